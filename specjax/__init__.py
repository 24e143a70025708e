"""specjax: speculative decoding of language models in JAX/XLA."""

from specjax import _compat  # noqa: F401  (must run before flax is imported)

__version__ = "0.1.0"


def __getattr__(name):
  """`specjax.register_speculator`, `specjax.SpeculatorSpec`, `specjax.Option` (imported on first use,
  so `import specjax` stays light)."""
  if name in ("register_speculator", "SpeculatorSpec", "Option"):
    from specjax.drafters import speculator_spec
    return getattr(speculator_spec, name)
  raise AttributeError(f"module 'specjax' has no attribute {name!r}")
