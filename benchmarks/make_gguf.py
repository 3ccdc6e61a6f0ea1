"""A copy of a GGUF file with its quantised matrices requantised to Q8_0 (benchmarks of the 8-bit path).

Every 2-d tensor of another quantised type (SmolLM2's package file: Q4_1) is dequantised and quantised
again to Q8_0 by the ``gguf`` package's own ``quants`` (llama.cpp's arithmetic); the metadata, the
tokenizer, the Q8_0 and float tensors are copied as they are. The values are the source's (rounded
once more, to 8 bits), so a model served from the copy answers as the source does; what changes is
the format the server reads.

    python benchmarks/make_gguf.py SRC.gguf OUT.gguf
"""

from __future__ import annotations

import argparse

import gguf
import numpy as np
from gguf import GGMLQuantizationType as Q


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("src")
    p.add_argument("out")
    args = p.parse_args()
    reader = gguf.GGUFReader(args.src)
    arch = str(reader.fields[gguf.Keys.General.ARCHITECTURE].contents())
    writer = gguf.GGUFWriter(args.out, arch=arch)
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue  # written by the writer itself
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), kind, sub_type=sub)
    data: list[np.ndarray] = []
    changed = 0
    for t in reader.tensors:
        raw, kind = np.asarray(t.data), t.tensor_type
        if kind not in (Q.F32, Q.F16, Q.BF16, Q.Q8_0) and len(t.shape) == 2:
            values = gguf.quants.dequantize(raw, kind)
            raw, kind = gguf.quants.quantize(values.astype(np.float32), Q.Q8_0), Q.Q8_0
            changed += 1
        writer.add_tensor_info(t.name, raw.shape, raw.dtype, raw.nbytes, raw_dtype=kind)
        data.append(raw)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for raw in data:
        writer.write_tensor_data(raw)
    writer.close()
    print(f"{args.out}: {changed} tensors requantised to Q8_0, {len(data) - changed} copied")


if __name__ == "__main__":
    main()
