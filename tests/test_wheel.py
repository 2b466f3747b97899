"""What `pip install .` (or `pip install git+...`) gives a user: a wheel.

An editable install serves every module from the clone, so a package left out
of the wheel goes unnoticed there. This test builds the wheel from the tree's
files, installs it with `[train]` into a fresh virtual environment outside the
clone, imports every module of the installed package from there and runs the
planning door with the shipped profile. The wheel is built as pip builds it for
a user (in an isolated build environment, which fetches setuptools); the new
environment then borrows this one's installed dependencies through a .pth file
and installs with --no-index, so jcomp itself comes only from the wheel.
"""
import glob
import os
import shutil
import subprocess
import sys
import sysconfig
import venv

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def _tree_files():
    """The files git would ship: tracked and untracked, less what .gitignore drops."""
    out = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT,
                         capture_output=True, text=True)
    if out.returncode != 0:
        pytest.skip(f"not a git checkout, cannot list the tree's files: {out.stderr.strip()}")
    return [f for f in out.stdout.splitlines() if os.path.isfile(os.path.join(ROOT, f))]


def _copy_tree(dst):
    for rel in _tree_files():
        os.makedirs(os.path.dirname(os.path.join(dst, rel)), exist_ok=True)
        shutil.copy2(os.path.join(ROOT, rel), os.path.join(dst, rel))


def _run(cmd, cwd, env=None, timeout=600):
    out = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, f"{' '.join(cmd)} exited {out.returncode}:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out


def _clean_env():
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "PYTHONSAFEPATH")}
    env["JAX_PLATFORMS"] = "cpu"
    return env


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """(python of a fresh venv holding the installed wheel, a folder outside the clone)."""
    src = tmp_path_factory.mktemp("src")
    _copy_tree(str(src))
    dist = tmp_path_factory.mktemp("dist")
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q",
          "-w", str(dist), str(src)], cwd=str(src), env=_clean_env())
    (wheel,) = glob.glob(os.path.join(str(dist), "jcomp-*.whl"))

    home = tmp_path_factory.mktemp("venv")
    venv.create(str(home), with_pip=True, clear=True)
    py = os.path.join(str(home), "bin", "python")
    new_site = _run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                    cwd=str(home)).stdout.strip()
    # This environment's site-packages serve the dependencies. A .pth line adds
    # the folder to sys.path without running the .pth files inside it, so the
    # editable install's finder (which maps `jcomp` to the clone) stays out.
    ours = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    with open(os.path.join(new_site, "_borrowed_deps.pth"), "w") as f:
        f.write("\n".join(sorted(ours)) + "\n")
    _run([py, "-m", "pip", "install", "-q", "--no-index", f"jcomp[train] @ file://{wheel}"],
         cwd=str(home), env=_clean_env())
    return py, str(home), new_site


def test_the_wheel_holds_every_module_of_the_package(installed):
    py, outside, new_site = installed
    script = (
        "import importlib, os, pkgutil, jcomp\n"
        "names = [m.name for m in pkgutil.walk_packages(jcomp.__path__, 'jcomp.')]\n"
        "for n in names: importlib.import_module(n)\n"
        "print(os.path.dirname(jcomp.__file__)); print(' '.join(sorted(names)))\n")
    out = _run([py, "-c", script], cwd=outside, env=_clean_env()).stdout.splitlines()
    where, names = out[-2], set(out[-1].split())
    assert where == os.path.join(new_site, "jcomp"), f"jcomp imported from {where}, not the wheel"
    in_tree = set()
    for dirpath, _, files in os.walk(os.path.join(ROOT, "jcomp")):
        for f in files:
            if f.endswith(".py"):
                rel = os.path.relpath(os.path.join(dirpath, f), ROOT)[:-3]
                name = rel.replace(os.sep, ".").removesuffix(".__init__")
                if name != "jcomp":
                    in_tree.add(name)
    missing = in_tree - names
    assert not missing, f"modules in the tree but not in the wheel: {sorted(missing)}"


def test_the_planning_door_runs_from_the_wheel(installed):
    py, outside, _ = installed
    out = _run([py, "-m", "jcomp.train.plan",
                f"--profile={ROOT}/configs/profiles/h100_8x_nvlink_400g.json",
                f"--config={ROOT}/configs/neox20b.py"], cwd=outside, env=_clean_env())
    assert "data.grad" in out.stdout and "predicted" in out.stdout, out.stdout[-2000:]
