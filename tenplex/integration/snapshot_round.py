"""A snapshot's all-gather, with the documents that stay the same within a world sent once.

May import: ``tenplex.replication`` (which regions one host alone holds), this package's :mod:`.canonical`,
:mod:`.exchange`, :mod:`.pieces` and :mod:`.savedoc`, and the standard library.

Every snapshot begins with one all-gather of JSON (:mod:`.snapshot`, step 1). Most of a rank's save document
(:func:`.savedoc.static_doc`: its device, the tensors and boxes it holds, the parameter groups) does not change
while the model's structure does not, and the layout does not change within a world. So each rank sends it only
when it changed since the last all-gather of its snapshotter (the first time, and after a change of structure),
every rank keeps what each rank sent last, and what every rank derives from all of them (:class:`.SaveRound`:
who writes which box, the host leaders, the store addresses) is derived again only when some rank sent a new one.
Every rank receives the same documents in the same order, so every rank's copy is the same. Sent every time:
the newest version, the RNG streams (the word ``unchanged`` when they equal the ones the rank sent last: a
loop without dropout or shuffling leaves them alone), the optimizer scalars and what the caller adds (the
previous snapshot's outcome).

One collective per snapshot, not two (:func:`.exchange.all_gather_json` sends the lengths first): the gather is
an :class:`.exchange.JsonGather`, whose capacity follows the documents; the first snapshot and a new static
document send again, padded to the longest.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ..replication.plan import unique_regions
from .canonical import canonical_sends
from .exchange import JsonGather
from .pieces import Piece
from .savedoc import SaveRound, static_doc, step_doc


_UNCHANGED = "unchanged"  # in place of RNG streams equal to the ones the rank sent last


class RoundCache:
    """One snapshotter's view of every rank's static document, and the round derived from them."""

    def __init__(self, ckpt) -> None:
        self.ckpt = ckpt
        self._key: tuple | None = None   # what this rank's static document was made from
        self._static: dict | None = None
        self._sent = False               # this rank's current static document went out in an all-gather
        self._peers: dict[int, dict] = {}  # rank -> the static document it sent last
        self._round: SaveRound | None = None
        self.changed = True              # the last exchange carried some rank's new static document
        self.spread = False              # every region of the round's layout is on two hosts or more
        self._gather = JsonGather()      # one collective per snapshot while the documents fit
        self._rng_sent: dict | None = None  # the RNG streams this rank sent last
        self._peer_rng: dict[int, Any] = {}  # rank -> the RNG streams it sent last
        self._sends: tuple[SaveRound, list] | None = None  # the round's canonical buffer sends

    def exchange(self, pieces: list[Piece], rank: int, rng: bool, model, optimizer, pieces_key: Any = None,
                 named: list | None = None, **more: Any) -> list[dict]:
        """Every rank's whole save document (static and per-step parts) and ``more``. Collective. ``pieces_key``
        stands for the pieces' names, boxes and specs when the caller knows them unchanged (:mod:`.snapshot_pieces`);
        ``named``: the optimizer's named parameters, when known (:meth:`.snapshot_pieces.PiecesCache.named_params`)."""
        ckpt = self.ckpt
        key = self.static_key(pieces, model, optimizer, pieces_key)
        if key != self._key:
            self._key, self._sent = key, False
            self._static = self._static_doc(pieces, rank, model, optimizer)
        mine = {**step_doc(ckpt.store.latest(), rng, model, optimizer, named), **more}
        if not self._sent:
            mine["static"] = self._static
        streams = mine["rng"]
        if streams is not None and streams == self._rng_sent:
            mine["rng"] = _UNCHANGED  # every rank keeps what this rank sent last
        docs = self._gather(mine, self.ckpt.group)
        self._sent, self._rng_sent = True, streams
        self.changed = any("static" in d for d in docs)
        for r, d in enumerate(docs):
            if "static" in d:
                self._peers[r] = d.pop("static")
            d.update(self._peers[r])
            if d["rng"] == _UNCHANGED:
                d["rng"] = self._peer_rng[r]
            self._peer_rng[r] = d["rng"]
        return docs

    def _static_doc(self, pieces: list[Piece], rank: int, model, optimizer) -> dict:
        ckpt = self.ckpt
        return static_doc(pieces, device=ckpt.device, host=ckpt.host, store=ckpt.store_address,
                          coord=ckpt.coord_key(rank), model=model, optimizer=optimizer)

    def static_key(self, pieces: list[Piece], model, optimizer, pieces_key: Any = None) -> tuple:
        """What this rank's static document is made from: equal keys, equal documents."""
        return (id(model), id(optimizer), self.ckpt.store_address,
                tuple((p.name, p.box, p.spec) for p in pieces) if pieces_key is None else pieces_key,
                tuple(tuple(id(p) for p in g["params"]) for g in optimizer.param_groups) if optimizer else ())

    def still_sent(self, pieces: list[Piece], rank: int, model, optimizer, pieces_key: Any = None) -> bool:
        """Whether every rank holds this rank's static document as it is now: the one it sent last, unless the
        state's description changed (a tensor given new memory keeps its name, box and spec: then the document,
        made again, is the same, and is taken as the one sent)."""
        if not self._sent:
            return False
        key = self.static_key(pieces, model, optimizer, pieces_key)
        if key == self._key:
            return True
        if self._static_doc(pieces, rank, model, optimizer) != self._static:
            return False
        self._key = key
        return True

    @property
    def current(self) -> SaveRound | None:
        """The round of the last exchange (its documents' RNG and scalars are that exchange's)."""
        return self._round

    def round(self, docs: list[dict]) -> SaveRound:
        """The round of these documents: derived again only when some rank's static document changed."""
        if self.changed or self._round is None:
            self._round = None  # derived again next time too, should this raise
            self._round = SaveRound.of(docs, self.ckpt.host, self.ckpt.stores)  # a mismatch raises everywhere
            self.spread = len(self._round.ring) > 1 and not unique_regions(self._round.layout())
        else:
            self._round = dataclasses.replace(self._round, docs=docs)
        return self._round

    def canonical_sends(self, round_: SaveRound) -> list:
        """The round's canonical buffer sends (:func:`.canonical.canonical_sends`), worked out once per round."""
        if self._sends is None or self.changed or self._sends[0].writers is not round_.writers:
            self._sends = (round_, canonical_sends(round_.docs, round_.writers))
        return self._sends[1]
