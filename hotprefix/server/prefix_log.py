"""What the request log and GET /prefix_groups say about prefix sharing, without prompt text.

Per prompt, the chain of its block hashes, each the engine's hash (salted per tenant
through the cache salt) passed through a keyed BLAKE2b and cut to 8 bytes: equal
blocks of one server (and of one log file across restarts) get equal digests, and a
digest reveals nothing about the text (a guess cannot be checked without the key).
The key is random per process, or kept next to the request log (`FILE.key`, 0600)
so that a log stays comparable across restarts.

PrefixGroups is the live view: requests grouped by their first block, with how often
and where (block position) they broke off from every earlier request, and what the
cache gave them. It is bounded: the most recent `max_hashes` block digests and
`max_groups` groups are kept.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import time
from collections import Counter, OrderedDict, deque
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from hotprefix.config import ConfigError
from hotprefix.engine.outputs import RequestOutput
from hotprefix.engine.requests import CacheScope
from hotprefix.server.request_log import KVShape, PrefixEntry
from hotprefix.sizing import max_cached_blocks

DIGEST_BYTES = 8


class LogKey:
    """The key of the block digests (see the module doc)."""

    def __init__(self, key: bytes) -> None:
        self.key = key

    @classmethod
    def for_log(cls, log_path: str | None) -> LogKey:
        """A random key, kept in LOG.key when there is a log (created 0600 once, whole or
        not at all, then reused). Raises ConfigError for a key file that is not one."""
        if log_path is None:
            return cls(secrets.token_bytes(32))
        path = Path(f"{log_path}.key")
        if not path.exists():
            key = secrets.token_bytes(32)
            tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
            tmp.unlink(missing_ok=True)  # a stale one (or a planted link: never written through)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(key.hex() + "\n")
            try:
                os.link(tmp, path)  # atomic, and never over a key another process just made
            except FileExistsError:
                pass
            finally:
                tmp.unlink()
        return cls(cls._read(path))

    @staticmethod
    def _read(path: Path) -> bytes:
        try:
            key = bytes.fromhex(path.read_text().strip())
        except (ValueError, OSError):
            key = b""
        if len(key) != 32:
            raise ConfigError(f"{path}: not a request-log key (64 hex digits); remove it to start a new one")
        return key

    def digest(self, data: bytes) -> str:
        return hashlib.blake2b(data, key=self.key, digest_size=DIGEST_BYTES).hexdigest()

    def digests(self, hashes: list[bytes]) -> list[str]:
        return [self.digest(h) for h in hashes]


@dataclass
class GroupStats:
    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    shared_tokens: int = 0  # what a cache that never evicts could have given (capped as the engine caps)
    breaks: Counter = field(default_factory=Counter)  # token position -> requests that broke off there
    last_use: float = 0.0  # unix time of its latest request
    blocks: int = 0  # full prompt blocks of its latest request
    text: str | None = None  # the start of its first prompt, only when the operator logs prompts


class PrefixGroups:
    """Live per-group sharing statistics (see the module doc). Lives on the event loop."""

    def __init__(self, block_size: int, max_hashes: int = 200_000, max_groups: int = 256) -> None:
        self.block_size = block_size
        self.max_hashes = max_hashes
        self.max_groups = max_groups
        self._seen: OrderedDict[str, None] = OrderedDict()
        self.groups: OrderedDict[str, GroupStats] = OrderedDict()
        self.requests = 0

    def observe(self, digests: list[str], prompt_tokens: int, cached_tokens: int, text: str | None = None) -> None:
        """One finished prompt: digests of its full blocks (prompt, then output), and the
        start of its text when prompts are logged. Mutates the view."""
        self.requests += 1
        group = digests[0] if digests and prompt_tokens >= self.block_size else "(under one block)"
        g = self.groups.get(group)
        if g is None:
            g = self.groups[group] = GroupStats()
            if len(self.groups) > self.max_groups:
                self.groups.popitem(last=False)
        self.groups.move_to_end(group)
        shared = 0
        while shared < len(digests) and digests[shared] in self._seen:
            shared += 1
        cap = max_cached_blocks(prompt_tokens, self.block_size)
        g.requests += 1
        g.last_use, g.blocks = time.time(), prompt_tokens // self.block_size
        if g.text is None and text is not None:
            g.text = text[:160]
        g.prompt_tokens += prompt_tokens
        g.cached_tokens += cached_tokens
        g.shared_tokens += min(shared, cap) * self.block_size
        if g.requests > 1 and shared < cap:
            g.breaks[shared * self.block_size] += 1
        for d in digests:
            self._seen[d] = None
            self._seen.move_to_end(d)
        while len(self._seen) > self.max_hashes:
            self._seen.popitem(last=False)

    def snapshot(self, top: int = 50) -> dict[str, Any]:
        """The view as JSON: groups with the most prompt tokens first."""
        rows = sorted(self.groups.items(), key=lambda kv: -kv[1].prompt_tokens)[:top]
        return {"block_size": self.block_size, "requests": self.requests, "groups": [
            {"group": k, "requests": g.requests, "prompt_tokens": g.prompt_tokens, "cached_tokens": g.cached_tokens,
             "hit_rate": g.cached_tokens / g.prompt_tokens if g.prompt_tokens else 0.0,
             "possible_hit_rate": g.shared_tokens / g.prompt_tokens if g.prompt_tokens else 0.0,
             "breaks": [{"token": t, "requests": c} for t, c in g.breaks.most_common(10)],
             "last_use": g.last_use, "blocks": g.blocks, **({"text": g.text} if g.text is not None else {})}
            for k, g in rows]}


class RecentPrompts:
    """The latest finished prompts' log entries, in the order they finished, with when:
    the traffic the dashboard's hit-rate curve replays (cachecurve/curve.py). Bounded by the
    block digests it holds and one for each entry (`max_blocks`: a prompt shorter than a
    block holds none, and counts); the oldest entries go first. Lives on the event loop;
    `snapshot` copies it for another thread."""

    def __init__(self, max_blocks: int = 200_000) -> None:
        self.max_blocks = max_blocks
        self.entries: deque[tuple[float, PrefixEntry]] = deque()
        self.blocks = 0
        self.added = 0  # entries ever added: a reader knows whether anything is new

    def add(self, entry: PrefixEntry, when: float) -> None:
        self.entries.append((when, entry))
        self.blocks += _cost(entry)
        self.added += 1
        while self.blocks > self.max_blocks and len(self.entries) > 1:
            self.blocks -= _cost(self.entries.popleft()[1])

    def snapshot(self) -> list[tuple[float, PrefixEntry]]:
        return list(self.entries)


def _cost(entry: PrefixEntry) -> int:
    """What an entry counts against RecentPrompts.max_blocks: its digests, and itself."""
    return len(entry.blocks or ()) + 1


@dataclass
class PrefixRecorder:
    """Turns finished prompts into request-log entries and feeds the live views (the
    prefix groups, the recent prompts). kv: the cache the server has, written in each
    log row (lint replays that size)."""

    key: LogKey
    groups: PrefixGroups
    kv: KVShape
    with_text: bool = False
    recent: RecentPrompts = field(default_factory=RecentPrompts)

    def entry(self, out: RequestOutput, scope: CacheScope, text: str | None) -> PrefixEntry:
        """The log entry of one engine request (its prompt); a finished one also feeds
        the live view. Its `blocks` are None when it did not finish (its hashes are unknown)."""
        tokens = len(out.prompt_token_ids)
        blocks = None
        if out.finished:
            blocks = tuple(self.key.digests(out.block_hashes))
            self.groups.observe(list(blocks), tokens, out.num_cached_tokens, text if self.with_text else None)
        salt = None if scope.salt is None else self.key.digest(scope.salt.encode())
        entry = PrefixEntry(tokens, out.num_cached_tokens, len(out.outputs[0].token_ids) if out.outputs else 0,
                            blocks, salt, scope.offset if salt is not None else 0,
                            text if self.with_text else None)
        if blocks is not None:
            self.recent.add(replace(entry, text=None), time.time())
        return entry
