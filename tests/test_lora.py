"""LoRA adapters against peft: same targets, same logits after training, PEFT's files both ways, merging."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import peft
import pytest
import torch
import transformers
from torch import nn

from tests.test_hf_io import CFG
from zerotron.config_load import ConfigError
from zerotron.models.hf import to_hf_name, write_hf_directory
from zerotron.models.llama import LlamaForCausalLM
from zerotron.models.lora import LoraConfig, apply_lora, load_adapter, merge_lora, save_adapter
from zerotron.models.nf4 import NF4Linear, NF4ParamLinear, is_quantized_param, nf4_weight, quantized_bytes


def _ids(seed: int) -> torch.Tensor:
    return torch.randint(0, CFG.vocab_size, (2, 13), generator=torch.Generator().manual_seed(seed))


def _base(tmp_path: Path, **changes: Any) -> tuple[LlamaForCausalLM, Path]:
    model = LlamaForCausalLM(dataclasses.replace(CFG, **changes)).eval()
    model.init_weights(5)
    write_hf_directory(model, tmp_path / "base")
    return model, tmp_path / "base"


def _hf(directory: Path) -> Any:
    return transformers.AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32).eval()


def _close(got: torch.Tensor, expected: torch.Tensor, tol: float = 1e-5) -> None:
    assert (got - expected).abs().max().item() <= tol * expected.abs().max().item()


def _as_if_trained(ref: Any) -> None:
    """Give a fresh peft adapter values training would: B away from zero, DoRA magnitudes moved."""
    with torch.no_grad():
        for n, p in ref.named_parameters():
            if "lora_B" in n:
                p.normal_(std=0.05)
            if "lora_magnitude_vector" in n:
                p.mul_(1 + 0.1 * torch.randn_like(p))


def _train(model: LlamaForCausalLM, steps: int = 3) -> None:
    """A few AdamW steps on random tokens: only the adapters may move."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=1e-2)
    model.train()
    for k in range(steps):
        ids = _ids(100 + k)
        logits = model(ids)
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()


@pytest.mark.parametrize(
    "targets", ["all-linear", ["q_proj", "v_proj"], r".*\.mlp\.(up|down)_proj"], ids=["all", "list", "regex"]
)
def test_targets_match_peft(tmp_path: Path, targets: Any) -> None:
    model, base = _base(tmp_path)
    names = apply_lora(model, LoraConfig(rank=4, target_modules=targets))
    ref = peft.get_peft_model(_hf(base), peft.LoraConfig(r=4, target_modules=targets))
    wrapped = {
        n.removeprefix("base_model.model.")
        for n, m in ref.named_modules()
        if isinstance(m, peft.tuners.lora.Linear)
    }
    assert {to_hf_name(n) for n in names} == wrapped


def test_fresh_adapters_leave_logits_and_only_adapters_train(tmp_path: Path) -> None:
    model, _ = _base(tmp_path)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with torch.no_grad():
        expected = model(_ids(0))
    apply_lora(model, LoraConfig(rank=4, alpha=8))
    with torch.no_grad():
        assert torch.equal(model(_ids(0)), expected)
    _train(model)
    after = dict(model.named_parameters())
    for name, value in before.items():
        assert torch.equal(after[name], value), name  # the base is frozen
    moved = [n for n, p in after.items() if "lora_B" in n and p.abs().max() > 0]
    assert len(moved) == 2 * 7  # every adapter of every layer trained
    with torch.no_grad():
        assert not torch.allclose(model(_ids(0)), expected)


@pytest.mark.parametrize(
    ("rslora", "dora"), [(False, False), (True, False), (False, True)], ids=["lora", "rslora", "dora"]
)
def test_trained_adapter_loads_in_peft_with_the_same_logits(tmp_path: Path, rslora: bool, dora: bool) -> None:
    model, base = _base(tmp_path, attention_bias=True)
    cfg = LoraConfig(rank=4, alpha=12, dropout=0.1, use_rslora=rslora, use_dora=dora)
    apply_lora(model, cfg, generator=torch.Generator().manual_seed(3))
    _train(model)
    save_adapter(model, cfg, tmp_path / "adapter", base_model=str(base))
    ref = peft.PeftModel.from_pretrained(_hf(base), str(tmp_path / "adapter")).eval()
    with torch.no_grad():
        _close(model(_ids(1)), ref(_ids(1)).logits)


@pytest.mark.parametrize("dora", [False, True], ids=["lora", "dora"])
def test_peft_adapter_loads_in_zerotron(tmp_path: Path, dora: bool) -> None:
    model, base = _base(tmp_path)
    torch.manual_seed(0)
    ref = peft.get_peft_model(
        _hf(base), peft.LoraConfig(r=6, lora_alpha=3, target_modules=["k_proj", "o_proj"], use_dora=dora)
    )
    _as_if_trained(ref)
    ref.save_pretrained(str(tmp_path / "peft"))
    cfg = load_adapter(model, tmp_path / "peft")
    assert (cfg.rank, cfg.alpha, sorted(cfg.target_modules), cfg.use_dora) == (
        6,
        3.0,
        ["k_proj", "o_proj"],
        dora,
    )
    with torch.no_grad():
        _close(model(_ids(2)), ref.eval()(_ids(2)).logits)


@pytest.mark.parametrize("dora", [False, True], ids=["lora", "dora"])
def test_merged_export_loads_in_transformers(tmp_path: Path, dora: bool) -> None:
    model, _ = _base(tmp_path)
    apply_lora(model, LoraConfig(rank=4, use_dora=dora))
    _train(model)
    with torch.no_grad():
        expected = model(_ids(3))
    assert merge_lora(model) == 2 * 7
    with torch.no_grad():
        _close(model(_ids(3)), expected)
    write_hf_directory(model, tmp_path / "merged")
    with torch.no_grad():
        _close(_hf(tmp_path / "merged")(_ids(3)).logits, expected)


@pytest.mark.parametrize(
    ("cfg", "says"),
    [
        (LoraConfig(rank=0), "lora.rank=0"),
        (LoraConfig(dropout=1.0), "lora.dropout=1.0"),
        (LoraConfig(target_modules="q_proj["), "is not a regex"),
        (LoraConfig(target_modules=["qproj"]), "matches no linear layer"),
    ],
)
def test_bad_lora_settings_say_what_to_change(tmp_path: Path, cfg: LoraConfig, says: str) -> None:
    model, _ = _base(tmp_path)
    with pytest.raises(ConfigError, match=says.replace("[", r"\[")):
        apply_lora(model, cfg)


def test_initialisation_is_peft_s(tmp_path: Path) -> None:
    """A spans PEFT's Kaiming-uniform range over the full fan-in (same bound per layer), B is zero."""
    model, base = _base(tmp_path)
    apply_lora(model, LoraConfig(rank=16), generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    ref = peft.get_peft_model(_hf(base), peft.LoraConfig(r=16, target_modules="all-linear"))
    theirs = {
        n.removeprefix("base_model.model.").replace(".default", ""): p for n, p in ref.named_parameters()
    }
    for name, p in model.named_parameters():
        if "lora_" in name:
            q = theirs[to_hf_name(name)]
            if "lora_B" in name:
                assert not p.any() and not q.any()
            else:
                ratio = p.abs().max() / q.abs().max()
                assert 0.9 < ratio < 1.1, (name, ratio.item())


def _hf_4bit(directory: Path, double: bool) -> Any:
    quant = transformers.BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=double,
        bnb_4bit_compute_dtype=torch.float32,
    )
    return transformers.AutoModelForCausalLM.from_pretrained(
        str(directory), quantization_config=quant, device_map="cpu", dtype=torch.float32
    ).eval()


@pytest.mark.parametrize("double", [False, True], ids=["nf4", "nf4-double-quant"])
def test_qlora_matches_peft_on_a_bitsandbytes_base(tmp_path: Path, double: bool) -> None:
    """QLoRA: every linear layer but lm_head in NF4 under trained adapters, against peft on transformers'
    bitsandbytes 4-bit model: far closer to it than either is to the unquantised model."""
    model, base = _base(tmp_path, hidden_size=64, intermediate_size=128)  # bitsandbytes on CPU: dims % 64
    with torch.no_grad():
        exact = model(_ids(4))
    cfg = LoraConfig(rank=4, alpha=8, base_bits=4, double_quant=double)
    apply_lora(model, cfg, generator=torch.Generator().manual_seed(4))
    plain = [n for n, m in model.named_modules() if type(m) is torch.nn.Linear and ".lora_" not in n]
    assert plain == ["lm_head"]
    _train(model)
    save_adapter(model, cfg, tmp_path / "adapter")
    ref = peft.PeftModel.from_pretrained(_hf_4bit(base, double), str(tmp_path / "adapter")).eval()
    with torch.no_grad():
        got, expected = model(_ids(4)), ref(_ids(4)).logits
    # transformers hands bitsandbytes' CPU kernel bf16 weights (quant_state.dtype is bfloat16), so the
    # two agree to the NF4 + bf16 rounding, not to fp32 (test_nf4 checks the layer exactly in fp32).
    assert (got - expected).norm() <= 0.05 * (expected - exact).norm()
    assert merge_lora(model) == 2 * 7


def test_qdora_equals_peft_dora_on_the_dequantised_base(tmp_path: Path) -> None:
    """QDoRA (DoRA on an NF4 base) is DoRA on the dequantised weights: after training, peft's DoRA on a
    transformers model holding exactly those weights gives zerotron's logits (fp32 1e-5); the merged
    layers give them too. (peft's own DoRA on a bitsandbytes 4-bit layer is no reference on CPU: the
    weight bitsandbytes dequantises there for the norm is not the one its CPU forward multiplies.)"""
    from zerotron.models.lora import QLoraLinear

    model, _ = _base(tmp_path)
    cfg = LoraConfig(rank=4, alpha=8, base_bits=4, use_dora=True)
    apply_lora(model, cfg, generator=torch.Generator().manual_seed(6))
    magnitudes = {n: p.detach().clone() for n, p in model.named_parameters() if "magnitude" in n}
    assert len(magnitudes) == 2 * 7
    _train(model)
    assert all(not torch.equal(p, magnitudes[n]) for n, p in model.named_parameters() if n in magnitudes)
    save_adapter(model, cfg, tmp_path / "adapter")
    dense = LlamaForCausalLM(model.config).eval()
    state = {k: v for k, v in model.state_dict().items() if "lora_" not in k and "base_layer" not in k}
    for name, module in model.named_modules():
        if isinstance(module, QLoraLinear):
            state[f"{name}.weight"] = module.base_layer.quantized.dequantize()
    dense.load_state_dict(state)
    write_hf_directory(dense, tmp_path / "dequantised")
    ref = peft.PeftModel.from_pretrained(_hf(tmp_path / "dequantised"), str(tmp_path / "adapter")).eval()
    with torch.no_grad():
        expected = ref(_ids(7)).logits
        _close(model(_ids(7)), expected)
        assert merge_lora(model) == 2 * 7
        _close(model(_ids(7)), expected)


@pytest.mark.parametrize("dora", [False, True], ids=["lora", "dora"])
def test_convert_merge_lora_matches_peft_merge(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], dora: bool
) -> None:
    """`zerotron convert BASE OUT --merge-lora ADAPTER`: the export equals peft's merge_and_unload."""
    from zerotron.cli import main

    _, base = _base(tmp_path, attention_bias=True)
    torch.manual_seed(1)
    ref = peft.get_peft_model(
        _hf(base), peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", use_dora=dora)
    )
    _as_if_trained(ref)
    ref.save_pretrained(str(tmp_path / "adapter"))
    with torch.no_grad():
        expected = ref.merge_and_unload().eval()(_ids(5)).logits
    assert (
        main(["convert", str(base), str(tmp_path / "merged"), "--merge-lora", str(tmp_path / "adapter")]) == 0
    )
    with torch.no_grad():
        _close(_hf(tmp_path / "merged")(_ids(5)).logits, expected)
    capsys.readouterr()
    (tmp_path / "bad").mkdir()
    assert main(["convert", str(base), str(tmp_path / "m2"), "--merge-lora", str(tmp_path / "bad")]) != 0
    assert "adapter_config.json not found" in capsys.readouterr().err
    assert not (tmp_path / "m2").exists()


def test_tensor_parallel_and_meta_device_models_get_adapters(tmp_path: Path) -> None:
    """A tensor-parallel layer gets its adapter part (tests/test_sft.py runs tp 2 and 4 against the single
    process); a meta-device (ZeRO-3) model gets meta adapters, whose values ZeRO-3's units take from
    initial_adapter (tests/test_sft.py: ZeRO-3 equals the single process; DoRA's magnitudes come from
    the weight source's rows); QLoRA there gets NF4 byte parameters that ZeRO-3 fills."""
    from zerotron.distributed.collectives import CommStats
    from zerotron.distributed.mesh import Group
    from zerotron.parallel.tensor import RowParallelLinear

    model, _ = _base(tmp_path)
    tp_one = Group("tp", (0,), None, CommStats(0))
    model.layers[0].self_attn.o_proj = RowParallelLinear(model.layers[0].self_attn.o_proj, tp_one)
    with torch.no_grad():
        expected = model(_ids(0))
    names = apply_lora(model, LoraConfig(rank=4))
    assert "layers.0.self_attn.o_proj" in names and hasattr(model.layers[0].self_attn.o_proj, "lora_A")
    with torch.no_grad():
        assert torch.equal(model(_ids(0)), expected)
    with torch.device("meta"):
        meta = LlamaForCausalLM(CFG)
    assert apply_lora(meta, LoraConfig(rank=4), seed=0) and all(p.is_meta for p in meta.parameters())
    with torch.device("meta"):
        meta = LlamaForCausalLM(CFG)
    apply_lora(meta, LoraConfig(base_bits=4), seed=0)  # QLoRA for ZeRO-3: NF4 bytes as parameters
    nf4 = {n: p for n, p in meta.named_parameters() if is_quantized_param(n)}
    assert nf4 and all(p.is_meta and p.dtype == torch.uint8 and not p.requires_grad for p in nf4.values())


@pytest.mark.parametrize("double", [True, False])
def test_nf4_parameters_compute_what_the_nf4_layer_computes(double: bool) -> None:
    """The NF4 form ZeRO-3 shards (codes and fp32 scale bytes as parameters) gives the NF4 layer's
    dequantised weight and output exactly, for a weight whose size is not a multiple of the block."""
    torch.manual_seed(0)
    linear = nn.Linear(40, 30, bias=True)  # 1200 values: 18.75 blocks of 64
    ref = NF4Linear(linear, double=double)
    layer = NF4ParamLinear(40, 30, bias=True, device="cpu")
    codes, scales = quantized_bytes(linear.weight, double=double)
    with torch.no_grad():
        layer.weight_nf4.copy_(codes)
        layer.weight_nf4_scales.copy_(scales)
        assert layer.bias is not None
        layer.bias.copy_(linear.bias)
    assert torch.equal(layer.quantized.dequantize(), ref.quantized.dequantize())
    x = torch.randn(3, 40)
    assert torch.equal(layer(x), ref(x))
    flat = torch.cat([torch.zeros(2, dtype=torch.uint8), scales])  # a view off fp32 alignment
    assert torch.equal(nf4_weight(codes, flat[2:], 30, 40).dequantize(), ref.quantized.dequantize())


def _nf4_records_body() -> None:
    """On each of 2 tp ranks: column-parallel (whole rows), replicated and row-parallel (a slice of every
    row) layers whose NF4 weights are byte parameters on the meta device (ZeRO-3's QLoRA base)."""
    from zerotron.distributed.launch import current_rank_and_world
    from zerotron.distributed.mesh import Mesh, ParallelDims
    from zerotron.models.nf4 import quantize_nf4
    from zerotron.models.nf4_tp import quantize_tp_layer_params
    from zerotron.parallel.placement import placements, read_local
    from zerotron.parallel.tensor import ColumnParallelLinear, RowParallelLinear

    rank, world = current_rank_and_world()
    group = Mesh(ParallelDims(world, dp=1, tp=world), rank).group("tp")
    torch.manual_seed(0)
    ref = {name: nn.Linear(256, 128, bias=False) for name in ("col", "rep", "row")}
    model = nn.Module()
    model.col = ColumnParallelLinear(ref["col"], group)
    model.rep = ColumnParallelLinear(ref["rep"], group, rows=(0, 128), replicated=True)
    model.row = RowParallelLinear(ref["row"], group)
    for name in ref:
        quantize_tp_layer_params(getattr(model, name), name)
    records = placements(model, tp=world)
    for name, linear in ref.items():
        layer = getattr(model, name)
        whole = dict(zip(("weight_nf4", "weight_nf4_scales"), quantized_bytes(linear.weight)))
        for part, values in whole.items():
            record = records[f"{name}.{part}"]
            assert record.sharded == (() if name == "rep" else ("tp",)), (name, part, record)
            assert record.replicated == (("tp",) if name == "rep" else ()), (name, part, record)
            grid = values.view(record.global_shape)
            local = read_local(
                record, lambda o, b, grid=grid: grid[tuple(slice(i, i + n) for i, n in zip(o, b))]
            )
            setattr(layer, part, nn.Parameter(local.clone(), False))
        expected = layer.weight_spec.slice(quantize_nf4(linear.weight.detach()).dequantize())
        assert torch.equal(layer.weight, expected), name


def test_nf4_byte_parameters_are_placed_where_the_shards_bytes_lie() -> None:
    """A tensor-parallel NF4 layer's byte parameters have placement records (DESIGN contract 5) that say
    where each rank's bytes lie in the single process's NF4 bytes of the whole weight: reading the
    records' boxes of those bytes and dequantising gives the rank's shard of the single process's
    dequantised weight (whole rows: one run of the bytes; a slice of every row: a column box of them)."""
    from tests.harness import run_distributed

    run_distributed(_nf4_records_body, 2)


def test_saving_over_an_adapter_replaces_it_whole(tmp_path: Path) -> None:
    model, base = _base(tmp_path)
    cfg = LoraConfig(rank=4)
    apply_lora(model, cfg)
    (tmp_path / "adapter").mkdir()
    (tmp_path / "adapter" / "stale.txt").write_text("from an earlier save")
    save_adapter(model, cfg, tmp_path / "adapter")
    assert sorted(p.name for p in (tmp_path / "adapter").iterdir()) == [
        "adapter_config.json",
        "adapter_model.safetensors",
    ]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter", "base"]  # no temporary folders left


@pytest.mark.parametrize(
    "setting", [{"bias": "all"}, {"modules_to_save": ["lm_head"]}, {"rank_pattern": {"q_proj": 2}}]
)
def test_adapter_settings_not_built_are_refused(tmp_path: Path, setting: dict[str, Any]) -> None:
    model, _ = _base(tmp_path)
    cfg = LoraConfig(rank=4)
    apply_lora(model, cfg)
    save_adapter(model, cfg, tmp_path / "adapter")
    path = tmp_path / "adapter" / "adapter_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **setting}))
    with pytest.raises(ConfigError, match=f"{next(iter(setting))}=.* is not read yet"):
        load_adapter(model, tmp_path / "adapter")


def test_nf4_linear_keeps_no_dequantised_weight_for_backward() -> None:
    """A QLoRA base layer's forward saves no dequantised copy of its weight for backward (it dequantises
    again there, as bitsandbytes does); the input's gradient is the plain linear's on that weight."""
    torch.manual_seed(0)
    layer = NF4Linear(nn.Linear(256, 512, bias=True))
    x = torch.randn(4, 256, requires_grad=True)
    saved: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = layer(x)
    assert sum(t.numel() for t in saved) < 256 * 512 // 4  # the 4-bit codes at most, no fp32 copy
    out.square().sum().backward()
    ref_x = x.detach().clone().requires_grad_(True)
    torch.nn.functional.linear(ref_x, layer.quantized.dequantize(), layer.bias).square().sum().backward()
    assert x.grad is not None and ref_x.grad is not None
    torch.testing.assert_close(x.grad, ref_x.grad, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("kind", ["column", "row"])
def test_tensor_parallel_nf4_layer_keeps_no_dequantised_weight_for_backward(
    kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tensor-parallel NF4 layer (one-rank group) saves no dequantised weight for backward either (its
    weight is dequantised again there); its input gradient is the plain linear's on that weight."""
    from zerotron.models.nf4 import NF4Weight

    calls = []
    dequantize = NF4Weight.dequantize
    monkeypatch.setattr(NF4Weight, "dequantize", lambda self, *a: calls.append(1) or dequantize(self, *a))
    from zerotron.distributed.collectives import CommStats
    from zerotron.distributed.mesh import Group
    from zerotron.models.nf4_tp import quantize_tp_layer
    from zerotron.parallel.tensor import ColumnParallelLinear, RowParallelLinear

    torch.manual_seed(0)
    group = Group("tp", (0,), None, CommStats(0))
    linear = nn.Linear(256, 128, bias=False)
    layer = ColumnParallelLinear(linear, group) if kind == "column" else RowParallelLinear(linear, group)
    quantize_tp_layer(layer, "layer")
    x = torch.randn(2, 3, 256, requires_grad=True)
    saved: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = layer(x)
    assert not any(t.numel() >= 256 * 128 for t in saved)  # no whole weight kept (inner hooks replace it)
    before = len(calls)
    out.square().sum().backward()
    assert len(calls) > before  # backward dequantised the weight again
    ref_x = x.detach().clone().requires_grad_(True)
    torch.nn.functional.linear(ref_x, layer.weight).square().sum().backward()
    assert x.grad is not None and ref_x.grad is not None
    torch.testing.assert_close(x.grad, ref_x.grad, rtol=1e-6, atol=1e-6)
