"""Tests for jcomp.meter.groups: XLA's three forms of replica groups read into
device-id tuples, and unreadable forms refused naming replica_groups."""
import pytest

from jcomp.meter import groups


def test_iota_groups_plain_and_transposed():
    assert groups.parse_replica_groups("[2,4]<=[8]") == [(0, 1, 2, 3), (4, 5, 6, 7)]
    # iota(8) as [[0,1,2,3],[4,5,6,7]], transposed: columns become groups
    assert groups.parse_replica_groups("[4,2]<=[2,4]T(1,0)") == [(0, 4), (1, 5), (2, 6), (3, 7)]
    # element (a,b,c) = 4a+2b+c; after T(2,1,0) rows run over c, then b, then a
    assert groups.parse_replica_groups("[2,4]<=[2,2,2]T(2,1,0)") == [(0, 4, 2, 6), (1, 5, 3, 7)]


def test_explicit_and_empty_groups():
    assert groups.parse_replica_groups("{{0,4},{1,5}}") == [(0, 4), (1, 5)]
    assert groups.parse_replica_groups("{}", num_devices=4) == [(0, 1, 2, 3)]


def test_mesh_form_groups():
    # no device_ids: the devices are iota(8) laid out as [2,1,4]; group over axis_0
    assert groups.parse_replica_groups("mesh['axis_0'=2,'axis_1'=1,'axis_2'=4] {'axis_0'}") == [
        (0, 4), (1, 5), (2, 6), (3, 7)]
    # device_ids [2,2,2]T(1,0,2): element (i,j,k) is 4j+2i+k, flattened [0,1,4,5,2,3,6,7];
    # on [2,1,4] the pairs differing only in axis_0 are (0,2),(1,3),(4,6),(5,7)
    assert groups.parse_replica_groups(
        "mesh['axis_0'=2,'axis_1'=1,'axis_2'=4], device_ids=([2,2,2]T(1,0,2)) {'axis_0'}") == [
        (0, 2), (1, 3), (4, 6), (5, 7)]
    # device_ids [2,2,2]T(0,2,1) flattened: [0,2,1,3,4,6,5,7]; on [4,1,2] axis_0 runs down columns
    assert groups.parse_replica_groups(
        "mesh['axis_0'=4,'axis_1'=1,'axis_2'=2], device_ids=([2,2,2]T(0,2,1)) {'axis_0'}") == [
        (0, 1, 4, 5), (2, 3, 6, 7)]
    # names may come unquoted; grouping over every axis gives one group
    assert groups.parse_replica_groups("mesh[a=2,b=4] {a,b}") == [tuple(range(8))]


@pytest.mark.parametrize("text", ["mesh['axis_0'=8] {'axis_0':(1)2}", "mesh['a'=2,'b'=2] {'c'}",
                                  "mesh['a'=2,'b'=2], device_ids=(0,2,1,3) {'a'}",
                                  "maximal_mesh[device_id=0]", "[3,2]<=[8]",
                                  "[4,2]<=[2,4]T(0,0)", "{{0,a}}"])
def test_unrecognised_groups_raise(text):
    with pytest.raises(ValueError, match="replica_groups"):
        groups.parse_replica_groups(text)
