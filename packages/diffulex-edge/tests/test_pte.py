"""Real ExecuTorch programs: numerics against eager, and the engine's input checks."""

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch

from diffulex_edge import DiffulexEdgeError, runtime
from diffulex_edge.backends import EagerDynamic
from diffulex_edge.cli import main as cli_main
from diffulex_edge.config import tiny_config
from diffulex_edge.generate import GenerationConfig, generate
from diffulex_edge.pte_record import record_path
from diffulex_edge.runtime import PteEngine

from .test_generate import Lockstep

BS = 4


@pytest.mark.parametrize("variant", ["cache_io", "block_kv", "static_kv"])
def test_pte_matches_eager_over_a_32_token_greedy_generation(model, config, pte_paths, variant):
    engine = PteEngine(pte_paths[variant], expected_config=config)
    assert engine.variant == variant
    lock = Lockstep(EagerDynamic(model, BS), engine.backend)
    cfg = GenerationConfig(max_new_tokens=32, remasking="low_confidence_static", stop_on_eos=False)
    prompt = [3, 1, 4, 1, 5, 9, 2]
    through_lock = generate(lock, prompt, cfg, config.mask_token_id, config.eos_token_id)
    assert max(lock.diffs) <= 1e-4
    eager = generate(EagerDynamic(model, BS), prompt, cfg, config.mask_token_id, None)
    pte = engine.generate(prompt, cfg)
    assert len(eager.tokens) == 32
    assert pte.tokens == eager.tokens == through_lock.tokens


def test_engine_rejects_a_pte_exported_for_another_config(pte_paths):
    other = tiny_config(rope_theta=500.0)
    with pytest.raises(DiffulexEdgeError, match="exported for another model config"):
        PteEngine(pte_paths["block_kv"], expected_config=other)
    with pytest.raises(DiffulexEdgeError, match=r"exported for another model config.*num_layers"):
        PteEngine(pte_paths["block_kv"], expected_config=tiny_config(num_hidden_layers=3))


def test_engine_rejects_prompts_past_its_cache(config, pte_paths):
    engine = PteEngine(pte_paths["block_kv"])
    prompt = [i % 60 for i in range(70)]  # in the vocabulary of 64, no mask or EOS token
    with pytest.raises(ValueError, match="more than max_seq 64"):
        engine.generate(prompt, GenerationConfig(max_new_tokens=4))
    assert engine.backend.cache_len == 0


def test_engine_rejects_files_that_are_not_diffulex_programs(tmp_path):
    with pytest.raises(FileNotFoundError):
        PteEngine(tmp_path / "missing.pte")


def test_pte_cache_matches_eager_after_commits(model, pte_paths):
    engine = PteEngine(pte_paths["cache_io"])
    eager = EagerDynamic(model, BS)
    ids = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8]])
    engine.backend.reset(), eager.reset()
    engine.backend.prefill(ids), eager.prefill(ids)
    for i in range(model.config.num_hidden_layers):
        torch.testing.assert_close(
            engine.backend.kv_cache[i, 0, ..., :8, :], eager.cache.layer(i)[0], rtol=0, atol=1e-4
        )


def _copy(pte_paths, tmp_path, variant="block_kv"):
    """A copy of an exported program and its record in ``tmp_path``."""
    src = pte_paths[variant]
    dst = tmp_path / src.name
    shutil.copy(src, dst)
    shutil.copy(record_path(src), record_path(dst))
    return dst


def test_export_records_the_program_digest_and_config(config, pte_paths):
    path = pte_paths["block_kv"]
    record = json.loads(record_path(path).read_text())
    assert record["pte_sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()
    assert record["pte_bytes"] == path.stat().st_size
    assert record["config"] == config.to_dict()
    engine = PteEngine(path)
    assert engine.verified and engine.config == config
    assert (engine.mask_token_id, engine.eos_token_id) == (63, 62)


def test_byte_5_of_the_identifier_is_refused_without_reaching_executorch(pte_paths, tmp_path):
    """Issue #15: byte 5 set to 0x8c aborted the process inside ExecuTorch."""
    path = _copy(pte_paths, tmp_path)
    data = bytearray(path.read_bytes())
    assert data[4:8] == b"ET12"
    data[5] = 0x8C
    path.write_bytes(bytes(data))
    with pytest.raises(DiffulexEdgeError, match=r"block_kv\.pte does not match the SHA-256"):
        PteEngine(path)
    # Unverified, the identifier check still stops it before ExecuTorch.
    with pytest.raises(DiffulexEdgeError, match=r"block_kv\.pte is not an ExecuTorch program"):
        PteEngine(path, allow_unverified=True)


def test_a_flipped_byte_anywhere_is_refused_naming_the_file(pte_paths, tmp_path):
    path = _copy(pte_paths, tmp_path, "cache_io")
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(DiffulexEdgeError, match=r"cache_io\.pte does not match the SHA-256"):
        PteEngine(path)
    path.write_bytes(bytes(data[:-10]))
    with pytest.raises(DiffulexEdgeError, match=r"cache_io\.pte is \d+ bytes, its record"):
        PteEngine(path)


def test_a_file_that_is_not_a_pte_says_so(tmp_path):
    path = tmp_path / "notes.pte"
    path.write_text('{"not": "a program"}\n')
    with pytest.raises(DiffulexEdgeError, match=r"has no integrity record.*allow_unverified"):
        PteEngine(path)
    with pytest.raises(DiffulexEdgeError, match=r"notes\.pte is not an ExecuTorch program"):
        PteEngine(path, allow_unverified=True)


def test_no_record_needs_the_explicit_flag(config, pte_paths, tmp_path):
    path = _copy(pte_paths, tmp_path)
    record_path(path).unlink()
    with pytest.raises(DiffulexEdgeError, match="allow_unverified=True"):
        PteEngine(path)
    with pytest.raises(DiffulexEdgeError, match="allow_unverified must be a bool"):
        PteEngine(path, allow_unverified="yes")
    engine = PteEngine(path, expected_config=config, allow_unverified=True)
    assert not engine.verified and engine.config is None
    prompt = [3, 1, 4, 1, 5]
    cfg = GenerationConfig(max_new_tokens=8, stop_on_eos=False)
    assert (
        engine.generate(prompt, cfg).tokens
        == PteEngine(pte_paths["block_kv"]).generate(prompt, cfg).tokens
    )


def test_an_edited_record_is_refused(pte_paths, tmp_path):
    """Issue #15: changed eos_token_id / mask_token_id constants were accepted."""
    path = _copy(pte_paths, tmp_path)
    rec = record_path(path)
    record = json.loads(rec.read_text())
    record["config"]["eos_token_id"] = 5
    rec.write_text(json.dumps(record))
    with pytest.raises(DiffulexEdgeError, match=r"does not match its own record_sha256"):
        PteEngine(path)


def _reseal(rec, record):
    body = {k: v for k, v in record.items() if k != "record_sha256"}
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    rec.write_text(json.dumps({**body, "record_sha256": hashlib.sha256(canonical).hexdigest()}))


def test_a_rebuilt_record_with_other_token_ids_is_refused(pte_paths, tmp_path):
    """A record rewritten with its checksum recomputed: the token ids must still agree
    with the record's config and with the constants the program reports."""
    path = _copy(pte_paths, tmp_path)
    rec = record_path(path)
    original = json.loads(rec.read_text())
    record = json.loads(json.dumps(original))
    record["metadata"]["mask_token_id"] = 5
    _reseal(rec, record)
    with pytest.raises(DiffulexEdgeError, match=r"metadata disagrees with the record's own config"):
        PteEngine(path)
    # Config and metadata changed together (digest included): only the program knows.
    from diffulex_edge.config import SDARConfig
    from diffulex_edge.program_meta import config_digest

    record = json.loads(json.dumps(original))
    record["config"]["mask_token_id"] = 5
    record["metadata"]["mask_token_id"] = 5
    record["metadata"]["config_digest"] = config_digest(SDARConfig.from_dict(record["config"]))
    _reseal(rec, record)
    with pytest.raises(DiffulexEdgeError, match=r"program's constants disagree.*mask_token_id"):
        PteEngine(path)


def test_an_unknown_variant_id_names_itself(pte_paths, monkeypatch):
    """Issue #15: an unknown variant id gave a bare KeyError."""
    monkeypatch.setattr(runtime, "_VARIANT_BY_ID", {0: "cache_io"})
    with pytest.raises(DiffulexEdgeError, match=r"block_kv\.pte: variant_id 1 is unknown"):
        PteEngine(pte_paths["block_kv"])


def test_cli_refuses_an_unverified_pte_unless_told(pte_paths, tmp_path, capsys):
    path = _copy(pte_paths, tmp_path)
    record_path(path).unlink()
    argv = ["generate", "--pte", str(path), "--prompt-ids", "3,1,4", "--max-new-tokens", "4"]
    assert cli_main(argv) == 2
    assert "allow_unverified" in capsys.readouterr().err
    assert cli_main([*argv, "--allow-unverified"]) == 0


def _rss_anon_bytes() -> int:
    import re

    status = Path("/proc/self/status").read_text()
    return int(re.search(r"RssAnon:\s+(\d+) kB", status).group(1)) * 1024


def test_the_program_is_mapped_from_its_file_not_copied(smollm2_pte, monkeypatch):
    """Loading SmolLM2's 626 MiB program adds file-backed pages, not an anonymous copy:
    under a memory limit the kernel can evict them (0.3 read the bytes into memory and
    ExecuTorch kept them for the program's life)."""
    from diffulex_edge import runtime

    grown = []
    load = runtime.PteEngine._load

    def measured(self, path):
        before = _rss_anon_bytes()
        program = load(self, path)
        grown.append(_rss_anon_bytes() - before)
        return program

    monkeypatch.setattr(runtime.PteEngine, "_load", measured)
    engine = runtime.PteEngine(smollm2_pte)
    assert engine.verified and engine.pte_bytes > 600 * 2**20
    assert grown[0] < 0.1 * engine.pte_bytes, grown


def test_a_program_replaced_during_loading_is_refused(pte_paths, tmp_path, monkeypatch):
    path = tmp_path / "p.pte"
    source = pte_paths["block_kv"]
    shutil.copy(source, path)
    shutil.copy(source.with_name(source.name + ".json"), tmp_path / "p.pte.json")
    load = runtime.PteEngine._load

    def replaced_meanwhile(self, p):
        program = load(self, p)
        copy = tmp_path / "copy"
        shutil.copy(path, copy)
        copy.replace(path)  # same bytes, new inode: a replaced file
        return program

    monkeypatch.setattr(runtime.PteEngine, "_load", replaced_meanwhile)
    with pytest.raises(DiffulexEdgeError, match="changed while it was being loaded"):
        runtime.PteEngine(path)
