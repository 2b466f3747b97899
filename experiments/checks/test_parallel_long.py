"""The long form of tests/gpt/test_parallel.py: the baseline GPT on the other mesh
shapes matches the single-device loss and gradients (about 1 minute on two cores)."""
import pytest

from tests.gpt import test_parallel as parallel
from tests.gpt.test_parallel import reference  # noqa: F401

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("shape", parallel.SHAPES_LONG)
def test_baseline_matches_single_device_loss_and_gradients(reference, shape):  # noqa: F811
    parallel.test_baseline_matches_single_device_loss_and_gradients(reference, shape)
