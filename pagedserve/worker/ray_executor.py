"""RayExecutor: the tensor-parallel ranks as Ray actors in one placement group, which is
how a model spans machines. Each actor holds the same Worker as an mp rank
(worker/worker.py); the group is torch.distributed over TCP to rank 0's node (gloo on CPU,
NCCL on CUDA).

    execute(out): encode ExecuteMsg(out) once, call every actor's `handle` with the same bytes
                  (Ray ships them once per node), take rank 0's StepResult

Ray is an optional extra (pip install -e ".[ray]"). The executor joins the Ray instance
the process is already connected to, or RAY_ADDRESS (e.g. a cluster started with
`ray start --head`), or starts a local one. A dead actor makes the step raise WorkerDied
naming the rank.
"""
from __future__ import annotations

import logging
import os
import time

from pagedserve.config import ResolvedConfig
from pagedserve.core.outputs import StepResult
from pagedserve.core.scheduler import SchedulerOutput
from pagedserve.worker.multiproc_executor import WorkerDied
from pagedserve.worker.worker import (ENCODER, REPLY_DECODER, CallMsg, ExecuteMsg, RankCalls, Worker, WorkerSpec,
                                      driver_rank, free_port)

logger = logging.getLogger("pagedserve.executor")

PLACEMENT_TIMEOUT = 120.0


class RayWorker:
    """The Ray actor around one rank's Worker."""

    def __init__(self, spec: WorkerSpec, rank: int, world_size: int) -> None:
        logging.basicConfig(level=logging.INFO, format=f"%(levelname)s %(asctime)s rank{rank} %(name)s: %(message)s")
        self.worker = Worker(spec, rank, world_size)
        self.device = "cpu" if spec.settings.config.device == "cpu" else "cuda:0"  # Ray sets CUDA_VISIBLE_DEVICES

    def address(self) -> tuple[str, int]:
        import ray
        ip = ray.util.get_node_ip_address()
        return ip, free_port("0.0.0.0")

    def start(self, master_addr: str, master_port: int) -> int:
        self.worker.init_distributed(master_addr, master_port, self.device)
        self.worker.load(self.device)
        return os.getpid()

    def handle(self, payload: bytes) -> bytes | None:
        reply = self.worker.handle(payload)
        return reply if isinstance(reply, bytes) else None


class RayExecutor(RankCalls):
    dp_lockstep = None  # no DP attention + EP lockstep (core/executor.py)

    def __init__(self, settings: ResolvedConfig) -> None:
        config = settings.config
        try:
            import ray
            from ray.util.placement_group import placement_group
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
        except ImportError:
            raise ValueError('distributed_executor_backend: ray is not installed; pip install -e ".[ray]"') from None
        self.tp = config.tensor_parallel_size
        self.world_size = self.tp * config.pipeline_parallel_size  # ranks: pp stages of tp
        self.driver = driver_rank(self.tp, config.pipeline_parallel_size)
        self.broadcast_seconds = 0.0
        self.broadcast_bytes = self.num_broadcasts = 0
        self.rank_kv_bytes: list[int] = []
        if not ray.is_initialized():
            ray.init(address=os.environ.get("RAY_ADDRESS"), include_dashboard=False, log_to_driver=True)
        on_gpu = config.device == "cuda"
        cpus = 1 if on_gpu else max(1, int(ray.available_resources().get("CPU", self.world_size)) // self.world_size)
        bundle = {"CPU": cpus, "GPU": 1} if on_gpu else {"CPU": cpus}
        self.placement_group = placement_group([dict(bundle) for _ in range(self.world_size)], strategy="PACK")
        ready, _ = ray.wait([self.placement_group.ready()], timeout=PLACEMENT_TIMEOUT)
        if not ready:
            ray.util.remove_placement_group(self.placement_group)
            raise ValueError(f"tensor_parallel_size: Ray could not place {self.world_size} ranks of {bundle} within "
                             f"{PLACEMENT_TIMEOUT:.0f} s (cluster resources: {ray.cluster_resources()})")
        spec = WorkerSpec(settings, cpus)
        actor = ray.remote(RayWorker)
        self.actors = [
            actor.options(num_cpus=cpus, num_gpus=1 if on_gpu else 0, name=None,
                          scheduling_strategy=PlacementGroupSchedulingStrategy(
                              placement_group=self.placement_group, placement_group_bundle_index=rank)
                          ).remote(spec, rank, self.world_size)
            for rank in range(self.world_size)]
        try:
            master_addr, master_port = ray.get(self.actors[0].address.remote())
            self.pids: list[int] = self._get([a.start.remote(master_addr, master_port) for a in self.actors])
        except BaseException:
            self.shutdown()
            raise
        logger.info("tensor parallel over Ray: %d actors (pids %s), group at %s:%d", self.world_size, self.pids,
                    master_addr, master_port)

    def _get(self, refs: list) -> list:
        """Every actor's answer, or WorkerDied naming the first rank that failed."""
        import ray
        from ray.exceptions import RayActorError, RayTaskError

        values = []
        for rank, ref in enumerate(refs):
            try:
                values.append(ray.get(ref))
            except RayActorError as e:
                raise WorkerDied(f"tensor-parallel rank {rank} (Ray actor) died: {e}") from None
            except RayTaskError as e:
                raise WorkerDied(f"tensor-parallel rank {rank} failed: {e}") from None
        return values

    def _send(self, msg) -> list:
        t0 = time.perf_counter()
        payload = ENCODER.encode(msg)
        refs = [a.handle.remote(payload) for a in self.actors]
        self.broadcast_seconds += time.perf_counter() - t0
        self.broadcast_bytes += len(payload)
        self.num_broadcasts += 1
        return self._get(refs)

    def _call(self, method: str, *args) -> list:
        return [REPLY_DECODER.decode(b).value for b in self._send(CallMsg(method, list(args)))]

    def execute(self, out: SchedulerOutput) -> StepResult:
        t0 = time.perf_counter()
        replies = self._send(ExecuteMsg(out))
        result = REPLY_DECODER.decode(replies[self.driver]).result
        result.duration = time.perf_counter() - t0
        return result

    def worker_stats(self) -> list[dict]:
        return self._call("stats")

    def check_health(self) -> None:
        pass  # no monitor to ask: a dead actor fails the step's own call as WorkerDied (`_get`)

    def worker_pids(self) -> list[int]:
        return list(self.pids)

    def shutdown(self) -> None:
        import ray

        for a in getattr(self, "actors", []):
            try:
                ray.kill(a)
            except Exception:  # noqa: BLE001 - already gone
                pass
        self.actors = []
        if getattr(self, "placement_group", None) is not None:
            try:
                ray.util.remove_placement_group(self.placement_group)
            except Exception:  # noqa: BLE001
                pass
            self.placement_group = None
