"""configs/default.yaml (+ --config FILE) -> frozen dataclasses, validated with every problem at once."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field, fields, replace
from importlib import resources
from pathlib import Path
from collections.abc import Callable
from typing import Any, get_origin

import yaml

from .errors import ConfigError

PRECISION_NAMES = ("fp64", "fp32", "tf32", "bf16", "fp16")


@dataclass(frozen=True, slots=True, kw_only=True)
class ReplayConfig:
    max_steps: int = 10000
    spike_window: int = 50
    min_history: int = 8
    loss_spike_factor: float = 10.0
    grad_spike_factor: float = 100.0
    spike_z: float = 3.0
    extreme_factor: float = 100.0
    extreme_z: float = 10.0
    persist_steps: int = 3
    runaway_factor: float = 30.0
    baseline_steps: int = 3
    rise_floor: float = 0.05
    update_ratio_limit: float = 1.0
    min_scale: float = 1.0
    max_scale_drop: float = 1024.0
    max_scaler_skips: int = 64
    history: int = 16
    snapshot_every: int = 50
    ratio_steps: int = 1
    snapshot_store: str = "auto"
    snapshot_memory_mb: float = 32.0
    snapshot_dir: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class RunConfig:
    reference: str = "fp32"
    precisions: tuple[str, ...] = ("fp32", "bf16", "fp16")
    verify_fixes: bool = True
    context_modules: int = 5
    update_ratio_limit: float = 1.0
    update_ratio_high: float = 0.01
    weight_growth_high: float = 1.5
    shift_factor: float = 10.0
    lr_jump_factor: float = 5.0
    near_zero: float = 1e-30
    fp16_on_cpu: bool = False
    fidelity_rtol_cuda: float = 1e-3
    deferred_checks: str = "auto"
    progress_every: float = 10.0


@dataclass(frozen=True, slots=True, kw_only=True)
class ScanConfig:
    zscore: float = 12.0
    warmup_batches: int = 8
    max_examples: int = 5
    ignore_index: int = -100
    typical_factor: float = 2.0
    max_problems: int = 1000
    infer_num_classes: bool = True
    infer_max_params: int = 100_000_000
    callable_batches: int = 10000
    moments_every: int = 16


@dataclass(frozen=True, slots=True, kw_only=True)
class GuardConfig:
    check_every: int = 1
    check_updates_every: int = 10
    policy: str = "skip"
    window: int = 50
    min_history: int = 8
    loss_spike_factor: float = 10.0
    grad_spike_factor: float = 100.0
    spike_z: float = 3.0
    extreme_factor: float = 100.0
    extreme_z: float = 10.0
    persist_steps: int = 3
    runaway_factor: float = 30.0
    baseline_steps: int = 3
    rise_floor: float = 0.05
    min_scale: float = 1.0
    max_scale_drop: float = 1024.0
    max_consecutive_skips: int = 5
    capsule_dir: str = "nanprobe-capsules"
    max_capsules: int = 10
    max_scaler_skips: int = 64
    history: int = 16
    rng_states: str = "auto"


@dataclass(frozen=True, slots=True, kw_only=True)
class CompareConfig:
    top: int = 8
    loss_tolerance: float = 0.02
    min_cosine: float = 0.99
    disagree_cosine: float = 0.9
    underflow_share: float = 0.05
    max_scale_halvings: int = 24
    max_reference_mb: float = 2048.0


@dataclass(frozen=True, slots=True, kw_only=True)
class HorizonConfig:
    margin: int = 20
    max_lookback: int = 150
    max_fixes: int = 4
    snapshot_every: int = 10


@dataclass(frozen=True, slots=True, kw_only=True)
class MonitorConfig:
    enabled: bool = True
    every: int = 2
    live_every: int = 10
    baseline_samples: int = 5
    settle_steps: int = 10
    growth_factor: float = 10.0
    attention_logit_limit: float = 100.0
    entropy_floor: float = 0.1
    output_logsumexp_limit: float = 50.0
    headroom_bits: float = 1.0
    adam_eps_share: float = 0.5
    loss_scale_drop: float = 1024.0
    min_lead: int = 5
    breakaway_window: int = 10
    breakaway_sigmas: float = 4.0
    breakaway_rise: float = 0.1
    breakaway_patience: int = 20
    breakaway_min_steps: int = 30


@dataclass(frozen=True, slots=True, kw_only=True)
class WatchConfig:
    explain_budget: float = 300.0


@dataclass(frozen=True, slots=True, kw_only=True)
class Config:
    replay: ReplayConfig = field(default_factory=ReplayConfig)
    run: RunConfig = field(default_factory=RunConfig)
    scan: ScanConfig = field(default_factory=ScanConfig)
    guard: GuardConfig = field(default_factory=GuardConfig)
    compare: CompareConfig = field(default_factory=CompareConfig)
    horizon: HorizonConfig = field(default_factory=HorizonConfig)
    monitor: MonitorConfig = field(default_factory=MonitorConfig)
    watch: WatchConfig = field(default_factory=WatchConfig)


_SIGNED = {"ignore_index"}
_CHOICES = {
    ("run", "reference"): ("fp32", "fp64"),
    ("guard", "policy"): ("skip", "raise", "record"),
    ("replay", "snapshot_store"): ("auto", "device", "host", "disk"),
    ("run", "deferred_checks"): ("auto", "on", "off"),
}


# type -> (is the value valid for the key, what it must be)
_KINDS: dict[type, tuple[Callable[[Any, str], bool], str]] = {
    bool: (lambda v, k: isinstance(v, bool), "true or false"),
    int: (lambda v, k: isinstance(v, int) and not isinstance(v, bool) and (v >= 0 or k in _SIGNED),
          "a non-negative integer"),
    float: (lambda v, k: isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0, "a non-negative number"),
    str: (lambda v, k: isinstance(v, str), "a string"),
}


def _coerce(section: str, key: str, value: Any, annotation: Any, problems: list[str]) -> Any:
    where = f"{section}.{key}"
    typ = eval(annotation) if isinstance(annotation, str) else annotation  # noqa: S307 - our own annotations
    if get_origin(typ) is tuple:
        if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
            problems.append(f"{where} must be a list of names, got {value!r}")
            return None
        bad = [v for v in value if v not in PRECISION_NAMES]
        if bad:
            problems.append(f"{where} has unknown precision(s) {bad}; choose from {list(PRECISION_NAMES)}")
        return tuple(value)
    ok, what = _KINDS[typ]
    if not ok(value, key):
        problems.append(f"{where} must be {what}, got {value!r}")
        if typ is not str:
            return value
    choices = _CHOICES.get((section, key))
    if choices and value not in choices:
        problems.append(f"{where} must be one of {list(choices)}, got {value!r}")
    return float(value) if typ is float else value


def _build(data: dict, source: str, base: Config | None = None) -> Config:
    problems: list[str] = []
    base = base or Config()
    if not isinstance(data, dict):
        raise ConfigError(source, [f"top level must be a mapping of sections, got {type(data).__name__}"])
    sections = {f.name: f for f in fields(Config)}
    new_sections = {}
    for name, values in data.items():
        if name not in sections:
            problems.append(f"unknown section {name!r} (known: {', '.join(sections)})")
        elif values is not None and not isinstance(values, dict):
            problems.append(f"section {name!r} must be a mapping")
        elif values is not None:
            current = getattr(base, name)
            known = {f.name: f for f in fields(current)}
            updates = {}
            for key, value in values.items():
                if key not in known:
                    problems.append(f"unknown key {name}.{key} (known: {', '.join(known)})")
                else:
                    updates[key] = _coerce(name, key, value, known[key].type, problems)
            new_sections[name] = replace(current, **updates)
    if problems:
        raise ConfigError(source, problems)
    return replace(base, **new_sections)


def default_config_path():
    """The packaged defaults (installed as nanprobe/configs), or the checkout's configs/ folder."""
    with contextlib.suppress(ModuleNotFoundError):
        path = resources.files("nanprobe.configs").joinpath("default.yaml")
        if path.is_file():
            return path
    return Path(__file__).resolve().parents[2] / "configs" / "default.yaml"


def _read_yaml(text: str, source: str) -> Any:
    try:
        return yaml.safe_load(text) or {}
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{source}:{mark.line + 1}" if mark else source
        raise ConfigError(where, [f"not valid YAML: {getattr(exc, 'problem', exc)}"]) from None


def load_config(path: str | Path | None = None) -> Config:
    """Defaults from the packaged default.yaml, then the user's file on top."""
    config = _build(_read_yaml(default_config_path().read_text(), "configs/default.yaml"), "configs/default.yaml")
    if path is None:
        return config
    p = Path(path)
    if not p.is_file():
        raise ConfigError(str(p), ["file not found"])
    return _build(_read_yaml(p.read_text(), str(p)), str(p), base=config)
