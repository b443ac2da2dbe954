"""Step time of one engine spread over TP x PP GPUs (EP inside the TP group) on a node
topology: the communication and pipeline terms around the per-rank roofline of
cost_model.py. Torch-free.

Placement (vLLM's and Megatron's order, TP innermost): stage s, TP rank r is GPU
s x TP + r, and GPU g sits on node g // gpus_per_node. A link inside a node runs at the
GPU preset's NVLink bandwidth (one direction), a link between nodes at `inter_node_gbps`
per GPU (default 50 GB/s: one 400 Gb/s ConnectX-7 NIC per GPU, as in a DGX H100/H200);
both at the cost model's `link_efficiency`, plus its fixed latency per collective.

Terms, per decoder layer of a stage, for the T tokens of a (micro-)batch, a = activation bytes:

* TP all-reduce (ring): 2 (TP-1)/TP x T x hidden x a per GPU, over the slowest link of the
  group: NVLink when the group is inside one node, the NIC when it spans nodes. Two per
  layer (after attention and after the MLP), as in cost_model.py.
* EP (the routed experts spread whole over the TP group, vLLM's --enable-expert-parallel
  with DP 1): the MLP all-reduce of an MoE layer is replaced by an all-to-all dispatch and
  an all-to-all combine. The step's tokens are split over the EP ranks before dispatch
  (the reduce-scatter / all-gather around it together move what one all-reduce moves);
  each GPU sends its T/EP tokens to their top-k experts, a share (EP-1)/EP of them to other
  GPUs: (T/EP) x k x hidden x a per GPU each way, split into the part for GPUs on the same
  node (NVLink) and on other nodes (NIC); the slower part sets the time. Uniform routing
  (no hot experts: no load imbalance term).
* Expert weights read: a step of T tokens touches an expected 1 - (1 - k/E)^T of the
  experts (uniform routing); only those are read, under TP (each GPU its 1/TP share of
  each) and EP (each GPU its own whole experts) alike.
* PP: the scheduled requests are split into m = min(PP, requests) micro-batches that
  follow each other through the stages (vLLM keeps PP batches in flight). In steady state
  a step lasts the longer of: the slowest stage's work on all micro-batches, and one
  micro-batch's trip through every stage plus (PP-1) activation sends
  (T_micro x hidden x a per GPU, over NVLink or the NIC as the stage boundary falls).
  With fewer micro-batches than stages the pipeline idles: the bubble of GPipe
  (Huang et al., 2019) without its fill and drain, which continuous batching avoids.
  Every stage carries its own layers; only the last one the LM head.

Published figures this uses: DeepEP's all-to-all kernels reach 153-158 GB/s over H800
NVLink (~160 GB/s) and 43-58 GB/s over 400 Gb/s CX7 RDMA (~50 GB/s) at EP 16-64
(deepseek-ai/DeepEP, docs/legacy.md, "Normal kernels"), i.e. close to the links: the
default link_efficiency (0.7, from NCCL all-reduce) is on the safe side for EP.
Invariant: TP inside one node, PP = 1, no EP and a dense model give exactly
cost_model.CostModel's step time.

DP attention + EP (`-dp N --enable-expert-parallel`, `DPExpertParallelCost`) is priced per
lockstep turn of the N cores, not per engine: each core's own step (TP 1, its ceil(E/N)
experts over every core's tokens), a dummy pass for a core with nothing scheduled, and the
turn's exchange (pagedserve's all-gather + all-reduce per MoE layer, or vLLM's all-to-all);
the turn lasts the slowest core plus the exchange. sim/data_parallel.py drives it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Sequence

from pagedserve.plan.kv_budget import ModelShape, dtype_bytes
from pagedserve.plan.parallel import ParallelLayout, stage_layer_counts
from pagedserve.sim.cost_model import CostModel, CostParams, ModelCost, StepFeatures, step_features
from pagedserve.sim.cost_params import allreduce_seconds
from pagedserve.sim.step_work import (KERNELS_FIRST_STAGE, KERNELS_LAST_STAGE, KERNELS_PER_STEP_FIXED,
                                      elementwise_kernels, gemm_kernel_count)

DEFAULT_GPUS_PER_NODE = 8
DEFAULT_INTER_NODE_GBPS = 50.0  # GB/s per GPU, one direction: one 400 Gb/s NIC per GPU


@dataclass(frozen=True)
class Topology:
    gpus_per_node: int = DEFAULT_GPUS_PER_NODE
    inter_node_gbps: float = DEFAULT_INTER_NODE_GBPS

    def __post_init__(self) -> None:
        if self.gpus_per_node < 1:
            raise ValueError(f"--gpus-per-node must be >= 1, got {self.gpus_per_node}")
        if not self.inter_node_gbps > 0:
            raise ValueError(f"--inter-node-bandwidth must be > 0 GB/s, got {self.inter_node_gbps}")

    def node_of(self, gpu: int) -> int:
        return gpu // self.gpus_per_node

    def spans_nodes(self, first_gpu: int, count: int) -> bool:
        return self.node_of(first_gpu) != self.node_of(first_gpu + count - 1)


@dataclass
class ParallelStepTime:
    """A predicted step by part (seconds). `compute`: linear + attention of the stages'
    critical path; `pipeline`: idle stages and activation sends that PP adds."""

    linear: float = 0.0
    attention: float = 0.0
    allreduce: float = 0.0
    all_to_all: float = 0.0
    pipeline: float = 0.0
    overhead: float = 0.0
    swap: float = 0.0
    launch: float = 0.0    # the stages' kernel launches on the critical path (CostModel: kernel_launch_s)
    dequant: float = 0.0   # a quantized KV cache's decode of what the stages' attention reads (CostModel's term)
    elementwise: float = 0.0  # the stages' norms, rotary, activation, embedding (CostModel's term)

    @property
    def total(self) -> float:
        return self.linear + self.attention + self.allreduce + self.all_to_all + self.pipeline + self.overhead \
            + self.swap + self.launch + self.dequant + self.elementwise


@dataclass(frozen=True)
class _Stage:
    model: ModelCost
    num_layers: int
    moe_layers: int
    routed_bytes: float      # routed-expert weight bytes one GPU of the stage holds
    first_gpu: int


class ParallelCostModel:
    """Same interface as CostModel (`params`, `predict`, `step_time`) for a TP x PP (+EP) layout."""

    def __init__(self, shape: ModelShape, weight_dtype: str, kv_dtype: str | None, layout: ParallelLayout,
                 params: CostParams, topology: Topology = Topology(), block_size: int = 16) -> None:
        if layout.dp > 1:
            raise ValueError("data_parallel_size: ParallelCostModel prices one engine core; -dp N is N cores "
                             "(sim/data_parallel.py, DPExpertParallelCost for DP + EP)")
        if layout.expert_parallel and not shape.is_moe:
            raise ValueError("enable_expert_parallel: the model has no experts")
        self.shape, self.layout, self.topology, self.params = shape, layout, topology, params
        self.block_size = block_size
        tp = layout.tp
        self.act_bytes = 4 if dtype_bytes(weight_dtype) == 4 else 2
        # the per-rank roofline without communication: this module adds that itself
        self.inner = CostModel(ModelCost.from_shape(shape, weight_dtype, kv_dtype, tp),
                               replace(params, link_bandwidth=0.0, allreduce_latency_s=0.0, allreduce_busbw=[]),
                               block_size)
        self.model = self.inner.model
        self.stages: list[_Stage] = []
        first_layer = 0
        counts = stage_layer_counts(shape.num_layers, layout.pp)
        for s, n in enumerate(counts):
            dense = max(0, min(n, shape.first_dense_layers - first_layer)) if shape.is_moe else n
            stage_shape = replace(shape, num_layers=n, first_dense_layers=dense if shape.is_moe else 0)
            model = ModelCost.from_shape(stage_shape, weight_dtype, kv_dtype, tp)
            if s < len(counts) - 1:  # only the last stage runs the LM head
                w = dtype_bytes(weight_dtype)
                model = replace(model, lm_head_params_per_rank=0.0,
                                weight_bytes_per_rank=model.weight_bytes_per_rank - model.lm_head_params_per_rank * w)
            # the once-per-step kernels: the embedding on the first stage, the final norm, LM head and sampler on
            # the last
            first, last = s == 0, s == len(counts) - 1
            once = (KERNELS_FIRST_STAGE if first else 0) + (KERNELS_LAST_STAGE if last else 0)
            model = replace(model, kernels_per_step=model.kernels_per_step - KERNELS_PER_STEP_FIXED + once,
                            gemm_kernels_per_step=gemm_kernel_count(stage_shape, last_stage=last),
                            elementwise_kernels=elementwise_kernels(stage_shape, tp, model.act_bytes, first, last))
            moe_layers = n - dense if shape.is_moe else 0
            expert = 3 * shape.hidden_size * shape.moe_intermediate_size * dtype_bytes(weight_dtype)
            per_gpu = (math.ceil(shape.num_experts / layout.ep) if layout.ep > 1 else shape.num_experts / tp)
            self.stages.append(_Stage(model, n, moe_layers, moe_layers * per_gpu * expert, s * tp))
            first_layer += n
        # swaps run on every stage at once: the stage with the most layers (KV per token) sets their time
        self._swap_model = max(self.stages, key=lambda st: st.num_layers).model
        link = params.link_bandwidth * params.link_efficiency
        self._inv_intra = 1.0 / link if link > 0 else 0.0
        self._inv_inter = 1.0 / (topology.inter_node_gbps * 1e9 * params.link_efficiency)

    # -- terms ------------------------------------------------------------------------------
    def _inv_link(self, first_gpu: int, count: int) -> float:
        return self._inv_inter if self.topology.spans_nodes(first_gpu, count) else self._inv_intra

    def _allreduce(self, stage: _Stage, tokens: int) -> float:
        tp = self.layout.tp
        if tp == 1 or tokens == 0:
            return 0.0
        per_layer = 2 * stage.num_layers - (stage.moe_layers if self.layout.expert_parallel else 0)
        data = tokens * self.shape.hidden_size * self.act_bytes
        if self.topology.spans_nodes(stage.first_gpu, tp):  # across nodes: the one-node curve does not apply
            return per_layer * (2 * (tp - 1) / tp * data * self._inv_inter + self.params.allreduce_latency_s)
        return per_layer * allreduce_seconds(self.params, tp, data, self._inv_intra)

    def _all_to_all(self, stage: _Stage, tokens: int) -> float:
        ep = self.layout.ep
        if ep == 1 or stage.moe_layers == 0 or tokens == 0:
            return 0.0
        sent = tokens / ep * self.shape.num_experts_per_tok * self.shape.hidden_size * self.act_bytes
        # GPUs of the EP group on this GPU's node (the group starts at a stage boundary)
        same_node = min(ep, self.topology.gpus_per_node - stage.first_gpu % self.topology.gpus_per_node)
        intra = sent * (same_node - 1) / ep * self._inv_intra
        inter = sent * (ep - same_node) / ep * self._inv_inter
        return stage.moe_layers * 2 * (max(intra, inter) + self.params.allreduce_latency_s)

    def _expert_bytes_not_read(self, stage: _Stage, tokens: int) -> float:
        if not stage.moe_layers:
            return 0.0
        touched = 1.0 - (1.0 - self.shape.num_experts_per_tok / self.shape.num_experts) ** tokens
        return (1.0 - touched) * stage.routed_bytes

    def _stage_time(self, stage: _Stage, new: Sequence[int], ctx: Sequence[int]) -> ParallelStepTime:
        f = step_features(stage.model, new, ctx, 0, self.block_size)
        f.linear_bytes -= self._expert_bytes_not_read(stage, f.num_tokens)
        t = self.inner.breakdown(f, stage.model)  # the stage's own kernels, not the whole model's
        return ParallelStepTime(linear=t.linear, attention=t.attention, allreduce=self._allreduce(stage, f.num_tokens),
                                all_to_all=self._all_to_all(stage, f.num_tokens), launch=t.launch, dequant=t.dequant,
                                elementwise=t.elementwise)

    def _send(self, stage: _Stage, tokens: int) -> float:
        """Activations from `stage` to the next one (each TP rank sends the full hidden)."""
        data = tokens * self.shape.hidden_size * self.act_bytes
        crosses = self.topology.node_of(stage.first_gpu + self.layout.tp - 1) != \
            self.topology.node_of(stage.first_gpu + self.layout.tp)
        return data * (self._inv_inter if crosses else self._inv_intra) + self.params.allreduce_latency_s

    # -- the step ---------------------------------------------------------------------------
    def breakdown(self, new_tokens: Sequence[int], context_lens: Sequence[int],
                  num_swap_blocks: int = 0, num_outputs: int | None = None) -> ParallelStepTime:
        if not new_tokens and not num_swap_blocks:
            return ParallelStepTime()
        # the step's own overheads (once, not per stage) and its swaps
        base = self.inner.breakdown(step_features(self._swap_model, new_tokens, context_lens, num_swap_blocks,
                                                  self.block_size, num_outputs))
        out = ParallelStepTime(overhead=base.overhead, swap=base.swap)
        if not new_tokens:
            return out
        groups = _micro_batches(list(new_tokens), list(context_lens), self.layout.pp)
        # times[g][s]: micro-batch g on stage s
        times = [[self._stage_time(st, new, ctx) for st in self.stages] for new, ctx in groups]
        busiest = max(range(len(self.stages)), key=lambda s: sum(times[g][s].total for g in range(len(groups))))
        for g in range(len(groups)):
            t = times[g][busiest]
            out.linear += t.linear
            out.attention += t.attention
            out.allreduce += t.allreduce
            out.all_to_all += t.all_to_all
            out.launch += t.launch
            out.dequant += t.dequant
            out.elementwise += t.elementwise
        work = sum(times[g][busiest].total for g in range(len(groups)))
        trip = max(sum(t.total for t in times[g]) + sum(self._send(st, sum(groups[g][0]))
                                                          for st in self.stages[:-1])
                   for g in range(len(groups)))
        out.pipeline = max(0.0, trip - work)
        return out

    def predict(self, new_tokens: Sequence[int], context_lens: Sequence[int], num_swap_blocks: int = 0,
                num_outputs: int | None = None) -> float:
        return self.breakdown(new_tokens, context_lens, num_swap_blocks, num_outputs).total

    def step_time(self, out) -> float:
        sched = out.scheduled
        new = [len(r.token_ids) for r in sched]
        ctx = [r.start_pos + n for r, n in zip(sched, new)]
        return self.predict(new, ctx, len(out.blocks_to_swap_out) + len(out.blocks_to_swap_in),
                            sum(1 for r in sched if r.sample))


def _micro_batches(new: list[int], ctx: list[int], pp: int) -> list[tuple[list[int], list[int]]]:
    """Requests in order, cut into min(pp, len) runs of about equal tokens."""
    m = min(pp, len(new))
    if m <= 1:
        return [(new, ctx)]
    target = sum(new) / m
    groups, cur_new, cur_ctx, acc = [], [], [], 0
    for i, (n, c) in enumerate(zip(new, ctx)):
        cur_new.append(n)
        cur_ctx.append(c)
        acc += n
        left_requests, left_groups = len(new) - i - 1, m - len(groups) - 1
        if left_groups and (acc >= target * (len(groups) + 1) or left_requests == left_groups):
            groups.append((cur_new, cur_ctx))
            cur_new, cur_ctx = [], []
    groups.append((cur_new, cur_ctx))
    return [g for g in groups if g[0]]


# -- DP attention + EP: the cores of one server in lockstep ---------------------------------------
@dataclass
class LockstepTurn:
    """One turn of the data-parallel cores under DP attention + EP, priced (seconds): each
    core's own work (`cores[r]`; a core with nothing scheduled runs a dummy pass:
    `dummy[r]`) and the exchange every core takes part in. The turn lasts the slowest
    core's work plus the exchange: every MoE layer waits for every core."""

    cores: list[float]
    dummy: list[bool]
    exchange: float
    token_counts: list[int]

    @property
    def total(self) -> float:
        return max(self.cores, default=0.0) + self.exchange


class DPExpertParallelCost:
    """A step of N data-parallel cores whose MoE layers share the experts (`-dp N
    --enable-expert-parallel`; worker/dp_lockstep.py, model/moe.py `_forward_dp`). Per core
    (TP 1): attention, dense layers, shared experts, router and LM head over its own tokens;
    its ceil(E / N) whole routed experts over every core's tokens routed to them (uniform
    routing: T x k / N token-expert pairs of the turn's T tokens) and only the experts those
    touch read; a core with nothing scheduled runs the MoE layers alone (a dummy pass: no
    tokens of its own, its experts for the others').

    The exchange, per MoE layer (`exchange="all-gather"`, what pagedserve's engine does over
    gloo, model/parallel.py ep_dispatch / ep_combine): an all-gather of the cores' token
    counts, of their tokens (hidden x act bytes each) and of their routing (2 k fp32 each),
    both padded to the largest core's count, then an all-reduce of every token's output
    (T x hidden x act bytes); plus, per turn, the cores' agreement (an all-reduce of 16 bytes).
    `exchange="all-to-all"` prices vLLM's instead (its DP + EP dispatch and combine: each core
    sends its tokens' k copies, (N-1)/N of them off-GPU, each way; the largest core sets it).
    A ring all-gather of D bytes per rank moves (N-1) x D per rank, an all-reduce
    2 (N-1)/N x D; each collective costs `allreduce_latency_s` on top. The link is
    `link_bandwidth x link_efficiency`: on a GPU the preset's NVLink (the NIC past
    `gpus_per_node`), on CPU the calibrated gloo line (benchmarks/parallel_layouts.py fits
    it: all_reduce's per-call and per-byte cost on this machine).
    """

    def __init__(self, shape: ModelShape, weight_dtype: str, kv_dtype: str | None, dp: int, params: CostParams,
                 topology: Topology = Topology(), block_size: int = 16, exchange: str = "all-gather") -> None:
        if not shape.is_moe:
            raise ValueError("enable_expert_parallel: the model has no experts")
        if exchange not in ("all-gather", "all-to-all"):
            raise ValueError(f"exchange: 'all-gather' or 'all-to-all', got {exchange!r}")
        self.shape, self.dp, self.params, self.block_size, self.exchange_kind = shape, dp, params, block_size, exchange
        self.act_bytes = 4 if dtype_bytes(weight_dtype) == 4 else 2
        # one core's roofline without communication (this class adds the exchange)
        self.inner = CostModel(ModelCost.from_shape(shape, weight_dtype, kv_dtype, 1),
                               replace(params, link_bandwidth=0.0, allreduce_latency_s=0.0, allreduce_busbw=[]),
                               block_size)
        self.model = self.inner.model
        self.moe_layers = shape.num_layers - shape.first_dense_layers
        expert = 3 * shape.hidden_size * shape.moe_intermediate_size
        self._routed_active = self.moe_layers * shape.num_experts_per_tok * expert   # params per token
        self.experts_per_core = math.ceil(shape.num_experts / dp)
        held = self.moe_layers * self.experts_per_core * expert * dtype_bytes(weight_dtype)
        self._held_bytes = held
        # ModelCost (TP 1) reads all E experts; a core holds only its share
        self._not_held_bytes = self.moe_layers * (shape.num_experts - self.experts_per_core) * expert \
            * dtype_bytes(weight_dtype)
        link = params.link_bandwidth * params.link_efficiency
        inv_intra = 1.0 / link if link > 0 else 0.0
        inv_inter = 1.0 / (topology.inter_node_gbps * 1e9 * params.link_efficiency)
        self._inv_link = inv_inter if topology.spans_nodes(0, dp) else inv_intra

    def _touched(self, total_tokens: int) -> float:
        return 1.0 - (1.0 - self.shape.num_experts_per_tok / self.shape.num_experts) ** total_tokens

    def core_step(self, new_tokens: Sequence[int], context_lens: Sequence[int], num_swap_blocks: int,
                  num_outputs: int | None, total_tokens: int) -> float:
        """One core's own work in a turn of `total_tokens` (all cores' tokens)."""
        f = step_features(self.model, new_tokens, context_lens, num_swap_blocks, self.block_size, num_outputs)
        if f.num_tokens:
            # its experts compute their share of every core's tokens, not its own tokens' k experts
            f.linear_flops += 2.0 * self._routed_active * (total_tokens / self.dp - f.num_tokens)
            f.linear_bytes -= self._not_held_bytes + (1.0 - self._touched(total_tokens)) * self._held_bytes
        return self.inner.breakdown(f).total

    def dummy_pass(self, total_tokens: int) -> float:
        """A core with no tokens of its own: only the MoE layers, its experts over the others'
        tokens (the GEMM term alone: no attention, no head, no sampling, no step overhead)."""
        if not total_tokens:
            return 0.0
        # num_reqs 1 only so that breakdown prices the work; its linear part is the GEMMs alone
        f = StepFeatures(0, 1, 0, 2.0 * self._routed_active * total_tokens / self.dp,
                         self._touched(total_tokens) * self._held_bytes, 0.0, 0.0, 0.0, 0)
        return self.inner.breakdown(f).linear

    def _all_gather(self, bytes_per_rank: float) -> float:
        return self.params.allreduce_latency_s + (self.dp - 1) * bytes_per_rank * self._inv_link

    def _all_reduce(self, nbytes: float) -> float:
        return self.params.allreduce_latency_s + 2 * (self.dp - 1) / self.dp * nbytes * self._inv_link

    def exchange(self, token_counts: Sequence[int]) -> float:
        """The turn's collectives, every core in them."""
        agree = self._all_reduce(16)
        most, total = max(token_counts, default=0), sum(token_counts)
        if not total:
            return agree
        h, a, k = self.shape.hidden_size, self.act_bytes, self.shape.num_experts_per_tok
        if self.exchange_kind == "all-to-all":
            sent = most * k * h * a * (self.dp - 1) / self.dp
            per_layer = 2 * (self.params.allreduce_latency_s + sent * self._inv_link)
        else:
            per_layer = (self._all_gather(8) + self._all_gather(most * h * a) + self._all_gather(most * 2 * k * 4)
                         + self._all_reduce(total * h * a))
        return agree + self.moe_layers * per_layer

    def turn(self, steps: Sequence[tuple[Sequence[int], Sequence[int], int, int | None] | None]) -> LockstepTurn:
        """`steps[r]`: core r's (new tokens, context lengths, swap blocks, outputs), or None
        (no work: a dummy pass)."""
        counts = [sum(s[0]) if s is not None else 0 for s in steps]
        total = sum(counts)
        cores, dummy = [], []
        for s, n in zip(steps, counts):
            if n:
                cores.append(self.core_step(s[0], s[1], s[2], s[3], total))
            else:  # nothing scheduled (a swap alone, at most): the MoE layers run for the others
                swap = self.core_step([], [], s[2], 0, total) if s is not None and s[2] else 0.0
                cores.append(swap + self.dummy_pass(total))
            dummy.append(not n)
        return LockstepTurn(cores, dummy, self.exchange(counts), counts)
