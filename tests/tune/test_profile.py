"""jcomp.tune.profile: the figures a plan rests on, their checks and their JSON."""
import json
import math
import os

import pytest

from jcomp import tune
from jcomp.tune import CodecCost, Link, Profile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLE = os.path.join(ROOT, "configs", "profiles", "h100_8x_nvlink_400g.json")


def _profile():
    return Profile(links={"data": Link(2e-5, 4.5e11, "nvlink"), "dcn": Link(3e-5, 5e10)},
                   codecs={"int8": CodecCost(7e-13, 8e-13), "int4:rot": CodecCost(1.3e-12, 1.2e-12)},
                   device="test device", comment="made up")


def test_save_and_load_give_back_the_same_profile(tmp_path):
    prof = _profile()
    path = tmp_path / "p.json"
    tune.save(prof, path)
    back = tune.load(path)
    assert back == prof
    assert back.links["data"].comment == "nvlink"
    assert back.links["dcn"].bytes_per_s == 5e10
    assert back.codecs["int4:rot"].decode_s_per_byte == 1.2e-12
    # Plain JSON that a person can edit: the fields by name.
    data = json.loads(path.read_text())
    assert data["links"]["dcn"] == {"latency_s": 3e-5, "bytes_per_s": 5e10}
    assert Profile.from_dict(data) == prof


def test_codec_names_are_canonical_specs():
    prof = Profile(links={}, codecs={" INT4:Rot ": CodecCost(1e-12, 1e-12)}, device="d")
    assert list(prof.codecs) == ["int4:rot"]
    assert prof.codec("int4:rot") is prof.codecs["int4:rot"]
    assert prof.codec("none") is None
    assert CodecCost(1e-12, 3e-12).s_per_byte == pytest.approx(4e-12)


def test_link_seconds_is_latency_per_collective_plus_bytes_over_bandwidth():
    assert Link(1e-3, 1e6).seconds(5e6, 4) == pytest.approx(4 * 1e-3 + 5.0)


@pytest.mark.parametrize("make, field", [
    (lambda: Link(1e-5, 0.0), "bytes_per_s"),
    (lambda: Link(1e-5, -1e9), "bytes_per_s"),
    (lambda: Link(1e-5, math.inf), "bytes_per_s"),
    (lambda: Link(-1e-5, 1e9), "latency_s"),
    (lambda: Link(math.nan, 1e9), "latency_s"),
    (lambda: CodecCost(math.nan, 1e-12), "encode_s_per_byte"),
    (lambda: CodecCost(1e-12, -1e-12), "decode_s_per_byte"),
])
def test_bad_figures_are_refused_naming_the_field(make, field):
    with pytest.raises(ValueError, match=field):
        make()


@pytest.mark.parametrize("make, field, allowed", [
    (lambda: Link(1e-5, 5e-324), "Link.bytes_per_s", "[1000, 1e+15]"),
    (lambda: Link(1e-5, 2e15), "Link.bytes_per_s", "[1000, 1e+15]"),
    (lambda: Link(1e308, 1e9), "Link.latency_s", "[0, 60]"),
    (lambda: CodecCost(1e308, 1e-12), "CodecCost.encode_s_per_byte", "[0, 0.001]"),
    (lambda: CodecCost(1e-12, 1.0), "CodecCost.decode_s_per_byte", "[0, 0.001]"),
])
def test_finite_but_absurd_figures_are_refused_naming_the_field_and_range(make, field, allowed):
    """Finite figures no link or codec can have would price a step at inf or nan."""
    with pytest.raises(ValueError) as e:
        make()
    assert str(e.value).startswith(f"{field} must be a number in {allowed}"), str(e.value)


def test_a_profile_file_with_absurd_figures_is_refused_on_load(tmp_path):
    path = tmp_path / "p.json"
    path.write_text('{"device": "d", "links": {"data": {"latency_s": 1e308, '
                    '"bytes_per_s": 5e-324}}, "codecs": {}}')
    with pytest.raises(ValueError, match=r"^profile.links\['data'\]: Link.latency_s must be"):
        tune.load(path)


def test_the_bounds_admit_every_real_link_and_codec():
    Link(0.0, 1e3), Link(60.0, 1e15), CodecCost(0.0, 1e-3)


def test_a_figure_that_is_no_number_is_a_type_error():
    with pytest.raises(TypeError, match="bytes_per_s"):
        Link(1e-5, "fast")


@pytest.mark.parametrize("spec, words", [
    ("int3", "int3"),                      # no such codec
    ("powersgd:rank=4", "not a collective"),
    ("none", "none"),                      # raw costs nothing
])
def test_codecs_outside_what_a_collective_sends_with_are_refused(spec, words):
    with pytest.raises(ValueError, match=words) as e:
        Profile(links={}, codecs={spec: CodecCost(1e-12, 1e-12)}, device="d")
    assert "Profile.codecs" in str(e.value)


def test_one_codec_under_two_spellings_is_refused():
    with pytest.raises(ValueError, match="second time"):
        Profile(links={}, codecs={"int8": CodecCost(1e-12, 1e-12),
                                  "INT8": CodecCost(2e-12, 1e-12)}, device="d")


def test_from_dict_names_unknown_missing_and_bad_fields():
    good = _profile().to_dict()
    with pytest.raises(ValueError, match="bandwidth"):
        Profile.from_dict({**good, "bandwidth": 1})
    with pytest.raises(ValueError, match="device"):
        Profile.from_dict({k: v for k, v in good.items() if k != "device"})
    bad_link = {**good, "links": {"data": {"latency_s": 1e-5, "bytes_per_s": 0}}}
    with pytest.raises(ValueError, match=r"links\['data'\].*bytes_per_s"):
        Profile.from_dict(bad_link)
    typo = {**good, "codecs": {"int8": {"encode_s_per_byte": 1e-12, "decode_s": 1e-12}}}
    with pytest.raises(ValueError, match="decode_s"):
        Profile.from_dict(typo)


def test_json_nan_and_infinity_are_refused(tmp_path):
    path = tmp_path / "p.json"
    path.write_text('{"device": "d", "links": {"data": {"latency_s": NaN, "bytes_per_s": 1e9}},'
                    ' "codecs": {}}')
    with pytest.raises(ValueError, match="NaN"):
        tune.load(path)
    path.write_text('{"device": "d", "links": {"data": {"latency_s": 0, "bytes_per_s": Infinity}},'
                    ' "codecs": {}}')
    with pytest.raises(ValueError, match="Infinity"):
        tune.load(path)


def test_a_missing_link_or_codec_cost_is_named():
    prof = _profile()
    with pytest.raises(ValueError, match="'tensor'"):
        prof.link("tensor")
    with pytest.raises(ValueError, match="'bf16'"):
        prof.codec("bf16")


def test_the_example_h100_profile_loads_and_plans_with_the_default_ladders():
    prof = tune.load(EXAMPLE)
    assert prof.comment and prof.device
    intra, inter = prof.links["tensor"], prof.links["dcn"]
    # NVLink 4 (450 GB/s) inside a node (tensor, innermost in configs/neox20b.py's
    # layout), one 400 Gbit/s NIC per GPU between nodes (data, pipeline, dcn).
    assert intra.bytes_per_s == 450e9
    assert inter.bytes_per_s == 400e9 / 8
    for axis in ("data", "pipeline"):
        link = prof.links[axis]
        assert (link.latency_s, link.bytes_per_s) == (inter.latency_s, inter.bytes_per_s), axis
    assert inter.latency_s >= intra.latency_s
    # Every codec of the default ladders has a cost, each a pass over HBM3
    # (3.35 TB/s) at half of peak or slower: never faster than memory allows.
    ladder_codecs = {c for ladder in tune.DEFAULT_LADDERS.values() for c in ladder} - {"none"}
    assert ladder_codecs <= set(prof.codecs)
    for cost in prof.codecs.values():
        assert cost.encode_s_per_byte >= 1 / 3.35e12 and cost.decode_s_per_byte >= 1 / 3.35e12
