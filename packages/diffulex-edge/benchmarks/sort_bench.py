"""Eager vs ``.pte`` decode speed on the toy sorting model (``checkpoints/sort8``): what the
CLI's ``diffulex-edge bench`` ran before 0.10.0. From a repository checkout:
``python packages/diffulex-edge/benchmarks/sort_bench.py [--prompts 20]``. It prints; the
measured tables are ``run_all.py``'s (``hatch run diffulex-edge:bench``).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch
from sort_task import run_sort_task, sort_prompts, trained_checkpoint  # benchmarks/

from diffulex_edge.backends import EagerDynamic
from diffulex_edge.checkpoint import load_checkpoint
from diffulex_edge.export import export_pte
from diffulex_edge.generate import GenerationConfig
from diffulex_edge.remasking import REMASKING
from diffulex_edge.runtime import PteEngine


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--prompts", type=int, default=20, help="random 8-digit prompts")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads for eager")
    parser.add_argument(
        "--remasking",
        choices=sorted(REMASKING),
        default="low_confidence_dynamic",
        help="REMASKING",
    )
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    torch.set_num_threads(args.threads)
    model = load_checkpoint(trained_checkpoint())
    c = model.config
    prompts = sort_prompts(args.prompts)
    config = GenerationConfig(max_new_tokens=12, remasking=args.remasking)
    with tempfile.TemporaryDirectory() as tmp:
        export_pte(model, Path(tmp) / "m.pte", 32, 4, "block_kv")
        engine = PteEngine(Path(tmp) / "m.pte", expected_config=c)
        for name, backend in (("eager", EagerDynamic(model, 4)), ("pte", engine.backend)):
            run_sort_task(backend, prompts[:1], config, c.mask_token_id, c.eos_token_id)  # warm-up
            r = run_sort_task(backend, prompts, config, c.mask_token_id, c.eos_token_id)
            print(
                f"{name:5s} {r.tokens_per_s:8.1f} tokens/s  {r.tokens_per_forward:.2f} tokens/forward"
                f"  exact match {r.exact_match:.3f}"
            )


if __name__ == "__main__":
    main()
