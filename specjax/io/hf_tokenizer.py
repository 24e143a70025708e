"""The tokenizer of an HF checkpoint folder: `tokenizer.json` (HF `tokenizers`), the special tokens
and chat template of `tokenizer_config.json` (or `chat_template.jinja` / `chat_template.json`),
and the end-of-generation ids of `generation_config.json`.

It has the interface of the GGUF tokenizer (`specjax.io.tokenizer.Tokenizer`): `encode`,
`encode_chat`, `decode`, `apply_chat_template`, `eos_ids`, ... Chats are rendered by the folder's
own Jinja template (a named default when it has none) and encoded as transformers' `apply_chat_template(tokenize=True)` encodes them
(no post-processor: the template writes BOS itself), with control-token strings inside messages
kept as text (`specjax.io.chat_template.encode_chat_ids`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping, Sequence

from specjax.errors import UserError
from specjax.io.chat_template import JinjaChatTemplate, chat_token_ids, default_chat_template

SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")


def _token_text(value) -> str | None:
  """A special token of tokenizer_config.json: a string or an AddedToken dict ({"content": ...})."""
  if isinstance(value, Mapping):
    return value.get("content")
  return value if isinstance(value, str) else None


def _chat_template_source(path: Path, config: dict) -> str | None:
  """The folder's default chat template: chat_template.jinja, chat_template.json, or the config's
  `chat_template` (a string, or a list of named templates: the one named "default")."""
  if (path / "chat_template.jinja").is_file():
    return (path / "chat_template.jinja").read_text()
  tpl = config.get("chat_template")
  if (path / "chat_template.json").is_file():
    tpl = json.loads((path / "chat_template.json").read_text()).get("chat_template", tpl)
  if isinstance(tpl, list):
    named = {t.get("name"): t.get("template") for t in tpl if isinstance(t, Mapping)}
    tpl = named.get("default") or next(iter(named.values()), None)
  return tpl if isinstance(tpl, str) else None


class HFTokenizer:
  """Encode / decode / chat for an HF checkpoint folder."""

  def __init__(self, path: str | Path, chat_template: str | None = None):
    from tokenizers import Tokenizer as RustTokenizer
    path = Path(path)
    if not (path / "tokenizer.json").is_file():
      raise UserError(f"{path} has no tokenizer.json (the fast tokenizer file transformers saves)")
    self._tok = RustTokenizer.from_file(str(path / "tokenizer.json"))
    cfg_file = path / "tokenizer_config.json"
    self._config = json.loads(cfg_file.read_text()) if cfg_file.is_file() else {}
    self._special = {k: t for k in SPECIAL_KEYS if (t := _token_text(self._config.get(k))) is not None}
    self._control = {a.content for a in self._tok.get_added_tokens_decoder().values() if a.special}
    self._control_ids = {self._tok.token_to_id(t) for t in self._control} - {None}
    self._bos_id = self._id(self._special.get("bos_token"))
    self._eos_id = self._id(self._special.get("eos_token"))
    eos = {self._eos_id}
    gen_file = path / "generation_config.json"
    if gen_file.is_file():
      ids = json.loads(gen_file.read_text()).get("eos_token_id")
      eos.update(ids if isinstance(ids, list) else [ids])
    eos.discard(None)
    self._eos_ids = ((self._eos_id,) if self._eos_id is not None else ()) + tuple(sorted(eos - {self._eos_id}))
    source = chat_template if chat_template is not None else _chat_template_source(path, self._config)
    self._chat = JinjaChatTemplate(source, self._special) if source else None
    self._add_bos = bool(self._config.get("add_bos_token", False))

  def _id(self, text: str | None) -> int | None:
    return None if text is None else self._tok.token_to_id(text)

  # -- properties (as the GGUF tokenizer's) --

  @property
  def vocab_size(self) -> int:
    return self._tok.get_vocab_size(with_added_tokens=True)

  @property
  def bos_id(self) -> int | None:
    return self._bos_id

  @property
  def eos_id(self) -> int | None:
    return self._eos_id

  @property
  def eos_ids(self) -> tuple[int, ...]:
    """End-of-generation ids: eos_token and generation_config.json's eos_token_id."""
    return self._eos_ids

  @property
  def add_bos(self) -> bool:
    return self._add_bos

  @property
  def backend(self):
    return self._tok

  def token_to_id(self, text: str) -> int | None:
    return self._tok.token_to_id(text)

  def token_text(self, token_id: int) -> str:
    return self._tok.id_to_token(int(token_id))

  # -- encode / decode --

  def encode(self, text: str, add_bos: bool | None = None, add_eos: bool | None = None,
             parse_special: bool = True) -> list[int]:
    """Token ids of `text`. add_bos=None: as the tokenizer's post-processor does (transformers'
    `encode(text)`); True / False: BOS added or not, nothing else. With parse_special=False
    control-token strings are tokenized as text."""
    post = add_bos is None and add_eos is None
    self._tok.encode_special_tokens = not parse_special
    try:
      ids = list(self._tok.encode(text, add_special_tokens=post).ids)
    finally:
      self._tok.encode_special_tokens = False
    if add_bos and self._bos_id is not None:
      ids = [self._bos_id] + ids
    if add_eos and self._eos_id is not None:
      ids = ids + [self._eos_id]
    return ids

  def decode(self, ids, skip_special: bool = True) -> str:
    import numpy as np
    return self._tok.decode([int(i) for i in np.asarray(ids).reshape(-1)], skip_special_tokens=skip_special)

  # -- chat --

  @property
  def chat_template(self) -> JinjaChatTemplate:
    """The folder's template, else a named default (announced once; `default_chat_template`)."""
    if self._chat is None:
      name, source = default_chat_template(lambda t: self._tok.token_to_id(t) is not None,
                                           "this checkpoint (no chat_template in tokenizer_config.json)")
      self._chat = JinjaChatTemplate(source, self._special, name=name)
    return self._chat

  def set_chat_template(self, source: str) -> None:
    self._chat = JinjaChatTemplate(source, self._special, name="user")

  def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True) -> str:
    return self.chat_template.render(messages, add_generation_prompt)

  def encode_chat(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                  parse_special: bool = False) -> list[int]:
    """transformers' `apply_chat_template(messages, tokenize=True)` ids, with control-token strings
    inside messages kept as text unless `parse_special`."""
    return chat_token_ids(self.chat_template, messages, add_generation_prompt, parse_special,
                          encode_offsets=self._encode_offsets, is_control=lambda t: t in self._control_ids,
                          encode_plain=lambda x: self.encode(x, add_bos=False, parse_special=False),
                          control_id=self._tok.token_to_id)[1]

  def _encode_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
    enc = self._tok.encode(text, add_special_tokens=False)
    return list(enc.ids), list(enc.offsets)

  def __repr__(self) -> str:
    return f"HFTokenizer(vocab_size={self.vocab_size}, bos={self._bos_id}, eos_ids={self._eos_ids})"
