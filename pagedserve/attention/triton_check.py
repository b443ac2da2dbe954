"""Can the Triton attention kernels serve tensors on this device? Answered once per process.

Kept apart from triton_backend so that asking imports triton only when the answer matters,
and so that a missing or broken triton is a reason in a log line, not an import error.

On CUDA the kernels also run one small step (decodes with GQA, a prefill chunk after cached
keys, a sliding window, a padding slot) against the torch reference on the device: a
compiler or driver that builds them wrong is then a fallback with a reason, not wrong tokens.
"""
from __future__ import annotations


import numpy as np
import torch


class TritonUnavailable(RuntimeError):
    """Why the Triton kernels cannot serve here (shown in the fallback's log line)."""


def interpreted(kernel: object) -> bool:
    """True when `kernel` was decorated under TRITON_INTERPRET=1 (runs in numpy on the host)."""
    return type(kernel).__name__ == "InterpretedFunction"


def check_triton(device_type: str) -> None:
    """Raises TritonUnavailable saying why the kernels cannot run on `device_type` tensors."""
    try:
        from pagedserve.attention import triton_backend
    except ImportError as e:
        raise TritonUnavailable(f"triton is not importable ({e}); `pip install triton` or the [cuda] extra") from e
    except Exception as e:  # a triton that imports but breaks (version skew with torch, a bad install)
        raise TritonUnavailable(f"importing triton failed: {e!r}") from e
    on_host = triton_backend.INTERPRETED
    if device_type == "cpu":
        if not on_host:
            raise TritonUnavailable("on CPU tensors the Triton kernels run only in the interpreter: set "
                                    "TRITON_INTERPRET=1 before pagedserve is imported (for tests; far too slow to serve)")
        return
    if on_host:
        raise TritonUnavailable(f"TRITON_INTERPRET=1 is set: the kernels would run in the interpreter on the host, "
                                f"not on {device_type}")
    try:
        self_check(torch.device(device_type))
    except TritonUnavailable:
        raise
    except Exception as e:  # compile errors, unsupported GPU, driver trouble
        raise TritonUnavailable(f"the kernels failed on {device_type}: {e!r}") from e


def self_check(device: torch.device, tolerance: float = 1e-3) -> None:
    """One small mixed step through the kernels and the torch reference; raises on any difference."""
    from pagedserve.attention import torch_backend, triton_backend

    block_size, kv_heads, heads, head_dim, window = 16, 2, 8, 64, 40
    gen = torch.Generator().manual_seed(0)
    pool_k = torch.randn(16 * block_size, kv_heads, head_dim, generator=gen)
    pool_v = torch.randn(16 * block_size, kv_heads, head_dim, generator=gen)
    decodes = [(np.array([3, 9, 1]), 36), (np.array([12]), 4)]
    prefills = [(np.array([5, 0, 14, 7]), 20, 30)]
    num_tokens = len(decodes) + 30
    q = torch.randn(num_tokens, heads, head_dim, generator=gen)
    k = torch.randn(num_tokens, kv_heads, head_dim, generator=gen)
    v = torch.randn(num_tokens, kv_heads, head_dim, generator=gen)
    outputs = []
    for backend in (triton_backend, torch_backend):
        kc, vc = pool_k.to(device), pool_v.to(device)
        meta, _ = backend.build_metadata(decodes, prefills, block_size, window, device)
        out = backend.paged_attention(q.to(device), k.to(device), v.to(device), kc, vc, meta, head_dim ** -0.5)
        outputs.append((out.cpu(), kc.cpu(), vc.cpu()))
    (got, got_k, got_v), (want, want_k, want_v) = outputs
    if not (torch.equal(got_k, want_k) and torch.equal(got_v, want_v)):
        raise TritonUnavailable("self-check: the KV write differs from the reference")
    err = (got - want).abs().max().item()
    if not err <= tolerance:  # NaN fails too
        raise TritonUnavailable(f"self-check: attention differs from the reference by {err:.3g} (> {tolerance})")
    padded = triton_backend.upload(np.array([-1]), 1, np.zeros(1, np.int32), np.zeros(1, np.int32),
                                   np.zeros(1, np.int32), np.zeros((1, 1), np.int32), np.zeros((0, 2), np.int32),
                                   block_size, None, device)
    kc = pool_k.to(device)
    triton_backend.write_kv(k[:1].to(device), v[:1].to(device), kc, kc.clone(), padded.slot_mapping)
    if not torch.equal(kc.cpu(), pool_k):
        raise TritonUnavailable("self-check: a padding slot (-1) was written")
