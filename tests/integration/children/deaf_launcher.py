"""A launcher that ignores SIGTERM: runs its command, then stays LINGER seconds after it ends.

Usage: deaf_launcher.py LINGER COMMAND [ARG...]. Like a wrapper script that traps SIGTERM and
has more to do after training (or hangs): it never passes the signal on, and the command starts
with SIGTERM ignored (an ignored disposition survives exec).
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time

signal.signal(signal.SIGTERM, signal.SIG_IGN)
code = subprocess.call(sys.argv[2:])
time.sleep(float(sys.argv[1]))
sys.exit(code)
