"""schemathesis against the server's own /openapi.json: completions and chat never answer 5xx."""
from __future__ import annotations

import time

import httpx
import pytest

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, settings  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402

from pagedserve.config import EngineConfig  # noqa: E402
from pagedserve.server.launcher import ServerThread, build_server  # noqa: E402

MAX_EXAMPLES = 30  # per endpoint: bounded so CI stays fast


@pytest.fixture(scope="module")
def server(tiny_llama):
    # Short max_model_len and few sequences bound how much work any generated request can ask for.
    config = EngineConfig(model=str(tiny_llama), num_kv_blocks=64, max_model_len=48, max_num_seqs=4)
    app, async_engine = build_server(config)
    with ServerThread(app) as st, httpx.Client(timeout=30) as http:
        st.async_engine = async_engine
        st.http = http  # one connection for the per-case health checks
        yield st


@pytest.fixture(scope="module")
def api_schema(server):
    return schemathesis.openapi.from_url(server.url + "/openapi.json")


schema = schemathesis.pytest.from_fixture("api_schema").include(path_regex=r"^/v1/(chat/)?completions$")


def assert_idle_and_healthy(server) -> None:
    """After a response, the engine drains (aborted or finished), holds no block and is healthy.
    The front-end forgets an aborted request at once and the core frees its blocks when it takes
    the abort in, a moment later: both are awaited, a block still held after 60 s fails."""
    engine = server.async_engine.engine
    end = time.monotonic() + 60
    while engine.has_unfinished_requests() or engine.kv_cache_manager.num_used_blocks:
        assert time.monotonic() < end, (f"a fuzzed request left the engine busy or holding "
                                        f"{engine.kv_cache_manager.num_used_blocks} blocks for 60 s")
        time.sleep(0.02)
    assert server.http.get(server.url + "/health").status_code == 200


@schema.parametrize()
@settings(max_examples=MAX_EXAMPLES, deadline=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
def test_no_server_errors(case, server):
    """Every case is checked on its own (no later test depends on this one having run first)."""
    response = case.call(base_url=server.url, timeout=60)
    case.validate_response(response, checks=[not_a_server_error])
    assert_idle_and_healthy(server)
