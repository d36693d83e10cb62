"""GPT-2 in plain PyTorch (the llm.c / nanoGPT architecture, GPT-2's parameter names), small enough
to train on a CPU.

Determinism (goal G2 rests on it): with the same seed, thread count and inputs, a CPU run is
bit-identical from run to run: no dropout, no nondeterministic CPU kernel, and AdamW on its
single-tensor path. Other thread counts reorder reductions; on CUDA bit-equality is not promised.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import asdict, dataclass, fields

import torch
import torch.nn as nn
import torch.nn.functional as F

from gputravel.errors import BadInput

#: Targets equal to this value are left out of the loss (padding, or positions not to train).
IGNORE_INDEX = -1


@dataclass(frozen=True)
class GPTConfig:
    block_size: int
    vocab_size: int
    n_layer: int
    n_head: int
    n_embd: int

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if type(value) is not int or value <= 0:  # not isinstance: True as a size is a mistake
                raise BadInput(f"GPTConfig.{name} must be a positive int, got {value!r}")
        if self.n_embd % self.n_head:
            raise BadInput(f"GPTConfig.n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head}); "
                           "pick n_embd as a multiple of n_head")

    @classmethod
    def gpt2_124m(cls) -> GPTConfig:
        """The smallest GPT-2 (124M parameters), as in the GPT-2 paper and llm.c."""
        return cls(block_size=1024, vocab_size=50257, n_layer=12, n_head=12, n_embd=768)

    @classmethod
    def tiny(cls, vocab_size: int) -> GPTConfig:
        """The demo's size: 300 steps of 8 x 64 tokens take about 40 s on two idle cores (vocab 256)."""
        return cls(block_size=64, vocab_size=vocab_size, n_layer=6, n_head=4, n_embd=256)

    def to_dict(self) -> dict[str, int]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> GPTConfig:
        if not isinstance(d, dict):
            raise BadInput(f"a GPTConfig dict is expected, got {type(d).__name__}")
        names = {f.name for f in fields(cls)}
        if set(d) != names:
            raise BadInput(f"a GPTConfig dict needs exactly the keys {sorted(names)}, got {sorted(d)}")
        return cls(**d)


def pick_device() -> str:
    """"cpu" without a usable GPU, else "cuda", or "cuda:{LOCAL_RANK}" for one of several ranks on
    one machine (torchrun sets LOCAL_RANK): each rank its own GPU, as NCCL requires."""
    if not torch.cuda.is_available():
        return "cpu"
    local = os.environ.get("LOCAL_RANK")
    if local is None:
        return "cuda"
    count = torch.cuda.device_count()
    if not re.fullmatch(r"[0-9]{1,4}", local) or int(local) >= count:
        raise BadInput(f"LOCAL_RANK={local!r} names no GPU of this machine's {count}: one rank per GPU")
    return f"cuda:{int(local)}"


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        # one matmul for q, k and v is cheaper than three and matches GPT-2's weight layout
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd)
        self.c_proj.residual_proj = True  # marks the scaled init (see GPT._init_weights)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.c_attn(x).split(c, dim=2)
        # (B, T, C) -> (B, n_head, T, head_dim): heads attend independently
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(b, t, c)
        return self.c_proj(y)


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd)
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd)
        self.c_proj.residual_proj = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # GPT-2 was trained with the tanh approximation; keep it so weights stay compatible
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # pre-LN: the residual stream itself is never normalised, which keeps deep stacks stable
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        if not isinstance(config, GPTConfig):
            raise BadInput(f"GPT needs a GPTConfig, got {type(config).__name__}")
        self.config = config
        self.transformer = nn.ModuleDict({
            "wte": nn.Embedding(config.vocab_size, config.n_embd),
            "wpe": nn.Embedding(config.block_size, config.n_embd),
            "h": nn.ModuleList(Block(config) for _ in range(config.n_layer)),
            "ln_f": nn.LayerNorm(config.n_embd),
        })
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        # tie: one matrix both embeds tokens and scores them (GPT-2; saves vocab*n_embd params)
        self.lm_head.weight = self.transformer.wte.weight
        self.apply(self._init_weights)

    def _init_weights(self, module: nn.Module) -> None:
        std = 0.02
        if isinstance(module, nn.Linear):
            if getattr(module, "residual_proj", False):
                # each block adds two residual contributions; scaling keeps the stream's
                # variance from growing with depth (GPT-2 paper, section 2.3)
                std *= (2 * self.config.n_layer) ** -0.5
            nn.init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=std)
        # LayerNorm keeps PyTorch's default (weight 1, bias 0), which is GPT-2's too

    def _check_idx(self, idx: torch.Tensor, what: str) -> None:
        if not isinstance(idx, torch.Tensor) or idx.dim() != 2 or idx.dtype != torch.long:
            raise BadInput(f"{what} must be a (batch, time) torch.long tensor of token ids")
        if idx.shape[1] == 0 or idx.shape[1] > self.config.block_size:
            raise BadInput(f"{what} has {idx.shape[1]} positions; it needs 1..block_size="
                           f"{self.config.block_size} (crop or split the sequence)")

    def forward(self, idx: torch.Tensor,
                targets: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits (B, T, vocab_size), and the mean cross-entropy over targets not IGNORE_INDEX if given."""
        self._check_idx(idx, "idx")
        pos = torch.arange(idx.shape[1], dtype=torch.long, device=idx.device)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        if targets is None:
            return logits, None
        if not isinstance(targets, torch.Tensor) or targets.shape != idx.shape:
            raise BadInput(f"targets must have the shape of idx {tuple(idx.shape)}")
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1), ignore_index=IGNORE_INDEX)
        return logits, loss

    def configure_optimizer(self, lr: float, weight_decay: float,
                            betas: tuple[float, float] = (0.9, 0.95)) -> torch.optim.AdamW:
        """AdamW decaying only matrices and embeddings; no fused/foreach kernels, so CPU steps
        are reproducible bit for bit."""
        if not lr > 0 or not math.isfinite(lr):
            raise BadInput(f"lr must be a positive finite float, got {lr!r}")
        if not weight_decay >= 0:
            raise BadInput(f"weight_decay must be >= 0, got {weight_decay!r}")
        if len(betas) != 2 or not all(0 <= b < 1 for b in betas):
            raise BadInput(f"betas must be two floats in [0, 1), got {betas!r}")
        # parameters() yields the tied matrix once, so it is not updated twice
        params = [p for p in self.parameters() if p.requires_grad]
        groups = [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ]
        return torch.optim.AdamW(groups, lr=lr, betas=tuple(betas), foreach=False, fused=False)

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0, top_k: int | None = None,
                 generator: torch.Generator | None = None) -> torch.Tensor:
        """``idx`` (B, T) with ``max_new_tokens`` sampled tokens appended; sampling draws only from
        ``generator``, so its seed fixes the sample."""
        self._check_idx(idx[:, -self.config.block_size :] if idx.dim() == 2 else idx, "idx")
        if not isinstance(max_new_tokens, int) or max_new_tokens < 0:
            raise BadInput(f"max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
        if not temperature > 0:
            raise BadInput(f"temperature must be > 0, got {temperature!r}")
        if top_k is not None and not (isinstance(top_k, int) and top_k >= 1):
            raise BadInput(f"top_k must be None or an int >= 1, got {top_k!r}")
        for _ in range(max_new_tokens):
            logits, _ = self(idx[:, -self.config.block_size :])
            logits = logits[:, -1, :] / temperature
            if top_k is not None and top_k < logits.size(-1):
                kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            probs = F.softmax(logits, dim=-1)
            nxt = torch.multinomial(probs, num_samples=1, generator=generator)
            idx = torch.cat((idx, nxt), dim=1)
        return idx
