"""fleet/routing.py's policy as Ray Serve's RequestRouter (the extension point Ray Serve LLM's
routers use). It runs in the caller's process (the fleet's ingress), one per deployment handle;
its state is serve.py's _RouterState, registered in serve.ROUTER_REGISTRY for /metrics."""
from __future__ import annotations

from ray.serve.request_router import RequestRouter

import logging

from pagedserve.fleet.serve import _RouterState

logger = logging.getLogger("ray.serve")


class FleetRequestRouter(RequestRouter):
    """Ranks: the policy's choice first, then every other candidate (Ray takes the first with
    room under max_ongoing_requests). A call with `target_replica` (the ingress's /metrics) goes
    to that replica."""

    # Ray drops a replica from a routing round when it does not answer the queue-length probe
    # in time (defaults 0.1 s, growing to 1 s). A CPU replica whose engine holds the cores can
    # take longer, and then a request aimed at it (the kv-aware choice, a /metrics scrape)
    # waits in backoff: give it longer.
    queue_len_response_deadline_s = 1.0
    max_queue_len_response_deadline_s = 10.0

    def initialize_state(self, policy: str = "kv-aware", block_size: int = 16, **kwargs) -> None:
        self.state = _RouterState(policy, block_size, **kwargs)
        self._counted: set[str] = set()      # internal request ids counted in flight
        self.state.ray_router = self
        # Ray ships this module to the caller by value (cloudpickle), globals included: reach the
        # registry through the imported module, never a copy of its dict.
        from pagedserve.fleet import registry as fleet_serve
        fleet_serve.ROUTER_REGISTRY[self._deployment_id.name] = self.state

    async def choose_replicas(self, candidate_replicas, pending_request=None):
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        self.state.sync({r.replica_id.unique_id: r for r in self.curr_replicas.values()})
        kwargs = pending_request.kwargs if pending_request is not None else {}
        target = kwargs.get("target_replica")
        if target is not None:
            logger.debug("fleet router: target %s among %s", target, sorted(by_id))
            return [[by_id[target]]] if target in by_id else [candidate_replicas]
        if not by_id:
            return []
        chosen = self.state.choose(kwargs.get("token_ids"), list(by_id))
        rest = [r for r in candidate_replicas if r.replica_id.unique_id != chosen]
        return [[by_id[chosen]], rest] if rest else [[by_id[chosen]]]

    def on_request_routed(self, pending_request, replica_id, result) -> None:
        if pending_request is not None and pending_request.kwargs.get("target_replica") is None:
            self._counted.add(pending_request.metadata.internal_request_id)
            with self.state.lock:
                self.state.policy.started(replica_id.unique_id)

    def on_request_completed(self, replica_id, internal_request_id) -> None:
        if internal_request_id in self._counted:
            self._counted.discard(internal_request_id)
            with self.state.lock:
                self.state.policy.finished(replica_id.unique_id)

    def on_replica_actor_died(self, replica_id) -> None:
        super().on_replica_actor_died(replica_id)
        self.state.forget(replica_id.unique_id)
