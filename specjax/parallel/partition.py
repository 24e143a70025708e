"""Where every array lives on a (data, model) mesh: `PartitionSpec`s by pytree path, placement,
and the constraints the jitted loops apply to their state.

Tensor parallelism (Megatron's layout, by parameter path; [in, out] kernels as in `layers.Linear`):

    .../qkv_proj/kernel      [d_model, (H+2KVH)*D]   columns on "model"   (attention heads)
    .../qkv_proj/bias        [(H+2KVH)*D]            on "model"
    .../o_proj/kernel        [H*D, d_model]          rows on "model"      (partial sums: one all-reduce)
    .../gate_up_proj/kernel  [d_model, 2F]           columns on "model"   (MLP)
    .../down_proj/kernel     [F, d_model]            rows on "model"
    embed_tokens/embedding   [V, d_model]            vocabulary on "model"
    lm_head/kernel           [d_model, V]            vocabulary on "model"
    anything else (norms, gated-DeltaNet tensors, ...) replicated

Per-sequence state (`GenState`, drafter states, sampling parameters): the leading batch axis on
"data"; a target's KV cache [B, S, KVH, D] also has its KV heads on "model", like the heads that
write it. Nothing else is decided here: params and inputs are placed with these NamedShardings
and `jax.jit` propagates them through the engine's programs (XLA's SPMD partitioner), so a
sharded run computes what the one-device run computes, up to the order of float reductions.

Note on the fused projections: the output columns of `qkv_proj` are grouped per KV head (for KV
head g: its query heads, K_g, V_g) and those of `gate_up_proj` interleaved per MLP unit (gate_j,
up_j), one order whatever the mesh (`models/layers.py`, written so by the loaders). A contiguous
split over "model" then gives each device whole KV groups (`check_target` requires model to divide
the KV heads) and the gate and up columns of the same units, so a decoder layer costs Megatron's
2 all-reduces and nothing else. Split as whole parts ([Q | K | V], [gate | up]), one device would
hold all of Q and another K and V, and XLA would move the projected activations to where attention
and the gated product need them (collective-permutes after every fused projection). A hybrid
target's gated attention groups its `qkv_proj` (query | gate per head, K, V) per KV head the same
way (`models/hybrid.py`); its DeltaNet projections are not split (replicated). tests/test_partition_layout.py checks the shard contents from the loaded weights and the
collectives of a compiled decode step.

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
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from specjax.errors import UserError
from specjax.parallel.mesh import DATA, MODEL, axis_size

# (module name, leaf name) -> the axis of the leaf split over "model"
TENSOR_PARALLEL = {
    ("qkv_proj", "kernel"): 1, ("qkv_proj", "bias"): 0,
    ("o_proj", "kernel"): 0,
    ("gate_up_proj", "kernel"): 1,
    ("down_proj", "kernel"): 0,
    ("embed_tokens", "embedding"): 0,
    ("lm_head", "kernel"): 1,
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
  """A UserError unless the model axis divides the attention heads and KV heads of `cfg` (each
  device must hold whole heads of the KV cache and of the attention it feeds)."""
  m = axis_size(mesh, MODEL)
  if m == 1:
    return
  bad = [(n, getattr(cfg, a)) for n, a in (("attention heads", "n_heads"), ("KV heads", "n_kv_heads"))
         if getattr(cfg, a, None) and getattr(cfg, a) % m]
  if bad:
    ok = [d for d in range(1, max(cfg.n_kv_heads, 1) + 1) if cfg.n_heads % d == 0 and cfg.n_kv_heads % d == 0]
    have = ", ".join(f"{v} {n}" for n, v in bad)
    raise UserError(f"mesh model={m} does not divide {what}'s {have}; model can be one of "
                    f"{', '.join(map(str, ok))}")


def divides_heads(cfg, mesh: Mesh | None) -> bool:
  m = axis_size(mesh, MODEL)
  return all(getattr(cfg, a, 1) % m == 0 for a in ("n_heads", "n_kv_heads"))


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
  """Target (or draft-model) parameters sharded over `mesh` (heads checked against `cfg` first)."""
  if cfg is not None:
    check_target(cfg, mesh, what)
  return place(params, param_shardings(params, mesh))


def replicate(tree, mesh: Mesh):
  """Every leaf replicated on every device of `mesh`."""
  return place(tree, jax.tree_util.tree_map(lambda _: NamedSharding(mesh, P()), tree))


# ----------------------------------------------------------------------------------------------
# drafters


def place_drafter(drafter, target_params, mesh: Mesh | None):
  """A device drafter whose arrays live on `mesh`: the target's parameters it reads (MTP, EAGLE-3,
  DFlash) are the target's own sharded arrays, a draft model is sharded like a target when the
  model axis divides its heads (else replicated), trained heads are replicated (a few small
  matrices per draft step: splitting them would add a collective per step for little memory).
  Host drafters, chains and drafters without weights are returned as they are."""
  if mesh is None or not hasattr(drafter, "weights") or drafter.weights is None:
    return drafter
  weights = drafter.weights
  if isinstance(weights, dict) and "target" in weights:
    placed = {k: (target_params if k == "target" else replicate(v, mesh)) for k, v in weights.items()}
  elif divides_heads(drafter.cfg, mesh):          # a draft model: same paths as a target
    placed = place_params(weights, mesh)
  else:
    placed = replicate(weights, mesh)
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
