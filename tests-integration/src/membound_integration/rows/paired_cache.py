"""paired-cache row: SmolLM2-135M with every MLP a SparseMLP at 50% active rows, run from storage.

The MLPs' neuron pools live in a pool file (``paired-cache convert --no-gate``: rows of up |
down_T, the gate being read from the safetensors by the predictor; made once by the PREPARE
step and kept under ``$MEMBOUND_CACHE``), mapped read-only; ``load_sparse`` builds the
model without ever materialising the dense MLP weights, and every other weight is a view of
the mapped safetensors. Each token's mask is the trained (gated) predictor's: the gate
computed exactly from gate_proj mapped from the safetensors, up x predicted at rank 64, fitted by the PREPARE step
on 16,384 tokens of Python's documentation and kept beside the pool. The paired-replacement
cache copies the chosen rows from the mapping into its active buffers (or, in place, the
C kernel multiplies them where they lie). The prompt runs dense (every row at once); each
generated token runs sparse. The bounded component is the MLP weight resident in those
buffers. ``load_sparse``'s default ``keep_cached="auto"`` applies: under the runner's
hard limit, what fits of what each token reads in full stays cached (SmolLM2 under
``tight``: the lm_head), the rest is paged out after use, and in place a layer not kept
reads its picked rows' pages only.
"""

from membound_integration.row import QUESTION, Row, greedy_generate

FRACTION = 0.5
SOURCE = "trained"
CALIBRATION_TOKENS = 16384


def pool_path():
    """The SmolLM2 pool file, written by ``paired_cache.model_io.convert`` on first use
    without the gate (the gated predictor computes act(gate x) from gate_proj mapped from
    the safetensors, so rows of up | down_T are what a token reads)."""
    import paired_cache
    from membound_testing import smollm2_float_dir
    from paired_cache.model_io import convert
    from paired_cache.pool_file import FORMAT_VERSION

    source = smollm2_float_dir()
    path = source.parent / (
        f"{source.name}-paired-cache-{paired_cache.__version__}-v{FORMAT_VERSION}-nogate.pcpool"
    )
    if not path.is_file():
        convert(source, path, gate=False, progress=False)  # written atomically
    return path


def predictor_path():
    """The SmolLM2 predictor file (``fit_predictors`` on Python's documentation), fitted on
    first use from the dense float copy."""
    import paired_cache
    from membound_testing import load_smollm2, smollm2_float_dir
    from paired_cache.trained_predictor import fit_predictors, python_docs_ids, save_predictors

    source = smollm2_float_dir()
    path = (
        source.parent
        / f"{source.name}-paired-cache-{paired_cache.__version__}-predictor.safetensors"
    )
    if not path.is_file():
        model, tokenizer = load_smollm2()
        ids = python_docs_ids(tokenizer, CALIBRATION_TOKENS)
        save_predictors(path, fit_predictors(model, ids))  # written atomically
    return path


def paired_cache_row(rows: str = "copy") -> Row:
    """rows: "copy" (the paired-replacement cache of active rows) or "in_place" (each
    token's rows read from the mapped pool, no active rows kept)."""
    from transformers import PreTrainedTokenizerFast

    from membound_testing import chat_prompt, smollm2_float_dir
    from paired_cache.model_io import load_sparse
    from paired_cache.pool_file import PoolFile

    path = pool_path()
    model_dir = smollm2_float_dir()
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(model_dir))
    # The prompt's MLPs run over every row at once (its tokens' masks would cover nearly
    # every row anyway); each generated token runs sparse.
    model = load_sparse(
        model_dir, path, SOURCE, FRACTION, predictor=predictor_path(), rows=rows, prefill="dense"
    )
    mlps = [layer.mlp for layer in model.model.layers]
    gen = greedy_generate(model, tokenizer, chat_prompt(tokenizer, QUESTION))
    how = "rows read in place from" if rows == "in_place" else "pool mapped from"
    return Row(
        name=f"SparseMLP {round(FRACTION * 100)}% rows, {SOURCE}, {how} storage, dense "
        "prefill (paired-cache)",
        **gen.row_fields(),
        component="MLP weights resident (active rows)",
        resident_bytes=sum(m.cache.active_bytes for m in mlps),
        # Every MLP weight: the pool's up | down_T rows and the gate it leaves out.
        unbounded_bytes=PoolFile(path).pool_bytes + sum(m.gate_weight.nbytes for m in mlps),
    )


def paired_cache_in_place_row() -> Row:
    return paired_cache_row("in_place")


ROWS = {"paired_cache": paired_cache_row, "paired_cache_in_place": paired_cache_in_place_row}
PREPARE = [pool_path, predictor_path]
