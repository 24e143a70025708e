"""Speculators by name, as llama.cpp's `--spec-type` names them; a comma-separated list is a chain."""

from __future__ import annotations

from typing import Any

from specjax.errors import UserError

HOST_SPECULATORS = {
    "ngram_simple": ("specjax.drafters.ngram", "NgramSimple"),
    "ngram_map_k": ("specjax.drafters.ngram", "NgramMapK"),
    "ngram_map_k4v": ("specjax.drafters.ngram", "NgramMapK4V"),
    "ngram_mod": ("specjax.drafters.ngram", "NgramMod"),
    "ngram_cache": ("specjax.drafters.ngram", "NgramCache"),
    "suffix": ("specjax.drafters.suffix", "SuffixDecoding"),
}
MODEL_SPECULATORS = ("draft", "mtp", "draft_tree")
MODEL_SPECULATORS += ("eagle3", "eagle3_tree")      # EAGLE-3 heads (--head PATH): chain / EAGLE-2 tree
MODEL_SPECULATORS += ("dflash",)                    # DFlash block drafter (--head PATH; options block_size, window)
MODEL_SPECULATORS += ("dflash_tree",)               # DFlash pass -> best-first token tree (--head PATH; node budget
                                                    # n_max; options depth, top_k, block_size, window)
ALL = MODEL_SPECULATORS + tuple(HOST_SPECULATORS)
# heads trained for a target and committed under assets/ (a source checkout has them): named in the
# error when a head speculator is asked for without --head
COMMITTED_HEADS = {"smollm2-135m-instruct": {"mtp": "mtp_smollm2_gpu2/mtp_head.safetensors",
                                             "eagle3": "eagle3_smollm2_gpu3/eagle3_head.safetensors",
                                             "dflash": "dflash_smollm2_gpu4/dflash.safetensors"}}


# head speculators: (file stem of a head directory, the `format` its JSON config carries)
HEAD_FILES = {"mtp": ("mtp_head", "specjax-mtp-v1"), "eagle3": ("eagle3_head", "specjax-eagle3-v1"),
              "eagle3_tree": ("eagle3_head", "specjax-eagle3-v1"), "dflash": ("dflash", "specjax-dflash-v1"),
              "dflash_tree": ("dflash", "specjax-dflash-v1")}


def check_head(name: str, head) -> None:
  """The checks of a head file for speculator `name` that need no model (files present, the right
  kind of head, readable safetensors): a wrong or broken head is one UserError before any loading."""
  from pathlib import Path

  from specjax.drafters.head_file import check_head_file
  if name in HEAD_FILES and isinstance(head, (str, Path)):
    stem, fmt = HEAD_FILES[name]
    check_head_file(head, stem, fmt, config_optional=name == "mtp")


def _needs_head(name: str, what: str, target) -> ValueError:
  """The error for a head speculator without a head, naming a committed head for this target when
  the checkout has one."""
  import os
  from pathlib import Path
  kind, model, hint = name.split("_")[0], str(getattr(target, "name", "") or "").lower(), ""
  for key, heads in COMMITTED_HEADS.items():
    path = Path(__file__).resolve().parents[2] / "assets" / heads.get(kind, "-")
    if model.startswith(key) and path.is_file():
      hint = f"; for {key} a trained one is committed: --head {os.path.relpath(path)}"
  return UserError(f"speculator {name!r} needs a trained {what} (--head PATH){hint}")


def _host(name: str, options: dict[str, Any]):
  import importlib
  module, cls = HOST_SPECULATORS[name]
  return getattr(importlib.import_module(module), cls)(**options)


def make_speculator(spec: Any, target, *, draft_model=None, draft_params=None, options: dict | None = None,
                    policy: str = "best", head=None):
  """A drafter from a name ("ngram_simple"), a chain ("ngram_simple,suffix") or a drafter object."""
  if not isinstance(spec, str):
    return spec
  names = [s.strip() for s in spec.split(",") if s.strip()]
  unknown = [n for n in names if n not in ALL]
  if unknown:
    raise UserError(f"unknown speculator(s) {unknown}; known: {', '.join(ALL)}")
  options = options or {}
  if len(names) > 1:
    if any(n in MODEL_SPECULATORS for n in names):
      raise UserError("chains of the model drafter with host speculators are not supported yet; "
                       "chain host speculators (ngram_*, suffix)")
    from specjax.drafters.chain import Chain
    return Chain([_host(n, options.get(n, {})) for n in names], policy=policy)
  name = names[0]
  check_head(name, head)
  opts = options.get(name, options if not any(k in HOST_SPECULATORS for k in options) else {})
  if name == "ngram_simple" and opts.get("device", True):
    from specjax.drafters.ngram_device import NgramSimpleDevice
    import numpy as np
    width = int(np.max(np.asarray(draft_params.n_max))) if draft_params is not None else None
    return NgramSimpleDevice(**{k: v for k, v in opts.items() if k != "device"}, width=width)
  if name == "ngram_mod" and opts.get("device", True):
    from specjax.drafters.ngram_mod_device import NgramModDevice
    import numpy as np
    width = int(np.max(np.asarray(draft_params.n_max))) if draft_params is not None else None
    return NgramModDevice(**{k: v for k, v in opts.items() if k != "device"}, width=width)
  if name == "draft":
    return make_draft_model_drafter(target, draft_model, draft_params, **opts)
  if name == "draft_tree":
    return make_draft_tree_speculator(target, draft_model, **opts)
  if name == "mtp":
    from specjax.drafters.mtp import make_mtp_drafter
    if head is None:
      raise _needs_head(name, "MTP head", target)
    return make_mtp_drafter(target, head, draft_params)
  if name in ("eagle3", "eagle3_tree"):   # EAGLE-3 heads: chains, or EAGLE-2 trees (opts: depth, top_k, seed)
    from specjax.drafters.eagle3 import make_eagle3_drafter
    if head is None:
      raise _needs_head(name, "EAGLE-3 head", target)
    return make_eagle3_drafter(target, head, draft_params, tree=name == "eagle3_tree",
                               **{k: v for k, v in opts.items() if k in ("depth", "top_k", "seed")})
  if name == "dflash":   # DFlash: one pass drafts a block; n_max <= block_size - 1
    from specjax.drafters.dflash import make_dflash_drafter
    if head is None:
      raise _needs_head(name, "DFlash drafter", target)
    return make_dflash_drafter(target, head, draft_params,
                               **{k: v for k, v in opts.items() if k in ("block_size", "window", "seed")})
  if name == "dflash_tree":   # one DFlash pass drafts a tree: n_max nodes, depth <= block_size - 1
    from specjax.drafters.dflash_tree import make_dflash_tree_drafter
    if head is None:
      raise _needs_head(name, "DFlash drafter", target)
    return make_dflash_tree_drafter(target, head, draft_params, **{k: v for k, v in opts.items()
                                                                   if k in ("depth", "top_k", "block_size", "window", "seed")})
  return _host(name, {k: v for k, v in opts.items() if k != "device"})


def make_draft_model_drafter(target, draft_model, draft_params=None, **opts):
  from specjax.drafters.draft_model import DraftModelDrafter, check_compatible
  from specjax.models.load import LoadedModel, load_model
  if draft_model is None:
    raise UserError("speculator 'draft' needs a draft model (--draft-model NAME|PATH)")
  if not isinstance(draft_model, LoadedModel):
    import jax
    dtype = jax.tree_util.tree_leaves(target.params)[0].dtype
    draft_model = load_model(draft_model, dtype=dtype)
  if target.tokenizer is not None and draft_model.tokenizer is not None:
    check_compatible(target.tokenizer, draft_model.tokenizer)
  n_max = 8
  if draft_params is not None:
    import numpy as np
    n_max = int(np.max(np.asarray(draft_params.n_max)))
  return DraftModelDrafter(cfg=draft_model.cfg, max_draft=max(n_max, 1), weights=draft_model.params, **opts)


def make_draft_tree_speculator(target, draft_model, **opts):
  """`draft_tree`: the draft model drafts a token tree (options depth, top_k, width)."""
  from specjax.drafters.draft_model_tree import DraftModelTreeDrafter
  plain = make_draft_model_drafter(target, draft_model)          # loads the model and checks compatibility
  return DraftModelTreeDrafter(cfg=plain.cfg, weights=plain.weights, **opts)
