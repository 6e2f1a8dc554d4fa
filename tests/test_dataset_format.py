"""Record format and packing: round trips from every input kind, numpy-only reads, and refused bad input."""

import json
import zlib

import numpy as np
import pytest

from tenplex.dataset import DatasetError, decode_sample, open_dataset, pack
from tenplex.dataset.reader import open_fallback
from tenplex.dataset.source import LocalRecords, read_verified
from tenplex.dataset.state import DatasetState, StateError
from tenplex.dataset.statefile import check_state_matches, load_state_file, write_state_file


def _tokens(tmp_path, n=50, seq=8, dtype=np.uint16):
    toks = np.random.default_rng(0).integers(0, 1000, (n, seq)).astype(dtype)
    toks.tofile(tmp_path / "tokens.bin")
    return toks


def test_token_bin_round_trip_read_with_numpy_only(tmp_path):
    toks = _tokens(tmp_path)
    info = pack(tmp_path / "tokens.bin", tmp_path / "ds", seq_len=8, dtype="uint16", file_bytes=200)
    assert info.num_samples == 50 and len(info.files) > 1  # 16-byte records, 200-byte files
    # The README's recipe: only numpy and plain file reads.
    meta = json.loads((tmp_path / "ds" / "dataset.json").read_text())
    index = np.load(tmp_path / "ds" / "index.npy")
    for i in (0, 17, 49):
        f, off, length, crc = index[i]
        with open(tmp_path / "ds" / meta["files"][f]["name"], "rb") as fh:
            fh.seek(off)
            raw = fh.read(length)
        assert zlib.crc32(raw) == crc
        np.testing.assert_array_equal(np.frombuffer(raw, dtype=meta["dtype"]).reshape(meta["shape"]), toks[i])
        np.testing.assert_array_equal(decode_sample(raw, info.decode_info()), toks[i])


def test_npy_npz_and_jsonl_inputs(tmp_path):
    (tmp_path / "arrays").mkdir()
    arrays = [np.arange(i + 1, dtype=np.float32) * i for i in range(5)]
    for i, a in enumerate(arrays):
        np.save(tmp_path / "arrays" / f"{i:03d}.npy", a)
    info = pack(tmp_path / "arrays", tmp_path / "ds1")
    src = LocalRecords(info)
    assert info.kind == "npy"
    for i, a in enumerate(arrays):
        np.testing.assert_array_equal(decode_sample(read_verified(src, info, i), info.decode_info()), a)

    (tmp_path / "z").mkdir()
    np.savez(tmp_path / "z" / "a.npz", x=np.ones(3), y=np.arange(2))
    info = pack(tmp_path / "z", tmp_path / "ds2")
    sample = decode_sample(read_verified(LocalRecords(info), info, 0), info.decode_info())
    assert set(sample) == {"x", "y"} and sample["y"].tolist() == [0, 1]

    lines = [{"text": f"line {i}", "n": i} for i in range(7)]
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n\n")
    info = pack(tmp_path / "d.jsonl", tmp_path / "ds3")
    assert info.num_samples == 7 and info.kind == "json"
    assert [decode_sample(read_verified(LocalRecords(info), info, i), info.decode_info())
            for i in range(7)] == lines


def test_bad_inputs_are_refused(tmp_path):
    (tmp_path / "bad.jsonl").write_text('{"a": 1}\nnot json\n')
    with pytest.raises(DatasetError, match="line 2"):
        pack(tmp_path / "bad.jsonl", tmp_path / "o1")
    (tmp_path / "t.bin").write_bytes(b"\0" * 17)
    with pytest.raises(DatasetError, match="whole number of sequences"):
        pack(tmp_path / "t.bin", tmp_path / "o2", seq_len=4, dtype="uint16")
    (tmp_path / "mix").mkdir()
    np.save(tmp_path / "mix" / "a.npy", np.ones(1))
    np.savez(tmp_path / "mix" / "b.npz", a=np.ones(1))
    with pytest.raises(DatasetError, match="mixes"):
        pack(tmp_path / "mix", tmp_path / "o3")
    (tmp_path / "garbage").mkdir()
    (tmp_path / "garbage" / "x.npy").write_bytes(b"not an array")
    with pytest.raises(DatasetError, match="x.npy"):
        pack(tmp_path / "garbage", tmp_path / "o4")


def test_truncated_index_names_the_file(tmp_path):
    _tokens(tmp_path)
    pack(tmp_path / "tokens.bin", tmp_path / "ds", seq_len=8, dtype="uint16")
    index = tmp_path / "ds" / "index.npy"
    index.write_bytes(index.read_bytes()[:-40])
    with pytest.raises(DatasetError, match=r"index\.npy.*truncated"):
        open_dataset(tmp_path / "ds")


def test_edited_index_is_refused(tmp_path):
    _tokens(tmp_path)
    pack(tmp_path / "tokens.bin", tmp_path / "ds", seq_len=8, dtype="uint16")
    index = tmp_path / "ds" / "index.npy"
    raw = bytearray(index.read_bytes())
    raw[-3] ^= 0xFF
    index.write_bytes(bytes(raw))
    with pytest.raises(DatasetError, match="sha256"):
        open_dataset(tmp_path / "ds")


def test_truncated_record_file_names_file_and_offset(tmp_path):
    _tokens(tmp_path)
    pack(tmp_path / "tokens.bin", tmp_path / "ds", seq_len=8, dtype="uint16")
    rec = tmp_path / "ds" / "records-00000.bin"
    with open(rec, "r+b") as f:
        f.truncate(100)
    with pytest.raises(DatasetError, match=r"records-00000\.bin: 100 bytes, expected 800.*offset 100"):
        open_dataset(tmp_path / "ds")


def test_corrupt_record_gives_file_and_offset_never_garbage(tmp_path):
    _tokens(tmp_path)
    info = pack(tmp_path / "tokens.bin", tmp_path / "ds", seq_len=8, dtype="uint16")
    victim = int(np.nonzero(info.index[:, 1] == 48)[0][0])  # the sample at offset 48 of records-00000.bin
    with open(tmp_path / "ds" / "records-00000.bin", "r+b") as f:
        f.seek(50)
        f.write(b"\xff")
    info = open_dataset(tmp_path / "ds")  # sizes are intact: the damage shows at read time
    with pytest.raises(DatasetError, match=rf"records-00000\.bin: sample {victim} at offset 48 .*checksum"):
        read_verified(LocalRecords(info), info, victim)
    state = DatasetState(info.identity, info.num_samples, seed=0, position=0, global_batch=5)
    reader = open_fallback(info, state, dp=1, rank=0)
    pos = int(np.nonzero(reader.sample_ids == victim)[0][0])
    with pytest.raises(DatasetError, match="checksum"):
        reader.read(pos)


def test_path_traversal_in_metadata_is_refused(tmp_path):
    _tokens(tmp_path)
    pack(tmp_path / "tokens.bin", tmp_path / "ds", seq_len=8, dtype="uint16")
    meta_path = tmp_path / "ds" / "dataset.json"
    meta = json.loads(meta_path.read_text())
    for bad in ("../tokens.bin", "/etc/passwd", "..", "sub/records-00000.bin", ".hidden"):
        meta["files"][0]["name"] = bad
        meta_path.write_text(json.dumps(meta))
        with pytest.raises(DatasetError, match="not a plain file name"):
            open_dataset(tmp_path / "ds")


def test_hand_edited_sizes_in_metadata_name_the_file_and_field(tmp_path):
    _tokens(tmp_path)
    pack(tmp_path / "tokens.bin", tmp_path / "ds", seq_len=8, dtype="uint16")
    meta_path = tmp_path / "ds" / "dataset.json"
    meta = json.loads(meta_path.read_text())
    for bad in ("12x", -1, 3.5, None, True):
        meta["files"][0]["bytes"] = bad
        meta_path.write_text(json.dumps(meta))
        with pytest.raises(DatasetError, match=r"dataset\.json: files\[0\] \(records-00000\.bin\) has \"bytes\": "):
            open_dataset(tmp_path / "ds")


def test_identity_tracks_content(tmp_path):
    _tokens(tmp_path)
    a = pack(tmp_path / "tokens.bin", tmp_path / "a", seq_len=8, dtype="uint16")
    b = pack(tmp_path / "tokens.bin", tmp_path / "b", seq_len=8, dtype="uint16")
    c = pack(tmp_path / "tokens.bin", tmp_path / "c", seq_len=4, dtype="uint16")
    assert a.identity == b.identity != c.identity
    with pytest.raises(DatasetError, match="not empty"):
        pack(tmp_path / "tokens.bin", tmp_path / "a", seq_len=8, dtype="uint16")


def test_failed_pack_leaves_nothing_behind_so_a_retry_works(tmp_path):
    (tmp_path / "bad.jsonl").write_text('{"a": 1}\nnot json\n')   # one record written before the error
    with pytest.raises(DatasetError, match="line 2"):
        pack(tmp_path / "bad.jsonl", tmp_path / "new")
    assert not (tmp_path / "new").exists()                        # it created the directory: gone
    (tmp_path / "mine").mkdir()
    with pytest.raises(DatasetError, match="line 2"):
        pack(tmp_path / "bad.jsonl", tmp_path / "mine")
    assert (tmp_path / "mine").is_dir() and not list((tmp_path / "mine").iterdir())  # the user's dir stays
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(DatasetError, match="no samples"):
        pack(tmp_path / "empty.jsonl", tmp_path / "mine")
    assert not list((tmp_path / "mine").iterdir())
    (tmp_path / "good.jsonl").write_text('{"a": 1}\n{"a": 2}\n')
    info = pack(tmp_path / "good.jsonl", tmp_path / "mine")       # the retry into the same output works
    assert info.num_samples == 2
    assert decode_sample(read_verified(LocalRecords(info), info, 1), info.decode_info()) == {"a": 2}


def test_state_file_round_trip_and_mismatch(tmp_path):
    _tokens(tmp_path)
    info = pack(tmp_path / "tokens.bin", tmp_path / "ds", seq_len=8, dtype="uint16")
    state = DatasetState(info.identity, 50, 3, 10, 5)
    write_state_file(tmp_path / "s.json", state, dp=2)
    assert load_state_file(tmp_path / "s.json", info) == (state, 2)
    write_state_file(tmp_path / "s.json", DatasetState("", 50, 3, 10, 5), dp=2)
    with pytest.raises(StateError, match="state is for dataset"):   # a mount insists on the identity
        load_state_file(tmp_path / "s.json", info)
    check_state_matches(DatasetState("", 50, 3, 10, 5), info)        # the in-process reader does not
    with pytest.raises(DatasetError, match="state has 40 samples"):
        check_state_matches(DatasetState(info.identity, 40, 3, 10, 5), info)
    (tmp_path / "s.json").write_text(json.dumps({**state.to_dict(), "dp": 0}))
    with pytest.raises(StateError, match="'dp' must be a positive integer"):
        load_state_file(tmp_path / "s.json", info)
