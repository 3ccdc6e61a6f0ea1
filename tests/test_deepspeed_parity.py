"""zerotron's ZeRO-1/2/3 train like DeepSpeed's ZeRO-1/2/3 (fp32, CPU, Gloo, dp=2, 10 steps).

Both frameworks start from the same weights (zerotron's ``LlamaForCausalLM(cfg.model).init_weights(seed)``),
read the same micro-batches (zerotron's ``DataLoader`` over a ``PackedDataset``, as in
tests/test_train_dp.py) and use the same hyper-parameters (tests/test_train_dp.py's ``BASE``: AdamW, two
parameter groups, clipping at 1.0, constant lr 3e-4). Each rank runs two accumulated micro-batches of
two sequences per step. DeepSpeed 0.19 runs on its CPU accelerator (``DS_ACCELERATOR=cpu``) over Gloo
(``deepspeed.init_distributed(dist_backend="gloo")``), each rank a subprocess of tests/harness.py with
torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT).

What makes the two computations the same:

- **Gradient averaging.** DeepSpeed divides each micro-batch's loss by ``gradient_accumulation_steps``
  in ``engine.backward`` and averages the reduced gradients over the dp ranks; with a per-micro-batch
  mean loss and equal token counts that is the mean over the global batch, which zerotron gets by
  scaling summed token losses by ``1 / (global_batch * seq_len)`` and summing over dp.
- **Clipping.** ``gradient_clipping: 1.0``: DeepSpeed divides the fp32 gradient partitions by
  ``(norm + 1e-6) / 1.0`` when that exceeds 1, with ``norm`` the global norm over every partition;
  zerotron (like ``torch.nn.utils.clip_grad_norm_``) multiplies by ``1.0 / (norm + 1e-6)`` clamped to 1.
- **Optimizer.** ``torch.optim.AdamW`` is passed as DeepSpeed's client optimizer with zerotron's two
  groups (matrices decayed, norm gains not) and ``zero_allow_untested_optimizer: true`` (without it
  DeepSpeed refuses a non-DeepSpeed optimizer under ZeRO); DeepSpeed wraps it over its fp32 flat
  partitions, as zerotron does over its shard segments: AdamW is element-wise, so both equal the
  unsharded update. No ``fp16``/``bf16`` section: fp32 throughout, no loss scaling. No scheduler: the
  client optimizer's constant lr.

The loss trajectories must agree within 1e-4 relative and the final weights (DeepSpeed's ZeRO-3 ones
gathered with ``deepspeed.zero.GatheredParameters``, zerotron's with ``full_params``) within 1e-5
norm-wise relative, the project's fp32 bound. Measured: ZeRO-1 and ZeRO-2 agree bit for bit (every
scaling above is a power of two, and both step the same torch AdamW on the same values); ZeRO-3 by
1.7e-7 (losses) and 2.3e-6 (weights), a difference of summation order inside DeepSpeed's stage-3
path. Training zerotron with ``weight_decay=0`` instead moves the weights 3e-4 away from DeepSpeed's
(the losses only 4e-6), so the weight bound is what catches a wrong hyper-parameter. The first
DeepSpeed run on a machine
JIT-compiles DeepSpeed's shared-memory communication op (~45 s, cached in ~/.cache/torch_extensions).
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tests.harness import run_distributed
from tests.test_train_dp import BASE, STEPS, _tokens
from zerotron.components.data import DataLoader, PackedDataset
from zerotron.config_load import load_config
from zerotron.distributed.launch import current_rank_and_world
from zerotron.distributed.mesh import Mesh, ParallelDims
from zerotron.models.llama import LlamaForCausalLM
from zerotron.train.trainer import Trainer

if importlib.util.find_spec("deepspeed") is None:  # a dev dependency: its absence is an error, not a skip
    raise ImportError("tests/test_deepspeed_parity.py needs DeepSpeed: pip install -e '.[dev]'")

LOSS_RTOL, WEIGHT_RTOL = 1e-4, 1e-5
COMMON = [*BASE, "parallel.dp=2", "train.micro_batch=2", "parallel.persist_numel=100"]


def _deepspeed_body(
    overrides: list[str], tokens: np.ndarray, stage: int, extra: dict | None = None, bf16: bool = False
) -> dict:
    """DeepSpeed's engine on the same weights and batches (``extra``: more ``zero_optimization`` keys;
    ``bf16``: its ``bf16`` mode, 16-bit working weights with fp32 master partitions)."""
    os.environ["DS_ACCELERATOR"] = "cpu"
    import deepspeed
    import torch.distributed as dist

    deepspeed.init_distributed(dist_backend="gloo")
    cfg = load_config(None, overrides)
    t = cfg.train
    rank, world = current_rank_and_world()
    model = LlamaForCausalLM(cfg.model)
    model.init_weights(t.seed)
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": t.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=t.lr,
        betas=(t.beta1, t.beta2),
        eps=t.eps,
    )
    accumulation = t.global_batch // (t.micro_batch * world)
    ds_config = {
        "train_batch_size": t.global_batch,
        "train_micro_batch_size_per_gpu": t.micro_batch,
        "gradient_accumulation_steps": accumulation,
        "gradient_clipping": t.grad_clip,
        "zero_optimization": {"stage": stage, **(extra or {})},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
        **({"bf16": {"enabled": True}} if bf16 else {}),
    }
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)
    loader = DataLoader(PackedDataset(tokens, t.seq_len), t.global_batch, t.micro_batch, rank, world, t.seed)
    losses = []
    for _ in range(STEPS):
        total = torch.zeros(())
        for x, y in loader.next_step():
            loss = F.cross_entropy(engine(x).float().flatten(0, 1), y.flatten())  # micro-batch mean
            engine.backward(loss)
            engine.step()  # steps the optimizer on the last micro-batch of the step
            total += loss.detach()
        dist.all_reduce(total)
        losses.append(total.item() / (world * accumulation))
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters()), enabled=stage == 3):
        weights = {k: v.detach().clone() for k, v in engine.module.named_parameters()}
    return {"losses": losses, "weights": weights}


def _zerotron_body(overrides: list[str], tokens: np.ndarray, run_dir: str) -> dict:
    cfg = load_config(None, overrides)
    rank, world = current_rank_and_world()
    trainer = Trainer(cfg, Mesh(ParallelDims.from_config(cfg.parallel, world), rank), Path(run_dir), tokens)
    losses = [trainer.train_step()["loss"] for _ in range(STEPS)]
    assert trainer.zero is not None
    with trainer.zero.full_params():
        weights = {k: v.detach().clone() for k, v in trainer.model.named_parameters()}
    return {"losses": losses, "weights": weights}


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_matches_deepspeed(stage: int, tmp_path: Path) -> None:
    tokens = _tokens()
    overrides = [*COMMON, f"parallel.zero={stage}"]
    theirs = run_distributed(_deepspeed_body, 2, overrides, tokens, stage, timeout=300)
    ours = run_distributed(_zerotron_body, 2, overrides, tokens, str(tmp_path), timeout=300)
    for got in ours:
        np.testing.assert_allclose(got["losses"], theirs[0]["losses"], rtol=LOSS_RTOL)
        assert got["weights"].keys() == theirs[0]["weights"].keys()
        for name, ref in theirs[0]["weights"].items():
            rel = ((got["weights"][name] - ref).norm() / ref.norm()).item()
            assert rel <= WEIGHT_RTOL, f"{name}: relative difference {rel:.3g} > {WEIGHT_RTOL:g}"
    assert ours[0]["losses"][-1] < ours[0]["losses"][0]


# -- bf16: DeepSpeed's ``bf16`` mode (16-bit working weights, fp32 master partitions) -----------------


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_bf16_matches_deepspeed_bf16(stage: int, tmp_path: Path) -> None:
    """bf16 ZeRO-1/2/3 against DeepSpeed's bf16 mode at the same stage, from the same weights and
    batches: both keep 16-bit working weights made from fp32 master partitions, so the loss
    trajectories agree within bf16's own spread (the single process's bf16 run moves up to 1e-3 from
    fp32; tests/test_precision.py). Gradients: zerotron reduces them in fp32 (``grad_reduce_dtype``)."""
    tokens = _tokens()
    overrides = [*COMMON, f"parallel.zero={stage}", "train.precision=bf16"]
    extra = {"stage3_param_persistence_threshold": 100}
    theirs = run_distributed(_deepspeed_body, 2, overrides, tokens, stage, extra, True, timeout=300)[0]
    theirs = theirs["losses"]
    ours = run_distributed(_zerotron_body, 2, overrides, tokens, str(tmp_path), timeout=300)[0]["losses"]
    assert ours[0] == theirs[0]  # the first step's forward: the same 16-bit weights, bit for bit
    # Measured: 2e-5 relative at most over 10 steps at ZeRO-3 (DeepSpeed's fp32 run is 3e-5 away).
    np.testing.assert_allclose(ours, theirs, rtol=1e-4)


def test_hybrid_zero3_matches_deepspeed_hpz(tmp_path: Path) -> None:
    """ZeRO-3 hybrid sharding (dp 4, blocks of 2) against DeepSpeed's ZeRO++ hpZ
    (``zero_hpz_partition_size: 2``, its secondary partition of the weights inside a block), fp32,
    from the same weights and batches: the same losses and weights as at ZeRO-3 (1e-4, 1e-5)."""
    tokens = _tokens()
    overrides = [*BASE, "parallel.dp=4", "train.micro_batch=1", "parallel.persist_numel=100"]
    hpz = {"zero_hpz_partition_size": 2}
    theirs = run_distributed(_deepspeed_body, 4, overrides, tokens, 3, hpz, timeout=300)[0]
    ours = run_distributed(
        _zerotron_body,
        4,
        [*overrides, "parallel.zero=3", "parallel.zero_shard_size=2"],
        tokens,
        str(tmp_path),
        timeout=300,
    )[0]
    np.testing.assert_allclose(ours["losses"], theirs["losses"], rtol=LOSS_RTOL)
    for name, ref in theirs["weights"].items():
        rel = ((ours["weights"][name] - ref).norm() / ref.norm()).item()
        assert rel <= WEIGHT_RTOL, f"{name}: relative difference {rel:.3g} > {WEIGHT_RTOL:g}"
