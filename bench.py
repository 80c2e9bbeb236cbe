"""
GPU benchmarks that print figures against ceilings measured in the same run (results go to BENCHMARKS.md with date,
hardware, commit and command). Random weights built from configs: no checkpoint is needed.

    python bench.py                          # every case below, each in its own process, then one table
    python bench.py ceilings                 # bf16 matmul rate, HBM copy bandwidth
    python bench.py drafter --preset 27b --seq 4096,2048 --breakdown   # drafter fwd+bwd step, where the time goes
    python bench.py drafter --preset 27b --eager                       # the same with the layers uncompiled
    python bench.py drafter --preset 8b --seq 3072
    python bench.py target --model 8b        # bare HF forward vs our capture path (and FSDP on a 1-GPU mesh)
    python bench.py target --model 27b [--no-fla]
    python bench.py e2e --model 8b           # colocated target forward + drafter step on one GPU
    python bench.py decode                   # eval.py's batch-1 loop, ms per cycle, with and without cuDNN attention

Timing is honest (STYLE.md §11): compile and warm up first, synchronize before reading the clock, median of several
runs. MFU is against the bf16 matmul measured in the same process and against the 989 TFLOP/s datasheet.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch

from attention import _flex_compiled, build_masks, compile_count, configure_compile, dflash_block_mask
from model import DFlashDrafter, DrafterConfig, HeadCE, dflash_loss, sample_anchors

PRESETS = {
    # Qwen3.6-27B drafter (DFLASH_SPEC §1.6): 5 layers, 4 sliding(2048) + 1 full, 5 target layers
    "27b": dict(hidden_size=5120, intermediate_size=17408, num_hidden_layers=5, num_attention_heads=32,
                num_key_value_heads=8, head_dim=128, vocab_size=248320, rope_theta=1e7, block_size=16,
                target_layer_ids=[1, 16, 31, 46, 61], num_target_layers=64, mask_token_id=248070,
                layer_types=["sliding_attention"] * 4 + ["full_attention"], sliding_window=2048),
    # Qwen3-8B drafter (z-lab Qwen3-8B-DFlash-b16 layout): 5 full-attention layers, ids by the released rule
    "8b": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=5, num_attention_heads=32,
               num_key_value_heads=8, head_dim=128, vocab_size=151936, rope_theta=1e6, block_size=16,
               target_layer_ids=[1, 9, 17, 25, 33], num_target_layers=36, mask_token_id=151669),
    # SmolLM2-135M-Instruct drafter (the demo)
    "smol": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=5, num_attention_heads=9,
                 num_key_value_heads=3, head_dim=64, vocab_size=49152, rope_theta=1e5, block_size=16,
                 target_layer_ids=[1, 8, 14, 20, 27], num_target_layers=30, mask_token_id=16),
}
H200_PEAK = 989e12  # dense bf16 FLOP/s, datasheet
ROWS = []  # (case, figure, value, "vs ceiling") for the final table


def row(case, figure, value, note=""):
    ROWS.append((case, figure, value, note))
    print(f"  {figure}: {value}" + (f"  ({note})" if note else ""), flush=True)


def cuda_time(fn, iters, warmup=2):
    """Median milliseconds of fn() over iters calls, each synchronized."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def matmul_ceiling(n=8192):
    a, b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16), torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    ms = cuda_time(lambda: a @ b, 20, warmup=5)
    return 2 * n ** 3 / (ms * 1e-3)


def copy_ceiling(gib=4):
    """HBM bandwidth of a plain device-to-device copy: bytes read + bytes written per second."""
    x = torch.empty(gib * 2 ** 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    ms = cuda_time(lambda: y.copy_(x), 10, warmup=3)
    return 2 * x.numel() / (ms * 1e-3)


def mfu(flops, ms, ceiling):
    tf = flops / (ms * 1e-3)
    return f"{tf / 1e12:.0f} TFLOP/s = {tf / ceiling:.0%} of measured matmul, {tf / H200_PEAK:.0%} MFU(989)"


def bench_ceilings(args):
    mm, hbm = matmul_ceiling(), copy_ceiling()
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}")
    row("ceilings", "bf16 8192^3 matmul", f"{mm / 1e12:.0f} TFLOP/s", f"{mm / H200_PEAK:.0%} of the 989 datasheet")
    row("ceilings", "HBM copy (4 GiB, read + write)", f"{hbm / 1e12:.2f} TB/s", f"{hbm / 4.8e12:.0%} of the 4.8 datasheet")

# -----------------------------------------------------------------------------
# drafter training step


def step_flops(cfg, S, anchors, keep):
    """Model FLOPs of one drafter fwd+bwd+loss step (no recompute counted). Forward matmul = 2*m*n*k.
    Trainable layers 3x (fwd, input grad, weight grad); fc 2x (its input, the target states, needs no grad);
    frozen LM head 2x (fwd + input grad); attention 3x of QK^T + PV over the keys each query row may see,
    counted exactly from the anchors."""
    D, F, H, Hkv, hd, V = (cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads,
                           cfg.num_key_value_heads, cfg.head_dim, cfg.vocab_size)
    K = cfg.block_size
    Q = anchors.numel() * K  # block rows (padding blocks are computed too)
    nK = len(cfg.target_layer_ids)
    per_row = 2 * D * (2 * H * hd + 2 * Hkv * hd + 3 * F)  # q, o, k, v of block tokens + SwiGLU
    per_ctx = 2 * D * 2 * Hkv * hd  # each layer projects the context to k, v
    fl = 2 * S * anchors.shape[0] * nK * D * D * 2  # fc, 2x
    fl += 3 * cfg.num_hidden_layers * (Q * per_row + S * anchors.shape[0] * per_ctx)
    j = torch.arange(K, device=anchors.device)
    p = anchors[:, :, None].float()
    for t in cfg.layer_types:  # visible keys per row: context + block part
        if t == "full_attention":
            vis = (p + K).expand(-1, -1, K)  # every row: p context keys + the whole block
        else:
            # context [max(0, p+j-W+1), p) holds min(p, W-1-j) keys; causal block part j+1
            vis = torch.minimum(p, (cfg.sliding_window - 1 - j).float()).clamp(min=0) + j + 1
        vis = (vis * keep[:, :, None]).sum().item()
        fl += 3 * 2 * 2 * vis * H * hd
    fl += 2 * 2 * Q * D * V
    return fl


def optimizer_ms(drafter):
    """AdamW over fp32 master copies, as the trainer does (bf16 weights, fp32 state), + the copy back."""
    masters = [p.detach().float().requires_grad_() for p in drafter.parameters()]
    for m, p in zip(masters, drafter.parameters()):
        m.grad = p.grad.float()
    opt = torch.optim.AdamW(masters, lr=6e-4, fused=True)

    def opt_step():
        opt.step()
        with torch.no_grad():
            torch._foreach_copy_(list(drafter.parameters()), masters)
    return cuda_time(opt_step, 10)


def bench_drafter(args):
    configure_compile()
    torch.manual_seed(0)
    dev, case = "cuda", f"drafter {args.preset}" + (" eager layers" if args.eager else "")
    cfg = DrafterConfig(**PRESETS[args.preset])
    drafter = DFlashDrafter(cfg).to(dev, torch.bfloat16)
    drafter.compile_layers = not args.eager
    n_params = sum(p.numel() for p in drafter.parameters())
    V, D, K = cfg.vocab_size, cfg.hidden_size, cfg.block_size
    embed = torch.randn(V, D, device=dev, dtype=torch.bfloat16) * 0.02
    head = torch.randn(V, D, device=dev, dtype=torch.bfloat16) * 0.02
    gen = torch.Generator(dev).manual_seed(0)

    def batch(S):
        ids = torch.randint(0, V, (1, S), device=dev)
        lm = torch.zeros(1, S, device=dev)
        lm[:, S // 4:] = 1  # a quarter prompt, the rest response
        hidden = torch.randn(1, S, len(cfg.target_layer_ids) * D, device=dev, dtype=torch.bfloat16)
        return ids, lm, hidden

    def step(ids, lm, hidden, backward=True):
        anchors, keep = sample_anchors(lm, args.anchors, gen)
        r = dflash_loss(drafter, embed, head, ids, lm, hidden, anchors, keep, gamma=7.0, backend="flex",
                        chunk_blocks=args.chunk)
        if backward:
            (r["loss_sum"] / r["weight_sum"]).backward()
        return r

    ceiling = matmul_ceiling()
    seqs = [int(s) for s in args.seq.split(",")]
    print(f"{case}: {n_params / 1e9:.3f}B params (+ frozen embed/head {2 * V * D / 1e9:.2f}B), {args.anchors} anchors "
          f"x {K}, matmul ceiling {ceiling / 1e12:.0f} TFLOP/s")
    t0 = time.perf_counter()  # compile warm-up: two lengths (the second makes sequence length symbolic)
    for s in (seqs[0], seqs[0] - 128, seqs[0]):
        step(*batch(s))
    torch.cuda.synchronize()
    warm_graphs = compile_count()
    row(case, "compile warm-up (3 steps, 2 lengths)", f"{time.perf_counter() - t0:.1f} s, {warm_graphs} graphs")

    for S in seqs:
        ids, lm, hidden = batch(S)
        anchors, keep = sample_anchors(lm, args.anchors, gen)
        torch.cuda.reset_peak_memory_stats()
        drafter.zero_grad(set_to_none=True)
        ms_fwd = cuda_time(lambda: step(ids, lm, hidden, backward=False), args.iters)
        ms = cuda_time(lambda: step(ids, lm, hidden), args.iters)
        peak = torch.cuda.max_memory_allocated() / 2 ** 30
        fl = step_flops(cfg, S, anchors, keep)
        row(case, f"S={S}: forward + loss", f"{ms_fwd:.1f} ms")
        row(case, f"S={S}: forward + backward + loss", f"{ms:.1f} ms", f"{fl / 1e12:.1f} TFLOP: {mfu(fl, ms, ceiling)}")
        row(case, f"S={S}: peak memory", f"{peak:.1f} GiB")
    S = seqs[0]
    ids, lm, hidden = batch(S)
    anchors, keep = sample_anchors(lm, args.anchors, gen)

    row(case, "AdamW (fused, fp32 masters) + copy back", f"{optimizer_ms(drafter):.1f} ms")

    if args.breakdown:  # each part alone at the step's shapes; the layers' matmuls and elementwise are the rest
        ms_step = cuda_time(lambda: step(ids, lm, hidden), args.iters)
        types = {t: cfg.layer_types.count(t) for t in set(cfg.layer_types)}
        ms_mask = cuda_time(lambda: build_masks(anchors, keep, S, K, list(types), cfg.sliding_window, "flex"), 20)
        ms_eager = cuda_time(lambda: [dflash_block_mask(anchors, keep, S, K, cfg.sliding_window if t != "full_attention"
                                                        else None, compiled=False) for t in types], 20)
        row(case, "BlockMask build, both layer types: eager construction -> compiled (used)",
            f"{ms_eager:.2f} -> {ms_mask:.2f} ms")
        masks = build_masks(anchors, keep, S, K, list(types), cfg.sliding_window, "flex")
        Q, H, Hkv, hd = args.anchors * K, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        q = torch.randn(1, H, Q, hd, device=dev, dtype=torch.bfloat16, requires_grad=True)
        kv = [torch.randn(1, Hkv, S + Q, hd, device=dev, dtype=torch.bfloat16, requires_grad=True) for _ in "kv"]
        ms_attn = sum(n * cuda_time(lambda: _flex_compiled(q, *kv, block_mask=masks[t], enable_gqa=True).sum()
                                    .backward(), args.iters) for t, n in types.items())
        out = torch.randn(Q, D, device=dev, dtype=torch.bfloat16, requires_grad=True)
        labels, w = torch.randint(0, V, (Q,), device=dev), torch.rand(Q, device=dev)
        ms_head = cuda_time(lambda: HeadCE.apply(out, head, labels, w, args.chunk * K)[0].backward(), args.iters)
        rest = ms_step - ms_mask - ms_attn - ms_head
        for name, t in (("BlockMask build (both layer types)", ms_mask),
                        (f"flex attention fwd+bwd ({' + '.join(f'{n} {t[:-10]}' for t, n in types.items())})", ms_attn),
                        ("LM head + CE fwd+bwd (HeadCE)", ms_head),
                        ("projections, MLP, norms, RoPE, fc, embedding (the rest)", rest)):
            row(case, f"breakdown S={S}: {name}", f"{t:.1f} ms", f"{t / ms_step:.0%} of {ms_step:.1f} ms")
        warm_graphs = compile_count()  # the standalone flex timed above compiled its own graphs

    for s in (2048, 3072, 4096, 2560, 3968, 1024, S):  # new lengths after warm-up: must compile nothing
        step(*batch(s))
    torch.cuda.synchronize()
    row(case, "recompiles after warm-up, S = 1024..4096 (7 lengths)", str(compile_count() - warm_graphs))

    if args.profile:
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                step(ids, lm, hidden)
            torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=15, max_name_column_width=60))

# -----------------------------------------------------------------------------
# target forward: bare HF vs the capture path train.py runs


# Qwen3.6-27B text stack (hybrid: 3 Gated-DeltaNet layers + 1 gated full-attention layer, 16 times). Shapes from
# the released config as we know it (DFLASH_SPEC §1.6, ANCHORS §3c); the bench prints the parameter count to check.
QWEN36_27B = dict(vocab_size=248320, hidden_size=5120, intermediate_size=17408, num_hidden_layers=64,
                  num_attention_heads=24, num_key_value_heads=4, head_dim=256, linear_num_key_heads=16,
                  linear_num_value_heads=48, linear_key_head_dim=128, linear_value_head_dim=128,
                  linear_conv_kernel_dim=4, rms_norm_eps=1e-6, max_position_embeddings=262144,
                  rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25})
QWEN3_8B = dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-6,
                max_position_embeddings=40960, rope_theta=1e6, tie_word_embeddings=False)
TARGETS = {"8b": (QWEN3_8B, [1, 9, 17, 25, 33], [(4, 3072), (1, 3072)]),
           "27b": (QWEN36_27B, [1, 16, 31, 46, 61], [(1, 4096), (2, 4096), (1, 2048)])}


def build_target(name):
    """Random bf16 CausalLM on the GPU from the config; returns (model, layer ids, shapes, kernels note)."""
    from transformers import AutoModelForCausalLM
    conf, ids, shapes = TARGETS[name]
    if name == "27b":
        from transformers.models.qwen3_5 import Qwen3_5TextConfig as C
    else:
        from transformers import Qwen3Config as C
    kernels = "sdpa"
    if name == "27b":
        try:
            import fla  # noqa: F401  (flash-linear-attention kernels for the Gated-DeltaNet layers)
            kernels = "fla " + fla.__version__
        except ImportError:
            kernels = "torch fallback (no flash-linear-attention)"
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(C(**conf), dtype=torch.bfloat16).eval().requires_grad_(False)
    return model, ids, shapes, kernels


def forward_flops(decoder, n_layers, B, S):
    """2 FLOP per weight per token of the layers run + causal attention (QK^T, PV over S/2 keys) in full layers."""
    c = decoder.config
    body = sum(p.numel() for p in decoder.layers[:n_layers].parameters())
    n_attn = sum(t == "full_attention" for t in (getattr(c, "layer_types", None) or
                                                 ["full_attention"] * c.num_hidden_layers)[:n_layers])
    return B * S * (2 * body + n_attn * 2 * 2 * (S / 2) * c.num_attention_heads * c.head_dim)


def truncate(decoder, keep):
    """What load_target builds: the decoder up to the deepest captured layer, nothing after it."""
    decoder.layers = decoder.layers[:keep]
    decoder.config.num_hidden_layers = keep
    if getattr(decoder.config, "layer_types", None):
        decoder.config.layer_types = decoder.config.layer_types[:keep]


def bench_target(args):
    if args.no_fla:  # hide flash-linear-attention from transformers' availability check (find_spec -> None)
        sys.modules["fla"] = None
    from train import Capture
    model, ids, shapes, kernels = build_target(args.model)
    case = f"target {args.model} ({kernels})"
    dec = model.get_decoder()
    L, keep = dec.config.num_hidden_layers, max(ids) + 1
    ceiling = matmul_ceiling()
    print(f"{case}: {L} layers, {sum(p.numel() for p in dec.layers.parameters()) / 1e9:.2f}B layer params; ours runs "
          f"layers 0..{keep - 1} and captures {ids}; matmul ceiling {ceiling / 1e12:.0f} TFLOP/s")
    bare = {}
    for B, S in shapes:  # bare HF: the whole decoder stack, no hooks, no LM head (logits are not needed)
        x = torch.randint(0, dec.config.vocab_size, (B, S), device="cuda")
        ms = cuda_time(lambda: dec(input_ids=x, use_cache=False), args.iters)
        bare[B, S] = B * S / (ms * 1e-3)
        row(case, f"B={B} S={S}: bare HF decoder forward, {L} layers", f"{bare[B, S]:.0f} tok/s",
            mfu(forward_flops(dec, L, B, S), ms, ceiling))
    truncate(dec, keep)
    cap = Capture(dec, ids)
    for B, S in shapes:
        x = torch.randint(0, dec.config.vocab_size, (B, S), device="cuda")
        ms = cuda_time(lambda: cap(x), args.iters)
        row(case, f"B={B} S={S}: capture path (train.py), {keep} layers + hooks", f"{B * S / (ms * 1e-3):.0f} tok/s",
            f"{B * S / (ms * 1e-3) / bare[B, S]:.0%} of bare; {mfu(forward_flops(dec, keep, B, S), ms, ceiling)}")
    row(case, "peak memory", f"{torch.cuda.max_memory_allocated() / 2 ** 30:.1f} GiB")
    if args.model == "8b":  # FSDP2 on a one-GPU mesh: the wrapper's cost (its all-gather of one rank is a copy)
        import torch.distributed as dist
        from torch.distributed.fsdp import fully_shard
        dist.init_process_group("nccl", init_method="tcp://127.0.0.1:29533", world_size=1, rank=0)
        for layer in dec.layers:
            fully_shard(layer, reshard_after_forward=True)
        fully_shard(dec, reshard_after_forward=True)
        B, S = shapes[0]
        x = torch.randint(0, dec.config.vocab_size, (B, S), device="cuda")
        ms = cuda_time(lambda: cap(x), args.iters)
        row(case, f"B={B} S={S}: capture path, FSDP2 on a 1-GPU mesh", f"{B * S / (ms * 1e-3):.0f} tok/s",
            f"{B * S / (ms * 1e-3) / bare[B, S]:.0%} of bare")
        dist.destroy_process_group()

# -----------------------------------------------------------------------------
# end to end, colocated: what train.py's one-process loop does per micro-batch


def bench_e2e(args):
    """train.py's colocated step on random data: target capture, anchors, dflash_loss, backward, train.Optimizer
    (fp32 masters, clipping), with train.py's host syncs. CUDA events split the GPU time between the two roles."""
    from types import SimpleNamespace

    from train import Capture, Config, Optimizer
    configure_compile()
    model, ids_, _, kernels = build_target(args.model)
    dec = model.get_decoder()
    embed, head = dec.embed_tokens.weight, model.lm_head.weight
    truncate(dec, max(ids_) + 1)
    cap = Capture(dec, ids_)
    cfg = DrafterConfig(**PRESETS[args.model])
    drafter = DFlashDrafter(cfg).to("cuda", torch.bfloat16)
    tcfg = Config(num_anchors=args.anchors)
    optim = Optimizer(tcfg, drafter, SimpleNamespace(drafters=[0], drafter_group=None))
    S, V = args.seq_e2e, cfg.vocab_size
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
    split = []

    def step(i):
        ids = torch.randint(0, V, (1, S - 128 * (i % 2)), device="cuda")  # two lengths, as a real corpus has
        lm = torch.zeros_like(ids)
        lm[:, ids.shape[1] // 4:] = 1
        ev[0].record()
        hidden = cap(ids)
        torch.cuda.synchronize()  # train.py syncs here to time the target
        ev[1].record()
        anchors, keep = sample_anchors(lm, args.anchors, torch.Generator("cuda").manual_seed(i))
        r = dflash_loss(drafter, embed, head, ids, lm, hidden, anchors, keep, backend="flex", chunk_blocks=args.chunk)
        r["loss_sum"].backward()
        w = r["weight_sum"].item()  # train.py's stats .cpu()
        optim.step(6e-4, w)
        ev[2].record()
        torch.cuda.synchronize()
        split.append((ev[0].elapsed_time(ev[1]), ev[1].elapsed_time(ev[2])))
        return ids.numel()

    for i in range(4):
        step(i)
    split.clear()
    warm = compile_count()
    torch.cuda.synchronize()
    t0, tokens = time.perf_counter(), 0
    for i in range(args.iters):
        tokens += step(i)
    wall = time.perf_counter() - t0
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        t1 = time.perf_counter()
        for i in range(3):
            step(i)
        pw = time.perf_counter() - t1
    busy = sum(e.self_device_time_total for e in prof.key_averages()) / 1e6 / pw
    t_t, t_d = (statistics.mean(x) for x in zip(*split[:args.iters]))
    case = f"e2e colocated {args.model}"
    row(case, f"S={S}/{S - 128}, {args.anchors} anchors: throughput", f"{tokens / wall:.0f} tok/s",
        f"{args.iters / wall:.2f} steps/s, target {kernels}")
    row(case, "time split per step: target / drafter (+optimizer)", f"{t_t:.0f} / {t_d:.0f} ms",
        f"{t_t / (t_t + t_d):.0%} / {t_d / (t_t + t_d):.0%}")
    row(case, "GPU busy (kernel time / wall, profiler)", f"{busy:.0%}")
    row(case, "peak memory / recompiles after warm-up",
        f"{torch.cuda.max_memory_allocated() / 2 ** 30:.1f} GiB / {compile_count() - warm}")

# -----------------------------------------------------------------------------


# SmolLM2-135M-Instruct (the demo target), for the decoding loop
SMOLLM2 = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
               num_key_value_heads=3, head_dim=64, rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True,
               max_position_embeddings=8192)


def bench_decode(args):
    """eval.py's spec_decode (block 16, a random drafter: ~1 token per cycle) and plain_decode on a random
    SmolLM2-shaped target, bf16, batch 1, in ms per cycle / per token with eval's time split. Each loop runs twice on
    one prompt: the second pass repeats every shape of the first. 'torch default' lifts eval's NO_CUDNN restriction,
    where cuDNN attention builds a host-side plan for each new key length."""
    import eval as ev
    from transformers import LlamaConfig, LlamaForCausalLM
    from model import drafter_config_from_target
    torch.manual_seed(0)
    cfg = LlamaConfig(**SMOLLM2)
    dev = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: a smoke run of the same loop
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
    target = LlamaForCausalLM(cfg).to(dev, torch.bfloat16).eval()
    drafter = DFlashDrafter(drafter_config_from_target(cfg, None, num_target_features=5, mask_token=16))
    drafter = drafter.to(dev, torch.bfloat16).eval()
    prompt, n = torch.randint(100, 40000, (200,)).tolist(), args.new_tokens

    def unwrapped(f):  # the loop without its decorators, run under inference_mode only
        while hasattr(f, "__wrapped__"):
            f = f.__wrapped__
        return torch.inference_mode()(f)

    ev.spec_decode(target, drafter, prompt, 32, 16, set())  # warm-up
    for label, spec, plain in (("eval (no cuDNN)", ev.spec_decode, ev.plain_decode),
                               ("torch default", unwrapped(ev.spec_decode), unwrapped(ev.plain_decode))):
        for rep in (1, 2):
            times = dict.fromkeys(ev.TIME_KEYS, 0.0)
            _, committed, _, _ = spec(target, drafter, prompt, n, 16, set(), times=times)
            c = len(committed)
            split = ", ".join(f"{k} {1e3 * times[k] / c:.1f}" for k in ("draft", "verify", "other"))
            row("decode", f"{label}, pass {rep}: spec cycle, block 16", f"{1e3 * sum(times[k] for k in ('draft', 'verify', 'other')) / c:.1f} ms",
                split)
            sync()
            t = time.perf_counter()
            out = plain(target, prompt, n, set())
            sync()
            row("decode", f"{label}, pass {rep}: plain step", f"{1e3 * (time.perf_counter() - t) / len(out):.1f} ms")


ALL = [["ceilings"], ["drafter", "--preset", "27b", "--seq", "4096,2048", "--breakdown"],
       ["drafter", "--preset", "27b", "--eager"], ["drafter", "--preset", "8b", "--seq", "3072", "--breakdown"],
       ["target", "--model", "8b"], ["target", "--model", "27b"], ["e2e", "--model", "8b"]]


def run_all(args):
    """Every case in a fresh process (no compile state, memory or fla import shared), then one table."""
    rows, failed = [], []
    cases = ALL + [["target", "--model", "27b", "--no-fla"], ["decode"]]  # 7: transformers' torch fallback kernels
    for case in [cases[int(i)] for i in args.cases.split(",")] if args.cases else ALL + [["decode"]]:
        print(f"\n$ python bench.py {' '.join(case)}", flush=True)
        out = f"/tmp/bench-{os.getpid()}.json"
        try:
            p = subprocess.run([sys.executable, __file__, *case, "--json", out], timeout=args.case_timeout)
        except subprocess.TimeoutExpired:
            p = None
        if p is None or p.returncode:
            failed.append(" ".join(case))
        if os.path.exists(out):
            with open(out) as f:
                rows += json.load(f)
            os.remove(out)
    print("\n| case | figure | value | against |\n|---|---|---|---|")
    for r in rows:
        print("| " + " | ".join(r) + " |")
    if failed:
        raise SystemExit(f"failed cases: {failed}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("what", nargs="?", default="all", choices=["all", "ceilings", "drafter", "target", "e2e",
                                                                   "decode"])
    ap.add_argument("--preset", default="27b", choices=list(PRESETS))
    ap.add_argument("--model", default="8b", choices=list(TARGETS))
    ap.add_argument("--seq", default="4096", help="drafter: comma-separated sequence lengths")
    ap.add_argument("--seq_e2e", type=int, default=3072)
    ap.add_argument("--anchors", type=int, default=512)
    ap.add_argument("--chunk", type=int, default=64, help="objective chunk, in blocks")
    ap.add_argument("--iters", type=int, default=8)
    ap.add_argument("--new_tokens", type=int, default=128, help="decode: tokens per loop")
    ap.add_argument("--eager", action="store_true", help="drafter layers uncompiled (the 'before')")
    ap.add_argument("--breakdown", action="store_true")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--no-fla", dest="no_fla", action="store_true", help="27b: transformers' torch fallback kernels")
    ap.add_argument("--cases", default="", help="all: indices into ALL (+ 7 = 27b --no-fla, 8 = decode), e.g. 0,1,2; default ALL + decode")
    ap.add_argument("--case-timeout", dest="case_timeout", type=int, default=300, help="all: seconds per case")
    ap.add_argument("--json", default=None, help="also write the rows here")
    args = ap.parse_args()
    try:
        {"all": run_all, "ceilings": bench_ceilings, "drafter": bench_drafter, "target": bench_target,
         "e2e": bench_e2e, "decode": bench_decode}[args.what](args)
    finally:
        if args.json:
            with open(args.json, "w") as f:
                json.dump(ROWS, f)
