"""The draft head as a torch module (contract/draft_head.py says what it computes), its step form
for export, and its dir: saved by training, loaded (every tensor checked) by the build.

Training runs ``forward`` over whole sequences with an explicit attention mask and the keys and
values of earlier passes (training-time test: a deeper draft step attends to what the shallower
ones wrote); the build exports ``DraftHeadStep``, the same module in the engine's step contract
(one layer's slot cache, written at ``write_index``), reusing the target's step layer
(builder/frontend/step_model.py) so the draft's attention is the target's code.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from torch import nn

from ...checkpoint.errors import CheckpointError
from ...checkpoint.weight_map import WeightMap
from ...contract.draft_head import CONFIG_FILE, NUM_TAPS, WEIGHTS_FILE, DraftHeadConfig, DraftLayerShape
from ...contract.json_file import read_json_object
from ...contract.paths import path_inside
from ..errors import UserError
from ..frontend.checkpoint import ArchConfig
from ..frontend.step_model import DecoderStep, rotary_tables, rotate_half

MAP_NAME = "draft_to_target"


def _llama_config(shape: DraftLayerShape):
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=shape.hidden_size, intermediate_size=shape.intermediate_size,
                       num_attention_heads=shape.num_heads, num_key_value_heads=shape.num_kv_heads,
                       head_dim=shape.head_dim, rms_norm_eps=shape.rms_norm_eps, rope_theta=shape.rope_theta,
                       num_hidden_layers=1, vocab_size=1, bos_token_id=None, eos_token_id=None, pad_token_id=None, attention_bias=False, mlp_bias=False)


def layer_arch(shape: DraftLayerShape, vocab_size: int) -> ArchConfig:
    """The draft layer as the step model's ArchConfig (for DecoderStep)."""
    return ArchConfig(architecture="LlamaForCausalLM", vocab_size=vocab_size, hidden_size=shape.hidden_size,
                      intermediate_size=shape.intermediate_size, num_layers=1, num_heads=shape.num_heads,
                      num_kv_heads=shape.num_kv_heads, head_dim=shape.head_dim, rms_norm_eps=shape.rms_norm_eps,
                      max_position_embeddings=1 << 20, tie_word_embeddings=False, qk_norm=False,
                      sliding_window=None)


class DraftHead(nn.Module):
    """fuse (3H → H), the input combination (2H → H), one decoder layer, norm, LM head (H → K).
    ``embed`` is the target's token embedding (frozen; not part of the draft's weights)."""

    def __init__(self, config: DraftHeadConfig, embed: nn.Embedding):
        super().__init__()
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRMSNorm, LlamaRotaryEmbedding

        shape, hidden = config.layer, config.layer.hidden_size
        self.config = config
        llama = _llama_config(shape)
        self.embed = embed
        self.embed.weight.requires_grad_(False)
        self.fuse = nn.Linear(NUM_TAPS * hidden, hidden, bias=False)
        self.embed_norm = LlamaRMSNorm(hidden, eps=shape.rms_norm_eps)
        self.feature_norm = LlamaRMSNorm(hidden, eps=shape.rms_norm_eps)
        self.combine = nn.Linear(2 * hidden, hidden, bias=False)
        self.layer = LlamaDecoderLayer(llama, layer_idx=0)
        self.norm = LlamaRMSNorm(hidden, eps=shape.rms_norm_eps)
        self.lm_head = nn.Linear(hidden, config.draft_vocab_size, bias=False)
        self.register_buffer(MAP_NAME, torch.zeros(config.draft_vocab_size, dtype=torch.int64))
        self.rotary = LlamaRotaryEmbedding(llama)

    def fuse_taps(self, taps: torch.Tensor) -> torch.Tensor:
        """taps [..., 3H] (the tapped layers' outputs, concatenated in ``config.taps`` order) → [..., H]."""
        return self.fuse(taps)

    def layer_input(self, input_ids: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """[B, S] next tokens and [B, S, H] features → the decoder layer's input [B, S, H]."""
        embedded = self.embed(input_ids).to(features.dtype)
        return self.combine(torch.cat((self.embed_norm(embedded), self.feature_norm(features)), dim=-1))

    def forward(self, input_ids: torch.Tensor, features: torch.Tensor, position_ids: torch.Tensor,
                mask: torch.Tensor, prior: list[tuple[torch.Tensor, torch.Tensor]] = ()):
        """Training pass: ``input_ids`` [B, S] (token p + 1 at position p), ``features`` [B, S, H],
        ``position_ids`` [B, S], ``mask`` bool [B, 1, S, T]: which of the T keys (``prior``'s
        passes' keys in order, then this pass's S) each query sees. Returns (logits [B, S, K],
        hidden [B, S, H]: the next draft step's features, (k, v) of this pass [B, H_kv, S, D])."""
        layer, shape = self.layer, self.config.layer
        batch, seq, _ = features.shape
        x = self.layer_input(input_ids, features)
        residual = x
        h = layer.input_layernorm(x)
        attn = layer.self_attn
        q = attn.q_proj(h).view(batch, seq, shape.num_heads, shape.head_dim).transpose(1, 2)     # [B, H, S, D]
        k = attn.k_proj(h).view(batch, seq, shape.num_kv_heads, shape.head_dim).transpose(1, 2)  # [B, Hkv, S, D]
        v = attn.v_proj(h).view(batch, seq, shape.num_kv_heads, shape.head_dim).transpose(1, 2)
        cos, sin = self.rotary(v, position_ids)  # [B, S, D]
        cos, sin = cos[:, None], sin[:, None]
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        keys = torch.cat([p[0] for p in prior] + [k], dim=2)     # [B, Hkv, T, D]
        values = torch.cat([p[1] for p in prior] + [v], dim=2)
        group = shape.num_heads // shape.num_kv_heads
        keys, values = keys.repeat_interleave(group, dim=1), values.repeat_interleave(group, dim=1)
        out = nn.functional.scaled_dot_product_attention(q, keys, values, attn_mask=mask)  # [B, H, S, D]
        out = attn.o_proj(out.transpose(1, 2).reshape(batch, seq, shape.num_heads * shape.head_dim))
        x = residual + out
        x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.lm_head(self.norm(x)).float(), x, (k, v)


class DraftHeadStep(nn.Module):
    """The draft's step in the engine contract: inputs ``input_ids``/``position_ids`` [B, S],
    ``write_index``/``kv_length`` [B], ``attention_mask`` [B, 1, S, S_max], ``logits_index`` [B, R],
    ``features`` [B, S, H], ``past_key_0``/``past_value_0`` [B, H_kv, S_max, D]; outputs
    ``draft_logits`` float32 [B, R, K], ``draft_hidden`` [B, R, H], the present caches."""

    def __init__(self, draft: DraftHead, max_seq_len: int):
        super().__init__()
        self.draft, self.max_seq_len = draft, max_seq_len
        shape = draft.config.layer
        self.arch = layer_arch(shape, draft.config.target_vocab_size)
        self.layer = DecoderStep(draft.layer, self.arch, max_seq_len)
        cos, sin = rotary_tables(draft.rotary.inv_freq, float(draft.rotary.attention_scaling), max_seq_len)
        dtype = draft.fuse.weight.dtype
        self.register_buffer("cos_table", cos.to(dtype), persistent=False)  # [S_max, D/2]
        self.register_buffer("sin_table", sin.to(dtype), persistent=False)

    def forward(self, input_ids, position_ids, write_index, kv_length, attention_mask, logits_index,
                features, past_key, past_value):
        arch = self.arch
        batch, seq = input_ids.shape
        x = self.draft.layer_input(input_ids, features)  # [B, S, H]
        cos = nn.functional.embedding(position_ids, self.cos_table)
        sin = nn.functional.embedding(position_ids, self.sin_table)
        cos = torch.cat((cos, cos), dim=-1).unsqueeze(1)  # [B, 1, S, D]
        sin = torch.cat((sin, sin), dim=-1).unsqueeze(1)
        slots = write_index[:, None] + torch.arange(seq, device=input_ids.device)[None, :]  # [B, S]
        scatter_index = slots[:, None, :, None].expand(batch, arch.num_kv_heads, seq, arch.head_dim)
        valid = torch.arange(self.max_seq_len, device=input_ids.device)[None, :] < kv_length[:, None]
        mask = attention_mask & valid[:, None, None, :]  # [B, 1, S, S_max]
        hidden, present_k, present_v = self.layer(x, cos, sin, past_key, past_value, scatter_index, mask)
        rows = logits_index[:, :, None].expand(batch, logits_index.shape[1], hidden.shape[-1])
        picked = torch.gather(hidden, 1, rows)  # [B, R, H]
        return self.draft.lm_head(self.draft.norm(picked)).float(), picked, present_k, present_v


def random_draft_head(config: DraftHeadConfig, std: float, seed: int = 0,
                      draft_to_target: np.ndarray | None = None) -> DraftHead:
    """A draft head of normal(0, ``std``) weights over a random embedding (what its cost or its
    plumbing is measured with: benchmarks, tests), its map ``draft_to_target`` or K distinct
    random target ids."""
    torch.manual_seed(seed)
    draft = DraftHead(config, nn.Embedding(config.target_vocab_size, config.layer.hidden_size))
    with torch.no_grad():
        for param in draft.parameters():
            param.normal_(0.0, std)
        ids = (torch.randperm(config.target_vocab_size)[:config.draft_vocab_size] if draft_to_target is None
               else torch.as_tensor(np.asarray(draft_to_target), dtype=torch.int64))
        getattr(draft, MAP_NAME).copy_(ids)
    return draft.eval()


def save_draft_head(draft: DraftHead, out: Path) -> None:
    """Writes ``draft_head.safetensors`` (float32; the embedding left out) and ``draft_head.json``."""
    from safetensors.torch import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {name: t.detach().contiguous() for name, t in draft.state_dict().items()
               if not name.startswith(("embed.", "rotary."))}
    # Each file is written under a temporary name and renamed, the config last: a killed run leaves
    # no dir that reads as a draft. safetensors creates owner-only files; a draft dir is shipped.
    weights, config = out / f".{WEIGHTS_FILE}.partial", out / f".{CONFIG_FILE}.partial"
    save_file({k: (v if v.dtype == torch.int64 else v.float()) for k, v in tensors.items()}, str(weights))
    config.write_text(json.dumps(draft.config.to_json(), indent=2) + "\n")
    for staged in (weights, config):
        staged.chmod(0o644)
    weights.replace(out / WEIGHTS_FILE)
    config.replace(out / CONFIG_FILE)


def read_draft_config(path: Path) -> DraftHeadConfig:
    """The draft dir's config (checked), nothing else read."""
    config_path = path_inside(Path(path), CONFIG_FILE)
    if not Path(path).is_dir():
        raise UserError(f"{path}: draft head dir does not exist (make one with `trtbuild draft train`)")
    if config_path is None or not config_path.is_file():
        raise UserError(f"{Path(path) / CONFIG_FILE}: missing, or a link leading outside the draft dir")
    try:
        return DraftHeadConfig.from_json(read_json_object(config_path), str(config_path))
    except ValueError as exc:
        raise UserError(str(exc)) from None


def load_draft_head(path: Path, embed: nn.Embedding) -> DraftHead:
    """A draft dir whose every tensor's header entry is checked (present, shape, dtype) and whose
    draft-to-target map holds only target ids; ``embed`` the target's token embedding."""
    path = Path(path)
    config = read_draft_config(path)
    weights_path = path_inside(path, WEIGHTS_FILE)
    if weights_path is None or not weights_path.is_file():
        raise UserError(f"{path / WEIGHTS_FILE}: missing, or a link leading outside the draft dir")
    if embed.weight.shape[1] != config.layer.hidden_size or embed.weight.shape[0] != config.target_vocab_size:
        raise UserError(f"{path}: the draft fits a target of hidden {config.layer.hidden_size} and vocabulary "
                        f"{config.target_vocab_size}; this target's embedding is {list(embed.weight.shape)}")
    draft = DraftHead(config, embed)
    expected = {name: tuple(t.shape) for name, t in draft.state_dict().items()
                if not name.startswith(("embed.", "rotary."))}
    try:
        weights = WeightMap.from_files(path, [weights_path])
    except CheckpointError as exc:
        raise UserError(str(exc)) from None
    if set(weights.names) != set(expected):
        missing, extra = sorted(set(expected) - set(weights.names)), sorted(set(weights.names) - set(expected))
        raise UserError(f"{weights_path}: tensors do not match the config: missing {missing[:4]}, unexpected {extra[:4]}")
    state = {}
    for name, shape in expected.items():
        entry = weights.entry(name)
        if tuple(entry.shape) != shape:
            raise UserError(f"{weights_path}: {name} has shape {list(entry.shape)}, expected {list(shape)} "
                            f"(from {CONFIG_FILE})")
        wanted = ("I64",) if name == MAP_NAME else ("F32", "F16", "BF16")
        if entry.dtype not in wanted:
            raise UserError(f"{weights_path}: {name} is {entry.dtype}; expected {' or '.join(wanted)}")
        state[name] = weights.tensor(name, torch.int64 if name == MAP_NAME else torch.float32)
    ids = state[MAP_NAME].numpy()
    if ids.min(initial=0) < 0 or ids.max(initial=0) >= config.target_vocab_size:
        raise UserError(f"{weights_path}: {MAP_NAME} holds ids outside the target's vocabulary "
                        f"[0, {config.target_vocab_size})")
    if len(np.unique(ids)) != len(ids):
        raise UserError(f"{weights_path}: {MAP_NAME} maps two draft ids to one target id")
    draft.load_state_dict(state, strict=False)
    return draft
