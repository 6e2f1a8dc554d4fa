"""What a rank reads at a step boundary between exchanges: its RNG streams and its optimizer's scalar states.

May import: this package's :mod:`.nontensor` and :mod:`.pieces`, torch and the standard library.

A snapshot that needs no exchange (:mod:`.snapshot`) still reads these on the training thread: the next step
changes them. :func:`.pieces.optimizer_scalars` walks every parameter's state, sorts its keys, decides which are
saved as tensors and reads each scalar with ``.item()`` (~70 us for the ~30 parameters of a tiny GPT here, most of
it the ``.item()`` calls). :class:`ScalarReader` makes that walk once per structure and then reads the same
entries: the 0-dimensional tensors of one dtype and device with one ``torch.stack(...).tolist()``, the plain
numbers as they are, giving the same values of the same Python types. A parameter whose state gained or lost a
key since the walk (its number of keys differs) makes the walk again.
"""

from __future__ import annotations

from typing import Any

import torch

from .nontensor import rng_state
from .pieces import optimizer_scalars


class ScalarReader:
    """:func:`.pieces.optimizer_scalars`, read through a plan made once per structure (see the module docstring)."""

    def __init__(self) -> None:
        # (the structure it was made under, [(name, key, parameter)], [(parameter, its number of state keys)])
        self._plan: tuple[Any, list[tuple[str, Any, torch.Tensor]], list[tuple[torch.Tensor, int]]] | None = None

    def read(self, model, optimizer, named: list | None, structure: Any) -> dict[str, dict[str, Any]]:
        """Every scalar optimizer state: ``{param name: {key: value}}``. ``structure``: the pieces cache's
        generation (None: unknown, walk every time); ``named``: the optimizer's named parameters."""
        if optimizer is None:
            return {}
        plan = self._plan
        state = optimizer.state
        if plan is None or structure is None or plan[0] is not structure or named is None \
                or any(len(state.get(param, ())) != count for param, count in plan[2]):
            return self._walk(model, optimizer, named, structure)
        values = [state[param][key] for _, key, param in plan[1]]
        read = _read_all(values)
        found: dict[str, dict[str, Any]] = {}
        for (name, key, _), value in zip(plan[1], read):
            found.setdefault(name, {})[key] = value
        return found

    def _walk(self, model, optimizer, named: list | None, structure: Any) -> dict[str, dict[str, Any]]:
        found = optimizer_scalars(model, optimizer, named)
        self._plan = None
        if structure is not None and named is not None:
            by_name = dict(named)
            entries = [(name, key, by_name[name]) for name, keys in found.items() for key in keys]
            counts = [(param, len(optimizer.state.get(param, ()))) for _, param in named]
            self._plan = (structure, entries, counts)
        return found


def _read_all(values: list[Any]) -> list[Any]:
    """The values as ``.item()`` gives them: 0-dimensional tensors read together per dtype and device."""
    read: list[Any] = list(values)
    groups: dict[tuple, list[int]] = {}
    for i, value in enumerate(values):
        if isinstance(value, torch.Tensor):
            groups.setdefault((value.dtype, value.device), []).append(i)
    for indices in groups.values():
        numbers = torch.stack([values[i] if values[i].dim() == 0 else values[i].reshape(()) for i in indices]).tolist()
        for i, number in zip(indices, numbers):
            read[i] = number
    return read


def read_at_boundary(scalars: ScalarReader | None, model, optimizer, named: list | None, structure: Any,
                     rng: bool) -> dict:
    """What this rank reads at the boundary for the state document: its optimizer scalars (None: the writer
    thread reads them, :mod:`.snapshot_defer`) and RNG streams, as the libraries give them (the writer thread
    makes them JSON: :func:`.nontensor.rng_doc`)."""
    return {"rng": rng_state() if rng else None,
            "scalars": None if scalars is None else scalars.read(model, optimizer, named, structure)}
