"""The serving layer by endpoint and by stream count: vLLM's API server and pagedserve's, in one sitting.

    OMP_NUM_THREADS=1 python benchmarks/serving_endpoint_probe.py [--python /tmp/peers/vllm/bin/python]
        [--model /tmp/peers/tiny-llama] [--out results/serving_endpoint_probe.json] [--rounds 2]

Three measurements, each the API process's CPU time (every thread's schedstat, ns: the machine is
shared, so CPU time, not wall; benchmarks/vllm_host_probe.py's clock) and, for vLLM, its engine core's:

1. **chat vs completions**, one streamed request at a time, text prompts of 16 / 200 / 800 tokens x
   1 and 16 outputs, 3 requests per cell, on /v1/completions and /v1/chat/completions in turn (the
   bodies `vllm bench serve` sends: `--backend openai` and `--backend openai-chat`, with
   stream_options.include_usage). Fitted per endpoint as ``a + b x prompt tokens + c x outputs``
   (least squares, non-negative); the ratios chat / completions per term are what the simulator's
   chat terms take (sim/host_overhead.py). The chat template is a one-message ChatML loop written
   here (the checkpoint has none); a model's own template (Qwen3's walks the messages twice) may cost
   more to render.
2. **delivery by stream count**: N = 1, 16, 64, 128 streams sent at once (prompt 16 tokens; chat
   beside completions at N = 64), twice with 4 and with 36 outputs each; (CPU(36) - CPU(4)) / 32 is the API process's work per step that
   feeds N streams (all N decode together: N x 16 prompt tokens fit one step), / N per output.
3. **vLLM's engine core per step** from the same bursts (its process tree's CPU, same difference),
   with a near-empty model (`--load-format dummy`, the checkpoint's config cut to one layer of
   hidden 128: the forward is a small part of the step), against N: V1's schedule, input
   preparation, sampler and output processing per step on this CPU.

Both servers: max-num-seqs 128, max-num-batched-tokens 4096, prefix caching off, one OpenMP thread,
the engine core in its own process (vLLM V1; pagedserve --engine-core-mode process). vLLM's venv is
only started as a subprocess.
"""
from __future__ import annotations

import argparse
import http.client
import json
import shutil
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from live import ROOT, Server, env, free_port, load_average  # noqa: E402
from vllm_host_probe import cpu_name, descendants, proc_cpu, timed_stream, tree_cpu  # noqa: E402

PROMPTS = (16, 200, 800)
OUTPUTS = (1, 16)
REPEATS = 3
STREAMS = (1, 16, 64, 128)
SHORT, LONG = 4, 36
CHAT_BURST = 64
ENDPOINTS = ("completions", "chat")
# A one-message ChatML loop (written for this probe; the tiny checkpoint ships no template).
CHAT_TEMPLATE = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
                 "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")

_TOK = None


def text_of(n: int, k: int) -> str:
    words = "the quick brown fox jumps over a lazy dog while seven bright stars watch".split()
    text = " ".join(words[(i * 5 + k) % len(words)] for i in range(n + 8))
    return _TOK.decode(_TOK.encode(text, add_special_tokens=False).ids[:n])


def stream(port: int, model: str, prompt: str, max_tokens: int, endpoint: str) -> dict:
    """One streamed request with the body `vllm bench serve` sends for the endpoint."""
    common = {"model": model, "temperature": 0.0, "stream": True, "ignore_eos": True, "min_tokens": max_tokens,
              "stream_options": {"include_usage": True}}
    if endpoint == "chat":
        path = "/v1/chat/completions"
        body = {**common, "messages": [{"role": "user", "content": prompt}], "max_completion_tokens": max_tokens}
    else:
        path = "/v1/completions"
        body = {**common, "prompt": prompt, "max_tokens": max_tokens}
    t0, times = timed_stream(port, path, body, 300)
    return {"ttft": times[0] - t0 if times else None, "chunks": len(times)}


def model_id(port: int) -> str:
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    c.request("GET", "/v1/models")
    out = json.loads(c.getresponse().read())["data"][0]["id"]
    c.close()
    return out


def one_at_a_time(srv: Server, k: int) -> list[dict]:
    pid, port = srv.proc.pid, srv.port
    model = model_id(port)
    rows = []
    for endpoint in ENDPOINTS:
        for n in PROMPTS:
            for m in OUTPUTS:
                c0, e0 = proc_cpu(pid), tree_cpu(descendants(pid))
                got = [stream(port, model, text_of(n, k * REPEATS + j), m, endpoint) for j in range(REPEATS)]
                time.sleep(0.05)
                c1, e1 = proc_cpu(pid), tree_cpu(descendants(pid))
                rows.append({"endpoint": endpoint, "prompt": n, "outputs": m, "api_cpu_s": (c1 - c0) / REPEATS,
                             "engine_cpu_s": (e1 - e0) / REPEATS, "chunks": got[0]["chunks"]})
    return rows


def burst(srv: Server, n_streams: int, outputs: int, endpoint: str, k: int) -> dict:
    pid, port = srv.proc.pid, srv.port
    model = model_id(port)
    prompts = [text_of(16, 1000 + k * 200 + j) for j in range(n_streams)]
    results: list[dict] = []
    threads = [threading.Thread(target=lambda p=p: results.append(stream(port, model, p, outputs, endpoint)))
               for p in prompts]
    c0, e0 = proc_cpu(pid), tree_cpu(descendants(pid))
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    time.sleep(0.2)
    c1, e1 = proc_cpu(pid), tree_cpu(descendants(pid))
    # Chunks can hold several tokens: vLLM's API process merges a stream's outputs that queued while
    # its consumer was behind (counted, not an error).
    return {"streams": n_streams, "outputs": outputs, "endpoint": endpoint, "api_cpu_s": c1 - c0,
            "engine_cpu_s": e1 - e0, "chunks": sum(r["chunks"] for r in results), "answered": len(results)}


def fit_endpoint(rows: list[dict], endpoint: str) -> dict:
    import numpy as np

    from pagedserve.sim.cost_model import _nnls

    sel = [r for r in rows if r["endpoint"] == endpoint]
    x = np.asarray([(1.0, r["prompt"], r["outputs"]) for r in sel])
    a, b, c = _nnls(x, np.asarray([r["api_cpu_s"] for r in sel]))
    return {"fixed_s": float(a), "per_prompt_token_s": float(b), "per_output_s": float(c), "rows": len(sel)}


def per_step(bursts: list[dict], key: str) -> dict:
    """Per N and endpoint: CPU per step feeding N streams = (CPU at LONG - CPU at SHORT) / (LONG - SHORT),
    the median over the rounds."""
    out: dict = {}
    for endpoint in {b["endpoint"] for b in bursts}:
        for n in sorted({b["streams"] for b in bursts if b["endpoint"] == endpoint}):
            longs = [b[key] for b in bursts if b["endpoint"] == endpoint and b["streams"] == n and b["outputs"] == LONG]
            shorts = [b[key] for b in bursts if b["endpoint"] == endpoint and b["streams"] == n and b["outputs"] == SHORT]
            diffs = [(lo - sh) / (LONG - SHORT) for lo, sh in zip(longs, shorts)]
            if not diffs:
                continue
            med = statistics.median(diffs)
            chunks = [b["chunks"] for b in bursts if b["endpoint"] == endpoint and b["streams"] == n]
            tokens = [b["streams"] * (b["outputs"] + (1 if endpoint == "chat" else 0)) for b in bursts
                      if b["endpoint"] == endpoint and b["streams"] == n]
            out.setdefault(endpoint, {})[str(n)] = {"per_step_s": med, "per_output_s": med / n, "each_round_s": diffs,
                                                    "chunks_per_frame_slot": sum(chunks) / sum(tokens)}
    return out


def line_fit(points: dict) -> dict:
    """per step = s0 + s1 x N, least squares non-negative, over the stream counts measured."""
    import numpy as np

    from pagedserve.sim.cost_model import _nnls

    ns = sorted(int(n) for n in points)
    s0, s1 = _nnls(np.asarray([(1.0, n) for n in ns]), np.asarray([points[str(n)]["per_step_s"] for n in ns]))
    return {"per_step_s": float(s0), "per_stream_s": float(s1), "streams": ns}


def chat_delta(server: dict) -> dict:
    """What the chat endpoint adds to a request, from one server's rows and bursts: admission (the
    one-output cells, chat - completions per cell, fitted as a + b x prompt tokens, non-negative) and
    per output under load (the chat burst's per-output CPU less the completions burst's at the same N,
    at least 0). Raw values beside the clamped ones."""
    import numpy as np

    from pagedserve.sim.cost_model import _nnls

    cells: dict = {}
    for r in server["rows"]:
        cells.setdefault((r["prompt"], r["outputs"]), {}).setdefault(r["endpoint"], []).append(r["api_cpu_s"])
    one = sorted((p, statistics.mean(c["chat"]) - statistics.mean(c["completions"]))
                 for (p, o), c in cells.items() if o == 1)
    a, b = _nnls(np.asarray([(1.0, p) for p, _ in one]), np.asarray([d for _, d in one]))
    n = str(CHAT_BURST)
    by = server["delivery_by_streams"]
    per_out = by["chat"][n]["per_output_s"] - by["completions"][n]["per_output_s"]
    return {"admit_s": float(a), "admit_per_prompt_token_s": float(b), "deliver_per_output_s": max(0.0, per_out),
            "raw": {"one_output_cells": one, "per_output_at_burst_s": per_out, "burst_streams": CHAT_BURST}}


def ship(report: dict, engine: dict | None, report_path: str, handover: dict | None = None) -> None:
    """The simulator's terms from a report (and, for vLLM's engine loop, vllm_engine_step_probe.py's):
    host_overhead_vllm.json gets vLLM's delivery per step and per stream (its bursts, raw: both on
    this machine), merge_outputs, a "chat" block (its completions terms + the chat deltas) and an
    "engine_loop"; host_overhead.json (pagedserve's probe) a "chat" block the same way."""
    from pagedserve.sim import host_overhead as ho

    when = f"{report['cpu']} ({report['when']}, load {report['load_before'].split()[0]}-{report['load_after'].split()[0]})"
    for name, path in (("vllm", ho.VLLM_SERVING_PATH), ("pagedserve", ho.DEFAULTS_PATH)):
        data = json.loads(path.read_text())
        fit = data["fit"]
        srv = report["servers"][name]
        delta = chat_delta(srv)
        src = f"benchmarks/serving_endpoint_probe.py on {when}: {report_path}"
        if name == "vllm":
            line = srv["delivery_line"]["completions"]
            fit["deliver_step_s"] = line["per_step_s"]
            fit["deliver_per_output_s"] = line["per_stream_s"]
            fit["merge_outputs"] = True
            fit["delivery_source"] = (f"API process CPU per step feeding N = {line['streams']} streams (a line "
                                      f"through them), {src}")
            if engine is not None:
                ns = sorted(int(n) for n in engine["by_streams"])
                import numpy as np

                from pagedserve.sim.cost_model import _nnls

                e0, e1 = _nnls(np.asarray([(1.0, n) for n in ns]),
                               np.asarray([engine["by_streams"][str(n)]["host_s"] for n in ns]))
                fit["engine_loop"] = {
                    "step_s": float(e0), "per_request_s": float(e1), "async_scheduling": True,
                    "source": (f"vLLM {engine['vllm']} V1 engine core per decode step less the model's compute, thread "
                               f"CPU time, N = {ns} (benchmarks/vllm_engine_step_probe.py, {engine['when']}, load "
                               f"{engine['load_before'].split()[0]}-{engine['load_after'].split()[0]}); async "
                               f"scheduling on, vLLM's default since 0.14 (vllm-project/vllm#27614)")}
        if name == "vllm" and handover is not None:
            # the fixed admission's part after the tokenizer await, out of the whole (kept as admit_s_whole)
            whole = fit.setdefault("admit_s_whole", fit["admit_s"])
            h = handover["fit"]
            fit["handover_s"], fit["handover_per_prompt_token_s"] = h["handover_s"], h["handover_per_prompt_token_s"]
            fit["admit_s"] = max(0.0, whole - h["handover_s"])
            fit["handover_source"] = (f"AsyncLLM.add_request in thread CPU time, vLLM {handover['vllm']} "
                                      f"(benchmarks/vllm_handover_probe.py, {handover['when']}, load "
                                      f"{handover['load_before'].split()[0]}-{handover['load_after'].split()[0]}); "
                                      f"admit_s is admit_s_whole less it")
        base = {k: fit.get(k, 0.0) for k in ("admit_s", "admit_per_prompt_token_s", "deliver_s",
                                             "deliver_per_output_s", "deliver_step_s", "handover_s",
                                             "handover_per_prompt_token_s")}
        fit["chat"] = {**base, "admit_s": base["admit_s"] + delta["admit_s"],
                       "admit_per_prompt_token_s": base["admit_per_prompt_token_s"] + delta["admit_per_prompt_token_s"],
                       "deliver_per_output_s": base["deliver_per_output_s"] + delta["deliver_per_output_s"],
                       "delta": delta,
                       "source": (f"the completions terms + chat - completions measured on {name}'s own server "
                                  f"(+{delta['admit_s'] * 1e3:.3f} ms + {delta['admit_per_prompt_token_s'] * 1e6:.2f} "
                                  f"us/prompt token, +{delta['deliver_per_output_s'] * 1e6:.1f} us/output), {src}")}
        path.write_text(json.dumps(data, indent=2) + "\n")
        print(f"wrote {path}: chat delta {delta['admit_s'] * 1e3:.3f} ms + {delta['admit_per_prompt_token_s'] * 1e6:.2f} "
              f"us/tok, +{delta['deliver_per_output_s'] * 1e6:.1f} us/output (raw {delta['raw']['per_output_at_burst_s'] * 1e6:+.1f})")


def checkpoints(model: Path, work: Path) -> tuple[Path, Path]:
    """The checkpoint with the probe's chat template, and vLLM's near-empty copy of it (one layer,
    hidden 128; weights random: --load-format dummy)."""
    chat = work / "chat-model"
    empty = work / "empty-model"
    for d in (chat, empty):
        if d.exists():
            shutil.rmtree(d)
        d.mkdir(parents=True)
        for f in model.iterdir():
            if f.name != "tokenizer_config.json" and not (d is empty and f.suffix == ".safetensors"):
                (d / f.name).symlink_to(f.resolve())
        tc = json.loads((model / "tokenizer_config.json").read_text())
        tc["chat_template"] = CHAT_TEMPLATE
        (d / "tokenizer_config.json").write_text(json.dumps(tc))
    cfg = json.loads((model / "config.json").read_text())
    cfg.update(num_hidden_layers=1, hidden_size=128, intermediate_size=256, num_attention_heads=2,
               num_key_value_heads=2, head_dim=64)
    (empty / "config.json").unlink()
    (empty / "config.json").write_text(json.dumps(cfg))
    return chat, empty


def vllm_server(python: str, model: Path, log: Path, dummy: bool) -> Server:
    port = free_port()
    cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--port", str(port),
           "--host", "127.0.0.1", "--dtype", "float32", "--max-model-len", "1024", "--max-num-seqs", "128",
           "--max-num-batched-tokens", "4096", "--no-enable-prefix-caching", "--served-model-name", "m"]
    if dummy:
        cmd += ["--load-format", "dummy"]
    e = env(1, {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"})
    e.pop("PYTHONPATH", None)
    return Server(cmd, port, log, e, timeout_s=900)


def pagedserve_server(model: Path, log: Path) -> Server:
    port = free_port()
    cmd = [sys.executable, "-m", "pagedserve.cli", "serve", "--model", str(model), "--port", str(port),
           "--host", "127.0.0.1", "--uvicorn-log-level", "warning", "--log-interval", "0", "--dtype", "float32",
           "--max-model-len", "1024", "--max-num-seqs", "128", "--max-num-batched-tokens", "4096",
           "--no-enable-prefix-caching", "--engine-core-mode", "process", "--served-model-name", "m"]
    return Server(cmd, port, log, env(1))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--python", default="/tmp/peers/vllm/bin/python")
    ap.add_argument("--model", default="/tmp/peers/tiny-llama")
    ap.add_argument("--out", default=str(ROOT / "results" / "serving_endpoint_probe.json"))
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--work", default="/tmp/serving-endpoint-probe")
    ap.add_argument("--streams", type=int, nargs="+", default=list(STREAMS))
    ap.add_argument("--ship", default=None, metavar="REPORT.json",
                    help="write the simulator's terms from a saved report into pagedserve/sim/host_overhead*.json "
                         "instead of measuring")
    ap.add_argument("--engine", default=None, metavar="ENGINE.json",
                    help="with --ship: vllm_engine_step_probe.py's report, for vLLM's engine loop")
    ap.add_argument("--handover", default=None, metavar="HANDOVER.json",
                    help="with --ship: vllm_handover_probe.py's report, for vLLM's hand-over to the engine core")
    args = ap.parse_args(argv)
    if args.ship:
        ship(json.loads(Path(args.ship).read_text()),
             json.loads(Path(args.engine).read_text()) if args.engine else None, args.ship,
             json.loads(Path(args.handover).read_text()) if args.handover else None)
        return 0
    global _TOK
    from tokenizers import Tokenizer

    model = Path(args.model)
    _TOK = Tokenizer.from_file(str(model / "tokenizer.json"))
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    chat_model, empty_model = checkpoints(model, work)
    load0, started = load_average(), time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    rows = {"vllm": [], "pagedserve": []}
    bursts = {"vllm": [], "pagedserve": []}
    with vllm_server(args.python, empty_model, work / "vllm.log", dummy=True) as v, \
            pagedserve_server(chat_model, work / "ps.log") as p:
        servers = {"vllm": v, "pagedserve": p}
        for name, srv in servers.items():  # warm-up, dropped
            for endpoint in ENDPOINTS:
                stream(srv.port, model_id(srv.port), text_of(200, 999), 8, endpoint)
        for k in range(args.rounds):
            for name, srv in servers.items():
                rows[name] += [dict(r, round=k) for r in one_at_a_time(srv, k)]
                print(f"round {k} {name}: one at a time done, load {load_average()}", flush=True)
            for n in args.streams:
                # completions at every N; chat beside it at one N (the per-chunk ratio under load)
                for endpoint in ENDPOINTS if n == CHAT_BURST else ("completions",):
                    for name, srv in servers.items():
                        for outputs in (SHORT, LONG):
                            bursts[name].append(dict(burst(srv, n, outputs, endpoint, k), round=k))
                print(f"round {k}: bursts of {n} done, load {load_average()}", flush=True)
                Path(args.work, "partial.json").write_text(json.dumps({"rows": rows, "bursts": bursts}))
    load1 = load_average()
    report = {"cpu": cpu_name(), "when": started, "load_before": load0, "load_after": load1,
              "vllm_python": args.python, "model": str(model), "chat_template": CHAT_TEMPLATE,
              "command": "OMP_NUM_THREADS=1 python benchmarks/serving_endpoint_probe.py " + " ".join(argv or sys.argv[1:]),
              "servers": {}}
    for name in rows:
        fits = {e: fit_endpoint(rows[name], e) for e in ENDPOINTS}
        ratio = {k: (fits["chat"][k] / fits["completions"][k] if fits["completions"][k] else None)
                 for k in ("fixed_s", "per_prompt_token_s", "per_output_s")}
        api = per_step(bursts[name], "api_cpu_s")
        eng = per_step(bursts[name], "engine_cpu_s")
        report["servers"][name] = {
            "one_at_a_time": fits, "chat_over_completions": ratio,
            "delivery_by_streams": api, "delivery_line": {e: line_fit(api[e]) for e in api},
            "engine_by_streams": eng, "engine_line": {e: line_fit(eng[e]) for e in eng},
            "rows": rows[name], "bursts": bursts[name]}
        print(f"\n{name}: one at a time, API CPU = fixed + per prompt token + per output")
        for e in ENDPOINTS:
            f = fits[e]
            print(f"  {e:12s} {f['fixed_s'] * 1e3:.3f} ms + {f['per_prompt_token_s'] * 1e6:.2f} us/tok + "
                  f"{f['per_output_s'] * 1e3:.3f} ms/output")
        print("  chat / completions: " + ", ".join(f"{k} {v:.2f}" if v else f"{k} -" for k, v in ratio.items()))
        for e in api:
            print(f"  {e}: API CPU per step feeding N streams: " + ", ".join(
                f"N={n}: {d['per_step_s'] * 1e3:.3f} ms ({d['per_output_s'] * 1e6:.1f} us/output)" for n, d in api[e].items()))
            lf = report["servers"][name]["delivery_line"][e]
            print(f"    line: {lf['per_step_s'] * 1e3:.3f} ms + {lf['per_stream_s'] * 1e6:.1f} us x N")
            print(f"  {e}: engine core CPU per step with N streams: " + ", ".join(
                f"N={n}: {d['per_step_s'] * 1e3:.3f} ms" for n, d in eng[e].items()))
    print(f"\nload {load0} -> {load1}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
