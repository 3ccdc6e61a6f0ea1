"""The quantised KV cache (``--kv-cache-dtype fp8 | fp8_e5m2 | int8``) against references.

References: the model's whole-sequence forward through a cache written here that rounds every key and
value vector to the format with torch's own casts (amax scaling per token and KV head) and attends with
plain causal SDPA — the engine's tokens and log-probabilities must be that model's; the engine with a
16-bit cache (block counts, bytes per sequence); the engine alone (batch invariance, prefix caching).
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Optional

import pytest
import torch
import torch.nn.functional as F

from tests.test_serve_engine import CFG, GREEDY, _prompts, _run, sharpened_pair
from zerotron.components.sampling import SamplingParams
from zerotron.serve import kernels, paged
from zerotron.serve.config import EngineConfigError
from zerotron.serve.engine import Engine, EngineConfig
from zerotron.serve.kv_quant import QuantizedKV, dequantize, quantize
from zerotron.serve.paged import KVPool
from zerotron.serve.server import EngineLoop

# the format's cast and its largest value, written out here (not read from zerotron.serve.kv_quant)
ROUNDING = {
    "fp8": (torch.float8_e4m3fn, 448.0),
    "fp8_e5m2": (torch.float8_e5m2, 57344.0),
    "int8": (None, 127.0),
}


def _rounded(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """Each vector of ``x`` (..., d) as the format stores it: scaled by its amax, cast, scaled back."""
    cast, top = ROUNDING[fmt]
    x = x.float()
    scale = x.abs().amax(-1, keepdim=True) / top
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    y = (x / scale).round().clamp(-127, 127) if cast is None else (x / scale).to(cast).float()
    return y * scale


class RoundedCache:
    """A whole-sequence cache for the model: keys and values rounded to ``fmt``, causal SDPA."""

    length = 0

    def __init__(self, fmt: str) -> None:
        self.fmt = fmt

    def attend(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        attn_mask: Optional[torch.Tensor],
        core: torch.nn.Module,
    ) -> torch.Tensor:
        k, v = (_rounded(t, self.fmt).to(q.dtype) for t in (k, v))
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return sharpened_pair(CFG)[1]


@pytest.mark.parametrize("fmt", ["fp8", "fp8_e5m2", "int8"])
def test_codes_round_each_vector_alone(fmt: str) -> None:
    torch.manual_seed(0)
    x = torch.randn(40, 3, 16) * torch.logspace(-3, 2, 40)[:, None, None]
    x[5, 1] = 0  # an all-zero vector keeps scale 1 and zero codes
    codes, scales = quantize(x, fmt)
    assert codes.dtype in (torch.uint8, torch.int8) and scales.shape == (40, 3)
    back = dequantize(codes, scales, fmt, torch.float32)
    torch.testing.assert_close(back, _rounded(x, fmt), rtol=0, atol=0)
    assert torch.equal(back[5, 1], torch.zeros(16))
    one, _ = quantize(x[7:9], fmt)  # a vector's codes are its own, in any batch
    assert torch.equal(one, codes[7:9])
    worst = {"fp8": 2**-4, "fp8_e5m2": 2**-3, "int8": 1 / 254}[fmt]  # half a step, relative to amax
    assert ((back - x).abs() <= worst * x.abs().amax(-1, keepdim=True) + 1e-12).all()


KERNELS = {
    "sdpa": {},
    "native": dict(native_attention=True),
    "onednn-lean-native": dict(onednn=True, native_attention=True),  # the lean fused decoder layer
}


@pytest.mark.parametrize("fmt", ["fp8", "int8"])
@pytest.mark.parametrize("kind", list(KERNELS))
def test_engine_gives_the_rounded_models_tokens_alone_and_batched(
    model: torch.nn.Module, fmt: str, kind: str
) -> None:
    native = KERNELS[kind]
    if native and not kernels.available():
        pytest.skip(f"the native attention kernel is not built here ({kernels.why_unavailable()})")
    prompts = _prompts([5, 17, 40, 9], seed=21)
    params = dataclasses.replace(GREEDY, max_tokens=16)
    engine = Engine(copy.deepcopy(model), None, EngineConfig(num_blocks=64, kv_cache_dtype=fmt, **native))
    together = _run(engine, prompts, params)
    assert together == [_run(engine, [p], params)[0] for p in prompts]  # bit for bit, alone or batched
    for prompt, (tokens, logps) in zip(prompts, together):
        with torch.no_grad():
            logits = model(torch.tensor([prompt + tokens]), kv_cache=RoundedCache(fmt))[0].float()
        ref = torch.log_softmax(logits[len(prompt) - 1 : -1], -1)
        assert ref.argmax(-1).tolist() == tokens
        torch.testing.assert_close(torch.tensor(logps), ref.max(-1).values, rtol=0, atol=1e-5)
    plain = Engine(copy.deepcopy(model), None, EngineConfig(num_blocks=64, **native))
    assert [t for t, _ in _run(plain, prompts, params)] != [t for t, _ in together]  # rounding shows


IN_PLACE_CASES = [
    (kernel, dtype, shape)
    for kernel in ("tiles", "dot", "fp32")
    for dtype in ((torch.bfloat16,) if kernel != "fp32" else (torch.float32, torch.bfloat16, torch.float16))
    for shape in ((9, 3, 64), (8, 2, 128)) + (((4, 2, 24),) if kernel == "fp32" else ())
]


def test_gpu_kernel_engine_reads_its_codes_in_place(
    model: torch.nn.Module, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine on the GPU's Triton kernel (here in Triton's interpreter) hands it the 8-bit pool
    itself, and gives the rounded model's tokens and log-probabilities, alone and batched (a smaller
    run of the test above: the interpreter is slow)."""
    from tests.test_serve_triton import WHY

    if WHY is not None:
        pytest.skip(str(WHY))
    from zerotron.serve import triton_attention

    reads = []
    real = triton_attention.paged_attention
    monkeypatch.setattr(
        triton_attention,
        "paged_attention",
        lambda q, k, *a, **kw: reads.append(type(k)) or real(q, k, *a, **kw),
    )
    prompts = _prompts([5, 11], seed=23)
    params = dataclasses.replace(GREEDY, max_tokens=4)
    engine = Engine(
        copy.deepcopy(model), None, EngineConfig(num_blocks=64, kv_cache_dtype="fp8", triton_attention=True)
    )
    together = _run(engine, prompts, params)
    assert set(reads) == {QuantizedKV}
    assert together == [_run(engine, [p], params)[0] for p in prompts]
    for prompt, (tokens, logps) in zip(prompts, together):
        with torch.no_grad():
            logits = model(torch.tensor([prompt + tokens]), kv_cache=RoundedCache("fp8"))[0].float()
        ref = torch.log_softmax(logits[len(prompt) - 1 : -1], -1)
        assert ref.argmax(-1).tolist() == tokens
        torch.testing.assert_close(torch.tensor(logps), ref.max(-1).values, rtol=0, atol=1e-5)


@pytest.mark.parametrize("fmt", ["fp8", "fp8_e5m2", "int8"])
@pytest.mark.parametrize(("kernel", "dtype", "shape"), IN_PLACE_CASES)
def test_native_kernel_reads_the_codes_in_place(
    fmt: str, kernel: str, dtype: torch.dtype, shape: tuple[int, int, int]
) -> None:
    """Each native attention kernel reads an 8-bit pool's codes and scales where they lie: bit for
    bit its output over a pool of the model's dtype holding the vectors rounded here (torch's casts,
    then the dtype) — the tile and dot kernels on bf16 rows, the fp32 kernel on fp32, bf16 and fp16
    rows (heads of 64 and 128 on AVX-512, of 24 in its generic loop) — on scattered slots, rows of
    different lengths, vectors of amax 1e-3 to 1e2 and an all-zero one; a scale changed moves exactly
    the rows that read its slot."""
    heads, kv_heads, dim = shape
    if not kernels.available():
        pytest.skip(f"the native attention kernel is not built here ({kernels.why_unavailable()})")
    why = {"tiles": kernels.why_no_tiles, "dot": kernels.why_no_dot, "fp32": lambda: None}[kernel]()
    if why is not None:
        pytest.skip(f"no {kernel} attention here: {why}")
    g = torch.Generator().manual_seed(dim + heads)
    pool_slots, lists, width = 640, 5, 96
    pools = []
    for _ in range(2):
        x = (
            torch.randn(pool_slots, kv_heads, dim, generator=g)
            * torch.logspace(-3, 2, pool_slots)[:, None, None]
        )
        x[7] = 0
        pool = QuantizedKV(pool_slots, kv_heads, dim, fmt, dtype, "cpu")
        pool.store(torch.arange(pool_slots), x.to(dtype))
        pools.append((pool, _rounded(x.to(dtype), fmt).to(dtype)))
    (k, k_dense), (v, v_dense) = pools
    slots = torch.stack([torch.randperm(pool_slots, generator=g)[:width] for _ in range(lists)])
    slots[0, 3] = 7
    seq = torch.tensor([0, 1, 2] + [3] * 20 + [4, 0])
    lens = torch.cat([torch.tensor([1, 40, 96]), torch.arange(1, 21), torch.tensor([64, 5])])
    q = torch.randn(len(seq), heads, dim, generator=g).to(dtype)
    got = kernels.paged_attention(q, k, v, slots, lens, seq, kernel=kernel)
    assert torch.equal(got, kernels.paged_attention(q, k_dense, v_dense, slots, lens, seq, kernel=kernel))
    moved = slots[1, :40].max()  # a slot of row 1's keys, of the larger vectors
    k.scales[moved] *= 1.5
    v.scales[moved] *= 1.5
    changed = (kernels.paged_attention(q, k, v, slots, lens, seq, kernel=kernel) != got).flatten(1).any(1)
    reads = torch.tensor([bool((slots[s, : int(n)] == moved).any()) for s, n in zip(seq, lens)])
    assert torch.equal(changed, reads) and reads.any()


@pytest.mark.parametrize("fmt", ["fp8", "fp8_e5m2", "int8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(9, 3, 64), (4, 2, 128), (2, 1, 24)])
def test_native_pass_stores_the_codes_torch_rounds(
    fmt: str, dtype: torch.dtype, shape: tuple[int, int, int]
) -> None:
    """The native pass of a packed step (``kernels.rope_store`` over an 8-bit pool: rotary embedding,
    then each k and v vector quantised and stored at its row's slot) stores the vectors torch's own
    rotation and casts give: the dequantised codes equal the test's rounding of torch's rotated k and
    of v bit for bit (vectors of amax 1e-30 to 1e5, 1e-7 to 1e3 in fp16, fp8's subnormal codes
    included, and all-zero ones), the rotated q equals torch's, and the slots no row names keep their
    codes; fp32, bf16 and fp16 rows."""
    from zerotron.models.llama import apply_rotary

    if not kernels.available():
        pytest.skip(f"the native attention kernel is not built here ({kernels.why_unavailable()})")
    heads, kv_heads, dim = shape
    g = torch.Generator().manual_seed(dim + heads)
    rows, pool_slots = 37, 100
    low, high = (-7, 3) if dtype == torch.float16 else (-30, 5)  # inside fp16's range
    y = (
        torch.randn(rows, (heads + 2 * kv_heads) * dim, generator=g)
        * torch.logspace(low, high, rows)[:, None]
    )
    y[3] = 0
    y[4, heads * dim : (heads + 1) * dim] = 0  # one k vector all zero
    y = y.to(dtype)
    angle = torch.rand(rows, dim // 2, generator=g) * 6
    cos, sin = (torch.cat([f(angle), f(angle)], 1).to(dtype) for f in (torch.cos, torch.sin))
    slots = torch.randperm(pool_slots, generator=g)[:rows]
    k = QuantizedKV(pool_slots, kv_heads, dim, fmt, dtype, "cpu")
    v = QuantizedKV(pool_slots, kv_heads, dim, fmt, dtype, "cpu")
    q = kernels.rope_store(y, cos, sin, k, v, slots, heads)
    qk = apply_rotary(
        y[:, : (heads + kv_heads) * dim].view(1, rows, -1, dim), cos[None, :, None], sin[None, :, None]
    )
    assert torch.equal(q, qk[0, :, :heads])
    want_k = _rounded(qk[0, :, heads:], fmt)
    want_v = _rounded(y[:, (heads + kv_heads) * dim :].view(rows, kv_heads, dim), fmt)
    for pool, want in ((k, want_k), (v, want_v)):
        got = dequantize(pool.codes[slots], pool.scales[slots], fmt, torch.float32)
        assert torch.equal(got, want)
        untouched = torch.ones(pool_slots, dtype=torch.bool)
        untouched[slots] = False
        assert not pool.codes[untouched].any() and torch.equal(
            pool.scales[untouched], torch.ones(63, kv_heads)
        )
    assert torch.equal(k.scales[slots[3]], torch.ones(kv_heads))  # all-zero vectors keep scale 1


@pytest.mark.parametrize("fmt", ["fp8", "int8"])
@pytest.mark.parametrize("activations", [False, True], ids=["fp32-rows", "int8-rows"])
def test_quantised_layers_step_in_one_native_call_over_an_8bit_pool(
    model: torch.nn.Module, fmt: str, activations: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A model of quantised linears (int4, on the native kernels) over an 8-bit cache runs each decoder
    layer of a packed step in one native call (``kernels.q8_layer``, its keys and values quantised
    there), and gives the tokens and log-probabilities of the same quantised model's whole-sequence
    forward over the test's rounded cache (torch's casts, causal SDPA), alone and batched."""
    from zerotron.models.llama import DecoderLayer
    from zerotron.serve import linear_kernels
    from zerotron.serve.linears import _LeanLayer

    if not kernels.available() or linear_kernels.why_no_native_matmul(torch.float32) is not None:
        pytest.skip("the lean quantised layers need the native kernels (AVX-512)")
    if activations and linear_kernels.why_no_q8a8() is not None:
        pytest.skip(str(linear_kernels.why_no_q8a8()))
    config = EngineConfig(
        num_blocks=64,
        kv_cache_dtype=fmt,
        quantization="int4",
        quantize_activations=activations,
        native_attention=True,
        native_matmul=True,
    )
    engine = Engine(copy.deepcopy(model), None, config)
    lean = [m.__dict__.get("forward") for m in engine.model.modules() if isinstance(m, DecoderLayer)]
    assert lean and all(isinstance(f, _LeanLayer) and f.whole is not None for f in lean)
    calls: list[int] = []
    whole_layer = kernels.q8_layer
    monkeypatch.setattr(kernels, "q8_layer", lambda *a: calls.append(1) or whole_layer(*a))
    prompts = _prompts([5, 17, 40, 9], seed=23)
    params = dataclasses.replace(GREEDY, max_tokens=12)
    together = _run(engine, prompts, params)
    assert len(calls) >= len(lean) * params.max_tokens
    assert together == [_run(engine, [p], params)[0] for p in prompts]
    # 8-bit rows: the native attention and SDPA differ in fp32 rounding, and an input within that of a
    # rounding boundary of its block of 32 rounds to the next integer on one side alone (a quantum of
    # the block: about 1% of a log-probability here); fp32 rows agree to fp32 rounding
    atol = 3e-2 if activations else 1e-5
    for prompt, (tokens, logps) in zip(prompts, together):
        with torch.no_grad():
            logits = engine.model(torch.tensor([prompt + tokens]), kv_cache=RoundedCache(fmt))[0].float()
        ref = torch.log_softmax(logits[len(prompt) - 1 : -1], -1)
        assert ref.argmax(-1).tolist() == tokens
        torch.testing.assert_close(torch.tensor(logps), ref.max(-1).values, rtol=0, atol=atol)


@pytest.mark.parametrize("fmt", ["fp8", "int8"])
@pytest.mark.parametrize("kernel", ["tiles", "dot"])
def test_a_long_decode_on_tiles_reads_the_codes_in_place(fmt: str, kernel: str) -> None:
    """At 1,024 keys or more a decode on the tile kernel (64 or more on the dot kernel) is streamed
    chunk by chunk instead of packed for its whole slot list; from an 8-bit pool its codes and scales
    are copied chunk by chunk, runs of consecutive slots at once (half the slots here lie in runs):
    bit for bit the decode over the bf16 pool of the rounded vectors (which is copied the same way),
    and the bits the same row gets as one of its prompt's rows (packed)."""
    if not kernels.available():
        pytest.skip(f"the native attention kernel is not built here ({kernels.why_unavailable()})")
    why = kernels.why_no_tiles() if kernel == "tiles" else kernels.why_no_dot()
    if why is not None:
        pytest.skip(f"no {kernel} attention here: {why}")
    heads, kv_heads, dim, n, pool_slots = 9, 3, 64, 1100, 1200
    g = torch.Generator().manual_seed(n)
    pools = []
    for _ in range(2):
        x = torch.randn(pool_slots, kv_heads, dim, generator=g)  # no key of negligible weight
        pool = QuantizedKV(pool_slots, kv_heads, dim, fmt, torch.bfloat16, "cpu")
        pool.store(torch.arange(pool_slots), x.bfloat16())
        pools.append((pool, _rounded(x.bfloat16(), fmt).bfloat16()))
    (k, k_dense), (v, v_dense) = pools
    run = torch.arange(50, 50 + n // 2)  # a run of consecutive slots, then scattered ones
    rest = torch.randperm(pool_slots, generator=g)
    rest = rest[(rest < 50) | (rest >= 50 + n // 2)][: n - n // 2]
    slots = torch.cat([run, rest]).view(1, n).contiguous()
    q = torch.randn(n, heads, dim, generator=g).bfloat16()
    lens, seq = torch.arange(1, n + 1), torch.zeros(n, dtype=torch.long)
    prompt = kernels.paged_attention(q, k, v, slots, lens, seq, kernel=kernel)
    for r in (70, 1023, n - 1):  # decodes on the stream path (the dot kernel's from 64 keys)
        row = slice(r, r + 1)
        alone = kernels.paged_attention(q[row], k, v, slots, lens[row], seq[row], kernel=kernel)
        assert torch.equal(alone, prompt[row])
        dense = kernels.paged_attention(q[row], k_dense, v_dense, slots, lens[row], seq[row], kernel=kernel)
        assert torch.equal(alone, dense)


@pytest.mark.parametrize("fmt", ["fp8", "int8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_engine_reads_its_codes_in_place(
    fmt: str, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A model of 64-dim heads on the native attention (fp32: the fp32 kernel; bf16: tiles or dot
    where the CPU has them) reads its 8-bit cache in place (no dequantised copy): the same tokens and
    log-probabilities as the engine that gathers and dequantises the slots each step, alone and
    batched."""
    if not kernels.available():
        pytest.skip(f"the native attention kernel is not built here ({kernels.why_unavailable()})")
    cfg = dataclasses.replace(CFG, hidden_size=128, num_attention_heads=2, num_key_value_heads=1)
    served = sharpened_pair(cfg)[1].to(dtype)
    prompts = _prompts([5, 17, 40, 9], seed=22)
    params = dataclasses.replace(GREEDY, max_tokens=12)
    config = EngineConfig(num_blocks=64, kv_cache_dtype=fmt, native_attention=True)
    reads = []
    real = kernels.paged_attention
    monkeypatch.setattr(
        kernels, "paged_attention", lambda q, k, *a, **kw: reads.append(type(k)) or real(q, k, *a, **kw)
    )
    together = _run(Engine(copy.deepcopy(served), None, config), prompts, params)
    assert set(reads) == {QuantizedKV}
    alone = [_run(Engine(copy.deepcopy(served), None, config), [p], params)[0] for p in prompts]
    monkeypatch.setattr(paged, "gathers", lambda pool, native: pool.fmt is not None)
    reads.clear()
    gathered = _run(Engine(copy.deepcopy(served), None, config), prompts, params)
    assert set(reads) == {torch.Tensor}
    assert together == alone == gathered


@pytest.mark.parametrize("fmt", ["fp8", "int8"])
def test_prefix_cache_hits_and_parallel_samples_on_a_quantised_pool(model: torch.nn.Module, fmt: str) -> None:
    shared = _prompts([70], seed=4)[0]
    prompts = [shared + tail for tail in _prompts([3, 12, 1], seed=5)]
    params = dataclasses.replace(GREEDY, max_tokens=10)
    cold = Engine(
        copy.deepcopy(model), None, EngineConfig(num_blocks=64, kv_cache_dtype=fmt, prefix_caching=False)
    )
    want = [_run(cold, [p], params)[0] for p in prompts]
    warm = Engine(copy.deepcopy(model), None, EngineConfig(num_blocks=64, kv_cache_dtype=fmt))
    got = [_run(warm, [p], params)[0] for p in prompts]
    assert warm.pool.hits >= 2 * (64 // 16)  # the shared 64 tokens' blocks, for the 2nd and 3rd prompts
    assert got == want
    sampled = SamplingParams(temperature=0.8, max_tokens=12, n=3, seed=7)  # copy-on-write of a shared block
    first = _run(warm, [prompts[0]], sampled)
    assert first == _run(cold, [prompts[0]], sampled)


def test_blocks_and_bytes_per_sequence_halve_against_a_bf16_cache() -> None:
    cfg = dataclasses.replace(CFG, hidden_size=128, num_attention_heads=2, num_key_value_heads=2)
    bf16 = sharpened_pair(cfg)[1].to(torch.bfloat16)
    memory = 3 << 20
    layers, kvh, d = cfg.num_hidden_layers, 2, 64
    assert KVPool.bytes_per_token(layers, kvh, d, torch.bfloat16) == 2 * layers * kvh * d * 2
    assert KVPool.bytes_per_token(layers, kvh, d, torch.bfloat16, "fp8") == 2 * layers * kvh * (d + 4)
    engines = {
        fmt: Engine(copy.deepcopy(bf16), None, EngineConfig(kv_cache_bytes=memory, kv_cache_dtype=fmt))
        for fmt in ("auto", "fp8", "int8")
    }
    for fmt, engine in engines.items():
        per_token = KVPool.bytes_per_token(layers, kvh, d, torch.bfloat16, None if fmt == "auto" else fmt)
        assert engine.pool.num_blocks == memory // (per_token * 16)  # blocks from the bytes given
        assert engine.kv.nbytes == engine.pool.num_blocks * 16 * per_token  # measured on the tensors
    ratio = (
        engines["fp8"].kv.nbytes
        / engines["fp8"].pool.num_blocks
        / (engines["auto"].kv.nbytes / engines["auto"].pool.num_blocks)
    )
    assert ratio == pytest.approx(68 / 128)  # bytes per block, so per sequence: 0.53×
    prompts = _prompts([50, 20, 33], seed=2)
    held = {fmt: _metric_per_sequence(engine, prompts) for fmt, engine in engines.items()}
    assert held["fp8"] / held["auto"] == pytest.approx(68 / 128)  # /metrics says it too
    assert held["int8"] == held["fp8"]
    for engine in engines.values():  # bf16: runs to the end (blocks returned, checked in _run), any batch
        together = _run(engine, prompts, GREEDY)
        assert together == [_run(engine, [p], GREEDY)[0] for p in prompts]


def _tp_worker(model_dir: str) -> list[tuple[list[int], list[float]]]:
    """One of 2 tensor-parallel ranks, each holding one of the model's 2 KV heads in fp8."""
    from zerotron.build.builder import load_model
    from zerotron.distributed.launch import current_rank_and_world
    from zerotron.distributed.mesh import Mesh, ParallelDims

    rank, world = current_rank_and_world()
    mesh = Mesh(ParallelDims(world, dp=1, tp=world), rank)
    group = mesh.group("tp")
    model, _ = load_model(model_dir, torch.float32, "cpu", mesh)
    engine = Engine(model, None, EngineConfig(num_blocks=64, kv_cache_dtype="fp8"), group)
    if group.rank_in_group != 0:
        engine.runner.follow()
        return []
    got = _run(engine, _prompts([5, 17, 40], seed=21), dataclasses.replace(GREEDY, max_tokens=12))
    engine.runner.publish(None, stop=True)
    return got


def test_tensor_parallel_quantised_cache_gives_the_rounded_models_tokens(
    model: torch.nn.Module, tmp_path: object
) -> None:
    from zerotron.distributed.launch import spawn

    sharpened_pair(CFG)[0].save_pretrained(str(tmp_path))
    got = spawn(
        _tp_worker, 2, args=(str(tmp_path),), timeout_s=600, backend="gloo", start_method="forkserver"
    )[0]
    for prompt, (tokens, logps) in zip(_prompts([5, 17, 40], seed=21), got):
        with torch.no_grad():
            logits = model(torch.tensor([prompt + tokens]), kv_cache=RoundedCache("fp8"))[0].float()
        ref = torch.log_softmax(logits[len(prompt) - 1 : -1], -1)
        assert ref.argmax(-1).tolist() == tokens
        torch.testing.assert_close(torch.tensor(logps), ref.max(-1).values, rtol=0, atol=1e-5)


def _metric_per_sequence(engine: Engine, prompts: list[list[int]]) -> float:
    """/metrics' KV bytes per running sequence after the prompts' first step (then run to the end)."""
    loop = EngineLoop(engine, start=False)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"m{i}", prompt, GREEDY)
    engine.step()
    lines = dict(line.rsplit(" ", 1) for line in loop.metrics().splitlines() if not line.startswith("#"))
    assert float(lines["zerotron_kv_cache_bytes_per_token"]) == engine.kv.token_bytes
    assert float(lines["zerotron_kv_cache_bytes"]) == engine.kv.nbytes
    blocks = sum(-(-(len(p) + 1) // 16) for p in prompts)  # each prompt and its first token
    per_sequence = float(lines["zerotron_kv_cache_bytes_per_sequence"])
    assert per_sequence == blocks * 16 * engine.kv.token_bytes / len(prompts)
    while engine.has_unfinished():
        engine.step()
    return per_sequence


def test_bad_kv_cache_dtype_is_refused_in_one_line() -> None:
    with pytest.raises(EngineConfigError, match="kv_cache_dtype.*choose one of auto, fp8"):
        EngineConfig(kv_cache_dtype="fp4")
    with pytest.raises(ValueError, match="not built"):
        KVPool(1, 2, 16, 1, 8, torch.float32, fmt="nf4")


SUITE = [
    "The capital of France is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "Once upon a time, in a land far away, there lived a dragon who",
    "The three primary colours are",
    "To make a cup of tea, first",
    "Photosynthesis is the process by which",
    "The first law of thermodynamics states that",
    "Here is a list of fruits: apple, banana,",
    "In 1969, the first humans landed on",
    "The quick brown fox",
    "A haiku about autumn:\n",
    "import numpy as np\n\ndef mean(xs):\n",
]


@pytest.mark.smollm2
def test_smollm2_greedy_agreement_and_perplexity_with_a_quantised_cache() -> None:
    """Measured on this project's CPU: the share of greedy tokens before the first difference from the
    bf16 cache's, over 12 prompts of 32 tokens: fp8 0.56, int8 0.72 (the bf16 model against the same
    model in fp32: 0.57); perplexity on the held text: bf16 cache 43.27, fp8 43.54 (+0.6%), int8 43.02
    (-0.6%). The bounds below: agreement at least 0.4 (fp8) and 0.5 (int8), perplexity within 1.5%."""
    from tests.test_serve_quant import HELD_TEXT
    from tests.test_smollm2 import GGUF_NAME, _smollm2_dir
    from zerotron.build.builder import load_model

    model, tokenizer = load_model(str(_smollm2_dir() / GGUF_NAME), torch.bfloat16, "cpu")
    ids = torch.tensor([tokenizer.encode(HELD_TEXT)])

    def perplexity(fmt: str) -> float:
        with torch.no_grad():
            logits = model(ids, kv_cache=RoundedCache(fmt))[0, :-1].float()
        return float(F.cross_entropy(logits, ids[0, 1:]).exp())

    with torch.no_grad():
        bf16 = float(F.cross_entropy(model(ids)[0, :-1].float(), ids[0, 1:]).exp())
    prompts = [tokenizer.encode(p) for p in SUITE]
    params = SamplingParams(temperature=0.0, max_tokens=32)

    def tokens(fmt: str) -> list[list[int]]:
        native = kernels.available()  # (the measured figures: native attention)
        config = EngineConfig(
            kv_cache_bytes=64 << 20, max_model_len=512, kv_cache_dtype=fmt, native_attention=native
        )
        return Engine(copy.deepcopy(model), None, config).generate(prompts, params)

    want = tokens("auto")
    for fmt, floor in (("fp8", 0.4), ("int8", 0.5)):
        got = tokens(fmt)
        agree = sum(
            next((i for i, (a, b) in enumerate(zip(w, g)) if a != b), len(w)) for w, g in zip(want, got)
        )
        assert agree / sum(map(len, want)) >= floor, (fmt, agree)
        ppl = perplexity(fmt)
        # measured +0.6% (fp8) and -0.6% (int8) on a CPU without AVX-512, +2.2% and +1.1% on one with
        # AVX-512 BF16, whose bf16 kernels round differently: a broken cache costs far more
        assert abs(ppl / bf16 - 1) <= 0.03, (fmt, bf16, ppl)
