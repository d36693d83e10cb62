"""Records kept resident (issue 27, the job's resident_mib): a visit kept trains again without
travelling, the batches unchanged (G2), the records zeroed when the job ends. In-process cohort:
the travels are real, through the device."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from gputravel.data.demo_records import demo_holders
from gputravel.errors import BadInput, HolderLost
from gputravel.train.loader import Kept, LocalSource
from gputravel.train.loop import train
from gputravel.train.schedule import Visit

from test_workloads import job, travelled


@pytest.fixture(scope="module")
def digits(tmp_path_factory) -> tuple[tuple[str, str], ...]:
    return demo_holders("image", 3, tmp_path_factory.mktemp("digits"))


def _travels(result, held: bool) -> list[tuple[str, int]]:
    return [(t["holder"], t["token_offset"]) for t in result.travels if bool(t.get("held_out")) == held]


def test_kept_visits_travel_once_and_train_to_the_losses_of_every_visit_travelling(digits, tmp_path: Path) -> None:
    # About 45 steps an epoch (1,437 training records, B 32): 100 steps are over two epochs, 4 evaluations.
    cfg = job(digits, steps=100, batch=32, eval_every=25)
    local = train(cfg, LocalSource.of(cfg, digits))
    every = travelled(cfg, digits, tmp_path / "every")
    kept = travelled(cfg.replace(resident_mib=1), digits, tmp_path / "kept")
    assert kept.losses == every.losses == local.losses and len(local.losses) == cfg.steps
    assert kept.evals == every.evals == local.evals and len(local.evals) == 4
    # Each visit travelled once, training and held-out: no visit twice, and fewer travels than without.
    trained, held = _travels(kept, held=False), _travels(kept, held=True)
    assert len(trained) == len(set(trained)) and len(held) == len(set(held))
    assert {h for h, _ in trained} == {h for h, _ in held} == {n for n, _ in digits}
    assert len(_travels(every, held=False)) > len(trained) and len(_travels(every, held=True)) == 4 * len(held)


def test_a_budget_keeps_the_first_visits_it_holds_and_the_end_zeroes_them() -> None:
    kept = Kept(budget_bytes=64)
    a, b = np.arange(8, dtype=np.int64), np.arange(8, 16, dtype=np.int64)  # 64 bytes each
    first = kept.keep(Visit("a", 0, 8), a)
    assert first is not a and np.array_equal(first, a)  # a copy: the buffer is scrubbed next travel
    assert kept.keep(Visit("b", 0, 8), b) is b and kept.get(Visit("b", 0, 8)) is None  # past the budget
    assert kept.get(Visit("a", 0, 8)) is first and kept.get(Visit("a", 0, 8), held=True) is None
    kept.forget()
    assert not first.any() and kept.get(Visit("a", 0, 8)) is None and kept.used == 0
    assert Kept(0).keep(Visit("a", 0, 8), a) is a  # 0: nothing kept


def test_the_loader_zeroes_what_it_kept_when_the_steps_end(digits, monkeypatch) -> None:
    cfg = job(digits, steps=10, batch=32, eval_every=0, resident_mib=1)
    seen: list[Kept] = []
    forget = Kept.forget

    def noted(self: Kept) -> None:
        seen.append(self)
        arrays = list(self._units.values())
        forget(self)
        assert arrays and not any(np.frombuffer(a.tobytes(), np.uint8).any() for a in arrays)

    monkeypatch.setattr(Kept, "forget", noted)
    train(cfg, LocalSource.of(cfg, digits))
    assert len(seen) == 1 and seen[0].used == 0


def test_no_kept_record_reaches_the_run_directory_or_its_checkpoints(digits, tmp_path: Path) -> None:
    """Kept records live in the orchestrator's memory only: every file the run writes (the
    plaintext checkpoints included) is searched for every training image's bytes."""
    cfg = job(digits, steps=100, batch=32, eval_every=50, checkpoint_every=50, resident_mib=1)
    source = LocalSource.of(cfg, digits)
    train(cfg, source, run_dir=tmp_path / "run")
    images = {bytes(r["image"].tobytes()) for name, _ in digits for r in source.fetch(Visit(name, 0, 64))}
    images |= {bytes(r["image"].tobytes()) for name, _ in digits for r in source.fetch_held(Visit(name, 0, 64))}
    images = {i for i in images if len(set(i)) > 4}  # no all-blank image: zeros are found anywhere
    written = [p.read_bytes() for p in (tmp_path / "run").rglob("*") if p.is_file()]
    assert images and written and any(p.name.startswith("checkpoint") for p in (tmp_path / "run").rglob("*"))
    assert not [i for i in images for w in written if i in w]


def test_job_show_states_how_long_records_are_kept() -> None:
    from gputravel.manifest.model import JobManifest
    from gputravel.train.job import TrainConfig

    def shown(cfg: TrainConfig) -> str:
        return JobManifest.for_job(cfg, holders=["alice"], quorum=1, recipients=[],
                                   outputs=_sealed()).describe()

    assert "retention   none" in shown(TrainConfig())
    kept = shown(TrainConfig(resident_mib=8))
    assert "retention   up to 8 MiB of travelled records kept in the orchestrator CVM's memory" in kept
    assert "never checkpointed" in kept
    from gputravel.data.records import RecordSchema

    tables = RecordSchema.parse("features: float32[4]; label: int64[]").canonical_json()
    dp = shown(TrainConfig(workload="tabular", record_schema=tables, dp_epsilon=3.0))  # it keeps every record itself
    assert "retention   every holder's training records kept" in dp
    with pytest.raises(BadInput, match="--resident-mib: expected 0 with DP-SGD"):
        TrainConfig(workload="tabular", dp_epsilon=3.0, resident_mib=1)


def test_zero_takes_only_an_array_it_can_zero_in_place() -> None:
    from gputravel.train.loader import zero

    with pytest.raises(ValueError, match="C-contiguous"):
        zero(np.asfortranarray(np.ones((3, 4))))
    with pytest.raises(ValueError, match="C-contiguous"):
        zero(np.ones(8)[::2])


def _sealed():
    from gputravel.manifest.sections import Outputs

    return Outputs(model="sealed")


def test_a_holder_that_leaves_is_trained_on_no_more_from_its_kept_records(tmp_path: Path) -> None:
    """As a failed travel would: the orchestrator drops holder-2 after step 20 (as it does on its
    goodbye); its kept records are not trained on nor evaluated after, and the result says it left."""
    from test_workloads import on_cohort

    holders = demo_holders("tabular", 3, tmp_path / "data")
    gone = holders[1][0]
    cfg = job(holders, workload="tabular", steps=60, batch=32, eval_every=10, resident_mib=1)
    holder_at: list[str] = []

    def run(source):
        def on_step(event) -> None:
            holder_at.append(event.holder)
            if event.step + 1 == 20:
                source.engine.drop(gone)  # the in-process orchestrator
        return train(cfg, source, on_step=on_step)

    result = on_cohort(cfg, holders, tmp_path / "cohort", run)
    # Its visit under way at step 20 ends (a visit is 4 batches here); none after.
    assert gone in holder_at[:20] and gone not in holder_at[24:] and len(result.losses) == cfg.steps
    assert all(gone not in e["per_holder"] for e in result.evals if e["step"] > 20)
    assert any(gone in e["per_holder"] for e in result.evals if e["step"] <= 20)
    assert any(repr(gone) in why and "left the cohort" in why for why in result.lost)


def test_a_workload_changing_held_out_records_in_place_leaves_the_kept_ones_as_they_came(tmp_path: Path) -> None:
    from gputravel.data.records import RecordSchema, write_records
    from gputravel.train.job import TrainConfig

    code = ("SCHEMA = 'row: float32[9]'\nimport torch\ndef model(schema): return torch.nn.Linear(8, 2)\n"
            "def inputs(records):\n    r = records['row']\n    r[:, :8].mul_(0.5)\n    return r[:, :8], r[:, 8].long()\n")
    schema = RecordSchema.parse("row: float32[9]")
    holders = []
    for i, name in enumerate(("alice", "bob")):
        rows = np.zeros(200, schema.dtype)
        rows["row"][:, :8] = np.random.default_rng(i).normal(size=(200, 8))
        rows["row"][:, 8] = rows["row"][:, 0] > 0
        write_records(tmp_path / name, schema, rows)
        holders.append((name, str(tmp_path / name)))
    cfg = TrainConfig(workload="mine", workload_code=code, record_schema=schema.canonical_json(), steps=40, batch=16,
                      buffer_bytes=16 << 10, eval_every=10, checkpoint_every=0, warmup_steps=2, lr=3e-3)
    every, kept = (train(cfg.replace(resident_mib=mib), LocalSource.of(cfg, holders)) for mib in (0, 1))
    assert kept.losses == every.losses and kept.evals == every.evals and len(every.evals) == 4


def test_a_holder_that_leaves_a_dp_job_stops_it_before_another_step(tmp_path: Path, monkeypatch) -> None:
    """docs/security.md row 74. The hostile review of the broker's dp key: a DP job that went on
    without a holder that left drew the noise a rerun over every holder draws again, so the host
    ran the job twice, cut a holder's link in one run, and the two runs' noised gradients at that
    step differed by the holder's records alone (the noise cancelled to 7e-9)."""
    from test_dp_training import KEY, job as dp_job
    from test_shuffle_all import leaving_at

    holders = demo_holders("tabular", 3, tmp_path)
    cfg = dp_job(holders, steps=12)
    taken: list[int] = []
    with pytest.raises(HolderLost, match=rf"holder {holders[1][0]!r} lost during a DP-SGD job"):
        leaving_at(monkeypatch, cfg, holders, "Resident", 4, taken, dp_key=KEY)
    assert taken == [1, 2, 3, 4]  # the steps before it left; none after


class _Slowed:
    """A LocalSource whose every fetch takes one second of `clock` (the loader's clock in the test)."""

    def __init__(self, source: LocalSource, clock: list[float]) -> None:
        self.source, self.clock = source, clock
        self.asked: list[tuple[str, int, bool]] = []

    def __getattr__(self, name: str):
        return getattr(self.source, name)

    def fetch(self, visit: Visit):
        self.clock[0] += 1.0
        self.asked.append((visit.holder, visit.token_offset, False))
        return self.source.fetch(visit)

    def fetch_held(self, visit: Visit):
        self.clock[0] += 1.0
        self.asked.append((visit.holder, visit.token_offset, True))
        return self.source.fetch_held(visit)


@pytest.mark.parametrize("resident_mib", [0, 1])
def test_the_stall_counts_every_travel_and_its_first_pass_each_holders_first(digits, monkeypatch,
                                                                           resident_mib: int) -> None:
    """`bench train`'s steady-state stall rests on this: a holder's first travel (training, held out)
    is the first pass; its next chunks and a travel that brings units again (none kept) are not."""
    import types

    from gputravel.train import loader as loader_module
    from gputravel.train.loader import Shuffled, TravellingLoader

    clock = [0.0]
    monkeypatch.setattr(loader_module, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    cfg = job(digits, steps=1, batch=32, buffer_bytes=16 << 10)
    source = _Slowed(LocalSource.of(cfg, digits), clock)
    loader = TravellingLoader(source, cfg.batch, cfg.seq_len, cfg.buffer_bytes,
                              batching=Shuffled(cfg.batch, 0, lambda t: t), resident_bytes=resident_mib << 20)
    batches = iter(loader)
    while loader.state.epoch < 2:  # epochs 0 and 1, then the first batch of epoch 2
        next(batches)
    for _ in range(2):  # one holder's held-out records, evaluated twice
        list(loader.held_out(digits[0][0]))
    asked = source.asked
    assert len({a for a in asked if not a[2]}) > 3 and any(a[2] for a in asked)  # several visits, some held out
    assert loader.stall_seconds == len(asked)  # every travel waited for, held-out ones too
    # Each holder's first training travel and first held-out one: a holder's next chunks are not.
    assert loader.first_pass_seconds == len({(h, held) for h, _, held in asked}) < len(set(asked))
    assert (len(asked) == len(set(asked))) == bool(resident_mib)  # kept: nothing travels twice


def test_a_failed_travel_is_stall_but_not_the_first_pass(digits, monkeypatch) -> None:
    import types

    from gputravel.errors import HolderLost
    from gputravel.train import loader as loader_module
    from gputravel.train.loader import Shuffled, TravellingLoader

    clock = [0.0]
    monkeypatch.setattr(loader_module, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    cfg = job(digits, steps=1, batch=32, buffer_bytes=16 << 10)
    source = _Slowed(LocalSource.of(cfg, digits), clock)
    lost = digits[0][0]
    fetch = source.fetch

    def fails_once(visit: Visit):
        if visit.holder == lost and not any(h == lost for h, _, _ in source.asked):
            clock[0] += 30.0  # waited for it until the deadline
            source.asked.append((lost, visit.token_offset, False))
            raise HolderLost(lost, "it stopped answering", during="the copy")
        return fetch(visit)

    source.fetch = fails_once
    loader = TravellingLoader(source, cfg.batch, cfg.seq_len, cfg.buffer_bytes,
                              batching=Shuffled(cfg.batch, 0, lambda t: t))
    batches = iter(loader)
    for _ in range(3):
        next(batches)
    assert loader.lost and loader.stall_seconds >= 31  # the failed wait and the travel after it
    assert loader.first_pass_seconds == 1  # the other holder's first travel only


def test_what_travels_before_one_shuffle_over_every_record_is_all_first_pass(digits, monkeypatch) -> None:
    """Under shuffle all (and DP-SGD) every record travels once before the first batch: each chunk of
    a holder is start-up, not the steady state (the second review of this stop)."""
    import types

    from gputravel.train import loader as loader_module
    from gputravel.train.loader import Shuffled, TravellingLoader, zero

    clock = [0.0]
    monkeypatch.setattr(loader_module, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    cfg = job(digits, steps=1, batch=32, buffer_bytes=16 << 10)
    source = _Slowed(LocalSource.of(cfg, digits), clock)
    loader = TravellingLoader(source, cfg.batch, cfg.seq_len, cfg.buffer_bytes,
                              batching=Shuffled(cfg.batch, 0, lambda t: t))
    zero(loader.travel_all("the test needs them"))
    assert len(source.asked) > len(digits)  # several chunks a holder
    assert loader.first_pass_seconds == loader.stall_seconds == len(source.asked)
