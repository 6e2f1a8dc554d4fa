"""In-place sources (Hugging Face save_to_disk, Parquet, WebDataset, Megatron): samples equal each format's own
library, through the in-process reader, the FUSE view and a packed copy; identities; one-line errors."""

import gc
import io
import json
import os
import pickle
import tarfile

import numpy as np
import pytest

import fuse_vfs
import source_helpers
from tenplex.cli import main
from tenplex.dataset import DatasetError, DatasetState, decode_sample, open_dataset, write_state_file
from tenplex.dataset.reader import open_fallback, open_mounted
from tenplex.dataset.inplace import open_records
from tenplex.dataset.source import read_verified

N = 23


@pytest.fixture(scope="module", autouse=True)
def _cache(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TENPLEX_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
        yield


@pytest.fixture(scope="module")
def sources(tmp_path_factory, _cache):
    root = tmp_path_factory.mktemp("sources")
    paths = {kind: source_helpers.make(kind, root / kind, N) for kind in source_helpers.KINDS}
    return {kind: (path, source_helpers.reference(kind, path)) for kind, path in paths.items()}


def _same(a, b) -> bool:
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return isinstance(a, np.ndarray) and a.dtype == np.asarray(b).dtype and np.array_equal(a, b)
    return a == b


@pytest.mark.parametrize("kind", source_helpers.KINDS)
def test_samples_equal_what_the_library_reads(sources, kind):
    path, expected = sources[kind]
    info = open_dataset(path)
    assert info.num_samples == len(expected) == N
    assert [source_helpers.sample_id(kind, e) for e in expected] == list(range(N))
    records = open_records(info)
    got = [decode_sample(read_verified(records, info, i), info.decode_info()) for i in range(info.num_samples)]
    assert all(_same(g, e) for g, e in zip(got, expected))
    # any byte range of a record file, as the FUSE server asks for pieces, in a DataLoader worker's copy too
    # (sequences overlap by a token: their record file is not their concatenation)
    worker_copy = pickle.loads(pickle.dumps(records))
    rows = info.index[info.index[:, 0] == 0]
    whole = b"".join(read_verified(records, info, i) for i in range(len(rows)))
    for start, length in ((0, len(whole)), (3, 5), (int(rows[1, 1]) - 2, int(rows[2, 2]) + 9), (len(whole) - 4, 4)):
        piece = worker_copy.read(0, int(rows[0, 1]) + start, length)
        assert kind == "megatron-seq" or piece == whole[start:start + length]
    # a rank's in-process view (dp 3, mid-epoch) reads the library's samples of its ids
    state = DatasetState(info.identity, info.num_samples, 5, 8, 4)
    reader = open_fallback(path, state, 3, 1)
    assert len(reader) > 0
    assert all(_same(reader.get(i), expected[s]) for i, s in enumerate(reader.sample_ids.tolist()))
    assert open_dataset(path).identity == info.identity  # the second open comes from the scan cache


@pytest.mark.skipif(fuse_vfs.fuse_unavailable_reason() is not None, reason="FUSE unavailable")
@pytest.mark.parametrize("kind", ["hf", "webdataset", "megatron-seq"])  # encoded rows, tar ranges, token ranges
def test_the_fuse_view_serves_each_source(sources, kind, tmp_path):
    path, expected = sources[kind]
    info = open_dataset(path)
    state = DatasetState(info.identity, info.num_samples, 3, 0, 5)
    write_state_file(tmp_path / "state.json", state, dp=2)
    (tmp_path / "mnt").mkdir()
    handle = fuse_vfs.mount(path, tmp_path / "mnt", tmp_path / "state.json", log_path=tmp_path / "log")
    try:
        seen = []
        for rank in range(2):
            reader = open_mounted(tmp_path / "mnt", rank)
            ids = reader.sample_ids.tolist()
            assert ids == open_fallback(path, state, 2, rank).sample_ids.tolist()
            assert all(_same(reader.get(i), expected[s]) for i, s in enumerate(ids))
            seen += ids
            reader.close()
        assert sorted(seen) == sorted(set(seen)) and len(seen) == state.epoch_length
    finally:
        gc.collect()
        handle.unmount(lazy=True, timeout=20)


@pytest.mark.parametrize("kind", ["parquet", "megatron"])
def test_pack_from_a_source_keeps_every_sample(sources, kind, tmp_path):
    path, expected = sources[kind]
    source = "megatron" if kind.startswith("megatron") else kind
    assert main(["data", "pack", "--from", source, str(path), str(tmp_path / "packed"), "--quiet"]) == 0
    info = open_dataset(tmp_path / "packed")
    assert info.source == "records" and info.num_samples == len(expected)
    records = open_records(info)
    assert all(_same(decode_sample(read_verified(records, info, i), info.decode_info()), e)
               for i, e in enumerate(expected))


def test_a_changed_source_has_another_identity_and_damage_is_named(tmp_path):
    path = source_helpers.make("megatron", tmp_path / "m", N)
    info = open_dataset(path)
    data = path / "corpus.bin"
    raw = bytearray(data.read_bytes())
    st = data.stat()
    raw[0] ^= 0xFF
    data.write_bytes(bytes(raw))
    assert open_dataset(path).identity != info.identity  # what a job saved a position for is refused
    # the same size and times (a change the scan cache cannot see): the read names the sample and offset
    os.utime(data, ns=(st.st_atime_ns, st.st_mtime_ns))
    with pytest.raises(DatasetError, match=r"corpus\.bin: sample 0 at offset 0 .*checksum mismatch"):
        read_verified(open_records(info), info, 0)
    data.write_bytes(bytes(raw[:-3]))
    with pytest.raises(DatasetError, match=r"corpus\.bin: document \d+ .*runs past the end"):
        open_dataset(path)
    data.unlink()
    with pytest.raises(DatasetError, match=r"corpus\.bin: missing"):
        open_dataset(path)


@pytest.mark.parametrize("tar_format", [tarfile.PAX_FORMAT, tarfile.GNU_FORMAT, tarfile.USTAR_FORMAT])
def test_the_quick_tar_decoder_reads_what_tarfile_reads(tar_format):
    from tenplex.dataset.encodings import _decode_plain_tar, _decode_with_tarfile, decode_tar

    def tar(members) -> bytes:
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w", format=tar_format) as out:
            for name, data in members:
                info = tarfile.TarInfo(name)
                info.size, info.mtime = len(data), 1_700_000_000
                out.addfile(info, io.BytesIO(data))
        return buf.getvalue()
    plain = tar([("dir/k1.txt", b"hi"), ("dir/k1.CLS", b"3" * 600), ("__meta__", b"x"), ("dir/k1.e", b"")])
    assert _decode_plain_tar(plain) == _decode_with_tarfile(plain) == {
        "__key__": "dir/k1", "txt": b"hi", "cls": b"3" * 600, "e": b""}
    long = tar([("d" * 120 + "/k.txt", b"long")])  # a pax or GNU long-name header: tarfile decodes it
    assert decode_tar(long) == {"__key__": "d" * 120 + "/k", "txt": b"long"}


def test_damaged_sources_fail_in_one_line(tmp_path):
    shards = source_helpers.make("webdataset", tmp_path / "w", 6)
    first = sorted(shards.glob("*.tar"))[0]
    first.write_bytes(first.read_bytes()[:700])
    (tmp_path / "idx").mkdir()
    (tmp_path / "idx" / "c.idx").write_bytes(b"MMIDIDX\x00\x00" + b"\x01" * 40)
    (tmp_path / "idx" / "c.bin").write_bytes(b"")
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "dataset_dict.json").write_text("{}")
    spec = tmp_path / "s.json"
    spec.write_text(json.dumps({"format": "tenplex.source/1", "source": "megatron", "path": "idx/c", "seq_len": 0}))
    for path, message in [(shards, r"shard-000\.tar: not a readable tar shard"),
                          (tmp_path / "idx", r"c\.idx: index version"),
                          (tmp_path / "hf", r"a Hugging Face DatasetDict; give one split's directory"),
                          (spec, r"seq_len must be a positive integer"),
                          (tmp_path / "nothing", r"no such dataset directory or source file")]:
        with pytest.raises(DatasetError, match=message) as caught:
            open_dataset(path)
        assert "\n" not in str(caught.value)


def test_the_step_loader_yields_each_step_once_and_keeps_the_position_of_steps_done(sources):
    """job.loader()'s machinery without a job: 2 prefetching workers over a fallback view; a restart at the
    position of the steps done (what a new world does) yields the rest of the epoch, none of what was
    prefetched beyond it."""
    from tenplex.dataset.state import StateError
    from tenplex.dataset.torch_data import RankBatchSampler, RankDataset, StepLoader

    path, expected = sources["megatron-seq"]
    info = open_dataset(path)
    start = DatasetState(info.identity, info.num_samples, 2, 0, 4)  # 5 steps of 4 in an epoch of 23
    job = {"step": 0}

    def stretch():
        state = start.advance(job["step"])
        data = RankDataset.fallback(info, state, 2, 0)
        return job["step"], data, list(RankBatchSampler(data))

    def loader():
        return StepLoader(stretch, lambda: job["step"], lambda: start.advance(job["step"]),
                          num_workers=2, prefetch_factor=2)

    seen = []
    for batch in loader():  # a world that stops after 2 of 5 steps: its workers prefetched more
        seen.append(batch[1])
        job["step"] += 1
        if job["step"] == 2:
            break
    saved = loader().state_dict()
    assert saved["position"] == 8
    for batch in loader():  # the next world, at the saved position
        assert [int(t[0]) // source_helpers.SEQ_LEN for t in batch[2]] == batch[1]
        seen.append(batch[1])
        job["step"] += 1
        if job["step"] == 5:
            break
    mine = open_fallback(path, start, 2, 0)
    assert sum(seen, []) == mine.sample_ids.tolist()  # rank 0's share of the epoch, each sample once, in order
    loader().load_state_dict(start.advance(5).to_dict())
    with pytest.raises(StateError, match="loader state is at position 8"):
        loader().load_state_dict(saved)


_GUIDE = os.path.join(os.path.dirname(__file__), "..", "docs", "guides", "datasets.md")


def test_the_guides_megatron_snippet_runs(sources, tmp_path, monkeypatch):
    """The guide's Megatron block, verbatim (test_docs leaves it to this test: megatron-core imports slowly)."""
    marker = "<!-- tested-by: tests/test_dataset_sources.py::test_the_guides_megatron_snippet_runs -->\n```python\n"
    text = open(_GUIDE).read()
    assert text.count(marker) == 1
    code = text.split(marker)[1].split("\n```\n")[0]
    monkeypatch.chdir(tmp_path)
    exec(compile(code, f"{_GUIDE} (Megatron block)", "exec"), {"__name__": "__guide__"})
    assert open_dataset(tmp_path / "corpus.source.json").num_samples == 12
