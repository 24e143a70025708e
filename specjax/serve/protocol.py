"""The OpenAI request and response bodies: parsing (every bad field is one 400 message) and the
JSON of completions, chat completions and their streamed chunks.

Beside the usual fields (max_tokens, temperature, top_p, top_k, seed, stop, stream) a request may
carry `"speculative": {"enabled": bool, "n_max": int, "n_min": int, "p_min": float}`, which sets
this request's drafting only. Responses add `token_ids` to each choice (the generated token ids,
as vLLM's `return_token_ids` does) and `usage.speculative` (this request's drafting counters).
"""

from __future__ import annotations

import dataclasses
import time

from specjax.engine import request as checks
from specjax.errors import UserError
from specjax.serve.scheduler import GenRequest

DEFAULT_MAX_TOKENS = 256
SPEC_FIELDS = ("enabled", "n_max", "n_min", "p_min")


class BadRequest(UserError):
  """A malformed request: answered with HTTP 400 and this message."""


@dataclasses.dataclass
class Parsed:
  """A checked request: the scheduler's part, plus what the HTTP layer needs."""
  gen: GenRequest
  stream: bool
  stop: list[str]
  include_usage: bool
  model: str


def _get(body: dict, name: str, kind, default, check=None, allowed: str = ""):
  v = body.get(name, default)
  if v is None:
    return default
  ok = isinstance(v, kind) and not (kind in (int, float, (int, float)) and isinstance(v, bool))
  if not ok or (check is not None and not check(v)):
    raise BadRequest(f"'{name}' must be {allowed or kind.__name__}, got {v!r}")
  return v


def _stop_strings(body: dict) -> list[str]:
  stop = body.get("stop")
  if stop is None:
    return []
  stop = [stop] if isinstance(stop, str) else stop
  if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop) or len(stop) > 4:
    raise BadRequest(f"'stop' must be a non-empty string or a list of up to 4 of them, got {body.get('stop')!r}")
  return stop


def _speculative(body: dict, max_draft: int) -> dict:
  spec = body.get("speculative") or {}
  if not isinstance(spec, dict) or set(spec) - set(SPEC_FIELDS):
    raise BadRequest(f"'speculative' must be an object with fields {', '.join(SPEC_FIELDS)}, got {spec!r}")
  enabled = _get(spec, "enabled", bool, True, allowed="true or false")
  draft = checks.check_draft_params({k: spec[k] for k in ("n_max", "n_min", "p_min") if k in spec}, 1)
  n_max = draft.get("n_max", [None])[0]
  if n_max is not None and n_max > max_draft:
    raise BadRequest(f"speculative.n_max must be at most {max_draft} on this server, got {n_max}")
  n_min = draft.get("n_min", [0])[0]
  if n_min > (max_draft if n_max is None else n_max):
    raise BadRequest(f"speculative.n_min ({n_min}) must be <= n_max")
  return {"speculative": enabled, "n_max": n_max, "n_min": n_min, "p_min": draft.get("p_min", [0.0])[0]}


def _prompt_tokens(body: dict, chat: bool, tokenizer, vocab: int) -> list[int]:
  """The prompt's token ids: chat messages through the chat template, or a text / token-id prompt."""
  if chat:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs or not all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in msgs):
      raise BadRequest("'messages' must be a non-empty list of {\"role\": str, \"content\": str}")
    if tokenizer is None:
      raise BadRequest("this model has no tokenizer: use /v1/completions with token-id prompts")
    return tokenizer.encode_chat(msgs)
  prompt = body.get("prompt")
  if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
    prompt = prompt[0]                  # a batch of one
  if isinstance(prompt, str) and prompt:
    if tokenizer is None:
      raise BadRequest("this model has no tokenizer: give the prompt as a list of token ids")
    return tokenizer.encode(checks.check_text(prompt, "prompt"))
  if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
    bad = [t for t in prompt if not 0 <= t < vocab]
    if bad:
      raise BadRequest(f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab})")
    return prompt
  raise BadRequest("'prompt' must be a non-empty string or a non-empty list of token ids (one prompt per request)")


def parse(body, *, chat: bool, tokenizer, vocab: int, capacity: int, max_draft: int) -> Parsed:
  """A request body -> `Parsed`, or BadRequest naming the field."""
  if not isinstance(body, dict):
    raise BadRequest("the request body must be a JSON object")
  if _get(body, "n", int, 1) != 1:
    raise BadRequest("'n' must be 1 (one choice per request)")
  max_tokens = _get(body, "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens", int,
                    DEFAULT_MAX_TOKENS, lambda v: v >= 1, "a whole number >= 1")
  sampling = checks.check_sampling({k: body[k] for k in ("temperature", "top_k", "top_p", "seed")
                                    if body.get(k) is not None}, 1)
  tokens = _prompt_tokens(body, chat, tokenizer, vocab)
  room = capacity - len(tokens) - max_draft - 2
  if room < 1:
    raise BadRequest(f"prompt of {len(tokens)} tokens does not fit this server's context of {capacity} tokens")
  if max_tokens > room:
    if "max_tokens" in body or "max_completion_tokens" in body:
      raise BadRequest(f"prompt ({len(tokens)} tokens) + max_tokens ({max_tokens}) exceed this server's context "
                       f"of {capacity} tokens (with drafting lookahead): at most {room} new tokens")
    max_tokens = room
  stream_options = _get(body, "stream_options", dict, {})
  gen = GenRequest(prompt=tokens, max_tokens=max_tokens, temperature=sampling.get("temperature", [1.0])[0],
                   top_k=sampling.get("top_k", [0])[0], top_p=sampling.get("top_p", [1.0])[0],
                   seed=sampling.get("seed", [0])[0], **_speculative(body, max_draft))
  return Parsed(gen=gen, stream=_get(body, "stream", bool, False, allowed="true or false"), stop=_stop_strings(body),
                include_usage=bool(stream_options.get("include_usage", False)), model=str(body.get("model", "")))


def usage(prompt_tokens: int, completion_tokens: int, spec: dict) -> dict:
  return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
          "total_tokens": prompt_tokens + completion_tokens, "speculative": spec}


def choice(chat: bool, text: str, token_ids: list[int], finish: str | None, delta: bool) -> dict:
  """One choice of a response (delta: a streamed chunk's)."""
  if chat:
    body = {"delta": {"content": text} if text or not delta else {}} if delta else \
        {"message": {"role": "assistant", "content": text}}
  else:
    body = {"text": text}
  return {"index": 0, **body, "token_ids": token_ids, "finish_reason": finish, "logprobs": None}


def envelope(chat: bool, rid: str, model: str, choices: list[dict], stream: bool, usage_: dict | None = None) -> dict:
  obj = ("chat.completion.chunk" if stream else "chat.completion") if chat else "text_completion"
  out = {"id": rid, "object": obj, "created": int(time.time()), "model": model, "choices": choices}
  if usage_ is not None:
    out["usage"] = usage_
  return out


def error_body(message: str, kind: str = "invalid_request_error", code: int = 400) -> dict:
  return {"error": {"message": message, "type": kind, "code": code}}
