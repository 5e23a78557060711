"""Prints 'ready', then one line per forwarded signal it receives; 'exit N' on stdin exits N.

The signals are blocked and taken with sigwaitinfo, not Python handlers: a handler that runs
while the main thread blocks in read() can miss a signal that arrives while an earlier handler
runs (CPython re-enters read() without checking again), and the test would blame the entrypoint.
"""

import os
import signal
import sys
import threading

SIGNALS = {
    getattr(signal, name)
    for name in ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2")
}


def exit_on_command() -> None:
    for line in sys.stdin:
        if line.startswith("exit "):
            sys.stdout.flush()
            os._exit(int(line.split()[1]))
    os._exit(0)


signal.pthread_sigmask(signal.SIG_BLOCK, SIGNALS)  # before the thread starts: it inherits the mask
threading.Thread(target=exit_on_command, daemon=True).start()
print(f"ready pid={os.getpid()} ppid={os.getppid()} sid={os.getsid(0)}", flush=True)
while True:
    print(signal.Signals(signal.sigwaitinfo(SIGNALS).si_signo).name, flush=True)
