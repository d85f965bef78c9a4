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
# Gemma 3's text models (the 4B..27B ones' text_config; Gemma3TextConfig's defaults fill the
# rest: head_dim 256, rope 1e6 global / 1e4 local, five local layers to one global)
GEMMA3 = dict(architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", head_dim=256,
              query_pre_attn_scalar=256, tie_word_embeddings=True)
GEMMA3_LARGE = dict(GEMMA3, sliding_window=1024, vocab_size=262208, max_position_embeddings=131072,
                    rope_scaling=dict(rope_type="linear", factor=8.0))
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
    "gemma-3-270m": dict(GEMMA3, num_hidden_layers=18, num_attention_heads=4, num_key_value_heads=1,
                         hidden_size=640, intermediate_size=2048, vocab_size=262144, sliding_window=512,
                         max_position_embeddings=32768),
    "gemma-3-1b": dict(GEMMA3, num_hidden_layers=26, num_attention_heads=4, num_key_value_heads=1,
                       hidden_size=1152, intermediate_size=6912, vocab_size=262144, sliding_window=512,
                       max_position_embeddings=32768),
    "gemma-3-4b": dict(GEMMA3_LARGE, num_hidden_layers=34, num_attention_heads=8, num_key_value_heads=4,
                       hidden_size=2560, intermediate_size=10240),
    "gemma-3-12b": dict(GEMMA3_LARGE, num_hidden_layers=48, num_attention_heads=16, num_key_value_heads=8,
                        hidden_size=3840, intermediate_size=15360),
    "gemma-3-27b": dict(GEMMA3_LARGE, num_hidden_layers=62, num_attention_heads=32, num_key_value_heads=16,
                        head_dim=128, query_pre_attn_scalar=168, hidden_size=5376, intermediate_size=21504),
    "qwen3-30b-a3b": dict(architectures=QWEN3_MOE, num_hidden_layers=48, num_attention_heads=32,
                          num_key_value_heads=4, head_dim=128, hidden_size=2048, intermediate_size=6144,
                          moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
                          vocab_size=151936, max_position_embeddings=40960, rope_theta=1e6, rms_norm_eps=1e-6),
    "smollm2-135m": dict(architectures=LLAMA, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                         hidden_size=576, intermediate_size=1536, vocab_size=49152, max_position_embeddings=8192,
                         tie_word_embeddings=True),
}
