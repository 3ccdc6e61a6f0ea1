"""The C++ source of :mod:`zerotron.serve.kernels`, compiled there on first use into one extension.

The source is one translation unit kept in fourteen files under ``csrc/`` (package data), joined in this
order, byte for byte:

- ``attention.cpp``: the includes, the anonymous namespace's start, the paged-attention kernels (the
  generic loop, AVX-512);
- ``attention_avx2.cpp``: the paged attention on AVX2 and FMA (it uses the row blocks and their
  dealing to threads of ``attention.cpp``), and the attention's dispatch, ``attend``;
- ``linear.cpp``: the linear layers' kernels (AMX tiles for bf16, AVX-512 for fp32, AVX512-BF16 for
  bf16), inside the namespace;
- ``linear_int8.cpp``: the linear layers of 8-bit weights with a scale (and a min) per group of
  inputs, on AVX2, inside the namespace;
- ``linear_vnni.cpp``: the linear layers of those weights times 8-bit-quantised activations, on
  AVX512-VNNI, inside the namespace;
- ``linear_a8_avx2.cpp``: the same products on AVX2 (a CPU without AVX512-VNNI), with the VNNI
  kernel's bits, inside the namespace;
- ``linear_vnni_tasks.cpp``: their decode's factors read with the tables' kinds as template
  arguments (the next file's path reads them too), the one-row kernel of a decode, and the products'
  tasks and entry, inside the namespace;
- ``linear_wide.cpp``: the fp32-activation kernel's direct path of 1 to 8 rows on AVX-512 (two
  outputs a register, blocks of up to 6 outputs), inside the namespace;
- ``linear_qtiles.cpp``: the same weights dequantised to bf16 times bf16 rows, on AVX512-BF16 (it uses
  the blocks of ``linear.cpp``'s AVX512-BF16 kernel) and on AMX tiles (its tile helpers), both with the
  dequantisation of ``linear_int8.cpp``, inside the namespace;
- ``attention_dot.cpp``: the paged attention of bf16 rows on AVX512-BF16 (it uses the row blocks and
  their dealing to threads of ``attention.cpp``; its packing and softmax helpers serve the tile kernel
  too);
- ``attention_tiles.cpp``: the paged attention of bf16 rows on AMX tiles (it uses the tile helpers of
  ``linear.cpp`` and those of ``attention_dot.cpp``);
- ``layer.cpp``: the decoder layer's elementwise steps (RMSNorm, SiLU(gate)·up, RoPE and the cache
  store), the namespace's end, the attention entry point;
- ``linear_entries.cpp``: the linear kernels' entry points, and the prepared products of the grouped
  kernels (``q8_prepare``/``q8_run``: several products of the same rows, checked once, run in one
  parallel region);
- ``entries.cpp``: the elementwise steps' entry points, ``q8_layer`` (a quantised decoder layer's
  step in one call, from the entry points above) and ``native_layer`` (the same for a layer whose
  products run on the native bf16 or fp32 linear kernels).

What each kernel computes and why is documented in :mod:`zerotron.serve.kernels` and beside each
function in the files.
"""

from __future__ import annotations

from importlib import resources

PARTS = (
    "attention.cpp",
    "attention_avx2.cpp",
    "linear.cpp",
    "linear_int8.cpp",
    "linear_vnni.cpp",
    "linear_a8_avx2.cpp",
    "linear_vnni_tasks.cpp",
    "linear_wide.cpp",
    "linear_qtiles.cpp",
    "attention_dot.cpp",
    "attention_tiles.cpp",
    "layer.cpp",
    "linear_entries.cpp",
    "entries.cpp",
)


def read_source() -> str:
    """The translation unit: the parts of ``csrc/`` joined in :data:`PARTS`' order."""
    folder = resources.files("zerotron.serve").joinpath("csrc")
    return "".join(folder.joinpath(name).read_text(encoding="utf-8") for name in PARTS)


SOURCE = read_source()
