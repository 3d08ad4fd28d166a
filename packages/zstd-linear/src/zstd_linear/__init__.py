"""Lossless zstd-compressed Linear layers with per-forward-pass caching and prefetch.

report = compress_model(model, policy="per_pass_prefetch")
model.generate(...)                  # bit-identical outputs, weights decoded on demand
compression_stats(model)             # passes, decompressions, bytes, seconds, peak
save_compressed(model, "m.zlin"); model = load_compressed("m.zlin")
decompress_model(model)              # plain nn.Linear again
"""

from zstd_linear.__about__ import __version__
from zstd_linear.codec import CodecConfig, EncodedWeight, Frame, encode_weight
from zstd_linear.decoder import DecodeError, Decoder
from zstd_linear.embedding import CompressedEmbedding
from zstd_linear.errors import CompressedFileError
from zstd_linear.fileformat import FORMAT_VERSION, read_file, write_file
from zstd_linear.layer import CompressedLinear
from zstd_linear.layout import LAYOUTS, SUPPORTED_DTYPES
from zstd_linear.model import (
    compress_model,
    compressed_layers,
    compression_report,
    compression_stats,
    decompress_model,
    reset_stats,
    set_policy,
)
from zstd_linear.policies import POLICIES, CachePolicy
from zstd_linear.pretrained import companion_path
from zstd_linear.report import CompressionReport, LayerReport
from zstd_linear.serialize import load_compressed, save_compressed
from zstd_linear.stats import DecodeStats

__all__ = [
    "FORMAT_VERSION",
    "LAYOUTS",
    "POLICIES",
    "SUPPORTED_DTYPES",
    "CachePolicy",
    "CodecConfig",
    "CompressedEmbedding",
    "CompressedFileError",
    "CompressedLinear",
    "CompressionReport",
    "DecodeError",
    "DecodeStats",
    "Decoder",
    "EncodedWeight",
    "Frame",
    "LayerReport",
    "__version__",
    "companion_path",
    "compress_model",
    "compressed_layers",
    "compression_report",
    "compression_stats",
    "decompress_model",
    "encode_weight",
    "load_compressed",
    "read_file",
    "reset_stats",
    "save_compressed",
    "set_policy",
    "write_file",
]
