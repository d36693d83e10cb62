"""Kinds of table over training runs: `bench train` (the paper's Table 2, and the methods side by
side: travel, tls, FedAvg) and `bench fl-sweep` (FedAvg's bytes against the data and the model,
the crossover, the loss gap). See table_kinds.py for how a kind is written.

`bench train` has written two formats. The first (before FL) had one row per link holding a
record per method (``baseline``, ``travelling``) and ``same_losses``; the present one has one
row per method and link (``method``: travel, tls, fl) and a ``checks`` list holding
``same_losses`` per link. :func:`runs` reads both into one shape, so every kind here renders
either.
"""

from __future__ import annotations

from dataclasses import dataclass

from gputravel.bench.table_kinds import Source, Table, link_label, num, pct
from gputravel.errors import BadInput

#: The first format's names for the methods, in the present format's words.
OLD_NAMES = {"travelling": "travel", "baseline": "tls"}
ORDER = ("travel", "tls", "fl")
LABELS = {"travel": "travel", "tls": "tls", "fl": "fl (FedAvg)"}


@dataclass(frozen=True)
class LinkRun:
    """One link of one `bench train` file: a record per method, and the G2 check."""

    bandwidth_mbit: float | None
    methods: dict[str, dict]
    same_losses: bool | None


def runs(data: dict) -> list[LinkRun]:
    """The file's links in the order it measured them, whichever format it has."""
    rows = data["rows"]
    if rows and "method" not in rows[0]:  # the first format: one row per link
        return [LinkRun(r["bandwidth_mbit"], {OLD_NAMES.get(k, k): _old_record(k, v, r) for k, v in r.items()
                                              if isinstance(v, dict) and "tx_s" in v}, r.get("same_losses"))
                for r in rows]
    checks = {c["bandwidth_mbit"]: c.get("same_losses") for c in data.get("checks", [])}
    out: dict[float | None, LinkRun] = {}
    for r in rows:
        bw = r["bandwidth_mbit"]
        out.setdefault(bw, LinkRun(bw, {}, checks.get(bw))).methods[r["method"]] = r
    return list(out.values())


def _old_record(name: str, rec: dict, row: dict) -> dict:
    paper = (row.get("paper") or {}).get(name)
    return {**rec, "paper": paper}


def _ordered(methods: dict[str, dict]) -> list[str]:
    return [m for m in ORDER if m in methods] + sorted(m for m in methods if m not in ORDER)


# ----------------------------------------------------------------------------- bench train
def train(src: Source) -> Table:
    """`bench train`: the paper's Table 2 for this system, the TLS baseline and travelling per
    link, the paper's shares beside (where the run's link is one of the paper's)."""
    header = ("link", "baseline training (s)", "baseline Tx (s)", "baseline Tx %", "ours training (s)",
              "ours Tx (s)", "ours Tx %", "paper baseline Tx %", "paper ours Tx %", "same losses")
    body = []
    for run in runs(src.data):
        b, o = run.methods.get("tls"), run.methods.get("travel")
        if b is None or o is None:
            raise BadInput("a train table needs travel and tls at every link (see train-methods for the others)")
        body.append((link_label(run.bandwidth_mbit), num(b["training_s"]), num(b["tx_s"], 3), pct(b["tx_share"], 3),
                     num(o["training_s"]), num(o["tx_s"], 3), pct(o["tx_share"], 3),
                     pct((b.get("paper") or {}).get("tx_share"), 3), pct((o.get("paper") or {}).get("tx_share"), 3),
                     _yes(run.same_losses)))
    return Table(header, tuple(body), "r")


def _yes(ok: bool | None) -> str:
    return "-" if ok is None else ("yes" if ok else "NO")


def train_methods(src: Source) -> Table:
    """`bench train`, one row per method and link: time, bytes over the links, holder compute,
    held-out loss, FL's rounds and framework. With several files (a glob of repeated runs) the
    values are the last run's, and in brackets the range over all runs where they differ."""
    per_file = [runs(d) for _, d in _by_run(src)]
    last = per_file[-1]
    body = []
    for run in last:
        for method in _ordered(run.methods):
            recs = [r.methods[method] for f in per_file for r in f
                    if r.bandwidth_mbit == run.bandwidth_mbit and method in r.methods]
            checks = [r.same_losses for f in per_file for r in f if r.bandwidth_mbit == run.bandwidth_mbit]
            body.append(_method_row(method, run.bandwidth_mbit, recs, checks))
    if not body:
        raise BadInput("no method row in the file")
    header = ("method", "link", "training (s)", "Tx (s)", "bytes over the links", "holder compute (s)",
              "final loss (held out)", "rounds", "framework", "same losses as the other (G2)")
    return Table(header, tuple(body))


def _by_run(src: Source) -> list[tuple[str, dict]]:
    """The files in run order (a file without a run number is the first run)."""
    order = sorted(range(len(src.files)), key=lambda i: (src.groups[i][1] or 1) if src.groups else 0)
    return [src.files[i] for i in order]


def _method_row(method: str, bw: float | None, recs: list[dict], checks: list[bool | None]) -> tuple[str, ...]:
    rec = recs[-1]

    def ranged(key: str, fmt) -> str:
        values = [r.get(key) for r in recs]
        if rec.get(key) is None:
            return "-"
        shown = [fmt(v) for v in values if v is not None]
        low, high = fmt(min(v for v in values if v is not None)), fmt(max(v for v in values if v is not None))
        return fmt(rec[key]) + (f" [{low}-{high}]" if len(set(shown)) > 1 else "")

    g2 = "-"
    if method in ("travel", "tls") and any(c is not None for c in checks):
        g2 = _yes(all(checks)) + (f" ({sum(bool(c) for c in checks)} of {len(checks)} runs)" if len(checks) > 1 else "")
    return (LABELS.get(method, method), link_label(bw), ranged("training_s", num), ranged("tx_s", lambda v: num(v, 3)),
            ranged("bytes_over_link", lambda v: f"{v:,}"), ranged("holder_compute_s", lambda v: num(v, 1)),
            ranged("final_loss", lambda v: num(v, 4)), "-" if rec.get("rounds") is None else str(rec["rounds"]),
            str(rec.get("framework") or "-"), g2)


def fl_rounds(src: Source) -> Table:
    """`bench train` with fl: FedAvg's rounds, one row each (its ``round_log``): time, what
    the holders sampled and replied, and the failures Flower reported."""
    fl = [r for run in runs(src.data) for m, r in run.methods.items() if m == "fl"]
    if not fl:
        raise BadInput("no fl row in the file")
    body = []
    for r in fl[0]["fl"]["round_log"]:
        failures = "; ".join(f.get("reason", "?") for f in r.get("failures", [])) or "-"
        body.append((str(r["round"]), num(r["wall_s"], 1), num(r.get("tx_s"), 1), str(r["sampled"]),
                     ", ".join(r["replied"]), failures))
    return Table(("round", "time (s)", "Tx (s)", "holders sampled", "replied", "failures (Flower's words)"),
                 tuple(body))


# ----------------------------------------------------------------------------- bench fl-sweep
def model_name(cell: dict) -> str:
    return f"{cell['n_layer']}x{cell['n_embd']}"


def fl_sweep(src: Source) -> Table:
    """`bench fl-sweep`: per data size (tokens per holder), one field (``field=``, default
    bytes_over_link) for travel and tls (which do not depend on the model) and FedAvg per model."""
    cells = src.data["cells"]
    key = src.option("field", "bytes_over_link")
    sizes = sorted({c["holder_tokens"] for c in cells})
    models = list(dict.fromkeys(model_name(c) for c in sorted(cells, key=lambda c: c["params"])))
    cols = [(m, None) for m in ("travel", "tls") if any(m in c["rows"] for c in cells)] + [("fl", n) for n in models]
    body = []
    for size in sizes:
        at = [c for c in cells if c["holder_tokens"] == size]
        row = [f"{size:,}"]
        for method, model in cols:
            rec = next((c["rows"][method] for c in at if method in c["rows"] and model in (None, model_name(c))), None)
            row.append(_value(None if rec is None else rec.get(key)))
        body.append(tuple(row))
    header = ("tokens / holder", *(m if n is None else f"FedAvg {n}" for m, n in cols))
    return Table(header, tuple(body), "r")


def _value(v: object) -> str:
    if v is None:
        return "-"
    if isinstance(v, int):
        return f"{v:,}"
    return num(v, 3) if isinstance(v, float) else str(v)


def fl_crossover(src: Source) -> Table:
    """`bench fl-sweep`: per model, what FedAvg moves per holder and round, and the tokens per
    holder at which it would move as few bytes as the TLS baseline or travelling (``crossover``)."""
    x = src.data["crossover"]
    body = tuple((name, f"{m['params']:,}", f"{m['fl_bytes_per_holder_round']:,.0f}", num(m["overhead"]),
                  _tokens(m["tls_parity_holder_tokens"]), _tokens(m["travel_parity_holder_tokens"]))
                 for name, m in sorted(x["models"].items(), key=lambda kv: kv[1]["params"]))
    header = ("model", "parameters", "FedAvg bytes per holder and round", "x twice the fp32 model",
              f"parity with tls: tokens / holder ({x['rounds']} rounds)",
              f"parity with travelling: tokens / holder ({x['rounds']} rounds)")
    return Table(header, body, "r")


def _tokens(n: float) -> str:
    if n >= 1e9:
        return f"{n / 1e9:,.2f}G"
    return f"{n / 1e6:,.2f}M" if n >= 1e6 else f"{n:,.0f}"


GAP_LABELS = {"non_iid": "non-IID (one press per holder)", "iid": "IID (presses mixed)"}


def fl_loss_gap(src: Source) -> Table:
    """`bench fl-sweep`: held-out loss of travelling (centralised) and FedAvg on non-IID and IID
    holders, and the mean of each method's last training losses."""
    body = []
    for key, runs_ in src.data["loss_gap"].items():
        t, f = runs_["travel"], runs_["fl"]
        body.append((GAP_LABELS.get(key, key), num(t["final_loss"], 4), num(f["final_loss"], 4),
                     f"{f['final_loss'] - t['final_loss']:+.3f}", num(t.get("train_loss_tail"), 3),
                     num(f.get("train_loss_tail"), 3)))
    return Table(("data", "travel (centralised)", "FedAvg", "gap", "travel: last training losses",
                  "FedAvg: holders' last local losses"), tuple(body), "r")
