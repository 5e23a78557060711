"""`jitckpt-sidecar [COMMAND] [OPTIONS]`: the S3 sidecar beside the trainer.

Commands are dispatched through COMMANDS ("module:function", each `main(argv) -> int`), so a
new one is one line there. Exit codes: 0 success; 1 runtime failure (the drain ended with
checkpoints not committed in S3, a restore failed); 2 a usage or configuration error;
3 S3 is unreachable, the bucket is missing or the credentials are refused.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import logging
import os
import signal
import sys
import threading
import traceback
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Callable, Optional

from jitckpt_entrypoint import log, settings, shared_settings
from jitckpt_entrypoint.errors import JitckptError
from jitckpt_entrypoint.protocol import status, trainer_lock
from jitckpt_entrypoint.protocol.layout import Layout
from jitckpt_sidecar import __version__, s3, signals
from jitckpt_sidecar.config import OPTIONS, Config
from jitckpt_sidecar.errors import ConfigError, SidecarError

if TYPE_CHECKING:
    from jitckpt_sidecar.service import Service

PROG = "jitckpt-sidecar"
COMMANDS: dict[str, tuple[str, str]] = {
    "run": (
        "jitckpt_sidecar.cli:run_main",
        "restore, then watch, upload, prune and serve metrics until SIGTERM (the default)",
    ),
    "restore": (
        "jitckpt_sidecar.cli:restore_main",
        "restore the newest checkpoint committed in S3, then exit (an init container)",
    ),
    "check": (
        "jitckpt_sidecar.cli:check_main",
        "verify the configuration and S3 access (list, write, read, delete), then exit",
    ),
    "install": (
        "jitckpt_sidecar.install:main",
        "copy the stdlib-only entrypoint bundle into DIR (the swap-in init container)",
    ),
    "inject": (
        "jitckpt_sidecar.inject.cli:main",
        "rewrite Pod/Job/JobSet/TrainJob/PyTorchJob YAML into the swap-in form (stdin or -f FILE)",
    ),
    "webhook": (
        "jitckpt_sidecar.webhook.cli:main",
        "a mutating admission webhook: inject pods labelled jitckpt.io/inject=true (HTTPS)",
    ),
}
USAGE = f"{PROG} [{'|'.join(COMMANDS)}] [OPTIONS]"


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] in (["-h"], ["--help"]):
        print(_overview())
        return 0
    if args[:1] == ["--version"]:
        print(f"{PROG} {__version__}")
        return 0
    name = "run"
    if args and not args[0].startswith("-"):
        name, args = args[0], args[1:]
    if name not in COMMANDS:
        _error(f"unknown command {name!r}; use one of {', '.join(COMMANDS)} (usage: {USAGE})")
        return 2
    module, _, function = COMMANDS[name][0].partition(":")
    target: Callable[[list[str]], int] = getattr(importlib.import_module(module), function)
    return target(args)


def _overview() -> str:
    lines = [f"usage: {USAGE}", "", "commands:"]
    lines += [f"  {name:10} {help_}" for name, (_, help_) in COMMANDS.items()]
    lines += ["", f"`{PROG} COMMAND --help` lists the options (each also a JITCKPT_* variable)."]
    return "\n".join(lines)


def _error(message: str) -> None:
    print(f"{PROG}: error: {message}", file=sys.stderr)


def parse(command: str, argv: Sequence[str]) -> tuple[Config, bool]:
    """Options of `command` (flags over JITCKPT_* env) into a validated Config, and -v."""
    usage = f"{PROG} {command} [OPTIONS]"
    parser = settings.ArgumentParser(
        prog=f"{PROG} {command}",
        usage=usage,
        description=COMMANDS[command][1] + ". Every option also reads its environment "
        "variable; a flag wins.",
        hint=f"usage: {usage}",
    )
    settings.add_flags(parser, OPTIONS)
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logs and tracebacks")
    parsed = vars(parser.parse_args(list(argv)))
    flags = settings.flag_values(parsed, OPTIONS)
    return Config.from_env(os.environ, flags), bool(parsed["verbose"])


def _command(
    command: str, argv: Sequence[str], body: Callable[[Config, logging.Logger], int]
) -> int:
    """Parse, set up logging, run `body`; every failure ends as one line on stderr."""
    verbose = "-v" in argv or "--verbose" in argv
    try:
        cfg, verbose = parse(command, argv)
    except settings.SettingError as exc:
        _error(str(exc))
        return exc.exit_code
    logger = log.setup(PROG, cfg.log_format, verbose=verbose)

    def failed(line: str) -> None:
        log.write_termination_log(cfg.termination_log, f"{PROG} {command}: {line}")

    try:
        return body(cfg, logger)
    except SidecarError as exc:
        logger.error("%s", exc, exc_info=verbose)
        failed(str(exc))
        return exc.exit_code
    except KeyboardInterrupt:
        return 130
    except Exception as exc:
        if s3.is_storage_error(exc):
            operation = getattr(exc, "operation_name", None) or command
            line = s3.describe(exc, cfg, operation, str(cfg.uri))
            logger.error("%s", line, exc_info=verbose)
            failed(line)
            return 1
        line = f"internal error: {type(exc).__name__}: {' '.join(str(exc).split())}"
        logger.error("%s (run with -v for the traceback)", line)
        failed(line)
        if verbose:
            traceback.print_exc()
        return 1


def prepare_dir(cfg: Config) -> Layout:
    """Create checkpoints/, staging/ and status/ and prove we can write there (exit 2 if not)."""
    try:
        return shared_settings.prepare_dir(cfg.dir)
    except JitckptError as exc:
        raise ConfigError(str(exc)) from None


@dataclasses.dataclass(frozen=True)
class _Store:
    client: Any
    """The transfer client every part of this process uses (upload, restore, retention)."""
    asks: Any
    """A client that gives up sooner, for the pruner's questions (s3.ASK_READ_TIMEOUT)."""
    checksums_refused: Optional[str]
    """The error code with which the store refused flexible checksums, when it did."""
    notes: list[str]
    """Warnings about the bucket (versioning, Object Lock: retention frees no bytes)."""


def _connect(
    cfg: Config, logger: logging.Logger, *, announce: bool = True, notes: bool = True
) -> _Store:
    """Probe S3 access (fast-failing client), then return the transfer client, made with the
    checksum setting the probe found the store accepts (logged unless not `announce`), and
    with `notes` the bucket's retention notes (not for the one-shot restore: they are about
    what retention frees, and the long-running sidecar logs them)."""
    session = s3.new_session()
    if not cfg.s3_verify_tls:
        logger.warning(
            "TLS verification of %s is OFF (JITCKPT_S3_VERIFY_TLS=0)", s3.endpoint_of(cfg)
        )
    attempts = min(s3.PROBE_ATTEMPTS, cfg.s3_max_attempts)
    try:
        probe_client = s3.make_client(cfg, session, attempts=attempts)
    except Exception as exc:
        if type(exc).__name__ != "InvalidRegionError":
            raise
        region = session.get_config_variable("region")
        raise ConfigError(
            f"the S3 region {region!r} is not a region name; set AWS_DEFAULT_REGION "
            "to the bucket's region, e.g. us-east-1"
        ) from None
    # An explicit AWS_REQUEST_CHECKSUM_CALCULATION is the user's choice: no silent switch.
    fallback = None
    if not os.environ.get("AWS_REQUEST_CHECKSUM_CALCULATION"):
        fallback = functools.partial(
            s3.make_client, cfg, session, attempts=attempts, checksums=s3.WHEN_REQUIRED
        )
    refused = s3.probe(probe_client, cfg, fallback=fallback)
    if refused and announce:
        logger.info("%s", s3.checksum_note(cfg, refused))
    # An upload and a fetch for the trainer can run at once, each with its full concurrency.
    pool = cfg.upload_concurrency + cfg.download_concurrency + 4
    checksums = s3.WHEN_REQUIRED if refused else None
    client = s3.make_client(cfg, session, pool=pool, checksums=checksums)
    asks = s3.make_client(
        cfg,
        session,
        attempts=min(s3.ASK_ATTEMPTS, cfg.s3_max_attempts),
        checksums=checksums,
        read_timeout=s3.ASK_READ_TIMEOUT,
    )
    found = s3.retention_notes(client, cfg) if notes else []
    if announce:
        for note in found:
            logger.warning("%s", note)
    return _Store(client, asks, refused, found)


def run_main(argv: list[str]) -> int:
    return _command("run", argv, _run)


def _run(cfg: Config, logger: logging.Logger) -> int:
    from prometheus_client import CollectorRegistry

    from jitckpt_sidecar import memory
    from jitckpt_sidecar.server import MetricsServer
    from jitckpt_sidecar.service import Service

    memory.configure()  # before any thread exists
    relay = signals.Relay((signal.SIGTERM, signal.SIGINT), logger)  # before the S3 probe
    layout = prepare_dir(cfg)
    registry = CollectorRegistry()
    server = MetricsServer(
        host=cfg.metrics_host, port=cfg.metrics_port, registry=registry, logger=logger
    )
    store = _connect(cfg, logger)
    service = Service(
        cfg,
        layout,
        client=store.client,
        asks=store.asks,
        registry=registry,
        server=server,
        logger=logger,
    )
    done = threading.Event()
    watching: list[threading.Thread] = []

    def on_signal(_signum: signal.Signals) -> None:
        if not watching:  # first: sigterm() takes locks a stuck main thread may hold
            watching.append(threading.Thread(target=_exit_if_stuck, args=(service, logger, done)))
            watching[0].daemon = True
            watching[0].start()
        service.sigterm()

    relay.to(on_signal)
    logger.info("started (pid %d): %s at %s", os.getpid(), cfg.uri, s3.endpoint_of(cfg))
    _say_restart_policy(cfg, logger)
    code = service.run()
    done.set()
    if code != 0 and service.failure:
        log.write_termination_log(cfg.termination_log, f"{PROG}: {service.failure}")
    # Leave now: a request stuck at the drain deadline must not hold the exit (s3transfer's
    # worker threads are joined at interpreter exit), and everything that matters is done.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _exit_if_stuck(service: Service, logger: logging.Logger, done: threading.Event) -> None:
    """After SIGTERM the drain ends JITCKPT_GRACE_SECONDS minus a margin after the grace period
    began (drain.py). A main loop stuck in a call past that (a hung volume: it asks S3 nothing)
    would be SIGKILLed without a line: a second before the margin ends (at least halfway into
    it), say where it is and exit 1."""
    cfg = service.cfg
    margin = cfg.grace_seconds - cfg.drain_seconds
    slack = max(margin / 2, margin - 1.0)
    while True:
        deadline = service.drain_deadline()  # earlier once the trainer's SIGTERM is read
        left = 0.5 if deadline is None else deadline + slack - service.monotonic()
        if done.wait(max(0.0, min(left, 0.5))):
            return
        if left <= 0:
            break
    if service.loop_ended.is_set():
        return  # its clean-up: bounded joins, then the exit
    line = (
        f"drain deadline passed (JITCKPT_GRACE_SECONDS={cfg.grace_seconds} minus "
        f"{margin:.1f} s) with the main loop stuck in {_where(threading.main_thread())}; "
        "exiting 1"
    )
    log.write_termination_log(cfg.termination_log, f"{PROG}: {line}")
    try:
        logger.error("%s", line)
    finally:
        os._exit(1)


def _where(thread: threading.Thread) -> str:
    """The thread's calls of ours (the innermost 6, as `file:line function`), then the call it
    is in: `service.py:N _loop > status_feed.py:N trainer > ... > atomic.py:N read_json`."""
    frame = sys._current_frames().get(thread.ident or -1)
    if frame is None:
        return "an unknown call"
    stack = traceback.extract_stack(frame)
    ours = (f"{os.sep}jitckpt_sidecar{os.sep}", f"{os.sep}jitckpt_entrypoint{os.sep}")
    named = [f for f in stack if any(part in f.filename for part in ours)][-6:]
    if not named or named[-1] is not stack[-1]:
        named.append(stack[-1])
    return " > ".join(f"{os.path.basename(f.filename)}:{f.lineno} {f.name}" for f in named)


def _say_restart_policy(cfg: Config, logger: logging.Logger) -> None:
    """What JITCKPT_RESTART_POLICY does here, when it is not what it is for."""
    if cfg.exit_with_trainer and not cfg.restart_policy:
        logger.warning(
            "JITCKPT_RESTART_POLICY is unset: any exit of the trainer ends this sidecar, and a "
            "trainer container killed whole (an OOM kill) is seen only after SIGTERM; set it to "
            "the pod's restartPolicy (inject does)"
        )
    elif cfg.restart_policy and not cfg.exit_with_trainer:
        logger.info(
            "JITCKPT_RESTART_POLICY=%s has no effect without JITCKPT_EXIT_WITH_TRAINER=1 (a "
            "native sidecar is stopped by the kubelet)",
            cfg.restart_policy,
        )


def restore_main(argv: list[str]) -> int:
    return _command("restore", argv, _restore)


def _restore(cfg: Config, logger: logging.Logger) -> int:
    # Not jitckpt_sidecar.service: its metrics and HTTP server imports cost the restore ~40 ms.
    from jitckpt_sidecar import peer
    from jitckpt_sidecar.readiness import Readiness, process_start
    from jitckpt_sidecar.remote import Remote
    from jitckpt_sidecar.restore import Restorer

    relay = signals.Relay((signal.SIGTERM, signal.SIGINT), logger)  # before the S3 probe
    layout = prepare_dir(cfg)
    _forget_earlier_trainer(layout, logger)
    client = _connect(cfg, logger, notes=False).client
    stop: list[str] = []
    replica = peer.configured(cfg, logger)

    def stopped(signum: signal.Signals) -> None:
        stop.append(signum.name)
        if replica is not None:
            replica.cancel()

    relay.to(stopped)
    readiness = Readiness(layout.status)
    readiness.reset()
    if replica is not None:  # own RAM, then the peer's copy, before the volume and S3
        replica.restore_own(before_trainer=True)
    restorer = Restorer(client, Remote(client, cfg.uri), cfg, layout, logger)
    result = restorer.run(cancel=lambda: stop[0] if stop else None)
    readiness.set(result.source, result.step, result.seconds, result.bytes)
    with contextlib.suppress(OSError):  # the recovery metric's start; nothing else needs it
        record = status.PodRestore(process_start(), result.source, result.bytes)
        status.POD_RESTORE.write(layout.status, record)
    # The trainer starts when this init container exits: skip the interpreter's teardown of
    # botocore's modules (measured 0.15 to 0.3 s); the ready file is already written durably.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _forget_earlier_trainer(layout: Layout, logger: logging.Logger) -> None:
    """An init container runs before every container of its pod, so a trainer.json here is an
    earlier pod's (JITCKPT_DIR on a PersistentVolume): its exit, or its death, must not read as
    this pod's trainer's to the sidecar that exits with it (JITCKPT_EXIT_WITH_TRAINER=1). Kept
    while something holds the trainer's lock (a restore run by hand beside a live trainer), and
    when the record neither exited nor says it holds the lock (an older entrypoint's)."""
    record = status.TRAINER.read(layout.status)
    if record is None or not (record.locked or record.exited_at is not None):
        return  # an entrypoint without the lock that may live: its restart rewrites it
    lock = trainer_lock.take_if_gone(layout.status)
    if lock is None and os.path.exists(trainer_lock.path(layout.status)):
        return
    try:
        status.TRAINER.remove(layout.status)
    finally:
        if lock is not None:
            os.close(lock)
    logger.info(
        "an earlier pod's trainer record (run %s) is not this pod's: removed", record.run_id
    )


def check_main(argv: list[str]) -> int:
    return _command("check", argv, _check)


def _check(cfg: Config, logger: logging.Logger) -> int:
    store = _connect(cfg, logger, announce=False)
    print(f"{PROG}: ok: {cfg.uri} at {s3.endpoint_of(cfg)}: list, write, read and delete work")
    if store.checksums_refused:
        print(f"{PROG}: note: {s3.checksum_note(cfg, store.checksums_refused)}")
    for note in store.notes:
        print(f"{PROG}: warning: {note}")
    return 0
