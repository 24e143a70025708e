"""The Python API a notebook calls:

    from specjax import api
    target = api.load("smollm2-135m-instruct")
    out = api.generate(target, ["Write a haiku about JAX."], speculator="ngram_simple",
                       sampling={"temperature": 0.0}, max_new_tokens=128)
    print(out.texts[0], out.stats.format())

`speculator` is None (plain decoding), a name or comma-separated chain of names
(`draft`, `ngram_simple`, ..., `suffix`), or a drafter object.

`api.load(..., invariant=True)` (or SPECJAX_INVARIANT=1, or `batch_invariant(target)`) runs the
target's forward through the batch-invariant kernels (`ModelConfig.invariant`): speculative greedy
output then equals plain greedy output bitwise in bf16 too, at some cost in speed.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specjax import parallel
from specjax.engine import request
from specjax.engine.decode import generate_plain
from specjax.drafters.base import DraftParams
from specjax.drafters.registry import make_speculator
from specjax.engine import speculative_generate
from specjax.errors import UserError
from specjax.models.config import ModelConfig
from specjax.models.load import LoadedModel, load_model
from specjax.engine.sampling import SamplingParams
from specjax.engine.stats import SpecStats


INVARIANT_ENV = "SPECJAX_INVARIANT"     # "1": `load` turns batch-invariant mode on unless told otherwise


def load(name_or_path: str, dtype: str = "float32", mesh=None, invariant: bool | None = None,
         head_placement: str = "replicated") -> LoadedModel:
  """Load a model by fetch name (downloaded on first use), GGUF path or HF directory.

  mesh: None (one device), a spec such as "data=2,model=4", or a `jax.sharding.Mesh` with axes
  ("data", "model"): the parameters are sharded over it (`specjax.parallel`), read on the host and
  written straight to their shards, and `generate` runs the batch over "data"; KV heads the model
  axis does not divide are padded with zero KV groups (`shard`: more KV-cache memory, same output).
  head_placement: on a mesh, trained drafter heads (MTP, EAGLE-3, DFlash) "replicated" on every
  device or "sharded" over the model axis like the target (`parallel.place_drafter`).
  invariant: batch-invariant forward (`batch_invariant`); None: SPECJAX_INVARIANT=1 turns it on."""
  if not isinstance(name_or_path, (str, os.PathLike)):
    raise UserError(f"model must be a fetch name or a path, got {type(name_or_path).__name__}")
  dt = jnp.dtype(request.check_choice("dtype", str(dtype), request.DTYPES))
  request.check_choice("head_placement", head_placement, parallel.HEAD_PLACEMENTS)
  if invariant is None:
    invariant = os.environ.get(INVARIANT_ENV, "0") == "1"
  mesh = parallel.as_mesh(mesh)
  if invariant and mesh is not None:
    raise UserError("batch-invariant mode runs on one device (its kernels are not partitioned over a mesh)")
  if mesh is None:
    model = load_model(str(name_or_path), dtype=dt)
    return batch_invariant(model) if invariant else model
  with jax.default_device(jax.local_devices(backend="cpu")[0]):   # host memory: no device holds a whole copy
    model = load_model(str(name_or_path), dtype=dt)
  return shard(model, mesh, head_placement=head_placement)


def batch_invariant(model: LoadedModel, on: bool = True) -> LoadedModel:
  """`model` with batch-invariant mode on (or off): every linear layer, norm and attention of its
  forward runs through kernels whose per-row reduction order does not depend on how many tokens
  are computed together (`specjax.kernels.invariant_*`), so a position's logits are the same in a
  one-token decode and in a K+1-token or tree verification. Same parameters; attention-only
  targets on one device."""
  if not isinstance(model.cfg, ModelConfig):
    raise UserError("batch-invariant mode covers attention-only targets (llama, qwen2/3, mistral, gemma3)")
  if on and getattr(model, "mesh", None) is not None:
    raise UserError("batch-invariant mode runs on one device (its kernels are not partitioned over a mesh)")
  return dataclasses.replace(model, cfg=model.cfg.replace(invariant=on))


def shard(model: LoadedModel, mesh, head_placement: str = "replicated") -> LoadedModel:
  """`model` with its parameters sharded over `mesh` (a spec string or a Mesh), tensor-parallel over
  the model axis (whole KV groups per device). Where the model axis does not divide the KV heads
  (SmolLM2-135M's 3 on model=2 or 4), the target is padded with zero KV groups up to the next
  multiple (`parallel.pad_heads`): the same greedy tokens, but its KV cache and attention grow by
  padded / real KV heads (3 -> 4: 4/3; a warning says so). The result's `cfg` is then the padded
  config and `logical_cfg` the checkpoint's own, which drafters use. `head_placement`: where the
  drafters' trained heads go on this mesh ("replicated" or "sharded", `parallel.place_drafter`)."""
  request.check_choice("head_placement", head_placement, parallel.HEAD_PLACEMENTS)
  mesh = parallel.as_mesh(mesh)
  if mesh is None:
    return model
  from specjax.models import fused_layer
  if fused_layer.enabled():
    raise UserError(f"{fused_layer.FUSED_ENV}=1 runs on one device (the fused layer's kernels are not "
                    "partitioned over a mesh); unset it to shard the model")
  params, cfg = parallel.place_target(model.params, model.cfg, mesh)
  logical = model.logical_cfg
  return dataclasses.replace(model, params=params, cfg=cfg, mesh=mesh, head_placement=head_placement,
                             unpadded_cfg=None if cfg == logical else logical)


@dataclasses.dataclass
class Output:
  tokens: list[list[int]]            # generated tokens per prompt
  texts: list[str] | None            # decoded text (when the target has a tokenizer)
  stats: SpecStats | None            # None for plain decoding
  seconds: float

  @property
  def tokens_per_s(self) -> float:
    return sum(len(t) for t in self.tokens) / max(self.seconds, 1e-9)


def encode_prompts(target: LoadedModel, prompts: Sequence[str | list[int]], chat: bool,
                   parse_special: bool = False) -> list[list[int]]:
  """Token ids of each prompt. With `chat`, a text is the user message of a one-turn chat, and
  control-token strings in it stay text unless `parse_special` (a user cannot forge a turn)."""
  out = []
  for p in request.prompt_list(prompts):
    if isinstance(p, str):
      if target.tokenizer is None:
        raise UserError("text prompts need a tokenizer; this model has none (pass token lists)")
      out.append(target.tokenizer.encode_chat([{"role": "user", "content": p}], parse_special=parse_special)
                 if chat else target.tokenizer.encode(p))
    else:
      out.append(list(p))
  return out


def generate(target: LoadedModel, prompts: Sequence[str | list[int]], *, speculator: Any = None,
             sampling: SamplingParams | dict | None = None, draft_params: DraftParams | dict | None = None,
             max_new_tokens: int = 128, chat: bool = True, stop_at_eos: bool = True,
             draft_model: LoadedModel | str | None = None, head: Any = None,
             capacity: int | None = None, rollback: str = "per_step", adaptive: bool = False,
             parse_special: bool = False, options: dict | None = None) -> Output:
  """Generate for a batch of prompts (text or token lists), with or without speculation.

  rollback: how a hybrid (recurrent) target's state goes back after a rejected draft: "per_step"
  (verification keeps the state after each position) or "redecode" (restore the pre-verification
  state and re-run the accepted tokens). Attention-only targets roll back by KV length either way.
  adaptive: per-sequence draft lengths from running acceptance and a verification width chosen by
  measured cost (`specjax.engine.adaptive`); n_max is then the upper bound.
  parse_special: with `chat`, parse control-token strings inside the prompts (default: text).
  draft_params: n_max / n_min / p_min, scalars or per prompt (`DraftParams`); a tree's n_max caps
  the depth of the nodes it verifies, its node budget is its `n_nodes` option.
  options: the speculator's options (`specjax speculators` lists them), e.g. {"size_n": 3} or, for a
  tree, {"n_nodes": 48}; for a chain, per member: {"ngram_simple": {...}, "suffix": {...}}.

  Every argument is checked before anything compiles; a bad one raises `UserError` naming it."""
  prompts = request.prompt_list(prompts)
  b = len(prompts)
  max_new_tokens = request.check_max_new_tokens(max_new_tokens)
  request.check_choice("rollback", rollback, request.ROLLBACKS)
  request.check_speculator(speculator)
  if sampling is None or isinstance(sampling, dict):
    sampling = SamplingParams.make(b, **request.check_sampling(sampling or {}, b))
  elif not isinstance(sampling, SamplingParams):
    request.check_sampling(sampling, b)          # raises: names the type
  if isinstance(draft_params, dict):
    draft_params = DraftParams(**request.check_draft_params(draft_params, b))
  elif draft_params is not None and not isinstance(draft_params, DraftParams):
    request.check_draft_params(draft_params, b)  # raises: names the type
  elif isinstance(draft_params, DraftParams):
    request.check_draft_params(dataclasses.asdict(draft_params), b)
  if speculator is None and (draft_model is not None or head is not None or adaptive or options):
    raise UserError("draft_model, head, options and adaptive apply to speculative generation: give a speculator")
  tokens = encode_prompts(target, prompts, chat, parse_special)
  request.check_tokens(tokens, target.cfg.vocab_size)
  request.check_context(tokens, max_new_tokens, getattr(target, "context_length", None))
  stop_ids = tuple(target.tokenizer.eos_ids) if (stop_at_eos and target.tokenizer is not None) else ()
  mesh = getattr(target, "mesh", None)
  with parallel.use(mesh):
    out_tokens, stats, seconds = _run(target, tokens, speculator, sampling, draft_params, max_new_tokens, stop_ids,
                                      draft_model, head, capacity, rollback, adaptive, options, mesh)
  texts = None
  if target.tokenizer is not None:
    texts = [target.tokenizer.decode(t) for t in out_tokens]
  return Output(tokens=out_tokens, texts=texts, stats=stats, seconds=seconds)


def _run(target, tokens, speculator, sampling, draft_params, max_new_tokens, stop_ids, draft_model, head, capacity,
         rollback, adaptive, options, mesh):
  """The engine call of `generate` -> (tokens per prompt, stats or None, seconds). On a mesh whose
  data axis does not divide the batch, rows repeating the last prompt pad it (they are dropped
  from the output; speculation stats count them)."""
  b = len(tokens)
  bp = parallel.padded_batch(b, mesh)
  if bp > b:
    tokens = tokens + [tokens[-1]] * (bp - b)
    sampling = SamplingParams(*(_pad_rows(a, b, bp) for a in dataclasses.astuple(sampling)))
    if draft_params is not None:
      draft_params = DraftParams(**{k: _pad_rows(v, b, bp) for k, v in dataclasses.asdict(draft_params).items()})
  if speculator is None:
    r = generate_plain(target.params, target.cfg, tokens, max_new_tokens=max_new_tokens, sampling=sampling,
                       stop_ids=stop_ids, capacity=capacity)
    stats, seconds, out_tokens = None, r.seconds, r.tokens
  else:
    drafter = make_speculator(speculator, target, draft_model=draft_model, draft_params=draft_params, head=head,
                              options=options)
    drafter = parallel.place_drafter(drafter, target.params, mesh, getattr(target, "head_placement", "replicated"))
    draft_params = draft_params or DraftParams(n_max=drafter.max_draft)
    r = speculative_generate(target.params, target.cfg, tokens, drafter, max_new_tokens=max_new_tokens,
                             sampling=sampling, draft_params=draft_params, stop_ids=stop_ids, capacity=capacity,
                             rollback=rollback, adaptive=adaptive)
    stats, seconds, out_tokens = r.stats, r.seconds, r.tokens
  return out_tokens[:b], stats, seconds


def _pad_rows(x, b: int, bp: int):
  """A per-sequence value [b, ...] padded to bp rows by repeating its last row; scalars as they are."""
  if np.ndim(x) == 0 or np.shape(x)[0] != b:
    return x
  a = np.asarray(x)
  return np.concatenate([a, np.repeat(a[-1:], bp - b, axis=0)]) if isinstance(x, (list, tuple, np.ndarray)) \
      else jnp.concatenate([x, jnp.repeat(x[-1:], bp - b, axis=0)])
