"""The compiled C core is what runs, it is current, its calls release the GIL, and the
wheel is a platform-tagged binary whose build fails when the C does not compile."""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from paired_cache._core import ffi, lib
from paired_cache.cache import core_info

PACKAGE = Path(__file__).resolve().parents[1]


def _ffi_build():
    spec = importlib.util.spec_from_file_location("ffi_build", PACKAGE / "csrc" / "ffi_build.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_core_is_a_compiled_extension():
    import _paired_cache_core

    path = Path(_paired_cache_core.__file__)
    assert path.suffix == ".so"
    assert path.read_bytes()[:4] == b"\x7fELF"
    # API mode: lib's functions are builtins of the extension, not ctypes/ABI trampolines.
    assert type(lib.pc_update).__name__ == "builtin_function_or_method"
    assert ffi.sizeof("pc_config") == 11 * 8


def test_core_was_built_from_the_current_sources():
    info = core_info()
    digest = _ffi_build().source_digest()
    assert digest in info, (
        f"the installed C core ({info}) is stale: rebuild it with "
        "`hatch env remove paired-cache && hatch env create paired-cache`"
    )
    assert "C201112L" in info and "pthreads" in info


def test_every_c_call_releases_the_gil(tmp_path):
    builder = _ffi_build().make_ffibuilder()
    glue = tmp_path / "glue.c"
    builder.emit_c_code(str(glue))
    text = glue.read_text()
    names = re.findall(r"^\w[\w\s\*]*\b(pc_\w+)\(", _ffi_build().cdef_text(), re.M)
    assert len(names) >= 14
    for name in names:
        body = text[text.index(f"_cffi_f_{name}(") :]
        body = body[: body.index("\n}\n")]
        call = body.index(f"{name}(", body.index("Py_BEGIN_ALLOW_THREADS"))
        assert body.index("Py_BEGIN_ALLOW_THREADS") < call < body.index("Py_END_ALLOW_THREADS")


def _build_wheel(source: Path, out: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(out), str(source)],
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.fixture(scope="module")
def package_copy(tmp_path_factory):
    dst = tmp_path_factory.mktemp("pkg") / "paired-cache"
    shutil.copytree(PACKAGE, dst, ignore=shutil.ignore_patterns("results", "__pycache__"))
    return dst


def test_wheel_is_platform_tagged_and_holds_the_core(package_copy, tmp_path):
    result = _build_wheel(package_copy, tmp_path)
    assert result.returncode == 0, result.stderr
    (wheel,) = tmp_path.glob("*.whl")
    assert not wheel.name.endswith("-none-any.whl")
    assert re.search(r"-cp3\d+-cp3\d+-linux_\w+\.whl$", wheel.name), wheel.name
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        assert any(re.fullmatch(r"_paired_cache_core\..*\.so", n) for n in names), names
        assert "paired_cache/py.typed" in names, names
        wheel_meta = next(n for n in names if n.endswith(".dist-info/WHEEL"))
        assert "Root-Is-Purelib: false" in zf.read(wheel_meta).decode()


def test_a_failed_compile_fails_the_build(package_copy, tmp_path):
    broken = package_copy.parent / "broken"
    shutil.copytree(package_copy, broken)
    update_c = broken / "csrc" / "pc_update.c"
    update_c.write_text(update_c.read_text() + "\nthis is not C;\n")
    result = _build_wheel(broken, tmp_path)
    assert result.returncode != 0
    assert not list(tmp_path.glob("*.whl"))
