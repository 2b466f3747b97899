"""Tests for jcomp.train.run.record: what one step's metrics record holds, in the
order metrics.jsonl gets it, what a phase's first step adds, and which steps'
records are written."""
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from jcomp.gpt import mesh as mesh_lib
from jcomp.gpt import messages
from jcomp.gpt import policy as policy_lib
from jcomp.meter import wire
from jcomp.train.run import record

BASELINE = policy_lib.preset("baseline")
INT8_GRADS = BASELINE.replace({"data.grad": "int8"})
MESH = {"data": 2, "tensor": 2, "pipeline": 2}

STEP_KEYS = ["step", "loss", "grad_norm", "lr", "step_time_s", "tokens_per_s", "compressed",
             "skipped_updates"]


def test_step_record_holds_the_step_in_file_order():
    m = {"loss": np.float32(2.5), "grad_norm": np.float32(0.75), "finite": np.bool_(True)}
    r = record.step_record(10, m, 2.5, 0.5, np.float32(0.25), 256, INT8_GRADS, 1)
    assert list(r) == STEP_KEYS
    assert r == {"step": 10, "loss": 2.5, "grad_norm": 0.75, "lr": 0.25, "step_time_s": 0.5,
                 "tokens_per_s": 256 / 0.5, "compressed": True, "skipped_updates": 1}
    # numpy scalars become Python floats: the record goes to JSON as it is
    assert type(r["grad_norm"]) is float and type(r["lr"]) is float
    assert json.loads(json.dumps(r)) == r


def test_step_record_of_an_uncompressed_phase_with_error_feedback():
    m = {"loss": 3.0, "grad_norm": 1.0, "ef_norm": np.float32(0.5)}
    r = record.step_record(1, m, 3.0, 2.0, 1e-3, 100, BASELINE, 0)
    assert r["compressed"] is False
    assert list(r) == STEP_KEYS + ["ef_norm"] and r["ef_norm"] == 0.5
    assert "ef_norm" not in record.step_record(1, {"grad_norm": 1.0}, 3.0, 2.0, 1e-3, 100,
                                               BASELINE, 0)


def _collective(name, axes, bytes_per_device, count, share):
    return wire.Collective(kind="all-reduce", dtype="f32", shape=(64,), group_size=2, axes=axes,
                           bytes_per_device=bytes_per_device, count=count, name=name, share=share)


def _report(notes=()):
    # data: 256 B x 3 runs on half the devices + 16 B once = 400; tensor: 100 B x 2 = 200;
    # collective executions per step (mesh average): 3 x 0.5 + 2 + 1 = 4.5
    return wire.WireReport([_collective("g", ("data",), 256.0, 3, 0.5),
                            _collective("a", ("tensor",), 100.0, 2, 1.0),
                            _collective("b", ("data",), 16.0, 1, 1.0)], list(notes))


@pytest.fixture(scope="module")
def state():
    """Parameters of 8 x 4 float32 split over 'data' (a device holds 4 x 4: 64 bytes)
    and an optimizer state of 10 float32 on every device (40 bytes)."""
    mesh = mesh_lib.make_mesh((2, 2, 2))
    params = {"w": jax.device_put(jnp.zeros((8, 4), jnp.float32), NamedSharding(mesh, P("data")))}
    zstate = {"m": jax.device_put(jnp.zeros((10,), jnp.float32), NamedSharding(mesh, P()))}
    return {"params": params, "zero": zstate}


def test_static_metrics_are_the_reports_bytes_and_the_states_size(state):
    assert record.static_metrics(_report(), state) == {
        "wire_bytes_data": 400.0, "wire_bytes_tensor": 200.0, "wire_bytes_total": 600.0,
        "wire_collectives": 4.5, "param_bytes_per_device": 64,
        "opt_state_bytes_per_device": 40, "devices": 8}
    noted = record.static_metrics(_report(["widened", "raw send"]), state)
    assert noted["wire_notes"] == "widened | raw send"


def test_phase_record_of_the_first_phase_names_its_compression(state):
    plan = messages.plan(INT8_GRADS, 2, MESH)
    r = record.phase_record(INT8_GRADS, plan, None, _report(), state)
    assert list(r) == ["wire_bytes_data", "wire_bytes_tensor", "wire_bytes_total",
                       "wire_collectives", "param_bytes_per_device",
                       "opt_state_bytes_per_device", "devices", "compression"]
    assert r["compression"] == "data.grad_reduce=int8"
    assert r["wire_bytes_total"] == 600.0


def test_phase_record_of_a_later_phase_names_what_changed(state):
    r = record.phase_record(INT8_GRADS, messages.plan(INT8_GRADS, 2, MESH), BASELINE, _report(),
                            state)
    assert r["compression_changes"] == "data.grad=none->int8"
    first = record.phase_record(BASELINE, messages.plan(BASELINE, 2, MESH), None, _report(),
                                state)
    assert first["compression"] == "none" and "compression_changes" not in first


@pytest.mark.parametrize("rec,step_no,written", [
    ({}, 4, True),  # every log_every (2) steps
    ({}, 3, False),
    ({}, 13, True),  # the last step
    ({"val_loss": 2.0}, 3, True),
    ({"wire_bytes_total": 1.0}, 3, True),  # a phase's first step
    ({"ef_reset": True}, 3, True),
    ({"ef_norm": 0.1, "loss": 2.0}, 3, False),
])
def test_due_writes_every_log_every_the_last_step_and_rarer_records(rec, step_no, written):
    assert record.due(rec, step_no, log_every=2, total_steps=13) is written
