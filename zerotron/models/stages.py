"""Pipeline stages of the Llama family: one contiguous range of decoder blocks per stage.

A :class:`LlamaStage` holds the embedding when it is the first stage, blocks ``[start, end)`` and the
final norm and output head when it is the last. Parameter names are those of the whole
:class:`~zerotron.models.llama.LlamaForCausalLM` (``layers.7.mlp.up_proj.weight``), so every stage
initialises its parameters to the same global values for the same seed (DESIGN contract 4) and
checkpoints name them the same way under any split.

With tied embeddings and more than one stage, the last stage holds its own copy of the embedding
matrix as ``lm_head.weight`` (initialised like ``embed_tokens.weight``); the trainer sums the two
gradients across the pipeline after each step, so both copies receive the single-device update.

Under tensor parallelism :func:`tensor_parallel_stages` applies the Llama plan to every stage, each
with the part of the plan it holds: the vocabulary-parallel embedding on the first stage, the blocks
everywhere, the final norm and the vocabulary-parallel head on the last. With sequence parallelism
the hidden states passed between stages are this rank's (b, s/t, h) sequence shard.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from zerotron.config import ModelConfig
from zerotron.distributed.mesh import Group
from zerotron.models.llama import (
    DecoderLayer,
    RMSNorm,
    RotaryEmbedding,
    init_parameter,
    tensor_parallel_plan,
)
from zerotron.parallel.pipeline import balance_stages, stages_from_sizes
from zerotron.parallel.tensor import TensorParallelPlan, apply_tensor_parallel
from zerotron.shapes import ModelShape, block_forward_flops, head_forward_flops


class LlamaStage(nn.Module):
    """Blocks ``[start, end)`` of a Llama model, plus the embedding (first) and the head (last)."""

    def __init__(self, cfg: ModelConfig, start: int, end: int, first: bool, last: bool) -> None:
        super().__init__()
        self.config, self.first, self.last = cfg, first, last
        if first:
            self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleDict({str(i): DecoderLayer(cfg, i) for i in range(start, end)})
        if last:
            self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
            if first and cfg.tie_word_embeddings:  # one stage: the model itself
                self.lm_head.weight = self.embed_tokens.weight
        self.rotary = RotaryEmbedding(cfg)
        self.sequence_shards = 1  # tp under sequence parallelism: hidden states are (b, s/t, h) shards

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Token ids (b, s) on the first stage, hidden states (b, s, h) elsewhere -> (b, s, h) or logits.

        Under sequence parallelism the hidden states (input and output) are (b, s/t, h) shards.
        """
        if self.first:
            b, s = x.shape  # token ids
            x = self.embed_tokens(x)  # (b, s, h) [(b, s/t, h)]
        else:
            b, s = x.shape[0], x.shape[1] * self.sequence_shards
        position_ids = torch.arange(s, device=x.device).expand(b, s)  # (b, s)
        cos, sin = self.rotary(position_ids, x.dtype)
        for layer in self.layers.values():
            x = layer(x, cos, sin)
        if self.last:
            return self.lm_head(self.norm(x))  # (b, s, V)
        return x

    def tied_weight(self) -> torch.Tensor | None:
        """This stage's copy of a tied embedding matrix (to sum gradients across stages), if any."""
        if not self.config.tie_word_embeddings or (self.first and self.last):
            return None
        if self.first:
            return self.embed_tokens.weight
        return self.lm_head.weight if self.last else None

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """The global initial values of this stage's parameters (same as the unsplit model's)."""
        for name, param in self.named_parameters():
            tied_head = name == "lm_head.weight" and self.config.tie_word_embeddings
            global_name = "embed_tokens.weight" if tied_head else name
            param.copy_(init_parameter(global_name, tuple(param.shape), seed, self.config))


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
) -> list[LlamaStage]:
    """This pipeline rank's chunks (virtual stages ``c * pp_size + pp_rank``), initialised, on ``device``."""
    n = len(bounds)
    chunks = []
    for stage in range(pp_rank, n, pp_size):
        start, end = bounds[stage]
        with torch.device("meta"):
            chunk = LlamaStage(cfg, start, end, first=stage == 0, last=stage == n - 1)
        chunk.to_empty(device=device)
        if chunk.first and chunk.last and cfg.tie_word_embeddings:
            chunk.lm_head.weight = chunk.embed_tokens.weight
        chunk.init_weights(seed)
        chunks.append(chunk)
    return chunks


def tensor_parallel_stages(
    chunks: Sequence[LlamaStage], cfg: ModelConfig, group: Group, sequence_parallel: bool
) -> None:
    """Split every chunk over the tensor-parallel ``group`` in place (after the pipeline split).

    Each chunk takes the entries of the Llama plan it holds: the embedding only on the first stage, the
    final norm and the output head only on the last (a tied head is the last stage's own copy, split
    by vocabulary like the embedding, so the two copies' shards line up across the pipeline).
    """
    for chunk in chunks:
        plan = tensor_parallel_plan(cfg)
        if not chunk.first:
            del plan["embedding"]
        if not chunk.last:
            del plan["output"]
            plan["norms"] = []
        apply_tensor_parallel(
            chunk,
            TensorParallelPlan.from_dict(plan),
            group,
            sequence_parallel,
            hidden_input=not chunk.first,
        )
        if sequence_parallel:
            chunk.sequence_shards = group.size


class StagedModel(nn.Module):
    """One pipeline rank's chunks under the unsplit model's names (``embed_tokens``, ``layers.7``, …).

    The chunks and this container share their modules, so ``named_parameters`` gives the global names
    that checkpoints and optimizers use, while :attr:`chunks` are what the schedule runs.
    """

    def __init__(self, cfg: ModelConfig, chunks: Sequence[LlamaStage]) -> None:
        super().__init__()
        self.config = cfg
        self.chunks = list(chunks)  # not registered twice: the modules are registered below
        self.layers = nn.ModuleDict({k: v for c in self.chunks for k, v in c.layers.items()})
        for chunk in self.chunks:
            if chunk.first:
                self.embed_tokens = chunk.embed_tokens
            if chunk.last:
                self.norm, self.lm_head = chunk.norm, chunk.lm_head

    def tied_weight(self) -> torch.Tensor | None:
        """This rank's copy of a tied embedding matrix, if it holds one."""
        return next((w for c in self.chunks if (w := c.tied_weight()) is not None), None)

    def tied_duplicate(self) -> torch.Tensor | None:
        """The copy that must not be counted twice (the last stage's head), if this rank holds it."""
        w = self.tied_weight()
        return w if w is not None and any(c.last for c in self.chunks) else None

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Not callable: a pipeline rank holds part of the model; run it with a PipelineRunner."""
        raise RuntimeError("a StagedModel holds part of a pipeline; run it with zerotron.parallel.pipeline")
