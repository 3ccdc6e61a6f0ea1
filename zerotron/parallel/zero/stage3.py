"""ZeRO-3 (P_os+g+p): parameters sharded too, gathered module by module just before use.

*apply* part. The model is cut into *units*: every child of every ``nn.ModuleList`` (a transformer
block) and the root module for whatever is left (embedding, final norm, head). Each unit's parameters
are laid end to end in a :class:`~zerotron.parallel.zero.flat.FlatLayout`; a rank keeps only its
``(shard,)`` of it, and the unit's parameters are views of a flat buffer whose storage exists only while
the unit is gathered (the storage is resized to zero when it is freed, so tensors that autograd saved
see the data again once it is re-gathered).

- Forward: a unit is all-gathered by a pre-forward hook, which also starts the all-gather of the next
  unit (prefetch), and freed by a post-forward hook when ``reshard_after_forward`` (the default).
- Backward: a hook on the unit's output gradient re-gathers it (and prefetches the unit that backward
  reaches next); when every parameter of the unit has its gradient, the whole gradients are
  reduce-scattered into the rank's gradient shard and both they and the gathered parameters are freed.
- Small parameters (fewer than ``persist_numel`` elements: norm gains, biases) form one *persistent*
  unit that stays gathered, like ZeRO-2: its gradients are reduce-scattered and it is all-gathered after
  the optimizer step.

Traffic per step with one micro-batch: all-gather forward + all-gather backward + reduce-scatter of
every sharded unit, ``3Ψ(N-1)/N``: 1.5× data parallelism.

*comm* part: all-gathers and reduce-scatters through :mod:`zerotron.distributed.collectives`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import nn

from zerotron.distributed import collectives
from zerotron.distributed.mesh import Group
from zerotron.parallel import float8
from zerotron.parallel.data import grad_or_zeros
from zerotron.parallel.engine import SavedValues
from zerotron.parallel.tensor import attach_grad_sums
from zerotron.parallel.zero.compress import reduce_grads
from zerotron.parallel.zero.flat import (
    FlatLayout,
    Replicas,
    ShardSegment,
    first_replica,
    reduce_replicas,
    segment_grads,
    showing,
)
from zerotron.parallel.zero.grads import GradStash
from zerotron.parallel.zero.offload import ShardStore, StoreRange
from zerotron.parallel.zero.optim_state import (
    gather_optimizer_state,
    load_optimizer_state,
    offloaded_optimizer_bytes,
    optimizer_state_bytes,
)
from zerotron.parallel.zero.options import ZeroOptions
from zerotron.parallel.zero.unit import Fill, Unit, UnitHome
from zerotron.parallel.zero.units import plan_units

_MAX_IN_FLIGHT = 2  # gradient reduce-scatters on their way at once (see ZeroStage3._reduce)


class ZeroStage3:
    """ZeRO-3 over ``group`` for any ``nn.Module`` (see the module docstring).

    Args:
        model: the whole model, already on its device (its parameters move into flat buffers).
        group: the data-parallel group of every parameter, or each parameter's group by name (the
            placement record's :func:`~zerotron.parallel.placement.grad_groups`). A unit is sharded
            over its parameters' group: the parameters of one module must share one (experts live in
            modules of their own), the small persistent ones form one unit per group.
        options: ZeRO's settings. ``persist_numel``: parameters with fewer elements stay whole on every
            rank. ``reshard_after_forward``: free each unit after its forward (re-gathered for
            backward); False keeps the units gathered from forward to backward, trading memory for one
            all-gather. ``offload_params``: ``cpu`` or ``nvme`` keeps every unit's shard (the fp32
            master) in host memory or in a file under ``nvme_path``, copied to the device only for the
            all-gather; the gradient shards land in host memory, and the optimizer must step there
            (:class:`~zerotron.parallel.zero.offload.OffloadAdamW` over :attr:`units`). Under mixed
            precision what lives there is a 16-bit copy of the shard (what the gathers read: half the
            bytes copied and read from files, no cast on the host) and the fp32 master moves to the
            optimizer's side (``offload_optimizer``). ``working_dtype``: the dtype of the gathered
            working weights (DESIGN contract 9: bf16/fp16 under mixed precision, so every all-gather
            moves 16-bit shards; the shards themselves stay the fp32 master weights the optimizer
            updates). ``reduce_dtype``: the dtype gradients are reduce-scattered in
            (``parallel.grad_reduce_dtype``); None: the gradients' own. The reduced shards accumulate in
            fp32 either way.
        fill: for a model built on the meta device, each parameter's values by name (its whole box on
            this rank, from a weight source): every unit materialises only this rank's range, one
            parameter at a time, so the whole model never exists on one rank.
        device: where the units live when ``fill`` materialises them.
        replica: hybrid sharding (``group`` is a block of the dp ranks): the ranks that hold the same
            shards in the other blocks; each step's accumulated gradient shards are all-reduced over it.
    """

    stage = 3

    def __init__(
        self,
        model: nn.Module,
        group: Group | Mapping[str, Group],
        options: ZeroOptions,
        fill: Fill | None = None,
        device: torch.device | str = "cpu",
        replica: Replicas | None = None,
        secondary: Group | None = None,
    ) -> None:
        self.replica = replica  # hybrid sharding: the ranks holding the same shards in other blocks
        self.working_dtype = options.working_dtype or torch.float32
        self.mixed = self.working_dtype != torch.float32
        self.reduce_dtype = options.reduce_dtype
        self.reshard_after_forward = options.reshard_after_forward
        offload_params = self.offload_params = options.offload_params
        group_of = (lambda name: group) if isinstance(group, Group) else group.__getitem__
        # ZeRO-3's float8 gathers: the weights of float8 linears travel as float8 bytes (units of their own)
        float8_specs = float8.float8_weights(model) if options.fp8_gather else {}
        per_root, runs = plan_units(model, group_of, options.persist_numel, float8_specs.keys())
        rank = runs[0][1].rank if runs else 0  # names the offload files (with the process id)
        sizes = [_stored(lay) for _, lay, _ in runs]
        # the offloaded parameters (what the gathers copy to the device: 16-bit under mixed precision)
        # and, under mixed precision, the fp32 master shards beside them
        self.store: ShardStore | None = None
        self.master_store: ShardStore | None = None
        if offload_params != "none":
            nvme = options.nvme_path
            self.store = ShardStore(sizes, "params", offload_params, nvme, rank, self.working_dtype)
            if self.mixed:
                where = options.master_offload or offload_params
                self.master_store = ShardStore(sizes, "master", where, nvme, rank)
        # Parameter offload on a GPU: the shards' host <-> device copies run on this side stream, beside
        # the compute (prefetched weights in, reduced gradients out); pending gradient copies are waited
        # for once, at the end of the step's backward.
        on_gpu = torch.device(device).type == "cuda"
        self.copy_stream: Any = (
            torch.cuda.Stream(torch.device(device)) if self.store is not None and on_gpu else None
        )
        self._host_copies: list[Any] = []  # events of gradient copies to the host still on their way
        self.units: list[Unit] = []
        self._units_of_module: dict[int, list[Unit]] = {}
        home = UnitHome(
            fill,
            device,
            self.working_dtype,
            self.master_store or self.store,  # where the fp32 master lives
            self.store if self.master_store is not None else None,  # its 16-bit host copy
            self.copy_stream,
            options.weight_block if options.quantized_weights else 0,
        )
        self.options = options
        self.secondary = secondary
        self.peak_secondary_bytes = 0  # hpZ: the second copies held at the end of a forward, at most
        for i, (owner, layout, frozen) in enumerate(runs):
            self.units.append(self._unit(i, owner, layout, frozen, home, float8_specs))
        self.order = [u for u in self.units if not u.persistent]  # forward order
        self.backward_order: list[Unit] = []  # per root, last first: the root (its output's grad), the rest
        for units in reversed(per_root):
            of = [self._units_of_module.get(id(m), []) for m in units]
            self.backward_order += of[0] + [u for mine in reversed(of[1:]) for u in mine]
        self._unit_of_param = {id(s.param): u for u in self.units for s in u.layout.slots}
        self._in_backward = False
        self._reader: ThreadPoolExecutor | None = None  # NVMe parameter offload's read-ahead thread
        self._frozen_held: list[Unit] = []  # frozen units gathered for the module backward is in
        self.peak_gathered_bytes = 0  # see _note_gathered
        self._in_flight: list[Unit] = []  # units whose reduce-scatter is on its way (oldest first)
        for module in (m for units in per_root for m in units):
            if id(module) in self._units_of_module:
                module.register_forward_pre_hook(self._pre_forward)
                module.register_forward_hook(self._post_forward)
        for p in (s.param for u in self.units if not u.frozen for s in u.layout.slots):
            p.register_post_accumulate_grad_hook(self._on_grad_ready)
        attach_grad_sums(model)  # a model materialised here: its tensor-parallel gradient sums
        for unit in self.order:
            unit.free()
        self.grad_stash = self._stash(options, rank)

    def _unit(
        self,
        i: int,
        owner: nn.Module | None,
        layout: FlatLayout,
        frozen: bool,
        home: UnitHome,
        float8_specs: dict[int, float8.Float8Spec],
    ) -> Unit:
        """Unit ``i`` (``owner``: its module; None: the persistent unit), gathered as float8 when its
        parameters are float8 weights, with hpZ's block where the unit's group spans it."""
        unit = Unit(layout, owner is None, i, frozen, home)
        if owner is not None and id(layout.slots[0].param) in float8_specs:
            unit.gather_float8([float8_specs[id(s.param)] for s in layout.slots])
        block = self.secondary
        if block is not None and owner is not None and set(block.ranks) < set(layout.group.ranks):
            unit.hpz = block  # a block of the unit's own group (the dense parameters')
        if owner is not None:
            self._units_of_module.setdefault(id(owner), []).append(unit)
        return unit

    def _stash(self, options: ZeroOptions, rank: int) -> GradStash | None:
        """parallel.offload_grads=nvme: the trained units' fp32 gradient shards wait for the optimizer
        step in a file (bucket k: the k-th trained unit, the offloaded optimizer's bucket k), not in
        host memory."""
        if options.offload_grads != "nvme":
            return None
        trained = self._trained
        self._stashed = {id(u): k for k, u in enumerate(trained)}
        sizes = [u.layout.shard for u in trained]
        return GradStash([u.segments for u in trained], sizes, options.nvme_path, rank)

    # -- what the trainer's optimizer sees ---------------------------------------------------------------
    @property
    def segments(self) -> list[list[ShardSegment]]:
        """Each unit's segments (frozen units' too: checkpoints hold their weights)."""
        return [u.segments for u in self.units]

    @property
    def _trained(self) -> list[Unit]:
        return [u for u in self.units if not u.frozen]

    @property
    def params(self) -> list[nn.Parameter]:
        """The segments this rank updates."""
        return [seg.param for u in self._trained for seg in u.segments]

    def trainable(self) -> list[tuple[str, nn.Parameter]]:
        """This rank's shard segments of trained parameters, by the name of the parameter each is part of."""
        return [(seg.name, seg.param) for u in self._trained for seg in u.segments]

    def param_groups(self) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
        """(weight-decayed, not decayed) segments."""
        segs = [seg for u in self._trained for seg in u.segments]
        return [s.param for s in segs if s.decay], [s.param for s in segs if not s.decay]

    # -- hooks -------------------------------------------------------------------------------------------
    def _pre_forward(self, module: nn.Module, args: Any) -> None:
        units = self._units_of_module[id(module)]
        for unit in units:
            unit.wait_gather()
        k = self.order.index(units[-1])
        self._prefetch(self.order, k)
        self._note_gathered()

    def _post_forward(self, module: nn.Module, args: Any, output: Any) -> Any:
        units = self._units_of_module[id(module)]
        if self._in_backward:  # recomputation inside backward: the unit is needed right after
            return output
        outputs = [output] if torch.is_tensor(output) else [t for t in _flatten(output) if torch.is_tensor(t)]
        if torch.is_grad_enabled():
            for t in outputs:
                if t.requires_grad:
                    t.register_hook(lambda g, units=units: self._pre_backward(units))
        if self.reshard_after_forward or not torch.is_grad_enabled():
            for unit in units:
                if torch.is_grad_enabled():
                    unit.keep_secondary()  # hpZ: backward gathers it inside the block
                unit.free()
            held = sum(u.secondary.numel() * u.secondary.element_size() for u in self.units if u.secondary is not None)  # fmt: skip
            self.peak_secondary_bytes = max(self.peak_secondary_bytes, held)
        return output

    def _pre_backward(self, units: list[Unit]) -> None:
        if not self._in_backward:
            self._in_backward = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)
        # backward has left the module whose frozen units are held: its input gradient is this output's
        self._free_frozen(keep=units)
        for unit in units:
            unit.wait_gather()
            if unit.frozen:
                self._frozen_held.append(unit)
        k = self.backward_order.index(units[-1])
        self._prefetch(self.backward_order, k)  # what backward reaches next
        self._note_gathered()

    def _prefetch(self, order: list[Unit], k: int) -> None:
        """After unit ``k`` of ``order``: start gathering the next unit, and under NVMe parameter offload
        start reading the one after it from its file (the read overlaps two units' compute)."""
        if k + 1 < len(order):
            order[k + 1].start_gather()
        if k + 2 < len(order) and self.store is not None and not self.store.resident:
            if self._reader is None:
                self._reader = ThreadPoolExecutor(1, thread_name_prefix="zerotron-nvme-params")
            order[k + 2].start_read(self._reader)

    def _free_frozen(self, keep: Sequence[Unit] = ()) -> None:
        """Free the frozen units held for backward, but those of ``keep``."""
        for unit in self._frozen_held:
            if unit not in keep:
                unit.free()
        self._frozen_held = [u for u in self._frozen_held if u in keep]

    def _note_gathered(self) -> None:
        """Track the peak bytes of gathered (or arriving) parameter buffers: ZeRO-3's working set."""
        held = sum(u.nbytes for u in self.units if u.gathered or u.gathering is not None)
        self.peak_gathered_bytes = max(self.peak_gathered_bytes, held)

    def _end_backward(self) -> None:
        self._in_backward = False
        self._free_frozen()
        for unit in self.units:  # hpZ: a copy backward did not use must never serve a later forward
            unit.secondary = None

    def _on_grad_ready(self, param: torch.Tensor) -> None:
        unit = self._unit_of_param[id(param)]
        unit.ready += 1
        if unit.ready == len(unit.layout.slots):
            self._reduce(unit)

    def _reduce(self, unit: Unit) -> None:
        layout = unit.layout
        grads = [grad_or_zeros(s.param) for s in layout.slots]
        flat_grad = layout.flatten(grads, self.reduce_dtype)  # (padded,) in the reduction's dtype
        for slot in layout.slots:
            slot.param.grad = None
        self._land(unit)  # an earlier micro-batch's reduction lands first
        out = torch.empty(layout.shard, dtype=flat_grad.dtype, device=flat_grad.device)
        work = reduce_grads(out, flat_grad, layout.group, self.options)
        unit.pending.append((work, out))  # flat_grad is this call's own buffer: the reduction may use it
        unit.ready, unit.reduced = 0, True
        unit.free()
        # At most two reductions in flight (FSDP2 waits on the previous one too): each holds its unit's
        # whole flat gradient until it lands, so more would grow with the model, not the unit.
        self._in_flight.append(unit)
        while len(self._in_flight) > _MAX_IN_FLIGHT:
            self._land(self._in_flight[0])

    def _land(self, unit: Unit) -> None:
        if unit in self._in_flight:
            self._in_flight.remove(unit)
        for work, out in unit.pending:
            work.wait()
            if self.store is not None and out.device.type != "cpu":  # the optimizer steps on the host
                out = self._to_host(out)
            if self.grad_stash is not None:
                self._wait_host_copies()
                self.grad_stash.add(
                    self._stashed[id(unit)], out if out.dtype == torch.float32 else out.float()
                )
            elif unit.grad_shard is None:
                unit.grad_shard = out if out.dtype == torch.float32 else out.float()  # fp32 accumulation
            else:
                self._wait_host_copies()  # accumulation on the host reads the copies
                unit.grad_shard.add_(out)
        unit.pending = []
        if unit.grad_shard is not None:
            segment_grads(unit.segments, unit.grad_shard)

    def _to_host(self, out: torch.Tensor) -> torch.Tensor:
        """A reduced gradient shard into pinned host memory, as fp32: on a GPU a copy on the side stream
        that the compute does not wait for (:meth:`_wait_host_copies` waits before the host reads it)."""
        host = torch.empty(out.shape, dtype=torch.float32, pin_memory=out.is_cuda)
        side = self.copy_stream
        if side is None:
            return host.copy_(out)
        src = out.float()  # on the compute stream, after the reduction it waited for
        side.wait_stream(torch.cuda.current_stream(src.device))
        with torch.cuda.stream(side):
            host.copy_(src, non_blocking=True)
        src.record_stream(side)  # its memory is not reused by the compute before the copy has read it
        done = torch.cuda.Event()
        done.record(side)
        self._host_copies.append(done)
        return host

    def _wait_host_copies(self) -> None:
        for done in self._host_copies:
            done.synchronize()
        self._host_copies = []

    def reduced_grad(self, param: torch.Tensor) -> torch.Tensor | None:
        """After :meth:`finish`: this rank's reduced gradient shard of ``param``, which must be alone in
        its unit (a tied copy); None when it is not."""
        unit = self._unit_of_param.get(id(param))
        return unit.grad_shard if unit is not None and len(unit.layout.slots) == 1 else None

    # -- step boundaries ---------------------------------------------------------------------------------
    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Gradients are reduce-scattered on every micro-batch; nothing to defer."""
        yield

    @contextlib.contextmanager
    def hold(self) -> Iterator[None]:
        """Under a pipeline step too, each micro-batch's gradients are reduce-scattered as they are
        ready: ZeRO-3 keeps no whole gradient."""
        yield

    def finish(self) -> None:
        """After the last backward of a step: reduce what has not been, land every shard gradient."""
        for unit in self._trained:
            if unit.ready or not unit.reduced:
                self._reduce(unit)
        for unit in self.units:
            self._land(unit)
            unit.reduced = False
            if unit.gathering is not None:  # a prefetch on its way would land pre-step weights later
                unit.wait_gather()
            unit.free()
        self._wait_host_copies()  # the host optimizer, the norm and the replicas' sums read them
        shards = [(u.grad_shard, u.layout.group) for u in self._trained if u.grad_shard is not None]
        reduce_replicas(
            shards, self.replica, self.reduce_dtype, self.units[0].flat.device if self.units else None
        )
        self._in_backward = False

    def after_step(self) -> None:
        """The persistent unit is gathered again from its updated shard (never quantised: its small
        parameters, norm gains above all, cost little to send and much to round); sharded units wait
        for use."""
        for unit in self.units:
            if unit.persistent:
                collectives.all_gather(unit.flat, unit.working_shard(), unit.layout.group)

    def zero_grad(self) -> None:
        """Drop every gradient."""
        if self.grad_stash is not None:
            self.grad_stash.clear()
        for unit in self.units:
            unit.grad_shard = None
            for seg in unit.segments:
                seg.param.grad = None
            for s in unit.layout.slots:
                s.param.grad = None

    @property
    def weight_test(self) -> Callable[[torch.Tensor], bool] | None:
        """:meth:`holds_weights`: the gathered buffers hold weights, not activations."""
        return self.holds_weights

    def holds_weights(self, t: torch.Tensor) -> bool:
        """Whether ``t`` lives in one of the gathered buffers (a weight view autograd saves, not an activation)."""
        ptr = t.untyped_storage().data_ptr()
        return ptr != 0 and any(u.buffer.untyped_storage().data_ptr() == ptr for u in self.units)

    @contextlib.contextmanager
    def full_params(self, trained_only: bool = False) -> Iterator[None]:
        """Gather every unit (``trained_only``: those of trained parameters) for the duration of the
        block (collective), then free them again. Under mixed precision the parameters show the fp32
        master weights (gathered apart from the 16-bit working buffers) for the block's duration."""
        if self.mixed:
            with self._full_masters(trained_only):
                yield
            return
        for unit in self.order:
            if not (trained_only and unit.frozen):
                unit.wait_gather()
        try:
            yield
        finally:
            for unit in self.units:
                unit.free()

    def _full_masters(self, trained_only: bool) -> AbstractContextManager[None]:
        units = [u for u in self.units if not (trained_only and u.frozen)]
        return showing((u.layout, u.gather_master()) for u in units)

    # -- accounting and checkpoints ----------------------------------------------------------------------
    @property
    def layouts(self) -> list[FlatLayout]:
        """Each unit's layout."""
        return [u.layout for u in self.units]

    def state_bytes(self, optimizer: torch.optim.Optimizer) -> dict[str, int]:
        """On the device: shards (+ the persistent unit whole, + any unit gathered now), shard gradients,
        AdamW states. Under parameter offload the shards and their gradients are not on the device.
        Under mixed precision the params are the fp32 master shards (which the ZeRO paper's K counts
        as optimizer state) plus the 16-bit working buffers gathered now."""
        opt = optimizer_state_bytes(optimizer)
        params = sum(u.nbytes for u in self.units if u.gathered)
        if self.store is not None:
            return {"params": params, "grads": 0, "optimizer": opt}
        params += sum(u.shard.numel() * u.shard.element_size() for u in self.units)
        return {"params": params, "grads": self._grad_bytes(), "optimizer": opt}

    def offloaded_bytes(self, optimizer: torch.optim.Optimizer) -> dict[str, dict[str, int]]:
        """Model states off the device: ``{host|nvme: {params, grads, optimizer}}``."""
        out = offloaded_optimizer_bytes(optimizer)
        if self.store is not None:
            out["host"]["params"] += self.store.host_bytes()
            out["nvme"]["params"] += self.store.nvme_bytes()
            out["host"]["grads"] += self._grad_bytes()
            out["nvme"]["grads"] += self.grad_stash.nvme_bytes() if self.grad_stash is not None else 0
        if self.master_store is not None:  # the fp32 master: optimizer state (the ZeRO paper's K)
            out["host"]["optimizer"] += self.master_store.host_bytes()
            out["nvme"]["optimizer"] += self.master_store.nvme_bytes()
        return out

    def _grad_bytes(self) -> int:
        return sum(
            u.grad_shard.numel() * u.grad_shard.element_size() for u in self.units if u.grad_shard is not None
        )

    def close(self) -> None:
        """Remove the parameter files of NVMe offload (after any read in flight)."""
        if self._reader is not None:
            self._reader.shutdown(wait=True)
            self._reader = None
        for store in (self.store, self.master_store, self.grad_stash):
            if store is not None:
                store.close()

    def optimizer_tensors(self, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
        """Whole AdamW tensors by parameter name (collective over dp)."""
        trained = self._trained
        return gather_optimizer_state([u.layout for u in trained], [u.segments for u in trained], optimizer)

    @property
    def names(self) -> set[str]:
        """The parameters this engine shards (by name)."""
        return {slot.name for unit in self.units for slot in unit.layout.slots}

    def load_shards(self, saved: SavedValues) -> None:
        """Give every unit's shard its ranges of the saved weights, with no gather; the persistent unit is
        re-gathered after (collective over dp). A checkpoint load: each segment's range is read and
        written ``saved.window`` elements at a time (``checkpoint.io_buffer_mb``), straight to wherever
        the shard lives (device, host memory or the NVMe file): no rank holds more than a window of it."""
        for unit in self.units:
            if unit.derived:  # a QLoRA base's NF4 bytes: made from the weight source, not saved
                continue
            for seg in unit.segments:
                for lo in range(0, seg.length, saved.window):
                    n = min(saved.window, seg.length - lo)
                    unit.write_range(saved.part(seg.name, seg.start + lo, n), seg.at + lo)
        self.after_step()

    def segment_values(
        self, written: bool = False
    ) -> Iterator[tuple[ShardSegment, Callable[[], torch.Tensor]]]:
        """Each segment this rank owns with a reader of its master weights ``(length,)``, called when the
        values are wanted: it reads the segment's range alone from wherever the shard lives (device, host
        memory or NVMe file), so a checkpoint written segment by segment holds one segment in memory at
        a time; no communication. ``written``: only those it writes to a checkpoint (under hybrid
        sharding, the first block's)."""
        for unit in self.units:
            if written and (unit.derived or not first_replica(unit.layout.group, self.replica)):
                continue
            for seg in unit.segments:
                yield seg, _segment_reader(unit, seg)

    def load_optimizer_tensors(
        self, optimizer: torch.optim.Optimizer, tensors: Mapping[str, torch.Tensor]
    ) -> None:
        """Each segment takes its part of whole AdamW tensors by name."""
        load_optimizer_state([seg for u in self._trained for seg in u.segments], optimizer, tensors)


def _stored(layout: FlatLayout) -> int:
    """Elements of a unit's shard in a parameter offload store (frozen bytes stay on the device)."""
    return layout.shard if layout.slots[0].param.is_floating_point() else 0


def _flatten(obj: Any) -> list[Any]:
    if isinstance(obj, (list, tuple)):
        return [x for item in obj for x in _flatten(item)]
    if isinstance(obj, dict):
        return [x for item in obj.values() for x in _flatten(item)]
    return [obj]


def _segment_reader(unit: Any, seg: ShardSegment) -> Callable[[], torch.Tensor]:
    """A reader of ``seg``'s master values: its range of the offloaded master (read alone from host
    memory or the NVMe file), or a copy of its range of the device shard."""
    if unit.store is not None:
        return StoreRange(unit.store, unit.index, seg.at, seg.length)
    return lambda: unit.shard[seg.at : seg.at + seg.length].detach().clone()
