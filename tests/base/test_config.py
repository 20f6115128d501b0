"""Config files load into typed dataclasses; every problem is reported at once."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from conftest import ROOT
from nanprobe.base.config import Config, default_config_path, load_config
from nanprobe.base.errors import ConfigError


def test_defaults_match_the_yaml():
    cfg = load_config()
    raw = yaml.safe_load(Path(default_config_path()).read_text())
    assert cfg.replay.max_steps == raw["replay"]["max_steps"]
    assert cfg.run.precisions == tuple(raw["run"]["precisions"])
    assert cfg.scan.ignore_index == -100


@pytest.mark.parametrize("path", sorted((ROOT / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_yaml_loads(path):
    assert isinstance(load_config(path), Config)


def test_override_merges_onto_defaults(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("replay:\n  max_steps: 7\nrun:\n  precisions: [fp32]\n")
    cfg = load_config(f)
    assert cfg.replay.max_steps == 7 and cfg.run.precisions == ("fp32",)
    assert cfg.replay.spike_window == load_config().replay.spike_window


def test_all_problems_at_once(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("replay:\n  max_steps: -1\n  bogus: 2\nguard:\n  policy: explode\nextra: {}\n")
    with pytest.raises(ConfigError) as info:
        load_config(f)
    problems = info.value.problems
    assert len(problems) == 4
    assert any("replay.max_steps" in p for p in problems) and any("guard.policy" in p for p in problems)


def test_yaml_syntax_error_names_the_line(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("replay:\n  max_steps: [1,\n")
    with pytest.raises(ConfigError) as info:
        load_config(f)
    assert "c.yaml:" in info.value.message


def test_missing_config_file():
    with pytest.raises(ConfigError, match="file not found"):
        load_config("/nonexistent/nanprobe.yaml")
