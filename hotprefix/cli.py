"""The `hotprefix` command and its sub-commands.

The flags of `serve` and `generate` are declared once, on the fields they set (config.py,
server_config.py, vllm_flags.ForeignFlags, and GenerateOptions below); this module builds
the parsers from those declarations (flags.add_flags) and the configs from what a command
line gave (flags.given, flags.build).
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from hotprefix.config import ConfigError, EngineConfig, ServerConfig
from hotprefix.flags import add_flags, build, flag, given
from hotprefix.sampling_params import SamplingParams
from hotprefix.server_config import TOOL_CALL_PARSERS as TOOL_CALL_PARSERS  # (re-exported)
from hotprefix.vllm_flags import ForeignFlags, check_foreign, expand_config, inert_lines

_SAMPLING = SamplingParams()  # generate's defaults are the API's, but max_tokens


@dataclass(frozen=True)
class GenerateOptions:
    """What `hotprefix generate` does with its prompts besides the engine's flags: how it
    samples and how it prints."""

    chat: bool = flag(False, "wrap each prompt as a user message in the chat template")
    max_tokens: int = flag(64, "the most tokens generated per sample")
    temperature: float = flag(_SAMPLING.temperature, "0 = greedy")
    top_p: float = flag(_SAMPLING.top_p, "sample from the most likely tokens whose probabilities add up to this")
    top_k: int = flag(_SAMPLING.top_k, "sample from the k most likely tokens (0 = all)")
    min_p: float = flag(_SAMPLING.min_p, "drop tokens less likely than this share of the most likely one")
    n: int = flag(_SAMPLING.n, "samples per prompt")
    sampling_seed: int | None = flag(_SAMPLING.seed, "per-request seed (reproducible sampling)")
    stop: tuple[str, ...] = flag(_SAMPLING.stop, "stop string (repeatable)", repeat=True)
    ignore_eos: bool = flag(False, "generate past the end-of-sequence token")
    json: bool = flag(False, "one JSON object per output")

    def sampling_params(self) -> SamplingParams:
        """These options as SamplingParams. Raises InvalidRequestError for values it refuses."""
        from hotprefix.errors import InvalidRequestError

        try:
            return SamplingParams(n=self.n, max_tokens=self.max_tokens, temperature=self.temperature, top_p=self.top_p,
                                  top_k=self.top_k, min_p=self.min_p, seed=self.sampling_seed, stop=self.stop,
                                  ignore_eos=self.ignore_eos)
        except ValueError as e:
            raise InvalidRequestError(str(e)) from None


def engine_config_from_args(a: argparse.Namespace) -> EngineConfig:
    """The EngineConfig of the engine flags given (serve's MODEL as --model). Raises ConfigError."""
    values = given(a, EngineConfig)
    tag = getattr(a, "model_tag", None)
    if tag and a.model and a.model != tag:
        raise ConfigError(f"two models given: {tag} and --model {a.model}")
    return build(EngineConfig, {**values, "model": tag} if tag else values)


def server_config_from_args(a: argparse.Namespace) -> ServerConfig:
    """The ServerConfig of the server flags given (-v: debug logging). Raises ConfigError."""
    return build(ServerConfig, {**given(a, ServerConfig), "log_level": "debug" if a.verbose else "info"})


def other_rank(config: EngineConfig) -> bool:
    """Under torchrun, a rank other than 0 (RANK): it follows rank 0 (engine/ranks.rank_main)
    until rank 0 stops, and says so. Raises PeerLostError when rank 0 is gone or never comes."""
    if config.model.tensor_parallel_size == 1:
        return False
    from hotprefix.engine.ranks import launch_of, rank_main

    launch = launch_of(config.model.tensor_parallel_size)
    if launch.place.rank == 0:
        return False
    rank_main(config, launch)
    return True


def cmd_serve(a: argparse.Namespace) -> int:
    import time

    log = logging.getLogger("hotprefix.server")
    for line in check_foreign(a):  # (raises ConfigError for a value that would change results)
        log.info(line)
    engine_config, server_config = engine_config_from_args(a), server_config_from_args(a)
    if other_rank(engine_config):
        return 0
    t0 = time.monotonic()
    with collector_paused() as started:
        log.info("starting: importing torch and the server")
        from hotprefix.server.launcher import runs_on_cpu, serve

        log.info("imported in %.1fs", time.monotonic() - t0)
        for line in inert_lines(a, engine_config, runs_on_cpu(engine_config)):
            log.info(line)
        return serve(engine_config, server_config, started)


@contextmanager
def collector_paused() -> Iterator[Callable[[], None]]:
    """Python's cycle collector off while the server starts, ended by the callable it
    yields (`serve` calls it once the engine is ready) or by leaving the block (a start
    that failed). Importing torch and the server and building the model make ~0.35 M
    tracked objects, which the collector scanned again and again (~0.3 s CPU of a 1B
    file's start); at the end they are frozen (gc.freeze: never scanned again) as they
    are, with the start's few garbage cycles (~0.7 MB, import-time functions and tuples):
    a full pass to free those would cost 0.13-0.19 s."""
    gc.disable()

    def started() -> None:
        if not gc.isenabled():
            gc.freeze()
            gc.enable()

    try:
        yield started
    finally:
        gc.enable()


def cmd_generate(a: argparse.Namespace) -> int:
    from hotprefix.engine.llm import LLM

    opts = build(GenerateOptions, given(a, GenerateOptions))
    params = opts.sampling_params()
    config = engine_config_from_args(a)
    if other_rank(config):
        return 0
    llm = LLM(config=config)
    prompts = a.prompt or [sys.stdin.read()]
    try:
        outs = (llm.chat([[{"role": "user", "content": p}] for p in prompts], params) if opts.chat
                else llm.generate(prompts, params))
    finally:
        llm.close()  # (the other tensor-parallel ranks stop)
    for o in outs:
        for c in o.outputs:
            if opts.json:
                print(json.dumps({"prompt": o.prompt, "index": c.index, "text": c.text,
                                  "token_ids": c.token_ids, "finish_reason": c.finish_reason,
                                  "prompt_tokens": len(o.prompt_token_ids),
                                  "completion_tokens": len(c.token_ids)}))
            else:
                print(c.text)
    return 0


def add_generate_parser(sub: argparse._SubParsersAction) -> None:
    g = sub.add_parser("generate", help="generate text for prompts on the command line (or stdin)",
                       description="Generate for each prompt with the offline engine and print the text.")
    g.add_argument("prompt", nargs="*", help="prompts (default: read one from stdin)")
    add_flags(g, GenerateOptions, EngineConfig)
    g.set_defaults(func=cmd_generate)


def add_serve_parser(sub: argparse._SubParsersAction) -> None:
    sv = sub.add_parser("serve", help="serve the OpenAI-compatible API",
                        description="Serve /v1/completions, /v1/chat/completions and friends over HTTP. vLLM's "
                                    "launch lines work: `hotprefix serve MODEL --max-model-len 4096 ...`.")
    sv.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                    help="the model, as vLLM takes it (the same as --model)")
    sv.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS, help="debug logging")
    sv.add_argument("--config", default=None, metavar="FILE",
                    help="a YAML file of flags (long names without dashes as keys); the command line wins")
    add_flags(sv, EngineConfig, ServerConfig, ForeignFlags)
    sv.set_defaults(func=cmd_serve)


def subparser(parser: argparse.ArgumentParser, command: str) -> argparse.ArgumentParser:
    """The parser of one sub-command of build_parser()'s."""
    sub = next(a for a in parser._actions if isinstance(getattr(a, "choices", None), dict) and command in a.choices)
    return sub.choices[command]


def serve_flags(parser: argparse.ArgumentParser) -> frozenset[str]:
    """The option strings of `hotprefix serve` (what a --config file may name)."""
    return frozenset(subparser(parser, "serve")._option_string_actions)


# the engine's own commands: their parsers need none of the tools' modules (whose imports,
# httpx, rich, prometheus_client and the gateway's, cost `hotprefix serve` ~0.1 s CPU)
ENGINE_COMMANDS = ("generate", "serve")


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The `hotprefix` parser: every sub-command, or only ENGINE_COMMANDS' when `command`
    is one of them (main() passes the command its command line names)."""
    import hotprefix

    p = argparse.ArgumentParser(prog="hotprefix", description="LLM inference built around a shared KV cache")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    p.add_argument("--version", action="version", version=f"hotprefix {hotprefix.__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    add_generate_parser(sub)
    add_serve_parser(sub)
    if command in ENGINE_COMMANDS:
        return p
    from hotprefix.gateway import cli as gateway_cli
    from hotprefix.tools import bench, lint, logs, size, watch

    for tool in (size, lint, logs, watch, bench):
        tool.add_parser(sub)
    gateway_cli.add_parsers(sub)
    return p


def named_command(argv: list[str]) -> str | None:
    """The sub-command a command line names: its first word that is not an option (the
    top-level options take no value)."""
    return next((w for w in argv if not w.startswith("-")), None)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(named_command(argv))
    try:
        argv = expand_config(argv, serve_flags(parser))
    except ConfigError as e:
        print(f"hotprefix: error: {e}", file=sys.stderr)
        return 2
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # the command's own usage (argparse alone prints the top-level one), then exit 2
        subparser(parser, args.command).error(f"unrecognized arguments: {' '.join(unknown)}")
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per HTTP call is noise here
    logging.getLogger("alembic").setLevel(logging.WARNING)  # a dozen lines per migration check
    from hotprefix.errors import InvalidRequestError, PeerLostError
    from hotprefix.model.arch import ModelLoadError

    try:
        return args.func(args)
    except (ModelLoadError, ConfigError, InvalidRequestError, PeerLostError) as e:
        print(f"hotprefix: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
