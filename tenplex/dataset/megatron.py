"""Megatron-LM indexed datasets (``PREFIX.bin`` + ``PREFIX.idx``) read in place: documents, or GPT sequences.

May import: numpy, the standard library and ``tenplex.dataset`` (format, scanning).

The ``.idx`` (``MMIDIDX`` version 1, little endian)::

    b"MMIDIDX\\x00\\x00"  <Q version = 1  <B dtype code  <Q sequence count S  <Q document count D
    int32[S] sequence lengths (tokens)   int64[S] sequence byte pointers into .bin   int64[D] document indices

dtype codes: 1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 6 float64, 7 float32, 8 uint16. A *document*
here is what ``IndexedDataset[i]`` returns: sequence ``i`` (for text, one per document).

Two modes:

- ``seq_len`` absent: sample ``i`` is document ``i``, its tokens (``kind`` tensor, shape ``[-1]``).
- ``seq_len`` given: fixed-length training sequences as Megatron's ``GPTDataset`` builds them with
  ``helpers.build_sample_idx`` over the documents in file order, for one epoch: sample ``i`` holds
  tokens ``[i * seq_len, (i + 1) * seq_len + 1)`` of the documents concatenated (the ``+ 1`` is
  ``add_extra_token_to_sequence``, on by default; ``"extra_token": false`` turns it off), so there are
  ``(tokens - extra) // seq_len`` samples and the last partial one is dropped
  (``drop_last_partial_sequence``). Supported: those two options. Not supported: Megatron's own
  document and sample shuffles (tenplex orders the sequences per epoch with its seeded permutation
  instead), several epochs of its index, blends and splits (one ``.bin``/``.idx`` pair, all of it), and
  multimodal indices. Since the documents lie back to back in ``.bin``, a sequence is one byte range.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

import numpy as np

from .format import DatasetError
from .scanning import range_crcs

ENCODER_VERSION = "1"
HEADER = b"MMIDIDX\x00\x00"
_FIXED = struct.Struct("<QBQQ")   # version, dtype code, sequence count, document count
DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32,
          8: np.uint16}


def layout(spec: dict[str, Any]) -> tuple[Path, list[str], dict[str, Any]]:
    """The directory, the ``.bin`` and ``.idx`` names and the options of a Megatron source spec."""
    path = Path(spec["path"])
    if path.is_dir():
        prefixes = sorted(p.name[:-4] for p in path.glob("*.idx"))
        if len(prefixes) != 1:
            raise DatasetError(f"{path}: {len(prefixes)} Megatron indices (*.idx) here; name one with a source "
                               f"file: {{\"format\": \"tenplex.source/1\", \"source\": \"megatron\", "
                               f"\"path\": \"{path}/PREFIX\"}}")
        root, prefix = path, prefixes[0]
    else:
        root, prefix = path.parent, path.name.removesuffix(".bin").removesuffix(".idx")
    for suffix in (".bin", ".idx"):
        if not (root / f"{prefix}{suffix}").is_file():
            raise DatasetError(f"{root / prefix}{suffix}: missing (a Megatron dataset is PREFIX.bin + PREFIX.idx)")
    options: dict[str, Any] = {}
    seq_len = spec.get("seq_len")
    if seq_len is not None:
        if type(seq_len) is not int or seq_len <= 0:
            raise DatasetError(f"{root / prefix}: seq_len must be a positive integer, got {seq_len!r}")
        extra = spec.get("extra_token", True)
        if not isinstance(extra, bool):
            raise DatasetError(f"{root / prefix}: extra_token must be true or false, got {extra!r}")
        options = {"seq_len": seq_len, "extra_token": extra}
    return root, [f"{prefix}.bin", f"{prefix}.idx"], options


def read_index(path: Path) -> tuple[np.dtype, np.ndarray, np.ndarray, np.ndarray]:
    """dtype, sequence lengths (int32), pointers (int64) and document indices (int64) of an ``.idx``."""
    raw = path.read_bytes()
    head = len(HEADER) + _FIXED.size
    if raw[:len(HEADER)] != HEADER or len(raw) < head:
        raise DatasetError(f"{path}: not a Megatron index (no MMIDIDX header)")
    version, code, count, docs = _FIXED.unpack_from(raw, len(HEADER))
    if version != 1 or code not in DTYPES:
        raise DatasetError(f"{path}: index version {version} / dtype code {code} is not supported (version 1, "
                           f"codes {sorted(DTYPES)})")
    want = head + count * 12 + docs * 8
    if count and len(raw) == want + count:
        raise DatasetError(f"{path}: a multimodal index (sequence modes); only text indices are supported")
    if len(raw) != want:
        raise DatasetError(f"{path}: {len(raw)} bytes, expected {want} for {count} sequences and {docs} "
                           "document indices (truncated or damaged)")
    lengths = np.frombuffer(raw, np.int32, count, head)
    pointers = np.frombuffer(raw, np.int64, count, head + count * 4)
    documents = np.frombuffer(raw, np.int64, docs, head + count * 12)
    return np.dtype(DTYPES[code]), lengths, pointers, documents


def scan(root: Path, files: list[str], options: dict[str, Any]) -> tuple[dict[str, Any], np.ndarray, None]:
    bin_path, idx_path = root / files[0], root / files[1]
    dtype, lengths, pointers, _ = read_index(idx_path)
    item = dtype.itemsize
    nbytes = lengths.astype(np.int64) * item
    size = bin_path.stat().st_size
    ends = pointers + nbytes
    if len(ends) and (pointers.min() < 0 or ends.max() > size):
        bad = int(np.nonzero((pointers < 0) | (ends > size))[0][0])
        raise DatasetError(f"{bin_path}: document {bad} at byte {pointers[bad]} length {nbytes[bad]} runs past "
                           f"the end of the file ({size} bytes; truncated?)")
    meta = {"kind": "tensor", "dtype": dtype.str, "documents": int(len(lengths))}
    if "seq_len" not in options:
        offsets, lens = pointers.astype(np.int64), nbytes
        meta["shape"] = [-1]
    else:
        contiguous = np.array_equal(pointers, np.concatenate(([0], np.cumsum(nbytes)[:-1])).astype(np.int64))
        if len(pointers) and not contiguous:
            raise DatasetError(f"{idx_path}: documents are not back to back in {bin_path.name}; sequences need "
                               "the layout Megatron's builder writes")
        seq_len, extra = options["seq_len"], int(options["extra_token"])
        tokens = int(lengths.sum(dtype=np.int64))
        count = max(0, (tokens - extra) // seq_len)
        offsets = np.arange(count, dtype=np.int64) * seq_len * item
        lens = np.full(count, (seq_len + extra) * item, dtype=np.int64)
        meta["shape"] = [seq_len + extra]
    crcs = range_crcs(bin_path, offsets, lens)
    index = np.stack([np.zeros(len(offsets), np.int64), offsets, lens, crcs], axis=1).astype(np.int64)
    return meta, index.reshape(-1, 4), None
