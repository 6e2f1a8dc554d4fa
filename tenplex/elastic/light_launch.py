"""``tenplex run --in-place`` without torchrun: its command line read without torch, and the node's workers
under :class:`~tenplex.elastic.supervisor.Supervisor`.

May import: ``tenplex.ops`` (its lines), ``.launcher`` (its spec, option readers, the store and the workers'
environment), ``.inplace_launch`` (the in-place environment), ``.supervisor`` and the standard library. No torch.

When every option is one that in place needs (:data:`LIGHT_OPTIONS`), ``tenplex run --in-place`` neither imports
torch nor runs torchrun: its own supervisor starts and watches the node's workers, with the environment, restarts
and exit codes of :mod:`.inplace_launch`'s torchrun ``--standalone``. Any other torchrun option (``--log-dir``,
``--nproc-per-node gpu``…) keeps torchrun (:func:`parse_light` returns None).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from .inplace_launch import _RENDEZVOUS, local_argv


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
