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

How attention work is counted follows the backend (`CostParams.attention_layout`):
"paged" for FlashAttention-style kernels (work follows each request's context), "padded"
for pagedserve's torch reference backend on CPU (decodes padded to the longest decode
context of the step; a chunk after a cached prefix computes its whole rectangle).

Default efficiencies are stated in `GPU_EFFICIENCY` with their sources. `fit` (the
`calibrate` command) instead fits every constant by least squares to step timings the
real engine logged (EngineConfig.step_trace_path), so the same model describes this
CPU or a user's GPU.
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

    peak_flops: float              # FLOP/s of one device (dense)
    mem_bandwidth: float           # bytes/s of one device
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
    # How the attention backend lays a step out. "paged": work follows each request's own
    # context (FlashAttention / paged-attention kernels, vLLM on GPU). "padded": pagedserve's
    # torch reference backend (CPU): decodes are padded to the longest decode context in the
    # step, and a chunk after a cached prefix computes its full chunk x context rectangle.
    attention_layout: str = "paged"
    # Measured step time / model, by the step's token count (small counts only). A CPU
    # picks GEMM kernels by shape: here 3 decode rows took 20% longer than 4. Vidur
    # profiles every batch size for the same reason; `fit` fills this from the trace.
    token_count_factors: dict = field(default_factory=dict)
    # Seconds per K/V value a quantized cache's reads spend decoding (None: the GPU default,
    # default_kv_dequant_s_per_value; on a CPU, benchmarks/kv_cache_dtype.py measures it).
    kv_dequant_s_per_value: float | None = None
    source: str = "defaults"

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "CostParams":
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})

    @classmethod
    def for_gpu(cls, gpu) -> "CostParams":
        """Defaults for a `pagedserve.plan.gpus.GpuSpec` (datasheet peaks x stated efficiencies).

        The NVLink figure in the presets is aggregate bidirectional: one direction is half."""
        return cls(peak_flops=gpu.bf16_tflops * 1e12, mem_bandwidth=gpu.hbm_bandwidth_gbps * 1e9,
                   link_bandwidth=gpu.gpu_link_gbps * 1e9 / 2, host_bandwidth=gpu.host_link_gbps * 1e9,
                   source=f"defaults for {gpu.name}")


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
        )


# Feature order for fitting: the unknowns are 1/rate of each roofline branch plus the
# overheads. Each part's time is max(a*F, b*B): the fit finds which branch is active.
@dataclass
class StepFeatures:
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


def step_features(model: ModelCost, new_tokens: Sequence[int], context_lens: Sequence[int],
                  num_swap_blocks: int = 0, block_size: int = 16, layout: str = "paged") -> StepFeatures:
    """The work of one step, O(batch): `new_tokens[i]` computed after `context_lens[i] - new_tokens[i]`."""
    num_tokens = 0
    pairs = 0       # query-key pairs attention computes
    kv_read = 0     # tokens of KV read
    num_prefills = 0
    num_decodes = 0
    max_decode_ctx = 0
    padded = layout == "padded"
    for n, c in zip(new_tokens, context_lens):
        num_tokens += n
        if n == 1:
            num_decodes += 1
            if c > max_decode_ctx:
                max_decode_ctx = c
            if not padded:
                pairs += c
                kv_read += c
            continue
        num_prefills += 1
        if padded and c > n:  # a chunk after a cached prefix: full rectangle over gathered KV
            pairs += n * c
            kv_read += c
        else:  # causal: query k (0-based) sees c - n + k + 1 keys
            pairs += n * c - n * (n - 1) // 2
            kv_read += c
    if padded and num_decodes:
        pairs += num_decodes * max_decode_ctx
        kv_read += num_decodes * max_decode_ctx
    num_reqs = len(new_tokens)
    linear_flops = 2.0 * num_tokens * model.linear_params_per_rank + 2.0 * num_reqs * model.lm_head_params_per_rank
    linear_bytes = model.weight_bytes_per_rank if num_reqs else 0.0
    attn_flops = 4.0 * model.num_layers * model.q_heads_per_rank * model.head_dim * pairs
    attn_bytes = float(kv_read * model.kv_bytes_per_token)
    if model.tp > 1 and num_tokens:
        allreduce_bytes = 2 * model.num_layers * num_tokens * model.hidden_size * model.act_bytes
        num_allreduces = 2 * model.num_layers
    else:
        allreduce_bytes, num_allreduces = 0.0, 0
    swap_bytes = float(num_swap_blocks * block_size * model.kv_bytes_per_token)
    return StepFeatures(num_tokens, num_reqs, num_prefills, linear_flops, linear_bytes, attn_flops, attn_bytes,
                        allreduce_bytes, num_allreduces, swap_bytes)


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
        self._inv_gemm_f = 1.0 / (p.peak_flops * p.gemm_mfu) if p.gemm_mfu > 0 else 0.0
        self._inv_gemm_b = 1.0 / (p.mem_bandwidth * p.gemm_mbu) if p.gemm_mbu > 0 else 0.0
        self._inv_attn_f = 1.0 / (p.peak_flops * p.attn_mfu) if p.attn_mfu > 0 else 0.0
        self._inv_attn_b = 1.0 / (p.mem_bandwidth * p.attn_mbu) if p.attn_mbu > 0 else 0.0
        link = p.link_bandwidth * p.link_efficiency
        self._inv_link = 1.0 / link if link > 0 else 0.0
        host = p.host_bandwidth * p.host_link_efficiency
        self._inv_host = 1.0 / host if host > 0 else 0.0
        self._factors = {int(k): float(v) for k, v in (p.token_count_factors or {}).items()}
        self._dequant_per_kv_byte = kv_dequant_s_per_kv_byte(model, p)

    def breakdown(self, f: StepFeatures) -> StepTime:
        if f.num_reqs == 0 and f.swap_bytes == 0:
            return StepTime(0.0, 0.0, 0.0, 0.0, 0.0)
        p, tp = self.params, self.model.tp
        linear = max(f.linear_flops * self._inv_gemm_f, f.linear_bytes * self._inv_gemm_b)
        attention = max(f.attn_flops * self._inv_attn_f, f.attn_bytes * self._inv_attn_b)
        allreduce = 0.0
        if f.num_allreduces:
            allreduce = (2 * (tp - 1) / tp * f.allreduce_bytes * self._inv_link
                         + f.num_allreduces * p.allreduce_latency_s)
        overhead = (p.step_overhead_s + p.per_request_overhead_s * f.num_reqs
                    + p.per_prefill_overhead_s * f.num_prefills)
        swap = f.swap_bytes * self._inv_host
        factor = self._factors.get(f.num_tokens) if self._factors else None
        if factor is not None:
            linear, attention, overhead = linear * factor, attention * factor, overhead * factor
        return StepTime(linear, attention, allreduce, overhead, swap, self.dequant_time(f))

    def dequant_time(self, f: StepFeatures) -> float:
        """The KV dequantization term: every K/V value attention reads (as counted in its bytes),
        decoded. Additive, and 0 for a plain cache."""
        return f.attn_bytes * self._dequant_per_kv_byte

    def predict(self, new_tokens: Sequence[int], context_lens: Sequence[int], num_swap_blocks: int = 0) -> float:
        return self.breakdown(step_features(self.model, new_tokens, context_lens, num_swap_blocks,
                                            self.block_size, self.params.attention_layout)).total

    def step_time(self, out) -> float:
        """Duration of the step a SchedulerOutput describes."""
        sched = out.scheduled
        new = [len(r.token_ids) for r in sched]
        ctx = [r.start_pos + n for r, n in zip(sched, new)]
        swaps = len(out.blocks_to_swap_out) + len(out.blocks_to_swap_in)
        return self.predict(new, ctx, swaps)

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
# Calibration: least squares on the engine's step trace.
# ---------------------------------------------------------------------------------------
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


def _nnls(a, b, iters: int = 50):
    """Non-negative least squares by active-set elimination (small problems only)."""
    import numpy as np

    active = list(range(a.shape[1]))
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


def fit(records: Iterable[StepTrace], model: ModelCost, base: CostParams, *, block_size: int = 16,
        iterations: int = 20, trim: float = 3.0, max_factor_tokens: int = 8,
        min_factor_steps: int = 20) -> tuple[CostParams, dict]:
    """Fit MFU/MBU of both parts and the CPU overheads to logged step durations.

    The model ``t = c0 + c1*R + c2*P + max(aF_lin, bB_lin) + max(cF_attn, dB_attn)`` (R
    requests, P prompt chunks, F FLOPs, B bytes; `base.attention_layout` decides how
    attention work is counted) is linear in
    its unknowns once each step's active roofline branches are known, so the fit
    alternates: pick branches with the current constants, solve a non-negative least
    squares on the relative error (fast steps count as much as slow ones: they make the
    ITL; steps with and without a prompt chunk weigh the same in total), repeat. Steps whose residual exceeds `trim` x the median absolute residual
    (another process took the CPU) are dropped once and the fit is redone. Finally, for
    each small token count with at least `min_factor_steps` steps, the median ratio of
    measured to modelled time becomes a `token_count_factors` entry.
    Peaks (peak_flops, mem_bandwidth) stay as given; the efficiencies absorb the scale.
    Returns (params, fit report).
    """
    import numpy as np

    rows, y, counts, has_prefill = [], [], [], []
    for r in records:
        if not r.num_reqs:
            continue
        f = step_features(model, r.new_tokens, r.context_lens, 0, block_size, base.attention_layout)
        rows.append((1.0, f.num_reqs, f.linear_flops, f.linear_bytes, f.attn_flops, f.attn_bytes, f.num_prefills))
        # The whole step (schedule to outputs) is what a step costs the server; `duration`
        # is the executor's share only.
        y.append(float(r.step_time))
        counts.append(f.num_tokens)
        has_prefill.append(f.num_prefills > 0)
    if len(rows) < 8:
        raise ValueError(f"trace: need at least 8 non-empty steps to calibrate, got {len(rows)}")
    X = np.asarray(rows, dtype=float)
    y = np.asarray(y, dtype=float)
    scale = X.max(axis=0)
    scale[scale == 0] = 1.0
    Xs = X / scale
    keep = np.ones(len(y), dtype=bool)

    # Relative error, and the two kinds of step weigh the same in total however rare one
    # is: steps with a prompt chunk make TTFT, decode-only steps make ITL.
    w = 1.0 / np.maximum(y, 1e-6)
    prefill = np.asarray(has_prefill)
    for cls in (prefill, ~prefill):
        if cls.any():
            w[cls] *= math.sqrt(len(y) / (2.0 * cls.sum()))

    def predict(coef):
        return (coef[0] * Xs[:, 0] + coef[1] * Xs[:, 1] + np.maximum(coef[2] * Xs[:, 2], coef[3] * Xs[:, 3])
                + np.maximum(coef[4] * Xs[:, 4], coef[5] * Xs[:, 5]) + coef[6] * Xs[:, 6])

    def alternate(mask, lin_start: str, att_start: str):
        """From a starting branch assignment ('sum': both terms, 'flops' or 'bytes' only),
        alternate between solving and re-assigning branches until nothing moves."""
        on, off = np.ones(len(y), dtype=bool), np.zeros(len(y), dtype=bool)
        lin_f, lin_b = {"sum": (on, on), "flops": (on, off), "bytes": (off, on)}[lin_start]
        att_f, att_b = {"sum": (on, on), "flops": (on, off), "bytes": (off, on)}[att_start]
        coef = None
        for _ in range(iterations):
            cols = np.column_stack([Xs[:, 0], Xs[:, 1], Xs[:, 2] * lin_f, Xs[:, 3] * lin_b,
                                    Xs[:, 4] * att_f, Xs[:, 5] * att_b, Xs[:, 6]])
            c = _nnls(cols[mask] * w[mask, None], y[mask] * w[mask])
            new_lin = Xs[:, 2] * c[2] >= Xs[:, 3] * c[3]
            new_att = Xs[:, 4] * c[4] >= Xs[:, 5] * c[5]
            done = coef is not None and (new_lin == lin_f).all() and (new_att == att_f).all()
            coef = c
            lin_f, lin_b, att_f, att_b = new_lin, ~new_lin, new_att, ~new_att
            if done:
                break
        pred = predict(coef)
        return coef, pred, float(np.sum(((pred[mask] - y[mask]) * w[mask]) ** 2))

    def solve(mask):
        # The alternation can stall in a local optimum: start it from every branch
        # assignment and keep the best fit.
        best = None
        for lin_start in ("sum", "flops", "bytes"):
            for att_start in ("sum", "flops", "bytes"):
                coef, pred, err = alternate(mask, lin_start, att_start)
                if best is None or err < best[2]:
                    best = (coef, pred, err)
        return best[0], best[1]

    coef, pred = solve(keep)
    rel = (pred - y) / y
    mad = np.median(np.abs(rel - np.median(rel))) or 1e-9
    keep = np.abs(rel - np.median(rel)) <= trim * mad * 1.4826 + 0.05
    coef, pred = solve(keep)
    k = coef / scale  # seconds per unit of each feature
    # Per-token-count corrections where the trace has enough steps of that size.
    counts_arr = np.asarray(counts)
    factors: dict[str, float] = {}
    for t in np.unique(counts_arr[keep]):
        sel = keep & (counts_arr == t)
        if t <= max_factor_tokens and sel.sum() >= min_factor_steps:
            ratio = float(np.median(y[sel] / pred[sel]))
            if abs(ratio - 1) > 0.03:
                factors[str(int(t))] = ratio
                pred[counts_arr == t] *= ratio

    def eff(inv_rate, peak):
        return float(1.0 / (inv_rate * peak)) if inv_rate > 0 else 0.0

    params = replace(
        base,
        step_overhead_s=float(k[0]), per_request_overhead_s=float(k[1]), per_prefill_overhead_s=float(k[6]),
        gemm_mfu=eff(k[2], base.peak_flops), gemm_mbu=eff(k[3], base.mem_bandwidth),
        attn_mfu=eff(k[4], base.peak_flops), attn_mbu=eff(k[5], base.mem_bandwidth),
        token_count_factors=factors,
        source=f"calibrated on {int(keep.sum())} of {len(y)} steps",
    )
    rel = (pred - y) / y
    report = {
        "num_steps": int(len(y)), "num_used": int(keep.sum()),
        "mean_abs_rel_error": float(np.mean(np.abs(rel[keep]))),
        "median_abs_rel_error": float(np.median(np.abs(rel[keep]))),
        "total_time_error": float(pred[keep].sum() / y[keep].sum() - 1),
    }
    report["token_count_factors"] = factors
    return params, report
