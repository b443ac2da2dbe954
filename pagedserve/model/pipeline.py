"""Pipeline parallelism: which decoder layers a stage holds, what it loads, what it sends.

    stage 0            stage 1            ...  stage pp-1 (last)
    embed_tokens       -                       -
    layers [0, a)      layers [a, b)           layers [.., num_layers)
    -                  -                       norm, lm_head (tied: its own copy of the
                                               embedding as the head), logits, sampling
      └── hidden + residual ──▶ └── hidden + residual ──▶

The split is `plan`'s (plan.parallel.stage_layer_counts: an even split, the remainder
given to the stages just before the last, as vLLM's get_pp_indices does), so each stage's
weights and KV pool are the bytes `pagedserve plan --pipeline-parallel-size` prints.

A stage's model is the whole model's class built for a smaller config: `stage_config`
gives it the stage's layer count (and the MoE layout of those layers), and
`stage_tensors` feeds it only its layers' checkpoint tensors, renumbered from 0, plus the
embedding / final norm / head where the stage holds them. The model code is the same at
any pp; its KV pool is [stage layers, ...] and indexed from 0.

Between stages each rank sends its stage's output (the layer output and the residual not
yet added to it, as one [2, T, hidden] tensor; DeepSeek's decoder has no separate residual:
[1, T, hidden]) to the rank of the same TP index in the next stage, with torch.distributed
send/recv (gloo on CPU, NCCL on CUDA). Every rank knows T from the SchedulerOutput all
ranks receive, so no shape travels. Ranks are numbered rank = pp_rank * tp + tp_rank
(vLLM's order: a stage's TP group is contiguous).
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, replace

from pagedserve.model.config import ModelConfig
from pagedserve.plan.parallel import stage_layer_counts

# A step is cut into micro-batches (at most pp, each of at least this many tokens) that follow
# each other through the stages, so stage s works on micro-batch k while stage s+1 works on
# k-1. That pays only where a stage's time grows with its tokens (prefill chunks: compute
# bound); a decode step's time is reading the weights, which each micro-batch would read
# again. 0 turns it off. Read from the environment so the spawned ranks see the same value.
PP_MICRO_BATCH_MIN_TOKENS = int(os.environ.get("PAGEDSERVE_PP_MICRO_BATCH_TOKENS", "256"))


@dataclass(frozen=True)
class PipelineStage:
    pp: int
    pp_rank: int
    first_layer: int
    num_layers: int

    @property
    def end_layer(self) -> int:
        return self.first_layer + self.num_layers

    @property
    def is_first(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last(self) -> bool:
        return self.pp_rank == self.pp - 1

    @classmethod
    def of(cls, num_layers: int, pp: int = 1, pp_rank: int = 0) -> "PipelineStage":
        counts = stage_layer_counts(num_layers, pp)
        return cls(pp, pp_rank, sum(counts[:pp_rank]), counts[pp_rank])


def check_pipeline_parallel(num_layers: int, pp: int) -> None:
    """Refuse, with the numbers, a pipeline_parallel_size the model's layers cannot fill
    (every stage needs at least one layer)."""
    if pp > num_layers:
        raise ValueError(f"pipeline_parallel_size: {pp} stages, but the model has {num_layers} decoder layers "
                         f"(every stage needs at least one); use at most {num_layers}")


def stage_config(cfg: ModelConfig, stage: PipelineStage) -> ModelConfig:
    """The config a stage's model is built from: its layers only."""
    if stage.pp == 1:
        return cfg
    moe = cfg.moe
    if moe is not None:
        moe = replace(moe, sparse_layers=moe.sparse_layers[stage.first_layer:stage.end_layer])
    return replace(cfg, num_layers=stage.num_layers, moe=moe)


def holds_embedding(stage: PipelineStage, tied: bool) -> bool:
    """Stage 0 looks tokens up; with tied weights the last stage keeps its own copy as the head."""
    return stage.is_first or (tied and stage.is_last)


def stage_tensors(tensors, stage: PipelineStage, tied: bool):
    """The checkpoint tensors a stage loads, `layers.N.` renumbered to its own index."""
    if stage.pp == 1:
        yield from tensors
        return
    embedding = holds_embedding(stage, tied)
    for name, tensor in tensors:
        bare = name[len("model."):] if name.startswith("model.") else name
        if bare.startswith("layers."):
            index, _, rest = bare[len("layers."):].partition(".")
            layer = int(index)
            if not stage.first_layer <= layer < stage.end_layer:
                continue  # another stage's layer (or a multi-token-prediction layer past the model)
            yield f"layers.{layer - stage.first_layer}.{rest}", tensor
        elif bare == "embed_tokens.weight":
            if embedding:
                yield bare, tensor
        elif bare in ("norm.weight", "lm_head.weight"):
            if stage.is_last:
                yield bare, tensor
        else:
            yield name, tensor


def prune_model(model, stage: PipelineStage, tied: bool) -> None:
    """Drop the modules a stage does not hold (before loading, so none is missing)."""
    if stage.pp == 1:
        return
    if not holds_embedding(stage, tied):
        model.embed_tokens = None
    if not stage.is_last:
        model.norm = None
        model.lm_head = None


def micro_batch_bounds(num_new_tokens: list[int], pp: int, min_tokens: int = PP_MICRO_BATCH_MIN_TOKENS
                       ) -> list[tuple[int, int]]:
    """Runs [a, b) of a step's requests (in row order), m = min(pp, requests, tokens //
    min_tokens) of them with about equal tokens; [(0, n)] when m <= 1 (no micro-batching)."""
    n, total = len(num_new_tokens), sum(num_new_tokens)
    m = min(pp, n, total // min_tokens) if min_tokens > 0 else 1
    if m <= 1:
        return [(0, n)]
    bounds, start, acc = [], 0, 0
    for i, tokens in enumerate(num_new_tokens):
        acc += tokens
        groups_left = m - len(bounds) - 1
        if groups_left and (acc >= total * (len(bounds) + 1) / m or n - i - 1 == groups_left):
            bounds.append((start, i + 1))
            start = i + 1
    bounds.append((start, n))
    return bounds


def send_intermediate(parts: tuple, dst: int, wait: bool = True):
    """Send a stage's output on; `wait=False`: return the pending send (wait() on it later) so
    the next micro-batch computes while this one travels."""
    import torch
    import torch.distributed as dist

    from pagedserve.model.parallel import comm_observer, observed_clock

    observer = comm_observer()
    payload = torch.stack([p for p in parts if p is not None]).contiguous()
    t0 = observed_clock(payload) if observer is not None else 0.0
    work = dist.isend(payload, dst)
    if wait:
        work.wait()
    if observer is not None:
        t1 = observed_clock(payload) if wait else time.perf_counter()
        observer.record("pp_send", t1 - t0, payload.numel() * payload.element_size())
    return None if wait else (work, payload)  # the payload lives until the send completes


def wait_sends(pending: list) -> None:
    from pagedserve.model.parallel import comm_observer, observed_clock

    observer = comm_observer() if pending else None
    t0 = observed_clock(pending[0][1]) if observer is not None else 0.0
    for work, _payload in pending:
        work.wait()
    if observer is not None:  # the sends' own calls were counted when they started
        observer.record("pp_send", observed_clock(pending[-1][1]) - t0, 0, calls=0)


def recv_intermediate(num_parts: int, num_tokens: int, hidden_size: int, dtype, device, src: int) -> tuple:
    """(hidden, residual) from the previous stage; residual None for a one-part model."""
    import torch
    import torch.distributed as dist

    from pagedserve.model.parallel import comm_observer, observed_clock

    observer = comm_observer()
    payload = torch.empty((num_parts, num_tokens, hidden_size), dtype=dtype, device=device)
    t0 = observed_clock(payload) if observer is not None else 0.0
    dist.recv(payload, src)
    if observer is not None:
        observer.record("pp_recv", observed_clock(payload) - t0, payload.numel() * payload.element_size())
    return (payload[0], payload[1]) if num_parts == 2 else (payload[0], None)
