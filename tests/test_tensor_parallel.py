"""Tensor and sequence parallelism equal the unsharded computation.

- Each parallel layer against the plain torch layer it replaces (output and every gradient), tp = 2, 4.
- The tiny model trained by the trainer at tp = 1, 2, 4 with sequence parallelism off and on, and at
  dp 2 × tp 2, against the single-process reference of tests/test_train_dp.py (written independently of
  the trainer; fp32, losses and weights within 1e-5 relative; see that module for why lr = 1e-3).
- TP traffic per step from ``comm_bytes`` against the analytic count, and sequence parallelism's
  smaller norm activations.
- Bad layouts are refused before any rank starts, with the tp values that would work.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.harness import run_distributed
from tests.test_train_dp import BASE, STEPS, _assert_close, _reference, _tokens
from zerotron.checkpoint import store
from zerotron.components.state import read_model_tensors
from zerotron.config_check import validate
from zerotron.config_load import ConfigError, load_config
from zerotron.distributed.launch import current_rank_and_world
from zerotron.distributed.mesh import Mesh, ParallelDims
from zerotron.parallel.tensor import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    gather_tensors,
    shard_specs,
)
from zerotron.parallel.tensor_comm import vocab_parallel_cross_entropy
from zerotron.parallel.tensor_generate import sequence_parallel_off
from zerotron.train.trainer import Trainer

# Clipping at 0.3 is active on every step (the unclipped norm starts at 0.8), so a wrong global norm shows.
TINY = [*BASE, "model.vocab_size=256", "train.grad_clip=0.3"]
B, S, H, OUT = 2, 8, 12, 16


def _tp_group():  # noqa: ANN202 - a Group
    rank, world = current_rank_and_world()
    return Mesh(ParallelDims(world, dp=1, tp=world), rank).group("tp")


def _rand(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _close(got: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-10, msg=what)


def _column_body(input_mode: str, replicated: bool) -> None:
    group = _tp_group()
    t, k = group.size, group.rank_in_group
    ref = nn.Linear(H, OUT, bias=True).double()
    with torch.no_grad():
        ref.weight.copy_(_rand(OUT, H, seed=1))
        ref.bias.copy_(_rand(OUT, seed=2))
    x_ref = _rand(B, S, H, seed=3).requires_grad_()
    r = _rand(B, S, OUT, seed=4)
    if replicated:  # two "heads" of OUT/2 rows, each used by t/2 ranks
        rows = (k * 2 // t * OUT // 2, OUT // 2)
    else:
        rows = (k * OUT // t, OUT // t)
    sl = slice(rows[0], rows[0] + rows[1])
    layer = ColumnParallelLinear(ref, group, input_mode, rows, replicated)
    x = x_ref.detach()
    if input_mode == "sequence":
        x = x.chunk(t, dim=1)[k]
    x = x.clone().requires_grad_()
    out = layer(x)  # (b, s, OUT/t)
    (out * r[..., sl]).sum().backward()
    if replicated:  # the reference loss: every rank's rows, heads counted as often as they are used
        ref_rows = [(j * 2 // t * OUT // 2, OUT // 2) for j in range(t)]
        y = ref(x_ref)
        sum((y[..., a : a + n] * r[..., a : a + n]).sum() for a, n in ref_rows).backward()
        _close(out, y[..., sl].detach(), "output")
        _close(layer.weight.grad, ref.weight.grad, "weight grad")
        _close(layer.bias.grad, ref.bias.grad, "bias grad")
    else:
        y = ref(x_ref)
        (y * r).sum().backward()
        _close(out, y[..., sl].detach(), "output")
        _close(layer.weight.grad, ref.weight.grad[sl], "weight grad")
        _close(layer.bias.grad, ref.bias.grad[sl], "bias grad")
    x_grad = x_ref.grad.chunk(t, dim=1)[k] if input_mode == "sequence" else x_ref.grad
    _close(x.grad, x_grad, "input grad")
    spec = shard_specs(layer)["weight"]
    assert spec.global_shape == (OUT, H)
    assert spec.offsets == ((0, 0) if replicated else (rows[0], 0))


def _row_body(output_mode: str) -> None:
    group = _tp_group()
    t, k = group.size, group.rank_in_group
    ref = nn.Linear(OUT, H, bias=True).double()
    with torch.no_grad():
        ref.weight.copy_(_rand(H, OUT, seed=5))
        ref.bias.copy_(_rand(H, seed=6))
    x_ref = _rand(B, S, OUT, seed=7).requires_grad_()
    r = _rand(B, S, H, seed=8)
    cols = slice(k * OUT // t, (k + 1) * OUT // t)
    layer = RowParallelLinear(ref, group, output_mode)
    x = x_ref.detach()[..., cols].clone().requires_grad_()
    out = layer(x)
    y = ref(x_ref)
    if output_mode == "sequence":
        y_mine, r_mine = y.chunk(t, dim=1)[k], r.chunk(t, dim=1)[k]
    else:
        y_mine, r_mine = y, r
    (out * r_mine).sum().backward()
    (y * r).sum().backward()
    _close(out, y_mine.detach(), "output")
    _close(x.grad, x_ref.grad[..., cols], "input grad")
    _close(layer.weight.grad, ref.weight.grad[:, cols], "weight grad")
    _close(layer.bias.grad, ref.bias.grad, "bias grad")
    assert shard_specs(layer)["weight"].offsets == (0, cols.start)


def _embedding_cross_entropy_body(output_mode: str) -> None:
    group = _tp_group()
    t, k = group.size, group.rank_in_group
    vocab = 20
    ref = nn.Embedding(vocab, H).double()
    with torch.no_grad():
        ref.weight.copy_(_rand(vocab, H, seed=9))
    ids = torch.randint(0, vocab, (B, S), generator=torch.Generator().manual_seed(10))
    r = _rand(B, S, H, seed=11)
    rows = slice(k * vocab // t, (k + 1) * vocab // t)
    layer = VocabParallelEmbedding(ref, group, output_mode)
    out = layer(ids)
    y = ref(ids)
    y_mine, r_mine = (y.chunk(t, 1)[k], r.chunk(t, 1)[k]) if output_mode == "sequence" else (y, r)
    (out * r_mine).sum().backward()
    (y * r).sum().backward()
    _close(out, y_mine.detach(), "embedding output")
    _close(layer.weight.grad, ref.weight.grad[rows], "embedding weight grad")
    # Vocab-parallel cross-entropy against F.cross_entropy on the full logits.
    logits = _rand(B * S, vocab, seed=12).float().requires_grad_()
    labels = torch.randint(0, vocab, (B * S,), generator=torch.Generator().manual_seed(13))
    mine = logits.detach()[:, rows].clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(mine, labels, group)
    weights = torch.linspace(0.5, 1.5, B * S)
    (loss * weights).sum().backward()
    ref_loss = F.cross_entropy(logits, labels, reduction="none")
    (ref_loss * weights).sum().backward()
    torch.testing.assert_close(loss, ref_loss.detach(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(mine.grad, logits.grad[:, rows], rtol=1e-6, atol=1e-7)


def _layers_body() -> None:
    for input_mode in ("replicated", "sequence"):
        _column_body(input_mode, replicated=False)
    if current_rank_and_world()[1] == 4:
        _column_body("replicated", replicated=True)  # two heads over four ranks: GQA with tp > KV heads
    for mode in ("reduce", "sequence"):
        _row_body(mode)
        _embedding_cross_entropy_body(mode)


@pytest.mark.parametrize("tp", [2, 4])
def test_parallel_layers_match_unsharded(tp: int) -> None:
    """Column (replicated and sequence input, replicated heads at tp=4), row (all-reduce and
    reduce-scatter output), vocab-parallel embedding and cross-entropy: outputs and every gradient."""
    run_distributed(_layers_body, tp)


# -- the whole model in the trainer ------------------------------------------------------------------------


def _tp_trainer_body(
    overrides: list[str], tokens: np.ndarray, run_dir: str, steps: int = STEPS, save: bool = False
) -> dict:
    """Train; gather every shard to its global tensor by its ShardSpec; report traffic and activations."""
    cfg = load_config(None, overrides)
    rank, world = current_rank_and_world()
    mesh = Mesh(ParallelDims.from_config(cfg.parallel, world), rank)
    trainer = Trainer(cfg, mesh, Path(run_dir), tokens)
    history = [trainer.train_step() for _ in range(steps)]
    if save:
        trainer.save()
    with trainer.zero.full_params() if trainer.zero else contextlib.nullcontext():  # ZeRO-3: gathered over dp
        shards = {k: v.detach().clone() for k, v in trainer.model.named_parameters()}
    return {
        "losses": [r["loss"] for r in history],
        "weights": gather_tensors(shards, shard_specs(trainer.model), mesh.group("tp")),
        "comm": history[-1]["comm_bytes"],
        "activation_bytes": history[-1]["activation_bytes"],
        "n_params": history[-1]["n_params"],
        "grad_norm": [r["grad_norm"] for r in history],
        "q_rows": trainer.model.layers[0].self_attn.q_proj.weight.shape[0],
    }


@pytest.mark.parametrize(
    ("tp", "sp", "recompute"),
    [(1, False, "none"), (2, False, "none"), (2, True, "none"), (4, False, "none"), (4, True, "none")]
    + [(2, True, "full")],
    ids=lambda v: str(v),
)
def test_tp_matches_single_process(tp: int, sp: bool, recompute: str, tmp_path: Path) -> None:
    tokens = _tokens()
    overrides = [*TINY, f"parallel.tp={tp}", f"parallel.sequence_parallel={sp}", "train.micro_batch=4"]
    overrides.append(f"train.recompute={recompute}")
    ref_losses, ref_weights = _reference(overrides, tokens)
    results = run_distributed(_tp_trainer_body, tp, overrides, tokens, str(tmp_path), timeout=300)
    for result in results:
        _assert_close(result, ref_losses, ref_weights)
        assert result["q_rows"] == 64 // tp  # the model really is split
    assert ref_losses[-1] < ref_losses[0]


@pytest.mark.parametrize(
    ("zero", "offload"), [(0, "none"), (1, "none"), (2, "none"), (3, "none"), (3, "nvme")]
)
def test_dp2_tp2_matches_single_process(zero: int, offload: str, tmp_path: Path) -> None:
    """dp 2 × tp 2 (SP on), with ZeRO-1/2/3 over dp (ZeRO-3 also with its parameters and optimizer
    offloaded to NVMe): trajectory, and a checkpoint of whole tensors."""
    tokens = _tokens()
    overrides = [*TINY, "parallel.dp=2", "parallel.tp=2", "parallel.sequence_parallel=true"]
    overrides.append(f"parallel.zero={zero}")
    overrides += [f"parallel.offload_optimizer={offload}", f"parallel.offload_params={offload}"]
    overrides.append(f"parallel.nvme_path={tmp_path}")
    overrides += ["train.micro_batch=2"]
    validate(load_config(None, overrides), 4)
    ref_losses, ref_weights = _reference(overrides, tokens)
    results = run_distributed(_tp_trainer_body, 4, overrides, tokens, str(tmp_path), STEPS, True, timeout=300)
    for result in results:
        _assert_close(result, ref_losses, ref_weights)
    assert results[0]["n_params"] == sum(w.numel() for w in ref_weights.values())
    # Each tp rank wrote its own shards; assembled by global name they are the reference's whole tensors.
    ckpt = store.find_latest(tmp_path / "checkpoints")
    assert ckpt is not None
    saved = read_model_tensors(ckpt)
    _assert_close({"losses": ref_losses, "weights": saved}, ref_losses, ref_weights)
    moments = read_model_tensors(ckpt, "optimizer")
    assert (
        moments["layers.0.mlp.down_proj.weight.exp_avg"].shape
        == ref_weights["layers.0.mlp.down_proj.weight"].shape
    )


def _expected_tp_bytes(cfg, micro_batches: int, sequence_parallel: bool) -> float:  # noqa: ANN001
    """The tp traffic of one step (bytes, NCCL bus convention, fp32), term by term.

    Per micro-batch of b sequences of s tokens, hidden h, L layers, tp t, in elements:
    - layers: 8·b·s·h·(t−1)/t each (f and g: two all-reduces forward and two backward; under sequence
      parallelism two all-gathers and two reduce-scatters each way, the same bytes);
    - embedding and output head: 4·b·s·h·(t−1)/t (the embedding's g forward, the head's f backward);
    - vocab-parallel loss: 6·b·s·(t−1)/t (all-reduce of the max, then of the sum of exponentials and
      the target logit stacked);
    - sequence parallelism: the norm gains' gradients summed over tp, (2L+1)·h · 2(t−1)/t; and the
      column-parallel layers, which save only their input's (b, s/t, h) shard, all-gather it again in
      backward, once per region (attention, MLP) and for the head: (2L+1)·b·s·h·(t−1)/t.
    Per step: the global gradient norm's scalar all-reduce, 2·4·(t−1)/t bytes.
    """
    m, t = cfg.model, cfg.parallel.tp
    b, s, h, n_layers = cfg.train.micro_batch, cfg.train.seq_len, m.hidden_size, m.num_hidden_layers
    frac = (t - 1) / t
    elements = (8 * n_layers + 4) * b * s * h * frac + 6 * b * s * frac
    if sequence_parallel:
        elements += (2 * n_layers + 1) * h * 2 * frac + (2 * n_layers + 1) * b * s * h * frac
    return 4 * micro_batches * elements + 2 * 4 * frac


def _norm_activation_body(overrides: list[str]) -> dict:
    """Bytes saved for backward inside the norm modules during one forward, by storage."""
    from zerotron.build.builder import build_model
    from zerotron.models.llama import RMSNorm

    cfg = load_config(None, overrides)
    rank, world = current_rank_and_world()
    mesh = Mesh(ParallelDims.from_config(cfg.parallel, world), rank)
    model = build_model(cfg, torch.device("cpu"), mesh)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            saved[ptr] = t.untyped_storage().nbytes()
        return t

    contexts = []
    for module in model.modules():
        if isinstance(module, RMSNorm):
            module.register_forward_pre_hook(
                lambda *_: (
                    contexts.append(torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t))
                    or contexts[-1].__enter__()
                )
            )
            module.register_forward_hook(lambda *_: contexts.pop().__exit__(None, None, None))
    ids = torch.arange(cfg.train.micro_batch * cfg.train.seq_len).reshape(cfg.train.micro_batch, -1) % 256
    model(ids)
    return {"norm_bytes": sum(saved.values())}


def test_traffic_and_sequence_parallel_activations(tmp_path: Path) -> None:
    """comm_bytes on tp equals the analytic count ±1%, with and without SP. SP keeps 1/t of the norms'
    saved tensors (input, 1/rms, normalised value) and of the column-parallel layers' saved input
    (the shard, not the gather), for the 2L+1 norms and regions (the head's too): activation_bytes
    drops by exactly that."""
    tokens = _tokens()
    out = {}
    for sp in (False, True):
        overrides = [*TINY, "parallel.tp=2", f"parallel.sequence_parallel={sp}", "train.micro_batch=4"]
        result = run_distributed(_tp_trainer_body, 2, overrides, tokens, str(tmp_path / str(sp)), 1)[0]
        cfg = load_config(None, overrides)
        got = sum(result["comm"]["tp"].values())
        assert got == pytest.approx(_expected_tp_bytes(cfg, 2, sp), rel=0.01)
        ops = result["comm"]["tp"]
        if sp:  # the layers' traffic moved from all-reduce to all-gather + reduce-scatter
            m, b, s = cfg.model, cfg.train.micro_batch, cfg.train.seq_len
            regather = 2 * (2 * m.num_hidden_layers + 1) * b * s * m.hidden_size * 4 / 2  # 2 micro-batches
            assert ops["all_gather"] - regather == ops["reduce_scatter"] > 10 * ops["all_reduce"]
        else:
            assert set(ops) == {"all_reduce"}
        out[sp] = result
        out[("norm", sp)] = run_distributed(_norm_activation_body, 2, overrides)[0]["norm_bytes"]
    assert out[("norm", True)] * 2 == out[("norm", False)] > 0
    m, b, s, t = cfg.model, cfg.train.micro_batch, cfg.train.seq_len, 2
    n, h, frac = 2 * m.num_hidden_layers + 1, m.hidden_size, 1 - 1 / t
    norms = n * 4 * (2 * b * s * h + b * s) * frac  # fp32 x and normalised x, and 1/rms
    column_inputs = n * 4 * b * s * h * frac
    assert out[False]["activation_bytes"] - out[True]["activation_bytes"] == norms + column_inputs


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["parallel.tp=3"], r"parallel\.tp=3 does not divide model\.num_attention_heads=4; .*: 1, 2, 4$"),
        (
            [
                "parallel.tp=4",
                "model.num_key_value_heads=2",
                "model.num_attention_heads=6",
                "model.head_dim=8",
            ],
            r"tp=4 does not divide model\.num_attention_heads=6; tp values that fit this model: 1, 2, 6$",
        ),
        (
            ["parallel.tp=4", "model.num_key_value_heads=3", "model.num_attention_heads=12"]
            + ["model.head_dim=8", "model.vocab_size=264"],
            r"tp=4 neither divides model\.num_key_value_heads=3 nor is a multiple of it.*: 1, 3, 6, 12$",
        ),
        (["parallel.tp=4", "model.intermediate_size=98"], r"model\.intermediate_size=98; .*: 1, 2$"),
        (
            ["parallel.tp=2", "parallel.sequence_parallel=true", "train.seq_len=33"],
            r"tp=2 does not divide train\.seq_len=33 \(parallel\.sequence_parallel=true\)",
        ),
    ],
)
def test_bad_tp_layouts_are_refused(overrides: list[str], expected: str) -> None:
    cfg = load_config(None, [*TINY, *overrides])
    world = cfg.parallel.tp * cfg.parallel.pp
    with pytest.raises(ConfigError, match=expected) as err:
        validate(cfg, world)
    assert "\n" not in str(err.value)


def _smollm2_tp_body(gguf: str, prompt_ids: list[int]) -> dict:
    from zerotron.components.generate import GenerateOptions
    from zerotron.models.llama import tensor_parallel_plan
    from zerotron.models.loading import load_pretrained
    from zerotron.parallel.tensor import TensorParallelPlan, apply_tensor_parallel
    from zerotron.parallel.tensor_comm import gather_last_dim
    from zerotron.serve.generate import GenerateJob, run_generate

    group = _tp_group()
    model, _ = load_pretrained(gguf, dtype=torch.float32)
    apply_tensor_parallel(model, TensorParallelPlan.from_dict(tensor_parallel_plan(model.config)), group)
    attn = model.layers[0].self_attn
    with torch.no_grad():
        logits = gather_last_dim(model(torch.tensor([prompt_ids])), group)  # (1, s, V)
    rank, world = current_rank_and_world()
    answer = run_generate(
        GenerateJob(gguf, "What is the capital of France?", GenerateOptions(max_new_tokens=24), chat=True),
        stats=None,
        mesh=Mesh(ParallelDims(world, dp=1, tp=world), rank),  # each rank loads its shard
    )
    if group.rank_in_group != 0:
        return {}
    return {"logits": logits, "heads": (attn.num_heads, attn.kv_heads), "text": answer["text"]}


@pytest.mark.smollm2
def test_smollm2_tp3_equals_tp1() -> None:
    """SmolLM2-135M (9 heads, 3 KV heads, tied embeddings) split over tp=3: the unsplit logits, and Paris."""
    from tests.test_smollm2 import GGUF_NAME, _smollm2_dir
    from zerotron.models.loading import load_pretrained

    gguf = str(_smollm2_dir() / GGUF_NAME)
    model, tokenizer = load_pretrained(gguf, dtype=torch.float32)
    prompt_ids = tokenizer.encode("The capital of France is")
    with torch.no_grad():
        expected = model(torch.tensor([prompt_ids]))
    del model
    got = run_distributed(_smollm2_tp_body, 3, gguf, prompt_ids, timeout=300)[0]
    assert got["heads"] == (3, 1)
    rel = ((got["logits"] - expected).abs().max() / expected.abs().max()).item()
    assert rel <= 1e-5, rel
    assert "Paris" in got["text"]


def _resume_body(overrides: list[str], tokens: np.ndarray, run_dir: str, ckpt: str, steps: int) -> dict:
    cfg = load_config(None, overrides)
    rank, world = current_rank_and_world()
    mesh = Mesh(ParallelDims.from_config(cfg.parallel, world), rank)
    trainer = Trainer(cfg, mesh, Path(run_dir), tokens)
    trainer.resume(ckpt)
    losses = [trainer.train_step()["loss"] for _ in range(steps)]
    shards = {k: v.detach().clone() for k, v in trainer.model.named_parameters()}
    return {"losses": losses, "weights": gather_tensors(shards, shard_specs(trainer.model), mesh.group("tp"))}


def test_checkpoint_moves_between_tp_sizes(tmp_path: Path) -> None:
    """3 steps at tp=2 (SP), saved; resumed at tp=4 and at tp=1: steps 4-5 equal a straight run."""
    tokens = _tokens()
    base = [*TINY, "train.micro_batch=4"]
    ref_losses, ref_weights = _reference(base, tokens, steps=5)
    first = [*base, "parallel.tp=2", "parallel.sequence_parallel=true"]
    run_distributed(_tp_trainer_body, 2, first, tokens, str(tmp_path / "a"), 3, True)
    ckpt = store.find_latest(tmp_path / "a" / "checkpoints")
    assert ckpt is not None
    for tp in (4, 1):
        got = run_distributed(
            _resume_body, tp, [*base, f"parallel.tp={tp}"], tokens, str(tmp_path / f"b{tp}"), str(ckpt), 2
        )[0]
        _assert_close(got, ref_losses[3:], ref_weights)


def _generate_body(overrides: list[str], tokens: np.ndarray, run_dir: str) -> list[int]:
    """Greedy generation from a freshly initialised tp model, sequence parallelism switched off for it
    (what the end-of-run sample does), with its logits on the prompt."""
    from zerotron.components.generate import GenerateOptions, generate

    cfg = load_config(None, overrides)
    rank, world = current_rank_and_world()
    mesh = Mesh(ParallelDims.from_config(cfg.parallel, world), rank)
    model = Trainer(cfg, mesh, Path(run_dir), tokens).model
    model.eval()
    tp = mesh.group("tp")
    with torch.no_grad(), sequence_parallel_off(model):
        result = generate(
            model, None, [1, 5, 9, 3], GenerateOptions(max_new_tokens=12), tp_group=tp, agree_group=tp
        )
    return [int(t) for t in result["ids"]]


@pytest.mark.parametrize(
    "extra",
    [
        [],
        ["model.num_local_experts=4", "model.num_experts_per_tok=2", "model.intermediate_size=32"],
        [
            "model.num_local_experts=4",
            "model.num_experts_per_tok=2",
            "model.intermediate_size=32",
            "parallel.etp=2",
        ],
    ],
    ids=["dense", "moe", "moe-etp"],
)
def test_sequence_parallel_model_generates_like_one_process(extra: list[str], tmp_path: Path) -> None:
    """The end-of-run sample of a sequence-parallel run (one-token decode steps cannot be split over tp):
    greedy tokens equal the single process's from the same initial weights."""
    from zerotron.components.generate import GenerateOptions, generate
    from zerotron.models.llama import LlamaForCausalLM

    overrides = [*TINY, *extra, "parallel.tp=2", "parallel.sequence_parallel=true", "train.micro_batch=4"]
    cfg = load_config(None, [*TINY, *extra])
    ref = LlamaForCausalLM(cfg.model)
    ref.init_weights(cfg.train.seed)
    ref.eval()
    with torch.no_grad():
        expected = [
            int(t) for t in generate(ref, None, [1, 5, 9, 3], GenerateOptions(max_new_tokens=12))["ids"]
        ]
    results = run_distributed(_generate_body, 2, overrides, _tokens(), str(tmp_path), timeout=300)
    assert results == [expected, expected]
