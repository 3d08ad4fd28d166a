"""A compressed model refuses what would half-succeed on it.

``model.save_pretrained`` writes config.json before it asks for the state dict, so the
compressed modules' refusal (compressed.py) would come after a file was written: it is
refused up front. A dtype or device move (``model.to(torch.bfloat16)``) would convert
every plain tensor it meets before reaching a compressed module: each module that holds
one checks the move on all of them first, so a refused move changes nothing.
"""

from __future__ import annotations

import types

import torch.nn as nn

from zstd_linear.compressed import SAVE_HINT, CompressedModule, check_move

_GUARDS = ("_apply", "save_pretrained")


def _checked_apply(module: nn.Module, fn, recurse: bool = True):
    if recurse:
        for sub in module.modules():
            if isinstance(sub, CompressedModule):
                check_move(sub, fn)
    return type(module)._apply(module, fn, recurse)


def _refuse_save_pretrained(model: nn.Module, *args, **kwargs):
    raise RuntimeError(
        "save_pretrained would write a checkpoint without the zstd-compressed weights "
        f"(they are no parameters of the model); {SAVE_HINT}"
    )


def guard(model: nn.Module) -> None:
    """Install the checks on ``model`` and every module above a compressed one."""
    above: set[str] = set()
    for name, module in model.named_modules():
        if isinstance(module, CompressedModule):
            parts = name.split(".")
            above.update(".".join(parts[:i]) for i in range(len(parts)))
    for name in above:
        module = model.get_submodule(name)
        module.__dict__["_apply"] = types.MethodType(_checked_apply, module)
    if callable(getattr(model, "save_pretrained", None)):
        model.__dict__["save_pretrained"] = types.MethodType(_refuse_save_pretrained, model)


def unguard(model: nn.Module) -> None:
    for module in model.modules():
        for attr in _GUARDS:
            method = module.__dict__.get(attr)
            if getattr(method, "__func__", None) in (_checked_apply, _refuse_save_pretrained):
                del module.__dict__[attr]
