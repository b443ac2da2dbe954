"""A Llama-3.1-8B-shaped forward on a real GPU, timed part by part, beside the simulator's price of
the same steps on that GPU's preset (issue 31: "decode and throughput efficiency from kernel
measurements", measured here rather than quoted).

Two halves, so the GPU minutes go to measuring only:

    # on the GPU (torch with CUDA; nothing else of pagedserve is needed):
    python benchmarks/gpu_step_probe.py measure --out h200_steps.json
    # anywhere (pagedserve installed): the simulator's prediction of every measured step, side by side
    python benchmarks/gpu_step_probe.py compare benchmarks/data/h200_step_probe.json --gpu H200

What `measure` runs, with random bf16 weights of Llama-3.1-8B's shapes (32 layers, 4096 hidden, 32 query /
8 kv heads of 128, 14336 intermediate, 128256 vocabulary; 15 GB on the device):

* **GEMMs**: each of a layer's four linear shapes (QKV, O, gate/up, down) and the LM head at 1 to 8,192
  rows, F.linear (cuBLAS) over the 32 layers' own weights in turn (so no weight comes from L2), captured in
  one CUDA graph: time per layer, achieved TB/s (weights + activations) and TFLOP/s.
* **decode attention**: one layer's attention of B sequences of L cached tokens, through PyTorch's
  scaled_dot_product_attention on a contiguous cache (its FlashAttention backend, GQA in the kernel) and
  through pagedserve's own Triton paged kernel on a paged pool (16-token blocks, scattered), in TB/s of KV read.
* **whole steps**: the 32-layer forward (RMSNorm, QKV, KV write, attention, O, residual, RMSNorm, gate/up,
  SiLU-and-mul, down, residual; then the final norm, the LM head for the sampled rows and an argmax) as one
  CUDA graph: decode steps at batch 1-256, prefill steps (eager: their kernels are long), and mixed steps
  (decodes and one prompt chunk in one batch). No rotary (an elementwise kernel of a few µs a layer: its
  launch is in the kernel count, its time is not). The kernel count per step is read from the profiler.

Every section is written to the JSON as soon as it is done, so a run cut short keeps what it measured.
`compare` prints, per measured step, the simulator's device terms for the same step (linear, attention,
launch; the host terms are left out: the probe has no scheduler or sampler) and measured / simulated.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SHAPE_8B = dict(hidden=4096, layers=32, heads=32, kv_heads=8, head_dim=128, inter=14336, vocab=128256)
SHAPE_TINY = dict(hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16, inter=128, vocab=512)  # CPU smoke run

GEMM_ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
DECODE_STEPS = [(1, 1024), (8, 1024), (32, 1024), (64, 1024), (128, 1024), (256, 1024), (8, 8192), (64, 4096)]
PREFILL_STEPS = [(1, 512), (1, 2048), (1, 8192), (4, 2048)]
MIXED_STEPS = [(32, 1024, 512), (32, 1024, 2048), (128, 1024, 512)]  # decodes, their context, one chunk's tokens
ATTENTION_CASES = [(1, 1024), (1, 8192), (8, 1024), (8, 8192), (32, 1024), (32, 4096), (128, 1024), (256, 1024),
                   (64, 4096)]


# -- timing -----------------------------------------------------------------------------------------
class Timer:
    """Seconds per call of `fn`: on CUDA the median of `reps` timed calls (CUDA events) after warm-up,
    as a replayed CUDA graph when `graph` (one capture, so launches cost what they cost in vLLM's decode);
    on CPU (the smoke run) perf_counter around eager calls."""

    def __init__(self, device):
        import torch
        self.torch, self.device = torch, device
        self.cuda = device.type == "cuda"

    def __call__(self, fn, reps: int = 10, graph: bool = False, warmup: int = 2) -> float:
        torch = self.torch
        if not self.cuda:
            fn()
            t = time.perf_counter()
            for _ in range(reps):
                fn()
            return (time.perf_counter() - t) / reps
        run = fn
        if graph:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(warmup):
                    fn()
            torch.cuda.current_stream().wait_stream(stream)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                fn()
            run = g.replay
        for _ in range(warmup):
            run()
        torch.cuda.synchronize()
        times = []
        for _ in range(reps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            run()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
        del run
        return sorted(times)[len(times) // 2]


# -- the model's weights ----------------------------------------------------------------------------
class Weights:
    def __init__(self, shape: dict, device, dtype):
        import torch
        h, kv, d, i = shape["hidden"], shape["kv_heads"], shape["head_dim"], shape["inter"]
        q = shape["heads"] * d

        def w(n, k):
            t = torch.empty(n, k, device=device, dtype=dtype)
            return t.normal_(0, 0.02)

        L = shape["layers"]
        self.qkv = [w(q + 2 * kv * d, h) for _ in range(L)]
        self.o = [w(h, q) for _ in range(L)]
        self.gate_up = [w(2 * i, h) for _ in range(L)]
        self.down = [w(h, i) for _ in range(L)]
        self.norm = [torch.ones(h, device=device, dtype=dtype) for _ in range(2 * L + 1)]
        self.lm_head = w(shape["vocab"], h)

    def linear_shapes(self) -> dict:
        return {"qkv": self.qkv, "o": self.o, "gate_up": self.gate_up, "down": self.down, "lm_head": [self.lm_head]}


def rms_norm(x, weight, eps=1e-5):
    import torch.nn.functional as F
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


SDPA_BACKENDS: list = []  # pick_sdpa_backend: the backends every sdpa call may use (empty: torch's choice)


def sdpa(q, k, v, causal: bool):
    """q [b, H, n, D], k/v [b, KV, L, D]: GQA inside the kernel (enable_gqa), on the backend picked."""
    import torch.nn.functional as F
    from torch.nn.attention import sdpa_kernel
    kwargs = {} if q.shape[1] == k.shape[1] else {"enable_gqa": True}
    if not SDPA_BACKENDS:
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, **kwargs)
    with sdpa_kernel(SDPA_BACKENDS):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, **kwargs)


def pick_sdpa_backend(shape: dict, device, dtype) -> str:
    """FlashAttention where it takes this torch's GQA decode and causal prefill shapes (what vLLM's
    kernels are), else torch's own choice; returns the name, for the record."""
    import torch
    from torch.nn.attention import SDPBackend
    H, KV, D = shape["heads"], shape["kv_heads"], shape["head_dim"]
    SDPA_BACKENDS[:] = [SDPBackend.FLASH_ATTENTION]
    try:
        for n, L, causal in ((1, 64, False), (64, 64, True)):
            sdpa(torch.randn(2, H, n, D, device=device, dtype=dtype), torch.randn(2, KV, L, D, device=device, dtype=dtype),
                 torch.randn(2, KV, L, D, device=device, dtype=dtype), causal)
        return "flash"
    except RuntimeError as e:
        SDPA_BACKENDS.clear()
        return f"torch's choice (flash refused: {str(e).splitlines()[0][:200]})"


class Stack:
    """The 32-layer forward over a contiguous cache per layer ([b, KV, L, D]); `decode`: B sequences of one
    new token at position L - 1 (cache length L); `prefill`: b sequences of T new tokens from position 0."""

    def __init__(self, shape: dict, weights: Weights):
        self.s, self.w = shape, weights

    def _layer_mlp(self, x, layer):
        import torch.nn.functional as F
        w = self.w
        h = rms_norm(x, w.norm[2 * layer + 1])
        gu = F.linear(h, w.gate_up[layer])
        g, u = gu.chunk(2, dim=-1)
        return x + F.linear(F.silu(g) * u, w.down[layer])

    def _qkv(self, x, layer):
        import torch.nn.functional as F
        s = self.s
        h = rms_norm(x, self.w.norm[2 * layer])
        qkv = F.linear(h, self.w.qkv[layer])
        q_dim, kv_dim = s["heads"] * s["head_dim"], s["kv_heads"] * s["head_dim"]
        return qkv.split([q_dim, kv_dim, kv_dim], dim=-1)

    def decode_fn(self, B: int, L: int, device, dtype, extra_chunk: int = 0):
        """A graph-capturable step: B decodes of context L, plus (mixed steps) one prompt chunk of
        `extra_chunk` tokens from position 0. Returns (fn, the cache tensors it holds)."""
        import torch
        import torch.nn.functional as F
        s = self.s
        H, KV, D, hid = s["heads"], s["kv_heads"], s["head_dim"], s["hidden"]
        cache = torch.empty(s["layers"], 2, B, KV, L, D, device=device, dtype=dtype).uniform_(-1, 1)
        chunk_cache = (torch.empty(s["layers"], 2, 1, KV, extra_chunk, D, device=device, dtype=dtype)
                       if extra_chunk else None)
        rows = B + extra_chunk
        x0 = torch.randn(rows, hid, device=device, dtype=dtype)
        sample_rows = torch.arange(B + (1 if extra_chunk else 0), device=device)
        if extra_chunk:
            sample_rows[-1] = rows - 1
        out = {}

        def fn():
            x = x0
            for layer in range(s["layers"]):
                q, k, v = self._qkv(x, layer)
                kc, vc = cache[layer, 0], cache[layer, 1]
                kc[:, :, L - 1].copy_(k[:B].view(B, KV, D))
                vc[:, :, L - 1].copy_(v[:B].view(B, KV, D))
                att = sdpa(q[:B].view(B, 1, H, D).transpose(1, 2), kc, vc, causal=False)
                att = att.transpose(1, 2).reshape(B, H * D)
                if extra_chunk:
                    n = extra_chunk
                    ck, cv = chunk_cache[layer, 0, 0], chunk_cache[layer, 1, 0]
                    ck.copy_(k[B:].view(n, KV, D).transpose(0, 1))
                    cv.copy_(v[B:].view(n, KV, D).transpose(0, 1))
                    catt = sdpa(q[B:].view(1, n, H, D).transpose(1, 2), ck[None], cv[None], causal=True)
                    att = torch.cat([att, catt.transpose(1, 2).reshape(n, H * D)])
                x = x + F.linear(att, self.w.o[layer])
                x = self._layer_mlp(x, layer)
            h = rms_norm(x[sample_rows], self.w.norm[-1])
            out["tokens"] = F.linear(h, self.w.lm_head).argmax(dim=-1)
        return fn, (cache, chunk_cache)

    def prefill_fn(self, b: int, T: int, device, dtype):
        import torch
        import torch.nn.functional as F
        s = self.s
        H, KV, D, hid = s["heads"], s["kv_heads"], s["head_dim"], s["hidden"]
        cache = torch.empty(s["layers"], 2, b, KV, T, D, device=device, dtype=dtype)
        x0 = torch.randn(b * T, hid, device=device, dtype=dtype)
        last = torch.arange(T - 1, b * T, T, device=device)
        out = {}

        def fn():
            x = x0
            for layer in range(s["layers"]):
                q, k, v = self._qkv(x, layer)
                kc, vc = cache[layer, 0], cache[layer, 1]
                kc.copy_(k.view(b, T, KV, D).transpose(1, 2))
                vc.copy_(v.view(b, T, KV, D).transpose(1, 2))
                att = sdpa(q.view(b, T, H, D).transpose(1, 2), kc, vc, causal=True)
                x = x + F.linear(att.transpose(1, 2).reshape(b * T, H * D), self.w.o[layer])
                x = self._layer_mlp(x, layer)
            h = rms_norm(x[last], self.w.norm[-1])
            out["tokens"] = F.linear(h, self.w.lm_head).argmax(dim=-1)
        return fn, cache


def count_kernels(fn, device) -> int | None:
    """CUDA kernels one call of `fn` launches (the profiler's kernel events); None off CUDA."""
    if device.type != "cuda":
        return None
    import torch
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)  # memsets/copies too


# -- measure ----------------------------------------------------------------------------------------
def measure(args) -> dict:
    import torch
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    shape = SHAPE_TINY if args.tiny else SHAPE_8B
    out_path = Path(args.out)
    res: dict = {"shape": shape, "dtype": str(dtype).replace("torch.", ""), "errors": {}, "host": {}}
    info = res["host"]
    info["torch"] = torch.__version__
    info["date_utc"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        info.update(gpu=p.name, sms=p.multi_processor_count, memory_gib=round(p.total_memory / 2**30, 1),
                    cuda=torch.version.cuda)
        try:
            import triton
            info["triton"] = triton.__version__
        except ImportError:
            pass
        torch.backends.cuda.matmul.allow_tf32 = False

    def save():
        out_path.write_text(json.dumps(res, indent=1))

    def section(name, body):
        t = time.perf_counter()
        try:
            body()
        except Exception as e:  # keep what the other sections measure
            res["errors"][name] = f"{type(e).__name__}: {e}\n{traceback.format_exc()[-2000:]}"
            print(f"[{name}] failed: {e!r}", flush=True)
        res.setdefault("section_seconds", {})[name] = round(time.perf_counter() - t, 1)
        save()
        if device.type == "cuda":
            torch.cuda.empty_cache()

    if device.type == "cuda":
        info["sdpa_backend"] = pick_sdpa_backend(shape, device, dtype)
        print(f"sdpa backend: {info['sdpa_backend']}", flush=True)
    timer = Timer(device)
    reps = 3 if args.tiny else args.reps
    torch.manual_seed(0)
    weights = Weights(shape, device, dtype)
    stack = Stack(shape, weights)
    esize = torch.empty((), dtype=dtype).element_size()
    if device.type == "cuda":
        # the copy bandwidth of this card, this run: the ceiling every TB/s below is read against
        def copy_bw():
            n = 2 * 2**30 // esize
            a, b = torch.empty(n, device=device, dtype=dtype), torch.empty(n, device=device, dtype=dtype)
            t = timer(lambda: b.copy_(a), reps=10)
            res["copy_tbps"] = 2 * n * esize / t / 1e12  # read + write
            print(f"device copy: {res['copy_tbps']:.2f} TB/s (read + write)", flush=True)
        section("copy", copy_bw)

    def gemms():
        rows_list = [m for m in GEMM_ROWS if not args.tiny or m <= 64]
        res["gemm"] = []
        for name, ws in weights.linear_shapes().items():
            n, k = ws[0].shape
            for m in rows_list:
                x = torch.randn(m, k, device=device, dtype=dtype)
                outs = [torch.empty(m, n, device=device, dtype=dtype) for _ in range(2)]

                def fn():
                    for i, w in enumerate(ws):
                        torch.mm(x, w.t(), out=outs[i % 2])  # F.linear's GEMM (cuBLAS), into a fixed output
                reps_here = reps if m * n * k < 2**36 else max(3, reps // 3)
                t = timer(fn, reps=reps_here, graph=True) / len(ws)
                moved = (n * k + m * (n + k)) * esize
                res["gemm"].append(dict(name=name, m=m, n=n, k=k, seconds=t, tbps=moved / t / 1e12,
                                        tflops=2 * m * n * k / t / 1e12))
            last = res["gemm"][-len(rows_list):]
            print(f"gemm {name} [{n}x{k}]: " + ", ".join(f"M={g['m']} {g['seconds'] * 1e6:.1f}us "
                                                         f"{g['tbps']:.2f}TB/s {g['tflops']:.0f}TF" for g in last),
                  flush=True)
    section("gemm", gemms)

    def attention():
        res["attention"] = []
        H, KV, D = shape["heads"], shape["kv_heads"], shape["head_dim"]
        cases = ATTENTION_CASES if not args.tiny else [(2, 64), (4, 128)]
        triton_backend = None
        try:
            from pagedserve.attention import triton_backend as tb
            triton_backend = tb if device.type == "cuda" else None
        except Exception as e:  # pagedserve's kernel is optional here
            res["errors"]["attention_import"] = repr(e)
        for B, L in cases:
            row = dict(batch=B, context=L, kv_bytes=2 * B * L * KV * D * esize)
            q = torch.randn(B, H, 1, D, device=device, dtype=dtype)
            kc = torch.empty(B, KV, L, D, device=device, dtype=dtype).uniform_(-1, 1)
            vc = torch.empty_like(kc).uniform_(-1, 1)
            row["sdpa_s"] = timer(lambda: sdpa(q, kc, vc, causal=False), reps=reps, graph=True)
            kc = vc = None  # the lambda above is done with them
            if triton_backend is not None:
                import numpy as np
                bs = 16
                per = -(-L // bs)
                num_blocks = B * per + 1
                rng = np.random.default_rng(0)
                ids = rng.permutation(num_blocks)[: B * per].reshape(B, per).astype(np.int64)
                pool_k = torch.empty(num_blocks * bs, KV, D, device=device, dtype=dtype).uniform_(-1, 1)
                pool_v = torch.empty_like(pool_k).uniform_(-1, 1)
                meta, _ = triton_backend.build_metadata([(ids[i], L - 1) for i in range(B)], [], bs, None, device)
                q2 = torch.randn(B, H, D, device=device, dtype=dtype)
                k2 = torch.randn(B, KV, D, device=device, dtype=dtype)
                v2 = torch.randn(B, KV, D, device=device, dtype=dtype)
                def twenty():  # eager, 20 calls a timing: the GPU's time where it exceeds the launches'
                    for _ in range(20):
                        triton_backend.paged_attention(q2, k2, v2, pool_k, pool_v, meta, 1 / math.sqrt(D))
                try:
                    row["triton_paged_s"] = timer(twenty, reps=reps) / 20
                except Exception as e:  # the SDPA figures stand without it
                    res["errors"][f"triton_paged{(B, L)}"] = repr(e)
                del pool_k, pool_v
            res["attention"].append(row)
            print(f"attention B={B} L={L}: " + ", ".join(
                f"{k[:-2]} {row[k] * 1e6:.1f}us {row['kv_bytes'] / row[k] / 1e12:.2f}TB/s"
                for k in ("sdpa_s", "triton_paged_s") if k in row), flush=True)
    section("attention", attention)

    def steps(kind, cases, make):
        res[kind] = []
        for case in cases:
            try:
                fn, held = make(*case)
                graph = kind != "prefill_steps"
                t = timer(fn, reps=reps if graph else max(3, reps // 2), graph=graph)
                kernels = count_kernels(fn, device) if not args.tiny else None
                res[kind].append(dict(case=list(case), seconds=t, kernels=kernels))
                print(f"{kind} {case}: {t * 1e3:.3f} ms, {kernels} kernels", flush=True)
                del fn, held
            except torch.cuda.OutOfMemoryError if device.type == "cuda" else MemoryError as e:
                res["errors"][f"{kind}{case}"] = repr(e)
            if device.type == "cuda":
                torch.cuda.empty_cache()

    def decode_cases():
        cases = DECODE_STEPS if not args.tiny else [(1, 32), (4, 64)]
        steps("decode_steps", cases, lambda B, L: stack.decode_fn(B, L, device, dtype))

    def prefill_cases():
        cases = PREFILL_STEPS if not args.tiny else [(1, 32), (2, 16)]
        steps("prefill_steps", cases, lambda b, T: stack.prefill_fn(b, T, device, dtype))

    def mixed_cases():
        cases = MIXED_STEPS if not args.tiny else [(4, 32, 16)]
        steps("mixed_steps", cases, lambda B, L, n: stack.decode_fn(B, L, device, dtype, extra_chunk=n))

    section("decode_steps", decode_cases)
    section("prefill_steps", prefill_cases)
    section("mixed_steps", mixed_cases)
    save()
    return res


# -- compare ----------------------------------------------------------------------------------------
def compare(args) -> None:
    sys.path.insert(0, str(ROOT))
    from pagedserve.plan.gpus import get_gpu
    from pagedserve.plan.models import load_model
    from pagedserve.sim.cost_model import CostModel, CostParams, ModelCost

    res = json.loads(Path(args.file).read_text())
    gpu = get_gpu(args.gpu)
    params = CostParams.for_gpu(gpu)
    cm = CostModel(ModelCost.from_shape(load_model("llama-3.1-8b").shape, "bfloat16", None, 1), params)
    host = res.get("host", {})
    print(f"measured on {host.get('gpu')} (torch {host.get('torch')}, CUDA {host.get('cuda')}, {host.get('date_utc')}); "
          f"device copy {res.get('copy_tbps', float('nan')):.2f} TB/s; simulated on the {gpu.name} preset "
          f"(weights and KV at {params.mem_bandwidth * params.mem_share / 1e12:.2f} TB/s x MBU "
          f"{params.gemm_mbu} / {params.attn_mbu}; GEMMs at {params.peak_flops * params.matmul_share / 1e12:.0f} "
          f"TFLOP/s x MFU {params.gemm_mfu}; {params.kernel_launch_s * 1e6:.1f} us x "
          f"{cm.model.kernels_per_step} launches)")
    for name, row in res.get("errors", {}).items():
        print(f"  (section {name} failed on the GPU: {row.splitlines()[0]})")

    def show(title, rows, predict):
        if not rows:
            return []
        print(f"\n{title}")
        print(f"  {'case':<22}{'measured ms':>12}{'simulated':>11}{'ratio':>7}   sim parts: linear / attention / launch / elementwise ms"
              f"{'   kernels':>10}")
        ratios = []
        for r in rows:
            st = predict(*r["case"])
            device_s = st.linear + st.attention + st.launch + st.allreduce + st.elementwise
            ratio = device_s / r["seconds"]
            ratios.append(ratio)
            print(f"  {str(tuple(r['case'])):<22}{r['seconds'] * 1e3:>12.3f}{device_s * 1e3:>11.3f}{ratio:>7.2f}   "
                  f"{st.linear * 1e3:.3f} / {st.attention * 1e3:.3f} / {st.launch * 1e3:.3f} / "
                  f"{st.elementwise * 1e3:.3f}{str(r.get('kernels')):>10}")
        return ratios

    def features(new, ctx, outputs):
        from pagedserve.sim.step_work import step_features
        return cm.breakdown(step_features(cm.model, new, ctx, 0, 16, outputs))

    all_ratios = []
    all_ratios += show("decode steps (B sequences at context L; one CUDA graph)", res.get("decode_steps"),
                       lambda B, L: features([1] * B, [L] * B, B))
    all_ratios += show("prefill steps (b prompts of T tokens; eager)", res.get("prefill_steps"),
                       lambda b, T: features([T] * b, [T] * b, b))
    all_ratios += show("mixed steps (B decodes at context L + one chunk of n from position 0; one CUDA graph)",
                       res.get("mixed_steps"), lambda B, L, n: features([1] * B + [n], [L] * B + [n], B + 1))
    if all_ratios:
        errs = sorted(abs(r - 1) for r in all_ratios)
        print(f"\nsimulated / measured over {len(errs)} steps: median |error| {100 * errs[len(errs) // 2]:.1f}%, "
              f"worst {100 * errs[-1]:.1f}%")
    gemm = res.get("gemm") or []
    if gemm:
        bw = params.mem_bandwidth * params.mem_share
        print(f"\nGEMMs (cuBLAS through F.linear, per call; achieved TB/s = (weights + activations) / time; "
              f"the preset's weight read: {bw * params.gemm_mbu / 1e12:.2f} TB/s)")
        by_name: dict = {}
        for g in gemm:
            by_name.setdefault(g["name"], []).append(g)
        for name, rows in by_name.items():
            print(f"  {name:<8} [{rows[0]['n']}x{rows[0]['k']}] " + "  ".join(
                f"M={g['m']}: {g['tbps']:.2f}TB/s {g['tflops']:.0f}TF" for g in rows))
    att = res.get("attention") or []
    if att:
        print(f"\ndecode attention, one layer (KV read TB/s; the preset's: {params.mem_bandwidth * params.mem_share * params.attn_mbu / 1e12:.2f})")
        for a in att:
            parts = [f"{k[:-2]} {a['kv_bytes'] / a[k] / 1e12:.2f} TB/s ({a[k] * 1e6:.1f} us)"
                     for k in ("sdpa_s", "triton_paged_s") if k in a]
            print(f"  B={a['batch']:<4} L={a['context']:<6} " + ", ".join(parts))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("measure", help="time the steps on this machine's GPU")
    m.add_argument("--out", required=True)
    m.add_argument("--device", default="cuda")
    m.add_argument("--reps", type=int, default=10)
    m.add_argument("--tiny", action="store_true", help="a tiny model (a smoke run of the code on CPU)")
    c = sub.add_parser("compare", help="the simulator's price of every measured step, side by side")
    c.add_argument("file")
    c.add_argument("--gpu", default="H200")
    args = ap.parse_args()
    if args.cmd == "measure":
        measure(args)
    else:
        compare(args)


if __name__ == "__main__":
    main()
