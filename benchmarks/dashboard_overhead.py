"""Engine step time with a /dashboard page open vs closed, at 64 running requests.

    python benchmarks/dashboard_overhead.py                        # 20 ms "forward", 64k-block pool
    python benchmarks/dashboard_overhead.py --num-kv-blocks 65536 262144 --phase-s 3
    python benchmarks/dashboard_overhead.py --executor instant     # no forward: the engine's Python only

One server (dashboard on) runs 64 requests that never finish during the measurement; the
run alternates phases with no page connected ("closed") and with a page connected
("open": an SSE client in a separate process reading every frame, as a browser would), and
reports per phase kind:

- step period: wall time between consecutive steps' ends, measured on the engine's own
  clock: the step itself plus everything the engine thread does between steps (applying
  commands, the pool snapshot, handing outputs to the loop), and whatever the loop's work
  (folding steps into the charts, encoding frames) takes from it through the GIL;
- core step time: `EngineCoreOutputs.step_time` (schedule + execute + update only);
- the snapshots taken and their mean cost.

The model is replaced by an executor that samples at once and then waits `--forward-ms`
with the GIL released, as a GPU forward does (`--executor sleep`, the default: 20 ms, a
decode step of a mid-size model at 64 sequences); `--executor instant` drops the wait, so a
step is the engine's own Python work only (but then the front-end's loop cannot keep up with
64 requests' outputs on 2 cores and the measurement is of the loop's backlog, not of the
dashboard); `--executor model` runs the built-in model on the CPU. The ratio open / closed
is printed from the one run.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

SSE_READER = """
import json, sys, httpx
with httpx.stream("GET", sys.argv[1], timeout=None) as r:
    for line in r.iter_lines():
        if line.startswith("data: "):
            json.loads(line[6:])
"""


class SleepExecutor:
    """Samples at once, then holds the step for `forward_s` with the GIL released (a GPU forward)."""

    def __init__(self, forward_s: float, vocab: int) -> None:
        from pagedserve.sim.instant_executor import InstantExecutor

        self.inner = InstantExecutor(vocab)
        self.forward_s = forward_s

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def execute(self, out):
        result = self.inner.execute(out)
        if out.scheduled:
            time.sleep(self.forward_s)
            result.duration = result.forward_time = self.forward_s
        return result


def run_config(args, num_kv_blocks: int) -> dict:
    from pagedserve import EngineConfig
    from pagedserve.engine.async_llm import AsyncLLM
    from pagedserve.engine.llm_engine import Engine
    from pagedserve.metrics import EngineMetrics
    from pagedserve.server.app import build_app
    from pagedserve.server.launcher import ServerThread
    from pagedserve.sim.instant_executor import InstantExecutor
    from step_overhead import model_dir_with_room

    prompt_len, max_tokens = 32, args.max_tokens
    model = model_dir_with_room(prompt_len + max_tokens + 64)
    config = EngineConfig(model=str(model), max_num_seqs=args.seqs, num_kv_blocks=num_kv_blocks,
                          max_model_len=prompt_len + max_tokens + 64, enable_prefix_caching=True,
                          preemption_mode="recompute")
    executor = {"instant": lambda: InstantExecutor(4096), "sleep": lambda: SleepExecutor(args.forward_ms / 1e3, 4096),
                "model": lambda: None}[args.executor]()
    engine = Engine(config, executor=executor)
    metrics = EngineMetrics(engine.model_name, config.max_model_len, log_interval=0)
    async_engine = AsyncLLM(engine, metrics)
    app = build_app(async_engine)
    hub = app.state.dashboard
    steps: list[tuple[float, float]] = []   # (core timestamp, core step_time) of every real step
    snapshot_costs: list[tuple[float, float]] = []
    lock = threading.Lock()

    running = [0]

    def record(outs) -> None:  # on the loop, after the hub: the same cost in both phases
        running[0] = outs.stats.num_running
        if outs.step_time:
            with lock:
                steps.append((outs.timestamp, outs.step_time))

    def record_snapshot(snapshot) -> None:  # each pool snapshot comes as its own message, after its step
        with lock:
            snapshot_costs.append((snapshot.time, snapshot.cost))

    hub_cpu: list[tuple[float, float]] = []  # the loop's CPU time in the dashboard's ingest, per report

    def timed_ingest(outs, ingest=hub.ingest) -> None:
        cpu0 = time.thread_time()
        ingest(outs)
        hub_cpu.append((outs.timestamp, time.thread_time() - cpu0))

    async_engine.step_listeners[async_engine.step_listeners.index(hub.ingest)] = timed_ingest
    async_engine.step_listeners.append(record)
    async_engine.snapshot_listeners.append(record_snapshot)
    phases: list[tuple[str, float, float]] = []
    with ServerThread(app) as st:
        import httpx

        def one(i: int) -> None:
            try:
                httpx.post(st.url + "/v1/completions", timeout=None,
                           json={"prompt": [16 + (i * 7 + k) % 4000 for k in range(prompt_len)],
                                 "max_tokens": max_tokens, "ignore_eos": True, "temperature": 1.0})
            except httpx.HTTPError:
                pass  # the server stops under it at the end

        load = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(args.seqs)]
        for t in load:
            t.start()
        while running[0] < args.seqs:  # all of them admitted and running
            time.sleep(0.05)
        time.sleep(args.warmup_s)
        for k in range(args.pairs * 2):
            kind = "closed" if k % 2 == 0 else "open"
            reader = None
            if kind == "open":
                reader = subprocess.Popen([sys.executable, "-c", SSE_READER, st.url + "/dashboard/events"])
                while hub.gate.watchers == 0:
                    time.sleep(0.01)
            time.sleep(args.settle_s)
            t0 = time.monotonic()
            time.sleep(args.phase_s)
            t1 = time.monotonic()
            phases.append((kind, t0, t1))
            if reader is not None:
                reader.terminate()
                reader.wait()
                while hub.gate.watchers:
                    time.sleep(0.01)
        running_at_end = running[0]
        import logging  # the requests still running fail as the server stops under them: expected
        for name in ("pagedserve.server", "uvicorn.error", "asyncio"):
            logging.getLogger(name).setLevel(logging.CRITICAL)
    result = {"num_kv_blocks": num_kv_blocks, "executor": args.executor, "running_at_end": running_at_end}
    for kind in ("closed", "open"):
        periods, core, costs, loop_cpu = [], [], [], 0.0
        for k, t0, t1 in phases:
            if k != kind:
                continue
            window = [s for s in steps if t0 <= s[0] <= t1]
            if len(window) > 1:
                periods.append((window[-1][0] - window[0][0]) / (len(window) - 1))
            core += [s[1] for s in window]
            costs += [c for t, c in snapshot_costs if t0 <= t <= t1]
            loop_cpu += sum(c for t, c in hub_cpu if t0 <= t <= t1)
        result[kind] = {"step_period_ms": 1e3 * sum(periods) / len(periods),
                        "core_step_ms": 1e3 * sum(core) / len(core), "steps": len(core),
                        "snapshots": len(costs),
                        "snapshot_cost_ms": 1e3 * sum(costs) / len(costs) if costs else None,
                        "snapshot_cpu_per_step_ms": 1e3 * sum(costs) / len(core),
                        "loop_cpu_per_step_ms": 1e3 * loop_cpu / len(core)}
    result["ratio_step_period"] = result["open"]["step_period_ms"] / result["closed"]["step_period_ms"]
    result["ratio_core_step"] = result["open"]["core_step_ms"] / result["closed"]["core_step_ms"]
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seqs", type=int, default=64)
    ap.add_argument("--num-kv-blocks", type=int, nargs="+", default=[65536])
    ap.add_argument("--executor", choices=("sleep", "instant", "model"), default="sleep")
    ap.add_argument("--forward-ms", type=float, default=20.0, help="--executor sleep: the forward's duration")
    ap.add_argument("--max-tokens", type=int, default=12000, help="long enough that nobody finishes while measured")
    ap.add_argument("--pairs", type=int, default=3, help="closed/open phase pairs, alternating")
    ap.add_argument("--phase-s", type=float, default=2.0)
    ap.add_argument("--settle-s", type=float, default=0.5)
    ap.add_argument("--warmup-s", type=float, default=1.0)
    args = ap.parse_args()
    results = []
    for blocks in args.num_kv_blocks:
        r = run_config(args, blocks)
        results.append(r)
        c, o = r["closed"], r["open"]
        print(f"{args.seqs} running, {blocks} blocks, {args.executor} executor "
              f"({r['running_at_end']} still running at the end):")
        print(f"  step period  closed {c['step_period_ms']:7.3f} ms   open {o['step_period_ms']:7.3f} ms   "
              f"open/closed {r['ratio_step_period']:.3f}x")
        print(f"  core step    closed {c['core_step_ms']:7.3f} ms   open {o['core_step_ms']:7.3f} ms   "
              f"open/closed {r['ratio_core_step']:.3f}x")
        cost = "n/a" if o["snapshot_cost_ms"] is None else f"{o['snapshot_cost_ms']:.3f} ms CPU"
        print(f"  open: {o['snapshots']} snapshots in {o['steps']} steps, {cost} each on the engine thread "
              f"= {o['snapshot_cpu_per_step_ms']:.3f} ms per step")
        print(f"  the loop's CPU in the dashboard per step: closed {c['loop_cpu_per_step_ms']:.3f} ms, "
              f"open {o['loop_cpu_per_step_ms']:.3f} ms (folding the step; open: encoding frames)")
    from common import write_result
    print(f"wrote {write_result('dashboard_overhead', {'args': vars(args), 'results': results})}")


if __name__ == "__main__":
    main()
