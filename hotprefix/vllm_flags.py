"""vLLM launch lines, accepted as they are: `hotprefix serve` takes what `vllm serve`
lines commonly carry.

A flag is honoured where its concept exists here (cli.py defines those, under vLLM's
names). The rest are FOREIGN_FLAGS: accepted, and named at start-up with the reason they
change nothing on this engine; a value that would silently change results (a LoRA
adapter, a quantization method other than the file's own, pipeline parallelism) is
refused with the reason instead. Also here: vLLM's human-readable integers (`4k`) and its
`--config FILE` (a YAML file of long flag names; the command line wins).
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from hotprefix.config import ConfigError


@dataclass(frozen=True)
class ForeignFlag:
    """A `vllm serve` flag with no effect here. names: its spellings; reason: why it
    changes nothing (logged at start when given); takes_value: it takes one value (else
    it is a switch); harmless: the values that change nothing (None: every value);
    refuse: why any other value is refused."""

    names: tuple[str, ...]
    reason: str
    takes_value: bool = False
    harmless: Callable[[str], bool] | None = None
    refuse: str = ""

    @property
    def dest(self) -> str:
        return "foreign_" + self.names[-1].lstrip("-").replace("-", "_").replace(".", "_")


_NO_PROMPT_LOGS = ("hotprefix logs no prompt or output to its log; --request-log writes one line per finished "
                   "request (prompt text only with --request-log-prompts)")
FOREIGN_FLAGS: tuple[ForeignFlag, ...] = (
    ForeignFlag(("--disable-log-requests",), _NO_PROMPT_LOGS),
    ForeignFlag(("--enable-log-requests",), _NO_PROMPT_LOGS),
    ForeignFlag(("--trust-remote-code",), "hotprefix runs no code from a model repository: it implements the "
                                          "architectures it loads (Llama-family) itself"),
    ForeignFlag(("-O", "--compilation-config"), "hotprefix does not use torch.compile (its CPU kernels are "
                                                "compiled C, built once)", takes_value=True),
    ForeignFlag(("--calculate-kv-scales",), "fp8 KV is stored with a fixed scale here (--kv-cache-dtype fp8); "
                                            "there are no per-layer scales to calculate"),
    ForeignFlag(("--enable-lora",), "no adapter is loaded without --lora-modules (which is refused)"),
    ForeignFlag(("--lora-modules",), "", takes_value=True, harmless=lambda v: False,
                refuse="LoRA adapters are not supported: answers would come from the base model alone"),
    ForeignFlag(("-pp", "--pipeline-parallel-size"), "one pipeline stage: the whole model runs in one engine",
                takes_value=True, harmless=lambda v: v.strip() == "1",
                refuse="hotprefix runs one engine per device; run one server per device behind `hotprefix "
                       "gateway` instead"),
    ForeignFlag(("-q", "--quantization"), "the weights' format is read from the file (a GGUF's block types)",
                takes_value=True, harmless=lambda v: v.lower() in ("gguf", "none"),
                refuse="only GGUF block weights and unquantized safetensors are loaded; another method would "
                       "serve other weights than the ones asked for"),
    ForeignFlag(("--tokenizer-mode",), "the model's fast tokenizer is used (the same tokens as the slow one)",
                takes_value=True, harmless=lambda v: v in ("auto", "hf", "slow"),
                refuse="mistral's own tokenizer format (tekken) is not supported; its tokens would differ"),
    ForeignFlag(("--response-role",), "chat replies have the role assistant", takes_value=True,
                harmless=lambda v: v == "assistant",
                refuse="chat replies always have the role assistant here; another role would change them"),
    ForeignFlag(("--guided-decoding-backend", "--structured-outputs-config.backend"),
                "output constraints are enforced by llguidance: a token is allowed exactly when the constraint "
                "allows it, as with every backend", takes_value=True),
)


def add_foreign_args(g: argparse._ArgumentGroup) -> None:
    """Add FOREIGN_FLAGS to a parser group (absent from the namespace when not given)."""
    for f in FOREIGN_FLAGS:
        kind = {"metavar": "VALUE"} if f.takes_value else {"action": "store_const", "const": "true"}
        g.add_argument(*f.names, dest=f.dest, default=argparse.SUPPRESS, help=f"vLLM's; {f.reason or f.refuse}", **kind)


def check_foreign(a: argparse.Namespace) -> list[str]:
    """The start-up lines naming each given foreign flag and why it changes nothing.
    Raises ConfigError for a value that would change results."""
    lines = []
    for f in FOREIGN_FLAGS:
        value = getattr(a, f.dest, None)
        if value is None:
            continue
        if f.takes_value and f.harmless is not None and not f.harmless(value):
            raise ConfigError(f"{f.names[-1]} {value}: {f.refuse}")
        lines.append(f"{f.names[-1]}{' ' + value if f.takes_value else ''}: accepted, no effect here ({f.reason})")
    return lines


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
