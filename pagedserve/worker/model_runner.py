"""ModelRunner: the real executor (core.executor.Executor). execute(SchedulerOutput) -> StepResult.

It owns the model, the device KV pool ([layers, 2, num_blocks * block_size, kv_heads,
head_dim]; with a quantized kv_cache_dtype an attention.kv_quant.QuantizedKVCache holding that
tensor in one byte per value, and per-token scales for int8), the sampler, and what it has been told about each request (CachedRequestState):
the scheduler sends a request's prompt and parameters once, then per-step diffs (new
tokens, new blocks). It never calls back into the scheduler.

Two per-request extras ride on that state:
- structured outputs: a grammar matcher, synced to the output tokens fed so far before
  each sample (so a recompute that re-feeds them leaves it where it was) and advanced by
  each sampled token;
- prompt logprobs: each prefill chunk's prompt rows are scored as the chunk runs (row p
  predicts prompt token p + 1); a counter keeps tokens already scored from being scored
  again when a preempted request recomputes its prompt.

Under tensor parallelism one ModelRunner runs in each rank's process (worker/worker.py),
holding its shard of the weights and a pool of its KV heads only, with the same number of
blocks and the same block tables as every other rank: each rank applies the same
SchedulerOutput, runs the same forward (the collectives keep them in step), and copies its
own blocks on swap. Only rank 0 samples; the others return an empty StepResult.

Under pipeline parallelism (model/pipeline.py) a runner holds one stage: its layers, and a
pool of those layers only (the same blocks and block tables as every other stage: the
scheduler sees one pool). Every stage applies the same SchedulerOutput; a stage after the
first receives the previous stage's hidden states and residual instead of embedding the
tokens, a stage before the last sends its own on instead of sampling. Only the last
stage's TP rank 0 samples.
"""
from __future__ import annotations

import ctypes
import itertools
import logging
import math
import mmap
import os
import sys
import time
from dataclasses import dataclass

import numpy as np
import torch

from pagedserve.attention import backend_for_cache, build_metadata
from pagedserve.attention.kv_quant import QuantizedKVCache, kv_format
from pagedserve.config import ResolvedConfig
from pagedserve.core.outputs import StepResult, TokenLogprobs
from pagedserve.core.scheduler import NewRequestData, ScheduledRequest, SchedulerOutput
from pagedserve.sampling import SamplingParams
from pagedserve.model.config import TPShard
from pagedserve.model.loader import TORCH_DTYPES, ModelConfig, load_model
from pagedserve.model.pipeline import (PipelineStage, micro_batch_bounds, recv_intermediate,
                                       send_intermediate, stage_config, wait_sends)
from pagedserve.structured.compiler import GrammarCompiler, GrammarMatcher
from pagedserve.tokenizer import LazyGrammarCompiler, grammar_compiler_for, load_tokenizer
from pagedserve.worker.sampler import Sampler

logger = logging.getLogger("pagedserve.worker")

# Prompt rows scored per logits matmul: bounds the [rows, vocab] float32 scratch.
LOAD_GRAMMAR_COMPILER = "load"  # ModelRunner.for_rank: the sampling rank builds its own compiler
PROMPT_LOGPROBS_ROWS_PER_PASS = 512


def keep_freed_memory_in_process() -> None:
    """Stop glibc from returning large freed buffers to the OS (and mapping them afresh).

    By default every allocation over 128 KiB is its own mmap, so each layer's activations and
    K/V gathers come back as fresh pages and pay a page fault per 4 KiB on first touch: on
    this CPU a 100 MB block gather ran at 2.7 GB/s that way and at 17 GB/s with the memory
    kept (what tcmalloc/jemalloc do, and what PyTorch's CPU tuning guides recommend).
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc: nothing to tune
        return
    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
    libc.mallopt(M_MMAP_THRESHOLD, 1 << 30)
    libc.mallopt(M_TRIM_THRESHOLD, (1 << 31) - 1)


# Linux's MAP_NORESERVE (not every Python's mmap module names it). Without it, pools mapped side by
# side merge into one accounted mapping, and a fork() checks that mapping alone against RAM + swap:
# three 10 GiB pools on a 24 GiB machine made os.fork() fail with ENOMEM (numpy's calloc'd pools
# never merged). Pages still come as they are written; under strict overcommit (mode 2) the kernel
# ignores the flag and charges the pool up front, as before.
MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000 if sys.platform.startswith("linux") else 0)


def allocate_zeroed(shape: tuple, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero-filled pool. Zeros matter: padded attention reads may touch never-written
    slots, and garbage NaNs there would poison the masked sums. On CPU it is an anonymous
    mmap with no advice: zero pages the kernel maps lazily, so a 4 GiB pool costs nothing until
    its blocks are written (torch.zeros touched every page up front: 12 s for 4 GiB on a 2-core
    EPYC). Not numpy's calloc: numpy advises MADV_HUGEPAGE on big arrays, and where the kernel's
    THP defrag is `madvise` (a common default) each first write of a 2 MiB page then stalls for
    compaction; a 32 x 128-token prefill of the 19M Llama into a fresh 4 GiB pool took 110 ms
    that way, 75 ms here, 70 ms in a pool small enough to stay warm (benchmarks/README.md)."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | MAP_NORESERVE)
    return torch.frombuffer(buf, dtype=torch.uint8).view(dtype).view(shape)  # the tensor keeps buf alive


@dataclass
class CachedRequestState:
    """What the runner keeps about one request between steps."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    token_ids: list[int]        # every token whose position the runner has seen: prompt, then fed outputs
    block_ids: list[int]
    grammar: GrammarMatcher | None = None  # structured outputs: consumed = the outputs fed so far
    num_prompt_logprobs_done: int = 1      # prompt tokens [1, this) are scored (token 0 has none)
    context_len: int = 0                   # tokens fed up to the end of this step
    plain_greedy: bool = False             # its token is its row's argmax (SamplingParams.plain_greedy)

    @classmethod
    def new(cls, data: NewRequestData, grammar_compiler: GrammarCompiler | None = None,
            samples: bool = True) -> "CachedRequestState":
        """`samples`: False on tensor-parallel ranks other than 0, which never sample and so
        keep no grammar matcher."""
        state = cls(data.request_id, data.prompt_token_ids, data.sampling_params, list(data.prompt_token_ids), [],
                    plain_greedy=data.sampling_params.plain_greedy)
        spec = data.sampling_params.structured_outputs
        if spec is not None and samples:
            if grammar_compiler is None:
                raise ValueError("structured_outputs: this executor has no grammar compiler")
            state.grammar = grammar_compiler.new_matcher(spec)
        return state

    def apply(self, sr: ScheduledRequest) -> None:
        self.token_ids[sr.start_pos:sr.context_len] = sr.token_ids
        self.context_len = sr.context_len
        if sr.resumed:
            self.block_ids = list(sr.new_block_ids)
        elif sr.new_block_ids:
            self.block_ids.extend(sr.new_block_ids)

    @property
    def output_token_ids(self) -> list[int]:
        """Output tokens fed so far: all of them when this step samples. A copy: only
        penalties need it."""
        return self.token_ids[len(self.prompt_token_ids):]


@dataclass
class StepInputs:
    """One step's model inputs, rows in the attention backend's order (decodes first)."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: object                    # the attention backend's metadata
    prompt_lens: torch.Tensor | None
    states: list[CachedRequestState]      # per scheduled request, in row order
    scheduled: list[ScheduledRequest]     # the same order
    last_rows: torch.Tensor | None        # row of each sampling request's last token; None: every row, in order
    sampling: list[CachedRequestState]    # the requests that sample this step, in that order


class ModelRunner:
    def __init__(self, model_config: ModelConfig, dtype: str, device: str, block_size: int,
                 eos_token_ids: frozenset[int], seed: int, grammar_compiler: GrammarCompiler | None = None,
                 shard: TPShard | None = None, kv_cache_dtype: str | None = None,
                 stage: PipelineStage | None = None, max_model_len: int | None = None) -> None:
        self.model_config = model_config
        self.shard = shard or TPShard.of(model_config)
        self.stage = stage or PipelineStage.of(model_config.num_layers)
        self.stage_config = stage_config(model_config, self.stage)  # its layers: the pool's shape
        self.num_micro_batches = 0  # pipelined steps' micro-batches (benchmarks read it)
        self.num_forwards = 0       # model forwards run (the DP + EP lockstep counts them)
        self.dp_lockstep = None     # worker/dp_lockstep.py, under DP attention + EP
        # the one rank that samples (and so keeps grammar matchers): the last stage's TP rank 0
        self.samples = self.stage.is_last and self.shard.rank == 0
        self.device = torch.device(device)
        self.dtype = TORCH_DTYPES[dtype]
        self.kv_format = kv_format(kv_cache_dtype)  # None: the pool is in the compute dtype
        self.quantized_cache = self.kv_format is not None
        # Which attention backend reads this pool, decided (and a bad combination refused) at start-up.
        backend_for_cache(self.device.type, self.quantized_cache)
        self.block_size = block_size
        if self.device.type == "cpu":
            keep_freed_memory_in_process()
        torch.manual_seed(seed)
        self.model = load_model(model_config, dtype, device, self.shard, self.stage, max_model_len)
        # MLA models read their latent pool through their own attention path and metadata
        self.build_metadata = getattr(self.model, "build_metadata", build_metadata)
        if self.quantized_cache and self.build_metadata is not build_metadata:  # refused at start-up, by name
            raise ValueError(f"kv_cache_dtype: {kv_cache_dtype} is not implemented for the MLA latent cache of "
                             f"{model_config.architecture}; use kv_cache_dtype=auto")
        self.sampler = Sampler(eos_token_ids, seed, self.device)
        self.num_blocks = 0
        self.kv_cache = self.host_cache = None
        self.requests: dict[str, CachedRequestState] = {}
        self.grammar_compiler = grammar_compiler

    @classmethod
    def for_rank(cls, settings: ResolvedConfig, device: str, rank: int = 0,
                 grammar_compiler: GrammarCompiler | None | str = LOAD_GRAMMAR_COMPILER) -> "ModelRunner":
        """The one way the engine makes a runner: rank `rank` (pp_rank * tp + tp_rank) of the
        layout `settings` name, its shard of its stage's layers in the resolved dtypes (each
        pool its share of the KV heads at the KV dtype's bytes). Only the sampling rank needs
        structured outputs' masks: `grammar_compiler` is its compiler (the in-process
        front-end's, sharing its cache), or LOAD_GRAMMAR_COMPILER to build its own."""
        config, model_config = settings.config, settings.model_config
        tp = config.tensor_parallel_size
        dp_experts = config.data_parallel_size > 1 and config.enable_expert_parallel and model_config.moe is not None
        dp = (config.data_parallel_size, config.data_parallel_rank) if dp_experts else (1, 0)  # DP attention + EP
        shard = TPShard.of(model_config, tp, rank % tp, config.enable_expert_parallel, *dp)
        stage = PipelineStage.of(model_config.num_layers, config.pipeline_parallel_size, rank // tp)
        if grammar_compiler == LOAD_GRAMMAR_COMPILER:
            samples = stage.is_last and shard.rank == 0
            grammar_compiler = (LazyGrammarCompiler(lambda: grammar_compiler_for(settings, load_tokenizer(config)))
                                if samples else None)
        return cls(model_config, settings.dtype, device, config.block_size, settings.eos_token_ids, config.seed,
                   grammar_compiler=grammar_compiler, shard=shard, kv_cache_dtype=settings.kv_cache_dtype,
                   stage=stage, max_model_len=config.max_model_len)

    def initialize_cache(self, num_blocks: int, num_host_blocks: int = 0) -> None:
        """The device pool, and swap space in the same layout in host memory (pinned on
        CUDA so block copies can be asynchronous)."""
        cfg = self.stage_config
        self.num_blocks = num_blocks
        shape = cfg.kv_cache_shape(num_blocks * self.block_size, self.shard.num_kv_heads)
        self.kv_cache = self._allocate_pool(shape, self.device)
        host_shape = shape[:2] + (num_host_blocks * self.block_size,) + shape[3:]
        self.host_cache = self._allocate_pool(host_shape, torch.device("cpu")) if num_host_blocks else None
        if self.host_cache is not None and self.device.type == "cuda":
            self.host_cache = self.host_cache.pin_memory()

    def open_disk_tier(self, path: str, num_slots: int) -> None:
        """This rank's file of the disk KV tier (core/kv_disk.py): slots of its shard of a block."""
        from pagedserve.core.kv_disk import rank_file_name
        from pagedserve.worker.disk_store import DiskStore
        parts = [self._blocks(t)[:, :, 0].numel() * t.element_size() for t in self._pool_tensors(self.host_cache)]
        self.disk_store = DiskStore(os.path.join(path, rank_file_name(self.shard.rank, self.stage.pp_rank)),
                                    num_slots, parts)

    def sync_disk_tier(self) -> None:
        """Make every disk-tier write so far durable (the engine's shutdown, before its last records)."""
        if getattr(self, "disk_store", None) is not None:
            os.fsync(self.disk_store.fd)

    def _disk_copies(self, out: SchedulerOutput, reads: bool, result: StepResult) -> None:
        """The disk tier's copies: writes (host -> disk) before every other copy, reads
        (disk -> host) after the swap-outs. An error ends the disk tier's work this step."""
        from pagedserve.worker.disk_store import block_payload, load_payload
        store = getattr(self, "disk_store", None)
        if store is None or result.disk_error:
            if store is None and (out.disk_writes or out.disk_reads):
                result.disk_error = "this rank has no disk tier"
            return
        host = [self._blocks(t) for t in self._pool_tensors(self.host_cache)]
        try:
            if not reads:
                store.write([(slot, key, block_payload(host, hb)) for hb, slot, key in out.disk_writes],
                            sync=out.disk_sync)
                return
            for slot, hb, key in out.disk_reads:
                payload = store.read(slot, key)
                if payload is None:
                    result.disk_failed_reads.append(slot)
                else:
                    load_payload(host, hb, payload)
        except OSError as e:
            result.disk_error = f"{type(e).__name__}: {e}"

    def _allocate_pool(self, shape: tuple, device: torch.device) -> torch.Tensor | QuantizedKVCache:
        if self.kv_format is None:
            return allocate_zeroed(shape, self.dtype, device)
        return QuantizedKVCache.allocate(shape, self.kv_format, device, allocate_zeroed)

    @torch.inference_mode()
    def profile_kv_budget(self, gpu_memory_utilization: float, max_num_batched_tokens: int,
                          max_num_seqs: int) -> int:
        """CUDA: bytes left for the KV pool = total x utilization - weights - measured
        activation peak (a dummy forward of max_num_batched_tokens, logits for max_num_seqs)
        - non-torch memory. The same subtraction `pagedserve plan` makes with estimates."""
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        before = torch.cuda.memory_allocated(self.device)
        cfg = self.stage_config
        # A pool in the KV dtype, so a quantized cache's write and read temporaries count in the peak.
        scratch = self._allocate_pool(cfg.kv_cache_shape(max_num_batched_tokens + self.block_size,
                                                         self.shard.num_kv_heads), self.device)
        scratch_bytes = sum(t.numel() * t.element_size() for t in self._pool_tensors(scratch))
        blocks = np.arange(-(-max_num_batched_tokens // self.block_size), dtype=np.int64)
        meta, positions = self.build_metadata([], [(blocks, 0, max_num_batched_tokens)], self.block_size,
                                              cfg.sliding_window, self.device, self.quantized_cache)
        ids = torch.zeros(max_num_batched_tokens, dtype=torch.long, device=self.device)
        hidden = self._forward(ids, torch.from_numpy(positions).to(self.device), scratch, meta)
        if hidden is not None:  # the last pipeline stage: logits too
            rows = hidden[-min(max_num_seqs, max_num_batched_tokens):]
            logits = self.model.compute_logits(rows)
            if logits is not None:
                torch.log_softmax(logits, dim=-1)
            del rows
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - before - scratch_bytes
        del scratch, hidden
        free, total = torch.cuda.mem_get_info(self.device)
        non_torch = max(total - free - torch.cuda.memory_reserved(self.device), 0)
        weights = torch.cuda.memory_allocated(self.device)
        budget = int(total * gpu_memory_utilization) - weights - peak - non_torch
        logger.info("memory profile: total %.2f GiB x %.2f, weights %.2f GiB, activation peak %.2f GiB, "
                    "non-torch %.2f GiB -> KV cache %.2f GiB", total / 2**30, gpu_memory_utilization,
                    weights / 2**30, peak / 2**30, non_torch / 2**30, budget / 2**30)
        return budget

    def _blocks(self, cache: torch.Tensor) -> torch.Tensor:
        """View a pool tensor [layers, 2, slots, ...] as [layers, 2, blocks, block_size, ...]."""
        l, two, slots, *rest = cache.shape
        return cache.view(l, two, slots // self.block_size, self.block_size, *rest)

    @staticmethod
    def _pool_tensors(cache: torch.Tensor | QuantizedKVCache) -> list[torch.Tensor]:
        """The tensors a block spans: the pool, or a quantized pool's values and scales."""
        return cache.tensors() if isinstance(cache, QuantizedKVCache) else [cache]

    def copy_blocks(self, pairs: list[tuple[int, int]], src, dst) -> None:
        """Copy whole blocks (all layers, K and V, scales with values) src[a] -> dst[b] for each (a, b)."""
        if not pairs:
            return
        src_ids = torch.tensor([a for a, _ in pairs], device=src.device)
        dst_ids = torch.tensor([b for _, b in pairs], device=dst.device)
        for s, d in zip(self._pool_tensors(src), self._pool_tensors(dst)):
            moved = self._blocks(s).index_select(2, src_ids).to(d.device, non_blocking=True)
            self._blocks(d).index_copy_(2, dst_ids, moved)

    def measure_host_bandwidth(self, max_blocks: int = 64) -> float:
        """Bytes/s of a device -> host block copy, timed once at start-up."""
        if self.host_cache is None:
            return 0.0
        n = min(max_blocks, self.num_blocks, self.host_cache.shape[2] // self.block_size)
        pairs = [(i, i) for i in range(n)]
        self.copy_blocks(pairs, self.kv_cache, self.host_cache)  # warm-up (first touch of pages)
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        self.copy_blocks(pairs, self.kv_cache, self.host_cache)
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        bytes_per_block = sum(t[:, :, : self.block_size].numel() * t.element_size()
                              for t in self._pool_tensors(self.kv_cache))
        return n * bytes_per_block / max(time.perf_counter() - t0, 1e-9)

    @torch.inference_mode()
    def profile_prefill(self, num_tokens: int) -> float:
        """Seconds per token of one dummy prefill forward (written into blocks nobody holds)."""
        num_tokens = max(1, min(num_tokens, self.num_blocks * self.block_size))
        blocks = np.arange(-(-num_tokens // self.block_size), dtype=np.int64)
        meta, positions = self.build_metadata([], [(blocks, 0, num_tokens)], self.block_size,
                                              self.model_config.sliding_window, self.device, self.quantized_cache)
        ids = torch.zeros(num_tokens, dtype=torch.long, device=self.device)
        pos = torch.from_numpy(positions).to(self.device)
        self._forward(ids, pos, self.kv_cache, meta)  # warm-up
        t0 = time.perf_counter()
        self._forward(ids, pos, self.kv_cache, meta)
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        return (time.perf_counter() - t0) / num_tokens

    def _apply_diffs(self, out: SchedulerOutput) -> list[CachedRequestState]:
        for rid in out.finished_ids:
            self.requests.pop(rid, None)
        self.sampler.forget(out.finished_ids)
        for data in out.new_requests:
            self.requests[data.request_id] = CachedRequestState.new(data, self.grammar_compiler,
                                                                    samples=self.samples)
        states = []
        for sr in out.scheduled:
            state = self.requests[sr.request_id]
            state.apply(sr)
            states.append(state)
        return states

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> StepResult:
        t0 = time.perf_counter()
        states = self._apply_diffs(out)
        result = StepResult()
        # The disk tier's writes first: the host blocks they read may be rewritten this step.
        if out.disk_writes or out.disk_sync:
            self._disk_copies(out, False, result)
        # Swap-outs next: their device blocks may be handed to others in this very step.
        if out.blocks_to_swap_out:
            self.copy_blocks(out.blocks_to_swap_out, self.kv_cache, self.host_cache)
        if out.disk_reads:  # into fresh host blocks; the host tier has them from the next step
            self._disk_copies(out, True, result)
        if out.blocks_to_swap_in:
            self.copy_blocks(out.blocks_to_swap_in, self.host_cache, self.kv_cache)
        if out.scheduled:
            inputs = self._prepare_inputs(out, states)
            t1 = time.perf_counter()
            if self.stage.pp > 1:
                hidden = self._forward_micro_batches(inputs)
            else:
                hidden = self._forward(inputs.input_ids, inputs.positions, self.kv_cache, inputs.meta,
                                       inputs.prompt_lens)
            if hidden is not None:  # the last pipeline stage (every stage, without pp)
                self._score_prompts(hidden, inputs.states, inputs.scheduled, result)
                self._sample(hidden, inputs, result)
            result.forward_time = time.perf_counter() - t1
        result.duration = time.perf_counter() - t0
        return result

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache, meta,
                 prompt_lens: torch.Tensor | None = None, pending: list | None = None) -> torch.Tensor | None:
        """This stage's part of the forward: the final hidden states on the last stage, None
        on the others (which send theirs on to the next stage's rank of the same TP index;
        `pending`: append the send there instead of waiting for it)."""
        stage, tp = self.stage, self.shard.tp
        self.num_forwards += 1
        intermediate = None
        if not stage.is_first:
            intermediate = recv_intermediate(self.model.num_intermediate_tensors, input_ids.shape[0],
                                             self.model_config.hidden_size, self.dtype, self.device,
                                             src=(stage.pp_rank - 1) * tp + self.shard.rank)
        out = self.model(input_ids, positions, kv_cache, meta, prompt_lens, intermediate)
        if stage.is_last:
            return out
        sent = send_intermediate(out, dst=(stage.pp_rank + 1) * tp + self.shard.rank, wait=pending is None)
        if pending is not None:
            pending.append(sent)
        return None

    def _forward_micro_batches(self, inputs: StepInputs) -> torch.Tensor | None:
        """The pipelined forward: the step's requests cut into micro-batches
        (pipeline.micro_batch_bounds) that follow each other through the stages; each sent
        on without waiting, so a stage starts its next micro-batch while the last travels.
        Requests are independent, so the rows are the one-batch forward's rows, in order."""
        sched = inputs.scheduled
        bounds = micro_batch_bounds([sr.num_new_tokens for sr in sched], self.stage.pp)
        if len(bounds) == 1:
            return self._forward(inputs.input_ids, inputs.positions, self.kv_cache, inputs.meta, inputs.prompt_lens)
        self.num_micro_batches += len(bounds)
        offsets = np.concatenate([[0], np.cumsum([sr.num_new_tokens for sr in sched])])
        outs, pending = [], []
        for a, b in bounds:
            lo, hi = int(offsets[a]), int(offsets[b])
            rows = range(a, b)  # decodes first within the run too: the batch's order is decodes, then prefills
            decodes = [(np.asarray(inputs.states[i].block_ids, dtype=np.int64), sched[i].start_pos)
                       for i in rows if sched[i].num_new_tokens == 1]
            prefills = [(np.asarray(inputs.states[i].block_ids, dtype=np.int64), sched[i].start_pos,
                         sched[i].num_new_tokens) for i in rows if sched[i].num_new_tokens != 1]
            meta, _ = self.build_metadata(decodes, prefills, self.block_size, self.model_config.sliding_window,
                                          self.device, self.quantized_cache)
            prompt_lens = None if inputs.prompt_lens is None else inputs.prompt_lens[lo:hi]
            out = self._forward(inputs.input_ids[lo:hi], inputs.positions[lo:hi], self.kv_cache, meta, prompt_lens,
                                pending=pending)
            if out is not None:
                outs.append(out)
        wait_sends(pending)
        return torch.cat(outs) if outs else None

    def _prepare_inputs(self, out: SchedulerOutput, states: list[CachedRequestState]) -> StepInputs:
        """The step's tensors in the attention backend's layout: decodes (one new token) first,
        then prefill chunks. Each request's block ids go to the backend as the list the state
        holds (the backend copies what it keeps); a decode-only step, the steady state, keeps
        the scheduled order and makes no per-request array."""
        sched = out.scheduled
        if all(len(sr.token_ids) == 1 for sr in sched):  # decode-only: the rows in scheduled order
            num_decodes = len(sched)
            meta, positions = self.build_metadata(
                [(state.block_ids, sr.start_pos) for state, sr in zip(states, sched)], [],
                self.block_size, self.model_config.sliding_window, self.device, self.quantized_cache)
            token_ids = np.fromiter((sr.token_ids[0] for sr in sched), dtype=np.int64, count=num_decodes)
        else:
            order = ([i for i, sr in enumerate(sched) if len(sr.token_ids) == 1]
                     + [i for i, sr in enumerate(sched) if len(sr.token_ids) != 1])
            states, sched = [states[i] for i in order], [sched[i] for i in order]
            num_decodes = sum(1 for sr in sched if len(sr.token_ids) == 1)
            meta, positions = self.build_metadata(
                [(state.block_ids, sr.start_pos) for state, sr in zip(states[:num_decodes], sched[:num_decodes])],
                [(state.block_ids, sr.start_pos, len(sr.token_ids))
                 for state, sr in zip(states[num_decodes:], sched[num_decodes:])],
                self.block_size, self.model_config.sliding_window, self.device, self.quantized_cache)
            token_ids = np.fromiter(itertools.chain.from_iterable(sr.token_ids for sr in sched), dtype=np.int64)
        prompt_lens = None
        if self.model.rotary.needs_prompt_lens:  # dynamic NTK RoPE: see model/rope.py
            per_token = np.repeat([len(state.prompt_token_ids) for state in states],
                                  [len(sr.token_ids) for sr in sched])
            prompt_lens = torch.from_numpy(per_token.astype(np.int64)).to(self.device)
        # Only requests that reach their last token this step produce a token.
        if num_decodes == len(sched) and all(sr.sample for sr in sched):
            last_rows = None  # decode-only, every request samples: the rows are the hidden states as they are
            sampling = states
        else:
            sample_rows = [k for k, sr in enumerate(sched) if sr.sample]
            ends = np.cumsum([len(sr.token_ids) for sr in sched]) - 1
            last_rows = torch.from_numpy(ends[sample_rows]).to(self.device)
            sampling = [states[k] for k in sample_rows]
        input_ids, positions = torch.from_numpy(token_ids), torch.from_numpy(positions)
        if self.device.type != "cpu":
            input_ids, positions = input_ids.to(self.device), positions.to(self.device)
        return StepInputs(input_ids=input_ids, positions=positions, meta=meta, prompt_lens=prompt_lens,
                          states=states, scheduled=sched, last_rows=last_rows, sampling=sampling)

    def _sample(self, hidden: torch.Tensor, inputs: StepInputs, result: StepResult) -> None:
        """Logits for the rows that end their request's tokens, then one token each."""
        sampling = inputs.sampling
        if not sampling:
            return
        logits = self.model.compute_logits(hidden if inputs.last_rows is None else hidden[inputs.last_rows])
        if logits is None:  # a tensor-parallel rank other than 0: the gathered logits are on rank 0
            return
        if all(state.plain_greedy for state in sampling):  # the common case: no grammar, no logprobs
            result.sampled.update(zip([state.request_id for state in sampling], self.sampler.greedy(logits)))
            return
        sync_grammars(sampling)
        tokens, logprobs = self.sampler(logits, sampling)
        for state, tok, lp in zip(sampling, tokens, logprobs):
            grammar = state.grammar
            if grammar is not None:
                grammar.accept(tok)
                failure = grammar.failure()
                if failure is not None:  # never a token the grammar did not take: the request fails
                    result.errors[state.request_id] = failure
                    continue
            result.sampled[state.request_id] = tok
            if lp is not None:
                result.logprobs[state.request_id] = lp

    @torch.inference_mode()
    def dummy_moe_pass(self) -> None:
        """DP attention + EP, a step with no tokens here: each MoE layer, in order, with none of
        its own (it still computes its experts for the other cores' tokens)."""
        from pagedserve.model.moe import SparseMoeBlock
        for module in self.model.modules():
            if isinstance(module, SparseMoeBlock):
                module.dummy(self.dtype, self.device)

    @property
    def num_stage_layers(self) -> int:
        """Decoder layers this rank's pool holds (all of them, without pipeline parallelism)."""
        return self.stage.num_layers

    @property
    def weight_bytes(self) -> int:
        """Bytes of this rank's weights as loaded (before any GEMM packing): `plan`'s per-GPU figure."""
        return self.model.weight_bytes

    @property
    def expert_layout(self) -> list[tuple[int, int, int]]:
        """(first expert, experts held, intermediate width held) of each MoE layer on this rank."""
        from pagedserve.model.moe import SparseMoeBlock
        return [(m.first_expert, m.experts.w13.shape[0], m.experts.w2.shape[2])
                for m in self.model.modules() if isinstance(m, SparseMoeBlock)]

    @property
    def kv_cache_bytes(self) -> int:
        """Bytes of this rank's device KV pool, as allocated."""
        if self.kv_cache is None:
            return 0
        return sum(t.numel() * t.element_size() for t in self._pool_tensors(self.kv_cache))  # scales included

    def _score_prompts(self, hidden: torch.Tensor, states: list[CachedRequestState],
                       sched: list[ScheduledRequest], result: StepResult) -> None:
        """Prompt logprobs of the prompt tokens this step's chunks predict (rows in batch order)."""
        row = 0
        for state, sr in zip(states, sched):
            k = state.sampling_params.prompt_logprobs
            if k is not None:
                first, last = prompt_tokens_scored(sr.start_pos, sr.context_len, len(state.prompt_token_ids),
                                                   state.num_prompt_logprobs_done)
                if first < last:
                    # Token j is predicted by the row of position j - 1.
                    rows = hidden[row + first - 1 - sr.start_pos: row + last - 1 - sr.start_pos]
                    targets = state.prompt_token_ids[first:last]
                    result.prompt_logprobs[state.request_id] = self._token_logprobs(rows, targets, k)
                    state.num_prompt_logprobs_done = last
            row += sr.num_new_tokens

    def _token_logprobs(self, hidden_rows: torch.Tensor, targets: list[int], k: int) -> list[TokenLogprobs]:
        """For each row: the target token's logprob and rank, and the top k (fp32 log_softmax)."""
        out: list[TokenLogprobs] = []
        for lo in range(0, len(targets), PROMPT_LOGPROBS_ROWS_PER_PASS):
            chunk_targets = targets[lo:lo + PROMPT_LOGPROBS_ROWS_PER_PASS]
            logits = self.model.compute_logits(hidden_rows[lo:lo + len(chunk_targets)])
            if logits is None:  # a tensor-parallel rank > 0: the gather (every rank joins it) went to rank 0
                continue
            logits = logits.float()
            lps = torch.log_softmax(logits, dim=-1)
            target_ids = torch.tensor(chunk_targets, device=lps.device)
            target_lps = lps.gather(1, target_ids[:, None])
            ranks = (lps > target_lps).sum(dim=1) + 1
            top_vals, top_ids = lps.topk(k, dim=-1) if k > 0 else (None, None)
            target_list, rank_list = target_lps[:, 0].tolist(), ranks.tolist()
            top_v = top_vals.tolist() if k > 0 else None
            top_i = top_ids.tolist() if k > 0 else None
            for j, token in enumerate(chunk_targets):
                top = list(zip(top_i[j], top_v[j])) if k > 0 else []
                out.append(TokenLogprobs(token, target_list[j], rank_list[j], top))
        return out

    def check_health(self) -> None:
        pass  # one process: nothing to watch

    def worker_pids(self) -> list[int]:
        return []

    def shutdown(self) -> None:
        self.requests.clear()
        if self.dp_lockstep is not None:
            self.dp_lockstep.shutdown()
            self.dp_lockstep = None


def prompt_tokens_scored(start_pos: int, context_len: int, num_prompt_tokens: int, num_done: int) -> tuple[int, int]:
    """[first, last): the prompt tokens a chunk computing positions [start_pos, context_len)
    predicts and that are not scored yet. Row p predicts token p + 1, so tokens
    start_pos + 1 .. context_len (the first token of the next chunk included: it is known)."""
    first = max(start_pos + 1, num_done)
    last = min(context_len + 1, num_prompt_tokens)
    return first, max(first, last)


def sync_grammars(states: list[CachedRequestState]) -> None:
    """Before a sample: each matcher has consumed exactly the outputs fed so far."""
    for state in states:
        if state.grammar is not None:
            state.grammar.sync(state.token_ids, len(state.prompt_token_ids), state.context_len)
