"""The built-in speculators, as llama.cpp's `--spec-type` names them, each a `SpeculatorSpec`
(`specjax.drafters.speculator_spec`) with its typed options; `make_speculator` builds a drafter from
a name or a comma-separated chain of host speculators. User code adds its own with
`specjax.register_speculator`."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from specjax.drafters.speculator_spec import Option, SpeculatorSpec, get, names, register_speculator
from specjax.errors import UserError

# heads trained for a target and committed under assets/<target>/<kind>/ (a source checkout has
# them; how each was trained: its folder and experiments/README.md): named in the error when a head
# speculator is asked for without --head
COMMITTED_HEADS = {"smollm2-135m-instruct": {"mtp": "smollm2/mtp/mtp_head.safetensors",
                                             "eagle3": "smollm2/eagle3/eagle3_head.safetensors",
                                             "dflash": "smollm2/dflash/dflash.safetensors"}}
_ASSETS = Path(__file__).resolve().parents[2] / "assets"


def _width(draft_params) -> int | None:
  return int(np.max(np.asarray(draft_params.n_max))) if draft_params is not None else None


def _needs_head(spec: SpeculatorSpec, target, why: str = "") -> UserError:
  """The error for a head speculator without a head (`why` says more), naming a committed head for
  this target when the checkout has one."""
  model, hint = str(getattr(target, "name", "") or "").lower(), ""
  for key, rel in spec.committed_heads.items():
    if model.startswith(key) and (_ASSETS / rel).is_file():
      hint = f"; for {key} a trained one is committed: --head {os.path.relpath(_ASSETS / rel)}"
  from specjax.drafters.head_file import HEAD_KINDS
  what = HEAD_KINDS[spec.head_format].split(" ", 1)[1]          # "an MTP head" -> "MTP head"
  return UserError(f"speculator {spec.name!r} needs a trained {what} (--head PATH){'; ' + why if why else ''}{hint}")


def _own_head(spec: SpeculatorSpec, target):
  """The head of a head speculator asked for without one: for `mtp`, the target checkpoint's own
  MTP layers (a Qwen3.5 folder's `mtp.*` tensors) where it has them; otherwise the error."""
  if spec.name != "mtp":
    raise _needs_head(spec, target)
  from specjax.drafters.mtp_reference import builtin_layers
  folder, why = builtin_layers(target)
  if folder is None:
    raise _needs_head(spec, target, why)
  return folder


# --- builders: (target, *, draft_model, draft_params, head, **options) -> Drafter ----------------

def _host_builder(module: str, cls: str):
  def build(target, *, draft_model=None, draft_params=None, head=None, **opts):
    import importlib
    return getattr(importlib.import_module(module), cls)(**opts)
  return build


def _ngram_simple(target, *, draft_model=None, draft_params=None, head=None, device=True, **opts):
  if not device:
    from specjax.drafters.ngram_simple import NgramSimple
    return NgramSimple(**opts)
  from specjax.drafters.ngram_device import NgramSimpleDevice
  return NgramSimpleDevice(**opts, width=_width(draft_params))


def _ngram_mod(target, *, draft_model=None, draft_params=None, head=None, device=True, **opts):
  if not device:
    from specjax.drafters.ngram_mod import NgramMod
    return NgramMod(**opts)
  from specjax.drafters.ngram_mod_device import NgramModDevice
  return NgramModDevice(**opts, width=_width(draft_params))


def _draft(target, *, draft_model=None, draft_params=None, head=None, **opts):
  return make_draft_model_drafter(target, draft_model, draft_params, **opts)


def _draft_tree(target, *, draft_model=None, draft_params=None, head=None, **opts):
  return make_draft_tree_speculator(target, draft_model, **opts)


def _mtp(target, *, draft_model=None, draft_params=None, head=None, **opts):
  from specjax.drafters.mtp import make_mtp_drafter
  return make_mtp_drafter(target, head, draft_params, **opts)


def _eagle3(tree: bool):
  def build(target, *, draft_model=None, draft_params=None, head=None, **opts):
    from specjax.drafters.eagle3_drafter import make_eagle3_drafter
    return make_eagle3_drafter(target, head, draft_params, tree=tree, **opts)
  return build


def _dflash(target, *, draft_model=None, draft_params=None, head=None, **opts):
  from specjax.drafters.dflash import make_dflash_drafter
  return make_dflash_drafter(target, head, draft_params, **opts)


def _dflash_tree(target, *, draft_model=None, draft_params=None, head=None, **opts):
  from specjax.drafters.dflash_tree import make_dflash_tree_drafter
  return make_dflash_tree_drafter(target, head, draft_params, **opts)


# --- examples: random heads / draft models for any target (the registry-wide tests) -------------

def _example_draft_model(target, workdir, **tree):
  """A draft model: the target with every matrix perturbed by 30% of its spread (drafts agree often
  but not always)."""
  import jax
  import jax.numpy as jnp
  from specjax.models.load import LoadedModel
  leaves, treedef = jax.tree_util.tree_flatten(target.params)
  keys = jax.random.split(jax.random.key(2), len(leaves))
  noisy = [x + (0.3 * jnp.std(x) * jax.random.normal(k, x.shape)).astype(x.dtype) if x.ndim >= 2 else x
           for x, k in zip(leaves, keys)]
  return {"draft_model": LoadedModel(name="draft", cfg=target.cfg, params=jax.tree_util.tree_unflatten(treedef, noisy)),
          **tree}


def _example_mtp(target, workdir):
  from specjax.drafters.mtp import init_heads
  return {"head": init_heads(target.logical_cfg, 2, seed=1)}


def _example_eagle3(target, workdir, **tree):
  from specjax.drafters.eagle3 import Eagle3Config, build_d2t, init_head
  v = target.cfg.vocab_size
  draft_vocab = max(2, (3 * v) // 4)
  hc = Eagle3Config.make(target.logical_cfg, draft_vocab)
  d2t = build_d2t([np.repeat(np.arange(v), np.arange(v, 0, -1))], v, draft_vocab)   # frequent = low ids
  return {"head": init_head(hc, 7, target_params=target.params, d2t=d2t), "hc": hc, "d2t": d2t, **tree}


def _example_dflash(target, workdir, **tree):
  from specjax.drafters.dflash import DFlashConfig, init_dflash
  taps = tuple(sorted({0, target.cfg.n_layers - 1}))
  dc = DFlashConfig(taps=taps, n_layers=1, block_size=5, window=8)
  return {"head": (init_dflash(target.logical_cfg, dc, seed=3, target_params=target.params), dc), **tree}


def _example_small_ngram(target, workdir):
  return {"size_n": 2, "size_m": 4}       # short prompts repeat only short n-grams


# --- option schemas -------------------------------------------------------------------------------

def _int(name, default, help, low=1, high=None, optional=False):
  return Option(name, int, default, help, low=low, high=high, optional=optional)


_SIZE_NM = (_int("size_n", 12, "n-gram length matched at the end of the history"),
            _int("size_m", 48, "tokens drafted after a match (upper bound of the draft)"))
_DEVICE = Option("device", bool, True, "run inside the jitted loop (false: the host implementation)")
_SEED = _int("seed", 0, "drafter sampling seed", low=0)
_NODES = _int("n_nodes", None, "the tree's node budget: nodes verified per round (default: min(32, the candidates))",
              optional=True)
_TREE = (_int("depth", 6, "tree depth (levels drafted)"), _int("top_k", 8, "children expanded per node"), _NODES)
_DFLASH = (_int("block_size", None, "block drafted per pass (default: as trained)", low=2, optional=True),
           _int("window", None, "target features kept (default: as trained)", optional=True), _SEED)

for _spec in (
    SpeculatorSpec("ngram_simple", _ngram_simple, "copy what followed the last n-gram's previous occurrence",
                   where="device", chainable=True, options=_SIZE_NM + (_DEVICE,), example=_example_small_ngram),
    SpeculatorSpec("ngram_map_k", _host_builder("specjax.drafters.ngram_map", "NgramMapK"),
                   "n-gram -> continuation map with llama.cpp's key statistics", options=_SIZE_NM,
                   example=_example_small_ngram),
    SpeculatorSpec("ngram_map_k4v", _host_builder("specjax.drafters.ngram_map", "NgramMapK4V"),
                   "n-gram map keeping four values per key",
                   options=_SIZE_NM + (_int("min_hits", 1, "hits before a value is drafted"),),
                   example=_example_small_ngram),
    SpeculatorSpec("ngram_mod", _ngram_mod, "one hashed n-gram table shared by every sequence and request",
                   where="device", chainable=True,
                   example=lambda t, w: {"n_match": 2, "n_min": 1, "n_max": 4, "table_size": 1 << 12, "add_chunk": 1},
                   options=(
                       _int("n_match", 24, "tokens hashed into a key"), _int("n_min", 48, "shortest draft"),
                       _int("n_max", 64, "longest draft"), _int("table_size", 1 << 22, "table entries"),
                       _int("add_chunk", 32, "tokens added to the table per chunk", low=0),
                       Option("low_accept", float, 0.5, "acceptance below which a sequence backs off", 0, 1),
                       _int("low_rounds", 3, "low-acceptance rounds before backing off"),
                       Option("reset_occupancy", float, 0.25, "table occupancy that resets it", 0, 1), _DEVICE)),
    SpeculatorSpec("ngram_cache", _host_builder("specjax.drafters.ngram_cache", "NgramCache"),
                   "lookup decoding over context, dynamic and static n-gram caches", options=(
                       _int("n_draft", 8, "longest draft"),
                       Option("static", str, None, "static cache file (llama.cpp format)", optional=True),
                       Option("dynamic", str, None, "dynamic cache file (llama.cpp format)", optional=True),
                       Option("update_dynamic", bool, False, "learn the dynamic cache across requests"))),
    SpeculatorSpec("suffix", _host_builder("specjax.drafters.suffix", "SuffixDecoding"),
                   "SuffixDecoding: suffix trees over this request and earlier ones", options=(
                       _int("max_depth", 64, "longest suffix matched"),
                       _int("max_spec_tokens", None, "longest draft (default max_depth)", optional=True),
                       Option("max_spec_factor", float, 1.0, "draft length per matched token", 0),
                       Option("max_spec_offset", float, 0.0, "draft length offset"),
                       Option("min_token_prob", float, 0.1, "stop below this continuation frequency", 0, 1),
                       _int("max_cached_requests", 100000, "earlier requests kept in the global tree", low=0))),
    SpeculatorSpec("draft", _draft, "a smaller draft model (--draft-model) drafts a chain", where="device",
                   needs_draft_model=True, example=_example_draft_model,
                   options=(Option("unroll", bool, True, "unroll the draft loop in the program"),
                            _int("block", 4, "unrolled: past this many steps, blocks of this many steps "
                                 "that stop once every sequence stopped drafting (0: never stop early)",
                                 low=0))),
    SpeculatorSpec("draft_tree", _draft_tree, "a draft model drafts a token tree", where="device", tree=True,
                   needs_draft_model=True, example=lambda t, w: _example_draft_model(t, w, depth=2, top_k=2),
                   options=(_int("depth", 3, "tree depth"), _int("top_k", 2, "children per expanded node"),
                            _int("width", 2, "nodes expanded per level"),
                            _int("n_nodes", None, "the tree's node budget: the first n_nodes of its level-order "
                                 "layout (default: all of it)", optional=True))),
    SpeculatorSpec("mtp", _mtp, "trained multi-token-prediction heads on the target's last hidden state",
                   where="device", head_format="specjax-mtp-v1", head_stem="mtp_head", example=_example_mtp,
                   options=(Option("unroll", bool, True, "unroll the heads in the program"),),
                   committed_heads={"smollm2-135m-instruct": COMMITTED_HEADS["smollm2-135m-instruct"]["mtp"]}),
    SpeculatorSpec("eagle3", _eagle3(False), "an EAGLE-3 head over fused target features drafts a chain",
                   where="device", head_format="specjax-eagle3-v1", head_stem="eagle3_head", options=(_SEED,),
                   example=_example_eagle3,
                   committed_heads={"smollm2-135m-instruct": COMMITTED_HEADS["smollm2-135m-instruct"]["eagle3"]}),
    SpeculatorSpec("eagle3_tree", _eagle3(True), "an EAGLE-3 head drafts an EAGLE-2 tree (n_nodes nodes)",
                   where="device", tree=True, head_format="specjax-eagle3-v1", head_stem="eagle3_head",
                   options=_TREE + (_SEED,), example=lambda t, w: _example_eagle3(t, w, depth=2, top_k=2, n_nodes=6),
                   committed_heads={"smollm2-135m-instruct": COMMITTED_HEADS["smollm2-135m-instruct"]["eagle3"]}),
    SpeculatorSpec("dflash", _dflash, "a DFlash block drafter drafts a whole block in one pass", where="device",
                   head_format="specjax-dflash-v1", head_stem="dflash", options=_DFLASH, example=_example_dflash,
                   committed_heads={"smollm2-135m-instruct": COMMITTED_HEADS["smollm2-135m-instruct"]["dflash"]}),
    SpeculatorSpec("dflash_tree", _dflash_tree, "one DFlash pass drafts a best-first tree (n_nodes nodes)",
                   where="device", tree=True, head_format="specjax-dflash-v1", head_stem="dflash",
                   options=(_int("depth", 8, "tree depth (<= block_size - 1)"),
                            _int("top_k", 8, "children per expanded node"), _NODES) + _DFLASH,
                   example=lambda t, w: _example_dflash(t, w, depth=2, top_k=2, n_nodes=6),
                   committed_heads={"smollm2-135m-instruct": COMMITTED_HEADS["smollm2-135m-instruct"]["dflash"]}),
):
  register_speculator(_spec)

# the built-in names (user-registered ones: `speculator_spec.names()`)
ALL = ("draft", "mtp", "draft_tree", "eagle3", "eagle3_tree", "dflash", "dflash_tree", "ngram_simple",
       "ngram_map_k", "ngram_map_k4v", "ngram_mod", "ngram_cache", "suffix")
MODEL_SPECULATORS = ALL[:7]
HOST_SPECULATORS = ALL[7:]
HEAD_FILES = {n: (get(n).head_stem, get(n).head_format) for n in ALL if get(n).head_format}


def check_head(name: str, head) -> None:
  """The checks of a head file for speculator `name` that need no model (files present, the right
  kind of head, readable safetensors): a wrong or broken head is one UserError before any loading."""
  from specjax.drafters import dflash_reference, eagle3_reference, mtp_reference
  from specjax.drafters.head_file import check_head_file
  spec = get(name)
  reference = {"specjax-eagle3-v1": eagle3_reference, "specjax-dflash-v1": dflash_reference,
               "specjax-mtp-v1": mtp_reference}.get(spec.head_format)
  if reference is not None and isinstance(head, (str, Path)) and reference.is_reference_folder(head):
    return                           # a reference layout (EAGLE / z-lab / DeepSeek / Qwen3-Next): checked when it loads
  if spec.head_format and isinstance(head, (str, Path)):
    check_head_file(head, spec.head_stem, spec.head_format, config_optional=name == "mtp")


def split_options(names_: list[str], options: dict | None) -> dict[str, dict]:
  """Options per speculator: `{name: {...}}` per chain member, or (one speculator) its own flat
  `{option: value}`; every value checked against the member's schema."""
  options = dict(options or {})
  if not isinstance(options, dict):
    raise UserError(f"options must be a mapping, got {type(options).__name__}")
  keyed = {k: v for k, v in options.items() if k in names_}
  flat = {k: v for k, v in options.items() if k not in names_}
  if flat and len(names_) > 1:
    raise UserError(f"options for a chain are per member: {{name: {{option: value}}}} with names in {names_}; "
                    f"got {sorted(flat)}")
  out = {}
  for n in names_:
    given = keyed.get(n, flat if len(names_) == 1 else {})
    if not isinstance(given, dict):
      raise UserError(f"options of {n} must be a mapping, got {given!r}")
    out[n] = get(n).check_options(given)
  return out


def check_speculator(spec: str, options: dict | None = None, *, head=None, draft_model=None) -> list[str]:
  """Every check of a speculator request that needs no model: known names, chains of host
  speculators only, options against their schemas, head kind and files, draft model given.
  -> the member names."""
  names_ = [s.strip() for s in spec.split(",") if s.strip()]
  if not names_:
    raise UserError(f"empty speculator name {spec!r}; known: {', '.join(names())}")
  for n in names_:
    get(n)
  if len(names_) > 1:
    fixed = [n for n in names_ if not get(n).chainable]
    if fixed:
      raise UserError(f"chains take host speculators (ngram_*, suffix, user host drafters); {fixed} cannot "
                      "join one")
  split_options(names_, options)
  for n in names_:
    s = get(n)
    if s.head_format:
      check_head(n, head)
    if s.needs_draft_model and draft_model is None:
      raise UserError(f"speculator {n!r} needs a draft_model (--draft-model NAME|PATH)")
  return names_


def make_speculator(spec: Any, target, *, draft_model=None, draft_params=None, options: dict | None = None,
                    policy: str = "best", head=None):
  """A drafter from a name ("ngram_simple"), a chain ("ngram_simple,suffix") or a drafter object."""
  if not isinstance(spec, str):
    return spec
  names_ = check_speculator(spec, options, head=head, draft_model=draft_model)
  per_name = split_options(names_, options)
  if len(names_) > 1:
    from specjax.drafters.chain import Chain
    members = [get(n).build(target, draft_params=draft_params, **{**per_name[n], **(
        {"device": False} if "device" in get(n).option_names else {})}) for n in names_]
    return Chain(members, policy=policy)
  s = get(names_[0])
  if s.head_format and head is None:
    head = _own_head(s, target)
  return s.build(target, draft_model=draft_model, draft_params=draft_params, head=head, **per_name[names_[0]])


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
  """`draft_tree`: the draft model drafts a token tree (options depth, top_k, width, n_nodes)."""
  from specjax.drafters.draft_model_tree import DraftModelTreeDrafter
  plain = make_draft_model_drafter(target, draft_model)          # loads the model and checks compatibility
  return DraftModelTreeDrafter(cfg=plain.cfg, weights=plain.weights, **opts)
