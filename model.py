"""The DFlash drafter in plain torch and its released checkpoint format.

A drafter (DFlash, arXiv 2602.06036) is a few Qwen3-style decoder layers. It reads the frozen target's
hidden states at `target_layer_ids`, fuses them once (fc + hidden_norm) into context features, and every layer
projects those features with its own k/v projections into extra keys/values placed in front of the block's own.
Queries come only from the block: [anchor token, mask, mask, ...] at absolute positions anchor+k. The target's
embedding and LM head are shared and frozen; they are not drafter weights.

Reading order (bottom-up): helpers -> attention -> MLP -> layer -> config -> model -> checkpoint.
Weight names match released checkpoints (z-lab, SpecForge, vLLM, SGLang), so saving is a plain state-dict write.
The optional heads (Markov, confidence, Domino) and the training objective live in loss.py.

Test: python -m pytest -q tests/test_model.py
"""

import json
import math
import os
from dataclasses import dataclass, field, replace

import torch
import torch.nn as nn
import torch.nn.functional as F
from attention import attend, compile_on_first_call
from loss import ConfidenceHead, MarkovHead, domino_head


# ------------------------------------------------- helpers: RMSNorm and rotary embedding, both as Qwen3/HF compute them
class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        # fp32 statistics, then back to the input dtype before the weight (HF Qwen3RMSNorm order)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rope_inv_freq(head_dim, theta, scaling=None):
    """Inverse frequencies in fp32, as HF and the serving engines compute them (bf16 ones would not match). Another
    rope type than these is an error, never an approximation."""
    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind == "default":
        return inv
    if kind == "linear":
        return inv / scaling["factor"]
    if kind == "llama3":  # Llama 3.1 frequency-dependent scaling
        factor, lo, hi = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > old / lo, inv / factor, inv)
        smooth = (old / wavelen - lo) / (hi - lo)
        mid = (1 - smooth) * scaled / factor + smooth * scaled
        is_mid = (wavelen >= old / hi) & (wavelen <= old / lo)
        return torch.where(is_mid, mid, scaled)
    raise ValueError(f"config.json: rope_scaling.rope_type={kind!r} is not supported (default, linear, llama3)")


def rope_cos_sin(pos, inv_freq, dtype):
    """pos [..., T] absolute positions -> cos, sin [..., T, head_dim] (computed in fp32, cast like HF)."""
    freqs = pos[..., None].float() * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x_BHTd, cos_BTd, sin_BTd):
    cos, sin = cos_BTd.unsqueeze(1), sin_BTd.unsqueeze(1)  # broadcast over heads
    x1, x2 = x_BHTd.chunk(2, dim=-1)
    return x_BHTd * cos + torch.cat((-x2, x1), dim=-1) * sin


# ---------------------------------------------------------------------- attention with KV injection, MLP, decoder layer
class DFlashAttention(nn.Module):
    def __init__(self, cfg, layer_type):
        super().__init__()
        D, H, Hkv, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.H, self.Hkv, self.hd, self.layer_type = H, Hkv, hd, layer_type
        self.window = cfg.sliding_window if layer_type == "sliding_attention" else None
        self.q_proj = nn.Linear(D, H * hd, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(D, Hkv * hd, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(D, Hkv * hd, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(H * hd, D, bias=cfg.attention_bias)
        self.q_norm = RMSNorm(hd, cfg.rms_norm_eps)  # per-head norms (Qwen3)
        self.k_norm = RMSNorm(hd, cfg.rms_norm_eps)

    def project_q(self, x_BQD, cos, sin):
        B, Q, _ = x_BQD.shape
        q = self.q_norm(self.q_proj(x_BQD).view(B, Q, self.H, self.hd)).transpose(1, 2)  # B H Q hd
        return apply_rope(q, cos, sin)

    def project_kv(self, h_BTD, cos, sin):
        """Keys/values for any mix of context features and block tokens; same weights, norm and RoPE for both."""
        B, T, _ = h_BTD.shape
        k = self.k_norm(self.k_proj(h_BTD).view(B, T, self.Hkv, self.hd)).transpose(1, 2)  # B Hkv T hd
        v = self.v_proj(h_BTD).view(B, T, self.Hkv, self.hd).transpose(1, 2)
        return apply_rope(k, cos, sin), v

    def forward(self, x_BQD, ctx_BSD, cos_all, sin_all, mask):
        """Training: all N blocks at once, x = [block_0 | ... | block_{N-1}], keys [context | blocks] under mask."""
        B, Q, _ = x_BQD.shape
        q = self.project_q(x_BQD, cos_all[:, -Q:], sin_all[:, -Q:])
        k, v = self.project_kv(torch.cat([ctx_BSD, x_BQD], dim=1), cos_all, sin_all)  # one matmul for both halves
        out = attend(q, k, v, mask)  # B H Q hd
        return self.o_proj(out.transpose(1, 2).reshape(B, Q, self.H * self.hd))

    def forward_cached(self, x_BKD, ctx_new_BTD, cache_kv, rope_ctx, rope_blk, sliding_mask):
        """Inference (eval.py): extend the context cache with the new verified positions, attend one block over
        [cached context ; block], cache only the context. rope_*: (cos, sin); sliding_mask: [K, start+K] or None."""
        B, K, _ = x_BKD.shape
        k_new, v_new = self.project_kv(ctx_new_BTD, *rope_ctx)
        if cache_kv is not None:
            k_new, v_new = torch.cat([cache_kv[0], k_new], 2), torch.cat([cache_kv[1], v_new], 2)
        q = self.project_q(x_BKD, *rope_blk)
        k_blk, v_blk = self.project_kv(x_BKD, *rope_blk)
        k, v = torch.cat([k_new, k_blk], 2), torch.cat([v_new, v_blk], 2)
        mask = sliding_mask if self.window is not None else None  # full layer: every context key and the block
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        return self.o_proj(out.transpose(1, 2).reshape(B, K, self.H * self.hd)), (k_new, v_new)


class MLP(nn.Module):  # SwiGLU, Qwen3MLP
    def __init__(self, cfg):
        super().__init__()
        D, F_ = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = nn.Linear(D, F_, bias=False)
        self.up_proj = nn.Linear(D, F_, bias=False)
        self.down_proj = nn.Linear(F_, D, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg, layer_type):
        super().__init__()
        self.layer_type = layer_type
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = DFlashAttention(cfg, layer_type)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, ctx, cos_all, sin_all, mask):
        x = x + self.self_attn(self.input_layernorm(x), ctx, cos_all, sin_all, mask)
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward_cached(self, x, ctx_new, cache_kv, *shared):
        a, cache_kv = self.self_attn.forward_cached(self.input_layernorm(x), ctx_new, cache_kv, *shared)
        x = x + a
        return x + self.mlp(self.post_attention_layernorm(x)), cache_kv


def _layer_call(layer, x, ctx, cos, sin, mask):
    return layer(x, ctx, cos, sin, mask)


# A decoder layer's training forward, compiled on CUDA: inductor fuses the norms, RoPE, SwiGLU and residuals (each its
# own pass over [B, N*K, D] eagerly) into the matmuls (BENCHMARKS.md), flex attention inside. The layer is an argument:
# layers of one type share one graph (weights are inputs), plus one once the sequence length turns dynamic.
_layer_compiled = compile_on_first_call(_layer_call)


# ------------- config: exactly what the released config.json holds (the fields the authors' code, vLLM and SGLang read)
@dataclass
class DrafterConfig:
    hidden_size: int = 576
    intermediate_size: int = 1536
    num_hidden_layers: int = 5
    num_attention_heads: int = 9
    num_key_value_heads: int = 3
    head_dim: int = 64
    vocab_size: int = 49152
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1e6
    rope_scaling: dict | None = None
    max_position_embeddings: int = 40960
    block_size: int = 16
    num_target_layers: int = 36  # depth of the target; only used by loaders when target_layer_ids is absent
    target_layer_ids: list = field(default_factory=lambda: [1, 9, 17, 25, 33])  # "output of decoder layer k"
    mask_token_id: int = 0
    layer_types: list | None = None  # per layer "full_attention" | "sliding_attention"; None -> all full
    sliding_window: int | None = None
    attention_bias: bool = False
    initializer_range: float = 0.02
    markov_rank: int = 0  # > 0: DSpark's low-rank Markov head (MarkovHead); 0: plain DFlash
    # DSpark's acceptance predictor (ConfidenceHead) on [h ; markov_w1[previous token]]; needs a
    # Markov head: both engines serve it only inside their DSpark drafter, fed that concatenation
    confidence_head: bool = False
    # > 0: Domino's causal correction (domino_head): a GRU of this width over the block's tokens so
    # far and an MLP through domino_emb_dim to the vocabulary, added to each offset's logits
    domino_gru_dim: int = 0
    domino_emb_dim: int = 256
    # the Domino head's block layout, as SpecForge's dflash_config names it (export.py spells out
    # both): (false, 0) offset k predicts anchor + k, corrected from the tokens at offsets 0..k-1;
    # (true, 1) offset k predicts anchor + k + 1, offset 0 uncorrected (SGLang's only form)
    domino_shift_label: bool = False
    domino_prefix_len: int = 0  # pure_draft_prefix_len: leading predictions left uncorrected

    def __post_init__(self):
        if self.layer_types is None:
            self.layer_types = ["full_attention"] * self.num_hidden_layers
        bad = [t for t in self.layer_types if t not in ("full_attention", "sliding_attention")]
        if bad or len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(f"layer_types must list {self.num_hidden_layers} of full_attention/sliding_attention, "
                             f"got {self.layer_types}")
        if "sliding_attention" in self.layer_types and not self.sliding_window:
            raise ValueError("layer_types has sliding_attention layers but sliding_window is not set")
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(f"mask_token_id {self.mask_token_id} is outside the vocabulary [0, {self.vocab_size})")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.confidence_head and not self.markov_rank:
            raise ValueError("confidence_head needs markov_rank > 0: vLLM and SGLang serve a "
                             "confidence head only on a DSpark drafter, fed [h ; markov_w1[prev]]")
        if self.domino_gru_dim and (self.markov_rank or self.domino_emb_dim <= 0):
            raise ValueError("domino_gru_dim > 0 (a Domino head) needs markov_rank 0 (one correction "
                             f"head: Domino or DSpark) and domino_emb_dim > 0, got {self.domino_emb_dim}")
        layout = (bool(self.domino_shift_label), int(self.domino_prefix_len))
        if layout != (False, 0) and (not self.domino_gru_dim or layout != (True, 1)):
            raise ValueError(f"a Domino head with shift_label {str(layout[0]).lower()} and "
                             f"pure_draft_prefix_len {layout[1]} is not a form this trainer builds "
                             "(false with 0, or true with 1; a layout needs domino_gru_dim > 0)")

    def num_params(self):
        """The drafter's trainable parameters, from the config alone (the memory plan's, before
        anything is built): fc, the layers (attention, MLP, norms), the final norm, the heads."""
        D, F, V, r, L = (self.hidden_size, self.intermediate_size, self.vocab_size,
                         self.markov_rank, self.num_hidden_layers)
        q, kv = self.num_attention_heads * self.head_dim, self.num_key_value_heads * self.head_dim
        layer = D * (2 * q + 2 * kv + 3 * F) + 2 * D + 2 * self.head_dim
        heads = 2 * V * r + self.confidence_head * (D + r + 1)
        G, E = self.domino_gru_dim, self.domino_emb_dim
        heads += bool(G) * (3 * G * (D + G) + E * (D + G) + E * V)
        return len(self.target_layer_ids) * D * D + L * layer + 2 * D + heads

    def to_json_dict(self):
        def own(*names):  # these fields as they are
            return {n: getattr(self, n) for n in names}
        # a Markov head makes it a DSpark drafter as vLLM (`method: "dspark"`) and SGLang read
        # one: the rank, a vanilla head (w2(w1[prev]), both [V, r]), the confidence head (always
        # on [h ; Markov embedding], the only form SGLang serves), our block layout (offset 0
        # holds the anchor, predicts nothing: sample_from_anchor). SpecForge's DSparkDraftModel
        # reads the head from dflash_config instead, with projector_type dspark and attention_mode
        # gqa (fewer KV heads) or mha (specforge/modeling/draft/dspark.py)
        dspark = {"markov_rank": self.markov_rank, "markov_head_type": "vanilla",
                  "enable_confidence_head": self.confidence_head,
                  "confidence_head_with_markov": self.confidence_head}
        gqa = self.num_key_value_heads < self.num_attention_heads
        nested = {**dspark, "projector_type": "dspark", "attention_mode": "gqa" if gqa else "mha"}
        head = {**dspark, "sample_from_anchor": False, "mask_token_id": self.mask_token_id,
                "target_layer_ids": list(self.target_layer_ids)} if self.markov_rank else {}
        # a Domino head as SpecForge's DominoDraftModel reads one (specforge/modeling/draft/
        # domino.py): projector_type domino, its two widths, the block layout (export.py)
        domino = {"projector_type": "domino", "emb_dim": self.domino_emb_dim,
                  "gru_hidden_dim": self.domino_gru_dim,
                  "pure_draft_prefix_len": self.domino_prefix_len,
                  "shift_label": self.domino_shift_label} if self.domino_gru_dim else {}
        arch = ("Qwen3DSparkModel" if self.markov_rank else
                "DominoDraftModel" if self.domino_gru_dim else "DFlashDraftModel")
        return {
            # no auto_map: the engines register these names themselves
            "architectures": [arch], **head, **({"emb_dim": self.domino_emb_dim} if domino else {}),
            "model_type": "qwen3", **own("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                                         "num_key_value_heads", "head_dim"),
            "hidden_act": "silu", **own("rms_norm_eps", "attention_bias"), "attention_dropout": 0.0,
            "initializer_range": self.initializer_range,
            # rope_theta stays top level: the authors' MLX loader reads it as a required key; vLLM reads
            # rope_parameters (transformers 5 spelling, which wins over rope_theta there): both say the same
            **own("rope_theta", "rope_scaling"),
            "rope_parameters": {"rope_type": "default", **(self.rope_scaling or {}), "rope_theta": self.rope_theta},
            **own("max_position_embeddings", "vocab_size"), "tie_word_embeddings": False,
            # written explicitly: Qwen3Config would otherwise derive them from use_sliding_window/max_window_layers
            "layer_types": list(self.layer_types), "use_sliding_window": "sliding_attention" in self.layer_types,
            "sliding_window": self.sliding_window, "max_window_layers": self.num_hidden_layers,
            "dtype": "bfloat16", "torch_dtype": "bfloat16",  # torch_dtype: transformers 4.x (the authors pin 4.57.1)
            "use_cache": True,
            # the authors' loaders read block_size here, SGLang in dflash_config first
            **own("block_size", "num_target_layers"),
            "dflash_config": {"mask_token_id": self.mask_token_id,
                              "target_layer_ids": list(self.target_layer_ids),
                              "block_size": self.block_size,
                              **(nested if self.markov_rank else {}), **domino},
        }

    @classmethod
    def from_json_dict(cls, d, where="config.json"):
        d = dict(d)
        dc = d.get("dflash_config") or {}
        if "mask_token_id" not in dc:
            raise ValueError(f"{where}: dflash_config.mask_token_id is missing")
        ids = dc.get("target_layer_ids", d.get("target_layer_ids"))
        if ids is None:  # released rule from the target depth
            ids = build_target_layer_ids(d["num_target_layers"], d["num_hidden_layers"])
        if d.get("rope_theta") is None and isinstance(d.get("rope_parameters"), dict):
            d["rope_theta"] = d["rope_parameters"]["rope_theta"]
        kw = dict(target_layer_ids=list(ids), mask_token_id=dc["mask_token_id"],
                  block_size=dc.get("block_size", d.get("block_size", 16)),
                  # SpecForge writes the head's fields nested only
                  markov_rank=dc.get("markov_rank", d.get("markov_rank", 0)),
                  confidence_head=bool(dc.get("enable_confidence_head",
                                              d.get("enable_confidence_head", False))))
        if dc.get("projector_type") == "domino":
            kw.update(domino_gru_dim=int(dc["gru_hidden_dim"]), domino_emb_dim=int(dc["emb_dim"]),
                      domino_shift_label=bool(dc.get("shift_label", False)),
                      domino_prefix_len=int(dc.get("pure_draft_prefix_len", 0)))
        with_markov = (dc.get("confidence_head_with_markov"), d.get("confidence_head_with_markov"))
        if kw["confidence_head"] and False in with_markov:
            raise ValueError(f"{where}: a confidence head on the hidden state alone (confidence_"
                             f"head_with_markov false) is not a form this trainer builds")
        if not d.get("use_sliding_window", True):
            d["sliding_window"] = None
        for name in [n for n in cls.__dataclass_fields__ if n not in kw]:
            if name in d:
                kw[name] = d[name]
            elif name in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                          "num_key_value_heads", "vocab_size", "rope_theta"):
                raise ValueError(f"{where}: required field {name!r} is missing")
        kw.setdefault("head_dim", d["hidden_size"] // d["num_attention_heads"])
        kw.setdefault("num_target_layers", max(kw["target_layer_ids"]) + 3)
        try:
            return cls(**kw)
        except ValueError as e:  # a config the trainer does not build: name the file
            raise ValueError(f"{where}: {e}") from None


def build_target_layer_ids(num_target_layers, n):
    """Released rule (z-lab, SpecForge, SGLang): n ids spread from layer 1 to layer L-3; 1 id -> the middle."""
    if n == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    return [int(round(start + i * (end - start) / (n - 1))) for i in range(n)]


def drafter_config_from_target(target_config, tokenizer=None, mask_token=None,
                               num_target_features=None, **fields):
    """A drafter config from any HF causal-LM config (nested text_config ok): sizes, heads, rope
    and vocab from the target, target_layer_ids by the released rule (num_target_features ids;
    default: one per drafter layer). fields: DrafterConfig fields to set (num_hidden_layers,
    block_size, layer_types, ...). Mask token: `mask_token` (string or id), else the tokenizer's,
    else the first unused embedding row (released convention); SmolLM2 has none free: pass e.g.
    "<empty_output>"."""
    tc = target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config
    L, vocab = tc.num_hidden_layers, tc.vocab_size
    if mask_token is not None:
        mask_id = tokenizer.convert_tokens_to_ids(mask_token) if isinstance(mask_token, str) else int(mask_token)
        if isinstance(mask_token, str) and (mask_id is None or mask_id == tokenizer.unk_token_id):
            raise ValueError(f"mask_token {mask_token!r} is not a token of this tokenizer")
    elif tokenizer is not None and tokenizer.mask_token_id is not None:
        mask_id = tokenizer.mask_token_id
    elif tokenizer is not None and len(tokenizer) < vocab:
        mask_id = len(tokenizer)
    else:
        raise ValueError(f"no free embedding row for a mask token (tokenizer has {len(tokenizer) if tokenizer else '?'}"
                         f" tokens, vocab {vocab}): pass mask_token= a token that training data never contains")
    rope = getattr(tc, "rope_parameters", None) or {}
    theta = getattr(tc, "rope_theta", None) or rope.get("rope_theta", 10000.0)
    scaling = getattr(tc, "rope_scaling", None) or (rope if rope.get("rope_type", "default") != "default" else None)
    if scaling is not None and scaling.get("rope_type", scaling.get("type")) not in ("linear", "llama3"):
        scaling = None  # mrope/partial rotary belong to the target's own attention; the drafter is plain Qwen3
    if scaling is not None:
        scaling = {k: v for k, v in scaling.items() if k != "rope_theta"}
    n_ids = num_target_features or fields.get("num_hidden_layers", DrafterConfig.num_hidden_layers)
    cfg = dict(hidden_size=tc.hidden_size, intermediate_size=tc.intermediate_size,
               num_attention_heads=tc.num_attention_heads, num_key_value_heads=tc.num_key_value_heads,
               head_dim=getattr(tc, "head_dim", None) or tc.hidden_size // tc.num_attention_heads,
               vocab_size=vocab, rms_norm_eps=tc.rms_norm_eps, rope_theta=float(theta),
               rope_scaling=scaling, max_position_embeddings=tc.max_position_embeddings,
               num_target_layers=L, target_layer_ids=build_target_layer_ids(L, n_ids),
               mask_token_id=mask_id)
    return DrafterConfig(**(cfg | fields))


# ----------------------------------------------------------------------------- the drafter (its optional heads: loss.py)
class DFlashDrafter(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.cfg = cfg
        self.fc = nn.Linear(len(cfg.target_layer_ids) * cfg.hidden_size, cfg.hidden_size, bias=False)  # fuse K layers
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DecoderLayer(cfg, t) for t in cfg.layer_types)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if cfg.markov_rank:
            self.markov_head = MarkovHead(cfg.vocab_size, cfg.markov_rank)
        if cfg.confidence_head:
            self.confidence_head = ConfidenceHead(cfg.hidden_size + cfg.markov_rank)
        if cfg.domino_gru_dim:
            self.prefix_gru, self.embed_proj = domino_head(cfg.hidden_size, cfg.domino_gru_dim,
                                                           cfg.domino_emb_dim, cfg.vocab_size)
        # fp32 buffer, not a weight (persistent=False keeps it out of the checkpoint); see _apply below
        self.register_buffer("inv_freq", rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling),
                             persistent=False)
        for layer in self.layers:
            layer.self_attn.inv_freq = self.inv_freq
        self.apply(self._init_weights)
        self.compile_layers = True  # run-time switch, not a checkpoint field (bench.py measures both)

    def _init_weights(self, m):  # HF Qwen3PreTrainedModel init: N(0, 0.02) linears and embeddings, norms at 1
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=self.cfg.initializer_range)
            if getattr(m, "bias", None) is not None:
                nn.init.zeros_(m.bias)

    def _apply(self, fn, *args, **kwargs):
        # .to(bf16) must not round the rotary frequencies: recompute them in fp32 on the new device
        super()._apply(fn, *args, **kwargs)
        c = self.cfg
        self.inv_freq = rope_inv_freq(c.head_dim, c.rope_theta, c.rope_scaling).to(self.fc.weight.device)
        for layer in self.layers:
            layer.self_attn.inv_freq = self.inv_freq
        return self

    def draft_tokens(self, logits_BKV, h_BKD, first_B, pick, embed_VD=None):
        """A block's drafted tokens from the logits of its drafting offsets [B, K-1, V]
        (DFlashDrafter.drafting: 1..K-1, or 0..K-2 under domino_shift_label) and their normed
        hidden [B, K-1, D] -> (tokens [B, K-1], the confidence head's probabilities [B, K-1], None
        without one). pick(logits [..., V]) chooses (argmax, or a sample). No Markov or Domino head:
        every offset at once; with one, left to right from first (the anchor), each drafted token
        the next one's previous, as DSpark and Domino draft. embed_VD: the target's embedding
        table (a Domino head reads the drafted tokens through it; under domino_prefix_len p the
        first p offsets of the block keep the LM head's logits, the GRU reading on)."""
        if self.cfg.domino_gru_dim:
            toks, state, first = [first_B], None, 1 - int(self.cfg.domino_shift_label)
            for k in range(logits_BKV.shape[1]):
                e_B1D = F.embedding(toks[-1], embed_VD)[:, None].to(h_BKD.dtype)
                g_B1G, state = self.prefix_gru(e_B1D, state)
                logits_BV = logits_BKV[:, k]
                if first + k >= self.cfg.domino_prefix_len:
                    logits_BV = logits_BV + self.domino_bias(h_BKD[:, k], g_B1G[:, 0]).to(logits_BV.dtype)
                toks.append(pick(logits_BV))
            return torch.stack(toks[1:], 1), None
        if not self.cfg.markov_rank:
            return pick(logits_BKV), None
        toks = [first_B]
        for k in range(logits_BKV.shape[1]):
            toks.append(pick(logits_BKV[:, k] + self.markov_head(toks[-1]).to(logits_BKV.dtype)))
        conf = None
        if self.cfg.confidence_head:  # on [h ; markov_w1[previous drafted token]], as engines do
            prev_BK = torch.stack(toks[:-1], 1)  # offset k's previous token: the anchor, then drafts
            conf = torch.sigmoid(self.confidence_logits(h_BKD, prev_BK))
        return torch.stack(toks[1:], 1), conf

    def drafting(self, K):
        """The offsets of a block of K whose outputs draft: 1..K-1 (offset k predicts the token at
        anchor+k), or 0..K-2 under domino_shift_label (offset k predicts anchor+k+1)."""
        shift = int(self.cfg.domino_shift_label)
        return slice(1 - shift, K - shift)

    def domino_bias(self, h_MD, g_MG):
        """The Domino head's logit bias for rows of normed hidden h whose GRU state is g."""
        return self.embed_proj(torch.cat([h_MD, g_MG.to(h_MD.dtype)], -1))

    def confidence_logits(self, h_MD, prev_M):
        """The confidence head's logits for drafted rows h (normed, as the LM head reads them)
        whose previous token is prev."""
        return self.confidence_head(h_MD, self.markov_head.markov_w1(prev_M))

    def forward(self, x_BQD, target_hidden_BSC, pos_blk_BQ, masks):
        """Training forward over all blocks -> normed hidden [B,Q,D]. x: embedded block tokens; target_hidden: the S
        context positions' target-layer states; pos_blk: anchor+k; masks: {layer_type: mask} (attention.build_masks)."""
        B, S = target_hidden_BSC.shape[:2]
        ctx = self.hidden_norm(self.fc(target_hidden_BSC))  # computed once, shared by every layer (paper §4.2)
        pos = torch.cat([torch.arange(S, device=x_BQD.device).expand(B, S), pos_blk_BQ], dim=1)  # [B, S+Q]
        cos, sin = rope_cos_sin(pos, self.inv_freq, x_BQD.dtype)
        run = _layer_compiled if self.compile_layers and x_BQD.is_cuda else _layer_call
        h = x_BQD
        for layer in self.layers:
            h = run(layer, h, ctx, cos, sin, masks[layer.layer_type])
        return self.norm(h)

    def forward_cached(self, x_BKD, new_hidden_BTC, cache, start):
        """One block at inference (eval.py) -> (normed hidden [B,K,D], cache of 0..start-1). cache: per-layer (k, v)
        of positions 0..start-T-1 (None: empty); new_hidden: target states of the verified start-T..start-1."""
        K, T, dev, dt = x_BKD.shape[1], new_hidden_BTC.shape[1], x_BKD.device, x_BKD.dtype
        T0 = 0 if not cache or cache[0] is None else cache[0][0].shape[2]
        assert T0 + T == start, "context cache must cover exactly positions 0..start-1"
        ctx_new = self.hidden_norm(self.fc(new_hidden_BTC))
        # RoPE and the sliding mask depend on positions only: computed once here, not once per layer
        rope_ctx = rope_cos_sin(torch.arange(T0, start, device=dev)[None], self.inv_freq, dt)
        rope_blk = rope_cos_sin(torch.arange(start, start + K, device=dev)[None], self.inv_freq, dt)
        sliding = None  # key position >= query position - (W-1), causal inside the block
        if "sliding_attention" in self.cfg.layer_types:
            qpos = torch.arange(start, start + K, device=dev)[:, None]
            kpos = torch.arange(start + K, device=dev)[None, :]
            sliding = (kpos >= qpos - (self.cfg.sliding_window - 1)) & ((kpos < start) | (kpos <= qpos))
        h, new_cache = x_BKD, []
        for layer, kv in zip(self.layers, cache or [None] * len(self.layers)):
            h, kv = layer.forward_cached(h, ctx_new, kv, rope_ctx, rope_blk, sliding)
            new_cache.append(kv)
        return self.norm(h), new_cache


def to_float8(drafter, recipe, emulate=False):
    """FP8 matmuls for the drafter's linears (torchao.float8: dynamic tensorwise or rowwise scales, e4m3 forward,
    gradients as the recipe says) where the sizes suit the FP8 kernels (multiples of 16). The weights keep their
    dtype and names, so a checkpoint does not change.
    The Markov head stays as it is (a table lookup, then a rank-r linear into the vocabulary).
    emulate: FP8 rounding in ordinary matmuls, for CPU tests (no speedup)."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    config = replace(Float8LinearConfig.from_recipe_name(recipe), emulate=emulate)
    return convert_to_float8_training(drafter, config=config, module_filter_fn=lambda m, name: not name.startswith(
        "markov_head") and m.in_features % 16 == 0 and m.out_features % 16 == 0)


# ------------------------------------------------- checkpoint: config.json + model.safetensors, flat released key names
def save_drafter(drafter, out_dir, dtype=torch.bfloat16):
    """Write a released-format checkpoint. dtype=None keeps the parameters' dtype (exact round trip)."""
    from safetensors.torch import save_file
    os.makedirs(out_dir, exist_ok=True)
    sd = {k: (v if dtype is None else v.to(dtype)).detach().cpu().contiguous() for k, v in drafter.state_dict().items()}
    cfg = drafter.cfg.to_json_dict()
    cfg["dtype"] = cfg["torch_dtype"] = str(next(iter(sd.values())).dtype).removeprefix("torch.")  # as saved
    save_file(sd, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)


def load_drafter(ckpt_dir, device="cpu", dtype=None):
    """Load ours or any released DFlash drafter directory (saved dtype unless given); a mismatch names its key."""
    from safetensors.torch import load_file
    path = os.path.join(ckpt_dir, "config.json")
    with open(path) as f:
        cfg = DrafterConfig.from_json_dict(json.load(f), where=path)
    sd = load_file(os.path.join(ckpt_dir, "model.safetensors"))
    sd = {k.removeprefix("model."): v for k, v in sd.items()}  # some exports carry a model. prefix
    with torch.device("meta"):
        drafter = DFlashDrafter(cfg)
    expected = {k: v.shape for k, v in drafter.state_dict().items()}
    missing, unexpected = sorted(set(expected) - set(sd)), sorted(set(sd) - set(expected))
    if missing or unexpected:
        raise KeyError(f"{ckpt_dir}: missing keys {missing}, unexpected keys {unexpected}")
    for k, shape in expected.items():
        if sd[k].shape != shape:
            raise ValueError(f"{ckpt_dir}: {k} has shape {tuple(sd[k].shape)}, config says {tuple(shape)}")
    drafter = drafter.to_empty(device=device).to(dtype or sd["fc.weight"].dtype)  # default: the saved dtype
    drafter.load_state_dict(sd, strict=True)
    return drafter
