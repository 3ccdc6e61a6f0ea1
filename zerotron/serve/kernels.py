"""Native CPU kernels of the serving engine, built on first use with torch's C++ extension loader.

:func:`paged_attention` attends each query row (a decode, or one position of a prompt) to its
sequence's keys and values up to its own position, where they lie in the paged pool (16-bit, or 8-bit
codes dequantised as they are read), through the sequence's slot list: no gathered copy, no mask. A
row's numbers depend on its own query, keys and values only, so a row gives the same bits in any
batch, in any chunk of its prompt, and as a decode or a prompt row. On CPUs with AMX, bf16 rows with
heads of 64 or 128 attend on tiles (``csrc/attention_tiles.cpp``): per block of rows and KV head the
scores are one tile product Q K^T, each row's softmax over its own keys in fp32 with the probabilities
rounded to bf16 (as flash attention rounds them), P V a tile product summed in key order from key 0;
on AVX512-BF16 without AMX the same on vector registers (``csrc/attention_dot.cpp``); elsewhere fp32.

:func:`tile_linear` is a bf16 linear layer on AMX tiles (the weight packed once by :func:`pack_tiles`),
each output its row times its column summed in fp32 over 32-deep tile products in k order, so a row's
result never depends on the call's row count (oneDNN's does); :func:`vec_linear` the fp32 one on
AVX-512 (one fused multiply-add chain over k in order per output), :func:`dot_linear` the bf16 one on
AVX512-BF16 without AMX (VDPBF16PS steps over pairs of k in order, rounded once to bf16).

:func:`q8_linear` multiplies fp32 rows by 8-bit (or 4-bit) weights with a scale and a min per group
of inputs, read from the files' own tables; :func:`q8a8_linear` multiplies the same weights by the
rows quantised to int8 per 32 inputs, in integers (AVX512-VNNI), as llama.cpp does (``zerotron serve
--quantize-activations``); :func:`q8t_linear` by bf16 rows on AMX tiles, the weights dequantised to
bf16 once per call (``--quantized-tiles``). All give a row the same result in any batch.

:func:`rms_norm` and :func:`silu_mul` are a decoder layer's RMSNorm and SiLU gate in one pass per row
(the model's roundings), cheaper than the torch operators' dispatch at a few rows.

The kernels are compiled once per machine and CPU (``-O3 -march=native``, kept in torch's extension
cache); where no C++ compiler is found, or with ``ZEROTRON_NATIVE_KERNELS=0``, they are unavailable
(:func:`available`) and the engine attends through SDPA and multiplies through oneDNN.
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import shutil
import threading
from collections.abc import Callable
from typing import Any, Optional

import torch

from zerotron.serve import kv_quant
from zerotron.serve.kernel_source import SOURCE as _SOURCE

# Vectorized reductions need reassociation (each build's order is fixed: same bits run to run);
# -ffast-math itself is avoided: linked into a library it would flush denormals process-wide.
_FLAGS = [
    "-O3",
    "-march=native",
    *(["-mprefer-vector-width=512"] if platform.machine() in ("x86_64", "AMD64") else []),
    "-fopenmp",
    "-fassociative-math",
    "-fno-signed-zeros",
    "-fno-trapping-math",
    # no peeling of loop iterations to align a pointer: a reduction's order then depends on the
    # data's length alone, never on where the allocator put a buffer
    "--param=vect-max-peeling-for-alignment=0",
]

# a scale's or a min's factors (the grouped kernels' tables: the second None for one factor)
Factors = tuple[Optional[torch.Tensor], Optional[torch.Tensor]]

_lock = threading.Lock()
_module: Optional[Any] = None
_error: Optional[str] = None


def _cpu_tag() -> str:
    """A short hash of this CPU's model and feature flags: a build for one CPU (``-march=native``) is
    never loaded on another from a shared extension cache."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [ln for ln in f if ln.startswith(("model name", "flags", "Features"))][:2]
    except OSError:
        lines = [platform.processor(), platform.machine()]
    return hashlib.sha256("".join(lines).encode()).hexdigest()[:10]


_NAME = "zerotron_kernels_v37"
_FUNCTIONS = [
    "paged_attention",
    "paged_attention_q8",
    "tiles_built",
    "tile_linear",
    "vec_built",
    "vec_linear",
    "dot_built",
    "dot_cpu",
    "dot_linear",
    "q8_built",
    "q8_cpu",
    "q8_linear",
    "vnni_cpu",
    "q8a8_linear",
    "q8t_linear",
    "rms_norm",
    "silu_mul",
    "rope_store",
    "bind_threads",
]


def _load() -> Any:
    """Build (or load from torch's extension cache) the module. torch's own build lock is a file that
    a builder killed mid-build (a Ctrl-C during the first ``zerotron serve``, a test's timeout) leaves
    behind, and every later build then waits on it forever; so builds here also take an advisory lock
    (``flock``, which the system releases with its holder) and, holding it, remove a torch lock that
    no live builder can own."""
    from torch.utils import cpp_extension

    name = f"{_NAME}_{_cpu_tag()}"
    build_dir = cpp_extension._get_build_directory(name, verbose=False)
    with open(os.path.join(build_dir, "zerotron.flock"), "w") as held:
        try:
            import fcntl

            fcntl.flock(held, fcntl.LOCK_EX)  # waits on a live builder only
            stale = os.path.join(build_dir, "lock")
            if os.path.exists(stale):
                os.remove(stale)
        except ImportError:  # no flock on this system: torch's lock alone
            pass
        return cpp_extension.load_inline(
            name=name,
            cpp_sources=[_SOURCE],
            functions=_FUNCTIONS,
            extra_cflags=_FLAGS,
            extra_ldflags=["-fopenmp"],  # libgomp.so.1: the one torch has loaded
            build_directory=build_dir,
            verbose=False,
        )


def _build() -> Optional[Any]:
    global _module, _error
    with _lock:
        if _module is None and _error is None:
            if os.environ.get("ZEROTRON_NATIVE_KERNELS", "1") == "0":
                _error = "turned off by ZEROTRON_NATIVE_KERNELS=0"
                return None
            compiler = os.environ.get("CXX") or "c++"  # what torch's extension loader runs
            if shutil.which(compiler) is None:
                _error = f"no C++ compiler found ({compiler!r} is not on the PATH; install g++ or set CXX)"
                return None
            try:
                _module = _load()
            except Exception as err:  # noqa: BLE001 - no compiler, no ninja: the SDPA path serves
                _error = (
                    f"{type(err).__name__}: {str(err).strip().splitlines()[-1] if str(err).strip() else ''}"
                )
        return _module


def _built() -> Any:
    module = _build()
    if module is None:
        raise RuntimeError(f"the native kernels are not available ({_error})")
    return module


def available() -> bool:
    """Whether the native kernels are built (building them on the first call)."""
    return _build() is not None


def why_unavailable() -> Optional[str]:
    """Why :func:`available` is False (None when it is True)."""
    _build()
    return _error


ATTENTION_KERNELS = ("fp32", "tiles", "dot")


def paged_attention(
    q: torch.Tensor,
    k_pool: Any,
    v_pool: Any,
    slots: torch.Tensor,
    lens: torch.Tensor,
    seq: Optional[torch.Tensor] = None,
    kernel: Optional[str] = None,
) -> torch.Tensor:
    """Attention of query rows to their sequences' keys: q (rows, heads, d); k/v pools (slots, kv_heads,
    d), or an 8-bit pool's :class:`~zerotron.serve.kv_quant.QuantizedKV` each; ``slots`` (sequences,
    width) each sequence's key slots in position order; ``seq`` (rows,) each row's sequence (default:
    row r reads slot list r); ``lens`` (rows,) how many of its sequence's keys a row attends (its
    position + 1). Returns (rows, heads, d) in q's dtype; softmax scale 1/sqrt(d).

    ``kernel`` (default: :func:`attention_kernel`): ``"tiles"`` (AMX) or ``"dot"`` (AVX512-BF16) for
    bf16 rows with heads of 64 or 128, the scores and the weighted sums as matrix products (the
    probabilities rounded to bf16, as flash attention rounds them); ``"fp32"``, fp32 arithmetic on
    AVX-512, on AVX2 (heads of a multiple of 8 up to 256, where the CPU has no AVX-512) or in the
    generic loop. Whichever, a row's numbers are its own: the same alone, beside other
    rows, as a prompt row or as a decode. An 8-bit pool is read in place by the tiles and dot kernels
    (the bits they give its :func:`~zerotron.serve.kv_quant.dequantize`'d pool); not by fp32."""
    if seq is None:
        seq = torch.arange(q.shape[0])
    if kernel is None:
        kernel = attention_kernel(q.dtype, q.shape[-1])
    elif kernel not in ATTENTION_KERNELS:
        raise ValueError(f"kernel={kernel!r}: one of {', '.join(ATTENTION_KERNELS)}")
    elif kernel != "fp32":
        if not (q.dtype == torch.bfloat16 and q.shape[-1] in (64, 128)):
            raise ValueError(
                f"kernel={kernel!r} takes bf16 heads of 64 or 128, not {q.dtype} of {q.shape[-1]}"
            )
        why = why_no_tiles() if kernel == "tiles" else why_no_dot()
        if why is not None:  # the tiles' check also asks the kernel for the tile registers
            raise RuntimeError(f"no {kernel} attention here: {why}")
    scale, index = q.shape[-1] ** -0.5, ATTENTION_KERNELS.index(kernel)
    if isinstance(k_pool, torch.Tensor):
        out: torch.Tensor = _built().paged_attention(q, k_pool, v_pool, slots, seq, lens, scale, index)
    elif kernel == "fp32":
        raise ValueError("an 8-bit KV pool is read in place by the tiles and dot kernels only, not fp32")
    else:
        k, v = (k_pool.codes, k_pool.scales), (v_pool.codes, v_pool.scales)
        fmt = kv_quant.KERNEL_FORMATS[k_pool.fmt]
        out = _built().paged_attention_q8(q, *k, *v, fmt, slots, seq, lens, scale, index)
    return out


def attention_kernel(dtype: torch.dtype, head_dim: int) -> str:
    """The attention kernel :func:`paged_attention` runs by default for rows of ``dtype`` and heads of
    ``head_dim``: bf16 heads of 64 or 128 on AMX tiles where the CPU has them, else on AVX512-BF16 where
    it has that; everything else in fp32 arithmetic."""
    if dtype == torch.bfloat16 and head_dim in (64, 128):
        if _tiles_here():
            return "tiles"
        if _dot_here():
            return "dot"
    return "fp32"


@functools.lru_cache(maxsize=1)
def _dot_here() -> bool:
    return dot_available()


@functools.lru_cache(maxsize=1)
def _tiles_here() -> bool:
    return tiles_available()


def _why_no_kernel(built: str, cpu: Callable[[Any], bool], code: str, instructions: str) -> Optional[str]:
    """Why a native linear kernel cannot run here (None when it can): the kernels not built, this build
    without the kernel's ``code`` (``built`` names the module's probe), or ``cpu(module)`` False (the
    CPU lacks its ``instructions``)."""
    module = _build()
    if module is None:
        return f"the native kernels are not available ({_error})"
    if not getattr(module, built)():
        return f"this build has no {code}"
    if not cpu(module):
        return instructions
    return None


def tiles_available() -> bool:
    """Whether bf16 linears can run on AMX tiles here (:func:`tile_linear`): the kernels built with
    tile code (x86-64), a CPU with AMX, and the kernel's leave to use its tile registers."""
    return why_no_tiles() is None


def why_no_tiles() -> Optional[str]:
    """Why :func:`tiles_available` is False (None when it is True)."""
    return _why_no_kernel(
        "tiles_built",
        lambda m: bool(torch.cpu._is_amx_tile_supported() and torch.cpu._init_amx()),
        "AMX tile code (an x86-64 CPU and GCC 11+ or clang are needed)",
        "this CPU has no AMX tiles (or the kernel refuses their use)",
    )


def pack_tiles(weight: torch.Tensor) -> torch.Tensor:
    """A bf16 (N, K) weight as :func:`tile_linear` reads it: (ceil(N/16), ceil(K/32), 16, 16, 2), each
    16-column, 32-deep block one AMX B tile (16 pairs of k, each pair's two values of 16 columns side
    by side); N and K padded with zeros."""
    if weight.dtype != torch.bfloat16 or weight.dim() != 2:
        raise ValueError(f"pack_tiles takes a 2-D bf16 weight, not {weight.dtype} {tuple(weight.shape)}")
    n, k = weight.shape
    padded = torch.nn.functional.pad(weight.detach(), (0, -k % 32, 0, -n % 16))
    blocks = padded.view(padded.shape[0] // 16, 16, padded.shape[1] // 32, 16, 2)
    return blocks.permute(0, 2, 3, 1, 4).contiguous()


def tile_linear(x: torch.Tensor, packed: torch.Tensor, bias: Optional[torch.Tensor], n: int) -> torch.Tensor:
    """``x @ weight.T + bias`` for bf16 rows ``x`` (..., K) on AMX tiles, ``packed`` from
    :func:`pack_tiles`, ``bias`` fp32 (n,) or None; (..., n) in bf16. Each output is its row times
    its column summed in fp32 over k in 32-deep tile products in k order, the bias added, rounded once:
    a row's result is the same in any batch (any row count, any threads)."""
    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1:  # the kernel reads each row's k in place
        rows = rows.contiguous()
    y: torch.Tensor = _built().tile_linear(rows, packed, bias, n)
    return y.view(*x.shape[:-1], n)


def vec_available() -> bool:
    """Whether fp32 linears can run on AVX-512 here (:func:`vec_linear`): the kernels built with its
    code (x86-64) and a CPU with AVX-512F."""
    return why_no_vec() is None


def why_no_vec() -> Optional[str]:
    """Why :func:`vec_available` is False (None when it is True)."""
    return _why_no_kernel(
        "vec_built",
        lambda m: bool(torch.cpu._is_avx512_supported()),
        "AVX-512 linear code (an x86-64 CPU and GCC or clang are needed)",
        "this CPU has no AVX-512",
    )


def dot_available() -> bool:
    """Whether bf16 linears can run on AVX512-BF16 here (:func:`dot_linear`): the kernels built with
    its code (x86-64, GCC 10+ or clang) and a CPU with AVX512-BF16."""
    return why_no_dot() is None


def why_no_dot() -> Optional[str]:
    """Why :func:`dot_available` is False (None when it is True)."""
    return _why_no_kernel(
        "dot_built",
        lambda m: bool(m.dot_cpu()),
        "AVX512-BF16 linear code (an x86-64 CPU and GCC 10+ or clang are needed)",
        "this CPU has no AVX512-BF16",
    )


def q8_available() -> bool:
    """Whether 8-bit weights with per-group scales can run on zerotron's kernel here
    (:func:`q8_linear`): the kernels built with its code (x86-64) and a CPU with AVX2, FMA and F16C."""
    return why_no_q8() is None


def why_no_q8() -> Optional[str]:
    """Why :func:`q8_available` is False (None when it is True)."""
    return _why_no_kernel(
        "q8_built",
        lambda m: bool(m.q8_cpu()),
        "8-bit linear code (an x86-64 CPU and GCC or clang are needed)",
        "this CPU has no AVX2 (with FMA and F16C)",
    )


def q8_linear(
    x: torch.Tensor,
    values: torch.Tensor,
    scales: Factors,
    mins: Factors = (None, None),
    offset: int = 0,
    add_mins: bool = False,
) -> torch.Tensor:
    """``x @ w.T`` for rows ``x`` (..., K) and a weight ``w`` (n, K) of 8-bit ``values`` (n, groups,
    group) int8, any strides but the last, ``group`` a multiple of 8 — or 4-bit ones two a byte,
    (n, groups, group / 2) uint8, input 2j in the low half, each value the nibble less ``offset``
    (the 4-bit formats and GGUF Q2_K's and Q3_K's as zerotron keeps them) — : ``w = q·s − m`` (``q·s
    + m`` where ``add_mins``: GGUF Q4_1's), each group's scale ``s`` the product of the factors
    ``scales`` and its min ``m`` that of ``mins`` (none when the first is None). A factor is a table
    (n, groups / per) of f32, f16, bf16, int8 or uint8, any strides, its entry per ``per``
    consecutive groups: the files' tables as they are (GGUF Q8_0's f16 scales;
    Q5_K's and Q6_K's f16 super-block scales times their small-integer group scales; GPTQ's scales and
    zeros times scales). The weights are dequantised slice by slice into fp32 (exactly: 8-bit values
    times f16-sized scales) and each output is 8 fused multiply-add chains over k in order, added in a
    fixed tree: a row's result is the same in any batch. Returns (..., n) fp32."""
    return _grouped("q8_linear", x, values, scales, mins, offset, add_mins)


def _grouped(entry: str, x: torch.Tensor, values: torch.Tensor, *tables: Any) -> torch.Tensor:
    """``x``'s rows (fp32; bf16 for q8t) through the grouped kernel ``entry`` (scales, mins, offset, add_mins)."""
    scales, mins, offset, add_mins = tables
    rows = x.reshape(-1, x.shape[-1]).to(torch.bfloat16 if entry == "q8t_linear" else torch.float32)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    y: torch.Tensor = getattr(_built(), entry)(
        rows, values, scales[0], scales[1], mins[0], mins[1], offset, add_mins
    )
    return y.view(*x.shape[:-1], values.shape[0])


def q8a8_available() -> bool:
    """Whether :func:`q8a8_linear` runs here: the kernels built with its code (x86-64) and a CPU with
    AVX512-VNNI (with AVX512-BW, -VL and -DQ)."""
    return why_no_q8a8() is None


def why_no_q8a8() -> Optional[str]:
    """Why :func:`q8a8_available` is False (None when it is True)."""
    return _why_no_kernel(
        "q8_built",
        lambda m: bool(m.vnni_cpu()),
        "8-bit linear code (an x86-64 CPU and GCC or clang are needed)",
        "this CPU has no AVX512-VNNI (with AVX512-BW, -VL and -DQ)",
    )


def q8t_available() -> bool:
    """Whether :func:`q8t_linear` runs here (:func:`q8_available` and :func:`tiles_available`)."""
    return why_no_q8t() is None


def why_no_q8t() -> Optional[str]:
    return why_no_q8() or why_no_tiles()


def q8t_linear(
    x: torch.Tensor,
    values: torch.Tensor,
    scales: Factors,
    mins: Factors = (None, None),
    offset: int = 0,
    add_mins: bool = False,
) -> torch.Tensor:
    """:func:`q8_linear`'s weights times bf16 rows on AMX tiles, K a multiple of 32: per 32 outputs the
    weights are dequantised as :func:`q8_linear` dequantises them and rounded once to bf16
    (``kernel_definitions.dequantized_bf16``), then multiplied by every row of the call in 32-deep
    tile products, each output summed in fp32 over k in order, rounded once to bf16: a row's result is
    its own at any batch. Each weight is dequantised once a call. Returns (..., n) bf16."""
    return _grouped("q8t_linear", x, values, scales, mins, offset, add_mins)


def q8a8_linear(
    x: torch.Tensor,
    values: torch.Tensor,
    scales: Factors,
    mins: Factors = (None, None),
    offset: int = 0,
    add_mins: bool = False,
) -> torch.Tensor:
    """:func:`q8_linear`'s product with the rows quantised to 8 bits, as llama.cpp and vLLM's GGUF
    kernels multiply: each row's blocks of 32 inputs as
    :func:`~zerotron.serve.kernel_definitions.quantize_rows` defines them, the
    integer products of those and the weights' values summed exactly (AVX512-VNNI), scaled by the
    groups' scales times the blocks' ``d``, less the mins times the quantised inputs' sums. In real
    arithmetic it is ``quantize_rows(x) @ w.T``; in fp32 each output is 16 lanes of fused
    multiply-adds in k order, added in a fixed tree: a row's result is the same in any batch. The
    same operands as :func:`q8_linear` but bf16 weights. Returns (..., n) fp32."""
    return _grouped("q8a8_linear", x, values, scales, mins, offset, add_mins)


def pack_wide(weight: torch.Tensor) -> torch.Tensor:
    """A bf16 weight (n, K) for :func:`wide_linear`: contiguous, K padded with zero weights to a
    multiple of 8, viewed as one group (n, 1, K8)."""
    w = weight.detach().to(torch.bfloat16)
    k = w.shape[1]
    w = torch.nn.functional.pad(w, (0, -k % 8)).contiguous()
    return w.view(w.shape[0], 1, w.shape[1])


def wide_linear(x: torch.Tensor, packed: torch.Tensor, bias: Optional[torch.Tensor], n: int) -> torch.Tensor:
    """``x @ weight.T + bias`` for bf16 rows ``x`` (..., K) on AVX2, ``packed`` from :func:`pack_wide`,
    ``bias`` fp32 (n,) or None; (..., n) in ``x``'s dtype. The 8-bit kernel's blocking with the bf16
    weights widened to fp32 slice by slice (:func:`q8_linear`): each output 8 fused multiply-add chains
    over k in order, added in a fixed tree, the bias added in fp32, rounded once — a row's result is
    the same in any batch, from one row up."""
    k = x.shape[-1]
    if packed.shape[2] != k:  # the weight's zero-padded inputs
        x = torch.nn.functional.pad(x, (0, packed.shape[2] - k))
    y = q8_linear(x, packed, (None, None))  # bf16 values: the weights themselves, no scales
    if bias is not None:
        y = y + bias
    return y.to(x.dtype)


def why_no_native_matmul(dtype: torch.dtype) -> Optional[str]:
    """Why linears of ``dtype`` cannot run on a native kernel here (None when they can): bf16 on AMX
    tiles (:func:`tile_linear`) or, without AMX, on AVX512-BF16 (:func:`dot_linear`), or without
    either on AVX2 (:func:`wide_linear`); fp32 on AVX-512 (:func:`vec_linear`), no other dtype."""
    if dtype == torch.bfloat16:
        no_tiles = why_no_tiles()
        if no_tiles is None:
            return None
        no_dot = why_no_dot()
        if no_dot is None:
            return None
        no_wide = why_no_q8()
        return None if no_wide is None else f"{no_tiles}; {no_dot}; {no_wide}"
    if dtype == torch.float32:
        return why_no_vec()
    return f"the native linears are bf16 (AMX, AVX512-BF16 or AVX2) and fp32 (AVX-512), not {dtype}"


def native_linear(
    dtype: torch.dtype,
) -> tuple[Callable[[torch.Tensor], torch.Tensor], Callable[..., torch.Tensor], str]:
    """The native kernel for linears of ``dtype`` here: (pack, run, name), ``pack`` the weight's
    packing, ``run(x, packed=, bias=, n=)`` the product; bf16 on AMX tiles where the CPU has them,
    else on AVX512-BF16, else on AVX2; fp32 on AVX-512. Raises where :func:`why_no_native_matmul`
    says why not."""
    why = why_no_native_matmul(dtype)
    if why is not None:
        raise RuntimeError(f"the native matmul is not available: {why}")
    if dtype == torch.float32:
        return pack_vec, vec_linear, "native AVX-512"
    if tiles_available():
        return pack_tiles, tile_linear, "native tiles"
    if dot_available():
        return pack_dot, dot_linear, "native AVX512-BF16"
    return pack_wide, wide_linear, "native AVX2"


def pack_vec(weight: torch.Tensor) -> torch.Tensor:
    """An fp32 (N, K) weight as :func:`vec_linear` reads it: (ceil(N/48), K, 48), each 48-column panel
    k-major (the 48 columns' values of one k side by side); N padded with zeros."""
    if weight.dtype != torch.float32 or weight.dim() != 2:
        raise ValueError(f"pack_vec takes a 2-D fp32 weight, not {weight.dtype} {tuple(weight.shape)}")
    n, k = weight.shape
    padded = torch.nn.functional.pad(weight.detach(), (0, 0, 0, -n % 48))
    packed = padded.view(-1, 48, k).transpose(1, 2).contiguous()
    if packed.data_ptr() % 64:  # the kernel loads whole 64-byte lines (torch's CPU allocations are)
        raise RuntimeError("pack_vec: the allocator returned a weight not 64-byte aligned")
    return packed


def vec_linear(x: torch.Tensor, packed: torch.Tensor, bias: Optional[torch.Tensor], n: int) -> torch.Tensor:
    """``x @ weight.T + bias`` for fp32 rows ``x`` (..., K) on AVX-512, ``packed`` from :func:`pack_vec`,
    ``bias`` fp32 (n,) or None; (..., n). Each output is one fused multiply-add chain over k in order,
    then the bias: a row's result is the same in any batch (any row count, any threads)."""
    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1:  # the kernel reads each row's k in place
        rows = rows.contiguous()
    y: torch.Tensor = _built().vec_linear(rows, packed, bias, n)
    return y.view(*x.shape[:-1], n)


def pack_dot(weight: torch.Tensor) -> torch.Tensor:
    """A bf16 (N, K) weight as :func:`dot_linear` reads it: (ceil(N/48), ceil(K/2), 48, 2), each
    48-column panel pair-major (for each pair of k, the two values of each of the 48 columns side by
    side); N and K padded with zeros."""
    if weight.dtype != torch.bfloat16 or weight.dim() != 2:
        raise ValueError(f"pack_dot takes a 2-D bf16 weight, not {weight.dtype} {tuple(weight.shape)}")
    padded = torch.nn.functional.pad(weight.detach(), (0, -weight.shape[1] % 2, 0, -weight.shape[0] % 48))
    n, k = padded.shape
    packed = padded.view(n // 48, 48, k // 2, 2).permute(0, 2, 1, 3).contiguous()
    if packed.data_ptr() % 64:  # the kernel loads whole 64-byte lines (torch's CPU allocations are)
        raise RuntimeError("pack_dot: the allocator returned a weight not 64-byte aligned")
    return packed


def dot_linear(x: torch.Tensor, packed: torch.Tensor, bias: Optional[torch.Tensor], n: int) -> torch.Tensor:
    """``x @ weight.T + bias`` for bf16 rows ``x`` (..., K) on AVX512-BF16, ``packed`` from
    :func:`pack_dot`, ``bias`` fp32 (n,) or None; (..., n) in bf16. Each output is one chain of
    VDPBF16PS steps over the pairs of k in order (fp32 sums), the bias added, rounded once: a row's
    result is the same in any batch (any row count, any threads)."""
    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1:  # the kernel reads each row's k in place
        rows = rows.contiguous()
    y: torch.Tensor = _built().dot_linear(rows, packed, bias, n)
    return y.view(*x.shape[:-1], n)


def bind_threads(cpus: list[list[int]]) -> list[bool]:
    """Bind thread ``t`` of the calling thread's OpenMP team to the CPUs ``cpus[t]`` (a list per
    thread, :mod:`zerotron.serve.affinity`); whether each thread took it."""
    return [bool(b) for b in _built().bind_threads(cpus)]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of the last dimension of ``x`` (any leading shape; ``weight`` in x's dtype), the model's
    roundings (:class:`~zerotron.models.llama.RMSNorm`: the statistic in fp32, the normalised row
    rounded to the dtype, times the weight rounded again) in one pass per row; each row's result is
    its own in any batch."""
    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    y: torch.Tensor = _built().rms_norm(rows, weight, eps)
    return y.view(x.shape)


def silu_mul(gate_up: torch.Tensor, width: int) -> torch.Tensor:
    """``silu(gate) * up`` for ``gate_up`` (..., 2 width), the gate's columns first: SiLU rounded to the
    dtype before the product, as the model's ``F.silu(gate) * up``; each row's result is its own."""
    rows = gate_up.reshape(-1, gate_up.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    y: torch.Tensor = _built().silu_mul(rows, width)
    return y.view(*gate_up.shape[:-1], width)


def rope_store(
    y: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    slots: torch.Tensor,
    heads: int,
) -> torch.Tensor:
    """A decoder layer's fused q/k/v product ``y`` (rows, (heads + 2 kv_heads) d) -> its q heads rotated,
    (rows, heads, d), in one pass per row that also rotates the k heads and writes them and the v
    heads to the pools at ``slots`` (rows,); cos/sin (rows, d). The model's roundings
    (:func:`~zerotron.models.llama.apply_rotary`: each product rounded to the dtype, then the sum), so
    the same bits as its torch operators; each row's result is its own."""
    q: torch.Tensor = _built().rope_store(y, cos, sin, k_pool, v_pool, slots, heads)
    return q
