"""What the elastic demo's workers recorded, turned into worlds, events, the final history and the checks.

May import: ``tenplex.planner``, ``tenplex.layout``, ``tenplex.store`` (reading saved layouts),
numpy, safetensors (numpy API) and the standard library. No torch.

Each worker writes JSON lines (``examples/01-gpt-train/train.py --record``):
``start`` (its world's id, hosts, configuration, restored step, version,
restore time, data position), ``step`` (loss and the sample ids it read),
``saved`` (step, version, position) and ``exit``; ranks with dp = tp = 0
dump their pipeline stage's full parameters and Adam moments after every save
and after a restore (safetensors). Every rank records when it was in such a
dump (``dump``: a collective gather, the demo's own check): the time the
whole world spent in them within a pause is reported as ``checks_s`` and
is not part of ``pause_s`` (a job without the demo's checks does not pause
for it).

The **final history** takes each step from the last world that trained it (a
step trained again after a failure replaces the lost attempt).

A **partition** (a node cut off while its processes run on) adds one more
check: no world that started after the cut restored a version that the cut-off
node committed after it (a store's ``versions/N/manifest.json`` is written at
N's commit, so its time is the commit's) or that its ranks recorded as saved
after it.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

FORMAT = "tenplex.demo.elastic/1"
LOSS_TOLERANCE = 1e-4


@dataclass
class World:
    id: str
    hosts: list[str]
    size: int
    parallel: str
    restored_step: int | None
    version: int | None
    transformed: bool
    plan_stats: dict
    position: int
    start: float                      # earliest process start of its ranks
    ready: float                      # when its last rank had joined the process group and restored
    restore_s: float
    saved_version: int | None = None  # the version its restore read (before any transformation)
    read_through: bool = False        # its ranks read the plan's regions from the stores (no new version)
    files: dict[str, dict] = field(default_factory=dict)   # record file -> coords
    file_hosts: dict[str, str] = field(default_factory=dict)  # record file -> the host its rank ran on
    steps: dict[int, dict] = field(default_factory=dict)    # step -> {"loss": …, "ids": […]}
    saves: list[dict] = field(default_factory=list)
    exits: list[dict] = field(default_factory=list)
    ends: list[dict] = field(default_factory=list)          # in place: its ranks' "end" (the process went on)
    pids: dict[str, int] = field(default_factory=dict)      # device (HOST/LOCAL_RANK) -> the pid of its rank
    dumps: dict[str, list] = field(default_factory=dict)    # "saved-S"/"restored-S" -> each rank's [begin, end]

    def checks(self) -> list[tuple[float, float]]:
        """When this world was held up by the demo's own dumps, one span per dump every rank made: from the last
        rank's entry, as long as the shortest rank's dump took (a lower bound: a rank that waits in the dump's
        gather for a slower peer counts no longer than the quickest; pipeline stages gather apart)."""
        return [(max(b for b, _ in each), max(b for b, _ in each) + min(e - b for b, e in each))
                for each in self.dumps.values() if len(each) == len(self.files)]

    def describe(self) -> dict:
        return {"world": self.size, "hosts": self.hosts, "parallel": self.parallel}


def read_worlds(folder: Path) -> list[World]:
    """The worlds of a record folder, in the order they started."""
    docs = []
    for path in sorted(folder.glob("rank-*.jsonl")):
        docs += [dict(json.loads(line), file=path.name) for line in path.read_text().splitlines() if line.strip()]
    worlds: dict[str, World] = {}
    owner: dict[str, World] = {}
    for d in docs:
        if d["event"] != "start":
            continue
        w = worlds.get(d["world_id"])
        if w is None:
            w = worlds[d["world_id"]] = World(d["world_id"], d["hosts"], d["world"], d["parallel"], d["restored_step"],
                                              d["version"], d["transformed"], d["plan_stats"], d["position"],
                                              d["time"], d["ready"], d["restore_s"], d.get("saved_version"),
                                              d.get("read_through", False))
        w.start, w.ready = min(w.start, d["time"]), max(w.ready, d["ready"])
        w.restore_s = max(w.restore_s, d["restore_s"])
        w.files[d["file"]] = d["coords"]
        w.file_hosts[d["file"]] = d["host"]
        if "pid" in d:
            w.pids[d["device"]] = d["pid"]
        owner[d["file"]] = w
    for d in docs:
        w = owner.get(d["file"])
        if w is None:
            continue
        if d["event"] == "step":
            coords = w.files[d["file"]]
            entry = w.steps.setdefault(d["step"], {"loss": d["loss"], "ids": [], "time": d.get("time", 0.0)})
            entry["time"] = max(entry["time"], d.get("time", 0.0))  # finished once its last rank finished it
            if coords["tp"] == 0 and coords["pp"] == 0:  # each dp rank's share once (its tp/pp peers read the same)
                entry["ids"] += d["ids"]
        elif d["event"] == "saved":
            w.saves.append(d)
        elif d["event"] == "exit":
            w.exits.append(d)
        elif d["event"] == "end":
            w.ends.append(d)
        elif d["event"] == "dump":
            w.dumps.setdefault(d["what"], []).append((d["begin"], d["time"]))
    return sorted(worlds.values(), key=lambda w: w.start)


def final_history(worlds: list[World]) -> dict[int, dict]:
    """step -> the record of the last world that trained it."""
    history: dict[int, dict] = {}
    for w in worlds:  # in start order: later worlds overwrite replayed steps
        history.update(w.steps)
    return dict(sorted(history.items()))


def _dump(folder: Path, kind: str, step: int, world: World) -> dict[str, np.ndarray]:
    """The full state a world dumped after its save (kind "saved") or restore ("restored") of ``step``."""
    from safetensors.numpy import load_file

    tags = {f.removeprefix("rank-").removesuffix(".jsonl").split("-", 1)[1] for f in world.files}
    state: dict[str, np.ndarray] = {}
    for tag in sorted(tags):
        path = folder / "dumps" / f"{kind}-{step}-{tag}.safetensors"
        if path.exists():
            state.update(load_file(str(path)))
    return state


def _bit_exact(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> bool:
    return bool(a) and a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and a[k].shape == b[k].shape and a[k].tobytes() == b[k].tobytes() for k in a)


def saved_layout(roots: list[Path], version: int):
    """The layout of ``version`` from the first store under ``roots`` that holds it (None: none does)."""
    from ..store import Store

    for root in roots:
        if not root.is_dir():  # evicted (evict:all deletes every root): opening a Store would make it again
            continue
        try:
            return Store(root, root.name).open(version).layout()
        except Exception:  # noqa: BLE001 -- not on this host (or promoted elsewhere): try the next
            continue
    return None


def _bytes(world: World, roots: list[Path]) -> dict:
    """The plan's bytes for the change into ``world``: kept, within hosts, between hosts, and the lower bound."""
    from ..planner import plan

    stats = world.plan_stats
    if not stats and world.version is not None and world.saves:
        old, new = saved_layout(roots, world.version), saved_layout(roots, world.saves[0]["version"])
        if old is not None and new is not None:
            stats = asdict(plan(old, new).stats)
    return {"kept": stats.get("kept_bytes", 0), "intra_host": stats.get("intra_host_bytes", 0),
            "inter_host": stats.get("inter_host_bytes", 0),
            "inter_host_lower_bound": stats.get("inter_host_lower_bound", 0)}


def commits_after(root: Path, t: float) -> list[int]:
    """Versions the store at ``root`` committed after wall time ``t`` (a manifest is written at its commit; its
    mtime is the one thing read here past the store's interface)."""
    from ..store import Store

    return [v for v in Store(root, root.name).versions()
            if (root / "versions" / str(v) / "manifest.json").stat().st_mtime > t]


def _cut_off(host: str, cut: float, worlds: list[World], roots: list[Path]) -> dict:
    """What the node ``host``, cut off at ``cut``, committed afterwards, and what the others restored since."""
    root = next((r for r in roots if r.name == host), None)
    late = set(commits_after(root, cut)) if root is not None else set()
    late |= {s["version"] for w in worlds for s in w.saves if w.file_hosts.get(s["file"]) == host and s["time"] > cut}
    restored = {w.saved_version for w in worlds if w.start > cut and w.saved_version is not None}
    return {"commits_after_cut": sorted(late), "restored_after_cut": sorted(restored),
            "restored_from_cut_off": sorted(late & restored)}


def summarize(reference: Path, elastic: Path, events: list, fired: list[dict], roots: list[Path],
              after: list[list[str]]) -> tuple[dict, dict]:
    """The ``tenplex.demo.elastic/1`` summary (events with their times and bytes, the checks), and the
    loss histories and worlds behind it (for the plot)."""
    worlds, ref_worlds = read_worlds(elastic), read_worlds(reference)
    history, ref_history = final_history(worlds), final_history(ref_worlds)
    out_events, bit_exact, position_ok = [], True, True
    for e, f, hosts in zip(events, fired, after):
        row, exact, resumed_right = _event_row(e, f, hosts, worlds, elastic, roots)
        out_events.append(row)
        bit_exact &= exact
        position_ok &= resumed_right
    checks = _checks(history, ref_history, out_events, bit_exact, position_ok,
                     any(e.kind == "partition" for e in events))
    ok = (checks["loss_max_rel_diff"] <= LOSS_TOLERANCE and checks["samples_read_twice"] == 0
          and checks["samples_skipped"] == 0 and checks["state_bit_exact"] and checks["position_restored"]
          and checks.get("cut_off_saves_restored", 0) == 0 and all("error" not in e for e in out_events))
    summary = {"format": FORMAT, "ok": bool(ok), "events": out_events, "checks": checks,
               "saves": _saves(worlds)}
    # Attempts that a failure threw away (their steps were trained again after the restore).
    lost = [(s, h["loss"]) for w in worlds for s, h in w.steps.items() if history[s] is not h]
    return summary, {"elastic": {s: h["loss"] for s, h in history.items()},
                     "reference": {s: h["loss"] for s, h in ref_history.items()}, "lost": lost}


def _event_row(e, f: dict, hosts: list[str], worlds: list[World], elastic: Path,
               roots: list[Path]) -> tuple[dict, bool, bool]:
    """One event's summary row (``f``: when it fired; ``hosts``: the world expected after it), whether the
    state the next world restored equals the saved one bit for bit, and whether it resumed at the newest
    save's step and dataset position."""
    before = [w for w in worlds if w.start < f["time"]]
    source = before[-1] if before else None
    target = next((w for w in worlds if w.start > f["time"] and sorted(w.hosts) == hosts), None)
    if source is None or target is None:
        return {"kind": e.kind, "host": e.host, "at_step": f["step"], "error": "no world found"}, False, False
    between = [w for w in worlds if source.start <= w.start < target.start]
    reached = max((s for w in between for s in w.steps), default=0)
    resumed = target.restored_step or 0
    exits = [x["time"] for w in between for x in w.exits if x["time"] >= f["time"]]
    detected = min(exits) if exits else target.start
    # Newest save committed before the new world started: what it must resume from.
    saves = [s for w in worlds if w.start < target.start for s in w.saves if s["time"] < target.start]
    newest = max(saves, key=lambda s: (s["step"], s["time"]), default=None)
    if newest is None:  # nothing was committed yet (a failure before the first save): a fresh start is right
        resumed_right = target.restored_step is None and target.position == 0
    else:
        resumed_right = resumed == newest["step"] and target.position == newest["position"]
    exact = True
    if newest is not None:
        saver = next(w for w in worlds if newest in w.saves)
        exact = _bit_exact(_dump(elastic, "saved", newest["step"], saver), _dump(elastic, "restored", resumed, target))
    row = {"kind": e.kind, "host": e.host, "at_step": f["step"], "resumed_from_step": resumed,
           "lost_steps": max(0, reached - resumed), "from": source.describe(), "to": target.describe(),
           "detect_s": round(detected - f["time"], 3),
           "restart_s": round(target.ready - target.restore_s - detected, 3),
           "restore_s": round(target.restore_s, 3), "bytes": _bytes(target, roots),
           **_pause(e.kind, f["time"], between, target), "pids": _pids(source, target)}
    if e.kind == "partition":
        row["cut_off"] = _cut_off(e.host, f["time"], worlds, roots)
    if e.kind == "evict":
        resumed_right &= _evicted(row, f)
    return row, exact, resumed_right


def _pause(kind: str, fired: float, between: list[World], target: World) -> dict:
    """``pause_s``: from the old world's last step finished (or the event, if later: a failure strikes a world the
    demo holds between steps) to the new world's first step finished, and its parts, which add up to it:
    ``detect_s`` (a failure: until the old world's first rank stopped), ``agree_s`` (a planned change: the ranks
    agreeing and saving at the step boundary), ``re_form_s`` (to the new world formed, its model built: in
    restart mode the processes' restart), ``restore_s`` and ``first_step_s``. The time every rank spent in the
    demo's own state dumps within the window (``checks_s``) is taken off the part it fell in and off the pause."""
    last = max((h["time"] for w in between for h in w.steps.values()), default=fired)
    begin = max(last, fired)
    if not target.steps:
        return {"pause_s": None, "pause": None, "checks_s": None}
    first = target.steps[min(target.steps)]["time"]
    stopped = min((x["time"] for w in between for x in w.exits + w.ends if x["time"] >= begin), default=target.start)
    stopped = min(max(stopped, begin), target.ready - target.restore_s)
    planned = kind in ("join", "leave", "evict")
    formed = target.ready - target.restore_s
    spans = {"detect_s" if not planned else "agree_s": (begin, stopped), "re_form_s": (stopped, formed),
             "restore_s": (formed, target.ready), "first_step_s": (target.ready, first)}
    checks = [c for w in between + [target] for c in w.checks()]
    parts = {"detect_s": 0.0, "agree_s": 0.0}
    for key, (a, b) in spans.items():  # each part less the demo's own checks inside it
        parts[key] = (b - a) - sum(max(0.0, min(b, e) - max(a, s)) for s, e in checks)
    checks_s = sum(max(0.0, min(first, e) - max(begin, s)) for s, e in checks)
    return {"pause_s": round(first - begin - checks_s, 3), "pause": {k: round(v, 3) for k, v in parts.items()},
            "checks_s": round(checks_s, 3)}


def _pids(source: World, target: World) -> dict[str, dict]:
    """Each survivor's (a device in both worlds) pid before and after the change: equal when it kept its process."""
    both = sorted(source.pids.keys() & target.pids.keys())
    return {d: {"before": source.pids[d], "after": target.pids[d]} for d in both}


def _evicted(row: dict, f: dict) -> bool:
    """An eviction's row gets the newest durable save before it (``f["durable"]``: version and step); whether the
    new job resumed from it (nothing else was left)."""
    row["durable"] = f.get("durable")
    return row["durable"] is not None and row["resumed_from_step"] == row["durable"]["step"]


def _checks(history: dict, ref_history: dict, out_events: list[dict], bit_exact: bool, position_ok: bool,
            partitioned: bool) -> dict:
    """The run's checks: losses against the reference, every sample read exactly once, the restored state and
    position, and (after a partition) that no save of the cut-off side was restored."""
    losses = [(s, h["loss"], ref_history[s]["loss"]) for s, h in history.items() if s in ref_history]
    rel = max((abs(a - b) / max(abs(b), 1e-12) for _, a, b in losses), default=float("inf"))
    seen = [i for h in history.values() for i in h["ids"]]
    expected = {i for h in ref_history.values() for i in h["ids"]}
    counts: dict[int, int] = {}
    for i in seen:
        counts[i] = counts.get(i, 0) + 1
    checks = {"loss_max_rel_diff": rel if losses and len(history) == len(ref_history) else float("inf"),
              "samples_read_twice": sum(1 for n in counts.values() if n > 1),
              "samples_skipped": len(expected - set(counts)),
              "state_bit_exact": bool(bit_exact and out_events),
              "position_restored": bool(position_ok and out_events)}
    if partitioned:
        checks["cut_off_saves_restored"] = sum(len(row["cut_off"]["restored_from_cut_off"])
                                               for row in out_events if "cut_off" in row)
    return checks


def _saves(worlds: list[World]) -> dict:
    """How the job saved: saves per kind (snapshot, periodic, stopping, final, requested) and the largest
    replication lag in steps that a save reported (the newest snapshot minus the newest with committed copies)."""
    saves = [s for w in worlds for s in w.saves]
    kinds: dict[str, int] = {}
    for _version, why in {(s["version"], s.get("why", "periodic")) for s in saves}:  # every rank records each save
        kinds[why] = kinds.get(why, 0) + 1
    return {"count": sum(kinds.values()), "kinds": dict(sorted(kinds.items())),
            "max_replication_lag": max((s.get("replication_lag", 0) for s in saves), default=0)}


def print_timeline(summary: dict, say) -> None:
    for i, e in enumerate(summary["events"], 1):
        if "error" in e:
            say(f"{i}. {e['kind']} {e['host']} at step {e['at_step']}: {e['error']}")
            continue
        b = e["bytes"]
        say(f"{i}. {e['kind']:5s} {e['host']} at step {e['at_step']}: world {e['from']['world']} "
            f"({','.join(e['from']['hosts'])}; {e['from']['parallel']}) -> {e['to']['world']} "
            f"({','.join(e['to']['hosts'])}; {e['to']['parallel']})")
        say(f"   detect {e['detect_s']:.1f} s, restart {e['restart_s']:.1f} s, restore {e['restore_s']:.2f} s; "
            f"resumed from step {e['resumed_from_step']}, {e['lost_steps']} step(s) lost and replayed")
        if e.get("pause"):
            p, kept = e["pause"], sum(v["before"] == v["after"] for v in e["pids"].values())
            say(f"   pause {e['pause_s']:.2f} s (detect {p['detect_s']:.2f}, agree {p['agree_s']:.2f}, re-form "
                f"{p['re_form_s']:.2f}, restore {p['restore_s']:.2f}, first step {p['first_step_s']:.2f}; "
                f"not counted: {e['checks_s']:.2f} s of the demo's own state dumps); "
                f"{kept} of {len(e['pids'])} survivor(s) kept their process")
        say(f"   bytes: kept {b['kept']}, within hosts {b['intra_host']}, between hosts {b['inter_host']} "
            f"(lower bound {b['inter_host_lower_bound']})")
        if e.get("durable"):
            say(f"   every node and store lost; the new job restored durable version {e['durable']['version']} "
                f"(step {e['durable']['step']}) from the bucket")
        if "cut_off" in e:
            cut = e["cut_off"]
            say(f"   new world {e['detect_s'] + e['restart_s'] + e['restore_s']:.1f} s after the cut; {e['host']} "
                f"committed {cut['commits_after_cut'] or 'nothing'} after it; restored since: versions "
                f"{cut['restored_after_cut']}, of them from {e['host']} after the cut: "
                f"{cut['restored_from_cut_off'] or 'none'}")
    if "links" in summary:
        links = summary["links"]
        say(f"links ({links['mbit']:g} Mbit/s each way; kernel counters): " + ", ".join(
            f"{h} out {v['out']} B, in {v['in']} B" for h, v in links["hosts"].items()))
    saves = summary["saves"]
    say(f"saves: {saves['count']} ({', '.join(f'{n} {k}' for k, n in saves['kinds'].items())}); replication lag "
        f"at most {saves['max_replication_lag']} step(s)")
    c = summary["checks"]
    say(f"checks: losses vs reference max rel diff {c['loss_max_rel_diff']:.2e} (<= {LOSS_TOLERANCE:g}); samples "
        f"read twice {c['samples_read_twice']}, skipped {c['samples_skipped']}; restored state bit-exact "
        f"{c['state_bit_exact']}; step and position restored {c['position_restored']}"
        + (f"; saves of a cut-off node restored {c['cut_off_saves_restored']}" if "cut_off_saves_restored" in c
           else ""))
    say("OK" if summary["ok"] else "FAILED")


def plot(summary: dict, history: dict, path: Path) -> None:
    """Both loss curves and the events (PNG, matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    h = history
    fig, (ax, bars) = plt.subplots(2, 1, figsize=(9, 6.5), gridspec_kw={"height_ratios": [3, 1.4]})
    ref = sorted(h["reference"].items())
    ax.plot([s for s, _ in ref], [v for _, v in ref], color="black", lw=2.5, alpha=0.35,
            label="reference (uninterrupted)")
    el = sorted(h["elastic"].items())
    ax.plot([s for s, _ in el], [v for _, v in el], "o-", color="tab:blue", ms=4, lw=1, label="elastic (final history)")
    if h.get("lost"):
        ax.plot([s for s, _ in h["lost"]], [v for _, v in h["lost"]], "x", color="tab:red", ms=7,
                label="lost with a failed node, then replayed")
    for e in summary["events"]:
        color = {"join": "tab:green", "fail": "tab:red", "leave": "tab:orange", "partition": "tab:purple",
                 "gpufail": "tab:brown", "evict": "tab:olive"}[e["kind"]]
        ax.axvline(e["at_step"] + 0.5, color=color, ls="--")
        label = f"{e['kind']} {e['host']}"
        if "to" in e:
            label += f"\n-> {e['to']['parallel']}"
        ax.text(e["at_step"] + 0.6, ax.get_ylim()[1], label, color=color, va="top", fontsize=8)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (global batch mean)")
    ax.set_title(f"tenplex demo --elastic: {'OK' if summary['ok'] else 'FAILED'}, max rel diff "
                 f"{summary['checks']['loss_max_rel_diff']:.1e}")
    ax.legend(loc="lower left")
    _plot_pauses(bars, summary)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


PAUSE_PARTS = (("detect_s", "detect", "tab:red"), ("agree_s", "agree + save", "tab:orange"),
               ("re_form_s", "re-form", "tab:blue"), ("restore_s", "restore", "tab:green"),
               ("first_step_s", "first step", "tab:gray"))


def _plot_pauses(ax, summary: dict) -> None:
    """Each event's pause as a bar of its parts (seconds), labelled with the survivors whose pid was kept."""
    rows = [e for e in summary["events"] if e.get("pause")]
    for y, e in enumerate(rows):
        left = 0.0
        for key, label, color in PAUSE_PARTS:
            width = max(0.0, e["pause"][key])
            ax.barh(y, width, left=left, color=color, label=label if y == 0 else None)
            left += width
        kept = sum(v["before"] == v["after"] for v in e["pids"].values())
        ax.text(left, y, f" {e['pause_s']:.2f} s, {kept}/{len(e['pids'])} pids kept", va="center", fontsize=8)
    ax.set_yticks(range(len(rows)), [f"{e['kind']} {e['host']}" for e in rows])
    ax.invert_yaxis()
    ax.set_xlim(0, 1.3 * max((e["pause_s"] for e in rows), default=1.0))  # room for the labels
    ax.set_xlabel(f"pause (s): last step of the old world to the first of the new ({summary.get('mode', '?')})")
    if rows:
        ax.legend(loc="lower center", bbox_to_anchor=(0.5, 1.0), fontsize=7, ncol=5, frameon=False)
