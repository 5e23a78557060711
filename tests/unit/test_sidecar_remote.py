"""What counts as committed in S3: every node's manifest, every owned object, its checksum."""

from __future__ import annotations

from jitckpt_entrypoint import manifest as m
from jitckpt_sidecar.remote import RemoteCheckpoint, problems

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
    assert problems(ckpt) == []
    assert ckpt.committed
    union = ckpt.files()
    assert sorted(union) == ["model.safetensors", "rng_1.pth", "trainer_state.json"]
    assert union["trainer_state.json"].checksum == CHECKSUM


def test_a_missing_node_manifest_is_not_committed():
    """Node 1 has not uploaded its manifest yet."""
    manifests = two_nodes()
    del manifests[1]
    assert problems(RemoteCheckpoint(10, objects(), manifests)) == ["manifest of node 1 missing"]


def test_a_missing_or_short_object_is_not_committed():
    """An owned object absent or shorter than listed makes the checkpoint uncommitted."""
    short = {**objects(), "model.safetensors": 99}
    assert problems(RemoteCheckpoint(10, short, two_nodes())) == [
        "model.safetensors: object has 99 bytes, not 100"
    ]
    gone = {k: v for k, v in objects().items() if k != "rng_1.pth"}
    assert problems(RemoteCheckpoint(10, gone, two_nodes())) == ["rng_1.pth: object missing"]


def test_an_owned_entry_without_a_checksum_we_can_verify_is_not_committed():
    """Restore verifies every file; an entry without a known checksum cannot be trusted."""
    manifests = two_nodes()
    files = (m.FileEntry("model.safetensors", 100, 0, "md5:abc"), manifests[0].files[1])
    manifests[0] = manifests[0].with_files(files)
    assert problems(RemoteCheckpoint(10, objects(), manifests)) == [
        "model.safetensors: no checksum we can verify"
    ]


def test_manifests_that_disagree_are_not_committed():
    """A manifest of another step under checkpoint-10/ breaks the set."""
    manifests = two_nodes()
    manifests[1] = two_nodes(step=11)[1]
    assert problems(RemoteCheckpoint(10, objects(), manifests)) == [
        "manifests disagree on the step, the node count or the kind"
    ]


def test_a_final_model_manifest_is_never_a_committed_checkpoint():
    """Manifests of kind output (final/) do not commit a checkpoint, nor checkpoint kinds a
    final model."""
    import dataclasses

    manifests = {n: dataclasses.replace(man, kind=m.OUTPUT_KIND) for n, man in two_nodes().items()}
    assert problems(RemoteCheckpoint(10, objects(), manifests))
    assert problems(RemoteCheckpoint(10, objects(), manifests), (m.OUTPUT_KIND,)) == []
    assert problems(RemoteCheckpoint(10, objects(), two_nodes()), (m.OUTPUT_KIND,))
