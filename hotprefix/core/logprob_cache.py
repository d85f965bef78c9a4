"""Prompt logprobs kept with the blocks they were computed over, so that a scoring
request (prompt_logprobs; echo with logprobs) starts from cached blocks too.

A request asking for its prompt's logprobs needs every prompt position's logits: a block
taken from the prefix cache skips them. So it takes a cached block only where the
logprobs that block's positions give are known: already recorded on the request (after
a preemption), or kept here. Block b's positions (b*bs .. (b+1)*bs - 1) score prompt
tokens b*bs + 1 .. (b+1)*bs: a function of the block's hash (its scope and every token
up to its end) and of the next block's first token, which together are the key. On the
batch-invariant path (docs/engine.md) a kept value is the same bits the request would
compute; elsewhere it differs from a recomputation only as a cached block's KV does.

Bounded: the least recently used entries go beyond MAX_LOGPROBS values (one per target
token, plus its top alternatives). Engine thread only.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from hotprefix.core.hashing import BlockHash
from hotprefix.core.request import Request
from hotprefix.sampling_params import TokenLogprobs

MAX_LOGPROBS = 1 << 19  # Logprob values kept (~100 bytes each)


@dataclass(frozen=True)
class _Entry:
    k: int  # alternatives kept per position
    values: tuple[TokenLogprobs, ...]  # targets b*bs + 1 .. (b+1)*bs

    @property
    def size(self) -> int:
        return len(self.values) * (1 + self.k)


class PromptLogprobCache:
    """Maps (block hash, next token) to the logprobs of the tokens a block's positions
    score. `reach` and `fill` read it for a request being admitted; `store` keeps what a
    step computed."""

    def __init__(self, block_size: int, max_values: int = MAX_LOGPROBS) -> None:
        self.block_size = block_size
        self.max_values = max_values
        self.num_values = 0
        self._entries: OrderedDict[tuple[BlockHash, int], _Entry] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        self._entries.clear()
        self.num_values = 0

    def _key(self, req: Request, b: int) -> tuple[BlockHash, int] | None:
        nxt = (b + 1) * self.block_size  # the last target: the next block's first token
        if nxt >= req.num_prompt_tokens or b >= len(req.block_hashes):
            return None
        return req.block_hashes[b], req.prompt_token_ids[nxt]

    def _targets(self, b: int) -> range:
        return range(b * self.block_size + 1, (b + 1) * self.block_size + 1)

    def _get(self, req: Request, b: int) -> _Entry | None:
        key = self._key(req, b)
        e = self._entries.get(key) if key is not None else None
        if e is None or e.k < (req.sampling_params.prompt_logprobs or 0):
            return None
        self._entries.move_to_end(key)
        return e

    def reach(self, req: Request, max_blocks: int) -> int:
        """How many of the request's first `max_blocks` blocks it may take from the prefix
        cache: all for a request that needs no prompt logprobs there, else up to the first
        block whose needed logprobs are neither recorded nor kept. Reads req.block_hashes."""
        if req.prompt_logprobs is None:
            return max_blocks
        for b in range(max_blocks):
            if any(req.needs_prompt_logprob(p) for p in self._targets(b)) and self._get(req, b) is None:
                return b
        return max_blocks

    def fill(self, req: Request, num_blocks: int) -> None:
        """Record the kept logprobs of the request's first `num_blocks` blocks on it (the
        blocks it took from the cache; `reach` said they are there)."""
        k = req.sampling_params.prompt_logprobs or 0
        for b in range(num_blocks):
            if not any(req.needs_prompt_logprob(p) for p in self._targets(b)):
                continue
            e = self._get(req, b)
            if e is None:
                raise KeyError(f"{req.request_id}: block {b}'s prompt logprobs are not kept")
            req.record_prompt_logprobs(b * self.block_size + 1,
                                       [TokenLogprobs(v.sampled, v.top[:k]) for v in e.values])

    def store(self, req: Request, first: int, count: int) -> None:
        """Keep the logprobs of every block whose targets the request now has, among
        those that targets first .. first + count - 1 (just recorded) belong to."""
        lps, k, bs = req.prompt_logprobs, req.sampling_params.prompt_logprobs or 0, self.block_size
        if lps is None or count <= 0:
            return
        for b in range((first - 1) // bs, (first + count - 2) // bs + 1):
            key = self._key(req, b)
            if key is None:
                continue
            old = self._entries.get(key)
            values = tuple(lps[p] for p in self._targets(b))
            if (old is not None and old.k >= k) or any(v is None for v in values):
                continue
            self._put(key, _Entry(k, values))

    def _put(self, key: tuple[BlockHash, int], e: _Entry) -> None:
        old = self._entries.pop(key, None)
        self.num_values += e.size - (old.size if old is not None else 0)
        self._entries[key] = e
        while self.num_values > self.max_values and self._entries:
            self.num_values -= self._entries.popitem(last=False)[1].size
