"""make demo: one training job, preempted twice at random steps, resumed from S3 in fresh pods.

Everything runs on this machine with the test harness's real parts: a moto S3 server on
127.0.0.1, and pods of jitckpt-entrypoint (PID 1 of its own PID namespace) running
`torchrun --nproc-per-node 2` on a tiny Llama with the HF Trainer, beside a jitckpt-sidecar.

  pod-1  trains from scratch; SIGTERM (to both containers, as the kubelet does) at a random step
  pod-2  fresh emptyDir: its sidecar restores the JIT checkpoint from S3; at a random step the
         cluster's notice comes first (Karpenter's disruption taint on its node, through a
         Kubernetes API on 127.0.0.1 that speaks the watch protocol: tests/harness/kube_api.py):
         its sidecar asks for a save now and has it in S3 before the SIGTERM that follows
  pod-3  restores the second JIT checkpoint and trains to the end
  reference  the same job, uninterrupted, under its own S3 prefix

Then it compares the final weights with the reference and reports. Outputs go to demo-out/:
per-pod logs, each sidecar's last /metrics scrape, timeline.png and report.txt.

    .venv/bin/python demo/demo.py [--seed N] [--out DIR] [--keep-checkpoints]
"""

from __future__ import annotations

import argparse
import contextlib
import random
import shutil
import signal
import sys
import time
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the pod harness

import report
import timeline
from harness.checkpoints import committed_in_s3
from harness.kube_api import KubeApi
from harness.pod import Pod, final_weights, last_step, resumed_from
from harness.procs import wait_for
from harness.s3 import Bucket, MotoServer
from jitckpt_entrypoint.protocol import status
from observe import MetricsTap, PodRun, read_status

REPO = Path(__file__).resolve().parents[1]
TOTAL = 100
SAVE_STEPS = 20
MODEL = ["--hidden", "128", "--layers", "4", "--vocab", "2048"]  # ~1.1M params, 13.5 MB checkpoints
STEP_SLEEP = "0.05"
"""Seconds added to each step: at this model's ~30 steps a second, the notice's save (1-2 s to
S3) and NOTICE_LEAD would otherwise outlast the steps left, and pod-2 would finish before its
SIGTERM."""
TRAIN_ARGS = [
    "--max-steps", str(TOTAL), "--save-steps", str(SAVE_STEPS), "--step-sleep", STEP_SLEEP, *MODEL
]  # fmt: skip
# The pods' sidecars serve /metrics on loopback only: this is a demo on someone's machine.
POD_ENV = {"JITCKPT_METRICS_HOST": "127.0.0.1"}
BUCKET = "jitckpt-demo"
TOLERANCE = 1e-7
NOTICE_LEAD = 1.0
"""Seconds from pod-2's save asked for being in S3 to its SIGTERM (Karpenter's own lead varies)."""
NODE, NAMESPACE = "node-b", "demo"
"""pod-2's node and namespace in the demo's Kubernetes API."""
OUTPUTS = ("*-trainer.log", "*-sidecar.log", "metrics-*.txt", "timeline.png", "report.txt")


class Demo:
    def __init__(self, out: Path, seed: int) -> None:
        self.out = out
        self.seed = seed
        rng = random.Random(seed)
        first = rng.randint(10, TOTAL // 2 - 10)
        self.targets = (first, rng.randint(first + 15, TOTAL - 45))
        """The steps after which pod-1 gets SIGTERM and pod-2 the cluster's notice (its SIGTERM
        follows NOTICE_LEAD s after the save asked for is in S3)."""
        self.started = time.monotonic()
        self.t0 = self.started  # reset when pod-1 is created: the timeline's zero
        self.server: Optional[MotoServer] = None
        self.api: Optional[KubeApi] = None
        self.notice: dict[str, float] = {}
        """pod-2's notice: the step it came after, the step saved, seconds to S3 and SIGTERM."""
        self.runs: list[PodRun] = []
        self.reference: Optional[PodRun] = None
        self.failures: list[str] = []

    def say(self, message: str) -> None:
        print(f"[{time.monotonic() - self.started:6.1f}s] {message}", flush=True)

    def check(self, ok: bool, failure: str) -> None:
        if not ok:
            self.failures.append(failure)
            self.say(f"CHECK FAILED: {failure}")

    # -- the pods --

    def launch(self, name: str, bucket: Bucket, env: Optional[dict[str, str]] = None) -> PodRun:
        pod = Pod(
            self.out / "pods",
            name,
            TRAIN_ARGS,
            s3_env=bucket.env({}),
            storage_uri=bucket.uri,
            env={**POD_ENV, **(env or {})},
        )
        run = PodRun(pod, MetricsTap(pod), time.monotonic(), bucket.keys())
        if name == "reference":
            self.reference = run
        else:
            self.runs.append(run)
        run.tap.start()
        self.say(f"{name}: created (empty emptyDir); sidecar /metrics at {run.tap.url}")
        pod.start()
        run.ready = read_status(pod, status.SIDECAR_READY.name)
        run.begin = resumed_from(pod)
        if run.ready.get("restore") == "s3":
            self.say(
                f"{name}: sidecar restored checkpoint-{run.ready['step']} from S3 "
                f"({report.megabytes(run.ready['restore_bytes'])} in "
                f"{run.ready['restore_seconds']:.2f} s); trainer resumed at step {run.begin}"
            )
        else:
            self.say(f"{name}: nothing in S3 yet; trainer started at step {run.begin}")
        return run

    def preempt(self, run: PodRun, bucket: Bucket, target: int) -> None:
        run.pod.wait_step(max(target, run.begin + 1))
        run.sigterm_after = last_step(run.pod)
        run.tap.fast()
        run.sigterm_sent = time.monotonic()
        self.say(f"{run.name}: SIGTERM to both containers after step {run.sigterm_after}")
        run.exit = run.pod.terminate()
        run.settle(bucket)
        jit = run.jit
        self.say(
            f"{run.name}: exited {run.exit.trainer} (sidecar {run.exit.sidecar}); "
            + (
                f"JIT {jit['checkpoint']} committed {report.seconds(report.trigger_to_commit(jit))}"
                " after SIGTERM"
                if jit
                else "no JIT checkpoint"
            )
        )
        self.check(
            (run.exit.trainer, run.exit.sidecar, run.exit.sigkilled) == (143, 0, False),
            f"{run.name}: exit codes trainer/sidecar {run.exit.trainer}/{run.exit.sidecar}"
            f"{', SIGKILLed at the grace period' if run.exit.sigkilled else ''}; expected 143/0",
        )
        self.check(bool(jit), f"{run.name}: no status/jit.json (no JIT checkpoint committed)")
        if jit:
            name = jit["checkpoint"]
            self.check(
                jit["step"] >= run.sigterm_after,
                f"{run.name}: JIT {name} is older than step {run.sigterm_after} (before SIGTERM)",
            )
            self.check(
                f"{name}/jitckpt-manifest.node-0.json" in bucket.keys(name),
                f"{run.name}: {name} is not committed in S3",
            )

    def kube(self) -> KubeApi:
        if self.api is None:
            raise RuntimeError("the demo's Kubernetes API is not started")
        return self.api

    def kube_env(self, pod: str) -> dict[str, str]:
        """What the downward API and the service account give a pod on NODE."""
        api = self.kube()
        api.add_pod(NAMESPACE, pod)
        return {
            **api.env(),
            "JITCKPT_KUBE_CREDENTIALS": str(api.credentials),
            "JITCKPT_NODE_NAME": NODE,
            "JITCKPT_POD_NAME": pod,
            "JITCKPT_POD_NAMESPACE": NAMESPACE,
        }

    def notify(self, run: PodRun, bucket: Bucket, target: int) -> None:
        """The cluster's notice before the SIGTERM: Karpenter taints the pod's node; its sidecar
        asks the trainer for a save now and uploads it while training goes on."""
        api = self.kube()
        run.pod.wait_step(max(target, run.begin + 1))
        after_step, noticed = last_step(run.pod), time.monotonic()
        api.taint(NODE, "karpenter.sh/disrupted")
        self.say(f"{run.name}: notice after step {after_step}: Karpenter taints {NODE}")
        folder = str(run.pod.jdir / "status")
        answer = wait_for(lambda: status.SAVE_ANSWER.read(folder), 60, "the trainer's answer")
        saved = answer.step
        wait_for(lambda: saved in committed_in_s3(bucket), 60, f"checkpoint-{saved} in S3")
        durable = time.monotonic() - noticed
        self.say(
            f"{run.name}: checkpoint-{saved} (asked for by the sidecar) in S3 {durable:.2f} s "
            "after the notice; training goes on"
        )
        self.check(saved >= after_step, f"{run.name}: the notice's save {saved} < {after_step}")
        self.notice = {"after": after_step, "saved": saved, "durable": durable}
        time.sleep(NOTICE_LEAD)
        self.notice["sigterm"] = time.monotonic() - noticed

    def finish(self, run: PodRun, bucket: Bucket) -> None:
        run.exit = run.pod.finish()
        run.settle(bucket)
        self.say(
            f"{run.name}: finished at step {run.last_done}; exited {run.exit.trainer} "
            f"(sidecar {run.exit.sidecar})"
        )
        self.check(
            (run.exit.trainer, run.exit.sidecar, run.exit.sigkilled) == (0, 0, False),
            f"{run.name}: exit codes trainer/sidecar {run.exit.trainer}/{run.exit.sidecar}"
            f"{', SIGKILLed at the grace period' if run.exit.sigkilled else ''}; expected 0/0",
        )
        self.check(run.last_done == TOTAL, f"{run.name}: ended at {run.last_done}, not {TOTAL}")

    # -- the whole demo --

    def run(self) -> tuple[float, float]:
        """Returns (max abs weight difference, seconds the job took)."""
        self.api = KubeApi(self.out / "kube")
        self.api.add_node(NODE)
        self.server = MotoServer().start()
        client = self.server.client()
        client.create_bucket(Bucket=BUCKET)
        job = Bucket(self.server, BUCKET, client, prefix="job")
        straight = Bucket(self.server, BUCKET, client, prefix="reference")
        self.say(f"S3: moto on {self.server.endpoint}; job checkpoints go to {job.uri}")

        self.t0 = time.monotonic()
        first = self.launch("pod-1", job)
        self.preempt(first, job, self.targets[0])
        second = self.launch("pod-2", job, self.kube_env("pod-2"))
        self.notify(second, job, self.targets[1])
        self.preempt(second, job, last_step(second.pod))
        third = self.launch("pod-3", job)
        self.finish(third, job)
        for steps_lost, after in zip(report.lost(self.runs), self.runs[1:]):
            self.check(
                steps_lost == 0, f"{after.name} resumed at {after.begin}: {steps_lost} steps lost"
            )
        for before, after in zip(self.runs, self.runs[1:]):
            if before.jit:
                self.check(
                    after.ready.get("step") == before.jit["step"] == after.begin,
                    f"{after.name}: restored {after.ready.get('step')} and resumed at "
                    f"{after.begin}; {before.name}'s JIT checkpoint was {before.jit['step']}",
                )
        job_seconds = third.ended_at - self.t0

        self.say(f"reference: the same job uninterrupted, checkpoints to {straight.uri}")
        reference = self.launch("reference", straight)
        self.finish(reference, straight)

        expected = final_weights(reference.pod.jdir, TOTAL)
        got = final_weights(third.pod.jdir, TOTAL)
        self.check(got.keys() == expected.keys(), "the final models have different tensors")
        worst = max(
            ((expected[k].double() - got[k].double()).abs().max().item() for k in expected),
            default=float("inf"),
        )
        self.check(worst <= TOLERANCE, f"final weights differ: max abs diff {worst:.3g}")
        return worst, job_seconds

    def close(self) -> None:
        for run in [*self.runs, *([self.reference] if self.reference else [])]:
            run.pod.close()
            run.tap.stop()
            run.ended_at = run.ended_at or time.monotonic()
        if self.server is not None:
            self.server.stop()
        if self.api is not None:
            self.api.stop()

    def write_outputs(self) -> None:
        every = [*self.runs, *([self.reference] if self.reference else [])]
        for run in every:
            run.write_logs(self.out, self.t0)
        if self.runs:
            timeline.draw(self.runs, self.reference, self.t0, TOTAL, self.out / "timeline.png")

    def dump_outputs(self) -> None:
        for run in [*self.runs, *([self.reference] if self.reference else [])]:
            print(run.pod.output(), file=sys.stderr)


def summary(demo: Demo, worst: float, wall: float, job_seconds: float, shown: Path) -> str:
    equal = worst == 0
    job = report.duration(job_seconds)
    weights = "bitwise equal" if equal else f"max abs diff {worst:.3g} (tolerance {TOLERANCE})"
    lines = [
        "",
        "Preemptions",
        report.preemptions(demo.runs),
        "  SIGTERM->commit: status/jit.json; SIGTERM->in S3: until the sidecar logged the upload.",
        "  steps lost: the last step the pod completed minus the step the next pod resumed at.",
        "",
        notice(demo),
        "",
        "Pods",
        report.pods(demo.runs),
        "",
        f"Final weights vs the uninterrupted run: {weights}",
        f"Wall time: {report.duration(wall)} in all; the job took {job} over 3 pods",
    ]
    if demo.reference is not None:
        straight = demo.reference.ended_at - demo.reference.created_at
        lines[-1] += f", the uninterrupted run {report.duration(straight)}"
    lines += [
        "Metrics: each sidecar served Prometheus text at the /metrics URL printed above while its",
        f"  pod ran; its last scrape is saved as {shown}/metrics-<pod>.txt",
        f"Logs: {shown}/<pod>-trainer.log, <pod>-sidecar.log   Timeline: {shown}/timeline.png",
        (
            "PASS: 2 preemptions (one after the cluster's notice), 0 steps lost, final weights "
            f"{'bitwise equal' if equal else 'match'}"
        ),
    ]
    return "\n".join(lines)


def notice(demo: Demo) -> str:
    """pod-2's early save: what of its checkpoint was durable when SIGTERM came."""
    n, run = demo.notice, demo.runs[1]
    jit = run.jit.get("step")
    return (
        f"Early notice (pod-2): Karpenter's taint on {NODE} after step {n['after']:.0f}; the "
        f"sidecar asked for a save now:\n  checkpoint-{n['saved']:.0f} was in S3 "
        f"{n['durable']:.2f} s after the notice, {n['sigterm'] - n['durable']:.1f} s before "
        f"SIGTERM; the JIT save at SIGTERM (checkpoint-{jit}) added the {jit - n['saved']:.0f} "
        "steps trained since."
    )


def clean(out: Path) -> None:
    """Remove what an earlier demo wrote there, and nothing else."""
    shutil.rmtree(out / "pods", ignore_errors=True)
    shutil.rmtree(out / "kube", ignore_errors=True)
    for pattern in OUTPUTS:
        for path in out.glob(pattern):
            path.unlink()
    out.mkdir(parents=True, exist_ok=True)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, help="seed for the SIGTERM steps (default: the time)")
    parser.add_argument("--out", type=Path, default=REPO / "demo-out", help="output directory")
    parser.add_argument(
        "--keep-checkpoints",
        action="store_true",
        help="keep the pods' checkpoints under OUT/pods (deleted after a passing run)",
    )
    opts = parser.parse_args(argv)
    # Stopped like a pod (SIGTERM): unwind through the finally blocks that kill the pods.
    signal.signal(signal.SIGTERM, lambda signo, _frame: sys.exit(128 + signo))
    seed = opts.seed if opts.seed is not None else int(time.time())
    out = opts.out.resolve()
    clean(out)
    shown = out.relative_to(Path.cwd()) if out.is_relative_to(Path.cwd()) else out

    print("jitckpt demo: one training job, preempted twice, resumed from S3 in fresh pods")
    print(f"  seed {seed} (repeat this run: make demo DEMO_ARGS='--seed {seed}')")
    print(
        f"  job: tiny Llama (~1.1M params), {TOTAL} steps, HF Trainer under torchrun, 2 ranks on "
        f"CPU; periodic saves every {SAVE_STEPS} steps"
    )
    demo = Demo(out, seed)
    print(
        f"  SIGTERM after step {demo.targets[0]} (pod-1); the cluster's notice after step "
        f"{demo.targets[1]} (pod-2), its SIGTERM {NOTICE_LEAD:.0f} s after the save asked for is "
        f"in S3; outputs in {shown}/"
    )
    worst, job_seconds, error = float("inf"), 0.0, ""
    try:
        worst, job_seconds = demo.run()
    except Exception as exc:  # noqa: BLE001 - the demo's edge: any failure ends in the pods' output
        # The harness raises AssertionError (with the output) on timeouts and unexpected exits.
        error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        demo.say(f"FAILED: {error}")
    finally:
        demo.close()
    wall = time.monotonic() - demo.started
    demo.write_outputs()

    if error or demo.failures:
        demo.dump_outputs()
        print(f"\nFAILED after {report.duration(wall)} (seed {seed}):", file=sys.stderr)
        for failure in [error, *demo.failures]:
            if failure:
                print(f"  - {failure}", file=sys.stderr)
        print(f"  logs: {shown}/", file=sys.stderr)
        return 1

    text = summary(demo, worst, wall, job_seconds, shown)
    print(text)
    (out / "report.txt").write_text(f"seed {seed}\n{text}\n")
    if not opts.keep_checkpoints:
        for run in [*demo.runs, *([demo.reference] if demo.reference else [])]:
            for sub in ("checkpoints", "staging"):
                shutil.rmtree(run.pod.jdir / sub, ignore_errors=True)
    return 0


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
    sys.exit(130)
