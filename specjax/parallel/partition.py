"""Where every array lives on a (data, model) mesh: `PartitionSpec`s by pytree path, placement,
and the constraints the jitted loops apply to their state.

Tensor parallelism (Megatron's layout, by parameter path; [out, in] kernels as in `layers.Linear`):

    .../qkv_proj/kernel      [(H+2KVH)*D, d_model]   outputs on "model"   (attention heads)
    .../qkv_proj/bias        [(H+2KVH)*D]            on "model"
    .../o_proj/kernel        [d_model, H*D]          inputs on "model"    (partial sums: one all-reduce)
    .../gate_up_proj/kernel  [2F, d_model]           outputs on "model"   (MLP)
    .../down_proj/kernel     [d_model, F]            inputs on "model"
    embed_tokens/embedding   [V, d_model]            vocabulary on "model"
    lm_head/kernel           [V, d_model]            vocabulary on "model"
    anything else (norms, gated-DeltaNet tensors, ...) replicated

Per-sequence state (`GenState`, drafter states, sampling parameters): the leading batch axis on
"data"; a target's KV cache [B, S, KVH, D] also has its KV heads on "model", like the heads that
write it. Nothing else is decided here: params and inputs are placed with these NamedShardings
and `jax.jit` propagates them through the engine's programs (XLA's SPMD partitioner), so a
sharded run computes what the one-device run computes, up to the order of float reductions.

Note on the fused projections: the outputs (kernel rows) of `qkv_proj` are grouped per KV head (for KV
head g: its query heads, K_g, V_g) and those of `gate_up_proj` interleaved per MLP unit (gate_j,
up_j), one order whatever the mesh (`models/layers.py`, written so by the loaders). A contiguous
split over "model" then gives each device whole KV groups (the model axis divides the KV heads, which
are padded where it does not: below) and the gate and up outputs of the same units, so a decoder
layer costs Megatron's 2 all-reduces and nothing else. Split as whole parts ([Q | K | V], [gate | up]), one device would
hold all of Q and another K and V, and XLA would move the projected activations to where attention
and the gated product need them (collective-permutes after every fused projection). A hybrid
target's gated attention groups its `qkv_proj` (query | gate per head, K, V) per KV head the same
way (`models/hybrid.py`); its DeltaNet projections are not split (replicated). tests/test_partition_layout.py checks the shard contents from the loaded weights and the
collectives of a compiled decode step.

Note on KV heads the model axis does not divide (SmolLM2-135M: 3 KV heads, model=2 or 4):
`place_target` first appends whole zero KV groups to every attention layer (`pad_heads`), up to
the next multiple of the model axis (3 -> 4 KV heads, 9 -> 12 query heads), and the target then runs
with the padded config. A zero group's queries, keys and values are zero, so its attention output
is zero, and its o_proj columns are zero: every layer computes what the unpadded one computes (up to
the order of float sums). The price is the padding itself: the KV cache, the QKV projection and
attention grow by padded / real KV heads (4/3 for SmolLM2 on model=2 or 4; a warning says so
when it happens). Drafters keep the checkpoint's own config (`LoadedModel.logical_cfg`).

Note on per-row writes under "data": XLA keeps a scatter into batch-sharded state local only when
the batch is a batching dimension of the scatter (a `jax.vmap` of the one-row update), as
`KVCache.write` and the history append in `engine/generation.py` are written. A scatter that
names its rows by explicit index arrays (`x.at[rows, cols].set(...)`) makes every device
all-gather the updates and indices over "data" (four all-gathers per layer and decode step for
the KV cache). On one device both forms compile to the same program. `parallel/hlo.py` counts the
collectives of a compiled decode step.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from specjax.errors import UserError
from specjax.parallel.mesh import DATA, MODEL, axis_size

log = logging.getLogger(__name__)

# (module name, leaf name) -> the axis of the leaf split over "model"
TENSOR_PARALLEL = {
    ("qkv_proj", "kernel"): 0, ("qkv_proj", "bias"): 0,
    ("o_proj", "kernel"): 1,
    ("gate_up_proj", "kernel"): 0,
    ("down_proj", "kernel"): 1,
    ("embed_tokens", "embedding"): 0,
    ("lm_head", "kernel"): 0,
}


def path_names(path) -> tuple[str, ...]:
  """A jax key path as plain strings: ("layers", "0", "self_attn", "qkv_proj", "kernel"); the
  `.value` attribute of an NNX variable (nnx.State leaves) is left out."""
  names = tuple(str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in path)
  return names[:-1] if names and isinstance(path[-1], jax.tree_util.GetAttrKey) and names[-1] == "value" else names


def param_spec(names: tuple[str, ...], shape: tuple[int, ...], model: int) -> P:
  """The PartitionSpec of one parameter from its path (`TENSOR_PARALLEL`); replicated when the
  rule's axis does not divide by the model axis (or no rule names it, or model == 1)."""
  axis = TENSOR_PARALLEL.get(tuple(names[-2:])) if len(names) >= 2 else None
  if model == 1 or axis is None or axis >= len(shape) or shape[axis] % model:
    return P()
  return P(*([None] * axis + [MODEL]))


def check_target(cfg, mesh: Mesh | None, what: str = "the target") -> None:
  """A UserError unless `cfg`'s attention can be split over the model axis: each device holds whole
  KV groups (a KV head with its query heads), so the query heads must form whole groups. A model
  axis that does not divide the KV heads is no error: `place_target` pads them (`pad_heads`)."""
  m = axis_size(mesh, MODEL)
  if m == 1:
    return
  h, kvh = cfg.n_heads, cfg.n_kv_heads
  if kvh < 1 or h % kvh:
    raise UserError(f"mesh model={m} cannot split {what}'s attention: its {h} attention heads do not "
                    f"form whole groups over its {kvh} KV heads")


def divides_heads(cfg, mesh: Mesh | None) -> bool:
  m = axis_size(mesh, MODEL)
  return all(getattr(cfg, a, 1) % m == 0 for a in ("n_heads", "n_kv_heads"))


def with_kv_heads(cfg, n_kv_heads: int):
  """`cfg` with `n_kv_heads` KV heads, each with its group of n_heads / cfg.n_kv_heads query heads."""
  return cfg.replace(n_heads=n_kv_heads * (cfg.n_heads // cfg.n_kv_heads), n_kv_heads=n_kv_heads)


def padded_config(cfg, mesh: Mesh | None):
  """The config a target of `cfg` runs with on `mesh`: its KV heads rounded up to a multiple of the
  model axis (query heads with them, whole groups); `cfg` itself when the axis divides them."""
  m = axis_size(mesh, MODEL)
  kvh = -(-cfg.n_kv_heads // m) * m
  return cfg if kvh == cfg.n_kv_heads else with_kv_heads(cfg, kvh)


# (module, leaf) -> the axis that grows when KV groups are appended (`pad_heads`)
_PADDED = {("self_attn", "qkv_proj", "kernel"): 0, ("self_attn", "qkv_proj", "bias"): 0,
           ("self_attn", "o_proj", "kernel"): 1}


def pad_heads(params, cfg, n_kv_heads: int):
  """(params, cfg) of the same function with whole zero KV groups appended to every attention layer,
  up to `n_kv_heads` KV heads and n_kv_heads * G query heads (G = n_heads / n_kv_heads, the group
  size, unchanged). With W = (G+2)*D fused outputs per group ((2G+2)*D for a hybrid target's gated
  attention: query | gate per head, `hybrid.gated_qkv_layout`) and KVH' = n_kv_heads:

      .../self_attn/qkv_proj/kernel  [KVH*W, d_model] -> [KVH'*W, d_model]   zero rows appended
      .../self_attn/qkv_proj/bias    [KVH*W]          -> [KVH'*W]            zeros appended
      .../self_attn/o_proj/kernel    [d_model, H*D]   -> [d_model, H'*D]     zero columns appended

  Everything else (norms, including gemma3's / qwen3's q_norm and k_norm, shared by all heads over
  head_dim; o_proj's bias, [d_model]; the MLP; a hybrid target's DeltaNet) is kept as it is. The
  fused qkv outputs are grouped per KV head (`layers.qkv_layout`: for KV head g, its G query heads,
  K_g, V_g), so the appended rows are the groups KVH..KVH'-1 of the padded config, and their
  query heads are the heads H..H'-1 whose o_proj columns are appended. Such a group's queries, keys
  and values are zero: its attention scores are all equal, its softmax-weighted sum of zero values
  is zero (gated: zero times the sigmoid gate), and its o_proj columns add zero, so the padded model
  computes what `params` computes (up to the order of float sums), while its KV cache, QKV
  projection and attention grow by KVH'/KVH. Host arrays (numpy, or jax arrays on the CPU) are
  padded on the host, so `put` still cuts them there; device arrays are padded where they live."""
  from specjax.models.weights import fused_layout
  if n_kv_heads < cfg.n_kv_heads:
    raise ValueError(f"cannot pad {cfg.n_kv_heads} KV heads down to {n_kv_heads}")
  padded = with_kv_heads(cfg, n_kv_heads)
  sizes, groups = fused_layout(cfg)["qkv_proj"]
  per_group = {"qkv_proj": sum(sizes) // groups,                                   # W fused outputs
               "o_proj": cfg.head_dim * (cfg.n_heads // cfg.n_kv_heads)}           # G*D inputs
  grow = n_kv_heads - cfg.n_kv_heads

  def pad(path, x):
    names = path_names(path)
    axis = _PADDED.get(tuple(names[-3:]))
    if axis is None or grow == 0:
      return x
    per = per_group[names[-2]]
    if np.shape(x)[axis] != cfg.n_kv_heads * per:
      raise ValueError(f"{'/'.join(names)} has shape {np.shape(x)}, not {cfg.n_kv_heads} KV groups of {per}")
    shape = list(np.shape(x))
    shape[axis] = grow * per
    if isinstance(x, np.ndarray) or (isinstance(x, jax.Array) and _on_host(x)):
      host = np.asarray(x)
      return np.concatenate([host, np.zeros(shape, host.dtype)], axis=axis)
    return jnp.concatenate([x, jnp.zeros(shape, x.dtype)], axis=axis)
  return jax.tree_util.tree_map_with_path(pad, params), padded


def param_shardings(params, mesh: Mesh, replicate: bool = False):
  """The NamedSharding of every parameter leaf (same tree), by `param_spec`; all replicated with
  `replicate` (small drafter heads)."""
  m = 1 if replicate else axis_size(mesh, MODEL)
  return jax.tree_util.tree_map_with_path(
      lambda path, x: NamedSharding(mesh, param_spec(path_names(path), np.shape(x), m)), params)


def put(x, sharding: NamedSharding):
  """`x` on `sharding`, each device receiving only its own slice: a host array (numpy, or a jax
  array on the CPU) is cut on the host and every shard is copied to its device once (no device
  ever holds the whole tensor, so a target larger than one accelerator loads). Works with several
  processes: each passes the same host value and fills the shards of its own devices."""
  if isinstance(x, jax.Array) and x.sharding == sharding:
    return x
  if isinstance(x, jax.Array) and not _on_host(x):
    return jax.device_put(x, sharding)
  host = np.asarray(x)
  return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def _on_host(x: jax.Array) -> bool:
  return x.is_fully_addressable and all(d.platform == "cpu" for d in x.sharding.device_set) \
      and len(x.sharding.device_set) == 1


def place(tree, shardings):
  """Every leaf of `tree` put on the matching NamedSharding of `shardings` (`put`)."""
  return jax.tree_util.tree_map(put, tree, shardings)


def place_params(params, mesh: Mesh, cfg=None, *, what: str = "the target"):
  """Target (or draft-model) parameters sharded over `mesh`; with `cfg`, checked first: the model
  axis must divide its KV heads (`place_target` pads them first where it does not)."""
  if cfg is not None:
    check_target(cfg, mesh, what)
    if not divides_heads(cfg, mesh):
      raise ValueError(f"mesh model={axis_size(mesh, MODEL)} does not divide {what}'s {cfg.n_kv_heads} KV heads: "
                       "pad them first (`place_target`)")
  return place(params, param_shardings(params, mesh))


def place_target(params, cfg, mesh: Mesh, *, what: str = "the target"):
  """(params, cfg) of a target sharded over `mesh`. Where the model axis does not divide its KV heads,
  the target is first padded with zero KV groups to the next multiple of the model axis
  (`pad_heads`: same output), and the returned cfg is the padded one, which the target's forward and
  its KV cache must then use (drafters keep the checkpoint's own, `LoadedModel.logical_cfg`). The
  padding costs KV-cache memory, QKV-projection and attention work in proportion (padded / real KV
  heads); a warning says so."""
  check_target(cfg, mesh, what)
  padded = padded_config(cfg, mesh)
  if padded != cfg:
    ratio = padded.n_kv_heads / cfg.n_kv_heads
    log.warning(f"mesh model={axis_size(mesh, MODEL)} does not divide {what}'s {cfg.n_kv_heads} KV heads: padded "
                f"with zero KV groups to {padded.n_kv_heads} KV heads / {padded.n_heads} attention heads (same "
                f"output); its KV cache, QKV projection and attention grow {ratio:.2f}x")
    params, padded = pad_heads(params, cfg, padded.n_kv_heads)
  return place_params(params, mesh, padded, what=what), padded


def replicate(tree, mesh: Mesh):
  """Every leaf replicated on every device of `mesh`."""
  return place(tree, jax.tree_util.tree_map(lambda _: NamedSharding(mesh, P()), tree))


# ----------------------------------------------------------------------------------------------
# drafters


HEAD_PLACEMENTS = ("replicated", "sharded")


def head_config(drafter):
  """The config of a trained head's attention layers (EAGLE-3: its own layer's; MTP / DFlash: the
  target's, whose heads they keep)."""
  hc = getattr(drafter, "hc", None)
  return hc.layer if hc is not None else drafter.cfg


def place_drafter(drafter, target_params, mesh: Mesh | None, heads: str = "replicated"):
  """A device drafter whose arrays live on `mesh`: the target's parameters it reads (MTP, EAGLE-3,
  DFlash) are the target's own sharded arrays, and a draft model is sharded like a target when the
  model axis divides its heads (else replicated: a draft model is small, and is not padded as a
  target is by `place_target`), its KV cache split by heads with it. Trained heads (the other
  weights) are `heads`:
    "replicated": whole on every device; a draft step's head math runs on each device, with no
      collective (the target's sharded embedding and LM head, which MTP / DFlash read, still split);
    "sharded": split over "model" by the target's rules (`TENSOR_PARALLEL`: attention by KV groups,
      MLP, the head's own LM head by vocabulary) and its KV cache by heads with them, when the model
      axis divides the head's KV heads (else replicated); each device reads 1/model of the head's
      weights per draft step, for 2 all-reduces per head layer.
  Which is faster depends on the head's size against the step's collectives: experiments measure it
  (`sharded_round_cost.py --head-placement`). Host drafters, chains and drafters without weights are
  returned as they are."""
  if heads not in HEAD_PLACEMENTS:
    raise UserError(f"heads must be one of {HEAD_PLACEMENTS}, got {heads!r}")
  if mesh is None or not hasattr(drafter, "weights") or drafter.weights is None:
    return drafter
  weights = drafter.weights
  split = False
  if isinstance(weights, dict) and "target" in weights:
    split = heads == "sharded" and divides_heads(head_config(drafter), mesh) and axis_size(mesh, MODEL) > 1
    place_head = (lambda v: place_params(v, mesh)) if split else (lambda v: replicate(v, mesh))
    placed = {k: (target_params if k == "target" else place_head(v)) for k, v in weights.items()}
  elif divides_heads(drafter.cfg, mesh):          # a draft model: same paths as a target
    placed, split = place_params(weights, mesh), axis_size(mesh, MODEL) > 1
  else:
    placed = replicate(weights, mesh)
  if split and any(f.name == "kv_on_model" for f in dataclasses.fields(drafter)):
    return dataclasses.replace(drafter, weights=placed, kv_on_model=True)
  return dataclasses.replace(drafter, weights=placed)


# ----------------------------------------------------------------------------------------------
# per-sequence state


def batch_spec(x, batch: int, data: int) -> P:
  """P("data") on the leading axis of a per-sequence array [B, ...] (when data divides B)."""
  if data > 1 and np.ndim(x) >= 1 and np.shape(x)[0] == batch and batch % data == 0:
    return P(DATA)
  return P()


def kv_spec(x, batch: int, data: int, model: int) -> P:
  """A KV tensor [B, S, KVH, D]: batch on "data", KV heads on "model" (where they divide)."""
  d = DATA if data > 1 and batch % data == 0 else None
  h = MODEL if model > 1 and np.shape(x)[2] % model == 0 else None
  return P(d, None, h, None)


def state_specs(state, batch: int, data: int, model: int, kv_on_model: bool = True):
  """The PartitionSpec of every leaf of a loop state: `KVCache` k / v by `kv_spec` (KV heads on
  "model" only with `kv_on_model`: a target's cache; a replicated head's cache keeps them whole),
  every other per-sequence leaf by `batch_spec`, scalars and shared tables replicated."""
  from specjax.models.kv_cache import KVCache

  def spec(node):
    if isinstance(node, KVCache):
      kv = lambda a: kv_spec(a, batch, data, model if kv_on_model else 1)
      return dataclasses.replace(node, k=tuple(kv(a) for a in node.k), v=tuple(kv(a) for a in node.v),
                                 lengths=batch_spec(node.lengths, batch, data))
    return jax.tree_util.tree_map(lambda a: batch_spec(a, batch, data), node)
  return jax.tree_util.tree_map(spec, state, is_leaf=lambda n: isinstance(n, KVCache))


def constrain_state(state, batch: int | None = None, *, kv_on_model: bool = True):
  """`state` with `with_sharding_constraint` on every leaf (`state_specs`), under the mesh set by
  `jax.set_mesh` (`specjax.parallel.use`); without a mesh (the one-device program) it returns
  `state` itself and adds nothing to the program. Call it inside the jitted loops on the loop
  state (after prefill, at the top of a round's body): XLA keeps the batch split over "data" and
  the KV heads over "model" through the while loop instead of guessing from the parameters.

  batch: the batch size (default: the leading axis of the first leaf that has one)."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or DATA not in mesh.axis_names:
    return state
  leaves = [x for x in jax.tree_util.tree_leaves(state) if np.ndim(x) >= 1]
  if not leaves:
    return state
  batch = leaves[0].shape[0] if batch is None else batch
  specs = state_specs(state, batch, mesh.shape[DATA], mesh.shape[MODEL], kv_on_model)
  return jax.tree_util.tree_map(lambda x, s: jax.lax.with_sharding_constraint(x, s), state, specs)


def shard_batch(tree, mesh: Mesh | None):
  """Per-sequence host arrays (a batch of training data, sampling parameters) put on `mesh` with
  the leading axis on "data" (replicated where data does not divide it)."""
  if mesh is None:
    return tree
  data = axis_size(mesh, DATA)

  def one(x):
    b = np.shape(x)[0] if np.ndim(x) else 0
    return put(x, NamedSharding(mesh, batch_spec(x, b, data)))
  return jax.tree_util.tree_map(one, tree)


def padded_batch(batch: int, mesh: Mesh | None) -> int:
  """The batch rounded up to a multiple of the data axis (padding rows are dropped on output)."""
  data = axis_size(mesh, DATA)
  return -(-batch // data) * data


def shardings_of(tree) -> Any:
  """The sharding of every leaf (for tests and reports)."""
  return jax.tree_util.tree_map(lambda x: x.sharding, tree)
