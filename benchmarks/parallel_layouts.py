"""The simulator's parallel cost terms against the engine's own measured communication, on
this machine, in one run (issue 30).

1. Fit the collectives: two gloo ranks time all_reduce, all_gather and a send (half a
   ping-pong) over payloads of 256 B to 4 MiB; a least-squares line per op gives its
   per-call cost (the intercept) and per-byte cost (the slope). At 2 ranks a ring
   all-reduce moves its payload once per rank, so the all-reduce line is exactly
   `allreduce_latency_s + bytes / link_bandwidth` of sim/cost_model.py.
2. Run each layout on the same tiny MoE checkpoint (Mixtral-shaped, random weights), the
   mp executor throughout so every layout pays the same broadcast of the step: 1 rank
   (the base), tp=2, tp=2 + --enable-expert-parallel, pp=2, at two batch sizes. The
   ranks' CommObserver (model/parallel.py) times every all-reduce, MoE combine, logits
   gather, pipeline send and receive; the engine's step trace gives every step's shape
   and time.
3. Predict: the step cost's compute constants are fitted (`sim.cost_model.fit`, the
   calibration `simulate calibrate` runs) on the 1-rank run's own steps; each layout's
   steps are then priced by sim/parallel_cost.py's ParallelCostModel with the fitted
   all-reduce line as its link, and the table puts the predicted mean step and
   communication per step beside the measured ones.

4. Data parallelism (-dp 2, engine/dp_client.py): the same checkpoint behind two engine-core
   processes, dense (each core the whole model, no communication but the placement) and
   with --enable-expert-parallel (DP attention + EP: each core half the experts, tokens
   exchanged in every MoE layer, the cores in lockstep). The prompts of a batch are spread
   over the cores, so a core's steps are half the batch. Each core's step trace
   (<trace>.dp<rank>) and its collectives (PAGEDSERVE_COMM_STATS, engine/core_proc.py) are
   read back. The simulator's column for these rows is `simulate -dp 2 [--enable-expert-parallel]`
   (sim/data_parallel.py) on the same batch, sent at once: two simulated engine cores behind the
   DP client's own placement rule, each step priced by the compute fitted on the 1-rank run;
   under DP + EP the cores step in lockstep and each turn adds the MoE exchange
   (sim/parallel_cost.py DPExpertParallelCost: per MoE layer the engine's all-gathers of counts,
   tokens and routing and its all-reduce of the outputs, on the fitted all_reduce line as the
   link). Its step is the mean over both cores' steps, as the measured one is.

Measured communication per step is that of the rank with the most (its all-reduces
include waiting for the slower rank; under pp=2 the last stage's receive is mostly waiting
for stage 0: the bubble). The simulator's counterparts: TP all-reduce, EP all-to-all
(dispatch + combine), and PP's pipeline term (idle stage + sends).

    OMP_NUM_THREADS=1 python benchmarks/parallel_layouts.py [--hidden 256] [--layers 4]
        [--experts 8] [--batches 4 16] [--prompt-len 96] [--new-tokens 24]

Results: results/parallel_layouts.json. About 5 minutes on 2 shared cores.
"""
from __future__ import annotations

import argparse
import os
import random
import socket
import statistics
import time
from dataclasses import replace
from pathlib import Path

from common import write_result

SIZES = [256 * 4 ** i for i in range(8)]  # 256 B .. 4 MiB
LAYOUTS = [("1 rank", dict(tensor_parallel_size=1)), ("tp=2", dict(tensor_parallel_size=2)),
           ("tp=2+EP", dict(tensor_parallel_size=2, enable_expert_parallel=True)),
           ("pp=2", dict(pipeline_parallel_size=2))]


# -- 1. the collectives -----------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _collective_rank(rank: int, port: int, repeats: int, out) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    results = {}
    for nbytes in SIZES:
        x = torch.ones(nbytes // 4)
        gathered = [torch.empty_like(x) for _ in range(2)]
        ops = {"all_reduce": lambda: dist.all_reduce(x), "all_gather": lambda: dist.all_gather(gathered, x),
               "send": lambda: (dist.send(x, 1), dist.recv(x, 1)) if rank == 0 else (dist.recv(x, 0), dist.send(x, 0))}
        for name, op in ops.items():
            times = []
            for i in range(repeats + 3):
                dist.barrier()
                t0 = time.perf_counter()
                op()
                if i >= 3:
                    times.append(time.perf_counter() - t0)
            # a ping-pong is two sends
            results.setdefault(name, []).append((nbytes, statistics.median(times) / (2 if name == "send" else 1)))
    if rank == 0:
        out.put(results)
    dist.destroy_process_group()


def fit_collectives(repeats: int) -> dict:
    import numpy as np
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_collective_rank, args=(r, port, repeats, queue)) for r in range(2)]
    for p in procs:
        p.start()
    results = queue.get(timeout=600)
    for p in procs:
        p.join()
    fits = {}
    for name, points in results.items():
        x = np.array([b for b, _ in points], dtype=float)
        y = np.array([t for _, t in points])
        # relative least squares: the small payloads' microseconds weigh as much as the large ones'
        a = np.stack([np.ones_like(x), x], axis=1) / y[:, None]
        (latency, per_byte), *_ = np.linalg.lstsq(a, np.ones_like(y), rcond=None)
        fits[name] = {"latency_s": float(latency), "s_per_byte": float(per_byte),
                      "gb_per_s": float(1e-9 / per_byte) if per_byte > 0 else float("inf"),
                      "points": [(int(b), float(t)) for b, t in points]}
    return fits


# -- 2. the layouts ----------------------------------------------------------------------------
def checkpoint(hidden: int, layers: int, experts: int) -> Path:
    from checkpoints import make_checkpoint

    path = Path("/tmp/pagedserve-bench") / f"mixtral-layouts-{layers}x{hidden}-e{experts}"
    if not (path / "config.json").exists():
        make_checkpoint(path, "mixtral", hidden=hidden, layers=layers, heads=8, kv_heads=4, inter=2 * hidden,
                        vocab=4096, max_pos=2048, init_std=0.02, num_local_experts=experts)
    return path


def run_layout(path: Path, flags: dict, batches: list[int], prompt_len: int, new_tokens: int,
               trace: Path) -> list[dict]:
    from pagedserve import LLM, SamplingParams
    from pagedserve.sim.cost_model import read_trace

    trace.unlink(missing_ok=True)
    llm = LLM(str(path), distributed_executor_backend="mp", max_model_len=1024, kv_cache_memory="256MiB",
              max_num_seqs=max(batches), max_num_batched_tokens=2048, enable_prefix_caching=False,
              step_trace_path=str(trace), **flags)
    rows = []
    try:
        ex = llm.engine.executor
        ex.set_comm_observer(True)
        rng = random.Random(0)
        params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
        llm.generate([[rng.randrange(2, 4096) for _ in range(prompt_len)]] * 2, params, use_tqdm=False)  # warm-up
        for batch in batches:
            prompts = [[rng.randrange(2, 4096) for _ in range(prompt_len)] for _ in range(batch)]
            done = len(read_trace(trace)) if trace.exists() else 0
            ex.reset_stats()
            t0 = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            wall = time.perf_counter() - t0
            stats = ex.worker_stats()
            steps = read_trace(trace)[done:]
            comm = [sum(v["seconds"] for v in s["comm"].values()) for s in stats]
            busiest = stats[max(range(len(stats)), key=lambda i: comm[i])]["comm"]
            rows.append({"batch": batch, "wall_s": wall, "steps": steps, "num_steps": len(steps),
                         "step_s": statistics.fmean(r.step_time for r in steps),
                         "comm_s_per_step": max(comm) / stats[0]["num_steps"],
                         "comm_by_rank": [s["comm"] for s in stats], "busiest_rank_comm": busiest,
                         "execute_s_per_step": [s["execute_seconds"] / s["num_steps"] for s in stats],
                         "tokens": [list(o.outputs[0].token_ids) for o in outs]})
    finally:
        llm.shutdown()
    return rows


DP_LAYOUTS = [("dp=2", dict(data_parallel_size=2)),
              ("dp=2+EP", dict(data_parallel_size=2, enable_expert_parallel=True))]


def run_dp_layout(path: Path, flags: dict, batches: list[int], prompt_len: int, new_tokens: int,
                  trace: Path) -> list[dict]:
    """The batches through AsyncLLM and the DP client (two engine-core processes)."""
    import asyncio
    import json

    from pagedserve.config import EngineConfig
    from pagedserve.engine.async_llm import AsyncLLM
    from pagedserve.engine.dp_client import DPCoreClient
    from pagedserve.engine.llm_engine import EngineFrontend
    from pagedserve.engine.output_processor import OutputKind
    from pagedserve.sampling import SamplingParams
    from pagedserve.sim.cost_model import read_trace

    comm_prefix = str(trace) + ".comm"
    traces = [Path(f"{trace}.dp{r}") for r in range(2)]
    stats_files = [Path(f"{comm_prefix}.dp{r}.json") for r in range(2)]
    for f in traces + stats_files:
        f.unlink(missing_ok=True)
    os.environ["PAGEDSERVE_COMM_STATS"] = comm_prefix
    config = EngineConfig(model=str(path), max_model_len=1024, kv_cache_memory="256MiB", max_num_seqs=max(batches),
                          max_num_batched_tokens=2048, enable_prefix_caching=False, step_trace_path=str(trace), **flags)
    frontend = EngineFrontend(config)
    client = DPCoreClient(frontend.settings)
    del os.environ["PAGEDSERVE_COMM_STATS"]
    rng = random.Random(0)
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    ids = iter(range(10 ** 9))

    def comm_now() -> list[dict]:
        time.sleep(1.0)  # both cores idle (and so written) by now
        return [json.loads(f.read_text()) if f.exists() else {"comm": {}, "num_forwards": 0} for f in stats_files]

    async def generate(async_llm, prompts):
        queues = [async_llm.submit([(str(next(ids)), None, p)], params, kind=OutputKind.FINAL_ONLY) for p in prompts]
        outs = []
        for queue in queues:
            while True:
                _, out = await queue.get()
                if isinstance(out, BaseException):
                    raise out
                if out.finished:
                    outs.append(list(out.outputs[0].token_ids))
                    break
        return outs

    async def main() -> list[dict]:
        async_llm = AsyncLLM(frontend, client=client, step_watchdog_timeout=0)
        async_llm.start()
        rows = []
        try:
            await generate(async_llm, [[rng.randrange(2, 4096) for _ in range(prompt_len)]] * 2)  # warm-up
            for batch in batches:
                prompts = [[rng.randrange(2, 4096) for _ in range(prompt_len)] for _ in range(batch)]
                done = [len(read_trace(t)) if t.exists() else 0 for t in traces]
                before = comm_now()
                t0 = time.perf_counter()
                outs = await generate(async_llm, prompts)
                wall = time.perf_counter() - t0
                after = comm_now()
                steps = [read_trace(t)[d:] for t, d in zip(traces, done)]
                comm_by_rank = [{k: {m: v[m] - b["comm"].get(k, {}).get(m, 0) for m in v} for k, v in a["comm"].items()}
                                for a, b in zip(after, before)]
                comm = [sum(v["seconds"] for v in c.values()) for c in comm_by_rank]
                busiest = max(range(2), key=lambda r: comm[r])
                num_steps = len(steps[busiest])
                rows.append({"batch": batch, "wall_s": wall, "steps": steps[busiest], "num_steps": num_steps,
                             "steps_by_rank": [len(s) for s in steps],
                             "step_s": statistics.fmean(r.step_time for s in steps for r in s),
                             "comm_s_per_step": comm[busiest] / max(1, len(steps[busiest])),
                             "comm_by_rank": comm_by_rank, "busiest_rank_comm": comm_by_rank[busiest],
                             "execute_s_per_step": [statistics.fmean(r.duration for r in s) if s else 0.0
                                                    for s in steps],
                             "tokens": outs})
        finally:
            async_llm.shutdown()
        return rows

    return asyncio.run(main())


# -- 3. the prediction -------------------------------------------------------------------------
def calibrate(path: Path, base_rows: list[dict], link: dict):
    from pagedserve.plan.models import load_model
    from pagedserve.sim.cost_model import CPU_NOMINAL_BANDWIDTH, CPU_NOMINAL_FLOPS, CostParams, ModelCost, fit

    shape = load_model(str(path)).shape
    # the mp executor's engine thread waits on the rank: its CPU time says nothing of the step,
    # so the fit takes the wall clock (cpu_time 0)
    records = [replace(r, cpu_time=0.0) for row in base_rows for r in row["steps"]]
    base = CostParams(peak_flops=CPU_NOMINAL_FLOPS, mem_bandwidth=CPU_NOMINAL_BANDWIDTH, combine="sum")
    params, report = fit(records, ModelCost.from_shape(shape, "float32", None, 1), base)
    params = replace(params, link_bandwidth=1.0 / link["s_per_byte"], link_efficiency=1.0,
                     allreduce_latency_s=max(link["latency_s"], 0.0))
    return shape, params, report


FITTED_LINE = {"all_reduce": "all_reduce", "moe_combine": "all_reduce", "gather": "all_gather",
               "pp_send": "send", "pp_recv": "send", "ep_dispatch": "all_gather", "ep_combine": "all_reduce",
               "dp_sync": "all_reduce"}


def line_cost(comm: dict, fits: dict, num_steps: int) -> float:
    """Seconds per step the fitted lines give the calls and bytes a rank made: what its
    communication would cost with the other rank always ready."""
    total = 0.0
    for kind, v in comm.items():
        f = fits[FITTED_LINE[kind]]
        total += v["calls"] * f["latency_s"] + v["bytes"] * f["s_per_byte"]
    return total / num_steps


def predict(shape, params, flags: dict, row: dict) -> dict:
    from pagedserve.plan.parallel import ParallelLayout
    from pagedserve.sim.parallel_cost import ParallelCostModel

    layout = ParallelLayout(flags.get("tensor_parallel_size", 1), flags.get("pipeline_parallel_size", 1),
                            enable_expert_parallel=flags.get("enable_expert_parallel", False))
    model = ParallelCostModel(shape, "float32", None, layout, params)
    parts = [model.breakdown(r.new_tokens, r.context_lens, r.num_swap_blocks, r.num_outputs) for r in row["steps"]]
    n = len(parts)
    return {"step_s": sum(p.total for p in parts) / n,
            "allreduce_s": sum(p.allreduce for p in parts) / n, "all_to_all_s": sum(p.all_to_all for p in parts) / n,
            "pipeline_s": sum(p.pipeline for p in parts) / n,
            "comm_s_per_step": sum(p.allreduce + p.all_to_all + p.pipeline for p in parts) / n}


def predict_dp(path: Path, params, flags: dict, row: dict, batches: list[int], prompt_len: int,
               new_tokens: int) -> dict:
    """`simulate -dp N [--enable-expert-parallel]` on the row's batch, every request sent at once
    (as the measured run submits them), with the engine config run_dp_layout gave the cores."""
    from pagedserve.bench.workloads import WorkloadRequest
    from pagedserve.config import EngineConfig
    from pagedserve.plan.parallel import ParallelLayout
    from pagedserve.sim.simulator import build_deployment, simulate

    config = EngineConfig(model=str(path), max_model_len=1024, kv_cache_memory="256MiB", max_num_seqs=max(batches),
                          max_num_batched_tokens=2048, enable_prefix_caching=False)
    layout = ParallelLayout(1, 1, flags["data_parallel_size"],
                            enable_expert_parallel=flags.get("enable_expert_parallel", False))
    dep = build_deployment(config, str(path), cost_params=params, layout=layout)
    result = simulate(dep, [WorkloadRequest(None, None, prompt_len, new_tokens, arrival_time=0.0)
                            for _ in range(row["batch"])])
    cores = result.per_core
    steps = sum(c["num_steps"] for c in cores)
    return {"step_s": sum(c["step_seconds"] for c in cores) / steps,
            "comm_s_per_step": sum(c["exchange_seconds"] for c in cores) / steps,
            "steps_by_core": [c["num_steps"] for c in cores], "requests_by_core": [c["requests"] for c in cores],
            "turns": result.data_parallel["turns"], "dummy_passes": [c["num_dummy_passes"] for c in cores],
            "simulate_dp": True}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--batches", type=int, nargs="+", default=[4, 16])
    ap.add_argument("--prompt-len", type=int, default=96)
    ap.add_argument("--new-tokens", type=int, default=24)
    ap.add_argument("--repeats", type=int, default=20, help="timings per collective and payload")
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")

    load0 = os.getloadavg()[0]
    fits = fit_collectives(args.repeats)
    print(f"gloo, 2 ranks on this machine ({os.cpu_count()} cores, load average {load0:.1f}):")
    for name, f in fits.items():
        print(f"  {name:>10}: {f['latency_s'] * 1e6:8.1f} us per call + {f['gb_per_s']:6.2f} GB/s")

    path = checkpoint(args.hidden, args.layers, args.experts)
    trace_dir = Path("/tmp/pagedserve-bench/layout-traces")
    trace_dir.mkdir(parents=True, exist_ok=True)
    measured = {label: run_layout(path, flags, args.batches, args.prompt_len, args.new_tokens,
                                  trace_dir / f"{label.replace('=', '').replace('+', '-').replace(' ', '')}.jsonl")
                for label, flags in LAYOUTS}
    measured |= {label: run_dp_layout(path, flags, args.batches, args.prompt_len, args.new_tokens,
                                      trace_dir / f"{label.replace('=', '').replace('+', '-')}.jsonl")
                 for label, flags in DP_LAYOUTS}
    shape, params, report = calibrate(path, measured["1 rank"], fits["all_reduce"])
    same = all(m["tokens"] == b["tokens"] for rows in measured.values()
               for m, b in zip(rows, measured["1 rank"]))

    print(f"\nMixtral-shaped, hidden {args.hidden}, {args.layers} layers, {args.experts} experts (top-2), fp32; "
          f"{args.prompt_len}-token prompts + {args.new_tokens} tokens; 1 torch thread per rank; "
          f"compute fitted on the 1-rank steps (mean |error| {report.get('mean_abs_rel_error', float('nan')):.0%}); "
          f"same greedy tokens in every layout: {same}")
    print("comm: the busiest rank's measured communication per step; line: the fitted collective lines "
          "priced on that rank's calls and bytes (the rest of comm is waiting for the other rank)")
    print(f"{'layout':>9} {'batch':>5} {'steps':>5} | {'step ms':>8} {'comm ms':>8} {'share':>6} {'line ms':>7} | "
          f"{'sim step':>8} {'sim comm':>8} {'share':>6} | {'step ratio':>10} {'comm ratio':>10}")
    table = []
    for label, flags in LAYOUTS + DP_LAYOUTS:
        for row in measured[label]:
            if flags.get("data_parallel_size", 1) > 1:
                sim = predict_dp(path, params, flags, row, args.batches, args.prompt_len, args.new_tokens)
            else:
                sim = predict(shape, params, flags, row)
            share, sim_share = row["comm_s_per_step"] / row["step_s"], sim["comm_s_per_step"] / sim["step_s"]
            comm_ratio = row["comm_s_per_step"] / sim["comm_s_per_step"] if sim["comm_s_per_step"] > 0 else None
            line_s = line_cost(row["busiest_rank_comm"], fits, row["num_steps"])
            print(f"{label:>9} {row['batch']:>5} {row['num_steps']:>5} | {row['step_s'] * 1e3:8.2f} "
                  f"{row['comm_s_per_step'] * 1e3:8.2f} {share:6.0%} {line_s * 1e3:7.2f} | {sim['step_s'] * 1e3:8.2f} "
                  f"{sim['comm_s_per_step'] * 1e3:8.2f} {sim_share:6.0%} | {row['step_s'] / sim['step_s']:10.2f} "
                  + (f"{comm_ratio:10.2f}" if comm_ratio is not None else f"{'-':>10}"))
            table.append({"layout": label, "flags": flags, "batch": row["batch"], "num_steps": row["num_steps"],
                          "measured": {k: row[k] for k in ("step_s", "comm_s_per_step", "execute_s_per_step",
                                                           "comm_by_rank", "wall_s")} | {"line_s_per_step": line_s},
                          "simulated": sim} | ({"steps_by_rank": row["steps_by_rank"]} if "steps_by_rank" in row else {}))
    print("\nper step, by kind (each rank; the larger batch): calls, KiB handed to the call, ms; and ms per call "
          "beside the fitted line's for that payload (the excess: waiting for the other rank)")
    line = {kind: fits[op] for kind, op in FITTED_LINE.items()}
    for label, _ in LAYOUTS[1:] + DP_LAYOUTS:
        row = measured[label][-1]
        for rank, comm in enumerate(row["comm_by_rank"]):
            steps = row["num_steps"]
            for kind, v in sorted(comm.items()):
                calls = v["calls"] or 1
                fitted = line[kind]["latency_s"] + line[kind]["s_per_byte"] * v["bytes"] / calls
                print(f"  {label:>8} rank {rank} {kind:>11}: {v['calls'] / steps:5.1f} calls "
                      f"{v['bytes'] / steps / 1024:8.1f} KiB {v['seconds'] / steps * 1e3:7.2f} ms | "
                      f"{v['seconds'] / calls * 1e3:6.3f} ms/call, fitted {fitted * 1e3:6.3f}")
    print(f"load average at the end: {os.getloadavg()[0]:.1f}")
    print("results:", write_result("parallel_layouts", {
        "args": vars(args), "collectives": fits, "cost_params": params.to_dict(), "fit": report,
        "same_tokens": same, "rows": table, "load_average": [load0, os.getloadavg()[0]]}))


if __name__ == "__main__":
    main()
