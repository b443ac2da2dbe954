"""Linear layers whose GEMM implementation (a LinearMethod) is chosen once, after the weights load.

Invariants:
- Until `Linear.use(method)` is called a Linear is exactly nn.Linear (F.linear on a plain
  [out, in] weight), so checkpoint loading sees ordinary parameters.
- After it, `weight` holds the form the method wants (plain, or a oneDNN-prepacked copy that
  replaces the plain one: never both, so packing costs no memory) and forward(x) equals
  F.linear(x, plain_weight, bias) up to the rounding of the compute dtype.
- A method is only offered where it can run (`available`); "torch" runs everywhere and is
  the fallback.
"""
from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.cpu_isa import CpuFeatures, cpu_features

logger = logging.getLogger("pagedserve.model")


class LinearMethod:
    """How one linear layer's GEMM runs: `pack` once at load, `apply` every forward."""

    name: ClassVar[str]

    def available(self, dtype: torch.dtype, device: torch.device) -> bool:
        raise NotImplementedError

    def pack(self, weight: torch.Tensor) -> torch.Tensor:
        return weight

    def apply(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        raise NotImplementedError


class TorchLinear(LinearMethod):
    """F.linear on the [out, in] weight: MKL sgemm for fp32 on CPU, oneDNN matmul for bf16
    (reordering the weight on every call), cuBLAS on CUDA."""

    name = "torch"

    def available(self, dtype, device) -> bool:
        return True

    def apply(self, x, weight, bias):
        return F.linear(x, weight, bias)


class OneDNNPackedLinear(LinearMethod):
    """oneDNN inner product on a weight reordered once into the blocked layout its kernel reads
    (AMX tiles for bf16 where the CPU has them), so no per-call weight reorder or transpose."""

    name = "onednn"

    def available(self, dtype, device) -> bool:
        if device.type != "cpu" or not torch.backends.mkldnn.is_available():
            return False
        if dtype == torch.bfloat16:
            return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
        return dtype == torch.float32

    def pack(self, weight):
        # No batch-size hint: the packed layout must serve every M the scheduler produces.
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach())

    def apply(self, x, weight, bias):
        if x.dim() != 2:
            lead = x.shape[:-1]
            return self.apply(x.reshape(-1, x.shape[-1]), weight, bias).reshape(*lead, -1)
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


LINEAR_METHODS: dict[str, LinearMethod] = {m.name: m for m in (TorchLinear(), OneDNNPackedLinear())}


class Linear(nn.Module):
    """nn.Linear's parameters and names (`weight` [out, in], optional `bias`), run by a LinearMethod."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.method: LinearMethod = LINEAR_METHODS["torch"]

    def use(self, method: LinearMethod) -> None:
        """Switch to `method`, packing the weight in place of the plain one."""
        if self.method is not LINEAR_METHODS["torch"]:
            raise RuntimeError("Linear.use: the weight is already packed; a layer is packed once")
        with torch.no_grad():
            packed = method.pack(self.weight.data)
        if packed is not self.weight.data:
            del self.weight
            self.register_buffer("weight", packed, persistent=False)
        self.method = method

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.method.apply(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, " \
               f"bias={self.bias is not None}, method={self.method.name}"


METHOD_ENV = "PAGEDSERVE_LINEAR_METHOD"


@dataclass(frozen=True)
class LinearChoice:
    """The method each distinct weight shape (out, in) runs with, and why."""

    methods: dict[tuple[int, int], str]
    reason: str

    def summary(self) -> str:
        by_method: dict[str, list[str]] = {}
        for (n, k), name in self.methods.items():
            by_method.setdefault(name, []).append(f"{n}x{k}")
        parts = [f"{name} for {', '.join(shapes)}" for name, shapes in by_method.items()]
        return f"{'; '.join(parts)} ({self.reason})"


def requested_method() -> str:
    """PAGEDSERVE_LINEAR_METHOD: 'auto' (default) or a method name, checked before anything loads."""
    value = os.environ.get(METHOD_ENV, "auto").strip() or "auto"
    if value != "auto" and value not in LINEAR_METHODS:
        raise ValueError(f"{METHOD_ENV}: must be 'auto' or one of {sorted(LINEAR_METHODS)}, got {value!r}")
    return value


def rule_for(dtype: torch.dtype, device: torch.device, features: CpuFeatures) -> tuple[str, str]:
    """The method the survey (benchmarks/gemm_survey.py) found fastest for this dtype and ISA."""
    if device.type != "cpu":
        return "torch", f"{device.type}"
    if dtype == torch.bfloat16 and features.fast_bf16 and LINEAR_METHODS["onednn"].available(dtype, device):
        return "onednn", f"bfloat16 on {features.describe()}: prepacked oneDNN weights"
    return "torch", f"{str(dtype).removeprefix('torch.')} on {features.describe()}"


def choose_linear_methods(shapes: list[tuple[int, int]], dtype: torch.dtype, device: torch.device,
                          features: CpuFeatures | None = None) -> LinearChoice:
    features = features or cpu_features()
    requested = requested_method()
    if requested != "auto":
        if not LINEAR_METHODS[requested].available(dtype, device):
            raise ValueError(f"{METHOD_ENV}: {requested!r} cannot run {dtype} on {device.type} here")
        return LinearChoice({s: requested for s in shapes}, f"{METHOD_ENV}={requested}")
    name, reason = rule_for(dtype, device, features)
    return LinearChoice({s: name for s in shapes}, reason)


def prepare_linear_layers(model: nn.Module, dtype: torch.dtype, device: torch.device,
                          features: CpuFeatures | None = None) -> LinearChoice:
    """Pick each Linear's method by weight shape and pack its weight; logs the choice once."""
    layers = [m for m in model.modules() if isinstance(m, Linear)]
    shapes = list(dict.fromkeys((m.out_features, m.in_features) for m in layers))
    choice = choose_linear_methods(shapes, dtype, device, features)
    start = time.perf_counter()
    for layer in layers:
        method = LINEAR_METHODS[choice.methods[(layer.out_features, layer.in_features)]]
        if method is not layer.method:
            layer.use(method)
    logger.info("linear layers: %s; packed in %.2f s", choice.summary(), time.perf_counter() - start)
    return choice
