"""``tenplex data``: pack a dataset, inspect it, write a dataset state, and plan which rank reads what.

May import: ``tenplex.dataset``, ``tenplex.errors``, numpy (to check ``--dtype``) and the standard library.
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import numpy as np

from ..dataset import DatasetState, open_dataset, pack, upcoming_batches, write_state_file
from ..dataset.inplace import SOURCES
from ..dataset.pack import DEFAULT_FILE_BYTES, pack_source
from ..errors import UsageError


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("data", help="pack datasets and plan each data-parallel rank's samples")
    sub = parser.add_subparsers(dest="data_command", metavar="ACTION", required=True)

    p = sub.add_parser("pack", help="build a record dataset from .npy/.npz files, a .jsonl, a token .bin, or a "
                                    "Hugging Face, Parquet, WebDataset or Megatron dataset (--from)",
                       description="Build a record dataset from a directory of .npy/.npz files (one sample "
                                   "each), a .jsonl file (one sample per line), or a tokenised .bin of "
                                   "fixed-length sequences (--seq-len, --dtype). With --from, copy a dataset "
                                   "that tenplex can also read in place: a Hugging Face save_to_disk directory, "
                                   "a directory of Parquet files or of WebDataset .tar shards, or a Megatron "
                                   "indexed dataset (.bin + .idx: documents, or with --seq-len GPT training "
                                   "sequences).")
    p.add_argument("source")
    p.add_argument("output", help="new or empty output directory")
    p.add_argument("--from", dest="source_kind", choices=SOURCES,
                   help="the source's format (read in place otherwise; see docs/guides/datasets.md)")
    p.add_argument("--seq-len", type=int, help="tokens per sequence (token .bin input, or --from megatron)")
    p.add_argument("--dtype", help="token dtype, e.g. uint16 or int32 (token .bin input)")
    p.add_argument("--file-bytes", type=int, default=DEFAULT_FILE_BYTES, help="record file size limit")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(handler=_pack)

    p = sub.add_parser("info", help="validate a dataset and print its metadata and identity")
    p.add_argument("dataset")
    p.set_defaults(handler=_info)

    p = sub.add_parser("state", help="write a dataset state file (what `tenplex vfs mount --state` serves)")
    p.add_argument("dataset")
    _state_arguments(p)
    p.add_argument("-o", "--output", required=True, help="state file to write")
    p.set_defaults(handler=_state)

    p = sub.add_parser("plan", help="print each rank's sample ids for the next K global batches",
                       description="Prints, for each dp rank, the sample ids it reads in the next K global "
                                   "batches, the batches themselves, and the position afterwards. The "
                                   "position counts samples consumed since the start of epoch 0.")
    p.add_argument("--num-samples", type=int, required=True)
    _state_arguments(p)
    p.add_argument("--steps", type=int, required=True, help="number of global batches K")
    p.add_argument("--json", action="store_true",
                   help='print {"ranks": [...], "batches": [...], "position": P} only')
    p.set_defaults(handler=_plan)


def _degree(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a data-parallel degree (an integer >= 1)")
    return value


def _state_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--seed", type=int, required=True)
    p.add_argument("--global-batch", type=int, required=True)
    p.add_argument("--dp", type=_degree, required=True, help="data-parallel degree (>= 1)")
    p.add_argument("--position", type=int, default=0,
                   help="samples consumed since the start of epoch 0 (a global-batch boundary)")
    p.add_argument("--keep-last", action="store_true", help="keep each epoch's final partial batch")


def _pack(args: argparse.Namespace) -> int:
    if args.dtype is not None:
        try:
            np.dtype(args.dtype)
        except TypeError:
            raise UsageError(f"--dtype {args.dtype!r} is not a numpy dtype name; use e.g. uint16 or int32") from None
    if args.source_kind is not None:
        if args.dtype is not None:
            raise UsageError("--dtype is for a token .bin; a --from source records its own dtype")
        info = pack_source(args.source, args.output, args.source_kind, seq_len=args.seq_len,
                           file_bytes=args.file_bytes, quiet=args.quiet)
    else:
        info = pack(args.source, args.output, seq_len=args.seq_len, dtype=args.dtype, file_bytes=args.file_bytes,
                    quiet=args.quiet)
    print(f"packed {info.num_samples} samples ({info.kind}) into {len(info.files)} record file(s) in "
          f"{info.root}; identity {info.identity}")
    return 0


def _info(args: argparse.Namespace) -> int:
    info = open_dataset(args.dataset)
    print(json.dumps({"identity": info.identity, **info.metadata}, indent=2))
    return 0


def _state(args: argparse.Namespace) -> int:
    info = open_dataset(args.dataset)
    state = DatasetState(info.identity, info.num_samples, args.seed, args.position, args.global_batch,
                         not args.keep_last)
    write_state_file(args.output, state, args.dp)
    print(f"wrote {args.output}: epoch {state.epoch}, position {state.position}, dp {args.dp}")
    return 0


def _plan(args: argparse.Namespace) -> int:
    state = DatasetState("", args.num_samples, args.seed, args.position, args.global_batch, not args.keep_last)
    result = upcoming_batches(state, args.dp, args.steps)
    if args.json:
        print(json.dumps(result))
        return 0
    after = dataclasses.replace(state, position=result["position"])
    print(f"epoch {state.epoch} position {state.position} -> epoch {after.epoch} position {after.position}")
    for k, batch in enumerate(result["batches"]):
        print(f"batch {k}: {batch}")
    for r, ids in enumerate(result["ranks"]):
        print(f"rank {r}: {ids}")
    return 0
