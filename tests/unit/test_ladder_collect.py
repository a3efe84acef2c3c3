"""The ladder's report names what its points trained under (dsslm/ladder_collect.py)."""
from __future__ import annotations

import pytest

from dsslm.ladder_collect import parametrisation, report


@pytest.mark.parametrize("width, depth, said", [
    (0, 0, "standard parametrisation"),
    (64, 0, "muP (model.mup_base_width=64)"),
    (64, 2, "muP (model.mup_base_width=64, model.mup_base_depth=2)"),
    # The depth rule alone changes every residual branch and hidden rate: it is not SP.
    (0, 2, "depth-muP (model.mup_base_depth=2)"),
])
def test_the_report_names_the_width_and_the_depth_rule(width, depth, said):
    rules = {"n_heads": 4, "mup_base_width": width, "mup_base_depth": depth}
    assert parametrisation(rules) == said
    first = report({"rules": rules}, [], [], [], {"points": 0}).splitlines()[0]
    assert first == f"ladder: 0 points, {said}, model.n_heads=4; ", first
