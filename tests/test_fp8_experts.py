"""Routed experts in float8 (:mod:`zerotron.parallel.float8_experts`) against torchao's own float8
linear, one call of it per expert and source micro-batch.

**The reference** is torchao's ``matmul_with_hp_or_float8_args`` (the body of its ``Float8Linear``,
emulated), called once for each segment of rows — one expert's rows from one source micro-batch — and
the weight gradient summed over an expert's segments: what the single process computes when it runs
those micro-batches one after the other. zerotron's grouped function must give the same bits (fp32
operands), and the same to 1e-6 when the rows of a segment or the expert's weight are split over two
ranks whose amaxes it reduces (context / sequence parallelism, expert tensor parallelism).

*Negative controls*: one scale per expert over every source's rows (what a grouped GEMM without
segments would do), and per-rank scales on a split, each leave the reference by > 1e-3 (tensorwise;
rowwise scales are powers of two, whose rescaling is exact, so per-rank rowwise scales mostly give the
same bits and the control is not asserted there). Whole runs in float8 on every layout are in
``tests/test_fp8.py``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.harness import run_distributed
from zerotron.distributed.launch import current_rank_and_world
from zerotron.distributed.mesh import Mesh, ParallelDims
from zerotron.parallel import float8
from zerotron.parallel.float8_experts import Segments, _ExpertFloat8Mm

float8.torchao_float8()  # a dev dependency: missing, these tests fail rather than skip

E, OUT, IN = 3, 48, 32
# rows per (expert, source); an expert with no rows from one source, one with none at all from another
COUNTS = torch.tensor([[5, 7], [0, 4], [6, 0]])


def _operands() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x (n, IN) whose sources differ in magnitude (x4 and x0.25), w (E, OUT, IN), an output weighting."""
    gen = torch.Generator().manual_seed(3)
    n = int(COUNTS.sum())
    x = torch.randn(n, IN, generator=gen) * torch.linspace(0.2, 3.0, IN)
    source = torch.tensor([0, 1] * E).repeat_interleave(COUNTS.flatten())
    x = x * torch.where(source == 0, 4.0, 0.25)[:, None]
    w = torch.randn(E, OUT, IN, generator=gen) * torch.linspace(0.5, 2.0, IN)
    return x, w, torch.randn(n, OUT, generator=gen)


def _torchao(x: torch.Tensor, w: torch.Tensor, r: torch.Tensor, recipe: str) -> tuple[torch.Tensor, ...]:
    """Output, input gradient and weight gradient from torchao's float8 matmul, one call per segment."""
    from torchao.float8.float8_linear import Float8Linear, matmul_with_hp_or_float8_args

    config = float8.torchao_float8().Float8LinearConfig.from_recipe_name(recipe)
    config = type(config)(**{**config.__dict__, "emulate": True})
    ys, gxs, gw = [], [], torch.zeros_like(w)
    at = 0
    for e in range(E):
        linear = torch.nn.Linear(IN, OUT, bias=False)
        layer = Float8Linear.from_float(linear, config)
        for rows in COUNTS[e].tolist():
            if not rows:
                continue
            xs, we = x[at : at + rows].clone().requires_grad_(), w[e].clone().requires_grad_()
            y = matmul_with_hp_or_float8_args.apply(xs, we.t(), layer.linear_mm_config, layer.config)
            (y * r[at : at + rows]).sum().backward()
            ys.append(y.detach())
            gxs.append(xs.grad)
            gw[e] += we.grad
            at += rows
    return torch.cat(ys), torch.cat(gxs), gw


def _ours(
    x: torch.Tensor, w: torch.Tensor, r: torch.Tensor, counts: torch.Tensor, spec: Any
) -> tuple[torch.Tensor, ...]:
    xa, wa = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = _ExpertFloat8Mm.apply(xa, wa, Segments.of(counts), spec)
    (y * r).sum().backward()
    return y.detach(), xa.grad, wa.grad


def _rel(got: tuple[torch.Tensor, ...], want: tuple[torch.Tensor, ...]) -> float:
    return max(float((a - b).norm() / b.norm()) for a, b in zip(got, want))


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_expert_gemms_equal_torchao_per_expert_and_source(recipe: str) -> None:
    x, w, r = _operands()
    want = _torchao(x, w, r, recipe)
    spec = float8.Float8Spec.create(recipe, True, pad=True)  # padding the rows' axis changes no value
    got = _ours(x, w, r, COUNTS, spec)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    if recipe == "tensorwise":  # one scale per expert over both sources: another float8 grid
        assert _rel(_ours(x, w, r, COUNTS.sum(1), spec), want) > 1e-3


def _split_body(kind: str, recipe: str, reduce: bool) -> float:
    """The expert GEMMs with a split over two ranks (``tokens``: each source's rows halved between the
    ranks; ``outer`` / ``inner``: the weight's out / in features halved, as expert tensor parallelism
    splits gate_up_proj / down_proj) against torchao's whole segments: the largest relative error."""
    from zerotron.distributed import collectives

    rank, world = current_rank_and_world()
    group = Mesh(ParallelDims(world, dp=1, tp=world), rank).group("tp")
    split = (group,) if reduce else ()
    x, w, r = _operands()
    want = _torchao(x, w, r, "tensorwise" if recipe == "tensorwise" else "rowwise")
    if kind == "tokens":
        spec = float8.Float8Spec.create(recipe, True, pad=True, tokens=split)
        mine = COUNTS // 2 if rank == 0 else COUNTS - COUNTS // 2  # this rank's rows of each segment
        starts = torch.cat([torch.zeros(1, dtype=torch.long), COUNTS.flatten().cumsum(0)[:-1]])
        skip = torch.zeros_like(COUNTS.flatten()) if rank == 0 else (COUNTS // 2).flatten()
        rows = torch.cat([torch.arange(s + k, s + k + m) for s, k, m in zip(starts, skip, mine.flatten())])
        y, gx, gw = _ours(x[rows], w, r[rows], mine, spec)
        collectives.all_reduce(gw, group)  # the token split's weight gradient, summed
        return _rel((y, gx, gw), (want[0][rows], want[1][rows], want[2]))
    half = (OUT if kind == "outer" else IN) // 2
    part = slice(rank * half, (rank + 1) * half)
    spec = float8.Float8Spec.create(recipe, True, pad=True, **{kind: split})
    if kind == "outer":
        y, gx, gw = _ours(x, w[:, part], r[:, part], COUNTS, spec)
        collectives.all_reduce(gx, group)  # the column split's input gradient, summed
        return _rel((y, gx, gw), (want[0][:, part], want[1], want[2][:, part]))
    y, gx, gw = _ours(x[:, part], w[:, :, part], r, COUNTS, spec)
    collectives.all_reduce(y, group)  # the row split's output, summed
    return _rel((y, gx, gw), (want[0], want[1][:, part], want[2][:, :, part]))


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
@pytest.mark.parametrize("kind", ["tokens", "outer", "inner"])
def test_split_expert_gemms_scale_as_the_whole_segments(kind: str, recipe: str) -> None:
    same = max(run_distributed(_split_body, 2, kind, recipe, True))
    assert same <= 1e-6, same
    if recipe == "tensorwise":
        per_rank = max(run_distributed(_split_body, 2, kind, recipe, False))
        assert per_rank > 1e-3, per_rank


def _ep_body(dims: tuple[int, int, int], sources: str, reduce: bool, recipe: str) -> float:
    """Ranks dp × cp with experts split over ep (two experts a rank): each rank routes its own rows (a
    micro-batch is the rows of its cp ranks; each cp rank's rows at another magnitude, and each
    micro-batch's) through :class:`ExpertDispatch` to float8 experts, against the single process: all
    the experts on each micro-batch alone, one after the other, the weight gradients summed. The
    largest relative error of this rank's outputs, input gradients and its experts' gradients (summed
    over their replicas, as training reduces them over ``edp``). ``sources``: ``mesh`` (each peer's
    micro-batch, as training numbers them), ``peer`` (each peer its own) or ``one`` (all peers one);
    ``reduce``: whether the replicas of an expert in one expert batch block reduce their amaxes."""
    from zerotron.distributed import collectives
    from zerotron.models.moe import Experts
    from zerotron.parallel.expert import ExpertDispatch, expert_replicas, expert_sources
    from zerotron.parallel.float8_experts import ExpertsFloat8

    rank, world = current_rank_and_world()
    dp, cp, ep = dims
    mesh = Mesh(ParallelDims(world, dp=dp, cp=cp, ep=ep), rank)
    block = expert_replicas(mesh.dims)
    replicas = mesh.split("edp", block, ("edp_batch", "edp_batch_rep"))[0] if block > 1 else None
    tokens = (replicas,) if reduce and replicas is not None else ()
    spec = float8.Float8Spec.create(recipe, True, pad=True, tokens=tokens)
    hidden, inner, experts, local = 32, 32, 2 * ep, 2
    gen = torch.Generator().manual_seed(7)
    gate_up = torch.randn(experts, 2 * inner, hidden, generator=gen) * 0.2
    down = torch.randn(experts, hidden, inner, generator=gen) * 0.2
    xs, ids, rs = [], [], []
    for r in range(world):  # rank r = micro-batch r // cp, cp rank r % cp
        n = 9 + 4 * r
        scale = (4.0, 0.25, 1.5, 0.5)[r % cp] * (1.0, 3.0, 0.3)[r // cp]
        xs.append(torch.randn(n, hidden, generator=gen) * scale)
        ids.append(torch.randint(0, experts, (n,), generator=gen))
        rs.append(torch.randn(n, hidden, generator=gen))

    def run(
        x: torch.Tensor, e: torch.Tensor, r: torch.Tensor, module: Experts, dispatch: Any
    ) -> tuple[torch.Tensor, ...]:
        order = torch.argsort(e, stable=True)
        leaf = x.clone().requires_grad_()
        y_sorted = dispatch(leaf[order], torch.bincount(e, minlength=experts), module)
        y = torch.empty_like(y_sorted).index_copy(0, order, y_sorted)
        (y * r).sum().backward()
        return y.detach(), leaf.grad

    def holder(count: int, first: int) -> Experts:
        module = Experts(count, hidden, inner, grouped=False)
        with torch.no_grad():
            module.gate_up_proj.copy_(gate_up[first : first + count])
            module.down_proj.copy_(down[first : first + count])
        module.float8_mlp = ExpertsFloat8(spec, spec)
        return module

    whole = holder(experts, 0)
    want = []
    for batch in range(dp):  # the single process: micro-batch 0, then 1, ...
        mine = list(range(batch * cp, (batch + 1) * cp))
        x, e, r = (torch.cat([t[i] for i in mine]) for t in (xs, ids, rs))
        y, gx = run(x, e, r, whole, lambda rows, counts, m: m(rows, counts))
        if rank in mine:
            at = sum(xs[i].shape[0] for i in mine if i < rank)
            want = [y[at : at + xs[rank].shape[0]], gx[at : at + xs[rank].shape[0]]]
    first = mesh.coords["ep"] * local
    mine_ = holder(local, first)
    numbered = {
        "mesh": expert_sources(mesh.dims, rank)[0],
        "peer": tuple(range(ep)),
        "one": (0,) * ep,
    }[sources]
    batches = expert_sources(mesh.dims, rank)[1] if sources == "mesh" else max(numbered) + 1
    dispatch = ExpertDispatch(mesh.group("ep"), local, numbered, batches)
    got = list(run(xs[rank], ids[rank], rs[rank], mine_, dispatch))
    assert whole.gate_up_proj.grad is not None and whole.down_proj.grad is not None
    grads = [mine_.gate_up_proj.grad, mine_.down_proj.grad]
    for g in grads:
        collectives.all_reduce(g, mesh.group("edp"))  # the replicas' partial sums, as training reduces
    got += grads
    want += [whole.gate_up_proj.grad[first : first + local], whole.down_proj.grad[first : first + local]]
    return _rel(tuple(got), tuple(want))


# (dp, cp, ep): cp divides ep (a micro-batch's rows for an expert on one rank); ep divides cp (one
# micro-batch split over two EP groups); neither (EP groups straddle micro-batches)
MESHES = {"cp2-ep4": (2, 2, 4), "cp4-ep2": (1, 4, 2), "cp2-ep3": (3, 2, 3)}


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
@pytest.mark.parametrize("layout", list(MESHES))
def test_expert_parallel_scales_each_source_micro_batch_as_the_single_process(
    layout: str, recipe: str
) -> None:
    """Under EP each expert scales the rows of each source micro-batch apart (its cp ranks' rows
    together), as the single process running the micro-batches one after the other, on layouts where
    cp divides ep, ep divides cp, and neither (the replicas holding parts of a micro-batch's rows for
    one expert reduce its amax). Controls (tensorwise): each cp rank's rows on their own scale, or all
    sources on one, or the replicas not reducing, leave it by > 1e-3."""
    dims = MESHES[layout]
    world = dims[0] * dims[1]
    same = max(run_distributed(_ep_body, world, dims, "mesh", True, recipe))
    assert same <= 1e-6, same
    if recipe == "tensorwise":
        for wrong in ("peer", "one") if layout == "cp2-ep4" else ():
            assert max(run_distributed(_ep_body, world, dims, wrong, True, recipe)) > 1e-3, wrong
        if layout != "cp2-ep4":
            assert max(run_distributed(_ep_body, world, dims, "mesh", False, recipe)) > 1e-3


def test_moe_fp8_under_torchrun_gives_the_single_process_losses(tmp_path: Path) -> None:
    """The command line as both ranks of a torchrun job, the routed experts split over them
    (``parallel.ep=2``): it trains in fp8 with no notice that the experts stay bf16, and its losses are
    those of the same command in one process, within the layouts' MoE tolerance (tests/test_fp8.py).
    Which scales the experts use is told apart by the tests above, not by whole runs."""
    from tests.test_fp8 import MOE, MOE_RTOL
    from tests.test_launch_job import ROOT, TRAIN, _env, _torchrun

    args = [*TRAIN[1:], *MOE, "train.precision=fp8", "train.steps=4"]
    one = subprocess.run([sys.executable, "-m", *args, "--nproc", "1", "--out", str(tmp_path / "one")],
                         env=_env(), capture_output=True, text=True, timeout=300, cwd=ROOT)  # fmt: skip
    assert one.returncode == 0, one.stderr[-3000:]
    two = _torchrun([*args, "parallel.ep=2", "--out", str(tmp_path / "two")])
    assert two.returncode == 0, two.stderr[-3000:]
    assert "routed experts compute in bf16" not in two.stdout + two.stderr
    assert "fp8" in two.stdout and "dp=2" in two.stdout
    a, b = (
        [json.loads(line)["loss"] for line in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]
        for run in ("one", "two")
    )
    assert len(a) == len(b) == 4
    assert max(abs(x - y) / abs(x) for x, y in zip(a, b)) <= MOE_RTOL, (a, b)
