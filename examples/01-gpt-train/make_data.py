"""Write the example dataset: learnable token sequences for the tiny GPT, packed with tenplex (one epoch = 120 steps
of 12 samples by default).

    python make_data.py /tmp/gpt/data [--samples 1440] [--seed 0]
"""

from __future__ import annotations

import argparse
from pathlib import Path

from tenplex.runtime.demo import make_dataset


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path, help="directory to create; the dataset goes to OUT (tokens.bin alongside)")
    p.add_argument("--samples", type=int, default=1440)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    state = make_dataset(args.out, args.samples, global_batch=12, seed=args.seed)
    print(f"{args.out / 'dataset'}: {state.num_samples} samples (identity {state.dataset[:12]}…)")


if __name__ == "__main__":
    main()
