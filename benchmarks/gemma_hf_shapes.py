"""Gemma 3 270M- and 1B-shaped HF folders (issue 41: "the shapes serve from HF folders"):
transformers' own Gemma3ForCausalLM with random weights at the published text configs'
shapes (hidden, layers, heads, head dim 256, window 512, the 262,144-token vocabulary,
local and global RoPE), saved with save_pretrained and a small tokenizer (the tests'), then
loaded by hotprefix from the folder. A prompt longer than the window (so the local layers
drop keys) is run by both: greedy tokens of hotprefix's float32 and int8 modes against
transformers' (eager attention). (The logits themselves are compared with transformers'
within 1e-4 on the tests' tiny Gemma 3, tests/model/test_gemma3.py.)

    .venv/bin/python benchmarks/gemma_hf_shapes.py [--shape 270m 1b] [--prompt 700] [--tokens 8] [--json out.json]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from run_facts import report  # noqa: E402

from hotprefix import LLM, SamplingParams  # noqa: E402
from tests.conftest import build_tiny_model  # noqa: E402

# The published text configs' shapes (google/gemma-3-270m, gemma-3-1b-it), as
# tests/model/test_gemma3.py's HUB_270M has the 270M.
SHAPES = {
    "270m": dict(hidden_size=640, intermediate_size=2048, num_hidden_layers=18, num_attention_heads=4,
                 num_key_value_heads=1),
    "1b": dict(hidden_size=1152, intermediate_size=6912, num_hidden_layers=26, num_attention_heads=4,
               num_key_value_heads=1),
    "4b": dict(hidden_size=2560, intermediate_size=10240, num_hidden_layers=34, num_attention_heads=8,
               num_key_value_heads=4, sliding_window=1024,
               rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}),
}
COMMON = dict(head_dim=256, query_pre_attn_scalar=256, sliding_window=512, vocab_size=262144,
              max_position_embeddings=32768, initializer_range=0.02, layer_types=None,
              rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                               "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})


def prompt_of(n: int) -> list[int]:
    """n token ids of the tests' tokenizer, from a fixed seed."""
    return torch.randint(3, 320, (n,), generator=torch.Generator().manual_seed(2)).tolist()


def serve(folder: Path, mode: str, prompt_len: int, tokens: int) -> list[int]:
    """hotprefix's greedy tokens from the folder in `mode`."""
    llm = LLM(model=str(folder), quantized_matmul=mode)
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    return llm.generate([prompt_of(prompt_len)], params)[0].outputs[0].token_ids


def run(shape: str, prompt_len: int, tokens: int) -> dict:
    """One shape: write the folder, run transformers and hotprefix on the same prompt
    (hotprefix alone, serving a bfloat16 folder, for the 4B)."""
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / f"gemma3-{shape}"
        if shape == "4b":  # in bfloat16: 8.6 GB where float32 would need 17 GB of this machine's 24
            build_tiny_model(folder, "gemma3", seed=5, dtype=torch.bfloat16, **{**COMMON, **SHAPES[shape]})  # (dropped)
            return {"shape": shape, "dtype": "bfloat16", "prompt_tokens": prompt_len,
                    "int8": {"tokens": serve(folder, "int8", prompt_len, tokens)}}
        hf = build_tiny_model(folder, "gemma3", seed=5, **{**COMMON, **SHAPES[shape]})
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt_of(prompt_len)]), max_new_tokens=tokens, min_new_tokens=tokens,
                              do_sample=False)[0, prompt_len:].tolist()
        del hf
        out: dict = {"shape": shape, "prompt_tokens": prompt_len, "transformers": ref}
        for mode in ("float32", "int8"):
            got = serve(folder, mode, prompt_len, tokens)
            out[mode] = {"tokens": got, "equal": got == ref, "agree": sum(a == b for a, b in zip(got, ref))}
        return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", nargs="+", default=["270m", "1b"], choices=sorted(SHAPES),
                    help="4b: written in bfloat16 and served without a reference run")
    ap.add_argument("--prompt", type=int, default=700)
    ap.add_argument("--tokens", type=int, default=8)
    ap.add_argument("--json")
    a = ap.parse_args()
    report({"results": [run(s, a.prompt, a.tokens) for s in a.shape]}, a.json)


if __name__ == "__main__":
    main()
