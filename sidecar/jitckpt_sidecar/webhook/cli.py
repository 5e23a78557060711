"""`jitckpt-sidecar webhook --tls-cert-file F --tls-private-key-file F [OPTIONS]`.

Exit 0 after SIGTERM or SIGINT (it answers for --drain-seconds more, then finishes the requests
in flight); 2 for a usage or configuration error (a certificate that does not load, a taken port).
"""

from __future__ import annotations

import dataclasses
import signal
import sys
import threading
from typing import Optional

from jitckpt_entrypoint import log, settings
from jitckpt_entrypoint import shared_settings as shared
from jitckpt_entrypoint.settings import INTEGER, NUMBER, OPTIONAL_TEXT, TEXT, Option, between
from jitckpt_sidecar import signals
from jitckpt_sidecar.errors import SidecarError
from jitckpt_sidecar.inject.options import OPTIONS as INJECT_OPTIONS
from jitckpt_sidecar.inject.options import Options
from jitckpt_sidecar.webhook import admission
from jitckpt_sidecar.webhook.server import WebhookServer

PROG = "jitckpt-sidecar webhook"
PER_JOB = ("storage_uri", "containers", "trainjob_runtime", "peers", "peer_secret")
DEFAULTS = tuple(o for o in INJECT_OPTIONS if o.field not in PER_JOB)
"""inject's flags, as the defaults of every pod (the pod's annotations win, but for the image);
a TrainJob's pods come to the webhook as pods, so its runtime flag has no use here, and the
peer replica's URLs and Secret are a job's own (annotations only)."""


@dataclasses.dataclass(frozen=True)
class WebhookConfig:
    tls_cert_file: str
    tls_private_key_file: str
    port: int = 8443
    address: str = "0.0.0.0"  # noqa: S104 - a webhook serves the API server from its pod IP
    storage_uri_prefix: Optional[str] = None
    """s3://bucket/prefix: pods without jitckpt.io/storage-uri use <prefix>/<namespace>/<job>."""
    drain_seconds: float = 5.0
    """After SIGTERM, how long it goes on answering while the Service drops it."""

    def __post_init__(self) -> None:
        settings.validate(self, OPTIONS)


OPTIONS = (
    Option("tls_cert_file", TEXT, "serving certificate (PEM; reloaded when it changes)",
           flag_only=True, required=True, metavar="FILE"),
    Option("tls_private_key_file", TEXT, "its private key (PEM)", flag_only=True, required=True,
           metavar="FILE"),
    Option("port", INTEGER, "HTTPS port", check=between(1, 65535, "a port number 1-65535"),
           flag_only=True, metavar="PORT"),
    Option("address", TEXT, "address to listen on", flag_only=True, metavar="ADDRESS"),
    Option("drain_seconds", NUMBER, "seconds it keeps answering after SIGTERM",
           check=between(0, 60, "0-60 seconds"), flag_only=True, metavar="SECONDS"),
    Option("storage_uri_prefix", OPTIONAL_TEXT,
           "pods without the jitckpt.io/storage-uri annotation use PREFIX/<namespace>/<job name>",
           check=shared.s3_uri_problem, show=shared.STORAGE_URI.show, flag_only=True,
           metavar="s3://BUCKET/PREFIX"),
)  # fmt: skip


def _parser() -> settings.ArgumentParser:
    parser = settings.ArgumentParser(
        prog=PROG,
        description=(
            "A mutating admission webhook: pods labelled jitckpt.io/inject=true get the rewrite "
            "of `jitckpt-sidecar inject`. inject's options below are the defaults; a pod's "
            "jitckpt.io/<option> annotations win (not for --image)."
        ),
        hint=f"see {PROG} --help",
    )
    settings.add_flags(parser, OPTIONS, WebhookConfig)
    settings.add_flags(parser, DEFAULTS, Options)
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logs")
    return parser


def parse(argv: list[str]) -> tuple[WebhookConfig, admission.Policy, bool]:
    parsed = vars(_parser().parse_args(argv))
    cfg = settings.resolve(WebhookConfig, OPTIONS, {}, settings.flag_values(parsed, OPTIONS))
    given = settings.flag_values(parsed, DEFAULTS)
    defaults = {
        o.field: o.convert(given[o.field], f"{o.flag} ") for o in DEFAULTS if o.field in given
    }
    # Checked now, with a placeholder URI, so a bad flag stops the start and not every pod.
    settings.resolve(Options, INJECT_OPTIONS, {}, {**defaults, "storage_uri": "s3://check/x"})
    return cfg, admission.Policy(defaults, cfg.storage_uri_prefix), bool(parsed["verbose"])


def main(argv: list[str]) -> int:
    try:
        cfg, policy, verbose = parse(argv)
    except settings.SettingError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    logger = log.setup(PROG, verbose=verbose)
    relay = signals.Relay((signal.SIGTERM, signal.SIGINT), logger)
    try:
        server = WebhookServer(
            (cfg.address, cfg.port), (cfg.tls_cert_file, cfg.tls_private_key_file), policy, logger
        )
    except SidecarError as exc:
        logger.error("%s", exc)
        return exc.exit_code

    drains: list[threading.Thread] = []

    def stop(signum: signal.Signals) -> None:
        if drains:
            return
        logger.info(
            "%s: stopping in %g s (answering until then), after the requests in flight",
            signum.name,
            cfg.drain_seconds,
        )
        drains.append(threading.Thread(target=server.drain, args=(cfg.drain_seconds,)))
        drains[0].start()

    relay.to(stop)
    where = cfg.storage_uri_prefix or "only the jitckpt.io/storage-uri annotation"
    logger.info(
        "serving POST /mutate, /healthz and /metrics on https://%s:%d (storage: %s)",
        cfg.address,
        server.port,
        where,
    )
    with server:
        server.serve_forever(poll_interval=0.5)
        for drain in drains:  # its wait for the requests in flight (their handlers are daemons)
            drain.join()
    return 0
