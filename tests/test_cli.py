"""The command line: bad input stops before any rank starts, with one line naming what to change."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from zerotron.cli import main


def _error(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    code = main(argv)
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert len(err.splitlines()) == 1, err
    return err


def test_serve_refuses_a_native_matmul_it_cannot_run(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """An explicit --matmul native is refused in one line, before any load, where it cannot run: under
    tensor parallelism (it packs whole weights) and on a CPU without the instructions of the dtype's
    kernel (AVX-512 or AVX2 for fp32, AMX, AVX512-BF16 or AVX2 for bf16; such a CPU is simulated here)."""
    from zerotron.serve import kernels, linear_kernels

    for dtype in ("float32", "bfloat16"):
        err = _error(capsys, ["serve", "model.gguf", "--matmul", "native", "--dtype", dtype, "--nproc", "3"])
        assert "--matmul native" in err and "tensor-parallel" in err
    monkeypatch.setattr(torch.cpu, "_is_avx512_supported", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    monkeypatch.setattr(kernels, "why_no_dot", lambda: "this CPU has no AVX512-BF16")
    monkeypatch.setattr(linear_kernels, "why_no_q8", lambda: "this CPU has no AVX2 (with FMA and F16C)")
    monkeypatch.setattr(
        linear_kernels, "why_no_vec", lambda: "this CPU has neither AVX-512F nor AVX2 with FMA"
    )
    for dtype, missing in (("float32", "AVX2"), ("bfloat16", "AVX2")):
        err = _error(capsys, ["serve", "model.gguf", "--matmul", "native", "--dtype", dtype])
        assert "--matmul native" in err and (missing in err or "not available" in err), err


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["train", "parallel.tp=3", "--nproc", "3"], "tp"),
        (["train", "parallel.dp=3", "--nproc", "2"], "world size"),
        (["train", "train.lrr=0.1"], "did you mean 'train.lr'"),
        (["train", "train.lr=-1"], "train.lr"),
        (["train", "train.seq_len=4096"], "max_position_embeddings"),
        (["train", "data.source=/nonexistent/corpus.txt"], "/nonexistent/corpus.txt"),
    ],
)
def test_bad_input_one_line(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, argv: list[str], expected: str
) -> None:
    err = _error(capsys, [*argv, "--out", str(tmp_path / "run")])
    assert expected in err
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_malformed_jsonl_reports_file_and_line(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    data = tmp_path / "corpus.jsonl"
    data.write_text(json.dumps({"text": "hello"}) + "\n{not json\n")
    err = _error(capsys, ["train", f"data.source={data}", "--out", str(tmp_path / "run")])
    assert f"{data}:2" in err


def test_train_end_to_end_small(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    out = tmp_path / "run"
    code = main(
        [
            "train",
            "train.steps=6",
            "train.seq_len=64",
            "train.global_batch=4",
            "train.micro_batch=2",
            "data.max_bytes=100000",
            "log.progress=lines",
            "--out",
            str(out),
        ]
    )
    text = capsys.readouterr().out
    assert code == 0
    assert f"run directory: {out}" in text and "sample:" in text
    for name in ("config.yaml", "metrics.jsonl", "loss.png", "sample.txt", "checkpoints/latest"):
        assert (out / name).exists(), name
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    keys = {
        "step",
        "loss",
        "lr",
        "grad_norm",
        "tokens",
        "n_params",
        "step_time_s",
        "tokens_per_s",
        "mfu",
        "comm_bytes",
        "model_state_bytes",
        "activation_bytes",
        "peak_memory_bytes",
        "layout",
        "rank",
    }
    assert keys <= set(records[0])
    assert records[0]["peak_memory_bytes"] > records[0]["model_state_bytes"]["params"]
    assert records[0]["mfu"] is None and records[0]["layout"]["dp"] == 2
    states = records[0]["model_state_bytes"]
    # AdamW: two fp32 moments per parameter, plus one scalar step counter per parameter tensor.
    assert states["optimizer"] == pytest.approx(2 * states["params"], rel=1e-3)
    assert states["grads"] == states["params"]  # fp32 gradients of every parameter, held at the step


def test_tensorboard_event_files(tmp_path: Path) -> None:
    out = tmp_path / "run"
    code = main(
        [
            "train",
            "train.steps=2",
            "train.seq_len=32",
            "train.global_batch=2",
            "train.micro_batch=1",
            "data.max_bytes=20000",
            "log.progress=none",
            "log.tensorboard=true",
            "--nproc",
            "1",
            "--out",
            str(out),
        ]
    )
    assert code == 0
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("train/loss")] == [1, 2]


def test_serve_refuses_a_native_attention_it_cannot_build(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where the native kernel cannot be built, an explicit --attention native is refused in one line
    with the reason (left out, the server attends through SDPA)."""
    from zerotron.serve import kernels

    monkeypatch.setattr(kernels, "_module", None)
    monkeypatch.setattr(kernels, "_error", "no C++ compiler found")
    err = _error(capsys, ["serve", "model.gguf", "--attention", "native"])
    assert "--attention native" in err and "no C++ compiler found" in err


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["serve", "model.gguf", "--nproc", "0"], "--nproc"),
        (["serve", "missing.gguf", "--nproc", "2"], "no such file"),
        (["serve", "model.gguf", "--port", "70000"], "--port"),
        (["serve", "model.gguf", "--max-num-seqs", "0"], "--max-num-seqs"),
        (["serve", "model.gguf", "--block-size", "24"], "--block-size"),
        (["serve", "model.gguf", "--nproc", "2", "--matmul", "onednn"], "--matmul onednn"),
        (["serve", "model.gguf", "--device", "xla"], "runs on cpu or cuda"),
        (["serve", "model.gguf", "--device", "cuda:x"], "not a device"),
        (["serve", "model.gguf", "--lora-modules", "noequals"], "name=path"),
        (["serve", "model.gguf", "--lora-modules", "a=/nowhere/adapter"], "adapter_config.json"),
        (["serve", "model.gguf", "--lora-modules", "a=/x", "a=/y"], "named twice"),
        (["serve", "model.gguf", "--lora-modules", "model=/x"], "rename the adapter"),
        (["serve", "model.gguf", "--max-loras", "0"], "--max-loras"),
        (["serve", "model.gguf", "--lora-modules", "a=/x", "b=/y", "--max-loras", "1"], "raise --max-loras"),
        (
            ["serve", "model.gguf", "--speculative-config", '{"method": "eagle"}'],
            "EAGLE, Medusa and MTP heads are not",
        ),
        (["serve", "model.gguf", "--speculative-config", "{"], "not JSON"),
    ],
)
def test_serve_refuses_in_one_line(
    capsys: pytest.CaptureFixture[str], argv: list[str], expected: str
) -> None:
    err = _error(capsys, argv)
    assert expected in err and len(err.splitlines()) == 1


def test_a_cuda_device_is_refused_in_one_line_where_it_cannot_serve(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """--device cuda: refused on a machine without CUDA (this one, or a simulated one); on a simulated
    one-GPU machine refused beside CPU kernel choices, more tensor-parallel ranks than GPUs and a device
    index it lacks, and otherwise an engine config on that device (no CPU kernels, fixed-shape
    linears by default)."""
    import argparse

    from zerotron.cli import build_parser
    from zerotron.serve.command import engine_config

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for command in (["serve", "model.gguf"], ["generate", "model.gguf", "--prompt", "hi"]):
        err = _error(capsys, [*command, "--device", "cuda"])
        assert "--device cuda" in err and "no CUDA device" in err, err
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    refusals = [
        (["--matmul", "native"], "--matmul native"),
        (["--attention", "native"], "--attention native"),
        (["--matmul", "onednn"], "--matmul onednn"),
        (["--nproc", "2"], "--nproc 2: this machine has 1 CUDA device(s)"),
        (["--device", "cuda:1"], "1 CUDA device"),
    ]
    for extra, expected in refusals:
        argv = ["serve", "model.gguf", "--device", "cuda", *extra]
        err = _error(capsys, argv)
        assert expected in err, err
    args: argparse.Namespace = build_parser().parse_args(["serve", "model.gguf", "--device", "cuda:0"])
    config = engine_config(args, 1)
    assert config.device == "cuda:0" and not (
        config.onednn or config.native_matmul or config.native_attention
    )
    assert config.fixed_rows is None  # the runner's default off the CPU: FIXED_ROWS-row calls
    # attention on a GPU: Triton's paged kernel where Triton is installed (dev installs it), else SDPA
    from zerotron.serve import triton_attention

    assert config.triton_attention == triton_attention.available()
    args = build_parser().parse_args(["serve", "model.gguf", "--device", "cuda", "--attention", "sdpa"])
    assert not engine_config(args, 1).triton_attention
    monkeypatch.setattr(triton_attention, "_error", "Triton is not installed")
    err = _error(capsys, ["serve", "model.gguf", "--device", "cuda", "--attention", "triton"])
    assert "--attention triton: Triton is not installed" in err and len(err.splitlines()) == 1, err
    assert not engine_config(
        build_parser().parse_args(["serve", "model.gguf", "--device", "cuda"]), 1
    ).triton_attention
    # on the CPU the Triton kernel is refused (it runs there only in Triton's interpreter)
    err = _error(capsys, ["serve", "model.gguf", "--attention", "triton"])
    assert "--attention triton" in err and "CUDA device" in err and len(err.splitlines()) == 1, err


def test_tensor_parallel_ranks_talk_over_gloo_on_the_cpu_and_nccl_on_gpus(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``serve``/``generate --nproc 2`` on a (simulated) machine with two GPUs: CPU ranks get Gloo (torch's
    automatic choice there would be NCCL, which moves no host tensors), ``--device cuda`` ranks NCCL,
    each then on its local rank's GPU; ``--device cuda:N`` is refused beside --nproc, and more ranks
    than GPUs too, in one line, before anything starts."""
    from tests.test_llama import BASE
    from zerotron.distributed import launch
    from zerotron.models.hf import config_to_hf
    from zerotron.serve.devices import rank_device

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(config_to_hf(BASE)))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    spawned: list[tuple[str, int, str]] = []

    def spawn(fn: object, nproc: int, args: tuple[object, ...] = (), **kw: object) -> list[object]:
        spawned.append((getattr(fn, "__name__", ""), nproc, str(kw.get("backend"))))
        return []

    monkeypatch.setattr(launch, "spawn", spawn)
    generate = ["generate", str(model), "parallel.tp=2", "--prompt", "hi"]
    for argv in (["serve", str(model), "--nproc", "2"], generate):
        assert main(argv) == 0 and main([*argv, "--device", "cuda"]) == 0
    assert [(n, b) for _, n, b in spawned] == [(2, "gloo"), (2, "nccl")] * 2
    assert [name for name, _, _ in spawned] == ["serve_worker"] * 2 + ["generate_worker"] * 2
    for argv, expected in (
        (["serve", str(model), "--nproc", "2", "--device", "cuda:1"], "pass --device cuda"),
        ([*generate, "--device", "cuda:0"], "pass --device cuda"),
        (["serve", str(model), "--nproc", "3", "--device", "cuda"], "--nproc 3: this machine has 2"),
    ):
        assert expected in _error(capsys, argv)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)  # set from LOCAL_RANK in a rank
    assert rank_device("cuda") == "cuda:1" and rank_device("cpu") == "cpu"


def test_serve_attention_kernel_picks_the_native_kernels_code(capsys: pytest.CaptureFixture[str]) -> None:
    """``--attention-kernel`` reaches the engine's settings; refused in one line beside SDPA attention
    (it picks the native kernel's code), for a dtype the code does not attend, and where the CPU
    lacks the code's instructions."""
    from zerotron.cli import build_parser
    from zerotron.serve import kernels
    from zerotron.serve.command import engine_config
    from zerotron.serve.config import EngineConfig, EngineConfigError

    args = build_parser().parse_args(["serve", "model.gguf", "--attention-kernel", "fp32"])
    if kernels.available():
        assert engine_config(args, 1).attention_kernel == "fp32"
    err = _error(capsys, ["serve", "model.gguf", "--attention", "sdpa", "--attention-kernel", "fp32"])
    assert "--attention-kernel" in err and "--attention native" in err and len(err.splitlines()) == 1, err
    with pytest.raises(EngineConfigError, match="attention_kernel: 'avx'"):
        EngineConfig(attention_kernel="avx")
    with pytest.raises(EngineConfigError, match="turn native attention on"):  # not accepted and ignored
        EngineConfig(attention_kernel="fp32")
    if kernels.available() and kernels.dot_available():
        with pytest.raises(EngineConfigError, match="dot: it attends bf16 rows, not float32"):
            EngineConfig(attention_kernel="dot", native_attention=True, dtype="float32")
        assert EngineConfig(attention_kernel="dot", native_attention=True, dtype="bfloat16").attention_kernel
    if kernels.available() and not kernels.tiles_available():
        with pytest.raises(EngineConfigError, match="attention_kernel: tiles: "):
            EngineConfig(attention_kernel="tiles", native_attention=True, dtype="bfloat16")
