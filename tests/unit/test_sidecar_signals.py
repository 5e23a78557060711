"""Signals relayed to a thread: a signal landing while the main thread holds a lock."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

# The main thread clears an Event in a tight loop, as the sidecar's main loop does after each
# wake-up; a handler that set the Event from the main thread waited on the lock it held.
CHILD = textwrap.dedent(
    """
    import logging, signal, sys, threading
    from jitckpt_sidecar import signals

    woken, done, seen = threading.Event(), threading.Event(), []

    def on_signal(signum):
        seen.append(signum)
        (done if signum == signal.SIGUSR2 else woken).set()

    signals.Relay((signal.SIGUSR1, signal.SIGUSR2), logging.getLogger("t")).to(on_signal)
    print("ready", flush=True)
    while not done.is_set():
        woken.clear()
    print(sum(1 for s in seen if s == signal.SIGUSR1), flush=True)
    """
)


@pytest.mark.skipif(sys.platform != "linux", reason="POSIX signals")
def test_signals_landing_while_the_main_thread_holds_an_events_lock_never_hang_it():
    """Before: a handler setting an Event hung the process within about 750 signals here."""
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD], stdout=subprocess.PIPE, text=True, env=os.environ
    )
    try:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "ready"
        for _ in range(1500):
            child.send_signal(signal.SIGUSR1)
            time.sleep(0.001)
        child.send_signal(signal.SIGUSR2)
        out, _ = child.communicate(timeout=20)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert child.returncode == 0
    assert int(out.strip()) > 0  # signals pending together are delivered once


EARLY = textwrap.dedent(
    """
    import logging, os, signal, threading, time
    from jitckpt_sidecar import signals

    relay = signals.Relay((signal.SIGTERM,), logging.getLogger("t"))
    os.kill(os.getpid(), signal.SIGTERM)  # before anyone can act on it: kept, not lost
    time.sleep(0.2)
    got = threading.Event()
    relay.to(lambda signum: got.set() if signum == signal.SIGTERM else None)
    print("handed" if got.wait(10) else "lost", flush=True)
    """
)


@pytest.mark.skipif(sys.platform != "linux", reason="POSIX signals")
def test_a_signal_before_its_callback_is_set_is_handed_to_it_when_it_is():
    out = subprocess.run(
        [sys.executable, "-c", EARLY], capture_output=True, text=True, timeout=30, check=False
    )
    assert (out.returncode, out.stdout.strip()) == (0, "handed"), out.stderr
