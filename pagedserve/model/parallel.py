"""Tensor-parallel pieces of the Llama family (Megatron-style), over torch.distributed.

    qkv_proj, gate_up_proj   column-parallel: each rank computes its heads / its slice of the
                             intermediate dimension; no communication
    o_proj, down_proj        row-parallel (RowParallelLinear, a model.layers.Linear, so the
                             GEMM path chosen per shape applies): each rank multiplies its slice
                             of the input, then one all-reduce sums the partial outputs; a bias
                             is added once, after the sum
    embed_tokens             vocab-parallel: a rank looks up the ids in its rows, zeros for the
                             rest, and an all-reduce assembles each row (one non-zero term: exact)
    lm_head                  vocab-parallel: each rank computes its vocabulary slice's logits,
                             gathered on rank 0, where sampling happens

With tp == 1 every layer is exactly the unsharded one (no collective, the same ops), so a
single-rank engine computes what it always did. The slices each rank takes of the
checkpoint's full tensors are `shard_checkpoint_tensor`'s; which heads and rows a rank owns
is `model.config.TPShard`'s.

The process group is torch.distributed's default group (gloo on CPU, NCCL on CUDA), set up
by worker/worker.py before the model is built. Communication is timed only where a
benchmark installs a CommObserver on the rank (`set_comm_observer`, reached through the
worker's `set_comm_observer` call); without one (the default) a collective is the bare
torch.distributed call, with no clock read.
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from pagedserve.model.config import ModelConfig, TPShard
from pagedserve.model.layers import Linear

class CommObserver:
    """What one rank's communication cost, by kind: calls, seconds (wall, the call's own)
    and bytes this rank handed to the call. Kinds: "all_reduce" (attention / dense MLP /
    embedding), "moe_combine" (the MoE layer's all-reduce), "gather" (logits to rank 0),
    "ep_dispatch" / "ep_combine" (DP attention + EP: an MoE layer's token exchange),
    "pp_send" (a send's call, and later waits on it), "pp_recv"."""

    def __init__(self) -> None:
        self.calls: dict[str, int] = {}
        self.seconds: dict[str, float] = {}
        self.bytes: dict[str, int] = {}

    def record(self, kind: str, seconds: float, num_bytes: int = 0, calls: int = 1) -> None:
        self.calls[kind] = self.calls.get(kind, 0) + calls
        self.seconds[kind] = self.seconds.get(kind, 0.0) + seconds
        self.bytes[kind] = self.bytes.get(kind, 0) + num_bytes

    def summary(self) -> dict[str, dict]:
        return {k: {"calls": self.calls[k], "seconds": self.seconds[k], "bytes": self.bytes[k]} for k in self.calls}


_observer: CommObserver | None = None


def set_comm_observer(observer: CommObserver | None) -> CommObserver | None:
    """Install `observer` on this process's collectives (None: remove); returns the previous one."""
    global _observer
    previous, _observer = _observer, observer
    return previous


def comm_observer() -> CommObserver | None:
    return _observer


def observed_clock(x: torch.Tensor) -> float:
    """perf_counter for an observer's interval; on CUDA after the device's queued work, so
    an asynchronous NCCL call is timed by its transfer, not its enqueue (a benchmark's cost)."""
    if x.is_cuda:
        torch.cuda.synchronize(x.device)
    return time.perf_counter()


def all_reduce(x: torch.Tensor, kind: str = "all_reduce") -> torch.Tensor:
    observer = _observer
    if observer is None:
        dist.all_reduce(x)
        return x
    t0 = observed_clock(x)
    dist.all_reduce(x)
    observer.record(kind, observed_clock(x) - t0, x.numel() * x.element_size())
    return x


def moe_combine(x: torch.Tensor) -> torch.Tensor:
    """An MoE layer's combine (model/moe.py): an all-reduce, observed under its own kind."""
    return all_reduce(x, "moe_combine")


def ep_dispatch(x: torch.Tensor, routing: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """DP attention + EP, an MoE layer's dispatch: every data-parallel rank's tokens (rows of
    `x`) and their routing (rows of `routing`: expert ids and weights, fp32) on every rank,
    in rank order, and each rank's row count. An all-gather of the counts, then of the rows
    padded to the most any rank has (gloo's all-gather wants one shape)."""
    observer = _observer
    t0 = observed_clock(x) if observer is not None else 0.0
    world = dist.get_world_size()
    count = torch.tensor([x.shape[0]], dtype=torch.int64)
    counts_t = [torch.zeros_like(count) for _ in range(world)]
    dist.all_gather(counts_t, count)
    counts = [int(c.item()) for c in counts_t]
    most = max(counts)
    gathered = []
    for t in (x, routing):
        padded = t if t.shape[0] == most else F.pad(t, (0, 0, 0, most - t.shape[0]))
        parts = [torch.empty_like(padded) for _ in range(world)]
        dist.all_gather(parts, padded.contiguous())
        gathered.append(torch.cat([p[:n] for p, n in zip(parts, counts)]))
    if observer is not None:
        observer.record("ep_dispatch", observed_clock(x) - t0,
                        most * (x.shape[1] * x.element_size() + routing.shape[1] * routing.element_size()), 3)
    return gathered[0], gathered[1], counts


def ep_combine(out: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """DP attention + EP, an MoE layer's combine: each rank's partial outputs (its experts')
    for every rank's tokens, summed over the ranks; this rank keeps its own tokens' rows. An
    all-reduce of the rows (gloo has no reduce-scatter of uneven parts; the sum is the same)."""
    all_reduce(out, "ep_combine")
    start = sum(counts[:dist.get_rank()])
    return out[start:start + counts[dist.get_rank()]]


def gather_on_rank0(x: torch.Tensor, shard: TPShard) -> torch.Tensor | None:
    """Concatenate every rank's last dimension on rank 0 (None elsewhere)."""
    observer = _observer
    t0 = observed_clock(x) if observer is not None else 0.0
    parts = [torch.empty_like(x) for _ in range(shard.tp)] if shard.rank == 0 else None
    dist.gather(x.contiguous(), parts, dst=0)
    if observer is not None:
        observer.record("gather", observed_clock(x) - t0, x.numel() * x.element_size())
    return torch.cat(parts, dim=-1) if parts is not None else None


class RowParallelLinear(Linear):
    """y = sum over ranks of x_r @ W_r^T, then + bias (once). A model.layers.Linear: its GEMM
    runs by the LinearMethod chosen for its (per-rank) shape at load, and its parameter names
    stay `weight`/`bias` so checkpoints load by their HF names."""

    def __init__(self, in_features_per_rank: int, out_features: int, bias: bool, tp: int) -> None:
        super().__init__(in_features_per_rank, out_features, bias=bias)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp == 1:
            return super().forward(x)
        y = all_reduce(self.method.apply(x, self.weight, None))
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Embedding):
    """Rows [vocab_start, vocab_start + vocab_per_rank) of the table; the last rank's tail
    past the real vocabulary is zero padding."""

    def __init__(self, shard: TPShard, hidden_size: int) -> None:
        super().__init__(shard.vocab_per_rank, hidden_size)
        self.shard = shard

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.shard.tp == 1:  # F.embedding's own call, without its wrapper's checks or Module.__getattr__
            return torch.embedding(self._parameters["weight"], ids)
        mine = (ids >= self.shard.vocab_start) & (ids < self.shard.vocab_end)
        local = torch.where(mine, ids - self.shard.vocab_start, torch.zeros_like(ids))
        rows = F.embedding(local, self.weight) * mine.unsqueeze(-1).to(self.weight.dtype)
        return all_reduce(rows)


def gather_vocab_logits(local: torch.Tensor, shard: TPShard, vocab_size: int) -> torch.Tensor | None:
    """This rank's vocabulary slice of the logits -> the full vocabulary's on rank 0 (None on
    the others)."""
    if shard.tp == 1:
        return local
    full = gather_on_rank0(local, shard)
    return None if full is None else full[..., :vocab_size]


def shard_checkpoint_tensor(name: str, tensor: torch.Tensor, cfg: ModelConfig, shard: TPShard) -> torch.Tensor:
    """The slice of one full HF checkpoint tensor (name without the `model.` prefix) that
    this rank holds. Replicated tensors (norms, row-parallel biases) come back whole."""
    if shard.tp == 1:
        return tensor
    parts = name.split(".")
    proj, kind = (parts[-2], parts[-1]) if len(parts) >= 2 else ("", "")
    hd = cfg.head_dim
    if proj == "q_proj":
        return tensor[shard.q_head_start * hd:(shard.q_head_start + shard.num_heads) * hd]
    if proj in ("k_proj", "v_proj"):
        return tensor[shard.kv_head_start * hd:(shard.kv_head_start + shard.num_kv_heads) * hd]
    if proj == "o_proj" and kind == "weight":
        return tensor[:, shard.q_head_start * hd:(shard.q_head_start + shard.num_heads) * hd]
    if proj in ("gate_proj", "up_proj"):
        return tensor[shard.intermediate_start:shard.intermediate_start + shard.intermediate_size]
    if proj == "down_proj" and kind == "weight":
        return tensor[:, shard.intermediate_start:shard.intermediate_start + shard.intermediate_size]
    if name in ("embed_tokens.weight", "lm_head.weight"):
        rows = tensor[shard.vocab_start:shard.vocab_end]
        pad = shard.vocab_per_rank - rows.shape[0]
        return F.pad(rows, (0, 0, 0, pad)) if pad else rows
    return tensor


def shard_mlp_tensor(proj: str, tensor: torch.Tensor, start: int, size: int) -> torch.Tensor:
    """An MLP projection's slice of the intermediate dimension [start, start + size): rows
    of gate/up (w1/w3), columns of down (w2). Used for experts and shared experts, whose
    widths are not the dense MLP's."""
    if proj in ("gate_proj", "up_proj", "w1", "w3"):
        return tensor[start:start + size]
    if proj in ("down_proj", "w2"):
        return tensor[:, start:start + size]
    raise ValueError(f"shard_mlp_tensor: {proj!r} is not an MLP projection")


def shard_heads(tensor: torch.Tensor, shard: TPShard, width: int, dim: int = 0) -> torch.Tensor:
    """The rows (dim 0) or columns (dim 1) of this rank's query heads, `width` per head
    (MLA's q_b_proj and kv_b_proj rows, o_proj columns)."""
    lo, hi = shard.q_head_start * width, (shard.q_head_start + shard.num_heads) * width
    return tensor[lo:hi] if dim == 0 else tensor[:, lo:hi]
