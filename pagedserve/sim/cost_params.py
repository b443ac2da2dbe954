"""Every constant of the step-cost model (CostParams), the device defaults with their sources,
and the KV dequantization default. Split out of cost_model.py; the model itself is described there."""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields

from pagedserve.sim.host_overhead import HostOverhead, default_host_overhead

# ---------------------------------------------------------------------------------------
# Default constants. Sources (numbers rounded, taken as typical rather than best case):
#  * GEMM MFU 0.6: large bf16 GEMMs reach ~600-700 of H100-SXM's 989 dense TFLOP/s in
#    cuBLAS; end-to-end prefill of 7-8B models in vLLM/TRT-LLM lands near 50-60 %.
#  * GEMM MBU 0.7: Databricks, "LLM Inference Performance Engineering: Best Practices"
#    (2023) measures ~60-70 % model bandwidth utilization for batch-1 decode on
#    A100/H100; a vLLM A100 sweep of Llama-3.1-8B (johnmusgrave.com, "vLLM
#    throughput-latency sweep on NVIDIA A100") reports 77 % of the memory roofline at C=1.
#  * attention MFU 0.4: FlashAttention-2 forward reaches 50-73 % of A100 peak and
#    ~35-50 % of H100 peak (Dao 2023; FlashAttention-3 paper, Shah et al. 2024, fig. 4).
#  * attention MBU 0.6: paged decode attention reads scattered 16-token blocks; vLLM's
#    paged-attention kernels run well below streaming bandwidth (Vidur, Agrawal et al.
#    MLSys 2024, profiles attention separately for this reason).
#  * link efficiency 0.7: NCCL all-reduce bus bandwidth on NVLink-4 H100 is ~360-480 GB/s
#    of 450 GB/s per direction for large messages; small messages are latency-bound,
#    hence ALLREDUCE_LATENCY_S (vLLM's custom all-reduce: a few microseconds).
#  * CPU overhead 2 ms/step + 20 us/request: vLLM's v0.6 performance blog ("vLLM v0.6.0:
#    2.7x throughput improvement", 2024) found CPU work (scheduling, input preparation,
#    detokenization) of a few ms per step before overlap; V1 overlaps part of it.
# ---------------------------------------------------------------------------------------
# The GEMM MFU above was stated on H100, whose best GEMM reaches 80% of its datasheet peak (794.5 of
# 989 bf16, 1402.6 of 1979 fp8 TFLOP/s: the measured max-achievable matmul, MAMF, in
# stas00/ml-engineering's table, plan/gpus.py). Other GPUs reach a different share of their own
# datasheet (A100 87%, B200 78%, MI300X 51%): their GEMMs run at the datasheet peak x
# (their MAMF share / H100's) x gemm_mfu, so the MFU keeps its meaning and a chip whose GEMMs
# cannot reach its datasheet is not priced as if they could (`matmul_share`).
REFERENCE_MATMUL_SHARE = {"bf16": 794.5 / 989, "fp8": 1402.6 / 1979}


def matmul_share(gpu, kind: str) -> float:
    """The GEMM peak factor of `gpu` for `kind` ("bf16" / "fp8"): its measured max-achievable matmul
    over its datasheet peak, relative to H100's (1.0 for H100 and for a GPU nobody measured). fp8
    not measured on a chip whose bf16 was: its bf16 share stands in (the same silicon and BLAS)."""
    bf16_mamf, bf16 = getattr(gpu, "matmul_bf16_tflops", 0.0), gpu.bf16_tflops
    bf16_share = bf16_mamf / bf16 / REFERENCE_MATMUL_SHARE["bf16"] if bf16_mamf and bf16 else 1.0
    if kind == "bf16":
        return bf16_share
    fp8_mamf, fp8 = getattr(gpu, "matmul_fp8_tflops", 0.0), getattr(gpu, "fp8_tflops", 0.0)
    return fp8_mamf / fp8 / REFERENCE_MATMUL_SHARE["fp8"] if fp8_mamf and fp8 else bf16_share


# The same for memory: the GEMM MBU 0.7 and attention MBU 0.6 above were stated on A100/H100, whose
# HBM a STREAM Triad drives at 2.97 of 3.35 TB/s on H100 SXM (89%; Azure ND H100 v5 in
# Azure/AI-benchmarking-guide, plan/gpus.py). A chip whose memory system reaches a different share of its
# datasheet (measured: A100-80GB 1.70 / 2.039 = 83%, H200 4.15 / 4.8 = 86%, MI300X 4.10 / 5.3 = 77%) reads its
# weights and KV at datasheet x (its STREAM share / H100's) x MBU (`mem_share`): the MBUs keep their meaning
# and a chip is not priced at a share of its datasheet its HBM never reaches. The weight GEMV and the
# decode attention take the same factor: no public per-chip measurement of either, beside STREAM, was at
# hand (the paged-decode figures found are H100-only: Dao-AILab/flash-attention#1572, FA3 with 8-token
# pages at batch 16, 1.23-1.85 TB/s = 37-55% of 3.35 at 128-4,000 tokens; microsoft/onnxruntime#21414,
# FA2 paged decode, 15-47% at 32-256 tokens, batch 64), so attention's MBU stays one stated figure scaled the same way.
REFERENCE_STREAM_SHARE = 2.97 / 3.35


def memory_share(gpu) -> float:
    """The HBM bandwidth factor of `gpu`: its measured STREAM Triad over its datasheet bandwidth, relative
    to H100's (1.0 for H100 and for a GPU nobody measured)."""
    stream, datasheet = getattr(gpu, "stream_tbps", 0.0), gpu.hbm_bandwidth_gbps
    if not stream or not datasheet:
        return 1.0
    return stream / (datasheet / 1000) / REFERENCE_STREAM_SHARE


# The step's kernel launches. A decode step of vLLM runs as one CUDA graph (HIP graph on ROCm) of ~10
# kernels per decoder layer (step_work.kernel_count); between two kernels of a graph the GPU does no
# useful work for the launch and the next kernel's ramp-up. Measured on H100: about 1.3 us of launch cost
# per kernel even with CUDA graphs (Hazy Research, "Look Ma, No Bubbles! Designing a Low-Latency
# Megakernel for Llama-1B", 2025-05-27, https://hazyresearch.stanford.edu/blog/2025-05-27-no-bubbles, as
# summarised at https://mlops.substack.com/p/one-megakernel-to-rule-llama-1b; the same post finds vLLM and
# SGLang using at most 50% of H100's bandwidth on Llama-1B at batch 1, for this reason). HIP graphs:
# 3.865 us per node over a 941-node graph of one-block kernels (ROCm/rocm-systems#10834, ROCm 7.x on
# gfx1100, RDNA3): the only public HIP-graph per-node figure at hand; CDNA3 (MI300X) runs the same HIP
# runtime (CLR) and AQL dispatch, but was not measured. The cost is added per kernel, times the kernels
# a step launches (`kernel_launch_s` x ModelCost.kernels_per_step), for every step: prefills launch the
# same kernels (eagerly, where a CPU launch of ~3 us hides behind long kernels: a lower bound).
# Where a kernel profile prices the kernels' own durations (KERNEL_PROFILES below: CUPTI durations, which hold
# neither the launch nor the gap before the kernel), this stays the gap between them. Whether Hazy's 1.3 us
# also holds part of what CUPTI counts as the kernel's ramp (its "setup and teardown") was not measured
# apart: if so, up to 1.3 us a kernel is counted twice there.
KERNEL_LAUNCH_S = {"cuda": 1.3e-6, "hip": 3.865e-6}

# How long the engine must have sat idle for its next steps to count as warming up (CostParams.warmup_factors).
# On the 2-core AMD EPYC VM (sim_vs_real's traces, 2026-12-05) the decode steps right after gaps over 20 ms ran
# 1.04-1.45x the steps back to back; the gaps the engine leaves between steps with work are ~0.2 ms.
WARMUP_IDLE_S = 0.02

# Kernel profiles: the chip's GEMMs and the layer's other kernels as measured, where a public per-kernel profile
# exists. Source: Vidur (Agrawal et al., MLSys 2024), https://github.com/microsoft/vidur, files
# data/profiling/compute/{h100,a100}/<org>/<model>/mlp.csv (commit 7d47513, 2024-11-19): CUDA kernel durations
# (torch profiler, CUPTI: the kernel's own run, not the gap before it) of one decoder layer of sarathi-serve's
# fp16 layers, at 1..4,096 tokens and TP 1/2/4/8, for Llama-2-7B/70B, CodeLlama-34B, InternLM-20B, Qwen-72B
# (and Llama-3-8B/70B on A100); Vidur's device configs say A100 80GB and H100 80GB (DGX: SXM). Derived
# figures only (benchmarks/sim_kernel_check.py --derive re-derives every one from the CSVs; phi-2 is left out:
# a GELU MLP):
#  * GEMMs (QKV, O, gate/up, down; per-layer sums at 21 token counts 1..4,096, every model and TP degree):
#    each GEMM kernel takes kernel_s + (t_c^p + t_m^p)^(1/p), t_c = FLOPs / tflops, t_m = weight bytes / tbps.
#    tbps and kernel_s: least squares of the 4-GEMM layer time on its weight bytes at 1 token (a GEMV streams
#    its weights at tbps after a fixed ramp; small TP shards reach less of the bandwidth for that reason:
#    H100 Llama-2-7B at TP 8 1.74 TB/s, Llama-2-70B at TP 1 2.89); tflops: the median FLOP rate at >= 2,048
#    tokens; p: the one exponent that best fits log(model / measured) over both chips' points (1.6; max() is
#    p = infinity and prices the ridge, 128-512 tokens, up to 1.6x fast). Residual: median |error| 3-4% a chip.
#    fp8 weights keep the stated roofline (no fp8 kernel in the profiles); vLLM's fused-MoE (Triton) expert
#    GEMMs were not profiled either: the cuBLAS curve stands in for them.
#  * Elementwise kernels, per kind: [floor_s, row_bps, bps]: a kernel over `rows` rows of `row` bytes takes
#    max(floor_s + row / row_bps, rows x row / bps). These kernels (sarathi's rms_norm, rotary_embedding,
#    silu_and_mul are vLLM's csrc kernels) run one thread block per row, so below a wave of blocks the time
#    is one block streaming its row (floor_s + row / row_bps: least squares at <= 8 tokens, every model and
#    TP); above it the whole tensor streams at bps (median at >= 2,048 tokens). Bytes a row, from the shapes:
#    norm 2 x hidden (read, write), rope 2 x (q + k heads per rank) x head_dim (in place), act 3 x
#    intermediate per rank (gate and up read, product written), add 3 x hidden, emb 2 x hidden; x 2 bytes.
KERNEL_PROFILES = {
    "H100-SXM": {
        "gemm": {"tflops": 716.0e12, "tbps": 2.982e12, "kernel_s": 3.98e-6, "exponent": 1.6},
        "elementwise": {"norm": [1.79e-6, 7.81e9, 1.11e12], "rope": [1.32e-6, 10.5e9, 1.56e12],
                        "act": [0.461e-6, 11.6e9, 1.88e12], "add": [0.385e-6, 40.7e9, 3.25e12],
                        "emb": [3.5e-6, 0.0, 0.547e12]},
    },
    "A100-80GB": {
        "gemm": {"tflops": 229.7e12, "tbps": 1.627e12, "kernel_s": 4.32e-6, "exponent": 1.6},
        "elementwise": {"norm": [1.26e-6, 5.46e9, 0.689e12], "rope": [1.91e-6, 7.92e9, 0.866e12],
                        "act": [0.666e-6, 8.03e9, 1.01e12], "add": [1.85e-6, 320e9, 1.80e12],
                        "emb": [4.5e-6, 0.0, 0.300e12]},
    },
}
# H200: the H100's silicon (the same GH100 die, clocks and tensor cores: "H200 is the same" in the MAMF table,
# plan/gpus.py) with HBM3e. Nobody profiled its kernels; its profile is H100's with every bandwidth figure
# (the GEMMs' weight read, the elementwise kernels' streaming rate) scaled by the two chips' measured STREAM
# Triad ratio (4.15 / 2.97 TB/s, plan/gpus.py: Azure ND H200 v5 / ND H100 v5), and every compute, floor and
# per-row figure kept: a one-block row kernel and a GEMM's ramp are the SM's, not the memory's.
_H200_OVER_H100_STREAM = 4.15 / 2.97


def _scaled_profile(profile: dict, memory_ratio: float) -> dict:
    gemm = dict(profile["gemm"], tbps=profile["gemm"]["tbps"] * memory_ratio)
    elementwise = {kind: [floor_s, row_bps, bps * memory_ratio]
                   for kind, (floor_s, row_bps, bps) in profile["elementwise"].items()}
    return {"gemm": gemm, "elementwise": elementwise, "derived_from": "H100-SXM"}


KERNEL_PROFILES["H200"] = _scaled_profile(KERNEL_PROFILES["H100-SXM"], _H200_OVER_H100_STREAM)
# What vLLM runs, priced with those kinds (step_work.elementwise_kernels lists a step's): per layer two fused
# residual-add + RMSNorm kernels ("add_norm": vLLM's fused_add_rms_norm does the work of sarathi's rms_norm
# and its residual add in one launch, so its time is the norm's plus the add's bytes at the add's rate, with
# the norm's floor only), rotary on q and k, SiLU-and-mul; once a step the embedding and the final norm.
# Not profiled, so not priced here beyond their launch: the KV-cache write, the sampler, Qwen3's q/k norms.
ELEMENTWISE_BYTES_PER_WIDTH = {"norm": 2, "rope": 2, "act": 3, "add": 3, "emb": 2}


def elementwise_seconds(figures: dict, kind: str, rows: float, width_bytes: float) -> float:
    """One elementwise kernel of `kind` over `rows` rows of `width_bytes` (the row's tensor width in bytes:
    hidden x act bytes for a norm, ...) priced from the chip's measured figures (KERNEL_PROFILES)."""
    if kind == "add_norm":
        return (elementwise_seconds(figures, "norm", rows, width_bytes)
                + rows * ELEMENTWISE_BYTES_PER_WIDTH["add"] * width_bytes / figures["add"][2])
    floor_s, row_bps, bps = figures[kind]
    row = ELEMENTWISE_BYTES_PER_WIDTH[kind] * width_bytes
    return max(floor_s + (row / row_bps if row_bps else 0.0), rows * row / bps)


def soft_roofline(compute_s: float, memory_s: float, exponent: float) -> float:
    """Compute and memory time combined as a p-norm: max() when exponent is 0 (the plain roofline)."""
    if not exponent:
        return max(compute_s, memory_s)
    if compute_s <= 0.0 or memory_s <= 0.0:
        return compute_s + memory_s
    return (compute_s ** exponent + memory_s ** exponent) ** (1.0 / exponent)


# All-reduces at or above vLLM's custom all-reduce limit go to NCCL / RCCL: the custom kernel (one-shot /
# two-shot over peer buffers) takes a message only while it is smaller than `max_size`, 8 MiB by default
# (vllm/distributed/device_communicators/custom_all_reduce.py: max_size=8192 * 1024, `inp_size < max_size`).
# Those messages are priced from the chip's measured nccl-tests / rccl-tests bus bandwidth at that size
# (GpuSpec.allreduce_busbw, measured on 8 GPUs: used only at TP 8), interpolated log-log between the measured
# sizes; a smaller message keeps the custom kernel's latency + link bandwidth (ALLREDUCE_LATENCY_S, below),
# as does any chip or TP degree nobody measured. nccl-tests times each call with its own launch, which a
# large message hides (an 8 MiB all-reduce on 8 MI300X takes ~112 us at 131.6 GB/s bus bandwidth). The custom
# kernel runs on MI300X too: AMD's vLLM fork from May 2024 (ROCm/vllm#27), upstream from vllm-project/vllm#14125.
CUSTOM_ALLREDUCE_MAX_BYTES = 8 * 2**20


def busbw_at(table, nbytes: float) -> float:
    """Bus bandwidth (bytes/s) at message size `nbytes` from a measured ((bytes, GB/s), ...) table: log-log
    interpolation between the measured sizes, the end figures beyond them."""
    pts = sorted((float(b), float(g) * 1e9) for b, g in table)
    if nbytes <= pts[0][0]:
        return pts[0][1]
    for (b0, g0), (b1, g1) in zip(pts, pts[1:]):
        if nbytes <= b1:
            w = math.log(nbytes / b0) / math.log(b1 / b0)
            return math.exp(math.log(g0) + w * math.log(g1 / g0))
    return pts[-1][1]


def allreduce_seconds(params: "CostParams", tp: int, nbytes: float, inv_link: float) -> float:
    """One all-reduce of `nbytes` over `tp` ranks: a ring's 2 (tp-1)/tp of the data over the link
    (`inv_link`: seconds per byte) plus the fixed latency; at or above the custom all-reduce limit, on a chip
    and TP degree with a measured NCCL/RCCL curve, that curve's bus bandwidth at this size instead."""
    if tp <= 1 or nbytes <= 0:
        return 0.0
    ring = 2 * (tp - 1) / tp * nbytes
    if (params.allreduce_busbw and tp == params.allreduce_busbw_gpus
            and nbytes >= params.custom_allreduce_max_bytes):
        return ring / busbw_at(params.allreduce_busbw, nbytes)
    return ring * inv_link + params.allreduce_latency_s


GPU_EFFICIENCY = {
    "gemm_mfu": 0.6, "gemm_mbu": 0.7, "attn_mfu": 0.4, "attn_mbu": 0.6,
    "link_efficiency": 0.7, "host_link_efficiency": 0.8,
}
ALLREDUCE_LATENCY_S = 8e-6
STEP_OVERHEAD_S = 2e-3
PER_REQUEST_OVERHEAD_S = 20e-6

# On a CPU there is no datasheet roofline worth trusting: the nominal peaks below only
# set the scale, and `calibrate` fits the efficiencies against them.
CPU_NOMINAL_FLOPS = 1e12
CPU_NOMINAL_BANDWIDTH = 1e11

# Dequantizing one K/V value: a convert and a multiply by its scale, on the GPU's vector units
# (not its tensor cores): H100-SXM does 67 TFLOP/s of fp32 vector work against 989 of dense
# bf16 tensor work (NVIDIA H100 datasheet), about 1/15, at the attention kernel's efficiency.
KV_DEQUANT_OPS_PER_VALUE = 2.0
VECTOR_SHARE_OF_PEAK_FLOPS = 1.0 / 15


def default_kv_dequant_s_per_value(peak_flops: float, attn_mfu: float) -> float:
    """Seconds to dequantize one K/V value when no measured figure is given."""
    rate = peak_flops * VECTOR_SHARE_OF_PEAK_FLOPS * attn_mfu
    return KV_DEQUANT_OPS_PER_VALUE / rate if rate > 0 else 0.0


@dataclass
class CostParams:
    """Every constant of the model. JSON round-trips through to_dict / from_dict."""

    peak_flops: float              # FLOP/s of one device (dense bf16)
    mem_bandwidth: float           # bytes/s of one device
    # FLOP/s of the device's fp8 tensor cores (dense); 0 = none. GEMMs of fp8 weights run at it
    # (vLLM's fp8 W8A8 path on Hopper/Ada/Blackwell/MI300); without it they compute in bf16.
    fp8_peak_flops: float = 0.0
    # The GEMMs run at peak x share x gemm_mfu (fp8 weights: fp8_peak_flops x fp8_matmul_share): a GPU
    # preset sets matmul_share(gpu, ...), the chip's measured max-achievable matmul relative to H100's
    # (attention keeps the datasheet peak: its efficiency is stated against it). 1 = the datasheet.
    matmul_share: float = 1.0
    fp8_matmul_share: float = 1.0
    # The weight and KV reads run at mem_bandwidth x mem_share x MBU: a GPU preset sets memory_share(gpu), the
    # chip's measured STREAM share of its datasheet relative to H100's. 1 = the datasheet as stated.
    mem_share: float = 1.0
    # Idle GPU time per kernel the step launches (KERNEL_LAUNCH_S, x ModelCost.kernels_per_step); 0 = not
    # modelled (a calibrated model: its fitted per-step constant holds it).
    kernel_launch_s: float = 0.0
    # The chip's measured GEMM curve (KERNEL_PROFILES[...]["gemm"]: tflops, tbps, kernel_s, exponent): bf16/fp16
    # GEMMs then take kernel_s each + the p-norm of their compute and weight-read times; empty = the stated
    # roofline above (peak x share x gemm_mfu, bandwidth x mem_share x gemm_mbu, max()).
    gemm_curve: dict = field(default_factory=dict)
    # The chip's measured elementwise kernels (KERNEL_PROFILES[...]["elementwise"]: kind -> [floor_s, row_bps,
    # bps]): the norms, rotary, activation and embedding of every step priced from them; empty = not priced.
    elementwise: dict = field(default_factory=dict)
    # The chip's measured NCCL/RCCL all-reduce bus bandwidth by message size ([[bytes, GB/s], ...]) on
    # `allreduce_busbw_gpus` GPUs; messages at or above `custom_allreduce_max_bytes` run there (allreduce_seconds).
    # Empty: every all-reduce at link_bandwidth x link_efficiency + allreduce_latency_s.
    allreduce_busbw: list = field(default_factory=list)
    allreduce_busbw_gpus: int = 0
    custom_allreduce_max_bytes: float = CUSTOM_ALLREDUCE_MAX_BYTES
    gemm_mfu: float = GPU_EFFICIENCY["gemm_mfu"]
    gemm_mbu: float = GPU_EFFICIENCY["gemm_mbu"]
    attn_mfu: float = GPU_EFFICIENCY["attn_mfu"]
    attn_mbu: float = GPU_EFFICIENCY["attn_mbu"]
    link_bandwidth: float = 0.0    # bytes/s GPU-GPU, one direction
    link_efficiency: float = GPU_EFFICIENCY["link_efficiency"]
    allreduce_latency_s: float = ALLREDUCE_LATENCY_S
    host_bandwidth: float = 0.0    # bytes/s GPU-host, one direction
    host_link_efficiency: float = GPU_EFFICIENCY["host_link_efficiency"]
    step_overhead_s: float = STEP_OVERHEAD_S
    per_request_overhead_s: float = PER_REQUEST_OVERHEAD_S
    per_prefill_overhead_s: float = 0.0  # per prompt chunk: backends that launch attention per chunk
    # per scheduled token: the host's input preparation (positions, slot mappings) grows with it
    per_token_overhead_s: float = 0.0
    # per step that swaps: launching the block copies (index_select / cudaMemcpyAsync per block
    # batch) costs a fixed time beside the bytes over the host link
    swap_step_overhead_s: float = 0.0
    # per token sampled: in a server the HTTP loop detokenizes and streams each one, and on a
    # CPU with one interpreter that work holds the engine back (fitted from the wall clock)
    per_output_overhead_s: float = 0.0
    # How the attention backend lays a step out. "paged": work follows each request's own
    # context (FlashAttention / paged-attention kernels, vLLM on GPU). "padded": pagedserve's
    # torch reference backend (CPU): decodes are padded to the longest decode context in the
    # step, and a chunk after a cached prefix computes its full chunk x context rectangle.
    # attention_pad_share, when set, says it in a number (the share of that padding paid).
    attention_layout: str = "paged"
    attention_pad_share: float | None = None
    combine: str = "max"           # "max": roofline (GPU); "sum": compute + memory time (CPU)
    # Measured step time / model, by the step's token count (small counts only). A CPU
    # picks GEMM kernels by shape: here 3 decode rows took 20% longer than 4. Vidur
    # profiles every batch size for the same reason; `fit` fills this from the trace.
    token_count_factors: dict = field(default_factory=dict)
    # A CPU engine's first steps after an idle spell of at least warmup_idle_s run slower than the same
    # steps back to back (caches, the OpenMP team, the core's clock): warmup_factors[k - 1] is the measured /
    # modelled time of the k-th step after such a spell (`fit` fills it from the trace; empty: none).
    warmup_factors: list = field(default_factory=list)
    warmup_idle_s: float = WARMUP_IDLE_S
    # Seconds per K/V value a quantized cache's reads spend decoding (None: the GPU default,
    # default_kv_dequant_s_per_value; on a CPU, benchmarks/kv_cache_dtype.py measures it).
    kv_dequant_s_per_value: float | None = None
    # The serving layer's own time (ServingOverhead.to_dict()); empty = not modelled.
    serving: dict = field(default_factory=dict)
    # The host's per-step work (the *_overhead_s terms) overlaps the device's: the engine schedules
    # step n+1 while the device runs step n (vLLM's async scheduling, on by default since 0.14), so a
    # step takes max(device, host) rather than their sum (sim/executor.py).
    host_overlap: bool = False
    # How far the calibration trace's steps landed from the model (measured - modelled seconds, as
    # quantiles); the simulator adds one drawn at random to each step (floored at 0). Empty: every
    # step takes its modelled time. `simulate calibrate --from-bench` fills it: a client's ITL and
    # TTFT tails on a shared CPU come from that scatter as much as from the step shapes.
    step_residuals_s: list = field(default_factory=list)
    # The shapes the calibration trace held (simulate warns when a run goes beyond them).
    coverage: dict = field(default_factory=dict)
    source: str = "defaults"

    @property
    def pad_share(self) -> float:
        if self.attention_pad_share is not None:
            return self.attention_pad_share
        return 1.0 if self.attention_layout == "padded" else 0.0

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "CostParams":
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})

    @classmethod
    def for_gpu(cls, gpu, host: "HostOverhead | None" = None, serving_overhead: bool = True) -> "CostParams":
        """Defaults for a `pagedserve.plan.gpus.GpuSpec` (datasheet peaks x the chip's measured matmul and
        STREAM shares relative to H100's x stated efficiencies, and its runtime's per-kernel launch cost),
        with the host CPU's share of every step and of every request (`HostOverhead`: measured on
        pagedserve's own front-end and engine, scaled to the host). `serving_overhead=False`
        leaves the serving layer out (the step's CPU terms stay): only when asked for.

        The NVLink figure in the presets is aggregate bidirectional: one direction is half."""
        host = host or default_host_overhead()
        params = cls(peak_flops=gpu.bf16_tflops * 1e12, mem_bandwidth=gpu.hbm_bandwidth_gbps * 1e9,
                     fp8_peak_flops=getattr(gpu, "fp8_tflops", 0.0) * 1e12,
                     matmul_share=matmul_share(gpu, "bf16"), fp8_matmul_share=matmul_share(gpu, "fp8"),
                     mem_share=memory_share(gpu), kernel_launch_s=KERNEL_LAUNCH_S[getattr(gpu, "runtime", "cuda")],
                     link_bandwidth=gpu.gpu_link_gbps * 1e9 / 2, host_bandwidth=gpu.host_link_gbps * 1e9,
                     allreduce_busbw=[list(p) for p in getattr(gpu, "allreduce_busbw", ())],
                     allreduce_busbw_gpus=getattr(gpu, "allreduce_gpus", 0),
                     source=f"defaults for {gpu.name}")
        # the chip's GEMMs and elementwise kernels as a public kernel profile measured them (KERNEL_PROFILES);
        # a chip nobody profiled keeps the stated roofline and prices no elementwise kernel
        profile = KERNEL_PROFILES.get(gpu.name, {})
        params.gemm_curve = dict(profile.get("gemm", {}))
        params.elementwise = {k: list(v) for k, v in profile.get("elementwise", {}).items()}
        # prefill attention at the measured rate of the kernel vLLM runs on the chip, where one was measured
        # (plan/gpus.py: FA2 on A100); elsewhere the stated attn_mfu of the datasheet peak
        attention = getattr(gpu, "attention_tflops", 0.0)
        if attention and gpu.bf16_tflops:
            params.attn_mfu = attention / gpu.bf16_tflops
        host.apply(params, serving=serving_overhead)
        return params
