"""What a GGUF's tokenizer holds in a server's process, stage by stage: the resident set
(/proc/self/smaps, MiB: anonymous, heap, file-backed) after torch's import, the server's
imports, the tokenizer, the output-constraint compiler the engine makes at start, and the
first chat whose message spells a special token (the split-special-tokens tokenizer and
the chat template renderer's import), each followed by malloc_trim(0) as the engine's
start does (model/build.return_freed_memory).

    .venv/bin/python benchmarks/idle_memory.py ~/.cache/hotprefix-bench/random-gemma3-270m-Q4_K_M.gguf
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import re
from pathlib import Path

_last: float | None = None


def resident() -> dict[str, float]:
    """MiB resident by kind of mapping: [anon], [heap], file (every file-backed one)."""
    kinds: collections.Counter[str] = collections.Counter()
    name = ""
    with open("/proc/self/smaps") as f:
        for line in f:
            if re.match(r"^[0-9a-f]+-[0-9a-f]+ ", line):
                parts = line.split()
                name = parts[5] if len(parts) > 5 else "[anon]"
                name = "file" if "/" in name else name
            elif line.startswith("Rss:"):
                kinds[name] += int(line.split()[1])
    return {k: v / 1024 for k, v in kinds.items()}


def stage(tag: str) -> None:
    global _last
    r = resident()
    total = sum(r.values())
    delta = "" if _last is None else f"{total - _last:+7.1f}"
    print(f"{tag:34s} {total:7.1f} {delta:>7s}   anon {r.get('[anon]', 0):6.1f}  heap {r.get('[heap]', 0):6.1f}  "
          f"file {r.get('file', 0):6.1f}", flush=True)
    _last = total


def trim(tag: str) -> None:
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    stage(f"  malloc_trim after {tag}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("gguf", type=Path)
    a = ap.parse_args()
    print(f"{'stage':34s} {'MiB':>7s} {'change':>7s}")
    stage("start")
    import torch  # noqa: F401

    stage("import torch")
    import hotprefix.server.app  # noqa: F401

    stage("the server's imports")
    from hotprefix.config import StructuredConfig
    from hotprefix.grammar import compiler_for
    from hotprefix.model.loader import gguf_tokenizer
    from hotprefix.tokenizers.prompt_encoder import PromptEncoder

    tok = gguf_tokenizer(a.gguf)
    stage("the tokenizer")
    trim("the tokenizer")
    compiler = compiler_for(tok, len(tok), {tok.eos_token_id or 0}, StructuredConfig())
    stage("the constraint compiler")
    trim("the compiler")
    special = next(iter(PromptEncoder(tok).special_tokens), "")
    PromptEncoder(tok).encode_chat([{"role": "user", "content": f"hello {special} there"}])
    stage("a chat spelling a special token")
    trim("the chat")
    del compiler


if __name__ == "__main__":
    main()
