"""The dataset half of the PTC: record format, packing, the pure sample assignment, and readers.

May import: numpy, tqdm, the standard library, ``tenplex.errors``, ``tenplex.files`` and
(for remote datasets) ``tenplex.store``'s client. ``state`` is pure. ``torch_data`` imports
torch and is not imported here. Never imports ``fuse_vfs`` (the FUSE layer sits above).
"""

from .format import DatasetError, DatasetInfo, decode_sample
from .inplace import open_dataset
from .pack import pack, write_dataset
from .state import DatasetState, StateError, epoch_order, upcoming_batches, remaining_in_epoch, split_sizes
from .statefile import check_state_matches, load_state_file, write_state_file

__all__ = [
    "DatasetError", "DatasetInfo", "DatasetState", "StateError", "check_state_matches", "decode_sample",
    "epoch_order", "load_state_file", "open_dataset", "pack", "upcoming_batches", "remaining_in_epoch", "split_sizes",
    "write_dataset", "write_state_file",
]
