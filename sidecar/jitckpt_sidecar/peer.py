"""The peer replica: each node's newest snapshot in RAM is also held by another node's sidecar.

A ring over the job's nodes: node k's sidecar keeps a copy of node k-1's newest snapshot
(JITCKPT_MEMORY_DIR `checkpoints/`, what the trainer snapshots there: hook/memory_tier.py) in
`<JITCKPT_MEMORY_DIR>/replica/`, so node k's own is held by node k+1. A replacement pod for a
lost node starts with an empty memory volume: before its restore from S3, its sidecar asks the
node that holds its replica and puts the copy among its own snapshots, byte for byte what the
lost node held. The trainer's resume then takes it like its own (hook/resume.py): when every
node holds that save in RAM and it is newer than what the volume holds. The restore order is
own RAM (a pod restarted in place asks nobody), the peer's copy, the volume, S3; a resume takes
one save id on every node, so never a mix of saves.

Consistency: snapshots are written over the pages of retired ones (hook/ram_files.py), and a
retire withdraws the manifests first. A copy is kept only when, after its last byte, the node
that served it still serves the same save: nothing it read can have been written over since.
The copy must then be committed as its node's part (validity.whole_here: every manifest, each
file of the node's at its listed size) before it is renamed into place; a copy cut short is
never committed, and the older replica stays until a newer one is.

HTTP on the sidecar's port (server.py), every request carrying JITCKPT_PEER_TOKEN as a bearer
token (compared in constant time; a missing or wrong one gets 401):
- `GET /peer/v1/snapshot/<node>`: the newest snapshot of node <node> this sidecar holds (its
  own node's, or the replica), as JSON: step, save id, lineage, created_at and every file with
  its size; 404 when none.
- `GET /peer/v1/file/<node>/<step>/<path>`: one file of it, streamed.
Transfers stream in 1 MiB chunks both ways (bounded memory). The token crosses the pod network
in the clear unless the cluster encrypts it (a mesh, WireGuard CNI); the data is the model.

Memory: the replica holds one snapshot of another node in this pod's memory volume, two while a
newer one is copied; size the volume for four snapshots (two own, two held) with the replica on.

Threads: `keep` on a thread of its own (started after the restore, stopped with the sidecar);
`restore_own` on the main thread before the restore from S3; the HTTP handlers on the server's
request threads (they only read).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hmac
import http.client
import json
import logging
import os
import shutil
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterable, Iterator
from typing import Any, Callable, Optional

from jitckpt_entrypoint.hook import room
from jitckpt_entrypoint.protocol import manifest as m
from jitckpt_entrypoint.protocol import status
from jitckpt_entrypoint.protocol.commit import remove_checkpoint
from jitckpt_entrypoint.protocol.layout import checkpoint_name, checkpoint_steps
from jitckpt_entrypoint.protocol.validity import whole_here

PREFIX = "/peer/v1/"
POLL = 0.5
"""Seconds between looks at a peer: the source's newest snapshot, the holder's copy of this
node's (a small JSON answer each)."""
TIMEOUT = 10.0
"""Seconds a peer has to connect and to send each chunk."""
CHUNK = 1 << 20
BACKOFF_MAX = 10.0
"""Seconds between a failing keeper's tries at most."""
REPLICA = "replica"
INCOMING = ".incoming"
STARTED = "sidecar-started"


@dataclasses.dataclass(frozen=True)
class Restored:
    """`<memory>/replica/restored.json`: the snapshot `restore_own` brought at the pod's start
    (the restore init container's, read by the sidecar after it: the recovery's label)."""

    step: int
    bytes: int


RESTORED = status.StatusFile("restored.json", Restored)


@dataclasses.dataclass(frozen=True)
class Held:
    """A snapshot one sidecar holds: of node `node`, as its index names it."""

    node: int
    step: int
    save_id: str
    lineage: str
    created_at: float
    files: tuple[tuple[str, int], ...]

    @property
    def key(self) -> tuple[int, str]:
        return self.step, self.save_id

    @property
    def bytes(self) -> int:
        return sum(size for _, size in self.files)

    def to_json(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "files": [list(f) for f in self.files]}

    @classmethod
    def from_json(cls, obj: Any) -> Optional[Held]:
        try:
            files = tuple((str(p), int(s)) for p, s in obj["files"])
            held = cls(
                int(obj["node"]),
                int(obj["step"]),
                str(obj["save_id"]),
                str(obj["lineage"]),
                float(obj["created_at"]),
                files,
            )
        except (KeyError, TypeError, ValueError):
            return None
        return held if all(_safe(p) for p, _ in files) else None


def _safe(relpath: str) -> bool:
    """A relative path that stays inside its directory."""
    parts = relpath.split("/")
    return bool(relpath) and not relpath.startswith("/") and ".." not in parts and "" not in parts


def newest(
    checkpoints: str, node: int, nodes: int, step: Optional[int] = None
) -> Optional[tuple[str, Held]]:
    """The newest snapshot in `checkpoints` (or that of `step`, while it is committed) that node
    `node` of a job of `nodes` nodes resumes from alone (validity.whole_here), with its
    directory."""
    steps = checkpoint_steps(checkpoints) if step is None else [step]
    for each in reversed(steps):
        path = os.path.join(checkpoints, checkpoint_name(each))
        save = whole_here(path, node)
        if save is None or save[node].nodes != nodes:
            continue
        own = save[node]
        files = []
        for parent, _, names in os.walk(path):
            for name in names:
                full = os.path.join(parent, name)
                with contextlib.suppress(OSError):
                    files.append((os.path.relpath(full, path), os.lstat(full).st_size))
        return path, Held(node, each, own.save_id, own.lineage, own.created_at, tuple(files))
    return None


class PeerError(Exception):
    """A peer that did not answer as one, or a copy that is not whole and unchanged."""


@dataclasses.dataclass(frozen=True)
class Answer:
    """A sidecar's answer about a node: the snapshot of it that it holds (None: none), and why
    it cannot keep that node's newest now (its keeper's last failure), if so."""

    held: Optional[Held]
    failing: Optional[str] = None


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args: Any, **kwargs: Any) -> None:  # noqa: ARG002
        return None  # a peer never redirects: the token goes nowhere else


class PeerReplica:
    def __init__(
        self,
        memory_dir: str,
        node: int,
        peers: tuple[str, ...],
        token: str,
        logger: logging.Logger,
        *,
        poll: float = POLL,
    ) -> None:
        self.memory_dir, self.node, self.peers, self.log = memory_dir, node, peers, logger
        self._auth = f"Bearer {token}"
        self.poll = poll
        self.nodes = len(peers)
        self.source = (node - 1) % self.nodes
        """The node whose snapshot this one keeps."""
        self.holder = (node + 1) % self.nodes
        """The node that keeps this one's."""
        self._replica_dir = os.path.join(memory_dir, REPLICA)
        self.own = os.path.join(memory_dir, "checkpoints")
        self.replica = os.path.join(memory_dir, REPLICA, "checkpoints")
        self._incoming = os.path.join(memory_dir, REPLICA, INCOMING)
        # In-cluster only: never through an egress proxy of the environment (the token and the
        # model would leave the cluster), never redirected.
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}), _NoRedirect)
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._said: Optional[str] = None
        """The keeper's last warning (said once until it changes or a copy succeeds)."""
        self.failing: Optional[str] = None
        """Why the keeper cannot keep the source's newest now (told to the source's sidecar:
        its trainer does not wait for this copy then)."""
        self.held: Optional[Held] = None
        """The replica held (for the metrics)."""
        shutil.rmtree(self._incoming, ignore_errors=True)  # a copy cut short by a kill
        with contextlib.suppress(OSError):
            found = newest(self.replica, self.source, self.nodes)
            self.held = found[1] if found else None

    def metric(self) -> tuple[Optional[float], int]:
        """The kept snapshot's creation time (None while none is kept) and bytes."""
        held = self.held
        return (None, 0) if held is None else (held.created_at, held.bytes)

    # -- serving --

    def app(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        """The WSGI app of PREFIX (server.py routes it here; PATH_INFO arrives unquoted)."""
        given = environ.get("HTTP_AUTHORIZATION", "")
        if not hmac.compare_digest(given.encode(), self._auth.encode()):
            return _answer(start_response, "401 Unauthorized", b"a valid peer token is needed\n")
        if environ.get("REQUEST_METHOD", "GET") != "GET":
            return _answer(start_response, "405 Method Not Allowed", b"GET only\n")
        path = environ.get("PATH_INFO", "")[len(PREFIX) :]
        kind, _, rest = path.partition("/")
        try:
            if kind == "snapshot":
                query = urllib.parse.parse_qs(environ.get("QUERY_STRING", ""))
                step = int(query["step"][0]) if "step" in query else None
                return self._index(int(rest), step, start_response)
            if kind == "file":
                node, step_text, relpath = rest.split("/", 2)
                return self._file(int(node), int(step_text), relpath, start_response)
        except ValueError:
            pass
        return _answer(start_response, "404 Not Found", b"no such peer path\n")

    def _index(
        self, node: int, step: Optional[int], start_response: Callable[..., Any]
    ) -> Iterable[bytes]:
        if node == self.node:
            found, failing = newest(self.own, node, self.nodes, step), None
        elif node == self.source:
            found, failing = newest(self.replica, node, self.nodes, step), self.failing
        else:
            return _answer(start_response, "404 Not Found", b"not a node this sidecar keeps\n")
        held = None if found is None else found[1].to_json()
        body = json.dumps({"node": node, "held": held, "failing": failing}).encode()
        start_response("200 OK", _headers("application/json", len(body)))
        return [body]

    def _file(
        self, node: int, step: int, relpath: str, start_response: Callable[..., Any]
    ) -> Iterable[bytes]:
        root = self.own if node == self.node else self.replica
        if node not in (self.node, self.source) or not _safe(relpath):
            return _answer(start_response, "404 Not Found", b"no such file\n")
        try:
            handle = open(os.path.join(root, checkpoint_name(step), relpath), "rb")  # noqa: SIM115 - closed by _stream
            size = os.fstat(handle.fileno()).st_size
        except OSError:
            return _answer(start_response, "404 Not Found", b"no such file\n")
        start_response("200 OK", _headers("application/octet-stream", size))
        return _stream(handle)

    # -- keeping the source's newest --

    def start(self) -> None:
        for target, name in ((self.keep, "jitckpt-peer"), (self.watch, "jitckpt-peer-kept")):
            thread = threading.Thread(target=target, name=name, daemon=True)
            thread.start()
            self._threads.append(thread)
        self.log.info(
            "peer replica: keeping node %d's newest snapshot; node %d keeps this node's",
            self.source,
            self.holder,
        )

    def cancel(self) -> None:
        """SIGTERM: no more copies (one in progress stops within a chunk), no more records;
        the drain's uploads have the network."""
        self._stop.set()

    def stop(self, wait: float = 1.0) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=wait)

    def keep(self) -> None:
        """Copy the source's newest every poll; after a failure, again in 1, 2, 4, 8, 10 s."""
        wait = self.poll
        while not self._stop.wait(wait):
            try:
                self.refresh()
                wait = self.poll
            except Exception as exc:  # noqa: BLE001 - one line a kind; tried again later
                self.failing = str(exc)
                wait = min(BACKOFF_MAX, max(1.0, wait * 2))
                if not self._stop.is_set():
                    self._say(f"peer replica: cannot keep node {self.source}'s snapshot: {exc}")

    def refresh(self) -> bool:
        """Copy the source's newest snapshot when it is not the one held; True when copied. A
        source with none keeps the copy held: it may be the lost node's replacement, whose
        sidecar asks for exactly that copy."""
        index = self._ask(self.source, self.source).held
        if index is None or (self.held is not None and _same(self.held, index)):
            self.failing = None
            return False
        shutil.rmtree(self._incoming, ignore_errors=True)
        free, reserve = room.free_bytes(self.memory_dir), self._reserve()
        if free < index.bytes + reserve:
            kept = f" beside room for this node's next ({room.gb(reserve)})" if reserve else ""
            raise PeerError(
                f"{checkpoint_name(index.step)} takes {room.gb(index.bytes)}{kept} and the "
                f"memory volume has {room.gb(free)} free; size it for four snapshots (two of "
                "this node's, two of its peer's)"
            )
        started = time.monotonic()
        self._copy(self.source, index, self.replica)
        self.held, self.failing, self._said = index, None, None
        for other in checkpoint_steps(self.replica):
            if other != index.step:
                remove_checkpoint(os.path.join(self.replica, checkpoint_name(other)))
        self.log.debug(
            "peer replica: %s of node %d copied (%s)",
            checkpoint_name(index.step),
            self.source,
            _rate(index.bytes, time.monotonic() - started),
        )
        return True

    def _reserve(self) -> int:
        """The free bytes the trainer's own two snapshots still need: a copy never takes them
        (the older of two is written over by the next, ram_files.py: it needs none)."""
        found = newest(self.own, self.node, self.nodes)
        if found is None:
            return 0
        used = room.tree_bytes(self.own)  # its snapshots and their spares (ram_files.SPARE)
        return max(0, 2 * found[1].bytes - used)

    # -- what the holder keeps of this node (for the trainer's RAM tier) --

    def watch(self) -> None:
        """Tell the trainer, every poll, which snapshot of this node its holder keeps
        (status.PEER_KEPT): its RAM tier keeps an older snapshot, and takes no new one, until
        the newest is kept there (hook/memory_tier.py `replicating`)."""
        while not self._stop.wait(self.poll):
            self.report()

    def report(self) -> None:
        """One record: `live` only while the holder answers and can keep this node's newest
        (a holder failing, unreachable or without the peer replica is not waited for)."""
        try:
            answer = self._ask(self.holder, self.node)
            step, save_id = (None, None) if answer.held is None else answer.held.key
            record = status.PeerKept(answer.failing is None, step, save_id, time.time())
        except PeerError:
            record = status.PeerKept(False, None, None, time.time())
        with contextlib.suppress(OSError):  # the next poll writes it again
            status.PEER_KEPT.write(self.memory_dir, record)

    # -- restoring this node's own --

    def restore_own(self, *, before_trainer: bool = False) -> Optional[tuple[int, int]]:
        """The first sidecar on this memory volume (a new pod: the volume goes with it), the
        volume without snapshots: this node's newest from the node that keeps it, among its
        own snapshots; (step, bytes), or None. `before_trainer`: the restore init container,
        which no trainer can run beside: it asks again when re-run (its copy or its restore
        failed), and no sidecar after it does. Never raises; SIGTERM (`cancel`) stops it."""
        try:
            first = self._first_on_volume()
            if not (first or before_trainer) or checkpoint_steps(self.own):
                return None  # restarted in place: the trainer's own snapshots, whatever they are
            answer = self._ask(self.holder, self.node)
            index = answer.held
            if index is None:
                self.log.info(
                    "peer replica: node %d holds no snapshot of this node; restoring as before",
                    self.holder,
                )
                return None
            started = time.monotonic()
            self._copy(self.holder, index, self.own, replace=False)
        except Exception as exc:  # noqa: BLE001 - the restore from S3 goes on without it
            self.log.warning(
                "peer replica: cannot restore this node's snapshot from node %d: %s",
                self.holder,
                exc,
            )
            return None
        self.log.info(
            "peer replica: restored %s (a snapshot in RAM) from node %d: %s",
            checkpoint_name(index.step),
            self.holder,
            _rate(index.bytes, time.monotonic() - started),
        )
        with contextlib.suppress(OSError):  # for the recovery's label (a later sidecar's too)
            RESTORED.write(self._replica_dir, Restored(index.step, index.bytes))
        return index.step, index.bytes

    def restored_at_start(self) -> Optional[tuple[int, int]]:
        """(step, bytes) of the snapshot restore_own restored in this pod (the restore init
        container's, or this sidecar's), or None."""
        record = RESTORED.read(self._replica_dir)
        return None if record is None else (record.step, record.bytes)

    def _first_on_volume(self) -> bool:
        """Whether no sidecar ran on this memory volume before (a marker there says one did)."""
        os.makedirs(os.path.join(self.memory_dir, REPLICA), exist_ok=True)
        try:
            os.close(
                os.open(os.path.join(self.memory_dir, REPLICA, STARTED), os.O_CREAT | os.O_EXCL)
            )
        except FileExistsError:
            return False
        return True

    # -- transfers --

    def _ask(self, peer: int, node: int, step: Optional[int] = None) -> Answer:
        """What `peer` holds of `node` (of `step`, while committed there); PeerError when it
        is unreachable or does not answer as a peer."""
        path = f"snapshot/{node}" + ("" if step is None else f"?step={step}")
        try:
            with self._get(peer, path) as answer:
                body = answer.read(1 << 24)
        except urllib.error.HTTPError as exc:
            hint = {
                401: " (its JITCKPT_PEER_TOKEN differs)",
                404: " (no peer replica there: JITCKPT_PEERS unset, or its memory volume "
                "read-only)",
            }.get(exc.code, "")
            raise PeerError(f"node {peer} answered {exc.code} {exc.reason}{hint}") from None
        except (OSError, ValueError, http.client.HTTPException) as exc:
            raise PeerError(f"node {peer} unreachable ({_reason(exc)})") from None
        parsed = _parse(body, node)
        if parsed is None:
            raise PeerError(f"node {peer} answered something other than a peer's answer")
        return parsed

    def _copy(self, peer: int, index: Held, checkpoints: str, *, replace: bool = True) -> None:
        """Every file of `index` from `peer` into `checkpoints/checkpoint-<step>`, manifests
        last, kept only when committed and still committed at `peer` afterwards (`replace`:
        an older copy of the step there goes; else one there ends it)."""
        name = checkpoint_name(index.step)
        incoming = os.path.join(self._incoming, name)
        shutil.rmtree(self._incoming, ignore_errors=True)
        try:
            ordered = sorted(index.files, key=lambda f: (m.is_manifest_name(f[0]), f[0]))
            for relpath, size in ordered:
                self._fetch(peer, index, relpath, size, os.path.join(incoming, relpath))
            if whole_here(incoming, index.node) is None:
                raise PeerError(f"{name} from node {peer} is not committed whole")
            if not _same(self._ask(peer, index.node, index.step).held, index):
                raise PeerError(f"{name} changed at node {peer} during the copy")
            os.makedirs(checkpoints, exist_ok=True)
            final = os.path.join(checkpoints, name)
            if os.path.exists(final):
                if not replace:
                    raise PeerError(f"{name} appeared in {checkpoints} during the copy")
                remove_checkpoint(final)
            os.rename(incoming, final)
        finally:
            shutil.rmtree(self._incoming, ignore_errors=True)

    def _fetch(self, peer: int, index: Held, relpath: str, size: int, dest: str) -> None:
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        quoted = urllib.parse.quote(relpath)
        got = 0
        try:
            path = f"file/{index.node}/{index.step}/{quoted}"
            with self._get(peer, path) as answer, open(dest, "wb") as out:
                while chunk := answer.read(CHUNK):
                    if self._stop.is_set():
                        raise PeerError("stopped (SIGTERM)")
                    out.write(chunk)
                    got += len(chunk)
        except urllib.error.HTTPError as exc:
            raise PeerError(f"{relpath}: node {peer} answered {exc.code} {exc.reason}") from None
        except (OSError, ValueError, http.client.HTTPException) as exc:
            raise PeerError(f"{relpath}: from node {peer}: {_reason(exc)}") from None
        if got != size:
            raise PeerError(f"{relpath}: {got} bytes from node {peer}, not {size}")

    def _get(self, peer: int, path: str) -> Any:
        url = self.peers[peer].rstrip("/") + PREFIX + path  # http(s) only: config.py
        request = urllib.request.Request(url, headers={"Authorization": self._auth})  # noqa: S310
        return self._opener.open(request, timeout=TIMEOUT)

    def _say(self, line: str) -> None:
        """A warning once until it changes or a copy succeeds (a peer down for long says it
        once)."""
        if line != self._said:
            self._said = line
            self.log.warning("%s", line)


def _parse(body: bytes, node: int) -> Optional[Answer]:
    """An index answer about `node`, or None when `body` is not one."""
    try:
        obj = json.loads(body)
        held = None if obj["held"] is None else Held.from_json(obj["held"])
        failing = obj.get("failing")
        if int(obj["node"]) != node or (obj["held"] is not None and held is None):
            return None
    except (ValueError, TypeError, KeyError, AttributeError):
        return None
    if held is not None and held.node != node:
        return None
    return Answer(held, None if failing is None else str(failing))


def _same(a: Optional[Held], b: Held) -> bool:
    return a is not None and (a.key, sorted(a.files)) == (b.key, sorted(b.files))


def _stream(handle: Any) -> Iterator[bytes]:
    with handle:
        while chunk := handle.read(CHUNK):
            yield chunk


def _answer(start_response: Callable[..., Any], code: str, body: bytes) -> list[bytes]:
    start_response(code, _headers("text/plain; charset=utf-8", len(body)))
    return [body]


def _headers(kind: str, length: int) -> list[tuple[str, str]]:
    return [("Content-Type", kind), ("Content-Length", str(length))]


def _reason(exc: BaseException) -> str:
    reason = getattr(exc, "reason", None)
    return str(reason if reason is not None else exc) or type(exc).__name__


def _rate(nbytes: int, seconds: float) -> str:
    rate = nbytes / 1e6 / max(seconds, 1e-6)
    return f"{nbytes / 1e6:.1f} MB in {seconds:.2f} s ({rate:.0f} MB/s)"


def configured(cfg: Any, logger: logging.Logger) -> Optional[PeerReplica]:
    """The peer replica `cfg` (the sidecar's Config) sets up, or None: not set, or the memory
    volume not writable here (one warning)."""
    if not cfg.peers or cfg.node_rank is None or cfg.nnodes is None:
        return None
    if not os.access(cfg.memory_dir, os.W_OK):
        logger.warning(
            "peer replica off: JITCKPT_MEMORY_DIR %s is not writable here; mount the memory "
            "volume read-write in the sidecar",
            cfg.memory_dir,
        )
        return None
    urls = peer_urls(cfg.peers, cfg.nnodes)
    return PeerReplica(cfg.memory_dir, cfg.node_rank, urls, cfg.peer_token, logger)


def peer_urls(template: str, nodes: int) -> tuple[str, ...]:
    """JITCKPT_PEERS: a URL with `{node}` (each node's, by rank), or one URL per node,
    comma-separated."""
    if "{node}" in template:
        return tuple(template.replace("{node}", str(n)) for n in range(nodes))
    return tuple(u.strip() for u in template.split(","))
