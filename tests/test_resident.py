"""Records kept resident (issue 27, the job's resident_mib): a visit kept trains again without
travelling, the batches unchanged (G2), the records zeroed when the job ends. In-process cohort:
the travels are real, through the device."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from gputravel.data.demo_records import demo_holders
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


def _sealed():
    from gputravel.manifest.sections import Outputs

    return Outputs(model="sealed")
