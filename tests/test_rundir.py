"""gputravel.train.rundir: report, metrics, plot, sample, checkpoint round trips and errors."""

from __future__ import annotations

import csv

import pytest
import torch

from gputravel.errors import BadInput
from gputravel.train.model import GPT, GPTConfig
from gputravel.train.rundir import RunDir, load_checkpoint

torch.set_num_threads(1)

CFG = GPTConfig(block_size=8, vocab_size=31, n_layer=1, n_head=2, n_embd=16)


def trained(seed: int = 0, cfg: GPTConfig = CFG):
    """A model and optimizer after two steps, so the optimizer has moment buffers."""
    torch.manual_seed(seed)
    m = GPT(cfg)
    opt = m.configure_optimizer(lr=1e-3, weight_decay=0.1, betas=(0.9, 0.95))
    x = torch.randint(0, cfg.vocab_size, (2, cfg.block_size))
    for _ in range(2):
        _, loss = m(x, x)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return m, opt


def test_report_round_trip(tmp_path):
    rd = RunDir(tmp_path / "run")
    report = {"steps": 300, "final_loss": 2.5, "holders": ["a", "b"], "nested": {"x": None}}
    rd.write_report(report)
    assert rd.read_report() == report
    assert not [p for p in rd.path.iterdir() if p.name.endswith(".tmp")]


def test_report_rejects_nan_and_non_json(tmp_path):
    rd = RunDir(tmp_path)
    with pytest.raises(BadInput, match="NaN"):
        rd.write_report({"loss": float("nan")})
    with pytest.raises(BadInput, match="JSON types"):
        rd.write_report({"loss": torch.tensor(1.0)})
    assert not rd.report_path.exists()


def test_metrics_header_and_rows(tmp_path):
    rd = RunDir(tmp_path)
    rd.append_metrics({"step": 0, "loss": 4.5, "lr": 1e-3})
    rd.append_metrics({"step": 1, "loss": torch.tensor(4.25), "lr": 1e-3})
    with rd.metrics_path.open(newline="") as f:
        rows = list(csv.reader(f))
    assert rows == [["step", "loss", "lr"], ["0", "4.5", "0.001"], ["1", "4.25", "0.001"]]
    with pytest.raises(BadInput, match="same columns"):
        rd.append_metrics({"step": 2, "loss": 4.0})


def test_metrics_resume_keeps_existing_header(tmp_path):
    RunDir(tmp_path).append_metrics({"step": 0, "loss": 1.0})
    rd = RunDir(tmp_path)  # a new process resuming the run
    rd.append_metrics({"loss": 0.5, "step": 1})  # same columns, other order
    assert rd.read_metrics() == [{"step": "0", "loss": "1.0"}, {"step": "1", "loss": "0.5"}]


def test_plot_is_png(tmp_path):
    rd = RunDir(tmp_path)
    out = rd.plot_losses([0, 1, 2], [3.0, 2.5, 2.0], title="test run")
    assert out == tmp_path / "loss.png"
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(BadInput):
        rd.plot_losses([0, 1], [1.0])


def test_sample(tmp_path):
    rd = RunDir(tmp_path)
    rd.write_sample("hello\nworld ü")
    assert rd.sample_path.read_text(encoding="utf-8") == "hello\nworld ü"


def test_checkpoint_round_trip(tmp_path):
    rd = RunDir(tmp_path)
    m, opt = trained(seed=0)
    rng = torch.get_rng_state()
    rd.save_checkpoint(m, opt, step=2, extra={"rng": rng, "note": "x"})
    m2, opt2 = trained(seed=1)  # different weights and moments, to be overwritten
    step, extra = load_checkpoint(rd.checkpoint_path, m2, opt2)
    assert step == 2 and extra["note"] == "x" and torch.equal(extra["rng"], rng)
    for (n1, p1), (n2, p2) in zip(m.state_dict().items(), m2.state_dict().items(), strict=True):
        assert n1 == n2 and torch.equal(p1, p2)
    assert m2.lm_head.weight is m2.transformer.wte.weight  # tying survives the load
    s1, s2 = opt.state_dict(), opt2.state_dict()
    assert s1["param_groups"] == s2["param_groups"]
    assert s1["state"].keys() == s2["state"].keys()
    for k in s1["state"]:
        for name in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(s1["state"][k][name], s2["state"][k][name])


def test_checkpoint_resume_continues_identically(tmp_path):
    rd = RunDir(tmp_path)
    m, opt = trained(seed=0)
    rd.save_checkpoint(m, opt, step=2, extra={})
    m2, opt2 = trained(seed=1)
    load_checkpoint(rd.checkpoint_path, m2, opt2)
    x = torch.randint(0, CFG.vocab_size, (2, CFG.block_size), generator=torch.Generator().manual_seed(3))
    for model, o in ((m, opt), (m2, opt2)):
        _, loss = model(x, x)
        o.zero_grad()
        loss.backward()
        o.step()
    assert all(torch.equal(a, b) for a, b in zip(m.parameters(), m2.parameters(), strict=True))


def test_checkpoint_config_mismatch(tmp_path):
    rd = RunDir(tmp_path)
    m, opt = trained()
    rd.save_checkpoint(m, opt, step=2, extra={})
    other = GPT(GPTConfig(block_size=8, vocab_size=31, n_layer=2, n_head=2, n_embd=16))
    with pytest.raises(BadInput, match="n_layer"):
        load_checkpoint(rd.checkpoint_path, other)


def test_checkpoint_missing_and_corrupt(tmp_path):
    rd = RunDir(tmp_path)
    m, opt = trained()
    with pytest.raises(BadInput, match="no checkpoint"):
        load_checkpoint(rd.checkpoint_path, m, opt)
    rd.save_checkpoint(m, opt, step=2, extra={})
    data = rd.checkpoint_path.read_bytes()
    rd.checkpoint_path.write_bytes(data[: len(data) // 2])  # truncated, as after a crash
    with pytest.raises(BadInput, match="corrupt"):
        load_checkpoint(rd.checkpoint_path, m, opt)
    rd.checkpoint_path.write_bytes(b"not a checkpoint at all")
    with pytest.raises(BadInput, match="corrupt"):
        load_checkpoint(rd.checkpoint_path, m, opt)


def test_checkpoint_of_other_format_is_refused(tmp_path):
    path = tmp_path / "checkpoint.pt"
    torch.save({"model": {}}, path)
    with pytest.raises(BadInput, match="not a"):
        load_checkpoint(path, GPT(CFG))
