"""`zerotron dpo`: preference pairs, the reference log-probs and the pair losses.

The references are independent of the code under test: TRL's ``DPOTrainer`` (its tokenisation of the
pairs, and its loss and gradients on a batch, with a separate reference model) for DPO and IPO; SimPO's
published formula over transformers' own log-probs. Layouts are then checked against the single
process, the reference pass included (each layout computes it itself).
"""

from __future__ import annotations

import dataclasses
import json
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import transformers

from tests.harness import run_distributed
from tests.test_hf_io import CFG
from zerotron.build.source import resolve_model
from zerotron.components.data import DataError
from zerotron.components.preference import reference_logps
from zerotron.components.preference_data import PreferenceDataset, prepare_preference
from zerotron.config import Config
from zerotron.config_check import validate
from zerotron.config_load import ConfigError, load_config
from zerotron.distributed.launch import current_rank_and_world
from zerotron.distributed.mesh import Mesh, ParallelDims
from zerotron.finetune.dpo import DPO_DEFAULTS
from zerotron.models.hf import to_hf_name, write_hf_directory
from zerotron.models.llama import LlamaForCausalLM
from zerotron.models.tokenizer import ByteTokenizer
from zerotron.train.trainer import Trainer

WORDS = ["cat", "dog", "sun", "sea", "red", "big", "tree", "rain"]


def _model_dir(path: Path, seed: int) -> Path:
    model = LlamaForCausalLM(dataclasses.replace(CFG, vocab_size=300, max_position_embeddings=256))
    model.init_weights(seed)
    write_hf_directory(model, path)
    for name, text in ByteTokenizer().to_files().items():  # the byte tokenizer, for TRL
        (path / name).write_text(text, encoding="utf-8")
    return path


def _pairs(n: int, seed: int = 0, kind: str = "messages") -> list[dict[str, Any]]:
    rng = random.Random(seed)
    rows: list[dict[str, Any]] = []
    for _ in range(n):
        q = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 4)))
        good, bad = q.upper(), " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 5)))
        if kind == "plain-text":
            rows.append({"prompt": f"say {q}:", "chosen": f" {good}", "rejected": f" {bad}"})
        elif kind == "implicit-prompt":  # TRL's: whole conversations sharing their start
            user = [{"role": "user", "content": q}]
            rows.append(
                {
                    "chosen": [*user, {"role": "assistant", "content": good}],
                    "rejected": [*user, {"role": "assistant", "content": bad}],
                }
            )
        else:
            rows.append(
                {
                    "prompt": [{"role": "user", "content": q}],
                    "chosen": [{"role": "assistant", "content": good}],
                    "rejected": [{"role": "assistant", "content": bad}],
                }
            )
    return rows


def _write(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def _config(model: Path, data: Path, *overrides: str) -> Config:
    defaults = {**DPO_DEFAULTS, "model.path": str(model), "data.source": str(data)}
    common = [
        "data.tokenizer=byte",
        "train.seq_len=64",
        "train.warmup_steps=0",
        "train.schedule=constant",
        "train.lr=1e-3",
        "log.progress=none",
    ]
    return resolve_model(load_config(None, [*common, *overrides], defaults=defaults))


def _trl(policy: Path, ref: Path, rows: list[dict[str, Any]], loss: str, tmp: Path) -> Any:
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    args = DPOConfig(
        output_dir=str(tmp / "trl"),
        per_device_train_batch_size=len(rows),
        beta=0.1,
        loss_type=[loss],
        max_length=None,
        report_to=[],
        use_cpu=True,
        bf16=False,
    )
    load = transformers.AutoModelForCausalLM.from_pretrained
    return DPOTrainer(
        model=load(str(policy), dtype=torch.float32),
        ref_model=load(str(ref), dtype=torch.float32),
        args=args,
        train_dataset=Dataset.from_list(rows),
        processing_class=transformers.AutoTokenizer.from_pretrained(str(policy)),
    )


@pytest.mark.parametrize("kind", ["messages", "implicit-prompt", "plain-text"])
def test_pairs_are_tokenised_as_trl_tokenises_them(tmp_path: Path, kind: str) -> None:
    base = _model_dir(tmp_path / "base", 3)
    rows = _pairs(6, kind=kind)
    cfg = _config(base, _write(tmp_path / "pairs.jsonl", rows))
    data = prepare_preference(cfg.data, ByteTokenizer(), cfg.train.seq_len, pad_id=257)
    trl = _trl(base, base, rows, "sigmoid", tmp_path)
    for k in range(len(rows)):
        want = trl.train_dataset[k]
        for j, answer in enumerate(("chosen_ids", "rejected_ids")):
            ids, labels = data.rows[0, 2 * k + j], data.rows[1, 2 * k + j]
            n = len(want["prompt_ids"]) + len(want[answer])
            assert ids[:n].tolist() == want["prompt_ids"] + want[answer]
            # the labels count the answer's tokens: position t predicts token t+1
            counted = np.flatnonzero(labels != -100)
            assert counted.tolist() == list(range(len(want["prompt_ids"]) - 1, n - 1))


def _grads_body(cfg_ref: Config, cfg: Config, rows: np.ndarray, run_dir: str) -> dict[str, Any]:
    """The reference pass with the reference model, then one forward and backward of every pair with
    the policy; the loss and the gradients by Hugging Face name."""
    rank, world = current_rank_and_world()
    mesh = Mesh(ParallelDims.from_config(cfg.parallel, world), rank)
    dataset = PreferenceDataset(rows)
    reference = Trainer(cfg_ref, mesh, Path(run_dir) / "ref", dataset)
    dataset.reference = reference_logps(reference.model, dataset, mesh, cfg_ref, reference.device)
    trainer = Trainer(cfg, mesh, Path(run_dir), dataset)
    micro = [dataset.batch(np.arange(len(dataset)))]
    loss = trainer.runner.forward_backward(micro, 1.0, trainer.device, len(dataset)) / len(dataset)
    grads = {to_hf_name(n): p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
    return {"loss": float(loss), "grads": grads, "metrics": trainer.runner.metrics()}


@pytest.mark.parametrize("loss", ["sigmoid", "ipo"])
def test_loss_and_gradients_equal_trl(tmp_path: Path, loss: str) -> None:
    base, policy = _model_dir(tmp_path / "base", 3), _model_dir(tmp_path / "policy", 5)
    rows = _pairs(6)
    data = _write(tmp_path / "pairs.jsonl", rows)
    common = ["lora.rank=0", f"preference.loss={loss}", "train.global_batch=6", "train.micro_batch=6"]
    cfg_ref, cfg = _config(base, data, *common), _config(policy, data, *common)
    packed = prepare_preference(cfg.data, ByteTokenizer(), cfg.train.seq_len, pad_id=257).rows
    ours = run_distributed(_grads_body, 1, cfg_ref, cfg, packed, str(tmp_path / "run"))[0]

    trl = _trl(policy, base, rows, loss, tmp_path)
    batch = trl.data_collator([trl.train_dataset[k] for k in range(len(rows))])
    trl.model.train()  # TRL logs its figures under "train" (the tiny model has no dropout)
    want = trl.compute_loss(trl.model, batch)
    want.backward()
    assert abs(ours["loss"] - want.item()) <= 1e-5 * abs(want.item())
    assert loss != "sigmoid" or abs(want.item() - np.log(2)) > 1e-3  # a policy apart from its reference
    named = dict(trl.model.named_parameters())
    assert sorted(ours["grads"]) == sorted(n for n, p in named.items() if p.grad is not None)
    for name, grad in ours["grads"].items():
        ref = named[name].grad
        assert ((grad - ref).norm() / ref.norm()).item() <= 1e-5, name
    # the implicit rewards TRL logs: beta times a difference of two log-probs near -60 (fp32: ~1e-6)
    metrics = trl._metrics["train"]
    assert ours["metrics"]["rewards_chosen"] == pytest.approx(metrics["rewards/chosen"][-1], abs=1e-5)
    assert ours["metrics"]["reward_margin"] == pytest.approx(metrics["rewards/margins"][-1], abs=1e-5)


def test_simpo_equals_its_formula_on_transformers_log_probs(tmp_path: Path) -> None:
    base = _model_dir(tmp_path / "base", 3)
    rows = _pairs(4)
    data = _write(tmp_path / "pairs.jsonl", rows)
    simpo = ["preference.loss=simpo", "preference.beta=2.0", "train.global_batch=4", "train.micro_batch=4"]
    cfg = _config(base, data, "lora.rank=0", *simpo)
    packed = prepare_preference(cfg.data, ByteTokenizer(), cfg.train.seq_len, pad_id=257).rows
    ours = run_distributed(_grads_body, 1, cfg, cfg, packed, str(tmp_path / "run"))[0]

    hf = transformers.AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    ids, labels = torch.from_numpy(packed[0]).long(), torch.from_numpy(packed[1]).long()
    logp = torch.log_softmax(hf(input_ids=ids).logits, dim=-1)
    mask = labels != -100
    token = logp.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    mean = (token * mask).sum(1) / mask.sum(1)  # SimPO: the length-normalised log-prob
    want = -F.logsigmoid(2.0 * (mean[0::2] - mean[1::2]) - cfg.preference.simpo_gamma).mean()
    assert ours["loss"] == pytest.approx(want.item(), rel=1e-5)


def _train_body(cfg: Config, rows: np.ndarray, run_dir: str, steps: int) -> dict[str, Any]:
    rank, world = current_rank_and_world()
    mesh = Mesh(ParallelDims.from_config(cfg.parallel, world), rank)
    dataset = PreferenceDataset(rows)
    trainer = Trainer(cfg, mesh, Path(run_dir), dataset)
    dataset.reference = reference_logps(trainer.model, dataset, mesh, cfg, trainer.device)
    history = [trainer.train_step() for _ in range(steps)]
    return {
        "losses": [r["loss"] for r in history],
        "accuracy": [r["reward_accuracy"] for r in history],
        "margin": [r["reward_margin"] for r in history],
        "reference": dataset.reference,
    }


@pytest.mark.parametrize(
    ("world", "layout"),
    [
        (2, ["parallel.zero=3", "lora.rank=0"]),
        (2, ["parallel.zero=2"]),
        (2, ["parallel.tp=2", "lora.rank=0"]),
        (4, ["parallel.tp=2", "parallel.zero=3", "parallel.sequence_parallel=true"]),
        (2, ["parallel.pp=2", "lora.rank=0", "parallel.pp_schedule=gpipe"]),
        (4, ["parallel.pp=2", "parallel.tp=2", "parallel.pp_schedule=zb"]),
        (4, ["parallel.pp=2", "parallel.zero=1", "train.global_batch=8"]),
        (2, ["parallel.cp=2", "lora.rank=0"]),
        (4, ["parallel.cp=2", "parallel.zero=2", "parallel.cp_comm=allgather"]),
        (4, ["parallel.pp=2", "parallel.cp=2", "lora.rank=0"]),
    ],
    ids=[
        "dp2-zero3-full",
        "dp2-zero2-lora",
        "tp2-full",
        "dp2-tp2-sp-zero3-lora",
        "pp2-gpipe-full",
        "pp2-tp2-zb-lora",
        "dp2-pp2-zero1-lora",
        "cp2-ring-full",
        "dp2-cp2-allgather-zero2-lora",
        "pp2-cp2-full",
    ],
)
def test_dpo_layouts_equal_single_process(tmp_path: Path, world: int, layout: list[str]) -> None:
    base = _model_dir(tmp_path / "base", 3)
    data = _write(tmp_path / "pairs.jsonl", _pairs(16))
    adapters = [x for x in layout if x.startswith("lora.")]
    batch = [x for x in layout if x.startswith("train.global_batch")] or ["train.global_batch=4"]
    one = _config(base, data, *batch, "train.micro_batch=2", *adapters)
    rows = prepare_preference(one.data, ByteTokenizer(), one.train.seq_len, pad_id=257).rows
    ref = run_distributed(_train_body, 1, one, rows, str(tmp_path / "one"), 3)[0]
    cfg = _config(base, data, *batch, "train.micro_batch=1", *layout)
    validate(cfg, world)
    got = run_distributed(_train_body, world, cfg, rows, str(tmp_path / "many"), 3)
    np.testing.assert_allclose(got[0]["reference"], ref["reference"], rtol=1e-5)
    np.testing.assert_allclose(got[0]["losses"], ref["losses"], rtol=1e-5)
    np.testing.assert_allclose(got[0]["margin"], ref["margin"], atol=1e-5)
    # at step 1 the policy is its reference: every reward is 0 up to rounding, and which answer's is
    # higher is a coin toss of the summation order; after it the rewards are apart
    assert got[0]["accuracy"][1:] == ref["accuracy"][1:]
    assert ref["losses"][0] == pytest.approx(np.log(2), abs=1e-6)  # the policy starts as its reference
    assert ref["losses"][-1] < ref["losses"][0]


def test_dpo_bf16_zero3_tracks_the_single_process(tmp_path: Path) -> None:
    """bf16 (16-bit working weights, fp32 masters) under dp 2 x ZeRO-3: the reference pass and the
    losses within bf16's reach of the single process's bf16 run."""
    base = _model_dir(tmp_path / "base", 3)
    data = _write(tmp_path / "pairs.jsonl", _pairs(16))
    one = _config(base, data, "train.global_batch=4", "train.micro_batch=2", "train.precision=bf16")
    rows = prepare_preference(one.data, ByteTokenizer(), one.train.seq_len, pad_id=257).rows
    ref = run_distributed(_train_body, 1, one, rows, str(tmp_path / "one"), 3)[0]
    layout = ["parallel.zero=3", "parallel.persist_numel=0", "train.precision=bf16"]
    cfg = _config(base, data, "train.global_batch=4", "train.micro_batch=1", *layout)
    got = run_distributed(_train_body, 2, cfg, rows, str(tmp_path / "many"), 3)[0]
    # summed answer log-probs from bf16 logits, another summation order
    # (measured: 1.2e-4 and 4e-4 apart; a missing or doubled rank's share is O(1))
    np.testing.assert_allclose(got["reference"], ref["reference"], rtol=1e-3)
    np.testing.assert_allclose(got["losses"], ref["losses"], rtol=2e-3)
    assert np.isfinite(got["losses"]).all() and got["losses"][-1] < got["losses"][0]


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "zerotron", *args], cwd=cwd, capture_output=True, text=True, timeout=600
    )


def test_dpo_command_trains_and_resumes_with_its_reference(tmp_path: Path) -> None:
    base = _model_dir(tmp_path / "base", 3)
    data = _write(tmp_path / "pairs.jsonl", _pairs(16))
    args = [
        "dpo",
        str(base),
        str(data),
        "data.tokenizer=byte",
        "train.seq_len=64",
        "train.global_batch=4",
        "train.lr=1e-3",
        "train.warmup_steps=0",
        "train.sample_every=0",
        "checkpoint.every=2",
        "--nproc",
        "2",
    ]
    straight = _cli(*args, "train.steps=4", "--out", str(tmp_path / "a"), cwd=tmp_path)
    assert straight.returncode == 0, straight.stderr[-3000:]
    assert "reference log-probs of 16 pairs" in straight.stdout
    records = [json.loads(line) for line in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 4 and {"reward_accuracy", "reward_margin"} <= set(records[-1])
    assert (tmp_path / "a" / "adapter" / "adapter_model.safetensors").exists()
    # a crash after step 2: the restart reads the saved reference, not the trained weights'
    crashed = _cli(*args, "train.steps=4", "fault.inject=crash:rank=1,step=3", "--max-restarts", "1",
                   "--out", str(tmp_path / "b"), cwd=tmp_path)  # fmt: skip
    assert crashed.returncode == 0, crashed.stderr[-3000:]
    again = [json.loads(line) for line in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    np.testing.assert_allclose([r["loss"] for r in again], [r["loss"] for r in records], rtol=1e-6)


def test_bad_pairs_are_named_or_skipped_and_counted(tmp_path: Path) -> None:
    base = _model_dir(tmp_path / "base", 3)
    rows: list[Any] = _pairs(3)
    rows.insert(1, {"prompt": "hi", "chosen": "there"})  # line 2: no rejected answer
    rows.append({"prompt": "hi", "chosen": 3, "rejected": "x"})  # line 5: not text
    data = _write(tmp_path / "pairs.jsonl", rows)
    with pytest.raises(DataError, match=r"pairs.jsonl:2: missing field rejected"):
        prepare_preference(_config(base, data).data, ByteTokenizer(), 64)
    skipped = prepare_preference(_config(base, data, "data.on_error=skip").data, ByteTokenizer(), 64)
    assert skipped.pairs == 3 and len(skipped.skipped) == 2
    assert "pairs.jsonl:5: chosen must be a string" in skipped.skipped[1]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["data.packing=true"], "set data.packing=false"),
        (["data.loss_on=all"], "leave data.loss_on out"),
        (["preference.loss=kto"], "preference.loss"),
        (["preference.beta=0"], "preference.beta=0.0 must be a positive number"),
    ],
)
def test_unbuilt_or_bad_settings_are_refused(tmp_path: Path, overrides: list[str], message: str) -> None:
    base = _model_dir(tmp_path / "base", 3)
    cfg = _config(base, _write(tmp_path / "p.jsonl", _pairs(2)), "train.global_batch=2", *overrides)
    with pytest.raises(ConfigError, match=message):
        validate(cfg, 2)


def test_preference_keys_on_other_data_are_refused() -> None:
    cfg = load_config(None, ["preference.beta=0.5"])
    with pytest.raises(ConfigError, match="preference.beta=0.5 sets the preference loss"):
        validate(cfg, 2)


def test_the_planner_counts_a_pair_as_two_rows() -> None:
    from zerotron.plan.layout import from_config

    common = ["model.preset=tiny", "train.global_batch=8", "train.micro_batch=2"]
    _, pairs, work = from_config(load_config(None, [*common, "data.format=preference"]), 2)
    rows = load_config(None, ["model.preset=tiny", "train.global_batch=16", "train.micro_batch=4"])
    _, layout, want = from_config(rows, 2)
    assert (pairs.micro_batch, work.global_batch) == (layout.micro_batch, want.global_batch) == (4, 16)
