"""Pipeline parallelism: split a model's blocks into stages and run a schedule's instruction lists.

*apply* part: :func:`balance_stages` cuts a sequence of per-block costs into contiguous stages (the
first stage also pays for the embedding, the last for the head and loss), minimising the most expensive
stage, or takes the user's layers per stage. The model side (which module is a stage) lives with the
model (``zerotron.models.stages``): this module works on any ``nn.Module`` chunks.

*execution*: :class:`PipelineRunner` walks this rank's list from
:mod:`zerotron.parallel.pipeline_schedule`. Sends are posted asynchronously and waited at the end of the
step; receives block, into buffers whose shape (micro-batch, seq_len, hidden) and dtype are known from
the config, so there is no shape hand-shake that could deadlock. ``BI``/``BW`` (zero-bubble): ``BI``
computes the gradient of the chunk's input (and of its small non-Linear parameters) while a
:class:`WeightGradStash` keeps each Linear's input and output gradient; ``BW`` turns those into weight
gradients, one GEMM per layer. With activation recomputation (which re-runs forwards inside the
backward) the runner falls back to two autograd passes, ``BW`` re-walking the graph for the weights.

Every P2P goes through :mod:`zerotron.distributed.collectives` on the pipeline group, counted under ``pp``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn

from zerotron import shapes
from zerotron.distributed import collectives
from zerotron.distributed.mesh import Group
from zerotron.parallel.float8 import float8_weight_grad
from zerotron.parallel.pipeline_schedule import Op, Schedule


class PipelineError(ValueError):
    """A stage split that cannot be made; the message says what to change."""


def balance_stages(
    costs: Sequence[float], n_stages: int, first_extra: float = 0.0, last_extra: float = 0.0
) -> list[tuple[int, int]]:
    """Contiguous ``[start, end)`` block ranges for ``n_stages`` stages minimising the largest stage cost.

    ``costs[i]`` is block i's cost; ``first_extra``/``last_extra`` are added to the first and last stage
    (embedding; head and loss). Every stage gets at least one block. The split is
    :func:`zerotron.shapes.balance_stages`', the planner's too.
    """
    try:
        sizes = shapes.balance_stages(costs, n_stages, first_extra, last_extra)
    except ValueError as e:
        raise PipelineError(str(e)) from None
    return stages_from_sizes(sizes, len(costs))


def stages_from_sizes(sizes: Sequence[int], n_layers: int) -> list[tuple[int, int]]:
    """``[start, end)`` ranges from the user's layers per stage (``parallel.pp_layers``)."""
    if sum(sizes) != n_layers or any(s < 1 for s in sizes):
        raise PipelineError(
            f"parallel.pp_layers={list(sizes)} must be positive and sum to model.num_hidden_layers={n_layers}"
        )
    bounds, start = [], 0
    for size in sizes:
        bounds.append((start, start + size))
        start += size
    return bounds


class SideChannel(Protocol):
    """Small per-micro-batch state that travels with the activations and their gradients (a model's
    router statistics, pooled over every stage): a fixed-size fp32 payload is sent after each hidden
    state or gradient and received after it, in the same order, so it needs no hand-shake either.
    ``key`` is (micro-batch, chunk) on this rank."""

    size: int

    def after_forward(self, key: tuple[int, int], out: torch.Tensor, last: bool) -> torch.Tensor:
        """The chunk's output (maybe wrapped to carry gradients home) after its forward."""
        ...

    def extra_loss(self, key: tuple[int, int]) -> torch.Tensor | None:
        """On the last stage: a term added to the micro-batch's loss for backward (not to its value)."""
        ...

    def outgoing(self, key: tuple[int, int], kind: str) -> torch.Tensor:
        """The payload sent with this chunk's activation (``kind`` "act") or input gradient ("grad")."""
        ...

    def incoming(self, key: tuple[int, int], kind: str, payload: torch.Tensor) -> None:
        """The payload that arrived with this chunk's input activation or output gradient."""
        ...


@dataclass
class _Step:
    """One step's inputs and what its instructions leave for each other: each micro-batch's (input,
    output) kept for backward (``saved``), the gradients that came back (``grads_out``), the tensors
    received and not yet used."""

    inputs: Sequence[torch.Tensor]
    labels: Sequence[torch.Tensor]
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    forward_context: Callable[[], Any] | None
    documents: Sequence[torch.Tensor] | None
    saved: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    grads_out: dict[tuple[int, int], torch.Tensor | None] = field(default_factory=dict)
    received: dict[tuple[str, int, int], torch.Tensor] = field(default_factory=dict)


class PipelineRunner:
    """Executes one rank's instruction list for one optimizer step.

    Args:
        schedule: the schedule of the whole pipeline (this rank uses ``schedule.ranks[rank]``).
        rank: this rank's index in the pipeline group.
        group: the pipeline-parallel group (P2P peers are its members, by stage index).
        chunks: this rank's model chunks; chunk ``c`` is virtual stage ``c * p + rank``. The first stage's
            chunk takes token ids, every other chunk a hidden state; the last stage's returns logits.
        act_shape, act_dtype: shape and dtype of the hidden state passed between stages.
        side: state that travels with every activation and gradient (:class:`SideChannel`), if any.
    """

    def __init__(
        self,
        schedule: Schedule,
        rank: int,
        group: Group,
        chunks: Sequence[nn.Module],
        act_shape: tuple[int, ...],
        act_dtype: torch.dtype,
        defer_weight_grads: bool = True,
        side: SideChannel | None = None,
    ) -> None:
        if len(chunks) != schedule.v:
            raise PipelineError(
                f"rank {rank} holds {len(chunks)} model chunks but the schedule has v={schedule.v}"
            )
        self.schedule, self.rank, self.group, self.chunks = schedule, rank, group, list(chunks)
        self.act_shape, self.act_dtype, self.side = act_shape, act_dtype, side
        self.last_stage = schedule.p * schedule.v - 1
        self.split_backward = any(op.kind == "BW" for op in schedule.ranks[rank])
        self.stash = (
            WeightGradStash.attach(self.chunks) if self.split_backward and defer_weight_grads else None
        )

    def _peer(self, pp_index: int) -> int:
        return self.group.ranks[pp_index]

    def _buffer(self, device: torch.device) -> torch.Tensor:
        return torch.empty(self.act_shape, dtype=self.act_dtype, device=device)

    def run(
        self,
        inputs: Sequence[torch.Tensor],
        labels: Sequence[torch.Tensor],
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        forward_context: Callable[[], Any] | None = None,
        documents: Sequence[torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Run the step: forward and backward of every micro-batch; return this rank's summed loss.

        ``documents``: each micro-batch's (mb, s) document ids of packed samples, given to every chunk
        (each stage masks attention and restarts positions per document alike).

        ``loss_fn(logits, labels)`` gives the (already scaled) loss of one micro-batch on the last stage;
        its detached sum is returned there (zero elsewhere). Gradients accumulate in the chunks' ``.grad``.
        ``forward_context`` (e.g. autocast or an activation meter) wraps every forward.
        """
        device = inputs[0].device
        step = _Step(inputs, labels, loss_fn, forward_context, documents)
        saved, grads_out, received = step.saved, step.grads_out, step.received
        pending: list[Any] = []
        loss_sum = torch.zeros((), dtype=torch.float32, device=device)
        for op in self.schedule.ranks[self.rank]:
            stage = self.schedule.stage(self.rank, op.chunk)
            key = (op.mb, op.chunk)
            if op.kind in ("RECV_ACT", "RECV_GRAD"):
                buf = self._buffer(device)
                collectives.recv(buf, self._peer(op.peer), self.group)
                received[(op.kind, op.mb, op.chunk)] = buf
                if self.side is not None:
                    payload = torch.empty(self.side.size, dtype=torch.float32, device=device)
                    collectives.recv(payload, self._peer(op.peer), self.group)
                    self.side.incoming(key, "act" if op.kind == "RECV_ACT" else "grad", payload)
            elif op.kind == "F":
                loss_sum += self._forward(op, stage, step)
            elif op.kind in ("SEND_ACT", "SEND_GRAD"):
                tensor = saved[key][1].detach() if op.kind == "SEND_ACT" else saved[key][0].grad
                if tensor is None:
                    raise PipelineError(f"stage {stage}: no input gradient to send for micro-batch {op.mb}")
                tensor = tensor.contiguous()
                work = collectives.send(tensor, self._peer(op.peer), self.group, async_op=True)
                pending.append((work, tensor))  # the tensor must outlive the send
                if self.side is not None:
                    payload = self.side.outgoing(key, "act" if op.kind == "SEND_ACT" else "grad").contiguous()
                    pending.append(
                        (collectives.send(payload, self._peer(op.peer), self.group, True), payload)
                    )
                if op.kind == "SEND_GRAD" and not self.split_backward:
                    saved.pop(key)
            elif op.kind in ("B", "BI"):
                grads_out[key] = received.pop(("RECV_GRAD", op.mb, op.chunk), None)
                self._backward(op, stage, saved, grads_out)
            elif op.kind == "BW":
                self._backward_weights(op, saved, grads_out)
        for work, _ in pending:
            work.wait()
        return loss_sum

    def _forward(self, op: Op, stage: int, step: _Step) -> torch.Tensor:
        if stage == 0:
            x = step.inputs[op.mb]  # (mb, s) token ids
        else:
            x = step.received.pop(("RECV_ACT", op.mb, op.chunk)).requires_grad_()  # (mb, s, h)
        document_ids = step.documents[op.mb] if step.documents is not None else None
        context = step.forward_context() if step.forward_context is not None else contextlib.nullcontext()
        with context:
            chunk = self.chunks[op.chunk]
            out = chunk(x) if document_ids is None else chunk(x, document_ids=document_ids)
            last = stage == self.last_stage
            if self.side is not None:
                out = self.side.after_forward((op.mb, op.chunk), out, last)
            if last:
                out = step.loss_fn(out, step.labels[op.mb])  # scalar
                value = out.detach().float()
                extra = self.side.extra_loss((op.mb, op.chunk)) if self.side is not None else None
                if extra is not None:  # in the backward, not in the reported loss
                    out = out + extra
        step.saved[(op.mb, op.chunk)] = (x, out)
        return value if last else torch.zeros((), device=out.device)

    def _backward(
        self,
        op: Op,
        stage: int,
        saved: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]],
        grads_out: dict[tuple[int, int], torch.Tensor | None],
    ) -> None:
        key = (op.mb, op.chunk)
        x, out = saved[key]
        grad = grads_out[key]
        if op.kind == "B":
            torch.autograd.backward(out, grad)
            grads_out.pop(key)
            if stage == 0:  # nothing to send back: done with this micro-batch
                saved.pop(key)
            return
        if self.stash is not None:  # BI: input and small-parameter gradients; Linear ones stashed
            self.stash.key = key
            inputs = ([x] if stage > 0 else []) + self.stash.other[op.chunk]
            grads = torch.autograd.grad(out, inputs, grad, allow_unused=True)
            self.stash.key = None
            if stage > 0:
                x.grad = grads[0]
            _accumulate(self.stash.other[op.chunk], grads[1 if stage > 0 else 0 :])
        elif stage > 0:  # BI without the stash: the input gradient only, keeping the graph for BW
            (x.grad,) = torch.autograd.grad(out, [x], grad, retain_graph=True)

    def _backward_weights(
        self,
        op: Op,
        saved: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]],
        grads_out: dict[tuple[int, int], torch.Tensor | None],
    ) -> None:
        key = (op.mb, op.chunk)
        _, out = saved.pop(key)
        grad = grads_out.pop(key)
        if self.stash is not None:
            self.stash.apply(key)
            return
        params = [p for p in self.chunks[op.chunk].parameters() if p.requires_grad]
        torch.autograd.backward(out, grad, inputs=params)


def _accumulate(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None]) -> None:
    for p, g in zip(params, grads):
        if g is not None:
            p.grad = g if p.grad is None else p.grad.add_(g)


class WeightGradStash:
    """Deferred weight gradients of every ``nn.Linear`` in some chunks (zero-bubble's BW, done properly).

    A forward hook on each Linear puts a hook on its output; when BI's backward passes through it,
    the output gradient and the layer's input are stashed under the current micro-batch. BI asks autograd
    only for the chunk input's gradient and the other (small) parameters' ones (norms, embedding), so no
    weight GEMM runs and the graph is freed; BW then computes each weight gradient as one GEMM
    ``dW = gᵀ·x``. Use :meth:`attach`, which returns None where this cannot apply (a parameter shared by
    a Linear and another module, e.g. tied embeddings on one stage).
    """

    def __init__(self, linears: list[nn.Linear], other: list[list[torch.Tensor]]) -> None:
        self.key: tuple[int, int] | None = None
        self.entries: dict[tuple[int, int], list[tuple[nn.Linear, torch.Tensor, torch.Tensor]]] = {}
        self.other = other
        self.handles = [m.register_forward_hook(self._on_forward) for m in linears]

    @classmethod
    def attach(cls, chunks: Sequence[nn.Module]) -> WeightGradStash | None:
        """A stash on ``chunks``' Linear layers, or None when a Linear's parameter is shared elsewhere."""
        linears = [m for c in chunks for m in c.modules() if isinstance(m, nn.Linear)]
        linear_ids = {id(p) for m in linears for p in m.parameters()}
        owned_elsewhere = {
            id(p)
            for c in chunks
            for m in c.modules()
            if not isinstance(m, nn.Linear)
            for p in m.parameters(recurse=False)
        }
        other: list[list[torch.Tensor]] = [
            [p for p in c.parameters() if p.requires_grad and id(p) not in linear_ids] for c in chunks
        ]
        if linear_ids & owned_elsewhere or not all(other):
            return None
        return cls(linears, other)

    def _on_forward(self, module: nn.Module, args: tuple[Any, ...], output: torch.Tensor) -> None:
        if not (torch.is_grad_enabled() and output.requires_grad):
            return
        inp = args[0].detach()

        def on_grad(g: torch.Tensor) -> None:
            if self.key is not None:
                self.entries.setdefault(self.key, []).append((module, inp, g.detach()))  # type: ignore[arg-type]

        output.register_hook(on_grad)

    def apply(self, key: tuple[int, int]) -> None:
        """BW of one micro-batch: accumulate every stashed Linear's weight (and bias) gradient."""
        for module, inp, g in self.entries.pop(key, []):
            w = module.weight
            g2 = g.reshape(-1, g.shape[-1]).to(w.dtype)  # (tokens, out)
            spec = getattr(module, "float8", None)  # train.precision=fp8: the float8 GEMM of its backward
            if spec is not None:
                dw = float8_weight_grad(inp, g, spec).to(w.dtype)
            else:
                dw = g2.t() @ inp.reshape(-1, inp.shape[-1]).to(w.dtype)  # (out, tokens) @ (tokens, in)
            _accumulate([w], [dw])
            if module.bias is not None:
                _accumulate([module.bias], [g2.sum(0)])


def sum_tied_grads(grad: torch.Tensor | None, group: Group) -> None:
    """Sum, in place, the gradients of a weight tied across pipeline stages (embedding and output head).

    The ranks that hold a copy (the first and the last stage: ``group`` is the mesh's ``embed`` group)
    pass its reduced gradient, the whole one or their ZeRO shard of it (the two copies are sharded
    alike); the others pass None and take no part. Afterwards both copies hold the sum, which is the
    single-device gradient of the shared matrix. Under tensor parallelism each tp rank passes its
    vocabulary shard (both copies are split alike), over the embedding group of its own tp index.
    """
    if grad is None or group.size == 1:
        return
    collectives.all_reduce(grad, group, op="sum")


def stage_activation_shape(tokens: Sequence[int], hidden: int, shards: int) -> tuple[int, int, int]:
    """The (b, s/shards, h) hidden states passed between stages for a micro-batch of ``tokens``
    (b, s) ids (``shards``: the sequence's split, tp under sequence parallelism times cp)."""
    return (tokens[0], tokens[1] // shards, hidden)


def forward_only(
    chunks: Sequence[nn.Module],
    group: Group,
    tokens: torch.Tensor,
    act_shape: tuple[int, ...],
    act_dtype: torch.dtype,
    forward_context: Callable[[], Any] | None = None,
) -> torch.Tensor | None:
    """One micro-batch of ``tokens`` (b, s) through every virtual stage in turn, without gradients or
    a schedule (a pass before training, e.g. a reference model's log-probs): stage ``k`` is chunk
    ``k // p`` of pipeline rank ``k % p``, as in :meth:`Schedule.stage`. Returns the last stage's
    output on the rank holding it, None on the others. ``act_shape``: the (b, s[/t], h) hidden states
    passed between stages."""
    p, rank = group.size, group.rank_in_group
    last = p * len(chunks) - 1
    pending: list[tuple[Any, torch.Tensor]] = []
    out = None
    for stage in range(rank, last + 1, p):  # this rank's stages, in order
        if stage == 0:
            x = tokens
        else:
            x = torch.empty(act_shape, dtype=act_dtype, device=tokens.device)
            collectives.recv(x, group.ranks[(stage - 1) % p], group)
        context = forward_context() if forward_context is not None else contextlib.nullcontext()
        with torch.no_grad(), context:
            y = chunks[stage // p](x)
        if stage == last:
            out = y
        else:
            y = y.to(act_dtype).contiguous()
            pending.append((collectives.send(y, group.ranks[(stage + 1) % p], group, async_op=True), y))
    for work, _ in pending:
        work.wait()
    return out
