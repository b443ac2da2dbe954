"""The simulator's per-layer kernel prices beside public per-kernel measurements: the kernel-level check of
the GPU presets' device model (issue 31).

    python benchmarks/sim_kernel_check.py                   # the check, before / after the kernel profiles
    python benchmarks/sim_kernel_check.py --derive          # re-derive cost_params.KERNEL_PROFILES from the CSVs
    python benchmarks/sim_kernel_check.py --vidur ~/vidur   # a checkout of https://github.com/microsoft/vidur

The measurements are Vidur's (Agrawal et al., MLSys 2024): data/profiling/compute/{h100,a100}/<org>/<model>/
mlp.csv, the CUDA kernel durations of one decoder layer of sarathi-serve's fp16 layers at 1..4,096 tokens and
TP 1/2/4/8 (columns time_stats.<op>.median, ms). They are read from a Vidur checkout or a bare git mirror of it
(--vidur; default $VIDUR or /work/.mirror/microsoft+vidur/repo); nothing of them is stored in this repository
but the figures cost_params.KERNEL_PROFILES derives (--derive shows the derivation reproduces them).

Per chip, model, TP degree and token count M, the simulator's price of one layer's parts next to the measured:
the four GEMMs (QKV, O, gate/up, down) summed, and each elementwise kernel Vidur times (its two RMSNorms,
rotary, SiLU-and-mul, the residual add); "before" is the preset without its kernel profile (the stated
roofline: GEMMs at peak x matmul_share x MFU 0.6, weights at bandwidth x mem_share x MBU 0.7, one max(); the
elementwise kernels not priced, only their launches), "after" with it. Launch gaps are not in either side: a
CUPTI kernel duration does not hold the idle time between kernels (cost_params.KERNEL_LAUNCH_S prices that).
phi-2 is left out (a GELU MLP; the simulator's shapes are gated). The vLLM column is what the simulator charges
a layer of vLLM's kernels (two fused add + RMSNorm, rotary, SiLU-and-mul), for comparison with Vidur's five.
"""
from __future__ import annotations

import argparse
import csv
import io
import math
import os
import statistics
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pagedserve.plan.gpus import get_gpu  # noqa: E402
from pagedserve.plan.kv_budget import ModelShape  # noqa: E402
from pagedserve.sim import cost_params  # noqa: E402
from pagedserve.sim.cost_model import CostModel, CostParams, ModelCost, StepFeatures  # noqa: E402
from pagedserve.sim.cost_params import ELEMENTWISE_BYTES_PER_WIDTH, elementwise_seconds  # noqa: E402
from pagedserve.sim.step_work import elementwise_kernels, gemm_kernel_count  # noqa: E402

CHIPS = {"h100": "H100-SXM", "a100": "A100-80GB"}
GEMMS = ("attn_pre_proj", "attn_post_proj", "mlp_up_proj", "mlp_down_proj")
# Vidur's timed elementwise ops -> the simulator's kind
ELEMENTWISE = {"input_layernorm": "norm", "post_attention_layernorm": "norm", "attn_rope": "rope", "mlp_act": "act",
               "add": "add"}
# log-spaced token counts that are on Vidur's grid (1, 2, 4, every 8 to 1,024, every 16 to 2,048, every 32 to 4,096)
GRID = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096)
SHOWN = (1, 8, 64, 128, 256, 512, 1024, 4096)
ACT = 2  # fp16
DEFAULT_VIDUR = "/work/.mirror/microsoft+vidur/repo"


# -- reading Vidur's profiles ----------------------------------------------------------------------------------------
def _list(vidur: Path) -> list[str]:
    if (vidur / "data" / "profiling").is_dir():
        return [str(p.relative_to(vidur)) for p in (vidur / "data" / "profiling" / "compute").glob("*/*/*/mlp.csv")]
    out = subprocess.run(["git", "--git-dir", str(vidur), "ls-tree", "-r", "--name-only", "HEAD",
                          "data/profiling/compute"], check=True, capture_output=True, text=True).stdout
    return [p for p in out.split() if p.endswith("/mlp.csv")]


def _read(vidur: Path, rel: str) -> str:
    if (vidur / rel).is_file():
        return (vidur / rel).read_text()
    return subprocess.run(["git", "--git-dir", str(vidur), "show", f"HEAD:{rel}"], check=True, capture_output=True,
                          text=True).stdout


def load(vidur: Path) -> dict[tuple[str, str], list[dict]]:
    """(chip, model) -> rows: the op medians in seconds, the shape, M (num_tokens) and TP."""
    data = {}
    for rel in sorted(_list(vidur)):
        chip, model = rel.split("/")[3], rel.split("/")[5]
        if chip not in CHIPS or model == "phi-2":
            continue
        rows, seen = [], set()
        for r in csv.DictReader(io.StringIO(_read(vidur, rel))):
            key = (r["num_tokens"], r["num_tensor_parallel_workers"])
            if r["use_gated_mlp"] != "True" or key in seen:  # 4,096 tokens is on two of Vidur's ranges: one row
                continue
            seen.add(key)
            t = {k.split(".")[1]: float(v) * 1e-3 for k, v in r.items()
                 if k.startswith("time_stats.") and k.endswith(".median") and v}
            rows.append({"t": t, "h": int(r["n_embd"]), "I": int(r["n_expanded_embd"]), "nh": int(r["n_head"]),
                         "nkv": int(r["n_kv_head"]), "V": int(r["vocab_size"]), "m": int(r["num_tokens"]),
                         "tp": int(r["num_tensor_parallel_workers"])})
        if rows:
            data[(chip, model)] = rows
    return data


def layer_shape(r: dict) -> ModelShape:
    return ModelShape(num_layers=1, hidden_size=r["h"], num_attention_heads=r["nh"], num_kv_heads=r["nkv"],
                      head_dim=r["h"] // r["nh"], intermediate_size=r["I"], vocab_size=r["V"])


def widths(r: dict) -> dict[str, float]:
    """Each Vidur op's row width in bytes (cost_params.ELEMENTWISE_BYTES_PER_WIDTH gives bytes per width)."""
    d, tp = r["h"] // r["nh"], r["tp"]
    return {"input_layernorm": r["h"] * ACT, "post_attention_layernorm": r["h"] * ACT,
            "attn_rope": (r["nh"] + r["nkv"]) // tp * d * ACT, "mlp_act": r["I"] // tp * ACT, "add": r["h"] * ACT,
            "emb": r["h"] * ACT}


# -- the derivation of KERNEL_PROFILES ------------------------------------------------------------------------------
def _lstsq2(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """y = a + b x, least squares."""
    n, sx, sy = len(xs), sum(xs), sum(ys)
    sxx, sxy = sum(x * x for x in xs), sum(x * y for x, y in zip(xs, ys))
    b = (n * sxy - sx * sy) / (n * sxx - sx * sx)
    return (sy - b * sx) / n, b


def _gemm_points(rows: list[dict]) -> list[tuple[int, float, float, float]]:
    """(M, layer FLOPs, layer weight bytes, measured seconds of the four GEMMs) per row on the grid."""
    out = []
    for r in rows:
        if r["m"] in GRID:
            params = ModelCost.from_shape(layer_shape(r), "bfloat16", None, r["tp"]).linear_params_per_rank
            out.append((r["m"], 2.0 * r["m"] * params, 2.0 * params, sum(r["t"][g] for g in GEMMS)))
    return out


def curve_time(fl: float, wb: float, kernels: int, curve: dict) -> float:
    tc, tm = fl / curve["tflops"], wb / curve["tbps"]
    return kernels * curve["kernel_s"] + cost_params.soft_roofline(tc, tm, curve["exponent"])


def derive(data) -> dict:
    """cost_params.KERNEL_PROFILES from the CSVs, by the procedure its comment states."""
    profiles, points = {}, {}
    for chip, preset in CHIPS.items():
        pts = [p for (c, _), rows in data.items() if c == chip for p in _gemm_points(rows)]
        one = [p for p in pts if p[0] == 1]
        a, b = _lstsq2([p[2] for p in one], [p[3] for p in one])  # t = 4 kernel_s + bytes / tbps
        tflops = statistics.median(p[1] / p[3] for p in pts if p[0] >= 2048)
        profiles[preset] = {"gemm": {"tflops": tflops, "tbps": 1.0 / b, "kernel_s": a / 4}, "elementwise": {}}
        points[preset] = pts
        for kind, ops in (("norm", ("input_layernorm", "post_attention_layernorm")), ("rope", ("attn_rope",)),
                          ("act", ("mlp_act",)), ("add", ("add",)), ("emb", ("emb",))):
            small, big = [], []
            for (c, _), rows in data.items():
                if c != chip:
                    continue
                for r in rows:
                    if r["m"] not in GRID or (kind == "emb" and r["tp"] != 1):  # TP > 1: sarathi's masked lookup
                        continue
                    w = widths(r)
                    for op in ops:
                        row = ELEMENTWISE_BYTES_PER_WIDTH[kind] * w[op]
                        if r["m"] <= 8:
                            small.append((row, r["t"][op]))
                        if r["m"] >= 2048:
                            big.append(r["m"] * row / r["t"][op])
            floor_s, slope = _lstsq2([x for x, _ in small], [y for _, y in small])
            if slope <= 0:  # no dependence on the row: the median small-M duration
                floor_s, slope = statistics.median(y for _, y in small), 0.0
            profiles[preset]["elementwise"][kind] = [floor_s, 1.0 / slope if slope else 0.0, statistics.median(big)]
    # one exponent for both chips: the least log error over every point
    def err(p):
        e = [math.log(curve_time(fl, wb, 4, {**profiles[k]["gemm"], "exponent": p}) / t)
             for k, pts in points.items() for _, fl, wb, t in pts]
        return math.sqrt(sum(x * x for x in e) / len(e))
    best = min((round(1.0 + 0.05 * i, 2) for i in range(41)), key=err)
    for prof in profiles.values():
        prof["gemm"]["exponent"] = best
    return profiles


def show_derivation(data) -> None:
    got = derive(data)
    print("Derived from the CSVs (beside cost_params.KERNEL_PROFILES):\n")
    for preset, prof in got.items():
        code = cost_params.KERNEL_PROFILES.get(preset, {})
        g, cg = prof["gemm"], code.get("gemm", {})
        print(f"{preset}: gemm tflops {g['tflops'] / 1e12:.1f} (code {cg.get('tflops', 0) / 1e12:.1f}), "
              f"tbps {g['tbps'] / 1e12:.3f} ({cg.get('tbps', 0) / 1e12:.3f}), kernel_s {g['kernel_s'] * 1e6:.2f} us "
              f"({cg.get('kernel_s', 0) * 1e6:.2f}), exponent {g['exponent']} ({cg.get('exponent')})")
        for kind, (f0, row_bps, bps) in prof["elementwise"].items():
            c = code.get("elementwise", {}).get(kind, [0, 0, 0])
            print(f"  {kind:5s} floor {f0 * 1e6:.2f} us ({c[0] * 1e6:.2f}), row {row_bps / 1e9:.1f} GB/s "
                  f"({c[1] / 1e9:.1f}), bandwidth {bps / 1e12:.2f} TB/s ({c[2] / 1e12:.2f})")


# -- the check -------------------------------------------------------------------------------------------------------
def cost_models(preset: str) -> tuple[CostParams, CostParams]:
    gpu = get_gpu(preset)
    after = CostParams.for_gpu(gpu)
    before = replace(after, gemm_curve={}, elementwise={})
    return before, after


def layer_prices(r: dict, before: CostParams, after: CostParams) -> dict:
    shape = layer_shape(r)
    model = ModelCost.from_shape(shape, "bfloat16", None, r["tp"])
    model = replace(model, gemm_kernels_per_step=gemm_kernel_count(shape, last_stage=False),
                    elementwise_kernels=elementwise_kernels(shape, r["tp"], ACT, first_stage=False, last_stage=False))
    m = r["m"]
    f = StepFeatures(m, 1, 0, 2.0 * m * model.linear_params_per_rank, 2.0 * model.linear_params_per_rank,
                     0.0, 0.0, 0.0, 0)
    w = widths(r)
    out = {"gemm": (sum(r["t"][g] for g in GEMMS), CostModel(model, before).gemm_time(f),
                    CostModel(model, after).gemm_time(f))}
    for op, kind in ELEMENTWISE.items():
        out[op] = (r["t"][op], 0.0, elementwise_seconds(after.elementwise, kind, m, w[op]))
    out["elementwise"] = tuple(sum(out[op][i] for op in ELEMENTWISE) for i in range(3))
    out["vllm_layer"] = CostModel(model, after).elementwise_time(m)
    return out


def check(data, holdout: bool = False) -> dict:
    """The tables. `holdout`: each model's "after" from figures derived without it (leave one model out)."""
    ratios: dict[tuple[str, str], dict[str, list[float]]] = {}
    for (chip, model), rows in sorted(data.items()):
        preset = CHIPS[chip]
        before, after = cost_models(preset)
        if holdout:
            prof = derive({k: v for k, v in data.items() if k != (chip, model)})[preset]
            after = replace(after, gemm_curve=prof["gemm"], elementwise=prof["elementwise"])
        print(f"\n### {preset} {model}\n")
        print("| TP | M | GEMMs measured us | before | after | elementwise measured us (norm x2, rope, act, add) "
              "| after | vLLM layer after |")
        print("|---:|---:|---:|---:|---:|---:|---:|---:|")
        for r in sorted(rows, key=lambda r: (r["tp"], r["m"])):
            if r["m"] not in GRID:
                continue
            got = layer_prices(r, before, after)
            cell = ratios.setdefault((preset, "GEMMs"), {"before": [], "after": []})
            cell["before"].append(got["gemm"][1] / got["gemm"][0])
            cell["after"].append(got["gemm"][2] / got["gemm"][0])
            for part in list(ELEMENTWISE) + ["elementwise"]:
                cell = ratios.setdefault((preset, part), {"before": [], "after": []})
                cell["before"].append(got[part][1] / got[part][0])
                cell["after"].append(got[part][2] / got[part][0])
            if r["m"] in SHOWN:
                g, e = got["gemm"], got["elementwise"]
                print(f"| {r['tp']} | {r['m']} | {g[0] * 1e6:.1f} | {g[1] * 1e6:.1f} ({g[1] / g[0]:.2f}) | "
                      f"{g[2] * 1e6:.1f} ({g[2] / g[0]:.2f}) | {e[0] * 1e6:.1f} | {e[2] * 1e6:.1f} ({e[2] / e[0]:.2f}) | "
                      f"{got['vllm_layer'] * 1e6:.1f} |")
    print("\n## Simulated / measured per layer, every model, TP and token count on the grid "
          f"({len(GRID)} counts, 1..4,096)" + (": after = each model priced by figures derived without it" if holdout
                                               else "") + "\n")
    print("| chip | part | points | before: median (p10-p90) | median \\|error\\| | after: median (p10-p90) "
          "| median \\|error\\| |")
    print("|---|---|---:|---|---:|---|---:|")
    summary = {}
    for (preset, part), cell in ratios.items():
        row = {k: _stats(v) for k, v in cell.items()}
        summary[f"{preset} {part}"] = row
        b, a = row["before"], row["after"]
        print(f"| {preset} | {part} | {len(cell['after'])} | {b['median']:.2f} ({b['p10']:.2f}-{b['p90']:.2f}) | "
              f"{b['abs_err']:.1%} | {a['median']:.2f} ({a['p10']:.2f}-{a['p90']:.2f}) | {a['abs_err']:.1%} |")
    return summary


def _stats(v: list[float]) -> dict:
    s = sorted(v)
    q = lambda f: s[min(len(s) - 1, int(f * len(s)))]  # noqa: E731
    return {"median": statistics.median(s), "p10": q(0.1), "p90": q(0.9),
            "abs_err": statistics.median(abs(x - 1) for x in s)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vidur", default=os.environ.get("VIDUR", DEFAULT_VIDUR),
                    help="a checkout of github.com/microsoft/vidur, or a bare git mirror of it")
    ap.add_argument("--derive", action="store_true", help="re-derive cost_params.KERNEL_PROFILES and stop")
    ap.add_argument("--holdout", action="store_true",
                    help="price each model with figures derived from the other models only (leave one model out)")
    args = ap.parse_args()
    vidur = Path(args.vidur).expanduser()
    if not vidur.exists():
        print(f"no Vidur at {vidur}: git clone https://github.com/microsoft/vidur and pass --vidur", file=sys.stderr)
        return 2
    data = load(vidur)
    if args.derive:
        show_derivation(data)
        return 0
    check(data, args.holdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
