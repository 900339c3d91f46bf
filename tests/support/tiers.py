"""The default run proves each behaviour once; the other points of a parametrized test go to the `slow` tier (README:
Tests), where `-m slow` or `-m ""` runs them."""

import pytest


def slow_but(points: list, keep: list, ids=None) -> list:
    """`points` as pytest params, each marked `slow` unless it is one of `keep`; `ids` names them (a function of the
    point, as in parametrize)."""
    params = []
    for point in points:
        values = point if isinstance(point, tuple) else (point,)
        marks = () if point in keep else pytest.mark.slow
        params.append(pytest.param(*values, marks=marks, id=ids(point) if ids else None))
    return params
