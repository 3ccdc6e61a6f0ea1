"""A parallel layout and its workload, read from a :class:`~zerotron.config.Config`, and checked.

Every check raises :class:`~zerotron.plan.errors.PlanError` with one line that says what to change.
The degrees and rank grid are the engine's (:class:`zerotron.layout.ParallelDims`): ``(dp, pp, cp, tp)`` with tp
innermost, so a tp group is ``tp`` consecutive ranks and must fit in one node.
"""

from __future__ import annotations

from dataclasses import dataclass

from zerotron import layout as shared
from zerotron.config import Config, ModelConfig
from zerotron.layout import ParallelDims
from zerotron.plan.errors import PlanError
from zerotron.plan.hardware import Hardware
from zerotron.shapes import ModelShape

RECOMPUTE = ("none", "selective", "full")
PRECISIONS = ("fp32", "bf16", "fp16", "fp8")


@dataclass(frozen=True)
class Layout(shared.HoldsDims):
    """The parallel degrees (:class:`zerotron.layout.ParallelDims`, the engine's own type) and the
    per-rank choices that change memory and time."""

    dims: ParallelDims
    cp_comm: str = "ring"  # ring, ulysses, allgather or hybrid (ulysses in groups of cp_ulysses_size)
    cp_ulysses_size: int = 1
    etp: int = 1  # expert tensor parallelism: 1 (experts whole on every tp rank) or tp (split over it)
    micro_batch: int = 1
    recompute: str = "none"
    sequence_parallel: bool = False
    tp_comm_overlap: bool = False
    # ZeRO-1/2: the updated shards gathered under the next step's first forward (Megatron-Core)
    overlap_param_gather: bool = False
    pp_schedule: str = "1f1b"
    virtual_stages: int = 1
    offload_optimizer: str = "none"
    offload_params: str = "none"
    offload_grads: str = "none"  # ZeRO-3 under parameter offload: where the fp32 gradient shards wait
    bucket_mb: float = 25.0
    pp_layers: tuple[int, ...] | None = None
    grad_reduce_dtype: str = "fp32"  # what gradients travel in over the data-parallel group (fp32, bf16)
    # the mixed convention's gradient bytes on that wire: 0 the working dtype's (DeepSpeed, Megatron under
    # fp16), 4 for Megatron under bf16 (its fp32 gradient buffer is what it reduces)
    mixed_grad_bytes: int = 0
    reshard_after_forward: bool = (
        True  # ZeRO-3: free each unit after its forward (gathered again in backward)
    )
    zero_quantized_weights: bool = False  # ZeRO-3's gathers send block int8 weights (qwZ)
    zero_quantized_gradients: bool = False  # gradient reduce-scatters send block-quantised values (qgZ)
    zero_quantized_gradient_bits: int = 8
    zero_quantized_weight_block: int = 2048
    zero_quantized_gradient_block: int = 128
    zero_quantized_gradient_node: int = 1  # qgZ: ranks per node of its two-level reduction (1: one level)
    zero_hpz_size: int = 1  # ZeRO-3 (hpZ): backward gathers inside blocks of this many dp ranks
    zero_fp8_gather: bool = False  # ZeRO-3 under fp8: float8 linears' weights gathered as float8 bytes
    fp8_skip: tuple[str, ...] = ()  # train.fp8_skip: block linears kept in bf16
    onebit_adam: bool = False  # 1-bit Adam (data parallelism): momenta sent as bits, after the warm-up
    # 0/1 Adam (with onebit_adam): its long-run synchronisation interval (local_step_clipper); 0: not it
    zero_one_interval: int = 0
    kernels: str = "fused"  # element-wise kernels: "fused" (Megatron, TE) or "eager" (one per operation)
    pp_scatter_gather: bool = True  # each tp rank sends 1/tp of a stage's output (Megatron), or all of it

    def as_dict(self) -> dict[str, object]:
        """The layout as plain data: the degrees and the choices."""
        d = self.dims
        choices = {k: v for k, v in self.__dict__.items() if k != "dims"}
        degrees = {"dp": d.dp, "tp": d.tp, "pp": d.pp, "cp": d.cp, "ep": d.ep, "zero": d.zero}
        return {**degrees, **choices, "zero_shard_size": d.zero_shard_size}

    def short(self) -> str:
        """A compact one-line description (search tables)."""
        extra = " sp" if self.sequence_parallel and self.tp > 1 else ""
        extra += " tpo" if self.tp_comm_overlap and self.tp > 1 else ""
        extra += " opg" if self.overlap_param_gather and self.zero in (1, 2) and self.dp > 1 else ""
        if self.pp > 1:
            extra += f" {self.pp_schedule}" + (f"x{self.virtual_stages}" if self.virtual_stages > 1 else "")
        if self.offload_optimizer != "none" or self.offload_params != "none":
            extra += f" off={self.offload_optimizer}/{self.offload_params}"
            extra += "/grads=nvme" if self.offload_grads == "nvme" else ""
        ep = f" ep{self.ep}" if self.ep > 1 else ""
        ep += f" etp{self.etp}" if self.etp > 1 else ""
        if self.cp > 1 and self.cp_comm != "ring":
            extra += f" cp={self.cp_comm}" + (f"{self.cp_ulysses_size}" if self.cp_comm == "hybrid" else "")
        return (
            f"dp{self.dp} tp{self.tp} pp{self.pp} cp{self.cp}{ep} z{self.zero} mb{self.micro_batch} "
            f"rc={self.recompute}{extra}"
        )


# bytes of one activation element by train.precision (fp8 counted at its 16-bit working dtype)
ACT_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 2}


@dataclass(frozen=True)
class Workload:
    """What one optimizer step computes."""

    seq_len: int
    global_batch: int
    precision: str = "bf16"

    @property
    def tokens(self) -> int:
        """Tokens per optimizer step (all data-parallel ranks)."""
        return self.seq_len * self.global_batch


def from_config(cfg: Config, gpus: int) -> tuple[ModelShape, Layout, Workload]:
    """The planner's view of ``cfg`` on ``gpus`` ranks (``parallel.dp=-1`` resolved)."""
    if gpus < 1:
        raise PlanError(f"--gpus {gpus}: give the number of devices, at least 1")
    p, t = cfg.parallel, cfg.train
    # a preference pair (zerotron dpo) is two rows of at most train.seq_len: planned at their bound
    rows = 2 if cfg.data.format == "preference" else 1
    try:
        dp = shared.resolve_dp(p.dp, p.pp, p.cp, p.tp, gpus)
        dims = shared.ParallelDims.of(dp, p.tp, p.pp, p.cp, p.ep, p.zero, p.zero_shard_size)
    except shared.LayoutError as e:
        raise PlanError(str(e).replace("the world size", "--gpus")) from None
    layout = Layout(
        dims=dims,
        cp_comm=p.cp_comm,
        cp_ulysses_size=p.cp_ulysses_size,
        etp=p.etp,
        micro_batch=t.micro_batch * rows,
        recompute=t.recompute,
        sequence_parallel=p.sequence_parallel,
        tp_comm_overlap=p.tp_comm_overlap,
        overlap_param_gather=p.overlap_param_gather,
        pp_schedule=p.pp_schedule,
        virtual_stages=p.virtual_stages,
        offload_optimizer=p.offload_optimizer,
        offload_params=p.offload_params,
        offload_grads=p.offload_grads,
        bucket_mb=p.bucket_mb,
        pp_layers=tuple(int(n) for n in getattr(p, "pp_layers", None) or ()) or None,
        grad_reduce_dtype=p.grad_reduce_dtype,
        reshard_after_forward=p.reshard_after_forward,
        zero_quantized_weights=p.zero_quantized_weights,
        zero_quantized_gradients=p.zero_quantized_gradients,
        zero_quantized_gradient_bits=p.zero_quantized_gradient_bits,
        zero_quantized_weight_block=p.zero_quantized_weight_block,
        zero_quantized_gradient_block=p.zero_quantized_gradient_block,
        zero_quantized_gradient_node=p.zero_quantized_gradient_node,
        zero_hpz_size=p.zero_hpz_size,
        zero_fp8_gather=cfg.fp8_gathers,
        fp8_skip=t.fp8_skip_patterns if t.precision == "fp8" else (),
        onebit_adam=t.optimizer in ("onebit_adam", "zero_one_adam"),
        zero_one_interval=t.zero_one_local_step_clipper if t.optimizer == "zero_one_adam" else 0,
        kernels="eager",  # zerotron's blocks run eagerly (train.compile is refused by the planner)
    )
    _check_model(cfg.model)
    work = Workload(t.seq_len, t.global_batch * rows, t.precision)
    return ModelShape.from_config(cfg.model), layout, work


def _check_model(m: ModelConfig) -> None:
    """The planner-only architecture fields (MLA, dense-first blocks) must describe one model."""
    mla = {
        "q_lora_rank": m.q_lora_rank,
        "qk_rope_head_dim": m.qk_rope_head_dim,
        "qk_nope_head_dim": m.qk_nope_head_dim,
    }
    if not m.kv_lora_rank and any(mla.values()):
        given = ", ".join(f"model.{k}" for k, v in mla.items() if v)
        raise PlanError(f"{given} describe multi-head latent attention: set model.kv_lora_rank > 0 too")
    if m.kv_lora_rank:
        if not m.qk_rope_head_dim or not m.qk_nope_head_dim:
            raise PlanError(
                "MLA (model.kv_lora_rank > 0) needs model.qk_rope_head_dim and qk_nope_head_dim > 0"
            )
        if m.dim_per_head != m.qk_rope_head_dim + m.qk_nope_head_dim or m.kv_heads != m.num_attention_heads:
            raise PlanError(
                f"MLA: set model.head_dim={m.qk_rope_head_dim + m.qk_nope_head_dim} (qk_nope_head_dim + "
                f"qk_rope_head_dim) and model.num_key_value_heads={m.num_attention_heads} (every head has "
                "its own keys and values)"
            )
    if m.first_k_dense_replace and not 0 < m.first_k_dense_replace < m.num_hidden_layers:
        raise PlanError(
            f"model.first_k_dense_replace={m.first_k_dense_replace}: keep it below "
            f"model.num_hidden_layers={m.num_hidden_layers}"
        )
    if m.first_k_dense_replace and not m.num_local_experts:
        raise PlanError("model.first_k_dense_replace needs an MoE model (model.num_local_experts > 0)")


def working_weights16(layout: Layout, work: Workload) -> bool:
    """Whether the engine's working weights are 16-bit: under bf16/fp16 every stage keeps 16-bit working
    weights made from fp32 masters (DESIGN contract 9): ZeRO-1/2/3 from master shards, data
    parallelism from whole masters on every rank (:func:`replicated_masters`); fp8 is bf16 around its
    float8 GEMMs (the float8 copies are made per GEMM from the 16-bit weights)."""
    return work.precision in ("bf16", "fp16", "fp8")


def replicated_masters(layout: Layout, work: Workload) -> bool:
    """Whether the engine runs data parallelism (``parallel.zero=0``) as ZeRO-1 with every rank a block
    of its own: under bf16/fp16, whole fp32 masters and moments on every rank beside the 16-bit weights."""
    return layout.zero == 0 and working_weights16(layout, work)


def whole_grads_sent_16bit(layout: Layout, work: Workload) -> bool:
    """Whether the engine's ZeRO-1 sends each bucket's whole bf16 gradients as backward made them (one
    micro-batch per step, ``grad_reduce_dtype=bf16`` under bf16) and keeps only the reduced fp32 shard at
    the step, as ZeRO-2 does, instead of whole fp32 accumulators."""
    return (
        layout.zero == 1
        and work.precision == "bf16"
        and layout.grad_reduce_dtype == "bf16"
        and micro_batches(layout, work) == 1
    )


def micro_batches(layout: Layout, work: Workload) -> int:
    """Micro-batches per optimizer step on one pipeline (gradient accumulation steps)."""
    return work.global_batch // (layout.dp * layout.micro_batch)


def check(m: ModelShape, layout: Layout, work: Workload, hw: Hardware, gpus: int) -> None:
    """Raise :class:`PlanError` on the first reason ``layout`` cannot run ``work`` on ``gpus`` devices.

    The layout rules are :func:`zerotron.layout.check`'s, the same the config loader and the trainer
    apply; on top of them the planner checks the compute dtype, ``--gpus`` and the node's size.
    """
    _check_choices(layout, work)
    if layout.world != gpus:
        raise PlanError(
            f"dp*tp*pp*cp = {layout.dp}*{layout.tp}*{layout.pp}*{layout.cp} = {layout.world} but --gpus is "
            f"{gpus}; set parallel.dp=-1 or change the degrees"
        )
    if layout.tp > hw.gpus_per_node:
        raise PlanError(
            f"tp={layout.tp} exceeds the {hw.gpus_per_node} GPUs of a node of {hw.name}; tensor parallelism "
            f"needs the intra-node link: use tp<={hw.gpus_per_node} and raise pp or dp"
        )
    try:
        shared.check(spec(m, layout, work))
    except shared.LayoutError as e:
        raise PlanError(str(e)) from None
    _check_limits(layout)


def spec(m: ModelShape, layout: Layout, work: Workload) -> shared.LayoutSpec:
    """The shared check's view of a planned layout."""
    return shared.LayoutSpec(
        dims=layout.dims,
        cp_comm=layout.cp_comm,
        cp_ulysses_size=layout.cp_ulysses_size,
        etp=layout.etp,
        heads=m.heads,
        kv_heads=m.kv_heads,
        vocab=m.vocab,
        intermediate=m.intermediate,
        expert_intermediate=m.intermediate,
        layers=m.layers,
        experts=m.experts,
        top_k=m.top_k,
        seq_len=work.seq_len,
        global_batch=work.global_batch,
        micro_batch=layout.micro_batch,
        sequence_parallel=layout.sequence_parallel,
        pp_schedule=layout.pp_schedule,
        virtual_stages=layout.virtual_stages,
        pp_layers=layout.pp_layers,
        offload_optimizer=layout.offload_optimizer,
        offload_params=layout.offload_params,
    )


def _check_choices(layout: Layout, work: Workload) -> None:
    for key, value, choices in (
        ("train.recompute", layout.recompute, RECOMPUTE),
        ("train.precision", work.precision, PRECISIONS),
    ):
        if value not in choices:
            raise PlanError(f"{key}={value!r}: choose one of {', '.join(choices)}")


def _check_limits(layout: Layout) -> None:
    if layout.overlap_param_gather and layout.zero not in (1, 2):
        raise PlanError(
            f"parallel.overlap_param_gather=true with zero={layout.zero}: it overlaps ZeRO-1/2's gather of "
            "the updated shards (ZeRO-3 already gathers under the compute); set parallel.zero=1 or 2"
        )
    if layout.zero >= 2 and layout.pp > 1:
        raise PlanError(
            f"zero={layout.zero} with pp={layout.pp}: zerotron plan does not model ZeRO-2/3 under pipeline "
            "parallelism yet (zerotron train runs it); plan it with zero<=1"
        )
