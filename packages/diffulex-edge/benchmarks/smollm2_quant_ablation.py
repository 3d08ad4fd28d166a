"""SmolLM2-135M-Instruct: where 8da4w's perplexity goes. Each torchao scheme is applied to the
eager model (no .pte) and scored on the held-out text of ``smollm2_quality.py``; a second
column says whether ExecuTorch's XNNPACK partitioner lowers that scheme, found by lowering
a one-layer model quantized the same way (no timing).

    python packages/diffulex-edge/benchmarks/smollm2_quant_ablation.py

8da4w = int8 dynamic per-token activations, int4 symmetric weights in groups along the input
dimension (the export's ``--quantize 8da4w`` uses groups of 32 on every linear layer,
the tied ``lm_head`` included). About 10 minutes on one core.
"""

from __future__ import annotations

import argparse
import copy
import math
import sys
from pathlib import Path

import torch
from torch import nn

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from smollm2_quality import TEXT  # noqa: E402

RESULTS = HERE / "results"
COMMAND = "python packages/diffulex-edge/benchmarks/smollm2_quant_ablation.py"


def _config(scheme: str, group: int):
    from torchao.quantization.granularity import PerAxis, PerGroup
    from torchao.quantization.quant_api import (
        Int8DynamicActivationIntxWeightConfig,
        IntxWeightOnlyConfig,
    )
    from torchao.quantization.quant_primitives import MappingType

    granularity = PerAxis(0) if group == 0 else PerGroup(group)  # 0: one scale per row
    if scheme == "8da4w":
        return Int8DynamicActivationIntxWeightConfig(
            weight_dtype=torch.int4, weight_granularity=granularity
        )
    if scheme == "8da8w":
        return Int8DynamicActivationIntxWeightConfig(
            weight_dtype=torch.int8, weight_granularity=granularity
        )
    if scheme == "4w":
        return IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=granularity)
    if scheme == "4w-asym":
        return IntxWeightOnlyConfig(
            weight_dtype=torch.int4,
            granularity=granularity,
            mapping_type=MappingType.ASYMMETRIC,
        )
    raise ValueError(scheme)


# (row, (scheme, group) for the decoder's linear layers, lm_head: "tied" = quantized with
# them, "fp32" = left float, or (scheme, group) of its own)
ROWS = [
    ("8da4w g32, lm_head too (the export)", ("8da4w", 32), "tied"),
    ("8da4w g32, lm_head fp32", ("8da4w", 32), "fp32"),
    ("8da4w g32, lm_head 8da8w g32", ("8da4w", 32), ("8da8w", 32)),
    ("int4 weight-only g32 (no activation quant), lm_head fp32", ("4w", 32), "fp32"),
    ("int4 weight-only asymmetric g32, lm_head fp32", ("4w-asym", 32), "fp32"),
    ("8da4w g32, lm_head 8da8w per row", ("8da4w", 32), ("8da8w", 0)),
    ("8da8w g32, lm_head 8da8w g32", ("8da8w", 32), ("8da8w", 32)),
    ("8da8w per row, lm_head too", ("8da8w", 0), "tied"),
    ("8da4w g16, lm_head too", ("8da4w", 16), "tied"),
    ("8da4w g16, lm_head 8da8w g32", ("8da4w", 16), ("8da8w", 32)),
]


INT8_ROW = ("8da8w", 0)
KINDS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# One kind of decoder layer at a time in 8da8w per row, the rest 8da4w g32, lm_head 8da8w
# per row (quantize_8da4w's int8_layers): does any one kind carry the loss?
ROWS += [
    (f"8da4w g32, {kind} and lm_head 8da8w per row", ("8da4w", 32), INT8_ROW, kind)
    for kind in KINDS
]


def quantized(base, layers, head, int8_kind=None):
    from torchao.quantization.quant_api import quantize_

    from diffulex_edge.export import quantize_8da4w

    model = copy.deepcopy(base)
    if int8_kind is not None:  # the package's own mixed quantizer (8da4w g32 + 8da8w per row)
        # min-max and a float embedding, as the rest of this ablation (0.10's quantizer)
        return quantize_8da4w(
            model, int8_layers=(int8_kind, "lm_head"), clip=False, int8_embedding=False
        )
    if head == "tied":
        quantize_(model, _config(*layers))
        return model
    model.lm_head.weight = nn.Parameter(model.embed_tokens.weight.detach().clone())
    quantize_(
        model,
        _config(*layers),
        filter_fn=lambda m, fqn: isinstance(m, nn.Linear) and fqn != "lm_head",
    )
    if head != "fp32":
        quantize_(model, _config(*head), filter_fn=lambda m, fqn: fqn == "lm_head")
    return model


def xnnpack_lowers(scheme: str, group: int) -> str:
    """'yes' if every linear of a one-layer model with this scheme ends up in an XNNPACK
    delegate, else what happened."""
    from torchao.quantization.quant_api import quantize_

    from diffulex_edge.executorch_import import lowering

    to_edge_transform_and_lower, XnnpackPartitioner = lowering()
    model = nn.Sequential(nn.Linear(128, 64)).eval()
    quantize_(model, _config(scheme, group))
    example = (torch.randn(2, 128),)
    try:
        program = torch.export.export(model, example)
        edge = to_edge_transform_and_lower(program, partitioner=[XnnpackPartitioner()])
    except Exception as err:  # the partitioner's own refusal is the answer
        return f"no: {type(err).__name__}: {str(err).splitlines()[0][:120]}"
    left = [
        n.target.__name__
        for n in edge.exported_program().graph.nodes
        if n.op == "call_function" and "linear" in str(n.target)
    ]
    return "yes" if not left else f"no: {left} left outside the delegate"


def perplexity(model, ids: torch.Tensor) -> float:
    from diffulex_edge.backends import EagerDynamic

    with torch.no_grad():
        logits = EagerDynamic(model, 1).prefill_causal(ids, all_logits=True)
    return math.exp(nn.functional.cross_entropy(logits[0, :-1].float(), ids[0, 1:]).item())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.parse_args()
    torch.set_num_threads(1)
    from transformers import PreTrainedTokenizerFast

    from diffulex_edge import load_checkpoint
    from membound_testing.models import smollm2_float_dir
    from membound_testing.results import write_result

    model_dir = smollm2_float_dir()
    ids = torch.tensor([PreTrainedTokenizerFast.from_pretrained(str(model_dir))(TEXT)["input_ids"]])
    base = load_checkpoint(model_dir).eval()
    fp32 = perplexity(base, ids)
    rows = [["fp32", "-", round(fp32, 2), 1.0]]
    print(rows[-1], flush=True)
    lowers = {}
    for name, layers, head, *kind in ROWS:
        for scheme in [layers] + ([head] if isinstance(head, tuple) else []):
            if scheme not in lowers:
                lowers[scheme] = xnnpack_lowers(*scheme)
        lowered = "; ".join(
            f"{s[0]} {f'g{s[1]}' if s[1] else 'per row'}: {lowers[s]}"
            for s in [layers] + ([head] if isinstance(head, tuple) else [])
        )
        ppl = perplexity(quantized(base, layers, head, *kind), ids)
        rows.append([name, lowered, round(ppl, 2), round(ppl / fp32, 3)])
        print(rows[-1], flush=True)
    write_result(
        RESULTS,
        package="diffulex-edge",
        name="smollm2_quant_ablation",
        title="SmolLM2-135M-Instruct: held-out perplexity per quantization scheme (eager)",
        command=COMMAND,
        columns=["scheme", "XNNPACK lowers it", "perplexity", "x fp32"],
        rows=rows,
        notes=f"{ids.shape[1]} tokens of smollm2_quality.py's held-out paragraph, one causal "
        "prefill of the eager model (diffulex-edge's SDAR port of SmolLM2, block size 1) "
        "after torchao's quantize_; g = weight group size along the input dimension, per "
        "row = one scale per output channel. "
        "'XNNPACK lowers it': a one-layer Linear(128, 64) with the scheme, exported and "
        "lowered with ExecuTorch's XnnpackPartitioner; 'yes' when no linear op is left "
        "outside the delegate. SmolLM2's weights come from a Q4_1 GGUF, dequantised.",
    )


if __name__ == "__main__":
    main()
