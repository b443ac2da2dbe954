"""ModelRunner: the real executor. execute(SchedulerOutput) -> StepResult.

It owns the model, the device KV pool ([layers, 2, num_blocks * block_size, kv_heads,
head_dim]) and the sampler; it never calls back into the scheduler.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from pagedserve.attention.torch_backend import build_metadata
from pagedserve.core.scheduler import SchedulerOutput
from pagedserve.model.loader import TORCH_DTYPES, ModelConfig, load_model
from pagedserve.worker.sampler import Sampler, TokenLogprobs

logger = logging.getLogger("pagedserve.worker")


@dataclass
class StepResult:
    sampled: dict[str, int] = field(default_factory=dict)
    logprobs: dict[str, TokenLogprobs] = field(default_factory=dict)
    duration: float = 0.0          # seconds spent in this step's execute
    forward_time: float = 0.0      # of which in the model forward + sampling


def allocate_zeroed(shape: tuple, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero-filled pool. Zeros matter: padded attention reads may touch never-written
    slots, and garbage NaNs there would poison the masked sums. On CPU, numpy's calloc
    maps zero pages lazily, so a 4 GiB pool costs nothing until its blocks are written
    (torch.zeros would touch every page up front: seconds at start-up)."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    itemsize = torch.empty((), dtype=dtype).element_size()
    raw = np.zeros(shape, dtype={2: np.int16, 4: np.int32, 8: np.int64}[itemsize])
    return torch.from_numpy(raw).view(dtype)


class ModelRunner:
    def __init__(self, model_config: ModelConfig, dtype: str, device: str, num_blocks: int, block_size: int,
                 eos_token_ids: frozenset[int], seed: int) -> None:
        self.model_config = model_config
        self.device = torch.device(device)
        self.dtype = TORCH_DTYPES[dtype]
        self.block_size = block_size
        self.num_blocks = num_blocks
        torch.manual_seed(seed)
        self.model = load_model(model_config, dtype, device)
        shape = (model_config.num_layers, 2, num_blocks * block_size, model_config.num_kv_heads, model_config.head_dim)
        self.kv_cache = allocate_zeroed(shape, self.dtype, self.device)
        self.sampler = Sampler(eos_token_ids, seed, self.device)

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> StepResult:
        t0 = time.perf_counter()
        self.sampler.forget(out.finished_ids)
        result = StepResult()
        if not out.scheduled:
            result.duration = time.perf_counter() - t0
            return result
        # Decodes (one new token) first, then prefill chunks: see attention.torch_backend.
        decodes = [r for r in out.scheduled if r.num_new_tokens == 1]
        prefills = [r for r in out.scheduled if r.num_new_tokens > 1]
        ordered = decodes + prefills
        meta, positions = build_metadata(
            [(np.asarray(r.block_ids, dtype=np.int64), r.start_pos) for r in decodes],
            [(np.asarray(r.block_ids, dtype=np.int64), r.start_pos, r.num_new_tokens) for r in prefills],
            self.block_size, self.model_config.sliding_window, self.device)
        token_ids = np.fromiter((t for r in ordered for t in r.token_ids), dtype=np.int64)
        input_ids = torch.from_numpy(token_ids).to(self.device)
        pos = torch.from_numpy(positions).to(self.device)

        # Only requests that reach their last token this step produce a token.
        last_rows, sampling = [], []
        row = 0
        for r in ordered:
            row += r.num_new_tokens
            if r.sample:
                last_rows.append(row - 1)
                sampling.append(r)
        t1 = time.perf_counter()
        hidden = self.model(input_ids, pos, self.kv_cache, meta)
        if sampling:
            logits = self.model.compute_logits(hidden[torch.tensor(last_rows, device=self.device)])
            tokens, logprobs = self.sampler(logits, sampling)
            for r, tok, lp in zip(sampling, tokens, logprobs):
                result.sampled[r.request_id] = tok
                if lp is not None:
                    result.logprobs[r.request_id] = lp
        t2 = time.perf_counter()
        result.forward_time = t2 - t1
        result.duration = t2 - t0
        return result
