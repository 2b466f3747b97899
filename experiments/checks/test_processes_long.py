"""The long form of tests/train/test_processes.py: 4 processes x 2 devices on the
(2, 2, 2) mesh, each data rank spanning two processes, train as one process
does, bit for bit (about 2 minutes on two cores)."""
import pytest

from tests.train.test_processes import STEPS, train_side_by_side

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return train_side_by_side(tmp_path_factory.mktemp("processes"),
                              {"one": (1, []), "four": (4, [])})


def test_four_processes_sharing_data_ranks_match_one_process_bitwise(runs):
    """4 processes x 2 devices, (2, 2, 2): the 1 x 8 run's losses and validation
    loss, bit for bit. The same program runs on the same rows; across processes
    gloo carries the collectives, which here sum in the same order."""
    one, four = runs["one"], runs["four"]
    assert sorted(one) == sorted(four) == list(range(1, STEPS + 1))
    assert [four[s]["loss"] for s in one] == [one[s]["loss"] for s in one]
    assert "val_loss" in one[STEPS] and four[STEPS]["val_loss"] == one[STEPS]["val_loss"]
