"""`zerotron train`: check everything, prepare the run directory and tokens, launch the ranks.

Every check runs in the launching process before any rank starts (DESIGN contract 6): the config, the
mesh arithmetic, the tokenizer and the whole data source (tokenised here, once, into
``run_dir/tokens.npy``, which the ranks memory-map).
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from zerotron.build.source import make_tokenizer, resolve_model, saved_model_config
from zerotron.checkpoint import store
from zerotron.components.adapters import save_run_adapter
from zerotron.components.data import SupervisedDataset, load_supervised, load_tokens, prepare_tokens
from zerotron.components.metrics import plot_loss, truncate_metrics
from zerotron.components.preference import reference_logps
from zerotron.components.preference_data import PreferenceDataset, prepare_preference
from zerotron.components.prompt_data import PromptSet, prepare_prompts, write_prompts
from zerotron.components.rewards import RewardError, load_rewards
from zerotron.components.supervised import prepare_supervised
from zerotron.config import ARCHITECTURE_FIELDS, Config, ModelConfig
from zerotron.config_check import validate
from zerotron.config_deepspeed import from_deepspeed
from zerotron.config_load import ConfigError, load_config, save_config
from zerotron.distributed.launch import (
    LaunchError,
    current_rank_and_world,
    destroy_distributed,
    die_with_parent,
    init_distributed,
    job_rank_and_world,
    share_from_rank0,
    spawn,
    under_torchrun,
)
from zerotron.distributed.mesh import Mesh, ParallelDims
from zerotron.distributed.watchdog import Watchdog
from zerotron.models.tokenizer import Tokenizer
from zerotron.train import run_dir as run_dir_lock
from zerotron.train.fault import RankWatchdog
from zerotron.train.sample import SampleEvery, mean_step_s, write_sample
from zerotron.train.trainer import Trainer


def default_run_dir() -> Path:
    """``runs/<timestamp>`` (or ``runs/<torchrun id>`` so that every rank agrees on it)."""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    if under_torchrun() and run_id and run_id != "none":
        return Path("runs") / f"torchrun-{run_id}"
    return Path("runs") / time.strftime("%Y%m%d-%H%M%S")


def _atomic_save_npy(path: Path, array: np.ndarray) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        np.save(f, array)
    os.replace(tmp, path)


def describe_schedule(config_path: str | None, overrides: list[str], nproc: int) -> str:
    """The pipeline schedule the config would run on ``nproc`` ranks, checked and simulated (no rank starts)."""
    from zerotron.parallel.pipeline_schedule import build_schedule, simulate
    from zerotron.train.pipeline_step import micro_batches_per_step

    world = int(os.environ["WORLD_SIZE"]) if under_torchrun() else nproc
    cfg = resolve_model(load_config(config_path, overrides))
    validate(cfg, world)
    dims = ParallelDims.from_config(cfg.parallel, world)
    if dims.pp == 1:
        return "parallel.pp=1: no pipeline schedule (set parallel.pp > 1)"
    p, v = dims.pp, cfg.parallel.virtual_stages
    m = micro_batches_per_step(cfg, dims.dp)
    schedule = build_schedule(cfg.parallel.pp_schedule, p, m, v)
    result = simulate(schedule)
    head = (
        f"{cfg.parallel.pp_schedule}: pp={p}, virtual_stages={v}, {m} micro-batches per step; "
        f"F = forward, B = backward (BI input / BW weight gradients), F3.1 = micro-batch 3 of chunk 1"
    )
    tail = (
        f"bubble fraction {result.bubble_fraction:.3f} (with backward = 2 x forward); "
        f"most forwards awaiting their backward, per rank: {result.max_in_flight}"
    )
    return "\n".join([head, schedule.format(), tail])


def load_job_config(
    config_path: str | None,
    overrides: list[str],
    world_size: int,
    deepspeed: str | None = None,
    report: bool = True,
    defaults: Mapping[str, Any] | None = None,
) -> Config:
    """The job's config, checked: file, DeepSpeed mapping (command-line overrides win; its table printed
    when ``report``), model.path's architecture and every check that needs no data. Writes no file, so
    every rank of a job may run it."""
    if deepspeed:
        mapped = from_deepspeed(deepspeed, config_path, overrides, world_size, defaults)
        if report:
            print(mapped.table(), flush=True)
        cfg = mapped.config
    else:
        cfg = load_config(config_path, overrides, defaults=defaults)
    cfg = resolve_model(cfg)
    validate(cfg, world_size)
    _check_fits_host(cfg, ParallelDims.from_config(cfg.parallel, world_size))
    return cfg


def _check_fits_host(cfg: Config, dims: ParallelDims) -> None:
    """Each rank materialises its share of the fp32 weights (its tensor-parallel and pipeline part, and
    under ZeRO-3 its data-parallel shard of that) plus the largest single tensor: refuse a model whose
    share alone exceeds one rank's part of this machine (a GPU's memory, or the host's memory over the
    local ranks), before any rank starts."""
    from zerotron.plan.model import total_params
    from zerotron.shapes import ModelShape

    m = cfg.model
    split = dims.tp * dims.pp * (dims.dp if cfg.parallel.zero == 3 else 1)
    largest = max(m.vocab_size, m.intermediate_size, m.num_attention_heads * m.dim_per_head) * m.hidden_size
    need = 4 * (total_params(ModelShape.from_config(m)) // split + largest)
    if torch.cuda.is_available():
        have, where = torch.cuda.get_device_properties(0).total_memory, "one GPU's memory"
    else:
        local = int(os.environ.get("LOCAL_WORLD_SIZE", dims.world_size) or 1)
        have = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // max(1, local)
        where = f"this machine's memory over {local} local rank{'s' if local > 1 else ''}"
    if need > have:
        raise ConfigError(
            f"each rank's share of the model is {need / 4:,.0f} fp32 values ({need / 2**30:,.1f} GiB with the "
            f"largest tensor), more than {where} ({have / 2**30:,.1f} GiB) (hidden_size={m.hidden_size}, "
            f"head_dim={m.dim_per_head}, intermediate_size={m.intermediate_size}, vocab_size={m.vocab_size}, "
            f"layers={m.num_hidden_layers}); check the model.* sizes, or split it further (parallel.tp, "
            "parallel.pp, parallel.zero=3) or run fewer local ranks"
        )


def _absolute(path: str) -> str:
    return str(Path(path).expanduser().resolve())


def _check_resume_model(ckpt: Path, cfg: Config) -> None:
    """The checkpoint holds the same architecture as the config (else one line naming the field)."""
    saved = ModelConfig(**saved_model_config(ckpt))
    for name in ARCHITECTURE_FIELDS:
        ours, theirs = getattr(cfg.model, name), getattr(saved, name)
        if theirs != ours:
            raise ConfigError(
                f"--resume {ckpt}: the checkpoint's model has {name}={theirs} but this config has "
                f"model.{name}={ours}; resume with the same model settings or start a new run (--out)"
            )


def resolve_resume(run_dir: Path, resume: str | None, cfg: Config) -> Path | None:
    """The checkpoint to resume from (verified once, here) or None; ``auto`` says what it found."""
    if resume is None:
        return None
    path: Path | None
    if resume != "auto":
        path = Path(resume)
        if not path.is_dir():
            raise ConfigError(f"--resume {resume}: no such checkpoint folder")
        store.verify(path)  # a corrupt file stops here, named, before any rank starts
    else:
        path, skipped = store.scan(run_dir / "checkpoints")
        for reason in skipped:
            fallback = f"falling back to {path.name}" if path else "no complete checkpoint left"
            print(f"zerotron: skipping a checkpoint: {reason}; {fallback}", file=sys.stderr, flush=True)
        if path is None and skipped:
            raise ConfigError(
                f"--resume auto: no usable checkpoint in {run_dir / 'checkpoints'} (see above); repair or "
                "remove them, or start over with --overwrite"
            )
        if path is None:
            print(
                f"zerotron: --resume auto: no checkpoint in {run_dir / 'checkpoints'}; starting from step 0",
                file=sys.stderr,
                flush=True,
            )
            return None
    assert path is not None
    _check_resume_model(path, cfg)
    return path


def prepare_run(cfg: Config, run_dir: Path) -> int:
    """Tokenise the data and write config.yaml, tokens.npy and the tokenizer files; return the token count.

    Paths in the saved config are made absolute, so the run directory is usable from anywhere.
    """
    tokenizer = make_tokenizer(cfg)
    if tokenizer.vocab_size > cfg.model.vocab_size:
        raise ConfigError(
            f"data.tokenizer has {tokenizer.vocab_size} tokens but model.vocab_size is {cfg.model.vocab_size}; "
            f"set model.vocab_size>={tokenizer.vocab_size}"
        )
    if cfg.data.format == "preference":
        n_tokens = _prepare_preference(cfg, tokenizer, run_dir)
    elif cfg.data.format == "prompts":
        n_tokens = _prepare_prompts(cfg, tokenizer, run_dir)
    elif cfg.data.format != "pretrain":
        n_tokens = _prepare_supervised(cfg, tokenizer, run_dir)
    else:
        n_tokens = _prepare_pretraining(cfg, tokenizer, run_dir)
    for name in ("bos", "eos"):  # recorded so that exports stop generation where the tokenizer does
        if (
            getattr(cfg.model, f"{name}_token_id") is None
            and getattr(tokenizer, f"{name}_id", None) is not None
        ):
            setattr(cfg.model, f"{name}_token_id", getattr(tokenizer, f"{name}_id"))
    if cfg.model.path:
        cfg.model.path = _absolute(cfg.model.path)
    if cfg.data.tokenizer not in ("byte", "model"):
        cfg.data.tokenizer = _absolute(cfg.data.tokenizer)
    if cfg.data.source != "stdlib":
        cfg.data.source = _absolute(cfg.data.source)
    save_config(cfg, run_dir / "config.yaml")
    to_files = getattr(tokenizer, "to_files", None)
    for name, text in (to_files() if to_files else {}).items():  # generate/convert/serve read them
        (run_dir / name).write_text(text, encoding="utf-8")
    return n_tokens


def _check_vocab(cfg: Config, top: int) -> None:
    if top >= cfg.model.vocab_size:
        raise ConfigError(
            f"data.source {cfg.data.source!r} holds token id {top} but model.vocab_size is {cfg.model.vocab_size}; "
            f"set model.vocab_size>={top + 1}"
        )


def _prepare_pretraining(cfg: Config, tokenizer: Tokenizer, run_dir: Path) -> int:
    """Documents into ``tokens.npy``; return the token count."""
    tokens = prepare_tokens(cfg.data, tokenizer)
    needed = cfg.train.global_batch * cfg.train.seq_len + 1
    if len(tokens) < needed:
        raise ConfigError(
            f"data.source {cfg.data.source!r} gives {len(tokens)} tokens, fewer than one global batch "
            f"({needed}); add data or lower train.global_batch/train.seq_len"
        )
    _check_vocab(cfg, int(tokens.max()))
    _atomic_save_npy(run_dir / "tokens.npy", tokens)
    return len(tokens)


def _prepare_supervised(cfg: Config, tokenizer: Tokenizer, run_dir: Path) -> int:
    """Supervised samples packed into ``sft.npy`` (see :mod:`zerotron.finetune.sft`), the chat template
    they were rendered with kept for the exported tokenizer; return the tokens the loss counts."""
    pad = tokenizer.eos_id if tokenizer.eos_id is not None else 0
    data = prepare_supervised(cfg.data, tokenizer, cfg.train.seq_len, pad)
    print(f"zerotron: data {cfg.data.source}: {data.summary()}", flush=True)
    if data.rows.shape[1] < cfg.train.global_batch:
        raise ConfigError(
            f"data.source {cfg.data.source!r} packs into {data.rows.shape[1]} rows of {cfg.train.seq_len} tokens, "
            f"fewer than one global batch ({cfg.train.global_batch}); add data or lower train.global_batch"
        )
    _check_vocab(cfg, int(data.rows[0].max()))
    if data.skipped:
        with open(run_dir / "skipped_rows.txt", "w", encoding="utf-8") as f:
            f.write("\n".join(data.skipped) + "\n")
    _atomic_save_npy(run_dir / "sft.npy", data.rows)
    return data.loss_tokens


def _prepare_preference(cfg: Config, tokenizer: Tokenizer, run_dir: Path) -> int:
    """Preference pairs into ``dpo.npy`` (two rows each, see :mod:`zerotron.finetune.dpo`); return the
    answer tokens the loss counts."""
    pad = tokenizer.eos_id if tokenizer.eos_id is not None else 0
    data = prepare_preference(cfg.data, tokenizer, cfg.train.seq_len, pad)
    print(f"zerotron: data {cfg.data.source}: {data.summary()}", flush=True)
    if data.pairs < cfg.train.global_batch:
        raise ConfigError(
            f"data.source {cfg.data.source!r} holds {data.pairs} preference pairs, fewer than one global batch "
            f"({cfg.train.global_batch} pairs); add data or lower train.global_batch"
        )
    _check_vocab(cfg, int(data.rows[0].max()))
    if data.skipped:
        (run_dir / "skipped_rows.txt").write_text("\n".join(data.skipped) + "\n", encoding="utf-8")
    _atomic_save_npy(run_dir / "dpo.npy", data.rows)
    return data.loss_tokens


def _prepare_prompts(cfg: Config, tokenizer: Tokenizer, run_dir: Path) -> int:
    """Prompt rows into ``prompts.jsonl`` (see :mod:`zerotron.finetune.grpo`); return their tokens."""
    try:
        load_rewards(cfg.grpo)  # a reward that cannot be found is said before anything runs
    except RewardError as e:
        raise ConfigError(str(e)) from None
    data = prepare_prompts(cfg.data, tokenizer, cfg.train.seq_len - cfg.grpo.max_new_tokens)
    print(f"zerotron: data {cfg.data.source}: {data.summary()}", flush=True)
    if len(data.lines) < cfg.train.global_batch:
        raise ConfigError(
            f"data.source {cfg.data.source!r} holds {len(data.lines)} prompts, fewer than one global batch "
            f"({cfg.train.global_batch} prompts); add data or lower train.global_batch"
        )
    _check_vocab(cfg, max(max(line["ids"]) for line in data.lines))
    if data.skipped:
        (run_dir / "skipped_rows.txt").write_text("\n".join(data.skipped) + "\n", encoding="utf-8")
    write_prompts(run_dir / "prompts.jsonl", data)
    return sum(len(line["ids"]) for line in data.lines)


def load_data(cfg: Config, rd: Path) -> np.ndarray | SupervisedDataset | PreferenceDataset | PromptSet:
    """The run's prepared data, as the trainer takes it."""
    if cfg.data.format == "prompts":
        return PromptSet(rd / "prompts.jsonl", cfg.train.seq_len)
    if cfg.data.format == "pretrain":
        return load_tokens(str(rd / "tokens.npy"))
    if cfg.data.format == "preference":
        return PreferenceDataset(np.load(rd / "dpo.npy", mmap_mode="r", allow_pickle=False))
    return load_supervised(rd / "sft.npy", cfg.data.packing)


def _reference(trainer: Trainer, data: PreferenceDataset, rd: Path) -> np.ndarray:
    """The reference log-probs of every pair: computed by the model as built (the run's step 0, before
    any checkpoint is loaded) and kept in ``reference_logps.npy``, which a resumed run reads instead."""
    path = rd / "reference_logps.npy"
    if path.exists():
        saved: np.ndarray = np.load(path, allow_pickle=False)
        if saved.shape == (2 * len(data),):
            return saved
    started = time.perf_counter()
    values = reference_logps(trainer.model, data, trainer.mesh, trainer.cfg, trainer.device)
    trainer.mesh.stats.reset()  # the pass's traffic is not the first step's
    if trainer.mesh.rank == 0:
        _atomic_save_npy(path, values)
        print(
            f"zerotron: reference log-probs of {len(data):,} pairs in {time.perf_counter() - started:.1f} s",
            flush=True,
        )
    return values


def banner(cfg: Config, world: int, n_tokens: int, run_dir: Path) -> str:
    """One line before step 1: model size, layout, data, tokens per step, run directory."""
    from zerotron.plan.layout import from_config
    from zerotron.plan.model import active_params, total_params

    shape, layout, _ = from_config(cfg, world)
    m, t, p = cfg.model, cfg.train, cfg.parallel
    name = m.preset or Path(m.path or "model").name
    active = f", {active_params(shape) / 1e6:,.2f} M active" if shape.experts else ""
    zero = f"{p.zero} (blocks of {layout.zero_shards})" if layout.zero_shards < layout.dp else f"{p.zero}"
    return (
        f"zerotron: {name} ({total_params(shape) / 1e6:,.2f} M parameters{active}, {m.num_hidden_layers} layers, "
        f"hidden {m.hidden_size}) | dp={layout.dp} tp={p.tp} pp={p.pp} cp={p.cp} zero={zero} on {world} "
        f"rank{'s' if world > 1 else ''} | data {cfg.data.source}: {n_tokens:,} tokens ({cfg.data.tokenizer}) "
        f"| {t.global_batch * t.seq_len:,} tokens per step x {t.steps} steps, {t.precision} | run directory "
        f"{run_dir}"
    )


def train_worker(run_dir: str, resume: str | None, attempt: int = 0) -> dict[str, Any]:
    """Body of one rank: build the mesh and the trainer, train, and (rank 0) report.

    ``resume`` is the checkpoint folder the launcher chose and verified (None: start at step 0);
    ``attempt`` counts the restarts before this one (fault injection runs on attempt 0 only).
    """
    rd = Path(run_dir)
    cfg = load_config(str(rd / "config.yaml"), [])
    rank, world = current_rank_and_world()
    mesh = Mesh(ParallelDims.from_config(cfg.parallel, world), rank)
    data = load_data(cfg, rd)
    trainer = Trainer(cfg, mesh, rd, data, attempt=attempt)
    if isinstance(data, PreferenceDataset) and cfg.preference.loss != "simpo":
        data.reference = _reference(trainer, data, rd)  # before a checkpoint replaces the weights
    if not os.environ.get("ZEROTRON_TRACE_DIR"):  # no zerotron launcher watching: watch ourselves
        RankWatchdog(mesh, trainer, cfg.fault.hang_timeout_s, cfg.fault.first_step_timeout_s)
    resumed = trainer.resume(resume, verified=True) if resume else None  # hashed once, by the launcher
    if rank == 0:
        truncate_metrics(rd, trainer.step)  # steps after the checkpoint are run again: no duplicates
    saved = {k: v for k, v in (trainer.resumed_layout or {}).items() if k != "world_size"}
    resharded = saved if resumed is not None and saved and saved != trainer.layout() else None
    if resumed is not None and rank == 0:
        moved = f", resharded from {saved} to {trainer.layout()}" if resharded else ""
        print(f"resumed from {resumed} at step {trainer.step}{moved}", flush=True)
    start = trainer.step
    # the samples run under the training layout, offload included
    history = trainer.fit(on_step=SampleEvery(rd) if trainer.cfg.train.sample_every else None, keep_open=True)
    try:
        summary: dict[str, Any] = {"rank": rank, "steps": trainer.step - start, "last_step": trainer.step}
        if trainer.stopped:
            summary["stopped"] = trainer.stopped
        if resumed is not None:
            summary["resumed_from_step"] = start
        if resharded:
            summary["resharded_from"] = resharded
        if history:
            summary.update(first_loss=history[0]["loss"], last_loss=history[-1]["loss"])
        if not trainer.stopped:
            summary.update(_finish(trainer, rd, history))
        summary["phase_peak_memory_bytes"] = dict(trainer.memory.peaks)
        summary["memory_at_start_bytes"] = trainer.memory.at_start
    finally:
        trainer.close()
    return summary


def _finish(trainer: Trainer, run_dir: Path, history: list[dict[str, Any]]) -> dict[str, Any]:
    """Loss plot (rank 0), the LoRA adapter, and the end-of-run sample under the training layout
    (:mod:`zerotron.train.sample`, at most ``train.sample_max_steps`` of the run's steps' time)."""
    out: dict[str, Any] = {}
    mesh, cfg = trainer.mesh, trainer.cfg
    metrics = run_dir / "metrics.jsonl"
    if mesh.rank == 0 and metrics.exists() and metrics.stat().st_size > 0:
        plot_loss(metrics, run_dir / "loss.png")
    if cfg.lora.rank > 0:
        adapter = save_run_adapter(trainer.model, mesh, trainer.zero, cfg, run_dir / "adapter")
        if adapter is not None:
            out["adapter"] = str(adapter)
    text = write_sample(trainer, run_dir, mean_step_s(history))
    if text is not None and mesh.rank == 0:
        out["sample"] = text
    return out


# a rank's body: (run directory, checkpoint to resume or None, restart attempt) -> its summary
Worker = Callable[[str, "str | None", int], dict[str, Any]]


@dataclass(frozen=True)
class LaunchOptions:
    """How a training job is launched (the flags every training command shares), checked on
    construction: the run directory (``--out``; default ``runs/<timestamp>``), what to resume (``auto``
    or a checkpoint folder), a DeepSpeed config to map, whether to start over in a directory that
    holds a run, and how many times a failed job is restarted from its newest checkpoint.
    ``start_method``: how local ranks start (:func:`~zerotron.distributed.launch.spawn`): ``spawn``, as
    the command line does, or ``forkserver`` for a program that launches many short jobs (a test suite):
    the ranks' output then goes where the fork server's went; None: ``launch.DEFAULT_START_METHOD``."""

    out: str | None = None
    resume: str | None = None
    deepspeed: str | None = None
    overwrite: bool = False
    max_restarts: int = 0
    start_method: str | None = None

    def __post_init__(self) -> None:
        if self.max_restarts < 0:
            raise ConfigError(f"--max-restarts {self.max_restarts}: give 0 or more")


def launch_training(
    config_path: str | None,
    overrides: list[str],
    nproc: int,
    options: LaunchOptions | None = None,
    defaults: Mapping[str, Any] | None = None,
    worker: Worker | None = None,
) -> dict[str, Any] | None:
    """Check, prepare and run a training job on ``nproc`` local ranks, or as one rank of a torchrun job.

    With ``options.max_restarts``, a job that fails (a rank crashes or dies, a hang, too many bad steps)
    is torn down and started again from the newest complete checkpoint, at most that many times; each
    restart and its cause go into ``restarts.jsonl``. ``defaults``: dotted keys in place of the tree's
    defaults (``zerotron sft``'s). Returns rank 0's summary; under torchrun the other ranks return None
    (rank 0 reports for the job). ``worker``: each rank's body in place of :func:`train_worker` (an
    application's own loop around the trainer: ``zerotron grpo``'s), called the same way.
    """
    options = options or LaunchOptions()
    worker = worker or train_worker
    out, resume, overwrite, max_restarts = (
        options.out,
        options.resume,
        options.overwrite,
        options.max_restarts,
    )
    if under_torchrun():
        return _run_as_job_rank(config_path, overrides, options, defaults, worker)
    if nproc < 1:
        raise ConfigError(f"--nproc {nproc}: give at least 1 local rank")
    cfg = load_job_config(config_path, overrides, nproc, options.deepspeed, defaults=defaults)
    run_dir = Path(out) if out else default_run_dir()
    lock = run_dir_lock.claim(run_dir, resume, overwrite)  # held until this process ends
    try:
        checkpoint = resolve_resume(run_dir, resume, cfg)
        n_tokens = prepare_run(cfg, run_dir)
        print(banner(cfg, nproc, n_tokens, run_dir), flush=True)
        watchdog = Watchdog(cfg.fault.hang_timeout_s, cfg.fault.first_step_timeout_s)
        for attempt in range(max_restarts + 1):
            ckpt = str(checkpoint) if checkpoint else None
            try:
                results = spawn(
                    worker,
                    nproc,
                    args=(str(run_dir), ckpt, attempt),
                    backend=cfg.parallel.backend,
                    watchdog=watchdog,
                    start_method=options.start_method,
                )
                return _report({**results[0], "restarts": attempt}, run_dir)
            except LaunchError as e:
                if attempt == max_restarts:
                    raise
                checkpoint = _restart_from(run_dir, attempt + 1, max_restarts, str(e))
        raise AssertionError("unreachable")
    finally:
        lock.close()


def _restart_from(run_dir: Path, attempt: int, max_restarts: int, cause: str) -> Path | None:
    """Record why the job is restarted and pick the newest complete checkpoint to restart from."""
    checkpoint, skipped = store.scan(run_dir / "checkpoints")
    for reason in skipped:
        print(f"zerotron: skipping a checkpoint: {reason}", file=sys.stderr, flush=True)
    first = cause.splitlines()[0]
    where = f"from {checkpoint.name}" if checkpoint else "from step 0 (no checkpoint yet)"
    print(f"zerotron: restart {attempt}/{max_restarts} {where} after: {first}", file=sys.stderr, flush=True)
    entry = {"attempt": attempt, "time": time.time(), "cause": first, "resume": str(checkpoint or "")}
    with open(run_dir / "restarts.jsonl", "a", encoding="utf-8") as f:
        f.write(json.dumps(entry) + "\n")
    return checkpoint


def _report(summary: dict[str, Any], run_dir: Path) -> dict[str, Any]:
    summary["run_dir"] = str(run_dir)
    with open(run_dir / "summary.json", "w", encoding="utf-8") as f:
        json.dump({k: v for k, v in summary.items() if k != "sample"}, f, indent=1)
    return summary


def _run_as_job_rank(
    config_path: str | None,
    overrides: list[str],
    options: LaunchOptions,
    defaults: Mapping[str, Any] | None = None,
    worker: Worker | None = None,
) -> dict[str, Any] | None:
    """This process is one rank of a torchrun/SLURM job (DESIGN contract 10): every rank checks the
    config (pure), rank 0 alone claims the run directory and writes the shared files while the others
    wait for its word, then every rank trains; rank 0 reports."""
    out, resume, deepspeed, overwrite = options.out, options.resume, options.deepspeed, options.overwrite
    rank, world = job_rank_and_world()
    die_with_parent()  # a rank never outlives its torchrun agent (or srun step)
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    if attempt > 0 and resume is None:  # torchrun restarted the job (--max-restarts): continue it
        resume = "auto"
    cfg = load_job_config(config_path, overrides, world, deepspeed, report=rank == 0, defaults=defaults)
    init_distributed(cfg.parallel.backend)
    lock = None
    try:
        word = ""
        if rank == 0:
            try:
                run_dir = Path(out) if out else default_run_dir()
                lock = run_dir_lock.claim(run_dir, resume, overwrite)
                checkpoint = resolve_resume(run_dir, resume, cfg)
                n_tokens = prepare_run(cfg, run_dir)
                print(banner(cfg, world, n_tokens, run_dir), flush=True)
                word = json.dumps(
                    {"run_dir": str(run_dir), "resume": str(checkpoint) if checkpoint else None}
                )
            except Exception as e:
                share_from_rank0(json.dumps({"error": str(e)}))
                raise
        message = json.loads(share_from_rank0(word))
        if "error" in message:
            raise ConfigError(f"rank 0 could not prepare the run: {message['error']}")
        summary = (worker or train_worker)(message["run_dir"], message["resume"], attempt)
        return _report(summary, Path(message["run_dir"])) if rank == 0 else None
    finally:
        destroy_distributed()
        if lock is not None:
            lock.close()
