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


def percentile(values: list[float], q: float) -> float:
    import numpy as np
    return float(np.percentile(values, q)) if values else float("nan")


def run_in_process(engine, workload, params_for) -> dict:
    """Replay `workload` (WorkloadRequests with arrival_time) against an Engine in wall-clock
    time: each request is added once its arrival time has passed, the engine steps in
    between. Returns per-request timings measured when step() hands tokens back.
    """
    import time

    pending = sorted(range(len(workload)), key=lambda i: workload[i].arrival_time)
    records: dict[str, dict] = {}
    start = time.perf_counter()
    nxt = 0
    while nxt < len(pending) or engine.has_unfinished_requests():
        now = time.perf_counter() - start
        while nxt < len(pending) and workload[pending[nxt]].arrival_time <= now:
            i = pending[nxt]
            w = workload[i]
            rid = f"r{i}"
            engine.add_request(rid, w.prompt_token_ids or w.prompt, params_for(w))
            records[rid] = {"arrival": w.arrival_time, "prompt_len": w.prompt_len, "token_times": [],
                            "tags": w.tags}
            nxt += 1
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, workload[pending[nxt]].arrival_time - now))
            continue
        outs = engine.step()
        t = time.perf_counter() - start
        for o in outs:
            rec = records[o.request_id]
            n = len(o.outputs[0].token_ids)
            rec["token_times"].extend([t] * (n - len(rec["token_times"])))
            if o.finished:
                rec["finish"] = t
                rec["num_preemptions"] = o.metrics[0].num_preemptions
    return {"records": records, "duration": time.perf_counter() - start}


def summarize(run: dict, only=None) -> dict:
    """Throughput and latency percentiles (ms) from run_in_process records."""
    recs = [r for r in run["records"].values() if only is None or only(r)]
    all_recs = list(run["records"].values())
    itl = [(b - a) * 1e3 for r in recs for a, b in zip(r["token_times"], r["token_times"][1:])]
    ttft = [(r["token_times"][0] - r["arrival"]) * 1e3 for r in recs if r["token_times"]]
    e2e = [(r["finish"] - r["arrival"]) * 1e3 for r in recs]
    out_tokens = sum(len(r["token_times"]) for r in all_recs)
    return {
        "duration_s": run["duration"],
        "output_tokens": out_tokens,
        "output_throughput": out_tokens / run["duration"],
        "request_throughput": len(all_recs) / run["duration"],
        "mean_ttft_ms": sum(ttft) / len(ttft), "p99_ttft_ms": percentile(ttft, 99),
        "median_itl_ms": percentile(itl, 50), "p99_itl_ms": percentile(itl, 99),
        "max_itl_ms": max(itl) if itl else float("nan"),
        "p99_e2el_ms": percentile(e2e, 99), "mean_e2el_ms": sum(e2e) / len(e2e),
        "preemptions": sum(r.get("num_preemptions", 0) for r in all_recs),
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
