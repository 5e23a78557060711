"""Writing the checkpoints we write ourselves: a background thread, files side by side.

`BackgroundWriter` runs one job at a time on a daemon thread (the manager keeps at most one save
in flight). A job can be cancelled: `check()` raises CancelledError once it is, and the writers
call it before every file and every chunk of a file (direct_write), so a cancelled save stops
within one buffer and is never committed. A job stuck in a collective of a save that other
ranks cancelled is simply left behind: the process exits after its JIT checkpoint.

`write_files` runs a checkpoint's file writers side by side (the serializers spend CPU time,
CRCs and pickling, that overlaps with the disk's) or, for a background save, one after another.
The big files themselves are written with O_DIRECT (direct_write: torch_save, safetensors_save);
the commit makes everything durable before the manifest (protocol.durable).
"""

from __future__ import annotations

import queue
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Optional

WRITERS = 4
"""Files written side by side, and threads writing one big file (direct_write)."""


class CancelledError(Exception):
    """The job was cancelled (a JIT checkpoint of a newer step replaces it)."""


class Job:
    def __init__(self, run: Callable[[Job], None], label: str) -> None:
        self.label = label
        self._run = run
        self._cancelled = threading.Event()
        self._done = threading.Event()
        self.error: Optional[BaseException] = None

    def cancel(self) -> None:
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def check(self) -> None:
        """Raise CancelledError when cancelled (called by the job between its phases)."""
        if self._cancelled.is_set():
            raise CancelledError(self.label)

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: Optional[float] = None) -> bool:
        return self._done.wait(timeout)

    def execute(self) -> None:
        try:
            self._run(self)
        except CancelledError:
            pass
        except BaseException as exc:  # noqa: BLE001 - kept for the training thread to report
            self.error = exc
        finally:
            self._done.set()


class BackgroundWriter:
    """One daemon thread that runs submitted jobs in order."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._queue: queue.Queue[Optional[Job]] = queue.Queue()
        self._thread: Optional[threading.Thread] = None

    def submit(self, run: Callable[[Job], None], label: str) -> Job:
        job = Job(run, label)
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name=self._name, daemon=True)
            self._thread.start()
        self._queue.put(job)
        return job

    def close(self, timeout: float = 5.0) -> None:
        """Stop the thread after the jobs already queued (a stuck one is left behind)."""
        if self._thread is None:
            return
        self._queue.put(None)
        self._thread.join(timeout)
        self._thread = None

    def _loop(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            job.execute()


def write_files(
    writers: list[Callable[[], object]], job: Optional[Job] = None, parallel: bool = True
) -> None:
    """Run `writers` side by side (or in turn); the first error is raised once all have ended."""
    if len(writers) <= 1 or not parallel:
        for write in writers:
            _checked(write, job)()
        return
    with ThreadPoolExecutor(max_workers=min(WRITERS, len(writers))) as pool:
        futures = [pool.submit(_checked(write, job)) for write in writers]
    for future in futures:
        future.result()


def _checked(write: Callable[[], object], job: Optional[Job]) -> Callable[[], object]:
    def run() -> object:
        if job is not None:
            job.check()
        return write()

    return run
