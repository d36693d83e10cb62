"""gputravel.train.model: shapes, GPT-2 init, weight tying, causality, determinism, sampling."""

from __future__ import annotations

import math

import pytest
import torch

from gputravel.errors import BadInput
from gputravel.train.model import GPT, GPTConfig, pick_device

# bit-equality holds for a fixed thread count; pin it for the whole module
torch.set_num_threads(1)

CFG = GPTConfig(block_size=16, vocab_size=97, n_layer=2, n_head=2, n_embd=32)


def build(seed: int = 0, cfg: GPTConfig = CFG) -> GPT:
    torch.manual_seed(seed)
    return GPT(cfg)


def batch(seed: int = 123, b: int = 4, t: int = 16, v: int = CFG.vocab_size):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, v, (b, t), generator=g)
    y = torch.randint(0, v, (b, t), generator=g)
    return x, y


def train(model: GPT, steps: int, lr: float = 1e-3) -> list[float]:
    opt = model.configure_optimizer(lr=lr, weight_decay=0.1, betas=(0.9, 0.95))
    x, y = batch()
    losses = []
    for _ in range(steps):
        _, loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def test_logits_shape_and_no_loss_without_targets():
    x, _ = batch(t=10)
    logits, loss = build()(x)
    assert logits.shape == (4, 10, CFG.vocab_size)
    assert loss is None


def test_loss_at_init_is_about_ln_vocab():
    # small init weights give near-uniform predictions: loss ~ ln(V). Failing this means the
    # init (std, residual scaling, tying) is wrong.
    cfg = GPTConfig(block_size=32, vocab_size=1000, n_layer=2, n_head=2, n_embd=64)
    x, y = batch(b=8, t=32, v=cfg.vocab_size)
    _, loss = build(cfg=cfg)(x, y)
    assert abs(loss.item() - math.log(cfg.vocab_size)) < 0.3


def test_init_follows_gpt2():
    m = build(cfg=GPTConfig(block_size=64, vocab_size=500, n_layer=4, n_head=4, n_embd=256))
    h = m.transformer.h
    assert torch.all(h[0].attn.c_attn.bias == 0)
    assert abs(h[0].mlp.c_fc.weight.std().item() - 0.02) < 0.002
    scaled = 0.02 * (2 * 4) ** -0.5
    assert abs(h[1].mlp.c_proj.weight.std().item() - scaled) < 0.002
    assert abs(h[1].attn.c_proj.weight.std().item() - scaled) < 0.002


def test_lm_head_is_tied_to_token_embedding():
    m = build()
    assert m.lm_head.weight is m.transformer.wte.weight
    # the tied matrix is one parameter, so the optimizer updates it once
    assert sum(p is m.lm_head.weight for p in m.parameters()) == 1


def test_causal_future_tokens_do_not_change_past_logits():
    m = build()
    x, _ = batch(b=2, t=12)
    x2 = x.clone()
    x2[:, 7] = (x2[:, 7] + 1) % CFG.vocab_size
    with torch.no_grad():
        a, _ = m(x)
        b, _ = m(x2)
    assert torch.equal(a[:, :7], b[:, :7])
    assert not torch.equal(a[:, 7:], b[:, 7:])


def test_same_seed_bit_identical_training_different_seed_differs():
    a = train(build(seed=7), 5)
    b = train(build(seed=7), 5)
    c = train(build(seed=8), 5)
    assert a == b  # exact float equality, not approx
    assert a != c


def test_overfits_one_batch():
    losses = train(build(), 30, lr=3e-3)
    assert losses[-1] < losses[0] - 1.0


def test_generate_length_and_reproducible_with_generator():
    m = build()
    m.eval()
    ctx = torch.zeros((2, 3), dtype=torch.long)
    a = m.generate(ctx, 20, temperature=0.9, top_k=10, generator=torch.Generator().manual_seed(1))
    b = m.generate(ctx, 20, temperature=0.9, top_k=10, generator=torch.Generator().manual_seed(1))
    c = m.generate(ctx, 20, temperature=0.9, top_k=10, generator=torch.Generator().manual_seed(2))
    assert a.shape == (2, 23)
    assert torch.equal(a[:, :3], ctx)
    assert torch.equal(a, b)
    assert not torch.equal(a, c)
    assert int(a.min()) >= 0 and int(a.max()) < CFG.vocab_size


def test_generate_crops_context_beyond_block_size():
    m = build()
    out = m.generate(torch.zeros((1, 15), dtype=torch.long), 5, generator=torch.Generator())
    assert out.shape == (1, 20)


def test_top_k_one_is_greedy():
    m = build()
    ctx = torch.tensor([[1, 2, 3]])
    out = m.generate(ctx, 1, top_k=1, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits, _ = m(ctx)
    assert out[0, -1].item() == logits[0, -1].argmax().item()


def test_optimizer_decays_only_matrices():
    m = build()
    opt = m.configure_optimizer(lr=1e-3, weight_decay=0.1, betas=(0.9, 0.95))
    decayed, plain = opt.param_groups
    assert decayed["weight_decay"] == 0.1 and plain["weight_decay"] == 0.0
    assert all(p.dim() >= 2 for p in decayed["params"])
    assert all(p.dim() < 2 for p in plain["params"])
    assert len(decayed["params"]) + len(plain["params"]) == len(list(m.parameters()))


@pytest.mark.parametrize(
    "kwargs",
    [
        {"n_embd": 30, "n_head": 4},
        {"n_layer": 0},
        {"vocab_size": -1},
        {"block_size": 1.5},
        {"n_head": True},
    ],
)
def test_bad_config_raises(kwargs):
    base = dict(block_size=8, vocab_size=10, n_layer=1, n_head=2, n_embd=8)
    with pytest.raises(BadInput):
        GPTConfig(**{**base, **kwargs})


def test_bad_inputs_raise():
    m = build()
    with pytest.raises(BadInput, match="block_size"):
        m(torch.zeros((1, CFG.block_size + 1), dtype=torch.long))
    with pytest.raises(BadInput, match=r"torch\.long"):
        m(torch.zeros((1, 4)))
    with pytest.raises(BadInput, match="shape"):
        m(torch.zeros((1, 4), dtype=torch.long), torch.zeros((1, 3), dtype=torch.long))
    with pytest.raises(BadInput, match="temperature"):
        m.generate(torch.zeros((1, 1), dtype=torch.long), 1, temperature=0.0)
    with pytest.raises(BadInput, match="lr"):
        m.configure_optimizer(lr=0.0, weight_decay=0.1, betas=(0.9, 0.95))


def test_presets():
    assert GPTConfig.gpt2_124m() == GPTConfig(1024, 50257, 12, 12, 768)
    tiny = GPTConfig.tiny(256)
    assert tiny.vocab_size == 256 and tiny.n_embd % tiny.n_head == 0
    assert GPTConfig.from_dict(tiny.to_dict()) == tiny
    with pytest.raises(BadInput):
        GPTConfig.from_dict({"block_size": 8})


def test_pick_device():
    assert pick_device() == ("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_runs_on_cuda():
    m = build().to("cuda")
    x, y = batch()
    _, loss = m(x.cuda(), y.cuda())
    loss.backward()
    g = torch.Generator(device="cuda").manual_seed(0)
    out = m.generate(x[:, :2].cuda(), 3, generator=g)
    assert out.shape == (4, 5) and out.device.type == "cuda"
