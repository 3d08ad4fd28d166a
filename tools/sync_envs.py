"""Reinstall the workspace members of existing hatch environments from the current tree.

hatch installs workspace members once, as editable installs, and re-syncs an environment
only when one of its dependencies is missing. A member whose version or build output
changed since (a version bump, paired-cache's compiled C core) stays stale in an
environment that already exists: its metadata keeps the old version and the old shared
library keeps running. This reinstalls every member of each named environment with
`--no-deps --force-reinstall`, which rebuilds both; dependencies are left to hatch.
An environment that does not exist yet is left alone (hatch builds it fresh on first use).

    python tools/sync_envs.py                # every environment that has members
    python tools/sync_envs.py paired-cache   # one environment

`hatch run test:all` and `hatch run bench` call this before they run anything.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import tomllib
from _common import ROOT, hatch


def members(env: str) -> list[str]:
    """The workspace member paths hatch.toml lists for `env` (relative to the root)."""
    envs = tomllib.loads((ROOT / "hatch.toml").read_text())["envs"]
    if env not in envs:
        raise SystemExit(f"sync_envs: no environment {env!r} in hatch.toml (have {sorted(envs)})")
    entries = envs[env].get("workspace", {}).get("members", [])
    return [e if isinstance(e, str) else e["path"] for e in entries]


def env_exists(env: str) -> bool:
    found = subprocess.run(
        [hatch(), "env", "find", env], cwd=ROOT, capture_output=True, text=True, check=False
    )
    path = found.stdout.strip().splitlines()
    return found.returncode == 0 and bool(path) and Path(path[-1]).is_dir()


def refresh(env: str) -> int:
    """Reinstall `env`'s members if the environment exists; return the exit status."""
    paths = members(env)
    if not paths or not env_exists(env):
        return 0
    editable = [arg for p in paths for arg in ("--editable", p)]
    print(f"sync_envs: reinstalling {', '.join(paths)} in {env}", flush=True)
    command = [hatch(), "run", f"{env}:python", "-m", "pip", "install", "--quiet"]
    command += ["--no-deps", "--force-reinstall", *editable]
    return subprocess.call(command, cwd=ROOT)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("envs", nargs="*", help="environments (default: all with members)")
    args = parser.parse_args()
    names = args.envs or [
        name
        for name, cfg in tomllib.loads((ROOT / "hatch.toml").read_text())["envs"].items()
        if cfg.get("workspace", {}).get("members")
    ]
    failed = [name for name in names if refresh(name) != 0]
    if failed:
        print(f"sync_envs: failed for {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
