"""The package's import graph: imports point down the stated order, never in a circle.

The order, top to bottom (README, "Layout"): the run (config, loop, its data,
checkpoints, faults and metrics) -> mesh and policy -> the message plan ->
model and step -> collectives -> codecs; the byte meter (wire, hlo) reads
compiled programs and stands apart, below everything that reports bytes.
A module may import modules of its own layer or below, never above.
"""
import ast
import os

import pytest

PKG = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "jcomp")
LAYERS = (
    ("trainer", "runspec", "resume", "stepcache", "steprecord", "hooks", "quiet", "checkpoint",
     "checksums", "data", "sources", "faults", "metrics", "cluster"),
    ("mesh", "policy", "schedule"),
    ("messages",),
    ("step", "optimizer", "parallel", "model", "autoencoder", "powersgd"),
    ("collectives",),
    ("codecs",),
    ("wire", "hlo"),
)
LAYER_OF = {unit: i for i, layer in enumerate(LAYERS) for unit in layer}


def _modules():
    """{dotted module name: file path} of every module in the package."""
    out = {}
    for root, _, files in os.walk(PKG):
        for f in files:
            if f.endswith(".py"):
                rel = os.path.relpath(os.path.join(root, f), os.path.dirname(PKG))[:-3]
                name = rel.replace(os.sep, ".").removesuffix(".__init__")
                out[name] = os.path.join(root, f)
    return out


def _imports(name, path, known):
    """The package modules `name` imports, anywhere in the file (lazy ones too)."""
    tree = ast.parse(open(path).read(), path)
    is_pkg = path.endswith("__init__.py")
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("jcomp"))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = name.split(".")[: len(name.split(".")) - node.level + is_pkg]
                base = ".".join(parts + ([base] if base else []))
            if not base.startswith("jcomp"):
                continue
            for a in node.names:
                sub = f"{base}.{a.name}"
                found.add(sub if sub in known else base)
    found.discard(name)
    return {m for m in found if m in known}


def _unit(module):
    """jcomp.codecs.blockwise -> "codecs"; jcomp.policy -> "policy"."""
    return module.split(".")[1] if "." in module else ""


@pytest.fixture(scope="module")
def graph():
    mods = _modules()
    return {name: _imports(name, path, mods) for name, path in mods.items()}


def test_every_module_has_a_place_in_the_order(graph):
    units = {_unit(m) for m in graph} - {""}
    assert units <= set(LAYER_OF), f"place these in LAYERS: {sorted(units - set(LAYER_OF))}"


def test_no_module_imports_a_module_above_it(graph):
    up = [(a, b) for a, deps in graph.items() for b in deps
          if _unit(a) and _unit(b) and LAYER_OF[_unit(b)] < LAYER_OF[_unit(a)]]
    assert not up, "imports pointing up: " + ", ".join(f"{a} -> {b}" for a, b in up)


def test_the_import_graph_has_no_circle(graph):
    # Between units (a package counts as one) and between modules alike.
    unit_graph = {}
    for a, deps in graph.items():
        unit_graph.setdefault(_unit(a), set()).update(_unit(b) for b in deps if _unit(b) != _unit(a))
    for g in (graph, unit_graph):
        state, path = {}, []

        def visit(n):
            state[n] = "open"
            path.append(n)
            for m in sorted(g.get(n, ())):
                if state.get(m) == "open":
                    raise AssertionError("circle: " + " -> ".join(path[path.index(m):] + [m]))
                if m not in state:
                    visit(m)
            path.pop()
            state[n] = "done"

        for n in sorted(g):
            if n not in state:
                visit(n)


def test_the_checker_sees_lazy_and_relative_imports(tmp_path):
    """The reader itself: an import inside a function counts."""
    f = tmp_path / "m.py"
    f.write_text("def f():\n    from jcomp import powersgd\n")
    assert _imports("jcomp.codecs", str(f), {"jcomp.powersgd", "jcomp.codecs"}) == {
        "jcomp.powersgd"}
