"""Many pagedserve replicas behind one OpenAI endpoint, as a Ray Serve application.

```
 client ──HTTP──► Ray Serve proxy ──► FleetIngress (tokenizes the prompt for the router only)
                                          │ DeploymentHandle, stream=True
                                          ▼ FleetRequestRouter (Ray's RequestRouter; fleet/routing.py policy)
                        EngineReplica × N: the whole pagedserve server (AsyncLLM + OpenAI app) on
                        127.0.0.1 of its node; KV events (vLLM format, ZMQ PUB + replay) to the router
```

- Ray places, health-checks and restarts the replicas; nothing here manages processes.
- The router runs in the caller's process (the ingress replica); it subscribes to each replica's
  KV-event stream (replaying what it missed) and forgets a replica on its death or on
  `AllBlocksCleared`. The token ids the ingress computes only steer the router: each replica
  parses and tokenizes the request itself, so a routing guess can cost speed, never output.
- A request is forwarded as its raw body and its response streamed back chunk by chunk, so
  every endpoint, field, error and SSE frame is the single server's. A client that disconnects
  cancels the handle call, which closes the replica's loopback stream: the engine aborts it.
- A replica that dies before the first byte of a response is retried once on another replica;
  one that dies mid-stream ends that stream with an error event (its tokens cannot be resumed).
- `/metrics`: every replica's exposition (carried by Ray's routing stats) with a `replica` label, plus
  the router's own.
"""
from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path
from typing import Any

from pagedserve.fleet.registry import ENGINE_DEPLOYMENT
from pagedserve.fleet.routing import ROUTERS, make_router

logger = logging.getLogger("pagedserve.fleet")

APP_NAME = "pagedserve"
# Headers a response keeps on its way back (the rest are hop-by-hop or Ray's).
_KEEP_HEADERS = ("content-type", "retry-after", "x-request-id")
ROUTER_METRIC_PREFIX = "pagedserve:router_"


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


# -- the replica ---------------------------------------------------------------------------------
def replica_resources(config, cpus_per_rank: float = 1.0) -> dict:
    """What Ray reserves for one replica (its `ray_actor_options`), or a ValueError naming what a
    replica cannot be.

    A replica's engine may be `-tp`/`-pp`: its ranks run as the replica's own child processes (the
    mp executor, spawned from inside the Ray actor, killed with it: worker.set_parent_death_signal),
    so Ray reserves every rank's share for the one replica: `cpus_per_rank` CPUs per rank on CPU,
    one GPU per rank (and `cpus_per_rank` CPUs for the API and scheduler) on CUDA. Why mp and not
    the Ray executor: the ranks of one tensor-parallel group belong on one node anyway (every
    layer's all-reduce); Ray then places, restarts and scales the replica as one unit; the Ray
    executor would ask for a placement group of its own from inside the replica, on top of the
    CPUs the replica already holds (on a full node it waits out its placement timeout); and a
    step is a pipe write, not a Ray call.

    Not a DP engine: `-dp` runs several engine cores behind one front-end's own balancer, each
    with its own pool, and they would publish their KV events on the one endpoint the replica
    advertises; the fleet's router already is the balancer over cores, so DP is more replicas."""
    if config.data_parallel_size > 1:
        raise ValueError(f"data_parallel_size: a replica is one engine core, got -dp {config.data_parallel_size}; "
                         f"the router balances the replicas as -dp balances cores: run "
                         f"--replicas N x {config.data_parallel_size} replicas without -dp instead")
    if config.distributed_executor_backend == "ray":
        raise ValueError("distributed_executor_backend: a replica runs its ranks as its own processes (mp); "
                         "ray (ranks as Ray actors) is not available inside a replica")
    if not cpus_per_rank > 0:
        raise ValueError(f"cpus_per_replica: must be > 0, got {cpus_per_rank}")
    world = config.tensor_parallel_size * config.pipeline_parallel_size
    if config.device == "cuda":
        return {"num_cpus": cpus_per_rank, "num_gpus": world}
    return {"num_cpus": cpus_per_rank * world}


def rank_threads(world: int, cpus_per_rank: float, current: str | None) -> str | None:
    """OMP_NUM_THREADS for a replica's ranks: the CPUs Ray reserved per rank, or fewer if the
    environment asked for fewer. Ray sets an actor's OMP_NUM_THREADS to all its CPUs, which every
    rank would take (threads_per_rank), oversubscribing them `world` times. None: leave it."""
    if world <= 1:
        return None
    per_rank = max(1, int(cpus_per_rank))
    if current is not None and current.isdigit() and 0 < int(current) < per_rank:
        return current
    return str(per_rank)


class EngineReplica:
    """One pagedserve server (AsyncLLM + the OpenAI app) on a loopback port of its node; a
    `-tp`/`-pp` engine's ranks are its child processes (replica_resources)."""

    def __init__(self, config, server_kwargs: dict | None = None, kv_events: bool = True,
                 advertise_host: str = "127.0.0.1", cpus_per_rank: float = 1.0) -> None:
        from pagedserve.config import KVEventsConfig
        from pagedserve.server.launcher import ServerThread, build_server

        threads = rank_threads(config.tensor_parallel_size * config.pipeline_parallel_size, cpus_per_rank,
                               os.environ.get("OMP_NUM_THREADS"))
        if threads is not None:
            os.environ["OMP_NUM_THREADS"] = threads   # the spawned ranks read it (threads_per_rank)

        try:
            from ray import serve
            self.replica_id = serve.get_replica_context().replica_id.unique_id
        except Exception:  # noqa: BLE001 - outside Ray (tests of the class itself)
            self.replica_id = f"local-{os.getpid()}"
        if config.step_trace_path:  # one trace (and request trace) per replica, never two writers on one file
            trace = Path(config.step_trace_path)
            config = replace(config, step_trace_path=str(trace.with_name(f"{trace.stem}.{self.replica_id}"
                                                                          f"{trace.suffix or '.jsonl'}")))
        self.kv_endpoint = self.replay_endpoint = None
        if advertise_host == "auto":  # a cluster: the router may run on another node
            import ray
            advertise_host = ray.util.get_node_ip_address()
        if kv_events and config.enable_prefix_caching:
            # Bind loopback on one node; every interface when the router may sit on another node.
            bind = "127.0.0.1" if advertise_host.startswith("127.") else "*"
            pub, rep = free_port(), free_port()
            config = replace(config, kv_events_config=KVEventsConfig(
                enable_kv_cache_events=True, endpoint=f"tcp://{bind}:{pub}", replay_endpoint=f"tcp://{bind}:{rep}"))
            self.kv_endpoint = f"tcp://{advertise_host}:{pub}"
            self.replay_endpoint = f"tcp://{advertise_host}:{rep}"
        app, self.async_engine = build_server(config, log_interval=0, **(server_kwargs or {}))
        self.server = ServerThread(app).start(timeout=300)
        self.block_size = config.block_size
        self._client = None

    def _http(self):
        import httpx
        if self._client is None:
            self._client = httpx.AsyncClient(base_url=self.server.url, timeout=None)
        return self._client

    async def http(self, method: str, path: str, headers: list, body: bytes, token_ids: list | None = None):
        """The local server's response: first (status, headers), then the body's chunks as they come.
        `token_ids` is for the router only."""
        request = self._http().build_request(method, path, headers=headers, content=body)
        response = await self._http().send(request, stream=True)
        try:
            kept = [(k, v) for k, v in response.headers.items() if k.lower() in _KEEP_HEADERS]
            yield (response.status_code, kept, self.replica_id)
            async for chunk in response.aiter_raw():
                yield chunk
        finally:
            await response.aclose()  # a cancelled stream closes the connection: the server aborts

    async def metrics(self, target_replica: str | None = None) -> tuple[str, str]:
        response = await self._http().get("/metrics")
        return self.replica_id, response.text

    def record_routing_stats(self) -> dict:
        """What the router reads every few seconds: where the KV events are, and the load."""
        import zlib

        m = self.async_engine.metrics
        # The exposition rides along (compressed): the ingress's /metrics reads every replica's
        # from here, with no request that would itself need routing to one chosen replica.
        return {"replica_id": self.replica_id, "kv_events": self.kv_endpoint, "replay": self.replay_endpoint,
                "block_size": self.block_size, "num_waiting": m._state["waiting"],
                "num_running": m._state["running"], "kv_usage": m._state["kv_usage"],
                "metrics_z": zlib.compress(m.render(), 6), "metrics_at": time.time()}

    def check_health(self) -> None:
        if self.async_engine.dead_error is not None:
            raise RuntimeError(f"the engine is dead: {self.async_engine.dead_error}")

    def __del__(self) -> None:
        try:
            self.async_engine.shutdown()
            self.server.stop()
        except Exception:  # noqa: BLE001
            pass


# -- KV events off the wire --------------------------------------------------------------------
class KVEventSubscriber:
    """A thread that follows one replica's vLLM-format KV-event stream into the router: it
    subscribes, asks the replay socket for everything kept, then applies live batches in
    sequence order (skipping what the replay already gave)."""

    def __init__(self, replica_id: str, endpoint: str, replay_endpoint: str | None, apply) -> None:
        import zmq

        self.replica_id, self._apply = replica_id, apply
        self._ctx = zmq.Context()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        self._sub.connect(endpoint)
        self._replay_endpoint = replay_endpoint
        self._stop = threading.Event()
        self.last_seq = -1
        self.num_batches = 0
        self._thread = threading.Thread(target=self._run, name=f"kv-sub-{replica_id[:8]}", daemon=True)
        self._thread.start()

    def _replay(self, decoder) -> None:
        import zmq

        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(self._replay_endpoint)
        try:
            dealer.send_multipart((b"", (self.last_seq + 1).to_bytes(8, "big")))
            while dealer.poll(5000):
                _, seq, payload = dealer.recv_multipart()
                seq_n = int.from_bytes(seq, "big", signed=True)
                if seq_n < 0:
                    return
                self._take(seq_n, decoder.decode(payload))
        finally:
            dealer.close(linger=0)

    def _take(self, seq: int, batch) -> None:
        if seq <= self.last_seq:
            return
        self.last_seq = seq
        self.num_batches += 1
        self._apply(self.replica_id, batch.events)

    def _run(self) -> None:
        import msgspec

        from pagedserve.engine.kv_events import KVEventBatch

        decoder = msgspec.msgpack.Decoder(KVEventBatch)
        try:
            if self._replay_endpoint:
                self._replay(decoder)
            while not self._stop.is_set():
                if self._sub.poll(100):
                    _, seq, payload = self._sub.recv_multipart()
                    seq_n = int.from_bytes(seq, "big")
                    if seq_n > self.last_seq + 1 and self._replay_endpoint:
                        self._replay(decoder)     # a gap (a slow join or a drop): fill it first
                    self._take(seq_n, decoder.decode(payload))
        except Exception:  # noqa: BLE001 - the replica went away; the router forgets it on its death
            if not self._stop.is_set():
                logger.exception("KV events of replica %s: subscriber stopped", self.replica_id)
        finally:
            self._sub.close(linger=0)
            self._ctx.term()

    def close(self) -> None:
        self._stop.set()


# -- the router (Ray Serve's extension point) -----------------------------------------------------
class _RouterState:
    """The policy, the subscribers and the counts, shared by Ray's router object and /metrics."""

    def __init__(self, policy: str, block_size: int, **kwargs) -> None:
        self.policy = make_router(policy, block_size, **kwargs)
        self.lock = threading.Lock()
        self.subscribers: dict[str, KVEventSubscriber] = {}
        self.decisions: Counter = Counter()       # (replica, reason) -> requests
        self.prompt_tokens = 0                    # of routed prompts (full blocks the engine could cache)
        self.matched_tokens = 0                   # of those, held by the chosen replica
        self.forgotten = 0                        # replicas forgotten (death or removal)
        self.metrics_z: dict[str, bytes] = {}     # replica -> its last exposition (routing stats), zlib
        self.ray_router = None                    # Ray's router object, for refresh()

    def apply(self, replica_id: str, events) -> None:
        with self.lock:
            self.policy.apply_events(replica_id, events)

    def sync(self, replicas: dict[str, Any]) -> None:
        """Make the policy's live set Ray's, subscribing to new replicas' KV events."""
        with self.lock:
            for gone in set(self.policy.replicas) - set(replicas):
                self._forget(gone)
            for replica_id, replica in replicas.items():
                self.policy.add_replica(replica_id)
                stats = getattr(replica, "routing_stats", None) or {}
                if stats.get("metrics_z"):
                    self.metrics_z[replica_id] = stats["metrics_z"]
                if stats:
                    self.policy.report_load(replica_id, stats.get("num_waiting", 0), stats.get("num_running", 0),
                                            stats.get("kv_usage", 0.0))
                if (self.policy.name == "kv-aware" and stats.get("kv_events")
                        and replica_id not in self.subscribers):
                    self.subscribers[replica_id] = KVEventSubscriber(replica_id, stats["kv_events"],
                                                                     stats.get("replay"), self.apply)

    def refresh(self) -> None:
        """Read Ray's current replica list and their routing stats now (a scrape between requests)."""
        if self.ray_router is not None:
            self.sync({r.replica_id.unique_id: r for r in list(self.ray_router.curr_replicas.values())})

    def expositions(self) -> dict[str, str]:
        import zlib
        with self.lock:
            return {r: zlib.decompress(z).decode() for r, z in self.metrics_z.items() if r in self.policy.replicas}

    def _forget(self, replica_id: str) -> None:
        self.metrics_z.pop(replica_id, None)
        self.policy.remove_replica(replica_id)
        sub = self.subscribers.pop(replica_id, None)
        if sub is not None:
            sub.close()
        self.forgotten += 1

    def forget(self, replica_id: str) -> None:
        with self.lock:
            if replica_id in self.policy.replicas:
                self._forget(replica_id)

    def choose(self, token_ids, candidates) -> str:
        with self.lock:
            decision = self.policy.choose(token_ids or [], candidates)
            self.decisions[(decision.replica_id, decision.reason)] += 1
            servable = max(len(token_ids or []) - 1, 0) // self.policy.block_size
            self.prompt_tokens += servable * self.policy.block_size
            self.matched_tokens += decision.matched_blocks * self.policy.block_size
            return decision.replica_id

    def render(self) -> str:
        """The router's own metrics, Prometheus text."""
        name = self.policy.name
        lines = [f"# HELP {ROUTER_METRIC_PREFIX}requests_total Requests routed, by replica and why it was chosen.",
                 f"# TYPE {ROUTER_METRIC_PREFIX}requests_total counter"]
        with self.lock:
            for (replica, reason), n in sorted(self.decisions.items()):
                lines.append(f'{ROUTER_METRIC_PREFIX}requests_total{{router="{name}",replica="{replica}",'
                             f'decision="{reason}"}} {n}')
            gauges = {
                "prompt_tokens_total": ("counter", "Prompt tokens in full blocks of routed requests.",
                                        self.prompt_tokens),
                "matched_tokens_total": ("counter", "Of those, tokens the chosen replica's pool held (KV events).",
                                         self.matched_tokens),
                "replicas": ("gauge", "Live replicas the router knows.", len(self.policy.replicas)),
                "replicas_forgotten_total": ("counter", "Replicas forgotten (died or left).", self.forgotten),
            }
            cached = {r: len(s.cached) for r, s in self.policy.replicas.items()}
            in_flight = {r: s.in_flight for r, s in self.policy.replicas.items()}
        for metric, (kind, help_text, value) in gauges.items():
            lines += [f"# HELP {ROUTER_METRIC_PREFIX}{metric} {help_text}", f"# TYPE {ROUTER_METRIC_PREFIX}{metric} {kind}",
                      f'{ROUTER_METRIC_PREFIX}{metric}{{router="{name}"}} {value}']
        for metric, help_text, per in (("cached_blocks", "Prefix-cache blocks the router knows a replica holds.", cached),
                                       ("in_flight", "Requests routed to a replica and not finished.", in_flight)):
            lines += [f"# HELP {ROUTER_METRIC_PREFIX}{metric} {help_text}", f"# TYPE {ROUTER_METRIC_PREFIX}{metric} gauge"]
            lines += [f'{ROUTER_METRIC_PREFIX}{metric}{{router="{name}",replica="{r}"}} {v}' for r, v in sorted(per.items())]
        return "\n".join(lines) + "\n"


# -- the ingress ------------------------------------------------------------------------------------


# -- the application -----------------------------------------------------------------------------------
def autoscaling_config(autoscale: str, config, replicas: int | None = None) -> dict:
    """`MIN:MAX[:TARGET]` -> Ray Serve's autoscaling_config. Ray scales on ongoing requests per
    replica (queued + running, as its handles count them); TARGET defaults to the engine's
    max_num_seqs: past it a replica's requests start to wait in its queue."""
    parts = str(autoscale).split(":")
    try:
        if len(parts) not in (2, 3):
            raise ValueError
        low, high = int(parts[0]), int(parts[1])
        target = float(parts[2]) if len(parts) == 3 else float(config.max_num_seqs)
    except ValueError:
        raise ValueError(f"autoscale: expected MIN:MAX or MIN:MAX:TARGET (e.g. 1:4), got {autoscale!r}") from None
    if not 1 <= low <= high or target <= 0:
        raise ValueError(f"autoscale: needs 1 <= MIN <= MAX and TARGET > 0, got {autoscale!r}")
    if replicas is not None and not low <= replicas <= high:
        raise ValueError(f"replicas: the initial {replicas} must lie within --autoscale {autoscale}")
    return {"min_replicas": low, "max_replicas": high, "initial_replicas": replicas or low,
            "target_ongoing_requests": target}


def build_fleet(config, replicas: int | None, router: str, *, cpus_per_replica: float = 1.0, seed: int = 0,
                imbalance_threshold: int | None = None, server_kwargs: dict | None = None,
                advertise_host: str = "127.0.0.1", max_ongoing_requests: int = 1024,
                autoscale: str | None = None):
    """The Ray Serve application: `replicas` EngineReplicas behind the ingress, routed by `router`;
    with `autoscale` (MIN:MAX[:TARGET]) Ray Serve scales them on queue length, starting at `replicas`.
    `cpus_per_replica`: Ray CPUs per rank of a replica's engine (a `-tp 2` replica takes twice)."""
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    if router not in ROUTERS:
        raise ValueError(f"router: must be one of {ROUTERS}, got {router!r}")
    if not (autoscale is not None and replicas is None) and (
            isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1):
        raise ValueError(f"replicas: must be an integer >= 1, got {replicas!r}")
    scale = {"autoscaling_config": autoscaling_config(autoscale, config, replicas)} if autoscale is not None \
        else {"num_replicas": replicas}
    kwargs: dict = {"policy": router, "block_size": config.block_size, "seed": seed}
    if router == "kv-aware" and imbalance_threshold is not None:
        kwargs["imbalance_threshold"] = imbalance_threshold
    resources = replica_resources(config, cpus_per_replica)
    engine = serve.deployment(EngineReplica, name=ENGINE_DEPLOYMENT).options(
        **scale, max_ongoing_requests=max_ongoing_requests,
        ray_actor_options=resources,
        health_check_period_s=2, health_check_timeout_s=30,
        request_router_config=RequestRouterConfig(
            request_router_class="pagedserve.fleet.ray_router:FleetRequestRouter", request_router_kwargs=kwargs,
            request_routing_stats_period_s=1.0, request_routing_stats_timeout_s=5.0))
    from pagedserve.fleet.ingress import build_ingress_class

    ingress = build_ingress_class()
    return ingress.bind(engine.bind(config, server_kwargs, router == "kv-aware", advertise_host, cpus_per_replica),
                        config.tokenizer or config.model, router)


def app_builder(args: dict):
    """`serve run pagedserve.fleet.serve:app_builder model=... replicas=2 router=kv-aware` (or a config
    file's `args:`): engine knobs by their EngineConfig names, plus replicas, router,
    cpus_per_replica, advertise_host, metric_names, autoscale (MIN:MAX[:TARGET])."""
    from pagedserve.config import EngineConfig

    args = dict(args)
    autoscale = args.pop("autoscale", None)
    replicas = args.pop("replicas", None if autoscale is not None else 1)
    replicas = int(replicas) if replicas is not None else None
    router = args.pop("router", "kv-aware")
    cpus = float(args.pop("cpus_per_replica", 1))
    advertise = args.pop("advertise_host", "127.0.0.1")
    metric_names = args.pop("metric_names", "pagedserve")
    known = set(EngineConfig.knob_names())
    unknown = set(args) - known
    if unknown:
        raise ValueError(f"fleet args: unknown key(s) {sorted(unknown)}; engine knobs are {sorted(known)}")
    config = EngineConfig(**_coerce(args))
    return build_fleet(config, replicas, router, cpus_per_replica=cpus, advertise_host=advertise,
                       server_kwargs={"metric_names": metric_names}, autoscale=autoscale)


def _coerce(args: dict) -> dict:
    """`serve run key=value` hands strings: numbers and booleans as YAML reads them."""
    import yaml
    return {k: yaml.safe_load(v) if isinstance(v, str) else v for k, v in args.items()}


def run_fleet(config, replicas: int | None, router: str, host: str, port: int, *, cpus_per_replica: float = 1.0,
              ray_address: str | None = None, server_kwargs: dict | None = None,
              advertise_host: str = "127.0.0.1", blocking: bool = True, autoscale: str | None = None):
    """Start (or join) Ray, start Serve's proxy on host:port, run the fleet. Returns the app handle."""
    import ray
    from ray import serve

    if not ray.is_initialized():
        ray.init(address=ray_address, include_dashboard=False, log_to_driver=False,
                 runtime_env={"env_vars": {"PYTHONPATH": os.environ.get("PYTHONPATH", "")}}
                 if os.environ.get("PYTHONPATH") else None)
    serve.start(http_options={"host": host, "port": port})
    app = build_fleet(config, replicas, router, cpus_per_replica=cpus_per_replica, server_kwargs=server_kwargs,
                      advertise_host="auto" if ray_address else advertise_host, autoscale=autoscale)
    handle = serve.run(app, name=APP_NAME, route_prefix="/", blocking=False)
    logger.info("fleet: %s replica(s), router %s, on http://%s:%d",
                replicas if autoscale is None else f"autoscaled {autoscale}", router, host, port)
    if blocking:
        import signal

        def stop(*_):
            raise KeyboardInterrupt

        signal.signal(signal.SIGTERM, stop)  # a SIGTERM also takes the app and a local Ray down
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            serve.shutdown()
            ray.shutdown()
    return handle
