"""``tenplex demo --elastic``: an elastic job on real torchrun agents, through joins, failures, leaves and partitions.

May import: ``tenplex.elastic.nodes``, ``.timeline`` and ``.evict`` (the bucket of ``evict:all``),
``tenplex.runtime`` (dataset, job launcher), ``tenplex.replication`` (is a save's copy complete?), ``tenplex.cluster``
(``link_mbit``: the emulated cluster), ``tenplex.errors`` and the standard library. No torch in
this process: the training runs in the workers (``examples/01-gpt-train/train.py``, shipped as
``tenplex/elastic/gpt_train/train.py``, through :class:`tenplex.elastic.Job`).

1. It packs the example dataset (exactly one epoch: ``steps`` global batches).
2. The **reference**: the same script trains every step uninterrupted on one
   node (2 workers), with the same initial weights and global batches.
3. The **elastic run**: a ``tenplex rendezvous serve`` process, and one
   ``tenplex run`` agent per simulated node (own store root, 2 workers each;
   ``h0`` and ``h1`` at first). Each event of the schedule happens when the job
   reaches its step: the workers wait at that step (the demo holds them with a
   file ``hold-STEP`` in the record folder) until the event is underway:

   * ``join:HOST@STEP``: a new ``tenplex run`` starts; torchrun stops the
     workers, which save at their next step boundary, and restarts them in the
     larger world;
   * ``fail:HOST@STEP``: SIGKILL of the node's process group and of its store;
     the survivors' next collective fails, they exit without saving, and the
     next world restores the newest version (the job snapshots every step:
     ``save_every=1``, staged at the boundary, committed and copied in the
     background) the survivors can assemble
     completely (from data-parallel copies or replicated ones), replaying the
     steps after it on the same global batches;
   * ``leave:HOST@STEP``: SIGTERM to the node's agent: the ranks agree at the
     next step boundary, save, and the others continue without it;
   * ``gpufail:HOST/DEVICE@STEP``: the worker on that device of the node
     fails with a device fault at the step boundary after STEP
     (``TENPLEX_INJECT_DEVICE_FAULT``, raised as torch raises a CUDA error);
     its agent excludes the device and re-joins with one worker fewer, the
     others' collectives fail, and the next world (the same nodes, one rank
     fewer) restores as after a failure;
   * ``partition:HOST@STEP`` (only with ``link_mbit``): the node's link is
     cut while its agent, store and workers keep running. No connection is
     reset, so every collective that waits on the node gives up after the
     job's collective timeout (:data:`LINKED_TIMEOUT_S`); the survivors form a
     new world without it and restore as after a failure. The cut-off node
     cannot reach the others or the rendezvous: its workers time out as well,
     and its agent gives up its rendezvous and exits (``nodes.LINKED_RDZV_CONF``);
   * ``evict:all@STEP`` (on loopback): the whole job is lost. Every node has
     flushed its saves to a bucket (moto's S3 server on loopback); once the save
     of the step is durable, every node is killed and its store root deleted,
     and a new job on three new nodes restores from the bucket (:mod:`.evict`).

   With ``link_mbit`` every node runs in a network namespace of its own, with a
   link of that many Mbit/s in each direction (:class:`tenplex.cluster.EmulatedCluster`),
   and the rendezvous store in the cluster's control namespace; the kernel's
   counters give each host's bytes in and out.

   **In place** (the default, :func:`run`'s ``in_place``; not for partitions, evictions or ``link_mbit``,
   :func:`restart_only`) every node runs ``tenplex run --in-place`` and the example loops over
   ``job.worlds()``: the survivors keep their processes and build the model of the next world in them. A join
   or a leave ends the world at the next step boundary (the held workers go on to it once the change is
   wanted), a failure ends it at the collective that failed, and a GPU fault ends that worker's process
   alone: its agent drops the device, the node's other worker stays (:mod:`tenplex.elastic.restarts`).

4. :mod:`.timeline` reads what every worker recorded and checks it; per event it reports the pause (the old
   world's last step, or the event if later, to the new world's first step) with its parts, and each
   survivor's pid before and after.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from ..errors import ConfigError, TenplexError
from .evict import demo_bucket, fresh_hosts, require_moto
from .nodes import Nodes

if TYPE_CHECKING:
    from ..cluster import Counters, EmulatedCluster

# examples/01-gpt-train/train.py as the package ships it: an installed tenplex has no examples/ folder
EXAMPLE = Path(__file__).resolve().parent / "gpt_train" / "train.py"
DEFAULT_SCHEDULE = "join:h2@4,fail:h1@8,leave:h2@12"
GLOBAL_BATCH = 12    # dp 1, 2 and 3 (one to three nodes of tp=2) all divide it into whole micro-batches
KINDS = ("join", "fail", "leave", "gpufail", "partition", "evict")
WORKERS_PER_NODE = 2
# How long a collective waits for a peer on links: a cut-off peer sends no reset, so this is how soon the others
# notice a partition. Ample for this job's longest legitimate wait (a restore that transforms the tiny GPT).
LINKED_TIMEOUT_S = 15.0
# Point-to-point receives (the pipeline's) wait without a timeout in gloo: a rank blocked on a cut-off peer is
# freed only when its host gives up retransmitting to that peer, after about 6 s with 4 retries (Linux: 15, about
# 15 minutes). Its exit then breaks its connections to the others, who were waiting on it.
LINKED_TCP_RETRIES = 4
SNAPSHOT_WAIT_S = 15.0  # a staged snapshot is recorded within a second here; past this, kill anyway
# A save's copies take a second or two here; a minute means the replication failed (its log says why).
REPLICATION_WAIT_S = 60.0
# Three nodes run a pipeline with one stage per node: losing one loses the only data-parallel copy of its
# stage, which only the replicated copies (tenplex.replication) bring back. Three ranks (a node of two and one
# with a failed GPU) train dp=3, so that every device trains (unpinned, tp=2 would leave the lone worker idle,
# which the example's Trainer runs too: its mesh spans the training ranks).
DEFAULT_PINS = {6: "tp=2,pp=3", 3: "tp=1,pp=1"}


class DemoError(TenplexError, RuntimeError):
    """The elastic demo could not run its schedule (the message says what and points to the logs)."""


@dataclass(frozen=True)
class Event:
    kind: str
    host: str
    at: int


def parse_schedule(text: str, initial: tuple[str, ...], steps: int, links: bool = False) -> list[Event]:
    """``"join:h2@4,fail:h1@8,leave:h2@12"`` -> events, checked against the nodes that run at each point
    (``links``: the nodes have network links of their own, which a partition needs)."""
    events: list[Event] = []
    running, cut, used = list(initial), set(), set(initial)
    failed: dict[str, set[str]] = {}  # node -> its failed devices
    for item in filter(None, (s.strip() for s in text.split(","))):
        m = re.fullmatch(r"(\w+):([A-Za-z0-9_-]+(?:/\d+)?)@(\d+)", item)
        if not m or m.group(1) not in KINDS or ("/" in m.group(2)) != (m.group(1) == "gpufail"):
            raise ConfigError(f"schedule item {item!r} is not KIND:HOST@STEP with KIND one of {', '.join(KINDS)} "
                              f"(e.g. join:h2@4), or gpufail:HOST/DEVICE@STEP")
        event = Event(m.group(1), m.group(2), int(m.group(3)))
        if events and event.at <= events[-1].at:
            raise ConfigError(f"schedule item {item!r}: steps must increase (the previous event is at step "
                              f"{events[-1].at})")
        if not 1 <= event.at < steps:
            raise ConfigError(f"schedule item {item!r}: the step must be within 1..{steps - 1} (the job trains "
                              f"{steps} steps)")
        if event.kind == "partition" and not links:
            raise ConfigError(f"schedule item {item!r}: a partition cuts a node's network link; give --link-mbit N "
                              f"so that every node has one")
        if event.kind == "evict":
            running = _check_evict(item, event, links, used)
            used |= set(running)
        elif event.kind == "gpufail":
            node, device = event.host.split("/")
            if node not in running:
                raise ConfigError(f"schedule item {item!r}: {node} is not running then ({', '.join(running)})")
            lost = failed.setdefault(node, set())
            if int(device) >= WORKERS_PER_NODE or device in lost:
                raise ConfigError(f"schedule item {item!r}: {node} has devices 0..{WORKERS_PER_NODE - 1}, of "
                                  f"which {', '.join(sorted(lost)) or 'none'} failed before")
            if len(lost) + 1 == WORKERS_PER_NODE:
                raise ConfigError(f"schedule item {item!r}: that is {node}'s last device; use fail:{node}@{event.at}")
            lost.add(device)
        elif event.kind == "join":
            if event.host in running:
                raise ConfigError(f"schedule item {item!r}: {event.host} is already running")
            if event.host in cut:
                raise ConfigError(f"schedule item {item!r}: {event.host} was cut off and its processes may still "
                                  f"run; join a new host instead")
            running.append(event.host)
            failed.pop(event.host, None)  # a new node
            used.add(event.host)
        else:
            if event.host not in running:
                raise ConfigError(f"schedule item {item!r}: {event.host} is not running then ({', '.join(running)})")
            if len(running) == 1:
                raise ConfigError(f"schedule item {item!r}: {event.host} is the last node; the job would stop")
            running.remove(event.host)
            if event.kind == "partition":
                cut.add(event.host)
        events.append(event)
    return events


def _check_evict(item: str, event: Event, links: bool, used: set[str]) -> list[str]:
    """An eviction's nodes afterwards (new ones), or a one-line error."""
    if event.host != "all":
        raise ConfigError(f"schedule item {item!r}: an eviction loses the whole job: evict:all@STEP")
    if links:
        raise ConfigError(f"schedule item {item!r}: evict:all keeps its bucket on loopback; run it without "
                          f"--link-mbit")
    return fresh_hosts(used)


def expected_hosts(initial: tuple[str, ...], events: list[Event]) -> list[list[str]]:
    """The nodes after each event (the world torchrun forms then)."""
    running, used, after = list(initial), set(initial), []
    for e in events:
        if e.kind == "evict":
            running = fresh_hosts(used)
        elif e.kind != "gpufail":  # a node with a failed device goes on
            running = running + [e.host] if e.kind == "join" else [h for h in running if h != e.host]
        used |= set(running)
        after.append(sorted(running))
    return after


def every_host(initial: tuple[str, ...], events: list[Event]) -> list[str]:
    """Every node that runs at some point."""
    return sorted(set(initial).union(*expected_hosts(initial, events)))


def _script(data: Path, steps: int, record: Path, save_every: int, pins: dict[int, str],
            timeout: float | None = None) -> list[str]:
    return [str(EXAMPLE), "--data", str(data), "--steps", str(steps), "--record", str(record),
            "--global-batch", str(GLOBAL_BATCH), "--save-every", str(save_every), "--keep-versions", "1000",
            *(f"--pin={world}:{spec}" for world, spec in sorted(pins.items())),
            *(["--timeout", str(timeout)] if timeout is not None else [])]


def run_reference(workdir: Path, data: Path, steps: int, say: Callable[[str], None]) -> Path:
    """The uninterrupted run: one node, 2 workers, every step; returns its record folder."""
    from ..runtime.launch import run_job

    record = workdir / "reference" / "record"
    record.mkdir(parents=True)
    say(f"reference: {steps} steps on one node without interruption")
    run_job([sys.executable, *_script(data, steps, record, save_every=0, pins={})], ["h0/0", "h0/1"],
            {"h0": workdir / "reference" / "h0"}, {}, workdir / "reference" / "logs", timeout=600)
    return record


def _records(folder: Path) -> list[dict]:
    docs = []
    for path in sorted(folder.glob("rank-*.jsonl")):
        for line in path.read_text().splitlines():
            if line.strip():
                docs.append(dict(json.loads(line), file=path.name))
    return docs


def run_elastic(workdir: Path, data: Path, steps: int, events: list[Event], initial: tuple[str, ...],
                save_every: int, pins: dict[int, str], say: Callable[[str], None],
                timeout: float = 900.0, cluster: "EmulatedCluster | None" = None, fuse: bool = False,
                script: list[str] | None = None, in_place: bool = False) -> tuple[Path, list[dict]]:
    """The elastic run (with ``cluster``: each node in its own network namespace; with ``fuse``: each node's
    workers read through its FUSE view of ``data``; ``script``: another worker program; ``in_place``: ``tenplex
    run --in-place``, the survivors keep their processes); returns its record folder and when each event was set
    off (wall time)."""
    record = workdir / "elastic" / "record"
    record.mkdir(parents=True)
    for e in events:
        (record / f"hold-{e.at}").touch()
    after = expected_hosts(initial, events)
    fired: list[dict] = []
    deadline = time.monotonic() + timeout
    env = dict(os.environ, OMP_NUM_THREADS="1")
    gpufails = [f"{e.host}@{e.at}" for e in events if e.kind == "gpufail"]
    if gpufails:  # every node gets it; only the named device's worker fails (tenplex.elastic.faults)
        env["TENPLEX_INJECT_DEVICE_FAULT"] = ",".join(gpufails)
    max_nodes = len(every_host(initial, events))
    script = script or _script(data, steps, record, save_every, pins,
                               LINKED_TIMEOUT_S if cluster is not None else None)
    # In place the first world waits for every initial node (later ones go on with the survivors); torchrun's
    # rendezvous gathers them by its last call instead, and its minimum must let one node go on alone.
    with Nodes(workdir / "elastic", WORKERS_PER_NODE, max_nodes, script, env, cluster,
               dataset=data if fuse else None, run_options=("--in-place",) if in_place else (),
               min_nodes=len(initial) if in_place else 1) as nodes:
        before = cluster.counters() if cluster is not None else None
        nodes.start_rendezvous()
        for host in initial:
            nodes.start(host)
        say(f"elastic run ({'in place' if in_place else 'restart mode'}): nodes {', '.join(initial)} (2 workers "
            f"each) join the rendezvous at {nodes.endpoint}")
        progress = _Progress(record, say)
        for i, e in enumerate(events):
            at = _await_event(progress, nodes, e, sorted(initial) if i == 0 else after[i - 1], deadline, save_every)
            durable = _await_durable(progress, nodes, at) if e.kind == "evict" else None
            say(f"event {i + 1}: {e.kind} {e.host} at step {at}")
            fired.append({"time": time.time(), "step": at, **({"durable": durable} if durable else {})})
            _set_off(nodes, e, record, after[i])
            _wait(lambda: progress.update() and progress.world_after(fired[-1]["time"], after[i]),  # noqa: B023
                  deadline, nodes,
                  f"a world of {', '.join(after[i])} after the {e.kind}")
            (record / f"hold-{e.at}").unlink(missing_ok=True)
        # A cut-off node is not waited for by anyone, but it must end by itself: its agent gives up its rendezvous.
        _wait(lambda: progress.update() and not nodes.running(), deadline, nodes, f"the job to reach step {steps}")
        codes = nodes.wait(0)
        if fuse:
            _write_views(workdir / "elastic" / "views.json", nodes)
        if cluster is not None and before is not None:
            _write_links(workdir / "elastic" / "links.json", cluster, cluster.counters() - before)
    _write_outcome(workdir / "elastic", fired, codes, nodes.partitioned)
    return record, fired


def _await_event(progress: "_Progress", nodes: Nodes, e: Event, wanted: list[str], deadline: float,
                 save_every: int = 0) -> int | None:
    """Wait until the job reaches event ``e``'s step on the nodes ``wanted`` (before a failure or a partition,
    also until the newest save's copies exist); return the step it reached."""
    _wait(lambda: progress.update() and progress.reached(e.at, wanted) is not None, deadline, nodes,
          f"the job to reach step {e.at} on {', '.join(wanted)}")
    at = progress.reached(e.at, wanted)  # e.at, unless a restart carried the job past its hold
    if e.kind == "fail" and save_every == 1 and at is not None:
        # A worker records its step before the step boundary that snapshots it: with a snapshot every step, give
        # the snapshot of the step reached a moment to be recorded, so that the node is killed after it, as the
        # job holds there (without it, the survivors may resume one step earlier: still at most one step lost).
        settle = min(deadline, time.monotonic() + SNAPSHOT_WAIT_S)
        while not any(d["event"] == "saved" and d["step"] >= at for d in progress.docs) and time.monotonic() < settle:
            time.sleep(0.1)
            progress.update()
    if e.kind in ("fail", "gpufail", "partition"):
        # The survivors resume from the newest save only once its copies exist: wait for the background
        # replication, so that the checks know which save the next world must restore.
        newest = max((d["version"] for d in progress.docs if d["event"] == "saved"), default=None)
        _wait(lambda: newest is None or _replicated(nodes, newest),
              min(deadline, time.monotonic() + REPLICATION_WAIT_S), nodes, f"the copies of version {newest}")
    return at


def _await_durable(progress: "_Progress", nodes: Nodes, at: int | None) -> dict:
    """Before an eviction: wait until the save of step ``at`` is in the bucket; its version and step."""
    from .evict import wait_durable

    def saves() -> list[dict]:
        progress.update()
        return [d for d in progress.docs if d["event"] == "saved"]

    try:
        return wait_durable(saves, at or 0, lambda: bool(nodes.running()))
    except TimeoutError as e:
        raise DemoError(f"{e}; logs: {nodes.base}/agent-*.log") from None


def _set_off(nodes: Nodes, e: Event, record: Path, hosts: list[str]) -> None:
    """Make event ``e`` happen to its node (``hosts``: the nodes after it)."""
    if e.kind == "evict":
        nodes.evict_all()
        for host in hosts:
            nodes.start(host)
    elif e.kind == "join":
        nodes.start(e.host)
    elif e.kind == "fail":
        nodes.fail(e.host)
    elif e.kind == "partition":
        nodes.partition(e.host)
    elif e.kind == "gpufail":
        pass  # the worker fails by itself once the hold is lifted (TENPLEX_INJECT_DEVICE_FAULT)
    else:
        nodes.leave(e.host)
    if e.kind != "join":
        # The survivors go on (and find out), the leaving node's ranks save with them.
        (record / f"hold-{e.at}").unlink()


def _write_views(path: Path, nodes: Nodes) -> None:
    """How often each node's dataset view was switched (a failed node's view died with it: null)."""
    from .dataview import switches

    path.write_text(json.dumps({h: switches(nodes.view(h)) for h in sorted(nodes.agents)}))


def _write_links(path: Path, cluster: "EmulatedCluster", moved: "Counters") -> None:
    """Each node's bytes out and in over its link during the run (``moved``: the kernel's counters' growth)."""
    links = {"mbit": cluster.mbit[cluster.hosts[0]],
             "hosts": {h: {"out": v.out, "in": v.in_} for h, v in sorted(moved.items())}}
    path.write_text(json.dumps(links))


def _write_outcome(base: Path, fired: list[dict], codes: dict[str, int | None], partitioned: set[str]) -> None:
    """Record when the events fired and how the agents ended; an agent that failed (not killed, not cut off)
    fails the run."""
    (base / "fired.json").write_text(json.dumps(fired))
    (base / "agents.json").write_text(json.dumps({"exit_codes": codes, "partitioned": sorted(partitioned)}))
    bad = {h: c for h, c in codes.items() if c not in (0, -9) and h not in partitioned}
    if bad:
        raise DemoError(f"agents exited with {bad}; see {base}/agent-*.log")


def _replicated(nodes: Nodes, version: int) -> bool:
    """Whether every copy of ``version`` that the replication rule asks for (default replicas) is committed."""
    from ..replication.copier import held_versions
    from ..replication.plan import copies
    from .timeline import saved_layout

    roots = {h: nodes.root(h) for h in nodes.agents}
    layout = saved_layout(list(roots.values()), version)
    if layout is None:
        return False
    needed = {(c.holder, c.origin) for c in copies(layout, None) if c.holder in roots}  # one per region: dedupe
    held = {h: held_versions(roots[h], h) for h in {h for h, _ in needed}}  # each holder's store read once
    return all(version in held[h].get(origin, []) for h, origin in needed)


class _Progress:
    """Follows the workers' records: prints each new world and step (live progress)."""

    def __init__(self, folder: Path, say: Callable[[str], None]):
        self.folder, self.say = folder, say
        self.docs: list[dict] = []
        self.worlds: dict[str, dict] = {}
        self.printed: set[tuple[str, int]] = set()

    def update(self) -> bool:
        self.docs = _records(self.folder)
        for d in self.docs:
            if d["event"] == "start" and d["world_id"] not in self.worlds:
                self.worlds[d["world_id"]] = d
                how = "fresh start" if d["restored_step"] is None else f"restored step {d['restored_step']}"
                self.say(f"  world {d['world']} on {','.join(d['hosts'])}: {d['parallel']}, {how}")
        rank0 = {d["file"] for d in self.docs if d["event"] == "start" and d["rank"] == 0}  # one file per world
        for d in self.docs:
            if d["event"] == "step" and d["file"] in rank0 and (d["file"], d["step"]) not in self.printed:
                self.printed.add((d["file"], d["step"]))
                self.say(f"  step {d['step']:3d}  loss {d['loss']:.6f}")
        return True

    def _world_of_file(self) -> dict[str, str]:
        return {d["file"]: d["world_id"] for d in self.docs if d["event"] == "start"}

    def reached(self, step: int, hosts: list[str]) -> int | None:
        """The last step a world of ``hosts`` finished, if it is ``step`` or later (the ranks wait at its hold)."""
        owner = self._world_of_file()
        done = [d["step"] for d in self.docs
                if d["event"] == "step" and sorted(self.worlds[owner[d["file"]]]["hosts"]) == hosts]
        return max(done) if done and max(done) >= step else None

    def world_after(self, t: float, hosts: list[str]) -> bool:
        return any(w["time"] > t and sorted(w["hosts"]) == hosts for w in self.worlds.values())


def _wait(ready: Callable[[], bool], deadline: float, nodes: Nodes, what: str) -> None:
    while not ready():
        if time.monotonic() > deadline:
            raise DemoError(f"timed out waiting for {what}; logs: {nodes.base}/agent-*.log")
        if not nodes.running():
            if ready():
                return
            raise DemoError(f"every agent exited while waiting for {what}; logs: {nodes.base}/agent-*.log")
        time.sleep(0.2)


def restart_only(events: list[Event], link_mbit: float | None) -> str | None:
    """Why this run cannot be in place (None: it can): partitions, evictions and per-node links are not yet
    demonstrated in place (issue 36)."""
    kinds = sorted({e.kind for e in events} & {"partition", "evict"})
    if kinds:
        return f"schedules with {' and '.join(kinds)}"
    return "--link-mbit" if link_mbit is not None else None


def require_links() -> None:
    """Raise :class:`~tenplex.cluster.ClusterUnavailable` (one line) where network namespaces cannot be used."""
    from ..cluster import ClusterUnavailable, unavailable

    reason = unavailable()
    if reason:
        raise ClusterUnavailable(f"--link-mbit: {reason}; the demo does not fall back to loopback")


def run(workdir: Path, schedule: str = DEFAULT_SCHEDULE, steps: int = 16, initial: tuple[str, ...] = ("h0", "h1"),
        save_every: int = 1, pins: dict[int, str] | None = None,
        say: Callable[[str], None] = print, link_mbit: float | None = None, fuse: bool = False,
        in_place: bool | None = None) -> tuple[dict, dict]:
    """Everything: dataset, reference, elastic run, summary. Returns the summary and the loss histories.

    ``in_place`` (default: yes, unless :func:`restart_only` names a reason): the nodes run ``tenplex run
    --in-place`` and the survivors keep their processes through every change; False: torchrun restarts every
    worker at each change (restart mode). The summary's ``mode`` says which ran.

    ``link_mbit``: run every node in its own network namespace with a link of that rate; raises
    :class:`~tenplex.cluster.ClusterUnavailable` (one line) before anything starts where namespaces
    cannot be used, never falls back to loopback. ``fuse``: the workers read through each node's FUSE view
    (``tenplex run --data-mount``); the summary's ``view`` says whether they did and how often each was switched."""
    from ..runtime.demo import make_dataset
    from .timeline import summarize

    events = parse_schedule(schedule, initial, steps, links=link_mbit is not None)
    why_not = restart_only(events, link_mbit)
    if in_place and why_not:
        raise ConfigError(f"the demo runs {why_not} in restart mode only; leave out in place")
    in_place = not why_not if in_place is None else in_place
    hosts = every_host(initial, events)
    if link_mbit is not None:
        require_links()
    evicts = any(e.kind == "evict" for e in events)
    if evicts:
        require_moto()
    # One epoch is exactly the run's global batches: "every sample once" covers the whole dataset.
    make_dataset(workdir / "data", steps * GLOBAL_BATCH, GLOBAL_BATCH, seed=0)
    data = workdir / "data" / "dataset"
    say(f"dataset: {steps * GLOBAL_BATCH} samples, global batch {GLOBAL_BATCH}, {steps} steps; schedule "
        f"{', '.join(f'{e.kind} {e.host} at step {e.at}' for e in events)}")
    reference = run_reference(workdir, data, steps, say)
    pins = DEFAULT_PINS if pins is None else pins
    if link_mbit is None:
        # With an eviction every node flushes its saves to the bucket (TENPLEX_DURABLE in their environment).
        with demo_bucket(workdir) if evicts else contextlib.nullcontext():
            record, fired = run_elastic(workdir, data, steps, events, initial, save_every, pins, say, fuse=fuse,
                                        in_place=in_place)
    else:
        from ..cluster import EmulatedCluster

        with EmulatedCluster(hosts, mbit=link_mbit, tcp_retries=LINKED_TCP_RETRIES) as cluster:
            say(f"links: every node in its own network namespace, {link_mbit:g} Mbit/s each way "
                f"({', '.join(f'{h} {cluster.address(h)}' for h in hosts)})")
            record, fired = run_elastic(workdir, data, steps, events, initial, save_every, pins, say,
                                        cluster=cluster, fuse=fuse)
    summary, history = summarize(reference, record, events, fired, [workdir / "elastic" / h for h in hosts],
                                 expected_hosts(initial, events))
    summary = {"format": summary.pop("format"), "ok": summary.pop("ok"),
               "mode": "in_place" if in_place else "restart", **summary}
    links = workdir / "elastic" / "links.json"
    if links.exists():
        summary["links"] = json.loads(links.read_text())
    if fuse:
        from .dataview import summarize_views

        summary["view"] = summarize_views(record, workdir / "elastic" / "views.json")
        summary["checks"]["read_through_view"] = summary["view"]["read"]
        summary["ok"] = summary["ok"] and summary["view"]["read"]
    return summary, history
