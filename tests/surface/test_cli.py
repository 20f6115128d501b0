"""The CLI contract: every bad input exits 2 with one line and no traceback."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from conftest import asset, output_lines
from nanprobe.surface.cli import app

runner = CliRunner()


def invoke(*args):
    return runner.invoke(app, list(args))


def _one_error_line(result) -> str:
    text = result.output.strip()
    assert "Traceback" not in text
    lines = output_lines(text)
    assert len(lines) == 1, text
    assert lines[0].startswith("nanprobe: error: ")
    return lines[0]


@pytest.mark.parametrize("args, fragment", [
    (["run", "nope.py:target"], "file 'nope.py' not found"),
    (["run", "no_colon"], "names no function"),
    (["run", asset("tiny.py") + ":missing"], "no function 'missing'"),
    (["run", asset("syntax_error.py") + ":target"], "syntax_error.py:1"),
    (["run", asset("import_error.py") + ":target"], "ModuleNotFoundError"),
    (["run", asset("tiny.py") + ":raises"], "KeyError"),
    (["run", asset("tiny.py") + ":returns_none"], "not a nanprobe.Target or dict"),
    (["run", asset("tiny.py") + ":no_model"], "returned no 'model'"),
    (["run", asset("tiny.py") + ":loss_not_scalar"], "not a scalar"),
    (["run", asset("tiny.py") + ":loss_not_tensor"], "not a tensor"),
    (["run", asset("tiny.py") + ":loss_detached"], "does not require grad"),
    (["run", asset("tiny.py") + ":loss_raises"], "RuntimeError"),
    (["run", asset("tiny.py") + ":target", "--precision", "fp8"], "unknown precision 'fp8'"),
    (["run", asset("tiny.py") + ":target", "--at", "-1"], "negative"),
    (["run", asset("tiny.py") + ":target", "--at", "99"], "batches ran out at step 5"),
    (["run", asset("tiny.py") + ":target", "--autocast-policy", "tpu"], "unknown autocast policy 'tpu'"),
    (["run", asset("tiny.py") + ":target", "--device", "nope:x"], "unknown device 'nope:x'"),
])
def test_bad_input_exits_2_with_one_line(args, fragment):
    result = invoke(*args)
    assert result.exit_code == 2, result.output
    assert fragment in _one_error_line(result)


def test_user_error_names_their_line():
    line = _one_error_line(invoke("run", asset("tiny.py") + ":loss_raises"))
    assert "tiny.py:" in line and "loss_fn(model, batch)" in line


def test_bad_config_reports_every_problem(tmp_path):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("replay:\n  max_steps: -3\n  nope: 1\nrun:\n  reference: fp8\n")
    line = _one_error_line(invoke("run", asset("tiny.py") + ":target", "--config", str(cfg)))
    assert "replay.max_steps" in line and "replay.nope" in line and "run.reference" in line


def test_json_refuses_to_overwrite_a_source_file(tmp_path):
    src = tmp_path / "train.py"
    src.write_text("x = 1\n")
    result = invoke("run", asset("tiny.py") + ":target", "--json", str(src))
    assert result.exit_code == 2
    assert src.read_text() == "x = 1\n"


def test_debug_shows_traceback():
    result = invoke("run", asset("tiny.py") + ":raises", "--debug")
    assert result.exit_code == 2
    assert "Traceback" in result.output


def test_healthy_run_exits_0_and_json_to_stdout():
    result = invoke("run", asset("tiny.py") + ":target", "--json", "-")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["status"] == "finite" and data["findings"] == [] and data["schema"] == 1


def test_internal_error_exits_3(monkeypatch):
    import importlib

    diagnose_mod = importlib.import_module("nanprobe.pipeline.diagnose")  # the module, not the exported function

    def boom(*a, **k):
        raise ZeroDivisionError("synthetic")

    monkeypatch.setattr(diagnose_mod, "diagnose", boom)
    result = invoke("run", asset("tiny.py") + ":target")
    assert result.exit_code == 3
    assert "internal error: ZeroDivisionError" in result.output and "report" in result.output


def test_help_lists_commands():
    result = invoke("--help")
    assert result.exit_code == 0
    assert "run" in result.output


def test_version():
    result = invoke("--version")
    assert result.exit_code == 0 and "nanprobe" in result.output
