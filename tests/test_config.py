"""Config loading: files, dotted overrides, presets, checks, and the DeepSpeed ds_config mapping."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from zerotron.cli import main
from zerotron.config_check import validate
from zerotron.config_deepspeed import from_deepspeed
from zerotron.config_load import ConfigError, describe_fields, load_config, save_config


def test_yaml_file_then_overrides_win(tmp_path: Path) -> None:
    path = tmp_path / "run.yaml"
    path.write_text(
        "model: {preset: tiny, num_hidden_layers: 6}\n"
        "parallel: {dp: 2}\n"
        "train: {lr: 1.0e-3, precision: bf16, steps: 50}\n"
    )
    cfg = load_config(str(path), ["train.lr=2e-4", "train.recompute=full", "log.tensorboard=true"])
    assert cfg.model.num_hidden_layers == 6  # explicit field over the preset
    assert cfg.model.hidden_size == 128  # from the tiny preset
    assert cfg.parallel.dp == 2 and cfg.train.steps == 50 and cfg.train.precision == "bf16"
    assert cfg.train.lr == 2e-4 and isinstance(cfg.train.lr, float)
    assert cfg.train.recompute == "full" and cfg.log.tensorboard is True


def test_json_file_and_preset_fields(tmp_path: Path) -> None:
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"model": {"preset": "llama3-8b"}, "train": {"seq_len": 4096}}))
    cfg = load_config(str(path))
    assert (cfg.model.hidden_size, cfg.model.num_key_value_heads, cfg.model.vocab_size) == (4096, 8, 128256)
    assert cfg.model.tie_word_embeddings is False
    assert cfg.train.seq_len == 4096


def test_saved_config_loads_back_equal(tmp_path: Path) -> None:
    cfg = load_config(
        None, ["model.preset=smollm2-135m", "train.seq_len=128", "parallel.offload_optimizer=none"]
    )
    save_config(cfg, tmp_path / "config.yaml")
    assert load_config(str(tmp_path / "config.yaml")) == cfg


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["train.lrr=0.1"], "did you mean 'train.lr'"),
        (["trian.lr=0.1"], "did you mean 'train.lr'"),
        (["train.steps=ten"], "train.steps: expected an integer, got 'ten'"),
        (["log.tensorboard=maybe"], "log.tensorboard: expected true or false"),
        (["model.preset=gpt5"], "unknown preset 'gpt5'"),
        (["lr=0.1"], "write section.key=value"),
    ],
)
def test_bad_keys_and_values(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


@pytest.mark.parametrize(
    ("overrides", "world", "message"),
    [
        (["train.precision=fp4"], 2, "train.precision='fp4': choose one of fp32, bf16, fp16, fp8"),
        (
            [
                "train.precision=fp8",
                "train.fp8_recipe=rowwise",
                "parallel.zero=3",
                "parallel.zero_fp8_gather=always",
            ],
            2,
            "rowwise casts the weight along a different axis for each GEMM",
        ),
        (["parallel.tp_comm_overlap=true"], 1, "does not overlap tensor-parallel collectives"),
        (["parallel.zero=1", "parallel.overlap_param_gather=true"], 1, "not under the next forward"),
        (["train.global_batch=15"], 2, "not divisible by the data-parallel size 2"),
        (["train.global_batch=16", "train.micro_batch=3"], 2, "not a multiple of train.micro_batch=3"),
        (["train.beta2=1.0"], 1, "train.beta2=1.0 must be in"),
        (["train.min_lr=1", "train.lr=0.1"], 1, "train.min_lr=1.0 is above train.lr=0.1"),
        (["checkpoint.keep=0"], 1, "checkpoint.keep=0 must be >= 1"),
        (["parallel.dp=2", "parallel.tp=2"], 2, "or --nproc 4"),
        (["parallel.ep=2"], 2, "expert parallelism needs an MoE model"),
        # not built yet: refused, never accepted and ignored
        (["parallel.cp=2", "parallel.cp_comm=ring2"], 2, "choose one of ring, ulysses, allgather, hybrid"),
        (
            ["train.sample_every=5", "parallel.pp=2", "model.num_hidden_layers=2"],
            2,
            "generation under pipeline parallelism is not built",
        ),
        (["train.compile=true", "parallel.cp=2"], 2, "not with parallel.cp=2; set train.compile=false"),
        (["train.compile=true", "parallel.tp=2"], 2, "not with parallel.tp=2;"),
        (["lora.rank=99999999999"], 1, "lora.rank=99999999999 exceeds model.hidden_size=128"),
        (["train.compile=true", "parallel.pp=2"], 2, "not with parallel.pp=2;"),
        (
            ["train.compile=true", "model.num_local_experts=4", "model.moe_intermediate_size=64"],
            1,
            "not with model.num_local_experts=4;",
        ),
    ],
)
def test_validate_names_what_to_change(overrides: list[str], world: int, message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace("+", r"\+")):
        validate(load_config(None, overrides), world)


def test_help_config_lists_every_key(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", "--help-config"]) == 0
    text = capsys.readouterr().out
    for key in ("model.hidden_size", "parallel.zero", "train.recompute", "data.source", "checkpoint.keep"):
        assert key in text
    assert describe_fields() in text


def _ds(tmp_path: Path, body: dict) -> str:
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(body))
    return str(path)


def test_deepspeed_config_is_mapped(tmp_path: Path) -> None:
    ds = {
        "train_batch_size": 32,
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 4,
        "gradient_clipping": 0.5,
        "steps_per_print": 10,
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": 6e-4, "betas": [0.9, 0.98], "eps": 1e-6, "weight_decay": 0.05},
        },
        "scheduler": {
            "type": "WarmupCosineLR",
            "params": {"warmup_num_steps": 7, "total_num_steps": 90, "cos_min_ratio": 0.1},
        },
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": 2, "overlap_comm": True, "offload_optimizer": {"device": "cpu"}},
    }
    cfg = from_deepspeed(_ds(tmp_path, ds), None, [], world_size=2).config
    t = cfg.train
    assert (t.global_batch, t.micro_batch, t.grad_clip) == (32, 4, 0.5)
    assert (t.lr, t.beta1, t.beta2, t.eps, t.weight_decay) == (6e-4, 0.9, 0.98, 1e-6, 0.05)
    assert (t.schedule, t.warmup_steps, t.steps) == ("cosine", 7, 90)
    assert t.min_lr == pytest.approx(6e-5)
    assert t.precision == "bf16"
    assert cfg.parallel.zero == 2 and cfg.parallel.offload_optimizer == "cpu"


def test_deepspeed_zero_infinity_swaps_the_gradients_too(tmp_path: Path) -> None:
    """DeepSpeed's stage 3 with its optimizer on NVMe swaps the gradient partitions there as well."""
    nvme = {"device": "nvme", "nvme_path": str(tmp_path)}
    ds = {
        "train_batch_size": 8,
        "zero_optimization": {"stage": 3, "offload_optimizer": nvme, "offload_param": nvme},
    }
    cfg = from_deepspeed(_ds(tmp_path, ds), None, [], world_size=2).config
    p = cfg.parallel
    assert (p.zero, p.offload_params, p.offload_optimizer, p.offload_grads) == (3, "nvme", "nvme", "nvme")
    ds["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}  # type: ignore[index]
    assert from_deepspeed(_ds(tmp_path, ds), None, [], world_size=2).config.parallel.offload_grads == "none"


def test_deepspeed_global_batch_from_micro_and_accumulation(tmp_path: Path) -> None:
    ds = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 3}
    cfg = from_deepspeed(_ds(tmp_path, ds), None, [], world_size=4).config
    assert cfg.train.global_batch == 2 * 3 * 4


def test_deepspeed_unmapped_keys_are_all_listed(tmp_path: Path) -> None:
    ds = {
        "train_batch_size": 8,
        "sparse_attention": {"mode": "fixed"},
        "optimizer": {"type": "Lamb", "params": {"lr": 1e-3}},
        "fp16": {"enabled": True, "fp16_master_weights_and_grads": True},
    }
    with pytest.raises(ConfigError) as info:
        from_deepspeed(_ds(tmp_path, ds), None, [], world_size=2)
    message = str(info.value)
    for part in ("sparse_attention", "optimizer.type='Lamb'", "fp16.fp16_master_weights_and_grads"):
        assert part in message
    assert "\n" not in message


def test_deepspeed_inconsistent_batch(tmp_path: Path) -> None:
    ds = {"train_batch_size": 30, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 4}
    with pytest.raises(ConfigError, match="train_batch_size=30 != "):
        from_deepspeed(_ds(tmp_path, ds), None, [], world_size=2)


def test_deepspeed_missing_file_from_cli(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code = main(["train", "--deepspeed", str(tmp_path / "nope.json"), "--out", str(tmp_path / "run")])
    assert code == 2
    assert "nope.json: no such file" in capsys.readouterr().err


def test_llama32_1b_preset_has_the_published_parameter_count() -> None:
    """The preset builds Llama-3.2-1B: transformers' model from the same fields has the same parameters,
    1,235,814,400 (its model card's 1.24 B, tied embeddings counted once)."""
    import torch
    from transformers import LlamaConfig
    from transformers import LlamaForCausalLM as HFLlama

    from zerotron.models.llama import LlamaForCausalLM

    cfg = load_config(None, ["model.preset=llama3.2-1b"]).model
    with torch.device("meta"):
        ours = sum(p.numel() for p in LlamaForCausalLM(cfg).parameters())
        hf = HFLlama(
            LlamaConfig(
                hidden_size=cfg.hidden_size,
                intermediate_size=cfg.intermediate_size,
                num_hidden_layers=cfg.num_hidden_layers,
                num_attention_heads=cfg.num_attention_heads,
                num_key_value_heads=cfg.num_key_value_heads,
                head_dim=cfg.head_dim,
                vocab_size=cfg.vocab_size,
                tie_word_embeddings=cfg.tie_word_embeddings,
            )
        )
        theirs = sum(p.numel() for p in hf.parameters())
    assert ours == theirs == 1_235_814_400
