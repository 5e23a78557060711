"""`jitckpt-entrypoint [OPTIONS] -- COMMAND [ARG...]`: the trainer container's PID 1."""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import signal
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any, Optional

from jitckpt_entrypoint import (
    __version__,
    final,
    grace,
    log,
    ram_writer,
    settings,
    shared_settings,
    supervisor,
)
from jitckpt_entrypoint.config import OPTIONS, Config
from jitckpt_entrypoint.errors import JitckptError
from jitckpt_entrypoint.protocol import registry, status, trainer_lock
from jitckpt_entrypoint.protocol.layout import FINAL_NAME, Layout
from jitckpt_entrypoint.shared_settings import parse_s3_uri
from jitckpt_entrypoint.shutdown import Shutdown

PROG = "jitckpt-entrypoint"
USAGE = f"{PROG} [OPTIONS] -- COMMAND [ARG...]"
HOOK_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_site")


def _parser() -> settings.ArgumentParser:
    parser = settings.ArgumentParser(
        prog=PROG,
        usage=USAGE,
        description=(
            "Run COMMAND (usually torchrun) as PID 1: forward signals, reap zombies, and let the "
            "injected hook save a just-in-time checkpoint on SIGTERM. Every option also reads "
            "its JITCKPT_* environment variable; a flag wins over the variable."
        ),
        hint=f"usage: {USAGE}",
    )
    settings.add_flags(parser, OPTIONS)
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logs and tracebacks")
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    return parser


def parse_args(argv: Sequence[str]) -> tuple[dict[str, Any], bool, list[str]]:
    """Split `argv` into (flag values by field, verbose, command)."""
    if "--" not in argv:
        if any(a in ("-h", "--help", "--version") for a in argv):
            _parser().parse_args(argv)  # prints and exits 0
        raise JitckptError(f"missing '--' before the training command; usage: {USAGE}")
    split = list(argv).index("--")
    options, command = list(argv[:split]), list(argv[split + 1 :])
    if not command:
        raise JitckptError(f"missing the training command after '--'; usage: {USAGE}")
    parsed = vars(_parser().parse_args(options))
    return settings.flag_values(parsed, OPTIONS), bool(parsed["verbose"]), command


def resolve_command(name: str, env: Mapping[str, str]) -> str:
    """The executable for `name`, searched on the child's PATH, or a one-line error."""
    if "/" in name:
        if os.path.isfile(name) and os.access(name, os.X_OK):
            return name
        raise JitckptError(f"command not found or not executable: {name!r}; fix the path")
    found = shutil.which(name, path=env.get("PATH", os.defpath))
    if found is None:
        raise JitckptError(f"command not found on PATH: {name!r}; install it or give its full path")
    return found


def prepare_dir(cfg: Config) -> Layout:
    """Create checkpoints/, staging/ and status/ and prove we can write there."""
    return shared_settings.prepare_dir(cfg.dir)


def child_env(env: Mapping[str, str], cfg: Config, run_id: str) -> dict[str, str]:
    """The child's environment: hook first on PYTHONPATH, resolved settings, torchrun timeout."""
    out = writer_env(env, cfg, run_id)
    user_path = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != HOOK_DIR]
    out["PYTHONPATH"] = os.pathsep.join([HOOK_DIR, *user_path])
    # torchrun SIGKILLs its workers this long after forwarding SIGTERM (30 s by default).
    out.setdefault("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", str(cfg.shutdown_timeout))
    return out


def writer_env(env: Mapping[str, str], cfg: Config, run_id: str) -> dict[str, str]:
    """The RAM writer's environment: the resolved settings and the run id, this package
    importable (the swap-in launcher puts it on sys.path itself); not the hook."""
    out = dict(env)
    package_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out["PYTHONPATH"] = os.pathsep.join(
        [package_root, *(p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p)]
    )
    out.update(cfg.to_env())
    out[status.RUN_ID_ENV] = run_id
    return out


def torchrun_timeout(env: Mapping[str, str], cfg: Config) -> int:
    """The worker shutdown timeout torchrun will use: the user's, else the one we derive."""
    try:
        return int(env["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"])
    except (KeyError, ValueError):
        return cfg.shutdown_timeout


def outcome(
    cfg: Config,
    layout: Layout,
    run_id: str,
    child: Optional[supervisor.ChildExit],
    sigterm_at: Optional[float],
) -> tuple[int, str]:
    """Our exit code and the one-line summary for the termination log.

    `child` is None when the command was still running (it ignored SIGTERM) when we stopped.
    """
    jit = status.read_jit(layout.status, run_id)
    if jit is not None and jit.peer_lost_at is not None and child is not None and child.status == 0:
        jit = None  # the survivors saved, torchrun restarted the job, and training ended
    if jit is not None:
        started = sigterm_at if sigterm_at is not None else jit.sigterm_at
        when = "" if started is None else f" {jit.committed_at - started:.1f} s after SIGTERM"
        if jit.peer_lost_at is not None:  # a SIGTERM after the loss does not time it
            lost = jit.committed_at - jit.peer_lost_at
            when = f" by the survivors {lost:.1f} s after a peer was lost"
        return cfg.exit_code, f"JIT checkpoint {jit.checkpoint} committed{when}"
    if child is None:  # not reached: supervision ends before the child only after a commit
        return 128 + signal.SIGTERM, "SIGTERM received, no JIT checkpoint committed"
    summary = f"training command {child.describe()}"
    if child.signal is not None:
        summary += f" (exit {child.status})"
    refusal = status.REFUSAL.read(layout.status, run_id)
    if refusal is not None and child.status != 0:
        summary += f": {refusal.message}"
    if sigterm_at is not None:
        summary = f"SIGTERM received, no JIT checkpoint committed; {summary}"
    elif child.status == 0:
        summary += model_location(cfg, layout, run_id)
    return child.status, summary


def model_location(cfg: Config, layout: Layout, run_id: str) -> str:
    """'; model in DIR[, uploading to s3://.../final/]' after training ended normally (staging
    the final model on the way in S3 mode), or '' when no Trainer finished training."""
    record = status.OUTPUT.read(layout.status, run_id)
    if record is None:
        return ""
    where = f"; model in {record.output_dir}"
    if not cfg.storage_uri:
        return where
    logger = logging.getLogger(f"jitckpt.{PROG}")
    try:
        staged = final.stage(layout, record)
    except (JitckptError, OSError) as exc:
        logger.error("cannot stage the final model for upload: %s", exc)  # noqa: TRY400 - one line
        return f"{where} (not uploaded: {exc})"
    if staged is None:
        logger.warning("output_dir %s is empty after training: no final model", record.output_dir)
        return f"{where} (empty)"
    logger.info(
        "staged the final model from %s: %d files, %.1f MB (%.1f MB copied) in %.1f s",
        record.output_dir,
        staged.files,
        staged.bytes / 1e6,
        staged.copied / 1e6,
        staged.seconds,
    )
    uri = parse_s3_uri(cfg.storage_uri)
    return f"{where}, uploading to s3://{uri.bucket}/{uri.key(FINAL_NAME)}/"


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    verbose = False
    try:
        flags, verbose, command = parse_args(args)
        cfg = Config.from_env(os.environ, flags)
        executable = resolve_command(command[0], os.environ)
        layout = prepare_dir(cfg)
    except JitckptError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    logger = log.setup(PROG, cfg.log_format, verbose=verbose)
    return run(cfg, layout, executable, command, logger)


def hold_trainer_lock(
    cfg: Config, layout: Layout, logger: logging.Logger
) -> tuple[Optional[int], bool]:
    """status/trainer.lock, held until we exit: the sidecar tells a container killed whole by it
    (protocol/trainer_lock.py). While the sidecar holds it (writing a dead run's snapshot out),
    wait at most JITCKPT_GRACE_SECONDS, and not past a SIGTERM that comes meanwhile (a handler
    for the wait: PID 1 would drop it): (the descriptor or None, whether SIGTERM came)."""
    sigterms: list[int] = []
    previous: list[Any] = []

    def waiting() -> None:
        logger.info("waiting for the sidecar to write the last run's snapshot out")
        previous.append(signal.signal(signal.SIGTERM, lambda signo, _: sigterms.append(signo)))

    lock = trainer_lock.hold(layout.status, cfg.grace_seconds, waiting, lambda: bool(sigterms))
    if previous:  # None: a handler set outside Python
        signal.signal(signal.SIGTERM, signal.SIG_DFL if previous[0] is None else previous[0])
    if lock is None:
        logger.debug("cannot hold %s", trainer_lock.path(layout.status))
    if sigterms and lock is not None:
        os.close(lock)
    return (None if sigterms else lock), bool(sigterms)


def run(
    cfg: Config, layout: Layout, executable: str, command: list[str], logger: logging.Logger
) -> int:
    pid = os.getpid()
    if pid != 1:
        if supervisor.become_subreaper():
            logger.info("not PID 1 (pid %d): registered as child subreaper to reap orphans", pid)
        else:
            logger.warning("not PID 1 (pid %d) and could not become a child subreaper", pid)
    est = grace.estimate(layout)
    if est is not None:
        timeout = torchrun_timeout(os.environ, cfg)
        too_short = grace.warning(est, cfg.grace_seconds, timeout)
        if too_short:
            logger.warning("%s", too_short)
    run_id = status.new_run_id()
    for stale in registry.remove_stale(layout.status):
        logger.debug("removed %s (left by a killed entrypoint)", stale)
    registry.open_run(layout.status, run_id)
    lock, stopped = hold_trainer_lock(cfg, layout, logger)
    if stopped:
        registry.close_run(layout.status, run_id)
        summary = "SIGTERM before the training command started; not started"
        log.write_termination_log(cfg.termination_log, summary)
        logger.info("%s; exiting %d", summary, 128 + signal.SIGTERM)
        return 128 + signal.SIGTERM
    record = status.TrainerStatus(
        run_id, pid, tuple(command), started_at=time.time(), locked=lock is not None
    )
    status.TRAINER.write(layout.status, record)
    env = child_env(os.environ, cfg, run_id)
    writer = (
        ram_writer.start(writer_env(os.environ, cfg, run_id), logger) if cfg.memory_dir else None
    )

    def on_sigterm(at: float) -> None:
        nonlocal record
        record = dataclasses.replace(record, sigterm_at=at)
        status.TRAINER.write(layout.status, record)
        if writer is not None:  # a save still written out gives way to the JIT save
            writer.signal(signal.SIGTERM)

    watch = Shutdown(cfg, layout.status, run_id, logger, on_sigterm=on_sigterm)
    logger.debug("running %s (run %s)", command, run_id)
    code = -1
    try:
        child = supervisor.supervise(executable, command, env, watch)
        code, summary = outcome(cfg, layout, run_id, child, watch.sigterm_at)
    finally:
        if writer is not None:
            if watch.sigterm_at is None:  # ended on its own (or crashed): its last save out
                writer.finish(cfg, run_id, logger, crashed=code != 0)
            writer.stop()
        registry.close_run(layout.status, run_id)
    # After staging the final model: the sidecar drains until it sees exited_at.
    record = dataclasses.replace(record, exited_at=time.time(), exit_code=code, summary=summary)
    status.TRAINER.write(layout.status, record)
    if lock is not None:
        os.close(lock)
    log.write_termination_log(cfg.termination_log, summary)
    logger.info("%s; exiting %d", summary, code)
    return code
