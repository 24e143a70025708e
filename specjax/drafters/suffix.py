"""SuffixDecoding on the host, after snowflakedb/ArcticInference `csrc/suffix_decoding/suffix_tree.cc`
and `arctic_inference/suffix_decoding/cache.py` (behaviour and defaults, not code).

Two depth-bounded suffix tries with occurrence counts:
- a per-request trie over the sequence's prompt and output, updated per appended token;
- a global trie over the outputs of earlier requests (those of previous `begin` calls), at most
  `max_cached_requests` of them, evicted first in, first out.

Drafting, for every match length m = 1 .. max_depth-1 of the history's suffix: walk from the
matched node to the most frequent child while the path probability (product of child/parent
counts) stays >= `min_token_prob`, for at most `max_spec = alpha * m + offset` tokens
(`max_spec_factor`, `max_spec_offset`). A draft's score is the sum of its tokens' path
probabilities, i.e. its expected number of accepted tokens. Each trie keeps its best-scoring draft
(ties go to the longer match); the global one is used only if it scores strictly higher.

Isolation: the per-request tries are dropped in `begin`. The global trie persists across `begin`
calls by design (that is SuffixDecoding's cross-request memory); pass `max_cached_requests=0` to
turn it off. Outputs enter it at the next `begin` (or `flush`) and only up to the last history the
drafter was shown, so the final round's tokens of a request are not cached.

Memory and time: a trie node per substring of length <= max_depth seen at least twice; a substring
seen once is a leaf pointing into the token list, its continuation read from there. Appending a
token costs O(length of the longest suffix seen before) <= O(max_depth); a 3000-token history with
a long repeat builds in ~0.1 s. (ArcticInference also compresses repeated unary chains: same
drafts, less memory on long repeats.)
"""

from __future__ import annotations

import collections
from collections.abc import Sequence

import numpy as np

from specjax.drafters.base import HostDrafter
from specjax.drafters.ngram_index import gc_paused

_DIRTY = object()      # `best` sentinel: recompute from the children


class _Leaf:
  """A substring that occurred once: its chain of continuations is read from the token list."""

  __slots__ = ("token", "seq", "end")
  count = 1

  def __init__(self, token: int, seq: list[int], end: int):
    self.token = token
    self.seq = seq                # the token list of its only occurrence
    self.end = end                # index in `seq` of the next token of that occurrence


class _Node:
  """A substring that occurred more than once (or did before a removal)."""

  __slots__ = ("token", "count", "children", "best")

  def __init__(self, token: int, count: int = 0):
    self.token = token
    self.count = count                                   # occurrences of this node's substring
    self.children: dict[int, _Node | _Leaf] | None = None
    self.best = None                                     # child of largest count (first to reach it), or _DIRTY

  def best_child(self) -> "_Node | _Leaf | None":
    if self.best is _DIRTY:
      best = None
      for child in (self.children or {}).values():
        if best is None or child.count > best.count:
          best = child
      self.best = best
    return self.best

  def _offer_best(self, child) -> None:
    best = self.best
    if best is None or (best is not _DIRTY and child.count > best.count):
      self.best = child


class SuffixTrie:
  """Depth-bounded suffix trie with occurrence counts over any number of token lists.

  Substrings that occurred once are not materialised: a `_Leaf` under the deepest repeated prefix
  points into the token list, and its continuation is read from there. A sequence is fed token by
  token through its `active` list: the nodes of its current suffixes that are materialised (index =
  suffix length, 0 = root); longer suffixes occurred only once and extend for free. So appending
  costs O(length of the longest suffix seen before), not O(max_depth).
  """

  def __init__(self, max_depth: int):
    if max_depth < 2:
      raise ValueError(f"max_depth must be >= 2, got {max_depth}")
    self.max_depth = int(max_depth)
    self.root = _Node(-1)

  def _promote(self, leaf: _Leaf, depth: int) -> _Node:
    """A second occurrence reached `leaf` (at `depth`): materialise it with its old continuation."""
    node = _Node(leaf.token, 2)
    seq, end = leaf.seq, leaf.end
    if depth < self.max_depth and end < len(seq):
      nxt = seq[end]
      node.children = {nxt: _Leaf(nxt, seq, end + 1)}
      node.best = node.children[nxt]
    return node

  def append(self, active: list[_Node], seq: list[int], pos: int) -> list[_Node]:
    """Count seq[pos] after every materialised suffix ending at pos-1; returns the new active list."""
    token, keep = seq[pos], self.max_depth - 1
    new = [self.root]
    self.root.count += 1
    for depth, node in enumerate(active):
      children = node.children
      if children is None:
        children = node.children = {}
      child = children.get(token)
      if child is None:                                  # first occurrence of this suffix: a leaf
        child = children[token] = _Leaf(token, seq, pos + 1)
        node._offer_best(child)
        continue
      if type(child) is _Leaf:
        leaf, child = child, self._promote(child, depth + 1)
        children[token] = child
        if node.best is leaf:
          node.best = child
        else:
          node._offer_best(child)
      else:
        child.count += 1
        node._offer_best(child)
      if depth < keep:
        new.append(child)
    return new

  def extend(self, seq: list[int], start: int = 0, active: list[_Node] | None = None) -> list[_Node]:
    """Feed seq[start:] (seq is the complete token list the leaves will point into)."""
    active = [self.root] if active is None else active
    with gc_paused():
      for pos in range(start, len(seq)):
        active = self.append(active, seq, pos)
    return active

  def remove(self, seq: list[int]) -> None:
    """Remove a token list added with `extend` (replays it, decrementing; prunes what empties)."""
    keep = self.max_depth - 1
    active = [self.root]
    for token in seq:
      new = [self.root]
      self.root.count -= 1
      for depth, node in enumerate(active):
        child = node.children[token]
        if node.best is child:
          node.best = _DIRTY
        if type(child) is _Leaf:                          # its only occurrence was this one
          del node.children[token]
          continue
        child.count -= 1
        if child.count == 0:
          del node.children[token]
        elif depth < keep:
          new.append(child)
      active = new

  def advance(self, states: list, token: int) -> list:
    """Match states of a context's suffixes (index = length; a `_Node` or, inside a single
    occurrence, a (token list, next index) pair) -> those of context + [token]."""
    new = [self.root]
    for state in states[:self.max_depth - 1]:
      if type(state) is tuple:
        seq, j = state
        if j >= len(seq) or seq[j] != token:
          break
        new.append((seq, j + 1))
        continue
      child = (state.children or {}).get(token)
      if child is None:
        break
      new.append((child.seq, child.end) if type(child) is _Leaf else child)
    return new

  def match(self, tail: Sequence[int]) -> list:
    """Match states of the suffixes of `tail` that occur (index = suffix length, 0 = root)."""
    states = [self.root]
    for t in tail[len(tail) - (self.max_depth - 1):] if len(tail) >= self.max_depth else tail:
      states = self.advance(states, int(t))
    return states

  def count(self, tokens: Sequence[int]) -> int:
    """Occurrences of `tokens` (length <= max_depth) in what was added."""
    if len(tokens) > self.max_depth:
      raise ValueError("longer than max_depth")
    state = self.root
    for depth, t in enumerate(tokens):
      if type(state) is tuple:
        seq, j = state
        if j >= len(seq) or seq[j] != t:
          return 0
        state = (seq, j + 1)
        continue
      child = (state.children or {}).get(t)
      if child is None:
        return 0
      state = (child.seq, child.end) if type(child) is _Leaf else child
    return 1 if type(state) is tuple else state.count

  def __len__(self) -> int:
    """Materialised nodes and leaves (root excluded)."""
    n, stack = 0, [self.root]
    while stack:
      kids = stack.pop().children or {}
      n += len(kids)
      stack.extend(c for c in kids.values() if type(c) is _Node)
    return n


def greedy_path(state, depth: int, max_depth: int, max_tokens: int, min_token_prob: float) -> tuple[list[int], float]:
  """Most-frequent-child walk from a match state at `depth`: (tokens, score = sum of path
  probabilities). Inside a single occurrence every step has probability 1."""
  tokens: list[int] = []
  prob, score = 1.0, 0.0
  while len(tokens) < max_tokens and depth < max_depth:
    if type(state) is tuple:                             # single occurrence: copy its continuation
      seq, j = state
      n = min(max_tokens - len(tokens), max_depth - depth, len(seq) - j)
      tokens.extend(seq[j:j + n])
      score += prob * max(n, 0)
      break
    child = state.best_child()
    if child is None:
      break
    prob *= child.count / state.count
    if prob < min_token_prob:
      break
    tokens.append(child.token)
    score += prob
    depth += 1
    state = (child.seq, child.end) if type(child) is _Leaf else child
  return tokens, score


def best_draft(states: Sequence, max_depth: int, cap: int, factor: float, offset: float,
               min_token_prob: float) -> tuple[list[int], float, int]:
  """Best (tokens, score, match_len) over match lengths m >= 1 (states[m]: the match state of the
  length-m suffix). Ties go to the longer match, as ArcticInference."""
  best: tuple[list[int], float, int] = ([], 0.0, 0)
  for m in range(1, len(states)):
    max_tokens = max(0, min(cap, int(m * factor + offset + 1e-6)))
    tokens, score = greedy_path(states[m], m, max_depth, max_tokens, min_token_prob)
    if score >= best[1]:
      best = (tokens, score, m)
  return best


class _SeqState:
  __slots__ = ("prompt_len", "tokens", "active", "global_states", "flushed")

  def __init__(self, prompt: list[int]):
    self.prompt_len = len(prompt)
    self.tokens = prompt                     # prompt + output seen so far (the local leaves point here)
    self.active: list[_Node] = []            # per-request trie: materialised nodes of the current suffixes
    self.global_states: list = []           # global trie: match states of the current suffixes
    self.flushed = False


class SuffixDecoding(HostDrafter):
  """SuffixDecoding as a host drafter (ArcticInference defaults: max_depth 64, factor 1.0,
  offset 0.0, min_token_prob 0.1, up to 100000 cached requests; max_spec_tokens = max_depth)."""

  name = "suffix"
  cross_request_memory = True     # the global tree over earlier requests

  def __init__(self, max_depth: int = 64, max_spec_tokens: int | None = None, max_spec_factor: float = 1.0,
               max_spec_offset: float = 0.0, min_token_prob: float = 0.1, max_cached_requests: int = 100000):
    if max_depth < 2:
      raise ValueError(f"max_depth must be >= 2, got {max_depth}")
    self.max_depth = int(max_depth)
    self.max_spec_tokens = int(max_spec_tokens if max_spec_tokens is not None else max_depth)
    if self.max_spec_tokens < 1:
      raise ValueError(f"max_spec_tokens must be >= 1, got {max_spec_tokens}")
    self.max_spec_factor, self.max_spec_offset = float(max_spec_factor), float(max_spec_offset)
    self.min_token_prob = float(min_token_prob)
    self.max_cached_requests = int(max_cached_requests)      # < 0: unbounded, 0: no global trie
    self.max_draft = min(self.max_spec_tokens, self.max_depth - 1)
    self.global_trie = SuffixTrie(self.max_depth)
    self._cached: collections.deque[list[int]] = collections.deque()   # outputs in the global trie, FIFO
    self._local: list[SuffixTrie] = []
    self._states: list[_SeqState] = []

  # -- global cache

  def flush(self) -> None:
    """Move the current requests' outputs into the global trie (FIFO eviction beyond the bound)."""
    if self.max_cached_requests == 0:
      return
    for st in self._states:
      if st.flushed:
        continue
      st.flushed = True
      out = st.tokens[st.prompt_len:]
      if out:
        self.global_trie.extend(out)
        self._cached.append(out)
    while self.max_cached_requests > 0 and len(self._cached) > self.max_cached_requests:
      self.global_trie.remove(self._cached.popleft())

  @property
  def n_cached_requests(self) -> int:
    return len(self._cached)

  # -- HostDrafter

  def begin(self, prompts: list[list[int]]) -> None:
    self.flush()
    self._local, self._states = [], []
    for p in prompts:
      trie, st = SuffixTrie(self.max_depth), _SeqState([int(t) for t in p])
      st.active = trie.extend(st.tokens)
      st.global_states = self.global_trie.match(st.tokens)
      self._local.append(trie)
      self._states.append(st)

  def _sync(self, i: int, history: Sequence[int]) -> _SeqState:
    st, trie = self._states[i], self._local[i]
    seen = len(st.tokens)
    if len(history) < seen or (seen and history[seen - 1] != st.tokens[seen - 1]):
      raise ValueError("history does not extend the one this sequence began with; call begin() "
                       "for a new request")
    with gc_paused():
      for t in history[seen:]:
        t = int(t)
        st.tokens.append(t)
        st.active = trie.append(st.active, st.tokens, len(st.tokens) - 1)
        st.global_states = self.global_trie.advance(st.global_states, t)   # fixed during a request
    return st

  def propose(self, histories: list[list[int]], n_max) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """-> (tokens [B, max_draft] int32, lengths [B] int32, scores [B] float32 expected accepted)."""
    b = len(histories)
    if b != len(self._states):
      raise ValueError(f"{self.name}: propose() for {b} sequences after begin() for {len(self._states)}")
    budget = np.minimum(np.broadcast_to(np.asarray(n_max, np.int64), (b,)), self.max_draft)
    tokens = np.zeros((b, self.max_draft), np.int32)
    lengths = np.zeros((b,), np.int32)
    scores = np.zeros((b,), np.float32)
    args = (self.max_spec_factor, self.max_spec_offset, self.min_token_prob)
    for i, h in enumerate(histories):
      st = self._sync(i, h)
      cap = int(budget[i])
      if cap <= 0:
        continue
      draft, score, _ = best_draft(st.active, self.max_depth, cap, *args)
      if len(st.global_states) > 1:
        g_draft, g_score, _ = best_draft(st.global_states, self.max_depth, cap, *args)
        if g_score > score:
          draft, score = g_draft, g_score
      tokens[i, :len(draft)] = draft
      lengths[i], scores[i] = len(draft), score
    return tokens, lengths, scores

  def end(self, histories: list[list[int]]) -> None:
    """The request is over: take in its final tokens (the global tree learns them at the next begin)."""
    for i, h in enumerate(histories):
      self._sync(i, h)

  def accept(self, n_accepted, verified=None) -> None:
    """Nothing to learn from acceptance: accepted tokens arrive with the next history."""
