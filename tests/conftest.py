"""Shared test fixtures: every test starts from the same global torch/Python state."""

from __future__ import annotations

import os
import random
import re
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
ASSETS = Path(__file__).resolve().parent / "assets"

os.environ.setdefault("COLUMNS", "120")
# One intra-op thread for the whole suite: on a 2-core CI machine two OpenMP threads plus the
# DataLoader workers some tests start make small ops 100x slower (threads descheduled at barriers).
# Every test compares results within this one setting.
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _restore_global_state():
    path = list(sys.path)
    modules = set(sys.modules)
    dtype = torch.get_default_dtype()
    anomaly = torch.is_anomaly_enabled()
    grad = torch.is_grad_enabled()
    threads = torch.get_num_threads()
    cwd = os.getcwd()
    rng = torch.get_rng_state()
    py_rng = random.getstate()
    tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    yield
    sys.path[:] = path
    for name in set(sys.modules) - modules:
        if name.startswith("nanprobe_entry_") or name.startswith("mypkg"):
            del sys.modules[name]
    torch.set_default_dtype(dtype)
    torch.set_anomaly_enabled(anomaly)
    torch.set_grad_enabled(grad)
    torch.set_num_threads(threads)
    torch.set_rng_state(rng)
    random.setstate(py_rng)
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32
    os.chdir(cwd)


_PROGRESS = re.compile(r"nanprobe: (?!error: ).* \(\d+ s\)")


def output_lines(text: str) -> list[str]:
    """A command's non-blank output lines, less the plain progress lines ("nanprobe: replaying step 3 (10 s)")
    that a command running past 10 s prints: on a loaded CI machine one can come before the error line."""
    return [line for line in text.strip().splitlines() if line.strip() and not _PROGRESS.fullmatch(line.strip())]


def example(name: str) -> str:
    return str(EXAMPLES / name)


def asset(name: str) -> str:
    return str(ASSETS / "entries" / name)


def plain_first_bad(name: str, steps: int) -> int | None:
    """The first non-finite step of an example in the examples' own plain loop, run here and now.

    Where that step depends on the CPU's low-precision kernels (an fp16 overflow by a small margin
    differs between CPUs and thread counts), a test takes its truth from this, never a number.
    """
    import contextlib
    import importlib.util
    import io

    sys.path.insert(0, str(EXAMPLES))   # the examples import their siblings (tiny_transformer, plain_loop)
    try:
        spec = importlib.util.spec_from_file_location(f"plain_{Path(name).stem}", EXAMPLES / name)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        from plain_loop import train
        with contextlib.redirect_stdout(io.StringIO()):
            step, _ = train(mod.target(), steps=steps, verbose=False)
        return step
    finally:
        sys.path.remove(str(EXAMPLES))
def assert_one_story(report) -> None:
    """One finding, one story (README, "Reading the report"): where the report has an origin, every finding
    that names an op names that origin (phase, module, op; a backward origin's op is its autograd node), and a
    ``data`` finding carries the origin's phase; a finding with phase ``input`` names no module and no op.
    Checked on the JSON the user reads."""
    data = report.to_json()
    origin = data["origin"]
    for f in data["findings"]:
        where = (f["phase"], f["module"], f["op"])
        if f["phase"] == "input":
            assert (f["module"], f["op"]) == (None, None), where
        if origin is None:
            continue
        at = (origin["phase"], origin["module"], origin.get("node") or origin["op"])
        if f["op"] is not None:
            assert where == at, (f["cause"], where, at)
        if f["cause"] == "data":
            assert f["phase"] == origin["phase"], (where, at)


def state_of(target):
    """A copy of the target's model state and (single) optimizer state, for assert_same_state."""
    import copy
    return ({k: v.clone() for k, v in target.model.state_dict().items()},
            copy.deepcopy(target.optimizer.state_dict()))


def assert_same_state(target, state):
    """The target's model and optimizer state equal ``state`` bitwise, dtypes included."""
    model, opt = state
    for k, v in target.model.state_dict().items():
        assert v.dtype == model[k].dtype and torch.equal(v, model[k]), k
    now = target.optimizer.state_dict()["state"]
    for i, entry in opt["state"].items():
        for key, value in entry.items():
            assert now[i][key].dtype == value.dtype and torch.equal(now[i][key], value), (i, key)


def free_port() -> int:
    """A TCP port free now, for a test's process group (``tcp://127.0.0.1:PORT``)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def leave_worker() -> None:
    """A spawned worker's work is done and its files written: exit without the interpreter's teardown,
    where a gloo thread still being torn down can abort the process now and then ("terminate called
    without an active exception", torch's teardown, seen at exit with and without nanprobe)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def first_nonfinite_update(run) -> int:
    """The oracle for update-born tests: call ``run()`` (a plain script, no nanprobe) and return the first
    optimizer step after whose update a weight is non-finite."""
    from torch.optim.optimizer import register_optimizer_step_post_hook

    seen: list[int] = []
    steps = iter(range(10 ** 6))

    def post(opt, args, kwargs):
        step = next(steps)
        if not seen and not all(torch.isfinite(p).all() for g in opt.param_groups for p in g["params"]):
            seen.append(step)

    handle = register_optimizer_step_post_hook(post)
    try:
        run()
    finally:
        handle.remove()
    return seen[0]


def tb_scalars(logdir: Path) -> dict[str, list[int]]:
    """Tag -> steps of the scalars in a TensorBoard log dir (every event file below it)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tags: dict[str, list[int]] = {}
    for events in sorted(logdir.rglob("events.out.tfevents.*")):
        acc = EventAccumulator(str(events))
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            tags.setdefault(tag, []).extend(e.step for e in acc.Scalars(tag))
    return tags
