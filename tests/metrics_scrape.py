"""Reading a test server's /metrics: every sample by name and labels, and waiting for idle."""
from __future__ import annotations

import time

import httpx
from prometheus_client.parser import text_string_to_metric_families


def scrape(server) -> dict[str, float]:
    """Every sample on /metrics as {'name{label=value,...}': value} (model_name left out)."""
    samples = {}
    for family in text_string_to_metric_families(httpx.get(server.url + "/metrics").text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "model_name")
            samples[f"{s.name}{{{labels}}}"] = s.value
    return samples


def wait_idle(server, deadline_s: float = 60.0) -> dict[str, float]:
    """Poll /metrics until nothing runs or waits and no block is held (a wait, not a timing
    assert: the deadline only turns a hang into a failure)."""
    end = time.monotonic() + deadline_s
    while True:
        m = scrape(server)
        idle = (m["pagedserve:num_requests_running{}"] == 0 and m["pagedserve:num_requests_waiting{}"] == 0
                and m["pagedserve:kv_cache_used_tokens{}"] == 0)
        if idle:
            return m
        assert time.monotonic() < end, f"the server did not become idle within {deadline_s} s"
        time.sleep(0.05)
