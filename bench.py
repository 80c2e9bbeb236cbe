"""GPU benchmarks on random weights, each figure against a ceiling measured in the same run (for
BENCHMARKS.md), timed after compiling and warming up, synchronized, the median of several runs.
`python bench.py`: every case of CASES in its own process, then one table;
`python bench.py drafter --preset 27b --breakdown --fp8=tensorwise`: one case (see each bench_*).

The drafter and end-to-end cases time train.py's own step: train.build_drafting builds the drafting
side (drafter, its variants, frozen tables, optimizer) and train.accumulate runs the micro-batches.
Config fields are given as --field=value and parsed by train.parse_config; the other flags are this
file's own (which case, lengths, model presets).
"""

import argparse
import collections
import inspect
import json
import os
import statistics
import subprocess
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

import eval as ev
import report
import train
from attention import (build_masks, compile_count, configure_compile, dflash_block_mask,
                       flex_compiled)
from loss import Rows, final_states, head_loss, sample_anchors
from model import DFlashDrafter, DrafterConfig, build_target_layer_ids
from ranks import Colocated, GiB, memory_need, setup_dist, torchrun_env
from target import Capture, Float8Frozen, fla_short_conv, load_for_generation, load_tokenizer

# Qwen3.6-27B text stack (3 Gated-DeltaNet + 1 gated full-attention layer, 16 times), shapes as we
# know them (checked)
QWEN36_27B = dict(vocab_size=248320, hidden_size=5120, intermediate_size=17408,
                  num_hidden_layers=64, num_attention_heads=24, num_key_value_heads=4, head_dim=256,
                  linear_num_key_heads=16, linear_num_value_heads=48, linear_key_head_dim=128,
                  linear_value_head_dim=128, linear_conv_kernel_dim=4, rms_norm_eps=1e-6,
                  max_position_embeddings=262144,
                  rope_parameters={"rope_type": "default", "rope_theta": 1e7,
                                   "partial_rotary_factor": 0.25})
QWEN3_8B = dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-6,
                max_position_embeddings=40960, rope_theta=1e6)
SMOL = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_attention_heads=9,
            num_key_value_heads=3, head_dim=64, rms_norm_eps=1e-5, rope_theta=1e5,
            max_position_embeddings=8192)
SMOLLM2 = dict(SMOL, num_hidden_layers=30, tie_word_embeddings=True)  # SmolLM2-135M-Instruct
TARGETS = {  # model type, config, captured ids, (batch, length) shapes
    "8b": ("qwen3", QWEN3_8B, [1, 9, 17, 25, 33], [(4, 3072), (1, 3072)]),
    "27b": ("qwen3_5_text", QWEN36_27B, [1, 16, 31, 46, 61], [(1, 4096), (2, 4096), (1, 2048)]),
}
# drafters: their sizes (DrafterConfig fields), and the Config fields that give their layers
# (train.drafter_layers), before the command line's
PRESETS = {
    # Qwen3.6-27B's, the released z-lab layout: 5 layers, 4 sliding (2048) + 1 full, block 16: the
    # Config's defaults
    "27b": (dict(hidden_size=5120, intermediate_size=17408, num_attention_heads=32,
                 num_key_value_heads=8, head_dim=128, vocab_size=248320, rope_theta=1e7,
                 target_layer_ids=[1, 16, 31, 46, 61], num_target_layers=64, mask_token_id=248070),
            []),
    # Qwen3-8B's (z-lab Qwen3-8B-DFlash-b16), the demo's: the target's shapes, ids by the released
    # rule, full attention
    "8b": (dict(QWEN3_8B, target_layer_ids=[1, 9, 17, 25, 33], num_target_layers=36,
                mask_token_id=151669), ["--sliding_layers=0"]),
    "smol": (dict(SMOL, target_layer_ids=[1, 8, 14, 20, 27], num_target_layers=30,
                  mask_token_id=16), ["--sliding_layers=0"]),
}
H200_PEAK = 989e12  # dense bf16 FLOP/s, datasheet
ROWS = []  # (case, figure, value, "vs ceiling") for the final table


def config(args, preset):
    """train.py's Config for a case: the drafter preset's fields, then the command line's
    --field=value."""
    return parsed([*PRESETS[preset][1], *args.fields])


def parsed(argv):
    """train.py's Config from --field=value, its dtype resolved as train.main resolves it."""
    return train.resolve_dtype(train.parse_config(argv))[0]


def drafter_config(cfg, preset):
    return DrafterConfig(**(PRESETS[preset][0] | train.drafter_layers(cfg)))


class RandomBatches:
    """Random token ids in train.py's batch layout (a quarter prompt, the rest response): what
    ranks.Colocated reads from a data.Batcher (ranks.batch_at sets epoch and step).
    Micro-batch m holds batch_size sequences of m tokens, so a case picks the lengths by picking m;
    one batch per length, made once."""
    steps_per_epoch = 2 ** 40

    def __init__(self, vocab, batch_size):
        self.vocab, self.B, self.made = vocab, batch_size, {}
        self.epoch = self.step = 0

    def __next__(self):
        S = self.step
        if S not in self.made:
            ids = torch.randint(0, self.vocab, (self.B, S), device="cuda")
            mask = torch.zeros_like(ids)
            mask[:, S // 4:] = 1
            self.made[S] = dict(input_ids=ids, loss_mask=mask, lengths=torch.full((self.B,), S))
        return self.made[S]


def random_states(dcfg, dtype, final=False):
    """In place of a target's capture: random target states [B, S, nK*D] (final: + D, the target's
    final states, as train.py sends them for loss.final_states), one tensor per shape."""
    made = {}

    def capture(ids_BS):
        if ids_BS.shape not in made:
            C = (len(dcfg.target_layer_ids) + final) * dcfg.hidden_size
            made[ids_BS.shape] = torch.randn(*ids_BS.shape, C, device="cuda", dtype=dtype)
        return made[ids_BS.shape]
    return capture


def drafting(cfg, dcfg, capture, tables=None):
    """train.py's drafting side on this GPU (a one-process Dist, as train.py sets one up), fed by
    ranks.Colocated from random batches and `capture`; tables: the frozen (embedding, LM head),
    default random."""
    batches = RandomBatches(dcfg.vocab_size, cfg.batch_size)
    source = Colocated(batches, capture, torch.device("cuda"))
    if tables is None:
        V, D, dtype = dcfg.vocab_size, dcfg.hidden_size, getattr(torch, cfg.dtype)
        tables = [torch.randn(V, D, device="cuda", dtype=dtype) * 0.02 for _ in "eh"]
    return train.build_drafting(cfg, dcfg, setup_dist(cfg, torchrun_env()), source, tables)


def optimizer_bytes(optim):
    """Bytes train.Optimizer holds beyond the drafter's own weights and gradients: fp32 masters
    (when the weights are not fp32), the flat gradient, AdamW's state once it has stepped."""
    own = {id(p) for p in optim.params}
    state = [t for s in optim.opt.state.values() for t in s.values() if torch.is_tensor(t)]
    held = [m for m in optim.masters if id(m) not in own] + [optim.flat] + state
    return sum(t.numel() * t.element_size() for t in held)


def micro_steps(cfg, side, lengths):
    """train.py's micro-batches (train.accumulate: forward, loss, backward, statistics) at these
    lengths -> their statistics. Each is step 0 of a run of max_steps (at least 1): a schedule on
    the step sits where a run starts (a Domino head's blend with the LM head's own CE at its start
    weight, the costlier phase: a second CE over the vocabulary)."""
    steps = max(cfg.max_steps, 1)
    return [train.accumulate(0, cfg, side, iter([S] * cfg.grad_accum), steps)[0] for S in lengths]


def table(case):
    """-> row(figure, value, note=""), which prints a figure of `case` and keeps it for the final
    table."""
    def row(figure, value, note=""):
        ROWS.append((case, figure, value, note))
        print(f"  {figure}: {value}" + (f"  ({note})" if note else ""), flush=True)
    return row


def cuda_times(fn, iters, warmup=2):
    """Milliseconds of each of iters calls of fn(), each synchronized, after `warmup` untimed ones.
    """
    times = []
    for _ in range(warmup + iters):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return times[warmup:]


def cuda_time(fn, iters, warmup=2):
    """Median milliseconds of fn() over iters calls."""
    return statistics.median(cuda_times(fn, iters, warmup))


def matmul_ceiling(n=8192):
    a, b = torch.randn(2, n, n, device="cuda", dtype=torch.bfloat16).unbind(0)
    return 2 * n ** 3 / (cuda_time(lambda: a @ b, 20, warmup=5) * 1e-3)


def mfu(flops, ms, ceiling):
    tf = flops / (ms * 1e-3)
    return (f"{tf / 1e12:.0f} TFLOP/s = {tf / ceiling:.0%} of measured matmul, "
            f"{tf / H200_PEAK:.0%} MFU(989)")


def bench_ceilings(args):
    row, x = table("ceilings"), torch.empty(4 * 2 ** 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)  # HBM: a device-to-device copy, bytes read + bytes written per second
    mm, hbm = matmul_ceiling(), 2 * x.numel() / (cuda_time(lambda: y.copy_(x), 10, warmup=3) * 1e-3)
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}")
    row("bf16 8192^3 matmul", f"{mm / 1e12:.0f} TFLOP/s",
        f"{mm / H200_PEAK:.0%} of the 989 datasheet")
    row("HBM copy (4 GiB, read + write)", f"{hbm / 1e12:.2f} TB/s",
        f"{hbm / 4.8e12:.0%} of the 4.8 datasheet")


def step_flops(cfg, S, anchors, keep, teacher=False):
    """Model FLOPs of one fwd+bwd+loss step, a matmul 2*m*n*k: layers 3x (fwd, input and weight
    grads), fc and the frozen LM head 2x (no input/weight grad), attention 3x over the keys each
    query row sees (exactly, from anchors); teacher: the target's logits through the LM head too,
    once (loss.HeadBridge computes each chunk's logits once)."""
    D, F, H, Hkv, hd, V = (cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads,
                           cfg.num_key_value_heads, cfg.head_dim, cfg.vocab_size)
    K, N = cfg.block_size, anchors.shape[0]
    Q = anchors.numel() * cfg.block_size  # block rows, padding ones too
    per_row = 2 * D * (2 * H * hd + 2 * Hkv * hd + 3 * F)  # q, o, k, v of block tokens + SwiGLU
    fl = 2 * S * N * len(cfg.target_layer_ids) * D * D * 2  # fc, 2x
    # + the context's k, v per layer
    fl += 3 * cfg.num_hidden_layers * (Q * per_row + S * N * 2 * D * 2 * Hkv * hd)
    j, p = torch.arange(K, device=anchors.device), anchors[:, :, None].float()
    for t in cfg.layer_types:  # visible keys per row: context + block part
        if t == "full_attention":
            vis = (p + K).expand(-1, -1, K)  # every row: p context keys + the whole block
        else:  # context [max(0, p+j-W+1), p) holds min(p, W-1-j) keys; causal block part j+1
            vis = torch.minimum(p, (cfg.sliding_window - 1 - j).float()).clamp(min=0) + j + 1
        fl += 3 * 2 * 2 * (vis * keep[:, :, None]).sum().item() * H * hd
    return fl + (2 + int(teacher)) * 2 * Q * D * V


def bench_drafter(args):
    """train.py's drafter step on random target states and frozen tables: forward + loss, +
    backward, peak memory, the optimizer step, the compile warm-up and the recompiles after it."""
    configure_compile()
    torch.manual_seed(0)
    cfg = config(args, args.preset)
    dcfg = drafter_config(cfg, args.preset)
    case = " ".join([f"drafter {args.preset}", *args.fields])
    row = table(case)
    dtype = getattr(torch, cfg.dtype)
    side = drafting(cfg, dcfg, random_states(dcfg, dtype, final_states(cfg, dcfg)))
    V, D, K = dcfg.vocab_size, dcfg.hidden_size, dcfg.block_size
    def steps(*lengths):  # -> ms of one micro-batch at each length, in a row
        return cuda_time(lambda: micro_steps(cfg, side, lengths), 1, warmup=0)
    ceiling, seqs = matmul_ceiling(), [int(s) for s in args.seq.split(",")]
    params = sum(p.numel() for p in side.drafter.parameters()) / 1e9
    print(f"{case}: {params:.3f}B params (+ frozen embed/head {2 * V * D / 1e9:.2f}B), "
          f"{cfg.num_anchors} anchors x {K}, matmul ceiling {ceiling / 1e12:.0f} TFLOP/s")
    # compile warm-up: the second length makes S symbolic
    warm_ms = steps(seqs[0], seqs[0] - 128, seqs[0])
    warm_graphs = compile_count()
    row("compile warm-up (3 steps, 2 lengths)", f"{warm_ms / 1e3:.1f} s, {warm_graphs} graphs")
    gen = torch.Generator("cuda").manual_seed(0)
    for S in seqs:
        batch, hidden, _ = side.source.get(S)  # micro-batch S: S tokens (RandomBatches)
        fl = step_flops(dcfg, S, *sample_anchors(batch["loss_mask"], cfg.num_anchors, gen),
                        teacher=final_states(cfg, dcfg))
        torch.cuda.reset_peak_memory_stats()
        side.drafter.zero_grad(set_to_none=True)
        ms_fwd = cuda_time(lambda: train.drafter_loss(cfg, side, batch, hidden, S), args.iters)
        ms = cuda_time(lambda: micro_steps(cfg, side, [S]), args.iters)
        row(f"S={S}: forward + loss", f"{ms_fwd:.1f} ms")
        row(f"S={S}: forward + backward + loss", f"{ms:.1f} ms",
            f"{fl / 1e12:.1f} TFLOP: {mfu(fl, ms, ceiling)}")
        peak, held = torch.cuda.max_memory_allocated() / GiB, optimizer_bytes(side.optim) / GiB
        moments = 8 * dcfg.num_params() / GiB
        row(f"S={S}: peak memory", f"{peak:.1f} GiB", f"the step alone {peak - held:.1f} GiB + "
            f"{held:.1f} GiB held by the optimizer (fp32 masters, flat gradient); AdamW's moments "
            f"add {moments:.1f} GiB from the first optimizer step on")
    S = seqs[0]
    ms_opt = cuda_time(lambda: side.optim.step(cfg.lr, 1.0), 10)
    row("optimizer step (train.Optimizer: flat fp32 gradient, norm, clip, fused AdamW, copy back)",
        f"{ms_opt:.1f} ms")
    if args.breakdown:
        ms_step = cuda_time(lambda: micro_steps(cfg, side, [S]), args.iters)
        breakdown(row, cfg, side, S, args.iters, ms_step)
        warm_graphs = compile_count()  # the standalone flex timed there compiled its own graphs
    steps(2048, 3072, 4096, 2560, 3968, 1024, S)  # new lengths after warm-up: must compile nothing
    row("recompiles after warm-up, S = 1024..4096 (7 lengths)", str(compile_count() - warm_graphs))
    if args.profile:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            steps(S, S, S)
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=15,
                                        max_name_column_width=60))


def breakdown(row, cfg, side, S, iters, ms_step):
    """Each part of the drafter step (ms_step ms) alone at its shapes (S tokens); the layers'
    matmuls and elementwise work are the rest."""
    dcfg = side.drafter.cfg
    K, W, Q = dcfg.block_size, dcfg.sliding_window, cfg.num_anchors * dcfg.block_size
    V, D = dcfg.vocab_size, dcfg.hidden_size
    batch, _, _ = side.source.get(S)
    gen = torch.Generator("cuda").manual_seed(0)
    anchors, keep = sample_anchors(batch["loss_mask"], cfg.num_anchors, gen)
    types = {t: dcfg.layer_types.count(t) for t in set(dcfg.layer_types)}
    build = lambda: build_masks(anchors, keep, S, K, list(types), W, "flex")  # noqa: E731
    ms_masks = sorted(cuda_times(build, 50))
    ms_mask = statistics.median(ms_masks)
    windows = [W if t != "full_attention" else None for t in types]
    ms_eager = cuda_time(lambda: [dflash_block_mask(anchors, keep, S, K, w, compiled=False)
                                  for w in windows], 20)
    row("BlockMask build, both layer types: eager construction -> compiled (used)",
        f"{ms_eager:.2f} -> {ms_mask:.2f} ms",
        f"min / median / max of 50: {ms_masks[0]:.2f} / {ms_mask:.2f} / {ms_masks[-1]:.2f} ms")
    masks = build_masks(anchors, keep, S, K, list(types), W, "flex")
    grad = dict(device="cuda", dtype=torch.bfloat16, requires_grad=True)
    q = torch.randn(1, dcfg.num_attention_heads, Q, dcfg.head_dim, **grad)
    kv = [torch.randn(1, dcfg.num_key_value_heads, S + Q, dcfg.head_dim, **grad) for _ in "kv"]

    def attention(t):  # flex forward + backward of one layer type
        flex_compiled(q, *kv, block_mask=masks[t], enable_gqa=True).sum().backward()
    ms_attn = sum(n * cuda_time(lambda: attention(t), iters) for t, n in types.items())
    out, labels = torch.randn(Q, D, **grad), torch.randint(0, V, (Q,), device="cuda")
    opts = side.opts
    # the target's final states at the rows, when the loss reads them (kd_loss, confidence head)
    teacher = torch.randn(Q, D, device="cuda", dtype=torch.bfloat16)
    rows = Rows(out_MD=out, labels_M=labels, valid_M=torch.ones_like(labels, dtype=torch.bool),
                decay_M=torch.rand(Q, device="cuda"), prev_M=labels, prefix_MG=None, K=K,
                teacher_MD=teacher if final_states(cfg, dcfg) else None,
                chunk_rows=(cfg.loss_chunk or cfg.num_anchors) * K)
    head = side.tables.head_VD
    ms_head = cuda_time(lambda: head_loss(rows, head, side.drafter, opts)[0].backward(), iters)
    attn = " + ".join(f"{n} {t[:-10]}" for t, n in types.items())
    rest = ms_step - ms_mask - ms_attn - ms_head
    for name, t in (("BlockMask build (both layer types)", ms_mask),
                    (f"flex attention fwd+bwd ({attn})", ms_attn),
                    ("LM head + loss fwd+bwd (loss.head_loss)",
                     ms_head),
                    ("projections, MLP, norms, RoPE, fc, embedding (the rest)", rest)):
        row(f"breakdown S={S}: {name}", f"{t:.1f} ms", f"{t / ms_step:.0%} of {ms_step:.1f} ms")


def build_target(name, fla_conv=True):
    """Random bf16 CausalLM on the GPU from the config -> (model, layer ids, shapes, kernels note).
    """
    from transformers import AutoConfig, AutoModelForCausalLM
    (model_type, conf, ids, shapes), kernels = TARGETS[name], "sdpa"
    if name == "27b":
        try:  # flash-linear-attention kernels for the Gated-DeltaNet layers
            import fla
            kernels = "fla " + fla.__version__
        except ImportError:
            kernels = "torch fallback (no flash-linear-attention)"
    torch.manual_seed(0)
    with torch.device("cuda"):
        config = AutoConfig.for_model(model_type, **conf)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    if fla_conv and fla_short_conv(model):  # as target.load_for_capture
        kernels += ", its short convolution too"
    return model.eval().requires_grad_(False), ids, shapes, kernels


def truncate(decoder, keep):
    """What target.load_for_capture builds: the decoder up to the deepest captured layer."""
    decoder.layers, decoder.config.num_hidden_layers = decoder.layers[:keep], keep
    if getattr(decoder.config, "layer_types", None):
        decoder.config.layer_types = decoder.config.layer_types[:keep]
    return decoder


def layer_split(decoder, fn, iters):
    """-> {part: ms per fn() call} inside each kind of decoder-layer part (linear_attn:
    Gated-DeltaNet, self_attn, mlp, norms) and inside that part's linears ("<part> linears"), from
    CUDA events around every call."""
    spans, handles = collections.defaultdict(list), []

    def time_it(module, part):
        def pre(*_):
            events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            spans[part].append(events)
            spans[part][-1][0].record()
        handles.extend([module.register_forward_pre_hook(pre),
                        module.register_forward_hook(lambda *_: spans[part][-1][1].record())])
    for layer in decoder.layers:
        for name, child in layer.named_children():
            part = "norms" if "norm" in name else name
            time_it(child, part)
            for m in child.modules():
                if isinstance(m, (torch.nn.Linear, Float8Frozen)) and part != "norms":
                    time_it(m, f"{part} linears")
    fn()  # warm-up, untimed
    torch.cuda.synchronize()
    spans.clear()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    for h in handles:
        h.remove()
    return {part: sum(a.elapsed_time(b) for a, b in pairs) / iters for part, pairs in spans.items()}


def target_rows(row, label, dec, cap, B, S, iters):
    """Where the capture path's time goes (layer_split), each part and what is left of it outside
    its linears."""
    x = torch.randint(0, dec.config.vocab_size, (B, S), device="cuda")
    total, split = cuda_time(lambda: cap(x), iters), layer_split(dec, lambda: cap(x), iters)
    for part, ms in sorted(split.items(), key=lambda kv: -kv[1]):
        lin = split.get(f"{part} linears") if not part.endswith("linears") else None
        note = f"{ms / total:.0%} of {total:.0f} ms"
        note += f"; outside its linears {ms - lin:.1f} ms" if lin else ""
        row(f"{label} B={B} S={S}: time in {part}", f"{ms:.1f} ms", note)


def token_rate(fn, vocab, B, S, iters):
    """-> (ms, tokens/s) of fn on random [B, S] token ids."""
    x = torch.randint(0, vocab, (B, S), device="cuda")
    ms = cuda_time(lambda: fn(x), iters)
    return ms, B * S / (ms * 1e-3)


def target_flops(dec, n_layers, B, S):
    """2 per weight per token of the layers run + causal attention (QK^T, PV over S/2 keys)."""
    c, body = dec.config, sum(p.numel() for p in dec.layers[:n_layers].parameters())
    types = getattr(c, "layer_types", None) or ["full_attention"] * n_layers
    n_attn = types[:n_layers].count("full_attention")
    return B * S * (2 * body + n_attn * 2 * 2 * (S / 2) * c.num_attention_heads * c.head_dim)


def bench_target(args):
    """The target's forward on random weights: the bare HF decoder, and train.py's capture path (its
    first layers, hooks); then the target as the Config changes it (train.target_variants, e.g.
    --target_fp8=true) against bf16. --breakdown: the time per layer part; --profile: the kernels.
    """
    if args.no_fla:  # hide flash-linear-attention from transformers' availability check
        sys.modules["fla"] = None
    cfg = config(args, args.model)
    model, ids, shapes, kernels = build_target(args.model, not args.torch_conv)
    case, dec = f"target {args.model} ({kernels})", model.get_decoder()
    ceiling, row = matmul_ceiling(), table(case)
    L, keep = dec.config.num_hidden_layers, max(ids) + 1  # layers, the layers the capture path runs
    params = sum(p.numel() for p in dec.layers.parameters()) / 1e9
    print(f"{case}: {L} layers, {params:.2f}B layer params; ours runs layers 0..{keep - 1} and "
          f"captures {ids}; matmul ceiling {ceiling / 1e12:.0f} TFLOP/s")
    rate = lambda fn, B, S: token_rate(fn, dec.config.vocab_size, B, S, args.iters)  # noqa: E731
    bare = {}
    for B, S in shapes:  # bare HF: the whole decoder stack, no hooks, no LM head (no logits needed)
        ms, bare[B, S] = rate(lambda x: dec(input_ids=x, use_cache=False), B, S)
        row(f"B={B} S={S}: bare HF decoder forward, {L} layers", f"{bare[B, S]:.0f} tok/s",
            mfu(target_flops(dec, L, B, S), ms, ceiling))
    cap = Capture(truncate(dec, keep), ids)
    for B, S in shapes:
        ms, tps = rate(cap, B, S)
        row(f"B={B} S={S}: capture path (train.py), {keep} layers + hooks", f"{tps:.0f} tok/s",
            f"{tps / bare[B, S]:.0%} of bare; {mfu(target_flops(dec, keep, B, S), ms, ceiling)}")
    if args.breakdown:
        target_rows(row, "bf16", dec, cap, *shapes[0], args.iters)
    if args.profile:  # the kernels: Gated-DeltaNet's (fla or torch), the short convolution, GEMMs
        x = torch.randint(0, dec.config.vocab_size, shapes[0], device="cuda")
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            cap(x)
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=20,
                                        max_name_column_width=70))
    row("peak memory", f"{torch.cuda.max_memory_allocated() / 2 ** 30:.1f} GiB")
    x = torch.randint(0, dec.config.vocab_size, shapes[0], device="cuda")
    ref_BSC = cap(x).float()
    n8 = train.target_variants(cfg, dec)
    if n8:  # the Config's target (FP8 linears): its captured states against bf16's, its speed
        err = [((a.float() - b).norm() / b.norm()).item()
               for a, b in zip(cap(x).chunk(len(ids), -1), ref_BSC.chunk(len(ids), -1))]
        row(f"FP8 target ({n8} linears): captured states against bf16, relative error per captured "
            f"layer", " / ".join(f"{e:.3f}" for e in err), f"layers {ids}")
        for B, S in shapes:
            ms, tps = rate(cap, B, S)
            row(f"B={B} S={S}: capture path with the FP8 target", f"{tps:.0f} tok/s",
                f"{tps / bare[B, S]:.0%} of bare")
        if args.breakdown:
            target_rows(row, "fp8", dec, cap, *shapes[0], args.iters)
        row("peak memory with the FP8 target",
            f"{torch.cuda.max_memory_allocated() / 2 ** 30:.1f} GiB")
        return  # train.py refuses FSDP2 with an FP8 target
    if args.model == "8b":
        (B, S), (_, tps) = shapes[0], fsdp_rate(dec, lambda: rate(cap, *shapes[0]))
        row(f"B={B} S={S}: capture path, FSDP2 on a 1-GPU mesh", f"{tps:.0f} tok/s",
            f"{tps / bare[B, S]:.0%} of bare")


def fsdp_rate(dec, rate):
    """rate() with the decoder sharded by FSDP2 on a 1-GPU mesh: the wrapper's cost (one rank's
    all-gather is a copy)."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    dist.init_process_group("nccl", init_method="tcp://127.0.0.1:29533", world_size=1, rank=0)
    for module in [*dec.layers, dec]:  # each layer, then the root
        fully_shard(module, reshard_after_forward=True)
    try:
        return rate()
    finally:
        dist.destroy_process_group()


def bench_fp8_states(args):
    """The captured states of the target as train.py builds it for the Config
    (train.target_variants; this case's default: --target_fp8=true) and of the bf16 target, each
    against the fp32 target's, per captured layer, on a real target and real text; bf16's distance
    is the error bf16 training already takes. Default: the demo's target (SmolLM2) on chitchat
    conversations (--target=, --data=). CPU or CUDA: torch._scaled_mm takes the same e4m3 operands
    on both."""
    from data import default_cache_dir, read_conversations, tokenize_conversation, write_chitchat
    # this case's defaults, then the command line's fields
    cfg = parsed(["--preset=demo", "--target_fp8=true", *args.fields])
    dev, row = "cuda" if torch.cuda.is_available() else "cpu", table("fp8 target states")
    given = {a.split("=")[0] for a in args.fields}
    data = cfg.data if "--data" in given else write_chitchat(default_cache_dir())[0]
    convs = read_conversations(data, skip_invalid=True)[0]
    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "fp8": torch.bfloat16}
    models = {k: load_for_generation(cfg.target, dev, dt)[0].get_decoder()
              for k, dt in dtypes.items()}
    n8, L = train.target_variants(cfg, models["fp8"]), models["fp8"].config.num_hidden_layers
    ids = build_target_layer_ids(L, 5)
    caps, tok = {k: Capture(m, ids) for k, m in models.items()}, load_tokenizer(cfg.target)
    err = {k: [[] for _ in ids] for k in ("bfloat16", "fp8")}  # per captured layer: per token
    for conv in convs[:args.convs]:
        x = torch.tensor([tokenize_conversation(tok, conv, args.seq_e2e)[0]], device=dev)
        ref = caps["float32"](x).chunk(len(ids), -1)
        for k in err:
            for e, a, b in zip(err[k], caps[k](x).float().chunk(len(ids), -1), ref):
                # one relative error per token
                e.append(((a - b).norm(dim=-1) / b.norm(dim=-1)).flatten())
    tokens = sum(len(t) for t in err["fp8"][0])
    print(f"{cfg.target}: {L} layers, captured {ids}, {n8} linears in FP8, "
          f"{min(args.convs, len(convs))} conversations, {tokens} tokens, {dev}")
    for k, label in (("bfloat16", "bf16 target"), ("fp8", f"train.py's target ({n8} FP8 linears)")):
        med = [torch.cat(e).median().item() for e in err[k]]
        row(f"{label} vs fp32: median relative error per token, per captured layer",
            " / ".join(f"{m:.4f}" for m in med), f"layers {ids}")


def bench_e2e(args):
    """train.py's colocated step on random data and a random target: the capture
    (ranks.Colocated, synchronized to time the target), anchors, loss and backward
    (train.accumulate), the optimizer step; the target as the Config changes it
    (train.target_variants)."""
    configure_compile()
    cfg = config(args, args.model)
    model, layer_ids, _, kernels = build_target(args.model)
    cap = Capture(truncate(model.get_decoder(), max(layer_ids) + 1), layer_ids)
    n8 = train.target_variants(cfg, cap.base)
    kernels += f", {n8} target linears in FP8" if n8 else ""
    tables = (model.get_decoder().embed_tokens.weight, model.lm_head.weight)
    side = drafting(cfg, drafter_config(cfg, args.model), cap, tables)
    S, row = args.seq_e2e, table(" ".join([f"e2e colocated {args.model}", *args.fields]))
    split = []  # per step: ms of the target, of the drafter (with the optimizer)

    def step(i):  # two lengths: S, S - 128
        s = micro_steps(cfg, side, [S - 128 * (i % 2)])[0]
        t0 = time.perf_counter()
        side.optim.step(cfg.lr, s["weight_sum"].item())
        torch.cuda.synchronize()
        optimizer_s = time.perf_counter() - t0
        split.append((1e3 * s["target_s"].item(), 1e3 * (s["drafter_s"].item() + optimizer_s)))
    def steps(n):  # -> seconds of n steps in a row
        return cuda_time(lambda: [step(i) for i in range(n)], 1, warmup=0) / 1e3
    steps(4)  # warm-up: compiles
    warm, wall = compile_count(), steps(args.iters)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        profiled = steps(3)
    busy = sum(e.self_device_time_total for e in prof.key_averages()) / 1e6 / profiled
    t_t, t_d = (statistics.mean(x) for x in zip(*split[4:4 + args.iters]))  # past the warm-up
    tokens = sum(S - 128 * (i % 2) for i in range(args.iters)) * cfg.batch_size
    row(f"S={S}/{S - 128}, {cfg.num_anchors} anchors: throughput", f"{tokens / wall:.0f} tok/s",
        f"{args.iters / wall:.2f} steps/s, target {kernels}")
    row("time split per step: target / drafter (+optimizer)", f"{t_t:.0f} / {t_d:.0f} ms",
        f"{t_t / (t_t + t_d):.0%} / {t_d / (t_t + t_d):.0%}")
    row("GPU busy (kernel time / wall, profiler)", f"{busy:.0%}")
    row("peak memory / recompiles after warm-up",
        f"{torch.cuda.max_memory_allocated() / 2 ** 30:.1f} GiB / {compile_count() - warm}")


def bench_decode(args):
    """eval.py's decoding loops on a random SmolLM2 (block 16, ~1 token per cycle), bf16, batch 1,
    twice (the second pass repeats every shape), with eval's NO_CUDNN and without ('torch default':
    cuDNN plans each new key length)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    dev, row = "cuda" if torch.cuda.is_available() else "cpu", table("decode")
    target = LlamaForCausalLM(LlamaConfig(**SMOLLM2)).to(dev, torch.bfloat16).eval()
    dcfg = drafter_config(config(args, "smol"), "smol")
    drafter = DFlashDrafter(dcfg).to(dev, torch.bfloat16).eval()
    prompt, n = torch.randint(100, 40000, (200,)).tolist(), args.new_tokens
    unwrapped = lambda f: torch.inference_mode()(inspect.unwrap(f))  # noqa: E731 (no decorators)
    ev.spec_decode(target, drafter, prompt, 16, ev.Decoding(32))  # warm-up
    for label, spec, plain in (("eval (no cuDNN)", ev.spec_decode, ev.plain_decode),
                               ("torch default", unwrapped(ev.spec_decode),
                                unwrapped(ev.plain_decode))):
        for rep in (1, 2):
            t = dict.fromkeys(report.TIME_KEYS, 0.0)
            c = len(spec(target, drafter, prompt, 16, ev.Decoding(n), times=t)[1])  # verify cycles
            out = plain(target, prompt, ev.Decoding(n), times=t)
            cycle = ("draft", "verify", "other")
            row(f"{label}, pass {rep}: spec cycle, block 16",
                f"{1e3 * sum(t[k] for k in cycle) / c:.1f} ms",
                ", ".join(f"{k} {1e3 * t[k] / c:.1f}" for k in cycle))
            plain_s = t["plain_prefill"] + t["plain_step"]
            row(f"{label}, pass {rep}: plain step", f"{1e3 * plain_s / len(out):.1f} ms")


def _regen_worker(rank, world, args, prompts, out, barrier):
    """bench_regen's process `rank`: its shard of the prompts through data._generate by each
    method, twice, every process starting each pass together; the figures (and the answers) to
    out/<rank>.json."""
    import data
    dev = f"cuda:{rank % torch.cuda.device_count()}" if torch.cuda.is_available() else "cpu"
    models, mine, res = {}, prompts[rank::world], []
    for cache, batch_tokens in regen_methods(args):
        attention = (data.generation_attention(cache) if args.attention == "auto"
                     else args.attention)
        if attention not in models:
            models[attention] = load_for_generation(args.target, dev, attention=attention)
        model, tok = models[attention]
        for rep in (1, 2):  # pass 1 compiles what the static cache compiles
            torch.manual_seed(rank)
            barrier.wait()  # the processes time the same method at the same time
            t0 = time.perf_counter()
            answers, tokens, unfinished, _ = data._generate(  # synced: .tolist()
                model, tok, mine, data.RegenOptions(max_new_tokens=args.new_tokens,
                                                    temperature=args.temperature, cache=cache,
                                                    batch_tokens=batch_tokens))
            res.append(dict(cache=cache, rep=rep, tokens=tokens, seconds=time.perf_counter() - t0,
                            unfinished=unfinished, answers=answers,
                            graphs=torch._dynamo.utils.counters["stats"]["unique_graphs"]))
    with open(os.path.join(out, f"{rank}.json"), "w") as f:
        json.dump(res, f)


def regen_methods(args):
    """--caches x --batch_tokens -> [(cache, tokens per generate call)]: the padded caches at each
    budget, continuous batching once (it plans its own batches)."""
    budgets = [int(b) for b in str(args.batch_tokens).split(",")]  # 0: data.generate_budget
    return [(c, b) for c in args.caches.split(",") for b in (budgets[:1] if c == "continuous"
                                                             else budgets)]


def bench_regen(args):
    """Regeneration as data.py runs it (data._generate) of the same --n prompts by each method of
    --caches: the dynamic KV cache (the before), the static one (transformers compiles the target's
    forward on a GPU: CUDA graphs), transformers' continuous batching (generate_batch); in --procs
    processes sharing the GPU(s), each a shard, each method twice (pass 1 compiles). Generated
    tokens (answers up to and including eos) over the slowest process's time. Default: the demo's
    target and its train prompts (made here if need be, without network: the GGUF is converted
    locally)."""
    import tempfile
    from data import (default_cache_dir, demo_prompts, demo_settings, read_conversations,
                      spawn_workers)
    from target import convert_gguf, smollm2_gguf
    cache = default_cache_dir()
    given = dict(f[2:].split("=", 1) for f in args.fields)  # --target=, --data=: train.py's fields
    args.target = given.get("target") or str(convert_gguf(smollm2_gguf(),
                                                            cache / "smollm2-135m-instruct"))
    path = given.get("data") or demo_prompts(cache, demo_settings("cuda")["corpus"],
                                     load_tokenizer(args.target))["train"]
    convs = read_conversations(path, require_assistant=False)[0][:args.n]
    firsts = [next(i for i, m in enumerate(c) if m["role"] == "user") for c in convs]
    prompts = [c[:i + 1] for c, i in zip(convs, firsts)]  # up to the first user turn
    with tempfile.TemporaryDirectory() as out:
        barrier = torch.multiprocessing.get_context("spawn").Barrier(args.procs)
        spawn_workers(_regen_worker, args.procs, (args.procs, args, prompts, out, barrier))
        res = [json.load(open(os.path.join(out, f"{r}.json"))) for r in range(args.procs)]
    row, rate, answers = table(f"regen {len(prompts)} prompts of {path}"), {}, {}
    names = [c if c == "continuous" else f"{c} cache, {b or 'auto'} tokens a call" for c, b in
             regen_methods(args)]
    for i, first in enumerate(res[0]):
        runs, key = [r[i] for r in res], (names[i // 2], first["rep"])
        tokens, secs = sum(r["tokens"] for r in runs), max(r["seconds"] for r in runs)
        rate[key], answers[key[0]] = tokens / secs, [a for r in runs for a in r["answers"]]
        cut, graphs = sum(r["unfinished"] for r in runs), max(r["graphs"] for r in runs)
        row(f"{key[0]}, pass {key[1]}: generated tok/s, {args.procs} processes",
            f"{tokens / secs:.0f}", f"{tokens} tokens in {secs:.1f} s, {cut} answers at "
            f"{args.new_tokens} tokens, {graphs} compiled graphs per process")
    for other in names[1:]:  # each against the first method (the before)
        same = sum(a == b for a, b in zip(answers[other], answers[names[0]]))
        row(f"{other} / {names[0]}, pass 2", f"{rate[other, 2] / rate[names[0], 2]:.2f}x",
            f"{same} of {len(prompts)} answers identical"
            + " (greedy: equal but where rounding flips a near-tie)" * (args.temperature == 0))


def bench_plan(args):
    """The start-up estimate (ranks.memory_need, as train.py --plan prints it) against the
    measured peak of train.py's own step (train.build_drafting, train.accumulate, the optimizer):
    --preset 27b, a drafter rank on full-length target states at each --seq; --preset smol, the demo
    colocated on one GPU (its cuda settings). One setting per process: compiled layers of another
    shape in the same process would recompile as dynamic."""
    from transformers import AutoConfig, LlamaConfig, LlamaForCausalLM
    configure_compile()
    row = table("plan: estimate vs measured peak")

    def measure(cfg, dcfg, capture):  # -> GiB peak allocated over 3 steps, a run's state included
        side = drafting(cfg, dcfg, capture)
        for s in micro_steps(cfg, side, [cfg.max_length] * 3):
            side.optim.step(cfg.lr, s["weight_sum"].item())
        return torch.cuda.max_memory_allocated() / GiB
    if args.preset == "27b":
        tc27 = AutoConfig.for_model(TARGETS["27b"][0], **QWEN36_27B)
        for S in (int(s) for s in args.seq.split(",")):
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            cfg = parsed([*PRESETS["27b"][1], *args.fields, f"--max_length={S}"])
            dcfg = drafter_config(cfg, "27b")
            est = memory_need(cfg, dcfg, tc27, 8)["drafter"]
            states = random_states(dcfg, getattr(torch, cfg.dtype), final_states(cfg, dcfg))
            got = measure(cfg, dcfg, states)
            row(f"27B drafter rank, S={S}, {cfg.num_anchors} anchors",
                f"{est:.2f} vs {got:.2f} GiB", f"{est / got - 1:+.1%}")
    if args.preset != "smol":
        return
    cfg = parsed(["--preset=demo", "--device=cuda", *args.fields])
    dcfg, tc = drafter_config(cfg, "smol"), LlamaConfig(**SMOLLM2)
    target = LlamaForCausalLM(tc).to("cuda", torch.bfloat16).eval().requires_grad_(False)
    decoder = truncate(target.get_decoder(), max(dcfg.target_layer_ids) + 1)
    est = memory_need(cfg, dcfg, tc, 1)["target+drafter"]
    got = measure(cfg, dcfg, Capture(decoder, dcfg.target_layer_ids))
    row(f"demo colocated, S={cfg.max_length} x {cfg.batch_size}, {cfg.num_anchors} anchors",
        f"{est:.2f} vs {got:.2f} GiB", f"{est / got - 1:+.1%}")


CASES = ["ceilings", "drafter --preset 27b --seq 4096,2048 --breakdown",
         "drafter --preset 27b --compile=false", "drafter --preset 8b --seq 3072 --breakdown",
         "target --model 8b", "target --model 27b", "e2e --model 8b",
         "target --model 27b --no_fla",  # 7: only when asked
         "decode", "plan --seq 4096", "plan --seq 2048", "plan --preset smol",
         "drafter --preset 27b --fp8=tensorwise --fp8_head=true --breakdown",
         "drafter --preset 8b --seq 3072 --fp8=tensorwise --fp8_head=true --breakdown",
         "drafter --preset 27b --fp8=rowwise --fp8_head=true --breakdown",
         "drafter --preset 27b --fp8_head=true --breakdown",
         "drafter --preset 27b --fp8=tensorwise",
         "target --model 27b --breakdown --profile --target_fp8=true",
         "target --model 8b --breakdown --target_fp8=true",
         "e2e --model 8b --fp8=tensorwise --fp8_head=true",
         "e2e --model 8b --fp8=tensorwise --fp8_head=true --target_fp8=true",
         "target --model 27b --torch_conv"]



def run_all(args):
    """Every case in a fresh process (no compile state, memory or fla import shared), then one
    table."""
    rows, failed, out = [], [], f"/tmp/bench-{os.getpid()}.json"
    cases = [CASES[int(i)] for i in args.cases.split(",")] if args.cases else CASES[:7] + CASES[8:]
    for case in cases:
        print(f"\n$ python bench.py {case}", flush=True)
        cmd = [sys.executable, __file__, *case.split(), *args.fields, "--json", out]
        try:
            subprocess.run(cmd, timeout=args.case_timeout, check=True)
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired):
            failed.append(case)
        if os.path.exists(out):
            with open(out) as f:
                rows += json.load(f)
            os.remove(out)
    print("\n| case | figure | value | against |\n|---|---|---|---|",
          *(f"| {' | '.join(r)} |" for r in rows), sep="\n")
    if failed:
        raise SystemExit(f"failed cases: {failed}")


def main(argv=None):
    benches = dict(all=run_all, ceilings=bench_ceilings, drafter=bench_drafter, target=bench_target,
                   e2e=bench_e2e, decode=bench_decode, plan=bench_plan, fp8states=bench_fp8_states,
                   regen=bench_regen)
    fields = ("Config fields: --field=value (train.py's Config), e.g. --fp8=tensorwise "
              "--fp8_head=true --markov_rank=32 --num_anchors=512 --loss_chunk=64 --compile=false "
              "--target_fp8=true")
    ap = argparse.ArgumentParser(description=__doc__, epilog=fields, allow_abbrev=False,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", nargs="?", default="all", choices=list(benches))
    ap.add_argument("--preset", default="27b", choices=list(PRESETS),
                    help="drafter, plan: whose drafter")
    ap.add_argument("--model", default="8b", choices=list(TARGETS), help="target, e2e: the target")
    for flag, default, help in (
            ("--seq", "4096", "drafter, plan: comma-separated sequence lengths"),
            ("--iters", 8, None),
            ("--cases", "", "all: indices into CASES, e.g. 0,1,2; default all but 7"),
            ("--json", "", "also write the rows here"),
            ("--case_timeout", 300, "all: seconds per case"),
            ("--new_tokens", 128, "decode, regen: new tokens"),
            ("--seq_e2e", 3072, "e2e: tokens per sequence; fp8states: per conversation"),
            ("--convs", 32, "fp8states: conversations"),
            ("--n", 2048, "regen: prompts"),
            ("--procs", 2, "regen: processes (on all GPUs)"),
            ("--caches", "dynamic,static,continuous", "regen: data._generate's caches, in order"),
            ("--temperature", 0.0, "regen: 0 = greedy"),
            ("--batch_tokens", "0", "regen: prompt + answer tokens per generate call of the padded "
             "caches, a list to sweep (0: data.generate_budget, by the free memory)"),
            ("--attention", "auto", "regen: the target's attention, sdpa | sdpa_grouped_decode "
             "(auto: data.generation_attention of each cache, as data.py regenerates)")):
        # a str or an int, as its default
        ap.add_argument(flag, type=type(default), default=default, help=help)
    for flag, help in (("--breakdown", "drafter, target: the time of each part"),
                       ("--profile", "drafter, target"),
                       ("--no_fla", "27b: transformers' torch fallback kernels"),
                       ("--torch_conv", "target 27b: the short convolution in transformers' torch "
                                        "path, fla elsewhere")):
        ap.add_argument(flag, action="store_true", help=help)
    args, args.fields = ap.parse_known_args(argv)
    train.parse_config(args.fields)  # a bad Config field stops here, named, before any GPU work
    try:
        benches[args.what](args)
    finally:
        if args.json:
            with open(args.json, "w") as f:
                json.dump(ROWS, f)


if __name__ == "__main__":
    main()
