"""`hotprefix lint`: why prompts do not share their prefixes, and what fixing it would gain.

Prompts are tokenized exactly as the server would (same tokenizer and chat
template) and run, in order, through a model of the prefix cache that uses the
engine's own block hasher: a prompt hits the longest run of its leading full
blocks seen before, capped so its last token is computed; all its full blocks
are then cached (an unbounded cache, no eviction). For each prompt, the point
where it stops matching every earlier prompt is its break; volatile content
(timestamps, dates, UUIDs, ids, counters) whose span contains the break is
what broke sharing. The fix moves such content to the end of the prompt, then
checks again (a prompt may hold several); the hit rate after the fix is
predicted the same way.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hotprefix.config import ConfigError
from hotprefix.core.hashing import BlockHasher
from hotprefix.engine.tokenizer import PromptEncoder
from hotprefix.tools.jsonl import iter_objects

VOLATILE = [  # (kind, pattern), most specific first
    ("uuid", r"\b[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}\b"),
    ("timestamp", r"\b\d{4}-\d{2}-\d{2}[T ]\d{2}:\d{2}(?::\d{2}(?:\.\d+)?)?(?:Z|[+-]\d{2}:?\d{2})?"),
    ("date", r"\b\d{4}-\d{2}-\d{2}\b|\b\d{1,2}/\d{1,2}/\d{2,4}\b|\b(?:Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Oct|Nov|Dec)"
             r"[a-z]*\.? \d{1,2}(?:st|nd|rd|th)?,? \d{4}\b"),
    ("time", r"\b\d{1,2}:\d{2}(?::\d{2})?(?:\s?[AaPp][Mm])?\b"),
    ("unix_time", r"\b1[5-9]\d{8}(?:\d{3})?\b"),
    ("id", r"(?i)\b(?:req(?:uest)?|user|session|trace|msg|conv(?:ersation)?|order|account)(?:[_-]?id)?[\s:=#_-]+"
           r"(?=[A-Za-z0-9_-]*\d)[A-Za-z0-9][A-Za-z0-9_-]{3,}"),
    ("hex_id", r"\b[0-9a-fA-F]{12,}\b"),
    ("counter", r"\b\d+\b"),
]
_PATTERNS = [(k, re.compile(p)) for k, p in VOLATILE]


@dataclass
class Volatile:
    kind: str
    start: int
    end: int
    text: str


def find_volatile(text: str) -> list[Volatile]:
    """Non-overlapping volatile spans, the most specific kind winning."""
    taken: list[Volatile] = []
    for kind, pat in _PATTERNS:
        for m in pat.finditer(text):
            if not any(m.start() < v.end and v.start < m.end() for v in taken):
                taken.append(Volatile(kind, m.start(), m.end(), m.group()))
    return sorted(taken, key=lambda v: v.start)


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


@dataclass
class Simulation:
    hits: list[int] = field(default_factory=list)  # cached tokens per prompt
    lcps: list[int] = field(default_factory=list)  # tokens shared with some earlier prompt

    @property
    def total_hits(self) -> int:
        return sum(self.hits)


def simulate(prompts: list[list[int]], block_size: int) -> Simulation:
    """Run prompts in order through an unbounded prefix cache (the engine's rules)."""
    hasher = BlockHasher(block_size)
    seen: set[bytes] = set()
    trie = Trie()
    sim = Simulation()
    for ids in prompts:
        hashes = hasher.hashes_of(ids)
        cap = (len(ids) - 1) // block_size
        n = 0
        while n < min(cap, len(hashes)) and hashes[n] in seen:
            n += 1
        sim.hits.append(n * block_size)
        sim.lcps.append(trie.lcp_then_insert(ids))
        seen.update(hashes)
    return sim


@dataclass
class Request:
    body: dict[str, Any]
    text: str  # the prompt text as the model sees it
    ids: list[int]


def _texts(body: dict[str, Any]) -> list[tuple[str, str]]:
    """(location, text) of every editable text in a request body."""
    if "messages" in body:
        return [(f"messages.{i}", m.get("content") or "") for i, m in enumerate(body["messages"])
                if isinstance(m.get("content"), str)]
    return [("prompt", body["prompt"])] if isinstance(body.get("prompt"), str) else []


def _set_text(body: dict[str, Any], loc: str, text: str) -> None:
    if loc == "prompt":
        body["prompt"] = text
    else:
        body["messages"][int(loc.split(".")[1])]["content"] = text


def move_to_end(body: dict[str, Any], culprit: str) -> dict[str, Any]:
    """A copy of body with one occurrence of culprit moved from its text to the
    end of the last text (the end of the prompt): what stays in front is shared."""
    out = json.loads(json.dumps(body))
    texts = _texts(out)
    for loc, text in texts:
        i = text.find(culprit)
        if i >= 0:
            _set_text(out, loc, text[:i] + text[i + len(culprit):])
            break
    last_loc, last_text = _texts(out)[-1]
    _set_text(out, last_loc, f"{last_text}\n({culprit})")
    return out


class Linter:
    def __init__(self, encoder: PromptEncoder, block_size: int, chat_template: str | None = None) -> None:
        self.encoder = encoder
        self.block_size = block_size
        self.chat_template = chat_template

    def prepare(self, body: dict[str, Any]) -> Request:
        ids = self.encoder.encode_request(body, self.chat_template)
        return Request(body, self.encoder.decode(ids), ids)

    def culprits(self, reqs: list[Request], sim: Simulation) -> list[tuple[int, Volatile, int, int]]:
        """(request index, volatile span, break token, break char) for every prompt whose
        break falls inside a volatile span."""
        found = []
        for i, (r, lcp) in enumerate(zip(reqs, sim.lcps)):
            if i == 0 or lcp >= len(r.ids) - 1:
                continue
            # The first differing token spans [brk_char, brk_end) of the text; it may
            # start with the space before the volatile content.
            brk_char = len(self.encoder.decode(r.ids[:lcp]))
            brk_end = len(self.encoder.decode(r.ids[:lcp + 1]))
            for v in find_volatile(r.text):
                if v.start < max(brk_end, brk_char + 1) and brk_char < v.end:
                    found.append((i, v, lcp, brk_char))
                    break
        return found

    def fix(self, reqs: list[Request], rounds: int = 5) -> tuple[list[Request], set[str]]:
        """Move break-causing volatile content to the end of each prompt, round by
        round, keeping a round only if it raises the predicted hits. Returns the
        fixed requests and the kinds of content whose move helped."""
        helped: set[str] = set()
        hits = simulate([r.ids for r in reqs], self.block_size).total_hits
        for _ in range(rounds):
            found = self.culprits(reqs, simulate([r.ids for r in reqs], self.block_size))
            if not found:
                break
            by_req = {i: v for i, v, _, _ in found}
            # Prompts without a break of their own (the first one, say) carry the same
            # kind of content at about the same place: move it too.
            where: dict[str, list[int]] = {}
            for v in by_req.values():
                where.setdefault(v.kind, []).append(v.start)
            fixed = []
            for i, r in enumerate(reqs):
                v = by_req.get(i) or self._near(r.text, {k: statistics.median(p) for k, p in where.items()})
                fixed.append(self.prepare(move_to_end(r.body, v.text)) if v is not None else r)
            new_hits = simulate([r.ids for r in fixed], self.block_size).total_hits
            if new_hits <= hits:
                break
            reqs, hits = fixed, new_hits
            helped |= set(where)
        return reqs, helped

    @staticmethod
    def _near(text: str, positions: dict[str, float], slack: int = 64) -> Volatile | None:
        """The volatile span of a culprit kind closest to where that kind broke other prompts."""
        best = None
        for v in find_volatile(text):
            if v.kind in positions and abs(v.start - positions[v.kind]) <= slack:
                if best is None or abs(v.start - positions[v.kind]) < abs(best.start - positions[best.kind]):
                    best = v
        return best

    def report(self, bodies: list[dict[str, Any]]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        reqs = [self.prepare(b) for b in bodies]
        sim = simulate([r.ids for r in reqs], self.block_size)
        total = sum(len(r.ids) for r in reqs)
        fixed, helped = self.fix(reqs)
        found = [f for f in self.culprits(reqs, sim) if f[1].kind in helped]
        fsim = simulate([r.ids for r in fixed], self.block_size)
        waste = sum(min(lcp, len(r.ids) - 1) - h for r, lcp, h in zip(reqs, sim.lcps, sim.hits))
        kinds: dict[str, dict[str, Any]] = {}
        for i, v, brk, _ in found:
            k = kinds.setdefault(v.kind, {"kind": v.kind, "requests": 0, "examples": [], "break_tokens": []})
            k["requests"] += 1
            k["break_tokens"].append(brk)
            if len(k["examples"]) < 3:
                text = reqs[i].text
                k["examples"].append({"request": i, "snippet": v.text, "token_pos": brk, "char_pos": v.start,
                                      "context": text[max(0, v.start - 40):v.end + 40]})
        findings = [{**k, "median_break_token": statistics.median(k.pop("break_tokens"))} for k in kinds.values()]
        breaks = [{"request": i, "break_token": lcp, "prompt_tokens": len(r.ids),
                   "context": self.encoder.decode(r.ids[max(0, lcp - 8):lcp]) + " ⟂ "
                   + self.encoder.decode(r.ids[lcp:lcp + 8])}
                  for i, (r, lcp) in enumerate(zip(reqs, sim.lcps)) if i and lcp < len(r.ids) - 1]
        out = {
            "requests": len(reqs), "prompt_tokens": total, "block_size": self.block_size,
            "hit_rate_as_sent": sim.total_hits / total if total else 0.0,
            "hit_rate_if_fixed": fsim.total_hits / sum(len(r.ids) for r in fixed) if fixed else 0.0,
            "alignment_waste_tokens": waste, "alignment_waste_rate": waste / total if total else 0.0,
            "volatile_before_break": findings,
            "breaks": sorted(breaks, key=lambda b: b["break_token"])[:20],
        }
        return out, [r.body for r in fixed]


def render(r: dict[str, Any]) -> str:
    lines = [f"{r['requests']} requests, {r['prompt_tokens']} prompt tokens, block size {r['block_size']}",
             f"prefix-cache hit rate as sent:            {100 * r['hit_rate_as_sent']:5.1f} %",
             f"hit rate with volatile content moved:     {100 * r['hit_rate_if_fixed']:5.1f} %",
             f"shared tokens lost to block alignment:    {r['alignment_waste_tokens']} "
             f"({100 * r['alignment_waste_rate']:.1f} % of prompt tokens)"]
    if r["volatile_before_break"]:
        lines.append("\nvolatile content where sharing breaks:")
        for f in r["volatile_before_break"]:
            ex = f["examples"][0]
            lines.append(f"  {f['kind']:<10} in {f['requests']} requests, breaking at token "
                         f"~{f['median_break_token']:.0f}: {ex['snippet']!r} (request {ex['request']}, "
                         f"char {ex['char_pos']})")
            lines.append(f"             ...{ex['context']!r}...")
    if r["breaks"]:
        lines.append("\nearliest breaks (⟂ marks where a prompt stops matching every earlier one):")
        for b in r["breaks"][:5]:
            lines.append(f"  request {b['request']} at token {b['break_token']}/{b['prompt_tokens']}: {b['context']!r}")
    return "\n".join(lines)


def read_requests(path: Path) -> list[dict[str, Any]]:
    """OpenAI request bodies (or request-log rows with a `prompt`), one per line. Raises ConfigError."""
    out = []
    for i, row in iter_objects(path):
        if "messages" not in row and "prompt" not in row:
            raise ConfigError(f"{path}:{i}: neither `messages` nor `prompt`")
        out.append(row)
    if not out:
        raise ConfigError(f"{path}: no requests")
    return out


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("lint", help="find what breaks prefix sharing in a log of requests",
                       description="Read OpenAI request bodies (JSONL), tokenize them as the server would, and "
                                   "report where prefix sharing breaks and what volatile content breaks it.")
    p.add_argument("file", help="JSONL of request bodies ({'messages': ...} or {'prompt': ...})")
    p.add_argument("--model", default=None, help="model whose tokenizer and chat template to use (default: bundled)")
    p.add_argument("--chat-template", default=None, help="override the chat template (file or string)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--write-fixed", default=None, help="write the requests with volatile content moved here")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=run)


def load_encoder(model: str | None) -> PromptEncoder:
    """Only the tokenizer of a model (no weights)."""
    from hotprefix.model.loader import gguf_tokenizer, load_tokenizer, resolve_model

    path = resolve_model(model)
    return PromptEncoder(gguf_tokenizer(path) if path.is_file() else load_tokenizer(str(path)))


def run(a: argparse.Namespace) -> int:
    template = a.chat_template
    if template and Path(template).is_file():
        template = Path(template).read_text()
    linter = Linter(load_encoder(a.model), a.block_size, template)
    rep, fixed = linter.report(read_requests(Path(a.file)))
    if a.write_fixed:
        Path(a.write_fixed).write_text("".join(json.dumps(b) + "\n" for b in fixed))
    print(json.dumps(rep, indent=2, ensure_ascii=False) if a.json else render(rep))
    return 0
