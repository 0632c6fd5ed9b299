"""Imports run one way: config -> build (hub, checkpoints_conv) -> models + proposers -> engine loop -> outputs.
Models, kernels and the parallel package never import the loaders, the hub or the engine; kernels know no
model; the engine loads nothing; and no module hides an import of the project inside a function (the one
exception: command-line entry points, which answer --help before loading JAX)."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PROJECT = ("specjax", "checkpoints_conv")
CLI_MODULES = {"checkpoints_conv.cli", "specjax.cli", "specjax.__main__", "specjax.training.__main__"}
FORBIDDEN = {
    "specjax.models": ("checkpoints_conv", "specjax.engine", "specjax.build", "specjax.hub", "specjax.llm"),
    "specjax.kernels": ("checkpoints_conv", "specjax.models", "specjax.engine", "specjax.build", "specjax.hub"),
    "specjax.parallel": ("checkpoints_conv", "specjax.models", "specjax.engine", "specjax.build", "specjax.hub"),
    "specjax.engine": ("checkpoints_conv", "specjax.hub", "specjax.build", "specjax.llm"),
    "specjax.config": ("checkpoints_conv", "specjax.models", "specjax.engine", "specjax.build", "specjax.hub"),
}


def modules() -> dict[str, Path]:
    found = {}
    for package in PROJECT:
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            found[name] = path
    return found


def imports(path: Path) -> list[tuple[str, bool]]:
    """(imported module, inside a function) for every import statement of the file."""
    tree = ast.parse(path.read_text())
    found = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            nested = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.Import):
                found.extend((alias.name, in_function) for alias in child.names)
            elif isinstance(child, ast.ImportFrom) and child.module and child.level == 0:
                found.append((child.module, in_function))
            visit(child, nested)

    visit(tree, False)
    return found


def test_the_scan_finds_the_layers():
    names = modules()
    assert {"specjax.models.llama", "specjax.kernels.attention", "specjax.engine.loop", "specjax.build",
            "checkpoints_conv.safetensors_loader"} <= set(names)


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_layers_import_only_downwards(layer):
    wrong = [(name, target) for name, path in modules().items() if name == layer or name.startswith(layer + ".")
             for target, _ in imports(path)
             if any(target == bad or target.startswith(bad + ".") for bad in FORBIDDEN[layer])]
    assert not wrong, f"{layer} imports upwards: {wrong}"


def test_no_project_import_is_hidden_inside_a_function():
    hidden = [(name, target) for name, path in modules().items() if name not in CLI_MODULES
              for target, in_function in imports(path)
              if in_function and target.split(".")[0] in PROJECT]
    assert not hidden, f"imports inside functions (a cycle worked around?): {hidden}"
