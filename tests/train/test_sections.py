"""jcomp.train.settings.sections: the config's plain sections, each read once
into a frozen value beside its checks."""
import dataclasses

import pytest

from jcomp.train.settings import sections
from tests.train.tinyconfig import tiny_config


def test_profile_steps_spec():
    assert sections.profile_steps("", 10) is None
    assert sections.profile_steps("3-5", 10) == (3, 5)
    assert sections.profile_steps("4-4", 4) == (4, 4)
    for bad in ("5", "5-3", "0-2", "2-11", "a-b", "1-2-3", "-3"):
        with pytest.raises(ValueError, match="train.profile_steps"):
            sections.profile_steps(bad, 10)


def test_the_sections_are_frozen_values_read_from_the_config():
    s = sections.read(tiny_config(**{"train.steps": 7, "train.profile_steps": "2-3"}), 8)
    assert s.train.steps == 7 and s.train.profile_steps == (2, 3)
    assert s.shape == (2, 2, 2) and s.dcn_data == 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.train.steps = 8  # type: ignore[misc]
