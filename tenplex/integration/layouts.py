"""The layout of a job's state: what each rank holds, who writes what, and whether a restore matches a save.

May import: ``tenplex.layout``, ``tenplex.box``, ``tenplex.devices`` and this package's :mod:`.pieces`,
:mod:`.names` and :mod:`.nontensor`; no store, no process group (the checkpointer gathers the ranks'
documents and calls these on them).

A rank's document (gathered on save and restore) lists its ``device``, ``host``, ``tensors``
(name -> [shape, dtype]) and ``boxes`` ([name, offsets, lengths]).
"""

from __future__ import annotations

from ..box import Box, tile
from ..devices import host_of
from ..layout import Layout, Shard, TensorSpec
from .names import likely_cause, parameter_names
from .nontensor import StateMismatchError, apply_optimizer_doc
from .pieces import OPTIMIZER_PREFIX, Piece, model_pieces, optimizer_pieces


def state_pieces(model, optimizer, annotations) -> list[Piece]:
    pieces = model_pieces(model, annotations)
    if optimizer is not None:
        pieces += optimizer_pieces(model, optimizer, annotations)
    return pieces


def specs_of(pieces: list[Piece]) -> dict[str, list]:
    return {p.name: [list(p.spec.shape), p.spec.dtype] for p in pieces}


def group_names(model, optimizer) -> list[list[str]]:
    if optimizer is None:
        return []
    names = parameter_names(model)
    return [[names[id(p)] for p in g["params"] if id(p) in names] for g in optimizer.param_groups]


def merge_specs(docs) -> dict[str, TensorSpec]:
    """One spec per tensor; ranks that disagree on a global shape or dtype are an error naming both."""
    merged: dict[str, tuple[TensorSpec, str]] = {}
    for d in docs:
        for name, (shape, dtype) in d["tensors"].items():
            spec = TensorSpec(tuple(shape), dtype)
            seen = merged.setdefault(name, (spec, d["device"]))
            if seen[0] != spec:
                raise StateMismatchError(f"tensor {name!r} has global shape {list(seen[0].shape)} {seen[0].dtype} on "
                                         f"{seen[1]} but {list(shape)} {dtype} on {d['device']}; every rank must agree")
    return {name: spec for name, (spec, _) in merged.items()}


def first_holder_per_host(docs) -> dict[tuple[str, str, Box], int]:
    """(host, tensor, box) -> the lowest rank on that host holding exactly that box: the one that writes it."""
    writers: dict[tuple[str, str, Box], int] = {}
    for rank, d in enumerate(docs):
        for name, offsets, lengths in d["boxes"]:
            writers.setdefault((d["host"], name, Box(tuple(offsets), tuple(lengths))), rank)
    return writers


def saved_layout(tensors, docs, writers) -> Layout:
    devices: dict[str, list[Shard]] = {}
    for (_host, name, box), rank in sorted(writers.items(), key=lambda kv: (kv[1], kv[0][1], kv[0][2])):
        devices.setdefault(docs[rank]["device"], []).append(Shard(name, box))
    return Layout.build(tensors, devices)


def needed_layout(docs) -> Layout:
    tensors = merge_specs(docs)
    devices = {d["device"]: [Shard(name, Box(tuple(o), tuple(n))) for name, o, n in d["boxes"]] for d in docs}
    return Layout.build(tensors, devices)


def check_and_build(old: Layout, docs, given: Layout | None, device: str, pieces: list[Piece],
                     with_optimizer: bool = True) -> Layout:
    """The new layout, after checking it against the saved one; StateMismatchError names what differs.
    Without an optimizer, saved optimizer tensors are not expected."""
    needed = needed_layout(docs)
    problems = []
    for name, spec in sorted(needed.tensors.items()):
        saved = old.tensors.get(name)
        if saved is None:
            problems.append(f"tensor {name!r} (shape {list(spec.shape)}, {spec.dtype}) is not in the saved state")
        elif saved.shape != spec.shape or saved.dtype != spec.dtype:
            problems.append(f"tensor {name!r} has shape {list(spec.shape)} {spec.dtype} in the restored job but "
                            f"{list(saved.shape)} {saved.dtype} in the saved state")
    for name in sorted(set(old.tensors) - set(needed.tensors)):
        if not with_optimizer and name.startswith(OPTIMIZER_PREFIX):
            continue
        problems.append(f"tensor {name!r} (shape {list(old.tensors[name].shape)}) was saved but the restored job "
                        f"has no such tensor")
    if problems:
        more = f" (and {len(problems) - 10} more)" if len(problems) > 10 else ""
        expected = set(needed.tensors) | ({n for n in old.tensors if n.startswith(OPTIMIZER_PREFIX)}
                                          if not with_optimizer else set())
        cause = likely_cause(set(old.tensors), expected, OPTIMIZER_PREFIX)
        lead = f"{cause}. In detail, " if cause else ""
        raise StateMismatchError(f"{lead}the restored job does not match the saved state ({len(problems)} "
                                 f"differences): " + "; ".join(problems[:10]) + more)
    if given is None:
        return needed
    held = {(s.tensor, s.box) for s in given.devices.get(device, ())}
    lacking = [f"{p.name} {p.box}" for p in pieces if (p.name, p.box) not in held]
    if lacking:
        raise StateMismatchError(f"the given layout does not give device {device} what its model needs: "
                                 f"{', '.join(lacking[:5])}{' …' if len(lacking) > 5 else ''}")
    return given


def check_optimizer(optimizer, model, state) -> None:
    if state["optimizer"] is None:
        raise StateMismatchError("the state was saved without an optimizer; restore without one, or save with it")
    apply_optimizer_doc(optimizer, state["optimizer"], group_names(model, optimizer))


def local_sources(old: Layout, new: Layout) -> dict[str, dict[tuple[str, Box], list[tuple[str, Box]]]] | None:
    """For each new device and box it needs, (old device on the same host, region) pairs that tile the box;
    None if some box cannot be assembled from its own host's shards (then the state must be transformed)."""
    by_host: dict[tuple[str, str], list[tuple[Box, str]]] = {}
    for device, shard in old.iter_shards():
        by_host.setdefault((host_of(device), shard.tensor), []).append((shard.box, device))
    sources: dict[str, dict[tuple[str, Box], list[tuple[str, Box]]]] = {}
    for device, shards in new.devices.items():
        for shard in shards:
            # The device's own old shards first: after a same-configuration restart nothing is shared.
            candidates = sorted(by_host.get((host_of(device), shard.tensor), []), key=lambda c: c[1] != device)
            tiles, remaining = tile(shard.box, ((src, box) for box, src in candidates))
            if remaining:
                return None
            sources.setdefault(device, {})[(shard.tensor, shard.box)] = tiles
    return sources
