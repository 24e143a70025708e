"""Tokenizer built purely from a GGUF file's metadata.

This module reads the file's `tokenizer.ggml.*` keys with `gguf.GGUFReader` (`read_tokenizer_metadata`)
and builds an equivalent HF `tokenizers` pipeline from them (`specjax.io.gguf_vocab`: byte-level
BPE for `gpt2` files, SentencePiece-style BPE for `llama` ones).

Chats are rendered by the file's own Jinja template (`tokenizer.chat_template`) in the sandboxed
environment HF folders use too (`specjax.io.chat_template`), with the file's special tokens as
`bos_token`, `eos_token`, ... A file without a template (e.g. the Gemma-3 270M GGUF) gets a named
built-in default, "gemma" or "chatml" by the turn markers of its vocabulary, announced once on
stderr; `set_chat_template` (`--chat-template FILE`) replaces either.

`eos_ids` follows llama.cpp's end-of-generation set: EOS, EOT/EOM, the FIM pad/repo/sep tokens and
the tokens whose text marks an end of turn (`<|im_end|>`, `<end_of_turn>`, `<|endoftext|>`, ...).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from tokenizers import Tokenizer as RustTokenizer

from specjax.io.gguf_vocab import (DEFAULT_ADD_BOS, SUPPORTED_MODELS, TokenizerError, TokenType, build_bpe,
                                   build_spm)

__all__ = ["Tokenizer", "TokenizerError", "TokenType", "read_tokenizer_metadata"]

# --- end-of-generation tokens, by text (llama.cpp's llama_vocab::impl::load) ---

_EOT_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>",
              "<EOT>", "_<EOT>", "<\uff5cend\u2581of\u2581sentence\uff5c>", "<end_of_utterance>")
_EOG_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<end_of_turn>",
              "<|endoftext|>", "<|eom_id|>", "<EOT>", "_<EOT>", "<|end_of_text|>", "<end_of_utterance>")
_FIM_PAD_TEXTS = ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>")
_FIM_REP_TEXTS = ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>")
_FIM_SEP_TEXTS = ("<|file_sep|>",)


def _field_value(field) -> Any:
  """One `gguf.ReaderField` as Python: str, bool/int/float, list[str], or a 1-D numpy array."""
  from gguf import GGUFValueType
  types = field.types
  if not types:
    return None
  if types[0] == GGUFValueType.ARRAY:
    if len(types) > 1 and types[1] == GGUFValueType.STRING:
      return [bytes(field.parts[i]).decode("utf-8", errors="replace") for i in field.data]
    if not field.data:
      return np.zeros((0,), np.float32)
    return np.concatenate([np.asarray(field.parts[i]).reshape(-1) for i in field.data])  # [n]
  if types[0] == GGUFValueType.STRING:
    return bytes(field.parts[field.data[0]]).decode("utf-8", errors="replace")
  return field.parts[field.data[0]][0].item()


def read_tokenizer_metadata(source) -> dict[str, Any]:
  """`general.architecture` and every `tokenizer.*` key of a GGUF (path or open `GGUFReader`)."""
  if isinstance(source, (str, os.PathLike)):
    from gguf import GGUFReader
    reader = GGUFReader(os.fspath(source), "r")
  else:
    reader = source
  out: dict[str, Any] = {}
  for key, field in reader.fields.items():
    if key.startswith("tokenizer.") or key == "general.architecture":
      out[key] = _field_value(field)
  return out


# --- the tokenizer --------------------------------------------------------------------------------


class Tokenizer:
  """Encode/decode and chat rendering for a model, built from its GGUF metadata alone."""

  def __init__(self, meta: Mapping[str, Any]):
    model_type = meta.get("tokenizer.ggml.model")
    if model_type not in SUPPORTED_MODELS:
      raise TokenizerError(f"unknown tokenizer model tokenizer.ggml.model={model_type!r}; "
                           f"supported: {', '.join(SUPPORTED_MODELS)}")
    tokens = meta.get("tokenizer.ggml.tokens")
    if not tokens:
      raise TokenizerError("GGUF metadata has no tokenizer.ggml.tokens")
    self._tokens: list[str] = list(tokens)
    n = len(self._tokens)
    types = meta.get("tokenizer.ggml.token_type")
    self._types = (np.full((n,), TokenType.NORMAL, np.int32) if types is None
                   else np.asarray(types, np.int32).reshape(-1))  # [vocab]
    if self._types.shape[0] != n:
      raise TokenizerError(f"token_type has {self._types.shape[0]} entries for {n} tokens")
    self._model_type: str = model_type
    self._pre: str | None = meta.get("tokenizer.ggml.pre")
    self._arch: str = str(meta.get("general.architecture", ""))

    def _id(key: str, default: int | None) -> int | None:
      v = meta.get(f"tokenizer.ggml.{key}")
      v = default if v is None else int(v)
      return v if v is not None and 0 <= v < n else None

    spm = model_type == "llama"
    self._bos_id = _id("bos_token_id", 1 if spm else None)
    self._eos_id = _id("eos_token_id", 2 if spm else None)
    self._unk_id = _id("unknown_token_id", 0 if spm else None)
    self._pad_id = _id("padding_token_id", None)
    pre = self._pre or "default"
    add_bos = meta.get("tokenizer.ggml.add_bos_token")
    self._add_bos = bool(add_bos) if add_bos is not None else (spm or pre in DEFAULT_ADD_BOS)
    self._add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False))
    add_space_prefix = meta.get("tokenizer.ggml.add_space_prefix")
    self._add_space_prefix = bool(add_space_prefix) if add_space_prefix is not None else spm

    if spm:
      scores = meta.get("tokenizer.ggml.scores")
      scores = None if scores is None else np.asarray(scores, np.float32).reshape(-1)  # [vocab]
      unk_text = self._tokens[self._unk_id] if self._unk_id is not None else None
      self._tok = build_spm(self._tokens, self._types, scores, self._arch, unk_text, self._add_space_prefix)
    else:
      merges = meta.get("tokenizer.ggml.merges")
      if merges is None:
        raise TokenizerError("gpt2 tokenizer without tokenizer.ggml.merges")
      self._tok = build_bpe(self._tokens, self._types, merges, pre)
    self._vocab_size = n

    self._text_to_id: dict[str, int] = {}
    for i, t in enumerate(self._tokens):
      self._text_to_id.setdefault(t, i)
    self._eos_ids = self._end_of_generation_ids(meta)
    self._chat_source: str | None = meta.get("tokenizer.chat_template") or None
    self._chat = None           # the JinjaChatTemplate, made on first use (a default is announced then)

  # -- construction --

  @classmethod
  def from_gguf(cls, path) -> "Tokenizer":
    """Build from a GGUF file path (or an already open `gguf.GGUFReader`)."""
    return cls(read_tokenizer_metadata(path))

  @classmethod
  def from_metadata(cls, meta: Mapping[str, Any]) -> "Tokenizer":
    """Build from a mapping of GGUF keys (`tokenizer.ggml.*`, `general.architecture`) to values."""
    return cls(meta)

  def _end_of_generation_ids(self, meta: Mapping[str, Any]) -> tuple[int, ...]:
    n = len(self._tokens)

    def by_key_or_text(key: str, texts: Sequence[str]) -> int | None:
      v = meta.get(f"tokenizer.ggml.{key}")
      if v is not None and 0 <= int(v) < n:
        return int(v)
      for t in texts:
        if t in self._text_to_id:
          return self._text_to_id[t]
      return None

    eog = {by_key_or_text("fim_pad_token_id", _FIM_PAD_TEXTS), by_key_or_text("fim_rep_token_id", _FIM_REP_TEXTS),
           by_key_or_text("fim_sep_token_id", _FIM_SEP_TEXTS), by_key_or_text("eot_token_id", _EOT_TEXTS),
           by_key_or_text("eom_token_id", ("<|eom_id|>",))}
    eog.update(self._text_to_id[t] for t in _EOG_TEXTS if t in self._text_to_id)
    eog.discard(None)
    if {"<|return|>", "<|call|>", "<|end|>"} <= self._text_to_id.keys():
      eog.discard(self._text_to_id["<|end|>"])  # harmony: <|end|> closes a message, not the generation
    eog.discard(self._eos_id)
    head = (self._eos_id,) if self._eos_id is not None else ()
    return head + tuple(sorted(eog))

  # -- properties --

  @property
  def vocab_size(self) -> int:
    return self._vocab_size

  @property
  def bos_id(self) -> int | None:
    return self._bos_id

  @property
  def eos_id(self) -> int | None:
    return self._eos_id

  @property
  def eos_ids(self) -> tuple[int, ...]:
    """End-of-generation ids: EOS first, then EOT/EOM/FIM-sep style stop tokens, ascending."""
    return self._eos_ids

  @property
  def unk_id(self) -> int | None:
    return self._unk_id

  @property
  def pad_id(self) -> int | None:
    return self._pad_id

  @property
  def add_bos(self) -> bool:
    return self._add_bos

  @property
  def add_eos(self) -> bool:
    return self._add_eos

  @property
  def model_type(self) -> str:
    """`tokenizer.ggml.model`: "gpt2" (byte-level BPE) or "llama" (SentencePiece)."""
    return self._model_type

  @property
  def pre(self) -> str | None:
    """`tokenizer.ggml.pre` as stored (None when absent)."""
    return self._pre

  @property
  def architecture(self) -> str:
    return self._arch

  @property
  def chat_template_source(self) -> str | None:
    """The Jinja template stored in the file (None when absent)."""
    return self._chat_source

  @property
  def backend(self) -> RustTokenizer:
    """The underlying `tokenizers.Tokenizer`."""
    return self._tok

  def token_text(self, token_id: int) -> str:
    """The token's text exactly as stored in `tokenizer.ggml.tokens`."""
    return self._tokens[token_id]

  def token_type(self, token_id: int) -> int:
    """The token's `tokenizer.ggml.token_type` (see `TokenType`)."""
    return int(self._types[token_id])

  def token_to_id(self, text: str) -> int | None:
    """Id of the token stored with exactly this text (first one when duplicated), else None."""
    return self._text_to_id.get(text)

  # -- encode / decode --

  def encode(self, text: str, add_bos: bool | None = None, add_eos: bool | None = None,
             parse_special: bool = True) -> list[int]:
    """Token ids of `text`. add_bos/add_eos default to the file's flags. With parse_special=False
    control-token texts in `text` are tokenized as plain text (user-defined ones still match)."""
    if parse_special:
      ids = self._tok.encode(text, add_special_tokens=False).ids
    else:
      self._tok.encode_special_tokens = True
      try:
        ids = self._tok.encode(text, add_special_tokens=False).ids
      finally:
        self._tok.encode_special_tokens = False
    return self._wrap(ids, add_bos, add_eos)

  def encode_batch(self, texts: Sequence[str], add_bos: bool | None = None,
                   add_eos: bool | None = None) -> list[list[int]]:
    """`encode` of several texts at once (tokenized in parallel by the Rust backend)."""
    encs = self._tok.encode_batch(list(texts), add_special_tokens=False)
    return [self._wrap(e.ids, add_bos, add_eos) for e in encs]

  def _wrap(self, ids: list[int], add_bos: bool | None, add_eos: bool | None) -> list[int]:
    if (self._add_bos if add_bos is None else add_bos) and self._bos_id is not None:
      ids = [self._bos_id] + ids
    if (self._add_eos if add_eos is None else add_eos) and self._eos_id is not None:
      ids = ids + [self._eos_id]
    return ids

  def decode(self, ids, skip_special: bool = True) -> str:
    """Text of `ids` (list or 1-D array); control tokens are dropped when skip_special."""
    ids = [int(i) for i in np.asarray(ids).reshape(-1)]
    return self._tok.decode(ids, skip_special_tokens=skip_special)

  # -- chat --

  def _special_texts(self) -> dict[str, str]:
    """The special tokens a template may refer to (`bos_token`, ...), as their texts."""
    ids = {"bos_token": self._bos_id, "eos_token": self._eos_id, "unk_token": self._unk_id,
           "pad_token": self._pad_id}
    return {k: self._tokens[i] for k, i in ids.items() if i is not None}

  @property
  def chat_template(self):
    """The `JinjaChatTemplate` chats are rendered with: the file's, a named default, or one set."""
    if self._chat is None:
      from specjax.io.chat_template import JinjaChatTemplate, default_chat_template
      if self._chat_source:
        self._chat = JinjaChatTemplate(self._chat_source, self._special_texts())
      else:
        name, source = default_chat_template(lambda t: t in self._text_to_id, "this GGUF file")
        self._chat = JinjaChatTemplate(source, self._special_texts(), name=name)
    return self._chat

  def set_chat_template(self, source: str) -> None:
    """Render chats with this Jinja template instead of the file's (`--chat-template FILE`)."""
    from specjax.io.chat_template import JinjaChatTemplate
    self._chat = JinjaChatTemplate(source, self._special_texts(), name="user")

  def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True) -> str:
    """Render `[{"role": ..., "content": ...}, ...]` with the chat template (transformers'
    `apply_chat_template(tokenize=False)`)."""
    return self.chat_template.render(messages, add_generation_prompt)

  def encode_chat(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                  parse_special: bool = False) -> list[int]:
    """Token ids of the rendered chat. BOS is added per the file's flag unless the template already
    wrote it (Gemma's `{{ bos_token }}`), so it appears exactly once, as llama.cpp's server does.

    Control tokens come from the template only: a control-token string inside a message's content
    (a user typing `<|im_end|>\n<|im_start|>assistant\n...`) is tokenized as text, so no message
    can forge a turn. `parse_special=True` parses them in content too (a caller that builds turns
    by hand)."""
    from specjax.io.chat_template import chat_token_ids
    text, ids = chat_token_ids(self.chat_template, messages, add_generation_prompt, parse_special,
                               encode_offsets=self._encode_offsets,
                               is_control=lambda t: self._types[t] == TokenType.CONTROL,
                               encode_plain=lambda x: self.encode(x, add_bos=False, add_eos=False, parse_special=False),
                               control_id=lambda x: self._text_to_id[x])
    bos_text = self._tokens[self._bos_id] if self._bos_id is not None else None
    add_bos = self._add_bos and not (bos_text and text.startswith(bos_text))
    return self._wrap(ids, add_bos, False)

  def _encode_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
    enc = self._tok.encode(text, add_special_tokens=False)
    return list(enc.ids), list(enc.offsets)

  def __repr__(self) -> str:
    return (f"Tokenizer(model={self._model_type!r}, pre={self._pre!r}, vocab_size={self._vocab_size}, "
            f"bos={self._bos_id}, eos={self._eos_id}, eos_ids={self._eos_ids}, add_bos={self._add_bos})")
