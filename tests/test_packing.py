"""Packed samples give every document the loss and gradients it has alone (no cross-contamination)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from tests.test_hf_io import CFG
from zerotron.components.packing import IGNORE, Sample, pack
from zerotron.models.llama import LlamaForCausalLM, document_attention


def _samples(seed: int, lengths: list[int], masked: bool) -> list[Sample]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        ids = torch.randint(0, CFG.vocab_size, (n,), generator=g).tolist()
        counted = (torch.rand(n, generator=g) < 0.6).tolist() if masked else None
        out.append(Sample(ids, counted))
    return out


def _alone(model: LlamaForCausalLM, sample: Sample) -> torch.Tensor:
    """The reference: one document in a batch of one, no mask, no packing."""
    ids = torch.tensor([list(sample.ids)])
    logits = model(ids)[0, :-1]
    losses = F.cross_entropy(logits, ids[0, 1:], reduction="none")
    counted = torch.ones(len(sample.ids) - 1, dtype=torch.bool)
    if sample.counted is not None:
        counted = torch.tensor(list(sample.counted))[1:]
    return (losses * counted).sum()


@pytest.mark.parametrize("masked", [False, True], ids=["all-tokens", "loss-mask"])
def test_packed_losses_and_gradients_equal_each_document_alone(masked: bool) -> None:
    model = LlamaForCausalLM(dataclasses.replace(CFG)).train()
    model.init_weights(1)
    samples = _samples(0, [9, 17, 5, 30, 12, 3, 21], masked)
    batch = pack(samples, seq_len=32)
    assert batch.input_ids.shape[0] < len(samples)  # several documents share rows

    logits = model(batch.input_ids, document_ids=batch.document_ids)
    token_loss = F.cross_entropy(logits.flatten(0, 1), batch.labels.flatten(), reduction="none")
    docs = batch.document_ids.flatten()
    packed = torch.stack([token_loss[docs == k].sum() for k in range(len(samples))])
    packed.sum().backward()
    packed_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()

    alone = torch.stack([_alone(model, s) for s in samples])
    alone.sum().backward()
    torch.testing.assert_close(packed, alone, rtol=1e-5, atol=1e-5)
    for name, p in model.named_parameters():
        torch.testing.assert_close(packed_grads[name], p.grad, rtol=1e-5, atol=1e-6, msg=name)


def test_naive_packing_would_differ() -> None:
    """The check above can fail: without document ids, later documents see earlier ones."""
    model = LlamaForCausalLM(dataclasses.replace(CFG)).eval()
    model.init_weights(1)
    batch = pack(_samples(1, [10, 10], False), seq_len=20)
    with torch.no_grad():
        fenced = model(batch.input_ids, document_ids=batch.document_ids)
        naive = model(batch.input_ids)
    assert torch.allclose(fenced[:, :10], naive[:, :10], atol=1e-6)
    assert not torch.allclose(fenced[:, 10:], naive[:, 10:], atol=1e-3)


def test_labels_never_cross_documents_and_padding_is_ignored() -> None:
    batch = pack(
        [Sample([1, 2, 3]), Sample([4, 5], [False, True]), Sample([6, 7, 8], [True, False, True])], 8
    )
    assert batch.input_ids.tolist() == [[1, 2, 3, 6, 7, 8, 4, 5]]
    assert batch.labels.tolist() == [[2, 3, IGNORE, IGNORE, 8, IGNORE, 5, IGNORE]]
    assert batch.position_ids.tolist() == [[0, 1, 2, 0, 1, 2, 0, 1]]
    padded = pack([Sample([1, 2, 3])], 5)
    assert padded.document_ids.tolist() == [[0, 0, 0, -1, -1]] and padded.padding_fraction == 0.4
    assert padded.labels.tolist() == [[2, 3, IGNORE, IGNORE, IGNORE]]


def test_document_attention_mask_by_hand() -> None:
    positions, mask = document_attention(torch.tensor([[0, 0, 1, 1, 1, -1]]))
    assert positions.tolist() == [[0, 1, 0, 1, 2, 0]]
    expected = torch.tensor(
        [
            [1, 0, 0, 0, 0, 0],
            [1, 1, 0, 0, 0, 0],
            [0, 0, 1, 0, 0, 0],
            [0, 0, 1, 1, 0, 0],
            [0, 0, 1, 1, 1, 0],
            [0, 0, 0, 0, 0, 1],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(mask[0, 0], expected)


@pytest.mark.parametrize(
    ("samples", "says"),
    [
        ([Sample(list(range(9)))], "has 9 tokens; each must have 1..8"),
        ([Sample([])], "has 0 tokens"),
        ([Sample([1, 2], [True])], "1 loss-mask entries for 2 tokens"),
        ([], "no samples"),
    ],
)
def test_bad_samples_say_what_to_change(samples: list[Sample], says: str) -> None:
    with pytest.raises(ValueError, match=says.replace(".", r"\.")):
        pack(samples, 8)
