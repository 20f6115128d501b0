"""Rich terminal output for reports. Makes no decisions: everything shown is in the Report."""

from __future__ import annotations

import math

from rich.console import Console, Group
from rich.panel import Panel
from rich.syntax import Syntax
from rich.table import Column, Table
from rich.text import Text

from ..base.report import Report, Status


def g(x) -> str:
    if x is None:
        return "-"
    if isinstance(x, str):
        return x
    if isinstance(x, float):
        if not math.isfinite(x):
            return str(x)
        if x != 0 and (abs(x) >= 1e5 or abs(x) < 1e-3):
            return f"{x:.3e}"
        return f"{x:.4g}"
    return str(x)


def _pct(x) -> str:
    return "-" if x is None else ("0" if x == 0 else f"{100 * x:.2g}%")


_MARK = {True: "[green]✓ verified[/]", False: "[red]✗ failed over the horizon[/]", None: "[dim]not verified[/]"}


def render_report(report: Report, console: Console, *, verbose: bool = False) -> None:
    """One screen by default (the verdict, one line per finding, the top fix with its code, the other fixes
    one line each); ``verbose``: every finding's evidence and fixes, the precisions, the modules, the history."""
    console.print(_verdict(report))
    if not verbose:
        _one_screen(report, console)
        return
    if report.findings:
        console.print(_findings(report))
        for i, f in enumerate(report.findings):
            for fix in f.fixes[:3 if i == 0 else 1]:
                console.print(_fix_panel(fix))
            for fix in f.fixes[3 if i == 0 else 1:]:
                if fix.verification is not None:   # trained over the horizon: its verdict is shown, not hidden
                    console.print(Text.from_markup(f"  also trained over the horizon: [bold]{fix.title}[/]  "
                                                   f"{_MARK[fix.verified]}"))
                    console.print(Text(f"    {fix.verify_note}", style="dim italic"))
    for part, table in ((report.precisions, _precisions), (report.context, _context), (report.history, _history)):
        if part:
            console.print(table(report))
    _notes(console, report.notes)


def _notes(console: Console, notes) -> None:
    for note in notes:
        console.print(f"[dim]note: {note}[/]")


def _fix_panel(fix, *, why: bool = True) -> Panel:
    title = Text.from_markup(f"[bold]{fix.title}[/]  {_MARK[fix.verified]}")
    body = [Syntax(fix.code, "python", theme="ansi_dark", word_wrap=True, background_color="default")]
    if fix.why and why:
        body.append(Text(fix.why, style="dim"))
    if fix.verify_note:
        body.append(Text(fix.verify_note, style="dim italic"))
    return Panel(Group(*body), title=title, title_align="left", border_style="cyan")


def _one_screen(r: Report, console: Console) -> None:
    first: dict[tuple, object] = {}   # one finding per story: a later one with the same cause, phase, module repeats it
    for f in r.findings:
        first.setdefault((f.cause, f.phase, f.module), f)
    stories = list(first.values())
    if stories:
        console.print(Text("Findings (most likely first)", style="bold"))
        for i, f in enumerate(stories[:4], 1):
            lines = [e for e in f.evidence if not (r.origin and e.startswith(_ORIGIN_PREFIXES))]
            cause = f.cause.value + (f" · {f.mechanism.value}" if f.mechanism is not None else "")
            line = Text.from_markup(f"{i:>2}  [bold]{cause}[/] ({f.confidence:.2f})  {f.phase.value} "
                                    f"{f.module or '(model)'}  ")
            line.append(lines[0] if lines else "", style="dim")
            console.print(line, no_wrap=True, overflow="ellipsis")
        fixes = list(stories[0].fixes)
        if fixes:
            console.print(_fix_panel(fixes[0], why=False))
        for fix in fixes[1:]:
            note = f"  [dim]{fix.verify_note}[/]" if fix.verify_note else ""
            console.print(Text.from_markup(f"  also: [bold]{fix.title}[/]  {_MARK[fix.verified]}{note}"),
                          no_wrap=True, overflow="ellipsis")
    for note in r.notes[:2]:
        console.print(Text(f"note: {note}", style="dim"), no_wrap=True, overflow="ellipsis")
    hidden = len(r.findings) - min(len(stories), 4) + len(r.notes[2:])
    more = f"{hidden} more finding(s) and note(s), " if hidden else ""
    console.print(Text(f"--verbose: {more}every finding's evidence and fixes, the precisions, module outputs, "
                       "recent steps", style="dim"), no_wrap=True, overflow="ellipsis")


def _grid() -> Table:
    """Two columns, the label in bold: the rows of a verdict panel."""
    t = Table.grid(padding=(0, 2))
    t.add_column(style="bold")
    t.add_column()
    return t


def _verdict(r: Report) -> Panel:
    o = r.origin
    lines = _grid()
    if r.status is Status.FINITE:
        title, style = "healthy: no NaN/Inf, no spike", "green"
        lines.add_row("step", g(r.step) if r.step is not None else "all replayed steps")
    else:
        what = {"nonfinite": "non-finite values", "spike": "loss/gradient spike", "diverging": "slow divergence",
                "error": "error"}[r.status.value]
        if r.error and o is None:
            what = "your code raised"
        born = f" born in {o.phase.value}" if o else ""
        title, style = f"step {r.step}: {what}{born}", "red"
        if pos := _position(r):
            lines.add_row("data", pos)
        if r.error:
            lines.add_row("raised", r.error)
        if o:
            op = f"{o.node} ({o.op})" if o.node else o.op
            lines.add_row("where", f"{o.module or '(model)'}   {op}   [{o.precision}]  → {o.kind}")
            if o.source:
                lines.add_row("source", f"{o.source}" + (f"   {o.code}" if o.code else ""))
            if o.parameter:
                lines.add_row("parameter", o.parameter)
            if o.samples:
                micro = f"micro-batch {o.micro}: " if o.micro is not None else ""
                lines.add_row("samples", micro + ", ".join(map(str, o.samples)))
        top = r.top
        if top:
            began = [e for e in top.evidence if e.startswith("onset: ") or " did not recover (" in e]
            # a mechanism finding's lines tell the trajectory (its own row); the cause row quotes the op's finding
            said = next((f for f in r.findings if f.mechanism is None and f.cause is top.cause), top) \
                if top.mechanism is not None else top
            specific = [e for e in said.evidence if not e.startswith(_ORIGIN_PREFIXES) and e not in began] \
                or list(said.evidence)
            lines.add_row("cause", f"[bold]{top.cause.value}[/] ({top.confidence:.2f})  {specific[-1] if specific else ''}")
            if top.onset is not None and top.mechanism is None:   # a mechanism's row says when it began
                said = began[0].removeprefix("onset: ").removeprefix(f"step {top.onset} was ") if began else ""
                lines.add_row("onset", f"step {top.onset}" + (f": {said}" if said else ""))
            if top.mechanism is not None:
                began = f", began at step {top.onset}" if top.onset is not None else ""
                lines.add_row("mechanism", f"[bold]{top.mechanism.value}[/] in {top.module or '(model)'}{began}: "
                              + (top.evidence[0] if top.evidence else ""))
    if r.trajectory and r.trajectory.get("warnings"):
        w = r.trajectory["warnings"][0]
        lines.add_row("[yellow]warned[/]", f"[yellow]step {w['step']}: {w['message']}[/]")
    lines.add_row("run", f"{r.entry}  ·  {r.precision}  ·  {r.device}"
                  + (f"  ·  {r.autocast_policy}" if r.autocast_policy else "")
                  + (f"  ·  reached by {r.reached_by}" if r.reached_by else ""))
    fid = r.fidelity
    if fid is not None and fid.reproduced is False:
        lines.add_row("[yellow]fidelity[/]", "[yellow]the rerun does not reproduce the replayed step "
                      f"({fid.tolerance}); confidence lowered. Likely: {fid.reasons[0] if fid.reasons else '?'}[/]")
    return Panel(lines, title=f"[bold]nanprobe {r.command}: {title}[/]", border_style=style, title_align="left")


def _position(r: Report) -> str | None:
    """Where the step sits in the data: epoch, step of the epoch, batches, micro-batches."""
    p = r.position
    if not p:
        return None
    parts = []
    if p.get("epoch") is not None:
        parts.append(f"epoch {p['epoch']}, step {p['index']} of the epoch")
    items = p.get("items") or []
    if items:
        parts.append(f"batch {items[0]}" if len(items) == 1 else f"batches {items[0]}-{items[-1]}")
    if p.get("micro_batches", 1) > 1:
        parts.append(f"{p['micro_batches']} micro-batches")
    return ", ".join(parts) or None


def _findings(r: Report) -> Table:
    t = Table(Column("#", justify="right", width=2), Column("cause", style="bold"), Column("conf", justify="right"),
              "phase", "module", Column("evidence", ratio=1), title="Findings (most likely first)",
              title_justify="left", expand=True)
    for i, f in enumerate(r.findings, 1):
        lines = [e for e in f.evidence if not (r.origin and e.startswith(_ORIGIN_PREFIXES))]
        cause = f.cause.value + (f"\n{f.mechanism.value}" if f.mechanism is not None else "")
        t.add_row(str(i), cause, f"{f.confidence:.2f}", f.phase.value, f.module or "-",
                  "\n".join(lines[:8 if f.mechanism is not None else 5] if i == 1 else lines[-2:]))
    return t


# evidence lines that repeat the verdict panel (the origin line and its code)
_ORIGIN_PREFIXES = ("forward: ", "backward: ", "update: ", "code: ")


def _precisions(r: Report) -> Table:
    t = Table("precision", Column("loss", justify="right"), Column("grad norm", justify="right"), "finite",
              "first non-finite", title=f"The same step in other precisions (step {r.step})", title_justify="left")
    for name, p in r.precisions.items():
        o = p.origin
        first = f"{o.phase.value} {o.module or '(model)'} {o.node or o.op}" if o else (p.note or "-")
        t.add_row(name + (" (run)" if name == r.precision else ""), g(p.loss), g(p.grad_norm),
                  "[green]yes[/]" if p.finite else "[red]no[/]", first)
    return t


def _context(r: Report) -> Table:
    title = "Module outputs up to the origin" if r.origin is not None and r.origin.phase.value == "forward" \
        else "The last module outputs of the forward pass"
    over = "> fp16 max" if r.precision != "bf16" else "> bf16 max"
    t = Table("module", "dtype", *(Column(c, justify="right") for c in ("|x| max", "min |x|>0", "zeros", over,
                                                                        "subnormal")),
              title=f"{title} (forward order)", title_justify="left")
    for m in r.context:
        t.add_row(m.module or "(model)", m.dtype, g(m.absmax), g(m.min_nonzero), _pct(m.zero_frac), _pct(m.over_frac),
                  _pct(m.under_frac), style=None if m.finite else "red")
    return t


def _history(r: Report) -> Table:
    epochs = any(h.epoch is not None for h in r.history)
    cols = ("step",) + (("epoch", "of epoch") if epochs else ()) + ("loss", "grad norm", "lr", "|dw|/|w|")
    t = Table(*(Column(c, justify="right") for c in cols), "note", title="Recent steps", title_justify="left")
    for h in r.history[-6:]:
        note = "skipped (GradScaler)" if h.skipped else ("" if h.finite else "[red]non-finite[/]")
        epoch = (str(h.epoch), str(h.index)) if epochs and h.epoch is not None else (("-", "-") if epochs else ())
        t.add_row(str(h.step), *epoch, g(h.loss), g(h.grad_norm), g(h.lr), g(h.update_ratio), note)
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
        _notes(console, result.notes)
        return
    lines = _grid()
    losses = [h.loss for h in r.history if h.loss is not None and not h.skipped]
    lines.add_row("steps", f"{result.steps_run} of {result.steps} trained from scratch under nanprobe.Guard")
    if losses:
        lines.add_row("loss", f"{g(losses[0])} → {g(losses[-1])} (last {len(r.history)} steps shown with -v)")
    lines.add_row("run", f"{r.entry}  ·  {r.precision}  ·  {r.device}  ·  {result.seconds:.1f}s")
    console.print(Panel(lines, title="[bold]nanprobe smoke: healthy: no NaN/Inf, no spike[/]", border_style="green",
                        title_align="left"))
    if verbose and r.history:
        console.print(_history(r))
    _notes(console, tuple(result.notes) + r.notes)


def render_comparison(cmp, console: Console) -> None:
    """`nanprobe compare-precisions`: one row per precision, the per-layer top-k tables, the recommendation."""
    bad = [name for name, r in cmp.precisions.items() if r.ran and not r.finite]
    title = "every precision finite" if not bad else f"non-finite in {', '.join(bad)}"
    lines = _grid()
    lines.add_row("step", f"{cmp.step}  (reached by {cmp.reached_by})" if cmp.reached_by else str(cmp.step))
    lines.add_row("run", f"{cmp.entry}  ·  trains in {cmp.precision}  ·  {cmp.device}  ·  reference {cmp.reference}"
                  + (f"  ·  {cmp.autocast_policy}" if cmp.autocast_policy else ""))
    console.print(Panel(lines, title=f"[bold]nanprobe compare-precisions: {title}[/]", title_align="left",
                        border_style="red" if bad else "green"))
    numbers = ("loss", "loss err", "grad norm", "grad cos", "act bits", "grad bits", "underflow")
    t = Table(Column("precision", no_wrap=True), *(Column(c, justify="right", no_wrap=True) for c in numbers),
              Column("first non-finite / note", min_width=24, ratio=1),
              title=f"The same step in each precision (errors vs {cmp.reference}; act/grad bits: headroom below "
                    "the dtype's max, in powers of two)", title_justify="left", expand=True)
    for name, r in cmp.precisions.items():
        label = name + (" (ref)" if r.reference else "")
        if not r.ran:
            t.add_row(label, *["-"] * 7, f"[dim]{r.note}[/]")
            continue
        o = r.origin
        note = f"[red]{o.phase.value} {o.module or '(model)'} {o.node or o.op} → {o.kind}[/]" if o and not r.finite \
            else ""
        if r.scaler is not None:
            sc = r.scaler
            note = (note + " " if note else "") + (
                f"GradScaler at {sc.scale:g}: " + (f"skips, settles at {sc.settled_scale:g}" if sc.skipped and
                                                    sc.settled_scale else "skips at any scale" if sc.skipped else
                                                    "passes"))
        t.add_row(label, g(r.loss), "-" if r.reference else _share_pct(r.loss_rel_err) if r.loss_rel_err is not None
                  and math.isfinite(r.loss_rel_err) else g(r.loss_rel_err),
                  g(r.grad_norm), "-" if r.grad_cosine is None else f"{r.grad_cosine:.5f}",
                  _bits(r.act_headroom_bits), _bits(r.grad_headroom_bits), _share_pct(r.underflow), note or "-",
                  style=None if r.finite else "red")
    console.print(t)
    for title, rows, fmt in ((f"Modules that lose most accuracy vs {cmp.reference} (relative error)",
                              cmp.least_accurate, g),
                             ("Modules closest to overflow (bits of headroom below the dtype's max)",
                              cmp.closest_to_overflow, _bits),
                             ("Modules deepest in underflow (share of values flushed to zero/subnormal)",
                              cmp.deepest_underflow, _share_pct)):
        if not rows:
            continue
        lt = Table("precision", "module", Column("value", justify="right"), "detail", title=title, title_justify="left")
        for x in rows:
            lt.add_row(x.precision, x.module, fmt(x.value), x.detail)
        console.print(lt)
    console.print(Panel(Text(cmp.recommendation), title="[bold]recommendation[/]", title_align="left",
                        border_style="green" if cmp.recommended else "yellow"))
    for d in cmp.disagreements:
        console.print(f"[red]finding: {d['evidence']}[/]")
    _notes(console, cmp.notes)


def _bits(x) -> str:
    return "-" if x is None else f"{x:.1f}"   # inf: "inf", "-inf"


def _shape_range(lo: tuple[int, ...], hi: tuple[int, ...]) -> str:
    if not hi:
        return "()"
    if len(lo) != len(hi):
        return "×".join(map(str, hi)) + " (rank varies)"
    return "×".join(str(a) if a == b else f"{a}..{b}" for a, b in zip(lo, hi))


def render_scan(result, console: Console, *, max_rows: int = 20) -> None:
    """`nanprobe scan-data`: verdict, the problems (step, key, samples), then the per-key summary."""
    r = result
    lines = _grid()
    if r.errors:
        first = r.first_error_step
        title, style = (f"{r.errors} error(s), {r.warnings} warning(s); first bad batch at step {first}", "red")
    elif r.warnings:
        title, style = f"no errors, {r.warnings} warning(s)", "yellow"
    else:
        title, style = "clean: no problem found", "green"
    lines.add_row("scanned", f"{r.batches_scanned} batches" + ("" if r.complete else " (stopped at --limit)"))
    lines.add_row("data", f"{r.entry}  ·  {r.precision}"
                  + (f" (values beyond ±{r.range_max:g} overflow)" if r.range_max else "") + f"  ·  {r.device}")
    labels = f"num_classes {r.num_classes} ({r.num_classes_source})" if r.num_classes else "num_classes unknown"
    lines.add_row("labels", f"{labels}  ·  ignore_index {r.ignore_index}")
    console.print(Panel(lines, title=f"[bold]nanprobe scan-data: {title}[/]", border_style=style,
                        title_align="left"))
    if r.problems:
        t = Table(title="Problems (by step)", title_justify="left", expand=True)
        key_width = min(40, max(len(p.key) for p in r.problems[:max_rows]))
        for col in ("step", "level", "problem", "key", "samples", "detail"):
            t.add_column(col, justify="right" if col == "step" else "left", ratio=1 if col == "detail" else None,
                         overflow="fold", min_width=key_width if col == "key" else None)
        for p in r.problems[:max_rows]:
            level = "[red]error[/]" if p.level == "error" else "[yellow]warning[/]"
            samples = ", ".join(map(str, p.samples)) + (" …" if p.count > len(p.samples) and p.samples else "")
            t.add_row(str(p.step), level, p.code, p.key, samples or "-", p.message)
        console.print(t)
        more = r.problems_total - min(len(r.problems), max_rows)
        if more > 0:
            console.print(f"[dim]… and {more} more problem(s); --json OUT lists "
                          f"{'them' if r.problems_total == len(r.problems) else f'the first {len(r.problems)}'}[/]")
    if r.summary:
        sampled = max((s.moment_batches for s in r.summary), default=0)
        caption = (f"mean/std from {sampled} of {r.batches_scanned} batches (scan.moments_every); min/max and checks "
                   "from all" if 0 < sampled < r.batches_scanned and console.width >= 100 else None)
        t = Table(title="Per key", title_justify="left", caption=caption, caption_justify="left")
        key_width = min(40, max(len(s.key) for s in r.summary))
        wide = console.width >= 100 + max(0, key_width - 20)   # narrow terminals: no mean/std columns
        cols = ("key", "dtype", "shape", "min", "max") + (("mean", "std") if wide else ()) + ("problems",)
        for col in cols:
            t.add_column(col, justify="right" if col in ("min", "max", "mean", "std") else "left",
                         min_width=key_width if col == "key" else None,
                         overflow="fold" if col in ("key", "problems") else "ellipsis")
        for s in r.summary:
            probs = ", ".join(f"{c}×{n}" for c, n in s.problems.items()) or "-"
            kind = ", ".join(s.dtypes) + ("" if s.role in ("float", "int") else f" {s.role}") \
                + (" ragged" if s.ragged else "")
            row = [s.key, kind, _shape_range(s.shape_min, s.shape_max), g(s.min), g(s.max)]
            row += [g(s.mean), g(s.std)] if wide else []
            t.add_row(*row, probs, style="red" if any(c not in ("outlier", "constant") for c in s.problems) else None)
        console.print(t)
    _notes(console, r.notes)


def _share_pct(x) -> str:
    if x is None:
        return "-"
    return "0" if x == 0 else f"{100 * x:.0f}%" if x >= 0.1 else f"{100 * x:.2g}%"
