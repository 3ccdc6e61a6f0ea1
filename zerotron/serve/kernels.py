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

The linear layers' kernels, built in the same module, are :mod:`zerotron.serve.linear_kernels`'s.

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


_NAME = "zerotron_kernels_v127"
_FUNCTIONS = [
    "paged_attention",
    "paged_attention_q8",
    "tiles_built",
    "tile_linear",
    "tile_gated",
    "vec_built",
    "vec_cpu",
    "vec_avx2",
    "vec_code",
    "vec_linear",
    "dot_built",
    "dot_cpu",
    "dot_linear",
    "q8_built",
    "q8_cpu",
    "q8_linear",
    "vnni_cpu",
    "q8a8_linear",
    "q8_avx2",
    "q8_prepare",
    "q8_release",
    "q8_run",
    "q8t_linear",
    "q8d_linear",
    "rms_norm",
    "silu_mul",
    "rope_store",
    "rope_store_q8",
    "bind_threads",
    "q8_layer",
    "native_layer",
]


def _load(march: str = "native") -> Any:
    """Build (or load from torch's extension cache) the module. torch's own build lock is a file that
    a builder killed mid-build (a Ctrl-C during the first ``zerotron serve``, a test's timeout) leaves
    behind, and every later build then waits on it forever; so builds here also take an advisory lock
    (``flock``, which the system releases with its holder) and, holding it, remove a torch lock that
    no live builder can own. ``march``: the CPU to build for (:func:`build_for`)."""
    from torch.utils import cpp_extension

    name = f"{_NAME}_{_cpu_tag()}" if march == "native" else f"{_NAME}_{march}_{_cpu_tag()}"
    flags = _FLAGS
    if march != "native":
        flags = [f for f in _FLAGS if f not in ("-march=native", "-mprefer-vector-width=512")] + [
            f"-march={march}"
        ]
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
            extra_cflags=flags,
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


def build_for(march: str) -> Any:
    """Build the kernels for another x86-64 CPU (``-march=MARCH``: ``znver3`` for an AMD Zen 3, AVX2 and
    no AVX-512; ``alderlake`` for an Intel client core, AVX2 with AVX-VNNI; ``haswell``) and use them
    in this process from now on, in place of this CPU's build: benchmarks time on this machine the
    code that CPU runs (this CPU must run its instructions). Code chosen at run time by the CPU's flags (AVX512-VNNI, AVX512-BF16, AMX) still finds this CPU's;
    ``q8_avx2(True)`` sends the 8-bit kernels to their AVX2 code too."""
    global _module, _error
    with _lock:
        _module, _error = _load(march), None
    return _module


def built() -> Any:
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
    rows, as a prompt row or as a decode. Every kernel reads an 8-bit pool in place (the fp32 kernel on
    AVX-512, on AVX2 or in its generic loop, as a 16-bit pool) and gives the bits it gives the pool
    :func:`~zerotron.serve.kv_quant.dequantize` makes of it in q's dtype."""
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
    k, v, k_scales, v_scales, fmt = _pool_operands(k_pool, v_pool)
    if fmt == 0:
        out: torch.Tensor = built().paged_attention(q, k, v, slots, seq, lens, scale, index)
    else:
        out = built().paged_attention_q8(q, k, k_scales, v, v_scales, fmt, slots, seq, lens, scale, index)
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


def why_no_kernel(built: str, cpu: Callable[[Any], bool], code: str, instructions: str) -> Optional[str]:
    """Why a native kernel cannot run here (None when it can): the kernels not built, this build
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
    """Whether bf16 rows can run on AMX tiles here (attention, and
    :func:`~zerotron.serve.linear_kernels.tile_linear`): the kernels built with tile code (x86-64), a
    CPU with AMX, and the kernel's leave to use its tile registers."""
    return why_no_tiles() is None


def why_no_tiles() -> Optional[str]:
    """Why :func:`tiles_available` is False (None when it is True)."""
    return why_no_kernel(
        "tiles_built",
        lambda m: bool(torch.cpu._is_amx_tile_supported() and torch.cpu._init_amx()),
        "AMX tile code (an x86-64 CPU and GCC 11+ or clang are needed)",
        "this CPU has no AMX tiles (or the kernel refuses their use)",
    )


def dot_available() -> bool:
    """Whether bf16 rows can run on AVX512-BF16 here (attention, and
    :func:`~zerotron.serve.linear_kernels.dot_linear`): the kernels built with its code (x86-64, GCC 10+
    or clang) and a CPU with AVX512-BF16."""
    return why_no_dot() is None


def why_no_dot() -> Optional[str]:
    """Why :func:`dot_available` is False (None when it is True)."""
    return why_no_kernel(
        "dot_built",
        lambda m: bool(m.dot_cpu()),
        "AVX512-BF16 linear code (an x86-64 CPU and GCC 10+ or clang are needed)",
        "this CPU has no AVX512-BF16",
    )


def bind_threads(cpus: list[list[int]]) -> list[bool]:
    """Bind thread ``t`` of the calling thread's OpenMP team to the CPUs ``cpus[t]`` (a list per
    thread, :mod:`zerotron.serve.affinity`); whether each thread took it."""
    return [bool(b) for b in built().bind_threads(cpus)]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of the last dimension of ``x`` (any leading shape; ``weight`` in x's dtype), the model's
    roundings (:class:`~zerotron.models.llama.RMSNorm`: the statistic in fp32, the normalised row
    rounded to the dtype, times the weight rounded again) in one pass per row; each row's result is
    its own in any batch."""
    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    y: torch.Tensor = built().rms_norm(rows, weight, eps)
    return y.view(x.shape)


def q8_layer(
    x: torch.Tensor,
    layer: tuple[torch.Tensor, float, torch.Tensor, float, list[int], list[torch.Tensor], int, int],
    cos: torch.Tensor,
    sin: torch.Tensor,
    attention: tuple[Any, Any, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, str],
) -> torch.Tensor:
    """A decoder layer's step of fp32 or bf16 rows ``x`` (1, rows, hidden) in one native call, for a
    layer whose four products are prepared quantised linears and whose attention reads the paged pool.
    ``layer``: the first norm's weight and epsilon, the second's, the handles of the
    :class:`~zerotron.serve.linear_kernels.Prepared` q/k/v, o, gate/up and down, their biases (an
    empty tensor for none: added to the product as the module adds it), the gate's columns and the
    query heads; ``attention``: the k and v pools, the rows' slots, the key slots, key counts and
    sequences :func:`paged_attention` takes, and its kernel (one of :data:`ATTENTION_KERNELS`); the
    pools dense or 8-bit (:class:`~zerotron.serve.kv_quant.QuantizedKV` each). The steps: RMSNorm, q/k/v,
    :func:`rope_store` (the rows' k and v written at their slots), :func:`paged_attention`, o and the
    residual, RMSNorm, gate/up, SiLU(gate)·up as torch computes ``F.silu(gate) * up``, down and the
    residual: the calls ``linears._LeanLayer`` makes from Python, in the same order, so the same bits,
    without a dozen Python calls a layer."""
    norm1, eps1, norm2, eps2, products, biases, gate, heads = layer
    out: torch.Tensor = built().q8_layer(
        x,
        norm1,
        eps1,
        norm2,
        eps2,
        products,
        biases,
        gate,
        cos,
        sin,
        *_layer_attention(attention, heads),
    )
    return out


NATIVE_LINEARS = ("tiles", "dot", "vec")


def native_layer(
    x: torch.Tensor,
    layer: tuple[
        torch.Tensor,
        float,
        torch.Tensor,
        float,
        str,
        list[torch.Tensor],
        list[torch.Tensor],
        list[int],
        int,
        int,
    ],
    cos: torch.Tensor,
    sin: torch.Tensor,
    attention: tuple[Any, Any, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, str],
) -> torch.Tensor:
    """A decoder layer's step of rows ``x`` (1, rows, hidden) in one native call, for a layer whose four
    products run on one of the native linear kernels (one of :data:`NATIVE_LINEARS`: bf16 on AMX tiles,
    :func:`~zerotron.serve.linear_kernels.tile_linear`; bf16 on AVX512-BF16,
    :func:`~zerotron.serve.linear_kernels.dot_linear`; fp32 on AVX-512 or AVX2,
    :func:`~zerotron.serve.linear_kernels.vec_linear`) and whose attention reads the paged pool.
    ``layer``: the first norm's weight and epsilon, the second's, the linears' kernel, the q/k/v, o,
    gate/up and down products' packed weights, their fp32 biases (an empty tensor for none) and
    widths, the gate's columns and the query heads; ``attention`` as :func:`q8_layer` takes it. The
    steps: RMSNorm, q/k/v, :func:`rope_store`, :func:`paged_attention`, o and the residual, RMSNorm,
    gate/up and SiLU(gate)·up (:func:`silu_mul`; on tiles in the product's pass,
    :func:`~zerotron.serve.linear_kernels.tile_gated`), down and the residual (on tiles added in the
    product's pass): the calls ``linears._LeanLayer`` makes from Python, in the same order, so the
    same bits, without a layer's eight to eleven calls from Python and their glue."""
    norm1, eps1, norm2, eps2, linears, packed, biases, widths, gate, heads = layer
    out: torch.Tensor = built().native_layer(
        x,
        norm1,
        eps1,
        norm2,
        eps2,
        NATIVE_LINEARS.index(linears),
        packed,
        biases,
        widths,
        gate,
        cos,
        sin,
        *_layer_attention(attention, heads),
    )
    return out


def _layer_attention(
    attention: tuple[Any, Any, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, str], heads: int
) -> tuple[Any, ...]:
    """The one-call layers' attention arguments (the C++ ``layer_attention``'s): the pools as the native
    calls take them, the rows' slots, the key slots, key counts and sequences, the query heads, the
    softmax scale and the kernel's index."""
    k_pool, v_pool, slots, key_slots, lens, seq, kernel = attention
    pools = _pool_operands(k_pool, v_pool)
    scale = pools[0].shape[-1] ** -0.5
    return (*pools, slots, key_slots, lens, seq, heads, scale, ATTENTION_KERNELS.index(kernel))


_NO_SCALES = torch.empty(0)


def _pool_operands(
    k_pool: Any, v_pool: Any
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """A layer's pools as the native calls take them: a dense pool's k and v with no scales (format
    0), or an 8-bit pool's (:class:`~zerotron.serve.kv_quant.QuantizedKV`) codes and scales and its
    format's code."""
    if isinstance(k_pool, torch.Tensor):
        return k_pool, v_pool, _NO_SCALES, _NO_SCALES, 0
    fmt = kv_quant.KERNEL_FORMATS[k_pool.fmt]
    return k_pool.codes, v_pool.codes, k_pool.scales, v_pool.scales, fmt


def silu_mul(gate_up: torch.Tensor, width: int) -> torch.Tensor:
    """``silu(gate) * up`` for ``gate_up`` (..., 2 width), the gate's columns first: SiLU rounded to the
    dtype before the product, as the model's ``F.silu(gate) * up``; each row's result is its own."""
    rows = gate_up.reshape(-1, gate_up.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    y: torch.Tensor = built().silu_mul(rows, width)
    return y.view(*gate_up.shape[:-1], width)


def rope_store(
    y: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_pool: Any,
    v_pool: Any,
    slots: torch.Tensor,
    heads: int,
) -> torch.Tensor:
    """A decoder layer's fused q/k/v product ``y`` (rows, (heads + 2 kv_heads) d) -> its q heads rotated,
    (rows, heads, d), in one pass per row that also rotates the k heads and writes them and the v
    heads to the pools at ``slots`` (rows,); cos/sin (rows, d). The model's roundings
    (:func:`~zerotron.models.llama.apply_rotary`: each product rounded to the dtype, then the sum), so
    the same bits as its torch operators; each row's result is its own. An 8-bit pool's
    (:class:`~zerotron.serve.kv_quant.QuantizedKV` each, heads up to 256 wide) k and v are stored
    quantised, the codes and scales :meth:`~zerotron.serve.kv_quant.QuantizedKV.store` stores."""
    k, v, k_scales, v_scales, fmt = _pool_operands(k_pool, v_pool)
    if fmt == 0:
        q: torch.Tensor = built().rope_store(y, cos, sin, k, v, slots, heads)
    else:
        q = built().rope_store_q8(y, cos, sin, k, k_scales, v, v_scales, fmt, slots, heads)
    return q
