"""Prints 'ready', then one line per forwarded signal it receives; 'exit N' on stdin exits N."""

import os
import signal
import sys

SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2")


def echo(signo, frame):
    print(signal.Signals(signo).name, flush=True)


for name in SIGNALS:
    signal.signal(getattr(signal, name), echo)
print(f"ready pid={os.getpid()} ppid={os.getppid()} sid={os.getsid(0)}", flush=True)
for line in sys.stdin:
    if line.startswith("exit "):
        sys.exit(int(line.split()[1]))
