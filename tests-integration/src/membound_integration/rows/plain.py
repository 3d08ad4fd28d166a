"""The reference row: the embedded SmolLM2-135M-Instruct with no membound package."""

from membound_integration.row import QUESTION, Row, greedy_generate


def plain_model() -> Row:
    from membound_testing import chat_prompt, load_smollm2

    model, tokenizer = load_smollm2()
    gen = greedy_generate(model, tokenizer, chat_prompt(tokenizer, QUESTION))
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    return Row(
        name="plain SmolLM2-135M (float32)",
        **gen.row_fields(),
        component="weights",
        resident_bytes=weight_bytes,
        unbounded_bytes=weight_bytes,
    )


ROWS = {"plain": plain_model}


def _float_copy():
    from membound_testing import smollm2_float_dir

    return smollm2_float_dir()


PREPARE = [_float_copy]
