"""The save document: what each saving rank tells the others, and what every rank derives from all of them.

May import: ``tenplex.box``, ``tenplex.errors``, ``tenplex.layout``, ``tenplex.replication``, this package's
:mod:`.layouts`, :mod:`.pieces`, :mod:`.nontensor` and :mod:`.versions`, torch.distributed and the standard library.

A blocking save (:meth:`Checkpointer.save`) and a snapshot (:mod:`.snapshot`) both begin with one all-gather
of JSON (no pickles): every rank's :func:`rank_doc`. From the gathered documents every rank derives the same
:class:`SaveRound` (who writes which box, which rank leads its host, every host's store address, how many
copies of each region the stores keep), and the host leaders write the :func:`state_doc` (step, RNG streams
keyed by parallel coordinates, optimizer scalars, scheduler and scaler) into the version.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from ..box import Box
from ..errors import ConfigError
from ..layout import Layout, TensorSpec
from ..replication import effective_replicas
from .layouts import first_holder_per_host, group_names, merge_specs, saved_layout, specs_of
from .nontensor import capture_rng, optimizer_doc, to_json
from .pieces import Piece, buffer_names, optimizer_scalars
from .versions import STATE_FORMAT

log = logging.getLogger(__name__)


def coord_key(coords: Mapping[str, int] | None, rank: int) -> str:
    """The key of a rank's RNG streams: its parallel coordinates (``dp=1,pp=0,tp=0``), or its rank."""
    chosen = coords if coords is not None else {"rank": rank}
    return ",".join(f"{k}={v}" for k, v in sorted(chosen.items()))


def rank_doc(pieces: list[Piece], *, device: str, host: str, latest: int | None, store: str | None, coord: str,
             rng: bool, model, optimizer) -> dict:
    """What a saving rank tells the others: where it is, what it holds, its RNG and optimizer scalars."""
    return {**static_doc(pieces, device=device, host=host, store=store, coord=coord, model=model,
                         optimizer=optimizer), **step_doc(latest, rng, model, optimizer)}


def static_doc(pieces: list[Piece], *, device: str, host: str, store: str | None, coord: str, model,
               optimizer) -> dict:
    """The part of :func:`rank_doc` that stays the same while the model's structure does (a snapshot sends it
    once per world, :mod:`.snapshot`): where the rank is, the tensors and boxes it holds, the parameter groups."""
    return {"device": device, "host": host, "store": store, "tensors": specs_of(pieces),
            "boxes": [[p.name, list(p.box.offsets), list(p.box.lengths)] for p in pieces], "coord": coord,
            "groups": group_names(model, optimizer), "buffers": buffer_names(model)}


def step_doc(latest: int | None, rng: bool, model, optimizer, named: list | None = None) -> dict:
    """The part of :func:`rank_doc` that changes every step: the newest version, RNG, optimizer scalars
    (``named``: see :func:`.pieces.optimizer_scalars`)."""
    return {"latest": latest, "rng": capture_rng() if rng else None,
            "scalars": optimizer_scalars(model, optimizer, named) if optimizer is not None else {}}


def state_doc(docs: list[dict], step: int, extra, scheduler, scaler, optimizer,
              names: list[list[str]] | None = None) -> dict:
    """The version's non-tensor state (``tenplex.torch_state``): every coordinate's RNG streams, the step, ...
    ``names``: :func:`world_group_names` of ``docs`` (worked out when not given)."""
    doc = {"format": STATE_FORMAT, "step": int(step), "extra": to_json(extra, "extra"), "rng": {},
           "scheduler": None if scheduler is None else to_json(scheduler.state_dict(), "the LR scheduler's state"),
           "scaler": None if scaler is None else to_json(scaler.state_dict(), "the gradient scaler's state"),
           "optimizer": None, "scalars": {}}
    if optimizer is not None:
        doc["optimizer"] = optimizer_doc(optimizer, world_group_names(docs, optimizer) if names is None else names)
    return refresh_state_doc(doc, docs, docs)


def world_group_names(docs: list[dict], optimizer) -> list[list[str]]:
    """Each parameter group's parameter names, over every rank's document (sorted)."""
    return [sorted({n for d in docs for n in d["groups"][i]}) for i in range(len(optimizer.param_groups))]


def refresh_state_doc(doc: dict, steps: Sequence[Mapping], docs: Sequence[Mapping]) -> dict:
    """``doc`` with its RNG streams and optimizer scalars from every rank's step document (``steps[r]``: ``rng``,
    ``scalars``; ``docs[r]``: ``coord``): a snapshot that exchanges them in the background (:mod:`.snapshot`)
    makes the rest of the state document at the step boundary, from the world's documents."""
    rng: dict[str, Any] = {}
    scalars: dict = {}
    for step_doc, d in zip(steps, docs):
        if step_doc["rng"] is not None:
            rng.setdefault(d["coord"], step_doc["rng"])
        scalars.update(step_doc["scalars"])
    doc["rng"], doc["scalars"] = rng, scalars
    return doc


def store_addresses(docs: list[dict], overrides: Mapping[str, str]) -> dict[str, str]:
    """host -> store address: what the ranks report, overridden by ``stores``/``TENPLEX_STORES``."""
    found = {d["host"]: d["store"] for d in docs if d.get("store")}
    found.update(overrides)
    return found


def replica_count(requested: int | None, addresses: Mapping[str, str], ring: list[str], rank: int) -> int:
    """Copies of each single-host region the stores keep (:func:`~tenplex.replication.effective_replicas`); 0
    with a warning when the default asks for copies but some host reported no store address."""
    count = effective_replicas(requested, len(ring))
    unknown = [h for h in ring if h not in addresses]
    if count and unknown:
        if requested is not None:
            raise ConfigError(f"replicas={requested} needs every host's store address, but host(s) "
                              f"{', '.join(unknown)} reported none: set TENPLEX_STORE_ADDRESS on every host "
                              f"(tenplex run does), pass store_address=, or pass replicas=0")
        if rank == 0:
            log.warning("state is not replicated: host(s) %s reported no store address (set "
                        "TENPLEX_STORE_ADDRESS, as tenplex run does); a lost host loses its shards",
                        ", ".join(unknown))
        return 0
    return count


@dataclass
class SaveRound:
    """What every rank derives from one save's gathered documents (the same on every rank)."""

    docs: list[dict]
    tensors: dict[str, TensorSpec]              # every saved tensor's global shape and dtype
    writers: dict[tuple[str, str, Box], int]    # (host, tensor, box) -> the rank that writes it on that host
    leader: int                                 # the first rank of this host: writes the documents, commits
    parts: list[str]                            # this host's parts of the version (one per rank)
    addresses: dict[str, str]                   # host -> store address
    ring: list[str]                             # the hosts of the saved layout
    # :meth:`layout`, built once: it reads only what stays the same within a world (the writers and each rank's
    # device), so a snapshot's round (``dataclasses.replace`` with the step's documents) keeps it.
    _layout: Layout | None = field(default=None, repr=False, compare=False)

    @classmethod
    def of(cls, docs: list[dict], host: str, overrides: Mapping[str, str]) -> "SaveRound":
        """Raises (the same error on every rank) when the ranks disagree on a tensor's shape or dtype."""
        return cls(docs, merge_specs(docs), first_holder_per_host(docs),
                   min(r for r, d in enumerate(docs) if d["host"] == host),
                   [f"rank{r}" for r, d in enumerate(docs) if d["host"] == host],
                   store_addresses(docs, overrides), sorted({d["host"] for d in docs if d["boxes"]}))

    def next_version(self, pending: Sequence[int] = ()) -> int:
        """One above every host's newest version (and above ``pending`` ones, not yet committed)."""
        return 1 + max([d["latest"] for d in self.docs if d["latest"] is not None] + list(pending), default=0)

    def all_parts(self) -> dict[str, list[str]]:
        """Every host's parts of the version (one per rank), recorded with it (:mod:`.rollforward`)."""
        parts: dict[str, list[str]] = {}
        for r, d in enumerate(self.docs):
            parts.setdefault(d["host"], []).append(f"rank{r}")
        return parts

    def layout(self) -> Layout:
        """The saved layout: every box with the device that writes it on each host."""
        if self._layout is None:
            self._layout = saved_layout(self.tensors, self.docs, self.writers)
        return self._layout
