"""Write a tiny HF model as a GGUF file, as llama.cpp's converter would."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

HF_TO_GGUF = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
    "mlp.gate": "ffn_gate_inp", "mlp.experts.gate_proj": "ffn_gate_exps", "mlp.experts.up_proj": "ffn_up_exps",
    "mlp.experts.down_proj": "ffn_down_exps",
}
F32_ALWAYS = ("ffn_gate_inp",)  # llama-quantize never quantizes a router
# Bytes per 256-value block and where the f16 scales sit, for the K-quants that neither
# gguf-py nor tests/kquants.py quantizes: we write random quants with small finite scales.
K_LAYOUT = {"Q2_K": (84, [80, 82]), "Q3_K": (110, [108])}
# llama.cpp's K-quant mixes, as far as a 2-layer model shows them: the base type, the
# type of output and of attn_v / ffn_down on layers given more bits, and the fallbacks for
# rows that 256-value blocks do not divide
MIXES = {"Q4_K_M": ("Q4_K", "Q6_K"), "Q5_K_M": ("Q5_K", "Q6_K")}
FALLBACK = {"Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}


def tensor_type(weight_type: str, gguf_name: str, cols: int) -> str:
    """The type a 2-D tensor is written in: weight_type itself, or its pick in a MIXES
    mix (layer 0 gets the more bits, as llama.cpp's use_more_bits gives the first layers)."""
    if weight_type not in MIXES:
        return weight_type
    base, more = MIXES[weight_type]
    more_bits = gguf_name == "output.weight" or (
        gguf_name.startswith("blk.0.") and gguf_name.split(".")[2] in ("attn_v", "ffn_down", "ffn_down_exps"))
    t = more if more_bits else base
    return FALLBACK[t] if cols % 256 else t


def _permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's Q/K row permutation (HF halves -> interleaved pairs)."""
    shape = w.shape
    return w.reshape(n_heads, 2, shape[0] // n_heads // 2, *shape[1:]).swapaxes(1, 2).reshape(shape)




def _llama_cpp_name(tensor: str) -> str:
    """A layer tensor's GGUF name as llama.cpp's gguf-py spells it (blk.{bid}.NAME -> NAME),
    so that these files are named by llama.cpp's rules, not by the loader's."""
    from gguf.constants import MODEL_TENSOR, TENSOR_NAMES

    return TENSOR_NAMES[MODEL_TENSOR[tensor]].split(".")[-1]


# Gemma 3's four norms a layer, as llama.cpp names them
GEMMA3_NAMES = {"input_layernorm": _llama_cpp_name("ATTN_NORM"),
                "post_attention_layernorm": _llama_cpp_name("ATTN_POST_NORM"),
                "pre_feedforward_layernorm": _llama_cpp_name("FFN_NORM"),
                "post_feedforward_layernorm": _llama_cpp_name("FFN_POST_NORM")}


def _gguf_name(hf: str, arch: str = "llama") -> str | None:
    if hf == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf == "model.norm.weight":
        return "output_norm.weight"
    if hf == "lm_head.weight":
        return "output.weight"
    parts = hf.split(".")
    layer, rest, kind = parts[2], ".".join(parts[3:-1]), parts[-1]
    names = {**HF_TO_GGUF, **GEMMA3_NAMES} if arch == "gemma3" else HF_TO_GGUF
    return f"blk.{layer}.{names[rest]}.{kind}"


def _gemma3_metadata(w, cfg) -> None:
    """Gemma 3's keys as llama.cpp's converter writes them: the window, the local layers'
    RoPE base and the global layers' linear scaling (the pattern is llama.cpp's default 6)."""
    w.add_sliding_window(cfg.sliding_window)
    w.add_rope_freq_base_swa(float(cfg.rope_parameters["sliding_attention"]["rope_theta"]))
    full = cfg.rope_parameters["full_attention"]
    if full.get("rope_type") == "linear":
        import gguf

        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(full["factor"])


def hf_tensors(hf_model):
    """(HF name, float32 array) of every weight, a mixture's experts as the 3-D
    `mlp.experts.{gate,up,down}_proj.weight` (transformers keeps gate and up as one)."""
    for name, t in hf_model.state_dict().items():
        a = t.detach().float().numpy()
        if name.endswith("mlp.experts.gate_up_proj"):
            i = a.shape[1] // 2
            yield name.replace("gate_up_proj", "gate_proj.weight"), a[:, :i]
            yield name.replace("gate_up_proj", "up_proj.weight"), a[:, i:]
        elif name.endswith("mlp.experts.down_proj"):
            yield name + ".weight", a
        else:
            yield name, a


def _blocks(a: np.ndarray, ttype: str, rng: np.random.Generator) -> np.ndarray:
    """a [N, K] (or experts' [X, N, K]) as GGUF blocks of ttype: [..., bytes a row]."""
    from tests.kquants import quantize

    rows = a.reshape(-1, a.shape[-1])
    raw = random_k_blocks(ttype, rows.shape, rng) if ttype in K_LAYOUT else quantize(rows, ttype)
    return raw.reshape(*a.shape[:-1], raw.shape[-1])


def _moe_metadata(w, cfg) -> None:
    experts = getattr(cfg, "num_experts", 0) or 0
    if experts:
        w.add_expert_count(experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)


def random_k_blocks(qtype: str, shape: tuple[int, int], rng: np.random.Generator) -> np.ndarray:
    nbytes, scale_offsets = K_LAYOUT[qtype]
    rows, cols = shape
    nblk = cols // 256
    raw = rng.integers(0, 256, size=(rows, nblk, nbytes), dtype=np.uint8)
    for off in scale_offsets:
        scale = rng.uniform(0.001, 0.01, size=(rows, nblk)).astype(np.float16)
        raw[:, :, off:off + 2] = scale.view(np.uint8).reshape(rows, nblk, 2)
    return raw.reshape(rows, nblk * nbytes)


def _write_bpe_tokenizer(w, tokenizer, vocab_size: int) -> None:
    """An HF byte-level BPE tokenizer as GGUF keys (tokenizer.ggml.model "gpt2", its merges),
    padded to vocab_size with [PADn] tokens; no BOS added."""
    import json

    vocab = tokenizer.backend_tokenizer.get_vocab()
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    tokens += [f"[PAD{i}]" for i in range(vocab_size - len(tokens))]
    special = set(tokenizer.all_special_tokens)
    model_json = tokenizer.backend_tokenizer.to_str()
    merges = json.loads(model_json)["model"]["merges"]
    merges = [m if isinstance(m, str) else " ".join(m) for m in merges]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in special else 1 for t in tokens])
    w.add_token_merges(merges)
    w.add_bos_token_id(tokenizer.bos_token_id)
    w.add_eos_token_id(tokenizer.eos_token_id)
    w.add_add_bos_token(False)
    w.add_chat_template(tokenizer.chat_template)


@dataclass(frozen=True)
class SpmVocab:
    """A SentencePiece vocabulary as Gemma 3's GGUF files store it (tokenizer.ggml.model
    "llama": a score a token and no merges, BOS added, no space prefix): <pad> <eos> <bos>
    <unk>, the 256 byte tokens, `pieces` (best merge first: a piece's score is minus its
    place), then unused [PADn] tokens up to the vocabulary size."""

    pieces: tuple[str, ...]
    PAD, EOS, BOS, UNK = 0, 1, 2, 3

    def tokens(self, vocab_size: int) -> list[str]:
        toks = ["<pad>", "<eos>", "<bos>", "<unk>", *(f"<0x{b:02X}>" for b in range(256)), *self.pieces]
        return toks + [f"[PAD{i}]" for i in range(vocab_size - len(toks))]

    def id(self, piece: str) -> int:
        return 260 + self.pieces.index(piece)

    def write(self, w, vocab_size: int) -> None:
        """Its tokenizer.* keys into GGUFWriter w."""
        tokens = self.tokens(vocab_size)
        n = 260 + len(self.pieces)
        w.add_tokenizer_model("llama")
        w.add_tokenizer_pre("default")
        w.add_token_list(tokens)
        w.add_token_scores([float(-i) if 260 <= i < n else 0.0 for i in range(len(tokens))])
        w.add_token_types([3, 3, 3, 2] + [6] * 256 + [1] * len(self.pieces) + [5] * (len(tokens) - n))
        w.add_bos_token_id(self.BOS)
        w.add_eos_token_id(self.EOS)
        w.add_unk_token_id(self.UNK)
        w.add_pad_token_id(self.PAD)
        w.add_add_bos_token(True)
        w.add_add_eos_token(False)
        w.add_add_space_prefix(False)


def write_gguf(path: Path, hf_model, tokenizer, weight_type: str = "F32", arch: str = "llama",
               seed: int = 0) -> Path:
    """Write hf_model's weights (2-D ones and a mixture's 3-D experts as weight_type or as
    a MIXES mix picks; norms and routers as F32) and tokenizer (an HF byte-level BPE
    tokenizer, or an SpmVocab) into a GGUF file at path, as `arch` (llama: q/k rows
    permuted; gemma3: its names, keys and norms)."""
    import gguf
    from gguf import GGMLQuantizationType as Q

    cfg = hf_model.config
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"tiny-{arch}")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
    w.add_value_length(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
    rope = cfg.rope_parameters.get("full_attention", cfg.rope_parameters)
    w.add_rope_freq_base(float(rope["rope_theta"]))
    if arch == "gemma3":
        _gemma3_metadata(w, cfg)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    w.add_file_type(0)
    _moe_metadata(w, cfg)

    if isinstance(tokenizer, SpmVocab):
        tokenizer.write(w, cfg.vocab_size)
    else:
        _write_bpe_tokenizer(w, tokenizer, cfg.vocab_size)

    nh, nkv = cfg.num_attention_heads, cfg.num_key_value_heads
    for name, a in hf_tensors(hf_model):
        if "rotary_emb" in name or (name == "lm_head.weight" and cfg.tie_word_embeddings):
            continue
        if arch == "gemma3" and name.endswith("norm.weight"):  # the converter stores Gemma's norms as w + 1
            a = a + np.float32(1.0)
        if arch == "llama" and name.endswith("q_proj.weight"):
            a = _permute(a, nh)
        elif arch == "llama" and name.endswith("k_proj.weight"):
            a = _permute(a, nkv)
        gname = _gguf_name(name, arch)
        ttype = tensor_type(weight_type, gname, a.shape[-1])
        if a.ndim == 1 or ttype == "F32" or gname.split(".")[-2] in F32_ALWAYS:
            w.add_tensor(gname, np.ascontiguousarray(a, dtype=np.float32))
        else:
            raw = _blocks(a, ttype, rng)
            w.add_tensor(gname, raw, raw_shape=raw.shape, raw_dtype=Q[ttype])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def hf_model_from_gguf(path: Path, config):
    """A transformers model of `config` holding a GGUF file's weights as gguf-py
    dequantizes them (the reference for architectures whose GGUF transformers cannot
    load, as qwen3moe's experts): HF names from the file's, experts' gate and up joined
    as transformers keeps them. No Q/K un-permutation (not for llama-style files)."""
    import gguf
    import torch
    import transformers

    names = {v: k for k, v in HF_TO_GGUF.items()} | {"token_embd": "model.embed_tokens",
                                                      "output_norm": "model.norm", "output": "lm_head"}
    state = {}
    for t in gguf.GGUFReader(str(path)).tensors:
        a = np.array(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
        a = a.reshape([int(d) for d in reversed(t.shape.tolist())])
        parts = t.name.split(".")
        hf = (f"model.layers.{parts[1]}.{names[parts[2]]}" if parts[0] == "blk" else names[parts[0]]) + ".weight"
        state[hf] = torch.from_numpy(a)
    for key in [k for k in state if k.endswith("mlp.experts.gate_proj.weight")]:
        base = key[:-len("gate_proj.weight")]
        state[base + "gate_up_proj"] = torch.cat([state.pop(key), state.pop(base + "up_proj.weight")], dim=1)
        state[base + "down_proj"] = state.pop(base + "down_proj.weight")
    model = getattr(transformers, config.architectures[0])(config).float().eval()
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and all("lm_head" in k for k in missing), (missing, unexpected)
    if missing:
        model.tie_weights()
    model.config._attn_implementation = "eager"
    return model
