"""The command line."""

from __future__ import annotations

from moe_expert_cache import RouterTrace, pinned_experts, read_state
from moe_expert_cache.cli import main


def test_generate_and_simulate(model_dir, tmp_path, capsys):
    path = model_dir("mixtral", 4)
    trace = tmp_path / "router.trace"
    rc = main(
        [
            "generate",
            "--model",
            str(path),
            "--capacity",
            "0.5",
            "--mode",
            "skip",
            "--prompt-ids",
            "1,2,3",
            "--max-tokens",
            "8",
            "--trace-out",
            str(trace),
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0
    assert "tokens/s:" in out and "hit rate:" in out
    assert len(out.split("tokens:")[1].splitlines()[0].split()) == 8
    assert main(["simulate", str(trace), "--capacity", "0.5"]) == 0
    table = capsys.readouterr().out
    assert "| belady | 4 |" in table and "| lcp | 4 |" in table
    state = tmp_path / "state.json"
    rc = main(
        [
            "generate",
            "--model",
            str(path),
            "--capacity",
            "4",
            "--prompt-ids",
            "1,2,3",
            "--max-tokens",
            "4",
            "--profile",
            str(trace),
            "--pin-share",
            "0.3",
            "--adaptive",
            "--state-out",
            str(state),
        ]
    )
    assert rc == 0
    assert "resident expert bytes:" in capsys.readouterr().out
    saved = read_state(state)
    assert sum(len(r) for r in saved["resident"]) == 8  # adaptive split of 2 x 4 slots
    pins = pinned_experts(RouterTrace.load(trace), 0.3)
    for layer, pinned in enumerate(saved["pinned"]):
        cap = len(saved["resident"][layer])
        assert pinned == sorted(pins[layer][: cap - 2])


def test_generate_bad_capacity(model_dir, capsys):
    rc = main(
        ["generate", "--model", str(model_dir("olmoe")), "--capacity", "1", "--prompt-ids", "1"]
    )
    assert rc == 2
    assert "top_k=2" in capsys.readouterr().err
