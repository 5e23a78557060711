"""The protocol package: stdlib only, and the commit both the hook and the harness run."""

from __future__ import annotations

import os
import pkgutil
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from jitckpt_entrypoint import protocol
from jitckpt_entrypoint.protocol import manifest as m
from jitckpt_entrypoint.protocol import status, validity
from jitckpt_entrypoint.protocol.commit import commit_node
from jitckpt_entrypoint.protocol.layout import Layout, checkpoint_steps

MODULES = sorted(f"{protocol.__name__}.{i.name}" for i in pkgutil.iter_modules(protocol.__path__))
ENTRYPOINT_ROOT = str(Path(protocol.__file__).resolve().parents[2])


def _python39() -> str | None:
    found = sorted(Path("/root/.pyenv/versions").glob("3.9.*/bin/python3.9"))
    return str(found[0]) if found else shutil.which("python3.9")


@pytest.mark.parametrize("python", [sys.executable, _python39()], ids=["this python", "3.9"])
def test_every_protocol_module_imports_with_the_standard_library_alone(python):
    """Without site-packages (-S -I) each module imports, on this python and on 3.9 (the
    swap-in bundle runs under the training image's python3): stdlib only, 3.9 syntax."""
    if python is None:
        pytest.skip("no python3.9 on this machine")
    code = (
        "import importlib, sys\n"
        f"sys.path.insert(0, {ENTRYPOINT_ROOT!r})\n"
        f"for name in {MODULES!r}:\n"
        "    importlib.import_module(name)\n"
        "print('ok')\n"
    )
    out = subprocess.run(
        [python, "-S", "-I", "-c", code], capture_output=True, text=True, check=False, timeout=60
    )
    assert (out.returncode, out.stdout) == (0, "ok\n"), out.stderr
    assert len(MODULES) >= 7


def two_nodes(tmp_path: Path) -> tuple[list[Layout], dict[int, dict[str, int]]]:
    """checkpoint-10 on two nodes' volumes: both hold the config, each its own shard."""
    layouts = [Layout(str(tmp_path / f"node{n}")) for n in (0, 1)]
    holdings = {}
    for node, layout in enumerate(layouts):
        layout.ensure()
        ckpt = Path(layout.checkpoint_dir(10))
        ckpt.mkdir()
        (ckpt / "config.json").write_bytes(b"{}")
        (ckpt / f"shard-{node}.bin").write_bytes(b"s" * (100 + node))
        holdings[node] = m.list_files(str(ckpt))
    return layouts, holdings


def commit10(
    layouts: list[Layout],
    holdings: dict[int, dict[str, int]],
    node: int,
    *,
    staged: bool = True,
    kind: str = "periodic",
    world_size: int = 2,
    started_at: float = 0.0,
) -> status.SaveEvent:
    """Commit node `node`'s part of the two-node checkpoint-10."""
    layout = layouts[node]
    return commit_node(
        layout,
        layout.checkpoint_dir(10),
        holdings,
        node=node,
        nodes=2,
        world_size=world_size,
        step=10,
        kind=kind,
        started_at=started_at,
        run_id="r",
        save_id="save-10",
        lineage="L",
        stage_for_upload=staged,
    )


def test_commit_node_writes_every_manifest_stages_owned_files_and_records_the_save(tmp_path):
    """Each node's volume gets every node's manifest (committed there for every node's own
    part), its staged directory only the files it owns (ready for upload), and a save event."""
    layouts, holdings = two_nodes(tmp_path)
    events = [
        commit10(layouts, holdings, node, kind="jit", world_size=4, started_at=100.0)
        for node in range(len(layouts))
    ]
    for node, layout in enumerate(layouts):
        manifests = validity.committed(layout.checkpoint_dir(10), node)
        assert manifests is not None
        assert sorted(manifests) == [0, 1]
        staged = validity.staged(layout.staged_dir(10))
        assert staged is not None
        assert (staged.node, staged.kind, staged.world_size) == (node, "jit", 4)
        assert {e.path for e in staged.owned} == (
            {"config.json", "shard-0.bin"} if node == 0 else {"shard-1.bin"}
        )
        assert sorted(os.listdir(layout.staged_dir(10))) == sorted(
            [m.manifest_name(node), *(e.path for e in staged.owned)]
        )
        event = status.read_save_event(os.path.join(layout.status, status.save_event_name(10)))
        assert event == events[node]
        assert (event.kind, event.node, event.run_id, event.started_at) == ("jit", node, "r", 100.0)
    assert events[1].bytes == 2 + 101  # what node 1 holds, owned or not


def test_without_upload_nothing_is_staged(tmp_path):
    layouts, holdings = two_nodes(tmp_path)
    commit10(layouts, holdings, 0, staged=False)
    assert checkpoint_steps(layouts[0].staging) == []
    assert validity.committed(layouts[0].checkpoint_dir(10), 0) is not None


def test_a_staged_directory_is_ready_only_whole_and_of_its_kind(tmp_path):
    """Staged: one manifest, every owned file at its size, a checkpoint kind and the directory's
    step; the final model (kind output) only when asked for as the final model."""
    layouts, holdings = two_nodes(tmp_path)
    layout = layouts[1]
    commit10(layouts, holdings, 1, staged=True)
    staged = layout.staged_dir(10)
    assert validity.staged(staged) is not None
    assert validity.staged(staged, final=True) is None
    Path(staged, "shard-1.bin").write_bytes(b"short")
    assert validity.staged(staged) is None
    os.rename(layout.checkpoint_dir(10), layout.final)  # a directory named final/
    assert validity.staged(layout.final) is None


def test_file_problems_names_each_missing_or_resized_file():
    entries = [m.FileEntry("a", 1), m.FileEntry("b", 2), m.FileEntry("c", 3)]
    sizes = {"a": 1, "b": 5}
    assert list(validity.file_problems(entries, sizes.get, "object")) == [
        "b: object has 5 bytes, not 2",
        "c: object missing",
    ]


def test_list_files_leaves_out_pruned_directories_manifests_and_temp_files(tmp_path):
    (tmp_path / "keep" / "deep").mkdir(parents=True)
    (tmp_path / "skip").mkdir()
    for rel in ("a.bin", "keep/deep/b.bin", "skip/c.bin", m.manifest_name(0), ".x.1.tmp"):
        (tmp_path / rel).write_bytes(b"12")
    os.symlink(tmp_path / "a.bin", tmp_path / "link.bin")
    found = m.list_files(str(tmp_path), lambda _parent, name: name == "skip")
    assert found == {"a.bin": 2, "keep/deep/b.bin": 2}


def test_a_commit_makes_every_file_and_directory_durable_before_any_manifest(
    tmp_path: Path, monkeypatch
):
    """Whatever path wrote the files (the Trainer's own save, DeepSpeed, FSDP, a plain loop),
    the commit fsyncs each file, each directory under the checkpoint, the checkpoint directory
    and `checkpoints/` itself before the first manifest exists."""
    layout = Layout(str(tmp_path))
    layout.ensure()
    ckpt = Path(layout.checkpoint_dir(10))
    (ckpt / "global_step10").mkdir(parents=True)
    (ckpt / "model.safetensors").write_bytes(b"w" * 100)
    (ckpt / "global_step10" / "states.pt").write_bytes(b"s" * 10)
    synced: list[str] = []
    manifests_seen_at: list[int] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        path = os.readlink(f"/proc/self/fd/{fd}")
        if os.path.basename(path).startswith(m.MANIFEST_PREFIX) or ".tmp" in path:
            manifests_seen_at.append(len(synced))
        else:
            synced.append(path)
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    commit_node(
        layout,
        str(ckpt),
        {0: m.list_files(str(ckpt))},
        node=0,
        nodes=1,
        world_size=1,
        step=10,
        kind="periodic",
        started_at=0.0,
        run_id="r",
        save_id="save-10",
        lineage="L",
        stage_for_upload=False,
    )
    wanted = {
        str(ckpt / "model.safetensors"),
        str(ckpt / "global_step10" / "states.pt"),
        str(ckpt / "global_step10"),
        str(ckpt),
        layout.checkpoints,
    }
    first_manifest = manifests_seen_at[0]
    assert wanted <= set(synced[:first_manifest]), synced
    assert validity.committed(str(ckpt)) is not None


def test_an_unsynced_restore_counts_on_its_own_boot_only(tmp_path, monkeypatch):
    """The marker's boot id decides: this boot's counts, another boot's, a torn marker, or a
    kernel without a boot id does not; settle syncs this boot's and removes the marker."""
    from jitckpt_entrypoint.protocol import durable

    roots = [tmp_path / "node"]
    layout = Layout(str(roots[0]))
    layout.ensure()
    ckpt = layout.checkpoint_dir(7)
    os.makedirs(ckpt)
    Path(ckpt, "model.bin").write_bytes(b"m" * 10)
    holdings = {0: m.list_files(ckpt)}
    durable.mark_unsynced(ckpt)
    commit_node(
        layout,
        ckpt,
        holdings,
        node=0,
        nodes=1,
        world_size=1,
        step=7,
        kind="periodic",
        started_at=0.0,
        run_id="r",
        stage_for_upload=False,
        save_id="s",
        lineage="L",
    )
    assert validity.committed(ckpt) is not None
    marker = Path(ckpt, durable.UNSYNCED)
    for foreign in ("another-boot", ""):
        monkeypatch.setattr(durable, "boot_id", lambda foreign=foreign: foreign)
        assert validity.committed(ckpt) is None
        assert not durable.settle(ckpt)
    monkeypatch.undo()
    good = marker.read_bytes()
    marker.write_bytes(b"\xff\xfe")  # torn by a crash
    assert validity.committed(ckpt) is None
    marker.write_bytes(good)
    assert durable.settle(ckpt)
    assert not marker.exists()
    assert not durable.settle(ckpt)
    monkeypatch.setattr(durable, "boot_id", lambda: "another-boot")
    assert validity.committed(ckpt) is not None
