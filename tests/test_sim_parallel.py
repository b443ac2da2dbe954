"""The simulator's parallel terms (sim/parallel_cost.py) against hand computations: TP
all-reduce inside vs across nodes, EP all-to-all, PP sends and bubbles, the experts a step
touches; and the layout comparison through `simulate` / `tune`."""
from __future__ import annotations

import json
from dataclasses import replace

import pytest

from pagedserve.plan.gpus import get_gpu
from pagedserve.plan.models import load_model
from pagedserve.plan.parallel import ParallelLayout, parse_layout
from pagedserve.sim.cost_model import CostModel, CostParams, ModelCost
from pagedserve.sim.parallel_cost import ParallelCostModel, Topology

H100 = CostParams.for_gpu(get_gpu("H100-SXM"))
NVLINK = 450e9 * H100.link_efficiency          # one direction, at the stated efficiency
NIC = 50e9 * H100.link_efficiency              # one 400 Gb/s NIC per GPU
LAT = H100.allreduce_latency_s
LLAMA70 = load_model("llama-3.1-70b").shape    # 80 layers, hidden 8192, bf16
DS = load_model("deepseek-v3").shape


def model(shape, layout, dtype="bfloat16", topology=Topology()):
    return ParallelCostModel(shape, dtype, None, layout, H100, topology)


STEPS = [([1] * 16, [900 + i for i in range(16)]), ([512], [512]), ([1] * 8 + [256], [300] * 8 + [1024])]


@pytest.mark.parametrize("new,ctx", STEPS)
def test_dense_tp_inside_a_node_is_the_single_rank_model(new, ctx):
    plain = CostModel(ModelCost.from_shape(LLAMA70, "bfloat16", None, 4), H100)
    assert model(LLAMA70, ParallelLayout(4)).predict(new, ctx) == pytest.approx(plain.predict(new, ctx), rel=1e-12)


@pytest.mark.parametrize("new,ctx", STEPS)
def test_a_quantized_kv_cache_costs_its_dequantization_under_tp_and_pp_too(new, ctx):
    """fp8 KV: the layouts charge the decode of every K/V value attention reads, as one rank does
    (ParallelCostModel's stages once dropped that term: an fp8-KV TP deployment was priced as if
    the cache were bf16)."""
    plain = CostModel(ModelCost.from_shape(LLAMA70, "bfloat16", "fp8", 4), H100)
    tp = ParallelCostModel(LLAMA70, "bfloat16", "fp8", ParallelLayout(4), H100)
    assert tp.breakdown(new, ctx).dequant > 0
    assert tp.predict(new, ctx) == pytest.approx(plain.predict(new, ctx), rel=1e-12)
    # PP: against the same layout with the decode free, the step costs more; one request's one
    # micro-batch walks both (equal, 40-layer) stages, so it pays both stages' decode
    pp = ParallelCostModel(LLAMA70, "bfloat16", "fp8", ParallelLayout(4, 2), H100)
    free = ParallelCostModel(LLAMA70, "bfloat16", "fp8", ParallelLayout(4, 2), replace(H100, kv_dequant_s_per_value=0.0))
    t = pp.breakdown(new, ctx)
    assert t.dequant > 0 and free.breakdown(new, ctx).dequant == 0.0
    assert pp.predict(new, ctx) > free.predict(new, ctx)
    if len(new) == 1:
        assert pp.predict(new, ctx) - free.predict(new, ctx) == pytest.approx(2 * t.dequant, rel=1e-9)


def test_tp_across_nodes_pays_the_nic():
    tokens = 64
    new, ctx = [1] * tokens, [1000] * tokens
    data = tokens * 8192 * 2
    inside = model(LLAMA70, ParallelLayout(8)).breakdown(new, ctx).allreduce
    across = model(LLAMA70, ParallelLayout(16)).breakdown(new, ctx).allreduce
    # two ring all-reduces per layer, 80 layers
    assert inside == pytest.approx(160 * (2 * 7 / 8 * data / NVLINK + LAT))
    assert across == pytest.approx(160 * (2 * 15 / 16 * data / NIC + LAT))
    # the same TP 16 on 16-GPU nodes stays on NVLink
    big_node = model(LLAMA70, ParallelLayout(16), topology=Topology(gpus_per_node=16)).breakdown(new, ctx).allreduce
    assert big_node == pytest.approx(160 * (2 * 15 / 16 * data / NVLINK + LAT))


def test_ep_all_to_all_inside_and_across_nodes():
    tokens = 256
    new, ctx = [1] * tokens, [2000] * tokens
    sent = lambda ep: tokens / ep * 8 * 7168 * 2   # top-8, hidden 7168, bf16 activations  # noqa: E731
    ep8 = model(DS, ParallelLayout(8, enable_expert_parallel=True), "fp8").breakdown(new, ctx)
    # 58 MoE layers x (dispatch + combine); 7 of the 8 destinations are other GPUs of the node
    assert ep8.all_to_all == pytest.approx(58 * 2 * (sent(8) * 7 / 8 / NVLINK + LAT))
    # the MoE layers' MLP all-reduce is gone: 61 attention + 3 dense-MLP all-reduces remain
    assert ep8.allreduce == pytest.approx(64 * (2 * 7 / 8 * tokens * 7168 * 2 / NVLINK + LAT))
    ep16 = model(DS, ParallelLayout(16, enable_expert_parallel=True), "fp8").breakdown(new, ctx)
    # 8 of 16 destinations on the other node: the NIC part is the slower one
    assert ep16.all_to_all == pytest.approx(58 * 2 * (sent(16) * 8 / 16 / NIC + LAT))


def test_a_decode_reads_only_the_experts_it_touches():
    one = model(DS, ParallelLayout(8), "fp8")
    mc = one.inner.model
    routed = 58 * 256 * 3 * 7168 * 2048 / 8            # fp8: one byte per weight, 1/8 of each expert
    touched = 8 / 256                                   # one token, top-8 of 256
    bytes_read = mc.weight_bytes_per_rank - (1 - touched) * routed
    t = one.breakdown([1], [100])
    assert t.linear == pytest.approx(bytes_read / (H100.mem_bandwidth * H100.gemm_mbu))
    # a big prefill touches (almost) all of them
    big = one.breakdown([4096], [4096])
    assert big.linear >= mc.weight_bytes_per_rank * (1 - 1e-6) / (H100.mem_bandwidth * H100.gemm_mbu)


def test_pp_one_request_walks_the_stages_two_fill_the_pipeline():
    tp4 = model(LLAMA70, ParallelLayout(4))
    pp2 = model(LLAMA70, ParallelLayout(4, 2))
    send = 1 * 8192 * 2 / NVLINK + LAT                  # one token's hidden to the next stage, same node
    # one request: stage 0 then stage 1 (40 layers each, LM head on the last) = the whole model + a send
    assert pp2.predict([1], [500]) == pytest.approx(tp4.predict([1], [500]) + send, rel=1e-9)
    one = pp2.breakdown([1], [500])
    assert one.pipeline > 0                            # stage 0 idles while stage 1 works
    # two requests: two micro-batches keep the busier last stage (it has the LM head) working
    # all the time: no bubble, and less than two one-request steps
    two = pp2.breakdown([1, 1], [500, 500])
    assert two.pipeline == 0 and two.total < 2 * one.total - one.overhead


def test_layout_strings():
    assert parse_layout("tp4xpp2") == ParallelLayout(4, 2)
    assert parse_layout("TP8+EP8").ep == 8
    with pytest.raises(ValueError, match="--expert-parallel-size"):
        parse_layout("TP8+EP4")
    with pytest.raises(ValueError, match="layout"):
        parse_layout("TP8+XP2")


def test_tune_compares_layouts_and_tp_across_nodes_loses(capsys, tmp_path):
    """The articles' rule of thumb, from the simulator: on 16 GPUs in two nodes, TP16 (TP
    across the nodes) is slower than TP8 x PP2 (TP inside, PP across)."""
    from pagedserve.cli import main

    out = tmp_path / "tune.json"
    assert main(["tune", "--model", "deepseek-v3", "--gpu", "H200", "--layouts", "TP16,TP8xPP2,TP8",
                 "--dataset", "random", "--random-input-len", "512", "--random-output-len", "64",
                 "--num-prompts", "64", "--max-num-seqs", "64", "--max-model-len", "2048",
                 "--json", str(out)]) == 0
    points = {p["knobs"]["layout"]: p for p in json.loads(out.read_text())["simulated"]}
    assert set(points) == {"TP16", "TP8xPP2", "TP8"} and not any(p["error"] for p in points.values())
    assert points["TP8xPP2"]["output_throughput"] > points["TP16"]["output_throughput"]
    text = capsys.readouterr().out
    assert "sweet spot" in text and "--tensor-parallel-size" in text
