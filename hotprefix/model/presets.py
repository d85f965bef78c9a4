"""Published model shapes by name (the fields of their config.json that shape the
model): `hotprefix size` sizes them and `--load-format dummy` builds random weights of
them. Torch-free."""

from __future__ import annotations

LLAMA3_ROPE = dict(rope_theta=500000.0, rms_norm_eps=1e-5,
                   rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                     original_max_position_embeddings=8192))
# Published configs (the fields that matter for sizing).
LLAMA, MISTRAL, QWEN2, QWEN3 = (["LlamaForCausalLM"], ["MistralForCausalLM"], ["Qwen2ForCausalLM"],
                                ["Qwen3ForCausalLM"])
QWEN3_MOE = ["Qwen3MoeForCausalLM"]
PRESETS: dict[str, dict] = {
    "llama-3.2-1b": dict(architectures=LLAMA, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                         head_dim=64, hidden_size=2048, intermediate_size=8192, vocab_size=128256,
                         max_position_embeddings=131072, tie_word_embeddings=True, **LLAMA3_ROPE),
    "llama-3.2-3b": dict(architectures=LLAMA, num_hidden_layers=28, num_attention_heads=24, num_key_value_heads=8,
                         head_dim=128, hidden_size=3072, intermediate_size=8192, vocab_size=128256,
                         max_position_embeddings=131072, tie_word_embeddings=True, **LLAMA3_ROPE),
    "llama-3.1-8b": dict(architectures=LLAMA, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                         hidden_size=4096, intermediate_size=14336, vocab_size=128256,
                         max_position_embeddings=131072, **LLAMA3_ROPE),
    "llama-3.1-70b": dict(architectures=LLAMA, num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8,
                          hidden_size=8192, intermediate_size=28672, vocab_size=128256,
                          max_position_embeddings=131072, **LLAMA3_ROPE),
    "mistral-7b": dict(architectures=MISTRAL, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                       hidden_size=4096, intermediate_size=14336, vocab_size=32768, max_position_embeddings=32768),
    "qwen2.5-7b": dict(architectures=QWEN2, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                       hidden_size=3584, intermediate_size=18944, vocab_size=152064, max_position_embeddings=32768),
    "qwen3-8b": dict(architectures=QWEN3, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                     head_dim=128, hidden_size=4096, intermediate_size=12288, vocab_size=151936,
                     max_position_embeddings=40960, rope_theta=1e6, rms_norm_eps=1e-6),
    "qwen3-32b": dict(architectures=QWEN3, num_hidden_layers=64, num_attention_heads=64, num_key_value_heads=8,
                      head_dim=128, hidden_size=5120, intermediate_size=25600, vocab_size=151936,
                      max_position_embeddings=40960),
    "qwen3-30b-a3b": dict(architectures=QWEN3_MOE, num_hidden_layers=48, num_attention_heads=32,
                          num_key_value_heads=4, head_dim=128, hidden_size=2048, intermediate_size=6144,
                          moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
                          vocab_size=151936, max_position_embeddings=40960, rope_theta=1e6, rms_norm_eps=1e-6),
    "smollm2-135m": dict(architectures=LLAMA, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                         hidden_size=576, intermediate_size=1536, vocab_size=49152, max_position_embeddings=8192,
                         tie_word_embeddings=True),
}
