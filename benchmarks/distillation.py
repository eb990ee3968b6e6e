"""What on-policy distillation is for: a student learns a task from a teacher's per-token
judgement, against the task reward alone.

1. The teacher: the small preset after SFT + RL on reverse (`examples/reverse_sft_rl.yaml`,
   trained here by `miles train`, or `--teacher DIR`). Its task score is the mean reward of its
   own samples (temperature 1) on the student's first prompts.
2. The student: a preset (`--student`, small by default) from random init, warm-started by a
   short SFT on reverse demonstrations (`--student-sft` steps, the teacher's SFT settings; far
   weaker than the teacher), the same init per seed in three arms, the same steps, prompts and
   learning rate:
       opd     pure distillation (advantage estimator none, train.distill)
       opd+rl  distillation + RL (GRPO advantages, train.distill)
       rl      RL alone (GRPO); the teacher still scores its samples, for the KL column only
   Per step: the task score (mean reward of the step's samples) and the KL to the teacher
   (`distill/kl`: the student's log-prob minus the teacher's over the sampled tokens).

Prints each step as it runs, a summary table (steps to 80 % of the teacher's score per seed,
final score, KL first → last), then one JSON object (with the per-step means over seeds).

    python benchmarks/distillation.py [--seeds 0,1,2] [--steps 60] [--lr 3e-4] [--teacher DIR]
                                      [--student small] [--student-sft 50]

Only a run of the three arms over three seeds or more is recorded (a partial one writes where
`MILES_BENCH_RESULTS_DIR` points, or nowhere).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
TEACHER_CONFIG = HERE.parent / "examples" / "reverse_sft_rl.yaml"
ARMS = ("opd", "opd+rl", "rl")
SHARE = 0.8  # the student's target: this share of the teacher's task score
WINDOW = 3  # steps averaged when testing the target (one step's 128 samples are noisy)

STUDENT = [
    "data.task=reverse",
    "rollout.prompts_per_step=16",
    "rollout.n_samples_per_prompt=8",
    "rollout.max_new_tokens=10",
    "rollout.temperature=1.0",
    "train.global_batch_size=128",
    "train.micro_batch_size=64",
]


def train_teacher(workdir: Path) -> Path:
    """`miles train` on examples/reverse_sft_rl.yaml; the directory of its final checkpoint."""
    root = workdir / "teacher"
    miles = Path(sys.executable).with_name("miles")  # the CLI of this environment
    cmd = [str(miles), "train", "--config", str(TEACHER_CONFIG)]
    cmd += ["--set", f"checkpoint.root={root}", "--set", "checkpoint.overwrite=true"]
    cmd += ["--set", f"tracking.tracking_uri=sqlite:///{workdir}/teacher-mlflow.db"]
    env = os.environ | {"PREFECT_LOGGING_LEVEL": "WARNING"}
    subprocess.run(cmd, check=True, cwd=workdir, env=env, stdout=subprocess.DEVNULL)
    steps = sorted((root / "reverse").glob("step_*"))
    return steps[-1]


def teacher_score(teacher: Path, seed: int, prompts: int) -> float:
    """The teacher's mean reward on `prompts` reverse prompts, 8 samples each at temperature 1,
    from the data the student's runs draw (seed `seed`)."""
    from miles_core.config import load_config
    from miles_core.data import TASKS, PromptSource, rl_examples
    from miles_core.engines.cpu.embedded import EmbeddedEngine
    from miles_core.models import load_hf_dir
    from miles_core.rollout.rollout_fn import generate_groups

    cfg = load_config(None, [*STUDENT, f"seed={seed}", f"rollout.prompts_per_step={prompts}"])
    model, tok = load_hf_dir(teacher)
    source = PromptSource(rl_examples(cfg), seed=cfg.data.seed, shuffle=cfg.data.shuffle)
    batch = source.next_batch(prompts)
    engine = EmbeddedEngine(model, tok, seed=seed)
    result = generate_groups(engine, tok, TASKS.get("reverse"), batch, cfg.rollout, 0)
    return statistics.fmean(s.reward for s in result.samples)


def student_init(preset: str, seed: int, sft_steps: int, workdir: Path) -> Path:
    """`preset` from random init (seed `seed`), after `sft_steps` SFT steps on reverse
    demonstrations (0: the random init itself)."""
    from miles_core.config import load_config
    from miles_core.run.runtime import prepare_model_dir
    from miles_core.train.sft import run_sft

    sets = [*STUDENT, f"model.preset={preset}", f"seed={seed}", f"model.seed={seed}"]
    sets += [f"checkpoint.root={workdir}/sft"]
    sets += [f"name=student-{seed}"]
    if sft_steps:
        sets += ["sft.task=reverse", f"sft.num_steps={sft_steps}", "sft.num_examples=4096"]
        sets += ["sft.batch_size=64", "sft.micro_batch_size=64", "sft.lr=1e-3"]
        sets += ["sft.lr_warmup_steps=10"]  # the teacher's SFT settings (reverse_sft_rl.yaml)
    cfg = load_config(None, sets)
    init = prepare_model_dir(cfg, workdir / f"random-{seed}")
    return Path(run_sft(cfg, init, None)) if sft_steps else init


def run_arm(
    arm: str,
    seed: int,
    steps: int,
    lr: float,
    teacher: Path,
    init: Path,
    workdir: Path,
    kd_top_k: int = 0,
) -> dict:
    """One student run in this process: per step its task score and its KL to the teacher."""
    from miles_core.config import load_config
    from miles_core.distill.teachers import TeacherFleet
    from miles_core.run.runtime import RLRuntime, prepare_model_dir

    sets = [*STUDENT, f"seed={seed}", f"model.path={init}", f"train.num_steps={steps}"]
    sets += [
        f"train.lr={lr}",
        f"checkpoint.root={workdir / 'ckpt'}",
        f"name={arm.replace('+', '-')}-{seed}",
    ]
    if arm.startswith("opd"):
        sets.append(f"train.distill={{teachers: {{default: {teacher}}}, kd_top_k: {kd_top_k}}}")
    if arm == "opd":
        sets.append("train.advantage_estimator=none")
    cfg = load_config(None, sets)
    rt = RLRuntime(cfg, prepare_model_dir(cfg, workdir / f"start-{arm}-{seed}"), None)
    judge = rt.teachers
    if judge is None:  # RL alone: the teacher scores its samples for the KL column, no more
        judge = TeacherFleet(
            load_config(
                None, [f"train.distill={{teachers: {{default: {teacher}}}}}"]
            ).train.distill,
            cfg.rollout.temperature,
            rt.workdir,
            api_key=rt.fleet.api_key,
        )
        rt.rollouts.group_hooks.append(judge.score)
    scores, kls = [], []
    try:
        for step in range(steps):
            result = rt.rollout(step)
            scores.append(statistics.fmean(s.reward for s in result.samples))
            kls.append(judge.metrics(result.samples)["distill/kl"])
            rt.train(result)
            rt.update_weights()
            print(f"  {arm} seed {seed} step {step}: score {scores[-1]:.3f} kl {kls[-1]:.3f}")
    finally:
        if judge is not rt.teachers:
            judge.close()
        rt.close()
    return {"score": scores, "kl": kls}


def steps_to(scores: list[float], target: float) -> int | None:
    """The first step whose mean score over the last `WINDOW` steps reaches `target`."""
    for i in range(WINDOW - 1, len(scores)):
        if statistics.fmean(scores[i - WINDOW + 1 : i + 1]) >= target:
            return i
    return None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--teacher", default=None, help="a trained teacher's model directory")
    ap.add_argument("--arms", default=",".join(ARMS))
    ap.add_argument("--student", default="small", help="the student's model preset")
    ap.add_argument("--student-sft", type=int, default=50, help="SFT steps of the student init")
    ap.add_argument(
        "--kd-top-k",
        type=int,
        default=8,
        help="train.distill.kd_top_k of the distillation arms (0: the advantage term alone)",
    )
    args = ap.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    arms = args.arms.split(",")
    with tempfile.TemporaryDirectory(prefix="miles-distill-bench-") as tmp:
        work = Path(tmp)
        teacher = Path(args.teacher) if args.teacher else train_teacher(work)
        target_of = {s: teacher_score(teacher, s, 64) for s in seeds}
        inits = {s: student_init(args.student, s, args.student_sft, work) for s in seeds}
        runs = {
            a: {
                s: run_arm(a, s, args.steps, args.lr, teacher, inits[s], work, args.kd_top_k)
                for s in seeds
            }
            for a in arms
        }
    summary = {}
    print(f"\nteacher score: {', '.join(f'{target_of[s]:.3f}' for s in seeds)} (seeds {seeds})")
    print(
        f"| arm | steps to {SHARE:.0%} of the teacher (per seed) | final score | KL first → last |"
    )
    print("|---|---|---|---|")
    for a in arms:
        reached = [steps_to(runs[a][s]["score"], SHARE * target_of[s]) for s in seeds]
        final = statistics.fmean(statistics.fmean(runs[a][s]["score"][-WINDOW:]) for s in seeds)
        kl0 = statistics.fmean(runs[a][s]["kl"][0] for s in seeds)
        kl1 = statistics.fmean(statistics.fmean(runs[a][s]["kl"][-WINDOW:]) for s in seeds)
        summary[a] = {
            "steps_to_target": reached,
            "final_score": final,
            "kl_first": kl0,
            "kl_last": kl1,
        }
        shown = ", ".join("—" if r is None else str(r) for r in reached)
        print(f"| {a} | {shown} | {final:.3f} | {kl0:.3f} → {kl1:.3f} |")
    result = {
        "seeds": seeds,
        "steps": args.steps,
        "lr": args.lr,
        "student": args.student,
        "student_sft_steps": args.student_sft,
        "kd_top_k": args.kd_top_k,
        "teacher_score": [target_of[s] for s in seeds],
        "share": SHARE,
        "summary": summary,
        "per_step": {
            a: {
                "score": [
                    statistics.fmean(runs[a][s]["score"][i] for s in seeds)
                    for i in range(args.steps)
                ],
                "kl": [
                    statistics.fmean(runs[a][s]["kl"][i] for s in seeds) for i in range(args.steps)
                ],
            }
            for a in arms
        },
    }
    print(json.dumps(result))
    full = set(arms) == set(ARMS) and len(seeds) >= 3
    if not full and not os.environ.get("MILES_BENCH_RESULTS_DIR"):
        print("a partial run (fewer arms or seeds than three): not recorded", file=sys.stderr)
        return
    from record import record_result  # benchmarks/record.py: results/<name>.json + docs

    record_result("distillation", result)


if __name__ == "__main__":
    main()
