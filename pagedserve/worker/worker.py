"""One rank (a tensor-parallel shard of one pipeline stage): a ModelRunner holding its
shard, driven by messages.

The engine core's executor (worker/multiproc_executor.py: one process per rank;
worker/ray_executor.py: one Ray actor per rank) encodes each message once and hands the
same bytes to every rank:

    ExecuteMsg(SchedulerOutput)   every rank applies the same diff and runs the same forward
                                  (the collectives keep them in step; pipeline stages pass
                                  activations on); the driver rank alone replies, with the
                                  StepResult: rank 0, or under pipeline parallelism the
                                  last stage's first rank (the one that samples)
    CallMsg(method, args)         start-up and measurements (profile, allocate the pool,
                                  stats); every rank replies
    ShutdownMsg                   leave the loop

A rank that fails replies with an error naming itself and exits: its peers then fail in
their next collective, and the executor reports the first failure. Messages are msgspec
(SchedulerOutput is a Struct of plain data), so a step's broadcast costs what its diff
holds: new requests' prompts once, then a few ids per scheduled request.
"""
from __future__ import annotations

import ctypes
import logging
import os
import signal
import socket
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import msgspec

from pagedserve.config import ResolvedConfig
from pagedserve.core.outputs import StepResult
from pagedserve.core.scheduler import SchedulerOutput
from pagedserve.utils import freeze_startup_heap

logger = logging.getLogger("pagedserve.worker")

# A collective waiting this long on a peer means the group is broken (a peer died without
# its socket closing). The executor notices a dead process much sooner, by its sentinel.
COLLECTIVE_TIMEOUT = timedelta(seconds=120)


class ExecuteMsg(msgspec.Struct, tag="execute", array_like=True):
    out: SchedulerOutput


class CallMsg(msgspec.Struct, tag="call", array_like=True):
    method: str
    args: list[Any] = []


class ShutdownMsg(msgspec.Struct, tag="shutdown", array_like=True):
    pass


class Reply(msgspec.Struct, array_like=True):
    value: Any = None
    result: StepResult | None = None
    error: str | None = None


WorkerMsg = ExecuteMsg | CallMsg | ShutdownMsg
ENCODER = msgspec.msgpack.Encoder()
MSG_DECODER = msgspec.msgpack.Decoder(WorkerMsg)
REPLY_DECODER = msgspec.msgpack.Decoder(Reply)


@dataclass
class WorkerSpec:
    """What every rank is started with (picklable: it crosses spawn and Ray)."""

    settings: ResolvedConfig
    num_threads: int   # torch intra-op threads of this rank (cores / ranks on one machine)


def set_parent_death_signal() -> None:
    """Linux: this process is killed when its parent dies, so a SIGKILLed server leaves no
    orphaned engine or worker behind."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
    except OSError:
        return
    PR_SET_PDEATHSIG = 1
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def driver_rank(tp: int, pp: int) -> int:
    """The rank that samples and replies: TP rank 0 of the last pipeline stage (ranks are
    numbered pp_rank * tp + tp_rank, vLLM's order)."""
    return (pp - 1) * tp


class Worker:
    def __init__(self, spec: WorkerSpec, rank: int, world_size: int) -> None:
        self.spec = spec
        self.rank = rank
        self.world_size = world_size
        self.tp = spec.settings.config.tensor_parallel_size
        self.pp = spec.settings.config.pipeline_parallel_size
        assert world_size == self.tp * self.pp, (world_size, self.tp, self.pp)
        self.tp_rank, self.pp_rank = rank % self.tp, rank // self.tp
        self.is_driver = rank == driver_rank(self.tp, self.pp)
        self.runner = None
        self.decode_seconds = 0.0
        self.execute_seconds = 0.0
        self.num_steps = 0

    def init_distributed(self, master_addr: str, master_port: int, device: str) -> None:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(self.spec.num_threads)
        backend = "nccl" if device.startswith("cuda") else "gloo"
        if device.startswith("cuda"):
            torch.cuda.set_device(torch.device(device))
        dist.init_process_group(backend, init_method=f"tcp://{master_addr}:{master_port}", rank=self.rank,
                                world_size=self.world_size, timeout=COLLECTIVE_TIMEOUT)

    def load(self, device: str) -> None:
        from pagedserve.worker.model_runner import ModelRunner

        self.runner = ModelRunner.for_rank(self.spec.settings, device, self.rank)

    def stats(self) -> dict:
        """Step counts and times; with a comm observer installed (`set_comm_observer`) also
        its communication by kind (`comm`) and the totals benchmarks/scaleout.py and
        pipeline_parallel.py print."""
        from pagedserve.model.parallel import comm_observer

        out = {"rank": self.rank, "pid": os.getpid(), "pp_rank": self.pp_rank, "tp_rank": self.tp_rank,
               "decode_seconds": self.decode_seconds, "execute_seconds": self.execute_seconds,
               "num_steps": self.num_steps, "pp_micro_batches": self.runner.num_micro_batches, "comm": None}
        observer = comm_observer()
        if observer is not None:
            comm = observer.summary()
            part = lambda kind, field: comm.get(kind, {}).get(field, 0)  # noqa: E731
            out.update(comm=comm, all_reduce=part("all_reduce", "seconds") + part("moe_combine", "seconds"),
                       gather=part("gather", "seconds"),
                       calls=sum(part(k, "calls") for k in ("all_reduce", "moe_combine", "gather")),
                       pp_send=part("pp_send", "seconds"), pp_recv=part("pp_recv", "seconds"),
                       pp_calls=part("pp_send", "calls") + part("pp_recv", "calls"), pp_bytes=part("pp_send", "bytes"))
        return out

    def reset_stats(self) -> None:
        from pagedserve.model.parallel import CommObserver, comm_observer, set_comm_observer
        self.decode_seconds = self.execute_seconds = 0.0
        self.num_steps = 0
        self.runner.num_micro_batches = 0
        if comm_observer() is not None:
            set_comm_observer(CommObserver())

    def set_comm_observer(self, enabled: bool) -> None:
        """Time this rank's collectives and sends from now on (a fresh CommObserver), or stop
        (None: the collectives run without a clock read)."""
        from pagedserve.model.parallel import CommObserver, set_comm_observer
        set_comm_observer(CommObserver() if enabled else None)

    def handle(self, payload: bytes) -> bytes | None | ShutdownMsg:
        """One message in; the reply's bytes (None: nothing to reply). Raises on failure."""
        t0 = time.perf_counter()
        msg = MSG_DECODER.decode(payload)
        t1 = time.perf_counter()
        if isinstance(msg, ExecuteMsg):
            self.decode_seconds += t1 - t0
            result = self.runner.execute(msg.out)
            self.execute_seconds += time.perf_counter() - t1
            self.num_steps += 1
            return ENCODER.encode(Reply(result=result)) if self.is_driver else None
        if isinstance(msg, CallMsg):
            target = getattr(self, msg.method, None)
            if target is None:
                target = getattr(self.runner, msg.method)
            value = target(*msg.args) if callable(target) else target
            return ENCODER.encode(Reply(value=value))
        return msg


def run_worker_process(spec: WorkerSpec, rank: int, world_size: int, master_port: int, cmd_conn, reply_conn) -> None:
    """The body of one mp rank: connect the group, load the shard, then serve messages
    until ShutdownMsg, a closed pipe (the engine is gone) or an error (reported, exit 1)."""
    set_parent_death_signal()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group; the server shuts us down
    logging.basicConfig(level=logging.INFO, format=f"%(levelname)s %(asctime)s rank{rank} %(name)s: %(message)s")
    config = spec.settings.config
    device = config.device if config.device == "cpu" else f"cuda:{rank}"
    worker = Worker(spec, rank, world_size)
    try:
        worker.init_distributed("127.0.0.1", master_port, device)
        worker.load(device)
        freeze_startup_heap(f"rank {rank}")  # this process lives and dies with its engine
        reply_conn.send_bytes(ENCODER.encode(Reply(value=os.getpid())))
        while True:
            reply = worker.handle(cmd_conn.recv_bytes())
            if isinstance(reply, ShutdownMsg):
                break
            if reply is not None:
                reply_conn.send_bytes(reply)
    except EOFError:  # the executor closed the pipe: the engine is gone
        os._exit(0)
    except BaseException as e:  # noqa: BLE001 - report who failed, then die at once (peers may be gone)
        logger.exception("rank %d failed", rank)
        try:
            reply_conn.send_bytes(ENCODER.encode(Reply(error=f"rank {rank} (pid {os.getpid()}): "
                                                               f"{type(e).__name__}: {e}")))
        except OSError:
            pass
        os._exit(1)
    # Leave at once: the group dies with its processes, and a clean teardown of torch under
    # load took seconds per rank for nothing.
    logging.shutdown()
    os._exit(0)


class RankCalls:
    """The Executor protocol's set-up calls for executors whose ranks answer `_call(method,
    *args) -> [one value per rank]`: the pool fits the tightest rank, profiling takes the
    slowest; each rank's KV bytes are kept for the start-up log and the tests."""

    rank_kv_bytes: list[int]

    def _call(self, method: str, *args) -> list:
        raise NotImplementedError

    def profile_kv_budget(self, gpu_memory_utilization: float, max_num_batched_tokens: int,
                          max_num_seqs: int) -> int:
        """The budget, as one rank of the stage with the most layers (the one the engine sizes
        the pool by), that gives the fewest blocks any rank can hold: pipeline stages' budgets
        differ (embedding, head) and so do their bytes per block (their layers)."""
        budgets = self._call("profile_kv_budget", gpu_memory_utilization, max_num_batched_tokens, max_num_seqs)
        layers = self._call("num_stage_layers")
        most = max(layers)
        return min(budget * most // n for budget, n in zip(budgets, layers))

    def initialize_cache(self, num_blocks: int, num_host_blocks: int) -> None:
        self._call("initialize_cache", num_blocks, num_host_blocks)
        self.rank_kv_bytes = self._call("kv_cache_bytes")

    def measure_host_bandwidth(self) -> float:
        return min(self._call("measure_host_bandwidth"))

    def open_disk_tier(self, path: str, num_slots: int) -> None:
        self._call("open_disk_tier", path, num_slots)

    def sync_disk_tier(self) -> None:
        self._call("sync_disk_tier")

    def set_comm_observer(self, enabled: bool = True) -> None:
        """Have every rank time its collectives and sends (Worker.set_comm_observer); stats() then
        report them. Off by default: benchmarks turn it on."""
        self._call("set_comm_observer", enabled)

    def profile_prefill(self, num_tokens: int) -> float:
        return max(self._call("profile_prefill", num_tokens))
