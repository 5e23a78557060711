"""Goodput through a scripted failure trace: HF's own checkpointing against jitckpt's, one pod
on Ceph RGW.

One pod of the tests' harness (tests/harness/pod.py: jitckpt-sidecar beside jitckpt-entrypoint
running `torchrun --standalone --nproc-per-node 2` on CPU/gloo, each pod with its own emptyDir)
trains tests/integration/children/train_hf.py (a Llama built from a config, random tokens,
`--step-sleep` added to every step so a step takes about as long as a real one relative to the
start-up of a process) against Ceph RGW 16 over HTTPS on loopback (tests/harness/rgw.py).

The trace. A seeded list of failures, the same for every variant: --sigterms preemptions, one
node loss and one worker crash, in a seeded order. Each fires a seeded number of seconds of
training after the previous (re)start's first step (together --minutes of training), so every
variant meets every failure after the same training time whatever its restarts cost:
- sigterm: a preemption. SIGTERM to both containers, SIGKILL at the end of the grace period;
  the Job's replacement is a new pod on another node: an empty emptyDir, restored from S3.
- pod-kill: a node loss. SIGKILL to the whole pod; a new pod restores from S3.
- container-oom (one per --container-ooms): the trainer container's cgroup OOM-killed, PID 1
  and all (its memory volume and sidecar stay); the pod is not restarted in place
  (restartPolicy Never): the kubelet stops its sidecar (SIGTERM), and a new pod restores from
  S3. jitckpt-ram's sidecar writes the newest snapshot in RAM out and uploads it first.
- worker-crash: SIGKILL to rank 1's worker. torchrun fails the container, which restarts in
  place at once (no CrashLoopBackOff delay) with the same emptyDir and the same sidecar.
- notice-N (one per --notices N): the cluster's notice, then a preemption. Karpenter's
  disruption taint on the pod's node (a Kubernetes API on loopback that speaks the watch
  protocol: tests/harness/kube_api.py), then N s of training, then SIGTERM as above. The jitckpt
  variants' sidecars watch their node and ask the trainer for a save now; the hf ones do not
  listen (nothing in HF's checkpointing would act on it). Reported per notice length: the
  newest step in S3 when SIGTERM came, and how much of the notice's save was there.
- node-loss (with --nodes 2 or more, in place of pod-kill and worker-crash): each job is one pod
  per node (`torchrun --nnodes`, static rendezvous on loopback). The last node's pod is
  SIGKILLed (a node lost without notice: its trainer and its sidecar), and the pods left get
  SIGTERM once node 0's trainer exited or 3 s later (the Job's controller deleting them); the
  next job is new pods on empty volumes, restored from S3. jitckpt's survivors save the last
  step they completed and their sidecars upload it in the drain; HF's ranks crash.
The run ends when training reaches its last step (max_steps = the trace's training seconds /
the uninterrupted step time), so a variant that loses work runs longer.

Variants (the same script and flags; periodic saves every --save-steps steps, save_total_limit 2):
- hf-periodic: the Trainer's periodic saves alone: JITCKPT_JIT=0 JITCKPT_ASYNC_SAVE=0 (the
  sidecar still uploads and restores them).
- hf-jit: the same plus HF's TrainingArguments(enable_jit_checkpoint=True). On SIGTERM each rank
  waits 3 s, then saves at its next step callback through the Trainer's _save_checkpoint, which
  the hook routes into JITCKPT_DIR/checkpoints and commits like a periodic save: a JIT
  checkpoint that is written is committed, uploaded by the draining sidecar and resumed from.
  The ranks do not agree on the step: when one rank starts the save's collectives while the
  other is still in a training step's all-reduce, gloo fails on the mismatch, no checkpoint is
  written and that preemption loses the steps since the last periodic save (seen in some
  preemptions of this bench, not all).
- jitckpt: the defaults (JIT checkpoint on SIGTERM, async periodic saves).
- jitckpt-interval: plus JITCKPT_SAVE_INTERVAL (--interval).
- jitckpt-overhead: plus JITCKPT_SAVE_OVERHEAD (--overhead), capped by --overhead-cap.
- jitckpt-ram: the defaults plus snapshots in RAM every --snapshot-interval: each pod gets its
  own JITCKPT_MEMORY_DIR on /dev/shm (a medium: Memory emptyDir: a restart in place keeps it, a
  new pod starts without).
Each repeat runs a failure-free baseline (no checkpoints) and then every variant through the
same trace, the variants in a rotated order per repeat.

Per variant:
- goodput: steps of progress x uninterrupted step time / wall time. The wall time runs from the
  first pod's start to training's last step; the uninterrupted step time is the baseline's mean
  step (after its first 10).
- goodput excl. start-ups: the same with every trainer start-up taken out of the wall time
  (trainer process start to the Trainer's on_train_begin: Python, torch and transformers
  imports, torchrun, the Trainer's set-up and checkpoint load). It costs every variant the same
  seconds per restart on this machine and no checkpoint tool controls it; a real job pays
  it too, but how long it is depends on its image and nodes.
- steps lost per failure kind (summed over the failures of that kind): the last step rank 0
  finished before the failure minus the step training resumed from after it.
- recovery s (median over failures): from the failure to the first step after the restart
  (the old pod's grace period, the new pod's restore, its start-up and one step).
- S3 MB written: the bytes of every PUT (objects and multipart parts) the pods sent, counted in
  RGW's access log (as bench_recovery.py counts them).

    .venv/bin/python bench/bench_goodput.py [--minutes 3] [--repeat 1] [--seed 1]
        [--sigterms 2] [--notices N ...] [--save-steps 500] [--step-sleep 0.1] [--interval 10s]
        [--overhead 5%] [--overhead-cap 30s] [--variants NAME ...] [--logs DIR] [--nodes 2]

Needs Ceph's binaries (tests/harness/rgw.py names the packages). One repeat of the default
3 minutes of training takes about 25 minutes on a 2-core VM. Temporary data lives under /tmp
(or $TMPDIR); --logs keeps every pod's output (trainer and sidecar).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parents[1]
CODE = [str(REPO / "entrypoint"), str(REPO / "sidecar")]
"""This checkout's packages, first on every path: the venv's editable install may point at
another checkout."""
sys.path[:0] = [*CODE, str(REPO / "tests"), str(REPO / "bench")]

from bench_recovery import AccessLog  # noqa: E402
from harness import rgw  # noqa: E402
from harness.kube_api import KubeApi  # noqa: E402
from harness.pod import Node, Pod  # noqa: E402
from harness.procs import Proc, descendants, environ_of, free_port  # noqa: E402
from harness.s3 import FAKE_CREDENTIALS, Bucket, RgwStore  # noqa: E402

MB = 1e6
KINDS = ("sigterm", "pod-kill", "worker-crash", "container-oom")
CONTAINER_OOM = "container-oom"
NODE_LOSS = "node-loss"
"""With --nodes 2 or more, instead of pod-kill and worker-crash: the last node's pod SIGKILLed
(a node lost without notice), the pods left SIGTERMed once node 0's trainer exited or
CONTROLLER_DELAY s later (the Job's controller deleting them), a new job on empty volumes."""
CONTROLLER_DELAY = 3.0
NOTICE = "notice-"
"""A kind `notice-<N>`: the cluster's notice (Karpenter's taint on the pod's node), then SIGTERM
N s later."""
NOTICE_TAINT = "karpenter.sh/disrupted"
STEP = re.compile(r"^step (\d+) rank=0$")
BEGIN = re.compile(r"^begin rank=0 pid=\d+ step=(\d+)$")


@dataclasses.dataclass(frozen=True)
class Variant:
    name: str
    env: dict[str, str]
    args: tuple[str, ...] = ()
    memory: bool = False
    """Each pod gets a memory directory of its own (JITCKPT_MEMORY_DIR)."""
    hears_notice: bool = True
    """Its sidecars watch their Node through the Kubernetes API (HF's own checkpointing has
    nothing that would act on a notice: its variants do not)."""


def variants(opts: argparse.Namespace) -> list[Variant]:
    hf = {"JITCKPT_JIT": "0", "JITCKPT_ASYNC_SAVE": "0"}
    return [
        Variant("hf-periodic", hf, hears_notice=False),
        Variant("hf-jit", hf, ("--hf-jit",), hears_notice=False),
        Variant("jitckpt", {}),
        Variant("jitckpt-interval", {"JITCKPT_SAVE_INTERVAL": opts.interval}),
        Variant(
            "jitckpt-overhead",
            {"JITCKPT_SAVE_OVERHEAD": opts.overhead, "JITCKPT_SAVE_INTERVAL": opts.overhead_cap},
        ),
        Variant("jitckpt-ram", {"JITCKPT_SNAPSHOT_INTERVAL": opts.snapshot_interval}, memory=True),
    ]


@dataclasses.dataclass(frozen=True)
class Event:
    after: float
    """Seconds of training after the previous (re)start's first step."""
    kind: str


def make_trace(
    seed: int,
    minutes: float,
    sigterms: int,
    notices: list[float],
    nodes: int = 1,
    *,
    container_ooms: int = 0,
) -> tuple[list[Event], float]:
    """The failures in a seeded order and spacing, and the training seconds after the last."""
    rng = random.Random(seed)
    kinds = ["sigterm"] * sigterms + (["pod-kill", "worker-crash"] if nodes == 1 else [NODE_LOSS])
    kinds += [f"{NOTICE}{lead:g}" for lead in notices]
    kinds += [CONTAINER_OOM] * container_ooms  # none by default: the traces stay as they were
    rng.shuffle(kinds)
    weights = [rng.uniform(0.5, 1.5) for _ in range(len(kinds) + 1)]
    seconds = [minutes * 60 * w / sum(weights) for w in weights]
    return [Event(round(s, 1), k) for s, k in zip(seconds, kinds)], round(seconds[-1], 1)


@dataclasses.dataclass
class AtSigterm:
    """What was durable in S3 when SIGTERM came after a notice."""

    lead: float
    """Seconds from the taint to the SIGTERM, measured."""
    noticed: int
    """The last step rank 0 finished when the node was tainted."""
    last: int
    """... and when SIGTERM came."""
    durable: int
    """The newest step committed in S3 then (0: none)."""
    saved: str
    """The notice's save (the first checkpoint after the taint's step) then: "committed" on the
    pod's volume, "being written", "not begun"; "-" for a variant that does not listen."""
    save_mb: float
    """... its size on the volume, MB."""
    durable_mb: float
    """... of it in S3 then."""


@dataclasses.dataclass
class Failure:
    kind: str
    last: int
    """The last step rank 0 finished before the failure."""
    resumed: int
    recovery: float
    down: float
    """From the failure to the old pod (or container) gone: the grace period's share."""
    notice: Optional[AtSigterm] = None


@dataclasses.dataclass
class Result:
    variant: str
    steps: int
    wall: float
    startups: list[float]
    failures: list[Failure]
    s3_bytes: int
    saves: int
    """Checkpoints the sidecars uploaded (their `uploaded checkpoint-N` lines)."""
    intervals: list[str] = dataclasses.field(default_factory=list)
    """The overhead budget's choices, in order (rank 0's `save interval ...` lines)."""

    def goodput(self, step_time: float, exclude_startups: bool = False) -> float:
        wall = self.wall - (sum(self.startups) if exclude_startups else 0.0)
        return self.steps * step_time / wall

    def lost(self, kind: str) -> Optional[int]:
        mine = [f.last - f.resumed for f in self.failures if f.kind == kind]
        return sum(mine) if mine else None


# -- one run ---------------------------------------------------------------------------------


class Runner:
    """Jobs of one variant on its own bucket, through the trace: each job one pod, or with
    `nodes` > 1 one pod per node (`torchrun --nnodes`)."""

    def __init__(
        self,
        root: Path,
        bucket: Bucket,
        variant: Variant,
        args: list[str],
        grace: int,
        *,
        api: Optional[KubeApi] = None,
        nodes: int = 1,
    ) -> None:
        self.root, self.bucket, self.variant, self.api = root, bucket, variant, api
        self.args, self.grace, self.nodes = [*args, *variant.args], grace, nodes
        self.pods: list[Pod] = []
        self.job: list[Pod] = []
        """The pods of the job training now, node 0's first."""
        self.trainers: list[Proc] = []
        """Node 0's trainer of every start (rank 0's output)."""
        self.startups: list[float] = []
        self.memory: list[str] = []
        self.notice: Optional[AtSigterm] = None

    def node(self) -> str:
        """The node of the newest job's first pod (every pod lands on a node of its own)."""
        return f"{self.job[0].name}-node"

    def new_pod(self) -> Pod:
        """A new job (a new pod per node, empty volumes): every sidecar ready, then every
        trainer; returns node 0's pod."""
        port = free_port()
        job = len(self.pods) // self.nodes
        self.job = [self._pod(job, n, port) for n in range(self.nodes)]
        for pod in self.job:
            pod.start_sidecar()
        for pod in self.job:
            pod.wait_ready(timeout=600)
        for pod in self.job[1:]:
            pod.start_trainer()
        self.start_trainer(self.job[0])
        return self.job[0]

    def _pod(self, job: int, rank: int, port: int) -> Pod:
        env = {
            **self.variant.env,
            "AWS_SDK_UA_APP_ID": "goodput",
            "PYTHONPATH": os.pathsep.join(CODE),
        }
        name = f"{self.variant.name}-{job}" + (f"-n{rank}" if self.nodes > 1 else "")
        if self.api is not None and self.variant.hears_notice:
            node = f"{name}-node"
            self.api.add_node(node)
            self.api.add_pod("training", name)
            env.update(self.api.env())
            env.update(
                JITCKPT_KUBE_CREDENTIALS=str(self.api.credentials),
                JITCKPT_NODE_NAME=node,
                JITCKPT_POD_NAME=name,
                JITCKPT_POD_NAMESPACE="training",
            )
        if self.variant.memory:  # the pod's own medium: Memory emptyDir
            shm = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
            self.memory.append(tempfile.mkdtemp(prefix="goodput-memory-", dir=shm))
            env["JITCKPT_MEMORY_DIR"] = self.memory[-1]
        pod = Pod(
            self.root,
            name,
            self.args,
            self.bucket.env({}),
            self.bucket.uri,
            grace=self.grace,
            node=Node(rank, self.nodes, port) if self.nodes > 1 else None,
            env=env,
        )
        self.pods.append(pod)
        return pod

    def start_trainer(self, pod: Pod) -> None:
        self.trainers.append(pod.start_trainer())

    def began(self, timeout: float = 600) -> tuple[int, float]:
        """(resumed step, seconds from the trainer's start to train()'s first step)."""
        proc, pod = self.trainers[-1], self.job[0]
        resumed = int(proc.expect(BEGIN.pattern, timeout=timeout).group(1))
        begin_at = next(t for t, line in proc.stamped if BEGIN.match(line))
        self.startups.append(begin_at - pod.started_at)
        proc.expect(rf"^step {resumed + 1} rank=0$", timeout=timeout)
        first = next(t for t, line in proc.stamped if STEP.match(line))
        return resumed, first

    def finished(self, max_steps: int) -> Optional[float]:
        """When rank 0 finished the last step, if it has."""
        for t, line in self.trainers[-1].stamped:
            if line == f"step {max_steps} rank=0":
                return t
        return None

    def fail(self, kind: str) -> tuple[int, float]:
        """Inflict `kind` and start the replacement; returns the last step rank 0 finished
        before it (its output is complete once the pod or container is gone) and when the
        failed pod or container was gone."""
        pod, proc = self.job[0], self.trainers[-1]
        self.notice = None
        if kind.startswith(NOTICE):
            self.notice = self.warn(pod, proc, float(kind[len(NOTICE) :]))
            self.terminate(self.job)
            gone = time.monotonic()
            self.new_pod()
        elif kind == "sigterm":
            self.terminate(self.job)
            gone = time.monotonic()
            self.new_pod()
        elif kind == NODE_LOSS:
            self.job[-1].kill()
            deadline = time.monotonic() + CONTROLLER_DELAY
            while time.monotonic() < deadline and proc.popen.poll() is None:
                time.sleep(0.05)  # node 0's survivors' save (or crash) ends it sooner
            self.terminate(self.job[:-1])
            gone = time.monotonic()
            self.new_pod()
        elif kind == "pod-kill":
            pod.kill()
            gone = time.monotonic()
            self.new_pod()
        elif kind == CONTAINER_OOM:
            proc.kill_tree()  # the container's cgroup: its PID 1 and every process in it
            self.terminate([pod])  # the kubelet stops the sidecar: it drains
            gone = time.monotonic()
            self.new_pod()
        else:
            worker = next(
                pid
                for pid in descendants(proc.pid)
                if "train_hf.py" in _cmdline(pid) and environ_of(pid).get("RANK") == "1"
            )
            os.kill(worker, signal.SIGKILL)
            proc.wait(timeout=self.grace + 60)  # torchrun fails the container
            gone = time.monotonic()
            self.start_trainer(pod)
        return _last_step(proc), gone

    @staticmethod
    def terminate(pods: list[Pod]) -> None:
        """SIGTERM to every pod of `pods` at once (a preemption of the job, or the controller
        deleting the pods left); returns when each is gone or SIGKILLed."""
        with ThreadPoolExecutor(len(pods)) as pool:
            list(pool.map(Pod.terminate, pods))

    def warn(self, pod: Pod, proc: Proc, lead: float) -> AtSigterm:
        """The notice: taint the pod's node (if its variant listens, it hears it), wait `lead` s
        and see what is durable in S3 just before the SIGTERM the caller sends."""
        noticed, at = _last_step(proc), time.monotonic()
        if self.api is not None and self.variant.hears_notice:
            self.api.taint(self.node(), NOTICE_TAINT)
        while time.monotonic() < at + lead:
            if proc.popen.poll() is not None:
                raise RuntimeError(f"{self.variant.name}: the trainer exited after the notice")
            time.sleep(0.05)
        # One LIST (tens of ms, not a read of every manifest): the SIGTERM follows at once.
        last, in_s3 = _last_step(proc), self.bucket.keys()
        durable = max(
            (int(k.split("/")[0][len("checkpoint-") :]) for k in in_s3 if _commit(k)), default=0
        )
        local = sorted(
            (int(d.name.split("-")[1]), d)
            for d in (pod.jdir / "checkpoints").glob("checkpoint-*")
            if d.name.split("-")[1].isdigit() and int(d.name.split("-")[1]) > noticed
        )
        save_mb = durable_mb = 0.0
        saved = "not begun"
        if not self.variant.hears_notice:
            saved = "-"  # a periodic save in the lead is not the notice's
        elif local:
            step, directory = local[0]
            whole = (directory / "jitckpt-manifest.node-0.json").exists()
            saved = "committed" if whole else "being written"
            save_mb = sum(f.stat().st_size for f in directory.rglob("*") if f.is_file()) / MB
            mine = f"checkpoint-{step}/"
            durable_mb = sum(size for k, size in in_s3.items() if k.startswith(mine)) / MB
        return AtSigterm(
            time.monotonic() - at, noticed, last, durable, saved, save_mb, min(durable_mb, save_mb)
        )

    def close(self, logs: Optional[Path] = None) -> None:
        for memory in self.memory:
            shutil.rmtree(memory, ignore_errors=True)
        for pod in self.pods:
            pod.close()
            if logs is not None:
                logs.mkdir(parents=True, exist_ok=True)
                (logs / f"{pod.name}.log").write_text(pod.output())

    def output(self) -> str:
        return "\n".join(pod.output()[-6000:] for pod in self.pods)


def _commit(key: str) -> bool:
    """A single-node checkpoint's manifest in S3: the sidecar puts it after every file."""
    return key.startswith("checkpoint-") and key.endswith("/jitckpt-manifest.node-0.json")


def _last_step(proc: Proc) -> int:
    steps = [int(m.group(1)) for line in proc.stdout if (m := STEP.match(line))]
    return steps[-1] if steps else 0


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def run_variant(
    runner: Runner, trace: list[Event], max_steps: int, log: AccessLog, logs: Optional[Path]
) -> Result:
    mark = log.mark()
    try:
        wall, failures = through(runner, trace, max_steps)
    except BaseException:
        print(runner.output(), file=sys.stderr)
        raise
    finally:
        runner.close(logs)
    written = sum(r.bytes for r in log.since(mark) if r.method == "PUT")
    uploads = sum(  # node 0's sidecars: every node's logs its own part of each checkpoint
        "uploaded checkpoint-" in line
        for p in runner.pods
        if p.sidecar is not None and (p.node is None or p.node.rank == 0)
        for line in p.sidecar.stderr
    )
    intervals = [
        line.split("INFO ", 1)[-1]
        for proc in runner.trainers
        for line in proc.stderr
        if "jitckpt-hook[rank 0]" in line and "save interval " in line
    ]
    return Result(
        runner.variant.name, max_steps, wall, runner.startups, failures, written, uploads, intervals
    )


def through(runner: Runner, trace: list[Event], max_steps: int) -> tuple[float, list[Failure]]:
    """Train through `trace` to `max_steps`, the last pod finishing (its sidecar uploads the
    final checkpoint); returns the wall time to the last step and the failures."""
    started = time.monotonic()
    failures: list[Failure] = []
    runner.new_pod()
    _, segment = runner.began()
    for event in trace:
        while time.monotonic() < segment + event.after:
            if runner.trainers[-1].popen.poll() is not None:
                raise RuntimeError(f"{runner.variant.name}: the trainer exited by itself")
            time.sleep(0.05)
        at = time.monotonic()
        last, gone = runner.fail(event.kind)
        if runner.notice is not None:  # the failure is the SIGTERM; the notice came before it
            at += runner.notice.lead
        resumed, segment = runner.began()
        failures.append(Failure(event.kind, last, resumed, segment - at, gone - at, runner.notice))
        print(
            f"  {runner.variant.name}: {event.kind} at step {last}, resumed at {resumed}, "
            f"training again {segment - at:.1f} s later",
            file=sys.stderr,
            flush=True,
        )
    ended = _wait(lambda: runner.finished(max_steps), 3600, "the last step")
    for pod in runner.job:
        out = pod.finish(timeout=600)
        if out.trainer != 0:
            raise RuntimeError(f"{runner.variant.name}: {pod.name}'s trainer exit {out}")
    return ended - started, failures


def _wait(predicate: Callable[[], Optional[float]], timeout: float, what: str) -> float:
    deadline = time.monotonic() + timeout
    while (value := predicate()) is None:
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.05)
    return value


def baseline(root: Path, bucket: Bucket, args: list[str], steps: int, nodes: int) -> float:
    """The uninterrupted step time: the mean step of a run without failures or checkpoints,
    after its first 10 steps."""
    no_saves = Variant("baseline", {"JITCKPT_SAVE_STRATEGY": "no"})
    runner = Runner(root, bucket, no_saves, [*args, "--max-steps", str(steps)], 30, nodes=nodes)
    try:
        runner.new_pod()
        proc = runner.trainers[-1]
        proc.expect(rf"^step {steps} rank=0$", timeout=900)
        times = {int(m.group(1)): t for t, line in proc.stamped if (m := STEP.match(line))}
        return (times[steps] - times[10]) / (steps - 10)
    finally:
        runner.close()


# -- the report ------------------------------------------------------------------------------


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def report(results: dict[str, list[Result]], step_times: list[float]) -> None:
    seen = [f.kind for runs in results.values() for r in runs for f in r.failures]
    kinds = [k for k in KINDS if k in seen]  # their usual order, then the trace's others
    for kind in seen:
        kinds += [kind] if kind not in kinds else []
    step = statistics.median(step_times)
    repeats = len(step_times)
    anchor = results.get("hf-periodic")
    print(
        f"\n### Goodput through the trace, {repeats} repeat(s)"
        f"{' (medians)' if repeats > 1 else ''}; uninterrupted step {step * 1e3:.0f} ms"
        f" ({', '.join(f'{s * 1e3:.0f}' for s in step_times)} ms per repeat)\n"
    )
    print(
        f"| variant | goodput | vs hf-periodic | goodput excl. start-ups | steps lost: "
        f"{' | '.join(kinds)} | recovery s (median) | sigterm: pod gone s | start-ups s | wall s "
        "| S3 MB written | vs hf-periodic | uploads |"
    )
    print("|---" * (11 + len(kinds)) + "|")
    base_good = _median([r.goodput(s) for r, s in zip(anchor, step_times)]) if anchor else None
    base_mb = _median([r.s3_bytes / MB for r in anchor]) if anchor else None
    for name, runs in results.items():
        good = _median([r.goodput(s) for r, s in zip(runs, step_times)])
        excl = _median([r.goodput(s, exclude_startups=True) for r, s in zip(runs, step_times)])
        lost = []
        for kind in kinds:
            values = [v for r in runs if (v := r.lost(kind)) is not None]
            lost.append(f"{_median(values):.0f}" if values else "-")
        recovery = _median([f.recovery for r in runs for f in r.failures])
        down = _median([f.down for r in runs for f in r.failures if f.kind == "sigterm"])
        mb = _median([r.s3_bytes / MB for r in runs])
        versus = f"{good / base_good:.2f}x" if base_good else "-"
        print(
            f"| {name} | {good:.3f} | {versus} | {excl:.3f} | {' | '.join(lost)} "
            f"| {recovery:.1f} | {down:.1f} | {_median([sum(r.startups) for r in runs]):.0f} "
            f"| {_median([r.wall for r in runs]):.0f} | {mb:.0f} "
            f"| {(f'{mb / base_mb:.2f}x' if base_mb else '-')} "
            f"| {_median([float(r.saves) for r in runs]):.0f} |"
        )
    print(
        "\nsteps lost: summed over the failures of that kind (median over repeats); recovery:"
        " failure to the first step after the restart; pod gone: SIGTERM to both containers"
        " exited (the JIT save, the sidecar's drain); start-ups: trainer process start to"
        " the Trainer's on_train_begin, summed over every start (the first included);"
        " goodput excl. start-ups takes them out of the wall time; uploads: checkpoints the"
        " sidecars uploaded."
    )
    notices(results)
    for name, runs in results.items():
        for i, r in enumerate(runs):
            detail = ", ".join(
                f"{f.kind} {f.last}->{f.resumed} (gone {f.down:.1f} s, training {f.recovery:.1f} s)"
                for f in r.failures
            )
            print(f"  {name} #{i + 1}: {detail}; {r.steps} steps in {r.wall:.0f} s")
            for line in r.intervals:
                print(f"    {line}")


def notices(results: dict[str, list[Result]]) -> None:
    """Per variant and notice length: what was durable in S3 when SIGTERM came."""
    rows = [(name, f) for name, runs in results.items() for r in runs for f in r.failures]
    rows = [(name, f, f.notice) for name, f in rows if f.notice is not None]
    if not rows:
        return
    print(
        "\n### The cluster's notice before SIGTERM\n\n"
        "| variant | notice s before SIGTERM | steps in the lead | newest step in S3 at SIGTERM "
        "| steps at risk then | the notice's save in S3 then | steps lost | pod gone s |\n"
        "|---|---|---|---|---|---|---|---|"
    )
    for name, f, n in sorted(rows, key=lambda row: (row[0], row[2].lead)):
        save = (
            f"{n.durable_mb:.1f} of {n.save_mb:.1f} MB ({n.durable_mb / n.save_mb:.0%})"
            if n.saved == "committed"
            else n.saved
        )
        print(
            f"| {name} | {n.lead:.1f} | {n.last - n.noticed} | {n.durable or '-'} "
            f"| {n.last - n.durable} | {save} | {f.last - f.resumed} | {f.down:.1f} |"
        )
    print(
        "\nsteps at risk: the last step rank 0 finished at SIGTERM minus the newest step"
        " committed in S3 then (what a node lost at that moment would cost); the notice's save:"
        " the first checkpoint after the step of the taint, its bytes in S3 at SIGTERM"
        " against its size on the volume once committed there, else whether it was being"
        " written ('-': a variant that does not hear the notice);"
        " steps lost: after the SIGTERM's own JIT save, the grace period and the restore."
    )


# -- main ------------------------------------------------------------------------------------


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=3.0, help="training time in the trace")
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--sigterms", type=int, default=2)
    parser.add_argument(
        "--notices",
        type=float,
        nargs="*",
        default=[],
        metavar="N",
        help="a notice-N failure per N: Karpenter's taint on the node, SIGTERM N s later",
    )
    parser.add_argument(
        "--container-ooms",
        type=int,
        default=0,
        help="container-oom failures: the trainer container killed whole, the pod replaced",
    )
    parser.add_argument("--save-steps", type=int, default=500)
    parser.add_argument("--step-sleep", type=float, default=0.1)
    parser.add_argument(
        "--interval", default="10s", help="jitckpt-interval's JITCKPT_SAVE_INTERVAL"
    )
    parser.add_argument("--overhead", default="5%", help="jitckpt-overhead's JITCKPT_SAVE_OVERHEAD")
    parser.add_argument("--overhead-cap", default="30s", help="and its JITCKPT_SAVE_INTERVAL")
    parser.add_argument(
        "--snapshot-interval", default="10s", help="jitckpt-ram's JITCKPT_SNAPSHOT_INTERVAL"
    )
    parser.add_argument("--baseline-steps", type=int, default=150)
    parser.add_argument("--grace", type=int, default=30, help="terminationGracePeriodSeconds")
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--logs", type=Path, default=None, help="keep every pod's output here")
    parser.add_argument("--variants", nargs="+", default=None, help="a subset, by name")
    parser.add_argument(
        "--nodes",
        type=int,
        default=1,
        help="pods per job (torchrun --nnodes); 2 or more: node-loss instead of pod-kill and "
        "worker-crash",
    )
    opts = parser.parse_args()
    if opts.nodes < 1:
        parser.error("--nodes: 1 or more")
    if opts.nodes > 1 and opts.variants and "jitckpt-ram" in opts.variants:
        parser.error("jitckpt-ram with --nodes > 1: RAM snapshots are off with several nodes")
    if opts.nodes > 1 and opts.container_ooms:
        parser.error("--container-ooms with --nodes > 1: not built (one node's container)")
    if opts.nodes > 1 and opts.notices:
        parser.error(
            "--notices with --nodes > 1: not built (the notice's save is measured on "
            "one node's files)"
        )
    return opts


def main() -> None:
    opts = parse_args()
    if rgw.missing_binaries():
        raise SystemExit(f"needs Ceph: {rgw.INSTALL_HINT}")
    chosen = [v for v in variants(opts) if opts.variants is None or v.name in opts.variants]
    if opts.nodes > 1:  # RAM snapshots are off with several nodes: it would be jitckpt again
        chosen = [v for v in chosen if not v.memory]
    trace, tail = make_trace(
        opts.seed,
        opts.minutes,
        opts.sigterms,
        opts.notices,
        opts.nodes,
        container_ooms=opts.container_ooms,
    )
    model = ["--hidden", str(opts.hidden), "--layers", str(opts.layers), "--vocab", str(opts.vocab)]
    common = [*model, "--step-sleep", str(opts.step_sleep), "--save-total-limit", "2"]
    revision = subprocess.run(
        ["git", "-C", str(REPO), "describe", "--always", "--dirty"],
        capture_output=True,
        text=True,
        check=False,
    ).stdout.strip()
    print(
        f"code: {REPO} at {revision}; model {' '.join(model)}, --step-sleep {opts.step_sleep},"
        f" save_steps {opts.save_steps}, {opts.nodes} node(s) x 2 CPU ranks (gloo),"
        f" grace {opts.grace} s"
    )
    print(f"trace (seed {opts.seed}), seconds of training after the previous restart:")
    for i, event in enumerate(trace):
        print(f"  {i + 1}. after {event.after:5.1f} s: {event.kind}")
    print(f"  then {tail:.1f} s of training to the last step")
    keys = FAKE_CREDENTIALS["AWS_ACCESS_KEY_ID"], FAKE_CREDENTIALS["AWS_SECRET_ACCESS_KEY"]
    results: dict[str, list[Result]] = {v.name: [] for v in chosen}
    step_times: list[float] = []
    with tempfile.TemporaryDirectory(prefix="bench-goodput-") as tmp_name:
        tmp = Path(tmp_name)
        api = KubeApi(tmp / "kube") if opts.notices else None
        with contextlib.ExitStack() as stack, rgw.running(tmp / "ceph", *keys) as cluster:
            if api is not None:
                stack.callback(api.stop)
            print(f"Ceph RGW up in {cluster.start_seconds:.1f} s", file=sys.stderr, flush=True)
            store = RgwStore(cluster)
            log = AccessLog(cluster.root / "log" / "client.rgw.a.log", "")

            def bucket(name: str) -> Bucket:
                client = store.client()
                client.create_bucket(Bucket=name)
                log.bucket = name
                return Bucket(store, name, client, prefix="job")

            for rep in range(opts.repeat):
                step = baseline(
                    tmp / f"r{rep}",
                    bucket(f"baseline-{rep}"),
                    common,
                    opts.baseline_steps,
                    opts.nodes,
                )
                step_times.append(step)
                max_steps = round(opts.minutes * 60 / step)
                print(
                    f"== repeat {rep + 1}: uninterrupted step {step * 1e3:.1f} ms,"
                    f" max_steps {max_steps}",
                    file=sys.stderr,
                    flush=True,
                )
                args = [
                    *common,
                    *("--max-steps", str(max_steps), "--save-steps", str(opts.save_steps)),
                ]
                order = chosen[rep % len(chosen) :] + chosen[: rep % len(chosen)]
                for variant in order:
                    started = time.monotonic()
                    runner = Runner(
                        tmp / f"r{rep}",
                        bucket(f"{variant.name}-{rep}"),
                        variant,
                        args,
                        opts.grace,
                        api=api,
                        nodes=opts.nodes,
                    )
                    logs = opts.logs / f"r{rep}" if opts.logs else None
                    result = run_variant(runner, trace, max_steps, log, logs)
                    results[variant.name].append(result)
                    print(
                        f"== {variant.name}: goodput {result.goodput(step):.3f}"
                        f" ({time.monotonic() - started:.0f} s)",
                        file=sys.stderr,
                        flush=True,
                    )
    report(results, step_times)


if __name__ == "__main__":
    main()
