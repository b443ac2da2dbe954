"""Metrics over an interval → findings: symptom (with its numbers) → likely cause → knob to move first.

The rules are the source articles' table, in the articles' order, followed by the signals their
monitoring section reads (KV pinned at the top, TTFT, ITL):

  1 low_utilisation  GPU utilisation low, KV pool idle       → raise max_num_seqs (then gpu_memory_utilization)
  2 restart          counters fell: the server died (OOM)    → lower gpu_memory_utilization / max_num_batched_tokens
  3 long_prompt_itl  P99 ITL over SLO with long prompts      → enable chunked prefill / smaller max_num_batched_tokens
  4 preemptions      preemptions rising                      → lower max_num_seqs (or gpu_memory_utilization up)
  5 kv_pinned        KV usage pinned at the top              → gpu_memory_utilization up (in margin), else max_num_seqs down
                     (4 and 5 also name --kv-cache-dtype fp8 while the cache is not 8-bit: ~2x the tokens per byte)
  6 ttft_queueing    P99 TTFT over SLO while requests queue  → capacity: max_num_seqs up if KV has room, else replicas
  7 ttft_prefill     P99 TTFT over SLO, no queue             → prefill blocks: chunked prefill
    ttft_slow_steps  ... and prompts too short to block      → every step is slow: lower max_num_seqs
  8 itl_overload     P99 ITL over SLO, prompts short         → decode squeezed: lower max_num_seqs

Utilisation (and KV usage, for rule 1) is judged only over the samples with demand, requests
running or waiting: a window that mixes a busy burst with idle seconds after it is not "underfed".
The findings then move each knob one way only: where two name opposite moves of one knob, the one
that lowers it wins (preemptions or latency over the SLO outrank low utilisation; a restart outranks
a pinned pool), and the other is set aside in a note. `judge` is the one entry both `pagedserve advise` and the dashboard call, so
the same window gets the same verdict. Utilisation is called "engine busy" unless it is the GPU's
(`--gpu-util` from nvidia-smi, not on a CPU): engine_busy_ratio is the engine's forward share of time.

"Queueing" is judged on the waiting gauge and on the queue-time histogram: requests that waited
(queue-time P99 at least `queue_ttft_share` of TTFT P99) were queued even when a sparse gauge
caught few of them. Every knob is named as the target server spells it on its device
(`KnobNames`): a vLLM server has no --max-queue-len, and on CPU its KV pool is
VLLM_CPU_KVCACHE_SPACE / --kv-cache-memory-bytes, not gpu_memory_utilization.

Everything here is plain data and pure functions: the CLI scrapes, this module judges.
"""
from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field

from pagedserve import metric_names as mn
from pagedserve.bench.prom import Snapshot, counter_delta, histogram_delta, histogram_quantile, naming_label


@dataclass
class Thresholds:
    """Every number a rule compares against; each is a CLI option of the same name."""
    ttft_p99_ms: float = 2000.0        # SLO on P99 time to first token
    itl_p99_ms: float = 100.0          # SLO on P99 inter-token latency
    kv_high: float = 0.95              # KV usage at or above this counts as "at the top"
    kv_low: float = 0.5                # mean KV usage below this: the pool idles
    kv_pinned_share: float = 0.5       # share of gauge samples at kv_high that counts as "pinned"
    util_low: float = 0.6              # utilisation below this: the GPU is not fed
    util_high: float = 0.95            # utilisation at or above this: saturated
    preemptions_per_min: float = 0.0   # preemption rate above this is "rising"
    long_prompt_tokens: float = 1024   # P90 prompt length at or above this: "long prompts"
    queue_share: float = 0.5           # share of gauge samples with waiting > 0 that counts as queueing
    queue_ttft_share: float = 0.5      # queue-time P99 at least this share of TTFT P99 also counts as queueing
    short_prompt_tokens: float = 256   # prompts below this (P90) are too short for prefill to block others
    gpu_memory_utilization_margin: float = 0.90  # the articles' safe top for gpu_memory_utilization
    evicted_prefix_share: float = 0.1  # prompt tokens missed on evicted prefixes at or above this share: a tier pays

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class KnobNames:
    """How the target server spells each knob the rules move, on its device."""

    server: str                   # pagedserve | vllm | other
    device: str                   # cpu | gpu | unknown
    max_num_seqs: str
    max_num_batched_tokens: str
    enable_chunked_prefill: str
    kv_pool: str                  # what sizes the KV pool
    kv_pool_has_margin: bool      # a fraction of device memory (the articles' 0.90 margin applies)
    queue_cap: str | None         # None: the server has no queue limit of its own
    chunked_always_on: bool = False  # vLLM V1: nothing to enable; the chunk size is the knob


def knob_names(naming: str, device: str = "unknown") -> KnobNames:
    """`naming`: Observations.naming (which server the metrics came from); `device`: cpu, gpu or unknown."""
    if naming.startswith("vllm"):
        v1 = naming == "vllm"
        pools = {"gpu": "--gpu-memory-utilization",
                 "cpu": "VLLM_CPU_KVCACHE_SPACE (GiB, environment) or --kv-cache-memory-bytes"}
        pools["unknown"] = f"{pools['gpu']} (GPU) / {pools['cpu']} (CPU)"
        return KnobNames("vllm", device, "--max-num-seqs", "--max-num-batched-tokens", "--enable-chunked-prefill",
                         pools[device], device == "gpu", None, chunked_always_on=v1)
    if naming == "pagedserve":
        pools = {"gpu": "--gpu-memory-utilization", "cpu": "--kv-cache-memory"}
        pools["unknown"] = f"{pools['gpu']} (GPU) / {pools['cpu']} (CPU)"
        return KnobNames("pagedserve", device, "--max-num-seqs", "--max-num-batched-tokens",
                         "--enable-chunked-prefill", pools[device], device == "gpu", "--max-queue-len")
    return KnobNames("other", device, "max_num_seqs", "max_num_batched_tokens", "chunked prefill",
                     "the KV pool size (gpu_memory_utilization on vLLM-like GPU servers)", device == "gpu", None)


@dataclass
class Observations:
    """What the interval showed; None = the scrape lacks the metric (or it saw no observations)."""
    naming: str
    interval_s: float
    num_gauge_samples: int
    gauges_sampled: bool                    # False: only the two snapshots were there (--from-files)
    utilisation: float | None
    utilisation_source: str                 # engine_busy_ratio | --gpu-util | unknown
    kv_usage_mean: float | None
    kv_usage_max: float | None
    kv_high_share: float | None             # share of samples with KV usage ≥ kv_high
    running_mean: float | None
    running_max: float | None
    waiting_mean: float | None
    waiting_max: float | None
    waiting_share: float | None             # share of samples with waiting > 0
    swapped_mean: float | None
    preemptions: float | None
    preemptions_per_min: float | None
    prompt_tokens_per_s: float | None
    generation_tokens_per_s: float | None
    requests_per_s: float | None
    ttft_p50_ms: float | None
    ttft_p90_ms: float | None
    ttft_p99_ms: float | None
    itl_p50_ms: float | None
    itl_p90_ms: float | None
    itl_p99_ms: float | None
    e2e_p99_s: float | None
    queue_time_p99_ms: float | None
    prompt_tokens_mean: float | None
    prompt_tokens_p90: float | None
    steps_per_s: float | None
    tokens_per_step: float | None
    counter_resets: list[str] = field(default_factory=list)
    kv_cache_dtype: str | None = None       # cache_config_info's cache_dtype label (None: not exposed)
    device: str = "unknown"                 # cpu | gpu | unknown: how the server's knobs are spelled
    demand_share: float | None = None       # share of samples with requests running or waiting (None: no gauges)
    utilisation_samples: int | None = None  # samples the busy-ratio mean is over (those with demand)
    kv_usage_mean_demand: float | None = None  # KV usage mean over the samples with demand
    evicted_prefix_tokens: float | None = None  # prompt tokens missed on prefixes evicted for room (pagedserve)
    prompt_tokens: float | None = None          # prompt tokens in the interval
    tier_query_tokens: float | None = None      # looked up in a host KV tier (None: no tier metrics)

    @property
    def has_traffic(self) -> bool:
        moved = any(v for v in (self.prompt_tokens_per_s, self.generation_tokens_per_s, self.requests_per_s))
        busy = any(v for v in (self.running_max, self.waiting_max))
        return bool(moved or busy)


@dataclass
class Finding:
    rule: str
    order: int
    title: str
    symptom: str                      # with the numbers that triggered it
    cause: str
    knob: str                         # the knob to move first (the engine-neutral name)
    direction: str                    # raise | lower | enable | add
    action: str                       # the move in words, with the fallback knob
    watch: str                        # what to read after the change
    numbers: dict[str, float | None]
    thresholds: dict[str, float]
    flag: str = ""                    # the knob as the target server spells it on its device


@dataclass
class Report:
    verdict: str                      # balanced | needs_tuning | idle
    summary: str
    observations: Observations
    findings: list[Finding]
    thresholds: Thresholds
    notes: list[str]

    def to_dict(self) -> dict:
        return asdict(self)


# -- observing ----------------------------------------------------------------------------------

def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _share(values: list[float], predicate) -> float | None:
    return sum(1 for v in values if predicate(v)) / len(values) if values else None


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000.0


def observe(first: Snapshot, last: Snapshot, samples: list[Snapshot], interval_s: float,
            thresholds: Thresholds, gpu_util: float | None = None, gauges_sampled: bool = True,
            device: str = "unknown") -> Observations:
    """Rates and percentiles between `first` and `last`; gauge statistics over `samples` (first..last)."""
    if interval_s <= 0:
        raise ValueError(f"interval must be > 0 seconds, got {interval_s}")
    samples = samples or [first, last]
    resets: list[str] = []

    def gauge_series(name: str) -> list[float]:
        return [s.gauges[name] for s in samples if name in s.gauges]

    def delta(name: str) -> float | None:
        d, reset = counter_delta(first.counters.get(name), last.counters.get(name))
        if reset:
            resets.append(name)
        return d

    def hist(name: str):
        h, reset = histogram_delta(first.histograms.get(name), last.histograms.get(name))
        if reset:
            resets.append(name)
        return h

    def quantile(h, q: float) -> float | None:
        return histogram_quantile(q, h.buckets) if h is not None else None

    def rate(d: float | None) -> float | None:
        return None if d is None else d / interval_s

    kv = gauge_series(mn.KV_CACHE_USAGE_PERC)
    running = gauge_series(mn.NUM_REQUESTS_RUNNING)
    waiting = gauge_series(mn.NUM_REQUESTS_WAITING)
    swapped = gauge_series(mn.NUM_REQUESTS_SWAPPED)
    demand = [_has_demand(s) for s in samples]
    known_demand = [d for d in demand if d is not None]
    # Judged where there was demand: a sample nobody was waiting on says nothing about being underfed.
    busy = [s.gauges[mn.ENGINE_BUSY_RATIO] for s, d in zip(samples, demand)
            if mn.ENGINE_BUSY_RATIO in s.gauges and d is not False]
    kv_demand = [s.gauges[mn.KV_CACHE_USAGE_PERC] for s, d in zip(samples, demand)
                 if mn.KV_CACHE_USAGE_PERC in s.gauges and d is not False]
    if gpu_util is not None:
        utilisation, source = gpu_util, "--gpu-util"
    elif busy:
        utilisation, source = _mean(busy), mn.ENGINE_BUSY_RATIO
    elif any(mn.ENGINE_BUSY_RATIO in s.gauges for s in samples):
        utilisation, source = None, f"{mn.ENGINE_BUSY_RATIO}, no sample with demand"
    else:
        utilisation, source = None, "unknown"

    preemptions = delta(mn.NUM_PREEMPTIONS)
    ttft, itl = hist(mn.TIME_TO_FIRST_TOKEN), hist(mn.INTER_TOKEN_LATENCY)
    e2e, queue = hist(mn.E2E_REQUEST_LATENCY), hist(mn.REQUEST_QUEUE_TIME)
    prompt_len, steps = hist(mn.REQUEST_PROMPT_TOKENS), hist(mn.ITERATION_TOKENS)
    finished = delta(mn.REQUEST_SUCCESS)
    if finished is None and e2e is not None:
        finished = e2e.count
    evicted_prefix, prompt_tokens = delta(mn.PREFIX_CACHE_EVICTED_HITS), delta(mn.PROMPT_TOKENS)

    return Observations(
        naming=naming_label(first.naming | last.naming),
        interval_s=interval_s,
        num_gauge_samples=len(samples),
        gauges_sampled=gauges_sampled,
        utilisation=utilisation,
        utilisation_source=source,
        kv_usage_mean=_mean(kv),
        kv_usage_max=max(kv) if kv else None,
        kv_high_share=_share(kv, lambda v: v >= thresholds.kv_high),
        running_mean=_mean(running),
        running_max=max(running) if running else None,
        waiting_mean=_mean(waiting),
        waiting_max=max(waiting) if waiting else None,
        waiting_share=_share(waiting, lambda v: v > 0),
        swapped_mean=_mean(swapped),
        preemptions=preemptions,
        preemptions_per_min=None if preemptions is None else preemptions * 60.0 / interval_s,
        prompt_tokens_per_s=rate(prompt_tokens),
        generation_tokens_per_s=rate(delta(mn.GENERATION_TOKENS)),
        requests_per_s=rate(finished),
        ttft_p50_ms=_ms(quantile(ttft, 0.5)),
        ttft_p90_ms=_ms(quantile(ttft, 0.9)),
        ttft_p99_ms=_ms(quantile(ttft, 0.99)),
        itl_p50_ms=_ms(quantile(itl, 0.5)),
        itl_p90_ms=_ms(quantile(itl, 0.9)),
        itl_p99_ms=_ms(quantile(itl, 0.99)),
        e2e_p99_s=quantile(e2e, 0.99),
        queue_time_p99_ms=_ms(quantile(queue, 0.99)),
        prompt_tokens_mean=prompt_len.mean() if prompt_len is not None else None,
        prompt_tokens_p90=quantile(prompt_len, 0.9),
        steps_per_s=rate(steps.count) if steps is not None else None,
        tokens_per_step=steps.mean() if steps is not None else None,
        counter_resets=sorted(set(resets)),
        kv_cache_dtype=next(iter(last.by_label(mn.CACHE_CONFIG_INFO, mn.CACHE_DTYPE_LABEL)), None),
        device=device,
        demand_share=_share(known_demand, bool),
        utilisation_samples=len(busy) if source == mn.ENGINE_BUSY_RATIO else None,
        kv_usage_mean_demand=_mean(kv_demand),
        evicted_prefix_tokens=evicted_prefix,
        prompt_tokens=prompt_tokens,
        tier_query_tokens=delta(mn.EXTERNAL_PREFIX_CACHE_QUERIES),
    )


def _has_demand(snapshot: Snapshot) -> bool | None:
    """Requests running or waiting in this scrape; None when it has neither gauge."""
    running = snapshot.gauges.get(mn.NUM_REQUESTS_RUNNING)
    waiting = snapshot.gauges.get(mn.NUM_REQUESTS_WAITING)
    if running is None and waiting is None:
        return None
    return (running or 0) + (waiting or 0) > 0


def utilisation_name(obs: Observations) -> str:
    """What the utilisation number is, in words: the GPU's only when the operator read it off the
    GPU (--gpu-util); engine_busy_ratio is the engine's share of time in the forward, on any device."""
    if obs.utilisation_source == "--gpu-util" and obs.device != "cpu":
        return "GPU utilisation"
    if obs.utilisation_source.startswith(mn.ENGINE_BUSY_RATIO) or obs.device == "cpu":
        return "engine busy"
    return "utilisation"


# -- judging ------------------------------------------------------------------------------------

def _f(value: float | None, digits: int = 2) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{100 * value:.0f}%"


def _over(value: float | None, limit: float) -> bool:
    return value is not None and value > limit


EIGHT_BIT_KV_DTYPES = ("fp8", "fp8_e4m3", "fp8_e5m2", "fp8_inc", "int8")


def kv_dtype_hint(kv_cache_dtype: str | None) -> str:
    """The KV-pressure rules' other lever: fewer bytes per token, unless the cache already is 8-bit."""
    if kv_cache_dtype in EIGHT_BIT_KV_DTYPES:
        return ""
    now = f"the cache is {kv_cache_dtype}" if kv_cache_dtype else "the scrape does not say the KV cache dtype"
    return (f"; or store KV in 8 bits: --kv-cache-dtype fp8 ({now}) holds about twice the tokens of a 16-bit "
            "cache (4x fp32) in the same memory, at a small accuracy cost")


def _s(seconds: float) -> str:
    """An interval for people: 30.3 s, 2.0 min."""
    return f"{seconds / 60:.1f} min" if seconds >= 120 else f"{seconds:.1f} s"


def advise(obs: Observations, thresholds: Thresholds) -> Report:
    """Apply the rules in the articles' order; `balanced` when none fires under load."""
    t = thresholds
    findings: list[Finding] = []
    notes: list[str] = []
    k = knob_names(obs.naming, obs.device)
    flags = {"max_num_seqs": k.max_num_seqs, "max_num_batched_tokens": k.max_num_batched_tokens,
             "enable_chunked_prefill": k.enable_chunked_prefill, "gpu_memory_utilization": k.kv_pool,
             "replicas": "replicas"}
    gpu_pool, cpu_pool = knob_names(obs.naming, "gpu").kv_pool, knob_names(obs.naming, "cpu").kv_pool
    gpu_up = f"raise {gpu_pool} within margin (≤ {t.gpu_memory_utilization_margin})"
    cpu_up = f"raise {cpu_pool} (if the host has the memory)"
    pool_up = {"gpu": gpu_up, "cpu": cpu_up}.get(k.device, f"{gpu_up} on a GPU, or {cpu_up.removeprefix('raise ')} "
                                                            f"on a CPU")
    if k.server == "other":
        pool_up = f"raise {k.kv_pool}"
    queue_cap = (f"meanwhile cap the queue ({k.queue_cap}) to fail fast" if k.queue_cap else
                 "meanwhile cap the queue in front of the server (gateway or load balancer: it has no queue "
                 "limit of its own) to fail fast")

    def add(rule: str, order: int, title: str, symptom: str, cause: str, knob: str, direction: str,
            action: str, watch: str, numbers: dict, used: tuple[str, ...]) -> None:
        if knob == "enable_chunked_prefill" and k.chunked_always_on:
            knob, direction = "max_num_batched_tokens", "lower"
            action = (f"chunked prefill is always on in vLLM V1: lower {k.max_num_batched_tokens} (e.g. halve it) "
                      "so a prefill chunk costs less per step")
        findings.append(Finding(rule, order, title, symptom, cause, knob, direction, action, watch, numbers,
                                {name: getattr(t, name) for name in used}, flags.get(knob, knob)))

    if not obs.gauges_sampled:
        notes.append("gauges (KV usage, running, waiting, swapped, busy ratio) come from the two snapshots only, "
                     "not sampled through the interval: 'pinned' and 'queueing' are judged on 2 points")
    if obs.utilisation is None and obs.utilisation_source == "unknown":
        notes.append("utilisation unknown (no engine_busy_ratio; pass --gpu-util PCT from nvidia-smi): "
                     "the utilisation rule is judged on KV usage and running/waiting alone")
    if obs.counter_resets:
        notes.append("counters reset between scrapes (" + ", ".join(obs.counter_resets) + "): the second "
                     "scrape's totals are used as the interval's, as Prometheus' rate() does")

    traffic = obs.has_traffic
    kv_mean, util = obs.kv_usage_mean, obs.utilisation
    kv_pinned = obs.kv_high_share is not None and obs.kv_high_share >= t.kv_pinned_share
    queued_by_histogram = (obs.queue_time_p99_ms is not None and obs.ttft_p99_ms is not None and obs.ttft_p99_ms > 0
                           and obs.queue_time_p99_ms >= t.queue_ttft_share * obs.ttft_p99_ms)
    queueing = (obs.waiting_share is not None and obs.waiting_share >= t.queue_share) or queued_by_histogram
    long_prompts = next((v for v in (obs.prompt_tokens_p90, obs.prompt_tokens_mean) if v is not None), None)
    prompts_are_long = long_prompts is not None and long_prompts >= t.long_prompt_tokens

    # 1. GPU utilisation low, throughput not rising → KV pool too small / max_num_seqs too conservative.
    #    Judged over the samples with demand only (a burst then idle seconds is not an underfed engine).
    util_name = utilisation_name(obs)
    demand_seen = obs.demand_share is None or obs.demand_share > 0
    kv_busy = obs.kv_usage_mean_demand if obs.kv_usage_mean_demand is not None else kv_mean
    util_low = util is not None and util < t.util_low
    kv_idle = kv_busy is not None and kv_busy < t.kv_low
    if traffic and demand_seen and not kv_pinned and ((util_low and (kv_busy is None or kv_busy < t.kv_high)) or
                                                      (util is None and kv_idle)):
        load_hint = ("" if queueing else " No request waited through the interval, so the offered load may be "
                     "the limit too: raise the load test's concurrency as you raise the knob.")
        over = ("" if obs.demand_share is None else
                f" over the {round(obs.demand_share * obs.num_gauge_samples)} of {obs.num_gauge_samples} samples "
                "with requests running or waiting")
        title = f"{util_name} low, throughput not rising" if util is not None else "KV pool idle, throughput not rising"
        add("low_utilisation", 1, title,
            f"{util_name} {_f(util)} ({obs.utilisation_source}) < util_low {t.util_low}, KV usage mean "
            f"{_f(kv_busy)} (kv_low {t.kv_low}){over}; running mean {_f(obs.running_mean, 1)}, "
            f"waiting mean {_f(obs.waiting_mean, 1)}",
            "max_num_seqs is too conservative: the KV pool has room the scheduler may not use." + load_hint,
            "max_num_seqs", "raise",
            f"raise {k.max_num_seqs} one step (e.g. ×1.5); once KV usage nears kv_high, {pool_up}",
            f"{util_name} and KV usage rise; stop and back off one step when P99 TTFT/ITL near the SLO "
            "or preemptions appear",
            dict(utilisation=util, kv_usage_mean=kv_busy, running_mean=obs.running_mean,
                 waiting_mean=obs.waiting_mean),
            ("util_low", "kv_low", "kv_high"))

    # 2. OOM at high concurrency → KV pool or batch too large. Metrics cannot show an OOM, but the
    #    restart that follows it resets every counter.
    if obs.counter_resets:
        add("restart", 2, "server restarted between scrapes (OOM?)",
            "counters fell between the scrapes: " + ", ".join(obs.counter_resets),
            "the server process restarted; under high concurrency that is most often a CUDA OOM: the KV pool "
            "or the batch is too large for what weights and activations leave",
            "gpu_memory_utilization", "lower",
            f"check the server log for OOM; lower {k.kv_pool}"
            + (" by 0.05" if k.kv_pool_has_margin else "") + f", or lower {k.max_num_batched_tokens}",
            "no further restarts under the same load test; then preemptions and KV usage",
            dict(counters_reset=float(len(obs.counter_resets))), ())

    # 3. P99 latency soars with long prompts → no chunked prefill.
    if _over(obs.itl_p99_ms, t.itl_p99_ms) and prompts_are_long:
        add("long_prompt_itl", 3, "P99 inter-token latency soars, prompts are long",
            f"ITL P99 {_f(obs.itl_p99_ms, 1)} ms > itl_p99 SLO {t.itl_p99_ms:g} ms with prompt length P90 "
            f"{_f(obs.prompt_tokens_p90, 0)} (mean {_f(obs.prompt_tokens_mean, 0)}) ≥ long_prompt_tokens "
            f"{t.long_prompt_tokens:g}",
            "long prefills hold whole steps, so every running decode waits for them: chunked prefill is off "
            "or its chunk (max_num_batched_tokens) is too large",
            "enable_chunked_prefill", "enable",
            f"enable chunked prefill ({k.enable_chunked_prefill}); if it is on, lower {k.max_num_batched_tokens} "
            "(e.g. halve it) so a prefill chunk costs less per step",
            "ITL P99 falls under the SLO; TTFT P99 may rise a little; throughput should hold",
            dict(itl_p99_ms=obs.itl_p99_ms, prompt_tokens_p90=obs.prompt_tokens_p90,
                 prompt_tokens_mean=obs.prompt_tokens_mean),
            ("itl_p99_ms", "long_prompt_tokens"))

    # 4. Frequent preemption, some requests very slow → concurrency beyond what the KV pool carries.
    if _over(obs.preemptions_per_min, t.preemptions_per_min):
        add("preemptions", 4, "preemptions rising, some requests very slow",
            f"{obs.preemptions:g} preemptions in {_s(obs.interval_s)} = {_f(obs.preemptions_per_min, 1)}/min > "
            f"{t.preemptions_per_min:g}/min; KV usage mean {_f(kv_mean)} max {_f(obs.kv_usage_max)}, "
            f"swapped mean {_f(obs.swapped_mean, 1)}",
            "concurrency exceeds what the KV pool carries: sequences grow, the pool runs dry and the "
            "scheduler evicts (swap or recompute)",
            "max_num_seqs", "lower",
            f"lower {k.max_num_seqs} one step (e.g. ×0.75); or {pool_up}" + kv_dtype_hint(obs.kv_cache_dtype),
            "preemptions back to 0 per minute; throughput and P99 should improve, KV usage stays below the top",
            dict(preemptions=obs.preemptions, preemptions_per_min=obs.preemptions_per_min,
                 kv_usage_mean=kv_mean, kv_usage_max=obs.kv_usage_max, swapped_mean=obs.swapped_mean),
            ("preemptions_per_min",))

    # 5. KV usage pinned at 100% → concurrency is at the top.
    if kv_pinned:
        add("kv_pinned", 5, "KV-cache usage pinned at the top",
            f"KV usage ≥ kv_high {t.kv_high} in {_pct(obs.kv_high_share)} of {obs.num_gauge_samples} samples "
            f"(≥ kv_pinned_share {_pct(t.kv_pinned_share)}); mean {_f(kv_mean)}, max {_f(obs.kv_usage_max)}",
            "concurrency is at the top: the pool holds all it can, any more load queues or preempts",
            "gpu_memory_utilization", "raise",
            f"{pool_up} to enlarge the pool; if it is already there, lower {k.max_num_seqs}"
            + kv_dtype_hint(obs.kv_cache_dtype),
            "KV usage drops below kv_high; no OOM; preemptions stay at 0",
            dict(kv_high_share=obs.kv_high_share, kv_usage_mean=kv_mean, kv_usage_max=obs.kv_usage_max),
            ("kv_high", "kv_pinned_share"))

    # 6/7. TTFT over SLO: with a queue it is capacity, without one it is prefill blocking.
    if _over(obs.ttft_p99_ms, t.ttft_p99_ms):
        numbers = dict(ttft_p99_ms=obs.ttft_p99_ms, waiting_mean=obs.waiting_mean,
                       waiting_share=obs.waiting_share, queue_time_p99_ms=obs.queue_time_p99_ms,
                       kv_usage_max=obs.kv_usage_max)
        queue_text = (f"TTFT P99 {_f(obs.ttft_p99_ms, 0)} ms > ttft_p99 SLO {t.ttft_p99_ms:g} ms; waiting > 0 in "
                      f"{_pct(obs.waiting_share)} of samples (mean {_f(obs.waiting_mean, 1)}, max "
                      f"{_f(obs.waiting_max, 0)}), queue time P99 {_f(obs.queue_time_p99_ms, 0)} ms"
                      + (f" (≥ {t.queue_ttft_share:g} of TTFT P99: requests queued)" if queued_by_histogram else ""))
        if queueing:
            room = not kv_pinned and (obs.kv_usage_max is None or obs.kv_usage_max < t.kv_high)
            if room:
                knob, direction = "max_num_seqs", "raise"
                action = (f"raise {k.max_num_seqs}: the KV pool has room to run what waits; if KV then pins or "
                          "preemptions start, the server is at capacity: add replicas")
            else:
                knob, direction = "replicas", "add"
                action = ("add capacity (replicas / GPUs): the KV pool is full, so more concurrency would only "
                          f"preempt; {queue_cap}")
            add("ttft_queueing", 6, "high TTFT with requests queueing", queue_text,
                "requests wait for a slot: the offered load exceeds the server's capacity", knob, direction,
                action, "waiting falls to ~0 and TTFT P99 under the SLO; ITL P99 must stay within its SLO",
                numbers, ("ttft_p99_ms", "queue_share", "queue_ttft_share", "kv_high"))
        elif long_prompts is None or long_prompts >= t.short_prompt_tokens:
            add("ttft_prefill", 7, "high TTFT without a queue", queue_text,
                "prefill is blocked behind other prefills (whole long prompts per step)",
                "enable_chunked_prefill", "enable",
                f"enable chunked prefill ({k.enable_chunked_prefill}) and check {k.max_num_batched_tokens} is not "
                "far above the common prompt length",
                "TTFT P99 under the SLO; ITL P99 unchanged", dict(numbers, prompt_tokens_p90=obs.prompt_tokens_p90),
                ("ttft_p99_ms", "queue_share", "queue_ttft_share", "short_prompt_tokens"))
        else:
            add("ttft_slow_steps", 7, "high TTFT without a queue, short prompts",
                queue_text + f"; prompts short (P90 {_f(long_prompts, 0)} < short_prompt_tokens "
                             f"{t.short_prompt_tokens:g})",
                "a prompt this short cannot block others: every step is slow (a large decode batch), so a new "
                "request waits out a step and then shares one",
                "max_num_seqs", "lower",
                f"lower {k.max_num_seqs} one step (e.g. ×0.75) so each step is shorter; if TTFT stays high at a "
                "small batch, the device is too slow for the SLO",
                "TTFT P99 under the SLO; throughput drops a little; waiting must stay ~0",
                dict(numbers, prompt_tokens_p90=obs.prompt_tokens_p90),
                ("ttft_p99_ms", "queue_share", "queue_ttft_share", "short_prompt_tokens"))

    # 8. ITL over SLO with short prompts → decode squeezed by too large a batch.
    # With the GPU underfed a smaller batch would not help ITL: rule 1 already says to raise concurrency.
    if _over(obs.itl_p99_ms, t.itl_p99_ms) and not prompts_are_long and not util_low:
        saturated = util is not None and util >= t.util_high
        add("itl_overload", 8, "high ITL: decode squeezed",
            f"ITL P99 {_f(obs.itl_p99_ms, 1)} ms > itl_p99 SLO {t.itl_p99_ms:g} ms, prompts short (P90 "
            f"{_f(obs.prompt_tokens_p90, 0)} < {t.long_prompt_tokens:g}), running mean "
            f"{_f(obs.running_mean, 1)}, {util_name} {_f(util)}" + (" ≥ util_high " + str(t.util_high)
                                                                    if saturated else ""),
            "the decode batch is too large for the latency target"
            + ((": the GPU is saturated (overload)" if util_name == "GPU utilisation" else
                ": the engine is saturated (overload)") if saturated else ""),
            "max_num_seqs", "lower",
            f"lower {k.max_num_seqs} one step (e.g. ×0.75) and re-run the same load test",
            "ITL P99 under the SLO; throughput drops only a little; waiting should not grow",
            dict(itl_p99_ms=obs.itl_p99_ms, running_mean=obs.running_mean, utilisation=util),
            ("itl_p99_ms", "long_prompt_tokens", "util_high"))

    # 9. Reused prefixes evicted for room → a host KV tier (or a larger one) would serve them.
    evicted_share = (obs.evicted_prefix_tokens / obs.prompt_tokens
                     if obs.evicted_prefix_tokens is not None and obs.prompt_tokens else None)
    if evicted_share is not None and evicted_share >= t.evicted_prefix_share:
        has_tier = bool(obs.tier_query_tokens)
        tier_flag = ("--kv-offloading-backend native --kv-offloading-size GIB" if k.server == "vllm"
                     else "--kv-offloading-size GIB")
        add("evicted_prefixes", 9, "reused prefixes were evicted before they came back",
            f"{obs.evicted_prefix_tokens:g} of {obs.prompt_tokens:g} prompt tokens ({_pct(evicted_share)}, ≥ "
            f"evicted_prefix_share {_pct(t.evicted_prefix_share)}) missed the prefix cache on a prefix it had "
            "held and evicted for room" + ("; the host KV tier is on and evicts them too" if has_tier else ""),
            "the working set of reused prefixes (multi-turn histories, shared documents) outgrows the pool"
            + (" and the host tier" if has_tier else "") + ": they are computed again on every return",
            "kv_offloading_size", "raise" if has_tier else "add",
            (f"raise {tier_flag}" if has_tier else f"add a host KV tier ({tier_flag}), sized with `pagedserve plan "
             "--kv-offloading-size` to hold the histories") + f"; or {pool_up}",
            "prefix_cache_evicted_hits falls; external_prefix_cache_hits rises; TTFT P50/P99 fall on returning "
            "prompts",
            dict(evicted_prefix_tokens=obs.evicted_prefix_tokens, prompt_tokens=obs.prompt_tokens,
                 evicted_share=evicted_share, tier_query_tokens=obs.tier_query_tokens),
            ("evicted_prefix_share",))

    findings.sort(key=lambda f: f.order)
    findings = _one_way_per_knob(findings, notes)
    if findings:
        verdict = "needs_tuning"
        moves = dict.fromkeys(f"{f.flag or f.knob} ({f.direction})" for f in findings)  # each move once, in order
        summary = f"{len(findings)} finding(s); move the first knob first, one change per load-test run: " + \
            ", ".join(moves)
    elif not traffic:
        verdict = "idle"
        summary = ("no traffic in the interval (no tokens, nothing running or waiting): run a load test "
                   "while advising")
    else:
        verdict = "balanced"
        summary = (f"utilisation {_f(util)} ({obs.utilisation_source}), KV usage mean {_f(kv_mean)} "
                   f"max {_f(obs.kv_usage_max)}, preemptions {_f(obs.preemptions_per_min, 1)}/min, TTFT P99 "
                   f"{_f(obs.ttft_p99_ms, 0)} ms (SLO {t.ttft_p99_ms:g}), ITL P99 {_f(obs.itl_p99_ms, 1)} ms "
                   f"(SLO {t.itl_p99_ms:g}); more concurrency now only adds latency risk")
        if obs.ttft_p99_ms is None and obs.itl_p99_ms is None:
            notes.append("no TTFT/ITL observations in the interval: latency could not be judged")
    return Report(verdict, summary, obs, findings, thresholds, notes)


def _one_way_per_knob(findings: list[Finding], notes: list[str]) -> list[Finding]:
    """A knob moves one way per verdict. Where findings name opposite moves of one knob, the one
    that lowers it wins: preemptions, slow steps or ITL over the SLO say the batch is already too
    much, and raising max_num_seqs on the word of low utilisation or a queue with room would undo
    them; a restart (OOM) outranks a pinned pool on the pool's size. The loser goes to a note."""
    lowered = {f.knob: f for f in reversed(findings) if f.direction == "lower"}  # the first that lowers
    kept = []
    for f in findings:
        winner = lowered.get(f.knob)
        if f.direction == "raise" and winner is not None:
            notes.append(f"{f.rule} would raise {f.flag or f.knob}, but {winner.rule} lowers it and outranks it "
                         "(pressure before headroom): lower first, re-run the load test, advise again")
            continue
        kept.append(f)
    return kept


def judge(snapshots: list[Snapshot], interval_s: float, thresholds: Thresholds, *, device: str = "unknown",
          gpu_util: float | None = None, gauges_sampled: bool = True) -> Report:
    """The verdict on one window of scrapes (first .. last, in order): `pagedserve advise` and the
    dashboard both come here, so one window gets one verdict."""
    if len(snapshots) < 2:
        raise ValueError(f"a window needs two scrapes at least, got {len(snapshots)}")
    obs = observe(snapshots[0], snapshots[-1], snapshots, interval_s, thresholds, gpu_util=gpu_util,
                  gauges_sampled=gauges_sampled, device=device)
    return advise(obs, thresholds)


def detect_device(texts: list[str]) -> str:
    """cpu / gpu from what a server says of itself in its metrics, else unknown. pagedserve's
    cache_config_info has a device label (cpu | cuda); vLLM's carries its engine's settings as
    labels, and a CPU build reports a CPU KV-cache space there."""
    for text in texts:
        for line in text.splitlines():
            name = line.split("{", 1)[0]
            if line.startswith("#") or name.rsplit(":", 1)[-1] != mn.CACHE_CONFIG_INFO or ":" not in name:
                continue
            labels = dict(re.findall(r'(\w+)="([^"]*)"', line))
            device = labels.get(mn.DEVICE_LABEL)
            if device in ("cpu", "cuda", "gpu"):
                return "cpu" if device == "cpu" else "gpu"
            if labels.get("cpu_kvcache_space_bytes") not in (None, "", "None"):
                return "cpu"
            if labels.get("num_gpu_blocks") not in (None, "", "None", "0"):
                return "gpu"
    return "unknown"


# -- rendering ----------------------------------------------------------------------------------

def format_report(report: Report, source: str) -> str:
    """The human-readable report: what was measured, then each finding, then notes."""
    o, t = report.observations, report.thresholds
    lines = [
        f"pagedserve advise — {source}",
        f"  naming: {o.naming} (device: {o.device}); interval {_s(o.interval_s)}; {o.num_gauge_samples} gauge samples"
        + ("" if o.gauges_sampled else " (the two snapshots only)"),
        f"  throughput: prompt {_f(o.prompt_tokens_per_s, 1)} tok/s, generation {_f(o.generation_tokens_per_s, 1)} "
        f"tok/s, finished {_f(o.requests_per_s, 2)} req/s",
        f"  utilisation{'' if utilisation_name(o) == 'utilisation' else f' ({utilisation_name(o)})'}: "
        f"{_f(o.utilisation)} ({o.utilisation_source}"
        + (f", over {o.utilisation_samples} samples with demand" if o.utilisation_samples is not None else "") + ")"
        + (f"; engine steps {_f(o.steps_per_s, 1)}/s, {_f(o.tokens_per_step, 1)} tokens/step"
           if o.steps_per_s is not None else ""),
        f"  KV usage: mean {_f(o.kv_usage_mean)}, max {_f(o.kv_usage_max)}, ≥ {t.kv_high} in {_pct(o.kv_high_share)} "
        f"of samples" + (f"; cache dtype {o.kv_cache_dtype}" if o.kv_cache_dtype else ""),
        f"  requests: running mean {_f(o.running_mean, 1)} max {_f(o.running_max, 0)}; waiting mean "
        f"{_f(o.waiting_mean, 1)} max {_f(o.waiting_max, 0)} (> 0 in {_pct(o.waiting_share)} of samples); "
        f"swapped mean {_f(o.swapped_mean, 1)}",
        f"  preemptions: {_f(o.preemptions, 0)} ({_f(o.preemptions_per_min, 1)}/min)",
        f"  latency: TTFT P50/P90/P99 {_f(o.ttft_p50_ms, 0)}/{_f(o.ttft_p90_ms, 0)}/{_f(o.ttft_p99_ms, 0)} ms "
        f"(SLO {t.ttft_p99_ms:g}); ITL P50/P90/P99 {_f(o.itl_p50_ms, 1)}/{_f(o.itl_p90_ms, 1)}/"
        f"{_f(o.itl_p99_ms, 1)} ms (SLO {t.itl_p99_ms:g}); "
        f"queue P99 {_f(o.queue_time_p99_ms, 0)} ms; e2e P99 {_f(o.e2e_p99_s, 2)} s",
        f"  prompt tokens: mean {_f(o.prompt_tokens_mean, 0)}, P90 {_f(o.prompt_tokens_p90, 0)}",
        "",
        f"verdict: {report.verdict} — {report.summary}",
    ]
    for i, f in enumerate(report.findings, 1):
        limits = ", ".join(f"{k}={v:g}" for k, v in f.thresholds.items())
        lines += [
            "",
            f"{i}. [{f.rule}] {f.title}",
            f"   symptom: {f.symptom}",
            f"   likely cause: {f.cause}",
            f"   knob first: {f.flag or f.knob} ({f.direction}) — {f.action}",
            f"   watch after: {f.watch}",
        ]
        if limits:
            lines.append(f"   thresholds: {limits}")
    if report.notes:
        lines += ["", "notes:"] + [f"  - {n}" for n in report.notes]
    return "\n".join(lines)


__all__ = ["Thresholds", "Observations", "Finding", "Report", "observe", "advise", "judge", "detect_device",
           "utilisation_name", "format_report"]
