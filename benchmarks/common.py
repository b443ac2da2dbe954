"""Shared helpers for benchmarks: a random checkpoint of a chosen size, made on the fly."""
from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

SIZES = {
    # name: (hidden, layers, heads, kv_heads, intermediate, vocab)  ~ parameter count
    "tiny": (64, 2, 4, 2, 128, 384),            # ~0.1M, smoke runs
    "20m": (384, 6, 6, 2, 1024, 8192),          # ~13M
    "100m": (768, 12, 12, 4, 2048, 32000),      # ~100M (tied embeddings)
}


def benchmark_checkpoint(size: str, cache_dir: Path | None = None) -> Path:
    from checkpoints import make_checkpoint

    hidden, layers, heads, kv_heads, inter, vocab = SIZES[size]
    path = (cache_dir or Path("/tmp/pagedserve-bench")) / f"llama-{size}"
    if not (path / "config.json").exists():
        make_checkpoint(path, "llama", hidden=hidden, layers=layers, heads=heads, kv_heads=kv_heads, inter=inter,
                        vocab=vocab, max_pos=2048, init_std=0.02, tie_word_embeddings=True)
    return path


def param_count(path: Path) -> int:
    cfg = json.loads((path / "config.json").read_text())
    h, i, v, L = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"], cfg["num_hidden_layers"]
    kv = cfg["num_key_value_heads"] * h // cfg["num_attention_heads"]
    per_layer = 2 * h * h + 2 * h * kv + 3 * h * i + 2 * h
    return v * h + L * per_layer + h + (0 if cfg.get("tie_word_embeddings") else v * h)


def write_result(name: str, result: dict) -> Path:
    out = ROOT / "results"
    out.mkdir(exist_ok=True)
    path = out / f"{name}.json"
    path.write_text(json.dumps(result, indent=2))
    return path


def quantile(values: list[float], q: float) -> float:
    """The q-quantile (0-1) as the nearest lower rank: a value that was measured, not interpolated
    (step and call timings, where the 10th percentile is the runs no other load slowed)."""
    ordered = sorted(values)
    return ordered[int(q * (len(ordered) - 1))]


def percentile(values: list[float], q: float) -> float:
    import numpy as np
    return float(np.percentile(values, q)) if values else float("nan")


def run_in_process(engine, workload, params_for) -> dict:
    """Replay `workload` into an in-process Engine in wall-clock time (pagedserve.bench.replay)."""
    from pagedserve.bench.replay import replay

    records, duration = replay(engine, workload, clock="wall", params_for=params_for)
    return {"records": records, "workload": list(workload), "duration": duration}


def summarize(run: dict, only=None) -> dict:
    """Throughput and latency percentiles (ms); `only(workload_request)` picks whose latencies count."""
    recs = [r for r, w in zip(run["records"], run["workload"]) if only is None or only(w)]
    itl = [g * 1e3 for r in recs for g in r.itls()]
    ttft = [r.ttft * 1e3 for r in recs if r.ttft is not None]
    e2e = [r.e2el * 1e3 for r in recs if r.e2el is not None]
    out_tokens = sum(r.num_output_tokens for r in run["records"])
    return {
        "duration_s": run["duration"],
        "output_tokens": out_tokens,
        "output_throughput": out_tokens / run["duration"],
        "request_throughput": len(run["records"]) / run["duration"],
        "mean_ttft_ms": sum(ttft) / len(ttft), "p99_ttft_ms": percentile(ttft, 99),
        "median_itl_ms": percentile(itl, 50), "p99_itl_ms": percentile(itl, 99),
        "max_itl_ms": max(itl) if itl else float("nan"),
        "p99_e2el_ms": percentile(e2e, 99), "mean_e2el_ms": sum(e2e) / len(e2e),
        "preemptions": sum(r.num_preemptions for r in run["records"]),
    }


def print_side_by_side(title: str, columns: dict[str, dict], keys: list[str], ratio_of: tuple[str, str] | None = None):
    names = list(columns)
    print(title)
    header = f"{'':24}" + "".join(f"{n:>16}" for n in names)
    if ratio_of:
        header += f"{ratio_of[0] + '/' + ratio_of[1]:>22}"
    print(header)
    for k in keys:
        row = f"{k:24}" + "".join(f"{columns[n][k]:>16.2f}" for n in names)
        if ratio_of:
            a, b = columns[ratio_of[0]][k], columns[ratio_of[1]][k]
            row += f"{(a / b if b else float('nan')):>21.2f}x"
        print(row)


def gemm_build(source: str):
    """Another build of gemm.cpp (same flags as the engine's), bound like the engine's and checked
    to share its packed-weight layout: what the A/B benchmarks call beside the engine's own."""
    import ctypes

    from pagedserve import native
    from pagedserve.model.cpu import gemm

    src = Path(source).resolve()
    compiler = native.find_compiler()
    path = native.library_path(src, compiler)
    if not path.exists():
        native.compile_library(compiler, src, path)
    lib = ctypes.CDLL(str(path))
    lib.ps_abi_version.restype = ctypes.c_int
    gemm.bind(lib)
    now = gemm.load_gemm()
    layout = lambda lib: (lib.ps_abi_version(), lib.ps_gemm_panel_width(), lib.ps_gemm_bf16_panel_width())  # noqa: E731
    if layout(lib) != layout(now):
        raise SystemExit("--before: the two builds differ in ABI or panel width: their packed weights would differ")
    return lib
