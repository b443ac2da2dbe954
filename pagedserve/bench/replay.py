"""Replay a workload into an in-process Engine, arrivals in real time, and record what each
request saw — the same RequestRecords the simulator fills, so reports compare field by field.

Used by `pagedserve tune --real` and the benchmarks. `clock="cpu"` measures time as the
process's CPU time plus the idle gaps it skips: on a shared machine, wall time mostly
measures the neighbours, while CPU time is what wall time would be on an idle one
(valid when torch runs one thread: set `torch.set_num_threads(1)`).
"""
from __future__ import annotations

import time
from typing import Callable, Sequence

from pagedserve.bench.report import RequestRecord
from pagedserve.bench.workloads import WorkloadRequest
from pagedserve.engine.output_processor import OutputKind
from pagedserve.sampling import SamplingParams


def greedy_exact_length(w: WorkloadRequest) -> SamplingParams:
    return SamplingParams(max_tokens=w.output_len, temperature=0.0, ignore_eos=w.ignore_eos)


def replay(engine, workload: Sequence[WorkloadRequest], *, clock: str = "wall",
           params_for: Callable[[WorkloadRequest], SamplingParams] = greedy_exact_length,
           on_step: Callable | None = None) -> tuple[list[RequestRecord], float]:
    """Returns (records in workload order, duration in seconds)."""
    if clock not in ("wall", "cpu"):
        raise ValueError(f"clock: 'wall' or 'cpu', got {clock!r}")
    read = time.perf_counter if clock == "wall" else time.process_time
    order = sorted(range(len(workload)), key=lambda i: workload[i].arrival_time)
    records = [RequestRecord(str(i), w.arrival_time, w.prompt_len, w.output_len) for i, w in enumerate(workload)]
    t0, skipped = read(), 0.0

    def now() -> float:
        return read() - t0 + skipped

    nxt = 0
    while nxt < len(order) or engine.has_unfinished_requests():
        while nxt < len(order) and workload[order[nxt]].arrival_time <= now():
            i = order[nxt]
            w = workload[i]
            try:
                engine.add_request(str(i), w.prompt_token_ids or w.prompt, params_for(w),
                                   output_kind=OutputKind.DELTA)
            except ValueError as e:
                records[i].failed, records[i].error = True, str(e)
            nxt += 1
        if not engine.has_unfinished_requests():
            gap = max(0.0, workload[order[nxt]].arrival_time - now())
            if clock == "wall":
                time.sleep(gap)
            else:
                skipped += gap  # idle: jump to the next arrival
            continue
        outputs = engine.step()
        t = now()
        if on_step is not None:
            on_step(engine, t)
        for out in outputs:
            rec = records[int(out.request_id)]
            rec.token_times.extend([t] * len(out.outputs[0].token_ids))
            if rec.first_token_time is None and rec.token_times:
                rec.first_token_time = rec.token_times[0]
            if out.finished:
                rec.finish = t
                rec.num_preemptions = out.metrics[0].num_preemptions if out.metrics else 0
    return records, now()
