"""The long form of tests/gpt/test_step.py: bucketing keeps the hybrid step's
messages near the baseline's (three whole train steps compiled)."""
import pytest

from tests.gpt.test_step import _compiled_report


@pytest.mark.slow
def test_hybrid_step_sends_about_as_many_messages_as_the_baseline():
    """Bucketed gradients and parameters, and one buffer per payload: the hybrid step
    compiles to the baseline's collectives plus at most one per coded reduction (an
    all_to_all and an all_gather stand in for one all-reduce), however many leaves
    the model has; and bucketing sends no more data bytes than a message per leaf."""
    base, hybrid = _compiled_report("baseline"), _compiled_report("hybrid")
    per_leaf = _compiled_report("hybrid", bucket_bytes=1)
    coded_reductions = sum(c.kind == "all-to-all" for c in hybrid.collectives)
    assert len(hybrid.collectives) <= len(base.collectives) + coded_reductions, (
        hybrid.table(), base.table())
    assert len(per_leaf.collectives) > len(hybrid.collectives) + 20
    assert hybrid.by_axis()["data"] <= per_leaf.by_axis()["data"]
