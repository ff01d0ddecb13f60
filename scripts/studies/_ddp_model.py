"""The model and data of scripts/studies/bench_ddp_variants.py: a decoder-only Transformer
language model whose size is a preset or flags, and seeded synthetic tokens.

    cfg = dict(PRESETS["tiny"])
    model = build_model(cfg, seed=0)
    x, y = make_batch(cfg, seed=0, shard=rank)     # a rank's (inputs, next tokens)
    loss_of(model, x, y).backward()
"""
import torch
import torch.nn.functional as F
from torch import nn

PRESETS = {  # parameters: tiny 42 K, small 7.4 M, medium 42 M, large 370 M
    "tiny": dict(layers=2, d_model=32, heads=2, vocab=256, seq_len=16, batch=4),
    "small": dict(layers=4, d_model=256, heads=4, vocab=8192, seq_len=64, batch=4),
    "medium": dict(layers=8, d_model=512, heads=8, vocab=16384, seq_len=128, batch=8),
    "large": dict(layers=24, d_model=1024, heads=16, vocab=32768, seq_len=256, batch=8),
}
MODEL_KEYS = ("layers", "d_model", "heads", "vocab", "seq_len", "batch")


# ------------------------------------------------------------ model and data

class DecoderLM(nn.Module):
    """Token + position embeddings, `layers` pre-norm causal self-attention blocks,
    a final LayerNorm and an untied linear head. No buffers (so the DDPs broadcast
    none) and no dropout (so every variant computes the same gradients)."""

    def __init__(self, layers, d_model, heads, vocab, seq_len):
        super().__init__()
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(seq_len, d_model)
        # Built one by one: nn.TransformerEncoder deep-copies one layer (identical blocks).
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(d_model, heads, 4 * d_model, dropout=0.0,
                                       activation="gelu", batch_first=True, norm_first=True)
            for _ in range(layers))
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)

    def forward(self, tokens):
        t = tokens.shape[1]
        mask = nn.Transformer.generate_square_subsequent_mask(t, device=tokens.device)
        h = self.tok(tokens) + self.pos(torch.arange(t, device=tokens.device))
        for block in self.blocks:
            h = block(h, src_mask=mask, is_causal=True)
        return self.head(self.norm(h))


def build_model(cfg, seed, device="cpu"):
    torch.manual_seed(seed)  # the same initial parameters on every rank and variant
    return DecoderLM(*(cfg[k] for k in MODEL_KEYS[:-1])).to(device)


def make_batch(cfg, seed, shard, device="cpu"):
    """(inputs, targets) of `shard`: batch x seq_len uniform tokens and the next ones."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + shard)
    tokens = torch.randint(cfg["vocab"], (cfg["batch"], cfg["seq_len"] + 1), generator=gen)
    return tokens[:, :-1].to(device), tokens[:, 1:].to(device)


def loss_of(module, x, y):
    return F.cross_entropy(module(x).flatten(0, 1), y.flatten())


def flat_params(module):
    return torch.cat([p.detach().reshape(-1).cpu() for p in module.parameters()])
