"""Units on the command line: human-readable sizes in output, TCP ports in options. May import: the standard library
only."""

import argparse


def human_bytes(n: int) -> str:
    """``1536`` -> ``'1.5 KiB'``."""
    if abs(n) < 1024:
        return f"{n} B"
    value = float(n)
    for unit in ("KiB", "MiB", "GiB", "TiB"):  # noqa: B007 -- the unit the loop stops at is the answer
        value /= 1024
        if abs(value) < 1024:
            break
    return f"{value:.1f} {unit}"


def tcp_port(text: str) -> int:
    """An argparse type: a TCP port, 0-65535 (0: any free port)."""
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a TCP port: use 0-65535 (0: any free port)")
    return port
