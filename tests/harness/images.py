"""Build the two images from the Containerfile on locally made bases (no container registry).

    python tests/harness/images.py           # local bases; tags jitckpt-{base,sidecar}:dev
    python tests/harness/images.py --base-image IMG --sidecar-base IMG    # real bases

Local bases: `debootstrap bookworm` (minbase + python3) imported with `podman import`, and on
top of it the local torch 2.13.0 CPU wheel from /opt/wheels. Both are cached: the rootfs tarball
under build/, the images in podman's store, so a second call (or a second test) reuses them.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from harness.podman import Podman  # noqa: E402
from harness.procs import REPO  # noqa: E402

DEBIAN = "localhost/jitckpt-test/debian:bookworm"
TORCH = "localhost/jitckpt-test/pytorch-cpu:2.13.0"
WHEELS = Path(os.environ.get("JITCKPT_WHEELS", "/opt/wheels"))
TORCH_WHEEL = "torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl"
MIRROR = os.environ.get("JITCKPT_DEBIAN_MIRROR", "http://deb.debian.org/debian")
CACHE = REPO / "build" / "image-cache"
# minbase + python3 (3.11 on bookworm) + venv/ensurepip for pip, + CA certificates for S3 TLS.
PACKAGES = ("python3", "python3-venv", "ca-certificates")
# Not needed in a container image; trimmed from the rootfs to keep every layer small.
TRIM = ("usr/share/doc", "usr/share/man", "usr/share/info", "usr/share/locale", "var/lib/apt/lists",
        "var/cache/apt", "var/log")  # fmt: skip
TORCH_CONTAINERFILE = """\
FROM {debian}
ARG PIP_INDEX_URL PIP_CERT
COPY requirements-dev.txt /tmp/requirements-dev.txt
RUN python3 -m venv /opt/venv \\
 && /opt/venv/bin/pip install --no-cache-dir --disable-pip-version-check \\
      -c /tmp/requirements-dev.txt /wheels/{wheel} \\
 && rm /tmp/requirements-dev.txt
ENV PATH=/opt/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
"""


def host_pip_args() -> list[str]:
    """Let pip inside builds trust what the host's pip trusts (a TLS-intercepting proxy's CA)
    and use the same index: passed as build args, mounted only while RUN steps run."""
    args = []
    cert = os.environ.get("PIP_CERT") or os.environ.get("SSL_CERT_FILE")
    if cert and Path(cert).is_file():
        args += ["--volume", f"{cert}:/run/jitckpt-host-ca.crt:ro",
                 "--build-arg", "PIP_CERT=/run/jitckpt-host-ca.crt"]  # fmt: skip
    if os.environ.get("PIP_INDEX_URL"):
        args += ["--build-arg", f"PIP_INDEX_URL={os.environ['PIP_INDEX_URL']}"]
    return args


def log(msg: str) -> None:
    print(f"images: {msg}", file=sys.stderr, flush=True)


def debian_rootfs_tar() -> Path:
    """debootstrap once per checkout; later calls reuse the tarball."""
    tar = CACHE / "bookworm-minbase.tar"
    if tar.exists():
        return tar
    if shutil.which("debootstrap") is None:
        raise RuntimeError("debootstrap is not installed (apt-get install debootstrap)")
    CACHE.mkdir(parents=True, exist_ok=True)
    rootfs = CACHE / "rootfs"
    shutil.rmtree(rootfs, ignore_errors=True)
    start = time.monotonic()
    subprocess.run(
        ["debootstrap", "--variant=minbase", f"--include={','.join(PACKAGES)}", "bookworm",
         str(rootfs), MIRROR],
        check=True, capture_output=True, text=True,
    )  # fmt: skip
    for rel in TRIM:
        target = rootfs / rel
        if target.exists():
            shutil.rmtree(target)
            target.mkdir()
    partial = tar.with_suffix(".tmp")
    subprocess.run(["tar", "-C", str(rootfs), "-cf", str(partial), "."], check=True)
    partial.rename(tar)
    shutil.rmtree(rootfs)
    log(f"debootstrap bookworm minbase: {time.monotonic() - start:.0f} s")
    return tar


def ensure_debian(pm: Podman) -> str:
    if not pm.image_exists(DEBIAN):
        tar = debian_rootfs_tar()
        start = time.monotonic()
        pm.run("import", "--change", 'CMD ["/bin/bash"]', str(tar), DEBIAN)
        log(f"podman import {DEBIAN}: {time.monotonic() - start:.0f} s")
    return DEBIAN


def ensure_torch(pm: Podman, weight: Sequence[str] = ()) -> str:
    """The stand-in for a PyTorch image: the Debian base plus the local CPU wheel in a venv."""
    if pm.image_exists(TORCH):
        return TORCH
    debian = ensure_debian(pm)
    if not (WHEELS / TORCH_WHEEL).exists():
        raise RuntimeError(f"{WHEELS / TORCH_WHEEL} is missing (the local torch CPU wheel)")
    context = CACHE / "torch-context"
    context.mkdir(parents=True, exist_ok=True)
    shutil.copy(REPO / "requirements-dev.txt", context / "requirements-dev.txt")
    (context / "Containerfile").write_text(
        TORCH_CONTAINERFILE.format(debian=debian, wheel=TORCH_WHEEL)
    )
    took = pm.build(
        [*weight, *host_pip_args(), "--volume", f"{WHEELS}:/wheels:ro", "-t", TORCH,
         "-f", str(context / "Containerfile"), str(context)]
    )  # fmt: skip
    log(f"torch base {TORCH}: {took:.0f} s")
    return TORCH


def build_targets(
    pm: Podman, base_image: str, sidecar_base: str, tag: str = "dev", weight: Sequence[str] = ()
) -> dict[str, float]:
    """Build both Containerfile targets; return seconds per target."""
    times = {}
    for target in ("sidecar", "base"):
        times[target] = pm.build(
            ["--target", target, *weight, *host_pip_args(),
             "--build-arg", f"BASE_IMAGE={base_image}",
             "--build-arg", f"SIDECAR_BASE={sidecar_base}",
             "-t", f"localhost/jitckpt-{target}:{tag}", "-f", str(REPO / "Containerfile"),
             str(REPO)]
        )  # fmt: skip
    return times


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-image", help="PyTorch image for the base target (default: local)")
    parser.add_argument("--sidecar-base", help="Python image for the sidecar (default: local)")
    parser.add_argument("--tag", default="dev")
    parser.add_argument(
        "--background",
        action="store_true",
        help="give the builds' RUN steps the lowest CPU weight (CI builds while tests run)",
    )
    args = parser.parse_args()
    pm = Podman()
    log(f"podman storage driver: {pm.driver}, root {pm.root}")
    # A RUN step runs in a cgroup of its own, where neither nice nor the caller's autogroup
    # reaches: without a low weight it takes as much CPU as a whole running test.
    weight = ["--cpu-shares", "2"] if args.background else []
    base_image = args.base_image or ensure_torch(pm, weight)
    sidecar_base = args.sidecar_base or ensure_debian(pm)
    times = build_targets(pm, base_image, sidecar_base, args.tag, weight)
    for target, took in times.items():
        ref = f"localhost/jitckpt-{target}:{args.tag}"
        print(f"{ref}: {pm.image_size(ref) / 1e6:.0f} MB, built in {took:.0f} s")
    for ref in (base_image, sidecar_base):
        if pm.image_exists(ref):
            print(f"  base {ref}: {pm.image_size(ref) / 1e6:.0f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
