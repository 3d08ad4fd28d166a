"""Loaded compressed frames are pages of the mapped .zlin file, never anonymous copies."""

from __future__ import annotations

import mmap
import os
import zlib

import torch
import torch.nn as nn

from zstd_linear import compress_model, compression_stats, load_compressed, save_compressed
from zstd_linear.fileformat import read_file
from zstd_linear.model import compressed_layers

DIM = 1024
N_LAYERS = 16  # 16 x (1024, 512) float32: 32 MiB decoded, ~26 MiB compressed


class Stack(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(
            nn.Linear(DIM // 2 if i % 2 else DIM, DIM // 2 if i % 2 == 0 else DIM, bias=False)
            for i in range(N_LAYERS)
        )

    def forward(self, x):  # x: (..., DIM)
        for layer in self.layers:
            x = layer(x)
        return x


def make_stack(seed: int) -> Stack:
    torch.manual_seed(seed)
    return Stack().eval()


def anonymous_bytes() -> int:
    """The process's anonymous memory (kB lines of /proc/self/smaps_rollup)."""
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            if line.startswith("Anonymous:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no Anonymous line in /proc/self/smaps_rollup")


def saved_stack(tmp_path):
    model = make_stack(1)
    compress_model(model)
    path = tmp_path / "stack.zlin"
    save_compressed(model, path)
    return path


def test_frames_are_read_only_views_of_one_mapping_of_the_file(tmp_path):
    path = saved_stack(tmp_path)
    entries = read_file(path)
    mappings = set()
    for _, encoded, _ in entries:
        for chunk in encoded.frames:
            for frame in chunk:
                assert isinstance(frame.data, memoryview) and frame.data.readonly
                assert isinstance(frame.data.obj, mmap.mmap)
                mappings.add(id(frame.data.obj))
        assert encoded.file_backed_bytes == encoded.compressed_bytes
    assert len(mappings) == 1
    with open("/proc/self/maps") as f:
        assert any(line.rstrip().endswith(str(path.resolve())) for line in f)


def test_loading_does_not_copy_compressed_bytes_into_anonymous_memory(tmp_path):
    path = saved_stack(tmp_path)
    compressed = os.path.getsize(path)
    assert compressed > 24 << 20
    before = anonymous_bytes()
    entries = read_file(path, threads=1)
    grown = anonymous_bytes() - before
    # Reading the data section into memory (0.2's loader) grew it by >= `compressed`;
    # what remains is the verifying decode's buffer (the largest layer, 2 MiB, which
    # malloc may keep) and its scratch planes.
    assert grown < compressed // 4, (grown, compressed)
    assert sum(e.compressed_bytes for _, e, _ in entries) > compressed - (1 << 16)


def test_loaded_model_is_bit_identical_and_counts_its_frames_as_file_backed(tmp_path):
    path = saved_stack(tmp_path)
    plain, fresh = make_stack(1), make_stack(2)
    report = load_compressed(path, fresh, policy="per_pass_prefetch")
    assert report.file_backed_bytes == report.compressed_bytes and report.anonymous_bytes == 0
    stats = compression_stats(fresh)
    assert stats.compressed_file_bytes == report.compressed_bytes
    assert stats.compressed_anonymous_bytes == 0
    x = torch.randn(3, DIM)
    with torch.no_grad():
        for _ in range(3):
            assert torch.equal(fresh(x), plain(x))
    assert compression_stats(fresh).anonymous_bytes == compression_stats(fresh).decoded_bytes
    for name, layer in compressed_layers(fresh).items():
        assert torch.equal(layer.weight, plain.get_submodule(name).weight)


def test_compressed_in_memory_frames_are_counted_as_anonymous():
    model = make_stack(1)
    report = compress_model(model, policy="none")
    assert report.file_backed_bytes == 0 and report.anonymous_bytes == report.compressed_bytes
    assert compression_stats(model).compressed_anonymous_bytes == report.compressed_bytes


def test_verifying_a_file_decodes_a_group_of_chunks_at_a_time(tmp_path, monkeypatch):
    """Loading checks every weight's CRC without holding its largest layer decoded
    (0.7 allocated the largest layer whole: SmolLM2's embedding, 113 MiB of anonymous
    memory at load)."""
    from zstd_linear import fileformat

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1024, 1024, bias=False))  # 4 MiB float32
    plain = nn.Sequential(nn.Linear(1024, 1024, bias=False))
    plain.load_state_dict(model.state_dict())
    compress_model(model, chunk_bytes=64 << 10)
    path = tmp_path / "one.zlin"
    save_compressed(model, path)
    monkeypatch.setattr(fileformat, "VERIFY_GROUP_BYTES", 256 << 10)
    sizes = []
    empty = torch.empty

    def recording_empty(*args, **kwargs):
        out = empty(*args, **kwargs)
        sizes.append(out.nbytes)
        return out

    monkeypatch.setattr(torch, "empty", recording_empty)
    entries = read_file(path, threads=2)
    monkeypatch.setattr(torch, "empty", empty)
    assert max(sizes) == 256 << 10  # 4 chunks of 64 KiB, not the 4 MiB weight
    ((_, encoded, _),) = entries
    assert encoded.crc32 == zlib.crc32(plain[0].weight.detach().numpy().tobytes())
    fresh = nn.Sequential(nn.Linear(1024, 1024, bias=False))
    load_compressed(path, fresh)
    x = torch.randn(3, 1024)
    with torch.no_grad():
        assert torch.equal(fresh(x), plain(x))
