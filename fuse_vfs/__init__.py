"""A read-only FUSE filesystem that shows each data-parallel rank its remaining samples of the epoch.

May import: ``tenplex.dataset``, ``tenplex.files``, ``tenplex.errors``, mfusepy (or fusepy),
numpy and the standard library. Nothing in ``tenplex`` imports this package except the
CLI and ``tenplex.elastic.dataview`` (an elastic job's view), lazily. The server runs in
its own process (``python -m fuse_vfs.server``); ``mount`` starts it and waits until the view is served.
"""

from .errors import FuseUnavailableError, VfsError
from .mount import MountHandle, mount, read_root, switch, unmount, write_state_file
from .preflight import check_fuse, check_mountpoint, fuse_unavailable_reason

__all__ = [
    "FuseUnavailableError", "MountHandle", "VfsError", "check_fuse", "check_mountpoint",
    "fuse_unavailable_reason", "mount", "read_root", "switch", "unmount", "write_state_file",
]
