"""Learning-rate schedule, gradient clipping and the fp16 loss scaler against hand-computed values."""

from __future__ import annotations

import math

import torch

from zerotron.components.optim import DynamicLossScaler, clip_grads_, global_grad_norm, lr_at
from zerotron.config import TrainConfig


def test_warmup_then_cosine_matches_formula() -> None:
    cfg = TrainConfig(steps=110, lr=1.0, min_lr=0.1, warmup_steps=10, schedule="cosine")
    assert lr_at(0, cfg) == 0.1  # (0 + 1) / 10
    assert lr_at(9, cfg) == 1.0
    assert lr_at(10, cfg) == 1.0
    mid = 10 + 50
    assert math.isclose(lr_at(mid, cfg), 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert math.isclose(lr_at(110, cfg), 0.1)


def test_linear_and_constant() -> None:
    lin = TrainConfig(steps=20, lr=2.0, min_lr=0.0, warmup_steps=0, schedule="linear")
    assert [lr_at(s, lin) for s in (0, 10, 20)] == [2.0, 1.0, 0.0]
    const = TrainConfig(steps=20, lr=0.5, warmup_steps=0, schedule="constant")
    assert lr_at(13, const) == 0.5


def test_global_norm_and_clip_equal_torch() -> None:
    torch.manual_seed(0)
    a = [torch.nn.Parameter(torch.randn(5, 3)) for _ in range(3)]
    b = [torch.nn.Parameter(p.detach().clone()) for p in a]
    for p, q in zip(a, b):
        g = torch.randn_like(p) * 3
        p.grad, q.grad = g.clone(), g.clone()
    ref = torch.nn.utils.clip_grad_norm_(b, 1.0)
    norm = global_grad_norm(a)
    clip_grads_(a, norm, 1.0)
    assert torch.allclose(norm, ref)
    for p, q in zip(a, b):
        assert torch.allclose(p.grad, q.grad, rtol=1e-6, atol=1e-7)


def test_loss_scaler_halves_on_overflow_and_grows_after_window() -> None:
    s = DynamicLossScaler(init_scale=1024, window=3)
    s.update(overflow=True)
    assert (s.scale, s.skipped) == (512, 1)
    for _ in range(3):
        s.update(overflow=False)
    assert s.scale == 1024
    restored = DynamicLossScaler()
    restored.load_state_dict(s.state_dict())
    assert restored.state_dict() == s.state_dict()
