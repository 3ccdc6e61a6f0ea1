"""``zerotron serve``: the command line's flags into an :class:`~zerotron.serve.config.EngineConfig`
(checked there, reported under the flags' names), then one process, or one tensor-parallel rank per
``--nproc`` (or per rank of a torchrun/srun job)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch

from zerotron.config_load import ConfigError
from zerotron.distributed import launch
from zerotron.distributed.launch import adopt_slurm_env, job_rank_and_world, under_torchrun
from zerotron.models.hf import ModelLoadError, packed_format_of
from zerotron.models.lora import read_adapter_config
from zerotron.serve import kernels, linear_kernels, triton_attention
from zerotron.serve.config import EngineConfig, EngineConfigError
from zerotron.serve.devices import check_device, rank_backend
from zerotron.serve.edge import ServerOptions, default_name
from zerotron.serve.generate import check_split
from zerotron.serve.linears import onednn_kernels
from zerotron.serve.lora import parse_lora_modules
from zerotron.serve.speculative import DraftConfig, SpecConfig, SpeculativeError, parse_speculative_config

# the flag that sets each EngineConfig field (what an EngineConfigError is reported under)
FLAGS = {
    "onednn": "--matmul onednn",
    "native_matmul": "--matmul native",
    "native_attention": "--attention native",
    "triton_attention": "--attention triton",
    "attention_kernel": "--attention-kernel",
    "block_size": "--block-size",
    "kv_cache_bytes": "--kv-cache-memory",
    "max_num_seqs": "--max-num-seqs",
    "max_num_batched_tokens": "--max-num-batched-tokens",
    "max_model_len": "--max-model-len",
    "dtype": "--dtype",
    "device": "--device",
    "tp": "--nproc",
    "max_loras": "--max-loras",
    "max_lora_rank": "--max-lora-rank",
    "quantization": "--quantization",
    "speculative": "--speculative-config",
    "kv_cache_dtype": "--kv-cache-dtype",
    "quantize_activations": "--quantize-activations",
    "quantized_tiles": "--quantized-tiles",
}
DEFAULT_MAX_LORAS = 4


def engine_config(args: argparse.Namespace, nproc: int) -> EngineConfig:
    """The engine's settings from ``zerotron serve``'s flags, checked by :class:`EngineConfig` (one line
    naming the flag): the flags as given first, so that a bad one is refused before any kernel is built
    to probe this machine, then with each default chosen for this machine and device."""
    memory = args.kv_cache_memory  # GiB, as bytes below: a number first
    for flag, ok in (("--nproc", nproc >= 1), ("--kv-cache-memory", 0 < memory < float("inf"))):
        if not ok:
            raise ConfigError(f"serve {flag}: out of range; see zerotron serve --help")
    device = check_device("serve", args.device, nproc)
    if args.attention == "triton" and device.type == "cpu":  # (its interpreter is the tests' CPU device)
        raise ConfigError(
            "serve --attention triton: the Triton kernel runs on a CUDA device (--device cuda); on the CPU "
            "use native or sdpa, or leave --attention out"
        )
    explicit = {
        "onednn": args.matmul == "onednn",
        "native_matmul": args.matmul == "native",
        "native_attention": args.attention == "native",
        "triton_attention": args.attention == "triton",
        "attention_kernel": args.attention_kernel if args.attention == "native" else None,
    }
    fields = {
        "block_size": args.block_size,
        "kv_cache_bytes": int(memory * 2**30),
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "max_model_len": args.max_model_len,
        "prefix_caching": not args.no_prefix_caching,
        "dtype": args.dtype,
        "device": str(device),
        "tp": nproc,
        "max_loras": max_loras(args),
        "max_lora_rank": args.max_lora_rank,
        "speculative": speculative(args),
        "quantization": args.quantization,
        "kv_cache_dtype": args.kv_cache_dtype,
        "quantize_activations": args.quantize_activations,
        "quantized_tiles": args.quantized_tiles,
    }
    config = _checked(fields | explicit)  # the flags as given, before any kernel is built to probe
    chosen = dict(explicit)
    if device.type == "cpu" and args.matmul is None and nproc == 1:  # packed linears where they run
        dtype = getattr(torch, args.dtype)
        chosen["native_matmul"] = linear_kernels.why_no_native_matmul(dtype) is None
        chosen["onednn"] = not chosen["native_matmul"] and onednn_kernels(dtype)
    if args.attention is None:  # the paged kernel of the device where it builds, else SDPA
        on_cpu = device.type == "cpu"
        chosen["native_attention"] = on_cpu and kernels.available()
        chosen["triton_attention"] = not on_cpu and triton_attention.available()
    if args.attention_kernel is not None and not chosen["native_attention"]:
        raise ConfigError(
            "serve --attention-kernel: it picks the native paged-attention kernel's code; use --attention "
            "native (or leave --attention out on a CPU where the kernel builds)"
        )
    chosen["attention_kernel"] = args.attention_kernel
    packed = packed_method(args.model) if args.quantization is None else None
    if packed is not None:  # a packed checkpoint's weights as they are, where the engine takes them
        try:
            return EngineConfig(**(fields | chosen | {"quantization": packed}))
        except EngineConfigError as err:  # the engine's own reason, e.g. adapters or a GPU
            print(
                f"zerotron serve: {args.model} holds {packed.upper()} packed weights, read dequantised "
                f"({err.reason})",
                flush=True,
            )
    final = config if chosen == explicit else _checked(fields | chosen)
    for flag, on in (
        ("--quantize-activations", final.quantize_activations),
        ("--quantized-tiles", final.quantized_tiles),
    ):
        if on and final.quantization is None:
            raise ConfigError(
                f"serve {flag}: it multiplies quantised weights; give --quantization (int8, int4, gguf "
                "for a .gguf file's blocks) or serve a GPTQ, AWQ or compressed-tensors checkpoint"
            )
    return final


def packed_method(model: str) -> str | None:
    """``gptq``, ``awq`` or ``compressed-tensors`` when ``model`` is a directory of that packed checkpoint
    format, else None (a format
    zerotron cannot read is refused by the loader, in one line)."""
    try:
        fmt = packed_format_of(Path(model)) if Path(model).is_dir() else None
    except ModelLoadError:
        return None
    return None if fmt is None else fmt.method


def max_loras(args: argparse.Namespace) -> int:
    """Adapters the engine holds at once: --max-loras, else 4 when adapters are served, else 0 (off)."""
    wanted = bool(args.lora_modules) or args.enable_lora or args.allow_runtime_lora_updating
    if args.max_loras is not None:
        if args.max_loras < 1:
            raise ConfigError("serve --max-loras: give at least 1 (or leave it out to serve no adapters)")
        if len(args.lora_modules) > args.max_loras:
            raise ConfigError(
                f"serve --lora-modules names {len(args.lora_modules)} adapters, more than --max-loras "
                f"{args.max_loras}: raise --max-loras"
            )
        return int(args.max_loras)
    return max(DEFAULT_MAX_LORAS, len(args.lora_modules)) if wanted else 0


def speculative(args: argparse.Namespace) -> SpecConfig | None:
    """--speculative-config (n-gram lookup or a draft model), or --speculative-model PATH (a draft
    model proposing 4 tokens); None without either; refused in one line."""
    if args.speculative_model is not None:
        if args.speculative_config is not None:
            raise ConfigError(
                "serve --speculative-model: give it or --speculative-config, not both (--speculative-config "
                '\'{"method": "draft_model", "model": PATH, "num_speculative_tokens": K}\' says both)'
            )
        return DraftConfig(model=args.speculative_model)
    if args.speculative_config is None:
        return None
    try:
        return parse_speculative_config(args.speculative_config)
    except SpeculativeError as err:
        raise ConfigError(f"serve --speculative-config: {err}") from None


def lora_modules(args: argparse.Namespace) -> tuple[tuple[str, str], ...]:
    """--lora-modules as (name, path) pairs, each adapter's config read (a bad one refused before the
    model loads)."""
    pairs = parse_lora_modules(args.lora_modules)
    max_loras(args)  # the counts first: no file read for a command refused anyway
    served = args.served_model_name or default_name(args.model)
    for name, path in pairs:
        if name == served:
            raise ConfigError(
                f"serve --lora-modules {name}={path}: the model is served as {name!r}; rename the adapter"
            )
        try:
            read_adapter_config(path)
        except ConfigError as err:
            raise ConfigError(f"serve --lora-modules {name}={path}: {err}") from None
    return tuple(pairs)


def _checked(fields: dict[str, object]) -> EngineConfig:
    """An :class:`EngineConfig` of these fields, its refusal reported under the flag's name."""
    try:
        return EngineConfig(**fields)  # type: ignore[arg-type]
    except EngineConfigError as err:
        raise ConfigError(
            f"serve {FLAGS.get(err.key, err.key)}: {err.reason}; leave it out or change it"
        ) from None


def server_options(args: argparse.Namespace) -> ServerOptions:
    """The server's own settings from ``zerotron serve``'s flags (the API key also from
    ``ZEROTRON_API_KEY``), checked."""
    return ServerOptions(
        name=args.served_model_name or default_name(args.model),
        host=args.host,
        port=args.port,
        api_key=args.api_key if args.api_key is not None else os.environ.get("ZEROTRON_API_KEY") or None,
        protect_metrics=args.protect_metrics,
        max_queued_requests=args.max_queued_requests,
        max_request_bytes=args.max_request_bytes,
        request_timeout_s=args.request_timeout,
        runtime_lora=args.allow_runtime_lora_updating,
        lora_modules=lora_modules(args),
        cpu_bind=args.cpu_bind,
    )


def serve_command(args: argparse.Namespace) -> int:
    """``zerotron serve MODEL``: one process, or ``--nproc`` tensor-parallel ranks (the first serves
    HTTP and schedules, each holds its shard)."""
    try:
        from zerotron.serve.app import run_server, serve_worker
    except ImportError as err:
        raise ConfigError(
            f"zerotron serve needs FastAPI and uvicorn ({err}): pip install 'zerotron[serve]'"
        ) from None
    nproc = 1 if args.nproc is None else args.nproc
    if adopt_slurm_env() or under_torchrun():  # every process of the job is a tensor-parallel rank
        nproc = job_rank_and_world()[1]
    options = server_options(args)
    config = engine_config(args, nproc)
    if nproc == 1 and not under_torchrun():
        run_server(args.model, options, config)
        return 0
    check_split(args.model, nproc)  # every rank holds a tensor-parallel shard
    launch.spawn(
        serve_worker,
        nproc,
        args=(args.model, options, config),
        backend=rank_backend(config.device or "cpu"),
    )
    return 0
