"""What CompressedLinear and CompressedEmbedding share: a weight kept as an EncodedWeight,
and the nn.Module operations that cannot apply to it, refused instead of half done."""

from __future__ import annotations

import torch
import torch.nn as nn

from zstd_linear.codec import EncodedWeight
from zstd_linear.decoder import Decoder

SAVE_HINT = (
    "save it with zstd_linear.save_compressed(model, path) and load it back with "
    "zstd_linear.load_compressed(path), or call zstd_linear.decompress_model(model) first"
)


class CompressedModule(nn.Module):
    """Base of the compressed modules; subclasses set ``encoded`` and ``name``.

    The weight is no parameter, so ``state_dict()`` could only leave it out: a
    checkpoint saved from it would load as a model missing its weights. Both that and a
    dtype or device move, which cannot reach the compressed bytes, raise instead.
    """

    encoded: EncodedWeight
    name: str

    @property
    def weight(self) -> torch.Tensor:
        """A freshly decoded copy of the weight (the module's shape, its dtype): costs a
        full decode and allocation, and is not tracked by the caching policy."""
        return Decoder(threads=1).decode(self.encoded)

    @property
    def compressed_bytes(self) -> int:
        return self.encoded.compressed_bytes

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        raise RuntimeError(
            f"state_dict() cannot hold {prefix}weight: it is zstd-compressed "
            f"({type(self).__name__}), so a checkpoint saved from the state dict would "
            f"silently lack it; {SAVE_HINT}"
        )

    def _apply(self, fn, recurse=True):
        check_move(self, fn)
        return super()._apply(fn, recurse)

    def _shape_repr(self) -> str:
        raise NotImplementedError

    def extra_repr(self) -> str:
        e = self.encoded
        return (
            f"{self._shape_repr()}, dtype={e.dtype}, layout={e.layout}, "
            f"ratio={e.original_bytes / max(1, e.compressed_bytes):.3f}"
        )


def check_move(module: CompressedModule, fn) -> None:
    """Raise unless ``fn`` (what ``Module._apply`` applies: ``.to(...)``, ``.half()``,
    ``.cuda()`` ...) leaves a tensor of the compressed weight's dtype on the CPU as it
    is. Probed on an empty tensor, before anything changes."""
    dtype = module.encoded.torch_dtype
    moved = fn(torch.empty(0, dtype=dtype))
    if moved.dtype != dtype or moved.device.type != "cpu":
        raise RuntimeError(
            f"cannot move the zstd-compressed weight of {module.name!r} ({module.encoded.dtype} "
            f"on the CPU) to {str(moved.dtype).removeprefix('torch.')} on {moved.device}: it "
            "decodes only to its stored dtype, on the CPU. Convert the model before "
            "compress_model, or call zstd_linear.decompress_model(model) first"
        )
