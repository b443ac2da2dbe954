"""An op's output tensor kept and rewritten call after call, for outputs whose every reader
is done before the op runs again.

A decode step on a small model is a few hundred small native calls, and `torch.empty` costs
~13 k instructions each (the Python argument parser, the dispatcher, the allocator): more than
many of the kernels. The decoder layer's own intermediates (the normed input, q/k/v, the
attention output, o_proj's output, gate/up and SiLU * up) are read only by the next op of the
same layer, so the module that makes one can keep it and hand the same tensor back to its
kernel the next step, at the same shape. Fixed addresses also let native.ConvertedArgs reuse
the kernel call's converted arguments.

Invariant: a ScratchOutput is owned by one call site (one module instance) and serves one
call per forward; what escapes the forward (a layer's output, the residual, the final norm,
the logits) is never written into one. Only tensors of up to MAX_ROWS rows and MAX_BYTES are kept
(decode sizes; where the GEMMs dwarf an allocation they are not kept): a prefill gets a fresh
tensor, so at most one small tensor per call site stays allocated.
"""
from __future__ import annotations

import torch

MAX_ROWS = 256
MAX_BYTES = 2 << 20


class ScratchOutput:
    __slots__ = ("tensor", "key")

    def __init__(self) -> None:
        self.tensor: torch.Tensor | None = None
        self.key: tuple | None = None

    def get(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A contiguous tensor of `shape` and `dtype`: the one from the last call when it had
        the same (its contents are stale), else a new one (kept when shape[0] <= MAX_ROWS)."""
        key = (shape, dtype)
        if key == self.key:
            return self.tensor
        out = torch.empty(*shape, dtype=dtype)  # varargs: a tuple first fails torch's int check (an exception)
        if shape[0] <= MAX_ROWS and out.numel() * out.element_size() <= MAX_BYTES:
            self.tensor, self.key = out, key
        return out
