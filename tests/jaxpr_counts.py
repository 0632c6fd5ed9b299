"""Primitives of a traced function, counted through its nested jaxprs (loop bodies, branches): what tests on
the structure of a program (which work a loop or a branch holds) read."""
from __future__ import annotations

import collections

import jax


def primitive_counts(fn, *args, branches: list | None = None) -> collections.Counter:
    """How often each primitive occurs in fn(*args)'s jaxpr, nested ones included. With `branches`, each cond's
    branches' own counts (a list of Counters, one per branch) are appended to it."""
    return _walk(jax.make_jaxpr(fn)(*args).jaxpr, branches)


def _walk(jaxpr, branches: list | None) -> collections.Counter:
    counts = collections.Counter()
    for eqn in jaxpr.eqns:
        counts[eqn.primitive.name] += 1
        inner = [_walk(sub, branches) for sub in _subjaxprs(list(eqn.params.values()))]
        if eqn.primitive.name == "cond" and branches is not None:
            branches.append(inner)
        for sub in inner:
            counts += sub
    return counts


def _subjaxprs(value) -> list:
    if isinstance(value, (list, tuple)):
        return [j for v in value for j in _subjaxprs(v)]
    inner = getattr(value, "jaxpr", value)
    return [inner] if hasattr(inner, "eqns") else []
