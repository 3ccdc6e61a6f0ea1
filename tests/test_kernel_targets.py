"""The native kernels' source builds for the CPUs this machine is not.

``zerotron serve`` compiles ``csrc/`` with ``-march=native`` on the machine it runs on. The code for
AVX-512, AVX512-BF16, AVX512-VNNI and AMX is compiled under target attributes or ``#if`` blocks, so a
build for an x86-64 CPU with AVX2 and FMA but no AVX-512 (AMD Zen 1-3, Intel client cores) takes other
paths than the one the tests run on an AVX-512 machine: a 512-bit value outside an AVX-512 target
breaks that build alone (it did once, unseen here); ``alderlake`` (an Intel client core: AVX2 with
AVX-VNNI, no AVX-512) takes the 8-bit-activation kernel's AVX-VNNI sums. Compiled at -O0 (the check is the build, not
the speed: the always-inline target checks run at any level).
"""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sysconfig
from pathlib import Path

import pytest

from zerotron.serve import kernel_source, kernels


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86-64 targets")
@pytest.mark.parametrize("march", ["haswell", "alderlake"])
def test_kernels_build_for_a_cpu_without_avx512(tmp_path: Path, march: str) -> None:
    compiler = os.environ.get("CXX") or "c++"
    if shutil.which(compiler) is None:
        pytest.skip(f"no C++ compiler ({compiler!r}): the native kernels are not built here either")
    from torch.utils import cpp_extension

    source = tmp_path / "kernels.cpp"
    source.write_text(kernel_source.SOURCE)
    flags = [f for f in kernels._FLAGS if f not in ("-O3", "-march=native", "-mprefer-vector-width=512")]
    includes = [
        x for p in [*cpp_extension.include_paths(), sysconfig.get_paths()["include"]] for x in ("-isystem", p)
    ]
    command = [
        compiler,
        "-std=c++20",
        "-O0",
        f"-march={march}",
        *flags,
        "-fPIC",
        *includes,
        "-c",
        str(source),
    ]
    built = subprocess.run([*command, "-o", str(tmp_path / "kernels.o")], capture_output=True, text=True)
    errors = [line for line in built.stderr.splitlines() if "error" in line]
    assert built.returncode == 0, "\n".join(errors[:20]) or built.stderr[-3000:]


# Kernels that fetch ahead through a helper (q8_prefetch_output, prefetch_slot, prefetch_slots): each
# is built for an AVX-512 target the plain helpers are not, and GCC, which does not inline across
# targets unless told to, counted a helper that only prefetches as pure and dropped its call — the
# one-row 8-bit-activation products and the AVX512-BF16 attention's streamed decodes ran without their
# fetches ahead, and their benchmarks measured no fetch at all.
FETCHING_KERNELS = ("va_tasks", "pack_keys", "pack_values", "dot_stream_block")


def _disassembly() -> str:
    """The built module's instructions (``objdump -d``), or a skip where it cannot be read."""
    if not kernels.available():
        pytest.skip(f"the native kernels are not built here: {kernels.why_unavailable()}")
    objdump = shutil.which("objdump")
    if objdump is None:
        pytest.skip("no objdump (binutils) to read the built module")
    return subprocess.run(
        [objdump, "-d", "--no-show-raw-insn", "-C", kernels.built().__file__], capture_output=True, text=True
    ).stdout


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86-64 prefetch instructions")
def test_kernels_keep_their_fetches_ahead() -> None:
    listing = _disassembly()
    fetches: dict[str, int] = {}
    name = ""
    for line in listing.splitlines():
        if line.endswith(">:"):  # a function's first line: "<address> <name(args)>:"
            head = line.split("<", 1)[1].replace("(anonymous namespace)::", "").split("(", 1)[0]
            name = head if head in FETCHING_KERNELS else ""
            if name:
                fetches.setdefault(name, 0)
        elif name and "prefetch" in line:
            fetches[name] += 1
    if not fetches:
        pytest.skip("this CPU's build has none of the kernels that fetch ahead (AVX512-VNNI, AVX512-BF16)")
    assert all(fetches.values()), f"prefetch instructions per kernel: {fetches}"


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    return {
        f for line in text.splitlines() if line.startswith("flags") for f in line.split(":", 1)[1].split()
    }


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86-64 instructions")
def test_the_avx2_products_take_vpdpbusd_where_the_cpu_has_avx_vnni() -> None:
    """The 8-bit-activation kernel's AVX2 code (``va2_block``, what an Intel client core runs) sums a
    lane's byte products with AVX-VNNI's 256-bit VPDPBUSD where the build's CPU has it, and with
    VPMADDUBSW and VPMADDWD where it has not (the bits are the same: tests/test_serve_q8a8.py)."""
    listing = _disassembly()
    ops: dict[str, int] = {"vpdpbusd": 0, "vpmaddubsw": 0}
    inside = False
    for line in listing.splitlines():
        if line.endswith(">:"):
            inside = "va2_block<" in line
        elif inside and "ymm" in line:
            for op in ops:
                ops[op] += f"\t{op}" in line or f" {op} " in line
    if not any(ops.values()):
        pytest.skip("this build has no AVX2 8-bit-activation kernel (no AVX2)")
    if "avx_vnni" in _cpu_flags():
        assert ops["vpdpbusd"] > 0 and ops["vpmaddubsw"] == 0, ops
    else:
        assert ops["vpdpbusd"] == 0 and ops["vpmaddubsw"] > 0, ops


def test_build_for_another_cpu_builds_with_its_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    """``kernels.build_for`` (benchmarks time an AVX2 CPU's code on this one): the source built with
    ``-march=MARCH`` in place of this CPU's flags, under its own name (never this CPU's build), and
    that module used from then on."""
    from torch.utils import cpp_extension

    calls: list[dict] = []
    made = object()

    def load_inline(**kw: object) -> object:
        calls.append(kw)
        return made

    monkeypatch.setattr(cpp_extension, "load_inline", load_inline)
    monkeypatch.setattr(kernels, "_module", None)
    monkeypatch.setattr(kernels, "_error", None)
    assert kernels.build_for("znver3") is made and kernels.built() is made
    flags = calls[0]["extra_cflags"]
    assert "-march=znver3" in flags and "-march=native" not in flags  # type: ignore[operator]
    assert "-mprefer-vector-width=512" not in flags  # type: ignore[operator]
    assert str(calls[0]["name"]).startswith(f"{kernels._NAME}_znver3_")
    assert calls[0]["cpp_sources"] == [kernel_source.SOURCE]
