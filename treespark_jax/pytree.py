"""Frozen dataclasses that are JAX pytrees: every field a child, rebuilt without ``__init__``.

``flax.struct.dataclass`` rebuilds a pytree through ``__init__``, so every tree utility that
puts something other than arrays in the leaves (a tree of ``NamedSharding``, ``None`` prefixes,
JAX's own placeholders) runs the constructor on values it was never meant for. Here a rebuild
sets the fields directly, the way ``equinox.Module`` does, so ``__init__`` (and the annotation
check the test session wraps around it, ``typing.py``) runs only when code constructs an
instance: ``Cls(...)`` or ``x.replace(...)``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

import jax

__all__ = ["pytree_dataclass"]

C = TypeVar("C", bound=type)


def pytree_dataclass(cls: C) -> C:
    """``cls`` as a frozen dataclass registered as a pytree whose fields are all children.

    The class gains ``replace(**fields)`` (``dataclasses.replace``).
    """
    cls = dataclasses.dataclass(frozen=True)(cls)
    names = tuple(f.name for f in dataclasses.fields(cls))
    keys = tuple(jax.tree_util.GetAttrKey(n) for n in names)

    def flatten_with_keys(x: Any):
        return tuple(zip(keys, (getattr(x, n) for n in names))), None

    def flatten(x: Any):
        return tuple(getattr(x, n) for n in names), None

    def unflatten(_: None, children: Any):
        obj = object.__new__(cls)
        for n, v in zip(names, children):
            object.__setattr__(obj, n, v)
        return obj

    jax.tree_util.register_pytree_with_keys(cls, flatten_with_keys, unflatten, flatten)
    cls.replace = lambda self, **fields: dataclasses.replace(self, **fields)
    return cls
