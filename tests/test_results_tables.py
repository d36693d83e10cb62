"""The tables of docs/benchmarks.md against the JSON behind them (docs/results/): cog writes
each from its data through tools/tables.py, and `cog --check` (run here in-process) fails when
one has drifted; a new table cannot land without data, nor a figure link without its figure. No
timing is asserted: the files are fixed data."""

from __future__ import annotations

import io
import json
import re
from pathlib import Path

import pytest
from cogapp import Cog

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "benchmarks.md"
STEPS = {"o_cleanup": 9.0, "o_export": 0.2, "dh_switch": 0.1, "dh_import": 0.2, "dh_copy": 100.0,
         "dh_export": 0.1, "tls": 0.7, "o_switch": 0.2, "o_import": 0.3, "o_rotate": 0.1}
NO_DATA_HEADING = "no data kept"
STATIC = re.compile(r"^<!-- static: .+ -->\s*$")


def cog(*args: str) -> tuple[int, str]:
    """Command-line cog, in this process: its exit status (0 done, 5 a check failed) and output."""
    out = io.StringIO()
    tool = Cog()
    tool.set_output(stdout=out, stderr=out)
    return tool.main(["cog", *args]), out.getvalue()


def unbacked_tables(text: str) -> list[int]:
    """Lines where a markdown table starts outside a cog block, not under a "no data kept"
    heading and not right after a ``<!-- static: why -->`` line."""
    headings: list[tuple[int, str]] = []
    out, fenced, inside, prev = [], False, False, ""
    for i, line in enumerate(text.split("\n")):
        if "[[[cog" in line or "[[[end]]]" in line:
            inside = "[[[cog" in line
        elif line.startswith("```"):
            fenced = not fenced
        elif not fenced and (h := re.match(r"^(#+)\s+(.*)", line)):
            level = len(h.group(1))
            headings = [x for x in headings if x[0] < level] + [(level, h.group(2).lower())]
        elif not fenced and not inside and line.startswith("|") and not prev.startswith("|"):
            if not any(NO_DATA_HEADING in title for _, title in headings) and not STATIC.match(prev):
                out.append(i + 1)
        prev = line
    return out


# ----------------------------------------------------------------------------- the real document
def test_every_table_in_the_benchmarks_agrees_with_its_data() -> None:
    status, output = cog("--check", "--diff", "--check-fail-msg=run `cog -r docs/benchmarks.md`", str(DOC))
    assert status == 0, output


def test_the_benchmarks_name_only_files_that_exist() -> None:
    text = DOC.read_text()
    assert "benchmarks-data" not in text
    sources = re.findall(r'\[\[\[cog t\.\w+\("([^"]+)"', text)
    assert len(sources) >= 30
    for source in sources:
        assert list(DOC.parent.glob(source)), source
    for figure in re.findall(r"^Figure: \[([^]]+)\]", text, re.M):
        assert (DOC.parent / figure).is_file(), f"figure {figure} is missing"


def test_no_table_stands_without_data() -> None:
    assert unbacked_tables(DOC.read_text()) == []


def test_a_table_without_data_is_found_unless_history_or_static() -> None:
    text = ("# B\n\n| a |\n|---|\n| 1 |\n\n<!-- static: the paper's figures -->\n| p |\n|---|\n\n"
            "## History (no data kept)\n\n| h |\n|---|\n\n### An old run\n\n| h2 |\n|---|\n\n"
            "## Later\n\n```\n| not a table |\n```\n<!-- [[[cog x() ]]] -->\n| c |\n|---|\n<!-- [[[end]]] -->\n"
            "| b |\n|---|\n")
    lines = text.split("\n")
    assert unbacked_tables(text) == [lines.index("| a |") + 1, lines.index("| b |") + 1]


def test_a_drifted_table_fails_the_check_and_cog_rewrites_it(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "results").symlink_to(DOC.parent / "results")
    (tmp_path / "tools").symlink_to(ROOT / "tools")
    doc = tmp_path / "docs" / "benchmarks.md"
    text = DOC.read_text()
    row = next(line for line in text.split("\n") if line.startswith("| 512 |"))
    doc.write_text(text.replace(row, row.replace("| 512 |", "| 511 |"), 1))
    status, output = cog("--check", str(doc))
    assert status == 5, output
    assert cog("-r", str(doc))[0] == 0
    assert doc.read_text() == text


# ----------------------------------------------------------------------------- helpers
def travel_run(date: str = "2026-11-24T10:00:00+00:00", copy: float = 5.0, **extra: object) -> dict:
    rows = [{"size_mib": s, "payload_bytes": s << 20, "total_ms": 110.0 + s, "steps_ms": dict(STEPS),
             "fixed_ms": 2.5, "copy_gbps": copy, "verified": True} for s in (4, 512)]
    return {"crypto_limit_gbps": 5.0, "machine": "vm 2 cpus", "date": date, "repeat": 5, "rows": rows, **extra}


def write(tmp_path: Path, files: dict[str, dict], call: str) -> str:
    """A document with one cog block (``call``, e.g. ``t.travel("results/t.json")``) over these
    files, written by cog; its text."""
    results = tmp_path / "results"
    results.mkdir(parents=True)
    for name, data in files.items():
        (results / name).write_text(json.dumps(data))
    doc = tmp_path / "bench.md"
    doc.write_text(f"# Benchmarks\n\n<!-- [[[cog import sys; sys.path.insert(0, {str(ROOT / 'tools')!r}); "
                   f"import tables as t ]]] -->\n<!-- [[[end]]] -->\n<!-- [[[cog {call} ]]] -->\n<!-- [[[end]]] -->\n")
    status, output = cog("-r", str(doc))
    assert status == 0, output
    return doc.read_text()


def table_of(tmp_path: Path, files: dict[str, dict], call: str) -> list[list[str]]:
    """Write one block and return its table's cells (header first, rule dropped)."""
    rows = [line for line in write(tmp_path, files, call).split("\n") if line.startswith("|")]
    return [[c.strip() for c in re.split(r"(?<!\\)\|", r.strip("|"))] for i, r in enumerate(rows) if i != 1]


def data_line(text: str) -> str:
    return next(line for line in text.split("\n") if line.startswith("Data:"))


def test_the_data_line_names_the_file_and_the_run(tmp_path: Path) -> None:
    line = data_line(write(tmp_path / "one", {"t.json": travel_run()}, 't.travel("results/t.json")'))
    assert line == "Data: [results/t.json](results/t.json); machine vm 2 cpus; 2026-11-24 10:00 UTC."
    files = {"ab-a-1.json": travel_run(), "ab-a-2.json": travel_run("2026-11-24T10:05:00+00:00", hardware="emulated")}
    text = write(tmp_path / "two", files, 't.travel_targets("results/ab-a-1.json", plot="results/a.png")')
    assert text.rstrip().endswith("Figure: [results/a.png](results/a.png).\n<!-- [[[end]]] -->")
    line = data_line(write(tmp_path / "glob", files, 't.ab_travel("results/ab-*.json", {"a": "A"})'))
    assert line == ("Data: the 2 files `results/ab-*.json`; machine vm 2 cpus; 2026-11-24 10:00 to 10:05 UTC; "
                    "hardware profile emulated.")


# ----------------------------------------------------------------------------- kinds
def test_travel_table_follows_the_steps_of_the_file(tmp_path: Path) -> None:
    cells = table_of(tmp_path, {"t.json": travel_run()}, 't.travel("results/t.json")')
    assert cells[0][:3] == ["MiB", "scrub", "O export"] and cells[0][-3:] == ["total", "fixed", "copy GB/s"]
    assert cells[2][0] == "512" and cells[2][5] == "100.00"


def test_travel_targets_use_the_pipeline_limit_when_measured(tmp_path: Path) -> None:
    plain = table_of(tmp_path / "a", {"t.json": travel_run(copy=4.5)}, 't.travel_targets("results/t.json")')
    assert plain[1] == ["copy throughput >= 0.8 x crypto limit", "4.50 GB/s = **0.90 x** 5.00 GB/s", "yes"]
    assert plain[3] == ["scrub <= 10% of the copy", "9.00 / 100.00 = **9.0 %**", "yes"]
    piped = table_of(tmp_path / "b", {"t.json": travel_run(copy=4.5, pipeline_limit_gbps=9.0)},
                     't.travel_targets("results/t.json", size=4)')
    assert piped[0][0] == "target (4 MiB)"
    assert piped[1] == ["copy throughput >= 0.8 x two-core pipeline limit", "4.50 GB/s = **0.50 x** 9.00 GB/s", "no"]
    assert piped[2][0].startswith("(for reference)")


def test_ab_travel_groups_by_the_glob_and_takes_medians_or_each_run(tmp_path: Path) -> None:
    files = {f"ab-{g}-{n}.json": travel_run(copy=c) for g, runs in (("base", (4.0, 5.0, 9.0)), ("new", (6.0,)))
             for n, c in enumerate(runs, 1)}
    med = table_of(tmp_path / "m", files, 't.ab_travel("results/ab-*.json", {"base": "before (abc)", "new": "after"})')
    assert [r[0] for r in med[1:]] == ["before (abc)", "after"]
    assert med[1][2] == "5.00" and med[2][2] == "6.00"
    each = table_of(tmp_path / "e", files, 't.ab_travel("results/ab-*.json", {"base": "B", "new": "N"}, each=True)')
    assert [r[0] for r in each[1:]] == ["B, 1", "N, 1", "B, 2", "B, 3"]
    piped = {k: {**v, "pipeline_limit_gbps": 8.0} for k, v in files.items()}
    piped_cells = table_of(tmp_path / "p", piped, 't.ab_travel("results/ab-*.json", {"base": "B"})')
    assert "pipeline limit GB/s" in piped_cells[0]


def test_ab_codec_sets_two_codecs_side_by_side(tmp_path: Path) -> None:
    def run(scale: float) -> dict:
        return {"rows": [{"message": "Ping", "bytes": 10, "encode_us": scale, "decode_us": 2 * scale,
                          "round_trip_us": 3 * scale}]}
    cells = table_of(tmp_path, {"c-old-1.json": run(1), "c-new-1.json": run(0.5)},
                     't.ab_codec("results/c-*.json", {"old": "old", "new": "new"})')
    assert cells[1] == ["Ping", "10 / 10", "1.00 / 0.50", "2.00 / 1.00", "3.00 / 1.50"]


def test_ddp_table_has_no_all_reduce_ratio_for_one_gpu(tmp_path: Path) -> None:
    def row(g: int) -> dict:
        return {"gpus": g, "model": "small", "params": 1, "iter_ms": {"plain": 4.0, "encrypted_naive": 5.0, "encrypted": 6.0},
                "allreduce_ms": {"plain": 1.0, "encrypted_naive": 1.5, "encrypted": 1.2}}
    cells = table_of(tmp_path, {"d.json": {"rows": [row(1), row(2)]}}, 't.ddp("results/d.json")')
    assert cells[1][-1] == "-" and cells[2][-1] == "1.20" and cells[2][5] == "1.50"


def test_ddp_where_shows_each_runs_rings_against_the_limit_and_their_cpu(tmp_path: Path) -> None:
    def run(plain: float) -> dict:
        four = {"gpus": 4, "allreduce_ms": {"plain": plain, "ring_unsealed": 21.0, "encrypted_naive": 33.0,
                                            "encrypted": 32.0},
                "allreduce_spread_ms": {"plain": [15.0, 25.0]}, "allreduce_limit_ms": plain + 7.5,
                "allreduce_vs_limit": {"encrypted_naive": 33.0 / (plain + 7.5), "encrypted": 32.0 / (plain + 7.5)},
                "allreduce_cpu_ms": {"plain": 34.0, "ring_unsealed": 37.0, "encrypted_naive": 60.0}}
        four["iter_ms"] = {"plain": 200.0, "encrypted": 216.0}
        return {"cores": 2, "rows": [{"gpus": 1}, four]}
    cells = table_of(tmp_path, {"w-1.json": run(20.0), "w-2.json": run(22.5)}, 't.ddp_where("results/w-*.json")')
    assert cells[1] == ["1", "4", "20.0 (15.0-25.0)", "21.0", "33.0", "32.0", "27.5", "1.20", "1.16", "1.08",
                        "34.0", "37.0", "60.0", "15.0", "23.0"]
    assert [c[:2] for c in cells[1:]] == [["1", "4"], ["2", "4"]]  # one GPU seals nothing: no row


def compare_run(hardware: object = None) -> dict:
    def cell(size: int, bw: float | None, travel: float, base: float, extra: bool = False) -> dict:
        return {"size_mib": size, "bandwidth_mbit": bw, "travel_ms": travel, "baseline_ms": base,
                "speedup": base / travel, "extrapolated": extra, "paper_speedup_estimate": 2.0,
                "rate_agreement": None if bw is None or extra else {"ratio": 1.02, "ok": True}}
    cells = [cell(4, 500.0, 5.0, 70.0), cell(4, None, 5.0, 4.0), cell(512, 500.0, 120.0, 9200.0, True),
             cell(512, None, 130.0, 1800.0)]
    out = {"link": "netns-tc", "machine": "vm", "date": "2026-11-24T12:00:00+00:00", "cells": cells}
    return out if hardware is None else {**out, "hardware": hardware}


def test_compare_grid_time_and_speedup(tmp_path: Path) -> None:
    time = table_of(tmp_path / "t", {"c.json": compare_run()}, 't.compare_time("results/c.json")')
    assert time[0] == ["MiB", "500 Mbit/s", "uncapped"]
    assert time[2] == ["512", "120.0 ms / ~9.2 s", "130.0 ms / 1.8 s"]
    speed = table_of(tmp_path / "s", {"c.json": compare_run()}, 't.compare_speedup("results/c.json")')
    assert speed[1] == ["4", "14x (2.00x)", "0.80x (2.00x)"] and speed[2][1] == "~77x (2.00x)"
    targets = table_of(tmp_path / "g", {"c.json": compare_run()}, 't.compare_targets("results/c.json")')
    assert targets[1][1].startswith("3 of 4 cells") and targets[1][2] == "no"
    assert targets[2][1] == "4 MiB at uncapped" and targets[3][1] == "1.020 to 1.020 (1 cells)"


@pytest.mark.parametrize("hardware, shown", [("paper-h100", "paper-h100"),
                                             ({"name": "paper-h100", "switch_ms": 148}, "paper-h100")])
def test_the_data_line_names_the_hardware_profile(tmp_path: Path, hardware: object, shown: str) -> None:
    line = data_line(write(tmp_path, {"c.json": compare_run(hardware)}, 't.compare_time("results/c.json")'))
    assert line.endswith(f"link netns-tc; 2026-11-24 12:00 UTC; hardware profile {shown}.")


def train_row(bw: float | None, fl: dict | None = None) -> dict:
    """A link of the first `bench train` format (one row per link, a record per method)."""
    def method(train: float, tx: float) -> dict:
        return {"training_s": train, "tx_s": tx, "tx_share": tx / (train + tx), "fetches": 5, "final_loss": 2.5}
    row = {"bandwidth_mbit": bw, "baseline": method(25.0, 1.0), "travelling": method(24.0, 0.05), "same_losses": True,
           "paper": {"baseline": {"tx_share": 0.47568}, "travelling": {"tx_share": 0.00082}}}
    return row if fl is None else {**row, "fl": fl}


def method_row(method: str, bw: float | None, train: float = 24.0, tx: float = 0.05, nbytes: int = 16680,
               **extra: object) -> dict:
    """A row of the present `bench train` format (one row per method and link)."""
    paper = {"travel": 0.00082, "tls": 0.47568}.get(method)
    return {"method": method, "bandwidth_mbit": bw, "framework": "gputravel", "bytes_over_link": nbytes,
            "tx_s": tx, "training_s": train, "wall_s": train + tx, "tx_share": tx / (train + tx),
            "holder_compute_s": 0.0, "final_loss": 2.4525, "rounds": None, "fetches": 5,
            "paper": None if paper is None else {"tx_share": paper}, **extra}


def train_run(tls_train: float = 25.0, fl_bytes: int = 88_935_884, same: bool = True) -> dict:
    fl = method_row("fl", 20.0, 15.3, 48.3, fl_bytes, framework="flwr 1.42.0", holder_compute_s=38.4,
                    final_loss=2.5942, rounds=4, fetches=None,
                    fl={"round_log": [{"round": 1, "wall_s": 28.6, "tx_s": 27.0, "sampled": 3,
                                       "replied": ["a", "b", "c"], "failures": []},
                                      {"round": 2, "wall_s": 66.8, "tx_s": 63.9, "sampled": 3, "replied": ["b", "c"],
                                       "failures": [{"reason": "Node Unavailable"}]}]})
    rows = [method_row("travel", 20.0), method_row("tls", 20.0, tls_train, 1.0, 689_361), fl]
    return {"link": "netns-tc", "methods": ["travel", "tls", "fl"], "rows": rows,
            "checks": [{"bandwidth_mbit": 20.0, "same_losses": same}]}


def test_train_table_reads_both_formats_of_bench_train(tmp_path: Path) -> None:
    old = table_of(tmp_path / "o", {"t.json": {"rows": [train_row(4.0), train_row(None)]}}, 't.train("results/t.json")')
    assert old[1] == ["4 Mbit/s", "25.00", "1.000", "3.846 %", "24.00", "0.050", "0.208 %", "47.568 %", "0.082 %", "yes"]
    assert old[2][0] == "uncapped"
    new = table_of(tmp_path / "n", {"t.json": train_run()}, 't.train("results/t.json")')
    assert new[1] == ["20 Mbit/s", "25.00", "1.000", "3.846 %", "24.00", "0.050", "0.208 %", "47.568 %", "0.082 %", "yes"]


def test_train_methods_one_row_per_method_fl_included(tmp_path: Path) -> None:
    cells = table_of(tmp_path / "n", {"t.json": train_run()}, 't.train_methods("results/t.json")')
    assert [r[0] for r in cells[1:]] == ["travel", "tls", "fl (FedAvg)"]
    assert cells[3] == ["fl (FedAvg)", "20 Mbit/s", "15.30", "48.300", "88,935,884", "38.4", "2.5942", "4",
                        "flwr 1.42.0", "-"]
    assert cells[1][4] == "16,680" and cells[1][-1] == "yes" and cells[1][7] == "-"
    old = table_of(tmp_path / "o", {"t.json": {"rows": [train_row(20.0)]}}, 't.train_methods("results/t.json")')
    assert [r[0] for r in old[1:]] == ["travel", "tls"] and old[1][4] == "-"  # the first format counted no bytes


def test_train_methods_over_repeated_runs_show_the_last_and_the_range(tmp_path: Path) -> None:
    files = {"t.json": train_run(tls_train=70.0, fl_bytes=88_956_749), "t-run2.json": train_run(tls_train=60.0),
             "t-run3.json": train_run(tls_train=13.8, same=False)}
    cells = table_of(tmp_path, files, 't.train_methods("results/t*.json")')
    tls = cells[2]
    assert tls[2] == "13.80 [13.80-70.00]" and tls[4] == "689,361"  # equal in every run: no range
    assert tls[-1] == "NO (2 of 3 runs)"
    assert cells[3][4] == "88,935,884 [88,935,884-88,956,749]"


def test_fl_rounds_table(tmp_path: Path) -> None:
    cells = table_of(tmp_path, {"t.json": train_run()}, 't.fl_rounds("results/t.json")')
    assert cells[1] == ["1", "28.6", "27.0", "3", "a, b, c", "-"]
    assert cells[2][4:] == ["b, c", "Node Unavailable"]


def fl_sweep_run() -> dict:
    def cell(tokens: int, layers: int, width: int, params: int, fl: int, central: bool) -> dict:
        rows = {"fl": {"bytes_over_link": fl, "final_loss": 4.0}}
        if central:
            rows |= {"travel": {"bytes_over_link": 9596}, "tls": {"bytes_over_link": tokens * 3}}
        return {"holder_tokens": tokens, "n_layer": layers, "n_embd": width, "params": params, "rows": rows}
    cells = [cell(t, 4, 128, 834_432, 44_000_000 + t, False) for t in (4096, 65536)] + \
            [cell(t, 2, 64, 120_640, 7_000_000 + t, True) for t in (4096, 65536)]
    models = {"4x128": {"params": 834_432, "fl_bytes_per_holder_round": 7_387_495.7, "overhead": 1.1067,
                        "tls_parity_holder_tokens": 4_699_117.2, "travel_parity_holder_tokens": 1_219_401_925.7},
              "2x64": {"params": 120_640, "fl_bytes_per_holder_round": 1_229_699.3, "overhead": 1.2741,
                       "tls_parity_holder_tokens": 782_200.3, "travel_parity_holder_tokens": 36_520_955.7}}
    gap = {"non_iid": {"travel": {"final_loss": 2.45248, "train_loss_tail": 2.5186},
                       "fl": {"final_loss": 2.59420, "train_loss_tail": 2.5061}}}
    return {"cells": cells, "crossover": {"rounds": 2, "models": models}, "loss_gap": gap}


def test_fl_sweep_tables(tmp_path: Path) -> None:
    data = {"s.json": fl_sweep_run()}
    sweep = table_of(tmp_path / "b", data, 't.fl_sweep("results/s.json")')
    assert sweep[0] == ["tokens / holder", "travel", "tls", "FedAvg 2x64", "FedAvg 4x128"]
    assert sweep[2] == ["65,536", "9,596", "196,608", "7,065,536", "44,065,536"]
    loss = table_of(tmp_path / "l", data, 't.fl_sweep("results/s.json", field="final_loss")')
    assert loss[1] == ["4,096", "-", "-", "4.000", "4.000"]
    cross = table_of(tmp_path / "x", data, 't.fl_crossover("results/s.json")')
    assert cross[1] == ["2x64", "120,640", "1,229,699", "1.27", "782,200", "36.52M"]
    assert cross[2][4:] == ["4.70M", "1.22G"] and "(2 rounds)" in cross[0][4]
    gap = table_of(tmp_path / "g", data, 't.fl_loss_gap("results/s.json")')
    assert gap[1] == ["non-IID (one press per holder)", "2.4525", "2.5942", "+0.142", "2.519", "2.506"]


def test_demo_tables_from_a_training_report(tmp_path: Path) -> None:
    report = {"config": {"batch": 8, "seq_len": 64}, "wall_s": 36.1, "travel_count": 5, "stall_share": 0.0007,
              "loss_before": 4.554, "loss_after": 2.516, "travel_median_steps_ms": dict(STEPS),
              "travels": [{"tokens": 32768, "total_ms": t} for t in (3.0, 4.0, 5.0)]}
    cells = table_of(tmp_path / "d", {"r.json": report}, 't.demo("results/r.json")')
    assert cells[2] == ["travels", "5 (each brings 32,768 tokens = 63 batches)"]
    assert cells[3][1].startswith("**0.07 %** of wall time (target at most 1%: met)")
    steps = table_of(tmp_path / "s", {"r.json": report}, 't.demo_steps("results/r.json")')
    assert steps[0][0] == "scrub" and steps[1][-1] == "4.00"


def test_scale_table(tmp_path: Path) -> None:
    rows = [{"holders": h, "median_ms": m, "p90_ms": m * 1.2, "fixed_ms": 1.0, "boot_s": 0.5 * h, "rss_mib": 40.0}
            for h, m in ((64, 2.0), (1, 1.6))]
    cells = table_of(tmp_path / "a", {"s.json": {"rows": rows}}, 't.scale("results/s.json")')
    assert cells[0][-1] == "median x 1 holder(s)"
    assert [r[0] for r in cells[1:]] == ["1", "64"] and cells[2][-1] == "1.25" and cells[2][5] == "40.0"
    control = [{**r, "same_holder_median_ms": 1.6, "loadavg": [7.7, 9.8]} for r in rows]
    cells = table_of(tmp_path / "b", {"s.json": {"rows": control}}, 't.scale("results/s.json")')
    assert cells[0][-3:] == ["one holder (control) ms", "round robin / control", "load at start"]
    assert cells[2][-3:] == ["1.60", "1.25", "7.7"]


def test_generic_table(tmp_path: Path) -> None:
    data = {"items": [{"a": 1, "c": 0.123456, "d": True}, {"a": 2}]}
    cells = table_of(tmp_path / "g", {"g.json": data},
                     't.generic("results/g.json", "items", [("a", "A", 0), ("c", "C c", 3), ("d", "D", 0)])')
    assert cells == [["A", "C c", "D"], ["1", "0.123", "yes"], ["2", "-", "-"]]
    text = write(tmp_path / "q", {"g.json": {"rows": [{"a": "x|y"}]}},
                 't.generic("results/g.json", "rows", [("a", "a", 2)])')
    assert "| x\\|y |" in text  # escaped: the row keeps its one column


# ----------------------------------------------------------------------------- against the paper
def test_travel_paper_sets_each_step_beside_the_papers(tmp_path: Path) -> None:
    run = travel_run()
    for r in run["rows"]:
        r["paper"] = {"total_ms": 2 * r["total_ms"], "steps_ms": {**STEPS, "dh_copy": 50.0, "o_rotate": None}}
    cells = table_of(tmp_path, {"t.json": run}, 't.travel_paper("results/t.json")')
    assert cells[0] == ["MiB", "scrub", "switch to H", "H copy", "TLS", "switch to O", "context steps", "total",
                        "paper total", "ours / paper"]
    assert cells[2] == ["512", "9.00 (9.00)", "0.10 (0.10)", "100.00 (50.00)", "0.70 (0.70)", "0.20 (0.20)", "0.70",
                        "622.0", "1244.0", "0.50"]


def with_paper(run: dict) -> dict:
    for c in run["cells"]:
        c["paper"] = {"travel_ms_ratio": 0.9, "baseline_ms_ratio": 0.6 if c["bandwidth_mbit"] else 0.25,
                      "speedup_ratio": c["speedup"] / 2.0}
    return run


def test_compare_profiles_set_the_two_hardware_profiles_side_by_side(tmp_path: Path) -> None:
    slow = compare_run({"profile": "paper-h100"})
    slow["cells"] = [{**c, "travel_ms": c["travel_ms"] + 300, "speedup": c["baseline_ms"] / (c["travel_ms"] + 300)}
                     for c in slow["cells"] if c["size_mib"] == 4]
    text = write(tmp_path, {"c.json": compare_run(), "c-paper-h100.json": slow},
                 't.compare_profiles("results/c*.json")')
    rows = [line for line in text.split("\n") if line.startswith("| 4 ")]
    assert rows == ["| 4 | 14x / **0.23x** (2.00x) | 0.80x / **0.01x** (2.00x) |"]  # 512 MiB: not in both
    assert "hardware profile paper-h100, emulated." in text  # the files in name order


def test_compare_against_the_paper_tie_break_and_table_2(tmp_path: Path) -> None:
    run = with_paper(compare_run("paper-h100"))
    run["tie_breaks"] = [{"bandwidth_mbit": 500.0, "baseline_faster_at_mib": [4, 16], "travel_faster_from_mib": 64},
                         {"bandwidth_mbit": None, "baseline_faster_at_mib": [], "travel_faster_from_mib": 4}]
    run["tie_break_estimates"] = [{"bandwidth_mbit": 500.0, "size_mib": 17.96}]
    run["table_2"] = [{"bandwidth_mbit": 4.0, "baseline_tx_s": 1124.27, "baseline_share": 0.477545, "extrapolated": True,
                       "ours_tx_s": 0.9488, "ours_share": 0.000771,
                       "paper": {"baseline_tx_s": 1115.88, "baseline_share": 0.47568, "ours_tx_s": 1.01,
                                 "ours_share": 0.00082}}]
    files = {"c.json": run}
    paper = table_of(tmp_path / "p", files, 't.compare_paper("results/c.json")')
    assert paper[1] == ["500 Mbit/s", "0.90x", "0.60x (1 of 2)", "7.00-38.33x", "1.02x"]
    assert paper[2][2] == "0.25x (2 of 2)" and paper[2][4] == "-"
    tie = table_of(tmp_path / "t", files, 't.compare_tie_break("results/c.json")')
    assert tie[1] == ["500 Mbit/s", "4, 16", "64", "18"] and tie[2] == ["uncapped", "none", "4", "-"]
    t2 = table_of(tmp_path / "2", files, 't.compare_table2("results/c.json")')
    assert t2[1] == ["4 Mbit/s", "~1124.27", "47.755 %", "1115.88", "47.568 %", "0.949", "0.077 %", "1.01", "0.082 %"]


def test_plan_worked_example_rows_per_source(tmp_path: Path) -> None:
    def plan(source: str, bw: float | None, saved: float) -> dict:
        return {"inputs": {"bandwidth_mbit": bw, "buffer_bytes": 256 << 20, "hardware": "paper-h100"},
                "sources": {"travel": source},
                "worked_example": {"saved_per_transmission_s": {"ours": saved, "paper": 7.0, "ratio": saved / 7},
                                   "saved_s": {"ours": saved * 180224, "paper": 1_261_568.0,
                                               "ratio": saved * 180224 / 1_261_568}}}
    files = {"p.json": plan("the paper: Table 1", 500.0, 7.27), "p-results.json": plan("docs/results/x.json", 500.0, 4.01),
             "p-uncapped.json": plan("the paper: Table 1", None, 3.01)}
    cells = table_of(tmp_path, files, 't.plan_worked_example("results/p*.json")')
    assert [r[0] for r in cells[1:]] == ["the paper's slides", "plan, the paper's figures", "plan, the paper's figures",
                                         "plan, measured here (paper-h100 JSONs)"]
    assert cells[1][3:] == ["7.00", "1,261,568 s (14.6 days)", "1.00"]
    assert cells[2] == ["plan, the paper's figures", "500 Mbit/s", "256 MiB", "7.27", "1,310,228 s (15.2 days)", "1.04"]
    assert cells[3][1] == "uncapped"
