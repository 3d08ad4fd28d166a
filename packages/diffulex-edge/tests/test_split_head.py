"""The lm_head's likeliest rows in int8 (diffulex_edge.split_head): the rows are those of
the largest mean probability, the split head gives the unsplit head's logits in vocabulary
order, its int4 rows hold GPTQ's codes of those rows and its int8 rows int8's rounding.
What it buys on SmolLM2 is measured in benchmarks/smollm2_quality.py."""

import copy

import torch
from random_sdar import random_model

from diffulex_edge.calibration import causal_windows, random_ids
from diffulex_edge.config import tiny_config
from diffulex_edge.export import quantize_8da4w
from diffulex_edge.gptq import gptq_int4_layers
from diffulex_edge.split_head import SplitHead, likely_rows, split_rows


def test_likely_rows_are_the_largest_mean_probabilities():
    model = random_model(tiny_config(), seed=4)
    ids = random_ids(model.config.vocab_size, 96, seed=5)
    with torch.no_grad():
        probs = torch.cat(
            [model(*w).softmax(-1).reshape(-1, 64) for w in causal_windows(model, ids)]
        )
    mean = probs.mean(0)
    rows = likely_rows(model, ids, 10)
    assert rows.tolist() == sorted(rows.tolist()) and len(set(rows.tolist())) == 10
    others = torch.ones(64, dtype=torch.bool)
    others[rows] = False
    assert mean[rows].min() >= mean[others].max()


def test_split_rows_rounds_and_keeps_both_parts():
    assert split_rows(49152, 1 / 12) == 4096
    assert split_rows(64, 1 / 12) == 5
    assert split_rows(64, 0) == 0
    assert split_rows(3, 0.01) == 1
    assert split_rows(3, 0.99) == 2


def test_a_float_split_head_is_the_head():
    """Every logit in vocabulary order, bit for bit. Weights and inputs are small integers,
    so every product and sum is exact in float32: the two parts' matrix products may sum
    in another order than the whole head's (the BLAS kernel depends on the shape and the
    CPU: on an AVX2 machine random floats differed by 1 ulp), and that must not show."""
    head = torch.nn.Linear(16, 40, bias=False)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        head.weight.copy_(torch.randint(-8, 8, (40, 16), generator=gen).float())
    rows = torch.tensor([0, 3, 17, 39])
    split = SplitHead(head, rows)
    x = torch.randint(-8, 8, (2, 5, 16), generator=gen).float()
    with torch.no_grad():
        torch.testing.assert_close(split(x), head(x), rtol=0, atol=0)
    assert split.out_features == 40


def test_the_split_heads_rows_are_gptqs_and_int8s():
    model = random_model(tiny_config(), seed=1)
    ids = random_ids(model.config.vocab_size, 96, seed=3)
    rows = likely_rows(model, ids, split_rows(64, 1 / 12))
    reference = copy.deepcopy(model)
    linear = {n: m for n, m in reference.named_modules() if isinstance(m, torch.nn.Linear)}
    codes, scales = gptq_int4_layers(reference, linear, ids, 32)["lm_head"]
    quantized = quantize_8da4w(copy.deepcopy(model), calibration=ids)
    head = quantized.lm_head
    assert isinstance(head, SplitHead)
    rest = torch.ones(64, dtype=torch.bool)
    rest[rows] = False
    want = codes[rest].float() * scales[rest].repeat_interleave(32, 1)
    torch.testing.assert_close(head.int4.weight.dequantize(), want, rtol=0, atol=0)
    weight = model.lm_head.weight.detach()[rows]
    step = weight.abs().amax(1, keepdim=True) / 127
    assert bool(((head.int8.weight.dequantize() - weight).abs() <= step / 2 + 1e-7).all())
    # the layers before the head are what they are without the split
    unsplit = quantize_8da4w(copy.deepcopy(model), calibration=ids, head_int8_share=0)
    q_proj = "layers.1.self_attn.q_proj"
    assert torch.equal(
        quantized.get_submodule(q_proj).weight.dequantize(),
        unsplit.get_submodule(q_proj).weight.dequantize(),
    )
