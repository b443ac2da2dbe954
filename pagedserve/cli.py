"""pagedserve serve | generate | plan | bench | simulate | tune | advise"""
from __future__ import annotations

import argparse
import logging
import sys


def _register_generate(sub) -> None:
    from pagedserve.engine_args import add_engine_args

    p = sub.add_parser("generate", help="generate offline from a prompt")
    add_engine_args(p)
    p.add_argument("--prompt", action="append", required=True, help="may be given several times")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--sampling-seed", type=int, default=None)
    p.set_defaults(func=_run_generate)


def _run_generate(args) -> int:
    from pagedserve.engine import LLM
    from pagedserve.engine_args import engine_config_from_args
    from pagedserve.sampling import SamplingParams

    config = engine_config_from_args(args)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.sampling_seed)
    llm = LLM.from_config(config)
    for out in llm.generate(args.prompt, params, use_tqdm=False):
        print(out.prompt + out.outputs[0].text)
        print(f"--- finish_reason={out.outputs[0].finish_reason} tokens={len(out.outputs[0].token_ids)}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedserve", description=__doc__)
    parser.add_argument("--log-level", default="INFO")
    sub = parser.add_subparsers(dest="command", required=True)
    _register_generate(sub)
    registrars = [
        ("pagedserve.server.cli", "register"),
        ("pagedserve.plan.cli", "register"),
        ("pagedserve.bench.cli", "register"),
        ("pagedserve.sim.cli", "register"),
        ("pagedserve.advise.cli", "register"),
        ("pagedserve.tune.cli", "register"),
    ]
    import importlib
    for module, fn in registrars:
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as e:
            if e.name != module:
                raise
            continue
        getattr(mod, fn)(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(asctime)s %(name)s: %(message)s")
    try:
        if args.command == "serve":
            from pagedserve.fleet.cli import run_replicas, wants_replicas
            if wants_replicas(args):  # the fleet sits above the one server: it is run from here
                return run_replicas(args)
        return args.func(args) or 0
    except ValueError as e:
        print(f"pagedserve {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
