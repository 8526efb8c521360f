"""Fixtures of the windowed DMR tests (``_windowed``): its batches and the fault-free parameters every run must end
bitwise equal to. Test modules with a trainer of another configuration define their own ``batches`` (and ``clean``),
which take precedence here."""

import pytest

from tests.sdc.dmr._windowed import clean_params, small_batches


@pytest.fixture(scope="module")
def batches():
    return small_batches()


@pytest.fixture(scope="module")
def clean(batches):
    return clean_params(batches)
