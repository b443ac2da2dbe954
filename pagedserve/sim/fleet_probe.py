"""Measure the fleet's own path on this machine: what `serve --replicas` adds around each replica's server.

    python -m pagedserve.sim.fleet_probe [--out pagedserve/sim/fleet_overhead.json] [--per-len 6]

One replica of the built-in model behind the real application (fleet/serve.py: Ray Serve's proxy,
the ingress, the router, the handle call, the replica's loopback HTTP), on a local Ray, with the
replica's request trace on. Streamed requests go one at a time (nothing queues), at prompts of
16-400 token ids and 2 or 24 output tokens. All processes share one clock (time.monotonic), so
each request splits into:

* inbound hop = replica's t_http - client's send (proxy, ingress, routing, the handle call, the
  loopback HTTP), fitted as ``request_s + per_prompt_token_s x prompt tokens`` (the body is the
  prompt's ids as JSON, parsed by the proxy, the ingress and the replica);
* outbound hop per streamed chunk = client's receipt - replica's t_first_out / t_last_out
  (the replica's uvicorn and its httpx reader, Ray's streaming generator to the ingress, the
  proxy): ``chunk_s``, the median;
* the replica's own serving layer, as a single server has it: admission = t_submit - t_http
  (``admit_s + admit_per_prompt_token_s x P``), delivery = t_first_out - t_first_token (``deliver_s``);
* CPU: the CPU time the proxy and the ingress processes (found by their Ray process titles) spend
  per request and per chunk, from runs of 2 and of 24 output tokens: the work a busy fleet's
  streams put on the cores its replicas run on; the same for the replica's process outside its
  engine's steps (its serving layer and its end of the stream: one interpreter lock with the
  engine thread); and Ray's CPU while the fleet idles (raylet, GCS, controller, probes), in cores;
* the replica's engine steps: their median wall / CPU time (``replica_step_stretch``), the share
  of a core the engine thread gets inside the fleet, to set against the calibration's own
  (sim/fleet.py `contention_scale`);
* the routing decision: fleet/routing.py's kv-aware `choose` on the benchmark's shape (two
  replicas, 8 tenants' prefixes cached), in-process.

Medians; the machine and its load recorded beside the fit. Needs ray[serve].
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

DEFAULTS_PATH = Path(__file__).with_name("fleet_overhead.json")
PROMPT_LENS = (16, 100, 200, 400)


def _fit_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least squares y = a + b x, b >= 0 (a slope below 0 is noise: a flat fit then)."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
    if b < 0:
        return statistics.median(ys), 0.0
    return my - b * mx, b


def _proc_cpu(needles: tuple[str, ...]) -> dict[str, float]:
    """CPU seconds (user + system) of the processes whose command line holds one of `needles`."""
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        for needle in needles:
            if needle in cmd:
                fields = stat.rsplit(")", 1)[1].split()
                out[needle] = out.get(needle, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return out


def step_stretch(steps) -> float:
    """The median wall / CPU time of an engine's steps (StepTrace): 1 when its thread had a core
    to itself, 2 when it got half of one (other processes, or the interpreter lock)."""
    ratios = sorted(st.step_time / st.cpu_time for st in steps if st.cpu_time > 0 and st.num_reqs)
    return ratios[len(ratios) // 2] if ratios else 1.0


def routing_cost(repeats: int = 2000) -> float:
    """Seconds per kv-aware decision: 2 replicas, 8 prefixes of 256 tokens cached, a 272-token prompt."""
    import random

    from pagedserve.fleet.routing import make_router, prompt_block_hashes

    rng = random.Random(0)
    prefixes = [[rng.randrange(16, 4000) for _ in range(256)] for _ in range(8)]
    router = make_router("kv-aware", 16, 0)
    router.set_replicas(["a", "b"])
    for i, p in enumerate(prefixes):
        router.replicas["ab"[i % 2]].cached.update(prompt_block_hashes(p, 16))
    prompts = [p + [rng.randrange(16, 4000) for _ in range(16)] for p in prefixes]
    t0 = time.perf_counter()
    for k in range(repeats):
        router.choose(prompts[k % len(prompts)])
    return (time.perf_counter() - t0) / repeats


def fleet_requests(per_len: int = 6, output_lens=(2, 24)) -> tuple[list[dict], dict]:
    """(one row per request: client and replica timestamps, output_len), CPU per run of the proxy
    and ingress processes."""
    import httpx
    import ray
    from ray import serve

    from pagedserve.config import EngineConfig
    from pagedserve.default_model_path import DEFAULT_MODEL_DIR
    from pagedserve.fleet.serve import free_port, run_fleet

    tmp = Path(tempfile.mkdtemp(prefix="ps-fleet-probe-"))
    env = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    if os.environ.get("PYTHONPATH"):
        env["PYTHONPATH"] = os.environ["PYTHONPATH"]
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
             _node_ip_address="127.0.0.1", runtime_env={"env_vars": env})
    rows: list[dict] = []
    cpu: dict = {}
    try:
        port = free_port()
        config = EngineConfig(model=str(DEFAULT_MODEL_DIR), max_model_len=1024, max_num_seqs=8,
                              enable_prefix_caching=False, step_trace_path=str(tmp / "steps.jsonl"))
        run_fleet(config, 1, "kv-aware", "127.0.0.1", port, blocking=False)
        url = f"http://127.0.0.1:{port}"
        with httpx.Client(base_url=url, timeout=120) as client:
            model = client.get("/v1/models").json()["data"][0]["id"]
            needles = ("ProxyActor", "FleetIngress", "EngineReplica")
            idle0, t_idle = _proc_cpu(needles + ("raylet", "gcs_server", "ServeController")), time.monotonic()
            time.sleep(5.0)
            idle1 = _proc_cpu(needles + ("raylet", "gcs_server", "ServeController"))
            cpu["idle_cores"] = {k: (idle1.get(k, 0.0) - idle0.get(k, 0.0)) / (time.monotonic() - t_idle) for k in idle1}
            for n_out in output_lens:
                for k in range(per_len + 1):   # the first round warms the path up and is dropped
                    if k == 1:
                        c0, t_warm = _proc_cpu(needles), time.monotonic()
                    for n in PROMPT_LENS:
                        body = {"model": model, "prompt": [16 + (i * 7 + k + 31 * n_out) % 3000 for i in range(n)],
                                "max_tokens": n_out, "stream": True, "ignore_eos": True, "temperature": 0.0}
                        row = {"prompt_len": n, "output_len": n_out, "warm": k > 0, "t_send": time.monotonic()}
                        with client.stream("POST", "/v1/completions", json=body) as r:
                            for line in r.iter_lines():
                                if line.startswith("data: ") and line != "data: [DONE]":
                                    now = time.monotonic()
                                    if "t_client_first" not in row:
                                        row["t_client_first"] = now
                                        row["id"] = json.loads(line[6:])["id"]
                                    row["t_client_last"] = now
                        rows.append(row)
                c1 = _proc_cpu(needles)
                cpu[n_out] = {"requests": per_len * len(PROMPT_LENS), "t0": t_warm,
                              "cpu_s": {k: c1.get(k, 0.0) - c0.get(k, 0.0) for k in needles}}
                t_warm = None
            time.sleep(1.0)
    finally:
        serve.shutdown()
        ray.shutdown()
    server = {}
    for path in tmp.glob("*.requests.jsonl"):
        for line in path.read_text().splitlines():
            if line.strip():
                r = json.loads(line)
                server[r["request_id"]] = r
    for row in rows:
        row.update({k: v for k, v in server.get(row.get("id"), {}).items() if k.startswith("t_")})
    # The replica's engine thread's CPU in its steps, per run: the rest of the replica's CPU is
    # its serving layer and its side of the streaming (the same process, one interpreter lock).
    from pagedserve.sim.calibration import read_trace
    steps = [st for path in tmp.glob("steps*.jsonl") if not path.name.endswith(".requests.jsonl")
             for st in read_trace(path)]
    cpu["replica_step_stretch"] = step_stretch(steps)
    runs = sorted((v["t0"], n) for n, v in cpu.items() if isinstance(n, int))
    for j, (t0, n) in enumerate(runs):
        t1 = runs[j + 1][0] if j + 1 < len(runs) else float("inf")
        cpu[n]["engine_step_cpu_s"] = sum(st.cpu_time for st in steps if t0 <= st.t_end < t1)
    return [r for r in rows if r["warm"] and r.get("t_http")], cpu


def measure(per_len: int = 6) -> dict:
    rows, cpu = fleet_requests(per_len)
    lens = [r["prompt_len"] for r in rows]
    inbound = [r["t_http"] - r["t_send"] for r in rows]
    admit = [r["t_submit"] - r["t_http"] for r in rows]
    request_s, per_token_s = _fit_line(lens, inbound)
    admit_s, admit_per_token_s = _fit_line(lens, admit)
    chunk_first = [r["t_client_first"] - r["t_first_out"] for r in rows]
    chunk_last = [r["t_client_last"] - r["t_last_out"] for r in rows]
    deliver = [r["t_first_out"] - r["t_first_token"] for r in rows]
    # CPU of the proxy and the ingress: per request (fixed) and per chunk, from the two output lengths.
    (lo, hi) = sorted(n for n in cpu if isinstance(n, int))

    def per_request_and_chunk(names) -> tuple[float, float]:
        tot = {n: sum(cpu[n]["cpu_s"][k] for k in names) / cpu[n]["requests"] for n in (lo, hi)}
        chunk = max(0.0, (tot[hi] - tot[lo]) / (hi - lo))
        return max(0.0, tot[lo] - chunk * lo), chunk

    proxy_per_request, proxy_per_chunk = per_request_and_chunk(("ProxyActor",))
    ingress_per_request, ingress_per_chunk = per_request_and_chunk(("FleetIngress",))
    for n in (lo, hi):   # the replica's CPU outside its engine's steps
        cpu[n]["cpu_s"]["EngineReplica"] -= cpu[n]["engine_step_cpu_s"]
    replica_per_request, replica_per_chunk = per_request_and_chunk(("EngineReplica",))
    fit = {"request_s": request_s, "per_prompt_token_s": per_token_s, "chunk_s": statistics.median(chunk_first + chunk_last),
           "proxy_cpu_per_request_s": proxy_per_request, "proxy_cpu_per_chunk_s": proxy_per_chunk,
           "ingress_cpu_per_request_s": ingress_per_request, "ingress_cpu_per_chunk_s": ingress_per_chunk,
           "admit_s": admit_s, "admit_per_prompt_token_s": admit_per_token_s, "deliver_s": statistics.median(deliver),
           "replica_cpu_per_request_s": replica_per_request, "replica_cpu_per_chunk_s": replica_per_chunk,
           "idle_cores": sum(cpu["idle_cores"].values()), "replica_step_stretch": cpu["replica_step_stretch"],
           "routing_s": routing_cost()}
    load = os.getloadavg()[0]
    fit["source"] = (f"fleet_probe on {platform.processor() or platform.machine()} "
                     f"({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, load {load:.1f})")
    by_len = {}
    for n in PROMPT_LENS:
        sel = [i for i, r in enumerate(rows) if r["prompt_len"] == n]
        by_len[n] = {"inbound_ms": statistics.median(inbound[i] for i in sel) * 1e3,
                     "admit_ms": statistics.median(admit[i] for i in sel) * 1e3}
    report = {"when": fit["source"], "load_average": load, "requests": len(rows), "by_prompt_len": by_len,
              "chunk_first_ms": statistics.median(chunk_first) * 1e3, "chunk_last_ms": statistics.median(chunk_last) * 1e3,
              "chunk_p90_ms": sorted(chunk_first + chunk_last)[int(0.9 * (len(rows) * 2 - 1))] * 1e3,
              "cpu_runs": {str(k): v for k, v in cpu.items()}}
    return {"fit": fit, "report": report}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="write the fit here (the shipped one: pagedserve/sim/fleet_overhead.json)")
    ap.add_argument("--per-len", type=int, default=6, help="requests per prompt length and output length")
    args = ap.parse_args(argv)
    result = measure(args.per_len)
    text = json.dumps(result, indent=2)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
