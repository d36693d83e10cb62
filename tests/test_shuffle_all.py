"""One shuffle over every holder's records (the job's shuffle = "all", issue 27): a script ported
to batches() trains as its stock DataLoader(shuffle=True) does over the same records, travelling
or local; the loop's own epochs resume mid-epoch; the rules refuse what it cannot do."""

from __future__ import annotations

import io
import runpy
import sys
from pathlib import Path

import pytest
import torch

from gputravel.data.records import common_schema, load_records, split_arrays, write_records
from gputravel.errors import BadInput, HolderLost
from gputravel.files import EVAL_SHARE
from gputravel.train.job import TrainConfig
from gputravel.train.loader import LocalSource
from gputravel.train.loop import train
from gputravel.train.rundir import Kept
from gputravel.train.schedule import Visit
from gputravel.train.scripted import run_job

from gputravel.data.demo_records import demo_holders
from test_workloads import BUFFER, SCRIPT, job, script_travelled, travelled

STOCK = SCRIPT.with_name("tabular_train.py")


@pytest.fixture(scope="module")
def tumours(tmp_path_factory) -> tuple[tuple[str, str], ...]:
    return demo_holders("tabular", 3, tmp_path_factory.mktemp("tumours"))


@pytest.fixture(scope="module")
def digits(tmp_path_factory) -> tuple[tuple[str, str], ...]:
    return demo_holders("image", 3, tmp_path_factory.mktemp("digits"))


def _port(holders, **changes) -> TrainConfig:
    return TrainConfig(workload="port", workload_code=SCRIPT.read_text(), script=True, batch=8, buffer_bytes=BUFFER,
                       record_schema=common_schema(holders).canonical_json(), shuffle="all", resident_mib=1,
                       **changes)


def _stock(holders, tmp_path: Path, monkeypatch, capsys) -> tuple[list[str], dict]:
    """The unchanged script over each holder's training records (as its CVM splits them), in name order."""
    dirs = []
    for name, path in sorted(holders):
        records = load_records(path)
        write_records(tmp_path / name, records.schema, split_arrays(records, EVAL_SHARE)[0])
        dirs.append(str(tmp_path / name))
    monkeypatch.setattr(sys, "argv", [str(STOCK), *dirs])
    capsys.readouterr()
    threads = torch.get_num_threads()
    torch.set_num_threads(TrainConfig().threads)  # as the job runs it: the same sums in the same order
    try:
        done = runpy.run_path(str(STOCK))
    finally:
        torch.set_num_threads(threads)
    printed = [line.rsplit(" ", 1)[1] for line in capsys.readouterr().out.splitlines() if " loss " in line]
    return printed, done["model"].state_dict()


def _weights(result) -> dict:
    return torch.load(io.BytesIO(result.weights), weights_only=True)


def test_a_ported_script_trains_to_the_stock_scripts_very_weights(tumours, tmp_path: Path, monkeypatch,
                                                                   capsys) -> None:
    cfg = _port(tumours)
    printed, stock = _stock(tumours, tmp_path / "stock", monkeypatch, capsys)
    local = run_job(cfg, LocalSource.of(cfg, tumours), kept=Kept(weights=True))
    assert [f"{loss:.4f}" for loss in local.losses] == printed and len(printed) > 100
    ported = _weights(local)
    assert ported.keys() == stock.keys() and all(torch.equal(ported[k], stock[k]) for k in stock)


def test_g2_a_ported_script_with_one_shuffle_gives_the_same_losses_travelling(tumours, tmp_path: Path) -> None:
    cfg = _port(tumours)
    local = run_job(cfg, LocalSource.of(cfg, tumours))
    moved = script_travelled(cfg, tumours, tmp_path)
    assert moved.losses == local.losses
    # Each visit travelled once (two buffers a holder here): every record is kept for the whole job.
    trained = [(t["holder"], t["token_offset"]) for t in moved.travels if not t.get("held_out")]
    assert len(trained) == len(set(trained)) == 6 and {h for h, _ in trained} == {n for n, _ in tumours}


@pytest.mark.parametrize("workload", ["image", "tabular"])
def test_the_loops_epochs_over_every_record_resume_and_match_travelling(workload, digits, tumours,
                                                                       tmp_path: Path) -> None:
    holders = tumours if workload == "tabular" else digits
    cfg = job(holders, workload=workload, steps=60, batch=32, eval_every=30, shuffle="all", resident_mib=1)
    whole = train(cfg, LocalSource.of(cfg, holders))
    assert travelled(cfg, holders, tmp_path / "moved").losses == whole.losses
    first = train(cfg, LocalSource.of(cfg, holders), run_dir=tmp_path / "run", should_stop=lambda: True)
    assert first.stopped and len(first.losses) == 1
    # Stopped after its first step; resumed: the steps an uninterrupted run would have taken.
    rest = train(cfg, LocalSource.of(cfg, holders), run_dir=tmp_path / "run",
                 resume_from=tmp_path / "run" / "checkpoint.pt")
    assert rest.losses == whole.losses and rest.evals == whole.evals
    assert whole.losses != train(cfg.replace(shuffle="visit"), LocalSource.of(cfg, holders)).losses


def test_one_shuffle_is_refused_where_it_cannot_hold_or_mean_anything(tumours) -> None:
    with pytest.raises(BadInput, match="shuffle: expected visit for GPT-2"):
        TrainConfig(shuffle="all")
    with pytest.raises(BadInput, match="shuffle: expected visit with DP-SGD"):
        TrainConfig(workload="tabular", shuffle="all", dp_epsilon=3.0)
    with pytest.raises(BadInput, match=r"--resident-mib: expected the MiB every training record takes"):
        _port(tumours).replace(resident_mib=0)  # refused as the job is written, before any service starts
    many = {name: 10_000 for name, _ in tumours}  # 30,000 records of 128 bytes: more than the MiB kept
    cfg = _port(tumours)
    with pytest.raises(BadInput, match=r"--shuffle all: the holders' 30000 training records take 3840000 bytes .* "
                                       r"--resident-mib 1 holds 1048576: raise it to 4 or more"):
        run_job(cfg, _Sized(many, LocalSource.of(cfg, tumours)))


class _Sized:
    """A source that claims `sizes` training records: the check comes before anything travels."""

    def __init__(self, sizes, inner) -> None:
        self._sizes, self.inner = sizes, inner

    def sizes(self):
        return self._sizes

    def fetch(self, visit):
        raise AssertionError("nothing travels before the check")


def test_the_records_kept_for_one_shuffle_are_zeroed_when_the_steps_end(tumours, monkeypatch) -> None:
    import numpy as np

    from gputravel.train import whole

    zeroed: list[np.ndarray] = []

    def noted(units: np.ndarray) -> None:
        whole_zero(units)
        zeroed.append(units)

    whole_zero = whole.zero
    monkeypatch.setattr(whole, "zero", noted)
    cfg = job(tumours, workload="tabular", steps=5, batch=32, eval_every=0, shuffle="all", resident_mib=1)
    train(cfg, LocalSource.of(cfg, tumours))
    # The records as they travelled, then each field array training read: every one, every byte.
    n = sum(LocalSource.of(cfg, tumours).sizes().values())
    assert [a.dtype.names or a.dtype.name for a in zeroed] == [("features", "label"), "float32", "int64"]
    assert all(len(a) == n and not np.frombuffer(a.tobytes(), np.uint8).any() for a in zeroed)


class _Leaving(LocalSource):
    """The holders' data from disk, one of which leaves the cohort once `gone` is set (as a goodbye)."""

    gone: str | None = None

    def departed(self, holders) -> set[str]:
        return {h for h in holders if h == self.gone}

    def fetch(self, visit):
        if visit.holder == self.gone:  # a travel to it fails
            raise HolderLost(visit.holder, "it left", during="a travel")
        return super().fetch(visit)

    def fetch_held(self, visit):
        if visit.holder == self.gone:
            raise HolderLost(visit.holder, "it left", during="a travel")
        return super().fetch_held(visit)


def leaving_at(monkeypatch, cfg: TrainConfig, holders, loader: str, step: int, taken: list[int] | None = None, **kw):
    """Train with holders[1] leaving the cohort after `step`, `loader` (loop.Whole or loop.Resident)
    noting each batch's feature rows: the result, the steps that saw a row of the holder's, and the rows.
    `taken`, if given, gets each step's number as it ends."""
    from gputravel.train import loop

    source = _Leaving.of(cfg, holders)
    gone = holders[1][0]
    theirs = {r.tobytes() for r in source.fetch(Visit(gone, 0, source.sizes()[gone]))["features"]}
    seen: list[int] = []
    at = {"n": 0}

    class Spy(getattr(loop, loader)):  # type: ignore[misc]
        def __init__(self, *a, **kw) -> None:
            super().__init__(*a, **kw)
            inner = self.batching.to_batch

            def to_batch(fields):
                if {r.numpy().tobytes() for r in fields["features"]} & theirs:
                    seen.append(at["n"])
                return inner(fields)
            self.batching.to_batch = to_batch

    def on_step(event) -> None:
        at["n"] = event.step + 1
        if taken is not None:
            taken.append(event.step + 1)
        if event.step + 1 == step:
            source.gone = gone

    monkeypatch.setattr(loop, loader, Spy)
    return train(cfg, source, on_step=on_step, **kw), seen, gone


def test_a_holder_that_leaves_mid_epoch_is_out_of_the_next_buffers_batches(tumours, monkeypatch) -> None:
    cfg = job(tumours, workload="tabular", steps=30, batch=32, eval_every=10, shuffle="all", resident_mib=1)
    result, seen, gone = leaving_at(monkeypatch, cfg, tumours, "Whole", 3)
    assert seen and max(seen) < 3  # goodbyes are read before each batch
    assert len(result.losses) == cfg.steps and any(repr(gone) in why for why in result.lost)
    assert all(gone not in e["per_holder"] for e in result.evals)  # the first evaluation is at step 10


def test_a_departure_first_seen_by_an_evaluation_is_named_in_lost(tumours) -> None:
    cfg = job(tumours, workload="tabular", steps=30, batch=32, eval_every=10, resident_mib=1)
    source = _Leaving.of(cfg, tumours)
    gone = tumours[2][0]

    def on_step(event) -> None:  # visits of 4 batches in turn: step 20 ends holder-2's, then evaluation
        if event.step + 1 == 19:
            source.gone = gone

    result = train(cfg, source, on_step=on_step)
    assert [why for why in result.lost if repr(gone) in why and "left the cohort" in why]
    assert len(result.losses) == cfg.steps and gone in result.evals[0]["per_holder"]
    assert [e["step"] for e in result.evals if gone not in e["per_holder"]] == [20, 30]


def test_a_script_that_breaks_off_an_epoch_or_draws_between_them_still_trains_as_the_stock_one(
        tumours, tmp_path: Path, monkeypatch, capsys) -> None:
    # A stock loop begins an epoch at each `for`: a break ends it, and torch.rand between epochs
    # draws before the next DataLoader's seed. batches() must do both the same way.
    def edit(text: str) -> str:
        text = text.replace("for epoch in range(3):\n", "for epoch in range(3):\n    torch.rand(1)\n")
        return text.replace("        optimizer.step()\n", "        optimizer.step()\n"
                                                         "        if epoch == 0 and loss.item() < 10:\n"
                                                         "            break\n")
    stock = tmp_path / "tabular_train.py"
    stock.write_text(edit(STOCK.read_text()))
    monkeypatch.setattr(sys.modules[__name__], "STOCK", stock)
    printed, weights = _stock(tumours, tmp_path / "stock", monkeypatch, capsys)
    cfg = _port(tumours).replace(workload_code=edit(SCRIPT.read_text()))
    assert "break" in cfg.workload_code and "torch.rand(1)" in cfg.workload_code
    local = run_job(cfg, LocalSource.of(cfg, tumours), kept=Kept(weights=True))
    assert [f"{loss:.4f}" for loss in local.losses] == printed and len(printed) > 50
    ported = _weights(local)
    assert all(torch.equal(ported[k], weights[k]) for k in weights)


class _Vote:
    """A data-parallel job's stop vote, as every rank sees it: yes if any rank said yes."""

    def __init__(self, others: bool) -> None:
        self.others = others
        self.said: list[bool] = []

    def anyone(self, mine: bool) -> bool:
        self.said.append(mine)
        return mine or self.others


def test_with_ranks_every_rank_refuses_a_share_that_does_not_fit_before_anything_travels() -> None:
    from gputravel.train.loop import _check_kept_everywhere

    fits, too_many = {"a": 100}, {"a": 100_000}  # records of 128 bytes against 1 MiB
    vote = _Vote(others=True)
    with pytest.raises(BadInput, match=r"another rank's share .* --resident-mib 1 \(each rank keeps its own share\)"):
        _check_kept_everywhere(1, fits, 128, vote)  # type: ignore[arg-type]
    mine = _Vote(others=False)
    with pytest.raises(BadInput, match=r"--resident-mib 1 holds 1048576: raise it to 13 or more"):
        _check_kept_everywhere(1, too_many, 128, mine)  # type: ignore[arg-type]
    assert vote.said == [False] and mine.said == [True]  # one vote each: the ranks stay in step
    _check_kept_everywhere(1, fits, 128, _Vote(others=False))  # type: ignore[arg-type]
