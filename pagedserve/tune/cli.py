"""`pagedserve tune`: find the sweet spot on the simulator (or, with --real, the real engine).

    pagedserve tune --model llama-3.1-8b --gpu H100-SXM --workload random --request-rate 8 \\
        --num-prompts 500 --slo ttft_p99:2000 itl_p99:100 --max-preemption-rate 0.05
    pagedserve tune ... --sweep max_num_seqs=16,32,64,128 --sweep enable_chunked_prefill=on,off
    pagedserve tune --device cpu --model CKPT --cost-model cost.json ... --real   # also run the real engine
    pagedserve tune --model deepseek-v3 --gpu H200 --layouts TP8,TP8+EP8,TP4xPP2 ...   # compare GPU layouts
    pagedserve tune ... --replicas 1,2,4 --router kv-aware,round-robin   # how many replicas, which router

Takes `pagedserve simulate`'s flags (engine knobs, simulated hardware, workload).
"""
from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

DEFAULT_SEQS = (8, 16, 32, 64, 128, 256, 512)


def register(subparsers) -> None:
    from pagedserve.sim.cli import _add_deployment_args, _add_workload_args

    p = subparsers.add_parser("tune", help="sweep knobs on the simulator and pick the sweet spot",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_deployment_args(p)
    _add_workload_args(p)
    t = p.add_argument_group("tuning")
    t.add_argument("--sweep", action="append", default=[], metavar="KNOB=V1,V2",
                   help="values to try for a knob (repeatable); default: max_num_seqs up to the planner's "
                        "bound x max_num_batched_tokens x chunked prefill on/off")
    t.add_argument("--layouts", default=None, metavar="L1,L2",
                   help="parallel layouts to compare, e.g. TP8,TP8+EP8,TP4xPP2,TP16 (each replaces -tp/-pp/"
                        "--enable-expert-parallel; crossed with --sweep when both are given)")
    t.add_argument("--replicas", default=None, metavar="N1,N2",
                   help="replica counts to compare, each a fleet behind --router (the fleet simulator, "
                        "sim/fleet.py; crossed with --layouts and --sweep). The pick is the fewest GPUs "
                        "(replicas x the layout's) meeting the SLOs")
    t.add_argument("--router", default=None, metavar="R1,R2",
                   help="with --replicas: routers to compare, of round-robin, power-of-two, kv-aware "
                        "(default kv-aware)")
    t.add_argument("--slo", nargs="+", default=None, metavar="NAME:MS",
                   help="ttft_p99:MS itl_p99:MS tpot_p99:MS e2el_p99:MS")
    t.add_argument("--max-preemption-rate", type=float, default=0.05,
                   help="preemptions per request a sweet spot may have (default 0.05)")
    t.add_argument("--real", action="store_true",
                   help="also run every point on the real engine (in-process, CPU; small models)")
    t.add_argument("--real-clock", choices=("wall", "cpu"), default="wall")
    t.add_argument("--plot", default=None, metavar="DIR", help="draw the front (throughput vs tail)")
    t.add_argument("--json", dest="json_out", default=None, metavar="FILE", help="write every point as JSON")
    p.set_defaults(func=run)


def _default_grid(dep, bound: int) -> dict[str, list]:
    seqs = sorted({s for s in DEFAULT_SEQS if s <= 1.25 * bound} | {max(1, bound)})
    on_gpu = dep.device != "cpu"
    return {"max_num_seqs": seqs,
            "max_num_batched_tokens": [2048, 8192] if on_gpu else [256, 1024],
            "enable_chunked_prefill": [True, False]}


def run(args) -> int:
    from pagedserve.engine_args import engine_config_from_args, knob_given
    from pagedserve.plan.kv_budget import blocks_per_request
    from pagedserve.sim.cli import build_workload, deployment_layout
    from pagedserve.bench.report import parse_goodput
    from pagedserve.sim.simulator import build_deployment, simulate
    from pagedserve.tune import tuner

    slos = tuner.parse_slos(args.slo)
    base = engine_config_from_args(args)
    if args.num_prompts < 1:
        raise ValueError(f"num_prompts: must be >= 1, got {args.num_prompts}")
    if args.model is None:
        raise ValueError("model: give a preset (e.g. llama-3.1-8b) or a checkpoint directory")
    gpu = None if args.device == "cpu" else args.gpu
    if gpu is None and args.device != "cpu":
        raise ValueError("gpu: give a GPU preset (--gpu H100-SXM), or --device cpu with --cost-model")
    import copy
    layouts = [name.strip() for name in args.layouts.split(",") if name.strip()] if args.layouts else []
    for name in layouts:
        deployment_layout(args, name)  # a bad layout is refused before anything runs
    if layouts and args.real:
        raise ValueError("layouts: --real runs the one-rank CPU engine; compare layouts on the simulator only")
    fleet_grid = tuner.parse_fleet(args.replicas, args.router)
    if fleet_grid and args.real:
        raise ValueError("replicas: --real runs one engine; compare replica counts on the simulator only")
    if fleet_grid and args.max_concurrency is not None:
        raise ValueError("replicas: the fleet simulation is open loop (drop --max-concurrency, give --request-rate)")

    from pagedserve.sim.host_overhead import host_speed

    host = {"weight_dtype": args.weight_dtype, "host_cpu_speed": host_speed(args.host_cpu_speed),
            "serving_overhead": args.serving_overhead, "host_profile": args.host_profile,
            "host_overhead": args.host_overhead, "endpoint": args.endpoint, "async_scheduling": args.async_scheduling}

    # On a GPU preset, max_num_seqs left unset (by the flags and by the point swept) is vLLM's
    # default for the device, as `simulate` and `plan` take it (plan/budget.vllm_batch_defaults).
    seqs_unset = not knob_given(args, "max_num_seqs")

    def layout_of(name: str | None, knobs: dict | None = None) -> dict:
        return {**deployment_layout(args, name, tp=base.tensor_parallel_size), **host,
                "max_num_seqs_unset": seqs_unset and "max_num_seqs" not in (knobs or {})}

    base_dep = build_deployment(copy.deepcopy(base), args.model, gpu=gpu, cost_params=args.cost_model,
                                **layout_of(layouts[0] if layouts else None))
    workload = build_workload(args, base_dep.vocab_size)
    mean_len = sum(w.prompt_len + w.output_len for w in workload) / len(workload)
    if base.max_model_len is None:
        # Tune for this workload: its longest request, rounded up to a block, bounds the context.
        longest = max(w.prompt_len + w.output_len for w in workload)
        base.max_model_len = min(-(-longest // base.block_size) * base.block_size,
                                 base_dep.config.max_model_len)
        base_dep = build_deployment(copy.deepcopy(base), args.model, gpu=gpu, cost_params=args.cost_model,
                                    **layout_of(layouts[0] if layouts else None))
    bound = int(base_dep.num_blocks / blocks_per_request(math.ceil(mean_len), base_dep.config.block_size))
    sweep = tuner.parse_sweep(args.sweep) if args.sweep else None
    if sweep and len(sweep.get("kv_cache_dtype", ())) > 1:
        # A smaller KV dtype holds more sequences: prune max_num_seqs by the roomiest pool swept.
        for kv_dtype in sweep["kv_cache_dtype"]:
            config = copy.deepcopy(base)
            config.kv_cache_dtype = kv_dtype
            dep = build_deployment(config, args.model, gpu=gpu, cost_params=args.cost_model,
                                   **layout_of(layouts[0] if layouts else None))
            bound = max(bound, int(dep.num_blocks / blocks_per_request(math.ceil(mean_len), dep.config.block_size)))
    if layouts or fleet_grid:  # each layout / fleet at the base knobs, or crossed with an explicit sweep
        grid = {**({"layout": layouts} if layouts else {}), **fleet_grid, **(sweep or {})}
    else:
        grid = sweep or _default_grid(base_dep, bound)
    # the pool (and so the bound) differs by layout: prune nothing when comparing layouts
    points, pruned = tuner.expand_grid(grid, max_num_seqs_bound=None if layouts else bound,
                                       max_model_len=base.max_model_len)
    goodput = parse_goodput(args.goodput)
    print(f"pagedserve tune: {base_dep.model_name} on {base_dep.device} x{base_dep.tp}; {len(workload)} requests, "
          f"mean {mean_len:.0f} tokens each, max_model_len {base.max_model_len}; the pool holds {bound} such "
          f"sequences ({base_dep.num_blocks} blocks); "
          f"{len(points)} points ({len(pruned)} pruned); SLOs {slos or 'none'}; "
          f"max {args.max_preemption_rate:g} preemptions/request", flush=True)
    for why in pruned:
        print(f"  pruned {why}")

    def sim_point(config, knobs):
        dep = build_deployment(config, args.model, gpu=gpu, cost_params=args.cost_model,
                               **layout_of(knobs.get("layout"), knobs))
        if "replicas" in knobs:  # a fleet: N copies of this deployment behind the router's code
            from pagedserve.sim.fleet import simulate_fleet
            fleet = simulate_fleet(dep, workload, knobs["replicas"], knobs["router"], seed=args.seed or 0,
                                   goodput_slos=goodput)
            point = tuner.point_from_metrics(knobs, fleet.metrics, len(workload))
            point.extra = {"prefix_cache_hit_rate": fleet.prefix_hit_rate, "gpus": tuner.gpus_of(knobs),
                           "requests_per_replica": fleet.requests_per_replica}
            return point
        result = simulate(dep, workload, max_concurrency=args.max_concurrency, goodput_slos=goodput,
                          seed=args.seed or 0)
        busy = result.busy_time / result.metrics["duration"] if result.metrics["duration"] else math.nan
        return tuner.point_from_metrics(knobs, result.metrics, len(workload), busy)

    results = tuner.sweep(base, points, sim_point, slos, on_point=lambda p: print(f"  simulated {p.knobs}", flush=True))
    chosen, why = tuner.choose_sweet_spot(results, slos, args.max_preemption_rate)
    print(format_table(results, chosen, "simulated"))
    real_results = None
    if args.real:
        real_results = run_real_sweep(args, base, points, workload, slos)
        real_chosen, real_why = tuner.choose_sweet_spot(real_results, slos, args.max_preemption_rate)
        print(format_table(real_results, real_chosen, "real engine"))
        print(f"real engine's sweet spot: {real_chosen.knobs if real_chosen else None} ({real_why})")
    if chosen is None:
        print(f"no sweet spot: {why}")
    else:
        print(f"sweet spot: {chosen.knobs} — {why}")
        knobs = dict(chosen.knobs)
        fleet_flags = ""
        if "replicas" in knobs:  # pagedserve's own fleet flags; vLLM's line is one replica of it
            fleet_flags = f" --replicas {knobs.pop('replicas')} --router {knobs.pop('router')}"
        flags = _serve_flags(base, knobs, args)
        print(f"  pagedserve serve --model {args.model} {flags}{fleet_flags}")
        print(f"  vllm serve {args.model} {flags}" + ("   # each replica" if fleet_flags else ""))
    if args.plot:
        print(f"wrote {plot_front(results, chosen, args.plot, slos)}")
    if args.json_out:
        payload = {"simulated": [vars(p) for p in results], "chosen": chosen.knobs if chosen else None,
                   "real": [vars(p) for p in real_results] if real_results else None}
        Path(args.json_out).write_text(json.dumps(payload, indent=2, default=str))
        print(f"wrote {args.json_out}")
    return 0


def _serve_flags(base, knobs: dict, args) -> str:
    """The knobs the operator fixed on this command line, then the ones tuning chose."""
    from pagedserve.engine_args import _FLAGS, _dest
    from pagedserve.tune.tuner import knob_flags

    skip = {"model", "config", "device", "step_trace_path", "served_model_name", "tokenizer",
            "distributed_executor_backend"}
    fixed = {}
    for flag, _ in _FLAGS:
        name = _dest(flag)
        if name not in skip and getattr(args, name, None) is not None:
            fixed[name] = getattr(base, name)
    fixed.setdefault("max_model_len", base.max_model_len)
    knobs = dict(knobs)
    if "layout" in knobs:  # as vLLM's flags
        from pagedserve.plan.parallel import parse_layout
        layout = parse_layout(knobs.pop("layout"))
        fixed["tensor_parallel_size"] = layout.tp
        if layout.pp > 1:
            fixed["pipeline_parallel_size"] = layout.pp
        if layout.dp > 1:  # a DP layout is simulated now (sim/data_parallel.py): its command must say so
            fixed["data_parallel_size"] = layout.dp
        if layout.expert_parallel:
            fixed["enable_expert_parallel"] = True
    else:
        if getattr(args, "pp", 1) > 1:
            fixed["pipeline_parallel_size"] = args.pp
        if getattr(args, "dp", 1) > 1:
            fixed["data_parallel_size"] = args.dp
        if getattr(args, "enable_expert_parallel", False):
            fixed["enable_expert_parallel"] = True
    if "gpu_memory_utilization" not in knobs and args.device != "cpu":
        fixed["gpu_memory_utilization"] = base.gpu_memory_utilization
    return knob_flags({**fixed, **knobs})


def run_real_sweep(args, base, points, workload, slos):
    """The same points on the real engine, in-process, arrivals replayed in real time."""
    from pagedserve.bench.replay import replay
    from pagedserve.engine import Engine
    from pagedserve.sim.report import compute_metrics
    from pagedserve.tune import tuner

    if args.device != "cpu":
        raise ValueError("real: --real runs the engine on this machine; use --device cpu and a checkpoint directory")

    def real_point(config, knobs):
        engine = Engine(config)
        records, duration = replay(engine, workload, clock=args.real_clock)
        metrics = compute_metrics(records, duration)
        return tuner.point_from_metrics(knobs, metrics, len(workload))

    return tuner.sweep(base, points, real_point, slos, on_point=lambda p: print(f"  ran {p.knobs}", flush=True))


def format_table(results, chosen, title: str) -> str:
    keys = list(results[0].knobs) if results else []
    head = "".join(f"{k:>24}" for k in keys)
    lines = [f"\n{title}: * = on the Pareto front (throughput vs tail), ok = meets SLOs, <= = sweet spot",
             f"{head}{'out tok/s':>11}{'P99 TTFT ms':>13}{'P99 ITL ms':>12}{'preempt/req':>12}{'busy':>7}  mark"]
    for p in sorted(results, key=lambda p: -p.output_throughput):
        knobs = "".join(f"{str(p.knobs[k]):>24}" for k in keys)
        if p.error:
            lines.append(f"{knobs}  refused: {p.error[:80]}")
            continue
        mark = ("*" if p.on_front else " ") + (" ok" if p.meets_slo else "   ") + (" <=" if p is chosen else "")
        busy = "" if math.isnan(p.busy_fraction) else f"{p.busy_fraction:.0%}"
        lines.append(f"{knobs}{p.output_throughput:>11.1f}{p.p99_ttft_ms:>13.1f}{p.p99_itl_ms:>12.1f}"
                     f"{p.preemptions_per_request:>12.3f}{busy:>7}  {mark}")
    return "\n".join(lines)


def plot_front(results, chosen, out_dir: str, slos) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [p for p in results if not p.error]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.scatter([p.tail for p in ok], [p.output_throughput for p in ok], c="lightgray", label="points")
    front = sorted((p for p in ok if p.on_front), key=lambda p: p.tail)
    ax.plot([p.tail for p in front], [p.output_throughput for p in front], "o-", label="Pareto front")
    if chosen is not None:
        ax.scatter([chosen.tail], [chosen.output_throughput], s=160, facecolors="none", edgecolors="red",
                   label="sweet spot")
    if slos:
        ax.axvline(1.0, color="red", linestyle="--", linewidth=1, label="SLO")
    ax.set_xlabel("worst P99 / its SLO" if slos else "P99 ITL (ms)")
    ax.set_ylabel("output tokens/s")
    ax.legend()
    ax.grid(alpha=0.3)
    path = Path(out_dir)
    path.mkdir(parents=True, exist_ok=True)
    path = path / "tune_front.png"
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
