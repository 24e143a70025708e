"""Disjoint subsets of the ShareGPT conversations for a GPU machine that cannot fetch.

Shuffles `sharegpt_chats.jsonl` (derived by `specjax fetch sharegpt` / `specjax.io.datasets.chats_file`)
with a fixed seed and writes its first N_TRAIN conversations as OUT/sharegpt_chats.jsonl (the name
`chats_file("sharegpt")` looks for in $SPECJAX_DATA, where bootstrap.sh copies .data/*.jsonl) and the
next N_HELDOUT as OUT/sharegpt_heldout_chats.jsonl (a chat source given by path), so held-out rows
are never trained on.

  python experiments/sharegpt_subset.py --train 1600 --heldout 300 --out .data
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--train", type=int, default=1600)
  ap.add_argument("--heldout", type=int, default=300)
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--out", default=".data")
  args = ap.parse_args()
  from specjax.io.datasets import chats_file
  lines = [ln for ln in chats_file("sharegpt").read_text().split("\n") if ln.strip()]
  random.Random(args.seed).shuffle(lines)
  out = Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  for name, part in (("sharegpt_chats.jsonl", lines[:args.train]),
                     ("sharegpt_heldout_chats.jsonl", lines[args.train:args.train + args.heldout])):
    (out / name).write_text("\n".join(part) + "\n")
    print(f"{out / name}: {len(part)} conversations, {(out / name).stat().st_size / 1e6:.1f} MB")


if __name__ == "__main__":
  main()
