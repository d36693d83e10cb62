"""The rows, checks and figure of `bench train`: every method's row has the same fields (0 or
None where it has no use for one), so a table or a plot can set them side by side.
"""

from __future__ import annotations

import statistics
from pathlib import Path

from gputravel.bench.compare import bandwidth_label
from gputravel.protocol.hardware import TABLE_2

#: The paper's Table 2 by link and method: training (s), Tx (s), Tx share.
PAPER_TABLE2 = {bw: {"baseline": (r[0], r[1], r[2] / 100), "travelling": (r[3], r[4], r[5] / 100)}
                for bw, r in TABLE_2.items()}
PAPER_KEY = {"travel": "travelling", "tls": "baseline"}
TAIL = 10  # training losses averaged for train_loss_tail


def _tail(losses: list[float]) -> float | None:
    tail = losses[-TAIL:]
    return sum(tail) / len(tail) if tail else None


def method_row(method: str, bw: float | None, report: dict, moved: dict | None, final_metrics: dict,
               step_ms: float | None = None) -> dict:
    """A travel or tls row from the training report: transmission = the loader's waits for data
    (``steady_stall_share``: all but each holder's first travel, over the time less those);
    ``final_metrics`` the final model on the held-out data; ``step_ms`` the median step time."""
    tx, wall = report["stall_s"], report["wall_s"]
    first = report.get("first_pass_s", 0.0)  # each holder's first travels: the job's fixed start-up wait
    paper = PAPER_TABLE2.get(None if bw is None else float(bw), {}).get(PAPER_KEY[method])
    return {"method": method, "bandwidth_mbit": bw, "framework": "gputravel",
            "bytes_over_link": None if moved is None else sum(b.total for b in moved.values()),
            "bytes_by_holder": None if moved is None else {n: {"up": b.up, "down": b.down} for n, b in moved.items()},
            "tx_s": tx, "training_s": wall - tx, "wall_s": wall, "tx_share": tx / wall if wall else 0.0,
            "holder_compute_s": 0.0, "final_loss": final_metrics["all"]["loss"], "final_metrics": final_metrics,
            "step_ms": step_ms, "stall_share": report["stall_share"], "first_pass_s": first,
            # None: not measured, the job ended inside its first epoch with nothing but the first pass
            # travelled (a holder's next chunk or a record brought again would have been the steady state).
            "steady_stall_share": None if not report["loader_state"].get("epoch") and tx <= first else
            (tx - first) / (wall - first) if wall > first else 0.0,
            "train_loss_tail": _tail(report["losses"]),
            "rounds": None, "fetches": report["travel_count"], "losses": report["losses"],
            "paper": None if paper is None else {"training_s": paper[0], "tx_s": paper[1], "tx_share": paper[2]}}


def fl_row(bw: float | None, rep: dict, final_metrics: dict) -> dict:
    """The FedAvg row (fl/run.py's report, flattened to the common fields, the rest kept).
    ``step_ms``: the median over holders and rounds of a local step; ``stall_share``: the share
    of the rounds no holder computed in (the links and Flower's round trips)."""
    last = rep["round_log"][-1]["holders"] if rep["round_log"] else []
    wall = rep["wall_s"]
    local = rep["plan"]["local_steps"]
    steps = [h["compute_s"] / local * 1e3 for r in rep["round_log"] for h in r["holders"]]
    return {"method": "fl", "bandwidth_mbit": bw, "framework": rep["framework"],
            "bytes_over_link": rep["bytes_over_link"], "bytes_by_holder": rep["bytes_by_holder"],
            "tx_s": rep["tx_s"], "training_s": rep["training_s"], "wall_s": wall,
            "tx_share": rep["tx_s"] / wall if wall else 0.0, "holder_compute_s": rep["holder_compute_s"],
            "final_loss": final_metrics["all"]["loss"], "final_metrics": final_metrics,
            "step_ms": statistics.median(steps) if steps else None, "stall_share": rep["tx_s"] / wall if wall else 0.0,
            "train_loss_tail": sum(h["loss_last"] for h in last) / len(last) if last else None,
            "rounds": rep["rounds"], "fetches": None, "paper": None,
            "fl": {k: v for k, v in rep.items() if k not in ("bytes_over_link", "bytes_by_holder", "tx_s",
                                                             "training_s", "wall_s", "holder_compute_s", "rounds",
                                                             "framework", "model_path")}}


def check_pair(bw: float | None, rows: dict[str, dict]) -> dict:
    """G2 at one bandwidth: travel and tls trained on the same bytes, so identical losses."""
    travel, tls = rows.get("travel"), rows.get("tls")
    same = None
    if travel is not None and tls is not None:
        same = (travel["losses"] == tls["losses"] and travel["final_loss"] == tls["final_loss"]
                and travel.get("final_metrics") == tls.get("final_metrics"))
    return {"bandwidth_mbit": bw, "same_losses": same}


COLORS = {"travel": "tab:blue", "tls": "tab:orange", "fl": "tab:green"}
NAMES = {"travel": "GPU Travelling", "tls": "TLS baseline", "fl": "FedAvg (Flower)"}


def plot(result: dict, path: Path) -> Path:
    """Two panels: time (training + Tx, stacked) and bytes over the link (log), a bar per method."""
    from matplotlib.figure import Figure

    rows = result["rows"]
    bws = list(dict.fromkeys(r["bandwidth_mbit"] for r in rows))
    methods = list(dict.fromkeys(r["method"] for r in rows))
    fig = Figure(figsize=(4 + 1.6 * len(bws), 4.8), dpi=110)
    time_ax, bytes_ax = fig.subplots(1, 2)
    width = 0.8 / len(methods)
    for k, m in enumerate(methods):
        xs = [i + (k - (len(methods) - 1) / 2) * width for i in range(len(bws))]
        got = [next((r for r in rows if r["method"] == m and r["bandwidth_mbit"] == b), None) for b in bws]
        train = [r["training_s"] if r else 0 for r in got]
        tx = [r["tx_s"] if r else 0 for r in got]
        time_ax.bar(xs, train, width, color=COLORS[m], label=f"{NAMES[m]}: training")
        time_ax.bar(xs, tx, width, bottom=train, color=COLORS[m], alpha=0.45, hatch="//", label=f"{NAMES[m]}: Tx")
        moved = [r["bytes_over_link"] or 0 for r in got]
        bytes_ax.bar(xs, moved, width, color=COLORS[m], label=NAMES[m])
    for ax in (time_ax, bytes_ax):
        ax.set_xticks(range(len(bws)), [bandwidth_label(b) + ("" if b is None else " Mbit/s") for b in bws], fontsize=8)
    time_ax.set_ylabel("time (s)")
    fig.legend(*time_ax.get_legend_handles_labels(), loc="lower center", ncol=3, fontsize=6)
    bytes_ax.set_yscale("log")
    bytes_ax.set_ylabel("bytes over the holders' links (log)")
    fig.suptitle(f"Training: travel vs TLS vs FedAvg (link: {result['link']})", fontsize=10)
    fig.tight_layout(rect=(0, 0.12, 1, 1))  # the legend below the panels
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    return path


COLUMNS = ("Mbit/s", "method", "training s", "Tx s", "Tx %", "bytes", "holder s", "step ms", "x local",
           "final loss", "accuracy", "rounds")


def table_rows(result: dict) -> list[list[str]]:
    out = []
    for r in result["rows"]:
        moved = "-" if r["bytes_over_link"] is None else f"{r['bytes_over_link']:,}"
        step, ratio = r.get("step_ms"), r.get("step_ms_vs_local")
        accuracy = ((r.get("final_metrics") or {}).get("all") or {}).get("accuracy")
        out.append([bandwidth_label(r["bandwidth_mbit"]), r["method"], f"{r['training_s']:.2f}", f"{r['tx_s']:.3f}",
                    f"{r['tx_share']:.2%}", moved, f"{r['holder_compute_s']:.1f}",
                    "-" if step is None else f"{step:.2f}", "-" if ratio is None else f"{ratio:.2f}",
                    f"{r['final_loss']:.4f}", "-" if accuracy is None else f"{accuracy:.3f}",
                    "-" if r["rounds"] is None else str(r["rounds"])])
    return out
