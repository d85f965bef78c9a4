"""`hotprefix size`: KV-cache memory for a model, a prompt pool and a concurrency.

Shares sizing.py with the engine: the numbers here are the ones the engine uses
to size its pool. With --from-log, the hit-rate curve of a server's request log
(hotprefix/cachecurve) answers beside the formula: the pool that reaches 95 % of the
hit rate an unbounded cache would give that traffic, in each dtype's bytes.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from hotprefix.cachecurve.advice import TARGET, Size, advise, to_json
from hotprefix.cachecurve.curve import Options, build
from hotprefix.config import CacheConfig, ConfigError, parse_size
from hotprefix.model.arch import ModelLoadError, arch_from_hf_config
from hotprefix.model.presets import PRESETS
from hotprefix.sizing import DTYPE_BYTES, ModelShape, SizeReport, size_report
from hotprefix.tools.curve_log import read_log
from hotprefix.tools.curve_report import render

RETAIN_EVERY = CacheConfig.__dataclass_fields__["kv_window_retain_interval"].default  # serve's default
DTYPES = ("float32", "float16", "bfloat16", "fp8")  # serve's --kv-cache-dtype names
SHORT = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}  # older spellings, still accepted


def kv_dtype(name: str) -> str:
    """A --kv-cache-dtype name as serve spells it (fp32/fp16/bf16 accepted too)."""
    name = SHORT.get(name, name)
    if name not in DTYPES:
        raise argparse.ArgumentTypeError(f"choose from {', '.join(DTYPES)}")
    return name


def shape_of_config(cfg: dict) -> ModelShape:
    """The shape of a config.json, read by the parser serve uses (so size refuses what
    serve refuses). Raises ConfigError."""
    try:
        return arch_from_hf_config(cfg).shape
    except ModelLoadError as e:
        raise ConfigError(str(e)) from None


def load_shape(source: str | None) -> tuple[str, ModelShape]:
    """A model's shape from a preset name, a config.json, a HF folder, a GGUF
    file, a hub id (config.json only is downloaded), or None for the default
    model. Raises ConfigError with a one-line message."""
    if source is None:
        return "smollm2-135m", shape_of_config(PRESETS["smollm2-135m"])
    if source.lower() in PRESETS:
        return source.lower(), shape_of_config(PRESETS[source.lower()])
    p = Path(source).expanduser()
    if p.is_dir():
        p = p / "config.json"
    if p.suffix == ".gguf" and p.is_file():
        from hotprefix.model.gguf_loader import read_gguf_arch

        a, _ = read_gguf_arch(p)
        return p.stem, a.shape
    if p.is_file():
        try:
            return p.parent.name or p.name, shape_of_config(json.loads(p.read_text()))
        except json.JSONDecodeError as e:
            raise ConfigError(f"{p}: invalid JSON ({e})") from None
        except ConfigError as e:
            raise ConfigError(f"{p}: {e}") from None
    if source.count("/") == 1 and not source.startswith((".", "/", "~")):
        try:
            from huggingface_hub import hf_hub_download

            cfg = hf_hub_download(source, "config.json")
        except Exception as e:  # network, 404, auth
            raise ConfigError(f"cannot download the config of {source!r}: {type(e).__name__}") from None
        return source, shape_of_config(json.loads(Path(cfg).read_text()))
    raise ConfigError(f"not a preset ({', '.join(PRESETS)}), file, folder or hub id: {source}")


def _human(n: int | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return str(n)


def _tier(blocks: int, prompts: int, block_size: int, grouped: bool) -> str:
    """A tier's room: its tokens (one group: a block is a block of every layer; a grouped
    pool's blocks are one group's pages: said as blocks) and the prompts it holds."""
    if not blocks:
        return "-"
    room = f"{blocks:,} blocks" if grouped else f"{blocks * block_size:,} tokens"
    return f"{room}, {prompts:,} prompts"


def render_table(name: str, shape: ModelShape, reports: list[SizeReport], weight_bytes: int,
                 from_log: list[Size] | None = None) -> str:
    groups = shape.pool_groups
    page = f"; a page of {groups.page_layers} layers, every group's" if len(groups.windows) > 1 else ""
    rows = [
        ("bytes per token", lambda r: f"{r.bytes_per_token:,} ({_human(r.bytes_per_token)})"),
        (f"bytes per token of each KV group ({len(groups.windows)} groups)",
         lambda r: f"{r.bytes_per_token * groups.page_layers // shape.num_layers:,}"),
        (f"bytes per block ({reports[0].block_size} tokens{page})", lambda r: f"{r.bytes_per_block:,}"),
        (f"bytes per prompt ({reports[0].prompt_tokens} tokens)", lambda r: _human(r.bytes_per_prompt)),
        (f"prompt pool ({reports[0].num_prompts} prompts)",
         lambda r: f"{_human(r.pool_bytes)} ({r.pool_blocks} blocks)"),
        ("KV budget", lambda r: _human(r.budget_bytes)),
        ("blocks in budget", lambda r: "-" if r.blocks_in_budget is None else f"{r.blocks_in_budget:,}"),
        (f"blocks needed (pool + {reports[0].concurrency} x {reports[0].max_model_len}-token requests)",
         lambda r: f"{r.blocks_needed:,}"),
        *([("95 % of the log's unbounded hit rate (its blocks)", lambda r: _logged(from_log, reports.index(r)))]
          if from_log else []),
        ("fits with zero eviction", lambda r: "-" if r.fits_without_eviction is None
         else ("yes" if r.fits_without_eviction else "NO")),
        (f"max concurrency at {reports[0].max_model_len} tokens (pool shared)",
         lambda r: "-" if r.max_concurrency is None else str(r.max_concurrency)),
        ("max concurrency, nothing shared", lambda r: "-" if r.max_concurrency_unshared is None
         else str(r.max_concurrency_unshared)),
        (f"one {reports[0].max_model_len}-token sequence in KV groups, {reports[0].retained_tails} tails kept "
         "(as the grouped pool holds it; tails kept in line, not held)",
         lambda r: f"{_human(r.sequence_bytes)} ({r.sequence_bytes / max(r.sequence_bytes_full, 1):.0%} of all-full)"),
        ("host tier (--kv-offloading-size)",
         lambda r: _tier(r.host_tier_blocks, r.host_tier_prompts, r.block_size, bool(page))),
        ("disk tier (--kv-disk-size)",
         lambda r: _tier(r.disk_tier_blocks, r.disk_tier_prompts, r.block_size, bool(page))),
    ]
    windows = ", ".join(sorted({"full" if w is None else f"window {w}" for w in groups.windows}))
    head = (f"{name}: {shape.num_layers} layers, {shape.num_kv_heads} KV heads x {shape.head_dim} dims "
            f"({shape.num_heads} query heads); ~{shape.num_params() / 1e9:.2f} B parameters, "
            f"weights {_human(weight_bytes)}; {len(groups.windows)} KV groups of {groups.page_layers} layers "
            f"({windows})")
    if shape.moe_layers:
        active = shape.num_params(active=True)
        head += (f"; {shape.num_experts} experts, {shape.experts_per_token} a token: ~{active / 1e9:.2f} B "
                 f"parameters read per token ({_human(weight_bytes * active // shape.num_params())})")
    w = max(len(label) for label, _ in rows)
    cols = [r.dtype for r in reports]
    cells = [[fn(r) for r in reports] for _, fn in rows]
    cw = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
    lines = [head, "", " " * w + "  " + "  ".join(c.rjust(cw[i]) for i, c in enumerate(cols))]
    for (label, _), row in zip(rows, cells):
        lines.append(label.ljust(w) + "  " + "  ".join(v.rjust(cw[i]) for i, v in enumerate(row)))
    return "\n".join(lines)


def _logged(sizes: list[Size], i: int) -> str:
    s = sizes[i]
    return f"{s.flag} ({s.blocks:,} blocks)" if s.flag else f"{s.blocks:,} blocks"


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("size", help="KV-cache memory for a model, a prompt pool and a concurrency",
                       description="How much KV memory prompts and requests take, and what fits.")
    p.add_argument("model", nargs="?", default=None,
                   help=f"preset ({', '.join(PRESETS)}), config.json, HF folder, .gguf file or hub id "
                        "(default: the bundled SmolLM2-135M)")
    p.add_argument("--kv-cache-dtype", "--dtype", action="append", type=kv_dtype, dest="dtype", metavar="DTYPE",
                   help=f"KV dtype as serve names it: {', '.join(DTYPES)} (repeatable; default: all)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--prompt-tokens", type=int, default=1000, help="tokens of each distinct (shared) prompt")
    p.add_argument("--num-prompts", type=int, default=1, help="distinct prompts to keep cached")
    p.add_argument("--concurrency", type=int, default=1, help="requests running at once")
    p.add_argument("--max-model-len", type=int, default=None, help="tokens per request (default: the model's)")
    p.add_argument("--kv-cache-memory", "--memory", dest="memory", default=None,
                   help="total memory, e.g. 80GiB (a GPU's) or the CPU share for KV")
    p.add_argument("--gpu-memory-utilization", "--utilization", dest="utilization", type=float, default=0.9,
                   help="share of --kv-cache-memory the server may use (serve's --gpu-memory-utilization)")
    p.add_argument("--weights", default=None,
                   help="weight bytes to subtract, all devices' (default: parameters x --weight-dtype bytes)")
    p.add_argument("--weight-dtype", type=kv_dtype, default="bfloat16", metavar="DTYPE",
                   help=f"bytes per weight: {', '.join(DTYPES)} (default bfloat16)")
    p.add_argument("--kv-offloading-size", type=float, default=0.0,
                   help="GiB of the host KV tier (serve's flag): what it holds in tokens and prompts")
    p.add_argument("--kv-disk-size", type=float, default=0.0,
                   help="GiB of the disk KV tier (serve's flag): what it holds in tokens and prompts")
    p.add_argument("--kv-window-retain-interval", "--retain-every", dest="retain_every", type=int,
                   default=RETAIN_EVERY,
                   help="a window model's grouped pool keeps a window tail every this many tokens (serve's flag; "
                        "default: serve's): the prompts' and the sequence's window blocks")
    p.add_argument("--from-log", metavar="LOG", default=None,
                   help="a `serve --request-log` file: the pool that reaches 95 %% of the hit rate an unbounded cache "
                        "would give its traffic (its hit-rate curve), beside the formula's answer")
    p.add_argument("-tp", "--tensor-parallel-size", dest="tp", type=int, default=1,
                   help="ranks the model is split over (serve's flag): weights, KV and memory per device")
    p.add_argument("--json", action="store_true", help="JSON instead of a table")
    p.set_defaults(func=run)


def per_device(name: str, shape: ModelShape, tp: int) -> tuple[str, ModelShape]:
    """The name and shape of what one of tp ranks holds. Raises ConfigError for a shape that does not split."""
    if tp < 1:
        raise ConfigError(f"--tensor-parallel-size must be >= 1, got {tp}")
    try:
        return (name if tp == 1 else f"{name} (one device of {tp})"), shape.per_device(tp)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def run(a: argparse.Namespace) -> int:
    name, shape = per_device(*load_shape(a.model), a.tp)
    weights = parse_size(a.weights) // a.tp if a.weights else shape.num_params() * DTYPE_BYTES[a.weight_dtype]
    budget = None if a.memory is None else int(parse_size(a.memory) * a.utilization) - weights
    reports = [size_report(shape, dt, a.block_size, a.prompt_tokens, a.num_prompts, a.concurrency,
                           a.max_model_len, budget, int(a.kv_offloading_size * 2**30), int(a.kv_disk_size * 2**30),
                           a.retain_every)
               for dt in (a.dtype or DTYPES)]
    logged = LoggedCurve.read(Path(a.from_log), shape, [r.dtype for r in reports]) if a.from_log else None
    if a.json:
        active = weights * shape.num_params(active=True) // shape.num_params()
        print(json.dumps({"model": name, "shape": asdict(shape), "weight_bytes": weights,
                          "active_weight_bytes": active, "reports": [asdict(r) for r in reports],
                          **({"from_log": logged.to_json()} if logged else {})}, indent=2))
    else:
        print(render_table(name, shape, reports, weights, logged.sizes if logged else None))
        if logged:
            print(f"\nfrom {a.from_log}:\n{render(logged.js)}")
    return 0


@dataclass(frozen=True)
class LoggedCurve:
    """A request log's curve (its own blocks: the log's block size, the bytes of the
    log's server) and its recommendation in each dtype's bytes (at the log's block size)."""

    js: dict[str, Any]
    sizes: list[Size]
    dtypes: list[str]

    @classmethod
    def read(cls, path: Path, shape: ModelShape, dtypes: list[str]) -> LoggedCurve:
        """Raises ConfigError for a file that is not a request log with block hashes."""
        log = read_log(path)
        if log.bodies or not log.reqs:
            raise ConfigError(f"{path}: no request-log rows with block hashes (`serve --request-log` with prefix "
                              "caching writes them)")
        bs = log.kv.block_size if log.kv else 16
        kv = log.kv
        curve = build(log.reqs, log.tenants, bs, log.span_s,
                      Options(kv.host_blocks if kv else 0, (kv.blocks,) if kv else ()))
        per_block = kv.block_bytes if kv else None
        js = to_json(curve, advise(curve, per_block, kv.blocks if kv else None), per_block)
        p95 = curve.pool_for(TARGET) or 0
        return cls(js, [Size.of(p95, shape.kv.bytes_per_block(dt, bs)) for dt in dtypes], dtypes)

    def to_json(self) -> dict[str, Any]:
        return {"curve": self.js, "recommended": {dt: asdict(s) for dt, s in zip(self.dtypes, self.sizes)}}
