"""SimExecutor: the engine core's Executor with a cost model in place of a model.

`execute(SchedulerOutput) -> StepResult` like worker.model_runner.ModelRunner: every
request whose step reaches its end gets a sampled token (any valid id; requests end by
their max_tokens, the workload's output length, since the simulator sets ignore_eos), and
the step takes the time the cost model says: the virtual clock moves by it during
execute(), so the core stamps tokens when the step ends, as on real hardware. What auto
preemption weighs (host copy bandwidth, prefill time per token) comes from the same cost
model, through the calls the engine core makes of a real executor. No tensors, no torch.
"""
from __future__ import annotations

import random

from pagedserve.core.outputs import StepResult
from pagedserve.sim.host_overhead import quantile_at


def host_step_s(params, out) -> float:
    """The host CPU's part of a step as the cost model charges it (CostParams' per-step, per-request,
    per-prompt-chunk and per-token overhead terms; token_count_factors, a CPU calibration's, aside)."""
    sched = out.scheduled
    prefills = sum(1 for r in sched if len(r.token_ids) > 1)
    return (params.step_overhead_s + params.per_request_overhead_s * len(sched)
            + params.per_prefill_overhead_s * prefills + params.per_token_overhead_s * out.num_batched_tokens
            + params.per_output_overhead_s * sum(1 for r in sched if r.sample))


class SimExecutor:
    dp_lockstep = None  # no DP attention + EP lockstep (core/executor.py)

    def __init__(self, cost_model, vocab_size: int = 32000, seed: int = 0, clock=None) -> None:
        self.cost_model = cost_model
        self.clock = clock  # a VirtualClock: advanced by each step's duration
        self._rng = random.Random(seed)
        self._low = min(16, max(vocab_size - 1, 0))  # skip special ids, as the workloads do
        self._high = max(vocab_size, self._low + 1)
        self._ids = [self._rng.randrange(self._low, self._high) for _ in range(4099)]
        self._next = 0
        # The calibration's scatter of step times around the model (CostParams.step_residuals_s), drawn
        # from a generator of its own so the token ids stay those of a run without it.
        self._residuals = list(getattr(getattr(cost_model, "params", None), "step_residuals_s", None) or ())
        self._residual_rng = random.Random(seed + 0x5EED)
        # The largest shapes the run asked the cost model about (compared with what it was
        # calibrated on: cost_model.run_beyond_coverage).
        self.shapes = {"max_decode_batch": 0, "max_context": 0, "max_step_tokens": 0, "max_prefill_chunk": 0,
                       "swap_blocks": 0}
        # A calibration's warm-up after idle (CostParams.warmup_factors): the k-th step after the engine sat
        # idle for warmup_idle_s takes warmup_factors[k - 1] x its modelled time. Needs the clock.
        params = getattr(cost_model, "params", None)
        self._warmup = list(getattr(params, "warmup_factors", None) or ()) if clock is not None else []
        self._warmup_idle_s = getattr(params, "warmup_idle_s", 0.0)
        self._last_end: float | None = None
        self._since_idle = 0

    # -- what the engine core asks at build time ---------------------------------------
    def profile_kv_budget(self, gpu_memory_utilization: float, max_num_batched_tokens: int,
                          max_num_seqs: int) -> int:
        raise ValueError("kv_cache_memory: the simulator sizes the pool from `pagedserve plan` or "
                         "--kv-cache-memory/--num-kv-blocks; it has no device to profile")

    def initialize_cache(self, num_blocks: int, num_host_blocks: int) -> None:
        pass  # no tensors

    def measure_host_bandwidth(self) -> float:
        params = self.cost_model.params
        host = params.host_bandwidth * params.host_link_efficiency
        if not host:  # a CPU "host pool" is a memcpy: take the calibrated KV read rate
            host = params.mem_bandwidth * (params.attn_mbu or 1.0)
        return host

    def profile_prefill(self, num_tokens: int) -> float:
        return self.cost_model.predict([num_tokens], [num_tokens]) / num_tokens

    def check_health(self) -> None:
        pass  # a cost model: nothing to watch

    def worker_pids(self) -> list[int]:
        return []

    def shutdown(self) -> None:
        pass

    # -- the step -------------------------------------------------------------------------
    def execute(self, out) -> StepResult:
        # Token ids from a pre-drawn random cycle: as good as fresh draws for anything the
        # scheduler looks at (stop checks, prefix hashes), at a fraction of the cost.
        ids, k = self._ids, self._next
        sampled = {}
        for r in out.scheduled:
            if r.sample:
                sampled[r.request_id] = ids[k]
                k = (k + 1) % len(ids)
        self._next = k
        self._note_shape(out)
        duration = self.step_duration(out)

        if self.clock is not None:
            self.clock.now += duration
            if not out.is_empty:
                self._last_end = self.clock.now
        return StepResult(sampled=sampled, duration=duration, forward_time=duration)

    def step_duration(self, out) -> float:
        """How long the step takes (the DP + EP lockstep's executor waits for the turn here)."""
        if out.is_empty:
            return 0.0
        t = self.cost_model.step_time(out)
        params = self.cost_model.params
        if getattr(params, "host_overlap", False):
            # async scheduling: the host's part of the step ran while the device ran the step before
            host = host_step_s(params, out)
            t = max(t - host, host)
        if self._warmup:
            t *= self._warmup_factor()
        if self._residuals:
            t = max(t + quantile_at(self._residuals, self._residual_rng.random()), 0.0)
        return t

    def _warmup_factor(self) -> float:
        """The warm-up factor of the step starting now: the k-th since the engine last sat idle for
        warmup_idle_s (execute notes each non-empty step's end, once the clock has moved by it)."""
        now = self.clock.now
        last = self._last_end
        self._since_idle = 0 if last is None or now - last >= self._warmup_idle_s else self._since_idle + 1
        k = self._since_idle
        return self._warmup[k - 1] if 1 <= k <= len(self._warmup) else 1.0

    def _note_shape(self, out) -> None:
        shapes = self.shapes
        decodes = chunk = ctx = 0
        for r in out.scheduled:
            n = len(r.token_ids)
            if n == 1:
                decodes += 1
            elif n > chunk:
                chunk = n
            c = r.start_pos + n
            if c > ctx:
                ctx = c
        shapes["max_decode_batch"] = max(shapes["max_decode_batch"], decodes)
        shapes["max_prefill_chunk"] = max(shapes["max_prefill_chunk"], chunk)
        shapes["max_context"] = max(shapes["max_context"], ctx)
        shapes["max_step_tokens"] = max(shapes["max_step_tokens"], out.num_batched_tokens)
        shapes["swap_blocks"] += len(out.blocks_to_swap_out) + len(out.blocks_to_swap_in)
