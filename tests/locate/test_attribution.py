"""Attribution that holds for what each op really did: fused/foreach optimizer steps name the parameter
whose update went non-finite and the state that did it."""

from __future__ import annotations

import pytest

from conftest import assert_one_story, example
from nanprobe.pipeline.diagnose import diagnose_target
from nanprobe.reach.entry import load_target

STATE = {"adamw": "exp_avg_sq", "adam": "exp_avg_sq", "adagrad": "sum", "rmsprop": "square_avg",
         "nadam": "exp_avg_sq", "adamax": "exp_inf", "adadelta": "square_avg"}


# not RAdam: with eps=0 its foreach step makes -inf in a head.weight temporary before the embedding's NaN
# (reported as that, "the update divided by zero"); what that -inf means is not checked here
@pytest.mark.parametrize("optimizer", ["adamw-fused", "adamw-foreach", "adam-fused", "adam-foreach",
                                       "adagrad-fused", "adagrad-foreach", "rmsprop-foreach", "nadam-foreach",
                                       "adamax-foreach", "adadelta-foreach"])
def test_fused_and_foreach_update_names_the_parameter_that_went_nan(optimizer):
    loaded = load_target(example("adamw_fused_eps_zero.py") + ":target", config={"optimizer": optimizer})
    report = diagnose_target(loaded)
    top, origin = report.top, report.origin
    assert_one_story(report)
    assert report.step == 0
    # head.weight is the first tensor of every list the fused/foreach op takes; embed.weight went NaN
    assert (origin.phase.value, origin.parameter, origin.module) == ("update", "embed.weight", "embed")
    assert (top.cause.value, top.phase.value, top.module) == ("div", "update", "embed")
    lines = "\n".join(top.evidence)
    assert "parameter embed.weight" in lines and "eps 0" in lines
    # the state read is the NaN parameter's own: 848 of its 1600 second-moment entries are 0 (rows not in batch 0)
    assert f"{STATE[optimizer.split('-')[0]]}: 848 of 1600 entries are 0" in lines
    assert "head" not in lines


def test_std_over_a_single_sample_is_a_div_with_a_data_finding():
    report = diagnose_target(load_target(example("std_single_sample_batch.py") + ":target"))
    top = report.top
    assert_one_story(report)
    assert report.step == 4   # 65 rows in batches of 16: the fifth batch holds one row
    assert (report.origin.phase.value, report.origin.module, report.origin.op) == ("forward", "whiten",
                                                                                   "aten.std.correction")
    assert (top.cause.value, top.phase.value, top.module) == ("div", "forward", "whiten")
    assert any("N - 1 = 0" in line for line in top.evidence)
    data = [f for f in report.findings if f.cause.value == "data"]
    assert data and "the batch holds 1 sample(s)" in data[0].evidence[0]
    assert any("drop_last=True" in fix.code for fix in top.fixes)


def test_layernorm_fed_an_extreme_row_is_an_overflow_not_a_division():
    pytest.importorskip("transformers")
    report = diagnose_target(load_target(example("gpt2_layernorm_extreme_row.py") + ":target"))
    top = report.top
    assert_one_story(report)
    assert report.step == 2
    assert (top.cause.value, top.phase.value, top.module) == ("overflow", "forward", "transformer.h.0.ln_1")
    assert report.origin.samples == (1,)
    lines = "\n".join(top.evidence)
    assert "1e+38" in lines and "division" not in lines and top.fixes


def test_lr_evidence_reads_the_param_group_that_owns_the_module():
    report = diagnose_target(load_target(example("lora_adapter_lr_typo.py") + ":target"))
    top = report.top
    assert_one_story(report)
    assert (top.cause.value, top.phase.value, top.module) == ("lr_spike", "update", "body.0")
    lines = "\n".join(top.evidence)
    assert "learning rate 1e+03 in param group 1 of 2" in lines and "largest relative update: body.0.lora_" in lines
    assert "learning rate 0.001, constant" not in lines   # the first group's LR does not speak for the adapters
    assert 'param_groups[1]["lr"]' in top.fixes[0].code
