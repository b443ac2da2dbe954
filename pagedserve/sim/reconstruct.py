"""A step trace rebuilt from a load test's client-side timings, for servers that write none
(vLLM, llama.cpp): `pagedserve simulate calibrate --from-bench RESULT.json`.

Every token a streaming client receives was sampled by one engine step, and the tokens of one
step reach their clients together, a step apart from the next step's. So the arrivals of all
requests, merged and sorted, fall into clusters: a new cluster starts where the gap to the
previous arrival exceeds `threshold_s` (default: 0.3 x the median inter-token gap) or where a
request already in the cluster receives another token (one token per request per step).
A cluster is one step: a request's first token means its prompt finished there (new tokens =
its prompt, context = its prompt); its k-th later token is a decode at context prompt + k. A
step's duration is the time from the previous cluster, counted only when the engine had work
throughout: some request already running (its first token at or before the previous cluster)
was still unfinished after this one. A request merely sent before the previous cluster does not
count: its prompt may still have been in the API server while the engine idled (vLLM's CPU
server: one such 'step' was 1.4x the model and, weighed as the trace's only prefill step, skewed
the fit). A step after an idle spell is left out (its start is unknown).

What this cannot see, and so assumes: a prompt computed in several chunks shows only as its
last chunk (keep prompts under max_num_batched_tokens, as the calibration workload's
defaults do); a step that sampled nothing (a chunk alone) merges into the next; and the
client receives a step's tokens a roughly constant time after the step ends (it cancels in
the differences). Requests whose chunks did not each carry one token are left out.
"""
from __future__ import annotations

import re
import statistics
from dataclasses import dataclass, field

from pagedserve.core.engine_core import StepTrace


# A run where more than this share of the clusters had to be cut did not show its steps: the client got the
# server's output in bursts (a stalled API process writing several steps' tokens back to back), and each burst
# rebuilds as one long step and a row of empty ones. vLLM's CPU server on the project's 2-core VM (2026-12-05, 19
# calibration runs): 6-15% in 13; 22-52% in 6, the three that stalled (mean TTFT 80-236 ms against ~40) among them;
# the other three (22-23%) had ordinary mean TTFTs.
BURSTY_SPLIT_SHARE = 0.2
# Above this share a rebuild notes its cuts (steps closer together than the client can tell apart).
NOTED_SPLIT_SHARE = 0.05


@dataclass
class Reconstruction:
    steps: list[StepTrace]
    threshold_s: float
    num_requests: int           # requests used
    num_skipped: int            # left out: failed, or chunks != tokens
    num_clusters: int
    num_idle_starts: int        # clusters after an idle spell (no duration)
    num_split: int              # clusters cut because one request had two tokens in them
    notes: list[str] = field(default_factory=list)

    @property
    def bursty(self) -> bool:
        """Too many clusters cut to read steps from (BURSTY_SPLIT_SHARE)."""
        return self.num_split > BURSTY_SPLIT_SHARE * self.num_clusters


def _token_times(r: dict) -> list[float] | None:
    if not r.get("success") or not r.get("num_chunks"):
        return None
    if r.get("output_tokens") not in (None, r["num_chunks"]):
        return None  # a chunk carried several tokens (or none): steps cannot be told apart
    t = r["start"] + r["ttft"]
    times = [t]
    for gap in r.get("itl") or []:
        t += gap
        times.append(t)
    return times


def steps_from_bench(result: dict, threshold_s: float | None = None) -> Reconstruction:
    """The engine steps a `pagedserve bench --result-file` run implies (see the module docstring)."""
    requests = result.get("requests") or []
    events: list[tuple[float, int, int]] = []  # (time, request index, output token index)
    prompts, sends, firsts, lasts = {}, {}, {}, {}
    skipped = 0
    gaps: list[float] = []
    for i, r in enumerate(requests):
        times = _token_times(r)
        if times is None:
            skipped += 1
            continue
        prompts[i], sends[i], firsts[i], lasts[i] = int(r["prompt_len"]), float(r["start"]), times[0], times[-1]
        events += [(t, i, k) for k, t in enumerate(times)]
        gaps += list(r.get("itl") or [])
    if not events:
        raise ValueError("bench_result: no streamed request with one token per chunk to rebuild steps from")
    if threshold_s is None:
        threshold_s = max(5e-4, 0.3 * statistics.median(gaps)) if gaps else 5e-3
    events.sort()

    clusters: list[list[tuple[float, int, int]]] = []
    split = 0
    members: set[int] = set()
    last_t = None
    for ev in events:
        t, i, _ = ev
        if last_t is None or t - last_t > threshold_s or i in members:
            if last_t is not None and i in members and t - last_t <= threshold_s:
                split += 1
            clusters.append([])
            members = set()
        clusters[-1].append(ev)
        members.add(i)
        last_t = t

    steps: list[StepTrace] = []
    idle = 0
    prev_t = None
    for cluster in clusters:
        t_c = cluster[0][0]
        new_tokens = [prompts[i] if k == 0 else 1 for _, i, k in cluster]
        context = [prompts[i] + k for _, i, k in cluster]
        busy = prev_t is not None and any(firsts[i] <= prev_t and lasts[i] >= t_c for i in sends)
        if busy:
            steps.append(StepTrace(new_tokens, context, duration=t_c - prev_t, step_time=t_c - prev_t,
                                   num_outputs=len(cluster)))
        else:
            idle += 1
        prev_t = t_c
    notes = []
    if split > len(clusters) * NOTED_SPLIT_SHARE:
        notes.append(f"{split} of {len(clusters)} clusters had to be cut where one request got two tokens: steps "
                     f"run closer together than the client can tell apart (threshold {threshold_s * 1e3:.1f} ms)")
    return Reconstruction(steps, threshold_s, len(prompts), skipped, len(clusters), idle, split, notes)


def merge_runs(results: list[dict], gap_s: float = 10.0) -> dict:
    """Several `pagedserve bench --result-file` runs as one: each run's send times shifted to start
    `gap_s` after the previous run's last token, so a replay (replay_fit) runs them one after another
    and the client's mean TTFT is theirs together. (`calibrate --from-bench A B` rebuilds each run's
    steps on its own.) Calibration runs spread over a session see the machine's speed on average,
    where one run sees its own minutes (sim_vs_vllm.py)."""
    if len(results) == 1:
        return results[0]
    merged, end = [], None
    for result in results:
        requests = [r for r in result.get("requests") or [] if r.get("start") is not None]
        if not requests:
            continue
        start = min(float(r["start"]) for r in requests)
        shift = 0.0 if end is None else end + gap_s - start
        last = start
        for r in requests:
            merged.append({**r, "start": float(r["start"]) + shift})
            if r.get("success") and r.get("ttft") is not None:
                last = max(last, float(r["start"]) + float(r["ttft"]) + sum(r.get("itl") or []))
        end = last + shift
    return {"requests": merged}


# -- the serving overhead of a server without a request trace ---------------------------------
def histogram_mean(text_before: str, text_after: str, name: str) -> tuple[float | None, float]:
    """Mean of a Prometheus histogram over the interval between two scrapes (all label sets
    added), and its count. Reads `name_sum` / `name_count` lines as exposed."""
    def totals(text: str) -> tuple[float, float]:
        s = c = 0.0
        for line in text.splitlines():
            m = re.match(rf"^{re.escape(name)}_(sum|count)(?:\{{[^}}]*\}})?\s+(\S+)", line)
            if m:
                if m.group(1) == "sum":
                    s += float(m.group(2))
                else:
                    c += float(m.group(2))
        return s, c

    s0, c0 = totals(text_before)
    s1, c1 = totals(text_after)
    count = c1 - c0
    return ((s1 - s0) / count if count > 0 else None), count


VLLM_QUEUE = "vllm:request_queue_time_seconds"
VLLM_PREFILL = "vllm:request_prefill_time_seconds"
VLLM_TTFT = "vllm:time_to_first_token_seconds"


def pooled_histogram_mean(scrapes: list[tuple[str, str]], name: str) -> tuple[float | None, float]:
    """histogram_mean over several runs, each with its (before, after) scrapes: their sums over their counts."""
    total = count = 0.0
    for before, after in scrapes:
        mean, n = histogram_mean(before, after, name)
        if mean is not None:
            total, count = total + mean * n, count + n
    return (total / count if count > 0 else None), count


def serving_from_metrics(result: dict, text_before: str | list[str], text_after: str | list[str]) -> tuple[float, dict]:
    """Admission overhead (seconds per request) of a server that keeps no request trace:
    the client's mean TTFT minus the engine's own (queue time + prefill time, from its
    histograms over the run). Several runs (merge_runs) give one scrape before and one after each.
    Returns (overhead, the means it came from)."""
    ttfts = [r["ttft"] for r in result.get("requests") or [] if r.get("success")]
    if not ttfts:
        raise ValueError("bench_result: no successful request")
    befores = [text_before] if isinstance(text_before, str) else list(text_before)
    afters = [text_after] if isinstance(text_after, str) else list(text_after)
    if len(befores) != len(afters):
        raise ValueError(f"metrics: {len(befores)} scrapes before the runs and {len(afters)} after")
    scrapes = list(zip(befores, afters))
    queue, nq = pooled_histogram_mean(scrapes, VLLM_QUEUE)
    prefill, npf = pooled_histogram_mean(scrapes, VLLM_PREFILL)
    server_ttft, _ = pooled_histogram_mean(scrapes, VLLM_TTFT)
    if queue is None or prefill is None:
        raise ValueError(f"metrics: {VLLM_QUEUE} and {VLLM_PREFILL} did not grow between the two scrapes "
                         f"(is this a vLLM server, and were the scrapes taken around the run?)")
    client = sum(ttfts) / len(ttfts)
    engine = queue + prefill
    report = {"client_ttft_mean_s": client, "engine_queue_mean_s": queue, "engine_prefill_mean_s": prefill,
              "server_ttft_mean_s": server_ttft, "num_requests": len(ttfts), "histogram_count": min(nq, npf),
              "outside_server_mean_s": None if server_ttft is None else client - server_ttft,
              "api_server_mean_s": None if server_ttft is None else server_ttft - engine}
    return max(client - engine, 0.0), report
