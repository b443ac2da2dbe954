"""The serving layer's admission and delivery, one implementation for the single engine
(sim/simulator.py), the one API server in front of `-dp`'s cores (sim/data_parallel.py) and
every replica of a fleet (sim/fleet.py), so they cannot drift.

A `ServingLoop` is one API process's event loop (and, with the admission split, its one tokenizer
thread) as ServingOverhead describes it: requests the client sent are taken up in the order the
loop reaches them; a step's delivery work waits for the loop and occupies it. The caller owns
where the sends come from (a closed loop's slots, a fleet's hop) through a `Sends` object:
`peek()` is when the next request reaches the loop (math.inf: none yet), `pop()` takes it and
returns (key, prompt tokens), or None when the caller rejected it (it never enters the engine).
"""
from __future__ import annotations

import heapq
import math
import random
from typing import Protocol

from pagedserve.sim.report import RequestRecord
from pagedserve.core.engine_core import check_request_length
from pagedserve.sim.host_overhead import ServingOverhead, quantile_at


class Sends(Protocol):
    def peek(self) -> float: ...

    def pop(self) -> tuple[int, int] | None: ...


class HeapSends:
    """Sends known ahead of time (a fleet replica's: each reaches its server after the hop): a
    heap of (sent at, key, prompt tokens)."""

    def __init__(self) -> None:
        self.heap: list[tuple[float, int, int]] = []

    def push(self, sent: float, key: int, prompt_len: int) -> None:
        heapq.heappush(self.heap, (sent, key, prompt_len))

    def peek(self) -> float:
        return self.heap[0][0] if self.heap else math.inf

    def pop(self) -> tuple[int, int] | None:
        _, key, prompt_len = heapq.heappop(self.heap)
        return key, prompt_len

    def __len__(self) -> int:
        return len(self.heap)


class ClientSends:
    """The benchmark client's sends (`simulate()` and `simulate -dp`): open loop, each request at
    its arrival; closed loop (`max_concurrency`), when a slot opens. `pop()` makes the request's
    record (`records[i]`) and rejects, with a 400 before it is queued, one longer than the model."""

    def __init__(self, workload, max_concurrency: int | None, max_len: int, records: list) -> None:
        self.workload, self.max_concurrency, self.max_len, self.records = workload, max_concurrency, max_len, records
        self.order = sorted(range(len(workload)), key=lambda i: workload[i].arrival_time)
        self.next_idx = 0
        self.in_flight = 0
        self.slot_free_at = 0.0  # closed loop: when the latest slot opened

    def sent_at(self, w) -> float:
        return max(w.arrival_time, self.slot_free_at) if self.max_concurrency is not None else w.arrival_time

    def can_send(self) -> bool:
        return self.next_idx < len(self.order) and (self.max_concurrency is None
                                                    or self.in_flight < self.max_concurrency)

    def done_sending(self) -> bool:
        return self.next_idx >= len(self.order)

    def peek(self) -> float:
        return self.sent_at(self.workload[self.order[self.next_idx]]) if self.can_send() else math.inf

    def pop(self) -> tuple[int, int] | None:
        i = self.order[self.next_idx]
        w = self.workload[i]
        self.next_idx += 1
        rec = self.records[i] = RequestRecord(str(i), self.sent_at(w), w.prompt_len, w.output_len)
        try:
            check_request_length(w.prompt_len, w.output_len, self.max_len)
        except ValueError as e:
            rec.failed, rec.error = True, str(e)  # the engine rejects it with a 400 before it is queued
            return None
        self.in_flight += 1
        return i, w.prompt_len

    def finished(self, seen: float) -> None:
        """A request's last token reached its client at `seen`: its slot opens."""
        self.in_flight -= 1
        self.slot_free_at = seen


_SQRT_HALF = math.sqrt(0.5)


class DeliveryJitter:
    """Each token's scatter around the modelled delivery (ServingOverhead.delivery_jitter_s): per
    stream a Gaussian AR(1) with the measured lag-1 correlation, mapped through the measured
    quantiles (a Gaussian copula), so a draw has the residuals' own distribution and a slow frame
    tends to be followed by another, as the calibration's streams showed."""

    def __init__(self, quantiles: list, rho: float, seed: int = 0) -> None:
        self.quantiles = [float(q) for q in quantiles]
        self.rho = min(max(float(rho), 0.0), 0.99)
        self.fresh = math.sqrt(1.0 - self.rho * self.rho)
        self.rng = random.Random(seed ^ 0x7177E2)
        self.state: dict = {}  # stream -> its latest Gaussian draw

    def draw(self, stream, last: bool) -> float:
        z = self.rng.gauss(0.0, 1.0)
        prev = self.state.pop(stream, None) if last else self.state.get(stream)
        if prev is not None:
            z = self.rho * prev + self.fresh * z
        if not last:
            self.state[stream] = z
        u = 0.5 * (1.0 + math.erf(z * _SQRT_HALF))
        return quantile_at(self.quantiles, u)


class ServingLoop:
    def __init__(self, serving: ServingOverhead, seed: int = 0) -> None:
        self.serving = serving
        self.jitter = (DeliveryJitter(serving.delivery_jitter_s, serving.delivery_jitter_rho, seed)
                       if serving.delivery_jitter_s else None)
        self.api_free_at = 0.0   # the event loop is free again (serial)
        self.frames_until = 0.0  # the latest step's frames are written by then (merge_outputs)
        self.tok_free_at = 0.0   # the tokenizer thread is free again (split)
        self.last_entry = 0.0    # the latest hand-off to the engine: requests reach it in the order they came
        self.split = serving.serial and serving.tokenize_off_loop
        # Requests whose admission is done, on their way into the engine: (entry, key).
        self.pending: list[tuple[float, int]] = []
        # The admission split at its await: prompts tokenized (at, key) whose hand-over to the
        # engine waits for the loop.
        self.handovers: list[tuple[float, int, int]] = []  # (tokenized at, key, prompt tokens)

    def busy(self) -> bool:
        """Something taken is not in the engine yet."""
        return bool(self.pending or self.handovers)

    def next_entry(self, sends: Sends, now: float) -> float:
        """When the next thing can reach the engine: an admission under way, else the next send."""
        if self.pending:
            return self.pending[0][0]
        when = []
        if self.handovers:
            when.append(max(self.handovers[0][0], self.api_free_at))
        sent = sends.peek()
        if sent != math.inf:
            when.append(max(sent, self.api_free_at) if self.serving.serial else sent)
        return min(when) if when else now

    def admit(self, sends: Sends, now: float, until: float | None = None) -> None:
        """Start the admissions the loop reaches by `now` (or, with `until`, before then: the end of
        a step whose tokens it delivers next; those only start)."""
        serving = self.serving
        while True:
            sent = sends.peek()
            if self.split and self.handovers and self.handovers[0][0] < sent:
                # a tokenized prompt's hand-over is the loop's next ready work (ready before the
                # next send): the loop takes it up in turn and the request enters the engine
                start = max(self.handovers[0][0], self.api_free_at)
                if start >= until if until is not None else start > now:
                    break
                _, key, prompt_len = heapq.heappop(self.handovers)
                # the hand-over's own loop work (input processing, the send to the engine core)
                entry = start + serving.handover(prompt_len)
                if entry > start:
                    self.api_free_at = entry
                heapq.heappush(self.pending, (entry, key))
                continue
            if sent == math.inf or sent > now:
                break
            if serving.serial and (max(sent, self.api_free_at) >= until if until is not None
                                   else max(sent, self.api_free_at) > now):
                break  # the loop reaches it later: what is ready before that goes first
            taken = sends.pop()
            if taken is None:
                continue
            key, prompt_len = taken
            # Its admission starts when it was sent or, one event loop doing everything, when the
            # serving layer finished what came before it.
            begin = max(sent, self.api_free_at) if serving.serial else sent
            if self.split:
                # parse and validate on the loop, then the prompt waits for the tokenizer thread
                self.api_free_at = begin + serving.admit_s
                self.tok_free_at = (max(self.api_free_at, self.tok_free_at)
                                    + serving.admit_per_prompt_token_s * prompt_len)
                heapq.heappush(self.handovers, (self.tok_free_at, key, prompt_len))
                continue
            # One loop and one tokenizer thread take requests in the order they came, so none reaches
            # the engine before one sent earlier (a burst of prompts of many lengths enters first come,
            # not shortest first: the engine's queue is first come, first served).
            entry = max(begin + serving.admit(prompt_len), self.last_entry)
            self.last_entry = entry
            if serving.serial:
                self.api_free_at = entry
            heapq.heappush(self.pending, (entry, key))

    def entered(self, now: float) -> list[tuple[float, int]]:
        """The admissions done by `now`, in entry order: (entry, key) each."""
        out = []
        while self.pending and self.pending[0][0] <= now:
            out.append(heapq.heappop(self.pending))
        return out

    def seen_at(self, stream, delivered: float, step_end: float, last: bool) -> float:
        """When one stream's token from a step delivered at `delivered` reaches its client: with a
        calibrated jitter, scattered by a draw for that stream (never before the step ended)."""
        if self.jitter is None:
            return delivered
        return max(delivered + self.jitter.draw(stream, last), step_end)

    def deliver(self, sends: Sends, step_end: float, num_outputs: int) -> float:
        """When a step's tokens reach their clients: the loop's work for the step (a detokenizer
        step and a frame per stream) waits for the loop and occupies it, after the admissions it
        reached during the step; deliver_s is latency on top (the hand-over from the engine to the
        loop), occupying nothing."""
        serving = self.serving
        if not num_outputs or serving.is_zero:
            return step_end
        if not serving.serial:
            return step_end + serving.deliver(num_outputs)
        self.admit(sends, step_end, until=step_end)
        if serving.merge_outputs and self.frames_until > step_end:
            # the frames of the step before are still being written: these outputs go with them,
            # the loop only takes the step's message in
            self.api_free_at = max(step_end, self.api_free_at) + serving.deliver_step_s
            return self.api_free_at + serving.deliver_s
        self.api_free_at = max(step_end, self.api_free_at) + serving.deliver_work(num_outputs)
        self.frames_until = self.api_free_at
        return self.api_free_at + serving.deliver_s
