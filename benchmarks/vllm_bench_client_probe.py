"""Who is busy in a `vllm bench serve` burst: the client's CPU beside vLLM's API server's, per request.

    OMP_NUM_THREADS=1 python benchmarks/vllm_bench_client_probe.py [--python /tmp/peers/vllm/bin/python]
        [--num-prompts 300] [--input-len 128] [--output-len 4] [--out results/vllm_bench_client_probe.json]

GPUStack's 1,000 x 128-in / 4-out chat bursts ran at 44 req/s on an H100 and 37 on an A100 (both hosts
limiting, not the GPUs): ~23-27 ms of serial work a request. This runs the same client (vLLM's own
`vllm bench serve` code, vllm/benchmarks/serve.py, from the peers' venv, its random dataset, rate inf,
--backend openai-chat) against `vllm serve` of the near-empty checkpoint benchmarks/serving_endpoint_probe.py
writes (with its chat template), and reads the CPU time of the client process over its benchmark() (the
requests, after the dataset; process CPU time) and of the API server process (every thread's schedstat):
each endpoint twice, with N and N/6 prompts, the difference over the requests between. Both processes share this machine's
cores, so the figures are CPU time, not wall.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from live import ROOT, env, load_average  # noqa: E402
from serving_endpoint_probe import checkpoints, vllm_server  # noqa: E402
from vllm_host_probe import cpu_name, proc_cpu  # noqa: E402

# vLLM's client, with its benchmark() (the requests, after the dataset is made) timed in process CPU time
CLIENT = """
import sys, time
import vllm.benchmarks.serve as s
from vllm.utils.argparse_utils import FlexibleArgumentParser
orig = s.benchmark
async def benchmark(*a, **k):
    t0 = time.process_time()
    try:
        return await orig(*a, **k)
    finally:
        print(f"CLIENT_CPU_S {time.process_time() - t0}", flush=True)
s.benchmark = benchmark
p = FlexibleArgumentParser()
s.add_cli_args(p)
s.main(p.parse_args(sys.argv[1:]))
"""


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--python", default="/tmp/peers/vllm/bin/python")
    ap.add_argument("--model", default="/tmp/peers/tiny-llama")
    ap.add_argument("--num-prompts", type=int, default=300)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=4)
    ap.add_argument("--work", default="/tmp/serving-endpoint-probe")
    ap.add_argument("--out", default=str(ROOT / "results" / "vllm_bench_client_probe.json"))
    args = ap.parse_args(argv)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    _, empty = checkpoints(Path(args.model), work)
    load0, when = load_average(), time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    rows = {}
    with vllm_server(args.python, empty, work / "vllm-bench.log", dummy=True) as v:
        def one(endpoint: str, backend: str, n: int) -> tuple[float, float, dict]:
            cmd = [args.python, "-c", CLIENT, "--backend", backend, "--endpoint",
                   "/v1/chat/completions" if endpoint == "chat" else "/v1/completions",
                   "--base-url", v.url, "--model", "m", "--tokenizer", str(empty), "--dataset-name", "random",
                   "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len),
                   "--num-prompts", str(n), "--ignore-eos", "--disable-tqdm", "--seed", "0"]
            e = env(1)
            e.pop("PYTHONPATH", None)
            a0 = proc_cpu(v.proc.pid)
            out = subprocess.run(cmd, capture_output=True, text=True, env=e, timeout=900)
            time.sleep(0.5)
            a1 = proc_cpu(v.proc.pid)
            if out.returncode != 0:
                raise RuntimeError(out.stderr[-3000:])
            got = {k.strip(): float(x) for k, x in
                   (l.split(":", 1) for l in out.stdout.splitlines() if ":" in l and "(" in l) if _num(x)}
            inner = [float(l.split()[1]) for l in out.stdout.splitlines() if l.startswith("CLIENT_CPU_S ")]
            return inner[0], a1 - a0, got

        small = max(1, args.num_prompts // 6)
        for endpoint, backend in (("completions", "openai"), ("chat", "openai-chat")):
            c_small, a_small, _ = one(endpoint, backend, small)
            c_big, a_big, got = one(endpoint, backend, args.num_prompts)
            k = args.num_prompts - small  # the difference: the client's start-up, imports and dataset cancel
            rows[endpoint] = {"client_cpu_per_request_s": (c_big - c_small) / k,
                              "api_cpu_per_request_s": (a_big - a_small) / k, "bench": got,
                              "runs": {"small": [small, c_small, a_small], "big": [args.num_prompts, c_big, a_big]}}
            print(f"{endpoint:12s} client {(c_big - c_small) / k * 1e3:.2f} ms CPU/request, API server "
                  f"{(a_big - a_small) / k * 1e3:.2f} ms ({args.num_prompts} vs {small} requests at once); req/s "
                  f"{got.get('Request throughput (req/s)')}, load {load_average()}", flush=True)
    res = {"cpu": cpu_name(), "when": when, "load_before": load0, "load_after": load_average(),
           "num_prompts": args.num_prompts, "input_len": args.input_len, "output_len": args.output_len, "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


def _num(x: str) -> bool:
    try:
        float(x)
        return True
    except ValueError:
        return False


if __name__ == "__main__":
    raise SystemExit(main())
