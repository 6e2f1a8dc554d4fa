"""Tensor names of a wrapped model, and the likely cause when saved and restored names differ.

May import: torch and the standard library. No I/O.

A model wrapped in ``DistributedDataParallel`` (or ``DataParallel``),
``torch.compile`` or activation checkpointing (``checkpoint_wrapper``) names
its tensors ``module.x``, ``_orig_mod.x`` or ``a._checkpoint_wrapped_module.x``.
tenplex saves and restores every tensor under the bare model's name ``x``, as
``torch.distributed.checkpoint.state_dict`` does, so that a state saved through
a wrapper restores into the bare model and the other way round. Only the
wrapper attribute of a module of a wrapper class is dropped: a user's own
submodule called ``module`` keeps its name.
"""

from __future__ import annotations

import sys
import weakref

import torch

# Wrapper classes are looked up only in modules already imported: a model compiled or checkpoint-wrapped by
# the user has imported them, and tenplex need not pay for importing torch._dynamo itself.
_WRAPPERS = (("torch.nn.parallel", ("DistributedDataParallel", "DataParallel"), "module"),
             ("torch._dynamo.eval_frame", ("OptimizedModule",), "_orig_mod"),
             ("torch.distributed.algorithms._checkpoint.checkpoint_wrapper", ("ActivationWrapper",),
              "_checkpoint_wrapped_module"))


def _wrapped_attribute(module: torch.nn.Module) -> str | None:
    """The attribute under which a wrapper module holds the wrapped one; None for other modules."""
    for module_name, class_names, attribute in _WRAPPERS:
        loaded = sys.modules.get(module_name)
        if loaded is None:
            continue
        if isinstance(module, tuple(getattr(loaded, c) for c in class_names)) and attribute in module._modules:
            return attribute
    return None


# model -> {name: bare name}: a name's wrappers are fixed by its own atoms (a wrapper added later changes the name,
# or leaves it and its bare name as they were), and a snapshot asks for every name at every step
_BARE: "weakref.WeakKeyDictionary[torch.nn.Module, dict[str, str]]" = weakref.WeakKeyDictionary()


def bare_name(model: torch.nn.Module, name: str) -> str:
    """``name`` (from ``state_dict()`` or ``named_parameters()``) without the wrappers' attributes."""
    known = _BARE.get(model)
    if known is None:
        known = _BARE[model] = {}
    found = known.get(name)
    if found is None:
        found = known[name] = _bare_name(model, name)
    return found


def _bare_name(model: torch.nn.Module, name: str) -> str:
    atoms, out, i = name.split("."), [], 0
    module: torch.nn.Module | None = model
    while i < len(atoms):
        inner = _wrapped_attribute(module) if module is not None else None
        if inner is not None and module is not None:
            # Some wrappers already drop their attribute from state_dict() names (checkpoint_wrapper's hook).
            if atoms[i] == inner:
                i += 1
            module = module._modules[inner]
            continue
        out.append(atoms[i])
        module = module._modules.get(atoms[i]) if module is not None else None
        i += 1
    return ".".join(out)


def parameter_names(model: torch.nn.Module) -> dict[int, str]:
    """id(parameter) -> its bare name."""
    return {id(p): bare_name(model, n) for n, p in model.named_parameters()}


def likely_cause(saved: set[str], restored: set[str], optimizer_prefix: str) -> str | None:
    """A sentence naming a prefix that every unmatched saved (or restored) name has and the other side lacks.

    Optimizer tensors (``optim.KEY.NAME``) are compared by their parameter's NAME.
    """
    def param_name(name: str) -> str:
        return name[len(optimizer_prefix):].split(".", 1)[-1] if name.startswith(optimizer_prefix) else name

    only_saved = {param_name(n) for n in saved - restored}
    only_restored = {param_name(n) for n in restored - saved}
    for side, other, where, there in ((only_saved, only_restored, "saved", "restored job's"),
                                      (only_restored, only_saved, "restored job's", "saved")):
        prefix = _common_prefix(side)
        if prefix and other and {n[len(prefix):] for n in side} >= other:
            return (f"all unmatched {where} names start with `{prefix}` and the {there} names lack it: the model is "
                    f"wrapped (or nested) differently on the two sides; tenplex drops the prefixes of "
                    f"DistributedDataParallel (`module.`), torch.compile (`_orig_mod.`) and checkpoint_wrapper "
                    f"itself, so save and restore the same model structure, or wrap it in one of those")
    return None


def _common_prefix(names: set[str]) -> str:
    """The longest run of leading dotted atoms that every name shares (with its trailing dot), or ''."""
    if not names:
        return ""
    split = [n.split(".")[:-1] for n in names]
    prefix = []
    for atoms in zip(*split):
        if len(set(atoms)) != 1:
            break
        prefix.append(atoms[0])
    return "".join(a + "." for a in prefix)
