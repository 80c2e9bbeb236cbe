"""GPU benchmarks on random weights, each figure against a ceiling measured in the same run (for BENCHMARKS.md), timed
after compiling and warming up, synchronized, the median of several runs. `python bench.py`: every case of CASES in
its own process, then one table; `python bench.py drafter --preset 27b --breakdown`: one case (see each bench_*).
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
from types import SimpleNamespace

import torch
from torch.profiler import ProfilerActivity, profile

import eval as ev
from attention import build_masks, compile_count, configure_compile, dflash_block_mask, flex_compiled
from data import demo_settings
from fused import Float8Head, Head, HeadCE, HeadTask
from model import (DFlashDrafter, DrafterConfig, LossBatch, Tables, build_target_layer_ids,
                   dflash_loss, sample_anchors, to_float8)
from ranks import GiB, final_states, memory_need
from target import (Capture, Float8Frozen, fla_short_conv, load_for_generation, load_tokenizer,
                    target_to_float8)
from train import Config, Optimizer, loss_options

# Qwen3.6-27B text stack (3 Gated-DeltaNet + 1 gated full-attention layer, 16 times), shapes as we know them (checked)
QWEN36_27B = dict(vocab_size=248320, hidden_size=5120, intermediate_size=17408, num_hidden_layers=64,
                  num_attention_heads=24, num_key_value_heads=4, head_dim=256, linear_num_key_heads=16,
                  linear_num_value_heads=48, linear_key_head_dim=128, linear_value_head_dim=128,
                  linear_conv_kernel_dim=4, rms_norm_eps=1e-6, max_position_embeddings=262144,
                  rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25})
QWEN3_8B = dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-6,
                max_position_embeddings=40960, rope_theta=1e6)
SMOL = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3,
            head_dim=64, rms_norm_eps=1e-5, rope_theta=1e5, max_position_embeddings=8192)
SMOLLM2 = dict(SMOL, num_hidden_layers=30, tie_word_embeddings=True)  # SmolLM2-135M-Instruct, the demo target
TARGETS = {"8b": ("qwen3", QWEN3_8B, [1, 9, 17, 25, 33], [(4, 3072), (1, 3072)]),  # model type, config, ids, shapes
           "27b": ("qwen3_5_text", QWEN36_27B, [1, 16, 31, 46, 61], [(1, 4096), (2, 4096), (1, 2048)])}
PRESETS = {  # drafters of 5 layers, block 16; Qwen3.6-27B's (the released z-lab layout): 4 sliding(2048) + 1 full
    "27b": dict(hidden_size=5120, intermediate_size=17408, num_hidden_layers=5, num_attention_heads=32,
                num_key_value_heads=8, head_dim=128, vocab_size=248320, rope_theta=1e7, block_size=16,
                target_layer_ids=[1, 16, 31, 46, 61], num_target_layers=64, mask_token_id=248070,
                layer_types=["sliding_attention"] * 4 + ["full_attention"], sliding_window=2048),
    # Qwen3-8B's (z-lab Qwen3-8B-DFlash-b16), the demo's: the target's shapes, ids by the released rule, full attention
    "8b": dict(QWEN3_8B, num_hidden_layers=5, block_size=16, target_layer_ids=[1, 9, 17, 25, 33], num_target_layers=36,
               mask_token_id=151669),
    "smol": dict(SMOL, num_hidden_layers=5, block_size=16, target_layer_ids=[1, 8, 14, 20, 27], num_target_layers=30,
                 mask_token_id=16),
}
H200_PEAK = 989e12  # dense bf16 FLOP/s, datasheet
ROWS = []  # (case, figure, value, "vs ceiling") for the final table
ONE_DRAFTER = SimpleNamespace(drafters=[0], drafter_group=None)  # the Dist a single drafter's train.Optimizer reads


def table(case):
    """-> row(figure, value, note=""), which prints a figure of `case` and keeps it for the final table."""
    def row(figure, value, note=""):
        ROWS.append((case, figure, value, note))
        print(f"  {figure}: {value}" + (f"  ({note})" if note else ""), flush=True)
    return row


def cuda_times(fn, iters, warmup=2):
    """Milliseconds of each of iters calls of fn(), each synchronized, after `warmup` untimed ones."""
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
    return f"{tf / 1e12:.0f} TFLOP/s = {tf / ceiling:.0%} of measured matmul, {tf / H200_PEAK:.0%} MFU(989)"


def bench_ceilings(args):
    row, x = table("ceilings"), torch.empty(4 * 2 ** 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)  # HBM: a plain device-to-device copy, bytes read + bytes written per second
    mm, hbm = matmul_ceiling(), 2 * x.numel() / (cuda_time(lambda: y.copy_(x), 10, warmup=3) * 1e-3)
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}")
    row("bf16 8192^3 matmul", f"{mm / 1e12:.0f} TFLOP/s", f"{mm / H200_PEAK:.0%} of the 989 datasheet")
    row("HBM copy (4 GiB, read + write)", f"{hbm / 1e12:.2f} TB/s", f"{hbm / 4.8e12:.0%} of the 4.8 datasheet")


def step_flops(cfg, S, anchors, keep):
    """Model FLOPs of one fwd+bwd+loss step, a matmul 2*m*n*k: layers 3x (fwd, input and weight grads), fc and the
    frozen LM head 2x (no input/weight grad), attention 3x over the keys each query row sees (exactly, from anchors)."""
    D, F, H, Hkv, hd, V = (cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads,
                           cfg.num_key_value_heads, cfg.head_dim, cfg.vocab_size)
    K, N, Q = cfg.block_size, anchors.shape[0], anchors.numel() * cfg.block_size  # Q: block rows, padding ones too
    per_row = 2 * D * (2 * H * hd + 2 * Hkv * hd + 3 * F)  # q, o, k, v of block tokens + SwiGLU
    fl = 2 * S * N * len(cfg.target_layer_ids) * D * D * 2  # fc, 2x
    fl += 3 * cfg.num_hidden_layers * (Q * per_row + S * N * 2 * D * 2 * Hkv * hd)  # + the context's k, v per layer
    j, p = torch.arange(K, device=anchors.device), anchors[:, :, None].float()
    for t in cfg.layer_types:  # visible keys per row: context + block part
        if t == "full_attention":
            vis = (p + K).expand(-1, -1, K)  # every row: p context keys + the whole block
        else:  # context [max(0, p+j-W+1), p) holds min(p, W-1-j) keys; causal block part j+1
            vis = torch.minimum(p, (cfg.sliding_window - 1 - j).float()).clamp(min=0) + j + 1
        fl += 3 * 2 * 2 * (vis * keep[:, :, None]).sum().item() * H * hd
    return fl + 2 * 2 * Q * D * V


def optimizer_ms(drafter):
    """AdamW over fp32 master copies, as the trainer does (bf16 weights, fp32 state), + the copy back."""
    params = list(drafter.parameters())
    masters = [p.detach().float().requires_grad_() for p in params]
    for m, p in zip(masters, params):
        m.grad = p.grad.float()
    opt = torch.optim.AdamW(masters, lr=6e-4, fused=True)

    def opt_step():
        opt.step()
        torch._foreach_copy_([p.data for p in params], masters)
    return cuda_time(opt_step, 10)


def drafter_case(args):
    """The drafter bench's row title: the preset and every variant on."""
    case = f"drafter {args.preset}" + " eager layers" * args.eager + f" fp8 {args.fp8}" * bool(args.fp8) + (
        " fp8 LM head" * args.fp8_head + f" Markov head r={args.markov_rank}" * (args.markov_rank > 0))
    case += " plain loss" * (args.loss_impl == "plain")
    case += f" kd {args.kd_loss}" * (args.kd_loss != "none")
    return case + " confidence head" * args.confidence_head


def bench_drafter(args):
    configure_compile()
    torch.manual_seed(0)
    case = drafter_case(args)
    cfg = DrafterConfig(**PRESETS[args.preset], markov_rank=args.markov_rank,
                        confidence_head=args.confidence_head)
    row = table(case)
    drafter = DFlashDrafter(cfg).to("cuda", torch.bfloat16)
    drafter.compile_layers = not args.eager
    if args.fp8:  # torchao float8 linears, as train.py's --fp8
        to_float8(drafter, args.fp8)
    V, D, K, W, Q = cfg.vocab_size, cfg.hidden_size, cfg.block_size, cfg.sliding_window, args.anchors * cfg.block_size
    embed, head = (torch.randn(V, D, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in "eh")
    head = Float8Head(head) if args.fp8_head else head  # as train.py's --fp8_head
    gen = torch.Generator("cuda").manual_seed(0)
    train_cfg = Config(loss_chunk=args.chunk, loss_impl=args.loss_impl, kd_loss=args.kd_loss)
    opts = loss_options(train_cfg, torch.device("cuda"))
    C, fin = len(cfg.target_layer_ids) * D, final_states(train_cfg, cfg)  # + the final states

    def batch(S):  # random ids and target states; a quarter prompt, the rest response
        ids, lm = torch.randint(0, V, (1, S), device="cuda"), torch.zeros(1, S, device="cuda")
        lm[:, S // 4:] = 1
        return ids, lm, torch.randn(1, S, C + fin * D, device="cuda", dtype=torch.bfloat16)

    def step(ids, lm, hidden, backward=True):
        anchors, keep = sample_anchors(lm, args.anchors, gen)
        final = hidden[..., C:] if fin else None
        r = dflash_loss(drafter, Tables(embed, head),
                        LossBatch(ids, lm, hidden[..., :C], anchors, keep, final), opts)
        if backward:
            (r["loss_sum"] / r["weight_sum"]).backward()
    steps = lambda *lengths: cuda_time(lambda: [step(*batch(s)) for s in lengths], 1, warmup=0)  # -> ms, one each
    ceiling, seqs = matmul_ceiling(), [int(s) for s in args.seq.split(",")]
    print(f"{case}: {sum(p.numel() for p in drafter.parameters()) / 1e9:.3f}B params (+ frozen embed/head "
          f"{2 * V * D / 1e9:.2f}B), {args.anchors} anchors x {K}, matmul ceiling {ceiling / 1e12:.0f} TFLOP/s")
    warm_ms = steps(seqs[0], seqs[0] - 128, seqs[0])  # compile warm-up: the second length makes S symbolic
    warm_graphs = compile_count()
    row("compile warm-up (3 steps, 2 lengths)", f"{warm_ms / 1e3:.1f} s, {warm_graphs} graphs")
    for S in seqs:
        ids, lm, hidden = batch(S)
        fl = step_flops(cfg, S, *sample_anchors(lm, args.anchors, gen))
        torch.cuda.reset_peak_memory_stats()
        drafter.zero_grad(set_to_none=True)
        ms_fwd = cuda_time(lambda: step(ids, lm, hidden, backward=False), args.iters)
        ms = cuda_time(lambda: step(ids, lm, hidden), args.iters)
        row(f"S={S}: forward + loss", f"{ms_fwd:.1f} ms")
        row(f"S={S}: forward + backward + loss", f"{ms:.1f} ms", f"{fl / 1e12:.1f} TFLOP: {mfu(fl, ms, ceiling)}")
        row(f"S={S}: peak memory", f"{torch.cuda.max_memory_allocated() / 2 ** 30:.1f} GiB")
    S, (ids, lm, hidden) = seqs[0], batch(seqs[0])
    anchors, keep = sample_anchors(lm, args.anchors, gen)
    row("AdamW (fused, fp32 masters) + copy back", f"{optimizer_ms(drafter):.1f} ms")
    if args.breakdown:  # each part alone at the step's shapes; the layers' matmuls and elementwise are the rest
        ms_step = cuda_time(lambda: step(ids, lm, hidden), args.iters)
        types = {t: cfg.layer_types.count(t) for t in set(cfg.layer_types)}
        ms_masks = sorted(cuda_times(lambda: build_masks(anchors, keep, S, K, list(types), W, "flex"), 50))
        ms_mask = statistics.median(ms_masks)
        ms_eager = cuda_time(lambda: [dflash_block_mask(anchors, keep, S, K, W if t != "full_attention" else None,
                                                        compiled=False) for t in types], 20)
        row("BlockMask build, both layer types: eager construction -> compiled (used)",
            f"{ms_eager:.2f} -> {ms_mask:.2f} ms", f"min / median / max of 50: {ms_masks[0]:.2f} / {ms_mask:.2f} / "
            f"{ms_masks[-1]:.2f} ms")
        masks = build_masks(anchors, keep, S, K, list(types), W, "flex")
        grad = dict(device="cuda", dtype=torch.bfloat16, requires_grad=True)
        q = torch.randn(1, cfg.num_attention_heads, Q, cfg.head_dim, **grad)
        kv = [torch.randn(1, cfg.num_key_value_heads, S + Q, cfg.head_dim, **grad) for _ in "kv"]
        ms_attn = sum(n * cuda_time(lambda: flex_compiled(q, *kv, block_mask=masks[t], enable_gqa=True).sum()
                                    .backward(), args.iters) for t, n in types.items())
        out, labels, w = torch.randn(Q, D, **grad), torch.randint(0, V, (Q,), device="cuda"), torch.rand(Q).cuda()
        task = HeadTask(head if args.fp8_head else Head(head), labels, w, labels, args.chunk * K)
        ms_head = cuda_time(lambda: HeadCE.apply(out, None, None, task)[0].backward(), args.iters)
        attn = " + ".join(f"{n} {t[:-10]}" for t, n in types.items())
        rest = ms_step - ms_mask - ms_attn - ms_head
        for name, t in (("BlockMask build (both layer types)", ms_mask), (f"flex attention fwd+bwd ({attn})", ms_attn),
                        ("LM head + CE fwd+bwd (HeadCE)", ms_head),
                        ("projections, MLP, norms, RoPE, fc, embedding (the rest)", rest)):
            row(f"breakdown S={S}: {name}", f"{t:.1f} ms", f"{t / ms_step:.0%} of {ms_step:.1f} ms")
        warm_graphs = compile_count()  # the standalone flex timed here compiled its own graphs
    steps(2048, 3072, 4096, 2560, 3968, 1024, S)  # new lengths after warm-up: must compile nothing
    row("recompiles after warm-up, S = 1024..4096 (7 lengths)", str(compile_count() - warm_graphs))
    if args.profile:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            steps(S, S, S)
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=15, max_name_column_width=60))


def build_target(name, fla_conv=True):
    """Random bf16 CausalLM on the GPU from the config -> (model, layer ids, shapes, kernels note)."""
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
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **conf), dtype=torch.bfloat16)
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
    """-> {part: ms per fn() call} inside each kind of decoder-layer part (linear_attn: Gated-DeltaNet, self_attn,
    mlp, norms) and inside that part's linears ("<part> linears"), from CUDA events around every call."""
    spans, handles = collections.defaultdict(list), []

    def time_it(module, part):
        def pre(*_):
            spans[part].append((torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)))
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
    """Where the capture path's time goes (layer_split), each part and what is left of it outside its linears."""
    x = torch.randint(0, dec.config.vocab_size, (B, S), device="cuda")
    total, split = cuda_time(lambda: cap(x), iters), layer_split(dec, lambda: cap(x), iters)
    for part, ms in sorted(split.items(), key=lambda kv: -kv[1]):
        lin = split.get(f"{part} linears") if not part.endswith("linears") else None
        note = f"{ms / total:.0%} of {total:.0f} ms" + (f"; outside its linears {ms - lin:.1f} ms" if lin else "")
        row(f"{label} B={B} S={S}: time in {part}", f"{ms:.1f} ms", note)


def bench_target(args):
    if args.no_fla:  # hide flash-linear-attention from transformers' availability check (find_spec -> None)
        sys.modules["fla"] = None
    model, ids, shapes, kernels = build_target(args.model, not args.torch_conv)
    case, dec, ceiling = f"target {args.model} ({kernels})", model.get_decoder(), matmul_ceiling()
    L, keep, row = dec.config.num_hidden_layers, max(ids) + 1, table(case)
    print(f"{case}: {L} layers, {sum(p.numel() for p in dec.layers.parameters()) / 1e9:.2f}B layer params; ours runs "
          f"layers 0..{keep - 1} and captures {ids}; matmul ceiling {ceiling / 1e12:.0f} TFLOP/s")

    def rate(fn, B, S):  # -> (ms, tokens/s) of fn on random [B, S] token ids
        x = torch.randint(0, dec.config.vocab_size, (B, S), device="cuda")
        ms = cuda_time(lambda: fn(x), args.iters)
        return ms, B * S / (ms * 1e-3)

    def flops(n_layers, B, S):  # 2 per weight per token of the layers run + causal attention (QK^T, PV over S/2 keys)
        c, body = dec.config, sum(p.numel() for p in dec.layers[:n_layers].parameters())
        n_attn = (getattr(c, "layer_types", None) or ["full_attention"] * n_layers)[:n_layers].count("full_attention")
        return B * S * (2 * body + n_attn * 2 * 2 * (S / 2) * c.num_attention_heads * c.head_dim)
    bare = {}
    for B, S in shapes:  # bare HF: the whole decoder stack, no hooks, no LM head (logits are not needed)
        ms, bare[B, S] = rate(lambda x: dec(input_ids=x, use_cache=False), B, S)
        row(f"B={B} S={S}: bare HF decoder forward, {L} layers", f"{bare[B, S]:.0f} tok/s",
            mfu(flops(L, B, S), ms, ceiling))
    cap = Capture(truncate(dec, keep), ids)
    for B, S in shapes:
        ms, tps = rate(cap, B, S)
        row(f"B={B} S={S}: capture path (train.py), {keep} layers + hooks", f"{tps:.0f} tok/s",
            f"{tps / bare[B, S]:.0%} of bare; {mfu(flops(keep, B, S), ms, ceiling)}")
    if args.breakdown:
        target_rows(row, "bf16", dec, cap, *shapes[0], args.iters)
    if args.profile:  # the kernels: Gated-DeltaNet's (fla or torch), the short convolution's, GEMMs, attention
        x = torch.randint(0, dec.config.vocab_size, shapes[0], device="cuda")
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            cap(x)
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=20, max_name_column_width=70))
    row("peak memory", f"{torch.cuda.max_memory_allocated() / 2 ** 30:.1f} GiB")
    if args.target_fp8:  # train.py --target_fp8: the kept layers' linears in e4m3, captured states against bf16's
        x = torch.randint(0, dec.config.vocab_size, shapes[0], device="cuda")
        ref, n = cap(x).float(), target_to_float8(dec)
        err = [((a.float() - b).norm() / b.norm()).item() for a, b in zip(cap(x).chunk(len(ids), -1),
                                                                           ref.chunk(len(ids), -1))]
        row(f"FP8 target ({n} linears): captured states against bf16, relative error per captured layer",
            " / ".join(f"{e:.3f}" for e in err), f"layers {ids}")
        for B, S in shapes:
            ms, tps = rate(cap, B, S)
            row(f"B={B} S={S}: capture path with the FP8 target", f"{tps:.0f} tok/s", f"{tps / bare[B, S]:.0%} of bare")
        if args.breakdown:
            target_rows(row, "fp8", dec, cap, *shapes[0], args.iters)
        row("peak memory with the FP8 target", f"{torch.cuda.max_memory_allocated() / 2 ** 30:.1f} GiB")
        return  # train.py refuses FSDP2 with an FP8 target
    if args.model == "8b":  # FSDP2 on a one-GPU mesh: the wrapper's cost (its all-gather of one rank is a copy)
        import torch.distributed as dist
        from torch.distributed.fsdp import fully_shard
        dist.init_process_group("nccl", init_method="tcp://127.0.0.1:29533", world_size=1, rank=0)
        for module in [*dec.layers, dec]:  # each layer, then the root
            fully_shard(module, reshard_after_forward=True)
        (B, S), (_, tps) = shapes[0], rate(cap, *shapes[0])
        row(f"B={B} S={S}: capture path, FSDP2 on a 1-GPU mesh", f"{tps:.0f} tok/s", f"{tps / bare[B, S]:.0%} of bare")
        dist.destroy_process_group()


def bench_fp8_states(args):
    """train.py --target_fp8 on a real target and real text: the captured states of the target with FP8 linears and
    of the bf16 target, each against the fp32 target's, per captured layer; bf16's distance is the error bf16
    training already takes. Default: the demo's target (SmolLM2) on chitchat conversations. CPU or CUDA:
    torch._scaled_mm takes the same e4m3 operands on both."""
    from data import default_cache_dir, read_conversations, tokenize_conversation, write_chitchat
    dev, row = "cuda" if torch.cuda.is_available() else "cpu", table("fp8 target states")
    path = args.target or str(default_cache_dir() / "smollm2-135m-instruct")
    convs = read_conversations(args.data or write_chitchat(default_cache_dir())[0], skip_invalid=True)[0]
    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "fp8": torch.bfloat16}
    models = {k: load_for_generation(path, dev, dt)[0].get_decoder() for k, dt in dtypes.items()}
    n8, L = target_to_float8(models["fp8"]), models["fp8"].config.num_hidden_layers
    ids = build_target_layer_ids(L, 5)
    caps, tok = {k: Capture(m, ids) for k, m in models.items()}, load_tokenizer(path)
    err = {k: [[] for _ in ids] for k in ("bfloat16", "fp8")}  # per captured layer: (norm of diff, norm) per conv
    for conv in convs[:args.convs]:
        x = torch.tensor([tokenize_conversation(tok, conv, args.seq_e2e)[0]], device=dev)
        ref = caps["float32"](x).chunk(len(ids), -1)
        for k in err:
            for e, a, b in zip(err[k], caps[k](x).float().chunk(len(ids), -1), ref):
                e.append(((a - b).norm(dim=-1) / b.norm(dim=-1)).flatten())  # one relative error per token
    print(f"{path}: {L} layers, captured {ids}, {n8} linears in FP8, {min(args.convs, len(convs))} conversations, "
          f"{sum(len(t) for t in err['fp8'][0])} tokens, {dev}")
    for k, label in (("bfloat16", "bf16 target"), ("fp8", "FP8 target")):
        med = [torch.cat(e).median().item() for e in err[k]]
        row(f"{label} vs fp32: median relative error per token, per captured layer",
            " / ".join(f"{m:.4f}" for m in med), f"layers {ids}")


def bench_e2e(args):
    """train.py's colocated step on random data: capture, anchors, dflash_loss, backward, train.Optimizer, syncs."""
    configure_compile()
    model, layer_ids, _, kernels = build_target(args.model)
    embed, head = model.get_decoder().embed_tokens.weight, model.lm_head.weight
    cap = Capture(truncate(model.get_decoder(), max(layer_ids) + 1), layer_ids)
    drafter = DFlashDrafter(DrafterConfig(**PRESETS[args.model])).to("cuda", torch.bfloat16)
    if args.fp8:  # as train.py's --fp8, --fp8_head, --target_fp8
        to_float8(drafter, args.fp8)
    head = Float8Head(head) if args.fp8_head else head
    kernels += f", {target_to_float8(cap.base)} target linears in FP8" if args.target_fp8 else ""
    optim = Optimizer(Config(num_anchors=args.anchors), drafter, ONE_DRAFTER)
    case = f"e2e colocated {args.model}" + f" fp8 {args.fp8}" * bool(args.fp8) + " fp8 LM head" * args.fp8_head
    S, row, split = args.seq_e2e, table(case + " fp8 target" * args.target_fp8), []  # split: ms of target, drafter
    opts = loss_options(Config(loss_chunk=args.chunk), torch.device("cuda"))

    def step(i):
        ids = torch.randint(0, drafter.cfg.vocab_size, (1, S - 128 * (i % 2)), device="cuda")  # two lengths
        lm = torch.zeros_like(ids)
        lm[:, ids.shape[1] // 4:] = 1
        t0 = time.perf_counter()
        hidden = cap(ids)
        torch.cuda.synchronize()  # train.py syncs here to time the target
        t1 = time.perf_counter()
        anchors, keep = sample_anchors(lm, args.anchors, torch.Generator("cuda").manual_seed(i))
        r = dflash_loss(drafter, Tables(embed, head), LossBatch(ids, lm, hidden, anchors, keep),
                        opts)
        r["loss_sum"].backward()
        optim.step(6e-4, r["weight_sum"].item())  # .item(): train.py's stats .cpu()
        torch.cuda.synchronize()
        split.append((1e3 * (t1 - t0), 1e3 * (time.perf_counter() - t1)))
    steps = lambda n: cuda_time(lambda: [step(i) for i in range(n)], 1, warmup=0) / 1e3  # -> seconds
    steps(4)  # warm-up: compiles
    warm, wall = compile_count(), steps(args.iters)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        profiled = steps(3)
    busy = sum(e.self_device_time_total for e in prof.key_averages()) / 1e6 / profiled
    t_t, t_d = (statistics.mean(x) for x in zip(*split[4:4 + args.iters]))  # past the warm-up
    tokens = sum(S - 128 * (i % 2) for i in range(args.iters))
    row(f"S={S}/{S - 128}, {args.anchors} anchors: throughput", f"{tokens / wall:.0f} tok/s",
        f"{args.iters / wall:.2f} steps/s, target {kernels}")
    row("time split per step: target / drafter (+optimizer)", f"{t_t:.0f} / {t_d:.0f} ms",
        f"{t_t / (t_t + t_d):.0%} / {t_d / (t_t + t_d):.0%}")
    row("GPU busy (kernel time / wall, profiler)", f"{busy:.0%}")
    row("peak memory / recompiles after warm-up",
        f"{torch.cuda.max_memory_allocated() / 2 ** 30:.1f} GiB / {compile_count() - warm}")


def bench_decode(args):
    """eval.py's decoding loops on a random SmolLM2 (block 16, ~1 token per cycle), bf16, batch 1, twice (the second
    pass repeats every shape), with eval's NO_CUDNN and without ('torch default': cuDNN plans each new key length)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    dev, row = "cuda" if torch.cuda.is_available() else "cpu", table("decode")
    target = LlamaForCausalLM(LlamaConfig(**SMOLLM2)).to(dev, torch.bfloat16).eval()
    drafter = DFlashDrafter(DrafterConfig(**PRESETS["smol"])).to(dev, torch.bfloat16).eval()
    prompt, n = torch.randint(100, 40000, (200,)).tolist(), args.new_tokens
    unwrapped = lambda f: torch.inference_mode()(inspect.unwrap(f))  # the loop without its decorators
    ev.spec_decode(target, drafter, prompt, 32, 16, set())  # warm-up
    for label, spec, plain in (("eval (no cuDNN)", ev.spec_decode, ev.plain_decode),
                               ("torch default", unwrapped(ev.spec_decode), unwrapped(ev.plain_decode))):
        for rep in (1, 2):
            t = dict.fromkeys(ev.TIME_KEYS, 0.0)
            c = len(spec(target, drafter, prompt, n, 16, set(), times=t)[1])  # verify cycles
            out = plain(target, prompt, n, set(), times=t)
            cycle = ("draft", "verify", "other")
            row(f"{label}, pass {rep}: spec cycle, block 16", f"{1e3 * sum(t[k] for k in cycle) / c:.1f} ms",
                ", ".join(f"{k} {1e3 * t[k] / c:.1f}" for k in cycle))
            row(f"{label}, pass {rep}: plain step", f"{1e3 * (t['plain_prefill'] + t['plain_step']) / len(out):.1f} ms")


def bench_plan(args):
    """The start-up estimate (ranks.memory_need, as train.py --plan prints it) against the measured
    peak of train.py's own pieces: --preset 27b, a drafter rank (drafter, train.Optimizer,
    dflash_loss on full-length target states) at each --seq; --preset smol, the demo colocated on
    one GPU (data.demo_settings' cuda settings). One setting per process: compiled layers of
    another shape in the same process would recompile as dynamic."""
    from transformers import AutoConfig, LlamaConfig, LlamaForCausalLM
    configure_compile()
    row, gen = table("plan: estimate vs measured peak"), torch.Generator("cuda").manual_seed(0)

    def measure(cfg, dcfg, capture=None):  # -> GiB peak allocated over 3 steps, the state of a run included
        drafter = DFlashDrafter(dcfg).to("cuda", torch.bfloat16)
        optim = Optimizer(cfg, drafter, ONE_DRAFTER)
        V, D, B, S = dcfg.vocab_size, dcfg.hidden_size, cfg.batch_size, cfg.max_length
        embed, head = (torch.randn(V, D, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in "eh")
        for _ in range(3):
            ids, lm = torch.randint(0, V, (B, S), device="cuda"), torch.ones(B, S, device="cuda")
            hidden = capture(ids) if capture else torch.randn(B, S, len(dcfg.target_layer_ids) * D, device="cuda",
                                                              dtype=torch.bfloat16)
            anchors, keep = sample_anchors(lm, cfg.num_anchors, gen)
            r = dflash_loss(drafter, Tables(embed, head), LossBatch(ids, lm, hidden, anchors, keep),
                            loss_options(cfg, torch.device("cuda")))
            r["loss_sum"].backward()
            optim.step(1e-4, r["weight_sum"].item())
        return torch.cuda.max_memory_allocated() / GiB
    tc27, dcfg = AutoConfig.for_model(TARGETS["27b"][0], **QWEN36_27B), DrafterConfig(**PRESETS["27b"])
    for S in (int(s) for s in args.seq.split(",")) if args.preset == "27b" else ():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        cfg = Config(max_length=S, num_anchors=args.anchors, loss_chunk=args.chunk)
        est, got = memory_need(cfg, dcfg, tc27, 8)["drafter"], measure(cfg, dcfg)
        row(f"27B drafter rank, S={S}, {args.anchors} anchors", f"{est:.2f} vs {got:.2f} GiB", f"{est / got - 1:+.1%}")
    if args.preset != "smol":
        return
    cfg, dcfg, tc = Config(**demo_settings("cuda")["train"]), DrafterConfig(**PRESETS["smol"]), LlamaConfig(**SMOLLM2)
    target = LlamaForCausalLM(tc).to("cuda", torch.bfloat16).eval().requires_grad_(False)
    capture = Capture(truncate(target.get_decoder(), max(dcfg.target_layer_ids) + 1), dcfg.target_layer_ids)
    est, got = memory_need(cfg, dcfg, tc, 1)["target+drafter"], measure(cfg, dcfg, capture)
    row(f"demo colocated, S={cfg.max_length} x {cfg.batch_size}, {cfg.num_anchors} anchors",
        f"{est:.2f} vs {got:.2f} GiB", f"{est / got - 1:+.1%}")


CASES = ["ceilings", "drafter --preset 27b --seq 4096,2048 --breakdown", "drafter --preset 27b --eager",
         "drafter --preset 8b --seq 3072 --breakdown", "target --model 8b", "target --model 27b", "e2e --model 8b",
         "target --model 27b --no-fla", "decode", "plan --seq 4096",
         "plan --seq 2048", "plan --preset smol", "drafter --preset 27b --fp8 tensorwise --fp8_head --breakdown",
         "drafter --preset 8b --seq 3072 --fp8 tensorwise --fp8_head --breakdown",
         "drafter --preset 27b --fp8 rowwise --fp8_head --breakdown", "drafter --preset 27b --fp8_head --breakdown",
         "drafter --preset 27b --fp8 tensorwise", "target --model 27b --breakdown --profile --target_fp8",
         "target --model 8b --breakdown --target_fp8", "e2e --model 8b --fp8 tensorwise --fp8_head",
         "e2e --model 8b --fp8 tensorwise --fp8_head --target_fp8", "target --model 27b --torch-conv"]  # 7: when asked


def run_all(args):
    """Every case in a fresh process (no compile state, memory or fla import shared), then one table."""
    rows, failed, out = [], [], f"/tmp/bench-{os.getpid()}.json"
    for case in [CASES[int(i)] for i in args.cases.split(",")] if args.cases else CASES[:7] + CASES[8:]:
        print(f"\n$ python bench.py {case}", flush=True)
        cmd = [sys.executable, __file__, *case.split(), "--json", out]
        try:
            subprocess.run(cmd, timeout=args.case_timeout, check=True)
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired):
            failed.append(case)
        if os.path.exists(out):
            with open(out) as f:
                rows += json.load(f)
            os.remove(out)
    print("\n| case | figure | value | against |\n|---|---|---|---|", *(f"| {' | '.join(r)} |" for r in rows), sep="\n")
    if failed:
        raise SystemExit(f"failed cases: {failed}")


def main(argv=None):
    benches = dict(all=run_all, ceilings=bench_ceilings, drafter=bench_drafter, target=bench_target, e2e=bench_e2e,
                   decode=bench_decode, plan=bench_plan, fp8states=bench_fp8_states)
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", nargs="?", default="all", choices=list(benches))
    ap.add_argument("--preset", default="27b", choices=list(PRESETS), help="drafter: whose drafter")
    ap.add_argument("--model", default="8b", choices=list(TARGETS), help="target, e2e: the target")
    for flag, default, help in (("--seq", "4096", "drafter: comma-separated sequence lengths"), ("--iters", 8, None),
                                ("--cases", "", "all: indices into CASES, e.g. 0,1,2; default all but 7"),
                                ("--json", "", "also write the rows here"), ("--chunk", 64, "objective chunk (blocks)"),
                                ("--markov_rank", 0, "drafter: a Markov head of this rank"),
                                ("--loss_impl", "fused", "drafter: fused | plain (train.py's)"),
                                ("--kd_loss", "none", "drafter: none | kl | l1 (needs plain)"),
                                ("--fp8", "", "drafter, e2e: tensorwise | rowwise FP8 linears (torchao)"),
                                ("--case-timeout", 300, "all: seconds per case"), ("--anchors", 512, None),
                                ("--new_tokens", 128, "decode: new tokens"),
                                ("--seq_e2e", 3072, "e2e; fp8states: tokens per conversation"),
                                ("--target", "", "fp8states: HF folder (default: the demo's target)"),
                                ("--data", "", "fp8states: conversations (default: chitchat)"), ("--convs", 32, None)):
        ap.add_argument(flag, type=type(default), default=default, help=help)  # a str or an int, as its default
    for flag, help in (("--eager", "drafter: layers uncompiled (the 'before')"), ("--breakdown", "drafter, target"),
                       ("--profile", "drafter, target"), ("--no-fla", "27b: transformers' torch fallback kernels"),
                       ("--torch-conv", "target 27b: the short convolution in transformers' torch path, fla elsewhere"),
                       ("--fp8_head", "drafter, e2e: the LM head's matmuls in FP8 (fused)"),
                       ("--confidence_head", "drafter: DSpark's (needs --markov_rank, plain)"),
                       ("--target_fp8",
                        "target, e2e: the target's linears in FP8 (target.Float8Frozen)")):
        ap.add_argument(flag, action="store_true", help=help)
    args = ap.parse_args(argv)
    try:
        benches[args.what](args)
    finally:
        if args.json:
            with open(args.json, "w") as f:
                json.dump(ROWS, f)


if __name__ == "__main__":
    main()
