"""The rest of a checkpoint, when a trainer asks (status/fetch.json), fetched in the background.

The start-up restore of a sharded checkpoint fetches only this node's part when it knows the
node (restore.py). A trainer that turns out to need more of it (it is another node of the job,
the job's world size changed, or a container restarted in place on a node that holds only its
own part) asks for the rest through `status/fetch.json`; this answers in `status/fetched.json`:
'fetching' at once, then 'done' or 'failed' with the reason. The download runs in its own
thread, so the main loop (uploads, metrics, /healthz) goes on meanwhile.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Optional

from jitckpt_entrypoint.protocol import status
from jitckpt_entrypoint.protocol.layout import checkpoint_name
from jitckpt_sidecar.restore import Restorer

Key = tuple[int, str, float]


class Fetcher:
    def __init__(
        self,
        restorer: Callable[[], Restorer],
        status_dir: str,
        logger: logging.Logger,
        *,
        cancel: Callable[[], Optional[str]],
        describe: Callable[[BaseException], str],
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.restorer, self.status_dir, self.log = restorer, status_dir, logger
        self.cancel, self.describe, self.clock = cancel, describe, clock
        self._thread: Optional[threading.Thread] = None
        self._handled: Optional[Key] = None

    def tick(self) -> None:
        """Start on a request not answered yet (one at a time)."""
        if self._thread is not None and self._thread.is_alive():
            return
        request = status.FETCH.read(self.status_dir)
        if request is None:
            return
        key = (request.step, request.save_id, request.requested_at)
        if key == self._handled:
            return
        self._handled = key
        if self.clock() - request.requested_at > status.FETCH_PATIENCE:
            return  # nobody waits for it any more
        answer = status.FETCHED.read(self.status_dir)
        if answer is not None and _key(answer) == key and answer.state != "fetching":
            return  # answered by this pod's sidecar before it restarted
        self._answer(key, "fetching")
        self._thread = threading.Thread(
            target=self._fetch, args=(key,), name="jitckpt-fetch", daemon=True
        )
        self._thread.start()

    def _fetch(self, key: Key) -> None:
        step, save_id, _ = key
        self.log.info(
            "the trainer needs more of %s than this node holds; fetching the rest",
            checkpoint_name(step),
        )

        def cancel() -> Optional[str]:  # SIGTERM, or nobody waits for it any more
            request = status.FETCH.read(self.status_dir)
            if request is None or (request.step, request.save_id) != (step, save_id):
                return "the trainer withdrew its request"
            return self.cancel()

        try:
            result = self.restorer().complete(step, save_id, cancel)
        except Exception as exc:  # noqa: BLE001 - answered to the trainer, which carries on
            reason = self.describe(exc)
            self.log.error("cannot fetch the rest of %s: %s", checkpoint_name(step), reason)
            self._answer(key, "failed", error=reason)
            return
        self._answer(key, "done", nbytes=result.fetched)

    def _answer(self, key: Key, state: str, *, error: str = "", nbytes: int = 0) -> None:
        status.FETCHED.write(self.status_dir, status.Fetched(*key, state, error, nbytes))


def _key(record: status.Fetched) -> Key:
    return (record.step, record.save_id, record.requested_at)
