"""``tenplex run``'s operations options, taken out of its command line before the launcher parses it.

May import: ``tenplex.elastic.launcher``, ``tenplex.ops`` and the standard library.

``--log-format``, ``--metrics-port`` and ``--metrics-bind`` (before the training script) set up this
process's logs and metrics and reach the workers through ``TENPLEX_LOG_FORMAT``,
``TENPLEX_METRICS_PORT`` (the port after the agent's; each worker adds its ``LOCAL_RANK``) and
``TENPLEX_METRICS_BIND``.
"""

from __future__ import annotations

import argparse
import os

from ..ops import logs, metrics
from ._operations import add_arguments, serve_metrics, setup_logs

NAMES = ("--log-format", "--metrics-port", "--metrics-bind")


def take(argv: list[str]) -> tuple[list[str], argparse.Namespace]:
    """``argv`` without the operations options (those before the training script), and their values (with the
    node's ``host`` and the ``job``: the rendezvous id, when given)."""
    from ..elastic.launcher import parser

    ours = argparse.ArgumentParser(add_help=False)
    add_arguments(ours)
    full = parser()
    add_arguments(full)
    ns = full.parse_args(argv)  # argparse's usage errors exit 2 with one line, as the launcher's do
    boundary = len(argv) - len(ns.training_script_args) - 1
    rest, mine, i = [], [], 0
    while i < boundary:
        token = argv[i]
        if token.split("=", 1)[0] in NAMES:
            taken = 1 if "=" in token else 2
            mine += argv[i:i + taken]
            i += taken
        else:
            rest.append(token)
            i += 1
    options = ours.parse_args(mine)
    options.host = ns.host
    options.job = logs.job_name(ns.rdzv_id)
    return rest + argv[boundary:], options


def start(options: argparse.Namespace) -> None:
    """Set up this process's logs and metrics; tell the workers (their environment) where theirs go."""
    setup_logs(options, host=options.host, job=options.job)
    port = serve_metrics(options, metrics.run_registry(options.host))
    if port is not None:
        os.environ[metrics.PORT_ENV] = str(port + 1)
        os.environ[metrics.BIND_ENV] = options.metrics_bind

