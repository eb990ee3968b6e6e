"""Regenerate the tables in docs/benchmarks.md from benchmarks/results/*.json.

Each benchmark writes its figures to `benchmarks/results/<name>.json` (`record.py`) and calls this
module, so the docs always show the newest run. docs/benchmarks.md marks where each table goes:

    <!-- results:weight_sync -->
    ...generated, do not edit...
    <!-- /results:weight_sync -->

    python benchmarks/render_results.py           # rewrite the tables in docs/benchmarks.md
    python benchmarks/render_results.py --check   # exit 1 if a table is stale or a block missing
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
RESULTS_DIR = HERE / "results"
DOCS = HERE.parent / "docs" / "benchmarks.md"
BLOCK = re.compile(
    r"(<!-- results:(?P<name>[a-z0-9_]+) -->\n)(?P<body>.*?)(<!-- /results:(?P=name) -->)", re.S
)


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(row) + " |" for row in rows]
    return out


def _num(x: Any, fmt: str = ".3g") -> str:
    if x is None:
        return "—"
    if isinstance(x, int) and fmt == ".3g":  # counts stay counts (1024, not 1.02e+03)
        return str(x)
    if isinstance(x, (int, float)):
        return format(x, fmt)
    return str(x)


def _ratio(value: Any, base: Any, fmt: str = ".2f") -> str:
    if value is None or not base:
        return "—"
    return format(value / base, fmt)


# ---------------------------------------------------------------- one renderer per benchmark
def engine_vs_hf(r: dict[str, Any]) -> list[str]:
    labels = {
        "hf_generate": "`generate` (tok/s)",
        "embedded": "embedded",
        "in_process_float32": "serving fp32, in process",
        "http_float32": "fp32 over HTTP",
        "in_process_bfloat16": "serving bf16, in process",
        "http_bfloat16": "bf16 over HTTP",
    }
    tps = r["tokens_per_s"]
    names = list(next(iter(tps.values())))
    rows = []
    for preset, row in tps.items():
        base = row.get("hf_generate")
        cells = [f"{_num(row[n], '.0f')} ({_ratio(row[n], base)}×)" for n in names[1:]]
        rows.append([preset, _num(base, ".0f"), *cells])
    out = _table(["preset", *(labels.get(n, n) for n in names)], rows)
    w = r.get("workload", {})
    out += [
        "",
        f"Decode tokens/s (× `generate` in brackets); batch {w.get('batch')} × "
        f"{w.get('prompt_tokens')}-token prompts × {w.get('new_tokens')} new tokens, sampling with "
        f"log-probs. Target: ≥ {r.get('target')}× `generate`.",
    ]
    ceilings = r.get("ceiling_vs_hf_generate")
    if ceilings:
        text = "; ".join(
            f"{p} " + ", ".join(f"{d} {_num(x, '.2f')}×" for d, x in c.items())
            for p, c in ceilings.items()
        )
        out += [
            "",
            "Ceiling on this machine (the workload's GEMMs and attention alone, no other op, "
            f"against `generate`): {text}.",
        ]
    return out


def prefix_cache(r: dict[str, Any]) -> list[str]:
    sec = r.get("seconds", {})
    by_turn = r.get("hit_rate_by_turn")
    turns = (
        f"{by_turn[0]:.3f} on the first turn, then {_span(by_turn[1:])}"
        if by_turn and len(by_turn) > 1
        else r.get("hit_rate_by_turn_summary", "—")
    )
    out = _table(
        [
            "preset",
            "sessions × turns",
            "hit rate",
            "per turn",
            "prompt tokens",
            "s with reuse",
            "s without",
            "speed-up",
        ],
        [
            [
                str(r.get("preset")),
                f"{r.get('sessions')} × {r.get('turns')}",
                _num(r.get("prefix_cache_hit_rate"), ".4f"),
                turns,
                _num(r.get("prompt_tokens"), ",d") if r.get("prompt_tokens") else "—",
                _num(sec.get("on"), ".2f"),
                _num(sec.get("off"), ".2f"),
                f"{_num(r.get('speedup_from_prefix_cache'), '.1f')}×",
            ]
        ],
    )
    return out


def _span(values: list[float]) -> str:
    lo, hi = f"{min(values):.3f}", f"{max(values):.3f}"
    return lo if lo == hi else f"{lo}–{hi}"


def weight_sync(r: dict[str, Any]) -> list[str]:
    gbps, frac = r["gbps"], r["fraction_of_memcpy"]
    transports = list(next(iter(frac.values())))
    rows = []
    for preset, row in gbps.items():
        mb = r.get("bytes", {}).get(preset)
        cells = [f"{_num(row[t], '.2f')} ({_num(frac[preset][t], '.2f')})" for t in transports]
        rows.append(
            [preset, _num(mb / 1e6 if mb else None, ".1f"), _num(row["memcpy"], ".1f"), *cells]
        )
    out = _table(["preset", "MB", "memcpy GB/s", *transports], rows)
    out += ["", "GB/s per push (fraction of memcpy in brackets).", ""]
    raw = r.get("fraction_of_raw")
    if raw:  # the group transports against a raw torch.distributed call of the same bytes
        wire = list(next(iter(raw.values())))
        raw_rows = [
            [
                preset,
                *(
                    f"{_num(gbps[preset][t], '.2f')} / {_num(gbps[preset].get(t + '_raw'), '.2f')}"
                    f" ({_num(raw[preset][t], '.2f')})"
                    for t in wire
                ),
                *(
                    [_num(bound.get(preset, {}).get(t), ".2f") for t in wire]
                    if (bound := r.get("flatten_bound_of_raw"))
                    else []
                ),
            ]
            for preset in raw
        ]
        bound_cols = (
            [f"{t}: raw + one flatten" for t in wire] if "flatten_bound_of_raw" in r else []
        )
        out += _table(["preset", *(f"{t} / raw {t} GB/s" for t in wire), *bound_cols], raw_rows)
        out += [
            "",
            "Transport GB/s against a raw `torch.distributed` broadcast (send for p2p) of the "
            "same bytes over the same group in the same run (fraction of raw in brackets).",
        ]
        if bound_cols:
            out += [
                "Raw + one flatten: the fraction of raw a push that flattens each bucket once "
                "(into kept buffers) can reach at most: raw time / (raw + flatten time), each "
                "measured alone in the same run.",
            ]
        out += [""]
    if r.get("shared_memory_bound"):
        bounds = ", ".join(
            f"{p} {_num(v, '.2f')} ({_num(r.get('round_trip_ms', {}).get(p), '.2f')} ms a call)"
            for p, v in r["shared_memory_bound"].items()
        )
        out += [
            "Shared memory at most (one memcpy of the bytes + one HTTP round trip to the engine "
            f"server, each measured alone in this run), as a fraction of memcpy: {bounds}.",
            "",
        ]
    delta_rows = [
        [
            preset,
            _num(r["delta_bytes_fraction"].get(preset), ".3f"),
            _num(r.get("delta_bytes_fraction_step10", {}).get(preset), ".3f"),
            _num(r.get("delta_bytes_fraction_fp32", {}).get(preset), ".3f"),
        ]
        for preset in r["delta_bytes_fraction"]
    ]
    out += _table(
        ["preset", "disk delta / full push, bf16, 1st step", "bf16, 10th step", "fp32, 1st step"],
        delta_rows,
    )
    lora = r.get("lora")
    if lora:  # a LoRA run's push: the adapter alone
        out += [""] + _table(
            ["preset", "targets", "adapter MB (rank 8)", "of a full push", "colocated ms",
             "shared memory ms"],
            [
                [
                    preset,
                    targets,
                    _num(row["bytes"] / 1e6, ".2f"),
                    _num(row["fraction_of_full"] * 100, ".2f") + " %",
                    _num(row["push_ms"]["colocated"], ".2f"),
                    _num(row["push_ms"]["shared_memory"], ".2f"),
                ]
                for preset, variants in lora.items()
                for targets, row in variants.items()
            ],
        )  # fmt: skip
        out += [
            "",
            "LoRA (train.lora rank 8; targets: attention = q/k/v/o_proj, all-linear = those and "
            "gate/up/down_proj): a push carries the adapter alone, checked bitwise on the "
            "engine after it. Per adapted projection the adapter is r·(1/in + 1/out) of its "
            "weight: these presets' widths (256, 512) make rank 8 a larger share than on a "
            "model thousands wide (a 512-wide square projection alone: 3.1 %; 4096 wide: "
            "0.39 %).",
        ]
        limit = r.get("targets", {}).get("lora_fraction_of_full")
        if limit:  # which targets meet it, at every preset
            by_targets: dict[str, list[str]] = {}
            for preset, variants in lora.items():
                for targets, row in variants.items():
                    by_targets.setdefault(targets, []).append(
                        f"{preset} {row['fraction_of_full'] * 100:.2f} %"
                    )
            met = {
                targets: all(row[targets]["fraction_of_full"] <= limit for row in lora.values())
                for targets in by_targets
            }
            out += [
                "",
                f"The target, a LoRA push ≤ {limit * 100:g} % of a full push at every preset: "
                + "; ".join(
                    f"{targets} adapters {'meet' if ok else 'miss'} it "
                    f"({', '.join(by_targets[targets])})"
                    for targets, ok in met.items()
                )
                + ".",
            ]
    t = r.get("targets", {})
    if t:
        out += [
            "",
            "Targets: shared_memory ≥ "
            f"{t.get('shared_memory')} of memcpy, broadcast ≥ {t.get('broadcast')}, "
            + (
                f"broadcast and p2p ≥ {t['fraction_of_raw']} of raw, "
                if "fraction_of_raw" in t
                else ""
            )
            + f"disk delta ≤ {t.get('delta_bytes_fraction')} of a full push"
            + (
                f", a LoRA push ≤ {t['lora_fraction_of_full'] * 100:g} % of it."
                if "lora_fraction_of_full" in t
                else "."
            ),
        ]
    return out


def async_vs_sync(r: dict[str, Any]) -> list[str]:
    sps = r["steps_per_s"]
    base = sps[r["sync_baseline"]]
    stale = r.get("mean_staleness_by_variant", {"fully_async": r.get("mean_staleness")})
    threads = r.get("threads", {})
    rows = [
        [
            f"**{name}**" if name == r["sync_baseline"] else name,
            _num(threads.get(name)),
            _num(v, ".2f"),
            _ratio(v, base),
            _num(stale.get(name), ".2f"),
            _num(r.get("reward_last5", {}).get(name), ".3f"),
        ]
        for name, v in sps.items()
    ]
    out = _table(
        ["variant", "threads", "steps/s", "× best sync", "mean staleness", "reward, last 5 steps"],
        rows,
    )
    out += [
        "",
        f"Preset {r.get('preset')}; the best sync variant (bold) is the baseline. Target: "
        f"fully_async ≥ {r.get('target')}× sync.",
    ]
    if len(r.get("runs", [])) > 1:
        each = r["runs"]

        def series(key: str) -> str:
            return ", ".join(_num(x.get(key), ".2f") for x in each)

        out += [
            "",
            f"{len(each)} comparisons in a row (the tables show the last): fully_async "
            f"{series('fully_async_over_sync')}× sync; one_step_off "
            f"{series('one_step_off_over_sync')}×.",
        ]
        if all("overlap_push_gain" in x for x in each):
            out[-1] += (
                " fully_async with the overlapped push over the same run waiting for each push: "
                f"{series('overlap_push_gain')}×."
            )
    if r.get("overlap_estimate_over_sync") is not None:
        one = r.get("cpu_s", {}).get("sync_1t", {})
        out += [
            "",
            "Overlap estimate for async on one core each: "
            f"{_num(r['overlap_estimate_over_sync'], '.2f')}× sync (the baseline's step against "
            "the larger of the two processes' CPU seconds per step at one thread each: engine "
            f"server {_num(one.get('engine'), '.3f')} s, trainer process "
            f"{_num(one.get('trainer'), '.3f')} s). Not a bound: the modes change the engine's work.",
        ]
    engine = r.get("engine_per_step")
    if engine:
        rows = [
            [
                name,
                _num(e.get("busy"), ".3f"),
                _num(e.get("steps"), ".1f"),
                _ratio(e.get("rows"), e.get("steps"), ".1f"),
            ]
            for name, e in engine.items()
        ]
        out += [
            "",
            *_table(
                [
                    "engine server, per trained step",
                    "s in engine steps",
                    "engine steps",
                    "requests per engine step",
                ],
                rows,
            ),
        ]
    return out


def step_time(r: dict[str, Any]) -> list[str]:
    rows = []
    for preset, step in r["step_time_s"].items():
        ph = r.get("phase_s", {}).get(preset, {})
        rows.append(
            [
                preset,
                _num(step, ".3f"),
                _num(ph.get("rollout_s"), ".3f"),
                _num(ph.get("train_s"), ".3f"),
                _num(ph.get("weight_sync_s"), ".3f"),
                _num(ph.get("orchestration_s"), ".3f"),
                _pct(r.get("orchestration_share", {}).get(preset)),
                _pct(r.get("overhead_vs_plain", {}).get(preset), sign=True),
                _num(r.get("prefect_server_cpu_s_per_step", {}).get(preset), ".2f"),
            ]
        )
    out = _table(
        [
            "preset",
            "flow step s",
            "rollout s",
            "train s",
            "weight sync s",
            "orchestration s",
            "orchestration share",
            "flow vs plain loop",
            "Prefect server CPU-s / step",
        ],
        rows,
    )
    out += ["", f"Mean of {r.get('steps_measured')} measured steps per preset."]
    return out


def _pct(x: Any, sign: bool = False) -> str:
    if x is None:
        return "—"
    return f"{x * 100:+.1f} %" if sign else f"{x * 100:.1f} %"


def session_load(r: dict[str, Any]) -> list[str]:
    lat = r.get("latency_s", {})
    return _table(
        [
            "sessions × turns",
            "requests",
            "errors",
            "p50 s",
            "p90 s",
            "p99 s",
            "turns/s",
            "branches",
            "TITO token edits",
        ],
        [
            [
                f"{r.get('sessions')} × {r.get('turns')}",
                _num(r.get("requests")),
                _num(r.get("errors")),
                _num(lat.get("p50"), ".2f"),
                _num(lat.get("p90"), ".2f"),
                _num(lat.get("p99"), ".2f"),
                _num(r.get("turns_per_s"), ".0f"),
                _num(r.get("branches")),
                _num(r.get("tito_token_edits", r.get("mismatched_tokens"))),
            ]
        ],
    )


def vs_trl(r: dict[str, Any]) -> list[str]:
    labels = {"trl": "TRL `GRPOTrainer`", "miles_embedded": "ours, embedded engine"}
    labels["miles_serving"] = "ours, serving engine"
    threshold = r.get("threshold")
    rows = []
    for preset, d in r["presets"].items():
        base = d["trl"]["s_per_step"]
        size = f"{preset} ({d['params'] / 1e6:.2f}M)" if d.get("params") else preset
        for side in [k for k in d if k == "trl" or k.startswith("miles_")]:
            s = d[side]
            phases = ", ".join(
                f"(of which generate {v:.3f})"
                if k == "rollout_generate"
                else f"{k.replace('_', ' ')} {v:.3f}"
                for k, v in s["phase_s"].items()
            )
            steps = s["steps_to_threshold"]
            rows.append(
                [
                    size,
                    labels.get(side, side),
                    _num(s["s_per_step"], ".3f"),
                    f"**{_ratio(s['s_per_step'], base)}**" if side != "trl" else "1",
                    phases,
                    ", ".join("—" if x is None else str(x) for x in steps),
                    _num(s["reward_last5"][0], ".3f"),
                    _num(s.get("mean_length"), ".1f"),
                    ", ".join(f"{x:.0f}" for x in s.get("outside_steps_s_by_round", [])) or "—",
                    f"{d['rounds']} × {d['steps']}",
                    _num(d.get("measured_at", "")[:16].replace("T", " ")),
                ]
            )
    out = _table(
        [
            "preset",
            "side",
            "s/step",
            "× TRL",
            "phases, median s",
            f"steps to reward ≥ {threshold}, per round",
            "reward, last 5 steps",
            "tokens / completion",
            "s outside the steps, per round",
            "rounds × steps",
            "measured (UTC)",
        ],
        rows,
    )
    w = r.get("workload", {})
    out += [
        "",
        "Median s/step over the timed steps of the interleaved rounds; "
        f"{w.get('prompts_per_step')} prompts × {w.get('samples_per_prompt')} samples × "
        f"{w.get('max_new_tokens')} new tokens, constant lr {w.get('lr')}; —: not reached within "
        "the run; s outside the steps: the process's wall time less its steps (start, imports, "
        "Prefect and MLflow start-up, model load, final checkpoint, exit). Target: ≤ "
        f"{r.get('target')}× TRL's s/step, same steps to the threshold within noise.",
    ]
    return out


def agentic_async(r: dict[str, Any]) -> list[str]:
    runs = r["by_variant"]
    base = runs["sync"]["steps_per_s"]
    rows = [
        [
            name,
            _num(v["steps_per_s"], ".3f"),
            _ratio(v["steps_per_s"], base),
            _num(v["median_step_s"], ".2f"),
            f"{_num(v['lag_mean'], '.2f')} / {_num(v['lag_max'], '.0f')}",
            f"{_num(v['active_episodes'], '.1f')} / {v['limit']} "
            f"({_num(v['active_fraction'], '.2f')})",
            _num(v["active_requests"], ".1f"),
            _num(v["prefix_cache_hit_rate"], ".3f"),
            _num(v.get("session_prefix_rate"), ".3f"),
            _num(v["turns_mean"], ".2f"),
            _num(v.get("cpu_busy"), ".2f"),
            _num(v["success_ma9_last"], ".3f"),
            f"{_num(v.get('episode_s'), '.2f')} ({_num(v.get('model_s'), '.2f')}, "
            f"{_num(v.get('sandbox_s'), '.2f')})",
        ]
        for name, v in runs.items()
    ]
    out = _table(
        [
            "variant",
            "steps/s",
            "× sync",
            "median step s",
            "lag mean / max",
            "active episodes / limit",
            "requests running",
            "prefix hit (2 engines)",
            "session prefix",
            "turns",
            "CPU busy",
            "success, 9-step avg",
            "episode s (model, sandbox)",
        ],
        rows,
    )
    t = r.get("targets", {})
    out += [
        "",
        f"Targets: fully_async ≥ {t.get('fully_async_over_sync')}× sync, active episodes ≥ "
        f"{t.get('active_fraction')} of the limit, prefix-cache hit rate ≥ {t.get('prefix_hit')}.",
    ]
    if r.get("cpu_ceiling_over_sync"):
        out += [
            "",
            f"Sync keeps the machine's CPU {runs['sync']['cpu_busy']:.0%} busy, so overlapping "
            f"can gain at most {_num(r['cpu_ceiling_over_sync'], '.2f')}× at the same work per "
            "step.",
        ]
    return out


def routing_replay(r: dict[str, Any]) -> list[str]:
    base = r["step_s"]["plain"]
    out = _table(
        ["trainer", "train step s", "vs plain"],
        [[k, _num(v, ".3f"), _ratio(v, base, ".3f")] for k, v in r["step_s"].items()],
    )
    out += [""]
    out += _table(
        ["weights", "routing mismatch", "log-prob gap without replay", "log-prob gap with replay"],
        [
            [
                label,
                _num(m["mismatch"], ".4f"),
                _num(m["lp_diff_plain"], ".5f"),
                _num(m["lp_diff_replay"], ".5f"),
            ]
            for label, m in (("the engine's", r["same_weights"]), ("one step on", r["one_step_on"]))
        ],
    )
    out += [
        "",
        f"Replay overhead {r['replay_overhead']:+.1%} of the train step (target ≤ "
        f"{r['targets']['replay_overhead']:.0%}); the record weighs "
        f"{r['record_bytes_per_token']:g} bytes per token ({r['bytes_per_position']} per "
        f"position: (T − 1)·L·k·4); {r['rows']} rows, {r['tokens']} tokens.",
    ]
    return out


def true_on_policy(r: dict[str, Any]) -> list[str]:
    rows = []
    for preset, m in r["presets"].items():
        t, s, g = m["tokens_per_s"], m["step_s"], m["logprob_gap"]
        rows.append(
            [
                preset,
                _num(t["plain"], ".0f"),
                _num(t["invariant"], ".0f"),
                _ratio(t["plain"], t["invariant"]),
                _num(s["plain"], ".3f"),
                _num(s["invariant"], ".3f"),
                _ratio(s["invariant"], s["plain"]),
                _num(g["plain"], ".2e"),
                _num(g["invariant"], ".2e"),
            ]
        )
    out = _table(
        [
            "preset",
            "engine tok/s",
            "with the mode",
            "engine cost ×",
            "train step s",
            "with the mode",
            "train cost ×",
            "log-prob gap",
            "with the mode",
        ],
        rows,
    )
    return out + [
        "",
        f"{r['rows']} rows of up to {r['max_new_tokens']} new tokens; goal: the mode costs "
        "≤ 1.25× engine and train time.",
    ]


def precision(r: dict[str, Any]) -> list[str]:
    out: list[str] = []
    for task in ("say_a", "reverse"):
        if task not in r:
            continue
        s = r[task]
        rows = []
        for name, v in s["variants"].items():
            dev = next(v[k] for k in v if k.startswith("max_dev"))
            rows.append(
                [
                    name,
                    _num(v["final_reward"], ".3f"),
                    _num(dev, ".3f"),
                    "yes" if v["within_tolerance"] else "no",
                    _num(v["gap_mean"], ".2e"),
                ]
            )
        out += [
            f"{task}: {s['seeds']} seed(s), reward of the last 5 steps, largest distance of the "
            f"mean curve from bf16's (tolerance ±{s['tolerance']}), mean log-prob gap:",
            "",
            *_table(["variant", "final reward", "max dev", "within", "log-prob gap"], rows),
            "",
        ]
    push, speed = r["push"], r["engine_tokens_per_s"]
    rows = [
        [
            name,
            _num(p["bytes"] / 1e6, ".2f"),
            _ratio(push["fp32"]["bytes"], p["bytes"]),
            _num(p.get("quantize_ms", "—"), ".1f"),
            _num(p.get("load_ms", "—"), ".1f"),
            _num(speed.get(name, "—"), ".0f"),
        ]
        for name, p in push.items()
    ]
    rows.append(["bf16 compute", "", "", "", "", _num(speed["bf16 compute"], ".0f")])
    return out + _table(
        ["format", "push MB", "smaller than fp32 ×", "quantize ms", "load ms", "engine tok/s"],
        rows,
    )


def _generic(r: dict[str, Any]) -> list[str]:
    return _table(["key", "value"], [[f"`{k}`", f"`{json.dumps(v)}`"] for k, v in r.items()])


def trainer_backends(r: dict[str, Any]) -> list[str]:
    rows = []
    for preset, per_world in r["step_time_s"].items():
        for ranks, times in per_world.items():
            base = times.get("fsdp")
            for label, t in times.items():
                rows.append([preset, ranks.split("_")[0], label, _num(t, ".3f"), _ratio(t, base)])
    return _table(["preset", "ranks", "trainer", "train step s", "vs FSDP2"], rows)


def time_to_result(r: dict[str, Any]) -> list[str]:
    labels = {
        "miles": "`miles train` (Prefect server kept)",
        "trl": "TRL `GRPOTrainer`",
        "miles_servers": "`miles train`, 2 engine servers + router",
        "miles_server_stopped": "`miles train`, no server running",
        "miles_new_home": "`miles train`, new PREFECT_HOME",
    }
    phases = ("to_main", "checks", "orchestration", "setup", "steps", "finish", "exit")
    rows = []
    for preset, d in r["presets"].items():
        trl = d["sides"]["trl"]["wall_s_median"]
        size = f"{preset} ({d['params'] / 1e6:.2f}M)" if d.get("params") else preset
        for side, s in {**d["sides"], **d.get("cold", {})}.items():
            ratio = _ratio(s["wall_s_median"], trl)
            rows.append(
                [
                    size,
                    labels.get(side, side),
                    _num(s["wall_s_median"], ".1f"),
                    ratio if side == "trl" else f"**{ratio}**",
                    _num(s["to_first_step_s"], ".1f"),
                    _num(s["s_per_step"], ".3f"),
                    *(_num(s["phases_s"][p], ".2f") for p in phases),
                    f"{len(s['wall_s'])} × {d['steps']}",
                ]
            )
    out = _table(
        [
            "preset",
            "side",
            "wall s",
            "× TRL",
            "first step at s",
            "s/step",
            *(p.replace("_", " ") for p in phases),
            "runs × steps",
        ],
        rows,
    )
    t = r.get("targets", {})
    out += [
        "",
        "Seconds from the spawn of the process to its exit (median of the runs), and its phases "
        "from the marks it writes (benchmarks/time_to_result.py; —: a phase that side does not "
        "have, its time counted in the next). Targets: wall ≤ "
        f"{t.get('wall_vs_trl')}× TRL's, the first step within {t.get('to_first_step_s')} s, "
        f"the exit within {t.get('exit_after_summary_s')} s of the result line.",
    ]
    return out


def lora(r: dict[str, Any]) -> list[str]:
    runs = r.get("rss_runs", 1)
    held = any("trainer_held_mb" in m for modes in r["memory"].values() for m in modes.values())

    def rss(m: dict[str, Any], key: str) -> str:
        reads = m.get(f"{key}_runs")
        lo, hi = (f"{min(reads):.0f}", f"{max(reads):.0f}") if reads else ("", "")
        return _num(m.get(key), ".0f") + (f" ({lo}–{hi})" if lo != hi else "")

    mem_rows = [
        [
            preset,
            mode,
            f"{m['trained_params']:,}",
            _num(m["grad_bytes"] / 1e6, ".2f"),
            _num(m["optimizer_bytes"] / 1e6, ".2f"),
            rss(m, "trainer_rss_mb"),
            *([rss(m, "trainer_held_mb")] if held else []),
            rss(m, "peak_rss_mb"),
        ]
        for preset, modes in r["memory"].items()
        for mode, m in modes.items()
    ]
    out = _table(
        ["preset", "training", "trained params", "gradients MB", "AdamW state MB",
         "trainer RSS MB", *(["trainer held MB"] if held else []), "peak RSS MB"],
        mem_rows,
    )  # fmt: skip
    out += [
        "",
        "One RL train step in a fresh process: full fine-tuning against rank-8 adapters on "
        "every linear layer (gradients and optimizer state exist only for what trains). Trainer "
        "RSS: what building the trainer and its step added to the process"
        + (
            "; held: the same after glibc's `malloc_trim` has handed back the free heap (the "
            "step's freed activations, which the C heap keeps in some processes and not in "
            "others), i.e. what the trainer holds"
            if held
            else ""
        )
        + "; peak RSS includes the imports (peft's, in both). "
        + (
            f"Each the median of {runs} fresh processes per preset and mode (their range in "
            "brackets)."
            if runs > 1
            else "One process each."
        ),
        "",
    ]
    target = r["target_reward"]
    rows = []
    for mode, per_seed in r["steps_to_target"].items():
        for seed, steps in per_seed.items():
            rewards = r["rewards"][mode][seed]
            rows.append(
                [mode, seed, "never" if steps is None else str(steps), _num(rewards[-1], ".3f")]
            )
    out += _table(["training", "seed", f"first step with reward ≥ {target}", "last reward"], rows)
    out += [
        "",
        f"`{r['example']}` (rank 8, small preset) and the same run without `train.lora` at the "
        "full fine-tuning learning rate, same seeds.",
    ]
    multi = r.get("multi_lora")
    if multi:
        seeds = multi.get("seeds") or {str(multi["seed"]): {"rewards": multi["rewards"]}}
        rows = [
            [
                name,
                seed,
                _num(sum(c[:5]) / 5, ".3f"),
                _num(sum(c[-5:]) / 5, ".3f"),
                str(len(c)),
                _num(run.get("wall_s"), ".0f"),
            ]
            for seed, run in seeds.items()
            for name, c in run["rewards"].items()
        ]
        out += [""] + _table(
            ["adapter", "seed", "reward, first 5 steps", "last 5 steps", "steps", "run s"], rows
        )
        out += [
            "",
            f"`{multi['example']}`: two adapters on one SFT-warm-started base, each stepping on "
            "its own task's rows; run s: the whole run, SFT warm start included, on this machine.",
        ]
    return out


def distillation(r: dict[str, Any]) -> list[str]:
    share = f"{r['share']:.0%}"
    out = _table(
        ["arm", f"steps to {share} of the teacher, per seed", "final score", "KL first → last"],
        [
            [
                arm,
                ", ".join("—" if x is None else str(x) for x in v["steps_to_target"]),
                _num(v["final_score"]),
                f"{v['kl_first']:.3f} → {v['kl_last']:.3f}",
            ]
            for arm, v in r["summary"].items()
        ],
    )
    teacher = ", ".join(f"{x:.3f}" for x in r["teacher_score"])
    out += [
        "",
        f"Student: {r.get('student', 'tiny')} after {r.get('student_sft_steps', 0)} SFT steps, "
        f"{r['steps']} steps at lr {r['lr']:g}, seeds {r['seeds']}; teacher score {teacher}. "
        + (
            f"The distillation arms use both terms: the sampled-token advantage term and the "
            f"dense term over the teacher's top {r['kd_top_k']} (`kd_top_k`)."
            if r.get("kd_top_k")
            else "The distillation arms use the sampled-token advantage term."
        ),
    ]
    return out


def diffusion_rl(r: dict[str, Any]) -> list[str]:
    def change(run: dict[str, Any], attribute: str, digits: int) -> str:
        h = run["held_out"][attribute]
        return f"{h['first']:.{digits}f} → {h['last']:.{digits}f}"

    out = _table(
        ["seed", "held-out all: pretrained → RL", "count", "shape", "position", "wall min"],
        [
            [
                str(run["seed"]),
                change(run, "all", 3),
                change(run, "count", 2),
                change(run, "shape", 2),
                change(run, "position", 2),
                f"{run['wall_s'] / 60:.1f}",
            ]
            for run in r["runs"]
        ],
    )
    out += [
        "",
        f"`{r['example']}`: {r['pretrain_steps']} pretraining steps, then {r['steps']} steps of "
        f"`{r['loss']}` on {r['images_per_step']} images each; the smallest gain over the "
        f"pretrained model is {r['min_gain']:+.3f}, the longest run {r['max_wall_s'] / 60:.1f} "
        "min from `miles train` to its exit.",
    ]
    return out


def optimizer_offload(r: dict[str, Any]) -> list[str]:
    base = r["modes"]["none"]
    out = _table(
        ["optimizer state", "peak RSS MB", "state held between steps MB", "step s", "weights"],
        [
            [
                mode,
                _num(m["peak_rss_mb"], ".0f"),
                _num(m["state_held_mb"], ".0f"),
                _num(m["step_s"], ".2f"),
                "bitwise the same" if m["weights_sha256"] == base["weights_sha256"] else "differ",
            ]
            for mode, m in r["modes"].items()
        ],
    )
    out += [
        "",
        f"The FSDP trainer on a {r['params'] / 1e6:.0f}M-parameter Qwen3, {r['steps']} SFT steps "
        f"per mode in a fresh process on one thread, {r['bucket_mb']} MB buckets; step s: the "
        "median after "
        "the first. On a CPU trainer `cpu` keeps the state where `none` does (host memory is "
        "the device's); on a GPU it moves it off the GPU. `disk` holds one bucket at a time: "
        f"peak RSS ×{r['disk_peak_rss_ratio']:.2f}, step time ×{r['disk_step_time_ratio']:.2f}.",
    ]
    return out


RENDERERS: dict[str, Callable[[dict[str, Any]], list[str]]] = {
    "engine_vs_hf": engine_vs_hf,
    "prefix_cache": prefix_cache,
    "weight_sync": weight_sync,
    "async_vs_sync": async_vs_sync,
    "agentic_async": agentic_async,
    "agentic_async_gpu": agentic_async,
    "step_time": step_time,
    "trainer_backends": trainer_backends,
    "routing_replay": routing_replay,
    "routing_replay_megatron": routing_replay,
    "true_on_policy": true_on_policy,
    "precision": precision,
    "lora": lora,
    "distillation": distillation,
    "diffusion_rl": diffusion_rl,
    "optimizer_offload": optimizer_offload,
    "session_load": session_load,
    "vs_trl": vs_trl,
    "time_to_result": time_to_result,
}


def _cpu(m: dict[str, Any]) -> str | None:
    """The processor, with the vector ISA and bf16 GEMMs where recorded: "AMD EPYC (AVX2)"."""
    if not m.get("processor"):
        return None
    if not m.get("cpu_capability"):
        return m["processor"]
    bf16 = ", bf16 GEMMs" if m.get("cpu_bf16_gemms") else ""
    return f"{m['processor']} ({m['cpu_capability']}{bf16})"


def provenance(payload: dict[str, Any]) -> str:
    m = payload.get("machine") or {}
    commit = (payload.get("git_commit") or {}).get("sha")
    where = m.get("description") or ", ".join(
        str(x)
        for x in (
            _cpu(m),
            f"{m['cpus_usable']} usable cores" if m.get("cpus_usable") else None,
            m.get("gpu"),
        )
        if x
    )
    parts = [f"Measured {payload.get('measured_at', '?')[:10]}"]
    if where:
        parts.append(f"on {where}")
    if commit:
        dirty = (payload.get("git_commit") or {}).get("dirty")
        parts.append(f"at commit `{commit[:10]}`" + (" with uncommitted changes" if dirty else ""))
    text = " ".join(parts) + f" (`{payload.get('command', '?')}`)."
    if payload.get("source") and payload["source"] != "measured by the benchmark":
        text += f" Source: {payload['source']}."
    return "_" + text + "_"


def render_block(name: str, results_dir: Path = RESULTS_DIR) -> str:
    path = results_dir / f"{name}.json"
    if not path.exists():
        return f"_Not measured yet: run `python benchmarks/{name}.py`._\n"
    payload = json.loads(path.read_text())
    lines = RENDERERS.get(name, _generic)(payload["result"])
    return "\n".join([*lines, "", provenance(payload), ""])


def render_text(text: str, results_dir: Path = RESULTS_DIR) -> str:
    return BLOCK.sub(
        lambda m: m.group(1) + render_block(m.group("name"), results_dir) + m.group(4), text
    )


def problems(text: str, results_dir: Path = RESULTS_DIR) -> list[str]:
    """What --check reports: results files without a block in the docs, blocks that are stale."""
    blocks = {m.group("name") for m in BLOCK.finditer(text)}
    out = [
        f"benchmarks/results/{p.name} has no '<!-- results:{p.stem} -->' block in docs/benchmarks.md"
        for p in sorted(results_dir.glob("*.json"))
        if p.stem not in blocks
    ]
    if render_text(text, results_dir) != text:
        out.append("docs/benchmarks.md is stale: run `python benchmarks/render_results.py`")
    return out


def render_docs(docs: Path = DOCS, results_dir: Path = RESULTS_DIR) -> bool:
    """Rewrite the generated blocks of `docs`; True when something changed."""
    if not docs.exists():
        return False
    text = docs.read_text()
    new = render_text(text, results_dir)
    if new != text:
        docs.write_text(new)
    return new != text


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if docs/benchmarks.md is stale")
    args = ap.parse_args()
    if args.check:
        found = problems(DOCS.read_text())
        for p in found:
            print(p, file=sys.stderr)
        return 1 if found else 0
    print("updated" if render_docs() else "up to date", DOCS)
    return 0


if __name__ == "__main__":
    sys.exit(main())
