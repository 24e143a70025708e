"""A device mesh with the two named axes every sharding in specjax refers to.

    data   the batch: sequences (and their KV caches, histories, sampler keys) are split over it
    model  tensor parallelism: attention heads, MLP columns / rows and the vocabulary are split over it

A user names the mesh as "data=2,model=4" (`--mesh` on the command line, `mesh:` in an experiment
config, `api.load(..., mesh=...)`); an axis left out has size 1. `model` is the inner (fastest
varying) axis, so the devices of one tensor-parallel group are neighbours (one host's NVLink
island); `data` is the outer one, the axis that crosses hosts first.

No mesh at all (None) is the one-device program of old, unchanged.
"""

from __future__ import annotations

from typing import Mapping

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from specjax.errors import UserError

DATA, MODEL = "data", "model"
AXES = (DATA, MODEL)


def parse_mesh(spec: str | Mapping[str, int]) -> dict[str, int]:
  """"data=2,model=4" (or {"data": 2, "model": 4}) -> {"data": 2, "model": 4}; a missing axis is 1.
  Unknown axis names, repeated names and sizes < 1 are a UserError naming the part."""
  if isinstance(spec, Mapping):
    items = [(str(k), v) for k, v in spec.items()]
  elif isinstance(spec, str):
    items = []
    for part in (p.strip() for p in spec.split(",")):
      if not part:
        continue
      name, eq, size = part.partition("=")
      if not eq:
        raise UserError(f"mesh: {part!r} is not AXIS=SIZE (e.g. --mesh data=2,model=4)")
      items.append((name.strip(), size.strip()))
  else:
    raise UserError(f"mesh must be a string like 'data=2,model=4' or a mapping, got {type(spec).__name__}")
  sizes = {DATA: 1, MODEL: 1}
  seen = set()
  for name, size in items:
    if name not in AXES:
      raise UserError(f"mesh: unknown axis {name!r} (axes: {', '.join(AXES)})")
    if name in seen:
      raise UserError(f"mesh: axis {name!r} given twice")
    seen.add(name)
    if isinstance(size, bool) or not (isinstance(size, int) or (isinstance(size, str) and size.isdigit())) \
        or int(size) < 1:
      raise UserError(f"mesh: size of {name!r} must be a positive integer, got {size!r}")
    n = int(size)
    sizes[name] = n
  return sizes


def make_mesh(spec: str | Mapping[str, int], devices=None) -> Mesh:
  """A `Mesh` of shape (data, model) over the first data*model of `devices` (default: every
  device of every process, `jax.devices()`). Axes are Auto: shardings given to inputs propagate
  through jitted programs (XLA's SPMD partitioner), constraints pin what it would get wrong."""
  sizes = parse_mesh(spec)
  if devices is None:
    from specjax.parallel.distributed import initialize_from_env
    initialize_from_env()             # several hosts: join them before listing their devices
  devices = list(jax.devices() if devices is None else devices)
  n = sizes[DATA] * sizes[MODEL]
  if n > len(devices):
    raise UserError(f"mesh data={sizes[DATA]},model={sizes[MODEL]} needs {n} devices, "
                    f"{len(devices)} are visible ({devices[0].platform})")
  grid = np.asarray(devices[:n], dtype=object).reshape(sizes[DATA], sizes[MODEL])   # [data, model]
  return Mesh(grid, AXES, axis_types=(AxisType.Auto, AxisType.Auto))


def as_mesh(mesh) -> Mesh | None:
  """None, a spec string / mapping, or a `Mesh` (its axes must be ("data", "model")) -> Mesh or None."""
  if mesh is None or isinstance(mesh, Mesh):
    if isinstance(mesh, Mesh) and tuple(mesh.axis_names) != AXES:
      raise UserError(f"a mesh's axes must be {AXES}, got {tuple(mesh.axis_names)}")
    return mesh
  return make_mesh(mesh)


def axis_size(mesh: Mesh | None, axis: str) -> int:
  """Size of `axis` in `mesh` (1 without a mesh)."""
  return 1 if mesh is None else int(mesh.shape[axis])


def describe(mesh: Mesh | None) -> str:
  """"data=2,model=4" (the spec that rebuilds it), or "none"."""
  if mesh is None:
    return "none"
  return ",".join(f"{a}={mesh.shape[a]}" for a in AXES)
