"""The operations options every long-running command shares: ``--log-format``, ``--metrics-port``/``-bind``.

May import: ``tenplex.ops``, ``tenplex.errors`` and the standard library.
"""

from __future__ import annotations

import argparse
import logging

from ..errors import UsageError
from ..ops import logs, metrics
from .units import tcp_port


def add_arguments(parser: argparse.ArgumentParser, with_metrics: bool = True) -> None:
    parser.add_argument("--log-format", choices=logs.FORMATS, default=None,
                        help="log lines as text (default) or as one JSON object per line (time, level, logger, "
                             "message, host, job, world, version, step)")
    if with_metrics:
        parser.add_argument("--metrics-port", type=tcp_port, default=None,
                            help="serve Prometheus metrics at http://BIND:PORT/metrics (default: none)")
        parser.add_argument("--metrics-bind", default="127.0.0.1",
                            help="address of the metrics endpoint (default 127.0.0.1; 0.0.0.0 for a scraper "
                                 "on another machine)")


def setup_logs(args: argparse.Namespace, always: bool = False, **context) -> None:
    """Log in ``--log-format`` at INFO; without the option only when ``always`` (as text), else logging stays
    as the command had it."""
    if args.log_format or always:
        logs.setup(args.log_format, logging.INFO, **context)


def serve_metrics(args: argparse.Namespace, registry) -> int | None:
    """Serve ``registry`` when ``--metrics-port`` was given; the bound port (None: not served)."""
    if args.metrics_port is None:
        return None
    try:
        port = metrics.serve(registry, args.metrics_port, args.metrics_bind)
    except OSError as e:
        raise UsageError(f"--metrics-port {args.metrics_port}: cannot serve metrics on {args.metrics_bind} "
                         f"({e.strerror or e}); choose another port") from None
    logging.getLogger("tenplex.ops").info("metrics on http://%s:%d/metrics", args.metrics_bind, port)
    return port

