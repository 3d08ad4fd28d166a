"""Checkers for ``membound_testing.fuzz``: each loads one mutant (a directory) with the real
loader and says whether what it loaded equals the original. They run in the fuzzer's worker
processes (this directory is put on their PYTHONPATH); the original is named by an
environment variable the test sets.

``check_pte`` also notes whether opening a mutant reached ExecuTorch's loader: a call to
the ``load_program`` of the runtime ``PteEngine`` loads through
(``diffulex_edge.executorch_import.runtime()``, counted by a wrapper). It appends one JSON
line per such mutant to ``DIFFULEX_FUZZ_REACH_LOG`` with whether the mutant was
byte-identical (program) and content-identical (record) to the original: with verification
on, only those may reach ExecuTorch.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from functools import cache
from pathlib import Path

import torch

from membound_testing import fuzz

torch.set_num_threads(1)

PTE_NAME = "model.pte"
_reached: list[int] = []


def mutate_pte_front(data: bytes, rng: random.Random) -> bytes:
    """One to three byte flips in the first 64 bytes (flatbuffer root offset, the ``ET12``
    identifier at bytes 4-8, the extended header), half of them inside the identifier."""
    buf = bytearray(data)
    for _ in range(rng.randrange(1, 4)):
        i = rng.randrange(4, 8) if rng.random() < 0.5 else rng.randrange(64)
        buf[i] ^= rng.randrange(1, 256)
    return bytes(buf)


def pte_targets(pte: Path, out: Path) -> dict[str, fuzz.Target]:
    """A directory holding ``model.pte`` and its record; a target for each file."""
    out.mkdir(parents=True, exist_ok=True)
    shutil.copy(pte, out / "model.pte")
    shutil.copy(pte.with_name(pte.name + ".json"), out / "model.pte.json")
    return {
        "model.pte": fuzz.Target(out, "model.pte", structured=mutate_pte_front),
        "model.pte.json": fuzz.Target(out, "model.pte.json", structured=fuzz.mutate_json_bytes),
    }


def checkpoint_targets(model, out: Path, foreign: bool) -> dict[str, fuzz.Target]:
    """A saved checkpoint (``foreign``: without its integrity record, as a Hugging Face
    checkpoint comes); a target for each file."""
    from diffulex_edge.checkpoint import INTEGRITY_FILE, save_checkpoint

    save_checkpoint(model, out)
    names = ["config.json", "model.safetensors"]
    if foreign:
        (out / INTEGRITY_FILE).unlink()
    else:
        names.append(INTEGRITY_FILE)
    structured = {"model.safetensors": fuzz.mutate_safetensors_header}
    return {
        name: fuzz.Target(out, name, structured=structured.get(name, fuzz.mutate_json_bytes))
        for name in names
    }


@cache
def _count_load_program() -> None:
    from diffulex_edge.executorch_import import runtime

    loader = runtime()
    real = loader.load_program

    def counting(data, *args, **kwargs):
        _reached.append(len(data) if isinstance(data, (bytes, bytearray)) else -1)
        return real(data, *args, **kwargs)

    loader.load_program = counting


def _block_logits(engine) -> torch.Tensor:
    """One denoising forward of an all-mask block after a 4-token prefill."""
    b = engine.backend
    b.reset()
    b.prefill(torch.tensor([[3, 1, 4, 1]]))
    return b.denoise(torch.full((1, engine.layout.block_size), engine.mask_token_id))


def _original_pte_path() -> Path:
    return Path(os.environ["DIFFULEX_FUZZ_ORIGINAL"]) / PTE_NAME


@cache
def _original_pte_files():
    pte = _original_pte_path()
    return pte.read_bytes(), json.loads(pte.with_name(PTE_NAME + ".json").read_text())


@cache
def _original_pte_outputs():
    from diffulex_edge.runtime import PteEngine

    engine = PteEngine(_original_pte_path())
    return engine.meta, engine.config, _block_logits(engine)


def check_pte(path: str) -> bool:
    from diffulex_edge.runtime import PteEngine

    orig_bytes, orig_record = _original_pte_files()
    pte = Path(path) / PTE_NAME
    try:
        record = json.loads((Path(path) / (PTE_NAME + ".json")).read_bytes())
    except ValueError:
        record = None
    pristine = pte.read_bytes() == orig_bytes and record == orig_record
    _count_load_program()
    _reached.clear()
    try:
        engine = PteEngine(pte)
    finally:
        if _reached:
            with open(os.environ["DIFFULEX_FUZZ_REACH_LOG"], "a") as log:
                log.write(json.dumps({"mutant": path, "pristine": pristine}) + "\n")
    orig_meta, orig_config, orig_logits = _original_pte_outputs()
    return (
        engine.meta == orig_meta
        and engine.config == orig_config
        and torch.equal(_block_logits(engine), orig_logits)
    )


@cache
def _original_checkpoint(directory: str):
    from diffulex_edge.checkpoint import load_checkpoint

    return load_checkpoint(directory)


def check_checkpoint(path: str) -> bool:
    from diffulex_edge.checkpoint import load_checkpoint

    original = _original_checkpoint(os.environ["DIFFULEX_FUZZ_ORIGINAL"])
    loaded = load_checkpoint(path)
    if loaded.config != original.config:
        return False
    a = dict(loaded.named_parameters(remove_duplicate=False))
    b = dict(original.named_parameters(remove_duplicate=False))
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a
    )
