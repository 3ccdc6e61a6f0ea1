"""zerotron's expert parallelism against transformers' native expert parallelism on the same weights
and inputs: ``DistributedConfig(ep_size=2, fsdp_size=2, ep_implementation="all_to_all")``, two Gloo ranks,
each with its half of the batch.

Both sides run one forward and backward of the mean token cross-entropy over the whole batch (the aux
loss weight is 0: transformers' native EP forms it per rank, zerotron over the global batch, so only the
cross-entropy is the same objective). zerotron's logits equal transformers' on each rank's rows, and
every gradient — the dense ones summed over the two ranks, each rank's two experts as they are — equals
transformers' (its FSDP-reduced gradients gathered whole), fp32 within 1e-5.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from tests.harness import run_distributed

transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.distributed")


def _write_mixtral(path: Path) -> None:
    config = transformers.MixtralConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        router_aux_loss_coef=0.0,
    )
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(config).float()
    with torch.no_grad():  # transformers zero-initialises the router: give it values
        for name, p in model.named_parameters():
            if name.endswith("gate.weight"):
                p.normal_(0.0, 0.3)
    model.save_pretrained(path)


def _batch() -> torch.Tensor:
    return torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(1))


def _native(path: str, rank: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """transformers' native EP: this rank's logits and every whole gradient."""
    from transformers import DistributedConfig

    config = DistributedConfig(ep_size=2, fsdp_size=2, ep_implementation="all_to_all")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, distributed_config=config, dtype=torch.float32, output_router_logits=False
    )
    ids = _batch()[2 * rank : 2 * rank + 2]
    out = model(ids, labels=ids)  # mean over this rank's tokens; FSDP averages over the two ranks
    out.loss.backward()
    logits = out.logits.full_tensor() if hasattr(out.logits, "full_tensor") else out.logits
    grads = {}
    for name, p in model.named_parameters():  # every rank gathers every gradient, in the same order
        g: Any = p.grad
        grads[name.removeprefix("model.")] = g.full_tensor() if hasattr(g, "full_tensor") else g
    return logits.detach(), grads


def _ours(path: str, rank: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """zerotron at ep 2 × dp 2 from the same directory: logits and this rank's gradients, the dense
    ones summed over the data-parallel ranks (what the engine's reducer does)."""
    from zerotron.build.builder import build_model
    from zerotron.build.source import resolve_model
    from zerotron.config_load import load_config
    from zerotron.distributed import collectives
    from zerotron.distributed.mesh import Mesh, ParallelDims

    cfg = resolve_model(load_config(None, [f"model.path={path}", "parallel.ep=2", "train.seq_len=16"]))
    mesh = Mesh(ParallelDims.from_config(cfg.parallel, 2), rank)
    model = build_model(cfg, torch.device("cpu"), mesh)
    ids = _batch()[2 * rank : 2 * rank + 2]
    logits = model(ids)
    tokens = _batch()[:, 1:].numel()  # the global batch's predicted tokens
    loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten(), reduction="sum") / tokens
    loss.backward()
    grads = {}
    for name, p in model.named_parameters():
        assert p.grad is not None, name
        if ".experts." not in name:  # experts: edp has one rank here, nothing to sum
            collectives.all_reduce(p.grad, mesh.group("dp"), op="sum")
        grads[name] = p.grad.detach().clone()
    return logits.detach(), grads


def _both(path: str) -> dict[str, Any]:
    from zerotron.distributed.launch import current_rank_and_world

    rank, _ = current_rank_and_world()
    ref_logits, ref_grads = _native(path, rank)
    logits, grads = _ours(path, rank)
    return {"rank": rank, "ref_logits": ref_logits, "logits": logits, "ref": ref_grads, "ours": grads}


def test_expert_parallel_equals_transformers_native_expert_parallel(tmp_path: Path) -> None:
    _write_mixtral(tmp_path)
    results = run_distributed(_both, 2, str(tmp_path), timeout=300)
    for r in results:
        ref = r["ref_logits"]
        assert (r["logits"][..., : ref.shape[-1]] - ref).abs().max() <= 1e-5 * ref.abs().max()
        assert set(r["ours"]) == set(r["ref"])
        for name, g in r["ours"].items():
            want = r["ref"][name]
            if ".experts." in name:  # this rank's two experts of four
                want = want[2 * r["rank"] : 2 * r["rank"] + 2]
            assert g.shape == want.shape, name
            assert float((g - want).norm() / want.norm()) <= 1e-5, (name, r["rank"])
