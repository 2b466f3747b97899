"""experiments/overlap.py: its arithmetic and its refusals (the rig itself needs
root and network namespaces: docs/experiments.md has its runs)."""
import pytest

from experiments import overlap


def test_hidden_is_what_one_program_saves_over_the_two_apart():
    row = overlap.summary({"compute_s": 0.3, "exchange_s": 0.9, "one_program_s": 1.0,
                           "two_programs_s": 1.2})
    assert row["hidden_s"] == pytest.approx(0.2)
    assert row["hidden_share"] == pytest.approx(0.2 / 0.3)
    serial = overlap.summary({"compute_s": 0.3, "exchange_s": 0.9, "one_program_s": 1.3,
                              "two_programs_s": 1.2})
    assert serial["hidden_s"] == 0.0 and serial["hidden_share"] == 0.0
    assert "hidden_threads_s" not in row


def test_two_threads_hide_what_they_save_over_the_two_apart():
    row = overlap.summary({"compute_s": 0.3, "exchange_s": 0.9, "one_program_s": 1.2,
                           "two_programs_s": 1.2, "two_threads_s": 0.95})
    assert row["hidden_s"] == 0.0
    assert row["hidden_threads_s"] == pytest.approx(0.25)
    assert row["hidden_threads_share"] == pytest.approx(0.25 / 0.3)


@pytest.mark.parametrize("argv,says", [
    (["--repeats", "0"], "--repeats must be > 0; got 0"),
    (["--exchange-mb", "-1"], "--exchange-mb must be > 0; got -1.0"),
    (["--devices", "0"], "--devices must be >= 1; got [0]"),
    (["--rate", "fast"], "fast"),
])
def test_bad_arguments_are_refused_by_name(argv, says, capsys):
    with pytest.raises(SystemExit) as e:
        overlap.parse_args(argv)
    assert e.value.code == 2
    assert says in capsys.readouterr().err
