"""The `zerotron` command line: parse arguments and dispatch. No logic of its own."""

from __future__ import annotations

import argparse
import sys
import warnings
from typing import Any, NoReturn, cast

from zerotron.config_load import ConfigError

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


def _split_config_and_overrides(items: list[str]) -> tuple[str | None, list[str]]:
    config = None
    overrides = []
    for item in items:
        if "=" in item:
            overrides.append(item)
        elif config is None:
            config = item
        else:
            raise ConfigError(f"more than one config file given ({config!r}, {item!r})")
    return config, overrides


def _cmd_train(args: argparse.Namespace) -> int:
    if args.show_schedule:
        from zerotron.train.run import describe_schedule

        config, overrides = _split_config_and_overrides(args.items)
        print(describe_schedule(config, overrides, args.nproc))
        return 0
    if args.help_config:
        from zerotron.config_load import describe_fields

        print(describe_fields())
        return 0
    from zerotron.train.run import launch_training

    config, overrides = _split_config_and_overrides(args.items)
    return _report_run(launch_training(config, overrides, args.nproc, **_launch_options(args)))


def _launch_options(args: argparse.Namespace) -> dict[str, Any]:
    return dict(
        out=args.out,
        resume=args.resume,
        deepspeed=args.deepspeed,
        overwrite=args.overwrite,
        max_restarts=args.max_restarts,
    )


def _cmd_sft(args: argparse.Namespace) -> int:
    from zerotron.finetune.sft import SFT_DEFAULTS
    from zerotron.train.run import launch_training

    config, overrides = _split_config_and_overrides(args.items)
    defaults = {**SFT_DEFAULTS, "model.path": args.model, "data.source": args.data}
    summary = launch_training(config, overrides, args.nproc, defaults=defaults, **_launch_options(args))
    code = _report_run(summary)
    if summary is not None and summary.get("adapter"):
        print(
            f"adapter (PEFT format): {summary['adapter']}; merge it with: zerotron convert "
            f"{args.model} MERGED --merge-lora {summary['adapter']}"
        )
    return code


def _report_run(summary: dict[str, Any] | None) -> int:
    """Print a finished run's summary (rank 0); the exit code."""
    if summary is None:  # a rank other than 0 of a torchrun/srun job: rank 0 reports
        return 0
    if summary.get("stopped"):
        from zerotron.train.fault import STOPPED_EXIT_CODE

        print(
            f"stopped by {summary['stopped']} after step {summary['last_step']}; checkpoint written; continue "
            f"with --resume auto --out {summary['run_dir']}"
        )
        return STOPPED_EXIT_CODE
    ran = f"{summary['steps']} steps"
    if "resumed_from_step" in summary:
        ran += f" (steps {summary['resumed_from_step'] + 1}-{summary['last_step']}, after resuming)"
    if "first_loss" in summary:
        print(f"loss {summary['first_loss']:.4f} -> {summary['last_loss']:.4f} over {ran}")
    else:
        print(f"nothing to run: the checkpoint is at step {summary['last_step']} (train.steps)")
    if summary.get("sample"):
        print("sample:\n" + summary["sample"])
    print(f"run directory: {summary['run_dir']}")
    return 0


def _cmd_generate(args: argparse.Namespace) -> int:
    from zerotron.serve.generate import (
        check_device,
        check_options,
        generate_worker,
        rank_backend,
        run_generate,
    )

    model, overrides = _split_config_and_overrides(args.items)
    tp = 1
    for item in overrides:
        key, _, value = item.partition("=")
        if key != "parallel.tp" or not value.isdigit() or int(value) < 1:
            raise ConfigError(f"generate takes only parallel.tp=N (an integer), not {item!r}")
        tp = int(value)
    if model is None:
        raise ConfigError("generate needs a MODEL (Hugging Face directory or .gguf file)")
    nproc = args.nproc if args.nproc is not None else tp
    if nproc != tp:
        raise ConfigError(f"--nproc {nproc} must equal parallel.tp={tp} for generate")
    options = dict(
        chat=args.chat,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
    )
    device = str(check_device("generate", args.device, nproc))
    check_options(model, tp, options)
    options["device"] = device
    if tp == 1:
        run_generate(model, args.prompt, **options)
        return 0
    from zerotron.distributed.launch import spawn

    spawn(generate_worker, nproc, args=(model, args.prompt, options), backend=rank_backend(device))
    return 0


def _cmd_serve(args: argparse.Namespace) -> int:
    try:
        from zerotron.serve.app import run_server
    except ImportError as err:
        raise ConfigError(
            f"zerotron serve needs FastAPI and uvicorn ({err}): pip install 'zerotron[serve]'"
        ) from None
    from zerotron.distributed.launch import adopt_slurm_env, job_rank_and_world, under_torchrun
    from zerotron.serve.app import engine_config

    nproc = 1 if args.nproc is None else args.nproc
    if adopt_slurm_env() or under_torchrun():  # every process of the job is a tensor-parallel rank
        nproc = job_rank_and_world()[1]
    config = engine_config(args, nproc)
    if nproc == 1 and not under_torchrun():
        run_server(args.model, args.host, args.port, args.served_model_name, config)
        return 0
    from zerotron.config import Config
    from zerotron.config_check import check_tensor_parallel
    from zerotron.distributed.launch import spawn
    from zerotron.serve.app import serve_worker
    from zerotron.serve.generate import model_config, rank_backend

    cfg = Config(model=model_config(args.model))
    cfg.parallel.tp = nproc  # every rank holds a tensor-parallel shard
    check_tensor_parallel(cfg)
    name = args.served_model_name or args.model
    spawn(
        serve_worker,
        nproc,
        args=(args.model, name, args.host, args.port, config),
        backend=rank_backend(config.device),
    )
    return 0


def _cmd_convert(args: argparse.Namespace) -> int:
    from zerotron.checkpoint.convert import convert

    convert(args.src, args.dst, to=args.to, merge_lora=args.merge_lora)
    print(
        f"wrote {args.dst}"
        + (" (a run directory: model.path or --resume it)" if args.to == "checkpoint" else "")
    )
    return 0


def _cmd_plan(args: argparse.Namespace) -> int:
    """`zerotron plan`: predict memory and step time, search layouts, or calibrate a profile."""
    import json
    from pathlib import Path

    from zerotron.config_load import load_config
    from zerotron.plan import PROFILES, PlanError, get_hardware, plan_config
    from zerotron.plan.calibrate import calibrate_runs, read_metrics
    from zerotron.plan.layout import from_config
    from zerotron.plan.planner import refuse_compiled
    from zerotron.plan.report import draw_breakdowns, format_calibration, format_plan, format_table
    from zerotron.plan.search import search

    config, overrides = _split_config_and_overrides(args.items)
    if args.accuracy:
        from zerotron.plan.accuracy import accuracy_report

        print(accuracy_report())
        return 0
    if args.calibrate:
        overrides += [item for item in args.calibrate + (args.check or []) if "=" in item]

        def runs_of(items: list[str]) -> list[tuple[Any, list[dict[str, Any]]]]:
            runs = []
            for run_dir in (Path(item) for item in items if "=" not in item):
                records = read_metrics(run_dir)
                saved = run_dir / "config.yaml"
                runs.append((load_config(str(saved) if saved.is_file() else config, overrides), records))
            return runs

        hw = get_hardware(args.hardware or "cpu")
        result = calibrate_runs(runs_of(args.calibrate), hw, held_out=runs_of(args.check or []))
        print(json.dumps(result, indent=2) if args.json else format_calibration(result))
        return 0
    if args.check:
        raise PlanError("--check RUN_DIR ... goes with --calibrate: runs to predict with the fitted profile")
    if not args.hardware:
        raise PlanError(f"--hardware is required: choose one of {', '.join(PROFILES)} or give a profile file")
    hw = get_hardware(args.hardware)
    gpus = args.gpus if args.gpus is not None else hw.gpus_per_node
    flash = args.attention == "flash"
    cfg = load_config(config, overrides)
    if cfg.model.path:  # the architecture is in the HF directory or GGUF file, as for `zerotron train`
        from zerotron.models.loading import read_model_config

        cfg.model = read_model_config(cfg.model.path)
    if args.search:
        if args.top < 1:
            raise PlanError(f"--top {args.top}: show at least 1 layout")
        refuse_compiled(cfg)
        model, _, work = from_config(_unplaced(cfg), gpus)
        found = search(model, work, hw, gpus, convention=args.convention, top=args.top, flash=flash)
        if args.json:
            print(json.dumps([p.to_json() for p in found.plans], indent=2))
            return 0
        print(format_table(found))
        print(f"breakdowns of the best plans: {draw_breakdowns(found, Path(args.png))}")
        return 0
    plan = plan_config(cfg, hw, gpus, convention=args.convention, flash=flash)
    print(json.dumps(plan.to_json(), indent=2) if args.json else format_plan(plan))
    if args.explain and not args.json:
        from zerotron.plan.explain import explain

        print(explain(*from_config(cfg, gpus), hw, plan, flash))
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    """`zerotron bench`: the same job on zerotron and its peers, side by side."""
    from zerotron.bench import parse_frameworks, run_bench

    config, overrides = _split_config_and_overrides(args.items)
    results = run_bench(
        config,
        overrides,
        parse_frameworks(args.frameworks),
        args.nproc,
        repeats=args.repeats,
        out=args.out,
        plan_hardware=args.hardware if args.plan else None,
    )
    if results is None:  # a rank other than 0 of a torchrun job
        return 0
    print(results["table"])
    plan = results["frameworks"].get("zerotron", {}).get("plan")
    if plan and "step_time_s" in plan:
        error = (
            f" (measured / predicted - 1 = {plan['step_time_error']:+.1%})"
            if "step_time_error" in plan
            else ""
        )
        print(
            f"zerotron plan on {plan['hardware']}: {plan['step_time_s']:.4f} s per step, "
            f"{plan['memory_bytes'] / 2**20:,.0f} MiB per rank{error}"
        )
    elif plan:
        print(f"zerotron plan on {plan['hardware']}: {plan['error']}")
    print(f"results: {results['run_dir']}/results.json, {results['run_dir']}/bench.png")
    return 0


def _unplaced(cfg: Any) -> Any:
    """``cfg`` with ``parallel`` reset to one rank of pure data parallelism (the search picks the layout)."""
    import dataclasses

    return dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, dp=-1, tp=1, pp=1, cp=1))


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
    train.set_defaults(fn=_cmd_train)

    sft = sub.add_parser(
        "sft",
        help="fine-tune a model on chat data (LoRA, assistant-only loss, packing)",
        epilog=EPILOG_SFT,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sft.add_argument("model", metavar="MODEL", help="HF directory, .gguf file, or zerotron checkpoint/run")
    sft.add_argument("data", metavar="DATA", help=".jsonl/.json/.csv/.parquet file or a directory of them")
    sft.add_argument(
        "items",
        nargs="*",
        metavar="[CONFIG] [key=value ...]",
        help="as for `zerotron train` (see zerotron train --help-config: lora.*, data.*)",
    )
    _add_launch_args(sft)
    sft.set_defaults(fn=_cmd_sft)

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
    conv.set_defaults(fn=_cmd_convert)

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
    gen.set_defaults(fn=_cmd_generate)


def _add_serve(sub: Any) -> None:
    """``zerotron serve``."""
    srv = sub.add_parser(
        "serve", help="serve a model over an OpenAI-compatible HTTP API (paged KV cache, continuous batching)"
    )
    srv.add_argument("model", metavar="MODEL", help="HF directory, .gguf file, or zerotron checkpoint/run")
    srv.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    srv.add_argument("--port", type=int, default=8000)
    srv.add_argument("--served-model-name", default=None, help="the model id clients send (default: MODEL)")
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
        "kernels, bf16 on AMX tiles or else AVX512-BF16, fp32 on AVX-512 (the default on one rank "
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
    srv.set_defaults(fn=_cmd_serve)


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
    plan.set_defaults(fn=_cmd_plan)


def _add_bench(sub: Any) -> None:
    """The ``zerotron bench`` sub-command."""
    bench = sub.add_parser(
        "bench", help="run the same training job on zerotron, DeepSpeed, FSDP2 and DDP side by side"
    )
    bench.add_argument("items", nargs="*", metavar="[CONFIG] [key=value ...]", help="as for `zerotron train`")
    bench.add_argument(
        "--frameworks",
        default=",".join(BENCH_FRAMEWORKS),
        help=f"comma-separated, from: {', '.join(BENCH_FRAMEWORKS)} (default: all)",
    )
    bench.add_argument("--nproc", type=int, default=2, help="local ranks (ignored under torchrun)")
    bench.add_argument("--repeats", type=int, default=1, help="runs of each framework, interleaved")
    bench.add_argument("--out", help="bench directory (default bench/<timestamp>)")
    bench.add_argument("--plan", action="store_true", help="add zerotron plan's prediction (see --hardware)")
    bench.add_argument(
        "--hardware", default="cpu", help="--plan: hardware profile name or file (default cpu)"
    )
    bench.set_defaults(fn=_cmd_bench)


def _user_errors() -> tuple[type[BaseException], ...]:
    """Exceptions that are the user's input, reported as one line without a traceback."""
    errors: list[Any] = []
    for module, name in [
        ("zerotron.config_load", "ConfigError"),
        ("zerotron.distributed.mesh", "MeshError"),
        ("zerotron.distributed.launch", "LaunchError"),
        ("zerotron.models.loading", "ModelLoadError"),
        ("zerotron.train.data", "DataError"),
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
