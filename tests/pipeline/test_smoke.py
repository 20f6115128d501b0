"""`nanprobe smoke` for CI and assert_trains_finite for users' test suites."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET

import pytest
from typer.testing import CliRunner

from conftest import asset, example
from nanprobe import diagnose, smoke
from nanprobe.surface.cli import app
from nanprobe.testing import assert_trains_finite

runner = CliRunner()


@pytest.mark.parametrize("name", ["healthy_mlp.py", "healthy_transformer.py"])
def test_smoke_healthy_exits_0_with_valid_junit(tmp_path, name):
    junit = tmp_path / "smoke.xml"
    result = runner.invoke(app, ["smoke", example(name) + ":target", "--steps", "8", "--junit", str(junit),
                                 "--capsule-dir", str(tmp_path / "caps")])
    assert result.exit_code == 0, result.output
    root = ET.parse(junit).getroot()
    assert root.tag == "testsuites" and root.get("failures") == "0"
    cases = root.findall(".//testcase")
    assert cases and not root.findall(".//failure")


def test_smoke_broken_exits_1_with_diagnosis_junit_and_capsule(tmp_path):
    junit = tmp_path / "smoke.xml"
    out = tmp_path / "smoke.json"
    caps = tmp_path / "caps"
    result = runner.invoke(app, ["smoke", example("div_l2norm_no_eps.py") + ":target", "--steps", "6",
                                 "--junit", str(junit), "--json", str(out), "--capsule-dir", str(caps)])
    assert result.exit_code == 1, result.output
    data = json.loads(out.read_text())
    assert data["command"] == "smoke" and data["step"] == 3
    assert data["findings"][0]["cause"] == "div" and data["findings"][0]["module"] == "normalize"
    assert data["smoke"]["steps_run"] == 4 and data["smoke"]["capsule"]
    root = ET.parse(junit).getroot()
    failures = root.findall(".//failure")
    assert root.get("failures") == "1" and len(failures) == 1
    assert "div" in failures[0].get("message") and "normalize" in failures[0].get("message")
    assert list(caps.glob("*.capsule.pt"))


def test_assert_trains_finite_passes_and_fails(tmp_path):
    assert assert_trains_finite(example("healthy_mlp.py") + ":target", steps=5).healthy
    with pytest.raises(AssertionError) as info:
        assert_trains_finite(example("sqrt_grad_at_zero.py") + ":target", steps=6)
    text = str(info.value)
    assert "sqrt" in text and "distance" in text


def test_smoke_bad_entry_exits_2_and_still_writes_junit(tmp_path):
    junit = tmp_path / "smoke.xml"
    result = runner.invoke(app, ["smoke", asset("tiny.py") + ":returns_none", "--steps", "3", "--junit", str(junit)])
    assert result.exit_code == 2
    root = ET.parse(junit).getroot()
    assert root.findall(".//error") or root.findall(".//failure")


def test_smoke_steps_must_be_positive():
    result = runner.invoke(app, ["smoke", asset("tiny.py") + ":target", "--steps", "0"])
    assert result.exit_code == 2 and "Traceback" not in result.output


def test_smoke_function_api(tmp_path):
    result = smoke(example("healthy_mlp.py") + ":target", steps=4, capsule_dir=tmp_path)
    assert result.exit_code == 0 and result.steps_run == 4


def test_smoke_spike_fails_the_spike_check(tmp_path):
    junit = tmp_path / "smoke.xml"
    result = runner.invoke(app, ["smoke", asset("guard_nan.py") + ":spike", "--steps", "16", "--junit", str(junit),
                                 "--capsule-dir", str(tmp_path)])
    assert result.exit_code == 1, result.output
    root = ET.parse(junit).getroot()
    (case,) = [c for c in root.findall(".//testcase") if c.find("failure") is not None]
    assert case.get("name").startswith("spike:")
    assert case.find("failure").get("message").startswith("step 14: loss/gradient spike")


def test_smoke_update_that_corrupts_weights_is_diagnosed_and_capsuled(tmp_path):
    """Finite gradients, non-finite weights after the update: smoke rebuilds the state before the
    update from its rolling snapshot, names the update, and its capsule replays that step."""
    entry = example("adam_eps_zero.py") + ":target"
    result = smoke(entry, steps=6, capsule_dir=tmp_path)
    assert result.exit_code == 1
    top = result.report.top
    assert (result.report.step, top.phase.value, top.module) == (0, "update", "embed")
    assert result.capsule is not None and result.report.fidelity.reproduced is True
    again = diagnose(entry, capsule=result.capsule)
    assert (again.step, again.top.cause, again.top.phase, again.top.module) == \
        (0, top.cause, top.phase, top.module)


def test_smoke_fp16_grad_scaler_target_is_healthy(tmp_path):
    result = smoke(asset("guard_nan.py") + ":fp16_scaler", steps=10, capsule_dir=tmp_path)
    assert result.exit_code == 0 and result.report.precision == "fp16"
    assert not list(tmp_path.iterdir())


def test_assert_trains_finite_takes_a_function_and_names_the_step():
    import importlib.util
    spec = importlib.util.spec_from_file_location("guard_nan_for_test", asset("guard_nan.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert assert_trains_finite(mod.healthy, steps=5).steps_run == 5
    with pytest.raises(AssertionError, match=r"step 4: non-finite values born in forward at norm"):
        assert_trains_finite(mod.target, steps=8)
