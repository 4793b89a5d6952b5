"""The engine's step function as a torch module over a transformers Llama-family model.

It implements the engine contract (trtbuild.contract.step; README "How a build works") in plain, decomposed torch ops
so that torch.export gives a graph whose every fusion is ours to make and log:
RMSNorm as pow/mean/rsqrt (transformers' own module), RoPE as rotate-half over a cos/sin table gathered by
position_ids, the cache write as a scatter at ``write_index``, attention as
matmul/where/softmax/matmul over the whole cache. The weights are the transformers
model's own modules, so the step matches transformers numerically.
"""
from __future__ import annotations

import torch
from torch import nn

from .checkpoint import ArchConfig




def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotary_tables(inv_freq: torch.Tensor, scaling: float, max_seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables [max_seq_len, D/2], computed as transformers computes them (float32)."""
    positions = torch.arange(max_seq_len, dtype=torch.float32)
    freqs = positions[:, None] * inv_freq.float()[None, :]  # [S_max, D/2]
    return freqs.cos() * scaling, freqs.sin() * scaling


class AttentionStep(nn.Module):
    """Self-attention of one layer against its slot caches (decomposed; fused by passes)."""

    def __init__(self, hf_attn: nn.Module, arch: ArchConfig, max_seq_len: int):
        super().__init__()
        self.arch, self.max_seq_len = arch, max_seq_len
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (
            hf_attn.q_proj, hf_attn.k_proj, hf_attn.v_proj, hf_attn.o_proj)
        self.scaling = float(hf_attn.scaling)
        # Qwen3 normalizes each head's query and key before RoPE.
        self.q_norm = hf_attn.q_norm if arch.qk_norm else None
        self.k_norm = hf_attn.k_norm if arch.qk_norm else None

    def forward(self, x, cos, sin, past_k, past_v, scatter_index, mask):
        arch = self.arch
        batch, seq, _ = x.shape
        q = self.q_proj(x).view(batch, seq, arch.num_heads, arch.head_dim).transpose(1, 2)     # [B, H, S, Dh]
        k = self.k_proj(x).view(batch, seq, arch.num_kv_heads, arch.head_dim).transpose(1, 2)  # [B, Hkv, S, Dh]
        v = self.v_proj(x).view(batch, seq, arch.num_kv_heads, arch.head_dim).transpose(1, 2)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        present_k = past_k.scatter(2, scatter_index, k)  # [B, Hkv, S_max, Dh]
        present_v = past_v.scatter(2, scatter_index, v)
        keys, values = self._repeat_kv(present_k), self._repeat_kv(present_v)  # [B, H, S_max, Dh]
        scores = torch.matmul(q, keys.transpose(-1, -2)) * self.scaling        # [B, H, S, S_max]
        scores = scores.float().masked_fill(~mask, torch.finfo(torch.float32).min)
        probs = torch.softmax(scores, dim=-1).to(q.dtype)
        out = torch.matmul(probs, values)  # [B, H, S, Dh]
        out = out.transpose(1, 2).reshape(batch, seq, arch.num_heads * arch.head_dim)
        return self.o_proj(out), present_k, present_v

    def _repeat_kv(self, x: torch.Tensor) -> torch.Tensor:
        arch = self.arch
        if arch.group_size == 1:
            return x
        batch = x.shape[0]
        x = x[:, :, None].expand(batch, arch.num_kv_heads, arch.group_size, self.max_seq_len, arch.head_dim)
        return x.reshape(batch, arch.num_heads, self.max_seq_len, arch.head_dim)


class DecoderStep(nn.Module):
    def __init__(self, hf_layer: nn.Module, arch: ArchConfig, max_seq_len: int):
        super().__init__()
        self.input_layernorm = hf_layer.input_layernorm
        self.self_attn = AttentionStep(hf_layer.self_attn, arch, max_seq_len)
        self.post_attention_layernorm = hf_layer.post_attention_layernorm
        self.mlp = hf_layer.mlp

    def forward(self, hidden, cos, sin, past_k, past_v, scatter_index, mask):
        attn_out, present_k, present_v = self.self_attn(
            self.input_layernorm(hidden), cos, sin, past_k, past_v, scatter_index, mask)
        hidden = hidden + attn_out
        hidden = hidden + self.mlp(self.post_attention_layernorm(hidden))
        return hidden, present_k, present_v


class LlamaStep(nn.Module):
    """One engine step: new tokens in, logits at ``logits_index`` out, caches updated.

    With ``draft_taps`` (a draft head's tapped layers, contract/draft_head.py) the step also
    outputs DRAFT_FEATURES [B, S, D]: ``draft_fuse`` (the draft's fuse projection, 3D → D) over the
    hidden states after those layers, concatenated, at every new position (not only the logits
    rows: the draft reads each position's features). Its weight comes from the draft dir.

    The transformers RMSNorm/MLP/Linear modules are reused as they are (their forward is
    already decomposed); module names follow transformers' so node names read
    ``/model/layers.3/self_attn/...``.
    """

    def __init__(self, hf_model: nn.Module, arch: ArchConfig, max_seq_len: int,
                 draft_taps: tuple[int, ...] | None = None, draft_fuse: nn.Linear | None = None):
        super().__init__()
        self.arch, self.max_seq_len = arch, max_seq_len
        if (draft_taps is None) != (draft_fuse is None):
            raise ValueError("draft_taps and draft_fuse come together")
        self.draft_taps = tuple(draft_taps) if draft_taps is not None else None
        self.draft_fuse = draft_fuse
        inner = hf_model.model
        self.embed_tokens = inner.embed_tokens
        self.layers = nn.ModuleList(DecoderStep(layer, arch, max_seq_len) for layer in inner.layers)
        self.norm = inner.norm
        self.lm_head = hf_model.lm_head
        cos, sin = rotary_tables(inner.rotary_emb.inv_freq, float(inner.rotary_emb.attention_scaling),
                                 max_seq_len)
        dtype = self.embed_tokens.weight.dtype
        self.register_buffer("cos_table", cos.to(dtype), persistent=False)  # [S_max, Dh/2]
        self.register_buffer("sin_table", sin.to(dtype), persistent=False)  # [S_max, Dh/2]

    def forward(self, input_ids, position_ids, write_index, kv_length, attention_mask, logits_index,
                *past: torch.Tensor):
        arch = self.arch
        batch, seq = input_ids.shape
        hidden = self.embed_tokens(input_ids)  # [B, S, D]
        # embedding() is a plain Gather of table rows (accepts the contract's int32 positions).
        cos = nn.functional.embedding(position_ids, self.cos_table)  # [B, S, Dh/2]
        sin = nn.functional.embedding(position_ids, self.sin_table)
        cos = torch.cat((cos, cos), dim=-1).unsqueeze(1)  # [B, 1, S, Dh]
        sin = torch.cat((sin, sin), dim=-1).unsqueeze(1)
        # Where this step's K/V land in each slot's cache, and which cache entries are valid.
        slots = write_index[:, None] + torch.arange(seq, device=input_ids.device)[None, :]  # [B, S]
        scatter_index = slots[:, None, :, None].expand(batch, arch.num_kv_heads, seq, arch.head_dim)
        valid = torch.arange(self.max_seq_len, device=input_ids.device)[None, :] < kv_length[:, None]
        mask = attention_mask & valid[:, None, None, :]  # [B, 1, S, S_max]

        presents, tapped = [], {}
        for index, layer in enumerate(self.layers):
            hidden, present_k, present_v = layer(hidden, cos, sin, past[2 * index], past[2 * index + 1],
                                                 scatter_index, mask)
            presents += [present_k, present_v]
            if self.draft_taps is not None and index in self.draft_taps:
                tapped[index] = hidden

        rows = logits_index[:, :, None].expand(batch, logits_index.shape[1], hidden.shape[-1])
        picked = torch.gather(hidden, 1, rows)   # [B, R, D]
        logits = self.lm_head(self.norm(picked)).float()  # [B, R, V]
        if self.draft_fuse is None:
            return (logits, *presents)
        features = self.draft_fuse(torch.cat([tapped[t] for t in self.draft_taps], dim=-1))  # [B, S, D]
        return (logits, features, *presents)
