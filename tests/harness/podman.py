"""Run podman with configuration files we write ourselves, never the machine's.

Everything podman reads comes from files under one root (build/podman by default, or
$JITCKPT_PODMAN_ROOT): containers.conf (runc, cgroupfs, host networking, the host's ulimits),
storage.conf (overlay, falling back to vfs where overlay cannot mount) and registries.conf (no
registries: every image here is built or imported locally). Only policy.json comes from the
podman package itself.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Optional

from harness.procs import REPO

# The host's limits, as the issue asks; a container's defaults would differ from the host's.
ULIMITS = ("nofile=20000:20000", "nproc=4096:4096")
DRIVERS = ("overlay", "vfs")


def default_root() -> Path:
    return Path(os.environ.get("JITCKPT_PODMAN_ROOT") or REPO / "build" / "podman")


def missing_tools() -> list[str]:
    return [t for t in ("podman", "runc", "catatonit") if shutil.which(t) is None]


def write_config(root: Path, driver: str) -> dict[str, str]:
    """Write the three config files for `driver`; return the environment that selects them."""
    conf = root / "conf"
    conf.mkdir(parents=True, exist_ok=True)
    ulimits = ", ".join(f'"{u}"' for u in ULIMITS)
    (conf / "containers.conf").write_text(
        "[containers]\n"
        f"default_ulimits = [{ulimits}]\n"
        # No CNI/netavark setup needed: the tests use the host's loopback (S3 on 127.0.0.1).
        'netns = "host"\n'
        "\n[engine]\n"
        'runtime = "runc"\n'
        'cgroup_manager = "cgroupfs"\n'
        'events_logger = "file"\n'
        f'tmp_dir = "{root / "tmp"}"\n'
    )
    options = '[storage.options.overlay]\nmountopt = "nodev"\n' if driver == "overlay" else ""
    (conf / "storage.conf").write_text(
        "[storage]\n"
        f'driver = "{driver}"\n'
        f'runroot = "{root / driver / "run"}"\n'
        f'graphroot = "{root / driver / "graph"}"\n' + options
    )
    (conf / "registries.conf").write_text(
        "# No registry is reachable; every image is built or imported locally.\n"
        "unqualified-search-registries = []\n"
        'short-name-mode = "disabled"\n'
    )
    (root / "tmp").mkdir(exist_ok=True)
    return {
        "CONTAINERS_CONF": str(conf / "containers.conf"),
        "CONTAINERS_STORAGE_CONF": str(conf / "storage.conf"),
        "CONTAINERS_REGISTRIES_CONF": str(conf / "registries.conf"),
        "TMPDIR": str(root / "tmp"),
    }


class Podman:
    """podman with our configuration; `run` raises with the output when a command fails."""

    def __init__(self, root: Optional[Path] = None, driver: Optional[str] = None) -> None:
        self.root = root or default_root()
        self.driver = driver or self._pick_driver()
        self.env = {**os.environ, **write_config(self.root, self.driver)}

    def _pick_driver(self) -> str:
        """overlay where it mounts here (it is much faster and smaller), else vfs.

        The choice is remembered next to the storage so that a run never switches drivers
        under an existing store.
        """
        self.root.mkdir(parents=True, exist_ok=True)
        marker = self.root / "driver"
        if marker.exists():
            return marker.read_text().strip()
        forced = os.environ.get("JITCKPT_PODMAN_DRIVER")
        chosen = forced or ("overlay" if _overlay_mounts(self.root) else "vfs")
        marker.write_text(chosen + "\n")
        return chosen

    def cmd(self, *args: str) -> list[str]:
        return ["podman", *args]

    def run(
        self,
        *args: str,
        check: bool = True,
        timeout: float = 600,
        input_text: Optional[str] = None,
    ) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run(
            self.cmd(*args),
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
            input=input_text,
            check=False,
        )
        if check and proc.returncode != 0:
            raise RuntimeError(
                f"podman {' '.join(args[:6])} ... exited {proc.returncode}\n"
                f"--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-4000:]}"
            )
        return proc

    def image_exists(self, ref: str) -> bool:
        return self.run("image", "exists", ref, check=False).returncode == 0

    def image_size(self, ref: str) -> int:
        return int(self.run("image", "inspect", "--format", "{{.Size}}", ref).stdout.strip())

    def build(self, args: Sequence[str], timeout: float = 1500) -> float:
        """`podman build ARGS`; returns the seconds it took."""
        start = time.monotonic()
        self.run("build", "--network", "host", *args, timeout=timeout)
        return time.monotonic() - start


def _overlay_mounts(root: Path) -> bool:
    """Can the kernel mount overlayfs with its upper dir on this filesystem (e.g. not on
    another overlay or on some network filesystems)?"""
    probe = root / "overlay-probe"
    dirs = {n: probe / n for n in ("lower", "upper", "work", "merged")}
    for d in dirs.values():
        d.mkdir(parents=True, exist_ok=True)
    opts = f"lowerdir={dirs['lower']},upperdir={dirs['upper']},workdir={dirs['work']}"
    try:
        ok = (
            subprocess.run(
                ["mount", "-t", "overlay", "overlay", "-o", opts, str(dirs["merged"])],
                capture_output=True,
                check=False,
            ).returncode
            == 0
        )
        if ok:
            subprocess.run(["umount", str(dirs["merged"])], capture_output=True, check=False)
        return ok
    finally:
        shutil.rmtree(probe, ignore_errors=True)
