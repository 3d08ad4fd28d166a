"""The lazy expert store: non-expert weights are materialised, experts read one at a time."""

from __future__ import annotations

import re
from collections import defaultdict
from pathlib import Path

import mlx.core as mx

from moe_expert_cache.safetensors_io import SafetensorsShard, TensorInfo, open_shards

# mlx-lm stores each MoE layer's experts stacked: <block>.switch_mlp.<proj>.<param>, (E, ...).
_EXPERT_KEY = re.compile(
    r"^(?P<block>.+\.(?:mlp|block_sparse_moe))\.switch_mlp\."
    r"(?P<proj>gate_proj|up_proj|down_proj)\.(?P<param>weight|scales|biases|bias)$"
)
PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


class ExpertStore:
    """Reads a model directory's shards; experts by byte range, everything else whole.

    ``blocks`` maps a MoE block's module path (``model.layers.3.mlp``) to
    ``{proj: {param: TensorInfo}}`` where each tensor is stacked ``(E, ...)``.
    ``bytes_read[block]`` counts the expert bytes copied out of the shards.
    """

    def __init__(self, model_dir: str | Path):
        self.model_dir = Path(model_dir)
        self._shards: dict[Path, SafetensorsShard] = {}
        self._infos: dict[str, TensorInfo] = {}
        for shard in open_shards(self.model_dir).values():
            self._shards[shard.path] = shard
            self._infos.update(shard.tensors)
        blocks: dict[str, dict[str, dict[str, TensorInfo]]] = defaultdict(lambda: defaultdict(dict))
        for name, info in self._infos.items():
            m = _EXPERT_KEY.match(name)
            if m:
                blocks[m["block"]][m["proj"]][m["param"]] = info
        self.blocks = {b: {p: dict(v) for p, v in projs.items()} for b, projs in blocks.items()}
        for block, projs in self.blocks.items():
            if set(projs) != set(PROJECTIONS):
                raise ValueError(
                    f"{block}: expert projections {sorted(projs)}, expected {list(PROJECTIONS)}"
                )
            counts = {i.shape[0] for p in projs.values() for i in p.values()}
            if len(counts) != 1:
                raise ValueError(f"{block}: expert tensors disagree on the expert count {counts}")
        self.bytes_read: dict[str, int] = dict.fromkeys(self.blocks, 0)

    def num_experts(self, block: str) -> int:
        return next(iter(self.blocks[block]["up_proj"].values())).shape[0]

    def expert_nbytes(self, block: str) -> int:
        """Bytes of one expert of ``block`` (all projections and their scales/biases)."""
        return sum(i.row_bytes for p in self.blocks[block].values() for i in p.values())

    def non_expert_weights(self) -> dict[str, mx.array]:
        """Every tensor that is not an expert tensor, read whole (materialised)."""
        return {
            name: self._shards[info.shard].read(info)
            for name, info in self._infos.items()
            if not _EXPERT_KEY.match(name)
        }

    def read_expert(self, block: str, expert: int) -> dict[str, dict[str, mx.array]]:
        """Expert ``expert`` of ``block``: ``{proj: {param: array of shape info.shape[1:]}}``.

        Reads only that expert's byte range of each stacked tensor.
        """
        out: dict[str, dict[str, mx.array]] = {}
        for proj, params in self.blocks[block].items():
            out[proj] = {}
            for param, info in params.items():
                out[proj][param] = self._shards[info.shard].read(info, row=expert)
                self.bytes_read[block] += info.row_bytes
        return out

    def close(self) -> None:
        for shard in self._shards.values():
            shard.close()
