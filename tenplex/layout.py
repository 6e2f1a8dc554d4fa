"""Layouts: which device holds which box of which named global tensor.

May import: ``tenplex.box``, ``tenplex.devices``, ``tenplex.dtypes``,
``tenplex.errors`` and the standard library. Pure: no file, network or
torch.distributed access. Reading and writing layout files lives in
``tenplex.files``.

JSON form (``tenplex.layout/1``)::

    {"format": "tenplex.layout/1",
     "tensors": {"NAME": {"shape": [4096, 1024], "dtype": "float32"}},
     "devices": {"h0/0": [{"tensor": "NAME", "offsets": [0, 0], "lengths": [2048, 1024]}]}}
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping

from .box import Box
from .devices import host_of, parse_device
from .dtypes import ITEMSIZE
from .errors import BoxError, ConfigError, LayoutError

LAYOUT_FORMAT = "tenplex.layout/1"


@dataclass(frozen=True)
class TensorSpec:
    """A named global tensor's real (unpadded) shape and element type."""

    shape: tuple[int, ...]
    dtype: str

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(operator.index(n) for n in self.shape))

    @property
    def itemsize(self) -> int:
        return ITEMSIZE[self.dtype]

    @property
    def nbytes(self) -> int:
        return Box.whole(self.shape).volume * self.itemsize


@dataclass(frozen=True, order=True)
class Shard:
    """One box of one tensor held by a device."""

    tensor: str
    box: Box


@dataclass(frozen=True)
class Layout:
    """Named global tensors and, per device, the boxes it holds.

    ``devices`` maps each device id to a tuple of shards. Construct through
    :meth:`build` (which validates) or :func:`from_dict`.

    Frozen, with one hidden cache: the first :meth:`shards_of` indexes every
    tensor's shards into ``_by_tensor`` (outside equality and repr). So
    ``tensors`` and ``devices`` must not be mutated after construction: build
    a new layout instead.
    """

    tensors: Mapping[str, TensorSpec]
    devices: Mapping[str, tuple[Shard, ...]]
    _by_tensor: dict = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def build(cls, tensors: Mapping[str, TensorSpec], devices: Mapping[str, Any]) -> "Layout":
        layout = cls(dict(tensors), {d: tuple(shards) for d, shards in devices.items()})
        layout.validate()
        return layout

    def validate(self) -> None:
        """Raise LayoutError naming the problem if this layout is inconsistent."""
        for name, spec in self.tensors.items():
            if spec.dtype not in ITEMSIZE:
                raise LayoutError(f"tensor {name!r} has unknown dtype {spec.dtype!r}; "
                                  f"known dtypes: {', '.join(sorted(ITEMSIZE))}")
            if any(n < 0 for n in spec.shape):
                raise LayoutError(f"tensor {name!r} has a negative dimension in shape {list(spec.shape)}")
        held: set[str] = set()
        whole = {name: Box.whole(spec.shape) for name, spec in self.tensors.items()}
        # Replicas usually share one tuple of shards, and shards share Box objects: check each once.
        checked: set[int] = set()
        inside: set[tuple[str, int]] = set()
        for device, shards in self.devices.items():
            try:
                parse_device(device)
            except ConfigError as e:
                raise LayoutError(str(e)) from None
            if id(shards) in checked:
                continue
            checked.add(id(shards))
            by_tensor: dict[str, list[Box]] = {}
            for shard in shards:
                if (shard.tensor, id(shard.box)) not in inside:
                    if shard.tensor not in whole:
                        raise LayoutError(f"device {device} holds a box of tensor {shard.tensor!r}, "
                                          f"which the layout's 'tensors' does not declare")
                    shape = self.tensors[shard.tensor].shape
                    if shard.box.ndim != len(shape) or not whole[shard.tensor].contains(shard.box):
                        raise LayoutError(f"device {device}: box {shard.box} of tensor {shard.tensor!r} lies "
                                          f"outside its shape {list(shape)}")
                    inside.add((shard.tensor, id(shard.box)))
                same = by_tensor.get(shard.tensor)
                if same is None:
                    by_tensor[shard.tensor] = [shard.box]
                    continue
                for other in same:
                    if other.overlaps(shard.box):
                        raise LayoutError(f"device {device} holds overlapping boxes {other} and {shard.box} "
                                          f"of tensor {shard.tensor!r}; boxes of one device must be disjoint")
                same.append(shard.box)
            held.update(by_tensor)
        missing = sorted(set(self.tensors) - held)
        if missing:
            raise LayoutError(f"no device holds tensor(s) {', '.join(map(repr, missing[:5]))}"
                              f"{' …' if len(missing) > 5 else ''}; every declared tensor needs at least one box")

    # ---- queries -------------------------------------------------------
    def hosts(self) -> list[str]:
        return sorted({host_of(d) for d in self.devices})

    def shards_of(self, tensor: str) -> list[tuple[str, Box]]:
        """(device, box) for every box of ``tensor`` in the layout, in device order."""
        if not self._by_tensor:
            index: dict[str, list[tuple[str, Box]]] = {}
            for device in sorted(self.devices):
                for shard in self.devices[device]:
                    index.setdefault(shard.tensor, []).append((device, shard.box))
            self._by_tensor.update(index)
        return self._by_tensor.get(tensor, [])

    def iter_shards(self) -> Iterator[tuple[str, Shard]]:
        for device in sorted(self.devices):
            for shard in self.devices[device]:
                yield device, shard

    def device_bytes(self, device: str) -> int:
        return sum(s.box.volume * self.tensors[s.tensor].itemsize for s in self.devices.get(device, ()))

    def total_bytes(self) -> int:
        return sum(spec.nbytes for spec in self.tensors.values())

    # ---- JSON ----------------------------------------------------------
    def to_dict(self) -> dict:
        return {
            "format": LAYOUT_FORMAT,
            "tensors": {name: {"shape": list(spec.shape), "dtype": spec.dtype}
                        for name, spec in sorted(self.tensors.items())},
            "devices": {device: [{"tensor": s.tensor, "offsets": list(s.box.offsets), "lengths": list(s.box.lengths)}
                                 for s in shards]
                        for device, shards in sorted(self.devices.items())},
        }


def from_dict(doc: Any, source: str = "layout") -> Layout:
    """Parse and validate a ``tenplex.layout/1`` document; errors name ``source``."""
    try:
        if not isinstance(doc, dict) or doc.get("format") != LAYOUT_FORMAT:
            found = doc.get("format") if isinstance(doc, dict) else type(doc).__name__
            raise LayoutError(f"expected format {LAYOUT_FORMAT!r}, found {found!r}")
        tensors = {}
        for name, spec in _require(doc, "tensors", dict).items():
            tensors[name] = TensorSpec(tuple(_require(spec, "shape", list)), _require(spec, "dtype", str))
        devices = {}
        shared: dict[tuple, Shard] = {}  # replicas' identical entries become one Shard (and Box) object
        for device, shards in _require(doc, "devices", dict).items():
            if not isinstance(shards, list):
                raise LayoutError(f"device {device}: expected a list of boxes, found {type(shards).__name__}")
            devices[device] = tuple(_shard(s, shared) for s in shards)
        return Layout.build(tensors, devices)
    except (LayoutError, BoxError, TypeError, ValueError) as e:
        raise LayoutError(f"{source}: {e}") from None


def _shard(entry: Any, shared: dict[tuple, Shard]) -> Shard:
    try:
        key = (entry["tensor"], tuple(entry["offsets"]), tuple(entry["lengths"]))
        shard = shared.get(key)
    except (KeyError, TypeError):
        shard = key = None
    if shard is None:
        shard = Shard(_require(entry, "tensor", str),
                      Box(tuple(_require(entry, "offsets", list)), tuple(_require(entry, "lengths", list))))
        if key is not None:
            shared[key] = shard
    return shard


def _require(obj: Any, key: str, kind: type) -> Any:
    if not isinstance(obj, dict) or key not in obj:
        raise LayoutError(f"missing key {key!r} in {str(obj)[:80]}")
    value = obj[key]
    if not isinstance(value, kind):
        raise LayoutError(f"key {key!r} should be a {kind.__name__}, found {type(value).__name__}: {str(value)[:80]}")
    return value
