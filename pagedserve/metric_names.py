"""The names of pagedserve's Prometheus metrics and what other servers call the same quantities.

One table that every writer and reader of a metric uses: `metrics.py` builds its collectors from
it, `bench/prom.py` maps a scrape of pagedserve, vLLM (V1 and V0) or llama.cpp onto it, and
`bench/metrics_scrape.py`, the reports, the advisor and the simulator's "inside the server" view
key their numbers by it. Referring to a metric by a constant of this module, never by a string
literal, turns a rename into an ImportError or a failing test instead of a silently empty panel.

Invariants:
- `MetricSpec.name` is the canonical name: no server prefix and no counter `_total`. A scrape
  normalised by `bench/prom.py` keys every metric by it.
- `MetricSpec.exposed` is the family's sample name as Prometheus shows it, without the prefix: a
  counter's samples carry `_total` (prometheus_client appends it). Reports and result files that
  speak of a metric use this form (`num_preemptions_total`), as a PromQL user would type it.
- Every foreign name (vLLM V1, vLLM V0, llama.cpp) maps to exactly one canonical name, and no
  foreign name is itself a canonical name of another metric (checked at import).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

PREFIX = "pagedserve:"
VLLM_PREFIX = "vllm:"
LLAMACPP_PREFIX = "llamacpp:"
# prefix → the naming it stands for (what a report says a scrape "speaks")
PREFIXES = {PREFIX: "pagedserve", VLLM_PREFIX: "vllm", LLAMACPP_PREFIX: "llamacpp"}

Kind = Literal["gauge", "counter", "histogram"]

# -- canonical names ----------------------------------------------------------------------------
NUM_REQUESTS_RUNNING = "num_requests_running"
NUM_REQUESTS_WAITING = "num_requests_waiting"
NUM_REQUESTS_SWAPPED = "num_requests_swapped"
KV_CACHE_USAGE_PERC = "kv_cache_usage_perc"
KV_CACHE_TOTAL_TOKENS = "kv_cache_total_tokens"
KV_CACHE_USED_TOKENS = "kv_cache_used_tokens"
KV_CACHE_BYTES_PER_TOKEN = "kv_cache_bytes_per_token"
CACHE_CONFIG_INFO = "cache_config_info"          # value 1; the KV cache's settings in its labels
ENGINE_BUSY_RATIO = "engine_busy_ratio"
NUM_PREEMPTIONS = "num_preemptions"
PROMPT_TOKENS = "prompt_tokens"
GENERATION_TOKENS = "generation_tokens"
REQUEST_SUCCESS = "request_success"
PREFIX_CACHE_QUERIES = "prefix_cache_queries"
PREFIX_CACHE_HITS = "prefix_cache_hits"
RECOMPUTED_TOKENS = "recomputed_tokens"
SWAPPED_BLOCKS = "swapped_blocks"
TIME_TO_FIRST_TOKEN = "time_to_first_token_seconds"
INTER_TOKEN_LATENCY = "inter_token_latency_seconds"
E2E_REQUEST_LATENCY = "e2e_request_latency_seconds"
REQUEST_QUEUE_TIME = "request_queue_time_seconds"
REQUEST_PROMPT_TOKENS = "request_prompt_tokens"
REQUEST_GENERATION_TOKENS = "request_generation_tokens"
ITERATION_TOKENS = "iteration_tokens_total"      # vLLM's name: a histogram despite the `_total`
REQUEST_NUM_PREEMPTIONS = "request_num_preemptions"
ENGINE_STEP = "engine_step_seconds"
STRUCTURED_OUTPUT_ERRORS = "structured_output_errors"
GRAMMAR_CACHE_ENTRIES = "grammar_cache_entries"
GRAMMAR_CACHE_BYTES = "grammar_cache_bytes"
KV_EVENTS = "kv_events"                          # --kv-events-config: events published / dropped
# The host KV tier (--kv-offloading-size), with vLLM's names for its offloading connector
EXTERNAL_PREFIX_CACHE_QUERIES = "external_prefix_cache_queries"
EXTERNAL_PREFIX_CACHE_HITS = "external_prefix_cache_hits"
KV_OFFLOAD_BYTES = "kv_offload_total_bytes"
KV_OFFLOAD_BLOCKS = "kv_offload_blocks"
KV_OFFLOAD_CPU_CACHE_USAGE = "kv_offload_cpu_cache_usage_perc"
PREFIX_CACHE_EVICTED_HITS = "prefix_cache_evicted_hits"  # misses on prefixes evicted for room (advise: a tier)
ENGINE_STALLS = "engine_stalls"                  # the step watchdog (engine/async_llm.py)
ENGINE_STALLED = "engine_stalled"
# -dp: each data-parallel engine core's own queues and pool (the unlabelled series are their sums)
DP_ENGINE_REQUESTS_RUNNING = "dp_engine_num_requests_running"
DP_ENGINE_REQUESTS_WAITING = "dp_engine_num_requests_waiting"
DP_ENGINE_KV_CACHE_USAGE_PERC = "dp_engine_kv_cache_usage_perc"

# Labels besides model_name.
MODE_LABEL = "mode"                      # num_preemptions: recompute | swap
FINISHED_REASON_LABEL = "finished_reason"  # request_success: stop | length | abort | error
DIRECTION_LABEL = "direction"            # swapped_blocks: out | in
OUTCOME_LABEL = "outcome"                # kv_events: published | dropped
TRANSFER_TYPE_LABEL = "transfer_type"    # kv_offload_*: GPU_to_CPU (pool -> tier) | CPU_to_GPU (vLLM's values)
CACHE_DTYPE_LABEL = "cache_dtype"        # cache_config_info: float32 | bfloat16 | fp8_e4m3 | int8 ... (vLLM's label)
ENGINE_LABEL = "engine"                  # dp_engine_*: the data-parallel rank, as vLLM labels its DP engines
DEVICE_LABEL = "device"                  # cache_config_info: cpu | cuda (`advise` spells knobs by it)
# Labels that only say which engine or model a series came from; a normalised scrape adds over them.
SOURCE_LABELS = ("model_name", "engine")


@dataclass(frozen=True)
class MetricSpec:
    name: str                          # canonical (see the module docstring)
    kind: Kind
    help: str
    labels: tuple[str, ...] = ()       # beyond model_name
    vllm: str | None = None            # vLLM V1's name for the same quantity (None: vLLM has none)
    vllm_old: tuple[str, ...] = ()     # names in older vLLM (V0, early V1), where they differ
    llamacpp: str | None = None        # llama.cpp server's name (with --metrics)
    ratio: bool = False                # a share in [0, 1]: several series are averaged, not added

    @property
    def exposed(self) -> str:
        return self.name + "_total" if self.kind == "counter" else self.name


METRICS: tuple[MetricSpec, ...] = (
    # Scheduler and pool state.
    MetricSpec(NUM_REQUESTS_RUNNING, "gauge", "Number of requests in model execution batches.",
               vllm=NUM_REQUESTS_RUNNING, llamacpp="requests_processing"),
    MetricSpec(NUM_REQUESTS_WAITING, "gauge", "Number of requests waiting to be processed.",
               vllm=NUM_REQUESTS_WAITING, llamacpp="requests_deferred"),
    MetricSpec(NUM_REQUESTS_SWAPPED, "gauge", "Number of requests swapped out to host memory.",
               vllm_old=(NUM_REQUESTS_SWAPPED,)),
    MetricSpec(KV_CACHE_USAGE_PERC, "gauge", "KV-cache usage. 1 means 100 percent usage.",
               vllm=KV_CACHE_USAGE_PERC, vllm_old=("gpu_cache_usage_perc",), llamacpp="kv_cache_usage_ratio",
               ratio=True),
    MetricSpec(KV_CACHE_TOTAL_TOKENS, "gauge", "Tokens the KV-cache pool holds (blocks x block_size)."),
    MetricSpec(KV_CACHE_USED_TOKENS, "gauge", "Token slots in blocks held by requests."),
    MetricSpec(KV_CACHE_BYTES_PER_TOKEN, "gauge",
               "Bytes one token's K and V take in the KV-cache pool (all layers, quantization scales included)."),
    MetricSpec(CACHE_CONFIG_INFO, "gauge",
               "Information of the KV cache: its dtype, block size, blocks and device (value 1).",
               (CACHE_DTYPE_LABEL, "block_size", "num_blocks", DEVICE_LABEL), vllm=CACHE_CONFIG_INFO),
    MetricSpec(ENGINE_BUSY_RATIO, "gauge", "Share of wall time spent in the model forward over the last window.",
               ratio=True),
    # Counters.
    MetricSpec(NUM_PREEMPTIONS, "counter", "Cumulative number of preemptions.", (MODE_LABEL,),
               vllm=NUM_PREEMPTIONS),
    MetricSpec(PROMPT_TOKENS, "counter", "Number of prefill tokens processed.",
               vllm=PROMPT_TOKENS, llamacpp=PROMPT_TOKENS),
    MetricSpec(GENERATION_TOKENS, "counter", "Number of generation tokens processed.",
               vllm=GENERATION_TOKENS, llamacpp="tokens_predicted"),
    MetricSpec(REQUEST_SUCCESS, "counter", "Count of finished requests by finish reason.", (FINISHED_REASON_LABEL,),
               vllm=REQUEST_SUCCESS),
    MetricSpec(PREFIX_CACHE_QUERIES, "counter", "Prompt tokens looked up in the prefix cache.",
               vllm=PREFIX_CACHE_QUERIES, vllm_old=("gpu_prefix_cache_queries",)),
    MetricSpec(PREFIX_CACHE_HITS, "counter", "Prompt tokens found in the prefix cache.",
               vllm=PREFIX_CACHE_HITS, vllm_old=("gpu_prefix_cache_hits",)),
    MetricSpec(RECOMPUTED_TOKENS, "counter", "Tokens whose KV was dropped by recompute preemption."),
    MetricSpec(SWAPPED_BLOCKS, "counter", "KV blocks moved between device and host.", (DIRECTION_LABEL,)),
    MetricSpec(KV_EVENTS, "counter", "KV cache events (--kv-events-config) sent to subscribers, or dropped.",
               (OUTCOME_LABEL,)),
    MetricSpec(EXTERNAL_PREFIX_CACHE_QUERIES, "counter",
               "Prompt tokens of requests looked up in the host KV tier (--kv-offloading-size).",
               vllm=EXTERNAL_PREFIX_CACHE_QUERIES),
    MetricSpec(EXTERNAL_PREFIX_CACHE_HITS, "counter",
               "Prompt tokens loaded from the host KV tier instead of computed.", vllm=EXTERNAL_PREFIX_CACHE_HITS),
    MetricSpec(KV_OFFLOAD_BYTES, "counter",
               "Bytes one rank copied between the KV pool and the host KV tier (GPU_to_CPU: stored, "
               "CPU_to_GPU: loaded; the pool side is named GPU as vLLM names it, on CPU too).",
               (TRANSFER_TYPE_LABEL,), vllm=KV_OFFLOAD_BYTES),
    MetricSpec(KV_OFFLOAD_BLOCKS, "counter", "KV blocks copied between the KV pool and the host KV tier.",
               (TRANSFER_TYPE_LABEL,)),
    MetricSpec(PREFIX_CACHE_EVICTED_HITS, "counter",
               "Prompt tokens that missed the prefix cache (and the host KV tier) on a prefix it had held and "
               "evicted for room: what a larger pool or host tier would have served."),
    MetricSpec(KV_OFFLOAD_CPU_CACHE_USAGE, "gauge", "Host KV tier usage. 1 means 100 percent usage.",
               vllm=KV_OFFLOAD_CPU_CACHE_USAGE, ratio=True),
    MetricSpec(ENGINE_STALLS, "counter",
               "Times the step watchdog saw no engine step complete for longer than its bound while there was work."),
    MetricSpec(ENGINE_STALLED, "gauge", "1 while the engine is stalled (/health answers 503), else 0."),
    # Histograms.
    MetricSpec(TIME_TO_FIRST_TOKEN, "histogram", "Histogram of time to first token in seconds.",
               vllm=TIME_TO_FIRST_TOKEN),
    MetricSpec(INTER_TOKEN_LATENCY, "histogram", "Histogram of inter-token latency in seconds.",
               vllm=INTER_TOKEN_LATENCY, vllm_old=("time_per_output_token_seconds",)),
    MetricSpec(E2E_REQUEST_LATENCY, "histogram", "Histogram of end to end request latency in seconds.",
               vllm=E2E_REQUEST_LATENCY),
    MetricSpec(REQUEST_QUEUE_TIME, "histogram", "Histogram of time spent waiting before first scheduled.",
               vllm=REQUEST_QUEUE_TIME),
    MetricSpec(REQUEST_PROMPT_TOKENS, "histogram", "Number of prefill tokens per request.",
               vllm=REQUEST_PROMPT_TOKENS),
    MetricSpec(REQUEST_GENERATION_TOKENS, "histogram", "Number of generation tokens per request.",
               vllm=REQUEST_GENERATION_TOKENS),
    MetricSpec(ITERATION_TOKENS, "histogram", "Histogram of tokens per engine step.", vllm=ITERATION_TOKENS),
    MetricSpec(REQUEST_NUM_PREEMPTIONS, "histogram", "Number of times a finished request was preempted."),
    MetricSpec(ENGINE_STEP, "histogram", "Histogram of engine step duration in seconds."),
    # Structured outputs.
    MetricSpec(STRUCTURED_OUTPUT_ERRORS, "counter",
               "Requests ended with an error because their grammar matcher failed during generation."),
    MetricSpec(GRAMMAR_CACHE_ENTRIES, "gauge", "Compiled grammars in the API process's grammar cache."),
    MetricSpec(GRAMMAR_CACHE_BYTES, "gauge",
               "Estimated bytes of the compiled grammars in the API process's grammar cache."),
    MetricSpec(DP_ENGINE_REQUESTS_RUNNING, "gauge", "Requests running on one data-parallel engine core (-dp).",
               (ENGINE_LABEL,)),
    MetricSpec(DP_ENGINE_REQUESTS_WAITING, "gauge",
               "Requests waiting for one data-parallel engine core (-dp), sent but not yet taken in included.",
               (ENGINE_LABEL,)),
    MetricSpec(DP_ENGINE_KV_CACHE_USAGE_PERC, "gauge", "KV-cache usage of one data-parallel engine core (-dp).",
               (ENGINE_LABEL,), ratio=True),
)

SPECS: dict[str, MetricSpec] = {spec.name: spec for spec in METRICS}


def _foreign_names() -> dict[str, tuple[str, str]]:
    """Foreign name (no prefix, no counter `_total`) → (canonical name, naming)."""
    out: dict[str, tuple[str, str]] = {}
    for spec in METRICS:
        for foreign, naming in ([(spec.vllm, "vllm")] + [(n, "vllm-v0") for n in spec.vllm_old]
                                + [(spec.llamacpp, "llamacpp")]):
            if foreign is None or foreign == spec.name:
                continue
            if foreign in SPECS:
                raise AssertionError(f"{foreign} is canonical for another metric; it cannot alias {spec.name}")
            if foreign in out and out[foreign][0] != spec.name:
                raise AssertionError(f"{foreign} aliases both {out[foreign][0]} and {spec.name}")
            out[foreign] = (spec.name, naming)
    return out


# Older or other servers' names → canonical. A scrape that has both an old and the canonical name
# (vLLM versions in transition export both) keeps the canonical one.
ALIASES: dict[str, tuple[str, str]] = _foreign_names()


def spec(name: str) -> MetricSpec:
    """The spec of a canonical name; a KeyError naming it otherwise."""
    try:
        return SPECS[name]
    except KeyError:
        raise KeyError(f"{name!r} is not a pagedserve metric (see pagedserve.metric_names)") from None


def exposed(name: str) -> str:
    """'num_preemptions' → 'num_preemptions_total'; gauges and histograms unchanged."""
    return spec(name).exposed
