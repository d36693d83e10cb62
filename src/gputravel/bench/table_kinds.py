"""The kinds of table `gputravel bench tables` can write, one function per kind.

A kind turns the JSON files behind one table (already read, in ``Source.files``) and the
marker's options into markdown rows. Adding a kind: write ``def my_kind(src: Source) ->
Table`` and list it in ``KINDS``; docs/benchmarks.md then names it in a marker. Kinds read
only the fields they need, so a benchmark may add fields without breaking its table.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass, field

from gputravel.errors import BadInput


@dataclass(frozen=True)
class Source:
    """What a marker names: its files (path as written in the marker, parsed JSON) and options."""

    files: tuple[tuple[str, dict], ...]
    options: dict[str, str] = field(default_factory=dict)
    groups: tuple[tuple[str, int | None], ...] = ()  # per file: what the glob's * matched, run number

    @property
    def data(self) -> dict:
        """The one file of a single-file kind."""
        if len(self.files) != 1:
            raise BadInput(f"this kind of table takes one file, the marker matched {len(self.files)}")
        return self.files[0][1]

    def option(self, name: str, default: str) -> str:
        return self.options.get(name, default)


@dataclass(frozen=True)
class Table:
    header: tuple[str, ...]
    rows: tuple[tuple[str, ...], ...]
    align: str = "l"  # "r": numbers, right-aligned from the second column on

    def markdown(self) -> str:
        rule = ["---"] + [("---:" if self.align == "r" else "---")] * (len(self.header) - 1)
        lines = [self.header, tuple(rule), *self.rows]
        return "\n".join("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |" for cells in lines)


# ----------------------------------------------------------------------------- formats
def num(x: float | None, digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def pct(x: float | None, digits: int = 1) -> str:
    return "-" if x is None else f"{x * 100:.{digits}f} %"


def link_label(bw: float | None) -> str:
    return "uncapped" if bw is None else f"{bw:g} Mbit/s"


def met(ok: bool) -> str:
    return "yes" if ok else "no"


# ----------------------------------------------------------------------------- bench travel
#: The paper's names for the travel's steps (Table 1); a step not listed shows its key.
STEP_NAMES = {"o_cleanup": "scrub", "o_export": "O export", "dh_switch": "switch to H", "dh_import": "H import",
              "dh_copy": "H copy", "dh_export": "H export", "tls": "TLS", "o_switch": "switch to O",
              "o_import": "O import", "o_rotate": "O rotate"}


def travel(src: Source) -> Table:
    """`bench travel`: the per-step medians per buffer size (paper Table 1)."""
    rows = src.data["rows"]
    steps = list(rows[0]["steps_ms"])
    header = ("MiB", *(STEP_NAMES.get(s, s) for s in steps), "total", "fixed", "copy GB/s")
    body = tuple((str(r["size_mib"]), *(num(r["steps_ms"][s]) for s in steps), num(r["total_ms"]),
                  num(r["fixed_ms"]), num(r["copy_gbps"])) for r in rows)
    return Table(header, body, "r")


def _copy_limit(data: dict) -> tuple[float, str]:
    """The limit the copy is measured against: the two-core pipeline where the run measured it."""
    if data.get("pipeline_limit_gbps"):
        return data["pipeline_limit_gbps"], "two-core pipeline limit"
    return data["crypto_limit_gbps"], "crypto limit"


def travel_targets(src: Source) -> Table:
    """`bench travel`: the targets at the largest size (or ``size=``): copy against the limit,
    fixed overhead, scrub share."""
    data = src.data
    row = _row_at(data["rows"], src.option("size", ""))
    limit, name = _copy_limit(data)
    ratio = row["copy_gbps"] / limit
    scrub, copy = row["steps_ms"]["o_cleanup"], row["steps_ms"]["dh_copy"]
    body = [(f"copy throughput >= 0.8 x {name}", f"{num(row['copy_gbps'])} GB/s = **{num(ratio)} x** "
             f"{num(limit)} GB/s", met(ratio >= 0.8))]
    if name != "crypto limit":
        one_core = row["copy_gbps"] / data["crypto_limit_gbps"]
        body.append(("(for reference) copy against the one-core crypto limit",
                     f"{num(one_core)} x {num(data['crypto_limit_gbps'])} GB/s", "-"))
    body += [("fixed overhead <= 3 ms", f"**{num(row['fixed_ms'])} ms**", met(row["fixed_ms"] <= 3)),
             ("scrub <= 10% of the copy", f"{num(scrub)} / {num(copy)} = **{pct(scrub / copy)}**",
              met(scrub <= 0.1 * copy))]
    return Table((f"target ({row['size_mib']} MiB)", "measured", "met?"), tuple(body))


def _row_at(rows: list[dict], size: str) -> dict:
    if not size:
        return rows[-1]
    for r in rows:
        if str(r["size_mib"]) == size:
            return r
    raise BadInput(f"no row of {size} MiB in the file")


def ab_travel(src: Source) -> Table:
    """A/B of `bench travel` runs: per group (``label.GROUP=``) the medians of its runs, or with
    ``rows=each`` one row per run. Ratios are taken within each run, then the median."""
    with_pipeline = all(d.get("pipeline_limit_gbps") for _, d in src.files)
    header = ("code", "crypto limit GB/s", *(("pipeline limit GB/s",) if with_pipeline else ()), "copy GB/s",
              "copy / limit", "fixed overhead ms", "scrub share of the copy", "travel total ms")
    size = src.option("size", "")

    def measures(data: dict) -> list[float]:
        r = _row_at(data["rows"], size)
        limit, _ = _copy_limit(data)
        extra = [data["pipeline_limit_gbps"]] if with_pipeline else []
        return [data["crypto_limit_gbps"], *extra, r["copy_gbps"], r["copy_gbps"] / limit, r["fixed_ms"],
                r["steps_ms"]["o_cleanup"] / r["steps_ms"]["dh_copy"], r["total_ms"]]

    def cells(values: list[float]) -> tuple[str, ...]:
        *rates, fixed, scrub, total = values
        return (*(num(v) for v in rates), num(fixed), pct(scrub), num(total, 1))

    return Table(header, tuple((label, *cells(v)) for label, v in _ab_rows(src, measures)), "r")


def _ab_rows(src: Source, measures: Callable[[dict], list[float]]) -> list[tuple[str, list[float]]]:
    """Rows of an A/B table: one per group (medians over its runs) or, with rows=each, one per
    run, ordered by run number and then by group."""
    labels = _group_labels(src)
    runs: dict[str, list[tuple[int | None, dict]]] = {g: [] for g in labels}
    for (_, data), (group, run) in zip(src.files, src.groups):
        if group in runs:
            runs[group].append((run, data))
    if src.option("rows", "median") == "each":
        order = sorted({run or 0 for g in runs.values() for run, _ in g})
        return [(f"{labels[g]}, {n}", measures(d)) for n in order for g in labels for run, d in runs[g]
                if (run or 0) == n]
    out = []
    for g, label in labels.items():
        if not runs[g]:
            raise BadInput(f"no file of group {g!r} matched the marker")
        per_run = [measures(d) for _, d in runs[g]]
        out.append((label, [statistics.median(col) for col in zip(*per_run)]))
    return out


def _group_labels(src: Source) -> dict[str, str]:
    """label.GROUP=TEXT options, in the order written; without any, every group by its name."""
    given = {k[len("label."):]: v for k, v in src.options.items() if k.startswith("label.")}
    return given or {g: g for g in dict.fromkeys(g for g, _ in src.groups)}


# ----------------------------------------------------------------------------- bench codec
def ab_codec(src: Source) -> Table:
    """A/B of `bench codec` runs, two groups (``label.A=`` then ``label.B=``): per message the
    bytes and median microseconds of each, as A / B (medians over a group's runs)."""
    labels = _group_labels(src)
    if len(labels) != 2:
        raise BadInput("an ab-codec table compares exactly two groups (label.A=... label.B=...)")
    per_group = {g: _codec_medians([d for (_, d), (grp, _) in zip(src.files, src.groups) if grp == g])
                 for g in labels}
    a, b = per_group.values()
    la, lb = labels.values()
    header = ("message", f"bytes {la} / {lb}", f"encode µs {la} / {lb}", f"decode µs {la} / {lb}",
              f"round trip µs {la} / {lb}")
    body = tuple((m, f"{a[m]['bytes']:.0f} / {b[m]['bytes']:.0f}",
                  *(f"{num(a[m][k])} / {num(b[m][k])}" for k in ("encode_us", "decode_us", "round_trip_us")))
                 for m in a if m in b)
    return Table(header, body, "r")


def _codec_medians(files: list[dict]) -> dict[str, dict[str, float]]:
    if not files:
        raise BadInput("a group of the ab-codec marker matched no file")
    out: dict[str, dict[str, float]] = {}
    for r in files[0]["rows"]:
        rows = [x for d in files for x in d["rows"] if x["message"] == r["message"]]
        out[r["message"]] = {k: statistics.median(x[k] for x in rows)
                             for k in ("bytes", "encode_us", "decode_us", "round_trip_us")}
    return out


# ----------------------------------------------------------------------------- bench ddp
def ddp(src: Source) -> Table:
    """`bench ddp`: iteration and all-reduce medians, plain / naive / encrypted, x = encrypted
    over plain (no all-reduce ratio with one GPU: the ring does nothing there)."""
    header = ("GPUs", "model", "iteration plain", "naive", "encrypted", "x", "all-reduce plain", "naive",
              "encrypted", "x")
    body = []
    for r in src.data["rows"]:
        it, ar = r["iter_ms"], r["allreduce_ms"]
        ar_x = "-" if r["gpus"] == 1 else num(ar["encrypted"] / ar["plain"])
        body.append((str(r["gpus"]), r["model"], num(it["plain"], 1), num(it["encrypted_naive"], 1),
                     num(it["encrypted"], 1), num(it["encrypted"] / it["plain"]), num(ar["plain"]),
                     num(ar["encrypted_naive"]), num(ar["encrypted"]), ar_x))
    return Table(header, tuple(body), "r")
