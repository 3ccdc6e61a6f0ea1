"""Combine the memory and time models into one plan of one layout.

:func:`plan_config` takes the same :class:`~zerotron.config.Config` as ``zerotron train``;
:func:`plan_layout` is the fast path the search calls for each candidate. Memory is reported for the
pipeline stage with the largest total (the first stage holds the most in-flight micro-batches and the
embedding, the last the head and the loss).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field, replace
from typing import Any

from zerotron.config import Config
from zerotron.layout import ONEBIT_BLOCK, hybrid_block, onebit_sizes, qgz_node, quantized_wire
from zerotron.plan import activations as act
from zerotron.plan import memory as mem
from zerotron.plan import tensor_parallel, timing
from zerotron.plan.errors import PlanError
from zerotron.plan.hardware import Hardware
from zerotron.plan.layout import (
    ACT_BYTES,
    Layout,
    Workload,
    check,
    from_config,
    micro_batches,
    replicated_masters,
    whole_grads_sent_16bit,
    working_weights16,
)
from zerotron.plan.model import StageParams, param_list, pipeline_layers, stage_params, with_float8
from zerotron.plan.phases import phase_memory
from zerotron.plan.traffic import engine_dp_bytes, onebit_zero_state_bytes
from zerotron.shapes import (
    ModelShape,
    attention_matrix_params,
    flops_per_token,
    mlp_params,
    recompute_flops_per_token,
)


@dataclass
class Plan:
    """Predicted memory (bytes per rank) and time (seconds per step) of one layout."""

    layout: Layout
    hardware: str
    memory: dict[str, float]
    host_bytes: float
    nvme_bytes: float
    stage: int
    time: dict[str, float]
    step_time_s: float
    tokens_per_s: float
    mfu: float
    tflops_per_gpu: float
    fits: bool
    memory_limit: float
    detail: dict[str, Any] = field(default_factory=dict)
    interval: dict[str, Any] | None = None
    """The step time's range from similar validation runs (:mod:`zerotron.plan.interval`), when set."""
    phases: dict[str, float] = field(default_factory=dict)
    """Peak bytes per phase of a run (:mod:`zerotron.plan.phases`), when set."""

    def to_json(self) -> dict[str, Any]:
        """The ``--json`` object: memory_bytes, step_time_s, tokens_per_s, mfu, breakdown."""
        return {
            "memory_bytes": {
                k: self.memory[k] for k in ("params", "grads", "optimizer", "activations", "buffers", "total")
            },
            "step_time_s": self.step_time_s,
            "step_time_range_s": (
                [self.interval["low_s"], self.interval["high_s"]] if self.interval else None
            ),
            "step_time_range_basis": self.interval["basis"] if self.interval else None,
            "tokens_per_s": self.tokens_per_s,
            "mfu": self.mfu,
            "phase_peak_memory_bytes": dict(self.phases),
            "breakdown": {
                "time_s": dict(self.time),
                "memory": dict(self.detail),
                "host_bytes_per_rank": self.host_bytes,
                "nvme_bytes_per_rank": self.nvme_bytes,
                "peak_stage": self.stage,
                "fits": self.fits,
                "device_memory_bytes": self.memory_limit,
                "tflops_per_gpu": self.tflops_per_gpu,
                "layout": self.layout.as_dict(),
                "hardware": self.hardware,
            },
        }


def refuse_compiled(cfg: Config) -> None:
    """The planner models eager blocks: a ``train.compile`` job is refused in one line."""
    if cfg.train.compile:
        raise PlanError(
            "train.compile=true: zerotron plan models eager blocks only (measured on one H100, compiled steps "
            "of a 1B Llama took 0.70x the eager ones: BENCHMARKS.md); plan with train.compile=false"
        )


def plan_config(
    cfg: Config, hw: Hardware, gpus: int, convention: str = "zerotron", flash: bool = True
) -> Plan:
    """Plan the layout ``cfg`` describes on ``gpus`` devices of ``hw`` (raises PlanError if impossible)."""
    refuse_compiled(cfg)
    m, layout, work = from_config(cfg, gpus)
    check(m, layout, work, hw, gpus)
    plan = plan_layout(m, layout, work, hw, convention, flash)
    layers = rank_layers(m, plan.layout, work)[plan.stage]
    io_buffer = cfg.checkpoint.io_buffer_mb * 2**20
    plan.phases = phase_memory(plan, m, work, io_buffer, layers, zero_ranks(plan.layout))
    return plan


def stage_memory(
    m: ModelShape,
    layout: Layout,
    work: Workload,
    convention: str,
    stage: int,
    flash: bool = True,
    dp_rank: int = 0,
) -> tuple[dict[str, float], dict[str, float], float, float]:
    """(memory, activation/buffer detail, host bytes, nvme bytes) of one pipeline stage's rank.

    ``dp_rank`` matters only for the engine's ZeRO shards (a flat buffer's padding and the tensors cut
    at shard boundaries differ by a few bytes between data-parallel ranks).
    """
    layers = rank_layers(m, layout, work)[stage]
    sp = stage_params(m, layout.tp, layout.pp, stage, layers, layout.ep, layout.etp)
    exact = None
    data = zero_ranks(layout)
    dp_rank %= data  # hybrid sharding: the rank's place in its block
    if convention == "zerotron" and layout.zero >= 1 and data > 1 and not m.experts and not m.mla:
        working = 2 if working_weights16(layout, work) else 4
        zero = 2 if whole_grads_sent_16bit(layout, work) else layout.zero  # the gradients' bytes alike
        if layout.zero_one_interval:  # 0/1 Adam's local step holds the whole fp32 gradient (ZeRO-1's)
            zero = 1
        part = (layout.tp, layout.pp, stage, layers)
        skip = layout.fp8_skip if layout.zero_fp8_gather else None  # None: no float8 gathers
        exact = _zero_states(m, part, zero, data, dp_rank, layout.bucket_mb, working, skip)
    states = _model_states(m, layout, work, convention, sp, exact)
    replicated = replicated_masters(layout, work) and data_ranks(layout) > 1
    if layout.onebit_adam and convention == "zerotron" and (exact is not None or replicated):
        # 1-bit Adam in ZeRO's engine (ZeRO-1/2, or 16-bit data parallelism): errors, denominators
        params = param_list(m, layout.tp, layout.pp, stage, layers)
        ranks = data_ranks(layout) if replicated else data
        zero_one = layout.zero_one_interval > 0
        extra = onebit_zero_state_bytes(params, ranks, layout.bucket_mb, replicated, zero_one)
        states["device"]["optimizer"] += float(extra)
    acts, detail = _activations(m, layout, work, convention, stage, sp.layers, flash)
    buffers, buf_detail = _buffers(m, layout, work, convention, stage, sp.elements)
    detail.update(buf_detail)
    detail.update({f"host_{k}": v for k, v in states["host"].items()})  # offloaded to host memory
    dev = states["device"]
    memory = {**dev, "activations": acts, "buffers": buffers}
    memory["total"] = sum(memory.values())
    return memory, detail, sum(states["host"].values()), sum(states["nvme"].values())


def data_ranks(layout: Layout) -> int:
    """Ranks holding the same dense parameters, over which ZeRO shards them and their gradients are
    reduced: dp·cp (context-parallel ranks hold parts of the same rows; Megatron's distributed
    optimizer and the engine shard over both)."""
    return layout.dp * layout.cp


def data_parallel_bytes(
    m: ModelShape, layout: Layout, work: Workload, stage: int = 0
) -> dict[str, dict[str, int]]:
    """The engine's data-parallel bytes of one step on a rank of pipeline ``stage``, by group and op
    (:func:`zerotron.plan.traffic.engine_dp_bytes`; dense models, ZeRO over dp: cp and ep are 1)."""
    if m.experts or m.mla or layout.cp > 1:
        raise PlanError("data_parallel_bytes models dense models without context parallelism or MLA")
    layers = rank_layers(m, layout, work)[stage]
    params = param_list(m, layout.tp, layout.pp, stage, layers)
    if layout.zero_fp8_gather:  # the float8 linears' weights: units of their own, gathered as bytes
        params = with_float8(params, m, layout.fp8_skip)
    return engine_dp_bytes(
        params,
        layout,
        micro_batches(layout, work),
        2 if working_weights16(layout, work) else 4,
        2 if layout.grad_reduce_dtype == "bf16" else 4,
    )


def zero_ranks(layout: Layout) -> int:
    """Ranks ZeRO shards the dense parameters over: :func:`data_ranks`, or one block of them under hybrid
    sharding (``zero_shard_size`` dp ranks with their cp ranks)."""
    return _hybrid_block(layout, "dp_cp") or data_ranks(layout)


def expert_dp(layout: Layout) -> int:
    """Ranks holding the same experts, over which ZeRO shards them and their gradients are reduced:
    dp·cp/ep (expert parallelism folds over the data- and context-parallel ranks, as in Megatron)."""
    return max(1, layout.dp * layout.cp // layout.ep)


def expert_zero_ranks(layout: Layout) -> int:
    """Ranks ZeRO shards the experts over: :func:`expert_dp`, or under hybrid sharding the experts'
    replicas in one block of ``zero_shard_size`` dp ranks with their cp ranks (at least 1: a block smaller
    than an EP group keeps whole expert states), as the engine's mesh cuts them."""
    return _hybrid_block(layout, "edp") or expert_dp(layout)


def _hybrid_block(layout: Layout, axis: str) -> int:
    """:func:`zerotron.layout.hybrid_block` of ``layout`` (0: not hybrid)."""
    return hybrid_block(axis, layout.dp, layout.cp, layout.ep, layout.zero, layout.zero_shard_size)


def _model_states(
    m: ModelShape,
    layout: Layout,
    work: Workload,
    convention: str,
    sp: StageParams,
    exact: dict[str, float] | None = None,
) -> dict[str, dict[str, float]]:
    """Model states of one rank by place; an MoE model's experts are sharded over :func:`expert_dp`."""
    offload = (layout.offload_optimizer, layout.offload_params, layout.offload_grads)
    zero, dense_ranks, expert_ranks = layout.zero, zero_ranks(layout), expert_zero_ranks(layout)
    if convention == "zerotron" and replicated_masters(layout, work):  # ZeRO-1 of one rank per block
        zero, dense_ranks, expert_ranks = 1, 1, 1
    elif convention == "zerotron" and whole_grads_sent_16bit(layout, work):
        zero = 2  # ZeRO-1 holding only the fp32 gradient shard at the step: ZeRO-2's bytes
    dense = mem.StateLayout(dense_ranks, zero, *offload)
    working = 2 if working_weights16(layout, work) else 4
    if not sp.expert_elements:
        states = mem.model_states(sp.elements, sp.tensors, dense, convention, work.precision, exact, working)
        fp32_dp = layout.zero == 0 and not replicated_masters(layout, work)
        if layout.onebit_adam and fp32_dp and convention == "zerotron" and data_ranks(layout) > 1:
            # 1-bit Adam's errors: the worker's over the padded momentum, the server's over its chunk
            padded, _ = onebit_sizes(sp.elements, data_ranks(layout))
            states["device"]["optimizer"] += 4.0 * (padded + padded // data_ranks(layout))
            if layout.zero_one_interval:  # 0/1 Adam: the weights of the last synchronisation
                states["device"]["optimizer"] += 4.0 * sp.elements
        return states
    parts = [
        mem.model_states(
            sp.elements - sp.expert_elements,
            sp.tensors - sp.expert_tensors,
            dense,
            convention,
            work.precision,
            working_bytes=working,
        ),
        mem.model_states(
            sp.expert_elements,
            sp.expert_tensors,
            mem.StateLayout(expert_ranks, zero, *offload),
            convention,
            work.precision,
            working_bytes=working,
        ),
    ]
    return {
        place: {kind: parts[0][place][kind] + parts[1][place][kind] for kind in parts[0][place]}
        for place in parts[0]
    }


@functools.lru_cache(maxsize=4096)
def _zero_states(
    m: ModelShape,
    part: tuple[int, int, int, int],
    zero: int,
    dp: int,
    rank: int,
    bucket_mb: float,
    working_bytes: int = 4,
    float8_skip: tuple[str, ...] | None = None,
) -> dict[str, float]:
    """The engine's ZeRO state bytes of one rank holding ``part`` = (tp, pp, stage, layers): its
    tensor-parallel share of pipeline stage ``stage``'s ``layers`` blocks (cached on small keys: the
    search repeats them); ``float8_skip``: ZeRO-3's float8 gathers with these ``train.fp8_skip``
    patterns (their units are laid out apart)."""
    params = param_list(m, *part)
    if float8_skip is not None:
        params = with_float8(params, m, float8_skip)
    return mem.engine_zero_states(params, zero, dp, rank, bucket_mb, working_bytes=working_bytes)


def rank_layers(m: ModelShape, layout: Layout, work: Workload) -> tuple[int, ...]:
    """Blocks on each pipeline rank, split as the engine splits them (see :func:`pipeline_layers`)."""
    v = layout.virtual_stages if layout.pp_schedule == "interleaved" else 1
    return pipeline_layers(m, work.seq_len, layout.pp, v, layout.pp_layers)


def memory_stages(m: ModelShape, layout: Layout, work: Workload) -> tuple[int, ...]:
    """The pipeline ranks whose memory can peak: the first (most micro-batches in flight, embedding),
    the last (head and loss) and the one with the most blocks."""
    return _peak_candidates(rank_layers(m, layout, work))


@functools.lru_cache(maxsize=1024)
def _peak_candidates(layers: tuple[int, ...]) -> tuple[int, ...]:
    last = len(layers) - 1
    return tuple(sorted({0, last, max(range(len(layers)), key=lambda r: layers[r])}))


def _activations(
    m: ModelShape, layout: Layout, work: Workload, convention: str, stage: int, layers: int, flash: bool
) -> tuple[float, dict[str, float]]:
    tp, sp = layout.tp, layout.sequence_parallel
    rb = act.RankBlock(
        b=layout.micro_batch,
        s=work.seq_len // layout.cp,
        precision=work.precision,
        recompute=layout.recompute,
        tp=tp,
        sp=sp,
        ep=layout.ep,
        etp=layout.etp,
        weights16=working_weights16(layout, work),
        cp=layout.cp,
        cp_comm=layout.cp_comm,
        ulysses=layout.cp_ulysses_size,
    )
    per_layer = _layer_bytes(m, rb, convention, flash)
    if convention == "zerotron":
        per_layer += act.split_bytes(act.context_terms(m, rb), tp, sp)
    every, first, last = _end_bytes(m, rb, convention, layout.pp)
    v = layout.virtual_stages if layout.pp_schedule == "interleaved" else 1
    held = act.inflight(layout.pp_schedule, layout.pp, micro_batches(layout, work), stage, v)
    blocks = (per_layer * layers / v + every) * held.chunks
    ends = first * held.first + last * held.last
    detail = {"activations_per_layer": per_layer, "inflight_chunks": held.chunks, "activations_ends": ends}
    return blocks + ends, detail


@functools.lru_cache(maxsize=4096)
def _layer_bytes(m: ModelShape, rb: act.RankBlock, convention: str, flash: bool) -> float:
    """Activation bytes of one block on one rank (cached: the search asks for the same ones often)."""
    if convention == "zerotron":
        return act.split_bytes(act.engine_layer_terms(m, rb), rb.tp, rb.sp)
    return act.split_bytes(act.megatron_layer_terms(m, rb.b, rb.s, rb.recompute, flash), rb.tp, rb.sp)


@functools.lru_cache(maxsize=4096)
def _end_bytes(m: ModelShape, rb: act.RankBlock, convention: str, pp: int) -> tuple[float, float, float]:
    """Activation bytes outside the blocks: per chunk (RoPE tables), first stage, last stage (cached)."""
    b, s, precision, tp, sp, weights16 = rb.b, rb.s, rb.precision, rb.tp, rb.sp, rb.weights16
    if convention == "zerotron":
        every = act.split_bytes(act.engine_stage_terms(m, b, s, 2 if weights16 else 4), tp, sp)
        first_terms = act.engine_first_stage_terms(m, b, s, tp)
        last_terms = act.engine_last_stage_terms(m, b, s, precision, tp, sp, weights16)
        first = act.split_bytes(first_terms, tp, sp)
        if pp == 1:  # one rank holds both ends: a storage they share is counted once
            last = act.split_bytes(act.unique(first_terms + last_terms), tp, sp) - first
        else:
            last = act.split_bytes(last_terms, tp, sp)
    else:
        every = 0.0
        first = 2.0 * b * s * m.hidden / (tp if sp else 1)  # embedding output (dropout mask ignored)
        last = 4.0 * b * s * m.vocab / tp  # fp32 logits for the loss
    return every, first, last


def _buffers(
    m: ModelShape, layout: Layout, work: Workload, convention: str, stage: int, elements: int
) -> tuple[float, dict[str, float]]:
    pb, gb, _ = mem.state_bytes_per_element(convention, work.precision, layout.zero)
    detail: dict[str, float] = {}
    if data_ranks(layout) > 1 and replicated_masters(layout, work) and convention == "zerotron":
        # 16-bit data parallelism reduces its fp32 accumulators in place, or through 16-bit copies
        if layout.grad_reduce_dtype == "bf16":
            detail["grad_reduce_copies"] = float(elements * 2)
    elif data_ranks(layout) > 1 and layout.zero == 0:
        # The engine's buckets: every bucket's flat copy lives until the step's reduction finishes.
        detail["grad_buckets"] = float(elements * gb)
    elif data_ranks(layout) > 1 and convention == "zerotron" and whole_grads_sent_16bit(layout, work):
        # ZeRO-1's whole bf16 gradients, sent as they are: every bucket's lives until the step lands it
        detail["grad_whole16"] = float(elements * 2)
    elif data_ranks(layout) > 1 and layout.zero in (1, 2):
        # Two reduce-scatter buckets in flight (one filling, one reducing), at most the whole gradient.
        detail["grad_buckets"] = min(2.0 * layout.bucket_mb * 2**20, float(elements * gb))
    if layout.zero == 3:
        # 16-bit working copies under bf16/fp16 (zerotron, Megatron, DeepSpeed); fp32 in fp32 training.
        gather_bytes = 2 if working_weights16(layout, work) else pb
        detail["zero3_gathered_params"] = mem.zero3_gather_bytes(
            m, layout.tp, gather_bytes, layout.ep, layout.zero_fp8_gather
        )
        if layout.zero_hpz_size > 1:  # hpZ: each unit's second copy, held from its forward to its backward
            detail["hpz_secondary"] = float(elements * gather_bytes / layout.zero_hpz_size)
        if not layout.reshard_after_forward:  # every unit stays gathered from its forward to its backward
            detail["zero3_gathered_params"] = max(
                detail["zero3_gathered_params"], float(elements * gather_bytes)
            )
    if stage == layout.pp - 1:
        # Backward of the loss: d(logits) in fp32 and in the compute dtype, one micro-batch.
        tokens = layout.micro_batch * work.seq_len / layout.cp
        detail["logits_grad"] = tokens * m.vocab / layout.tp * (4 + ACT_BYTES[work.precision])
    return sum(detail.values()), detail


def resolve_qgz_node(layout: Layout, gpus_per_node: int) -> Layout:
    """``zero_quantized_gradient_node=0`` (auto) resolved as the trainer resolves it from its launcher's
    ranks per node (:func:`zerotron.layout.qgz_node`), from the hardware's GPUs per node."""
    d = layout.dims
    built = d.zero_shard_size in (0, d.dp) and d.cp == 1 and d.ep == 1
    node = qgz_node(
        layout.zero_quantized_gradient_node, layout.zero_quantized_gradients, d.dp, gpus_per_node,
        d.pp * d.cp * d.tp, built,
    )  # fmt: skip
    return replace(layout, zero_quantized_gradient_node=node)


def plan_layout(
    m: ModelShape,
    layout: Layout,
    work: Workload,
    hw: Hardware,
    convention: str = "zerotron",
    flash: bool = True,
) -> Plan:
    """Memory and time of a checked ``layout`` (see :func:`zerotron.plan.layout.check`).

    ``flash=False`` models attention that materialises the scores (Megatron 2021): their memory (in the
    ``megatron`` convention) and the softmax's memory traffic.
    """
    layout = resolve_qgz_node(layout, hw.gpus_per_node)
    stages = memory_stages(m, layout, work)
    per_stage = [stage_memory(m, layout, work, convention, st, flash) for st in stages]
    worst = max(range(len(stages)), key=lambda i: per_stage[i][0]["total"])
    memory, detail, host, nvme = per_stage[worst]
    hw = hw.per_rank(layout.world)
    times = step_times(m, layout, work, hw, convention, flash)
    step = sum(times.values())
    flops_total = flops_per_token(m, work.seq_len) * work.tokens
    hw_flops = flops_total + recompute_flops_per_token(m, work.seq_len, layout.recompute) * work.tokens
    peak = hw.flops(work.precision) * layout.world
    host_per_node = host * min(hw.gpus_per_node, layout.world)
    fits = memory["total"] <= hw.memory_bytes and host_per_node <= hw.host_memory_bytes
    return Plan(
        layout=layout,
        hardware=hw.name,
        memory=memory,
        host_bytes=host,
        nvme_bytes=nvme,
        stage=stages[worst],
        time=times,
        step_time_s=step,
        tokens_per_s=work.tokens / step,
        mfu=flops_total / step / peak,
        tflops_per_gpu=hw_flops / step / layout.world / 1e12,
        fits=fits,
        memory_limit=hw.memory_bytes,
        detail=detail,
    )


def _wires(layout: Layout, work: Workload, convention: str, pb: int, gb: int) -> tuple[int, float, float]:
    """Bytes an element of the working weights, of ZeRO's gathers and of the gradient reductions take
    on the wire (``pb``/``gb``: the convention's parameter and gradient bytes)."""
    # zerotron: gradients travel in parallel.grad_reduce_dtype; ZeRO's gathers move 16-bit working
    # weights under bf16/fp16
    grad_wire = (
        (2 if layout.grad_reduce_dtype == "bf16" else gb)
        if convention == "zerotron"
        else layout.mixed_grad_bytes or ACT_BYTES[work.precision]
    )
    param_wire = (
        (2 if working_weights16(layout, work) else pb)
        if convention == "zerotron"
        else ACT_BYTES[work.precision]
    )
    # ZeRO++: quantised gathers (ZeRO-3) and gradient reductions send int8/int4 blocks
    gather_wire: float = param_wire
    reduce_wire: float = grad_wire
    if layout.zero_quantized_weights and layout.zero == 3:
        gather_wire = quantized_wire(layout.zero_quantized_weight_block, 8)
    if layout.onebit_adam and layout.zero < 3:  # 1-bit Adam after the warm-up: bits and a scale per block
        reduce_wire = 1 / 8 + 4 / ONEBIT_BLOCK
    if layout.zero_quantized_gradients and layout.zero >= 1:
        reduce_wire = quantized_wire(
            layout.zero_quantized_gradient_block, layout.zero_quantized_gradient_bits
        )
    return param_wire, gather_wire, reduce_wire


def step_times(
    m: ModelShape, layout: Layout, work: Workload, hw: Hardware, convention: str, flash: bool = True
) -> dict[str, float]:
    """Every component of one step's time on the critical path (seconds)."""
    n_mb = micro_batches(layout, work)
    layers = rank_layers(m, layout, work)
    last = layout.pp - 1
    busiest = max(range(layout.pp), key=lambda r: layers[r])
    t_compute, critical = max(
        (timing.microbatch_compute(m, layout, work, hw, layers[r], r == last, flash), r)
        for r in {busiest, last}
    )
    t_tp = tensor_parallel.tensor_parallel_time(m, layout, work, hw, max(layers))
    t_cp = timing.context_parallel_time(m, layout, work, hw, max(layers))
    t_ep = timing.expert_parallel_time(m, layout, work, hw, max(layers))
    t_mb = t_compute + t_tp + t_cp + t_ep
    times = {"compute": n_mb * t_compute, "tp_comm": n_mb * t_tp, "cp_comm": n_mb * t_cp}
    if m.experts:
        times["ep_comm"] = n_mb * t_ep
    times.update(timing.pipeline_times(m, layout, work, hw, t_mb))
    pb, gb, ob = mem.state_bytes_per_element(convention, work.precision, layout.zero)
    param_wire, gather_wire, reduce_wire = _wires(layout, work, convention, pb, gb)
    stages = [
        stage_params(m, layout.tp, layout.pp, r, layers[r], layout.ep, layout.etp)
        for r in sorted({0, critical, layout.pp - 1})
    ]
    sp = max(stages, key=lambda st: st.elements)
    dense = sp.elements - sp.expert_elements
    # cp folded into the data-parallel group: the dp·cp ranks of a (pp, tp) place
    folded = timing.DataGroup.of(layout, data_ranks(layout), layout.tp * layout.pp)
    grads, params = dense * reduce_wire, dense * gather_wire
    secondary = dense * param_wire  # hpZ's second copy, as forward gathered it
    fp8_gathers = layout.zero == 3 and layout.zero_fp8_gather and convention == "zerotron"
    if fp8_gathers:
        # the blocks' float8 weights travel as a byte each (their scales: a few control bytes)
        f8 = float8_gathered(m, layout.tp, sp.layers)
        params, secondary = (dense - f8) * gather_wire + f8, (dense - f8) * param_wire + f8
    layers_ = max(1, sp.layers)
    gathered = (params, secondary) if layout.zero == 3 and layout.zero_hpz_size > 1 else params
    times.update(timing.data_parallel_time(layout, hw, folded, grads, gathered, t_compute, n_mb, layers_))
    shard = -(-dense // zero_ranks(layout)) if layout.zero >= 1 else dense
    if sp.expert_elements:  # the experts' gradients reduce over their own dp·cp/ep replicas
        replicas = timing.DataGroup.of(layout, expert_dp(layout))
        # the routed experts' stacks gathered as float8 too (a byte each, a scale per expert)
        grads, params = (
            sp.expert_elements * reduce_wire,
            sp.expert_elements * (1 if fp8_gathers else gather_wire),
        )
        expert_times = timing.data_parallel_time(
            layout, hw, replicas, grads, params, t_compute, n_mb, layers_
        )
        for key, value in expert_times.items():
            times[key] = times.get(key, 0.0) + value
        shard += (
            -(-sp.expert_elements // expert_zero_ranks(layout)) if layout.zero >= 1 else sp.expert_elements
        )
    states = _model_states(m, replace(layout, offload_optimizer="none", offload_params="none"), work,
                           convention, sp)["device"]  # fmt: skip
    # offloaded working weights cross the link in their working dtype (16 bits under bf16/fp16: cast
    # on the host after the step, and ZeRO-3's offloaded parameters are a 16-bit copy)
    times.update(timing.optimizer_time(layout, hw, shard, sum(states.values()), gb, param_wire, ob, n_mb))
    times["param_offload"] = timing.param_offload_time(layout, hw, shard, param_wire, t_compute, n_mb)
    return times


def float8_gathered(m: ModelShape, tp: int, layers: int) -> int:
    """Elements ZeRO-3 gathers as float8 on one tensor-parallel rank of ``layers`` blocks, of the
    dense parameters: the blocks' projections (the dense MLP's; routed experts' are counted with the
    experts' own gathers; ``train.fp8_skip`` left out of this estimate)."""
    return layers * (attention_matrix_params(m) + (0 if m.experts else mlp_params(m))) // tp
