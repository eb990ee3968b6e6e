"""Checkpoints through fsspec: local and s3:// (a real moto S3 server on 127.0.0.1)."""

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from miles_core.checkpoint.store import CheckpointStore, check_checkpoint_matches
from miles_core.config import RunConfig
from miles_core.models import architecture_of, build_model
from miles_core.train.backends.fsdp import FSDPBackend

BUCKET = "miles-test"


@pytest.fixture(scope="module")
def s3_server(moto_s3):
    """The session's moto server (conftest.py), with this module's bucket."""
    import fsspec

    fsspec.filesystem("s3", **moto_s3).mkdir(BUCKET)
    return moto_s3


def _trainer(model_dir):
    # warmup + cosine: a restored trainer only takes the same next step if the LR schedule came back
    cfg = RunConfig().train.model_copy(
        update={"micro_batch_size": 4, "lr_warmup_steps": 3, "lr_decay_style": "cosine"}
    )
    return FSDPBackend(str(model_dir), optim=cfg.model_dump(), loss=cfg.model_dump(), total_steps=5)


def _round_trip(root, storage_options, tiny_dir, tiny):
    from miles_core.train.batch import TrainBatch

    _, tok = tiny
    trainer = _trainer(tiny_dir)
    batch = TrainBatch(tokens=[[5, 6, 7, 8]] * 4, response_lengths=[2] * 4, loss_masks=[[1, 1]] * 4)
    trainer.train_step(batch, loss="sft")  # optimizer state exists now
    store = CheckpointStore(root, "run1", storage_options)

    def write(d):
        trainer.save(str(d))
        tok.save_pretrained(str(d))

    uri = store.save(3, write, {"step": 3, "policy_version": 2})
    assert store.latest_step() == 3
    assert store.read_state(3)["policy_version"] == 2
    local = store.fetch(3)
    # the model part is an ordinary HF directory
    from transformers import AutoModelForCausalLM

    reloaded = AutoModelForCausalLM.from_pretrained(local)
    expected = {n: t for b in trainer.named_weights() for n, t in b}
    for name, p in reloaded.named_parameters():
        assert torch.equal(p.detach(), expected[name]), name
    # optimizer state comes back too: a fresh trainer that loads it takes the same next step
    other = _trainer(tiny_dir)
    other.load(str(local))
    a = trainer.train_step(batch, loss="sft")
    b = other.train_step(batch, loss="sft")
    assert a["loss"] == b["loss"] and a["grad_norm"] == b["grad_norm"]
    assert a["lr"] == b["lr"] == pytest.approx(2 / 3 * 1e-3)  # second warmup step of three
    wa = {n: t for bk in trainer.named_weights() for n, t in bk}
    wb = {n: t for bk in other.named_weights() for n, t in bk}
    assert all(torch.equal(wa[n], wb[n]) for n in wa)
    store.close()
    return uri, local


def test_local_checkpoint_round_trip(tmp_path, tiny_dir, tiny):
    uri, local = _round_trip(str(tmp_path / "ckpt"), None, tiny_dir, tiny)
    assert uri == str(tmp_path / "ckpt" / "run1" / "step_000003")
    assert json.loads((local / "state.json").read_text())["step"] == 3
    assert set(load_file(str(local / "model.safetensors"))) >= {"model.embed_tokens.weight"}


def test_s3_checkpoint_round_trip_against_moto(s3_server, tiny_dir, tiny):
    import fsspec

    uri, _ = _round_trip(f"s3://{BUCKET}/ckpts", s3_server, tiny_dir, tiny)
    assert uri == f"s3://{BUCKET}/ckpts/run1/step_000003"
    fs = fsspec.filesystem("s3", **s3_server)
    names = {p.rsplit("/", 1)[-1] for p in fs.find(f"{BUCKET}/ckpts/run1/step_000003")}
    assert {"config.json", "model.safetensors", "state.json", "tokenizer.json"} <= names
    assert fs.cat_file(f"{BUCKET}/ckpts/run1/latest") == b"3"


def test_checkpoint_of_another_architecture_is_refused(tmp_path, tiny_dir):
    small, _ = build_model("small", seed=0)
    with pytest.raises(
        ValueError,
        match="does not match the model config.*hidden_size: model has 256, checkpoint has 64",
    ):
        check_checkpoint_matches(architecture_of(small.config), str(tiny_dir))
    check_checkpoint_matches(architecture_of(str(tiny_dir)), str(tiny_dir))  # same model: accepted


@pytest.mark.slow  # moto, an engine server and several pushes
def test_disk_weight_pushes_through_s3_reach_an_engine_server(
    s3_server, tiny_dir, tmp_path, monkeypatch
):
    """The trainer writes full and delta pushes to s3://; the engine server pulls them with the
    credentials of its own environment (as an engine on another host would)."""
    import fsspec

    from miles_core.engines.http import EngineProcess, HttpEngine
    from miles_core.models import load_hf_dir
    from miles_core.weights import weights_checksum
    from miles_core.weights.source import TensorBuckets
    from miles_core.weights.transports.disk import DiskTransport

    for var, value in {
        "AWS_ACCESS_KEY_ID": s3_server["key"],
        "AWS_SECRET_ACCESS_KEY": s3_server["secret"],
        "AWS_ENDPOINT_URL": s3_server["endpoint_url"],
        "AWS_DEFAULT_REGION": "us-east-1",
    }.items():
        monkeypatch.setenv(var, value)
    root = f"s3://{BUCKET}/pushed"
    proc = EngineProcess(
        tiny_dir, args=["--threads", "1"], log_path=tmp_path / "engine.log", weight_roots=[root]
    )
    proc.start()
    engine = HttpEngine(proc.url)
    try:
        transport = DiskTransport(root=root, storage_options=s3_server, keep=2, delta=True)
        transport.connect([engine])
        model, _ = load_hf_dir(tiny_dir)
        weights = {n: p.detach().clone() for n, p in model.named_parameters()}
        sizes = []
        for version in (1, 2):
            name = sorted(weights)[version]  # change one tensor per push
            weights[name] = weights[name] + 0.01
            sizes.append(transport.push(TensorBuckets(weights), version=version).bytes)
            assert engine.weights_checksum() == weights_checksum(weights.items())
            assert engine.weight_version == version
        fs = fsspec.filesystem("s3", **s3_server)
        manifest = json.loads(fs.cat_file(f"{BUCKET}/pushed/weight_v000002/manifest.json"))
        assert manifest["kind"] == "delta" and manifest["base_version"] == 1
        assert sizes[1] < sizes[0] / 4  # one changed tensor of many
    finally:
        engine.close()
        proc.stop()


@pytest.fixture
def full_disk(tmp_path):
    """A 256 KiB tmpfs: too small for a checkpoint of the tiny model (a real ENOSPC)."""
    mount = tmp_path / "small"
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mount)], capture_output=True
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=True)


def test_a_save_onto_a_full_disk_fails_clearly_and_keeps_the_earlier_checkpoint(full_disk):
    from miles_core.checkpoint.store import CheckpointSaveError, CheckpointStore
    from miles_core.models import build_model

    store = CheckpointStore(str(full_disk), "run")
    store.save(0, lambda d: (d.mkdir(), (d / "small.txt").write_text("fits")), {"step": 0})
    model, tok = build_model("tiny", 0)
    with pytest.raises(CheckpointSaveError, match=r"No space left on device.*step 0 is the latest"):
        store.save(1, lambda d: (model.save_pretrained(d), tok.save_pretrained(d)), {})
    assert store.latest_step() == 0 and store.read_state(0) == {"step": 0}
    assert sorted(p.name for p in (full_disk / "run").iterdir()) == ["latest", "step_000000"]
    store.close()


def test_a_failed_save_before_the_last_step_does_not_stop_training(full_disk, tmp_path):
    """The save task on a real full disk: before the last step it reports and carries on; once
    there is room the next save succeeds; a last-step save that fails raises."""
    import tempfile
    from pathlib import Path

    from miles_core.checkpoint.store import CheckpointSaveError
    from miles_core.config import load_config
    from miles_core.run.runtime import RLRuntime, prepare_model_dir
    from tasks.checkpoint import save_checkpoint

    cfg = load_config(
        None,
        [
            "model.preset=tiny",
            "data.num_prompts=8",
            "rollout.prompts_per_step=2",
            "rollout.n_samples_per_prompt=2",
            "train.global_batch_size=4",
            "train.micro_batch_size=4",
            "train.num_steps=3",
            f"checkpoint.root={full_disk}",
        ],
    )
    rt = RLRuntime(cfg, prepare_model_dir(cfg, Path(tempfile.mkdtemp())), None)
    try:
        assert save_checkpoint.fn(rt, 0)["checkpoint/save_failed"] == 1.0  # full: goes on
        assert rt.last_saved_step is None and rt.store.latest_step() is None
        with pytest.raises(CheckpointSaveError, match="No space left on device"):
            save_checkpoint.fn(rt, 2)  # the last step's save must succeed
        remount = ["mount", "-o", "remount,size=64m", str(full_disk)]
        subprocess.run(remount, check=True)
        assert "checkpoint/save_failed" not in save_checkpoint.fn(rt, 1)
        assert rt.store.latest_step() == 1
    finally:
        rt.close()


class _AuthMotoServer:
    """moto as a subprocess with credential checks on: only the first few calls (used here to
    create an IAM user and its key) go unauthenticated."""

    def __init__(self, log_path):
        from miles_core.processes.managed import free_port

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(log_path, "wb")  # noqa: SIM115  (closed in stop)
        env = {**os.environ, "INITIAL_NO_AUTH_ACTION_COUNT": "3"}
        server = Path(sys.executable).with_name("moto_server")
        self.proc = subprocess.Popen(
            [str(server), "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env=env,
        )

    def wait(self):
        import httpx

        for _ in range(200):
            try:
                httpx.get(f"{self.url}/moto-api/", timeout=1)
                return
            except httpx.HTTPError:
                assert self.proc.poll() is None, "moto server exited"
                threading.Event().wait(0.05)
        raise TimeoutError("moto server did not start")

    def stop(self):
        self.proc.terminate()
        self.proc.wait(10)
        self.log.close()


@pytest.fixture
def auth_s3(tmp_path):
    import boto3

    server = _AuthMotoServer(tmp_path / "moto.log")
    try:
        server.wait()
        kw = {"endpoint_url": server.url, "region_name": "us-east-1"}
        iam = boto3.client("iam", aws_access_key_id="a", aws_secret_access_key="b", **kw)
        iam.create_user(UserName="trainer")
        allow_s3 = {
            "Version": "2012-10-17",
            "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}],
        }
        iam.put_user_policy(
            UserName="trainer", PolicyName="s3", PolicyDocument=json.dumps(allow_s3)
        )
        key = iam.create_access_key(UserName="trainer")["AccessKey"]
        good = {"key": key["AccessKeyId"], "secret": key["SecretAccessKey"]}
        boto3.client(
            "s3",
            aws_access_key_id=good["key"],
            aws_secret_access_key=good["secret"],
            **kw,
        ).create_bucket(Bucket=BUCKET)
        yield server.url, good
    finally:
        server.stop()


def test_wrong_s3_credentials_are_refused_before_anything_starts(auth_s3):
    from miles_core.config import load_config
    from miles_core.run.preflight import preflight

    url, good = auth_s3

    def config(key, secret):
        opts = {"endpoint_url": url, "key": key, "secret": secret, "skip_instance_cache": True}
        return load_config(
            None,
            [
                f"checkpoint.root=s3://{BUCKET}/runs",
                f"checkpoint.storage_options={json.dumps(opts)}",
            ],
        )

    preflight(config(good["key"], good["secret"]))  # the right key writes its probe
    for key, secret in ((good["key"], "wrong-secret"), ("AKIANOSUCHKEY", good["secret"])):
        with pytest.raises(OSError, match=rf"checkpoint root s3://{BUCKET}/runs.* is not writable"):
            preflight(config(key, secret))
