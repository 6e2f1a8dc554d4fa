"""``tenplex rendezvous serve``: the rendezvous store of elastic jobs, owned by no agent.

May import: every tenplex layer.

    tenplex rendezvous serve [--bind 127.0.0.1] [--port 29400] [--port-file F] [--allow-unauthenticated]

Agents use it with ``tenplex run … --rdzv-backend c10d --rdzv-endpoint HOST:PORT``.
"""

from __future__ import annotations

import argparse
import signal
import threading
from pathlib import Path

from ..ops import logs
from ._operations import add_arguments as add_operations_arguments, setup_logs
from .units import tcp_port


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("rendezvous", help="serve the rendezvous store of elastic jobs (torch TCPStore)")
    sub = parser.add_subparsers(dest="rendezvous_command", metavar="ACTION", required=True)
    serve = sub.add_parser("serve", help="serve a multi-tenant TCPStore that torchrun agents join with is_host=false")
    serve.add_argument("--bind", default="127.0.0.1",
                       help="address to listen on (default 127.0.0.1; others need --allow-unauthenticated)")
    serve.add_argument("--port", type=tcp_port, default=29400, help="port (default 29400; 0: any free port)")
    serve.add_argument("--port-file", type=Path, help="write the bound port to this file once serving")
    serve.add_argument("--allow-unauthenticated", action="store_true",
                       help="allow a non-loopback bind: TCPStore has no authentication, use a trusted network")
    add_operations_arguments(serve, with_metrics=False)
    serve.set_defaults(handler=_serve)


def _serve(args) -> int:
    from ..elastic.rendezvous import serve

    setup_logs(args)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    serve(args.bind, args.port, args.port_file, args.allow_unauthenticated, stop,
          ready=lambda port: logs.line(f"tenplex rendezvous serving on {args.bind}:{port}",
                                       logger="tenplex.cli.rendezvous", port=port))
    return 0
