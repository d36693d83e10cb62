"""DP-SGD (issue 29): what is refused before anything travels, the resident Poisson sample, the ε
reported, G2 under DP, resume. Tiny jobs: a few steps over the shipped tumour records."""

from __future__ import annotations

import math
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from gputravel.data.demo_records import demo_holders
from gputravel.data.records import common_schema
from gputravel.errors import BadInput
from gputravel.jobs.training import TrainingJobConfig, check_capacity, non_private_reference, run_training_job
from gputravel.train.job import TrainConfig
from gputravel.train.loader import LocalSource
from gputravel.train.loop import build_model, make_report, train, workload_of
from gputravel.train.privacy import Private, check_independent, check_job, check_model, poisson_sample
from gputravel.train.rundir import checkpoint_extra
from test_workloads import travelled  # `train` fed by an in-process cohort: real travels, no processes

KEY = bytes(range(32))
BUFFER = 128 << 10  # every tumour record (455 of 128 bytes) resident


@pytest.fixture(scope="module")
def tumours(tmp_path_factory) -> tuple[tuple[str, str], ...]:
    return demo_holders("tabular", 3, tmp_path_factory.mktemp("tumours"))


def job(holders, **changes) -> TrainConfig:
    values = dict(workload="tabular", record_schema=common_schema(holders).canonical_json(), steps=8, batch=32,
                  buffer_bytes=BUFFER, checkpoint_every=0, warmup_steps=2, lr=0.03, dp_epsilon=3.0, eval_every=0)
    return TrainConfig(**{**values, **changes})


class Counted(LocalSource):
    """A local source that counts what it is asked to bring (a travel, for the travelling loader)."""

    fetched = 0

    def fetch(self, visit):
        self.fetched += 1
        return super().fetch(visit)


def counted(cfg: TrainConfig, holders) -> Counted:
    src = LocalSource.of(cfg, holders)
    out = Counted(src._units, src._held, src._piece)
    return out


def test_epsilon_spent_is_at_most_the_target_and_the_report_says_how(tumours) -> None:
    cfg = job(tumours)
    result = train(cfg, LocalSource.of(cfg, tumours), dp_key=KEY)
    dp = make_report(cfg, result)["dp"]
    assert 0 < dp["epsilon_spent"] <= cfg.dp_epsilon
    assert dp["delta"] == cfg.dp_delta and dp["accountant"] == "rdp" and dp["max_grad_norm"] == cfg.dp_max_grad_norm
    records = sum(LocalSource.of(cfg, tumours).sizes().values())
    assert dp["sample_rate"] == cfg.batch / records and dp["noise_multiplier"] > 0
    public = cfg.replace(dp_epsilon=0.0)
    assert make_report(public, train(public, LocalSource.of(cfg, tumours)))["dp"] is None


def test_the_prv_accountant_keeps_to_its_target_and_gdp_which_can_underestimate_is_refused(tumours) -> None:
    cfg = job(tumours, steps=4, dp_accountant="prv")
    dp = train(cfg, LocalSource.of(cfg, tumours), dp_key=KEY).dp
    assert dp is not None and 0 < dp["epsilon_spent"] <= cfg.dp_epsilon and dp["accountant"] == "prv"
    with pytest.raises(BadInput, match="--dp-accountant: expected rdp or prv"):
        job(tumours, dp_accountant="gdp")
    assert TrainConfig(dp_accountant="gdp").dp_accountant == "gdp"  # without DP it counts nothing


def test_records_larger_than_the_buffer_are_refused_before_anything_travels(tumours) -> None:
    cfg = job(tumours, buffer_bytes=32 << 10)
    source = counted(cfg, tumours)
    with pytest.raises(BadInput, match=r"--dp-epsilon: the holders' 455 training records take 58240 bytes, the job's "
                                       r"buffer holds 32768: .* raise --buffer-mib to 0\.0625 or more"):
        train(cfg, source, dp_key=KEY)
    assert source.fetched == 0
    with pytest.raises(BadInput, match="--dp-epsilon: the holders' 455 training records"):  # the demo, before it starts
        check_capacity(TrainingJobConfig(train=cfg.replace(loader="local"), holders=tumours, run_dir="unused"))


def test_a_delta_of_one_over_the_records_or_more_is_refused(tumours) -> None:
    cfg = job(tumours, dp_delta=1 / 400)
    with pytest.raises(BadInput, match=r"--dp-delta 0.0025: at 1/N \(455 training records\) or above"):
        train(cfg, LocalSource.of(cfg, tumours), dp_key=KEY)


BATCHNORM = """SCHEMA = "features: float32[30]; label: int64[]"
import torch
from torch import nn
def model(schema):
    return nn.Sequential(nn.Linear(30, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2))
def inputs(records):
    return records["features"], records["label"]
"""


def test_a_layer_opacus_cannot_train_is_named_before_anything_travels(tumours) -> None:
    cfg = job(tumours, workload="bn", workload_code=BATCHNORM)
    source = counted(cfg, tumours)
    with pytest.raises(BadInput, match=r"workload 'bn': Opacus cannot train layer '1' \(BatchNorm1d\) with DP-SGD "
                                       r".*BatchNorm by GroupNorm; opacus.validators.ModuleValidator.fix"):
        train(cfg, source, dp_key=KEY)
    assert source.fetched == 0


@pytest.mark.parametrize("workload", ["image", "tabular"])
def test_the_shipped_workloads_pass_opacus(workload: str) -> None:
    cfg = TrainConfig(workload=workload)
    model, _ = build_model(cfg, "cpu", workload_of(cfg))
    check_model(model, workload)


def test_several_gpus_are_refused(tumours) -> None:
    with pytest.raises(BadInput, match=r"--dp-epsilon: DP-SGD trains on one GPU .* not 2"):
        TrainingJobConfig(train=job(tumours, loader="local"), holders=tumours, run_dir="unused", gpus=2)
    check_job(job(tumours), 1)


def test_the_poisson_sample_takes_each_record_at_its_rate_independently() -> None:
    n, rate, steps = 2000, 0.05, 400
    taken = np.zeros(n)
    sizes = []
    for step in range(steps):
        picked = poisson_sample(KEY, step, n, rate).numpy()
        taken[picked] += 1
        sizes.append(len(picked))
    assert abs(np.mean(sizes) - n * rate) < 2 and np.std(sizes) > 3  # the batch size varies, around q N
    assert abs(taken.mean() / steps - rate) < 0.002
    assert np.std(taken / steps) < 2 * math.sqrt(rate * (1 - rate) / steps)  # no record favoured
    assert torch.equal(poisson_sample(KEY, 7, n, rate), poisson_sample(KEY, 7, n, rate))
    assert not torch.equal(poisson_sample(KEY, 7, n, rate), poisson_sample(bytes(32), 7, n, rate))  # keyed


def test_the_sample_does_not_depend_on_the_order_holders_are_given_in(tumours) -> None:
    cfg = job(tumours)
    forward = train(cfg, LocalSource.of(cfg, tumours), dp_key=KEY)
    backward = train(cfg, LocalSource.of(cfg, tuple(reversed(tumours))), dp_key=KEY)
    assert forward.losses == backward.losses


def test_a_dp_job_travels_once_and_never_trains_on_held_out_records(tumours) -> None:
    cfg = job(tumours, steps=20, eval_every=10)
    source = counted(cfg, tumours)
    result = train(cfg, source, dp_key=KEY)
    assert source.fetched == len(tumours)  # each holder's records travel once, all in one buffer
    assert [t.get("held_out", False) for t in result.travels].count(False) == len(tumours)


def test_an_empty_sample_still_adds_noise(tumours) -> None:
    cfg = job(tumours)
    workload = workload_of(cfg)
    model, optimizer = build_model(cfg, "cpu", workload)
    private = Private(cfg, model, optimizer, 455, KEY, "cpu")
    before = [p.detach().clone() for p in model.parameters()]
    assert math.isnan(private.step(None, 0.01, 0, workload.loss, workload.guard))
    assert all(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert private.spent() > 0


def test_a_stopped_dp_job_resumes_to_the_same_samples_and_counts_what_it_spent(tumours, tmp_path: Path) -> None:
    cfg = job(tumours, steps=10, checkpoint_every=3)
    whole = train(cfg, LocalSource.of(cfg, tumours), dp_key=KEY)
    asked: list[int] = []
    first = train(cfg, LocalSource.of(cfg, tumours), run_dir=tmp_path, dp_key=KEY,
                  should_stop=lambda: asked.append(1) or len(asked) == 5)
    assert first.stopped and first.dp is not None and whole.dp is not None
    assert 0 < first.dp["epsilon_spent"] < whole.dp["epsilon_spent"]  # what 5 steps spent, not 10
    stored = checkpoint_extra(tmp_path / "checkpoint.pt")["dp"]
    assert sum(h[2] for h in stored["history"]) == 5 and "key" not in stored  # a plaintext checkpoint: no key
    resumed = train(cfg, LocalSource.of(cfg, tumours), run_dir=tmp_path, dp_key=KEY,
                    resume_from=tmp_path / "checkpoint.pt")
    assert resumed.losses == whole.losses and resumed.dp == whole.dp


def test_without_a_key_each_job_draws_its_own_secret_one(tumours) -> None:
    cfg = job(tumours, steps=3)
    a, b = train(cfg, LocalSource.of(cfg, tumours)), train(cfg, LocalSource.of(cfg, tumours))
    assert a.losses != b.losses  # the job's seed is public (in the manifest): the noise must not follow from it


def test_the_demo_reports_dp_beside_the_job_without_it(tumours, tmp_path: Path) -> None:
    cfg = TrainingJobConfig(train=job(tumours, loader="local", steps=5), holders=tumours, run_dir=str(tmp_path))
    report = run_training_job(cfg)
    assert 0 < report["dp"]["epsilon_spent"] <= 3.0 and report["eval"]["all"]["records"] > 0
    reference = non_private_reference(cfg)
    assert 0 <= reference["accuracy"] <= 1 and reference["loader"] == "local"


def test_g2_travelling_and_local_draw_the_same_samples_and_train_the_same_model(tumours, tmp_path: Path) -> None:
    cfg = job(tumours, steps=6, eval_every=3)
    local = train(cfg, LocalSource.of(cfg, tumours), dp_key=KEY)
    moved = travelled(cfg, tumours, tmp_path, dp_key=KEY)
    assert moved.losses == local.losses and moved.evals == local.evals and moved.dp == local.dp
    assert [t.get("held_out", False) for t in moved.travels].count(False) == len(tumours)  # travelled once each


def test_job_show_states_the_dp_settings_and_what_they_leave_out(tumours) -> None:
    from gputravel.manifest import JobManifest, Outputs

    def described(t: TrainConfig, metrics: bool) -> str:
        return JobManifest.for_job(t, holders=[n for n, _ in tumours], quorum=2, recipients=(),
                                   outputs=Outputs(model="sealed", checkpoints="sealed", metrics=metrics)).describe()

    text = described(job(tumours), metrics=True)
    assert "DP-SGD: epsilon 3 at delta 1e-05 (rdp accountant), each record's gradient clipped to 1.0" in text
    assert "the metrics written are not covered" in text
    assert "not covered" not in described(job(tumours), metrics=False)
    assert "privacy     none" in described(job(tumours, dp_epsilon=0.0), metrics=True)


def test_the_live_view_counts_the_epsilon_the_job_spends(tumours, tmp_path: Path) -> None:
    from gputravel.train.privacy import epsilon_after

    cfg = TrainingJobConfig(train=job(tumours, loader="local", steps=5), holders=tumours, run_dir=str(tmp_path))
    mechanism = check_capacity(cfg)  # the demo's live view takes the mechanism the check found
    assert mechanism is not None and check_capacity(TrainingJobConfig(
        train=job(tumours, loader="local", dp_epsilon=0.0), holders=tumours, run_dir=str(tmp_path))) is None
    spent = train(cfg.train, LocalSource.of(cfg.train, tumours), dp_key=KEY).dp
    assert spent is not None and epsilon_after(mechanism, 5) == pytest.approx(spent["epsilon_spent"])


def test_a_sealed_checkpoint_keeps_the_key_so_a_resume_without_one_draws_the_same(tumours, tmp_path: Path) -> None:
    from gputravel.broker.seal import JOB_DIGEST_BYTES, KEY_BYTES, Sealer
    from gputravel.train.rundir import Kept

    sealer = Sealer(bytes(KEY_BYTES), "checkpoint", bytes(JOB_DIGEST_BYTES))
    cfg = job(tumours, steps=6, checkpoint_every=3)
    whole = train(cfg, LocalSource.of(cfg, tumours), dp_key=KEY)
    asked: list[int] = []
    train(cfg, LocalSource.of(cfg, tumours), run_dir=tmp_path, dp_key=KEY, kept=Kept(sealer=sealer),
          should_stop=lambda: asked.append(1) or len(asked) == 3)
    assert checkpoint_extra(tmp_path / "checkpoint.pt", sealer=sealer)["dp"]["key"] == KEY.hex()
    # No key given: the resumed job takes the one its sealed checkpoint kept.
    resumed = train(cfg, LocalSource.of(cfg, tumours), run_dir=tmp_path, kept=Kept(sealer=sealer),
                    resume_from=tmp_path / "checkpoint.pt")
    assert resumed.losses == whole.losses and resumed.dp == whole.dp


def test_a_step_that_drew_no_record_is_left_out_of_the_reports_means() -> None:
    from gputravel.train.loop import TrainResult

    report = make_report(TrainConfig(workload="tabular"), TrainResult(losses=[1.0, math.nan, 3.0]))
    assert report["loss_before"] == report["loss_after"] == 2.0 and math.isnan(report["losses"][1])


def test_the_demo_command_trains_privately_and_states_both_accuracies(tumours, tmp_path: Path) -> None:
    import json

    from typer.testing import CliRunner

    from gputravel.cli.app import app

    args = ["demo", "--workload", "tabular", "--loader", "local", "--steps", "5", "--batch", "32", "--dp-epsilon", "3",
            "--lr", "0.1",
            "--run-dir", str(tmp_path / "run"), "--json", str(tmp_path / "report.json"),
            *[f"--holder-data={name}={path}" for name, path in tumours]]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    said = " ".join(result.output.split())  # as the console wrapped it
    assert "DP-SGD: epsilon" in said and "without (the same job, --loader local)" in said, said
    dp = json.loads((tmp_path / "report.json").read_text())["dp"]
    assert 0 < dp["epsilon_spent"] <= 3 and dp["accountant"] == "rdp" and "accuracy" in dp["non_private"]
    refused = CliRunner().invoke(app, [*args[:-3], "--dp-accountant", "gdp", *args[-3:]])
    assert refused.exit_code != 0 and "--dp-accountant: expected rdp or prv" in refused.output


# Workloads whose records are not independent (the review's probes, issue 29 F2): each breaks the
# bound C on one record's influence (x2 to x15.6 measured), and each is refused before anything travels.
COUPLED_HEAD = """SCHEMA = "features: float32[30]; label: int64[]"
import torch
from torch import nn
import torch.nn.functional as F
def model(schema):
    return M()
def inputs(records):
    return records["features"], records["label"]
class M(nn.Module):
    def __init__(self):
        super().__init__(); self.a = nn.Linear(30, 8); self.b = nn.Linear(8, 2)
    def forward(self, x):
        return self.b(torch.relu(self.a(x)))
class Mix(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x + x.sum(0, keepdim=True) * 0.1
    @staticmethod
    def backward(ctx, g):
        return g + g.sum(0, keepdim=True) * 0.1
class MixBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()
    @staticmethod
    def backward(ctx, g):
        return g + g.sum(0, keepdim=True) * 0.1
"""
def _two_layers(forward: str) -> str:
    """A model M of two linear layers (30 -> 8 -> 2) whose forward(x) is `forward`'s lines."""
    return ("\nclass M(nn.Module):\n    def __init__(self):\n"
            "        super().__init__(); self.a = nn.Linear(30, 8); self.b = nn.Linear(8, 2)\n"
            "    def forward(self, x):\n" + "".join(f"        {line}\n" for line in forward.split("\n")))


COUPLED = {
    "standardised": ("""
def inputs(records):
    x = records["features"]
    return (x - x.mean(0)) / (x.std(0) + 1e-6), records["label"]
""", "inputs makes a record's row depend on the other records of its batch"),
    "augmented": ("""
def inputs(records):
    x, y = records["features"], records["label"]
    return torch.cat([x, x * 1.01]), torch.cat([y, y])
""", "inputs gives 8 rows for a batch of 4 records"),
    "rows": ("""
class M(nn.Module):
    def __init__(self):
        super().__init__(); self.a = nn.Linear(5, 8); self.b = nn.Linear(8, 2)
    def forward(self, x):
        return self.b(torch.relu(self.a(x.reshape(-1, 5)))).reshape(x.shape[0], 6, 2).mean(1)
""", "forward gives parameter 'a.weight' 24 per-record gradients for 4 records"),
    "centred": (_two_layers("h = self.a(x)\nreturn self.b(torch.relu(h - h.mean(0, keepdim=True)))"),
                "forward makes a record's output depend on the other records"),
    "mixed": (_two_layers("return self.b(torch.relu(Mix.apply(self.a(x))))"),
              "forward makes a record's output depend on the other records"),
    "mixed_backward": (_two_layers("return self.b(torch.relu(MixBackward.apply(self.a(x))))"),
                       "a record's per-record gradient is not the gradient of that record alone"),
    "loss": ("""
def loss(out, y):
    return F.cross_entropy(out, y) + out.mean(0).pow(2).sum()
""", "loss is not the mean of a loss a record"),
}


@pytest.mark.parametrize("coupling", sorted(COUPLED))
def test_a_workload_that_couples_the_records_of_a_batch_is_refused_before_anything_travels(tumours,
                                                                                          coupling: str) -> None:
    body, said = COUPLED[coupling]
    cfg = job(tumours, workload="coupled", workload_code=COUPLED_HEAD + body)
    source = counted(cfg, tumours)
    with pytest.raises(BadInput, match=rf"workload 'coupled': {re.escape(said)}.*treat the records of a batch "
                                       r"independently"):
        train(cfg, source, dp_key=KEY)
    assert source.fetched == 0


def test_records_treated_independently_pass_the_check_dropout_and_tied_weights_included(tumours) -> None:
    body = """
class M(nn.Module):
    def __init__(self):
        super().__init__(); self.a = nn.Linear(30, 30); self.b = nn.Linear(30, 2); self.d = nn.Dropout(0.5)
    def forward(self, x):
        return self.b(self.d(self.a(torch.relu(self.a(x)))))
"""
    cfg = job(tumours, workload="fine", workload_code=COUPLED_HEAD + body)
    workload = workload_of(cfg)
    model, _ = build_model(cfg, "cpu", workload)
    state = torch.random.get_rng_state()
    check_independent(workload, model)
    assert torch.equal(state, torch.random.get_rng_state())  # the job's random state untouched: same losses


def test_a_step_with_more_per_record_gradients_than_records_drawn_is_refused(tumours) -> None:
    # The step's own check, for what the made-up batch could miss: 2 rows a record (augmented) here.
    cfg = job(tumours, workload="coupled", workload_code=COUPLED_HEAD + COUPLED["augmented"][0])
    workload = workload_of(cfg)
    model, optimizer = build_model(cfg, "cpu", workload)
    private = Private(cfg, model, optimizer, 455, KEY, "cpu")
    before = [p.detach().clone() for p in model.parameters()]
    batch = workload.inputs({"features": torch.randn(5, 30), "label": torch.zeros(5, dtype=torch.int64)}, "cpu")
    with pytest.raises(BadInput, match=r"workload 'coupled': parameter 'a.weight' got 10 per-record gradients for the "
                                       r"5 records drawn"):
        private.step(batch, 0.01, 0, workload.loss, workload.guard, drawn=5)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True)) and private.taken() == 0


def test_no_step_is_taken_past_the_steps_that_spend_the_target(tumours) -> None:
    cfg = job(tumours, steps=2)
    workload = workload_of(cfg)
    model, optimizer = build_model(cfg, "cpu", workload)
    private = Private(cfg, model, optimizer, 455, KEY, "cpu")
    for step in range(2):
        private.step(None, 0.01, step, workload.loss, workload.guard)
    with pytest.raises(BadInput, match=r"--dp-epsilon 3: the job's 2 steps spend it; a further step would spend more"):
        private.step(None, 0.01, 2, workload.loss, workload.guard)
    assert private.taken() == 2 and private.spent() <= 3


def test_a_resume_over_other_holders_or_records_is_refused(tumours, tmp_path: Path) -> None:
    # Resumed with a holder absent, the sealed key's noise would recur over other records, and
    # sigma, recomputed for N 455 -> 304, overshot the target (3.006 > 3: the review's probe).
    from gputravel.broker.seal import JOB_DIGEST_BYTES, KEY_BYTES, Sealer
    from gputravel.train.rundir import Kept

    kept = Kept(sealer=Sealer(bytes(KEY_BYTES), "checkpoint", bytes(JOB_DIGEST_BYTES)))
    cfg = job(tumours, steps=6, checkpoint_every=3)
    asked: list[int] = []
    train(cfg, LocalSource.of(cfg, tumours), run_dir=tmp_path, dp_key=KEY, kept=kept,
          should_stop=lambda: asked.append(1) or len(asked) == 3)
    stored = checkpoint_extra(tmp_path / "checkpoint.pt", sealer=kept.sealer)["dp"]
    names = sorted(name for name, _ in tumours)
    assert stored["records"] == 455 and stored["holders"] == names
    fewer = tumours[:2]
    with pytest.raises(BadInput, match=rf"sampled over 455 training records of {', '.join(names)}; this job has "
                                       rf"\d+ of {', '.join(sorted(n for n, _ in fewer))}: resume with the holders"):
        train(cfg, LocalSource.of(cfg, fewer), run_dir=tmp_path, kept=kept, resume_from=tmp_path / "checkpoint.pt")


def forged(path: Path, **dp) -> None:
    """The plaintext checkpoint at `path` with its dp state changed (the host can write it)."""
    ck = torch.load(path, weights_only=False)
    ck["extra"]["dp"].update(dp)
    torch.save(ck, path)


def test_a_plaintext_checkpoint_whose_privacy_state_is_not_the_jobs_is_refused(tumours, tmp_path: Path) -> None:
    cfg = job(tumours, steps=10, checkpoint_every=5)
    asked: list[int] = []
    train(cfg, LocalSource.of(cfg, tumours), run_dir=tmp_path, dp_key=KEY,
          should_stop=lambda: asked.append(1) or len(asked) == 5)
    path = tmp_path / "checkpoint.pt"
    honest = torch.load(path, weights_only=False)["extra"]["dp"]
    (sigma, rate, steps), = honest["history"]
    cases = {  # forged [[1e9, q, 5]] reported epsilon 2.605 for 10 steps (honest 2.994); sigma inf hung the job
        "history": ([[1e9, rate, 5]], [[math.inf, rate, 5]], [[sigma, 0.0, 5]], [[sigma, rate, 4]],
                    [[sigma, rate, 2], [sigma, rate, 2]], [[math.nan, rate, 5]], [[sigma, rate, 5.0]]),
        "records": (304,), "holders": (["a"],)}
    for key, values in cases.items():
        for value in values:
            forged(path, **{**honest, key: value})
            with pytest.raises(BadInput, match=rf"checkpoint {re.escape(str(path))}"):
                train(cfg, LocalSource.of(cfg, tumours), run_dir=tmp_path, dp_key=KEY, resume_from=path)
    forged(path, **honest)
    assert train(cfg, LocalSource.of(cfg, tumours), run_dir=tmp_path, dp_key=KEY, resume_from=path).losses
