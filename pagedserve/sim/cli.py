"""`pagedserve simulate`: predict a deployment's serving report without the hardware.

    pagedserve simulate --model llama-3.1-70b --gpu H100-SXM --tp 4 --gpu-memory-utilization 0.9 \\
        --max-num-seqs 64 --max-num-batched-tokens 8192 --workload long-context --request-rate 2 \\
        --num-prompts 2000
    pagedserve serve --model CKPT_DIR --step-trace-path steps.jsonl ...      # the live server, traced
    pagedserve bench --dataset calibration --request-rate 2 --num-prompts 200 --result-file bench.json
    pagedserve simulate calibrate --trace steps.jsonl --bench-result bench.json --model CKPT_DIR --out cost.json
    pagedserve simulate --device cpu --model CKPT_DIR --cost-model cost.json --kv-cache-memory 64MiB ...

The engine's own scheduler and KV-cache manager run on a virtual clock; a cost model
(roofline of the GPU preset, or constants calibrated on a real engine's step trace)
stands in for the model. Every engine knob takes the same flag as `serve`; the workload
flags are `pagedserve bench`'s.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

from pagedserve.bench.workloads import add_dataset_args, dataset_kwargs, make_workload
from pagedserve.utils import json_safe


def _add_workload_args(p: argparse.ArgumentParser) -> None:
    d = add_dataset_args(p, default_num_prompts=1000)
    d.add_argument("--workload-trace", default=None, metavar="FILE",
                   help="arrivals from a file instead: JSON lines / CSV with timestamp, prompt_len, output_len")
    lo = p.add_argument_group("load")
    lo.add_argument("--request-rate", type=float, default=math.inf, help="requests/s (Poisson; inf = all at t=0)")
    lo.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of inter-arrival gaps; 1 = Poisson")
    lo.add_argument("--max-concurrency", type=int, default=None, help="closed loop: at most N requests in flight")
    lo.add_argument("--goodput", nargs="+", default=None, metavar="KEY:MS", help="SLOs, e.g. ttft:500 tpot:50")
    lo.add_argument("--endpoint", choices=("completions", "chat"), default="completions",
                    help="the client's endpoint, as `pagedserve bench --endpoint` (vllm bench serve --backend openai / "
                         "openai-chat): the serving layer's terms measured for it (chat renders the template and "
                         "streams deltas); default completions")


def _add_deployment_args(p: argparse.ArgumentParser, engine_flags: bool = True) -> None:
    if engine_flags:
        from pagedserve.engine_args import add_engine_args
        add_engine_args(p, skip=("pipeline_parallel_size", "data_parallel_size"))  # -pp below: the simulated stages
    g = p.add_argument_group("simulated hardware")
    g.add_argument("--gpu", default=None, help="GPU preset (H100-SXM, A100-80GB, H200, L40S, ...); omit with --device cpu")
    g.add_argument("--pipeline-parallel-size", "-pp", "--pp", dest="pp", type=int, default=1,
                   help="pipeline stages (layers split between them; TP x PP GPUs in all)")
    g.add_argument("--data-parallel-size", "-dp", "--dp", dest="dp", type=int, default=1,
                   help="engine cores behind the DP balancer, each its own pool (serve's -dp; with "
                        "--enable-expert-parallel on an MoE model: DP attention + EP, the cores in lockstep)")
    if not engine_flags:  # otherwise the engine's own --enable-expert-parallel (same meaning) is there
        g.add_argument("--enable-expert-parallel", action="store_true",
                       help="MoE: spread whole experts over the TP group (all-to-all dispatch and combine)")
    g.add_argument("--gpus-per-node", type=int, default=8,
                   help="GPUs per node: a TP/EP group or stage boundary past it crosses the inter-node link")
    g.add_argument("--inter-node-bandwidth", type=float, default=50.0, metavar="GB/s",
                   help="per GPU, one direction (default 50: one 400 Gb/s NIC per GPU)")
    g.add_argument("--cost-model", default=None, metavar="COST.json",
                   help="cost constants from `simulate calibrate` (default: the GPU preset's stated defaults)")
    g.add_argument("--weight-dtype", "--quantization", dest="weight_dtype", default=None,
                   choices=("fp8", "bfloat16", "float16", "float32"),
                   help="GPU: the weights' dtype (fp8 = vLLM's --quantization fp8: one byte per weight, GEMMs at the "
                        "fp8 tensor-core peak where the GPU has one); default: the checkpoint's / --dtype")
    g.add_argument("--host-cpu-speed", default=None, metavar="X",
                   help="GPU: the host CPU's single-thread speed relative to the machine the shipped host probe ran "
                        "on (pagedserve/sim/host_overhead.json); scales the per-step and serving CPU terms (default 1)")
    g.add_argument("--host-overhead", default=None, metavar="HOST.json",
                   help="GPU: the host CPU terms from `python -m pagedserve.sim.host_probe --out HOST.json` run on the "
                        "deployment's host (default: the shipped probe, pagedserve/sim/host_overhead.json)")
    g.add_argument("--host-profile", choices=("pagedserve", "vllm"), default="pagedserve",
                   help="GPU: whose engine loop costs each step on the host: pagedserve = this project's loop as the "
                        "host probe measured it (default), vllm = vLLM v0.6's published 2 ms + 20 us per request, with vLLM's serving layer as "
                        "benchmarks/vllm_host_probe.py measured it (pagedserve/sim/host_overhead_vllm.json)")
    g.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="GPU: the engine schedules the next step while the device runs this one, so a step's host "
                        "work hides under the device's (vLLM's --async-scheduling, its default since 0.14); default: "
                        "on with --host-profile vllm, off with pagedserve")
    g.add_argument("--no-serving-overhead", dest="serving_overhead", action="store_false",
                   help="GPU: leave the serving layer's per-request CPU time (tokenize, detokenize, SSE) out")


def register(subparsers) -> None:
    p = subparsers.add_parser("simulate", help="predict a deployment's serving report (virtual clock, real scheduler)",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_deployment_args(p)
    _add_workload_args(p)
    o = p.add_argument_group("output")
    o.add_argument("--result-json", "--result-file", dest="result_json", default=None,
                   help="write the report, timelines and per-request preemptions as JSON")
    o.add_argument("--plot", "--plot-dir", dest="plot", default=None, metavar="DIR", help="write PNG plots here")
    o.add_argument("--save-records", action="store_true", help="include every request's timings in the JSON")
    fl = p.add_argument_group("fleet (docs/replicas.md)")
    fl.add_argument("--replicas", type=int, default=None,
                    help="simulate N replicas of this deployment behind --router (the serve --replicas code)")
    fl.add_argument("--router", default="kv-aware", choices=("round-robin", "power-of-two", "kv-aware"))
    fl.add_argument("--fleet-overhead", default="none", metavar="none|shipped|FILE",
                    help="charge the Ray path around each replica (proxy, ingress, handle, each chunk's way back; "
                         "sim/fleet_probe.py's fit): shipped = pagedserve/sim/fleet_overhead.json, or a FILE the "
                         "probe wrote on the host (default none: the engines and their serving layer only)")
    dash = p.add_argument_group("dashboard")
    dash.add_argument("--dashboard", action="store_true",
                      help="replay the run into the server's /dashboard page (it starts when the page connects; "
                           "the page stays up after the run until Ctrl-C)")
    dash.add_argument("--dashboard-speed", type=float, default=1.0, metavar="X",
                      help="simulated seconds per wall second (inf = as fast as it runs)")
    dash.add_argument("--dashboard-host", default="127.0.0.1")
    dash.add_argument("--dashboard-port", type=int, default=8000)
    p.set_defaults(func=run)

    sub = p.add_subparsers(dest="sim_command", required=False)
    c = sub.add_parser("calibrate", help="fit the cost model to a real engine's step trace (--step-trace-path)",
                       description="Fit the step cost (and, from the server's request trace, the serving "
                                   "overhead) to what a live server logged; print the fit's error by step kind "
                                   "and warn where the trace leaves a term unfitted.")
    src = c.add_mutually_exclusive_group(required=True)
    src.add_argument("--trace", nargs="+", metavar="TRACE",
                     help="JSON lines written by the engine (--step-trace-path); several runs may be given")
    src.add_argument("--from-bench", nargs="+", metavar="RESULT.json",
                     help="a server that writes no step trace (vLLM): rebuild its steps from this `pagedserve bench "
                          "--result-file` (every streamed token's arrival; see pagedserve/sim/reconstruct.py); "
                          "several runs may be given (fitted together: runs spread over a session see the "
                          "machine's speed on average)")
    c.add_argument("--metrics-before", nargs="+", default=None, metavar="FILE",
                   help="with --from-bench: the server's /metrics scraped just before each run ...")
    c.add_argument("--metrics-after", nargs="+", default=None, metavar="FILE",
                   help="... and just after: the serving overhead is fitted from the client's TTFT and the "
                        "engine's own queue and prefill times (see --serving-fit)")
    c.add_argument("--serving-fit", choices=("replay", "subtract"), default="replay",
                   help="with --from-bench and the metrics: replay = the calibration run replayed in the "
                        "simulator, the admission chosen so that its mean TTFT equals the client's (default); "
                        "subtract = the client's mean TTFT minus the engine's queue + prefill (the simulator "
                        "then charges the wait for a running step twice: vLLM's queue time leaves it out)")
    c.add_argument("--step-spread", action=argparse.BooleanOptionalAction, default=None,
                   help="store how far the trace's steps scatter around the fitted model (1000 quantiles of "
                        "measured - modelled); the simulator then adds a draw to every step, which widens "
                        "the ITL and TTFT tails as the machine did (default: on; --no-step-spread: steps "
                        "exactly as modelled)")
    c.add_argument("--max-num-seqs", type=int, default=None,
                   help="the server's max_num_seqs: the --serving-fit replay runs at it (default: pagedserve's), "
                        "and the fit warns when the trace's decode batches reach under half of it")
    c.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="with --serving-fit replay: the server's max_num_batched_tokens (default: pagedserve's); "
                        "block size, KV blocks and prefix caching come from vLLM's cache_config_info")
    c.add_argument("--request-trace", default=None, nargs="+", metavar="FILE",
                   help="the server's request trace, one per TRACE (default: each TRACE's companion "
                        "STEM.requests.jsonl, where it exists)")
    c.add_argument("--bench-result", default=None, nargs="+", metavar="FILE",
                   help="`pagedserve bench --result-file` of the run that made each TRACE: adds the client's send "
                        "and receive times to the serving overhead (what the server cannot see of itself)")
    c.add_argument("--max-model-len", type=int, default=None,
                   help="the longest context simulations will ask about (warns when the trace has none that long)")
    c.add_argument("--combine", choices=("max", "sum"), default=None,
                   help="compute and memory time: max = roofline (default on GPU), sum = added (default on CPU)")
    c.add_argument("--json", action="store_true", help="print the fitted constants and the fit report as JSON")
    c.add_argument("--model", required=True, help="the checkpoint directory (config.json) or preset the trace ran")
    c.add_argument("--out", required=True, help="where to write the cost model JSON")
    c.add_argument("--gpu", default=None, help="the GPU the trace ran on (its peaks scale the efficiencies); omit for CPU")
    c.add_argument("--tensor-parallel-size", "-tp", "--tp", dest="tensor_parallel_size", type=int, default=1)
    c.add_argument("--dtype", default="auto", help="the dtype the engine ran (auto: float32 on CPU, checkpoint's on GPU)")
    c.add_argument("--block-size", type=int, default=16)
    c.add_argument("--attention-layout", choices=("paged", "padded"), default=None,
                   help="how the engine's attention backend spends work: padded = pagedserve's torch "
                        "backend, paged = FlashAttention-style kernels (default on GPU); on CPU the default "
                        "fits the share of padding the backend pays, so either backend is described")
    c.set_defaults(func=run_calibrate)


def deployment_layout(args, layout: str | None = None, tp: int | None = None) -> dict:
    """build_deployment's `layout` and `topology` from the flags (or a layout string such
    as "TP4xPP2+EP4", which replaces -tp/-pp/--enable-expert-parallel). `tp`: the engine
    config's tensor_parallel_size (default: the flag's, else 1)."""
    from pagedserve.plan.parallel import ParallelLayout, parse_layout
    from pagedserve.sim.parallel_cost import Topology

    dp = getattr(args, "dp", 1)
    if dp < 1:
        raise ValueError(f"data_parallel_size: must be >= 1, got {dp}")
    if layout is not None:
        chosen = parse_layout(layout)
    else:
        tp = tp or getattr(args, "tensor_parallel_size", None) or 1
        if tp < 1:
            raise ValueError(f"tensor_parallel_size: must be >= 1, got {tp}")
        if args.pp < 1:
            raise ValueError(f"pipeline_parallel_size: must be >= 1, got {args.pp}")
        chosen = ParallelLayout(tp, args.pp, dp, enable_expert_parallel=bool(args.enable_expert_parallel))
    return {"layout": chosen, "topology": Topology(args.gpus_per_node, args.inter_node_bandwidth)}


def build_workload(args, vocab_size: int, max_len: int | None = None):
    from pagedserve.sim.simulator import load_trace_workload

    if args.workload_trace:
        return load_trace_workload(args.workload_trace)
    kw = dataset_kwargs(args, vocab_size)
    if args.dataset == "calibration" and max_len:
        kw["max_len"] = max_len  # as the bench caps it to the server's max_model_len
    return make_workload(args.dataset, args.num_prompts, request_rate=args.request_rate, burstiness=args.burstiness,
                         seed=args.seed or 0, dataset_path=args.dataset_path, **kw)


def run(args) -> int:
    from pagedserve.engine_args import engine_config_from_args, knob_given
    from pagedserve.bench.report import parse_goodput
    from pagedserve.sim.cost_model import ServingOverhead
    from pagedserve.sim.simulator import build_deployment, simulate

    if args.dashboard:
        _check_dashboard_args(args)
    if args.num_prompts < 1:
        raise ValueError(f"num_prompts: must be >= 1, got {args.num_prompts}")
    slos = parse_goodput(args.goodput)
    config = engine_config_from_args(args)
    if args.model is None:
        raise ValueError("model: give a preset (e.g. llama-3.1-8b) or a checkpoint directory")
    if args.gpu is None and args.device != "cpu":
        raise ValueError("gpu: give a GPU preset (--gpu H100-SXM), or --device cpu with --cost-model")
    gpu = None if args.device == "cpu" else args.gpu
    shape = deployment_layout(args, tp=config.tensor_parallel_size)
    from pagedserve.sim.host_overhead import host_speed

    dep = build_deployment(config, args.model, gpu=gpu, cost_params=args.cost_model, weight_dtype=args.weight_dtype,
                           host_cpu_speed=host_speed(args.host_cpu_speed), serving_overhead=args.serving_overhead,
                           host_profile=args.host_profile, host_overhead=args.host_overhead,
                           endpoint=args.endpoint, async_scheduling=args.async_scheduling,
                           max_num_seqs_unset=not knob_given(args, "max_num_seqs"), **shape)
    workload = build_workload(args, dep.vocab_size, dep.config.max_model_len)
    rate = "inf" if math.isinf(args.request_rate) else f"{args.request_rate:g}"
    cfg = dep.config
    gpus = shape["layout"].num_gpus
    where = (f"{gpus} x {dep.device} ({dep.layout}, {-(-gpus // shape['topology'].gpus_per_node)} node(s))"
             if gpu is not None else dep.device)
    if dep.dp > 1:
        where += (f", {dep.dp} data-parallel engine cores "
                  + ("in lockstep (DP attention + EP)" if dep.lockstep_cost is not None else "(independent)"))
    print(f"pagedserve simulate: {dep.model_name} on {where}; KV pool {dep.pool_note}; "
          f"max_num_seqs={cfg.max_num_seqs} max_num_batched_tokens={cfg.max_num_batched_tokens} "
          f"max_model_len={cfg.max_model_len}; cost model: {dep.cost_model.params.source}", flush=True)
    print(f"workload: {args.workload_trace or args.dataset} x {len(workload)}, request rate {rate}, "
          f"burstiness {args.burstiness:g}, max concurrency {args.max_concurrency}", flush=True)
    print(f"serving overhead: {ServingOverhead.from_dict(dep.cost_model.params.serving).describe()}", flush=True)
    cp = dep.cost_model.params
    print(f"host CPU per step: {cp.step_overhead_s * 1e6:.0f} us + {cp.per_request_overhead_s * 1e6:.1f} us/request + "
          f"{cp.per_token_overhead_s * 1e6:.2f} us/token", flush=True)
    tp = config.tensor_parallel_size
    if tp > 1 and cp.link_bandwidth:
        small = (f"{cp.allreduce_latency_s * 1e6:.0f} us + {cp.link_bandwidth * cp.link_efficiency / 1e9:.0f} GB/s "
                 "per all-reduce")
        if cp.allreduce_busbw and tp == cp.allreduce_busbw_gpus:
            mib = cp.custom_allreduce_max_bytes / 2**20
            small += (f" below {mib:g} MiB (vLLM's custom kernel); at and above, the measured NCCL/RCCL bus "
                      f"bandwidth at that size ({cp.allreduce_busbw_gpus} GPUs, plan/gpus.py)")
        elif cp.allreduce_busbw:
            small += f" (the measured NCCL/RCCL curve is for {cp.allreduce_busbw_gpus} GPUs: not used at TP {tp})"
        print(f"TP all-reduce: {small}", flush=True)
    if dep.lockstep_cost is not None:
        print(f"DP + EP exchange: {dep.lockstep_cost.exchange_kind} per MoE layer, "
              f"{cp.allreduce_latency_s * 1e6:.0f} us per collective + "
              + (f"{cp.link_bandwidth * cp.link_efficiency / 1e9:.2f} GB/s" if cp.link_bandwidth else
                 "no link bandwidth in the cost model (bytes priced free: fit one, benchmarks/parallel_layouts.py)"),
              flush=True)
    if cfg.step_trace_path:
        print(f"step trace (virtual time): {cfg.step_trace_path}", flush=True)
    if getattr(args, "replicas", None) is not None:
        return _run_fleet(args, dep, workload, slos)
    if args.dashboard:
        return _run_with_dashboard(args, dep, workload, slos)
    result = simulate(dep, workload, max_concurrency=args.max_concurrency, goodput_slos=slos, seed=args.seed or 0)
    _report(args, dep, result, slos)
    return 0


def _run_fleet(args, dep, workload, slos) -> int:
    from pagedserve.bench.report import format_summary, results_from_records, summarize
    from pagedserve.sim.fleet import simulate_fleet

    if args.replicas < 1:
        raise ValueError(f"replicas: must be >= 1, got {args.replicas}")
    if dep.dp > 1:
        raise ValueError(f"replicas: a fleet of -dp {dep.dp} engines is not simulated (give -dp or --replicas)")
    if args.max_concurrency is not None or args.dashboard:
        raise ValueError("replicas: the fleet simulation is open loop without a dashboard (drop --max-concurrency, "
                         "--dashboard)")
    hop = None
    if args.fleet_overhead != "none":
        from pagedserve.sim.fleet import default_fleet_hop

        path = None if args.fleet_overhead == "shipped" else Path(args.fleet_overhead)
        if path is not None and not path.is_file():
            raise ValueError(f"fleet_overhead: no file {path} (python -m pagedserve.sim.fleet_probe --out {path})")
        # On CUDA `serve` runs the engine core in its own process: no lock shared with the streams.
        hop = default_fleet_hop(path, engine_thread=dep.config.device == "cpu")
        print(hop.describe(), flush=True)
    result = simulate_fleet(dep, workload, args.replicas, args.router, seed=args.seed or 0, goodput_slos=slos,
                            hop=hop)
    summary = summarize(results_from_records(result.records), result.metrics["duration"], slos)
    print(format_summary(summary, f"Simulated Fleet Result ({args.replicas} x replica, router {args.router})"))
    print(f"prefix cache hit rate {result.prefix_hit_rate:.1%} ({result.prefix_cache_hits} of "
          f"{result.prefix_cache_queries} prompt tokens); requests per replica {result.requests_per_replica}; "
          f"router decisions {result.decisions}; {result.num_steps} steps simulated in {result.sim_wall_s:.1f} s")
    if args.result_json:
        path = Path(args.result_json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(json_safe(result.to_dict()), indent=2))
        print(f"wrote {path}")
    return 0


def _check_dashboard_args(args) -> None:
    if not args.dashboard_speed > 0:
        raise ValueError(f"dashboard_speed: must be > 0 simulated seconds per second, got {args.dashboard_speed}")
    if not 0 <= args.dashboard_port <= 65535:
        raise ValueError(f"dashboard_port: must be in [0, 65535], got {args.dashboard_port}")


def _run_with_dashboard(args, dep, workload, slos) -> int:
    from pagedserve.dashboard.replay import SimReplay, replay_info, workload_prompt_len
    from pagedserve.sim.simulator import simulate

    if dep.dp > 1:
        raise ValueError(f"dashboard: replays one engine core's pool, not -dp {dep.dp} cores")

    speed = args.dashboard_speed

    def run_simulation(on_step, gate):
        return simulate(dep, workload, max_concurrency=args.max_concurrency, goodput_slos=slos,
                        seed=args.seed or 0, on_step=on_step, pool_snapshots=gate)

    def on_done(result):
        _report(args, dep, result, slos)
        print("simulation finished; the dashboard stays up until Ctrl-C", flush=True)

    replay = SimReplay(run_simulation, replay_info(dep, speed), workload_prompt_len(workload),
                       dep.config.max_model_len, speed=speed, on_done=on_done)
    print(f"dashboard: open http://{args.dashboard_host}:{args.dashboard_port}/dashboard — the replay "
          f"(x{speed:g}) starts when the page connects", flush=True)
    replay.serve(args.dashboard_host, args.dashboard_port, "warning")
    return 1 if replay.error is not None else 0


def _report(args, dep, result, slos) -> None:
    from pagedserve.bench.report import format_summary, results_from_records, summarize
    from pagedserve.sim.cost_model import run_beyond_coverage

    summary = summarize(results_from_records(result.records), result.metrics["duration"], slos,
                        server=result.server_view())
    print(format_summary(summary, "Simulated Serving Result"))
    print(f"KV usage: max {max(result.timeline.kv_usage, default=0):.1%}, "
          f"preemptions {result.num_preemptions} ({result.metrics['num_preempted_requests']} requests), "
          f"recomputed tokens {result.num_recomputed_tokens}, blocks swapped out/in "
          f"{result.num_blocks_swapped_out}/{result.num_blocks_swapped_in}; "
          f"{result.num_steps} steps simulated in {result.sim_wall_s:.1f} s")
    for core in result.per_core:
        print(f"data-parallel engine {core['rank']}: {core['requests']} requests, {core['num_steps']} steps, busy "
              f"{core['busy_fraction']:.1%}, KV usage max {core['max_kv_usage']:.1%} (mean {core['mean_kv_usage']:.1%}), "
              f"preemptions {core['num_preemptions']}, prefix hits {core['prefix_cache_hits']} of "
              f"{core['prefix_cache_queries']} tokens" + (f", dummy passes {core['num_dummy_passes']}"
                                                          if result.data_parallel.get("lockstep") else ""))
    if result.data_parallel.get("lockstep"):
        dp = result.data_parallel
        print(f"lockstep: {dp['turns']} turns, MoE exchange {dp['exchange_s'] * 1e3:.1f} ms in all "
              f"({dp['exchange_s'] / dp['turns'] * 1e3 if dp['turns'] else 0:.3f} ms per turn)")
    if result.host_tier:
        t = result.host_tier
        print(f"host KV tier: {t['hit_tokens']:,} of {t['query_tokens']:,} prompt tokens loaded from it "
              f"({t['hit_rate']:.1%}), blocks stored/loaded/evicted {t['blocks_stored']}/{t['blocks_loaded']}/"
              f"{t['blocks_evicted']}; copies {1e3 * (t['load_seconds'] + t['store_seconds']):.1f} ms "
              f"(in {1e3 * t['load_seconds']:.1f}) against {1e3 * t['recompute_seconds_saved']:.1f} ms of prefill saved")
    for warning in run_beyond_coverage(dep.cost_model.params.coverage, result.shapes):
        print(f"warning: {warning}")
    if args.result_json:
        payload = result.to_dict(dep)
        if args.save_records:
            payload["requests"] = [
                {"request_id": r.request_id, "arrival": r.arrival, "prompt_len": r.prompt_len,
                 "output_len": r.output_len, "ttft": r.ttft, "e2el": r.e2el, "num_preemptions": r.num_preemptions,
                 "failed": r.failed} for r in result.records]
        path = Path(args.result_json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(json_safe(payload), indent=2))
        print(f"wrote {path}")
    if args.plot:
        from pagedserve.bench.plots import plot_run  # the bench's own plots, fed the simulated run
        for path in plot_run(results_from_records(result.records), result.timeline.as_scraped(),
                             result.metrics["duration"], args.plot):
            print(f"wrote {path}")


def run_calibrate(args) -> int:
    from pagedserve.config import resolve_dtype
    from pagedserve.plan.models import load_model
    from pagedserve.server.request_trace import request_trace_path
    from pagedserve.sim.cost_model import (CPU_NOMINAL_BANDWIDTH, CPU_NOMINAL_FLOPS, CostModel, CostParams,
                                           ModelCost, fit, fit_serving,
                                           match_client_records, read_request_trace, read_trace)

    info = load_model(args.model)
    if args.gpu:
        from pagedserve.plan.gpus import get_gpu
        # the serving layer is fitted from the request trace, or reported missing: not the probe's
        base = CostParams.for_gpu(get_gpu(args.gpu), serving_overhead=False)
        base.attention_layout = args.attention_layout or "paged"
        base.combine = args.combine or "max"
        dtype = info.checkpoint_dtype if args.dtype == "auto" else args.dtype
    else:
        base = CostParams(peak_flops=CPU_NOMINAL_FLOPS, mem_bandwidth=CPU_NOMINAL_BANDWIDTH,
                          attention_layout=args.attention_layout or "paged", combine=args.combine or "sum")
        dtype = resolve_dtype(args.dtype, info.checkpoint_dtype, "cpu")
    mcost = ModelCost.from_shape(info.shape, dtype, None, args.tensor_parallel_size)
    if args.from_bench:
        return _calibrate_from_bench(args, info, mcost, base, dtype)
    for name, given in (("request_trace", args.request_trace), ("bench_result", args.bench_result)):
        if given is not None and len(given) != len(args.trace):
            raise ValueError(f"{name}: give one per --trace ({len(args.trace)}), got {len(given)}")
    records = []
    for path in args.trace:
        # Runs are kept apart: a run's last step is followed by no gap (num_unfinished 0 or not).
        run = read_trace(path)
        run[-1].num_unfinished = 0
        records += run
    def swap_probe():  # a CPU engine's swap is the block copy: time it here when the trace has none
        from pagedserve.sim.swap_probe import probe_swap_cost

        return probe_swap_cost(mcost.kv_bytes_per_token, info.shape.num_layers, args.block_size, dtype)

    params, report = fit(records, mcost, base, block_size=args.block_size,
                         fit_pad_share=args.attention_layout is None and not args.gpu,
                         max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                         swap_probe=None if args.gpu else swap_probe)
    if args.step_spread is not False:
        params.step_residuals_s = report["step_residual_quantiles_s"]

    requests, missing, matched = [], [], 0
    for k, path in enumerate(args.trace):
        request_path = args.request_trace[k] if args.request_trace else request_trace_path(path)
        if not args.request_trace and not Path(request_path).is_file():
            missing.append(str(request_path))
            continue
        run_requests = read_request_trace(request_path)
        if args.bench_result:
            matched += match_client_records(run_requests, json.loads(Path(args.bench_result[k]).read_text()))
        requests += run_requests
    serving_report = None
    if requests:
        serving, serving_report = fit_serving(requests, records)
        serving_report["client_records_matched"] = matched if args.bench_result else None
        params.serving = serving.to_dict()
    if missing:
        report["warnings"].append(f"no request trace ({', '.join(missing)}): the serving overhead (HTTP, "
                                  f"tokenization, streaming) is "
                                  + ("fitted on the other runs only" if requests else
                                     "not modelled; TTFT will be low by it"))
    CostModel(mcost, params, args.block_size).save(args.out, {"fit": report, "serving_fit": serving_report,
                                                              "model": info.name, "trace": [str(t) for t in args.trace],
                                                              "dtype": dtype})
    if args.json:
        print(json.dumps({"params": params.to_dict(), "fit": report, "serving_fit": serving_report}, indent=2))
    else:
        print(format_calibration(params, report, serving_report))
    print(f"wrote {args.out}")
    return 0


def _calibrate_from_bench(args, info, mcost, base, dtype) -> int:
    from pagedserve.sim.cost_model import CostModel, ServingOverhead, fit
    from pagedserve.sim.host_overhead import quantile_at
    from pagedserve.sim.reconstruct import BURSTY_SPLIT_SHARE, merge_runs, serving_from_metrics, steps_from_bench

    for name in ("metrics_before", "metrics_after"):
        given = getattr(args, name)
        if given and len(given) != len(args.from_bench):
            raise SystemExit(f"--{name.replace('_', '-')}: one file per --from-bench run ({len(args.from_bench)}), "
                             f"got {len(given)}")
    runs = [json.loads(Path(p).read_text()) for p in args.from_bench]
    rebuilds = [steps_from_bench(r) for r in runs]
    # A run whose client got the output in bursts shows stalls, not steps: it is left out of the whole fit (its
    # steps, and the replay and /metrics that set the admission, which would take the stalls for admission time).
    keep = [k for k, rb in enumerate(rebuilds) if not rb.bursty]
    left_out = [k for k, rb in enumerate(rebuilds) if rb.bursty]
    why = [f"{args.from_bench[k]}: {rebuilds[k].num_split} of {rebuilds[k].num_clusters} token-arrival clusters "
           f"({rebuilds[k].num_split / rebuilds[k].num_clusters:.0%}) had one request twice within "
           f"{rebuilds[k].threshold_s * 1e3:.1f} ms; the client got the output in bursts, so its steps cannot be "
           f"rebuilt" for k in left_out]
    if not keep:
        raise SystemExit("calibrate --from-bench: every run was left out (more than "
                         f"{BURSTY_SPLIT_SHARE:.0%} of its clusters cut): " + "; ".join(why))
    runs, rebuilds = [runs[k] for k in keep], [rebuilds[k] for k in keep]
    metrics_before = [args.metrics_before[k] for k in keep] if args.metrics_before else None
    metrics_after = [args.metrics_after[k] for k in keep] if args.metrics_after else None
    result = merge_runs(runs)  # the runs one after another: the replay and the /metrics take them together
    steps = [s for rb in rebuilds for s in rb.steps]
    params, report = fit(steps, mcost, base, block_size=args.block_size,
                         fit_pad_share=args.attention_layout is None and not args.gpu,
                         max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs)
    report["reconstruction"] = {
        "threshold_s": statistics.median(rb.threshold_s for rb in rebuilds),
        **{key: sum(getattr(rb, key) for rb in rebuilds)
           for key in ("num_requests", "num_skipped", "num_clusters", "num_idle_starts", "num_split")}}
    report["warnings"] = [f"left out {n}" for n in why] + [n for rb in rebuilds for n in rb.notes] + report["warnings"]
    report["runs_left_out"] = [args.from_bench[k] for k in left_out]
    if args.step_spread is not False:  # before the replay below: it prices the run as the simulator will
        params.step_residuals_s = report["step_residual_quantiles_s"]
    serving_report = None
    if metrics_before and metrics_after:
        befores = [Path(p).read_text() for p in metrics_before]
        afters = [Path(p).read_text() for p in metrics_after]
        after = afters[-1]
        admit, serving_report = serving_from_metrics(result, befores, afters)
        if args.serving_fit == "subtract":
            params.serving = ServingOverhead(admit_s=admit, source="client TTFT minus the engine's queue + "
                                                                   "prefill time (its /metrics)").to_dict()
        else:
            serving, replayed = _serving_by_replay(args, info, mcost, params, result, after, serving_report)
            serving_report.update({"subtraction_admit_s": admit, "replay": replayed})
            report["warnings"] += replayed["warnings"]
            params.serving = serving.to_dict()
    else:
        report["warnings"].append("no --metrics-before/--metrics-after: the serving overhead is not modelled")
    CostModel(mcost, params, args.block_size).save(args.out, {"fit": report, "serving_fit": serving_report,
                                                              "model": info.name, "from_bench": args.from_bench,
                                                              "dtype": dtype})
    if args.json:
        print(json.dumps({"params": params.to_dict(), "fit": report, "serving_fit": serving_report}, indent=2))
    else:
        r = report["reconstruction"]
        print(f"rebuilt {len(steps)} steps from {r['num_requests']} requests' token arrivals "
              f"({r['num_clusters']} clusters at a {r['threshold_s'] * 1e3:.1f} ms threshold; {r['num_idle_starts']} "
              f"after an idle spell left out; {r['num_skipped']} requests skipped)")
        print(format_calibration(params, report, None))
        if params.step_residuals_s:
            q = params.step_residuals_s
            at = [quantile_at(q, u) * 1e3 for u in (0.1, 0.5, 0.9, 0.99)]
            print(f"step scatter around the model (added to each simulated step): p10 {at[0]:+.2f} ms, "
                  f"p50 {at[1]:+.2f}, p90 {at[2]:+.2f}, p99 {at[3]:+.2f}")
        if serving_report:
            print(f"  measured means: client TTFT {serving_report['client_ttft_mean_s'] * 1e3:.1f} ms, engine queue "
                  f"{serving_report['engine_queue_mean_s'] * 1e3:.1f} ms + prefill "
                  f"{serving_report['engine_prefill_mean_s'] * 1e3:.1f} ms")
            rep = serving_report.get("replay")
            if rep:
                print(f"  replay of the calibration run ({rep['knobs']}): simulated queue "
                      f"{rep['replay_queue_mean_s'] * 1e3:.1f} ms + prefill {rep['replay_prefill_mean_s'] * 1e3:.1f} ms; "
                      f"mean TTFT {rep['replay_ttft_without_admission_s'] * 1e3:.1f} ms with no admission, "
                      f"{rep['replay_ttft_mean_s'] * 1e3:.1f} ms at {rep['admit_s'] * 1e3:.1f} ms (the subtraction "
                      f"gave {serving_report['subtraction_admit_s'] * 1e3:.1f} ms)")
    print(f"wrote {args.out}")
    return 0


def _serving_by_replay(args, info, mcost, params, result: dict, metrics_after: str, measured: dict):
    """The admission from the calibration run replayed on the fitted step costs (sim/replay_fit.py),
    on the server's knobs: max_num_seqs and max_num_batched_tokens as given, the KV pool and prefix
    caching as vLLM's cache_config_info reports them."""
    import re

    from pagedserve.config import EngineConfig
    from pagedserve.sim.replay_fit import serving_by_replay
    from pagedserve.sim.simulator import build_deployment

    cfg = {}
    for line in metrics_after.splitlines():
        if line.startswith("vllm:cache_config_info"):
            cfg = dict(re.findall(r'(\w+)="([^"]*)"', line))
    knobs = {k: v for k, v in (("max_num_seqs", args.max_num_seqs),
                               ("max_num_batched_tokens", args.max_num_batched_tokens),
                               ("max_model_len", args.max_model_len)) if v is not None}
    blocks = cfg.get("num_gpu_blocks")
    if blocks and blocks.isdigit():
        knobs["num_kv_blocks"] = int(blocks)
    knobs["enable_prefix_caching"] = cfg.get("enable_prefix_caching", "False") == "True"
    knobs["block_size"] = args.block_size
    config = EngineConfig(enable_chunked_prefill=True, preemption_mode="recompute", **knobs)

    def build(p):
        return build_deployment(config, args.model, cost_params=p)

    serving, report = serving_by_replay(result, params, build, measured["engine_queue_mean_s"],
                                        measured["engine_prefill_mean_s"])
    report["knobs"] = ", ".join(f"{k}={v}" for k, v in knobs.items())
    return serving, report


def format_calibration(params, report: dict, serving_report: dict | None) -> str:
    """What calibrate tells a person: the fit's error by step kind, what the trace covered,
    the serving overhead, and every warning."""
    from pagedserve.sim.cost_model import ServingOverhead, coverage_note, format_error_report

    gap = report.get("step_gap") or {}
    lines = [
        f"calibrated on {report['num_used']} of {report['num_steps']} steps ({report['form']} form): mean |error| "
        f"per step {report['mean_abs_rel_error']:.1%}, total time {report['total_time_error']:+.1%}",
        f"trace covers: {coverage_note(report['coverage'])}",
        f"between steps: median {gap.get('median_gap_s', 0) * 1e3:.1f} ms over {gap.get('num_gaps', 0)} gaps "
        f"(included in each step's cost)",
        f"attention padding share: {report['attention_pad_share']:g}; swaps: {report['host_bandwidth']}",
    ]
    seen = report.get("warmup_steps_seen")
    if seen is not None:
        factors = report.get("warmup_factors") or []
        lines.append(f"after an idle spell of {params.warmup_idle_s * 1e3:g} ms or more, decode steps 1-{len(seen)} "
                     f"seen {'/'.join(map(str, seen))} times: "
                     + ("took " + ", ".join(f"{f:.2f}x" for f in factors) + " the model, applied to the simulated "
                        "steps after idle" if factors else "no warm-up fitted (too few, or as fast as the rest)"))
    if report.get("shape_errors"):
        lines += [
            "shape of the step cost, fitted to the engine thread's CPU time per step (error vs CPU time):",
            format_error_report(report["shape_errors"]),
            f"wall clock = {report['wall_per_cpu']:.2f} x CPU time + {report.get('wall_per_step_s', 0.0) * 1e3:.2f} ms "
            f"per step + {report['per_output_overhead_s'] * 1e3:.2f} ms per token sampled (the engine thread waits "
            f"for other processes and for the server's HTTP loop, which streams every token); every constant is "
            f"scaled to the wall clock",
        ]
    lines += [
        "per-step error vs the wall clock (step + gap to the next):",
        format_error_report(report["errors"]),
        f"serving overhead: {ServingOverhead.from_dict(params.serving).describe()}",
    ]
    if serving_report:
        def ms(v):
            return "n/a" if v is None else f"{v * 1e3:.1f} ms"
        lines.append(f"  measured means: admission {ms(serving_report['admission_mean_s'])} (server side "
                     f"{ms(serving_report['server_admission_mean_s'])}, client to server "
                     f"{ms(serving_report['client_to_server_mean_s'])}); delivery "
                     f"{ms(serving_report['delivery_mean_s'])} (server side {ms(serving_report['server_delivery_mean_s'])}"
                     f", server to client {ms(serving_report['server_to_client_mean_s'])})")
    for w in report["warnings"]:
        lines.append(f"warning: {w}")
    return "\n".join(lines)


if __name__ == "__main__":  # python -m pagedserve.sim.cli ...
    from pagedserve.cli import main
    sys.exit(main(["simulate", *sys.argv[1:]]))
