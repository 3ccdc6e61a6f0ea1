"""FP8 training (``train.precision=fp8``) equals torchao's float8 linear in one process, and gives the
single process's losses on every layout.

**The reference** is written here without the trainer: zerotron's single-device model (bf16 working
weights, fp32 masters for ``torch.optim.AdamW``, as DESIGN contract 9 has it) with torchao's
own float8 autograd function (``matmul_with_hp_or_float8_args``, the body of torchao's
``Float8Linear``) on its block projections, fed bf16 operands as torchao's ``Float8Linear`` sees them
on a GPU under autocast with FSDP2's bf16 parameters (torchao's forward casts only under CUDA autocast),
and one micro-batch per step.

**Layouts** are compared with the single-process fp8 run at the same micro-batch size (a scale belongs
to one micro-batch's tensor; data parallelism runs other micro-batches on other ranks, as the single
process runs them one after the other).

*The sharp check* is per linear (:func:`test_split_linears_scale_as_the_whole_tensor`, fp32
operands): with the same scales every float8 value is the same bits and a split GEMM changes only the
fp32 summation order, so a split linear equals the whole one to 1e-6 (measured ~1e-9), while per-shard
scales put each piece on another float8 grid (~1e-2).

*Whole runs* (6 steps, bf16 around the float8 GEMMs) cannot be that sharp: bf16 itself moves these
losses by up to 2e-5 between a split layout and the single process (the partial sums of a row-parallel
GEMM are rounded to bf16 before they are added; measured: tp 1.7e-5, cp 1.9e-5), and float8
re-quantises each perturbed activation: a perturbation δ pushes a value across an e4m3 rounding
boundary (steps of 2^-4..2^-3 relative) with probability ~δ/2^-4, and the value then moves by a whole
step, so float8 amplifies the bf16 noise by a few times (measured: tp 3.3e-5, pp 3.9e-5, interleaved
4.8e-5, cp 6.3e-5; ZeRO, data parallelism and hybrid sharding ~1e-7). ``RTOL`` = 2e-4 bounds that
with room for other CPUs' kernels; per-shard scales in whole runs land in the same range (tp 4.1e-5,
cp 8.0e-5), which is why the negative control is the per-linear one. MoE blocks add a discrete step:
a flipped float8 rounding can flip a token's top-k choice, which moves the token to another expert
(measured with the routed experts in float8: ep 2.5e-5 (rowwise 3.0e-5), cp 4.4e-5, ZeRO-3 4.3e-5, tp
with SP 2.0e-4, with etp 1.9e-4, tp×ep×SP 1.9e-4, against bf16's 1.2e-5–2.2e-5 on the same layouts):
``MOE_RTOL`` = 5e-4. Here too whole runs cannot tell the right scales from wrong ones (ep with one
scale per expert over both sources' rows: 1.9e-5); the sharp checks of the experts' scales, per
source micro-batch under EP and reduced over split rows and weights, are in tests/test_fp8_experts.py. The QLoRA tensor-parallel layout runs at hidden 128 (NF4's 64-value
blocks must fall whole in each row-parallel shard), where bf16 alone moves the losses further between
tp 2 with SP and one process (measured: LoRA 7.5e-5, QLoRA 6.5e-5) and fp8 amplifies that alike (LoRA
1.1e-4, QLoRA 2.5e-4): ``WIDE_RTOL`` = 4e-4.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tests.harness import run_distributed
from tests.test_train_dp import BASE, _tokens, torch_adamw
from zerotron.components.data import DataLoader, PackedDataset
from zerotron.config_check import validate
from zerotron.config_load import ConfigError, load_config
from zerotron.distributed.launch import current_rank_and_world
from zerotron.distributed.mesh import Mesh, ParallelDims
from zerotron.models.llama import LlamaForCausalLM
from zerotron.parallel import float8
from zerotron.train.trainer import Trainer

torchao_float8 = float8.torchao_float8()  # a dev dependency: missing, these tests fail rather than skip

STEPS = 6
RTOL = 2e-4
MOE_RTOL = 5e-4  # routing is discrete: see the module docstring
WIDE_RTOL = 4e-4  # hidden 128: bf16's own layout noise is larger there (see the module docstring)
FP8 = [*BASE, f"train.steps={STEPS}", "train.precision=fp8"]
LORA = ["lora.rank=4", "lora.target_modules=all-linear", "train.lr=3e-3"]
QLORA = [*LORA, "lora.base_bits=4"]
MOE = ["model.num_local_experts=4", "model.shared_expert_intermediate_size=64"]
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class _TorchaoBf16Linear(torch.nn.Module):
    """torchao's float8 linear as it runs under CUDA autocast with bf16 parameters: bf16 operands
    into torchao's ``matmul_with_hp_or_float8_args`` (its ``Float8Linear.forward``, bias-free)."""

    def __init__(self, linear: torch.nn.Linear, recipe: str) -> None:
        super().__init__()
        from torchao.float8.float8_linear import Float8Linear

        config = torchao_float8.Float8LinearConfig.from_recipe_name(recipe)
        config = type(config)(**{**config.__dict__, "emulate": True})
        self.inner = Float8Linear.from_float(linear, config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torchao.float8.float8_linear import matmul_with_hp_or_float8_args

        m = self.inner
        with torch.autocast("cpu", enabled=False):
            w = m.weight.to(torch.bfloat16).t()
            return matmul_with_hp_or_float8_args.apply(x.to(torch.bfloat16), w, m.linear_mm_config, m.config)


class _TorchaoExperts:
    """A block's routed experts through torchao's float8 matmul, one call per expert and GEMM (one
    micro-batch a step: each expert's rows are one micro-batch's), in place of the experts' MLP."""

    def __init__(self, recipe: str) -> None:
        from torchao.float8.float8_linear import Float8Linear

        config = torchao_float8.Float8LinearConfig.from_recipe_name(recipe)
        self.inner = Float8Linear.from_float(
            torch.nn.Linear(16, 16, bias=False), type(config)(**{**config.__dict__, "emulate": True})
        )

    def _mm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        from torchao.float8.float8_linear import matmul_with_hp_or_float8_args

        m = self.inner
        return matmul_with_hp_or_float8_args.apply(x, w.t(), m.linear_mm_config, m.config)

    def __call__(
        self, x: torch.Tensor, counts: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor
    ) -> torch.Tensor:
        with torch.autocast("cpu", enabled=False):
            x, gate_up, down = x.to(torch.bfloat16), gate_up.to(torch.bfloat16), down.to(torch.bfloat16)
            outs = []
            for e, rows in enumerate(x.split(counts.tolist())):
                if rows.shape[0]:
                    gate, up = self._mm(rows, gate_up[e]).chunk(2, dim=-1)
                    outs.append(self._mm(F.silu(gate) * up, down[e]))
            return torch.cat(outs) if outs else x.new_zeros((0, down.shape[1]))


def _torchao_reference(overrides: list[str], tokens: np.ndarray, recipe: str) -> list[float]:
    cfg = load_config(None, overrides)
    model = LlamaForCausalLM(cfg.model)
    model.init_weights(cfg.train.seed)
    for name, module in list(model.named_modules()):
        if name.startswith("layers.") and name.rpartition(".")[2] in PROJECTIONS:
            parent, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(parent), leaf, _TorchaoBf16Linear(module, recipe))
        if name.endswith("mlp.experts"):
            module.float8_mlp = _TorchaoExperts(recipe)
    masters = [torch.nn.Parameter(p.detach().clone()) for p in model.parameters()]  # fp32, for AdamW
    model.to(torch.bfloat16)  # the 16-bit working weights
    t = cfg.train
    master_model = torch.nn.Module()
    master_model.params = torch.nn.ParameterList(masters)  # torch_adamw's decay groups by ndim
    opt = torch_adamw(master_model, t)
    loader = DataLoader(PackedDataset(tokens, t.seq_len), t.global_batch, t.global_batch, 0, 1, t.seed)
    losses = []
    for _ in range(STEPS):
        (x, y) = loader.next_step()[0]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(x)
        loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), reduction="sum") / y.numel()
        loss.backward()
        for master, p in zip(masters, model.parameters()):
            master.grad, p.grad = p.grad.float(), None
        torch.nn.utils.clip_grad_norm_(masters, t.grad_clip)
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            for master, p in zip(masters, model.parameters()):
                p.copy_(master)
        losses.append(loss.item())
    return losses


def _run(overrides: list[str], tokens: np.ndarray, run_dir: str) -> list[float]:
    cfg = load_config(None, overrides)
    rank, world = current_rank_and_world()
    mesh = Mesh(ParallelDims.from_config(cfg.parallel, world), rank)
    trainer = Trainer(cfg, mesh, Path(run_dir), tokens)
    return [trainer.train_step()["loss"] for _ in range(STEPS)]


def _rel(a: list[float], b: list[float]) -> float:
    return float(np.max(np.abs(np.asarray(a) - np.asarray(b)) / np.abs(np.asarray(b))))


# the reference adds no load-balancing loss (the trainer's is tested in tests/test_moe_train.py)
@pytest.mark.parametrize("model", [[], [*MOE, "model.router_aux_loss_coef=0"]], ids=["dense", "moe"])
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_single_process_equals_torchao(recipe: str, model: list[str], tmp_path: Path) -> None:
    """One process, one micro-batch a step: zerotron's fp8 run equals torchao's float8 linears (an MoE
    model's routed experts too, through torchao's float8 matmul per expert)."""
    tokens = _tokens()
    overrides = [*FP8, *model, f"train.fp8_recipe={recipe}", "train.micro_batch=8"]
    ref = _torchao_reference(overrides, tokens, recipe)
    ours = run_distributed(_run, 1, overrides, tokens, str(tmp_path))[0]
    np.testing.assert_allclose(ours, ref, rtol=1e-5)
    assert ref[-1] < ref[0]


def test_fp8_is_not_bf16(tmp_path: Path) -> None:
    """fp8 actually runs: its losses differ from the bf16 run's by far more than the layout tolerance,
    and stay within a few percent of them."""
    tokens = _tokens()
    fp8 = run_distributed(_run, 1, [*FP8, "train.micro_batch=8"], tokens, str(tmp_path / "a"))[0]
    bf16 = [*FP8, "train.micro_batch=8", "train.precision=bf16"]
    ref = run_distributed(_run, 1, bf16, tokens, str(tmp_path / "b"))[0]
    assert 1e-5 < _rel(fp8, ref) < 0.02  # 7e-5 here: the torchao comparison above holds to 1e-5


LAYOUTS = [
    (2, ["parallel.dp=2", "parallel.zero=0"]),
    (2, ["parallel.dp=2", "parallel.zero=1"]),
    (2, ["parallel.dp=2", "parallel.zero=2"]),
    (2, ["parallel.dp=2", "parallel.zero=3", "parallel.persist_numel=100"]),
    (
        2,
        ["parallel.dp=2", "parallel.zero=3", "parallel.offload_params=cpu", "parallel.offload_optimizer=cpu"],
    ),
    (2, ["parallel.tp=2"]),
    (2, ["parallel.tp=2", "parallel.sequence_parallel=true"]),
    (2, ["parallel.tp=2", "parallel.sequence_parallel=true", "train.fp8_recipe=rowwise"]),
    (2, ["parallel.pp=2", "parallel.pp_schedule=1f1b"]),
    (2, ["parallel.pp=2", "parallel.pp_schedule=zb"]),
    (
        2,
        [
            "parallel.pp=2",
            "parallel.pp_schedule=interleaved",
            "parallel.virtual_stages=2",
            "model.num_hidden_layers=4",
        ],
    ),
    (2, ["parallel.cp=2"]),
    (2, ["parallel.cp=2", "train.fp8_recipe=rowwise"]),
    (2, ["parallel.tp=2", "train.recompute=full"]),
    (4, ["parallel.dp=2", "parallel.tp=2", "parallel.sequence_parallel=true", "parallel.zero=3"]),
    (4, ["parallel.dp=4", "parallel.zero=3", "parallel.zero_shard_size=2"]),
    (2, ["parallel.dp=2", "parallel.zero=2", *LORA]),
    (2, ["parallel.tp=2", "parallel.sequence_parallel=true", *LORA]),
    (2, ["parallel.tp=2", *LORA, "lora.use_dora=true"]),
    (2, ["parallel.dp=2", "parallel.zero=2", *QLORA]),
    (2, ["parallel.dp=2", "parallel.zero=3", *QLORA]),
    # NF4's 64-value blocks: a row-parallel shard must hold whole blocks of each row
    (
        2,
        [
            "parallel.tp=2",
            "parallel.sequence_parallel=true",
            *QLORA,
            "model.hidden_size=128",
            "model.intermediate_size=256",
        ],
    ),
    (2, ["parallel.dp=2", "parallel.zero=3", *QLORA, "lora.use_dora=true"]),
    # routed experts in float8: a micro-batch's rows meet its experts on other ranks (ep: rows of other
    # micro-batches arrive beside them; cp, tp with SP: its rows split; etp: the experts split)
    (2, ["parallel.ep=2", *MOE]),
    (2, ["parallel.ep=2", *MOE, "train.fp8_recipe=rowwise"]),
    (4, ["parallel.tp=2", "parallel.ep=2", "parallel.sequence_parallel=true", *MOE]),
    (2, ["parallel.cp=2", *MOE]),
    (4, ["parallel.ep=4", "parallel.cp=2", *MOE]),
    # cp does not divide ep: a micro-batch's rows for one expert arrive on two of its replicas
    (4, ["parallel.ep=2", "parallel.cp=4", *MOE]),
    (2, ["parallel.tp=2", "parallel.sequence_parallel=true", *MOE]),
    (2, ["parallel.tp=2", "parallel.etp=2", "parallel.sequence_parallel=true", *MOE]),
    (2, ["parallel.dp=2", "parallel.zero=3", *MOE]),
    # ZeRO-3 over the experts' replicas (dp 4, edp 2), their stacks gathered as float8, a scale each
    (4, ["parallel.ep=2", "parallel.zero=3", *MOE]),
    (2, ["parallel.pp=2", "parallel.pp_schedule=zb", *MOE]),
]


_SINGLE: dict[tuple[str, ...], list[float]] = {}  # the single-process losses of each model and recipe


def _single_losses(single: list[str], run_dir: Path) -> list[float]:
    """The single process's losses for ``single``, run once per distinct configuration: layouts that
    differ only in ``parallel.*`` share their reference (the run is deterministic)."""
    key = tuple(single)
    if key not in _SINGLE:
        _SINGLE[key] = run_distributed(_run, 1, single, _tokens(), str(run_dir))[0]
    return _SINGLE[key]


@pytest.mark.parametrize(("world", "layout"), LAYOUTS, ids=[" ".join(lay) for _, lay in LAYOUTS])
def test_layouts_give_the_single_process_losses(world: int, layout: list[str], tmp_path: Path) -> None:
    tokens = _tokens()
    overrides = [*FP8, "train.micro_batch=2", *layout]
    single = [o for o in overrides if not o.startswith("parallel.")]
    ref = _single_losses(single, tmp_path / "ref")
    ours = run_distributed(_run, world, overrides, tokens, str(tmp_path / "run"), timeout=300)
    for losses in ours:
        tol = MOE_RTOL if MOE[0] in layout else WIDE_RTOL if "model.hidden_size=128" in layout else RTOL
        assert _rel(losses, ref) <= tol, (losses, ref)


def _split_linear_body(kind: str, recipe: str, reduce: bool) -> float:
    """One float8 linear split over two ranks (``column``/``row``: tensor parallelism; ``tokens``:
    context parallelism's token split) against the whole linear in one process, fp32 operands: the
    largest relative error (norm-wise) of the output, the weight gradient and the input gradient."""
    from zerotron.distributed import collectives
    from zerotron.parallel.tensor import ColumnParallelLinear, RowParallelLinear

    rank, world = current_rank_and_world()
    group = Mesh(ParallelDims(world, dp=1, tp=world), rank).group("tp")
    split = (group,) if reduce else ()  # without: the negative control, each rank scales its own piece
    k = group.rank_in_group
    gen = torch.Generator().manual_seed(5)
    full = torch.nn.Linear(32, 64, bias=False)
    with torch.no_grad():
        full.weight.copy_(torch.randn(64, 32, generator=gen) * torch.linspace(0.1, 3.0, 32))
    x = torch.randn(2, 16, 32, generator=gen) * torch.linspace(2.0, 0.2, 16)[:, None]
    r = torch.randn(2, 16, 64, generator=gen)
    ref = float8.Float8Linear.from_linear(full, float8.Float8Spec.create(recipe, True))
    x_ref = x.clone().requires_grad_()
    y_ref = ref(x_ref)
    (y_ref * r).sum().backward()
    assert full.weight.grad is not None
    w_ref, full.weight.grad = full.weight.grad.clone(), None
    out_rows, in_cols, toks = (
        slice(k * 32, (k + 1) * 32),
        slice(k * 16, (k + 1) * 16),
        slice(k * 8, (k + 1) * 8),
    )
    if kind == "column":
        layer: torch.nn.Module = ColumnParallelLinear(full, group)
        layer.float8 = float8.Float8Spec.create(recipe, True, outer=split)
        xin, want = x.clone().requires_grad_(), (y_ref[..., out_rows], w_ref[out_rows], x_ref.grad)
        y = layer(xin)
        (y * r[..., out_rows]).sum().backward()
    elif kind == "row":
        layer = RowParallelLinear(full, group)
        layer.float8 = float8.Float8Spec.create(recipe, True, inner=split)
        xin, want = (
            x[..., in_cols].clone().requires_grad_(),
            (y_ref, w_ref[:, in_cols], x_ref.grad[..., in_cols]),
        )
        y = layer(xin)
        (y * r).sum().backward()
    else:
        layer = float8.Float8Linear.from_linear(full, float8.Float8Spec.create(recipe, True, tokens=split))
        xin, want = x[:, toks].clone().requires_grad_(), (y_ref[:, toks], w_ref, x_ref.grad[:, toks])
        y = layer(xin)
        (y * r[:, toks]).sum().backward()
        collectives.all_reduce(layer.weight.grad, group)  # the token split's weight gradient, summed
    got = (y.detach(), layer.weight.grad, xin.grad)
    return max(float((a - b.detach()).norm() / b.norm()) for a, b in zip(got, want))


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
@pytest.mark.parametrize("kind", ["column", "row", "tokens"])
def test_split_linears_scale_as_the_whole_tensor(kind: str, recipe: str) -> None:
    """A float8 linear split over ranks equals the whole one (fp32 operands: only the summation order of
        the split GEMMs differs, ~1e-7); the negative control, per-shard scales, leaves that by orders of
        magnitude (every value of a split tensor on another float8 grid: ~1e-2). Rowwise scales are powers of
    two, and a power-of-two rescaling of an e4m3 value is exact away from the subnormals, so per-shard
    rowwise scales mostly give the same bits: there the control cannot discriminate and is not asserted."""
    same = max(run_distributed(_split_linear_body, 2, kind, recipe, True))
    assert same <= 1e-6, same
    if recipe == "tensorwise":
        per_shard = max(run_distributed(_split_linear_body, 2, kind, recipe, False))
        assert per_shard > 1e-3, per_shard


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_float8_linear_compiles_as_one_graph(recipe: str) -> None:
    """``torch.compile(fullgraph=True)`` traces a float8 linear's forward and backward without a graph
    break (a break at each cast once left a compiled fp8 step slower than the eager one on a GPU), with
    the eager layer's numbers."""
    torch.manual_seed(0)
    layer = float8.Float8Linear.from_linear(
        torch.nn.Linear(64, 32, bias=False), float8.Float8Spec.create(recipe, emulate=True)
    )
    x = torch.randn(48, 64)
    grads = []
    for run in (layer, torch.compile(layer, fullgraph=True, backend="aot_eager")):
        xin = x.clone().requires_grad_()
        layer.weight.grad = None
        y = run(xin)
        y.square().sum().backward()
        grads.append((y.detach(), xin.grad, layer.weight.grad))
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["train.fp8_recipe=blockwise"], "train.fp8_recipe"),
        (["train.precision=bf16", "train.fp8_recipe=rowwise"], "applies to train.precision=fp8"),
        (["model.hidden_size=72", "model.num_attention_heads=4"], "multiples of 16"),
        (["parallel.tp=4", "model.intermediate_size=96"], r"gate_proj multiplies \(64 in, 24 out\)"),
        (["train.precision=fp16", "train.fp8_skip=*.q_proj"], "applies to train.precision=fp8"),
        (["train.fp8_skip=*.qproj"], "pattern '\\*.qproj' matches no float8 layer"),
        (["parallel.zero_fp8_gather=sometimes"], "use one of auto, always, never"),
        (["parallel.zero_fp8_gather=always", "parallel.zero=2"], "it is ZeRO-3's"),
        (
            ["parallel.zero_fp8_gather=always", "parallel.zero=3", "train.precision=bf16"],
            "set train.precision=fp8",
        ),
        (
            ["parallel.zero_fp8_gather=always", "parallel.zero=3", "train.fp8_recipe=rowwise"],
            "rowwise casts the weight along a different axis",
        ),
    ],
)
def test_bad_fp8_settings_are_one_line(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        cfg = load_config(None, [*FP8, *overrides])
        validate(cfg, cfg.parallel.tp)


def test_routed_experts_compute_in_float8_unless_skipped() -> None:
    from zerotron.models.parallelize import parallelize_llama

    cfg = load_config(None, [*FP8, *MOE])
    validate(cfg, 1)
    model = parallelize_llama(cfg)
    experts = [m.float8_mlp for n, m in model.named_modules() if n.endswith("mlp.experts")]
    assert experts and all(e is not None and e.gate_up and e.down for e in experts)
    # train.fp8_skip keeps one of the two GEMMs in bf16
    skip = load_config(None, [*FP8, *MOE, "train.fp8_skip=*.experts.down_proj"])
    validate(skip, 1)
    kept = [m.float8_mlp for n, m in parallelize_llama(skip).named_modules() if n.endswith("mlp.experts")]
    assert all(e.gate_up is not None and e.down is None for e in kept)


def test_skipped_shapes_are_allowed_and_stay_bf16() -> None:
    from zerotron.models.parallelize import parallelize_llama
    from zerotron.parallel.float8 import Float8Linear

    overrides = [*FP8, "model.intermediate_size=72", "train.fp8_skip=*.gate_proj,*.up_proj,*.down_proj"]
    cfg = load_config(None, overrides)
    validate(cfg, 1)
    model = parallelize_llama(cfg)
    fp8 = {
        n.partition(".")[2].partition(".")[2] for n, m in model.named_modules() if isinstance(m, Float8Linear)
    }
    assert fp8 == {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj"}
    assert type(model.lm_head) is torch.nn.Linear


def test_fp8_under_torchrun_saves_fp32_masters_that_resume_in_bf16_and_back(tmp_path: Path) -> None:
    """The command line under torchrun (tp 2 + SP): an fp8 checkpoint resumes under bf16, and a bf16
    one under fp8 (checkpoints hold the fp32 masters; the precision is not part of them)."""
    from tests.test_launch_job import TRAIN, _steps, _torchrun

    run = tmp_path / "run"
    shape = [
        "model.hidden_size=64",
        "model.num_attention_heads=4",
        "model.num_key_value_heads=2",
        "model.intermediate_size=96",
    ]
    layout = [*shape, "parallel.tp=2", "parallel.sequence_parallel=true", "checkpoint.every=2"]
    first = _torchrun([*TRAIN[1:], *layout, "train.precision=fp8", "train.steps=2", "--out", str(run)])
    assert first.returncode == 0, first.stderr[-3000:]
    assert "fp8 |" in first.stdout
    again = _torchrun(
        [*TRAIN[1:], *layout, "train.precision=bf16", "train.steps=4", "--out", str(run), "--resume", "auto"]
    )
    assert again.returncode == 0, again.stderr[-3000:]
    back = _torchrun(
        [*TRAIN[1:], *layout, "train.precision=fp8", "train.steps=5", "--out", str(run), "--resume", "auto"]
    )
    assert back.returncode == 0, back.stderr[-3000:]
    assert "at step 4" in back.stdout
    assert _steps(run) == [1, 2, 3, 4, 5]


def test_deepspeed_fp8_keys_point_to_train_precision(tmp_path: Path) -> None:
    """DeepSpeed has no fp8 section (Transformer Engine's fp8 is switched on in model code): a config
    that carries one is refused in one line naming zerotron's key."""
    import json

    from zerotron.config_deepspeed import from_deepspeed

    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_batch_size": 8, "bf16": {"enabled": True}, "fp8": {"enabled": True}}))
    with pytest.raises(ConfigError, match=r"fp8 \(DeepSpeed has no fp8 section.*train.precision=fp8") as info:
        from_deepspeed(str(path), None, [], world_size=2)
    assert "\n" not in str(info.value)


def test_lora_keeps_an_fp8_base_in_float8(monkeypatch: pytest.MonkeyPatch) -> None:
    """LoRA and DoRA on an fp8 model: the frozen base's projections still multiply in float8 (each
    forward casts the same operands as the fp8 model's; at initialisation LoRA's B is zero, so its
    logits equal the fp8 model's exactly, and differ from bf16's)."""
    from zerotron.build.builder import build
    from zerotron.models.lora import LoraLinear

    casts: list[int] = []
    real = float8._cast
    monkeypatch.setattr(float8, "_cast", lambda *a: casts.append(1) or real(*a))
    tokens = torch.from_numpy(_tokens()[: 2 * 32].astype(np.int64)).reshape(2, 32)
    logits, counts = {}, {}
    cases = {"fp8": [], "lora": LORA, "dora": [*LORA, "lora.use_dora=true"], "bf16": ["train.precision=bf16"]}
    for name, extra in cases.items():
        cfg = load_config(None, [*FP8, *extra])
        model = build(cfg, "cpu").model
        if name in ("lora", "dora"):
            adapted = [m for m in model.modules() if isinstance(m, LoraLinear)]
            assert adapted and all(m.float8 is not None for m in adapted)
        casts.clear()
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            logits[name] = model(tokens).float()
        counts[name] = len(casts)
    assert counts == {"fp8": 2 * 7 * 2, "lora": 2 * 7 * 2, "dora": 2 * 7 * 2, "bf16": 0}  # 2 blocks x 7
    assert torch.equal(logits["lora"], logits["fp8"])
    assert not torch.equal(logits["fp8"], logits["bf16"])


def _logits_and_input_grad(model: torch.nn.Module, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The logits under bf16 autocast and the gradient of their mean square at the embeddings' output."""
    kept: dict[str, torch.Tensor] = {}

    def leaf(module: torch.nn.Module, args: object, out: torch.Tensor) -> torch.Tensor:
        kept["x"] = out.detach().requires_grad_(True)
        return kept["x"]

    handle = model.embed_tokens.register_forward_hook(leaf)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(tokens).float()
    out.square().mean().backward()
    handle.remove()
    return out.detach(), kept["x"].grad


def test_qlora_multiplies_its_nf4_base_in_float8() -> None:
    """QLoRA on an fp8 model: each frozen NF4 base projection multiplies in float8. At
    initialisation (B zero) the logits, and the input gradient backward makes with the weight
    dequantised again, equal those of the fp8 model whose projections hold the NF4 weights'
    dequantised values (NF4 of the same initial weights): the same float8 casts of the same weights. They differ from a bf16 QLoRA's."""
    from zerotron.build.builder import build
    from zerotron.models.nf4 import quantize_nf4

    tokens = torch.from_numpy(_tokens()[: 2 * 32].astype(np.int64)).reshape(2, 32)
    qlora = build(load_config(None, [*FP8, *QLORA]), "cpu").model
    bf16 = build(load_config(None, [*FP8, *QLORA, "train.precision=bf16"]), "cpu").model
    plain = build(load_config(None, FP8), "cpu").model
    with torch.no_grad():
        for module in plain.modules():
            if isinstance(module, float8.Float8Linear):
                module.weight.copy_(quantize_nf4(module.weight).dequantize())
    logits, grad = _logits_and_input_grad(qlora, tokens)
    ref_logits, ref_grad = _logits_and_input_grad(plain, tokens)
    assert torch.equal(logits, ref_logits)
    assert torch.equal(grad, ref_grad)
    assert not torch.equal(logits, _logits_and_input_grad(bf16, tokens)[0])


def test_compiled_fp8_equals_eager(tmp_path: Path) -> None:
    """``train.compile`` with fp8 (the float8 casts and GEMMs inside each compiled block) gives the eager
    fp8 losses: inductor fuses the bf16 norms and activations differently (bf16 compile moves these
    losses by ~1e-5) and float8's rounding amplifies that as a layout does, so the bound is ``RTOL``
    (measured 3.4e-5)."""
    tokens = _tokens()
    overrides = [*FP8, "train.micro_batch=8"]
    eager = run_distributed(_run, 1, overrides, tokens, str(tmp_path / "e"))[0]
    compiled = run_distributed(
        _run, 1, [*overrides, "train.compile=true"], tokens, str(tmp_path / "c"), timeout=600
    )
    assert _rel(compiled[0], eager) <= RTOL


def test_dpo_in_fp8_keeps_the_single_process_numbers(tmp_path: Path) -> None:
    """``zerotron dpo``'s step in fp8 (LoRA on a Hugging Face model, its reference pass in fp8 too):
    the policy starts as its reference (loss log 2), and dp 2 × ZeRO-2 gives the single process's
    reference log-probs and losses at the same micro-batch size."""
    from tests.test_dpo import _config, _model_dir, _pairs, _train_body, _write
    from zerotron.components.preference_data import prepare_preference
    from zerotron.models.tokenizer import ByteTokenizer

    base = _model_dir(tmp_path / "base", 3)  # hidden 48, 2 KV heads of 12: k/v_proj (24 out) stay bf16
    data = _write(tmp_path / "pairs.jsonl", _pairs(16))
    fp8 = [
        "train.precision=fp8",
        "train.fp8_skip=*.k_proj,*.v_proj",
        "train.global_batch=4",
        "train.micro_batch=1",
    ]
    one = _config(base, data, *fp8)
    validate(one, 1)
    rows = prepare_preference(one.data, ByteTokenizer(), one.train.seq_len, pad_id=257).rows
    ref = run_distributed(_train_body, 1, one, rows, str(tmp_path / "one"), 3)[0]
    many = _config(base, data, *fp8, "parallel.zero=2")
    validate(many, 2)
    got = run_distributed(_train_body, 2, many, rows, str(tmp_path / "many"), 3)[0]
    assert ref["losses"][0] == pytest.approx(np.log(2), abs=1e-6)
    np.testing.assert_allclose(got["reference"], ref["reference"], rtol=1e-6)
    assert _rel(got["losses"], ref["losses"]) <= RTOL
    assert ref["losses"][-1] < ref["losses"][0]


def test_zero3_nvme_offload_in_fp8(tmp_path: Path) -> None:
    """ZeRO-3 with parameters and optimizer in NVMe files (16-bit working copies written beside the
    fp32 masters) gives the single process's fp8 losses."""
    tokens = _tokens()
    (tmp_path / "nvme").mkdir()
    nvme = [
        "parallel.offload_params=nvme",
        "parallel.offload_optimizer=nvme",
        f"parallel.nvme_path={tmp_path / 'nvme'}",
    ]
    overrides = [*FP8, "train.micro_batch=2"]
    ref = run_distributed(_run, 1, overrides, tokens, str(tmp_path / "ref"))[0]
    layout = [*overrides, "parallel.dp=2", "parallel.zero=3", *nvme]
    ours = run_distributed(_run, 2, layout, tokens, str(tmp_path / "run"), timeout=300)
    for losses in ours:
        assert _rel(losses, ref) <= RTOL, (losses, ref)


def _run_gathers(overrides: list[str], tokens: np.ndarray, run_dir: str) -> tuple[list[float], list[int]]:
    """The losses and each step's all-gathered bytes over dp."""
    cfg = load_config(None, overrides)
    rank, world = current_rank_and_world()
    trainer = Trainer(cfg, Mesh(ParallelDims.from_config(cfg.parallel, world), rank), Path(run_dir), tokens)
    records = [trainer.train_step() for _ in range(STEPS)]
    gathered = [sum(ops.get("all_gather", 0) for ops in r["comm_bytes"].values()) for r in records]
    return [r["loss"] for r in records], gathered  # over dp, and edp for routed experts


@pytest.mark.parametrize(
    "layout",
    [
        ["parallel.dp=2"],
        ["parallel.dp=2", "parallel.offload_params=cpu", "parallel.offload_optimizer=cpu", *LORA],
        ["parallel.dp=2", *MOE],  # routed experts: each expert of a stack cast with its own scale
    ],
    ids=["dp2", "offload-lora", "moe"],
)
def test_zero3_float8_gathers_send_half_the_bytes_for_the_same_numbers(
    layout: list[str], tmp_path: Path
) -> None:
    """ZeRO-3's float8 gathers (cast with the whole weight's scale before the gather) give the bf16
    gathers' losses bit for bit, and the gathers of the float8 linears' weights move half the bytes.

    Counted here from the model's shape, not from the planner: with ``persist_numel`` 100 each block's
    sharded units are its projection matrices in both runs (the norms stay whole; the router stays
    bf16), gathered in forward and again in backward on every micro-batch, B(n-1)/n bytes a gather of
    B bytes."""
    tokens = _tokens()
    base = [*FP8, "train.micro_batch=2", "parallel.zero=3", "parallel.persist_numel=100", *layout]
    bf16 = run_distributed(
        _run_gathers, 2, [*base, "parallel.zero_fp8_gather=never"], tokens, str(tmp_path / "a")
    )
    fp8 = run_distributed(
        _run_gathers, 2, [*base, "parallel.zero_fp8_gather=always"], tokens, str(tmp_path / "b")
    )
    cfg = load_config(None, base)
    m = cfg.model
    h, kv = m.hidden_size, m.kv_heads * m.dim_per_head
    mlp = m.intermediate_size  # dense; MoE: the shared expert's and every routed expert's
    if m.num_local_experts:
        mlp = m.shared_expert_intermediate_size + m.num_local_experts * m.expert_intermediate
    matrices = m.num_hidden_layers * (2 * h * h + 2 * h * kv + 3 * h * mlp)
    passes = 2 * cfg.train.global_batch // (2 * cfg.train.micro_batch)  # forward + backward, per micro-batch
    saved = passes * matrices * (2 - 1) // 2  # a byte instead of two per element, half sent by each rank
    for (losses_bf16, sent_bf16), (losses_fp8, sent_fp8) in zip(bf16, fp8):
        assert losses_fp8 == losses_bf16
        assert all(a - b == saved for a, b in zip(sent_bf16, sent_fp8)), (sent_bf16, sent_fp8, saved)
        assert losses_fp8[-1] < losses_fp8[0]
