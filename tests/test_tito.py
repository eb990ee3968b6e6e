"""TITO families: incremental ids equal full renders (and the model's own chat template) wherever
the template is append-only, the places where it is not are found, and completions parse back to
their messages. Every registered family is checked, and one defined in the test tree
(tests/plugins/family.py) loaded by import path, as a user's would be."""

import json
import subprocess
import sys

import pytest
from pydantic import ValidationError

from miles_core.config import load_config
from miles_core.tito import FAMILIES, registry
from miles_core.tito.diff import token_diff
from miles_core.tito.verify import TOOLS, model_template, verify
from tests.plugins.family import HeadersFamily, save_model_dir

PLUGIN = "tests.plugins.family:HeadersFamily"


@pytest.fixture(scope="module", params=[*FAMILIES.names(), PLUGIN])
def family(request):
    return FAMILIES.get(request.param)()


@pytest.fixture(scope="module")
def headers_dir(tmp_path_factory):
    """The tiny model saved with the plugin family's chat template."""
    return save_model_dir(tmp_path_factory.mktemp("headers") / "model")


def test_every_append_only_kind_matches_at_every_turn_and_the_known_limits_show(family):
    reports = {r.variant: r for r in verify(family, conversations=6, turns=20, seed=1)}
    for kind, r in reports.items():
        assert r.turns == 6 * 20
        assert r.parsed == r.turns, kind  # every completion parses back to its message
        if kind in family.expected_append_only:
            assert r.matched == r.turns, (kind, r.first_mismatches)
        else:  # the family says its template is not append-only here: the check must see it
            assert r.matched < r.turns and r.first_mismatches, kind


def test_the_last_turn_of_a_conversation_is_compared_too():
    """One-turn conversations: every turn is a last turn. A family whose completions lack the
    stop token the render holds differs there, and the check must say so."""

    class DropsTheStop(HeadersFamily):
        def completion(self, message, tools=None):
            return super().completion(message, tools)[:-1]

    for r in verify(DropsTheStop(), conversations=3, turns=1, seed=0):
        assert r.turns == 3 and r.matched == 0 and not r.ok, r.variant
        assert "turn 1: ids part at position" in r.first_mismatches[0]
    assert all(r.matched == 3 for r in verify(HeadersFamily(), conversations=3, turns=1, seed=0))


def test_every_turn_is_also_compared_with_the_chat_template_the_model_ships(headers_dir, tiny_dir):
    headers = HeadersFamily()
    same = verify(headers, conversations=3, turns=6, seed=2, template=model_template(headers_dir))
    for r in same:
        assert r.template_matched == r.turns == 18 and r.ok, (r.variant, r.template_mismatches)
    # the same family against a model whose template is ChatML: it matches itself, not the model
    other = verify(headers, conversations=3, turns=6, seed=2, template=model_template(tiny_dir))
    for r in other:
        assert r.matched == r.turns and r.template_matched == 0 and not r.ok, r.variant
        assert "template" in r.template_mismatches[0] and "<|im_start|>" in r.template_mismatches[0]
    # and the tiny family against the tiny model's own template: plain chat renders alike
    plain = verify(FAMILIES.get("tiny")(), 3, 6, 2, model_template(tiny_dir))[0]
    assert plain.variant == "plain" and plain.template_matched == plain.turns


def test_qwen3_uses_the_real_qwen_vocabulary():
    q = FAMILIES.get("qwen3")()
    text = "<|im_start|>assistant\n<think>\nhmm\n</think>\n\n4<|im_end|>"
    ids = q.tokenizer.encode(text)
    assert ids == [151644, 77091, 198, 151667, 198, 71, 3821, 198, 151668, 271, 19, 151645]
    assert q.stop_ids == [151645]


def test_a_session_built_from_engine_ids_and_appends_equals_the_render():
    q = FAMILIES.get("qwen3")()
    messages = [{"role": "user", "content": "count lines in a.txt"}]
    held = q.prompt(messages, TOOLS)
    call = {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": "c0",
                "type": "function",
                "function": {"name": "run", "arguments": json.dumps({"cmd": "wc -l a.txt"})},
            }
        ],
    }
    held += q.completion(call, TOOLS)  # what the engine generated
    tool = {"role": "tool", "tool_call_id": "c0", "content": "3 a.txt"}
    held += q.append([tool], TOOLS)
    assert held == q.prompt(messages + [call, tool], TOOLS)
    assert q.decode(held).endswith("</tool_response><|im_end|>\n<|im_start|>assistant\n")


def test_a_tool_call_that_is_not_json_does_not_parse():
    q = FAMILIES.get("tiny")()
    bad = q.tokenizer.encode("<tool_call>\n{not json\n</tool_call><|im_end|>")
    with pytest.raises(json.JSONDecodeError):
        q.parse(bad)
    with pytest.raises(ValueError, match="not another one"):
        q.append([{"role": "assistant", "content": "x"}])


def test_parse_exact_gives_a_message_that_renders_back_to_the_engine_ids(family):
    """What the session server returns to a harness: echoed back, it is the engine's ids —
    structured where the structure round-trips, else plain text (no tool call invented)."""
    call = {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": "call_0",
                "type": "function",
                "function": {"name": "run", "arguments": json.dumps({"cmd": "ls -l"})},
            }
        ],
    }
    plain = {"role": "assistant", "content": "all done"}
    cases = [(family.completion(call), "parsed"), (family.completion(plain), "parsed")]
    cases.append((family.completion(plain)[:2], "parsed"))  # cut off: closed by the stop id
    text = family.decode(family.completion(call)[:-1])
    as_text = family.parse(family.completion({"role": "assistant", "content": text}))
    if "tool_calls" in as_text:  # the family's tool-call markup is plain text: model output
        # that looks like a call but does not round-trip (text after it, a misspelt key)
        for odd in (text + "junk", text.replace("arguments", "argumeents")):
            cases.append((family.completion({"role": "assistant", "content": odd}), "text"))
    for ids, expected in cases:
        message, how = family.parse_exact(ids)
        assert how == expected, (family.decode(ids), how)
        closed = ids if ids[-1] in family.stop_ids else ids + family.stop_ids[:1]
        assert family.completion(message) == closed
        assert ("tool_calls" in message) == (ids == family.completion(call))
    assert family.name != "tiny" or len(cases) == 5  # the ChatML odd cases ran


def test_a_family_loads_by_import_path_or_by_a_registered_name(monkeypatch):
    assert type(FAMILIES.get(PLUGIN)()) is HeadersFamily
    assert load_config(None, [f"agent.family={PLUGIN}"]).agent.family == PLUGIN
    monkeypatch.setattr(registry.FAMILIES, "_entries", dict(registry.FAMILIES._entries))
    FAMILIES.register("headers", HeadersFamily)
    assert type(FAMILIES.get("headers")()) is HeadersFamily
    assert "headers" in FAMILIES.names()
    assert {"tiny", "qwen3", "mistral"} <= set(FAMILIES.names())  # the built-ins registered


@pytest.mark.parametrize(
    "name, message",
    [
        ("gpt2", "unknown TITO family 'gpt2' in agent.family; known: .*mistral, qwen3, tiny"),
        ("tests.plugins.family:Nope", "cannot import TITO family 'tests.plugins.family:Nope'"),
        ("no_such_module:Family", "cannot import TITO family 'no_such_module:Family'"),
        ("miles_core.tito.verify:VariantReport", "not a concrete TitoFamily subclass"),
        ("miles_core.tito.family:TitoFamily", "not a concrete TitoFamily subclass"),
        (":Family", "expected 'package.module:Class'"),
    ],
)
def test_a_family_that_is_not_one_is_refused_with_its_reason(name, message):
    with pytest.raises(ValueError, match=message):
        FAMILIES.get(name)
    with pytest.raises(ValidationError, match=message):
        load_config(None, [f"agent.family={name}"])


def test_a_factory_that_returns_something_else_is_refused_when_built():
    with pytest.raises(ValueError, match="the factory returned <class 'str'>"):
        FAMILIES.get("os:getcwd")()


def test_token_diff_reports_the_first_divergence_and_an_edit_count():
    assert token_diff([1, 2, 3], [1, 2, 3]).equal
    inserted = token_diff([1, 2, 3, 4, 5, 6], [1, 2, 9, 3, 4, 5, 6])  # one token inserted
    assert (inserted.first_divergence, inserted.edits) == (2, 1)  # not 5 shifted positions
    assert token_diff([1, 2, 3], [1, 2]) == token_diff([1, 2], [1, 2, 3])
    assert (token_diff([1, 2], [1, 2, 7]).first_divergence, token_diff([], [4, 4]).edits) == (2, 2)
    swapped = token_diff([1, 2, 3, 4], [1, 3, 2, 4])
    assert (swapped.first_divergence, swapped.edits) == (1, 2)
    assert token_diff([5, 1, 2, 1], [1, 2, 1, 6]).edits == 2  # one deleted, one added


def test_terminal_demonstrations_are_rendered_with_the_runs_family(tiny_dir, tmp_path):
    from miles_core.data import TASKS
    from miles_core.run.preflight import preflight

    headers = HeadersFamily()
    task = TASKS.get("terminal")
    example = task.generate(1, seed=0)[0]
    ids, mask = task.demonstration(example, headers)
    opening = headers.prompt([{"role": "user", "content": example.prompt}])
    assert ids[: len(opening)] == opening and len(ids) - len(opening) == len(mask)
    assert headers.decode(ids).count("### Assistant\n") == sum(
        1 for a, b in zip([0, *mask], mask, strict=False) if b and not a
    )  # one header per assistant turn, and the loss covers exactly those turns
    # a run whose model does not speak the family is refused before anything starts
    overrides = [
        f"model.path={tiny_dir}",
        f"checkpoint.root={tmp_path}",
        "sft.task=terminal",
        f"agent.family={PLUGIN}",
    ]
    with pytest.raises(ValueError, match=f"agent.family '{PLUGIN}' does not tokenize like"):
        preflight(load_config(None, overrides))


def test_unknown_family_is_refused_by_the_command(capsys):
    from flows.cli import main  # in-process: the exit codes and output of `miles tito verify`

    assert main(["tito", "verify", "--family", "gpt2"]) == 2
    assert "unknown TITO family 'gpt2'" in capsys.readouterr().out


def test_the_verify_command_prints_its_table_and_passes(capsys):
    from flows.cli import main

    assert main(["tito", "verify", "--family", "mistral", "--conversations", "3"]) == 0
    out = capsys.readouterr().out
    assert "differs (known limit)" in out and "tool list is placed" in out


def _verify_command(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "flows.cli", "tito", "verify", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_a_family_from_the_test_tree_passes_the_verify_command_against_its_model(headers_dir):
    out = _verify_command("--family", PLUGIN, "--model", str(headers_dir), "--turns", "4")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "== model template" in out.stdout and "equal to the model's chat template" in out.stdout
    assert out.stdout.count("80/80") == 3 * 3  # 20 conversations × 4 turns, 3 columns, 3 kinds
