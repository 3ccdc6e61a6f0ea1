"""Write a Hugging Face directory of a larger model for the serving benchmarks: SmolLM2-1.7B's
architecture (its published config.json: 24 layers, hidden 2048, 32 heads, no grouped KV, MLP 8192,
SmolLM2's 49,152-token vocabulary, tied head) with random weights (transformers' own
initialisation, seeded), and SmolLM2's tokenizer copied from a SmolLM2 directory. Its text means
nothing: it is for throughput, memory and latency, not for quality or a draft's acceptance.

    python benchmarks/make_random_model.py SMOL_HF_DIR OUT_DIR [--layers 24] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import torch

SMOLLM2_1_7B = dict(  # SmolLM2-1.7B-Instruct's config.json
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=24,
    num_attention_heads=32,
    num_key_value_heads=32,
    vocab_size=49152,
    max_position_embeddings=8192,
    rope_theta=130000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
    bos_token_id=1,
    eos_token_id=2,
)
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("tokenizer_dir", help="a SmolLM2 Hugging Face directory (its tokenizer is copied)")
    p.add_argument("out_dir")
    p.add_argument("--layers", type=int, default=24, help="decoder layers (24: SmolLM2-1.7B's)")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**{**SMOLLM2_1_7B, "num_hidden_layers": args.layers})
    torch.manual_seed(args.seed)
    model = LlamaForCausalLM(config).to(getattr(torch, args.dtype)).eval()
    out = Path(args.out_dir)
    model.save_pretrained(out, max_shard_size="100GB")  # one model.safetensors
    for name in TOKENIZER_FILES:
        if (Path(args.tokenizer_dir) / name).exists():
            shutil.copy(Path(args.tokenizer_dir) / name, out / name)
    n = sum(t.numel() for t in model.parameters())
    print(f"wrote {out}: {n / 1e9:.2f} B parameters in {args.dtype}")


if __name__ == "__main__":
    main()
