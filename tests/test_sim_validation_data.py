"""benchmarks/data/published_gpu_runs.json is read by benchmarks/sim_validation.py, which only
runs by hand: a case whose metric has no group there, or whose GPU / model the simulator cannot
resolve, would fail only when someone next runs the validation. These checks read the file and
the script's tables; they simulate nothing."""
import importlib.util
import json
from pathlib import Path

from pagedserve.plan.gpus import get_gpu
from pagedserve.plan.models import model_from_hf_config, preset_names

ROOT = Path(__file__).resolve().parents[1]
DATA = json.loads((ROOT / "benchmarks" / "data" / "published_gpu_runs.json").read_text())


def _sim_validation():
    spec = importlib.util.spec_from_file_location("sim_validation", ROOT / "benchmarks" / "sim_validation.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_every_published_metric_has_a_group_with_a_target():
    sv = _sim_validation()
    for case in DATA["cases"]:
        for key in case["published"]:
            assert key in sv.GROUPS, f"{case['id']}: {key} has no metric group"
            assert sv.GROUPS[key] in sv.TARGETS, f"{case['id']}: group {sv.GROUPS[key]} has no target"


def test_every_case_names_a_source_a_gpu_preset_and_a_model():
    presets = set(preset_names())
    ids = [c["id"] for c in DATA["cases"]]
    assert len(ids) == len(set(ids)), "case ids repeat"
    for case in DATA["cases"]:
        assert case["url"].startswith("http"), case["id"]
        get_gpu(case["gpu"])  # raises on an unknown GPU
        name = case["model"]
        if name in DATA["models"]:
            cfg = {k: v for k, v in DATA["models"][name].items() if not k.startswith("_")}
            info = model_from_hf_config(cfg, name, DATA["models"][name]["_source"])
            assert info.shape.num_layers == cfg["num_hidden_layers"], name
        else:
            assert name in presets, f"{case['id']}: model {name} is neither a preset nor in the file's models"


def test_every_served_case_names_its_endpoint_and_async_scheduling_from_its_source():
    """The simulator charges the client's endpoint's serving terms and the vLLM version's async
    scheduling (sim_validation.py reads both per case): a served case without them would run on
    the defaults silently. Async scheduling is the engine loop's, so an offline case (the LLM class,
    no server) names it too: vLLM's 2024 nightly latency tests ran on the profile's default (on) until
    2026-12-05, 13-20% optimistic, where their V0 engine had none."""
    for case in DATA["cases"]:
        assert isinstance(case.get("async_scheduling"), bool) and case.get("async_scheduling_source"), case["id"]
        if case["workload"]["kind"] == "batch":
            continue  # offline: no server, no endpoint
        assert case["endpoint"] in ("completions", "chat") and case["endpoint_source"], case["id"]
    assert {c["endpoint"] for c in DATA["cases"] if c["id"].startswith("gpustack")} == {"chat"}
