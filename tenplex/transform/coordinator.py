"""Run a plan across every host's store with a two-phase commit.

May import: ``tenplex.store`` (client and transformer types; never its protobuf), ``tenplex.transfer_plan``,
``tenplex.layout``, ``tenplex.devices``, ``tenplex.errors`` and the standard library.

Phase 1: every destination host (a host of the new layout) stages and
prepares the new version through its store's ``Transform`` RPC, pulling from
the source hosts itself; all hosts run at once. Phase 2, only when every host
prepared: every host commits (concurrently). A failure in phase 1 aborts the staged version
everywhere; a failure in phase 2 deletes the new version from the hosts that
had already committed it. Either way the old version is untouched and the
raised :class:`TransformError` lists every failed host with its cause: the
exception itself (``failures``), the first one recorded also as the error's ``__cause__``.

Dead or partitioned peers are noticed by silence, not by deadlines: a host
whose Transform stream (which carries a heartbeat) or whose answer to a call
stays silent for ``pull_timeout`` seconds has failed, and so has a source
that a destination's pull hears nothing from for that long (the destination
then reads from a replica). A partitioned peer sends no reset, so a deadline
would only fire after minutes. Once one host failed, the others are stopped
at their next progress message (at least every second) instead of finishing
work that will be aborted.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

from ..devices import host_of
from ..errors import ConfigError, TransformError
from ..layout import Layout
from ..transfer_plan import Plan, PlanStats
from ..store.client import StoreClient
from ..store.transformer import TransformProgress, TransformRequest

Progress = Callable[[str, int, int], None]  # (host, bytes done, bytes total)
log = logging.getLogger(__name__)
_COMMIT_THREADS = 64  # concurrent commit calls


def transform(plan: Plan, old_layout: Layout, new_layout: Layout, stores: dict[str, str], old_version: int,
              new_version: int, progress: Progress | None = None, streams: int | None = None, token: str | None = None,
              timeout: float = 3600.0, pull_timeout: float = 5.0, chunk_bytes: int = 0,
              root_certificates: bytes | None = None,
              before_commit: Callable[[], None] | None = None) -> dict:
    """Turn ``old_version`` (laid out as ``old_layout``) into ``new_version`` (``new_layout``) on every host.

    ``stores`` maps each host to its store address. ``progress(host, done, total)``
    is called from worker threads as bytes arrive. ``before_commit`` runs after
    every host prepared and before any commits (orchestration and tests use it).
    ``streams``: concurrent pulls per destination host (None: each host's own default, one per CPU, 2 to 4).
    ``pull_timeout``: seconds a store may stay silent (a pull delivering no
    bytes, a call or a host's progress stream without an answer) before it
    counts as dead; ``timeout`` bounds the whole transformation.
    Returns a report: seconds and, per host, the bytes kept, linked, copied
    locally, pulled remotely and re-fetched from replicas. Tensors the old
    layout lacks (``plan.new_tensors``) get no shards in the new version: the
    job initialises them.
    """
    _check(plan, old_layout, new_layout, stores, old_version, new_version)
    _check_options(streams, chunk_bytes, timeout, pull_timeout)
    started = time.monotonic()
    requests = _requests(plan, old_layout, new_layout, stores, old_version, new_version, streams, chunk_bytes,
                         pull_timeout)
    destinations = list(requests)
    clients = {h: StoreClient(a, token=token, root_certificates=root_certificates, timeout=timeout,
                              stall_timeout=pull_timeout) for h, a in stores.items()}
    outcome = _Outcome()
    log.info("transformation %s -> %s: %d destination host(s), %d transfers", old_version, new_version,
             len(destinations), len(plan.transfers))
    try:
        _prepare_everywhere(clients, requests, outcome, progress, timeout)
        if not outcome.failures and before_commit is not None:
            try:
                before_commit()
            except Exception as e:  # noqa: BLE001
                outcome.failures["coordinator"] = _caused(TransformError(f"before_commit hook failed: {e}"), e)
        if outcome.failures:  # what another transformation staged or committed is its own: left alone
            _abort(clients, [h for h in destinations if h not in outcome.conflicts], new_version, outcome.failures)
            raise _failed("prepare", old_version, new_version, outcome.failures, outcome.conflicts)
        log.info("transformation %s -> %s: every host prepared; committing", old_version, new_version)
        _commit_everywhere(clients, destinations, new_version, outcome)
        if outcome.failures:
            raise _failed("commit", old_version, new_version, outcome.failures, outcome.conflicts)
    finally:
        for client in clients.values():
            client.close()
    return {"old_version": old_version, "new_version": new_version, "seconds": time.monotonic() - started,
            "hosts": {h: r.counts() for h, r in sorted(outcome.results.items())}}


def _check(plan: Plan, old_layout: Layout, new_layout: Layout, stores: dict[str, str], old_version: int,
           new_version: int) -> None:
    """Refuse a transformation that cannot work before any host is touched."""
    if new_version == old_version:
        raise TransformError(f"new version {new_version} must differ from the old version")
    for t in plan.transfers:  # a plan made for other layouts
        if t.dst not in new_layout.devices or (t.source == "old" and t.src not in old_layout.devices):
            raise TransformError(f"the plan does not match the layouts: transfer {t.to_dict()} names a device "
                                 f"that the {'new' if t.dst not in new_layout.devices else 'old'} layout lacks; "
                                 f"plan again with tenplex.planner.plan(old_layout, new_layout)")
    missing = sorted(set(new_layout.hosts()) - set(stores))
    if missing:
        raise TransformError(f"no store address for destination host(s) {missing}; got {sorted(stores)}",
                             {h: ConfigError(f"no store address for host {h}") for h in missing})


def _check_options(streams: int | None, chunk_bytes: int, timeout: float, pull_timeout: float) -> None:
    """Refuse counts below 1 and durations that are not positive, before any host is touched."""
    if streams is not None and (not isinstance(streams, int) or streams < 1):
        raise ConfigError(f"streams must be an integer >= 1 (None: each host's default), got {streams!r}")
    if not isinstance(chunk_bytes, int) or chunk_bytes < 0:
        raise ConfigError(f"chunk_bytes must be an integer >= 1 (0: the default), got {chunk_bytes!r}")
    for name, seconds in (("timeout", timeout), ("pull_timeout", pull_timeout)):
        if not seconds > 0:
            raise ConfigError(f"{name} must be > 0 seconds, got {seconds!r}")


def _requests(plan: Plan, old_layout: Layout, new_layout: Layout, stores: dict[str, str], old_version: int,
              new_version: int, streams: int | None, chunk_bytes: int,
              pull_timeout: float) -> dict[str, TransformRequest]:
    """Each destination host's request (in the new layout's host order), with only its own transfers: the
    whole plan's statistics would not describe them."""
    old_hosts = old_layout.hosts()
    transfers_of: dict[str, list] = {h: [] for h in new_layout.hosts()}
    for t in plan.transfers:
        transfers_of.setdefault(host_of(t.dst), []).append(t)
    return {host: TransformRequest(
        host=host, old_version=old_version, new_version=new_version,
        plan=Plan(tuple(ts), PlanStats(), plan.new_tensors), old_layout=old_layout, new_layout=new_layout,
        peers=stores, streams=streams, chunk_bytes=chunk_bytes or None,
        # The host whose old JSON documents the new version carries: this one when it held old state.
        json_from_host=host if host in old_hosts else next((h for h in old_hosts if h in stores), None),
        stall_timeout_s=pull_timeout) for host, ts in transfers_of.items()}


class _Outcome:
    """What the hosts reported so far, written from their threads."""

    def __init__(self) -> None:
        self.results: dict[str, TransformProgress] = {}
        self.failures: dict[str, BaseException] = {}
        self.conflicts: set[str] = set()  # hosts where another transformation holds or committed the new version
        self.lock = threading.Lock()

    def failed(self, host: str, error: BaseException) -> None:
        with self.lock:
            self.failures[host] = error
            if _conflict(error):
                self.conflicts.add(host)


def _prepare_everywhere(clients: dict[str, StoreClient], requests: dict[str, TransformRequest], outcome: _Outcome,
                        progress: Progress | None, timeout: float) -> None:
    """Phase 1: every destination host stages and prepares its part, all at once, one thread each."""
    def run(host: str) -> None:
        request = requests[host]
        try:
            final = None
            updates = clients[host].transform(request, timeout=timeout)
            try:
                for update in updates:
                    if outcome.failures:  # the transformation fails anyway: stop this host's work now
                        raise _Stopped()
                    if progress is not None:
                        progress(host, update.bytes_done, update.bytes_total)
                    final = update
            finally:
                updates.close()  # drops the call, which cancels it on the store
            if final is None or not final.done:
                raise TransformError(f"store of host {host} ended the transformation without reporting completion")
            with outcome.lock:
                outcome.results[host] = final
        except _Stopped:
            log.info("transformation %s -> %s: stopped host %s after another host failed", request.old_version,
                     request.new_version, host)
        except Exception as e:  # noqa: BLE001 - collected and reported for every host
            # INFO, not WARNING: the TransformError raised later carries every cause; the CLI prints it in one line.
            log.info("transformation %s -> %s failed on host %s", request.old_version, request.new_version, host,
                     exc_info=True)
            outcome.failed(host, e)

    threads = [threading.Thread(target=run, args=(h,), name=f"transform-{h}") for h in requests]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def _commit_everywhere(clients: dict[str, StoreClient], destinations: list[str], version: int,
                       outcome: _Outcome) -> None:
    """Phase 2: every host commits, concurrently (up to ``_COMMIT_THREADS`` at a time: a commit syncs the host's
    directories, and one after the other hundreds of hosts would take a second); when one fails, the hosts
    that committed delete the version again and the others abort it and delete it too (a commit whose answer
    was lost may have landed). A host where another transformation owns the version is left alone. When the
    commits cannot all run (no thread, an interrupt), the same rollback happens before the error is raised."""
    def commit(host: str) -> bool:
        try:
            clients[host].commit(version)
            return True
        except Exception as e:  # noqa: BLE001
            outcome.failed(host, e)
            return False

    done: dict[str, bool] = {}
    stopped: BaseException | None = None
    try:
        with ThreadPoolExecutor(max_workers=min(_COMMIT_THREADS, len(destinations) or 1),
                                thread_name_prefix="commit") as pool:
            futures = {host: pool.submit(commit, host) for host in destinations}
            for host, future in futures.items():
                done[host] = future.result()
    except BaseException as e:  # noqa: BLE001 - rolled back below, then raised again
        stopped = e
        for host in destinations:
            if host not in done and host not in outcome.failures:
                outcome.failed(host, _caused(TransformError(f"commit not confirmed ({type(e).__name__}: {e})"), e))
    committed = [host for host in destinations if done.get(host)]
    if outcome.failures:
        _roll_back(clients, destinations, committed, version, outcome)
    if stopped is not None and not isinstance(stopped, Exception):
        raise stopped


def _roll_back(clients: dict[str, StoreClient], destinations: list[str], committed: list[str], version: int,
               outcome: _Outcome) -> None:
    for host in committed:  # nobody can have used the new version yet: take it back
        try:
            clients[host].delete(version)
        except Exception as e:  # noqa: BLE001
            outcome.failures[host] = _caused(TransformError(f"committed, and could not be rolled back: {e}"), e)
    uncertain = [h for h in destinations if h not in committed and h not in outcome.conflicts]
    # a commit that failed on its way back (a deadline, a lost answer) may have landed: a host that answers the
    # abort is asked to delete as well (one that does not would not answer that either: no second wait on it)
    for host in _abort(clients, uncertain, version, outcome.failures):
        try:
            clients[host].delete(version)
        except Exception:  # noqa: BLE001 - its failure is recorded already
            pass


class _Stopped(Exception):
    """A host's part was stopped because another host failed (not a failure of its own)."""


def _abort(clients: dict[str, StoreClient], hosts: list[str], version: int,
           failures: dict[str, BaseException]) -> list[str]:
    """Abort the staged version on ``hosts``; the hosts that answered."""
    answered = []
    for host in hosts:
        try:
            clients[host].abort(version)
            answered.append(host)
        except Exception as e:  # noqa: BLE001 - its staged files stay invisible; gc removes them
            if host not in failures:
                failures[host] = _caused(TransformError(f"abort failed (staged data stays invisible until gc): {e}"), e)
    return answered


def _caused(error: TransformError, cause: BaseException) -> TransformError:
    error.__cause__ = cause
    return error


def _conflict(error: BaseException) -> bool:
    """A store refused because another transformation runs to, or already committed, the same version."""
    return getattr(getattr(error, "code", None), "name", None) in ("ABORTED", "ALREADY_EXISTS")


def _failed(phase: str, old_version: int, new_version: int, failures: dict[str, BaseException],
            conflicts: set[str] | frozenset[str] = frozenset()) -> TransformError:
    """The error listing every failed host's cause; chained to the first one recorded so its traceback shows."""
    outcome = f"{new_version} was not committed" if not conflicts else \
        (f"another transformation is writing or already committed version {new_version} on "
         f"{', '.join(sorted(conflicts))}; this one left that alone and committed nothing")
    lines = [f"transformation {old_version} -> {new_version} failed in the {phase} phase on "
             f"{len(failures)} host(s); version {old_version} is unchanged; {outcome}:"]
    lines += [f"  {host}: {cause}" for host, cause in sorted(failures.items())]
    return _caused(TransformError("\n".join(lines), failures), next(iter(failures.values())))
