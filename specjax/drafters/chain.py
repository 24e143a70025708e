"""A chain of host speculators: every round each proposes, one draft per sequence is verified.

Policies:
- `first` (llama.cpp `--spec-type a,b,...`): the first speculator, in the given order, with a
  non-empty draft wins.
- `best`: per sequence, the draft with the highest expected number of accepted tokens wins (ties
  go to the earlier speculator). The expectation is the speculator's own score when it gives one
  (SuffixDecoding does), else it comes from the speculator's running per-position acceptance
  statistics in this request: E[accepted | length L] = sum_{i<L} prod_{j<=i} a_j, where a_j is the
  rate at which position j was accepted when positions before it were, smoothed towards `prior`
  with weight `prior_weight` (so a new speculator starts at a_j = prior).

Only the winner learns from verification: it gets `accept` with its accepted count, the others
are told their draft was not verified (`verified=False`, llama.cpp's `is_other`; a speculator
without that keyword gets 0). `wins` counts, per speculator name, the sequence-rounds whose
verified draft it made; it and the acceptance statistics cover the requests since the last
`begin`, so a request's choices do not depend on the ones before it.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from specjax.drafters.base import HostDrafter
from specjax.errors import UserError

POLICIES = ("best", "first")


class Chain(HostDrafter):
  """Host chain over host drafters (HostDrafter protocol); `max_draft` is the largest of theirs."""

  @property
  def cross_request_memory(self) -> bool:
    return any(d.cross_request_memory for d in self.drafters)

  def __init__(self, drafters: Sequence, policy: str = "best", prior: float = 0.5, prior_weight: float = 2.0):
    if not drafters:
      raise ValueError("Chain needs at least one drafter")
    if policy not in POLICIES:
      raise ValueError(f"unknown chain policy {policy!r}; use one of {POLICIES}")
    for d in drafters:
      if not isinstance(d, HostDrafter):
        raise UserError(f"Chain takes host drafters only; {getattr(d, 'name', d)!r} is not a HostDrafter")
    if not 0.0 <= prior <= 1.0 or prior_weight <= 0:
      raise ValueError(f"need prior in [0, 1] and prior_weight > 0, got {prior}, {prior_weight}")
    self.drafters = tuple(drafters)
    self.policy = policy
    self.prior, self.prior_weight = float(prior), float(prior_weight)
    self.names = self._unique_names([d.name for d in self.drafters])
    self.name = f"chain_{policy}({','.join(self.names)})"
    self.max_draft = max(int(d.max_draft) for d in self.drafters)
    self._reset_stats()
    self._winner = np.zeros((0,), np.int32)        # [B] drafter index of each sequence's draft, -1 none
    self._lengths = np.zeros((0,), np.int32)       # [B] length of the winning draft

  @staticmethod
  def _unique_names(names: list[str]) -> tuple[str, ...]:
    out, seen = [], {}
    for n in names:
      seen[n] = seen.get(n, 0) + 1
      out.append(n if seen[n] == 1 else f"{n}#{seen[n]}")
    return tuple(out)

  def _reset_stats(self) -> None:
    self.wins = {n: 0 for n in self.names}
    # per drafter, per draft position: times tested (reached with all earlier positions accepted),
    # times accepted
    self.tested = [np.zeros((d.max_draft,), np.int64) for d in self.drafters]
    self.accepted = [np.zeros((d.max_draft,), np.int64) for d in self.drafters]

  def acceptance_rates(self, k: int) -> np.ndarray:
    """[max_draft of drafter k] smoothed per-position conditional acceptance rates."""
    w = self.prior_weight
    return (self.accepted[k] + self.prior * w) / (self.tested[k] + w)

  def expected_accepted(self, k: int, lengths: np.ndarray) -> np.ndarray:
    """[B] expected accepted tokens of drafter k's drafts of the given lengths [B]."""
    cum = np.concatenate([[0.0], np.cumsum(np.cumprod(self.acceptance_rates(k)))])   # [K+1]
    return cum[np.clip(lengths, 0, len(cum) - 1)]

  def begin(self, prompts: list[list[int]]) -> None:
    for d in self.drafters:
      d.begin(prompts)
    self._reset_stats()
    self._winner = np.full((len(prompts),), -1, np.int32)
    self._lengths = np.zeros((len(prompts),), np.int32)

  def propose(self, histories: list[list[int]], n_max) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    b = len(histories)
    n_max = np.broadcast_to(np.asarray(n_max, np.int64), (b,))
    tokens = np.zeros((b, self.max_draft), np.int32)
    lengths = np.zeros((b,), np.int32)
    scores = np.zeros((b,), np.float32)
    winner = np.full((b,), -1, np.int32)
    for k, d in enumerate(self.drafters):
      d_tok, d_len, d_score = d.propose(histories, np.minimum(n_max, d.max_draft))
      d_tok = np.asarray(d_tok, np.int32).reshape(b, d.max_draft)
      d_len = np.minimum(np.asarray(d_len, np.int64).reshape(b), n_max)
      d_exp = (self.expected_accepted(k, d_len) if d_score is None
               else np.asarray(d_score, np.float32).reshape(b)).astype(np.float32)
      take = (d_len > 0) & (winner < 0)
      if self.policy == "best":
        take |= (d_len > 0) & (d_exp > scores)
      for i in np.flatnonzero(take):
        tokens[i] = 0
        tokens[i, :d_len[i]] = d_tok[i, :d_len[i]]
      lengths = np.where(take, d_len, lengths).astype(np.int32)
      scores = np.where(take, d_exp, scores).astype(np.float32)
      winner = np.where(take, k, winner).astype(np.int32)
    self._winner, self._lengths = winner, lengths
    for k, n in enumerate(self.names):
      self.wins[n] += int((winner == k).sum())
    return tokens, lengths, scores

  def end(self, histories: list[list[int]]) -> None:
    for d in self.drafters:
      d.end(histories)

  def accept(self, n_accepted, verified=None) -> None:
    n_acc = np.asarray(n_accepted, np.int64).reshape(-1)
    ver = np.ones(n_acc.shape, bool) if verified is None else np.asarray(verified, bool).reshape(-1)
    for k, d in enumerate(self.drafters):
      mine = (self._winner == k) & ver
      d.accept(np.where(mine, n_acc, 0), verified=mine)
      for i in np.flatnonzero(mine):                   # per-position statistics of the winner
        ln, acc = int(self._lengths[i]), int(min(n_acc[i], self._lengths[i]))
        self.tested[k][:min(acc + 1, ln)] += 1
        self.accepted[k][:acc] += 1
    self._winner = np.full_like(self._winner, -1)

