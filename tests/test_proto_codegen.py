"""The committed gRPC/protobuf code matches proto/ (regenerate with `make proto`), and the hand-framed chunks
are standard protobuf."""

from __future__ import annotations

import re

import numpy as np
from hypothesis import given, settings, strategies as st

from tenplex.box import Box
from tenplex.store import codegen, wire
from tenplex.store._proto import store_pb2 as pb

# Lines that record the generator's version rather than the schema; a newer grpcio-tools changes only these.
_VERSION_LINES = re.compile(r"^(# Protobuf Python Version:.*|GRPC_GENERATED_VERSION = .*|\s+\d+,)$", re.M)


def _normalise(text: str) -> str:
    return _VERSION_LINES.sub("<version>", text)


def test_generated_code_is_up_to_date(tmp_path):
    fresh = {p.name: p.read_text() for p in codegen.generate(tmp_path / "out")}
    committed = {p.name: p.read_text() for p in codegen.OUTPUT.glob("*.py")}
    assert sorted(fresh) == sorted(committed), "generated file set changed: run `make proto` and commit"
    for name, text in fresh.items():
        assert _normalise(text) == _normalise(committed[name]), \
            f"tenplex/store/_proto/{name} is stale: run `make proto` (python -m tenplex.store.codegen) and commit"


def test_generated_grpc_module_imports_the_package_local_messages():
    from tenplex.store._proto import store_pb2_grpc
    assert store_pb2_grpc.tenplex_dot_v1_dot_store__pb2 is pb
    assert pb.DESCRIPTOR.package == "tenplex.v1"


@settings(max_examples=60, deadline=None)
@given(st.binary(max_size=300), st.lists(st.integers(0, 2**40), min_size=0, max_size=4), st.integers(0, 2**64 - 1))
def test_hand_framed_chunk_is_standard_protobuf(data, offsets, digest):
    box = Box(tuple(offsets), tuple(o % 7 for o in offsets))
    index = len(offsets)
    head = pb.Chunk(box=wire.to_pb_box(box), xxh3=digest, index=index).SerializeToString()
    raw = wire.encode_with_data(head, data)
    parsed = pb.Chunk.FromString(raw)  # what any generated stub would see
    assert parsed.data == data and parsed.xxh3 == digest and wire.from_pb_box(parsed.box) == box
    assert parsed.index == index
    sub, got_digest, view, got_index = wire.decode_chunk(
        pb.Chunk(box=wire.to_pb_box(box), xxh3=digest, data=data, index=index).SerializeToString())
    assert (sub, got_digest, bytes(view), got_index) == (box, digest, data, index)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), st.integers(0, 6)), min_size=0, max_size=4),
       st.sampled_from([1, 2, 4, 8]), st.integers(1, 400), st.integers(0, 400))
def test_split_box_covers_the_box_exactly_in_small_chunks(dims, itemsize, max_bytes, lead):
    box = Box(tuple(d[0] for d in dims), tuple(d[1] for d in dims))
    pieces = list(wire.split_box(box, itemsize, max_bytes, lead))
    assert all(box.contains(p) for p in pieces)
    assert all(p.volume * itemsize <= max_bytes or p.volume == 1 for p in pieces)
    if box.volume:
        marks = np.zeros(box.lengths, dtype=int)
        for p in pieces:
            marks[p.local(box).slices()] += 1
        assert (marks == 1).all()  # every element exactly once: disjoint and complete
    else:
        assert pieces == [box]
    firsts = [np.ravel_multi_index(p.local(box).offsets, box.lengths) for p in pieces if p.volume]
    assert firsts == sorted(firsts)  # in C order: a reader places them one after the other


def test_split_box_lead_puts_frame_ends_on_the_grid():
    """Rows of 16 bytes, cells of 64 (4 rows): a run whose first byte is 48 bytes into a cell starts with one
    row, then whole cells; a lead that is no whole number of rows, or a box of several runs, is cut as before."""
    rows = lambda pieces: [(p.offsets[0], p.lengths[0]) for p in pieces]  # noqa: E731
    box = Box((10, 0), (11, 4))
    assert rows(wire.split_box(box, 4, 64)) == [(10, 4), (14, 4), (18, 3)]
    assert rows(wire.split_box(box, 4, 64, lead=48)) == [(10, 1), (11, 4), (15, 4), (19, 2)]
    assert rows(wire.split_box(box, 4, 64, lead=64 + 48)) == [(10, 1), (11, 4), (15, 4), (19, 2)]
    assert rows(wire.split_box(box, 4, 64, lead=40)) == [(10, 4), (14, 4), (18, 3)]  # 2.5 rows: no grid
    assert rows(wire.split_box(box, 4, 60, lead=48)) == [(10, 3), (13, 3), (16, 3), (19, 2)]  # 3.75 rows a cell
    several = Box((0, 0, 0), (2, 11, 4))  # two runs of rows (dimension 0 has length 2)
    assert [(p.offsets[:2], p.lengths[1]) for p in wire.split_box(several, 4, 64, lead=48)] == \
        [((0, 0), 4), ((0, 4), 4), ((0, 8), 3), ((1, 0), 4), ((1, 4), 4), ((1, 8), 3)]
    assert list(wire.split_box(Box((0, 0), (2, 4)), 4, 64, lead=48)) == [Box((0, 0), (2, 4))]  # fits: one piece
