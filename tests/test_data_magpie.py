"""Magpie prompts (specjax/train/magpie.py) with the real SmolLM2-135M-Instruct: the pre-query part
and end-of-turn token come from the chat template; sampled queries are text that closed the user
turn; sampling is deterministic for a seed and resumes from its cache exactly; a dataset with a
magpie source resumes to identical shards; evaluation sets stay refused; steered queries
(`query_prefixes`) start from their row's opening, and caches and datasets built before the option
stay valid."""

from __future__ import annotations

import dataclasses
import json
import shutil

import numpy as np
import pytest

from specjax.train.data import DataConfig, ShardDataset, SourceConfig, build_dataset, prompt_stream, same_identity
from specjax.train.magpie import (MagpieTemplate, openings_of, query_of, row_seeds, sample_queries, settings_of,
                                  synthesize_queries)

MAGPIE = SourceConfig("magpie", limit=4, max_query_tokens=32, min_query_chars=8)


def _config(out, **kw) -> DataConfig:
  # query sampling and answering then share one cache capacity (128): one compilation on CPU
  base = dict(dir=str(out), sources=(MAGPIE, SourceConfig("alpaca")), n_sequences=8, max_prompt_len=64,
              max_new_tokens=8, batch_size=4, temperature=0.0, store_taps=False, seed=3)
  return DataConfig(**{**base, **kw})


@pytest.fixture(scope="module")
def template(smollm2_jax):
  return MagpieTemplate.of(smollm2_jax.tokenizer)


@pytest.fixture(scope="module")
def plain_raw(smollm2_jax, template):
  """The raw samples of the seeds of batch 0 of source 0 of `_config`, without openings."""
  return sample_queries(smollm2_jax, template, row_seeds(3, 0, 0, 4), temperature=1.0, top_p=1.0, max_tokens=32)


@pytest.fixture(scope="module")
def magpie_cache(smollm2_jax, tmp_path_factory):
  """The queries of source 0 of `_config` sampled once, uninterrupted: (queries, cache file)."""
  path = tmp_path_factory.mktemp("magpie") / "full.jsonl"
  return synthesize_queries(smollm2_jax, MAGPIE, _config(path.parent), 0, path, progress=False), path


def test_template_is_the_chat_templates_user_turn(smollm2_jax, template):
  """A chat-encoded user message = the pre-query part + the message's tokens + end-of-turn + the
  assistant opening: the pre-query part holds SmolLM2's default system turn and ends with the
  user turn's opening; the end-of-turn token is <|im_end|>, one of the target's stop tokens."""
  tok = smollm2_jax.tokenizer
  text = "How do I sort a list of tuples by their second element?"
  chat = tok.encode_chat([{"role": "user", "content": text}])
  body = tok.encode(text, add_bos=False, add_eos=False)
  pre = list(template.pre_query)
  assert chat[:len(pre)] == pre and chat[len(pre):len(pre) + len(body)] == body
  assert chat[len(pre) + len(body)] == template.end_of_turn
  assert tok.token_text(template.end_of_turn) == "<|im_end|>" and template.end_of_turn in tok.eos_ids
  assert template.pre_query_text.startswith("<|im_start|>system\n") and template.pre_query_text.endswith(
      "<|im_start|>user\n")


def test_sampled_queries_close_the_user_turn_and_repeat_for_a_seed(smollm2_jax, template, plain_raw, magpie_cache,
                                                                   tmp_path):
  """Raw samples that pass the filter end with the end-of-turn token and decode to non-empty text
  without special tokens; synthesize_queries returns `limit` distinct queries, its first cached
  batch being exactly the filtered samples of the same seeds (sampling is a function of the seed),
  and one resumed from a torn cache (first batch + half a line) writes the same cache and returns
  the same queries as an uninterrupted run."""
  tok = smollm2_jax.tokenizer
  raw = plain_raw
  kept = []
  for tokens in raw:
    text, why = query_of(tok, template, tokens, 8)
    if text is None:
      assert why in ("truncated", "special", "short")
      assert why != "truncated" or tokens[-1] != template.end_of_turn
      continue
    kept.append(text)
    assert tokens[-1] == template.end_of_turn and template.end_of_turn not in tokens[:-1]
    assert text == text.strip() and len(text) >= 8 and "<|im" not in text
  assert kept, [tok.decode(t, skip_special=False) for t in raw]

  dc = _config(tmp_path)
  full, full_path = magpie_cache
  assert len(full) == 4 and len(set(full)) == 4 and all(isinstance(q, str) and q for q in full)
  lines = full_path.read_text().splitlines(keepends=True)
  assert json.loads(lines[1])["queries"] == list(dict.fromkeys(kept))   # batch 0: the seeds sampled above
  torn = lines[:2] + [lines[2][:len(lines[2]) // 2]] if len(lines) > 2 else lines[:1] + [lines[1][:10]]
  (tmp_path / "torn.jsonl").write_text("".join(torn))
  again = synthesize_queries(smollm2_jax, MAGPIE, dc, 0, tmp_path / "torn.jsonl", progress=False)
  assert again == full
  assert (tmp_path / "torn.jsonl").read_bytes() == full_path.read_bytes()
  with pytest.raises(ValueError, match="other settings"):
    synthesize_queries(smollm2_jax, dataclasses.replace(MAGPIE, query_temperature=0.5), dc, 0,
                       tmp_path / "torn.jsonl", progress=False)


def test_dataset_with_magpie_source_resumes_to_identical_shards(smollm2_jax, magpie_cache, tmp_path, prompt_data):
  """A dataset of magpie queries + Alpaca prompts built as 4 then 8 rows (its queries sampled by
  build_dataset) equals one built as 8 at once from the cache of a standalone sampling run (same
  query cache, same shard bytes); its magpie rows are the chat encoding of the cached
  queries answered by the target; MT-bench (by name or file) is refused before anything is
  written, and query settings on a prompt set are refused."""
  from specjax.bench.prompts import resolve
  tok = smollm2_jax.tokenizer
  a, b = tmp_path / "a", tmp_path / "b"
  build_dataset(smollm2_jax, _config(a, n_sequences=4), progress=False)
  assert len(ShardDataset(a)) == 4
  build_dataset(smollm2_jax, _config(a), progress=False)
  b.mkdir()
  shutil.copy(magpie_cache[1], b / "magpie_prompts_0.jsonl")
  build_dataset(smollm2_jax, _config(b), progress=False)
  for name in ("magpie_prompts_0.jsonl", "shard_00000.npz", "shard_00001.npz"):
    assert (a / name).read_bytes() == (b / name).read_bytes(), name
  ds = ShardDataset(b)
  assert len(ds) == 8
  queries = [q for line in (b / "magpie_prompts_0.jsonl").read_text().splitlines()[1:]
             for q in json.loads(line)["queries"]][:4]
  src, toks, plens = ds.arrays["source"], ds.arrays["tokens"], ds.arrays["prompt_lens"]
  magpie_prompts = [toks[r, :plens[r]].tolist() for r in np.flatnonzero(src == 0)]
  chats = [tok.encode_chat([{"role": "user", "content": q}]) for q in queries]
  assert magpie_prompts == [c for c in chats if len(c) <= 64] and len(magpie_prompts) >= 2
  streamed = [p for i, p, _ in prompt_stream(_config(b), lambda t: tok.encode_chat([{"role": "user", "content": t}]),
                                             {0: queries}) if i == 0]
  assert streamed == magpie_prompts

  for bad in ("mt_bench", str(resolve("mt_bench"))):
    with pytest.raises(ValueError, match="evaluation set"):
      build_dataset(smollm2_jax, _config(tmp_path / "mt", sources=(SourceConfig(bad),)), progress=False)
  assert not (tmp_path / "mt").exists()
  with pytest.raises(ValueError, match="magpie sources only"):
    build_dataset(smollm2_jax, _config(tmp_path / "x", sources=(SourceConfig("alpaca", query_top_p=0.9),)),
                  progress=False)


STEER = ("Write a poem about", "", "Imagine you are", "Explain why")


def test_openings_cycle_over_the_rows_of_all_batches(smollm2_jax):
  """openings_of: row j of batch b gets the tokens of prefixes[(b * n + j) % len] (the prefixes
  cycled over the rows of the whole run, across batch boundaries), encoded without BOS/EOS so
  they decode back to the prefix; "" gives no tokens; no prefixes: n empty openings."""
  tok = smollm2_jax.tokenizer
  prefixes = ("Write a", "", "Imagine you are")
  enc = {p: tok.encode(p, add_bos=False, add_eos=False) for p in prefixes}
  assert enc[""] == [] and all(tok.decode(enc[p]) == p for p in prefixes)
  rows = [openings_of(tok, prefixes, b, 4) for b in range(3)]
  assert [o for batch in rows for o in batch] == [enc[prefixes[r % 3]] for r in range(12)]
  assert rows[1] == [enc[""], enc["Imagine you are"], enc["Write a"], enc[""]]   # rows 4..7 of the run
  assert openings_of(tok, (), 5, 4) == [[]] * 4
  assert openings_of(tok, ("Explain",), 2, 3) == [tok.encode("Explain", add_bos=False, add_eos=False)] * 3


def test_steered_queries_start_from_their_openings(smollm2_jax, template, plain_raw):
  """sample_queries with openings (the seeds of `plain_raw`, one opening per row, "" on row 1):
  the target continues pre-query + opening: the row with the empty opening samples exactly what
  it samples without openings (rows are independent), the others sample something else; every
  sample query_of keeps is its opening's text followed by what the target wrote (and at least one
  steered query is kept), and one cut by the token budget is refused as before."""
  tok = smollm2_jax.tokenizer
  openings = openings_of(tok, STEER, 0, 4)
  raw = sample_queries(smollm2_jax, template, row_seeds(3, 0, 0, 4), temperature=1.0, top_p=1.0, max_tokens=24,
                       openings=openings)
  assert raw[1] == plain_raw[1][:24]
  assert all(raw[j] != plain_raw[j][:len(raw[j])] for j in (0, 2, 3))
  steered = 0
  for prefix, opening, tokens in zip(STEER, openings, raw):
    text, why = query_of(tok, template, tokens, 8, opening)
    if text is None:
      assert why != "truncated" or tokens[-1] != template.end_of_turn
      continue
    assert text.startswith(prefix) and text == tok.decode(opening + tokens[:-1]).strip() and "<|im" not in text
    steered += bool(prefix)
  assert steered, [tok.decode(o + t, skip_special=False) for o, t in zip(openings, raw)]


def test_an_opening_alone_is_no_query(smollm2_jax, template):
  """query_of refuses as "short" a sample that closes the user turn right after its opening (or
  after whitespace only), however long the opening, and keeps the same opening followed by text."""
  tok = smollm2_jax.tokenizer
  eot = template.end_of_turn
  opening = tok.encode("Write a short story about", add_bos=False, add_eos=False)
  for body in ([], tok.encode("  ", add_bos=False, add_eos=False)):
    assert query_of(tok, template, body + [eot], 8, opening) == (None, "short")
  tail = tok.encode(" a lighthouse keeper.", add_bos=False, add_eos=False)
  assert query_of(tok, template, tail + [eot], 8, opening) == ("Write a short story about a lighthouse keeper.", "ok")


def test_cache_header_names_query_prefixes_only_when_given(smollm2_jax, template, magpie_cache, tmp_path):
  """settings_of (the query cache's header) holds "query_prefixes" (as a list) only for a source
  with prefixes; a header written before the option (its keys only) equals the settings of a
  source without prefixes, so such a cache resumes (its queries returned without sampling again),
  while a source with prefixes refuses it."""
  dc = _config(tmp_path)
  steer = dataclasses.replace(MAGPIE, query_prefixes=STEER)
  plain, steered = settings_of(MAGPIE, dc, 0, template), settings_of(steer, dc, 0, template)
  assert "query_prefixes" not in plain and steered == {**plain, "query_prefixes": list(STEER)}
  old = {"seed": 3, "source_index": 0, "batch_size": 4, "temperature": 1.0, "top_p": 1.0, "max_tokens": 32,
         "min_chars": 8, "pre_query": list(template.pre_query), "end_of_turn": template.end_of_turn}
  assert plain == old
  full, full_path = magpie_cache
  lines = full_path.read_text().splitlines(keepends=True)
  head = json.loads(lines[0])
  (tmp_path / "old.jsonl").write_text(json.dumps({**head, "magpie": old}) + "\n" + "".join(lines[1:]))
  assert synthesize_queries(smollm2_jax, MAGPIE, dc, 0, tmp_path / "old.jsonl", progress=False) == full
  with pytest.raises(ValueError, match="other settings"):
    synthesize_queries(smollm2_jax, steer, dc, 0, tmp_path / "old.jsonl", progress=False)


def test_query_prefixes_identity_and_check():
  """SourceConfig.identity() leaves out an empty query_prefixes (a dataset built before the option
  keeps its identity and still matches) and holds a non-empty one; query_prefixes on a prompt
  set is refused by check() as a magpie-only setting, and accepted on a magpie source."""
  plain = SourceConfig("magpie", limit=4)
  steer = SourceConfig("magpie", limit=4, query_prefixes=("Write a", ""))
  assert "query_prefixes" not in plain.identity()
  assert steer.identity() == {**plain.identity(), "query_prefixes": ("Write a", "")}
  old = json.loads(json.dumps(DataConfig(sources=(plain,)).identity()))
  defaults = DataConfig().identity()
  assert same_identity(old, json.loads(json.dumps(DataConfig(sources=(plain,)).identity())), defaults)
  assert not same_identity(old, json.loads(json.dumps(DataConfig(sources=(steer,)).identity())), defaults)
  steer.check()
  with pytest.raises(ValueError, match=r"\['query_prefixes'\] apply to magpie sources only"):
    SourceConfig("alpaca", query_prefixes=("Write a",)).check()


@pytest.mark.parametrize("mtp,eagle3", [("configs/train_mtp_smollm2_gpu.yaml", "configs/train_eagle3_smollm2_gpu_step1.yaml"),
                                        ("configs/train_mtp_smollm2_gpu_smoke.yaml", "configs/train_eagle3_smollm2_gpu_step1_smoke.yaml")])
def test_gpu2_configs_share_one_data_build(mtp, eagle3):
  """The MTP and EAGLE-3 configs of the second GPU run load strictly and name the same datasets
  with the same settings (so `train eagle3` resumes the folders `train data` built instead of
  refusing or regenerating them); their main dataset samples magpie queries; no source is MT-bench."""
  from specjax.train import eagle3 as e3
  from specjax.train.mtp import load_spec
  a, b = load_spec(mtp), e3.load_spec(eagle3)
  assert (a.data, a.extra_data, a.dtype, a.target) == (b.data, b.extra_data, b.dtype, b.target)
  assert a.data.sources[0].is_magpie and a.data.responses == "target"
  for dc in (a.data,) + a.extra_data:
    for src in dc.sources:
      src.check()
