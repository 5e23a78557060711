"""Start-up cost the hook adds to a non-training `python3 -c pass`.

Alternates runs without and with the hook directory on PYTHONPATH (as jitckpt-entrypoint sets it,
JITCKPT_RUN_ID included so the hook installs itself) and prints medians and the difference.
Goal (issue 2): <= 5 ms.

    .venv/bin/python bench/bench_hook_startup.py [RUNS]
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time

from jitckpt_entrypoint.cli import HOOK_DIR


def once(env: dict[str, str]) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", "pass"], env=env, check=True)
    return time.perf_counter() - start


def main() -> None:
    runs = int(sys.argv[1]) if len(sys.argv) > 1 else 20
    plain = {k: v for k, v in os.environ.items() if not k.startswith("JITCKPT_")}
    plain.pop("PYTHONPATH", None)
    hooked = {**plain, "PYTHONPATH": HOOK_DIR, "JITCKPT_RUN_ID": "bench", "JITCKPT_DIR": "/tmp"}
    for env in (plain, hooked):  # warm the page cache and the .pyc files
        once(env)
    without, with_hook = [], []
    for _ in range(runs):
        without.append(once(plain))
        with_hook.append(once(hooked))
    a, b = statistics.median(without), statistics.median(with_hook)
    print(f"python -c pass, median of {runs} alternating runs")
    print(f"{'':24}{'median ms':>10}")
    print(f"{'without hook':24}{a * 1e3:10.2f}")
    print(f"{'with hook':24}{b * 1e3:10.2f}")
    print(f"{'added by the hook':24}{(b - a) * 1e3:10.2f}   (goal <= 5 ms; ratio {b / a:.3f})")


if __name__ == "__main__":
    main()
