"""Several devices and hosts: a (data, model) mesh, shardings by parameter path, placement, and
`jax.distributed` from the environment. See mesh.py, partition.py and distributed.py.

With no mesh every function here is the identity and the one-device program is unchanged.
"""

from __future__ import annotations

import contextlib

import jax

from specjax.parallel.distributed import initialize_from_env
from specjax.parallel.mesh import DATA, MODEL, as_mesh, axis_size, describe, make_mesh, parse_mesh
from specjax.parallel.partition import (check_target, constrain_state, pad_heads, padded_batch, padded_config,
                                        HEAD_PLACEMENTS, place_drafter, place_params, place_target, replicate, shard_batch)


def use(mesh):
  """A context in which jitted programs trace under `mesh` (`jax.set_mesh`), so
  `constrain_state` inside them applies its constraints; a null context for None."""
  return contextlib.nullcontext() if mesh is None else jax.set_mesh(mesh)


__all__ = ["DATA", "MODEL", "as_mesh", "axis_size", "check_target", "constrain_state", "describe",
           "initialize_from_env", "make_mesh", "pad_heads", "padded_batch", "padded_config", "parse_mesh",
           "HEAD_PLACEMENTS", "place_drafter", "place_params", "place_target", "replicate", "shard_batch", "use"]
