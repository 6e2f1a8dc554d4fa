"""The store's contract (``tenplex.store.contract``): the local store keeps it, and code above it works with a
backend that lacks the optional capabilities (as an object store would)."""

from __future__ import annotations

from tenplex.planner import plan
from tenplex.store import (FileBackedReader, LinkingWriter, Store, StoreReader, StoreWriter, TensorStore,
                           VersionWriter)
from tenplex.transform import TransformRequest
from tenplex.transform.host import run_host_part

from store_helpers import assert_version_matches, gpt_layout, random_globals, write_version


class _WithoutLinks:
    """A store whose writers cannot hard-link and whose readers are not file-backed; everything else is the local
    store's."""

    def __init__(self, store: Store):
        self._store = store

    def __getattr__(self, name: str):
        return getattr(self._store, name)

    def begin(self, version: int, part: str | None = None):
        return _Hiding(self._store.begin(version, part), "link")

    def open(self, version: int):
        return _Hiding(self._store.open(version), "link_file", "shard_file", "byte_span")


class _Hiding:
    def __init__(self, inner, *hidden: str):
        self._inner, self._hidden = inner, hidden

    def __getattr__(self, name: str):
        if name in self._hidden:
            raise AttributeError(name)
        return getattr(self._inner, name)


def test_the_local_store_keeps_the_contract_with_both_capabilities(tmp_path):
    store = Store(tmp_path, "h0")
    writer = store.begin(1)
    try:
        assert isinstance(store, TensorStore)
        assert isinstance(writer, StoreWriter) and isinstance(writer, LinkingWriter)
    finally:
        writer.abort()
    write_version({"h0": tmp_path}, gpt_layout(1, 1, 1, 1, 1), 1, random_globals(gpt_layout(1, 1, 1, 1, 1)))
    reader = store.open(1)
    assert isinstance(reader, StoreReader) and isinstance(reader, FileBackedReader)


def test_the_writer_does_not_import_the_local_store():
    """The store hands its writers a staging directory and a publish function: ``writer`` needs no ``local``."""
    import ast
    import inspect

    import tenplex.store.writer as writer_module

    tree = ast.parse(inspect.getsource(writer_module))
    imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert "local" not in imported and "tenplex.store.local" not in imported
    assert list(inspect.signature(VersionWriter).parameters) == ["staging", "version", "part", "publish"]


def _transform_on_one_host(store, old, new, version: int):
    request = TransformRequest(host="h0", old_version=version, new_version=version + 1, plan=plan(old, new),
                               old_layout=old, new_layout=new, peers={"h0": "127.0.0.1:1"})
    return run_host_part(store, request, lambda progress: None)


def test_a_store_without_links_gets_kept_shards_copied_not_linked(tmp_path):
    old = gpt_layout(1, 2, 1, 1, 2)   # tp=2 on h0/0 and h0/1
    new = gpt_layout(1, 2, 1, 1, 2)   # the same: every new shard is a whole old shard
    arrays = random_globals(old, seed=3)
    write_version({"h0": tmp_path}, old, 1, arrays)
    write_version({"h0": tmp_path}, old, 3, arrays)

    linked = _transform_on_one_host(Store(tmp_path, "h0"), old, new, 1)
    assert linked.linked_bytes == linked.bytes_total > 0 and linked.kept_bytes == 0

    without = _WithoutLinks(Store(tmp_path, "h0"))
    assert not isinstance(without.begin(9), LinkingWriter)
    without.abort(9)
    copied = _transform_on_one_host(without, old, new, 3)
    assert copied.linked_bytes == 0 and copied.kept_bytes == copied.bytes_total == linked.bytes_total

    store = Store(tmp_path, "h0")
    for version in (2, 4):  # prepared by the transformer; the coordinator commits
        store.commit(version, ["transform"])
    assert_version_matches({"h0": tmp_path}, new, 2, arrays)
    assert_version_matches({"h0": tmp_path}, new, 4, arrays)
    old_inodes = {(tmp_path / "versions" / "3" / e.file).stat().st_ino for e in store.open(3).entries}
    assert not old_inodes & {(tmp_path / "versions" / "4" / e.file).stat().st_ino for e in store.open(4).entries}
