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
`chat_token_ids` is the one chat-encoding path of both tokenizers (GGUF files and HF folders):
render, locate the message contents, encode.

A model with no template of its own gets a named default (`default_chat_template`: "gemma" or
"chatml", `specjax.io.default_chat_templates`), announced once on stderr.
"""

from __future__ import annotations

import datetime
import json
import re
import sys
from functools import lru_cache
from typing import Any, Callable, Mapping, Sequence

from specjax.errors import UserError
from specjax.io.default_chat_templates import DEFAULT_TEMPLATES, MARKERS

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
  """A Jinja chat template with the special tokens it may refer to. `name`: where it came from
  ("file": the model's own; "chatml" / "gemma": a built-in default; "user": --chat-template)."""

  kind = "jinja"

  def __init__(self, source: str, special_tokens: Mapping[str, str] | None = None, name: str = "file"):
    self.source = source
    self.name = name
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


def render_with_spans(render: Callable[[list], str], messages: Sequence[Mapping[str, Any]],
                      rendered_content: Callable[[str, str], str] | None = None
                      ) -> tuple[str, list[tuple[int, int]] | None]:
  """(the rendered chat, [start, end) spans of the message contents in it, one per message).

  Contents are found by rendering with a marker in place of each: the text between markers must be
  the template's own, and each marker stands for its content as written (or trimmed on either side,
  as `| trim` does; `rendered_content(role, content)` first, when given). None for the spans when
  the template changes the text around the markers in another way."""
  contents = [m.get("content") for m in messages]
  text = render(list(messages))
  if not all(isinstance(c, str) for c in contents):
    return text, None
  marked = render([{**m, "content": _MARK.format(i)} for i, m in enumerate(messages)])
  pieces = _MARK_RE.split(marked)            # literal, marker, literal, ..., literal
  spans: list[tuple[int, int] | None] = [None] * len(messages)
  pos = 0
  for k, piece in enumerate(pieces):
    if k % 2 == 0:                           # the template's own text
      if not text.startswith(piece, pos):
        return text, None
      pos += len(piece)
      continue
    i = int(piece[1:-1])
    c, after = contents[i], pieces[k + 1]
    firsts = [rendered_content(str(messages[i].get("role")), c)] if rendered_content else []
    for cand in dict.fromkeys(firsts + [c, c.strip(), c.lstrip(), c.rstrip()]):
      if text.startswith(cand, pos) and text.startswith(after, pos + len(cand)):
        spans[i] = (pos, pos + len(cand))
        pos += len(cand)
        break
    else:
      return text, None
  if pos != len(text):
    return text, None
  return text, [s for s in spans if s is not None]   # a message the template leaves out has no span


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


def chat_token_ids(template, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool,
                   parse_special: bool, *, encode_offsets, is_control, encode_plain, control_id) -> tuple[str, list[int]]:
  """(rendered text, token ids) of a chat rendered by `template` (a JinjaChatTemplate), control
  tokens taken from the template only unless `parse_special` (see `encode_chat_ids`)."""
  text, spans = render_with_spans(lambda ms: template.render(ms, add_generation_prompt), messages)
  ids = encode_chat_ids(text, spans, [m.get("content") for m in messages], encode_offsets, is_control,
                        encode_plain, control_id, parse_special)
  return text, ids


_announced: set[str] = set()


def default_chat_template(has_token: Callable[[str], bool], what: str = "this model") -> tuple[str, str]:
  """(name, Jinja source) of the default template for a model without one: "gemma" when its
  vocabulary has `<start_of_turn>`, else "chatml". Announced on stderr once per process and name."""
  name = next((n for marker, n in MARKERS if has_token(marker)), "chatml")
  if name not in _announced:
    _announced.add(name)
    warn = "" if any(has_token(m) for m, n in MARKERS if n == name) else " (its markers are not tokens here: they are encoded as text)"
    print(f"note: {what} has no chat template; chats use the built-in {name!r} template{warn} "
          f"(--chat-template FILE to use another)", file=sys.stderr)
  return name, DEFAULT_TEMPLATES[name]
