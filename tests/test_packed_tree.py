"""PackedTree: the weights passed to the host loop's and the server's programs as one flat tuple
are the same weights (round trip exact, same jitted result), and packing the same structure again
keeps jit's cache (no retrace per call or per packing)."""

import jax
import jax.numpy as jnp
import numpy as np

from specjax.models.config import ModelConfig
from specjax.models.decoder import init_params
from specjax.engine.packed_tree import PackedTree, unpack


def _params():
  cfg = ModelConfig(arch="llama", vocab_size=64, d_model=32, n_layers=2, n_heads=2, n_kv_heads=1, head_dim=16,
                    ffn_dim=64, rope_theta=10000.0, norm_eps=1e-6)
  return init_params(cfg, seed=0)


def test_round_trip_is_exact():
  params = _params()
  back = unpack(PackedTree.pack(params))
  assert jax.tree_util.tree_structure(back) == jax.tree_util.tree_structure(params)
  for a, b in zip(jax.tree_util.tree_leaves(params), jax.tree_util.tree_leaves(back)):
    assert a is b


def test_jitted_result_equal_and_traced_once():
  params = _params()
  traces = []

  @jax.jit
  def total(p, x):
    traces.append(1)
    return sum(jnp.sum(leaf.astype(jnp.float32)) for leaf in jax.tree_util.tree_leaves(unpack(p))) * x

  want = total(params, 2.0)
  got = [total(PackedTree.pack(params), 2.0) for _ in range(3)]     # packed anew each call, as per request
  assert all(np.array_equal(np.asarray(g), np.asarray(want)) for g in got)
  assert len(traces) == 2            # once for the plain tree, once for the packing, not per packing


def test_unpack_passes_other_values_through():
  tree = {"a": jnp.ones(2)}
  assert unpack(tree) is tree and unpack(None) is None
