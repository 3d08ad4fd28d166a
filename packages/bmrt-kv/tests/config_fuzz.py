"""Seeded config fuzzing of BMRTConfig: good configs, an independent spec, and the checker.

The "file" :func:`membound_testing.fuzz.run` damages is a JSON object of named configs
(``GOOD``), each a dict of every BMRTConfig field; ``fuzz.mutate_json_bytes`` rewrites one
field (to a value from ``fuzz.ODD_VALUES``, a nearby int, or deletes it, or adds an unknown
key). :func:`check` builds every config with ``BMRTConfig.from_dict`` and classes what
happened against :func:`config_valid`, a spec of the valid fields written independently of
the package:

- refused with BMRTError, and the spec agrees it is invalid: the fuzzer counts it clean;
- refused although the spec says valid: AssertionError (the fuzzer counts it unclear);
- accepted although the spec says invalid, or holding a value other than the one given
  (``True`` kept as 1, ``1.0`` as 1): False (silent);
- accepted, valid and exact: a changed config then runs a short stream through a real
  BMRTCache on a tiny Llama (so a value that passes construction but fails mid-stream is
  caught), and True (benign).

Kept in its own module so that the fuzzer's worker processes can import it.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

MAX_TOKENS = 2**31 - 1
MAX_SEED = 2**32 - 1
SELECTOR_NAMES = ("exact", "lsh", "magicpig", "hybrid", "streaming", "h2o", "snapkv", "keydiff")
TIE_BREAKER_NAMES = ("l2", "max_sim", "mahalanobis", "partitioned_centroid", "none")

# Budgets small enough that the 24-token smoke stream compresses.
_BASE = dict(
    budget=16,
    protection_divisor=4,
    block_size=8,
    selector="exact",
    selector_options={},
    scoring="agnostic",
    question_weight=0.5,
    positions="absolute",
    granularity="head",
    seed=0,
    decode_block=1,
)
GOOD = {
    "exact": {**_BASE, "selector_options": {"kernel": 3}},
    "lsh": {
        **_BASE,
        "selector": "lsh",
        "selector_options": {"tables": 4, "bits": 6, "tie_breaker": "max_sim"},
        "positions": "rerotate",
        "seed": 7,
    },
    "magicpig": {
        **_BASE,
        "budget": 20,
        "selector": "magicpig",
        "selector_options": {"tables": 8, "bits": 4},
        "granularity": "layer",
    },
    "hybrid": {
        **_BASE,
        "selector": "hybrid",
        "selector_options": {
            "primary": "snapkv",
            "secondary": "lsh",
            "ratio": 0.5,
            "primary_options": {"window": 4, "kernel": 3},
            "secondary_options": {"tables": 4, "bits": 5, "tie_breaker": "l2"},
        },
        "scoring": "query_aware",
        "question_weight": 0.9,
    },
    "h2o": {**_BASE, "selector": "h2o", "scoring": "query_aware", "seed": 123, "decode_block": 3},
    "snapkv": {
        **_BASE,
        "protection_divisor": 3,
        "selector": "snapkv",
        "selector_options": {"window": 8, "kernel": 5},
    },
    "keydiff": {
        **_BASE,
        "selector": "keydiff",
        "block_size": 4,
        "positions": "rerotate",
        "decode_block": 4,
    },
}


def write_targets(directory: Path) -> Path:
    path = Path(directory) / "bmrt_configs.json"
    path.write_text(json.dumps(GOOD, indent=1))
    return path


def _int(value, low, high, odd=False) -> bool:
    return type(value) is int and low <= value <= high and (not odd or value % 2 == 1)


def _fraction(value, low_open) -> bool:
    if type(value) not in (int, float):
        return False
    return 0 < value <= 1 if low_open else 0 <= value <= 1


def _name(value, names) -> bool:
    return type(value) is str and value in names


def _stage_options(value) -> bool:
    return value is None or type(value) is dict


OPTION_SPECS = {
    "exact": {"kernel": lambda v: _int(v, 1, 1023, odd=True)},
    "snapkv": {
        "window": lambda v: _int(v, 1, MAX_TOKENS),
        "kernel": lambda v: _int(v, 1, 1023, odd=True),
    },
    "lsh": {
        "tables": lambda v: _int(v, 1, 1024),
        "bits": lambda v: _int(v, 1, 16),
        "tie_breaker": lambda v: _name(v, TIE_BREAKER_NAMES),
    },
    "magicpig": {"tables": lambda v: _int(v, 1, 255), "bits": lambda v: _int(v, 1, 16)},
    "hybrid": {
        "primary": lambda v: _name(v, set(SELECTOR_NAMES) - {"hybrid"}),
        "secondary": lambda v: _name(v, set(SELECTOR_NAMES) - {"hybrid"}),
        "ratio": lambda v: _fraction(v, low_open=False),
        "primary_options": _stage_options,
        "secondary_options": _stage_options,
    },
    "h2o": {},
    "streaming": {},
    "keydiff": {
        "question_share": lambda v: _fraction(v, low_open=False),
        "kernel": lambda v: _int(v, 1, 1023, odd=True),
        "anchor": lambda v: _name(v, ("pool", "stream")),
    },
}


def options_valid(selector: str, options) -> bool:
    if type(options) is not dict:
        return False
    spec = OPTION_SPECS[selector]
    if any(type(k) is not str or k not in spec or not spec[k](v) for k, v in options.items()):
        return False
    if selector == "hybrid":
        for stage, default in (("primary", "exact"), ("secondary", "lsh")):
            nested = options.get(f"{stage}_options") or {}
            if not options_valid(options.get(stage, default), nested):
                return False
    return True


def config_valid(kwargs, defaults: dict) -> bool:
    """The spec of a valid BMRTConfig (README and docstring), independent of the package."""
    if type(kwargs) is not dict or any(k not in defaults for k in kwargs):
        return False
    c = {**defaults, **kwargs}
    if not (
        _int(c["budget"], 1, MAX_TOKENS)
        and _int(c["protection_divisor"], 3, MAX_TOKENS)
        and (c["block_size"] is None or _int(c["block_size"], 1, MAX_TOKENS))
        and _int(c["seed"], 0, MAX_SEED)
        and _name(c["selector"], SELECTOR_NAMES)
        and _name(c["scoring"], ("agnostic", "query_aware"))
        and _name(c["positions"], ("absolute", "rerotate"))
        and _name(c["granularity"], ("head", "layer"))
        and _fraction(c["question_weight"], low_open=True)
    ):
        return False
    n_protected = c["budget"] // c["protection_divisor"]
    if n_protected < 1 or c["budget"] - 2 * n_protected < 1:
        return False
    # decode_block: decoding steps held above the budget, at most the block in effect
    # (block_size, or 512 capped at the budget, at twice it under query-aware scoring).
    block = c["block_size"]
    if block is None:
        block = min(512, (2 if c["scoring"] == "query_aware" else 1) * c["budget"])
    if not _int(c["decode_block"], 1, block):
        return False
    return options_valid(c["selector"], c["selector_options"])


def _holds_exactly(config, kwargs, defaults) -> bool:
    """Every field holds the value given (or its default), of the same type; a
    question_weight given as the int 1 may be held as the float 1.0."""
    for name, default in defaults.items():
        want, got = kwargs.get(name, default), getattr(config, name)
        if name == "question_weight" and type(got) is float and got == want:
            continue
        if type(got) is not type(want) or got != want:
            return False
    return True


_MODEL = None


def _tiny_llama():
    global _MODEL
    if _MODEL is None:
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(0)
        config = LlamaConfig(
            vocab_size=97,
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=4096,
        )
        _MODEL = LlamaForCausalLM(config).eval()
    return _MODEL


def smoke(config) -> None:
    """A 24-token stream and one decoding step through a real BMRTCache; the cache must
    stay within the budget."""
    import torch

    from bmrt_kv import BMRTCache
    from bmrt_kv.stream import BoundedStream

    model = _tiny_llama()
    ids = list(range(3, 27))
    if config.scoring == "query_aware" and config.block_tokens < 2:
        # No room for a question next to a block: drive the cache directly, as a caller
        # that supplies the scoring-only tokens itself (here none) would.
        cache = BMRTCache._with_question(model, config)
        with torch.no_grad():
            for token in ids:
                model(input_ids=torch.tensor([[token]]), past_key_values=cache)
    else:
        question = [5] if config.scoring == "query_aware" else None
        stream = BoundedStream(model, config=config, question=question)
        stream.feed(ids)
        stream.generate(max_new_tokens=1)
        cache = stream.cache
    if max(cache.stored_tokens) > config.budget:
        raise AssertionError(f"the cache holds {cache.stored_tokens} > budget {config.budget}")


def check(path: str) -> bool:
    from bmrt_kv import BMRTConfig, BMRTError

    # fuzz.run appends a NUL to a mutant that came out identical to the original.
    configs = json.loads(Path(path).read_bytes().rstrip(b"\0"))
    defaults = {f.name: getattr(BMRTConfig(), f.name) for f in dataclasses.fields(BMRTConfig)}
    refusal = None
    for name, kwargs in configs.items():
        valid = config_valid(kwargs, defaults)
        try:
            config = BMRTConfig.from_dict(kwargs)
        except BMRTError as err:
            if valid:
                raise AssertionError(f"config {name!r} is valid but was refused: {err}") from err
            refusal = err
            continue
        if not valid or not _holds_exactly(config, kwargs, defaults):
            return False
        if kwargs != GOOD.get(name):
            smoke(config)
    if refusal is not None:
        raise refusal
    return True
