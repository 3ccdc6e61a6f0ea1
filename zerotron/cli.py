"""The `zerotron` command line: parse arguments and dispatch. No logic of its own."""

from __future__ import annotations

import argparse
import importlib
import sys
import warnings
from typing import Any, NoReturn, cast

BENCH_FRAMEWORKS = ("zerotron", "deepspeed", "fsdp2", "ddp", "torch-tp", "torch-pp")  # zerotron.bench.jobs

EPILOG_TRAIN = """examples:
  zerotron train                                   # the embedded default: tiny model, stdlib corpus, 2 ranks
  zerotron train my.yaml train.lr=1e-3 --nproc 4   # a config file plus dotted overrides
  zerotron train parallel.dp=2 --resume auto --out runs/a
  torchrun --nproc-per-node 8 -m zerotron train my.yaml   # under torchrun: its ranks are used
"""

EPILOG_SFT = """LoRA (rank 8, alpha 32, all linear layers), loss on the assistant's tokens, packed samples,
lr 1e-4; every key of `zerotron train --help-config` applies (lora.rank=0: full fine-tuning).
examples:
  zerotron sft HuggingFaceTB/SmolLM2-135M-Instruct chat.jsonl --nproc 1
  zerotron sft model.gguf data/ lora.rank=16 data.loss_on=last_turn train.steps=500 --out runs/sft
  zerotron sft model_dir chat.jsonl --deepspeed ds_config_zero2.json --nproc 2
  torchrun --nproc-per-node 4 -m zerotron sft model_dir chat.jsonl
The adapter is written to RUN_DIR/adapter (PEFT's files); `zerotron convert MODEL OUT --merge-lora
RUN_DIR/adapter` writes the merged Hugging Face model.
"""

EPILOG_DPO = """Preference pairs {prompt|messages, chosen, rejected} (TRL's format) or {messages,
rejected_response} (ms-swift's); DPO (preference.loss=sigmoid, preference.beta=0.1), IPO (ipo) or SimPO
(simpo, no reference model); LoRA rank 8 as zerotron sft, lr 5e-5, 8 pairs per step. The reference is
the model as loaded (under LoRA, its base), its log-probs computed once before step 1 on the same layout.
examples:
  zerotron dpo HuggingFaceTB/SmolLM2-135M-Instruct pairs.jsonl --nproc 1
  zerotron dpo model_dir pairs.jsonl preference.loss=ipo preference.beta=0.5 --nproc 2
  zerotron dpo model_dir pairs.jsonl lora.rank=0 train.lr=1e-6 parallel.zero=3 --nproc 4
  torchrun --nproc-per-node 4 -m zerotron dpo model_dir pairs.jsonl
"""

EPILOG_GRPO = """Prompt rows {prompt|messages, ...} (any other field, e.g. answer, goes to the rewards). Each step:
grpo.group_size completions per prompt from zerotron's serving engine on the training ranks' own
weights, rewards summed, group-normalised advantages, the clipped policy loss (grpo.loss=dapo, TRL's
default; grpo, dr_grpo), one optimizer step, a prefix-cache reset as the weight sync. The engine's and
the trainer's log-probs agree bit for bit (metrics.jsonl: logprob_max_abs_delta). Full weights or LoRA
(lora.rank), fp32 under data and tensor parallelism and ZeRO-1/2, bf16 under ZeRO-1/2.
examples:
  zerotron grpo model_dir sums.jsonl --reward exact_match --nproc 1
  zerotron grpo model_dir sums.jsonl --reward exact_match --reward format grpo.group_size=8 --nproc 2
  zerotron grpo model_dir prompts.jsonl --reward my_rewards:score grpo.beta=0.04 parallel.zero=2
  torchrun --nproc-per-node 2 -m zerotron grpo model_dir sums.jsonl --reward exact_match
"""


# each sub-command's body, in its own package (imported when it runs)
COMMANDS = {
    "train": "zerotron.train.command:train_command",
    "sft": "zerotron.finetune.sft:sft_command",
    "dpo": "zerotron.finetune.dpo:dpo_command",
    "grpo": "zerotron.finetune.grpo:grpo_command",
    "generate": "zerotron.serve.generate:generate_command",
    "serve": "zerotron.serve.command:serve_command",
    "convert": "zerotron.build.convert:convert_command",
    "plan": "zerotron.plan.command:plan_command",
    "bench": "zerotron.bench.command:bench_command",
}


def _run(args: argparse.Namespace) -> int:
    """Dispatch to the sub-command's body."""
    module, _, name = COMMANDS[args.command].partition(":")
    return cast(int, getattr(importlib.import_module(module), name)(args))


class _Parser(argparse.ArgumentParser):
    """argparse with its errors on one line (``zerotron train: error: ...; see zerotron train --help``)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}; see `{self.prog} --help`\n")


def _add_launch_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nproc", type=int, default=2, help="local ranks to launch (ignored under torchrun)")
    p.add_argument("--out", help="run directory (default runs/<timestamp>)")
    p.add_argument("--resume", help="'auto' (newest complete checkpoint in --out) or a checkpoint folder")
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="start over in an --out that holds an earlier run (deletes its metrics and checkpoints)",
    )
    p.add_argument("--deepspeed", metavar="DS_CONFIG", help="a DeepSpeed ds_config.json to map")
    p.add_argument(
        "--max-restarts",
        type=int,
        default=0,
        help="restart a failed or hung job from its newest checkpoint up to N times (under torchrun: "
        "torchrun's own --max-restarts)",
    )


def _add_finetune(sub: Any, name: str, summary: str, epilog: str) -> argparse.ArgumentParser:
    """``zerotron sft|dpo|grpo MODEL DATA [CONFIG] [key=value ...]``."""
    p: argparse.ArgumentParser = sub.add_parser(
        name, help=summary, epilog=epilog, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("model", metavar="MODEL", help="HF directory, .gguf file, or zerotron checkpoint/run")
    p.add_argument("data", metavar="DATA", help=".jsonl/.json/.csv/.parquet file or a directory of them")
    p.add_argument(
        "items",
        nargs="*",
        metavar="[CONFIG] [key=value ...]",
        help="as for `zerotron train` (see zerotron train --help-config: lora.*, data.*, preference.*, grpo.*)",
    )
    _add_launch_args(p)
    p.set_defaults(fn=_run)
    return p


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every subcommand."""
    parser = _Parser(prog="zerotron", description="Train, convert and run transformer models.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    train = sub.add_parser(
        "train",
        help="train a model",
        epilog=EPILOG_TRAIN,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    train.add_argument(
        "items",
        nargs="*",
        metavar="[CONFIG] [key=value ...]",
        help="a YAML/JSON config file and/or dotted overrides (see --help-config)",
    )
    _add_launch_args(train)
    train.add_argument("--help-config", action="store_true", help="list every config key and exit")
    train.add_argument(
        "--show-schedule",
        action="store_true",
        help="print the pipeline schedule of this config (each rank's instructions, bubble) and exit",
    )
    train.set_defaults(fn=_run)

    _add_finetune(
        sub, "sft", "fine-tune a model on chat data (LoRA, assistant-only loss, packing)", EPILOG_SFT
    )
    _add_finetune(
        sub, "dpo", "preference-tune a model on chosen/rejected pairs (DPO, IPO, SimPO; LoRA)", EPILOG_DPO
    )
    grpo = _add_finetune(
        sub,
        "grpo",
        "reinforce a model on prompts and rewards (online GRPO, DAPO; rollouts by the engine)",
        EPILOG_GRPO,
    )
    grpo.add_argument(
        "--reward",
        action="append",
        metavar="NAME",
        help="a reward: exact_match, format, length or module:function (repeat to sum several; grpo.rewards)",
    )

    _add_generate(sub)
    _add_serve(sub)

    conv = sub.add_parser(
        "convert",
        help="convert a GGUF file, HF directory or zerotron checkpoint into a HF directory or a checkpoint",
    )
    conv.add_argument("src", help="a .gguf file, a HF directory, or a zerotron checkpoint or run directory")
    conv.add_argument("dst", help="a new (or empty) directory")
    conv.add_argument(
        "--to",
        choices=["hf", "checkpoint"],
        default="hf",
        help="hf: a HF directory transformers loads; checkpoint: a zerotron run directory whose checkpoint "
        "loads under any layout (as model.path or with --resume)",
    )
    conv.add_argument(
        "--merge-lora",
        metavar="ADAPTER_DIR",
        default=None,
        help="fold a LoRA adapter (PEFT's adapter_config.json + adapter_model.safetensors) into the weights",
    )
    conv.set_defaults(fn=_run)

    _add_plan(sub)

    _add_bench(sub)
    return parser


def _add_generate(sub: Any) -> None:
    """``zerotron generate``."""
    gen = sub.add_parser("generate", help="generate text from a model (HF directory or GGUF file)")
    gen.add_argument(
        "items", nargs="+", metavar="MODEL", help="Hugging Face directory or .gguf file [parallel.tp=N]"
    )
    gen.add_argument("--nproc", type=int, default=None, help="local ranks (tensor parallel; = parallel.tp)")
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    gen.add_argument("--max-new-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument(
        "--device",
        default="cpu",
        help="cpu (default) or cuda[:N]; with --nproc N: cuda, rank r on cuda:LOCAL_RANK over NCCL",
    )
    gen.set_defaults(fn=_run)


def _add_serve(sub: Any) -> None:
    """``zerotron serve``."""
    srv = sub.add_parser(
        "serve", help="serve a model over an OpenAI-compatible HTTP API (paged KV cache, continuous batching)"
    )
    srv.add_argument("model", metavar="MODEL", help="HF directory, .gguf file, or zerotron checkpoint/run")
    srv.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    srv.add_argument("--port", type=int, default=8000)
    srv.add_argument(
        "--served-model-name",
        default=None,
        help="the model id clients send (default: MODEL's name, not its path)",
    )
    _add_serve_edge(srv)
    _add_serve_threads(srv)
    _add_serve_lora(srv)
    srv.add_argument("--max-num-seqs", type=int, default=64, help="sequences running at once")
    srv.add_argument(
        "--max-num-batched-tokens", type=int, default=2048, help="tokens per engine step (vLLM's CPU default)"
    )
    srv.add_argument("--max-model-len", type=int, default=None, help="context length (default: the model's)")
    srv.add_argument(
        "--block-size", type=int, default=16, help="tokens per KV cache block (a power of two, 1 to 128)"
    )
    srv.add_argument("--kv-cache-memory", type=float, default=1.0, help="GiB for the KV cache")
    srv.add_argument("--no-prefix-caching", action="store_true", help="do not reuse cached prompt blocks")
    srv.add_argument(
        "--matmul",
        choices=["native", "onednn", "mkl"],
        default=None,
        help="linear layers on weights packed once, q/k/v and gate/up fused: through zerotron's native "
        "kernels, bf16 on AMX tiles or else AVX512-BF16 or else AVX2, fp32 on AVX-512 or AVX2 (the default on one rank "
        "where the CPU has them), or through oneDNN (the default otherwise on one rank; fp16); or through torch's "
        "F.linear (MKL in fp32, >= 16 rows; 16-bit in row chunks; what tensor-parallel shards run)",
    )
    srv.add_argument(
        "--attention",
        choices=["native", "triton", "sdpa"],
        default=None,
        help="every row (decodes and prompt rows) through zerotron's paged-attention kernel, reading "
        "keys and values where they lie in the cache: native on the CPU (the default there where it "
        "builds: a C++ compiler, once per machine), triton on a GPU (the default there where Triton is "
        "installed); or through torch's SDPA on gathered keys",
    )
    srv.add_argument(
        "--attention-kernel",
        choices=["fp32", "dot", "tiles"],  # serve.kernels.ATTENTION_KERNELS
        default=None,
        help="the native kernel's code for bf16 rows with heads of 64 or 128: tiles (AMX: the default "
        "where the CPU has it), dot (AVX512-BF16: the default where it has that but no AMX; prompts "
        "about 2x faster than fp32, decodes slower), or fp32 arithmetic (the default "
        "otherwise, and for every other dtype and head size)",
    )
    srv.add_argument(
        "--dtype",
        choices=["float32", "bfloat16"],
        default="float32",
        help="weights, activations and KV cache: float32, or bfloat16 (half the memory; AMX/AVX-512 "
        "kernels; the linears run in row chunks so results do not depend on the batch)",
    )
    srv.add_argument(
        "--device",
        default="cpu",
        help="where the model and KV cache live: cpu (default) or cuda[:N] (linears through F.linear in "
        "256-row calls, attention through the Triton paged kernel or SDPA); with --nproc N: cuda, one GPU "
        "per rank (cuda:LOCAL_RANK, NCCL)",
    )
    srv.add_argument(
        "--nproc",
        type=int,
        default=None,
        help="local ranks: the model is split over them (tensor parallel, each rank loading only its "
        "shard); under torchrun or srun its ranks",
    )
    srv.set_defaults(fn=_run)


def _add_serve_edge(srv: Any) -> None:
    """``zerotron serve``'s flags of the server's edge: keys and limits."""
    srv.add_argument(
        "--api-key",
        default=None,
        help="/v1/* needs the header 'Authorization: Bearer KEY' (default: $ZEROTRON_API_KEY, else none)",
    )
    srv.add_argument("--protect-metrics", action="store_true", help="/metrics needs the API key too")
    srv.add_argument(
        "--max-queued-requests",
        type=int,
        default=256,
        help="requests that may wait beyond the --max-num-seqs running; past that a 503 with Retry-After",
    )
    srv.add_argument(
        "--max-request-bytes", type=int, default=4 << 20, help="a larger request body is refused (413)"
    )
    srv.add_argument(
        "--request-timeout",
        type=float,
        default=0.0,
        help="seconds a request may take before it is aborted (504; 0: no limit)",
    )


def _add_serve_threads(srv: Any) -> None:
    """``zerotron serve``'s CPU threads."""
    srv.add_argument(
        "--cpu-bind",
        choices=["auto", "none"],  # serve.affinity.CHOICES
        default="none",
        help="on a CPU: bind each OpenMP thread to a core of its own (auto, as vLLM's "
        "VLLM_CPU_OMP_THREADS_BIND; tensor-parallel ranks on disjoint cores; the HTTP thread left free), "
        "or not (none, the default: on a 2-core CPU binding measured within noise of not binding)",
    )


def _add_serve_lora(srv: Any) -> None:
    """``zerotron serve``'s multi-LoRA flags (vLLM's names)."""
    srv.add_argument(
        "--lora-modules",
        nargs="+",
        default=[],
        metavar="NAME=PATH",
        help="LoRA adapters served over the model (PEFT directories: zerotron sft's or peft's); a request "
        "picks one by its model field",
    )
    srv.add_argument(
        "--enable-lora", action="store_true", help="serve LoRA adapters (implied by --lora-modules)"
    )
    srv.add_argument(
        "--max-loras", type=int, default=None, help="adapters loaded at once (default 4 with adapters)"
    )
    srv.add_argument(
        "--quantization",
        choices=["int8", "int4", "gguf", "gptq", "awq", "compressed-tensors"],  # build.quantize.LOAD_METHODS
        default=None,
        help="the decoder layers' weights quantised as they are loaded: int8 with per-row scales, or int4 "
        "in groups of 32 (64/128) inputs (also each tensor-parallel rank's shard); gguf: a GGUF file's "
        "Q2_K/Q3_K/Q4_0/Q4_1/Q4_K/Q5_0/Q5_1/Q5_K/Q6_K/Q8_0/IQ4_NL/IQ4_XS blocks served as they are, IQ1_S/IQ1_M/IQ2_XXS/"
        "IQ2_XS/IQ2_S/IQ3_XXS/IQ3_S as 4-bit indices into their grids' values (llama.cpp's quantiser's "
        "files, the types it falls back to included); gptq, awq, compressed-tensors: such a "
        "checkpoint's 4-bit (gptq, compressed-tensors: or 8-bit; gptq: or 2-, 3-bit, held in 4) weights as they are (chosen for such a "
        "checkpoint where they run; elsewhere it is read dequantised). Under --nproc each rank keeps its "
        "part. Multiplied by torch's weight-only kernels on the CPU; adapters apply on top",
    )
    srv.add_argument(
        "--quantize-activations",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="multiply the quantised weights (--quantization or a quantised checkpoint) by activations "
        "quantised to int8 per 32 inputs, as llama.cpp and vLLM's GGUF kernels do (integer products "
        "on AVX512-VNNI; 2-3x faster decode matrix products than fp32 activations, outputs within "
        "about 1%% of them); a CPU with AVX512-VNNI. Default: on for --quantization gguf in float32 "
        "where the CPU has AVX512-VNNI and the kernel takes every quantised linear, else off; "
        "--no-quantize-activations keeps fp32 activations",
    )
    srv.add_argument(
        "--quantized-tiles",
        action="store_true",
        help="in bf16, multiply the quantised weights (--quantization or a quantised checkpoint) with "
        "each weight dequantised to bf16 once per call, on AMX tiles or else on AVX512-BF16: products of "
        "hundreds of rows 2-6x faster than torch's weight-only kernels (1.3-2.5x the output throughput "
        "at 16 sequences), one-sequence decode 1.4-2.8x slower; a CPU with AMX or AVX512-BF16 (under "
        "--nproc each rank's parts)",
    )
    srv.add_argument(
        "--kv-cache-dtype",
        choices=["auto", "fp8", "fp8_e4m3", "fp8_e5m2", "int8"],  # serve.kv_quant.CHOICES
        default="auto",
        help="the KV cache's storage: auto (the model's dtype), fp8 (e4m3, also fp8_e4m3), fp8_e5m2 or "
        "int8, each key and value vector with its own scale (about half a bf16 cache's bytes)",
    )
    srv.add_argument(
        "--speculative-config",
        default=None,
        metavar="JSON",
        help='speculative decoding, vLLM\'s keys: \'{"method": "ngram", "num_speculative_tokens": 4, '
        '"prompt_lookup_max": 4, "prompt_lookup_min": 1}\' (proposals by n-gram lookup in each sequence), '
        '\'{"method": "draft_model", "model": PATH, "num_speculative_tokens": 4}\' (a draft model of the same '
        'vocabulary) or \'{"method": "draft_model", "draft_layers": K}\' (the served model\'s first K layers)',
    )
    srv.add_argument(
        "--speculative-model",
        default=None,
        metavar="PATH",
        help="speculative decoding with this draft model (same vocabulary), 4 tokens proposed per step",
    )
    srv.add_argument(
        "--max-lora-rank", type=int, default=16, help="the largest adapter rank served (each slot's width)"
    )
    srv.add_argument(
        "--allow-runtime-lora-updating",
        action="store_true",
        help="answer /v1/load_lora_adapter and /v1/unload_lora_adapter (they read the server's files; "
        "under --nproc every rank reads the path given)",
    )


def _add_plan(sub: Any) -> None:
    """The ``zerotron plan`` sub-command."""
    plan = sub.add_parser("plan", help="predict memory and step time of a layout; search the best one")
    plan.add_argument("items", nargs="*", metavar="[CONFIG] [key=value ...]", help="as for `zerotron train`")
    plan.add_argument(
        "--hardware", metavar="NAME|FILE", help="a hardware profile name or a YAML/JSON profile"
    )
    plan.add_argument("--gpus", type=int, help="devices in the job (default: one node of the hardware)")
    plan.add_argument("--json", action="store_true", help="print JSON (memory_bytes, step_time_s, ...)")
    plan.add_argument("--search", action="store_true", help="rank every valid layout that fits")
    plan.add_argument("--top", type=int, default=10, help="--search: layouts to show")
    plan.add_argument("--png", default="plan_search.png", help="--search: breakdown plot path")
    plan.add_argument(
        "--calibrate",
        nargs="+",
        metavar="RUN_DIR",
        help="fit the profile's efficiency to a run (GEMM and communication efficiency to several runs)",
    )
    plan.add_argument(
        "--check",
        nargs="+",
        metavar="RUN_DIR",
        help="with --calibrate: runs not used by the fit, predicted with the fitted profile (their error)",
    )
    plan.add_argument("--explain", action="store_true", help="print each time term's formula and inputs")
    plan.add_argument(
        "--attention",
        choices=("flash", "unfused"),
        default="flash",
        help="fused (flash) attention, as zerotron runs it, or unfused attention that stores the scores "
        "(Megatron before flash attention; memory in the mixed convention, time of the score GEMMs)",
    )
    plan.add_argument(
        "--accuracy",
        action="store_true",
        help="the planner's error on the published calibration and validation runs, row by row",
    )
    plan.add_argument(
        "--convention",
        choices=("zerotron", "mixed"),
        default="zerotron",
        help="memory as zerotron's engine holds it, or as Megatron/DeepSpeed do (16-bit params and grads, "
        "Korthikanti activations)",
    )
    plan.set_defaults(fn=_run)


def _add_bench(sub: Any) -> None:
    """The ``zerotron bench`` sub-command."""
    bench = sub.add_parser(
        "bench", help="run the same training job on zerotron, DeepSpeed, FSDP2 and DDP side by side"
    )
    bench.add_argument("items", nargs="*", metavar="[CONFIG] [key=value ...]", help="as for `zerotron train`")
    bench.add_argument(
        "--frameworks",
        default=",".join(BENCH_FRAMEWORKS),
        help=f"comma-separated, from: {', '.join(BENCH_FRAMEWORKS)}, zerotron-uncompressed (the same job "
        "without ZeRO++'s compression) (default: all but zerotron-uncompressed)",
    )
    bench.add_argument("--nproc", type=int, default=2, help="local ranks (ignored under torchrun)")
    bench.add_argument("--repeats", type=int, default=1, help="runs of each framework, interleaved")
    bench.add_argument("--out", help="bench directory (default bench/<timestamp>)")
    bench.add_argument("--plan", action="store_true", help="add zerotron plan's prediction (see --hardware)")
    bench.add_argument(
        "--hardware", default="cpu", help="--plan: hardware profile name or file (default cpu)"
    )
    bench.set_defaults(fn=_run)


def _user_errors() -> tuple[type[BaseException], ...]:
    """Exceptions that are the user's input, reported as one line without a traceback."""
    errors: list[Any] = []
    for module, name in [
        ("zerotron.config_load", "ConfigError"),
        ("zerotron.distributed.mesh", "MeshError"),
        ("zerotron.distributed.launch", "LaunchError"),
        ("zerotron.models.loading", "ModelLoadError"),
        ("zerotron.components.data", "DataError"),
        ("zerotron.checkpoint.store", "CheckpointError"),
        ("zerotron.plan.errors", "PlanError"),
    ]:
        try:
            errors.append(getattr(__import__(module, fromlist=[name]), name))
        except (ImportError, AttributeError):
            continue
    return tuple(errors)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse a command line; ``key=value`` overrides may stand anywhere, before or after the flags.

    argparse's intermixed parsing does not work through sub-parsers, so the sub-command is looked up
    first and its own parser reads the rest intermixed.
    """
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    if argv and argv[0] in subparsers.choices:
        args = subparsers.choices[argv[0]].parse_intermixed_args(argv[1:])
        args.command = argv[0]
        return cast("argparse.Namespace", args)
    return parser.parse_args(argv)


def _show_warning(message: Any, category: type[Warning], *rest: Any, **kw: Any) -> None:
    """zerotron's own warnings as one ``zerotron: warning:`` line; others as Python shows them."""
    if category.__module__.startswith("zerotron"):
        print(f"zerotron: warning: {message}", file=sys.stderr, flush=True)
    else:
        _PYTHON_SHOWWARNING(message, category, *rest, **kw)


_PYTHON_SHOWWARNING = warnings.showwarning


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `zerotron` console script."""
    warnings.showwarning = _show_warning
    try:
        args = parse_args(argv)
    except SystemExit as e:  # argparse's own exit (--help, a malformed flag: one line already printed)
        return e.code if isinstance(e.code, int) else 2
    try:
        return cast(int, args.fn(args))
    except _user_errors() as e:
        print(f"zerotron: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
