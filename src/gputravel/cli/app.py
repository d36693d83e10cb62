"""Command line: `gputravel travel`, `bench travel|compare|codec|ddp` and `redteam` here; every
other command in a module of its own."""

from __future__ import annotations

import enum
from pathlib import Path
from typing import Optional

import typer
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from gputravel.bench import codec as codec_bench, compare, travel as travel_bench
from gputravel.cli.attest import attest_app, pki_app
from gputravel.cli.audit import audit_app
from gputravel.files import write_json
from gputravel.cli.data import data_app
from gputravel.cli.train import training_job
from gputravel.cli.hardware import hardware_option, print_against_paper
from gputravel.cli.model import model_app
from gputravel.cli.job import job_app
from gputravel.cli.plan import plan_command
from gputravel.cli.scale import bench_scale
from gputravel.cli.service import cohort_app, serve_command, status_command
from gputravel.cli.train_bench import bench_fl_sweep, bench_train
from gputravel.cli.dp_bench import bench_dp
from gputravel.jobs.travel import Travel, TravelJobConfig, check_capacity, run_travels, summarise
from gputravel.protocol.control import STEPS
from gputravel.protocol.hardware import hardware_profile
from gputravel.cli.output import (Commands, check_output_dir, check_output_file, console, fail, numeric_table,
                                  write_results)


app = typer.Typer(pretty_exceptions_show_locals=False, add_completion=False, no_args_is_help=True, cls=Commands,
                  help="GPU Travelling: confidential collaborative training with a travelling (emulated) H100 in CC mode.")
bench_app = typer.Typer(pretty_exceptions_show_locals=False, no_args_is_help=True, help="Benchmarks (numbers live here, never in tests).")
app.add_typer(bench_app, name="bench")

app.command(name="demo")(training_job)
app.add_typer(data_app, name="data")
app.add_typer(pki_app, name="pki")
app.add_typer(attest_app, name="attest")
app.add_typer(audit_app, name="audit")
app.add_typer(cohort_app, name="cohort")
app.add_typer(model_app, name="model")
app.add_typer(job_app, name="job")
app.command("serve")(serve_command)
app.command("status")(status_command)
app.command("plan")(plan_command)
bench_app.command("scale")(bench_scale)
bench_app.command("train")(bench_train)
bench_app.command("fl-sweep")(bench_fl_sweep)
bench_app.command("dp")(bench_dp)

SHORT = {"o_cleanup": "scrub", "o_export": "O exp", "dh_switch": "→H sw", "dh_import": "H imp", "dh_copy": "H copy",
         "dh_export": "H exp", "tls": "TLS", "o_switch": "→O sw", "o_import": "O imp", "o_rotate": "rotate"}


# The per-travel table's steps, grouped so it fits a terminal and adds up to the total (the
# orchestrator's export runs inside the scrub, so it is not added again).
CONTEXT_STEPS = ("dh_import", "dh_export", "o_import", "o_rotate")


def _row(t: Travel, gpus: int) -> list[str]:
    r = t.report
    n = r.chunk.nbytes if r.chunk else 0
    st = r.steps_ms
    gbps = n / (st["dh_copy"] / 1e3) / 1e9 if st["dh_copy"] else 0.0
    ok = "[green]ok[/green]" if r.chunk else "[yellow]refused[/yellow]"
    chunk = f"@{r.chunk.dataset_offset >> 20}M" if r.chunk else "-"
    cells = (st["o_cleanup"], st["dh_switch"] + st["o_switch"], st["tls"], sum(st[s] for s in CONTEXT_STEPS), st["dh_copy"], r.total_ms)
    row = [str(r.travel_id), r.holder, chunk, f"{n / (1 << 20):.0f}", *(f"{c:.2f}" for c in cells), f"{gbps:.2f}", ok]
    return [str(t.gpu), *row] if gpus > 1 else row


@app.command(name="travel")
def travel_job(
    holders: int = typer.Option(3, help="Number of data holders (one CVM process each)."),
    dataset_mib: int = typer.Option(24, help="Size of each holder's synthetic dataset, MiB."),
    buffer_mib: int = typer.Option(8, help="Dataset buffer in the GPU's protected memory, MiB."),
    seed: int = typer.Option(0, help="Seed of the synthetic datasets."),
    workdir: Optional[Path] = typer.Option(None, help="Where the synthetic datasets are written (default: runs/demo); the report goes to --json."),
    json_path: Optional[Path] = typer.Option(None, "--json", help="Write the travel reports as JSON here."),
    hardware: str = hardware_option(),
    gpus: int = typer.Option(1, help="GPUs travelling at the same time, each to its own share of the holders."),
) -> None:
    """Travels only, no training: every chunk verified by digest.

    A local cohort moves every holder's synthetic dataset through the GPU once, with where the
    time went in each travel; with --gpus N, N cohorts travel in parallel, each to its share."""
    out = workdir or Path("runs/demo")
    check_output_dir(out, "--workdir")
    check_output_file(json_path, "--json")
    cfg = TravelJobConfig(holders=holders, dataset_mib=dataset_mib, buffer_mib=buffer_mib, seed=seed, hardware=hardware,
                          gpus=gpus)
    check_capacity(cfg)
    total = holders * -(-dataset_mib // buffer_mib)
    on = f"{gpus} GPUs in parallel" if gpus > 1 else "one GPU"
    console.print(f"[bold]gputravel travel[/bold]: {holders} holders x {dataset_mib} MiB, buffer {buffer_mib} MiB, "
                  f"{total} travels on {on}. Booting host, GPU, holders, then the orchestrator (paper 4.1)...")
    columns = ("#", "holder", "chunk", "MiB", "scrub", "switch", "TLS", "context", "copy", "total", "GB/s", "digest")
    table = numeric_table("Travels (ms, shares of the critical path; switch = waits for the MUX, to holder + back; "
                          "context = imports, holder export, rotation; the orchestrator exports during the scrub)",
                          ("gpu", *columns) if gpus > 1 else columns, show_lines=False, pad_edge=False)  # ids by GPU
    travels: list[Travel] = []
    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                  TimeElapsedColumn(), console=console, transient=True) as progress:
        task = progress.add_task("travelling", total=total)

        def on_travel(t: Travel) -> None:
            travels.append(t)
            table.add_row(*_row(t, gpus))
            progress.update(task, advance=1, description=f"GPU {t.gpu} back from {t.holder}" if gpus > 1
                            else f"GPU back from {t.holder}")

        run_travels(cfg, out, on_travel)
    console.print(table)
    summary = summarise([t.report for t in travels])
    console.print(f"{summary['verified']}/{summary['travels']} chunks verified by digest, "
                  f"{summary['bytes'] / (1 << 20):.0f} MiB moved; median travel {summary['median_total_ms']:.2f} ms, "
                  f"median fixed overhead {summary['median_fixed_ms']:.2f} ms (total - copy - scrub).")
    if json_path:
        summary["wall_s"] = max(t.end_s for t in travels)  # from the common start to the last travel's end
        payload = {"config": vars(cfg), "summary": summary, "travels": [_travel_json(t) for t in travels],
                   "hardware": hardware_profile(cfg.hardware).to_json()}
        write_json(json_path, payload)
        console.print(f"report written to {json_path}")


def _travel_json(t: Travel) -> dict:
    """A travel's report, with the GPU that made it and when (seconds from the job's start)."""
    r = t.report
    return {"gpu": t.gpu, "travel_id": r.travel_id, "holder": r.holder, "steps_ms": r.steps_ms, "total_ms": r.total_ms,
            "verify_ms": r.verify_ms, "refused": r.refused,
            "chunk": None if r.chunk is None else {"dataset_offset": r.chunk.dataset_offset, "nbytes": r.chunk.nbytes,
                                                   "digest": r.chunk.digest.hex()},
            "dataset_offset": t.dataset_offset, "start_s": t.start_s, "end_s": t.end_s}


def _ints(text: str, error: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise typer.BadParameter(error) from None


_SIZES = "sizes are comma-separated integers (MiB), e.g. 4,8,16"


@bench_app.command("travel")
def bench_travel(
    sizes: str = typer.Option("4,8,16,32,64,128,256,512", help="Buffer sizes in MiB, comma separated."),
    repeat: int = typer.Option(5, help="Timed travels per size (after one warm-up); medians are reported."),
    json_path: Optional[Path] = typer.Option(None, "--json", help="Write the results as JSON here."),
    hardware: str = hardware_option(),
) -> None:
    """The paper's Table 1 for this system: per-step time of a travel at each buffer size."""
    size_list = _ints(sizes, _SIZES)
    table = numeric_table("GPU Travelling overheads (medians, ms) — paper Table 1 layout",
                          ("MiB", *(SHORT[s] for s in STEPS), "total", "fixed", "copy GB/s"))

    def on_row(row: dict) -> None:
        st = row["steps_ms"]
        table.add_row(str(row["size_mib"]), *(f"{st[s]:.2f}" for s in STEPS), f"{row['total_ms']:.2f}",
                      f"{row['fixed_ms']:.2f}", f"{row['copy_gbps']:.2f}")
        console.print(f"  {row['size_mib']} MiB done: copy {row['copy_gbps']:.2f} GB/s, fixed {row['fixed_ms']:.2f} ms")

    with console.status("measuring the crypto and pipeline limits and booting cohorts..."):
        result = travel_bench.run(size_list, repeat, on_row=on_row, hardware=hardware)
    console.print(table)
    limit, pipe = result["crypto_limit_gbps"], result["pipeline_limit_gbps"]
    last = result["rows"][-1]
    console.print(f"pipeline limit (two cores, the slower of seal and open while both run): {pipe:.2f} GB/s; crypto "
                  f"limit (one core, encrypt + decrypt): {limit:.2f} GB/s; at {last['size_mib']} MiB copy throughput "
                  f"is {last['copy_gbps'] / pipe:.2f} x the pipeline limit ({last['copy_gbps'] / limit:.2f} x the crypto "
                  f"limit), fixed overhead {last['fixed_ms']:.2f} ms, "
                  f"scrub {last['steps_ms']['o_cleanup'] / last['steps_ms']['dh_copy'] * 100:.1f}% of the copy.")
    write_results(json_path, result)


@bench_app.command("compare")
def bench_compare(
    sizes: str = typer.Option("4,8,16,32,64,128,256,512", help="Buffer sizes in MiB, comma separated."),
    bandwidths: str = typer.Option("4,20,100,500,uncapped", help="Link caps in Mbit/s, comma separated; 'uncapped' for none."),
    repeat: int = typer.Option(3, help="Timed transmissions per method and cell (after a warm-up); medians are reported."),
    link: str = typer.Option("auto", help="auto (netns-tc where namespaces work, else token-bucket), netns or token-bucket."),
    max_transfer_s: float = typer.Option(25.0, help="Baseline transfers longer than this (size/rate) are not run but "
                                                    "extrapolated from the largest size measured at that bandwidth."),
    link_check_s: float = typer.Option(2.0, help="netns-tc: a raw TCP transfer this long through each capped link (0: none)."),
    json_path: Optional[Path] = typer.Option(None, "--json", help="Write the results as JSON here."),
    plot_path: Optional[Path] = typer.Option(None, "--plot", help="Draw a figure like the paper's Figure 6 here (PNG)."),
    hardware: str = hardware_option(),
) -> None:
    """GPU Travelling vs the centralised TLS baseline on capped links (paper 7.2, Figure 6)."""
    check_output_file(plot_path, "--plot")  # a directory is refused before the cells run, not after
    cfg = compare.CompareConfig(tuple(_ints(sizes, _SIZES)), compare.parse_bandwidths(bandwidths), repeat, link,
                                max_transfer_s, link_check_s, hardware=hardware)
    with console.status("booting a cohort per cell and measuring both methods..."):
        result = compare.run(cfg, on_cell=lambda c: console.print(
            f"  {c['size_mib']} MiB @ {compare.bandwidth_label(c['bandwidth_mbit'])}: travel {c['travel_ms']:.1f} ms, "
            f"baseline {'~' if c['extrapolated'] else ''}{c['baseline_ms']:.1f} ms"))
    _print_compare(result)
    print_against_paper(result)
    if plot_path:
        console.print(f"figure written to {compare.plot(result, plot_path)}")
    write_results(json_path, result)


def _print_compare(result: dict) -> None:
    table = numeric_table(f"Time per transmission (medians; link: {result['link']})", compare.COLUMNS)
    for row in compare.table_rows(result):
        table.add_row(*row)
    console.print(table)
    console.print("  rate chk: the baseline's TLS time / (size/cap); the target is within 15 % (OFF: outside).")
    for t in result["tie_breaks"]:
        slower = ", ".join(map(str, t["baseline_faster_at_mib"])) or "no size"
        console.print(f"  {compare.bandwidth_label(t['bandwidth_mbit'])}: baseline faster at {slower}; "
                      f"travelling faster from {t['travel_faster_from_mib']} MiB up")
    for c in result["link_checks"]:
        console.print(f"  raw TCP through the {c['bandwidth_mbit']:g} Mbit/s link: {c['measured_mbit']:.1f} Mbit/s, "
                      f"time {c['ratio']:.3f} x size/cap ({'ok' if c['ok'] else 'OFF'})")
    if any(c["extrapolated"] for c in result["cells"]):
        console.print(f"  ~: not run (transfer over {result['max_transfer_s']:g} s), extrapolated linearly in size.")


@bench_app.command("codec")
def bench_codec(
    repeat: int = typer.Option(15, help="Timed samples per message; medians are reported."),
    json_path: Optional[Path] = typer.Option(None, "--json", help="Write the results as JSON here."),
) -> None:
    """Encode and decode time of the travel path's messages (the wire codec)."""
    table = numeric_table("Wire codec, travel path (medians, µs per call)",
                          ("message", "bytes", "encode", "decode", "round trip"))
    result = codec_bench.run(repeat, on_row=lambda r: table.add_row(
        r["message"], str(r["bytes"]), f"{r['encode_us']:.2f}", f"{r['decode_us']:.2f}", f"{r['round_trip_us']:.2f}"))
    console.print(table)
    console.print(f"codec: {result['codec']}")
    write_results(json_path, result)


@bench_app.command("ddp")
def bench_ddp(
    gpus: str = typer.Option("1,2,4", help="GPU counts (rank processes), comma separated."),
    models: str = typer.Option("small,base", help="Models, comma separated: small, base."),
    iters: int = typer.Option(5, help="Timed iterations per method (after a warm-up); medians are reported."),
    json_path: Optional[Path] = typer.Option(None, "--json", help="Write the results as JSON here."),
    device: str = typer.Option("cpu", help="cpu (each emulated GPU a CPU process, gloo) or cuda (one real GPU "
                                           "per rank, plain DDP over NCCL, the rings staged through the host)."),
    compress: Optional[str] = typer.Option(None, help="Send the gradients as fp16 or bf16 (every method; off by "
                                                      "default: it changes the numerics)."),
) -> None:
    """Data-parallel training with the ring all-reduce sealed at every hop: plain DDP, the naive
    encrypted ring and the pipelined one (iteration and all-reduce medians, ms)."""
    from gputravel.bench import ddp as ddp_bench  # lazy: torch and torch.distributed

    if device not in ("cpu", "cuda"):
        raise typer.BadParameter("--device is cpu or cuda")
    where = "emulated GPUs are CPU processes" if device == "cpu" else "one CUDA GPU per rank"
    # it: a whole training iteration; ar: the gradient all-reduce alone; x: encrypted / plain;
    # limit: plain + the AES this run measured, spread over the shared cores; /lim: over it.
    table = numeric_table(f"DDP between GPU TEEs (medians, ms; {where})", ("G", "model", "it plain", "it naive",
                          "it enc", "it x", "ar plain", "ar naive", "ar enc", "ar x", "limit", "naive /lim",
                          "enc /lim"))

    def row(r: dict) -> None:
        it, ar, lim = r["iter_ms"], r["allreduce_ms"], r["allreduce_vs_limit"]
        table.add_row(str(r["gpus"]), r["model"], f"{it['plain']:.1f}",
                      f"{it['encrypted_naive']:.1f}", f"{it['encrypted']:.1f}",
                      f"{it['encrypted'] / it['plain']:.2f}", f"{ar['plain']:.2f}", f"{ar['encrypted_naive']:.2f}",
                      f"{ar['encrypted']:.2f}", f"{ar['encrypted'] / max(ar['plain'], 1e-9):.2f}",
                      f"{r['allreduce_limit_ms']:.2f}", f"{lim['encrypted_naive']:.2f}", f"{lim['encrypted']:.2f}")
        cpu = r["allreduce_cpu_ms"]  # one all-reduce's CPU, every rank's summed
        console.print(f"  {r['gpus']} GPU(s), {r['model']} ({r['params']:,} parameters): the ring unsealed "
                      f"{ar['ring_unsealed']:.2f} ms; CPU of one all-reduce, all ranks: gloo {cpu['plain']:.1f}, "
                      f"unsealed {cpu['ring_unsealed']:.1f}, naive {cpu['encrypted_naive']:.1f}, "
                      f"pipelined {cpu['encrypted']:.1f} ms")

    counts = tuple(_ints(gpus, "--gpus takes comma-separated integers, e.g. 1,2,4"))
    result = ddp_bench.run(counts, tuple(m.strip() for m in models.split(",") if m.strip()),
                           iters, on_row=row, device=device, compress=compress)
    console.print(table)
    console.print(f"AES-GCM seal+open: {result['aes_gbps_per_core']:.2f} GB/s a core, {result['cores']} cores shared")
    write_results(json_path, result)


# What the red team's holders hold: marked random bytes, or image records (the digits, canary images among them)
RedTeamData = enum.Enum("RedTeamData", {d: d for d in ("raw", "records")}, type=str)


@app.command("redteam")
def redteam(
    json_path: Optional[Path] = typer.Option(None, "--json", help="Write the results as JSON here."),
    only: Optional[list[str]] = typer.Option(None, "--only", help="Run only this attack (repeatable)."),
    evidence: bool = typer.Option(False, "--evidence", help="Also print what was observed in each attack."),
    data: RedTeamData = typer.Option(RedTeamData.raw, "--data", help="The holders' datasets: random bytes with "
                                     "markers, or image records (the image workload's digits) with canary images."),
) -> None:
    """Run every attack (paper section 6, and more) and count the plaintext each attacker obtained.

    The attacks run against a live local cohort, then the job rows (issue 28) on cohorts of their
    own. Exits 1 if any attack got plaintext or was not stopped."""
    # The command line is the red team's only door: no other command loads it (tests/test_architecture.py).
    from gputravel.redteam.arena import Attack, Verdict  # lazy: only `gputravel redteam` loads the red team
    from gputravel.redteam.jobarena import JobAttack  # lazy: as above
    from gputravel.redteam.jobs import JOB_ATTACKS  # lazy: as above
    from gputravel.redteam.rows import ATTACKS  # lazy: as above
    from gputravel.redteam.run import print_report, run_redteam  # lazy: as above

    names = [a.name for a in ATTACKS + JOB_ATTACKS]
    unknown = sorted(set(only or ()) - set(names))
    if unknown:
        fail(f"unknown attack {', '.join(unknown)}; choose from: {', '.join(names)}")

    def show(a: Attack | JobAttack, v: Verdict) -> None:
        console.print(f"  {a.name}: {'stopped' if v.stopped else '[red]NOT stopped[/red]'}")

    report = run_redteam(only=tuple(only or ()), data=data.value, on_result=show)
    print_report(report, console, evidence=evidence)
    write_results(json_path, report.to_json())
    if report.failed:
        raise typer.Exit(1)


if __name__ == "__main__":  # pragma: no cover
    app()
