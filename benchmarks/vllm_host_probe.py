"""vLLM's own serving overhead on this CPU, measured from the outside, beside pagedserve's in the same sitting.

    OMP_NUM_THREADS=1 python benchmarks/vllm_host_probe.py --text [--python /tmp/peers/vllm/bin/python]
        [--model /tmp/peers/tiny-llama] [--out pagedserve/sim/host_overhead_vllm.json] [--rounds 3]

Both servers run the same tiny checkpoint on loopback with one OpenMP thread and the engine core in a
process of its own (vLLM's V1 layout; pagedserve with --engine-core-mode process and --metric-names
vllm, so the same /metrics names answer). One streamed request at a time, prompts of 16-800 tokens,
1 and 16 output tokens (token ids; --text: text of about that many tokens, which each server
tokenizes); per request:

* the API process's CPU time (utime + stime of its /proc/PID/stat, every thread of it; the engine-core
  process is another PID): fitted as ``a + b x prompt tokens + c x output tokens``. CPU time hardly
  moves with the machine's load, wall time does. ``c`` is the per-chunk work (detokenize, one SSE
  frame); ``a - c + b x P`` is the request's own work (HTTP, parse, tokenize, hand-off, teardown).
* the wall residual: the client's TTFT minus the engine's queue and prefill time (the deltas of
  vllm:request_queue_time_seconds_sum and vllm:request_prefill_time_seconds_sum around the request),
  fitted as ``r0 + r1 x P``: the front-end's whole share of TTFT, its CPU work and its hops.
* ITL: the client's gaps against vllm:request_decode_time_seconds_sum / (outputs - 1), the engine's.

Bursts: BURST requests sent at once (prompt 200, 16 outputs), the API CPU per request against the
one-at-a-time fit (does the loop's cost per request fall when steps batch the streams?).

The measured profile (`--out`, read by `--host-profile vllm`, sim/host_overhead.py) keeps vLLM's terms
as ServingOverhead reads them, on this machine (speed 1.0: the probe machine, scaled by
--host-cpu-speed as the pagedserve profile is): admit_s = a - c, admit_per_prompt_token_s = b (CPU:
the loop is occupied), deliver_per_output_s = c (CPU, per request fed), deliver_s = r0 - a (the rest
of the residual: latency that occupies nothing, at least 0). The engine loop per step stays as
host_overhead.py says (this probe runs a real model; the step's host share is not separable from
outside). pagedserve's terms from the same sitting are recorded beside them, with the ratios.
vLLM's venv is never a dependency of pagedserve; this script only starts it as a subprocess.
"""
from __future__ import annotations

import argparse
import http.client
import json
import platform
import re
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from live import ROOT, Server, env, free_port, load_average  # noqa: E402

OUT = ROOT / "pagedserve" / "sim" / "host_overhead_vllm.json"
PROMPTS = (16, 64, 200, 400, 800)
OUTPUTS = (1, 16)
REPEATS = 3  # each cell this many times between two reads of the CPU clocks


def proc_cpu(pid: int) -> float:
    """Time on CPU of `pid`, every thread of it, seconds: the sum of its tasks' schedstat (ns
    resolution; /proc/PID/stat's utime + stime count 10 ms ticks, coarser than a request)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            total += int((task / "schedstat").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            pass
    return total / 1e9


def descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        for task in Path(f"/proc/{p}/task").iterdir():
            try:
                kids = [int(k) for k in (task / "children").read_text().split()]
            except OSError:
                kids = []
            out += kids
            todo += kids
    return out


def tree_cpu(pids: list[int]) -> float:
    total = 0.0
    for p in pids:
        try:
            total += proc_cpu(p)
        except OSError:
            pass
    return total


def metric_sum(text: str, name: str) -> float:
    return sum(float(v) for v in re.findall(rf"^{re.escape(name)}(?:\{{[^}}]*\}})?\s+(\S+)", text, re.M))


def scrape(port: int) -> str:
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    c.request("GET", "/metrics")
    text = c.getresponse().read().decode()
    c.close()
    return text


def timed_stream(port: int, path: str, body: dict, timeout: float) -> tuple[float, list[float]]:
    """POST one streamed request on loopback: (the send's perf_counter time, the time each SSE
    chunk that carries choices was read)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    t0 = time.perf_counter()
    conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
    r = conn.getresponse()
    if r.status != 200:
        raise RuntimeError(f"HTTP {r.status} on {path}: {r.read()[:300]!r}")
    times = []
    while True:
        line = r.readline()
        if not line:
            break
        line = line.strip()
        if line.startswith(b"data:") and line[5:].strip() != b"[DONE]":
            j = json.loads(line[5:])
            if j.get("choices"):
                times.append(time.perf_counter())
    conn.close()
    return t0, times


def stream(port: int, model: str, prompt: list[int], max_tokens: int) -> dict:
    t0, times = timed_stream(port, "/v1/completions", {
        "model": model, "prompt": prompt, "max_tokens": max_tokens, "min_tokens": max_tokens, "ignore_eos": True,
        "temperature": 0.0, "stream": True}, 120)
    return {"ttft": times[0] - t0, "gaps": [b - a for a, b in zip(times, times[1:])], "chunks": len(times)}


_TEXT = None  # with --text: the checkpoint's tokenizer, and prompts are text of about n tokens


def prompt_ids(n: int, k: int) -> list[int] | str:
    if _TEXT is not None:
        words = "the quick brown fox jumps over a lazy dog while seven bright stars watch".split()
        text = " ".join(words[(i * 5 + k) % len(words)] for i in range(n + 8))
        return _TEXT.decode(_TEXT.encode(text, add_special_tokens=False).ids[:n])
    return [16 + (i * 7 + k * 13) % 300 for i in range(n)]


def measure(server: Server, rounds: int, burst: int) -> dict:
    pid = server.proc.pid
    port = server.port
    model = json.loads(urllib_get(port, "/v1/models"))["data"][0]["id"]
    for k in range(3):  # warm-up, dropped
        stream(port, model, prompt_ids(200, 900 + k), 8)
    sent = getattr(server, "sent", 0) + 3  # requests so far: the index of each in a request trace
    rows = []
    for k in range(rounds):
        for n in PROMPTS:
            for m in OUTPUTS:
                before = scrape(port)
                c0, e0 = proc_cpu(pid), tree_cpu(descendants(pid))
                got = [stream(port, model, prompt_ids(n, k * REPEATS + j), m) for j in range(REPEATS)]
                time.sleep(0.05)  # the last request's teardown after [DONE]
                c1, e1 = proc_cpu(pid), tree_cpu(descendants(pid))
                after = scrape(port)
                d = {name: (metric_sum(after, f"vllm:{name}_sum") - metric_sum(before, f"vllm:{name}_sum")) / REPEATS
                     for name in ("request_queue_time_seconds", "request_prefill_time_seconds",
                                  "request_decode_time_seconds", "time_to_first_token_seconds")}
                gaps = [g for res in got for g in res["gaps"]]
                rows.append({"prompt": n, "outputs": m, "api_cpu_s": (c1 - c0) / REPEATS,
                             "engine_cpu_s": (e1 - e0) / REPEATS,
                             "ttft_s": statistics.median(res["ttft"] for res in got),
                             "ttfts_s": [res["ttft"] for res in got], "chunks": got[0]["chunks"],
                             "itl_mean_s": statistics.mean(gaps) if gaps else None,
                             "trace_range": [sent, sent + REPEATS], **d})
                sent += REPEATS
    server.sent = sent + burst
    if not burst:
        return {"rows": rows, "burst": None}
    # one burst: `burst` streams at once
    results = []
    c0 = proc_cpu(pid)
    threads = [threading.Thread(target=lambda j=j: results.append(stream(port, model, prompt_ids(200, 500 + j), 16)))
               for j in range(burst)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    time.sleep(0.2)
    burst_cpu = (proc_cpu(pid) - c0) / burst
    ttfts = sorted(r["ttft"] for r in results)
    return {"rows": rows, "burst": {"requests": burst, "prompt": 200, "outputs": 16, "api_cpu_per_request_s": burst_cpu,
                                    "ttft_median_s": statistics.median(ttfts), "ttft_max_s": ttfts[-1]}}


def urllib_get(port: int, path: str) -> str:
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    c.request("GET", path)
    text = c.getresponse().read().decode()
    c.close()
    return text


def engine_times_from_trace(rows: list[dict], trace: Path) -> None:
    """pagedserve exports no vllm:request_prefill/queue/decode_time histograms: take the same
    spans from its request trace (t_scheduled -> t_first_token is vLLM's prefill time, the
    scheduled-to-first-token span; t_first_token -> t_last_token its decode time)."""
    from pagedserve.server.request_trace import request_trace_path

    lines = [json.loads(x) for x in request_trace_path(trace).read_text().splitlines() if x.strip()]
    for r in rows:
        got = lines[r["trace_range"][0]:r["trace_range"][1]]
        slack = 0 if _TEXT is None else 2 + r["prompt"] // 10  # text: the servers count the tokens (BOS, merges)
        if any(abs((q.get("prompt_len") or -99) - r["prompt"]) > slack for q in got):
            raise RuntimeError(f"request trace out of step with the requests sent at {r['trace_range']}")
        r["request_queue_time_seconds"] = statistics.mean(q["t_scheduled"] - q["t_submit"] for q in got)
        r["request_prefill_time_seconds"] = statistics.mean(q["t_first_token"] - q["t_scheduled"] for q in got)
        r["request_decode_time_seconds"] = statistics.mean(q["t_last_token"] - q["t_first_token"] for q in got)


def fit(measured: dict) -> dict:
    """The terms, from one server's rows (least squares, non-negative)."""
    import numpy as np

    from pagedserve.sim.cost_model import _nnls

    rows = measured["rows"]
    x = np.asarray([(1.0, r["prompt"], r["outputs"]) for r in rows])
    a, b, c = _nnls(x, np.asarray([r["api_cpu_s"] for r in rows]))
    resid = [r["ttft_s"] - r["request_queue_time_seconds"] - r["request_prefill_time_seconds"] for r in rows]
    r0, r1 = _nnls(np.asarray([(1.0, r["prompt"]) for r in rows]), np.asarray(resid))
    itl_gap = [r["itl_mean_s"] - r["request_decode_time_seconds"] / (r["outputs"] - 1)
               for r in rows if r["outputs"] > 1 and r["itl_mean_s"] is not None]
    eng_per_token = [r["engine_cpu_s"] / r["outputs"] for r in rows if r["outputs"] > 1]
    return {"api_cpu_fixed_s": float(a), "api_cpu_per_prompt_token_s": float(b), "api_cpu_per_output_s": float(c),
            "residual_fixed_s": float(r0), "residual_per_prompt_token_s": float(r1),
            "residual_median_s": float(statistics.median(resid)),
            "itl_minus_engine_median_s": float(statistics.median(itl_gap)) if itl_gap else None,
            "engine_cpu_per_output_median_s": float(statistics.median(eng_per_token)) if eng_per_token else None,
            "burst_api_cpu_per_request_s": measured["burst"]["api_cpu_per_request_s"],
            "fit_api_cpu_at_burst_s": float(a + b * measured["burst"]["prompt"] + c * measured["burst"]["outputs"]),
            # per request fed by a step that fed `burst` of them: the burst's CPU less its admissions
            "burst_api_cpu_per_output_s": float(max(0.0, measured["burst"]["api_cpu_per_request_s"]
                                                    - (a - c + b * measured["burst"]["prompt"]))
                                                / measured["burst"]["outputs"])}


def serving_terms(f: dict) -> dict:
    """ServingOverhead's terms from a fit (the module docstring says why each)."""
    return {"admit_s": max(0.0, f["api_cpu_fixed_s"] - f["api_cpu_per_output_s"]),
            "admit_per_prompt_token_s": f["api_cpu_per_prompt_token_s"],
            "deliver_s": max(0.0, f["residual_fixed_s"] - f["api_cpu_fixed_s"]),
            # ServingOverhead charges it per request a step fed, serially: the batched figure (the
            # one-stream c also holds the loop's wake-up per step, paid once whatever the batch)
            "deliver_per_output_s": f["burst_api_cpu_per_output_s"]}


def vllm_server(python: str, model: Path, log: Path) -> Server:
    port = free_port()
    cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--port", str(port),
           "--host", "127.0.0.1", "--dtype", "float32", "--max-model-len", "1024", "--max-num-seqs", "32",
           "--max-num-batched-tokens", "1024", "--no-enable-prefix-caching", "--served-model-name", "m"]
    e = env(1, {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"})
    e.pop("PYTHONPATH", None)  # vLLM's venv must not see this checkout
    return Server(cmd, port, log, e, timeout_s=900)


def pagedserve_server(model: Path, log: Path, trace: Path) -> Server:
    port = free_port()
    for p in (trace, trace.with_name(trace.stem + ".requests.jsonl")):
        p.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "pagedserve.cli", "serve", "--model", str(model), "--port", str(port),
           "--host", "127.0.0.1", "--uvicorn-log-level", "warning", "--log-interval", "0", "--dtype", "float32",
           "--max-model-len", "1024", "--max-num-seqs", "32", "--max-num-batched-tokens", "1024",
           "--no-enable-prefix-caching", "--engine-core-mode", "process", "--metric-names", "vllm",
           "--served-model-name", "m", "--step-trace-path", str(trace)]
    return Server(cmd, port, log, env(1))


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--python", default="/tmp/peers/vllm/bin/python")
    ap.add_argument("--model", default="/tmp/peers/tiny-llama")
    ap.add_argument("--out", default=str(OUT))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--burst", type=int, default=16)
    ap.add_argument("--work", default="/tmp/vllm-host-probe")
    ap.add_argument("--text", action="store_true",
                    help="send text prompts (each server tokenizes them, as `vllm bench serve` makes them do) "
                         "instead of token ids (the shipped profile was measured with --text)")
    args = ap.parse_args(argv)
    if args.text:
        global _TEXT
        from tokenizers import Tokenizer

        _TEXT = Tokenizer.from_file(str(Path(args.model) / "tokenizer.json"))

    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    model = Path(args.model)
    load0 = load_average()
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    # Both servers up at once, their rounds interleaved: the ratio is from one sitting.
    measured = {}
    with vllm_server(args.python, model, work / "vllm.log") as v, pagedserve_server(model, work / "ps.log", work / "ps.steps.jsonl") as p:
        parts = {"vllm": [], "pagedserve": []}
        bursts = {}
        for k in range(args.rounds):
            for name, srv in (("vllm", v), ("pagedserve", p)):
                got = measure(srv, 1, args.burst if k == 0 else 0)
                parts[name] += got["rows"]
                if got["burst"]:
                    bursts[name] = got["burst"]
                print(f"round {k} {name}: {len(got['rows'])} requests, load {load_average()}", flush=True)
        for name in parts:
            measured[name] = {"rows": parts[name], "burst": bursts[name]}
    engine_times_from_trace(measured["pagedserve"]["rows"], work / "ps.steps.jsonl")
    fits = {name: fit(m) for name, m in measured.items()}
    terms = {name: serving_terms(f) for name, f in fits.items()}
    load1 = load_average()
    ratio = {k: (terms["vllm"][k] / terms["pagedserve"][k] if terms["pagedserve"][k] else None) for k in terms["vllm"]}
    # The profile: the shipped pagedserve probe's terms (host_overhead.json, the same machine) times
    # vLLM / pagedserve per term from this sitting, so both profiles are the probe's method and one
    # machine's speed (a term whose pagedserve figure is 0 here takes vLLM's own).
    from pagedserve.sim.host_overhead import load_host_overhead

    base = load_host_overhead()
    profile = {k: (getattr(base, k) * ratio[k] if ratio[k] is not None else terms["vllm"][k]) for k in terms["vllm"]}
    source = (f"benchmarks/vllm_host_probe.py: vLLM's API server / pagedserve's, measured from outside in one "
              f"sitting on {cpu_name()} ({started}, load {load0.split()[0]}-{load1.split()[0]}, "
              f"{'text' if _TEXT is not None else 'token-id'} prompts), times {base.source}")
    data = {"fit": {**profile, "speed": 1.0, "source": source},
            "report": {"cpu": cpu_name(), "when": started, "load_before": load0, "load_after": load1,
                       "vllm_python": args.python, "model": str(model), "fits": fits, "terms": terms,
                       "ratio_vllm_over_pagedserve": ratio, "bursts": {n: m["burst"] for n, m in measured.items()},
                       "rows": {n: m["rows"] for n, m in measured.items()}}}
    Path(args.out).write_text(json.dumps(data, indent=2) + "\n")
    print(f"load {load0} -> {load1}")
    for name in ("vllm", "pagedserve"):
        f, t = fits[name], terms[name]
        print(f"{name:10s} API CPU {f['api_cpu_fixed_s'] * 1e3:.2f} ms + {f['api_cpu_per_prompt_token_s'] * 1e6:.2f} us/prompt tok"
              f" + {f['api_cpu_per_output_s'] * 1e3:.3f} ms/output; TTFT - queue - prefill {f['residual_fixed_s'] * 1e3:.2f} ms"
              f" + {f['residual_per_prompt_token_s'] * 1e6:.2f} us/prompt tok (median {f['residual_median_s'] * 1e3:.2f} ms);"
              f" ITL - engine {(f['itl_minus_engine_median_s'] or 0) * 1e3:.2f} ms; burst of {args.burst}: "
              f"{f['burst_api_cpu_per_request_s'] * 1e3:.2f} ms API CPU/request (one-stream fit {f['fit_api_cpu_at_burst_s'] * 1e3:.2f}),"
              f" {f['burst_api_cpu_per_output_s'] * 1e3:.3f} ms/output")
        print(f"{'':10s} -> admit {t['admit_s'] * 1e3:.2f} ms + {t['admit_per_prompt_token_s'] * 1e6:.2f} us/tok, "
              f"deliver {t['deliver_s'] * 1e3:.2f} ms + {t['deliver_per_output_s'] * 1e3:.3f} ms/request fed")
    print("profile (host_overhead.json x ratio): " + ", ".join(f"{k} {v * 1e3:.3f} ms" for k, v in profile.items()))
    print("vLLM / pagedserve: " + ", ".join(f"{k} {v:.2f}" if v is not None else f"{k} -" for k, v in ratio.items()))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
