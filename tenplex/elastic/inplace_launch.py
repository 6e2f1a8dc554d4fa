"""``tenplex run --in-place``: each node's torchrun supervises only its own workers; the workers form the job's
worlds themselves (:mod:`tenplex.elastic.worlds`).

May import: ``tenplex.errors``, ``tenplex.ops`` (its lines), ``.launcher`` (its spec and option readers),
``.supervisor`` and the standard library (no torch: the launcher parses before torchrun loads).

torchrun's elastic agent stops and restarts every local worker on any membership change of its rendezvous, so
survivors cannot keep their processes while torchrun owns the cross-node world. In place, each node's torchrun
runs ``--standalone`` (a rendezvous of this node alone): it restarts its workers after a crash, counted against
``--max-restarts`` as before, and nothing else. The user's ``--rdzv-endpoint`` (a ``tenplex rendezvous serve``
store) and ``--rdzv-id`` go to the workers instead, with the smallest number of workers the first world waits for
(``--nnodes MIN`` times ``--nproc-per-node``).

Without torchrun (:func:`parse_light`, :func:`run_supervised`): when every option is one that in place needs (the
table :data:`LIGHT_OPTIONS`), ``tenplex run --in-place`` neither imports torch nor runs torchrun: its own
:class:`~tenplex.elastic.supervisor.Supervisor` starts and watches the node's workers, with the same
environment, restarts and exit codes. Any other torchrun option (``--log-dir``, ``--nproc-per-node gpu``…)
keeps torchrun ``--standalone`` as above.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from ..errors import ConfigError

# torchrun options that describe the cross-node rendezvous: in place, the workers' business, not torchrun's
_RENDEZVOUS = ("--rdzv-endpoint", "--rdzv_endpoint", "--rdzv-backend", "--rdzv_backend", "--rdzv-conf",
               "--rdzv_conf", "--rdzv-id", "--rdzv_id", "--nnodes", "--standalone")


def local_argv(options: list[str], given, without) -> tuple[list[str], dict[str, str]]:
    """(torchrun options for this node alone, the workers' in-place environment) from the user's options;
    ``given``/``without`` are the launcher's option readers."""
    endpoint = given(options, "--rdzv-endpoint", "--rdzv_endpoint")
    if not endpoint:
        raise ConfigError("tenplex run --in-place needs --rdzv-endpoint HOST:PORT of a rendezvous store that no "
                          "agent owns (start one with `tenplex rendezvous serve`): the workers form the worlds there")
    nnodes = given(options, "--nnodes") or "1"
    per_node = given(options, "--nproc-per-node", "--nproc_per_node") or "1"
    try:
        min_workers = int(nnodes.split(":")[0]) * int(per_node)
    except ValueError:
        raise ConfigError(f"--in-place needs numbers for --nnodes ({nnodes!r}) and --nproc-per-node "
                          f"({per_node!r})") from None
    env = {"TENPLEX_IN_PLACE": "1", "TENPLEX_RDZV_ENDPOINT": endpoint,
           "TENPLEX_RDZV_ID": given(options, "--rdzv-id", "--rdzv_id") or "none",
           "TENPLEX_MIN_WORKERS": str(min_workers)}
    return [*without(options, *_RENDEZVOUS), "--standalone"], env


# torchrun options that tenplex run --in-place handles without torchrun (option -> whether it takes a value):
# the cross-node rendezvous goes to the workers (above), --max-restarts to the supervisor, the rest is ignored as
# torchrun --standalone ignores it (--rdzv-backend, --rdzv-conf) or needs nothing of it here.
LIGHT_OPTIONS = {"--nnodes": True, "--nproc-per-node": True, "--nproc_per_node": True, "--max-restarts": True,
                 "--max_restarts": True, "--local-addr": True, "--local_addr": True, "--monitor-interval": True,
                 "--monitor_interval": True, "--standalone": False, "-m": False, "--module": False,
                 "--no-python": False, "--no_python": False, "--run-path": False, "--run_path": False,
                 **{name: True for name in _RENDEZVOUS if name != "--standalone"}}


class _Quiet(argparse.ArgumentParser):
    """Says nothing of a malformed line: the launcher's full parser reports it."""

    def error(self, message: str):
        raise SystemExit(2)


def light_parser(add_more=None) -> argparse.ArgumentParser:
    """``tenplex run``'s options and :data:`LIGHT_OPTIONS`, parsed without torch (``add_more(parser)`` adds the
    command line's own, e.g. its operations options)."""
    p = _Quiet(prog="tenplex run", add_help=False, allow_abbrev=False)
    p.add_argument("--host", required=True)
    p.add_argument("--store-root", required=True, type=Path)
    p.add_argument("--store-bind", default="127.0.0.1")
    p.add_argument("--store-advertise")
    for name in ("--token-file", "--dataset", "--data-mount"):
        p.add_argument(name, type=Path)
    p.add_argument("--durable")
    p.add_argument("--in-place", action="store_true")
    for name, valued in LIGHT_OPTIONS.items():
        dest = "light_" + name.lstrip("-").replace("-", "_")
        if valued:
            p.add_argument(name, dest=dest)
        else:
            p.add_argument(name, dest=dest, action="store_true")
    if add_more is not None:
        add_more(p)
    p.add_argument("training_script")
    p.add_argument("training_script_args", nargs=argparse.REMAINDER)
    return p


def parse_light(argv: list[str], add_more=None, skip: tuple[str, ...] = ()):
    """(the run's spec, the parsed options, the workers per node, --max-restarts) when ``argv`` is an in-place
    run that needs no torchrun; None otherwise (not --in-place, another torchrun option, a malformed line: the
    launcher's full parser handles and reports those). ``skip``: the options ``add_more`` added."""
    from .launcher import DEFAULT_MAX_RESTARTS, _given, spec_of

    if "--in-place" not in argv:
        return None
    try:
        ns, unknown = light_parser(add_more).parse_known_args(argv)
    except SystemExit:
        return None
    boundary = len(argv) - len(ns.training_script_args) - 1
    if unknown or not ns.in_place or boundary < 0 or argv[boundary] != ns.training_script:
        return None
    options = argv[:boundary]
    try:
        nproc = int(_given(options, "--nproc-per-node", "--nproc_per_node") or "1")
        restarts = int(_given(options, "--max-restarts", "--max_restarts") or DEFAULT_MAX_RESTARTS)
    except ValueError:
        return None  # "gpu", "auto": torchrun resolves them
    return spec_of(ns, options, skip), ns, nproc, restarts


def run_supervised(spec, nproc: int, max_restarts: int) -> int:
    """``tenplex run --in-place`` with this node's :class:`~tenplex.elastic.supervisor.Supervisor`, no torchrun."""
    import sys

    from ..ops import logs
    from .launcher import _given, _without, entry_command, prepare
    from .supervisor import Supervisor

    local_argv(spec.torchrun, _given, _without)  # the same checks as with torchrun (--rdzv-endpoint, numbers)
    address = prepare(spec)
    command = entry_command(spec)
    logs.line(f"tenplex run: host {spec.host}, store {address} ({spec.store_root}); {nproc} worker(s) in place, "
              f"supervised here (no torchrun): {' '.join(command)}", sys.stderr, logger=__name__)
    local_addr = _given(spec.torchrun, "--local-addr", "--local_addr") or "127.0.0.1"
    rdzv_id = _given(spec.torchrun, "--rdzv-id", "--rdzv_id") or "none"
    return Supervisor(spec.host, nproc, max_restarts, command, run_id=rdzv_id, local_addr=local_addr).run()
