"""vLLM launch lines, accepted as they are: `hotprefix serve` takes what `vllm serve`
lines commonly carry.

Every flag of `vllm serve --help` (vLLM 0.32 and 0.33: tests/e2e/vllm_serve_flags.txt) is
taken. A flag is honoured where its concept exists here: it is declared on its config field
(config.py, under vLLM's name, with vLLM's spellings as aliases and vLLM's units). The
rest are declared the same way on ForeignFlags' groups (vllm_foreign*.py): accepted (by
`hotprefix serve` and by `LLM()`), and named at start-up with the reason they change
nothing on this engine; a value that would silently change results (a LoRA adapter, a
quantization method other than the file's own, pipeline parallelism) is refused with the
reason instead. An honoured flag that does nothing on the CPU (or in the mode chosen) is
named at start-up too (`inert_lines`, its field's `Inert` rule). Also here: vLLM's
human-readable integers (`4k`), its dtype spellings, and its `--config FILE` (a YAML file
of long flag names; the command line wins).
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from hotprefix.flags import ConfigError, build, declared, given
from hotprefix.vllm_foreign import AdapterFlags, ExpertFlags, ParallelFlags, given_flags
from hotprefix.vllm_foreign_frontend import FrontendFlags, MetricsFlags
from hotprefix.vllm_foreign_model import ModelFlags, RuntimeFlags


@dataclass(frozen=True)
class ForeignFlags:
    """The `vllm serve` flags (and `LLM()` keywords) with no effect here, in groups
    (vllm_foreign*.py): each given one is True, False (a switch given off) or its value.
    Raises ConfigError at construction for a value that would change results."""

    parallel: ParallelFlags = field(default_factory=ParallelFlags)
    experts: ExpertFlags = field(default_factory=ExpertFlags)
    adapters: AdapterFlags = field(default_factory=AdapterFlags)
    model: ModelFlags = field(default_factory=ModelFlags)
    runtime: RuntimeFlags = field(default_factory=RuntimeFlags)
    frontend: FrontendFlags = field(default_factory=FrontendFlags)
    metrics: MetricsFlags = field(default_factory=MetricsFlags)

    def lines(self) -> list[str]:
        """The start-up lines naming each given flag and why it changes nothing."""
        out = []
        for group in (getattr(self, f.name) for f in fields(self)):
            for d, value, rule in given_flags(group):
                spelled = d.names[-1] if value is not False else d.off_names[0]
                out.append(f"{spelled}{'' if isinstance(value, bool) else f' {value}'}: accepted, no effect here "
                           f"({rule.reason})")
        return out


FOREIGN_FLAGS = declared(ForeignFlags)


@dataclass(frozen=True)
class Inert:
    """The rule of an honoured flag that does nothing in some configurations:
    when(config, on_cpu) says it does nothing there; why says what happens instead."""

    why: str
    when: Callable[[Any, bool], bool]


def on_cpu(_config: Any, cpu: bool) -> bool:
    """An Inert rule's `when` for flags of CUDA alone."""
    return cpu


def inert_lines(a: argparse.Namespace, config: Any, cpu: bool) -> list[str]:
    """The start-up lines naming each honoured flag given on the command line that does
    nothing with `config` (an EngineConfig) on this device (cpu: it runs on the CPU)."""
    out = []
    for d in declared(type(config)):
        given_value = getattr(a, d.dest, None)
        if isinstance(d.flag.rule, Inert) and given_value is not None and d.flag.rule.when(config, cpu):
            shown = "" if isinstance(given_value, bool) else " " + " ".join(map(str, given_value)) \
                if isinstance(given_value, list) else f" {given_value}"
            out.append(f"{d.names[0]}{shown}: accepted, no effect here ({d.flag.rule.why})")
    return out


def check_foreign(a: argparse.Namespace) -> list[str]:
    """The start-up lines naming each given foreign flag and why it changes nothing.
    Raises ConfigError for a value that would change results."""
    return build(ForeignFlags, given(a, ForeignFlags)).lines()


_HUMAN = re.compile(r"(\d+(?:\.\d+)?)([kmgtKMGT]?)")


def human_int(text: str) -> int:
    """vLLM's human-readable integers: 4k = 4,000, 4K = 4,096, 25.6k = 25,600, 1M =
    1,048,576; a plain integer as it is. Raises argparse.ArgumentTypeError."""
    m = _HUMAN.fullmatch(text.strip())
    if not m:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r} (e.g. 4096, 4k or 4K)")
    number, suffix = m.groups()
    power = "kmgt".find(suffix.lower()) + 1 if suffix else 0
    base = 1024 if suffix.isupper() else 1000
    value = float(number) * base ** power
    if value != int(value):
        raise argparse.ArgumentTypeError(f"not a whole number of tokens: {text!r}")
    return int(value)


DTYPE_ALIASES = {"half": "float16", "float": "float32", "bf16": "bfloat16", "fp16": "float16"}


def expand_config(argv: list[str], known: frozenset[str]) -> list[str]:
    """argv with `--config FILE` replaced by the file's flags, put before the command
    line's own (which therefore win). The file is YAML: long flag names without their
    dashes as keys (`max-model-len: 4096`, `model: PATH`); true for a switch, false for
    its `--no-` form or its default; a list for a flag that takes several. `known`: the
    serve command's option strings. Raises ConfigError for a file that cannot be read
    or a key that names no flag."""
    for i, arg in enumerate(argv):
        if arg == "--config" or arg.startswith("--config="):
            path = arg.split("=", 1)[1] if "=" in arg else (argv[i + 1] if i + 1 < len(argv) else "")
            rest = argv[:i] + argv[i + (1 if "=" in arg else 2):]
            where = next((j + 1 for j, x in enumerate(rest) if x == "serve"), len(rest))
            return rest[:where] + config_flags(path, known) + rest[where:]
    return argv


def config_flags(path: str, known: frozenset[str]) -> list[str]:
    """The command-line flags a --config YAML file stands for. Raises ConfigError."""
    import yaml

    try:
        data = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as e:
        raise ConfigError(f"--config {path}: cannot read it ({e})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"--config {path}: expected a mapping of flag names to values")
    out: list[str] = []
    for key, value in data.items():
        flag = "--" + str(key).replace("_", "-")
        if flag not in known:
            raise ConfigError(f"--config {path}: {key!r} is not a flag of `hotprefix serve`")
        if value is True:
            out.append(flag)
        elif value is False or value is None:
            out += ["--no-" + flag[2:]] if value is False and "--no-" + flag[2:] in known else []
        elif isinstance(value, list):
            out += [flag, *map(str, value)]
        else:
            out += [flag, str(value)]
    return out
