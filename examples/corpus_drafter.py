"""A speculator written outside specjax: draft from a corpus of documents the user gives.

Each round, per sequence, the drafter looks for the longest tail of the token history (at most
`size_n` tokens, at least `min_n`) in the corpus and proposes what followed it there: useful when
answers quote known documents (manuals, code bases, earlier answers). It is a host drafter, so it
also joins chains (`--spec corpus,suffix`). Registering it is one call; nothing in specjax changes.

    specjax --plugin examples/corpus_drafter.py generate --chat --spec corpus \\
        --spec-config '{"path": "docs.txt"}' "What does the manual say about ...?"

    from specjax.drafters.speculator_spec import load_plugin
    load_plugin("examples/corpus_drafter.py")
    api.generate(target, prompts, speculator="corpus", options={"path": "docs.txt"})

The corpus file holds documents separated by blank lines, tokenized with the target's tokenizer.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from specjax import Option, SpeculatorSpec, register_speculator
from specjax.drafters.base import HostDrafter


class CorpusDrafter(HostDrafter):
  name = "corpus"

  def __init__(self, documents: list[list[int]], max_draft: int = 8, size_n: int = 8, min_n: int = 2):
    self.docs, self.max_draft, self.size_n, self.min_n = documents, max_draft, size_n, min_n
    self.index: dict[tuple, list] = {}                       # min_n-gram -> (doc, end) positions
    for d, doc in enumerate(documents):
      for end in range(min_n, len(doc)):
        self.index.setdefault(tuple(doc[end - min_n:end]), []).append((d, end))

  def begin(self, prompts):
    pass

  def propose(self, histories, n_max):
    tokens = np.zeros((len(histories), self.max_draft), np.int32)
    lengths = np.zeros((len(histories),), np.int32)
    for i, h in enumerate(histories):
      best = max(((self._match(h, d, end), d, end) for d, end in self.index.get(tuple(h[-self.min_n:]), ())),
                 default=None)
      if best is not None:
        draft = self.docs[best[1]][best[2]:best[2] + min(int(n_max[i]), self.max_draft)]
        tokens[i, :len(draft)], lengths[i] = draft, len(draft)
    return tokens, lengths, None

  def _match(self, history, d, end) -> int:
    """How many tokens (up to size_n) the history and document d before `end` share at the end."""
    n = 0
    while n < min(self.size_n, len(history), end) and history[-1 - n] == self.docs[d][end - 1 - n]:
      n += 1
    return n

  def accept(self, n_accepted, verified=None):
    pass


def build(target, *, draft_model=None, draft_params=None, head=None, path, size_n=8, min_n=2):
  docs = [t for t in Path(path).read_text().split("\n\n") if t.strip()]
  tokens = [target.tokenizer.encode(t, add_bos=False) for t in docs]
  n_max = 8 if draft_params is None else int(np.max(np.asarray(draft_params.n_max)))
  return CorpusDrafter(tokens, max_draft=max(n_max, 1), size_n=size_n, min_n=min_n)


def example(target, workdir):
  """A working instance for any target with a tokenizer (the registry-wide tests build it): a
  corpus of four documents of random tokens."""
  rng = np.random.default_rng(0)
  docs = [target.tokenizer.decode(rng.integers(0, target.cfg.vocab_size, 48).tolist()) for _ in range(4)]
  path = Path(workdir) / "corpus.txt"
  path.write_text("\n\n".join(docs))
  return {"path": str(path)}


register_speculator(SpeculatorSpec(
    "corpus", build, "copy from a user-given corpus of documents (an example plugin)", where="host", example=example,
    options=(Option("path", str, None, "text file of documents separated by blank lines", required=True),
             Option("size_n", int, 8, "longest history tail matched", low=1),
             Option("min_n", int, 2, "shortest history tail matched", low=1))), replace=True)
