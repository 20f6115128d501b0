"""typer CLI: flags -> library call -> render or JSON -> exit code. The only module importing typer."""

from __future__ import annotations

import functools
import os
import sys
import traceback
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console

from . import __version__
from .config import Config, load_config
from .errors import EXIT_INTERNAL, NanprobeError, UsageError
from .report import dumps

app = typer.Typer(name="nanprobe", pretty_exceptions_enable=False, no_args_is_help=True, add_completion=False,
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
VerboseOpt = Annotated[bool, typer.Option("--verbose", "-v", help="Show every finding's fixes and the history.")]

_debug = False


def console(stderr: bool = False) -> Console:
    width = int(os.environ.get("COLUMNS", "0") or 0) or None
    return Console(stderr=stderr, width=width or (None if sys.stdout.isatty() else 120), highlight=False)


def handles_errors(fn):
    """NanprobeError -> one line + its exit code; anything else -> internal error, exit 3."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        global _debug
        _debug = bool(kwargs.get("debug"))
        try:
            return fn(*args, **kwargs)
        except (typer.Exit, typer.Abort, KeyboardInterrupt):
            raise
        except NanprobeError as err:
            if _debug:
                traceback.print_exc()
            print(f"nanprobe: error: {err.message}", file=sys.stderr)
            raise typer.Exit(err.exit_code) from None
        except Exception as err:  # noqa: BLE001 - a bug in nanprobe
            if _debug:
                traceback.print_exc()
            print(f"nanprobe: internal error: {type(err).__name__}: {err}. This is a bug in nanprobe; rerun with "
                  "--debug and report the output.", file=sys.stderr)
            raise typer.Exit(EXIT_INTERNAL) from None

    return wrapper


def config_from(path: Path | None) -> Config:
    return load_config(path)


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


def progress_printer(enabled: bool):
    if not enabled:
        return None
    err = console(stderr=True)
    status = err.status("nanprobe: starting")
    status.start()

    def update(msg: str) -> None:
        status.update(f"nanprobe: {msg}")

    update.stop = status.stop  # type: ignore[attr-defined]
    return update


@app.command("run")
@handles_errors
def run_cmd(entry: EntryArg, at: AtOpt = None, precision: PrecisionOpt = None, json_out: JsonOpt = None,
            config: ConfigOpt = None, max_steps: MaxStepsOpt = None, autocast_policy: PolicyOpt = "native",
            verbose: VerboseOpt = False, debug: DebugOpt = False) -> None:
    """Reach the step (replay from step 0 or load_state), rerun it instrumented, explain it, suggest fixes."""
    from .diagnose import diagnose  # torch is imported lazily so --help stays fast
    _check_precision(precision)
    if autocast_policy not in ("native", "cuda"):
        raise UsageError(f"unknown autocast policy {autocast_policy!r}", "--autocast-policy", "Use native or cuda")
    cfg = config_from(config)
    progress = progress_printer(json_out != "-" and sys.stderr.isatty())
    try:
        report = diagnose(entry, at=at, precision=precision, config=cfg, max_steps=max_steps, on_progress=progress,
                          policy=autocast_policy)
    finally:
        if progress:
            progress.stop()
    if json_out != "-":
        from .render import render_report
        render_report(report, console(), verbose=verbose)
    emit_json(report.to_json(), json_out)
    raise typer.Exit(report.exit_code)


def _check_precision(precision: str | None, allowed=("fp32", "bf16", "fp16")) -> None:
    if precision is None:
        return
    from .precision import parse_precision
    try:
        p = parse_precision(precision)
    except ValueError:
        p = None
    if p is None or p.value not in allowed:
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
