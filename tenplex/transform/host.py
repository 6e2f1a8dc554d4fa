"""One destination host's part of a transformation: stage version N+1 from N and prepare it.

May import: numpy, ``tenplex.store`` (its contract, client and transformer types; never its protobuf),
``tenplex.transfer_plan``, ``tenplex.layout``, ``tenplex.box``, ``tenplex.devices``, ``tenplex.errors``
and the standard library. Runs inside the host's store server (the
``Transform`` RPC), so it reads this host's old shards straight from disk.

Its parts: ``staging`` (link, queue and run the work), ``sources`` (read old
regions here or from peers, replicas on failure), ``linking`` (which old
file a new shard links to), ``progress`` (counters and heartbeat).

Order of work, per new shard of this host's devices:

1. A shard kept whole (same device, or another device of this host, same
   box) is hard-linked to the old file: no bytes are copied. So is a shard
   that one old shard of this host holds as a contiguous run of its bytes
   (a dim-0 slab: what ZeRO and FSDP keep of a replica), as a slice row of
   the linked file, by a local pull of step 2 that first reads the run once
   to verify it (a damaged run is copied instead, from a replica if need
   be); slices of one change share files where replicas allow (see
   ``linking.linkable``). (A store that cannot link, see
   ``tenplex.store.contract``, gets them copied in step 2, and so does a
   shard whose link fails: its old file gone, or on another mount.)
2. Every other ``"from": "old"`` region is written straight into the new
   shard's file (``ShardTarget``): from this host's old files (memory-mapped)
   without gRPC, or pulled from the source host by ``streams`` concurrent
   pulls (one connection each): large regions in pieces of up to 16 MiB over
   the source's bulk data plane (plain TCP, ``tenplex.store.dataplane``; gRPC
   ReadBox streams when the source has none or TLS is on), small ones
   batched many to a gRPC call (``ReadBoxes``). The new files' space is
   reserved by a thread of its own while the pulls run, so a full disk
   fails early. The order of the pulls keeps every source link busy at once
   and lets replicas take over a slow source's pieces (``schedule``).
3. ``"from": "new"`` regions (the local fan-out) are copied from the new
   shards that step 2 fills, by one more thread, each as soon as every byte
   of its source region has landed (``completion``): during the pulls, not
   after them; from a linked shard (whole or slice), they read the old file.

A local region that is one contiguous run of both the old and the new shard
file goes from the verified read buffer straight into the new file. Every new
shard is finished (fsynced, its block checksums collected) by the thread
that wrote its last region, so that work overlaps the other pulls instead of
running serially in ``prepare``.

A region whose source fails (host down, cut off, corrupted data after
retries, missing version) is fetched again from the other replicas the old
layout lists, this host's own first; only when no replica covers it does the
part fail, naming the tensor, region and every cause. A source counts as
failed when a pull from it delivers nothing for ``request.stall_timeout_s`` seconds
(the stall limit): a partitioned peer sends no reset, so waiting for a
deadline would take minutes. While it works, the part sends the coordinator a
progress message at least every ``HEARTBEAT_S``, so that the coordinator can
tell a silent host from a busy one in the same way.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path
from typing import Callable

from ..errors import StoreError, TransformError
from ..layout import Layout
from ..store import LAYOUT_DOC, StoreReader, TensorStore, wire
from ..store.manifest import TRANSFORM_PART
from ..store.transformer import TransformProgress, TransformRequest
from .progress import Counters, heartbeat
from .sources import Sources
from .staging import stage

log = logging.getLogger(__name__)

MAX_DEFAULT_STREAMS = 4  # pulls per host when the request names none: one per CPU the store may use, 2 to 4
STALL_S = 5.0  # default stall limit of pulls (request.stall_timeout_s)
CGROUP_CPU_MAX = Path("/sys/fs/cgroup/cpu.max")  # cgroup v2: "QUOTA PERIOD" or "max PERIOD" (a pod's CPU limit)


def default_streams() -> int:
    """Concurrent pulls of a host whose request names no number: one per CPU this process may use (its CPU
    affinity, and its cgroup's CPU quota when it has one: a container's limit), at least 2 and at most
    ``MAX_DEFAULT_STREAMS``. Each pull receives, hashes and writes in the kernel; more pulls than cores only
    contend with each other, with the store's serving threads and with the local copies (measured on two cores,
    2026-12-04: 2 streams 5-10 % faster than 4 on the compare benchmark's cross-host changes)."""
    cpus = len(os.sched_getaffinity(0))
    try:
        quota, period = CGROUP_CPU_MAX.read_text().split()[:2]
        if quota != "max":
            cpus = min(cpus, max(1, -(-int(quota) // int(period))))
    except (OSError, ValueError):
        pass  # no cgroup v2 CPU controller here: the affinity alone
    return max(2, min(MAX_DEFAULT_STREAMS, cpus))


def run_host_part(store: TensorStore, request: TransformRequest, progress: Callable[[TransformProgress], None],
                  cancelled: threading.Event | None = None, token: str | None = None,
                  root_certificates: bytes | None = None) -> TransformProgress:
    """Stage ``request.new_version`` on this host and prepare it (the coordinator commits). Returns the final
    counters (``done`` set). A :class:`~tenplex.store.transformer.Transformer`."""
    host = request.host
    if host != store.host:
        raise StoreError(f"transform request for host {host} reached the store of host {store.host}")
    plan, old, new = request.plan, request.old_layout, request.new_layout
    cancelled = cancelled or threading.Event()
    streams = request.streams or default_streams()
    reader = store.open(request.old_version) if request.old_version in store.versions() else None
    sources = Sources(host, old, request.old_version, reader, dict(request.peers), token, root_certificates,
                       streams, request.chunk_bytes or wire.DEFAULT_CHUNK_BYTES, request.stall_timeout_s or STALL_S)
    counters = Counters(progress)
    beating = threading.Event()
    threading.Thread(target=heartbeat, args=(counters, beating), name=f"heartbeat-{host}", daemon=True).start()
    log.info("host %s: staging version %s from %s (%d transfers, %d streams)", host, request.new_version,
             request.old_version, len(plan.transfers), streams)
    store.abort(request.new_version)  # leftovers of an earlier, interrupted attempt
    writer = store.begin(request.new_version, part=TRANSFORM_PART)
    try:
        stage(host, plan.transfers, set(plan.new_tensors), new, writer, reader, sources, counters, cancelled,
               streams)
        _carry_json(host, request, old, writer, reader, sources)
        writer.put_layout(new)
        writer.prepare()
    except BaseException:
        writer.abort()
        raise
    finally:
        beating.set()
        sources.close()
        if reader is not None:
            reader.close()  # now: its directory (a version that may be deleted next) is not left to the collector
    log.info("host %s: prepared version %s", host, request.new_version)
    return counters.message(done=True)


def _carry_json(host: str, request: TransformRequest, old: Layout, writer, reader: StoreReader | None,
                sources: Sources) -> None:
    """Copy the old version's JSON documents (step, RNG, dataset position…) into the new version.

    They come from ``request.json_from_host`` (this host itself when it held
    old state); if that host fails, from the other old hosts in turn."""
    origin = request.json_from_host or host
    candidates = [origin] + [h for h in old.hosts() if h != origin]
    causes = []
    for candidate in candidates:
        try:
            if candidate == host:
                if reader is None:
                    continue
                docs = {name: reader.get_json(name) for name in reader.json_names() if name != LAYOUT_DOC}
            else:
                if candidate in sources.failed:
                    continue
                client = sources.client(candidate)
                names = sorted(client.manifest(request.old_version)["json"])
                # not the old layout: the new version records its own, and a large one is tens of MB to fetch
                docs = {name: client.get_json(request.old_version, name) for name in names if name != LAYOUT_DOC}
        except Exception as e:  # noqa: BLE001 - try the next host that held the old version
            causes.append(f"{candidate}: {e}")
            continue
        for name, doc in docs.items():
            writer.put_json(name, doc)
        return
    if causes:
        raise TransformError(f"host {host}: could not read the JSON documents of version {request.old_version} "
                             f"from any old host: " + "; ".join(causes))
