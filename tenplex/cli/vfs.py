"""``tenplex vfs``: mount a dataset's per-rank views with FUSE, switch them, unmount.

May import: ``fuse_vfs`` (lazily, so ``tenplex`` works without FUSE), ``tenplex.dataset``
and the standard library.
"""

from __future__ import annotations

import argparse
import json


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("vfs", help="mount per-rank dataset views with FUSE, switch, unmount")
    sub = parser.add_subparsers(dest="vfs_command", metavar="ACTION", required=True)

    p = sub.add_parser("mount", help="mount DATASET at MOUNTPOINT, serving the state in --state",
                       description="Mounts a read-only view: MOUNTPOINT/rank{r}/{data,index.npy,state.json} "
                                   "for each dp rank. Runs the server in the background and returns once "
                                   "mounted (or stays in the foreground with --foreground).")
    p.add_argument("dataset")
    p.add_argument("mountpoint")
    p.add_argument("--state", required=True, help="state file written by `tenplex data state`")
    p.add_argument("--foreground", action="store_true", help="serve in this process until unmounted")
    p.add_argument("--log", help="server log file (background mode)")
    p.add_argument("--store", help="read record files from a remote tenplex store (host:port)")
    p.add_argument("--cache-dir", help="local read cache directory for --store")
    p.add_argument("--allow-other", action="store_true", help="let other users read the mount")
    p.add_argument("--libfuse", choices=("auto", "3", "2"),
                   help="libfuse to serve with (default: $TENPLEX_LIBFUSE, else auto: libfuse3 when installed, "
                        "which reads up to 896 KiB per request, else libfuse2)")
    p.set_defaults(handler=_mount)

    p = sub.add_parser("switch", help="switch a mount to a new dp degree and/or position, atomically")
    p.add_argument("mountpoint")
    p.add_argument("--dp", type=int)
    p.add_argument("--position", type=int, help="samples consumed since the start of epoch 0")
    p.set_defaults(handler=_switch)

    p = sub.add_parser("status", help="print the mount's state.json")
    p.add_argument("mountpoint")
    p.set_defaults(handler=_status)

    p = sub.add_parser("unmount", help="unmount (fusermount3 -u)")
    p.add_argument("mountpoint")
    p.add_argument("--lazy", action="store_true", help="detach even while files are open (fusermount -z)")
    p.set_defaults(handler=_unmount)


def _mount(args: argparse.Namespace) -> int:
    import os

    import fuse_vfs
    if args.foreground:
        if args.libfuse:
            os.environ["TENPLEX_LIBFUSE"] = args.libfuse  # read when the server imports mfusepy, just below
        from fuse_vfs.server import main
        argv = [args.dataset, args.mountpoint, "--state", args.state]
        argv += ["--store", args.store] if args.store else []
        argv += ["--cache-dir", args.cache_dir] if args.cache_dir else []
        argv += ["--allow-other"] if args.allow_other else []
        return main(argv)
    handle = fuse_vfs.mount(args.dataset, args.mountpoint, args.state, log_path=args.log, store=args.store,
                            cache_dir=args.cache_dir, allow_other=args.allow_other, libfuse=args.libfuse)
    root = fuse_vfs.read_root(handle.mountpoint)
    print(f"mounted {args.dataset} at {handle.mountpoint}: generation {root['generation']}, dp {root['dp']}, "
          f"position {root['state']['position']}, libfuse {root['libfuse']} (server pid {handle.pid}, "
          f"log {handle.log_path})")
    return 0


def _switch(args: argparse.Namespace) -> int:
    import fuse_vfs
    root = fuse_vfs.switch(args.mountpoint, dp=args.dp, position=args.position)
    print(f"{args.mountpoint}: generation {root['generation']}, dp {root['dp']}, "
          f"position {root['state']['position']} (epoch {root['state']['epoch']})")
    return 0


def _status(args: argparse.Namespace) -> int:
    import fuse_vfs
    print(json.dumps(fuse_vfs.read_root(args.mountpoint), indent=2))
    return 0


def _unmount(args: argparse.Namespace) -> int:
    import fuse_vfs
    fuse_vfs.unmount(args.mountpoint, lazy=args.lazy)
    print(f"unmounted {args.mountpoint}")
    return 0
