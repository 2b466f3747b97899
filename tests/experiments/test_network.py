"""experiments/network.py: train.py over a throttled loopback in a private
network namespace, checked against jcomp.meter.wire's byte meter."""
import functools
import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time

import pytest

from experiments import network as net
from experiments import network_figures as figs
from experiments import network_launch as net_launch
from experiments import report_auto as rep_auto
from experiments import report_hops as rep_hops
from experiments import report_network as rep

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = ["-m", "experiments.network"]


@functools.cache
def _namespaces_unavailable():
    reason = net.unavailable_reason()
    if reason:
        return reason
    try:
        with net.Namespace(f"{net.PREFIX}{os.getpid()}probe"):
            return None
    except net.Unavailable as e:
        return str(e)


def test_rates_parse_in_tc_units():
    assert net.rate_bits("unthrottled") is None
    assert net.rate_bits("100mbit") == 1e8
    assert net.rate_bits("1gbit") == 1e9
    assert net.rate_bits("2.5kbit") == 2500.0
    for bad in ("100", "100mbps", "-1mbit", "0mbit", "fast"):
        with pytest.raises(ValueError, match="rate"):
            net.rate_bits(bad)


def test_sweep_runs_every_row_repeat_major():
    """--repeats 2: every rate and policy once, then again, so that a slow spell
    of the machine falls on one run of several rows rather than on every run of
    one; the time-to-loss runs come once, after them."""
    args = net.parse_args(["--rates", "unthrottled", "100mbit", "--policies", "baseline",
                           "hybrid", "--repeats", "2"])
    order = [(s["kind"], s.get("repeat"), s["rate"], s["policy"]) for s in net.plan(args)]
    sweep = [(i, r, p) for i in (0, 1) for r in ("unthrottled", "100mbit")
             for p in ("baseline", "hybrid")]
    assert order == ([("sweep",) + key for key in sweep]
                     + [("ttl", None, "100mbit", p) for p in ("baseline", "hybrid")])
    with pytest.raises(SystemExit):
        net.parse_args(["--repeats", "0"])
    only = net.parse_args(["--ttl-only", "--rates", "1gbit", "--ttl-rate", "1gbit", "--policies",
                           "baseline", "perhop", "--hops"])
    assert [(s["kind"], s["rate"], s["policy"], s["hops"]) for s in net.plan(only)] == [
        ("ttl", "1gbit", "baseline", True), ("ttl", "1gbit", "perhop", True)]
    # --ttl-repeats 2: each time-to-loss run twice, repeat-major; the first keeps
    # the settings of a row from before the option.
    twice = net.parse_args(["--ttl-only", "--rates", "1gbit", "--ttl-rate", "1gbit",
                            "--policies", "baseline", "perhop", "--hops", "--ttl-repeats", "2"])
    assert [(s["policy"], s.get("repeat")) for s in net.plan(twice)] == [
        ("baseline", None), ("perhop", None), ("baseline", 1), ("perhop", 1)]
    with pytest.raises(SystemExit):
        net.parse_args(["--ttl-repeats", "0"])


@pytest.mark.e2e
def test_missing_tools_give_one_line_and_exit_2(tmp_path):
    out = tmp_path / "network.json"
    proc = subprocess.run([sys.executable, *SCRIPT, "--out", str(out)], cwd=ROOT,
                          env={**os.environ, "PATH": str(tmp_path)}, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "ip and tc not found" in lines[0], proc.stderr
    assert not out.exists()


def _row(policy, kind, steps, val_losses, step_s=1.0, date="2026-12-01T10:00", commit="a",
         exact=True):
    return {"settings": {"rate": "100mbit", "policy": policy, "kind": kind, "steps": steps},
            "val_losses": {str(k): v for k, v in val_losses.items()}, "date": date,
            "commit": commit, "final_val_loss": val_losses[steps], "step_times_s": [step_s] * steps,
            **({"exact_eval": True} if exact else {})}


def test_time_to_target_is_the_first_evaluation_at_or_below_the_baselines_loss():
    rows = [_row("baseline", "sweep", 4, {4: 2.0}, step_s=3.0),
            _row("hybrid", "sweep", 4, {4: 2.5}),  # the sweep row is not the time-to-loss run
            _row("hybrid", "ttl", 8, {2: 2.6, 4: 2.2, 6: 1.99, 8: 1.9}),
            _row("naive", "ttl", 8, {2: 2.9, 4: 2.5, 6: 2.3, 8: 2.1})]
    ttl = figs.time_to_target(rows, "100mbit")
    assert ttl["target_val_loss"] == 2.0
    assert ttl["policies"]["baseline"] == dict(kind="sweep", commit="a", steps_run=4, reached=True,
                                               step=4, time_s=12.0, best_val_loss=2.0)
    assert ttl["policies"]["hybrid"]["step"] == 6 and ttl["policies"]["hybrid"]["time_s"] == 6.0
    assert ttl["policies"]["naive"]["reached"] is False
    assert ttl["policies"]["naive"]["time_s"] is None
    # The baseline's own time-to-loss run, newer and from another commit, replaces its sweep run.
    rows.append(_row("baseline", "ttl", 8, {2: 2.4, 4: 2.1, 6: 1.95, 8: 1.9}, step_s=3.0,
                     date="2026-12-01T11:00", commit="b"))
    base = figs.time_to_target(rows, "100mbit")["policies"]["baseline"]
    assert (base["kind"], base["commit"], base["step"], base["time_s"]) == ("ttl", "b", 6, 18.0)
    # A compressed policy's loss read through its compressed forward (before exact
    # evaluation) does not count, however fast; the baseline's forward is exact anyway.
    rows.append(_row("naive", "ttl", 8, {2: 1.0, 4: 1.0, 6: 1.0, 8: 1.0}, exact=False,
                     date="2026-12-01T12:00"))
    rows = [dict(r, exact_eval=False) if r["settings"]["policy"] == "baseline" else r
            for r in rows]
    ttl = figs.time_to_target(rows, "100mbit")
    assert ttl["policies"]["naive"]["reached"] is False and "baseline" in ttl["policies"]


def test_repeated_time_to_loss_runs_give_the_median_of_the_newest_commits():
    rows = [_row("baseline", "sweep", 4, {4: 2.0}),
            _row("hybrid", "ttl", 8, {2: 2.6, 4: 1.9, 8: 1.8}, step_s=9.0, commit="old"),
            *(dict(_row("hybrid", "ttl", 8, {2: 2.6, 4: 1.9, 8: 1.8}, step_s=t,
                        date=f"2026-12-02T1{i}:00", commit="new"),
                   settings=dict(rate="100mbit", policy="hybrid", kind="ttl", steps=8,
                                 **({"repeat": i} if i else {})))
              for i, t in enumerate((1.0, 3.0, 2.0)))]
    got = figs.time_to_target(rows, "100mbit")["policies"]["hybrid"]
    assert got["commit"] == "new" and got["step"] == 4
    assert sorted(got["times_s"]) == [4.0, 8.0, 12.0] and got["time_s"] == 8.0
    base = figs.time_to_target(rows, "100mbit")["policies"]["baseline"]
    assert "times_s" not in base and base["time_s"] == 4.0


def test_an_outer_loop_reaches_the_loss_only_with_a_synced_model_and_pays_for_its_syncs():
    every = int(net_launch.POLICIES["diloco"]["outer.every"])
    rows = [_row("baseline", "sweep", 4, {4: 2.0}),
            # Step 2's island mean is below the target, but no island holds the
            # synced model there: the first synced loss at or below it counts.
            _row("diloco", "ttl", 2 * every, {2: 1.5, every: 2.5, 2 * every: 1.9})]
    rows[1]["outer_sync_s_by_step"] = {str(every): 0.5, str(2 * every): 0.25}
    got = figs.time_to_target(rows, "100mbit")["policies"]["diloco"]
    assert got["step"] == 2 * every
    assert got["time_s"] == 2 * every * 1.0 + 0.75  # the inner steps' and both syncs' time
    assert got["best_val_loss"] == 1.9


def test_a_sync_s_bytes_on_the_link_are_its_steps_excess_over_a_plain_step():
    by_step = {s: {"step": s} for s in range(1, 7)}
    static = {"outer_bytes_per_step": 100.0}
    by_step[4].update(outer_sync_s=0.1, outer_bytes_per_sync=400.0)
    delta = {2: 10.0, 3: 12.0, 4: 3212.0, 5: 11.0, 6: 10.0}
    got = figs._outer_figures(by_step, static, [2, 3, 4, 5, 6], delta, devices=8)
    assert got["kernel_bytes_per_step_without_sync"] == 10.5
    assert got["kernel_sync_bytes"] == 3201.5 and got["meter_sync_bytes"] == 3200.0
    assert got["outer_sync_s_by_step"] == {"4": 0.1}
    assert figs._outer_figures(by_step, {}, [2], delta, devices=8) == {}  # every-step run


def test_a_carried_starts_bytes_are_on_the_step_that_carried_it_and_merges_are_timed():
    """outer.delay: the start due after step 3 rides in step 4 (outer_carried),
    so step 4's excess is the sync, priced by step 3's outer_bytes_per_sync; a
    merge's seconds count in the time to the loss like a sync's."""
    by_step = {s: {"step": s} for s in range(1, 7)}
    static = {"outer_bytes_per_step": 100.0}
    by_step[3].update(outer_fragment=1, outer_carried_by=4, outer_bytes_per_sync=400.0)
    by_step[4].update(outer_carried=1, outer_start_s=0.3)
    by_step[5].update(outer_apply_s=0.2)
    delta = {2: 10.0, 3: 12.0, 4: 3212.0, 5: 11.0, 6: 10.0}
    got = figs._outer_figures(by_step, static, [2, 3, 4, 5, 6], delta, devices=8)
    assert got["outer_carried_steps"] == [4] and got["outer_sync_s_by_step"] == {}
    assert got["outer_start_s_by_step"] == {"4": 0.3}
    assert got["kernel_sync_bytes"] == 3201.5 and got["meter_sync_bytes"] == 3200.0
    assert got["outer_apply_s_by_step"] == {"5": 0.2}
    rows = [_row("baseline", "sweep", 4, {4: 2.0}),
            _row("streaming", "ttl", 20, {10: 2.5, 20: 1.9})]
    rows[1]["outer_sync_s_by_step"] = {"10": 0.5}
    rows[1]["outer_apply_s_by_step"] = {"6": 0.25, "16": 0.125}
    hit = figs.time_to_target(rows, "100mbit")["policies"]["streaming"]
    assert hit["step"] == 20 and hit["time_s"] == 20 * 1.0 + 0.5 + 0.375


def test_a_row_of_compression_auto_keeps_its_decision_and_its_steps():
    """compression.auto's first metrics record has no step: the row's figures come
    from the step records as for any policy, and the row carries the decision
    (the codec and link per entry, the predicted seconds against raw)."""
    entries = {"data.grad": {"codec": "int4:rot", "latency_s": 1e-4, "bytes_per_s": 1.2e7,
                             "raw_bytes": 4e6, "coded_bytes": 5e5, "seconds": 0.1,
                             "raw_seconds": 0.25},
               "data.param": {"codec": "int8", "latency_s": 1e-4, "bytes_per_s": 1.2e7,
                              "raw_bytes": 4e6, "coded_bytes": 1e6, "seconds": 0.1,
                              "raw_seconds": 0.25}}
    decision = {"seconds": 0.2, "raw_seconds": 0.5, "source": "probed at start",
                "overlap": 0.0, "device": "test", "entries": entries, "dcn_data": 2,
                "routes": {"as given": {"seconds": 0.3, "links": {}},
                           "per hop (mesh.dcn_data=2)": {"seconds": 0.2, "links": {}}},
                "profile": {"codecs": {"int8": {"encode_s_per_byte": 1e-9,
                                                "decode_s_per_byte": 2e-9}}}}
    steps = [{"step": s, "step_time_s": 0.1 * s, "loss": 5.0 - s, "wire_bytes_total": 100.0,
              "devices": 8} for s in range(1, 5)]
    marks = {s: ((1000 * s, 10 * s, 0), 0.1 * s) for s in range(1, 5)}
    raw = dict(records=[{"auto": decision}] + steps, marks=marks, before=(0, 0, 0),
               after=(5000, 50, 0), wall_s=3.0, header_bytes=66)
    plain = figs.summarize(dict(raw, records=steps), warm_steps=1)
    row = figs.summarize(raw, warm_steps=1)
    assert {k: v for k, v in row.items() if k != "auto"} == plain
    table = row["auto"].pop("table")
    assert row["auto"] == {"codecs": {"data.grad": "int4:rot", "data.param": "int8"},
                           "links": {"data.grad": [1e-4, 1.2e7], "data.param": [1e-4, 1.2e7]},
                           "dcn_data": 2, "outer": None, "routes": {"as given": 0.3,
                                                     "per hop (mesh.dcn_data=2)": 0.2},
                           "route_links": {"as given": {}, "per hop (mesh.dcn_data=2)": {}},
                           "codec_s_per_byte": {"int8": 1e-9 + 2e-9},
                           "predicted_s": 0.2, "predicted_raw_s": 0.5}
    assert "route taken: per hop, mesh.dcn_data=2" in table and "int4:rot" in table
    assert net_launch._flags("auto", {}) == ["--config.compression.policy=baseline",
                                             "--config.compression.auto=on",
                                             "--config.compression.trial=6"]


@pytest.mark.e2e
@pytest.mark.skipif(bool(_namespaces_unavailable()), reason=str(_namespaces_unavailable()))
def test_kernel_bytes_on_a_throttled_link_track_the_meter(tmp_path):
    """2 processes x 4 devices, 300 Mbit/s, a d_model=128 model so that messages
    are large next to their headers.

    Tolerance: the TCP payload (the kernel's lo bytes less 66 header bytes per
    packet: Ethernet 14, IPv4 20, TCP 20 + 12 of timestamps) is within 10% of
    the sum over the 8 devices of the metered bytes. The rest of the 10% is
    gloo's own framing (a small header per message), which the meter does not
    count and which was about 1% of the payload here. And the step takes at
    least the time the link needs for those bytes beyond one token bucket (tbf
    lets a full bucket, 4 MiB, pass at once after an idle gap), so they did
    cross it.

    Window: a step's bytes are read when its record appears in metrics.jsonl,
    so the mean over the window is (reading at its last step - reading before
    its first) / steps, off by how late those two readings came. The record of
    step 1, which carries the meter's figures, is the latest to appear on a
    loaded machine (measured there: 12% of a 0.2 s step), so the window starts
    after step 2. Beside another test process, a reading can also come a tenth
    of a second late at either end (measured: +12% over a four-step window), so
    the window spans 13 steps (3-15; step 16 evaluates and is left out), which
    divides that error by more than three at a few seconds' cost."""
    out = tmp_path / "network.json"
    cmd = [sys.executable, *SCRIPT, "--config", "configs/tiny.py", "--steps", "16",
           "--warm-steps", "2", "--warmup-steps", "1", "--rates", "300mbit", "--repeats", "1", "--policies",
           "baseline", "--ttl-rate", "", "--set", "model.d_model=128", "--set", "model.d_ff=256",
           "--xla-flags=--xla_backend_optimization_level=0", "--timeout", "120",
           "--workroot", str(tmp_path / "runs"), "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    (row,) = json.loads(out.read_text())["rows"]
    assert "tbf" in row["qdisc"] and "300Mbit" in row["qdisc"], row["qdisc"]
    assert row["header_bytes_per_packet"] == 66
    meter = row["meter_bytes_per_step"]
    assert meter == pytest.approx(8 * row["wire_bytes_per_device"]["total"])
    assert row["kernel_window_steps"] == list(range(3, 16)), row["kernel_window_steps"]
    assert 0.9 <= row["payload_over_meter"] <= 1.1, row
    assert row["kernel_bytes_per_step"] > row["tcp_payload_per_step"]
    bucket = 4 * 2**20  # tbf's burst (tools/netns.py: "4mb", tc's 1024-based sizes)
    assert row["median_step_s"] >= 0.9 * (row["kernel_bytes_per_step"] - bucket) * 8 / 300e6, row
    assert row["startup_bytes"] > 0 and len(row["losses"]) == 16
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert row["namespace"] not in listed.split(), listed


@pytest.mark.e2e
@pytest.mark.skipif(bool(_namespaces_unavailable()), reason=str(_namespaces_unavailable()))
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_an_interrupted_sweep_kills_its_runs_and_removes_its_namespace(tmp_path, sig):
    workroot = tmp_path / "runs"
    proc = subprocess.Popen([sys.executable, *SCRIPT, "--config", "configs/tiny.py",
                             # Far more steps than the signal lets run: the sweep must
                             # still be going when it lands (4 steps were seen to finish).
                             "--steps", "400", "--rates", "100mbit", "--policies", "baseline",
                             "--ttl-rate", "", "--workroot", str(workroot),
                             "--out", str(tmp_path / "network.json")], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            # As at a terminal: a suite started in the background inherits
                            # SIGINT ignored, and Python then installs no Ctrl-C handler.
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    name = f"{net.PREFIX}{proc.pid}"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not list(workroot.glob("*/process1.log")):
        time.sleep(0.05)
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert name in listed.split(), listed
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode != 0, err
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert name not in listed.split(), listed
    alive = []
    for cmdline in pathlib.Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if str(workroot).encode() in cmdline.read_bytes():
                alive.append(cmdline.parent.name)
        except OSError:
            pass
    assert not alive, f"train.py processes left running: {alive}"


class _SleepNamespace:
    """Stands in for netns.Namespace: each command is a `sleep`, so nothing is sent."""

    coordinator_host = "127.0.0.1"

    def exec_args(self, argv, process=0):
        return ["sleep", "30"]

    def counters(self):
        return (0, 0, 0)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_inside_popen_still_kills_every_child(tmp_path, monkeypatch, sig):
    """The race of the test above, made certain: the signal lands while Popen of
    the second process runs, after its fork. Its child must be killed with the
    first, though the exception interrupts the launch before the child is listed."""
    started = []
    real_popen = subprocess.Popen

    def popen_then_signal(*args, **kwargs):
        proc = real_popen(*args, **kwargs)
        started.append(proc)
        if len(started) == 2:
            os.kill(os.getpid(), sig)  # its handler runs before this call returns
        return proc

    monkeypatch.setattr(net_launch.subprocess, "Popen", popen_then_signal)
    old = signal.signal(signal.SIGTERM, net._raise_exit)
    old_int = signal.signal(signal.SIGINT, signal.default_int_handler)
    settings = dict(procs=2, config="configs/tiny.py", steps=400, eval_every=400,
                    warmup_steps=1, policy="baseline", set={})
    try:
        with pytest.raises((KeyboardInterrupt, SystemExit)):
            net_launch.launch(_SleepNamespace(), settings, str(tmp_path), 60.0, 1)
        alive = [p.pid for p in started if p.poll() is None]
    finally:
        signal.signal(signal.SIGTERM, old)
        signal.signal(signal.SIGINT, old_int)
        for p in started:
            p.kill()
            p.wait()
    assert len(started) == 2
    assert not alive, f"children left running: {alive}"


def test_the_report_names_what_the_hybrid_rows_ran_at_each_commit():
    """The hybrid preset changed twice; a sweep's hybrid rows are labelled with the
    preset of the commit that ran them, not today's."""
    def rev(ref):
        return subprocess.run(["git", "rev-parse", ref], cwd=ROOT, capture_output=True,
                              text=True, check=True).stdout.strip()
    (first, first_ran), (last, last_ran) = rep.HYBRID_PRESETS[0], rep.HYBRID_PRESETS[-1]
    assert rep.hybrid_at(rev("HEAD")) == last_ran
    assert rep.hybrid_at(rev(first)) == first_ran
    assert "hybrid_paper" in rep.hybrid_at(rev(first + "^"))
    assert rep.hybrid_at(rev(last + "^")) == rep.HYBRID_PRESETS[-2][1]


_SERVER = """
import socket, sys
s = socket.socket(); s.bind((sys.argv[1], 5555)); s.listen(); c, _ = s.accept(); n = 0
while True:
    d = c.recv(1 << 20)
    if not d:
        break
    n += len(d)
print(n)
"""
_CLIENT = """
import socket, sys, time
for _ in range(100):
    try:
        s = socket.create_connection((sys.argv[1], 5555)); break
    except OSError:
        time.sleep(0.05)
s.sendall(b"x" * int(sys.argv[2])); s.close()
"""


@pytest.mark.skipif(bool(_namespaces_unavailable()), reason=str(_namespaces_unavailable()))
def test_a_pair_throttles_and_counts_only_what_crosses_between_its_namespaces():
    """--hops' link: 12 MB sent from namespace 1 to 0 cross the veth (its counters
    hold them, plus headers and ACKs) at no more than the rate once tbf's 4 MiB
    bucket is spent; 12 MB sent inside namespace 0, over its own loopback, leave
    the veth's counters alone. Both namespaces and their /etc/netns files go."""
    from tools import netns

    size, rate = 12_000_000, 100e6
    with netns.Pair(f"{net.PREFIX}{os.getpid()}") as pair:
        pair.set_rate("100mbit")
        assert pair.qdisc().count("rate 100Mbit") == 2, pair.qdisc()
        host = socket.gethostname()
        looked_up = subprocess.run(pair.exec_args(["getent", "hosts", host], process=1),
                                   capture_output=True, text=True).stdout
        assert looked_up.split()[0] == pair.addresses[1], looked_up

        def send(server_ns, client_ns, addr):
            server = subprocess.Popen(pair.exec_args([sys.executable, "-c", _SERVER, addr],
                                                     process=server_ns),
                                      stdout=subprocess.PIPE, text=True)
            before, t0 = pair.counters(), time.monotonic()
            subprocess.run(pair.exec_args([sys.executable, "-c", _CLIENT, addr, str(size)],
                                          process=client_ns), check=True, timeout=60)
            got = int(server.communicate(timeout=60)[0])
            return got, pair.counters()[0] - before[0], time.monotonic() - t0

        got, crossed, seconds = send(0, 1, pair.addresses[0])
        assert got == size
        assert size <= crossed <= 1.1 * size, crossed
        assert seconds >= (size - 4 * 2**20) * 8 / rate, seconds
        got, crossed, _ = send(0, 0, pair.addresses[0])
        assert got == size and crossed < 10_000, crossed
        names = pair.names
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    assert not set(names) & set(listed), listed
    assert not any(os.path.exists(f"/etc/netns/{n}") for n in names)


def test_the_auto_section_checks_auto_against_the_fastest_and_its_prediction():
    def row(rate, policy, step, repeat, auto=None):
        settings = dict(procs=2, config="configs/base.py", warmup_steps=2, hops=True,
                        set={"mesh.data": "4"}, kind="sweep", rate=rate, policy=policy,
                        steps=14, eval_every=14, repeat=repeat)
        return dict(settings=settings, commit="abc1234def", date=f"2026-12-05T0{repeat}",
                    median_step_s=step, **({"auto": auto} if auto else {}))

    def decision(predicted, raw, codec, dcn_bps):
        return {"codecs": {"dcn.grad": codec, "tensor.act": "none"}, "dcn_data": 2,
                "predicted_s": predicted, "predicted_raw_s": raw,
                "route_links": {"per hop (mesh.dcn_data=2)": {"dcn": {"bytes_per_s": dcn_bps}}}}

    rows = []
    for i in range(3):
        rows += [row("unthrottled", "baseline", 0.30, i), row("unthrottled", "hybrid", 0.32, i),
                 row("unthrottled", "auto", 0.29, i, decision(0.01, 0.05, "none", 1e8)),
                 row("10mbit", "baseline", 4.0, i), row("10mbit", "hybrid_perhop", 0.80, i),
                 row("10mbit", "auto", 0.90, i, decision(0.60, 4.0, "int4:rot", 3.0e5))]
    text, claims = rep_auto.auto_section({"rows": rows, "warm_steps": 2})
    # compute = 0.30 (unthrottled baseline) - 0.05 (its predicted raw communication)
    assert "0.250 s" in text
    fast, slow = claims
    assert fast.startswith("compression.auto at unthrottled: 0.290 s per step, 0.967x the fastest")
    assert "PASS (within 5% of the fastest" in fast
    assert "predicted 0.260 s, 0.90x measured: PASS" in fast
    # 0.90 s against hybrid_perhop's 0.80: 1.125x the fastest fails; 0.85 predicted passes.
    assert "1.125x the fastest" in slow and "FAIL (within 5%" in slow
    assert "predicted 0.850 s, 0.94x measured: PASS" in slow and "dcn.grad=int4:rot" in slow
    line = next(l for l in text.splitlines() if l.startswith("| 10mbit"))
    # The probed link: 0.3 MB/s per device x 4 devices of a process = 1.2 MB/s, 0.96x 10 Mbit/s.
    assert "| 1.20 | 0.96 |" in line
    # With the baseline run in one process (--procs 1), its step is the compute.
    alone = []
    for i, step in enumerate((0.27, 0.26, 0.5)):
        r = row("unthrottled", "baseline", step, i)
        r["settings"]["procs"] = 1
        r["commit"] = "fed4321abc"
        alone.append(r)
    text, claims = rep_auto.auto_section({"rows": rows + alone, "warm_steps": 2})
    assert "the baseline in one process, median of 3 runs at fed4321: 0.270 s" in text
    assert "predicted 0.280 s, 0.97x measured: PASS" in claims[0]
    assert "commit abc1234" in text.lower()
    # With compression.trial the taken candidate's trial time is the prediction, and
    # the model's (compute from the uncompressed trial) stands beside it.
    for r in rows:
        if r["settings"]["policy"] == "auto" and r["settings"]["rate"] == "10mbit":
            r["auto"].update(trial_step_s=0.88, trial={"taken": "per hop (mesh.dcn_data=2)",
                                                       "predicted_s": {
                                                           "per hop (mesh.dcn_data=2)": 0.45}})
    text, claims = rep_auto.auto_section({"rows": rows + alone, "warm_steps": 2})
    assert "predicted 0.880 s, 0.98x measured: PASS" in claims[1]
    line = next(l for l in text.splitlines() if l.startswith("| 10mbit"))
    assert "| 0.880 | 0.98 | 0.50 |" in line  # predicted, its ratio, the model's ratio


def test_the_auto_section_shows_other_policies_and_a_trials_fewest_bytes_choice():
    def row(policy, step, repeat, auto=None):
        settings = dict(procs=2, config="configs/base.py", warmup_steps=2, hops=True,
                        set={"mesh.data": "4"}, kind="sweep", rate="100mbit", policy=policy,
                        steps=30, eval_every=30, repeat=repeat)
        return dict(settings=settings, commit="abc1234def", date=f"2026-12-05T0{repeat}",
                    median_step_s=step, **({"auto": auto} if auto else {}))

    taken = "as given, fewest bytes"
    decision = {"codecs": {"data.grad": "int4:rot", "tensor.act": "int8"}, "dcn_data": 1,
                "predicted_s": 0.1, "predicted_raw_s": 0.4, "trial_step_s": 0.38,
                "trial": {"taken": taken, "predicted_s": {taken: 0.45}}}
    rows = []
    for i in range(3):  # no baseline: hybrid_act8, not a rival, is shown beside them
        rows += [row("hybrid", 0.42, i), row("hybrid_perhop", 0.40, i),
                 row("hybrid_act8", 0.37, i), row("auto", 0.39, i, decision)]
    text, [claim] = rep_auto.auto_section({"rows": rows, "warm_steps": 2})
    assert "| hybrid_act8 s |" in text
    line = next(l for l in text.splitlines() if l.startswith("| 100mbit"))
    assert "| n/a | 0.420 | 0.400 | 0.370 | 0.390 |" in line, line
    # Weighed against the rivals only (0.39 / 0.40), and it says no baseline ran.
    assert "0.975x the fastest of hybrid, hybrid_perhop (hybrid_perhop" in claim
    assert "no baseline run: PASS (within 5% of the fastest); predicted" in claim
    assert "chose flat, fewest bytes: data.grad=int4:rot, tensor.act=int8" in claim


def test_the_hops_section_compares_per_hop_with_flat_hybrid_side_by_side():
    def row(policy, step, link, slow=None, repeat=0):
        settings = dict(procs=2, config="configs/base.py", warmup_steps=2, hops=True,
                        set={"mesh.data": "4"}, kind="sweep", rate="100mbit", policy=policy,
                        steps=14, eval_every=14, repeat=repeat)
        return dict(settings=settings, commit="abc1234def", date=f"2026-12-04T0{repeat}",
                    loadavg_before=1.0, median_step_s=step, kernel_bytes_per_step=link,
                    tcp_payload_per_step=0.9 * link, meter_slow_hop_bytes_per_step=slow,
                    final_loss=2.0)

    rows = [row("baseline", 2.0, 8e6, repeat=i) for i in range(3)]
    rows += [row("hybrid", s, 2e6, repeat=i) for i, s in enumerate((1.0, 1.2, 5.0))]
    rows += [row("perhop", s, 1e6, slow=0.9e6, repeat=i) for i, s in enumerate((0.6, 0.5, 0.7))]
    rows += [row("hybrid_perhop", s, 1.5e6, slow=1.2e6, repeat=i) for i, s in enumerate((1.8, 1.5))]
    text, claims = rep_hops.hops_section({"rows": rows, "warm_steps": 2})
    table = {l.split("|")[2].strip(): l.split("|")[1:-1] for l in text.splitlines()
             if l.startswith("| 100mbit")}
    # Medians over the three runs: a slow outlier (hybrid's 5.0 s) does not move them.
    assert table["hybrid"][2].strip() == "1.200" and table["hybrid"][4].strip() == "0.60"
    assert table["perhop"][7].strip() == "0.900" and table["perhop"][8].strip() == "1.000"
    assert table["baseline"][7].strip() == "n/a"
    assert claims == [
        "Two hops at 100mbit: perhop (data messages raw inside a process and coded across, the "
        "rest raw) takes 0.50x the flat hybrid's step time and sends 0.50x its bytes over the "
        "slow link (medians of the runs, side by side).",
        "Two hops at 100mbit: hybrid_perhop (the hybrid preset with its data messages coded "
        "across processes only) takes 1.38x the flat hybrid's step time and sends 0.75x its "
        "bytes over the slow link (medians of the runs, side by side)."]
    assert rep.commands({"rows": rows})[0].startswith("python -m experiments.network --hops ")


def test_a_row_faster_than_its_links_rate_is_named_with_the_time_its_bytes_need():
    def row(policy, step, link):
        settings = dict(procs=2, config="configs/base.py", warmup_steps=2, hops=True,
                        set={"mesh.data": "4"}, kind="sweep", rate="10mbit", policy=policy,
                        steps=14, eval_every=14, repeat=0)
        return dict(settings=settings, commit="abc1234def", date="2026-12-04T00",
                    loadavg_before=1.0, median_step_s=step, kernel_bytes_per_step=link,
                    tcp_payload_per_step=link, meter_slow_hop_bytes_per_step=None, final_loss=2.0)

    # 10 MB a step is 5 MB each way: 4 s at 10 Mbit/s, under the baseline's 4.2 s;
    # per hop's 0.67 MB each way need 0.532 s, more than its 0.356 s step.
    text, _ = rep_hops.hops_section({"rows": [row("baseline", 4.2, 10e6),
                                              row("hybrid_perhop", 0.356, 1.33e6)],
                                     "warm_steps": 2})
    note = next(l for l in text.splitlines() if l.startswith("Faster than their link"))
    assert "10mbit hybrid_perhop (0.356 s; its 0.67 MB each way need 0.532 s at the rate)" in note
    assert "baseline" not in note


def test_the_outer_section_gives_each_syncs_bytes_and_the_time_to_the_baselines_loss():
    def row(policy, sync=None, repeat=0):
        settings = dict(procs=2, config="configs/base.py", warmup_steps=2, hops=True,
                        set={"mesh.data": "4"}, kind="sweep", rate="10mbit", policy=policy,
                        steps=14, eval_every=14, repeat=repeat)
        r = dict(settings=settings, commit="abc1234def", date="2026-12-04T00", loadavg_before=1.0,
                 median_step_s=1.0, kernel_bytes_per_step=1e5, tcp_payload_per_step=9e4,
                 meter_slow_hop_bytes_per_step=8e4, final_loss=2.0)
        if sync:
            r.update(kernel_bytes_per_step_without_sync=13000.0, kernel_sync_bytes=sync,
                     meter_sync_bytes=8e5, kernel_over_meter_sync=sync / 8e5)
        return r

    def ttl(step, time):
        return dict(kind="ttl", commit="abc1234def", steps_run=28, reached=step is not None,
                    step=step, time_s=time, best_val_loss=3.0)

    net = {"rows": [row("baseline"), row("hybrid_perhop"), row("diloco", sync=8.4e5),
                    row("diloco", sync=8.8e5, repeat=1)],
           "warm_steps": 2,
           "ttl_by_rate": {"10mbit": {"rate": "10mbit", "target_val_loss": 3.1, "policies": {
               "baseline": ttl(10, 40.0), "hybrid_perhop": ttl(10, 8.0),
               "diloco": ttl(20, 4.0), "sparseloco": ttl(None, None)}}}}
    text, claims = rep_hops.outer_section(net)
    # The median over both runs of each run's own figures.
    sync_row = next(l for l in text.splitlines() if l.startswith("| 10mbit | diloco | 2 |"))
    assert sync_row.split("|")[4:8] == [" 13,000 ", " 860.0 ", " 800.0 ", " 1.075 "]
    assert claims == [
        "Outer loop across a 10mbit link: diloco reaches it in 4.0 s (step 20), 0.10x the "
        "baseline's 40.0 s and 0.50x hybrid_perhop's (time to the baseline's loss 3.1000, one "
        "run each).",
        "Outer loop across a 10mbit link: sparseloco does not reach it in 28 steps (time to the "
        "baseline's loss 3.1000, one run each)."]


@pytest.mark.skipif(bool(_namespaces_unavailable()), reason=str(_namespaces_unavailable()))
def test_a_fresh_namespace_reads_its_own_loopback():
    """Its counters are read through a process that enters the namespace: read
    before it has, they would be this machine's own loopback's."""
    for _ in range(3):
        with net.Namespace(f"{net.PREFIX}{os.getpid()}") as ns:
            assert ns.counters() == (0, 0, 0)
