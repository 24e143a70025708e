"""Version shims, applied before flax is imported (specjax/__init__.py imports this first).

flax 0.12.8 (the newest release) subclasses `jax.experimental.hijax.HiPrimitive` and
`MutableHiType` at import time; jax 0.11 renamed that API (`HiPrim`, `HiType`), so `import flax.nnx`
fails on jax 0.11.x. Those classes only back flax's opt-in "hijax variables", which specjax never
enables, so stand-ins that let the module import are enough. Remove once flax supports jax 0.11.
"""

from __future__ import annotations


def patch_hijax_for_flax() -> None:
  try:
    from jax.experimental import hijax as hjx
  except ImportError:
    return
  if not hasattr(hjx, "HiPrimitive"):
    from jax.extend.core import Primitive
    hjx.HiPrimitive = Primitive
  if not hasattr(hjx, "MutableHiType"):
    hjx.MutableHiType = getattr(hjx, "HiType", object)
  for name in ("AvalQDD", "AvalMutableQDD"):
    if not hasattr(hjx, name):
      setattr(hjx, name, object)


patch_hijax_for_flax()
