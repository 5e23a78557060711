"""The RAM writer: a process the entrypoint starts beside the trainer (JITCKPT_MEMORY_DIR set)
that writes the trainer's periodic saves from RAM to the volume, so that no thread of a training
process spends its time on the disk.

The hook takes a periodic save as a snapshot into JITCKPT_MEMORY_DIR (memory_tier.py) and asks
for it to be written out (protocol.write_out). The writer copies the committed snapshot's files
into `JITCKPT_DIR/checkpoints/checkpoint-<step>/` (which the hook made: what the Trainer wrote
there after its save call is kept), each durable before the next, and commits them through
protocol.commit like the hook's own commit: the manifests last, with the snapshot's save id and
lineage, staged for the sidecar, the save event recorded. It answers every request, written or
not.

SIGTERM (the entrypoint forwards the pod's): a copy in progress stops, its directory goes, and
the writer exits; the JIT save needs the disk, and it is newer. Training that ends without
SIGTERM and fails (a crash): the entrypoint asks for the newest snapshot when it is newer than
the volume (`Process.finish`), so a replacement pod, whose memory volume is new, resumes from it
too. A copy is committed only when its snapshot was not retired meanwhile (its files reused).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import signal
import sys
import time
from types import FrameType
from typing import Callable, Optional

from jitckpt_entrypoint import log
from jitckpt_entrypoint.config import Config
from jitckpt_entrypoint.errors import JitckptError
from jitckpt_entrypoint.protocol import durable, status, trainer_lock, write_out
from jitckpt_entrypoint.protocol import manifest as m
from jitckpt_entrypoint.protocol.commit import commit_node, remove_checkpoint
from jitckpt_entrypoint.protocol.layout import Layout, checkpoint_name
from jitckpt_entrypoint.protocol.validity import committed, files_match, newest_committed, newness

COMPONENT = "jitckpt-ram-writer"
POLL_SECONDS = 0.05
CHUNK = 64 << 20
"""Bytes per copy call: a SIGTERM stops a copy within one."""


class StoppedError(Exception):
    """SIGTERM arrived while a save was being written out."""


class RamWriter:
    """Writes committed snapshots of `memory_dir` to the volume at `root` (JITCKPT_DIR); also
    the sidecar's, for a trainer container that died whole (jitckpt_sidecar/ram_rescue.py)."""

    def __init__(
        self, memory_dir: str, root: str, upload: bool, run_id: str, logger: logging.Logger
    ) -> None:
        self.memory_dir = memory_dir
        self.layout = Layout(root)
        self.upload = upload
        """Stage what is written for the sidecar (JITCKPT_STORAGE_URI is set)."""
        self.run_id = run_id
        self.log = logger
        self.stopping = False

    def serve(self) -> None:
        """Answer requests until SIGTERM."""
        write_out.announce(self.memory_dir, self.run_id)
        self.log.info(
            "writing periodic saves from %s to %s", self.memory_dir, self.layout.checkpoints
        )
        parent = os.getppid()
        while not self.stopping:
            if os.getppid() != parent:  # the entrypoint died (not PID 1): nobody stops us
                return
            request = write_out.request(self.memory_dir)
            if request is None or request.run_id != self.run_id:
                time.sleep(POLL_SECONDS)
                continue
            write_out.answer(self.memory_dir, self.write(request))

    def write(self, request: write_out.Request) -> write_out.Answer:
        """Write snapshot `request.step` to the volume and commit it; the answer says how. A
        `fresh` request (after training failed: no live hook made the directory) first removes
        what an uncommitted directory of that step holds (a save cut short)."""
        step, name = request.step, checkpoint_name(request.step)
        started = time.monotonic()
        src = os.path.join(self.memory_dir, "checkpoints", name)
        dest = self.layout.checkpoint_dir(step)
        try:
            manifests = committed(src)
            if manifests is None:
                return self._failed(request, f"the snapshot {src} is not committed")
            own = manifests[min(manifests)]
            if own.nodes != 1:  # each node's holds what its ranks load, not its part of a save
                return self._failed(request, f"the snapshot {src} is of a job of several nodes")
            there = committed(dest)
            if there is not None:
                if newness(there[min(there)]) >= newness(own):  # the trainer's own save of the
                    return write_out.Answer(request.id, step, ok=True)  # step, or this one
                remove_checkpoint(dest)  # a save of an older run (lineage) at this step
            elif request.fresh and os.path.lexists(dest):
                remove_checkpoint(dest)
            nbytes = self._copy(src, dest, manifests, request.started_at)
            self._commit(dest, manifests, request)
        except StoppedError:
            with contextlib.suppress(OSError):
                remove_checkpoint(dest)
            self.log.info("%s not written out: stopping (SIGTERM)", name)
            return write_out.Answer(request.id, step, ok=False, error=write_out.STOPPED)
        except Exception as exc:  # noqa: BLE001 - every request gets its answer
            with contextlib.suppress(OSError):
                remove_checkpoint(dest)
            return self._failed(request, str(exc) or type(exc).__name__)
        seconds = time.monotonic() - started
        self.log.info(
            "committed %s from RAM (%.1f MB in %.2f s, %.0f MB/s)",
            name,
            nbytes / 1e6,
            seconds,
            nbytes / 1e6 / max(seconds, 1e-6),
        )
        return write_out.Answer(request.id, step, ok=True, bytes=nbytes, seconds=seconds)

    def _copy(
        self, src: str, dest: str, manifests: dict[int, m.Manifest], started_at: float
    ) -> int:
        """Every file the manifests list into `dest` (made by the hook: what the Trainer wrote
        there after its save call stays), each durable as it is written; the bytes copied."""
        entries = {e.path: e for manifest in manifests.values() for e in manifest.files}
        os.makedirs(dest, exist_ok=True)
        total, copied = 0, []
        for path, entry in sorted(entries.items()):
            target = os.path.join(dest, path)
            if _written_since(target, started_at):  # by the Trainer after its save call: its
                continue  # own save would have it so
            os.makedirs(os.path.dirname(target), exist_ok=True)
            with contextlib.suppress(FileNotFoundError):  # a new inode: staging/ may link it
                os.unlink(target)
            total += self._copy_file(os.path.join(src, path), target)
            copied.append(entry)
        durable.sync_tree(dest)  # the directories (the files are synced)
        if not files_match(dest, copied):  # changed or removed under us
            raise OSError(f"{dest} changed while it was written")
        # Nor was the snapshot retired meanwhile (a trainer still running: its files are then
        # the next snapshot's spares, written over): retiring withdraws its manifests first.
        again = committed(src)
        save_id = manifests[min(manifests)].save_id
        if again is None or again[min(again)].save_id != save_id:
            raise OSError(f"the snapshot {src} was retired while it was copied")
        return total

    def _copy_file(self, src: str, dest: str) -> int:
        """Copied in chunks, the disk's writeback one chunk behind (a SIGTERM stops it within
        one chunk: the JIT save is not kept waiting by a long writeback); durable when it
        returns."""
        with open(src, "rb") as fin, open(dest, "wb") as fout:
            size, offset = os.fstat(fin.fileno()).st_size, 0
            behind = _WriteBehind(fout.fileno())
            while offset < size:
                if self.stopping:
                    raise StoppedError
                sent = os.sendfile(fout.fileno(), fin.fileno(), offset, min(CHUNK, size - offset))
                if sent == 0:
                    break
                behind.wrote(offset, sent)
                offset += sent
            os.fdatasync(fout.fileno())
        return offset

    def _commit(
        self, dest: str, manifests: dict[int, m.Manifest], request: write_out.Request
    ) -> None:
        """The commit (protocol.commit): the snapshot's save id and lineage, every file in
        `dest`; staged for the sidecar; the save event."""
        if self.stopping:
            raise StoppedError
        node = min(manifests)  # one node (the RAM tier's condition)
        own = manifests[node]
        commit_node(
            self.layout,
            dest,
            {node: m.list_files(dest)},
            node=node,
            nodes=own.nodes,
            world_size=own.world_size,
            step=own.step,
            kind=own.kind,
            started_at=request.started_at,
            run_id=self.run_id,
            stage_for_upload=self.upload,
            save_id=own.save_id,
            lineage=own.lineage,
            synced=True,
        )
        # Whole, as committed (nothing else writes or removes it meanwhile; should anything,
        # it is not left committed).
        if committed(dest, node) is None:
            raise OSError(f"{dest} changed while it was committed")

    def _failed(self, request: write_out.Request, error: str) -> write_out.Answer:
        self.log.warning("%s not written out from RAM: %s", checkpoint_name(request.step), error)
        return write_out.Answer(request.id, request.step, ok=False, error=error)


def _written_since(path: str, started_at: float) -> bool:
    try:
        return os.stat(path).st_mtime > started_at
    except FileNotFoundError:
        return False


class _WriteBehind:
    """Writeback of a file written in chunks, one chunk behind the writes where the
    filesystem does it (ext4, XFS): each chunk's writeback starts at once (sync_file_range)
    and the previous one's is waited for, so the disk has the next chunk queued while one is
    synced (1.23x the copy's MB/s of an fdatasync per chunk on the CI VM's disk). Durability
    is the caller's fdatasync at the end (and the commit's fsync), never this. Where the call
    is missing or not allowed (not Linux, a seccomp profile), an fdatasync per chunk. A write
    error it reports is raised: on Linux it is reported once per open file, so an fdatasync
    after it would succeed and lose it."""

    WAIT_BEFORE, WRITE, WAIT_AFTER = 1, 2, 4
    UNSUPPORTED = frozenset(
        {errno.ENOSYS, errno.EPERM, errno.EINVAL, errno.ESPIPE, errno.EOPNOTSUPP}
    )

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.previous: Optional[tuple[int, int]] = None
        self.call = _sync_file_range()

    def wrote(self, offset: int, length: int) -> None:
        wait = self.WAIT_BEFORE | self.WRITE | self.WAIT_AFTER
        if (
            self.call is not None
            and self._range(offset, length, self.WRITE)
            and (self.previous is None or self._range(*self.previous, wait))
        ):
            self.previous = (offset, length)
            return
        self.call = None  # not there, or refused: an fdatasync per chunk from now on
        os.fdatasync(self.fd)

    def _range(self, offset: int, length: int, flags: int) -> bool:
        """True when done, False when not supported here; a write error is raised."""
        call = self.call
        if call is None:
            return False
        if call(self.fd, offset, length, flags) == 0:
            return True
        import ctypes

        code = ctypes.get_errno()
        if code in self.UNSUPPORTED:
            return False
        raise OSError(code, f"sync_file_range: {os.strerror(code)}")


_LIBC: list[Optional[Callable[..., int]]] = []


def _sync_file_range() -> Optional[Callable[..., int]]:
    """libc's sync_file_range (Linux), or None."""
    if not _LIBC:
        call: Optional[Callable[..., int]] = None
        try:
            import ctypes

            found = ctypes.CDLL(None, use_errno=True).sync_file_range
        except (ImportError, OSError, AttributeError):
            pass
        else:
            found.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
            found.restype = ctypes.c_int
            call = found
        _LIBC.append(call)
    return _LIBC[0]


class Process:
    """The entrypoint's handle on the writer it started: signals go to that process only (PID
    1 reaps it with every other child, and its pid may then be reused)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.start = write_out.start_time(pid)

    def alive(self) -> bool:
        return self.start is not None and write_out.start_time(self.pid) == self.start

    def signal(self, signo: int) -> None:
        if self.alive():
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signo)

    def finish(self, cfg: Config, run_id: str, logger: logging.Logger, crashed: bool) -> None:
        """After training ended without SIGTERM, within JITCKPT_GRACE_SECONDS in all: the save
        handed over before it is written out, then, when training failed (`crashed`), the
        newest snapshot in RAM when it is newer than every checkpoint on the volume. A pod that
        is replaced, not restarted in place, loses its memory volume: a crash without notice
        then costs what ran since the newest periodic save, not since the newest snapshot."""
        memory_dir = cfg.memory_dir
        deadline = time.monotonic() + cfg.grace_seconds
        if not crashed:
            self._wait(lambda: write_out.request(memory_dir) is None, deadline)
            return
        # Asked only once the writer has announced itself: its announcement removes what an
        # earlier writer left, a request made before it too (a trainer that failed at once).
        if not self._wait(
            lambda: (
                write_out.writer(memory_dir, run_id) == self.pid
                and write_out.request(memory_dir) is None
            ),
            deadline,
        ):
            return
        try:
            step = newer_snapshot(memory_dir, cfg.dir)
        except OSError as exc:
            logger.warning(
                "cannot tell whether a snapshot in RAM is newer than the volume: %s", exc
            )
            return
        if step is None or not self.alive():
            return
        name = checkpoint_name(step)
        logger.info("training failed without SIGTERM: writing %s from RAM to the volume", name)
        request = write_out.Request(write_out.new_id(), step, time.time(), run_id, fresh=True)
        try:
            write_out.ask(memory_dir, request)
        except OSError as exc:
            logger.warning("cannot ask the RAM writer for %s: %s", name, exc)
            return
        if not self._wait(lambda: write_out.answered(memory_dir, request.id) is not None, deadline):
            logger.warning(
                "%s not written out from RAM within JITCKPT_GRACE_SECONDS (%gs)",
                name,
                cfg.grace_seconds,
            )

    def _wait(self, done: Callable[[], bool], deadline: float) -> bool:
        """Until `done()` (True) or the deadline, or the writer is gone (False)."""
        while time.monotonic() < deadline:
            try:
                if not self.alive():
                    return False
                if done():
                    return True
            except OSError:
                return False
            time.sleep(POLL_SECONDS)
        return False

    def stop(self, wait: float = 5.0) -> None:
        """After training: SIGTERM, SIGKILL after `wait` seconds; reaped."""
        self.signal(signal.SIGTERM)
        deadline = time.monotonic() + wait
        while self.alive():
            try:
                done, _ = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # reaped already (PID 1 reaps every child)
                return
            if done:
                return
            if time.monotonic() >= deadline:
                self.signal(signal.SIGKILL)
                with contextlib.suppress(ChildProcessError):
                    os.waitpid(self.pid, 0)
                return
            time.sleep(0.02)


def newer_snapshot(memory_dir: str, root: str) -> Optional[int]:
    """The step of the newest committed snapshot in `memory_dir` (JITCKPT_MEMORY_DIR) when it
    is newer than every committed checkpoint on the volume at `root` (JITCKPT_DIR; in resume's
    order: lineage, then step; the volume's save of a step wins), else None. Never a snapshot
    of a job of several nodes: a node's holds what its ranks load, not its part of a save."""
    snapshots = Layout(memory_dir).checkpoints
    step = newest_committed(snapshots)
    snapshot = None if step is None else committed(os.path.join(snapshots, checkpoint_name(step)))
    if step is None or snapshot is None or snapshot[min(snapshot)].nodes != 1:
        return None
    node = min(snapshot)  # the snapshot's node: what this node's volume holds of a save
    volume = Layout(root)
    newest = newest_committed(volume.checkpoints, node)
    theirs = committed(volume.checkpoint_dir(newest), node) if newest is not None else None
    if theirs is not None and newness(theirs[min(theirs)]) >= newness(snapshot[min(snapshot)]):
        return None
    return step


def start(env: dict[str, str], logger: logging.Logger) -> Optional[Process]:
    """The entrypoint: run the writer beside the trainer (`env`: its settings and run id, no
    hook on PYTHONPATH), or None (one line why: the hook then writes saves itself)."""
    argv = [sys.executable, "-m", __name__]
    try:
        pid = os.posix_spawn(
            sys.executable,
            argv,
            env,
            setsid=True,
            setsigdef=(signal.SIGTERM, signal.SIGINT, signal.SIGPIPE, signal.SIGCHLD),
        )
    except OSError as exc:
        logger.warning("cannot start the RAM writer (%s): the trainer writes its saves", exc)
        return None
    return Process(pid)


def main(argv: Optional[list[str]] = None) -> int:
    """`python -m jitckpt_entrypoint.ram_writer`, started by the entrypoint with the trainer's
    environment (the resolved settings, the run id)."""
    del argv
    try:
        cfg = Config.from_env(os.environ)
    except JitckptError as exc:
        sys.stderr.write(f"{COMPONENT}: error: {exc}\n")
        return 2
    logger = log.setup(COMPONENT, cfg.log_format)
    run_id = os.environ.get(status.RUN_ID_ENV, "")
    if not cfg.memory_dir or not run_id:
        logger.error("JITCKPT_MEMORY_DIR and %s must be set; nothing to do", status.RUN_ID_ENV)
        return 2
    if trainer_lock.hold(Layout(cfg.dir).status, 0.0, lambda: None) is None:  # the sidecar
        logger.debug("cannot hold the trainer's lock")  # trusts it only with the entrypoint's
    writer = RamWriter(cfg.memory_dir, cfg.dir, bool(cfg.storage_uri), run_id, logger)

    def stop(signo: int, frame: Optional[FrameType]) -> None:
        del signo, frame
        writer.stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    try:
        writer.serve()
    except OSError as exc:
        logger.error("cannot write saves out from RAM: %s", exc)  # noqa: TRY400 - one line
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
