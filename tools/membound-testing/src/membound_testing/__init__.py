"""Developer-only helpers for membound's tests, benchmarks and demo (never published).

Packages must not import this at run time; their test extras and benchmarks may.
"""

from membound_testing.__about__ import __version__
from membound_testing.machine import machine_info
from membound_testing.models import (
    align_linear_weights,
    chat_prompt,
    load_smollm2,
    minilm_path,
    smollm2_float_dir,
    smollm2_gguf_path,
)
from membound_testing.passkey import passkey_prompt
from membound_testing.readme import run_python_blocks, smollm2_importable

__all__ = [
    "__version__",
    "align_linear_weights",
    "chat_prompt",
    "load_smollm2",
    "machine_info",
    "minilm_path",
    "passkey_prompt",
    "run_python_blocks",
    "smollm2_float_dir",
    "smollm2_gguf_path",
    "smollm2_importable",
]
