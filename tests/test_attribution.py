"""Attribution that holds for what each op really did: fused/foreach optimizer steps name the parameter
whose update went non-finite and the state that did it."""

from __future__ import annotations

import pytest

from conftest import example
from nanprobe.diagnose import diagnose_target
from nanprobe.entry import load_target

STATE = {"adamw": "exp_avg_sq", "adam": "exp_avg_sq", "adagrad": "sum", "rmsprop": "square_avg"}


@pytest.mark.parametrize("optimizer", ["adamw-fused", "adamw-foreach", "adam-fused", "adam-foreach",
                                       "adagrad-fused", "adagrad-foreach", "rmsprop-foreach"])
def test_fused_and_foreach_update_names_the_parameter_that_went_nan(optimizer):
    loaded = load_target(example("adamw_fused_eps_zero.py") + ":target", config={"optimizer": optimizer})
    report = diagnose_target(loaded)
    top, origin = report.top, report.origin
    assert report.step == 0
    # head.weight is the first tensor of every list the fused/foreach op takes; embed.weight went NaN
    assert (origin.phase.value, origin.parameter, origin.module) == ("update", "embed.weight", "embed")
    assert (top.cause.value, top.phase.value, top.module) == ("div", "update", "embed")
    lines = "\n".join(top.evidence)
    assert "parameter embed.weight" in lines and "eps 0" in lines
    # the state read is the NaN parameter's own: 848 of its 1600 second-moment entries are 0 (rows not in batch 0)
    assert f"{STATE[optimizer.split('-')[0]]}: 848 of 1600 entries are 0" in lines
    assert "head" not in lines
