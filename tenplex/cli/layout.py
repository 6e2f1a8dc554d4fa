"""``tenplex layout``: write the layout of a built-in model under a parallel configuration.

May import: ``tenplex.gpt``, ``tenplex.ptc``, ``tenplex.parallel``, ``tenplex.dtypes``,
``tenplex.files``, ``tenplex.errors`` and the standard library.
"""

from __future__ import annotations

import argparse
import json
import sys

from ..dtypes import ITEMSIZE
from ..errors import ConfigError
from ..files import save_layout
from ..gpt import gpt
from ..parallel import SHARDING_MODES, ParallelConfig, parse_degrees
from ..ptc import layout
from .units import human_bytes


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "layout", help="write the layout of a built-in model under a parallel configuration",
        description="Compute which device holds which box of every tensor (parameters and optimizer states) of a "
                    "built-in model, and write it as tenplex.layout/1 JSON.")
    parser.add_argument("--model", choices=["gpt"], default="gpt", help="built-in partition rules (default gpt)")
    parser.add_argument("--layers", type=int, required=True, help="transformer layers")
    parser.add_argument("--hidden", type=int, required=True, help="hidden size")
    parser.add_argument("--heads", type=int, required=True, help="attention heads")
    parser.add_argument("--vocab", type=int, required=True, help="vocabulary size (unpadded)")
    parser.add_argument("--ffn", type=int, help="MLP inner size (default 4 * hidden)")
    parser.add_argument("--optimizer", choices=["adam", "none"], default="none",
                        help="add optimizer states (adam: exp_avg and exp_avg_sq per parameter)")
    parser.add_argument("--dtype", choices=sorted(ITEMSIZE), default="float32", help="parameter dtype")
    parser.add_argument("--tied", action="store_true",
                        help="tie embedding and head (embedding on first and last stage)")
    parser.add_argument("--gated", action="store_true", help="fused gate|up MLP input projection (SwiGLU-style)")
    parser.add_argument("--vocab-pad-multiple", type=int, default=1, metavar="M",
                        help="pad the vocabulary to a multiple of M * tp in local tensors (default 1)")
    parser.add_argument("--parallel", required=True, metavar="dp=D,tp=T,pp=P", help="parallel degrees")
    parser.add_argument("--sharding", choices=SHARDING_MODES, default="none",
                        help="sharded data parallelism: none, optimizer (ZeRO-1) or full (FSDP/ZeRO-3)")
    parser.add_argument("--stages", metavar="N,N,…", help="layers per pipeline stage (default: as even as possible)")
    parser.add_argument("--hosts", type=int, required=True, help="number of hosts (named h0, h1, …)")
    parser.add_argument("--devices-per-host", type=int, required=True, help="devices on each host")
    parser.add_argument("-o", "--output", metavar="FILE", help="write the layout here (default: stdout)")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    degrees = parse_degrees(args.parallel)
    world = degrees["dp"] * degrees["tp"] * degrees["pp"]
    available = args.hosts * args.devices_per_host
    if world != available:
        raise ConfigError(f"--parallel {args.parallel} needs {world} devices, but --hosts {args.hosts} x "
                          f"--devices-per-host {args.devices_per_host} gives {available}")
    stages = None
    if args.stages:
        try:
            stages = tuple(int(n) for n in args.stages.split(","))
        except ValueError:
            raise ConfigError(f"--stages {args.stages!r} should be comma-separated layer counts, e.g. 3,3,2") from None
    config = ParallelConfig.on_hosts(degrees["dp"], degrees["tp"], degrees["pp"], args.hosts, args.devices_per_host,
                                     sharding=args.sharding, stage_layers=stages)
    ptc = gpt(args.layers, args.hidden, args.heads, args.vocab, args.ffn, dtype=args.dtype,
              optimizer=args.optimizer, tied=args.tied, gated=args.gated, vocab_pad_multiple=args.vocab_pad_multiple)
    result = layout(ptc, config)
    if args.output is None:
        json.dump(result.to_dict(), sys.stdout, separators=(",", ":"))
        print()
        return 0
    save_layout(result, args.output)
    boxes = sum(len(shards) for shards in result.devices.values())
    held = sum(result.device_bytes(d) for d in result.devices)
    print(f"wrote {args.output}: {len(result.tensors)} tensors ({human_bytes(result.total_bytes())}), "
          f"{config.describe()}, {boxes} boxes, {human_bytes(held)} held in all")
    return 0
