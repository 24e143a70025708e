"""Chat templates rendered by Jinja, as transformers renders them, and chat encoding that keeps
message text from forging turns.

`JinjaChatTemplate` renders a checkpoint's own template (`tokenizer_config.json`'s
`chat_template`, a `chat_template.jinja` file, or a file the user names) in a sandboxed Jinja
environment with what transformers gives templates: `trim_blocks`, `lstrip_blocks`, loop controls,
a `tojson` filter that keeps non-ASCII text, the globals `raise_exception` and `strftime_now`, and
the variables `messages`, `tools`, `documents`, `add_generation_prompt` and the special tokens
(`bos_token`, `eos_token`, ...).

`encode_chat_ids` turns a rendered chat into token ids so that control tokens come from the
template only: a control-token string typed inside a message is tokenized as text.
"""

from __future__ import annotations

import datetime
import json
import re
from functools import lru_cache
from typing import Any, Callable, Mapping, Sequence

from specjax.errors import UserError

_MARK = "\ue000{}\ue001"
_MARK_RE = re.compile("(\ue000\\d+\ue001)")


class TemplateError(UserError):
  """A chat template failed to render (its own `raise_exception`, or a Jinja error)."""


@lru_cache(maxsize=32)
def _compiled(source: str):
  import jinja2
  from jinja2.ext import loopcontrols
  from jinja2.sandbox import ImmutableSandboxedEnvironment

  def raise_exception(message):
    raise TemplateError(f"chat template: {message}")

  def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

  env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
  env.filters["tojson"] = tojson
  env.globals["raise_exception"] = raise_exception
  env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
  try:
    return env.from_string(source)
  except jinja2.TemplateSyntaxError as e:
    raise TemplateError(f"chat template does not parse: {e.message} (line {e.lineno})") from None


class JinjaChatTemplate:
  """A Jinja chat template with the special tokens it may refer to."""

  kind = "jinja"

  def __init__(self, source: str, special_tokens: Mapping[str, str] | None = None):
    self.source = source
    self.special_tokens = dict(special_tokens or {})
    _compiled(source)                                   # a broken template fails at load, not at first use

  def render(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
             tools=None, documents=None, **kwargs) -> str:
    import jinja2
    try:
      return _compiled(self.source).render(messages=list(messages), tools=tools, documents=documents,
                                           add_generation_prompt=add_generation_prompt,
                                           **{**self.special_tokens, **kwargs})
    except TemplateError:
      raise
    except jinja2.TemplateError as e:
      raise TemplateError(f"chat template failed: {e}") from None

  def rendered_content(self, role: str, content: str) -> str:
    return content


def render_with_spans(render: Callable[[list], str], messages: Sequence[Mapping[str, Any]],
                      rendered_content: Callable[[str, str], str]) -> tuple[str, list[tuple[int, int]] | None]:
  """(the rendered chat, [start, end) spans of the message contents in it). Contents are found by
  rendering with a marker in place of each; None for the spans when the template changes the
  text around the markers in a way substitution does not reproduce."""
  contents = [m.get("content") for m in messages]
  text = render(list(messages))
  if not all(isinstance(c, str) for c in contents):
    return text, None
  marked = render([{**m, "content": _MARK.format(i)} for i, m in enumerate(messages)])
  for fix in (lambda r, c: rendered_content(r, c), lambda r, c: c.strip()):
    parts, spans, pos = [], [], 0
    for piece in _MARK_RE.split(marked):
      if piece.startswith("\ue000") and piece.endswith("\ue001"):
        i = int(piece[1:-1])
        piece = fix(str(messages[i].get("role")), contents[i])
        spans.append((pos, pos + len(piece)))
      parts.append(piece)
      pos += len(piece)
    if "".join(parts) == text:
      return text, spans
  return text, None


def encode_chat_ids(text: str, spans, contents: Sequence, encode_offsets, is_control, encode_plain, control_id,
                    parse_special: bool) -> list[int]:
  """Token ids of a rendered chat whose control tokens come from the template only.

  encode_offsets(text) -> (ids, [(start, end)]) with control strings parsed; encode_plain(text) ->
  ids with control strings as text; is_control(id); control_id(text) -> id. A control token that
  starts inside a message's span was typed by the user: the text between the template's own
  control tokens is then encoded with control strings as text (the tokenizer splits at added
  tokens the same way, so ids elsewhere do not change)."""
  ids, offsets = encode_offsets(text)
  if parse_special:
    return list(ids)
  if spans is None:               # contents not located: refuse only when a message holds a control string
    if any(isinstance(c, str) and any(is_control(t) for t in encode_offsets(c)[0]) for c in contents):
      raise UserError("this chat template changes message text, so control-token strings inside messages "
                      "cannot be told apart from the template's; remove them or parse them explicitly "
                      "(--parse-special / parse_special=True)")
    return list(ids)
  forged = {(a, b) for t, (a, b) in zip(ids, offsets) if is_control(t) and any(lo <= a < hi for lo, hi in spans)}
  if not forged:
    return list(ids)
  out, pos = [], 0
  for t, (a, b) in zip(ids, offsets):
    if is_control(t) and (a, b) not in forged:
      out += encode_plain(text[pos:a]) if a > pos else []
      out.append(control_id(text[a:b]))
      pos = b
  if pos < len(text):
    out += encode_plain(text[pos:])
  return out
