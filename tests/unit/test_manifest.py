"""The commit protocol: manifests, ownership and what counts as committed."""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

import pytest

from jitckpt_entrypoint.protocol import manifest as m
from jitckpt_entrypoint.protocol import validity
from jitckpt_entrypoint.protocol.commit import remove_checkpoint


def make_ckpt(root: Path, step: int, files: dict[str, bytes]) -> Path:
    d = root / f"checkpoint-{step}"
    for rel, data in files.items():
        (d / rel).parent.mkdir(parents=True, exist_ok=True)
        (d / rel).write_bytes(data)
    return d


def commit(d: Path, step: int, node: int = 0, nodes: int = 1, kind: str = "periodic") -> m.Manifest:
    holdings = {node: m.list_files(str(d))}
    files = m.assign_owners(holdings)[node]
    man = m.new_manifest(step, kind, node=node, nodes=nodes, world_size=2, files=files)
    m.write_manifest(str(d), man)
    return man


def test_a_directory_without_manifest_is_not_committed(tmp_path):
    """Files alone do not make a checkpoint committed."""
    d = make_ckpt(tmp_path, 5, {"model.safetensors": b"x" * 10})
    assert validity.committed(str(d)) is None
    assert validity.newest_committed(str(tmp_path)) is None


def test_manifest_written_last_commits_and_lists_every_file(tmp_path):
    """Once the manifest is written the directory is committed; it lists nested files, sizes."""
    d = make_ckpt(tmp_path, 7, {"a.bin": b"1234", "sub/b.bin": b"12", ".x.123.tmp": b"junk"})
    man = commit(d, 7)
    assert [(f.path, f.size, f.owner) for f in man.files] == [("a.bin", 4, 0), ("sub/b.bin", 2, 0)]
    assert validity.committed(str(d)) is not None
    assert validity.committed_steps(str(tmp_path)) == [7]


def test_short_or_missing_file_uncommits(tmp_path):
    """A listed file that is missing or has the wrong size makes the checkpoint invalid."""
    d = make_ckpt(tmp_path, 3, {"a.bin": b"1234", "b.bin": b"5678"})
    commit(d, 3)
    (d / "a.bin").write_bytes(b"12")
    assert validity.committed(str(d)) is None
    (d / "a.bin").write_bytes(b"1234")
    os.unlink(d / "b.bin")
    assert validity.committed(str(d)) is None


def test_newest_committed_skips_newer_partial_directories(tmp_path):
    """Resume picks the highest committed step, never a newer partial one."""
    for step in (10, 20):
        commit(make_ckpt(tmp_path, step, {"w": b"w"}), step)
    make_ckpt(tmp_path, 30, {"w": b"partial"})
    assert validity.newest_committed(str(tmp_path)) == 20


def test_every_node_manifest_is_required(tmp_path):
    """With two nodes, one node's manifest alone does not commit the checkpoint."""
    d = make_ckpt(tmp_path, 4, {"model": b"m", "rng_state_0.pth": b"r0"})
    owned = m.assign_owners({0: m.list_files(str(d)), 1: {"model": 1, "rng_state_1.pth": 2}})
    m.write_manifest(
        str(d),
        m.new_manifest(4, "jit", node=0, nodes=2, world_size=4, files=owned[0], save_id="s"),
    )
    assert validity.committed(str(d), node=0) is None
    m.write_manifest(
        str(d),
        m.new_manifest(4, "jit", node=1, nodes=2, world_size=4, files=owned[1], save_id="s"),
    )
    assert validity.committed(str(d), node=0) is not None
    # node 1's files are not here: committed from node 0's view only
    assert validity.committed(str(d)) is None


def test_owner_is_the_lowest_node_holding_a_path():
    """Files held by several nodes are uploaded once, by the lowest node."""
    owned = m.assign_owners({1: {"model": 5, "rng_1": 1}, 0: {"model": 5, "rng_0": 1}})
    assert {f.path: f.owner for f in owned[1]} == {"model": 0, "rng_1": 1}
    assert [f.path for f in m.Manifest(1, "jit", 1, 2, 2, owned[1]).owned] == ["rng_1"]


def test_manifest_json_round_trip_and_checksums(tmp_path):
    """A manifest with uploader checksums parses back equal."""
    man = m.new_manifest(
        9, "final", node=0, nodes=1, world_size=1, files=(m.FileEntry("a", 1, 0, "sha256:ab"),)
    )
    assert m.Manifest.from_json(json.loads(man.to_bytes())) == man


@pytest.mark.parametrize(
    "mutate",
    [
        lambda o: o.update(version=99),
        lambda o: o.update(kind="weird"),
        lambda o: o["files"][0].update(path="../../etc/passwd"),
        lambda o: o["files"][0].update(path="/abs"),
        lambda o: o.update(node=3),
        lambda o: o.pop("step"),
    ],
)
def test_untrustworthy_manifests_are_rejected(mutate):
    """Wrong version, kind, escaping paths or inconsistent nodes make a manifest unparsable."""
    obj = m.new_manifest(
        1, "jit", node=0, nodes=1, world_size=1, files=(m.FileEntry("a", 1, 0),)
    ).to_json()
    mutate(obj)
    assert m.Manifest.from_json(obj) is None


def test_remove_checkpoint_uncommits_before_deleting_files(tmp_path):
    """Removal deletes the manifests first and then the whole directory."""
    d = make_ckpt(tmp_path, 2, {"a": b"a"})
    commit(d, 2)
    remove_checkpoint(str(d))
    assert not d.exists()
    assert validity.committed_steps(str(tmp_path)) == []


def test_manifests_of_two_saves_of_one_step_never_commit_it(tmp_path):
    """Node 0's manifest of one save and node 1's of another (an attempt re-saved the step):
    not committed, whatever the files."""
    d = make_ckpt(tmp_path, 4, {"model": b"m"})
    owned = m.assign_owners({0: m.list_files(str(d)), 1: {"model": 1}})
    for node, save in ((0, "attempt-b"), (1, "attempt-a")):
        m.write_manifest(
            str(d),
            m.new_manifest(
                4, "jit", node=node, nodes=2, world_size=2, files=owned[node], save_id=save
            ),
        )
    assert validity.committed(str(d), node=0) is None
    assert "is of another save" in validity.incomplete_reason(m.read_manifests(str(d)))


def test_manifests_written_before_save_ids_read_as_one_legacy_save():
    """Manifests without a save id or lineage still read (as one save with id "")."""
    obj = m.new_manifest(3, "periodic", node=0, nodes=1, world_size=1, files=()).to_json()
    del obj["save_id"], obj["lineage"]
    parsed = m.Manifest.from_json(obj)
    assert parsed is not None
    assert (parsed.save_id, parsed.lineage) == ("", "")
    assert validity.complete_save({0: parsed}, 3) == {0: parsed}


def test_lineages_sort_in_birth_order():
    """The restore prefers the newest-born lineage: string order is birth order."""
    older, newer = m.new_lineage(1_700_000_000.0), m.new_lineage(1_700_000_000.5)
    assert older < newer
    assert older.startswith("20231114T221320000Z-")


def two_node_sharded_save(tmp_path: Path) -> tuple[Path, dict[int, m.Manifest]]:
    """checkpoint-4 of 2 nodes x 2 ranks as node 1's volume holds it after a per-node restore:
    its own shards, node 0's file of replicated values, and the shared files."""
    d = make_ckpt(
        tmp_path,
        4,
        {
            "trainer_state.json": b"{}",
            "opt/.metadata": b"m",
            "opt/__0_1.distcp": b"r",
            "opt/__2_0.distcp": b"22",
            "opt/__3_0.distcp": b"33",
        },
    )
    node0 = {
        "trainer_state.json": 2,
        "opt/.metadata": 1,
        "opt/__0_0.distcp": 2,
        "opt/__0_1.distcp": 1,
        "opt/__1_0.distcp": 2,
    }
    node1 = {"opt/__2_0.distcp": 2, "opt/__3_0.distcp": 2}
    entries = m.assign_owners({0: node0, 1: node1})
    reads = {0: (("opt",), ()), 1: (("opt",), ("opt/__0_1.distcp",))}
    save = {
        n: m.new_manifest(
            4,
            "periodic",
            node=n,
            nodes=2,
            world_size=4,
            files=entries[n],
            save_id="s",
            shard_dirs=reads[n][0],
            shard_reads=reads[n][1],
        )
        for n in (0, 1)
    }
    for man in save.values():
        m.write_manifest(str(d), man)
    return d, save


def test_a_node_of_a_sharded_save_reads_its_shards_the_listed_ones_and_every_other_file(
    tmp_path,
):
    d, save = two_node_sharded_save(tmp_path)
    union = validity.local_union(save)
    assert sorted(validity.node_files(save, 1, union)) == [
        "opt/.metadata",
        "opt/__0_1.distcp",
        "opt/__2_0.distcp",
        "opt/__3_0.distcp",
        "trainer_state.json",
    ]
    assert validity.node_files(save, 0, union).keys() == union.keys() - {
        "opt/__2_0.distcp",
        "opt/__3_0.distcp",
    }
    # Node 1's volume: loadable for node 1 at the save's size only; never held in full.
    assert validity.loadable(str(d), 1, 2, 4) is not None
    assert validity.loadable(str(d), 1) is not None
    assert validity.loadable(str(d), 0, 2, 4) is None  # node 0's shards are not here
    assert validity.loadable(str(d), 1, 1, 2) is None  # another size reshards: every file
    assert validity.committed(str(d)) is None


def test_the_shard_map_round_trips_and_manifests_without_it_read_every_file():
    man = m.new_manifest(
        4,
        "jit",
        node=1,
        nodes=2,
        world_size=4,
        files=(),
        shard_dirs=("", "opt"),
        shard_reads=("opt/__0_1.distcp",),
    )
    parsed = m.Manifest.from_json(json.loads(man.to_bytes()))
    assert parsed is not None
    assert (parsed.shard_dirs, parsed.shard_reads) == (("", "opt"), ("opt/__0_1.distcp",))
    plain = m.new_manifest(4, "jit", node=0, nodes=1, world_size=1, files=())
    assert "reads" not in plain.to_json()
    unsafe = {"dirs": ["../x"], "shards": []}
    assert m.Manifest.from_json({**plain.to_json(), "reads": unsafe}) is None


def test_the_hook_asks_for_the_rest_only_of_a_newest_checkpoint_it_cannot_load(
    tmp_path, monkeypatch
):
    """On node 1's volume (its part of a sharded save) a trainer that is node 0, or of another
    size, wants the rest; node 1 at the save's size does not. Without a sidecar nothing waits."""
    from jitckpt_entrypoint.config import Config
    from jitckpt_entrypoint.hook import resume
    from jitckpt_entrypoint.hook.session import Session
    from jitckpt_entrypoint.hook.topology import Topology

    two_node_sharded_save(tmp_path)

    def topo(node: int, nodes: int = 2, world: int = 4) -> Topology:
        return Topology(
            rank=0, world_size=world, local_world_size=world // nodes, node=node, nodes=nodes
        )

    assert resume._wanted(str(tmp_path), topo(1)) is None
    assert resume._wanted(str(tmp_path), topo(0)) == (4, "s", "")
    assert resume._wanted(str(tmp_path), topo(0, nodes=1, world=2)) == (4, "s", "")
    hook_log = logging.getLogger("jitckpt.hook")  # a Session sets it up; put it back after
    monkeypatch.setattr(hook_log, "handlers", list(hook_log.handlers))
    monkeypatch.setattr(hook_log, "propagate", hook_log.propagate)
    session = Session(Config.from_env({"JITCKPT_DIR": str(tmp_path / "jdir")}), topo(0), "run")
    started = time.monotonic()
    resume.fetch_missing(session)  # no sidecar in this pod: no request, no wait
    assert time.monotonic() - started < 1.0
    assert not (tmp_path / "jdir" / "status" / "fetch.json").exists()
