"""TreeSpark-JAX: lossless tree speculative decoding with a learned block drafter.

``load``, ``TreeSpark``, ``GenerationConfig`` and ``GenerationResult`` are imported lazily from ``treespark_jax.api``
so that importing a submodule (``treespark_jax.tree``) does not load the whole stack.
"""

__all__ = ["GenerationConfig", "GenerationResult", "TreeSpark", "load"]
__version__ = "0.1.0"


def __getattr__(name):
    if name in __all__:
        from treespark_jax import api

        return getattr(api, name)
    raise AttributeError(f"module 'treespark_jax' has no attribute {name!r}")
