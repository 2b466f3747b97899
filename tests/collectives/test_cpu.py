"""jcomp.collectives.cpu: the XLA_FLAGS option under which CPU programs with
collectives over several device groups do not stop, and the warning of the
hop-by-hop ops when it is missing."""
import warnings

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from jcomp import collectives as cc
from jcomp.collectives import cpu


@pytest.mark.parametrize("before,after", [
    ({}, cpu.FLAG),
    ({"XLA_FLAGS": "--xla_force_host_platform_device_count=8"},
     "--xla_force_host_platform_device_count=8 " + cpu.FLAG),
    # the user's own choice, either way, stays as it is
    ({"XLA_FLAGS": f"--{cpu.OPTION}=true"}, f"--{cpu.OPTION}=true"),
    ({"XLA_FLAGS": cpu.FLAG}, cpu.FLAG),
])
def test_add_flag_adds_the_option_only_where_it_is_unset(before, after):
    env = dict(before)
    cpu.add_flag(env)
    assert env["XLA_FLAGS"] == after


def _trace(fn):
    mesh = jax.make_mesh((2, 4), ("dcn", "ici"), axis_types=(AxisType.Explicit,) * 2)
    every = P(("dcn", "ici"))
    body = jax.shard_map(lambda a: fn(a[0])[None], mesh=mesh, in_specs=every, out_specs=every)
    x = jax.device_put(jnp.zeros((8, 8, 16), jnp.float32), NamedSharding(mesh, every))
    jax.jit(body).trace(x)


HOP_BY_HOP = {
    "psum": lambda a: cc.psum(a, ("dcn", "ici"), codec={"dcn": "int8"}),
    "psum_scatter": lambda a: cc.psum_scatter(a, ("dcn", "ici"), codec={"dcn": "int8"},
                                              tiled=True),
    "all_gather": lambda a: cc.all_gather(a, ("dcn", "ici"), codec={"dcn": "int8"},
                                          tiled=True)[:8],
}


@pytest.mark.parametrize("op", list(HOP_BY_HOP))
def test_hop_by_hop_ops_warn_on_cpu_without_the_option(op, monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    with pytest.warns(cpu.SchedulerWarning, match=cpu.FLAG):
        _trace(HOP_BY_HOP[op])


@pytest.mark.parametrize("op", list(HOP_BY_HOP))
def test_hop_by_hop_ops_are_quiet_with_the_option(op, monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", cpu.FLAG)
    with warnings.catch_warnings():
        warnings.simplefilter("error", cpu.SchedulerWarning)
        _trace(HOP_BY_HOP[op])


def test_one_codec_for_all_axes_does_not_warn(monkeypatch):
    """A plain string codec is the flat op over all axes at once: one group per
    collective, nothing for the scheduler to interleave."""
    monkeypatch.setenv("XLA_FLAGS", "")
    with warnings.catch_warnings():
        warnings.simplefilter("error", cpu.SchedulerWarning)
        _trace(lambda a: cc.psum(a, ("dcn", "ici"), codec="int8"))
