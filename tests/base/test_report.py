"""Report -> JSON (schema 1) and exit codes."""

from __future__ import annotations

import json

from nanprobe.base.report import (Cause, Finding, Fix, Mechanism, Origin, Phase, PrecisionResult, Report, Status,
                             StepRecord)


def _report(status=Status.NONFINITE):
    origin = Origin(phase=Phase.FORWARD, module="blocks.1.attn", op="aten.bmm.default", precision="fp16",
                    source="model.py:42", kind="+inf", samples=(3,))
    finding = Finding(cause=Cause.OVERFLOW, confidence=0.934, phase=Phase.FORWARD, module="blocks.1.attn",
                      op="aten.bmm.default", evidence=("fp32 value reaches 1.2e5 > 65504",),
                      fixes=(Fix(title="bf16", code="...", verified=True),))
    return Report(command="run", entry="train.py:target", step=7, status=status, device="cpu", precision="fp16",
                  origin=origin, findings=(finding,),
                  precisions={"fp16": PrecisionResult(precision="fp16", loss=float("nan"), finite=False, origin=origin),
                              "fp32": PrecisionResult(precision="fp32", loss=2.5, finite=True)},
                  history=(StepRecord(step=6, loss=2.4, grad_norm=float("inf"), lr=1e-3, update_ratio=0.01,
                                      finite=True, skipped=True, scale=1024.0),))


def test_json_matches_design_contract():
    data = json.loads(_report().dumps())
    assert {"schema", "nanprobe", "command", "entry", "step", "status", "device", "precision", "origin", "findings",
            "precisions"} <= set(data)
    assert data["schema"] == 1 and data["status"] == "nonfinite"
    assert data["origin"] == {"phase": "forward", "module": "blocks.1.attn", "op": "aten.bmm.default",
                              "precision": "fp16", "source": "model.py:42", "kind": "+inf", "samples": [3]}
    f = data["findings"][0]
    assert (f["cause"], f["confidence"], f["phase"], f["module"]) == ("overflow", 0.934, "forward", "blocks.1.attn")
    assert f["fixes"][0] == {"title": "bf16", "code": "...", "verified": True}
    assert data["precisions"]["fp16"]["loss"] == "nan"       # NaN/Inf as strings: the file stays valid JSON
    assert data["history"][0]["grad_norm"] == "inf"
    assert data["precisions"]["fp32"]["origin"] is None


def test_exit_codes_follow_status():
    statuses = (Status.FINITE, Status.NONFINITE, Status.SPIKE, Status.DIVERGING, Status.ERROR)
    assert [_report(s).exit_code for s in statuses] == [0, 1, 1, 1, 2]


def test_cause_codes_are_the_stable_set():
    assert [c.value for c in Cause] == ["data", "overflow", "underflow", "log", "sqrt", "div", "domain", "lr_spike",
                                       "not_reproduced", "unknown"]


def test_mechanism_codes_are_the_stable_set():
    assert [m.value for m in Mechanism] == ["attention_logit_growth", "output_logit_divergence", "adam_second_moment",
                                           "lr_schedule", "loss_scale_collapse", "activation_growth"]
