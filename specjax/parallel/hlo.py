"""What a sharded program communicates: the collectives in its compiled HLO.

`decode_step_collectives` compiles one plain decode step of a target config on a mesh from
abstract values (shapes, dtypes and shardings: no weights are allocated, so an 8B-shaped target
costs only its compilation) and counts the collectives XLA put in it, per decoder layer and
outside the layers. Benchmarks print it beside their timings; tests assert on it.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding

COLLECTIVES = ("all-gather", "all-reduce", "collective-permute", "reduce-scatter", "all-to-all")
# an op, not an instruction's name (`%all-gather.3 = ... all-gather(...)`); the start of an async
# pair counts, its `-done` does not
_OP = re.compile(r"[\s}](" + "|".join(COLLECTIVES) + r")(?:-start)?\(")


def collective_counts(hlo_text: str) -> dict[str, int]:
  """The number of each collective op in a compiled program's HLO text."""
  counts = dict.fromkeys(COLLECTIVES, 0)
  for m in _OP.finditer(hlo_text):
    counts[m.group(1)] += 1
  return counts


def decode_step_hlo(cfg, mesh: Mesh, batch: int, capacity: int = 128, dtype=jnp.bfloat16) -> str:
  """The compiled HLO text of one plain decode step (`engine.decode.decode_step`) of a target of
  `cfg` with its parameters sharded over `mesh` as `api.shard` shards them (`place_target`: KV heads
  the model axis does not divide padded with zero groups, `padded_config`) and the loop state as the
  decode loop constrains it (`state_specs`), at `batch` sequences and `capacity` cache slots."""
  from flax import nnx

  from specjax.engine.decode import decode_step
  from specjax.engine.generation import GenState
  from specjax.engine.sampling import SamplingParams
  from specjax.models.decoder import Transformer
  from specjax.models.kv_cache import KVCache
  from specjax.parallel.mesh import DATA, MODEL, axis_size
  from specjax.parallel.partition import constrain_state, padded_config, param_shardings, state_specs

  cfg = padded_config(cfg, mesh)
  params = nnx.split(nnx.eval_shape(lambda: Transformer(cfg, dtype=dtype, rngs=nnx.Rngs(0))))[1]
  state = jax.eval_shape(lambda: GenState(
      cache=KVCache.init(cfg, batch, capacity, dtype), history=jnp.zeros((batch, capacity), jnp.int32),
      hist_len=jnp.zeros((batch,), jnp.int32), prompt_len=jnp.zeros((batch,), jnp.int32),
      last=jnp.zeros((batch,), jnp.int32), keys=jnp.zeros((batch, 2), jnp.uint32), done=jnp.zeros((batch,), bool)))
  sampling = jax.eval_shape(lambda: SamplingParams.make(batch))
  per_seq = (sampling, jax.ShapeDtypeStruct((batch,), jnp.int32))               # sampling, max_new
  abstract = lambda tree, shardings: jax.tree_util.tree_map(
      lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)
  named = lambda specs: jax.tree_util.tree_map(lambda s: NamedSharding(mesh, s), specs)
  data, model = axis_size(mesh, DATA), axis_size(mesh, MODEL)
  args = (abstract(params, param_shardings(params, mesh)),
          abstract(state, named(state_specs(state, batch, data, model))),
          abstract(per_seq, named(state_specs(per_seq, batch, data, model))),
          jax.ShapeDtypeStruct((1,), jnp.int32, sharding=NamedSharding(mesh, jax.sharding.PartitionSpec())))
  step = jax.jit(lambda p, s, ps, stop: constrain_state(decode_step(p, cfg, constrain_state(s), ps[0], stop, ps[1])))
  with jax.set_mesh(mesh):               # the constraints of the decode loop's body apply
    return step.lower(*args).compile().as_text()


def decode_step_collectives(cfg, mesh: Mesh, batch: int, capacity: int = 128, dtype=jnp.bfloat16) -> dict:
  """Collectives of one plain decode step on `mesh`: {"per_layer": counts, "outside_layers":
  counts}, from the programs of the target cut to 1 and 2 layers (the layers are unrolled in the
  program, so one more layer adds its own collectives)."""
  one, two = (collective_counts(decode_step_hlo(cfg.replace(n_layers=n), mesh, batch, capacity, dtype))
              for n in (1, 2))
  per_layer = {k: two[k] - one[k] for k in COLLECTIVES}
  return {"per_layer": per_layer, "outside_layers": {k: one[k] - per_layer[k] for k in COLLECTIVES}}
