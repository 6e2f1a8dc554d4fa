"""The dataset half of the PTC: record format, packing, the pure sample assignment, and readers.

May import: numpy, tqdm, the standard library, ``tenplex.errors``, ``tenplex.files`` and
(for remote datasets) ``tenplex.store``'s client. ``state`` is pure. ``torch_data`` imports
torch and is not imported here. Never imports ``fuse_vfs`` (the FUSE layer sits above).
"""

from .format import DatasetError, DatasetInfo, decode_sample, open_dataset
from .pack import pack, write_dataset
from .state import DatasetState, StateError, epoch_order, plan_steps, remaining_in_epoch, split_sizes

__all__ = [
    "DatasetError", "DatasetInfo", "DatasetState", "StateError", "decode_sample", "epoch_order",
    "open_dataset", "pack", "plan_steps", "remaining_in_epoch", "split_sizes", "write_dataset",
]
