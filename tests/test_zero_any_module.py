"""ZeRO on any ``nn.Module``: a Hugging Face ``transformers.LlamaForCausalLM`` sharded by ``apply_zero``.

DESIGN contract 3 says ZeRO works on any module, Hugging Face models included. Here a tiny
``transformers.LlamaForCausalLM`` (random init from a small ``LlamaConfig``: hidden 64, 2 layers, GQA)
is trained by a short hand-written loop, the one a user would write around :func:`apply_zero`, on two
Gloo ranks with ZeRO-1, -2 and -3, each rank taking half of every batch in two accumulated
micro-batches. The reference is the same loop unsharded in one process: the whole batch in one
forward, ``torch.optim.AdamW`` and ``torch.nn.utils.clip_grad_norm_``. Losses and final weights must
agree within 1e-5 relative (fp32, lr 3e-4: see tests/test_train_dp.py for why this lr).

``apply_zero`` sums gradients over the data-parallel ranks (as the trainer, which scales by the global
token count, expects), so the loop divides each micro-batch's mean loss by the number of micro-batches
it accumulates over the whole data-parallel group.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.harness import run_distributed
from zerotron.components.optim import clip_grads_, global_grad_norm
from zerotron.distributed.launch import current_rank_and_world
from zerotron.distributed.mesh import Mesh, ParallelDims
from zerotron.parallel.zero.api import ZeroOptions, apply_zero

transformers = pytest.importorskip("transformers")

STEPS, BATCH, SEQ, VOCAB, LR, CLIP, WD = 6, 8, 16, 128, 3e-4, 1.0, 0.1


def _model(tied: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=tied,
    )
    return transformers.LlamaForCausalLM(cfg).train()


def _batches() -> torch.Tensor:
    """Two random batches, alternating, so that the loss on the first one must fall."""
    gen = torch.Generator().manual_seed(3)
    two = torch.randint(0, VOCAB, (2, BATCH, SEQ), generator=gen)
    return two.repeat(STEPS // 2, 1, 1)  # (steps, b, s)


def _adamw(decay: list, no_decay: list) -> torch.optim.AdamW:
    groups = [{"params": decay, "weight_decay": WD}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=LR, betas=(0.9, 0.95), eps=1e-8)


def _reference(tied: bool) -> tuple[list[float], dict[str, torch.Tensor]]:
    model = _model(tied)
    params = list(model.parameters())
    opt = _adamw([p for p in params if p.ndim >= 2], [p for p in params if p.ndim < 2])
    losses = []
    for ids in _batches():
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, CLIP)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.named_parameters()}


def _sharded(stage: int, tied: bool, micro: int = 2) -> dict:
    rank, world = current_rank_and_world()
    group = Mesh(ParallelDims(world_size=world, dp=world), rank).group("dp")
    model = _model(tied)
    engine = apply_zero(model, group, ZeroOptions(stage, persist_numel=100))
    opt = _adamw(*engine.param_groups())
    losses = []
    for ids in _batches():
        mine = ids.chunk(world)[rank].chunk(micro)  # this rank's half, in micro-batches
        total = torch.zeros(())
        for i, part in enumerate(mine):
            with engine.no_sync() if i < micro - 1 else _nothing():
                loss = model(input_ids=part, labels=part).loss
                (loss / (micro * world)).backward()
            total += loss.detach() / (micro * world)
        engine.finish()
        clip_grads_(engine.params, global_grad_norm(engine.params, [group]), CLIP)
        opt.step()
        engine.after_step()
        engine.zero_grad()
        torch.distributed.all_reduce(total)
        losses.append(total.item())
    with engine.full_params():
        weights = {k: v.detach().clone() for k, v in model.named_parameters()}
    return {"losses": losses, "weights": weights}


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


@pytest.mark.parametrize(("stage", "tied"), [(1, False), (2, False), (3, False), (3, True)])
def test_apply_zero_on_transformers_llama_matches_unsharded(stage: int, tied: bool) -> None:
    ref_losses, ref_weights = _reference(tied)
    results = run_distributed(_sharded, 2, stage, tied, timeout=120)
    for got in results:
        np.testing.assert_allclose(got["losses"], ref_losses, rtol=1e-5)
        assert got["weights"].keys() == ref_weights.keys()
        for name, ref in ref_weights.items():
            rel = ((got["weights"][name] - ref).norm() / ref.norm()).item()
            assert rel <= 1e-5, f"{name}: relative difference {rel:.3g} > 1e-5"
    assert ref_losses[-2] < ref_losses[0]  # the same batch, STEPS - 2 updates later
