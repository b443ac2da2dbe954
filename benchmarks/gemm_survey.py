"""GEMM survey: GFLOP/s of every candidate linear-layer implementation on this CPU, for the layer
shapes of the models pagedserve is measured on, at M = 1, 8, 32, 256 rows (decode batch sizes and a
prefill chunk), plus where the GEMM time inside a real decode step goes.

    python benchmarks/gemm_survey.py                     # everything (several minutes on 2 cores)
    python benchmarks/gemm_survey.py --sections hot,cold --models 246m --ms 8,32

Sections (each prints its own table, ratios against plain F.linear fp32 measured in the same run):
  hot     each shape alone, the same weight every call (cache-resident: the upper bound that
          earlier "timed alone" numbers measured)
  cold    one decode step's GEMMs in model order, each layer its own weight, so the weights stream
          from memory as they do in the engine (per-shape GFLOP/s and the step's GEMM total)
  compile torch.compile (inductor CPU, freezing; with and without max-autotune): compile time,
          recompiles as M varies, steady GFLOP/s
  threads the cold step under OpenMP settings (one subprocess each)
  engine  torch.profiler over real decode steps at --engine-batch running requests (246M): GEMM
          time inside the step vs the same GEMMs alone (cold), per linear method

Shapes: the fused qkv, o_proj, fused gate_up, down_proj and lm_head of the built-in 4M model and of
the 19M / 246M random Llamas that shared/peers/make_models.py makes (dimensions copied below).
Timing: the best of repeated calls within a small time budget (the minimum is the least disturbed
by other processes on a shared machine); read ratios, not absolute numbers.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pagedserve.cpu_isa import cpu_features  # noqa: E402
from pagedserve.model.layers import LINEAR_METHODS  # noqa: E402


@dataclass(frozen=True)
class ModelDims:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    inter: int
    vocab: int
    head_dim: int = 64

    def shapes(self) -> list[tuple[str, int, int]]:
        """(name, N = out features, K = in features) of one layer's GEMMs, then the head."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        return [("qkv", q + 2 * kv, self.hidden), ("o_proj", self.hidden, q),
                ("gate_up", 2 * self.inter, self.hidden), ("down", self.hidden, self.inter),
                ("lm_head", self.vocab, self.hidden)]


MODELS = {
    "4m": ModelDims(hidden=256, layers=4, heads=4, kv_heads=2, inter=688, vocab=4096),      # default_model
    "19m": ModelDims(hidden=256, layers=4, heads=4, kv_heads=2, inter=688, vocab=32000),    # peers tiny-llama
    "246m": ModelDims(hidden=1024, layers=16, heads=16, kv_heads=4, inter=2816, vocab=32000),  # small-llama
}


# -- candidates -----------------------------------------------------------------------------------
class Candidate:
    """One way to compute x @ w.T. prepare(w, m) returns the state run(x, state) needs."""

    name = ""
    dtype = torch.float32

    def prepare(self, w: torch.Tensor, m: int):
        return w

    def run(self, x, state):
        raise NotImplementedError


class PlainLinear(Candidate):
    name = "F.linear"

    def run(self, x, w):
        return F.linear(x, w)


class MmTransposed(Candidate):
    name = "x@wT (mm)"

    def prepare(self, w, m):
        return w.t().contiguous()

    def run(self, x, wt):
        return torch.mm(x, wt)


class MklPacked(Candidate):
    """MKL's cblas_sgemm_pack: the packed weight is only used when M equals the M it was packed
    for (torch falls back to a plain sgemm otherwise), so it is surveyed at its own M only."""

    name = "mkl packed @M"

    def prepare(self, w, m):
        return (torch.ops.mkl._mkl_reorder_linear_weight(w, m), w, m)

    def run(self, x, state):
        packed, w, m = state
        return torch.ops.mkl._mkl_linear(x, packed, w, None, m)


class UtilsMkldnn(Candidate):
    """torch.utils.mkldnn's MkldnnLinear: weight converted once, input converted every call."""

    name = "utils.mkldnn"

    def prepare(self, w, m):
        return w.to_mkldnn()

    def run(self, x, w):
        return torch._C._nn.mkldnn_linear(x.to_mkldnn(), w, None).to_dense()


class OneDNNAtM(Candidate):
    """oneDNN prepacked with the batch-size hint equal to the M it then runs at."""

    name = "onednn packed @M"

    def prepare(self, w, m):
        return torch.ops.mkldnn._reorder_linear_weight(w, m)

    def run(self, x, w):
        return torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")


class EngineMethod(Candidate):
    """A LinearMethod of pagedserve.model.layers, exactly as the engine runs it."""

    def __init__(self, method_name: str, dtype: torch.dtype) -> None:
        self.method = LINEAR_METHODS[method_name]
        self.dtype = dtype
        self.name = ("bf16 " if dtype == torch.bfloat16 else "") + f"engine:{method_name}"

    def prepare(self, w, m):
        return self.method.pack(w)

    def run(self, x, w):
        return self.method.apply(x, w, None)


def bf16(cls) -> Candidate:
    c = cls()
    c.dtype = torch.bfloat16
    c.name = "bf16 " + c.name
    return c


def candidates(want_bf16: bool) -> list[Candidate]:
    out: list[Candidate] = [PlainLinear(), EngineMethod("torch-t", torch.float32), MmTransposed(), MklPacked(),
                            UtilsMkldnn(), OneDNNAtM(), EngineMethod("onednn", torch.float32)]
    if want_bf16:
        out += [bf16(PlainLinear), EngineMethod("torch-t", torch.bfloat16), EngineMethod("onednn", torch.bfloat16)]
    return out


# -- timing ---------------------------------------------------------------------------------------
def best_seconds(fn, budget_s: float, min_reps: int = 5) -> float:
    for _ in range(2):
        fn()
    best, reps, start = float("inf"), 0, time.perf_counter()
    while reps < min_reps or time.perf_counter() - start < budget_s:
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
        reps += 1
    return best


def gflops(m: int, n: int, k: int, seconds: float) -> float:
    return 2 * m * n * k / seconds / 1e9


def unique_shapes(model_names: list[str]) -> list[tuple[str, int, int]]:
    seen, out = set(), []
    for name in model_names:
        for layer, n, k in MODELS[name].shapes():
            if (n, k) not in seen:
                seen.add((n, k))
                out.append((f"{name}.{layer}", n, k))
    return out


def print_table(title: str, rows: list[tuple[str, int, dict[str, float]]], names: list[str], unit: str) -> None:
    """rows: (shape label, M, {candidate: value}); prints values and ratio vs the first column."""
    base = names[0]
    print(f"\n## {title} ({unit}; ratio vs {base} in brackets)")
    width = max(14, max(len(n) for n in names) + 1)
    print(f"{'shape':22}{'M':>5}" + "".join(f"{n:>{width}}" for n in names))
    for label, m, vals in rows:
        cells = []
        for n in names:
            v = vals.get(n)
            if v is None:
                cells.append(f"{'-':>{width}}")
            elif n == base:
                cells.append(f"{v:>{width}.1f}")
            else:
                cells.append(f"{f'{v:.1f} ({v / vals[base]:.2f}x)':>{width}}")
        print(f"{label:22}{m:>5}" + "".join(cells))


# -- sections -------------------------------------------------------------------------------------
def interleaved_best(fns: dict[str, callable], budget_s: float, min_rounds: int = 5) -> dict[str, float]:
    """Best seconds of each fn, timed round-robin so that a burst of load from other processes
    hits every candidate alike instead of whichever happened to be running."""
    for fn in fns.values():
        fn()
        fn()
    best = {name: float("inf") for name in fns}
    rounds, start = 0, time.perf_counter()
    while rounds < min_rounds or time.perf_counter() - start < budget_s * len(fns):
        for name, fn in fns.items():
            t = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - t)
        rounds += 1
    return best


def section_hot(model_names, ms, cands, budget_s) -> list:
    rows = []
    for label, n, k in unique_shapes(model_names):
        w32 = torch.randn(n, k) * 0.02
        for m in ms:
            fns = {}
            for c in cands:
                x = torch.randn(m, k).to(c.dtype)
                state = c.prepare(w32.to(c.dtype), m)
                fns[c.name] = (lambda c=c, x=x, state=state: c.run(x, state))
            vals = {name: gflops(m, n, k, s) for name, s in interleaved_best(fns, budget_s).items()}
            del fns
            rows.append((label, m, vals))
            print(f"  hot {label} M={m}: " + ", ".join(f"{k_}={v:.0f}" for k_, v in vals.items()), flush=True)
    print_table("hot: each shape alone, same weight every call", rows, [c.name for c in cands], "GFLOP/s")
    return rows


def model_weights(dims: ModelDims) -> list[list[torch.Tensor]]:
    """fp32 random weights: one list of four per layer, then [lm_head]."""
    layers = [[torch.randn(n, k) * 0.02 for _, n, k in dims.shapes()[:4]] for _ in range(dims.layers)]
    _, n, k = dims.shapes()[4]
    return layers + [[torch.randn(n, k) * 0.02]]


def decode_step_gemms(dims: ModelDims, cand: Candidate, m: int, steps: int,
                      weights: list[list[torch.Tensor]] | None = None) -> tuple[float, dict[str, float]]:
    """Time every GEMM of `steps` decode steps in model order, each layer with its own weight.

    Returns (best step's GEMM seconds, {layer name: GFLOP/s in that step})."""
    shapes = dims.shapes()
    layer_shapes, head = shapes[:4], shapes[4]
    weights = weights or model_weights(dims)
    states = [[cand.prepare(w.to(cand.dtype), m) for w in layer] for layer in weights[:-1]]
    head_state = cand.prepare(weights[-1][0].to(cand.dtype), m)
    inputs = {k: torch.randn(m, k).to(cand.dtype) for _, _, k in shapes}
    best_total, best_split = float("inf"), {}
    for step in range(steps + 1):  # step 0 warms up (first-touch page faults, oneDNN primitive cache)
        split = {name: 0.0 for name, _, _ in shapes}
        for layer_states in states:
            for (name, _, k), state in zip(layer_shapes, layer_states):
                t = time.perf_counter()
                cand.run(inputs[k], state)
                split[name] += time.perf_counter() - t
        t = time.perf_counter()
        cand.run(inputs[head[2]], head_state)
        split[head[0]] += time.perf_counter() - t
        total = sum(split.values())
        if step and total < best_total:
            best_total, best_split = total, split
    rates = {}
    for name, n, k in shapes:
        count = 1 if name == "lm_head" else dims.layers
        rates[name] = gflops(m, n, k, best_split[name] / count)
    return best_total, rates


def section_cold(model_names, ms, cands, steps, rounds) -> dict:
    """Each candidate's step is timed `rounds` times, alternating candidates between rounds."""
    results = {}
    for model in model_names:
        dims = MODELS[model]
        weights = model_weights(dims)
        flop_per_row = 2 * sum(n * k * (1 if name == "lm_head" else dims.layers) for name, n, k in dims.shapes())
        step_rows, shape_rows = [], []
        for m in ms:
            best: dict[str, tuple[float, dict]] = {}
            for _ in range(rounds):
                for c in cands:
                    total, rates = decode_step_gemms(dims, c, m, steps, weights)
                    if c.name not in best or total < best[c.name][0]:
                        best[c.name] = (total, rates)
            step_vals = {name: flop_per_row * m / total / 1e9 for name, (total, _) in best.items()}
            print(f"  cold {model} M={m}: " + ", ".join(
                f"{name} {total * 1e3:.2f} ms" for name, (total, _) in best.items()), flush=True)
            step_rows.append((f"{model} all GEMMs", m, step_vals))
            for name, _, _ in dims.shapes():
                shape_rows.append((f"{model}.{name}", m, {c: r[name] for c, (_, r) in best.items()}))
            results[(model, m)] = step_vals
        names = [c.name for c in cands]
        print_table(f"cold: {model} decode step, GEMMs in model order, each layer its own weight",
                    step_rows + shape_rows, names, "GFLOP/s")
        del weights
    return results


def section_compile(ms, budget_s) -> None:
    """torch.compile of one F.linear per shape (246M shapes), dynamic M, weights frozen."""
    import torch._inductor.config as inductor_config
    from torch._dynamo.utils import counters

    inductor_config.freezing = True
    dims = MODELS["246m"]
    variants = [("inductor", torch.float32, None), ("inductor max-autotune", torch.float32, "max-autotune"),
                ("bf16 inductor max-autotune", torch.bfloat16, "max-autotune")]
    if not cpu_features().fast_bf16:
        variants = variants[:2]

    class OneLinear(torch.nn.Module):
        def __init__(self, w):
            super().__init__()
            self.w = torch.nn.Parameter(w, requires_grad=False)

        def forward(self, x):
            return F.linear(x, self.w)

    rows = []
    for label, n, k in [(f"246m.{name}", n, k) for name, n, k in dims.shapes()]:
        w32 = torch.randn(n, k) * 0.02
        per_m: dict[int, dict[str, float]] = {m: {} for m in ms}
        for vname, dtype, mode in variants:
            torch._dynamo.reset()
            module = OneLinear(w32.to(dtype)).eval()
            compiled = torch.compile(module, mode=mode, dynamic=True)
            graphs_before = counters["stats"]["unique_graphs"]
            first_calls = []
            with torch.inference_mode():
                for m in ms:
                    x = torch.randn(m, k).to(dtype)
                    t = time.perf_counter()
                    compiled(x)
                    first_calls.append(time.perf_counter() - t)
                    base = best_seconds(lambda: F.linear(x.float(), w32), budget_s) if vname == variants[0][0] else None
                    if base is not None:
                        per_m[m]["F.linear"] = gflops(m, n, k, base)
                    per_m[m][vname] = gflops(m, n, k, best_seconds(lambda: compiled(x), budget_s))
            graphs = counters["stats"]["unique_graphs"] - graphs_before
            print(f"  compile {label} {vname}: first calls at M={ms}: "
                  + ", ".join(f"{s:.2f}s" for s in first_calls) + f"; {graphs} graphs compiled", flush=True)
        for m in ms:
            rows.append((label, m, per_m[m]))
    print_table("compile: torch.compile(F.linear), dynamic M, freezing", rows,
                ["F.linear"] + [v[0] for v in variants], "GFLOP/s")


THREAD_SETTINGS = [
    ("default", {}),
    ("OMP_NUM_THREADS=1", {"OMP_NUM_THREADS": "1"}),
    ("OMP_WAIT_POLICY=PASSIVE", {"OMP_WAIT_POLICY": "PASSIVE"}),
    ("OMP_WAIT_POLICY=ACTIVE", {"OMP_WAIT_POLICY": "ACTIVE"}),
    ("OMP_PROC_BIND=close", {"OMP_PROC_BIND": "close", "OMP_PLACES": "cores"}),
]


def section_threads(ms, steps) -> None:
    """The cold 246M step under each OpenMP setting; each runs in a fresh process (OpenMP reads
    its environment once)."""
    print(f"\n## threads: cold 246M decode-step GEMMs (F.linear fp32) under OpenMP settings; "
          f"torch.get_num_threads()={torch.get_num_threads()}")
    base: dict[int, float] = {}
    for label, env in THREAD_SETTINGS:
        code = ("import sys, json; sys.argv=['x']; sys.path.insert(0, %r); import gemm_survey as g, torch; "
                "print(json.dumps({m: g.decode_step_gemms(g.MODELS['246m'], g.PlainLinear(), m, %d)[0] "
                "for m in %r}), torch.get_num_threads())" % (str(Path(__file__).parent), steps, ms))
        proc = subprocess.run([sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True,
                              text=True, timeout=900)
        if proc.returncode:
            print(f"{label:28} failed: {proc.stderr.strip().splitlines()[-1:]}")
            continue
        payload, threads = proc.stdout.strip().rsplit(" ", 1)
        seconds = {int(m): s for m, s in json.loads(payload).items()}
        base = base or seconds
        print(f"{label:28} threads={threads:>2} " + "  ".join(
            f"M={m}: {seconds[m] * 1e3:7.1f} ms ({base[m] / seconds[m]:.2f}x)" for m in ms))


def section_engine(model_path: str | None, batch: int, steps: int, methods: list[str], dtype: str) -> None:
    """Profile real decode steps and compare their GEMM time with the same GEMMs alone."""
    from torch.profiler import ProfilerActivity, profile

    from pagedserve import LLM, SamplingParams

    path = resolve_246m(model_path)
    dims = MODELS["246m"]
    print(f"\n## engine: {batch} running requests on {path} ({dtype}), {steps} decode steps profiled per method")
    gemm_ops = ("aten::mm", "aten::addmm", "mkldnn::_linear_pointwise", "aten::linear")
    for method in methods:
        os.environ["PAGEDSERVE_LINEAR_METHOD"] = method
        llm = LLM(str(path), dtype=dtype, max_model_len=1024, max_num_seqs=batch, enable_prefix_caching=False,
                  kv_cache_memory="2GiB")
        engine = llm.engine
        gen = torch.Generator().manual_seed(0)
        for i in range(batch):
            prompt = torch.randint(3, dims.vocab, (128,), generator=gen).tolist()
            engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=64 + steps, temperature=0,
                                                               ignore_eos=True))
        while any(r.num_computed_tokens < len(r.prompt_token_ids) for r in engine.scheduler.running) \
                or engine.scheduler.waiting:
            engine.step()
        for _ in range(3):
            engine.step()
        step_times = []
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(steps):
                t = time.perf_counter()
                engine.step()
                step_times.append(time.perf_counter() - t)
        events = prof.key_averages()
        # aten::linear's CPU time includes its aten::mm child; count the innermost GEMM ops only.
        gemm_us = sum(e.self_cpu_time_total for e in events if e.key in gemm_ops[:3])
        total_us = sum(e.self_cpu_time_total for e in events)
        gemm_ms = gemm_us / 1e3 / steps
        flop = 2 * batch * sum(n * k * (1 if name == "lm_head" else dims.layers) for name, n, k in dims.shapes())
        torch_dtype = getattr(torch, dtype)
        cand = EngineMethod(method, torch_dtype)
        alone_s, _ = decode_step_gemms(dims, cand, batch, 3)
        step_ms = statistics.median(step_times) * 1e3
        print(f"{method:10} step {step_ms:7.1f} ms (median), GEMMs {gemm_ms:6.1f} ms/step = "
              f"{gemm_us / max(total_us, 1):.0%} of profiled CPU time, {flop / (gemm_ms / 1e3) / 1e9:6.1f} GFLOP/s "
              f"in the engine vs {flop / alone_s / 1e9:6.1f} GFLOP/s alone ({alone_s * 1e3:.1f} ms) "
              f"-> engine/alone {alone_s * 1e3 / gemm_ms:.2f}x")
        top = sorted(events, key=lambda e: -e.self_cpu_time_total)[:6]
        print("           top ops: " + ", ".join(f"{e.key} {e.self_cpu_time_total / 1e3 / steps:.1f} ms" for e in top))
        del llm, engine


def resolve_246m(model_path: str | None) -> Path:
    if model_path:
        return Path(model_path)
    peer = Path(os.environ.get("PEERS_DIR", "/tmp/peers")) / "small-llama"
    if (peer / "config.json").exists():
        return peer
    sys.path.insert(0, str(ROOT / "tests"))
    from checkpoints import make_checkpoint

    path = Path("/tmp/pagedserve-bench/llama-246m")
    if not (path / "config.json").exists():
        d = MODELS["246m"]
        make_checkpoint(path, "llama", hidden=d.hidden, layers=d.layers, heads=d.heads, kv_heads=d.kv_heads,
                        inter=d.inter, vocab=d.vocab, max_pos=4096, init_std=0.02, rms_norm_eps=1e-5)
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sections", default="hot,cold,compile,threads,engine")
    ap.add_argument("--models", default="4m,19m,246m")
    ap.add_argument("--ms", default="1,8,32,256")
    ap.add_argument("--budget", type=float, default=0.08, help="seconds of repeats per hot cell")
    ap.add_argument("--steps", type=int, default=2, help="decode steps per cold cell (best counts)")
    ap.add_argument("--rounds", type=int, default=2, help="alternating rounds of the cold candidates")
    ap.add_argument("--candidates", default="", help="comma-separated candidate names to keep (default: all); "
                    "F.linear fp32 is always kept as the baseline")
    ap.add_argument("--model-path", default=None, help="246M checkpoint for the engine section")
    ap.add_argument("--engine-batch", type=int, default=32)
    ap.add_argument("--engine-steps", type=int, default=8)
    ap.add_argument("--engine-methods", default="torch,onednn")
    ap.add_argument("--engine-dtype", default="float32")
    args = ap.parse_args()
    sections = args.sections.split(",")
    models = args.models.split(",")
    ms = [int(m) for m in args.ms.split(",")]
    feats = cpu_features()
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, CPU {feats.describe()}, "
          f"oneDNN bf16 {torch.ops.mkldnn._is_mkldnn_bf16_supported()}, load average {os.getloadavg()[0]:.2f}")
    cands = candidates(want_bf16=feats.fast_bf16)
    if args.candidates:
        keep = {name.strip() for name in args.candidates.split(",")} | {"F.linear"}
        cands = [c for c in cands if c.name in keep]
    torch.manual_seed(0)
    with torch.inference_mode():
        if "hot" in sections:
            section_hot(models, ms, cands, args.budget)
        if "cold" in sections:
            section_cold(models, ms, cands, args.steps, args.rounds)
    if "compile" in sections:
        section_compile(ms, args.budget)
    if "threads" in sections:
        section_threads(ms, args.steps)
    if "engine" in sections:
        section_engine(args.model_path, args.engine_batch, args.engine_steps, args.engine_methods.split(","),
                       args.engine_dtype)
    print(f"\nload average at the end: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
