"""Lossless zstd-compressed Linear layers with per-forward-pass caching and prefetch.

report = compress_model(model, policy="per_pass_prefetch")
model.generate(...)                  # bit-identical outputs, weights decoded on demand
compression_stats(model)             # passes, decompressions, bytes, seconds, peak
save_compressed(model, "m.zlin"); model = load_compressed("m.zlin")
decompress_model(model)              # plain nn.Linear again

Building blocks live in their modules: the codec in ``zstd_linear.codec``
(``encode_weight``, ``CodecConfig``, ``EncodedWeight``, ``Frame``), the decoder in
``zstd_linear.decoder`` (``Decoder``, ``DecodeError``), the file format in
``zstd_linear.fileformat`` (``read_file``, ``write_file``, ``FORMAT_VERSION``), the
policies in ``zstd_linear.policies``; see the README's "API" section.
"""

from zstd_linear.__about__ import __version__
from zstd_linear.embedding import CompressedEmbedding
from zstd_linear.errors import CompressedFileError, ZstdLinearError
from zstd_linear.layer import CompressedLinear
from zstd_linear.model import (
    compress_model,
    compression_report,
    compression_stats,
    decompress_model,
    reset_stats,
    set_policy,
)
from zstd_linear.policies import POLICIES
from zstd_linear.serialize import load_compressed, save_compressed

__all__ = [
    "POLICIES",
    "CompressedEmbedding",
    "CompressedFileError",
    "CompressedLinear",
    "ZstdLinearError",
    "__version__",
    "compress_model",
    "compression_report",
    "compression_stats",
    "decompress_model",
    "load_compressed",
    "reset_stats",
    "save_compressed",
    "set_policy",
]
