"""`simulate calibrate`'s step-cost fit: least squares of CostParams on the engine's step trace
(read_trace, step_costs, fit), its coverage and error reports, and the host-copy fallbacks.
Split out of cost_model.py."""
from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path
from typing import Iterable, Sequence

from pagedserve.core.engine_core import StepTrace
from pagedserve.sim.cost_params import WARMUP_IDLE_S, CostParams
from pagedserve.sim.host_overhead import scatter_quantiles
from pagedserve.sim.step_work import ModelCost, step_features

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


def gap_before(prev: StepTrace, r: StepTrace) -> float:
    """Seconds between `prev`'s end and `r`'s start, on the engine's clock (both need t_end)."""
    return (r.t_end - r.step_time) - prev.t_end


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
            gap = gap_before(a, b)
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


def steps_after_idle(records: Sequence[StepTrace], idle_s: float = WARMUP_IDLE_S) -> list[int | None]:
    """Per step, how many steps the engine ran since it was last idle for `idle_s` or longer: 0 for
    the first step after such a spell (and the first of the trace), 1 for the one after it, ...
    None where the trace has no timestamps. Idle is measured from a step's end to the next one's
    start, as the engine's clock stamped them."""
    out: list[int | None] = []
    prev, since = None, 0
    for r in records:
        if not r.t_end:
            out.append(None)
            prev = None
            continue
        gap = None if prev is None else gap_before(prev, r)
        since = 0 if gap is None or gap < 0 or gap >= idle_s else since + 1
        out.append(since)
        prev = r
    return out


# A decode batch counts as covered when at least this many steps (or this share of the steps that
# decode) reach it: a maximum seen in a handful of steps fits nothing.
REACH_MIN_STEPS = 20
REACH_MIN_SHARE = 0.01


def decode_batch_reach(batches: Sequence[int]) -> int:
    """The largest decode batch b that at least max(REACH_MIN_STEPS, REACH_MIN_SHARE of the decoding steps)
    steps reach (have b decodes or more); 0 when too few steps decode."""
    sizes = sorted((b for b in batches if b), reverse=True)
    need = max(REACH_MIN_STEPS, int(REACH_MIN_SHARE * len(sizes)))
    return sizes[need - 1] if len(sizes) >= need else 0


def trace_coverage(records: Sequence[StepTrace]) -> dict:
    """The shapes a trace holds: what a cost model fitted on it has seen."""
    kinds = {k: 0 for k in STEP_KINDS}
    max_batch = max_ctx = max_tokens = max_chunk = swap_blocks = swap_steps = 0
    batches = []
    for r in records:
        if not r.num_reqs:
            continue
        kinds[step_kind(r)] += 1
        decodes = sum(1 for n in r.new_tokens if n == 1)
        batches.append(decodes)
        max_batch = max(max_batch, decodes)
        max_ctx = max(max_ctx, max(r.context_lens))
        max_tokens = max(max_tokens, r.num_tokens)
        max_chunk = max(max_chunk, max((n for n in r.new_tokens if n > 1), default=0))
        swap_blocks += r.num_swap_blocks
        swap_steps += 1 if r.num_swap_blocks else 0
    return {"num_steps": sum(kinds.values()), "steps_by_kind": kinds, "max_decode_batch": max_batch,
            "decode_batch_reach": decode_batch_reach(batches), "max_context": max_ctx, "max_step_tokens": max_tokens,
            "max_prefill_chunk": max_chunk,
            "swap_blocks": swap_blocks, "swap_steps": swap_steps}


def coverage_note(c: dict) -> str:
    kinds = c.get("steps_by_kind", {})
    return (f"{c.get('num_steps', 0)} steps ({', '.join(f'{kinds.get(k, 0)} {k}' for k in STEP_KINDS)}); "
            f"decode batches up to {c.get('max_decode_batch', 0)}"
            + (f" ({c['decode_batch_reach']} in {REACH_MIN_STEPS}+ steps)" if "decode_batch_reach" in c else "")
            + f", contexts up to {c.get('max_context', 0)} tokens, "
            f"steps up to {c.get('max_step_tokens', 0)} tokens, prompt chunks up to {c.get('max_prefill_chunk', 0)}, "
            f"{c.get('swap_blocks', 0)} blocks swapped")


def calibration_warnings(c: dict, host_note: str | None, max_model_len: int | None = None,
                         max_num_seqs: int | None = None) -> list[str]:
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
    elif max_num_seqs and c.get("decode_batch_reach", max_num_seqs) < max_num_seqs / 2:
        warnings.append(f"decode batches reach {c['decode_batch_reach']} in {REACH_MIN_STEPS} steps or more (at most "
                        f"{c.get('max_decode_batch', 0)}), under half of max_num_seqs={max_num_seqs}: larger batches "
                        f"are priced by extrapolating the smaller ones (a higher --request-rate or longer outputs in "
                        f"the calibration load fill the batch)")
    if max_model_len and c.get("max_context", 0) < max_model_len // 2:
        warnings.append(f"no long contexts: the longest in the trace is {c.get('max_context', 0)} tokens, "
                        f"under half of max_model_len={max_model_len}; the attention terms are extrapolated "
                        f"beyond it")
    if host_note is not None:
        warnings.append(host_note)
    return warnings


def run_beyond_coverage(coverage: dict, shapes: dict, margin: float = 1.25) -> list[str]:
    """What a simulated run did that the calibration trace never showed (by more than `margin`x). A decode batch
    counts as shown where enough steps reach it (`decode_batch_reach`), not where one step did."""
    if not coverage:
        return []
    out = []
    for key, label in (("max_decode_batch", "decode batch"), ("max_context", "context"),
                       ("max_step_tokens", "tokens in one step"), ("max_prefill_chunk", "prompt chunk")):
        seen, ran = coverage.get(key, 0), shapes.get(key, 0)
        shown = f"only {seen}"
        if key == "max_decode_batch" and "decode_batch_reach" in coverage:
            seen = coverage["decode_batch_reach"]
            shown = f"{seen} in {REACH_MIN_STEPS} steps or more (at most {coverage[key]})"
        if ran > margin * seen:
            out.append(f"the run reached a {label} of {ran}, the calibration trace {shown}: that part of the step "
                       f"cost is extrapolated")
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
        max_model_len: int | None = None, max_num_seqs: int | None = None, iterations: int = 20, reweight: int = 4,
        trim: float = 3.0,
        max_factor_tokens: int = 8, min_factor_steps: int = 20,
        min_kind_steps: int = 20, warmup_steps: int = 4) -> tuple[CostParams, dict]:
    """Fit the step cost's constants to a step trace; returns (params, report).

    What a step costs the server is its wall time plus the gap to the next step
    (`step_costs`). On a shared machine that wall time mostly measures the neighbours (the
    same step takes 1x to 5x its CPU time), so when the trace has the engine thread's CPU
    time per step the fit runs in two stages: the shape of the cost (how it grows with
    batch, context, chunks) is fitted to the CPU times, which are steady; then the wall
    clock is fitted as ``wall_per_cpu x shape + per_output x sampled tokens + per step`` (the
    second term: the server's HTTP loop detokenizes and streams every token and, sharing one
    interpreter, holds the engine back; the third: the gap between steps, which does not grow
    with the tokens), and every constant is scaled to it. Without CPU
    times the shape is fitted to the wall-clock costs directly. The shape is
    ``t = c0 + c1 R + c2 P + lin(F_lin, B_lin) + att(F_att, B_att) + c7 S``
    (R requests, P prompt chunks, F FLOPs, B bytes, S swapped bytes), each part combining its
    two branches as `base.combine` says: "sum" is linear in the unknowns, one non-negative
    least squares; "max" (the roofline) alternates between picking each step's active branch
    and solving, from every starting assignment, keeping the best. Errors are relative,
    weighed by the prediction (reweighted `reweight` times, so noise in the measurement does
    not bias the fit low), and each step kind (decode / mixed / prefill) with at least
    `min_kind_steps` steps weighs the same in total however rare it is (a rarer kind weighs
    what its steps would unbalanced). Steps whose residual exceeds `trim` x the median absolute
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

    Warm-up: on a CPU the first decode steps after the engine sat idle for `warmup_idle_s` (its
    caches, the OpenMP team and the core's clock were elsewhere) run 10-40% over the same steps
    back to back (sim_vs_real's traces, 2026-12-05). The decode steps 1..`warmup_steps` after such a
    spell are left out of the shape fit, and each position with at least `min_factor_steps` of them
    gets its measured/modelled median as `warmup_factors[k - 1]`, which the simulator applies to
    the k-th step after an idle spell of its own. (Step 0 after idle is almost always a prompt's
    first chunk: its warm-up cannot be told apart from the prompt's price, so the prefill terms
    hold it.)
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
    # Each kind with at least `min_kind_steps` steps weighs the same in total; a rarer kind keeps the
    # weight its steps have unbalanced: raised to a third of the fit, one stray step (in a trace rebuilt
    # from a client's token arrivals, a prompt whose step began after an idle wait the client cannot
    # see) set the prompt terms for every step (vLLM's CPU server, 2026-12-02: one such "prefill" step
    # priced its 71 mixed steps 18-20% high).
    counts = {k: int((kinds == k).sum()) for k in STEP_KINDS}
    common = [k for k in STEP_KINDS if counts[k] >= min_kind_steps]
    rare_share = sum(n for k, n in counts.items() if k not in common) / len(y)
    for k in common:
        balance[kinds == k] = math.sqrt((1.0 - rare_share) * len(y) / (len(common) * counts[k]))
    idle_s = base.warmup_idle_s
    since = np.asarray([-1 if s is None else s for s in steps_after_idle(records, idle_s)])
    cold = (kinds == "decode") & (since >= 1) & (since <= warmup_steps)

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
        keep = ~cold
        coef, pred = solve(Xs, keep)
        rel = (pred - y) / y
        mad = np.median(np.abs(rel[keep] - np.median(rel[keep]))) or 1e-9
        keep = ~cold & (np.abs(rel - np.median(rel[keep])) <= trim * mad * 1.4826 + 0.05)
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

    warmup: list[float] = []
    for pos in range(1, warmup_steps + 1):
        sel = cold & (since == pos)
        if sel.sum() < min_factor_steps:
            break
        warmup.append(float(np.median(y[sel] / pred[sel])))
    while warmup and abs(warmup[-1] - 1) <= 0.03:  # positions that run as fast as the rest add nothing
        warmup.pop()
    for pos, factor in enumerate(warmup, start=1):
        pred[since == pos] *= factor
    # the warm-up steps count in the wall-clock fit and the error reports from here on
    keep = keep | cold

    shape_errors = None
    wall_per_cpu = None
    per_output = wall_per_step = 0.0
    if use_cpu:
        shape_errors = error_report([r for r, kp in zip(records, keep) if kp], pred[keep], y[keep])
        outputs = np.asarray([r.num_outputs for r in records], dtype=float)
        # Plain least squares on seconds: the wall clock's noise is large and skewed, and what
        # the simulation needs right is the total.
        # A third term, per step: the gap between two steps (the loop's turn, the outputs' hand-off)
        # is flat in the tokens a step sampled (0.15-0.25 ms at 1-6 on the project's VM); without it
        # the per-token term took it, fitted on mostly one-token steps, and a batch of 5 paid it 5 times.
        c = _nnls(np.column_stack([pred[keep], outputs[keep], np.ones(int(keep.sum()))]), wall[keep])
        wall_per_cpu, per_output, wall_per_step = float(c[0]), float(c[1]), float(c[2])
        if wall_per_cpu <= 0:
            wall_per_cpu, per_output, wall_per_step = float(wall[keep].sum() / pred[keep].sum()), 0.0, 0.0
        k = k * wall_per_cpu
        k[_COL_STEP] += wall_per_step
        pred = pred * wall_per_cpu + per_output * outputs + wall_per_step
        y = wall

    def eff(inv_rate, peak):
        return float(1.0 / (inv_rate * peak)) if inv_rate > 0 else 0.0

    # the peak CostModel will divide the GEMM FLOPs by (fp8 weights on fp8 tensor cores)
    gemm_peak = (base.fp8_peak_flops * base.fp8_matmul_share
                 if model.weight_bytes_per_param == 1 and base.fp8_peak_flops > 0
                 else base.peak_flops * base.matmul_share)

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
    # Every step's miss, trimmed ones too (a stall is part of what a client sees), as quantiles.
    residual_quantiles = scatter_quantiles(y - pred)
    params = replace(
        base,
        step_overhead_s=float(k[_COL_STEP]), per_request_overhead_s=float(k[_COL_REQ]),
        per_prefill_overhead_s=float(k[_COL_CHUNK]), per_output_overhead_s=per_output,
        per_token_overhead_s=0.0, swap_step_overhead_s=swap_step_s,  # the rest is in the fitted terms
        kernel_launch_s=0.0,  # the fitted per-step constant holds the launches the trace's steps paid
        gemm_curve={}, elementwise={},  # the fitted GEMM rates and constants hold what a kernel profile priced
        gemm_mfu=eff(k[_COL_LF], gemm_peak), gemm_mbu=eff(k[_COL_LB], base.mem_bandwidth * base.mem_share),
        attn_mfu=eff(k[_COL_AF], base.peak_flops), attn_mbu=eff(k[_COL_AB], base.mem_bandwidth * base.mem_share),
        attention_pad_share=float(pad_share), host_bandwidth=host_bw, host_link_efficiency=host_eff,
        token_count_factors=factors, warmup_factors=warmup, coverage=coverage,
        source=f"calibrated on {int(keep.sum())} of {len(y)} steps",
    )
    rel = (pred - y) / y
    errors = error_report([r for r, kp in zip(records, keep) if kp], pred[keep], y[keep])
    report = {
        "num_steps": int(len(y)), "num_used": int(keep.sum()), "form": form,
        "target": "cpu_time, then the wall clock" if use_cpu else "wall-clock step cost",
        "wall_per_cpu": wall_per_cpu, "per_output_overhead_s": per_output, "wall_per_step_s": wall_per_step,
        "shape_errors": shape_errors,
        "mean_abs_rel_error": float(np.mean(np.abs(rel[keep]))),
        "median_abs_rel_error": float(np.median(np.abs(rel[keep]))),
        "total_time_error": float(pred[keep].sum() / y[keep].sum() - 1),
        "token_count_factors": factors, "attention_pad_share": float(pad_share),
        "warmup_factors": warmup, "warmup_steps_seen": [int((cold & (since == pos)).sum())
                                                        for pos in range(1, warmup_steps + 1)],
        "pad_share_scores": {str(s): score(s) for s in shares} if len(shares) > 1 else None,
        "step_gap": gap_info, "host_bandwidth": host_source, "coverage": coverage, "errors": errors,
        # How widely steps scatter around the model (measured / predicted): the simulator
        # predicts means; on a shared machine single steps land this far either side.
        "step_time_spread": {"p10": float(np.percentile(ratios, 10) / ratios.mean()),
                             "p50": float(np.percentile(ratios, 50) / ratios.mean()),
                             "p90": float(np.percentile(ratios, 90) / ratios.mean()),
                             "p99": float(np.percentile(ratios, 99) / ratios.mean())},
        "warnings": calibration_warnings(coverage, host_note, max_model_len, max_num_seqs),
        "step_residual_quantiles_s": residual_quantiles,
    }
    return params, report
