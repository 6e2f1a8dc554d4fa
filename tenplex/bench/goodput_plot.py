"""The plot of ``tenplex bench goodput --plot``: each mode's steps over wall time, with the events marked.

May import: matplotlib (Agg backend) and the standard library.
"""

from __future__ import annotations

from pathlib import Path

MARKS = {"join": "^", "leave": "v", "fail": "x", "gpufail": "*"}


def plot(result: dict, path: Path) -> None:
    """One line per mode (every step attempt: a rollback shows as a drop), its events as markers on it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 5))
    for m in result["modes"]:
        if not m.get("progress"):
            continue
        t, step = zip(*m["progress"])
        (line,) = ax.plot(t, step, label=f"{m['mode']} (goodput {m['goodput'] or 0:.2f})", linewidth=1.2)
        for e in m["events"]:
            if e.get("reached") and e.get("offset") is not None:  # where the job was when the event came
                at = max((s for x, s in m["progress"] if x <= e["offset"]), default=0)
                ax.plot([e["offset"]], [at], MARKS[e["kind"]], color=line.get_color(), markersize=9)
    ideal = result["steps"] * result["step_ms"] / 1000
    ax.plot([0, ideal], [0, result["steps"]], ":", color="grey", label="ideal (no events, no overhead)")
    for kind, mark in MARKS.items():
        ax.plot([], [], mark, color="black", label=kind)
    ax.set_xlabel("wall time since launch (s)")
    ax.set_ylabel("step")
    ax.set_title(f"{result['steps']} steps of {result['step_ms']:g} ms under one trace ({len(result['trace'])} events)")
    ax.legend(loc="lower right", fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
