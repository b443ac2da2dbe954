"""`pagedserve simulate -dp N`: data parallelism inside one server, on virtual clocks.

N copies of the engine's own core (`build_core`: each its own scheduler, KV pool, SimExecutor
and virtual clock), behind the DP client's own placement rule (core/dp_balance.py
`DPBalancer.place`, the function engine/dp_client.py calls): each request, once the serving
layer has taken it in, goes to the core with the least 4 x waiting + running, then the more
prompt blocks placed there, then the lower KV usage, then the lower rank. The balancer sees
what the DP client sees: each core's stats from the last step that *ended* by then, plus the
requests sent to it that it had not yet taken in (a burst alternates).

- Plain DP (a dense model, or an MoE model without --enable-expert-parallel): the cores are
  independent. Discrete events: the next send or entry happens when no core's step would
  end before it; otherwise the core whose clock is earliest steps.
- DP attention + EP (--enable-expert-parallel on an MoE model; worker/dp_lockstep.py): the
  cores step in lockstep on one clock. Each turn every core with work steps (its executor
  waits in the turn, as the engine's waits in the MoE layers' collectives: the busy cores
  step on threads of their own, meeting at a barrier; each core's state is its own, so the
  result does not depend on the threads' order), a core with nothing scheduled or no work
  runs a dummy pass, and the turn lasts the slowest core plus the MoE exchange
  (sim/parallel_cost.py `DPExpertParallelCost`: the engine's all-gather + all-reduce on CPU,
  priced on the cost model's link; vLLM's all-to-all on a GPU preset). On CPU, after an idle
  spell the first turn starts on the cores' next idle tick (engine/core_loop.py IDLE_WAIT:
  every idle core waits that long for messages before the cores agree again); on a GPU preset
  (vLLM's DP coordinator wakes idle ranks at once) there is none.

The serving layer is the engine's one API server in front of the N cores (engine/dp_client.py):
one `ServingLoop` (sim/serving_loop.py, the one simulate() and every fleet replica run: one event
loop, its tokenizer thread, hand-overs, deliveries) takes each request in before the balancer
places it, and every core's step delivers its tokens through that loop, in the order the steps
end. So `-dp 1` is simulate() request for request.
"""
from __future__ import annotations

import copy
import dataclasses
import heapq
import math
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Sequence

from pagedserve.bench.report import RequestRecord
from pagedserve.bench.workloads import WorkloadRequest
from pagedserve.core.dp_balance import DPBalancer, EngineLoad
from pagedserve.core.outputs import SchedulerStats
from pagedserve.core.request import Request
from pagedserve.sampling import SamplingParams
from pagedserve.sim.core_run import SimResult, Timeline, VirtualClock, _prompt_ids, build_core, deliver_token
from pagedserve.sim.cost_model import ServingOverhead
from pagedserve.sim.executor import SimExecutor
from pagedserve.sim.report import compute_metrics
from pagedserve.sim.serving_loop import ClientSends, ServingLoop

IDLE_TICK_S = 0.25  # engine/core_loop.py IDLE_WAIT (tests/test_sim_dp.py checks they agree)
_TURN_TIMEOUT_S = 600.0  # a core that never reaches the turn is a bug: fail, never hang


def check_dp_layout(layout, shape, device: str) -> None:
    """Refuse what `simulate -dp` does not run, with the numbers (the engine refuses the same)."""
    if layout.dp == 1:
        return
    if layout.tp > 1 or layout.pp > 1:
        raise ValueError(f"data_parallel_size: {layout.dp} with tensor_parallel_size={layout.tp} and "
                         f"pipeline_parallel_size={layout.pp} is not simulated (each data-parallel core is one rank, "
                         f"as in the engine); use -dp alone, or -tp / -pp without -dp")
    if layout.expert_parallel:
        if not shape.is_moe:
            raise ValueError("enable_expert_parallel: the model has no experts")
        if device == "cpu" and shape.num_experts % layout.dp:
            raise ValueError(f"enable_expert_parallel: {shape.num_experts} routed experts do not divide over "
                             f"data_parallel_size={layout.dp} cores (each holds E / N whole experts)")


class _Turn:
    """One lockstep turn: every busy core's executor posts its step and waits; the last to
    arrive prices the turn (DPExpertParallelCost.turn) for all."""

    def __init__(self, cost, num_cores: int, busy: Sequence[int], start: float) -> None:
        self.cost, self.start = cost, start
        self.steps: list = [None] * num_cores
        self.priced = None
        self.barrier = threading.Barrier(len(busy), action=self._price, timeout=_TURN_TIMEOUT_S)

    def _price(self) -> None:
        self.priced = self.cost.turn(self.steps)

    def wait(self, rank: int, out) -> float:
        sched = out.scheduled
        new = [len(r.token_ids) for r in sched]
        self.steps[rank] = (new, [r.start_pos + n for r, n in zip(sched, new)],
                            len(out.blocks_to_swap_out) + len(out.blocks_to_swap_in), sum(1 for r in sched if r.sample))
        self.barrier.wait()
        return self.priced.total


class LockstepSimExecutor(SimExecutor):
    """A DP + EP core's executor: its step lasts the turn (`turn` is set before each one)."""

    def __init__(self, rank: int, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.rank = rank
        self.turn: _Turn | None = None

    def step_duration(self, out) -> float:
        return self.turn.wait(self.rank, out)


class _Core:
    def __init__(self, rank: int, deployment, seed: int, lockstep: bool) -> None:
        self.rank = rank
        self.clock = VirtualClock()
        if deployment.config.step_trace_path:  # one trace per core, as the engine's cores write them
            config = copy.copy(deployment.config)
            config.step_trace_path = f"{config.step_trace_path}.dp{rank}"
            deployment = dataclasses.replace(deployment, config=config)
        cls_args = (deployment.cost_model, deployment.vocab_size, seed + rank)
        self.executor = (LockstepSimExecutor(rank, *cls_args, clock=self.clock) if lockstep
                         else SimExecutor(*cls_args, clock=self.clock))
        self.core = build_core(deployment, self.executor, self.clock)
        self.live: dict[str, RequestRecord] = {}
        self.placed = 0
        # What the DP client knows of this core: (stats, requests it had taken in) from its last
        # step, valid from that step's end; and the one before (a step still under way).
        self.view = self.prev_view = (SchedulerStats(num_total_blocks=deployment.num_blocks), 0)
        self.view_from = 0.0
        self.num_steps = self.num_dummy = self.num_preemptions = 0
        self.busy = self.kv_usage_sum = self.peak_kv_usage = 0.0
        self.step_seconds = self.exchange_seconds = 0.0  # its own steps (busy also counts dummy turns)

    def load_at(self, t: float) -> EngineLoad:
        stats, taken = self.view if t >= self.view_from else self.prev_view
        return EngineLoad.of(stats, self.placed - taken)

    def step(self):
        taken = self.placed
        outs = self.core.step()
        self.prev_view, self.view, self.view_from = self.view, (outs.stats, taken), outs.timestamp
        return outs


def simulate_dp(deployment, workload: Sequence[WorkloadRequest], *, max_concurrency: int | None = None,
                goodput_slos: dict[str, float] | None = None, seed: int = 0, on_place=None):
    """Run `workload` through `deployment.dp` engine cores (`deployment.lockstep_cost` set:
    DP attention + EP in lockstep). `on_place(request_index, rank)` sees every placement.
    Returns a SimResult whose totals are the fleet's and whose `per_core` holds each core's."""
    if max_concurrency is not None and max_concurrency < 1:
        raise ValueError(f"max_concurrency: must be >= 1, got {max_concurrency}")
    wall0 = time.perf_counter()
    config, n = deployment.config, deployment.dp
    lockstep = deployment.lockstep_cost is not None
    cores = [_Core(r, deployment, seed, lockstep) for r in range(n)]
    balancer = DPBalancer(config.block_size, [deployment.num_blocks] * n)
    serving = ServingOverhead.from_dict(deployment.cost_model.params.serving)
    id_rng = random.Random(seed) if config.enable_prefix_caching else None
    max_len = config.max_model_len
    records: list[RequestRecord | None] = [None] * len(workload)
    timeline = Timeline()
    # The one API server in front of the cores (sim/serving_loop.py, as simulate() and the fleet's
    # replicas run it): its event loop takes the client's sends in, then hands each to the balancer.
    loop = ServingLoop(serving, seed)
    sends = ClientSends(workload, max_concurrency, max_len, records)
    deliveries: list[tuple[float, int, int, object]] = []   # (step end, rank, seq, outputs): not delivered yet
    state = {"steps": 0, "exchange": 0.0, "turns": 0, "seq": 0}

    def loop_waits() -> bool:
        return loop.busy() or sends.peek() != math.inf

    def take_in(now: float) -> None:
        """The serving loop's admissions reached by `now`; those done go to the balancer's core."""
        loop.admit(sends, now)
        for at, i in loop.entered(now):
            w, rec = workload[i], records[i]
            ids = _prompt_ids(w, i, deployment.vocab_size, id_rng)
            rank = balancer.place(ids, [c.load_at(at) for c in cores])
            if on_place is not None:
                on_place(i, rank)
            core = cores[rank]
            core.placed += 1
            if not core.core.has_unfinished_requests():
                core.clock.now = max(core.clock.now, at)  # an idle core wakes for it (a busy one is past it)
            core.core.add_request(Request(rec.request_id, ids, SamplingParams(max_tokens=w.output_len,
                                                                              ignore_eos=True),
                                          frozenset(), at, 0, max_len))
            core.live[rec.request_id] = rec

    def account(core: _Core, outs, exchange: float = 0.0) -> None:
        st = outs.stats
        core.num_steps += 1
        core.busy += outs.execute_time
        core.step_seconds += outs.execute_time
        core.exchange_seconds += exchange
        core.num_preemptions += sum(st.num_preempted.values())
        core.kv_usage_sum += st.kv_usage
        core.peak_kv_usage = max(core.peak_kv_usage, st.kv_usage)

    def queue_delivery(core: _Core, outs, at: float) -> None:
        if outs.outputs:
            heapq.heappush(deliveries, (at, core.rank, state["seq"], outs))
            state["seq"] += 1

    def deliver() -> None:
        """The earliest step end's tokens, through the one loop (after what it reached before them)."""
        at, rank, _, outs = heapq.heappop(deliveries)
        core = cores[rank]
        seen_at = loop.deliver(sends, at, len(outs.outputs))
        for out in outs.outputs:
            seen = deliver_token(core.live[out.request_id], loop.seen_at(out.request_id, seen_at, at, out.finished),
                                 out)
            if out.finished:
                core.live.pop(out.request_id)
                sends.finished(seen)

    def next_wake() -> float:
        """When something outside a core that did no work can change it: a request reaching the
        cores, or a delivery (a closed loop's slot)."""
        return min(loop.next_entry(sends, 0.0) if loop_waits() else math.inf,
                   deliveries[0][0] if deliveries else math.inf)

    def record_timeline(at: float, preempted: int, tokens: int) -> None:
        """The fleet as /metrics shows it: the unlabelled gauges sum the cores."""
        views = [c.view[0] for c in cores]
        timeline.time.append(at)
        timeline.num_running.append(sum(s.num_running for s in views))
        timeline.num_waiting.append(sum(s.num_waiting for s in views))
        timeline.num_swapped.append(sum(s.num_swapped for s in views))
        used, total = sum(s.num_used_blocks for s in views), sum(s.num_total_blocks for s in views)
        timeline.kv_usage.append(used / total if total else 0.0)
        timeline.num_batched_tokens.append(tokens)
        timeline.num_preempted.append(preempted)

    def stuck(now: float):
        return RuntimeError(f"simulation stuck at t={now:.3f}s: "
                            + ", ".join(f"core {c.rank}: {len(c.core.scheduler.waiting)} waiting, "
                                        f"{len(c.core.scheduler.running)} running" for c in cores)
                            + "; nothing schedulable")

    totals = {"preempted": 0, "recomputed": 0, "swapped_out": 0, "swapped_in": 0}

    def count(outs) -> int:
        st = outs.stats
        pre = sum(st.num_preempted.values())
        totals["preempted"] += pre
        totals["recomputed"] += st.num_recomputed_tokens
        totals["swapped_out"] += st.num_blocks_swapped_out
        totals["swapped_in"] += st.num_blocks_swapped_in
        return pre

    def did_work(outs) -> bool:
        st = outs.stats
        return bool(st.num_batched_tokens or st.num_blocks_swapped_out or st.num_blocks_swapped_in)

    if not lockstep:
        # Discrete events in time order: a step's delivery, then what the loop hands to the cores,
        # then the core whose clock is earliest steps (each on its own clock); at a tie in that order.
        while True:
            stepping = [c for c in cores if c.core.has_unfinished_requests()]
            step_at = min((c.clock.now for c in stepping), default=math.inf)
            entry_at = loop.next_entry(sends, step_at) if loop_waits() else math.inf
            deliver_at = deliveries[0][0] if deliveries else math.inf
            if deliver_at <= min(entry_at, step_at) and deliver_at < math.inf:
                deliver()
                continue
            if entry_at <= step_at and entry_at < math.inf:
                take_in(entry_at)
                continue
            if not stepping:
                break
            core = min(stepping, key=lambda c: (c.clock.now, c.rank))
            take_in(core.clock.now)  # what the loop reached by then starts (simulate() admits before each step)
            outs = core.step()
            state["steps"] += 1
            pre = count(outs)
            if not did_work(outs):  # nothing could run on it: only an arrival can change that
                nxt = next_wake()
                if nxt == math.inf:
                    raise stuck(core.clock.now)
                core.clock.now = max(core.clock.now, nxt)
                continue
            account(core, outs)
            queue_delivery(core, outs, outs.timestamp)
            record_timeline(outs.timestamp, pre, outs.stats.num_batched_tokens)
    else:
        now, idle, idle_since = 0.0, True, 0.0  # idle: the cores wait in idle ticks since idle_since
        # pagedserve's engine (CPU) polls in idle ticks; a GPU preset prices vLLM's DP + EP, whose
        # coordinator wakes the idle ranks when a request arrives: no tick
        idle_tick = IDLE_TICK_S if deployment.device == "cpu" else 0.0
        pool = ThreadPoolExecutor(max_workers=n, thread_name_prefix="sim-dp-core")
        try:
            while True:
                take_in(now)  # everything the loop took in by now, in order
                busy = [c for c in cores if c.core.has_unfinished_requests()]
                if not busy:
                    if not loop_waits():
                        break
                    now = max(now, loop.next_entry(sends, now))
                    continue
                if idle and idle_tick:  # work after an idle spell: the cores next agree on an idle tick
                    tick = idle_since + idle_tick * math.ceil((now - idle_since) / idle_tick - 1e-9)
                    if tick > now:
                        now = tick  # what is sent or taken in by then joins the first turn
                        continue
                    idle = False
                turn = _Turn(deployment.lockstep_cost, n, [c.rank for c in busy], now)
                for c in cores:
                    c.clock.now = now
                    c.executor.turn = turn
                if len(busy) == 1:
                    results = [busy[0].step()]
                else:
                    futures = [pool.submit(_step_in_turn, c, turn) for c in busy]
                    results = [f.result() for f in futures]
                priced = turn.priced
                end = now + priced.total
                state["turns"] += 1
                state["exchange"] += priced.exchange
                worked, pre_sum, tokens = False, 0, 0
                for c, outs in zip(busy, results):
                    state["steps"] += 1
                    pre_sum += count(outs)
                    tokens += outs.stats.num_batched_tokens
                    worked = worked or did_work(outs)
                    account(c, outs, priced.exchange)
                    queue_delivery(c, outs, end)
                for c in cores:
                    c.num_dummy += priced.dummy[c.rank]
                    if c not in busy:
                        c.busy += priced.total
                    c.clock.now = end
                while deliveries:  # the turn's tokens, core by core, through the one loop
                    deliver()
                if not worked:  # no core could run anything: only an arrival can change that
                    nxt = next_wake()
                    if nxt == math.inf:
                        raise stuck(now)
                    now = max(end, nxt)
                    continue
                record_timeline(end, pre_sum, tokens)
                now = end
                if not any(c.core.has_unfinished_requests() for c in cores):
                    idle, idle_since = True, end
        finally:
            pool.shutdown(wait=True)

    if not sends.done_sending():  # a closed loop whose slots never opened: a bug, never a short result
        raise RuntimeError(f"simulation stuck: {sends.in_flight} in flight, none in the cores or the serving loop")
    for c in cores:
        c.core.shutdown()
    done = [r for r in records if r is not None]
    duration = max((r.finish for r in done if r.finish is not None), default=0.0)
    metrics = compute_metrics(done, duration, goodput_slos=goodput_slos)
    per_core = []
    for c, placed in zip(cores, balancer.num_placed):
        sched = c.core.scheduler
        per_core.append({"rank": c.rank, "requests": placed, "num_steps": c.num_steps, "step_seconds": c.step_seconds,
                         "exchange_seconds": c.exchange_seconds,
                         "busy_fraction": c.busy / duration if duration else 0.0,
                         "max_kv_usage": c.peak_kv_usage,
                         "mean_kv_usage": c.kv_usage_sum / c.num_steps if c.num_steps else 0.0,
                         "num_preemptions": c.num_preemptions, "prefix_cache_queries": sched.kv.prefix_queries,
                         "prefix_cache_hits": sched.kv.prefix_hits, "num_dummy_passes": c.num_dummy})
    shapes: dict = {}
    for c in cores:
        for k, v in c.executor.shapes.items():
            shapes[k] = shapes.get(k, 0) + v if k == "swap_blocks" else max(shapes.get(k, 0), v)
    by_mode: dict = {}
    for c in cores:
        for mode, k in c.core.scheduler.total_preemptions_by_mode.items():
            by_mode[mode] = by_mode.get(mode, 0) + k
    result = SimResult(done, metrics, timeline, state["steps"], deployment.num_blocks, totals["preempted"],
                       totals["recomputed"], totals["swapped_out"], totals["swapped_in"], time.perf_counter() - wall0,
                       sum(c.busy for c in cores) / n, by_mode, cores[0].core.scheduler.costs,
                       sum(p["prefix_cache_queries"] for p in per_core), sum(p["prefix_cache_hits"] for p in per_core),
                       shapes, serving, {}, per_core,
                       {"size": n, "lockstep": lockstep, "turns": state["turns"], "exchange_s": state["exchange"]})
    return result


def _step_in_turn(core: _Core, turn: _Turn):
    try:
        return core.step()
    except BaseException:
        turn.barrier.abort()  # the others leave the turn at once (BrokenBarrierError), not at the timeout
        raise
