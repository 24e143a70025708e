"""Checking a generation request before anything is loaded, compiled or run.

`api.generate` and the `generate` command call these on what the user gave (prompts, sampling,
draft parameters, token budget, speculator, rollback, dtype), so a bad value is one `UserError`
that names the argument and what is allowed, raised before a model load or an XLA compilation
(never a tracer error, a NaN that silently ends generation, or an out-of-memory inside XLA).
Per-prompt parameters are a scalar (every prompt) or a list with one value per prompt.
"""

from __future__ import annotations

import math
import numbers
from typing import Any, Sequence

from specjax.errors import UserError

DRAFT_FIELDS = ("n_max", "n_min", "p_min")
ROLLBACKS = ("per_step", "redecode")
DTYPES = ("float32", "bfloat16", "float16")
MAX_SEED = 2 ** 32


def _is_int(x) -> bool:
  return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _is_real(x) -> bool:
  return isinstance(x, numbers.Real) and not isinstance(x, bool)


def per_prompt(name: str, value: Any, n_prompts: int, kind: type) -> list:
  """`value` as a list of n_prompts values of `kind` (int or float): a scalar is repeated, a list
  must have one value or one per prompt. Floats must be finite; ints must be whole numbers."""
  value = value.tolist() if hasattr(value, "tolist") else value          # numpy / jax scalars and arrays
  values = list(value) if isinstance(value, (list, tuple)) else [value]
  if not values:
    raise UserError(f"{name}: empty list")
  for v in values:
    if kind is int and not _is_int(v):
      raise UserError(f"{name} must be an integer, got {v!r}")
    if kind is float and not _is_real(v):
      raise UserError(f"{name} must be a number, got {v!r}")
    if kind is float and not math.isfinite(float(v)):
      raise UserError(f"{name} must be a finite number, got {v!r}")
  if len(values) not in (1, n_prompts):
    raise UserError(f"{name} has {len(values)} values for {n_prompts} prompt(s): give one value, or one per prompt")
  return [kind(v) for v in values] * (n_prompts if len(values) == 1 else 1)


def _in_range(name: str, values: list, ok, allowed: str) -> None:
  bad = [v for v in values if not ok(v)]
  if bad:
    raise UserError(f"{name} must be {allowed}, got {bad[0]!r}")


def _per_prompt_fields(what: str, given, kinds: dict, n_prompts: int, alternative: str) -> dict:
  """The fields of a dict of per-prompt values (`kinds`: name -> int or float), each as a list of
  n_prompts checked values; None values are left out."""
  if not isinstance(given, dict):
    raise UserError(f"{what} must be a dict of {', '.join(kinds)} or a {alternative}, "
                    f"got {type(given).__name__} {given!r}")
  unknown = sorted(set(given) - set(kinds))
  if unknown:
    raise UserError(f"{what}: unknown field(s) {unknown}; allowed: {', '.join(kinds)}")
  return {name: per_prompt(name, v, n_prompts, kinds[name]) for name, v in given.items() if v is not None}


def check_sampling(sampling: dict, n_prompts: int) -> dict:
  """Per-prompt sampling fields (temperature, top_k, top_p, seed) of a dict, checked; -> lists."""
  out = _per_prompt_fields("sampling", sampling, {"temperature": float, "top_k": int, "top_p": float, "seed": int},
                           n_prompts, "SamplingParams")
  _in_range("temperature", out.get("temperature", []), lambda v: v >= 0, ">= 0 (0 = greedy)")
  _in_range("top_k", out.get("top_k", []), lambda v: v >= 0, ">= 0 (0 = off)")
  _in_range("top_p", out.get("top_p", []), lambda v: 0 < v <= 1, "in (0, 1] (1 = off)")
  _in_range("seed", out.get("seed", []), lambda v: 0 <= v < MAX_SEED, f"in [0, {MAX_SEED})")
  return out


def check_draft_params(draft: dict, n_prompts: int) -> dict:
  """Per-prompt draft fields (n_max, n_min, p_min) of a dict, checked; -> lists."""
  out = _per_prompt_fields("draft_params", draft, {"n_max": int, "n_min": int, "p_min": float}, n_prompts,
                           "DraftParams")
  _in_range("n_max", out.get("n_max", []), lambda v: v >= 0, ">= 0 (0 = no drafting)")
  _in_range("n_min", out.get("n_min", []), lambda v: v >= 0, ">= 0")
  _in_range("p_min", out.get("p_min", []), lambda v: 0 <= v <= 1, "in [0, 1]")
  if "n_min" in out and "n_max" in out:
    bad = [(lo, hi) for lo, hi in zip(out["n_min"], out["n_max"]) if lo > hi]
    if bad:
      raise UserError(f"n_min must be <= n_max, got n_min {bad[0][0]} > n_max {bad[0][1]}")
  return out


def check_max_new_tokens(value: Any) -> int:
  if not _is_int(value) or value < 1:
    raise UserError(f"max_new_tokens must be a whole number >= 1, got {value!r}")
  return int(value)


def check_choice(name: str, value: Any, allowed: Sequence[str]) -> str:
  if value not in allowed:
    raise UserError(f"{name} must be one of {', '.join(allowed)}, got {value!r}")
  return value


def check_speculator(speculator: Any) -> None:
  """None (plain decoding), a name or comma-separated chain of known names, or a drafter object."""
  if speculator is None:
    return
  if isinstance(speculator, str):
    from specjax.drafters.speculator_spec import names as known
    names = [s.strip() for s in speculator.split(",")]
    unknown = [n for n in names if n not in known()]
    if unknown or not any(names):
      raise UserError(f"unknown speculator {', '.join(unknown) or repr(speculator)}; known: {', '.join(known())}")
    return
  if not hasattr(speculator, "on_device") or not hasattr(speculator, "max_draft"):
    raise UserError(f"speculator must be None, a speculator name (e.g. 'ngram_simple') or a drafter object, "
                    f"got {type(speculator).__name__} {speculator!r}")


def check_text(text: str, where: str) -> str:
  """A prompt must be valid Unicode text: bytes that were not UTF-8 arrive from the command line as
  lone surrogates, which no tokenizer accepts."""
  try:
    text.encode("utf-8")
  except UnicodeEncodeError as e:
    raw = text[e.start:e.start + 1].encode("utf-8", "surrogateescape")
    raise UserError(f"{where} is not valid UTF-8 text (byte 0x{raw.hex()} at character {e.start})") from None
  return text


def decode_utf8(data: bytes, where: str) -> str:
  """Bytes (stdin, a file) as UTF-8 text, or a UserError naming the first bad byte."""
  try:
    return data.decode("utf-8")
  except UnicodeDecodeError as e:
    raise UserError(f"{where} is not valid UTF-8 text (byte 0x{data[e.start:e.start + 1].hex()} "
                    f"at offset {e.start})") from None


def prompt_list(prompts: Any) -> list:
  """The prompts as a list of texts or token lists. One text, or one list of token ids, is one
  prompt (not a batch of characters / one-token prompts)."""
  if isinstance(prompts, str):
    prompts = [prompts]
  elif isinstance(prompts, Sequence) and prompts and all(_is_int(t) for t in prompts):
    prompts = [list(prompts)]
  elif hasattr(prompts, "tolist") and getattr(prompts, "ndim", 0) in (1, 2):   # numpy / jax arrays
    prompts = prompts.tolist()
    prompts = [prompts] if prompts and _is_int(prompts[0]) else prompts
  if not isinstance(prompts, Sequence) or isinstance(prompts, (bytes, bytearray)):
    raise UserError(f"prompts must be a text, a list of texts, or a list of token-id lists, "
                    f"got {type(prompts).__name__}")
  if len(prompts) == 0:
    raise UserError("no prompts given")
  out = []
  for i, p in enumerate(prompts):
    if isinstance(p, str):
      if not p:
        raise UserError(f"prompt {i} is empty")
      out.append(check_text(p, f"prompt {i}"))
    elif isinstance(p, Sequence) or hasattr(p, "tolist"):
      toks = p.tolist() if hasattr(p, "tolist") else list(p)
      if not toks:
        raise UserError(f"prompt {i} has no tokens")
      if not all(_is_int(t) for t in toks):
        raise UserError(f"prompt {i}: token prompts are lists of integer token ids")
      out.append([int(t) for t in toks])
    else:
      raise UserError(f"prompt {i} must be a text or a list of token ids, got {type(p).__name__}")
  return out


def check_tokens(tokens: list[list[int]], vocab_size: int) -> None:
  for i, toks in enumerate(tokens):
    bad = [t for t in toks if not 0 <= t < vocab_size]
    if bad:
      raise UserError(f"prompt {i}: token id {bad[0]} is outside the model's vocabulary [0, {vocab_size})")
    if not toks:
      raise UserError(f"prompt {i} encodes to no tokens")


def check_context(tokens: list[list[int]], max_new_tokens: int, context_length: int | None) -> None:
  """Prompt + new tokens must fit the model's context (its trained positions): the KV cache is
  sized from them, so an unchecked budget is an out-of-memory error deep inside XLA."""
  if not context_length:
    return
  longest = max(len(t) for t in tokens)
  if longest >= context_length:
    raise UserError(f"prompt of {longest} tokens does not fit the model's context of {context_length} tokens")
  if longest + max_new_tokens > context_length:
    raise UserError(f"prompt ({longest} tokens) + max_new_tokens ({max_new_tokens}) exceed the model's context "
                    f"of {context_length} tokens: at most {context_length - longest} new tokens")
