"""The final model: staged by the entrypoint, uploaded by a real sidecar to final/ in S3."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from harness.checkpoints import SIDECAR, commit, data, hf_files, log_line, sidecar_env
from harness.checkpoints import write_trainer as write_trainer_status
from harness.s3 import Bucket
from harness.s3proxy import S3Proxy
from jitckpt_entrypoint import final, status
from jitckpt_entrypoint import manifest as m

pytestmark = [pytest.mark.integration, pytest.mark.s3_stores("moto", "rgw")]


@pytest.fixture
def proxy(s3_bucket: Bucket) -> Iterator[S3Proxy]:
    proxy = s3_bucket.server.proxy().start()
    yield proxy
    proxy.stop()


def model_dir(path: Path, seed: int, extra: bool = False) -> Path:
    """What TRL's sft script leaves in --output_dir, and a stale checkpoint beside it."""
    files = {
        "model.safetensors": data(300_000, seed),
        "config.json": b'{"model_type": "llama"}\n',
        "tokenizer.json": data(5000, 7),
        "tokenizer_config.json": b"{}\n",
        "chat_template.jinja": b"{{ messages }}\n",
        "README.md": f"model card {seed}\n".encode(),
        "train_results.json": b'{"train_loss": 1.0}\n',
        "checkpoint-5/model.safetensors": b"old checkpoint",
    }
    if extra:
        files["runs/events.out"] = b"logs"
    for rel, content in files.items():
        (path / rel).parent.mkdir(parents=True, exist_ok=True)
        (path / rel).write_bytes(content)
    return path


def stage(root: Path, output: Path, step: int) -> final.StagedFinal:
    layout = m.Layout(str(root))
    layout.ensure()
    staged = final.stage(layout, status.OutputRecord("run", str(output), step, time.time()))
    assert staged is not None
    return staged


def run_sidecar(spawn, base_env, s3_bucket, root, endpoint=None):
    env = s3_bucket.env({**base_env, "JITCKPT_DIR": str(root)}, endpoint=endpoint)
    proc = spawn(SIDECAR, env=sidecar_env(env, JITCKPT_EXIT_WITH_TRAINER="1"))
    assert proc.wait(90) == 0, proc.output()
    return proc


def final_keys(s3_bucket: Bucket, name: str = "final") -> dict[str, int]:
    return {k[len(name) + 1 :]: v for k, v in s3_bucket.keys(f"{name}/").items()}


def test_the_final_model_goes_to_final_after_the_checkpoints_manifest_last(
    spawn, base_env, s3_bucket, proxy, tmp_path
):
    """Training ended: the final checkpoint goes up first, then the output_dir's model into
    final/ (no checkpoint-* from it), its manifest last; the sidecar's last line names it."""
    root, output = tmp_path / "node", model_dir(tmp_path / "out", seed=1, extra=True)
    commit([root], 30, [hf_files(30)], kind="final")
    staged = stage(root, output, 30)
    write_trainer_status(root, exited=True)
    proc = run_sidecar(spawn, base_env, s3_bucket, root, endpoint=proxy.url)

    keys = final_keys(s3_bucket)
    assert set(keys) == {
        "model.safetensors",
        "config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
        "README.md",
        "train_results.json",
        "runs/events.out",
        "jitckpt-manifest.node-0.json",
    }
    assert staged.files == len(keys) - 1
    assert s3_bucket.get("final", "model.safetensors") == data(300_000, 1)
    man = json.loads(s3_bucket.get("final", "jitckpt-manifest.node-0.json"))
    assert (man["kind"], man["step"], man["nodes"]) == ("output", 30, 1)
    assert all(f["checksum"].startswith("xxh128:") for f in man["files"])

    writes = [r for r in proxy.log() if r.writes_object and "/probe" not in r.key]
    final_writes = [r for r in writes if r.key.startswith(f"{s3_bucket.prefix}/final/")]
    ckpt_writes = [r for r in writes if "/checkpoint-30/" in r.key]
    assert ckpt_writes
    assert final_writes
    assert max(r.ended for r in ckpt_writes) <= min(r.started for r in final_writes)
    assert final_writes[-1].key.endswith("/final/jitckpt-manifest.node-0.json")
    assert all(r.ended <= final_writes[-1].started for r in final_writes[:-1])
    assert not (root / "staging" / "final").exists()
    last = proc.stderr[-1]
    assert f"the final model is in s3://{s3_bucket.name}/{s3_bucket.prefix}/final/" in last, last


def test_a_new_final_replaces_final_only_once_it_is_complete(
    spawn, base_env, s3_bucket, proxy, tmp_path
):
    """A job trained again: the new model is complete in .final-incoming/ before final/'s
    manifest goes; final/ then holds exactly the new files (a file the new model lacks is gone,
    an unchanged one is not copied) with the new manifest written last."""
    root = tmp_path / "node"
    stage(root, model_dir(tmp_path / "first", seed=1, extra=True), 30)
    write_trainer_status(root, exited=True)
    run_sidecar(spawn, base_env, s3_bucket, root)
    proxy.requests.clear()

    stage(root, model_dir(tmp_path / "second", seed=2), 60)
    proc = run_sidecar(spawn, base_env, s3_bucket, root, endpoint=proxy.url)

    keys = final_keys(s3_bucket)
    assert "runs/events.out" not in keys
    assert s3_bucket.get("final", "model.safetensors") == data(300_000, 2)
    assert s3_bucket.get("final", "README.md") == b"model card 2\n"
    assert json.loads(s3_bucket.get("final", "jitckpt-manifest.node-0.json"))["step"] == 60
    assert final_keys(s3_bucket, ".final-incoming") == {}

    prefix = s3_bucket.prefix
    incoming_manifest = next(
        r
        for r in proxy.log()
        if r.writes_object and r.key == f"{prefix}/.final-incoming/jitckpt-manifest.node-0.json"
    )
    manifest_gone = next(
        r for r in proxy.log() if f"{prefix}/final/jitckpt-manifest.node-0.json" in r.deleted
    )
    assert incoming_manifest.ended <= manifest_gone.started
    final_writes = [
        r for r in proxy.log() if r.key.startswith(f"{prefix}/final/") and r.writes_object
    ]
    assert final_writes[-1].key == f"{prefix}/final/jitckpt-manifest.node-0.json"
    copied = {r.key.rsplit("/", 1)[1] for r in final_writes[:-1]}
    assert "model.safetensors" in copied
    assert "tokenizer.json" not in copied  # unchanged: kept, not copied again
    log_line(proc, r"the final model \(step 60\) is in s3://")


def test_the_same_final_model_again_changes_nothing(spawn, base_env, s3_bucket, proxy, tmp_path):
    """A rerun that ends with the same model (same files and checksums) writes nothing."""
    root, output = tmp_path / "node", model_dir(tmp_path / "out", seed=3)
    stage(root, output, 30)
    write_trainer_status(root, exited=True)
    run_sidecar(spawn, base_env, s3_bucket, root)
    stage(root, output, 30)
    proc = run_sidecar(spawn, base_env, s3_bucket, root, endpoint=proxy.url)
    assert not [r for r in proxy.log() if r.writes_object and "/final" in r.key]
    log_line(proc, r"already holds this model")


def test_the_drain_waits_for_the_final_model(spawn, base_env, s3_bucket, tmp_path):
    """SIGTERM to the sidecar right after the trainer exited: it uploads final/ before exiting 0."""
    root = tmp_path / "node"
    write_trainer_status(root)
    env = s3_bucket.env({**base_env, "JITCKPT_DIR": str(root)})
    proc = spawn(SIDECAR, env=sidecar_env(env, JITCKPT_GRACE_SECONDS="60"))
    log_line(proc, r"ready")
    stage(root, model_dir(tmp_path / "out", seed=4), 12)
    write_trainer_status(root, exited=True)
    proc.send(signal.SIGTERM)
    assert proc.wait(60) == 0, proc.output()
    assert "model.safetensors" in final_keys(s3_bucket)
    assert "the final model is in s3://" in proc.stderr[-1]


def test_restore_never_takes_final_for_a_checkpoint(spawn, base_env, s3_bucket, tmp_path):
    """With final/ and .final-incoming/ in S3 beside checkpoint-20, a new pod restores
    checkpoint-20; with final/ alone it starts fresh."""
    first = tmp_path / "first"
    stage(first, model_dir(tmp_path / "out", seed=5), 40)
    write_trainer_status(first, exited=True)
    run_sidecar(spawn, base_env, s3_bucket, first)
    s3_bucket.put(b"x", ".final-incoming", "jitckpt-manifest.node-0.json")

    fresh = tmp_path / "fresh"
    write_trainer_status(fresh, exited=True)
    proc = run_sidecar(spawn, base_env, s3_bucket, fresh)
    log_line(proc, r"no committed checkpoint in s3://")
    assert os.listdir(fresh / "checkpoints") == []

    commit([first], 20, [hf_files(20)])
    run_sidecar(spawn, base_env, s3_bucket, first)
    again = tmp_path / "again"
    write_trainer_status(again, exited=True)
    run_sidecar(spawn, base_env, s3_bucket, again)
    assert sorted(os.listdir(again / "checkpoints")) == ["checkpoint-20"]
