"""Double-forks N orphans that exit at once; reports whether PID 1 reaped them.

Run inside the PID namespace: the orphans are re-parented to PID 1 (the entrypoint). Prints
'reaped N' when every orphan has vanished from /proc, 'zombie PIDS' if any stays a zombie.
"""

import os
import sys
import time

count = int(sys.argv[1])
read_fd, write_fd = os.pipe()
for _ in range(count):
    middle = os.fork()
    if middle == 0:
        if os.fork() == 0:  # the orphan: report our pid, then exit right away
            os.write(write_fd, f"{os.getpid()}\n".encode())
            os._exit(0)
        os._exit(0)  # the middle process exits first, orphaning its child
    os.waitpid(middle, 0)
os.close(write_fd)
with os.fdopen(read_fd) as pipe:
    orphans = [int(line) for line in pipe]


def state(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):  # reaped between open() and read()
        return None


deadline = time.monotonic() + 10
while any(state(p) is not None for p in orphans) and time.monotonic() < deadline:
    time.sleep(0.01)
left = [p for p in orphans if state(p) is not None]
print(f"zombie {left}" if left else f"reaped {len(orphans)}", flush=True)
