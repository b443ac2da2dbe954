"""--host-profile vllm: the serving layer measured from vLLM's own API server (benchmarks/vllm_host_probe.py)."""
from __future__ import annotations

import json

import pytest

from pagedserve.sim import host_overhead as ho
from pagedserve.sim.cost_model import CostParams, ServingOverhead

PROBE = ho.HostOverhead(step_s=1e-5, per_request_s=3e-6, admit_s=1.5e-3, admit_per_prompt_token_s=3e-6,
                        deliver_s=3.8e-3, deliver_per_output_s=2e-5, runner_step_s=2e-4, source="host_probe on X")


def _write(path, **terms):
    path.write_text(json.dumps({"fit": {**terms, "speed": 1.0, "source": "vllm_host_probe on Y"}, "report": {}}))


def test_the_vllm_profile_takes_its_serving_layer_from_the_vllm_measurement(tmp_path, monkeypatch):
    path = tmp_path / "vllm.json"
    _write(path, admit_s=4e-3, admit_per_prompt_token_s=8e-6, deliver_s=1e-3, deliver_per_output_s=5e-5)
    monkeypatch.setattr(ho, "VLLM_SERVING_PATH", path)
    v = PROBE.for_profile("vllm")
    assert (v.admit_s, v.admit_per_prompt_token_s, v.deliver_s, v.deliver_per_output_s) == (4e-3, 8e-6, 1e-3, 5e-5)
    assert v.step_s == ho.VLLM_STEP_S and v.runner_step_s == 0.0  # the engine loop: the blog's figure, as before
    assert "vllm_host_probe on Y" in v.source
    p = CostParams(peak_flops=1e12, mem_bandwidth=1e11)
    v.scaled(2.0).apply(p)  # scaled to a host as the pagedserve profile is
    s = ServingOverhead.from_dict(p.serving)
    assert s.serial and s.admit(1000) == pytest.approx((4e-3 + 8e-3) / 2)
    assert s.deliver(10) == pytest.approx((1e-3 + 5e-4) / 2)
    assert PROBE.for_profile("pagedserve") is PROBE  # pagedserve's own profile is untouched


def test_without_a_vllm_measurement_the_profile_keeps_the_probes_serving_layer(tmp_path, monkeypatch):
    monkeypatch.setattr(ho, "VLLM_SERVING_PATH", tmp_path / "absent.json")
    v = PROBE.for_profile("vllm")
    assert (v.admit_s, v.deliver_s, v.deliver_per_output_s) == (PROBE.admit_s, PROBE.deliver_s,
                                                                PROBE.deliver_per_output_s)
    assert "host_probe on X" in v.source


def test_the_shipped_vllm_measurement_says_where_and_when_it_was_taken():
    data = json.loads(ho.VLLM_SERVING_PATH.read_text())
    assert "vllm_host_probe.py" in data["fit"]["source"] and data["report"]["cpu"] and data["report"]["when"]
    v = ho.default_host_overhead(profile="vllm")
    assert v.admit_s == pytest.approx(data["fit"]["admit_s"]) and v.admit_s > 0
    assert v.deliver_per_output_s == pytest.approx(data["fit"]["deliver_per_output_s"])
    assert v.deliver_per_output_s > 0
