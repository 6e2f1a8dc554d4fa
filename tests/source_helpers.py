"""Small datasets in each in-place source format, written with the format's own library, and its reference reader.

``make(kind, dir, n)`` writes ``n`` samples and returns the path to open; ``reference(kind, path)``
returns the samples as the source's own library reads them, in the source's order, decoded the way
tenplex decodes them (``decode_sample``). Sample ``i`` carries ``i`` (``sample_id``): an id column, the
tar key, a document of ``i`` tokens, or the tokens ``0, 1, 2, ...`` cut into sequences.
"""

from __future__ import annotations

import io
import json
import tarfile
import warnings
from pathlib import Path

import numpy as np

KINDS = ("hf", "parquet", "webdataset", "megatron", "megatron-seq")
SEQ_LEN = 7


def _rows(n: int) -> dict:
    rng = np.random.default_rng(n)
    return {"id": list(range(n)), "text": [f"sample {i} " + "x" * int(rng.integers(0, 40)) for i in range(n)],
            "tokens": [rng.integers(0, 1000, int(rng.integers(1, 9))).tolist() for _ in range(n)]}


def make(kind: str, out: Path, n: int) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    if kind == "hf":
        import datasets
        datasets.Dataset.from_dict(_rows(n)).save_to_disk(str(out / "hf"))
        return out / "hf"
    if kind == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq
        (out / "pq").mkdir()
        table = pa.table(_rows(n))
        half = n // 2
        pq.write_table(table.slice(0, half), out / "pq" / "part-0.parquet", row_group_size=5)
        pq.write_table(table.slice(half), out / "pq" / "part-1.parquet", row_group_size=7)
        return out / "pq"
    if kind == "webdataset":
        import webdataset as wds
        (out / "wds").mkdir()
        with wds.ShardWriter(str(out / "wds" / "shard-%03d.tar"), maxcount=max(1, n // 3)) as sink:
            for i in range(n):
                sink.write({"__key__": f"s{i:05d}", "txt": f"caption {i}".encode(),
                            "cls": str(i % 10).encode(), "bin": bytes(range(i % 256)) * 3})
        return out / "wds"
    with warnings.catch_warnings():  # megatron-core's builder converts tensors the way numpy 2 warns about
        warnings.simplefilter("ignore", DeprecationWarning)
        return _megatron(out, n, seq_len=SEQ_LEN if kind == "megatron-seq" else None)


def _megatron(out: Path, n: int, seq_len: int | None) -> Path:
    import torch
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder
    rng = np.random.default_rng(n)
    (out / "mg").mkdir()
    builder = IndexedDatasetBuilder(str(out / "mg" / "corpus.bin"), dtype=np.uint16)
    if seq_len is None:  # document i: a random number of tokens, all i
        docs = [np.full(int(rng.integers(1, 20)), i, dtype=np.int64) for i in range(n)]
    else:  # tokens 0, 1, 2, ... in documents of random lengths: exactly n sequences of seq_len + 1
        tokens = np.arange(n * seq_len + 1, dtype=np.int64)
        docs = np.split(tokens, np.sort(rng.choice(np.arange(1, len(tokens)), n // 2, replace=False)))
    for doc in docs:
        builder.add_document(torch.from_numpy(doc), [len(doc)])
    builder.finalize(str(out / "mg" / "corpus.idx"))
    if seq_len is None:
        return out / "mg"
    spec = out / "corpus.source.json"
    spec.write_text(json.dumps({"format": "tenplex.source/1", "source": "megatron", "path": "mg/corpus",
                                "seq_len": seq_len}))
    return spec


def sample_id(kind: str, sample) -> int:
    """The id a sample of ``make(kind, ...)`` carries."""
    if kind in ("hf", "parquet"):
        return sample["id"]
    if kind == "webdataset":
        return int(sample["__key__"][1:])
    return int(sample[0]) // (SEQ_LEN if kind == "megatron-seq" else 1)


def reference(kind: str, path: Path) -> list:
    """Every sample, read by the format's own library."""
    if kind == "hf":
        import datasets
        ds = datasets.load_from_disk(str(path))
        return [ds[i] for i in range(len(ds))]
    if kind == "parquet":
        import pyarrow.parquet as pq
        return [row for f in sorted(path.glob("*.parquet")) for row in pq.read_table(f).to_pylist()]
    if kind == "webdataset":
        import webdataset as wds
        urls = [str(p) for p in sorted(path.glob("*.tar"))]
        where = ("__url__", "__local_path__")  # where webdataset read a sample, not the sample
        return [{k: v for k, v in s.items() if k not in where} for s in wds.WebDataset(urls, shardshuffle=False)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.datasets.indexed_dataset import IndexedDataset
    if kind == "megatron":
        ds = IndexedDataset(str(path / "corpus"), mmap=True)
        return [np.array(ds[i]) for i in range(len(ds))]  # copies: ds unmaps its file when collected
    spec = json.loads(path.read_text())
    return gpt_sequences(IndexedDataset(str(path.parent / spec["path"]), mmap=True), spec["seq_len"])


def gpt_sequences(ds, seq_len: int) -> list[np.ndarray]:
    """Megatron GPTDataset's samples for one epoch over the documents in file order (no shuffles): its
    ``helpers.build_sample_idx`` and the assembly of ``_query_document_sample_shuffle_indices``."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.datasets import helpers
    sizes = np.asarray(ds.sequence_lengths, dtype=np.int32)
    docs = np.arange(len(sizes), dtype=np.int32)
    index = helpers.build_sample_idx(sizes, docs, seq_len, 1, int(sizes.sum()), True, True)
    out = []
    for i in range(len(index) - 1):
        (d0, o0), (d1, o1) = index[i], index[i + 1]
        if d0 == d1:
            parts = [ds.get(int(docs[d0]), offset=int(o0), length=int(o1 - o0 + 1))]
        else:
            parts = [ds.get(int(docs[d]), offset=int(o0) if d == d0 else 0,
                            length=None if d < d1 else int(o1 + 1)) for d in range(d0, d1 + 1)]
        out.append(np.concatenate(parts))
    return out


def tar_member_bytes(sample: dict) -> bytes:
    """A sample dict as a tar stream (for corrupting tests)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for field, value in sample.items():
            if field.startswith("__"):
                continue
            info = tarfile.TarInfo(f"{sample['__key__']}.{field}")
            info.size = len(value)
            tar.addfile(info, io.BytesIO(value))
    return buf.getvalue()
