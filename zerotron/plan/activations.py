"""Activation memory per rank: the tensors saved for backward, and how many micro-batches' worth a
pipeline schedule holds at once.

Activations are lists of :class:`Term` — one per tensor saved for backward — under two conventions:
``zerotron`` (exactly what the engine's autograd graph saves, read from
:mod:`zerotron.models.llama` under its :class:`~zerotron.components.metrics.ActivationMeter`) and
``megatron`` (Korthikanti et al. 2022, 16-bit activations with 1-byte dropout masks, GQA/SwiGLU
adapted). Each term says how it splits: over ``tp`` always (head- or FFN-split), only under sequence
parallelism (``sp``: the b·s·h tensors around norms, dropout and the linear inputs), or not at all.
Context parallelism divides the sequence before the terms are built.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from zerotron.layout import ulysses_size
from zerotron.shapes import ModelShape, attention_matrix_params, attention_split_params, mlp_params

_DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 2}  # fp8: activations stay 16-bit


@dataclass(frozen=True)
class Term:
    """One tensor saved for backward, for a whole micro-batch on one device before any split."""

    name: str
    nbytes: float
    split: str  # "tp", "sp" or "none"
    max_split: int = 0  # at most this many ways (KV heads replicated when tp exceeds them); 0: no limit
    storage: str = ""  # tensors that are views of one storage name it: counted once per rank (see unique)


def unique(terms: list[Term]) -> list[Term]:
    """``terms`` with each named storage counted once (the first term that names it)."""
    seen: set[str] = set()
    out = []
    for term in terms:
        if term.storage and term.storage in seen:
            continue
        seen.add(term.storage)
        out.append(term)
    return out


def _token_ids(name: str, b: int, s: int, tp: int) -> Term:
    """Token ids a stage saves: a one-sequence micro-batch's ids and labels are both views of the loader's
    (s+1)-token int64 window (one storage); a stacked batch, or ids the vocabulary-parallel layers
    rewrite (tp > 1), is a tensor of its own."""
    if b == 1 and tp == 1:
        return Term(name, 8 * (s + 1), "none", storage="loader.window")
    return Term(name, 8 * b * s, "none")


def _act_bytes(precision: str) -> int:
    return _DTYPE_BYTES[precision]


def local_matrix_params(m: ModelShape, ep: int) -> int:
    """Weight elements of one block on one expert-parallel rank (before tp): its E/ep experts."""
    mlps = m.experts // ep if m.experts else 1
    return attention_matrix_params(m) + mlps * mlp_params(m) + m.router


def moe_terms(m: ModelShape, b: int, s: int, precision: str) -> list[Term]:
    """What a Megatron MoE block saves besides its experts' MLP activations (the Megatron convention's
    estimate; the engine's own block is :func:`engine_moe_terms`): the router's fp32 logits and top-k probabilities, the
    routing indices, and the k copies of every token dispatched to its experts (compute dtype)."""
    if not m.experts:
        return []
    t, k, a = b * s, m.top_k, _act_bytes(precision)
    return [
        Term("moe.router_logits", 4 * t * m.experts, "none"),
        Term("moe.routing", (4 + 8) * t * k, "none"),
        Term("moe.dispatched_tokens", a * t * k * m.hidden, "none"),
    ]


def engine_moe_terms(
    m: ModelShape, b: int, s: int, precision: str, ep: int = 1, weights16: bool = False, etp: int = 1
) -> list[Term]:
    """What the engine's MoE block (:mod:`zerotron.models.moe`) saves for backward beyond its input, for
    balanced routing (each of the ``T·k`` slots on one expert; b micro-batch, s local sequence length).

    Router (fp32 scores): the scores (softmax's output, or sigmoid's and the per-token sums that
    normalise them), the fp32 logits logsumexp reads and its result (the z-loss), the top-k ids, and
    with ``norm_topk`` the chosen weights and their sums. Dispatch: two int64 slot indices, the slots'
    weights, the sorted token rows, the experts' gate|up output, its SiLU and the product (gate|up
    and down in the compute dtype), the experts' output and its weighted fp32 copy that the combine
    keeps. Expert parallelism keeps the regrouping permutation and its inverse. Under autocast the
    router's input and every local weight are cast to 16 bits (the experts' casts are done by the
    block, :func:`zerotron.models.moe.expert_mlp`). A shared expert saves its three products and gate.
    Tokens are a rank's own (``sp``: its sequence shard under sequence parallelism); the experts are
    whole on every tp rank (``none``). With 16-bit working weights (``weights16``) nothing is cast:
    the router and the shared expert read the norm's 16-bit output, the experts their own weights, and
    the slots' weights and weighted outputs are 16-bit like the residual stream.

    Expert tensor parallelism (``etp`` = tp): the router's terms stay the rank's own tokens, but the
    dispatch runs on all the tokens of the tp group (``none``: whole under sequence parallelism too)
    through a 1/etp slice of each expert's intermediate width."""
    t, k, h, i, e = b * s, m.top_k, m.hidden, m.intermediate, m.experts
    routed = "none" if etp > 1 else "sp"  # the tokens the experts see
    autocast = precision != "fp32"
    w = _act_bytes(precision) if autocast else 4
    slots = t * k
    terms = [
        Term("moe.scores", 4 * t * e, "sp"),
        Term("moe.logits_fp32", 4 * t * e, "sp"),
        Term("moe.logsumexp", 4 * t, "sp"),
        Term("moe.ids", 8 * slots, "sp"),
        Term("moe.slot_indices", 2 * 8 * slots, routed),
        Term("moe.slot_weights", (w if weights16 else 4) * slots, routed),
        Term("moe.tokens", w * slots * h, routed),
        Term("moe.inner", 4 * w * slots * i // etp, routed),  # gate|up (2I), SiLU (I), product (I)
        Term("moe.expert_out", w * slots * h, routed),
        Term("moe.weighted_out", (w if weights16 else 4) * slots * h, routed),
    ]
    if m.sigmoid:
        terms.append(Term("moe.score_sums", 4 * t, "sp"))
    if m.norm_topk:
        terms += [Term("moe.topk_weights", 4 * slots, "sp"), Term("moe.topk_sums", 4 * t, "sp")]
    if ep > 1:
        terms.append(Term("moe.regroup", 2 * 8 * slots, routed))
    if autocast and not weights16:
        terms.append(Term("moe.router_input_cast", w * t * h, "sp"))
        weights = (e // ep) * mlp_params(m) // etp + m.router
        terms.append(Term("moe.weight_casts", w * weights, "none"))
    if m.shared:  # gate, up and its gate's inputs (autocast's own casts)
        casts = 3 * w * t * h if autocast and not weights16 else 0
        terms.append(Term("moe.shared_inner", 4 * w * t * m.shared + casts, "sp"))
        if m.shared_gate:
            terms.append(Term("moe.shared_gate", 4 * t + 4 * t * h, "sp"))
    return terms


@dataclass(frozen=True)
class RankBlock:
    """How one rank runs a block, what its saved tensors depend on: the micro-batch ``b``, the local
    sequence length ``s``, the compute precision and recompute mode, the tensor (+ sequence), expert and
    context splits, and whether the working weights are 16-bit (``weights16``)."""

    b: int
    s: int
    precision: str
    recompute: str = "none"
    tp: int = 1
    sp: bool = False
    ep: int = 1
    etp: int = 1
    weights16: bool = False
    cp: int = 1
    cp_comm: str = "ring"
    ulysses: int = 1


def engine_layer_terms(m: ModelShape, rb: RankBlock) -> list[Term]:
    """Tensors one block of the engine saves for backward (``rb.b`` micro-batch, ``rb.s`` local sequence
    length).

    fp32: each RMSNorm saves its input, 1/rms (b·s) and the normalised value, and the gain's product
    (the linear input); autocast (bf16/fp16) instead saves a 16-bit copy of the linear input per
    projection that reads it and a 16-bit copy of every weight (autocast's cast cache lives for one
    forward). Attention saves rotated q, k and v and, unless the core is recomputed, SDPA's
    log-sum-exp and output (flash on CPU and GPU: nothing quadratic). Full recomputation keeps only the
    block's fp32 input.

    Under tensor parallelism the projections' inputs are whole (b, s, h) tensors on every rank (Megatron's
    f is the identity); under sequence parallelism (``sp``, tp > 1) the column-parallel layers save one
    (b, s/t, h) shard per region instead (in the compute dtype: one copy under autocast) and cast their
    weights in backward, so only the row-parallel weights' casts are saved. Keys and values split
    over at most ``kv_heads`` ranks (the engine replicates KV heads when tp exceeds them).

    An MoE block's terms are :func:`engine_moe_terms`'.

    ``weights16`` (ZeRO-1/2/3 under bf16/fp16: 16-bit working weights, DESIGN contract 9): the residual
    stream is 16-bit too, so each RMSNorm saves an fp32 copy of its input, 1/rms, the 16-bit cast of
    the normalised value and its 16-bit result, the one input all projections that read it save (no casts, no weight copies: the
    gathered weights are not activations); RoPE's q/k and the checkpointed block input are 16-bit.
    """
    b, s, precision, recompute, tp, sp = rb.b, rb.s, rb.precision, rb.recompute, rb.tp, rb.sp
    ep, weights16, etp = rb.ep, rb.weights16, rb.etp
    t, a = b * s, _act_bytes(precision)
    k = m.active_mlps
    h, q, kv, i, kvh = m.hidden, m.q_width, m.kv_width, m.intermediate, m.kv_heads
    v, o = m.v_width, m.o_width
    if recompute == "full":
        return [Term("block_input", (a if weights16 else 4) * t * h, "sp")]
    terms: list[Term] = []
    for norm in ("input_norm", "post_norm"):
        terms += [Term(f"{norm}.x", 4 * t * h, "sp"), Term(f"{norm}.rms", 4 * t, "sp")]
        terms.append(Term(f"{norm}.normed", (a if weights16 else 4) * t * h, "sp"))
        if weights16:  # the gain's product reads the 16-bit cast of the fp32 normalised value
            terms.append(Term(f"{norm}.cast", a * t * h, "sp"))
    casts_attn, casts_mlp = 3, (2 if m.gated else 1) * k
    moe = m.experts > 0  # the MoE block's own terms replace the MLP's (engine_moe_terms)
    if weights16:
        pass  # the projections read the norms' 16-bit results, counted above
    elif precision == "fp32":
        terms.append(Term("attn.linear_input", 4 * t * h, "sp"))
        terms.append(Term("mlp.linear_input", 4 * t * h, "sp"))  # (MoE: the router's input)
    elif sp and tp > 1:
        terms.append(Term("attn.input_shard", a * t * h, "sp"))
        if not moe:
            terms.append(Term("mlp.input_shard", a * t * h, "sp"))
        terms.append(Term("weight_casts.rowwise", a * (o * h + (0 if moe else i * h)), "tp"))  # o, down
    else:
        terms.append(Term("attn.linear_input_casts", casts_attn * a * t * h, "none"))
        if not moe:
            terms.append(Term("mlp.linear_input_casts", casts_mlp * a * t * h, "none"))
        # replicated projections are cast whole: k/v when tp exceeds the KV heads, MLA's down-projections
        kv_weights = attention_split_params(m)[1] if m.mla else h * (kv + v)
        kv_split = 1 if m.mla else tp if kvh % tp == 0 else 1
        matrices = attention_matrix_params(m) if moe else local_matrix_params(m, ep)
        terms.append(Term("weight_casts", a * (matrices - kv_weights), "tp"))
        terms.append(Term("weight_casts.kv", a * kv_weights / kv_split, "none"))
    if recompute == "selective":
        qk_bytes = a if weights16 else 4  # rotated q/k handed to the checkpointed core: RoPE's dtype
        terms += [Term("attn.q", qk_bytes * t * q, "tp"), Term("attn.k", qk_bytes * t * kv, "tp", kvh)]
        terms += [Term("attn.v", a * t * v, "tp", kvh), Term("attn.o_input", a * t * o, "tp")]
    else:
        terms += [Term("attn.q", a * t * q, "tp"), Term("attn.k", a * t * kv, "tp", kvh)]
        terms += [Term("attn.v", a * t * v, "tp", kvh), Term("attn.out", a * t * o, "tp")]
        terms.append(Term("attn.logsumexp", 4 * b * m.heads * s, "tp"))
    terms += mla_terms(m, b, s, a)
    if moe:
        return terms + engine_moe_terms(m, b, s, precision, ep, weights16, etp)
    mlp_tensors = 4 if m.gated else 2  # gate, silu, up, product | up, gelu
    terms.append(Term("mlp.inner", mlp_tensors * a * t * i, "tp"))
    return terms


def context_terms(m: ModelShape, rb: RankBlock) -> list[Term]:
    """What context-parallel attention saves beyond the one-device core's q, k, v, output and
    log-sum-exp (``rb.b`` micro-batch, ``rb.s`` local tokens): ``ulysses``/``hybrid`` keep the output
    in head-split form besides the output projection's input (and K/V repeated per query head when the
    all-to-all group does not divide this tp rank's KV heads); ``allgather`` keeps the other cp − 1
    ranks' K/V. Nothing when the core is recomputed (its inputs are what is kept)."""
    cp, cp_comm, tp = rb.cp, rb.cp_comm, rb.tp
    if cp == 1 or rb.recompute != "none":
        return []
    t, a = rb.b * rb.s, _act_bytes(rb.precision)
    if cp_comm == "allgather":
        return [Term("cp.gathered_kv", 2 * (cp - 1) * a * t * m.kv_width, "tp", m.kv_heads)]
    u = ulysses_size(cp_comm, cp, rb.ulysses)
    if u == 1:
        return []
    terms = [Term("cp.out_heads", a * t * m.q_width, "tp")]
    if (m.kv_heads // min(tp, m.kv_heads)) % u:  # repeated: each query head's K/V saved
        kv_local = m.kv_width / min(tp, m.kv_heads)
        terms.append(Term("cp.kv_repeated", 2 * a * t * (m.q_width / tp - kv_local), "none"))
    return terms


def engine_first_stage_terms(m: ModelShape, b: int, s: int, tp: int) -> list[Term]:
    """The embedding's saved token ids (and, split by vocabulary, its mask of owned ids)."""
    terms = [_token_ids("embedding.ids", b, s, tp)]
    if tp > 1:
        terms.append(Term("embedding.owned_mask", b * s, "none"))
    return terms


def engine_stage_terms(m: ModelShape, b: int, s: int, nbytes: int = 4) -> list[Term]:
    """RoPE's cos/sin tables (in the residual stream's dtype: fp32, or 16-bit under 16-bit working
    weights), built on every pipeline stage."""
    return [Term("rope.cos_sin", 2 * nbytes * b * s * m.head_dim, "none")]


def engine_last_stage_terms(
    m: ModelShape, b: int, s: int, precision: str, tp: int, sp: bool = False, weights16: bool = False
) -> list[Term]:
    """Final norm, output head and the loss (``weights16``: see :func:`engine_layer_terms`).

    The loss keeps an fp32 (b·s, V/t) softmax or log-softmax and the targets: int64 labels (and the
    weight scalar) from ``cross_entropy``, or, vocabulary-parallel, int64 local targets and a bool mask.
    The head's input is whole on every tensor-parallel rank, or under sequence parallelism its shard
    (in the compute dtype; the weight is cast again in backward).
    """
    t, h = b * s, m.hidden
    terms = [Term("final_norm.x", 4 * t * h, "sp"), Term("final_norm.rms", 4 * t, "sp")]
    terms.append(Term("final_norm.normed", (_act_bytes(precision) if weights16 else 4) * t * h, "sp"))
    if weights16:
        terms.append(Term("final_norm.cast", _act_bytes(precision) * t * h, "sp"))
    if weights16:
        pass  # the head reads the norm's 16-bit result; its weight is a gathered 16-bit copy
    elif precision == "fp32":
        terms.append(Term("head.input", 4 * t * h, "sp"))
    elif sp and tp > 1:
        terms.append(Term("head.input_shard", _act_bytes(precision) * t * h, "sp"))
    else:
        a = _act_bytes(precision)
        terms += [Term("head.input_cast", a * t * h, "none"), Term("head.weight_cast", a * m.vocab * h, "tp")]
    terms.append(Term("loss.softmax", 4 * t * m.vocab, "tp"))
    if tp > 1:
        terms.append(Term("loss.targets_and_mask", 9 * t, "none"))
    else:
        terms += [_token_ids("loss.labels", b, s, tp), Term("loss.weight", 4, "none")]
    return terms


def mla_terms(m: ModelShape, b: int, s: int, nbytes: int) -> list[Term]:
    """What multi-head latent attention saves besides the core's q, k, v and output (an estimate: the
    engine does not build MLA): each latent (the query's q_lora, the joint kv_lora and the shared rotary
    key), its RMSNorm's input and normalised output that the up-projection reads; whole on every
    tensor-parallel rank (the down-projections are replicated)."""
    if not m.mla:
        return []
    t = b * s
    terms = [Term("mla.kv_latent", nbytes * t * (m.kv_lora + m.rope_dim + 2 * m.kv_lora), "none")]
    if m.q_lora:
        terms.append(Term("mla.q_latent", 3 * nbytes * t * m.q_lora, "none"))
    return terms


def megatron_layer_terms(m: ModelShape, b: int, s: int, recompute: str, flash: bool = True) -> list[Term]:
    """Korthikanti et al. Table 2 terms for one block: 16-bit activations, 1-byte dropout masks.

    GPT with h heads and a 4h MLP gives 34·sbh + 5·as²b; GQA shrinks the k and v terms, SwiGLU keeps
    gate, up and their product. Flash attention and selective recomputation drop the 5·as²b of scores.
    """
    t, h, q, kv, i = b * s, m.hidden, m.q_width, m.kv_width, m.intermediate
    if recompute == "full":
        return [Term("block_input", 2 * t * h, "sp")]
    terms = [
        Term("norms.inputs", 4 * t * h, "sp"),
        Term("attn.qkv_input", 2 * t * h, "sp"),
        Term("attn.q_k", 2 * t * (q + kv), "tp"),
        Term("attn.v", 2 * t * m.v_width, "tp"),
        Term("attn.o_input", 2 * t * m.o_width, "tp"),
        *mla_terms(m, b, s, 2),
        Term("attn.dropout_mask", t * h, "sp"),
        Term("mlp.input", 2 * t * h, "sp"),
        Term("mlp.inner", (3 if m.gated else 2) * 2 * t * i * m.active_mlps, "tp"),
        Term("mlp.dropout_mask", t * h, "sp"),
        *moe_terms(m, b, s, "bf16"),
    ]
    if not flash and recompute == "none":
        terms.append(Term("attn.scores", 5 * m.heads * s * s * b, "tp"))
    return terms


def split_bytes(terms: list[Term], tp: int, sequence_parallel: bool) -> float:
    """Bytes of ``terms`` on one tensor-parallel rank."""
    total = 0.0
    for term in terms:
        if term.split == "tp" or (term.split == "sp" and sequence_parallel):
            total += term.nbytes / (min(tp, term.max_split) if term.max_split else tp)
        else:
            total += term.nbytes
    return total


@dataclass(frozen=True)
class InFlight:
    """What one pipeline rank holds at its activation peak.

    ``chunks``: chunk-micro-batches in flight (a chunk is L/(p·v) layers); ``first``/``last``: how many
    of them are in the first virtual stage (embedding) or the last (head and loss).
    """

    chunks: int
    first: int
    last: int


@functools.lru_cache(maxsize=16384)
def inflight(schedule: str, pp: int, micro_batches: int, rank: int, virtual: int = 1) -> InFlight:
    """The rank's peak of in-flight micro-batches under the engine's schedules.

    GPipe runs every forward first (m in flight); 1F1B and zero-bubble (ZB-H1) warm up with p − r − 1
    forwards (peak min(p − r, m)); interleaved 1F1B replays Megatron's order, whose first rank peaks at
    p·v + p − 1 chunks: Korthikanti's factor 1 + (p − 1)/(p·v) over 1F1B.
    """
    m, p, r = micro_batches, pp, rank
    if p == 1:
        return InFlight(1, 1, 1)
    if schedule == "gpipe":
        return InFlight(m, m if r == 0 else 0, m if r == p - 1 else 0)
    if schedule != "interleaved":
        n = min(p - r, m)
        return InFlight(n, n if r == 0 else 0, n if r == p - 1 else 0)
    v, total = virtual, m * virtual
    warmup = total if m == p else min(total, (p - r - 1) * 2 + (v - 1) * p)
    live = [0] * v
    best = list(live)
    for k in range(total):  # forward k, then (after warm-up) backward k - warmup
        live[(k // p) % v] += 1
        best = list(live) if sum(live) > sum(best) else best
        if k >= warmup:
            live[v - 1 - ((k - warmup) // p) % v] -= 1
    return InFlight(sum(best), best[0] if r == 0 else 0, best[v - 1] if r == p - 1 else 0)


def inflight_microbatches(schedule: str, pp: int, micro_batches: int, stage: int, virtual: int) -> float:
    """In-flight micro-batches of whole stages (L/p layers) at the rank's peak (``chunks / v``)."""
    v = virtual if schedule == "interleaved" else 1
    return inflight(schedule, pp, micro_batches, stage, v).chunks / v
