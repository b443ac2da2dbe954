"""Data parallelism inside one server (vLLM's -dp): N engine cores, each in its own process
with its own scheduler and KV pool, behind one CoreClient that AsyncLLM drives as it drives
one core.

    AsyncLLM ── DPCoreClient ──┬─ ProcessCoreClient ─ engine-core process, data-parallel rank 0
                place, route    ├─ ProcessCoreClient ─ engine-core process, data-parallel rank 1
                aborts, merge   └─ ...

- Placement (core/dp_balance.py, the rule `simulate -dp` calls too): each request (the samples of one prompt together) goes to
  the core with the least 4 x waiting + running (vLLM's DP load-balancing score; waiting
  counts the requests sent to it that it has not taken in yet, so a burst spreads at once);
  a tie goes to the core holding more of the prompt's leading blocks (`PrefixRecord`: the
  block hashes of the prompts placed on each core, bounded by its pool), then to the one
  with the lower KV-cache usage, then to the lower rank.
- Aborts and stop-string finishes go to the core that owns the request.
- Outputs: every core's steps reach AsyncLLM as they come; each step's stats carry this
  step's counts from its core and the queue and pool state summed over all cores (the
  unlabelled gauges are the sums), and each core's own state goes to the
  `dp_engine_*{engine="<rank>"}` gauges.
- Faults: the cores serve one API, so one core's death is the engine's (as in vLLM): the
  first core to die is reported (naming its rank), every request in flight ends with an
  error, /health turns 503.
- DP attention + EP (--enable-expert-parallel on an MoE model): the cores also form one
  gloo process group, in which their MoE layers exchange tokens (model/moe.py); its
  rendezvous port is chosen here, before any core starts.
"""
from __future__ import annotations

import logging
import socket
import threading
from typing import Callable

import msgspec

from pagedserve.core.dp_balance import (DPBalancer, EngineLoad, PrefixRecord,  # noqa: F401  (re-exported)
                                        WAITING_WEIGHT, choose_engine)
from pagedserve.core.outputs import EngineCoreOutputs, SchedulerStats
from pagedserve.core.request import Request, RequestStatus
from pagedserve.engine.core_client import EngineCoreDied, ProcessCoreClient
from pagedserve.engine.core_wire import PoolLayout

logger = logging.getLogger("pagedserve.server")

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class DPCoreClient:
    """N engine-core processes behind the CoreClient protocol (engine/core_client.py)."""

    def __init__(self, settings, start_timeout: float = 900.0) -> None:
        """`settings`: the front-end's ResolvedConfig; each core gets it with its own rank."""
        config = settings.config
        self.engine_core = None
        self.size = config.data_parallel_size
        self.metrics = None  # EngineMetrics, for the per-engine gauges (set by the server)
        port = free_port() if config.enable_expert_parallel else 0
        self.clients: list[ProcessCoreClient] = []
        try:
            for rank in range(self.size):  # all started before any is waited for: under EP they meet while starting
                trace = f"{config.step_trace_path}.dp{rank}" if config.step_trace_path else None  # one file per core
                rank_settings = settings.with_knobs(data_parallel_rank=rank, data_parallel_master_port=port,
                                                    step_trace_path=trace)
                self.clients.append(ProcessCoreClient(rank_settings, start_timeout, wait=False))
            for client in self.clients:
                client.wait_ready()
        except BaseException:
            for client in self.clients:
                client.shutdown(5.0)
            raise
        self._lock = threading.Lock()
        self._owner: dict[str, int] = {}
        self._state: list[SchedulerStats] = [c.initial_snapshot().stats for c in self.clients]
        self._balancer = DPBalancer(self.clients[0].pool_layout().block_size,
                                    [c.pool_layout().num_blocks for c in self.clients])
        self._post: Callable[[object], None] | None = None
        self._dead = False
        logger.info("%d data-parallel engine cores: pids %s%s", self.size, [c.process.pid for c in self.clients],
                    " (DP attention + EP: the experts are spread over them)" if port else "")

    # -- what AsyncLLM reads --------------------------------------------------------------
    @property
    def num_pending_adds(self) -> int:
        return sum(c.num_pending_adds for c in self.clients)

    def initial_snapshot(self) -> EngineCoreOutputs:
        return EngineCoreOutputs([], self._merged(SchedulerStats()))

    def pool_layout(self) -> PoolLayout:
        """Rank 0's (every core's pool is sized alike, from the same config)."""
        return self.clients[0].pool_layout()

    def pool_layouts(self) -> list[PoolLayout]:
        return [c.pool_layout() for c in self.clients]

    def describe(self) -> str:
        return f"the {self.size} data-parallel engine cores (pids {[c.process.pid for c in self.clients]})"

    def stall_suspects(self) -> list[dict]:
        out = []
        for rank, client in enumerate(self.clients):
            for suspect in client.stall_suspects():
                out.append({**suspect, "who": f"data-parallel engine {rank}: {suspect['who']}"})
        return out

    def is_alive(self) -> bool:
        return all(c.is_alive() for c in self.clients)

    def death_reason(self) -> str | None:
        for rank, client in enumerate(self.clients):
            if (reason := client.death_reason()) is not None:
                return f"data-parallel engine {rank}: {reason}"
        return None

    # -- life cycle -------------------------------------------------------------------------
    def start(self, post: Callable[[object], None]) -> None:
        self._post = post
        for rank, client in enumerate(self.clients):
            client.start(lambda item, rank=rank: self._on_item(rank, item))

    def shutdown(self, timeout: float = 15.0) -> None:
        for client in self.clients:
            client.shutdown(timeout)

    # -- requests in ----------------------------------------------------------------------------
    def add_requests(self, requests: list[Request]) -> None:
        by_rank: dict[int, list[Request]] = {}
        with self._lock:
            for group in _prompt_groups(requests):
                rank = self._place(group)
                by_rank.setdefault(rank, []).extend(group)
                for req in group:
                    self._owner[req.request_id] = rank
        for rank, batch in by_rank.items():
            self.clients[rank].add_requests(batch)

    @property
    def num_placed(self) -> list[int]:
        """Requests (prompts) placed on each core so far."""
        return self._balancer.num_placed

    def _place(self, group: list[Request]) -> int:
        loads = [EngineLoad.of(s, c.num_pending_adds) for c, s in zip(self.clients, self._state)]
        return self._balancer.place(group[0].prompt_token_ids, loads)

    def finish_requests(self, request_ids: list[str], status: RequestStatus, stop_reason=None) -> None:
        by_rank: dict[int, list[str]] = {}
        with self._lock:
            for request_id in request_ids:
                rank = self._owner.pop(request_id, None)
                if rank is not None:
                    by_rank.setdefault(rank, []).append(request_id)
        for rank, ids in by_rank.items():
            self.clients[rank].finish_requests(ids, status, stop_reason)

    def pause(self) -> None:
        for client in self.clients:
            client.pause()

    def resume(self) -> None:
        for client in self.clients:
            client.resume()

    def watch_pool(self, watchers: int, max_rate: float, max_share: float) -> None:
        """The dashboard's pool view shows data-parallel engine 0's pool."""
        self.clients[0].watch_pool(watchers, max_rate, max_share)

    # -- outputs back -------------------------------------------------------------------------
    def _on_item(self, rank: int, item) -> None:
        """From core `rank`'s receiver thread."""
        if isinstance(item, BaseException):
            with self._lock:
                if self._dead:
                    return
                self._dead = True
            self._post(EngineCoreDied(f"data-parallel engine {rank}: {item}"))
            return
        if isinstance(item, EngineCoreOutputs):
            with self._lock:
                self._state[rank] = item.stats
                for out in item.outputs:
                    if out.finished:
                        self._owner.pop(out.request_id, None)
                item.stats = self._merged(item.stats)
                waiting = self.clients[rank].num_pending_adds + self._state[rank].num_waiting
            if self.metrics is not None:
                own = self._state[rank]
                self.metrics.set_engine_state(rank, own.num_running, waiting, own.kv_usage)
        self._post(item)

    def _merged(self, step: SchedulerStats) -> SchedulerStats:
        """This step's counts as they are; the queues and pools summed over the cores."""
        total = lambda name: sum(getattr(s, name) for s in self._state)  # noqa: E731
        used, blocks = total("num_used_blocks"), total("num_total_blocks")
        return msgspec.structs.replace(step, num_running=total("num_running"), num_waiting=total("num_waiting"),
                                       num_swapped=total("num_swapped"), num_used_blocks=used,
                                       num_total_blocks=blocks, num_total_tokens=total("num_total_tokens"),
                                       kv_usage=used / blocks if blocks else 0.0)


def _prompt_groups(requests: list[Request]) -> list[list[Request]]:
    """Consecutive requests with one prompt (the samples of one request) stay together."""
    groups: list[list[Request]] = []
    for req in requests:
        if groups and groups[-1][0].prompt_token_ids == req.prompt_token_ids:
            groups[-1].append(req)
        else:
            groups.append([req])
    return groups
