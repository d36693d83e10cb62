"""Sealed checkpoints (broker/seal.py, train/rundir.py's `sealer`): at rest only ciphertext, which
opens only with the key of the same orchestrator measurement, job and purpose; anything else is a
SealedError saying why, and a plaintext checkpoint handed to a sealer is refused too.
"""

from __future__ import annotations

import struct

import pytest
import torch

from gputravel.broker import Sealer, is_sealed
from gputravel.errors import BadInput, SealedError
from gputravel.train.rundir import RunDir, checkpoint_extra, load_checkpoint

torch.set_num_threads(1)

KEY, OTHER_KEY = bytes(range(32)), bytes(range(1, 33))
JOB, OTHER_JOB = bytes([7]) * 48, bytes([8]) * 48
CANARY = 1234.5678  # a weight whose bytes must not appear at rest


def model_and_optimizer(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Linear(8, 4)
    with torch.no_grad():
        model.weight.fill_(CANARY)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.ones(2, 8)).sum().backward()
    opt.step()
    return model, opt


@pytest.fixture
def sealed_run(tmp_path):
    run = RunDir(tmp_path / "run")
    model, opt = model_and_optimizer()
    run.save_checkpoint(model, opt, 7, {"world_size": 1, "shares": [2]}, sealer=Sealer(KEY, "checkpoint", JOB))
    return run, model, opt


def test_a_sealed_checkpoint_round_trips_and_holds_no_plaintext(sealed_run):
    run, model, opt = sealed_run
    data = run.checkpoint_path.read_bytes()
    assert is_sealed(data) and not data.startswith(b"PK")  # not a torch zip
    weight = model.weight.detach().numpy().tobytes()
    assert weight[:16] not in data and struct.pack("<f", CANARY) * 2 not in data
    fresh, fresh_opt = model_and_optimizer(1)
    step, extra = load_checkpoint(run.checkpoint_path, fresh, fresh_opt, sealer=Sealer(KEY, "checkpoint", JOB))
    assert (step, extra) == (7, {"world_size": 1, "shares": [2]})
    assert torch.equal(fresh.weight, model.weight) and torch.equal(fresh.bias, model.bias)
    assert fresh_opt.state_dict()["state"][0]["step"] == opt.state_dict()["state"][0]["step"]
    assert checkpoint_extra(run.checkpoint_path, sealer=Sealer(KEY, "checkpoint", JOB))["shares"] == [2]
    # Bytes a caller read and checked (loop.py passes `data`) open the same way.
    assert load_checkpoint(run.checkpoint_path, fresh, data=data, sealer=Sealer(KEY, "checkpoint", JOB))[0] == 7


def test_a_sealed_checkpoint_does_not_open_with_another_key_job_or_purpose(sealed_run):
    run, _, _ = sealed_run
    model = model_and_optimizer(1)[0]
    cases = ((Sealer(OTHER_KEY, "checkpoint", JOB), "another orchestrator measurement or job"),
             (Sealer(KEY, "checkpoint", OTHER_JOB), "sealed for job 0707"),
             (Sealer(KEY, "model", JOB), "sealed for the 'checkpoint' key"))
    for sealer, needle in cases:
        with pytest.raises(SealedError, match=needle):
            load_checkpoint(run.checkpoint_path, model, sealer=sealer)
        with pytest.raises(SealedError):
            checkpoint_extra(run.checkpoint_path, sealer=sealer)


def test_a_tampered_or_truncated_sealed_checkpoint_is_refused(sealed_run):
    run, _, _ = sealed_run
    data = bytearray(run.checkpoint_path.read_bytes())
    data[-20] ^= 1  # inside the ciphertext
    run.checkpoint_path.write_bytes(bytes(data))
    with pytest.raises(SealedError, match="or it is corrupt"):
        checkpoint_extra(run.checkpoint_path, sealer=Sealer(KEY, "checkpoint", JOB))
    run.checkpoint_path.write_bytes(bytes(data[: len(data) // 2]))
    with pytest.raises(SealedError, match="not a sealed file"):
        checkpoint_extra(run.checkpoint_path, sealer=Sealer(KEY, "checkpoint", JOB))


def test_a_plaintext_checkpoint_handed_to_a_sealer_is_refused_and_a_sealed_one_without(tmp_path, sealed_run):
    plain = RunDir(tmp_path / "plain")
    model, opt = model_and_optimizer()
    plain.save_checkpoint(model, opt, 3)
    assert not is_sealed(plain.checkpoint_path.read_bytes())
    with pytest.raises(SealedError, match="not a sealed file"):
        load_checkpoint(plain.checkpoint_path, model, sealer=Sealer(KEY, "checkpoint", JOB))
    assert load_checkpoint(plain.checkpoint_path, model)[0] == 3  # no sealer: today's plaintext behaviour
    run, _, _ = sealed_run
    with pytest.raises(BadInput, match="sealed one opens only with its run's key"):
        load_checkpoint(run.checkpoint_path, model)


def test_a_sealer_checks_its_inputs_and_never_shows_its_key():
    for args, needle in (((b"short", "checkpoint", JOB), "32 bytes"), ((KEY, "weights", JOB), "purpose"),
                         ((KEY, "checkpoint", b"x" * 32), "48 bytes")):
        with pytest.raises(BadInput, match=needle):
            Sealer(*args)
    sealer = Sealer(KEY, "model", JOB)
    assert KEY.hex() not in repr(sealer) and "model" in repr(sealer)
    one, two = sealer.seal(b"weights"), sealer.seal(b"weights")
    assert one != two and sealer.open(one) == sealer.open(two) == b"weights"  # a fresh nonce each time
