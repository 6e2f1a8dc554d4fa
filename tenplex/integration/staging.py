"""Host buffers that stage shards between the store files and an accelerator, and the side stream that copies.

May import: torch and the standard library.

A save or restore of a GPU tensor goes through host memory: the store reads
and writes files. Copies between the device and *pinned* (page-locked) host
memory run on the GPU's copy engine at full speed and asynchronously;
copies from pageable memory are staged by the driver and block. So the
restore reads each slab of a shard into a pinned buffer of this pool and
copies it to the device on a side stream while other slabs are read into
other buffers; the save copies slabs off the device while others are written
to their file, a few threads at once (:func:`each`). Buffers are reused: allocating pinned memory costs far
more than copying into it, and a pool of a few slabs bounds the host memory a
rank holds for staging, whatever the size of its state.

Synchronisation: the side stream first waits for the work queued so far on
the caller's current stream (the training loop's last writes to a tensor
come before a save reads it, and a restore's copy lands after them); the
caller's current stream then waits for the copy (whatever the job runs next
sees the restored values), without blocking the host. A buffer goes back to
the pool with the event of its last copy and is handed out again only once
that copy is done.

On a machine without CUDA nothing here is CUDA-specific: buffers are plain
host tensors and copies are synchronous ``copy_`` calls, so the same code
runs (and is tested) on CPU.
"""

from __future__ import annotations

import threading
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, TypeVar

import torch

SLAB_BYTES = 64 << 20  # one buffer; a copy of this size runs at the link's full rate on current GPUs
BUFFERS = 6  # at most this many per process: 4 threads reading or writing slabs plus 2 copies in flight
THREADS = 4  # slabs of one piece read or written at once (file I/O releases the GIL; copies overlap it)


class _Buffer:
    """One host buffer and the event of the last device copy that uses it (None: no copy in flight)."""

    def __init__(self, nbytes: int, pinned: bool):
        self.tensor = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
        self.event: torch.cuda.Event | None = None

    def idle(self) -> bool:
        return self.event is None or self.event.query()

    def wait(self) -> None:
        if self.event is not None:
            self.event.synchronize()
            self.event = None

    def view(self, nbytes: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        """The first ``nbytes`` as a contiguous tensor of ``dtype`` and ``shape``."""
        return self.tensor[:nbytes].view(dtype).view(shape)


class HostBuffers:
    """A bounded, thread-safe pool of host buffers of ``slab_bytes`` each, made on first need, then reused."""

    def __init__(self, slab_bytes: int, pinned: bool, count: int = BUFFERS):
        self.slab_bytes, self.pinned, self.count = slab_bytes, pinned, count
        self.made = 0
        self._free: deque[_Buffer] = deque()
        self._ready = threading.Condition()

    def take(self, nbytes: int) -> _Buffer:
        """A buffer of at least ``nbytes`` (at most ``slab_bytes``) whose last copy is done; blocks while all are
        busy. An idle buffer comes first; then a new one, while fewer than ``count`` exist; then the oldest."""
        if nbytes > self.slab_bytes:
            raise ValueError(f"a staged region of {nbytes} bytes exceeds the staging slab of {self.slab_bytes}")
        with self._ready:
            while True:
                idle = next((b for b in self._free if b.idle()), None)
                if idle is not None:
                    self._free.remove(idle)
                    idle.event = None
                    return idle
                if self.made < self.count:
                    self.made += 1
                    oldest = None
                    break
                if self._free:
                    oldest = self._free.popleft()
                    break
                self._ready.wait()
        if oldest is None:  # allocated outside the lock: pinning takes a while
            try:
                return _Buffer(self.slab_bytes, self.pinned)
            except BaseException:
                with self._ready:
                    self.made -= 1
                    self._ready.notify()
                raise
        oldest.wait()
        return oldest

    def give(self, buffer: _Buffer, event: torch.cuda.Event | None = None) -> None:
        """Return ``buffer``; ``event``: the copy that still reads or writes it (the next taker waits for it)."""
        buffer.event = event
        with self._ready:
            self._free.append(buffer)
            self._ready.notify()


_pools: dict[bool, HostBuffers] = {}
_pools_lock = threading.Lock()
_pinned = True  # whether staging uses pinned buffers where CUDA is there (the benchmark compares pageable)


def pool() -> HostBuffers:
    """This process's pool (pinned where CUDA is available, unless :func:`use_pinned` turned it off)."""
    pinned = _pinned and torch.cuda.is_available()  # pinning needs the CUDA driver
    with _pools_lock:
        if pinned not in _pools:
            _pools[pinned] = HostBuffers(SLAB_BYTES, pinned=pinned)
        return _pools[pinned]


def use_pinned(pinned: bool) -> None:
    """Stage through pinned (True, the default) or pageable (False) host buffers from now on."""
    global _pinned
    _pinned = pinned


_streams: dict[torch.device, torch.cuda.Stream] = {}


def side_stream(device: torch.device) -> torch.cuda.Stream:
    """The stream this process copies between host buffers and CUDA ``device`` on (one per device)."""
    with _pools_lock:
        if device not in _streams:
            _streams[device] = torch.cuda.Stream(device)
        return _streams[device]


def to_device(fill: Callable[[memoryview], None], dest: torch.Tensor) -> None:
    """Copy into ``dest`` (any device, any strides) the C-order bytes that ``fill`` writes into a host buffer.

    On CUDA the copy runs on the side stream and this returns once it is queued (the caller's current stream
    waits for it); elsewhere it is done when this returns."""
    buffers, nbytes = pool(), dest.numel() * dest.element_size()
    buffer = buffers.take(nbytes)
    try:
        host = buffer.view(nbytes, dest.dtype, tuple(dest.shape))
        fill(memoryview(buffer.tensor[:nbytes].numpy()))
    except BaseException:
        buffers.give(buffer)
        raise
    if dest.device.type != "cuda":
        dest.copy_(host)
        buffers.give(buffer)
        return
    buffers.give(buffer, _copy_on_side_stream(dest, host))


def from_device(source: torch.Tensor) -> Staged:
    """Start copying ``source`` (any device, any strides) into a host buffer; :meth:`Staged.host` waits for it."""
    buffers, nbytes = pool(), source.numel() * source.element_size()
    buffer = buffers.take(nbytes)
    host = buffer.view(nbytes, source.dtype, tuple(source.shape))
    event = _copy_on_side_stream(host, source) if source.device.type == "cuda" else None
    if event is None:
        host.copy_(source)
    return Staged(buffers, buffer, host, event)


class Staged:
    """A region on its way off the device into a pooled host buffer."""

    def __init__(self, buffers: HostBuffers, buffer: _Buffer, host: torch.Tensor, event: torch.cuda.Event | None):
        self._buffers, self._buffer, self._host, self._event = buffers, buffer, host, event

    def host(self) -> torch.Tensor:
        """The region's values in host memory (contiguous), once the copy is done."""
        if self._event is not None:
            self._event.synchronize()
            self._event = None
        return self._host

    def release(self) -> None:
        """Hand the buffer back to its pool (after the copy, if it still runs: nothing may write into it
        meanwhile)."""
        self.host()
        self._buffers.give(self._buffer)


def _copy_on_side_stream(dest: torch.Tensor, source: torch.Tensor) -> torch.cuda.Event:
    """``dest.copy_(source)`` between a host buffer and a CUDA tensor, queued on the side stream and ordered
    after the current stream's work so far; the current stream waits for it. Returns the copy's event."""
    device = (dest if dest.device.type == "cuda" else source).device
    return copies_on_side_stream(device, [(dest, source)])


def copies_on_side_stream(device: torch.device, copies: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.cuda.Event:
    """Every ``dest.copy_(source)`` of ``copies`` (host buffers and CUDA tensors on ``device``), queued on the
    device's side stream after the current stream's work so far; the current stream waits for them (so the next
    kernel cannot overwrite a source mid-copy), the host does not. Returns the copies' event."""
    current = torch.cuda.current_stream(device)
    stream = side_stream(device)
    stream.wait_stream(current)
    with torch.cuda.stream(stream):
        for dest, source in copies:
            dest.copy_(source, non_blocking=True)
        event = torch.cuda.Event()
        event.record(stream)
    current.wait_event(event)
    return event


_Item = TypeVar("_Item")


def each(fn: Callable[[_Item], None], items: list[_Item]) -> None:
    """``fn(item)`` for every item, up to ``THREADS`` at once (one item: in this thread), without autograd
    (which is per thread); the first failure is raised after every call has ended."""
    def run(item: _Item) -> None:
        with torch.no_grad():
            fn(item)

    if len(items) == 1:
        run(items[0])
        return
    with ThreadPoolExecutor(max_workers=min(THREADS, len(items)), thread_name_prefix="staging") as threads:
        for _ in threads.map(run, items):
            pass


def begin(devices: set[torch.device]) -> None:
    """Order every staged copy queued from now on (by any thread) after the work queued so far on the calling
    thread's current stream of each CUDA device (copies queued from worker threads order themselves only after
    those threads' current streams)."""
    for device in devices:
        if device.type == "cuda":
            side_stream(device).wait_stream(torch.cuda.current_stream(device))


def publish(devices: set[torch.device]) -> None:
    """Make the calling thread's current stream of each CUDA device wait for every staged copy queued so far
    (by any thread: copies queued from worker threads ordered only those threads' current streams)."""
    for device in devices:
        if device.type == "cuda":
            torch.cuda.current_stream(device).wait_stream(side_stream(device))
