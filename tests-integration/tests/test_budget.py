"""The budget runner itself: hard limits as the kernel enforces them.

These need a writable memory cgroup, which CI has (it runs as root on a machine with
cgroup v1 or v2): where none can be made, they fail with the runner's reason rather than
skip, since the runner is what is under test.
"""

import os
import sys

import pytest

from membound_integration.budget import __main__ as cli
from membound_testing.budget import cgroup
from membound_testing.budget.runner import bisect_min_limit, run_limited

MiB = 2**20


def _py(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def _alloc(mib: int) -> list[str]:
    # Touch every page, so the memory is really charged (bytearray zero-fills it), and
    # hold it for longer than the runner's sampling interval.
    return _py(
        f"import time; x = bytearray({mib} * 2**20); time.sleep(0.2); print('allocated', len(x))"
    )


def test_anonymous_memory_past_the_limit_is_reported_as_oom_killed():
    result = run_limited(_alloc(300), 128 * MiB)
    assert result.oom_killed
    assert not result.completed
    assert result.status == "OOM-killed"
    assert result.peak_anon > 64 * MiB  # it got as far as filling the limit


def test_anonymous_memory_under_the_limit_completes():
    result = run_limited(_alloc(64), 256 * MiB)
    assert result.completed, (result.status, result.stderr)
    assert "allocated 67108864" in result.stdout
    assert 64 * MiB <= result.peak_anon < 256 * MiB
    assert result.peak_usage >= result.peak_anon  # the kernel's own peak (anon + cache)


def test_a_mapped_file_larger_than_the_limit_is_read_under_it(tmp_path):
    """File pages are reclaimable: the kernel evicts them and the read goes on."""
    big = tmp_path / "weights.bin"
    with open(big, "wb") as f:
        for _ in range(320):
            f.write(b"\x01" * MiB)
        # Written back and evicted here too, not only by the runner's drop (sync, then
        # drop_caches), so the read below must come from the disk. The one run that counted
        # read_bytes 0 here was the first after boot, before any throttled run: v1 counts
        # reads only once a throttle rule was written (cgroup._count_reads_v1).
        f.flush()
        os.fsync(f.fileno())
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    code = (
        "import mmap, sys\n"
        f"f = open({str(big)!r}, 'rb')\n"
        "m = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)\n"
        "s = sum(m[i] for i in range(0, len(m), 4096))\n"
        "print('sum', s)\n"
    )
    result = run_limited(_py(code), 128 * MiB)
    assert result.completed, (result.status, result.stderr)
    assert f"sum {320 * MiB // 4096}" in result.stdout
    assert result.peak_file_mapped + result.peak_anon < 128 * MiB
    # The page cache was dropped first, so the file came from the disk.
    if result.cache_note is None:
        assert result.read_bytes >= 320 * MiB, result


def test_read_throttle_bounds_the_read_rate(tmp_path):
    big = tmp_path / "data.bin"
    big.write_bytes(b"\x02" * (48 * MiB))
    device = cgroup.block_device_of(big)
    code = f"import time; t = time.time(); open({str(big)!r}, 'rb').read(); print(time.time() - t)"
    result = run_limited(_py(code), 256 * MiB, read_bps=16 * 10**6, device=device)
    assert result.completed, (result.status, result.stderr)
    assert result.cache_note is None, result.cache_note
    # 48 MiB at 16 MB/s takes >= ~3 s; unthrottled it is a fraction of a second here.
    assert float(result.stdout.split()[-1]) > 2.0
    assert result.read_bytes >= 48 * MiB


def test_bisection_finds_a_known_threshold_within_the_resolution():
    calls = []

    def passes(limit):
        calls.append(limit)
        return limit >= 300 * MiB, ""

    found = bisect_min_limit(passes, 64 * MiB, 2048 * MiB)
    assert 300 * MiB <= found.min_bytes <= 316 * MiB
    assert calls[0] == 2048 * MiB
    assert len(calls) <= 9


def test_bisection_of_a_real_child_brackets_its_allocation():
    """A child holding 192 MiB of anonymous memory needs a little more than that."""

    def passes(limit):
        result = run_limited(_alloc(192), limit, drop_cache=False)
        return result.completed, result.status

    found = bisect_min_limit(passes, 64 * MiB, 512 * MiB)
    assert found.min_bytes is not None
    assert 192 * MiB < found.min_bytes <= 192 * MiB + 64 * MiB, found.tries


def test_bisection_reports_none_when_even_hi_fails():
    found = bisect_min_limit(lambda limit: (False, "OOM-killed"), 64 * MiB, 128 * MiB)
    assert found.min_bytes is None
    assert "fails even at 128 MiB" in found.describe()


def test_bisection_goes_on_above_hi_up_to_the_fallback_keeping_every_try():
    found = bisect_min_limit(
        lambda limit: (limit >= 900 * MiB, ""), 64 * MiB, 512 * MiB, fallback_hi=2048 * MiB
    )
    assert 900 * MiB <= found.min_bytes <= 916 * MiB
    assert found.tries[0] == (512 * MiB, False, "") and found.tries[1][0] == 2048 * MiB
    no_fallback = bisect_min_limit(lambda limit: (limit >= 900 * MiB, ""), 64 * MiB, 512 * MiB)
    assert no_fallback.min_bytes is None and len(no_fallback.tries) == 1


def test_no_writable_cgroup_is_one_line_and_exit_2(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(cgroup, "V1", tmp_path / "none")
    monkeypatch.setattr(cgroup, "V2_CANDIDATES", (tmp_path / "none",))
    assert cli.main(["run", "--limit", "100M", "--", "true"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert err[0].startswith("budget: no hard limit can be set here:")


@pytest.mark.parametrize("text,expected", [("480M", 480 * MiB), ("2G", 2 * 2**30), ("1024", 1024)])
def test_sizes_parse(text, expected):
    assert cli.parse_size(text) == expected


def test_groups_are_removed_after_a_run():
    before = {p.name for p in (cgroup.V1 / "memory").rglob("membound-budget-*")}
    run_limited(_py("print(1)"), 64 * MiB, drop_cache=False)
    after = {p.name for p in (cgroup.V1 / "memory").rglob("membound-budget-*")}
    assert after <= before


def test_a_demo_row_under_a_limit_reports_its_answer_and_its_reads():
    from membound_integration.demo import parse_row, row_command

    result = run_limited(row_command("plain", "plain"), 2048 * MiB)
    assert result.completed, (result.status, result.stderr[-2000:])
    row = parse_row(result.stdout)
    assert row["correct"] and "Paris" in row["output"]
    assert row["new_tokens"] > 0
    assert row["decode_read_bytes"] is not None
    # The safetensors weights are mmap'd: file-backed pages of the process, not anonymous.
    assert result.peak_rss_file > 100 * MiB
    assert result.peak_rss_anon < 2048 * MiB


def _raw(tps: dict, limits: dict) -> dict:
    raw = {}
    for row, per_profile in tps.items():
        raw[row] = {
            "profiles": {
                p: {"completed": True, "correct": True, "tokens_per_s": v}
                for p, v in per_profile.items()
            }
        }
    for row, mib in limits.items():
        raw.setdefault(row, {"profiles": {}})["min_limit"] = {"min_limit_mib": mib}
    return raw


def test_targets_are_judged_from_the_measurements():
    from membound_integration.budget.suite import _targets

    raw = _raw(
        {"plain": {"tight": 0.3, "ample": 10.0}, "zstd_linear": {"tight": 0.61, "ample": 8.0}},
        {"plain": 400, "zstd_linear": 380, "bmrt_kv": 700, "plain_passkey": 860},
    )
    got = {t["target"]: t for t in _targets(raw)}
    assert got["zstd_linear: minimum hard limit below plain's"]["met"]
    assert got["tight: zstd_linear >= 2.0x plain tokens/s, same answer"]["met"]
    assert not got["ample: zstd_linear >= 0.9x plain tokens/s"]["met"]  # 0.8x
    assert got["tight: paired_cache >= 1.5x plain tokens/s, same answer"]["measured"] == (
        "not measured"
    )
    assert not got["tight: paired_cache >= 1.5x plain tokens/s, same answer"]["met"]
    bmrt = next(t for t in got.values() if t["target"].startswith("bmrt-kv"))
    assert bmrt["met"]  # 160 MiB below
    raw["zstd_linear"]["profiles"]["tight"]["correct"] = False  # a wrong answer never counts
    got = {t["target"]: t for t in _targets(raw)}
    assert not got["tight: zstd_linear >= 2.0x plain tokens/s, same answer"]["met"]


def test_a_minimum_limit_is_below_plains_only_where_plain_failed():
    """A minimum within the bisection's resolution of plain's is not "below" it: the
    row must have answered under a limit at which plain failed (2026-11-26: zstd-linear
    421 MiB, plain 425 MiB, plain failed at 413 MiB)."""
    from membound_integration.budget.suite import _targets

    raw = _raw({}, {"plain": 425, "zstd_linear": 421})
    raw["plain"]["min_limit"]["tries"] = [[786, True, "ok"], [425, True, "ok"], [413, False, "x"]]
    target = "zstd_linear: minimum hard limit below plain's"
    got = {t["target"]: t for t in _targets(raw)}[target]
    assert not got["met"]
    assert got["measured"] == (
        "421 MiB vs plain 425 MiB; plain failed at 413 MiB: within the bisection's resolution"
    )
    raw["zstd_linear"]["min_limit"]["min_limit_mib"] = 410
    got = {t["target"]: t for t in _targets(raw)}[target]
    assert got["met"] and got["measured"] == "410 MiB vs plain 425 MiB; plain failed at 413 MiB"


def test_a_row_and_its_baseline_from_different_runs_are_not_compared():
    from membound_integration.budget.suite import OTHER_RUN, _targets

    raw = _raw(
        {"plain": {"tight": 0.3, "ample": 10.0}, "zstd_linear": {"tight": 0.9, "ample": 10.0}},
        {"plain": 400, "zstd_linear": 380},
    )
    for row, run in (("plain", "2026-11-26 10:42 UTC"), ("zstd_linear", "2026-11-26 06:42 UTC")):
        for entry in [*raw[row]["profiles"].values(), raw[row]["min_limit"]]:
            entry["run"] = run
    got = {t["target"]: t for t in _targets(raw)}
    for target in (
        "zstd_linear: minimum hard limit below plain's",
        "tight: zstd_linear >= 2.0x plain tokens/s, same answer",
        "ample: zstd_linear >= 0.9x plain tokens/s",
    ):
        assert not got[target]["met"], target
        assert got[target]["measured"].endswith(f"({OTHER_RUN})"), got[target]
    for entry in [*raw["zstd_linear"]["profiles"].values(), raw["zstd_linear"]["min_limit"]]:
        entry["run"] = "2026-11-26 10:42 UTC"  # the same run: compared again
    got = {t["target"]: t for t in _targets(raw)}
    assert got["zstd_linear: minimum hard limit below plain's"]["met"]
    assert got["tight: zstd_linear >= 2.0x plain tokens/s, same answer"]["met"]


def test_a_child_that_cannot_join_its_group_is_an_error_not_a_measurement(monkeypatch):
    """If the wrapper cannot put the child in the group, the command must not run unlimited."""
    real_wrap = cgroup.Cgroup.wrap

    def broken_wrap(self, command):
        self.groups = [*self.groups, cgroup.Path("/nonexistent-cgroup")]
        return real_wrap(self, command)

    monkeypatch.setattr(cgroup.Cgroup, "wrap", broken_wrap)
    with pytest.raises(cgroup.CgroupUnavailable, match="could not join"):
        run_limited(_py("print('ran unlimited')"), 64 * MiB, drop_cache=False)


def test_a_process_mapping_the_model_cache_stops_the_run_before_it_starts(
    monkeypatch, tmp_path, capsys
):
    # Pages a process maps cannot be dropped and stay charged to its group: a limited run
    # would read them for free. The runner refuses, naming the process and the file, and
    # runs nothing; with the mapping gone it runs.
    import mmap

    monkeypatch.setenv("MEMBOUND_CACHE", str(tmp_path))
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"\0" * 8192)
    marker = tmp_path / "ran"
    with open(weights, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ):
        found = cgroup.mapped_by_processes(tmp_path)
        assert len(found) == 1 and found[0].startswith(f"pid {os.getpid()} (")
        assert found[0].endswith(f") maps {weights}")
        code = cli.main(["run", "--limit", "256M", "--", "touch", str(marker)])
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and len(err) == 1 and not marker.exists()
        assert err[0].startswith(f"budget: not measured: pid {os.getpid()} (")
        assert f"maps {weights}: pages a process maps stay in the page cache" in err[0]
    assert cgroup.mapped_by_processes(tmp_path) == []
    assert run_limited(["touch", str(marker)], 256 * MiB).completed and marker.exists()
