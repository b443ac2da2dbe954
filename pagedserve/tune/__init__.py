"""`pagedserve tune`: sweep knobs on the simulator (or the real engine), keep the Pareto front,
pick the sweet spot. `tuner` is the pure sweep logic, `cli` the sub-command. The advisor
(metrics → knob) is its own package, pagedserve/advise/."""
