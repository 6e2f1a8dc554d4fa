"""``tenplex status``: a job's state at a glance, from its stores.

May import: every tenplex layer.

    tenplex status ADDRESS [ADDRESS ...] [--root DIR ...] [--token-file F] [--tls-ca F] [--json]

The stores to ask: the addresses given, the store serving each ``--root`` (its ``.tenplex-store.port``,
written by ``tenplex run``), and every store the newest save's record (``tenplex.stores``) names, so one
address is enough. For each host: whether it answered and the versions it holds; for the newest versions:
the step, the hosts that saved it, those that hold it now, the copies asked for and those found; and the
newest version that the hosts that answered could restore completely (every host of the save holds it, or
copies of a missing host's regions survive). Copies live in nested stores of each root (no RPC lists them):
they are counted where the root is readable on this machine, and shown as unknown elsewhere. So are the
workers' metrics endpoints that the root records (:func:`tenplex.ops.metrics.endpoint_states`): serving, waiting
for a port that a worker of the previous world still holds, or not served.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ..errors import UsageError

STATUS_FORMAT = "tenplex.status/1"
SHOWN_VERSIONS = 3
STATE_DOC = "tenplex.torch_state"  # tenplex.integration.checkpointer.STATE_DOC, whose import loads torch


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("status", help="a job's hosts, versions, replication and what it would restore")
    parser.add_argument("addresses", nargs="*", metavar="ADDRESS", help="HOST:PORT of a store of the job")
    parser.add_argument("--root", action="append", type=Path, default=[],
                        help="a store directory on this machine whose server to ask (repeatable)")
    parser.add_argument("--token-file", type=Path, help="file holding the shared store token")
    parser.add_argument("--tls-ca", type=Path, help="PEM certificate(s) to trust: connect with TLS")
    parser.add_argument("--versions", type=int, default=SHOWN_VERSIONS,
                        help=f"how many of the newest versions to show (default {SHOWN_VERSIONS})")
    parser.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for each store (default 5)")
    parser.add_argument("--json", action="store_true", help=f"print one {STATUS_FORMAT} JSON document")
    parser.set_defaults(handler=_status)


def _status(args) -> int:
    from .store import _client_options

    addresses = list(args.addresses) + [_served_address(root) for root in args.root]
    if not addresses:
        raise UsageError("say which stores to ask: ADDRESS (HOST:PORT) or --root DIR")
    report = gather(addresses, **_client_options(args), timeout=args.timeout, shown=max(1, args.versions))
    if not any(h["reachable"] for h in report["hosts"]):
        raise UsageError("no store answered: " + "; ".join(f"{h['address']}: {h['error']}" for h in report["hosts"]))
    print(json.dumps(report, indent=1) if args.json else render(report))
    return 0


def _served_address(root: Path) -> str:
    port_file = root / ".tenplex-store.port"
    try:
        return f"127.0.0.1:{int(port_file.read_text())}"
    except (OSError, ValueError):
        raise UsageError(f"--root {root}: no store server is recorded there ({port_file} is missing or empty): "
                         f"give its address instead") from None


def gather(addresses: list[str], token: str | None = None, root_certificates: bytes | None = None,
           timeout: float = 5.0, shown: int = SHOWN_VERSIONS) -> dict:
    """The ``tenplex.status/1`` document of the stores at ``addresses`` and those their newest save names."""
    from ..replication.stores import STORES_DOC
    from ..store.client import RemoteStoreError, StoreClient

    hosts: dict[str, dict] = {}     # address -> what it said
    clients: dict[str, StoreClient] = {}
    pending = list(dict.fromkeys(addresses))
    records: dict[int, dict] = {}  # version -> its tenplex.stores record
    named: dict[str, str] = {}     # address -> host, from a record (names a store that does not answer)
    try:
        while pending:
            address = pending.pop(0)
            client = clients[address] = StoreClient(address, token=token, root_certificates=root_certificates,
                                                    timeout=timeout, retries=0, data_plane=False)
            hosts[address] = _ask(client, address, timeout, RemoteStoreError)
            if not hosts[address]["reachable"] and address in named:
                hosts[address]["host"] = named[address]
            for version in sorted(hosts[address].get("versions", []), reverse=True)[:shown]:
                if version not in records:
                    record = _json(client, version, STORES_DOC, RemoteStoreError)
                    if record is not None:
                        records[version] = record
            for version in sorted(records, reverse=True)[:1]:  # the newest save names the job's stores
                named.update({a: h for h, a in records[version]["stores"].items() if a})
                answered = {h["host"] for h in hosts.values() if h["reachable"]}  # a host may have moved
                pending += [a for a, h in named.items() if a not in hosts and a not in pending and h not in answered]
        return _report(hosts, clients, records, shown, RemoteStoreError)
    finally:
        for client in clients.values():
            client.close()


def _ask(client, address: str, timeout: float, remote_error) -> dict:
    try:
        health = client.health(timeout=timeout)
    except remote_error as e:
        if e.code is not None and e.code.name == "UNAUTHENTICATED":
            raise UsageError(f"store {address} refused the token: pass the job's --token-file") from None
        return {"address": address, "reachable": False, "error": _reason(e)}
    copies = _local_copies(health["root"], health["host"])
    return {"address": address, "reachable": True, "host": health["host"], "root": health["root"],
            "versions": sorted(health["versions"]), "copies": copies, "metrics": _metrics_endpoints(health["root"])}


def _metrics_endpoints(root: str) -> list[dict] | None:
    """The state of each worker metrics endpoint the root records (serving, waiting for its port, unserved);
    None when the root is not on this machine."""
    from ..ops.metrics import endpoint_states

    return endpoint_states(root) if Path(root).is_dir() else None


def _reason(error) -> str:
    code = error.code.name.lower() if error.code is not None else "error"
    return "unreachable" if code in ("unavailable", "deadline_exceeded") else f"{code}: {error}"


def _local_copies(root: str, host: str) -> dict[str, list[int]] | None:
    """origin host -> versions of which the store keeps copies; None when its root is not on this machine."""
    from ..replication.copier import held_versions

    if not Path(root).is_dir():
        return None
    return held_versions(root, host)


def _json(client, version: int, name: str, remote_error):
    try:
        return client.get_json(version, name)
    except remote_error:
        return None  # a version without it (a transformation's output), or gone meanwhile


def _report(hosts: dict, clients: dict, records: dict, shown: int, remote_error) -> dict:
    from ..store.manifest import LAYOUT_DOC

    reached = {h["host"]: h for h in hosts.values() if h["reachable"]}
    all_versions = sorted({v for h in reached.values() for v in h["versions"]}, reverse=True)
    versions = []
    for version in all_versions:
        holders = sorted(host for host, h in reached.items() if version in h["versions"])
        client = clients[reached[holders[0]]["address"]]
        state = _json(client, version, STATE_DOC, remote_error)
        layout_doc = _json(client, version, LAYOUT_DOC, remote_error)
        devices = None if layout_doc is None else _devices_per_host(layout_doc)
        saved_hosts = sorted(devices) if devices else holders
        record = records.get(version)
        copies = {origin: sorted(holder for holder, h in reached.items()
                                 if version in (h["copies"] or {}).get(origin, [])) for origin in saved_hosts}
        missing = [h for h in saved_hosts if h not in holders]
        versions.append({"version": version, "step": None if state is None else state.get("step"),
                         "saved_hosts": saved_hosts, "hosts": holders, "missing": missing,
                         "replicas": None if record is None else record.get("replicas"),
                         "copies": copies if all(h["copies"] is not None for h in reached.values()) else None,
                         "devices": devices,
                         "restorable": all(copies.get(m) for m in missing)})
    restorable = next((v for v in versions if v["restorable"]), None)
    committed = next((v for v in versions if v["step"] is not None), None)
    return {"format": STATUS_FORMAT,
            "hosts": [dict(h, versions=h.get("versions", []), copies=h.get("copies"), metrics=h.get("metrics"))
                      for h in hosts.values()],
            "versions": versions[:shown],
            "last_committed_step": None if committed is None else committed["step"],
            "configuration": None if committed is None else committed["devices"],
            "restorable": None if restorable is None else {"version": restorable["version"],
                                                           "step": restorable["step"]}}


def _devices_per_host(layout_doc: dict) -> dict[str, int]:
    from ..devices import host_of

    counts: dict[str, int] = {}
    for device in layout_doc.get("devices", {}):
        counts[host_of(device)] = counts.get(host_of(device), 0) + 1
    return dict(sorted(counts.items()))


def render(report: dict) -> str:
    lines = ["HOST      ADDRESS                 STATE        VERSIONS"]
    for h in report["hosts"]:
        state = "ok" if h["reachable"] else h["error"]
        held = ",".join(map(str, h["versions"][-6:])) or "-"
        lines.append(f"{h.get('host', '?'):<9} {h['address']:<23} {state:<12} {held}")
    endpoints = [(h.get("host", "?"), e) for h in report["hosts"] for e in h.get("metrics") or []]
    if endpoints:
        lines.append("")
        lines += [f"metrics of {host} on port {e['port']}: {_endpoint_text(e)}" for host, e in endpoints]
    lines.append("")
    lines.append("VERSION   STEP   SAVED BY      HELD BY       MISSING   COPIES (origin: holders)     RESTORABLE")
    for v in report["versions"]:
        copies = "unknown" if v["copies"] is None else \
            " ".join(f"{o}:{'+'.join(hs) or '-'}" for o, hs in v["copies"].items())
        lines.append(f"{v['version']:<9} {_text(v['step']):<6} {','.join(v['saved_hosts']):<13} "
                     f"{','.join(v['hosts']):<13} {','.join(v['missing']) or '-':<9} {copies:<28} "
                     f"{'yes' if v['restorable'] else 'no'}")
    devices = report["configuration"]
    lines.append("")
    lines.append(f"last committed step: {_text(report['last_committed_step'])}"
                 + ("" if not devices else "  (devices: " + ", ".join(f"{h}={n}" for h, n in devices.items()) + ")"))
    r = report["restorable"]
    lines.append("a recovery would restore: " + ("nothing (no complete version)" if r is None else
                                                 f"version {r['version']} (step {_text(r['step'])})"))
    return "\n".join(lines)


def _endpoint_text(endpoint: dict) -> str:
    state = {"serving": "serving", "unserved": "not served (its port was in use)",
             "waiting": "waiting for its port (in use by another process)"}.get(endpoint["state"], endpoint["state"])
    return f"{state}, worker pid {endpoint['pid']}" + ("" if endpoint["alive"] else " (gone)")


def _text(value) -> str:
    return "-" if value is None else str(value)

