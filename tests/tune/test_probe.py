"""jcomp.tune.probe on the emulated 8-device CPU mesh: links per axis, codec costs."""
import importlib
import math
import os
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
from jax.sharding import AxisType

from jcomp import tune

probe_module = importlib.import_module("jcomp.tune.probe")


def _mesh(shape, names, kind=AxisType.Explicit):
    return jax.make_mesh(shape, names, axis_types=(kind,) * len(names))


def test_probe_gives_finite_positive_figures_for_each_axis_and_codec(tmp_path):
    mesh = _mesh((4, 2), ("data", "tensor"))
    codecs = ("none", "bf16", "int8", "int4:rot")
    t0 = time.perf_counter()
    prof = tune.probe(mesh, codecs=codecs)
    took = time.perf_counter() - t0
    assert took < 30, f"probe took {took:.1f} s"  # about 2 s on an idle 2-core machine
    assert set(prof.links) == {"data", "tensor"}
    for axis, link in prof.links.items():
        assert math.isfinite(link.latency_s) and link.latency_s >= 0, axis
        assert math.isfinite(link.bytes_per_s) and link.bytes_per_s > 0, axis
        assert f"n={mesh.shape[axis]}" in link.comment
    assert set(prof.codecs) == {"bf16", "int8", "int4:rot"}  # "none" costs nothing
    for name, cost in prof.codecs.items():
        for v in (cost.encode_s_per_byte, cost.decode_s_per_byte):
            assert math.isfinite(v) and v > 0, name
    assert "cpu" in prof.device and "data=4" in prof.device
    path = tmp_path / "probed.json"
    tune.save(prof, path)
    assert tune.load(path) == prof
    # What it measured plans: every axis and kind gets a codec.
    d = tune.choose(prof, {("data", "grad"): (1e6, 1), ("tensor", "act"): (1e5, 4)})
    assert {(c.axis, c.kind) for c in d.choices} == {("data", "grad"), ("tensor", "act")}


def test_axes_of_size_one_are_not_probed_and_auto_meshes_work():
    mesh = _mesh((8, 1), ("data", "tensor"), AxisType.Auto)
    prof = tune.probe(mesh, codecs=("int8",), sizes=(1 << 14, 1 << 21), codec_bytes=1 << 16,
                      repeats=3)
    assert set(prof.links) == {"data"} and set(prof.codecs) == {"int8"}


def test_fit_link_recovers_a_line_and_keeps_both_figures_non_negative():
    w = np.array([1e3, 1e5, 1e6, 4e6])
    a, b = tune.fit_link(w, 2e-4 + w / 5e8)
    assert a == pytest.approx(2e-4, rel=1e-9) and b == pytest.approx(1 / 5e8, rel=1e-9)
    # A negative intercept is no latency: the fit goes through the origin.
    a, b = tune.fit_link(w, -1e-4 + w / 1e9)
    assert a == 0.0 and b == pytest.approx(float(w @ (-1e-4 + w / 1e9)) / float(w @ w))
    # Time falling with bytes gives no bandwidth (b = 0), the probe's error case.
    a, b = tune.fit_link(w, np.array([4e-3, 3e-3, 2e-3, 1e-3]))
    assert b == 0.0 and a == pytest.approx(2.5e-3)
    with pytest.raises(ValueError, match="non-finite"):
        tune.fit_link(w, np.array([1e-3, np.nan, 2e-3, 3e-3]))


def _timed_link(monkeypatch, latency_s, bytes_per_s):
    """The probe's timer answering as a link of these figures would: t = latency
    + the psum's wire bytes per device / bandwidth. Records each size asked."""
    asked = []

    def median_s(fn, x, repeats, max_s=float("inf")):
        size = x.size * 4 // len(jax.devices())
        asked.append((size, max_s))
        return latency_s + size / bytes_per_s  # over n=2, wire = size
    monkeypatch.setattr(probe_module, "_median_s", median_s)
    return asked


@pytest.mark.parametrize("bytes_per_s, timed", [
    (1e9, [1 << 16, 1 << 18, 1 << 20, 1 << 22]),  # every call short: every size
    (3e6, [1 << 16, 1 << 18, 1 << 20]),           # 1 MiB takes 0.35 s: no 4 MiB
    (1e5, [1 << 16, 1 << 18]),                    # even 64 KiB is slow: two sizes still
])
def test_the_sizes_stop_at_the_first_slow_call_after_two(monkeypatch, bytes_per_s, timed):
    asked = _timed_link(monkeypatch, 1e-3, bytes_per_s)
    mesh = _mesh((2, 4), ("data", "tensor"))
    prof = tune.probe(mesh, codecs=(), repeats=3)  # the default sizes
    assert [size for size, _ in asked] == timed * 2  # data's sizes, then tensor's
    assert all(max_s == probe_module.SIZE_BUDGET_S for _, max_s in asked)
    assert str(timed) in prof.links["data"].comment
    # From the sizes it timed, the fit recovers the link.
    assert prof.links["data"].bytes_per_s == pytest.approx(bytes_per_s, rel=1e-6)
    assert prof.links["data"].latency_s == pytest.approx(1e-3, rel=1e-6)


@pytest.mark.parametrize("kwargs, named", [
    (dict(sizes=(1 << 16, 1 << 16)), "sizes"),
    (dict(sizes=(1 << 16, 1001)), "sizes"),
    (dict(codecs=("powersgd:rank=2",)), r"codecs\[0\]"),
    (dict(codecs=("int8", "int3")), r"codecs\[1\]"),
    (dict(repeats=0), "repeats"),
    (dict(codec_bytes=2), "codec_bytes"),
])
def test_bad_arguments_are_named(kwargs, named):
    with pytest.raises(ValueError, match=named):
        tune.probe(_mesh((4, 2), ("data", "tensor")), **kwargs)


def test_a_mesh_is_required():
    with pytest.raises(TypeError, match="mesh"):
        tune.probe(jax.devices())
    with pytest.raises(TypeError, match="codecs"):
        tune.probe(_mesh((4, 2), ("data", "tensor")), codecs="int8")


_TWO_PROCESS_PROBE = r"""
import sys, time
import jax
jax.config.update("jax_num_cpu_devices", 2)
jax.config.update("jax_cpu_collectives_implementation", "gloo")
port, me = sys.argv[1], int(sys.argv[2])
jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2,
                           process_id=me)
import importlib
probe = importlib.import_module("jcomp.tune.probe")
if me == 1:
    # This process's clock runs 1000x fast: each of its calls reads as a slow
    # link's, past SIZE_BUDGET_S and SLOW_CALL_S, where process 0's do not.
    real = time.perf_counter
    probe._clock = lambda: real() * 1000
mesh = jax.make_mesh((4,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
prof = probe.probe(mesh, codecs=(), sizes=(1 << 12, 1 << 22, 1 << 23), repeats=5)
link = prof.links["data"]
print("LINK", link.comment, link.latency_s, link.bytes_per_s, flush=True)
jax.distributed.shutdown()
"""


def test_two_processes_whose_stop_rules_trip_on_one_only_stop_as_one(tmp_path):
    """2 processes x 2 CPU devices probing one axis across both: on process 1
    every call looks slow (its clock), on process 0 none does. The stop rules
    decide on the slowest process's time, so both make the same calls (one per
    size, two sizes) and end with the same link, where process 0 went on to
    more calls and sizes and the two waited on each other's psums."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    script = tmp_path / "probe2.py"
    script.write_text(_TWO_PROCESS_PROBE)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="", PYTHONPATH=root)
    procs = [subprocess.Popen([sys.executable, str(script), str(port), str(i)], cwd=root,
                              env=env, text=True, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE) for i in range(2)]
    try:
        outs = [p.communicate(timeout=90) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    links = []
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
        [line] = [l for l in out.splitlines() if l.startswith("LINK ")]
        links.append(line)
    assert links[0] == links[1]
    assert "sizes [4096, 4194304] B/device" in links[0], links[0]
