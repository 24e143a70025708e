"""Copies in the compiled adaptive program's loops: for a speculator at batch B and a cache capacity,
the optimized HLO of plain decoding's loop and of the adaptive program with the width-0 rung alone
and with the whole width ladder, and in each the `copy` / `copy-start` instructions of every while
loop's body (not inside fusions) with their bytes, and the ops there with outputs of >= 1 MB. A copy of KV-cache-sized loop state in a step
loop's body is paid every step: it would show as bytes that grow with the capacity.

  python experiments/adaptive_hlo.py --tiny --out /tmp/adaptive_hlo.json                                      # CPU
  OUT=... bash experiments/gpu/bootstrap.sh python3 experiments/adaptive_hlo.py --capacity 512 2048 --out $OUT/adaptive_hlo.json
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from adaptive_overhead import TINY  # noqa: E402
from sharding_bench import RANDOM_SHAPES, random_target  # noqa: E402
from specjax.bench.env import device_info, git_revision  # noqa: E402
from specjax.drafters import speculator_spec  # noqa: E402
from specjax.drafters.base import DraftParams  # noqa: E402
from specjax.engine import adaptive as adapt  # noqa: E402
from specjax.engine.adaptive_loop import adaptive_run  # noqa: E402
from specjax.engine.decode import _decode_loop  # noqa: E402
from specjax.engine.generation import pad_prompts  # noqa: E402
from specjax.engine.loops import prefill_request  # noqa: E402
from specjax.engine.round import RoundInputs, RoundSpec  # noqa: E402
from specjax.engine.sampling import SamplingParams  # noqa: E402

BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "f32": 4,
         "s64": 8, "u64": 8, "f64": 8}
HEADER = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
WHILE = re.compile(r"while\(.*body=%?([\w.\-]+)")
COPY = re.compile(r"=\s+(\w+)\[([\d,]*)\][^ ]*\s+(copy|copy-start)\(")
OP = re.compile(r"=\s+(\w+)\[([\d,]*)\][^ ]*\s+([\w\-]+)\(")
LARGE = 1 << 20          # an op writing this many bytes per loop iteration is worth a look
NO_DATA = {"get-tuple-element", "parameter", "tuple", "bitcast", "constant"}   # ops that move no bytes


def _bytes(dtype: str, dims: str) -> int:
  return int(np.prod([int(d) for d in dims.split(",") if d], dtype=np.int64)) * BYTES.get(dtype, 4)


def loop_bodies(hlo: str) -> dict[str, list[str]]:
  """{while body name: its top-level instruction lines} of every while loop in the module."""
  comps, name = {}, None
  for line in hlo.splitlines():
    m = HEADER.match(line)
    if m and not line.startswith(" "):
      name = m.group(1)
      comps[name] = []
    elif name is not None:
      comps[name].append(line)
  bodies = {m.group(1) for lines in comps.values() for ln in lines for m in [WHILE.search(ln)] if m}
  return {body: comps.get(body, []) for body in sorted(bodies)}


def loop_copies(bodies: dict[str, list[str]], large: bool = False) -> dict:
  """{while body: [[bytes, shape], ...]} of the copies at the top level of every while body (`large`:
  of every op there whose output is >= LARGE bytes, named by opcode: an update XLA could not do in
  place writes a whole cache-sized buffer)."""
  out = {}
  for body, lines in bodies.items():
    found = []
    for ln in lines:
      m = (OP if large else COPY).search(ln)
      if m and (not large or (m.group(3) not in NO_DATA and _bytes(m.group(1), m.group(2)) >= LARGE)):
        found.append([_bytes(m.group(1), m.group(2)), f"{m.group(3)} {m.group(1)}[{m.group(2)}]"])
    out[body] = sorted(found, reverse=True)
  return out


def ops_per_body(bodies: dict[str, list[str]]) -> dict:
  """{while body: instructions at its top level that do work (fusions, custom calls, copies, ...)}: a
  loop body compiled with more of them launches more kernels every iteration."""
  return {body: sum(1 for ln in lines for m in [OP.search(ln)] if m and m.group(3) not in NO_DATA)
          for body, lines in bodies.items()}


def summary(hlo: str) -> dict:
  bodies = loop_bodies(hlo)
  copies, large = loop_copies(bodies), loop_copies(bodies, large=True)
  return {"while_loops": len(copies), "copy_bytes_in_loop_bodies": int(sum(b for c in copies.values() for b, _ in c)),
          "largest": sorted((c for cs in copies.values() for c in cs), reverse=True)[:8],
          "by_body": {k: v[:6] for k, v in copies.items() if v},
          "large_outputs_by_body": {k: v[:12] for k, v in large.items() if v}, "ops_by_body": ops_per_body(bodies)}


def main():
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--tiny", action="store_true", help="a tiny float32 model (CPU)")
  ap.add_argument("--speculator", default="mtp")
  ap.add_argument("--n-max", type=int, default=3)
  ap.add_argument("--batch", type=int, default=8)
  ap.add_argument("--capacity", type=int, nargs="+", default=[512, 2048])
  ap.add_argument("--dump", help="also write each program's optimized HLO here")
  ap.add_argument("--out", required=True)
  args = ap.parse_args()
  target = (random_target(TINY, "tiny (random)", dtype=jnp.float32) if args.tiny
            else random_target(RANDOM_SHAPES["smollm2"], "smollm2 shapes (random)"))
  cfg, params, b, k = target.cfg, target.params, args.batch, args.n_max
  sspec = speculator_spec.get(args.speculator)
  drafter = sspec.build(target, draft_params=DraftParams(n_max=k), **sspec.example(target, Path("/tmp")))
  dp = {n: jnp.asarray(a) for n, a in DraftParams(n_max=k).arrays(b, k).items()}
  inp = RoundInputs(params=params, dparams=drafter.params(), sampling=SamplingParams.make(b), dp=dp,
                    stop_ids=jnp.asarray([-1], jnp.int32), max_new=jnp.full((b,), 10_000, jnp.int32))
  spec = RoundSpec(cfg=cfg, drafter=drafter)
  rng = np.random.default_rng(0)
  toks, lens = pad_prompts([list(rng.integers(1, cfg.vocab_size - 1, 60)) for _ in range(b)])
  rows = []
  for cap in args.capacity:
    carry = prefill_request(spec, inp, jnp.asarray(toks), jnp.asarray(lens), capacity=cap, history_len=cap)
    programs = {"plain": _decode_loop.lower(params, carry.state, inp.sampling, inp.stop_ids, inp.max_new, cfg=cfg)}
    for label, widths in (("adaptive_width0_alone", (0,)), ("adaptive_all_widths", None)):
      ac = adapt.AdaptiveConfig(widths=widths)
      n = len(ac.widths_for(drafter.max_draft))
      programs[label] = adaptive_run.lower(spec, inp, carry, jnp.ones((n,), jnp.float32), jnp.int32(0), jnp.int32(8),
                                           ac=ac)
    row = {"capacity": cap}
    for label, lowered in programs.items():
      hlo = lowered.compile().as_text()
      if args.dump:
        Path(args.dump).mkdir(parents=True, exist_ok=True)
        (Path(args.dump) / f"{label}_cap{cap}.hlo.txt").write_text(hlo)
      row[label] = summary(hlo)
      brief = {kk: row[label][kk] for kk in ("while_loops", "copy_bytes_in_loop_bodies", "largest")}
      print(json.dumps({"capacity": cap, "program": label, **brief}), flush=True)
    rows.append(row)
  result = {"what": "copies at the top level of the while loop bodies of the compiled programs", "model": target.name,
            "speculator": args.speculator, "git_revision": git_revision(), "device": device_info(), "args": vars(args),
            "rows": rows}
  Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
  main()
