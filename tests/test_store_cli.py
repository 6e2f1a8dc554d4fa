"""`tenplex store …` end to end: serve through the real entry point, ls, gc, transform with progress, TLS + token."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from tenplex.files import save_layout, save_plan
from tenplex.planner import plan
from tenplex.store.client import RemoteStoreError, StoreClient

from store_helpers import StoreProcess, assert_version_matches, gpt_layout, random_globals, write_version

TENPLEX = str(Path(sys.executable).with_name("tenplex"))


def _run(*args, check=True):
    done = subprocess.run([TENPLEX, "store", *args], capture_output=True, text=True, timeout=300)
    if check:
        assert done.returncode == 0, done.stderr
    return done


def test_serve_ls_transform_gc_through_the_cli(tmp_path):
    old = gpt_layout(2, 2, 1, 2, 2)
    new = gpt_layout(1, 4, 1, 2, 2)
    roots = {h: tmp_path / h for h in ("h0", "h1")}
    arrays = random_globals(old, seed=11)
    write_version(roots, old, 1, arrays, docs={"step": {"step": 5}})
    procs = {h: StoreProcess(roots[h], h, full_cli=True) for h in roots}
    try:
        stores = ",".join(f"{h}={p.address}" for h, p in procs.items())
        save_plan(plan(old, new), tmp_path / "plan.json")
        save_layout(old, tmp_path / "old.json")
        save_layout(new, tmp_path / "new.json")
        done = _run("transform", str(tmp_path / "plan.json"), str(tmp_path / "old.json"), str(tmp_path / "new.json"),
                    "--stores", stores, "--old-version", "1", "--new-version", "2")
        report = json.loads(done.stdout)
        assert report["new_version"] == 2 and set(report["hosts"]) == {"h0", "h1"}
        assert "h0" in done.stderr and "h1" in done.stderr  # one progress bar per host
        assert_version_matches(roots, new, 2, arrays)
        health = json.loads(_run("ls", procs["h0"].address).stdout)
        assert health["host"] == "h0" and health["versions"] == [1, 2]
        listing = _run("ls", procs["h1"].address, "--version", "2").stdout
        assert "h1/0\t" in listing and "json: layout, step" in listing
        assert json.loads(_run("gc", procs["h0"].address, "--keep", "1").stdout) == {"deleted": [1]}
        missing = _run("ls", procs["h0"].address, "--version", "1", check=False)
        assert missing.returncode == 2 and "NOT_FOUND" in missing.stderr and "no committed version 1" in missing.stderr
    finally:
        for p in procs.values():
            p.stop()


def test_stores_without_addresses_is_a_clear_error(tmp_path):
    old, new = gpt_layout(1, 2, 1, 1, 2), gpt_layout(1, 1, 1, 1, 1)
    save_plan(plan(old, new), tmp_path / "plan.json")
    save_layout(old, tmp_path / "old.json")
    save_layout(new, tmp_path / "new.json")
    done = _run("transform", str(tmp_path / "plan.json"), str(tmp_path / "old.json"), str(tmp_path / "new.json"),
                "--stores", "h0", "--old-version", "1", "--new-version", "2", check=False)
    assert done.returncode == 2 and "--stores" in done.stderr and "'h0' has no '='" in done.stderr


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs openssl to make a test certificate")
def test_tls_with_token_off_loopback(tmp_path):
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
                    "-days", "1", "-subj", "/CN=localhost", "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost"],
                   check=True, capture_output=True)
    token = tmp_path / "token"
    token.write_text("tls-token")
    old = gpt_layout(1, 2, 1, 1, 2)
    new = gpt_layout(1, 2, 1, 2, 1)
    roots = {h: tmp_path / h for h in ("h0", "h1")}
    arrays = random_globals(old, seed=12)
    write_version(roots, old, 1, arrays)
    tls = ("--tls-cert", str(cert), "--tls-key", str(key), "--tls-ca", str(cert))
    procs = {h: StoreProcess(roots[h], h, token_file=token, bind="0.0.0.0", extra_args=tls) for h in roots}
    try:
        with StoreClient(procs["h0"].address, token="tls-token", root_certificates=cert.read_bytes()) as client:
            assert client.versions() == [1]
        with StoreClient(procs["h0"].address, token="tls-token", timeout=5) as plaintext:
            with pytest.raises(RemoteStoreError) as info:
                plaintext.versions()
            assert info.value.code == grpc.StatusCode.UNAVAILABLE
        from tenplex.transform import transform
        transform(plan(old, new), old, new, {h: p.address for h, p in procs.items()}, 1, 2, token="tls-token",
                  root_certificates=cert.read_bytes())
        assert_version_matches(roots, new, 2, arrays)
    finally:
        for p in procs.values():
            p.stop()
