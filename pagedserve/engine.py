"""Engine: add_request / step / abort, and LLM for offline generation.

One step, end to end:
    scheduler.schedule()            -> SchedulerOutput (plain data: who runs, how many tokens, which blocks)
    executor.execute(sched_out)     -> StepResult (sampled token per request that reached its end)
    scheduler.update_from_output()  -> advances counts, appends tokens, applies stop rules, frees blocks
    detokenize + stop strings       -> RequestOutputs for every request that moved
"""
from __future__ import annotations

import itertools
import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from pagedserve.config import EngineConfig
from pagedserve.core.scheduler import PreemptionCosts, Scheduler, SchedulerOutput, SchedulerStats
from pagedserve.detokenizer import IncrementalDetokenizer
from pagedserve.outputs import CompletionOutput, RequestMetrics, RequestOutput
from pagedserve.plan.kv_budget import (KVPoolSize, ModelShape, blocks_per_request, dtype_bytes,
                                       kv_cache_log_lines, size_kv_pool)
from pagedserve.request import Request, RequestStatus
from pagedserve.sampling import SamplingParams

logger = logging.getLogger("pagedserve.engine")


def default_model_dir() -> str:
    from pagedserve.default_model_path import DEFAULT_MODEL_DIR
    return str(DEFAULT_MODEL_DIR)


def size_pool(config: EngineConfig, shape: ModelShape, dtype: str) -> KVPoolSize:
    """How many blocks the pool gets: the very function `pagedserve plan` calls."""
    pool = size_kv_pool(shape, config.kv_cache_memory or 0, kv_dtype_bytes=dtype_bytes(dtype),
                        block_size=config.block_size)
    if config.num_kv_blocks is not None:  # an exact count (tests, reproductions) wins over bytes
        pool = KVPoolSize(config.num_kv_blocks, config.block_size, pool.bytes_per_token)
    need = blocks_per_request(config.max_model_len, config.block_size)
    if pool.num_blocks < need:
        raise ValueError(
            f"kv_cache_memory: the KV pool holds {pool.num_blocks} blocks ({pool.num_tokens} tokens, "
            f"{pool.num_bytes / 2**20:.1f} MiB at {pool.bytes_per_token} bytes per token), but one request of "
            f"max_model_len={config.max_model_len} tokens needs {need} blocks "
            f"({need * pool.bytes_per_block / 2**20:.1f} MiB); raise kv_cache_memory/num_kv_blocks "
            f"or lower max_model_len")
    return pool


class _Sample:
    """Engine-side state of one parallel sample: its scheduler request and detokenizer."""

    def __init__(self, index: int, request: Request, detok: IncrementalDetokenizer | None) -> None:
        self.index = index
        self.request = request
        self.detok = detok
        self.logprobs: list | None = [] if request.sampling_params.logprobs is not None else None
        self.cumulative_logprob = 0.0
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None


@dataclass
class _Group:
    """One user request: n samples sharing a prompt."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    samples: list[_Sample] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.samples)


class Engine:
    def __init__(self, config: EngineConfig, executor=None, tokenizer=None) -> None:
        from pagedserve.config import resolve_dtype
        from pagedserve.model.loader import read_model_config

        if config.model is None:
            config.model = default_model_dir()
        self.config = config
        self.model_config = read_model_config(config.model)
        config.resolve(self.model_config.max_model_len)
        self.dtype = resolve_dtype(config.dtype, self.model_config.checkpoint_dtype, config.device)
        self.tokenizer = tokenizer if tokenizer is not None else self._load_tokenizer()
        self.eos_token_ids = self._eos_token_ids()
        if executor is None:
            from pagedserve.worker.model_runner import ModelRunner
            executor = ModelRunner(self.model_config, self.dtype, config.device, config.block_size,
                                   self.eos_token_ids, config.seed)
        self.executor = executor
        if config.kv_cache_memory is None and config.num_kv_blocks is None:  # CUDA: measure, then subtract
            config.kv_cache_memory = executor.profile_gpu_kv_budget(
                config.gpu_memory_utilization, config.max_num_batched_tokens, config.max_num_seqs)
        shape = ModelShape.from_hf_config(self.model_config.hf_config)
        self.pool_sizing = size_pool(config, shape, self.dtype)
        for line in kv_cache_log_lines(self.pool_sizing, config.max_model_len, device=config.device.upper()):
            logger.info(line)
        logger.info("KV cache pool: %.3f GiB, %d bytes per token", self.pool_sizing.num_bytes / 2**30,
                    self.pool_sizing.bytes_per_token)
        num_host_blocks = 0
        if config.preemption_mode != "recompute":
            num_host_blocks = config.swap_space // self.pool_sizing.bytes_per_block
            logger.info("swap space: %d blocks (%.2f GiB host memory)", num_host_blocks,
                        num_host_blocks * self.pool_sizing.bytes_per_block / 2**30)
        if hasattr(executor, "allocate_kv_cache"):
            executor.allocate_kv_cache(self.pool_sizing.num_blocks, num_host_blocks)
        self.preemption_costs = None
        if config.preemption_mode == "auto" and num_host_blocks and hasattr(executor, "measure_host_bandwidth"):
            self.preemption_costs = PreemptionCosts(
                bytes_per_block=self.pool_sizing.bytes_per_block,
                host_bandwidth=executor.measure_host_bandwidth(),
                prefill_seconds_per_token=executor.profile_prefill(min(256, config.max_num_batched_tokens)))
            logger.info("auto preemption: host copy %.2f GB/s, prefill %.1f us/token",
                        self.preemption_costs.host_bandwidth / 1e9,
                        self.preemption_costs.prefill_seconds_per_token * 1e6)
        self.scheduler = Scheduler.from_config(config, self.pool_sizing.num_blocks, num_host_blocks=num_host_blocks,
                                               costs=self.preemption_costs)
        self.kv_cache_manager = self.scheduler.kv
        if self.model_config.rope.depends_on_prompt_len:
            # Dynamic NTK RoPE: a long prompt's K depends on its length, so prefix-cache keys must too.
            rope = self.model_config.rope
            self.kv_cache_manager.extra_keys_for = lambda req: rope.prefix_cache_key(req.num_prompt_tokens)
        self.block_pool = self.kv_cache_manager.pool
        self.groups: dict[str, _Group] = {}
        self._sample_to_group: dict[str, tuple[_Group, _Sample]] = {}
        self._ids = itertools.count()
        self.last_stats = SchedulerStats()
        self.last_step_result = None
        self.num_steps = 0
        self._trace = open(config.step_trace_path, "a") if config.step_trace_path else None

    @property
    def model_name(self) -> str:
        return self.config.served_model_name or self.model_config.name

    # -- set-up helpers -------------------------------------------------------------------
    def _load_tokenizer(self):
        from transformers import AutoTokenizer
        path = self.config.tokenizer or self.config.model
        try:
            return AutoTokenizer.from_pretrained(path)
        except Exception as e:  # a checkpoint without tokenizer files can still run token ids
            logger.warning("no tokenizer loaded from %s (%s); only token-id prompts will work", path, e)
            return None

    def _eos_token_ids(self) -> frozenset[int]:
        ids: set[int] = set()
        gen_cfg = Path(self.config.model) / "generation_config.json"
        if gen_cfg.is_file():
            eos = json.loads(gen_cfg.read_text()).get("eos_token_id")
            ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        eos = self.model_config.hf_config.get("eos_token_id")
        ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return frozenset(ids)

    # -- requests in -------------------------------------------------------------------
    def tokenize(self, prompt: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError("prompt: this model has no tokenizer; send token ids instead")
        return self.tokenizer(prompt).input_ids

    def validate_request(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        """Raise ValueError (with the numbers) for a request that cannot run; changes nothing."""
        n = len(prompt_token_ids)
        max_len = self.config.max_model_len
        if n == 0:
            raise ValueError("prompt: must contain at least one token")
        vocab = self.model_config.vocab_size
        if any((not isinstance(t, int)) or t < 0 or t >= vocab for t in prompt_token_ids):
            raise ValueError(f"prompt: token ids must be integers in [0, {vocab})")
        if n >= max_len:
            raise ValueError(f"prompt: this model's maximum context length is {max_len} tokens, "
                             f"but the prompt has {n} tokens (no room for any output)")
        if params.max_tokens is not None and n + params.max_tokens > max_len:
            raise ValueError(f"max_tokens: this model's maximum context length is {max_len} tokens; "
                             f"you requested {n + params.max_tokens} tokens ({n} in the prompt, "
                             f"{params.max_tokens} for the completion)")
        if params.logprobs is not None and params.logprobs > self.config.max_logprobs:
            raise ValueError(f"logprobs: at most {self.config.max_logprobs}, got {params.logprobs}")
        if any(t >= vocab for t in params.stop_token_ids):
            raise ValueError(f"stop_token_ids: token ids must be below the vocabulary size {vocab}")
        if params.seed is not None and not -2**63 <= params.seed < 2**63:
            raise ValueError(f"seed: must fit a signed 64-bit integer, got {params.seed}")
        if params.stop and self.tokenizer is None:
            raise ValueError("stop: stop strings need a tokenizer; use stop_token_ids")

    def add_request(self, request_id: str | None, prompt: str | Sequence[int], params: SamplingParams | None = None,
                    arrival_time: float | None = None, priority: int = 0,
                    prompt_token_ids: Sequence[int] | None = None) -> str:
        """Queue a request. A text prompt is tokenized unless its `prompt_token_ids` are given."""
        params = params or SamplingParams()
        request_id = str(next(self._ids)) if request_id is None else request_id
        if request_id in self.groups:
            raise ValueError(f"request_id: {request_id!r} is already in use")
        text = prompt if isinstance(prompt, str) else None
        if prompt_token_ids is not None:
            token_ids = list(prompt_token_ids)
        else:
            token_ids = self.tokenize(prompt) if isinstance(prompt, str) else list(prompt)
        self.validate_request(token_ids, params)
        group = _Group(request_id, text, token_ids)
        for i in range(params.n):
            child_params = params if params.n == 1 else params.child(i)
            child_id = request_id if params.n == 1 else f"{request_id}#{i}"
            req = Request(child_id, token_ids, child_params, self.eos_token_ids, arrival_time, priority,
                          self.config.max_model_len)
            detok = None
            if self.tokenizer is not None:
                detok = IncrementalDetokenizer(self.tokenizer, token_ids, child_params.stop,
                                               child_params.include_stop_str_in_output,
                                               child_params.skip_special_tokens)
            sample = _Sample(i, req, detok)
            group.samples.append(sample)
            self._sample_to_group[child_id] = (group, sample)
        for sample in group.samples:
            self.scheduler.add_request(sample.request)
        self.groups[request_id] = group
        return request_id

    def abort(self, request_id: str) -> bool:
        """End a request now; its blocks return to the pool immediately."""
        group = self.groups.pop(request_id, None)
        if group is None:
            return False
        for s in group.samples:
            self.scheduler.finish_request(s.request.request_id, RequestStatus.FINISHED_ABORTED)
            self._sample_to_group.pop(s.request.request_id, None)
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self.groups)

    @property
    def num_unfinished_requests(self) -> int:
        return len(self.groups)

    # -- the step ------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        step_start = time.perf_counter()
        sched_out = self.scheduler.schedule()
        result = self.executor.execute(sched_out)
        updated, finished = self.scheduler.update_from_output(sched_out, result.sampled)
        self.last_stats = sched_out.stats
        self.last_step_result = result
        if self.preemption_costs is not None and sched_out.num_batched_tokens >= 64:
            # Keep the recompute estimate current: prefill-heavy steps tell us the per-token cost.
            per_token = result.forward_time / sched_out.num_batched_tokens
            c = self.preemption_costs
            c.prefill_seconds_per_token = 0.8 * c.prefill_seconds_per_token + 0.2 * per_token
        self.num_steps += 1

        touched: dict[str, _Group] = {}
        for req in updated:
            group, sample = self._sample_to_group[req.request_id]
            touched[group.request_id] = group
            token = req.output_token_ids[-1]
            lp = result.logprobs.get(req.request_id)
            if sample.logprobs is not None and lp is not None:
                sample.logprobs.append(lp)
                sample.cumulative_logprob += lp.logprob
            if sample.detok is not None:
                hit = sample.detok.add_token(token)
                if hit is not None and not req.is_finished:
                    self.scheduler.finish_request(req.request_id, RequestStatus.FINISHED_STOPPED, hit)
                elif hit is not None:
                    req.status, req.stop_reason = RequestStatus.FINISHED_STOPPED, hit
            if req.is_finished:
                sample.finish_reason = req.status.value
                sample.stop_reason = req.stop_reason
        outputs = []
        for group in touched.values():
            outputs.append(self._make_output(group))
            if group.finished:
                self.groups.pop(group.request_id, None)
                for s in group.samples:
                    self._sample_to_group.pop(s.request.request_id, None)
        if self._trace is not None:
            self._write_trace(sched_out, result, time.perf_counter() - step_start)
        return outputs

    def _make_output(self, group: _Group) -> RequestOutput:
        comps, metrics = [], []
        for s in group.samples:
            req = s.request
            done = s.finish_reason is not None
            text = s.detok.visible_text(done) if s.detok is not None else ""
            comps.append(CompletionOutput(
                index=s.index, text=text, token_ids=list(req.output_token_ids),
                cumulative_logprob=s.cumulative_logprob if s.logprobs is not None else None,
                logprobs=list(s.logprobs) if s.logprobs is not None else None,
                finish_reason=s.finish_reason, stop_reason=s.stop_reason))
            t = req.times
            metrics.append(RequestMetrics(t.arrival, t.first_scheduled, t.first_token, t.last_token, t.finished,
                                          req.num_preemptions, req.num_cached_tokens))
        return RequestOutput(group.request_id, group.prompt, group.prompt_token_ids, comps, group.finished, metrics)

    def _write_trace(self, out: SchedulerOutput, result, step_time: float) -> None:
        record = {
            "num_tokens": out.num_batched_tokens,
            "num_reqs": len(out.scheduled),
            "num_decodes": sum(1 for r in out.scheduled if r.num_new_tokens == 1),
            "context_lens": [r.context_len for r in out.scheduled],
            "new_tokens": [r.num_new_tokens for r in out.scheduled],
            "duration": result.duration,    # execute() only
            "step_time": step_time,         # the whole step: schedule, execute, update, detokenize
        }
        self._trace.write(json.dumps(record) + "\n")
        self._trace.flush()


PromptInput = str | Sequence[int] | dict


class LLM:
    """Offline generation, vLLM-style: LLM(model=...).generate(prompts, SamplingParams(...))."""

    def __init__(self, model: str | None = None, **engine_args) -> None:
        unknown = set(engine_args) - set(EngineConfig.knob_names())
        if unknown:
            raise ValueError(f"unknown engine argument(s): {sorted(unknown)}")
        self.engine = Engine(EngineConfig(model=model, **engine_args))

    @classmethod
    def from_config(cls, config: EngineConfig) -> "LLM":
        llm = cls.__new__(cls)
        llm.engine = Engine(config)
        return llm

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: PromptInput | Sequence[PromptInput],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, priority: Sequence[int] | None = None) -> list[RequestOutput]:
        prompt_list = self._as_prompt_list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params or SamplingParams()] * len(prompt_list)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompt_list):
                raise ValueError(f"sampling_params: got {len(params_list)} for {len(prompt_list)} prompts")
        # Validate everything before queueing anything: bad input changes nothing.
        engine = self.engine
        token_lists = [engine.tokenize(p) if isinstance(p, str) else list(p) for p in prompt_list]
        for toks, params in zip(token_lists, params_list):
            engine.validate_request(toks, params)
        ids = []
        for i, (p, toks, params) in enumerate(zip(prompt_list, token_lists, params_list)):
            rid = f"gen-{next(engine._ids)}"
            engine.add_request(rid, p, params, priority=priority[i] if priority else 0, prompt_token_ids=toks)
            ids.append(rid)
        return self._run(ids, use_tqdm)

    @staticmethod
    def _as_prompt_list(prompts) -> list:
        if isinstance(prompts, str) or isinstance(prompts, dict):
            prompts = [prompts]
        elif prompts and isinstance(prompts[0], int):
            prompts = [prompts]
        out = []
        for p in prompts:
            if isinstance(p, dict):
                p = p.get("prompt_token_ids", p.get("prompt"))
            out.append(p)
        return out

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        from tqdm import tqdm

        engine = self.engine
        done: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="Processed prompts", disable=not use_tqdm, dynamic_ncols=True)
        start = time.perf_counter()
        out_tokens = 0
        try:
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        done[out.request_id] = out
                        out_tokens += sum(len(c.token_ids) for c in out.outputs)
                        bar.update(1)
                        bar.set_postfix_str(f"output {out_tokens / (time.perf_counter() - start):.1f} tok/s")
        finally:
            bar.close()
        return [done[i] for i in ids]
