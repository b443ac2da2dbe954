"""The fleet's one OpenAI endpoint (fleet/serve.py): a Ray Serve ingress that forwards each
request to an EngineReplica through the router, streaming the answer back.

Kept apart from serve.py, without `from __future__ import annotations`: FastAPI reads the
handlers' annotations (Request) as objects."""
import asyncio
import json
import logging

from pagedserve.fleet.registry import ENGINE_DEPLOYMENT, label_exposition

logger = logging.getLogger("pagedserve.fleet")
METRICS_TIMEOUT_S = 10.0


def _retryable(error: BaseException) -> bool:
    from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError
    return isinstance(error, (ActorDiedError, ActorUnavailableError, RayActorError))


def _error_body(message: str, code: int = 503) -> bytes:
    return json.dumps({"error": {"message": message, "type": "ServiceUnavailableError", "param": None,
                                 "code": code}}).encode()


def build_ingress_class():
    from fastapi import FastAPI, Request
    from fastapi.responses import Response, StreamingResponse
    from ray import serve

    api = FastAPI()

    @serve.deployment(name="FleetIngress", ray_actor_options={"num_cpus": 0}, max_ongoing_requests=4096)
    @serve.ingress(api)
    class FleetIngress:
        def __init__(self, engine, tokenizer_path: str | None, router: str) -> None:
            self.engine = engine
            self.router = router
            self.tokenizer = None
            if tokenizer_path and router == "kv-aware":
                try:
                    from transformers import AutoTokenizer
                    self.tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
                except Exception as e:  # noqa: BLE001 - routing then sees no prefix; replies are unchanged
                    logger.warning("fleet: no tokenizer for routing (%s)", e)

        def token_ids(self, path: str, body: bytes) -> list[int]:
            """The prompt as the replica will tokenize it (first prompt of a batch), for routing only."""
            if self.tokenizer is None:
                return []
            try:
                data = json.loads(body)
                if path.endswith("/chat/completions"):
                    messages = [{"role": m.get("role"), "content": m.get("content") if isinstance(m.get("content"), str)
                                 else "".join(p.get("text", "") for p in m.get("content") or [])}
                                for m in data["messages"]]
                    text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
                    return list(self.tokenizer(text, add_special_tokens=False).input_ids)
                prompt = data.get("prompt")
                if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
                    prompt = prompt[0]
                if isinstance(prompt, str):
                    return list(self.tokenizer(prompt).input_ids)
                if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
                    return prompt
            except Exception:  # noqa: BLE001 - the replica answers a bad body with its own 400
                pass
            return []

        async def _open(self, method: str, path: str, headers: list, body: bytes, token_ids: list):
            """(head, first body chunk or None, the generator), retrying once on another replica
            when the first one dies before answering."""
            for attempt in range(2):
                gen = self.engine.options(stream=True).http.remote(method, path, headers, body,
                                                                    token_ids=token_ids)
                try:
                    head = await gen.__anext__()
                    try:
                        first = await gen.__anext__()
                    except StopAsyncIteration:
                        first = None
                    return head, first, gen
                except Exception as e:  # noqa: BLE001
                    gen.cancel()
                    if attempt == 0 and _retryable(e):
                        logger.warning("fleet: replica died before answering; retrying once (%s)", type(e).__name__)
                        continue
                    raise

        async def forward(self, request: Request, path: str):
            body = await request.body()
            headers = [(k, v) for k, v in request.headers.items()
                       if k.lower() in ("content-type", "authorization", "x-request-id", "accept")]
            try:
                head, first, gen = await self._open(request.method, path, headers, body, self.token_ids(path, body))
            except Exception as e:  # noqa: BLE001 - no replica could answer: a clean 503
                return Response(_error_body(f"no replica could serve the request: {type(e).__name__}: {e}"),
                                status_code=503, media_type="application/json", headers={"Retry-After": "1"})
            status, kept, _replica = head
            media = dict((k.lower(), v) for k, v in kept).get("content-type", "application/json")

            async def rest():
                try:
                    if first is not None:
                        yield first
                    async for chunk in gen:
                        yield chunk
                except asyncio.CancelledError:
                    raise
                except Exception as e:  # noqa: BLE001 - the replica died mid-stream
                    if media.startswith("text/event-stream"):
                        yield b"data: " + _error_body(f"the replica serving this stream died: {type(e).__name__}") + b"\n\n"
                finally:
                    gen.cancel()

            return StreamingResponse(rest(), status_code=status, media_type=media,
                                     headers={k: v for k, v in kept if k.lower() != "content-type"})

        @api.post("/v1/{rest:path}")
        async def post(self, request: Request, rest: str):
            return await self.forward(request, "/v1/" + rest)

        @api.get("/v1/{rest:path}")
        async def get(self, request: Request, rest: str):
            return await self.forward(request, "/v1/" + rest)

        @api.get("/health")
        async def health(self, request: Request):
            return await self.forward(request, "/health")

        async def _metrics_of(self, replica_id):
            return await self.engine.metrics.remote(target_replica=replica_id)

        @api.get("/metrics")
        async def metrics(self):
            # The class travels to its replica by value (cloudpickle), globals copied: read the
            # router registry through the module, where the router put its state.
            from pagedserve.fleet import registry as fleet_serve

            state = fleet_serve.ROUTER_REGISTRY.get(ENGINE_DEPLOYMENT)
            texts: dict = {}
            if state is None:
                # No request has gone through the handle yet, so Ray has not built the router:
                # one call builds it and brings that replica's exposition.
                try:
                    replica_id, text = await asyncio.wait_for(self._metrics_of(None), METRICS_TIMEOUT_S)
                    texts[replica_id] = text
                except Exception:  # noqa: BLE001 - no replica answers yet: an empty scrape
                    pass
                state = fleet_serve.ROUTER_REGISTRY.get(ENGINE_DEPLOYMENT)
            if state is not None:
                state.refresh()
                texts.update(state.expositions())   # each replica's, as its last routing stats carried it
            lines, seen = [], set()
            for replica_id, text in sorted(texts.items()):
                lines += label_exposition(text, replica_id, seen)
            state = fleet_serve.ROUTER_REGISTRY.get(ENGINE_DEPLOYMENT)
            router_text = state.render() if state is not None else ""
            return Response("\n".join(lines) + "\n" + router_text, media_type="text/plain; version=0.0.4")

    return FleetIngress


