"""The package's layering, checked: no import circles (imports inside functions count), every
module imports only from its own layer or below, and ARCHITECTURE.md names exactly the modules
the tree has."""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Dict, Set

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "dist_ckpt"

# Bottom-up, as ARCHITECTURE.md describes them; a module belongs to the first prefix it matches.
LAYERS = [
    ("1 base", ["dist_ckpt.core", "dist_ckpt._version", "dist_ckpt.runtime", "dist_ckpt.standalone"]),
    ("2 what a rank holds", ["dist_ckpt.mapping", "dist_ckpt.sharding", "dist_ckpt.dict_utils", "dist_ckpt.utils",
                             "dist_ckpt.optimizer", "dist_ckpt.exchange_utils"]),
    ("3 integrity and storage", ["dist_ckpt.integrity", "dist_ckpt.storage"]),
    ("4 strategies", ["dist_ckpt.strategies"]),
    ("5 orchestration", ["dist_ckpt.validation", "dist_ckpt.pipeline", "dist_ckpt.serialization",
                         "dist_ckpt.state_dict_utils", "dist_ckpt.tensor_aware_state_dict"]),
    ("6 training loop", ["dist_ckpt.manager", "dist_ckpt.local", "dist_ckpt.policies"]),
    ("7 tools", ["dist_ckpt.tools", "dist_ckpt.__main__", "dist_ckpt"]),
]


def _modules() -> Dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _layer(module: str) -> int:
    for index, (_, prefixes) in enumerate(LAYERS):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return index
    raise AssertionError(f"{module} is in no layer: add it to LAYERS and ARCHITECTURE.md")


def _imports(modules: Dict[str, Path]) -> Dict[str, Set[str]]:
    """Module -> the package's modules it imports, anywhere in its code."""
    graph: Dict[str, Set[str]] = {}
    for name, path in modules.items():
        is_pkg = path.name == "__init__.py"
        deps: Set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = name.split(".")
                    parts = parts[: len(parts) - node.level + (1 if is_pkg else 0)]
                    base = ".".join(parts + ([node.module] if node.module else []))
                targets = [base] + [f"{base}.{a.name}" for a in node.names]
            for target in targets:
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if target and target != name and not name.startswith(target + "."):
                    if not (is_pkg and target.startswith(name + ".")):  # a package re-exporting its children
                        deps.add(target)
        graph[name] = deps
    return graph


def test_every_module_imports_only_its_layer_or_below():
    modules = _modules()
    upward = [f"{m} (layer {LAYERS[_layer(m)][0]}) imports {d} (layer {LAYERS[_layer(d)][0]})"
              for m, deps in sorted(_imports(modules).items()) for d in sorted(deps) if _layer(d) > _layer(m)]
    assert not upward, "\n".join(upward)


def test_no_import_circles():
    graph = _imports(_modules())
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: list = []
    on_stack: Set[str] = set()
    circles = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    assert not circles, circles


def test_architecture_md_names_every_module_and_no_other():
    text = (ROOT / "ARCHITECTURE.md").read_text()
    named = set()
    for match in re.finditer(r"`(dist_ckpt/[\w/]+\.py|dist_ckpt/[\w/]+/)`", text):
        named.add(match.group(1))
    files = {str(p.relative_to(ROOT)) for p in PACKAGE.rglob("*.py") if p.name != "__init__.py" or p.parent == PACKAGE}
    packages = {str(p.parent.relative_to(ROOT)) + "/" for p in PACKAGE.rglob("__init__.py") if p.parent != PACKAGE}
    missing = sorted((files | packages) - named)
    stale = sorted(named - files - packages)
    assert not missing, f"ARCHITECTURE.md does not name: {missing}"
    assert not stale, f"ARCHITECTURE.md names what the tree does not have: {stale}"
