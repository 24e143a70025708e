"""A GGUF vocabulary rebuilt as a HF `tokenizers` (Rust) pipeline.

A GGUF carries no `tokenizer.json`; llama.cpp stores the vocabulary under `tokenizer.ggml.*` keys
(token texts, token types, BPE merges or SentencePiece scores, the pre-tokenizer name). From those:

* `tokenizer.ggml.model == "gpt2"` (`build_bpe`): byte-level BPE with the file's merges. The text is
  first split the way llama.cpp's `llm_tokenizer_bpe` splits it for `tokenizer.ggml.pre` (a sequence
  of regexes, each one splitting every piece so far, matches and gaps both kept), then byte-level
  mapped and merged. `smollm` splits every digit on its own before the GPT-2 regex; `qwen2` uses
  Qwen2's regex.
* `tokenizer.ggml.model == "llama"` (`build_spm`): SentencePiece-style BPE with byte fallback, as
  transformers' GGUF converter builds it: spaces become "\u2581" (no prefix space unless
  `tokenizer.ggml.add_space_prefix` says so, which Gemma does not), merges recovered from the
  vocabulary and ranked by the merged token's score (by its position in the file for Gemma, whose
  scores follow that order).

In both, control tokens (token type 3) are matched whole in the text as special added tokens and
user-defined ones (type 4) as plain added tokens, like llama.cpp's special-token partition.
"""

from __future__ import annotations

import enum
import warnings
from collections.abc import Mapping, Sequence

import numpy as np
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as RustTokenizer

from specjax.errors import UserError


class TokenizerError(UserError):
  """The GGUF metadata describes no tokenizer this module can build, or a chat cannot be rendered."""


class TokenType(enum.IntEnum):
  """`tokenizer.ggml.token_type` values (llama.cpp's `llama_token_type`)."""
  UNDEFINED = 0
  NORMAL = 1
  UNKNOWN = 2
  CONTROL = 3
  USER_DEFINED = 4
  UNUSED = 5
  BYTE = 6


SUPPORTED_MODELS = ("gpt2", "llama")

# --- pre-tokenizer regexes, by `tokenizer.ggml.pre` (behaviour of llama.cpp's llm_tokenizer_bpe) ---

_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
          r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
           r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_TEKKEN = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
           r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
           r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_DEFAULT = (r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]")

_PRE_SPLITS: dict[str, tuple[str, ...]] = {}
for _names, _exprs in (
    (("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b"), (r"\p{N}", _GPT2)),
    (("gpt-2", "gpt2", "phi-2", "mpt", "olmo", "jais", "exaone4", "jina-es", "jina-de", "jina-v1-en",
      "jina-v2-es", "jina-v2-de", "jina-v2-code", "roberta-bpe", "gigachat", "mellum", "trillion"), (_GPT2,)),
    (("qwen2", "deepseek-r1-qwen", "kormo", "stablelm2", "megrez", "hunyuan"), (_QWEN2,)),
    (("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2", "dbrx",
      "smaug-bpe"), (_LLAMA3,)),
    (("tekken",), (_TEKKEN,)),
    (("default",), _DEFAULT),
):
  for _name in _names:
    _PRE_SPLITS[_name] = _exprs
del _names, _exprs, _name
# Pre-tokenizers whose BPE looks a whole pre-token up in the vocabulary before merging.
_IGNORE_MERGES = frozenset({"llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral",
                            "midm-2.0", "lfm2", "tekken"})
# Pre-tokenizers for which llama.cpp turns add_bos on unless the file says otherwise.
DEFAULT_ADD_BOS = frozenset({"llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral",
                              "midm-2.0", "lfm2", "tekken", "chameleon"})


def _bytes_to_unicode() -> dict[int, str]:
  """GPT-2's reversible byte -> printable character map (the byte-level BPE alphabet)."""
  printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("\u00a1"), ord("\u00ac") + 1))
               + list(range(ord("\u00ae"), ord("\u00ff") + 1)))
  table, extra = {}, 0
  for b in range(256):
    if b in printable:
      table[b] = chr(b)
    else:
      table[b] = chr(256 + extra)
      extra += 1
  return table


_BYTE_CHARS = _bytes_to_unicode()
_BYTE_ALPHABET = frozenset(_BYTE_CHARS.values())


def _special_tokens(tokens: Sequence[str], types: np.ndarray, keep) -> tuple[list[AddedToken], list[AddedToken]]:
  """(control tokens as special AddedTokens, user-defined tokens as plain AddedTokens)."""
  control = [AddedToken(t, normalized=False, special=True)
             for t, ty in zip(tokens, types) if ty == TokenType.CONTROL and keep(t)]
  user = [AddedToken(t, normalized=False, special=False)
          for t, ty in zip(tokens, types) if ty == TokenType.USER_DEFINED and keep(t)]
  return control, user


def build_bpe(tokens: list[str], types: np.ndarray, merges: Sequence[str], pre: str) -> RustTokenizer:
  """Byte-level BPE (`tokenizer.ggml.model == "gpt2"`)."""
  # Every real token is spelled in the byte alphabet; a control/user-defined token that is not
  # (e.g. full-width DeepSeek markers) keeps its text: it is matched whole and never merged into.
  vocab: dict[str, int] = {}
  for i, tok in enumerate(tokens):
    if not set(tok) <= _BYTE_ALPHABET and types[i] not in (TokenType.CONTROL, TokenType.USER_DEFINED):
      tok = "".join(_BYTE_CHARS[b] for b in tok.encode("utf-8"))
    vocab[tok] = i
  pairs = []
  for m in merges:
    cut = m.find(" ", 1)  # the first space that is not the very first character
    if cut < 0:
      raise TokenizerError(f"malformed BPE merge {m!r}")
    pairs.append((m[:cut], m[cut + 1:]))
  exprs = _PRE_SPLITS.get(pre)
  if exprs is None:
    warnings.warn(f"unknown tokenizer.ggml.pre {pre!r}; using llama.cpp's 'default' pre-tokenizer",
                  stacklevel=3)
    exprs = _DEFAULT
  model = models.BPE(vocab=vocab, merges=pairs, dropout=None, unk_token=None, fuse_unk=False,
                     byte_fallback=False, ignore_merges=pre in _IGNORE_MERGES)
  tok = RustTokenizer(model)
  tok.normalizer = None
  tok.pre_tokenizer = pre_tokenizers.Sequence(
      [pre_tokenizers.Split(Regex(e), behavior="isolated") for e in exprs]
      + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
  tok.decoder = decoders.ByteLevel()
  control, user = _special_tokens(tokens, types, lambda t: t in vocab)
  tok.add_special_tokens(control)
  tok.add_tokens(user)
  return tok


def _spm_merges(vocab: Mapping[str, int], ranks: Mapping[str, float]) -> list[tuple[str, str]]:
  """BPE merges implied by a SentencePiece vocabulary.

  Every split of a token into two vocabulary pieces is a merge; merges are ordered by the merged
  token's rank (higher first), then by longer left piece, then longer right piece, then by the
  pieces' ids. This is the order transformers' GGUF converter produces.
  """
  entries: list[tuple[float, str, str]] = []
  for tok, rank in ranks.items():
    local = [(tok[:k], tok[k:]) for k in range(1, len(tok)) if tok[:k] in vocab and tok[k:] in vocab]
    if len(local) > 1:
      local.sort(key=lambda p: (vocab[p[0]], vocab[p[1]]))
    entries.extend((rank, a, b) for a, b in local)
  entries.sort(key=lambda e: (e[0], len(e[1]), len(e[2])), reverse=True)  # stable
  return [(a, b) for _, a, b in entries]


def build_spm(tokens: list[str], types: np.ndarray, scores: np.ndarray | None, arch: str,
               unk_text: str | None, add_space_prefix: bool) -> RustTokenizer:
  """SentencePiece BPE with byte fallback (`tokenizer.ggml.model == "llama"`)."""
  gemma = arch.startswith("gemma")
  original = tokens
  if gemma:
    # Gemma files store runs of spaces as real spaces while the text side sees "\u2581"s.
    tokens = ["\u2581" * len(t) if " " in t and not t.strip() else t for t in tokens]
  vocab = {t: i for i, t in enumerate(tokens)}
  if gemma or scores is None:
    # Gemma's merge order is the order of the file, which its scores do not all follow.
    ranks: dict[str, float] = {t: -i for i, t in enumerate(tokens)}
  else:
    ranks = dict(zip(tokens, scores.astype(np.float64).tolist()))
  model = models.BPE(vocab=vocab, merges=_spm_merges(vocab, ranks), dropout=None,
                     unk_token=unk_text if unk_text in vocab else None, fuse_unk=True, byte_fallback=True)
  tok = RustTokenizer(model)
  steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
  if add_space_prefix:
    tok.normalizer = None
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first", split=False)
    steps.append(decoders.Strip(content=" ", left=1, right=0))
  else:
    tok.normalizer = normalizers.Replace(" ", "\u2581")
    tok.pre_tokenizer = None
  tok.decoder = decoders.Sequence(steps)
  # The stored texts are looked up, not the respelled ones: Gemma's "  " user-defined tokens are
  # reached through the "\u2581\u2581" merges instead of being matched in the raw text.
  control, user = _special_tokens(original, types, lambda t: t in vocab)
  tok.add_special_tokens(control)
  tok.add_tokens(user)
  return tok
