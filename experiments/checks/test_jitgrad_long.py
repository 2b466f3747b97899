"""The long form of tests/collectives/test_jitgrad.py: with codec="none",
cc.value_and_grad is the plain step for bfloat16 parameters too, and under
gradient accumulation it reduces once per step."""
import pytest

from tests.collectives import test_jitgrad as jitgrad
from tests.collectives.test_jitgrad import mesh, runs  # noqa: F401

pytestmark = pytest.mark.slow


def test_none_is_the_plain_step_in_bfloat16(mesh, monkeypatch):  # noqa: F811
    jitgrad.test_none_is_the_plain_step(mesh, monkeypatch, "bfloat16")


@pytest.mark.slow
def test_accumulation_reduces_once_per_step(runs):
    """lax.scan over 4 microbatches: the plain program all-reduces over "data" in
    every iteration; value_and_grad's reduction runs once per step, and with int8
    sends 0.26 of one plain reduction's bytes at most."""
    k = 4
    _, l_plain, r_plain = runs(None, k)
    _, l_ours, r_ours = runs("int8", k)
    _, _, r_none = runs("none", k, 1)
    over_data = lambda r: [c for c in r.collectives if c.axes == ("data",)]
    assert any(c.count == k for c in over_data(r_plain)), r_plain.table()
    assert over_data(r_ours) and all(c.count == 1 for c in over_data(r_ours)), r_ours.table()
    assert [c.kind for c in over_data(r_none)] == ["all-reduce"]
    one_plain_reduction = r_plain.by_axis()["data"] / k
    assert r_none.by_axis()["data"] <= one_plain_reduction * 1.01
    assert r_ours.by_axis()["data"] <= 0.26 * one_plain_reduction
    assert r_ours.by_axis()["model"] == r_plain.by_axis()["model"]
    assert abs(l_ours[-1] / l_plain[-1] - 1) < 0.01, (l_ours[-1], l_plain[-1])
