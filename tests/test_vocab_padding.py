"""Vocabulary padding (``model.pad_vocab_to_multiple_of``): tensor parallelism splits any vocabulary.

The tiny preset's vocabulary (259 tokens) does not divide by 2; under tp it is padded to
``padded_vocab(tp)`` rows. The reference is the independent, unpadded single-process loop of
``tests/test_train_dp.py`` (torch's AdamW, ``F.cross_entropy`` over 259 logits): the padded layouts give
its losses and weights (fp32, 1e-5), the padded rows stay zero and get no probability, the parameter
count leaves them out, and neither the checkpoint nor an export holds them — so a padded run resumes
unpadded and the other way round.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tests.harness import run_distributed
from tests.test_train_3d import _body as _train
from tests.test_train_dp import BASE, _reference, _tokens
from zerotron.build.convert import convert
from zerotron.build.source import resolve_model
from zerotron.checkpoint import store
from zerotron.components.state import read_model_tensors
from zerotron.config_check import validate
from zerotron.config_load import load_config
from zerotron.distributed.launch import current_rank_and_world
from zerotron.distributed.mesh import Mesh, ParallelDims
from zerotron.models.llama import LlamaForCausalLM
from zerotron.models.loading import load_pretrained
from zerotron.train.trainer import Trainer

STEPS = 3
VOCAB = 259  # the tiny preset's (byte-level) vocabulary
PADDED = [*BASE, f"model.vocab_size={VOCAB}", "train.grad_clip=0.3", "train.micro_batch=2"]


def _close(got: torch.Tensor, want: torch.Tensor, name: str) -> None:
    assert got.shape == want.shape, name
    rel = ((got - want).norm() / want.norm()).item()
    assert rel <= 1e-5, (name, rel)


def _check(results: list[dict], rows: int, ref_losses: list[float], ref: dict[str, torch.Tensor]) -> None:
    for r in results:
        np.testing.assert_allclose(r["losses"], ref_losses, rtol=1e-5)
        assert r["n_params"] == sum(w.numel() for w in ref.values())  # padding is not counted
        for name, w in r["weights"].items():
            want = ref[name if name in ref else "embed_tokens.weight"]  # a pipeline's tied head copy
            if name.endswith(("embed_tokens.weight", "lm_head.weight")):
                assert w.shape[0] == rows  # the split model really is padded
                assert not w[VOCAB:].any(), name  # padded rows stay zero through training
                w = w[:VOCAB]
            _close(w, want, name)


@pytest.mark.parametrize(
    ("world", "layout", "rows"),
    [
        (2, ["parallel.tp=2"], 260),
        (2, ["parallel.tp=2", "parallel.sequence_parallel=true"], 260),
        (4, ["parallel.tp=2", "parallel.dp=2", "parallel.zero=3"], 260),
        (4, ["parallel.tp=2", "parallel.dp=2", "parallel.zero=1", "model.pad_vocab_to_multiple_of=64"], 384),
        (4, ["parallel.tp=2", "parallel.pp=2", "model.pad_vocab_to_multiple_of=64"], 384),
        (2, ["parallel.tp=2", "model.tie_word_embeddings=false", "model.pad_vocab_to_multiple_of=64"], 384),
    ],
    ids=lambda x: "+".join(v.split(".")[1] for v in x) if isinstance(x, list) else str(x),
)
def test_padded_layouts_equal_the_unpadded_single_process(
    world: int, layout: list[str], rows: int, tmp_path: Path
) -> None:
    overrides = [*PADDED, *layout]
    validate(load_config(None, overrides), world)  # tp=2 no longer refused for a vocabulary of 259
    tokens = _tokens()
    ref_losses, ref = _reference(overrides, tokens, steps=STEPS)
    assert ref["embed_tokens.weight"].shape[0] == VOCAB  # the reference is not padded
    results = run_distributed(_train, world, overrides, tokens, str(tmp_path), STEPS, None, timeout=300)
    _check(results, rows, ref_losses, ref)
    ckpt = store.find_latest(tmp_path / "checkpoints")
    saved = read_model_tensors(ckpt)  # assembled from the ranks' pieces: no padding saved
    assert set(saved) == {n for n in ref if n != "lm_head.weight" or n in saved}
    for name, w in saved.items():
        _close(w, ref[name], name)
    moments = read_model_tensors(ckpt, "optimizer")
    assert moments["embed_tokens.weight.exp_avg"].shape == (VOCAB, 64)


def test_padded_checkpoint_resumes_unpadded_and_back(tmp_path: Path) -> None:
    """tp 2 (padded to 384 rows) -> one process (unpadded) -> tp 2 (260 rows): the 3+1+1 steps are the
    reference's 5, optimizer moments included."""
    tokens = _tokens()
    ref_losses, ref = _reference(PADDED, tokens, steps=STEPS + 2)
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    first = run_distributed(
        _train,
        2,
        [*PADDED, "parallel.tp=2", "model.pad_vocab_to_multiple_of=64"],
        tokens,
        str(a),
        STEPS,
        None,
    )
    latest = lambda run: str(store.find_latest(run / "checkpoints"))  # noqa: E731
    second = run_distributed(_train, 1, PADDED, tokens, str(b), 1, latest(a))
    third = run_distributed(_train, 2, [*PADDED, "parallel.tp=2"], tokens, str(c), 1, latest(b))
    losses = first[0]["losses"] + second[0]["losses"] + third[0]["losses"]
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    _check(third, 260, ref_losses[-1:], ref)


def test_padded_logits_get_no_probability_and_no_gradient() -> None:
    cfg = load_config(None, [*PADDED, "model.tie_word_embeddings=false"]).model
    plain = LlamaForCausalLM(cfg)
    plain.init_weights(5)
    padded = LlamaForCausalLM(cfg, vocab_rows=300)
    padded.init_weights(5)  # the same real rows, zeros past them
    assert not padded.lm_head.weight[VOCAB:].any()
    torch.testing.assert_close(padded.lm_head.weight[:VOCAB], plain.lm_head.weight, rtol=0, atol=0)
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))
    logits = padded(ids)
    assert logits.shape[-1] == 300 and bool(torch.isneginf(logits[..., VOCAB:]).all())
    assert logits.softmax(-1)[..., VOCAB:].sum().item() == 0.0
    loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    ref = F.cross_entropy(plain(ids)[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    torch.testing.assert_close(loss, ref, rtol=1e-6, atol=0)
    loss.backward()
    assert not padded.lm_head.weight.grad[VOCAB:].any()
    assert not padded.embed_tokens.weight.grad[VOCAB:].any()


def test_padded_run_exports_the_real_vocabulary(tmp_path: Path) -> None:
    tokens = _tokens()
    overrides = [*PADDED, "parallel.tp=2", "model.pad_vocab_to_multiple_of=64"]
    run_distributed(_train, 2, overrides, tokens, str(tmp_path / "run"), 1, None)
    out = tmp_path / "hf"
    convert(tmp_path / "run", out)
    model, _ = load_pretrained(out)
    assert model.embed_tokens.weight.shape == (VOCAB, 64)
    assert model.config.vocab_size == VOCAB


def _smollm2_steps(overrides: list[str], tokens: np.ndarray, run_dir: str) -> dict:

    cfg = resolve_model(load_config(None, overrides))
    rank, world = current_rank_and_world()
    mesh = Mesh(ParallelDims.from_config(cfg.parallel, world), rank)
    trainer = Trainer(cfg, mesh, Path(run_dir), tokens)
    rows = [p.shape[0] for n, p in trainer.model.named_parameters() if n == "embed_tokens.weight"]
    history = [trainer.train_step() for _ in range(2)]
    return {"losses": [r["loss"] for r in history], "n_params": history[0]["n_params"], "rows": rows}


@pytest.mark.smollm2
def test_smollm2_tp3_padded_equals_the_unpadded_single_process(tmp_path: Path) -> None:
    """SmolLM2 (49,152 tokens) read from its GGUF file under tp 3 with the vocabulary padded to a
    multiple of 300 (49,200 rows): its first loss is transformers' on the same tokens, and two AdamW
    steps give the single unpadded process's losses."""
    from tests.test_smollm2 import GGUF_NAME, _smollm2_dir

    transformers = pytest.importorskip("transformers")
    gguf = _smollm2_dir() / GGUF_NAME
    seq = 16
    # Two windows (tokens [0, 17) and [16, 33)): every step's batch is both, in some order.
    tokens = np.random.default_rng(3).integers(0, 49152, size=2 * seq + 1).astype(np.uint32)
    common = [f"model.path={gguf}", f"train.seq_len={seq}", "train.global_batch=2", "train.micro_batch=1"]
    common += ["train.lr=1e-4", "train.warmup_steps=0", "train.schedule=constant", "log.progress=none"]
    padded = [*common, "parallel.tp=3", "model.pad_vocab_to_multiple_of=100"]
    tp3 = run_distributed(_smollm2_steps, 3, padded, tokens, str(tmp_path / "tp3"), timeout=600)
    (single,) = run_distributed(_smollm2_steps, 1, common, tokens, str(tmp_path / "one"), timeout=600)
    assert single["rows"] == [49152] and tp3[0]["rows"] == [49200 // 3]
    for r in tp3:
        np.testing.assert_allclose(r["losses"], single["losses"], rtol=1e-5)
        assert r["n_params"] == single["n_params"]
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
    )
    windows = torch.from_numpy(tokens.astype(np.int64))
    batch = torch.stack([windows[: seq + 1], windows[seq:]])  # (2, seq + 1)
    with torch.no_grad():
        logits = reference(batch[:, :-1]).logits
    expected = F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten()).item()
    np.testing.assert_allclose(single["losses"][0], expected, rtol=1e-4)
