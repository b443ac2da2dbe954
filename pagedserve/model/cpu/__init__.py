"""C++ kernels for the model's CPU path (built at first use by pagedserve/native.py): the
skinny-GEMM linear layer (gemm.py / gemm.cpp) and the fused elementwise ops (fused.py / fused.cpp).
Each has a torch reference the model falls back to, with one log line, where it cannot build."""
