"""A real Prometheus (Debian's ``prometheus`` package) for the metrics tests: on loopback, a temporary config
and storage directory, a 0.5 s scrape interval; its HTTP API answers the tests' queries."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from tenplex.ports import free_port


def prometheus_binary() -> str:
    """The prometheus command; without it the test fails in CI (scripts/setup.sh installs it) and skips here."""
    found = shutil.which("prometheus")
    if found is None:
        message = "Prometheus is not installed: apt-get install -y prometheus (scripts/setup.sh does)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return found


class Prometheus:
    def __init__(self, workdir: Path, targets: list[str]):
        workdir.mkdir(parents=True, exist_ok=True)
        config = workdir / "prometheus.yml"
        config.write_text(json.dumps({  # YAML is a superset of JSON
            "global": {"scrape_interval": "500ms", "scrape_timeout": "400ms"},
            "scrape_configs": [{"job_name": "tenplex", "static_configs": [{"targets": targets}]}]}))
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(workdir / "prometheus.log", "wb")
        self.proc = subprocess.Popen([prometheus_binary(), f"--config.file={config}",
                                      f"--storage.tsdb.path={workdir / 'data'}",
                                      f"--web.listen-address=127.0.0.1:{self.port}"],
                                     stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while not self._ready():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                pytest.fail(f"Prometheus did not start: {(workdir / 'prometheus.log').read_text()[-2000:]}")
            time.sleep(0.1)

    def _ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as reply:
                return reply.status == 200
        except OSError:
            return False

    def query(self, expression: str) -> list[tuple[dict, float]]:
        """(labels, value) of each series of an instant query."""
        url = f"{self.url}/api/v1/query?" + urllib.parse.urlencode({"query": expression})
        with urllib.request.urlopen(url, timeout=10) as reply:
            doc = json.load(reply)
        assert doc["status"] == "success", doc
        return [(r["metric"], float(r["value"][1])) for r in doc["data"]["result"]]

    def await_query(self, expression: str, predicate, deadline_s: float = 60.0) -> list[tuple[dict, float]]:
        """The query's result once ``predicate(result)`` holds (the last result when the deadline passes)."""
        deadline = time.monotonic() + deadline_s
        while True:
            result = self.query(expression)
            if predicate(result) or time.monotonic() > deadline:
                return result
            time.sleep(0.25)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
