"""Run by tests/test_fused_ops.py under ATEN_CPU_CAPABILITY=default (torch's scalar kernels, whose
SiLU uses std::exp as the fused kernel does): prints "exact" when every fused op equals the torch
expressions bit for bit in fp32 and bf16, else what differed."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedserve.model.cpu import fused


def main() -> None:
    assert fused.fused_ops_for("cpu") == "cpu", "the fused kernels did not build"
    gen = torch.Generator().manual_seed(11)
    wrong = []
    for dtype in (torch.float32, torch.bfloat16):
        for rows, cols in ((1, 255), (37, 255), (6, 1000)):
            x = (torch.randn(rows, cols + 3, generator=gen) * 4).to(dtype)[:, :cols]
            res = torch.randn(rows, cols, generator=gen).to(dtype)
            w = torch.randn(cols, generator=gen).to(dtype)

            def norm(t):
                t32 = t.float()
                return w * (t32 * torch.rsqrt(t32.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype)

            if not torch.equal(fused.rms_norm(x, w, 1e-5), norm(x)):
                wrong.append(f"rms_norm {dtype} {rows}x{cols}")
            want_res = res + x
            out, new_res = fused.add_rms_norm(x, res.clone(), w, 1e-5)
            if not (torch.equal(new_res, want_res) and torch.equal(out, norm(want_res))):
                wrong.append(f"add_rms_norm {dtype} {rows}x{cols}")
            half = cols // 2
            if not torch.equal(fused.silu_and_mul(x[:, :2 * half]), F.silu(x[:, :half]) * x[:, half:2 * half]):
                wrong.append(f"silu_and_mul {dtype} {rows}x{cols}")
        q = torch.randn(5, 3, 64, generator=gen).to(dtype)
        k = torch.randn(5, 1, 64, generator=gen).to(dtype)
        cos, sin = torch.randn(5, 1, 64, generator=gen).to(dtype), torch.randn(5, 1, 64, generator=gen).to(dtype)

        def rope(t):
            return t * cos + torch.cat((-t[..., 32:], t[..., :32]), dim=-1) * sin

        want_q, want_k = rope(q), rope(k)
        got_q, got_k = fused.apply_rotary(q, k, cos, sin)
        if not (torch.equal(got_q, want_q) and torch.equal(got_k, want_k)):
            wrong.append(f"rotary {dtype}")
    print("\n".join(wrong) if wrong else "exact")


if __name__ == "__main__":
    main()
