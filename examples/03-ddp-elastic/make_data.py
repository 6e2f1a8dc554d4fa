"""Write the example dataset: learnable token sequences (arithmetic progressions modulo the vocabulary), packed
with tenplex so that every world reads each sample exactly once per epoch.

    python make_data.py /tmp/ddp/data [--samples 960] [--seed 0]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from tenplex.dataset import pack

VOCAB, SEQ = 64, 16


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path, help="directory to create; the packed dataset goes to OUT/dataset")
    p.add_argument("--samples", type=int, default=960)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    rng = np.random.default_rng(args.seed)
    starts = rng.integers(0, VOCAB, size=(args.samples, 1))
    strides = rng.integers(1, 4, size=(args.samples, 1))
    tokens = (starts + strides * np.arange(SEQ + 1)) % VOCAB  # (samples, seq + 1): inputs and shifted targets
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "tokens.bin").write_bytes(tokens.astype(np.uint16).tobytes())
    info = pack(args.out / "tokens.bin", args.out / "dataset", seq_len=SEQ + 1, dtype="uint16")
    print(f"{args.out / 'dataset'}: {info.num_samples} samples")


if __name__ == "__main__":
    main()
