"""``tenplex rendezvous serve``: torch's ``TCPStore`` in a process of its own, for torchrun's c10d rendezvous.

May import: ``tenplex.errors``, ``tenplex.elastic.closewatch``, torch.distributed (``TCPStore``, on use) and the
standard library.

Why: with torchrun's c10d backend one agent hosts the rendezvous store, and
killing that agent ends the whole job (measured here with torch 2.13). A store
that no agent owns survives any node; the agents connect to it with
``--rdzv-conf is_host=false`` (``tenplex run`` adds that). The store is
multi-tenant: several jobs (``--rdzv-id``) can share it.

torch's ``TCPStore`` has no address option and no authentication: it listens on
every interface. We bind the listening socket ourselves and hand it over
(``master_listen_fd``), so that it listens on loopback unless told otherwise;
any other address needs ``allow_unauthenticated`` (use it on a trusted
network only, as torchrun's own store is).

Beside the store it serves a close watch (:mod:`tenplex.elastic.closewatch`,
on the same address, its port in the store): in-place workers learn there at
once that a peer's process is gone, without waiting out its heartbeat.
"""

from __future__ import annotations

import errno
import ipaddress
import socket
import threading
from pathlib import Path

from ..errors import ConfigError
from .closewatch import PORT_KEY, CloseWatch


def is_loopback(address: str) -> bool:
    if address == "localhost":
        return True
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False


def _listen(listener: socket.socket, bind: str, port: int) -> None:
    if not 0 <= port <= 65535:
        raise ConfigError(f"port {port} is not a TCP port: use 0-65535 (0: any free port)")
    try:
        listener.bind((bind, port))
        listener.listen(1024)
    except OSError as e:
        if e.errno == errno.EADDRINUSE:
            why = f"port {port} is in use; choose another port (0: any free port)"
        elif e.errno == errno.EADDRNOTAVAIL:
            why = f"{bind} is not an address of this machine"
        else:
            why = e.strerror or str(e)
        raise ConfigError(f"cannot listen on {bind}:{port}: {why}") from None


def serve(bind: str = "127.0.0.1", port: int = 0, port_file: Path | None = None,
          allow_unauthenticated: bool = False, stop: threading.Event | None = None,
          ready=None) -> None:
    """Serve a TCPStore on ``bind:port`` until ``stop`` is set; write the bound port to ``port_file``."""
    if not is_loopback(bind) and not allow_unauthenticated:
        raise ConfigError(f"torch's TCPStore has no authentication; binding {bind} would let anyone who reaches "
                          f"it join or disturb the rendezvous; bind 127.0.0.1, or pass --allow-unauthenticated "
                          f"on a trusted network")
    family = socket.AF_INET6 if ":" in bind else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        _listen(listener, bind, port)  # before torch loads: a bad address fails at once
        bound = listener.getsockname()[1]
        import torch.distributed as dist

        store = dist.TCPStore(bind, bound, is_master=True, wait_for_workers=False, multi_tenant=True,
                              master_listen_fd=listener.fileno())
    except BaseException:
        listener.close()
        raise
    listener.detach()  # the store owns the socket now and closes it itself
    # The watch appends from its own thread, through its own client (a TCPStore client is one connection).
    appender = dist.TCPStore(bind, bound, is_master=False)
    watch = CloseWatch(appender.append, bind)  # type: ignore[attr-defined]  # in torch, not in its stubs
    store.set(PORT_KEY, str(watch.port))
    if port_file is not None:
        tmp = port_file.with_name(port_file.name + ".tmp")
        tmp.write_text(f"{bound}\n")
        tmp.replace(port_file)
    if ready is not None:
        ready(bound)
    try:
        (stop or threading.Event()).wait()
    finally:
        watch.close()
        del appender, store
