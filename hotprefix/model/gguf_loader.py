"""GGUF files: shape from metadata (no torch needed), tensors dequantized through the `gguf` package."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from hotprefix.model.arch import FULL, GGUF_ARCHITECTURES, SLIDING, ModelArch, ModelLoadError
from hotprefix.model.families import FAMILIES
from hotprefix.model.gguf_file import ArrayField, GGUFFile, GGUFFormatError

if TYPE_CHECKING:
    import torch

    from hotprefix.model.kernels.weights import ExpertBlocks, PackedWeight
    from hotprefix.model.parallel import ShardPlan

# Tensor types we dequantize (gguf.quants implements each of these in numpy); of these, the
# C kernels multiply from their blocks the ones in kernels.weights.QTYPES.
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K",
                   "Q8_K", "Q2_K", "Q3_K")
FLOAT_TYPES = ("F32", "F16", "BF16")

_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",  # a mixture's router, [experts, hidden]
    "ffn_gate_exps": "mlp.experts.gate_proj",  # its experts, 3-D: [experts, FFN, hidden]
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",  # [experts, hidden, FFN]
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_BLK = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")


def _reader(path: Path) -> GGUFFile:
    try:
        return GGUFFile(path)
    except (GGUFFormatError, OSError, ValueError) as e:
        raise ModelLoadError(f"{path}: not a readable GGUF file ({e})") from None


def _field(reader: GGUFFile, key: str, default: Any = None) -> Any:
    v = reader.get(key, default)
    return default if isinstance(v, ArrayField) else v


def _window_fields(reader: GGUFFile, garch: str, family: str, layers: int, hidden: int, heads: int
                   ) -> dict[str, Any]:
    """A sliding-window family's fields as llama.cpp reads them (src/models/gemma3.cpp): the
    window (`attention.sliding_window`; none: every layer global), which layers it applies to
    (`attention.sliding_window_pattern`: a period, layer i global when (i + 1) % period == 0,
    or one boolean a layer; default the family's), the local layers' RoPE base
    (`rope.freq_base_swa`, default 10,000), and the query scale (head_dim^-1/2; hidden /
    heads for the 62-layer 27B, as llama.cpp and HF's query_pre_attn_scalar give it)."""
    pattern = FAMILIES[family].window_pattern
    if not pattern:
        return {}
    key = f"{garch}.attention.sliding_window_pattern"
    window = _field(reader, f"{garch}.attention.sliding_window")
    flags = reader.scalars(key)
    if flags is None:
        period = int(_field(reader, key, pattern))
        if period < 1:
            raise ValueError(f"{key} must be at least 1, got {period}")
        flags = [(i + 1) % period != 0 for i in range(layers)]
    kinds = tuple(SLIDING if f and window else FULL for f in flags)
    return dict(layer_types=kinds, sliding_window=int(window) if window else None,
                rope_local_theta=float(_field(reader, f"{garch}.rope.freq_base_swa", 10000.0)),
                query_pre_attn_scalar=hidden / heads if layers == 62 else None,
                hidden_act=FAMILIES[family].activations[0])


def read_gguf_arch(path: Path) -> tuple[ModelArch, GGUFFile]:
    """The model's shape from GGUF metadata, and the open reader. Raises ModelLoadError."""
    reader = _reader(path)
    garch = _field(reader, "general.architecture")
    family = GGUF_ARCHITECTURES.get(garch)
    if family is None:
        raise ModelLoadError(f"{path.name}: unsupported GGUF architecture {garch!r} "
                             f"(supported: {', '.join(GGUF_ARCHITECTURES)})")
    name = str(_field(reader, "general.name", "") or "").lower()
    if family == "llama" and "mistral" in name:
        family = "mistral"

    def a(key: str, default: Any = None) -> Any:
        return _field(reader, f"{garch}.{key}", default)

    heads = a("attention.head_count")
    hidden = a("embedding_length")
    vocab = a("vocab_size") or reader.array_len("tokenizer.ggml.tokens")
    names = {t.name for t in reader.tensors}
    scaling: dict[str, Any] = {}
    stype = a("rope.scaling.type")
    if stype == "linear":
        scaling = {"rope_type": "linear", "factor": float(a("rope.scaling.factor"))}
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    try:
        arch = ModelArch(
            family=family, vocab_size=int(vocab), hidden_size=int(hidden),
            intermediate_size=int(a("feed_forward_length") or a("expert_feed_forward_length")),
            num_layers=int(a("block_count")),
            num_heads=int(heads), num_kv_heads=int(a("attention.head_count_kv") or heads),
            head_dim=int(a("attention.key_length") or hidden // heads),
            rms_norm_eps=float(a("attention.layer_norm_rms_epsilon", 1e-6)),
            rope_theta=float(a("rope.freq_base", 10000.0)), rope_scaling=scaling,
            max_position_embeddings=int(a("context_length", 4096)),
            tie_word_embeddings="output.weight" not in names, qk_norm=FAMILIES[family].qk_norm,
            torch_dtype="float32", bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
            eos_token_ids=() if eos is None else (int(eos),), **_moe_fields(a, names),
            **_window_fields(reader, garch, family, int(a("block_count")), int(hidden), int(heads)))
    except (TypeError, ValueError) as e:
        raise ModelLoadError(f"{path.name}: incomplete GGUF metadata ({e})") from None
    arch.validate()
    return arch, reader


def _moe_fields(a: Any, names: set[str]) -> dict[str, Any]:
    """ModelArch's mixture-of-experts fields from GGUF metadata (`a`: a key of the
    architecture's): the experts, how many a token takes, their FFN size; llama.cpp
    renormalises the chosen weights unless the file says otherwise; a layer without a
    router keeps a dense MLP. Raises TypeError or ValueError for a missing field."""
    experts = int(a("expert_count") or 0)
    if not experts:
        return {}
    layers = int(a("block_count"))
    return dict(num_experts=experts, experts_per_token=int(a("expert_used_count")),
                expert_intermediate_size=int(a("expert_feed_forward_length")),
                norm_topk_prob=bool(a("expert_weights_norm", True)),
                dense_layers=tuple(i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" not in names))


def _unpermute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (interleaved rope) back to HF's layout."""
    shape = w.shape
    return w.reshape(n_heads, shape[0] // n_heads // 2, 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


@dataclass(frozen=True)
class DeferredRows:
    """A 2-D (or experts' 3-D) tensor of a block type the kernels do not multiply (Q2_K, Q3_K), kept as its
    mapped bytes: widened to float32 only for a mode that asks (LoadedModel.model_weights)."""

    type_name: str
    raw: np.ndarray  # [rows, bytes per row], a view of the mapped file
    shape: tuple[int, ...]  # [N, K] in HF's order ([X, N, K]: a mixture's experts)
    permute_heads: int | None  # llama.cpp's Q/K row order to undo

    def dequantize(self) -> torch.Tensor:
        import torch
        from gguf import GGMLQuantizationType, dequantize

        w = np.asarray(dequantize(self.raw, GGMLQuantizationType[self.type_name]), dtype=np.float32)
        w = w.reshape(self.shape)
        if self.permute_heads is not None:
            w = _unpermute(w, self.permute_heads)
        return torch.from_numpy(np.array(w, dtype=np.float32, order="C"))

    def part(self, dim: int, start: int, stop: int, rows: int | None = None) -> DeferredRows:
        """Rows [start, stop) (dim 0: whole heads of a permuted Q/K, padded with zero blocks
        to `rows`) or columns [start, stop) (dim 1, on block boundaries) of a 2-D tensor, a
        copy owning only those bytes (kernels.weights.split_blocks). Raises ValueError for
        columns off block boundaries."""
        import torch
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        from hotprefix.model.kernels.weights import split_blocks

        n, k = self.shape
        raw = split_blocks(torch.from_numpy(self.raw), self.type_name,
                           GGML_QUANT_SIZES[GGMLQuantizationType[self.type_name]], dim, start, stop, rows).numpy()
        heads = self.permute_heads and (self.permute_heads * (stop - start) // n if dim == 0 else self.permute_heads)
        return DeferredRows(self.type_name, raw, (raw.shape[0], k) if dim == 0 else (n, stop - start), heads)


@dataclass
class GGUFWeights:
    """load_gguf_weights's result, in HF's names. `tensors`: float32 tensors, and meta
    tensors of the right shape for those held as blocks; `packed`: blocks the kernels
    multiply (kernels.weights.PackedWeight, views of the mapped file unless un-permuted); `deferred`:
    blocks of other types."""

    tensors: dict[str, Any]
    packed: dict[str, PackedWeight]
    deferred: dict[str, DeferredRows]


def _hf_name(t_name: str, arch: ModelArch, path: Path) -> tuple[str, int | None]:
    """The HF name of a GGUF tensor and, for llama's Q/K, the heads whose row order to undo.
    Raises ModelLoadError for a name we do not know."""
    m = _BLK.match(t_name)
    if m:
        layer, short, kind = m.groups()
        names = {**_LAYER_NAMES, **dict(FAMILIES[arch.family].gguf_names)}
        if short not in names:
            raise ModelLoadError(f"{path.name}: unexpected tensor {t_name}")
        permute = None
        if FAMILIES[arch.family].gguf_permutes_qk:  # llama.cpp permutes Q/K rows of llama-style models
            permute = {"attn_q": arch.num_heads, "attn_k": arch.num_kv_heads}.get(short)
        return f"model.layers.{layer}.{names[short]}.{kind}", permute
    base, _, kind = t_name.rpartition(".")
    if base not in _TOP_NAMES:
        raise ModelLoadError(f"{path.name}: unexpected tensor {t_name}")
    return f"{_TOP_NAMES[base]}.{kind}", None


def load_gguf_weights(path: Path, arch: ModelArch, reader: GGUFFile, keep_blocks: bool = False) -> GGUFWeights:
    """All tensors, renamed to HF's names: 1-D ones and float types as float32; with
    keep_blocks, 2-D tensors of block types as blocks (meta tensors in `tensors`), which
    LoadedModel.model_weights widens only for a mode that needs float32, so that int8 mode
    never holds a float32 copy, not even while loading; without, every tensor as float32.

    Raises ModelLoadError for a tensor type we cannot read, an unknown tensor name, or a
    file that ends before its tensors do.
    """
    import torch
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, dequantize


    out = GGUFWeights({}, {}, {})
    for t in reader.tensors:
        try:
            qtype = GGMLQuantizationType(t.ggml_type)
            ttype = qtype.name
        except ValueError:
            ttype = f"type {t.ggml_type}"
        if ttype not in SUPPORTED_TYPES:
            raise ModelLoadError(f"{path.name}: tensor {t.name} has unsupported type {ttype} "
                                 f"(supported: {', '.join(SUPPORTED_TYPES)})")
        block_size, type_size = GGML_QUANT_SIZES[qtype]
        try:
            raw = reader.raw(t, type_size, block_size)
        except GGUFFormatError as e:
            raise ModelLoadError(f"{path.name}: {e}") from None
        if t.name == "rope_freqs.weight":
            out.tensors["rope_freqs"] = torch.from_numpy(np.array(dequantize(raw, qtype), dtype=np.float32).reshape(-1))
            continue
        name, permute = _hf_name(t.name, arch, path)
        shape = tuple(int(d) for d in reversed(t.shape))
        if keep_blocks and len(shape) in (2, 3) and ttype not in FLOAT_TYPES:
            _keep_blocks(out, name, ttype, raw, shape, permute)
            continue
        w = np.asarray(dequantize(raw, qtype), dtype=np.float32).reshape(shape)
        if permute is not None:
            w = _unpermute(w, permute)
        # a copy, never a view of the map: GGUFFile.release drops the map's pages, and would drop
        # what anyone had written into them
        out.tensors[name] = torch.from_numpy(np.array(w, dtype=np.float32, order="C"))
    return out


def _keep_blocks(out: GGUFWeights, name: str, ttype: str, raw: np.ndarray, shape: tuple[int, ...],
                 permute: int | None) -> None:
    """Keep a 2-D weight or a mixture's 3-D experts as their blocks: in `out.packed` for a
    type the kernels multiply, else in `out.deferred`; a meta tensor of the shape in
    `out.tensors`."""
    import torch

    from hotprefix.model.kernels.weights import ExpertBlocks, PackedWeight

    if len(shape) == 3:
        p = ExpertBlocks.from_gguf(ttype, torch.from_numpy(raw), *shape)
    else:
        p = PackedWeight.from_gguf(ttype, torch.from_numpy(_unpermute(raw, permute) if permute else raw), *shape)
    if p is not None:
        out.packed[name] = p
    else:
        out.deferred[name] = DeferredRows(ttype, raw, shape, permute)
    out.tensors[name] = torch.empty(shape, device="meta")


def shard_gguf_weights(w: GGUFWeights, plan: ShardPlan, path: Path) -> GGUFWeights:
    """The rank's part of each weight (ShardPlan): float tensors cut; blocks split on whole
    rows (column-parallel, vocabulary rows padded with zero blocks) or on block boundaries
    (row-parallel), each part a copy, so a rank keeps only its bytes of the map; the same
    for the types the kernels do not read (DeferredRows: Q2_K, Q3_K). Raises ModelLoadError
    for blocks that do not split (columns off block boundaries)."""
    import torch

    from hotprefix.model.parallel import ShardKind, vocab_rows

    out = GGUFWeights({}, {}, dict(w.deferred))
    for name, t in w.tensors.items():
        where = plan.part(name, tuple(t.shape)) if t.is_meta else None
        if where is None:
            out.tensors[name] = t if t.is_meta else plan.cut_tensor(name, t)
            if name in w.packed:
                out.packed[name] = w.packed[name]
            continue
        rows = vocab_rows(t.shape[0], plan.place.size) if plan.kind(name) is ShardKind.VOCAB else None
        try:
            part = (w.packed.get(name) or w.deferred[name]).part(*where, rows=rows)
        except ValueError as e:
            raise ModelLoadError(f"{path.name}: {name} does not split over {plan.place.size} ranks ({e})") from None
        (out.deferred if isinstance(part, DeferredRows) else out.packed)[name] = part
        out.tensors[name] = torch.empty(part.shape if isinstance(part, DeferredRows) else (part.n, part.k),
                                        device="meta")
    return out


def dequantize_rows(p: PackedWeight | ExpertBlocks) -> torch.Tensor:
    """A `kernels.weights.PackedWeight` of GGUF rows as float32 [N, K] (ExpertBlocks: [X,
    N, K]), dequantized by gguf (the values load_gguf_weights would have given)."""
    import torch
    from gguf import GGMLQuantizationType, dequantize

    w = dequantize(p.raw.numpy(), GGMLQuantizationType(p.qtype))  # rows (an expert's rows) of values
    shape = (p.experts, p.n, p.k) if hasattr(p, "experts") else (p.n, p.k)
    return torch.from_numpy(np.array(w, dtype=np.float32, order="C").reshape(shape))
