"""SGLang's prompt scoring on our engines: `logprob_start_len` k asks for the log-probs of the
request's own input ids from position k on, in `meta_info.input_token_logprobs`.

The layout is SGLang's: one `[logprob, token_id, None]` entry per input position k..L-1, and
the first entry is a placeholder whose log-prob is None (its context is not scored). So a
teacher scoring a student's response of R tokens after a P-token prompt sends the whole
sequence with k = P - 1 and reads entries 1..R. k = -1 asks for nothing, k = L for an empty
list; k > L is refused (`wire.validate_request`).

With `top_logprobs_num` n each scored position also lists its n likeliest tokens
(`input_top_logprobs`), and with `token_ids_logprob` the log-probs of those ids
(`input_token_ids_logprobs`), first entry None likewise: what a top-k distillation needs from
both sides.

The values come from one forward over the whole sequence, then log_softmax(logits / T) at each
scored position: with `true_on_policy` the model family's invariant forward and the trainer's
tempered log-softmax, so they are the trainer's `compute_log_probs` bits for the same tokens;
otherwise the model's own forward (fp32). T is `input_logprob_temperature` (ours; default 1,
what SGLang uses for input positions whatever the sampling temperature), echoed in the reply so
a caller can check both sides scored at the same temperature.
"""

from __future__ import annotations

import torch

from miles_core.engines.wire import EngineRequestError, GenerateRequest
from miles_core.true_on_policy import ops


def asked(req: GenerateRequest) -> bool:
    return req.logprob_start_len >= 0


def check_scoring(req: GenerateRequest) -> None:
    """The scoring part of a request this engine cannot serve, as an EngineRequestError."""
    if asked(req) and req.lora_path is not None:
        raise EngineRequestError(
            "logprob_start_len with lora_path: scoring input ids with an adapter is not built "
            "(score with the base model, or leave logprob_start_len at -1)"
        )


class PromptScorer:
    """Computes `input_token_logprobs` for requests that ask: `invariant` is the model family's
    invariant forward (true on-policy), else the model's own forward runs."""

    def __init__(self, model: torch.nn.Module, invariant=None):
        self.model = model
        self.invariant = invariant

    def _logits(self, ids: torch.Tensor) -> torch.Tensor:
        """Logits [L, V] of one sequence, each position after the ones before it."""
        if self.invariant is not None:
            positions = torch.arange(ids.numel(), device=ids.device)
            return self.invariant.logits(ids[None], positions[None])[0]
        return self.model(input_ids=ids[None]).logits[0]

    @torch.inference_mode()
    def meta(self, req: GenerateRequest) -> dict:
        """The meta_info entries of `req`'s scoring ({} when it asks for none)."""
        if not asked(req):
            return {}
        ids, k = req.input_ids, req.logprob_start_len
        temperature = req.input_logprob_temperature or 1.0
        out: dict = {"input_token_logprobs": [], "input_logprob_temperature": temperature}
        if req.top_logprobs_num:
            out["input_top_logprobs"] = []
        if req.token_ids_logprob is not None:
            out["input_token_ids_logprobs"] = []
        if k >= len(ids):
            return out
        for key in out:  # the placeholder: the first scored position has no context
            if key != "input_logprob_temperature":
                out[key].append((None, ids[k], None) if key == "input_token_logprobs" else None)
        if k + 1 == len(ids):
            return out
        device = next(self.model.parameters()).device
        seq = torch.tensor(ids, dtype=torch.long, device=device)
        logits = self._logits(seq)[k : len(ids) - 1]
        if self.invariant is not None:
            lp = ops.tempered_log_softmax(logits, temperature)
        else:
            lp = torch.log_softmax(logits.float() / temperature, dim=-1)
        targets = seq[k + 1 :]
        values = lp.gather(-1, targets.unsqueeze(-1)).squeeze(-1).tolist()
        out["input_token_logprobs"] += [
            (v, t, None) for v, t in zip(values, ids[k + 1 :], strict=True)
        ]
        if req.top_logprobs_num:
            top = lp.topk(req.top_logprobs_num, dim=-1)
            out["input_top_logprobs"] += _rows(top.values, top.indices)
        if req.token_ids_logprob is not None:
            given = torch.tensor(req.token_ids_logprob, dtype=torch.long, device=device)
            at = lp[:, given]
            out["input_token_ids_logprobs"] += _rows(at, given.expand_as(at))
        return out


def _rows(values: torch.Tensor, ids: torch.Tensor) -> list[list[tuple[float, int, None]]]:
    """Per position, SGLang's [logprob, token_id, text] entries."""
    return [
        [(v, i, None) for v, i in zip(vs, is_, strict=True)]
        for vs, is_ in zip(values.tolist(), ids.tolist(), strict=True)
    ]
