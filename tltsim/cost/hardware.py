"""One GPU: ``HardwareSpec`` and its cited presets (inputs of the roofline model, beside
``tltsim.cost.specs``' model and drafter specs, which re-export these names).

    from tltsim.cost.hardware import get_hardware
    get_hardware("H100-SXM").hbm_bytes_per_s    # 3.35e12
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# What a hand-written hardware file can hold before it is a unit slip (a value in TB/s, GB or
# TFLOP/s where the field is per second, bytes or FLOP/s): from one CPU core's (~1e11 FLOP/s,
# ~3e10 B/s, benchmarks/bench_fidelity.py's CPU_SPEC) to well past any datasheet (B200: ~2.3e15
# dense BF16 FLOP/s, 8e12 B/s HBM3e, 1.9e11 bytes; NVLink 5: 1.8e12 B/s), 40x or more either side.
PLAUSIBLE = {
    "peak_flops_per_s": (1e9, 1e17, "989e12 for 989 TFLOP/s"),
    "hbm_bytes_per_s": (1e8, 1e15, "3.35e12 for 3.35 TB/s"),
    "memory_bytes": (1e8, 1e14, "80e9 for 80 GB"),
    "link_bytes_per_s": (1e6, 1e15, "450e9 for 450 GB/s"),
}


@dataclass(frozen=True)
class HardwareSpec:
    """One GPU. Peaks are datasheet numbers; the fractions turn them into achievable rates."""

    name: str
    peak_flops_per_s: float  # dense BF16 tensor-core FLOP/s (not the 2:4-sparsity figure)
    hbm_bytes_per_s: float  # device memory bandwidth
    memory_bytes: float  # device memory capacity as NVML reports it (see the presets)
    link_bytes_per_s: (
        float  # GPU-to-GPU bandwidth per direction (NVLink or PCIe), for TP all-reduce
    )
    # Assumption (not a published measurement): large bf16 GEMMs in cuBLAS/CUTLASS sustain about
    # 70% of the dense datasheet peak; decode adds small GEMMs and attention that do worse, which the
    # per-iteration overhead below partly absorbs. A measured profile (issue #7) replaces it.
    flops_fraction: float = 0.70
    # Assumption: streaming kernels (weight GEMV, paged KV reads) sustain about 80% of the datasheet
    # HBM bandwidth; STREAM-like copies get closer to 90% on H100 (third-party measurements we could
    # not verify first-hand). Fit from a measured profile (issue #7).
    bandwidth_fraction: float = 0.80
    # Training hardware FLOPs utilisation, recompute included: Llama 3 (arXiv 2407.21783, Table 4)
    # reports 38-43% BF16 MFU for 405B pre-training on H100s; we take 0.40 for FSDP actor updates.
    train_flops_fraction: float = 0.40
    # Assumption: fixed cost of one engine iteration with CUDA graphs (scheduling, sampling,
    # launch, host sync), ~1 ms; e.g. batch-1 decode of an 8B model on H100 runs at 6-7 ms/token
    # while its weights stream in ~5-6 ms at 80% bandwidth. Fit from a measured profile (issue #7).
    iter_overhead_s: float = 1.0e-3
    # Assumption: fixed cost of one drafter forward inside an SD iteration (graph replay + top-k).
    draft_step_overhead_s: float = 1.0e-4
    # Assumption: latency of one small intra-node all-reduce (NCCL / custom all-reduce), ~10 us.
    allreduce_latency_s: float = 1.0e-5

    def __post_init__(self) -> None:
        for field_name in (
            "peak_flops_per_s",
            "hbm_bytes_per_s",
            "memory_bytes",
            "link_bytes_per_s",
        ):
            # JSON's NaN and Infinity parse: a NaN bandwidth made every time NaN (or, inside
            # max(), silently dropped the memory term)
            value = getattr(self, field_name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(
                    f"HardwareSpec {self.name!r}: {field_name} must be > 0, got {value}"
                )
            low, high, example = PLAUSIBLE[field_name]
            if not low <= value <= high:  # a unit slip: 3.35 (TB/s) priced bytes per second
                raise ValueError(
                    f"HardwareSpec {self.name!r}: {field_name} {value:g} is outside "
                    f"[{low:g}, {high:g}], what any CPU core or GPU has (the unit is in the name: "
                    f"{example})"
                )
        for field_name in ("flops_fraction", "bandwidth_fraction", "train_flops_fraction"):
            if not 0 < getattr(self, field_name) <= 1:
                raise ValueError(f"HardwareSpec {self.name!r}: {field_name} must be in (0, 1]")
        for field_name in ("iter_overhead_s", "draft_step_overhead_s", "allreduce_latency_s"):
            value = getattr(self, field_name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(
                    f"HardwareSpec {self.name!r}: {field_name} must be >= 0, got {value}"
                )

    @property
    def achievable_flops_per_s(self) -> float:
        return self.peak_flops_per_s * self.flops_fraction

    @property
    def achievable_bytes_per_s(self) -> float:
        return self.hbm_bytes_per_s * self.bandwidth_fraction


# ---------------------------------------------------------------------------------------------
# Hardware presets: datasheet peaks. Dense BF16 = half the "with sparsity" datasheet figure.
# ---------------------------------------------------------------------------------------------

GB = 1e9
TB = 1e12

# memory_bytes is the capacity NVML reports (nvidia-smi's total, MiB), not the datasheet's
# marketing size: "80 GB" is 81,559 MiB = 85.5e9 bytes on an H100 (Modal, "Why does an NVIDIA
# H100 80GB card offer 85.52 GB?", thundergolfer.com/blog/nvidia-gpu-memory-capacity, lists
# H100 81,559, H200 143,771, A100 80GB 81,920, L40S 46,068 MiB; H20 97,871 MiB as nvidia-smi
# prints it in NVIDIA/nvtrust#128). vLLM's gpu_memory_utilization is a fraction of that total;
# the decimal datasheet figure understated KV capacity by ~7% on H100/H200/A100.
MIB = 2**20

HARDWARE_PRESETS: dict[str, HardwareSpec] = {
    # NVIDIA H100 Tensor Core GPU datasheet, SXM5 column: BF16 1,979 TFLOPS with sparsity (989.5
    # dense), HBM3 3.35 TB/s, 80 GB, NVLink 900 GB/s (bidirectional: 450 GB/s per direction).
    "H100-SXM": HardwareSpec(
        "H100-SXM",
        peak_flops_per_s=989.5 * TB,
        hbm_bytes_per_s=3.35 * TB,
        memory_bytes=81_559 * MIB,
        link_bytes_per_s=450 * GB,
    ),
    # NVIDIA H200 Tensor Core GPU datasheet, SXM column: BF16 1,979 TFLOPS with sparsity (989.5
    # dense), HBM3e 4.8 TB/s, 141 GB, NVLink 900 GB/s.
    "H200": HardwareSpec(
        "H200",
        peak_flops_per_s=989.5 * TB,
        hbm_bytes_per_s=4.8 * TB,
        memory_bytes=143_771 * MIB,
        link_bytes_per_s=450 * GB,
    ),
    # NVIDIA A100 Tensor Core GPU datasheet, 80GB SXM column: BF16 312 TFLOPS dense (624 with
    # sparsity), HBM2e 2,039 GB/s, 80 GB, NVLink 600 GB/s (300 GB/s per direction).
    "A100-80GB": HardwareSpec(
        "A100-80GB",
        peak_flops_per_s=312 * TB,
        hbm_bytes_per_s=2.039 * TB,
        memory_bytes=81_920 * MIB,
        link_bytes_per_s=300 * GB,
    ),
    # NVIDIA H20 (HGX H20 product brief; not a public datasheet, figures as widely reported):
    # BF16 148 TFLOPS dense (296 with sparsity), HBM3 4.0 TB/s, 96 GB, NVLink 900 GB/s.
    "H20": HardwareSpec(
        "H20",
        peak_flops_per_s=148 * TB,
        hbm_bytes_per_s=4.0 * TB,
        memory_bytes=97_871 * MIB,
        link_bytes_per_s=450 * GB,
    ),
    # NVIDIA L40S datasheet: BF16 362.05 TFLOPS dense (733 with sparsity), GDDR6 864 GB/s, 48 GB,
    # no NVLink: PCIe Gen4 x16, 64 GB/s bidirectional (32 GB/s per direction).
    "L40S": HardwareSpec(
        "L40S",
        peak_flops_per_s=362.05 * TB,
        hbm_bytes_per_s=0.864 * TB,
        memory_bytes=46_068 * MIB,
        link_bytes_per_s=32 * GB,
    ),
}


# The device names torch.cuda.get_device_name (NVML's name, as nvidia-smi prints it) gives for the
# exact variants of the presets above, so that a tltrun profile's sidecar ("hardware": that name)
# finds its preset. Other variants (H100 PCIe/NVL, A100 40GB or PCIe, H200 NVL) differ in bandwidth
# or memory and map to none: pass --hardware. Names: this project's H200 runs ("NVIDIA H200",
# benchmarks/RESULTS.md); the others as NVML reports them in the Modal post cited above and NVIDIA's
# nvtrust#128 (H20).
DEVICE_NAMES = {
    "NVIDIA H100 80GB HBM3": "H100-SXM",
    "NVIDIA H200": "H200",
    "NVIDIA A100-SXM4-80GB": "A100-80GB",
    "NVIDIA H20": "H20",
    "NVIDIA L40S": "L40S",
}


def preset_of_device(device_name: str) -> str | None:
    """The preset named ``device_name`` or the one whose exact variant it is (``DEVICE_NAMES``)."""
    if device_name in HARDWARE_PRESETS:
        return device_name
    return DEVICE_NAMES.get(" ".join(device_name.split()))


def get_hardware(name: str) -> HardwareSpec:
    if name not in HARDWARE_PRESETS:
        raise ValueError(
            f"unknown hardware preset {name!r}; expected one of {', '.join(HARDWARE_PRESETS)}"
        )
    return HARDWARE_PRESETS[name]


__all__ = [
    "DEVICE_NAMES",
    "GB",
    "HARDWARE_PRESETS",
    "MIB",
    "TB",
    "HardwareSpec",
    "get_hardware",
    "preset_of_device",
]
