"""The long form of tests/collectives/test_rows.py: row-locality for every other
codec, at the suite's row lengths, at configs/base.py's d_model and in flat
buckets (about 4 minutes on two cores)."""
import pytest

from tests.collectives import test_rows as rows
from tests.collectives.test_rows import mesh  # noqa: F401

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("codec", rows.LOSSY_LONG)
def test_lossy_codecs_keep_rows_apart(mesh, codec):  # noqa: F811
    rows.test_lossy_codecs_keep_rows_apart(mesh, codec)


@pytest.mark.parametrize("codec", rows.D128_LONG)
def test_default_blocks_keep_rows_apart_at_d128(mesh, codec):  # noqa: F811
    rows.test_default_blocks_keep_rows_apart_at_d128(mesh, codec)


@pytest.mark.parametrize("op", sorted(rows.FLAT_OPS))
@pytest.mark.parametrize("codec", rows.FLAT_CODECS_LONG)
def test_flat_bucket_leaves_do_not_mix(mesh, op, codec):  # noqa: F811
    rows.test_flat_bucket_leaves_do_not_mix(mesh, op, codec)
