"""``evict:all@STEP`` in ``tenplex demo --elastic``: the whole job is lost and a new job restores from the bucket.

May import: ``tenplex.durable`` (the bucket client and moto's server on loopback), ``tenplex.errors`` and the
standard library (no torch).

When a schedule has an eviction, every node flushes its saves to a bucket of moto's S3 server on loopback
(``TENPLEX_DURABLE`` and the ``AWS_*`` endpoint and credentials in every node's environment). At the event,
the demo waits until the save of the step the job reached is durable, kills every node (agent, workers, store),
deletes every store root, and starts :data:`RESTART_NODES` new nodes under a new rendezvous id: a new job,
whose stores are empty, restores the newest durable version from the bucket (into its own configuration).
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path
from typing import Callable, Iterator

from ..errors import ConfigError

# The new job after an eviction: three new nodes, so that the state comes back under another configuration than
# the default schedule's two nodes (world 6: the demo pins tp=2,pp=3).
RESTART_NODES = 3
BUCKET, PREFIX = "tenplex-demo", "elastic"
# A flush of the demo's GPT (a few MB per host) to moto takes a second or two here; a minute means it failed.
DURABLE_WAIT_S = 60.0


def require_moto() -> None:
    """Raise :class:`~tenplex.errors.ConfigError` (one line) where moto's S3 server cannot be started."""
    try:
        import moto  # noqa: F401 -- only whether it is there: the server runs in a process of its own
    except ImportError:
        raise ConfigError("evict:all needs moto's S3 server for the job's bucket: pip install 'moto[server]' "
                          "(or 'tenplex[test]')") from None


def fresh_hosts(used: set[str], n: int = RESTART_NODES) -> list[str]:
    """The new job's nodes: the first ``n`` names ``hN`` that no node of the schedule used before."""
    names = (f"h{i}" for i in range(len(used) + n + 1))
    return [h for h in names if h not in used][:n]


@contextlib.contextmanager
def demo_bucket(base: Path) -> Iterator[dict[str, str]]:
    """moto's S3 server on loopback with the job's bucket; yields the environment that points a node (and this
    process, while it lasts: :func:`wait_durable` reads the bucket) at it."""
    from ..durable.testserver import create_bucket, start_s3_server, stop

    with open(base / "s3.log", "ab") as log:
        proc, endpoint = start_s3_server(log=log)
    try:
        create_bucket(endpoint, BUCKET)
        env = {"TENPLEX_DURABLE": f"s3://{BUCKET}/{PREFIX}", "AWS_ENDPOINT_URL": endpoint,
               "AWS_ACCESS_KEY_ID": "demo", "AWS_SECRET_ACCESS_KEY": "demo", "AWS_REGION": "us-east-1"}
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            yield env
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
    finally:
        stop(proc)


def wait_durable(saves: Callable[[], list[dict]], step: int, running: Callable[[], bool]) -> dict:
    """Wait until the job recorded a save of ``step`` (or later) and the newest save is in the bucket; return
    ``{"version", "step"}`` of that save (``saves()``: the saves recorded so far; ``running()``: whether any node
    still runs). Raises :class:`TimeoutError` after :data:`DURABLE_WAIT_S`."""
    from ..durable import Bucket, DurableError, durable_versions

    bucket = Bucket(os.environ["TENPLEX_DURABLE"], timeout_s=10)
    deadline = time.monotonic() + DURABLE_WAIT_S
    while time.monotonic() < deadline and running():
        newest = max(saves(), key=lambda s: s["version"], default=None)
        if newest is not None and newest["step"] >= step:
            try:
                if newest["version"] in durable_versions(bucket):
                    return {"version": newest["version"], "step": newest["step"]}
            except DurableError:
                pass  # moto busy: ask again
        time.sleep(0.2)
    raise TimeoutError(f"the save of step {step} did not become durable in {DURABLE_WAIT_S:g} s")
