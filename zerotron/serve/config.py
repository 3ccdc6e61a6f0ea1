"""The serving engine's settings as one object that checks itself (DESIGN contract 11).

:class:`EngineConfig` is what ``zerotron serve``'s flags become and what every part of the engine
reads: the scheduler's limits, the KV cache's blocks, the model's dtype and device, and the kernels of
the linear layers and of attention. Every check runs in ``__post_init__`` — on construction, and again
whenever :meth:`EngineConfig.for_model` fills in what depends on the model (its device, dtype and
tensor-parallel size) — and fails with an :class:`EngineConfigError` naming the setting, which the
command line reports under the flag's name.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

import torch

from zerotron.build.quantize import LOAD_METHODS
from zerotron.serve import kernels, kv_quant, linear_kernels, triton_attention
from zerotron.serve.linears import FIXED_ROWS, onednn_kernels
from zerotron.serve.speculative import DraftConfig, SpecConfig

BLOCK_SIZES = (1, 2, 4, 8, 16, 32, 64, 128)
DTYPES = ("float32", "bfloat16", "float16")

# what each setting is called in errors (and the runner's wording): the field name otherwise
_LABELS = {
    "native_attention": "native attention",
    "native_matmul": "native matmul",
    "triton_attention": "Triton attention",
    "block_size": "block size",
}


class EngineConfigError(ValueError):
    """A setting the engine cannot run with: ``key`` is the field, ``reason`` what is wrong and what to
    do; ``str()`` reads ``label: reason``."""

    def __init__(self, key: str, reason: str) -> None:
        super().__init__(f"{_LABELS.get(key, key)}: {reason}")
        self.key, self.reason = key, reason


@dataclass(frozen=True)
class EngineConfig:
    """The engine's settings (``zerotron serve``'s flags of the same names, vLLM's where it has one)."""

    block_size: int = 16
    num_blocks: Optional[int] = None  # None: from kv_cache_bytes
    kv_cache_bytes: int = 1 << 30
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048  # tokens per step, decodes and prefill chunks (vLLM's CPU default)
    max_model_len: Optional[int] = None  # None: the model's max_position_embeddings (at most 8192)
    prefix_caching: bool = True
    onednn: bool = False  # pack (and fuse) the linears for oneDNN: the engine then owns the model (CPU)
    native_attention: bool = False  # every row through the native paged kernel (zerotron.serve.kernels)
    # that kernel's code: fp32 | dot (AVX512-BF16) | tiles (AMX); None: kernels.attention_kernel's choice
    attention_kernel: Optional[str] = None
    # linears on zerotron's kernels: bf16 on AMX tiles, AVX512-BF16 or AVX2, fp32 on AVX-512 or AVX2 (CPU)
    native_matmul: bool = False
    dtype: Optional[str] = None  # the model's dtype (float32 | bfloat16 | float16); None: the model's
    device: Optional[str] = None  # where the model and the KV cache live (cpu | cuda[:N]); None: the model's
    fixed_rows: Optional[int] = None  # linears in calls of this many rows (0: off); None: 256 off the CPU
    # every row through the Triton paged kernel (serve.triton_attention); None: off the CPU where Triton is
    triton_attention: Optional[bool] = None
    tp: int = 1  # tensor-parallel ranks the model is split over
    max_loras: int = 0  # LoRA adapters served at once over the model (serve.lora); 0: multi-LoRA off
    max_lora_rank: int = 16  # the largest adapter rank served (each adapter slot's width)
    speculative: Optional[SpecConfig] = (
        None  # n-gram lookup or a draft model (serve.speculative, serve.draft)
    )
    quantization: Optional[str] = None  # int8 | int4 | gguf: the decoder linears quantised (build.quantize)
    kv_cache_dtype: str = (
        "auto"  # auto (the model's dtype) | fp8 | fp8_e4m3 | fp8_e5m2 | int8 (serve.kv_quant)
    )
    # the quantised weights times activations quantised to int8 per 32 inputs (linear_kernels.q8a8_linear);
    # None: where it runs (`zerotron serve`'s default), a GGUF file's blocks times fp32 rows on a CPU with
    # AVX512-VNNI whose kernel takes every quantised linear (StepRunner resolves it)
    quantize_activations: Optional[bool] = False
    # bf16 rows times the quantised weights, each weight dequantised to bf16 once per call, on AMX tiles
    # or AVX512-BF16 (linear_kernels.q8t_linear): prompts several times faster, one-row decode slower
    # than torch's kernels
    quantized_tiles: bool = False

    def __post_init__(self) -> None:
        self._check_limits()
        self._check_kernels()

    def _check_limits(self) -> None:
        limits = [
            ("block_size", self.block_size in BLOCK_SIZES, "choose a power of two from 1 to 128"),
            ("num_blocks", self.num_blocks is None or self.num_blocks >= 2, "give at least 2 blocks"),
            ("kv_cache_bytes", self.kv_cache_bytes > 0, "give the KV cache some memory"),
            ("max_num_seqs", self.max_num_seqs >= 1, "at least 1 sequence"),
            ("max_num_batched_tokens", self.max_num_batched_tokens >= 1, "at least 1 token per step"),
            ("max_model_len", self.max_model_len is None or self.max_model_len >= 2, "at least 2 tokens"),
            ("fixed_rows", self.fixed_rows is None or self.fixed_rows >= 0, "rows per call, or 0 for off"),
            ("dtype", self.dtype is None or self.dtype in DTYPES, f"choose one of {', '.join(DTYPES)}"),
            ("tp", self.tp >= 1, "at least 1 rank"),
            ("max_loras", self.max_loras >= 0, "0 (no adapters) or more"),
            ("max_lora_rank", self.max_lora_rank >= 1, "at least 1"),
            (
                "attention_kernel",
                self.attention_kernel is None or self.attention_kernel in kernels.ATTENTION_KERNELS,
                f"choose one of {', '.join(kernels.ATTENTION_KERNELS)}",
            ),
            (
                "kv_cache_dtype",
                self.kv_cache_dtype in kv_quant.CHOICES,
                f"choose one of {', '.join(kv_quant.CHOICES)}",
            ),
        ]
        for key, ok, fix in limits:
            if not ok:
                raise EngineConfigError(key, f"{getattr(self, key)!r} is out of range; {fix}")
        try:
            torch.device(self.device or "cpu")
        except RuntimeError:
            raise EngineConfigError(
                "device", f"{self.device!r} is not a device; use cpu, cuda or cuda:N"
            ) from None

    def _check_quantized_tiles(self, device: Optional[torch.device]) -> None:
        why = (
            "the kernel runs on the CPU"
            if device is not None and device.type != "cpu"
            else "it multiplies bf16 rows: give --dtype bfloat16"
            if self.dtype not in (None, "bfloat16")
            else "it replaces the 8-bit-activation kernel's products; give one of the two"
            if self.quantize_activations
            else linear_kernels.why_no_q8t()
        )
        if why is not None:
            raise EngineConfigError("quantized_tiles", f"not available: {why}")

    def _check_kernels(self) -> None:
        """The kernel choices against each other, the device (once known: an engine's model's), the
        dtype, the tensor-parallel split and what this machine can run."""
        device = torch.device(self.device) if self.device is not None else None
        if device is not None and device.type != "cpu":
            chosen = [k for k in ("onednn", "native_attention", "native_matmul") if getattr(self, k)]
            if chosen:
                raise EngineConfigError(
                    chosen[0],
                    f"CPU kernels; a model on {device} runs F.linear, and SDPA or the Triton "
                    "paged-attention kernel",
                )
        if self.fixed_rows and (self.onednn or self.native_matmul):
            raise EngineConfigError(
                "fixed_rows",
                "fixed-shape linears and packed linears (onednn, native matmul) exclude each other",
            )
        if self.triton_attention:
            self._check_triton(device)
        packs = "it packs whole weights; tensor-parallel shards run F.linear"
        if self.native_attention and not kernels.available():
            raise EngineConfigError(
                "native_attention", f"the kernel could not be built ({kernels.why_unavailable()})"
            )
        dtype = getattr(torch, self.dtype) if self.dtype is not None else None  # known: an engine's model's
        if self.attention_kernel is not None:
            self._check_attention_kernel(dtype)
        if self.native_matmul and self.tp > 1:
            raise EngineConfigError("native_matmul", packs)
        why = linear_kernels.why_no_native_matmul(dtype) if self.native_matmul and dtype is not None else None
        if why is not None:
            raise EngineConfigError("native_matmul", f"not available: {why}")
        if self.onednn and self.tp > 1:
            raise EngineConfigError("onednn", packs)
        if self.quantization is not None:
            self._check_quantization(device)
        if self.quantize_activations:
            why = (
                "the kernel runs on the CPU"
                if device is not None and device.type != "cpu"
                else linear_kernels.why_no_q8a8()
            )
            if why is not None:
                raise EngineConfigError("quantize_activations", f"not available: {why}")
        if self.quantized_tiles:
            self._check_quantized_tiles(device)
        layers = isinstance(self.speculative, DraftConfig) and self.speculative.draft_layers is not None
        if layers and (self.tp > 1 or self.max_loras):
            raise EngineConfigError(
                "speculative",
                "a draft of the served model's first layers runs on one rank without adapters; give a "
                'draft model ("model") instead',
            )
        if self.onednn and dtype == torch.bfloat16 and not onednn_kernels(dtype):
            raise EngineConfigError("onednn", "this CPU has no oneDNN bf16 kernels (AVX-512 BF16 or AMX)")

    def _check_attention_kernel(self, dtype: torch.dtype | None) -> None:
        if not self.native_attention:
            raise EngineConfigError(
                "attention_kernel",
                "it picks the native paged-attention kernel's code: turn native attention on",
            )
        if self.attention_kernel == "fp32":
            return
        why = (
            f"it attends bf16 rows, not {self.dtype}"
            if dtype not in (None, torch.bfloat16)
            else kernels.why_no_tiles()
            if self.attention_kernel == "tiles"
            else kernels.why_no_dot()
        )
        if why is not None:
            raise EngineConfigError("attention_kernel", f"{self.attention_kernel}: {why}")

    def _check_quantization(self, device: torch.device | None) -> None:
        if self.quantization not in LOAD_METHODS:
            raise EngineConfigError(
                "quantization",
                f"{self.quantization!r} is not built; int8 (per-row scales), int4 (grouped), gguf (a GGUF "
                "file's Q2_K to Q8_0 and IQ blocks as they are), gptq, awq and compressed-tensors (such a "
                "checkpoint's 4- or 8-bit weights as they are) are (fp8 is not)",
            )
        why = (
            "the int8 and int4 kernels run on the CPU"
            if device is not None and device.type != "cpu"
            else "the kernels multiply fp32 or bf16 activations"
            if self.dtype == "float16" and self.quantization in ("int8", "int4")
            else None
        )
        if why is not None:
            raise EngineConfigError("quantization", why)

    def _check_triton(self, device: torch.device | None) -> None:
        if self.native_attention:
            raise EngineConfigError(
                "triton_attention", "native attention and Triton attention exclude each other: choose one"
            )
        if not triton_attention.available():
            raise EngineConfigError("triton_attention", f"{triton_attention.why_unavailable()}")
        if device is not None and device.type == "cpu" and not triton_attention.interpreted():
            raise EngineConfigError(
                "triton_attention",
                "the Triton paged-attention kernel runs on CUDA devices (on the CPU only under Triton's "
                "interpreter, TRITON_INTERPRET=1): use native attention or SDPA on the CPU",
            )

    def for_model(self, device: torch.device, dtype: torch.dtype, tp: int) -> EngineConfig:
        """These settings for a model on ``device`` in ``dtype`` split over ``tp`` ranks, every check
        run again: off the CPU the linears run in :data:`FIXED_ROWS`-row calls and attention through
        the Triton kernel (where Triton is installed) unless said otherwise."""
        fixed = (
            self.fixed_rows if self.fixed_rows is not None else (FIXED_ROWS if device.type != "cpu" else 0)
        )
        triton = self.triton_attention
        if triton is None:
            triton = device.type != "cpu" and triton_attention.available()
        dtype_name = str(dtype).removeprefix("torch.")
        return dataclasses.replace(
            self, device=str(device), dtype=dtype_name, tp=tp, fixed_rows=fixed, triton_attention=triton
        )
