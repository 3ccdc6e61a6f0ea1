#!/usr/bin/env bash
# One short GPU session's checks, in one command (about 8-9 minutes on an H100; give the device call
# 590 s), from the repo root:
#
#   bash benchmarks/gpu_session.sh OUT_DIR [BEFORE_DIR]
#
# BEFORE_DIR: an earlier zerotron's source tree (its zerotron/ and benchmarks/), for the offload
# before/after pair; make it with
#   mkdir -p .gpu_before && git archive COMMIT zerotron benchmarks | tar -x -C .gpu_before
# (the commit before 1f59e40 for "before the 16-bit host copy and the fused host AdamW").
#
# 0. tests/test_serve_triton.py on the GPU: the Triton kernel compiled, against fp64 attention and
#    transformers' tokens, batch-invariant (needs pytest and transformers, in the GPU image).
# 1. `zerotron serve`'s engine on the GPU (benchmarks/gpu_serve.py; Triton and SDPA attention): batch
#    invariance, transformers' tokens, output tokens/s beside transformers' static batch and
#    sequential generate.
# 2. ZeRO-3 with parameters and optimizer offloaded to host memory (benchmarks/gpu_offload.py,
#    SmolLM2-135M's shape, bf16, 16 x 2048 tokens a step): this code, and BEFORE_DIR's if given.
# 3. The same job with ZeRO-3 on the GPU (no offload), eager and with train.compile=true.
# 4. That job in fp8 (train.precision=fp8: torchao's float8 GEMMs), eager and compiled, beside part 3's
#    bf16 (needs torchao in the GPU image: `pip install --no-deps torchao-*.whl` if it is not there).
#    With FP8_ONLY=1 only this part runs (the whole session is over 10 minutes with it).
# 5. (gemm) the planner's GEMM law against the card: a tensor-parallel GPT layer's bf16 and fp8
#    products by shape (benchmarks/gpu_gemm.py).
# 6. (mfu8) the ~1B Llama of benchmarks/gpu_mfu.py in bf16 and fp8, compiled, and fp8 eager.
# 7. (invariance) which of the engine's operations change a row's bits with its batch, fp32 and bf16
#    (benchmarks/gpu_invariance.py; seconds).
# 8. (bigstep) the profile of an eager training step of a large-hidden Llama (hidden 8192, 3 blocks,
#    sequence 4096): the rate its matrix products reach back to back (`gemm_tflops` in
#    bigstep/results.json), against the planner's law (0.82 x peak x g/(g + 128), ~790 TFLOP/s at
#    these shapes) and the sustained random-data products of part 5 (~670): the open question of
#    issue 58's held-out Megatron runs (docs/planning.md, "What the H100 runs taught").
#
# PARTS (default "triton serve offload zero3 fp8", parts 0-4) names the parts to run, in the order
# given: triton, serve, offload, zero3, fp8, gemm, mfu8, invariance, bigstep. A 10-minute call holds
# about four. Open after 2026-12-05: "bigstep invariance mfu8" (a large model's GEMM rate; fp32
# serving's batch dependence; compiled fp8 after its graph-break fix), then "serve" with SERVE_S=300.
#
# Each part has its own time limit, so one that hangs cannot take the others' time; every result is a
# file in OUT_DIR (serve/ and mfu/ hold their results.json) and the log is printed.
set -u
out=${1:?usage: gpu_session.sh OUT_DIR [BEFORE_DIR]}
before=${2:-}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
python3 -c "import torch; print(torch.__version__, torch.cuda.get_device_name(0))" || exit 2
none="parallel.offload_params=none parallel.offload_optimizer=none"
parts=${PARTS:-triton serve offload zero3 fp8}
[ "${FP8_ONLY:-0}" = 1 ] && parts=fp8
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH}
for part in $parts; do
case $part in
triton)
    echo "== the Triton paged-attention kernel's tests, compiled on the GPU"
    # the CPU kernels build first (73 s on an H200 host), inside this limit
    timeout 180 python3 -m pytest -q -p no:cacheprovider -m "slow or not slow" tests/test_serve_triton.py \
        >"$out/triton_tests.log" 2>&1
    echo "triton tests: rc $?"
    tail -15 "$out/triton_tests.log" ;;
serve)
    echo "== serve engine on the GPU"
    mkdir -p "$out/serve"
    timeout "${SERVE_S:-230}" python3 benchmarks/gpu_serve.py --out "$out/serve" || echo "gpu_serve: rc $?" ;;
offload)
    echo "== ZeRO-3 + host offload, this code"
    timeout 90 python3 benchmarks/gpu_offload.py --steps 6 --out "$out/offload_now.json" ||
        echo "offload now: rc $?"
    if [ -n "$before" ]; then
        echo "== ZeRO-3 + host offload, $before"
        PYTHONPATH="$before" timeout 90 python3 "$before/benchmarks/gpu_offload.py" --steps 6 \
            --out "$out/offload_before.json" || echo "offload before: rc $?"
    fi ;;
zero3)
    echo "== ZeRO-3 on the GPU, eager and compiled"
    # shellcheck disable=SC2086
    timeout 70 python3 benchmarks/gpu_offload.py --steps 6 --out "$out/zero3_eager.json" $none ||
        echo "zero3 eager: rc $?"
    # shellcheck disable=SC2086
    timeout 110 python3 benchmarks/gpu_offload.py --steps 8 --out "$out/zero3_compile.json" \
        $none train.compile=true || echo "zero3 compile: rc $?" ;;
fp8)
    echo "== FP8 on the GPU: the ZeRO-3 job in float8, eager and compiled (bf16: zero3_eager, zero3_compile)"
    if python3 -c "import torchao.float8" 2>/dev/null; then
        # shellcheck disable=SC2086
        timeout 80 python3 benchmarks/gpu_offload.py --steps 6 --out "$out/zero3_fp8.json" $none \
            train.precision=fp8 || echo "zero3 fp8: rc $?"
        # shellcheck disable=SC2086
        timeout 120 python3 benchmarks/gpu_offload.py --steps 8 --out "$out/zero3_fp8_compile.json" \
            $none train.precision=fp8 train.compile=true || echo "zero3 fp8 compile: rc $?"
    else
        echo "torchao is not installed here: the fp8 part is not run"
    fi ;;
gemm)
    echo "== the planner's GEMM law: a tensor-parallel GPT layer's products, bf16 and fp8"
    timeout "${GEMM_S:-90}" python3 benchmarks/gpu_gemm.py --fp8 --out "$out/gemm.json" || echo "gemm: rc $?" ;;
mfu8)
    echo "== a ~1B Llama in bf16 and fp8: compiled, and fp8 eager"
    mkdir -p "$out/mfu"
    timeout "${MFU_S:-200}" python3 benchmarks/gpu_mfu.py --steps 12 --variants compile:4,fp8c:4,fp8:4 \
        --out "$out/mfu" || echo "mfu8: rc $?" ;;
bigstep)
    echo "== a large-hidden Llama's eager step, profiled: its matrix products' rate"
    mkdir -p "$out/bigstep"
    timeout "${BIGSTEP_S:-240}" python3 benchmarks/gpu_mfu.py --steps 5 --seq 4096 --variants eager:1 --profile \
        --model model.hidden_size=8192,model.num_attention_heads=64,model.num_key_value_heads=8,model.head_dim=128,model.intermediate_size=28672,model.num_hidden_layers=3,model.vocab_size=32768 \
        --out "$out/bigstep" || echo "bigstep: rc $?" ;;
invariance)
    echo "== batch invariance of the engine's operations, one by one"
    timeout 120 python3 benchmarks/gpu_invariance.py --out "$out/invariance.json" || echo "invariance: rc $?" ;;
*) echo "unknown part $part (triton serve offload zero3 fp8 gemm mfu8 invariance bigstep)" ;;
esac
done
echo "== done"
