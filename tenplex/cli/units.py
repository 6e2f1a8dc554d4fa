"""Human-readable units for command-line output. May import: the standard library only."""


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
