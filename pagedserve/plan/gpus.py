"""Accelerator presets: memory, HBM bandwidth, dense bf16 and fp8 compute, GPU-GPU and host links.

`memory_bytes` is the total the driver reports where a log or nvidia-smi shows it (the number
`gpu_memory_utilization` multiplies, a little below the marketing capacity); where no such
figure was at hand it is the datasheet capacity, and the comment says so. Bandwidths are the
vendor's datasheet figures: HBM in GB/s, the GPU-GPU link as the aggregate bidirectional figure
the vendor publishes, the host link as one direction (PCIe x16, or NVLink-C2C on GH200).
TFLOP/s are dense (no sparsity); `fp8_tflops` is the fp8 tensor-core peak, 0 where the chip has
none (A100: vLLM runs fp8 checkpoints there as weight-only, computing in bf16). Every preset
names the datasheet it comes from (`source`).

Measured beside the datasheet, where a public measurement was at hand (0 = nobody measured it):
`matmul_*_tflops`, the max-achievable matmul (MAMF); `stream_tbps`, the HBM bandwidth a STREAM
Triad reaches (BabelStream, in Microsoft Azure's AI-benchmarking-guide, one VM per chip:
https://github.com/Azure/AI-benchmarking-guide/tree/main/Azure_Results). `runtime` says whose
graph runtime launches the step's kernels ("cuda" / "hip"): sim/cost_params.KERNEL_LAUNCH_S.
From the same guide's result files: `attention_tflops`, its FlashAttention-2 forward figure, set only where
FA2 is the kernel vLLM runs on that chip; `allreduce_busbw`, its nccl-tests / rccl-tests AllReduce bus
bandwidth by message size on the VM's 8 GPUs (`allreduce_gpus`), the sizes at or above 1 MiB.
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
    fp8_tflops: float = 0.0  # dense fp8 tensor-core peak; 0 = no fp8 tensor cores
    source: str = ""  # the datasheet the figures come from
    matmul_bf16_tflops: float = 0.0  # measured max-achievable bf16 matmul (MAMF); 0 = not measured
    matmul_fp8_tflops: float = 0.0   # measured max-achievable fp8 matmul; 0 = not measured
    stream_tbps: float = 0.0  # measured STREAM Triad HBM bandwidth, TB/s; 0 = not measured
    runtime: str = "cuda"     # "cuda" (CUDA graphs) or "hip" (HIP graphs): the per-kernel launch cost
    # measured prefill-attention rate, TFLOP/s, of the kernel vLLM runs on this chip; 0 = none at hand
    attention_tflops: float = 0.0
    # measured all-reduce bus bandwidth by message size ((bytes, GB/s), ...), on `allreduce_gpus` GPUs of one
    # node; () = not measured (the link's datasheet figure x link_efficiency prices every message)
    allreduce_busbw: tuple = ()
    allreduce_gpus: int = 0

    def to_dict(self) -> dict:
        return asdict(self)


_NV = "https://www.nvidia.com/en-us/data-center/"
_MiB = 2**20
# AllReduce bus bandwidth, GB/s, in-place, 1 MiB .. 8 GiB by powers of two (the result files' "1M" .. "8G" rows),
# 8 GPUs of one Azure VM (Azure/AI-benchmarking-guide, Azure_Results/<VM>_results.md, "NCCL Bandwidth" /
# "RCCL Bandwidth"). A100: ND A100 v4 (A100-SXM4-80GB, NCCL 2.18.5); H100: ND H100 v5 (NCCL 2.18.5); H200: ND
# H200 v5 (NCCL 2.20.5); MI300X: ND MI300X v5 (RCCL 2.22.3). The H100 and MI300X files are in the guide's forks
# yosoyjay/ and samuel-bohman/AI-benchmarking-guide.
_AR_SIZES = tuple(_MiB * 2**i for i in range(14))
_AR_A100 = tuple(zip(_AR_SIZES, (36.22, 53.54, 71.43, 89.99, 109.22, 132.77, 166.63, 174.18, 213.87, 221.58,
                                 228.10, 230.22, 230.48, 231.58)))
_AR_H100 = tuple(zip(_AR_SIZES, (43.70, 81.93, 128.73, 172.13, 234.45, 295.53, 361.78, 400.61, 423.38, 438.46,
                                 466.35, 472.36, 475.54, 478.87)))
_AR_H200 = tuple(zip(_AR_SIZES, (52.96, 88.78, 138.44, 181.94, 240.41, 300.91, 368.11, 412.45, 432.24, 442.72,
                                 467.58, 472.57, 477.41, 479.98)))
_AR_MI300X = tuple(zip(_AR_SIZES, (22.41, 43.41, 82.53, 131.57, 171.46, 230.35, 266.34, 290.81, 302.80, 308.89,
                                   313.92, 315.06, 314.85, 316.82)))
# FlashAttention-2 on A100-SXM4-80GB: 179.5 TFLOP/s (ND A100 v4, "Flash Attention 2.0": the first block of
# Dao-AILab's benchmarks/benchmark_flash_attention.py at batch 2 x 8,192 tokens, i.e. non-causal, head dim 64;
# the file does not say whether its figure is the forward or the forward + backward rate, and the guide's later
# script reports fwd + bwd). vLLM runs FA2 on Ampere (vllm-flash-attn; FA3 needs Hopper). As a prefill rate it
# is a floor on each count: FA2's forward outruns its backward, head dim 128 (Llama, Qwen) runs faster than 64
# (Dao 2023, figs. 4-6), and a chunk after a long prefix is mostly the non-causal rectangle. The 40 GB part has
# the same GA100 compute (312 TFLOP/s): the same figure. Not
# set elsewhere: the H100 / H200 files measure FA2 (327.9 / 329.3 TFLOP/s, head dim 128), but vLLM runs FA3 on
# Hopper; MI300X's (328.6, head dim 64) is the ROCm FA2 port, while vLLM-ROCm's default prefill kernel was its
# Triton one.
_FA2_A100 = 179.5
GPU_PRESETS: dict[str, GpuSpec] = {
    spec.name.lower(): spec
    for spec in [
        # STREAM not measured on the 40 GB part (HBM2 at 1,555 GB/s, not the 80 GB's HBM2e): stream_tbps 0
        GpuSpec("A100-40GB", 40960 * MiB, 1555, 312, 600, 32, 0, _NV + "a100/", matmul_bf16_tflops=271.2,
                attention_tflops=_FA2_A100),
        # CUDA reports 79.15 GiB total on A100-80GB in vLLM's start-up logs.
        # STREAM Triad 1.70 TB/s: Azure ND A100 v4 (A100-SXM4-80GB), Azure_Results/ND_A100_v4_results.md
        GpuSpec("A100-80GB", int(79.15 * GiB), 2039, 312, 600, 32, 0, _NV + "a100/", matmul_bf16_tflops=271.2,
                stream_tbps=1.70, attention_tflops=_FA2_A100, allreduce_busbw=_AR_A100, allreduce_gpus=8),
        # 79.22 GiB: vLLM's "total_gpu_memory" on H100 (vllm-project/vllm PR #10511).
        # STREAM Triad 2.97 TB/s: Azure ND H100 v5, Azure_Results/ND_H100_v5_results.md
        GpuSpec("H100-SXM", int(79.22 * GiB), 3350, 989, 900, 64, 1979, _NV + "h100/", matmul_bf16_tflops=794.5,
                matmul_fp8_tflops=1402.6, stream_tbps=2.97, allreduce_busbw=_AR_H100, allreduce_gpus=8),
        # MAMF bf16: "H200 is the same" as H100 (the table's note); fp8 measured on H200 itself
        # STREAM Triad 4.15 TB/s: Azure ND H200 v5, Azure_Results/ND_H200_v5_results.md
        GpuSpec("H200", 143771 * MiB, 4800, 989, 900, 64, 1979, _NV + "h200/", matmul_bf16_tflops=794.5,
                matmul_fp8_tflops=1453.4, stream_tbps=4.15, allreduce_busbw=_AR_H200, allreduce_gpus=8),
        # no NVLink: peers talk over PCIe 4.0
        GpuSpec("L40S", 46068 * MiB, 864, 362, 32, 32, 733, _NV + "l40s/"),
        GpuSpec("RTX-4090", 24564 * MiB, 1008, 165, 32, 32, 330,  # nvidia-smi: 24564MiB; fp8 w/ fp16 accumulate
                "https://images.nvidia.com/aem-dam/Solutions/geforce/ada/nvidia-ada-gpu-architecture.pdf"),
        # L4: 24 GB GDDR6 at 300 GB/s, bf16 121 / fp8 242.5 dense TFLOP/s, PCIe 4.0 x16, no NVLink.
        # 23034 MiB: nvidia-smi's total on an L4.
        GpuSpec("L4", 23034 * MiB, 300, 121, 32, 32, 242.5, _NV + "l4/"),
        # B200 (HGX/DGX B200): 180 GB HBM3e at 8 TB/s per GPU (DGX B200: 1,440 GB and 64 TB/s for
        # eight), bf16 2.25 / fp8 4.5 dense PFLOP/s, NVLink 5 1.8 TB/s, PCIe 5.0 x16.
        # Capacity: the datasheet's 180 GB (no driver figure at hand).
        GpuSpec("B200", 180 * 10**9, 8000, 2250, 1800, 64, 4500, _NV + "dgx-b200/", matmul_bf16_tflops=1745.0,
                matmul_fp8_tflops=3432.5),
        # GH200 (96 GB HBM3 version): 4 TB/s, H100's tensor cores (bf16 989 / fp8 1979 dense),
        # NVLink 900 GB/s to peers, and NVLink-C2C to the Grace CPU: 900 GB/s bidirectional, so
        # the host link (swap) is 450 GB/s one way. Capacity: the datasheet's 96 GB.
        # (MAMF measured on the 141 GB HBM3e GH200: the same Hopper tensor cores)
        GpuSpec("GH200", 96 * 10**9, 4000, 989, 900, 450, 1979, _NV + "grace-hopper-superchip/",
                matmul_bf16_tflops=828.6, matmul_fp8_tflops=1535.0),
        # MI300X: 192 GB HBM3 at 5.3 TB/s, bf16 1,307.4 / fp8 2,614.9 dense TFLOP/s, Infinity Fabric
        # 896 GB/s aggregate to its 7 peers, PCIe 5.0 x16. Capacity: the datasheet's 192 GB.
        # MAMF bf16 668.4 (ROCm 6.3, TunableOp on; 51% of the datasheet, against H100's 80%). fp8: 1,222.9 TFLOP/s,
        # hipBLASLt FP8 at 8192^3, random inputs, 10,000 warm-up iterations (Azure ND MI300X v5, "GEMM HipBLASLt";
        # the best of its nine shapes: 16384^3 1,081.4, 6144x12288x12288 1,148.7): a fixed-shape figure, not a
        # search over shapes as MAMF is, so if anything low.
        # STREAM Triad 4.10 TB/s (77% of 5.3, against H100's 89%): Azure ND MI300X v5,
        # Azure_Results/ND_MI300X_v5_results.md (the file as Azure's guide published it, stored in its forks
        # yosoyjay/AI-benchmarking-guide and samuel-bohman/AI-benchmarking-guide: 4.10 and 4.09).
        GpuSpec("MI300X", 192 * 10**9, 5300, 1307.4, 896, 64, 2614.9,
                "https://www.amd.com/en/products/accelerators/instinct/mi300/mi300x.html", matmul_bf16_tflops=668.4,
                matmul_fp8_tflops=1222.9, stream_tbps=4.10, runtime="hip", allreduce_busbw=_AR_MI300X,
                allreduce_gpus=8),
    ]
}

_ALIASES = {
    "a100": "a100-80gb", "a100-40g": "a100-40gb", "a100-80g": "a100-80gb", "a100-sxm-80gb": "a100-80gb",
    "h100": "h100-sxm", "h100-80gb": "h100-sxm", "h100-sxm5": "h100-sxm",
    "h200-141gb": "h200", "h200-sxm": "h200",
    "4090": "rtx-4090", "rtx4090": "rtx-4090", "rtx 4090": "rtx-4090",
    "l40s-48gb": "l40s",
    "l4-24gb": "l4", "nvidia-l4": "l4",
    "b200-180gb": "b200", "b200-sxm": "b200", "hgx-b200": "b200",
    "gh200-96gb": "gh200", "grace-hopper": "gh200",
    "mi300": "mi300x", "mi300x-192gb": "mi300x", "amd-mi300x": "mi300x",
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
