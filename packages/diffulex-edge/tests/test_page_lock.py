"""A loaded program's pages stay evictable (no ExecuTorch mlock unless asked), the process's
memory-lock limit and capabilities come back as they were, and running a program does not
import ExecuTorch's exporter."""

from __future__ import annotations

import json
import resource
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from diffulex_edge import executorch_import
from diffulex_edge.page_lock import ipc_lock_effective, no_page_locking
from diffulex_edge.pte_record import record_path
from diffulex_edge.runtime import PteEngine

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def _copy(pte: Path, directory: Path) -> Path:
    """The program and its record under a path of its own, so this test's mappings are
    the only ones of that file in the process."""
    out = directory / pte.name
    shutil.copyfile(pte, out)
    shutil.copyfile(record_path(pte), record_path(out))
    return out


def _mapped_kib(path: Path, field: str) -> int:
    """The sum of ``field`` (kB) over this process's mappings of ``path``."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()
        if head and "-" in head[0] and ":" not in head[0]:  # a mapping's first line
            inside = len(head) > 5 and head[5] == str(path)
        elif inside and line.startswith(field + ":"):
            total += int(head[1])
    return total


def _lock_allowed(nbytes: int) -> bool:
    """Whether this process may lock ``nbytes`` of pages: the capability, or room under
    the soft memory-lock limit."""
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    return bool(ipc_lock_effective()) or soft == resource.RLIM_INFINITY or soft >= nbytes


@pytest.mark.parametrize("variant", ["block_kv", "static_kv"])
def test_a_loaded_program_has_none_of_its_pages_locked(pte_paths, tmp_path, variant):
    pte = _copy(pte_paths[variant], tmp_path)
    engine = PteEngine(pte)
    assert _mapped_kib(pte, "Rss") > 0  # mapped, so there is something to lock
    assert _mapped_kib(pte, "Locked") == 0
    assert engine.lock_pages is False


def test_lock_pages_leaves_executorch_locking_as_it_is(pte_paths, tmp_path):
    pte = _copy(pte_paths["static_kv"], tmp_path)
    engine = PteEngine(pte, lock_pages=True)
    assert engine.lock_pages is True and _mapped_kib(pte, "Rss") > 0
    locked = _mapped_kib(pte, "Locked")
    if _lock_allowed(pte.stat().st_size):  # root, as in CI: ExecuTorch locks its segments
        assert locked > 0
    else:  # an ordinary user under a small limit: the kernel refuses ExecuTorch's mlock
        assert locked == 0


def test_the_limit_and_the_capability_are_restored_after_loading(pte_paths, tmp_path):
    limit, capability = resource.getrlimit(resource.RLIMIT_MEMLOCK), ipc_lock_effective()
    PteEngine(_copy(pte_paths["block_kv"], tmp_path))
    assert resource.getrlimit(resource.RLIMIT_MEMLOCK) == limit
    assert ipc_lock_effective() == capability


def test_no_page_locking_refuses_locks_inside_and_restores_after_an_error():
    limit, capability = resource.getrlimit(resource.RLIMIT_MEMLOCK), ipc_lock_effective()
    with pytest.raises(KeyError, match="inside"), no_page_locking():
        assert resource.getrlimit(resource.RLIMIT_MEMLOCK) == (0, limit[1])
        assert ipc_lock_effective() in (False, None)
        raise KeyError("inside")
    assert resource.getrlimit(resource.RLIMIT_MEMLOCK) == limit
    assert ipc_lock_effective() == capability


def test_where_python_has_no_resource_module_loading_goes_ahead(monkeypatch, pte_paths):
    """Windows: no memory-lock limit to lower; the engine still loads."""
    from diffulex_edge import page_lock

    monkeypatch.setattr(page_lock, "resource", None)
    with no_page_locking():
        pass
    assert PteEngine(pte_paths["block_kv"]).meta["block_size"] == 4


def test_lock_pages_must_be_a_bool(pte_paths):
    from diffulex_edge.errors import DiffulexEdgeError

    with pytest.raises(DiffulexEdgeError, match="lock_pages must be a bool"):
        PteEngine(pte_paths["block_kv"], lock_pages=1)


_RUN = textwrap.dedent(
    """
    import json, sys
    import torch
    from diffulex_edge import PteEngine

    engine = PteEngine(sys.argv[1])
    engine.backend.reset()
    engine.backend.prefill(torch.tensor([[3, 1, 4, 1]]))
    logits = engine.backend.denoise(
        torch.full((1, engine.layout.block_size), engine.mask_token_id)
    )
    print(json.dumps({
        "finite": bool(torch.isfinite(logits).all()),
        "exporter": sorted(m for m in ("executorch.exir", "torch._inductor", "torchao")
                           if m in sys.modules),
    }))
    """
)


def test_running_a_program_does_not_import_the_exporter(pte_paths):
    """executorch.runtime imports executorch.exir (and through it torchao, ~130 MiB of
    anonymous memory); the engine's runtime and the static_kv kernels do without."""
    done = subprocess.run(
        [sys.executable, "-c", _RUN, str(pte_paths["static_kv"])], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result == {"finite": True, "exporter": []}


def test_the_public_runtime_gives_the_same_logits(pte_paths, monkeypatch):
    """Where ExecuTorch's compiled module lacks the entry points the lean runtime calls,
    runtime() falls back to executorch.runtime; both run the program alike."""
    from executorch.runtime import Runtime

    def logits():
        engine = PteEngine(pte_paths["static_kv"])
        b = engine.backend
        b.reset()
        b.prefill(torch.tensor([[3, 1, 4, 1]]))
        mask = torch.full((1, engine.layout.block_size), engine.mask_token_id)
        return b.denoise(mask), engine.program

    lean, lean_program = logits()
    assert isinstance(lean_program, executorch_import.Program)
    executorch_import.runtime.cache_clear()
    monkeypatch.setattr(executorch_import, "_ENTRY_POINTS", ("no_such_entry_point",))
    try:
        assert executorch_import.runtime() is Runtime.get()
        public, public_program = logits()
    finally:
        executorch_import.runtime.cache_clear()
    assert not isinstance(public_program, executorch_import.Program)
    torch.testing.assert_close(public, lean, rtol=0, atol=0)


_EXPORT = textwrap.dedent(
    """
    import json, sys
    from pathlib import Path
    sys.path.insert(0, sys.argv[2])  # benchmarks/: the test-model builder
    from diffulex_edge.config import tiny_config
    from diffulex_edge.export import export_pte
    from random_sdar import random_model

    package = str(Path(export_pte.__code__.co_filename).parent) + "/"
    ran = set()

    def note(frame, event, arg):
        name = frame.f_code.co_filename
        if event == "call" and name.startswith(package):
            ran.add(name[len(package):])

    model = random_model(tiny_config(), seed=0)
    sys.setprofile(note)
    export_pte(model, Path(sys.argv[1]) / "s.pte", 64, 4, "static_kv")
    export_pte(model, Path(sys.argv[1]) / "q.pte", 64, 4, "block_kv", "8da4w")
    sys.setprofile(None)
    print(json.dumps(sorted(ran)))
    """
)


def test_the_export_digest_covers_every_module_an_export_runs(tmp_path):
    """The SmolLM2 programs the tests and the demo reuse are keyed by export_code_digest,
    which leaves out the run-only modules: no code of theirs may run in an export, or a
    change to one would leave a stale program in the cache."""
    from diffulex_edge import export

    package = Path(export.__file__).parent
    assert all((package / name).is_file() for name in export._RUN_ONLY_MODULES)
    done = subprocess.run(
        [sys.executable, "-c", _EXPORT, str(tmp_path), str(BENCHMARKS)],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    ran = set(json.loads(done.stdout.strip().splitlines()[-1]))
    assert {"export.py", "model.py", "pte_record.py"} <= ran, ran
    assert ran & export._RUN_ONLY_MODULES == set()
