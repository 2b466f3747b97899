"""The message plan: every message the step sends, checked against the compiled program."""
import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding

from jcomp.gpt import hyperparams, messages, sharding, step, zero

from jcomp.meter import wire
from jcomp.gpt import mesh as jmesh
from jcomp.gpt import model as gpt
from jcomp.gpt import policy as jpolicy

CFG = gpt.ModelConfig(vocab_size=64, d_model=32, n_heads=4, n_layers=4, d_ff=64, max_seq_len=16)
SIZES = lambda d, t, p: {"data": d, "tensor": t, "pipeline": p}


def test_every_field_reads_its_entry_and_only_messages_that_exist_are_listed():
    pl = messages.plan(jpolicy.preset("hybrid"), 4, SIZES(2, 2, 2))
    assert {m.name for m in pl.messages()} == {
        "grad_reduce", "param_gather", "embed_sum", "head_entry_grad", "block_exit",
        "block_entry_grad", "stage_send", "stage_send_grad", "last_stage_sum",
        "first_stage_grad"}  # no autoencoder: its weight-gradient sum does not exist
    for m in pl.messages():
        axis, kind = m.entry.split(".")
        assert m.axis == axis and all(str(c) == str(jpolicy.preset("hybrid")[axis, kind])
                                      for c in m.codecs), m
    only_data = messages.plan(jpolicy.preset("hybrid"), 4, SIZES(8, 1, 1))
    assert {m.axis for m in only_data.messages()} == {"data"}
    assert only_data.describe() == "data.grad_reduce=int4:rot data.param_gather=int8"
    assert messages.plan(jpolicy.preset("baseline"), 4, SIZES(2, 2, 2)).describe() == "none"


def test_a_split_data_axis_adds_the_slow_hops_messages():
    """With a 'dcn' axis the optimizer's messages go hop by hop: the data entries
    code the fast hop, the dcn entries (their data entries when unset) the slow one."""
    split = dict(dcn=2, **SIZES(2, 2, 1))
    pl = messages.plan(jpolicy.preset("hybrid"), 4, split)
    assert pl.data_axes == ("dcn", "data")
    assert [(a, g.name, p.name) for a, g, p in pl.data_hops()] == [
        ("data", "grad_reduce", "param_gather"), ("dcn", "grad_reduce_dcn", "param_gather_dcn")]
    assert pl.grad_reduce_dcn.size == 2 and pl.grad_reduce.size == 2
    assert str(pl.grad_reduce_dcn.codec) == "int4:rot" and pl.grad_reduce_dcn.axis == "dcn"
    hop = jpolicy.preset("baseline").replace({"dcn.grad": "int4:rot", "dcn.param": "int8"})
    assert messages.plan(hop, 4, split).describe() == (
        "dcn.grad_reduce_dcn=int4:rot dcn.param_gather_dcn=int8")
    flat = messages.plan(hop, 4, SIZES(4, 2, 1))  # no 'dcn' axis: no slow-hop message
    assert flat.data_axes == ("data",) and len(flat.data_hops()) == 1
    assert flat.describe() == "none" and not flat.grad_reduce_dcn.exists
    with pytest.raises(ValueError, match="data.grad=powersgd.*mesh.dcn_data > 1"):
        messages.plan(jpolicy.preset("baseline").replace({"data.grad": "powersgd:rank=2"}), 4,
                      split)


def test_places_are_global_layers_and_sending_stages():
    pol = jpolicy.preset("hybrid").restrict({"tensor.act": "1,3", "pipeline.act_grad": "1"})
    pl = messages.plan(pol, 4, SIZES(1, 2, 2))
    assert [str(pl.block_exit.at(i)) for i in range(4)] == ["none", "int4:rot", "none", "int4:rot"]
    assert pl.block_exit.describe() == "int4:rot[layers 1,3]"
    # Stage 1 sends backward to stage 0; stage 0's own input gradient goes nowhere
    # compressed, since stage 0 is not selected.
    assert str(pl.stage_send_grad.at(1)) == "int8"
    assert str(pl.first_stage_grad.codec) == "none" and not pl.first_stage_grad.compressed()
    assert "pipeline.first_stage_grad" not in pl.describe()
    assert pl.last_stage_sum.places == (1,) and pl.stage_send.places == (0,)


def test_a_model_that_does_not_divide_or_a_layer_out_of_range_is_refused():
    with pytest.raises(ValueError, match="n_layers=3 is not divisible by mesh.pipeline=2"):
        messages.plan(jpolicy.preset("hybrid"), 3, SIZES(1, 1, 2))
    with pytest.raises(ValueError, match="layers.tensor.act=7"):
        messages.plan(jpolicy.preset("hybrid").restrict({"tensor.act": "7"}), 4, SIZES(1, 2, 1))


def test_learned_codes_name_their_rest_outside_the_blocks():
    pol = jpolicy.preset("baseline").replace({"tensor.act": "ae:dim=8:rest=int8"})
    pl = messages.plan(pol, 4, SIZES(1, 2, 1))
    assert str(pl.embed_sum.codec) == "int8" and str(pl.block_exit.at(0)) == "ae:dim=8:rest=int8"
    assert pl.ae_grad_sum.exists and not messages.plan(
        jpolicy.preset("hybrid"), 4, SIZES(1, 2, 1)).ae_grad_sum.exists


def _coded_axes(pol, shape, remat=False):
    """(axes the compiled train step sends coded (integer) payloads over, axes it
    sends anything over) for the tiny model on this mesh."""
    mesh = jmesh.make_mesh(shape)
    tx = hyperparams.make_tx(lr=1e-3, warmup_steps=0, total_steps=10)
    shapes = jax.eval_shape(lambda: gpt.init_params(CFG, jax.random.key(0)))
    pl = messages.plan(pol, CFG.n_layers, dict(mesh.shape))
    layout = zero.for_plan(pl)
    state = step.abstract_state(shapes, mesh, tx, layout)
    batch = jax.ShapeDtypeStruct((16, 9), np.int32, sharding=NamedSharding(mesh, sharding.BATCH_SPEC))
    fn = step.make_train_step(CFG, mesh, pl, tx, shapes, layout=layout, microbatches=2,
                              clip_norm=1.0, remat=remat)
    report = wire.measure_compiled(fn.lower(state, batch).compile(), mesh)
    coded = {a for c in report.collectives for a in c.axes if _is_coded(c)}
    return pl, coded, {a for c in report.collectives for a in c.axes}, report


def _is_coded(c) -> bool:
    return any(not dt.startswith(("f", "bf", "pred")) for dt, _, _ in c.parts)


@pytest.mark.parametrize("overrides, shape, remat", [
    ({"data.grad": "int8", "tensor.act": "int8", "pipeline.act_grad": "int8"}, (2, 2, 2), False),
    ({"pipeline.act": "int8"}, (2, 2, 2), False),
    ({"data.grad": "int8", "tensor.act_grad": "int8", "pipeline.act": "int8"}, (8, 1, 1), False),
    # Remat recomputes the forward sends in the backward pass: they stay forward messages.
    ({"tensor.act": "int8", "pipeline.act": "int8"}, (1, 2, 4), True),
])
@pytest.mark.slow
def test_compressed_messages_in_the_plan_are_the_coded_collectives_of_the_program(
        overrides, shape, remat):
    """The plan's compressed messages, by axis, are exactly the axes whose
    compiled collectives carry integer payloads; on (8, 1, 1) it lists data
    messages only, and the program sends over data only."""
    pol = jpolicy.preset("baseline").replace(overrides)
    pl, coded, sent, report = _coded_axes(pol, shape, remat)
    assert coded == {m.axis for m in pl.messages() if m.compressed()}
    assert sent == {m.axis for m in pl.messages()} | {
        a for a, n in zip(jpolicy.AXES, shape) if n > 1}
    listed = {e.split("=")[0].split(".")[0] for e in pl.describe().split()}
    assert listed == coded
    # By message: the meter attributes each collective to the plan's message it
    # was sent under (wire.message_scope). Every coded collective belongs to a
    # compressed message of the plan, over that message's axis; every compressed
    # message has coded collectives; an attributed collective names a message
    # that exists. (A collective over no axis, a size-1 group, moves nothing; XLA
    # keeps some, as a message that does not exist would have sent them.)
    by_name = {m.name: m for m in pl.messages()}
    for c in (c for c in report.collectives if c.axes):
        if c.message:
            assert c.message in by_name and c.axes == (by_name[c.message].axis,), (c, by_name)
        if _is_coded(c):
            assert c.message and by_name[c.message].compressed(), (c, report.table())
    carried = {c.message for c in report.collectives if _is_coded(c)}
    assert carried == {m.name for m in pl.messages() if m.compressed()}, report.table()
    moving = wire.WireReport([c for c in report.collectives if c.axes])
    assert set(moving.by_message()) - {""} <= set(by_name)
