"""Training a mixture-of-experts model equals transformers' Mixtral trained in one process, on every
layout that carries experts: one process, dp, ZeRO-1/2/3, cp, recomputation, expert parallelism.

Reference: transformers' ``MixtralForCausalLM`` holding zerotron's initial weights, trained with torch's
AdamW on the whole global batch, its loss the token cross-entropy plus ``router_aux_loss_coef`` times
transformers' own auxiliary loss (and the z-loss from its router logits where asked). The layouts run
one micro-batch per rank (no accumulation), so the load-balancing statistics are pooled over the same
global batch. fp32, 8 steps: losses, aux losses and weights within 1e-5 (relative).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tests.harness import run_distributed
from tests.test_train_3d import _body
from tests.test_train_dp import BASE, _tokens, torch_adamw
from zerotron.checkpoint import store
from zerotron.components.data import DataLoader, PackedDataset
from zerotron.components.state import read_model_tensors
from zerotron.config_check import validate
from zerotron.config_load import ConfigError, load_config
from zerotron.models.llama import LlamaForCausalLM

transformers = pytest.importorskip("transformers")

STEPS = 8
MOE = [
    *BASE,
    "model.vocab_size=256",
    "model.num_local_experts=4",
    "model.num_experts_per_tok=2",
    "model.intermediate_size=32",
    "model.router_aux_loss_coef=0.1",
    "train.grad_clip=0.3",
    f"train.steps={STEPS}",
]


def _mixtral(cfg: Any) -> Any:
    m = cfg.model
    config = transformers.MixtralConfig(
        vocab_size=m.vocab_size,
        hidden_size=m.hidden_size,
        intermediate_size=m.expert_intermediate,
        num_hidden_layers=m.num_hidden_layers,
        num_attention_heads=m.num_attention_heads,
        num_key_value_heads=m.kv_heads,
        num_local_experts=m.num_local_experts,
        num_experts_per_tok=m.num_experts_per_tok,
        max_position_embeddings=m.max_position_embeddings,
        rms_norm_eps=m.rms_norm_eps,
        rope_theta=m.rope_theta,
        tie_word_embeddings=m.tie_word_embeddings,
        router_aux_loss_coef=m.router_aux_loss_coef,
        output_router_logits=True,
    )
    return transformers.MixtralForCausalLM(config).float()


def _reference(
    overrides: list[str], tokens: np.ndarray
) -> tuple[list[float], list[float], dict[str, torch.Tensor]]:
    """transformers' Mixtral from zerotron's initial weights, trained on the whole batch."""
    cfg = load_config(None, overrides)
    ours = LlamaForCausalLM(cfg.model)
    ours.init_weights(cfg.train.seed)
    ref = _mixtral(cfg)
    state = {("" if k.startswith("lm_head") else "model.") + k: v for k, v in ours.state_dict().items()}
    ref.load_state_dict(state, strict=True)
    ref.train()
    t = cfg.train
    opt = torch_adamw(ref, t)
    loader = DataLoader(PackedDataset(tokens, t.seq_len), t.global_batch, t.global_batch, 0, 1, t.seed)
    losses, auxes = [], []
    for _ in range(STEPS):
        (x, y) = loader.next_step()[0]
        out = ref(x)
        ce = F.cross_entropy(out.logits.flatten(0, 1), y.flatten())
        z = sum(torch.logsumexp(r.float(), -1).square().mean() for r in out.router_logits)
        loss = ce + cfg.model.router_aux_loss_coef * out.aux_loss + cfg.model.router_z_loss_coef * z
        loss.backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), t.grad_clip)
        opt.step()
        opt.zero_grad()
        losses.append(ce.item())
        auxes.append(out.aux_loss.item())
    weights = {k.removeprefix("model."): v.detach().clone() for k, v in ref.named_parameters()}
    return losses, auxes, weights


def _moe_body(overrides: list[str], tokens: np.ndarray, run_dir: str, steps: int, resume: str | None) -> dict:
    """The shared training body; an expert-parallel rank's expert tensors are reported with the index
    of their first expert (its ``ep`` coordinate times the experts per rank)."""
    from zerotron.distributed.launch import current_rank_and_world
    from zerotron.distributed.mesh import Mesh, ParallelDims

    out = _body(overrides, tokens, run_dir, steps, resume)
    rank, world = current_rank_and_world()
    ep_rank = Mesh(ParallelDims.from_config(load_config(None, overrides).parallel, world), rank).coords["ep"]
    out["first_expert"] = {n: ep_rank * w.shape[0] for n, w in out["weights"].items() if ".experts." in n}
    return out


def _check_expert_weights(results: list[dict], ref_weights: dict[str, torch.Tensor]) -> None:
    """Every rank's tensors (its experts' rows of the expert tensors) equal the reference's."""
    seen: dict[str, set[int]] = {}
    for r in results:
        for name, w in r["weights"].items():
            first = r["first_expert"].get(name, 0)
            whole = ref_weights[
                name if name in ref_weights else "embed_tokens.weight"
            ]  # pipeline's tied copy
            ref = whole[first : first + w.shape[0]]
            assert float((w - ref).norm() / ref.norm()) <= 1e-5, name
            seen.setdefault(name, set()).update(range(first, first + w.shape[0]))
    seen.pop("lm_head.weight", None)
    for name, ref in ref_weights.items():  # together the ranks hold every expert of every tensor
        assert seen[name] == set(range(ref.shape[0] if ".experts." in name else len(seen[name]))), name


def _aux_body(overrides: list[str], tokens: np.ndarray, run_dir: str, steps: int, resume: str | None) -> dict:
    """The shared training body, plus the router figures of every step."""
    from zerotron.distributed.launch import current_rank_and_world
    from zerotron.distributed.mesh import Mesh, ParallelDims
    from zerotron.train.trainer import Trainer

    cfg = load_config(None, overrides)
    rank, world = current_rank_and_world()
    mesh = Mesh(ParallelDims.from_config(cfg.parallel, world), rank)
    trainer = Trainer(cfg, mesh, Path(run_dir), tokens)
    history = [trainer.train_step() for _ in range(2)]
    return {
        "aux": [r["aux_loss"] for r in history],
        "load": history[-1]["expert_load"],
        "active": history[-1]["active_params"],
    }


LAYOUTS = [
    (1, ["train.micro_batch=8"]),
    (2, ["train.micro_batch=4"]),
    (2, ["train.micro_batch=4", "parallel.zero=1"]),
    (2, ["train.micro_batch=4", "parallel.zero=2", "model.router_z_loss_coef=0.001"]),
    (2, ["train.micro_batch=4", "parallel.zero=3", "parallel.persist_numel=0"]),
    (2, ["train.micro_batch=8", "parallel.cp=2", "train.recompute=full"]),
    (2, ["train.micro_batch=4", "model.moe_grouped_gemm=false", "train.recompute=selective"]),
    (2, ["train.micro_batch=4", "parallel.ep=2"]),
    (4, ["train.micro_batch=2", "parallel.ep=4"]),
    (4, ["train.micro_batch=2", "parallel.ep=2", "parallel.zero=1"]),
    (4, ["train.micro_batch=2", "parallel.ep=2", "parallel.zero=2", "parallel.zero_shard_size=1"]),
    (4, ["train.micro_batch=2", "parallel.ep=4", "parallel.zero=1", "parallel.zero_shard_size=2"]),
    (
        4,
        [
            "train.micro_batch=2",
            "parallel.ep=2",
            "parallel.zero=3",
            "parallel.zero_shard_size=2",
            "parallel.persist_numel=0",
        ],
    ),
    (2, ["train.micro_batch=4", "parallel.ep=2", "parallel.zero=2"]),
    (4, ["train.micro_batch=2", "parallel.ep=2", "parallel.zero=3", "parallel.persist_numel=0"]),
    (2, ["train.micro_batch=8", "parallel.ep=2", "parallel.cp=2", "train.recompute=full"]),
    (4, ["train.micro_batch=4", "parallel.ep=4", "parallel.cp=2", "parallel.dp=2"]),
    (2, ["train.micro_batch=8", "parallel.tp=2"]),
    (2, ["train.micro_batch=8", "parallel.pp=2", "parallel.dp=1"]),
    (2, ["train.micro_batch=8", "parallel.pp=2", "parallel.dp=1", "parallel.pp_schedule=zb"]),
    (4, ["train.micro_batch=4", "parallel.pp=2", "parallel.ep=2", "parallel.zero=1"]),
    (
        4,
        [
            "train.micro_batch=8",
            "parallel.pp=2",
            "parallel.dp=1",
            "parallel.tp=2",
            "parallel.sequence_parallel=true",
            "train.recompute=full",
        ],
    ),
    (4, ["train.micro_batch=4", "parallel.tp=2", "parallel.sequence_parallel=true", "parallel.ep=2"]),
    (
        4,
        [
            "train.micro_batch=4",
            "parallel.tp=2",
            "parallel.ep=2",
            "parallel.zero=3",
            "parallel.persist_numel=0",
        ],
    ),
    (
        8,
        [
            "train.micro_batch=4",
            "parallel.tp=2",
            "parallel.sequence_parallel=true",
            "parallel.cp=2",
            "parallel.ep=2",
            "parallel.zero=1",
        ],
    ),
]


@pytest.mark.parametrize(
    ("world", "layout"),
    LAYOUTS,
    ids=lambda x: x if isinstance(x, int) else "+".join(v.split(".")[1] for v in x),
)
def test_moe_training_matches_transformers(world: int, layout: list[str], tmp_path: Path) -> None:
    tokens = _tokens()
    overrides = [*MOE, *layout]
    validate(load_config(None, overrides), world)
    ref_losses, ref_aux, ref_weights = _reference(overrides, tokens)
    results = run_distributed(_moe_body, world, overrides, tokens, str(tmp_path), STEPS, None, timeout=300)
    for r in results:
        np.testing.assert_allclose(r["losses"], ref_losses, rtol=1e-5)
        assert r["n_params"] == sum(w.numel() for w in ref_weights.values())
    _check_expert_weights(results, ref_weights)
    saved = read_model_tensors(store.find_latest(tmp_path / "checkpoints"))
    for name, ref in ref_weights.items():
        assert float((saved[name] - ref).norm() / ref.norm()) <= 1e-5, name
    figures = run_distributed(
        _aux_body, world, overrides, tokens, str(tmp_path / "aux"), 2, None, timeout=300
    )
    experts = sum(w.numel() for n, w in ref_weights.items() if ".experts." in n)
    idle = experts * (4 - 2) // 4  # of each block's 4 experts a token runs 2
    for f in figures:  # every rank reports the global aux loss of the step
        np.testing.assert_allclose(f["aux"], ref_aux[:2], rtol=1e-5)
        assert f["active"] == sum(w.numel() for w in ref_weights.values()) - idle
        assert 0 < f["load"]["min"] <= 0.25 <= f["load"]["max"] and f["load"]["cv"] >= 0


ETP_LAYOUTS = [
    (2, ["train.micro_batch=8", "parallel.tp=2", "parallel.etp=2"]),
    (2, ["train.micro_batch=8", "parallel.tp=2", "parallel.etp=2", "parallel.sequence_parallel=true"]),
    (4, ["train.micro_batch=4", "parallel.tp=2", "parallel.etp=2", "parallel.ep=2"]),
    (
        4,
        [
            "train.micro_batch=4",
            "parallel.tp=2",
            "parallel.etp=2",
            "parallel.sequence_parallel=true",
            "parallel.ep=2",
            "parallel.zero=3",
            "parallel.persist_numel=0",
            "train.recompute=full",
        ],
    ),
    (
        4,
        [
            "train.micro_batch=8",
            "parallel.pp=2",
            "parallel.dp=1",
            "parallel.tp=2",
            "parallel.etp=2",
            "parallel.sequence_parallel=true",
            "parallel.zero=1",
        ],
    ),
]


@pytest.mark.parametrize(
    ("world", "layout"),
    ETP_LAYOUTS,
    ids=lambda x: x if isinstance(x, int) else "+".join(v.split(".")[1] for v in x),
)
def test_expert_tensor_parallel_training_matches_transformers(
    world: int, layout: list[str], tmp_path: Path
) -> None:
    """Experts split over tp (parallel.etp=tp): each rank holds a slice of every expert's intermediate
    width (gate and up rows, down columns); losses, aux losses and the saved weights (assembled from the
    slices each rank wrote) equal transformers' Mixtral trained on the whole batch, and each rank holds
    1/tp of the expert elements of its ep rank."""
    tokens = _tokens()
    overrides = [*MOE, *layout]
    validate(load_config(None, overrides), world)
    ref_losses, ref_aux, ref_weights = _reference(overrides, tokens)
    results = run_distributed(_moe_body, world, overrides, tokens, str(tmp_path), STEPS, None, timeout=300)
    cfg = load_config(None, overrides)
    per_rank = cfg.model.num_local_experts // cfg.parallel.ep
    for r in results:
        np.testing.assert_allclose(r["losses"], ref_losses, rtol=1e-5)
        assert r["n_params"] == sum(w.numel() for w in ref_weights.values())
        for name, w in r["weights"].items():
            if ".experts." in name and "parallel.zero=3" not in layout:
                whole = ref_weights[name]
                assert w.numel() * cfg.parallel.tp == whole.numel() * per_rank // whole.shape[0], name
    saved = read_model_tensors(store.find_latest(tmp_path / "checkpoints"))
    for name, ref in ref_weights.items():
        assert float((saved[name] - ref).norm() / ref.norm()) <= 1e-5, name
    figures = run_distributed(
        _aux_body, world, overrides, tokens, str(tmp_path / "aux"), 2, None, timeout=300
    )
    for f in figures:
        np.testing.assert_allclose(f["aux"], ref_aux[:2], rtol=1e-5)


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["lora.rank=4"], "lora.rank > 0 on a mixture-of-experts model is not built yet"),
        (["model.num_experts_per_tok=5"], "num_experts_per_tok=5 must be between 1 and"),
        (["parallel.ep=3"], "ep=3"),
        (["parallel.ep=4"], "parallel.ep=4 does not divide parallel.dp*cp = 2"),
        (["model.mlp=plain"], "MoE experts are SwiGLU"),
        (["parallel.etp=2"], "parallel.etp=2: the experts are either whole on every tp rank"),
        (
            ["parallel.tp=2", "parallel.dp=1", "parallel.etp=2", "model.moe_intermediate_size=3"],
            "etp=2 does not divide",
        ),
    ],
)
def test_moe_layouts_not_built_are_refused(overrides: list[str], expected: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(expected)):
        validate(load_config(None, [*MOE, *overrides]), 2)


@pytest.mark.parametrize(
    ("world", "layout"), [(1, ["train.micro_batch=8"]), (4, ["train.micro_batch=2", "parallel.ep=4"])]
)
def test_checkpoint_saved_at_ep2_resumes_on_another_layout(
    world: int, layout: list[str], tmp_path: Path
) -> None:
    """Saved with the experts split over 2 ranks, resumed whole on one rank or split over 4: the
    trajectory continues as transformers' does."""
    tokens = _tokens()
    ref_losses, _, ref_weights = _reference(MOE, tokens)
    first = run_distributed(
        _moe_body,
        2,
        [*MOE, "train.micro_batch=4", "parallel.ep=2"],
        tokens,
        str(tmp_path),
        4,
        None,
        timeout=300,
    )
    np.testing.assert_allclose(first[0]["losses"], ref_losses[:4], rtol=1e-5)
    ckpt = str(store.find_latest(tmp_path / "checkpoints"))
    second = run_distributed(
        _moe_body, world, [*MOE, *layout], tokens, str(tmp_path / "b"), 4, ckpt, timeout=300
    )
    for r in second:
        np.testing.assert_allclose(r["losses"], ref_losses[4:], rtol=1e-5)
    _check_expert_weights(second, ref_weights)


@pytest.mark.parametrize(
    ("first_world", "first", "world", "layout"),
    [
        (
            4,
            ["train.micro_batch=4", "parallel.tp=2", "parallel.etp=2", "parallel.ep=2", "parallel.zero=1"],
            1,
            ["train.micro_batch=8"],
        ),
        (
            2,
            ["train.micro_batch=4", "parallel.ep=2"],
            2,
            ["train.micro_batch=8", "parallel.tp=2", "parallel.etp=2", "parallel.sequence_parallel=true"],
        ),
    ],
    ids=["etp-to-one", "ep-to-etp"],
)
def test_expert_tensor_parallel_checkpoints_reshard(
    first_world: int, first: list[str], world: int, layout: list[str], tmp_path: Path
) -> None:
    """A checkpoint whose experts are split over tp (each rank's slice of the gate rows and of the up
    rows written as separate pieces) resumes whole on one process, and one saved at ep 2 resumes with
    the experts split over tp: the trajectory continues as transformers' does."""
    tokens = _tokens()
    ref_losses, _, ref_weights = _reference(MOE, tokens)
    a = run_distributed(_moe_body, first_world, [*MOE, *first], tokens, str(tmp_path), 4, None, timeout=300)
    np.testing.assert_allclose(a[0]["losses"], ref_losses[:4], rtol=1e-5)
    ckpt = str(store.find_latest(tmp_path / "checkpoints"))
    b = run_distributed(_moe_body, world, [*MOE, *layout], tokens, str(tmp_path / "b"), 4, ckpt, timeout=300)
    for r in b:
        np.testing.assert_allclose(r["losses"], ref_losses[4:], rtol=1e-5)
    saved = read_model_tensors(store.find_latest(tmp_path / "b" / "checkpoints"))
    for name, ref in ref_weights.items():
        assert float((saved[name] - ref).norm() / ref.norm()) <= 1e-5, name


def test_expert_parallel_checkpoint_exports_to_transformers(tmp_path: Path) -> None:
    """A checkpoint trained at ep 2 (ZeRO-3) converts to a Hugging Face Mixtral directory that
    transformers loads (per-expert tensors, as save_pretrained writes), with the logits of
    transformers' own trained model."""
    from zerotron.build.convert import convert

    tokens = _tokens()
    overrides = [*MOE, "train.micro_batch=4", "parallel.ep=2", "parallel.zero=3", "parallel.persist_numel=0"]
    _, _, ref_weights = _reference(MOE, tokens)
    run_distributed(_moe_body, 2, overrides, tokens, str(tmp_path), STEPS, None, timeout=300)
    convert(store.find_latest(tmp_path / "checkpoints"), tmp_path / "hf", shard_bytes=200_000)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path / "hf"), dtype=torch.float32
    ).eval()
    assert type(loaded).__name__ == "MixtralForCausalLM"
    ref = _mixtral(load_config(None, MOE)).eval()
    result = ref.load_state_dict({"model." + k: v for k, v in ref_weights.items()}, strict=False)
    assert result.missing_keys == ["lm_head.weight"] and not result.unexpected_keys  # the tied head
    ids = torch.from_numpy(tokens[:64].astype(np.int64)).reshape(2, 32)
    with torch.no_grad():
        expected = ref(ids).logits
        assert (loaded(ids).logits - expected).abs().max() <= 1e-4 * expected.abs().max()
