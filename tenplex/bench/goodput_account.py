"""The accounting of ``tenplex bench goodput``: what the workers recorded, turned into goodput, pauses and losses.

May import: the standard library only. Pure apart from reading the record folder.

Each rank records every step it finished (``step``: its world, its share ``n`` of the global batch, the number of
data-parallel ranks ``dp``, its local mean loss). An **attempt** is one world's records of one step; it is
*complete* when all ``dp`` ranks recorded it and their shares add up to the global batch, or when a rank recorded
that its group committed it (torchft: a participant may die between the commit and its record; the step's loss is
then unknown); an incomplete one was cut short by a failure (``cut_short``, not counted). The **final** attempt of a
step is the last complete one (a step trained again after a rollback replaces the lost attempt); its loss is the
shares' weighted mean, compared with the reference run's.

* ``goodput`` = steps x step time / wall time, the step time being the emulated accelerator time (``--step-ms``):
  the ideal is the same steps with no events and no other cost, ``ideal_s`` = steps x step time; the wall time
  runs from the launch of the first node to the last step.
* Per event (at the time it was set off): ``before``, the highest step recorded by the worlds that existed then
  (they may finish a step or two after it); ``new_world``, the first world that recorded a step after the event and
  was not seen before it; ``resumed``, the step that world continued from (its first step minus one); ``steps_lost``
  = ``before`` - ``resumed`` (steps trained again), ``pause_s`` = the longest time without a finished step between
  the event and the new world's first step (the job's stall: a peer whose survivors train on while a joining replica
  starts stalls only while the quorum changes), ``regain_s`` = from the event to the first step beyond ``before``
  (the time until the job is as far as it was). No new world (the event came after the end): all null.
* ``startup``: where the start-up went, in seconds after the launch: each phase's median over the first world's
  ranks (``process``: the worker process started; ``imported``: torch and the job's modules imported; ``job``:
  tenplex's Job created; ``registered``/``formed``: in place, registered as warm and formed its first world;
  ``started``: restored and about to step) and ``first_step``, the first world's first step.
* ``bytes_read``: what the restores and heals read (from checkpoint storage, the stores or a peer), as the ranks
  recorded it.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

LOSS_TOLERANCE = 1e-4   # DDP: the same global batch in shares sums in another order


def read_records(folder: Path) -> list[dict]:
    docs = []
    for path in sorted(folder.glob("rank-*.jsonl")):
        for line in path.read_text().splitlines():
            if line.strip():
                try:
                    docs.append(json.loads(line))
                except json.JSONDecodeError:
                    pass  # the last line of a rank killed while writing it
    return docs


def attempts(docs: list[dict], global_batch: int) -> list[dict]:
    """Every (world, step) attempt, in the order of its time (its last rank's record)."""
    groups: dict[tuple[str, int], list[dict]] = {}
    for d in docs:
        if d["event"] == "step":
            groups.setdefault((d["world"], d["step"]), []).append(d)
    out = []
    for (world, step), ds in groups.items():
        n = sum(d["n"] for d in ds)
        whole = len(ds) == ds[0]["dp"] and n == global_batch
        out.append({"world": world, "step": step, "time": max(d["time"] for d in ds),
                    "first": min(d["time"] for d in ds),
                    "loss": sum(d["loss"] * d["n"] for d in ds) / n if whole else None,
                    "complete": whole or any(d.get("committed") for d in ds)})
    return sorted(out, key=lambda a: a["time"])


def finals(tries: list[dict]) -> dict[int, dict]:
    """step -> its last complete attempt (an incomplete one is a step that a failure cut short)."""
    history: dict[int, dict] = {}
    for a in tries:  # in time order: a later attempt of a step replaces an earlier one
        if a["complete"]:
            history[a["step"]] = a
    return dict(sorted(history.items()))


def event_costs(tries: list[dict], fired: list[dict]) -> list[dict]:
    """Per event: ``before``, ``resumed``, ``steps_lost``, ``pause_s`` and ``regain_s`` (module docstring)."""
    first_seen: dict[str, float] = {}
    for a in tries:  # a world is seen from its first rank's first record
        first_seen[a["world"]] = min(a["first"], first_seen.get(a["world"], a["first"]))
    out = []
    for f in fired:
        t = f["time"]
        old = {w for w, s in first_seen.items() if s <= t}
        before = max((a["step"] for a in tries if a["world"] in old), default=0)
        new = [a for a in tries if a["time"] > t and a["world"] not in old]
        cost = dict(f, before=before, new_world=None, resumed=None, steps_lost=None, pause_s=None, regain_s=None)
        if new:
            world = new[0]["world"]
            resumed = min(a["step"] for a in new if a["world"] == world) - 1
            beyond = [a["time"] for a in tries if a["time"] > t and a["step"] > before]
            cost.update(new_world=world, resumed=resumed, steps_lost=max(0, before - resumed),
                        pause_s=round(_stall(tries, t, new[0]["time"]), 3),
                        regain_s=round(beyond[0] - t, 3) if beyond else None)
        out.append(cost)
    return out


def _stall(tries: list[dict], t: float, until: float) -> float:
    """The longest time without a finished step from the event at ``t`` to the new world's first step."""
    times = [t] + [a["time"] for a in tries if t < a["time"] <= until]
    before = [a["time"] for a in tries if a["time"] <= t]
    times[0] = max(before[-1], t) if before else t
    return max(b - a for a, b in zip(times, times[1:]))


def startup(docs: list[dict], first: dict | None, launched: float) -> dict | None:
    """The start-up phases of the first world's ranks (module docstring), medians after ``launched``."""
    if first is None:
        return None
    # the ranks that trained the first world's steps (a peer may name its start record's world otherwise)
    ranks = {(d.get("host"), d.get("pid")) for d in docs if d["event"] == "step" and d["world"] == first["world"]}
    earliest: dict[tuple, dict] = {}  # each of those ranks' first start record (in place, it has one per world)
    for d in docs:
        key = (d.get("host"), d.get("pid"))
        if d["event"] == "start" and (d.get("world") == first["world"] or key in ranks) and d.get("phases"):
            if key not in earliest or d["time"] < earliest[key]["time"]:
                earliest[key] = d
    starts = [d["phases"] for d in earliest.values()] or [{}]
    names = dict.fromkeys(name for p in starts for name in p)
    out = {n: round(statistics.median(p[n] for p in starts if n in p) - launched, 3) for n in names}
    return dict(out, first_step=round(first["time"] - launched, 3))


def compare_losses(history: dict[int, dict], reference: dict[int, float]) -> dict:
    """The final losses against the reference's; ``unknown``: steps whose shares were not all recorded."""
    diffs = [abs(a["loss"] - reference[s]) for s, a in history.items() if s in reference and a["loss"] is not None]
    unknown = sum(1 for a in history.values() if a["loss"] is None)
    worst = max(diffs, default=None)
    return {"max_abs_diff": worst, "tolerance": LOSS_TOLERANCE, "compared": len(diffs), "unknown": unknown,
            "equal": worst is not None and len(diffs) + unknown == len(reference) and worst <= LOSS_TOLERANCE}


def account(docs: list[dict], fired: list[dict], reference: dict[int, float], steps: int, step_s: float,
            launched: float, global_batch: int) -> dict:
    """The per-mode report (see the module docstring)."""
    every = attempts(docs, global_batch)
    last = min((a["time"] for a in every if a["step"] == steps and a["complete"]), default=None)
    every = [a for a in every if last is None or a["time"] <= last]  # the job is over at its last step
    tries = [a for a in every if a["complete"]]
    history = finals(tries)
    done = sorted(history) == list(range(1, steps + 1))
    end = max((a["time"] for a in history.values()), default=launched)
    wall = end - launched
    gaps = [b["time"] - a["time"] for a, b in zip(tries, tries[1:]) if b["step"] == a["step"] + 1
            and b["world"] == a["world"]]
    saves = [d for d in docs if d["event"] == "saved"]
    return {
        "finished": done,
        "steps": len(history),
        "attempts": len(tries),
        "replayed_steps": len(tries) - len(history),
        "cut_short": len(every) - len(tries),
        "wall_s": round(wall, 3),
        "ideal_s": round(steps * step_s, 3),
        "goodput": round(len(history) * step_s / wall, 4) if done and wall > 0 else None,
        "startup_s": round(tries[0]["time"] - launched, 3) if tries else None,
        "startup": startup(docs, tries[0] if tries else None, launched),
        "median_step_s": round(statistics.median(gaps), 4) if gaps else None,
        "worlds": len({a["world"] for a in tries}),
        "saves": len({d["step"] for d in saves}),
        "bytes_read": sum(d.get("bytes_read", 0) for d in docs if d["event"] in ("start", "heal")),
        "moved_bytes": sum(d.get("moved_bytes", 0) for d in docs if d["event"] == "start"),
        "losses": compare_losses(history, reference),
        "events": [dict(e, offset=round(e["time"] - launched, 3)) for e in event_costs(tries, fired)],
        "progress": [[round(a["time"] - launched, 3), a["step"]] for a in tries],
    }
