"""The store servers under concurrent load, with a descriptor audit (issue 39 item 2): used by
``tests/test_store_stress.py`` (a short run) and ``scripts/store-stress`` (as long as you like).

Two store servers run in this process (so that ``/proc/self/fd`` is theirs), each with the transformer and the
data plane. Transformations switch a small GPT's state between (dp 1, tp 2, pp 2) and (dp 1, tp 1, pp 4) on
2 hosts x 2 devices (the "pp 2->4, tp 2->1" change that once failed with EBADF) with many streams, while other
threads read shards of the newest versions through the data plane and through gRPC, and a collector deletes old
versions (which closes the servers' cached readers while reads are under way). Every error of every operation
is kept: one that says EBADF fails the run, and so does any other that is not a read of a version deleted
meanwhile. At the end every version is compared with the global arrays, and the descriptors this process holds
are compared with those it held before: none may be left on a shard file, a staged or deleted version.
"""

from __future__ import annotations

import errno
import os
import random
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from tenplex.errors import StoreError
from tenplex.planner import plan
from tenplex.store import Store
from tenplex.store.client import StoreClient
from tenplex.store.server import serve
from tenplex.transform import transform
from tenplex.transform.host import run_host_part

from store_helpers import assert_version_matches, gpt_layout, random_globals, write_version

HOSTS = ("h0", "h1")


@dataclass
class Outcome:
    """What a stress run did and saw."""

    transformations: int = 0
    reads: dict[str, int] = field(default_factory=lambda: {"data plane": 0, "grpc": 0})
    deleted_while_read: int = 0
    collected: int = 0
    ebadf: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    fds_before: int = 0
    fds_after: int = 0
    left_open: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def as_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


def _says_ebadf(error: BaseException) -> bool:
    return getattr(error, "errno", None) == errno.EBADF or "Bad file descriptor" in str(error) or \
        "Errno 9]" in str(error)


def _descriptors() -> dict[str, str]:
    found = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            found[fd] = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            pass  # closed while listing (the listing's own descriptor)
    return found


def _stray(base: Path, before: dict[str, str], after: dict[str, str]) -> list[str]:
    """Descriptors held now and not before that point into the stores at anything but a committed version's
    directory (a server caches a reader of each version read, until it is deleted): a shard or document file,
    a staged or deleted version."""
    return sorted(f"{fd} -> {target}" for fd, target in after.items()
                  if str(base) in target and before.get(fd) != target and not
                  (os.path.isdir(target) and Path(target).parent.name == "versions"))


class _Runner:
    def __init__(self, base: Path, streams: int):
        self.base, self.streams = base, streams
        self.layouts = [gpt_layout(1, 2, 2, 2, 2, layers=4, hidden=64, vocab=512, host_names=HOSTS),
                        gpt_layout(1, 1, 4, 2, 2, layers=4, hidden=64, vocab=512, host_names=HOSTS)]
        self.plans = [plan(self.layouts[0], self.layouts[1]), plan(self.layouts[1], self.layouts[0])]
        self.arrays = random_globals(self.layouts[0], seed=39)
        self.roots = {h: base / h for h in HOSTS}
        self.outcome = Outcome()
        self.lock = threading.Lock()
        self.newest = 1
        self.stop = threading.Event()

    def error(self, what: str, e: BaseException) -> None:
        with self.lock:
            (self.outcome.ebadf if _says_ebadf(e) else self.outcome.unexpected).append(
                f"{what}: {type(e).__name__}: {e}")

    def read_forever(self, client: StoreClient, path: str, seed: int) -> None:
        rng = random.Random(seed)
        while not self.stop.is_set():
            version = self.newest - rng.randrange(2)  # the newest, or the one before (about to be collected)
            layout = self.layouts[(version - 1) % 2]
            host = rng.choice(HOSTS)
            device = rng.choice([d for d in layout.devices if d.startswith(host + "/")])
            shard = rng.choice(layout.devices[device])
            try:
                client[host].read_box(version, device, shard.tensor, shard.box, layout.tensors[shard.tensor].dtype)
                with self.lock:
                    self.outcome.reads[path] += 1
            except StoreError as e:
                if "was deleted" in str(e) or "no committed version" in str(e) or "NOT_FOUND" in str(e):
                    with self.lock:
                        self.outcome.deleted_while_read += 1
                else:
                    self.error(f"read {path} v{version} {device} {shard.tensor}", e)
            except Exception as e:  # noqa: BLE001 - every error is kept and judged
                self.error(f"read {path} v{version} {device} {shard.tensor}", e)

    def transform_and_collect(self, addresses: dict[str, str], admin: dict[str, StoreClient], rounds: int,
                              seconds: float | None) -> None:
        began = time.monotonic()
        done = 0
        while done < rounds or (seconds is not None and time.monotonic() - began < seconds):
            old = self.newest
            which = (old - 1) % 2
            try:
                transform(self.plans[which], self.layouts[which], self.layouts[1 - which], addresses, old, old + 1,
                          streams=self.streams, timeout=300, pull_timeout=60)
            except Exception as e:  # noqa: BLE001 - judged at the end; the run cannot go on from here
                self.error(f"transform {old} -> {old + 1}", e)
                return
            self.newest = old + 1
            self.outcome.transformations += 1
            for host in HOSTS:  # closes the servers' cached readers of old versions while reads run
                try:
                    self.outcome.collected += len(admin[host].gc(2))
                except Exception as e:  # noqa: BLE001
                    self.error(f"gc on {host}", e)
            done += 1


def run(base: Path, rounds: int = 4, seconds: float | None = None, streams: int = 8, readers: int = 4) -> Outcome:
    """Stress two in-process store servers under ``base`` for ``rounds`` transformations (or ``seconds``)."""
    runner = _Runner(base, streams)
    write_version(runner.roots, runner.layouts[0], 1, runner.arrays)
    servers, addresses = [], {}
    for host in HOSTS:
        server, port = serve(Store(runner.roots[host], host), transformer=run_host_part)
        servers.append(server)
        addresses[host] = f"127.0.0.1:{port}"
    began = time.monotonic()
    clients: list[dict[str, StoreClient]] = []
    try:
        # the plane of each reader: data plane for large boxes (any box here: min bytes 0), or gRPC only
        planes = [{h: StoreClient(a, data_plane_min_bytes=0, timeout=120) for h, a in addresses.items()},
                  {h: StoreClient(a, data_plane=False, timeout=120) for h, a in addresses.items()}]
        admin = {h: StoreClient(a, timeout=120) for h, a in addresses.items()}
        clients = [*planes, admin]
        for client in admin.values():
            client.health()  # channels made before the audit begins: they are not what it looks for
        before = _descriptors()
        runner.outcome.fds_before = len(before)
        threads = [threading.Thread(target=runner.read_forever, args=(planes[i % 2], ("data plane", "grpc")[i % 2],
                                                                       i), daemon=True) for i in range(readers)]
        for t in threads:
            t.start()
        try:
            runner.transform_and_collect(addresses, admin, rounds, seconds)
        finally:
            runner.stop.set()
            for t in threads:
                t.join(120)
        for version in Store(runner.roots["h0"], "h0").versions():
            assert_version_matches(runner.roots, runner.layouts[(version - 1) % 2], version, runner.arrays)
    finally:
        for group in clients:
            for client in group.values():
                client.close()
        for server in servers:
            server.health.drain()  # its watcher stops before the directories go
            server.data_server.close()
            server.stop(None).wait()
    runner.outcome.seconds = round(time.monotonic() - began, 1)
    after = _descriptors()
    runner.outcome.fds_after = len(after)
    runner.outcome.left_open = _stray(base, before, after)
    return runner.outcome
