"""The FUSE server process: mount, follow the state file, serve until unmounted.

May import: ``fuse_vfs`` (fs, preflight, errors, binding), ``tenplex.dataset``, ``tenplex.files``
and the standard library. Run as ``python -m fuse_vfs.server DATASET MOUNTPOINT --state FILE``
(``tenplex vfs mount`` does this); it stays in the foreground until the mount is unmounted.

The state file (``tenplex.dataset-state/1`` plus ``"dp"``) is the only control
channel: writing a new one atomically (``tenplex vfs switch``) makes the server
build the new generation aside and then switch to it in one step. Every load,
good or bad, bumps ``loads`` in ``/state.json``; a bad state file leaves the
current view in place and sets ``state_error``.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
from pathlib import Path
from typing import Any

from tenplex.dataset.format import DatasetError, DatasetInfo
from tenplex.dataset.inplace import open_dataset, open_records
from tenplex.dataset.source import RecordSource
from tenplex.dataset.state import StateError
from tenplex.dataset.statefile import load_state_file_world

from . import binding
from .errors import VfsError
from .fs import LIBFUSE_VERSION, MAX_READ, ROOT_FORMAT, Generation, TenplexFS, build_generation
from .preflight import check_fuse, check_mountpoint

POLL_S = 0.05
DATASET_CHECK_EVERY = 10  # polls between checks that the dataset is unchanged (0.5 s)


def _stat_key(path: Path) -> tuple[int, int, int] | None:
    try:
        st = path.stat()
    except FileNotFoundError:
        return None
    return st.st_ino, st.st_size, st.st_mtime_ns


class Server:
    def __init__(self, dataset: str, mountpoint: str, state_file: str, source: RecordSource | None = None,
                 info: DatasetInfo | None = None):
        self.info = info or open_dataset(dataset)
        self.source = source or open_records(self.info)
        self.mountpoint, self.state_file = Path(mountpoint), Path(state_file).resolve()
        self.loads, self.state_error = 1, None  # type: int, str | None
        self._state_key = _stat_key(self.state_file)
        state, dp, world = load_state_file_world(self.state_file, self.info)
        self._meta_keys = self._dataset_keys()
        self.stop = threading.Event()
        self.fs = TenplexFS(self.info, self.source, build_generation(self.info, state, dp, 1, world),
                            self.root_doc, self.watch)

    def _dataset_keys(self) -> list[Any]:
        return [_stat_key(p) for p in self.info.metadata_paths()]

    def root_doc(self) -> dict[str, Any]:
        gen: Generation = self.fs.generation
        return {"format": ROOT_FORMAT, "generation": gen.number, "world": gen.world, "dp": gen.dp,
                "state": gen.state.to_dict(),
                "dataset": self.info.identity, "dataset_path": str(self.info.root),
                "state_file": str(self.state_file), "loads": self.loads, "state_error": self.state_error,
                "error": self.fs.error, "pid": os.getpid(), "libfuse": LIBFUSE_VERSION}

    def reload(self) -> None:
        """Build the generation of the current state file aside, then switch to it (or record why not)."""
        try:
            state, dp, world = load_state_file_world(self.state_file, self.info)
            gen = build_generation(self.info, state, dp, self.fs.generation.number + 1, world)
            self.fs.switch(gen)
            self.state_error = None
            print(f"tenplex vfs: generation {gen.number}: dp={dp} position={state.position} "
                  f"epoch={state.epoch}" + (f" world={world}" if world else ""), file=sys.stderr, flush=True)
        except (StateError, DatasetError, ValueError, OSError) as e:
            self.state_error = str(e)
            print(f"tenplex vfs: kept generation {self.fs.generation.number}: {e}", file=sys.stderr, flush=True)
        self.loads += 1

    def check_dataset(self) -> None:
        why = self.source.changed()
        if why is None and self._dataset_keys() != self._meta_keys:
            why = f"{self.info.root}: the dataset's metadata or index was rewritten"
        if why and not self.fs.error:
            self.fs.fail(f"dataset changed under the mount: {why}; unmount and mount again")
            print(f"tenplex vfs: {self.fs.error}", file=sys.stderr, flush=True)

    def watch(self) -> None:
        """Follow the state file and the dataset until the mount goes away (runs in a daemon thread)."""
        why = binding.raise_readahead(str(self.mountpoint), binding.READAHEAD_REQUESTS * MAX_READ >> 10)
        if why:
            print(f"tenplex vfs: {why}", file=sys.stderr, flush=True)
        polls = 0
        while not self.stop.wait(POLL_S):
            key = _stat_key(self.state_file)
            if key != self._state_key:
                self._state_key = key
                self.reload()
            polls += 1
            if polls % DATASET_CHECK_EVERY == 0:  # a stat per record file: not at every poll
                self.check_dataset()

    def run(self, allow_other: bool = False, debug: bool = False) -> None:
        from .fs import MOUNT_OPTIONS, fuse
        options: dict[str, Any] = dict(MOUNT_OPTIONS)
        if allow_other:
            options["allow_other"] = True
        try:
            fuse.FUSE(self.fs, str(self.mountpoint), foreground=True, raw_fi=True, debug=debug, **options)
        finally:
            self.stop.set()
            self.source.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fuse_vfs.server", description=__doc__.splitlines()[0])
    parser.add_argument("dataset")
    parser.add_argument("mountpoint")
    parser.add_argument("--state", required=True, help="state file (tenplex.dataset-state/1 with 'dp')")
    parser.add_argument("--store", help="read the record files from this store (host:port) instead")
    parser.add_argument("--cache-dir", help="local read cache for --store")
    parser.add_argument("--allow-other", action="store_true")
    parser.add_argument("--debug", action="store_true")
    args = parser.parse_args(argv)
    try:
        check_fuse()
        check_mountpoint(args.mountpoint)
        binding.keep_read_buffers_on_heap()
        source = info = None
        if args.store:
            from tenplex.dataset.remote import open_remote
            info, source = open_remote(args.store, args.dataset, cache_dir=args.cache_dir)
        server = Server(args.dataset, args.mountpoint, args.state, source=source, info=info)
        server.run(allow_other=args.allow_other, debug=args.debug)
    except (VfsError, DatasetError, StateError, OSError) as e:
        print(f"tenplex vfs: error: {e}", file=sys.stderr, flush=True)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
