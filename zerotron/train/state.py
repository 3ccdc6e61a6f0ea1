"""What a training checkpoint holds, and how it is written and restored (first, data-parallel version).

Files inside one checkpoint folder (see :mod:`zerotron.checkpoint.store` for publication):

- ``model.safetensors``: the full model under zerotron's parameter names (replicated under plain data
  parallelism, so rank 0 writes it); with pipeline parallelism ``model.pp{K}.safetensors``, the tensors
  of pipeline rank K under the same global names, written by its first data-parallel replica;
- ``optimizer.safetensors`` (``optimizer.pp{K}.safetensors``): AdamW moments ``{name}.exp_avg`` /
  ``{name}.exp_avg_sq`` and ``{name}.step``;
- ``rng.rank{R}.safetensors``: each rank's torch CPU (and CUDA) generator state;
- ``trainer.json``: step, loss scaler, data-loader position, layout and the resolved config.

Under tensor parallelism each parameter's shards and its AdamW moments are all-gathered over the tp
group on save, so the files hold whole tensors under global names whatever tp was, and each rank
slices its part on load (by the parameter's :class:`~zerotron.parallel.tensor.ShardSpec`).
"""

from __future__ import annotations

import contextlib
import copy
import shutil
from pathlib import Path
from typing import Any

import torch
from torch import nn

from zerotron.checkpoint import store
from zerotron.checkpoint.async_save import CheckpointWriter
from zerotron.dist import collectives
from zerotron.dist.mesh import Mesh
from zerotron.parallel.tensor import ShardSpec, gather_tensors, shard_specs, slice_tensors


def _param_names(model: nn.Module) -> dict[int, str]:
    names: dict[int, str] = {}
    for name, p in model.named_parameters(remove_duplicate=True):
        names.setdefault(id(p), name)
    return names


def model_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """Parameters (tied ones once) and persistent buffers by name."""
    out: dict[str, torch.Tensor] = dict(model.named_parameters(remove_duplicate=True))
    persistent = set(model.state_dict().keys())
    out.update({n: b for n, b in model.named_buffers() if n in persistent})
    return out


def optimizer_tensors(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """AdamW state as named tensors (no pickle, readable under any layout later)."""
    names = _param_names(model)
    out: dict[str, torch.Tensor] = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state.get(p)
            if not state:
                continue
            for key, value in state.items():
                out[f"{names[id(p)]}.{key}"] = value if torch.is_tensor(value) else torch.tensor(value)
    return out


def load_optimizer_tensors(
    model: nn.Module, optimizer: torch.optim.Optimizer, tensors: dict[str, torch.Tensor]
) -> None:
    """Inverse of :func:`optimizer_tensors`."""
    names = _param_names(model)
    for group in optimizer.param_groups:
        for p in group["params"]:
            prefix = names[id(p)] + "."
            state = {k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)}
            if state:
                optimizer.state[p] = {k: v.to(p.device) if v.ndim else v for k, v in state.items()}


def rng_tensors() -> dict[str, torch.Tensor]:
    """This rank's generator states."""
    out = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        out["cuda"] = torch.cuda.get_rng_state()
    return out


def save_checkpoint(
    root: Path,
    step: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    mesh: Mesh,
    trainer_state: dict[str, Any],
    keep: int,
    zero: Any = None,
    writer: CheckpointWriter | None = None,
) -> Path:
    """Write and publish the checkpoint of ``step`` from every rank (collective over the world).

    Under ZeRO (``zero``: the trainer's engine) the shards are all-gathered first, so the files hold the
    same whole tensors by name as without it and load under any ZeRO stage or none.

    With ``writer`` (``checkpoint.async_save``) the gathers still run here, on the main thread, but the
    tensors are copied into host memory and the writer's thread writes and publishes them while training
    goes on; the returned folder exists once ``writer.wait()`` has returned on rank 0.
    """
    if writer is not None:
        writer.wait()  # one write in flight: the previous folder is published before this one starts
    zero_tensors = None
    if zero is not None:  # collective over dp: every rank takes part in the gathers
        with zero.full_params():
            zero_weights = {k: v.detach().clone() for k, v in model_tensors(model).items()}
        zero_tensors = (zero_weights, zero.optimizer_tensors(optimizer))
    tmp = store.temp_dir(root, step)
    if mesh.rank == 0:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
    world = mesh.group("world")
    collectives.barrier(world)
    files = {f"rng.rank{mesh.rank}.safetensors": rng_tensors()}  # file name -> tensors
    tp = mesh.group("tp")
    if tp.size > 1 and mesh.coords["dp"] == 0 and mesh.coords["cp"] == 0:  # the writer's tp group
        specs = _tp_specs(model)  # this tp rank's whole shards (gathered over dp first under ZeRO)
        local = zero_tensors or (model_tensors(model), optimizer_tensors(model, optimizer))
        weights, moments = gather_tensors(local[0], specs, tp), gather_tensors(local[1], specs, tp)
    elif _writes_model(mesh) and zero_tensors is not None:
        weights, moments = zero_tensors
    elif _writes_model(mesh):
        weights, moments = model_tensors(model), optimizer_tensors(model, optimizer)
    if _writes_model(mesh):
        suffix = _stage_suffix(mesh)
        files[f"model{suffix}.safetensors"] = weights
        files[f"optimizer{suffix}.safetensors"] = moments
    json_files = {"trainer.json": copy.deepcopy(trainer_state)} if mesh.rank == 0 else {}
    final = root / store.step_dir_name(step)
    if writer is not None:
        live = zero_tensors is None  # ZeRO's gathered tensors are host copies already
        writer.submit(root, step, {n: _host_copies(t, live) for n, t in files.items()}, json_files, keep)
        return final
    for name, tensors in files.items():
        store.write_tensors(tmp / name, tensors)
    for name, data in json_files.items():
        store.write_json(tmp / name, data)
    collectives.barrier(world)
    if mesh.rank == 0:
        final = store.publish(root, step, keep)
    collectives.barrier(world)
    return final


def _host_copies(tensors: dict[str, torch.Tensor], live: bool) -> dict[str, torch.Tensor]:
    """Detached host tensors that training cannot change: copies of ``live`` ones (model, optimizer)."""
    return {k: v.detach().to("cpu", copy=live) for k, v in tensors.items()}


def load_checkpoint(
    ckpt: Path, model: nn.Module, optimizer: torch.optim.Optimizer, mesh: Mesh, zero: Any = None
) -> dict[str, Any]:
    """Restore model, optimizer and (same world size) this rank's RNG from ``ckpt``; return the trainer state.

    Tensors are stored whole under the model's global names, so a checkpoint loads into any data-parallel
    size and any pipeline split: each rank takes the names it holds (pipeline stage files are merged).
    """
    store.verify(ckpt)
    state = store.read_json(ckpt / "trainer.json")
    tied = bool(getattr(getattr(model, "config", None), "tie_word_embeddings", False))
    specs = _tp_specs(model) if mesh.dims.tp > 1 else {}  # full tensors in the files; keep this tp shard
    weights = slice_tensors(_with_tied_head(read_model_tensors(ckpt), tied), specs)
    # Under ZeRO-3 the parameters are gathered to take the whole tensors, then each rank keeps its shard.
    with zero.full_params(writeback=True) if zero is not None else contextlib.nullcontext():
        missing, unexpected = model.load_state_dict(weights, strict=False)
    missing = [m for m in missing if m not in _tied_names(model)]
    if mesh.dims.pp > 1:
        unexpected = []  # the other pipeline stages' tensors
    if missing or unexpected:
        raise store.CheckpointError(
            f"{ckpt}: the model files do not fit this model (missing {missing[:3]}, unexpected {unexpected[:3]})"
        )
    moments = slice_tensors(_with_tied_head(_read_merged(ckpt, "optimizer"), tied), specs)
    if zero is not None:
        zero.load_optimizer_tensors(optimizer, moments)
    else:
        load_optimizer_tensors(model, optimizer, moments)
    saved_world = state.get("layout", {}).get("world_size")
    if saved_world == mesh.dims.world_size:  # another layout keeps the seeds the trainer set for it
        rng = store.read_tensors(ckpt / f"rng.rank{mesh.rank}.safetensors")
        torch.set_rng_state(rng["cpu"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"])
    return state


def _with_tied_head(tensors: dict[str, torch.Tensor], tied: bool) -> dict[str, torch.Tensor]:
    """Give a pipeline's last stage its head copy from a checkpoint that stored the tied matrix once.

    Every ``embed_tokens.weight*`` tensor (weights, AdamW moments, step) gets an ``lm_head.weight*``
    alias when the checkpoint has none: the copies are equal by construction.
    """
    if not tied:
        return tensors
    out = dict(tensors)
    for name, t in tensors.items():
        if name.startswith("embed_tokens.weight"):
            out.setdefault("lm_head.weight" + name[len("embed_tokens.weight") :], t)
    return out


def _tp_specs(model: nn.Module) -> dict[str, ShardSpec]:
    """Shard specs of the tensor-parallel parameters and of their AdamW moments, by saved name."""
    specs = shard_specs(model)
    moments = {f"{name}.{key}": spec for name, spec in specs.items() for key in ("exp_avg", "exp_avg_sq")}
    return {**specs, **moments}


def _writes_model(mesh: Mesh) -> bool:
    """One replica writes the model: the first data-parallel rank of each pipeline stage."""
    return all(mesh.coords[axis] == 0 for axis in ("dp", "cp", "tp"))


def _stage_suffix(mesh: Mesh) -> str:
    return f".pp{mesh.coords['pp']}" if mesh.dims.pp > 1 else ""


def _read_merged(ckpt: Path, kind: str) -> dict[str, torch.Tensor]:
    files = sorted(ckpt.glob(f"{kind}*.safetensors"))
    if not files:
        raise store.CheckpointError(f"{ckpt}: no {kind}*.safetensors file")
    merged: dict[str, torch.Tensor] = {}
    for path in files:
        merged.update(store.read_tensors(path))
    return merged


def read_model_tensors(ckpt: Path) -> dict[str, torch.Tensor]:
    """Every model tensor of a checkpoint by global name, merged over its pipeline-stage files."""
    return _read_merged(ckpt, "model")


def _tied_names(model: nn.Module) -> set[str]:
    """Names that alias another parameter (tied embeddings): state_dict keeps both, safetensors one."""
    all_names = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    unique = {n for n, _ in model.named_parameters(remove_duplicate=True)}
    return all_names - unique
