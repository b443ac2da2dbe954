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
* **kernel launches** (GPU presets): every kernel of the forward pass leaves the GPU idle for its
  launch, ``kernel_launch_s x ModelCost.kernels_per_step`` (step_work.kernel_count: ~10 per dense
  layer), so a small step cannot cost less than its launches; 0 for a calibrated model.
* **elementwise kernels** (GPU presets with a kernel profile, cost_params.KERNEL_PROFILES: H100-SXM,
  A100-80GB): the fused residual add + RMSNorms, rotary, SiLU-and-mul, embedding and final norm of
  the step's tokens (step_work.elementwise_kernels), each at its kind's measured floor (one thread
  block streaming its row) or bandwidth. Their durations are the kernels' own (CUPTI), so the launch
  term above still prices the gaps between them.

On those chips the **linear** part is not the roofline above but the measured GEMM curve: each GEMM
kernel takes a fixed `kernel_s` plus ``(t_c^p + t_m^p)^(1/p)`` (p = 1.6: compute and weight read
overlap imperfectly near the ridge), with the layers' GEMMs over the step's tokens and the LM head's
over its requests priced apart (`CostModel.gemm_time`).

On a GPU preset the memory terms run at the chip's achievable bandwidth: datasheet x `mem_share`
(its measured STREAM share relative to H100's, cost_params.memory_share) x MBU.

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

Where the parts live (cost_model re-exports every name, so `from pagedserve.sim.cost_model import
...` keeps working): `cost_params` (CostParams, the device defaults and their sources),
`step_work` (ModelCost, StepFeatures, step_features: the work, in FLOPs and bytes), this module
(StepTime, CostModel: the work priced on a device), `parallel_cost` (TP/PP/EP communication),
`calibration` (the fit on a step trace), `serving_fit` (the serving layer's fit on a request
trace), `host_overhead` (the host CPU's terms).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from pagedserve.sim.calibration import (  # noqa: F401  (re-exported)
    _COL_AB, _COL_AF, _COL_CHUNK, _COL_DAB, _COL_DAF, _COL_LB, _COL_LF, _COL_REQ, _COL_STEP, _COL_SWAP,
    _CONTEXT_BINS, _DECODE_BATCH_BINS, _NUM_COEF, _PAD_SHARES, STEP_KINDS, _design, _error_stats, _nnls,
    calibration_warnings, coverage_note, error_report, fit, format_error_report, measure_memcpy_bandwidth,
    read_trace, run_beyond_coverage, step_costs, step_kind, trace_coverage)
from pagedserve.sim.cost_params import (  # noqa: F401  (re-exported)
    ALLREDUCE_LATENCY_S, CPU_NOMINAL_BANDWIDTH, CPU_NOMINAL_FLOPS, GPU_EFFICIENCY, KERNEL_LAUNCH_S,
    KV_DEQUANT_OPS_PER_VALUE, PER_REQUEST_OVERHEAD_S, REFERENCE_STREAM_SHARE, STEP_OVERHEAD_S,
    VECTOR_SHARE_OF_PEAK_FLOPS, CostParams, allreduce_seconds, default_kv_dequant_s_per_value, elementwise_seconds,
    memory_share, soft_roofline)
from pagedserve.sim.host_overhead import HostOverhead, ServingOverhead, default_host_overhead  # noqa: F401
from pagedserve.sim.serving_fit import fit_serving, match_client_records, read_request_trace  # noqa: F401
from pagedserve.sim.step_work import ModelCost, StepFeatures, kernel_count, step_features  # noqa: F401  (re-exported)


@dataclass
class StepTime:
    """A predicted step, by part (seconds)."""

    linear: float
    attention: float
    allreduce: float
    overhead: float
    swap: float
    dequant: float = 0.0   # a quantized KV cache's decode of what attention reads
    launch: float = 0.0    # the GPU idle between the step's kernels (CostParams.kernel_launch_s x kernels)
    elementwise: float = 0.0  # the norms, rotary, activation, embedding (CostParams.elementwise; 0: not priced)

    @property
    def total(self) -> float:
        return (self.linear + self.attention + self.allreduce + self.overhead + self.swap + self.dequant
                + self.launch + self.elementwise)


class CostModel:
    def __init__(self, model: ModelCost, params: CostParams, block_size: int = 16) -> None:
        self.model = model
        self.params = params
        self.block_size = block_size
        p = params
        # Inverse rates, precomputed: the simulator calls step_time once per step.
        gemm_peak = p.peak_flops * p.matmul_share  # the share a GEMM reaches on this chip (cost_params)
        if model.weight_bytes_per_param == 1 and p.fp8_peak_flops > 0:
            gemm_peak = p.fp8_peak_flops * p.fp8_matmul_share  # fp8 weights and activations on fp8 tensor cores
        self._inv_gemm_f = 1.0 / (gemm_peak * p.gemm_mfu) if p.gemm_mfu > 0 else 0.0
        self._inv_gemm_b = 1.0 / (p.mem_bandwidth * p.mem_share * p.gemm_mbu) if p.gemm_mbu > 0 else 0.0
        # A measured GEMM curve (cost_params.KERNEL_PROFILES) replaces the stated roofline for the 16-bit dense
        # GEMMs it was measured on; fp8 / int8 weights and MoE models (vLLM's fused-MoE Triton kernels: no such
        # kernel in the profiles) keep the roofline.
        curve = p.gemm_curve if p.gemm_curve and model.weight_bytes_per_param == 2 and not model.moe else None
        self._exponent, self._gemm_kernel_s = 0.0, 0.0
        if curve:
            self._inv_gemm_f, self._inv_gemm_b = 1.0 / curve["tflops"], 1.0 / curve["tbps"]
            self._exponent, self._gemm_kernel_s = curve["exponent"], curve["kernel_s"]
        self._elementwise = p.elementwise or None
        self._inv_attn_f = 1.0 / (p.peak_flops * p.attn_mfu) if p.attn_mfu > 0 else 0.0
        self._inv_attn_b = 1.0 / (p.mem_bandwidth * p.mem_share * p.attn_mbu) if p.attn_mbu > 0 else 0.0
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

    def breakdown(self, f: StepFeatures, model: ModelCost | None = None) -> StepTime:
        """The step `f` priced by part. `model`: whose kernels the step launches (a pipeline stage's; default
        the whole model's)."""
        if f.num_reqs == 0 and f.swap_bytes == 0:
            return StepTime(0.0, 0.0, 0.0, 0.0, 0.0)
        p, tp = self.params, self.model.tp
        model = model or self.model
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
            linear = self.gemm_time(f, model)
            attention = max(dec_f, dec_b) + max(att_f - dec_f, att_b - dec_b)
        allreduce = 0.0
        if f.num_allreduces:
            allreduce = f.num_allreduces * allreduce_seconds(p, tp, f.allreduce_bytes / f.num_allreduces,
                                                             self._inv_link)
        overhead = (p.step_overhead_s + p.per_request_overhead_s * f.num_reqs
                    + p.per_prefill_overhead_s * f.num_prefills + p.per_token_overhead_s * f.num_tokens)
        swap = f.swap_bytes * self._inv_host + (p.swap_step_overhead_s if f.swap_bytes else 0.0)
        factor = self._factors.get(f.num_tokens) if self._factors else None
        if factor is not None:
            linear, attention, overhead = linear * factor, attention * factor, overhead * factor
        overhead += p.per_output_overhead_s * f.num_outputs
        launch = p.kernel_launch_s * model.kernels_per_step if f.num_reqs else 0.0
        return StepTime(linear, attention, allreduce, overhead, swap, self.dequant_time(f), launch,
                        self.elementwise_time(f.num_tokens, model))

    def gemm_time(self, f: StepFeatures, model: ModelCost | None = None) -> float:
        """The step's GEMMs on a GPU (combine "max"). The stated roofline: one max() over the step's FLOPs and
        weight bytes. A measured curve: the layers' GEMMs (rows = the step's tokens) and the LM head's (rows =
        its requests) each as the p-norm of compute and weight-read time, + kernel_s per GEMM kernel."""
        lin_f, lin_b = f.linear_flops * self._inv_gemm_f, f.linear_bytes * self._inv_gemm_b
        if not self._exponent:
            return max(lin_f, lin_b)
        head_f, head_b = f.lm_head_flops * self._inv_gemm_f, f.lm_head_bytes * self._inv_gemm_b
        t = (soft_roofline(lin_f - head_f, lin_b - head_b, self._exponent)
             + soft_roofline(head_f, head_b, self._exponent))
        if f.num_tokens:
            t += self._gemm_kernel_s * (model or self.model).gemm_kernels_per_step
        return t

    def elementwise_time(self, num_tokens: int, model: ModelCost | None = None) -> float:
        """The step's norms, rotary, activation and embedding kernels over its tokens at the chip's measured
        figures (CostParams.elementwise); 0 where none were measured."""
        if not self._elementwise or not num_tokens:
            return 0.0
        return sum(kernels * elementwise_seconds(self._elementwise, kind, num_tokens * rows, width)
                   for kind, kernels, rows, width in (model or self.model).elementwise_kernels)

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
