"""EngineConfig: every engine knob, named as vLLM names it, validated in one place.

Each bad value raises one ValueError that names the knob and the allowed range, before
anything is allocated.
"""
from __future__ import annotations

import dataclasses
import enum
import json
import logging
from dataclasses import dataclass, fields
from typing import Any

from pagedserve.cpu_isa import CpuFeatures, cpu_features
from pagedserve.utils import parse_bytes

logger = logging.getLogger("pagedserve.config")


class _KnobEnum(str, enum.Enum):
    """A knob's allowed values: compares, prints and serialises as its plain string."""

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


class PreemptionMode(_KnobEnum):
    """What happens to a victim when the pool runs dry. `auto` picks swap or recompute per
    victim, whichever its measured costs say is cheaper."""

    RECOMPUTE = "recompute"
    SWAP = "swap"
    AUTO = "auto"


class SchedulingPolicy(_KnobEnum):
    FCFS = "fcfs"
    PRIORITY = "priority"  # lower `priority` value runs sooner


EXECUTOR_BACKENDS = ("uni", "mp", "ray")  # uni: the model in the engine-core process (tp=1 only)
DTYPES = ("auto", "float32", "bfloat16", "float16")
# How the KV cache stores K and V (vLLM's --kv-cache-dtype): auto = the compute dtype; fp8 is
# fp8_e4m3; int8 adds one fp32 scale per token and KV head (see attention/kv_quant.py).
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2", "int8")
DEVICES = ("cpu", "cuda")
PREEMPTION_MODES = tuple(m.value for m in PreemptionMode)
SCHEDULING_POLICIES = tuple(p.value for p in SchedulingPolicy)
DEFAULT_CPU_KV_CACHE_MEMORY = 4 * 2**30  # vLLM's CPU backend reserves 4 GiB unless told otherwise
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048


def resolve_dtype(requested: str, checkpoint_dtype: str, device: str, features: CpuFeatures | None = None) -> str:
    """The dtype the engine computes in (weights and KV cache).

    'auto' takes the checkpoint's dtype on CUDA and float32 on CPU, on every CPU: the default
    then gives the same tokens as the fp32 reference whatever the machine's ISA (a bf16
    checkpoint computed in fp32 is exact; computed in bf16 it is not). 'bfloat16' on CPU runs
    bf16 where the CPU has AVX512-BF16 or AMX (`features`, probed at run time if not given) and
    float32 elsewhere, where bf16 GEMMs are emulated and slower than fp32; the fallback is logged.
    """
    if requested == "auto":
        if device == "cpu" or checkpoint_dtype not in ("float32", "bfloat16", "float16"):
            return "float32"
        return checkpoint_dtype
    if requested == "bfloat16" and device == "cpu":
        features = features or cpu_features()
        if not features.fast_bf16:
            logger.warning("dtype: bfloat16 requested, but this CPU (%s) has neither AVX512-BF16 nor AMX; "
                           "computing in float32", features.describe())
            return "float32"
    return requested


def resolve_kv_cache_dtype(kv_cache_dtype: str, compute_dtype: str) -> str:
    """The dtype the KV pool stores: the compute dtype for 'auto', 'fp8_e4m3' for vLLM's 'fp8'."""
    if kv_cache_dtype == "auto":
        return compute_dtype
    return "fp8_e4m3" if kv_cache_dtype == "fp8" else kv_cache_dtype


def _check(cond: bool, knob: str, message: str) -> None:
    if not cond:
        raise ValueError(f"{knob}: {message}")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


# -- --kv-events-config ---------------------------------------------------------------
@dataclass
class KVEventsConfig:
    """vLLM's KVEventsConfig fields and defaults, except the endpoint: loopback unless asked
    (vLLM binds tcp://*:5557, every interface)."""

    enable_kv_cache_events: bool = False
    publisher: str | None = None            # "zmq" | "null"; None: zmq when enabled, else null
    endpoint: str = "tcp://127.0.0.1:5557"  # PUB socket (bound)
    replay_endpoint: str | None = None      # ROUTER socket for replays (bound), None = no replay
    buffer_steps: int = 10_000              # batches kept for replay
    hwm: int = 100_000                      # ZMQ send high-water mark of the PUB socket
    max_queue_size: int = 100_000           # batches waiting for the publisher thread; beyond: dropped
    topic: str = ""

    def __post_init__(self) -> None:
        if self.publisher is None:
            self.publisher = "zmq" if self.enable_kv_cache_events else "null"
        _need(isinstance(self.enable_kv_cache_events, bool), "enable_kv_cache_events", "must be true or false")
        _need(self.publisher in ("zmq", "null"), "publisher", f"must be \"zmq\" or \"null\", got {self.publisher!r}")
        _need(isinstance(self.endpoint, str) and "://" in self.endpoint, "endpoint",
              f"must be a ZMQ address like tcp://127.0.0.1:5557, got {self.endpoint!r}")
        _need(self.replay_endpoint is None or (isinstance(self.replay_endpoint, str) and "://" in self.replay_endpoint),
              "replay_endpoint", f"must be a ZMQ address or null, got {self.replay_endpoint!r}")
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            value = getattr(self, name)
            _need(isinstance(value, int) and not isinstance(value, bool) and value >= 1, name,
                  f"must be an integer >= 1, got {value!r}")
        _need(isinstance(self.topic, str), "topic", f"must be a string, got {self.topic!r}")

    @property
    def publishes(self) -> bool:
        return self.enable_kv_cache_events and self.publisher != "null"

    @classmethod
    def parse(cls, value: "KVEventsConfig | dict | str | None") -> "KVEventsConfig | None":
        """From the flag's JSON text, a mapping (YAML config), or an instance; None stays None."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"kv_events_config: not valid JSON ({e})") from None
        if not isinstance(value, dict):
            raise ValueError(f"kv_events_config: must be a JSON object, got {type(value).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"kv_events_config: unknown field(s) {unknown}; known: {sorted(known)}")
        return cls(**value)


def _need(cond: Any, name: str, message: str) -> None:
    if not cond:
        raise ValueError(f"kv_events_config.{name}: {message}")


@dataclass
class EngineConfig:
    model: str | None = None  # None = the built-in default model
    tokenizer: str | None = None
    dtype: str = "auto"
    kv_cache_dtype: str = "auto"
    device: str = "cpu"
    seed: int = 0
    block_size: int = 16
    max_num_seqs: int = 128
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0
    kv_cache_memory: int | str | None = None
    num_kv_blocks: int | None = None
    gpu_memory_utilization: float = 0.9
    preemption_mode: PreemptionMode | str = PreemptionMode.AUTO
    swap_space: int | str = "4GiB"  # vLLM's default host swap space
    # vLLM's --kv-offloading-size: GiB of host memory (summed over ranks) for the host KV tier
    # that keeps prefix blocks the device pool evicts (core/kv_tier.py); None = no tier.
    kv_offloading_size: float | None = None
    kv_offloading_backend: str | None = None  # vLLM's --kv-offloading-backend: only "native" here
    # The disk tier below the host tier (core/kv_disk.py): a directory, and GiB over all ranks.
    kv_offloading_disk: str | None = None
    kv_offloading_disk_size: float | None = None
    enable_prefix_caching: bool = True
    scheduling_policy: SchedulingPolicy | str = SchedulingPolicy.FCFS
    max_logprobs: int = 20
    served_model_name: str | None = None
    step_trace_path: str | None = None
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1  # stages the decoder layers are split into (vLLM's -pp); ranks = tp x pp
    distributed_executor_backend: str | None = None  # None: mp when tp x pp > 1, else uni
    enable_expert_parallel: bool = False  # MoE: whole experts per TP rank instead of a slice of every expert
    # vLLM's -dp: engine cores in one server, each its own process, scheduler and KV pool
    # (engine/dp_client.py); with enable_expert_parallel on an MoE model, the experts are spread
    # over the dp cores (DP attention + EP). data_parallel_rank: which core this config is (set
    # by the DP client for each core's process; 0 otherwise).
    data_parallel_size: int = 1
    data_parallel_rank: int = 0
    data_parallel_master_port: int = 0  # DP + EP: the cores' gloo rendezvous on 127.0.0.1 (set by the DP client)
    structured_outputs_cache_bytes: int | str = "64MiB"  # compiled grammars kept (estimated), besides 256 entries
    # vLLM's --kv-events-config (JSON text, a mapping, or a core.kv_events.KVEventsConfig);
    # None = no KV events.
    kv_events_config: Any = None

    def __post_init__(self) -> None:
        self.validate()

    def __setattr__(self, name: str, value: Any) -> None:
        if self.__dict__.get("_read_only"):
            raise AttributeError(f"{name}: this is an engine's resolved config, read-only once resolved "
                                 f"(ResolvedConfig); set the knob on the EngineConfig you build an engine from")
        object.__setattr__(self, name, value)

    def resolved_copy(self, model_max_len: int) -> "EngineConfig":
        """A read-only copy with the model-dependent defaults filled in (`resolve`); this config
        is left as it was, so one config can build several engines."""
        copy = dataclasses.replace(self)
        copy.resolve(model_max_len)
        object.__setattr__(copy, "_read_only", True)
        return copy

    @classmethod
    def knob_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]

    def validate(self) -> None:
        _check(self.dtype in DTYPES, "dtype", f"must be one of {DTYPES}, got {self.dtype!r}")
        _check(self.kv_cache_dtype in KV_CACHE_DTYPES, "kv_cache_dtype",
               f"must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        _check(self.device in DEVICES, "device", f"must be one of {DEVICES}, got {self.device!r}")
        _check(_is_int(self.seed), "seed", f"must be an integer, got {self.seed!r}")
        _check(_is_int(self.block_size) and self.block_size in (1, 2, 4, 8, 16, 32, 64, 128, 256),
               "block_size", f"must be a power of two in [1, 256], got {self.block_size!r}")
        _check(_is_int(self.max_num_seqs) and 1 <= self.max_num_seqs <= 65536,
               "max_num_seqs", f"must be an integer in [1, 65536], got {self.max_num_seqs!r}")
        if self.max_num_batched_tokens is not None:
            _check(_is_int(self.max_num_batched_tokens) and self.max_num_batched_tokens >= 1,
                   "max_num_batched_tokens", f"must be an integer >= 1, got {self.max_num_batched_tokens!r}")
        if self.max_model_len is not None:
            _check(_is_int(self.max_model_len) and self.max_model_len >= 1,
                   "max_model_len", f"must be an integer >= 1, got {self.max_model_len!r}")
        _check(isinstance(self.enable_chunked_prefill, bool), "enable_chunked_prefill",
               f"must be true or false, got {self.enable_chunked_prefill!r}")
        _check(_is_int(self.long_prefill_token_threshold) and self.long_prefill_token_threshold >= 0,
               "long_prefill_token_threshold", f"must be an integer >= 0 (0 = off), got {self.long_prefill_token_threshold!r}")
        if self.kv_cache_memory is not None:
            try:
                self.kv_cache_memory = parse_bytes(self.kv_cache_memory)
            except ValueError as e:
                raise ValueError(f"kv_cache_memory: {e}") from None
            _check(self.kv_cache_memory > 0, "kv_cache_memory", f"must be > 0 bytes, got {self.kv_cache_memory}")
        if self.num_kv_blocks is not None:
            _check(_is_int(self.num_kv_blocks) and self.num_kv_blocks >= 1,
                   "num_kv_blocks", f"must be an integer >= 1, got {self.num_kv_blocks!r}")
        _check(isinstance(self.gpu_memory_utilization, (int, float)) and 0 < self.gpu_memory_utilization <= 1,
               "gpu_memory_utilization", f"must be in (0, 1], got {self.gpu_memory_utilization!r}")
        _check(self.preemption_mode in PREEMPTION_MODES, "preemption_mode",
               f"must be one of {PREEMPTION_MODES}, got {self.preemption_mode!r}")
        self.preemption_mode = PreemptionMode(self.preemption_mode)
        try:
            self.swap_space = parse_bytes(self.swap_space)
        except ValueError as e:
            raise ValueError(f"swap_space: {e}") from None
        _check(self.swap_space >= 0, "swap_space", f"must be >= 0 bytes, got {self.swap_space}")
        _check(isinstance(self.enable_prefix_caching, bool), "enable_prefix_caching",
               f"must be true or false, got {self.enable_prefix_caching!r}")
        if self.kv_offloading_size is not None:
            _check(isinstance(self.kv_offloading_size, (int, float)) and not isinstance(self.kv_offloading_size, bool)
                   and self.kv_offloading_size > 0, "kv_offloading_size",
                   f"must be a number of GiB > 0, got {self.kv_offloading_size!r}")
            _check(self.enable_prefix_caching, "kv_offloading_size",
                   "the host KV tier keeps prefix-cache blocks: it needs enable_prefix_caching")
        if self.kv_offloading_disk is not None or self.kv_offloading_disk_size is not None:
            _check(isinstance(self.kv_offloading_disk, str) and self.kv_offloading_disk != "", "kv_offloading_disk",
                   f"needs a directory for the disk KV tier (with kv_offloading_disk_size), got {self.kv_offloading_disk!r}")
            size = self.kv_offloading_disk_size
            _check(isinstance(size, (int, float)) and not isinstance(size, bool) and size > 0,
                   "kv_offloading_disk_size", f"must be a number of GiB > 0 (with kv_offloading_disk), got {size!r}")
            _check(self.kv_offloading_size is not None, "kv_offloading_disk",
                   "the disk tier sits below the host tier: it needs kv_offloading_size too")
            _check(self.tensor_parallel_size * self.pipeline_parallel_size == 1, "kv_offloading_disk",
                   "the disk tier runs with one rank only for now (tensor_parallel_size and "
                   "pipeline_parallel_size 1): only the driver rank reports its disk reads")
        if self.kv_offloading_backend is not None:
            _check(self.kv_offloading_backend == "native", "kv_offloading_backend",
                   f"only 'native' (the built-in host tier) is implemented, got {self.kv_offloading_backend!r}")
            _check(self.kv_offloading_size is not None, "kv_offloading_backend",
                   "needs kv_offloading_size (GiB of host memory for the tier)")
        _check(self.scheduling_policy in SCHEDULING_POLICIES, "scheduling_policy",
               f"must be one of {SCHEDULING_POLICIES}, got {self.scheduling_policy!r}")
        self.scheduling_policy = SchedulingPolicy(self.scheduling_policy)
        _check(_is_int(self.max_logprobs) and self.max_logprobs >= 0, "max_logprobs",
               f"must be an integer >= 0, got {self.max_logprobs!r}")
        try:
            self.structured_outputs_cache_bytes = parse_bytes(self.structured_outputs_cache_bytes)
        except ValueError as e:
            raise ValueError(f"structured_outputs_cache_bytes: {e}") from None
        _check(self.structured_outputs_cache_bytes >= 0, "structured_outputs_cache_bytes",
               f"must be >= 0 bytes (0 = keep none), got {self.structured_outputs_cache_bytes}")
        _check(_is_int(self.tensor_parallel_size) and self.tensor_parallel_size >= 1, "tensor_parallel_size",
               f"must be an integer >= 1, got {self.tensor_parallel_size!r}")
        self.kv_events_config = KVEventsConfig.parse(self.kv_events_config)
        _check(isinstance(self.enable_expert_parallel, bool), "enable_expert_parallel",
               f"must be true or false, got {self.enable_expert_parallel!r}")
        _check(_is_int(self.pipeline_parallel_size) and self.pipeline_parallel_size >= 1, "pipeline_parallel_size",
               f"must be an integer >= 1, got {self.pipeline_parallel_size!r}")
        world = self.tensor_parallel_size * self.pipeline_parallel_size
        _check(_is_int(self.data_parallel_size) and self.data_parallel_size >= 1, "data_parallel_size",
               f"must be an integer >= 1, got {self.data_parallel_size!r}")
        _check(_is_int(self.data_parallel_rank) and 0 <= self.data_parallel_rank < self.data_parallel_size,
               "data_parallel_rank", f"must be in [0, {self.data_parallel_size}), got {self.data_parallel_rank!r}")
        # Each DP core runs its model in its own process; ranks of its own (tp, pp) under it would
        # need process groups per core, and more CPU ranks than these machines run: refused, by name.
        _check(self.data_parallel_size == 1 or self.device == "cpu", "data_parallel_size",
               f"{self.data_parallel_size} on {self.device} is not implemented (each core would need a device of "
               f"its own); -dp runs on CPU, over gloo")
        _check(self.data_parallel_size == 1 or world == 1, "data_parallel_size",
               f"{self.data_parallel_size} with tensor_parallel_size={self.tensor_parallel_size} and "
               f"pipeline_parallel_size={self.pipeline_parallel_size} is not implemented (each data-parallel "
               f"core runs one rank); use -dp alone, or -tp / -pp without -dp")
        # A stage's TP collectives would need a process group of their own (today they use the
        # whole world's), and four CPU ranks are more than these tests run: refused, by name.
        _check(not (self.tensor_parallel_size > 1 and self.pipeline_parallel_size > 1), "pipeline_parallel_size",
               f"{self.pipeline_parallel_size} with tensor_parallel_size={self.tensor_parallel_size} is not "
               f"implemented (tensor parallelism within a pipeline stage); use one of them")
        if self.distributed_executor_backend is None:
            self.distributed_executor_backend = "mp" if world > 1 else "uni"
        _check(self.distributed_executor_backend in EXECUTOR_BACKENDS, "distributed_executor_backend",
               f"must be one of {EXECUTOR_BACKENDS}, got {self.distributed_executor_backend!r}")
        _check(not (self.distributed_executor_backend == "uni" and world > 1),
               "distributed_executor_backend", f"uni runs one rank in the engine process; "
               f"tensor_parallel_size={self.tensor_parallel_size} x pipeline_parallel_size="
               f"{self.pipeline_parallel_size} needs mp or ray")

    def resolve(self, model_max_len: int) -> None:
        """Fill the knobs whose defaults depend on the model, then check them together."""
        if self.max_model_len is None:
            self.max_model_len = model_max_len
        _check(self.max_model_len <= model_max_len, "max_model_len",
               f"{self.max_model_len} exceeds the model's max_position_embeddings ({model_max_len})")
        if self.max_num_batched_tokens is None:
            self.max_num_batched_tokens = (DEFAULT_MAX_NUM_BATCHED_TOKENS if self.enable_chunked_prefill
                                           else max(self.max_model_len, DEFAULT_MAX_NUM_BATCHED_TOKENS))
        if not self.enable_chunked_prefill:
            # Without chunking a prompt must fit one step whole, or it could never start.
            _check(self.max_num_batched_tokens >= self.max_model_len, "max_num_batched_tokens",
                   f"must be >= max_model_len ({self.max_model_len}) when chunked prefill is off, "
                   f"got {self.max_num_batched_tokens}")
        if self.kv_cache_memory is None and self.num_kv_blocks is None and self.device == "cpu":
            self.kv_cache_memory = DEFAULT_CPU_KV_CACHE_MEMORY


@dataclass(frozen=True)
class ResolvedConfig:
    """What the engine derives from its knobs and its model, worked out once, before anything
    is built (engine/resolve.py resolve_config), then handed down read-only: the front-end,
    the engine core, the executor and every rank read these and never derive them again.
    Plain data, so it crosses to the engine-core process and to the ranks as it is."""

    config: EngineConfig          # read-only; max_model_len, max_num_batched_tokens, ... filled in
    model_config: Any             # model/config.ModelConfig: the checkpoint's config, no weights
    dtype: str                    # what the model computes in (resolve_dtype)
    kv_cache_dtype: str           # what the KV pool stores (resolve_kv_cache_dtype)
    eos_token_ids: frozenset[int]  # generation_config, config.json and the tokenizer's, together

    @property
    def vocab_size(self) -> int:
        return self.model_config.vocab_size

    def with_knobs(self, **knobs: Any) -> "ResolvedConfig":
        """The same settings with a few per-process knobs changed, still read-only (a
        data-parallel core's rank, its group's port, its own step-trace file)."""
        config = dataclasses.replace(self.config, **knobs)
        object.__setattr__(config, "_read_only", True)
        return dataclasses.replace(self, config=config)
