"""``tenplex store``: run a host's tensor store server, inspect stores, run a transformation.

May import: every tenplex layer, tqdm and the standard library.

    tenplex store serve --root DIR --host h0 [--bind 127.0.0.1] [--port 0] [--token-file F] [--port-file F]
    tenplex store ls ADDRESS [--version N] [--token-file F]
    tenplex store gc ADDRESS --keep K [--token-file F]
    tenplex store stop --store-root DIR
    tenplex store transform PLAN OLD_LAYOUT NEW_LAYOUT --stores h0=ADDR,h1=ADDR --old-version N --new-version M
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import threading
from pathlib import Path

from ..errors import UsageError
from ..ops import logs
from ._operations import add_arguments as add_operations_arguments
from .units import tcp_port


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("store", help="run or query a host's tensor store")
    sub = parser.add_subparsers(dest="store_command", metavar="ACTION", required=True)
    _register_serve(sub)
    _register_queries(sub)


def _register_serve(sub: argparse._SubParsersAction) -> None:
    serve = sub.add_parser("serve", help="serve a store directory over gRPC (tenplex.v1.Store)",
                           description="Serve a store directory over gRPC (tenplex.v1.Store). Off loopback a token "
                                       "is required; without --tls-cert/--tls-key every gRPC call carries that "
                                       "token in plaintext, readable by anyone on the network path (the data "
                                       "plane sends only an HMAC of it): use TLS off trusted networks.")
    serve.add_argument("--root", required=True, type=Path, help="store directory (created if missing)")
    serve.add_argument("--host", required=True, help="host name of this store, e.g. h0")
    serve.add_argument("--bind", default="127.0.0.1", help="address to bind (default 127.0.0.1; others need a token)")
    serve.add_argument("--port", type=tcp_port, default=0,
                       help="port (default 0: any free port; one in use is refused)")
    serve.add_argument("--probe-port", type=tcp_port, default=None,
                       help="also answer grpc.health.v1 without a token on this port of the same address, for "
                            "kubelet gRPC probes (health only, requests of at most 1 KiB; default: none)")
    serve.add_argument("--port-file", type=Path, help="write the bound port to this file once serving")
    _token_arguments(serve)
    serve.add_argument("--tls-cert", type=Path, help="PEM certificate: serve TLS (needs --tls-key)")
    serve.add_argument("--tls-key", type=Path, help="PEM private key of --tls-cert")
    serve.add_argument("--max-streams", type=_positive, default=None,
                       help="bulk streams (WriteShard, ReadBox...) served at once; more are refused with "
                            "RESOURCE_EXHAUSTED (default: the server's threads but 16, kept for control calls)")
    serve.add_argument("--stream-idle-s", type=float, default=60.0,
                       help="cancel a bulk stream that makes no progress for this long (default 60)")
    serve.add_argument("--part-idle-s", type=float, default=3600.0,
                       help="abort a part written over gRPC (WriteShard/PutJson) that is neither prepared nor "
                            "aborted and unused for this long (default 3600)")
    serve.add_argument("--no-data-plane", action="store_true",
                       help="serve box reads over gRPC only (the plain-TCP data plane is also off with TLS)")
    add_operations_arguments(serve)
    serve.set_defaults(handler=_serve)


def _register_queries(sub: argparse._SubParsersAction) -> None:
    """The actions that talk to running stores (ls, gc, stop, transform)."""
    ls = sub.add_parser("ls", help="list a store's versions, or one version's shards")
    ls.add_argument("address", help="HOST:PORT of a store server")
    ls.add_argument("--version", type=int, help="show this version's manifest summary")
    _token_arguments(ls)
    ls.set_defaults(handler=_ls)

    gc = sub.add_parser("gc", help="delete all but the newest K versions of a store")
    gc.add_argument("address")
    gc.add_argument("--keep", type=int, required=True)
    _token_arguments(gc)
    gc.set_defaults(handler=_gc)

    stop = sub.add_parser("stop", help="stop the store that `tenplex run --store-root DIR` left serving")
    stop.add_argument("--store-root", required=True, type=Path, help="the --store-root given to tenplex run")
    stop.set_defaults(handler=_stop)

    tr = sub.add_parser("transform", help="run a plan across the stores (two-phase commit), with progress")
    tr.add_argument("plan", type=Path, help="tenplex.plan/1 JSON (tenplex plan OLD NEW --json)")
    tr.add_argument("old_layout", type=Path)
    tr.add_argument("new_layout", type=Path)
    tr.add_argument("--stores", required=True, help="comma-separated HOST=ADDRESS for every host of both layouts")
    tr.add_argument("--old-version", type=int, required=True)
    tr.add_argument("--new-version", type=int, required=True)
    tr.add_argument("--streams", type=_positive, default=None,
                    help="concurrent pulls per destination host (default: one per CPU of each store's host, 2 to 4)")
    _token_arguments(tr)
    tr.set_defaults(handler=_transform)


def _positive(text: str) -> int:
    try:
        count = int(text)
    except ValueError:
        count = 0
    if count < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a count: use an integer >= 1")
    return count


def _token_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--token-file", type=Path, help="file holding the shared store token")
    parser.add_argument("--tls-ca", type=Path,
                        help="PEM certificate(s) to trust: connect to stores with TLS (serve: when pulling from peers)")


def _client_options(args) -> dict:
    ca = getattr(args, "tls_ca", None)
    return {"token": _token(args), "root_certificates": ca.read_bytes() if ca else None}


def _token(args) -> str | None:
    if not args.token_file:
        return None
    token = args.token_file.read_text().strip()
    if not token:
        raise UsageError(f"token file {args.token_file} is empty")
    return token


def _serve(args) -> int:
    from ..store import Store
    from ..store.server import serve
    from ..transform.host import run_host_part
    from . import _operations

    _operations.setup_logs(args, always=True, host=args.host)
    if args.tls_cert and args.tls_key:
        _check_tls_pair(args.tls_cert, args.tls_key)
    tls_cert = args.tls_cert.read_bytes() if args.tls_cert else None
    tls_key = args.tls_key.read_bytes() if args.tls_key else None
    store = Store(args.root, args.host)
    options = _client_options(args)
    observed = _store_metrics(store)
    metrics_port = _operations.serve_metrics(args, observed.registry)  # a taken port fails before serving
    server, port = serve(store, bind=args.bind, port=args.port, token=options["token"], tls_cert=tls_cert,
                         tls_key=tls_key, transformer=observed.observed(run_host_part),
                         interceptors=[observed.interceptor()],
                         peer_root_certificates=options["root_certificates"], data_plane=not args.no_data_plane,
                         max_streams=args.max_streams, stream_idle_s=args.stream_idle_s,
                         part_idle_s=args.part_idle_s, probe_port=args.probe_port, on_sent=observed.count_sent)
    if args.port_file:
        tmp = args.port_file.with_name(args.port_file.name + ".tmp")
        tmp.write_text(f"{port}\n")
        tmp.replace(args.port_file)
    logs.line(f"tenplex store {args.host} serving {args.root} on {args.bind}:{port}"
              + (f" (metrics on port {metrics_port})" if metrics_port else ""), logger="tenplex.cli.store",
              port=port, metrics_port=metrics_port)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    server.health.drain()  # NOT_SERVING while the last calls finish
    server.stop(grace=2).wait()
    server.health.close()
    return 0


def _store_metrics(store):
    from ..ops.metrics import StoreMetrics
    from ..replication.copier import held_versions

    return StoreMetrics(store.versions, store.free_bytes, lambda: held_versions(store.root, store.host))


def _check_tls_pair(cert: Path, key: Path) -> None:
    """Fail with one clear line, before gRPC reports a bad certificate as "Failed to bind to address"."""
    import ssl

    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(cert, key)
    except ssl.SSLError as e:
        raise UsageError(f"--tls-cert {cert} / --tls-key {key}: not a PEM certificate and its matching private "
                         f"key ({e.reason or e})") from None


def _ls(args) -> int:
    from ..store.client import StoreClient

    with StoreClient(args.address, **_client_options(args)) as client:
        if args.version is None:
            print(json.dumps(client.health()))
            return 0
        manifest = client.manifest(args.version)
        for row in manifest["shards"]:
            print(f"{row['device']}\t{row['tensor']}\t{row['dtype']}\toffsets={row['offsets']}\t"
                  f"lengths={row['lengths']}\t{row['nbytes']} B")
        print(f"json: {', '.join(sorted(manifest['json'])) or '-'}")
    return 0


def _gc(args) -> int:
    from ..store.client import StoreClient

    with StoreClient(args.address, **_client_options(args)) as client:
        print(json.dumps({"deleted": client.gc(args.keep)}))
    return 0


def _stop(args) -> int:
    from ..elastic.launcher import stop_store

    if not args.store_root.is_dir():
        raise UsageError(f"--store-root {args.store_root} is not a directory")
    pid = stop_store(args.store_root)
    print(f"stopped the store of {args.store_root} (pid {pid})" if pid is not None
          else f"no store is running for {args.store_root}")
    return 0


def _transform(args) -> int:
    from tqdm import tqdm

    from ..devices import parse_host_addresses
    from ..files import load_layout, load_plan
    from ..transform import transform

    stores = parse_host_addresses(args.stores, "--stores")
    plan, old, new = load_plan(args.plan), load_layout(args.old_layout), load_layout(args.new_layout)
    bars: dict[str, tqdm] = {}
    lock = threading.Lock()

    def progress(host: str, done: int, total: int) -> None:
        with lock:
            bar = bars.get(host)
            if bar is None:
                bar = bars[host] = tqdm(total=total, desc=host, unit="B", unit_scale=True, file=sys.stderr,
                                        position=len(bars))
            bar.update(done - bar.n)

    try:
        report = transform(plan, old, new, stores, args.old_version, args.new_version, progress=progress,
                           streams=args.streams, **_client_options(args))
    finally:
        for bar in bars.values():
            bar.close()
    print(json.dumps(report))
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m tenplex.cli.store ACTION …``: the same as ``tenplex store ACTION …`` without loading the
    other subcommands (a store host needs only this one)."""
    from . import user_error

    parser = argparse.ArgumentParser(prog="tenplex")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["store", *(sys.argv[1:] if argv is None else argv)])
    try:
        return int(args.handler(args) or 0)
    except Exception as e:
        if not user_error(e):  # the same policy as `tenplex`: a bug shows its traceback
            raise
        logs.line(f"tenplex store: error: {e}", sys.stderr, logging.ERROR, "tenplex.cli")
        return 2


if __name__ == "__main__":
    sys.exit(main())
