"""Test setup: 8 emulated CPU devices, set before JAX starts its backend.

LLVM optimization level 0 cuts the compile time that dominates these small
programs by about a fifth. It acts after XLA's HLO passes, so the collectives
the byte meter reads from a compiled program are the same; only the machine
code is slower, and no test here times it.
"""
import os

_flags = os.environ.get("XLA_FLAGS", "")
if "xla_backend_optimization_level" not in _flags:
    _flags += " --xla_backend_optimization_level=0"
os.environ["XLA_FLAGS"] = (_flags + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_enable_x64", False)
