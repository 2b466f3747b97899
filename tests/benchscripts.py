"""A script of benchmarks/ loaded as a module, for the tests that check it."""
import importlib.util
import pathlib
import sys

BENCHMARKS = pathlib.Path(__file__).resolve().parents[1] / "benchmarks"


def load(name: str):
    """benchmarks/<name>.py as the module bench_<name>, registered in sys.modules
    (dataclasses look their module up there)."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module
