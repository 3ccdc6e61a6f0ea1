"""Write a GPTQ, AWQ or compressed-tensors 4-bit checkpoint (GPTQ and compressed-tensors: or 8-bit,
``--bits 8``) of a Hugging Face directory for ``benchmarks/serve_quant.py --gptq/--awq/--compressed-tensors``: the decoder linears rounded to nearest in groups and packed as
AutoGPTQ's and AutoAWQ's packers lay them out, or by the compressed-tensors library itself
(``tests/packing.py``); the rest copied. The values are not GPTQ's or AWQ's
choice (no calibration here), the layout and the bytes served are.

    PYTHONPATH=. python benchmarks/make_packed.py MODEL_HF_DIR OUT_DIR --method gptq --group 64
"""

from __future__ import annotations

import argparse
from pathlib import Path

from tests.packing import compressed_tensors_directory, packed_directory


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model_dir", help="a Hugging Face directory with one model.safetensors")
    p.add_argument("out_dir")
    p.add_argument("--method", choices=["gptq", "awq", "compressed-tensors"], default="gptq")
    p.add_argument("--group", type=int, default=64, help="inputs per scale (-1: one per row)")
    p.add_argument("--act-order", action="store_true", help="GPTQ: inputs assigned to groups out of order")
    p.add_argument(
        "--bits",
        type=int,
        choices=[2, 3, 4, 8],
        default=4,
        help="8: GPTQ and compressed-tensors only; 2, 3: GPTQ only",
    )
    args = p.parse_args()
    src, out = Path(args.model_dir), Path(args.out_dir)
    if args.method == "compressed-tensors":  # by the compressed-tensors library itself
        compressed_tensors_directory(src, out, args.group, sym=True, bits=args.bits)
    else:
        packed_directory(src, out, args.method, args.group, args.act_order, sym=True, bits=args.bits)
    print(f"wrote {args.out_dir} ({args.method}, {args.bits}-bit, groups of {args.group})")


if __name__ == "__main__":
    main()
