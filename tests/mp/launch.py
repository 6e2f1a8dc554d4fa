"""Start real processes for multi-process tests: tensor store servers and torch.distributed jobs (gloo).

Nothing crosses a process boundary as a pickle: jobs read a JSON spec and
write JSON/safetensors files; store servers are found through port files.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from tenplex.runtime import launch
from tenplex.runtime.hosts import Hosts

ROOT = Path(__file__).resolve().parents[2]
PYTHON = sys.executable


class StoreServers:
    """``tenplex store serve`` processes, one per (root, host); ``addresses`` maps root key -> {host: address}.

    Each key's roots must be ``BASE/HOST`` with one BASE, the layout of :class:`tenplex.runtime.hosts.Hosts`.
    """

    def __init__(self, roots: dict[str, dict[str, Path]]):
        self.groups: list[Hosts] = []
        self.addresses: dict[str, dict[str, str]] = {}
        try:
            for key, hosts in roots.items():
                bases = {root.parent for root in hosts.values()}
                if len(bases) != 1 or any(root.name != host for host, root in hosts.items()):
                    raise ValueError(f"roots of {key!r} must be BASE/HOST with one BASE, got {hosts}")
                group = Hosts(bases.pop())
                self.groups.append(group)
                group.start(*hosts)
                self.addresses[key] = dict(group.addresses)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        for group in self.groups:
            group.stop()


def run_job(world: int, spec: dict, workdir: Path, script: Path | None = None, timeout: float = 400) -> None:
    """Run ``world`` ranks of ``script`` (default: gpt_worker.py) on ``spec`` through the runtime's launcher.

    Workers read their store roots and addresses from the spec, so the launch places every rank on h0.
    """
    script = script or Path(__file__).with_name("gpt_worker.py")
    workdir.mkdir(parents=True, exist_ok=True)
    spec_path = workdir / f"spec-{os.getpid()}-{time.monotonic_ns()}.json"
    spec_path.write_text(json.dumps(spec))
    launch.run_job([PYTHON, str(script), str(spec_path)], [f"h0/{r}" for r in range(world)], {"h0": workdir}, {},
                   workdir / spec_path.stem, timeout=timeout)
