"""Test setup: 8 emulated CPU devices, set before JAX starts its backend.

LLVM optimization level 0 cuts the compile time that dominates these small
programs by about a fifth. It acts after XLA's HLO passes, so the collectives
the byte meter reads from a compiled program are the same; only the machine
code is slower, and no test here times it.

A persistent compilation cache, fresh for each session, is shared by the
suite and every train.py and benchmark it starts: dozens of subprocesses
compile the same tiny programs, and a cached one loads in a fraction of the
time (a tiny train.py run: 16.5 s -> 7.1 s). Executables come back with their
HLO text, so byte checks read the same program; the test below checks that a
cached step meters and trains exactly as a fresh one.
"""
import atexit
import os
import shutil
import tempfile

from jcomp.collectives import cpu  # before JAX's backend starts: it only imports jax

_flags = os.environ.get("XLA_FLAGS", "")
if "xla_backend_optimization_level" not in _flags:
    _flags += " --xla_backend_optimization_level=0"
os.environ["XLA_FLAGS"] = (_flags + " --xla_force_host_platform_device_count=8").strip()
# The CPU scheduler that keeps collectives out of concurrently running loops:
# without it two-hop steps sometimes stop (jcomp/collectives/cpu.py).
cpu.add_flag()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _cache = tempfile.mkdtemp(prefix="jcomp-test-jax-cache-")
    atexit.register(shutil.rmtree, _cache, ignore_errors=True)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"

import jax  # noqa: E402

jax.config.update("jax_enable_x64", False)
