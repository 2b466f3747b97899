"""The long checks run with the suite's setup: 8 emulated CPU devices, LLVM
optimization level 0 and a compilation cache shared with the train.py runs
they start (tests/conftest.py)."""
import tests.conftest  # noqa: F401  (sets the environment before JAX's backend starts)
