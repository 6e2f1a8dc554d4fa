"""Transfer plans: the frozen, ordered list of region copies that turns one layout into another.

May import: ``tenplex.box``, ``tenplex.layout``, ``tenplex.devices``,
``tenplex.errors`` and the standard library. Pure. The planning algorithm
lives in ``tenplex.planner``; this module is the data model and its JSON form
(``tenplex.plan/1``)::

    {"format": "tenplex.plan/1",
     "transfers": [{"tensor": "NAME", "src": "h0/0", "dst": "h1/2", "from": "old",
                    "offsets": [0, 0], "lengths": [1024, 1024]}],
     "stats": {"target_bytes": 0, "kept_bytes": 0, "intra_host_bytes": 0,
               "inter_host_bytes": 0, "inter_host_lower_bound": 0,
               "max_host_send_bytes": 0, "max_host_recv_bytes": 0, "initialized_bytes": 0}}

``"from": "old"`` reads the region from one of ``src``'s old shards;
``"from": "new"`` (only within a host) reads it from one of ``src``'s new
shards that an earlier transfer already filled.

Statistics: ``target_bytes`` is the size of every box of the new layout;
``kept_bytes + intra_host_bytes + inter_host_bytes + initialized_bytes ==
target_bytes``. ``initialized_bytes`` counts the boxes of tensors that the
old layout lacks, which the plan leaves to be initialised (only when the
caller allowed new tensors; their names are in ``"new_tensors"``, a key
present only when there are any). ``max_host_send_bytes`` and
``max_host_recv_bytes`` count only transfers between hosts.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any, Literal, Mapping

from .box import Box
from .devices import host_of
from .errors import PlanError

PLAN_FORMAT = "tenplex.plan/1"
Source = Literal["old", "new"]


@dataclass(frozen=True)
class Transfer:
    tensor: str
    src: str
    dst: str
    source: Source
    box: Box

    @property
    def kept(self) -> bool:
        return self.src == self.dst and self.source == "old"

    @property
    def crosses_hosts(self) -> bool:
        return host_of(self.src) != host_of(self.dst)

    def to_dict(self) -> dict:
        return {"tensor": self.tensor, "src": self.src, "dst": self.dst, "from": self.source,
                "offsets": list(self.box.offsets), "lengths": list(self.box.lengths)}


@dataclass(frozen=True)
class PlanStats:
    target_bytes: int = 0
    kept_bytes: int = 0
    intra_host_bytes: int = 0
    inter_host_bytes: int = 0
    inter_host_lower_bound: int = 0
    max_host_send_bytes: int = 0
    max_host_recv_bytes: int = 0
    initialized_bytes: int = 0


@dataclass(frozen=True)
class Plan:
    transfers: tuple[Transfer, ...]
    stats: PlanStats
    new_tensors: tuple[str, ...] = ()

    def host_traffic(self, itemsizes: Mapping[str, int]) -> dict[str, tuple[int, int]]:
        """Bytes (sent, received) between hosts, per host; ``itemsizes`` maps tensor name to element size."""
        traffic: dict[str, list[int]] = {}
        hosts: dict[str, str] = {}  # device -> host: parsing a device id per transfer dominated on 1,024 devices
        for t in self.transfers:
            src = hosts.get(t.src) or hosts.setdefault(t.src, host_of(t.src))
            dst = hosts.get(t.dst) or hosts.setdefault(t.dst, host_of(t.dst))
            if src != dst:
                nbytes = t.box.volume * itemsizes[t.tensor]
                traffic.setdefault(src, [0, 0])[0] += nbytes
                traffic.setdefault(dst, [0, 0])[1] += nbytes
        return {host: (sent, received) for host, (sent, received) in sorted(traffic.items())}

    def device_loads(self, itemsizes: Mapping[str, int]) -> dict[str, int]:
        """Bytes each device sends (every transfer but the kept ones), per source device: the senders' balance."""
        loads: dict[str, int] = {}
        for t in self.transfers:
            if t.src != t.dst or t.source != "old":
                loads[t.src] = loads.get(t.src, 0) + t.box.volume * itemsizes[t.tensor]
        return loads

    def to_dict(self) -> dict:
        # Transfer.to_dict inlined: one method call per transfer was a third of `tenplex plan -o` on 1,024 devices
        doc = {"format": PLAN_FORMAT,
               "transfers": [{"tensor": t.tensor, "src": t.src, "dst": t.dst, "from": t.source,
                              "offsets": list(t.box.offsets), "lengths": list(t.box.lengths)}
                             for t in self.transfers],
               "stats": asdict(self.stats)}
        if self.new_tensors:
            doc["new_tensors"] = list(self.new_tensors)
        return doc


def plan_from_dict(doc: Any, source: str = "plan") -> Plan:
    """Parse a ``tenplex.plan/1`` document; errors name ``source``."""
    try:
        if not isinstance(doc, dict) or doc.get("format") != PLAN_FORMAT:
            found = doc.get("format") if isinstance(doc, dict) else type(doc).__name__
            raise PlanError(f"expected format {PLAN_FORMAT!r}, found {found!r}")
        transfers = []
        for t in doc["transfers"]:
            if t["from"] not in ("old", "new"):
                raise PlanError(f"transfer 'from' must be 'old' or 'new', found {t['from']!r}")
            transfers.append(Transfer(str(t["tensor"]), str(t["src"]), str(t["dst"]), t["from"],
                                      Box(tuple(t["offsets"]), tuple(t["lengths"]))))
        known = {f.name for f in fields(PlanStats)}
        stats = PlanStats(**{k: int(v) for k, v in doc["stats"].items() if k in known})
        return Plan(tuple(transfers), stats, tuple(str(n) for n in doc.get("new_tensors", ())))
    except PlanError as e:
        raise PlanError(f"{source}: {e}") from None
    except (KeyError, TypeError, ValueError) as e:
        raise PlanError(f"{source}: malformed plan ({type(e).__name__}: {e})") from None
