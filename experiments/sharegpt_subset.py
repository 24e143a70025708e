"""Disjoint subsets of the ShareGPT conversations for a GPU machine that cannot fetch.

Shuffles `sharegpt_chats.jsonl` (derived by `specjax fetch sharegpt` / `specjax.io.datasets.chats_file`)
with a fixed seed and writes its first N_TRAIN conversations as OUT/sharegpt_chats.jsonl (the name
`chats_file("sharegpt")` looks for in $SPECJAX_DATA, where bootstrap.sh copies .data/*.jsonl) and the
next N_HELDOUT as OUT/sharegpt_heldout_chats.jsonl (a chat source given by path), so held-out rows
are never trained on. With --gzip the training file is written as sharegpt_chats.jsonl.gz (about a
third of the size; bootstrap.sh unpacks .data/*.jsonl.gz into $SPECJAX_DATA), so ~4x the
conversations fit the 64 MiB a GPU call carries.

  python experiments/sharegpt_subset.py --train 1600 --heldout 300 --out .data
  python experiments/sharegpt_subset.py --train 8000 --heldout 300 --gzip --out .data
"""

from __future__ import annotations

import argparse
import gzip
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
  ap.add_argument("--gzip", action="store_true", help="write the training file gzipped (.jsonl.gz)")
  args = ap.parse_args()
  from specjax.io.datasets import chats_file
  lines = [ln for ln in chats_file("sharegpt").read_text().split("\n") if ln.strip()]
  random.Random(args.seed).shuffle(lines)
  out = Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  train = "sharegpt_chats.jsonl" + (".gz" if args.gzip else "")
  for stale in ("sharegpt_chats.jsonl", "sharegpt_chats.jsonl.gz"):     # one training file, the one written now
    (out / stale).unlink(missing_ok=True)
  for name, part in ((train, lines[:args.train]),
                     ("sharegpt_heldout_chats.jsonl", lines[args.train:args.train + args.heldout])):
    text = ("\n".join(part) + "\n").encode("utf-8")
    (out / name).write_bytes(gzip.compress(text, mtime=0) if name.endswith(".gz") else text)
    print(f"{out / name}: {len(part)} conversations, {(out / name).stat().st_size / 1e6:.1f} MB")


if __name__ == "__main__":
  main()
