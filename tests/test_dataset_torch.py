"""The PyTorch Dataset/Sampler on the in-process fallback reader (no FUSE): workers, empty micro-batches, weights."""

import numpy as np
import torch
from torch.utils.data import DataLoader

from tenplex.dataset import DatasetState, pack
from tenplex.dataset.state import epoch_order
from tenplex.dataset.torch_data import RankBatchSampler, RankDataset, collate, micro_batch_weights


def test_fallback_loader_with_workers_tail_batch_and_loss_weights(tmp_path):
    toks = np.arange(23 * 4, dtype=np.int32).reshape(23, 4)
    toks.tofile(tmp_path / "t.bin")
    info = pack(tmp_path / "t.bin", tmp_path / "ds", seq_len=4, dtype="int32")
    state = DatasetState(info.identity, 23, 5, 0, 10, drop_last=False)   # batches of 10, 10, 3
    dp = 5
    per_rank, weights = [], []
    for r in range(dp):
        ds = RankDataset.fallback(info.root, state, dp, r)
        loader = DataLoader(ds, batch_sampler=RankBatchSampler(ds), collate_fn=collate, num_workers=2 if r == 0 else 0)
        batches = list(loader)
        assert len(batches) == 3
        if r >= 3:
            assert batches[2] is None                   # no sample of the 3-sample tail batch for ranks 3 and 4
        per_rank.append(batches)
        weights.append(micro_batch_weights(ds))
    assert np.allclose(np.sum(weights, axis=0), 1.0)    # the weighted rank means add up to the batch mean
    assert weights[0] == [0.2, 0.2, 1 / 3]
    for step in range(3):
        rows = torch.cat([b[step] for b in per_rank if b[step] is not None])
        ids = (rows[:, 0] // 4).tolist()
        order = epoch_order(23, 5, 0).tolist()
        assert ids == order[10 * step:10 * step + 10]
