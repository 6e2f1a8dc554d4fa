"""Touch memory right before a timed step, so that every method starts with memory the machine has backed.

May import: numpy and the standard library.

The development machines are VMs whose host backs guest memory on first
touch and takes freed memory back within about half a minute (free page
reporting). Writing memory the host has not backed is several times slower
than writing memory just freed: a 4 GiB tmpfs file written in 4 MiB pieces
took 3.8 s into fresh memory, 1.6-2.3 s rewritten right after a delete, and
10.7 s for a second 4 GiB kept next to the first (2026-12-03; docs/performance.md
has the details). Every benchmark here writes gigabytes
of new tmpfs pages, so without care it times the hypervisor, by an amount
that depends on what ran in the half minute before. :func:`warm` allocates
and writes ``gib`` GiB and frees them again: the next step writes into memory
the host backs, as on a machine whose memory is its own. The benchmarks call
it before each timed step of every method alike, and before their baselines
(``--warm-gb``; 0: off).
"""

from __future__ import annotations

import argparse

import numpy as np


def add_warm_argument(parser: argparse.ArgumentParser, default: float | None = 0.0, default_help: str = "") -> None:
    """The ``--warm-gb`` option of every benchmark that calls :func:`warm` (``default_help`` says what a
    ``default`` of None means)."""
    parser.add_argument("--warm-gb", type=float, default=default,
                        help="write and free this many GiB right before each timed step (on a VM that backs memory "
                             f"on first touch, every method then starts with backed memory; 0: off{default_help})")


def warm(gib: float) -> None:
    """Write ``gib`` GiB of fresh memory and free it (nothing when ``gib`` <= 0)."""
    if gib > 0:
        block = np.ones(int(gib * (1 << 30)), np.uint8)  # writes every page
        del block
