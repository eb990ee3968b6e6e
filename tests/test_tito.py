"""TITO families: incremental ids equal full renders wherever the template is append-only, the
places where it is not are found, and completions parse back to their messages."""

import json
import subprocess
import sys

import pytest

from miles_core.tito import FAMILIES, get_family
from miles_core.tito.verify import TOOLS, verify


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request):
    return get_family(request.param)


def test_every_append_only_kind_matches_at_every_turn_and_the_known_limits_show(family):
    reports = {r.variant: r for r in verify(family, conversations=6, turns=20, seed=1)}
    for kind, r in reports.items():
        assert r.turns == 6 * 20
        assert r.parsed == r.turns, kind  # every completion parses back to its message
        if kind in family.expected_append_only:
            assert r.matched == r.turns, (kind, r.first_mismatches)
        else:  # the family says its template is not append-only here: the check must see it
            assert r.matched < r.turns and r.first_mismatches, kind


def test_qwen3_uses_the_real_qwen_vocabulary():
    q = get_family("qwen3")
    text = "<|im_start|>assistant\n<think>\nhmm\n</think>\n\n4<|im_end|>"
    ids = q.tokenizer.encode(text)
    assert ids == [151644, 77091, 198, 151667, 198, 71, 3821, 198, 151668, 271, 19, 151645]
    assert q.stop_ids == [151645]


def test_a_session_built_from_engine_ids_and_appends_equals_the_render():
    q = get_family("qwen3")
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
    q = get_family("tiny")
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
    if family.name != "mistral":  # ChatML: text after the call, a misspelt key
        text = family.decode(family.completion(call)[:-1])
        for odd in (text + "junk", text.replace("arguments", "argumeents")):
            cases.append((family.completion({"role": "assistant", "content": odd}), "text"))
    for ids, expected in cases:
        message, how = family.parse_exact(ids)
        assert how == expected, (family.decode(ids), how)
        closed = ids if ids[-1] in family.stop_ids else ids + family.stop_ids[:1]
        assert family.completion(message) == closed
        assert ("tool_calls" in message) == (ids == family.completion(call))


def test_unknown_family_is_refused_by_the_command():
    out = subprocess.run(
        [sys.executable, "-m", "flows.cli", "tito", "verify", "--family", "gpt2"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2 and "unknown TITO family 'gpt2'" in out.stdout + out.stderr


def test_the_verify_command_prints_its_table_and_passes():
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "flows.cli",
            "tito",
            "verify",
            "--family",
            "mistral",
            "--conversations",
            "3",
            "--turns",
            "5",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "differs (known limit)" in out.stdout and "tool list is placed" in out.stdout
