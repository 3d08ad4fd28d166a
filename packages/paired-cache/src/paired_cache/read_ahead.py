"""What load_sparse hooks onto a model it built so that the weights a token reads in full
come from the page cache: a read-ahead (MADV_WILLNEED) of the next block's mapped tensors
while this one computes (add_read_ahead), and a PageKeeper that keeps what fits cached and
pages the rest out as soon as it is used (keep_cached). A block is a decoder layer (or the
lm_head) and the mapped tensors it reads in full."""

from __future__ import annotations

import functools

import torch
from torch import nn

from paired_cache._pages import MappedPages, memory_groups, page_cache_room
from paired_cache.pool_file import PoolFile
from paired_cache.safetensors_map import SafetensorsMap

Block = tuple[nn.Module, list[tuple[SafetensorsMap, str]]]


def prune_replaced(model: nn.Module, blocks: list[Block]) -> None:
    """At the first forward, drop from each block the mapped tensors the model no longer
    holds: a module replaced after load_sparse returned (another package's, such as
    zstd-linear's load_compressed of the attention projections and the embedding) reads
    its weights elsewhere, and reading its old ranges ahead, or keeping them cached, would
    read bytes no forward uses."""
    for _module, own in blocks:
        own[:] = [(mapping, name) for mapping, name in own if _still_held(model, mapping, name)]


def _still_held(model: nn.Module, mapping: SafetensorsMap, name: str) -> bool:
    module_name, _, attr = name.rpartition(".")
    try:
        module = model.get_submodule(module_name)
    except AttributeError:
        return True  # not a module of the model's: a SparseMLP's gate, which it reads
    held = module._parameters.get(attr, module._buffers.get(attr))
    return held is not None and held.data_ptr() == mapping.tensor(name).data_ptr()


def layer_block(model: nn.Module, prefix: str, where, used: set[str]) -> Block:
    """A decoder layer and the mapped tensors it reads in full (all but the embedding's)."""
    names = sorted(n for n in used if n.startswith(prefix + "."))
    return model.get_submodule(prefix), [(where[n], n) for n in names]


def head_block(model: nn.Module, where, used: set[str]) -> Block | None:
    """The output embedding (lm_head) and its mapped weight: its own, or the input
    embedding's where they are tied."""
    head = model.get_output_embeddings()
    if head is None:
        return None
    names = {id(m): n for n, m in model.named_modules()}
    key = f"{names[id(head)]}.weight"
    embed = model.get_input_embeddings()
    if key not in used and embed is not None and embed.weight is head.weight:
        key = f"{names[id(embed)]}.weight"
    return (head, [(where[key], key)]) if key in used else None


def tensor_ranges(tensors) -> list[tuple[MappedPages, tuple[int, int]]]:
    """(mapping, (begin, end)) ranges holding the (mapping, name) tensors, merged per file."""
    by_map: dict[int, tuple[SafetensorsMap, list[str]]] = {}
    for mapping, name in tensors:
        by_map.setdefault(id(mapping), (mapping, []))[1].append(name)
    return [(m, r) for m, names in by_map.values() for r in m.ranges(names)]


class PageKeeper:
    """load_sparse's keep_cached: of the ranges each block reads in full every token, some
    blocks' stay cached and every other block's are paged out when the block is done.
    Blocks are kept largest first (SmolLM2: the lm_head, then the layers in reading order),
    as many as the budget takes, set as each token starts (the first block's forward
    pre-hook). "auto" leaves room for the two largest consecutive blocks that are not kept
    (one being read, the next read ahead) and MARGIN, from the room the process's memory
    cgroups leave for page cache (the groups looked up once, at the first token)."""

    MARGIN = 4 * 2**20

    def __init__(self, blocks: list[Block], extra, keep: int | str) -> None:
        self.blocks, self.extra = blocks, extra
        self.modules = [module for module, _ in blocks]
        self.measure()
        self.keep = keep
        self.kept: set[int] = set(range(len(blocks)))  # the blocks kept cached this token
        self.paged_out = 0  # bytes asked to be paged out, over the model's life
        self.groups: list | None = None  # the process's memory cgroups, looked up once
        # "auto" found, at this token, no memory limit or one that leaves room for twice
        # everything the blocks read: nothing of the model's is paged out or pressed.
        self.roomy = False

    def measure(self) -> None:
        """The ranges and sizes of the blocks' tensors (again after they were pruned)."""
        self.ranges = [
            tensor_ranges(own) + more
            for (_, own), more in zip(self.blocks, self.extra, strict=True)
        ]
        self.sizes = [sum(end - begin for _, (begin, end) in r) for r in self.ranges]
        self.order = sorted(range(len(self.blocks)), key=lambda i: (-self.sizes[i], i))

    def _in_flight(self, kept: set[int]) -> int:
        n = len(self.sizes)
        return max(
            (
                self.sizes[i] + (self.sizes[(i + 1) % n] if (i + 1) % n not in kept else 0)
                for i in range(n)
                if i not in kept
            ),
            default=0,
        )

    def plan(self) -> None:
        if self.keep == "auto":
            if self.groups is None:
                self.groups = memory_groups()
            room = page_cache_room(self.groups)
            self.roomy = room is None
            if room is None:  # no limit: the page cache is the kernel's
                self.kept = set(range(len(self.sizes)))
                return
        kept: set[int] = set()
        total = 0
        for i in self.order:
            trial = kept | {i}
            if self.keep == "auto":
                fits = total + self.sizes[i] + self._in_flight(trial) + self.MARGIN <= room
            else:
                fits = total + self.sizes[i] <= int(self.keep)
            if fits:
                kept, total = trial, total + self.sizes[i]
        self.kept = kept
        self.roomy = self.keep == "auto" and len(kept) == len(self.sizes) and room >= 2 * total

    def is_kept(self, i: int) -> bool:
        return i in self.kept

    def read_rows(self, block: int, pools: PoolFile, layer: int, rows: torch.Tensor) -> None:
        """In place, a layer whose pool is not kept reads the token's picked rows only
        (their pages, asked for once the mask is known); a kept one was read whole."""
        if block not in self.kept:
            pools.will_need_rows(layer, rows.numpy())

    def done(self, i: int) -> None:
        if i not in self.kept:
            for mapping, (begin, end) in self.ranges[i]:
                if mapping.page_out_range(begin, end):
                    self.paged_out += end - begin

    def attach(self) -> None:
        if not self.modules:
            return
        self.modules[0].register_forward_pre_hook(lambda _m, _a: self.plan())
        for i, module in enumerate(self.modules):
            module.register_forward_hook(lambda _m, _a, _o, i=i: self.done(i))


RECHECK_TOKENS = 16


def add_read_ahead(blocks: list[Block], extra=None, extra_wanted=None, roomy=None) -> None:
    """A forward pre-hook on each block asks for the next block's mapped tensors (the last
    block's, the head's, for the first block's: the next token starts there; the first
    block asks for its own too), so that their read overlaps this block's compute.
    Tensors stored side by side are asked for as one range (SmolLM2: the input norm, the
    gate, and the post-attention norm with the attention projections), and only ranges
    that do not look cached (``is_cached(sample=True)``) are asked for: asking for cached
    pages still walks them in the kernel (SmolLM2 under ample memory: 7 ms of a 47 ms
    token for 0.10's ~480 asks per token). The hooks stay with the model, which
    load_sparse built.

    Args:
        blocks: (module, its (mapping, tensor name) pairs) in the order a token runs them.
        extra: extra[i], more (mapping, (begin, end)) ranges block i reads, asked for with
            its tensors (a pool file's layer, in place); None: none.
        extra_wanted: extra_wanted(i) says at that moment whether block i's extra ranges
            are asked for (None: always; load_sparse passes its PageKeeper's is_kept: a
            layer not kept reads its picked rows only).
        roomy: roomy() says that this token no memory limit applies, or one that leaves
            room for twice what the blocks read (load_sparse passes its PageKeeper's;
            None: never); then a range found cached within the last RECHECK_TOKENS tokens
            is not looked at again (SmolLM2 under ample memory: ~125 ranges a token, each
            three mincore calls, 1.3 ms of a 38 ms token). Otherwise every range is looked
            at every token. With that much room the model's pages are evicted only when
            something else fills it (or the whole machine's memory is short); a range
            evicted then is faulted in, page by page, for up to RECHECK_TOKENS tokens
            before it is asked for again.
    """
    extra = extra if extra is not None else [[] for _ in blocks]
    token = [0]  # tokens started: the first block's hook counts them
    seen_cached: dict[tuple[int, int, int], int] = {}  # (mapping, begin, end) -> token

    def tagged(j):  # block j's ranges: its tensors' (always) and its extra ones (tag j)
        return [(m, r, None) for m, r in tensor_ranges(blocks[j][1])] + [
            (m, r, j) for m, r in extra[j]
        ]

    asks: dict[int, list] = {}  # block -> ranges it asks for, set at its first call (the
    # blocks' tensors are pruned at the model's first forward: prune_replaced)

    for i, (module, _own) in enumerate(blocks):

        def ask(_module, _args, i=i, first=i == 0) -> None:  # args unchanged
            if i not in asks:
                after = (i + 1) % len(blocks)
                asks[i] = tagged(after) if i else tagged(0) + tagged(after)
            wanted = asks[i]
            token[0] += first
            trust = roomy is not None and roomy()
            for mapping, (begin, end), j in wanted:
                if j is not None and extra_wanted is not None and not extra_wanted(j):
                    continue
                key = (id(mapping), begin, end)
                if trust and token[0] - seen_cached.get(key, -RECHECK_TOKENS) < RECHECK_TOKENS:
                    continue
                if mapping.is_cached(begin, end, sample=True):
                    seen_cached[key] = token[0]
                else:
                    seen_cached.pop(key, None)
                    mapping.will_need_range(begin, end)

        module.register_forward_pre_hook(ask)


def attach_page_hooks(
    model: nn.Module,
    mlp_names: list[str],
    pools: PoolFile,
    where: dict,
    used: set[str],
    *,
    in_place: bool,
    read_ahead: bool,
    keep_cached: int | str | None,
) -> None:
    """load_sparse's read-ahead and keep_cached (LoadConfig says what each does): one
    block per decoder layer (the layer of each MLP in mlp_names) and one for the lm_head;
    the blocks' mapped tensors pruned at the first forward (prune_replaced).

    Args:
        model: the model load_sparse built.
        mlp_names: its SparseMLPs' names, in the pool file's layer order.
        pools: the PoolFile they read; in place, each layer's whole pool is part of
            its block.
        where: mapped tensor name -> its SafetensorsMap.
        used: the mapped tensors the model reads.
        in_place: the SparseMLPs read their rows in place.
        read_ahead: add the read-ahead hooks.
        keep_cached: "auto", a byte count, or None (no PageKeeper).
    """
    blocks = [layer_block(model, name.rpartition(".")[0], where, used) for name in mlp_names]
    # In place, each token reads about half of every row's up | down_T part, scattered:
    # 4 KiB faults, one at a time. Asking for the layer's whole pool ahead reads more
    # bytes, in requests the device serves at its bandwidth.
    pool_ranges = [
        [(pools, pools.layer_range(i))] if in_place else [] for i in range(len(mlp_names))
    ]
    head = head_block(model, where, used)
    blocks += [head] if head else []
    extra = [*pool_ranges, []][: len(blocks)]
    keeper = None

    def prune_once(_model, _args) -> None:
        prune_replaced(model, blocks)
        if keeper is not None:
            keeper.measure()
        handle.remove()

    handle = model.register_forward_pre_hook(prune_once)
    if keep_cached is not None:
        keeper = model.page_keeper = PageKeeper(blocks, extra, keep_cached)
        keeper.attach()
        if in_place:
            for i, name in enumerate(mlp_names):
                model.get_submodule(name).will_read_rows = functools.partial(
                    keeper.read_rows, i, pools, i
                )
    if read_ahead:
        add_read_ahead(
            blocks,
            extra,
            None if keeper is None else keeper.is_kept,
            None if keeper is None else lambda: keeper.roomy,
        )


__all__ = [
    "RECHECK_TOKENS",
    "Block",
    "PageKeeper",
    "add_read_ahead",
    "attach_page_hooks",
    "head_block",
    "layer_block",
    "prune_replaced",
    "tensor_ranges",
]
