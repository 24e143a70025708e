"""specjax: speculative decoding of language models in JAX/XLA."""

from specjax import _compat  # noqa: F401  (must run before flax is imported)

__version__ = "0.1.0"
