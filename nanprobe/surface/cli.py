"""typer CLI: flags -> library call -> render or JSON -> exit code. The only module importing typer."""

from __future__ import annotations

import contextlib
import functools
import io
import math
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.text import Text
from typer.core import TyperGroup

try:   # typer >= 0.17 vendors click as typer._click; older releases use the click package
    from typer import _click as click
except ImportError:  # pragma: no cover - depends on the typer release
    import click

from ..base.version import __version__
from ..base.config import load_config
from ..base.errors import EXIT_INTERNAL, EXIT_USAGE, NanprobeError, UsageError
from ..base.report import dumps

EXIT_INTERRUPTED = 130


class _OneLineErrors(TyperGroup):
    """click's usage errors (unknown option or command, missing or bad argument) as one line, exit 2."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        try:
            rv = super().main(args=args, prog_name=prog_name, complete_var=complete_var, standalone_mode=False,
                              **extra)
            code = rv if isinstance(rv, int) else 0
        except click.exceptions.UsageError as err:
            if type(err).__name__ == "NoArgsIsHelpError" and err.ctx is not None:   # plain `nanprobe`
                click.echo(err.ctx.get_help())
                code = EXIT_USAGE
            else:
                path = err.ctx.command_path if err.ctx is not None else "nanprobe"
                message = err.format_message().strip().rstrip(".")
                print(f"nanprobe: error: {message[:1].lower() + message[1:]}. Try '{path} --help'.", file=sys.stderr)
                code = EXIT_USAGE
        except click.exceptions.ClickException as err:
            print(f"nanprobe: error: {err.format_message().strip().rstrip('.')}.", file=sys.stderr)
            code = err.exit_code
        except typer.Abort:
            print("nanprobe: interrupted.", file=sys.stderr)
            code = EXIT_INTERRUPTED
        if standalone_mode:
            sys.exit(code)
        return code


app = typer.Typer(name="nanprobe", cls=_OneLineErrors, pretty_exceptions_enable=False, no_args_is_help=True,
                  add_completion=False,
                  help="Find where and why a PyTorch training step produced NaN/Inf, and what to change.",
                  context_settings={"help_option_names": ["-h", "--help"]})

EntryArg = Annotated[str, typer.Argument(metavar="ENTRY",
                                         help="path/to/train.py:function or package.module:function returning a "
                                              "nanprobe.Target or dict")]
AtOpt = Annotated[Optional[int], typer.Option("--at", help="Step to diagnose (default: the first bad step).")]
PrecisionOpt = Annotated[Optional[str], typer.Option("--precision", "-p",
                                                     help="Precision the run trains in: fp32, bf16 or fp16 "
                                                          "(default: the target's).")]
JsonOpt = Annotated[Optional[str], typer.Option("--json", metavar="OUT",
                                                help="Write the JSON report to OUT ('-' for stdout: then only JSON "
                                                     "goes to stdout).")]
ConfigOpt = Annotated[Optional[Path], typer.Option("--config", help="YAML overriding configs/default.yaml.")]
DebugOpt = Annotated[bool, typer.Option("--debug", help="Show full tracebacks.")]
MaxStepsOpt = Annotated[Optional[int], typer.Option("--max-steps", help="Without --at: replay at most this many "
                                                                        "steps (default: replay.max_steps).")]
PolicyOpt = Annotated[str, typer.Option("--autocast-policy",
                                        help="Autocast op list: 'native' (the device's own) or 'cuda' (CUDA's "
                                             "float32 list emulated on CPU, for runs trained on a GPU).")]
DeviceOpt = Annotated[Optional[str], typer.Option("--device", help="Move the model, optimizer state and batches "
                                                                  "to this device first (cpu, cuda, cuda:1).")]
VerboseOpt = Annotated[bool, typer.Option("--verbose", "-v", help="Show every finding's evidence and fixes, the other precisions, module outputs and recent steps (the default report fits one screen).")]
CapsuleOpt = Annotated[Optional[Path], typer.Option("--capsule", metavar="PATH",
                                                    help="Replay exactly the step a nanprobe.Guard capsule holds: "
                                                         "a capsule file, or a sharded capsule's directory "
                                                         "(FSDP/DDP; replayed on one process, naming the rank).")]


def console(stderr: bool = False) -> Console:
    width = int(os.environ.get("COLUMNS", "0") or 0) or None
    return Console(stderr=stderr, width=width or (None if sys.stdout.isatty() else 120), highlight=False)


def handles_errors(fn):
    """NanprobeError -> one line + its exit code; anything else -> internal error, exit 3."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        debug = bool(kwargs.get("debug"))
        try:
            return fn(*args, **kwargs)
        except (typer.Exit, typer.Abort):
            raise
        except KeyboardInterrupt:
            print("nanprobe: interrupted (nothing was written).", file=sys.stderr)
            raise typer.Exit(EXIT_INTERRUPTED) from None
        except Exception as err:  # noqa: BLE001 - not a NanprobeError: a bug in nanprobe
            if debug:
                traceback.print_exc()
            if isinstance(err, NanprobeError):
                line, code, shown = err.message, err.exit_code, f"nanprobe: error: {err.message}"
            else:
                line = f"internal error: {type(err).__name__}: {err}. This is a bug in nanprobe; rerun with " \
                       "--debug and report the output"
                code, shown = EXIT_INTERNAL, f"nanprobe: {line}."
            print(shown, file=sys.stderr)
            if kwargs.get("json_out"):   # a CI system still gets a report: status "error", the message, the code
                command = next((c.name for c in app.registered_commands if c.callback.__name__ == fn.__name__),
                               fn.__name__)
                data = {"schema": 1, "nanprobe": __version__, "command": command, "entry": kwargs.get("entry"),
                        "status": "error", "error": line, "exit_code": code, "findings": []}
                with contextlib.suppress(NanprobeError):   # the --json path itself is the problem: the line says it
                    emit_json(data, kwargs["json_out"])
            raise typer.Exit(code) from None

    return wrapper


def emit_json(data: dict, json_out: str | None) -> None:
    if json_out is None:
        return
    text = dumps(data)
    if json_out == "-":
        sys.stdout.write(text + "\n")
        return
    path = Path(json_out)
    if path.suffix in (".py", ".pt", ".pth", ".yaml", ".yml"):
        raise UsageError(f"refusing to write JSON over {json_out}", "--json",
                         "Give a .json path (nanprobe never overwrites source, checkpoint or config files)")
    try:
        path.write_text(text + "\n")
    except OSError as exc:
        raise UsageError(f"cannot write {json_out}: {exc.strerror}", "--json", "Give a writable path") from None


def _call(fn, json_out: str | None, progress, *args, **kwargs):
    """``fn(*args, on_progress=progress, **kwargs)``; under ``--json -`` what the user's code prints goes to
    stderr (stdout carries only the JSON). The progress display stops after, errors too."""
    try:
        with contextlib.redirect_stdout(sys.stderr) if json_out == "-" else contextlib.nullcontext():
            return fn(*args, on_progress=progress, **kwargs)
    finally:
        if progress:
            progress.stop()


def _finish(result, json_out: str | None, render, then=None) -> None:
    """Render (unless ``--json -``), write the JSON, ``then()``, exit with the result's code."""
    if json_out != "-":
        render()
    emit_json(result.to_json(), json_out)
    if then is not None:
        then()
    raise typer.Exit(result.exit_code)


def _check_plot(plot: Path | None) -> None:
    if plot is not None:
        from ..compare import check_plot
        check_plot(plot)


def _same_stream() -> bool:
    """stdout and stderr are the same file (``2>&1``): lines on stderr would land inside the JSON."""
    try:
        a, b = os.fstat(sys.stdout.fileno()), os.fstat(sys.stderr.fileno())
    except (OSError, ValueError, AttributeError, io.UnsupportedOperation):
        return sys.stdout is sys.stderr
    return os.path.samestat(a, b)


def progress_printer(json_out: str | None, every: float = 10.0):
    """Progress on stderr: a spinner on a terminal; elsewhere (CI logs) a plain line at most every ``every``
    seconds. Off under ``--json -`` when stderr and stdout are the same file."""
    if json_out == "-" and (sys.stderr.isatty() or _same_stream()):
        return None
    if sys.stderr.isatty():
        status = console(stderr=True).status("nanprobe: starting")
        status.start()

        def update(msg: str) -> None:
            status.update(f"nanprobe: {msg}")

        update.stop = status.stop  # type: ignore[attr-defined]
        return update
    if every <= 0:
        return None
    start = time.monotonic()
    last = [start]

    def plain(msg: str) -> None:
        now = time.monotonic()
        if now - last[0] >= every:
            last[0] = now
            print(f"nanprobe: {msg} ({now - start:.0f} s)", file=sys.stderr, flush=True)

    plain.stop = lambda: None  # type: ignore[attr-defined]
    return plain


TrajectoryPlotOpt = Annotated[Optional[Path], typer.Option(
    "--plot", metavar="FILE.png", help="Write the precursor monitor's series (attention logits, entropy, log Z, "
                                       "gradient norms, loss) with the onset and any warning (needs matplotlib: "
                                       "the nanprobe\\[plot] extra).")]


@app.command("run")
@handles_errors
def run_cmd(entry: EntryArg, at: AtOpt = None, precision: PrecisionOpt = None, json_out: JsonOpt = None,
            config: ConfigOpt = None, max_steps: MaxStepsOpt = None, autocast_policy: PolicyOpt = "native",
            verbose: VerboseOpt = False, debug: DebugOpt = False, capsule: CapsuleOpt = None,
            device: DeviceOpt = None, plot: TrajectoryPlotOpt = None) -> None:
    """Reach the step (capsule, load_state or replay from step 0), rerun it instrumented, explain it, suggest fixes."""
    from ..pipeline.diagnose import diagnose  # torch is imported lazily so --help stays fast
    from .render import render_report
    _check_precision(precision)
    _check_plot(plot)
    if autocast_policy not in ("native", "cuda"):
        raise UsageError(f"unknown autocast policy {autocast_policy!r}", "--autocast-policy", "Use native or cuda")
    cfg = load_config(config)
    report = _call(diagnose, json_out, progress_printer(json_out, cfg.run.progress_every), entry, at=at,
                   precision=precision, config=cfg, max_steps=max_steps, policy=autocast_policy,
                   capsule=None if capsule is None else str(capsule), device=device)
    if plot is not None and report.trajectory:
        from ..compare import plot_trajectory
        plot_trajectory(report.trajectory, plot, title=f"nanprobe run: {report.entry} step {report.step}")

    def render() -> None:
        render_report(report, console(), verbose=verbose)
        if plot is not None:
            console().print(f"[dim]{'plot written to ' + str(plot) if report.trajectory else 'no plot: no precursor left its band (no trajectory)'}[/]")

    _finish(report, json_out, render)


StepsOpt = Annotated[int, typer.Option("--steps", "-n", help="Training steps to run from scratch.")]
JunitOpt = Annotated[Optional[Path], typer.Option("--junit", metavar="FILE",
                                                  help="Write JUnit XML to FILE (one testcase per check) for CI.")]
CapsuleDirOpt = Annotated[Optional[Path], typer.Option("--capsule-dir", metavar="DIR",
                                                       help="Where the bad step's capsule goes "
                                                            "(default: guard.capsule_dir).")]


@app.command("smoke")
@handles_errors
def smoke_cmd(entry: EntryArg, steps: StepsOpt = 20, precision: PrecisionOpt = None, json_out: JsonOpt = None,
              junit: JunitOpt = None, config: ConfigOpt = None, capsule_dir: CapsuleDirOpt = None,
              verbose: VerboseOpt = False, debug: DebugOpt = False) -> None:
    """CI check: train N steps from scratch under nanprobe.Guard; exit 1 with the diagnosis of the first bad step."""
    from ..pipeline.smoke import smoke, write_junit
    from .render import render_smoke
    _check_precision(precision)
    if steps < 1:
        raise UsageError(f"--steps {steps} is not a positive number of steps", "--steps", "Give N >= 1")
    cfg = load_config(config)
    try:
        result = _call(smoke, json_out, progress_printer(json_out, cfg.run.progress_every), entry, steps=steps,
                       precision=precision, config=cfg, capsule_dir=capsule_dir)
    except NanprobeError as err:
        if junit is not None:
            write_junit(junit, None, entry=entry, error=err.message)
        raise
    _finish(result, json_out, lambda: render_smoke(result, console(), verbose=verbose),
            None if junit is None else functools.partial(write_junit, junit, result))


PrecisionsOpt = Annotated[Optional[str], typer.Option(
    "--precisions", metavar="LIST",
    help="Comma-separated subset of fp64,fp32,tf32,bf16,fp16,fp16+scaler (default: all; the reference always runs).")]
TopOpt = Annotated[Optional[int], typer.Option("--top", help="Modules per per-layer table (default: compare.top).")]
PlotOpt = Annotated[Optional[Path], typer.Option("--plot", metavar="FILE.png",
                                                 help="Plot per-layer |activation| and |gradient| maxima per "
                                                      "precision (needs matplotlib: the nanprobe\\[plot] extra).")]


@app.command("compare-precisions")
@handles_errors
def compare_cmd(entry: EntryArg, at: AtOpt = None, precisions: PrecisionsOpt = None, top: TopOpt = None,
                plot: PlotOpt = None, json_out: JsonOpt = None, config: ConfigOpt = None,
                debug: DebugOpt = False) -> None:
    """Rerun the same step under fp64, fp32, tf32, bf16, fp16 and fp16+GradScaler; compare with the reference."""
    from ..compare import compare_precisions, parse_precisions, plot_comparison
    from .render import render_comparison
    names = parse_precisions(precisions)
    if top is not None and top < 1:
        raise UsageError(f"--top {top} is not a positive count", "--top", "Give a number of modules >= 1")
    _check_plot(plot)
    cfg = load_config(config)
    result = _call(compare_precisions, json_out, progress_printer(json_out, cfg.run.progress_every), entry, at=at,
                   precisions=names, top=top, config=cfg)
    if plot is not None:
        plot_comparison(result, plot)

    def render() -> None:
        render_comparison(result, console())
        if plot is not None:
            console().print(f"[dim]plot written to {plot}[/]")

    _finish(result, json_out, render)


LimitOpt = Annotated[Optional[int], typer.Option("--limit", metavar="N",
                                                help="Scan at most the first N batches (default: all).")]
NumClassesOpt = Annotated[Optional[int], typer.Option("--num-classes", metavar="K",
                                                      help="Labels must be < K (default: the target's num_classes, "
                                                           "else the model's output width).")]


def _scan_progress(enabled: bool):
    """A rich progress bar (batches/s, problems found) on stderr; None when quiet."""
    if not enabled:
        return None
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
    bar = Progress(SpinnerColumn(), TextColumn("scanning"), BarColumn(), MofNCompleteColumn(),
                   TextColumn("{task.fields[rate]:.0f} batches/s · {task.fields[problems]} problem(s)"),
                   TimeElapsedColumn(), console=console(stderr=True), transient=True)
    task = bar.add_task("scan", total=None, rate=0.0, problems=0)
    bar.start()
    start, last = time.monotonic(), [0.0]

    def update(done: int, total: int | None, problems: int) -> None:
        now = time.monotonic()
        if now - last[0] >= 0.1 or done == total:   # rich redraws on its own timer; keep this call cheap
            last[0] = now
            bar.update(task, completed=done, total=total, rate=done / max(now - start, 1e-9), problems=problems)

    update.stop = bar.stop  # type: ignore[attr-defined]
    return update


@app.command("scan-data")
@handles_errors
def scan_data_cmd(entry: EntryArg, limit: LimitOpt = None, precision: PrecisionOpt = None,
                  num_classes: NumClassesOpt = None, json_out: JsonOpt = None, config: ConfigOpt = None,
                  debug: DebugOpt = False) -> None:
    """Iterate the batches (no training) and report every NaN/Inf, empty, out-of-range or extreme value."""
    from ..pipeline.scan import scan_data
    from .render import render_scan
    _check_precision(precision)
    cfg = load_config(config)
    progress = _scan_progress(json_out != "-" and sys.stderr.isatty()
                              and os.environ.get("CI", "").strip().lower() not in ("1", "true", "yes"))
    result = _call(scan_data, json_out, progress, entry, limit=limit, precision=precision, num_classes=num_classes,
                   config=cfg)
    _finish(result, json_out, lambda: render_scan(result, console()))


CommandArg = Annotated[Optional[list[str]], typer.Argument(metavar="-- COMMAND ARGS",
                                                          help="The command to watch, after --: python train.py "
                                                               "ARGS or python -m pkg.train ARGS (run in this "
                                                               "process), or a launcher (torchrun ..., accelerate "
                                                               "launch ..., python -m torch.distributed.run ..., "
                                                               "bash run.sh): its Python processes are followed, "
                                                               "each rank writes its own report, and one line at "
                                                               "the end says what was watched (processes, ranks, "
                                                               "optimizer steps, bad steps, reports).")]
WatchPolicyOpt = Annotated[str, typer.Option("--policy", help="On a bad step: skip (the update; go on), raise "
                                                              "(into the script), record (apply it anyway).")]
DirOpt = Annotated[Path, typer.Option("--dir", metavar="DIR", help="Where capsules and JSON reports go.")]
EntryOpt = Annotated[Optional[str], typer.Option("--entry", metavar="ENTRY",
                                                 help="The ENTRY for the replay command (train.py:target).")]
WatchJsonOpt = Annotated[Optional[str], typer.Option("--json", metavar="OUT",
                                                    help="Also write the first bad step's JSON report (with --at: "
                                                         "step N's) to the file OUT (stdout is the script's).")]
MaxReportsOpt = Annotated[int, typer.Option("--max-reports", metavar="N",
                                            help="Bad steps diagnosed in-process (later ones: capsule and a line).")]
WatchAtOpt = Annotated[Optional[int], typer.Option(
    "--at", metavar="N", help="Explain optimizer step N (as watch numbers it): re-execute the script, nothing "
                              "checked before step N, step N's forward, backward and update instrumented, then stop "
                              "it; the same report as nanprobe run. Compared with the watched run's record in --dir "
                              "(its Python random/numpy start state restored, its skipped updates skipped again): "
                              "a step that differs is reported 'not reproduced'. Exit code: the report's.")]
ExplainOpt = Annotated[Optional[bool], typer.Option(
    "--explain/--no-explain", help="A bad step not located in-process (born in backward or in the update) is "
                                   "explained by nanprobe watch --at N after the script ends (the script runs again "
                                   "up to step N; --json gets that report). Default: when reaching the step took "
                                   "at most watch.explain_budget seconds (300); --explain always, --no-explain never.")]
# watch's explain runs `watch --at N` in a fresh interpreter with the script's output sent to a file: the report
# goes to this file instead (rendered for a terminal of the given width), and watch prints it
ReportToOpt = Annotated[Optional[str], typer.Option("--report-to", hidden=True, metavar="FILE:WIDTH")]


@app.command("watch")
@handles_errors
def watch_cmd(command: CommandArg = None, json_out: WatchJsonOpt = None, policy: WatchPolicyOpt = "skip",
              dirpath: DirOpt = Path("nanprobe-reports"), entry: EntryOpt = None, max_reports: MaxReportsOpt = 1,
              config: ConfigOpt = None, debug: DebugOpt = False, at: WatchAtOpt = None,
              explain: ExplainOpt = None, report_to: ReportToOpt = None) -> None:
    """Run an unmodified script under the guard (global hooks); diagnose its first bad step in-process.

    Under a launcher (torchrun, accelerate launch, bash run.sh) every Python process it starts is watched.
    """
    import logging

    if at is not None:   # the report of step N rendered after the script's output; its exit code
        from ..watch.at import watch_at
        from .render import render_report
        at_result = watch_at(command or [], at, dirpath=dirpath, json_out=json_out, config=load_config(config))
        if report_to is not None:
            path, _, width = report_to.rpartition(":")
            with open(path, "w", encoding="utf-8") as f:
                render_report(at_result.report, Console(file=f, width=int(width), force_terminal=True,
                                                        highlight=False))
        else:
            render_report(at_result.report, console())
        print(at_result.summary(), file=sys.stderr)
        raise typer.Exit(at_result.exit_code)
    from ..watch import watch
    from ..watch.child import log_to_stderr
    cfg = load_config(config)
    log = logging.getLogger("nanprobe.watch")
    handler = log_to_stderr(log)
    started = time.monotonic()
    try:
        result = watch(command or [], json_out=json_out, policy=policy, config=cfg, dirpath=dirpath, entry=entry,
                       max_reports=max_reports)
    finally:
        log.removeHandler(handler)
        log.propagate = True
    seconds = time.monotonic() - started
    if result.error and result.events and result.events[-1].action == "raised":
        print(result.error, file=sys.stderr)
    print(result.summary(), file=sys.stderr)
    if explain is not False and result.processes is None:   # one process: --at re-executes it
        from ..watch.at import explain as explain_steps
        explain_steps(result.events, command or [], functools.partial(print, file=sys.stderr), steps=result.steps,
                      seconds=seconds, budget=math.inf if explain else cfg.watch.explain_budget, dirpath=dirpath,
                      config=config, json_out=json_out, show=_show_ansi, width=console().width)
    raise typer.Exit(result.exit_code)


def _show_ansi(text: str) -> None:
    """Print a report another nanprobe process rendered (ANSI) on stdout: in colour only on a terminal."""
    console().print(Text.from_ansi(text), end="", soft_wrap=True)


def _check_precision(precision: str | None) -> None:
    if precision is None:
        return
    from ..base.precision import parse_precision
    allowed = ("fp32", "bf16", "fp16")
    with contextlib.suppress(ValueError):
        if parse_precision(precision).value in allowed:
            return
    raise UsageError(f"unknown precision {precision!r}", "--precision", f"Use one of: {', '.join(allowed)}")


def _version(value: bool) -> None:
    if value:
        print(f"nanprobe {__version__}")
        raise typer.Exit(0)


@app.callback()
def _main(version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True,
                                                help="Print the version and exit.")] = False) -> None:
    """nanprobe: where and why the first NaN/Inf was born, and what to change."""


def main() -> None:
    app()


if __name__ == "__main__":
    main()
