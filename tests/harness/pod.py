"""One Kubernetes pod on this machine: the trainer container and the sidecar sharing an emptyDir.

The trainer "container" is jitckpt-entrypoint as PID 1 of its own PID namespace running
`torchrun --nproc-per-node 2` on a real HF Trainer script; the sidecar runs beside it. Like the
kubelet, a Pod starts the sidecar first and the trainer once the sidecar's startupProbe
(/readyz) passes; `terminate()` sends SIGTERM to both containers at once and SIGKILLs whatever
is left at the end of the grace period; a new Pod always starts with an empty emptyDir. A Job
of several pods runs them as torchrun nodes that rendezvous on 127.0.0.1.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Optional

import torch
from safetensors.torch import load_file

from harness.procs import (
    ENTRYPOINT,
    UNSHARE_PID,
    Proc,
    children_of,
    clean_env,
    free_port,
    wait_for,
)
from harness.training import TORCHRUN, TRAIN_HF, steps_seen
from jitckpt_entrypoint.protocol import status

SIDECAR = [str(Path(sys.executable).parent / "jitckpt-sidecar")]


@dataclasses.dataclass(frozen=True)
class Node:
    """Where a pod sits in a multi-node torchrun job."""

    rank: int
    count: int
    master_port: int


@dataclasses.dataclass
class PodExit:
    trainer: Optional[int]
    sidecar: Optional[int]
    sigkilled: bool
    """Something was still running at the end of the grace period."""


class Pod:
    def __init__(
        self,
        root: Path,
        name: str,
        train_args: Sequence[str],
        s3_env: Mapping[str, str],
        storage_uri: str,
        grace: int = 30,
        node: Optional[Node] = None,
        env: Optional[Mapping[str, str]] = None,
        script: Path = TRAIN_HF,
        command: Optional[Sequence[str]] = None,
    ) -> None:
        self.name = name
        self.dir = root / name
        self.jdir = self.dir / "emptydir"
        self.jdir.mkdir(parents=True)
        (self.dir / "tmp").mkdir()
        self.grace = grace
        self.node = node
        self.metrics_port = free_port()
        self.env = _clean_env()
        self.env.update(s3_env)
        self.env.update(
            JITCKPT_DIR=str(self.jdir),
            JITCKPT_STORAGE_URI=storage_uri,
            JITCKPT_GRACE_SECONDS=str(grace),
            JITCKPT_METRICS_PORT=str(self.metrics_port),
            JITCKPT_METRICS_HOST="127.0.0.1",
            JITCKPT_TERMINATION_LOG=str(self.dir / "termination-log"),
            # The pod's own /tmp: train_hf.py's default output_dir (the final model in S3
            # mode) must not be shared with other pods' runs.
            TMPDIR=str(self.dir / "tmp"),
        )
        if node is not None:  # the sidecar knows the node, as k8s/multi-node tells it
            self.env.update(JITCKPT_NODE_RANK=str(node.rank), JITCKPT_NNODES=str(node.count))
        self.env.update(env or {})
        self.command = list(command) if command else self._torchrun(script, train_args)
        self.sidecar: Optional[Proc] = None
        self.trainer: Optional[Proc] = None
        self.trainer_pid1: Optional[int] = None
        self.started_at = 0.0

    def _torchrun(self, script: Path, args: Sequence[str]) -> list[str]:
        if self.node is None:
            launch = ["--standalone", "--nproc-per-node=2"]
        else:
            launch = [
                f"--nnodes={self.node.count}",
                f"--node-rank={self.node.rank}",
                "--nproc-per-node=2",
                "--master-addr=127.0.0.1",
                f"--master-port={self.node.master_port}",
            ]
        return [TORCHRUN, *launch, str(script), *args]

    # -- lifecycle, as the kubelet drives it -------------------------------------------------

    def start_sidecar(self) -> Proc:
        # Each container has its own /dev/termination-log.
        env = {**self.env, "JITCKPT_TERMINATION_LOG": str(self.dir / "sidecar-termination-log")}
        self.sidecar = Proc(SIDECAR, env=env)
        return self.sidecar

    def wait_ready(self, timeout: float = 120) -> None:
        """The native sidecar's startupProbe: GET /readyz until it answers 200."""
        assert self.sidecar is not None
        wait_for(
            lambda: self._ready() or self._sidecar_died(), timeout, f"{self.name} sidecar ready"
        )
        if not self._ready():
            raise AssertionError(
                f"{self.name}: sidecar exited before ready\n{self.sidecar.output()}"
            )

    def start_trainer(self) -> Proc:
        self.started_at = time.monotonic()
        self.trainer = Proc([*UNSHARE_PID, *ENTRYPOINT, "--", *self.command], env=self.env)
        trainer = self.trainer
        (self.trainer_pid1,) = wait_for(lambda: children_of(trainer.pid), 30, "the trainer's PID 1")
        return self.trainer

    def start(self) -> Pod:
        self.start_sidecar()
        self.wait_ready()
        self.start_trainer()
        return self

    def terminate(self) -> PodExit:
        """Preemption: SIGTERM to both containers at once; SIGKILL at the end of the grace."""
        deadline = time.monotonic() + self.grace
        for proc, pid in ((self.trainer, self.trainer_pid1), (self.sidecar, None)):
            if proc is not None and proc.popen.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid or proc.pid, signal.SIGTERM)
        return self._reap(deadline)

    def finish(self, timeout: float = 600) -> PodExit:
        """Training ends on its own; then the kubelet stops the sidecar (native sidecar rules)."""
        assert self.trainer is not None
        self.trainer.wait(timeout=timeout)
        if self.sidecar is not None and self.sidecar.popen.poll() is None:
            self.sidecar.send(signal.SIGTERM)
        return self._reap(time.monotonic() + self.grace)

    def kill(self) -> PodExit:
        """The node died: SIGKILL everything now."""
        for proc in (self.trainer, self.sidecar):
            if proc is not None:
                proc.kill_tree()
        return PodExit(self._code(self.trainer), self._code(self.sidecar), sigkilled=True)

    def _reap(self, deadline: float) -> PodExit:
        procs = [p for p in (self.trainer, self.sidecar) if p is not None]
        while any(p.popen.poll() is None for p in procs) and time.monotonic() < deadline:
            time.sleep(0.01)
        sigkilled = any(p.popen.poll() is None for p in procs)
        for proc in procs:
            proc.kill_tree()
        return PodExit(self._code(self.trainer), self._code(self.sidecar), sigkilled)

    @staticmethod
    def _code(proc: Optional[Proc]) -> Optional[int]:
        return None if proc is None else proc.popen.poll()

    # -- observation ---------------------------------------------------------------------------

    def _ready(self) -> bool:
        try:
            with urllib.request.urlopen(
                f"http://127.0.0.1:{self.metrics_port}/readyz", timeout=1
            ) as r:
                return bool(r.status == 200)
        except (urllib.error.URLError, OSError):
            return False

    def _sidecar_died(self) -> bool:
        return self.sidecar is not None and self.sidecar.popen.poll() is not None

    def metrics(self) -> str:
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=5) as response:
            return str(response.read().decode())

    def wait_step(self, step: int, timeout: float = 300) -> None:
        assert self.trainer is not None
        self.trainer.expect(rf"^step {step} rank=0$", timeout=timeout)

    def output(self) -> str:
        parts = []
        for label, proc in (("trainer", self.trainer), ("sidecar", self.sidecar)):
            if proc is not None:
                parts.append(f"===== {self.name} {label}\n{proc.output()}")
        return "\n".join(parts)

    def close(self) -> None:
        for proc in (self.trainer, self.sidecar):
            if proc is not None:
                proc.kill_tree()


def start_job(members: list[Pod]) -> list[Pod]:
    """Start a multi-node job as Kubernetes would: every sidecar, each ready (restored), then
    every trainer."""
    for pod in members:
        pod.start_sidecar()
    for pod in members:
        pod.wait_ready()
    for pod in members:
        pod.start_trainer()
    return members


def finish_resumed_job(members: list[Pod], step: int) -> None:
    """A job started on a restore from S3: every node resumed at `step`, trained to the end and
    its sidecar restored exactly that checkpoint."""
    assert resumed_from(members[0]) == step
    for pod in members:
        assert pod.finish().trainer == 0, pod.output()
    for pod in members:
        assert_restored_from_s3(pod, step)


def assert_restored_from_s3(pod: Pod, step: int) -> None:
    """The pod's sidecar restored exactly checkpoint-`step` from S3 (its ready record)."""
    ready = status.SIDECAR_READY.read(str(pod.jdir / "status"))
    assert ready is not None, pod.output()
    assert (ready.restore, ready.step) == ("s3", step), pod.output()


def restored_by_sidecars(members: list[Pod], source: Path, step: int) -> None:
    """New pods' sidecars alone (no trainer; what it would get): each restored checkpoint-`step`
    from S3, every file of `source` (the saving pod's copy) byte for byte; the manifests, which
    the restore writes anew, by name."""
    for pod in members:
        pod.start_sidecar()
    for pod in members:
        pod.wait_ready()
        assert_restored_from_s3(pod, step)
        restored = pod.jdir / "checkpoints" / source.name
        for path in (p for p in source.rglob("*") if p.is_file()):
            mine = restored / path.relative_to(source)
            if path.name.startswith("jitckpt-manifest."):
                assert mine.is_file(), mine
            else:
                assert mine.read_bytes() == path.read_bytes(), path


def _clean_env() -> dict[str, str]:
    return {k: v for k, v in clean_env().items() if not k.startswith("AWS_")}


def resumed_from(pod: Pod, timeout: float = 300) -> int:
    """The step rank 0's Trainer began at (0 for a fresh start)."""
    assert pod.trainer is not None
    return int(pod.trainer.expect(r"^begin rank=0 pid=\d+ step=(\d+)$", timeout=timeout).group(1))


def last_step(pod: Pod) -> int:
    """The last optimizer step rank 0 reported finished."""
    assert pod.trainer is not None
    return steps_seen(pod.trainer)[-1]


def final_weights(jdir: Path, step: int) -> dict[str, torch.Tensor]:
    return weights(jdir / "checkpoints" / f"checkpoint-{step}")


def weights(ckpt: Path) -> dict[str, torch.Tensor]:
    """The model weights of a checkpoint: model.safetensors, else FSDP's sharded DCP files."""
    if (ckpt / "model.safetensors").exists():
        return load_file(str(ckpt / "model.safetensors"))
    import tempfile

    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "model.pt"
        dcp_to_torch_save(str(ckpt / "pytorch_model_fsdp_0"), str(out))
        loaded = torch.load(out, weights_only=True)["model"]  # accelerate's DCP key
    return {k: v for k, v in loaded.items() if isinstance(v, torch.Tensor)}
