"""One tiny config per model family a VPS user fine-tunes: the architecture zoo of tests/test_zoo.py and
scripts/validate_zoo.py. Each keeps its family's structure (attention layout, norms, MLP or experts, tied
embeddings, sliding windows) at a size that traces and trains in a second or two on a CPU."""

from __future__ import annotations

import transformers as tf

V, H = 256, 64  # vocabulary and hidden size of every member
IDS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)  # inside the tiny vocabulary
COMMON = dict(vocab_size=V, hidden_size=H, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=512, **IDS)


def _gqa(**kw) -> dict:
    return {**COMMON, "num_key_value_heads": 2, **kw}


ZOO = {
    "llama3": lambda: tf.LlamaConfig(**_gqa(intermediate_size=128, rope_theta=500000.0)),
    "qwen2": lambda: tf.Qwen2Config(**_gqa(intermediate_size=128)),
    "qwen3": lambda: tf.Qwen3Config(**_gqa(intermediate_size=128, head_dim=16)),
    "mistral": lambda: tf.MistralConfig(**_gqa(intermediate_size=128, sliding_window=None)),
    "gemma2": lambda: tf.Gemma2Config(**_gqa(intermediate_size=128, head_dim=16, sliding_window=32)),
    "gemma3": lambda: tf.Gemma3TextConfig(**_gqa(intermediate_size=128, head_dim=16, sliding_window=32)),
    "phi3": lambda: tf.Phi3Config(**_gqa(intermediate_size=128)),
    "olmo2": lambda: tf.Olmo2Config(**_gqa(intermediate_size=128)),
    "smollm3": lambda: tf.SmolLM3Config(**_gqa(intermediate_size=128)),
    "gpt_neox": lambda: tf.GPTNeoXConfig(**{**COMMON, "intermediate_size": 128}),
    "gpt2": lambda: tf.GPT2Config(vocab_size=V, n_embd=H, n_layer=2, n_head=4, n_positions=512, **IDS),
    # mixture-of-experts: 8 experts, 2 routed per token
    "qwen3_moe": lambda: tf.Qwen3MoeConfig(**_gqa(intermediate_size=128, moe_intermediate_size=32, head_dim=16,
                                                  num_experts=8, num_experts_per_tok=2, decoder_sparse_step=1)),
    "mixtral": lambda: tf.MixtralConfig(**_gqa(intermediate_size=32, num_local_experts=8, num_experts_per_tok=2,
                                               sliding_window=None)),
    "olmoe": lambda: tf.OlmoeConfig(**_gqa(intermediate_size=32, num_experts=8, num_experts_per_tok=2)),
    "gpt_oss": lambda: tf.GptOssConfig(**_gqa(intermediate_size=32, head_dim=16, num_local_experts=8,
                                              num_experts_per_tok=2, sliding_window=32)),
}
MOE = ("qwen3_moe", "mixtral", "olmoe", "gpt_oss")
