"""GGUF files quantised by llama.cpp's own quantiser, and llama.cpp's logits on them.

Needs llama-cpp-python (llama.cpp's C library and its Python binding, built from source by pip:
minutes on a small machine), which zerotron itself does not need, installed beside zerotron for
``tiny`` and ``quantize`` (``compare`` can take it from another Python: ``--llama-python``); run it
once to (re)make the test data, or for the benchmark beside llama.cpp:

    pip install llama-cpp-python
    python benchmarks/llamacpp_gguf.py tiny tests/data/llamacpp
    python benchmarks/llamacpp_gguf.py quantize SMOL_F32.gguf OUTDIR --types Q2_K,Q3_K_M,Q4_K_M,Q5_K_M,Q6_K
    python benchmarks/llamacpp_gguf.py compare OUTDIR/*.gguf --llama-python VENV/bin/python --json results.json
    python benchmarks/llamacpp_gguf.py large SMOL.gguf BIG-F16.gguf   # then quantize it as above

``tiny`` writes two small random Llama models in f32 with the ``gguf`` package (one with 256 inputs
to every matrix, so the K types apply throughout; one with 96, where llama.cpp falls back to Q5_0,
Q5_1, IQ4_NL and Q8_0), quantises each with ``llama_model_quantize`` to the file types listed in
TINY_TYPES, and evaluates llama.cpp on one token sequence over every file (the f32 ones too), saving
its logits as ``logits.npz`` (no pickle) beside the ``.gguf`` files it keeps (not the f32 sources).
``large`` writes a random model of a larger shape (SmolLM2-1.7B's by default) in f16 with another
file's tokenizer and settings, for speed beside llama.cpp where no larger model is at hand (its
perplexity means nothing). ``quantize`` makes real model files from an f32 GGUF (llama.cpp's ``convert_hf_to_gguf.py
--outtype f32``). ``compare`` runs each file in zerotron (``--quantization gguf``: its blocks kept, on
the native kernels, as ``zerotron serve`` runs it) and in llama.cpp, each in a process of its own, two
threads each: perplexity on a held text (the same token ids), the tokens per second of one greedy
sequence decoding 64 tokens (the median of three), zerotron's resident weight bytes beside the
file's tensor bytes and llama.cpp's model size.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import gguf
import numpy as np

# name -> (hidden, heads, kv heads, ffn, vocab): every matrix's inputs a multiple of 256, or of 32 only
TINY_MODELS = {"k256": (256, 4, 2, 256, 272), "k96": (96, 3, 1, 256, 272)}
TINY_TYPES = {
    "k256": ("Q2_K", "Q3_K_M", "Q4_K_M", "Q5_K_M", "Q6_K", "IQ3_S"),
    "k96": ("Q2_K", "Q4_K_M", "Q5_K_M", "Q6_K", "IQ4_XS"),
}
TOKENS = [
    257,
    3,
    70,
    71,
    100,
    101,
    5,
    200,
    9,
    33,
    33,
    33,
    120,
    64,
    1,
    250,
    44,
    45,
    46,
    47,
]  # the evaluated ids


def write_tiny(path: Path, hidden: int, heads: int, kv: int, ffn: int, vocab: int, seed: int = 0) -> None:
    """A one-layer random Llama in f32 with a byte-level BPE vocabulary (256 bytes, a few merges, two
    control tokens) and an output head of its own."""
    rng = np.random.default_rng(seed)
    head_dim = hidden // heads
    w = gguf.GGUFWriter(str(path), arch="llama")
    w.add_name("zerotron tiny llama")
    w.add_block_count(1)
    w.add_context_length(256)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(head_dim)
    w.add_vocab_size(vocab)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    from zerotron.models.tokenizer import _bytes_to_unicode  # here: `_one llamacpp` runs without zerotron

    spelling = _bytes_to_unicode()  # GPT-2's byte-to-character table, as zerotron's tokenizer reads it
    alphabet = [spelling[b] for b in range(256)]
    merges = [f"{alphabet[a]} {alphabet[b]}" for a, b in zip(range(65, 91), range(97, 123))][: vocab - 258]
    tokens = alphabet + [m.replace(" ", "") for m in merges] + ["<|bos|>", "<|eos|>"]
    assert len(tokens) == vocab, (len(tokens), vocab)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([1] * (vocab - 2) + [3, 3])
    w.add_token_merges(merges)
    w.add_bos_token_id(vocab - 2)
    w.add_eos_token_id(vocab - 1)
    w.add_add_bos_token(False)

    def matrix(out: int, inputs: int) -> np.ndarray:
        return (rng.standard_normal((out, inputs)) * inputs**-0.5).astype(np.float32)

    w.add_tensor("token_embd.weight", (rng.standard_normal((vocab, hidden)) * 0.5).astype(np.float32))
    w.add_tensor("blk.0.attn_norm.weight", (1 + 0.1 * rng.standard_normal(hidden)).astype(np.float32))
    w.add_tensor("blk.0.attn_q.weight", matrix(hidden, hidden) * 2)
    w.add_tensor("blk.0.attn_k.weight", matrix(kv * head_dim, hidden) * 2)
    w.add_tensor("blk.0.attn_v.weight", matrix(kv * head_dim, hidden))
    w.add_tensor("blk.0.attn_output.weight", matrix(hidden, hidden))
    w.add_tensor("blk.0.ffn_norm.weight", (1 + 0.1 * rng.standard_normal(hidden)).astype(np.float32))
    w.add_tensor("blk.0.ffn_gate.weight", matrix(ffn, hidden))
    w.add_tensor("blk.0.ffn_up.weight", matrix(ffn, hidden))
    w.add_tensor("blk.0.ffn_down.weight", matrix(hidden, ffn))
    w.add_tensor("output_norm.weight", (1 + 0.1 * rng.standard_normal(hidden)).astype(np.float32))
    w.add_tensor("output.weight", matrix(vocab, hidden) * 4)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


# SmolLM2-1.7B's shape (its config.json): layers, hidden, heads, kv heads, ffn
LARGE_SHAPE = (24, 2048, 32, 32, 8192)


def write_large(src: Path, out: Path, shape: tuple[int, ...] = LARGE_SHAPE, seed: int = 0) -> None:
    """A random Llama of ``shape`` (layers, hidden, heads, kv heads, ffn) in f16 with ``src``'s
    tokenizer, chat template and rotary settings, its head tied to the embedding as SmolLM2's is."""
    layers, hidden, heads, kv, ffn = shape
    reader = gguf.GGUFReader(str(src))
    w = gguf.GGUFWriter(str(out), arch="llama")
    dims = {"block_count": layers, "embedding_length": hidden, "feed_forward_length": ffn}
    dims |= {"attention.head_count": heads, "attention.head_count_kv": kv}
    dims |= {"rope.dimension_count": hidden // heads}
    for field in reader.fields.values():
        if field.name in ("general.architecture", "general.file_type") or field.name.startswith("GGUF."):
            continue  # written below, or by the writer itself
        kind = field.types[0]
        key = field.name.removeprefix("llama.")
        value = dims.pop(key) if key in dims else field.contents()
        sub_type = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(field.name, value, kind, sub_type=sub_type)
    if dims:
        raise SystemExit(f"{src}: no llama.{', llama.'.join(dims)} to replace")
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    vocab = int(reader.fields["llama.vocab_size"].contents())
    rng = np.random.default_rng(seed)
    head_dim = hidden // heads

    def matrix(rows: int, inputs: int, scale: float = 1.0) -> np.ndarray:
        return (rng.standard_normal((rows, inputs), dtype=np.float32) * scale * inputs**-0.5).astype(
            np.float16
        )

    w.add_tensor("token_embd.weight", matrix(vocab, hidden, hidden**0.5 * 0.02))
    for i in range(layers):
        for norm in ("attn_norm", "ffn_norm"):
            w.add_tensor(f"blk.{i}.{norm}.weight", np.ones(hidden, dtype=np.float32))
        for name, rows, inputs in (
            ("attn_q", heads * head_dim, hidden),
            ("attn_k", kv * head_dim, hidden),
            ("attn_v", kv * head_dim, hidden),
            ("attn_output", hidden, heads * head_dim),
            ("ffn_gate", ffn, hidden),
            ("ffn_up", ffn, hidden),
            ("ffn_down", hidden, ffn),
        ):
            w.add_tensor(f"blk.{i}.{name}.weight", matrix(rows, inputs))
    w.add_tensor("output_norm.weight", np.ones(hidden, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def quantize(src: Path, out: Path, ftype: str, threads: int = 2) -> None:
    """``src`` quantised to llama.cpp's file type ``ftype`` (``Q4_K_M``, ...) by llama.cpp itself."""
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype}")
    params.nthread = threads
    status = llama_cpp.llama_model_quantize(str(src).encode(), str(out).encode(), ctypes.byref(params))
    if status != 0:
        raise SystemExit(f"llama_model_quantize({src}, {ftype}) failed: {status}")


def llama_logits(path: Path, tokens: list[int], threads: int = 2) -> np.ndarray:
    """llama.cpp's logits (len(tokens), vocab) for ``tokens`` from position 0, one token a step (on an
    AMX Xeon llama-cpp-python 0.3.36 crashed evaluating several tokens of Q3_K blocks at once)."""
    from llama_cpp import Llama

    llm = Llama(
        str(path), n_ctx=128, n_batch=1, n_ubatch=1, logits_all=True, n_threads=threads, verbose=False
    )
    llm.eval(tokens)
    logits = np.array(llm.scores[: len(tokens)], dtype=np.float32)
    llm.close()
    return logits


def tensor_types(path: Path) -> dict[str, str]:
    return {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(path)).tensors}


def tiny(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    logits: dict[str, np.ndarray] = {}
    made: dict[str, dict[str, str]] = {}
    for name, shape in TINY_MODELS.items():
        src = out / f"{name}-F32.gguf.tmp"
        write_tiny(src, *shape)
        logits[f"{name}-F32"] = llama_logits(src, TOKENS)
        for ftype in TINY_TYPES[name]:
            file = out / f"{name}-{ftype}.gguf"
            quantize(src, file, ftype)
            logits[f"{name}-{ftype}"] = llama_logits(file, TOKENS)
            made[file.name] = tensor_types(file)
        src.unlink()
    np.savez(out / "logits.npz", tokens=np.array(TOKENS), **logits)
    (out / "types.json").write_text(json.dumps(made, indent=1, sort_keys=True) + "\n")
    for file, types in made.items():
        print(file, sorted(set(types.values())))


HELD_TEXT = (Path(__file__).parents[1] / "tests" / "data" / "held_text.txt").read_text().strip()
PROMPT = "Write a short story about a robot who learns to paint."
DECODE, REPEATS = 64, 3


def _perplexity(logits: np.ndarray, ids: list[int]) -> float:
    x = logits[:-1].astype(np.float64)
    x = x - x.max(-1, keepdims=True)
    logp = x - np.log(np.exp(x).sum(-1, keepdims=True))
    return float(np.exp(-logp[np.arange(len(ids) - 1), ids[1:]].mean()))


def run_zerotron(path: str, dtype: str = "float32", activations: bool = False) -> dict[str, object]:
    import torch

    from zerotron.components.sampling import SamplingParams
    from zerotron.models.quant import weight_bytes
    from zerotron.serve import kernels, linear_kernels
    from zerotron.serve.app import load_engine
    from zerotron.serve.engine import EngineConfig
    from zerotron.serve.linears import onednn_kernels

    torch.set_num_threads(2)
    # the kernels `zerotron serve` chooses on a CPU: native paged attention, and native (else oneDNN)
    # packed linears for the matrices not kept as blocks
    native = linear_kernels.why_no_native_matmul(getattr(torch, dtype)) is None
    config = EngineConfig(
        quantization="gguf",
        max_num_seqs=8,
        max_model_len=512,
        dtype=dtype,
        native_attention=kernels.available(),
        native_matmul=native,
        onednn=not native and onednn_kernels(getattr(torch, dtype)),
        quantize_activations=activations,  # --quantize-activations
    )
    engine = load_engine(path, config)
    tok = engine.tokenizer
    held, prompt = tok.encode(HELD_TEXT), tok.encode(PROMPT)
    with torch.no_grad():
        logits = engine.model(torch.tensor([held]))[0].float().numpy()
    params = SamplingParams(max_tokens=DECODE, temperature=0.0, ignore_eos=True)
    engine.generate([prompt], params)  # warm-up
    times = []
    for _ in range(REPEATS):
        start = time.perf_counter()
        out = engine.generate([prompt], params)[0]
        times.append(len(out) / (time.perf_counter() - start))
    return {
        "perplexity": _perplexity(logits, held),
        "tok_s": statistics.median(times),
        "weight_bytes": weight_bytes(engine.model),
        "native": engine.runner.int8_native,
        "ids": held,
    }


def run_llamacpp(path: str) -> dict[str, object]:
    from llama_cpp import Llama

    llm = Llama(path, n_ctx=512, n_batch=1, n_ubatch=1, logits_all=True, n_threads=2, verbose=False)
    held = llm.tokenize(HELD_TEXT.encode(), add_bos=False)
    llm.eval(held)
    logits = np.array(llm.scores[: len(held)], dtype=np.float32)
    prompt = llm.tokenize(PROMPT.encode(), add_bos=False)
    times = []
    for i in range(REPEATS + 1):
        llm.reset()
        start, n = time.perf_counter(), 0
        for _ in llm.generate(prompt, top_k=1, temp=0.0, reset=True):
            n += 1
            if n == DECODE:
                break
        if i:  # the first is the warm-up
            times.append(n / (time.perf_counter() - start))
    return {
        "perplexity": _perplexity(logits, held),
        "tok_s": statistics.median(times),
        "ids": held,
    }


def compare(files: list[Path], out: Path | None, llama_python: str, dtype: str, activations: bool) -> None:
    rows = []
    runs = [("zerotron", sys.executable), ("llamacpp", llama_python)]
    if activations:  # zerotron serve --quantize-activations too, in the same run
        runs.insert(1, ("zerotron-a8", sys.executable))
    for file in files:
        tensor_bytes = sum(int(t.n_bytes) for t in gguf.GGUFReader(str(file)).tensors)
        row: dict[str, object] = {"file": file.name, "tensor_bytes": tensor_bytes}
        for who, python in runs:
            cmd = [python, __file__, "_one", who, str(file), "--dtype", dtype]
            result = subprocess.run(cmd, capture_output=True, text=True, check=True)
            row[who] = json.loads(result.stdout.strip().splitlines()[-1])
        rows.append(row)
        z, ll = row["zerotron"], row["llamacpp"]
        assert isinstance(z, dict) and isinstance(ll, dict)
        if z.pop("ids") != ll.pop("ids"):
            raise SystemExit(f"{file.name}: the two tokenisers gave different ids for the held text")
        a8 = row.get("zerotron-a8")
        extra = ""
        if isinstance(a8, dict):
            a8.pop("ids")
            extra = (
                f"; int8 activations: perplexity {a8['perplexity']:.3f}, tok/s {a8['tok_s']:.1f} "
                f"({a8['tok_s'] / ll['tok_s']:.2f}x)"
            )
        print(
            f"{file.name}: perplexity zerotron {z['perplexity']:.3f} llama.cpp {ll['perplexity']:.3f}; "
            f"tok/s zerotron {z['tok_s']:.1f} llama.cpp {ll['tok_s']:.1f} ({z['tok_s'] / ll['tok_s']:.2f}x); "
            f"weights {z['weight_bytes'] / 2**20:.1f} MiB, file tensors {tensor_bytes / 2**20:.1f} MiB{extra}",
            flush=True,
        )
    if out is not None:
        out.write_text(json.dumps(rows, indent=1) + "\n")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("tiny", help="the tests' small files and llama.cpp's logits on them")
    t.add_argument("out", type=Path)
    q = sub.add_parser("quantize", help="a real model's files in llama.cpp's file types")
    q.add_argument("src", type=Path)
    q.add_argument("out", type=Path)
    q.add_argument("--types", default="Q2_K,Q3_K_M,Q4_K_M,Q5_K_M,Q6_K")
    big = sub.add_parser("large", help="a random model of SmolLM2-1.7B's shape, another file's tokenizer")
    big.add_argument("src", type=Path)
    big.add_argument("out", type=Path)
    c = sub.add_parser("compare", help="zerotron beside llama.cpp on each file")
    c.add_argument("files", type=Path, nargs="+")
    c.add_argument("--json", type=Path, default=None)
    c.add_argument("--llama-python", default=sys.executable, help="a Python with llama-cpp-python")
    c.add_argument("--dtype", default="float32", help="zerotron's activations: float32 or bfloat16")
    c.add_argument(
        "--quantize-activations",
        action="store_true",
        help="also zerotron with --quantize-activations (int8 activations, as llama.cpp's), same run",
    )
    one = sub.add_parser("_one")
    one.add_argument("who", choices=["zerotron", "zerotron-a8", "llamacpp"])
    one.add_argument("file")
    one.add_argument("--dtype", default="float32")
    args = p.parse_args()
    if args.cmd == "tiny":
        tiny(args.out)
        return
    if args.cmd == "large":
        write_large(args.src, args.out)
        return
    if args.cmd == "compare":
        compare(args.files, args.json, args.llama_python, args.dtype, args.quantize_activations)
        return
    if args.cmd == "_one":
        print(
            json.dumps(
                run_llamacpp(args.file)
                if args.who == "llamacpp"
                else run_zerotron(args.file, args.dtype, activations=args.who == "zerotron-a8")
            )
        )
        return
    args.out.mkdir(parents=True, exist_ok=True)
    for ftype in args.types.split(","):
        file = (
            args.out
            / f"{args.src.stem.removesuffix('-F32').removesuffix('-F16').removesuffix('_f32')}-{ftype}.gguf"
        )
        quantize(args.src, file, ftype)
        kinds = tensor_types(file)
        print(
            file, file.stat().st_size, {k: list(kinds.values()).count(k) for k in sorted(set(kinds.values()))}
        )


if __name__ == "__main__":
    main()
