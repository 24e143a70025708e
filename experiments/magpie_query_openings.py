"""What kinds of requests does the target write as Magpie queries? Counts the first words of the
queries cached in a dataset folder's `magpie_prompts_<i>.jsonl` (written by `build_dataset` for a
magpie source) and of the query texts, e.g. for the MTP data's main folder built on the GPU
(`bash experiments/gpu/stage_mtp2_data.sh` -> out/mtp_gpu2/data_greedy):

  python experiments/magpie_query_openings.py out/mtp_gpu2/data_greedy/magpie_prompts_0.jsonl \
      --out experiments/results/magpie_query_openings.json
"""

from __future__ import annotations

import argparse
import collections
import json
from pathlib import Path


def main(argv=None) -> dict:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("cache", help="a magpie_prompts_<i>.jsonl query cache")
  ap.add_argument("--top", type=int, default=25)
  ap.add_argument("--out", default=None)
  a = ap.parse_args(argv)
  from specjax.bench.env import device_info, git_revision
  lines = Path(a.cache).read_text().splitlines()
  header = json.loads(lines[0])
  queries = [q for line in lines[1:] if line.strip() for q in json.loads(line)["queries"]]
  first = collections.Counter(q.split()[0] for q in queries if q.split())
  out = {"cache": a.cache, "settings": header.get("magpie"), "queries": len(queries),
         "first_words": first.most_common(a.top),
         "can_or_im": first["Can"] + first["I'm"], "git_revision": git_revision(), "device": device_info()}
  print(f"{len(queries)} queries; 'Can ...' or 'I'm ...': {out['can_or_im']}; most common first words: "
        f"{first.most_common(10)}")
  if a.out:
    Path(a.out).write_text(json.dumps(out, indent=1) + "\n")
  return out


if __name__ == "__main__":
  main()
