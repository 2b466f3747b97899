"""The long form of tests/collectives/test_jitgrad.py: with codec="none",
cc.value_and_grad is the plain step for bfloat16 parameters too."""
import pytest

from tests.collectives import test_jitgrad as jitgrad
from tests.collectives.test_jitgrad import mesh  # noqa: F401

pytestmark = pytest.mark.slow


def test_none_is_the_plain_step_in_bfloat16(mesh, monkeypatch):  # noqa: F811
    jitgrad.test_none_is_the_plain_step(mesh, monkeypatch, "bfloat16")
