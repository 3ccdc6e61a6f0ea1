"""The training loop of one rank: micro-batches, gradient accumulation, data-parallel reduction,
precision, clipping, the optimizer step, metrics and checkpoints.

The model and its data-parallel engine (ZeRO, or gradient buckets) come from the one model builder
(:func:`zerotron.build.builder.build`), which applies parallelism in DESIGN.md's order; the trainer
composes the parts below the loop (:mod:`zerotron.components`: data, optimizer and schedule, loss,
metrics, checkpoint state).
"""

from __future__ import annotations

import contextlib
import math
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from zerotron.build.builder import build
from zerotron.checkpoint import store
from zerotron.checkpoint.async_save import CheckpointWriter
from zerotron.components import state as ckpt_state
from zerotron.components.data import DataLoader, PackedDataset, SupervisedDataset
from zerotron.components.metrics import (
    ActivationMeter,
    MemoryPhases,
    MetricsWriter,
    Progress,
    peak_flops,
    peak_memory_bytes,
    return_freed_host_memory,
)
from zerotron.components.optim import (
    DynamicLossScaler,
    clip_grads_,
    lr_at,
    optimizer_for,
    sharded_grad_norm,
)
from zerotron.components.preference_data import PreferenceDataset
from zerotron.components.prompt_data import PromptSet
from zerotron.config import Config
from zerotron.config_load import to_dict
from zerotron.distributed import collectives
from zerotron.distributed.mesh import Mesh
from zerotron.models.nf4_tp import frozen_base_bytes, quantized_weight_numel
from zerotron.parallel.placement import counts_in_norm, local_numel, norm_axes
from zerotron.plan.model import inactive_params
from zerotron.shapes import ModelShape, flops_per_token
from zerotron.train.fault import BadStepGuard, Injector, StopRequest, agree
from zerotron.train.step import build_step


class Trainer:
    """One rank's view of a training run."""

    def __init__(
        self,
        cfg: Config,
        mesh: Mesh,
        run_dir: Path,
        tokens: np.ndarray | SupervisedDataset | PreferenceDataset | PromptSet,
        attempt: int = 0,
    ) -> None:
        """``tokens``: the token array of pre-training data (cut into windows here), the supervised
        rows of ``zerotron sft``, the preference pairs of ``zerotron dpo`` or the prompts of ``zerotron grpo``."""
        self.cfg, self.mesh, self.run_dir = cfg, mesh, run_dir
        self._init_fault(attempt)
        self.device = (
            torch.device("cuda", torch.cuda.current_device())
            if torch.cuda.is_available()
            else torch.device("cpu")
        )
        torch.manual_seed(cfg.train.seed + mesh.rank // mesh.dims.tp)
        self.memory = MemoryPhases(self.device)  # peak memory per phase: materialise, steps, save, sample
        self.memory.begin()
        nvme = "nvme" in (cfg.parallel.offload_params, cfg.parallel.offload_optimizer)
        with return_freed_host_memory(nvme):
            built = build(cfg, self.device, mesh, train=True)
            assert built.data_parallel is not None
            self.model, dp = built.model, built.data_parallel
            self.model.train()
            self.dp_group = mesh.group("dp")
            self.zero, self.buckets, self.shard_group = dp.zero, dp.reducer, dp.shard_group
            self.optimizer = optimizer_for(self.buckets, self.zero, cfg)
        self.scaler = DynamicLossScaler(cfg.train.loss_scale_init, cfg.train.loss_scale_window)
        dataset = tokens if not isinstance(tokens, np.ndarray) else PackedDataset(tokens, cfg.train.seq_len)
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
        self.io_buffer_bytes = max(1, int(cfg.checkpoint.io_buffer_mb * 2**20))  # offloaded ranges per I/O
        # checkpoint.async_save: a thread writes the files; the gathers stay on this thread.
        self.ckpt_writer = (
            CheckpointWriter(mesh.rank, mesh.dims.world_size, self.io_buffer_bytes)
            if cfg.checkpoint.async_save
            else None
        )
        self.memory.end("materialise")

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

    def _init_fault(self, attempt: int) -> None:
        self.attempt = attempt  # 0, or the number of restarts before this one (--max-restarts)
        self.guard = BadStepGuard(self.cfg.fault)
        self.injector = Injector(self.cfg.fault.inject, self.mesh.rank, attempt)
        self.stopped: str | None = None  # the signal that stopped fit() early, agreed by every rank

    # -- one optimizer step ------------------------------------------------------------------------
    def train_step(
        self, micro: list[tuple[torch.Tensor, ...]] | None = None, counted: int | None = None
    ) -> dict[str, Any]:
        """Run one optimizer step (on the loader's next batches unless ``micro`` is given; its loss is
        then normalised by ``counted``, by default ``global_batch * seq_len``).

        The loss is the mean over the tokens the loss counts in the whole global batch (labels other
        than -100), on every layout: each rank scales its micro-batches' summed loss by that global
        count, so data-parallel sizes and micro-batch splits give the single process's gradients."""
        cfg = self.cfg.train
        started = time.perf_counter()
        self.injector.before_step(self.step + 1)
        position = self.loader.state_dict()
        counted = counted or cfg.global_batch * cfg.seq_len
        if micro is None:
            micro = self.loader.next_step()
            counted = self.loader.global_tokens
        fp16 = cfg.precision == "fp16"
        scale = self.scaler.scale if fp16 else 1.0
        if self.injector.poisons(self.step + 1):
            scale = float("nan")  # fault.inject nan: this step's gradients are NaN on every rank
        loss_sum = self.runner.forward_backward(micro, scale, self.device, counted)
        stash = self.zero.grad_stash if self.zero is not None else None  # gradient shards on NVMe
        if fp16:
            grads = [p.grad for p in self.params if p.grad is not None]
            if grads:
                torch._foreach_mul_(grads, 1.0 / scale)
            if stash is not None:
                stash.scale(1.0 / scale)
        norm = sharded_grad_norm(
            self.norm_classes, self.mesh.group("pp"), stash.norms() if stash is not None else None
        )
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
            coef = clip_grads_(self.params, norm, cfg.grad_clip)
            if stash is not None and coef is not None:
                stash.scale(coef)
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
        # a preference pair is two rows
        tokens = cfg.global_batch * cfg.seq_len * getattr(self.loader.dataset, "rows_per_sample", 1)
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
        return self.mesh.dims.as_layout()

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
            self._held(),
            trainer_state,
            self.cfg.checkpoint.keep,
            self.ckpt_writer,
            self.io_buffer_bytes,
        )

    def _held(self) -> ckpt_state.RankState:
        return ckpt_state.RankState(self.model, self.optimizer, self.mesh, self.zero)

    def _save_checked(self) -> None:
        """Save, then let ``fault.inject`` corrupt the published checkpoint (drills; rank 0)."""
        with self.memory.phase("save"):
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
        with self.memory.phase("load"):
            state = ckpt_state.load_checkpoint(ckpt, self._held(), verified, self.io_buffer_bytes)
        self.step = int(state["step"])
        if "scaler" in state:  # absent from a converted model (`zerotron convert --to checkpoint`)
            self.scaler.load_state_dict(state["scaler"])
        if "loader" in state:
            self.loader.load_state_dict(state["loader"])
        self.resumed_layout = state.get("layout")
        return ckpt

    # -- the loop ------------------------------------------------------------------------------------------
    def fit(self, on_step: Any = None, keep_open: bool = False, step_fn: Any = None) -> list[dict[str, Any]]:
        """Train until ``train.steps``; checkpoint every ``checkpoint.every`` steps and at the end.
        ``step_fn``: what runs a step and returns its record, in place of :meth:`train_step` (an
        application's step around it: ``zerotron grpo``'s rollouts, rewards, then ``train_step``).

        ``keep_open``: leave the engine's offload files in place after a run that ends normally (the
        caller generates the end-of-run sample under the training layout, then calls :meth:`close`)."""
        self._keep_open = keep_open
        cfg = self.cfg
        writer = MetricsWriter(self.run_dir, self.mesh.rank, cfg.log.per_rank_metrics, cfg.log.tensorboard)
        show = self.mesh.rank == 0
        progress = Progress(cfg.train.steps, self.step, cfg.log.progress if show else "none", cfg.log.every)
        history: list[dict[str, Any]] = []
        self._step_fn = step_fn or self.train_step
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
                with self.memory.phase("steps"):
                    record = self._step_fn()
                record["phase_peak_memory_bytes"] = dict(self.memory.peaks)
                record["peak_memory_bytes"] = peak_memory_bytes(self.device)  # the step's end included
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
