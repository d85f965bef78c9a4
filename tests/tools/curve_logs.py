"""Logs for the hit-rate curve's tests, seeded (the same every run): requests as the cache
sees them (hashed chains: shared system prompts, growing chats, exact repeats, requests of
every size) and the server's request-log rows that carry them."""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path

from hotprefix.cachecurve.request import SimRequest
from hotprefix.server.request_log import KVShape, LogRow, LogStatus, PrefixEntry


def chain(parts: list[object], salt: str = "") -> list[bytes]:
    """Block hashes of a chain whose blocks hold `parts` (each block's hash names its prefix)."""
    h, out = salt.encode(), []
    for p in parts:
        h = hashlib.blake2b(h + repr(p).encode(), digest_size=8).digest()
        out.append(h)
    return out


def chats(n: int, seed: int, bs: int, convs: int = 8, systems: int = 3, repeat: float = 0.0,
          tenants: int = 1) -> tuple[list[SimRequest], list[str | None]]:
    """Chats over a few system prompts (interleaved), prompts of every length modulo the
    block size, outputs of 0 to 3 blocks, some hashes past the computed tokens or missing,
    and with `repeat` the share of requests sent again as they were (or with another output)."""
    rng = random.Random(seed)
    system = [[("s", s, j) for j in range(rng.randint(1, 12))] for s in range(systems)]
    history: dict[int, list[object]] = {}
    reqs: list[SimRequest] = []
    who: list[str | None] = []
    for i in range(n):
        if reqs and rng.random() < repeat:
            j = rng.randrange(max(0, len(reqs) - 6), len(reqs))
            r = reqs[j]
            reqs.append(r if rng.random() < 0.5 else SimRequest(r.hashes, r.prompt_tokens, rng.randint(0, 40)))
            who.append(who[j])
            continue
        c = rng.randrange(convs)
        h = history.setdefault(c, list(system[rng.randrange(systems)]))
        h += [("u", c, i, j) for j in range(rng.randint(1, 6))]
        p = max(1, len(h) * bs - rng.randrange(bs))
        out = rng.choice([0, 1, 1, 2, 5, bs, 3 * bs + 1])
        full = (p + max(out, 1) - 1) // bs
        tenant = f"t{c % tenants}" if tenants > 1 else None
        hashes = chain(h + [("o", c, i, j) for j in range(full + 1)], tenant or "")
        reqs.append(SimRequest(hashes[:rng.choice([full, full, full + 1, max(0, full - 1)])], p, out))
        who.append(tenant)
    return reqs, who


def write_log(path: Path, reqs: list[SimRequest], tenants: list[str | None], kv: KVShape | None,
              start: float = 1.8e9) -> None:
    """The request-log rows of requests served one after another, a second apart (each
    prompt's hashes written as the server writes digests: hex)."""
    with path.open("w") as f:
        for i, (r, t) in enumerate(zip(reqs, tenants)):
            entry = PrefixEntry(r.prompt_tokens, 0, r.output_tokens, tuple(bytes(h).hex() for h in r.hashes),
                                t and hashlib.blake2b(t.encode(), digest_size=8).hexdigest())
            row = LogRow(start + i + 0.5, f"r{i}", "/v1/completions", "m", None, LogStatus.OK, r.prompt_tokens, 0,
                         r.output_tokens, 0.1, 0.5, "length", kv, (entry,))
            f.write(json.dumps(row.to_json()) + "\n")
