"""MultiprocExecutor: one worker process per rank, tensor_parallel_size x
pipeline_parallel_size of them (torch.multiprocessing, spawn), joined in one
torch.distributed group (gloo on CPU, NCCL on CUDA).

    engine core (scheduler, once)                 rank 0 .. rank N-1 (worker/worker.py)
    execute(out): encode ExecuteMsg(out) once ──▶ the same bytes down each rank's pipe
                  wait: the driver's reply pipe,   every rank: apply diff, forward (collectives,
                  every rank's error pipe and        pipeline sends between stages)
                  every process's sentinel      ◀─ the driver (rank 0; under pp the last
                                                   stage's first rank): Reply(StepResult)

The broadcast is the SchedulerOutput itself, which is already a diff (a request's prompt
and parameters once, then per-step tokens and new block ids), so its bytes track the step,
not the requests' histories. Its cost is kept in `broadcast_seconds` / `broadcast_bytes`.

Faults: a rank that dies (its process sentinel fires) or reports an error makes the step
raise WorkerDied naming the rank and pid, at once; a monitor thread notices a death between
steps too (`check_health`). The engine then treats the step as fatal. shutdown() asks every
rank to leave, then terminates and kills whatever is still alive: no rank outlives it.

Starting ranks: always "spawn" (a fresh interpreter per rank), never "fork": the parent has
torch's OpenMP pool and, in a server, the event loop's and the engine's threads, and a fork
of a threaded process can hang on a lock some other thread held. Spawn imports the user's
main module again in every rank, so a script that builds its LLM at module level without
`if __name__ == "__main__":` would build it again there; a rank notices that (it is still
bootstrapping) and leaves with UNGUARDED_MAIN_EXIT, and the parent raises UnguardedMainError,
one line naming the fix, in place of multiprocessing's traceback in each rank and a bare
"rank 0 died: exit code 1".
"""
from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import sys
import threading
import time
from multiprocessing.connection import wait

from pagedserve.config import ResolvedConfig
from pagedserve.core.outputs import StepResult
from pagedserve.core.scheduler import SchedulerOutput
from pagedserve.worker.worker import (ENCODER, REPLY_DECODER, CallMsg, ExecuteMsg, RankCalls, Reply, ShutdownMsg,
                                      WorkerSpec, driver_rank, free_port, run_worker_process)

logger = logging.getLogger("pagedserve.executor")

START_TIMEOUT = 900.0   # seconds for every rank to load its shard


class WorkerDied(RuntimeError):
    """A tensor-parallel rank is gone or failed; the message names it."""


class UnguardedMainError(WorkerDied):
    """The script that builds a tensor-parallel engine has no `if __name__ == "__main__":`."""


# A rank's exit status meaning "I was started while importing the script's main module, and
# that import tried to start ranks of its own": the script lacks its __main__ guard.
UNGUARDED_MAIN_EXIT = 83


def leave_if_spawned_from_unguarded_main() -> None:
    """In a process multiprocessing is still bootstrapping (it sets `_inheriting` while it
    imports the parent's main module; its own check before starting a process reads the same
    flag), building ranks means the main module does so at import time. Leave quietly with
    UNGUARDED_MAIN_EXIT: the parent explains, once, instead of a traceback per rank."""
    if getattr(multiprocessing.current_process(), "_inheriting", False):
        raise SystemExit(UNGUARDED_MAIN_EXIT)


def unguarded_main_message(tp: int) -> str:
    main = sys.modules.get("__main__")
    script = getattr(main, "__file__", None) or "the main module"
    return (f"tensor_parallel_size={tp} starts its ranks with multiprocessing 'spawn', which imports "
            f"{script} again in each rank, and that import builds the engine again: put the code that "
            f"builds LLM(...) under `if __name__ == \"__main__\":`")


def describe_exit(exitcode: int | None) -> str:
    if exitcode is None:
        return "still running"
    if exitcode < 0:
        try:
            return f"killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"killed by signal {-exitcode}"
    return f"exit code {exitcode}"


def threads_per_rank(tp: int) -> int:
    """Ranks on one machine share its cores: each gets its share as torch threads, unless
    the operator set OMP_NUM_THREADS, which every rank then takes as it is."""
    explicit = os.environ.get("OMP_NUM_THREADS", "")
    return int(explicit) if explicit.isdigit() and int(explicit) > 0 else max(1, (os.cpu_count() or 1) // tp)


class _Rank:
    def __init__(self, rank: int, process, cmd, reply) -> None:
        self.rank = rank
        self.process = process
        self.cmd = cmd      # parent -> rank
        self.reply = reply  # rank -> parent

    def describe(self) -> str:
        return f"rank {self.rank} (pid {self.process.pid})"

    def killed(self) -> bool:
        """Ended by a signal (SIGKILL, the OOM killer, a crash): not the rank's own reaction."""
        return (self.process.exitcode or 0) < 0


class MultiprocExecutor(RankCalls):
    dp_lockstep = None  # no DP attention + EP lockstep (core/executor.py)

    def __init__(self, settings: ResolvedConfig) -> None:
        import torch.multiprocessing as tmp

        leave_if_spawned_from_unguarded_main()
        config = settings.config
        self.tp = config.tensor_parallel_size
        self.pp = config.pipeline_parallel_size
        self.world_size = self.tp * self.pp
        self.driver = driver_rank(self.tp, self.pp)
        self.broadcast_seconds = 0.0
        self.broadcast_bytes = 0
        self.num_broadcasts = 0
        self.rank_kv_bytes: list[int] = []
        self._failure: WorkerDied | None = None
        self._deaths: list[_Rank] = []  # in the order they were seen: the first is the cause
        self._reap_lock = threading.Lock()
        self._closing = False
        spec = WorkerSpec(settings, threads_per_rank(self.world_size))
        ctx = tmp.get_context("spawn")
        port = free_port()
        self.ranks: list[_Rank] = []
        for rank in range(self.world_size):
            cmd_r, cmd_w = ctx.Pipe(duplex=False)
            reply_r, reply_w = ctx.Pipe(duplex=False)
            process = ctx.Process(target=run_worker_process, args=(spec, rank, self.world_size, port, cmd_r, reply_w),
                                  name=f"pagedserve-tp{rank}", daemon=True)
            process.start()
            cmd_r.close()
            reply_w.close()
            self.ranks.append(_Rank(rank, process, cmd_w, reply_r))
        try:
            pids = self._collect(self.ranks, START_TIMEOUT)
        except BaseException:
            self.shutdown()
            raise
        logger.info("tensor parallel: %d ranks (pids %s), %d torch threads each%s", self.world_size,
                    ", ".join(str(p.value) for p in pids), spec.num_threads,
                    f"; {self.pp} pipeline stages of {self.tp}" if self.pp > 1 else "")
        self._monitor = threading.Thread(target=self._watch, name="pagedserve-tp-monitor", daemon=True)
        self._monitor.start()

    # -- messages ---------------------------------------------------------------------
    def _broadcast(self, msg) -> None:
        self.check_health()
        t0 = time.perf_counter()
        payload = ENCODER.encode(msg)
        try:
            for r in self.ranks:
                r.cmd.send_bytes(payload)
        except (BrokenPipeError, ConnectionResetError, OSError):
            self._raise_dead()
        self.broadcast_seconds += time.perf_counter() - t0
        self.broadcast_bytes += len(payload)
        self.num_broadcasts += 1

    def _collect(self, ranks: list[_Rank], timeout: float | None = None) -> list[Reply]:
        """One reply from each of `ranks`, watching every rank for death or error meanwhile."""
        pending = {r.reply: r for r in ranks}
        replies: dict[int, Reply] = {}
        deadline = None if timeout is None else time.monotonic() + timeout
        watched = {r.reply: r for r in self.ranks}
        sentinels = {r.process.sentinel: r for r in self.ranks}
        while pending:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready = wait(list(watched) + list(sentinels), left)
            if not ready and deadline is not None:
                raise WorkerDied(f"tensor-parallel ranks {[r.rank for r in pending.values()]} did not answer "
                                 f"within {timeout:.0f} s")
            for obj in ready:
                if obj in watched:
                    rank = watched[obj]
                    try:
                        reply = REPLY_DECODER.decode(obj.recv_bytes())
                    except (EOFError, OSError):
                        continue  # its sentinel says why
                    if reply.error is not None:
                        self._fail_with_reply_error(reply.error)
                    if obj not in pending:
                        self._fail(WorkerDied(f"tensor-parallel {rank.describe()} replied out of turn"))
                    replies[rank.rank] = reply
                    del pending[obj]
            fired = [sentinels[obj] for obj in ready if obj in sentinels]
            if fired and not self._closing:
                self._raise_dead(fired)
        return [replies[r.rank] for r in ranks]

    def _call(self, method: str, *args) -> list:
        self._broadcast(CallMsg(method, list(args)))
        return [reply.value for reply in self._collect(self.ranks)]

    # -- faults -----------------------------------------------------------------------
    def _fail(self, error: WorkerDied) -> None:
        if self._failure is None:
            self._failure = error
            logger.error("%s", error)
        raise self._failure

    def _dead_ranks(self, first_seen: list[_Rank] = ()) -> list[_Rank]:
        """The dead ranks, first-seen first: a peer of a dead rank often dies of it (gloo:
        "connection reset by peer") within the same moment, and listing by rank number would
        name that echo as the cause. `first_seen`: ranks whose sentinels have just fired."""
        # One reaper at a time: the monitor thread and the step both come here, and two threads
        # in waitpid on one pid race: the loser gets ECHILD, which multiprocessing reads as
        # "still alive", and the dead rank goes unnamed.
        with self._reap_lock:
            self._note_deaths(first_seen)
            self._note_deaths([r for r in self.ranks if r.process.sentinel in wait([r.process.sentinel
                                                                                      for r in self.ranks], 0)])
            for r in self.ranks:
                r.process.join(0.5)  # let a dying process finish dying, so its exit code is known
            self._note_deaths([r for r in self.ranks if not r.process.is_alive()])
            return list(self._deaths)

    def _note_deaths(self, ranks: list[_Rank]) -> None:
        """Add newly seen deaths; of those seen at once, one killed by a signal comes first."""
        new = [r for r in ranks if r not in self._deaths]
        for r in new:
            r.process.join(0.5)  # its exit code, to tell a kill from an exit
        self._deaths += sorted(new, key=lambda r: (not r.killed(), r.rank))

    @staticmethod
    def _death_message(dead: list[_Rank]) -> str:
        """The first death is the cause; the rest come after it, as what followed."""
        cause, *after = dead
        message = f"tensor-parallel {cause.describe()} died: {describe_exit(cause.process.exitcode)}"
        if after:
            followers = "; ".join(f"{r.describe()}: {describe_exit(r.process.exitcode)}" for r in after)
            message += f" (then {followers})"
        return message

    def _raise_dead(self, first_seen: list[_Rank] = ()) -> None:
        dead = self._dead_ranks(first_seen)
        if any(r.process.exitcode == UNGUARDED_MAIN_EXIT for r in dead):
            raise UnguardedMainError(unguarded_main_message(self.tp))  # a script to fix, not a death to log
        if not dead:
            self._fail(WorkerDied("tensor-parallel: a rank closed its pipe"))
        self._fail(WorkerDied(self._death_message(dead)))

    def _fail_with_reply_error(self, error: str, grace: float = 1.0) -> None:
        """A rank's error is often the echo of a peer's death (gloo: "connection reset by peer"),
        and its reply can arrive before the dead peer's sentinel is seen: wait a moment for the
        sentinels and name the dead rank when there is one, the echo after it."""
        fired = wait([r.process.sentinel for r in self.ranks], grace)
        if fired:
            dead = self._dead_ranks([r for r in self.ranks if r.process.sentinel in fired])
            if dead:
                self._fail(WorkerDied(f"{self._death_message(dead)} (then {error})"))
        self._fail(WorkerDied(f"tensor-parallel {error}"))

    def _watch(self) -> None:
        fired = wait([r.process.sentinel for r in self.ranks])
        if self._closing:
            return
        try:
            self._raise_dead([r for r in self.ranks if r.process.sentinel in fired])
        except WorkerDied:
            pass

    def check_health(self) -> None:
        """Raise WorkerDied if any rank has died (cheap: the monitor thread keeps the verdict)."""
        if self._failure is not None:
            raise self._failure

    # -- the Executor protocol -----------------------------------------------------------
    def execute(self, out: SchedulerOutput) -> StepResult:
        t0 = time.perf_counter()
        self._broadcast(ExecuteMsg(out))
        result = self._collect([self.ranks[self.driver]])[0].result
        result.duration = time.perf_counter() - t0
        return result

    def worker_stats(self) -> list[dict]:
        return self._call("stats")

    def reset_stats(self) -> None:
        self._call("reset_stats")
        self.broadcast_seconds = 0.0
        self.broadcast_bytes = self.num_broadcasts = 0

    def worker_pids(self) -> list[int]:
        return [r.process.pid for r in self.ranks]

    def shutdown(self, timeout: float = 10.0) -> None:
        if self._closing:
            return
        self._closing = True
        payload = ENCODER.encode(ShutdownMsg())
        for r in self.ranks:
            try:
                r.cmd.send_bytes(payload)
            except OSError:
                pass
        deadline = time.monotonic() + timeout
        for r in self.ranks:
            r.process.join(max(0.0, deadline - time.monotonic()))
        for r in self.ranks:
            if r.process.is_alive():
                r.process.terminate()
                r.process.join(2)
            if r.process.is_alive():
                r.process.kill()
                r.process.join(2)
            r.cmd.close()
            r.reply.close()
