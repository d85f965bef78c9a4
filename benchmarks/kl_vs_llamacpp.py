"""How far int8 mode's next-token distributions are from float32's, next to llama.cpp's.

Feeds the same token ids to hotprefix in float32 mode (the reference: token-identical
to transformers), hotprefix in int8 mode, and a running llama-server (same GGUF), and
compares, at every position of the text, the distribution of the next token.
llama-server gives only its top-K probabilities (`n_probs`) for the token after a
prompt, so every system is compared the same way: the candidate's top K tokens plus
one bucket for the rest of the vocabulary, KL(reference || candidate) over those
K + 1 outcomes (the reference's mass summed into the same buckets). The full-vocabulary
KL of int8 mode is printed too.

    bash benchmarks/peers/llamaserver.sh serve 8791 &   # then:
    .venv/bin/python benchmarks/kl_vs_llamacpp.py http://127.0.0.1:8791 [--model FILE.gguf] [--json out.json]

(--model: the GGUF llama-server serves; default the bundled model. --max-tokens N: the
text's first N tokens, for a tiny model whose vocabulary spells it byte by byte.)
"""

from __future__ import annotations

import argparse
import math
import statistics

import httpx
import torch
from run_facts import report

from hotprefix.config import CacheConfig, EngineConfig, ModelConfig
from hotprefix.core.outputs import ScheduledRequest, SchedulerOutput
from hotprefix.engine.llm_engine import LLMEngine
from hotprefix.model.loader import load_model
from hotprefix.sampling_params import SamplingParams

TEXT = (
    "A cache is only as good as its hit rate. When many users send prompts that begin with the same "
    "system instructions, the server can compute the keys and values of that shared beginning once and "
    "keep them in memory. Each later request then starts where the shared part ends, and its first token "
    "arrives after a fraction of the work. The hard parts are deciding what to keep when memory runs "
    "out, making sure one tenant never reads another tenant's entries, and measuring honestly how much "
    "time was saved. Engineers who build such systems spend most of their days on these three "
    "questions, and the rest of their days on the bugs that the answers introduce. A good design makes "
    "the common case fast and the rare case correct, and it explains itself in its logs and metrics so "
    "that an operator at three in the morning can tell what happened without reading the source code."
)


def engine_logprobs(loaded, mode: str, ids: list[int]) -> torch.Tensor:
    """log-softmax of the next-token logits after each prefix of ids: [len(ids), V]."""
    # one block table for every layer (a sliding-window model's grouped pool takes one table per group;
    # it only frees blocks out of the window, which no query reads: the same logits)
    cache = CacheConfig(num_blocks_override=64, kv_cache_groups=False)
    eng = LLMEngine(EngineConfig(ModelConfig(quantized_matmul=mode), cache), loaded=loaded, warmup=False)
    blocks = list(range(-(-len(ids) // cache.block_size)))
    so = SchedulerOutput([ScheduledRequest("kl", ids, 0, blocks, True, SamplingParams(), ids, [])])
    return torch.log_softmax(eng.runner.all_logits(so).double(), -1)


def llama_top(url: str, ids: list[int], k: int) -> list[dict[int, float] | None]:
    """llama-server's top-k next-token probabilities after each prefix ids[:i + 1]; None
    where it gives none (it holds back a token that is an incomplete UTF-8 sequence, and its
    probabilities with it)."""
    out: list[dict[int, float] | None] = []
    with httpx.Client(timeout=120) as c:
        for i in range(len(ids)):
            r = c.post(url + "/completion", json={"prompt": ids[:i + 1], "n_predict": 1, "n_probs": k,
                                                   "temperature": 0, "cache_prompt": True})
            r.raise_for_status()
            probs = r.json().get("completion_probabilities")
            out.append({t["id"]: math.exp(t["logprob"]) for t in probs[0]["top_logprobs"]} if probs else None)
    return out


def bucket_kl(ref: torch.Tensor, cand: dict[int, float]) -> float:
    """KL(ref || cand) over cand's tokens plus one bucket for the rest; ref: [V] log-probs."""
    p = ref.exp()
    ids = torch.tensor(list(cand))
    p_top = p[ids]
    q_top = torch.tensor(list(cand.values()), dtype=torch.float64)
    p_rest, q_rest = max(1.0 - float(p_top.sum()), 1e-12), max(1.0 - float(q_top.sum()), 1e-12)
    kl = float((p_top * (p_top.clamp_min(1e-300).log() - q_top.clamp_min(1e-12).log())).sum())
    return kl + p_rest * (math.log(p_rest) - math.log(q_rest))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("url", help="llama-server base URL")
    ap.add_argument("--k", type=int, default=20)
    ap.add_argument("--model", default=None, help="the GGUF file llama-server serves (default: the bundled model)")
    ap.add_argument("--max-tokens", type=int, default=None,
                    help="the text's first N tokens only (a tiny test model's context)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    loaded = load_model(a.model)
    ids = loaded.tokenizer(TEXT)["input_ids"][:a.max_tokens]
    ref = engine_logprobs(loaded, "float32", ids)
    q8 = engine_logprobs(loaded, "int8", ids)
    llama = llama_top(a.url.rstrip("/"), ids, a.k)

    def top(lp: torch.Tensor) -> dict[int, float]:
        v, i = lp.topk(a.k)
        return dict(zip(i.tolist(), v.exp().tolist()))

    pos = [i for i in range(len(ids)) if llama[i] is not None]  # every system on the same positions
    kl_llama = [bucket_kl(ref[i], llama[i]) for i in pos]
    kl_int8 = [bucket_kl(ref[i], top(q8[i])) for i in pos]
    full_int8 = (ref.exp() * (ref - q8)).sum(-1)[pos]
    ref_top1 = ref.argmax(-1).tolist()
    q8_top1 = q8.argmax(-1).tolist()
    res = {
        "model": loaded.name, "tokens": len(pos), "positions_without_llama_probs": len(ids) - len(pos), "k": a.k,
        "llama_server": {"kl_topk_mean": statistics.fmean(kl_llama), "kl_topk_median": statistics.median(kl_llama),
                         "top1_agrees": statistics.fmean(max(llama[i], key=llama[i].get) == ref_top1[i]
                                                         for i in pos)},
        "hotprefix_int8": {"kl_topk_mean": statistics.fmean(kl_int8), "kl_topk_median": statistics.median(kl_int8),
                           "kl_full_mean": float(full_int8.mean()),
                           "top1_agrees": statistics.fmean(q8_top1[i] == ref_top1[i] for i in pos)},
    }
    report(res, a.json)


if __name__ == "__main__":
    main()
