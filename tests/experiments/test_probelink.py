"""experiments/probelink.py and report_probelink.py: the probe's link figure against
tc's rate."""
import pytest

from experiments import probelink
from experiments import report_probelink


def test_figures_scale_a_device_by_the_devices_crossing_at_once_against_tc():
    worker = dict(latency_s=0.0, bytes_per_s=2.5e6, comment="probe",
                  psum_s_by_size={"1048576": [0.5, 0.4, 0.45], "65536": [0.1, 0.1, 0.1]})
    fig = probelink.figures(worker, "100mbit", (1000, 10, 3), (9000, 30, 5))
    n = probelink.DEVICES_PER_PROCESS
    assert fig["link_bytes_per_s"] == 2.5e6 * n
    assert fig["link_over_tc"] == pytest.approx(2.5e6 * n * 8 / 1e8)
    # Each size: its bytes per device x n over the median call, in bits, over tc's.
    assert fig["psum_over_tc_by_size"]["1048576"] == pytest.approx(1048576 * n / 0.45 * 8 / 1e8)
    assert fig["psum_over_tc_by_size"]["65536"] == pytest.approx(65536 * n / 0.1 * 8 / 1e8)
    assert fig["retransmitted_segments"] == 2 and fig["veth_bytes"] == 8000
    assert fig["comment"] == "probe"  # the worker's own figures are kept


@pytest.mark.parametrize("argv, named", [
    (["--rates", "unthrottled"], "throttled"),
    (["--rates", "100mbps"], "--rates"),
    (["--repeats", "0"], "--repeats"),
])
def test_bad_arguments_are_named(capsys, argv, named):
    with pytest.raises(SystemExit) as e:
        probelink.main(argv)
    assert e.value.code == 2
    assert named in capsys.readouterr().err


def _row(commit, rate, repeat, over_tc):
    return dict(commit=commit, rate=rate, repeat=repeat, burst="128kb", dirty=False,
                link_over_tc=over_tc, link_bytes_per_s=over_tc * 1e8 / 8,
                comment="probe: psum over 'dcn' (n=2), sizes [65536, 262144] B/device, median of 5",
                psum_over_tc_by_size={"262144": over_tc}, retransmitted_segments=3)


def test_the_report_judges_every_run_of_the_newest_commit_and_names_the_earlier_ones():
    data = {"rows": [_row("a" * 40, "100mbit", 0, 0.5)]
            + [_row("b" * 40, "100mbit", i, x) for i, x in enumerate((0.95, 0.9, 0.97))]
            + [_row("b" * 40, "10mbit", i, x) for i, x in enumerate((0.95, 0.84, 0.97))]}
    text, claims = report_probelink.report_section(data)
    assert "Commit bbbbbbb" in text and "aaaaaaa 0.500-0.500 (1 runs)" in text
    assert "[65536, 262144]" in text
    by_rate = {c.split(" at ")[1].split(":")[0]: c for c in claims}
    assert "PASS" in by_rate["100mbit"] and "0.950x" in by_rate["100mbit"]
    assert "FAIL" in by_rate["10mbit"]  # one run of three outside 15%
    assert list(by_rate) == ["10mbit", "100mbit"]  # slowest first
    assert report_probelink.command(data) == (
        "python -m experiments.probelink --rates 10mbit 100mbit --repeats 3 --burst 128kb")
