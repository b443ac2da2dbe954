"""Load generation: workloads shared by `pagedserve bench` (real servers) and `pagedserve simulate`."""
