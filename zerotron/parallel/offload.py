"""ZeRO-Offload's optimizer half (Ren et al. 2021): master weights, AdamW moments and the step on the host.

:class:`HostAdamW` is a ``torch.optim.AdamW`` over fp32 host copies of the rank's shard segments (pinned
memory where a GPU is present). Its step copies the segments' gradients to the host, runs torch's
``foreach`` AdamW on the CPU tensors (the vectorised CPU Adam) and copies the updated values back into
the segments, which are views of the device's working parameters. The device then holds no optimizer
state at all: the host holds the master copy and the two moments, K = 12 bytes per parameter of the
shard, which ``state_bytes`` reports as optimizer state.

Checkpoints see the moments through :meth:`HostAdamW.key`: ZeRO's gather and load functions look a
segment's state up under its host copy.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from zerotron.config import TrainConfig


class HostAdamW(torch.optim.AdamW):
    """AdamW whose parameters are host copies of the device segments ``decay`` and ``no_decay``."""

    def __init__(self, decay: list[nn.Parameter], no_decay: list[nn.Parameter], cfg: TrainConfig) -> None:
        pin = torch.cuda.is_available()
        self.device_params = decay + no_decay
        self.host_params = [self._host_copy(p, pin) for p in self.device_params]
        self.host_of = {id(d): h for d, h in zip(self.device_params, self.host_params)}
        hosts_decay, hosts_plain = self.host_params[: len(decay)], self.host_params[len(decay) :]
        groups = [
            {"params": hosts_decay, "weight_decay": cfg.weight_decay},
            {"params": hosts_plain, "weight_decay": 0.0},
        ]
        super().__init__(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, foreach=True)

    @staticmethod
    def _host_copy(p: nn.Parameter, pin: bool) -> nn.Parameter:
        host = torch.empty(p.shape, dtype=torch.float32, device="cpu", pin_memory=pin)
        host.copy_(p.detach())
        return nn.Parameter(host)

    def key(self, device_param: torch.Tensor) -> torch.Tensor:
        """The tensor under which ``device_param``'s AdamW state is kept (its host copy)."""
        return self.host_of[id(device_param)]

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        """Gradients to the host, AdamW there, updated weights back to the device segments."""
        for d, h in zip(self.device_params, self.host_params):
            h.grad = None if d.grad is None else d.grad.detach().to("cpu", torch.float32, non_blocking=True)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        out = super().step(closure)
        for d, h in zip(self.device_params, self.host_params):
            d.copy_(h, non_blocking=True)
        return out

    def master_bytes(self) -> int:
        """Bytes of the fp32 host master copy."""
        return sum(h.numel() * h.element_size() for h in self.host_params)

    def sync_from_device(self) -> None:
        """Take the device segments' values into the host master copy (after a checkpoint load)."""
        with torch.no_grad():
            for d, h in zip(self.device_params, self.host_params):
                h.copy_(d.detach())


def state_key(optimizer: torch.optim.Optimizer, param: torch.Tensor) -> torch.Tensor:
    """Where ``optimizer`` keeps ``param``'s state: its host copy under offload, else ``param`` itself."""
    return optimizer.key(param) if isinstance(optimizer, HostAdamW) else param
