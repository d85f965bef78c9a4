"""`hotprefix lint LOG --curve` (and `--url SERVER --curve`, `--plot FILE`): the hit-rate
curve of a log (hotprefix/cachecurve), printed in words or as JSON, drawn as SVG.

A request log (tools/curve_log.py) gives each prompt's block digests, its tenant and the
cache the server had: its pool is marked and its host tier replayed, unless lint's cache
flags say otherwise; the bytes of a block come from the log, else from --model and
--kv-cache-dtype. Request bodies are tokenized with lint's tokenizer (given in).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hotprefix.cachecurve.advice import advise, to_json
from hotprefix.cachecurve.curve import Curve, Options, build
from hotprefix.cachecurve.request import SimRequest
from hotprefix.config import ConfigError
from hotprefix.tools.cache_sim import CacheSize
from hotprefix.tools.curve_log import LogTraffic, read_log
from hotprefix.tools.curve_report import render

Tokenize = Callable[[list[dict[str, Any]], int], list[SimRequest]]  # request bodies, block size -> requests
Sizes = Callable[[int, CacheSize | None, int], CacheSize]  # block size, the log's cache, bytes a block -> the cache


def add_curve_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("the hit-rate curve")
    g.add_argument("--curve", action="store_true",
                   help="the hit rate and the prefill tokens saved at every pool size (and with the host tier the "
                        "log or the flags give), the pool that reaches 95 %% of an unbounded cache's rate, per tenant")
    g.add_argument("--plot", metavar="FILE", default=None, help="write the curve as SVG (implies --curve)")
    g.add_argument("--sample", type=float, default=None, metavar="RATE",
                   help="keep this share of the blocks, by hash (default: all, unless they do not fit in memory)")
    g.add_argument("--checks", type=int, default=3, metavar="N",
                   help="replays of the engine's policy that check the one-pass curve (default 3)")


@dataclass(frozen=True)
class LogCurve:
    """A curve with what it was read with: the bytes of a block (None: unknown) and where
    they came from, and the server's pool (None: not stated)."""

    curve: Curve
    per_block: int | None
    bytes_from: str
    pool: int | None

    def to_json(self) -> dict[str, Any]:
        return to_json(self.curve, advise(self.curve, self.per_block, self.pool), self.per_block)


def block_bytes(kv_bytes: int | None, model: str | None, dtype: str, block_size: int) -> tuple[int, str]:
    """The bytes of a block: the log's, else the model's KV at dtype; and where they came from."""
    if kv_bytes is not None:
        return kv_bytes, " (from the log)"
    from hotprefix.tools.size import kv_dtype, load_shape

    name, shape = load_shape(model)
    return (shape.kv.bytes_per_block(kv_dtype(dtype), block_size),
            f" ({name}'s KV in {dtype}: --model and --kv-cache-dtype say otherwise)")


def log_curve(a: argparse.Namespace, tokenize: Tokenize, sizes: Sizes) -> LogCurve:
    """The curve of the log a.file, with lint's flags. Raises ConfigError."""
    log = read_log(Path(a.file), a.max_line_bytes, a.max_rows)
    kv = log.kv
    if log.reqs and a.block_size and kv and a.block_size != kv.block_size:
        raise ConfigError(f"{a.file}: its hashes are of {kv.block_size}-token blocks; they cannot be replayed as "
                          f"{a.block_size}-token blocks (leave --block-size out)")
    if not log.reqs and not log.bodies:
        raise ConfigError(f"{a.file}: no requests")
    block_size = kv.block_size if kv else a.block_size or 16
    per_block, source = block_bytes(kv.block_bytes if kv else None, a.model, a.kv_cache_dtype, block_size)
    size = sizes(block_size, CacheSize(kv.blocks, kv.host_blocks, "from the log") if kv else None, per_block)
    reqs, tenants = _requests(log, tokenize, block_size)
    try:
        opts = Options(size.host_blocks, (size.device_blocks,) if size.device_blocks else (), a.checks, a.sample)
        return LogCurve(build(reqs, tenants, block_size, log.span_s, opts), per_block, source, size.device_blocks)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _requests(log: LogTraffic, tokenize: Tokenize, block_size: int) -> tuple[list[SimRequest], list[str | None]]:
    if not log.bodies:
        return log.reqs, log.tenants
    salts = [b.get("cache_salt") for b in log.bodies]
    return tokenize(log.bodies, block_size), [s if isinstance(s, str) else None for s in salts]


def run_curve(a: argparse.Namespace, tokenize: Tokenize, sizes: Sizes) -> int:
    if a.url:
        return run_live(a)
    if not a.file:
        raise ConfigError("give a request file, or --url SERVER")
    lc = log_curve(a, tokenize, sizes)
    emit(lc.to_json(), a, lc.bytes_from)
    return 0


def emit(js: dict[str, Any], a: argparse.Namespace, how: str = "") -> None:
    """Print the curve (text or JSON) and write its picture when asked."""
    if a.plot:
        from hotprefix.tools.curve_svg import svg

        try:
            Path(a.plot).write_text(svg(js))
        except OSError as e:
            raise ConfigError(f"cannot write {a.plot}: {e.strerror}") from None
    print(json.dumps(js, indent=2) if a.json else render(js, how))


def run_live(a: argparse.Namespace) -> int:
    """The curve the server computes over its recent traffic (in /dashboard/data)."""
    from hotprefix.tools.lint_live import fetch

    js = fetch(a.url, a.api_key, path="/dashboard/data").get("curve")
    if not js:
        raise ConfigError(f"{a.url} has no curve yet: it needs prefix caching and a finished request")
    emit(js, a, " (the server's)")
    return 0
