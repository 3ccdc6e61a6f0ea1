"""The serving engine on a GPU (`zerotron serve --device cuda`): correctness and speed in one short run.

Run:  python benchmarks/gpu_serve.py [--device cuda] [--tiny] [--out DIR]

No download: a random Llama of SmolLM2-135M's shape (hidden 576, 30 layers, 9 heads, 3 KV heads,
vocabulary 49152; ``--tiny``: 2 layers, for a dry run on a CPU) is built with transformers, saved as a
Hugging Face directory and loaded by zerotron's loader onto ``--device`` (what ``zerotron serve MODEL
--device cuda`` does). Its embedding is scaled by 3 so that greedy choices are not near-ties. Per dtype
(float32, bfloat16):

1. Batch invariance: 12 greedy requests (prompts of 5-300 tokens, 32 new tokens) alone, all together
   under a 64-token step budget (prompts cut into chunks) and again after the 300-token one's prompt is
   cached (prefix-cache hit): tokens and log-probabilities must be bit-identical (the engine's linears
   run in 256-row calls off the CPU, ``fixed_rows``; attention is the Triton paged kernel, every row
   alone over its own keys, the default on a GPU). Also with SDPA over gathered keys whose shapes
   depend on the position alone (``--attention sdpa``, the fallback without Triton), and with the
   linears as plain whole F.linear calls (``fixed_rows=0``), to show what the fixed calls buy (and,
   timed only by default, with an fp8 KV cache the Triton kernel reads in place: ``kv=fp8``).
2. Against transformers' ``generate`` on the same device and weights: the share of requests whose
   greedy tokens are equal, and the largest difference between the engine's log-probabilities and a
   full forward of zerotron's model without a cache.
3. Speed: 64 requests of 64 prompt and 64 output tokens (random ids, ignore EOS) all at once: output
   tokens/s and peak GPU memory; for each setting of 1. and with 32-row calls; beside transformers'
   ``generate`` on the 64 prompts as one padded batch (a static batch, KV cache of its own), and beside
   zerotron's sequential ``generate`` (one request at a time) on 8 of them.

Prints each result as it comes and writes results.json into ``--out`` after each. A dry run on a CPU:
``TRITON_INTERPRET=1 python benchmarks/gpu_serve.py --device cpu --tiny`` (the Triton kernel in its
interpreter; ``--tiny`` also shortens the prompts and the trace).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from zerotron.components.generate import GenerateOptions, generate  # noqa: E402
from zerotron.components.sampling import SamplingParams  # noqa: E402
from zerotron.models.loading import load_pretrained  # noqa: E402
from zerotron.serve.engine import Engine, EngineConfig  # noqa: E402

SCALE = 3.0  # the embedding's (tied head's) scale: sharper logits, not saturated ones
SMOLLM2 = dict(
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    vocab_size=49152,
    max_position_embeddings=2048,
    rope_theta=100000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
)


def build(tmp: Path, tiny: bool) -> Path:
    import transformers

    keys = dict(SMOLLM2, num_hidden_layers=2) if tiny else SMOLLM2
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**keys)).float().eval()
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(SCALE)
    model.save_pretrained(tmp / "model")
    return tmp / "model"


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def run(
    engine: Engine, prompts: list[list[int]], params: SamplingParams
) -> list[tuple[list[int], list[float]]]:
    ids = [f"r{i}" for i in range(len(prompts))]
    for rid, prompt in zip(ids, prompts):
        engine.add_request(rid, prompt, params)
    got: dict[str, tuple[list[int], list[float]]] = {rid: ([], []) for rid in ids}
    while engine.has_unfinished():
        for out in engine.step():
            for o in out.outputs:
                if o.index == 0:
                    got[out.request_id][0].extend(o.token_ids)
                    got[out.request_id][1].extend(c.logprob for c in o.choices)
    assert engine.pool.in_use == 0, "KV blocks leaked"
    return [got[rid] for rid in ids]


def invariance(
    model: Any, prompts: list[list[int]], fixed: int, triton: bool, new: int, kv: str = "auto"
) -> dict[str, Any]:
    params = SamplingParams(temperature=0.0, max_tokens=new, logprobs=0, ignore_eos=True)

    def make(**kw: Any) -> Engine:
        base = {"num_blocks": 256, "fixed_rows": fixed, "triton_attention": triton, "kv_cache_dtype": kv}
        cfg = EngineConfig(**{**base, **kw})
        return Engine(model, None, cfg)

    alone = [run(make(), [p], params)[0] for p in prompts]
    batched = run(make(max_num_batched_tokens=64), prompts, params)
    engine = make()
    run(engine, prompts[1:2], params)  # the longest prompt: its full blocks are cached
    hits = engine.pool.hits
    cached = run(engine, prompts[:4], params)
    return {
        "batched_equal": batched == alone,
        "batched_tokens_equal": [t for t, _ in batched] == [t for t, _ in alone],
        "cached_equal": cached == alone[:4],
        "prefix_hits": engine.pool.hits - hits,
        "max_logprob_diff_batched": max(
            (abs(a - b) for (_, la), (_, lb) in zip(alone, batched) for a, b in zip(la, lb)), default=0.0
        ),
        "alone": alone,
    }


def reference(
    hf: Any, model: Any, prompts: list[list[int]], alone: list[Any], device: torch.device
) -> dict[str, Any]:
    same, worst = 0, 0.0
    for prompt, (tokens, logprobs) in zip(prompts, alone):
        ids = torch.tensor([prompt], device=device)
        with torch.no_grad():
            out = hf.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=len(tokens), do_sample=False
            )
            same += int(out[0, len(prompt) :].tolist() == tokens)
            full = torch.log_softmax(model(torch.tensor([prompt + tokens], device=device))[0].float(), -1)
        expected = [float(full[len(prompt) - 1 + i, t]) for i, t in enumerate(tokens)]
        worst = max(worst, max(abs(a - b) for a, b in zip(logprobs, expected)))
    mean = sum(-x for _, lp in alone for x in lp) / sum(len(lp) for _, lp in alone)
    return {
        "equal_to_transformers": f"{same}/{len(prompts)}",
        "max_logprob_diff_full_forward": worst,
        "mean_chosen_logprob": -mean,
    }


def speed(
    model: Any,
    prompts: list[list[int]],
    device: torch.device,
    fixed: int,
    triton: bool,
    new: int,
    kv: str = "auto",
) -> dict[str, Any]:
    params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
    cfg = EngineConfig(
        num_blocks=1024, max_num_seqs=64, fixed_rows=fixed, triton_attention=triton, kv_cache_dtype=kv
    )
    engine = Engine(model, None, cfg)
    run(engine, prompts[:4], params)  # warm-up
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    sync(device)
    t0 = time.perf_counter()
    got = run(engine, prompts, params)
    sync(device)
    wall = time.perf_counter() - t0
    row: dict[str, Any] = {
        "output_tokens_per_s": sum(len(t) for t, _ in got) / wall,
        "wall_s": wall,
        "steps": engine.stats["steps"],
    }
    if device.type == "cuda":
        row["peak_memory_bytes"] = int(torch.cuda.max_memory_allocated())
    return row


def peers(model: Any, hf: Any, prompts: list[list[int]], device: torch.device, new: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    ids = torch.tensor(prompts, device=device)  # equal lengths: no padding needed
    with torch.no_grad():
        hf.generate(ids[:4], attention_mask=torch.ones_like(ids[:4]), max_new_tokens=4, do_sample=False)
        sync(device)
        t0 = time.perf_counter()
        res = hf.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new, do_sample=False
        )
        sync(device)
    wall = time.perf_counter() - t0
    out["transformers static batch"] = {
        "output_tokens_per_s": (res.shape[1] - ids.shape[1]) * len(prompts) / wall
    }
    t0 = time.perf_counter()
    made = 0
    for prompt in prompts[:8]:
        made += len(generate(model, None, prompt, GenerateOptions(max_new_tokens=new, stop_ids=[]))["ids"])
    sync(device)
    out["zerotron generate, sequential"] = {"output_tokens_per_s": made / (time.perf_counter() - t0)}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="2 layers, short prompts (a dry run on a CPU)")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument(
        "--settings",
        default="256:triton,256:sdpa,0:triton,32:triton,256:triton:fp8",
        help="FIXED_ROWS:ATTENTION[:KV_CACHE_DTYPE] settings; the first is checked against transformers, "
        "the last only timed",
    )
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    args = p.parse_args()
    device = torch.device(args.device)
    torch.backends.cuda.matmul.allow_tf32 = False
    g = torch.Generator().manual_seed(0)
    lengths = [5, 300, 17, 64, 100, 33, 250, 9, 128, 47, 190, 70]
    if args.tiny:
        lengths = [max(1, n // 6) for n in lengths]
    check = [torch.randint(0, 49152, (n,), generator=g).tolist() for n in lengths]
    count, new = (8, 8) if args.tiny else (64, 64)
    trace = [torch.randint(0, 49152, (64,), generator=g).tolist() for _ in range(count)]
    checked = 8 if args.tiny else 32  # new tokens of the invariance and reference checks
    settings = [
        (int(x[0]), x[1] == "triton", x[2] if len(x) > 2 else "auto")
        for x in (y.split(":") for y in args.settings.split(","))
    ]
    results: dict[str, Any] = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu"}
    results["torch"] = torch.__version__
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        path = build(Path(tmp), args.tiny)
        for name in args.dtypes.split(","):
            dtype = getattr(torch, name)
            import transformers

            hf = transformers.LlamaForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
            row: dict[str, Any] = results.setdefault(name, {})
            for i, (fixed, triton, kv) in enumerate(settings):
                label = f"fixed_rows={fixed} {'triton' if triton else 'sdpa'}" + (
                    f" kv={kv}" if kv != "auto" else ""
                )
                # an engine sets its model's linears (fixed calls or not): a fresh model for each setting
                model, _ = load_pretrained(path, dtype=dtype, device=device)
                if i < len(settings) - 1 or len(settings) == 1:  # (the last of several: speed only)
                    inv = invariance(model, check, fixed, triton, checked, kv)
                    alone = inv.pop("alone")
                    row[f"invariance {label}"] = inv
                    if i == 0:
                        row["reference"] = reference(hf, model, check, alone, device)
                row[f"speed {label}"] = speed(copy.deepcopy(model), trace, device, fixed, triton, new, kv)
                print(name, label, json.dumps(row, default=str), flush=True)
                (out / "results.json").write_text(json.dumps(results, indent=1))
            model, _ = load_pretrained(path, dtype=dtype, device=device)  # as zerotron generate runs it
            row["peers"] = peers(model, hf, trace, device, new)
            del model, hf
            (out / "results.json").write_text(json.dumps(results, indent=1))
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
