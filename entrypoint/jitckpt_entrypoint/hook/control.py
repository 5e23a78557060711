"""jitckpt's own collectives on a dedicated CPU (gloo) group: step agreement, commit barriers.

A separate group keeps our tiny messages off the training communicator (NCCL or gloo), so they
never reorder or block gradient all-reduces. Every method is collective: all ranks must call
the same methods in the same order. With one process (no torch.distributed) they are local.

The step agreement answers three questions at the same step on every rank: did any rank get
SIGTERM (stop), is a time-based periodic save due (save: rank 0's clock, cadence.py), and is a
time-based snapshot to RAM due (snapshot: rank 0's clock, memory_tier.py). They ride in one MAX
all-reduce of three numbers, so a due save costs no extra collective. A request is a token (a
positive number the caller picks, 0 for none), sent once and answered once: the caller can tell
a request that a save made since has answered already.

The agreement is calibrated on the first CALIBRATION_CALLS steps (each with an async
round). Then one blocking round carries every rank's median step time, and TIMED_ROUNDS more
measure what a blocking round costs (each rank's quickest; the slowest rank's counts):

- Long steps (a blocking round costs at most BLOCKING_COST of a step, e.g. steps of 60 ms or
  more on one host, where a round takes ~0.3 ms): a blocking round after every step, so a
  SIGTERM that arrives during step N stops at step N itself.
- Short steps: an async round, started after a step and read one round later (no step waits
  for it). A round costs about half a millisecond of CPU on a busy host (gloo's thread must be
  scheduled beside the training threads): 6% of a 9 ms step. So short steps share a round, one
  every `every` steps, as many as fill ROUND_SECONDS; a stop waits at most about two rounds.

All ranks agree on the mode and on `every`, so they start and read the same rounds at the same
steps.
"""

from __future__ import annotations

import contextlib
import logging
import math
import statistics
import time
from typing import Any, Optional

log = logging.getLogger("jitckpt.hook")

ROUND_SECONDS = 0.05
"""Training time per agreement round once steps are known to be short."""
CALIBRATION_CALLS = 8
"""Steps (with a round each) whose durations decide how many steps share a round."""
TIMED_ROUNDS = 5
"""Blocking rounds timed at calibration (the quickest counts: the first may include set-up)."""
BLOCKING_COST = 0.005
"""A blocking round after every step when it costs at most this fraction of a step."""


LEFT_TO_TEARDOWN: list[Any] = []
"""What a failed training left with a collective in flight (groups, the writer, its save):
never collected before the interpreter's teardown, since a group's destructor waits for its
work."""


class ControlGroup:
    def __init__(self) -> None:
        self._dist: Any = None
        self._group: Any = None
        self._buffer: Any = None
        self._pending: Any = None
        self._calls: list[float] = []
        """Times of the first calls of stop_requested (until calibrated)."""
        self.every = 1
        """Steps per agreement round (1 until calibrated)."""
        self.blocking = False
        """A blocking round after every step (long steps; decided by calibration)."""
        self._calibrated = False
        self._count = 0
        self._carried = (0, 0)
        """Tokens (save, snapshot) a blocking round (`any_now`) received: the next agree's."""
        self._wanted = (0, 0)
        """This rank's tokens (save, snapshot), not yet sent (agree's steps between rounds)."""
        self.world_size = 1
        try:
            import torch.distributed as dist
        except ImportError:
            return
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            self._dist = dist
            self._group = dist.new_group(backend="gloo")  # collective: every rank creates it
            self.world_size = dist.get_world_size()

    @property
    def distributed(self) -> bool:
        return self._group is not None

    @property
    def lost(self) -> bool:
        """The script's destroy_process_group() took every group, this one too."""
        return self.distributed and not self._dist.is_initialized()

    @property
    def group(self) -> Any:
        """The gloo process group (None with one process)."""
        return self._group

    def agree(self, stop: bool, save: int = 0, snapshot: int = 0) -> tuple[bool, int, int]:
        """The async agreement, called once per optimizer step on every rank: (stop, save,
        snapshot).

        Returns whether any rank had its stop flag set one round ago, and the largest save and
        snapshot tokens sent then (0: none), so every rank gets the same answer at the same
        step; then starts the next round without waiting for it. The round started at step N
        has finished long before step N+1 ends, so `wait()` is free. A token is sent once,
        with the next round (stop is asked again every step).
        """
        if not self.distributed:
            return stop, save, snapshot
        self._wanted = _most(self._wanted, (save, snapshot))
        self._count += 1
        if not self._calibrated:
            self._calls.append(time.monotonic())
            if len(self._calls) >= CALIBRATION_CALLS:
                return self._calibrate(stop)
        elif self.blocking:
            return self._now(stop)
        elif self._count % self.every:
            return (False, *self._take_carried())
        stopped, due = self._collect()
        if not stopped:
            self._buffer = self._flags(stop, self._take_wanted())
            self._pending = self._dist.all_reduce(
                self._buffer, op=self._dist.ReduceOp.MAX, group=self._group, async_op=True
            )
        return (stopped, *due)

    def stop_requested(self, local: bool) -> bool:
        """`agree` without a save flag: whether every rank stops at this step."""
        return self.agree(local)[0]

    def _calibrate(self, stop: bool) -> tuple[bool, int, int]:
        """Blocking rounds: the flags with every rank's median step time, then a few timed
        ones (every rank in step now), then the slowest rank's quickest. Decides `blocking`
        and `every`."""
        import torch

        stopped, due = self._collect()
        if stopped:
            return (True, *due)
        times = self._calls
        step = statistics.median(b - a for a, b in zip(times, times[1:]))
        flags = [1 if stop else 0, *self._take_wanted(), int(step * 1e6)]
        both = torch.tensor(flags, dtype=torch.int64)
        self._dist.all_reduce(both, op=self._dist.ReduceOp.MAX, group=self._group)
        rounds = []
        for _ in range(TIMED_ROUNDS):
            started = time.monotonic()
            self._dist.all_reduce(self._flag(False), group=self._group)
            rounds.append(time.monotonic() - started)
        cost = torch.tensor([int(min(rounds) * 1e6)], dtype=torch.int64)
        self._dist.all_reduce(cost, op=self._dist.ReduceOp.MAX, group=self._group)
        self._calibrated, self._calls = True, []
        step_us, round_us = max(1, int(both[3].item())), max(1, int(cost[0].item()))
        self.blocking = round_us <= BLOCKING_COST * step_us
        self.every = 1 if self.blocking else max(1, math.ceil(ROUND_SECONDS * 1e6 / step_us))
        self._count = 0
        if self._dist.get_rank() == 0:
            log.info(
                "stop agreement %s (a step takes %.1f ms, a blocking round %.2f ms)",
                "after every step" if self.blocking else f"every {self.every} steps, async",
                step_us / 1e3,
                round_us / 1e3,
            )
        return (bool(both[0].item()), *_most(due, (int(both[1].item()), int(both[2].item()))))

    def any_now(self, local: bool) -> bool:
        """Blocking agreement at a point where all ranks are in step anyway (after a save).
        Due tokens of the round in flight are kept for the next `agree`."""
        if not self.distributed:
            return local
        stop, save, snapshot = self._now(local)
        self._carried = _most(self._carried, (save, snapshot))
        return stop

    def _now(self, stop: bool) -> tuple[bool, int, int]:
        """One blocking round (with the result of the round in flight folded in)."""
        stopped, due = self._collect()
        flags = self._flags(stop or stopped, _most(due, self._take_wanted()))
        self._dist.all_reduce(flags, op=self._dist.ReduceOp.MAX, group=self._group)
        return bool(flags[0].item()), int(flags[1].item()), int(flags[2].item())

    def _collect(self) -> tuple[bool, tuple[int, int]]:
        """The result of the round in flight ((False, (0, 0)) when none is), with the tokens
        carried over from an `any_now`."""
        carried = self._take_carried()
        if self._pending is None:
            return False, carried
        self._pending.wait()
        self._pending = None
        buffer = self._buffer
        got = (int(buffer[1].item()), int(buffer[2].item()))
        return bool(buffer[0].item()), _most(carried, got)

    def _take_carried(self) -> tuple[int, int]:
        carried, self._carried = self._carried, (0, 0)
        return carried

    def _take_wanted(self) -> tuple[int, int]:
        wanted, self._wanted = self._wanted, (0, 0)
        return wanted

    @staticmethod
    def _flag(value: bool) -> Any:
        import torch

        return torch.tensor([1 if value else 0], dtype=torch.int32)

    @staticmethod
    def _flags(stop: bool, tokens: tuple[int, int]) -> Any:
        import torch

        return torch.tensor([1 if stop else 0, *tokens], dtype=torch.int64)

    def barrier(self) -> None:
        if self.distributed:
            self._drain()
            self._dist.barrier(group=self._group)

    def all_gather(self, obj: Any) -> list[Any]:
        if not self.distributed:
            return [obj]
        self._drain()
        out: list[Optional[Any]] = [None] * self.world_size
        self._dist.all_gather_object(out, obj, group=self._group)
        return out

    def close(self, wait: bool = True) -> bool:
        """Destroy the group while every rank is still here (not in interpreter teardown);
        one the script's destroy_process_group() took already is simply forgotten. With
        wait=False, a group whose round is still in flight is left as it is (False)."""
        if not self.distributed:
            return True
        if wait:
            self._collect()
        elif self._pending is None or self._pending.is_completed():
            self._pending = None  # completed (or failed: its wait() would raise again)
        else:
            return False
        with contextlib.suppress(ValueError):  # not in c10d's groups: destroyed already
            self._dist.destroy_process_group(self._group)
        self._group = None
        return True

    def _drain(self) -> None:
        """Finish the in-flight async round so collectives stay matched across ranks."""
        # Every rank has the same round in flight, so waiting here is symmetric; its result
        # is kept and returned by the next stop_requested() call.
        if self._pending is not None:
            self._pending.wait()
            self._pending = _Done()


def _most(a: tuple[int, int], b: tuple[int, int]) -> tuple[int, int]:
    """The larger of each token."""
    return max(a[0], b[0]), max(a[1], b[1])


class _Done:
    def wait(self) -> None:
        return None

    def is_completed(self) -> bool:
        return True
