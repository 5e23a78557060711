"""Ask the sidecar for the files of a checkpoint this node does not hold, and wait for them.

The sidecar's restore of a sharded checkpoint brings a node only what its ranks load at the
checkpoint's own size and layout (docs/how-it-works.md, Per-node restore). A rank that needs
more (it is another node than the sidecar was told, the job's size or parallel layout changed,
or a container restarted in place where each node holds only its own part) asks through
`status/fetch.json` (step, save id, when asked) and waits for `status/fetched.json` with that
very key: 'fetching', then 'done' or 'failed'. Ranks of one node that ask at once share one
request. Nothing here raises: without a sidecar, without an answer within FETCH_ANSWER
seconds, or on 'failed', the caller goes on as it would have (DCP then reports the file it
cannot find, or the resume picks an older checkpoint).
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Callable, Optional

from jitckpt_entrypoint.protocol import status
from jitckpt_entrypoint.protocol.layout import Layout, checkpoint_name

FETCH_ANSWER = 60.0
"""Seconds the sidecar has to take up a request before the rank carries on without it."""

log = logging.getLogger("jitckpt.hook")


def ask_sidecar(
    layout: Layout,
    step: int,
    save_id: str,
    *,
    say: bool = True,
    ready: Callable[[], bool] = lambda: False,
    patience: float = status.FETCH_PATIENCE,
    clock: Callable[[], float] = time.time,
    poll: float = 0.2,
) -> Optional[status.Fetched]:
    """Request every missing file of save `save_id` of checkpoint-<step> and wait for the
    answer, or until `ready()` (the files this rank needs are there), at most `patience`
    seconds once the sidecar took it up; the final answer (a 'done' one for `ready`), or
    None."""
    try:
        return _ask(
            layout, step, save_id, say=say, ready=ready, patience=patience, clock=clock, poll=poll
        )
    except Exception as exc:  # noqa: BLE001 - never into training: carry on without the files
        log.warning("cannot ask the sidecar for %s: %s", checkpoint_name(step), exc)
        return None


def _ask(
    layout: Layout,
    step: int,
    save_id: str,
    *,
    say: bool,
    ready: Callable[[], bool],
    patience: float,
    clock: Callable[[], float],
    poll: float,
) -> Optional[status.Fetched]:
    name = checkpoint_name(step)
    if status.SIDECAR_READY.read(layout.status) is None:
        return None  # no sidecar in this pod (local mode), or not started
    started = clock()
    key = _request(layout, step, save_id, started)
    answer: Optional[status.Fetched] = None
    while True:
        answer = status.FETCHED.read(layout.status)
        current = status.FETCH.read(layout.status)
        if current is not None and (current.step, current.save_id) == (step, save_id):
            key = _key(current)  # another rank of this node asked again: one request
        if answer is not None and _key(answer) == key and answer.state != "fetching":
            break
        if ready():  # another rank's request (or answer) brought what this rank needs
            answer = status.Fetched(*key, "done")
            break
        # Taken up: the sidecar works on this save (for this request or another rank's).
        taken = (
            answer is not None
            and (answer.step, answer.save_id) == (step, save_id)
            and answer.state == "fetching"
        )
        if clock() - started > (patience if taken else FETCH_ANSWER):
            answer = None
            break
        time.sleep(poll)
    if answer is None:
        _withdraw(layout, key)
        if say:
            log.warning("the sidecar did not fetch %s in time", name)
    elif say and answer.state == "failed":
        log.warning("the sidecar could not fetch %s: %s", name, answer.error)
    elif say:
        log.info("the sidecar fetched the rest of %s (%.1f MB)", name, answer.bytes / 1e6)
    return answer


Key = tuple[int, str, float]


def _key(record: status.Fetch | status.Fetched) -> Key:
    return (record.step, record.save_id, record.requested_at)


def _request(layout: Layout, step: int, save_id: str, now: float) -> Key:
    """The key of a pending request for this save (another rank's), or of a new one."""
    current = status.FETCH.read(layout.status)
    if current is not None and (current.step, current.save_id) == (step, save_id):
        answer = status.FETCHED.read(layout.status)
        answered = answer is not None and _key(answer) == _key(current)
        fresh = now - current.requested_at < status.FETCH_PATIENCE
        if fresh and not (answered and answer is not None and answer.state != "fetching"):
            return _key(current)
    request = status.Fetch(step, save_id, now)
    status.FETCH.write(layout.status, request)
    return _key(request)


def _withdraw(layout: Layout, key: Key) -> None:
    """Remove a request nobody answers any more, so a sidecar never acts on it late."""
    current = status.FETCH.read(layout.status)
    if current is not None and _key(current) == key:
        with contextlib.suppress(OSError):
            status.FETCH.remove(layout.status)
