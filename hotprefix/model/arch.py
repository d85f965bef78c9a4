"""The model's shape, read from a HF config.json or a GGUF file's metadata."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from hotprefix.errors import ModelLoadError as ModelLoadError  # its home is errors.py; re-exported for model/
from hotprefix.model.families import FAMILIES, GGUF_ARCHITECTURES, HF_ARCHITECTURES, MODEL_TYPES
from hotprefix.sizing import KVShape, ModelShape

__all__ = ["GGUF_ARCHITECTURES", "HF_ARCHITECTURES", "ModelArch", "ModelLoadError", "arch_from_hf_config"]
ROPE_TYPES = ("default", "linear", "llama3")
SLIDING, FULL = "sliding_attention", "full_attention"  # HF's `layer_types` entries


@dataclass(frozen=True)
class ModelArch:
    """Everything about the model's shape that the modules need."""

    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] = field(default_factory=dict)
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None
    torch_dtype: str = "float32"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # Sliding-window families (Gemma 3): each layer's kind (SLIDING or FULL; empty: every
    # layer attends within sliding_window if there is one, as Mistral's do); the RoPE base
    # of the sliding layers (they take no rope_scaling; None: rope_theta); the query scale's
    # base (query_pre_attn_scalar^-1/2; None: head_dim); the MLP's activation; and whether
    # the checkpoint stores RMSNorm weights as w for (1 + w) (HF's Gemma; GGUF stores w + 1).
    layer_types: tuple[str, ...] = ()
    rope_local_theta: float | None = None
    query_pre_attn_scalar: float | None = None
    hidden_act: str = "silu"
    norm_adds_one: bool = False
    # a mixture of experts (num_experts > 0): each MoE layer routes a token to the top
    # experts_per_token of num_experts SwiGLU experts of expert_intermediate_size, their
    # softmax weights renormalised over the chosen ones with norm_topk_prob; dense_layers
    # keep a dense MLP of intermediate_size (Qwen3-MoE's mlp_only_layers, decoder_sparse_step)
    num_experts: int = 0
    experts_per_token: int = 0
    expert_intermediate_size: int = 0
    norm_topk_prob: bool = False
    dense_layers: tuple[int, ...] = ()

    @property
    def kv_shape(self) -> KVShape:
        return KVShape(self.num_layers, self.num_kv_heads, self.head_dim)

    @property
    def shape(self) -> ModelShape:
        """What sizing needs (`hotprefix size` reads a config.json through this parser too)."""
        moe_layers = sum(self.moe_layer(i) for i in range(self.num_layers))
        return ModelShape(self.num_layers, self.num_heads, self.num_kv_heads, self.head_dim, self.hidden_size,
                          self.intermediate_size, self.vocab_size, self.tie_word_embeddings,
                          self.max_position_embeddings, self.layer_windows, self.num_experts, self.experts_per_token,
                          self.expert_intermediate_size, moe_layers, self.qk_norm)

    def moe_layer(self, i: int) -> bool:
        """Whether layer i's MLP is a mixture of experts."""
        return self.num_experts > 0 and i not in self.dense_layers

    @property
    def rope_type(self) -> str:
        return self.rope_scaling.get("rope_type", self.rope_scaling.get("type", "default"))

    def window_of(self, layer: int) -> int | None:
        """The keys layer `layer` attends to before each query, itself included (a query
        at p sees [p - window + 1, p]); None: every earlier key."""
        if self.layer_types and self.layer_types[layer] != SLIDING:
            return None
        return self.sliding_window

    @cached_property
    def layer_windows(self) -> tuple[int | None, ...]:
        """window_of of every layer (computed once: read every step)."""
        return tuple(self.window_of(i) for i in range(self.num_layers))

    def validate(self) -> None:
        """Raise ModelLoadError for shapes or options the modules do not implement."""
        if self.num_heads % self.num_kv_heads:
            raise ModelLoadError(f"num_attention_heads {self.num_heads} is not a multiple of "
                                 f"num_key_value_heads {self.num_kv_heads}")
        if self.rope_type not in ROPE_TYPES:
            raise ModelLoadError(f"unsupported rope scaling type {self.rope_type!r} "
                                 f"(supported: {', '.join(ROPE_TYPES)})")
        acts = FAMILIES[self.family].activations
        if self.hidden_act not in acts:
            raise ModelLoadError(f"unsupported hidden_act {self.hidden_act!r} (the {self.family} family "
                                 f"uses {', '.join(acts)})")
        if self.layer_types and (len(self.layer_types) != self.num_layers or set(self.layer_types) - {SLIDING, FULL}):
            raise ModelLoadError(f"layer_types must name {self.num_layers} layers, each {SLIDING!r} or {FULL!r}")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ModelLoadError(f"sliding_window must be at least 1, got {self.sliding_window}")
        if self.num_experts and not (0 < self.experts_per_token <= self.num_experts
                                     and self.expert_intermediate_size > 0):
            raise ModelLoadError(f"a mixture of {self.num_experts} experts cannot route each token to "
                                 f"{self.experts_per_token} of them (expert FFN {self.expert_intermediate_size})")
        if self.num_experts < 0 or (not self.num_experts and self.experts_per_token):
            raise ModelLoadError(f"{self.experts_per_token} experts per token of {self.num_experts} experts")


def _family_of(cfg: dict[str, Any]) -> str:
    archs = cfg.get("architectures") or []
    family = next((HF_ARCHITECTURES[a] for a in archs if a in HF_ARCHITECTURES), None)
    if family is None:
        family = MODEL_TYPES.get(cfg.get("model_type", ""))
    if family is None:
        raise ModelLoadError(f"unsupported architecture {archs or cfg.get('model_type')!r} "
                             f"(supported: {', '.join(HF_ARCHITECTURES)})")
    return family


def _rope(cfg: dict[str, Any], family: str) -> tuple[float, dict[str, Any], float | None]:
    """(rope_theta, rope_scaling, the sliding layers' base or None) of a config.json: a flat
    `rope_parameters` / `rope_scaling`, or (transformers 5's Gemma 3) one per layer kind."""
    rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    local = None
    if FULL in rope or SLIDING in rope:  # {"full_attention": {...}, "sliding_attention": {...}}
        local = (rope.get(SLIDING) or {}).get("rope_theta")
        rope = dict(rope.get(FULL) or {})
    elif FAMILIES[family].window_pattern:
        local = cfg.get("rope_local_base_freq")
    theta = rope.pop("rope_theta", None) or cfg.get("rope_theta", 10000.0)
    if rope.get("rope_type", rope.get("type")) == "default":
        rope = {}
    return float(theta), rope, None if local is None else float(local)


def _layer_types(cfg: dict[str, Any], family: str) -> tuple[tuple[str, ...], int | None]:
    """(each layer's kind, the window) of a config.json: Mistral-style (one window for
    every layer, no kinds) or, for a family with a window pattern, HF's `layer_types`
    (else `sliding_window_pattern`: layer i is global when (i + 1) % pattern == 0)."""
    pattern = FAMILIES[family].window_pattern
    if not pattern:
        window = cfg.get("sliding_window") if family == "mistral" or cfg.get("use_sliding_window") else None
        return (), window
    kinds = cfg.get("layer_types")
    if not kinds:
        n = int(cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern") or pattern)
        kinds = [FULL if (i + 1) % n == 0 else SLIDING for i in range(cfg["num_hidden_layers"])]
    return tuple(kinds), cfg.get("sliding_window")


def arch_from_hf_config(cfg: dict[str, Any]) -> ModelArch:
    """Build a ModelArch from a parsed config.json. Raises ModelLoadError."""
    family = _family_of(cfg)
    spec = FAMILIES[family]
    cfg = {**dict(spec.hf_defaults), **cfg}
    try:
        heads = cfg["num_attention_heads"]
        hidden = cfg["hidden_size"]
        theta, rope, local_theta = _rope(cfg, family)
        kinds, window = _layer_types(cfg, family)
        eos = cfg.get("eos_token_id")
        arch = ModelArch(
            family=family,
            vocab_size=cfg["vocab_size"],
            hidden_size=hidden,
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or hidden // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=theta,
            rope_scaling=rope,
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qk_norm=spec.qk_norm,
            sliding_window=window,
            torch_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32"),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=tuple(eos if isinstance(eos, list) else [] if eos is None else [eos]),
            layer_types=kinds, rope_local_theta=local_theta,
            query_pre_attn_scalar=cfg.get("query_pre_attn_scalar"),
            hidden_act=cfg.get("hidden_activation") or cfg.get("hidden_act") or spec.activations[0],
            norm_adds_one=spec.norm_adds_one, **_moe_fields(cfg),
        )
    except KeyError as e:
        raise ModelLoadError(f"config.json lacks {e.args[0]!r}") from None
    arch.validate()
    return arch


def _moe_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """ModelArch's mixture-of-experts fields of a config.json (none for a dense model).
    Raises KeyError for an MoE config without its top-k or expert size."""
    experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
    if not experts:
        return {}
    step, only = int(cfg.get("decoder_sparse_step") or 1), set(cfg.get("mlp_only_layers") or ())
    dense = tuple(i for i in range(cfg["num_hidden_layers"]) if i in only or (i + 1) % step)
    return dict(num_experts=experts, experts_per_token=int(cfg["num_experts_per_tok"]),
                expert_intermediate_size=int(cfg["moe_intermediate_size"]),
                norm_topk_prob=bool(cfg.get("norm_topk_prob", False)), dense_layers=dense)
