"""Step-time cost model: how long one engine step takes, from its SchedulerOutput alone.

A step is split into parts, each timed as a roofline
``max(flops / (peak_flops x MFU), bytes / (bandwidth x MBU))``:

* **linear** (every GEMM: QKV, O, gate/up/down, and the LM head for the scheduled
  requests): FLOPs = 2 x linear params / TP x tokens; bytes = the weights, read once
  per step, / TP. Small steps are memory-bound, big prefills compute-bound.
* **attention**, per request from its context: a request computing ``n`` new tokens
  after ``s`` cached ones attends ``n*s + n(n+1)/2`` query-key pairs, each
  ``4 x head_dim`` FLOPs (QK^T and PV) per query head per layer; it reads its whole KV
  (``context x kv_bytes_per_token``). The KV read is the term that dominates
  long-context decode.

plus terms with no roofline:

* **all-reduce** under TP: two per layer (after attention and after the MLP) of
  ``tokens x hidden x act_bytes``; a ring moves ``2 (tp-1)/tp`` of it over the GPU link,
  plus a fixed latency per all-reduce;
* **CPU overhead**: a fixed cost per step, a cost per scheduled request (input
  preparation, sampling, detokenization) and one per prompt chunk (backends that launch
  attention chunk by chunk);
* **swap**: blocks moved to / from the host pool over the host link;
* **KV dequantization** (a quantized `kv_cache_dtype`: fp8 / int8): every K/V value attention
  reads is decoded and scaled, ``values read x kv_dequant_s_per_value``. The quantized cache's
  smaller bytes per token already shrink the attention read and the swap terms; this term is
  the compute it costs in exchange, kept separate and added to the step.

Attention work is counted as a paged kernel does it (each request's own context: the
decode term grows with the batch's total context, the GEMM term with the batch size), plus
the extra work a padded backend adds (pagedserve's torch reference backend on CPU pads
decodes to the longest decode context of the step and computes a chunk-after-prefix's
whole rectangle), paid at `attention_pad_share` (1 = padded backend, 0 = a paged kernel such
as FlashAttention or a C++ CPU kernel; `calibrate` fits it, so one model serves either).

How a part's compute and memory times combine (`CostParams.combine`): "max" is the
roofline (a GPU overlaps them, the slower wins), "sum" adds them (a CPU kernel mostly does
one, then the other; the GEMM's weight read is then part of the per-step constant).

Default efficiencies are stated in `GPU_EFFICIENCY` with their sources. `fit` (the
`calibrate` command) instead fits every constant by least squares to step timings the
real engine logged (EngineConfig.step_trace_path), so the same model describes this
CPU or a user's GPU. `fit_serving` fits the serving layer's own time per request and per
streamed token (`ServingOverhead`) from the server's request trace.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Iterable, Sequence

from pagedserve.core.engine_core import StepTrace
from pagedserve.plan.kv_budget import QUANTIZED_KV_DTYPES, ModelShape, dtype_bytes, kv_bytes_per_token, kv_scale_bytes
from pagedserve.plan.models import param_breakdown
from pagedserve.sim.host_overhead import HostOverhead, ServingOverhead, default_host_overhead

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
    # Seconds per K/V value a quantized cache's reads spend decoding (None: the GPU default,
    # default_kv_dequant_s_per_value; on a CPU, benchmarks/kv_cache_dtype.py measures it).
    kv_dequant_s_per_value: float | None = None
    # The serving layer's own time (ServingOverhead.to_dict()); empty = not modelled.
    serving: dict = field(default_factory=dict)
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
        """Defaults for a `pagedserve.plan.gpus.GpuSpec` (datasheet peaks x stated efficiencies),
        with the host CPU's share of every step and of every request (`HostOverhead`: measured on
        pagedserve's own front-end and engine, scaled to the host). `serving_overhead=False`
        leaves the serving layer out (the step's CPU terms stay): only when asked for.

        The NVLink figure in the presets is aggregate bidirectional: one direction is half."""
        host = host or default_host_overhead()
        params = cls(peak_flops=gpu.bf16_tflops * 1e12, mem_bandwidth=gpu.hbm_bandwidth_gbps * 1e9,
                     fp8_peak_flops=getattr(gpu, "fp8_tflops", 0.0) * 1e12,
                     link_bandwidth=gpu.gpu_link_gbps * 1e9 / 2, host_bandwidth=gpu.host_link_gbps * 1e9,
                     source=f"defaults for {gpu.name}")
        host.apply(params, serving=serving_overhead)
        return params


@dataclass(frozen=True)
class ModelCost:
    """Per-token and per-step quantities of one model on one TP rank."""

    num_layers: int
    hidden_size: int
    q_heads_per_rank: int
    head_dim: int
    linear_params_per_rank: float   # decoder linear layers / TP (no embedding, no LM head)
    lm_head_params_per_rank: float  # hidden x vocab / TP (vocab-parallel head)
    weight_bytes_per_rank: float    # what one step reads: linear layers + LM head
    kv_bytes_per_token: int         # one rank's share
    act_bytes: float
    tp: int
    kv_values_per_token: int = 0    # K/V values per token a read must dequantize (0: a plain cache)
    weight_bytes_per_param: float = 2.0  # 1: fp8/int8 weights (fp8 tensor cores where the device has them)

    @classmethod
    def from_shape(cls, shape: ModelShape, weight_dtype: str = "bfloat16", kv_dtype: str | None = None,
                   tp: int = 1) -> "ModelCost":
        parts = param_breakdown(shape)
        w = dtype_bytes(weight_dtype)
        act = 4 if w == 4 else 2
        kv = dtype_bytes(kv_dtype) if kv_dtype else act
        quantized = kv_dtype in QUANTIZED_KV_DTYPES
        linear = (parts["attention"] + parts["mlp"]) / tp
        if shape.is_moe:  # a token only visits its experts; weights read are (close to) all of them
            routed = 3 * shape.hidden_size * shape.moe_intermediate_size
            moe_layers = shape.num_layers - shape.first_dense_layers
            active = parts["mlp"] - moe_layers * routed * (shape.num_experts - shape.num_experts_per_tok)
            linear_flop_params = (parts["attention"] + active) / tp
        else:
            linear_flop_params = linear
        lm_head = shape.hidden_size * shape.vocab_size / tp
        heads = max(1, shape.num_attention_heads // tp)
        head_dim = shape.head_dim
        if shape.is_mla:  # attention computed in the latent: (kv_lora_rank + rope) wide keys
            head_dim = (shape.kv_lora_rank or 0) + (shape.qk_rope_head_dim or 0)
        return cls(
            num_layers=shape.num_layers, hidden_size=shape.hidden_size, q_heads_per_rank=heads,
            head_dim=head_dim, linear_params_per_rank=linear_flop_params, lm_head_params_per_rank=lm_head,
            weight_bytes_per_rank=(linear + lm_head) * w,
            kv_bytes_per_token=kv_bytes_per_token(shape, kv, tp, kv_scale_bytes(kv_dtype) if kv_dtype else 0),
            act_bytes=act, tp=tp,
            kv_values_per_token=kv_bytes_per_token(shape, 1, tp) if quantized else 0,
            weight_bytes_per_param=w,
        )


@dataclass
class StepFeatures:
    """The work of one step. Attention is counted as a paged kernel does it (`attn_*`); what a
    padded backend adds on top is kept apart (`attn_pad_*`), paid at the model's pad share."""

    num_tokens: int
    num_reqs: int
    num_prefills: int
    linear_flops: float
    linear_bytes: float
    attn_flops: float
    attn_bytes: float
    allreduce_bytes: float
    num_allreduces: int
    swap_bytes: float = 0.0
    attn_pad_flops: float = 0.0
    attn_pad_bytes: float = 0.0
    num_outputs: int = 0
    # the decodes' share of the attention terms above (the rest is the prompt chunks'): a mixed
    # step runs them as separate work, each at its own bound (see CostModel.breakdown)
    attn_decode_flops: float = 0.0
    attn_decode_bytes: float = 0.0
    attn_decode_pad_flops: float = 0.0
    attn_decode_pad_bytes: float = 0.0


def step_features(model: ModelCost, new_tokens: Sequence[int], context_lens: Sequence[int],
                  num_swap_blocks: int = 0, block_size: int = 16, num_outputs: int | None = None) -> StepFeatures:
    """The work of one step, O(batch): `new_tokens[i]` computed after `context_lens[i] - new_tokens[i]`.
    `num_outputs`: requests that sample a token (default: every one whose chunk ends its prompt
    is unknown here, so all of them)."""
    num_tokens = 0
    pairs = 0       # query-key pairs a paged kernel computes
    kv_read = 0     # tokens of KV it reads
    pad_pairs = 0   # what a padded backend computes on top
    pad_read = 0
    num_prefills = 0
    num_decodes = 0
    decode_ctx = 0
    max_decode_ctx = 0
    for n, c in zip(new_tokens, context_lens):
        num_tokens += n
        kv_read += c
        if n == 1:
            num_decodes += 1
            decode_ctx += c
            if c > max_decode_ctx:
                max_decode_ctx = c
            continue
        num_prefills += 1
        # causal: query k (0-based) sees c - n + k + 1 keys; a padded backend computes a
        # chunk-after-prefix's whole n x c rectangle
        causal = n * c - n * (n - 1) // 2
        pairs += causal
        if c > n:
            pad_pairs += n * c - causal
    pairs += decode_ctx
    decode_pad = 0
    if num_decodes:  # padded: every decode attends over the longest decode context
        decode_pad = num_decodes * max_decode_ctx - decode_ctx
        pad_pairs += decode_pad
        pad_read += decode_pad
    num_reqs = len(new_tokens)
    linear_flops = 2.0 * num_tokens * model.linear_params_per_rank + 2.0 * num_reqs * model.lm_head_params_per_rank
    linear_bytes = model.weight_bytes_per_rank if num_reqs else 0.0
    per_pair = 4.0 * model.num_layers * model.q_heads_per_rank * model.head_dim
    if model.tp > 1 and num_tokens:
        allreduce_bytes = 2 * model.num_layers * num_tokens * model.hidden_size * model.act_bytes
        num_allreduces = 2 * model.num_layers
    else:
        allreduce_bytes, num_allreduces = 0.0, 0
    swap_bytes = float(num_swap_blocks * block_size * model.kv_bytes_per_token)
    kvb = model.kv_bytes_per_token
    return StepFeatures(num_tokens, num_reqs, num_prefills, linear_flops, linear_bytes, per_pair * pairs,
                        float(kv_read * kvb), allreduce_bytes, num_allreduces, swap_bytes,
                        per_pair * pad_pairs, float(pad_read * kvb),
                        num_reqs if num_outputs is None else num_outputs,
                        per_pair * decode_ctx, float(decode_ctx * kvb), per_pair * decode_pad, float(decode_pad * kvb))


@dataclass
class StepTime:
    """A predicted step, by part (seconds)."""

    linear: float
    attention: float
    allreduce: float
    overhead: float
    swap: float
    dequant: float = 0.0   # a quantized KV cache's decode of what attention reads

    @property
    def total(self) -> float:
        return self.linear + self.attention + self.allreduce + self.overhead + self.swap + self.dequant


class CostModel:
    def __init__(self, model: ModelCost, params: CostParams, block_size: int = 16) -> None:
        self.model = model
        self.params = params
        self.block_size = block_size
        p = params
        # Inverse rates, precomputed: the simulator calls step_time once per step.
        gemm_peak = p.peak_flops
        if model.weight_bytes_per_param == 1 and p.fp8_peak_flops > 0:
            gemm_peak = p.fp8_peak_flops  # fp8 weights and activations on fp8 tensor cores
        self._inv_gemm_f = 1.0 / (gemm_peak * p.gemm_mfu) if p.gemm_mfu > 0 else 0.0
        self._inv_gemm_b = 1.0 / (p.mem_bandwidth * p.gemm_mbu) if p.gemm_mbu > 0 else 0.0
        self._inv_attn_f = 1.0 / (p.peak_flops * p.attn_mfu) if p.attn_mfu > 0 else 0.0
        self._inv_attn_b = 1.0 / (p.mem_bandwidth * p.attn_mbu) if p.attn_mbu > 0 else 0.0
        link = p.link_bandwidth * p.link_efficiency
        self._inv_link = 1.0 / link if link > 0 else 0.0
        host = p.host_bandwidth * p.host_link_efficiency
        self._inv_host = 1.0 / host if host > 0 else 0.0
        self._factors = {int(k): float(v) for k, v in (p.token_count_factors or {}).items()}
        self._dequant_per_kv_byte = kv_dequant_s_per_kv_byte(model, p)
        if p.combine not in ("max", "sum"):
            raise ValueError(f"combine: must be 'max' or 'sum', got {p.combine!r}")
        self._sum = p.combine == "sum"
        self._pad = p.pad_share

    def breakdown(self, f: StepFeatures) -> StepTime:
        if f.num_reqs == 0 and f.swap_bytes == 0:
            return StepTime(0.0, 0.0, 0.0, 0.0, 0.0)
        p, tp = self.params, self.model.tp
        lin_f, lin_b = f.linear_flops * self._inv_gemm_f, f.linear_bytes * self._inv_gemm_b
        att_f = (f.attn_flops + self._pad * f.attn_pad_flops) * self._inv_attn_f
        att_b = (f.attn_bytes + self._pad * f.attn_pad_bytes) * self._inv_attn_b
        if self._sum:
            linear, attention = lin_f + lin_b, att_f + att_b
        else:
            # The step's GEMMs are one kernel each over all its rows: one roofline. Its attention
            # is two kinds of work: the prompt chunks' (compute-bound, FlashAttention-style) and
            # the decodes' (memory-bound: each reads its whole KV for one query). They are
            # separate launches or separate thread blocks, each at its own bound; their times add,
            # so a chunk in a decode batch is never hidden behind the decodes' KV read (or the
            # decodes behind the chunk's FLOPs), as one max() over the step's totals would do.
            dec_f = (f.attn_decode_flops + self._pad * f.attn_decode_pad_flops) * self._inv_attn_f
            dec_b = (f.attn_decode_bytes + self._pad * f.attn_decode_pad_bytes) * self._inv_attn_b
            linear = max(lin_f, lin_b)
            attention = max(dec_f, dec_b) + max(att_f - dec_f, att_b - dec_b)
        allreduce = 0.0
        if f.num_allreduces:
            allreduce = (2 * (tp - 1) / tp * f.allreduce_bytes * self._inv_link
                         + f.num_allreduces * p.allreduce_latency_s)
        overhead = (p.step_overhead_s + p.per_request_overhead_s * f.num_reqs
                    + p.per_prefill_overhead_s * f.num_prefills + p.per_token_overhead_s * f.num_tokens)
        swap = f.swap_bytes * self._inv_host + (p.swap_step_overhead_s if f.swap_bytes else 0.0)
        factor = self._factors.get(f.num_tokens) if self._factors else None
        if factor is not None:
            linear, attention, overhead = linear * factor, attention * factor, overhead * factor
        overhead += p.per_output_overhead_s * f.num_outputs
        return StepTime(linear, attention, allreduce, overhead, swap, self.dequant_time(f))

    def dequant_time(self, f: StepFeatures) -> float:
        """The KV dequantization term: every K/V value attention reads (as counted in its bytes),
        decoded. Additive, and 0 for a plain cache."""
        return f.attn_bytes * self._dequant_per_kv_byte

    def predict(self, new_tokens: Sequence[int], context_lens: Sequence[int], num_swap_blocks: int = 0,
                num_outputs: int | None = None) -> float:
        return self.breakdown(step_features(self.model, new_tokens, context_lens, num_swap_blocks,
                                            self.block_size, num_outputs)).total

    def step_time(self, out) -> float:
        """Duration of the step a SchedulerOutput describes."""
        sched = out.scheduled
        new = [len(r.token_ids) for r in sched]
        ctx = [r.start_pos + n for r, n in zip(sched, new)]
        swaps = len(out.blocks_to_swap_out) + len(out.blocks_to_swap_in)
        return self.predict(new, ctx, swaps, sum(1 for r in sched if r.sample))

    # -- persistence -------------------------------------------------------------------
    def save(self, path: str | Path, extra: dict | None = None) -> None:
        Path(path).write_text(json.dumps({"params": self.params.to_dict(), **(extra or {})}, indent=2))


def kv_dequant_s_per_kv_byte(model: ModelCost, params: CostParams) -> float:
    """Dequantization seconds per byte of KV read (0 for a plain cache)."""
    if not model.kv_values_per_token or not model.kv_bytes_per_token:
        return 0.0
    per_value = params.kv_dequant_s_per_value
    if per_value is None:
        per_value = default_kv_dequant_s_per_value(params.peak_flops, params.attn_mfu)
    return per_value * model.kv_values_per_token / model.kv_bytes_per_token


def load_params(path: str | Path) -> CostParams:
    data = json.loads(Path(path).read_text())
    return CostParams.from_dict(data.get("params", data))


# ---------------------------------------------------------------------------------------
# Calibration: least squares on the engine's step trace (and the server's request trace).
# ---------------------------------------------------------------------------------------
STEP_KINDS = ("decode", "mixed", "prefill")
_DECODE_BATCH_BINS = ((1, 1), (2, 4), (5, 8), (9, 16), (17, 64), (65, 1 << 30))
_CONTEXT_BINS = ((0, 127), (128, 511), (512, 2047), (2048, 1 << 30))


def read_trace(path: str | Path) -> list[StepTrace]:
    """One StepTrace per line, as the engine core writes them (--step-trace-path)."""
    records = []
    for line in Path(path).read_text().splitlines():
        line = line.strip()
        if line:
            records.append(StepTrace.from_dict(json.loads(line)))
    if not records:
        raise ValueError(f"trace: {path} holds no step records")
    return records


def step_kind(r: StepTrace) -> str:
    """decode: every request computes one token; prefill: none decodes; mixed: both."""
    decodes = sum(1 for n in r.new_tokens if n == 1)
    if decodes == len(r.new_tokens):
        return "decode"
    return "prefill" if decodes == 0 else "mixed"


def step_costs(records: Sequence[StepTrace]) -> tuple[list[float], dict]:
    """What each step costs the engine's loop: from its start to the next step's start when
    the next one followed at once (the engine had work left), else its own step_time plus
    the median such gap. Between two steps the engine applies new requests and aborts and,
    in a server, shares the interpreter with the HTTP loop; the simulator has no such gap,
    so its steps must carry it. Traces without timestamps give step_time as it is."""
    costs = [float(r.step_time) for r in records]
    gaps = []
    for k in range(len(records) - 1):
        a, b = records[k], records[k + 1]
        if a.t_end and b.t_end and a.num_unfinished > 0:
            gap = (b.t_end - b.step_time) - a.t_end
            if gap >= 0:
                gaps.append((k, gap))
    if not gaps:
        return costs, {"num_gaps": 0, "median_gap_s": 0.0, "mean_gap_s": 0.0}
    values = sorted(g for _, g in gaps)
    median = values[len(values) // 2]
    with_gap = {k for k, _ in gaps}
    for k, gap in gaps:
        costs[k] += gap
    for k, r in enumerate(records):
        if k not in with_gap and r.t_end:
            costs[k] += median
    return costs, {"num_gaps": len(gaps), "median_gap_s": median, "mean_gap_s": sum(values) / len(values)}


def trace_coverage(records: Sequence[StepTrace]) -> dict:
    """The shapes a trace holds: what a cost model fitted on it has seen."""
    kinds = {k: 0 for k in STEP_KINDS}
    max_batch = max_ctx = max_tokens = max_chunk = swap_blocks = swap_steps = 0
    for r in records:
        if not r.num_reqs:
            continue
        kinds[step_kind(r)] += 1
        decodes = sum(1 for n in r.new_tokens if n == 1)
        max_batch = max(max_batch, decodes)
        max_ctx = max(max_ctx, max(r.context_lens))
        max_tokens = max(max_tokens, r.num_tokens)
        max_chunk = max(max_chunk, max((n for n in r.new_tokens if n > 1), default=0))
        swap_blocks += r.num_swap_blocks
        swap_steps += 1 if r.num_swap_blocks else 0
    return {"num_steps": sum(kinds.values()), "steps_by_kind": kinds, "max_decode_batch": max_batch,
            "max_context": max_ctx, "max_step_tokens": max_tokens, "max_prefill_chunk": max_chunk,
            "swap_blocks": swap_blocks, "swap_steps": swap_steps}


def coverage_note(c: dict) -> str:
    kinds = c.get("steps_by_kind", {})
    return (f"{c.get('num_steps', 0)} steps ({', '.join(f'{kinds.get(k, 0)} {k}' for k in STEP_KINDS)}); "
            f"decode batches up to {c.get('max_decode_batch', 0)}, contexts up to {c.get('max_context', 0)} tokens, "
            f"steps up to {c.get('max_step_tokens', 0)} tokens, prompt chunks up to {c.get('max_prefill_chunk', 0)}, "
            f"{c.get('swap_blocks', 0)} blocks swapped")


def calibration_warnings(c: dict, host_note: str | None, max_model_len: int | None = None) -> list[str]:
    """Where the trace leaves a term of the model unfitted or thinly fitted."""
    warnings = []
    if c.get("num_steps", 0) < 100:
        warnings.append(f"only {c.get('num_steps', 0)} steps: a short trace fits the constants loosely "
                        f"(`pagedserve bench --dataset calibration` makes a longer one)")
    for kind in STEP_KINDS:
        if not c.get("steps_by_kind", {}).get(kind):
            warnings.append(f"no {kind} steps in the trace: their cost is extrapolated from the others")
    if c.get("max_decode_batch", 0) < 4:
        warnings.append(f"decode batches only up to {c.get('max_decode_batch', 0)}: the per-request and GEMM "
                        f"terms of larger batches are extrapolated")
    if max_model_len and c.get("max_context", 0) < max_model_len // 2:
        warnings.append(f"no long contexts: the longest in the trace is {c.get('max_context', 0)} tokens, "
                        f"under half of max_model_len={max_model_len}; the attention terms are extrapolated "
                        f"beyond it")
    if host_note is not None:
        warnings.append(host_note)
    return warnings


def run_beyond_coverage(coverage: dict, shapes: dict, margin: float = 1.25) -> list[str]:
    """What a simulated run did that the calibration trace never showed (by more than `margin`x)."""
    if not coverage:
        return []
    out = []
    for key, label in (("max_decode_batch", "decode batch"), ("max_context", "context"),
                       ("max_step_tokens", "tokens in one step"), ("max_prefill_chunk", "prompt chunk")):
        seen, ran = coverage.get(key, 0), shapes.get(key, 0)
        if ran > margin * seen:
            out.append(f"the run reached a {label} of {ran}, the calibration trace only {seen}: that part of "
                       f"the step cost is extrapolated")
    if shapes.get("swap_blocks") and not coverage.get("swap_blocks"):
        out.append(f"the run swapped {shapes['swap_blocks']} blocks; the calibration trace had no swaps, so the "
                   f"swap cost is the fallback host bandwidth, not a fitted one")
    return out


def measure_memcpy_bandwidth(num_bytes: int = 1 << 26, repeats: int = 3) -> float:
    """Bytes/s of a large memory copy on this machine: what a CPU engine's swap (host pool to
    host pool) costs per byte when the trace has no swaps to fit it from."""
    import time

    import numpy as np

    src = np.ones(num_bytes, dtype=np.uint8)
    dst = np.empty_like(src)
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t0)
    return num_bytes / max(best, 1e-9)


def _nnls(a, b, iters: int = 50):
    """Non-negative least squares by active-set elimination (small problems only)."""
    import numpy as np

    active = [j for j in range(a.shape[1]) if np.any(a[:, j])]
    x = np.zeros(a.shape[1])
    for _ in range(iters):
        if not active:
            break
        sol, *_ = np.linalg.lstsq(a[:, active], b, rcond=None)
        if (sol >= 0).all():
            x[:] = 0
            x[active] = sol
            return x
        # Drop the most negative coefficient and refit.
        active.pop(int(np.argmin(sol)))
    return x


def _error_stats(pred, y) -> dict:
    import numpy as np

    rel = (pred - y) / y
    return {"num_steps": int(len(y)), "mean_abs_rel_error": float(np.mean(np.abs(rel))),
            "bias": float(np.mean(rel)), "total_time_error": float(pred.sum() / y.sum() - 1)}


def error_report(records: Sequence[StepTrace], predicted: Sequence[float], measured: Sequence[float]) -> dict:
    """Per-step error by step kind, and for decode-only steps by batch size and by mean
    context (a decode term that follows the batch but not the context shows as a bias
    that changes sign across the context bins)."""
    import numpy as np

    pred, y = np.asarray(predicted, dtype=float), np.asarray(measured, dtype=float)
    kinds = np.asarray([step_kind(r) for r in records])
    out: dict = {"all": _error_stats(pred, y), "by_kind": {}, "decode_by_batch": {}, "decode_by_context": {}}
    for kind in STEP_KINDS:
        sel = kinds == kind
        if sel.any():
            out["by_kind"][kind] = _error_stats(pred[sel], y[sel])
    decode = kinds == "decode"
    batch = np.asarray([r.num_reqs for r in records])
    mean_ctx = np.asarray([sum(r.context_lens) / max(r.num_reqs, 1) for r in records])
    for lo, hi in _DECODE_BATCH_BINS:
        sel = decode & (batch >= lo) & (batch <= hi)
        if sel.any():
            out["decode_by_batch"][f"{lo}" if lo == hi else f"{lo}-{hi if hi < 1 << 29 else ''}"] = \
                _error_stats(pred[sel], y[sel])
    for lo, hi in _CONTEXT_BINS:
        sel = decode & (mean_ctx >= lo) & (mean_ctx <= hi)
        if sel.any():
            out["decode_by_context"][f"{lo}-{hi if hi < 1 << 29 else ''}"] = _error_stats(pred[sel], y[sel])
    return out


def format_error_report(rep: dict) -> str:
    def row(name, s):
        return (f"  {name:<22} {s['num_steps']:>6} steps   mean |error| {s['mean_abs_rel_error']:6.1%}   "
                f"bias {s['bias']:+6.1%}   total time {s['total_time_error']:+6.1%}")

    lines = [row("all steps", rep["all"])]
    lines += [row(k, s) for k, s in rep["by_kind"].items()]
    lines += [row(f"decode, batch {k}", s) for k, s in rep["decode_by_batch"].items()]
    lines += [row(f"decode, context {k}", s) for k, s in rep["decode_by_context"].items()]
    return "\n".join(lines)


# Columns of the design matrix: the per-step constant, per request, per prompt chunk, GEMM
# FLOPs, GEMM bytes, attention FLOPs, attention bytes (both with the padding share), swap bytes.
_COL_STEP, _COL_REQ, _COL_CHUNK, _COL_LF, _COL_LB, _COL_AF, _COL_AB, _COL_SWAP = range(8)
# Two more columns carry the decodes' share of the attention FLOPs and bytes (not unknowns: the
# "max" form prices the decodes' and the chunks' attention each at its own bound, as breakdown does).
_COL_DAF, _COL_DAB = 8, 9
_NUM_COEF = 8
_PAD_SHARES = (0.0, 0.25, 0.5, 0.75, 1.0)


def _design(records: Sequence[StepTrace], model: ModelCost, block_size: int, pad_share: float, form: str):
    import numpy as np

    rows = []
    for r in records:
        f = step_features(model, r.new_tokens, r.context_lens, r.num_swap_blocks, block_size)
        rows.append((1.0, f.num_reqs, f.num_prefills, f.linear_flops, f.linear_bytes if form == "max" else 0.0,
                     f.attn_flops + pad_share * f.attn_pad_flops, f.attn_bytes + pad_share * f.attn_pad_bytes,
                     f.swap_bytes, f.attn_decode_flops + pad_share * f.attn_decode_pad_flops,
                     f.attn_decode_bytes + pad_share * f.attn_decode_pad_bytes))
    return np.asarray(rows, dtype=float)


def fit(records: Iterable[StepTrace], model: ModelCost, base: CostParams, *, block_size: int = 16,
        fit_pad_share: bool = False, host_bandwidth_fallback: tuple[float, str] | None = None,
        swap_probe=None,
        max_model_len: int | None = None, iterations: int = 20, reweight: int = 4, trim: float = 3.0,
        max_factor_tokens: int = 8, min_factor_steps: int = 20) -> tuple[CostParams, dict]:
    """Fit the step cost's constants to a step trace; returns (params, report).

    What a step costs the server is its wall time plus the gap to the next step
    (`step_costs`). On a shared machine that wall time mostly measures the neighbours (the
    same step takes 1x to 5x its CPU time), so when the trace has the engine thread's CPU
    time per step the fit runs in two stages: the shape of the cost (how it grows with
    batch, context, chunks) is fitted to the CPU times, which are steady; then the wall
    clock is fitted as ``wall_per_cpu x shape + per_output x sampled tokens`` (the second
    term: the server's HTTP loop detokenizes and streams every token and, sharing one
    interpreter, holds the engine back), and every constant is scaled to it. Without CPU
    times the shape is fitted to the wall-clock costs directly. The shape is
    ``t = c0 + c1 R + c2 P + lin(F_lin, B_lin) + att(F_att, B_att) + c7 S``
    (R requests, P prompt chunks, F FLOPs, B bytes, S swapped bytes), each part combining its
    two branches as `base.combine` says: "sum" is linear in the unknowns, one non-negative
    least squares; "max" (the roofline) alternates between picking each step's active branch
    and solving, from every starting assignment, keeping the best. Errors are relative,
    weighed by the prediction (reweighted `reweight` times, so noise in the measurement does
    not bias the fit low), and each step kind (decode / mixed / prefill) weighs the same in
    total however rare it is. Steps whose residual exceeds `trim` x the median absolute
    deviation (a page fault, a collection) are dropped once. With `fit_pad_share` the share
    of a padded backend's extra attention work is chosen from a grid by the same error;
    otherwise it stays `base.pad_share`. Small token counts with at least `min_factor_steps`
    steps get a measured/modelled `token_count_factors` entry (a CPU's GEMM speed is not
    monotone in rows). Swap cost is fitted when the trace swapped; otherwise the host
    bandwidth falls back to `host_bandwidth_fallback` (bytes/s, how it is known), else
    `base.host_bandwidth`, else `swap_probe()` (a callable returning bytes/s, seconds per swapping
    step and how it knows: swap_probe.probe_swap_cost, the engine's own block copy timed here),
    else a memcpy measured here, and the report warns. Peaks stay as
    given; the efficiencies absorb the scale.
    """
    import numpy as np

    records = [r for r in records if r.num_reqs]
    if len(records) < 8:
        raise ValueError(f"trace: need at least 8 non-empty steps to calibrate, got {len(records)}")
    form = base.combine
    wall_list, gap_info = step_costs(records)
    wall = np.asarray(wall_list, dtype=float)
    use_cpu = sum(1 for r in records if r.cpu_time > 0) >= 0.9 * len(records)
    y = np.asarray([max(r.cpu_time, 1e-6) for r in records], dtype=float) if use_cpu else wall
    kinds = np.asarray([step_kind(r) for r in records])
    counts_arr = np.asarray([r.num_tokens for r in records])
    balance = np.ones(len(y))
    present = [k for k in STEP_KINDS if (kinds == k).any()]
    for k in present:
        sel = kinds == k
        balance[sel] = math.sqrt(len(y) / (len(present) * sel.sum()))

    def combine_pred(X, coef):
        if form == "sum":
            return X[:, :_NUM_COEF] @ coef
        dec_f, dec_b = coef[_COL_AF] * X[:, _COL_DAF], coef[_COL_AB] * X[:, _COL_DAB]
        return (coef[_COL_STEP] * X[:, _COL_STEP] + coef[_COL_REQ] * X[:, _COL_REQ]
                + coef[_COL_CHUNK] * X[:, _COL_CHUNK] + coef[_COL_SWAP] * X[:, _COL_SWAP]
                + np.maximum(coef[_COL_LF] * X[:, _COL_LF], coef[_COL_LB] * X[:, _COL_LB])
                + np.maximum(dec_f, dec_b)
                + np.maximum(coef[_COL_AF] * X[:, _COL_AF] - dec_f, coef[_COL_AB] * X[:, _COL_AB] - dec_b))

    def solve_weighted(X, mask, w):
        if form == "sum":
            return _nnls(X[mask, :_NUM_COEF] * w[mask, None], y[mask] * w[mask])
        best = None
        n = len(y)
        on, off = np.ones(n, dtype=bool), np.zeros(n, dtype=bool)
        starts = {"sum": (on, on), "flops": (on, off), "bytes": (off, on)}
        pf, pb = X[:, _COL_AF] - X[:, _COL_DAF], X[:, _COL_AB] - X[:, _COL_DAB]  # the chunks' part
        for lin_start in starts:
            for att_start in starts:
                lf, lb = starts[lin_start]
                af, ab = starts[att_start]   # the decodes' attention: flops branch, bytes branch
                cf, cb = starts[att_start]   # the chunks' attention
                coef = None
                for _ in range(iterations):
                    cols = X[:, :_NUM_COEF].copy()
                    cols[:, _COL_LF] *= lf
                    cols[:, _COL_LB] *= lb
                    cols[:, _COL_AF] = X[:, _COL_DAF] * af + pf * cf
                    cols[:, _COL_AB] = X[:, _COL_DAB] * ab + pb * cb
                    c = _nnls(cols[mask] * w[mask, None], y[mask] * w[mask])
                    new_l = X[:, _COL_LF] * c[_COL_LF] >= X[:, _COL_LB] * c[_COL_LB]
                    new_a = X[:, _COL_DAF] * c[_COL_AF] >= X[:, _COL_DAB] * c[_COL_AB]
                    new_c = pf * c[_COL_AF] >= pb * c[_COL_AB]
                    done = (coef is not None and (new_l == lf).all() and (new_a == af).all()
                            and (new_c == cf).all())
                    coef, lf, lb, af, ab, cf, cb = c, new_l, ~new_l, new_a, ~new_a, new_c, ~new_c
                    if done:
                        break
                err = float(np.sum(((combine_pred(X, coef)[mask] - y[mask]) * w[mask]) ** 2))
                if best is None or err < best[1]:
                    best = (coef, err)
        return best[0]

    def solve(X, mask):
        """Relative least squares, weights from the prediction (start: the measurement)."""
        w = balance / np.maximum(y, 1e-9)
        for _ in range(1 + reweight):
            coef = solve_weighted(X, mask, w)
            pred = combine_pred(X, coef)
            w = balance / np.maximum(pred, 1e-9)
        return coef, pred

    def solve_trimmed(pad_share):
        X = _design(records, model, block_size, pad_share, form)
        scale = X.max(axis=0)
        scale[scale == 0] = 1.0
        scale[_COL_DAF], scale[_COL_DAB] = scale[_COL_AF], scale[_COL_AB]  # parts of those columns
        Xs = X / scale
        keep = np.ones(len(y), dtype=bool)
        coef, pred = solve(Xs, keep)
        rel = (pred - y) / y
        mad = np.median(np.abs(rel - np.median(rel))) or 1e-9
        keep = np.abs(rel - np.median(rel)) <= trim * mad * 1.4826 + 0.05
        coef, pred = solve(Xs, keep)
        return coef / scale[:_NUM_COEF], pred, keep

    shares = _PAD_SHARES if fit_pad_share else (base.pad_share,)
    fits = {s: solve_trimmed(s) for s in shares}
    # Compare shares on the steps every candidate kept, so trimming cannot flatter one.
    common = np.logical_and.reduce([f[2] for f in fits.values()])

    def score(s):
        pred = fits[s][1]
        return float(np.sum(((pred[common] - y[common]) / pred[common] * balance[common]) ** 2))

    pad_share = min(shares, key=score)
    k, pred, keep = fits[pad_share]

    factors: dict[str, float] = {}
    for t in np.unique(counts_arr[keep]):
        sel = keep & (counts_arr == t)
        if t <= max_factor_tokens and sel.sum() >= min_factor_steps:
            ratio = float(np.median(y[sel] / pred[sel]))
            if abs(ratio - 1) > 0.03:
                factors[str(int(t))] = ratio
                pred[counts_arr == t] *= ratio

    shape_errors = None
    wall_per_cpu = None
    per_output = 0.0
    if use_cpu:
        shape_errors = error_report([r for r, kp in zip(records, keep) if kp], pred[keep], y[keep])
        outputs = np.asarray([r.num_outputs for r in records], dtype=float)
        # Plain least squares on seconds: the wall clock's noise is large and skewed, and what
        # the simulation needs right is the total.
        c = _nnls(np.column_stack([pred[keep], outputs[keep]]), wall[keep])
        wall_per_cpu, per_output = float(c[0]), float(c[1])
        if wall_per_cpu <= 0:
            wall_per_cpu, per_output = float(wall[keep].sum() / pred[keep].sum()), 0.0
        k = k * wall_per_cpu
        pred = pred * wall_per_cpu + per_output * outputs
        y = wall

    def eff(inv_rate, peak):
        return float(1.0 / (inv_rate * peak)) if inv_rate > 0 else 0.0

    # the peak CostModel will divide the GEMM FLOPs by (fp8 weights on fp8 tensor cores)
    gemm_peak = (base.fp8_peak_flops if model.weight_bytes_per_param == 1 and base.fp8_peak_flops > 0
                 else base.peak_flops)

    coverage = trace_coverage(records)
    host_note = None
    swap_step_s = 0.0
    if coverage["swap_blocks"] and k[_COL_SWAP] > 0:
        host_bw, host_eff = float(1.0 / k[_COL_SWAP]), 1.0
        host_source = f"fitted on {coverage['swap_steps']} steps that swapped {coverage['swap_blocks']} blocks"
    else:
        if host_bandwidth_fallback is not None:
            host_bw, how = host_bandwidth_fallback
            host_eff = 1.0
        elif base.host_bandwidth > 0:
            host_bw, host_eff, how = base.host_bandwidth, base.host_link_efficiency, "the stated default"
        elif swap_probe is not None:
            host_bw, swap_step_s, how = swap_probe()
            host_eff = 1.0
            if wall_per_cpu:  # the swap copy runs on the same contended CPU as the rest
                host_bw /= wall_per_cpu
                swap_step_s *= wall_per_cpu
                how += f", slowed by the trace's wall/CPU factor {wall_per_cpu:.2f}"
        else:
            host_bw, host_eff, how = measure_memcpy_bandwidth(), 1.0, "a memcpy measured on this machine"
            if wall_per_cpu:  # the swap copy runs on the same contended CPU as the rest
                host_bw /= wall_per_cpu
                how += f", slowed by the trace's wall/CPU factor {wall_per_cpu:.2f}"
        why = "no swaps in the trace" if not coverage["swap_blocks"] else "the swap steps did not separate a swap cost"
        host_source = f"not fitted ({why}): {host_bw * host_eff / 1e9:.2f} GB/s from {how}"
        host_note = (f"{why}: host copy bandwidth not fitted; swaps will cost {host_bw * host_eff / 1e9:.2f} GB/s "
                     + (f"+ {swap_step_s * 1e3:.2f} ms per swapping step " if swap_step_s else "")
                     + f"from {how} (run the calibration load on a small pool with --preemption-mode swap to fit it)")

    ratios = y[keep] / np.maximum(pred[keep], 1e-12)
    params = replace(
        base,
        step_overhead_s=float(k[_COL_STEP]), per_request_overhead_s=float(k[_COL_REQ]),
        per_prefill_overhead_s=float(k[_COL_CHUNK]), per_output_overhead_s=per_output,
        per_token_overhead_s=0.0, swap_step_overhead_s=swap_step_s,  # the rest is in the fitted terms
        gemm_mfu=eff(k[_COL_LF], gemm_peak), gemm_mbu=eff(k[_COL_LB], base.mem_bandwidth),
        attn_mfu=eff(k[_COL_AF], base.peak_flops), attn_mbu=eff(k[_COL_AB], base.mem_bandwidth),
        attention_pad_share=float(pad_share), host_bandwidth=host_bw, host_link_efficiency=host_eff,
        token_count_factors=factors, coverage=coverage,
        source=f"calibrated on {int(keep.sum())} of {len(y)} steps",
    )
    rel = (pred - y) / y
    errors = error_report([r for r, kp in zip(records, keep) if kp], pred[keep], y[keep])
    report = {
        "num_steps": int(len(y)), "num_used": int(keep.sum()), "form": form,
        "target": "cpu_time, then the wall clock" if use_cpu else "wall-clock step cost",
        "wall_per_cpu": wall_per_cpu, "per_output_overhead_s": per_output, "shape_errors": shape_errors,
        "mean_abs_rel_error": float(np.mean(np.abs(rel[keep]))),
        "median_abs_rel_error": float(np.median(np.abs(rel[keep]))),
        "total_time_error": float(pred[keep].sum() / y[keep].sum() - 1),
        "token_count_factors": factors, "attention_pad_share": float(pad_share),
        "pad_share_scores": {str(s): score(s) for s in shares} if len(shares) > 1 else None,
        "step_gap": gap_info, "host_bandwidth": host_source, "coverage": coverage, "errors": errors,
        # How widely steps scatter around the model (measured / predicted): the simulator
        # predicts means; on a shared machine single steps land this far either side.
        "step_time_spread": {"p10": float(np.percentile(ratios, 10) / ratios.mean()),
                             "p50": float(np.percentile(ratios, 50) / ratios.mean()),
                             "p90": float(np.percentile(ratios, 90) / ratios.mean()),
                             "p99": float(np.percentile(ratios, 99) / ratios.mean())},
        "warnings": calibration_warnings(coverage, host_note, max_model_len),
    }
    return params, report


# -- the serving layer ------------------------------------------------------------------
def read_request_trace(path: str | Path) -> list[dict]:
    """The server's request trace (pagedserve/server/request_trace.py), one dict per line."""
    out = []
    for line in Path(path).read_text().splitlines():
        if line.strip():
            out.append(json.loads(line))
    if not out:
        raise ValueError(f"request_trace: {path} holds no requests")
    return out


def match_client_records(requests: list[dict], bench_result: dict) -> int:
    """Give each server request record the client's view of it, from a `pagedserve bench
    --result-file`: `t_send` (the client sent it), `t_client_first` and `t_client_last` (its
    first and last token reached the client), on the server's clock. Matched by prompt length, each server
    record to the latest unmatched send at or before its HTTP arrival. Returns how many
    matched. The client's own clock is CLOCK_MONOTONIC like the server's (same machine)."""
    start = bench_result.get("run_start_monotonic")
    if start is None:
        raise ValueError("bench_result: no run_start_monotonic (made by an older pagedserve bench); "
                         "rerun the bench, or calibrate from the server's trace alone")
    sends: dict[int, list[tuple[float, dict]]] = {}
    for r in bench_result.get("requests", []):
        if r.get("success"):
            sends.setdefault(int(r["prompt_len"]), []).append((start + r["start"], r))
    for lst in sends.values():
        lst.sort(key=lambda x: x[0])
    used: set[int] = set()
    matched = 0
    for req in sorted(requests, key=lambda q: q.get("t_http") or q["t_submit"]):
        t = req.get("t_http") or req["t_submit"]
        best = None
        for send, r in sends.get(int(req["prompt_len"]), []):
            if send > t + 1e-3:
                break
            if id(r) not in used:
                best = (send, r)
        if best is None:
            continue
        used.add(id(best[1]))
        req["t_send"] = best[0]
        req["t_client_first"] = best[0] + best[1]["ttft"]
        req["t_client_last"] = req["t_client_first"] + sum(best[1].get("itl") or [])
        matched += 1
    return matched


def fit_serving(requests: Sequence[dict], steps: Sequence[StepTrace]) -> tuple[ServingOverhead, dict]:
    """Fit ServingOverhead from the request trace joined to its step trace.

    admission = t_submit - (t_send if the client's view was matched, else t_http), regressed
    on (1, prompt tokens) over the requests that found the serving layer free (every earlier
    request already handed to the engine): a burst queues at the HTTP loop and the tokenizer
    thread, and the overload phase of a calibration run would otherwise set the mean for
    every load (under overload the engine's queue dwarfs it anyway); delivery = (t_client_first, else t_first_out) - t_first_token and
    (t_client_last, else t_last_out) - t_last_token, regressed on (1, requests fed by that step: the step-trace
    line whose t_end is that token's time). Plain least squares on seconds, non-negative:
    the simulator needs the mean right (the tails come from the steps and the queue)."""
    import numpy as np

    outputs_at = {r.t_end: r.num_outputs for r in steps if r.t_end}

    def arrived_at(q):
        return q.get("t_send") if q.get("t_send") is not None else q.get("t_http")

    timed = sorted((q for q in requests if arrived_at(q) is not None and q.get("t_submit") is not None),
                   key=arrived_at)
    free, latest_submit = set(), -math.inf
    for q in timed:
        if latest_submit < arrived_at(q):
            free.add(id(q))
        latest_submit = max(latest_submit, q["t_submit"])
    use_free = len(free) >= 4
    adm_x, adm_y, del_x, del_y = [], [], [], []
    server_adm, client_adm, server_del, client_del = [], [], [], []
    for q in requests:
        if q.get("t_submit") is None or q.get("t_first_token") is None or q.get("t_first_out") is None:
            continue
        arrived = arrived_at(q)
        if arrived is not None and (id(q) in free or not use_free):
            adm_x.append((1.0, float(q["prompt_len"] or 0)))
            adm_y.append(q["t_submit"] - arrived)
            if q.get("t_http") is not None:
                server_adm.append(q["t_submit"] - q["t_http"])
                if q.get("t_send") is not None:
                    client_adm.append(q["t_http"] - q["t_send"])
        n_first = outputs_at.get(q["t_first_token"])
        first_seen = q.get("t_client_first") if q.get("t_client_first") is not None else q["t_first_out"]
        if n_first is not None:
            del_x.append((1.0, float(n_first)))
            del_y.append(first_seen - q["t_first_token"])
        server_del.append(q["t_first_out"] - q["t_first_token"])
        if q.get("t_client_first") is not None:
            client_del.append(q["t_client_first"] - q["t_first_out"])
        n_last = outputs_at.get(q.get("t_last_token"))
        last_seen = q.get("t_client_last") if q.get("t_client_last") is not None else q.get("t_last_out")
        if n_last is not None and last_seen is not None and q["t_last_token"] != q["t_first_token"]:
            del_x.append((1.0, float(n_last)))
            del_y.append(last_seen - q["t_last_token"])
    if len(adm_y) < 4 or len(del_y) < 4:
        raise ValueError(f"request_trace: need at least 4 streamed requests matched to the step trace, got "
                         f"{len(adm_y)} admissions and {len(del_y)} deliveries (was the trace written by "
                         f"`pagedserve serve --step-trace-path` with streaming requests?)")
    ax, ay, dx, dy = np.asarray(adm_x), np.asarray(adm_y), np.asarray(del_x), np.asarray(del_y)
    a = _nnls(ax, ay)
    d = _nnls(dx, dy)
    client = any(q.get("t_send") is not None for q in requests)
    overhead = ServingOverhead(float(a[0]), float(a[1]), float(d[0]), float(d[1]),
                               source=f"fitted on {len(adm_y)} requests"
                                      + (", client's send and receive times included" if client else
                                         ", server side only"))

    def mean(v):
        return float(np.mean(v)) if v else None

    report = {
        "num_requests": len(requests), "num_admissions": len(adm_y), "num_deliveries": len(del_y),
        "admissions_from": "requests that found the serving layer free" if use_free else "all requests",
        "admission_residual_p99_s": float(np.percentile(ay - ax @ a, 99)),
        "delivery_residual_p99_s": float(np.percentile(dy - dx @ d, 99)),
        "admission_mean_s": mean(adm_y), "delivery_mean_s": mean(del_y),
        "server_admission_mean_s": mean(server_adm), "client_to_server_mean_s": mean(client_adm),
        "server_delivery_mean_s": mean(server_del), "server_to_client_mean_s": mean(client_del),
        "admission_p90_s": float(np.percentile(adm_y, 90)), "delivery_p90_s": float(np.percentile(del_y, 90)),
    }
    return overhead, report
