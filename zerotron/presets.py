"""Model presets: architecture fields under Hugging Face's Llama names.

Pure data, no torch: ``zerotron plan`` and the config layer read it on any machine. The figures are
those published in each model's Hugging Face ``config.json``.
"""

from __future__ import annotations

from typing import Any

PRESETS: dict[str, dict[str, Any]] = {
    # The default job's and the tests' model: a few million parameters, byte-level vocabulary.
    "tiny": dict(
        hidden_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=352,
        vocab_size=256 + 3,
        max_position_embeddings=1024,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        rms_norm_eps=1e-5,
        mlp="gated",
    ),
    "smollm2-135m": dict(
        hidden_size=576,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        intermediate_size=1536,
        vocab_size=49152,
        max_position_embeddings=8192,
        rope_theta=100000.0,
        tie_word_embeddings=True,
        rms_norm_eps=1e-5,
        mlp="gated",
    ),
    # Mixture of experts (Mixtral-8x7B-v0.1's config.json): 46.7 B parameters, 12.9 B active per token.
    "mixtral-8x7b": dict(
        hidden_size=4096,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        intermediate_size=14336,
        vocab_size=32000,
        max_position_embeddings=32768,
        rope_theta=1000000.0,
        tie_word_embeddings=False,
        rms_norm_eps=1e-5,
        mlp="gated",
        num_local_experts=8,
        num_experts_per_tok=2,
    ),
    "llama3-8b": dict(
        hidden_size=4096,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        intermediate_size=14336,
        vocab_size=128256,
        max_position_embeddings=8192,
        rope_theta=500000.0,
        tie_word_embeddings=False,
        rms_norm_eps=1e-5,
        mlp="gated",
    ),
    "llama3-70b": dict(
        hidden_size=8192,
        num_hidden_layers=80,
        num_attention_heads=64,
        num_key_value_heads=8,
        intermediate_size=28672,
        vocab_size=128256,
        max_position_embeddings=8192,
        rope_theta=500000.0,
        tie_word_embeddings=False,
        rms_norm_eps=1e-5,
        mlp="gated",
    ),
    "qwen2.5-7b": dict(
        hidden_size=3584,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        intermediate_size=18944,
        vocab_size=152064,
        max_position_embeddings=32768,
        rope_theta=1000000.0,
        tie_word_embeddings=False,
        rms_norm_eps=1e-6,
        attention_bias=True,
        mlp="gated",
    ),
}
