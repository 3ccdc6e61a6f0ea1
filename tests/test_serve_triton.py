"""The Triton paged-attention kernel (a GPU's attention in ``zerotron serve``) against references.

Without a GPU the kernel runs in Triton's interpreter (tests/conftest.py chooses it before Triton is
imported); with a CUDA device these tests run it compiled on the GPU. References: attention of each row
over its own keys written out with torch in fp32, transformers' ``generate``, and the engine's own
outputs alone vs batched (bit for bit).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Optional

import pytest
import torch

from tests import test_serve_engine
from tests.test_serve_engine import GREEDY, _prompts, _run, transformers_greedy
from zerotron.models.llama import LlamaForCausalLM
from zerotron.serve import kv_quant, triton_attention
from zerotron.serve.engine import Engine, EngineConfig
from zerotron.serve.linears import CHUNK_ROWS
from zerotron.serve.runner import StepRunner

if not triton_attention.available():  # the dev install has Triton on x86-64 Linux
    pytest.skip(f"Triton: {triton_attention.why_unavailable()}", allow_module_level=True)
pair = test_serve_engine.pair  # the engine tests' random Llama and its transformers twin
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _why_it_cannot_run() -> Optional[str]:
    """Why the kernel cannot run here (None: it can): on a GPU it compiles; without one it needs
    Triton's interpreter, chosen before Triton's import, of Triton 3.9 or later (earlier
    interpreters cannot loop to a bound the kernel loaded, as each row's key count is)."""
    if DEVICE.type != "cpu":
        return None
    if not triton_attention.interpreted():
        return "no GPU, and Triton was imported before TRITON_INTERPRET=1"
    import triton

    if tuple(int(x) for x in triton.__version__.split(".")[:2]) < (3, 9):
        return f"no GPU, and Triton {triton.__version__}'s interpreter cannot loop to a loaded bound"
    return None


WHY = _why_it_cannot_run()
runs = pytest.mark.skipif(WHY is not None, reason=str(WHY))  # the tests that run the kernel


def _reference(
    q: torch.Tensor,
    kp: torch.Tensor,
    vp: torch.Tensor,
    slots: torch.Tensor,
    lens: torch.Tensor,
    seq: torch.Tensor,
) -> torch.Tensor:
    """Each row's softmax(q k^T / sqrt(d)) v over its sequence's first ``lens`` keys, in fp64."""
    out = torch.empty(q.shape, dtype=torch.float64)
    group = q.shape[1] // kp.shape[1]
    for r in range(len(q)):
        take = slots[seq[r], : lens[r]]
        k = kp[take].double().repeat_interleave(group, dim=1)  # (n, heads, d)
        v = vp[take].double().repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,nhd->hn", q[r].double(), k) * q.shape[2] ** -0.5
        out[r] = torch.einsum("hn,nhd->hd", scores.softmax(-1), v)
    return out


def _problem(
    heads: int, kv_heads: int, dim: int, dtype: torch.dtype, lens: list[int], seed: int = 0
) -> tuple[torch.Tensor, ...]:
    """Random pools and queries; rows spread over three sequences whose slots are scattered."""
    g = torch.Generator().manual_seed(seed)
    pool_slots, width = 600, max(lens) + 7  # the width is not the longest row's: lists carry slack
    kp = torch.randn(pool_slots, kv_heads, dim, generator=g).to(dtype)
    vp = torch.randn(pool_slots, kv_heads, dim, generator=g).to(dtype)
    slots = torch.randperm(pool_slots, generator=g)[: 3 * width].view(3, width)
    seq = torch.arange(len(lens)) % 3
    q = torch.randn(len(lens), heads, dim, generator=g).to(dtype)
    return q, kp, vp, slots, torch.tensor(lens), seq


# GQA 2, SmolLM2's 3 (not a power of two), MHA with d 24, GQA 8 with d 128 (16-position key blocks)
SHAPES = [(4, 2, 16), (9, 3, 64), (6, 6, 24), (16, 2, 128)]
LENS = [1, 2, 63, 64, 65, 130, 17]  # one key, a block's end, past it, two blocks and a tail


@runs
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), SHAPES)
def test_kernel_equals_reference_attention(heads: int, kv_heads: int, dim: int, dtype: torch.dtype) -> None:
    q, kp, vp, slots, lens, seq = _problem(heads, kv_heads, dim, dtype, LENS)
    args = [t.to(DEVICE) for t in (q, kp, vp, slots, lens, seq)]
    got = triton_attention.paged_attention(*args).cpu()
    assert got.dtype == dtype and got.shape == q.shape
    want = _reference(q, kp, vp, slots, lens, seq)
    if dtype == torch.float32:
        torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-5)  # GPU: approximate exp
    else:  # one rounding to bf16 at the end: within a unit in the last place of the exact result
        ulp = torch.finfo(torch.bfloat16).eps * want.abs().clamp_min(2**-126)
        assert bool(((got.double() - want).abs() <= ulp).all())


@runs
@pytest.mark.parametrize("fmt", ["fp8", "fp8_e5m2", "int8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(9, 3, 64), (6, 6, 24)])
def test_kernel_reads_an_8bit_pool_in_place(
    fmt: str, dtype: torch.dtype, heads: int, kv_heads: int, dim: int
) -> None:
    """The kernel over an 8-bit pool's codes and scales gives, bit for bit, its output over the pool
    torch's :func:`~zerotron.serve.kv_quant.dequantize` makes in the model's dtype (vectors of amax
    1e-3 to 1e2, an all-zero one, fp8's subnormal codes among them)."""
    q, kp, vp, slots, lens, seq = _problem(heads, kv_heads, dim, dtype, LENS, seed=3)
    scale = torch.logspace(-3, 2, kp.shape[0])[:, None, None]
    pools, dense = [], []
    for x in (kp, vp):
        x = (x.float() * scale).to(dtype)
        x[int(slots[0, 0])] = 0
        pool = kv_quant.QuantizedKV(x.shape[0], kv_heads, dim, fmt, dtype, DEVICE)
        pool.store(torch.arange(x.shape[0], device=DEVICE), x.to(DEVICE))
        pools.append(pool)
        dense.append(kv_quant.dequantize(pool.codes, pool.scales, fmt, dtype))
    rows = [t.to(DEVICE) for t in (q, slots, lens, seq)]
    got = triton_attention.paged_attention(rows[0], pools[0], pools[1], *rows[1:])
    assert torch.equal(got, triton_attention.paged_attention(rows[0], dense[0], dense[1], *rows[1:]))


@runs
def test_rows_are_batch_invariant() -> None:
    """A row's bits do not depend on the call: alone, among others, in another order, or with slot
    lists of another width (a width changes every step; the kernel does not specialise on it)."""
    q, kp, vp, slots, lens, seq = (t.to(DEVICE) for t in _problem(9, 3, 64, torch.bfloat16, LENS, seed=1))
    whole = triton_attention.paged_attention(q, kp, vp, slots, lens, seq)
    order = torch.randperm(len(q), generator=torch.Generator().manual_seed(2)).to(DEVICE)
    permuted = triton_attention.paged_attention(q[order], kp, vp, slots, lens[order], seq[order])
    assert torch.equal(permuted, whole[order])
    wider = torch.cat([slots, slots[:, :40]], dim=1)  # 40 more columns, never read
    for r in range(len(q)):
        alone = triton_attention.paged_attention(q[r : r + 1], kp, vp, slots, lens[r : r + 1], seq[r : r + 1])
        assert torch.equal(alone[0], whole[r]), r
        own = wider[seq[r] : seq[r] + 1]  # its sequence's list only, wider
        zero = torch.zeros(1, dtype=torch.long, device=DEVICE)
        assert torch.equal(
            triton_attention.paged_attention(q[r : r + 1], kp, vp, own, lens[r : r + 1], zero)[0], whole[r]
        )


@runs
def test_bad_calls_are_refused() -> None:
    q, kp, vp, slots, lens, seq = _problem(4, 2, 16, torch.float32, [3, 5])
    with pytest.raises(ValueError, match="one dtype"):
        triton_attention.paged_attention(q.double(), kp, vp, slots, lens, seq)
    with pytest.raises(ValueError, match="shapes"):
        triton_attention.paged_attention(q[:, :3], kp, vp, slots, lens, seq)


# ---- the engine with Triton attention -----------------------------------------------------------------
# Off the CPU the engine runs fixed-shape linears and the Triton kernel: ``fixed`` is that
# configuration (32-row calls here, 256 by default on a GPU); the other case keeps torch's F.linear.
# The engine's model is a copy on the test's device (a GPU where there is one), which it owns.


@pytest.fixture
def engine_factory(pair: tuple[torch.nn.Module, LlamaForCausalLM]) -> Iterator[Callable[..., Engine]]:
    engines: list[Engine] = []

    def make(**kw: object) -> Engine:
        model = copy.deepcopy(pair[1]).to(DEVICE)
        engines.append(
            Engine(model, None, EngineConfig(**{"num_blocks": 128, "triton_attention": True, **kw}))
        )  # type: ignore[arg-type]
        return engines[-1]

    yield make
    for e in engines:
        assert e.pool.in_use == 0 and not e.scheduler.running and not e.scheduler.waiting


@runs
@pytest.mark.parametrize("fixed", [True, False], ids=["fixed-32", "F.linear"])
def test_engine_greedy_equals_transformers_generate(
    pair: tuple[torch.nn.Module, LlamaForCausalLM],
    engine_factory: Callable[..., Engine],
    fixed: bool,
) -> None:
    ref, _ = pair
    prompts = _prompts([5, 40, 70], seed=3)
    engine = engine_factory(max_num_batched_tokens=48, fixed_rows=CHUNK_ROWS if fixed else 0)
    got = _run(engine, prompts, dataclasses.replace(GREEDY, max_tokens=12))
    for prompt, (tokens, _) in zip(prompts, got):
        assert tokens == transformers_greedy(ref, prompt, 12)


@runs
def test_engine_is_batch_invariant_alone_batched_chunked_cached_and_resumed(
    engine_factory: Callable[..., Engine],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Fixed-shape linears and Triton attention (a GPU's engine): a greedy request's tokens and
    log-probabilities are bit-identical alone, batched with its prompt in chunks, on a prefix-cache
    hit, and after preemption and recomputation (every row computed alone: a prompt row as a decode).
    Every row goes to the Triton kernel: no SDPA call."""
    import torch.nn.functional as F

    sdpa = F.scaled_dot_product_attention
    sdpa_calls: list[int] = []
    monkeypatch.setattr(
        F, "scaled_dot_product_attention", lambda *a, **kw: sdpa_calls.append(1) or sdpa(*a, **kw)
    )
    calls: list[int] = []
    kernel = triton_attention.paged_attention
    monkeypatch.setattr(
        triton_attention, "paged_attention", lambda q, *a: calls.append(len(q)) or kernel(q, *a)
    )
    params = dataclasses.replace(GREEDY, max_tokens=10)
    prompts = _prompts([70, 9, 33], seed=5)
    make = functools.partial(engine_factory, fixed_rows=CHUNK_ROWS)
    alone = [_run(make(), [p], params)[0] for p in prompts]
    assert _run(make(max_num_batched_tokens=23), prompts, params) == alone
    engine = make()
    _run(engine, prompts[:1], params)
    hits = engine.pool.hits
    assert _run(engine, prompts[:2], params) == alone[:2] and engine.pool.hits > hits
    shorter, longer = _prompts([20, 21, 22], seed=6), dataclasses.replace(params, max_tokens=30)
    ample = _run(make(), shorter, longer)
    tight = make(num_blocks=9, block_size=16, max_model_len=64)  # 8 blocks for three sequences of 4
    assert _run(tight, shorter, longer) == ample and tight.scheduler.preemptions > 0
    assert calls and not sdpa_calls


@runs
def test_runner_refuses_triton_beside_native_and_on_a_cpu_without_the_interpreter(
    pair: tuple[torch.nn.Module, LlamaForCausalLM],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from zerotron.serve.engine import EngineConfig, build_kv_pool

    _, model = pair
    _, kv = build_kv_pool(model, EngineConfig(num_blocks=8, max_model_len=64))
    with pytest.raises(ValueError, match="exclude each other"):
        StepRunner(model, kv, EngineConfig(native_attention=True, triton_attention=True))  # type: ignore[arg-type]
    if DEVICE.type == "cpu":
        monkeypatch.setattr(triton_attention, "interpreted", lambda: False)
        with pytest.raises(ValueError, match="runs on CUDA devices"):
            StepRunner(model, kv, EngineConfig(triton_attention=True))  # type: ignore[arg-type]


_COMPILE = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from zerotron.serve import triton_attention as ta

kernel = ta._kernel
assert type(kernel).__name__ == "JITFunction", type(kernel)
shapes = ((3, 64), (1, 128), (8, 128), (4, 24))  # (query heads per KV head, head dim)
cases = [(90, dtype, group, dim, 0) for dtype in ("fp32", "bf16", "fp16") for group, dim in shapes]
# 8-bit pools: fp8 e4m3 (1), e5m2 (2), int8 (3)
cases += [(90, "bf16", 3, 64, 1), (90, "bf16", 3, 64, 3), (90, "fp32", 4, 24, 2), (80, "fp16", 1, 128, 1)]
for arch, dtype, group, dim, fmt in cases + [(80, "bf16", 3, 64, 0)]:
    pool = "*" + dtype if fmt == 0 else "*i8" if fmt == 3 else "*u8"
    scales = pool if fmt == 0 else "*fp32"
    tensors = ("*" + dtype, pool, pool, "*" + dtype, scales, scales)
    sig = {"tensors": tensors, "rows": ("*i64",) * 3, "scale": "fp32", "width": "i32"}
    group_p, dim_p = ta._pow2(group), ta._pow2(dim)
    shape = (group, group_p, dim, dim_p, ta._block(group_p, dim_p), 2, fmt)  # two KV heads
    sig["SHAPE"] = "constexpr"
    where = {(kernel.arg_names.index("SHAPE"),): shape}
    done = triton.compile(ASTSource(kernel, sig, where), target=GPUTarget("cuda", arch, 32))
    assert "cubin" in done.asm, (arch, dtype, group, dim, fmt)
print("compiled")
"""


def test_kernel_compiles_for_cuda_gpus() -> None:
    """The interpreter runs Python, not Triton's compiler, which rejects more (an annotation it cannot
    read, a construct it does not lower): compile the kernel to a cubin for sm_90 (H100) for each
    dtype and several (group, head dim) shapes, over 16-bit and 8-bit pools, and for sm_80 (A100); no
    GPU is needed."""
    import os
    import subprocess
    import sys

    from triton.backends import backends

    if "nvidia" not in backends:
        pytest.skip("this Triton build has no CUDA backend")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    done = subprocess.run(
        [sys.executable, "-c", _COMPILE], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0 and "compiled" in done.stdout, done.stderr[-3000:]


# ---- tensor parallelism with the GPU's configuration ---------------------------------------------------
# ``zerotron serve --device cuda --nproc N``: every rank a shard on its own GPU, fixed-shape linears,
# Triton attention, plans and activations over NCCL. Here the same engine runs on Gloo ranks of the CPU
# with the kernel interpreted (on a machine with N GPUs: on them, over NCCL). A model of 6 heads over 3
# KV heads, so that 3 ranks split it; with 3 ranks the order in which partial sums are added matters.
TP_CFG = dataclasses.replace(
    test_serve_engine.CFG, hidden_size=96, num_attention_heads=6, num_key_value_heads=3, intermediate_size=96
)
TP_PROMPTS = ([70, 9, 33], 5)  # lengths, seed


def _tp_serve(model_dir: str, fixed_rows: int) -> list[list[tuple[list[int], list[float]]]]:
    """One rank of a tensor-parallel engine (its shard, loaded as ``zerotron serve`` loads it, on its
    device): the first rank runs the prompts alone, batched in chunks of a 23-token budget, and again
    on a prefix-cache hit, then stops the others, which follow its plans; returns the first rank's
    three runs."""
    from zerotron.build.builder import load_model
    from zerotron.distributed.launch import current_rank_and_world
    from zerotron.distributed.mesh import Mesh, ParallelDims
    from zerotron.serve.devices import rank_device

    rank, world = current_rank_and_world()
    mesh = Mesh(ParallelDims(world, dp=1, tp=world), rank)
    group = mesh.group("tp")
    model, _ = load_model(model_dir, torch.float32, rank_device(str(DEVICE)), mesh)
    config = EngineConfig(num_blocks=128, triton_attention=True, fixed_rows=fixed_rows)
    budgets = (2048, 23)
    engines = [
        Engine(model, None, dataclasses.replace(config, max_num_batched_tokens=b), group) for b in budgets
    ]
    order = (0, 1, 0)  # alone, batched, cached: the others follow each engine until the first stops it
    if group.rank_in_group != 0:
        for i in order:
            engines[i].runner.follow()
        return []
    params = dataclasses.replace(GREEDY, max_tokens=10)
    prompts = _prompts(*TP_PROMPTS)
    alone = [_run(engines[0], [p], params)[0] for p in prompts]
    engines[0].runner.publish(None, stop=True)
    batched = _run(engines[1], prompts, params)
    engines[1].runner.publish(None, stop=True)
    hits = engines[0].pool.hits
    cached = _run(engines[0], prompts, params)
    assert engines[0].pool.hits > hits
    engines[0].runner.publish(None, stop=True)
    return [alone, batched, cached]


@runs
@pytest.mark.parametrize("fixed_rows", [CHUNK_ROWS, 0], ids=["fixed-32", "F.linear"])
def test_tensor_parallel_engine_with_triton_attention(tmp_path: Path, fixed_rows: int) -> None:
    """3 tensor-parallel ranks with the GPU's configuration (Triton attention; linears in fixed 32-row
    calls, or torch's F.linear): greedy tokens equal transformers' ``generate``, and tokens and
    log-probabilities are bit-identical alone, batched and on a prefix-cache hit (the row-parallel
    partial sums are added in rank order after an all-gather). Whole F.linear calls are bit-identical
    across batches on the CPU (fp32, 16 rows at least), not on a GPU, whose matrix library chooses
    its kernel by the row count (the reason for the fixed calls there): on GPUs that variant is held
    to transformers' tokens only."""
    from zerotron.distributed.launch import spawn

    world = 3
    if DEVICE.type == "cuda" and torch.cuda.device_count() < world:
        pytest.skip(
            f"{world} tensor-parallel ranks need {world} GPUs; this machine has {torch.cuda.device_count()}"
        )
    ref = test_serve_engine.sharpened_pair(TP_CFG)[0]
    ref.save_pretrained(tmp_path)  # a Hugging Face directory, read shard by shard by every rank
    backend = "nccl" if DEVICE.type == "cuda" else "gloo"
    runs_ = spawn(
        _tp_serve,
        world,
        args=(str(tmp_path), fixed_rows),
        timeout_s=600,
        backend=backend,
        start_method="forkserver",
    )
    alone, batched, cached = runs_[0]
    if fixed_rows or DEVICE.type == "cpu":
        assert batched == alone and cached == alone
    for prompt, (tokens, _) in zip(_prompts(*TP_PROMPTS), alone):
        assert tokens == transformers_greedy(ref, prompt, 10)
