"""``moe-expert-cache generate|simulate``."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from moe_expert_cache.config import MODES, CacheConfig
from moe_expert_cache.generate import generate
from moe_expert_cache.loader import load_cached_model
from moe_expert_cache.manager import config_from_state, read_state
from moe_expert_cache.policies import POLICIES
from moe_expert_cache.profile import adaptive_capacity, pinned_experts
from moe_expert_cache.simulator import SIMULATED, simulate
from moe_expert_cache.trace import RouterTrace


def _capacity(text: str) -> float | int:
    return float(text) if "." in text else int(text)


def _prompt_ids(args) -> list[int]:
    if args.prompt_ids is not None:
        return [int(t) for t in args.prompt_ids.split(",")]
    from mlx_lm.utils import load_tokenizer

    try:
        tokenizer = load_tokenizer(Path(args.model))
    except Exception as e:
        raise SystemExit(
            f"--prompt needs a tokenizer in {args.model} ({e}); pass --prompt-ids instead"
        ) from e
    return tokenizer.encode(args.prompt)


def _profiled(config: CacheConfig, trace: RouterTrace, args) -> CacheConfig:
    """Capacities (adaptive or uniform) and pins from a profiling trace."""
    caps = config.layer_capacities([trace.num_experts] * trace.num_layers, trace.top_k)
    if args.adaptive:
        caps = adaptive_capacity(trace, sum(caps))
    pinned = {}
    if args.pin_share is not None:
        pins = pinned_experts(trace, args.pin_share)
        pinned = {i: pins[i][: caps[i] - trace.top_k] for i in range(trace.num_layers)}
    return CacheConfig(capacity=caps, mode=config.mode, policy=config.policy, pinned=pinned)


def cmd_generate(args) -> int:
    config = CacheConfig(capacity=_capacity(args.capacity), mode=args.mode, policy=args.policy)
    if args.profile:
        config = _profiled(config, RouterTrace.load(args.profile), args)
    if args.state_in:
        config = config_from_state(config, read_state(args.state_in))
    cached = load_cached_model(args.model, config)
    if args.trace_out:
        cached.manager.start_trace()
    result = generate(cached.model, _prompt_ids(args), args.max_tokens, cached.manager)
    total = cached.manager.total_metrics()
    print("tokens:", " ".join(map(str, result.tokens)))
    print(f"tokens/s: {result.tokens_per_s:.2f}")
    print(
        f"resident expert bytes: {cached.manager.resident_expert_bytes()} "
        f"of {cached.manager.all_expert_bytes()}"
    )
    print(
        f"hit rate: {total.hit_rate:.4f} ({total.hits}/{total.requests}), "
        f"swaps: {total.swaps}, bytes read: {total.bytes_read}"
    )
    for layer, m in zip(cached.manager.layers, cached.manager.metrics(), strict=True):
        print(f"  layer {layer.index}: {m.to_dict()}")
    if args.trace_out:
        cached.manager.trace.save(args.trace_out)
    if args.state_out:
        cached.manager.save_state(args.state_out)
    return 0


def cmd_simulate(args) -> int:
    trace = RouterTrace.load(args.trace)
    caps = [_capacity(c) for c in args.capacity.split(",")]
    policies = args.policies.split(",")
    print("| policy | capacity | hit rate |")
    print("|---|---|---|")
    for row in simulate(trace, caps, policies):
        print(f"| {row.policy} | {row.capacity} | {row.hit_rate:.4f} |")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="moe-expert-cache", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="greedy generation with an expert cache")
    g.add_argument("--model", required=True, help="mlx-lm model directory")
    g.add_argument("--capacity", default="0.5", help="share (0.5) or count (16) per layer")
    g.add_argument("--mode", choices=MODES, default="exact")
    g.add_argument("--policy", choices=sorted(POLICIES), default="lcp")
    prompt = g.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="text (needs a tokenizer in the model directory)")
    prompt.add_argument("--prompt-ids", help="comma-separated token ids")
    g.add_argument("--max-tokens", type=int, default=32)
    g.add_argument("--profile", help="a router trace of a profiling run (see --trace-out)")
    g.add_argument(
        "--pin-share", type=float, help="with --profile: pin experts used by more than this share"
    )
    g.add_argument(
        "--adaptive", action="store_true", help="with --profile: per-layer capacity from it"
    )
    g.add_argument("--trace-out", help="write the router trace here")
    g.add_argument("--state-in", help="warm-start from a saved cache state")
    g.add_argument("--state-out", help="save the final cache state here")
    g.set_defaults(func=cmd_generate)
    s = sub.add_parser("simulate", help="replay a router trace under every policy")
    s.add_argument("trace")
    s.add_argument("--capacity", default="0.25,0.5,0.75")
    s.add_argument("--policies", default=",".join(SIMULATED))
    s.set_defaults(func=cmd_simulate)
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
