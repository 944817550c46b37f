"""Random-init model presets, built from configs (never downloaded).

``tiny`` is the demo and test model: small enough to train on a laptop CPU in a minute. The
``llama-*`` presets follow published Llama-family shapes and are for planning and benchmarks.
"""

from __future__ import annotations

# name -> LlamaConfig keyword arguments. Every linear dimension is a whole number of 64-weight blocks, as
# bitsandbytes' 4-bit CPU kernels want (model.quantize=4bit on a preset).
PRESETS: dict[str, dict] = {
    "tiny": dict(vocab_size=256, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=1024),
    "llama-125m": dict(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
                       num_attention_heads=12, num_key_value_heads=12, max_position_embeddings=4096),
    "llama-350m": dict(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=24,
                       num_attention_heads=16, num_key_value_heads=16, max_position_embeddings=4096),
    "llama-1b": dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                     num_attention_heads=32, num_key_value_heads=4, max_position_embeddings=4096),
    "llama-3b": dict(vocab_size=32000, hidden_size=3200, intermediate_size=8640, num_hidden_layers=26,
                     num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=4096),
    "llama-7b": dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                     num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=4096),
    "llama-13b": dict(vocab_size=32000, hidden_size=5120, intermediate_size=13824, num_hidden_layers=40,
                      num_attention_heads=40, num_key_value_heads=40, max_position_embeddings=4096),
}


def preset_config(name: str):
    """The transformers config of a preset (a LlamaConfig)."""
    from transformers import LlamaConfig

    return LlamaConfig(**PRESETS[name], tie_word_embeddings=False)
