"""Engine: the synchronous front-end around one EngineCore (add_request / step / abort).

One step, end to end:
    engine_core.step()                  schedule -> execute -> update: per-request token deltas + stats
    output_processor.process_outputs()  detokenize, stop strings, parallel-sample groups -> RequestOutputs
    engine_core.finish_requests()       the samples a stop string ended give their blocks back now

The core knows nothing of text; this front-end knows nothing of blocks. AsyncLLM (the
server's front-end) drives the same parts from an event loop, with the core in a thread
(built from an Engine) or in its own process (built from an EngineFrontend, which holds
everything but the core: engine/core_client.py).
"""
from __future__ import annotations

import itertools
import logging
from typing import Sequence

from pagedserve.config import EngineConfig, ResolvedConfig
from pagedserve.core.engine_core import EngineCore, size_pool
from pagedserve.core.request import RequestStatus
from pagedserve.engine.input_processor import InputProcessor
from pagedserve.engine.kv_events import make_kv_events_hook
from pagedserve.engine.output_processor import OutputKind, OutputProcessor, make_core_requests
from pagedserve.engine.resolve import default_model_dir, resolve_config
from pagedserve.outputs import RequestOutput
from pagedserve.plan.kv_budget import ModelShape, kv_cache_log_lines, kv_replication_warning
from pagedserve.sampling import SamplingParams
from pagedserve.tokenizer import grammar_compiler_for
from pagedserve.worker.executors import make_executor

logger = logging.getLogger("pagedserve.engine")

__all__ = ["Engine", "EngineFrontend", "build_engine_core", "default_model_dir"]


class EngineFrontend:
    """What a front-end holds: the resolved config (engine/resolve.py; `config` is its
    read-only knobs), the model's config (no weights), the tokenizer, and the input and
    output processors. The API process of a split server holds only this; the engine core
    lives in another process (engine/core_client.py), built from the same `settings`."""

    def __init__(self, config: EngineConfig, tokenizer=None) -> None:
        self.settings, self.tokenizer = resolve_config(config, tokenizer)
        self.config = self.settings.config
        self.model_config = self.settings.model_config
        self.grammar_compiler = grammar_compiler_for(self.settings, self.tokenizer)
        self.input_processor = InputProcessor(self.config, self.model_config.vocab_size, self.tokenizer,
                                              self.grammar_compiler)
        self.output_processor = OutputProcessor(self.tokenizer)
        self._ids = itertools.count()

    @property
    def model_name(self) -> str:
        return self.config.served_model_name or self.model_config.name

    @property
    def dtype(self) -> str:
        return self.settings.dtype

    @property
    def kv_cache_dtype(self) -> str:
        return self.settings.kv_cache_dtype

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self.settings.eos_token_ids

    def tokenize(self, prompt: str) -> list[int]:
        return self.input_processor.tokenize(prompt)

    def next_request_id(self) -> str:
        return str(next(self._ids))


def disk_tier_fingerprint(settings: ResolvedConfig) -> dict:
    """What a disk KV tier's files must have been written by to be served (core/kv_disk.py):
    the model's path and a hash of its config, the compute and KV dtypes (the engine core adds
    the block size, bytes per block and the tp/pp shape)."""
    import hashlib
    import json
    mc = settings.model_config
    config_hash = hashlib.sha256(json.dumps(mc.hf_config, sort_keys=True, default=str).encode()).hexdigest()
    return {"model": str(getattr(mc, "path", settings.config.model)), "model_config_sha256": config_hash,
            "dtype": settings.dtype, "kv_cache_dtype": settings.kv_cache_dtype}


def build_engine_core(settings: ResolvedConfig, executor=None, grammar_compiler=None,
                      load_grammar_compiler: bool = False) -> EngineCore:
    """The executor the settings ask for (unless given), the pool sized as `plan` sizes it (per
    rank), and the core: what Engine builds in process and the engine-core process builds
    for a split server. `grammar_compiler`: structured outputs in an in-process executor
    (the front-end's); `load_grammar_compiler`: the runner builds its own (the engine-core
    process; tensor-parallel ranks always do)."""
    config, model_config = settings.config, settings.model_config
    if executor is None:
        executor = make_executor(settings, grammar_compiler, load_grammar_compiler)
    elif getattr(executor, "grammar_compiler", False) is None:
        executor.grammar_compiler = grammar_compiler
    try:
        kv_cache_memory = config.kv_cache_memory
        if kv_cache_memory is None and config.num_kv_blocks is None:  # CUDA: measure, then subtract
            kv_cache_memory = executor.profile_kv_budget(
                config.gpu_memory_utilization, config.max_num_batched_tokens, config.max_num_seqs)
        shape = ModelShape.from_hf_config(model_config.hf_config)
        kv_dtype = settings.kv_cache_dtype
        pool = size_pool(config, shape, kv_dtype, kv_cache_memory)
        tp = config.tensor_parallel_size
        if (replicated := kv_replication_warning(shape, tp)) is not None:
            logger.warning(replicated)
        for line in kv_cache_log_lines(pool, config.max_model_len, device=config.device.upper(), kv_dtype=kv_dtype):
            logger.info(line)
        pp = config.pipeline_parallel_size
        where = (f" on each of {tp} ranks" if tp > 1 else "") + (
            f" (the largest of {pp} pipeline stages; each holds only its layers)" if pp > 1 else "")
        logger.info("KV cache pool: %.3f GiB%s, %d bytes per token", pool.num_bytes / 2**30, where,
                    pool.bytes_per_token)
        prefix_extra_keys = None
        if model_config.rope.depends_on_prompt_len:
            # Dynamic NTK RoPE: a long prompt's K depends on its length, so prefix-cache keys must too.
            rope = model_config.rope
            prefix_extra_keys = lambda req: rope.prefix_cache_key(req.num_prompt_tokens)  # noqa: E731
        core = EngineCore.build(config, executor, pool, prefix_extra_keys=prefix_extra_keys,
                                disk_fingerprint=disk_tier_fingerprint(settings) if config.kv_offloading_disk else None)
        if (kv_events := make_kv_events_hook(config)) is not None:  # binds its sockets now: a bad one fails the start
            core.record_kv_events()
            core.observers.append(kv_events)
        return core
    except BaseException:
        executor.shutdown()
        raise


class Engine(EngineFrontend):
    """The front-end with its engine core in process (LLM.generate, the in-thread server)."""

    def __init__(self, config: EngineConfig, executor=None, tokenizer=None) -> None:
        if config.data_parallel_size > 1:
            raise ValueError(f"data_parallel_size: {config.data_parallel_size} engine cores run in `pagedserve serve` "
                             f"(each in its own process, engine/dp_client.py); LLM and Engine drive one core")
        super().__init__(config, tokenizer)
        self.engine_core = build_engine_core(self.settings, executor, self.grammar_compiler)
        self.pool_sizing = self.engine_core.pool

    # -- looking inside (tests, benchmarks; the step never goes through these) -------------
    @property
    def executor(self):
        return self.engine_core.executor

    @property
    def scheduler(self):
        return self.engine_core.scheduler

    @property
    def kv_cache_manager(self):
        return self.engine_core.scheduler.kv

    @property
    def block_pool(self):
        return self.engine_core.scheduler.kv.pool

    def shutdown(self) -> None:
        """Stop the executor (its worker processes, under tensor parallelism)."""
        self.engine_core.shutdown()

    # -- requests in -------------------------------------------------------------------
    def add_request(self, request_id: str | None, prompt: str | Sequence[int], params: SamplingParams | None = None,
                    arrival_time: float | None = None, priority: int = 0,
                    prompt_token_ids: Sequence[int] | None = None,
                    output_kind: OutputKind = OutputKind.FINAL_ONLY) -> str:
        """Queue a request. A text prompt is tokenized unless its `prompt_token_ids` are given."""
        params = params or SamplingParams()
        request_id = self.next_request_id() if request_id is None else request_id
        text = prompt if isinstance(prompt, str) else None
        if prompt_token_ids is not None:
            token_ids = list(prompt_token_ids)
        else:
            token_ids = self.input_processor.tokenize(prompt) if isinstance(prompt, str) else list(prompt)
        self.input_processor.validate(token_ids, params)
        core_requests = make_core_requests(request_id, token_ids, params, self.eos_token_ids, arrival_time,
                                           priority, self.config.max_model_len)
        self.output_processor.add_request(request_id, text, token_ids, core_requests, output_kind)
        for req in core_requests:
            self.engine_core.add_request(req)
        return request_id

    def abort(self, request_id: str) -> bool:
        """End a request now; its blocks return to the pool immediately."""
        if request_id not in self.output_processor.requests:
            return False
        self.engine_core.finish_requests(self.output_processor.abort_request(request_id))
        return True

    def has_unfinished_requests(self) -> bool:
        return len(self.output_processor) > 0

    def reset_prefix_cache(self) -> bool:
        """Forget the prefix cache (refused while a request holds blocks); its KV event, if
        KV events are on, is published now rather than at the next step."""
        done = self.engine_core.reset_prefix_cache()
        if done:
            self.engine_core.observe(self.engine_core.snapshot())
        return done

    # -- the step ------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        processed = self.output_processor.process_outputs(self.engine_core.observe(self.engine_core.step()))
        for core_id, stop in processed.stopped:
            self.engine_core.finish_requests([core_id], RequestStatus.FINISHED_STOPPED, stop)
        return processed.request_outputs
