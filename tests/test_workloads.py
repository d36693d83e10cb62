"""Workloads (issue 27): loading one, training it on records, G2 on an in-process cohort, the
held-out split, resume. No processes: the in-process cohort travels for real through the device."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

import numpy as np
import pytest

from gputravel.data.demo_records import demo_holders
from gputravel.data.records import Field, RecordSchema, common_schema, load_records, split_arrays
from gputravel.errors import BadInput
from gputravel.files import EVAL_SHARE
from gputravel.holder.cvm import manifest_piece_bytes
from gputravel.protocol.layout import Layout, record_bytes_for
from gputravel.testing.cohort import InProcessCohort
from gputravel.train.job import TrainConfig
from gputravel.train.loader import LocalSource, Cut, TravelSource
from gputravel.train.loop import make_report, train, workload_of
from gputravel.data.records import Units

BUFFER = 16 << 10


@pytest.fixture(scope="module")
def digits(tmp_path_factory) -> tuple[tuple[str, str], ...]:
    return demo_holders("image", 3, tmp_path_factory.mktemp("digits"))


def job(holders, **changes) -> TrainConfig:
    schema = common_schema(holders).canonical_json()
    values = dict(workload="image", record_schema=schema, steps=12, batch=8, buffer_bytes=BUFFER, eval_every=6,
                  checkpoint_every=0, warmup_steps=2, lr=3e-3)
    return TrainConfig(**{**values, **changes})


def travelled(cfg: TrainConfig, holders, tmp_path: Path, **kw):
    return on_cohort(cfg, holders, tmp_path, lambda source: train(cfg, source, **kw))


def script_travelled(cfg: TrainConfig, holders, tmp_path: Path):
    from gputravel.train.scripted import run_job

    return on_cohort(cfg, holders, tmp_path, lambda source: run_job(cfg, source))


def on_cohort(cfg: TrainConfig, holders, tmp_path: Path, run):
    paths = {name: Path(path) for name, path in holders}
    layout = Layout(record_bytes=record_bytes_for(cfg.buffer_bytes))  # as the demo's cohort and local reference
    with InProcessCohort(paths, buffer_bytes=cfg.buffer_bytes, workdir=tmp_path, layout=layout,
                         formats=dict.fromkeys(paths, "records"), schema=cfg.record_schema) as cohort:
        orch = cohort.orchestrator
        hellos = {name: orch.travel_sm.holders[name] for name in paths}
        schema = RecordSchema.from_json(cfg.record_schema)
        cuts = {n: Cut(Units(schema.record_bytes, h.piece_bytes), h.train_records, h.eval_records, schema.dtype)
                for n, h in hellos.items()}
        return run(TravelSource(orch, {n: h.dataset_bytes for n, h in hellos.items()}, cuts))


def test_shipped_workloads_load_and_a_file_workload_is_its_text() -> None:
    assert workload_of(TrainConfig()).tokens
    image = workload_of(TrainConfig(workload="image"))
    assert image.schema.text() == "image: uint8[1,8,8]; label: int64[]"
    code = "SCHEMA = 'x: float32[3]; label: int64[]'\nimport torch\ndef model(s): return torch.nn.Linear(3, 2)\n" \
           "def inputs(r): return r['x'], r['label']\n"
    mine = workload_of(TrainConfig(workload="mine", workload_code=code))
    assert mine.name == "mine" and [f.name for f in mine.schema.fields] == ["x", "label"]
    # The text is in the job, so in what holders pin: one changed line is another job.
    assert TrainConfig(workload="mine", workload_code=code).canonical_json() != \
        TrainConfig(workload="mine", workload_code=code.replace("2)", "3)")).canonical_json()


@pytest.mark.parametrize(("code", "said"), [
    ("SCHEMA = 'x: float32[3]'\n", "does not define model, inputs"),
    ("raise ValueError('boom')\n", "failed to load: ValueError: boom"),
    ("SCHEMA = 3\ndef model(s): pass\ndef inputs(r): pass\n", "SCHEMA is a string"),
])
def test_a_broken_workload_file_is_named(code: str, said: str) -> None:
    with pytest.raises(BadInput, match=said):
        workload_of(TrainConfig(workload="mine", workload_code=code))


def test_a_workload_and_records_of_another_shape_are_refused() -> None:
    other = RecordSchema((Field("image", "uint8", (1, 28, 28)), Field("label", "int64")))
    with pytest.raises(BadInput, match=r"trains on records image: uint8\[1,8,8\].*hold image: uint8\[1,28,28\]"):
        workload_of(TrainConfig(workload="image", record_schema=other.canonical_json()))
    with pytest.raises(BadInput, match="--workload: expected one of gpt2, image, tabular or a workload file"):
        TrainConfig(workload="nope")


def test_holders_of_two_schemas_are_named_before_anything_starts(digits, tmp_path: Path) -> None:
    tables = demo_holders("tabular", 1, tmp_path)
    with pytest.raises(BadInput, match=re.escape("holder 'b' holds records of another schema than holder 'a': "
                                                 "field 'image' is missing (expected image: uint8[1,8,8])")):
        common_schema([("a", digits[0][1]), ("b", tables[0][1])])


@pytest.mark.parametrize("workload", ["image", "tabular"])
def test_g2_travelling_and_local_records_give_bit_identical_losses_and_metrics(digits, tumours, workload: str,
                                                                               tmp_path: Path) -> None:
    holders = digits if workload == "image" else tumours
    cfg = job(holders, workload=workload)
    local = train(cfg, LocalSource.of(cfg, holders))
    moved = travelled(cfg, holders, tmp_path)
    assert moved.losses == local.losses and len(local.losses) == cfg.steps
    assert moved.evals == local.evals and [e["step"] for e in local.evals] == [6, 12]
    report = make_report(cfg, local)
    assert set(report["eval"]["per_holder"]) == {n for n, _ in holders}
    assert report["eval"]["all"]["records"] == sum(len(split_arrays(load_records(p), EVAL_SHARE)[1]) for _, p in holders)
    # Held-out records travel for evaluation only, each counted in the report.
    assert any(t.get("held_out") for t in report["travels"])


def test_held_out_records_are_never_trained_on(digits, tmp_path: Path) -> None:
    """The training loader's records and the evaluation's are disjoint sets of record digests."""
    cfg = job(digits, steps=200, eval_every=0)  # over an epoch: every training record is drawn
    source = LocalSource.of(cfg, digits)
    seen_train, seen_held = set(), set()
    fetch, fetch_held = source.fetch, source.fetch_held
    source.fetch = lambda v: _note(fetch(v), seen_train)  # type: ignore[method-assign]
    source.fetch_held = lambda v: _note(fetch_held(v), seen_held)  # type: ignore[method-assign]
    train(cfg, source)
    assert seen_train and seen_held and not seen_train & seen_held
    everything = {hashlib.sha256(r.tobytes()).digest() for _, p in digits for r in load_records(p).array}
    assert seen_train | seen_held <= everything


def _note(records: np.ndarray, into: set) -> np.ndarray:
    into.update(hashlib.sha256(r.tobytes()).digest() for r in records)
    return records


def test_records_are_shuffled_within_a_visit_and_the_same_for_the_same_seed(digits) -> None:
    cfg = job(digits, steps=30, eval_every=0)
    a, b = train(cfg, LocalSource.of(cfg, digits)), train(cfg, LocalSource.of(cfg, digits))
    assert a.losses == b.losses
    c = train(cfg.replace(seed=1), LocalSource.of(cfg, digits))
    assert c.losses != a.losses


def test_a_stopped_records_run_resumes_to_the_same_losses_and_metrics(digits, tmp_path: Path) -> None:
    cfg = job(digits, steps=12, eval_every=4, checkpoint_every=5)
    whole = train(cfg, LocalSource.of(cfg, digits))
    asked = []
    first = train(cfg, LocalSource.of(cfg, digits), run_dir=tmp_path / "run",
                  should_stop=lambda: asked.append(1) or len(asked) == 7)
    assert first.stopped and len(first.losses) == 7
    resumed = train(cfg, LocalSource.of(cfg, digits), run_dir=tmp_path / "run",
                    resume_from=tmp_path / "run" / "checkpoint.pt")
    assert resumed.losses == whole.losses and resumed.evals == whole.evals
    assert (tmp_path / "run" / "eval.png").is_file()


def test_the_local_reference_lays_out_records_as_the_holders_do(digits) -> None:
    cfg = job(digits)
    piece = manifest_piece_bytes(Layout(record_bytes=record_bytes_for(cfg.buffer_bytes)))
    source = LocalSource.of(cfg, digits)
    assert source.capacity(cfg.buffer_bytes) == Units(72, piece).capacity(cfg.buffer_bytes)
    train_, held = split_arrays(load_records(digits[0][1]), EVAL_SHARE)
    assert source.sizes()[digits[0][0]] == len(train_) and source.held_sizes()[digits[0][0]] == len(held)


SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "tabular_train_gputravel.py"


@pytest.fixture(scope="module")
def tumours(tmp_path_factory) -> tuple[tuple[str, str], ...]:
    return demo_holders("tabular", 3, tmp_path_factory.mktemp("tumours"))


def script_job(holders, code: str) -> TrainConfig:
    return TrainConfig(workload="port", workload_code=code, script=True, batch=8, buffer_bytes=BUFFER,
                       record_schema=common_schema(holders).canonical_json())


def test_g2_a_ported_script_sees_the_same_batches_travelling_and_local(tumours, tmp_path: Path) -> None:
    from gputravel.train.scripted import run_job

    cfg = script_job(tumours, SCRIPT.read_text())
    local = run_job(cfg, LocalSource.of(cfg, tumours))
    moved = script_travelled(cfg, tumours, tmp_path)
    # Three epochs of every holder's training records, B at a time, each visit's tail dropped.
    per_epoch = sum(n // cfg.batch for n in LocalSource.of(cfg, tumours).sizes().values())
    assert moved.losses == local.losses and len(local.losses) == 3 * per_epoch


def test_a_failing_script_is_named_by_type_and_line_never_by_its_message(tumours) -> None:
    from gputravel.train.scripted import run_job

    code = "from gputravel.workloads.script import batches\nfor b in batches():\n    raise ValueError(str(b))\n"
    cfg = script_job(tumours, code)
    with pytest.raises(BadInput, match=r"^script 'port' failed: ValueError at line 3$"):
        run_job(cfg, LocalSource.of(cfg, tumours))


def test_batches_outside_a_job_says_how_to_run_a_script() -> None:
    from gputravel.workloads.script import batches

    with pytest.raises(BadInput, match="gputravel demo --script FILE"):
        next(iter(batches()))


def test_one_changed_line_of_a_workload_or_script_changes_the_orchestrators_measurement() -> None:
    """Holders approve the job in the orchestrator's RTMR[3] by digest: an edited workload is another job to them."""
    from gputravel.orchestrator.cvm import OrchestratorConfig
    from gputravel.orchestrator.job import job_digest

    def measured(cfg: TrainConfig) -> bytes:
        return job_digest(OrchestratorConfig("host.sock", "pki", Layout(record_bytes=BUFFER), BUFFER,
                                             schema=cfg.record_schema, job_json=cfg.canonical_json()))

    code = SCRIPT.read_text()
    base = TrainConfig(workload="port", workload_code=code, script=True)
    edited = base.replace(workload_code=code.replace("lr=1e-3", "lr=2e-3"))
    assert measured(base) != measured(edited)
    shipped = TrainConfig(workload="image")
    assert measured(shipped) != measured(shipped.replace(workload="tabular"))


def test_g2_holds_for_records_on_two_gpus_services_against_local_ranks(processes, digits, searchable_tmp: Path,
                                                                        tmp_path: Path) -> None:
    """Two orchestrator ranks on the parties' services, each travelling to its share, against two local
    rank processes reading the same records: equal losses and held-out metrics."""
    from gputravel.jobs.training import TrainingJobConfig, run_training_job

    base = TrainConfig(workload="image", steps=8, batch=8, buffer_bytes=BUFFER, eval_every=4, checkpoint_every=0,
                       warmup_steps=2)
    runs = {loader: run_training_job(TrainingJobConfig(train=base.replace(loader=loader), holders=digits, gpus=2,
                                                       run_dir=str(searchable_tmp / loader)))
            for loader in ("travelling", "local")}
    moved, local = runs["travelling"], runs["local"]
    assert moved["losses"] == local["losses"] and len(local["losses"]) == 8
    assert moved["eval_history"] == local["eval_history"] and [e["step"] for e in local["eval_history"]] == [4, 8]
    assert set(moved["eval"]["per_holder"]) == {n for n, _ in digits}


def test_a_training_chunk_ends_where_the_held_out_records_start(tmp_path: Path) -> None:
    """No travel for training brings a held-out record into the GPU's buffer, even where the buffer
    would hold more (the hostile review of issue 27 found the chunk ran on into them)."""
    from gputravel.data.records import write_records

    schema = RecordSchema((Field("x", "float32", (4,)), Field("label", "int64")))
    paths = {}
    for name in ("h1", "h2"):
        array = np.zeros(50, dtype=schema.dtype)
        array["label"] = np.arange(50) + (1000 if name == "h1" else 2000)  # every record distinct
        write_records(tmp_path / name, schema, array)
        paths[name] = tmp_path / name
    buffer = 64 << 10  # holds a holder's every record
    layout = Layout(record_bytes=4096)
    with InProcessCohort(paths, buffer_bytes=buffer, workdir=tmp_path, layout=layout,
                         formats=dict.fromkeys(paths, "records"), schema=schema.canonical_json()) as cohort:
        orch = cohort.orchestrator
        for name, path in paths.items():
            hello = orch.travel_sm.holders[name]
            units = Units(schema.record_bytes, hello.piece_bytes)
            train_, held = split_arrays(load_records(path), EVAL_SHARE)
            report = orch.travel(name, 0)
            assert report.chunk.nbytes == units.eval_base(hello.train_records) < hello.dataset_bytes
            carried = bytes(orch.buffer_view())
            assert all(r.tobytes() in carried for r in train_)
            assert not any(r.tobytes() in carried for r in held)
            report = orch.travel(name, units.eval_base(hello.train_records))  # the held-out records, on their own
            carried = bytes(orch.buffer_view())
            assert all(r.tobytes() in carried for r in held) and not any(r.tobytes() in carried for r in train_)


@pytest.mark.parametrize("where", ["model", "inputs", "loss", "metrics"])
def test_a_failing_workload_is_named_by_type_and_line_never_by_its_message(tumours, where: str) -> None:
    """The hostile review of issue 27 made a holder's label 31337 reach the orchestrator's log
    through cross_entropy's message; a workload's own code failing says type and line only."""
    fails = {w: (f"    raise ValueError(str({'s' if w == 'model' else 'r' if w == 'inputs' else 'y'}))\n"
                 if w == where else "") for w in ("model", "inputs", "loss", "metrics")}
    code = ("import torch\nSCHEMA = 'features: float32[30]; label: int64[]'\n"
            f"def model(s):\n{fails['model']}    return torch.nn.Linear(30, 2)\n"
            f"def inputs(r):\n{fails['inputs']}    return r['features'], r['label']\n"
            f"def loss(o, y):\n{fails['loss']}    return torch.nn.functional.cross_entropy(o, y)\n"
            f"def metrics(o, y):\n{fails['metrics']}    return {{'loss': torch.nn.functional.cross_entropy(o, y)}}\n")
    cfg = TrainConfig(workload="mine", workload_code=code, batch=8, buffer_bytes=BUFFER, steps=2,
                      record_schema=common_schema(tumours).canonical_json())
    with pytest.raises(BadInput) as caught:
        train(cfg, LocalSource.of(cfg, tumours))
    assert re.fullmatch(rf"workload 'mine' failed in {where}: ValueError at line \d+", str(caught.value))


def test_a_script_that_exits_with_a_message_is_named_without_it(tumours) -> None:
    from gputravel.train.scripted import run_job

    for code, refused in (("import sys\nsys.exit('label 31337')\n", True), ("import sys\nsys.exit(0)\n", False)):
        cfg = script_job(tumours, code)
        if refused:
            with pytest.raises(BadInput, match=r"^script 'port' exited: SystemExit at line 2$"):
                run_job(cfg, LocalSource.of(cfg, tumours))
        else:
            assert run_job(cfg, LocalSource.of(cfg, tumours)).losses == []


def test_code_runs_only_on_an_orchestrator_measured_with_its_job_in_canonical_form(tumours, tmp_path: Path) -> None:
    """The hostile review of issue 27: with no measured job, any Train command's code ran; with a
    measured job of duplicate keys, reviewers and json.loads could read two different codes."""
    from dataclasses import replace

    from gputravel.orchestrator.process import run_training
    from gputravel.protocol.control import Train
    from gputravel.transport.memory import memory_pair

    schema = common_schema(tumours).canonical_json()
    cfg = TrainConfig(workload="mine", workload_code=(Path(__file__).parents[1] / "src/gputravel/workloads/tabular.py")
                      .read_text(), record_schema=schema, buffer_bytes=BUFFER, steps=2)
    text = cfg.canonical_json()
    twice = text[:-1] + ',"workload_code":"import os"}'  # the last key wins in json.loads
    paths = {name: Path(path) for name, path in tumours}
    layout = Layout(record_bytes=record_bytes_for(BUFFER))
    for measured, said in (("", "runs only on an orchestrator measured with that job"),
                           (twice, "is not in canonical form")):
        with InProcessCohort(paths, buffer_bytes=BUFFER, workdir=tmp_path, layout=layout,
                             formats=dict.fromkeys(paths, "records"), schema=schema) as cohort:
            orch = cohort.orchestrator
            orch.config = replace(orch.config, job_json=measured)
            control, _ = memory_pair("control", "launcher")
            cmd = Train(config_json=twice if measured else text, run_dir="", resume_checkpoint="", rank=0,
                        world_size=1, master="", ifname="", shares=(), ranks_context=b"")
            with pytest.raises(BadInput, match=said):
                run_training(orch, cmd, control, None)


@pytest.mark.parametrize("doc", [
    '{"fields":[{"name":"x","dtype":"uint8","shape":[1],"note":1}]}',  # an unknown key: not dropped
    '{"fields":["x"]}',
    '{"fields":[{"name":"x","dtype":"uint8","shape":[true]}]}',
    '{"fields":[{"name":"x","dtype":"uint8","shape":[1],"names":"cd"}]}',  # not the names ("c", "d")
    '{"fields":[{"name":"x","dtype":"uint8"}]}',
    '{"fields":[],"x":1}',
])
def test_a_schema_is_read_strictly_nothing_dropped_or_coerced(doc: str) -> None:
    """The hostile review of issue 27: fields that were not objects, or had an unknown key, vanished."""
    with pytest.raises(BadInput, match="a schema is"):
        RecordSchema.from_json(doc)


def test_packing_never_replaces_a_directory_that_holds_anything_else(tmp_path: Path) -> None:
    from gputravel.data.records import write_records

    schema = RecordSchema.parse("x: float32[2]; label: int64[]")
    write_records(tmp_path / "out", schema, np.zeros(3, dtype=schema.dtype))
    (tmp_path / "out" / "notes.txt").write_text("mine")
    with pytest.raises(BadInput, match="is not a record dataset alone"):
        write_records(tmp_path / "out", schema, np.ones(3, dtype=schema.dtype))
    assert (tmp_path / "out" / "notes.txt").read_text() == "mine"


def test_cohort_init_refuses_a_job_of_tokens_over_record_holders(tumours, searchable_tmp: Path) -> None:
    from gputravel.service.init import init_cohort

    with pytest.raises(BadInput, match=r"job\.record_schema: the holders hold records, the job trains on tokens"):
        init_cohort(searchable_tmp / "c", tumours, job={"workload": "tabular", "record_schema": ""})


@pytest.mark.parametrize("where", ["backward", "optimizer step", "own error", "keyboard"])
def test_a_workload_cannot_carry_a_record_out_in_an_error_from_any_of_its_code(tumours, where: str) -> None:
    """The second review of issue 27: backward and the optimizer's step ran unguarded, and the
    workload's own BadInput, KeyboardInterrupt or exception class could carry a record's value."""
    body = {
        "backward": (("class F(torch.autograd.Function):\n    @staticmethod\n    def forward(ctx, x): return x\n"
                     "    @staticmethod\n    def backward(ctx, g): raise ValueError(str(g.tolist()))\n"
                     "def inputs(r): return r['features'], r['label']\n"
                     "def loss(o, y): return torch.nn.functional.cross_entropy(F.apply(o), y)\n"), "backward: ValueError"),
        "optimizer step": (("class Opt(torch.optim.SGD):\n    def step(self, closure=None):\n"
                           "        raise FloatingPointError(str([p.grad.tolist() for p in self.param_groups[0]['params']]))\n"
                           "def optimizer(params, lr, weight_decay): return Opt(params, lr=lr)\n"
                           "def inputs(r): return r['features'], r['label']\n"), "optimizer step: FloatingPointError"),
        "own error": (("from gputravel.errors import BadInput\nclass E(Exception): pass\n"
                      "def inputs(r): raise BadInput(str(r['label'].tolist()))\n"), "inputs: an exception the code defines"),
        "keyboard": ("def inputs(r): raise KeyboardInterrupt(str(r['features'].tolist()))\n", "inputs: KeyboardInterrupt"),
    }[where]
    code = ("import torch\nSCHEMA = 'features: float32[30]; label: int64[]'\n"
            "def model(s): return torch.nn.Linear(30, 2)\n" + body[0])
    cfg = TrainConfig(workload="mine", workload_code=code, batch=8, buffer_bytes=BUFFER, steps=2,
                      record_schema=common_schema(tumours).canonical_json())
    with pytest.raises(BadInput) as caught:
        train(cfg, LocalSource.of(cfg, tumours))
    assert re.fullmatch(rf"workload 'mine' failed in {body[1]} at line \d+", str(caught.value)), str(caught.value)


def test_a_resume_over_a_holders_changed_data_or_split_is_refused(digits, tmp_path: Path) -> None:
    """The second review of issue 27: a holder that re-split its records between a stop and the
    resume had its formerly held-out records trained on. The checkpoint records what each brought."""
    cfg = job(digits, steps=6, eval_every=0, checkpoint_every=3)
    asked = []
    train(cfg, LocalSource.of(cfg, digits), run_dir=tmp_path / "run", should_stop=lambda: asked.append(1) or len(asked) == 3)
    checkpoint = tmp_path / "run" / "checkpoint.pt"
    with pytest.raises(BadInput, match=r"the data or held-out split of holders 'holder-1', 'holder-2', 'holder-3' changed since"):
        train(cfg, LocalSource.of(cfg, digits, eval_share=0.3), resume_from=checkpoint)
    assert len(train(cfg, LocalSource.of(cfg, digits), resume_from=checkpoint).losses) == 6  # the same: resumed


class _LosesHeldOut:
    """A source whose `holder` is lost in every travel for its held-out records."""

    def __init__(self, inner, holder: str) -> None:
        self.inner, self.holder, self.last_report = inner, holder, None

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def fetch_held(self, visit):
        from gputravel.errors import HolderLost

        if visit.holder == self.holder:
            raise HolderLost(visit.holder, "gone", "an evaluation travel")
        return self.inner.fetch_held(visit)


def test_a_holder_lost_in_an_evaluation_travel_is_left_out_and_training_goes_on(digits) -> None:
    """The code review of issue 27: training skipped a lost holder, evaluation let it end the run."""
    cfg = job(digits, steps=8, eval_every=4)
    events = []
    result = train(cfg, _LosesHeldOut(LocalSource.of(cfg, digits), "holder-2"), on_step=events.append)
    assert len(result.losses) == 8 and [e["step"] for e in result.evals] == [4, 8]
    assert set(result.evals[-1]["per_holder"]) == {"holder-1", "holder-3"} and result.lost
    # The steps after an evaluation belong to the training visit, not to the last holder evaluated.
    assert events[4].holder == events[3].holder


def test_a_script_trains_on_holder_data_given_on_the_command_line(tumours, tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from gputravel.cli.app import app

    args = ["demo", "--script", str(SCRIPT), "--loader", "local", "--run-dir", str(tmp_path / "run"),
            *[f"--holder-data={name}={path}" for name, path in tumours]]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output


@pytest.mark.parametrize("count", [1, 13, 14, 40, 121])
def test_records_laid_out_a_block_at_a_time_are_the_same_bytes(count: int, monkeypatch) -> None:
    """A holder lays its records straight into its mapping, a block of pieces at a time; where a
    block ends must not show: every record whole in its piece, the padding zero, blocks or not."""
    import gputravel.data.records as records

    schema = RecordSchema.parse("x: uint8[9]; label: int64[]")  # 17 bytes: 3 to a 64-byte piece, 13 padding
    array = np.zeros(count, dtype=schema.dtype)
    array["x"], array["label"] = np.arange(count * 9).reshape(count, 9) % 251, np.arange(count) + 1
    units = Units(schema.record_bytes, 64)
    whole = records.lay_out_split(records.Records(schema, array), units, 0.3, 5)
    monkeypatch.setattr(records, "_BLOCK_BYTES", 64)  # a piece a block
    assert records.lay_out_split(records.Records(schema, array), units, 0.3, 5) == whole
    laid, train, held = whole
    train_, held_ = split_arrays(records.Records(schema, array), 0.3, 5)
    assert units.read(memoryview(laid), train, schema.dtype).tobytes() == train_.tobytes()
    if held:
        base = units.eval_base(train)
        assert units.read(memoryview(laid)[base:], held, schema.dtype).tobytes() == held_.tobytes()
    pieces = [bytes(laid[i : i + 64]) for i in range(0, len(laid), 64)]
    assert all(p[51:] == bytes(max(0, len(p) - 51)) for p in pieces)  # 3 records of 17, then zeros


def test_a_script_under_a_manifest_hands_back_the_model_it_keeps(tumours, tmp_path: Path) -> None:
    """Issue 28 for scripts: the model a script hands `keep()` is what a manifest job seals and
    releases, equal to the script's model trained on the same batches; a script that keeps none is
    refused rather than releasing nothing, and no plot is written where metrics may not be kept."""
    import io

    import torch

    from gputravel.train.rundir import Kept
    from gputravel.train.scripted import run_job

    cfg = script_job(tumours, SCRIPT.read_text())
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    kept = run_job(cfg, LocalSource.of(cfg, tumours), run_dir=run_dir, kept=Kept(metrics=False, weights=True))
    state = torch.load(io.BytesIO(kept.weights), weights_only=True)
    assert sorted(state) == ["0.bias", "0.weight", "2.bias", "2.weight", "4.bias", "4.weight"]
    assert list(run_dir.iterdir()) == []  # the loss plot is a metric the manifest keeps in
    again = run_job(cfg, LocalSource.of(cfg, tumours), kept=Kept(weights=True))
    assert all(torch.equal(state[k], v) for k, v in torch.load(io.BytesIO(again.weights), weights_only=True).items())
    nothing = cfg.replace(workload_code=SCRIPT.read_text().replace("\nkeep(model)", "\n# keep(model)"))
    with pytest.raises(BadInput, match=r"script 'port' handed no model to gputravel\.workloads\.script\.keep"):
        run_job(nothing, LocalSource.of(cfg, tumours), kept=Kept(weights=True))
    with pytest.raises(BadInput, match=r"keep\(\) takes the trained torch\.nn\.Module, got dict"):
        run_job(cfg.replace(workload_code="from gputravel.workloads.script import keep\nkeep({})\n"),
                LocalSource.of(cfg, tumours))
