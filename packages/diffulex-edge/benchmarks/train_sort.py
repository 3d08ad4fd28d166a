"""Train a tiny SDAR model on digit sorting with the block-diffusion objective.

Each step feeds ``[noisy ; clean]`` (2T tokens, the clean copy repeating positions 0..T-1):
in every answer block a fraction t ~ U(0, 1] of the tokens is replaced by MASK; a noisy
block sees itself and the clean blocks before it, a clean block sees clean blocks up to
itself (block-causal), exactly what decoding with a KV cache will show the model. The loss
is cross-entropy on the masked tokens. From a repository checkout:
``python packages/diffulex-edge/benchmarks/train_sort.py OUT_DIR`` (``checkpoints/sort8`` was
trained by it, with the default 9 minutes).
"""

from __future__ import annotations

import argparse
import math
import time

import torch
import torch.nn.functional as F
from sort_task import EOS, MASK, VOCAB_SIZE, SortTask  # benchmarks/sort_task.py

from diffulex_edge.checkpoint import save_checkpoint
from diffulex_edge.config import SDARConfig
from diffulex_edge.model import SDARModel


def sort_model_config(task: SortTask) -> SDARConfig:
    return SDARConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        rope_theta=10_000.0,
        max_position_embeddings=64,
        mask_token_id=MASK,
        eos_token_id=EOS,
    )


def training_mask(seq_len: int, block_size: int) -> torch.Tensor:
    """(2T, 2T) bool, True = visible, over ``[noisy ; clean]``."""
    blk = torch.arange(seq_len) // block_size
    same = blk[:, None] == blk[None, :]
    before = blk[None, :] < blk[:, None]
    causal = blk[None, :] <= blk[:, None]
    top = torch.cat([same, before], dim=1)
    bottom = torch.cat([torch.zeros_like(same), causal], dim=1)
    return torch.cat([top, bottom], dim=0)


def noisy_batch(clean: torch.Tensor, task: SortTask, generator: torch.Generator):
    """Mask a per-block fraction of answer tokens; returns (noisy, loss_mask) both (B, T)."""
    B, T = clean.shape
    nblocks = T // task.block_size
    t = torch.rand(B, nblocks, generator=generator).clamp_min(1e-3)
    t = t.repeat_interleave(task.block_size, dim=1)
    masked = torch.rand(B, T, generator=generator) < t
    masked[:, : task.prompt_len] = False
    return clean.masked_fill(masked, MASK), masked


def train(out_dir: str, minutes: float, seed: int, threads: int, batch: int) -> SDARModel:
    """Train the sorting model for ``minutes`` of wall time and save it to ``out_dir``.

    Args:
        out_dir: the checkpoint directory to write (``save_checkpoint``).
        minutes: the wall-clock budget; the learning rate decays over it.
        seed: seeds the weights and the batches.
        threads: torch intra-op threads.
        batch: sequences per step.

    Returns:
        The trained model, in eval mode.
    """
    torch.manual_seed(seed)
    torch.set_num_threads(threads)
    task = SortTask()
    model = SDARModel(sort_model_config(task)).train()
    gen = torch.Generator().manual_seed(seed)
    T = task.seq_len
    attn = training_mask(T, task.block_size)[None]
    positions = torch.arange(T).repeat(2)[None].expand(batch, -1)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.01, betas=(0.9, 0.98))
    budget = minutes * 60
    start = time.perf_counter()
    step = 0
    while (elapsed := time.perf_counter() - start) < budget:
        # Cosine decay over the wall-clock budget, after a short warm-up.
        frac = elapsed / budget
        lr_scale = min(1.0, (step + 1) / 100) * 0.5 * (1 + math.cos(math.pi * frac))
        for group in opt.param_groups:
            group["lr"] = 2e-3 * lr_scale
        clean = task.sample(batch, gen)
        noisy, loss_mask = noisy_batch(clean, task, gen)
        logits = model(torch.cat([noisy, clean], dim=1), positions, attention_mask=attn)
        loss = F.cross_entropy(logits[:, :T][loss_mask], clean[loss_mask])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 100 == 0:
            print(f"step {step:5d}  {elapsed:6.1f}s  loss {loss.item():.4f}", flush=True)
        step += 1
    print(f"trained {step} steps in {time.perf_counter() - start:.1f}s", flush=True)
    model.eval()
    save_checkpoint(model, out_dir)
    return model


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir")
    parser.add_argument("--minutes", type=float, default=9.0, help="wall-clock training budget")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--batch", type=int, default=64)
    args = parser.parse_args(argv)
    train(args.out_dir, args.minutes, args.seed, args.threads, args.batch)


if __name__ == "__main__":
    main()
