"""Speculative decoding with a draft model: lossless against the engine without speculation.

References: the same engine with speculation off (greedy tokens and log-probabilities, bit for bit,
alone and batched, with chunked prefill, preemption and the native kernels), the model's exact
distribution for sampled output (brute-force forwards, chi-square), and a draft that is a copy of the
served model, whose every proposal the served model must keep — a draft cache that held a wrong
token or position would propose something else.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import subprocess
import sys
import time
import urllib.request

import pytest
import torch

from tests.test_serve_engine import CFG, GREEDY, _prompts, _run, sharpened_pair
from tests.test_serve_speculative import _chi_square_p, _repetitive, three_token_samples
from zerotron.serve import kernels
from zerotron.serve.config import EngineConfigError
from zerotron.serve.engine import Engine, EngineConfig, RequestError
from zerotron.serve.speculative import DraftConfig

DRAFT = DraftConfig(num_speculative_tokens=4, model="draft")
LAYERS = DraftConfig(num_speculative_tokens=3, draft_layers=1)


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return sharpened_pair(CFG)[1]


@pytest.fixture(scope="module")
def small() -> torch.nn.Module:
    """A different model of the same vocabulary: one layer, its own random weights."""
    torch.manual_seed(5)
    return sharpened_pair(dataclasses.replace(CFG, num_hidden_layers=1))[1]


KINDS = {
    "F.linear": {},
    "oneDNN, chunked prefill": {"onednn": True, "max_num_batched_tokens": 24},
    "preempting": {"num_blocks": 12, "block_size": 4, "max_model_len": 40},
    "native": {"native_attention": True},
}


def _engine(
    model: torch.nn.Module, draft: torch.nn.Module | None, spec: DraftConfig | None, **kw: object
) -> Engine:
    config = EngineConfig(**{"num_blocks": 128, **kw, "speculative": spec})  # type: ignore[arg-type]
    return Engine(
        copy.deepcopy(model), None, config, None, copy.deepcopy(draft) if draft is not None else None
    )  # type: ignore[arg-type]


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("which", ["draft model", "first layers"])
def test_greedy_output_is_the_output_without_speculation(
    model: torch.nn.Module, small: torch.nn.Module, kind: str, which: str
) -> None:
    kw = KINDS[kind]
    if kw.get("native_attention") and not kernels.available():
        pytest.skip(f"the native attention kernel is not built here ({kernels.why_unavailable()})")
    prompts = _repetitive(seed=3, count=5) + _prompts([19], seed=8)
    params = dataclasses.replace(GREEDY, max_tokens=20)
    plain = _engine(model, None, None, **kw)
    spec = (
        _engine(model, small, DRAFT, **kw) if which == "draft model" else _engine(model, None, LAYERS, **kw)
    )
    want = [_run(plain, [p], params)[0] for p in prompts]
    assert _run(spec, prompts, params) == want  # batched
    assert [_run(spec, [p], params)[0] for p in prompts] == want  # alone
    assert spec.stats["spec_draft_tokens"] > 100 and spec.drafter is not None
    assert spec.drafter.held == 0  # every draft block given back
    if kind == "preempting":
        assert spec.scheduler.preemptions > 0


@pytest.mark.parametrize("native", [False, True])
def test_a_copy_of_the_model_as_draft_has_every_proposal_kept(model: torch.nn.Module, native: bool) -> None:
    if native and not kernels.available():
        pytest.skip(f"the native attention kernel is not built here ({kernels.why_unavailable()})")
    prompts = _prompts([5, 33, 70, 12], seed=4)
    params = dataclasses.replace(GREEDY, max_tokens=30)
    kw = {"native_attention": native, "max_num_batched_tokens": 48}  # catch-up in several forwards
    plain = _engine(model, None, None, **kw)
    spec = _engine(model, model, DRAFT, **kw)
    assert _run(spec, prompts, params) == _run(plain, prompts, params)
    drafted, kept = spec.stats["spec_draft_tokens"], spec.stats["spec_accepted_tokens"]
    # natively every row's bits are its own; SDPA's one-row runs differ in the last bits (rare flips)
    assert kept == drafted if native else kept >= 0.95 * drafted, (kept, drafted)
    assert spec.stats["steps"] < plain.stats["steps"] / 3  # 5 tokens a forward, less the prompts' steps


def test_each_proposal_is_the_drafts_greedy_continuation(
    model: torch.nn.Module, small: torch.nn.Module
) -> None:
    """Every step's proposals equal the draft model's greedy tokens after the sequence's tokens, computed
    here without a cache — after rejections, chunked catch-up and preemption too (a draft cache that
    kept a rejected token's keys, or missed some, proposes something else)."""
    prompts = _repetitive(seed=6, count=4) + _prompts([30, 11], seed=9)
    engine = _engine(
        model, small, DRAFT, num_blocks=20, block_size=4, max_model_len=60, max_num_batched_tokens=20
    )
    seen: list[tuple[list[int], list[int]]] = []
    assert engine.drafter is not None
    propose = engine.drafter.propose

    def recorded(wanted: list) -> None:  # type: ignore[type-arg]
        propose(wanted)
        seen.extend((list(seq.tokens), list(seq.drafts)) for seq, _ in wanted if seq.drafts)

    engine.drafter.propose = recorded  # type: ignore[method-assign]
    _run(engine, prompts, dataclasses.replace(GREEDY, max_tokens=24))
    assert len(seen) > 40 and engine.scheduler.preemptions > 0
    assert engine.stats["spec_accepted_tokens"] < engine.stats["spec_draft_tokens"]  # rejections happened
    with torch.no_grad():
        for tokens, drafts in seen:
            ids = list(tokens)
            for _ in drafts:
                ids.append(int(small(torch.tensor([ids]))[0, -1].argmax()))
            assert drafts == ids[len(tokens) :]


def test_sampled_output_with_a_draft_follows_the_models_distribution(
    model: torch.nn.Module, small: torch.nn.Module
) -> None:
    """The second tokens of 1,536 samples (each a proposal of the draft, kept or replaced) follow the
    model's exact marginal at temperature 0.7."""
    prompt = _prompts([6], seed=21)[0]
    t = 0.7
    with torch.no_grad():
        first = torch.softmax(model(torch.tensor([prompt]))[0, -1].double() / t, -1)
        vocab = first.shape[0]
        second = torch.softmax(
            model(torch.tensor([prompt + [a] for a in range(vocab)]))[:, -1].double() / t, -1
        )
    marginal = (first[:, None] * second).sum(0)
    engine = _engine(model, small, DraftConfig(num_speculative_tokens=2, model="draft"), num_blocks=512)
    got = three_token_samples(engine, prompt, t)
    assert engine.stats["spec_draft_tokens"] >= 1536  # every sample's second token went through a proposal
    counts = torch.bincount(got[:, 1], minlength=vocab).double()
    assert _chi_square_p(counts, marginal) > 1e-3


def test_draft_settings_are_refused_in_one_line(model: torch.nn.Module) -> None:
    other = sharpened_pair(dataclasses.replace(CFG, vocab_size=97))[1]
    with pytest.raises(RequestError, match="share the served model's tokenizer"):
        _engine(model, other, DRAFT)
    with pytest.raises(ValueError, match="load it and pass draft="):
        _engine(model, None, DRAFT)
    with pytest.raises(ValueError, match="not a draft model's"):
        _engine(model, model, None)
    with pytest.raises(ValueError, match="give 1 to 1 of the model's 2 layers"):
        _engine(model, None, DraftConfig(draft_layers=2))
    for kw in (dict(tp=2), dict(max_loras=2)):
        with pytest.raises(EngineConfigError, match="first layers runs on one rank without adapters"):
            EngineConfig(speculative=LAYERS, **kw)  # type: ignore[arg-type]


def _tp_worker(model_dir: str, draft_dir: str) -> list[list[tuple[list[int], list[float]]]]:
    """One of 2 tensor-parallel ranks: the first runs the prompts without and with a draft model (whole,
    on the first rank only), the other follows both engines."""
    from zerotron.build.builder import load_model
    from zerotron.distributed.launch import current_rank_and_world
    from zerotron.distributed.mesh import Mesh, ParallelDims

    rank, world = current_rank_and_world()
    group = Mesh(ParallelDims(world, dp=1, tp=world), rank).group("tp")
    model, _ = load_model(model_dir, torch.float32, "cpu", Mesh(ParallelDims(world, dp=1, tp=world), rank))
    first = group.rank_in_group == 0
    draft = load_model(draft_dir, torch.float32, "cpu")[0] if first else None
    plain = Engine(model, None, EngineConfig(num_blocks=128), group)
    spec = Engine(model, None, EngineConfig(num_blocks=128, speculative=DRAFT), group, draft)
    if not first:
        plain.runner.follow()
        spec.runner.follow()
        return []
    runs = []
    for e in (plain, spec):
        runs.append(_run(e, _repetitive(seed=7, count=3), dataclasses.replace(GREEDY, max_tokens=12)))
        e.runner.publish(None, stop=True)
    assert spec.stats["spec_draft_tokens"] > 0
    return runs


def test_tensor_parallel_draft_speculation_equals_tensor_parallel_without(tmp_path: object) -> None:
    from zerotron.distributed.launch import spawn

    sharpened_pair(CFG)[0].save_pretrained(str(tmp_path / "model"))  # type: ignore[operator]
    torch.manual_seed(5)
    sharpened_pair(dataclasses.replace(CFG, num_hidden_layers=1))[0].save_pretrained(str(tmp_path / "draft"))  # type: ignore[operator]
    args = (str(tmp_path / "model"), str(tmp_path / "draft"))  # type: ignore[operator]
    plain, spec = spawn(_tp_worker, 2, args=args, timeout_s=600, backend="gloo", start_method="forkserver")[0]
    assert spec == plain


def test_serve_with_a_speculative_model_from_the_command_line(tmp_path: object) -> None:
    """``zerotron serve DIR --speculative-model DRAFT``: greedy completions equal a server without it,
    and /metrics counts the draft's proposals."""
    from tests.test_serve_http import _free_port

    sharpened_pair(CFG)[0].save_pretrained(str(tmp_path / "model"))  # type: ignore[operator]
    prompt = _repetitive(seed=2, count=1)[0]
    texts, metrics = [], ""
    for extra in ([], ["--speculative-model", str(tmp_path / "model")]):  # type: ignore[operator]
        port = _free_port()
        cmd = [sys.executable, "-m", "zerotron", "serve", str(tmp_path / "model"), "--port", str(port)]  # type: ignore[operator]
        proc = subprocess.Popen([*cmd, "--kv-cache-memory", "0.05", "--max-model-len", "256", *extra])
        try:
            base = f"http://127.0.0.1:{port}"
            for _ in range(240):
                try:
                    urllib.request.urlopen(f"{base}/v1/models", timeout=2)
                    break
                except OSError:
                    time.sleep(0.5)
            body = json.dumps(
                {"model": "model", "prompt": prompt, "max_tokens": 16, "temperature": 0}
            ).encode()
            req = urllib.request.Request(f"{base}/v1/completions", body, {"Content-Type": "application/json"})
            texts.append(json.loads(urllib.request.urlopen(req, timeout=60).read())["choices"][0]["text"])
            metrics = urllib.request.urlopen(f"{base}/metrics", timeout=10).read().decode()
        finally:
            proc.terminate()
            proc.wait(timeout=60)
    assert texts[0] == texts[1]
    drafted = next(
        float(x.split()[1])
        for x in metrics.splitlines()
        if x.startswith("zerotron_spec_decode_num_draft_tokens_total")
    )
    assert drafted > 0


def test_the_server_faults_in_the_drafts_pool_too(
    model: torch.nn.Module, monkeypatch: pytest.MonkeyPatch
) -> None:
    """settle_process (the server's start) hands heap.prefault the draft's KV pool beside the served
    model's: a draft writes its pool every step, and its first pages would otherwise be faulted in then."""
    from zerotron.serve import app, heap

    engine = _engine(model, None, LAYERS)
    assert engine.drafter is not None
    seen: list[torch.Tensor] = []
    monkeypatch.setattr(heap, "keep_freed", lambda: None)
    monkeypatch.setattr(heap, "settle_objects", lambda: None)
    monkeypatch.setattr(heap, "prefault", lambda tensors: seen.extend(tensors))
    app.settle_process(engine)
    ids = {t.data_ptr() for t in seen}
    assert {t.data_ptr() for t in engine.kv.tensors()} <= ids
    assert {t.data_ptr() for t in engine.drafter.kv.tensors()} <= ids
    assert len(ids) == len(engine.kv.tensors()) + len(engine.drafter.kv.tensors())
