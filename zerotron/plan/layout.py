"""A parallel layout and its workload, read from a :class:`~zerotron.config.Config`, and checked.

Every check raises :class:`~zerotron.plan.errors.PlanError` with one line that says what to change.
The rank grid is the engine's (:class:`zerotron.distributed.mesh.ParallelDims`): ``(dp, pp, cp, tp)`` with tp
innermost, so a tp group is ``tp`` consecutive ranks and must fit in one node.
"""

from __future__ import annotations

from dataclasses import dataclass

from zerotron.config import Config
from zerotron.plan.errors import PlanError
from zerotron.plan.hardware import Hardware
from zerotron.shapes import ModelShape

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb")
RECOMPUTE = ("none", "selective", "full")
OFFLOAD = ("none", "cpu", "nvme")
PRECISIONS = ("fp32", "bf16", "fp16", "fp8")


@dataclass(frozen=True)
class Layout:
    """Degrees of parallelism and the per-rank choices that change memory and time."""

    dp: int
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    zero: int = 0
    micro_batch: int = 1
    recompute: str = "none"
    sequence_parallel: bool = False
    tp_comm_overlap: bool = False
    pp_schedule: str = "1f1b"
    virtual_stages: int = 1
    offload_optimizer: str = "none"
    offload_params: str = "none"
    bucket_mb: float = 25.0
    pp_layers: tuple[int, ...] | None = None

    @property
    def world(self) -> int:
        """Ranks the layout needs."""
        return self.dp * self.tp * self.pp * self.cp

    def as_dict(self) -> dict[str, object]:
        """The layout as plain data."""
        return dict(self.__dict__)

    def short(self) -> str:
        """A compact one-line description (search tables)."""
        extra = " sp" if self.sequence_parallel and self.tp > 1 else ""
        extra += " tpo" if self.tp_comm_overlap and self.tp > 1 else ""
        if self.pp > 1:
            extra += f" {self.pp_schedule}" + (f"x{self.virtual_stages}" if self.virtual_stages > 1 else "")
        if self.offload_optimizer != "none" or self.offload_params != "none":
            extra += f" off={self.offload_optimizer}/{self.offload_params}"
        ep = f" ep{self.ep}" if self.ep > 1 else ""
        return (
            f"dp{self.dp} tp{self.tp} pp{self.pp} cp{self.cp}{ep} z{self.zero} mb{self.micro_batch} "
            f"rc={self.recompute}{extra}"
        )


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
    inner = p.tp * p.pp * p.cp
    if p.dp == -1:
        if gpus % inner:
            raise PlanError(
                f"tp*pp*cp = {p.tp}*{p.pp}*{p.cp} = {inner} does not divide --gpus {gpus}; "
                f"choose degrees whose product divides {gpus}"
            )
        dp = gpus // inner
    else:
        dp = p.dp
    layout = Layout(
        dp=dp,
        tp=p.tp,
        pp=p.pp,
        cp=p.cp,
        ep=p.ep,
        zero=p.zero,
        micro_batch=t.micro_batch,
        recompute=t.recompute,
        sequence_parallel=p.sequence_parallel,
        tp_comm_overlap=p.tp_comm_overlap,
        pp_schedule=p.pp_schedule,
        virtual_stages=p.virtual_stages,
        offload_optimizer=p.offload_optimizer,
        offload_params=p.offload_params,
        bucket_mb=p.bucket_mb,
        pp_layers=tuple(int(n) for n in getattr(p, "pp_layers", None) or ()) or None,
    )
    return ModelShape.from_config(cfg.model), layout, Workload(t.seq_len, t.global_batch, t.precision)


def micro_batches(layout: Layout, work: Workload) -> int:
    """Micro-batches per optimizer step on one pipeline (gradient accumulation steps)."""
    return work.global_batch // (layout.dp * layout.micro_batch)


def check(m: ModelShape, layout: Layout, work: Workload, hw: Hardware, gpus: int) -> None:
    """Raise :class:`PlanError` on the first reason ``layout`` cannot run ``work`` on ``gpus`` devices."""
    _check_choices(layout, work)
    _check_degrees(m, layout, work, hw, gpus)
    _check_batch(layout, work)
    _check_features(m, layout)


def _check_choices(layout: Layout, work: Workload) -> None:
    for key, value, choices in (
        ("train.recompute", layout.recompute, RECOMPUTE),
        ("parallel.pp_schedule", layout.pp_schedule, SCHEDULES),
        ("parallel.offload_optimizer", layout.offload_optimizer, OFFLOAD),
        ("parallel.offload_params", layout.offload_params, OFFLOAD),
        ("train.precision", work.precision, PRECISIONS),
    ):
        if value not in choices:
            raise PlanError(f"{key}={value!r}: choose one of {', '.join(choices)}")
    degrees: tuple[tuple[str, int], ...] = (
        ("dp", layout.dp),
        ("tp", layout.tp),
        ("pp", layout.pp),
        ("cp", layout.cp),
        ("ep", layout.ep),
        ("virtual_stages", layout.virtual_stages),
    )
    for name, degree in degrees:
        if degree < 1:
            raise PlanError(f"parallel.{name}={degree} must be >= 1")
    if layout.zero not in (0, 1, 2, 3):
        raise PlanError(f"parallel.zero={layout.zero} must be 0, 1, 2 or 3")
    if layout.micro_batch < 1 or work.global_batch < 1 or work.seq_len < 1:
        raise PlanError("train.micro_batch, train.global_batch and train.seq_len must be >= 1")


def _check_degrees(m: ModelShape, layout: Layout, work: Workload, hw: Hardware, gpus: int) -> None:
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
    if m.heads % layout.tp:
        raise PlanError(
            f"tp={layout.tp} does not divide model.num_attention_heads={m.heads}; choose a tp that divides "
            f"{m.heads}"
        )
    if m.kv_heads % layout.tp and layout.tp % m.kv_heads:
        raise PlanError(
            f"tp={layout.tp} neither divides nor is a multiple of model.num_key_value_heads={m.kv_heads}; "
            "choose a tp that divides the query heads and is a divisor or multiple of the KV heads"
        )
    if m.vocab % layout.tp:
        raise PlanError(
            f"tp={layout.tp} does not divide model.vocab_size={m.vocab} (the embedding and head are split "
            "by vocabulary); pad the vocabulary or choose another tp"
        )
    if layout.virtual_stages > 1 and layout.pp_schedule != "interleaved":
        raise PlanError(
            f"parallel.virtual_stages={layout.virtual_stages} needs parallel.pp_schedule=interleaved "
            "(or set virtual_stages=1)"
        )
    chunks = layout.pp * layout.virtual_stages
    if chunks > m.layers:
        raise PlanError(
            f"pp*virtual_stages = {chunks} exceeds model.num_hidden_layers={m.layers}; every stage needs a "
            "layer: lower parallel.pp or parallel.virtual_stages"
        )
    sizes = layout.pp_layers
    if sizes and (len(sizes) != chunks or sum(sizes) != m.layers or min(sizes) < 1):
        raise PlanError(
            f"parallel.pp_layers={list(sizes)} must have pp*virtual_stages = {chunks} positive entries summing "
            f"to model.num_hidden_layers={m.layers}"
        )
    if work.seq_len % layout.cp:
        raise PlanError(f"cp={layout.cp} does not divide train.seq_len={work.seq_len}")


def _check_batch(layout: Layout, work: Workload) -> None:
    if work.global_batch % layout.dp:
        raise PlanError(
            f"train.global_batch={work.global_batch} is not divisible by dp={layout.dp}; use a multiple of "
            f"{layout.dp}"
        )
    per_rank = work.global_batch // layout.dp
    if per_rank % layout.micro_batch:
        raise PlanError(
            f"train.global_batch={work.global_batch} / dp={layout.dp} = {per_rank} sequences per rank is not a "
            f"multiple of train.micro_batch={layout.micro_batch}; set train.micro_batch to a divisor of "
            f"{per_rank} or train.global_batch to a multiple of {layout.dp * layout.micro_batch}"
        )
    m = per_rank // layout.micro_batch
    if layout.pp_schedule == "interleaved" and layout.pp > 1 and m % layout.pp:
        raise PlanError(
            f"the interleaved schedule needs micro-batches per step ({m}) to be a multiple of pp={layout.pp}; "
            "raise train.global_batch or lower train.micro_batch"
        )


def _check_features(m: ModelShape, layout: Layout) -> None:
    if m.experts < 0:
        raise PlanError(f"model.num_local_experts={m.experts} must be >= 0 (0: a dense MLP)")
    if m.experts and not 1 <= m.top_k <= m.experts:
        raise PlanError(
            f"model.num_experts_per_tok={m.top_k} must be between 1 and model.num_local_experts={m.experts}"
        )
    if layout.ep > 1 and not m.experts:
        raise PlanError(
            f"ep={layout.ep}: the model has no experts (dense Llama config); expert parallelism needs an MoE "
            "model (model.num_local_experts > 0), or set parallel.ep=1"
        )
    if m.experts and m.experts % layout.ep:
        fits = ", ".join(str(d) for d in range(1, m.experts + 1) if m.experts % d == 0)
        raise PlanError(f"ep={layout.ep} does not divide the {m.experts} experts; choose ep in {fits}")
    if layout.ep > 1 and (layout.dp * layout.cp) % layout.ep:
        raise PlanError(
            f"ep={layout.ep} must divide dp*cp = {layout.dp * layout.cp}: expert parallelism folds over the "
            "data- and context-parallel ranks (each group of ep of them splits the experts)"
        )
    if layout.offload_params != "none" and layout.zero != 3:
        raise PlanError(
            f"offload_params={layout.offload_params} needs parallel.zero=3 (parameters are offloaded as "
            "ZeRO-3 shards)"
        )
    if layout.offload_optimizer != "none" and layout.zero == 0:
        raise PlanError(
            f"offload_optimizer={layout.offload_optimizer} needs parallel.zero>=1 (the offloaded optimizer "
            "works on ZeRO shards)"
        )
    if layout.zero >= 2 and layout.pp > 1:
        raise PlanError(
            f"zero={layout.zero} with pp={layout.pp}: sharded gradients would be reduced every micro-batch; "
            "use zero<=1 with pipeline parallelism (as DeepSpeed and Megatron do)"
        )
