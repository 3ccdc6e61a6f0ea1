"""GRPO's arithmetic (``zerotron grpo``): group-normalised advantages and the clipped policy loss.

The formulas are TRL's ``GRPOTrainer``'s (Shao et al. 2024; DAPO, Yu et al. 2025; Dr. GRPO, Liu et al.
2025), written here on plain tensors so that the rollout loop (:mod:`zerotron.finetune.grpo`) and the
tests share them:

- advantages (:func:`group_advantages`): each completion's reward less its group's mean, divided by
  the group's (or the global batch's) unbiased std + 1e-4; a reward that is NaN (its function raised or
  returned NaN) is left out of its group's statistics and gets advantage 0;
- the per-token loss (:func:`token_losses`): ``-min(r A, clip(r, 1 - eps, 1 + eps_high) A)`` with
  ``r = exp(logp - logp_old)``, plus ``beta`` times the k3 estimate of KL to the reference,
  ``exp(ref - logp) - (ref - logp) - 1``, by default times ``r`` (``grpo.kl_bias_correction``: the
  unbiased reverse-KL gradient of DeepSeek-V3.2, TRL's default);
- its sum (:func:`loss_sum`) over what the loss averages: every completion token of the global batch
  (``dapo``), each completion's token mean then the rows (``grpo``), or rows x ``max_new_tokens``
  (``dr_grpo``); :func:`loss_count` is the matching denominator for the whole global batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from zerotron.config import GrpoConfig

STD_EPS = 1e-4  # TRL's


def _nanstd(x: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """The unbiased std ignoring NaNs (TRL's ``nanstd``)."""
    mean = torch.nanmean(x, dim=dim, keepdim=True)
    variance = torch.nanmean((x - mean) ** 2, dim=dim, keepdim=True)
    count = torch.sum(~torch.isnan(x), dim=dim, keepdim=True)
    std = torch.sqrt(variance * count / (count - 1))
    return std if dim is None else std.squeeze(dim)


def group_advantages(rewards: torch.Tensor, group_size: int, scale: str) -> torch.Tensor:
    """(n,) rewards, groups of ``group_size`` in turn -> (n,) advantages (see the module docstring);
    ``scale``: group, batch or none."""
    grouped = rewards.view(-1, group_size)
    mean = torch.nanmean(grouped, dim=1).repeat_interleave(group_size)
    if scale == "batch":
        std = _nanstd(rewards).expand_as(rewards)
    else:
        std = _nanstd(grouped, dim=1).repeat_interleave(group_size)
    advantages = rewards - mean
    if scale != "none":
        advantages = advantages / (std + STD_EPS)
    return torch.nan_to_num(advantages, nan=0.0)


@dataclass
class TokenLosses:
    """A batch's per-token figures, (b, t) each: loss, whether the ratio was clipped, KL (0 without
    a reference)."""

    loss: torch.Tensor
    clipped: torch.Tensor
    kl: torch.Tensor


def token_losses(
    logps: torch.Tensor,
    old_logps: torch.Tensor,
    advantages: torch.Tensor,
    cfg: GrpoConfig,
    ref_logps: torch.Tensor | None = None,
    weights: torch.Tensor | None = None,
) -> TokenLosses:
    """Per-token GRPO loss of ``logps`` (b, t) against the rollouts' ``old_logps`` (b, t) and the rows'
    ``advantages`` (b,); ``weights`` (b, t): an importance-sampling correction per token (tis)."""
    eps_low = cfg.epsilon
    eps_high = cfg.epsilon_high or cfg.epsilon
    adv = advantages[:, None]
    ratio = torch.exp(logps - old_logps)
    clipped_ratio = torch.clamp(ratio, 1 - eps_low, 1 + eps_high)
    loss = -torch.min(ratio * adv, clipped_ratio * adv)
    if weights is not None:
        loss = loss * weights
    clipped = ((ratio < 1 - eps_low) & (adv < 0)) | ((ratio > 1 + eps_high) & (adv > 0))
    kl = torch.zeros_like(loss)
    if cfg.beta != 0.0:
        assert ref_logps is not None, "grpo.beta > 0 needs the reference log-probs"
        delta = ref_logps - logps
        kl = torch.exp(delta) - delta - 1
        loss = loss + cfg.beta * (kl * ratio if cfg.kl_bias_correction else kl)
    return TokenLosses(loss, clipped.detach(), kl.detach())


def loss_sum(per_token: torch.Tensor, mask: torch.Tensor, kind: str) -> torch.Tensor:
    """The micro-batch's share of the numerator: the masked tokens' sum (dapo, dr_grpo) or each row's
    token mean summed over rows (grpo)."""
    masked = per_token * mask
    if kind == "grpo":
        return (masked.sum(-1) / mask.sum(-1).clamp(min=1.0)).sum()
    return masked.sum()


def loss_count(kind: str, rows: int, tokens: int, max_new_tokens: int) -> int:
    """The global batch's denominator for :func:`loss_sum`: its completion tokens (dapo), its rows
    (grpo) or rows x ``max_new_tokens`` (dr_grpo)."""
    if kind == "dapo":
        return max(tokens, 1)
    if kind == "grpo":
        return rows
    return rows * max_new_tokens
