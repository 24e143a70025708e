"""Replayed acceptance: what a point-mass drafter would have had accepted at every width, read off
the token stream the target produced.

A drafter whose proposal is a function of the history alone (device `ngram_simple`: prompt lookup)
and whose draft is a single token per position (no distribution q) is accepted exactly where its
tokens equal the target's: greedy, the verified continuation is the target's own greedy stream, and
sampled, a point-mass draft d is accepted with probability p(d), the chance that the target's own
sample is d. So from the stream alone (whatever width produced it, plain decoding included) the
adaptive controller knows, for every width w, how many rounds speculation at w would have taken for
the tokens produced so far, per sequence:

  m_L     the match length at prefix length L: leading draft tokens proposed from history[:L] that
          equal history[L], history[L+1], ...;
  a round at width w starting at L ends at L + 1 + min(m_L, w) (the accepted tokens and the bonus).

Counting the rounds from the last round start through the newly known stream is a walk over this
jump function; it is done by binary lifting (log2 of the window steps of gathers), so a segment's
update is a few fused array operations on the device, not a loop over tokens.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ReplayState:
  start: jax.Array    # [W, B] int32: where the next replayed round at each width starts (history index)
  known: jax.Array    # [W, B] int32: rounds at width w starting before this are replayed (their w tokens
                      # are known)
  tokens: jax.Array   # [W, B] f32: replayed tokens per width (decayed per segment)
  rounds: jax.Array   # [W, B] f32: replayed rounds per width (decayed per segment)

  @staticmethod
  def init(hist_len, n_widths: int) -> "ReplayState":
    b = hist_len.shape[0]
    z = jnp.zeros((n_widths, b), jnp.float32)
    start = jnp.broadcast_to(hist_len, (n_widths, b)).astype(jnp.int32)
    return ReplayState(start=start, known=start, tokens=z, rounds=z)


def match_lengths(drafts, lengths, history, at):
  """drafts [B, T, K], lengths [B, T] proposed at prefix lengths at [B, T]; history [B, H] ->
  [B, T] int32: leading draft tokens equal to history[at + j] (j < lengths)."""
  k = drafts.shape[-1]
  cols = at[:, :, None] + jnp.arange(k)[None, None, :]                                     # [B, T, K]
  truth = jnp.take_along_axis(history[:, None, :], jnp.clip(cols, 0, history.shape[1] - 1), axis=2)
  ok = (drafts == truth) & (jnp.arange(k)[None, None, :] < lengths[:, :, None])           # [B, T, K]
  return jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=2), axis=2)


def walk_rounds(jump, start, stop, levels: int):
  """Rounds of a jump walk, per row. jump [R, T] int32: where a round starting at window position t
  ends (> t; T = the sink); start [R], stop [R]: walk from start while the position is < stop.
  -> (rounds [R], end [R]): rounds taken and the position after the last (>= stop, or start when
  start >= stop). Binary lifting: tables of 2^l jumps, taken from the largest down."""
  r, t = jump.shape
  sink = jnp.full((r, 1), t, jump.dtype)
  table = jnp.concatenate([jnp.minimum(jump, t), sink], axis=1)                            # [R, T+1]
  tables = [table]
  for _ in range(levels - 1):
    table = jnp.take_along_axis(table, table, axis=1)
    tables.append(table)
  pos, n = start, jnp.zeros_like(start)
  for lvl in range(levels - 1, -1, -1):
    nxt = jnp.take_along_axis(tables[lvl], pos[:, None], axis=1)[:, 0]
    take = nxt < stop
    pos, n = jnp.where(take, nxt, pos), n + jnp.where(take, 1 << lvl, 0)
  last = pos < stop                                   # one more round starts before stop and ends after it
  end = jnp.where(last, jnp.take_along_axis(tables[0], pos[:, None], axis=1)[:, 0], pos)
  return n + last.astype(n.dtype), end


def replay_segment(rs: ReplayState, propose_at, history, hist_len, widths: tuple[int, ...], k: int,
                   window: int, decay: float) -> ReplayState:
  """Extends the replay over the stream produced since the last call. propose_at(history, at [B, T])
  -> (drafts [B, T, K], lengths [B, T]); hist_len [B] now. A round at width w may start where its w
  draft tokens are known (before hist_len - w) and inside the window of `window` positions from
  the earliest start."""
  nw, b = rs.start.shape
  base = jnp.min(rs.start, axis=0)                                                         # [B]
  at = base[:, None] + jnp.arange(window)[None, :]                                         # [B, T]
  drafts, lengths = propose_at(history, at)
  m = match_lengths(drafts, lengths, history, at)                                          # [B, T]
  w = jnp.asarray(widths, jnp.int32)[:, None, None]                                        # [W, 1, 1]
  stop = jnp.minimum(hist_len[None, :] - w[:, :, 0], (base + window - k - 1)[None, :])      # [W, B]
  stop = jnp.maximum(stop, rs.known)
  jump = jnp.arange(window)[None, None, :] + 1 + jnp.minimum(m[None], w)                   # [W, B, T]
  levels = max(1, int(window).bit_length())
  rounds, end = walk_rounds(jump.reshape(nw * b, window), (rs.start - base[None]).reshape(-1),
                            (stop - base[None]).reshape(-1), levels)
  rounds, end = rounds.reshape(nw, b), end.reshape(nw, b) + base[None]
  return ReplayState(start=end.astype(jnp.int32), known=stop.astype(jnp.int32),
                     tokens=decay * rs.tokens + (end - rs.start).astype(jnp.float32),
                     rounds=decay * rs.rounds + rounds.astype(jnp.float32))
