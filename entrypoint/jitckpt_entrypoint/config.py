"""The trainer side's settings: one frozen, validated object built from flags and JITCKPT_* env.

The entrypoint resolves it once (bad values are a one-line error and exit 2 before anything
starts) and passes every resolved value to the child as JITCKPT_* variables; the hook inside
the training processes reads the same variables back with `from_env`.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
from collections.abc import Mapping
from typing import Optional

from jitckpt_entrypoint.errors import JitckptError

SAVE_STRATEGIES = ("no", "steps", "epoch")
LOG_FORMATS = ("text", "json")
ASYNC_BUSY = ("wait", "skip")
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")
# S3 bucket naming rules (3-63 chars, lowercase, digits, dots, hyphens; starts/ends alnum).
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9]$")
_USERINFO = re.compile(r"//[^/@]*@")


def redact_userinfo(url: str) -> str:
    """`url` with the user:password@ of its authority (a secret, maybe) replaced by ***@."""
    return _USERINFO.sub("//***@", url)


@dataclasses.dataclass(frozen=True)
class Option:
    field: str
    env: str
    flag: str
    help: str


def add_arguments(
    parser: argparse.ArgumentParser, options: tuple[Option, ...], bool_fields: tuple[str, ...]
) -> None:
    """One flag per option (--x/--no-x for booleans), each help naming its variable."""
    for option in options:
        text = f"{option.help} [{option.env}]"
        if option.field in bool_fields:
            parser.add_argument(
                option.flag,
                dest=option.field,
                action=argparse.BooleanOptionalAction,
                default=None,
                help=text,
            )
        else:
            parser.add_argument(option.flag, dest=option.field, metavar="VALUE", help=text)


OPTIONS = (
    Option("dir", "JITCKPT_DIR", "--dir", "shared volume root (the emptyDir)"),
    Option(
        "storage_uri",
        "JITCKPT_STORAGE_URI",
        "--storage-uri",
        "s3://bucket/prefix; empty = no upload",
    ),
    Option(
        "save_strategy",
        "JITCKPT_SAVE_STRATEGY",
        "--save-strategy",
        "no|steps|epoch; overrides the script",
    ),
    Option(
        "save_steps",
        "JITCKPT_SAVE_STEPS",
        "--save-steps",
        "periodic save interval in optimizer steps",
    ),
    Option(
        "save_total_limit",
        "JITCKPT_SAVE_TOTAL_LIMIT",
        "--save-total-limit",
        "local checkpoints to keep",
    ),
    Option("jit", "JITCKPT_JIT", "--jit", "1 = save a checkpoint on SIGTERM, 0 = don't"),
    Option(
        "resume", "JITCKPT_RESUME", "--resume", "1 = resume from the newest committed checkpoint"
    ),
    Option(
        "async_save",
        "JITCKPT_ASYNC_SAVE",
        "--async-save",
        "1 = periodic Trainer saves written in the background, 0 = the Trainer's own",
    ),
    Option(
        "async_busy",
        "JITCKPT_ASYNC_BUSY",
        "--async-busy",
        "wait|skip: a periodic save due while the last one is being written",
    ),
    Option(
        "grace_seconds",
        "JITCKPT_GRACE_SECONDS",
        "--grace-seconds",
        "the pod's terminationGracePeriodSeconds",
    ),
    Option(
        "exit_code",
        "JITCKPT_EXIT_CODE",
        "--exit-code",
        "exit code after a committed JIT checkpoint",
    ),
    Option(
        "termination_log",
        "JITCKPT_TERMINATION_LOG",
        "--termination-log",
        "summary file; empty = none",
    ),
    Option("log_format", "JITCKPT_LOG_FORMAT", "--log-format", "text|json"),
)
OPTION_BY_FIELD = {o.field: o for o in OPTIONS}


@dataclasses.dataclass(frozen=True)
class S3Uri:
    bucket: str
    prefix: str  # no leading or trailing slash; "" for the bucket root

    def key(self, *parts: str) -> str:
        return "/".join(p for p in (self.prefix, *parts) if p)

    def __str__(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}" if self.prefix else f"s3://{self.bucket}"


def parse_s3_uri(value: str, name: str = "JITCKPT_STORAGE_URI") -> S3Uri:
    """Parse `s3://bucket[/prefix]`, or raise a one-line error that names `name`."""
    if _USERINFO.search(value):  # s3a://KEY:SECRET@bucket (old Hadoop style): never echo it
        raise JitckptError(
            f"{name}={redact_userinfo(value)!r} carries credentials; use "
            "s3://bucket/prefix and put them in AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY"
        )
    if not value.startswith("s3://"):
        raise JitckptError(f"{name}={value!r} is not an S3 URI; use s3://bucket/prefix")
    bucket, _, prefix = value[len("s3://") :].partition("/")
    if not _BUCKET.match(bucket) or ".." in bucket:
        raise JitckptError(
            f"{name}={value!r}: {bucket!r} is not a valid bucket name "
            "(3-63 lowercase letters, digits, dots or hyphens); use s3://bucket/prefix"
        )
    prefix = prefix.strip("/")
    if "//" in prefix:
        raise JitckptError(
            f"{name}={value!r} has an empty path segment ('//'); use s3://bucket/prefix"
        )
    return S3Uri(bucket, prefix)


def shutdown_timeout_for(grace_seconds: int) -> int:
    """torchrun's worker shutdown timeout: three quarters of the grace period.

    Kubernetes SIGKILLs the pod at the end of the grace period. torchrun SIGKILLs its workers
    after its own shutdown timeout; ending that a quarter early leaves the sidecar time to
    upload the JIT checkpoint, and lets torchrun and us exit with a real status.
    """
    return max(1, grace_seconds * 3 // 4)


@dataclasses.dataclass(frozen=True)
class Config:
    """The trainer side's settings; every field has a flag and a JITCKPT_* twin (see OPTIONS)."""

    dir: str = "/mnt/jitckpt"
    """Root of the volume shared with the sidecar: checkpoints/, staging/, status/ live here."""
    storage_uri: str = ""
    """s3://bucket/prefix the sidecar uploads to; empty means local/PVC mode (nothing is staged)."""
    save_strategy: Optional[str] = None
    """Periodic save strategy forced on every Trainer; None keeps the script's own."""
    save_steps: Optional[int] = None
    """Periodic save interval (optimizer steps); implies save_strategy=steps when that is unset."""
    save_total_limit: Optional[int] = None
    """Local checkpoints the Trainer keeps; None keeps the script's own."""
    jit: bool = True
    """Save, commit and exit at the next optimizer step boundary after SIGTERM."""
    resume: bool = True
    """Make Trainer.train() resume from the newest committed checkpoint."""
    async_save: bool = True
    """Write periodic Trainer saves from a host-memory snapshot on a background thread."""
    async_busy: str = "wait"
    """A periodic save due while the previous one is still being written: wait for it, or skip."""
    grace_seconds: int = 30
    """The pod's terminationGracePeriodSeconds: the whole budget from SIGTERM to SIGKILL."""
    exit_code: int = 143
    """Exit code after a JIT checkpoint was committed (torchrun itself exits 1 after a signal)."""
    termination_log: str = "/dev/termination-log"
    """Where the one-line summary goes (Kubernetes shows it); empty disables it."""
    log_format: str = "text"
    """text or json log lines on stderr."""

    def __post_init__(self) -> None:
        if not os.path.isabs(self.dir):  # a relative one lands in the container's own layer
            _bad("dir", self.dir, "an absolute path to the shared volume, e.g. /mnt/jitckpt")
        if self.storage_uri:
            parse_s3_uri(self.storage_uri)
        if self.save_strategy is not None and self.save_strategy not in SAVE_STRATEGIES:
            _bad("save_strategy", self.save_strategy, "one of " + ", ".join(SAVE_STRATEGIES))
        if self.save_steps is not None and self.save_steps < 1:
            _bad("save_steps", self.save_steps, "a whole number of optimizer steps >= 1")
        if self.save_total_limit is not None and self.save_total_limit < 1:
            _bad("save_total_limit", self.save_total_limit, "a whole number >= 1")
        if self.grace_seconds < 1:
            _bad(
                "grace_seconds",
                self.grace_seconds,
                "the pod's terminationGracePeriodSeconds (>= 1)",
            )
        if not 1 <= self.exit_code <= 255:
            _bad("exit_code", self.exit_code, "an exit code from 1 to 255")
        if self.async_busy not in ASYNC_BUSY:
            _bad("async_busy", self.async_busy, "wait or skip")
        if self.log_format not in LOG_FORMATS:
            _bad("log_format", self.log_format, "text or json")

    @property
    def effective_save_strategy(self) -> Optional[str]:
        if self.save_strategy is None and self.save_steps is not None:
            return "steps"
        return self.save_strategy

    @property
    def shutdown_timeout(self) -> int:
        return shutdown_timeout_for(self.grace_seconds)

    def to_env(self) -> dict[str, str]:
        """Every resolved setting as JITCKPT_* strings, for the child's environment."""
        env = {}
        for option in OPTIONS:
            value = getattr(self, option.field)
            if value is None:
                continue
            env[option.env] = ("1" if value else "0") if isinstance(value, bool) else str(value)
        return env

    @classmethod
    def from_env(cls, env: Mapping[str, str], flags: Optional[Mapping[str, str]] = None) -> Config:
        """Build from flag values (by field name, as given) over JITCKPT_* env over defaults."""
        flags = flags or {}
        kwargs: dict[str, object] = {}
        for field in dataclasses.fields(cls):
            option = OPTION_BY_FIELD[field.name]
            if field.name in flags:
                raw, source = flags[field.name], option.flag
            elif option.env in env:
                raw, source = env[option.env], option.env
            else:
                continue
            kwargs[field.name] = _convert(field.name, raw.strip(), source)
        try:
            return cls(**kwargs)  # type: ignore[arg-type]
        except InvalidOptionError as exc:
            if exc.field in flags:  # name the flag the user actually typed
                raise JitckptError(exc.describe(OPTION_BY_FIELD[exc.field].flag + " ")) from None
            raise


def _convert(name: str, raw: str, source: str) -> object:
    kind = {f.name: f.type for f in dataclasses.fields(Config)}[name]
    sep = " " if source.startswith("--") else "="
    if kind == "bool":
        if raw.lower() in _TRUE:
            return True
        if raw.lower() in _FALSE:
            return False
        raise JitckptError(f"{source}{sep}{raw!r} is not a boolean; use 1 or 0")
    if kind in ("int", "Optional[int]"):
        if raw == "" and kind == "Optional[int]":
            return None
        try:
            return int(raw)
        except ValueError:
            hint = OPTION_BY_FIELD[name].help
            raise JitckptError(f"{source}{sep}{raw!r} is not an integer; set {hint}") from None
    if kind == "Optional[str]" and raw == "":
        return None
    return raw


class InvalidOptionError(JitckptError):
    """A setting outside its accepted values; the message names the variable and the values."""

    def __init__(self, field: str, value: object, accepted: str) -> None:
        self.field, self.value, self.accepted = field, value, accepted
        super().__init__(self.describe(OPTION_BY_FIELD[field].env + "="))

    def describe(self, source: str) -> str:
        return f"{source}{self.value!r} is invalid; use {self.accepted}"


def _bad(field: str, value: object, accepted: str) -> None:
    raise InvalidOptionError(field, value, accepted)
