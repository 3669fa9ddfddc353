"""Parameters of a test repeated across variants that exercise the same code (isolation modes, loss types): the
variant a run on this machine takes runs in every suite, the others carry the ``variant`` marker, which
``make test`` runs and ``make test-fast`` (the inner loop) leaves out."""

import pytest


def each(variants, first=None):
    """``variants`` as ``pytest.mark.parametrize`` values: ``first`` (default: the first of ``variants``, e.g. the
    strongest isolation mode that works here, which :func:`rewards.sandbox.isolation` picks) plain, every other one
    marked ``variant``."""
    first = variants[0] if first is None and variants else first
    return [v if v == first else pytest.param(v, marks=pytest.mark.variant) for v in variants]
