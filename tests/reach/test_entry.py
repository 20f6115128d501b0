"""ENTRY loading and Target validation, without the CLI."""

from __future__ import annotations

import sys

import pytest
import torch

from conftest import ASSETS, asset
from nanprobe.reach.entry import load_target, split_entry
from nanprobe.base.errors import EntryError, TargetError, UserCodeError
from nanprobe.base.precision import Precision
from nanprobe.reach.target import Target, validate


def test_file_entry_returns_validated_target():
    loaded = load_target(asset("tiny.py") + ":target")
    assert isinstance(loaded.target, Target)
    assert loaded.target.precision is Precision.FP32
    assert loaded.function == "target"
    assert loaded.path.endswith("tiny.py") and loaded.lineno is not None


def test_package_entry(monkeypatch):
    monkeypatch.syspath_prepend(str(ASSETS / "pkgentry"))
    loaded = load_target("mypkg.train:target")
    assert loaded.module == "mypkg.train"
    assert isinstance(loaded.target.model, torch.nn.Linear)


def test_config_dict_is_passed_when_accepted():
    loaded = load_target(asset("tiny.py") + ":with_config", config={"clip": 2.5})
    assert loaded.target.max_grad_norm == 2.5


def test_callable_batches_accepted():
    assert callable(load_target(asset("tiny.py") + ":callable_batches").target.batches)


@pytest.mark.parametrize("entry, fragment", [
    ("no_colon.py", "names no function"),
    ("x.py:1bad", "not a Python name"),
    ("missing_dir/missing.py:target", "not found"),
    ("no_such_pkg_xyz.mod:target", "module 'no_such_pkg_xyz.mod' not found"),
])
def test_entry_errors(entry, fragment):
    with pytest.raises(EntryError) as info:
        load_target(entry)
    assert fragment in info.value.message
    assert info.value.exit_code == 2


def test_missing_function_lists_candidates():
    with pytest.raises(EntryError) as info:
        load_target(asset("tiny.py") + ":nope")
    assert "no function 'nope'" in info.value.message
    assert "target" in info.value.message


def test_not_a_function():
    with pytest.raises(EntryError, match="not a function"):
        load_target(asset("tiny.py") + ":NOT_A_FUNCTION")


def test_two_required_arguments():
    with pytest.raises(EntryError, match="2 required arguments"):
        load_target(asset("tiny.py") + ":takes_two")


@pytest.mark.parametrize("name, line_fragment", [
    ("syntax_error.py:target", "syntax_error.py:1"),
    ("import_error.py:target", "import_error.py:2"),
])
def test_user_import_errors_point_at_their_line(name, line_fragment):
    with pytest.raises(UserCodeError) as info:
        load_target(asset(name))
    assert line_fragment in info.value.message


def test_user_function_raising_points_at_their_line():
    with pytest.raises(UserCodeError) as info:
        load_target(asset("tiny.py") + ":raises")
    msg = info.value.message
    assert "KeyError" in msg and "tiny.py:" in msg
    assert info.value.lineno is not None
    line = open(asset("tiny.py")).read().splitlines()[info.value.lineno - 1]
    assert 'values["missing"]' in line


@pytest.mark.parametrize("fn, fragment", [
    ("returns_none", "returned NoneType, not a nanprobe.Target or dict"),
    ("returns_list", "returned list"),
    ("no_model", "returned no 'model'"),
    ("model_not_module", "'model' is str, not a torch.nn.Module"),
    ("unknown_key", "unknown key(s) 'lr'"),
    ("bad_precision", "'precision' is 'fp8'"),
    ("scaler_without_fp16", "'grad_scaler' is set but 'precision' is fp32"),
    ("one_shot_batches", "one-shot iterator"),
    ("foreign_optimizer", "not parameters of 'model'"),
])
def test_target_validation(fn, fragment):
    with pytest.raises(TargetError) as info:
        load_target(asset("tiny.py") + ":" + fn)
    assert fragment in info.value.message
    assert "\n" not in info.value.message


def test_validate_accepts_target_instances():
    model = torch.nn.Linear(2, 2)
    t = validate(Target(model=model, loss_fn=lambda m, b: m(b).sum(), batches=[torch.ones(1, 2)],
                        precision="bf16"), "here")
    assert t.precision is Precision.BF16


def test_split_entry_keeps_windows_style_colon_in_path():
    assert split_entry("C:/x/train.py:target") == ("C:/x/train.py", "target")


def test_entry_module_does_not_leak_between_tests():
    assert not any(name.startswith("nanprobe_entry_") for name in sys.modules)
