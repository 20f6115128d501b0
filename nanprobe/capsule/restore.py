"""A capsule -> the exact state before its step, in the objects a fresh entrypoint built.

The result is a :class:`nanprobe.reach.replay.Reached`, so ``diagnose_target(loaded, reached=...)``
diagnoses exactly the captured step. The loop's settings (precision, GradScaler, clipping) come
from the capsule: what the guarded run really did; differences become notes.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from ..base.errors import CapsuleError, UsageError, short_path
from ..base.precision import Precision, device_of, parse_precision
from ..base.report import Status
from .codec import decode_batch, fingerprint, rng_from_safe, unwrap
from . import sharded
from .io import Capsule, build, list_capsules, read, record_dict, to_record


def _lightning_position(module: torch.nn.Module, epoch: int, step: int, notes: list[str]) -> None:
    """A LightningModule the ENTRY built, outside any Trainer, replaying a step the run took in epoch
    ``epoch`` at ``global_step`` ``step``: ``training_step`` code that reads ``self.current_epoch`` or
    ``self.global_step`` (a loss switched on after a warm-up epoch) sees what it saw in the run, and
    ``self.log`` does nothing (no warning per call). The module's class is swapped for a subclass that
    says so; a module attached to a Trainer keeps its own."""
    cls = type(module)
    if getattr(module, "_trainer", None) is not None or not any(
            c.__name__ == "LightningModule" and c.__module__.split(".")[0] in ("lightning", "pytorch_lightning")
            for c in cls.__mro__):
        return
    ns = {"current_epoch": property(lambda self: epoch), "global_step": property(lambda self: step),
          "log": lambda self, *a, **k: None, "log_dict": lambda self, *a, **k: None,
          "__module__": cls.__module__, "__qualname__": cls.__qualname__}
    module.__class__ = type(cls.__name__, (cls,), ns)
    notes.append(f"a LightningModule replayed outside a Trainer: current_epoch reads {epoch} and global_step "
                 f"{step}, as in the run; self.log does nothing")


def check_model(capsule: Capsule, model: torch.nn.Module) -> None:
    """CapsuleError unless the capsule's fingerprint (parameter names and shapes) is the model's."""
    mine = dict(fingerprint(model))
    theirs = {str(item[0]): list(item[1]) for item in capsule.data["fingerprint"]}
    parts = [f"{a} has {len(names)} parameter(s) the {b} lacks, e.g. {names[0]!r}"
             for a, b, names in (("capsule", "model", [n for n in theirs if n not in mine]),
                                 ("model", "capsule", [n for n in mine if n not in theirs])) if names]
    diff = "; ".join(parts) or next((f"parameter {n!r} is {tuple(mine[n])} in the model but {tuple(shape)} in the "
                                     "capsule" for n, shape in theirs.items() if mine[n] != shape), None)
    if diff:
        raise CapsuleError(f"capsule is from another model: {diff}", capsule.path,
                           "Pass the ENTRY that builds the model the guarded run trained")


# per-parameter optimizer state that has the parameter's shape (Adam, AdamW, SGD momentum, RMSprop, Adagrad,
# Adadelta, Adamax, NAdam, RAdam, ASGD, Rprop); other keys (Adafactor's factored rows) are not checked
_PARAM_SHAPED = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer", "square_avg", "acc_delta", "grad_avg",
                 "sum", "exp_inf", "ax", "prev", "step_size")


def optimizer_state_damage(opt: torch.optim.Optimizer) -> str | None:
    """A loaded optimizer state that does not fit the model: a per-parameter buffer of another shape or
    type, a step count that is not a number. ``load_state_dict`` accepts them; the update fails later."""
    names = {id(p): f"param_groups[{g}][{i}]" for g, group in enumerate(opt.param_groups)
             for i, p in enumerate(group["params"])}
    for p, state in opt.state.items():
        who = names.get(id(p), "a parameter")
        if not isinstance(state, Mapping):
            return f"state of {who} is a {type(state).__name__}, not a dict"
        for key, value in state.items():
            if key == "step" and not (isinstance(value, (int, float)) and not isinstance(value, bool)
                                      or isinstance(value, torch.Tensor) and value.numel() == 1):
                return f"'step' of {who} is not a number"
            if key in _PARAM_SHAPED and not isinstance(value, torch.Tensor):
                return f"{key!r} of {who} is a {type(value).__name__}, not a tensor"
            if key in _PARAM_SHAPED and value.shape != p.shape:
                return f"{key!r} of {who} has shape {tuple(value.shape)}, the parameter {tuple(p.shape)}"
    return None


def _load_states(cap: Capsule, target, loop, notes: list[str]) -> None:
    data = cap.data
    try:
        with torch.no_grad():
            target.model.load_state_dict(data["model"])
    except (RuntimeError, KeyError, ValueError, TypeError) as exc:
        raise CapsuleError(f"model state does not load: {str(exc).splitlines()[0][:160]}", cap.path,
                           "Pass the ENTRY that builds the model the guarded run trained") from None
    saved, live = data["optimizers"], target.optimizers
    if saved and not live:
        notes.append("the capsule holds optimizer state but the entrypoint returns no optimizer; "
                     "the update phase is not replayed")
    elif live and not saved:
        notes.append("the guarded run had no optimizer; the entrypoint's fresh optimizer state is used")
    elif len(saved) != len(live):
        raise CapsuleError(f"capsule holds {len(saved)} optimizer state(s), the entrypoint returns {len(live)} "
                           "optimizer(s)", cap.path, "Return the optimizers of the guarded run, in the same order")
    else:
        for (name, opt), state in zip(live, saved):
            try:
                opt.load_state_dict(state)
            except (ValueError, KeyError, RuntimeError, TypeError, IndexError) as exc:
                raise CapsuleError(f"state of {name} does not match the entrypoint's: "
                                   f"{str(exc).splitlines()[0][:160]}", cap.path,
                                   "Return the same optimizer type and parameter groups as the guarded run") from None
            damage = optimizer_state_damage(opt)
            if damage:
                raise CapsuleError(f"capsule field 'optimizers' is damaged: {name} {damage}", cap.path,
                                   "Use another capsule, or return the optimizer of the guarded run")
    masters, live_masters = data.get("masters") or [], target.masters
    if len(masters) != len(live_masters) or any(not isinstance(t, torch.Tensor) or t.shape != m.shape
                                                 for t, (_, m) in zip(masters, live_masters)):
        raise CapsuleError(f"capsule holds {len(masters)} master copies of the weights, the entrypoint's optimizers "
                           f"step {len(live_masters)} tensor(s) outside the model", cap.path,
                           "Return the optimizer over the same master copies as the guarded run")
    with torch.no_grad():
        for t, (_, m) in zip(masters, live_masters):
            m.copy_(t)
    for (name, sched), state in zip(target.schedulers, data["schedulers"]):
        if state is None:
            continue
        try:
            sched.load_state_dict(state)
        except Exception as exc:  # noqa: BLE001 - a scheduler of another kind
            notes.append(f"{name} state not restored ({type(exc).__name__}); the LR comes from the optimizer state")
    scalers = loop.objects.scalers()
    for (name, scaler), state in zip(scalers, data["scalers"]):
        if isinstance(state, Mapping) and state and scaler.is_enabled():
            try:
                scaler.load_state_dict(dict(state))
            except (KeyError, TypeError, RuntimeError, ValueError) as exc:
                raise CapsuleError(f"capsule field 'scalers' is damaged ({type(exc).__name__})", cap.path,
                                   "Use another capsule") from None
    if len(data["scalers"]) != len(scalers) and data["scalers"]:
        notes.append(f"the capsule holds {len(data['scalers'])} GradScaler state(s), the loop has {len(scalers)}")


def _batch_like(enc: Any) -> Any:
    """A micro-batch as the guard writes it: a tensor or container (tagged), or an index (an int)."""
    if isinstance(enc, (str, bytes, float, bool)) or enc is None:
        raise CapsuleError(f"a micro-batch is {'None' if enc is None else 'a ' + type(enc).__name__}, not a batch "
                           "of tensors", None, "The capsule is damaged; use another one")
    return enc


def _version(text: Any) -> tuple[int, ...]:
    """"2.13.0+cpu" -> (2, 13, 0); unreadable -> ()."""
    digits = ("".join(ch for ch in piece if ch.isdigit()) for piece in str(text).split("+")[0].split("."))
    return tuple(int(d) for d in itertools.takewhile(bool, digits))


def version_notes(cap: Capsule) -> list[str]:
    """Warnings for a capsule written by a newer nanprobe or torch than the one replaying it."""
    from ..base.version import __version__

    notes = []
    for name, running in (("nanprobe", __version__), ("torch", torch.__version__)):
        theirs = cap.versions.get(name)
        if theirs and _version(theirs) > _version(running):
            notes.append(f"warning: the capsule was written by {name} {theirs}, newer than this {running}: "
                         f"upgrade {name} to replay it exactly as it ran")
    return notes


def _field(cap: Capsule, name: str, fn):
    """Decode one capsule field; any failure is that field's damage (exit 2 naming it)."""
    try:
        return fn()
    except CapsuleError as err:
        what = err.what if f"field '{name}" in err.what else f"capsule field {name!r} is damaged: {err.what}"
        raise CapsuleError(what, cap.path, err.fix) from None
    except Exception:  # noqa: BLE001 - a damaged field can fail in any way
        raise CapsuleError(f"capsule field {name!r} is damaged", cap.path, "Use another capsule") from None


def reach_from_capsule(path: str | os.PathLike | Capsule, loaded, cfg=None, *,
                       precision: str | Precision | None = None, found_for: int | None = None,
                       policy: str | None = None):
    """Restore the capsule into the entrypoint's freshly built objects; the state before its step."""
    from ..reach.feed import Position, Recorded, Stream
    from ..reach.replay import Reached, scheduler_info
    from ..reach.state import apply_carried
    from ..reach.step import Loop

    cap = path if isinstance(path, Capsule) else read(path)
    target = loaded.target
    model = target.model
    if isinstance(cap.data.get("sharded"), Mapping) and not cap.data.get("model"):
        raise CapsuleError(f"{Path(cap.path).name} is rank {cap.rank}'s file of a sharded capsule (the weights are "
                           f"in its directory's DCP files)", cap.path,
                           f"Pass the directory: nanprobe run ENTRY --capsule {short_path(Path(cap.path).parent)}")
    check_model(cap, model)
    data = cap.data
    notes: list[str] = version_notes(cap)
    device = device_of(model)
    prec = parse_precision(precision) if precision is not None else cap.precision
    if prec is not cap.precision:
        notes.append(f"the guarded run trained in {cap.precision.value}; replayed in {prec.value} as asked")
    if target.step_fn is None:
        want_scaler = bool(data.get("grad_scaler")) and prec is Precision.FP16 and bool(target.optimizers)
        if want_scaler != target.uses_scaler and not target.user_scalers:
            notes.append(f"GradScaler {'on' if want_scaler else 'off'} as in the guarded run "
                         f"(the entrypoint says grad_scaler={target.grad_scaler})")
            target.grad_scaler = want_scaler
        mgn = data.get("max_grad_norm")
        if mgn != target.max_grad_norm:
            notes.append(f"gradient clipping {mgn if mgn else 'off'} as in the guarded run "
                         f"(the entrypoint says max_grad_norm={target.max_grad_norm})")
            target.max_grad_norm = mgn
    elif data.get("form") == "loss_fn":
        notes.append("the capsule was written by a loop without step_fn; replayed with this entrypoint's step_fn")
    if data.get("form") == "watch_forward":   # the root module's inputs, not the loop's batch
        from ..reach.forward import ForwardStep

        target.step_fn, target.loss_fn = ForwardStep(device.type), None
        target.accumulate = max(len(data.get("micro_batches") or ()), 1)
        target.max_grad_norm, target.grad_scaler = None, False
        notes.append("a nanprobe watch capsule: it holds the inputs of the script's root module, so the step "
                     "reruns the model's forward on them (and its backward when the output holds the loss), as "
                     "watch did; the entrypoint only builds the model and optimizer (its loss_fn is not used)")
    target.precision = prec
    loop = Loop(target, loaded.where, prec, policy or "native")
    _load_states(cap, target, loop, notes)
    carried = data.get("carried")
    if carried and not isinstance(carried, Mapping):
        raise CapsuleError("capsule field 'carried' is damaged", cap.path, "Use another capsule")
    if carried:
        _field(cap, "carried", lambda: apply_carried(dict(carried), loop.objects, notes))
    rng = _field(cap, "rng", lambda: rng_from_safe(data["rng"], device.type))
    micro_rng = _field(cap, "micro_rng", lambda: [rng_from_safe(r, device.type, f"micro_rng[{i}]")
                                                   for i, r in enumerate(data["micro_rng"])])
    snapshot = loop.objects.take(rng=rng)
    saved_threads = data.get("threads")
    if isinstance(saved_threads, int) and device.type == "cpu" and cap.device.startswith("cpu") \
            and 0 < saved_threads <= (os.cpu_count() or 1):
        snapshot.threads = saved_threads
    if cap.device.split(":")[0] != device.type:
        notes.append(f"the capsule was written on {cap.device}; replayed on {device.type}")
    if policy in (None, "native") and cap.device.startswith("cuda") and device.type == "cpu" and prec.autocast:
        policy = "cuda"
        notes.append("CUDA's autocast policy is emulated on CPU, as in the run that wrote the capsule")
    pos = data.get("position") if isinstance(data.get("position"), Mapping) else None
    position = _field(cap, "position", lambda: Position(
        step=cap.step, epoch=None if pos.get("epoch") is None else int(pos["epoch"]), index=int(pos.get("index") or 0),
        items=tuple(int(i) for i in pos.get("items") or ()))) if pos else None
    if position is not None and position.epoch is not None:
        _lightning_position(unwrap(target.model), position.epoch, cap.step, notes)
    if data.get("batch_missing") or not data["micro_batches"]:
        stream = Stream(target)
        stream.skip(cap.step)
        recorded = Recorded.of(stream.open(cap.step))
        recorded.rng_after = []
        notes.append(f"the guard saw no batch (optimizer_step without guard.step(batch)); "
                     f"using the entrypoint's batch for step {cap.step}")
        snapshot.restore(loop.objects)   # fetching may have drawn from the RNG: back to the capsule's state
    else:
        items = _field(cap, "micro_batches", lambda: [decode_batch(_batch_like(e), device, notes)
                                                      for e in data["micro_batches"]])
        recorded = Recorded(step=cap.step, items=items, rng_after=micro_rng, position=position)
    if data.get("dropped"):
        notes.append(f"not stored in the capsule: {', '.join(map(str, data['dropped'][:3]))}")
    record = _field(cap, "record", lambda: to_record(dict(data.get("record") or {}, step=cap.step)))
    if data.get("form") == "watch_forward":   # as watch compares: the forward rerun gives the root output's
        record = dataclasses.replace(record, grad_norm=None)   # loss, not the norm of what the script backpropagated
    history = _field(cap, "history", lambda: [to_record(h) for h in data["history"] if isinstance(h, Mapping)])
    how = f"capsule {cap.path}" + (f" (found for --at {found_for})" if found_for is not None else "")
    if cap.world_size > 1:
        how += f" (rank {cap.rank} of {cap.world_size})"
    status = cap.status if cap.status in (Status.NONFINITE, Status.SPIKE) else Status.NONFINITE
    return Reached(step=cap.step, recorded=recorded, snapshot=snapshot, loop=loop, precision=prec, status=status,
                   reason=cap.reason, record=record if record.loss is not None or record.grad_norm is not None
                   else None, history=history, update_ratios={}, reached_by=how, notes=notes,
                   policy=policy or "native", compiled=bool(data.get("compiled", False)), **scheduler_info(target))


def reach_from_dir(path: str | os.PathLike, loaded, cfg=None, *, precision: str | Precision | None = None,
                   policy: str | None = None, extra: dict[str, Any] | None = None):
    """A sharded capsule (a directory: FSDP2/FSDP1/DDP, one rank file each) on ONE process: the full state
    goes into the entrypoint's unsharded model and optimizers; each rank's batch is rerun in rank order on
    it, and the first rank whose batch gives a non-finite value is the step diagnosed (none: the rank the
    run itself named). ``extra`` (filled in): the ranks replayed, for the report."""
    from ..locate.rerun import run_step

    caps, state = sharded.read_dir(path, read)
    module, live, where = loaded.target.model, loaded.target.optimizers, str(path)
    saved = state.get("optimizers") or {}
    for cap in caps:
        check_model(cap, module)
        data = cap.data
        metas = data.get("optimizers") or []
        data["model"] = state.get("model") or {}
        if len(metas) == len(live):
            data["optimizers"] = [_field(cap, "optimizers", lambda m=m, i=i, o=o: sharded.optimizer_state(
                m, saved.get(str(i)) or {}, o, module, where)) for i, (m, (_, o)) in enumerate(zip(metas, live))]
        else:   # reach_from_capsule says what differs
            data["optimizers"] = [dict(m) for m in metas]
    world = caps[0].world_size
    named = next((c.rank for c in caps if c.local and c.status is Status.NONFINITE),
                 next((c.rank for c in caps if c.local), None))
    tried: list[dict[str, Any]] = []
    chosen = None
    spike = all(c.status is Status.SPIKE for c in caps)   # finite values: a rerun per rank cannot tell them apart
    for cap in () if spike else caps:
        reached = reach_from_capsule(cap, loaded, cfg, precision=precision, policy=policy)
        # its batch rerun once (uninstrumented, up to its update) on the restored state; the objects end as they were
        trace = run_step(loaded.target, reached, reached.precision, where=loaded.where, instrument=False,
                         tolerate_errors=True, restore_after=True, ratios=False, update=False)
        bad = trace.exc is None and trace.record is not None and not trace.record.finite
        tried.append({"rank": cap.rank, "nonfinite": bad})
        if bad:
            chosen = reached
            break
    if chosen is None:   # no rank's batch alone reproduces it: the rank the run named (else rank 0)
        pick = next((c for c in caps if c.rank == named), caps[0])
        chosen = reach_from_capsule(pick, loaded, cfg, precision=precision, policy=policy)
        rank = pick.rank
        why = "the step is a spike (finite values)" if spike else (
            f"no rank's batch alone gave a non-finite value when replayed on the full model (ranks "
            f"{', '.join(str(t['rank']) for t in tried)} of {world})")
        line = (f"{why}; diagnosing rank {rank}'s step, the rank "
                f"{'that saw it in the run' if named is not None else 'of the first file'}")
    else:
        rank = tried[-1]["rank"]
        fine = [t["rank"] for t in tried[:-1]]
        line = (f"rank {rank} of {world} produced the first non-finite value: its batch, replayed on the full "
                f"(resharded) weights, is non-finite" + (f"; rank(s) {', '.join(map(str, fine))} gave finite "
                                                         "values" if fine else ""))
    chosen.notes.insert(0, line)
    chosen.reached_by = f"sharded capsule {where} (rank {rank} of {world}, replayed on one process)"
    if extra is not None:
        extra["rank"] = {"rank": rank, "world_size": world, "capsule": where, "replayed": tried,
                         "run_named": named, "reproduced": any(t["nonfinite"] for t in tried)}
    return chosen


def capsule_reach(loaded, cfg, *, capsule: str | os.PathLike | None, at: int | None,
                  precision: str | Precision | None = None, policy: str | None = None,
                  extra: dict[str, Any] | None = None):
    """`nanprobe run`'s first stop: ``--capsule FILE`` or ``--capsule DIR`` (a sharded capsule), or a
    capsule for ``--at N`` in guard.capsule_dir.

    Returns ``(reached_or_None, notes)``: None means "replay as usual" (notes say why a capsule
    found for the step was not used). ``extra``: filled with what the report adds (a sharded capsule:
    the rank replayed).
    """
    if capsule is not None:
        if Path(capsule).is_dir():
            reached = reach_from_dir(capsule, loaded, cfg, precision=precision, policy=policy, extra=extra)
        else:
            reached = reach_from_capsule(capsule, loaded, cfg, precision=precision, policy=policy)
        if at is not None and at != reached.step:
            raise UsageError(f"the capsule holds step {reached.step}, not --at {at}", str(capsule),
                             "Drop --at (the capsule fixes the step) or give the capsule of that step")
        return reached, []
    if at is None:
        return None, []
    # --at N: a usable capsule for step N in guard.capsule_dir, a sharded capsule's directory first (the newest);
    # capsules that cannot be used are skipped with a note
    notes: list[str] = []
    for d in sharded.list_dirs(cfg.guard.capsule_dir, at):
        try:
            return reach_from_dir(d, loaded, cfg, precision=precision, policy=policy, extra=extra), []
        except CapsuleError as err:
            notes.append(f"capsule {d} for step {at} not used: {err.what}")
    candidates = []
    for p in list_capsules(cfg.guard.capsule_dir, at):
        try:
            cap = read(p)
            check_model(cap, loaded.target.model)
            candidates.append(cap)
        except CapsuleError as err:
            notes.append(f"capsule {p} for step {at} not used: {err.what}")
    if not candidates:
        return None, notes
    # the rank that saw the problem first, then rank 0, then the newest
    candidates.sort(key=lambda c: (not c.local, c.rank, -(Path(c.path).stat().st_mtime)))
    reached = reach_from_capsule(candidates[0], loaded, cfg, precision=precision, found_for=at, policy=policy)
    reached.notes[:0] = notes
    return reached, []


def build_from_reached(reached, *, entry: str | None = None) -> dict:
    """The capsule of a reached step (smoke's CI artifact): the objects must be in the state before it."""
    loop = reached.loop
    target = loop.target
    snap = reached.snapshot
    pos = reached.position
    return build(model=target.model, optimizers=[o for _, o in target.optimizers],
                 schedulers=[s for _, s in target.schedulers], scalers=[s for _, s in loop.objects.scalers()],
                 micro_batches=list(reached.recorded.items), rng=snap.rng, micro_rng=list(reached.recorded.rng_after),
                 step=reached.step, precision=reached.precision, status=reached.status.value, reason=reached.reason,
                 record=record_dict(reached.record) if reached.record else {},
                 history=[record_dict(h) for h in reached.history], entry=entry,
                 max_grad_norm=target.max_grad_norm, threads=snap.threads,
                 position=None if pos is None else {"epoch": pos.epoch, "index": pos.index, "items": list(pos.items)},
                 carried=snap.carried(), grad_scaler=loop.scaler is not None and target.step_fn is None,
                 form=target.form)
