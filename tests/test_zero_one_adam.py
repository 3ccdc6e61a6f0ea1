"""0/1 Adam: its schedule against DeepSpeed's step-by-step counters written here, its first steps against
torch's AdamW, training on 2 ranks beside AdamW (the bytes of each kind of step, the replicas equal
after every synchronisation and apart between them, the loss close to AdamW's), a resume that gives
the uninterrupted run's losses, and the DeepSpeed and refused settings."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tests.harness import run_distributed
from tests.test_onebit_adam import TINY, _tokens
from zerotron.config_check import validate
from zerotron.config_load import ConfigError, load_config
from zerotron.distributed.launch import current_rank_and_world
from zerotron.distributed.mesh import Mesh, ParallelDims
from zerotron.parallel.zero_one import ZeroOneAdam, ZeroOneSchedule


def _deepspeed_counters(steps: int, freeze: int, scaler: int, local_scaler: int, clipper: int) -> list:
    """(variance step?, synchronising step?) of steps 1..``steps`` as DeepSpeed's ZeroOneAdam counts
    them: ``var_interval``/``var_counter`` before the freeze, ``local_step_interval``/
    ``local_step_counter`` after it, updated after each step."""
    out = []
    var_interval, var_counter, local_interval, local_counter = 1, 0, 1, 0
    for t in range(1, steps + 1):
        frozen = t > freeze
        variance = not frozen and t % var_interval == 0
        sync = frozen and t % local_interval == 0
        out.append((variance, sync))
        if not frozen:
            if t % var_interval == 0:
                var_counter += 1
                if var_counter == scaler:
                    var_counter, var_interval = 0, var_interval * 2
        else:
            local_counter += 1
            if local_counter == local_scaler:
                local_counter, local_interval = 0, min(clipper, local_interval * 2)
    return out


@pytest.mark.parametrize(
    ("freeze", "scaler", "local_scaler", "clipper"), [(100, 16, 32678, 16), (300, 3, 7, 16), (50, 1, 1, 4)]
)
def test_schedule_matches_deepspeeds_counters(
    freeze: int, scaler: int, local_scaler: int, clipper: int
) -> None:
    schedule = ZeroOneSchedule(freeze, scaler, local_scaler, clipper)
    expected = _deepspeed_counters(600, freeze, scaler, local_scaler, clipper)
    got = [(schedule.variance(t)[0], schedule.local(t) and schedule.synchronizes(t)) for t in range(1, 601)]
    assert got == expected
    counts = [schedule.variance(t)[1] for t in range(1, 601)]
    assert counts == list(np.cumsum([v for v, _ in expected]))


class _Solo:
    """A group of one rank (the optimizer's communication is then none)."""

    size = 1


def test_variance_steps_are_adamw_then_the_variance_waits() -> None:
    """Through its first variance steps (every step at first) 0/1 Adam is torch's AdamW; on a step that
    is not one the variance stays as it was while the momentum moves on."""
    g = torch.Generator().manual_seed(0)
    a = torch.nn.Parameter(torch.randn(7, 5, generator=g))
    b = torch.nn.Parameter(a.detach().clone())
    schedule = ZeroOneSchedule(var_freeze_step=100, var_update_scaler=3)
    ours = ZeroOneAdam([{"params": [a], "weight_decay": 0.1}], 1e-2, (0.9, 0.95), 1e-8, schedule, _Solo())  # type: ignore[arg-type]
    ref = torch.optim.AdamW([b], lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, foreach=False)
    for step in range(1, 6):  # variance steps 1, 2, 3, then every 2nd: 4 yes, 5 no
        grad = torch.randn(7, 5, generator=g)
        a.grad, b.grad = grad.clone(), grad.clone()
        before = ours.state[a]["exp_avg_sq"].clone() if ours.state else None
        ours.step()
        ref.step()
        if step <= 4:
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
        else:
            assert torch.equal(ours.state[a]["exp_avg_sq"], before)
            torch.testing.assert_close(
                ours.state[a]["exp_avg"], ref.state[b]["exp_avg"], rtol=1e-5, atol=1e-7
            )


FREEZE, STEPS = 12, 40
ZERO_ONE = [
    "train.optimizer=zero_one_adam",
    f"train.zero_one_var_freeze_step={FREEZE}",
    "train.zero_one_var_update_scaler=4",
    "train.zero_one_local_step_scaler=4",
    "train.zero_one_local_step_clipper=4",
]


def _train_body(tmp: str, layout: list[str]) -> dict[str, Any]:
    from zerotron.train.trainer import Trainer

    rank, world = current_rank_and_world()
    out: dict[str, Any] = {}
    for name, overrides in {"adamw": [], "zero_one": ZERO_ONE}.items():
        cfg = load_config(None, [*TINY, *layout, *overrides])
        trainer = Trainer(
            cfg, Mesh(ParallelDims.from_config(cfg.parallel, world), rank), Path(tmp, name), _tokens()
        )
        history, weights = [], []
        for _ in range(STEPS):
            history.append(trainer.train_step())
            weights.append(torch.cat([p.detach().reshape(-1).clone() for p in trainer.model.parameters()]))
        out[name] = {"losses": [r["loss"] for r in history], "comm": [r["comm_bytes"]["dp"] for r in history]}
        out[name]["weights"] = weights
        trainer.close()
    return out


LAYOUTS = {
    "dp": [],
    # 16-bit data parallelism: ZeRO-1's engine, every rank a block of its own (whole fp32 masters)
    "dp_bf16": ["train.precision=bf16"],
    "zero1": ["parallel.zero=1"],
    "zero2_bf16": ["parallel.zero=2", "train.precision=bf16", "train.micro_batch=2"],  # 2 micro-batches
}


@pytest.mark.parametrize("layout", LAYOUTS.values(), ids=LAYOUTS.keys())
def test_training_beside_adamw(tmp_path: Path, layout: list[str]) -> None:
    """Each kind of step sends what it should (ZeRO: its gather of the weights after every step but a
    local one that does not synchronise); the replicas are equal after every synchronisation and apart
    between them; the loss ends within 5% of AdamW's under the same layout."""
    ranks = run_distributed(_train_body, 2, str(tmp_path), layout, timeout=600)
    adamw, ours = ranks[0]["adamw"], ranks[0]["zero_one"]
    schedule = ZeroOneSchedule(FREEZE, 4, 4, 4)
    zero = any(o.startswith("parallel.zero=") for o in layout)  # ZeRO-1/2 (else data parallelism)
    plain = adamw["comm"][-1]
    full = plain["reduce_scatter"] if zero else plain["all_reduce"]
    gather = plain.get("all_gather", 0)  # ZeRO's gather of the weights after a step
    for t, comm in enumerate(ours["comm"], start=1):
        variance, _ = schedule.variance(t)
        sync = schedule.local(t) and schedule.synchronizes(t)
        # ZeRO's gathers: the weights after a step (not after a local step that does not synchronise);
        # in fp32, the variance shards on the first step after a variance step that is not one, and
        # the momentum shards when the local steps start
        gathers = gather * int(sync or not schedule.local(t))
        fp32 = gather * (2 if "train.precision=bf16" in layout else 1)
        if zero and not variance and t > 1 and schedule.variance(t - 1)[0]:
            gathers += fp32
        gathers += fp32 * int(zero and t == FREEZE + 1)
        bits = comm.get("all_to_all", 0) + comm.get("all_gather", 0) - gathers
        if variance:  # the gradients reduced as AdamW's run reduces them
            assert comm.get("reduce_scatter" if zero else "all_reduce") == full and bits == 0, t
        elif not schedule.local(t) or sync:  # the gradients, or the weights' change, as bits (under
            # ZeRO a synchronisation is an all-reduce of the change: the fp32 one is twice the
            # reduce-scatter of the gradients)
            bound = (2 if zero and sync else 1) * full / 20
            assert 0 < bits <= bound and comm.get("all_reduce", 0) <= 16, t
            assert "reduce_scatter" not in comm, t
        else:  # a local step: the loss and the finiteness flag, nothing else
            assert bits == 0 and comm.get("all_reduce", 0) <= 16 and "all_gather" not in comm, t
        same = torch.equal(ranks[0]["zero_one"]["weights"][t - 1], ranks[1]["zero_one"]["weights"][t - 1])
        assert same == (not schedule.local(t) or sync), t  # equal replicas after a synchronisation only
    local = [t for t in range(FREEZE + 1, STEPS + 1) if not schedule.synchronizes(t)]
    assert len(local) >= 10  # the run reached intervals of 4
    assert adamw["losses"][-1] < 0.7 * adamw["losses"][0]
    # single steps swing: compare the mean of the last 8 steps' losses (over both ranks' batches)
    mean = float(np.mean(ours["losses"][-8:]))
    reference = float(np.mean(adamw["losses"][-8:]))
    assert abs(mean - reference) <= 0.05 * reference, (mean, reference)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["parallel.zero=3"], "not ZeRO-3"),
        (["train.precision=fp16"], "not fp16"),
        (["parallel.zero=1", "parallel.offload_optimizer=cpu"], "offloaded optimizer"),
        (["train.precision=bf16", "parallel.grad_reduce_dtype=bf16"], "grad_reduce_dtype=fp32"),
        (["train.grad_clip=1.0"], "train.grad_clip=0"),
        (["train.zero_one_local_step_clipper=0"], "zero_one_local_step_clipper=0: give 1 or more"),
    ],
)
def test_refused_settings(overrides: list[str], message: str) -> None:
    cfg = load_config(None, [*TINY, *ZERO_ONE, *overrides])
    with pytest.raises(ConfigError, match=message) as e:
        validate(cfg, 2)
    assert "\n" not in str(e.value)


def test_schedule_keys_without_zero_one_adam_are_refused() -> None:
    cfg = load_config(None, [*TINY, "train.zero_one_local_step_clipper=8"])
    with pytest.raises(ConfigError, match="set train.optimizer=zero_one_adam") as e:
        validate(cfg, 2)
    assert "\n" not in str(e.value)


def test_deepspeed_zero_one_adam(tmp_path: Path) -> None:
    from zerotron.config_deepspeed import from_deepspeed

    path = tmp_path / "ds.json"
    opt = {"type": "ZeroOneAdam", "params": {"lr": 1e-3, "var_freeze_step": 400, "local_step_clipper": 8}}
    path.write_text(json.dumps({"train_batch_size": 8, "gradient_clipping": 0.0, "optimizer": opt}))
    t = from_deepspeed(str(path), None, [], world_size=2).config.train
    assert (t.optimizer, t.zero_one_var_freeze_step, t.zero_one_local_step_clipper) == (
        "zero_one_adam",
        400,
        8,
    )
    assert (t.zero_one_var_update_scaler, t.zero_one_local_step_scaler, t.lr) == (16, 32678, 1e-3)


@pytest.mark.parametrize("layout", [[], LAYOUTS["zero2_bf16"]], ids=["dp", "zero2_bf16"])
def test_resume_continues_the_run_that_saved(tmp_path: Path, layout: list[str]) -> None:
    """A checkpoint saved between synchronisations synchronises first; resumed at the same world size,
    the run gives the losses of the run that saved it, bit for bit (each rank's errors from its file;
    under ZeRO the whole momentum and denominator gathered again from their shards)."""
    from zerotron.cli import main

    job = [
        *TINY,
        *layout,
        *ZERO_ONE[:1],
        "train.zero_one_var_freeze_step=2",
        "train.zero_one_local_step_scaler=1",
    ]
    # synchronising at steps 3, 4 and 8 (intervals 1, 2, 4): the save at step 6 comes between two
    job += ["train.zero_one_local_step_clipper=4", "checkpoint.every=3"]
    job += ["data.max_bytes=100000", "train.sample_every=0"]
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    assert main(["train", *job, "train.steps=9", "--nproc", "2", "--out", str(whole)]) == 0
    assert main(["train", *job, "train.steps=6", "--nproc", "2", "--out", str(cut)]) == 0
    assert main(["train", *job, "train.steps=9", "--nproc", "2", "--out", str(cut), "--resume", "auto"]) == 0

    def losses(run: Path) -> list[float]:
        return [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]

    assert losses(cut) == losses(whole) and len(losses(whole)) == 9
