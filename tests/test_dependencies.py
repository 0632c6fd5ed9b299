"""The demo's install (`pip install -e .`, no extras) brings what the package needs at run time, including what
its dependencies import only when used. The suite's own environment cannot show a missing one: the test extras
bring some of them (torch requires jinja2), so this reads the declared requirements instead."""
from __future__ import annotations

import importlib.metadata as metadata

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

# Imported lazily by a dependency on a path the package takes, and required by none of them.
LAZY = {"jinja2": "transformers' chat templates (LLM.chat, the demo)"}


def runtime_closure(distribution: str) -> set[str]:
    """The distributions `pip install distribution` installs: its requirements without extras, transitively."""
    found, pending = set(), [distribution]
    while pending:
        name = canonicalize_name(pending.pop())
        if name in found:
            continue
        found.add(name)
        for line in metadata.requires(name) or []:
            requirement = Requirement(line)
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                pending.append(requirement.name)
    return found


def test_what_dependencies_import_lazily_is_declared():
    closure = runtime_closure("specjax")
    assert {"jax", "flax", "transformers"} <= closure
    for distribution, reason in LAZY.items():
        assert distribution in closure, f"{distribution} ({reason}) is not installed by `pip install -e .`"
