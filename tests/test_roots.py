"""The allowed roots of the engine (`--weight-roots`) and the evaluation service
(`--checkpoint-roots`), one module for both (miles_core/processes/roots.py): what a legitimate client
reads, and the union of what the two servers' former checks refused, each under the stricter
of their two rules."""

from __future__ import annotations

import pytest

from miles_core.processes.roots import AllowedRoots, MalformedUri, OutsideRoots
from miles_core.weights.transports.disk import confine, not_found_message


def test_pushes_and_checkpoints_under_the_roots_are_read(tmp_path):
    local = tmp_path / "pushed"
    (local / "weight_v000001").mkdir(parents=True)
    (local / "latest").symlink_to(local / "weight_v000001")  # a link that stays inside
    roots = AllowedRoots.parse([f"{local}/", "s3://bucket/prefix/", "http://127.0.0.1:9/w"])
    assert roots.check(f"{local}/weight_v000001") == str(local / "weight_v000001")
    assert roots.check(str(local)) == str(local)
    assert roots.check(f"{local}//latest") == str(local / "weight_v000001")
    assert roots.check(f"file://{local}/weight_v000001") == str(local / "weight_v000001")
    assert roots.check(f"local://{local}/weight_v000001") == str(local / "weight_v000001")
    push = "s3://bucket/prefix/weight_v000001"
    assert roots.check(push) == push and roots.check(push + "/") == push
    assert roots.check("S3://bucket/prefix") == "s3://bucket/prefix"
    assert roots.check("http://127.0.0.1:9/w/x/model.safetensors").endswith(
        "/w/x/model.safetensors"
    )
    assert AllowedRoots.parse(["gs://bucket"]).check("gs://bucket/any/key") == "gs://bucket/any/key"
    assert AllowedRoots.parse([f"file://{local}", " "]).local == (str(local),)


def test_the_stricter_rule_of_the_two_former_checks_holds_everywhere(tmp_path):
    """Each URI here was accepted (or answered 403) by one of the two former modules."""
    roots = AllowedRoots.parse([str(tmp_path), "s3://bucket/prefix"])
    for uri in [
        f"{tmp_path}/a/../../etc",  # the service resolved it, answering 403: now malformed
        f"{tmp_path}/./a",
        f"{tmp_path}/a?b",  # the engine read local names with '?', '#', '\\'
        f"{tmp_path}/a#b",
        f"{tmp_path}/a\\b",
        f"{tmp_path}/%2e%2e/etc",  # the service let percent-encoding through in local paths
        f"{tmp_path}/a://b",  # the service read it as a local path
        "s3://bucket/prefix//x",  # the engine read empty segments of a remote path
        "s3://bucket/prefix/x\n",  # control characters (urlsplit drops tabs and newlines)
        "s3://buck\tet/prefix/x",
        f"{tmp_path}/a\x00",
        f"file://localhost{tmp_path}/a",  # a file:// URL naming a host
        "s3:///prefix/x",
        "s3://bucket/prefix/a::x",
        "relative/x",
    ]:
        with pytest.raises(MalformedUri) as refused:
            roots.check(uri, "model_path")
        assert refused.value.status == 400 and "model_path" in str(refused.value), uri
    for uri in [
        "s3://bucket/prefix-x/a",
        "s3://other/prefix/a",
        "gs://bucket/prefix/a",
        f"{tmp_path}-sibling/a",
        "/etc/hostname",
        "/no/such/path",
    ]:
        with pytest.raises(OutsideRoots, match="is not under the roots") as outside:
            roots.check(uri)
        assert outside.value.status == 403
    with pytest.raises(OutsideRoots, match="none configured"):
        AllowedRoots.parse([]).check(str(tmp_path))
    for root in ["ckpt", "s3://bucket/a/../b", "s3://", "simplecache::s3://b/p", "s3://b/p?x=1"]:
        with pytest.raises(ValueError, match="weight root"):
            AllowedRoots.parse([root], "weight root")


def test_the_engine_answers_outside_its_roots_as_a_missing_path(tmp_path):
    roots = AllowedRoots.parse([str(tmp_path)])
    with pytest.raises(OutsideRoots) as outside:
        confine(roots, "/etc/hostname")
    assert str(outside.value) == not_found_message("/etc/hostname")
    with pytest.raises(OutsideRoots, match="without --weight-roots"):
        confine(AllowedRoots(), "relative/x")  # no roots: every load refused, malformed too
    with pytest.raises(MalformedUri):
        confine(roots, "relative/x")
