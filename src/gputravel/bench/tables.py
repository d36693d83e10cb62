"""`gputravel bench tables`: the markdown tables of docs/benchmarks.md, written from the JSON
files behind them, so a table and its data cannot drift apart.

A table in the document sits between two markers::

    <!-- table: results/bench-travel-2026-11-24.json travel -->
    (written by this module: the table, then a line naming its data)
    <!-- /table -->

The opening marker holds the source (a path relative to the document, or a glob with one
``*``), the kind (``KINDS``) and options (``name=value``; quote a value with spaces, as in
a shell). ``plot=results/X.png`` adds a link to a figure, drawn from the data when the kind
can draw one and the figure is missing or older than the data. ``rewrite`` replaces what
lies between the markers; ``check`` lists every table that differs from its data, every
figure missing, and every table outside markers. A table with no data may stand only under
a heading saying "no data kept", or right after a ``<!-- static: why -->`` line (a table of
the paper's figures, say).
"""

from __future__ import annotations

import json
import re
import shlex
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from gputravel.bench import table_kinds as tk, table_kinds_links as tl, table_kinds_paper as tp, table_kinds_train as tt
from gputravel.errors import BadInput
from gputravel.files import atomic_write_bytes

KINDS: dict[str, Callable[[tk.Source], tk.Table]] = {
    "travel": tk.travel, "travel-targets": tk.travel_targets, "ab-travel": tk.ab_travel, "ab-codec": tk.ab_codec,
    "ddp": tk.ddp, "compare-time": tl.compare_time, "compare-speedup": tl.compare_speedup,
    "compare-targets": tl.compare_targets, "demo": tl.demo, "demo-steps": tl.demo_steps, "scale": tl.scale, "scale-buffers": tl.scale_buffers,
    "generic": tl.generic,
    "travel-paper": tp.travel_paper, "compare-profiles": tp.compare_profiles, "compare-paper": tp.compare_paper,
    "compare-tie-break": tp.compare_tie_break, "compare-table2": tp.compare_table2,
    "plan-worked-example": tp.plan_worked_example,
    "train": tt.train, "train-methods": tt.train_methods, "fl-rounds": tt.fl_rounds, "fl-sweep": tt.fl_sweep,
    "fl-crossover": tt.fl_crossover, "fl-loss-gap": tt.fl_loss_gap,
}
OPEN = re.compile(r"^<!-- table: (?P<spec>.*?) -->\s*$")
CLOSE = "<!-- /table -->"
STATIC = re.compile(r"^<!-- static: .+ -->\s*$")
NO_DATA_HEADING = "no data kept"


@dataclass(frozen=True)
class Marker:
    line: int  # 1-based, of the opening marker
    source: str
    kind: str
    options: dict[str, str]


def parse_marker(spec: str, line: int) -> Marker:
    try:
        words = shlex.split(spec)
    except ValueError as exc:
        raise BadInput(f"line {line}: the table marker does not parse: {exc}") from None
    if len(words) < 2 or "=" in words[0] or "=" in words[1]:
        raise BadInput(f"line {line}: a table marker reads <!-- table: SOURCE KIND [name=value ...] -->")
    source, kind, *rest = words
    if kind not in KINDS:
        raise BadInput(f"line {line}: unknown kind of table {kind!r}; the kinds: {', '.join(sorted(KINDS))}")
    options = {}
    for word in rest:
        name, eq, value = word.partition("=")
        if not eq or not name:
            raise BadInput(f"line {line}: option {word!r} is not name=value")
        options[name] = value
    return Marker(line, source, kind, options)


# ----------------------------------------------------------------------------- sources
def load_source(marker: Marker, base: Path) -> tk.Source:
    """Read the marker's files. A glob's files are grouped by what its * matched, less a
    trailing run number (``-3``), which orders the runs of a group."""
    if marker.source.count("*") > 1:
        raise BadInput(f"line {marker.line}: a source may hold one * at most")
    paths = sorted(base.glob(marker.source), key=_natural) if "*" in marker.source else [base / marker.source]
    if not paths or not all(p.is_file() for p in paths):
        raise BadInput(f"line {marker.line}: no data file at {marker.source} (relative to {base})")
    files, groups = [], []
    for p in paths:
        try:
            data = json.loads(p.read_text())
        except (OSError, ValueError) as exc:
            raise BadInput(f"line {marker.line}: {p.name} is not readable JSON: {exc}") from None
        files.append((p.relative_to(base).as_posix(), data))
        groups.append(_group(marker.source, p.relative_to(base).as_posix()))
    return tk.Source(tuple(files), marker.options, tuple(groups))


def _natural(path: Path) -> list:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", path.name)]


def _group(pattern: str, path: str) -> tuple[str, int | None]:
    if "*" not in pattern:
        return "", None
    head, tail = pattern.split("*")
    star = path[len(head): len(path) - len(tail)]
    m = re.fullmatch(r"(.*?)-?(\d+)", star)
    return (m.group(1), int(m.group(2))) if m else (star, None)


# ----------------------------------------------------------------------------- one table
def render(marker: Marker, base: Path) -> str:
    """What lies between the markers: the table, then the line that names its data."""
    src = load_source(marker, base)
    try:
        table = KINDS[marker.kind](src)
    except (KeyError, TypeError, ZeroDivisionError, IndexError) as exc:
        raise BadInput(f"line {marker.line}: {marker.source} does not hold what a {marker.kind} table needs "
                       f"({type(exc).__name__}: {exc})") from None
    except BadInput as exc:
        raise BadInput(f"line {marker.line}: {exc}") from None
    lines = ["", table.markdown(), "", data_line(marker.source, src)]
    if "plot" in marker.options:
        lines.append(f"Figure: [{marker.options['plot']}]({marker.options['plot']}).")
    return "\n".join(lines) + "\n"


def data_line(source: str, src: tk.Source) -> str:
    """Where the table comes from, with the facts the files record about their runs."""
    datas = [d for _, d in src.files]
    if len(datas) == 1:
        where = f"Data: [{source}]({source})"
    else:
        where = f"Data: the {len(datas)} files `{source}`"
    facts = []
    for key in ("command", "machine", "link"):
        values = list(dict.fromkeys(str(d[key]) for d in datas if d.get(key)))
        if values:
            facts.append(f"{key} {values[0]}" + (f" (and {len(values) - 1} other)" if len(values) > 1 else ""))
    dates = sorted(_when(d["date"]) for d in datas if d.get("date"))
    if dates:
        facts.append(_span(dates[0], dates[-1]))
    # A file without the block predates the profiles: it ran emulated, which is worth saying
    # only beside a file that names its profile.
    profiles = list(dict.fromkeys(tp.profile_of(d) for d in datas))
    if any(d.get("hardware") for d in datas):
        facts.append("hardware profile " + ", ".join(profiles))
    return where + ("; " + "; ".join(facts) if facts else "") + "."


def _when(iso: str) -> str:
    """2026-11-24T11:11:27+00:00 -> 2026-11-24 11:11 UTC (the benchmarks write UTC)."""
    m = re.match(r"(\d{4}-\d\d-\d\d)T(\d\d:\d\d)", iso)
    return f"{m.group(1)} {m.group(2)} UTC" if m else iso


def _span(first: str, last: str) -> str:
    if first == last:
        return first
    if first[:10] == last[:10]:  # the same day: 2026-11-24 11:11 to 11:16 UTC
        return f"{first.removesuffix(' UTC')} to {last[11:]}"
    return f"{first} to {last}"



# ----------------------------------------------------------------------------- the document
def blocks(text: str) -> list[tuple[Marker, int, int]]:
    """Each marker with the line range (0-based, end exclusive) of what lies between."""
    lines = text.split("\n")
    out: list[tuple[Marker, int, int]] = []
    i = 0
    while i < len(lines):
        m = OPEN.match(lines[i])
        if m:
            marker = parse_marker(m.group("spec"), i + 1)
            end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == CLOSE or OPEN.match(lines[j])), None)
            if end is None or OPEN.match(lines[end]):
                raise BadInput(f"line {i + 1}: the table marker is not closed by {CLOSE} before the next one")
            out.append((marker, i + 1, end))
            i = end
        elif lines[i].strip() == CLOSE:
            raise BadInput(f"line {i + 1}: {CLOSE} without a table marker before it")
        i += 1
    return out


def rewrite(text: str, base: Path) -> tuple[str, list[Marker]]:
    """The document with every table written from its data, and the markers whose table changed."""
    lines = text.split("\n")
    changed = []
    for marker, start, end in reversed(blocks(text)):
        new = render(marker, base).split("\n")[:-1]
        if lines[start:end] != new:
            changed.append(marker)
            lines[start:end] = new
    return "\n".join(lines), sorted(changed, key=lambda m: m.line)


def unbacked_tables(text: str) -> list[int]:
    """Lines where a markdown table starts outside any marker, not under a "no data kept"
    heading and not right after a ``<!-- static: ... -->`` line."""
    inside = set()
    for _, start, end in blocks(text):
        inside.update(range(start, end))
    headings: list[tuple[int, str]] = []
    out, fenced, prev = [], False, ""
    for i, line in enumerate(text.split("\n")):
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and (h := re.match(r"^(#+)\s+(.*)", line)):
            level = len(h.group(1))
            headings = [x for x in headings if x[0] < level] + [(level, h.group(2).lower())]
        elif not fenced and line.startswith("|") and not prev.startswith("|") and i not in inside:
            history = any(NO_DATA_HEADING in title for _, title in headings)
            if not history and not STATIC.match(prev):
                out.append(i + 1)
        prev = line
    return out


# ----------------------------------------------------------------------------- figures
def plotters() -> dict[str, Callable[[dict, Path], object]]:
    """Kinds whose data can draw their figure."""
    from gputravel.bench import compare  # lazy: matplotlib and the cohort stack, only to draw a figure

    return {"compare-time": compare.plot, "compare-speedup": compare.plot}


def figures(text: str, base: Path, *, draw: bool) -> list[str]:
    """Each marker's plot= figure: drawn from the data where missing or older than it (when
    ``draw``); the problems left (a figure missing that nothing can draw)."""
    problems = []
    for marker, _, _ in blocks(text):
        if "plot" not in marker.options:
            continue
        png = base / marker.options["plot"]
        stale = not png.is_file() or ("*" not in marker.source and
                                      png.stat().st_mtime < (base / marker.source).stat().st_mtime)
        if stale and draw:
            draw_fn = plotters().get(marker.kind)
            if draw_fn is not None:
                draw_fn(load_source(marker, base).data, png)
                continue
        if not png.is_file():
            problems.append(f"line {marker.line}: figure {marker.options['plot']} is missing")
    return problems


def check(doc: Path) -> list[str]:
    """Every way the document disagrees with its data, one line each; empty when none."""
    text = _read(doc)
    _, changed = rewrite(text, doc.parent)
    problems = [f"line {m.line}: the {m.kind} table differs from {m.source} (run `gputravel bench tables`)"
                for m in changed]
    problems += figures(text, doc.parent, draw=False)
    problems += [f"line {n}: a table with no data behind it (put it between table markers, under a heading "
                 f"saying '{NO_DATA_HEADING}', or after a <!-- static: why --> line)" for n in unbacked_tables(text)]
    return problems


def write(doc: Path) -> tuple[list[Marker], list[str]]:
    """Rewrite the document's tables from their data and draw stale figures; the markers whose
    table changed, and what is still wrong (figures missing, tables outside markers)."""
    text = _read(doc)
    new, changed = rewrite(text, doc.parent)
    if new != text:
        atomic_write_bytes(doc, new.encode())
    problems = figures(new, doc.parent, draw=True)
    problems += [f"line {n}: a table with no data behind it" for n in unbacked_tables(new)]
    return changed, problems


def _read(doc: Path) -> str:
    try:
        return Path(doc).read_text()
    except OSError as exc:
        raise BadInput(f"cannot read {doc}: {exc.strerror}") from None
