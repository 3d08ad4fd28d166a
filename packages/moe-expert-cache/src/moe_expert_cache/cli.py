"""``moe-expert-cache generate`` (greedy decoding with an expert cache) and
``moe-expert-cache simulate`` (replay a router trace under every policy)."""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

from moe_expert_cache.config import DEFAULT_CAPACITY_SHARE, MODES, ExpertCacheConfig
from moe_expert_cache.errors import ExpertCacheError
from moe_expert_cache.generate import generate
from moe_expert_cache.loader import load_cached_model
from moe_expert_cache.manager import config_from_state, read_state
from moe_expert_cache.policies import POLICIES
from moe_expert_cache.profile import adaptive_capacity, pinned_experts
from moe_expert_cache.simulator import SIMULATED, simulate
from moe_expert_cache.trace import RouterTrace

# What mlx_lm.utils.load_tokenizer reads; a directory with neither has no tokenizer.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def _capacity(text: str) -> float | int:
    """``0.5`` (a share of each layer's experts) or ``16`` (a count per layer): the text
    decides, so ``1.0`` keeps every expert and ``1`` one."""
    try:
        return float(text) if "." in text else int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is neither a share like 0.5 nor a count like 16"
        ) from None


def _token_ids(text: str) -> list[int]:
    """Comma-separated token ids, ``1,2,3``."""
    try:
        return [int(t) for t in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a comma-separated list of integer token ids"
        ) from None


def _tokenizer(args):
    """The model directory's tokenizer, for ``--prompt``; ``None`` with ``--prompt-ids``."""
    if args.prompt_ids is not None:
        return None
    model_dir = Path(args.model)
    if not any((model_dir / name).is_file() for name in TOKENIZER_FILES):
        raise ExpertCacheError(
            f"--prompt needs a tokenizer, and {model_dir} has none (no "
            f"{' or '.join(TOKENIZER_FILES)}); pass token ids with --prompt-ids instead"
        )
    from mlx_lm.utils import load_tokenizer

    try:
        tokenizer = load_tokenizer(model_dir)
    except Exception as e:  # transformers raises many kinds for a broken tokenizer
        raise ExpertCacheError(
            f"--prompt needs a tokenizer, and the one in {model_dir} does not load "
            f"({type(e).__name__}: {e}); pass token ids with --prompt-ids instead"
        ) from e
    return tokenizer


def _profiled(config: ExpertCacheConfig, trace: RouterTrace, args) -> ExpertCacheConfig:
    """Capacities (adaptive or uniform) and pins from a profiling trace."""
    caps = config.layer_capacities([trace.num_experts] * trace.num_layers, trace.top_k)
    if args.adaptive:
        caps = adaptive_capacity(trace, sum(caps))
    pinned = {}
    if args.pin_share is not None:
        pins = pinned_experts(trace, args.pin_share)
        pinned = {i: pins[i][: caps[i] - trace.top_k] for i in range(trace.num_layers)}
    return replace(config, capacity=caps, capacity_share=None, pinned=pinned)


def cmd_generate(args) -> int:
    if (args.pin_share is not None or args.adaptive) and not args.profile:
        raise ExpertCacheError("--pin-share and --adaptive need --profile")
    share = isinstance(args.capacity, float)
    config = ExpertCacheConfig(
        capacity=None if share else args.capacity,
        capacity_share=args.capacity if share else None,
        mode=args.mode,
        policy=args.policy,
        prefetch=args.prefetch,
        map_embeddings=args.map_embeddings,
    )
    if args.profile:
        config = _profiled(config, RouterTrace.load(args.profile), args)
    if args.state_in:
        config = config_from_state(config, read_state(args.state_in))
    tokenizer = _tokenizer(args)
    prompt_ids = args.prompt_ids if tokenizer is None else tokenizer.encode(args.prompt)
    cached = load_cached_model(args.model, config)
    if args.trace_out:
        cached.manager.start_trace()
    result = generate(cached.model, prompt_ids, args.max_tokens, cached.manager)
    total = cached.manager.total_metrics()
    print("tokens:", " ".join(map(str, result.tokens)))
    if tokenizer is not None:
        print("text:", repr(tokenizer.decode(result.tokens)))
    print(f"tokens/s: {result.tokens_per_s:.2f}")
    print(
        f"resident expert bytes: {cached.manager.resident_expert_bytes()} "
        f"of {cached.manager.all_expert_bytes()}"
    )
    print(
        f"hit rate: {total.hit_rate:.4f} ({total.hits}/{total.requests}), "
        f"swaps: {total.swaps}, bytes read: {total.bytes_read}"
    )
    print(f"stall on expert loads: {total.stall_s * 1e3:.1f} ms")
    if config.prefetch:
        print(f"prefetched: {total.prefetched} experts, {total.prefetch_used} used")
    for layer, m in zip(cached.manager.layers, cached.manager.metrics(), strict=True):
        print(f"  layer {layer.index}: {m.to_dict()}")
    if args.trace_out:
        cached.manager.trace.save(args.trace_out)
    if args.state_out:
        cached.manager.save_state(args.state_out)
    return 0


def cmd_simulate(args) -> int:
    trace = RouterTrace.load(args.trace)
    print("| policy | capacity | hit rate |")
    print("|---|---|---|")
    for row in simulate(trace, args.capacity, args.policies):
        print(f"| {row.policy} | {row.capacity} | {row.hit_rate:.4f} |")
    return 0


def build_parser() -> argparse.ArgumentParser:
    formatter = argparse.ArgumentDefaultsHelpFormatter
    parser = argparse.ArgumentParser(
        prog="moe-expert-cache", description=__doc__, formatter_class=formatter
    )
    commands = parser.add_subparsers(dest="command", required=True)

    g = commands.add_parser(
        "generate", help="greedy generation with an expert cache", formatter_class=formatter
    )
    g.add_argument("--model", required=True, help="mlx-lm MoE model directory")
    g.add_argument(
        "--capacity",
        type=_capacity,
        default=DEFAULT_CAPACITY_SHARE,
        help="resident experts per MoE layer: a share with a decimal point (0.5, 1.0: "
        "capacity_share) or a count without one (16: capacity)",
    )
    g.add_argument(
        "--mode",
        choices=MODES,
        default=ExpertCacheConfig.mode,
        help="exact: load misses first (stock output); skip: compute without them",
    )
    g.add_argument(
        "--policy",
        choices=sorted(POLICIES),
        default=ExpertCacheConfig.policy,
        help="eviction policy",
    )
    g.add_argument(
        "--prefetch",
        action="store_true",
        help="exact mode: read each MoE layer's guessed experts during its attention",
    )
    g.add_argument(
        "--map-embeddings",
        action="store_true",
        help="leave the input embedding table in the mmap'd shard (untied float tables)",
    )
    prompt = g.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="text (needs a tokenizer in the model directory)")
    prompt.add_argument("--prompt-ids", type=_token_ids, help="comma-separated token ids")
    g.add_argument("--max-tokens", type=int, default=32, help="tokens to generate")
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
    g.set_defaults(handler=cmd_generate)

    s = commands.add_parser(
        "simulate", help="replay a router trace under every policy", formatter_class=formatter
    )
    s.add_argument("trace", help="a router trace (generate --trace-out)")
    s.add_argument(
        "--capacity",
        type=_capacity,
        nargs="+",
        default=[0.25, 0.5, 0.75],
        help="resident experts per layer, each a share with a decimal point (0.5) or a "
        "count without one (16)",
    )
    s.add_argument(
        "--policies",
        nargs="+",
        choices=SIMULATED,
        default=list(SIMULATED),
        help="policies to replay (belady: the offline optimum)",
    )
    s.set_defaults(handler=cmd_simulate)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.handler(args)
    except (ValueError, OSError) as err:
        # Expected failures (bad values, damaged or missing files; ExpertCacheError is a
        # ValueError): one line, exit 2, as argparse reports a bad argument.
        parser.exit(2, f"{parser.prog}: error: {err}\n")
    return 2


if __name__ == "__main__":
    sys.exit(main())
