"""Run block-diffusion generation on an exported ``.pte`` through ExecuTorch's runtime.

The engine verifies the program against its integrity record (``<name>.pte.json``,
:mod:`diffulex_edge.pte_record`) by reading the file once before ExecuTorch sees a byte,
then lets ExecuTorch map the file, and loads its methods with one packed copy of the
weights between them (:mod:`diffulex_edge.xnnpack_weight_cache`). It reads the program's
constant methods (what it was exported for), checks them against the record and the forward
method's input shapes before the first step, owns the static KV cache, and builds every
mask on the CPU with :mod:`diffulex_edge.masks` (a ``static_kv`` program holds its cache
itself and needs no masks: the engine loads ExecuTorch's LLM custom-op kernels for it).
"""

from __future__ import annotations

import warnings
from contextlib import ExitStack, nullcontext
from pathlib import Path

from diffulex_edge.backends import StaticBackend
from diffulex_edge.config import SDARConfig
from diffulex_edge.errors import DiffulexEdgeError
from diffulex_edge.export import EXPORT_VARIANTS, PREFILL_METHOD
from diffulex_edge.generate import (
    GenerationConfig,
    GenerationResult,
    check_token_ids,
    generate,
    generate_autoregressive,
)
from diffulex_edge.kv_cache import StaticCacheLayout
from diffulex_edge.page_lock import no_page_locking
from diffulex_edge.program_meta import META_KEYS, PTE_FORMAT_VERSION, config_digest
from diffulex_edge.pte_record import file_identity, record_path, verify_program_file
from diffulex_edge.xnnpack_weight_cache import WeightCacheUnavailable, shared_packed_weights

_VARIANT_BY_ID = {cls.variant_id: name for name, cls in EXPORT_VARIANTS.items()}


def _check_identifier(path: Path, data: bytes) -> None:
    """A .pte is a flatbuffer whose file identifier (bytes 4-8) is ``ET`` and two digits."""
    ident = data[4:8]
    if len(data) < 8 or ident[:2] != b"ET" or not ident[2:].isdigit():
        raise DiffulexEdgeError(
            f"{path} is not an ExecuTorch program: bytes 4-8 are {ident!r}, expected the "
            "identifier b'ET' + two digits (e.g. b'ET12')"
        )


def _check_flags(**flags) -> None:
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise DiffulexEdgeError(f"{name} must be a bool, got {value!r}")


class PteEngine:
    """Load a diffulex ``.pte`` and generate with it.

    The program must match its integrity record ``<path>.json`` (written by
    :func:`export_pte`): its size and SHA-256 are checked by reading the file once, then
    ExecuTorch maps the file itself, so the program's bytes are file-backed pages the kernel
    can evict under a memory limit, not an anonymous copy (626 MiB for SmolLM2 in float32).
    The file's identity (device, inode, size, mtime) must be the same after the mapping as
    at the check, else the engine refuses it: a file replaced or rewritten in between is
    caught; one rewritten in place with its size and mtime forged is not, and a file
    changed while the engine runs changes the program (as with any memory-mapped model).
    A program without a record, or that fails the check, is refused.

    The ``forward`` and ``prefill`` methods share one packed copy of the weights (XNNPACK's
    weight cache, switched on while they load: :mod:`diffulex_edge.xnnpack_weight_cache`);
    ``shares_packed_weights`` says whether they do. Where the ExecuTorch runtime cannot
    switch the cache, each method packs its own copy (SmolLM2 in fp32: 517 MiB each) and a
    program with a prefill method loads with a ``RuntimeWarning`` saying so.

    Args:
        path: the ``.pte`` written by :func:`export_pte`, its record ``<path>.json`` beside
            it.
        expected_config: when given, the program must have been exported from a model with
            exactly this config (compared by digest).
        allow_unverified: load a program without a record, or one that fails it, anyway:
            the engine still checks the file identifier and the program's constants, but a
            damaged program can then crash the process inside ExecuTorch.
        lock_pages: ExecuTorch locks every segment it maps in memory (``mlock``), where the
            process may: as root, or under a raised ``RLIMIT_MEMLOCK``. A locked page
            cannot be evicted under a memory limit. By default (False) the engine loads the
            program with locking refused (:mod:`diffulex_edge.page_lock`), so the mapped
            weights stay evictable file pages for every user, as they already are for an
            ordinary one; True leaves ExecuTorch's locking as it is (fewer page faults, more
            resident memory).

    Raises:
        FileNotFoundError: no file at ``path``.
        DiffulexEdgeError: the program fails its record (or has none), is not a diffulex-edge
            program of this format version, was exported for another config than
            ``expected_config``, changed while it loaded, or ExecuTorch is not installed or
            cannot load it; or a flag is not a bool.
    """

    def __init__(
        self,
        path: str | Path,
        expected_config: SDARConfig | None = None,
        *,
        allow_unverified: bool = False,
        lock_pages: bool = False,
    ) -> None:
        _check_flags(allow_unverified=allow_unverified, lock_pages=lock_pages)
        self.lock_pages = lock_pages
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"no .pte at {path}")
        self.path = path
        self.record, identity = self._verify_file(allow_unverified)
        self.verified = self.record is not None
        self.pte_bytes = identity[2]
        with self._loading():
            self.program = self._load(path)
        if file_identity(path) != identity:
            raise DiffulexEdgeError(
                f"{path} changed while it was being loaded (its inode, size or mtime differ "
                "from when it was checked); load it again"
            )
        self.meta = self._read_meta()
        self._check_meta_against_record()
        if expected_config is not None:
            self.check_config(expected_config)
        self.variant = _VARIANT_BY_ID[self.meta["variant_id"]]
        self.layout = self._cache_layout()
        self.method, self.backend = self._load_backend()

    def _verify_file(self, allow_unverified: bool):
        """The program's record and file identity (the record None when unverified, checked
        against the file otherwise), after checking the file's flatbuffer identifier."""
        if allow_unverified:
            record, identity = None, file_identity(self.path)
        else:
            record, identity = verify_program_file(self.path)
        with open(self.path, "rb") as f:
            _check_identifier(self.path, f.read(8))
        return record, identity

    def _check_meta_against_record(self) -> None:
        if self.record is None:
            return
        diffs = {
            k: (self.meta[k], self.record.metadata[k])
            for k in META_KEYS
            if self.meta[k] != self.record.metadata[k]
        }
        if diffs:
            raise DiffulexEdgeError(
                f"{self.path}: the program's constants disagree with "
                f"{record_path(self.path).name} (program vs record: {diffs})"
            )

    def _cache_layout(self) -> StaticCacheLayout:
        try:
            return StaticCacheLayout(
                num_layers=self.meta["num_layers"],
                batch=1,
                kv_heads=self.meta["kv_heads"],
                max_seq=self.meta["max_seq"],
                head_dim=self.meta["head_dim"],
                block_size=self.meta["block_size"],
            )
        except ValueError as err:
            raise DiffulexEdgeError(
                f"{self.path}: the program's cache geometry is invalid: {err}"
            ) from err

    def _load_backend(self):
        """``forward`` (and the prefill method when the program has one), checked against
        the cache layout, and the :class:`StaticBackend` that steps them."""
        prefill_size = self.meta["prefill_size"] or None
        static_kv = self.variant == "static_kv"
        if static_kv:
            from diffulex_edge.executorch_import import llm_custom_kernels

            llm_custom_kernels()  # the kernels its forward calls
        with self._loading():
            method, prefill = self._load_methods(prefill_size is not None and not static_kv)
        self._check_forward_inputs(method, static_kv)
        if static_kv:  # the prompt's chunks run through forward itself
            prefill = method if prefill_size is not None else None
        prefill_step = None if prefill is None else method_step(prefill)
        try:
            backend = StaticBackend(
                self.layout, self.variant, method_step(method), prefill_step, prefill_size
            )
        except ValueError as err:
            raise DiffulexEdgeError(f"{self.path}: {err}") from err
        return method, backend

    def _check_forward_inputs(self, method, static_kv: bool) -> None:
        """A static_kv forward takes (input_ids, input_pos); the others take the cache as
        their third input, in the layout's shape."""
        if static_kv:
            inputs = method.metadata.num_inputs()
            if inputs != 2:
                raise DiffulexEdgeError(
                    f"{self.path}: a static_kv forward takes (input_ids, input_pos), this one "
                    f"takes {inputs} inputs"
                )
            return
        try:
            cache_shape = tuple(method.metadata.input_tensor_meta(2).sizes())
        except RuntimeError as err:
            raise DiffulexEdgeError(f"{self.path}: forward has no kv_cache input: {err}") from err
        if cache_shape != self.layout.shape:
            raise DiffulexEdgeError(
                f"{self.path}: forward's kv_cache input is {cache_shape}, its metadata "
                f"says {self.layout.shape}"
            )

    def _loading(self):
        """What ExecuTorch may do with the pages it maps while the program loads: lock
        them only if ``lock_pages`` (:mod:`diffulex_edge.page_lock`)."""
        return nullcontext() if self.lock_pages else no_page_locking()

    def _load(self, path: Path):
        from diffulex_edge.executorch_import import runtime

        try:
            # By path: ExecuTorch memory-maps the file (its MmapDataLoader) instead of
            # holding a copy of the bytes.
            return runtime().load_program(str(path))
        except RuntimeError as err:
            raise DiffulexEdgeError(
                f"ExecuTorch could not load {self.path} as a program ({err}); the file is "
                "damaged or not a .pte"
            ) from err

    def _load_methods(self, with_prefill: bool):
        """``forward`` and, if asked, ``prefill``, with one packed copy of the weights
        between them (XNNPACK's shared weight cache, :mod:`diffulex_edge.xnnpack_weight_cache`)
        where the runtime allows it; sets :attr:`shares_packed_weights`."""
        path = self.path
        if with_prefill and PREFILL_METHOD not in self.program.method_names:
            raise DiffulexEdgeError(
                f"{path}: its metadata names a prefill of {self.meta['prefill_size']} tokens "
                f"but the program has no {PREFILL_METHOD!r} method"
            )
        names = ["forward", PREFILL_METHOD] if with_prefill else ["forward"]
        with ExitStack() as stack:
            try:
                stack.enter_context(shared_packed_weights())
                self.shares_packed_weights = True
            except WeightCacheUnavailable as err:
                self.shares_packed_weights = False
                if with_prefill:
                    warnings.warn(
                        f"{path}: each method packs its own copy of the weights ({err})",
                        RuntimeWarning,
                        stacklevel=3,
                    )
            methods = []
            for name in names:
                try:
                    methods.append(self.program.load_method(name))
                except RuntimeError as err:
                    raise DiffulexEdgeError(
                        f"ExecuTorch could not load {path}'s {name}: {err}"
                    ) from err
        return methods[0], (methods[1] if with_prefill else None)

    def _read_meta(self) -> dict[str, int]:
        path = self.path
        names = self.program.method_names
        if "diffulex_format_version" in names:
            version = self.program.load_method("diffulex_format_version").execute([])
            if version != [PTE_FORMAT_VERSION]:
                raise DiffulexEdgeError(
                    f"{path} has format version {version}, this engine reads "
                    f"{PTE_FORMAT_VERSION}: re-export it with this version of diffulex-edge"
                )
        missing = [k for k in META_KEYS if k not in names]
        if missing or "forward" not in names:
            raise DiffulexEdgeError(
                f"{path} is not a diffulex-edge program (missing methods "
                f"{missing + ([] if 'forward' in names else ['forward'])})"
            )
        meta = {}
        for k in META_KEYS:
            try:
                out = self.program.load_method(k).execute([])
            except RuntimeError as err:
                raise DiffulexEdgeError(f"{path}: constant method {k} failed: {err}") from err
            if len(out) != 1 or not isinstance(out[0], int) or isinstance(out[0], bool):
                raise DiffulexEdgeError(
                    f"{path}: constant method {k} returned {out!r}, expected an int"
                )
            meta[k] = out[0]
        if meta["diffulex_format_version"] != PTE_FORMAT_VERSION:
            raise DiffulexEdgeError(
                f"{path} has format version {meta['diffulex_format_version']}, "
                f"this engine reads {PTE_FORMAT_VERSION}"
            )
        if meta["variant_id"] not in _VARIANT_BY_ID:
            raise DiffulexEdgeError(
                f"{path}: variant_id {meta['variant_id']} is unknown, expected one of "
                f"{sorted(_VARIANT_BY_ID)} ({_VARIANT_BY_ID})"
            )
        for k in ("mask_token_id", "eos_token_id"):
            if not -1 <= meta[k] < meta["vocab_size"]:
                raise DiffulexEdgeError(
                    f"{path}: {k} {meta[k]} is outside [-1, vocab_size {meta['vocab_size']})"
                )
        return meta

    @property
    def config(self) -> SDARConfig | None:
        """The config the program was exported from (from the verified record), or None
        for an unverified program."""
        return None if self.record is None else self.record.config

    def check_config(self, config: SDARConfig) -> None:
        """Refuse a config other than the one the program was exported from.

        Args:
            config: The model config the caller means to run (e.g. to compare eager and
                ``.pte`` outputs).

        Raises:
            DiffulexEdgeError: Its shapes or its config digest differ from the program's.
        """
        got = {
            "num_layers": config.num_hidden_layers,
            "kv_heads": config.num_key_value_heads,
            "head_dim": config.head_dim,
            "vocab_size": config.vocab_size,
        }
        diffs = {k: (self.meta[k], v) for k, v in got.items() if self.meta[k] != v}
        if diffs or self.meta["config_digest"] != config_digest(config):
            raise DiffulexEdgeError(
                f"{self.path} was exported for another model config "
                f"(pte vs given: {diffs or 'same shapes, different config digest'})"
            )

    @property
    def mask_token_id(self) -> int:
        return self.meta["mask_token_id"]

    @property
    def eos_token_id(self) -> int | None:
        return None if self.meta["eos_token_id"] < 0 else self.meta["eos_token_id"]

    def generate(self, prompt_ids, config: GenerationConfig) -> GenerationResult:
        """Block diffusion for a program with a mask token; otherwise (an autoregressive
        model such as Llama) next-token decoding, which needs block size 1.

        Args:
            prompt_ids: the prompt's token ids, a list of ints or an integer tensor.
            config: how many tokens, the remasking strategy and the sampling.

        Returns:
            :class:`GenerationResult`: the new tokens (cut before the first EOS) and the
            forwards they took.

        Raises:
            ValueError: an empty prompt, a token id outside the vocabulary, the mask token
                in the prompt, or a prompt plus ``max_new_tokens`` longer than the program's
                cache.
            DiffulexEdgeError: an autoregressive program exported with a block size other
                than 1.
        """
        check_token_ids(prompt_ids, self.meta["vocab_size"])
        if self.mask_token_id < 0:
            if self.layout.block_size != 1:
                raise DiffulexEdgeError(
                    f"{self.path} has no mask_token_id (an autoregressive model) but block "
                    f"size {self.layout.block_size}; export it with block_size 1"
                )
            return generate_autoregressive(self.backend, prompt_ids, config, self.eos_token_id)
        return generate(self.backend, prompt_ids, config, self.mask_token_id, self.eos_token_id)


def method_step(method):
    """An ExecuTorch method as a step callable (tensors in, tuple of tensors out)."""

    def step(*inputs):
        return tuple(method.execute(list(inputs)))

    return step
