"""Speculative decoding by n-gram lookup: lossless against the engine without speculation.

References: the same engine with speculation off (greedy tokens and log-probabilities, bit for bit,
alone and batched, with chunked prefill, preemption, prefix caching, parallel samples and adapters),
and for sampling the model's exact distribution (brute-force forwards of every continuation), by a
chi-square test that a leaky verifier (one that keeps every proposal) fails.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from tests.test_serve_engine import CFG, GREEDY, _prompts, _run, sharpened_pair
from zerotron.components.sampling import SamplingParams, draw, sample
from zerotron.serve import engine as engine_module
from zerotron.serve.engine import Engine, EngineConfig
from zerotron.serve.speculative import NgramConfig, SpeculativeError, parse_speculative_config, propose

SPEC = NgramConfig(num_speculative_tokens=4, prompt_lookup_max=3, prompt_lookup_min=1)


@pytest.fixture(scope="module")
def model() -> object:
    return sharpened_pair(CFG)[1]


def _repetitive(seed: int, count: int) -> list[list[int]]:
    """Prompts that repeat a random phrase (the shapes n-gram lookup is for), and one that does not."""
    g = torch.Generator().manual_seed(seed)
    prompts = []
    for i in range(count):
        phrase = torch.randint(0, CFG.vocab_size, (3 + i % 4,), generator=g).tolist()
        prompts.append((phrase * 4)[: 9 + 2 * i])
    return prompts + _prompts([13], seed=seed)


def test_propose_takes_what_followed_the_latest_longest_match() -> None:
    assert propose([1, 2, 3, 9, 1, 2, 3, 7, 5, 1, 2, 3], 3, 3, 1) == [7, 5, 1]  # the latest "1 2 3"
    assert propose([4, 5, 6, 4, 5], 5, 4, 1) == [6, 4, 5]
    assert propose([4, 5, 6, 7, 8, 5], 2, 3, 1) == [6, 7]  # only the 1-gram "5" matches
    assert propose([4, 5, 6, 7, 8, 5], 2, 3, 2) == []
    assert propose([1, 2, 3], 4, 3, 1) == []


KINDS = {
    "F.linear": {},
    "oneDNN, chunked prefill": {"onednn": True, "max_num_batched_tokens": 24},
    "preempting": {"num_blocks": 12, "block_size": 4, "max_model_len": 40},
    "no prefix cache": {"prefix_caching": False},
}


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_greedy_output_is_the_output_without_speculation(model: object, kind: str) -> None:
    kw = {"num_blocks": 128, **KINDS[kind]}
    prompts = _repetitive(seed=1, count=6)
    params = dataclasses.replace(GREEDY, max_tokens=20)
    plain = Engine(copy.deepcopy(model), None, EngineConfig(**kw))  # type: ignore[arg-type]
    spec = Engine(copy.deepcopy(model), None, EngineConfig(speculative=SPEC, **kw))  # type: ignore[arg-type]
    want = [_run(plain, [p], params)[0] for p in prompts]
    assert _run(spec, prompts, params) == want  # batched
    before = spec.stats["steps"]
    assert [_run(spec, [p], params)[0] for p in prompts] == want  # alone
    assert spec.stats["spec_accepted_tokens"] > 20  # proposals were kept: the test ran speculation
    assert spec.stats["steps"] - before < plain.stats["steps"]  # fewer forwards for the same tokens
    if kind == "preempting":
        assert spec.scheduler.preemptions > 0


def test_speculation_keeps_parallel_samples_stops_and_adapters(model: object, tmp_path: object) -> None:
    peft = pytest.importorskip("peft")
    from tests.test_llama import _reference

    ref = _reference(CFG)
    wrapped = peft.get_peft_model(
        ref, peft.LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False)
    )
    wrapped.save_pretrained(str(tmp_path))
    prompts = _repetitive(seed=4, count=3)
    kw = {"num_blocks": 128, "max_loras": 2}
    plain = Engine(copy.deepcopy(model), None, EngineConfig(**kw))  # type: ignore[arg-type]
    spec = Engine(copy.deepcopy(model), None, EngineConfig(speculative=SPEC, **kw))  # type: ignore[arg-type]
    for e in (plain, spec):
        e.load_lora("a", str(tmp_path))
    stop = SamplingParams(temperature=0.0, max_tokens=16, n=2, logprobs=0, stop_token_ids=[prompts[0][2]])
    for lora in (None, "a"):
        want = [plain.generate([p], stop, [lora])[0] for p in prompts]
        assert spec.generate(prompts, stop, [lora] * len(prompts)) == want
    assert spec.stats["spec_accepted_tokens"] > 0


def _chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """p-value of observed ``counts`` against ``probs`` (cells expected below 5 pooled)."""
    n = counts.sum()
    expected = probs * n
    big = expected >= 5
    obs = torch.cat([counts[big], counts[~big].sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    keep = exp > 0
    stat = ((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum()
    dof = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), stat.double() / 2))


def test_rejection_step_samples_the_target_distribution_and_a_leak_is_caught() -> None:
    """``sample`` with a draft, 20,000 times, for a likely and an unlikely draft: the tokens follow
    softmax(logits / T) (chi-square); a verifier that keeps the draft when it should not fails."""
    torch.manual_seed(0)
    logits = torch.randn(12) * 2
    params = SamplingParams(temperature=0.8, max_tokens=4)
    probs = torch.softmax(logits / 0.8, -1)
    g = torch.Generator().manual_seed(1)
    for draft in (int(probs.argmax()), int(probs.argmin())):
        tokens = torch.tensor([sample(logits, params, [], [], g, draft=draft).token for _ in range(20000)])
        counts = torch.bincount(tokens, minlength=12).double()
        assert _chi_square_p(counts, probs.double()) > 1e-3
    leaky = counts.clone()
    leaky[draft] += 400  # 2% of the tokens kept as the draft whatever the model says
    assert _chi_square_p(leaky, probs.double()) < 1e-6


def test_draw_follows_the_probabilities_and_never_draws_a_zero() -> None:
    """``draw`` (every sampled token's last step): 20,000 draws from a 200-entry distribution with
    zeros follow it (chi-square), never give an entry of probability 0, and a distribution that is NaN
    or all zeros is refused, as ``torch.multinomial`` refuses it."""
    g = torch.Generator().manual_seed(3)
    probs = torch.softmax(torch.randn(200, generator=g) * 3, -1)
    probs[::7] = 0.0
    counts = torch.bincount(torch.tensor([draw(probs, g) for _ in range(20000)]), minlength=200).double()
    assert counts[::7].sum() == 0
    assert _chi_square_p(counts, probs.double() / probs.sum()) > 1e-3
    shifted = torch.roll(counts, 1)  # a draw one entry off
    assert _chi_square_p(shifted, probs.double() / probs.sum()) < 1e-6
    for bad in (torch.tensor([float("nan"), 1.0]), torch.zeros(3)):
        with pytest.raises(ValueError, match="finite, one of them positive"):
            draw(bad, g)


def three_token_samples(engine: Engine, prompt: list[int], t: float) -> torch.Tensor:
    """(1536, 3): 24 requests of 64 samples of 3 tokens at temperature ``t`` (sample i: seed + i)."""
    got = []
    for seed in range(24):
        engine.add_request(
            f"s{seed}", prompt, SamplingParams(temperature=t, max_tokens=3, n=64, seed=1000 * seed)
        )
        outs: dict[int, list[int]] = {}
        while engine.has_unfinished():
            for out in engine.step():
                for o in out.outputs:
                    outs.setdefault(o.index, []).extend(o.token_ids)
        got += [outs[i] for i in range(64)]
    return torch.tensor(got)


def test_sampled_speculation_follows_the_models_distribution(
    model: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each decode step proposes the likeliest next token after the last one (often kept); the second
    and third tokens of 1,536 samples (the third the model's own token after a kept proposal, or a
    plain decode) follow the model's exact marginals, computed by running every continuation through
    the model without a cache; an engine that keeps every proposal fails."""
    prompt = _prompts([6], seed=21)[0]
    m = copy.deepcopy(model)
    t = 0.5
    with torch.no_grad():  # the exact distributions of t1, t2 | t1 and t3 | t1 t2 at temperature t
        first = torch.softmax(m(torch.tensor([prompt]))[0, -1].double() / t, -1)
        vocab = first.shape[0]
        pairs = torch.tensor([prompt + [a] for a in range(vocab)])
        second = torch.softmax(m(pairs)[:, -1].double() / t, -1)  # (t1, t2)
        joint12 = first[:, None] * second
        likely = second.argmax(-1).tolist()  # the likeliest t2 after each t1: the proposal
        triples = torch.tensor([prompt + [a, b] for a in range(vocab) for b in range(vocab)])
        third = (torch.cat([m(chunk)[:, -1] for chunk in triples.split(2048)]).double() / t).softmax(-1)
        marginal3 = (joint12.reshape(-1, 1) * third).sum(0)
    marginal2 = joint12.sum(0)
    monkeypatch.setattr(engine_module, "propose", lambda tokens, k, hi, lo: [likely[tokens[-1]]] * k)

    def samples(engine: Engine) -> torch.Tensor:
        return three_token_samples(engine, prompt, t)

    spec = Engine(copy.deepcopy(model), None, EngineConfig(num_blocks=512, speculative=SPEC))  # type: ignore[arg-type]
    tokens = samples(spec)
    assert spec.stats["spec_accepted_tokens"] > 300  # the proposals were exercised, often kept
    for column, marginal in ((1, marginal2), (2, marginal3)):
        counts = torch.bincount(tokens[:, column], minlength=vocab).double()
        assert _chi_square_p(counts, marginal) > 1e-3
    real = engine_module.sample

    def leaky(logits, params, prompt_ids, output_ids, generator, argmax=None, draft=None):  # type: ignore[no-untyped-def]
        choice = real(logits, params, prompt_ids, output_ids, generator, argmax, draft)
        if draft is not None:
            choice.token = draft
        return choice

    monkeypatch.setattr(engine_module, "sample", leaky)
    leaked = samples(Engine(copy.deepcopy(model), None, EngineConfig(num_blocks=512, speculative=SPEC)))  # type: ignore[arg-type]
    counts = torch.bincount(leaked[:, 1], minlength=vocab).double()
    assert _chi_square_p(counts, marginal2) < 1e-6


def test_speculative_config_is_checked_in_one_line() -> None:
    assert parse_speculative_config('{"method": "ngram", "num_speculative_tokens": 3}') == NgramConfig(3)
    for text, words in [
        ('{"method": "eagle"}', "EAGLE, Medusa and MTP heads are not"),
        ('{"method": "draft_model"}', '"model" .* or "draft_layers"'),
        ('{"method": "draft_model", "model": "x", "draft_layers": 2}', "not both"),
        ('{"method": "draft_model", "draft_layers": 0}', "at least 1 layer"),
        ('{"method": "draft_model", "model": 3}', "as a string"),
        ('{"method": "draft_model", "prompt_lookup_max": 3, "model": "x"}', "not a setting of draft_model"),
        ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens"),
        ('{"method": "ngram", "prompt_lookup_min": 5, "prompt_lookup_max": 2}', "prompt_lookup_min"),
        ('{"method": "ngram", "bogus": 1}', "bogus"),
        ("ngram", "not JSON"),
    ]:
        with pytest.raises(SpeculativeError, match=words):
            parse_speculative_config(text)


def _tp_worker(model_dir: str) -> list[list[tuple[list[int], list[float]]]]:
    """One of 2 tensor-parallel ranks: the first runs the prompts without and with speculation (the
    proposals travel in the plans), the other follows both engines."""
    from zerotron.build.builder import load_model
    from zerotron.distributed.launch import current_rank_and_world
    from zerotron.distributed.mesh import Mesh, ParallelDims

    rank, world = current_rank_and_world()
    mesh = Mesh(ParallelDims(world, dp=1, tp=world), rank)
    group = mesh.group("tp")
    model, _ = load_model(model_dir, torch.float32, "cpu", mesh)
    engines = [Engine(model, None, EngineConfig(num_blocks=128, speculative=s), group) for s in (None, SPEC)]
    if group.rank_in_group != 0:
        for e in engines:
            e.runner.follow()
        return []
    params = dataclasses.replace(GREEDY, max_tokens=16)
    runs = []
    for e in engines:
        runs.append(_run(e, _repetitive(seed=7, count=4), params))
        e.runner.publish(None, stop=True)
    assert engines[1].stats["spec_accepted_tokens"] > 0
    return runs


def test_tensor_parallel_speculation_equals_tensor_parallel_without(tmp_path: object) -> None:
    from zerotron.distributed.launch import spawn

    ref = sharpened_pair(CFG)[0]
    ref.save_pretrained(str(tmp_path))
    runs = spawn(
        _tp_worker, 2, args=(str(tmp_path),), timeout_s=600, backend="gloo", start_method="forkserver"
    )
    plain, spec = runs[0]
    assert spec == plain
