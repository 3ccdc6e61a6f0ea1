"""Every input gets a faithful answer: DeepSpeed configs mapped as DeepSpeed means them (checked against
DeepSpeed itself), run directories that cannot be mixed up, and one-line errors for bad values."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest

from tests.harness import run_distributed
from zerotron.checkpoint import store
from zerotron.cli import main
from zerotron.components.optim import lr_at
from zerotron.config_deepspeed import from_deepspeed
from zerotron.config_load import ConfigError
from zerotron.models.tokenizer import ByteTokenizer, HFTokenizer
from zerotron.train import run_dir as run_dir_lock

TINY = [
    "model.num_hidden_layers=2",
    "model.hidden_size=32",
    "model.intermediate_size=64",
    "model.num_attention_heads=4",
    "train.seq_len=32",
    "train.global_batch=4",
    "train.micro_batch=2",
    "data.max_bytes=40000",
    "log.progress=none",
]
STEPS = 12

# DeepSpeed configs as users write them; each runs in DeepSpeed's own engine below.
DS_CONFIGS: dict[str, dict[str, Any]] = {
    "zero3-tutorial": {  # a fine-tuning tutorial's ZeRO-3 config (the zero section is mapped, not run)
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 4,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 2e-5, "weight_decay": 0.01}},
        "scheduler": {
            "type": "WarmupDecayLR",
            "params": {
                "warmup_min_lr": 0,
                "warmup_max_lr": 2e-5,
                "warmup_num_steps": 3,
                "total_num_steps": 10,
            },
        },
        "zero_optimization": {
            "stage": 3,
            "overlap_comm": True,
            "stage3_param_persistence_threshold": 1e4,
            "stage3_prefetch_bucket_size": 5e7,
            "reduce_bucket_size": 5e7,
        },
    },
    "warmup-lr-defaults": {
        "train_batch_size": 8,
        "optimizer": {"type": "Adam", "params": {"lr": 0.01}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 5}},
    },
    "cosine-linear-warmup": {
        "train_batch_size": 16,
        "gradient_accumulation_steps": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "betas": [0.8, 0.9], "eps": 1e-6}},
        "scheduler": {
            "type": "WarmupCosineLR",
            "params": {
                "warmup_num_steps": 4,
                "total_num_steps": 10,
                "warmup_type": "linear",
                "cos_min_ratio": 0.1,
            },
        },
    },
    "micro-only-decay-floor": {
        "train_micro_batch_size_per_gpu": 3,
        "optimizer": {"type": "AdamW", "params": {}},
        "scheduler": {
            "type": "WarmupDecayLR",
            "params": {"warmup_min_lr": 1e-4, "warmup_num_steps": 2, "total_num_steps": 8},
        },
    },
}


def _without_zero(ds: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in ds.items() if k != "zero_optimization"}


def _deepspeed_engine_body(configs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Each config in DeepSpeed's engine: its batch triplet, its optimizer's settings, and the lr of
    each optimizer step (read before the step, as the step uses it)."""
    os.environ["DS_ACCELERATOR"] = "cpu"
    import deepspeed
    import torch

    deepspeed.init_distributed(dist_backend="gloo")
    out = {}
    for name, ds in configs.items():
        model = torch.nn.Linear(4, 4)
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds)
        group = engine.optimizer.param_groups[0]
        lrs = []
        for _ in range(STEPS):
            lrs.append(float(engine.optimizer.param_groups[0]["lr"]))
            for _ in range(engine.gradient_accumulation_steps()):
                engine.backward(engine(torch.ones(engine.train_micro_batch_size_per_gpu(), 4)).sum())
                engine.step()
        out[name] = {
            "batch": [
                engine.train_batch_size(),
                engine.train_micro_batch_size_per_gpu(),
                engine.gradient_accumulation_steps(),
            ],
            "betas": list(group["betas"]),
            "eps": group["eps"],
            "weight_decay": group["weight_decay"],
            "clip": engine.gradient_clipping(),
            "lrs": lrs,
        }
    return out


def _write(tmp_path: Path, name: str, body: dict[str, Any]) -> str:
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(body))
    return str(path)


def test_deepspeed_mapping_equals_deepspeed_engine(tmp_path: Path) -> None:
    """Batch triplet (dp 2), optimizer defaults and betas, clipping and the lr of every step: zerotron's
    mapping of each file equals what DeepSpeed's engine does with the same file."""
    engine = run_distributed(
        _deepspeed_engine_body, 2, {k: _without_zero(v) for k, v in DS_CONFIGS.items()}, timeout=400
    )[0]
    for name, ds in DS_CONFIGS.items():
        t = from_deepspeed(_write(tmp_path, name, ds), None, [], world_size=2).config.train
        got = engine[name]
        assert [t.global_batch, t.micro_batch, t.global_batch // (2 * t.micro_batch)] == got["batch"], name
        assert [t.beta1, t.beta2] == pytest.approx(got["betas"]), name
        assert (t.eps, t.weight_decay, t.grad_clip) == pytest.approx(
            (got["eps"], got["weight_decay"], got["clip"])
        ), name
        assert [lr_at(k, t) for k in range(STEPS)] == pytest.approx(got["lrs"], rel=1e-12, abs=1e-15), name


def test_zero3_tutorial_config_maps_every_key(tmp_path: Path) -> None:
    mapped = from_deepspeed(_write(tmp_path, "z3", DS_CONFIGS["zero3-tutorial"]), None, [], world_size=2)
    p = mapped.config.parallel
    assert (p.zero, p.persist_numel) == (3, 10_000)
    assert p.bucket_mb == pytest.approx(5e7 * 4 / 2**20)
    table = mapped.table()
    for key in ("overlap_comm", "stage3_prefetch_bucket_size", "gradient_accumulation_steps"):
        assert key in table, key
    assert "no effect in zerotron" in table and "parallel.persist_numel=10000" in table


def test_hugging_face_auto_config_resolves_from_zerotron(tmp_path: Path) -> None:
    """Hugging Face's ZeRO-2 "auto" template: each auto takes the zerotron config's value (as HF's
    integration takes its TrainingArguments'), named in the table; fp16 "auto" keeps train.precision."""
    hf = {
        "fp16": {"enabled": "auto", "loss_scale": 0, "initial_scale_power": 16, "hysteresis": 2},
        "bf16": {"enabled": "auto"},
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"},
        },
        "scheduler": {
            "type": "WarmupLR",
            "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto"},
        },
        "zero_optimization": {
            "stage": 2,
            "allgather_partitions": True,
            "overlap_comm": True,
            "reduce_bucket_size": "auto",
            "contiguous_gradients": True,
        },
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "train_batch_size": "auto",
        "train_micro_batch_size_per_gpu": "auto",
    }
    overrides = ["train.lr=5e-4", "train.precision=bf16", "train.global_batch=32", "train.micro_batch=2"]
    mapped = from_deepspeed(_write(tmp_path, "hf", hf), None, overrides, world_size=4)
    t = mapped.config.train
    assert (t.lr, t.precision, t.global_batch, t.micro_batch) == (5e-4, "bf16", 32, 2)
    assert (t.beta1, t.beta2, t.weight_decay, t.grad_clip) == (0.9, 0.95, 0.1, 1.0)
    assert mapped.config.parallel.bucket_mb == pytest.approx(128 * 128 * 4 / 2**20)
    assert mapped.table().count("(auto: from the zerotron config)") >= 10


def test_command_line_overrides_win_and_are_reported(tmp_path: Path) -> None:
    ds = {
        "train_batch_size": 8,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-4}},
        "zero_optimization": {"stage": 3},
    }
    mapped = from_deepspeed(
        _write(tmp_path, "d", ds), None, ["train.lr=1e-3", "parallel.zero=2"], world_size=2
    )
    assert (mapped.config.train.lr, mapped.config.parallel.zero) == (1e-3, 2)
    table = mapped.table()
    assert "train.lr=0.001 (command line)" in table and "overrides the DeepSpeed value 0.0003" in table
    assert "parallel.zero=2 (command line)" in table


def test_deepspeed_table_printed_before_training(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    ds = {"train_batch_size": 4, "steps_per_print": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    path = _write(tmp_path, "d", ds)
    code = main(
        ["train", *TINY, "train.steps=2", "--deepspeed", path, "--nproc", "1", "--out", str(tmp_path / "r")]
    )
    out = capsys.readouterr().out
    assert code == 0
    assert "DeepSpeed config" in out and "train.lr=0.001" in out and "train.grad_clip=1.0" in out
    lrs = [json.loads(line)["lr"] for line in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    assert lrs == [1e-3, 1e-3]


# -- run directories ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished 4-step byte-tokenizer run with checkpoints at steps 2 and 4."""
    out = tmp_path_factory.mktemp("runs") / "done"
    assert (
        main(["train", *TINY, "train.steps=4", "checkpoint.every=2", "--nproc", "1", "--out", str(out)]) == 0
    )
    return out


def _copy(run: Path, tmp_path: Path) -> Path:
    target = tmp_path / "run"
    shutil.copytree(run, target)
    (target / run_dir_lock.LOCK_NAME).unlink(missing_ok=True)
    return target


def _one_line_error(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    code = main(argv)
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


def test_second_live_run_on_the_same_directory_is_refused(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    out = tmp_path / "shared"
    holder = run_dir_lock.claim(out, None, False)  # a live run holds the directory
    try:
        err = _one_line_error(capsys, ["train", *TINY, "train.steps=2", "--nproc", "1", "--out", str(out)])
        assert "another zerotron run" in err and f"pid {os.getpid()}" in err
        assert not (out / "config.yaml").exists()  # the live run's files were not touched
    finally:
        holder.close()
    assert main(["train", *TINY, "train.steps=1", "--nproc", "1", "--out", str(out)]) == 0


def test_reused_directory_needs_resume_or_overwrite(
    capsys: pytest.CaptureFixture[str], finished_run: Path, tmp_path: Path
) -> None:
    run = _copy(finished_run, tmp_path)
    before = (run / "metrics.jsonl").read_text()
    err = _one_line_error(capsys, ["train", *TINY, "train.steps=2", "--nproc", "1", "--out", str(run)])
    assert "--resume auto" in err and "--overwrite" in err
    assert (run / "metrics.jsonl").read_text() == before  # nothing lost
    assert store.find_latest(run / "checkpoints").name == "step_00000004"
    # --overwrite starts over: keep=1 keeps the new run's checkpoint, metrics hold only the new steps.
    argv = ["train", *TINY, "train.steps=2", "checkpoint.keep=1", "--nproc", "1", "--out", str(run)]
    assert main([*argv, "--overwrite"]) == 0
    assert [p.name for p in (run / "checkpoints").glob("step_*")] == ["step_00000002"]
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2]


def test_latest_is_the_source_of_truth(tmp_path: Path) -> None:
    """A later-numbered checkpoint of an abandoned line is neither resumed from nor kept over the new one."""
    root = tmp_path / "checkpoints"
    for step in (200, 10):
        tmp = store.temp_dir(root, step)
        tmp.mkdir(parents=True)
        store.write_json(tmp / "trainer.json", {"step": step})
        store.publish(root, step, keep=1)
    assert (root / "step_00000010").is_dir()  # keep=1 kept the newest by `latest`, not by number
    assert store.find_latest(root).name == "step_00000010"


def test_resume_auto_with_nothing_says_so(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    out = tmp_path / "typo"
    assert main(["train", *TINY, "train.steps=1", "--nproc", "1", "--out", str(out), "--resume", "auto"]) == 0
    err = capsys.readouterr().err
    assert f"no checkpoint in {out / 'checkpoints'}; starting from step 0" in err


def test_manifest_less_only_checkpoint_is_not_a_silent_restart(
    capsys: pytest.CaptureFixture[str], finished_run: Path, tmp_path: Path
) -> None:
    run = _copy(finished_run, tmp_path)
    shutil.rmtree(run / "checkpoints" / "step_00000002")
    (run / "checkpoints" / "step_00000004" / "manifest.json").unlink()
    code = main(["train", *TINY, "train.steps=6", "--nproc", "1", "--out", str(run), "--resume", "auto"])
    err = capsys.readouterr().err
    assert code == 2 and "no manifest.json" in err and "no usable checkpoint" in err


def test_resumed_summary_counts_the_steps_that_ran(
    capsys: pytest.CaptureFixture[str], finished_run: Path, tmp_path: Path
) -> None:
    run = _copy(finished_run, tmp_path)
    assert main(["train", *TINY, "train.steps=6", "--nproc", "1", "--out", str(run), "--resume", "auto"]) == 0
    out = capsys.readouterr().out
    assert "over 2 steps (steps 5-6, after resuming)" in out
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 5, 6]


def test_run_directory_and_exports_are_usable(
    capsys: pytest.CaptureFixture[str], finished_run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A byte-tokenizer run: generate reads the run directory, its HF export carries a tokenizer that
    transformers loads (ids equal to the byte tokenizer's), and a fine-tune from a converted checkpoint
    named by a relative path converts from another working directory."""
    assert main(["generate", str(finished_run), "--prompt", "def ", "--max-new-tokens", "4"]) == 0
    hf = tmp_path / "hf"
    assert main(["convert", str(finished_run), str(hf)]) == 0
    from transformers import AutoTokenizer

    text = "héllo\n\tdef f(): ✓"
    assert AutoTokenizer.from_pretrained(str(hf))(text)["input_ids"] == ByteTokenizer().encode(text)
    assert HFTokenizer.from_file(hf / "tokenizer.json").eos_id == ByteTokenizer.eos_id
    # relative model.path to a converted checkpoint, then convert that run from elsewhere
    monkeypatch.chdir(tmp_path)
    assert main(["convert", str(finished_run), "base", "--to", "checkpoint"]) == 0
    tuned = ["train", *TINY, "train.steps=1", "model.path=base", "data.tokenizer=model", "--nproc", "1"]
    assert main([*tuned, "--out", "tuned"]) == 0
    monkeypatch.chdir(Path(__file__).parent)
    assert main(["convert", str(tmp_path / "tuned"), str(tmp_path / "tuned-hf")]) == 0
    assert (tmp_path / "tuned-hf" / "tokenizer.json").is_file()


def test_checkpoint_files_get_the_run_directory_permissions(finished_run: Path, tmp_path: Path) -> None:
    mode = (finished_run / "config.yaml").stat().st_mode & 0o777
    ckpt = store.find_latest(finished_run / "checkpoints")
    assert all(p.stat().st_mode & 0o777 == mode for p in ckpt.glob("*.safetensors"))
    hf = tmp_path / "hf"
    main(["convert", str(finished_run), str(hf)])
    assert (hf / "model.safetensors").stat().st_mode & 0o777 == mode


@pytest.mark.spawn  # reads what the ranks print
def test_banner_before_step_one_and_zero_warning_on_one_line(
    capfd: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    argv = ["train", *TINY, "train.steps=1", "parallel.zero=1", "log.progress=lines", "--nproc", "1"]
    assert main([*argv, "--out", str(tmp_path / "r")]) == 0
    captured = capfd.readouterr()
    banner = next(line for line in captured.out.splitlines() if line.startswith("zerotron: tiny"))
    assert captured.out.index(banner) < captured.out.index("step 1/1")
    for part in ("M parameters", "dp=1", "zero=1", "tokens per step", str(tmp_path / "r")):
        assert part in banner
    assert [line for line in captured.err.splitlines() if "saves no memory" in line] == [
        next(
            line
            for line in captured.err.splitlines()
            if line.startswith("zerotron: warning: parallel.zero=1")
        )
    ]


# -- one-line errors -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["train", "--nproc", "0"], "--nproc 0"),
        (["train", "train.lr=nan"], "train.lr=nan must be a finite number"),
        (["train", "model.head_dim=0"], "model.head_dim=0"),
        (["train", "model.num_key_value_heads=0"], "model.num_key_value_heads=0"),
        (["train", "parallel.bucket_mb=-1"], "parallel.bucket_mb"),
        (["train", "--nproc", "2", "train.steps=-5"], "train.steps"),  # an override after a flag
        (["plan", "--gpus", "0", "--hardware", "h100-sxm"], "--gpus 0"),
        (["plan", "--hardware", "h100-sxm"], "train.global_batch=16 / dp=8"),
        (["train", "--nproc", "two"], "invalid int value"),
    ],
)
def test_bad_values_one_line(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, argv: list[str], expected: str
) -> None:
    extra = ["--out", str(tmp_path / "r")] if argv[0] == "train" else []
    assert expected in _one_line_error(capsys, [*argv, *extra])


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (["--max-new-tokens", "-5"], "--max-new-tokens -5"),
        (["--temperature", "-1"], "--temperature -1"),
        (["--top-k", "-3"], "--top-k -3"),
        (["--top-p", "0"], "--top-p 0"),
        (["--nproc", "3", "parallel.tp=3"], "parallel.tp=3 does not divide model.num_attention_heads=4"),
    ],
)
def test_generate_bad_options_one_line(
    capsys: pytest.CaptureFixture[str], finished_run: Path, flags: list[str], expected: str
) -> None:
    assert expected in _one_line_error(capsys, ["generate", str(finished_run), "--prompt", "x", *flags])


def test_resume_with_another_model_shape_one_line(
    capsys: pytest.CaptureFixture[str], finished_run: Path, tmp_path: Path
) -> None:
    run = _copy(finished_run, tmp_path)
    argv = ["train", *TINY, "model.hidden_size=64", "train.steps=6", "--nproc", "1", "--out", str(run)]
    err = _one_line_error(capsys, [*argv, "--resume", "auto"])
    assert "hidden_size=32" in err and "model.hidden_size=64" in err


@pytest.mark.parametrize("bad", ["file", "unwritable"])
def test_out_must_be_a_writable_directory(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, bad: str
) -> None:
    out = tmp_path / "a-file" if bad == "file" else Path("/proc/zerotron-run")
    if bad == "file":
        out.write_text("x")
    err = _one_line_error(capsys, ["train", *TINY, "--nproc", "1", "--out", str(out)])
    assert str(out) in err


def test_deepspeed_refusals_are_listed_together(tmp_path: Path) -> None:
    ds = {
        "train_batch_size": 8,
        "optimizer": {"type": "Adam", "params": {"adam_w_mode": False, "weight_decay": 0.1, "amsgrad": True}},
        "scheduler": {"type": "OneCycle", "params": {}},
        "fp16": {"enabled": True, "loss_scale": 128},
        "zero_optimization": {"stage": 3, "zero_quantized_nontrainable_weights": True},
    }
    with pytest.raises(ConfigError) as info:
        from_deepspeed(_write(tmp_path, "bad", ds), None, [], world_size=2)
    message = str(info.value)
    for part in ("adam_w_mode", "amsgrad", "OneCycle", "fp16.loss_scale=128", "zero_quantized_nontrainable"):
        assert part in message, part
    assert "\n" not in message


def test_docs_plan_example_prints_what_the_planner_prints(capsys: pytest.CaptureFixture[str]) -> None:
    """Every `$ zerotron plan ...` transcript in the user guide's planning page is the planner's current
    output."""
    import shlex

    lines = (Path(__file__).resolve().parents[1] / "docs" / "planning.md").read_text().splitlines()
    transcripts, i = [], 0
    while i < len(lines):
        if lines[i].startswith("$ zerotron plan"):
            command = lines[i][2:]
            while command.endswith("\\"):
                i += 1
                command = command[:-1] + " " + lines[i].strip()
            expected = []
            while i + 1 < len(lines) and not lines[i + 1].startswith(("$ ", "```")):
                i += 1
                expected.append(lines[i])
            transcripts.append((shlex.split(command)[1:], expected))
        i += 1
    assert len(transcripts) >= 2
    for argv, expected in transcripts:
        assert main(argv) == 0
        assert capsys.readouterr().out.splitlines() == expected, argv
