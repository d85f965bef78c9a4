"""Flags declared once, on the config fields.

A config dataclass's field says how it is set: `field: int = flag(16, help=..., group=...)`.
From those declarations come the `hotprefix serve` and `generate` parsers (`add_flags`),
their `--help` (each default printed once, read from the field), the values a command line
gave (`given`), the keywords `LLM(...)` takes (`take_keywords`), and the config itself
(`build`), with each value converted from the user's unit (a flag's text, or an LLM keyword:
GiB, minutes, "4MiB", a JSON list) to the field's (bytes, seconds, a tuple) by its `Unit`.
The config classes construct and validate themselves; nothing here knows a field by name.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import types
import typing
from collections.abc import Callable, Iterable, Mapping
from dataclasses import MISSING, Field, dataclass, field, fields, is_dataclass
from enum import Enum
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")
FLAG = "flag"  # the key of a declaration in a field's metadata


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the option and the value."""


class FlagGroup(str, Enum):
    """The sections of --help, in the order they are printed."""

    MODEL = "model and cache"
    SCHEDULER = "scheduler"
    STRUCTURED = "structured outputs (limits on a request's JSON schema, regex or grammar; each a 400)"
    SERVER = "server"
    LIMITS = "limits (what one request may ask for)"
    HTTP = "HTTP (vLLM's flags)"
    FOREIGN = "vLLM's other flags"


GROUP_TEXT = {FlagGroup.FOREIGN: (
    "Every other flag of `vllm serve` (vLLM 0.32 and 0.33, in each of its spellings) is accepted and not listed "
    "here: each one given is named at start-up with why it has no effect on this engine, and a value that would "
    "change results is refused with why (docs/cli.md).")}


@dataclass(frozen=True)
class Unit:
    """How a user's value (a flag's text, or an LLM keyword) becomes the field's value
    (to_field, which raises ConfigError), and how the field's default is shown in --help.
    metavar: what --help calls the value."""

    to_field: Callable[[Any], Any]
    show: Callable[[Any], str] = str
    metavar: str | None = None


@dataclass(frozen=True)
class Flag:
    """A field's declaration. names: its option strings (default: --field-name; the first
    long one names it in the parsed namespace, the others are aliases, e.g. vLLM's);
    group: its --help section (None: the command's own options); unit: converts the user's
    value; choices: the values allowed (default: an Enum field's values); type: parses the
    command line's text (default: int or float as the field is, unless a unit converts it);
    nargs / repeat: the flag takes several values / may be given several times; shown: the
    default as --help says it where the field's own default does not ("" hides it); negate:
    a --disable-X switch that turns a True field off; negatable: --X and --no-X; inverse: a
    negatable --enable-X is also turned off by --disable-X, and a --disable-X by --enable-X
    (vLLM 0.33's spellings); env: the environment variable that gives the value when the
    flag is not given; rule: what else a module knows about the flag (vllm_flags: why it
    has no effect here)."""

    help: str
    group: FlagGroup | None = None
    names: tuple[str, ...] = ()
    unit: Unit | None = None
    choices: tuple[str, ...] | None = None
    type: Callable[[str], Any] | None = None
    nargs: str | None = None
    repeat: bool = False
    metavar: str | None = None
    shown: str | None = None
    negate: bool = False
    negatable: bool = False
    inverse: bool = False
    env: str | None = None
    rule: Any = None


def flag(default: Any, help: str, **declaration: Any) -> Any:
    """A dataclass field with this default, declared as a flag (see Flag for the rest)."""
    return field(default=default, metadata={FLAG: Flag(help, **declaration)})


@dataclass(frozen=True)
class Declared:
    """One declared field, as the mechanism sees it: its name, declaration, default and
    type (without None)."""

    name: str
    flag: Flag
    default: Any
    type: Any

    @property
    def names(self) -> tuple[str, ...]:
        return self.flag.names or ("--" + self.name.replace("_", "-"),)

    @property
    def off_names(self) -> tuple[str, ...]:
        """The option strings that turn a negatable switch off: --no-X for each long name,
        and with `inverse` --disable-X for --enable-X (and the reverse)."""
        if not self.flag.negatable:
            return ()
        longs = [n for n in self.names if n.startswith("--")]
        swap = {"--enable-": "--disable-", "--disable-": "--enable-"}
        inverse = [swap[p] + n[len(p):] for n in longs for p in swap if self.flag.inverse and n.startswith(p)]
        return tuple(["--no-" + n[2:] for n in longs] + inverse)

    @property
    def dest(self) -> str:
        """Its attribute in the parsed namespace: the first long name, as argparse derives it."""
        return next(n for n in self.names if n.startswith("--"))[2:].replace("-", "_").replace(".", "_")

    @property
    def keywords(self) -> tuple[str, ...]:
        """The LLM() keywords that set it: the field's name and its long flag names (not
        a --disable-X switch's: its name says the opposite of the field's value)."""
        flags = () if self.flag.negate else (n[2:].replace("-", "_") for n in self.names if n.startswith("--"))
        return tuple(dict.fromkeys([self.name, *flags]))

    def convert(self, value: Any) -> Any:
        """value, in the user's unit, as the field's. Raises ConfigError."""
        if self.flag.unit is not None:
            return self.flag.unit.to_field(value)
        return tuple(value) if self.flag.nargs or self.flag.repeat else value

    def help_text(self) -> str:
        """The declaration's help with the default said once (and the env variable)."""
        shown = self.flag.shown if self.flag.shown is not None else self._shown_default()
        text = self.flag.help + (f" (default: {shown})" if shown else "")
        text += f" (env {self.flag.env})" if self.flag.env else ""
        return text.replace("%", "%%")

    def _shown_default(self) -> str:
        v = self.default
        if v is None or v == () or (self.type is bool and not self.flag.negatable):
            return ""
        if isinstance(v, Enum):
            return str(v.value)
        return self.flag.unit.show(v) if self.flag.unit is not None else str(v)

    def argparse_kwargs(self) -> dict[str, Any]:
        """add_argument's keywords. Every default is None: a flag that was not given is
        None in the namespace and the field's own default applies."""
        hidden = self.flag.group is FlagGroup.FOREIGN  # (hundreds: their group's text says what they do)
        f, kw = self.flag, {"dest": self.dest, "default": None,
                            "help": argparse.SUPPRESS if hidden else self.help_text()}
        if self.type is bool:
            return {**kw, "action": Switch, "off": self.off_names} if f.negatable else {**kw, "action": "store_true"}
        choices = f.choices or (tuple(m.value for m in self.type) if _is_enum(self.type) else None)
        parse = f.type or (self.type if self.type in (int, float) and f.unit is None and not f.nargs else None)
        return {**kw, "choices": choices, "type": parse, "nargs": f.nargs, "action": "append" if f.repeat else None,
                "metavar": f.metavar or (f.unit.metavar if f.unit else None)}


class DefaultsOnce(argparse.HelpFormatter):
    """--help for a parser whose arguments are not declared here (the gateway's): each
    default said once, from the argument, unless its help already says its default or it
    has none worth saying (None, False)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or action.default in (None, False, argparse.SUPPRESS) or not action.option_strings:
            return text
        return text + " (default: %(default)s)"


class Switch(argparse.Action):
    """A switch given on (True: its names) or off (False: `off`, e.g. --no-X, --disable-X)."""

    def __init__(self, option_strings: list[str], dest: str, off: tuple[str, ...] = (), **kw: Any) -> None:
        super().__init__([*option_strings, *off], dest, nargs=0, **kw)
        self.off = frozenset(off)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        setattr(namespace, self.dest, option_string not in self.off)


def _is_enum(t: Any) -> bool:
    return isinstance(t, type) and issubclass(t, Enum)


def _without_none(t: Any) -> Any:
    if isinstance(t, types.UnionType) or typing.get_origin(t) is typing.Union:
        rest = [a for a in typing.get_args(t) if a is not type(None)]
        return rest[0] if len(rest) == 1 else t
    return t


@functools.cache
def declared(cls: type) -> tuple[Declared, ...]:
    """The declared fields of dataclass cls and of its undeclared dataclass-typed fields (its
    sections), in order.
    Raises TypeError for a declaration that cannot work (a switch that can only turn a
    True field on)."""
    hints = typing.get_type_hints(cls)
    out: list[Declared] = []
    for f in fields(cls):
        t = _without_none(hints[f.name])
        if is_dataclass(t) and FLAG not in f.metadata:  # a group of flags (a dataclass a flag sets whole is one)
            out += declared(t)
        elif FLAG in f.metadata:
            d = Declared(f.name, f.metadata[FLAG], _default(f), t)
            if t is bool and d.default is not d.flag.negate and not d.flag.negatable:
                raise TypeError(f"{cls.__name__}.{f.name}: a switch must turn its default around (negate/negatable)")
            out.append(d)
    return tuple(out)


def _default(f: Field) -> Any:
    return f.default_factory() if f.default is MISSING and f.default_factory is not MISSING else f.default


def add_flags(parser: argparse.ArgumentParser, *classes: type) -> None:
    """Add the declared flags of each class to parser, each in its --help section
    (sections in FlagGroup order). Mutates parser."""
    decls = [d for cls in classes for d in declared(cls)]
    groups = {g: parser.add_argument_group(g.value, GROUP_TEXT.get(g)) for g in FlagGroup
              if any(d.flag.group is g for d in decls)}
    for d in decls:
        kw = {k: v for k, v in d.argparse_kwargs().items() if v is not None or k == "default"}
        (groups[d.flag.group] if d.flag.group else parser).add_argument(*d.names, **kw)


def given(a: argparse.Namespace, cls: type) -> dict[str, Any]:
    """The values the command line gave cls's declared flags, by field name, as parsed
    (not yet converted); a flag with an env variable takes it when not given."""
    out: dict[str, Any] = {}
    for d in declared(cls):
        value = getattr(a, d.dest, None)
        if value is None and d.flag.env:
            value = os.environ.get(d.flag.env)
        if value is not None:
            out[d.name] = (not value) if d.flag.negate else value
    return out


def take_keywords(kwargs: dict[str, Any], cls: type) -> dict[str, Any]:
    """Remove from kwargs the keywords that set cls's declared fields (each field's name
    or a long flag name of it, e.g. vLLM's) and return them by field name. Mutates kwargs;
    raises TypeError for two keywords that set one field."""
    out: dict[str, Any] = {}
    for d in declared(cls):
        for key in d.keywords:
            if key in kwargs:
                if d.name in out:
                    raise TypeError(f"{key} and another keyword both set {d.name}")
                out[d.name] = kwargs.pop(key)
    return out


def build(cls: type[T], values: Mapping[str, Any]) -> T:
    """An instance of dataclass cls: each declared field named in values takes that
    value converted by its declaration (the user's unit to the field's); each field that
    is a dataclass is built the same way from the same values; every other field keeps
    its default. Raises ConfigError for a value the declaration or the class refuses."""
    hints = typing.get_type_hints(cls)
    by_name = {d.name: d for d in declared(cls)}
    kwargs: dict[str, Any] = {}
    for f in fields(cls):
        t = _without_none(hints[f.name])
        if is_dataclass(t) and FLAG not in f.metadata:
            kwargs[f.name] = build(t, values)
        elif f.name in values:
            d = by_name.get(f.name)
            kwargs[f.name] = d.convert(values[f.name]) if d else values[f.name]
    return cls(**kwargs)


# -- units ------------------------------------------------------------------------------

_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6,
          "mib": 2**20, "g": 10**9, "gb": 10**9, "gib": 2**30, "t": 10**12, "tb": 10**12,
          "tib": 2**40, "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}
_NUMBER = re.compile(r"\s*[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?\s*")


def parse_size(text: str | int | float) -> int:
    """Parse a memory size such as ``"4GiB"``, ``"512MB"`` or ``1073741824`` into bytes.

    Raises ConfigError on anything that is not a non-negative size.
    """
    if isinstance(text, (int, float)):
        if text < 0:
            raise ConfigError(f"memory size must be non-negative, got {text}")
        return int(text)
    m = _SIZE_RE.match(text)
    if not m or (m.group(2) or "").lower() not in _UNITS:
        raise ConfigError(f"cannot parse memory size {text!r} (examples: 4GiB, 512MB, 1000000)")
    return int(float(m.group(1)) * _UNITS[(m.group(2) or "").lower()])


def _number(value: Any) -> float:
    """value (a number, or its text) as a float. Raises ConfigError."""
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"not a number: {value!r}") from None


def _gib(value: Any) -> int:
    """GiB as bytes: a number (4, 0.5, or its text) is GiB; text with a unit (512MiB) is that size."""
    if isinstance(value, str) and not _NUMBER.fullmatch(value):
        return parse_size(value)
    n = _number(value) * 2**30
    if n != n or n in (float("inf"), float("-inf")):
        raise ConfigError(f"not a size in GiB: {value!r}")
    return int(n)


def _show_size(n: int) -> str:
    for name, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n and n % size == 0:
            return f"{n // size}{name}"
    return str(n)


def _text_list(value: str | Iterable[str] | None) -> tuple[str, ...]:
    """A list as vLLM's flags take it (a JSON list) or comma-separated; a list as it is. Raises ConfigError."""
    if not isinstance(value, str):
        return tuple(value or ())
    if value.lstrip().startswith("["):
        try:
            items = json.loads(value)
        except json.JSONDecodeError as e:
            raise ConfigError(f"not a JSON list: {value!r} ({e})") from None
        if not isinstance(items, list) or not all(isinstance(x, str) for x in items):
            raise ConfigError(f"expected a JSON list of strings, got {value!r}")
        return tuple(items)
    return tuple(x.strip() for x in value.split(",") if x.strip())


def _file_or_text(value: str) -> str:
    """A file's contents where value names a file, else value itself."""
    return Path(value).read_text() if os.path.isfile(value) else value


GIB = Unit(_gib, lambda b: f"{b / 2**30:g}", "GiB")
SIZE = Unit(parse_size, _show_size, "SIZE")  # bytes, or text such as 4GiB
MINUTES = Unit(lambda v: _number(v) * 60, lambda s: f"{s / 60:g}", "MINUTES")  # the field holds seconds
TEXT_LIST = Unit(_text_list, lambda items: json.dumps(list(items)))
FILE_OR_TEXT = Unit(_file_or_text)
