"""Training rows from multi-turn chats: ShareGPT or any chat JSONL (`messages` / `conversations`),
rendered with the target's chat template, the loss on the assistant turns only.

A data source `{name: sharegpt, kind: chat}` (or `{name: path/to/chats.jsonl, kind: chat}`) reads
conversations (`specjax.io.conversations`: alternating user / assistant turns after an optional
system message), shuffled with the seed like a prompt set. Each becomes one row:

  tokens     the template's rendering of the conversation (`encode_chat`, no generation prompt),
             cut to the row width; turns whose answer would start past the width are left out
  loss_mask  the assistant turns: from the end of the generation prompt that opens the turn to its
             end-of-turn token, inclusive (what the target emits when it answers); the system and
             user turns and the template's own headers are not learned
  prompt_len where the first assistant turn starts (longer first prompts than `max_prompt_len` skip
             the conversation, as long prompts do)

The spans are found by rendering prefixes: the history rendered with the generation prompt must be
a token prefix of the history plus the answer, which must be a prefix of the whole conversation
(true of ChatML, Llama-3, Gemma; a template that rewrites earlier turns, such as Qwen3 dropping
past reasoning, is refused: the conversation is skipped).

With `responses: target` (self-distillation, as EAGLE-3 and SpecForge build their data) the user
turns are kept and every assistant turn is replaced by the target's own answer given the history
so far (already regenerated answers included): greedy at temperature 0, else sampled with seeds
derived from (seed, row, turn); at most `max_new_tokens` per answer. A conversation ends at an
answer cut by that budget, and before a user turn whose prompt would not leave room in the row.
With `responses: reference` the conversation's own answers are kept.
"""

from __future__ import annotations

import dataclasses
from typing import Iterator, Sequence

import numpy as np


@dataclasses.dataclass
class ChatItem:
  """A conversation of a chat source on its way to a row: its messages, and its rendered ids and
  loss mask once they are known (reference answers: at once; regenerated ones: after generation)."""
  messages: list[dict]
  ids: list[int] | None = None
  mask: list[bool] | None = None


def chat_row(tok, messages: Sequence[dict], width: int) -> tuple[list[int], list[bool]] | None:
  """(token ids [<= width], loss mask [same]) of `messages` rendered with `tok`'s chat template
  (see the module docstring), or None when the template is not prefix-stable or no assistant turn
  starts within the row."""
  stops = set(tok.eos_ids)
  spans, full = [], []
  for i, m in enumerate(messages):
    if m["role"] != "assistant":
      continue
    prompt = tok.encode_chat(list(messages[:i]), add_generation_prompt=True)
    if len(prompt) >= width:
      break
    turn = tok.encode_chat(list(messages[:i + 1]), add_generation_prompt=False)
    if prompt[:len(full)] != full or turn[:len(prompt)] != prompt:
      return None
    end = next((k + 1 for k in range(len(prompt), len(turn)) if turn[k] in stops), len(turn))
    spans.append((len(prompt), end))
    full = turn
  if not spans:
    return None
  ids = full[:width]
  mask = np.zeros(len(full), bool)
  for a, b in spans:
    mask[a:b] = True
  return ids, mask[:width].tolist()


def chat_items(src, index: int, dc, tok) -> Iterator[tuple[list[int], ChatItem]]:
  """(first prompt ids, ChatItem) of chat source `src` (the `index`-th source of DataConfig `dc`),
  in its shuffled order; with reference answers the item carries its row already."""
  from specjax.io import datasets
  from specjax.io.conversations import ChatFile
  path = datasets.chats_file(src.name) if src.name in datasets.DATASETS else src.name
  chats = ChatFile(path)
  order = np.random.default_rng(dc.seed + index).permutation(len(chats))
  for k in order[:src.limit] if src.limit else order:
    msgs = chats.messages(int(k))
    if msgs is None:
      continue
    if src.max_turns:
      system = 1 if msgs[0]["role"] == "system" else 0
      msgs = msgs[:system + 2 * src.max_turns]
    row = chat_row(tok, msgs, dc.width)
    if row is None:
      continue
    first = row[1].index(True)
    item = ChatItem(msgs, *row) if dc.responses == "reference" else ChatItem(msgs)
    yield row[0][:first], item


def turn_seed(seed: int, turn: int) -> int:
  """The sampler seed of a row's `turn`-th regenerated answer (a function of these numbers only)."""
  return int(np.random.SeedSequence([seed, turn, 0x6368]).generate_state(1)[0])


def regenerate(target, conversations: Sequence[Sequence[dict]], seeds: Sequence[int], *, width: int,
               max_new_tokens: int, temperature: float, batch_size: int, capacity: int,
               progress: bool = False) -> list[list[dict]]:
  """The conversations with every assistant turn replaced by `target`'s answer given the history
  so far (see the module docstring). Turn k of every conversation is one generation batch of
  `batch_size` rows (padded with a repeat: one program shape for every batch)."""
  from tqdm.auto import tqdm

  from specjax.engine.decode import generate_plain
  from specjax.engine.sampling import SamplingParams
  tok = target.tokenizer
  stops = tuple(tok.eos_ids)
  out = [list(c[:1]) if c and c[0]["role"] == "system" else [] for c in conversations]
  users = [[m for m in c if m["role"] == "user"] for c in conversations]
  live = list(range(len(conversations)))
  bar = tqdm(total=sum(map(len, users)), desc="regenerate", unit="turn", leave=False, disable=not progress,
             dynamic_ncols=True)
  for turn in range(max(map(len, users), default=0)):
    rows, prompts = [], []
    for r in live:
      if turn < len(users[r]):
        ids = tok.encode_chat(out[r] + [users[r][turn]], add_generation_prompt=True)
        if len(ids) < width:                   # room for at least one answer token in the row
          rows.append(r)
          prompts.append(ids)
    if not rows:
      break
    padded = prompts + [prompts[0]] * (batch_size - len(prompts))
    row_seeds = [turn_seed(seeds[r], turn) for r in rows] + [0] * (batch_size - len(rows))
    sampling = SamplingParams.make(batch_size, temperature=temperature, seed=row_seeds)
    answers = generate_plain(target.params, target.cfg, padded, max_new_tokens=max_new_tokens, sampling=sampling,
                             stop_ids=stops, capacity=capacity).tokens[:len(rows)]
    live = []
    for r, answer in zip(rows, answers):
      ended = bool(answer) and answer[-1] in stops
      text = tok.decode(answer[:-1] if ended else answer, skip_special=True)
      out[r] += [users[r][turn], {"role": "assistant", "content": text}]
      if ended:                                # an answer cut by the budget ends its conversation
        live.append(r)
    bar.update(len(rows))
  bar.close()
  return out
