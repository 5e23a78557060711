"""Settings from flags and JITCKPT_* variables: an option table per command, one parser.

Every option of jitckpt-entrypoint and jitckpt-sidecar is a flag and a JITCKPT_* variable; a
flag wins over the variable, the variable over the platform variables an option falls back to
(AWS_ENDPOINT_URL, ...), and those over the config dataclass's default. `jitckpt-sidecar
inject`'s options are flags only, with the same converters and checks. An `Option` says it all
once: field, flag, variable, typed converter (`Kind`), check, help and README text. `resolve`
builds the frozen config from them; a bad value is one `SettingError` line that names the flag
or variable it came from and what is accepted. `doc_rows` lists the options for the README.

Standard library only and python3.9 syntax: it runs in the entrypoint bundle, under the
training image's own python3.
"""

from __future__ import annotations

import argparse
import dataclasses
import decimal
import re
from collections.abc import Mapping, Sequence
from typing import Any, Callable, NoReturn, Optional, TypeVar

from jitckpt_entrypoint.errors import JitckptError

T = TypeVar("T")
Check = Callable[[Any], Optional[str]]
"""None when the value is accepted, else what the error says after the value, with its own
separator: " is invalid; use a number from 1 to 64"."""


class SettingError(JitckptError):
    """A flag, variable or argument that cannot be used: one line naming it and what is
    accepted; the command exits 2 before anything starts."""

    exit_code = 2

    def __init__(self, source: str, rest: str, field: str = "") -> None:
        self.source, self.rest, self.field = source, rest, field
        super().__init__(source + rest)

    def named(self, source: str) -> SettingError:
        """The same error, naming where the value really came from (a flag, a fallback)."""
        return SettingError(source, self.rest, self.field)


# --- converters ---------------------------------------------------------------------------

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def parse_boolean(text: str) -> bool:
    if text.lower() in _TRUE + _FALSE:
        return text.lower() in _TRUE
    raise ValueError(f"not a boolean: {text!r}")


_QUANTITY = re.compile(r"^(\+?(?:\d+\.?\d*|\.\d+))(Ki|Mi|Gi|Ti|Pi|Ei|[eE][+-]?\d+|[mkMGTPE])?$")
_BINARY = ("Ki", "Mi", "Gi", "Ti", "Pi", "Ei")
_SUFFIX = {
    "": decimal.Decimal(1),
    "m": decimal.Decimal("0.001"),
    **{s: decimal.Decimal(10) ** (3 * (i + 1)) for i, s in enumerate("kMGTPE")},
    **{s: decimal.Decimal(1024) ** (i + 1) for i, s in enumerate(_BINARY)},
}


def parse_quantity(value: str) -> int:
    """A Kubernetes quantity ("50Gi", "500M", "1.5G", "12e6") in whole bytes, rounded up."""
    match = _QUANTITY.match(value)
    if not match:
        raise ValueError(f"not a quantity: {value!r}")
    number, suffix = decimal.Decimal(match.group(1)), match.group(2) or ""
    if suffix[:1] in ("e", "E") and len(suffix) > 1:
        scale = decimal.Decimal(10) ** int(suffix[1:])
    else:
        scale = _SUFFIX[suffix]
    return int((number * scale).to_integral_value(rounding=decimal.ROUND_CEILING))


def format_quantity(value: int) -> str:
    """Bytes as the largest binary suffix that divides them (16777216 -> "16Mi")."""
    for exponent in range(len(_BINARY), 0, -1):
        if value and value % 1024**exponent == 0:
            return f"{value // 1024**exponent}{_BINARY[exponent - 1]}"
    return str(value)


_DURATION = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(h|m|s)?")
_SECONDS_PER = {"h": 3600.0, "m": 60.0, "s": 1.0, None: 1.0}


def parse_duration(text: str) -> float:
    """Seconds from "600", "600s", "10m", "1.5h" or "1h30m" (a bare number is seconds)."""
    parts = list(_DURATION.finditer(text))
    if not parts or "".join(m.group(0) for m in parts) != text:
        raise ValueError(f"not a duration: {text!r}")
    if len(parts) > 1 and any(m.group(2) is None for m in parts):
        raise ValueError(f"not a duration: {text!r}")  # "1h30": 30 what?
    return sum(float(m.group(1)) * _SECONDS_PER[m.group(2)] for m in parts)


def parse_percent(text: str) -> float:
    """A fraction from "1%" or "0.5%" (the % is required: "1" would be ambiguous)."""
    if not text.endswith("%"):
        raise ValueError(f"not a percentage: {text!r}")
    return float(text[:-1]) / 100


def _quantity_text(text: str) -> str:
    parse_quantity(text)
    return text


@dataclasses.dataclass(frozen=True)
class Kind:
    """How an option's text becomes its value, and its value text again."""

    parse: Callable[[str], Any]
    """Raises ValueError for text it does not accept."""
    problem: str = ""
    """Follows the refused text in the error; {help} is the option's help."""
    optional: bool = False
    """Empty text means None: unset."""
    format: Callable[[Any], str] = str
    """The value as the text a variable would hold (the child's env, the docs)."""
    boolean: bool = False
    """A flag pair --x/--no-x instead of a flag with a value."""


TEXT = Kind(str)
OPTIONAL_TEXT = Kind(str, optional=True)
INTEGER = Kind(int, "is not an integer; set {help}")
OPTIONAL_INTEGER = dataclasses.replace(INTEGER, optional=True)
NUMBER = Kind(float, "is not a number; set {help}", format=lambda v: format(v, "g"))
BOOLEAN = Kind(
    parse_boolean, "is not a boolean; use 1 or 0", format=lambda v: "1" if v else "0", boolean=True
)
QUANTITY = Kind(
    parse_quantity,
    "is not a Kubernetes quantity; use e.g. 50Gi, 500M or 64Mi",
    format=format_quantity,
)
OPTIONAL_QUANTITY = dataclasses.replace(QUANTITY, optional=True)
OPTIONAL_DURATION = Kind(
    parse_duration,
    "is not a duration; use seconds or a unit, e.g. 600, 600s, 10m or 1h",
    optional=True,
    format=lambda v: format(v, "g"),
)
OPTIONAL_PERCENT = Kind(
    parse_percent,
    "is not a percentage; use e.g. 1% or 0.5%",
    optional=True,
    format=lambda v: format(v * 100, "g") + "%",
)
QUANTITY_TEXT = dataclasses.replace(QUANTITY, parse=_quantity_text, format=str)
"""A quantity kept as written (inject copies it into the YAML), refused as QUANTITY refuses."""


# --- checks -------------------------------------------------------------------------------


def rule(ok: Callable[[Any], object], accepted: str) -> Check:
    """A check: values for which `ok` is false are refused with "is invalid; use <accepted>"."""
    return lambda value: None if ok(value) else f" is invalid; use {accepted}"


def between(low: float, high: float, accepted: str) -> Check:
    return rule(lambda value: low <= value <= high, accepted)


def at_least(low: float, accepted: str) -> Check:
    return rule(lambda value: value >= low, accepted)


def one_of(values: Sequence[str], accepted: str = "") -> Check:
    return rule(lambda value: value in values, accepted or "one of " + ", ".join(values))


# --- options ------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Fallback:
    """A platform variable an option is read from when its own is unset or empty."""

    env: str
    template: str = "{}"
    """The option's text made from the variable's (s3://{}/jitckpt from AWS_S3_BUCKET)."""

    def source(self, option: Option) -> str:
        if self.template == "{}":
            return f"{self.env}="
        return f"{option.env} (from {self.env})="


def _same(value: Any) -> Any:
    return value


@dataclasses.dataclass(frozen=True)
class Option:
    """One setting: a config field, its flag, its JITCKPT_* variable, converter and docs."""

    field: str
    kind: Kind
    help: str
    """One line for --help; also the hint of a conversion error."""
    check: Optional[Check] = None
    doc: str = ""
    """The README's meaning column (markdown); the help when empty."""
    default_doc: str = ""
    """The README's default column, when the field's default does not say it."""
    fallbacks: tuple[Fallback, ...] = ()
    show: Callable[[Any], Any] = _same
    """The value as errors show it (user:password@ in a URL is a secret)."""
    flag: str = ""
    """--field-with-dashes unless given."""
    env: str = ""
    """JITCKPT_<FIELD> unless given or flag_only."""
    flag_only: bool = False
    """No variable (inject's options): argparse sees every value."""
    metavar: str = "VALUE"
    choices: tuple[str, ...] = ()
    """For a flag-only option argparse refuses anything else; give a check for the rest."""
    required: bool = False
    repeat: bool = False
    """The flag may be given several times; the value is a tuple."""

    def __post_init__(self) -> None:
        if not self.flag:
            object.__setattr__(self, "flag", "--" + self.field.replace("_", "-"))
        if not self.env and not self.flag_only:
            object.__setattr__(self, "env", "JITCKPT_" + self.field.upper())

    @property
    def source(self) -> str:
        """How an error names the option when no flag or variable gave the value."""
        return f"{self.flag} " if self.flag_only else f"{self.env}="

    def convert(self, raw: Any, source: str) -> Any:
        """The typed value of `raw` (a list for a repeated flag), or a SettingError."""
        if isinstance(raw, list):
            return tuple(self.convert(item, source) for item in raw)
        text = str(raw).strip()
        if text == "" and self.kind.optional:
            return None
        try:
            return self.kind.parse(text)
        except ValueError:
            problem = self.kind.problem.format(help=self.help)
            raise SettingError(source, f"{self.show(text)!r} {problem}", self.field) from None

    def validate(self, value: Any) -> None:
        """Raise a SettingError naming the variable (or flag) when `value` is refused."""
        if value is None or self.check is None:
            return
        problem = self.check(value)
        if problem is not None:
            raise SettingError(self.source, f"{self.show(value)!r}{problem}", self.field)


def validate(config: object, options: Sequence[Option]) -> None:
    """Check every option's value of `config` (its __post_init__), in table order."""
    for option in options:
        option.validate(getattr(config, option.field))


def _raw(
    option: Option, env: Mapping[str, str], flags: Mapping[str, Any]
) -> Optional[tuple[Any, str]]:
    """(text, source) from the flag, the variable or a fallback; None leaves the default."""
    if option.field in flags:
        return flags[option.field], f"{option.flag} "
    if option.env in env and (env[option.env].strip() or not option.fallbacks):
        return env[option.env], f"{option.env}="
    for fallback in option.fallbacks:
        text = env.get(fallback.env, "").strip()
        if text:
            return fallback.template.format(text), fallback.source(option)
    return None


def resolve(
    cls: Callable[..., T],
    options: Sequence[Option],
    env: Mapping[str, str],
    flags: Optional[Mapping[str, Any]] = None,
) -> T:
    """Build `cls` from flag values (by field) over variables over fallbacks over defaults.

    An error names where the value came from: the flag, the variable or the fallback.
    """
    flags = flags or {}
    kwargs: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for option in options:
        found = _raw(option, env, flags)
        if found is not None:
            raw, sources[option.field] = found
            kwargs[option.field] = option.convert(raw, sources[option.field])
    try:
        return cls(**kwargs)
    except SettingError as exc:
        source = sources.get(exc.field)
        if source is None:
            raise
        raise exc.named(source) from None


def default_of(config: type, field: str) -> Any:
    """The default of `field` in the config dataclass `config` (None when it has none)."""
    for f in dataclasses.fields(config):
        if f.name == field:
            if f.default_factory is not dataclasses.MISSING:
                return f.default_factory()
            return None if f.default is dataclasses.MISSING else f.default
    raise KeyError(field)


# --- command line -------------------------------------------------------------------------


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose errors are one SettingError line, ending with `hint`."""

    def __init__(self, *args: Any, hint: str, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)
        self.hint = hint

    def error(self, message: str) -> NoReturn:
        # argparse quotes unknown arguments verbatim; one with a newline must not split the line.
        message = message.replace("\r", "\\r").replace("\n", "\\n")
        raise SettingError("", f"{message}; {self.hint}")


def add_flags(
    parser: argparse.ArgumentParser, options: Sequence[Option], config: Optional[type] = None
) -> None:
    """One flag per option (--x/--no-x for booleans); its help names the variable or, for a
    flag-only option, the default of `config`."""
    for option in options:
        kwargs: dict[str, Any] = {"dest": option.field, "default": None}
        note = option.env
        if option.flag_only and config is not None:
            default = default_of(config, option.field)
            note = "" if default in (None, "", ()) else option.kind.format(default)
        kwargs["help"] = f"{option.help} [{note}]" if note else option.help
        if option.kind.boolean:
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            kwargs["metavar"] = option.metavar
        if option.repeat:
            kwargs["action"] = "append"
        if option.choices and option.flag_only:
            kwargs["choices"] = option.choices
        if option.required:
            kwargs["required"] = True
        parser.add_argument(option.flag, **kwargs)


def flag_values(parsed: Mapping[str, Any], options: Sequence[Option]) -> dict[str, Any]:
    """The options given on the command line, by field, as `resolve` takes them."""
    flags: dict[str, Any] = {}
    for option in options:
        value = parsed.get(option.field)
        if value is not None:
            flags[option.field] = option.kind.format(value) if option.kind.boolean else value
    return flags


# --- docs ---------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class DocRow:
    """One row of the README's configuration table."""

    env: str
    flag: str
    read_by: str
    default: str
    meaning: str

    def markdown(self) -> str:
        env = f"`{self.env}`" if self.env else "—"
        return f"| {env} | `{self.flag}` | {self.read_by} | {self.default} | {self.meaning} |"


def _default_doc(config: type, option: Option) -> str:
    default = default_of(config, option.field)
    if option.default_doc:
        text = option.default_doc
    elif default is None:
        text = "unset"
    elif default == "":
        text = "empty"
    else:
        text = f"`{option.kind.format(default)}`"
    plain = [f"`{f.env}`" for f in option.fallbacks if f.template == "{}"]
    return ", ".join([*plain, f"else {text}"]) if plain else text


def doc_rows(tables: Mapping[str, tuple[type, Sequence[Option]]]) -> list[DocRow]:
    """The options of several commands ({"E": (Config, OPTIONS), ...}), one row per variable
    (or flag), in table order; a variable read by several shares its row ("E, S")."""
    rows: dict[str, DocRow] = {}
    for reader, (config, options) in tables.items():
        for option in options:
            flag = option.flag
            if option.kind.boolean:
                flag = f"{flag}/--no-{flag[2:]}"
            row = DocRow(
                option.env, flag, reader, _default_doc(config, option), option.doc or option.help
            )
            key = option.env or option.flag
            seen = rows.get(key)
            if seen is None:
                rows[key] = row
                continue
            if (seen.flag, seen.default, seen.meaning) != (row.flag, row.default, row.meaning):
                raise ValueError(f"{key} is documented differently by {seen.read_by} and {reader}")
            rows[key] = dataclasses.replace(seen, read_by=f"{seen.read_by}, {reader}")
    return list(rows.values())
