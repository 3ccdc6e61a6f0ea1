"""Mixture-of-experts models against transformers: tiny random Mixtral, Qwen2-MoE (shared expert, q/k/v
bias), Qwen3-MoE (per-head q/k norm) and OLMoE (whole-projection q/k norm), read from the directory
``save_pretrained`` writes (per-expert tensors) and from the fused in-memory layout; logits, the
auxiliary loss and every parameter's gradient of loss + coef·aux equal transformers'; export loads back
in transformers with the same logits."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from zerotron.models.hf import write_hf_directory
from zerotron.models.hf_moe import split_experts
from zerotron.models.llama import LlamaForCausalLM
from zerotron.models.loading import ModelLoadError, load_pretrained
from zerotron.models.moe import expert_mlp, router_losses

transformers = pytest.importorskip("transformers")

COMMON = dict(
    vocab_size=101,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_experts_per_tok=2,
    output_router_logits=True,
    tie_word_embeddings=False,
    max_position_embeddings=64,
)
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "mixtral": ("MixtralConfig", dict(intermediate_size=48, num_local_experts=4, router_aux_loss_coef=0.02)),
    "qwen2_moe": (
        "Qwen2MoeConfig",
        dict(
            intermediate_size=96,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=40,
            num_experts=6,
            norm_topk_prob=False,
            router_aux_loss_coef=0.05,
        ),
    ),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        dict(intermediate_size=96, moe_intermediate_size=32, num_experts=4, norm_topk_prob=True, head_dim=16),
    ),
    "olmoe": ("OlmoeConfig", dict(intermediate_size=32, num_experts=8, num_experts_per_tok=3)),
}
CLASSES = {
    "MixtralConfig": "MixtralForCausalLM",
    "Qwen2MoeConfig": "Qwen2MoeForCausalLM",
    "Qwen3MoeConfig": "Qwen3MoeForCausalLM",
    "OlmoeConfig": "OlmoeForCausalLM",
}


def _reference(family: str, seed: int = 0) -> Any:
    config_name, fields = FAMILIES[family]
    config = getattr(transformers, config_name)(**{**COMMON, **fields})
    torch.manual_seed(seed)
    model = getattr(transformers, CLASSES[config_name])(config).float()
    with torch.no_grad():  # transformers zero-initialises routers and biases: give them values
        for name, p in model.named_parameters():
            if name.endswith(("gate.weight", "bias", "norm.weight")):
                p.normal_(0.0 if "norm" not in name else 1.0, 0.3)
    return model.train()


def _inputs(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 101, (2, 12), generator=g), torch.randint(0, 101, (2, 12), generator=g)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_forward_aux_and_gradients_equal_transformers(tmp_path: Path, family: str) -> None:
    ref = _reference(family)
    ref.save_pretrained(tmp_path)  # per-expert tensors on disk
    ids, labels = _inputs()
    out = ref(ids, labels=labels)
    out.loss.backward()

    model, _ = load_pretrained(tmp_path)
    model.train()
    cfg = model.config
    assert cfg.num_local_experts == FAMILIES[family][1].get(
        "num_local_experts", FAMILIES[family][1].get("num_experts")
    )
    logits = model(ids)
    losses = router_losses(model)
    assert losses is not None
    assert (logits - out.logits).abs().max() <= 1e-5 * out.logits.abs().max()
    torch.testing.assert_close(losses.aux, out.aux_loss.float(), rtol=1e-5, atol=1e-7)
    # transformers shifts labels inside its loss; do the same on zerotron's logits
    shifted = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())
    (shifted + cfg.router_aux_loss_coef * losses.aux).backward()
    theirs = {
        n.removeprefix("model.").replace(".block_sparse_moe.", ".mlp."): p for n, p in ref.named_parameters()
    }
    for name, p in model.named_parameters():
        expected = theirs[name].grad
        assert expected is not None, name
        scale = expected.abs().max().clamp_min(1e-6)
        assert (p.grad - expected).abs().max() <= 1e-5 * scale, name


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "olmoe"])
def test_fused_layout_reads_and_export_loads_in_transformers(tmp_path: Path, family: str) -> None:
    ref = _reference(family, seed=3).eval()
    ids, _ = _inputs(4)
    with torch.no_grad():
        expected = ref(ids).logits
    ref.config.save_pretrained(tmp_path / "fused")
    save_file(  # the in-memory (fused) names, as some tools write them
        {n: p.detach().contiguous() for n, p in ref.state_dict().items()},
        str(tmp_path / "fused" / "model.safetensors"),
    )
    model, _ = load_pretrained(tmp_path / "fused")
    with torch.no_grad():
        assert (model(ids) - expected).abs().max() <= 1e-5 * expected.abs().max()
    write_hf_directory(model, tmp_path / "out")
    back = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path / "out"), dtype=torch.float32
    ).eval()
    assert type(back).__name__ == type(ref).__name__
    with torch.no_grad():
        assert (back(ids).logits - expected).abs().max() <= 1e-5 * expected.abs().max()
    reread, _ = load_pretrained(tmp_path / "out")  # and zerotron reads its own export
    with torch.no_grad():
        assert (reread(ids) - expected).abs().max() <= 1e-5 * expected.abs().max()


def test_grouped_gemm_equals_the_loop_including_idle_experts() -> None:
    g = torch.Generator().manual_seed(0)
    gate_up, down = torch.randn(4, 2 * 8, 16, generator=g), torch.randn(4, 16, 8, generator=g)
    counts = torch.tensor([3, 0, 5, 2])  # expert 1 gets no token
    x = torch.randn(10, 16, generator=g, requires_grad=True)
    w = [gate_up.clone().requires_grad_(), down.clone().requires_grad_()]
    grouped = expert_mlp(x, counts, w[0], w[1], grouped=True)
    grouped.square().sum().backward()
    grads = [x.grad.clone(), w[0].grad.clone(), w[1].grad.clone()]
    x.grad = None
    w2 = [gate_up.clone().requires_grad_(), down.clone().requires_grad_()]
    loop = expert_mlp(x, counts, w2[0], w2[1], grouped=False)
    loop.square().sum().backward()
    torch.testing.assert_close(grouped, loop, rtol=1e-5, atol=1e-6)
    for a, b in zip(grads, [x.grad, w2[0].grad, w2[1].grad]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert torch.isfinite(grads[1]).all() and grads[1][1].abs().max() == 0  # idle expert: zero, not NaN


def test_missing_expert_tensor_is_named(tmp_path: Path) -> None:
    ref = _reference("mixtral")
    ref.save_pretrained(tmp_path)
    from safetensors.torch import load_file

    tensors = load_file(str(tmp_path / "model.safetensors"))
    del tensors["model.layers.1.block_sparse_moe.experts.2.w3.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="layers.1.mlp.experts.gate_up_proj"):
        load_pretrained(tmp_path)


def test_split_experts_names_as_save_pretrained() -> None:
    t = torch.arange(2 * 4 * 3).reshape(2, 4, 3).float()
    names = [n for n, _ in split_experts("layers.0.mlp.experts.gate_up_proj", t, {"gate": "w1", "up": "w3"})]
    assert names == [f"layers.0.mlp.experts.{e}.{r}.weight" for e in range(2) for r in ("w1", "w3")]


def test_unsupported_moe_configs_are_refused(tmp_path: Path) -> None:
    ref = _reference("qwen2_moe")
    ref.config.decoder_sparse_step = 2
    ref.save_pretrained(tmp_path)
    with pytest.raises(ModelLoadError, match="dense layers between MoE layers is not supported"):
        load_pretrained(tmp_path)


def test_model_builds_with_layout_independent_init() -> None:
    from zerotron.config import ModelConfig

    cfg = ModelConfig(
        preset=None,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=16,
        vocab_size=50,
        num_local_experts=4,
    )
    a, b = LlamaForCausalLM(cfg), LlamaForCausalLM(cfg)
    a.init_weights(5)
    b.init_weights(5)
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), n
    assert a.layers[0].mlp.experts.gate_up_proj.std() > 0
