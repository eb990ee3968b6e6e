"""The run's teachers: each an engine that scores the student's samples.

A teacher given as a model directory is served by an engine server this run starts on
127.0.0.1 (with the run's key, stopped by PID at close; in true on-policy mode with the
invariant forward, so a teacher equal to the student scores the trainer's bits). A teacher given
as a URL is attached to; it must answer at start.

`score(group)` scores each sample of a group with its teacher: the one its data row names in
`teacher_key`, else `default`. A sample that cannot be scored — its row names a teacher the run
does not have, the teacher is unreachable or refuses, its answer fails the checks of
`scoring.py` — becomes FAILED with the reason in its metadata, and trains nothing: never a
silent wrong teacher, and the run goes on. Scoring is called for each group as it completes
(the producer's thread in async modes, the trainer's in sync ones).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from miles_core.config.distill import DEFAULT_TEACHER, DistillSettings, is_url
from miles_core.distill import top_k
from miles_core.distill.field import TEACHER_LOG_PROBS, TOP_K_KL, kd_names
from miles_core.distill.scoring import (
    TeacherAnswerError,
    likeliest,
    position_entries,
    scoring_request,
    teacher_log_probs,
    top_entries,
)
from miles_core.engines.protocol import ProcessUnavailable
from miles_core.types import Sample, SampleGroup, Status

log = logging.getLogger("miles.distill")
ROW = "row"  # sample.metadata key of the data row's own fields (data/tasks.py: Example.fields)
ERROR = "distill_error"  # why a sample's teacher could not score it


@dataclass
class Teacher:
    name: str
    source: str  # a model directory or a URL
    engine: object  # HttpEngine
    process: object | None = None  # the EngineProcess this run started, if any


def teacher_name(sample: Sample, key: str) -> str:
    row = sample.metadata.get(ROW) or {}
    name = row.get(key)
    return DEFAULT_TEACHER if name is None else str(name)


class TeacherFleet:
    def __init__(
        self,
        settings: DistillSettings,
        temperature: float,
        workdir: Path,
        true_on_policy: bool = False,
        api_key: str | None = None,
        port_range=None,
        student=None,
    ):
        self.settings = settings
        self.temperature = temperature
        self.student = student  # the rollout engine: the student's side of a top-k KL
        self.teachers: dict[str, Teacher] = {}
        try:
            for name, source in settings.teachers.items():
                self.teachers[name] = _start(
                    name, source, workdir, true_on_policy, api_key, port_range
                )
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ scoring
    def score(self, group: SampleGroup) -> None:
        """Writes each sample's teacher log-probs (token field `teacher_log_probs`), or fails
        the sample with the reason."""
        by_teacher: dict[str, list[Sample]] = {}
        kd = self.settings.kd_top_k
        for s in group.samples:
            s.token_fields[TEACHER_LOG_PROBS.name] = np.zeros(s.response_length, np.float32)
            if self.settings.top_k:
                s.token_fields[TOP_K_KL.name] = np.zeros(s.response_length, np.float32)
            if kd:
                for name, dtype in zip(kd_names(kd), (np.int32, np.float32), strict=True):
                    s.token_fields[name] = np.zeros((s.response_length, kd), dtype)
            if s.status == Status.FAILED or s.response_length == 0:
                continue  # trains nothing: nothing to score
            name = teacher_name(s, self.settings.teacher_key)
            if name not in self.teachers:
                _fail(
                    s,
                    f"its data row names teacher {name!r} ({self.settings.teacher_key}), which "
                    f"this run does not have (teachers: {', '.join(self.teachers)})",
                )
                continue
            by_teacher.setdefault(name, []).append(s)
        for name, samples in by_teacher.items():
            teacher = self.teachers[name]
            k = max(self.settings.top_k, kd)  # each position's likeliest tokens, for both terms
            try:
                answers = teacher.engine.generate(
                    [scoring_request(s, self.temperature, k) for s in samples]
                )
            except (ProcessUnavailable, OSError, ValueError) as e:  # ValueError: refused
                for s in samples:
                    _fail(s, f"teacher {name} at {teacher.source} did not score it: {e}")
                continue
            scored = []
            for s, resp in zip(samples, answers, strict=True):
                try:
                    s.token_fields[TEACHER_LOG_PROBS.name] = teacher_log_probs(
                        s, resp, self.temperature
                    )
                    if kd:
                        top = position_entries(resp, "input_top_logprobs", s)
                        ids, log_probs = likeliest(top, kd)
                        s.token_fields.update(zip(kd_names(kd), (ids, log_probs), strict=True))
                    scored.append((s, resp))
                except TeacherAnswerError as e:
                    _fail(s, f"teacher {name}: {e}")
            if self.settings.top_k and scored:
                self._top_k(teacher, scored)

    def _top_k(self, teacher: Teacher, scored: list[tuple[Sample, object]]) -> None:
        """The top-k KL of each position (top_k.py) into token field `teacher_topk_kl`: the
        student's engine scores its own top-k (and the teacher's top-k tokens, where the set
        needs them), the teacher the student's top-k tokens where the set needs them."""
        k, strategy, T = self.settings.top_k, self.settings.top_k_strategy, self.temperature
        student_at_teacher, teacher_at_student = top_k.needs(strategy)
        samples = [s for s, _ in scored]
        try:
            t_top = [
                [top_entries(row, k) for row in position_entries(r, "input_top_logprobs", s)]
                for s, r in scored
            ]
            asked = [_ids(rows) if student_at_teacher else None for rows in t_top]
            answers = self.student.generate(
                [scoring_request(s, T, k, ids) for s, ids in zip(samples, asked, strict=True)]
            )
            s_top, s_at = [], []
            for s, resp in zip(samples, answers, strict=True):
                teacher_log_probs(s, resp, T)  # the student's answer passes the same checks
                s_top.append(position_entries(resp, "input_top_logprobs", s))
                s_at.append(
                    position_entries(resp, "input_token_ids_logprobs", s)
                    if student_at_teacher
                    else [{}] * s.response_length
                )
            t_at = [[{}] * s.response_length for s in samples]
            if teacher_at_student:
                more = teacher.engine.generate(
                    [
                        scoring_request(s, T, 0, _ids(rows))
                        for s, rows in zip(samples, s_top, strict=True)
                    ]
                )
                t_at = [
                    position_entries(r, "input_token_ids_logprobs", s)
                    for s, r in zip(samples, more, strict=True)
                ]
        except (ProcessUnavailable, OSError, ValueError) as e:  # refused, or a bad answer
            for s in samples:
                _fail(s, f"top-k scoring with teacher {teacher.name}: {e}")
            return
        for i, s in enumerate(samples):
            try:
                kl = [
                    top_k.position_kl(
                        strategy,
                        s_top[i][j] | s_at[i][j],
                        t_top[i][j] | t_at[i][j],
                        list(s_top[i][j]),
                        list(t_top[i][j]),
                    )
                    for j in range(s.response_length)
                ]
            except KeyError as e:  # an answer without the log-probs of tokens it was asked for
                _fail(s, f"top-k scoring with teacher {teacher.name}: {e}")
                continue
            s.token_fields[TOP_K_KL.name] = np.asarray(kl, dtype=np.float32)

    def metrics(self, samples: list[Sample]) -> dict[str, float]:
        """`distill/kl`: the mean over trained tokens of the student's rollout log-prob minus
        the teacher's (the sampled-token estimate of KL(student ‖ teacher)); the samples the
        teachers failed."""
        diff, tokens = 0.0, 0
        for s in samples:
            teacher = s.token_fields.get(TEACHER_LOG_PROBS.name)
            if teacher is None or s.status == Status.FAILED:
                continue
            mask = np.asarray(s.loss_mask, dtype=bool)
            student = np.asarray(s.rollout_log_probs, dtype=np.float64)
            diff += float((student - teacher)[mask].sum())
            tokens += int(mask.sum())
        failed = sum(ERROR in s.metadata for s in samples)
        return {"distill/kl": diff / max(tokens, 1), "distill/failed_samples": float(failed)}

    def close(self) -> None:
        for t in self.teachers.values():
            try:
                t.engine.close()
            finally:
                if t.process is not None:
                    t.process.stop()


def _ids(rows: list[dict[int, float]]) -> list[int]:
    """Every token id the positions' entries name, once."""
    return sorted({i for row in rows for i in row})


def _fail(sample: Sample, reason: str) -> None:
    sample.status = Status.FAILED
    sample.loss_mask = [0] * sample.response_length
    sample.metadata[ERROR] = reason
    sample.metadata.setdefault("error", f"distillation: {reason}")
    log.warning("sample %s failed: %s", sample.rollout_id, reason)


def _start(name, source, workdir: Path, true_on_policy, api_key, port_range) -> Teacher:
    from miles_core.engines.http import EngineProcess, HttpEngine

    if is_url(source):
        engine = HttpEngine(source, api_key=api_key)
        try:
            engine.server_info(timeout=10)
        except Exception as e:  # noqa: BLE001 — any failure to answer is "unreachable"
            engine.close()
            raise RuntimeError(
                f"train.distill.teachers.{name}: the teacher at {source} does not answer "
                f"({type(e).__name__}: {e}); start it, or fix the URL"
            ) from None
        return Teacher(name, source, engine)
    args = ["--threads", "1"] + (["--true-on-policy"] if true_on_policy else [])
    process = EngineProcess(
        source,
        args=args,
        log_path=workdir / f"teacher-{name}.log",
        port_range=port_range,
        api_key=api_key,
    ).start()
    return Teacher(name, source, HttpEngine(process.url, api_key=api_key), process)


def check_teachers(
    settings: DistillSettings, student_config: dict, student_tokenizer, rows: list
) -> None:
    """Before anything starts: each teacher directory is a model on the student's vocabulary
    (the same size and the same token → id map: a teacher scores the student's ids), and every
    data row's teacher is one the run has (`default` for the rows that name none). A URL
    teacher is checked when the run attaches to it."""
    import json

    for name, source in settings.teachers.items():
        if is_url(source):
            continue
        where = f"train.distill.teachers.{name} ({source})"
        config_file = Path(source) / "config.json"
        if not config_file.is_file():
            raise FileNotFoundError(f"{where}: not a model directory (no config.json)")
        teacher = json.loads(config_file.read_text())
        if teacher.get("vocab_size") != student_config.get("vocab_size"):
            raise ValueError(
                f"{where}: vocabulary of {teacher.get('vocab_size')} tokens, the student's has "
                f"{student_config.get('vocab_size')}: a teacher must score the student's token ids"
            )
        for key in ("top_k", "kd_top_k"):
            if getattr(settings, key) > int(student_config.get("vocab_size") or 0):
                raise ValueError(
                    f"train.distill.{key} {getattr(settings, key)} exceeds the vocabulary "
                    f"({student_config.get('vocab_size')} tokens)"
                )
        if student_tokenizer is not None:
            from transformers import AutoTokenizer

            theirs = AutoTokenizer.from_pretrained(source).get_vocab()
            ours = student_tokenizer.get_vocab()
            if theirs != ours:
                differ = sorted(set(theirs.items()) ^ set(ours.items()))[:3]
                raise ValueError(
                    f"{where}: its tokenizer maps tokens to other ids than the student's "
                    f"(e.g. {differ}): a teacher must score the student's token ids"
                )
    for i, ex in enumerate(rows, start=1):
        name = ex.fields.get(settings.teacher_key, DEFAULT_TEACHER)
        if name not in settings.teachers:
            said = f"names teacher {name!r}" if name != DEFAULT_TEACHER else "names no teacher"
            raise ValueError(
                f"data row {i} {said} ({settings.teacher_key!r}), and the run has no such "
                f"teacher (teachers: {', '.join(settings.teachers)}; 'default' takes the rows "
                "that name none)"
            )
