"""Bad input fails before anything starts, with a message that says what to fix."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from miles_core.config import load_config
from miles_core.data import DatasetError, read_jsonl
from miles_core.run.preflight import preflight

REPO = Path(__file__).resolve().parents[1]


SERVER = ["rollout.engine=server", "weight_sync.transport=shared_memory"]


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["train.global_batch_size=96"], "must be divisible by train.global_batch_size"),
        (["rollout.engine=carrier"], "unknown rollout engine 'carrier' in rollout.engine; known: "),
        (
            ["train.micro_batch_size=48"],
            r"must be divisible by micro_batch_size × data-parallel ranks \(48\)",
        ),
        (["train.world_size=3"], r"micro_batch_size × data-parallel ranks \(96\)"),
        (["data.task=translate"], "unknown task 'translate' in data.task; known: add, "),
        (["train.lr=0"], "train.lr"),
        (["train.lr=-1e-3"], "greater than 0"),
        (["rollout.n_samples_per_prompt=0"], "rollout.n_samples_per_prompt"),
        (["rollout.n_samples_per_prompt=1"], "at least 2 for train.advantage_estimator grpo"),
        (["train.lr_rate=1"], "train.lr_rate"),
        (["sft.batch_size=50", "sft.micro_batch_size=32"], "sft.batch_size"),
        (["name=a/b"], "name"),
        (["train.min_lr=0.01", "train.lr=0.001"], r"min_lr \(0.01\) must not exceed lr"),
        (["train.adam_beta1=1.0"], "adam_beta1"),
        (["train.loss_options.eps_clip_high=0"], "eps_clip_high"),
        (["train.threads=0"], "threads"),
        (
            ["rollout.engine_options.dtype=bfloat16"],
            "rollout engine 'embedded' takes no options; rollout.engine_options has dtype",
        ),
        (["rollout.engine=server"], "rollout.engine: server needs weight_sync.transport"),
        (["weight_sync.transport=disk"], "set rollout.engine: server"),
        (["rollout.mode=fully_async"], "rollout.mode fully_async needs rollout.engine: server"),
        (
            [*SERVER, "rollout.mode=fully_async", "rollout.mode_options.max_staleness=-1"],
            "rollout.mode_options.max_staleness",
        ),
        (
            ["rollout.mode_options.max_staleness=2"],
            "rollout mode 'sync' takes no options; rollout.mode_options has max_staleness",
        ),
        (["rollout.mode=lockstep"], "unknown rollout mode 'lockstep' in rollout.mode; known: "),
        (["rollout.engine=sglang"], r"give python \(launch SGLang\) or url \(attach"),
        (
            [
                "rollout.engine=sglang",
                "rollout.engine_options.url=http://127.0.0.1:30000",
                "weight_sync.transport=shared_memory",
            ],
            "rollout.engine: sglang needs weight_sync.transport broadcast | disk | p2p",
        ),
        (
            ["rollout.engine=serving", "rollout.engine_options.dtype=float16"],
            "rollout.engine_options.dtype",
        ),
        (
            ["train.loss_options.off_policy.mode=tis", "train.loss_options.off_policy.low=3"],
            r"low \(3.0\) must be below",
        ),
        (["train.loss_options.off_policy.mode=is"], "train.loss_options.off_policy.mode"),
        (["weight_sync.transport=carrier-pigeon"], "unknown weight transport 'carrier-pigeon'"),
        (
            [*SERVER, "weight_sync.transport=disk", "weight_sync.transport_options.deltas=true"],
            r"weight_sync.transport_options.deltas\n +Extra inputs are not permitted",
        ),
        (
            ["weight_sync.transport=tests.plugins.transport:JournaledTransport"],
            r"weight_sync.transport_options.journal\n +Field required",
        ),
        (
            [*SERVER, "rollout.engine_options.health_timeout_s=1"],
            r"health_timeout_s \(1.0\) must exceed",
        ),
        (
            [*SERVER, "rollout.engine_options.max_engine_restarts=-1"],
            "rollout.engine_options.max_engine_restarts",
        ),
        (["data.exclude_sft=true"], "data.exclude_sft .*: the run has no sft: section"),
        (["agent.turn_slack=-1"], "agent.turn_slack"),
    ],
)
def test_config_errors_name_the_field(overrides, message):
    with pytest.raises(ValidationError, match=message):
        load_config(None, overrides)


def test_override_syntax_error():
    with pytest.raises(ValueError, match="dotted.key=value"):
        load_config(None, ["train.lr"])


def test_dataset_row_without_prompt_names_the_row(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(
        json.dumps({"prompt": "a"})
        + "\n"
        + json.dumps({"prompt": "b"})
        + "\n"
        + json.dumps({"question": "c"})
        + "\n"
    )
    with pytest.raises(DatasetError, match="row 3 has no 'prompt' field"):
        read_jsonl(str(path))
    path.write_text('{"prompt": "a"}\n{not json\n')
    with pytest.raises(DatasetError, match="row 2 is not valid JSON"):
        read_jsonl(str(path))
    with pytest.raises(DatasetError, match="not found"):
        read_jsonl(str(tmp_path / "missing.jsonl"))


def test_exclude_sft_drops_a_files_sft_rows_and_refuses_a_file_of_nothing_else(tmp_path):
    from miles_core.data import rl_examples

    sft, rl = tmp_path / "sft.jsonl", tmp_path / "rl.jsonl"
    sft.write_text('{"prompt": "say a", "label": "a"}\n')
    rl.write_text('{"prompt": "say a", "label": "a"}\n{"prompt": "say b", "label": "b"}\n')
    sets = [f"data.path={rl}", f"sft.path={sft}", "data.exclude_sft=true", "data.num_prompts=8"]
    assert [r.prompt for r in rl_examples(load_config(None, sets))] == ["say b"]
    rl.write_text('{"prompt": "say a", "label": "a"}\n')
    with pytest.raises(DatasetError, match="every row of .*rl.jsonl.* is an SFT example"):
        rl_examples(load_config(None, sets))


def test_jsonl_rows_are_read_through_fsspec(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(
        '{"prompt": "say a", "label": 1}\n\n{"prompt": [{"role": "user", "content": "hi"}]}\n'
    )
    rows = read_jsonl(f"file://{path}")
    assert [r.prompt for r in rows] == ["say a", [{"role": "user", "content": "hi"}]]
    assert rows[0].label == 1


def test_preflight_refuses_a_checkpoint_of_another_model(tmp_path):
    from miles_core.checkpoint.store import CheckpointStore
    from miles_core.models import build_model

    model, tok = build_model("tiny", 0)
    store = CheckpointStore(str(tmp_path), "r")
    store.save(0, lambda d: (model.save_pretrained(d), tok.save_pretrained(d)), {"step": 0})
    ok = load_config(None, ["name=r", "model.preset=tiny", f"checkpoint.root={tmp_path}"])
    preflight(ok, resume=True)
    bad = load_config(None, ["name=r", "model.preset=small", f"checkpoint.root={tmp_path}"])
    with pytest.raises(ValueError, match="does not match the model config"):
        preflight(bad, resume=True)
    with pytest.raises(FileNotFoundError, match="has no checkpoint"):
        preflight(load_config(None, ["name=other", f"checkpoint.root={tmp_path}"]), resume=True)


@pytest.mark.slow  # one real `miles train` subprocess; the other cases in process
def test_cli_rejects_bad_input_before_starting_anything(tmp_path, monkeypatch, capsys):
    from flows import cli

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "x"}\n{"nothing": 1}\n')
    # any Prefect call would fail loudly
    monkeypatch.setenv("PREFECT_API_URL", "http://127.0.0.1:9/api")
    monkeypatch.chdir(tmp_path)
    proc = subprocess.run(
        [sys.executable, "-m", "flows.cli", "train", "--set", "train.global_batch_size=100"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert "must be divisible" in proc.stderr and "Traceback" not in proc.stderr
    cases = [
        (["--set", "data.task=nope"], "unknown task 'nope'"),
        (["--set", f"data.path={bad}"], "row 2 has no 'prompt' field"),
        (["--set", "train.lr=0"], "train.lr"),
    ]
    for args, message in cases:
        assert cli.main(["train", *args]) == 2, args
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.jsonl"]  # no store, no folder


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_preflight_refuses_prompts_that_do_not_fit_the_context(tmp_path):
    long = _write(tmp_path / "long.jsonl", [{"prompt": "ok"}, {"prompt": "x" * 600}])
    with pytest.raises(
        ValueError,
        match="row 2 is 619 tokens \\+ rollout.max_new_tokens 16, more than the model's context of 512",
    ):
        preflight(load_config(None, [f"data.path={long}", f"checkpoint.root={tmp_path}"]))
    with pytest.raises(
        ValueError, match=r"rollout.max_new_tokens 500, more than the model's context"
    ):
        preflight(
            load_config(
                None,
                ["data.task=reverse", "rollout.max_new_tokens=500", f"checkpoint.root={tmp_path}"],
            )
        )


AGENTIC = [
    "data.task=terminal",
    "rollout.engine=server",
    "weight_sync.transport=shared_memory",
    "agent.function=miles_core.envs.sandbox_agent:run_agent",
]


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["rollout.engine=serving", "weight_sync.transport=colocated"],
            "needs an engine server .* rollout.engine: serving runs in",
        ),
        (
            ["rollout.mode=fully_async", "rollout.pause_mode=abort"],
            "an agent episode cannot continue a call it lost: agentic runs in rollout.mode "
            "fully_async use retract or in_place",
        ),
        (["agent.concurrency=4"], r"agent.concurrency \(4 .*\) is below the group size .* \(8\)"),
    ],
)
def test_an_agentic_config_that_cannot_run_is_refused_naming_the_one_setting(overrides, message):
    with pytest.raises(ValidationError, match=message):
        load_config(None, [*AGENTIC, *overrides])


def test_engine_servers_options_are_refused_for_an_in_process_engine():
    with pytest.raises(
        ValidationError, match=r"rollout.engine_options.num_engines\n.*Extra inputs"
    ):
        load_config(None, ["rollout.engine_options.num_engines=2", "rollout.engine=serving"])


def test_preflight_refuses_an_agentic_task_without_an_agent_and_a_call_past_the_context(
    tmp_path,
):
    root = f"checkpoint.root={tmp_path}"
    with pytest.raises(ValueError, match="task 'terminal' is agentic .*: set agent.function"):
        preflight(load_config(None, ["data.task=terminal", root]))
    with pytest.raises(ValueError, match=r"\+ agent.max_tokens 500, more than the model's context"):
        preflight(load_config(None, [*AGENTIC, "agent.max_tokens=500", root]))
    preflight(load_config(None, [*AGENTIC, root]))  # the defaults fit: accepted


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["agent.max_tokens=48"],
            r"agent.max_tokens \(48\) cannot fit one tool call of a 'create' task: its scripted "
            r"run call is \d+ tokens",
        ),
        (
            ["agent.max_turns=2"],
            r"agent.max_turns \(2\) cannot fit the scripted solution of a 'debug' task \(3 tool "
            r"calls\)",
        ),
        (
            ["agent.max_session_tokens=300"],
            r"agent.max_session_tokens \(300 tokens\) cannot fit the scripted episode of a "
            r"'fix' task \(\d+ tokens with its tool results\)",
        ),
        (
            ["model.context=400"],
            r"the model's context \(400 tokens\) cannot fit the scripted episode of a 'debug' "
            r"task .*; raise model.context",
        ),
    ],
)
def test_preflight_refuses_a_turn_or_token_budget_no_scripted_episode_fits(
    tmp_path, overrides, message
):
    with pytest.raises(ValueError, match=message):
        preflight(load_config(None, [*AGENTIC, f"checkpoint.root={tmp_path}", *overrides]))


def test_preflight_refuses_an_evaluation_set_that_only_training_tasks_could_fill(tmp_path):
    """say_a has 8 distinct prompts: 64 training prompts hold all of them, so no evaluation
    task outside the training set exists."""
    agentic_say_a = [*AGENTIC[1:], "data.task=say_a", f"checkpoint.root={tmp_path}"]
    with pytest.raises(
        ValueError, match=r"agent.eval_episodes: 4 evaluation tasks disjoint .* 0 of 80"
    ):
        preflight(
            load_config(None, [*agentic_say_a, "data.num_prompts=64", "agent.eval_episodes=4"])
        )
    preflight(load_config(None, [*agentic_say_a, "data.num_prompts=2", "agent.eval_episodes=4"]))


def test_preflight_refuses_rows_without_the_label_the_task_scores(tmp_path):
    rows = _write(
        tmp_path / "r.jsonl", [{"prompt": "reverse abc", "label": "cba"}, {"prompt": "reverse xyz"}]
    )
    with pytest.raises(
        ValueError, match="row 2 has no 'label' \\(task 'reverse' scores against it\\)"
    ):
        preflight(
            load_config(
                None, ["data.task=reverse", f"data.path={rows}", f"checkpoint.root={tmp_path}"]
            )
        )


def test_preflight_refuses_a_resume_past_the_end_and_an_unwritable_root(tmp_path):
    from miles_core.checkpoint.store import CheckpointStore
    from miles_core.models import build_model

    model, tok = build_model("tiny", 0)
    CheckpointStore(str(tmp_path), "done").save(
        9, lambda d: (model.save_pretrained(d), tok.save_pretrained(d)), {}
    )
    finished = load_config(None, ["name=done", "train.num_steps=10", f"checkpoint.root={tmp_path}"])
    with pytest.raises(ValueError, match="already at step 10 of 10; raise train.num_steps"):
        preflight(finished, resume=True)
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(OSError, match="is not writable"):
        preflight(load_config(None, [f"checkpoint.root={blocker}"]))


def test_a_new_run_with_the_name_of_an_existing_one_is_refused_unless_it_overwrites(tmp_path):
    """Two runs of one name would interleave their checkpoints (and `latest`): refused; with
    checkpoint.overwrite the earlier run's checkpoints (its SFT's too) are removed first."""
    from miles_core.checkpoint.store import CheckpointStore
    from miles_core.run.preflight import clear_previous_checkpoints

    def write(d):
        d.mkdir(parents=True, exist_ok=True)
        (d / "weights.txt").write_text("old")

    for name in ("twice", "twice-sft"):
        CheckpointStore(str(tmp_path), name).save(3, write, {})
    base = [f"checkpoint.root={tmp_path}", "name=twice"]
    with pytest.raises(ValueError, match=r"run 'twice' already has checkpoints under .* step 3"):
        preflight(load_config(None, base))
    cfg = load_config(None, [*base, "checkpoint.overwrite=true", "sft.task=reverse"])
    preflight(cfg)  # allowed: it replaces them
    clear_previous_checkpoints(cfg)
    assert not (tmp_path / "twice").exists() and not (tmp_path / "twice-sft").exists()
    preflight(load_config(None, base))  # nothing left to collide with


def test_empty_prompts_and_a_missing_model_are_refused(tmp_path):
    for prompt in ("", "   ", []):
        path = _write(tmp_path / "e.jsonl", [{"prompt": "ok"}, {"prompt": prompt}])
        with pytest.raises(DatasetError, match="row 2: 'prompt' must be a non-empty string"):
            read_jsonl(path)
    missing = load_config(None, [f"model.path={tmp_path / 'nope'}"])
    with pytest.raises(FileNotFoundError, match="is not a model directory"):
        preflight(missing)
    # an SFT result to start from that is not one: the setting named, nothing started
    (tmp_path / "sft-run").mkdir()
    reused = load_config(None, ["sft.task=reverse", f"sft.reuse={tmp_path / 'sft-run'}"])
    with pytest.raises(FileNotFoundError, match=r"sft.reuse .*sft-run' is not a model dir"):
        preflight(reused)


# The bad-input catalogue: every class of bad input, what the user gets, and the test that
# shows it (`file::test`). Each ends in a clear error before anything starts, a 4xx from a
# server that keeps serving, or a FAILED sample while training goes on; nothing saved is lost.
CATALOGUE = [
    ("invalid evaluation settings", "the field and the rule", "test_eval.py::test_bad_eval_settings_are_refused_before_anything_starts"),
    ("evaluation that raises, hangs or gets HTTP 500", "eval/errors + the reason as a run tag; training goes on", "test_eval.py::test_failing_or_hanging_evaluations_never_stop_training"),
    ("unknown registered policy version", "LookupError naming the version", "test_eval.py::test_dedicated_mode_in_the_flow_then_the_evaluate_flow_scores_a_version"),
    ("malformed evaluation-service job", "422/400/404; an unreadable checkpoint fails the job with the reason", "test_eval.py::test_the_evaluation_service_refuses_malformed_jobs_with_4xx"),
    ("malformed JSONL row", "row number + 'not valid JSON'", "test_bad_input.py::test_dataset_row_without_prompt_names_the_row"),
    ("row without a prompt", "row number named", "test_bad_input.py::test_dataset_row_without_prompt_names_the_row"),
    ("empty or blank prompt", "row number named", "test_bad_input.py::test_empty_prompts_and_a_missing_model_are_refused"),
    ("row without the label the task scores", "row number named", "test_bad_input.py::test_preflight_refuses_rows_without_the_label_the_task_scores"),
    ("prompt longer than the context", "refused in preflight with lengths", "test_bad_input.py::test_preflight_refuses_prompts_that_do_not_fit_the_context"),
    ("missing dataset file", "'not found'", "test_bad_input.py::test_dataset_row_without_prompt_names_the_row"),
    ("invalid config combination", "the field and the rule", "test_bad_input.py::test_config_errors_name_the_field"),
    ("unknown config key / bad override", "the key named", "test_bad_input.py::test_override_syntax_error"),
    ("CLI: bad input exits 2 before Prefect or MLflow start", "exit 2, message", "test_bad_input.py::test_cli_rejects_bad_input_before_starting_anything"),
    ("unknown starting model path (model.path, sft.reuse)", "'not a model directory', the setting named", "test_bad_input.py::test_empty_prompts_and_a_missing_model_are_refused"),
    ("model/checkpoint mismatch", "both architectures named", "test_bad_input.py::test_preflight_refuses_a_checkpoint_of_another_model"),
    ("resume past the end, unwritable root", "what to change", "test_bad_input.py::test_preflight_refuses_a_resume_past_the_end_and_an_unwritable_root"),
    ("--resume-step without such a checkpoint, async buffer the config cannot continue", "the saved steps / the setting to use", "test_checkpoint_state.py::test_resume_rules_refuse_before_anything_starts"),
    ("duplicate run name", "--resume / another name / overwrite", "test_bad_input.py::test_a_new_run_with_the_name_of_an_existing_one_is_refused_unless_it_overwrites"),
    ("wrong S3 credentials", "root 'is not writable' + the store's reason", "test_storage.py::test_wrong_s3_credentials_are_refused_before_anything_starts"),
    ("disk full on save", "earlier checkpoints and latest untouched", "test_storage.py::test_a_save_onto_a_full_disk_fails_clearly_and_keeps_the_earlier_checkpoint"),
    ("disk full before the last step", "logged, training goes on", "test_storage.py::test_a_failed_save_before_the_last_step_does_not_stop_training"),
    ("NaN / infinite reward", "FAILED sample, training goes on", "test_scoring.py::test_a_failing_reward_function_fails_only_its_sample"),
    ("reward function that raises or hangs", "FAILED sample after the timeout", "test_scoring.py::test_a_run_whose_reward_function_fails_half_the_time_keeps_training"),
    ("reward hook that raises, hangs or returns garbage", "only its episodes FAILED", "test_rewards.py::test_a_failing_episode_hook_fails_that_episode_only"),
    ("invalid token ids / malformed /generate", "400, server keeps serving", "test_engine_server.py::test_bad_generate_requests_get_400_and_the_server_keeps_serving"),
    ("malformed JSON, unknown version, oversize body", "400 / 413", "test_engine_server.py::test_malformed_json_unknown_version_and_oversize_body"),
    ("corrupt, foreign or out-of-order weight push", "refused, engine unchanged", "test_transports.py::test_a_corrupt_or_foreign_disk_push_is_refused_and_changes_nothing"),
    ("shared-memory bucket naming a host file, link, FIFO or another user's file", "400, nothing mapped or unlinked", "test_weight_loads_confined.py::test_a_shared_memory_push_maps_only_this_users_regular_bucket_files"),
    ("disk load outside --weight-roots (URL, relative, .., s3://, /dev/zero)", "403/400, nothing fetched, same answer as missing", "test_weight_loads_confined.py::test_disk_loads_come_only_from_the_weight_roots"),
    ("disk load of a FIFO, device, oversized, non-safetensors or unreadable file", "403/400, read no further than its size", "test_weight_loads_confined.py::test_disk_loads_read_regular_files_only_and_no_further_than_their_size"),
    ("disk loads that stall on a slow store", "408 after the timeout, 429 past 2 in flight, control routes unaffected", "test_weight_loads_confined.py::test_stalled_disk_loads_time_out_and_never_hold_up_control_routes"),
    ("weight group joined as rank 0 / wildcard address; push with nothing received", "400, weights and version kept", "test_weight_loads_confined.py::test_a_group_push_with_nothing_received_is_refused_and_keeps_the_version"),
    ("sampling_seed outside [-2**63, 2**64), /generate with the KV cache released", "400 with the reason", "test_weight_loads_confined.py::test_seeds_out_of_range_and_a_released_kv_cache_are_4xx"),
    ("/init_weights_update_group naming an address that does not resolve, or a port where nothing listens", "400 at once (it held the request for the whole 120 s rendezvous timeout)", "test_weight_loads_confined.py::test_a_group_push_with_nothing_received_is_refused_and_keeps_the_version"),
    ("any request the three servers' OpenAPI schemas allow or break, and malformed raw bodies (schemathesis + hypothesis)", "never a 5xx; the server healthy and serving afterwards", "test_fuzz.py::test_the_engine_server_answers_every_fuzzed_request_below_500"),
    ("unknown session, malformed messages, bad tool-call JSON, too long", "404 / 400 with the reason", "test_sessions.py::test_bad_requests_get_clear_errors_and_the_server_keeps_serving"),
    ("harness that disconnects mid-turn", "server keeps serving", "test_sessions.py::test_a_harness_that_disconnects_mid_turn_does_not_stop_the_server"),
    ("garbled engine reply to the session server", "502", "test_sessions.py::test_idle_sessions_expire_and_a_garbled_engine_reply_is_a_502"),
    ("agent that raises or hangs", "FAILED episode", "test_agents.py::test_an_agent_that_raises_or_hangs_yields_failed_samples"),
    ("agent plug-in path that does not import", "refused in preflight", "test_rewards.py::test_reward_hook_paths_are_checked_before_anything_starts"),
    ("agentic run on an in-process engine, or async with pause_mode abort; fewer episodes in flight than a group", "the one setting named", "test_bad_input.py::test_an_agentic_config_that_cannot_run_is_refused_naming_the_one_setting"),
    ("agentic task without agent.function; prompt + agent.max_tokens past the context", "refused in preflight, the setting named", "test_bad_input.py::test_preflight_refuses_an_agentic_task_without_an_agent_and_a_call_past_the_context"),
    ("agent.max_tokens below one tool call, agent.max_turns below a scripted solution, a token budget or context below a scripted episode", "refused in preflight, the kind and the numbers named", "test_bad_input.py::test_preflight_refuses_a_turn_or_token_budget_no_scripted_episode_fits"),
    ("rollout.engine_options.num_engines > 1 with an in-process engine", "refused, the setting named", "test_bad_input.py::test_engine_servers_options_are_refused_for_an_in_process_engine"),
    ("agentic evaluation set that only training tasks could fill", "refused in preflight: how many disjoint tasks were found", "test_bad_input.py::test_preflight_refuses_an_evaluation_set_that_only_training_tasks_could_fill"),
    ("sandbox escapes (network, host files, fork bomb, memory, loops, output)", "blocked, scored 0", "test_sandbox.py::test_nothing_of_the_host_outside_the_workspace_is_readable_or_writable"),
    ("unknown TITO family", "the families listed", "test_tito.py::test_unknown_family_is_refused_by_the_command"),
    ("per-token field that does not load, clashes, or arrives misaligned", "refused in config validation / the sample and field named", "test_token_fields.py::test_a_run_declares_its_fields_in_the_config_and_a_bad_one_is_refused_up_front"),
    ("engine server killed or hung mid-run", "replaced ≤ 10 s, weights pushed, requests re-issued once", "test_engine_recovery.py::test_a_killed_engine_in_fully_async_mode_is_replaced_and_nothing_is_lost"),
    ("request that fails again after a replacement; restarts used up", "'failed again … re-issued once'; 'max_engine_restarts'", "test_engine_recovery.py::test_a_request_is_reissued_only_once_and_restarts_are_bounded"),
    ("session-server body over 8 MiB (declared or chunked)", "413 before it is read", "test_sessions_hostile.py::test_bodies_over_8_mib_are_413_before_they_are_read_declared_or_chunked"),
    ("NaN / Infinity in a session body (metadata, sampling, /samples reward)", "400, nothing stored", "test_sessions_hostile.py::test_non_finite_numbers_anywhere_are_400_and_nothing_is_stored"),
    ("50k-deep JSON to the session server", "400 'nests deeper than 64 levels'", "test_sessions_hostile.py::test_50k_deep_json_is_400_on_every_route"),
    ("too many live sessions; a session past its stored-ids cap", "429 / 413 with the cap", "test_sessions_hostile.py::test_live_sessions_are_capped_with_429_and_a_session_s_ids_with_413"),
    ("chat seed outside the engine's range", "400 naming seed", "test_sessions_hostile.py::test_a_seed_out_of_the_engines_range_is_400_not_a_500"),
    ("evaluation task outside the service's --tasks", "400, nothing imported", "test_eval_service_hostile.py::test_a_task_outside_the_allow_list_is_400_and_its_module_is_never_imported"),
    ("checkpoint URI outside the evaluation service's roots (URL, symlink, missing)", "403, the same answer for missing and forbidden; nothing fetched", "test_eval_service_hostile.py::test_checkpoints_outside_the_roots_are_refused_alike_and_urls_are_never_fetched"),
    ("weight or checkpoint URI malformed for either server (.. in a local path, ?/#/backslash/control characters, %2e, empty remote segments, file://host)", "400 from both servers by one rule (miles_core/processes/roots.py), before anything is opened", "test_roots.py::test_the_stricter_rule_of_the_two_former_checks_holds_everywhere"),
    ("evaluation job table full", "oldest finished dropped, else 429", "test_eval_service_hostile.py::test_the_job_table_is_bounded_and_drops_finished_jobs_first"),
    ("evaluation job with NaN, 2^64 seed, 50k-deep or 9 MiB body", "4xx / 413", "test_eval_service_hostile.py::test_malformed_or_hostile_job_bodies_are_4xx"),
    ("concurrent evaluation jobs, one a truncated checkpoint", "that job fails, every other loads", "test_eval_service_hostile.py::test_concurrent_jobs_in_a_fresh_service_all_load_and_a_failed_one_poisons_nothing"),
    ("request without the server's key, or with another", "401 'missing / wrong API key' on every route but /health, before routing", "test_auth.py::test_the_engine_server_requires_the_key_on_every_route_but_health"),
    ("server bound beyond loopback without a key", "refused at start-up, nothing bound, the variable named", "test_auth.py::test_non_loopback_bind_without_a_key_is_refused_at_start"),
    ("network.api_key that cannot be a header token", "network.api_key named", "test_auth.py::test_the_config_key_is_checked_and_never_dumped"),
    ("two runs of one name at once", "one claims the name; the other exits 2 naming the owner, nothing created", "test_run_lock.py::test_runs_of_one_name_started_together_only_one_claims_it"),
    ("run name a live run holds (train or --resume)", "exit 2 at preflight: 'is already running (pid …)', no folder, no MLflow store", "test_run_lock.py::test_the_cli_refuses_a_name_a_live_run_holds_before_anything_starts"),
    ("stale run lock (owner killed)", "taken over on its host; from another host the 'miles run unlock' command", "test_run_lock.py::test_a_dead_owners_lock_is_taken_over_on_its_host_and_cleared_by_command_elsewhere"),
    ("corrupt, truncated or empty safetensors file in model.path", "exit 2: the file and the byte counts", "test_preflight.py::test_a_corrupt_or_truncated_safetensors_file_is_refused"),
    ("model too big for the machine (vocab_size 1e8), config at odds with its weights", "exit 2 with the estimate, nothing allocated / the shapes named", "test_preflight.py::test_a_model_too_big_for_the_machine_is_refused_without_allocating"),
    ("tracking URI MLflow cannot open (bogus://, missing sqlite folder)", "exit 2: the scheme and the known ones", "test_preflight.py::test_a_tracking_uri_mlflow_cannot_open_is_refused"),
    ("non-finite number in the config (.inf, .nan)", "'Input should be a finite number', the field named", "test_preflight.py::test_non_finite_numbers_in_the_config_are_refused"),
    ("unknown chat role in a prompt", "the row, message and known roles", "test_preflight.py::test_an_unknown_chat_role_is_refused"),
    ("YAML syntax error in the config file or a --set", "exit 2: file, line and column, no traceback", "test_preflight.py::test_yaml_syntax_errors_exit_2_with_the_file_and_line"),
    ("plug-in that raises or has a syntax error at import", "exit 2: its file and line, no traceback", "test_preflight.py::test_a_plugin_that_raises_at_import_exits_2_with_its_file_and_line"),
    ("rollout.precision a model's shapes cannot take, INT4 group_size not dividing an input dim, keep_bf16 naming no tensor", "refused in preflight, the setting and the weights named", "test_precision_plan.py::test_a_model_the_precision_cannot_take_is_refused_before_start"),
    ("train.qat without a format, megatron QAT or p2p with a format, true on-policy without QAT", "the setting named", "test_precision_plan.py::test_precision_settings_that_cannot_work_are_refused_naming_them"),
    ("quantized push missing a part, in the wrong dtype, or in float for a quantized weight", "refused, engine unchanged", "test_precision_plan.py::test_a_bad_push_to_a_quantized_engine_changes_nothing"),
    ("train.lora with rank 0, a module the model lacks, megatron, QAT or a quantized rollout; on an engine without in-place adapter replacement, a transport other than disk, fully_async, agent sessions or check_equal", "refused before start, the setting named", "test_lora.py::test_lora_settings_that_cannot_work_are_refused_before_start"),
    ("adapter push an engine without in-place replacement refuses (SGLang's load of a new version); a request naming a replaced version", "PushFailed, the version before serving / 400", "test_lora.py::test_an_engine_without_upsert_takes_each_push_as_a_new_version"),
    ("a distillation teacher on another vocabulary or token map, without config.json, or a data row naming a teacher the run lacks; top_k past the vocabulary", "refused before start, the teacher named", "test_distill.py::test_a_teacher_that_cannot_score_the_students_ids_is_refused_before_start"),
    ("a teacher URL that does not answer at start", "an error naming the teacher and the URL", "test_distill.py::test_an_unreachable_teacher_is_a_clear_error_at_start"),
    ("a teacher lost mid-run", "its samples FAILED with the reason; the run goes on", "test_distill.py::test_a_teacher_lost_mid_run_fails_its_samples_with_the_reason"),
    ("a teacher's answer with other ids, no placeholder, another length or temperature, a non-finite log-prob", "refused, the sample FAILED with the reason", "test_distill.py::test_an_answer_that_must_not_be_trained_on_is_refused_saying_why"),
    ("a sample whose row names a teacher the run lacks", "FAILED with the reason, never scored by another teacher", "test_distill.py::test_each_sample_goes_to_its_rows_teacher_and_an_unknown_one_fails_it"),
    ("a scoring request: logprob_start_len past the input, a temperature ≤ 0", "400 naming the field", "test_prompt_logprobs.py::test_a_bad_scoring_request_is_a_400_naming_the_field"),
    ("top_logprobs_num past the vocabulary, token_ids_logprob outside it", "refused naming the field (400 on a server)", "test_prompt_logprobs.py::test_top_k_past_the_vocabulary_and_ids_outside_it_are_refused"),
    ("request naming an adapter not loaded, none while LoRA is on, a load past --max-loaded-loras, unloading one in use, an adapter of another base", "4xx / refused, the adapter table unchanged", "test_lora.py::test_requests_and_loads_the_adapter_table_cannot_take_are_refused"),
    ("adapter directory outside the weight roots, a pickled tensor payload", "400, nothing read or unpickled", "test_lora.py::test_the_servers_lora_routes_answer_as_sglangs"),
    ("miles convert to a format SGLang cannot load, or with an INT4 group that does not divide", "exit 2 with the reason, nothing written", "contract/test_sglang_quant_contract.py::test_the_cli_converts_with_a_runs_settings_and_refuses_what_cannot_load"),
    ("image run settings that cannot work: η < 0, zero sampling steps, flow_grpo on the ODE, a grid prompt outside the vocabulary, a text loss, an engine or transport images lack", "refused in config validation, the setting named", "test_diffusion_rl.py::test_image_settings_that_cannot_work_are_refused"),
    ("image run whose resolution or starting model the CLI cannot take", "exit 2 with the reason, nothing created", "test_diffusion_rl.py::test_the_cli_refuses_a_resolution_or_model_the_run_cannot_take"),
    ("image rollout request: a word outside the vocabulary, another resolution, zero steps, η < 0, an unknown key", "400 with the reason, the server keeps serving", "test_diffusion_engine.py::test_the_server_refuses_bad_requests_with_400"),
    ("any request the image engine server's schema allows or breaks, and raw bodies", "never a 5xx; serving afterwards", "test_diffusion_engine.py::test_the_image_engine_server_answers_every_fuzzed_request_below_500"),
]  # fmt: skip


def test_the_catalogue_names_real_tests_and_covers_at_least_twenty_classes():
    import ast

    assert len({name for name, _, _ in CATALOGUE}) >= 20
    here = Path(__file__).parent
    for name, _, where in CATALOGUE:
        file, _, test = where.partition("::")
        tree = ast.parse((here / file).read_text())
        defined = {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
        assert test in defined, f"catalogue entry {name!r}: {where} does not exist"
