"""The store's contract (``tenplex.store.contract``): the local store keeps it, and code above it works with a
backend that lacks the optional capabilities (as an object store would)."""

from __future__ import annotations

import errno
from typing import Protocol

import pytest
import torch

from tenplex.box import Box
from tenplex.integration.annotate import Annotation
from tenplex.integration.pieces import tensor_pieces
from tenplex.integration.shardio import read_piece, write_piece
from tenplex.planner import plan
from tenplex.store import (FileBackedReader, LinkingWriter, SpaceReportingStore, Store, StoreReader, StoreWriter,
                           TensorStore, VersionWriter)
from tenplex.store.manifest import TRANSFORM_PART
from tenplex.store.service import _check_free_space
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


class _ContractOnly:
    """``inner`` seen through ``protocol`` alone: any attribute the protocol does not declare is missing."""

    def __init__(self, inner, protocol: type):
        self._inner, self._allowed = inner, _members(protocol)

    def __getattr__(self, name: str):
        if name not in self._allowed:
            raise AttributeError(f"{name!r} is not part of the store's contract")
        return getattr(self._inner, name)


def _members(protocol: type) -> set[str]:
    """The public members a protocol and its protocol bases declare."""
    bases = [b for b in protocol.__mro__ if getattr(b, "_is_protocol", False) and b is not Protocol]
    return {name for base in bases for name in vars(base) if not name.startswith("_")}


def test_contract_only_hides_what_the_contract_does_not_declare(tmp_path):
    write_version({"h0": tmp_path}, gpt_layout(1, 1, 1, 1, 1), 1, random_globals(gpt_layout(1, 1, 1, 1, 1)))
    reader = _ContractOnly(Store(tmp_path, "h0").open(1), StoreReader)
    assert reader.json_names() and reader.version == 1
    for outside in ("path", "manifest", "current", "shard_file", "byte_span"):  # VersionReader has them all
        assert not hasattr(reader, outside)


def test_pieces_go_to_and_from_a_store_through_the_contract_alone(tmp_path):
    """shardio needs nothing of the POSIX store beyond ``StoreWriter.put`` and ``StoreReader.read/readinto``."""
    store = Store(tmp_path, "h0")
    full = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    writer = _ContractOnly(store.begin(1), StoreWriter)
    for device, first in (("h0/0", 0), ("h0/1", 3)):  # two column halves
        piece, = tensor_pieces("w", full[:, first:first + 3].contiguous(), Annotation((4, 6), (0, first)))
        write_piece(writer, device, piece)
    writer.commit()
    reader = _ContractOnly(store.open(1), StoreReader)
    target = torch.zeros(2, 6)  # rows 1..2 of the whole tensor: a region of both halves, read in place
    piece, = tensor_pieces("w", target, Annotation((4, 6), (1, 0)))
    read_piece(reader, [("h0/0", Box((1, 0), (2, 3))), ("h0/1", Box((1, 3), (2, 3)))], piece)
    assert torch.equal(target, full[1:3])
    scalar = torch.zeros(())  # a 0-d tensor goes through ``read``, not ``readinto``
    writer = _ContractOnly(store.begin(2), StoreWriter)
    write_piece(writer, "h0/0", tensor_pieces("s", torch.tensor(2.5))[0])
    writer.commit()
    read_piece(_ContractOnly(store.open(2), StoreReader), [("h0/0", Box((), ()))], tensor_pieces("s", scalar)[0])
    assert scalar.item() == 2.5


def test_the_local_store_keeps_the_contract_with_every_capability(tmp_path):
    store = Store(tmp_path, "h0")
    writer = store.begin(1)
    try:
        assert isinstance(store, TensorStore) and isinstance(store, SpaceReportingStore)
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
        store.commit(version, [TRANSFORM_PART])
    assert_version_matches({"h0": tmp_path}, new, 2, arrays)
    assert_version_matches({"h0": tmp_path}, new, 4, arrays)
    old_inodes = {(tmp_path / "versions" / "3" / e.file).stat().st_ino for e in store.open(3).entries}
    assert not old_inodes & {(tmp_path / "versions" / "4" / e.file).stat().st_ino for e in store.open(4).entries}


def test_the_server_checks_free_space_through_the_store_and_only_where_it_can_tell(tmp_path):
    store = Store(tmp_path, "h0")
    _check_free_space(store, 1, "shard 'w'")  # a byte fits
    with pytest.raises(OSError) as full:
        _check_free_space(store, 1 << 62, "shard 'w' [0:4]")
    assert full.value.errno == errno.ENOSPC
    assert "shard 'w' [0:4] needs 4611686018427387904 bytes" in str(full.value) and str(tmp_path) in str(full.value)
    unbounded = _Hiding(store, "free_bytes")  # as an object store: no capacity to report
    assert not isinstance(unbounded, SpaceReportingStore)
    _check_free_space(unbounded, 1 << 62, "shard 'w'")  # not checked: its writes fail on their own
