"""The two ways a restore moves state between devices: every rank reads its part of the plan straight from the
stores (read-through), or the stores run the plan into a new version (transformation).

May import: ``tenplex.errors``, ``tenplex.store``, ``tenplex.transform``, ``tenplex.layout``,
``tenplex.transfer_plan``, ``tenplex.plan_index``, ``tenplex.share_planner``, this package's :mod:`.exchange`,
:mod:`.readthrough`, :mod:`.nontensor`, :mod:`.pieces` and :mod:`.shardio`, and torch.distributed.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from typing import Callable, Mapping

import torch.distributed as dist

from ..errors import StoreError
from ..layout import Layout
from ..plan_index import LayoutIndex
from ..share_planner import layouts_digest, plan_share
from ..store import Store
from ..store.client import StoreClient
from ..transfer_plan import Plan
from .exchange import agree, all_gather_json
from .nontensor import StateMismatchError
from .pieces import Piece
from .readthrough import RemoteVersion, fans_out, read_hosts, read_through, source_hosts
from .shardio import RegionReader

log = logging.getLogger(__name__)
READ_STALL_S = 5.0  # a store that sends nothing for this long while a restore reads from it is dead


@dataclass(frozen=True)
class Shares:
    """What every rank's share of a plan adds up to: enough to choose between read-through and transformation."""

    fans_out: bool        # some share reads a region another device of its host brought in ("from": "new")
    read_hosts: set[str]  # the hosts whose old shards some share reads
    stats: dict           # the whole plan's PlanStats fields


def plan_my_share(old: Layout, new: Layout, device: str, group) -> tuple[Plan, Shares]:
    """This rank's share of the plan from ``old`` to ``new`` (its device's transfers only), and the sum of all
    shares. Collective: one all-gather of small summaries, each with a digest of the two layouts, which must
    agree (every rank planned from the same layouts; ranks that did not raise StateMismatchError everywhere)."""
    def mine() -> tuple[Plan, dict]:
        o, n = LayoutIndex(old), LayoutIndex(new)
        share = plan_share(o, n, [device] if device in new.devices else [])
        # bytes between hosts, so the sum of the shares can name the busiest host
        traffic = share.host_traffic({name: spec.itemsize for name, spec in new.tensors.items()})
        return share, {"digest": layouts_digest(o, n), "fans_out": fans_out(share),
                       "reads": sorted(read_hosts(share)), "stats": asdict(share.stats),
                       "sent": {host: out for host, (out, _) in traffic.items()},
                       "received": {host: into for host, (_, into) in traffic.items()}}

    share, summary = agree("restore: planning this rank's share of the change", mine, group)
    summaries = all_gather_json(summary, group)
    if len({s["digest"] for s in summaries}) > 1:
        raise StateMismatchError("restore: the ranks planned from different layouts (their digests differ); "
                                 "every rank must restore the same saved version into the same configuration")
    return share, Shares(any(s["fans_out"] for s in summaries), {h for s in summaries for h in s["reads"]},
                         _add_up(summaries))


def _add_up(summaries: list[dict]) -> dict:
    stats = {key: sum(s["stats"][key] for s in summaries) for key in summaries[0]["stats"]}
    for key, side in (("max_host_send_bytes", "sent"), ("max_host_recv_bytes", "received")):
        per_host: dict[str, int] = {}
        for s in summaries:
            for host, nbytes in s[side].items():
                per_host[host] = per_host.get(host, 0) + nbytes
        stats[key] = max(per_host.values(), default=0)
    return stats


def read_plan_through(the_plan: Plan, old: Layout, version: int, pieces: list[Piece], addresses: dict[str, str], *,
                      store: Store, device: str, token: str | None, group) -> bool:
    """Every rank reads its device's transfers of ``the_plan`` from ``version`` into its pieces. Collective.

    True when every rank did; False when a store or the network failed on some rank (logged): the caller
    then lets the stores run the plan, which retries failed sources from other replicas."""
    hosts = source_hosts(the_plan, device)
    dtypes = {name: spec.dtype for name, spec in old.tensors.items()}

    def run() -> str | None:
        """None when done; the failure when a store or the network failed (other errors raise everywhere)."""
        require_addresses(hosts - {store.host}, addresses)
        clients: list[StoreClient] = []
        local = None
        try:
            readers: dict[str, RegionReader] = {}
            for host in sorted(hosts):
                if host == store.host:
                    readers[host] = local = store.open(version)
                else:
                    clients.append(StoreClient(addresses[host], token=token, stall_timeout=READ_STALL_S,
                                                   peer_host=store.host))
                    readers[host] = RemoteVersion(clients[-1], version, dtypes)
            read_through(the_plan, device, pieces, readers)
            return None
        except (StoreError, OSError) as e:
            return f"{type(e).__name__}: {e}"
        finally:
            for client in clients:
                client.close()
            if local is not None:
                local.close()

    mine = agree("restore: reading the plan's regions", run, group)
    failures = [(r, f) for r, f in enumerate(all_gather_json(mine, group)) if f]
    if dist.get_rank(group) == 0:
        for r, failure in failures[:3]:
            log.warning("restore: rank %d could not read its regions directly (%s); the stores run the plan "
                        "instead", r, failure)
    return not failures


def transform_stored(make_plan: Callable[[], Plan], old: Layout, new: Layout, old_version: int, target: int,
                     addresses: dict[str, str], *, token: str | None, group) -> int:
    """Rank 0 has the stores run the plan ``make_plan`` returns (made on rank 0 only: the whole plan) from
    ``old_version`` into version ``target``. Collective."""
    from ..transform import transform

    def run():
        if dist.get_rank(group) != 0:
            return None
        require_addresses(set(old.hosts()) | set(new.hosts()), addresses)
        # The transformer carries the JSON documents (the state doc included) into the new version.
        transform(make_plan(), old, new, stores=addresses, old_version=old_version, new_version=target, token=token)
        return target

    agree("restore: transforming the stored state", run, group)
    return target


def require_addresses(hosts: set[str], addresses: Mapping[str, str]) -> None:
    missing = sorted(hosts - set(addresses))
    if missing:
        raise StateMismatchError(
            f"restoring into this configuration moves state between devices, which needs the store "
            f"process of every host; no address for host(s) {', '.join(missing)}: set "
            f"TENPLEX_STORE_ADDRESS on every host (tenplex run does), or pass stores= / "
            f"TENPLEX_STORES=h0=HOST:PORT,…")
