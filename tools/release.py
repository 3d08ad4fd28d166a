"""Build one package and check it as a user gets it, then print its release tag.

    python tools/release.py zstd-linear [--tests] [--dist DIR]

Checks that the version in __about__.py was bumped past the package's last tag
(`<package>-v<version>`) and that CHANGELOG.md has an entry for it; builds the sdist and
the wheel with `hatch build`; installs the wheel into a fresh venv; imports it there and
checks the version; with --tests, also runs the package's tests against that installed
wheel (not the editable tree). Prints the tag to create; creates nothing in git.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
import venv
from pathlib import Path

from _common import PACKAGES, ROOT, hatch

# Packages whose wheel carries compiled code and so must be platform-tagged.
PLATFORM_WHEELS = {"paired-cache"}
# The dev machines' CPU torch; a user's pip resolves the open range in the metadata.
DEV_CONSTRAINTS = "torch==2.13.0\n"


class ReleaseError(Exception):
    pass


def read_version(package: str) -> str:
    about = ROOT / "packages" / package / "src" / PACKAGES[package] / "__about__.py"
    match = re.search(r'__version__\s*=\s*"([^"]+)"', about.read_text())
    if not match:
        raise ReleaseError(f'{about}: no __version__ = "..." line')
    return match.group(1)


def check_bumped(package: str, version: str) -> None:
    changelog = (ROOT / "packages" / package / "CHANGELOG.md").read_text()
    if not re.search(rf"^##\s+\[?{re.escape(version)}\]?(\s|$)", changelog, re.M):
        raise ReleaseError(f"{package}: CHANGELOG.md has no '## {version}' entry")
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
    )
    wheels = sorted(dist.glob(f"{PACKAGES[package]}-*.whl"))
    sdists = sorted(dist.glob(f"{PACKAGES[package]}-*.tar.gz"))
    if len(wheels) != 1 or len(sdists) != 1:
        raise ReleaseError(f"expected one wheel and one sdist in {dist}, found {wheels + sdists}")
    wheel = wheels[0]
    if package in PLATFORM_WHEELS and wheel.name.endswith("-none-any.whl"):
        raise ReleaseError(f"{wheel.name}: {package} must build a platform-tagged wheel")
    return wheel, sdists[0]


def install_and_check(package: str, version: str, wheel: Path, run_tests: bool) -> None:
    with tempfile.TemporaryDirectory(prefix=f"release-{package}-") as tmp:
        env_dir = Path(tmp) / "venv"
        venv.create(env_dir, with_pip=True)
        py = str(env_dir / "bin" / "python")
        constraints = Path(tmp) / "constraints.txt"
        constraints.write_text(DEV_CONSTRAINTS)
        pip = [py, "-m", "pip", "install", "-q", "-c", str(constraints)]
        spec = f"{wheel}[test]" if run_tests else str(wheel)
        subprocess.run([*pip, spec], check=True)
        mod = PACKAGES[package]
        smoke = (
            f"import {mod}, sys; v = {mod}.__version__; "
            f"assert v == {version!r}, v; "
            f"assert 'site-packages' in {mod}.__file__, {mod}.__file__; "
            f"print('imported', {mod}.__name__, v, 'from', {mod}.__file__)"
        )
        subprocess.run([py, "-c", smoke], check=True, cwd=tmp)
        if run_tests:
            helper = ROOT / "tools" / "membound-testing"
            subprocess.run([*pip, f"{helper}[models]"], check=True)
            tests = ROOT / "packages" / package / "tests"
            # Run from the temp dir with importlib mode so src/ is never on sys.path.
            subprocess.run(
                [
                    py,
                    "-m",
                    "pytest",
                    "-q",
                    "-p",
                    "no:cacheprovider",
                    "--import-mode=importlib",
                    str(tests),
                ],
                check=True,
                cwd=tmp,
            )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("package", choices=list(PACKAGES))
    parser.add_argument("--tests", action="store_true", help="run the tests against the wheel")
    parser.add_argument("--dist", type=Path, help="where to put the built files (default: temp)")
    args = parser.parse_args()

    try:
        version = read_version(args.package)
        check_bumped(args.package, version)
        with tempfile.TemporaryDirectory() as tmp:
            dist = args.dist or Path(tmp)
            dist.mkdir(parents=True, exist_ok=True)
            wheel, sdist = build(args.package, dist)
            print(f"built {sdist.name} and {wheel.name}")
            install_and_check(args.package, version, wheel, args.tests)
    except (ReleaseError, subprocess.CalledProcessError) as exc:
        print(f"release check failed: {exc}", file=sys.stderr)
        return 1
    print(f"{args.package}-v{version}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
