"""Hardware profiles: peak FLOP/s per dtype, memory, links and the efficiency constants of the time model.

Profiles are plain data. The figures are vendors' data-sheet numbers (dense, no sparsity) for one
device; ``intra_bw`` is one device's uni-directional bandwidth to its node peers (NVLink/NVSwitch,
Infinity Fabric or PCIe), ``inter_bw`` its share of the node's network (e.g. a DGX A100 has 8×200 Gb/s
InfiniBand for 8 GPUs: 25 GB/s each). ``host_memory_bytes`` is per node. The efficiency constants
(``gemm_efficiency``, ``gemm_knee``, ``attention_efficiency``, ``comm_efficiency``) are what
:mod:`zerotron.plan.calibrate` fits to a user's runs; the shipped values were fitted to the published
calibration runs of :mod:`zerotron.plan.published` (see ``_A100_FIT`` and ``_H100_FIT``).

A user profile is a YAML or JSON mapping with the same keys; ``base: NAME`` starts from a shipped
profile and overrides only the keys given.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from zerotron.plan.errors import PlanError

GiB = 2**30
GB = 1e9


@dataclass(frozen=True)
class Hardware:
    """One accelerator kind and the node it sits in."""

    name: str
    peak_flops: dict[str, float]
    """Dense peak FLOP/s by compute dtype: ``bf16``, ``fp16``, ``fp32`` (IEEE fp32, what the engine runs:
    it does not enable TF32), ``tf32`` (tensor cores, for reference) and ``fp8`` (Hopper and Ada only)."""
    memory_bytes: float
    """Device memory (bytes)."""
    memory_bw: float
    """Device memory bandwidth (bytes/s)."""
    gpus_per_node: int
    """Devices that share the fast intra-node link."""
    intra_bw: float
    """Uni-directional bandwidth of one device to its node peers (bytes/s)."""
    inter_bw: float
    """One device's share of the node's network bandwidth (bytes/s)."""
    intra_latency_s: float = 5e-6
    """Per-hop latency α of a collective inside a node."""
    inter_latency_s: float = 15e-6
    """Per-hop latency α of a collective across nodes."""
    host_memory_bytes: float = 1024 * GiB
    """Host RAM per node (for CPU offload)."""
    pcie_bw: float = 25 * GB
    """Host↔device bandwidth per device (bytes/s)."""
    nvme_bw: float = 3 * GB
    """NVMe bandwidth available to one device's offload (bytes/s)."""
    cpu_adam_params_per_s: float = 1.0e9
    """Parameters per second the host's Adam step updates for one device (DeepSpeed CPU Adam)."""
    gemm_efficiency: float = 0.6
    """Fraction of peak that large matrix multiplies reach."""
    gemm_knee: float = 16.0
    """GEMM size (geometric mean of its dimensions) at which efficiency is half of ``gemm_efficiency``."""
    fp8_efficiency: float = 0.6
    """Fraction of the FP8 peak that large FP8 matrix multiplies reach (casts and scaling included)."""
    attention_efficiency: float = 0.5
    """Fraction of peak a fused (flash) attention kernel reaches on the unmasked half of causal scores."""
    comm_efficiency: float = 0.9
    """Fraction of link bandwidth a collective reaches (NCCL bus bandwidth / link bandwidth)."""
    eager_elementwise: float = 5.0
    """Time of an eager block's element-wise kernels (one kernel per operation: an RMSNorm in fp32 is six
    of them, rotary embedding, casts, layout copies for attention) as a multiple of a fused block's
    bytes at ``memory_bw``. Measured on an H100 (BENCHMARKS.md, "bf16 MFU of a ~1B Llama"): 133-144 ms
    of such kernels per step against 25.6 ms modelled for the fused block: 5.2-5.6, taken as 5 (part of
    that time is per-parameter traffic the model counts elsewhere)."""
    overlap_contention: float = 0.0
    """Fraction of an overlapped NCCL collective's time (data-parallel reduction under backward,
    ZeRO-3's per-block traffic, ring attention) that lengthens the step even when compute could hide
    it: the collective kernels take SMs and memory bandwidth from the kernels they run beside. Fitted
    per chip on the calibration runs (host-to-device copies and Transformer Engine's tensor-parallel
    overlap, modelled from its design with ``sms``, are not affected)."""
    sms: int = 0
    """Streaming multiprocessors: an overlapped tensor-parallel reduce-scatter runs on 16 of them and the
    GEMM beside it on the rest (``tensor_parallel.UB_SMS``); 0: unknown, no such slowdown."""
    shared_host: bool = False
    """Ranks on a node share one host's peak FLOP/s and memory bandwidth (CPU processes): the profile
    gives the node's figures and each rank gets 1/(ranks on the node) of them."""
    notes: str = field(default="", compare=False)

    def per_rank(self, world: int) -> Hardware:
        """The share of one rank when ``world`` ranks run (a ``shared_host`` node splits its compute)."""
        if not self.shared_host:
            return self
        ranks = max(1, min(world, self.gpus_per_node))
        if ranks == 1:
            return self
        return dataclasses.replace(
            self,
            peak_flops={k: v / ranks for k, v in self.peak_flops.items()},
            memory_bw=self.memory_bw / ranks,
            cpu_adam_params_per_s=self.cpu_adam_params_per_s / ranks,
        )

    def flops(self, dtype: str) -> float:
        """Peak FLOP/s for the compute dtype ``dtype`` (fp32, bf16, fp16)."""
        if dtype not in self.peak_flops:
            raise PlanError(
                f"hardware {self.name!r} has no peak FLOP/s for {dtype}; choose another train.precision or add "
                f"peak_flops.{dtype} to the profile"
            )
        return self.peak_flops[dtype]


def _gpu(
    name: str,
    tflops: float,
    fp32_tflops: float,
    tf32_tflops: float,
    mem: float,
    hbm: float,
    fp8_tflops: float = 0.0,
    **kw: Any,
) -> Hardware:
    flops = {"bf16": tflops * 1e12, "fp16": tflops * 1e12, "fp32": fp32_tflops * 1e12}
    flops["tf32"] = tf32_tflops * 1e12
    if fp8_tflops:
        flops["fp8"] = fp8_tflops * 1e12
    return Hardware(name=name, peak_flops=flops, memory_bytes=mem, memory_bw=hbm, **kw)


# Efficiency constants fitted to the calibration set of :mod:`zerotron.plan.published` by
# :func:`zerotron.plan.accuracy.fit_profiles` (``python -m zerotron.plan.accuracy --fit``): A100 runs
# (Narayanan Table 1, llm-foundry on one node) and H100 runs (llm-foundry on one node). H200 and H100
# PCIe share the H100's chip; the other GPUs carry the A100 fit until calibrated (``--calibrate``).
# ``_H100_FIT`` (below) joins its fitted constants to the measured ones.
_A100_FIT: dict[str, float] = dict(
    gemm_efficiency=0.72,
    gemm_knee=512.0,
    attention_efficiency=0.25,
    overlap_contention=0.0,
    eager_elementwise=1.0,
)

# Measured, not fitted: the H100 SXM's bf16 GEMM law e·g/(g + knee) from microbenchmarks. The maximum
# achievable matmul FLOP/s is 792 TFLOP/s (80.1% of 989) at 6144x17920x2816 (Bekman, ml-engineering,
# "Maximum Achievable Matmul FLOPS comparison table", CUDA 12.1), and 787-793 TFLOP/s for 8192^3 on the
# H100 lent to this project (BENCHMARKS.md); the profile of an eager 1B Llama step on that card put its
# GEMMs (8192-token micro-batches, g of 2,000-6,000) at ~80% of peak: 152 ms for 1.2e14 FLOPs. A fit of
# end-to-end runs had put the knee at 4096 (GEMMs at 40-50%), absorbing the eager element-wise traffic
# and the collectives' contention of its calibration runs (docs/planning.md, "What the H100 runs taught").
MEASURED: dict[str, dict[str, float]] = {
    "h100-sxm": dict(gemm_efficiency=0.82, gemm_knee=128.0, eager_elementwise=5.0)
}
_H100_FIT: dict[str, float] = dict(
    attention_efficiency=0.225, fp8_efficiency=0.69, overlap_contention=1.0, **MEASURED["h100-sxm"]
)

# The ``cpu`` profile's collective constants and attention efficiency are measured by
# benchmarks/cpu_profile.py on a 2-core machine: Gloo all-reduces of 0.5 and 8 MB through zerotron's
# collectives (2α ≈ 2.9 ms, ~1 GB/s bus bandwidth: intra_bw 2 GB/s x comm_efficiency 0.5) and causal
# attention at a third of the matmul speed on one thread. Its GEMM efficiency is a prior that
# ``--calibrate`` replaces; its eager factor is 1 (not measured on a CPU: the calibrated GEMM
# efficiency absorbs the element-wise time).
PROFILES: dict[str, Hardware] = {
    p.name: p
    for p in (
        _gpu("a100-40g", 312, 19.5, 156, 40 * GiB, 1.555e12, sms=108, gpus_per_node=8, intra_bw=300 * GB,
             inter_bw=25 * GB, host_memory_bytes=1024 * GiB, pcie_bw=25 * GB, nvme_bw=3 * GB,
             **_A100_FIT, notes="DGX A100: NVSwitch 600 GB/s bidirectional, 8x200 Gb/s IB"),
        _gpu("a100-80g", 312, 19.5, 156, 80 * GiB, 2.039e12, sms=108, gpus_per_node=8, intra_bw=300 * GB,
             inter_bw=25 * GB, host_memory_bytes=2048 * GiB, pcie_bw=25 * GB, nvme_bw=3 * GB,
             **_A100_FIT, notes="DGX A100 80GB (Selene): NVSwitch, 8x200 Gb/s IB"),
        _gpu("h100-sxm", 989, 67, 494.5, 80 * GiB, 3.35e12, 1979, sms=132, gpus_per_node=8, intra_bw=450 * GB,
             inter_bw=50 * GB, host_memory_bytes=2048 * GiB, pcie_bw=55 * GB, nvme_bw=5 * GB,
             cpu_adam_params_per_s=1.5e9, **_H100_FIT,
             notes="DGX H100: NVLink 900 GB/s bidirectional, 8x400 Gb/s IB"),
        _gpu("h200", 989, 67, 494.5, 141e9, 4.8e12, 1979, sms=132, gpus_per_node=8, intra_bw=450 * GB,
             inter_bw=50 * GB, host_memory_bytes=2048 * GiB, pcie_bw=55 * GB, nvme_bw=5 * GB,
             cpu_adam_params_per_s=1.5e9, **_H100_FIT, notes="HGX H200: H100 compute, 141 GB HBM3e at 4.8 TB/s"),
        _gpu("h100-pcie", 756, 51, 378, 80 * GiB, 2.0e12, 1513, sms=114, gpus_per_node=8, intra_bw=25 * GB,
             inter_bw=12.5 * GB, host_memory_bytes=1024 * GiB, pcie_bw=50 * GB, nvme_bw=4 * GB,
             **_H100_FIT, notes="PCIe Gen5 peers through host switches, 100 Gb/s network per GPU"),
        _gpu("l40s", 362, 91.6, 183, 48 * GiB, 0.864e12, 733, sms=142, gpus_per_node=8, intra_bw=25 * GB,
             inter_bw=12.5 * GB, host_memory_bytes=1024 * GiB, pcie_bw=25 * GB, nvme_bw=3 * GB,
             **_A100_FIT, notes="no NVLink: PCIe Gen4 peer traffic"),
        _gpu("rtx4090", 165, 82.6, 82.6, 24 * GiB, 1.008e12, 330, sms=128, gpus_per_node=4, intra_bw=12 * GB,
             inter_bw=1.25 * GB, inter_latency_s=50e-6, host_memory_bytes=128 * GiB, pcie_bw=25 * GB,
             nvme_bw=3 * GB, cpu_adam_params_per_s=0.5e9, **_A100_FIT,
             notes="workstation: no P2P, PCIe Gen4 through the host, 10 GbE between boxes"),
        _gpu("mi250x-gcd", 191.5, 47.9, 47.9, 64 * GiB, 1.6e12, sms=110, gpus_per_node=8, intra_bw=50 * GB,
             inter_bw=12.5 * GB, host_memory_bytes=512 * GiB, pcie_bw=36 * GB, nvme_bw=2 * GB,
             **_A100_FIT, notes="one GCD of an MI250X (Frontier node: 8 GCDs, 4x200 Gb/s Slingshot)"),
        Hardware(name="cpu", peak_flops={"fp32": 1.0e12, "tf32": 1.0e12, "bf16": 1.0e12, "fp16": 0.5e12,
                                         "fp8": 1.0e12},  # fp8: emulated, fp32 GEMMs on float8 values
                 memory_bytes=256 * GiB, memory_bw=100 * GB, gpus_per_node=8, intra_bw=2 * GB,
                 inter_bw=1.25 * GB, intra_latency_s=1.4e-3, inter_latency_s=2e-3,
                 host_memory_bytes=256 * GiB, pcie_bw=100 * GB, nvme_bw=2 * GB,
                 cpu_adam_params_per_s=0.2e9, gemm_efficiency=0.3, gemm_knee=64.0, comm_efficiency=0.5,
                 attention_efficiency=0.1, fp8_efficiency=0.3, eager_elementwise=1.0, shared_host=True,
                 notes="a generic many-core server; ranks are processes sharing its cores and memory (Gloo)"),
    )
}  # fmt: skip

_FIELDS = {f.name for f in dataclasses.fields(Hardware)}

# CUDA device names (fragments, most specific first) -> the profile whose peak is the device's.
_DEVICE_NAMES = (
    ("H100 PCIe", "h100-pcie"),
    ("H100", "h100-sxm"),
    ("H200", "h200"),
    ("A100-SXM4-40GB", "a100-40g"),
    ("A100", "a100-80g"),
    ("L40S", "l40s"),
    ("RTX 4090", "rtx4090"),
    ("MI250X", "mi250x-gcd"),
)


def peak_flops_of_device(device_name: str, dtype: str = "bf16") -> float | None:
    """Dense peak FLOP/s of the device ``torch.cuda.get_device_name`` reports, from the profiles (the
    trainer's MFU and the planner use the same figures); None for a device no profile describes."""
    for fragment, profile in _DEVICE_NAMES:
        if fragment in device_name:
            return PROFILES[profile].peak_flops.get(dtype)
    return None


def get_hardware(name_or_path: str) -> Hardware:
    """A shipped profile by name, or a user profile from a YAML/JSON file path."""
    if name_or_path in PROFILES:
        return PROFILES[name_or_path]
    path = Path(name_or_path)
    if path.suffix.lower() in (".yaml", ".yml", ".json") or path.is_file():
        return load_profile(path)
    raise PlanError(
        f"unknown hardware {name_or_path!r}; choose one of {', '.join(PROFILES)} or give a profile file"
        " (.yaml/.json)"
    )


def load_profile(path: Path) -> Hardware:
    """Read a user profile; ``base: NAME`` inherits a shipped profile, other keys override it."""
    if not path.is_file():
        raise PlanError(f"--hardware {path}: no such profile file")
    text = path.read_text(encoding="utf-8")
    try:
        if path.suffix.lower() == ".json":
            data = json.loads(text)
        else:
            import yaml

            data = yaml.safe_load(text)
    except ValueError as e:  # yaml.YAMLError is not a ValueError: caught below
        raise PlanError(f"--hardware {path}: not valid JSON ({e})".replace("\n", " ")) from e
    except Exception as e:  # noqa: BLE001 - any YAML parse error becomes one line
        raise PlanError(f"--hardware {path}: not valid YAML ({e})".replace("\n", " ")) from e
    if not isinstance(data, dict):
        raise PlanError(f"--hardware {path}: the top level must be a mapping of profile keys")
    return profile_from_dict(data, source=str(path))


def profile_from_dict(data: dict[str, Any], source: str = "profile") -> Hardware:
    """A :class:`Hardware` from a mapping (``base`` optional); unknown keys are errors."""
    data = dict(data)
    base_name = data.pop("base", None)
    unknown = sorted(set(data) - _FIELDS)
    if unknown:
        raise PlanError(
            f"{source}: unknown key(s) {', '.join(unknown)}; known keys: {', '.join(sorted(_FIELDS))}"
        )
    if base_name is not None:
        if base_name not in PROFILES:
            raise PlanError(f"{source}: unknown base {base_name!r}; choose one of {', '.join(PROFILES)}")
        values = dataclasses.asdict(PROFILES[base_name])
    else:
        missing = [
            f.name
            for f in dataclasses.fields(Hardware)
            if f.name not in data
            and f.default is dataclasses.MISSING
            and f.default_factory is dataclasses.MISSING
        ]
        if missing:
            raise PlanError(f"{source}: missing key(s) {', '.join(missing)} (or set base: NAME)")
        values = {}
    peak = {**values.get("peak_flops", {}), **(data.pop("peak_flops", None) or {})}
    values.update({k: _number(k, v, source) for k, v in data.items()})
    values["peak_flops"] = {k: _number(f"peak_flops.{k}", v, source) for k, v in peak.items()}
    values.setdefault("name", base_name or source)
    if values["name"] == base_name and "name" not in data:
        values["name"] = f"{base_name}+{Path(source).stem}"
    hw = Hardware(**values)
    _check(hw, source)
    return hw


def _number(key: str, value: Any, source: str) -> Any:
    """``value`` as the field's type: text for name/notes, an int for gpus_per_node, else a float.

    YAML reads ``96.0e9`` (no exponent sign) as text; it is accepted as a number here.
    """
    if key in ("name", "notes"):
        return str(value)
    if key == "shared_host":
        if isinstance(value, bool):
            return value
        raise PlanError(f"{source}: shared_host must be true or false, got {value!r}")
    try:
        return int(value) if key in ("gpus_per_node", "sms") else float(value)
    except (TypeError, ValueError):
        raise PlanError(f"{source}: {key} must be a number, got {value!r}") from None


def _check(hw: Hardware, source: str) -> None:
    for key in (
        "memory_bytes",
        "memory_bw",
        "intra_bw",
        "inter_bw",
        "pcie_bw",
        "nvme_bw",
        "cpu_adam_params_per_s",
        "gemm_efficiency",
        "attention_efficiency",
        "fp8_efficiency",
        "comm_efficiency",
        "eager_elementwise",
    ):
        if not float(getattr(hw, key)) > 0:
            raise PlanError(f"{source}: {key} must be > 0")
    if hw.gpus_per_node < 1:
        raise PlanError(f"{source}: gpus_per_node must be >= 1")
    if hw.sms < 0:
        raise PlanError(f"{source}: sms (streaming multiprocessors) must be >= 0 (0: unknown)")
    if not 0 <= hw.overlap_contention <= 1:
        raise PlanError(f"{source}: overlap_contention is a fraction (0 to 1)")
    if max(hw.gemm_efficiency, hw.attention_efficiency, hw.fp8_efficiency, hw.comm_efficiency) > 1:
        raise PlanError(
            f"{source}: gemm_efficiency, attention_efficiency, fp8_efficiency and comm_efficiency are fractions "
            "(<= 1)"
        )
