"""The packages stacked on one model, each through its own public API (#54).

No package imports another; this module is the glue, and it is short because each package
takes the model the other left:

1. ``paired_cache.load_sparse`` builds the model from storage: every MLP a SparseMLP over
   the rows of a pool file, mapped (``rows="in_place"``: each token multiplies its
   predicted rows where they lie), every other weight a view of the mapped safetensors.
2. ``zstd_linear.load_compressed(path, model)`` replaces every nn.Linear the .zlin file
   names (the attention projections) and the embedding (with the lm_head tied to it) by
   their compressed forms, still file-backed. The file is written without the MLPs
   (``compress_model(model, exclude="*.mlp.*", embeddings=True)``): the rows are
   paired-cache's.
3. ``bmrt_kv.BMRTCache`` bounds the KV cache of that model's attention.

Nothing of the model is copied into anonymous memory but the mask sources' predictors,
the MLP rows a token multiplies, and the decoded layers the zstd-linear policy keeps.

Stacking in the other order (compress first, then sparsify) gives the same model at
lossless settings (tests/test_stack.py); a file naming layers another package replaced
is refused by zstd-linear before the model changes.
"""

from __future__ import annotations

import os
from pathlib import Path

MLP_GLOB = "*.mlp.*"


def write_rest_zlin(full: str | os.PathLike, path: str | os.PathLike) -> Path:
    """Cut the .zlin file of every layer but the MLPs' from a file of the whole model, with
    zstd-linear's own reader and writer (no re-encoding; written atomically).

    Args:
        full: a .zlin file written by ``save_compressed`` of the whole model.
        path: where to write the file without the MLP layers.

    Returns:
        ``path``.
    """
    from zstd_linear.fileformat import read_file, write_file

    entries = read_file(full)
    write_file(path, [e for e in entries if ".mlp." not in e[0]])
    return Path(path)


def load_stacked(
    model_dir: str | os.PathLike,
    pool: str | os.PathLike,
    zlin: str | os.PathLike,
    source: str = "trained",
    fraction: float = 0.5,
    *,
    policy: str = "per_pass_prefetch",
    predictor: str | os.PathLike | None = None,
    **policy_options,
):
    """The model of ``model_dir`` with its MLPs sparse over ``pool`` and every other Linear
    and the embedding compressed from ``zlin``.

    Args:
        model_dir: a transformers checkpoint (config.json and safetensors).
        pool: its pool file (``paired_cache.convert``).
        zlin: its .zlin file without MLP layers (``compress_model(..., exclude="*.mlp.*",
            embeddings=True)`` then ``save_compressed``, or :func:`write_rest_zlin`).
        source: paired-cache's mask source; "trained" needs ``predictor``.
        fraction: the share of MLP rows each token reads, in (0, 1].
        policy: zstd-linear's policy name; ``policy_options`` go to it (``memory_limit=
            "auto"`` for "budget").
        predictor: the predictor file of ``source="trained"``.

    Returns:
        The model, in eval mode.
    """
    import zstd_linear
    from paired_cache import load_sparse

    options = {} if predictor is None else {"predictor": predictor}
    model = load_sparse(model_dir, pool, source, fraction, rows="in_place", **options)
    zstd_linear.load_compressed(zlin, model, policy, **policy_options)
    return model
