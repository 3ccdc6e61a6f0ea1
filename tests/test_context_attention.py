"""Context-parallel attention alone: every comm mode equals the single process's attention.

The reference is SDPA over the whole sequence (causal, optionally within packed documents) on one
process; each rank checks the forward output on its zig-zag tokens and the gradients of q, k, v it holds
(fp32, 1e-6 of the largest element), for ring, ulysses, allgather and hybrid at cp 2 and 4, with grouped-query attention
(including fewer KV heads than ranks).
"""

from __future__ import annotations

import pytest
import torch

from tests.harness import run_distributed
from zerotron.distributed.launch import current_rank_and_world
from zerotron.distributed.mesh import Mesh, ParallelDims
from zerotron.parallel.context.attention import context_groups
from zerotron.parallel.context.blocks import reference_attention
from zerotron.parallel.context.split import check_split, local_index, runs_of, shard, unshard

CASES = [  # (mode, heads, kv heads, ulysses size)
    ("ring", 4, 4, 1),
    ("ring", 4, 1, 1),  # one KV head for every rank of the ring
    ("allgather", 4, 2, 1),
    ("ulysses", 4, 2, 1),
    ("ulysses", 8, 2, 1),  # at cp 4: KV heads fewer than ranks, repeated per query head
    ("hybrid", 4, 2, 2),
]


def _inputs(heads: int, kv_heads: int, seq: int, documents: bool) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(heads * 100 + kv_heads)
    q = torch.randn(2, heads, seq, 8, generator=gen)
    k = torch.randn(2, kv_heads, seq, 8, generator=gen)
    v = torch.randn(2, kv_heads, seq, 8, generator=gen)
    grad = torch.randn(2, heads, seq, 8, generator=gen)
    if documents:  # ragged packed documents, different in each row
        docs = torch.stack([torch.tensor([0] * 5 + [1] * 14 + [2] * (seq - 19)), torch.arange(seq) // 7])
    else:
        docs = torch.zeros(2, seq, dtype=torch.long)
    return q, k, v, grad, docs


def _body(cases: list[tuple[str, int, int, int]], seq: int, documents: bool) -> list[float]:
    rank, world = current_rank_and_world()
    mesh = Mesh(ParallelDims(world, dp=1, cp=world), rank)
    errors = []
    for mode, heads, kv_heads, u in cases:
        q, k, v, grad, docs = _inputs(heads, kv_heads, seq, documents)
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        ref = reference_attention(*leaves, docs if documents else None)
        ref.backward(grad)
        mine = [shard(t, world, rank, dim=2).detach().requires_grad_() for t in (q, k, v)]
        groups = context_groups(mesh, mode, u)
        runs = [runs_of(seq, world, r) for r in range(world)]
        out = groups.attend(*mine, runs, docs if documents else None, 8**-0.5)
        out.backward(shard(grad, world, rank, dim=2))
        pairs = [(out, ref)] + [(m.grad, leaf.grad) for m, leaf in zip(mine, leaves)]
        for got, want in pairs:
            assert got is not None and want is not None
            want = shard(want, world, rank, dim=2)
            errors.append(float((got.detach() - want).abs().max() / want.abs().max()))  # relative
    return errors


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("documents", [False, True], ids=["causal", "documents"])
def test_every_mode_equals_the_single_process(cp: int, documents: bool) -> None:
    cases = [c for c in CASES if c[1] % cp == 0 or c[0] not in ("ulysses", "hybrid")]
    for errors in run_distributed(_body, cp, cases, 32, documents, timeout=180):
        assert len(errors) == 4 * len(cases)
        assert max(errors) < 1e-6, errors


def test_zigzag_split_round_trip_and_positions() -> None:
    x = torch.arange(2 * 24).reshape(2, 24)
    parts = [shard(x, 3, r) for r in range(3)]
    assert torch.equal(unshard(parts), x)
    assert local_index(24, 3, 0).tolist() == [0, 1, 2, 3, 20, 21, 22, 23]
    assert torch.equal(parts[1][0], torch.tensor([4, 5, 6, 7, 16, 17, 18, 19]))
    with pytest.raises(ValueError, match="multiple of 2\\*parallel.cp = 6"):
        check_split(32, 3)


def _deepspeed_body(seq: int, heads: int, kv_heads: int) -> dict[str, torch.Tensor]:
    """Ulysses by DeepSpeed (contiguous sequence split, (s, b, h, d) layout) and by zerotron (zig-zag)
    on the same q, k, v: each rank's outputs and input gradients, for the caller to reassemble."""
    import os

    os.environ["DS_ACCELERATOR"] = "cpu"
    import deepspeed
    import torch.distributed as dist
    from deepspeed.sequence.layer import DistributedAttention

    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = current_rank_and_world()
    q, k, v, grad, _ = _inputs(heads, kv_heads, seq, documents=False)

    def local_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # DeepSpeed hands (s, b, h/p, d); the single process's causal SDPA wants (b, h, s, d)
        def bhsd(t: torch.Tensor) -> torch.Tensor:
            return t.permute(1, 2, 0, 3)

        out = torch.nn.functional.scaled_dot_product_attention(
            bhsd(q), bhsd(k), bhsd(v), is_causal=True, enable_gqa=q.shape[2] != k.shape[2]
        )
        return out.permute(2, 0, 1, 3)

    part = seq // world
    theirs = [
        t[:, :, rank * part : (rank + 1) * part].permute(2, 0, 1, 3).detach().requires_grad_()
        for t in (q, k, v)
    ]
    attention = DistributedAttention(local_attention, dist.group.WORLD, scatter_idx=2, gather_idx=0)
    out_ds = attention(*theirs, 1)  # batch dim 1
    out_ds.backward(grad[:, :, rank * part : (rank + 1) * part].permute(2, 0, 1, 3))

    mesh = Mesh(ParallelDims(world, dp=1, cp=world), rank)
    mine = [shard(t, world, rank, dim=2).detach().requires_grad_() for t in (q, k, v)]
    runs = [runs_of(seq, world, r) for r in range(world)]
    out = context_groups(mesh, "ulysses").attend(*mine, runs, None, 8**-0.5)
    out.backward(shard(grad, world, rank, dim=2))

    def back(t: torch.Tensor) -> torch.Tensor:  # (s, b, h, d) -> (b, h, s, d)
        return t.detach().permute(1, 2, 0, 3)

    result = {"ds_out": back(out_ds), "out": out.detach()}
    for name, a, b in zip("qkv", theirs, mine):
        assert a.grad is not None and b.grad is not None
        result[f"ds_d{name}"], result[f"d{name}"] = back(a.grad), b.grad
    return result


def test_ulysses_equals_deepspeed_ulysses() -> None:
    seq, cp = 32, 2
    results = run_distributed(_deepspeed_body, cp, seq, 4, 2, timeout=180)
    for key in ("out", "dq", "dk", "dv"):
        ours = unshard([r[key] for r in results], dim=2)  # zig-zag parts -> the whole sequence
        theirs = torch.cat([r[f"ds_{key}"] for r in results], dim=2)  # contiguous parts
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-6 * float(theirs.abs().max()))


class _Echo(torch.nn.Module):
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: object = None) -> torch.Tensor:
        return q


def test_rope_positions_under_the_split_are_the_whole_rows() -> None:
    """Each cp rank's tokens get the RoPE angles of their positions in the whole row, restarting at each
    packed document (positions written out here token by token)."""
    from types import SimpleNamespace

    from zerotron.config_load import load_config
    from zerotron.models.llama import LlamaForCausalLM
    from zerotron.parallel.context import ContextSplit

    cfg = load_config(
        None, ["model.hidden_size=32", "model.num_hidden_layers=1", "model.num_attention_heads=2"]
    )
    model = LlamaForCausalLM(cfg.model)
    model.layers[0].self_attn.core = _Echo()
    seen: list[torch.Tensor] = []
    model.layers[0].self_attn.register_forward_pre_hook(lambda _, args: seen.append(args[1]))
    seq, cp = 24, 3
    docs = torch.tensor([[0] * 7 + [1] * 10 + [2] * 7, [5] * 24])
    whole = torch.tensor([[*range(7), *range(10), *range(7)], list(range(24))])  # by hand
    for rank in range(cp):
        groups = SimpleNamespace(cp_group=SimpleNamespace(size=cp, rank_in_group=rank))
        model.context = ContextSplit(groups)  # type: ignore[arg-type]
        for documents in (docs, None):
            seen.clear()
            model(shard(torch.zeros(2, seq, dtype=torch.long), cp, rank), document_ids=documents)
            expected = shard(whole if documents is not None else torch.arange(seq).expand(2, seq), cp, rank)
            cos, _ = model.rotary(expected, torch.float32)
            assert torch.equal(seen[0], cos)
