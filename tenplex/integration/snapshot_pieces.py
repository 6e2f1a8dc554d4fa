"""A snapshotter's pieces, made again only when the state's tensors change.

May import: this package's :mod:`.layouts` and :mod:`.pieces`, torch and the standard library.

:func:`.layouts.state_pieces` works out every tensor's boxes (a DTensor's from its mesh and placements) and
validates each :class:`~tenplex.box.Box`: ~2 ms per snapshot for the ~90 pieces of a tiny GPT on this busy machine,
while within a world nothing of it changes from one step to the next but the in-place version counters.
:class:`PiecesCache` keeps the pieces while the *structure* is the same: the same model and optimizer objects,
equal annotations, and the same tensor objects (by identity) with the same shape, dtype and storage in
the model's state dict (under the same names) and the optimizer's state, in the same order. Only the version
counters are read again.
A change of any of these (a parameter replaced or its ``.data`` swapped, an optimizer state created or
loaded, a new parameter group) builds the pieces again from scratch.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor

from .layouts import state_pieces
from .pieces import Piece, named_optimizer_params, version_of


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local tensor (``to_local`` makes a new alias of it at every call), or the tensor."""
    if isinstance(tensor, DTensor):
        local = getattr(tensor, "_local_tensor", None)  # torch's own attribute; to_local() would alias it anew
        if local is None:
            with torch.no_grad():
                local = tensor.to_local()
        return local
    return tensor


def _where(local: torch.Tensor) -> tuple:
    """The memory a local tensor covers: an alias of the same memory (``to_local``'s) has the same."""
    return local.data_ptr(), local.shape, local.stride(), local.dtype


def _describe(tensor: torch.Tensor) -> tuple:
    if type(tensor) is torch.Tensor or type(tensor) is torch.nn.Parameter:  # the common case, in one tuple
        return id(tensor), tensor.data_ptr(), tensor.shape, tensor.stride(), tensor.dtype
    local = getattr(tensor, "_local_tensor", None) if isinstance(tensor, DTensor) else tensor
    if local is None:
        local = _local(tensor)
    return id(tensor), id(local), tensor.shape, local.data_ptr(), local.shape, local.stride(), local.dtype


def _describe_all(tensors: list[torch.Tensor]) -> tuple:
    """Every tensor's description; a tensor met again (a parameter the optimizer holds, after the state dict's
    copy of it) by its identity alone: its memory is in its first description."""
    seen: set[int] = set()
    described: list[object] = []
    for tensor in tensors:
        if id(tensor) in seen:
            described.append(id(tensor))
        else:
            seen.add(id(tensor))
            described.append(_describe(tensor))
    return tuple(described)


def _tensors(model, optimizer) -> tuple[tuple[str, ...], list[torch.Tensor]]:
    """The state dict's names, and every tensor the pieces can come from, in a fixed order: the state dict's,
    then the optimizer states."""
    state_dict = model.state_dict(keep_vars=True)
    found = [t for t in state_dict.values() if isinstance(t, torch.Tensor)]
    if optimizer is not None:
        for group in optimizer.param_groups:
            for param in group["params"]:
                found.append(param)
                state = optimizer.state.get(param)
                if state:
                    found += [v for _, v in sorted(state.items(), key=lambda kv: str(kv[0]))
                              if isinstance(v, torch.Tensor) and v.dim() > 0]
    return tuple(state_dict), found


class PiecesCache:
    """The non-empty pieces of one snapshotter's state (see the module docstring)."""

    def __init__(self) -> None:
        self._key: tuple | None = None
        self._pieces: list[Piece] = []
        self._sources: list[tuple[torch.Tensor, ...]] = []  # per piece: the tensors whose counters count
        self.generation: Any = None  # the same while the pieces' names, boxes and specs are (None: not cached)
        self._memory: dict[int, tuple[torch.Tensor, tuple]] = {}  # id(piece.local) -> it, (device, address, dtype)
        self._named: tuple[Any, list] | None = None  # (generation, the optimizer's named parameters)

    def named_params(self, model, optimizer) -> list | None:
        """:func:`.pieces.named_optimizer_params` while the structure stays (the names are the state dict's, part
        of the structure), worked out once per structure; None when not cached."""
        if self.generation is None or optimizer is None:
            return None
        if self._named is None or self._named[0] is not self.generation:
            self._named = (self.generation, named_optimizer_params(model, optimizer))
        return self._named[1]

    def fingerprint(self, piece: Piece) -> tuple | None:
        """What must stay the same for a piece to count as unchanged: the memory it lives in and the in-place
        version counters (a change through ``.data`` bumps no counter and is not seen: optimizers change
        parameters in place, torch's own under ``no_grad``, which counts). None: not tracked (never skipped).
        A cached piece's memory is the one the structure check just compared: not read again."""
        if piece.version is None:
            return None
        known = self._memory.get(id(piece.local)) if self._key is not None else None
        if known is not None and known[0] is piece.local:
            return (*known[1], piece.version)
        local = piece.local
        return local.device, local.data_ptr(), local.dtype, piece.version

    def pieces(self, model, optimizer, annotations) -> list[Piece]:
        try:
            names, tensors = _tensors(model, optimizer)
            key = (id(model), id(optimizer), tuple((annotations or {}).items()),  # frozen dataclasses: by value
                   names, _describe_all(tensors))
        except (RuntimeError, TypeError, NotImplementedError):  # a tensor without plain memory (sparse, ...)
            self._key, self.generation, self._memory = None, None, {}
            return [p for p in state_pieces(model, optimizer, annotations) if not p.box.is_empty()]
        if key == self._key:
            return [Piece(p.name, p.spec, p.box, p.local_box, p.local, version_of(*sources))
                    for p, sources in zip(self._pieces, self._sources)]
        self._key, self.generation, self._memory = None, None, {}  # built again next time too, should this raise
        self._pieces = [p for p in state_pieces(model, optimizer, annotations) if not p.box.is_empty()]
        # What tensor_pieces counts: a DTensor's own counter and its local tensor's, else the tensor's.
        by_memory = {_where(_local(t)): ((t, _local(t)) if isinstance(t, DTensor) else (t,)) for t in tensors}
        found = [by_memory.get(_where(p.local)) for p in self._pieces]
        if all(sources is not None for sources in found):  # else some piece of a view of its own: never cached
            self._sources = [s for s in found if s is not None]
            self._key, self.generation = key, object()
            self._memory = {id(p.local): (p.local, (p.local.device, p.local.data_ptr(), p.local.dtype))
                            for p in self._pieces}
        return self._pieces
