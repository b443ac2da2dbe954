"""Accelerator presets: memory, HBM bandwidth, dense bf16 compute, GPU-GPU and host links.

`memory_bytes` is the total the driver reports (nvidia-smi's MiB figure, or CUDA's
`mem_get_info` total where a vLLM log shows it) - the number `gpu_memory_utilization`
multiplies - which is a little below the marketing capacity. Bandwidths are the vendor's
datasheet figures: HBM in GB/s, NVLink as the aggregate bidirectional figure NVIDIA
publishes, host link as one direction of PCIe x16. TFLOP/s are dense (no sparsity).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

GiB = 2**30
MiB = 2**20


@dataclass(frozen=True)
class GpuSpec:
    name: str
    memory_bytes: int
    hbm_bandwidth_gbps: float  # GB/s (10^9 bytes/s)
    bf16_tflops: float  # dense
    gpu_link_gbps: float  # GPU-GPU (NVLink aggregate, or PCIe when there is none)
    host_link_gbps: float  # GPU-host, one direction

    def to_dict(self) -> dict:
        return asdict(self)


GPU_PRESETS: dict[str, GpuSpec] = {
    spec.name.lower(): spec
    for spec in [
        GpuSpec("A100-40GB", 40960 * MiB, 1555, 312, 600, 32),
        # CUDA reports 79.15 GiB total on A100-80GB in vLLM's start-up logs.
        GpuSpec("A100-80GB", int(79.15 * GiB), 2039, 312, 600, 32),
        # 79.22 GiB: vLLM's "total_gpu_memory" on H100 (vllm-project/vllm PR #10511).
        GpuSpec("H100-SXM", int(79.22 * GiB), 3350, 989, 900, 64),
        GpuSpec("H200", 143771 * MiB, 4800, 989, 900, 64),
        GpuSpec("L40S", 46068 * MiB, 864, 362, 32, 32),  # no NVLink: peers talk over PCIe 4.0
        GpuSpec("RTX-4090", 24564 * MiB, 1008, 165, 32, 32),  # nvidia-smi: 24564MiB
    ]
}

_ALIASES = {
    "a100": "a100-80gb", "a100-40g": "a100-40gb", "a100-80g": "a100-80gb", "a100-sxm-80gb": "a100-80gb",
    "h100": "h100-sxm", "h100-80gb": "h100-sxm", "h100-sxm5": "h100-sxm",
    "h200-141gb": "h200", "h200-sxm": "h200",
    "4090": "rtx-4090", "rtx4090": "rtx-4090", "rtx 4090": "rtx-4090",
    "l40s-48gb": "l40s",
}


def gpu_names() -> list[str]:
    return [spec.name for spec in GPU_PRESETS.values()]


def get_gpu(name: str) -> GpuSpec:
    key = name.strip().lower().replace("_", "-")
    key = _ALIASES.get(key, key)
    try:
        return GPU_PRESETS[key]
    except KeyError:
        raise ValueError(f"unknown GPU {name!r}; presets: {', '.join(gpu_names())} "
                         "(or give --gpu-memory 24GiB)") from None


def custom_gpu(memory_bytes: int, name: str = "custom") -> GpuSpec:
    """Any device given only by its memory; bandwidth and compute are unknown (0)."""
    return GpuSpec(name, memory_bytes, 0.0, 0.0, 0.0, 0.0)
