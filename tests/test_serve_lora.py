"""Multi-LoRA serving against peft: rows of three adapters and of the base model in one batch.

References: ``peft``'s forward of each adapter on the transformers model (logits, 2e-5 in fp32) and
its greedy ``generate``; the engine serving each request alone (batch invariance, exact); an adapter
merged into the weights by ``zerotron``'s merge (an independent path: no low-rank products at run
time). Every engine test ends with all KV blocks free.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path

import pytest
import torch

from tests.adapters import save_random_adapter
from tests.test_serve_engine import CFG, GREEDY, _prompts, sharpened_pair
from zerotron.components.sampling import SamplingParams
from zerotron.models.lora import LoraConfig, apply_lora, merge_adapter_tensors, save_adapter
from zerotron.serve import linear_kernels
from zerotron.serve.engine import Engine, EngineConfig, LoraError, UnknownModel
from zerotron.serve.linears import plain_linear
from zerotron.serve.lora import MultiLora

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

# name -> peft LoraConfig settings: all linears; two projections with rsLoRA; three others
ADAPTERS = {
    "alpha": dict(r=4, lora_alpha=8, target_modules="all-linear"),
    "beta": dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], use_rslora=True),
    "gamma": dict(r=2, lora_alpha=4, target_modules=["o_proj", "gate_proj", "down_proj"]),
}


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> tuple[torch.nn.Module, object, dict[str, Path]]:
    """The transformers model, zerotron's copy of it, and three peft adapters saved to disk (random A
    and B, scaled so that each changes the greedy tokens)."""
    ref, model = sharpened_pair(CFG)
    root = tmp_path_factory.mktemp("adapters")
    paths = {}
    for i, (name, kw) in enumerate(ADAPTERS.items()):
        torch.manual_seed(10 + i)
        wrapped = peft.get_peft_model(copy.deepcopy(ref), peft.LoraConfig(init_lora_weights=False, **kw))
        with torch.no_grad():
            for n, p in wrapped.named_parameters():
                if "lora_B" in n:
                    p.mul_(4.0)
        wrapped.save_pretrained(str(root / name))
        paths[name] = root / name
    return ref, model, paths


def _peft(ref: torch.nn.Module, path: Path) -> torch.nn.Module:
    return peft.PeftModel.from_pretrained(copy.deepcopy(ref), str(path)).eval()


def _engine(model: object, paths: dict[str, Path], **kw: object) -> Engine:
    # a multi-LoRA engine owns its model (it wraps the linears' forwards): give it a copy
    engine = Engine(copy.deepcopy(model), None, EngineConfig(**{"num_blocks": 128, "max_loras": 4, **kw}))  # type: ignore[arg-type]
    for name, path in paths.items():
        engine.load_lora(name, str(path))
    return engine


def _run(engine: Engine, prompts: list[list[int]], loras: list[str | None], params: SamplingParams) -> list:
    """Each prompt's tokens and log-probabilities under its adapter, all run together."""
    ids = [f"r{i}" for i in range(len(prompts))]
    for rid, prompt, lora in zip(ids, prompts, loras):
        engine.add_request(rid, prompt, params, lora)
    got: dict[str, tuple[list[int], list[float]]] = {rid: ([], []) for rid in ids}
    while engine.has_unfinished():
        for out in engine.step():
            for o in out.outputs:
                got[out.request_id][0].extend(o.token_ids)
                got[out.request_id][1].extend(c.logprob for c in o.choices)
    assert engine.pool.in_use == 0, "KV blocks leaked"
    return [got[rid] for rid in ids]


ENGINES = {
    "F.linear": {},
    "oneDNN": {"onednn": True},
    "fixed 32-row": {"fixed_rows": 32},
    "native": {"native_matmul": True},
}


@pytest.mark.parametrize("kind", sorted(ENGINES))
def test_mixed_batch_logits_equal_peft_for_each_adapter_and_the_base(served: tuple, kind: str) -> None:
    ref, model, paths = served
    if kind == "native" and linear_kernels.why_no_native_matmul(torch.float32) is not None:
        pytest.skip(
            f"zerotron's native fp32 linears need AVX-512 or AVX2: {linear_kernels.why_no_native_matmul(torch.float32)}"
        )
    engine = _engine(model, paths, **ENGINES[kind])
    captured: list[torch.Tensor] = []
    inner = engine.runner.run
    engine.runner.run = lambda plan: captured.append(inner(plan)) or captured[-1]  # type: ignore[method-assign]
    prompts = _prompts([5, 9, 3, 12, 7], seed=3)
    loras = ["alpha", None, "beta", "gamma", "alpha"]
    params = dataclasses.replace(GREEDY, max_tokens=1)
    _run(engine, prompts, loras, params)
    assert len(captured) == 1 and captured[0].shape[0] == len(prompts)  # one step: all five together
    models = {name: _peft(ref, path) for name, path in paths.items()}
    with torch.no_grad():
        base_logits = [ref(torch.tensor([p])).logits[0, -1] for p in prompts]
        for row, (prompt, lora) in enumerate(zip(prompts, loras)):
            want = (models[lora] if lora else ref)(torch.tensor([prompt])).logits[0, -1]
            # 2e-5: the slots' stacked fp32 products round differently from peft's per-adapter ones
            # (1.05e-5 measured on these sharpened weights, logits up to 3)
            torch.testing.assert_close(captured[0][row], want, rtol=0, atol=2e-5 if lora else 1e-5)
            if lora:  # the adapter matters: a test that served the base would fail
                assert (want - base_logits[row]).abs().max() > 0.1


def test_greedy_tokens_equal_peft_generate_and_do_not_depend_on_the_batch(served: tuple) -> None:
    ref, model, paths = served
    prompts = _prompts([6, 11, 4, 9, 14, 8, 5, 10], seed=5)
    loras = ["alpha", "beta", None, "gamma", "beta", "alpha", None, "gamma"]
    engine = _engine(model, paths)
    together = _run(engine, prompts, loras, GREEDY)
    alone = [_run(engine, [p], [lo], GREEDY)[0] for p, lo in zip(prompts, loras)]
    assert together == alone  # tokens and log-probabilities, bit for bit
    models = {name: _peft(ref, path) for name, path in paths.items()}
    outs = set()
    for prompt, lora, (tokens, _) in zip(prompts, loras, together):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            want = (models[lora] if lora else ref).generate(
                input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False
            )
        assert tokens == want[0, len(prompt) :].tolist()
        outs.add(tuple(tokens))
    assert len(outs) == len(prompts)


def test_an_adapter_gives_what_its_merged_weights_give(served: tuple, tmp_path: Path) -> None:
    """zerotron's own adapter format (``zerotron sft``'s save_adapter) served beside the base, against
    the base model with the adapter merged into its weights (no low-rank products at run time)."""
    _, model, _ = served
    save_random_adapter(copy.deepcopy(model), ["q_proj", "up_proj", "down_proj"], tmp_path / "sft", 3, 0.5)
    merged = copy.deepcopy(model)
    state = dict(merge_adapter_tensors(model.state_dict().items(), tmp_path / "sft"))
    merged.load_state_dict(state)
    engine = Engine(copy.deepcopy(model), None, EngineConfig(num_blocks=128, max_loras=1))
    engine.load_lora("sft", str(tmp_path / "sft"))
    prompts = _prompts([7, 13], seed=9)
    got = _run(engine, prompts, ["sft", None], GREEDY)
    want = _run(Engine(merged, None, EngineConfig(num_blocks=128)), prompts[:1], [None], GREEDY)
    assert got[0][0] == want[0][0]
    torch.testing.assert_close(torch.tensor(got[0][1]), torch.tensor(want[0][1]), rtol=0, atol=1e-4)
    assert got[1][0] != got[0][0] or prompts[0] != prompts[1]


def test_prefix_cache_is_never_shared_across_adapters_or_reloads(served: tuple) -> None:
    """The same prompt under the base, then an adapter, then the adapter reloaded from another
    directory: each equals a fresh engine without prefix caching (a block reused across adapters
    would change the logits); the same adapter twice hits the cache."""
    _, model, paths = served
    prompt = _prompts([40], seed=11)[0]
    engine = _engine(model, paths, block_size=8)
    fresh = _engine(model, paths, block_size=8, prefix_caching=False)
    for lora in (None, "alpha", "beta"):
        assert _run(engine, [prompt], [lora], GREEDY) == _run(fresh, [prompt], [lora], GREEDY)
    hits = engine.pool.hits
    _run(engine, [prompt], ["alpha"], GREEDY)
    assert engine.pool.hits > hits  # the same adapter reuses its own blocks
    engine.unload_lora("alpha")
    engine.load_lora("alpha", str(paths["gamma"]))  # the name again, other weights
    assert _run(engine, [prompt], ["alpha"], GREEDY) == _run(fresh, [prompt], ["gamma"], GREEDY)


def test_parallel_samples_and_preemption_keep_their_adapter(served: tuple) -> None:
    _, model, paths = served
    engine = _engine(model, paths, num_blocks=12, block_size=4, max_model_len=36)  # preempts
    prompts = _prompts([9, 10, 11, 12], seed=2)
    loras = ["alpha", "gamma", None, "beta"]
    tight = _run(engine, prompts, loras, GREEDY)
    assert engine.scheduler.preemptions > 0
    roomy = _engine(model, paths)
    assert tight == [_run(roomy, [p], [lo], GREEDY)[0] for p, lo in zip(prompts, loras)]
    params = SamplingParams(temperature=0.0, max_tokens=6, n=3)
    engine.add_request("n3", prompts[0], params, "gamma")
    samples: dict[int, list[int]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            for o in out.outputs:
                samples.setdefault(o.index, []).extend(o.token_ids)
    alone = _run(roomy, [prompts[0]], ["gamma"], dataclasses.replace(GREEDY, max_tokens=6))[0][0]
    assert samples == {0: alone, 1: alone, 2: alone}


@pytest.mark.parametrize("native", [False, True])
def test_bf16_mixed_batch_is_batch_invariant(served: tuple, native: bool) -> None:
    """Each row's tokens alone as in the batch, on chunked F.linear and on the native bf16 kernel (its
    slots packed for it)."""
    _, model, paths = served
    if native and linear_kernels.why_no_native_matmul(torch.bfloat16) is not None:
        pytest.skip(f"no native bf16 linears here: {linear_kernels.why_no_native_matmul(torch.bfloat16)}")
    bf16 = copy.deepcopy(model).to(torch.bfloat16)
    engine = _engine(bf16, paths, native_matmul=native)
    assert (engine.runner.lora is not None and engine.runner.lora.native is not None) == native
    prompts = _prompts([6, 40, 4, 9], seed=8)
    loras = ["alpha", "beta", None, "gamma"]
    together = _run(engine, prompts, loras, GREEDY)
    assert together == [_run(engine, [p], [lo], GREEDY)[0] for p, lo in zip(prompts, loras)]


def test_refusals_name_the_adapter_and_what_to_change(served: tuple, tmp_path: Path) -> None:
    ref, model, paths = served
    engine = _engine(model, {}, max_loras=2)
    with pytest.raises(UnknownModel, match="The model `alpha` does not exist"):
        engine.add_request("x", [1, 2, 3], GREEDY, "alpha")
    engine.load_lora("alpha", str(paths["alpha"]))
    with pytest.raises(LoraError, match="already served"):
        engine.load_lora("alpha", str(paths["beta"]))
    engine.load_lora("beta", str(paths["beta"]))
    with pytest.raises(LoraError, match="--max-loras"):
        engine.load_lora("gamma", str(paths["gamma"]))
    with pytest.raises(UnknownModel):
        engine.unload_lora("gamma")
    with pytest.raises(LoraError, match="adapter_config.json"):
        engine.load_lora("nowhere", str(tmp_path / "missing"))
    engine.unload_lora("beta")
    # an adapter of another model's shapes, a DoRA adapter and one adapting the head are refused
    other = dataclasses.replace(CFG, intermediate_size=64)
    wrong = peft.get_peft_model(
        _reference_of(other), peft.LoraConfig(r=2, target_modules=["down_proj"], init_lora_weights=False)
    )
    wrong.save_pretrained(str(tmp_path / "wrong"))
    with pytest.raises(LoraError, match="trained on this model"):
        engine.load_lora("wrong", str(tmp_path / "wrong"))
    dora = peft.get_peft_model(
        copy.deepcopy(ref), peft.LoraConfig(r=2, target_modules=["q_proj"], use_dora=True)
    )
    dora.save_pretrained(str(tmp_path / "dora"))
    with pytest.raises(LoraError, match="DoRA"):
        engine.load_lora("dora", str(tmp_path / "dora"))
    head = peft.get_peft_model(copy.deepcopy(ref), peft.LoraConfig(r=2, target_modules=["lm_head"]))
    head.save_pretrained(str(tmp_path / "head"))
    with pytest.raises(LoraError, match="head"):
        engine.load_lora("head", str(tmp_path / "head"))
    no_lora = Engine(model, None, EngineConfig(num_blocks=64))
    with pytest.raises(LoraError, match="max_loras"):
        no_lora.load_lora("alpha", str(paths["alpha"]))
    assert EngineConfig(max_loras=2, tp=2).max_loras == 2  # tensor-parallel adapters are built


def test_a_slot_is_reused_only_when_its_requests_have_finished(served: tuple) -> None:
    """Unloading an adapter stops new requests at once; its running request finishes with its own
    weights, and a new adapter takes the slot only after it has."""
    _, model, paths = served
    engine = _engine(model, {}, max_loras=1)
    engine.load_lora("alpha", str(paths["alpha"]))
    prompt = _prompts([9], seed=4)[0]
    want = _run(_engine(model, paths), [prompt], ["alpha"], GREEDY)[0]
    engine.add_request("r", prompt, GREEDY, "alpha")
    got: tuple[list[int], list[float]] = ([], [])
    for out in engine.step():
        got[0].extend(out.outputs[0].token_ids)
        got[1].extend(c.logprob for c in out.outputs[0].choices)
    engine.unload_lora("alpha")
    with pytest.raises(UnknownModel):
        engine.add_request("late", prompt, GREEDY, "alpha")
    with pytest.raises(LoraError, match="still running"):
        engine.load_lora("beta", str(paths["beta"]))
    while engine.has_unfinished():
        for out in engine.step():
            got[0].extend(out.outputs[0].token_ids)
            got[1].extend(c.logprob for c in out.outputs[0].choices)
    assert got == want
    engine.load_lora("beta", str(paths["beta"]))  # the slot is free now
    fresh = _engine(model, paths)
    assert _run(engine, [prompt], ["beta"], GREEDY) == _run(fresh, [prompt], ["beta"], GREEDY)


def test_an_adapter_above_the_slot_rank_is_refused(served: tuple) -> None:
    _, model, paths = served
    engine = _engine(model, {}, max_lora_rank=4)
    engine.load_lora("alpha", str(paths["alpha"]))  # rank 4
    with pytest.raises(LoraError, match="--max-lora-rank 8"):
        engine.load_lora("beta", str(paths["beta"]))  # rank 8


def _quantized_reference(ref: torch.nn.Module, method: str) -> torch.nn.Module:
    """transformers' model with each decoder linear's weight replaced by its int8 or int4 values
    dequantised in PyTorch (the arithmetic of :mod:`zerotron.models.quant`, applied here to the
    transformers module): the base a quantised engine serves, for peft to adapt."""
    from zerotron.models.quant import dequantize_groups, int4_group, quantize_groups, quantize_rows

    out = copy.deepcopy(ref)
    with torch.no_grad():
        for name, linear in out.named_modules():
            if type(linear) is torch.nn.Linear and name.startswith("model.layers."):
                w = linear.weight.detach()
                if method == "int8":
                    q, scale = quantize_rows(w)
                    linear.weight.copy_(q.float() * scale[:, None])
                else:
                    group = int4_group(linear.in_features)
                    linear.weight.copy_(dequantize_groups(*quantize_groups(w, group), group))
    return out


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_adapters_over_quantized_weights_equal_peft_over_the_dequantized_base(
    served: tuple, method: str
) -> None:
    """--quantization int8/int4 with adapters: each row's logits are peft's forward of its adapter on the
    dequantised base; rows without adapter are the quantised engine's own bits; batch-invariant."""
    ref, model, paths = served
    engine = _engine(model, paths, quantization=method)
    assert engine.runner.quantized is not None and len(engine.lora.modules) == 7 * CFG.num_hidden_layers
    captured: list[torch.Tensor] = []
    inner = engine.runner.run
    engine.runner.run = lambda plan: captured.append(inner(plan)) or captured[-1]  # type: ignore[method-assign]
    prompts = _prompts([5, 9, 3, 12, 7], seed=3)
    loras = ["alpha", None, "beta", "gamma", "alpha"]
    _run(engine, prompts, loras, dataclasses.replace(GREEDY, max_tokens=1))
    base = _quantized_reference(ref, method)
    plain = Engine(copy.deepcopy(model), None, EngineConfig(num_blocks=64, quantization=method))  # type: ignore[arg-type]
    plain_out: list[torch.Tensor] = []
    plain_inner = plain.runner.run
    plain.runner.run = lambda plan: plain_out.append(plain_inner(plan)) or plain_out[-1]  # type: ignore[method-assign]
    _run(plain, [prompts[1]], [None], dataclasses.replace(GREEDY, max_tokens=1))
    assert torch.equal(captured[0][1], plain_out[0][0])  # the base row: the quantised engine's bits
    with torch.no_grad():
        for row, (prompt, lora) in enumerate(zip(prompts, loras)):
            if lora is None:
                continue
            want = _peft(base, paths[lora])(torch.tensor([prompt])).logits[0, -1]
            # the int8/int4 kernels against F.linear on the dequantised weights, and the stacked slots
            # against peft's products: 1.1e-5 measured on these sharpened weights (logits up to 3)
            torch.testing.assert_close(captured[0][row], want, rtol=0, atol=3e-5)
            unquantized = _peft(ref, paths[lora])(torch.tensor([prompt])).logits[0, -1]
            assert (unquantized - want).abs().max() > 1e-3  # the quantised base matters
    together = _run(engine, prompts, loras, dataclasses.replace(GREEDY, max_tokens=8))
    alone = [
        _run(engine, [p], [lo], dataclasses.replace(GREEDY, max_tokens=8))[0] for p, lo in zip(prompts, loras)
    ]
    assert together == alone


def _reference_of(cfg: object) -> torch.nn.Module:
    from tests.test_llama import _reference

    return _reference(cfg)  # type: ignore[arg-type]


def test_multilora_records_the_adaptable_linears_only(served: tuple) -> None:
    _, model, _ = served
    lora = MultiLora(model, 2, 16, plain_linear)
    assert "lm_head" not in lora.modules and all(n.startswith("layers.") for n in lora.modules)
    assert len(lora.modules) == 7 * CFG.num_hidden_layers


# ---- over HTTP: the OpenAI API and vLLM's adapter endpoints --------------------------------------


def _tiny_adapters(tmp: Path) -> tuple[object, dict[str, Path]]:
    """test_serve_edge's byte-level model and two zerotron adapters for it (``zerotron sft``'s format)."""
    from tests.test_serve_edge import _model

    paths = {}
    for seed, targets in ((1, "all-linear"), (2, ["k_proj", "up_proj"])):
        trained = _model()
        cfg = LoraConfig(rank=4, alpha=8.0, target_modules=targets)  # type: ignore[arg-type]
        apply_lora(trained, cfg)
        torch.manual_seed(seed)
        with torch.no_grad():
            for n, p in trained.named_parameters():
                if "lora_B" in n:
                    p.normal_(0, 0.5)
        paths[f"a{seed}"] = save_adapter(trained, cfg, tmp / f"a{seed}")
    return _model(), paths


def _offline(
    model: object, paths: dict[str, Path], prompt: list[int], lora: str | None, n: int, **kw: object
) -> list[int]:
    engine = _engine(model, paths, max_loras=2, num_blocks=64, **kw)
    return engine.generate([prompt], dataclasses.replace(GREEDY, max_tokens=n), [lora])[0]


def test_http_requests_pick_adapters_and_adapters_load_and_unload(tmp_path: Path) -> None:
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    from tests.test_serve_edge import NAME, _Served
    from zerotron.serve.edge import ServerOptions

    model, paths = _tiny_adapters(tmp_path)
    s = _Served(ServerOptions(name=NAME, runtime_lora=True), EngineConfig(num_blocks=64, max_loras=2))
    try:
        prompt = [104, 105, 33, 32, 119]

        def complete(name: str) -> tuple[int, object]:
            body = {"model": name, "prompt": prompt, "max_tokens": 8, "temperature": 0}
            status, _, reply = s.request("POST", "/v1/completions", body)
            return status, reply

        status, _, listed = s.request("GET", "/v1/models")
        assert [m["id"] for m in listed["data"]] == [NAME]
        status, reply = complete("a1")
        assert status == 404 and reply["error"]["type"] == "NotFoundError"
        assert reply["error"]["message"] == "The model `a1` does not exist." and reply["error"]["code"] == 404
        for name in ("a1", "a2"):
            status, _, text = s.request(
                "POST", "/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(paths[name])}
            )
            assert status == 200 and name in text
        listed = s.request("GET", "/v1/models")[2]
        assert [(m["id"], m["parent"]) for m in listed["data"]] == [(NAME, None), ("a1", NAME), ("a2", NAME)]
        refusals = [
            ({"lora_name": "a1", "lora_path": str(paths["a2"])}, "already served"),
            ({"lora_name": NAME, "lora_path": str(paths["a2"])}, "already served"),
            ({"lora_name": "a3", "lora_path": str(paths["a2"])}, "--max-loras"),
            ({"lora_name": "a3"}, "lora_path"),
        ]
        for body, words in refusals:
            status, _, reply = s.request("POST", "/v1/load_lora_adapter", body)
            assert status == 400 and words in reply["error"]["message"], reply
        tokenizer = s.engine.tokenizer
        for name in (NAME, "a1", "a2"):
            status, reply = complete(name)
            assert status == 200 and reply["model"] == name
            want = _offline(model, paths, prompt, None if name == NAME else name, 8)
            assert reply["choices"][0]["text"] == tokenizer.decode(want, skip_special_tokens=True)
        assert len({complete(n)[1]["choices"][0]["text"] for n in (NAME, "a1", "a2")}) == 3
        metrics = s.request("GET", "/metrics")[2]
        assert "zerotron_lora_adapters_loaded 2" in metrics
        status, _, text = s.request("POST", "/v1/unload_lora_adapter", {"lora_name": "a1"})
        assert status == 200
        assert complete("a1")[0] == 404 and complete("a2")[0] == 200
        status, _, reply = s.request("POST", "/v1/unload_lora_adapter", {"lora_name": "a1"})
        assert status == 404 and reply["error"]["type"] == "NotFoundError"
        s.idle()
    finally:
        s.close()
    closed = _Served(ServerOptions(name=NAME), EngineConfig(num_blocks=64, max_loras=2))
    try:  # without --allow-runtime-lora-updating the server reads no files on request
        body = {"lora_name": "a1", "lora_path": str(paths["a1"])}
        assert closed.request("POST", "/v1/load_lora_adapter", body)[0] == 404
    finally:
        closed.close()


SPECULATE = ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}']


@pytest.mark.parametrize(("quantization", "nproc"), [(None, 1), ("int8", 1), (None, 2), ("int8", 2)])
def test_zerotron_serve_lora_modules_from_the_command_line(
    tmp_path: Path, quantization: str | None, nproc: int
) -> None:
    """``zerotron serve HF_DIR --lora-modules a1=... a2=... --speculative-config ...`` in its own
    process (over int8 weights, on 2 tensor-parallel ranks, and both): each adapter's greedy tokens equal
    the offline one-rank engine's without speculation, and differ between the adapters."""
    pytest.importorskip("fastapi")
    import socket
    import subprocess
    import sys
    import time

    from tests.test_serve_http import _get, _post
    from zerotron.models.hf import write_hf_directory

    model, paths = _tiny_adapters(tmp_path)
    write_hf_directory(model, tmp_path / "hf")  # type: ignore[arg-type]
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = int(sock.getsockname()[1])
    modules = [f"{n}={p}" for n, p in paths.items()]
    cmd = [sys.executable, "-m", "zerotron", "serve", str(tmp_path / "hf"), "--port", str(port)]
    log = (tmp_path / "serve.log").open("w")
    proc = subprocess.Popen(
        [
            *cmd,
            "--served-model-name",
            "tiny",
            "--lora-modules",
            *modules,
            "--kv-cache-memory",
            "0.05",
            *SPECULATE,
            *(["--quantization", quantization] if quantization else []),
            *(["--nproc", str(nproc)] if nproc > 1 else []),
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    base = f"http://127.0.0.1:{port}"
    outputs = set()
    try:
        deadline = time.time() + 120
        while time.time() < deadline:
            try:
                if _get(f"{base}/health")[0] == 200:
                    break
            except OSError:
                time.sleep(0.3)
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()
        assert "2 of at most 4 LoRA adapters" in (tmp_path / "serve.log").read_text()
        prompt = [104, 105, 33, 32, 104, 105, 33, 32, 104, 105]  # repetitive: n-gram proposals
        for name in ("tiny", "a1", "a2"):
            body = {"model": name, "prompt": prompt, "max_tokens": 6, "temperature": 0, "logprobs": 0}
            status, reply = _post(f"{base}/v1/completions", json.dumps(body).encode())
            assert status == 200, reply
            want = _offline(
                model, paths, prompt, None if name == "tiny" else name, 6, quantization=quantization
            )
            got = reply["choices"][0]["logprobs"]["tokens"]  # type: ignore[index]
            assert got == [str(t) for t in want]  # no tokenizer in the directory: token ids
            outputs.add(tuple(got))
        assert len(outputs) == 3
        metrics = _get(f"{base}/metrics")[1]
        assert "zerotron_spec_decode_num_draft_tokens_total" in metrics
    finally:
        proc.terminate()
        proc.wait(timeout=30)
