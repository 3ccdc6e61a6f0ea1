"""The training loop of one rank: micro-batches, gradient accumulation, data-parallel reduction,
precision, clipping, the optimizer step, metrics and checkpoints.

Parallelism is applied in DESIGN.md's order: :func:`build_model` runs the one parallelize path
(pipeline split → tensor/sequence parallel → context parallel → expert parallel → activation
recomputation), then the engine adds data-parallel gradient buckets or ZeRO last.
"""

from __future__ import annotations

import contextlib
import math
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from zerotron.checkpoint import store
from zerotron.checkpoint.async_save import CheckpointWriter
from zerotron.config import LORA_NAME_LIST, Config
from zerotron.config_load import to_dict
from zerotron.distributed import collectives
from zerotron.distributed.mesh import Mesh
from zerotron.models.lora import LoraConfig, apply_lora
from zerotron.models.nf4_tp import frozen_base_bytes, quantized_weight_numel
from zerotron.models.parallelize import parallelize_llama
from zerotron.models.sources import InitSource, WeightSource, open_pretrained
from zerotron.parallel.data import GradientBuckets
from zerotron.parallel.engine import GradientReducer, ShardedEngine
from zerotron.parallel.placement import (
    counts_in_norm,
    grad_groups,
    local_numel,
    materialize,
    materialize_buffers,
    norm_axes,
)
from zerotron.parallel.zero.api import apply_zero, offload_optimizer, zero_sharding
from zerotron.plan.hardware import peak_flops_of_device
from zerotron.plan.model import inactive_params
from zerotron.shapes import ModelShape, flops_per_token
from zerotron.train import state as ckpt_state
from zerotron.train.data import DataLoader, PackedDataset, SupervisedDataset
from zerotron.train.fault import BadStepGuard, Injector, StopRequest, agree
from zerotron.train.fill import fill_from
from zerotron.train.loss import AUTOCAST, REDUCE_DTYPE
from zerotron.train.metrics import ActivationMeter, MetricsWriter, Progress
from zerotron.train.optim import (
    DynamicLossScaler,
    adamw,
    clip_grads_,
    lr_at,
    sharded_grad_norm,
)
from zerotron.train.step import build_step


@contextlib.contextmanager
def weight_source(cfg: Config, model: nn.Module) -> Iterator[WeightSource]:
    """Where ``model``'s weights come from: a zerotron checkpoint (or run) named by ``model.path`` (each
    rank picks the run's newest checkpoint by file sizes and hashes only the files it reads), a Hugging
    Face directory or GGUF file named by it, or the layout-independent initial values."""
    ckpt = store.checkpoint_dir(Path(cfg.model.path), hashes=False) if cfg.model.path else None
    source: WeightSource
    if ckpt is not None:
        source = ckpt_state.CheckpointSource(ckpt, model)
    elif cfg.model.path:
        source = open_pretrained(cfg.model.path, cfg.model)
    else:
        source = InitSource(cfg.model, cfg.train.seed)
    try:
        yield source
    finally:
        source.close()


def build_model(
    cfg: Config, device: torch.device, mesh: Mesh | None = None, materialized: bool = True
) -> nn.Module:
    """This rank's part of the model, laid out over ``mesh`` by the one parallelize path
    (:func:`zerotron.models.parallelize.parallelize_llama`) on the meta device, then materialised on
    ``device`` box by box from its weight source (:func:`weight_source`): the whole model never exists
    on one rank. ``materialized=False`` leaves it on the meta device for ZeRO-3, which materialises only
    its shards."""
    model = parallelize_llama(cfg, mesh)
    if materialized:
        tp = mesh.dims.tp if mesh is not None else 1
        with weight_source(cfg, model) as source:
            materialize(model, source.box, device, ckpt_state.model_placements(model, tp))
    if cfg.lora.rank > 0:  # on the meta device for ZeRO-3: its units take the initial values (fill_from)
        add_adapters(model, cfg)
    return model


def lora_config(cfg: Config) -> LoraConfig:
    """The ``lora.*`` section as the adapters' settings (a comma-joined name list becomes a list)."""
    lo = cfg.lora
    targets: str | list[str] = lo.target_modules
    if lo.target_modules != "all-linear" and re.fullmatch(LORA_NAME_LIST, lo.target_modules):
        targets = lo.target_modules.split(",")
    return LoraConfig(
        rank=lo.rank,
        alpha=lo.alpha,
        dropout=lo.dropout,
        target_modules=targets,
        use_rslora=lo.use_rslora,
        use_dora=lo.use_dora,
        base_bits=lo.base_bits,
        double_quant=lo.double_quant,
    )


def add_adapters(model: nn.Module, cfg: Config) -> list[str]:
    """Freeze ``model`` and put LoRA adapters on it, each initialised from ``train.seed`` and its layer's
    name alone (the same adapters on every rank and layout). On a meta-device model (ZeRO-3) the
    adapters are on the meta device too and ZeRO-3's units take their values from `zerotron.train.fill.fill_from`."""
    return apply_lora(model, lora_config(cfg), seed=cfg.train.seed)


def peak_memory_bytes(device: torch.device) -> int:
    """This rank's peak memory so far: CUDA's max allocated bytes, or on CPU the process's peak RSS.

    On Linux the peak is ``VmHWM`` of /proc/self/status, this process image's own: ``ru_maxrss`` also
    keeps the RSS of the process that spawned it (Linux carries it over fork and exec), so a rank
    started by a large parent (a test runner, a notebook) would report the parent's size."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    from pathlib import Path

    status = Path("/proc/self/status")
    if status.is_file():
        for line in status.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux reports KiB


@contextlib.contextmanager
def return_freed_host_memory() -> Iterator[None]:
    """While the model is materialised, have glibc give freed tensors back to the OS at once.

    By default glibc raises its mmap threshold to the largest block freed so far (up to 32 MiB) and
    serves later tensors below it from heap arenas, which fragment and are not returned: materialising
    a model one global tensor at a time then grows the RSS by a good part of the model (measured: +190
    to +280 MiB for 345 MiB of fp32 weights under ZeRO-3, none of it held). Inside, the threshold is
    1 MiB; on leaving, the heap is trimmed (``malloc_trim``) and the threshold set to 4 MiB for
    training: 1 MiB there (every tensor of 1 MiB or more mapped afresh) cost about 30% more CPU time per
    step on benchmarks/zero.py's model, and 32 MiB (glibc's ceiling) let ZeRO-3's working set fragment
    the heap by 180 MiB in tests/test_memory_scale.py. An explicit ``MALLOC_MMAP_THRESHOLD_`` in the
    environment is left alone; elsewhere than glibc this does nothing.
    """
    import ctypes
    import os
    import sys

    libc: Any = None
    if sys.platform.startswith("linux") and "MALLOC_MMAP_THRESHOLD_" not in os.environ:
        try:
            libc = ctypes.CDLL(None)
            libc.mallopt, libc.malloc_trim  # noqa: B018 - glibc has both (musl has neither)
        except (OSError, AttributeError):
            libc = None
    if libc is not None:
        libc.mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD
    try:
        yield
    finally:
        if libc is not None:
            libc.malloc_trim(0)
            libc.mallopt(-3, 4 << 20)


def peak_flops(device: torch.device) -> float | None:
    """Peak dense bf16 FLOP/s of one device, when known."""
    if device.type != "cuda":
        return None
    return peak_flops_of_device(torch.cuda.get_device_name(device))


class Trainer:
    """One rank's view of a training run."""

    def __init__(
        self,
        cfg: Config,
        mesh: Mesh,
        run_dir: Path,
        tokens: np.ndarray | SupervisedDataset,
        attempt: int = 0,
    ) -> None:
        """``tokens``: the token array of pre-training data (cut into windows here) or the supervised
        rows of ``zerotron sft``."""
        self.cfg, self.mesh, self.run_dir = cfg, mesh, run_dir
        self._init_fault(attempt)
        self.device = (
            torch.device("cuda", torch.cuda.current_device())
            if torch.cuda.is_available()
            else torch.device("cpu")
        )
        torch.manual_seed(cfg.train.seed + mesh.rank // mesh.dims.tp)
        with return_freed_host_memory():
            self.model = build_model(cfg, self.device, mesh, materialized=cfg.parallel.zero < 3)
            self.model.train()
            self.dp_group = mesh.group("dp")
            self.zero, self.buckets, self.optimizer = self._build_engine(cfg)
        self.scaler = DynamicLossScaler(cfg.train.loss_scale_init, cfg.train.loss_scale_window)
        dataset = (
            tokens if isinstance(tokens, SupervisedDataset) else PackedDataset(tokens, cfg.train.seq_len)
        )
        self.loader = DataLoader(
            dataset,
            global_batch=cfg.train.global_batch,
            micro_batch=cfg.train.micro_batch,
            dp_rank=self.dp_group.rank_in_group,
            dp_size=self.dp_group.size,
            seed=cfg.train.seed,
        )
        self.meter = ActivationMeter(self.model, self.buckets.weight_test)
        self.step = 0
        self.resumed_layout: dict[str, Any] | None = None
        self.runner = build_step(self.model, mesh, cfg, self.meter, self.buckets)
        self._place_norm(mesh)
        # The default generator draws adapter dropout from the first step on: seeded again here, past
        # whatever building the layout drew, and alike on the ranks of a tp group (tp is the innermost
        # axis), which see the same activations (zerotron/models/lora_tp.py). A resume restores it.
        torch.manual_seed(cfg.train.seed + mesh.rank // mesh.dims.tp)
        self.flops_per_token = flops_per_token(ModelShape.from_config(cfg.model), cfg.train.seq_len)
        self.ckpt_root = run_dir / "checkpoints"
        # checkpoint.async_save: a thread writes the files; the gathers stay on this thread.
        self.ckpt_writer = (
            CheckpointWriter(mesh.rank, mesh.dims.world_size) if cfg.checkpoint.async_save else None
        )

    def _place_norm(self, mesh: Mesh) -> None:
        """From the placement record: the gradients this rank adds to the global norm (each element
        once), the groups that sum the parts, and the model's parameter count."""
        records = ckpt_state.model_placements(self.model, mesh.dims.tp)
        owned = {name for name, record in records.items() if counts_in_norm(record, mesh.coords)}
        # the optimizer, clipping and unscaling see what the reducer says this rank updates (whole
        # parameters, or ZeRO's shard segments)
        trainable = self.buckets.trainable()
        self.params = [p for _, p in trainable]
        axes = {name: norm_axes(record, self.zero is not None) for name, record in records.items()}
        classes: dict[tuple[str, ...], list[torch.Tensor]] = {a: [] for a in sorted(set(axes.values()))}
        for name, p in trainable:
            if name in owned:
                classes[axes[name]].append(p)
        # each class of parameters summed over its own groups (the same classes on every rank of them)
        # (ZeRO's shards are summed over the group that shards them: a block of dp under hybrid sharding)
        group = self.shard_group if self.zero is not None else mesh.group
        self.norm_classes = [(params, [group(a) for a in key]) for key, params in classes.items()]
        stored = {name: math.prod(record.stored_shape) for name, record in records.items()}
        total = torch.tensor(
            [float(local_numel(records, self.model) + quantized_weight_numel(self.model, stored))]
        )
        collectives.all_reduce(total, mesh.group("pp"), op="sum")  # every stage holds different blocks
        self.n_params = int(total.item())
        self.frozen_bytes: int | None = None  # LoRA: the frozen base this rank holds (whole, NF4, shards)
        if self.cfg.lora.rank > 0:
            shards = dict.fromkeys(self.zero.names, 0) if self.zero is not None else {}
            for seg in (s for segs in self.zero.segments for s in segs) if self.zero is not None else ():
                shards[seg.name] += seg.length * seg.param.element_size()
            self.frozen_bytes = frozen_base_bytes(self.model, shards)
        # MoE: what each token runs (the experts it is not routed to left out)
        self.active_params = self.n_params - inactive_params(ModelShape.from_config(self.cfg.model))

    def _build_engine(
        self, cfg: Config
    ) -> tuple[ShardedEngine | None, GradientReducer, torch.optim.Optimizer]:
        """ZeRO (which replaces the gradient buckets and owns the optimizer's params) or plain data
        parallelism's buckets, each reducing a parameter over the group its placement names, and the
        optimizer over what this rank updates."""
        par = cfg.parallel
        records = ckpt_state.model_placements(self.model, self.mesh.dims.tp)
        mixed = cfg.train.precision in AUTOCAST
        stage, self.shard_group, replicas = zero_sharding(self.mesh, par.zero, mixed)
        groups = grad_groups(records, self.shard_group)
        zero: ShardedEngine | None = None
        if stage > 0:
            with contextlib.ExitStack() as stack:
                fill = None
                if par.zero == 3:  # the model is on the meta device: each unit materialises its range
                    source = stack.enter_context(weight_source(cfg, self.model))
                    fill = fill_from(self.model, source, records, cfg.train.seed, cfg.lora.double_quant)
                    materialize_buffers(self.model, source.box, self.device, records)  # not ZeRO's
                zero = apply_zero(
                    self.model,
                    stage,
                    groups,
                    par.bucket_mb,
                    par.persist_numel,
                    par.reshard_after_forward,
                    par.offload_params,
                    par.nvme_path,
                    fill,
                    self.device,
                    AUTOCAST.get(cfg.train.precision),  # 16-bit working weights, fp32 master shards
                    REDUCE_DTYPE[par.grad_reduce_dtype],
                    replicas,
                    par.offload_optimizer if par.offload_optimizer != "none" else None,
                )
        buckets: GradientReducer = zero or GradientBuckets(
            self.model, groups, par.bucket_mb, REDUCE_DTYPE[par.grad_reduce_dtype]
        )
        optimizer: torch.optim.Optimizer
        if zero is not None and par.offload_optimizer != "none":  # ZeRO-Offload: the step on the host
            optimizer = offload_optimizer(zero, cfg.train, par.offload_optimizer, par.nvme_path)
        else:
            optimizer = adamw(*buckets.param_groups(), cfg.train)
        return zero, buckets, optimizer

    def _init_fault(self, attempt: int) -> None:
        self.attempt = attempt  # 0, or the number of restarts before this one (--max-restarts)
        self.guard = BadStepGuard(self.cfg.fault)
        self.injector = Injector(self.cfg.fault.inject, self.mesh.rank, attempt)
        self.stopped: str | None = None  # the signal that stopped fit() early, agreed by every rank

    # -- one optimizer step ------------------------------------------------------------------------
    def train_step(self, micro: list[tuple[torch.Tensor, ...]] | None = None) -> dict[str, Any]:
        """Run one optimizer step (on the loader's next batches unless ``micro`` is given; its loss is
        then normalised by ``global_batch * seq_len``).

        The loss is the mean over the tokens the loss counts in the whole global batch (labels other
        than -100), on every layout: each rank scales its micro-batches' summed loss by that global
        count, so data-parallel sizes and micro-batch splits give the single process's gradients."""
        cfg = self.cfg.train
        started = time.perf_counter()
        self.injector.before_step(self.step + 1)
        position = self.loader.state_dict()
        counted = cfg.global_batch * cfg.seq_len
        if micro is None:
            micro = self.loader.next_step()
            counted = self.loader.global_tokens
        fp16 = cfg.precision == "fp16"
        scale = self.scaler.scale if fp16 else 1.0
        if self.injector.poisons(self.step + 1):
            scale = float("nan")  # fault.inject nan: this step's gradients are NaN on every rank
        loss_sum = self.runner.forward_backward(micro, scale, self.device, counted)
        if fp16:
            grads = [p.grad for p in self.params if p.grad is not None]
            torch._foreach_mul_(grads, 1.0 / scale)
        norm = sharded_grad_norm(self.norm_classes, self.mesh.group("pp"))
        overflow = not bool(torch.isfinite(norm))
        lr = lr_at(self.step, cfg)
        # the global loss, equal on every rank (context-parallel ranks hold parts of the same rows)
        collectives.all_reduce(
            loss_sum, self.mesh.group("dp_cp" if self.mesh.dims.cp > 1 else "dp"), op="sum"
        )
        bad = None
        if fp16:
            self.scaler.update(overflow)
        if not (overflow and fp16):  # an fp16 overflow is the loss scaler's to handle
            bad = self.guard.check(float(loss_sum) / counted, not overflow)
        if (overflow and fp16) or bad is not None:
            skipped = True
        else:
            skipped = False
            clip_grads_(self.params, norm, cfg.grad_clip)
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            self.optimizer.step()
            self.buckets.after_step()
        activation = self.meter.take_peak()
        states = self.buckets.state_bytes(self.optimizer)
        offloaded = self.buckets.offloaded_bytes(self.optimizer)
        self.buckets.zero_grad()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        record = self._record(loss_sum / counted, norm, lr, started, activation, states, skipped)
        record["loss_tokens"] = counted
        record.update(self.runner.metrics())  # MoE: aux_loss, z_loss, expert_load
        if self.active_params != self.n_params:  # MoE: the parameters each token runs
            record["active_params"] = self.active_params
        if self.frozen_bytes is not None:
            record["frozen_base_bytes"] = self.frozen_bytes
        if offloaded is not None:  # model states off the device (ZeRO offload): {host|nvme: {params, ...}}
            record["offloaded_state_bytes"] = offloaded
        if bad is not None:  # skipped; the data it would have trained on, for the post-mortem
            record.update(bad_step=bad, data_position=position, bad_steps_total=self.guard.total)
        self.guard.check_limit(self.step)
        return record

    def _record(
        self,
        loss: torch.Tensor,
        norm: torch.Tensor,
        lr: float,
        started: float,
        activation: int,
        states: dict[str, Any],
        skipped: bool,
    ) -> dict[str, Any]:
        cfg = self.cfg.train
        tokens = cfg.global_batch * cfg.seq_len
        elapsed = time.perf_counter() - started
        tokens_per_s = tokens / elapsed
        peak = peak_flops(self.device)
        mfu = (
            None if peak is None else self.flops_per_token * tokens_per_s / (peak * self.mesh.dims.world_size)
        )
        record: dict[str, Any] = {
            "step": self.step,
            "loss": float(loss),
            "lr": lr,
            "grad_norm": float(norm),
            "tokens": tokens,
            "n_params": self.n_params,
            "step_time_s": elapsed,
            "tokens_per_s": tokens_per_s,
            "mfu": mfu,
            "comm_bytes": self.mesh.stats.snapshot(),
            "model_state_bytes": states,
            "activation_bytes": activation,
            "peak_memory_bytes": peak_memory_bytes(self.device),
            "layout": self.layout(),
            "rank": self.mesh.rank,
            "restarts": self.attempt,
        }
        self.mesh.stats.reset()
        if cfg.precision == "fp16":
            record.update(skipped=skipped, loss_scale=self.scaler.scale)
        return record

    def layout(self) -> dict[str, int]:
        """The parallel layout as written into metrics and checkpoints."""
        d = self.mesh.dims
        return {"dp": d.dp, "pp": d.pp, "cp": d.cp, "tp": d.tp, "ep": d.ep, "zero": d.zero}

    # -- checkpoints -----------------------------------------------------------------------------------
    def save(self) -> Path:
        """Write a checkpoint of the current step (every rank calls this).

        Under ``checkpoint.async_save`` this returns once the state is copied to host memory; the folder
        is complete after :meth:`wait_for_checkpoint` (which the next save and :meth:`fit` call).
        """
        trainer_state = {
            "step": self.step,
            "scaler": self.scaler.state_dict(),
            "loader": self.loader.state_dict(),
            "layout": {**self.layout(), "world_size": self.mesh.dims.world_size},
            "config": to_dict(self.cfg),
        }
        return ckpt_state.save_checkpoint(
            self.ckpt_root,
            self.step,
            self.model,
            self.optimizer,
            self.mesh,
            trainer_state,
            self.cfg.checkpoint.keep,
            self.zero,
            self.ckpt_writer,
        )

    def _save_checked(self) -> None:
        """Save, then let ``fault.inject`` corrupt the published checkpoint (drills; rank 0)."""
        path = self.save()
        if self.ckpt_writer is None and self.mesh.rank == 0:
            self.injector.after_save(self.step, path)

    def wait_for_checkpoint(self, grace_s: float | None = None) -> None:
        """Block until an asynchronous checkpoint write in flight is on disk (and published, on rank 0)."""
        if self.ckpt_writer is not None:
            self.ckpt_writer.wait(grace_s)

    def resume(self, spec: str, verified: bool = False) -> Path | None:
        """Continue from ``spec``: ``auto`` (newest complete checkpoint of this run, if any) or a path.

        ``verified``: the launcher (or torchrun's rank 0) chose ``spec`` and checked every file's
        sha256, so this rank does not hash them again; otherwise it hashes the files it reads."""
        if spec == "auto":
            ckpt = store.find_latest(self.ckpt_root)
            if ckpt is None:
                return None
        else:
            ckpt = Path(spec)
            if not ckpt.is_dir():
                raise store.CheckpointError(f"--resume {spec}: no such checkpoint folder")
        # Build optimizer state tensors before loading so the restored ones replace them.
        state = ckpt_state.load_checkpoint(ckpt, self.model, self.optimizer, self.mesh, self.zero, verified)
        self.step = int(state["step"])
        if "scaler" in state:  # absent from a converted model (`zerotron convert --to checkpoint`)
            self.scaler.load_state_dict(state["scaler"])
        if "loader" in state:
            self.loader.load_state_dict(state["loader"])
        self.resumed_layout = state.get("layout")
        return ckpt

    # -- the loop ------------------------------------------------------------------------------------------
    def fit(self, on_step: Any = None, keep_open: bool = False) -> list[dict[str, Any]]:
        """Train until ``train.steps``; checkpoint every ``checkpoint.every`` steps and at the end.

        ``keep_open``: leave the engine's offload files in place after a run that ends normally (the
        caller generates the end-of-run sample under the training layout, then calls :meth:`close`)."""
        self._keep_open = keep_open
        cfg = self.cfg
        writer = MetricsWriter(self.run_dir, self.mesh.rank, cfg.log.per_rank_metrics, cfg.log.tensorboard)
        show = self.mesh.rank == 0
        progress = Progress(cfg.train.steps, self.step, cfg.log.progress if show else "none", cfg.log.every)
        history: list[dict[str, Any]] = []
        with StopRequest() as stop:
            return self._fit_loop(cfg, writer, progress, show, history, stop, on_step)

    def _fit_loop(
        self,
        cfg: Config,
        writer: MetricsWriter,
        progress: Progress,
        show: bool,
        history: list[dict[str, Any]],
        stop: StopRequest,
        on_step: Any,
    ) -> list[dict[str, Any]]:
        """The steps, checkpoints and stop checks of :meth:`fit` (signal handlers installed)."""
        try:
            last = cfg.train.steps if cfg.train.exit_step <= 0 else min(cfg.train.steps, cfg.train.exit_step)
            while self.step < last:
                record = self.train_step()
                history.append(record)
                writer.write(record)
                progress.update(record)
                self.mesh.stats.progress(self.step)
                if record.get("bad_step") and show:
                    print(f"step {record['step']}: skipped ({record['bad_step']})", flush=True)
                if record.get("skipped") and show:
                    print(
                        f"step {record['step']}: fp16 gradient overflow, step skipped, "
                        f"loss scale now {record['loss_scale']:g}",
                        flush=True,
                    )
                if on_step is not None:
                    on_step(self, record)
                every = cfg.checkpoint.every
                if every > 0 and self.step % every == 0 and self.step < last:
                    self._save_checked()
                # every rank checks the same steps and stops after the same one
                check = self.step % cfg.fault.signal_check_every == 0
                if check and agree(self.mesh, stop.signal is not None):
                    self.stopped = stop.signal or "a signal on another rank"
                    break
            if not (self.ckpt_root / store.step_dir_name(self.step)).exists():
                self._save_checked()
            self.wait_for_checkpoint()
            if self.stopped and show:
                print(f"stopped by {self.stopped} after step {self.step}, checkpoint written", flush=True)
        except BaseException:
            with contextlib.suppress(Exception):  # the error in flight is the one to report
                self.wait_for_checkpoint(grace_s=30.0)
            self.close()
            raise
        finally:
            progress.close()
            writer.close()
        if not self._keep_open:
            self.close()
        return history

    def close(self) -> None:
        """Release what outlives a step: the NVMe offload files of the ZeRO engine and the optimizer."""
        for owner in (self.zero, self.optimizer):
            close = getattr(owner, "close", None)
            if close is not None:
                close()
