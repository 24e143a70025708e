"""Magpie prompts: user queries sampled from the target itself (Xu et al. 2024, "Magpie: Alignment
Data Synthesis from Scratch by Prompting Aligned LLMs with Nothing").

The target gets only the pre-query part of its chat template (the default system turn if the
template has one, then the opening of a user turn: for ChatML `<|im_start|>user\\n`) and writes the
user turn until its end-of-turn token. Those queries, answered by the target in `build_dataset`, are
chat-like prompts from the target's own distribution, with no evaluation set involved.

The pre-query part is cut from the tokenizer's own chat rendering of a one-message conversation (a
sentinel as the user's text), so it follows whatever template the model ships; the end-of-turn
token is the first token after the sentinel.

With `query_prefixes`, row r of the sampling run starts its query from the opening
prefixes[r % len] (the target writes the rest; the opening is part of the query text): the target's
unprompted queries are mostly requests for help ("Can you ...", "I'm ..."), and openings such as
"Write a poem about" or "Imagine you are" steer it toward other kinds of requests.

Queries are kept when they end with the end-of-turn token (not cut by the token budget nor ended by
another stop token), hold no other special token, are long enough, and are not exact duplicates of
an earlier query. Generation batch b uses seeds derived from (seed, source index, b) only, so the
queries are a deterministic function of the settings; they are cached in the dataset folder (one
JSONL line per finished batch, rewritten atomically), and a resumed build continues after the last
cached batch and ends with exactly the queries of an uninterrupted one.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import numpy as np

SENTINEL = "\x00magpie-query\x00"
NAME = "magpie"


@dataclasses.dataclass(frozen=True)
class MagpieTemplate:
  pre_query: tuple[int, ...]   # tokens the target continues with a user query
  end_of_turn: int             # the token that closes the user turn
  pre_query_text: str

  @classmethod
  def of(cls, tok) -> "MagpieTemplate":
    """The pre-query part and end-of-turn token of `tok`'s chat template (a specjax Tokenizer)."""
    text = tok.apply_chat_template([{"role": "user", "content": SENTINEL}], add_generation_prompt=False)
    if text.count(SENTINEL) != 1:
      raise ValueError("the chat template does not render the user message verbatim; cannot cut its pre-query part")
    pre, post = text.split(SENTINEL)
    bos_text = tok.token_text(tok.bos_id) if tok.bos_id is not None else None
    add_bos = bool(tok.add_bos) and not (bos_text and pre.startswith(bos_text))   # as encode_chat does
    pre_ids = tok.encode(pre, add_bos=add_bos, add_eos=False)
    post_ids = tok.encode(post, add_bos=False, add_eos=False)
    if not post_ids:
      raise ValueError("the chat template closes a user turn with nothing; no end-of-turn token")
    return cls(tuple(pre_ids), int(post_ids[0]), pre)


def row_seeds(seed: int, source_index: int, batch: int, n: int) -> list[int]:
  """Sampler seeds of generation batch `batch` (a function of these numbers only)."""
  return [int(s) for s in np.random.SeedSequence([seed, source_index, batch, 0x6d61]).generate_state(n)]


def sample_queries(target, template: MagpieTemplate, seeds: list[int], *, temperature: float, top_p: float,
                   max_tokens: int, openings: list[list[int]] | None = None) -> list[list[int]]:
  """The target continues the pre-query part (followed by row i's opening tokens `openings[i]`, when
  given) once per seed: the raw generated tokens (the stop token included when one was hit)."""
  from specjax.engine.decode import generate_plain
  from specjax.engine.generation import PROMPT_BUCKET, round_up
  from specjax.engine.sampling import SamplingParams
  n = len(seeds)
  stop = tuple(dict.fromkeys((template.end_of_turn,) + tuple(target.tokenizer.eos_ids)))
  sampling = SamplingParams.make(n, temperature=temperature, top_p=top_p, seed=seeds)
  prompts = [list(template.pre_query) + list(o) for o in (openings or [[]] * n)]
  capacity = round_up(round_up(max(len(p) for p in prompts), PROMPT_BUCKET) + max_tokens + 1, 64)
  return generate_plain(target.params, target.cfg, prompts, max_new_tokens=max_tokens,
                        sampling=sampling, stop_ids=stop, capacity=capacity).tokens


def query_of(tok, template: MagpieTemplate, tokens: list[int], min_chars: int,
             opening: list[int] = ()) -> tuple[str | None, str]:
  """(query text, "ok") for generated tokens that make a valid query (after the `opening` tokens
  the target was given, which start the text), else (None, why not): "truncated" (no end-of-turn at
  the end), "special" (another special token inside), "short" (fewer than min_chars characters
  after stripping, empty included, or nothing but whitespace written after the opening: the
  opening alone is no query)."""
  if not tokens or tokens[-1] != template.end_of_turn:
    return None, "truncated"
  body = list(opening) + list(tokens[:-1])
  if tok.decode(body, skip_special=True) != tok.decode(body, skip_special=False):
    return None, "special"
  text = tok.decode(body, skip_special=True).strip()
  if len(text) < max(min_chars, 1) or not tok.decode(list(tokens[:-1]), skip_special=True).strip():
    return None, "short"
  return text, "ok"


def settings_of(src, dc, source_index: int, template: MagpieTemplate) -> dict:
  """What decides the queries (checked against the cache's header)."""
  out = {"seed": dc.seed, "source_index": source_index, "batch_size": dc.batch_size,
         "temperature": src.query_temperature, "top_p": src.query_top_p, "max_tokens": src.max_query_tokens,
         "min_chars": src.min_query_chars, "pre_query": list(template.pre_query), "end_of_turn": template.end_of_turn}
  if src.query_prefixes:   # caches written before the option stay valid
    out["query_prefixes"] = list(src.query_prefixes)
  return out


def openings_of(tok, prefixes, batch: int, n: int) -> list[list[int]]:
  """The opening tokens of the n rows of generation batch `batch`: the prefixes cycled over the
  rows of all batches in order (row r of the run gets prefixes[r % len]); none without prefixes."""
  if not prefixes:
    return [[] for _ in range(n)]
  return [tok.encode(prefixes[(batch * n + j) % len(prefixes)], add_bos=False, add_eos=False) for j in range(n)]


def _read_cache(path: Path, settings: dict) -> list[dict]:
  """The finished batches of a cache file (a torn last line is dropped)."""
  if not path.exists():
    return []
  lines = path.read_text().splitlines()
  batches = []
  for i, line in enumerate(lines):
    try:
      row = json.loads(line)
    except json.JSONDecodeError:
      if i == len(lines) - 1:
        break
      raise ValueError(f"{path}: line {i + 1} is not JSON")
    if i == 0:
      if row.get("magpie") != settings:
        raise ValueError(f"{path} holds queries sampled with other settings ({row.get('magpie')}); delete it "
                         f"or use another data.dir")
      continue
    batches.append(row)
  return batches


def _write_cache(path: Path, settings: dict, template: MagpieTemplate, batches: list[dict]) -> None:
  tmp = path.with_suffix(path.suffix + ".tmp")
  head = {"magpie": settings, "pre_query_text": template.pre_query_text}
  tmp.write_text("".join(json.dumps(r) + "\n" for r in [head] + batches))
  os.replace(tmp, path)


def synthesize_queries(target, src, dc, source_index: int, cache_path: str | Path, *,
                       progress: bool = True) -> list[str]:
  """`src.limit` queries (fewer if `max_batches` batches of dc.batch_size do not yield them),
  sampled, filtered and cached in `cache_path` (resumed from it)."""
  from tqdm.auto import tqdm
  tok = target.tokenizer
  template = MagpieTemplate.of(tok)
  if not src.limit:
    raise ValueError("a magpie source needs a limit (how many queries to sample)")
  settings = settings_of(src, dc, source_index, template)
  path = Path(cache_path)
  batches = _read_cache(path, settings)
  queries = [q for b in batches for q in b["queries"]]
  seen = set(queries)
  bs = dc.batch_size
  max_batches = src.max_query_batches or 4 * -(-src.limit // bs) + 2
  bar = tqdm(total=src.limit, initial=min(len(queries), src.limit), disable=not progress, desc="magpie queries",
             unit="query", dynamic_ncols=True)
  while len(queries) < src.limit and len(batches) < max_batches:
    b = len(batches)
    openings = openings_of(tok, src.query_prefixes, b, bs)
    raw = sample_queries(target, template, row_seeds(dc.seed, source_index, b, bs), temperature=src.query_temperature,
                         top_p=src.query_top_p, max_tokens=src.max_query_tokens, openings=openings)
    kept, why = [], {"truncated": 0, "special": 0, "short": 0, "duplicate": 0}
    for tokens, opening in zip(raw, openings):
      text, reason = query_of(tok, template, tokens, src.min_query_chars, opening)
      if text is not None and text in seen:
        text, reason = None, "duplicate"
      if text is None:
        why[reason] += 1
        continue
      seen.add(text)
      kept.append(text)
    batches.append({"batch": b, "queries": kept, "rejected": why})
    _write_cache(path, settings, template, batches)
    queries.extend(kept)
    bar.update(min(len(kept), src.limit - bar.n))
    bar.set_postfix(batch=b, kept=f"{len(kept)}/{bs}")
  bar.close()
  if len(queries) < src.limit and progress:
    print(f"[magpie] {len(queries)} of {src.limit} queries after {len(batches)} batches (max_query_batches)")
  return queries[:src.limit]
