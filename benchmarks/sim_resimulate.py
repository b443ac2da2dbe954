"""A cost-model change before / after on the same live runs, no server started: refit the stored round-0
calibration traces of the last `sim_vs_real.py` run (results/sim_vs_real/calib0_*) with this checkout's
`simulate calibrate`, re-simulate the held-out workloads stored in results/sim_vs_real.json with it, and print
each goal metric's error against the stored real medians. Run it from two checkouts (PYTHONPATH) to compare
what a change to the fit or the simulator does on identical traces.

    OMP_NUM_THREADS=1 python benchmarks/sim_resimulate.py [--results results/sim_vs_real.json]

(CPU calibrations time the engine's block copy at fit time when the trace has no swap cost to fit: that one
figure is measured now, on whatever the machine is doing.)
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import sim_vs_real as S  # noqa: E402
from common import ROOT, benchmark_checkpoint  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--results", type=Path, default=ROOT / "results" / "sim_vs_real.json")
    ap.add_argument("--size", default="20m")
    ap.add_argument("--calibrate-flag", action="append", default=[],
                    help="a further `simulate calibrate` flag for the refit (e.g. --step-spread); repeatable")
    args = ap.parse_args()
    stored = json.loads(args.results.read_text())
    work = args.results.parent / "sim_vs_real"
    model = benchmark_checkpoint(args.size)
    phases = [name for name, _, _ in S.CALIBRATION]
    traces = [work / f"calib0_{p}.jsonl" for p in phases]
    benches = [work / f"calib0_{p}.bench.json" for p in phases]
    with tempfile.TemporaryDirectory() as tmp:
        cost = Path(tmp) / "cost.json"
        fitted = S.fit_cost(model, traces, benches, cost, args.calibrate_flag)
        print("\n".join(line for line in fitted.splitlines()[:6]))
        by_name = {w.name: w for w in S.workloads(stored["rate_for_busy"])}
        rows, errors = [], []
        for entry in stored["workloads"]:
            w = by_name.get(entry["name"])
            if w is None:
                print(f"{entry['name']}: not a workload of this checkout, skipped")
                continue
            sim = S.simulate_workload(model, cost, w)
            real = entry["real_median"]
            rows.append((w, real, sim))
            errs = {k: S.error(sim[k], real[k]) for k in S.GOAL_KEYS}
            errors += [abs(e) for e in errs.values() if e is not None]
            print(f"{w.name}: " + ", ".join(f"{k} {S.fmt_err(e)}" for k, e in errs.items()))
    met, total = S.goals_met(rows)
    print(f"{met} of {total} within 10%; mean |error| {sum(errors) / max(len(errors), 1):.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
