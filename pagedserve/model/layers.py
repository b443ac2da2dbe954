"""Linear layers whose GEMM implementation (a LinearMethod) is chosen once, after the weights load.

Invariants:
- Until `Linear.use(method)` is called a Linear is exactly nn.Linear (F.linear on a plain
  [out, in] weight), so checkpoint loading sees ordinary parameters.
- After it, `weight` holds the form the method wants (plain, transposed in memory, a
  oneDNN-prepacked copy, or our GEMM's column panels) in place of the plain one: never both, so packing costs no memory;
  and forward(x) equals F.linear(x, plain_weight, bias) up to the rounding of the compute dtype.
- A method is only offered where it can run (`available`) and only for the weight shapes it can
  pack (`supports`); "torch" runs everywhere and is the only one used off CPU.
- The method of each distinct weight shape comes from PAGEDSERVE_LINEAR_METHOD: 'auto' (the
  default) applies `rule_method`, derived from benchmarks/gemm_survey.py and cpu_gemm.py on this project's CPUs
  and deterministic (the same machine always computes the same numbers); 'probe' times every
  available method on the machine at hand at load (`probe_methods`) and keeps the fastest per
  shape; a method name forces that method for the shapes it supports (the rule picks for the rest).
"""
from __future__ import annotations

import functools
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.cpu_isa import CpuFeatures, cpu_features
from pagedserve.model.cpu import gemm
from pagedserve.native import NativeUnavailable
from pagedserve.scratch import ScratchOutput

logger = logging.getLogger("pagedserve.model")


class LinearMethod:
    """How one linear layer's GEMM runs: `pack` once at load, `apply` every forward."""

    name: ClassVar[str]

    def available(self, dtype: torch.dtype, device: torch.device) -> bool:
        raise NotImplementedError

    def supports(self, shape: tuple[int, int]) -> bool:
        """Whether a weight of this (out, in) shape can be packed for this method."""
        return True

    def pack(self, weight: torch.Tensor) -> torch.Tensor:
        return weight

    def apply(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        raise NotImplementedError

    def apply_into(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                   scratch: ScratchOutput) -> torch.Tensor:
        """`apply`, the output in `scratch`'s tensor where the method can write one (else a new one)."""
        return self.apply(x, weight, bias)


class TorchLinear(LinearMethod):
    """F.linear on the [out, in] weight: MKL sgemm for fp32 on CPU, oneDNN matmul for bf16
    (reordering the weight on every call), cuBLAS on CUDA."""

    name = "torch"

    def available(self, dtype, device) -> bool:
        return True

    def apply(self, x, weight, bias):
        return F.linear(x, weight, bias)


class TransposedTorchLinear(TorchLinear):
    """F.linear on an [out, in] weight stored column-major ([in, out] in memory), so the BLAS
    reads B untransposed; on small in-features (K <= 768) this was up to 1.6x faster than the
    row-major weight at M <= 32 in the survey, and equal on large K."""

    name = "torch-t"

    def pack(self, weight):
        return weight.detach().t().contiguous().t()


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


class CppPackedLinear(LinearMethod):
    """pagedserve's own GEMM (model/cpu/gemm.cpp): the weight packed once into panels of output
    columns that one pass streams linearly while up to 8 rows of x reuse every load from
    registers. Made for decode batches (M = 1-64), where MKL and oneDNN leave most of the
    core idle; 0.8-1.0x them at prefill sizes (benchmarks/cpu_gemm.py). fp32 everywhere; bf16
    (vdpbf16ps, fp32 accumulation) only where the CPU reports AVX512-BF16 at run time and the
    library, built with -march=native, has the kernel."""

    name = "cpp"

    def available(self, dtype, device) -> bool:
        if device.type != "cpu":
            return False
        if dtype == torch.bfloat16:
            return cpu_features().avx512_bf16 and _cpp_gemm_panel_width(torch.bfloat16) > 0
        return dtype == torch.float32 and _cpp_gemm_panel_width() > 0

    def supports(self, shape) -> bool:
        # One shape rule for both dtypes: where the bf16 kernel exists its panels are as wide.
        width = _cpp_gemm_panel_width()
        bf16_width = _cpp_gemm_panel_width(torch.bfloat16)
        return width > 0 and shape[0] % width == 0 and (not bf16_width or shape[0] % bf16_width == 0)

    def pack(self, weight):
        return gemm.pack(weight.detach().contiguous())

    def apply(self, x, weight, bias):
        return gemm.linear(x, weight, bias)

    def apply_into(self, x, weight, bias, scratch):
        return gemm.linear(x, weight, bias, scratch)


@functools.cache
def _cpp_gemm_panel_width(dtype: torch.dtype = torch.float32) -> int:
    """The compiled GEMM's panel width for `dtype`, or 0 (with one warning) where it cannot build here."""

    try:
        return gemm.panel_width(dtype)
    except NativeUnavailable as e:
        if dtype == torch.float32:
            logger.warning("CPU GEMM kernel unavailable, linear layers use torch/oneDNN: %s", e)
        return 0


LINEAR_METHODS: dict[str, LinearMethod] = {m.name: m for m in (TorchLinear(), TransposedTorchLinear(),
                                                                 OneDNNPackedLinear(), CppPackedLinear())}


class Linear(nn.Module):
    """nn.Linear's parameters and names (`weight` [out, in], optional `bias`), run by a LinearMethod."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.method: LinearMethod = LINEAR_METHODS["torch"]
        # Set by a model whose every reader of this layer's output is done before the layer
        # runs again (pagedserve/scratch.py); None: a new output tensor per call.
        self.scratch: ScratchOutput | None = None

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
        # The weight and bias read from their dicts: `self.weight` on a registered buffer or
        # parameter first fails the ordinary lookup (an AttributeError built and dropped), then
        # runs nn.Module.__getattr__ — ~0.6 µs, 17 times a step on a 4-layer model.
        weight = self._buffers.get("weight")
        if weight is None:
            weight = self._parameters["weight"]
        if self.scratch is None:
            return self.method.apply(x, weight, self._parameters.get("bias"))
        return self.method.apply_into(x, weight, self._parameters.get("bias"), self.scratch)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, " \
               f"bias={self.bias is not None}, method={self.method.name}"


METHOD_ENV = "PAGEDSERVE_LINEAR_METHOD"
PROBE_ROWS = (1, 8, 32)  # decode batch sizes; prefill-sized M is fast with every packed method
PROBE_ROUNDS = 3


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
    """PAGEDSERVE_LINEAR_METHOD: 'auto' (default), 'probe', or a method name."""
    value = os.environ.get(METHOD_ENV, "auto").strip() or "auto"
    if value not in ("auto", "probe") and value not in LINEAR_METHODS:
        raise ValueError(f"{METHOD_ENV}: must be 'auto', 'probe' or one of {sorted(LINEAR_METHODS)}, got {value!r}")
    return value


SMALL_IN_FEATURES = 768


def rule_method(shape: tuple[int, int], dtype: torch.dtype, names: list[str], amx: bool = False) -> str:
    """What the survey found fastest on CPU (benchmarks/README.md, "GEMM survey"), among `names`
    (the methods that can run this shape here):
    bf16: pagedserve's packed-panel kernel where it has its AVX512-BF16 path (one thread, warm:
    1.3-2.3x prepacked oneDNN at M = 1-8, 1.1-1.3x at 32, 1.0-1.05x at 256, 0.94-0.99x at 2048:
    benchmarks/README.md, "bf16 GEMM: small M and the prefill tile"),
    except on an AMX CPU (`amx`; not measured here: oneDNN's tiles do 16x the work per
    instruction), else prepacked oneDNN (AMX / AVX512-BF16 kernels on a pre-blocked weight);
    fp32: pagedserve's packed-panel kernel (1.1-2.4x oneDNN and MKL at M = 8-32, about equal at
    M = 256, 0.8-1.0x at M = 1); where it cannot build or the shape does not fit its panels, a
    column-major weight for small in-features (MKL reads B untransposed; 1.1-1.6x on K=256/688)
    and prepacked oneDNN for the rest."""
    _, in_features = shape
    if (dtype == torch.float32 or (dtype == torch.bfloat16 and not amx)) and "cpp" in names:
        return "cpp"
    if dtype == torch.float32 and in_features <= SMALL_IN_FEATURES and "torch-t" in names:
        return "torch-t"
    if dtype in (torch.float32, torch.bfloat16) and "onednn" in names:
        return "onednn"
    return "torch"


Timer = Callable[[LinearMethod, torch.Tensor, torch.Tensor], float]


def time_once(method: LinearMethod, x: torch.Tensor, packed: torch.Tensor) -> float:
    start = time.perf_counter()
    method.apply(x, packed, None)
    return time.perf_counter() - start


def probe_methods(shape: tuple[int, int], dtype: torch.dtype, names: list[str],
                  timer: Timer = time_once) -> tuple[str, dict[str, float]]:
    """Time each method on a random weight of `shape` at every PROBE_ROWS batch size, the methods
    interleaved so a burst of other load hits them alike; keep each one's best time.

    Score = sum over M of (time / fastest method's time at that M): every batch size counts
    the same, however long its GEMM takes. Returns (winner, scores)."""
    n, k = shape
    gen = torch.Generator().manual_seed(n * 7919 + k)
    weight = (torch.randn(n, k, generator=gen) * 0.02).to(dtype)
    packed = {name: LINEAR_METHODS[name].pack(weight) for name in names}
    inputs = {m: torch.randn(m, k, generator=gen).to(dtype) for m in PROBE_ROWS}
    best = {(name, m): float("inf") for name in names for m in PROBE_ROWS}
    with torch.inference_mode():
        for round_ in range(PROBE_ROUNDS + 1):  # round 0 warms up (oneDNN primitive creation)
            for m, x in inputs.items():
                for name in names:
                    seconds = timer(LINEAR_METHODS[name], x, packed[name])
                    if round_:
                        best[(name, m)] = min(best[(name, m)], seconds)
    fastest = {m: max(min(best[(name, m)] for name in names), 1e-12) for m in PROBE_ROWS}
    scores = {name: sum(best[(name, m)] / fastest[m] for m in PROBE_ROWS) for name in names}
    return min(names, key=lambda name: scores[name]), scores


def choose_linear_methods(shapes: list[tuple[int, int]], dtype: torch.dtype, device: torch.device,
                          features: CpuFeatures | None = None, timer: Timer = time_once) -> LinearChoice:
    requested = requested_method()
    names = [name for name, method in LINEAR_METHODS.items() if method.available(dtype, device)]
    fits = {s: [name for name in names if LINEAR_METHODS[name].supports(s)] for s in shapes}
    if requested in LINEAR_METHODS:
        if requested not in names:
            raise ValueError(f"{METHOD_ENV}: {requested!r} cannot run {dtype} on {device.type} here")
        misfits = [s for s in shapes if requested not in fits[s]]
        methods = {s: requested if s not in misfits else rule_method(s, dtype, fits[s]) for s in shapes}
        reason = f"{METHOD_ENV}={requested}"
        if misfits:
            reason += f"; by rule for the shapes it cannot pack: {', '.join(f'{n}x{k}' for n, k in misfits)}"
        return LinearChoice(methods, reason)
    if device.type != "cpu" or len(names) == 1:
        return LinearChoice({s: "torch" for s in shapes}, f"{device.type}: the only method")
    features = features or cpu_features()
    amx = features.amx_bf16 and features.amx_tile
    where = f"{str(dtype).removeprefix('torch.')} on {features.describe()}"
    if requested == "auto":
        return LinearChoice({s: rule_method(s, dtype, fits[s], amx) for s in shapes}, f"{where}, by rule")
    start = time.perf_counter()
    methods = {shape: probe_methods(shape, dtype, fits[shape], timer)[0] for shape in shapes}
    return LinearChoice(methods, f"{where}, fastest of {'/'.join(names)} at M={'/'.join(map(str, PROBE_ROWS))} "
                                 f"in a {time.perf_counter() - start:.2f} s probe")


def prepare_linear_layers(model: nn.Module, dtype: torch.dtype, device: torch.device,
                          features: CpuFeatures | None = None) -> LinearChoice:
    """Pick each Linear's method by weight shape and pack its weight; logs the choice once."""
    layers = [m for m in model.modules() if isinstance(m, Linear)]
    shapes = list(dict.fromkeys((m.out_features, m.in_features) for m in layers))
    choice = choose_linear_methods(shapes, dtype, device, features)
    for layer in layers:
        method = LINEAR_METHODS[choice.methods[(layer.out_features, layer.in_features)]]
        if method is not layer.method:
            layer.use(method)
    logger.info("linear layers: %s", choice.summary())
    return choice
