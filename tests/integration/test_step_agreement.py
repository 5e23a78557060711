"""The step agreement (hook/control.py) between two real gloo processes: every rank gets the
same (stop, save) answers at the same calls, whatever step a rank-0 save request comes at."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from harness.procs import free_port
from jitckpt_entrypoint.protocol.layout import Layout

pytestmark = pytest.mark.integration

CHILD = r"""
import json, os, sys, time
import torch.distributed as dist
from jitckpt_entrypoint.hook import control
dist.init_process_group("gloo")
rank = dist.get_rank()
group = control.ControlGroup()
answers = []
for call in range(60):
    if call < control.CALIBRATION_CALLS:
        time.sleep(float(sys.argv[1]))  # the step time calibration measures
    ask = call if rank == 0 and call in (13, 31) else 0  # a token; 31's round: any_now at 32
    snap = 100 + call if rank == 0 and call in (20, 31) else 0  # a snapshot's token
    stop, save, snapshot = group.agree(rank == 1 and call >= 45, ask, snap)  # SIGTERM: 45
    answers.append([call, stop, save, snapshot])
    if call == 32:
        answers.append([call, "any_now", group.any_now(False), 0])
    if stop:
        break
answers.append(["every", group.every, group.blocking])
group.close()
print(json.dumps(answers))
"""


def two_ranks(code: str, arg: str, **extra: str) -> tuple[list[int], list[tuple[str, str]]]:
    """Run `code` as ranks 0 and 1 of a gloo world: their exit codes, (stdout, stderr)s."""
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    env.update(WORLD_SIZE="2", **extra)
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, arg],
            env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(2)
    ]
    outs = [p.communicate(timeout=120) for p in procs]
    return [p.returncode for p in procs], outs


@pytest.mark.parametrize("step", [0.01, 0.12], ids=["short steps, async", "long, blocking"])
def test_every_rank_gets_each_save_request_once_at_the_same_call(step: float):
    codes, outs = two_ranks(CHILD, str(step))
    assert codes == [0, 0], outs
    answers = [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]
    assert answers[0] == answers[1]  # the same answers at the same calls
    *calls, (_, every, blocking) = answers[0]
    saves = [call for call, kind, save, _ in calls if kind != "any_now" and save]
    tokens = [save for _, kind, save, _ in calls if kind != "any_now" and save]
    assert tokens == [13, 31], calls  # each request's own token, once
    snapshots = [snap for _, kind, _, snap in calls if kind != "any_now" and snap]
    assert snapshots == [120, 131], calls  # the snapshots' tokens beside them, once each
    stops = [call for call, stop, _, _ in calls if stop is True]
    if blocking:  # a round after every step: answered at the very step
        assert (saves, stops) == ([13, 31], [45]), calls
        return
    # async rounds (also with long steps, when a loaded machine makes a round dear): a
    # request waits for the next round
    assert len(saves) == 2, calls  # each request once, none lost between rounds
    assert 13 < saves[0] <= 13 + 2 * every
    assert 31 < saves[1] <= 31 + 2 * every
    assert len(stops) == 1, calls
    assert 45 <= stops[0] <= 45 + 2 * every


LOOP_END = r"""
import os, signal, sys
import torch.distributed as dist
from jitckpt_entrypoint import hook as jitckpt
from jitckpt_entrypoint.hook import control
from jitckpt_entrypoint.hook.manager import current
control.ROUND_SECONDS = control.BLOCKING_COST = 0  # an async round after every step
dist.init_process_group("gloo")
rank = dist.get_rank()
for step in range(1, 13):
    jitckpt.should_stop(step)
assert current().session.control._pending is not None  # the last round, in flight below
if rank == 0:
    os.kill(os.getpid(), signal.SIGTERM)  # after the last agreement: only the flag sees it
    while not current().session.flag.is_set:
        pass
if sys.argv[1] == "destroy first":
    dist.destroy_process_group()  # the script's clean-up, before jitckpt.done()
jitckpt.done()
print("after done", signal.getsignal(signal.SIGTERM) == signal.SIG_DFL, flush=True)
if dist.is_initialized():
    dist.destroy_process_group()
"""


@pytest.mark.parametrize("order", ["done first", "destroy first"])
def test_a_sigterm_after_the_last_agreement_ends_the_rank_and_done_after_destroy_is_fine(
    order: str, tmp_path
):
    """A plain loop's end: done() puts the previous SIGTERM handler back on every rank; rank
    0's SIGTERM, which came after the last stop agreement, ends rank 0 then (as without
    jitckpt) instead of being swallowed; done() after the script's destroy_process_group()
    skips jitckpt's collectives in one line instead of raising."""
    Layout(str(tmp_path)).ensure()  # the entrypoint's part
    codes, outs = two_ranks(LOOP_END, order, JITCKPT_DIR=str(tmp_path), LOCAL_WORLD_SIZE="2")
    assert codes == [-signal.SIGTERM, 0], outs
    assert outs[0][0] == "", outs  # rank 0 never got past done()
    assert "SIGTERM after training's last stop agreement: the process ends by it" in outs[0][1]
    assert outs[1][0] == "after done True\n", outs
    skipped = "jitckpt's last collectives are skipped"
    assert (skipped in outs[1][1]) == (order == "destroy first"), outs
    assert "Traceback" not in outs[0][1] + outs[1][1], outs
    warnings = [line for line in outs[0][1].splitlines() if "WARNING" in line]
    assert len(warnings) == (2 if order == "destroy first" else 1), warnings  # no others
