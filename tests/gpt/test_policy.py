"""The policy table: presets, overrides, and where an entry compresses."""
import pytest

from jcomp import codecs

from jcomp.gpt import policy


def test_presets_follow_their_recipes():
    assert all(codecs.parse(c).kind == "identity" for _, _, c in policy.preset("baseline").table)
    paper = policy.preset("hybrid_paper")
    assert str(paper["data", "grad"]) == "int4" and paper.error_feedback
    assert {str(paper[a, k]) for a in ("tensor", "pipeline") for k in ("act", "act_grad")} == {"int8"}
    hybrid = policy.preset("hybrid")
    assert hybrid == policy.uniform("none").replace(policy.HYBRID) and not hybrid.error_feedback
    assert str(hybrid["data", "param"]) == "int8" and codecs.parse(hybrid["data", "grad"]).kind == "dense"
    assert {str(hybrid["tensor", k]) for k in ("act", "act_grad")} == {"int4:rot"}
    assert {str(hybrid["pipeline", k]) for k in ("act", "act_grad")} == {"int8"}
    naive = policy.preset("naive")
    assert {str(naive[a, k]) for a, k in policy.MESSAGES} == {"int4"} and naive.error_feedback
    with pytest.raises(ValueError, match="unknown policy preset 'fast'.*baseline, naive, hybrid"):
        policy.preset("fast")


@pytest.mark.parametrize("spec,want", [("4-7", (4, 5, 6, 7)), ("0-1, 6", (0, 1, 6)), ("3", (3,)),
                                       ([5, 1], (1, 5)), ("", None), (None, None)])
def test_parse_indices(spec, want):
    assert policy.parse_indices(spec, "layers") == want


@pytest.mark.parametrize("spec,match", [
    ("a-3", r"layers='a-3': items must be N or N-M"), ("-2", "items must be N or N-M"),
    ("5-2", "range 5-2 runs backwards"), ("1,1", "listed twice"), ([], "lists no index"),
    ([1, -1], "ints >= 0"), ([True], "ints >= 0")])
def test_parse_indices_rejects_bad_specs(spec, match):
    with pytest.raises(ValueError, match=match):
        policy.parse_indices(spec, "layers")
    with pytest.raises(TypeError, match="a string like '0-3,6' or a list of ints"):
        policy.parse_indices(3, "layers")


def test_format_indices_round_trips():
    for idx in [(0, 1, 2, 3, 6), (1,), (0, 2, 4), (3, 4, 5, 9, 10)]:
        assert policy.parse_indices(policy.format_indices(idx), "x") == idx
    assert policy.format_indices((0, 1, 2, 3, 6)) == "0-3,6"


def test_restrict_compresses_only_the_named_layers_and_stages():
    pol = policy.preset("hybrid_paper").restrict({"tensor.act": "4-7", "pipeline.act_grad": [1]})
    assert pol.where("tensor", "act") == (4, 5, 6, 7) and pol.where("tensor", "act_grad") is None
    assert [pol.compresses("tensor", "act", layer=i) for i in (3, 4, 7)] == [False, True, True]
    assert pol.compresses("tensor", "act_grad", layer=0)  # unrestricted: everywhere
    assert not pol.compresses("pipeline", "act_grad", stage=0)
    assert pol.compresses("pipeline", "act_grad", stage=1)
    with pytest.raises(ValueError, match="compresses in some layers only: pass layer="):
        pol.compresses("tensor", "act")
    # A codec of "none" compresses nowhere, selected or not.
    assert not policy.preset("baseline").restrict({"tensor.act": "0"}).compresses(
        "tensor", "act", layer=0)
    # "" lifts a restriction; replace (a schedule's phases) keeps it.
    assert pol.restrict({"tensor.act": ""}).where("tensor", "act") is None
    assert pol.replace({"data.grad": "int8"}).where("tensor", "act") == (4, 5, 6, 7)
    assert "act=int8[layers 4-7]" in str(pol) and "act_grad=int8[stages 1]" in str(pol)


@pytest.mark.parametrize("key,match", [
    ("data.grad", "only tensor.act, tensor.act_grad, pipeline.act, pipeline.act_grad can"),
    ("tensor.param", "only tensor.act"), ("model.act", "unknown mesh axis 'model'"),
    ("tensor.acts", "unknown message kind 'acts'")])
def test_restrict_rejects_entries_without_places(key, match):
    with pytest.raises(ValueError, match=match):
        policy.preset("hybrid").restrict({key: "0"})


def test_check_places_names_the_entry_and_the_range():
    pol = policy.preset("hybrid").restrict({"tensor.act": "6-8", "pipeline.act": "0"})
    pol.check_places(n_layers=9, n_stages=1)
    with pytest.raises(ValueError, match=r"layers.tensor.act=8: the model has 8 layers \(0..7\)"):
        pol.check_places(n_layers=8, n_stages=1)
    with pytest.raises(ValueError, match=r"stages.pipeline.act=2-3: the model has 2 stages"):
        policy.preset("hybrid").restrict({"pipeline.act": "0-3"}).check_places(8, 2)


UNSENT = [("data", "act"), ("data", "act_grad"), ("tensor", "param"), ("pipeline", "grad"),
          ("pipeline", "param")]


@pytest.mark.parametrize("axis,kind", UNSENT)
def test_entries_that_name_no_message_stay_none_and_refuse_a_codec(axis, kind):
    """Five of the twelve entries name no message of the step; presets leave them
    none and an override naming them is refused, so nothing reports compressing
    a message that does not exist."""
    assert (axis, kind) not in policy.MESSAGES
    for name in policy.PRESETS:
        assert str(policy.preset(name)[axis, kind]) == "none", name
    with pytest.raises(ValueError, match=f"no {kind} message over '{axis}'.*data.grad"):
        policy.preset("baseline").replace({f"{axis}.{kind}": "int8"})
    assert str(policy.preset("baseline").replace({f"{axis}.{kind}": "none"})[axis, kind]) == "none"
    assert len(policy.MESSAGES) + len(UNSENT) == len(policy.AXES) * len(policy.KINDS)


@pytest.mark.parametrize("key,spec,fits", [
    ("tensor.grad", "powersgd:rank=2", "data.grad"), ("pipeline.act", "powersgd:rank=2", "data.grad"),
    ("data.grad", "ae:dim=8", "tensor.act, tensor.act_grad"),
    ("pipeline.act", "ae:dim=8", "tensor.act, tensor.act_grad")])
def test_structured_codecs_stand_only_where_the_placement_table_says(key, spec, fits):
    """One table (policy.PLACEMENT) decides, for the policy and the schedule alike."""
    with pytest.raises(ValueError, match=rf"policy override '{key}'.*only \({fits}\)"):
        policy.preset("baseline").replace({key: spec})
    from jcomp.gpt import schedule
    with pytest.raises(ValueError, match=rf"schedule.{key}=.*only \({fits}\)"):
        schedule.parse({key: f"{spec}@3"})
    axis, kind = key.split(".")
    ok = [k for k, (entries, _) in policy.PLACEMENT.items() if (axis, kind) in entries]
    assert codecs.parse(spec).kind not in ok


# ------------------------------------------------------------- the slow hop

def test_dcn_entries_default_to_their_data_entries():
    """Unset, dcn.grad and dcn.param are the data entries; set, they stand apart,
    show in as_dict and str, and "" unsets them."""
    hybrid = policy.preset("hybrid")
    assert hybrid["dcn", "grad"] == hybrid["data", "grad"] and not hybrid.dcn
    assert "dcn" not in hybrid.as_dict() and "dcn" not in str(hybrid)
    split = hybrid.replace({"data.grad": "none", "dcn.grad": "int4"})
    assert str(split["dcn", "grad"]) == "int4" and str(split["data", "grad"]) == "none"
    assert split["dcn", "param"] == hybrid["data", "param"]
    assert split.as_dict()["dcn"] == {"grad": "int4"} and "dcn: grad=int4" in str(split)
    assert split.compresses("dcn", "grad") and split.where("dcn", "grad") is None
    assert split.replace({"dcn.grad": ""}) == hybrid.replace({"data.grad": "none"})


@pytest.mark.parametrize("key,spec,match", [
    ("dcn.act", "int8", r"'dcn.act'.*slow hop sends no act message.*dcn.grad, dcn.param"),
    ("dcn.grad", "powersgd:rank=2", r"'dcn.grad'.*cannot code the slow hop"),
    ("dcn.param", "ae:dim=8", r"'dcn.param'.*only \(tensor.act, tensor.act_grad\)"),
    ("dcn.grad", "int3", r"'dcn.grad'")])
def test_bad_dcn_entries_are_refused_by_name(key, spec, match):
    with pytest.raises(ValueError, match=match):
        policy.preset("baseline").replace({key: spec})
