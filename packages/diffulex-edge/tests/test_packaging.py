"""Packaging (#19): what an install needs, a quiet import, file modes, py.typed.

The dependency tests run code in a subprocess in which only the distributions an install
would hold are importable: every other distribution installed in this environment is
blocked by a meta-path finder, as if it were absent.
"""

import json
import os
import stat
import subprocess
import sys
import textwrap
import zipfile
from importlib.metadata import distribution
from importlib.resources import files
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from diffulex_edge import export_pte, save_checkpoint

PACKAGE = Path(__file__).resolve().parents[1]
# benchmarks/: the toy sorting model and task, and the test-model builder (not in the wheel).
BENCHMARKS = PACKAGE / "benchmarks"

BLOCKER = """
import importlib.machinery, importlib.metadata, sys
ALLOWED = set({allowed!r})
OWNERS = importlib.metadata.packages_distributions()

def _blocked(name):
    dists = OWNERS.get(name.split(".")[0])
    names = {{d.lower().replace("_", "-").replace(".", "-") for d in dists or ()}}
    return bool(dists) and not ALLOWED & names

class Finder(importlib.machinery.PathFinder):
    # Not found, exactly as if not installed: import raises ModuleNotFoundError and
    # importlib.util.find_spec returns None.
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if _blocked(name):
            return None
        return importlib.machinery.PathFinder.find_spec(name, path, target)

sys.meta_path[:] = [Finder if f is importlib.machinery.PathFinder else f for f in sys.meta_path]
"""


def _closure(names: list[str], extras: tuple[str, ...] = ()) -> set[str]:
    """The distributions pip would install for ``names`` (with ``extras`` of the first),
    following Requires-Dist with markers evaluated for this interpreter."""
    todo = [(n, extras if i == 0 else ()) for i, n in enumerate(names)]
    seen: set[str] = set()
    while todo:
        name, extra = todo.pop()
        key = canonicalize_name(name)
        if key in seen and not extra:
            continue
        seen.add(key)
        for line in distribution(name).requires or []:
            req = Requirement(line)
            envs = [{"extra": e} for e in ("", *extra)]
            if req.marker is None or any(req.marker.evaluate(env) for env in envs):
                todo.append((req.name, ()))
    return seen


def _run(code: str, allowed: set[str] | None = None) -> subprocess.CompletedProcess:
    prelude = "" if allowed is None else BLOCKER.format(allowed=sorted(allowed))
    return subprocess.run(
        [sys.executable, "-c", prelude + textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_import_prints_nothing_and_leaves_executorch_unimported():
    result = _run(
        """
        import sys
        import diffulex_edge
        print(sorted(m for m in sys.modules if m.split(".")[0] in ("executorch", "torchao")))
        """
    )
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    assert result.stdout.strip() == "[]"


def test_the_base_install_decodes_and_saves_with_its_declared_dependencies_only(tmp_path):
    # save_checkpoint goes through safetensors' torch writer, which imports numpy without
    # safetensors declaring it (#55): the base install must hold numpy itself.
    allowed = _closure(["diffulex-edge"])
    assert {"torch", "safetensors", "numpy"} <= allowed and "executorch" not in allowed
    result = _run(
        f"""
        from diffulex_edge import EagerDynamic, GenerationConfig, generate, load_checkpoint
        from diffulex_edge import save_checkpoint
        import sys
        sys.path.insert(0, {str(BENCHMARKS)!r})
        from sort_task import decode, encode, trained_checkpoint
        model = load_checkpoint(trained_checkpoint())
        save_checkpoint(model, {str(tmp_path / "copy")!r})
        model = load_checkpoint({str(tmp_path / "copy")!r})
        c = model.config
        r = generate(EagerDynamic(model, 4), encode("31415926"), GenerationConfig(12),
                     c.mask_token_id, c.eos_token_id)
        print(decode(r.tokens))
        """,
        allowed,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "11234569"


def test_numpy_is_a_base_dependency_of_the_wheel():
    """What the wheel declares (pyproject.toml), not what this environment happens to hold."""
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    pyproject = Path(__file__).parents[1] / "pyproject.toml"
    deps = tomllib.loads(pyproject.read_text())["project"]["dependencies"]
    names = {canonicalize_name(Requirement(d).name): Requirement(d) for d in deps}
    assert "numpy" in names and names["numpy"].marker is None


def test_without_executorch_the_pte_paths_name_the_extra(pte_paths, tmp_path):
    result = _run(
        f"""
        import sys
        sys.modules["executorch"] = None  # as if not installed
        from diffulex_edge import DiffulexEdgeError, PteEngine, export_pte
        from diffulex_edge.config import tiny_config
        sys.path.insert(0, {str(BENCHMARKS)!r})
        from random_sdar import random_model
        for attempt in (lambda: PteEngine({str(pte_paths["block_kv"])!r}),
                        lambda: export_pte(random_model(tiny_config()), {str(tmp_path)!r} + "/t.pte", 64)):
            try:
                attempt()
            except DiffulexEdgeError as e:
                print(e)
        """
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 2
    assert lines[0].startswith("running a .pte needs ExecuTorch")
    assert lines[1].startswith("exporting a .pte needs ExecuTorch")
    assert all("pip install 'diffulex-edge[executorch]'" in line for line in lines)
    assert not (tmp_path / "t.pte").exists()


def test_the_pte_runtime_extra_runs_a_program_quietly(pte_paths):
    """`pip install diffulex-edge[pte-runtime]` + `pip install --no-deps executorch torchao`
    (the README's lean route) holds everything a .pte run imports; and torchao's CUDA-library
    warnings and torch's pytree deprecation, printed while ExecuTorch imports, are gone."""
    allowed = _closure(["diffulex-edge"], ("pte-runtime",)) | {"executorch", "torchao"}
    assert "pandas" not in allowed and "hypothesis" not in allowed
    result = _run(
        f"""
        from diffulex_edge import GenerationConfig, PteEngine
        engine = PteEngine({str(pte_paths["block_kv"])!r})
        r = engine.generate([3, 1, 4, 1, 5], GenerationConfig(8, stop_on_eos=False))
        print(len(r.tokens))
        """,
        allowed,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "8"
    ours = [
        line
        for line in result.stderr.splitlines()
        # ExecuTorch's threadpool probes the CPU natively and logs it; no API turns it off.
        if not line.startswith("[cpuinfo_utils.cpp:")
    ]
    assert ours == [], result.stderr


@pytest.fixture
def umask_027():
    old = os.umask(0o027)
    try:
        yield
    finally:
        os.umask(old)


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_exported_files_follow_the_umask(model, tmp_path, umask_027):
    """They were chmod 0644 whatever the umask; under umask 027 a plain open() gives 0640."""
    result = export_pte(model, tmp_path / "m.pte", 32, 4, "block_kv")
    assert _mode(result.path) == 0o640
    assert _mode(result.record_path) == 0o640
    save_checkpoint(model, tmp_path / "ckpt")
    names = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    assert names == ["config.json", "diffulex_integrity.json", "model.safetensors"]
    assert {_mode(p) for p in (tmp_path / "ckpt").iterdir()} == {0o640}
    os.umask(0o022)
    save_checkpoint(model, tmp_path / "ckpt")
    assert {_mode(p) for p in (tmp_path / "ckpt").iterdir()} == {0o644}
    assert json.loads((tmp_path / "ckpt" / "config.json").read_text())["vocab_size"] == 64


# What #56 moved from the wheel to benchmarks/: the toy sorting task, its training and its
# checkpoint (random_model, the test-model builder, was in model.py).
LEFT_THE_WHEEL = ("diffulex_edge/task.py", "diffulex_edge/train.py", "diffulex_edge/checkpoints/")


def test_the_wheel_holds_runtime_code_only(tmp_path):
    """The wheel built from this tree: no toy model, task, training or test-model builder."""
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path), PACKAGE],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert built.returncode == 0, built.stderr[-3000:]
    (wheel,) = tmp_path.glob("*.whl")
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        sources = {n: zf.read(n).decode() for n in names if n.endswith(".py")}
    shipped = {"diffulex_edge/cli.py", "diffulex_edge/model.py", "diffulex_edge/py.typed"}
    assert shipped | {"diffulex_edge/calibration.txt"} <= set(names)
    for name in names:
        assert not name.startswith(LEFT_THE_WHEEL), name
        assert not name.endswith(".safetensors"), name
    for name, text in sources.items():
        assert "def random_model" not in text and "diffulex_edge.task" not in text, name


def test_the_package_is_typed():
    assert files("diffulex_edge").joinpath("py.typed").is_file()
