"""The package's layers: every import (also inside functions) goes down or sideways, never up, and
no modules import each other in a circle; compiled code sits with the layer that uses it and
includes only its own layer's headers and those below; no file grows past a reader's page count.

Layers, lowest first:
  core  ->  ngram, format  ->  runtime  ->  converters  ->  offline  ->  tools  ->  cli
with integrations/ beside the top, importing only the runtime's public API, the hash and core.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "ple_prep"

LAYERS = {
    "ple_prep": 0, "ple_prep.core": 0,
    "ple_prep.ngram": 1, "ple_prep.format": 1,
    "ple_prep.runtime": 2,
    "ple_prep.converters": 3,
    "ple_prep.offline": 4,
    "ple_prep.tools": 5,
    "ple_prep.cli": 6, "ple_prep.__main__": 6,
    "ple_prep.integrations": 7,
}
# What an integration with a serving stack may import: the reader, the hash and the basics.
INTEGRATION_MAY_IMPORT = ("ple_prep.runtime", "ple_prep.ngram", "ple_prep.core")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def layer_of(module: str) -> int:
    """The layer of the longest LAYERS prefix of `module`."""
    parts = module.split(".")
    for length in range(len(parts), 0, -1):
        prefix = ".".join(parts[:length])
        if prefix in LAYERS:
            return LAYERS[prefix]
    raise AssertionError(f"{module} is in no layer; add it to LAYERS")


# The compiled modules (setup.py): `<layer>._native`, built from `<layer>/native/*.c`.
COMPILED_MODULES = {module_name(path.parent.parent / "_native") for path in PACKAGE.rglob("native/module.c")}


def package_imports() -> dict[str, set[str]]:
    """{module: ple_prep modules it imports anywhere in its body}, relative imports resolved."""
    modules = {module_name(path): path for path in PACKAGE.rglob("*.py")}
    known = set(modules) | COMPILED_MODULES
    imports: dict[str, set[str]] = {}
    for module, path in modules.items():
        is_package = path.name == "__init__.py"
        found = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = module.split(".")[:len(module.split(".")) - node.level + is_package]
                    anchor = ".".join(base + ([node.module] if node.module else []))
                else:
                    anchor = node.module or ""
                # `from . import x` may name a module or a name; count the module when there is one.
                names = [f"{anchor}.{alias.name}" if f"{anchor}.{alias.name}" in known else anchor
                         for alias in node.names]
            else:
                continue
            found.update(name for name in names if name == "ple_prep" or name.startswith("ple_prep."))
        found.discard(module)
        imports[module] = found
    return imports


IMPORTS = package_imports()
EDGES = {(module, target) for module, targets in IMPORTS.items() for target in targets}


def test_the_walk_sees_lazy_imports():
    # The CLI imports its commands' libraries inside the functions: the walk must see them.
    assert ("ple_prep.cli", "ple_prep.offline.writer") in EDGES
    assert ("ple_prep.offline.writer", "ple_prep.format.header") in EDGES
    # And the compiled modules, each used by its own layer.
    assert COMPILED_MODULES == {"ple_prep.core._native", "ple_prep.runtime._native"}
    assert ("ple_prep.format.order", "ple_prep.core._native") in EDGES
    assert ("ple_prep.runtime.gather", "ple_prep.runtime._native") in EDGES


def test_no_import_goes_up_a_layer():
    upward = sorted(f"{module} (layer {layer_of(module)}) imports {target} (layer {layer_of(target)})"
                    for module, target in EDGES
                    if layer_of(target) > layer_of(module))
    assert not upward, "\n".join(upward)


def test_integrations_use_only_the_public_runtime():
    wrong = sorted(f"{module} imports {target}" for module, target in EDGES
                   if module.startswith("ple_prep.integrations")
                   and not target.startswith("ple_prep.integrations")
                   and not any(target == allowed or (allowed == "ple_prep.core" and target.startswith(allowed + "."))
                               for allowed in INTEGRATION_MAY_IMPORT))
    assert not wrong, "\n".join(wrong)


def test_no_circular_imports():
    graph = {module: {t for t in targets if t in IMPORTS}
             for module, targets in IMPORTS.items()}
    state: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[str] = []

    def visit(module: str) -> None:
        state[module] = 1
        stack.append(module)
        for target in sorted(graph[module]):
            if state.get(target) == 1:
                cycles.append(" -> ".join(stack[stack.index(target):] + [target]))
            elif target not in state:
                visit(target)
        stack.pop()
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module)
    # A package importing its own submodules (`__init__` re-exports) is not a circle unless a
    # submodule imports the package back.
    assert not cycles, "\n".join(cycles)



C_SOURCES = sorted(PACKAGE.rglob("*.[ch]"))
C_FILE_MAX_LINES = 500
RUNTIME_MODULE_MAX_LINES = 400


def test_compiled_code_includes_only_its_layer_and_below():
    wrong = []
    for path in C_SOURCES:
        layer = layer_of(module_name(path.parent / "x"))
        for included in re.findall(r'^#include "([^"]+)"', path.read_text(), flags=re.M):
            target = (path.parent / included).resolve()
            if not target.exists():
                wrong.append(f"{path.relative_to(PACKAGE)} includes {included}, which does not exist")
            elif layer_of(module_name(target.parent / "x")) > layer:
                wrong.append(f"{path.relative_to(PACKAGE)} (layer {layer}) includes {included}")
    assert C_SOURCES and not wrong, "\n".join(wrong)


def test_no_c_file_over_500_lines_and_no_runtime_module_over_400():
    long = [f"{path.relative_to(PACKAGE)}: {count} lines" for path in C_SOURCES
            if (count := len(path.read_text().splitlines())) > C_FILE_MAX_LINES]
    long += [f"{path.relative_to(PACKAGE)}: {count} lines" for path in (PACKAGE / "runtime").rglob("*.py")
             if (count := len(path.read_text().splitlines())) > RUNTIME_MODULE_MAX_LINES]
    assert not long, "\n".join(long)
