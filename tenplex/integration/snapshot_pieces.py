"""A snapshotter's pieces, made again only when the state's tensors change.

May import: this package's :mod:`.layouts`, :mod:`.module_tree` and :mod:`.pieces`, torch and the standard
library.

:func:`.layouts.state_pieces` works out every tensor's boxes (a DTensor's from its mesh and placements) and
validates each :class:`~tenplex.box.Box`: ~2 ms per snapshot for the ~90 pieces of a tiny GPT on this busy machine,
while within a world nothing of it changes from one step to the next but the in-place version counters.
:class:`PiecesCache` keeps the pieces while the *structure* is the same: the same model and optimizer objects,
equal annotations, and the same tensor objects (by identity) with the same shape, dtype and storage in
the model's state dict (under the same names) and the optimizer's state (under the same keys), in the same
order. The cached pieces themselves are handed out again (:class:`_Tracked`: their version counters are read
when asked).
A change of any of these (a parameter replaced or its ``.data`` swapped, an optimizer state created or
loaded, a new parameter group) builds the pieces again from scratch.

Two checks, both at every call: :class:`_Probe` compares the containers by identity and each tensor's memory
(~0.1 ms for a tiny GPT); what it finds the same, the exact structure key (:func:`_tensors`, the state dict's
tensors and the optimizer states it describes, ~0.2 ms more) finds the same too, so only when the probe
differs is the key made and compared (an optimizer whose states are new Python numbers at every step, say).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor

from .layouts import state_pieces
from .module_tree import ModuleTree, NotPlain
from .pieces import _VERSION, Piece, named_optimizer_params, version_of

_FIELDS = ("name", "spec", "box", "local_box", "local")  # Piece's fields but its version


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


def _own_local(tensor: DTensor) -> torch.Tensor:
    local = getattr(tensor, "_local_tensor", None)
    if local is None:  # to_local() would make a new alias at every step: never the same structure
        raise TypeError("a DTensor without a local tensor of its own")
    return local


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


def _tensors(model, optimizer, state_dict) -> tuple[list[torch.Tensor], list[str]]:
    """Every tensor the pieces can come from, in a fixed order: the state dict's, then the optimizer states; and
    the names of those states (a state renamed, its tensor the same, is another piece)."""
    found = [t for t in state_dict.values() if isinstance(t, torch.Tensor)]
    keys: list[str] = []
    if optimizer is not None:
        for group in optimizer.param_groups:
            for param in group["params"]:
                found.append(param)
                state = optimizer.state.get(param)
                if state:
                    named = [(str(k), v) for k, v in state.items() if isinstance(v, torch.Tensor) and v.dim() > 0]
                    named.sort(key=lambda kv: kv[0])
                    keys += [k for k, _ in named]
                    found += [v for _, v in named]
    return found, keys


class _Tracked(Piece):
    """A cached piece: handed out at every step of its structure, so its :attr:`version` is the in-place version
    counters read when asked (a fresh piece's are those when it was made: the same within a step boundary).
    Equal only to itself (its fields' hash would change with the counters)."""

    _sources: tuple[torch.Tensor, ...]  # the tensors whose counters count (see tensor_pieces)
    _memory: tuple  # the local tensor's (device, address, dtype), as the structure check compared them
    _generation: object  # the cache's structure it belongs to

    __eq__ = object.__eq__
    __hash__ = object.__hash__

    def __new__(cls, *args, **kwargs):  # dataclasses.replace() calls the class: a plain piece, counters as now
        return Piece(*args, **kwargs)

    @classmethod
    def of(cls, piece: Piece, sources: tuple[torch.Tensor, ...], generation: object) -> "_Tracked":
        tracked = object.__new__(cls)
        for name in _FIELDS:  # a frozen dataclass: set as its own __init__ does
            object.__setattr__(tracked, name, getattr(piece, name))
        local = piece.local
        object.__setattr__(tracked, "_sources", sources)
        object.__setattr__(tracked, "_memory", (local.device, local.data_ptr(), local.dtype))
        object.__setattr__(tracked, "_generation", generation)
        return tracked

    @property
    def version(self) -> tuple[int, ...] | None:  # Piece.version, read now
        return version_of(*self._sources)


def tracked_sources(piece: Piece, structure: Any) -> tuple[torch.Tensor, ...] | None:
    """The tensors whose in-place counters count for ``piece`` when it is a cached piece of ``structure``
    (:attr:`PiecesCache.generation`), else None."""
    if type(piece) is _Tracked and piece._generation is structure:
        return piece._sources
    return None


class _Probe:
    """The cheap structure check: the same model, optimizer and annotations, the same objects (by identity, in
    order) in the state dict (under the same names), the parameter groups, the optimizer's state and each
    parameter's state dict (under the same keys), and every tensor among them with the same memory (a DTensor:
    its global shape and the same local tensor, whose memory counts). Whatever :func:`_tensors` and
    :func:`_describe_all` describe is among these, so a probe that holds means an unchanged structure key. Holds
    the objects whose ids it compares, so that no id is reused while it lives."""

    def __init__(self, model, optimizer, annotations, state_dict) -> None:
        self.owners = (id(model), id(optimizer), tuple((annotations or {}).items()))
        self.names, self.values = list(state_dict), list(state_dict.values())
        try:  # the same tree holds the same state dict: compared without calling state_dict()
            self.tree: ModuleTree | None = ModuleTree(model)
        except NotPlain:
            self.tree = None
        self.ids = tuple(map(id, self.values))
        self.groups = [list(group["params"]) for group in optimizer.param_groups] if optimizer is not None else []
        self.group_ids = [tuple(map(id, params)) for params in self.groups]
        state = optimizer.state if optimizer is not None else {}
        self.state_keys, self.states = list(state), list(state.values())
        self.state_ids = (tuple(map(id, self.state_keys)), tuple(map(id, self.states)))
        self.keys = [k for st in self.states for k in st]
        self.state_values = [v for st in self.states for v in st.values()]
        self.state_value_ids = tuple(map(id, self.state_values))
        tensors = {id(t): t for t in (*self.values, *(p for ps in self.groups for p in ps), *self.state_values)
                   if isinstance(t, torch.Tensor)}
        # A plain optimizer state of no dimensions (Adam's step) counts only as long as it has none: the key
        # describes the model's tensors and the optimizer's states of some dimensions (and DTensors: all here)
        described = {id(t) for t in (*self.values, *(p for ps in self.groups for p in ps))}
        self.scalars = [t for t in tensors.values()
                        if id(t) not in described and not isinstance(t, DTensor) and t.dim() == 0]
        scalars = set(map(id, self.scalars))
        self.wrapped = [(t, _own_local(t)) for t in tensors.values() if isinstance(t, DTensor)]
        self.plain = [t for t in tensors.values() if not isinstance(t, DTensor) and id(t) not in scalars] + \
            [local for _, local in self.wrapped]
        self.memory = self._memory()

    def _memory(self) -> tuple[list, list, list]:
        return (list(map(_where, self.plain)),
                [t.dim() for t in self.scalars],
                [(t.shape, getattr(t, "_local_tensor", None)) for t, _ in self.wrapped])

    def holds(self, model, optimizer, annotations) -> bool:
        if (id(model), id(optimizer), tuple((annotations or {}).items())) != self.owners:
            return False
        if self.tree is not None:
            if not self.tree.same():
                return False
        else:
            state_dict = model.state_dict(keep_vars=True)
            if tuple(map(id, state_dict.values())) != self.ids or list(state_dict) != self.names:
                return False
        if optimizer is not None:
            groups = optimizer.param_groups
            if len(groups) != len(self.group_ids) or any(tuple(map(id, g["params"])) != ids
                                                         for g, ids in zip(groups, self.group_ids)):
                return False
            state = optimizer.state
            if (tuple(map(id, state)), tuple(map(id, state.values()))) != self.state_ids:
                return False
            if [k for st in self.states for k in st] != self.keys or \
                    tuple(map(id, [v for st in self.states for v in st.values()])) != self.state_value_ids:
                return False
        plain, scalars, wrapped = self._memory()
        return plain == self.memory[0] and scalars == self.memory[1] and all(
            shape == known[0] and local is known[1] for (shape, local), known in zip(wrapped, self.memory[2]))


class PiecesCache:
    """The non-empty pieces of one snapshotter's state (see the module docstring)."""

    def __init__(self) -> None:
        self._key: tuple | None = None
        self._probe: _Probe | None = None  # None: the next call makes the key
        self._pieces: list[Piece] = []
        self.generation: Any = None  # the same while the pieces' names, boxes and specs are (None: not cached)
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
        A piece of the cached structure: its memory is the one the structure check just compared, not read again."""
        if type(piece) is _Tracked and piece._generation is self.generation:
            try:  # version_of, inline: one call less per piece and step
                return piece._memory + (tuple(map(_VERSION, piece._sources)),)
            except RuntimeError:  # an inference tensor: not tracked
                return None
        version = piece.version
        if version is None:
            return None
        local = piece.local
        return local.device, local.data_ptr(), local.dtype, version

    def pieces(self, model, optimizer, annotations) -> list[Piece]:
        """The pieces of the state now: the cached ones (the same objects) while the structure is the same."""
        probe = self._probe
        try:
            if probe is not None and probe.holds(model, optimizer, annotations):
                return list(self._pieces)
        except (RuntimeError, TypeError, NotImplementedError, AttributeError):  # made again below, or not cached
            pass
        self._probe = None
        try:
            state_dict = model.state_dict(keep_vars=True)
            tensors, state_keys = _tensors(model, optimizer, state_dict)
            key = (id(model), id(optimizer), tuple((annotations or {}).items()),  # frozen dataclasses: by value
                   tuple(state_dict), tuple(state_keys), _describe_all(tensors))
        except (RuntimeError, TypeError, NotImplementedError):  # a tensor without plain memory (sparse, ...)
            self._key, self.generation = None, None
            return [p for p in state_pieces(model, optimizer, annotations) if not p.box.is_empty()]
        if key != self._key:
            self._build(model, optimizer, annotations, key, tensors)
        if self._key is not None:
            self._probe = self._probed(model, optimizer, annotations, state_dict)
        return list(self._pieces)

    def _build(self, model, optimizer, annotations, key: tuple, tensors: list[torch.Tensor]) -> None:
        self._key, self.generation = None, None  # built again next time too, should this raise
        self._pieces = [p for p in state_pieces(model, optimizer, annotations) if not p.box.is_empty()]
        # What tensor_pieces counts: a DTensor's own counter and its local tensor's, else the tensor's.
        by_memory: dict[tuple, tuple[torch.Tensor, ...]] = {
            _where(_local(t)): ((t, _local(t)) if isinstance(t, DTensor) else (t,)) for t in tensors}
        found = [by_memory.get(_where(p.local)) for p in self._pieces]
        if all(sources is not None for sources in found):  # else some piece of a view of its own: never cached
            self._key, self.generation = key, object()
            self._pieces = [_Tracked.of(p, sources, self.generation)
                            for p, sources in zip(self._pieces, found) if sources is not None]

    @staticmethod
    def _probed(model, optimizer, annotations, state_dict) -> _Probe | None:
        try:
            return _Probe(model, optimizer, annotations, state_dict)
        except (RuntimeError, TypeError, NotImplementedError, AttributeError):  # the key alone, at every call
            return None
