"""vLLM launch lines, accepted as they are: `hotprefix serve` takes what `vllm serve`
lines commonly carry.

A flag is honoured where its concept exists here: it is declared on its config field
(config.py, under vLLM's name, with vLLM's spellings as aliases and vLLM's units). The
rest are declared the same way on ForeignFlags: accepted (by `hotprefix serve` and by
`LLM()`), and named at start-up with the reason they change nothing on this engine; a
value that would silently change results (a LoRA adapter, a quantization method other
than the file's own, pipeline parallelism) is refused with the reason instead. Also
here: vLLM's human-readable integers (`4k`), its dtype spellings, and its `--config FILE`
(a YAML file of long flag names; the command line wins).
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hotprefix.flags import ConfigError, Declared, FlagGroup, build, declared, flag, given


@dataclass(frozen=True)
class NoEffect:
    """Why a vLLM flag changes nothing here (logged at start when given); harmless: the
    values that change nothing (None: every value); refuse: why any other value is refused."""

    reason: str
    harmless: Callable[[str], bool] | None = None
    refuse: str = ""


def no_effect(reason: str, names: tuple[str, ...] = (), takes_value: bool = False,
              harmless: Callable[[str], bool] | None = None, refuse: str = "") -> Any:
    """A ForeignFlags field: a switch (False: not given), or a flag that takes one value (None: not given)."""
    return flag(None if takes_value else False, f"vLLM's; {reason or refuse}", group=FlagGroup.FOREIGN, names=names,
                metavar="VALUE", shown="", rule=NoEffect(reason, harmless, refuse))


def _never(value: str) -> bool:
    return False


_NO_PROMPT_LOGS = ("hotprefix logs no prompt or output to its log; --request-log writes one line per finished "
                   "request (prompt text only with --request-log-prompts)")
_ONE_ENGINE = "hotprefix runs one engine per device; run one server per device behind `hotprefix gateway` instead"


@dataclass(frozen=True)
class ForeignFlags:
    """The `vllm serve` flags (and `LLM()` keywords) with no effect here that were given:
    True or a value for each given one. Raises ConfigError at construction for a value
    that would change results."""

    disable_log_requests: bool = no_effect(_NO_PROMPT_LOGS)
    enable_log_requests: bool = no_effect(_NO_PROMPT_LOGS)
    trust_remote_code: bool = no_effect("hotprefix runs no code from a model repository: it implements the "
                                        "architectures it loads (Llama-family) itself")
    compilation_config: str | None = no_effect("hotprefix does not use torch.compile (its CPU kernels are compiled "
                                               "C, built once)", ("-O", "--compilation-config"), takes_value=True)
    calculate_kv_scales: bool = no_effect("fp8 KV is stored with a fixed scale here (--kv-cache-dtype fp8); there "
                                          "are no per-layer scales to calculate")
    enable_lora: bool = no_effect("no adapter is loaded without --lora-modules (which is refused)")
    lora_modules: str | None = no_effect("", takes_value=True, harmless=_never,
                                         refuse="LoRA adapters are not supported: answers would come from the base "
                                                "model alone")
    pipeline_parallel_size: str | None = no_effect("one pipeline stage: the whole model runs in one engine",
                                                   ("-pp", "--pipeline-parallel-size"), takes_value=True,
                                                   harmless=lambda v: v.strip() == "1", refuse=_ONE_ENGINE)
    quantization: str | None = no_effect("the weights' format is read from the file (a GGUF's block types)",
                                         ("-q", "--quantization"), takes_value=True,
                                         harmless=lambda v: v.lower() in ("gguf", "none"),
                                         refuse="only GGUF block weights and unquantized safetensors are loaded; "
                                                "another method would serve other weights than the ones asked for")
    tokenizer_mode: str | None = no_effect("the model's fast tokenizer is used (the same tokens as the slow one)",
                                           takes_value=True, harmless=lambda v: v in ("auto", "hf", "slow"),
                                           refuse="mistral's own tokenizer format (tekken) is not supported; its "
                                                  "tokens would differ")
    response_role: str | None = no_effect("chat replies have the role assistant", takes_value=True,
                                          harmless=lambda v: v == "assistant",
                                          refuse="chat replies always have the role assistant here; another role "
                                                 "would change them")
    guided_decoding_backend: str | None = no_effect(
        "output constraints are enforced by llguidance: a token is allowed exactly when the constraint allows it, as "
        "with every backend", ("--guided-decoding-backend", "--structured-outputs-config.backend"), takes_value=True)
    enable_prompt_tokens_details: bool = no_effect("usage.prompt_tokens_details.cached_tokens is always reported")
    enable_auto_tool_choice: bool = no_effect("tool_choice auto is always on")
    disable_uvicorn_access_log: bool = no_effect("uvicorn's access log is always off here; --request-log writes "
                                                 "one line per finished request")

    def __post_init__(self) -> None:
        for d, value, rule in self._given():
            if value is not True and rule.harmless is not None and not rule.harmless(str(value)):
                raise ConfigError(f"{d.names[-1]} {value}: {rule.refuse}")

    def _given(self) -> list[tuple[Declared, Any, NoEffect]]:
        return [(d, getattr(self, d.name), d.flag.rule) for d in declared(ForeignFlags)
                if getattr(self, d.name) not in (None, False)]

    def lines(self) -> list[str]:
        """The start-up lines naming each given flag and why it changes nothing."""
        return [f"{d.names[-1]}{'' if value is True else f' {value}'}: accepted, no effect here ({rule.reason})"
                for d, value, rule in self._given()]


FOREIGN_FLAGS = declared(ForeignFlags)


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
