"""A pytree passed to jitted programs called once per round or call (the host loop, the server) as
one flat tuple of its leaves.

Every call of a jitted function flattens its arguments. The weights are an `nnx.State` (or a dict
of `nnx.Variable`s), whose nodes flatten through Python callbacks: ~2.5 us a leaf, ~0.9 ms a call
for SmolLM2 and an MTP head on a CPU host, paid on every such call while the device waits. A
`PackedTree` flattens in one callback to a tuple of arrays (which JAX's C++ flattening reads
directly) and a static part compared by identity, so the weights cost a few microseconds a call.
Inside the trace `unpack` gives the original pytree back.
"""

from __future__ import annotations

import functools
from typing import Any

import jax


class _Static:
  """The tree's structure, hashed and compared by identity: jit's cache key stays cheap."""
  __slots__ = ("treedef",)

  def __init__(self, treedef):
    self.treedef = treedef


# one `_Static` per distinct structure, so packing the same weights again (each request of the host
# loop) finds the programs compiled for the last packing
_static_of = functools.cache(_Static)


@jax.tree_util.register_pytree_node_class
class PackedTree:
  """`tree`'s leaves as one tuple; pack once, pass it wherever `tree` went, `unpack` inside jit."""
  __slots__ = ("leaves", "static")

  def __init__(self, leaves: tuple, static: _Static):
    self.leaves, self.static = tuple(leaves), static

  @classmethod
  def pack(cls, tree) -> "PackedTree":
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    return cls(leaves, _static_of(treedef))

  def tree_flatten(self):
    return (self.leaves,), self.static

  @classmethod
  def tree_unflatten(cls, static, children):
    return cls(children[0], static)

  def unpack(self):
    return jax.tree_util.tree_unflatten(self.static.treedef, self.leaves)


def unpack(x: Any):
  """The original pytree of a `PackedTree`; anything else as it is."""
  return x.unpack() if isinstance(x, PackedTree) else x
