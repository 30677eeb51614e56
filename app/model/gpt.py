"""A GPT-2-style decoder (learned positions, pre-LayerNorm, GELU MLP, tied embeddings).

Shapes: tokens (B, S) int64 -> logits (B, S, V). Every parameter is tagged with a
`ParamMeta` and initialised from (seed, name) only, see `app/model/init.py`.
The fused QKV weight is laid out as (heads, 3, head_dim) rows, so a contiguous split of
its rows over tensor-parallel ranks hands each rank whole heads.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from app.deck import ModelConfig
from app.model.init import ParamMeta, init_parameters, new_param


class LayerNorm(nn.Module):
    def __init__(self, hidden: int, eps: float, device: Optional[torch.device]) -> None:
        super().__init__()
        self.eps = eps
        self.weight = new_param(ParamMeta((hidden,), init="ones", decay=False), device=device)
        self.bias = new_param(ParamMeta((hidden,), init="zeros", decay=False), device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, (x.shape[-1],), self.weight, self.bias, self.eps)


class Linear(nn.Module):
    """y = x W^T + b with W of shape (out, in)."""

    def __init__(self, n_in: int, n_out: int, std: float, device: Optional[torch.device]) -> None:
        super().__init__()
        self.weight = new_param(ParamMeta((n_out, n_in), std=std), device=device)
        self.bias = new_param(ParamMeta((n_out,), init="zeros", decay=False), device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, device: Optional[torch.device]) -> None:
        super().__init__()
        self.heads, self.head_dim, self.dropout = cfg.heads, cfg.hidden // cfg.heads, cfg.dropout
        out_std = cfg.init_std / math.sqrt(2 * cfg.layers)  # GPT-2: scale residual projections
        self.qkv = Linear(cfg.hidden, 3 * cfg.hidden, cfg.init_std, device)
        self.proj = Linear(cfg.hidden, cfg.hidden, out_std, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        qkv = self.qkv(x).view(b, s, self.heads, 3, self.head_dim)
        q, k, v = (t.transpose(1, 2) for t in qkv.unbind(dim=3))  # each (B, heads, S, head_dim)
        dropout = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, s, self.heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, device: Optional[torch.device]) -> None:
        super().__init__()
        self.fc = Linear(cfg.hidden, cfg.ffn, cfg.init_std, device)
        self.proj = Linear(cfg.ffn, cfg.hidden, cfg.init_std / math.sqrt(2 * cfg.layers), device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, device: Optional[torch.device]) -> None:
        super().__init__()
        self.ln1 = LayerNorm(cfg.hidden, cfg.layernorm_eps, device)
        self.attn = Attention(cfg, device)
        self.ln2 = LayerNorm(cfg.hidden, cfg.layernorm_eps, device)
        self.mlp = MLP(cfg, device)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.dropout(self.attn(self.ln1(x)))
        return x + self.dropout(self.mlp(self.ln2(x)))


class GPT(nn.Module):
    def __init__(self, cfg: ModelConfig, seed: int, device: Optional[torch.device] = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.wte = new_param(ParamMeta((cfg.vocab_size, cfg.hidden), std=cfg.init_std), device=device)
        self.wpe = new_param(ParamMeta((cfg.seq_len, cfg.hidden), std=cfg.init_std), device=device)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg, device) for _ in range(cfg.layers))
        self.ln_f = LayerNorm(cfg.hidden, cfg.layernorm_eps, device)
        self.head = None
        if not cfg.tie_embeddings:
            self.head = new_param(ParamMeta((cfg.vocab_size, cfg.hidden), std=cfg.init_std), device=device)
        init_parameters(self, seed)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens (B, S) -> logits (B, S, V)."""
        s = tokens.shape[1]
        x = self.drop(F.embedding(tokens, self.wte) + self.wpe[:s])
        for block in self.blocks:
            x = block(x)
        return F.linear(self.ln_f(x), self.wte if self.head is None else self.head)

    def loss(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy over the B x S positions of this micro-batch."""
        logits = self.forward(tokens)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

    def num_parameters(self) -> int:
        """Global parameter count (the tied embedding counted once)."""
        return sum(math.prod(p.meta.global_shape) for p in self.parameters())
