"""A torchrun worker that reports its rank and environment, then waits for SIGTERM."""

import os
import signal
import sys

rank = os.environ["RANK"]


def say(line):
    os.write(1, (line + "\n").encode())  # one write: two workers share this pipe


def on_term(signo, frame):
    say(f"SIGTERM rank={rank}")
    sys.exit(0)


signal.signal(signal.SIGTERM, on_term)
say(
    f"ready rank={rank} timeout={os.environ.get('TORCH_ELASTIC_SHUTDOWN_TIMEOUT')} "
    f"agent={os.getppid()}"
)
while True:
    signal.pause()
