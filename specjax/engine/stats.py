"""Speculation statistics: per-round counters on the device, llama.cpp-style summaries on the host.

llama.cpp prints, per speculator: #calls(begin, draft, accept), #gen drafts, #acc drafts,
#gen tokens, #acc tokens and durations. We add acceptance by draft position and tau (mean tokens
emitted per verification round, bonus included).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RoundStats:
  rounds: jax.Array           # [B] verification rounds while live
  gen_drafts: jax.Array       # [B] rounds with a non-empty (verified) draft
  acc_drafts: jax.Array       # [B] rounds with at least one accepted draft token
  gen_tokens: jax.Array       # [B] draft tokens verified
  acc_tokens: jax.Array       # [B] draft tokens accepted
  drafted_by_pos: jax.Array   # [K] rounds whose draft reached position i (trees: depth i + 1)
  accepted_by_pos: jax.Array  # [K] rounds whose draft was accepted through position i (trees: depth i + 1)
  emitted: jax.Array          # [B] tokens emitted by rounds (after stop-token / budget cuts)
  rejected: jax.Array         # [B] rounds whose draft was not accepted to its end (adaptive drafting's
                              # censored-geometric acceptance: accepted tokens / (those + rejections))

  @staticmethod
  def zeros(batch: int, k: int) -> "RoundStats":
    z = lambda n: jnp.zeros((n,), jnp.int32)   # distinct buffers: loops donate the stats
    return RoundStats(z(batch), z(batch), z(batch), z(batch), z(batch), z(k), z(k), z(batch), z(batch))

  def update(self, dlen, n_acc, live, n_emitted, n_verified=None) -> "RoundStats":
    """dlen [B]: draft length (chains) or depth reached (trees; then n_verified [B] = nodes verified)."""
    k = self.drafted_by_pos.shape[0]
    n_verified = dlen if n_verified is None else n_verified
    pos = jnp.arange(k)[None, :]
    live_i = live.astype(jnp.int32)
    return RoundStats(
        rounds=self.rounds + live_i,
        gen_drafts=self.gen_drafts + (live & (n_verified > 0)).astype(jnp.int32),
        acc_drafts=self.acc_drafts + (live & (n_acc > 0)).astype(jnp.int32),
        gen_tokens=self.gen_tokens + n_verified * live_i,
        acc_tokens=self.acc_tokens + n_acc * live_i,
        drafted_by_pos=self.drafted_by_pos + jnp.sum((pos < dlen[:, None]) & live[:, None], axis=0),
        accepted_by_pos=self.accepted_by_pos + jnp.sum((pos < n_acc[:, None]) & live[:, None], axis=0),
        emitted=self.emitted + n_emitted,
        rejected=self.rejected + (live & (n_acc < dlen)).astype(jnp.int32))


@dataclasses.dataclass
class SpecStats:
  """Host summary of one speculative run (one speculator)."""
  name: str
  n_seq: int
  rounds: int
  gen_drafts: int
  acc_drafts: int
  gen_tokens: int
  acc_tokens: int
  drafted_by_pos: list[int]
  accepted_by_pos: list[int]
  seconds: float
  emitted: int = 0                    # tokens emitted by verification rounds (cut at stop / budget)
  draft_seconds: float = 0.0          # host drafters: time spent proposing/accepting on the host
  per_seq_rounds: list[int] = dataclasses.field(default_factory=list)
  per_seq_acc_tokens: list[int] = dataclasses.field(default_factory=list)
  per_seq_gen_tokens: list[int] = dataclasses.field(default_factory=list)
  per_seq_emitted: list[int] = dataclasses.field(default_factory=list)
  adaptive: dict | None = None       # adaptive drafting: widths, measured costs (ms), [width, rounds] runs

  @staticmethod
  def from_rounds(name: str, rs: RoundStats, n_seq: int, seconds: float, draft_seconds: float = 0.0,
                  adaptive: dict | None = None) -> "SpecStats":
    h = jax.tree_util.tree_map(np.asarray, rs)
    return SpecStats(name=name, n_seq=n_seq, rounds=int(h.rounds.sum()), gen_drafts=int(h.gen_drafts.sum()),
                     acc_drafts=int(h.acc_drafts.sum()), gen_tokens=int(h.gen_tokens.sum()),
                     acc_tokens=int(h.acc_tokens.sum()), drafted_by_pos=h.drafted_by_pos.tolist(),
                     accepted_by_pos=h.accepted_by_pos.tolist(), emitted=int(h.emitted.sum()), seconds=seconds, draft_seconds=draft_seconds,
                     per_seq_rounds=h.rounds.tolist(), per_seq_acc_tokens=h.acc_tokens.tolist(),
                     per_seq_gen_tokens=h.gen_tokens.tolist(), per_seq_emitted=h.emitted.tolist(),
                     adaptive=adaptive)

  @property
  def tau(self) -> float:
    """Mean tokens emitted per verification round (accepted drafts + the bonus token), counting
    only what was emitted (the last round may be cut by a stop token or the token budget)."""
    return self.emitted / max(self.rounds, 1)

  @property
  def acceptance_rate(self) -> float:
    return self.acc_tokens / max(self.gen_tokens, 1)

  @property
  def acceptance_by_pos(self) -> list[float]:
    """P(position i accepted | the draft reached position i); for tree drafts, by depth."""
    return [a / d if d else 0.0 for a, d in zip(self.accepted_by_pos, self.drafted_by_pos)]

  def to_dict(self) -> dict:
    d = dataclasses.asdict(self)
    d.update(tau=self.tau, acceptance_rate=self.acceptance_rate, acceptance_by_pos=self.acceptance_by_pos)
    return d

  def format(self) -> str:
    shown = max([i + 1 for i, d in enumerate(self.drafted_by_pos) if d] or [0])
    by_pos = " ".join(f"{a:.2f}" for a in self.acceptance_by_pos[:min(shown, 16)]) + (" ..." if shown > 16 else "")
    return (f"statistics {self.name}: #calls(b,g,a) = {self.n_seq} {self.rounds} {self.rounds}, "
            f"#gen drafts = {self.gen_drafts}, #acc drafts = {self.acc_drafts}, "
            f"#gen tokens = {self.gen_tokens}, #acc tokens = {self.acc_tokens}, "
            f"dur(total, host draft) = {self.seconds * 1e3:.1f}, {self.draft_seconds * 1e3:.1f} ms\n"
            f"  tau = {self.tau:.3f}, acceptance = {self.acceptance_rate:.3f}, by position: {by_pos}")
