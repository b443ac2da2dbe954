"""Measure the host-CPU terms of `host_overhead.HostOverhead` on this machine, from pagedserve's own code.

    python -m pagedserve.sim.host_probe [--out pagedserve/sim/host_overhead.json] [--repeats 3]

* engine loop: the real `EngineCore` (the scheduler and KV manager the simulator drives) with an
  executor that computes nothing, at decode batches of 1-64 and with prompt chunks of 64-512
  tokens beside them; each step's wall time, fitted as ``step_s + per_request_s x R + per_token_s x T``;
* admission: the request body's validation (the server's pydantic `CompletionRequest`) and the
  built-in model's tokenizer on prompts of 16-1,000 tokens: ``admit_s + admit_per_prompt_token_s x P``;
* delivery: one token through the server's incremental detokenizer plus one SSE frame
  (`json.dumps` of a chunk, as server/app.py builds it): ``deliver_per_output_s`` per request fed;
* the whole HTTP path (`--server`, the default): `pagedserve serve` of the built-in model on
  loopback with its request trace, one streamed request at a time at prompts of 16-800 tokens:
  admission = t_submit - t_http (uvicorn, the body, validation, tokenization, the hand-off),
  regressed on the prompt length, and delivery = t_first_out - t_first_token with one stream
  (``deliver_s``: the event loop's turn, the chunk, the queue hop). These replace the
  micro-benchmarks' admission, which miss the HTTP layer.

* the model runner's host side (`--runner`, the default; needs torch): the real `ModelRunner` of the
  built-in model, one thread, at decode batches of 1-64 with prompt chunks of 0-256 tokens beside
  them; the CPU time (`time.thread_time`, so a loaded machine does not inflate it) of the step's
  diffs and input tensors (`_apply_diffs`, `_prepare_inputs`: block tables, slots, positions, token
  ids), fitted as ``runner_step_s + runner_per_request_s x R + runner_per_token_s x T``. Every device's
  runner does this before its forward; the engine-loop probe's null executor skips it.
  `--runner-only` measures this part alone and writes it into an existing `--out` file.

Medians of `repeats` runs; the machine and its load are recorded beside the fit. Torch is needed
only for the runner part: the engine loop's executor is a stub and the tokenizer is the
`tokenizers` one the server loads.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

from pagedserve.sim.host_overhead import DEFAULTS_PATH, HostOverhead
from pagedserve.sim.instant_executor import InstantExecutor


def _core(max_num_seqs: int, max_tokens_per_step: int):
    from pagedserve.config import EngineConfig
    from pagedserve.core.engine_core import EngineCore
    from pagedserve.plan.kv_budget import KVPoolSize

    cfg = EngineConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_tokens_per_step, max_model_len=1024,
                       num_kv_blocks=4096, enable_prefix_caching=False, device="cpu", swap_space=0)
    cfg.resolve(1024)
    return EngineCore.build(cfg, InstantExecutor(4000), KVPoolSize(4096, cfg.block_size, 64))


def engine_steps(batches=(1, 4, 16, 64), chunks=(64, 256, 512), steps: int = 40) -> list[tuple[int, int, float]]:
    """(requests, tokens, seconds) of single engine steps."""
    from pagedserve.core.request import Request
    from pagedserve.sampling import SamplingParams

    rows = []
    for batch in batches:
        for chunk in (0, *chunks):
            core = _core(batch + 1, max(chunk, 1) + batch)
            params = SamplingParams(max_tokens=600, ignore_eos=True)
            for i in range(batch):
                core.add_request(Request(f"d{i}", [16 + i % 100] * 16, params, frozenset(), time.monotonic(), 0, 1024))
            while any(r.num_computed_tokens < len(r.prompt_token_ids) for r in core.scheduler.running) or \
                    core.scheduler.waiting:  # get every request decoding
                core.step()
            times = []
            for k in range(steps):
                if chunk:  # a prompt of one chunk arrives before the step, as in a mixed step
                    core.add_request(Request(f"p{k}", [17] * chunk, SamplingParams(max_tokens=1, ignore_eos=True),
                                             frozenset(), time.monotonic(), 0, 1024))
                t0 = time.perf_counter()
                core.step()
                times.append(time.perf_counter() - t0)
            rows.append((batch + (1 if chunk else 0), batch + chunk, statistics.median(times[5:])))
            core.shutdown()
    return rows


def admission(prompt_lens=(16, 128, 512, 1000), repeats: int = 30) -> list[tuple[int, float]]:
    """(prompt tokens, seconds) to validate a completion body and tokenize its prompt."""
    from transformers import AutoTokenizer

    from pagedserve.default_model_path import DEFAULT_MODEL_DIR
    from pagedserve.server.protocol import CompletionRequest

    tok = AutoTokenizer.from_pretrained(str(DEFAULT_MODEL_DIR))
    word = "the quick brown fox jumps over a lazy dog "
    rows = []
    for n in prompt_lens:
        text = word * 40
        while len(tok(text)["input_ids"]) < n:
            text += word * 40
        ids = tok(text)["input_ids"][:n]
        text = tok.decode(ids)
        body = json.dumps({"model": "m", "prompt": text, "max_tokens": 128, "stream": True, "temperature": 0.0})
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            req = CompletionRequest.model_validate_json(body)
            tok(req.prompt)["input_ids"]
            times.append(time.perf_counter() - t0)
        rows.append((n, statistics.median(times)))
    return rows


def delivery(num_tokens: int = 2000) -> float:
    """Seconds per output token: the incremental detokenizer's step and one SSE frame."""
    from transformers import AutoTokenizer

    from pagedserve.default_model_path import DEFAULT_MODEL_DIR
    from pagedserve.engine.detokenizer import IncrementalDetokenizer

    tok = AutoTokenizer.from_pretrained(str(DEFAULT_MODEL_DIR))
    ids = tok("the quick brown fox jumps over a lazy dog " * 400)["input_ids"][:num_tokens]
    detok = IncrementalDetokenizer(tok, ids[:16], [], False, True)
    created = int(time.time())
    t0 = time.perf_counter()
    for k, t in enumerate(ids):
        detok.add_token(t)
        text = detok.take_new_text(False)
        payload = {"id": "cmpl-probe", "object": "text_completion", "created": created, "model": "m",
                   "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": None}]}
        f"data: {json.dumps(payload)}\n\n".encode()
    return (time.perf_counter() - t0) / len(ids)


def server_requests(prompt_lens=(16, 64, 200, 400, 800), per_len: int = 6, timeout_s: float = 300.0) -> list[dict]:
    """The request trace of `pagedserve serve` (built-in model, loopback) under one streamed
    request at a time: admission and delivery with no queue in front of them."""
    import socket
    import subprocess
    import sys
    import tempfile
    import urllib.request

    import httpx

    from pagedserve.default_model_path import DEFAULT_MODEL_DIR
    from pagedserve.server.request_trace import request_trace_path

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    tmp = Path(tempfile.mkdtemp(prefix="ps-host-probe-"))
    trace = tmp / "steps.jsonl"
    cmd = [sys.executable, "-m", "pagedserve.cli", "serve", "--model", str(DEFAULT_MODEL_DIR), "--host", "127.0.0.1",
           "--port", str(port), "--uvicorn-log-level", "warning", "--log-interval", "0",
           "--step-trace-path", str(trace),
           "--max-model-len", "1024"]
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    log = open(tmp / "server.log", "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"host probe: the server exited with {proc.returncode}: "
                                   + (tmp / "server.log").read_text()[-2000:])
            try:
                with urllib.request.urlopen(url + "/v1/models", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("host probe: the server did not come up")
            time.sleep(0.5)
        with httpx.Client(base_url=url, timeout=60) as client:
            model = client.get("/v1/models").json()["data"][0]["id"]
            for k in range(per_len + 1):  # the first round warms the path up and is dropped
                for n in prompt_lens:
                    body = {"model": model, "prompt": [16 + (i * 7 + k) % 300 for i in range(n)], "max_tokens": 4,
                            "stream": True, "ignore_eos": True, "temperature": 0.0}
                    with client.stream("POST", "/v1/completions", json=body) as r:
                        for _ in r.iter_lines():
                            pass
    finally:
        if proc.poll() is None:
            import signal

            os.killpg(proc.pid, signal.SIGINT)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        log.close()
    rows = [json.loads(line) for line in request_trace_path(trace).read_text().splitlines() if line.strip()]
    return rows[len(prompt_lens):]


def runner_steps(batches=(1, 8, 32, 64), chunks=(0, 64, 256), steps: int = 12,
                 model_dir: str | Path | None = None) -> list[tuple[int, int, float]]:
    """(requests, tokens, CPU seconds) of the model runner's host work before the forward, the
    median over `steps` steps of each cell: `batch` requests decoding, and with `chunk` a prompt of
    that many tokens arriving before every step (a mixed step)."""
    import torch

    from pagedserve import EngineConfig, SamplingParams
    from pagedserve.default_model_path import DEFAULT_MODEL_DIR
    from pagedserve.engine import Engine

    torch.set_num_threads(1)
    engine = Engine(EngineConfig(model=str(model_dir or DEFAULT_MODEL_DIR), dtype="float32", device="cpu",
                                 max_num_seqs=max(batches) + 1, max_num_batched_tokens=max(batches) + max(chunks),
                                 max_model_len=1024, kv_cache_memory="64MiB", enable_prefix_caching=False))
    runner = engine.engine_core.executor
    spent = [0.0]

    def timed(fn):
        def wrapper(*args):
            t0 = time.thread_time()
            try:
                return fn(*args)
            finally:
                spent[0] += time.thread_time() - t0
        return wrapper

    runner._apply_diffs, runner._prepare_inputs = timed(runner._apply_diffs), timed(runner._prepare_inputs)
    rows = []
    k = 0
    try:
        for batch in batches:
            for chunk in chunks:
                for i in range(batch):
                    engine.add_request(f"d{k}", [16 + (i * 7 + k) % 200] * 32,
                                       SamplingParams(max_tokens=steps + 4, ignore_eos=True, temperature=0))
                    k += 1
                engine.step()  # the decoders' prompts
                times = []
                for _ in range(steps):
                    if chunk:
                        engine.add_request(f"p{k}", [17 + k % 200] * chunk,
                                           SamplingParams(max_tokens=1, ignore_eos=True, temperature=0))
                        k += 1
                    spent[0] = 0.0
                    engine.step()
                    times.append(spent[0])
                while engine.has_unfinished_requests():
                    engine.step()
                rows.append((batch + (1 if chunk else 0), batch + chunk, statistics.median(times[2:])))
    finally:
        if hasattr(engine, "shutdown"):
            engine.shutdown()
    return rows


def fit_runner(rows: list[tuple[int, int, float]]) -> tuple[tuple[float, float, float], float]:
    """(runner_step_s, runner_per_request_s, runner_per_token_s) by relative least squares, and
    the fit's median |error|."""
    import numpy as np

    a = np.asarray([(1.0, r, t) for r, t, _ in rows])
    y = np.asarray([max(s, 1e-9) for *_, s in rows])
    c = _nnls(a / y[:, None], np.ones(len(y)))
    return (float(c[0]), float(c[1]), float(c[2])), float(np.median(np.abs(a @ c / y - 1)))


def _nnls(a, b):
    from pagedserve.sim.cost_model import _nnls as nnls

    return nnls(a, b)


def probe_runner(repeats: int = 3) -> tuple[tuple[float, float, float], dict]:
    runs = [runner_steps() for _ in range(repeats)]
    rows = [(r, t, statistics.median(run[i][2] for run in runs)) for i, (r, t, _) in enumerate(runs[0])]
    terms, err = fit_runner(rows)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    report = {"when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "load_average": load,
              "clock": "thread CPU time", "steps": [{"requests": r, "tokens": t, "measured_s": s} for r, t, s in rows],
              "median_abs_rel_error": err}
    return terms, report


def probe(repeats: int = 3, server: bool = True, runner: bool = True) -> tuple[HostOverhead, dict]:
    import numpy as np

    step_runs = [engine_steps() for _ in range(repeats)]
    steps = [(r, t, statistics.median(run[i][2] for run in step_runs)) for i, (r, t, _) in enumerate(step_runs[0])]
    adm_runs = [admission() for _ in range(repeats)]
    adm = [(n, statistics.median(run[i][1] for run in adm_runs)) for i, (n, _) in enumerate(adm_runs[0])]
    per_output = statistics.median(delivery() for _ in range(repeats))

    a = np.asarray([(1.0, r, t) for r, t, _ in steps])
    y = np.asarray([s for *_, s in steps])
    c = _nnls(a / y[:, None], np.ones(len(y)))  # relative least squares
    ad = _nnls(np.asarray([(1.0, n) for n, _ in adm]), np.asarray([s for _, s in adm]))
    deliver_s = 0.0
    served = None
    if server:
        # One server run per repeat; the run with the least delivery time is kept: on a shared
        # machine the others measure the neighbours (the event loop waits for a CPU), not the work.
        runs = []
        for _ in range(repeats):
            traced = [q for q in server_requests() if q.get("t_http") is not None and q.get("t_first_out") is not None]
            delivery_y = [q["t_first_out"] - q["t_first_token"] for q in traced]
            runs.append((statistics.median(delivery_y), traced))
        delivery_median, traced = min(runs, key=lambda r: r[0])
        x = np.asarray([(1.0, float(q["prompt_len"])) for q in traced])
        adm_y = np.asarray([q["t_submit"] - q["t_http"] for q in traced])
        ad = _nnls(x, adm_y)
        deliver_s = max(0.0, delivery_median - per_output)
        served = {"num_requests": len(traced), "admission_median_s": float(np.median(adm_y)),
                  "delivery_median_s": float(delivery_median),
                  "delivery_median_s_of_each_run": [float(r[0]) for r in runs]}
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    runner_terms, runner_report = probe_runner(repeats) if runner else ((0.0, 0.0, 0.0), None)
    fit = HostOverhead(step_s=float(c[0]), per_request_s=float(c[1]), per_token_s=float(c[2]),
                       admit_s=float(ad[0]), admit_per_prompt_token_s=float(ad[1]), deliver_s=deliver_s,
                       deliver_per_output_s=float(per_output),
                       source=f"host_probe on {cpu} ({when}, load {load:.1f})" if load is not None else
                       f"host_probe on {cpu} ({when})",
                       runner_step_s=runner_terms[0], runner_per_request_s=runner_terms[1],
                       runner_per_token_s=runner_terms[2])
    pred = a @ c
    report = {"cpu": cpu, "when": when, "load_average": load, "python": platform.python_version(),
              "engine_steps": [{"requests": r, "tokens": t, "measured_s": s, "fitted_s": float(p)}
                               for (r, t, s), p in zip(steps, pred)],
              "engine_fit_median_abs_rel_error": float(np.median(np.abs(pred / y - 1))),
              "admission": [{"prompt_tokens": n, "measured_s": s} for n, s in adm],
              "delivery_per_output_s": per_output, "server": served, "runner": runner_report}
    return fit, report


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(DEFAULTS_PATH))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-server", dest="server", action="store_false",
                    help="skip the live server (admission from the micro-benchmarks only)")
    ap.add_argument("--no-runner", dest="runner", action="store_false",
                    help="skip the model runner's host side (it needs torch)")
    ap.add_argument("--runner-only", action="store_true",
                    help="measure only the model runner's host side and write it into the existing --out file")
    args = ap.parse_args(argv)
    if args.runner_only:
        data = json.loads(Path(args.out).read_text())
        terms, runner_report = probe_runner(args.repeats)
        data["fit"].update(runner_step_s=terms[0], runner_per_request_s=terms[1], runner_per_token_s=terms[2])
        load = runner_report["load_average"]
        source = data["fit"].get("source", "").split("; model runner")[0]
        data["fit"]["source"] = (f"{source}; model runner {runner_report['when']}, CPU time"
                                 + (f", load {load:.1f}" if load is not None else ""))
        data.setdefault("report", {})["runner"] = runner_report
        Path(args.out).write_text(json.dumps(data, indent=2) + "\n")
        print(f"model runner, host side: {terms[0] * 1e6:.0f} us + {terms[1] * 1e6:.2f} us/request + "
              f"{terms[2] * 1e6:.3f} us/token CPU time (median |error| {runner_report['median_abs_rel_error']:.1%}); "
              f"wrote {args.out}")
        return 0
    fit, report = probe(args.repeats, args.server, args.runner)
    Path(args.out).write_text(json.dumps({"fit": fit.to_dict(), "report": report}, indent=2) + "\n")
    print(f"engine step: {fit.step_s * 1e6:.0f} us + {fit.per_request_s * 1e6:.1f} us/request + "
          f"{fit.per_token_s * 1e6:.2f} us/token (median |error| {report['engine_fit_median_abs_rel_error']:.1%})")
    print(f"admission: {fit.admit_s * 1e6:.0f} us + {fit.admit_per_prompt_token_s * 1e6:.2f} us/prompt token; "
          f"delivery {fit.deliver_s * 1e6:.0f} us + {fit.deliver_per_output_s * 1e6:.1f} us per request per step")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
