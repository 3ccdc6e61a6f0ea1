"""A Llama-family decoder written for one device, as a reference implementation.

Covers Llama 2/3 (GQA, Llama 3 RoPE frequency scaling), Mistral (no sliding window), Qwen2 (q/k/v bias),
SmolLM2 (tied embeddings) and GPT-style models (``mlp="plain"``: GELU MLP). Parallelism is applied to
this model from outside (DESIGN contract 3); the parallel plan relies on these names:

- ``model.embed_tokens``, ``model.layers`` (a :class:`LayerStack` of :class:`DecoderLayer`), ``model.norm``,
  ``model.lm_head`` (sharing ``embed_tokens.weight`` when ``tie_word_embeddings``);
- inside a block: ``self_attn.{q,k,v,o}_proj``, ``self_attn.core`` (softmax(QKᵀ)V only, the unit of
  selective recomputation), ``mlp.{gate,up,down}_proj``, ``input_layernorm``, ``post_attention_layernorm``.

Parameter names equal Hugging Face's ``LlamaForCausalLM`` names without the ``model.`` prefix.
Initialisation is layout-independent (DESIGN contract 4): :func:`init_parameter` gives each parameter a
value that depends only on (seed, name, global shape).
"""

from __future__ import annotations

import math
import zlib
from typing import Any, Optional, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from zerotron.config import ModelConfig
from zerotron.models.moe import MoEBlock


class RMSNorm(nn.Module):
    """Root-mean-square LayerNorm; the statistic is computed in fp32 and the result cast back (as HF)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalise the last dimension of ``x`` (any leading shape)."""
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def rope_inverse_frequencies(cfg: ModelConfig) -> torch.Tensor:
    """RoPE inverse frequencies (d/2,) in fp32 on the CPU, with Llama 3 scaling when configured.

    Llama 3 scaling (HF ``rope_type="llama3"``): wavelengths longer than
    ``original_max_position_embeddings / low_freq_factor`` are divided by ``factor``, shorter than
    ``original / high_freq_factor`` are kept, and the band between is interpolated smoothly.
    """
    dim = cfg.dim_per_head
    inv_freq = 1.0 / (
        cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim)
    )  # (d/2,)
    scaling = cfg.rope_scaling or {}
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return inv_freq
    if rope_type != "llama3":
        raise ValueError(f"model.rope_scaling: rope_type {rope_type!r} is not supported; use llama3 or none")
    factor = float(scaling["factor"])
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    original = float(scaling["original_max_position_embeddings"])
    low_freq_wavelen, high_freq_wavelen = original / low, original / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (original / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """cos/sin tables of rotary position embeddings, built lazily per device (never a parameter).

    The tables are plain attributes rather than buffers so that a model built on the meta device needs
    no re-initialisation of them, and so that ``state_dict`` holds weights only.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.inv_freq = rope_inverse_frequencies(cfg)  # (d/2,) fp32, CPU
        self.max_len = cfg.max_position_embeddings
        self._tables: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def _table(self, device: torch.device, needed: int) -> tuple[torch.Tensor, torch.Tensor]:
        cached = self._tables.get(device)
        if cached is None or cached[0].shape[0] < needed:
            length = max(self.max_len, needed)
            pos = torch.arange(length, dtype=torch.float32, device=device)
            freqs = pos[:, None] * self.inv_freq.to(device)[None, :]  # (L, d/2)
            emb = torch.cat((freqs, freqs), dim=-1)  # (L, d)
            cached = (emb.cos(), emb.sin())
            self._tables[device] = cached
        return cached

    def forward(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin for ``position_ids`` (b, s), each (b, 1, s, d) in ``dtype``."""
        cos, sin = self._table(position_ids.device, int(position_ids.max()) + 1)
        return cos[position_ids].unsqueeze(1).to(dtype), sin[position_ids].unsqueeze(1).to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` (b, heads, s, d) by the angles in cos/sin (b, 1, s, d); HF's half-split convention."""
    return x * cos + _rotate_half(x) * sin


class AttentionCache(Protocol):
    """What the attention layers need of a cache: ``length`` tokens held before this step (the model
    derives positions and the chunk's causal mask from it) and ``attend``, which stores the step's keys
    and values and attends to all of them. :class:`KVCache` is the contiguous one;
    :class:`zerotron.serve.paged.PagedAttention` reads a paged pool through block tables."""

    length: int

    def attend(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        attn_mask: Optional[torch.Tensor],
        core: nn.Module,
    ) -> torch.Tensor: ...


class KVCache:
    """Preallocated keys and values of every layer for incremental decoding.

    ``k[i]``/``v[i]`` are (b, kv_heads, max_len, d); ``length`` tokens of them are filled. The model
    writes a step's keys into place (no concatenation, no per-step allocation of the cache) and advances
    ``length`` once all layers have run.
    """

    def __init__(
        self,
        cfg: ModelConfig,
        batch: int,
        max_len: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        shape = (batch, cfg.kv_heads, max_len, cfg.dim_per_head)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.num_hidden_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.num_hidden_layers)]
        self.max_len = max_len
        self.length = 0

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store a step's k, v (b, kv_heads, s, d) of ``layer``; return all keys/values so far (views)."""
        end = self.length + k.shape[2]
        if end > self.max_len:
            raise ValueError(f"KV cache full: {end} tokens exceed its max_len={self.max_len}")
        self.k[layer][:, :, self.length : end] = k
        self.v[layer][:, :, self.length : end] = v
        return self.k[layer][:, :, :end], self.v[layer][:, :, :end]

    def attend(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        attn_mask: Optional[torch.Tensor],
        core: nn.Module,
    ) -> torch.Tensor:
        """Store this step's k/v of ``layer`` and attend q (b, h, s, d) to every key so far."""
        k, v = self.update(layer, k, v)  # (b, kvh, t, d)
        out: torch.Tensor = core(q, k, v, attn_mask)
        return out


def document_positions(document_ids: torch.Tensor) -> torch.Tensor:
    """Packed documents (b, s) -> position ids (b, s) restarting at 0 at each document's first token."""
    s = document_ids.shape[1]
    index = torch.arange(s, device=document_ids.device).expand_as(document_ids)
    starts = torch.ones_like(document_ids, dtype=torch.bool)
    starts[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    first = torch.where(starts, index, torch.zeros_like(index)).cummax(dim=1).values  # each doc's start
    return index - first


def document_attention(document_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed documents (b, s) -> (position ids restarting at each document (b, s), boolean mask
    (b, 1, s, s): causal within a document, nothing across documents)."""
    s = document_ids.shape[1]
    same = document_ids[:, :, None] == document_ids[:, None, :]
    causal = torch.ones(s, s, dtype=torch.bool, device=document_ids.device).tril()
    return document_positions(document_ids), (same & causal)[:, None]


class SequenceSplit(Protocol):
    """What a model whose tokens are split over ranks (context parallelism) needs of the split: the
    global positions (s,) of this rank's ``s`` tokens of each row and the value its replaced attention
    cores take in place of a mask (where every rank's tokens sit, the whole rows' document ids)."""

    def prepare(
        self, s: int, device: torch.device, document_ids: Optional[torch.Tensor]
    ) -> tuple[torch.Tensor, Any]: ...


class AttentionCore(nn.Module):
    """softmax(QKᵀ/√d)V with a causal mask: the part selective recomputation wraps.

    Grouped-query attention is handled by SDPA's ``enable_gqa`` (k/v heads are shared by groups of
    query heads without being copied).
    """

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        """q (b, h, s, d), k/v (b, kv_h, t, d) -> (b, h, s, d). Causal unless an explicit mask is given.

        With ``t > s`` (cached keys) and no mask, every query sees every key: the single-token decode step.
        """
        gqa = q.shape[1] != k.shape[1]
        if attn_mask is not None:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, enable_gqa=gqa)
        causal = q.shape[2] > 1 and q.shape[2] == k.shape[2]
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)


class Attention(nn.Module):
    """Multi-head attention with GQA/MQA, RoPE and optional q/k/v bias (Qwen2)."""

    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.kv_heads, self.head_dim = cfg.num_attention_heads, cfg.kv_heads, cfg.dim_per_head
        if self.num_heads % self.kv_heads:
            raise ValueError(
                f"model.num_key_value_heads={self.kv_heads} must divide num_attention_heads={self.num_heads}"
            )
        h, qd, kvd = cfg.hidden_size, self.num_heads * self.head_dim, self.kv_heads * self.head_dim
        self.q_proj = nn.Linear(h, qd, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(h, kvd, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(h, kvd, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(qd, h, bias=False)
        self.core = AttentionCore()
        self.qk_norm = cfg.qk_norm
        if cfg.qk_norm not in ("none", "head", "full"):
            raise ValueError(f"model.qk_norm: unknown value {cfg.qk_norm!r}; choose none, head or full")
        if cfg.qk_norm != "none":  # per head (Qwen3) or over the whole projection (OLMoE)
            full = cfg.qk_norm == "full"
            self.q_norm = RMSNorm(qd if full else self.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(kvd if full else self.head_dim, cfg.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: Optional[AttentionCache] = None,
        attn_mask: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """x (b, s, h) -> (b, s, h)."""
        b, s, _ = x.shape
        q, k = self.q_proj(x), self.k_proj(x)  # (b, s, nh·d), (b, s, kvh·d)
        if self.qk_norm == "full":
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.view(b, s, self.num_heads, self.head_dim)
        k = k.view(b, s, self.kv_heads, self.head_dim)
        if self.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)  # (b, nh, s, d), (b, kvh, s, d)
        v = self.v_proj(x).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)  # (b, kvh, s, d)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if kv_cache is not None:  # the cache stores k/v and attends (contiguous or paged)
            out = kv_cache.attend(self.layer_idx, q, k, v, attn_mask, self.core)  # (b, nh, s, d)
        else:
            out = self.core(q, k, v, attn_mask)  # (b, nh, s, d)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, self.num_heads * self.head_dim))


class MLP(nn.Module):
    """SwiGLU (``gated``: down(silu(gate(x)) * up(x))) or GPT-style (``plain``: down(gelu(up(x)))).

    The plain MLP uses GELU with the tanh approximation (GPT-2's ``gelu_new``) and, like the gated one,
    no biases.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        if cfg.mlp not in ("gated", "plain"):
            raise ValueError(f"model.mlp: unknown value {cfg.mlp!r}; choose gated or plain")
        self.gated = cfg.mlp == "gated"
        h, i = cfg.hidden_size, cfg.intermediate_size
        if self.gated:
            self.gate_proj = nn.Linear(h, i, bias=False)
        self.up_proj = nn.Linear(h, i, bias=False)
        self.down_proj = nn.Linear(i, h, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (b, s, h) -> (b, s, h)."""
        if self.gated:
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))  # (b, s, h)
        return self.down_proj(F.gelu(self.up_proj(x), approximate="tanh"))


class DecoderLayer(nn.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then + mlp(norm(.))."""

    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer_idx)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp: nn.Module = MoEBlock(cfg) if cfg.num_local_experts else MLP(cfg)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: Optional[AttentionCache] = None,
        attn_mask: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """x (b, s, h) -> (b, s, h)."""
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, kv_cache, attn_mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class LayerStack(nn.ModuleList):
    """The decoder blocks a model holds, registered under their global indices (``layers.7``).

    The whole model holds blocks ``0 .. L-1`` (an ordinary ``ModuleList``); a pipeline stage holds a
    contiguous range of them under the same names, so parameter names, initial values and checkpoint
    keys do not depend on the split. Iteration and integer indexing go by position.
    """

    def __init__(self, blocks: dict[int, nn.Module]) -> None:
        super().__init__()
        for index, block in blocks.items():
            self._modules[str(index)] = block

    def __getitem__(self, idx: Any) -> Any:
        return list(self._modules.values())[idx]


class LlamaForCausalLM(nn.Module):
    """Decoder-only language model returning logits; the loss is the caller's.

    Args:
        cfg: architecture (preset already applied). Build on the meta device and call
            ``to_empty(device=...)`` + :meth:`init_weights` to materialise without a first random init.
        layers: the blocks this model holds (all of them unless it is a pipeline stage).
        embed, head: whether it holds the embedding (the first stage) and the final norm + output head
            (the last stage). A model without the embedding takes hidden states ``(b, s, h)`` (``(b,
            s/t, h)`` sequence shards under sequence parallelism: :attr:`sequence_shards`); one without
            the head returns them. With tied embeddings, a last stage that is not also the first holds
            its own copy of the embedding matrix as ``lm_head.weight`` (initialised like
            ``embed_tokens.weight``; the pipeline sums the two copies' gradients after each step).
        vocab_rows: rows of the embedding and output head (default ``vocab_size``); more pads the
            vocabulary (:meth:`~zerotron.config.ModelConfig.padded_vocab`, so that tensor parallelism
            splits it evenly): the rows past ``vocab_size`` are zeros, their logits are ``-inf`` (no
            token ever gets probability there, so the loss and the gradients are the unpadded model's)
            and the placement record leaves them out of the parameter count and the checkpoints.

    A pipeline stage is this model with what it does not own pruned (:mod:`zerotron.models.stages`).
    """

    def __init__(
        self,
        cfg: ModelConfig,
        layers: range | None = None,
        embed: bool = True,
        head: bool = True,
        vocab_rows: int | None = None,
    ) -> None:
        super().__init__()
        self.config = cfg
        self.vocab_rows = vocab_rows or cfg.vocab_size
        if self.vocab_rows < cfg.vocab_size:
            raise ValueError(f"vocab_rows={self.vocab_rows} < vocab_size={cfg.vocab_size}")
        layers = range(cfg.num_hidden_layers) if layers is None else layers
        if embed:
            # nn.Embedding's own N(0, 1) where there are values to draw; none on the meta device
            # (torch's meta normal_ imports torch._dynamo: 1.2 s of a served model's start-up)
            weight = torch.empty(self.vocab_rows, cfg.hidden_size)
            if weight.device.type != "meta":
                nn.init.normal_(weight)
            self.embed_tokens = nn.Embedding(self.vocab_rows, cfg.hidden_size, _weight=weight)
        self.layers = LayerStack({i: DecoderLayer(cfg, i) for i in layers})
        if head:
            self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
            self.lm_head = nn.Linear(cfg.hidden_size, self.vocab_rows, bias=False)
        self.rotary = RotaryEmbedding(cfg)
        self.sequence_shards = 1  # tp under sequence parallelism: hidden inputs are (b, s/t, h) shards
        self.context: Optional[SequenceSplit] = None  # context parallelism: this rank's tokens of each row
        self.tie_weights()

    @property
    def first(self) -> bool:
        """Whether this model holds the embedding (takes token ids)."""
        return "embed_tokens" in self._modules

    @property
    def last(self) -> bool:
        """Whether this model holds the output head (returns logits)."""
        return "lm_head" in self._modules

    def tie_weights(self) -> None:
        """Make ``lm_head.weight`` the very tensor of ``embed_tokens.weight`` when tied (and both here)."""
        if (
            self.config.tie_word_embeddings
            and self.first
            and self.last
            and isinstance(self.lm_head, nn.Linear)
        ):
            self.lm_head.weight = self.embed_tokens.weight  # (a quantised pair shares its tensors already)

    def tied_weight(self) -> torch.Tensor | None:
        """This stage's copy of a tied embedding matrix (to sum gradients across stages), if any."""
        if not self.config.tie_word_embeddings or (self.first and self.last):
            return None
        if self.first:
            return self.embed_tokens.weight
        return self.lm_head.weight if self.last else None

    def _apply(self, fn, recurse=True):  # type: ignore[no-untyped-def]
        # to_empty/to/cuda convert the two tied references separately; re-tie afterwards.
        super()._apply(fn, recurse)  # type: ignore[no-untyped-call]
        self.tie_weights()
        return self

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: Optional[torch.Tensor] = None,
        kv_cache: Optional[AttentionCache] = None,
        logits_to_keep: int = 0,
        logits_index: Optional[torch.Tensor] = None,
        document_ids: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """input_ids (b, s) -> logits (b, s, V). With ``kv_cache``, continue after its cached tokens.

        ``document_ids`` (b, s) marks packed documents: a token attends only to earlier tokens of its
        own document, and positions restart at each document unless ``position_ids`` are given, so each
        document gets the logits it has alone.

        Under context parallelism (:attr:`context`, set by
        :func:`~zerotron.parallel.context.apply_context_parallel`) ``input_ids`` are this rank's zig-zag
        tokens of each row, ``document_ids`` the whole rows' ids, and the positions come from the split.

        ``logits_to_keep=n > 0`` projects only the last n positions to the vocabulary (b, n, V): a
        prefill for generation needs just the last one. A pipeline stage takes hidden states instead
        of token ids when it has no embedding, and returns hidden states when it has no head.
        """
        if self.first:
            b, s = input_ids.shape
            x = self.embed_tokens(input_ids)  # (b, s, h) [(b, s/t, h) under sequence parallelism]
        else:
            x = input_ids  # hidden states from the previous stage
            b, s = x.shape[0], x.shape[1] * self.sequence_shards
        past = kv_cache.length if kv_cache is not None else 0
        attn_mask: Any = None
        if self.context is not None:  # s of the row's tokens; the whole rows' document ids
            index, attn_mask = self.context.prepare(s, x.device, document_ids)
            whole = index.expand(b, s) if document_ids is None else document_positions(document_ids)[:, index]
            position_ids = whole if position_ids is None else position_ids
        elif document_ids is not None:
            if kv_cache is not None:
                raise ValueError("document_ids (packed documents) cannot be combined with a KV cache")
            doc_positions, attn_mask = document_attention(document_ids)
            position_ids = doc_positions if position_ids is None else position_ids
        if position_ids is None:
            position_ids = torch.arange(past, past + s, device=x.device).expand(b, s)  # (b, s)
        cos, sin = self.rotary(position_ids, x.dtype)  # (b, 1, s, d)
        if past > 0 and s > 1:
            # A chunk after cached tokens: query i sees keys up to past + i (causal, bottom-right aligned).
            keys = torch.arange(past + s, device=x.device)
            attn_mask = keys[None, :] <= (past + torch.arange(s, device=x.device))[:, None]  # (s, t)
        for layer in self.layers:
            x = layer(x, cos, sin, kv_cache, attn_mask)
        if kv_cache is not None:
            kv_cache.length += s
        if not self.last:
            return x
        if logits_index is not None:
            x = x[:, logits_index]
        elif logits_to_keep > 0:
            x = x[:, -logits_to_keep:]
        logits = self.lm_head(self.norm(x))  # (b, s, V) [this rank's V/t columns under tp]
        return self._mask_padding(logits) if self.vocab_rows > self.config.vocab_size else logits

    def _mask_padding(self, logits: torch.Tensor) -> torch.Tensor:
        """``-inf`` in the columns of padded vocabulary rows (ids >= vocab_size; under tensor
        parallelism this rank's columns start at its shard's offset)."""
        spec = getattr(self.lm_head, "tp_specs", {}).get("weight")
        start = spec.offsets[0] if spec is not None else 0
        ids = torch.arange(start, start + logits.shape[-1], device=logits.device)  # (V/t,)
        return logits.masked_fill(ids >= self.config.vocab_size, float("-inf"))

    def padded_rows(self) -> dict[str, int]:
        """Parameters padded past the vocabulary: name -> rows that are real (vocab_size)."""
        if self.vocab_rows == self.config.vocab_size:
            return {}
        names = [n for n, held in (("embed_tokens", self.first), ("lm_head", self.last)) if held]
        return {f"{n}.weight": self.config.vocab_size for n in names}

    @torch.no_grad()
    def pad_vocabulary(self, rows: int) -> None:
        """Grow a materialised model's embedding and head to ``rows`` rows (zeros past the vocabulary):
        what :func:`~zerotron.models.parallelize.parallelize_llama` builds directly, for a model loaded
        whole (``zerotron generate`` under tp)."""
        if rows <= self.vocab_rows:
            return
        for name in ("embed_tokens", "lm_head"):  # a tied head is grown too, then tied again
            module = getattr(self, name, None)
            if module is None:
                continue
            old = module.weight
            grown = old.new_zeros((rows, *old.shape[1:]))
            grown[: old.shape[0]] = old
            module.weight = nn.Parameter(grown, old.requires_grad)
        self.vocab_rows = rows
        self.tie_weights()

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Give every parameter its layout-independent initial value (see :func:`init_parameter`); a
        tied head copy takes the embedding's."""
        self.tie_weights()
        padded = self.padded_rows()
        for name, param in self.named_parameters():
            source = "embed_tokens.weight" if self.tied_weight() is param and self.last else name
            shape = tuple(param.shape)
            rows = padded.get(name, shape[0] if shape else 0)
            param.zero_()
            param[:rows].copy_(init_parameter(source, (rows, *shape[1:]), seed, self.config))


def init_parameter(name: str, shape: tuple[int, ...], seed: int, cfg: ModelConfig) -> torch.Tensor:
    """The initial value (fp32, CPU) of parameter ``name`` with global ``shape``: a pure function.

    A generator seeded with crc32(f"{seed}:{name}") draws N(0, initializer_range) for matrices, scaled by
    1/sqrt(2·num_layers) for the residual output projections (o_proj, down_proj; GPT-2); norms are ones
    and biases zeros. A sharded engine computes the same global tensor and slices its part.
    """
    if name.endswith("bias"):
        return torch.zeros(shape, device="cpu")
    if "norm" in name.rsplit(".", 2)[-2]:
        return torch.ones(shape, device="cpu")
    # The CPU generator keeps only 32 bits of its seed, so seed and name are hashed together into 32.
    gen = torch.Generator(device="cpu").manual_seed(zlib.crc32(f"{seed}:{name}".encode()))
    std = cfg.initializer_range
    if name.endswith(("o_proj.weight", "down_proj.weight", "experts.down_proj")):
        std /= math.sqrt(2 * cfg.num_hidden_layers)
    return torch.empty(shape, device="cpu").normal_(0.0, std, generator=gen)


def tensor_parallel_plan(cfg: ModelConfig) -> dict[str, Any]:
    """How tensor parallelism splits this model (the format of :mod:`zerotron.parallel.tensor`).

    Attention is split by heads (q, and k/v by KV heads, replicated when tp exceeds them), the MLP by
    intermediate columns (SwiGLU's gate and up alike), the embedding and the output head by vocabulary.
    A mixture-of-experts block is not split: every tp rank holds its experts whole and runs them on the
    tokens it has (its sequence shard under sequence parallelism, whose gradients then sum over tp, as
    the norms' do), as Megatron does with an expert tensor-parallel size of 1.
    """
    mlp_colwise = ["gate_proj", "up_proj"] if cfg.mlp == "gated" else ["up_proj"]
    regions: dict[str, Any] = {
        "self_attn": {
            "colwise": ["q_proj", "k_proj", "v_proj"],
            "rowwise": ["o_proj"],
            "heads": {"num_heads": ["q_proj"], "kv_heads": ["k_proj", "v_proj"]},
        },
    }
    replicated = ["input_layernorm", "post_attention_layernorm"]
    if cfg.num_local_experts:  # experts whole on every tp rank (Megatron's expert tp = 1)
        replicated.append("mlp")
    else:
        regions["mlp"] = {"colwise": mlp_colwise, "rowwise": ["down_proj"]}
    return {
        "embedding": "embed_tokens",
        "output": "lm_head",
        "norms": ["norm"],
        "blocks": "layers",
        "block": {"norms": replicated, "regions": regions},
    }


def count_parameters(model: nn.Module) -> int:
    """Number of distinct parameter elements (a tied embedding counts once)."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
