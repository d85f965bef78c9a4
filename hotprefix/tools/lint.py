"""`hotprefix lint`: why prompts do not share their prefixes, and what fixing it would gain.

Input is a log of OpenAI request bodies, or the server's own request log
(`hotprefix serve --request-log FILE`): its rows carry, per prompt, the chain of
(keyed, salted) block hashes, the cached tokens the server measured and, with
`--request-log-prompts`, the rendered prompt text.

Prompts run, in arrival order, through a replay of the prefix cache that uses the
engine's own hasher, pool and eviction order (tools/cache_sim.py), of the size the
log states or the flags give (unbounded otherwise: the output says which). For
each prompt, the point where it stops matching every earlier prompt is its break;
volatile content (tools/volatile.py) whose span holds the break is what broke
sharing. The fix moves such content to the end of the prompt, round by round, and
keeps a round only if the predicted hit rate rises; it is idempotent.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import Counter, defaultdict
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

from hotprefix.config import ConfigError
from hotprefix.core.hashing import BlockHasher, CacheScope
from hotprefix.errors import InvalidRequestError
from hotprefix.server.log_lines import escape_controls
from hotprefix.server.request_log import MAX_BLOCK_SIZE, PrefixEntry
from hotprefix.sizing import blocks_for_tokens, max_cached_blocks
from hotprefix.tokenizers.prompt_encoder import PromptEncoder
from hotprefix.tools.cache_sim import CacheSize, Replay, SimRequest, replay
from hotprefix.tools.curve_cli import add_curve_arguments, run_curve
from hotprefix.tools.jsonl import MAX_LINE_BYTES, MAX_ROWS, json_text
from hotprefix.tools.lint_input import read_requests
from hotprefix.tools.volatile import Placement, Volatile, find_volatile, move, spans_of

MAX_ROUNDS = 8


class Trie:
    """Token sequences seen so far; longest common prefix with any of them."""

    def __init__(self) -> None:
        self.root: dict[int, dict] = {}

    def lcp_then_insert(self, ids: list[int]) -> int:
        node, n, matched = self.root, 0, True
        for t in ids:
            nxt = node.get(t)
            if nxt is None:
                matched = False
                nxt = node[t] = {}
            elif matched:
                n += 1
            node = nxt
        return n


def token_lcps(prompts: list[list[int]]) -> list[int]:
    """Per prompt, the tokens it shares with the longest-matching earlier prompt."""
    trie = Trie()
    return [trie.lcp_then_insert(ids) for ids in prompts]


@dataclass(frozen=True)
class LintRequest:
    """One prompt as lint sees it. body: what the fix edits (None when only hashes are
    known); ids/text: its tokens and their text (None likewise); sim: what the cache
    replay needs; measured: the cached tokens the server reported (log rows only);
    group: its prefix group (the first block's hash, hex; None under one block)."""

    body: dict[str, Any] | None
    ids: list[int] | None
    text: str | None
    sim: SimRequest
    measured: int | None = None
    logged_group: str | None = None  # the first block's digest in the server's log (as /prefix_groups names it)

    @property
    def tokens(self) -> int:
        return self.sim.prompt_tokens

    @property
    def group(self) -> str | None:
        if self.logged_group is not None:
            return self.logged_group
        return bytes(self.sim.hashes[0]).hex()[:16] if self.sim.hashes else None


@dataclass
class Finding:
    index: int
    span: Volatile
    break_token: int


class Linter:
    """Tokenizes as the server does (same tokenizer, template, hasher, block size) and
    replays through a cache of `size`."""

    def __init__(self, encoder: PromptEncoder, block_size: int, chat_template: str | None = None,
                 size: CacheSize | None = None) -> None:
        self.encoder = encoder
        self.block_size = block_size
        self.chat_template = chat_template
        self.size = size or CacheSize()
        self.hasher = BlockHasher(block_size)

    # -- inputs ------------------------------------------------------------------------
    def prepare(self, body: dict[str, Any], output_tokens: int = 1, measured: int | None = None) -> LintRequest:
        """A request body as the server would tokenize it (its cache salt included).
        Raises InvalidRequestError for a body the server would refuse."""
        ids = self.encoder.encode_request(body, self.chat_template)
        salt = body.get("cache_salt")
        scope = CacheScope(salt if isinstance(salt, str) else None, int(body.get("cache_salt_offset") or 0))
        hashes = self.hasher.hashes_of(ids, scope)
        return LintRequest(body, ids, self.encoder.decode(ids), SimRequest(hashes, len(ids), output_tokens),
                           measured)

    def from_log(self, entry: PrefixEntry) -> LintRequest:
        """One prompt of a request-log row. With its text (and a text that tokenizes back
        to as many tokens), a body the fix can edit; else hashes only."""
        out = entry.completion or 1
        group = entry.blocks[0] if entry.blocks and entry.tokens >= self.block_size else None
        if entry.text is not None:
            body: dict[str, Any] = {"prompt": entry.text, "add_special_tokens": False}
            if entry.salt:
                body |= {"cache_salt": entry.salt, "cache_salt_offset": entry.salt_offset}
            r = self.prepare(body, out, entry.cached)
            if r.tokens == entry.tokens:
                return replace(r, logged_group=group)
        hashes = [bytes.fromhex(h) for h in entry.blocks or ()]
        return LintRequest(None, None, None, SimRequest(hashes, entry.tokens, out), entry.cached, group)

    def from_log_entries(self, entries: list[PrefixEntry]) -> list[LintRequest]:
        """The prompts of a request log: all by their text when every one has a text that
        tokenizes back to its logged length, else all by their logged hashes (a replay
        cannot mix the two: the log's hashes are keyed)."""
        reqs = [self.from_log(e) for e in entries]
        if all(r.body is not None for r in reqs):
            return reqs
        return [self.from_log(replace(e, text=None)) for e in entries]

    # -- analysis ------------------------------------------------------------------------
    def run(self, reqs: list[LintRequest], size: CacheSize | None = None) -> Replay:
        return replay([r.sim for r in reqs], self.block_size, self._within(reqs, size or self.size))

    def _within(self, reqs: list[LintRequest], size: CacheSize) -> CacheSize:
        """`size` cut to the blocks the requests can ever hold (a pool or tier larger than that
        never evicts: the same replay, without allocating what a log says it had)."""
        if size.device_blocks is None:
            return size
        most = sum(blocks_for_tokens(r.sim.computed_tokens, self.block_size) for r in reqs) * len(size.windows) + 1
        return replace(size, device_blocks=min(size.device_blocks, most), host_blocks=min(size.host_blocks, most))

    def rate(self, reqs: list[LintRequest], size: CacheSize | None = None) -> float:
        return _share(self.run(reqs, size).total_hits, sum(r.tokens for r in reqs))

    def culprits(self, reqs: list[LintRequest]) -> list[Finding]:
        """For every prompt whose break falls inside a volatile span: that span (in the
        prompt's text) and the break's token position. Needs the prompts' text."""
        found = []
        lcps = token_lcps([r.ids or [] for r in reqs])
        for i, (r, lcp) in enumerate(zip(reqs, lcps)):
            if i == 0 or r.ids is None or r.text is None or lcp >= len(r.ids) - 1:
                continue
            # The first differing token spans [brk_char, brk_end) of the text; it may
            # start with the space before the volatile content.
            brk_char = len(self.encoder.decode(r.ids[:lcp]))
            brk_end = len(self.encoder.decode(r.ids[:lcp + 1]))
            for v in find_volatile(r.text):
                if v.start < max(brk_end, brk_char + 1) and brk_char < v.end:
                    found.append(Finding(i, v, lcp))
                    break
        return found

    def fix(self, reqs: list[LintRequest]) -> tuple[list[LintRequest], set[str]]:
        """Move break-causing volatile content to the end of each prompt, round by round,
        keeping a round only if it raises the predicted hit rate. Returns the fixed
        requests and the kinds whose move helped. Idempotent: fixing the result again
        changes nothing. Requests without text are returned as they are."""
        helped: set[str] = set()
        if any(r.body is None for r in reqs):
            return reqs, helped
        rate = self.rate(reqs)
        for _ in range(MAX_ROUNDS):
            found = self.culprits(reqs)
            if not found:
                break
            by_req = {f.index: f.span for f in found}
            where: dict[str, list[int]] = defaultdict(list)
            for v in by_req.values():
                where[v.kind].append(v.start)
            near = {k: statistics.median(p) for k, p in where.items()}
            spans = [by_req.get(i) or _near(r.text or "", near) for i, r in enumerate(reqs)]
            candidates = [[self._moved(r, v, place) for r, v in zip(reqs, spans)] for place in Placement]
            new_rate, best = max(((self.rate(c), c) for c in candidates), key=lambda rc: rc[0])
            if new_rate <= rate:
                break
            reqs, rate = best, new_rate
            helped |= set(where)
        return reqs, helped

    def _moved(self, r: LintRequest, v: Volatile | None, where: Placement) -> LintRequest:
        """r with the clause around v moved to `where` (r itself when v is None, is not in
        an editable text, or is placed already)."""
        if v is None or r.body is None:
            return r
        spot = next(((loc, s) for loc, s in spans_of(r.body) if s.kind == v.kind and s.text == v.text), None)
        if spot is None:
            return r
        body = move(r.body, *spot, where, self.encoder.special_tokens)
        return r if body is r.body else self.prepare(body, r.sim.output_tokens)

    def report(self, reqs: list[LintRequest]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """The findings (see render) and the fixed request bodies (empty without text)."""
        sim, unbounded = self.run(reqs), self.run(reqs, CacheSize())
        total = sum(r.tokens for r in reqs)
        fixed, helped = self.fix(reqs)
        found = [f for f in self.culprits(reqs) if f.span.kind in helped]
        measured = None if any(r.measured is None for r in reqs) else sum(r.measured or 0 for r in reqs)
        textual = all(r.ids is not None for r in reqs)
        lcps = token_lcps([r.ids or [] for r in reqs]) if textual else []
        waste = sum(min(lcp, r.tokens - 1) - h for r, lcp, h in zip(reqs, lcps, unbounded.hits))
        out = {
            "requests": len(reqs), "prompt_tokens": total, "block_size": self.block_size,
            "cache": self.size.describe(self.block_size), "cache_blocks": self.size.device_blocks,
            "host_blocks": self.size.host_blocks,
            "hit_rate_measured": None if measured is None else _share(measured, total),
            "hit_rate_as_sent": _share(sim.total_hits, total),
            "hit_rate_unbounded": _share(unbounded.total_hits, total),
            "hit_rate_if_fixed": self.rate(fixed) if textual else None,
            "hit_rate_if_fixed_unbounded": self.rate(fixed, CacheSize()) if textual else None,
            "requests_too_big": sim.too_big,
            "text": textual,
            "alignment_waste_tokens": waste, "alignment_waste_rate": _share(waste, total),
            "volatile_before_break": self._findings(reqs, found),
            "breaks": self._breaks(reqs, lcps),
            "groups": self._groups(reqs, sim, measured is not None),
        }
        return out, [r.body for r in fixed if r.body is not None] if textual else []

    def _findings(self, reqs: list[LintRequest], found: list[Finding]) -> list[dict[str, Any]]:
        kinds: dict[str, dict[str, Any]] = {}
        for f in found:
            k = kinds.setdefault(f.span.kind, {"kind": f.span.kind, "requests": 0, "examples": [], "breaks": []})
            k["requests"] += 1
            k["breaks"].append(f.break_token)
            if len(k["examples"]) < 3:
                text, v = reqs[f.index].text or "", f.span
                k["examples"].append({"request": f.index, "snippet": v.text, "token_pos": f.break_token,
                                      "char_pos": v.start, "context": text[max(0, v.start - 40):v.end + 40]})
        return [{**k, "median_break_token": statistics.median(k.pop("breaks"))} for k in kinds.values()]

    def _breaks(self, reqs: list[LintRequest], lcps: list[int]) -> list[dict[str, Any]]:
        """Where prompts stop matching every earlier one (lcps: token_lcps of their ids; none without text)."""
        rows = [{"request": i, "break_token": lcp, "prompt_tokens": r.tokens,
                 "context": self.encoder.decode((r.ids or [])[max(0, lcp - 8):lcp]) + " ⟂ "
                 + self.encoder.decode((r.ids or [])[lcp:lcp + 8])}
                for i, (r, lcp) in enumerate(zip(reqs, lcps)) if i and lcp < r.tokens - 1]
        return sorted(rows, key=lambda b: b["break_token"])[:20]

    def _groups(self, reqs: list[LintRequest], sim: Replay, measured: bool, top: int = 10) -> list[dict[str, Any]]:
        """The sharing structure: requests grouped by their first block, with where they
        broke off from every earlier request (block granularity, the rule of the server's
        /prefix_groups) and their hit rates (measured: whether the server's are known)."""
        groups: dict[str | None, dict[str, Any]] = {}
        for r, hit, shared in zip(reqs, sim.hits, sim.shared_blocks):
            g = groups.setdefault(r.group, {"group": r.group, "requests": 0, "prompt_tokens": 0, "predicted": 0,
                                            "measured": 0, "breaks": Counter()})
            g["requests"] += 1
            g["prompt_tokens"] += r.tokens
            g["predicted"] += hit
            g["measured"] += r.measured or 0
            if g["requests"] > 1 and shared < max_cached_blocks(r.tokens, self.block_size):
                g["breaks"][shared * self.block_size] += 1
        out = []
        for g in sorted(groups.values(), key=lambda g: -g["prompt_tokens"])[:top]:
            n = g["prompt_tokens"] or 1
            out.append({"group": g["group"], "requests": g["requests"], "prompt_tokens": g["prompt_tokens"],
                        "hit_rate_predicted": g["predicted"] / n,
                        "hit_rate_measured": g["measured"] / n if measured else None,
                        "breaks": [{"token": t, "requests": c} for t, c in g["breaks"].most_common(5)]})
        return out


def _share(part: int, total: int) -> float:
    return part / total if total else 0.0


def _near(text: str, positions: dict[str, float], slack: int = 64) -> Volatile | None:
    """The volatile span of a culprit kind closest to where that kind broke other prompts."""
    best = None
    for v in find_volatile(text):
        if v.kind in positions and abs(v.start - positions[v.kind]) <= slack:
            if best is None or abs(v.start - positions[v.kind]) < abs(best.start - positions[best.kind]):
                best = v
    return best


# -- output ------------------------------------------------------------------------------


def _pct(x: float | None) -> str:
    return "    -  " if x is None else f"{100 * x:5.1f} %"


def render(r: dict[str, Any]) -> str:
    lines = [f"{r['requests']} requests, {r['prompt_tokens']} prompt tokens, block size {r['block_size']}",
             f"assumed cache: {r['cache']}"]
    if r["hit_rate_measured"] is not None:
        lines.append(f"prefix-cache hit rate measured by the server: {_pct(r['hit_rate_measured'])}")
    lines += [f"prefix-cache hit rate as sent (predicted):    {_pct(r['hit_rate_as_sent'])}",
              f"  ... with an unbounded cache:                {_pct(r['hit_rate_unbounded'])}"]
    if r["hit_rate_if_fixed"] is not None:
        lines.append(f"hit rate with volatile content moved:        {_pct(r['hit_rate_if_fixed'])}")
        lines.append(f"shared tokens lost to block alignment:       {r['alignment_waste_tokens']} "
                     f"({100 * r['alignment_waste_rate']:.1f} % of prompt tokens)")
    else:
        lines.append("no prompt text in the log: start the server with --request-log-prompts to find the "
                     "volatile content and a fix")
    if r["requests_too_big"]:
        lines.append(f"{r['requests_too_big']} requests did not fit the assumed cache at all")
    if r["volatile_before_break"]:
        lines.append("\nvolatile content where sharing breaks:")
        for f in r["volatile_before_break"]:
            ex = f["examples"][0]
            lines.append(f"  {f['kind']:<10} in {f['requests']} requests, breaking at token "
                         f"~{f['median_break_token']:.0f}: {ex['snippet']!r} (request {ex['request']}, "
                         f"char {ex['char_pos']})")
            lines.append(f"             ...{ex['context']!r}...")
    if r["groups"]:
        lines.append("\nprefix groups (requests sharing a first block), largest first:")
        for g in r["groups"][:5]:
            brk = ", ".join(f"token {b['token']} ({b['requests']})" for b in g["breaks"][:3]) or "none"
            lines.append(f"  {g['group'] or '(under one block)':<18} {g['requests']:>5} requests, hit rate "
                         f"{_pct(g['hit_rate_predicted']).strip()} predicted"
                         + (f", {_pct(g['hit_rate_measured']).strip()} measured" if g["hit_rate_measured"]
                            is not None else "") + f"; breaks at {brk}")
    if r["breaks"]:
        lines.append("\nearliest breaks (⟂ marks where a prompt stops matching every earlier one):")
        for b in r["breaks"][:5]:
            lines.append(f"  request {b['request']} at token {b['break_token']}/{b['prompt_tokens']}: {b['context']!r}")
    return "\n".join(lines)


# -- reading ------------------------------------------------------------------------------


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("lint", help="find what breaks prefix sharing in a log of requests",
                       description="Read OpenAI request bodies or the server's request log (JSONL), replay them "
                                   "through the server's prefix cache, and report where sharing breaks, what "
                                   "volatile content breaks it, and the hit rate with it moved. The cache is "
                                   "the one the log states, else the one the flags give, else unbounded.")
    p.add_argument("file", nargs="?", help="JSONL of request bodies ({'messages': ...} or {'prompt': ...}) or "
                                           "a `hotprefix serve --request-log` file")
    p.add_argument("--url", default=None, help="read a live server's prefix groups (GET /prefix_groups) instead")
    p.add_argument("--api-key", default=None, help="the server's --api-key, for --url")
    p.add_argument("--model", default=None, help="model whose tokenizer and chat template to use (default: bundled)")
    p.add_argument("--chat-template", default=None, help="override the chat template (file or string)")
    p.add_argument("--block-size", type=int, default=None, help="tokens per block (default: the log's, else 16)")
    c = p.add_argument_group("the cache to simulate (default: the size the log states, else unbounded)")
    c.add_argument("--num-blocks", type=int, default=None, help="device KV blocks, as the server's pool")
    c.add_argument("--kv-cache-memory", default=None, help="bytes of KV cache (e.g. 2GiB), as serve's flag")
    c.add_argument("--kv-cache-dtype", default="float32", help="KV dtype for --kv-cache-memory and "
                                                                "--kv-offloading-size (float32, float16, fp8...)")
    c.add_argument("--kv-offloading-size", type=float, default=None, help="GiB of host KV tier, as serve's flag")
    c.add_argument("--host-blocks", type=int, default=None, help="host KV tier blocks")
    c.add_argument("--unbounded", action="store_true", help="assume a cache that never evicts")
    p.add_argument("--write-fixed", default=None, help="write the requests with volatile content moved here")
    p.add_argument("--max-line-bytes", type=int, default=MAX_LINE_BYTES,
                   help="a longer line of the file is an error (it is never read whole)")
    p.add_argument("--max-rows", type=int, default=MAX_ROWS, help="more rows in the file is an error")
    p.add_argument("--json", action="store_true")
    add_curve_arguments(p)
    p.set_defaults(func=run)


def load_encoder(model: str | None) -> PromptEncoder:
    """Only the tokenizer of a model (no weights)."""
    from hotprefix.model.loader import gguf_tokenizer, load_tokenizer, resolve_model

    path = resolve_model(model)
    return PromptEncoder(gguf_tokenizer(path) if path.is_file() else load_tokenizer(str(path)))


def cache_size(a: argparse.Namespace, block_size: int, logged: CacheSize | None,
               per_block: int | None = None) -> CacheSize:
    """The cache the flags ask for, else the log's, else unbounded (sizes in bytes count
    blocks of `per_block` bytes, else of --model's KV at --kv-cache-dtype). Raises ConfigError."""
    if a.unbounded:
        return CacheSize(source="--unbounded")
    layout = logged or _model_layout(a.model)
    if per_block is None and (a.kv_cache_memory is not None or a.kv_offloading_size is not None):
        from hotprefix.tools.size import kv_dtype, load_shape

        shape = load_shape(a.model)[1]  # a block: a page of one KV group's layers (a grouped pool)
        per_block = shape.pool_groups.page_bytes(shape.kv, kv_dtype(a.kv_cache_dtype), block_size)
    device = a.num_blocks
    if a.kv_cache_memory is not None and per_block:
        from hotprefix.config import parse_size

        device = parse_size(a.kv_cache_memory) // per_block
    host = a.host_blocks
    if a.kv_offloading_size is not None and per_block:
        host = int(a.kv_offloading_size * 2**30) // per_block
    try:
        if device is None and host is None:
            return logged or CacheSize(source="no size given", windows=layout.windows,
                                       retain_every=layout.retain_every)
        base = logged or CacheSize()
        return CacheSize(device if device is not None else base.device_blocks,
                         host if host is not None else base.host_blocks, "from the flags", layout.windows,
                         layout.retain_every)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _model_layout(model: str | None) -> CacheSize:
    """The pool's KV-cache groups serve would give --model (its retention interval serve's
    default), as a CacheSize of no blocks; one group for a model size cannot read (the
    tokenizer's load says what is wrong with it)."""
    from hotprefix.tools.size import RETAIN_EVERY, load_shape

    try:
        windows = load_shape(model)[1].pool_groups.windows
    except ConfigError:
        return CacheSize()
    return CacheSize(windows=windows, retain_every=RETAIN_EVERY)


def _template(a: argparse.Namespace) -> str | None:
    """--chat-template: a file's text, or the text given."""
    t = a.chat_template
    return Path(t).read_text() if t and Path(t).is_file() else t


def _sims(a: argparse.Namespace, bodies: list[dict[str, Any]], block_size: int) -> list[SimRequest]:
    """Request bodies as the cache sees them (the model's tokenizer and template)."""
    linter = Linter(load_encoder(a.model), block_size, _template(a))
    return [linter.prepare(b).sim for b in bodies]


def run(a: argparse.Namespace) -> int:
    if not (a.max_line_bytes >= 1 and a.max_rows >= 1):
        raise ConfigError("--max-line-bytes and --max-rows must be >= 1")
    if a.curve or a.plot:  # tools/curve_cli.py, with this tokenizer (for request bodies) and these cache flags
        return run_curve(a, partial(_sims, a), partial(cache_size, a))
    if a.url:
        from hotprefix.tools.lint_live import run_live

        return run_live(a.url, a.api_key, a.json)
    if not a.file:
        raise ConfigError("give a request file, or --url SERVER")
    data = read_requests(Path(a.file), a.max_line_bytes, a.max_rows)
    block_size = a.block_size or data.block_size or 16
    if not 1 <= block_size <= MAX_BLOCK_SIZE:
        raise ConfigError(f"--block-size must be in 1..{MAX_BLOCK_SIZE}, got {block_size}")
    linter = Linter(load_encoder(a.model), block_size, _template(a), cache_size(a, block_size, data.size))
    reqs = [_prepared(linter, a.file, line, b) for line, b in data.bodies] + linter.from_log_entries(data.entries)
    rep, fixed = linter.report(reqs)
    if a.write_fixed:
        Path(a.write_fixed).write_text("".join(json.dumps(b) + "\n" for b in fixed))
    print(json_text(rep) if a.json else render(rep))
    return 0


def _prepared(linter: Linter, path: str, line: int, body: dict[str, Any]) -> LintRequest:
    """A body of line `line` as the server would tokenize it. Raises ConfigError (one line,
    naming the line) for one the server would refuse."""
    try:
        return linter.prepare(body)
    except (InvalidRequestError, ValueError, TypeError) as e:
        raise ConfigError(f"{path}:{line}: a request the server would refuse: "
                          f"{escape_controls(str(e)) or type(e).__name__}") from None

