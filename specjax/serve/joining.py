"""Joining requests, host side: which of them one prefill call takes, and their stacked rows.

A request joining the slot batch is prefilled piece by piece into its slot's row
(`slot_programs.prefill_rows`); the requests joining at the same time share each call, their
pieces stacked as rows of one batch. A piece is the rest of the prompt, or at most `chunk`
tokens where prompts are prefilled in chunks (so a long prompt does not stall the running
slots), padded to a multiple of `CHUNK_BUCKET` up to the chunk and, past it (whole prompts of
drafters that prefill in one pass), to the chunk doubled until it holds the piece (`piece_width`);
a call runs at its widest piece and at the smallest batch of `prefill_buckets` that holds its rows
(padding rows write nothing), so few programs compile: one per (rows bucket, width), every one of
them known in advance (`piece_widths`) so a server compiles them all before its first request.

The work of a call is the tokens its program computes, rows bucket x width; a call takes the
joining requests in arrival order while that stays within the budget it is given (`plan`).
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from specjax.drafters.base import DraftParams
from specjax.engine.generation import round_up
from specjax.engine.sampling import SamplingParams

CHUNK_BUCKET = 64      # prefill pieces are padded to a multiple of this (few compiled widths)


@dataclasses.dataclass
class Joining:
  """A request being prefilled into its slot, one piece per prefill call."""
  prompt: np.ndarray     # [T] int32
  slot: int
  draft: DraftParams     # its drafting once it runs (n_max 0: no speculation)
  sampling: tuple        # (temperature, top_k, top_p, seed) host scalars
  max_new: int
  offset: int = 0        # prompt tokens already in the slot's cache

  def piece(self, chunk: int | None) -> int:
    """Tokens the next call prefills: the rest of the prompt, at most `chunk` (None: no limit)."""
    rest = len(self.prompt) - self.offset
    return rest if chunk is None else min(rest, chunk)


def make_joining(prompt, *, slot: int, draft: DraftParams, temperature=0.0, top_k=0, top_p=1.0, seed=0,
                 max_new=16) -> Joining:
  """A request's joining record (its sampling parameters checked on the host, as `SamplingParams.make`
  checks them)."""
  sampling = tuple(a[0] for a in SamplingParams.host(1, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed))
  return Joining(prompt=np.asarray(prompt, np.int32), slot=int(slot), draft=draft, sampling=sampling,
                 max_new=int(max_new))


def piece_width(n: int, chunk: int, cap: int) -> int:
  """The padded width of a prefill piece of `n` tokens (n <= cap): a multiple of CHUNK_BUCKET up to
  `chunk`, beyond it `chunk` doubled until it holds the piece; at most `cap` (the slot's capacity:
  a piece is written into the slot's cache and history rows)."""
  w = round_up(max(n, 1), CHUNK_BUCKET)
  if w > chunk:
    g = chunk
    while g < w:
      g *= 2
    w = g
  return min(w, cap)


def piece_widths(chunk: int, cap: int) -> list[int]:
  """Every width `piece_width` gives for pieces of 1..cap tokens."""
  return sorted({piece_width(n, chunk, cap) for n in range(1, cap + 1)})


def prefill_buckets(slots: int) -> tuple[int, ...]:
  """Row counts a prefill call compiles for: powers of two below the slots, and every slot."""
  return tuple(sorted({1 << i for i in range(slots.bit_length()) if 1 << i < slots} | {slots}))


def rows_bucket(n: int, buckets: tuple[int, ...]) -> int:
  return next(b for b in buckets if b >= n)


def plan(joining: list[Joining], budget: int, *, chunk: int | None, buckets: tuple[int, ...],
         force: bool, grain: int, cap: int) -> tuple[list[Joining], int]:
  """The requests one call prefills: the longest prefix of `joining` (arrival order) whose work,
  rows bucket x the widest padded piece (`piece_width(n, grain, cap)`), stays within `budget`
  tokens; with `force` at least the first (a piece larger than the budget still progresses).
  `chunk`: the most tokens of a piece (None: whole prompts). -> (requests, work of the call)."""
  taken, width = [], 0
  for j in joining[:buckets[-1]]:
    w = max(width, piece_width(j.piece(chunk), grain, cap))
    if rows_bucket(len(taken) + 1, buckets) * w > budget and not (force and not taken):
      break
    taken.append(j)
    width = w
  return taken, (rows_bucket(len(taken), buckets) * width if taken else 0)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class PrefillRows:
  """One prefill call's rows (host arrays; padding rows point past the last slot)."""
  slot: np.ndarray        # [N] int32
  tokens: np.ndarray      # [N, P] int32 the pieces, right-padded
  n: np.ndarray           # [N] int32 valid tokens of each piece (padding rows: 1)
  fresh: np.ndarray       # [N] bool the piece starts its prompt
  finish: np.ndarray      # [N] bool the piece ends its prompt
  prompt: np.ndarray      # [N, H] int32 whole prompts (H: the history length, or P in one pass)
  prompt_len: np.ndarray  # [N] int32
  max_new: np.ndarray     # [N] int32


def stack(joining: list[Joining], rows: int, width: int, *, chunk: int | None, prompt_width: int,
          slots: int) -> tuple[PrefillRows, SamplingParams]:
  """The rows of a call over `joining` (then padding up to `rows`), pieces `width` wide, whole
  prompts `prompt_width` wide; and their sampling parameters."""
  r = PrefillRows(slot=np.full((rows,), slots, np.int32), tokens=np.zeros((rows, width), np.int32),
                  n=np.ones((rows,), np.int32), fresh=np.ones((rows,), bool), finish=np.zeros((rows,), bool),
                  prompt=np.zeros((rows, prompt_width), np.int32), prompt_len=np.ones((rows,), np.int32),
                  max_new=np.ones((rows,), np.int32))
  t, k, p = np.zeros(rows, np.float32), np.zeros(rows, np.int32), np.ones(rows, np.float32)
  seed = np.zeros(rows, np.uint32)
  for i, j in enumerate(joining):
    n = j.piece(chunk)
    r.slot[i], r.n[i], r.fresh[i], r.finish[i] = j.slot, n, j.offset == 0, j.offset + n == len(j.prompt)
    r.tokens[i, :n] = j.prompt[j.offset:j.offset + n]
    r.prompt[i, :len(j.prompt)], r.prompt_len[i], r.max_new[i] = j.prompt, len(j.prompt), j.max_new
    t[i], k[i], p[i], seed[i] = j.sampling
  return r, SamplingParams(t, k, p, seed)
