"""The event trace of ``tenplex bench goodput``: joins, planned leaves, killed nodes and GPU faults in wall time.

May import: the standard library and ``tenplex.errors``. Pure: no process is started here.

A trace is a list of events, each ``at`` seconds after the job's first step. ``--trace`` gives either the events
(``fail:h1@20,join:h2@40,gpufail:h0/1@60,leave:h2@80``), or rates per minute
(``join=0.3,leave=0.25,fail=0.25,gpufail=0.2``) from which :func:`generate` draws a seeded random trace (a
Poisson process: exponential gaps at the total rate, each event's kind drawn in proportion to the rates among
those the cluster allows then), ``short``: the fixed trace of the tests, or ``none``. The cluster keeps between
``min_hosts`` and ``max_hosts`` nodes of ``DEVICES`` GPUs: a join adds a new node (``h2``, ``h3``, …, never a
name used before), a leave (SIGTERM, then SIGKILL after the grace period) or a kill removes one, and a GPU fault
takes one device of a node that has two or more.
"""

from __future__ import annotations

import random
import re
from dataclasses import asdict, dataclass

from ..errors import ConfigError

KINDS = ("join", "leave", "fail", "gpufail")
DEVICES = 2                        # GPUs (workers) per node
DEFAULT_RATES = "join=0.3,leave=0.25,fail=0.25,gpufail=0.2"   # about one event per minute
# The tests' trace: a killed node, then a failed GPU. Each forces a new world in every mode, so that the job
# cannot end before the event's recovery is recorded (a join may come too late for a short job to notice).
SHORT = "fail:h1@1,gpufail:h0/1@2"


@dataclass(frozen=True)
class Event:
    at: float          # seconds after the job's first step
    kind: str          # join, leave, fail or gpufail
    host: str
    device: str | None = None   # gpufail only

    def describe(self) -> str:
        where = f"{self.host}/{self.device}" if self.device is not None else self.host
        return f"{self.kind}:{where}@{self.at:g}"

    def to_dict(self) -> dict:
        return {k: v for k, v in asdict(self).items() if v is not None}


class Cluster:
    """Which nodes run and which of their devices work, as the trace unfolds (to check and to draw events)."""

    def __init__(self, initial: list[str]):
        self.healthy = {h: [str(d) for d in range(DEVICES)] for h in initial}
        self.used = set(initial)

    def apply(self, e: Event, item: str, min_hosts: int, max_hosts: int) -> None:
        running = sorted(self.healthy)
        if e.kind == "join":
            if e.host in self.used or len(running) >= max_hosts:
                raise ConfigError(f"trace item {item!r}: a join needs a new node name and fewer than {max_hosts} "
                                  f"nodes (running: {', '.join(running)}; used: {', '.join(sorted(self.used))})")
            self.healthy[e.host] = [str(d) for d in range(DEVICES)]
            self.used.add(e.host)
        elif e.host not in self.healthy:
            raise ConfigError(f"trace item {item!r}: {e.host} is not running then ({', '.join(running)})")
        elif e.kind == "gpufail":
            if e.device not in self.healthy[e.host] or len(self.healthy[e.host]) < 2:
                raise ConfigError(f"trace item {item!r}: {e.host}'s working devices are "
                                  f"{', '.join(self.healthy[e.host])}; a GPU fault needs one of them and another "
                                  f"left (use fail:{e.host} for the last one)")
            self.healthy[e.host].remove(e.device)
        else:
            if len(running) <= min_hosts:
                raise ConfigError(f"trace item {item!r}: the cluster keeps at least {min_hosts} nodes")
            del self.healthy[e.host]

    def next_host(self) -> str:
        return f"h{1 + max(int(h[1:]) for h in self.used)}"


def parse(text: str, initial: list[str], min_hosts: int = 1, max_hosts: int = 4) -> list[Event]:
    """``"fail:h1@20,join:h2@40"`` -> events, checked against the nodes that run at each point."""
    cluster, events = Cluster(initial), list[Event]()
    for item in filter(None, (s.strip() for s in text.split(","))):
        m = re.fullmatch(r"(\w+):(h\d+)(?:/(\d+))?@(\d+(?:\.\d+)?)", item)
        if not m or m.group(1) not in KINDS or (m.group(3) is not None) != (m.group(1) == "gpufail"):
            raise ConfigError(f"trace item {item!r} is not KIND:HOST@SECONDS with KIND one of join, leave, fail "
                              f"(e.g. fail:h1@20), or gpufail:HOST/DEVICE@SECONDS")
        e = Event(float(m.group(4)), m.group(1), m.group(2), m.group(3))
        if events and e.at <= events[-1].at:
            raise ConfigError(f"trace item {item!r}: times must increase (the previous event is at "
                              f"{events[-1].at:g} s)")
        cluster.apply(e, item, min_hosts, max_hosts)
        events.append(e)
    return events


def parse_rates(text: str) -> dict[str, float]:
    """``"join=0.3,fail=0.2"`` -> events per minute of each kind."""
    rates: dict[str, float] = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        kind, _, value = item.partition("=")
        try:
            rate = float(value)
        except ValueError:
            rate = -1.0
        if kind not in KINDS or rate < 0:
            raise ConfigError(f"rate {item!r} is not KIND=PER_MINUTE with KIND one of {', '.join(KINDS)} "
                              f"(e.g. fail=0.25)")
        rates[kind] = rate
    if not any(rates.values()):
        raise ConfigError(f"rates {text!r}: at least one kind needs a positive rate")
    return rates


def generate(rates: dict[str, float], duration_s: float, seed: int, initial: list[str],
             min_hosts: int = 2, max_hosts: int = 4) -> list[Event]:
    """A seeded random trace over ``duration_s`` seconds (see the module docstring)."""
    rng, cluster, events, t = random.Random(seed), Cluster(initial), list[Event](), 0.0
    total = sum(rates.values()) / 60.0  # events per second
    while True:
        t += rng.expovariate(total)
        if t >= duration_s:
            return events
        running = sorted(cluster.healthy)
        allowed = {k: r for k, r in rates.items() if r > 0 and _allowed(k, cluster, min_hosts, max_hosts)}
        if not allowed:
            continue
        kind = rng.choices(list(allowed), weights=list(allowed.values()))[0]
        if kind == "join":
            e = Event(round(t, 1), kind, cluster.next_host())
        elif kind == "gpufail":
            host = rng.choice([h for h in running if len(cluster.healthy[h]) >= 2])
            e = Event(round(t, 1), kind, host, rng.choice(cluster.healthy[host]))
        else:
            e = Event(round(t, 1), kind, rng.choice(running))
        cluster.apply(e, e.describe(), min_hosts, max_hosts)
        events.append(e)


def _allowed(kind: str, cluster: Cluster, min_hosts: int, max_hosts: int) -> bool:
    if kind == "join":
        return len(cluster.healthy) < max_hosts
    if kind == "gpufail":
        return any(len(d) >= 2 for d in cluster.healthy.values())
    return len(cluster.healthy) > min_hosts


def build(text: str, duration_s: float, seed: int, initial: list[str], max_hosts: int = 4) -> list[Event]:
    """``--trace``: ``short``, explicit events, or rates (a seeded random trace over ``duration_s``)."""
    if text == "none":
        return []
    if text == "short":
        return parse(SHORT, initial, 1, max_hosts)
    if "@" in text:
        return parse(text, initial, 1, max_hosts)
    return generate(parse_rates(text), duration_s, seed, initial, min(2, len(initial)), max_hosts)
