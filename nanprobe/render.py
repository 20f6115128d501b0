"""Rich terminal output for reports. Makes no decisions: everything shown is in the Report."""

from __future__ import annotations

import math

from rich.console import Console, Group
from rich.panel import Panel
from rich.syntax import Syntax
from rich.table import Table
from rich.text import Text

from .report import Report, Status


def g(x) -> str:
    if x is None:
        return "-"
    if isinstance(x, str):
        return x
    if isinstance(x, float):
        if math.isnan(x) or math.isinf(x):
            return str(x)
        if x != 0 and (abs(x) >= 1e5 or abs(x) < 1e-3):
            return f"{x:.3e}"
        return f"{x:.4g}"
    return str(x)


def _pct(x) -> str:
    return "-" if x is None else ("0" if x == 0 else f"{100 * x:.2g}%")


_MARK = {True: "[green]✓ verified[/]", False: "[red]✗ rerun still fails[/]", None: "[dim]not verified[/]"}


def render_report(report: Report, console: Console, *, verbose: bool = False) -> None:
    console.print(_verdict(report))
    if report.findings:
        console.print(_findings(report))
        for i, f in enumerate(report.findings[: 1 if not verbose else len(report.findings)]):
            for fix in f.fixes[:3 if i == 0 else 1]:
                title = Text.from_markup(f"[bold]{fix.title}[/]  {_MARK[fix.verified]}")
                body = [Syntax(fix.code, "python", theme="ansi_dark", word_wrap=True, background_color="default")]
                if fix.why:
                    body.append(Text(fix.why, style="dim"))
                if fix.verify_note:
                    body.append(Text(fix.verify_note, style="dim italic"))
                console.print(Panel(Group(*body), title=title, title_align="left", border_style="cyan"))
    if report.precisions:
        console.print(_precisions(report))
    if report.context:
        console.print(_context(report))
    if report.history and (verbose or report.status is not Status.FINITE):
        console.print(_history(report))
    for note in report.notes:
        console.print(f"[dim]note: {note}[/]")


def _verdict(r: Report) -> Panel:
    o = r.origin
    lines = Table.grid(padding=(0, 2))
    lines.add_column(style="bold")
    lines.add_column()
    if r.status is Status.FINITE:
        title, style = "healthy: no NaN/Inf, no spike", "green"
        lines.add_row("step", g(r.step) if r.step is not None else "all replayed steps")
    else:
        what = {"nonfinite": "non-finite values", "spike": "loss/gradient spike", "error": "error"}[r.status.value]
        born = f" born in {o.phase.value}" if o else ""
        title, style = f"step {r.step}: {what}{born}", "red"
        if o:
            op = f"{o.node} ({o.op})" if o.node else o.op
            lines.add_row("where", f"{o.module or '(model)'}   {op}   [{o.precision}]  → {o.kind}")
            if o.source:
                lines.add_row("source", f"{o.source}" + (f"   {o.code}" if o.code else ""))
            if o.parameter:
                lines.add_row("parameter", o.parameter)
            if o.samples:
                lines.add_row("samples", ", ".join(map(str, o.samples)))
        top = r.top
        if top:
            specific = [e for e in top.evidence if not e.startswith(_ORIGIN_PREFIXES)] or list(top.evidence)
            lines.add_row("cause", f"[bold]{top.cause.value}[/] ({top.confidence:.2f})  {specific[-1] if specific else ''}")
    lines.add_row("run", f"{r.entry}  ·  {r.precision}  ·  {r.device}"
                  + (f"  ·  {r.autocast_policy}" if r.autocast_policy else "")
                  + (f"  ·  reached by {r.reached_by}" if r.reached_by else ""))
    return Panel(lines, title=f"[bold]nanprobe {r.command}: {title}[/]", border_style=style, title_align="left")


def _findings(r: Report) -> Table:
    t = Table(title="Findings (most likely first)", title_justify="left", expand=True)
    t.add_column("#", justify="right", width=2)
    t.add_column("cause", style="bold")
    t.add_column("conf", justify="right")
    t.add_column("phase")
    t.add_column("module")
    t.add_column("evidence", ratio=1)
    for i, f in enumerate(r.findings, 1):
        lines = [e for e in f.evidence if not (r.origin and e.startswith(_ORIGIN_PREFIXES))]
        t.add_row(str(i), f.cause.value, f"{f.confidence:.2f}", f.phase.value, f.module or "-",
                  "\n".join(lines[:5] if i == 1 else lines[-2:]))
    return t


# evidence lines that repeat the verdict panel (the origin line and its code)
_ORIGIN_PREFIXES = ("forward: ", "backward: ", "update: ", "code: ")


def _precisions(r: Report) -> Table:
    t = Table(title=f"The same step in other precisions (step {r.step})", title_justify="left")
    t.add_column("precision")
    t.add_column("loss", justify="right")
    t.add_column("grad norm", justify="right")
    t.add_column("finite")
    t.add_column("first non-finite")
    for name, p in r.precisions.items():
        o = p.origin
        first = f"{o.phase.value} {o.module or '(model)'} {o.node or o.op}" if o else (p.note or "-")
        t.add_row(name + (" (run)" if name == r.precision else ""), g(p.loss), g(p.grad_norm),
                  "[green]yes[/]" if p.finite else "[red]no[/]", first)
    return t


def _context(r: Report) -> Table:
    t = Table(title="Module outputs up to the origin (forward order)", title_justify="left")
    for col in ("module", "dtype", "|x| max", "min |x|>0", "zeros", "> fp16 max" if r.precision != "bf16"
                else "> bf16 max", "subnormal"):
        t.add_column(col, justify="right" if col not in ("module", "dtype") else "left")
    for m in r.context:
        t.add_row(m.module or "(model)", m.dtype, g(m.absmax), g(m.min_nonzero), _pct(m.zero_frac), _pct(m.over_frac),
                  _pct(m.under_frac), style=None if m.finite else "red")
    return t


def _history(r: Report) -> Table:
    t = Table(title="Recent steps", title_justify="left")
    for col in ("step", "loss", "grad norm", "lr", "|dw|/|w|", "note"):
        t.add_column(col, justify="right" if col != "note" else "left")
    for h in r.history[-6:]:
        note = "skipped (GradScaler)" if h.skipped else ("" if h.finite else "[red]non-finite[/]")
        t.add_row(str(h.step), g(h.loss), g(h.grad_norm), g(h.lr), g(h.update_ratio), note)
    return t


def render_smoke(result, console: Console, *, verbose: bool = False) -> None:
    """`nanprobe smoke`: the diagnosis of the first bad step, or one healthy panel."""
    r = result.report
    if r.status is not Status.FINITE:
        render_report(r, console, verbose=verbose)
        if result.capsule:
            console.print(f"[bold]capsule[/] {result.capsule}")
        if result.command:
            console.print(f"[bold]replay[/]  {result.command}")
        for note in result.notes:
            console.print(f"[dim]note: {note}[/]")
        return
    lines = Table.grid(padding=(0, 2))
    lines.add_column(style="bold")
    lines.add_column()
    losses = [h.loss for h in r.history if h.loss is not None and not h.skipped]
    lines.add_row("steps", f"{result.steps_run} of {result.steps} trained from scratch under nanprobe.Guard")
    if losses:
        lines.add_row("loss", f"{g(losses[0])} → {g(losses[-1])} (last {len(r.history)} steps shown with -v)")
    lines.add_row("run", f"{r.entry}  ·  {r.precision}  ·  {r.device}  ·  {result.seconds:.1f}s")
    console.print(Panel(lines, title="[bold]nanprobe smoke: healthy: no NaN/Inf, no spike[/]", border_style="green",
                        title_align="left"))
    if verbose and r.history:
        console.print(_history(r))
    for note in tuple(result.notes) + r.notes:
        console.print(f"[dim]note: {note}[/]")
