"""``tenplex run``: one per node. Start (or reuse) the node's store, then run torchrun's elastic agent.

May import: ``tenplex.runtime.hosts`` (the store process), ``tenplex.store.client`` (is a store already
serving?), ``tenplex.errors``, ``tenplex.durable.bucket`` (checks ``--durable``), ``tenplex.elastic.restarts``
(the agent's restart accounting), ``.inplace_launch`` (``--in-place``) and ``.dataview`` (``--data-mount``),
``tenplex.ops`` (its lines under ``--log-format json``), ``tenplex.flock`` (the store lock's bounded wait),
torch's ``torch.distributed.run`` (the agent) and ``torch.distributed.elastic`` (its signal and rendezvous
errors), and the standard library. All but ``errors`` and ``flock`` are imported on use.

    tenplex run --host NAME --store-root DIR [--store-bind ADDR] [--store-advertise HOST] [--token-file F]
                [--durable s3://BUCKET/PREFIX] [--dataset DIR --data-mount PATH] [torchrun options] script.py [args]

Every option that is not one of the above goes to torchrun unchanged
(``--nnodes=MIN:MAX``, ``--nproc-per-node``, ``--rdzv-endpoint``, ``--max-restarts``…).
The agent runs in this process, so a signal to ``tenplex run`` is a signal to
the agent: SIGTERM is a planned leave (the workers save at their next step
boundary and exit), and SIGKILL of the node's process group is a host failure.

What it adds to torchrun, each for a reason measured with torch 2.13 and gloo
on loopback (see :func:`torchrun_argv`), and the worker environment:
``TENPLEX_HOST``, ``TENPLEX_STORE_ROOT``, ``TENPLEX_STORE_ADDRESS`` (this
node's store, which the ranks exchange so that no one needs
``TENPLEX_STORES``) and ``TENPLEX_TOKEN`` when ``--token-file`` is given.
``TORCHELASTIC_RESTART_COUNT`` is counted per agent, not per job, so nothing
here or in :mod:`tenplex.elastic.job` uses it as a generation number.

The store is started in a session of its own and keeps serving after the
agent exits: a node that left can still serve its shards to the survivors.
Its port, pid and log are ``DIR/.tenplex-store.{port,pid,log}``; a later
``tenplex run`` with the same root reuses it, and ``tenplex store stop
--store-root DIR`` (:func:`stop_store`) stops it. ``DIR/.tenplex-store.lock``
(``flock``) keeps one store per root when runs start at once; a run waits for it
at most ``STORE_LOCK_WAIT_S`` (a holder that is stopped or hung keeps it: the
error names it).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import ConfigError
from ..flock import held

# Restarts after a crash (torchrun's default 0 would end the job at the first one). Leaves, lost nodes and
# device faults also reach the agents as failed workers, but tenplex run does not count them
# (tenplex.elastic.restarts): only a script that really crashes ends the job, after this many restarts.
DEFAULT_MAX_RESTARTS = "10"
# Without these, the survivors wait 15 s+ for a dead node's keep-alive to expire (measured: a new world ran
# 8-11 s after a kill with them). A short last call lets a round close soon after the last survivor arrives.
DEFAULT_RDZV_CONF = {"keep_alive_interval": "1", "keep_alive_max_attempt": "3", "last_call_timeout": "2"}

_OURS = ("--host", "--store-root", "--store-bind", "--store-advertise", "--token-file", "--durable", "--dataset",
         "--data-mount")
_MODES = {"-m": "module", "--module": "module", "--no-python": "exec", "--no_python": "exec",
          "--run-path": "script", "--run_path": "script"}


@dataclass
class RunSpec:
    """``tenplex run``'s own options, the user's torchrun options, and the program each worker runs."""

    host: str
    store_root: Path
    store_bind: str = "127.0.0.1"
    store_advertise: str | None = None
    token_file: Path | None = None
    torchrun: list[str] = field(default_factory=list)
    mode: str = "script"
    target: str = ""
    args: list[str] = field(default_factory=list)
    durable: str | None = None
    dataset: Path | None = None       # with data_mount: the node's FUSE view of it (tenplex.elastic.dataview)
    data_mount: Path | None = None
    in_place: bool = False            # the workers form the worlds themselves (tenplex.elastic.inplace_launch)


def parser():
    from torch.distributed.run import get_args_parser

    p = get_args_parser()
    p.prog = "tenplex run"
    p.allow_abbrev = False  # our own options are found by their exact tokens
    p.add_argument("--host", required=True, help="this node's host name (device ids are HOST/LOCAL_RANK)")
    p.add_argument("--store-root", required=True, type=Path, help="this node's store directory")
    p.add_argument("--store-bind", default="127.0.0.1",
                   help="address this node's store listens on (default 127.0.0.1; others need --token-file)")
    p.add_argument("--store-advertise",
                   help="address other nodes reach this store at (default: the bind address, or this machine's "
                        "name when binding 0.0.0.0)")
    p.add_argument("--token-file", type=Path, help="the stores' shared token (needed beyond loopback)")
    p.add_argument("--durable", metavar="s3://BUCKET/PREFIX",
                   help="flush saved versions to this bucket and restore from it (sets TENPLEX_DURABLE)")
    p.add_argument("--dataset", type=Path, help="a dataset the workers read through a FUSE view (with "
                                                "--data-mount): packed, or a Hugging Face, Parquet, WebDataset or "
                                                "Megatron directory or source file, read in place")
    p.add_argument("--data-mount", type=Path, help="where this node mounts the job's view of --dataset (once per "
                                                   "node; every world switches it before its workers read)")
    p.add_argument("--in-place", action="store_true",
                   help="survivors keep their processes through joins, leaves and lost nodes: this node's torchrun "
                        "supervises only its workers, which form each world on --rdzv-endpoint's store "
                        "(scripts that loop over job.worlds(); others restart at a change as before)")
    return p


def parse(argv: list[str]) -> RunSpec:
    """Split ``argv`` into our options, the user's torchrun options and the worker program."""
    ns = parser().parse_args(argv)
    boundary = len(argv) - len(ns.training_script_args) - 1
    if boundary < 0 or argv[boundary] != ns.training_script:
        raise ConfigError(f"cannot find the training script {ns.training_script!r} in the command line")
    return spec_of(ns, argv[:boundary])


def spec_of(ns, options: list[str], skip: tuple[str, ...] = ()) -> RunSpec:
    """The :class:`RunSpec` of parsed options ``ns``; ``options``: the command line before the training script
    (``skip``: more options with a value that are neither ours nor torchrun's)."""
    passthrough, mode, i = [], "script", 0
    while i < len(options):
        token = options[i]
        name = token.split("=", 1)[0]
        if name in _OURS or name in skip:
            i += 1 if "=" in token else 2
            continue
        if token == "--in-place":
            i += 1
            continue
        if token in _MODES:
            mode = _MODES[token]
        else:
            passthrough.append(token)
        i += 1
    if ns.durable is not None:
        from ..durable.bucket import parse_url
        parse_url(ns.durable)  # a malformed location fails here, not in every worker
    if (ns.dataset is None) != (ns.data_mount is None):
        raise ConfigError("--dataset and --data-mount go together: the dataset and where this node mounts its view")
    return RunSpec(ns.host, ns.store_root, ns.store_bind, ns.store_advertise, ns.token_file, passthrough, mode,
                   ns.training_script, list(ns.training_script_args), ns.durable, ns.dataset, ns.data_mount,
                   ns.in_place)


def _given(options: list[str], *names: str) -> str | None:
    """The value the user gave an option (last one wins), '' for a flag, None when absent."""
    value = None
    for i, token in enumerate(options):
        name, sep, inline = token.partition("=")
        if name in names:
            value = inline if sep else (options[i + 1] if i + 1 < len(options) and not options[i + 1].startswith("-")
                                        else "")
    env = {n: f"PET_{n.lstrip('-').replace('-', '_').upper()}" for n in names}
    return value if value is not None else next((os.environ[e] for e in env.values() if e in os.environ), None)


def _without(options: list[str], *names: str) -> list[str]:
    out, skip = [], False
    for token in options:
        if skip:
            skip = False
            continue
        name, sep, _ = token.partition("=")
        if name in names:
            skip = not sep
            continue
        out.append(token)
    return out


def torchrun_argv(spec: RunSpec) -> list[str]:
    """The arguments for torchrun: the user's options plus tenplex's measured defaults, then the entry shim."""
    options = list(spec.torchrun)
    if spec.in_place:
        from .inplace_launch import local_argv

        options = local_argv(options, _given, _without)[0]
    standalone = _given(options, "--standalone") is not None
    backend = _given(options, "--rdzv-backend", "--rdzv_backend")
    if not standalone:
        if backend is None:
            backend = "c10d"
            options += ["--rdzv-backend", backend]
        if not _given(options, "--rdzv-endpoint", "--rdzv_endpoint"):
            raise ConfigError("tenplex run needs --rdzv-endpoint HOST:PORT of a rendezvous store that no agent owns "
                              "(start one with `tenplex rendezvous serve`), or --standalone for a single node")
    if backend == "c10d" and not standalone:
        conf = dict(DEFAULT_RDZV_CONF)
        # If the agent hosting the c10d store dies, the whole job dies: the store is `tenplex rendezvous serve`.
        conf["is_host"] = "false"
        given = _given(options, "--rdzv-conf", "--rdzv_conf") or ""
        for item in filter(None, given.split(",")):
            key, _, value = item.partition("=")
            conf[key.strip()] = value.strip()
        options = _without(options, "--rdzv-conf", "--rdzv_conf")
        options += ["--rdzv-conf", ",".join(f"{k}={v}" for k, v in conf.items())]
    if _given(options, "--max-restarts", "--max_restarts") is None:
        options += ["--max-restarts", DEFAULT_MAX_RESTARTS]
    return [*options, "--no-python", *entry_command(spec)]


def entry_command(spec: RunSpec) -> list[str]:
    """How each worker starts: through the entry shim (tenplex.elastic.entry), which makes it die with its agent."""
    return [sys.executable, "-u", "-m", "tenplex.elastic.entry", spec.mode, spec.target, *spec.args]


def alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie, killed but not yet reaped by its parent, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().rsplit(")", 1)[-1].split()[0] != "Z"


def advertised_host(bind: str, advertise: str | None) -> str:
    if advertise:
        return advertise
    return socket.gethostname() if bind in ("0.0.0.0", "::") else bind


def _store_files(root: Path) -> tuple[Path, Path, Path]:
    """The node store's port, pid and log files under ``root``."""
    port, pid, log = (root / f".tenplex-store.{x}" for x in ("port", "pid", "log"))
    return port, pid, log


STORE_LOCK_WAIT_S = 300.0  # a holder keeps the store lock while it starts a store (120 s by default) or stops one


@contextlib.contextmanager
def _store_lock(root: Path, wait: float = STORE_LOCK_WAIT_S):
    """Hold ``root``'s store lock: one ``tenplex run`` or ``tenplex store stop`` at a time checks, starts or
    stops the store there, so that two runs starting at once start one store (the kernel drops the lock when
    its holder dies, so a crashed run leaves no stale lock; one stopped or hung keeps it: past ``wait`` seconds
    this raises ``tenplex.flock.LockTimeout`` naming the holder)."""
    with held(root / ".tenplex-store.lock", wait, f"the node store of {root}"):
        yield


def _read_number(path: Path) -> int | None:
    """The integer in ``path``; None when it is missing, empty or garbled (what a crash mid-write leaves)."""
    try:
        return int(path.read_text())
    except (OSError, ValueError):
        return None


def _write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)  # a reader sees the old file or the new one, never a part


def store_pid(root: Path) -> int | None:
    """The pid of the store ``tenplex run`` left serving ``root``; None when none runs (a stale pid file, or
    its pid reused by another program)."""
    root = root.resolve()
    pid = _read_number(_store_files(root)[1])
    if pid is None or not alive(pid):
        return None
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return None
    serves_root = "serve" in argv and any(a == "--root" and b == str(root) for a, b in zip(argv, argv[1:]))
    return pid if serves_root else None


def ensure_store(spec: RunSpec, token: str | None, start_timeout: float = 120.0) -> str:
    """The address of the store serving ``spec.store_root`` for ``spec.host``: a running one, or a new one."""
    root = spec.store_root.resolve()
    root.mkdir(parents=True, exist_ok=True)
    with _store_lock(root):
        return _reuse_or_start_store(spec, root, token, start_timeout)


def _reuse_or_start_store(spec: RunSpec, root: Path, token: str | None, start_timeout: float) -> str:
    from ..runtime.hosts import await_store, spawn_store
    from ..store.client import StoreClient

    port_file, pid_file, log = _store_files(root)
    host = advertised_host(spec.store_bind, spec.store_advertise)
    # Reuse only a store that the pid file says still runs: a stale port may now belong to another server.
    port = _read_number(port_file) if store_pid(root) is not None else None
    if port is not None:
        address = f"{host}:{port}"
        try:
            with StoreClient(address, token=token, timeout=5.0) as client:
                health = client.health(timeout=5.0)
        except Exception:  # noqa: BLE001 -- a stale port file: start a new store below
            health = None
        if health is not None:
            if health["host"] != spec.host or Path(health["root"]).resolve() != root:
                raise ConfigError(f"the store at {address} serves {health['root']} as host {health['host']}, not "
                                  f"{root} as host {spec.host}; use another --store-root or --host")
            return address
    extra = ["--bind", spec.store_bind]
    if spec.token_file is not None:
        extra += ["--token-file", str(spec.token_file)]
    with open(log, "ab") as out:
        proc = spawn_store(root, spec.host, port_file, *extra, stdout=out, detached=True)
    _write_atomically(pid_file, f"{proc.pid}\n")
    port = int(await_store(proc, spec.host, port_file, time.monotonic() + start_timeout, log).rsplit(":", 1)[1])
    return f"{host}:{port}"


def _gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def stop_store(root: Path, timeout: float = 15.0) -> int | None:
    """Stop the store ``tenplex run`` left serving ``root`` (SIGTERM; SIGKILL after ``timeout`` s: its commits
    are atomic) and remove its pid and port files; the pid it stopped, None when none ran."""
    root = root.resolve()
    with _store_lock(root):
        pid = store_pid(root)
        if pid is not None:
            os.kill(pid, signal.SIGTERM)
            if not _gone(pid, timeout):
                os.kill(pid, signal.SIGKILL)
                _gone(pid, timeout)
        port_file, pid_file, _ = _store_files(root)
        pid_file.unlink(missing_ok=True)
        port_file.unlink(missing_ok=True)
    return pid


def worker_env(spec: RunSpec, address: str, token: str | None) -> dict[str, str]:
    env = {"TENPLEX_HOST": spec.host, "TENPLEX_STORE_ROOT": str(spec.store_root.resolve()),
           "TENPLEX_STORE_ADDRESS": address, "TENPLEX_AGENT_PID": str(os.getpid()),
           # c10d rendezvous restarts and scale-ups fail while the agents share the rendezvous store with the
           # workers (upstream pytorch issue 135712).
           "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    if token:
        env["TENPLEX_TOKEN"] = token
    if spec.durable:
        env["TENPLEX_DURABLE"] = spec.durable
    return env


def prepare(spec: RunSpec) -> str:
    """The dataset's view (first: a bad dataset starts nothing), the node's store, and the workers' environment
    (in this process's: the agent passes it on); the store's address."""
    from ..ops import logs

    token = spec.token_file.read_text().strip() if spec.token_file else None
    if spec.token_file and not token:
        raise ConfigError(f"token file {spec.token_file} is empty")
    if spec.dataset is not None and spec.data_mount is not None:
        from .dataview import STATE_DIR, VIEW_ENV, ensure_view

        root = ensure_view(spec.dataset, spec.data_mount, spec.store_root / STATE_DIR)
        os.environ.update({VIEW_ENV: str(spec.data_mount.resolve()), "TENPLEX_DATASET": str(spec.dataset.resolve())})
        logs.line(f"tenplex run: dataset view of {spec.dataset} at {spec.data_mount} (generation "
                  f"{root['generation']}, world {root.get('world') or 'none yet'})", sys.stderr, logger=__name__)
    address = ensure_store(spec, token)
    os.environ.update(worker_env(spec, address, token))
    if spec.in_place:
        from .inplace_launch import local_argv

        os.environ.update(local_argv(spec.torchrun, _given, _without)[1])  # where the workers form the worlds
    return address


def run(argv: list[str]) -> int:
    """Start or reuse the store, set the environment, run the agent; 0 after a planned leave (SIGTERM)."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError, RendezvousTimeoutError
    from torch.distributed.run import main as torchrun_main

    from ..ops import logs

    spec = parse(argv)
    args = torchrun_argv(spec)
    address = prepare(spec)
    logs.line(f"tenplex run: host {spec.host}, store {address} ({spec.store_root}); torchrun {' '.join(args)}",
              sys.stderr, logger=__name__)
    from .restarts import NodeOutOfDevices, tenplex_agent

    try:
        with tenplex_agent(spec.host):
            torchrun_main(args)
    except NodeOutOfDevices as e:
        logs.line(f"tenplex run: {e}; leaving the job", sys.stderr, logging.ERROR, __name__)
        return 1
    except SignalException as e:
        if e.sigval in (signal.SIGTERM, signal.SIGINT):
            logs.line(f"tenplex run: host {spec.host} left the job ({signal.Signals(e.sigval).name})", sys.stderr,
                      logger=__name__)
            return 0
        raise
    except (RendezvousConnectionError, RendezvousTimeoutError) as e:
        # A node cut off from the rendezvous store (a network partition) can join no later world: it leaves.
        logs.line(f"tenplex run: host {spec.host} cannot reach the rendezvous store ({type(e).__name__}: {e}); "
                  f"its workers stopped, leaving the job", sys.stderr, logging.ERROR, __name__)
        return 1
    return 0
