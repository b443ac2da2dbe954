"""`pagedserve simulate`: the real core/ scheduler driven on a virtual clock, with a
cost model (sim.cost_model) in place of the model runner. Torch-free."""
