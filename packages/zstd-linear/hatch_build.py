"""hatchling build hook: compile the C core through cffi for the wheel and editable targets.

The extension ``_zstd_linear_core`` is a top-level module so that the same file works in
both targets: an editable install puts ``src/`` on the path, where a compiled file inside
``src/zstd_linear`` would have to be written into the source tree. A compile error
propagates and fails the build: there is no pure-Python fallback.
"""

from __future__ import annotations

import importlib.util
import shutil
import tempfile
from pathlib import Path

from hatchling.builders.hooks.plugin.interface import BuildHookInterface


def _load_ffi_build(root: str):
    path = Path(root) / "csrc" / "ffi_build.py"
    spec = importlib.util.spec_from_file_location("zstd_linear_ffi_build", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class CFFIBuildHook(BuildHookInterface):
    PLUGIN_NAME = "custom"

    def initialize(self, version: str, build_data: dict) -> None:
        if self.target_name != "wheel":
            return
        ffi_build = _load_ffi_build(self.root)
        self._tmp = tempfile.mkdtemp(prefix="zstd-linear-build-")
        built = Path(ffi_build.make_ffibuilder().compile(tmpdir=self._tmp, verbose=False))
        if not built.is_file():
            raise RuntimeError(f"cffi reported {built} but no such file was built")
        # The wheel holds a CPython extension: tag it for this interpreter and platform.
        build_data["pure_python"] = False
        build_data["infer_tag"] = True
        key = "force_include_editable" if version == "editable" else "force_include"
        build_data[key][str(built)] = built.name

    def finalize(self, version: str, build_data: dict, artifact_path: str) -> None:
        tmp = getattr(self, "_tmp", None)
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
