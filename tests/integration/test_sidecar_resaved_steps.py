"""A step saved again: the sidecar uploads each save as itself, and a late upload of an earlier
save never replaces a newer one, against a real S3 server (moto and Ceph RGW).

A 2-node job commits checkpoint-50 (save A); the job restarts and saves 50 again (save B), so
`staging/checkpoint-50/` changes under the sidecar of a node whose upload of A has not finished,
or an old pod's sidecar uploads A after the new pod's uploaded B. Whatever the order, the
restore hands the trainer one save of 50 on every node, or the checkpoint before it.
"""

from __future__ import annotations

import logging
import shutil
import threading
import time
from pathlib import Path
from typing import Any, Optional

import pytest

from harness.checkpoints import (
    SIDECAR,
    commit,
    data,
    log_line,
    remote,
    sidecar_env,
    upload_directly,
    write_trainer,
)
from harness.procs import wait_for
from harness.s3 import Bucket
from harness.s3proxy import is_key
from jitckpt_entrypoint.protocol import manifest as m
from jitckpt_entrypoint.protocol import validity
from jitckpt_entrypoint.protocol.layout import Layout
from jitckpt_sidecar import checksum
from jitckpt_sidecar.config import Config
from jitckpt_sidecar.errors import SidecarError
from jitckpt_sidecar.remote import CHECKSUM_META, PIN_NAME, Remote
from jitckpt_sidecar.restore import Restorer
from jitckpt_sidecar.uploader import StaleSaveError

pytestmark = [pytest.mark.integration, pytest.mark.s3_stores("moto", "rgw")]

SHARDS = {0: ("__0_0.distcp",), 1: ("__1_0.distcp", "__1_1.distcp")}
"""The files each node owns: node 1 uploads two, so one node's part can mix two saves."""


def files(step: int, seed: int) -> list[dict[str, Any]]:
    """Each node's files of one save; `seed` tells two saves of a step apart."""
    state = f'{{"global_step": {step}, "seed": {seed}}}\n'.encode()
    return [
        {
            **{name: data(96 * 1024 + i, seed * 100 + i) for i, name in enumerate(SHARDS[n])},
            "trainer_state.json": state,
        }
        for n in range(2)
    ]


def save(roots: list[Path], step: int, seed: int) -> str:
    """Commit one 2-node save of checkpoint-<step> on `roots`; returns its save id. A root that
    holds the step already loses it first, as the trainer's resume removes a checkpoint it
    could not load before saving the step again."""
    for root in roots:
        shutil.rmtree(Layout(str(root)).checkpoint_dir(step), ignore_errors=True)
    return commit(roots, step, files(step, seed))[0].save_id


def restored(
    bucket: Bucket, root: Path, *, keep_pin: bool = False
) -> Optional[tuple[int, list[bytes]]]:
    """What a fresh restore of a new round gives: (step, every node's shards), or None."""
    if not keep_pin:
        bucket.delete(PIN_NAME)  # a new round: the pin binds only the round that wrote it
    cfg = Config(storage_uri=bucket.uri, s3_endpoint=bucket.server.endpoint)
    result = Restorer(
        bucket.client, Remote(bucket.client, cfg.uri), cfg, Layout(str(root)), _log()
    ).run()
    if result.step is None:
        return None
    ckpt = Path(Layout(str(root)).checkpoint_dir(result.step))
    assert validity.committed(str(ckpt)) is not None
    return result.step, [(ckpt / f).read_bytes() for n in (0, 1) for f in SHARDS[n]]


def shards_of(step: int, seed: int) -> list[bytes]:
    saved = files(step, seed)
    return [saved[n][f] for n in (0, 1) for f in SHARDS[n]]


def _log() -> logging.Logger:
    return logging.getLogger("test")


@pytest.mark.parametrize("when", ["while-it-waits-to-retry", "mid-upload"])
def test_a_step_saved_again_under_a_pending_upload_goes_up_as_the_new_save(
    spawn, base_env, s3_bucket, proxy, tmp_path, when
):
    """Node 1's upload of save A of 50 fails (and waits to retry), or is still sending a file,
    when the job saves 50 again (save B) and re-stages it. The sidecar uploads B's bytes under
    B's manifest, never A's manifest over B's bytes nor A's over B's staged copy: 50 is not
    committed until node 0 uploads B too, and then it is B's on every node."""
    base = [tmp_path / "base0", tmp_path / "base1"]
    save(base, 40, seed=1)
    for root in base:
        upload_directly(s3_bucket, root, 40)
    node0_a, node1 = tmp_path / "a0", tmp_path / "node1"
    save([node0_a, node1], 50, seed=2)
    upload_directly(s3_bucket, node0_a, 50)

    manifest1 = m.manifest_name(1)
    if when == "mid-upload":
        gate = proxy.hold(is_key("checkpoint-50/__1_0.distcp", "PUT"))
    else:
        fault = proxy.fail(is_key(f"checkpoint-50/{manifest1}", "PUT"), 400, None, "InvalidRequest")
    write_trainer(node1)
    env = s3_bucket.env({**base_env, "JITCKPT_DIR": str(node1)}, endpoint=proxy.url)
    proc = spawn(SIDECAR, env=sidecar_env(env, JITCKPT_EXIT_WITH_TRAINER="1"))
    if when == "mid-upload":
        wait_for(lambda: gate.held >= 1, 60, "node 1's upload of save A to send a file")
    else:
        log_line(proc, r"upload of checkpoint-50 failed", timeout=60)

    save_b = save([tmp_path / "b0", node1], 50, seed=3)
    if when == "mid-upload":
        gate.release()
    else:
        fault.times = fault.hits
    write_trainer(node1, exited=True)
    assert proc.wait(120) == 0, proc.output()

    part = remote(s3_bucket).load(50).manifests[1]
    assert part.save_id == save_b, proc.output()
    assert restored(s3_bucket, tmp_path / "fresh") == (40, shards_of(40, 1))
    upload_directly(s3_bucket, tmp_path / "b0", 50)
    assert restored(s3_bucket, tmp_path / "later") == (50, shards_of(50, 3))


def test_a_late_upload_of_an_earlier_save_never_replaces_the_newer_saves_bytes(
    s3_bucket, proxy, tmp_path
):
    """An old pod's sidecar starts uploading save A of 50 and stalls in a file; the new pod's
    sidecars upload save B of 50 meanwhile. When A's upload goes on, none of its bytes or its
    manifest replace B's: it stops as stale, and the restore gives B."""
    a = [tmp_path / "a0", tmp_path / "a1"]
    b = [tmp_path / "b0", tmp_path / "b1"]
    save(a, 50, seed=2)
    save(b, 50, seed=3)
    gate = proxy.hold(is_key("checkpoint-50/__1_1.distcp", "PUT"))
    late: list[BaseException] = []

    def upload_a() -> None:
        try:
            upload_directly(s3_bucket, a[1], 50, client=s3_bucket.server.client(proxy.url))
        except BaseException as exc:  # noqa: BLE001 - the test reads it
            late.append(exc)

    thread = threading.Thread(target=upload_a)
    thread.start()
    wait_for(lambda: gate.held >= 1, 60, "save A's upload to send a file")
    for root in b:
        upload_directly(s3_bucket, root, 50)
    gate.release()
    thread.join(60)
    assert len(late) == 1, late
    assert isinstance(late[0], StaleSaveError), late

    ckpt = remote(s3_bucket).load(50)
    assert ckpt.committed
    assert ckpt.save_id == commit_id(b[0], 50)
    assert restored(s3_bucket, tmp_path / "fresh") == (50, shards_of(50, 3))


def test_s3_holds_a_part_only_when_its_objects_are_that_saves_bytes(s3_bucket, tmp_path):
    """B's manifest over A's bytes (a late upload of A killed after its files) is not B's part
    in S3: the pruner may not delete B's local copy for it."""
    a = [tmp_path / "a0", tmp_path / "a1"]
    b = [tmp_path / "b0", tmp_path / "b1"]
    save(a, 50, seed=2)
    save_b = save(b, 50, seed=3)
    for root in b:
        upload_directly(s3_bucket, root, 50)
    assert remote(s3_bucket).holds(50, 1, save_b)
    # What a late upload of A leaves when it is killed between its files and its manifest.
    for name in SHARDS[1]:
        path = Path(Layout(str(a[1])).checkpoint_dir(50)) / name
        s3_bucket.put(
            path.read_bytes(),
            "checkpoint-50",
            name,
            Metadata={CHECKSUM_META: checksum.file_checksum(str(path))},
        )
    assert not remote(s3_bucket).holds(50, 1, save_b)
    assert remote(s3_bucket).holds(50, 0, save_b)


def commit_id(root: Path, step: int) -> str:
    return m.read_manifests(Layout(str(root)).checkpoint_dir(step))[0].save_id


def test_a_conditional_write_whose_response_was_lost_counts_once_it_is_found_landed(
    s3_bucket, proxy, tmp_path
):
    """A file's PUT reaches S3 but its response is lost: botocore's retry meets its own
    object (412 for If-None-Match), which is this save's with this checksum, so the upload goes
    on; the same for the manifest."""
    roots = [tmp_path / "n0", tmp_path / "n1"]
    save(roots, 50, seed=2)
    for suffix in ("checkpoint-50/__1_0.distcp", f"checkpoint-50/{m.manifest_name(1)}"):
        proxy.fail(is_key(suffix, "PUT"), 500, 1, "InternalError", landed=True)
    client = s3_bucket.server.client(proxy.url)
    upload_directly(s3_bucket, roots[1], 50, client=client)
    upload_directly(s3_bucket, roots[0], 50)
    assert restored(s3_bucket, tmp_path / "fresh") == (50, shards_of(50, 2))


def test_a_store_that_refuses_the_precondition_header_gets_the_writes_without_it(
    s3_bucket, proxy, tmp_path
):
    """A store answering If-None-Match with 501 NotImplemented: one failed attempt, then every
    write goes without the header (one warning), and the checkpoint is committed."""
    roots = [tmp_path / "n0", tmp_path / "n1"]
    save(roots, 50, seed=2)
    proxy.fail(is_key("checkpoint-50/__1_0.distcp", "PUT"), 501, 1, "NotImplemented")
    client = s3_bucket.server.client(proxy.url)
    with pytest.raises(SidecarError, match="does not take If-None-Match"):
        upload_directly(s3_bucket, roots[1], 50, client=client)
    upload_directly(s3_bucket, roots[1], 50, client=client)
    upload_directly(s3_bucket, roots[0], 50)
    assert restored(s3_bucket, tmp_path / "fresh") == (50, shards_of(50, 2))


def test_a_late_upload_of_a_save_the_next_round_resumed_below_is_never_committed(
    s3_bucket, tmp_path
):
    """The old pod's trainer saved 60 and was stopped; the next pod's restore listed S3 before
    that save had any manifest there, took 50 and pinned it. The old pod's upload of 60 (same
    lineage) finishes afterwards: it is not committed (it would outrank the live run's saves).
    A pin from before the trainer was stopped (a restore by hand while it trained) does not
    count, nor does any pin while the trainer runs."""
    base = [tmp_path / "b0", tmp_path / "b1"]
    save(base, 50, seed=1)
    old = [tmp_path / "o0", tmp_path / "o1"]
    save(old, 60, seed=2)
    for root in base:
        upload_directly(s3_bucket, root, 50)
    stopped = time.time()
    assert restored(s3_bucket, tmp_path / "next", keep_pin=True) == (50, shards_of(50, 1))
    with pytest.raises(StaleSaveError, match="resumed below it"):
        upload_directly(s3_bucket, old[0], 60, superseded_after=stopped)
    assert remote(s3_bucket).committed_steps() == [50]
    upload_directly(s3_bucket, old[0], 60, superseded_after=time.time())
    upload_directly(s3_bucket, old[1], 60)
    assert remote(s3_bucket).committed_steps() == [50, 60]
