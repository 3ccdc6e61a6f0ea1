"""Pipeline stages of the Llama family: the model with what a stage does not own pruned.

A stage is a :class:`~zerotron.models.llama.LlamaForCausalLM` built with only blocks ``[start, end)``,
plus the embedding when it is the first stage and the final norm and output head when it is the last
(torchtitan's ``pipeline_module_split`` does the same): one forward for the whole model and every
stage. Parameter names are those of the whole model (``layers.7.mlp.up_proj.weight``), so every stage
initialises its parameters to the same global values for the same seed (DESIGN contract 4) and
checkpoints name them the same way under any split.

With tied embeddings and more than one stage, the last stage holds its own copy of the embedding
matrix as ``lm_head.weight`` (initialised like ``embed_tokens.weight``); the trainer sums the two
gradients across the pipeline after each step, so both copies receive the single-device update.

Tensor parallelism applies the same Llama plan to every stage (:func:`zerotron.parallel.tensor.
apply_tensor_parallel` skips the entries a pruned stage does not hold): the vocabulary-parallel
embedding on the first stage, the blocks everywhere, the final norm and the vocabulary-parallel head on
the last. With sequence parallelism the hidden states passed between stages are this rank's (b, s/t, h)
sequence shard.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from zerotron.config import ModelConfig
from zerotron.models.llama import LayerStack, LlamaForCausalLM
from zerotron.parallel.pipeline import balance_stages, stages_from_sizes
from zerotron.shapes import ModelShape, block_forward_flops, head_forward_flops


def stage_bounds(
    cfg: ModelConfig, seq_len: int, n_stages: int, layers_per_stage: Sequence[int] | None = None
) -> list[tuple[int, int]]:
    """Block ranges of the ``n_stages`` virtual stages: the user's sizes, or balanced by FLOPs."""
    if layers_per_stage:
        if len(layers_per_stage) != n_stages:
            raise ValueError(
                f"parallel.pp_layers has {len(layers_per_stage)} entries but there are {n_stages} stages "
                "(pp * virtual_stages)"
            )
        return stages_from_sizes(layers_per_stage, cfg.num_hidden_layers)
    m = ModelShape.from_config(cfg)
    block, head = block_forward_flops(m, seq_len), head_forward_flops(m)
    return balance_stages([block] * cfg.num_hidden_layers, n_stages, last_extra=head)


def build_stages(
    cfg: ModelConfig,
    bounds: Sequence[tuple[int, int]],
    pp_rank: int,
    pp_size: int,
    seed: int,
    device: torch.device | str = "cpu",
) -> list[LlamaForCausalLM]:
    """This pipeline rank's chunks (virtual stages ``c * pp_size + pp_rank``), initialised, on ``device``."""
    chunks = meta_stages(cfg, bounds, pp_rank, pp_size)
    for chunk in chunks:
        chunk.to_empty(device=device)
        chunk.init_weights(seed)
    return chunks


def meta_stages(
    cfg: ModelConfig,
    bounds: Sequence[tuple[int, int]],
    pp_rank: int,
    pp_size: int,
    vocab_rows: int | None = None,
) -> list[LlamaForCausalLM]:
    """This pipeline rank's chunks on the meta device (no storage: materialised after the split), with
    ``vocab_rows`` embedding/head rows (default: the vocabulary, unpadded)."""
    n = len(bounds)
    chunks = []
    for stage in range(pp_rank, n, pp_size):
        start, end = bounds[stage]
        with torch.device("meta"):
            chunks.append(
                LlamaForCausalLM(
                    cfg, range(start, end), embed=stage == 0, head=stage == n - 1, vocab_rows=vocab_rows
                )
            )
    return chunks


class StagedModel(nn.Module):
    """One pipeline rank's chunks under the unsplit model's names (``embed_tokens``, ``layers.7``, …).

    The chunks and this container share their modules, so ``named_parameters`` gives the global names
    that checkpoints and optimizers use, while :attr:`chunks` are what the schedule runs.
    """

    def __init__(self, cfg: ModelConfig, chunks: Sequence[LlamaForCausalLM]) -> None:
        super().__init__()
        self.config = cfg
        self.chunks = list(chunks)  # not registered twice: the modules are registered below
        self.layers = LayerStack({int(k): v for c in self.chunks for k, v in c.layers.named_children()})
        for chunk in self.chunks:
            if chunk.first:
                self.embed_tokens = chunk.embed_tokens
            if chunk.last:
                self.norm, self.lm_head = chunk.norm, chunk.lm_head

    def tied_weight(self) -> torch.Tensor | None:
        """This rank's copy of a tied embedding matrix, if it holds one."""
        return next((w for c in self.chunks if (w := c.tied_weight()) is not None), None)

    def tied_copy(self) -> tuple[torch.Tensor, str] | None:
        """The copy that is not counted, written or read twice (the last stage's head) with the name of
        the tensor it copies, if this rank holds it."""
        w = self.tied_weight()
        return (w, "embed_tokens.weight") if w is not None and any(c.last for c in self.chunks) else None

    def padded_rows(self) -> dict[str, int]:
        """This rank's parameters padded past the vocabulary (see :meth:`LlamaForCausalLM.padded_rows`)."""
        return {n: rows for c in self.chunks for n, rows in c.padded_rows().items()}

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Not callable: a pipeline rank holds part of the model; run it with a PipelineRunner."""
        raise RuntimeError("a StagedModel holds part of a pipeline; run it with zerotron.parallel.pipeline")
