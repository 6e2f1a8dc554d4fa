"""``tenplex run``: one per node. Start or reuse the node's store, then run torchrun's elastic agent.

May import: every tenplex layer.

    tenplex run --host NAME --store-root DIR [torchrun options] script.py [args]

Everything after ``run`` is parsed by :func:`tenplex.elastic.launcher.parse`
(torchrun's own parser plus tenplex's options), so torchrun options that
tenplex does not know pass through unchanged; ``tenplex run --help`` lists both.

With ``--in-place`` and only the torchrun options that in place needs, no torch and no torchrun: the node's
workers start at once under :mod:`tenplex.elastic.supervisor`
(:func:`tenplex.elastic.light_launch.parse_light`). With other torchrun options, ``--in-place`` keeps
torchrun ``--standalone``, and the node's store starts at once, in a thread, while this
process imports torch for the launcher (a few seconds on a busy machine): the
launcher then finds it serving (or still starting: it waits on the store's
lock) instead of starting it after the import.
"""

from __future__ import annotations

import argparse
import logging
import os
import threading

from ..ops import logs
from . import _run_operations
from ._operations import add_arguments

log = logging.getLogger(__name__)


def register(subparsers: argparse._SubParsersAction) -> None:
    # No option prefix: every token after `run` reaches the launcher's parser untouched.
    parser = subparsers.add_parser("run", help="run torchrun's elastic agent on this node, with its tenplex store",
                                   prefix_chars="\x00", add_help=False)
    parser.add_argument("argv", nargs=argparse.REMAINDER)
    parser.set_defaults(handler=_run)


def _run(args) -> int:
    from ..elastic.light_launch import parse_light, run_supervised

    # TENPLEX_IN_PLACE_TORCHRUN=1 keeps torchrun --standalone as each node's supervisor (the way before it)
    torchrun = os.environ.get("TENPLEX_IN_PLACE_TORCHRUN", "") not in ("", "0")
    light = None if torchrun else parse_light(args.argv, add_arguments, _run_operations.NAMES)
    if light is not None:  # in place with nothing torchrun must do: no torch here, no torchrun
        from ..elastic.launcher import _given

        spec, ns, nproc, max_restarts = light
        ns.host, ns.job = spec.host, logs.job_name(_given(spec.torchrun, "--rdzv-id", "--rdzv_id"))
        _run_operations.start(ns)
        return run_supervised(spec, nproc, max_restarts)
    return _run_torchrun(args)


def _run_torchrun(args) -> int:
    from ..elastic.launcher import run

    early = _store_early(args.argv)  # before anything imports torch (the operations' parser does)
    argv, operations = _run_operations.take(args.argv)
    _run_operations.start(operations)
    if early is not None:
        _undo_if_misread(argv, *early)
    try:
        return run(argv)
    finally:
        if early is not None:
            early[1].join()


def _undo_if_misread(argv: list[str], spec, thread: threading.Thread) -> None:
    """Stop the store started early when torch's parser reads the store's options otherwise (a script argument
    that looked like one of them): the launcher then starts the right one."""
    from ..elastic.launcher import parse, stop_store

    try:
        real = parse(argv)
    except Exception:  # noqa: BLE001 -- the launcher reports it; the early store must not outlive the mistake
        real = None
    same = real is not None and all(getattr(real, f) == getattr(spec, f) for f in
                                    ("host", "store_root", "store_bind", "store_advertise", "token_file"))
    if not same:
        thread.join()
        stop_store(spec.store_root)


def _store_options(argv: list[str]):
    """The node store's options read without torch's parser (None without ``--in-place``, or with ``--dataset``:
    the launcher checks the dataset before it starts anything)."""
    from ..elastic.launcher import RunSpec

    p = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    for name in ("--host", "--store-root", "--store-bind", "--store-advertise", "--token-file", "--dataset"):
        p.add_argument(name)
    p.add_argument("--in-place", action="store_true")
    ns, _ = p.parse_known_args(argv)
    if not ns.in_place or ns.dataset is not None or not ns.host or not ns.store_root:
        return None
    from pathlib import Path

    return RunSpec(ns.host, Path(ns.store_root), ns.store_bind or "127.0.0.1", ns.store_advertise,
                   Path(ns.token_file) if ns.token_file else None)


def _store_early(argv: list[str]):
    """(the store's options, the thread) that starts (or reuses) the node's store while the launcher imports
    torch (``--in-place``); None when not early."""
    try:
        spec = _store_options(argv)
    except SystemExit:  # a malformed command line: the launcher's parser says what is wrong
        return None
    if spec is None:
        return None

    def start() -> None:
        from ..elastic.launcher import ensure_store

        try:
            token = spec.token_file.read_text().strip() if spec.token_file else None
            ensure_store(spec, token)
        except Exception as e:  # noqa: BLE001 -- the launcher starts it again and reports the error itself
            log.debug("the early store start failed (%s: %s); the launcher retries", type(e).__name__, e)

    thread = threading.Thread(target=start, name="tenplex-store-start", daemon=True)
    thread.start()
    return spec, thread
