"""
GPU benchmarks that print figures (results go to BENCHMARKS.md with date, hardware, commit and command).

    python bench.py drafter              # Qwen3.6-27B drafter shapes: mask build, fwd+bwd+loss step, MFU, memory,
                                         # recompiles over varying lengths, where the time goes
    python bench.py drafter --preset smol --seq 1024 --anchors 256
    python bench.py target               # Qwen3.6-27B-shaped target (random weights), our capture path, MFU

Timing is honest (STYLE.md §11): compile and warm up first, synchronize before reading the clock, and report MFU
against a bf16 matmul ceiling measured in the same process as well as against the 989 TFLOP/s H200 datasheet.
"""

import argparse
import statistics
import time

import torch

from attention import build_masks, compile_count, configure_compile
from model import DFlashDrafter, DrafterConfig, dflash_loss, sample_anchors

PRESETS = {
    # Qwen3.6-27B drafter (DFLASH_SPEC §1.6): 5 layers, 4 sliding(2048) + 1 full, 5 target layers
    "27b": dict(hidden_size=5120, intermediate_size=17408, num_hidden_layers=5, num_attention_heads=32,
                num_key_value_heads=8, head_dim=128, vocab_size=248320, rope_theta=1e7, block_size=16,
                target_layer_ids=[1, 16, 31, 46, 61], num_target_layers=64, mask_token_id=248070,
                layer_types=["sliding_attention"] * 4 + ["full_attention"], sliding_window=2048),
    # SmolLM2-135M-Instruct drafter (the demo)
    "smol": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=5, num_attention_heads=9,
                 num_key_value_heads=3, head_dim=64, vocab_size=49152, rope_theta=1e5, block_size=16,
                 target_layer_ids=[1, 8, 14, 20, 27], num_target_layers=30, mask_token_id=16),
}
H200_PEAK = 989e12  # dense bf16 FLOP/s, datasheet


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
    fl = 2 * S * nK * D * D * 2  # fc, 2x
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


def bench_drafter(args):
    configure_compile()
    torch.manual_seed(0)
    dev = "cuda"
    cfg = DrafterConfig(**PRESETS[args.preset])
    if args.window:
        cfg.sliding_window = args.window
    drafter = DFlashDrafter(cfg).to(dev, torch.bfloat16)
    n_params = sum(p.numel() for p in drafter.parameters())
    V, D = cfg.vocab_size, cfg.hidden_size
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
        return r, anchors, keep

    ceiling = matmul_ceiling()
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}  drafter params {n_params / 1e9:.3f}B "
          f"(+ frozen embed/head {2 * V * D / 1e9:.2f}B)")
    print(f"bf16 8192^3 matmul ceiling: {ceiling / 1e12:.0f} TFLOP/s ({ceiling / H200_PEAK:.0%} of 989)")

    # compile warm-up: two lengths (the second makes sequence length symbolic), then never again
    S = args.seq
    t0 = time.perf_counter()
    for s in (S, S - 128, S):
        step(*batch(s))
    torch.cuda.synchronize()
    warm_graphs = compile_count()
    print(f"compile warm-up: {time.perf_counter() - t0:.1f}s, {warm_graphs} graphs")

    ids, lm, hidden = batch(S)
    anchors, keep = sample_anchors(lm, args.anchors, gen)
    for name, lt in (("full", ["full_attention"]), ("sliding", ["sliding_attention"]), ("both", cfg.layer_types)):
        ms = cuda_time(lambda: build_masks(anchors, keep, S, cfg.block_size, lt, cfg.sliding_window, "flex"), 20)
        print(f"BlockMask build ({name}): {ms:.3f} ms")
    # candidate: the tile tables compiled (dynamic shapes: one graph for every length)
    from attention import block_tiles, dflash_block_mask
    tiles_c = torch.compile(block_tiles, dynamic=True)
    W = cfg.sliding_window
    for s in (S, S - 256, S):
        a_, k_ = sample_anchors(batch(s)[1], args.anchors, gen)
        x, y = (dflash_block_mask(a_, k_, s, cfg.block_size, W, tiles_fn=f) for f in (block_tiles, tiles_c))
        assert torch.equal(x.kv_indices, y.kv_indices) and torch.equal(x.full_kv_num_blocks, y.full_kv_num_blocks)
    ms = cuda_time(lambda: [dflash_block_mask(anchors, keep, S, cfg.block_size, W if t == "sliding_attention"
                                              else None, tiles_fn=tiles_c) for t in set(cfg.layer_types)], 20)
    print(f"BlockMask build (both), compiled tile tables: {ms:.3f} ms (identical masks)")
    warm_graphs = compile_count()  # the candidate's own compile above is not a training-step recompile

    torch.cuda.reset_peak_memory_stats()
    drafter.zero_grad(set_to_none=True)
    ms_fwd = cuda_time(lambda: step(ids, lm, hidden, backward=False), args.iters)
    ms_step = cuda_time(lambda: step(ids, lm, hidden), args.iters)
    peak = torch.cuda.max_memory_allocated() / 2 ** 30
    fl = step_flops(cfg, S, anchors, keep)
    print(f"S={S} anchors={args.anchors} block={cfg.block_size}: forward+loss {ms_fwd:.1f} ms, "
          f"fwd+bwd+loss {ms_step:.1f} ms, {fl / 1e12:.1f} TFLOP/step -> {fl / (ms_step * 1e-3) / 1e12:.0f} TFLOP/s = "
          f"{fl / (ms_step * 1e-3) / ceiling:.0%} of measured matmul, {fl / (ms_step * 1e-3) / H200_PEAK:.0%} MFU(989); "
          f"peak mem {peak:.1f} GiB")

    # optimizer: AdamW over fp32 master copies, as the trainer does (bf16 weights, fp32 state)
    masters = [p.detach().float().requires_grad_() for p in drafter.parameters()]
    for m, p in zip(masters, drafter.parameters()):
        m.grad = p.grad.float()
    opt = torch.optim.AdamW(masters, lr=6e-4, fused=True)

    def opt_step():
        opt.step()
        with torch.no_grad():
            torch._foreach_copy_(list(drafter.parameters()), masters)
    print(f"AdamW (fused, fp32 masters) + copy back: {cuda_time(opt_step, 10):.1f} ms")
    del masters, opt

    # recompiles over varying sequence lengths after warm-up: must be 0
    for s in (2048, 3072, 4096, 2560, 3968, 1024, S):
        step(*batch(s))
    torch.cuda.synchronize()
    print(f"recompiles after warm-up over lengths 1024..4096: {compile_count() - warm_graphs}")

    if args.profile:
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                step(ids, lm, hidden)
            torch.cuda.synchronize()
        buckets = {}
        total = 0.0
        for e in prof.key_averages():
            t = e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
            if t <= 0 or e.key.startswith("ProfilerStep") or e.device_type != torch.autograd.DeviceType.CUDA:
                continue
            k = e.key.lower()
            cat = ("flex attention" if "flex" in k or "tem_fused" in k else
                   "matmul" if any(x in k for x in ("gemm", "nvjet", "cutlass", "xmma", "sm90", "matmul")) else
                   "cross-entropy/softmax" if any(x in k for x in ("softmax", "nll", "cross", "log_")) else
                   "other (norms, rope, elementwise, copies)")
            buckets[cat] = buckets.get(cat, 0.0) + t
            total += t
        print("where the GPU time goes (3 steps):")
        for cat, t in sorted(buckets.items(), key=lambda x: -x[1]):
            print(f"  {cat:40s} {t / 3e3:8.1f} ms/step  {t / total:6.1%}")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=60))


# Qwen3.6-27B text stack (hybrid: 3 Gated-DeltaNet layers + 1 gated full-attention layer, 16 times). Shapes from
# the released config as we know it (DFLASH_SPEC §1.6, ANCHORS §3c); the bench prints the parameter count to check.
QWEN36_27B = dict(vocab_size=248320, hidden_size=5120, intermediate_size=17408, num_hidden_layers=64,
                  num_attention_heads=24, num_key_value_heads=4, head_dim=256, linear_num_key_heads=16,
                  linear_num_value_heads=48, linear_key_head_dim=128, linear_value_head_dim=128,
                  linear_conv_kernel_dim=4, rms_norm_eps=1e-6, max_position_embeddings=262144,
                  rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25})


def bench_target(args):
    """The target side exactly as train.py runs it (decoder truncated after the deepest captured layer, no LM head,
    forward hooks capture the chosen layers), random bf16 weights from the Qwen3.6-27B shapes."""
    from transformers import AutoModelForCausalLM
    from transformers.models.qwen3_5 import Qwen3_5TextConfig
    from train import Capture
    ids = [1, 16, 31, 46, 61]
    tc = Qwen3_5TextConfig(**QWEN36_27B)
    keep = max(ids) + 1
    tc.num_hidden_layers, tc.layer_types = keep, tc.layer_types[:keep]
    try:
        import fla  # noqa: F401  (flash-linear-attention kernels for the Gated-DeltaNet layers)
        kernels = "fla " + fla.__version__
    except ImportError:
        kernels = "torch fallback (no flash-linear-attention)"
    torch.manual_seed(0)
    t0 = time.perf_counter()
    with torch.device("cuda"):
        base = AutoModelForCausalLM.from_config(tc, dtype=torch.bfloat16).get_decoder().eval().requires_grad_(False)
    n_body = sum(p.numel() for n, p in base.named_parameters() if "embed" not in n)
    print(f"target: {keep}/64 layers built in {time.perf_counter() - t0:.0f}s, {n_body / 1e9:.2f}B non-embedding "
          f"params (+{base.embed_tokens.weight.numel() / 1e9:.2f}B embedding), kernels: {kernels}")
    cap = Capture(base, ids)
    ceiling = matmul_ceiling()
    print(f"bf16 8192^3 matmul ceiling: {ceiling / 1e12:.0f} TFLOP/s")
    n_attn = sum(t == "full_attention" for t in tc.layer_types)
    for B, S in ((1, 2048), (1, 4096), (4, 2048), (2, 4096)):
        x = torch.randint(0, tc.vocab_size, (B, S), device="cuda")
        ms = cuda_time(lambda: cap(x), args.iters, warmup=2)
        # 2 FLOP per weight per token + causal attention (QK^T and PV over S/2 keys on average) in full layers
        fl = B * S * (2 * n_body + n_attn * 2 * 2 * (S / 2) * tc.num_attention_heads * tc.head_dim)
        print(f"B={B} S={S}: {ms:.0f} ms/forward, {B * S / (ms * 1e-3):.0f} tokens/s, {fl / (ms * 1e-3) / 1e12:.0f} "
              f"TFLOP/s = {fl / (ms * 1e-3) / ceiling:.0%} of measured matmul, "
              f"{fl / (ms * 1e-3) / H200_PEAK:.0%} MFU(989); peak mem {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB")


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=["drafter", "target"])
    ap.add_argument("--preset", default="27b", choices=list(PRESETS))
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--anchors", type=int, default=512)
    ap.add_argument("--chunk", type=int, default=64, help="objective chunk, in blocks")
    ap.add_argument("--window", type=int, default=0)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    bench_drafter(args) if args.what == "drafter" else bench_target(args)
