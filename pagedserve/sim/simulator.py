"""Discrete-event simulation of a pagedserve deployment on a virtual clock.

The scheduler and the KV-cache manager are the engine's own: the core is built by the
engine's own factory, `EngineCore.build(config, executor, pool, clock=virtual_clock,
cpu_clock=virtual_clock)` (`build_core`), which makes the scheduler with
`Scheduler.from_config` as it does for the engine, and this loop calls `core.step()`
(schedule, execute, update_from_output) as the engine does. Only the model runner is
replaced, by `SimExecutor` (a cost model). So preemptions, KV usage, queueing and tail
latency come out of the real policy.

One iteration:
    admit every request whose arrival time + admission overhead <= now (and, in closed
    loop, while fewer than max_concurrency are in flight) -> core.add_request
    core.step(): schedule, execute (the virtual clock moves by the cost model's step
    time), update
    record token times (the step's end + delivery overhead), finishes, and the step's
    running/waiting/swapped/KV usage
When nothing is in flight, the clock jumps to the next arrival. The admission and
delivery overheads are the serving layer's (HTTP, tokenization, detokenization, SSE:
`cost_model.ServingOverhead`, fitted by calibrate from the server's request trace); a
request's TTFT and E2E are measured from when the client sent it, as the bench measures. The simulator's own
per-step work is O(batch); 10,000 long-context requests of Llama-3.1-70B on 4 x H100
(228,708 steps) simulate in ~25 s on this 2-core machine.

The core's parts (clock, deployment, timeline, result) are in sim/core_run.py, shared with
sim/data_parallel.py (-dp). Torch-free: `python -c "import pagedserve.sim.simulator, sys; assert 'torch' not in sys.modules"`.
"""
from __future__ import annotations

import csv
import json
import random
import time
from pathlib import Path
from typing import Callable, Sequence

from pagedserve.bench.workloads import WorkloadRequest
from pagedserve.config import EngineConfig, resolve_dtype, resolve_kv_cache_dtype
from pagedserve.core.engine_core import check_pool_fits, size_pool
from pagedserve.core.request import Request
from pagedserve.core.snapshot import take_snapshot
from pagedserve.plan.kv_budget import KVPoolSize
from pagedserve.plan.parallel import ParallelLayout
from pagedserve.sampling import SamplingParams
from pagedserve.sim.core_run import (Deployment, SimResult, Timeline, VirtualClock,  # noqa: F401 - re-exported
                                     _prompt_ids, build_core, deliver_token, host_tier_summary)
from pagedserve.sim.cost_model import CostModel, CostParams, ModelCost, ServingOverhead, load_params
from pagedserve.sim.executor import SimExecutor
from pagedserve.sim.serving_loop import ClientSends, ServingLoop
from pagedserve.sim.parallel_cost import ParallelCostModel, Topology
from pagedserve.sim.report import RequestRecord, compute_metrics


def build_deployment(config: EngineConfig, model: str, *, gpu: str | None = None, tp: int | None = None,
                     cost_params: CostParams | str | Path | None = None, layout: ParallelLayout | None = None,
                     topology: Topology | None = None, weight_dtype: str | None = None,
                     host_cpu_speed: float | None = None, serving_overhead: bool = True,
                     host_profile: str = "pagedserve", host_overhead: str | Path | None = None,
                     usage: str = "server", max_num_seqs_unset: bool = False, endpoint: str = "completions",
                     async_scheduling: bool | None = None) -> Deployment:
    """Resolve knobs and size the pool exactly as `serve` (on CPU) or `plan` (on a GPU) would.

    GPU: pool = plan.budget.compute_plan (total x gpu_memory_utilization - weights/TP -
    activations - sampler - overhead, cut into blocks by size_kv_pool), unless
    num_kv_blocks / kv_cache_memory are given. CPU: engine.size_pool on kv_cache_memory /
    num_kv_blocks, the very function the engine calls. `tp` defaults to the config's
    tensor_parallel_size (the pool is one rank's, as on the real engine).

    `layout` (TP x PP, EP inside the TP group; replaces `tp`) and `topology` (GPUs per
    node, inter-node bandwidth) shape a GPU deployment: the plan sizes the pool per stage,
    and sim/parallel_cost.py prices the step.

    `weight_dtype` ("fp8": vLLM's --quantization fp8, or an fp8 checkpoint) overrides the
    checkpoint's dtype on a GPU: weights read at one byte, GEMMs at the fp8 tensor-core peak
    where the preset has one. Without a --cost-model, a GPU deployment charges the host CPU's
    work (sim/host_overhead.py: per step and, unless `serving_overhead` is False, per request)
    at `host_cpu_speed` x the probe machine's single-thread speed (default 1); `host_profile`
    says whose engine loop ("vllm": vLLM's published per-step cost; "pagedserve": the probe's);
    `host_overhead` a probe file measured on the host itself instead of the shipped one; `endpoint`
    the client's ("completions" or "chat": the serving terms measured for it); `async_scheduling`
    whether the step's host work overlaps the device's (None: the profile's, vLLM on, pagedserve off).
    On a GPU, an unset max_num_batched_tokens (and max_num_seqs, with `max_num_seqs_unset`) takes
    vLLM's default for the preset and `usage` ("server": `vllm serve`; "offline": the LLM class).
    """
    from pagedserve.plan.models import load_model

    if layout is not None:
        tp = layout.tp
    if tp is None:
        tp = config.tensor_parallel_size
    elif tp != config.tensor_parallel_size:
        config.tensor_parallel_size = tp
        config.distributed_executor_backend = None
        config.validate()

    info = load_model(model)
    shape = info.shape
    if isinstance(cost_params, (str, Path)):
        cost_params = load_params(cost_params)
    layout = layout or ParallelLayout(tp)
    lockstep = None
    if layout.dp > 1:  # each core prices its own step; DP + EP's exchange is the lockstep cost's
        from pagedserve.sim.data_parallel import check_dp_layout
        from pagedserve.sim.parallel_cost import DPExpertParallelCost

        check_dp_layout(layout, shape, "cpu" if gpu is None else "cuda")
    core_layout = ParallelLayout(layout.tp, layout.pp) if layout.dp > 1 else layout
    if gpu is not None:
        from pagedserve.plan.budget import PlanRequest, compute_plan, vllm_batch_defaults
        from pagedserve.plan.gpus import get_gpu

        spec = get_gpu(gpu)
        config.device = "cuda"
        # vLLM's defaults for this GPU and usage context (plan/budget.vllm_batch_defaults):
        # max_num_seqs only when the caller says the user left it unset (EngineConfig's own
        # default is the CPU engine's).
        tokens_default, seqs_default = vllm_batch_defaults(spec.memory_bytes, spec.name, usage,
                                                           config.max_num_batched_tokens)
        if config.max_num_batched_tokens is None and config.enable_chunked_prefill:
            config.max_num_batched_tokens = tokens_default
        if max_num_seqs_unset:
            config.max_num_seqs = seqs_default
        config.resolve(shape.max_position_embeddings or 8192)
        if weight_dtype is None:
            weight_dtype = info.checkpoint_dtype if config.dtype == "auto" else config.dtype
        plan = compute_plan(PlanRequest(
            model=info, device=spec, device_kind="gpu", dtype=weight_dtype, tensor_parallel_size=tp,
            pipeline_parallel_size=layout.pp, data_parallel_size=layout.dp,
            enable_expert_parallel=layout.expert_parallel, gpu_memory_utilization=config.gpu_memory_utilization,
            kv_cache_memory=config.kv_cache_memory, kv_cache_dtype=config.kv_cache_dtype,
            max_model_len=config.max_model_len, max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens, block_size=config.block_size))
        num_blocks = config.num_kv_blocks if config.num_kv_blocks is not None else plan.pool.num_blocks
        note = (f"{num_blocks:,} blocks from `pagedserve plan` ({plan.kv_pool_budget_bytes / 2**30:.2f} GiB "
                f"per GPU at {plan.pool.bytes_per_token:,} bytes/token, KV {plan.kv_dtype})")
        if cost_params is None:
            from pagedserve.sim.host_overhead import default_host_overhead

            params = CostParams.for_gpu(spec, default_host_overhead(host_cpu_speed, host_profile, host_overhead,
                                                                    endpoint, async_scheduling),
                                        serving_overhead)
        else:
            params = cost_params
        bytes_per_block = plan.pool.bytes_per_block
        cost_model = ParallelCostModel(shape, weight_dtype, plan.kv_dtype, core_layout, params,
                                       topology or Topology(), config.block_size)
        if layout.dp > 1 and layout.expert_parallel:  # priced as vLLM's DP + EP: all-to-all
            lockstep = DPExpertParallelCost(shape, weight_dtype, plan.kv_dtype, layout.dp, params,
                                            topology or Topology(), config.block_size, exchange="all-to-all")
        device = spec.name
    else:
        if layout.expert_parallel and not shape.is_moe:
            raise ValueError("enable_expert_parallel: the model has no experts")
        # the engine runs TP, EP and PP on CPU ranks (gloo): the pool is sized per stage as it sizes it
        config.pipeline_parallel_size = layout.pp
        config.enable_expert_parallel = layout.expert_parallel
        config.device = "cpu"
        config.resolve(shape.max_position_embeddings or 8192)
        dtype = resolve_dtype(config.dtype, info.checkpoint_dtype, "cpu")
        kv_dtype = resolve_kv_cache_dtype(config.kv_cache_dtype, dtype)
        pool = size_pool(config, shape, kv_dtype)
        num_blocks = pool.num_blocks
        bytes_per_block = pool.bytes_per_block
        note = f"{num_blocks:,} blocks from engine.size_pool ({pool.bytes_per_token:,} bytes/token, KV {kv_dtype})"
        if cost_params is None:
            raise ValueError("cost_model: on --device cpu give --cost-model COST.json "
                             "(made by `pagedserve simulate calibrate` from an engine step trace)")
        params = cost_params
        if core_layout.pp > 1 or core_layout.expert_parallel:
            # the CPU ranks sit on one machine: every link is the cost model's link_bandwidth
            # (a calibrated gloo rate, benchmarks/parallel_layouts.py fits one)
            cost_model = ParallelCostModel(shape, dtype, kv_dtype, core_layout, params, topology or Topology(),
                                           config.block_size)
        else:
            cost_model = CostModel(ModelCost.from_shape(shape, dtype, kv_dtype, tp), params, config.block_size)
        if layout.dp > 1 and layout.expert_parallel:  # the engine's exchange: all-gather + all-reduce over gloo
            lockstep = DPExpertParallelCost(shape, dtype, kv_dtype, layout.dp, params, topology or Topology(),
                                            config.block_size)
        device = "cpu"
    check_pool_fits(KVPoolSize(num_blocks, config.block_size, bytes_per_block // config.block_size), config)
    return Deployment(config, num_blocks, cost_model, info.name, shape.vocab_size or 32000, device, tp, note,
                      bytes_per_block, layout.describe() if gpu is not None or layout.pp > 1 or layout.expert_parallel
                      or layout.dp > 1 else "", plan if gpu is not None else None, layout.dp, lockstep)


def load_trace_workload(path: str | Path) -> list[WorkloadRequest]:
    """Arrivals from a file: JSON lines or CSV with a timestamp (seconds; `timestamp` or
    `arrival_time`), `prompt_len` (or `input_len`) and `output_len`. Timestamps are
    shifted so the first arrival is at 0. Prompt ids are filled by the simulator."""
    path = Path(path)
    text = path.read_text()
    if path.suffix == ".csv":
        rows = list(csv.DictReader(text.splitlines()))
    else:
        stripped = text.lstrip()
        rows = json.loads(text) if stripped.startswith("[") else [json.loads(l) for l in text.splitlines() if l.strip()]
    out = []
    for i, row in enumerate(rows):
        try:
            t = float(row.get("timestamp", row.get("arrival_time")))
            p = int(row.get("prompt_len", row.get("input_len")))
            o = int(row.get("output_len"))
        except (TypeError, ValueError):
            raise ValueError(f"trace: row {i + 1} of {path} needs timestamp, prompt_len and output_len; "
                             f"got {row}") from None
        if p < 1 or o < 1:
            raise ValueError(f"trace: row {i + 1} of {path}: prompt_len and output_len must be >= 1")
        out.append(WorkloadRequest(None, None, p, o, arrival_time=t))
    if not out:
        raise ValueError(f"trace: {path} holds no requests")
    out.sort(key=lambda r: r.arrival_time)
    t0 = out[0].arrival_time
    for r in out:
        r.arrival_time -= t0
    return out


def simulate(deployment: Deployment, workload: Sequence[WorkloadRequest], *, max_concurrency: int | None = None,
             goodput_slos: dict[str, float] | None = None, executor=None, seed: int = 0,
             on_step: Callable | None = None, max_steps: int | None = None,
             clock: VirtualClock | None = None, pool_snapshots=None) -> SimResult:
    """Run `workload` through the deployment's engine core on a virtual clock.

    `executor` defaults to SimExecutor(deployment.cost_model) advancing `clock`; tests pass
    a recording one that advances the clock they pass. `on_step(core_outputs)` is called
    after every step. With `pool_snapshots` (a core.snapshot.SnapshotGate; the dashboard's
    replay), `on_step` also gets a PoolSnapshot after each step the gate says, and when the
    run ends a last state report (no step) and a snapshot of the drained pool.
    """
    if deployment.dp > 1:
        if executor is not None or on_step is not None or max_steps is not None or clock is not None \
                or pool_snapshots is not None:
            raise ValueError("data_parallel_size: a -dp simulation takes no executor, clock, step hook or dashboard")
        from pagedserve.sim.data_parallel import simulate_dp
        return simulate_dp(deployment, workload, max_concurrency=max_concurrency, goodput_slos=goodput_slos, seed=seed)
    wall0 = time.perf_counter()
    config = deployment.config
    clock = clock or VirtualClock()
    executor = executor or SimExecutor(deployment.cost_model, deployment.vocab_size, seed, clock=clock)
    core = build_core(deployment, executor, clock)
    vocab = deployment.vocab_size
    id_rng = random.Random(seed) if config.enable_prefix_caching else None
    if max_concurrency is not None and max_concurrency < 1:
        raise ValueError(f"max_concurrency: must be >= 1, got {max_concurrency}")

    records: list[RequestRecord] = [None] * len(workload)  # type: ignore[list-item]
    live: dict[str, RequestRecord] = {}
    timeline = Timeline()
    # The serving layer is one event loop (one API process): an admission or a step's delivery
    # waits for the one before it. So a burst of arrivals queues at the HTTP loop and the
    # tokenizer, and a step feeding many streams delays the next admissions (serving.serial).
    # The loop takes turns (asyncio runs its ready callbacks in order, and a request's handling
    # yields at its awaits): an admission is taken up when the loop reaches it, after the tokens
    # of the steps that ended before that; a burst does not hold every stream's first token until
    # the last of its requests is admitted. sim/serving_loop.py, shared with the fleet's replicas.
    steps = 0
    preemptions = recomputed = swapped_out = swapped_in = 0
    tier_queries = 0  # prompt tokens of requests that looked past the pool into the host tier
    busy = 0.0
    max_len = config.max_model_len
    serving = ServingOverhead.from_dict(deployment.cost_model.params.serving)
    loop = ServingLoop(serving, seed)

    sends = ClientSends(workload, max_concurrency, max_len, records)

    def admit() -> None:
        """Start the admissions the serving loop reaches by now, then hand the ones done to the engine."""
        loop.admit(sends, clock.now)
        for entry, i in loop.entered(clock.now):
            w, rec = workload[i], records[i]
            params = SamplingParams(max_tokens=w.output_len, ignore_eos=True)
            core.add_request(Request(rec.request_id, _prompt_ids(w, i, vocab, id_rng), params, frozenset(), entry,
                                     0, max_len))
            live[rec.request_id] = rec

    scheduler = core.scheduler
    while True:
        admit()
        if not core.has_unfinished_requests():
            if sends.done_sending() and not loop.busy():
                break
            if not loop.busy() and max_concurrency is not None and sends.in_flight >= max_concurrency:
                raise RuntimeError(f"simulation stuck at t={clock.now:.3f}s: {sends.in_flight} in flight, "
                                   "none in the engine")
            clock.now = max(clock.now, loop.next_entry(sends, clock.now))
            continue
        outs = core.step()
        st = outs.stats
        if not st.num_batched_tokens and not st.num_blocks_swapped_out and not st.num_blocks_swapped_in:
            # Nothing could run: only an arrival can change that (the engine would idle).
            if loop.busy() or sends.can_send():
                clock.now = max(clock.now, loop.next_entry(sends, clock.now))
                continue
            raise RuntimeError(f"simulation stuck at t={clock.now:.3f}s: {st.num_waiting} waiting, "
                               f"{st.num_running} running, nothing schedulable")
        busy += outs.execute_time
        # The client sees the step's tokens after the serving layer delivered them.
        now = loop.deliver(sends, outs.timestamp, len(outs.outputs))
        for out in outs.outputs:
            seen = deliver_token(live[out.request_id], loop.seen_at(out.request_id, now, outs.timestamp, out.finished),
                                 out)
            if out.finished:
                live.pop(out.request_id)
                sends.finished(seen)
        n_pre = sum(st.num_preempted.values())
        preemptions += n_pre
        recomputed += st.num_recomputed_tokens
        swapped_out += st.num_blocks_swapped_out
        swapped_in += st.num_blocks_swapped_in
        tier_queries += st.tier_queries
        timeline.time.append(outs.timestamp)
        timeline.num_running.append(st.num_running)
        timeline.num_waiting.append(st.num_waiting)
        timeline.num_swapped.append(st.num_swapped)
        timeline.kv_usage.append(st.kv_usage)
        timeline.num_batched_tokens.append(st.num_batched_tokens)
        timeline.num_preempted.append(n_pre)
        steps += 1
        if on_step is not None:
            on_step(outs)
            if pool_snapshots is not None and (snapshot := pool_snapshots.take(scheduler)) is not None:
                on_step(snapshot)
        if max_steps is not None and steps >= max_steps:
            break
    # The run ends when its last token reached its client: after the last step by the serving
    # layer's delivery (the drained pool's last report carries that time).
    clock.now = max([clock.now] + [r.finish for r in records if r is not None and r.finish is not None])
    if pool_snapshots is not None and on_step is not None:
        on_step(core.snapshot())
        on_step(take_snapshot(scheduler))

    core.shutdown()  # closes the step trace, if config.step_trace_path asked for one
    records = [r for r in records if r is not None]
    duration = max((r.finish for r in records if r.finish is not None), default=clock.now)
    metrics = compute_metrics(records, duration, goodput_slos=goodput_slos)
    return SimResult(records, metrics, timeline, steps, deployment.num_blocks, preemptions, recomputed,
                     swapped_out, swapped_in, time.perf_counter() - wall0, busy,
                     dict(scheduler.total_preemptions_by_mode), scheduler.costs, scheduler.kv.prefix_queries,
                     scheduler.kv.prefix_hits, dict(getattr(executor, "shapes", {})), serving,
                     host_tier_summary(scheduler, tier_queries))
