"""experiments/report_streaming.py: the streaming sweep's and the overlap
probe's sections of RESULTS.md, from made-up rows."""
from experiments import report_streaming as rs


def test_the_streaming_section_sets_the_carrying_step_against_a_plain_one_and_a_sync():
    def row(policy, times, repeat=0, **outer):
        return dict(settings=dict(procs=2, config="configs/base.py", warmup_steps=2, hops=True,
                                  set={}, kind="sweep", rate="10mbit", policy=policy, steps=8,
                                  eval_every=8, repeat=repeat),
                    commit="abc1234def", date="2026-12-05T00", median_step_s=0.3,
                    step_times_s=times, **outer)
    plain = [0.9, 0.5, 0.3, 0.3, 0.3, 0.3, 0.3, 0.3]
    carried = [0.9, 0.5, 0.3, 0.8, 0.3, 0.3, 0.5, 0.3]  # steps 4 (its first) and 7 carry
    net_ = {"rows": [row("diloco_f2", plain, outer_sync_s_by_step={"3": 0.1, "6": 0.1}),
                     row("streaming", carried, outer_carried_steps=[4, 7],
                         outer_apply_s_by_step={"5": 0.0, "8": 0.0})]}
    text, claims = rs.streaming_section(net_)
    line = next(l for l in text.splitlines() if l.startswith("| streaming |"))
    assert line.split("|")[5:9] == [" 0.300 s ", " 0.500 s ", " - ", " - "]
    assert "against the carrying step 0.500 s: -0.100 s." in text  # 0.3 + 0.1 - 0.5
    assert "on its thread" not in text.split("\n\n")[-1]
    assert len(claims) == 1 and "hid -0.100 s" in claims[0]
    # Starts on a thread of their own, timed there (each run's first left out).
    net_["rows"][1]["outer_start_s_by_step"] = {"4": 0.9, "7": 0.4}
    text, _ = rs.streaming_section(net_)
    line = next(l for l in text.splitlines() if l.startswith("| streaming |"))
    assert line.split("|")[6:8] == [" 0.500 s ", " 0.400 s "]
    assert "The start took 0.400 s on its thread" in text
    # The time to the baseline's loss, one run each or the median of several.
    net_["ttl_by_rate"] = {"10mbit": {"target_val_loss": 3.0, "policies": {
        "streaming": dict(reached=True, step=8, time_s=2.5),
        "diloco_f2": dict(reached=False, step=None, time_s=None)}}}
    text, _ = rs.streaming_section(net_)
    assert ("(one run each; syncs and merges counted): streaming 2.50 s (step 8), diloco_f2 "
            "not reached.") in text
    net_["ttl_by_rate"]["10mbit"]["policies"]["streaming"]["times_s"] = [2.0, 2.5, 3.0]
    text, _ = rs.streaming_section(net_)
    assert "(the median of its runs; " in text and "2.50 s (step 8, 2.00-3.00 s over 3 runs)" in text


def test_the_overlap_section_shows_two_threads_where_they_were_timed():
    row = dict(devices_per_process=1, local_collective=True, compute_s=0.3, exchange_s=0.9,
               one_program_s=1.1, two_programs_s=1.2, hidden_s=0.1)
    ov = dict(command="python -m experiments.overlap", commit="abc1234def", rate="10mbit",
              burst="128kb", exchange_mb=1.0, repeats=5, rows=[row])
    assert "two threads" not in rs.overlap_section(ov)
    row.update(two_threads_s=0.95, hidden_threads_s=0.25)
    text = rs.overlap_section(ov)
    line = text.splitlines()[-1]
    assert line.split("|")[7:10] == [" 0.950 s ", " 0.100 s ", " 0.250 s "]
    assert "hidden in two threads" in text
