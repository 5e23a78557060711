"""What counts as committed in S3: every node's manifest, every owned object, its checksum."""

from __future__ import annotations

import dataclasses

from jitckpt_entrypoint.protocol import manifest as m
from jitckpt_entrypoint.protocol.validity import RemoteCheckpoint, s3_part_problems, s3_problems

CHECKSUM = "xxh128:" + "0" * 32


def two_nodes(step: int = 10) -> dict[int, m.Manifest]:
    """Node 0 owns model + state, node 1 owns its RNG file and also holds the state."""
    shared = m.FileEntry("trainer_state.json", 20, owner=0)
    node0 = m.Manifest(
        step,
        "periodic",
        0,
        2,
        2,
        (
            m.FileEntry("model.safetensors", 100, 0, CHECKSUM),
            m.FileEntry(shared.path, 20, 0, CHECKSUM),
        ),
    )
    node1 = m.Manifest(
        step, "periodic", 1, 2, 2, (shared, m.FileEntry("rng_1.pth", 7, 1, CHECKSUM))
    )
    return {0: node0, 1: node1}


def objects() -> dict[str, int]:
    return {
        "model.safetensors": 100,
        "trainer_state.json": 20,
        "rng_1.pth": 7,
        m.manifest_name(0): 1,
        m.manifest_name(1): 1,
    }


def test_a_complete_two_node_checkpoint_is_committed_and_its_union_names_every_file():
    """Both manifests, every owned object with its size and checksum: committed; the union
    holds each file once, as its owner's entry."""
    ckpt = RemoteCheckpoint(10, objects(), two_nodes())
    assert s3_problems(ckpt) == []
    assert ckpt.committed
    union = ckpt.files()
    assert sorted(union) == ["model.safetensors", "rng_1.pth", "trainer_state.json"]
    assert union["trainer_state.json"].checksum == CHECKSUM


def test_a_missing_node_manifest_is_not_committed():
    """Node 1 has not uploaded its manifest yet."""
    manifests = two_nodes()
    del manifests[1]
    assert s3_problems(RemoteCheckpoint(10, objects(), manifests)) == ["manifest of node 1 missing"]


def test_a_missing_or_short_object_is_not_committed():
    """An owned object absent or shorter than listed makes the checkpoint uncommitted."""
    short = {**objects(), "model.safetensors": 99}
    assert s3_problems(RemoteCheckpoint(10, short, two_nodes())) == [
        "model.safetensors: object has 99 bytes, not 100"
    ]
    gone = {k: v for k, v in objects().items() if k != "rng_1.pth"}
    assert s3_problems(RemoteCheckpoint(10, gone, two_nodes())) == ["rng_1.pth: object missing"]


def test_an_owned_entry_without_a_checksum_we_can_verify_is_not_committed():
    """Restore verifies every file; an entry without a known checksum cannot be trusted."""
    manifests = two_nodes()
    files = (m.FileEntry("model.safetensors", 100, 0, "md5:abc"), manifests[0].files[1])
    manifests[0] = manifests[0].with_files(files)
    assert s3_problems(RemoteCheckpoint(10, objects(), manifests)) == [
        "model.safetensors: no checksum we can verify"
    ]


def test_manifests_that_disagree_are_not_committed():
    """A manifest of another step under checkpoint-10/ breaks the set."""
    manifests = two_nodes()
    manifests[1] = two_nodes(step=11)[1]
    assert s3_problems(RemoteCheckpoint(10, objects(), manifests)) == [
        "manifests disagree on the step, the node count, the world size or the kind"
    ]


def test_stale_manifests_of_nodes_a_smaller_job_no_longer_has_do_not_block_it():
    """A 4-node save left manifests of nodes 2 and 3; the 2-node save that replaced nodes 0
    and 1 is committed, and its union names only its own files."""
    manifests = two_nodes()
    stale = m.Manifest(10, "periodic", 2, 4, 4, (m.FileEntry("rng_2.pth", 7, 2, CHECKSUM),))
    manifests[2] = stale
    manifests[3] = dataclasses.replace(stale, node=3)
    ckpt = RemoteCheckpoint(10, {**objects(), "rng_2.pth": 7}, manifests)
    assert s3_problems(ckpt) == []
    assert sorted(ckpt.files()) == ["model.safetensors", "rng_1.pth", "trainer_state.json"]
    assert sorted(ckpt.save or {}) == [0, 1]


def test_manifests_of_two_saves_are_not_committed_however_whole_each_part_is():
    """Attempt A's node 1 and attempt B's node 0 uploaded the same step: shards of two
    trainings must never be restored together."""
    manifests = two_nodes()
    manifests[1] = dataclasses.replace(manifests[1], save_id="attempt-a")
    assert s3_problems(RemoteCheckpoint(10, objects(), manifests)) == [
        "manifest of node 1 is of another save of the step (an earlier attempt)"
    ]


def test_a_final_model_manifest_is_never_a_committed_checkpoint():
    """Manifests of kind output (final/) do not commit a checkpoint, nor checkpoint kinds a
    final model."""
    import dataclasses

    manifests = {n: dataclasses.replace(man, kind=m.OUTPUT_KIND) for n, man in two_nodes().items()}
    assert s3_problems(RemoteCheckpoint(10, objects(), manifests))
    assert s3_problems(RemoteCheckpoint(10, objects(), manifests), (m.OUTPUT_KIND,)) == []
    assert s3_problems(RemoteCheckpoint(10, objects(), two_nodes()), (m.OUTPUT_KIND,))


def test_a_nodes_part_is_in_s3_before_the_whole_checkpoint_is_committed():
    """Node 1 uploaded its manifest and the file it owns; node 0 has not: node 1's part is in
    S3 (its local copy may go), the checkpoint is not committed and node 0's part is not in S3."""
    manifests = two_nodes()
    del manifests[0]
    only_node1 = {"rng_1.pth": 7, m.manifest_name(1): 1}
    ckpt = RemoteCheckpoint(10, only_node1, manifests)
    assert s3_part_problems(ckpt, 1) == []
    assert not ckpt.committed
    assert s3_part_problems(ckpt, 0) == ["manifest of node 0 missing"]
    short = RemoteCheckpoint(10, {**only_node1, "rng_1.pth": 6}, manifests)
    assert s3_part_problems(short, 1) == ["rng_1.pth: object has 6 bytes, not 7"]
