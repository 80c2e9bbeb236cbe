"""Train a DFlash drafter (arXiv 2602.06036) against a frozen target, a process per GPU (torchrun).

Roles: target ranks hold the frozen target (FSDP2 over the node's target ranks, or replicated),
prefill each sequence and capture the hidden states at `target_layer_ids`; drafter ranks train the
drafter data-parallel. Hidden states flow target -> drafter over point-to-point sends (ranks.py);
one process (one GPU, or CPU) holds both roles. The target itself is target.py; how it is sharded,
`shard_target` here.

    bash launch.sh                        # picks the demo or the real recipe for this machine
    torchrun --nproc_per_node 8 train.py --target=/models/Qwen3.6-27B --data=train.jsonl
    python train.py --preset=demo --device=cpu   # colocated, 1 process
    python -m pytest -q tests/test_train.py

Reading order: Config (edit the defaults, or pass --field=value), the schedule and optimizer,
train() and its loop, main(); below the ruler the plumbing: the loop's bookkeeping (RunState: skipped
steps, log lines, checkpoints), config parsing and checks, the drafting side (bench.py builds its step
with it too), loading the data, sharding the target."""

import importlib.util
import json
import math
import os
import sys
import time
import traceback
import dataclasses
from dataclasses import dataclass, field, fields
from functools import partial

import numpy as np
import torch
import torch.distributed as dist

from attention import compile_count, configure_compile
from checkpoint import (list_ckpts, lock_run_dir, log_line, log_skipped, open_run_dir,
                        plot_curves, resume_point, save_checkpoint, step_metrics,
                        warn_config_changes, write_done, write_run_info)
from fp8 import Float8Head
from loss import LossBatch, LossOptions, Tables, dflash_loss, final_states, sample_anchors
from model import DFlashDrafter, DrafterConfig, drafter_config_from_target, load_drafter, to_float8
from ranks import (USABLE, Colocated, Dist, Receiver, assign_roles, drafter_schedule,
                   largest_anchors, memory_check, on_gpu, per_step, placement_table,
                   reduce_stats, report_failure, role_of, run_target, setup_dist, stop_agreed,
                   stop_job, teardown_dist, torchrun_env, watch_for_death)
from target import (FINAL, default_dtype, frozen_tables, load_for_capture, read_target,
                    target_to_float8)


@dataclass(frozen=True)
class Config:
    # model
    target: str = "Qwen/Qwen3.6-27B"  # HF causal-LM folder (a hub id only where a hub is reachable)
    drafter_layers: int = 5  # decoder layers in the drafter
    target_features: int = 0  # target layers fused by fc (K); 0 = drafter_layers (released rule)
    block_size: int = 16  # tokens per drafted block (anchor + block_size-1 predictions)
    mask_token: str = ""  # a token or an id; "": the tokenizer's mask token, or the first free row
    sliding_layers: int = 4  # the first n drafter layers attend in a sliding window, the rest fully
    sliding_window: int = 2048  # tokens, for sliding layers
    init_drafter: str = ""  # start from this released-format drafter instead of a random init
    # data
    data: str = "train.jsonl"  # conversations, JSONL or JSON array (OpenAI messages or ShareGPT)
    max_length: int = 3072  # tokens per sequence, right-truncated
    batch_size: int = 1  # sequences per micro-batch (one drafter rank, one forward)
    grad_accum: int = 1  # micro-batches per drafter rank per optimizer step
    skip_invalid: bool = False  # skip (and count) broken records instead of stopping at the first
    pad_multiple: int = 128  # sequence length bucket, tokens (fewer distinct shapes, no recompiles)
    # objective (loss.py): the DFlash loss over num_anchors blocks a sequence
    num_anchors: int = 512  # blocks per sequence (padded with invalid blocks: fixed shapes)
    # over block offsets: decay = exp(-(k-1)/gamma) | dpace (loss.dpace_weights)
    loss_weighting: str = "decay"
    gamma: float = 7.0  # decay's scale
    dpace_alpha: float = 0.5  # dpace's smoothing of the drafter's confidence, (1 - alpha) q + alpha
    loss_chunk: int = 64  # blocks per LM-head+CE chunk (0: a sequence's); logits exist per chunk
    # arms, each off by default (loss.py holds their heads and terms): DSpark's Markov head,
    # confidence head and target-distribution term; Domino's correction
    markov_rank: int = 0  # > 0: DSpark's low-rank Markov head of this rank (loss.MarkovHead)
    # DSpark's confidence head (loss.ConfidenceHead): per drafted position, the chance the
    # target accepts it; the engines size verification from it. Needs markov_rank > 0
    confidence_head: bool = False
    confidence_weight: float = 1.0  # the confidence head's BCE beside them (DSpark: 1.0)
    # the confidence head trains on detached features: its BCE moves the head alone, never what
    # the drafter drafts (False: DSpark's, the BCE's gradient reaches the drafter and Markov table)
    confidence_detached: bool = False
    # the target's distribution p (its final state through the LM head) as a target beside the
    # CE: none | kl = KL(p || q) | l1 = sum_v |q_v - p_v| (2x total variation: DSpark's L1)
    kd_loss: str = "none"
    # per row (1 - kd_weight) CE + kd_weight KD; 0.9 with l1 is DSpark's CE 0.1 + L1 0.9
    kd_weight: float = 0.9
    # > 0: Domino's causal correction of this GRU width (loss.domino_head; SpecForge's Domino uses
    # a quarter of the hidden size), through domino_emb_dim to the vocabulary
    domino_gru_dim: int = 0
    domino_emb_dim: int = 256
    # where its rows' labels sit: shifted = offset k predicts the token at anchor+k+1, offset 0's
    # correction off (SpecForge's shift_label true, pure_draft_prefix_len 1: the layout SGLang
    # serves); aligned = offset k predicts anchor+k, every offset corrected (no engine serves it)
    domino_layout: str = "shifted"
    # Domino's blend: the LM head's own CE weighs domino_base_start at step 0, falling linearly
    # to 0 by domino_base_decay of the run; the corrected logits' CE weighs the rest (SpecForge)
    domino_base_start: float = 1.0
    domino_base_decay: float = 0.5
    # optim
    lr: float = 6e-4  # peak learning rate
    beta1: float = 0.9
    beta2: float = 0.999
    weight_decay: float = 0.0
    warmup_ratio: float = 0.04  # fraction of steps with linear warmup, then cosine to 0
    epochs: float = 6.0  # passes over the data
    max_steps: int = 0  # optimizer steps; 0 = derived from epochs (it is also the cosine horizon)
    grad_clip: float = 1.0  # global L2 norm
    max_bad_steps: int = 10  # non-finite steps in a row (each skipped) before the run stops
    # distributed and precision
    target_ranks: int = 5  # processes per node holding the target (FSDP2 mesh within the node)
    drafter_ranks: int = 3  # processes per node training the drafter (data parallel over all nodes)
    target_shard: str = "fsdp"  # fsdp | replicate (a full target copy per target rank)
    # auto | bfloat16 (fp32 master weights and optimizer state) | float32; auto: bf16 on CUDA,
    # on a CPU bf16 only where its matmuls are native, else fp32 (target.default_dtype)
    dtype: str = "auto"
    device: str = "auto"  # auto | cuda | cpu
    compile: bool = True  # CUDA: compile each drafter layer (flex inside); False: eager layers
    fp8: str = ""  # "" (bf16) | tensorwise | rowwise: FP8 drafter linears (model.to_float8)
    fp8_head: bool = False  # the LM head's matmuls (logits, input grad) in FP8 (fp8.Float8Head)
    # the frozen target's linears in FP8 for its forward (target.Float8Frozen); unsharded. Off: its
    # states sit 6-7x further from fp32 than bf16's (BENCHMARKS.md); on: training for a target
    # served in FP8
    target_fp8: bool = False
    prefetch: int = 2  # micro-batches a target rank may have in flight to its drafters
    transport_timeout: int = 900  # seconds before a blocked collective or transfer fails the job
    # logging
    out_dir: str = "out"
    run_name: str = "run"  # run directory under out_dir
    log_every: int = 10  # optimizer steps between log lines
    ckpt_every: int = 500  # optimizer steps between checkpoints (and one at the end)
    keep_ckpts: int = 3  # newest checkpoints kept
    resume: str = ""  # "auto" = newest checkpoint of this run, or a checkpoint directory
    seed: int = 42
    preset: str = ""  # "demo": SmolLM2-135M + chitchat on CPU or 1-7 GPUs (data.demo_settings)
    plan: str = ""  # "NODESxGPUS[:GiB]", e.g. "1x8:80": print the placement and memory plan, exit


# ------------------------------------------------------------------- the schedule and the optimizer
def lr_at(cfg, step, total):
    """Linear warmup from lr/W to lr over W = int(warmup_ratio * total) steps, then cosine to 0."""
    W = int(cfg.warmup_ratio * total)
    if step < W:
        return cfg.lr * (step + 1) / W
    return 0.5 * cfg.lr * (1 + math.cos(math.pi * (step - W) / max(1, total - W)))


class Optimizer:
    """AdamW over fp32 master weights (the drafter itself may be bf16). Gradients go into one flat
    fp32 buffer, reduced once per step over drafter ranks, divided by the global token-weight sum
    (an exact token-weighted mean), clipped."""

    def __init__(self, cfg, drafter, d):
        self.cfg, self.d = cfg, d
        self.params = list(drafter.parameters())
        fp32 = all(p.dtype == torch.float32 for p in self.params)
        if fp32:
            self.masters = self.params
        else:
            self.masters = [p.detach().float().requires_grad_() for p in self.params]
        self.flat = torch.zeros(sum(p.numel() for p in self.params), device=self.params[0].device)
        chunks = self.flat.split([p.numel() for p in self.params])
        self.views = [v.view_as(p) for v, p in zip(chunks, self.params)]
        self.opt = torch.optim.AdamW(self.masters, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2),
                                     weight_decay=cfg.weight_decay, fused=self.flat.is_cuda)

    def step(self, lr, weight_sum, loss_finite=True):
        """p.grad holds d(sum of weighted CE)/dp of this rank -> (global grad norm before clipping,
        applied). A non-finite loss or grad norm drops the step whole (no update, no optimizer-state
        change): every drafter rank sees the same reduced loss and buffer, so all decide alike."""
        for v, p in zip(self.views, self.params):
            if p.grad is None:
                v.zero_()
            else:
                v.copy_(p.grad)
                p.grad = None
        if len(self.d.drafters) > 1:
            dist.all_reduce(self.flat, group=self.d.drafter_group)
        self.flat.div_(max(weight_sum, 1e-12))
        norm = torch.linalg.vector_norm(self.flat)
        gnorm = norm.item()
        if not (loss_finite and math.isfinite(gnorm)):
            return gnorm, False
        self.flat.mul_(torch.clamp(self.cfg.grad_clip / (norm + 1e-6), max=1.0))
        for mp, v in zip(self.masters, self.views):
            mp.grad = v
        for g in self.opt.param_groups:
            g["lr"] = lr
        self.opt.step()
        # fp32 runs: the masters are the params, whose next backward must start from zero
        for mp in self.masters:
            mp.grad = None
        if self.masters is not self.params:
            with torch.no_grad():
                torch._foreach_copy_(self.params, self.masters)
        return gnorm, True

    def weights_finite(self):
        """After an applied step: are all weights finite? The largest |w| of each tensor (fused; no
        overflow, unlike an L2 norm), one host sync."""
        return bool(torch.stack(torch._foreach_norm(self.params, float("inf"))).isfinite().all())

    def load(self, state):
        with torch.no_grad():
            for mp, s in zip(self.masters, state["masters"]):
                mp.copy_(s)
            if self.masters is not self.params:
                torch._foreach_copy_(self.params, self.masters)
        self.opt.load_state_dict(state["optimizer"])


# ----------------------------------------------------------------------------------------- training
def train(cfg, d, target_config, tokenizer):
    """One run on this rank: the data, then its role (the target's forward loop, the drafter's
    training, or both)."""
    dcfg = drafter_cfg(cfg, target_config, tokenizer)
    run_dir = os.path.join(cfg.out_dir, cfg.run_name)
    lock = lock_run_dir(run_dir) if d.rank == 0 else None  # held until this process ends
    if lock:
        print(placement_table(d.world, d.world // d.nnodes, cfg), flush=True)
        memory = memory_check(cfg, dcfg, target_config, d.world)[0]
        print("memory per GPU (estimate):\n" + "\n".join(memory), flush=True)
        write_run_info(run_dir, cfg, d, dcfg)
    batcher = load_data(cfg, d, tokenizer, dcfg.mask_token_id)
    P = per_step(len(d.drafters), cfg.grad_accum)
    if batcher.steps_per_epoch < P and not cfg.max_steps:
        raise ValueError(f"{len(batcher.data)} sequences do not fill one optimizer step of "
                         f"{P * cfg.batch_size}")
    total = cfg.max_steps or max(1, int(cfg.epochs * (batcher.steps_per_epoch // P)))
    resume, state = resume_point(cfg, run_dir)
    start = state["step"] if state else 0
    if d.rank == 0:
        print(f"data: {len(batcher.data)} sequences, {batcher.steps_per_epoch // P} optimizer "
              f"steps/epoch, {total} steps of {P} micro-batches x {cfg.batch_size}"
              + (f"; resuming at step {start}" if state else ""), flush=True)
        warn_config_changes(cfg, state)
    final = final_states(cfg, dcfg)  # the target's final states travel too, after the layers'
    capture = None
    if d.is_target:
        shard = partial(shard_target, mesh=d.target_mesh)
        capture = load_for_capture(cfg.target, dcfg.target_layer_ids + [FINAL] * final,
                                   getattr(torch, cfg.dtype), d.device, shard, cfg.target_fp8,
                                   verbose=d.rank == d.targets[0])
    if not d.is_drafter:
        return run_target(cfg, d, batcher, capture, start, total)

    if d.is_target:  # colocated: this process prefills its own micro-batches
        source = Colocated(batcher, capture, d.device)
    else:
        width = (len(dcfg.target_layer_ids) + final) * dcfg.hidden_size
        schedule = drafter_schedule(d, cfg.grad_accum, start, total)
        source = Receiver(cfg, d, width, getattr(torch, cfg.dtype), schedule)
    side = build_drafting(cfg, dcfg, d, source, state=state)
    if d.leader:
        open_run_dir(run_dir, side.drafter, start if state else None)
    run = RunState(cfg, d, run_dir, start, total, last_good=resume,
                   bad_steps=state.get("bad_steps", 0) if state else 0)
    train_drafter(cfg, d, side, run)


def train_drafter(cfg, d, side, run):
    """The loop: accumulate, all-reduce the statistics, step (or skip a non-finite step), log,
    checkpoint; after a SIGTERM to the job, checkpoint and exit (ranks.stop_agreed)."""
    schedule = drafter_schedule(d, cfg.grad_accum, run.start, run.total)
    for step in range(run.start, run.total):
        s, length = accumulate(step, cfg, side, schedule, run.total)
        s = reduce_stats(s, d)
        stop = stop_agreed(s, d, step + 1, run.total)
        lr = lr_at(cfg, step, run.total)
        t0 = time.perf_counter()
        loss_finite = math.isfinite(s["loss_sum"].item())
        gnorm, applied = side.optim.step(lr, s["weight_sum"].item(), loss_finite)
        # the optimizer's time: busy on every drafter
        s["drafter_s"] += (time.perf_counter() - t0) * len(d.drafters)
        # an update that overflowed cannot be skipped back
        if applied and not side.optim.weights_finite():
            raise FloatingPointError(f"step {step + 1} left non-finite weights (lr={lr:.3g}). "
                                     f"{run.last_good_note()}")
        run.after_step(step + 1, s, gnorm, lr, applied, length)
        if run.checkpoint_due(step + 1) or (stop and not run.streak):
            run.save(step + 1, side)
        if stop:
            stop_job(d.rank, role_of(d.rank, d.targets, d.drafters), step + 1, run.last_good, d.leader)
    run.finish()


def accumulate(step, cfg, side, schedule, steps):
    """The grad_accum micro-batches of optimizer step `step` of the run's `steps` on this drafter
    rank: forward, loss, backward of the un-normalized weighted CE (the optimizer divides) ->
    (summed statistics, last length)."""
    opts = side.opts
    if cfg.domino_gru_dim:
        opts = dataclasses.replace(opts, base_weight=domino_base_weight(cfg, step, steps))
    total = None
    for _ in range(cfg.grad_accum):
        m = next(schedule)
        batch, hidden, target_s = side.source.get(m)
        t0 = time.perf_counter()
        r = drafter_loss(cfg, side, batch, hidden, m, opts)
        r["loss_sum"].backward()
        s = {k: v.detach().double().cpu() for k, v in r.items()}  # .cpu() synchronizes
        seconds = time.perf_counter() - t0
        for k, v in (("tokens", batch["lengths"].sum()), ("sequences", len(batch["lengths"])),
                     ("target_s", target_s), ("drafter_s", seconds)):
            s[k] = torch.tensor(float(v), dtype=torch.float64)
        total = s if total is None else {k: total[k] + s[k] for k in s}
    return total, batch["input_ids"].shape[1]


def drafter_loss(cfg, side, batch, hidden_BSC, m, opts=None):
    """Forward and loss of micro-batch m -> dflash_loss's sums, not yet backpropagated. Its anchors
    depend only on (seed, m): the same sequences get the same blocks whatever the topology."""
    gen = torch.Generator(hidden_BSC.device).manual_seed(cfg.seed * 1_000_003 + m)
    anchors_BN, keep_BN = sample_anchors(batch["loss_mask"], cfg.num_anchors, gen)
    # the layers' states, then the target's final ones when the run sends them (final_states)
    C = len(side.drafter.cfg.target_layer_ids) * side.drafter.cfg.hidden_size
    final_BSD = hidden_BSC[..., C:] if hidden_BSC.shape[-1] > C else None
    inputs = LossBatch(batch["input_ids"], batch["loss_mask"], hidden_BSC[..., :C], anchors_BN,
                       keep_BN, final_BSD)
    return dflash_loss(side.drafter, side.tables, inputs, opts or side.opts)


def main(cfg):
    if cfg.plan:  # dry run, nothing loaded: the placement, the memory per GPU, what fits
        print(plan(cfg))
        return
    env = torchrun_env()
    cfg, why = resolve_dtype(cfg)
    # a config error: a message naming the field and exit 1, before any process group or GPU memory
    try:
        target_config, tokenizer = read_target(cfg.target)
        validate(cfg, env.world, target_config, tokenizer, env.local_world)
    except ValueError as e:
        report_failure(f"[rank {env.rank}] {e}")
        raise SystemExit(f"[rank {env.rank}] {e}") from None
    if env.rank == 0:
        print(why, flush=True)
    role = role_of(env.rank, *assign_roles(env.world, cfg, env.local_world))
    watch_for_death(env.rank, role)
    d = None
    try:
        d = setup_dist(cfg, env)
        train(cfg, d, target_config, tokenizer)
    except BaseException as e:
        msg = (f"[rank {env.rank} ({role})] FAILED: {type(e).__name__}: {e}\n"
               f"{traceback.format_exc()}")
        sys.stdout.flush()
        print(f"\n{msg}", end="", file=sys.stderr, flush=True)
        # a lost peer is a consequence of another rank's exit: stamped after it
        lost_peer = isinstance(e, dist.DistError) or "by peer" in str(e)
        report_failure(msg, time.time() + lost_peer)
        # never wait in NCCL/gloo destructors: torchrun sees the exit and stops every other rank
        os._exit(1)
    finally:
        teardown_dist(d)


# ================================================================= plumbing: bookkeeping, config, data, sharding
@dataclass
class RunState:
    """What the loop carries from one step to the next besides the weights: the non-finite-step
    bookkeeping, the newest good checkpoint, the end of the compile warm-up, and the log interval. A
    skipped step counts in bad_steps (kept across resumes) and in the streak; checkpoints are
    written only outside a streak, so the newest one is the last good one and keep_ckpts never
    prunes it away."""
    cfg: Config
    d: Dist
    run_dir: str
    start: int  # the first step of this process (the resumed checkpoint's)
    total: int
    last_good: str | None = None  # the newest checkpoint of good steps (resume's at first)
    bad_steps: int = 0  # non-finite steps skipped, in all
    streak: int = 0  # ... in a row, up to now
    warm_graphs: int | None = None  # compile_count() once the warm-up is over
    lengths: set = field(default_factory=set)  # padded lengths seen
    window: dict | None = None  # statistics summed over the applied steps since the last log line
    gnorm: float = float("nan")  # of the newest applied step
    logged: int = field(init=False)  # the step of the last log line (start, at first)
    t_log: float = field(init=False)  # when the log interval began

    def __post_init__(self):
        self.logged, self.t_log = self.start, time.perf_counter()

    def after_step(self, done, s, gnorm, lr, applied, length):
        """Book optimizer step `done` (1-based): add an applied one to the log interval, count a
        skipped one (max_bad_steps in a row stop the run), note the end of the warm-up, write the
        log line when due."""
        if applied:
            self.streak, self.gnorm = 0, gnorm
            self.window = s if self.window is None else {k: self.window[k] + s[k] for k in s}
        else:
            self._skip(done, s, gnorm)
        self.lengths.add(length)
        # the warm-up is over once two lengths were seen: compiled code is then dynamic in S
        if self.warm_graphs is None and done - self.start >= 2 and len(self.lengths) >= 2:
            self.warm_graphs = compile_count()
        if done % self.cfg.log_every == 0 or done == self.total:
            self._log(done, lr)

    def _skip(self, done, s, gnorm):
        self.bad_steps += 1
        self.streak += 1
        if self.d.leader:
            loss = s["loss_sum"].item() / max(s["weight_sum"].item(), 1e-12)
            rec = dict(step=done, skipped=True, loss=loss, grad_norm=gnorm, bad_streak=self.streak,
                       bad_steps=self.bad_steps)
            log_skipped(self.run_dir, rec, self.total, self.cfg.max_bad_steps)
        # every drafter rank stops at the same step: they see the same reduced statistics
        if self.streak >= self.cfg.max_bad_steps:
            raise FloatingPointError(
                f"{self.streak} consecutive steps with a non-finite loss or grad norm (steps "
                f"{done - self.streak + 1}-{done}, none applied; "
                f"max_bad_steps={self.cfg.max_bad_steps}). {self.last_good_note()}")

    def _log(self, done, lr):
        dt = time.perf_counter() - self.t_log
        # an interval of skipped steps only has nothing to average: their own lines say it
        if self.d.leader and self.window is not None:
            recompiles = 0 if self.warm_graphs is None else compile_count() - self.warm_graphs
            eta_s = dt / (done - self.logged) * (self.total - done)
            rec = dict(step=done, **step_metrics(self.window, self.d, dt), lr=lr,
                       grad_norm=self.gnorm, recompiles=recompiles, bad_steps=self.bad_steps,
                       eta_s=eta_s)
            log_line(self.run_dir, rec, self.total, self.d.world)
        self.window, self.t_log, self.logged = None, time.perf_counter(), done

    def checkpoint_due(self, done):
        return self.streak == 0 and (done % self.cfg.ckpt_every == 0 or done == self.total)

    def save(self, done, side):
        self.last_good = os.path.join(self.run_dir, f"ckpt-{done:07d}")
        if self.d.leader:
            save_checkpoint(self.run_dir, done, side.drafter, side.optim, self.cfg, self.bad_steps)
            plot_curves(self.run_dir)
            print(f"checkpoint {self.last_good}", flush=True)

    def finish(self):
        if self.d.leader:
            write_done(self.run_dir, self.total, self.bad_steps, self.streak, self.last_good)
        if self.streak:  # the run ends, but not with a checkpoint of its last steps
            raise FloatingPointError(f"the last {self.streak} steps were skipped as non-finite. "
                                     f"{self.last_good_note()}")

    def last_good_note(self):
        ckpt = self.last_good
        return (f"Last good checkpoint: {ckpt or 'none (no checkpoint written yet)'}; after a fix "
                f"(lower lr, check the data) continue with --resume={ckpt or 'auto'}")


def parse_config(argv):
    """--field=value overrides, parsed against the field types; a preset applies first. Unknown key:
    error."""
    kv = {}
    for a in argv:
        if not a.startswith("--") or "=" not in a:
            raise SystemExit(f"arguments are --field=value, got {a!r}")
        k, v = a[2:].split("=", 1)
        kv[k] = v
    types = {f.name: f.type for f in fields(Config)}
    unknown = sorted(set(kv) - set(types))
    if unknown:
        hint = " (fields are spelled with underscores)" if any("-" in k for k in unknown) else ""
        raise SystemExit(f"unknown config field(s) {unknown}{hint}; fields: {sorted(types)}")
    shape = sorted(set(kv) & set(DRAFTER_SHAPE))
    if "init_drafter" in kv and shape:
        raise SystemExit(f"--init_drafter takes the drafter's shape from its config.json: drop "
                         f"--{', --'.join(shape)}")
    base = {}
    if kv.get("preset"):
        if kv["preset"] != "demo":
            raise SystemExit(f"unknown preset {kv['preset']!r}; presets: ['demo']")
        from data import demo_settings  # the demo's corpus, training and eval settings
        device = "cuda" if on_gpu(kv.get("device", "auto")) else "cpu"
        base = dict(demo_settings(device, torchrun_env().world)["train"])
    for k, v in kv.items():
        base[k] = _parse_value(k, v, types[k])
    return Config(**base)


def _parse_value(k, v, t):
    if t in (bool, "bool"):
        words = {"1": True, "true": True, "yes": True, "0": False, "false": False, "no": False}
        if v.lower() not in words:
            raise SystemExit(f"--{k}={v!r}: expected true/false")
        return words[v.lower()]
    try:
        return int(v) if t in (int, "int") else float(v) if t in (float, "float") else v
    except ValueError:
        raise SystemExit(f"--{k}={v!r}: expected {t}") from None


def _each(names, ok, message):
    return [(f, lambda c, t, f=f: ok(getattr(c, f)), message) for f in names]


INF = float("inf")
MAX_STEPS = 10 ** 9
DAY = 86_400  # seconds
PLAN_FORMAT = ("must be NODESxGPUS[:GiB], e.g. 1x8:80 (NODES in [1, 512], GPUS in [1, 64], "
               "GiB in (0, 4096])")
# (field, check(cfg, target text config), message): every failing row is reported, naming its field.
# Numbers are checked against ranges, so nan and inf fail too. A 4th element: the fields a row
# compares with; it is skipped when one of them failed. SHAPE: the fields the drafter config is
# derived from (deriving it is skipped when one fails), and init_drafter, whose config.json replaces
# them.
SHAPE = [
    *_each(["drafter_layers"], lambda x: 1 <= x <= 1024, "must be in [1, 1024]"),
    *_each(["block_size"], lambda x: 2 <= x <= 1024, "must be in [2, 1024]"),
    ("target_features",
     lambda c, t: 1 <= (c.target_features or c.drafter_layers) <= t.num_hidden_layers,
     "must be in [1, {t.num_hidden_layers}] (the target's depth; 0 = drafter_layers)"),
    ("sliding_layers", lambda c, t: 0 <= c.sliding_layers <= c.drafter_layers,
     "must be in [0, drafter_layers={c.drafter_layers}]"),
    # training windows only the context, inference the block's own keys too: they agree only when W
    # >= K
    ("sliding_window", lambda c, t: c.sliding_layers == 0 or c.block_size <= c.sliding_window < INF,
     "must be >= block_size={c.block_size} when sliding_layers > 0",
     ["block_size", "sliding_layers"]),
    ("mask_token", lambda c, t: not _is_id(c.mask_token) or int(c.mask_token) < t.vocab_size,
     "must be < the target vocabulary ({t.vocab_size})"),
    # a V x r, r x V head past rank V is no longer low-rank: it only costs memory and time
    ("markov_rank", lambda c, t: 0 <= c.markov_rank <= min(4096, t.vocab_size),
     "must be in [0, min(4096, the target vocabulary {t.vocab_size})] (0: no Markov head)"),
    ("confidence_detached", lambda c, t: not c.confidence_detached or c.confidence_head,
     "needs confidence_head=true", ["confidence_head"]),
    ("confidence_head", lambda c, t: not c.confidence_head or c.markov_rank > 0,
     "needs markov_rank > 0 (vLLM and SGLang serve a confidence head only on a DSpark "
     "drafter, fed the Markov embedding)", ["markov_rank"]),
    ("domino_gru_dim", lambda c, t: 0 <= c.domino_gru_dim <= 16384, "must be in [0, 16384] (0: no Domino head)"),
    ("domino_gru_dim", lambda c, t: not c.domino_gru_dim or c.markov_rank == 0,
     "a Domino head needs markov_rank=0 (one correction head)", ["markov_rank"]),
    *_each(["domino_emb_dim"], lambda x: 1 <= x <= 16384, "must be in [1, 16384]"),
    ("domino_layout", lambda c, t: c.domino_layout in ("shifted", "aligned"), "must be shifted or aligned"),
    *_each(["domino_base_start", "domino_base_decay"], lambda x: 0 <= x <= 1, "must be in [0, 1]"),
    ("init_drafter",
     lambda c, t: not c.init_drafter or all(os.path.isfile(os.path.join(c.init_drafter, f))
                                            for f in ("config.json", "model.safetensors")),
     "holds no config.json + model.safetensors"),
]
# the Config fields that make the drafter's shape, in one list: drafter_cfg reads them, and
# --init_drafter (whose config.json fixes the shape) refuses them
DRAFTER_SHAPE = list(dict.fromkeys(row[0] for row in SHAPE if row[0] != "init_drafter"))
RULES = SHAPE + [
    ("data", lambda c, t: os.path.isfile(c.data), "is not a file"),
    ("max_length", lambda c, t: c.block_size <= c.max_length <= 2 ** 20,
     "must be in [block_size, 2^20]", ["block_size"]),
    ("num_anchors", lambda c, t: 1 <= c.num_anchors <= c.max_length,
     "must be in [1, max_length] (a sequence has no more anchor positions)", ["max_length"]),
    # a bucket longer than every sequence pads each batch past max_length: the step grows with it
    ("pad_multiple", lambda c, t: 1 <= c.pad_multiple <= c.max_length, "must be in [1, max_length]",
     ["max_length"]),
    *_each(["batch_size", "grad_accum", "log_every", "ckpt_every", "keep_ckpts", "max_bad_steps"],
           lambda x: 1 <= x <= 2 ** 31, "must be in [1, 2^31]"),
    *_each(["prefetch"], lambda x: 1 <= x <= 64,
           "must be in [1, 64] (micro-batches held in flight)"),
    *_each(["transport_timeout"], lambda x: 1 <= x <= 30 * DAY,
           f"must be in [1, {30 * DAY}] seconds"),
    *_each(["loss_chunk"], lambda x: 0 <= x <= 2 ** 31, "must be in [0, 2^31]"),
    *_each(["max_steps"], lambda x: 0 <= x <= MAX_STEPS, f"must be in [0, {MAX_STEPS}]"),
    ("epochs", lambda c, t: 0 < c.epochs <= 1e4 or (c.max_steps > 0 and 0 <= c.epochs < INF),
     "must be in (0, 10000] (finite, and > 0 when max_steps=0)"),
    # what numpy's and torch's RNGs take
    *_each(["seed"], lambda x: 0 <= x < 2 ** 32, "must be in [0, 2^32)"),
    *_each(["lr", "gamma", "grad_clip"], lambda x: 0 < x < INF, "must be > 0 and finite"),
    *_each(["weight_decay"], lambda x: 0 <= x < INF, "must be >= 0 and finite"),
    *_each(["warmup_ratio", "beta1", "beta2"], lambda x: 0 <= x < 1, "must be in [0, 1)"),
    ("dtype", lambda c, t: c.dtype in ("auto", "bfloat16", "float32"),
     "must be auto, bfloat16 or float32"),
    ("loss_weighting", lambda c, t: c.loss_weighting in ("decay", "dpace"),
     "must be decay or dpace"),
    ("kd_loss", lambda c, t: c.kd_loss in ("none", "kl", "l1"), "must be none, kl or l1"),
    *_each(["kd_weight"], lambda x: 0 <= x <= 1, "must be in [0, 1]"),
    *_each(["confidence_weight"], lambda x: 0 <= x < INF, "must be >= 0 and finite"),
    *_each(["dpace_alpha"], lambda x: 0 < x <= 1, "must be in (0, 1]"),
    ("target_shard", lambda c, t: c.target_shard in ("fsdp", "replicate"),
     "must be fsdp or replicate"),
    ("fp8", lambda c, t: c.fp8 in ("", "tensorwise", "rowwise"),
     "must be '', tensorwise or rowwise"),
    ("fp8", lambda c, t: not c.fp8 or importlib.util.find_spec("torchao"),
     "needs torchao (requirements.txt)"),
    ("fp8_head", lambda c, t: not c.fp8_head or t.vocab_size % 16 == t.hidden_size % 16 == 0,
     "needs the target's vocab_size ({t.vocab_size}) and hidden_size ({t.hidden_size}) to be "
     "multiples of 16"),
    ("fp8", lambda c, t: not ((c.fp8 or c.fp8_head or c.target_fp8) and on_gpu(c.device))
     or torch.cuda.get_device_capability() >= (8, 9),
     "fp8, fp8_head and target_fp8 need FP8 tensor cores (compute capability 8.9 or newer)"),
    ("device",
     lambda c, t: c.device in ("auto", "cpu") or (c.device == "cuda" and torch.cuda.is_available()),
     "must be auto, cpu or cuda (cuda only where CUDA is available)"),
    # the run directory is the only place a run writes: run_name is one plain name inside out_dir,
    # never a path
    ("run_name", lambda c, t: _plain(c.run_name),
     "must be a plain directory name inside out_dir (no '/', not '..')"),
    ("run_name",
     lambda c, t: not _plain(c.run_name) or _inside(os.path.join(c.out_dir, c.run_name), c.out_dir),
     "is a link that leads out of out_dir"),
    ("out_dir", lambda c, t: not os.path.exists(c.out_dir) or os.path.isdir(c.out_dir),
     "is not a directory"),
    ("out_dir", lambda c, t: os.access(_existing_parent(c.out_dir), os.W_OK), "is not writable"),
    ("resume",
     lambda c, t: c.resume in ("", "auto")
     or os.path.isfile(os.path.join(c.resume, "train_state.pt")),
     "holds no train_state.pt"),
    ("plan", lambda c, t: not c.plan or _plan_shape(c.plan), PLAN_FORMAT),
]


def _is_id(mask_token):
    # only ASCII digits are an id ("٣".isdigit() is True too); anything else is one token
    return mask_token.isascii() and mask_token.isdigit()


def _plain(name):
    return name not in ("", ".", "..") and os.path.basename(name) == name


def _inside(path, root):
    if not os.path.lexists(path):
        return True
    return os.path.realpath(path).startswith(os.path.realpath(root) + os.sep)


def _plan_shape(text):
    """"NODESxGPUS[:GiB]" -> (nodes, gpus, GiB or None); None for anything else. Bounded: the
    placement table's routing grows with the square of the world size (512 nodes of 8: ~15 s)."""
    shape, colon, gib = text.partition(":")
    nodes, x, gpus = shape.lower().partition("x")
    if not (x and nodes.isascii() and nodes.isdigit() and gpus.isascii() and gpus.isdigit()):
        return None
    try:
        size = float(gib) if colon else None
    except ValueError:
        return None
    ok = 1 <= int(nodes) <= 512 and 1 <= int(gpus) <= 64 and (size is None or 0 < size <= 4096)
    return (int(nodes), int(gpus), size) if ok else None


def _existing_parent(path):
    path = os.path.abspath(path)
    while not os.path.exists(path):
        path = os.path.dirname(path)
    return path


def validate(cfg, world, target_config, tokenizer, local_world=None, device_gib=None):
    """Every config error at once, before any process group or GPU memory. Each message starts with
    the field. device_gib: the memory of one GPU (default: this rank's CUDA device; none on CPU)."""
    tc, errs = target_config.get_text_config(), []
    try:
        assign_roles(world, cfg, local_world)
    except ValueError as e:
        errs.append(str(e))
    failed = []
    for f, ok, m, *after in RULES:
        if not set(*after) & {g for g, _ in failed} and not ok(cfg, tc):
            failed.append((f, m))
    errs += [f"{f}={getattr(cfg, f)!r} {m.format(c=cfg, t=tc)}" for f, m in failed]
    if cfg.target_fp8 and cfg.target_shard == "fsdp" and world > 1:
        errs.append("target_fp8=True needs target_shard=replicate when target ranks are their own "
                    "processes (FSDP2 shards the bf16 weights; their FP8 copies would not be "
                    "sharded)")
    run_dir = os.path.join(cfg.out_dir, cfg.run_name)
    if _plain(cfg.run_name) and not cfg.resume and list_ckpts(run_dir):
        # a fresh run would interleave its checkpoints with the old run's (and prune the wrong ones)
        errs.append(f"resume: {run_dir} already holds checkpoints of an earlier run "
                    f"({list_ckpts(run_dir)[-1]}); --resume=auto continues it, or pick another "
                    f"run_name (or delete the directory)")
    if not {f for f, _ in failed} & {row[0] for row in SHAPE}:
        try:
            dcfg = drafter_cfg(cfg, target_config, tokenizer)
        except (ValueError, KeyError, OSError) as e:
            errs.append(f"drafter config: {e}")
        else:
            ids = dcfg.target_layer_ids
            if not 0 <= min(ids) <= max(ids) < tc.num_hidden_layers:
                errs.append(f"target_layer_ids {ids} must be layers of the target "
                            f"[0, {tc.num_hidden_layers})")
            if dcfg.hidden_size != tc.hidden_size or dcfg.vocab_size != tc.vocab_size:
                errs.append("drafter hidden_size/vocab_size differ from the target's")
            if not errs:
                errs += memory_check(cfg, dcfg, target_config, world, device_gib)[1]
    if errs:
        raise ValueError("invalid config:\n  " + "\n  ".join(errs))


def plan(cfg):
    """--plan=NODESxGPUS[:GiB]: the placement, each role's memory per GPU from the target's
    config.json alone (no weights, tokenizer or GPU), and the largest num_anchors that fits per
    max_length on GiB GPUs (default 80, 141)."""
    from transformers import AutoConfig
    if not _plan_shape(cfg.plan):  # a config error like any other, before anything is read
        raise SystemExit(f"invalid config:\n  plan={cfg.plan!r} {PLAN_FORMAT}")
    nodes, gpus, gib = _plan_shape(cfg.plan)
    world = nodes * gpus
    sizes = [gib] if gib else [80.0, 141.0]
    try:
        assign_roles(world, cfg, gpus)
    except ValueError as e:
        raise SystemExit(f"invalid config:\n  plan={cfg.plan!r}: {e}") from None
    try:
        target_config = AutoConfig.from_pretrained(cfg.target, trust_remote_code=False)
    except (OSError, ValueError) as e:
        raise SystemExit(f"--plan needs the target's config.json: --target={cfg.target!r}: "
                         f"{e}") from None
    if cfg.device == "auto":  # planned for GPUs
        cfg = dataclasses.replace(cfg, device="cuda")
    cfg = resolve_dtype(cfg)[0]
    # which mask token: no matter for the memory
    dcfg = drafter_cfg(dataclasses.replace(cfg, mask_token="0"), target_config, None)
    lines = memory_check(cfg, dcfg, target_config, world, sizes[-1])[0]
    out = [placement_table(world, gpus, cfg),
           f"memory per GPU (estimate) at max_length={cfg.max_length}, "
           f"num_anchors={cfg.num_anchors}, batch_size={cfg.batch_size}, {cfg.dtype}:", *lines,
           f"largest num_anchors that fits (estimates within {USABLE:.0%} of a GPU of "
           f"{' or '.join(f'{g:g}' for g in sizes)} GiB):"]
    for S in sorted({1024, 2048, 4096, 8192, 16384, cfg.max_length}):
        c = dataclasses.replace(cfg, max_length=S)
        fits = [f"{largest_anchors(c, dcfg, target_config, world, USABLE * g)} on {g:g} GiB"
                for g in sizes]
        out.append(f"  max_length={S}: " + ", ".join(fits))
    return "\n".join(out)


def resolve_dtype(cfg):
    """dtype=auto -> the one target.default_dtype picks for this device -> (cfg, the start-up line
    saying why)."""
    if cfg.dtype != "auto":
        return cfg, f"dtype: {cfg.dtype} (--dtype)"
    dtype, why = default_dtype("cuda" if on_gpu(cfg.device) else "cpu")
    name = str(dtype).removeprefix("torch.")
    return dataclasses.replace(cfg, dtype=name), f"dtype: {name} ({why}; --dtype overrides)"


def drafter_cfg(cfg, target_config, tokenizer):
    """The drafter's DrafterConfig: init_drafter's config.json, or the target's sizes (model.
    drafter_config_from_target) with the Config's DRAFTER_SHAPE fields."""
    if cfg.init_drafter:
        with open(os.path.join(cfg.init_drafter, "config.json")) as f:
            return DrafterConfig.from_json_dict(json.load(f))
    mask = int(cfg.mask_token) if _is_id(cfg.mask_token) else (cfg.mask_token or None)
    return drafter_config_from_target(target_config, tokenizer, mask_token=mask,
                                      num_target_features=cfg.target_features or None,
                                      **drafter_layers(cfg))


def drafter_layers(cfg):
    """The DrafterConfig fields that the Config's layer fields set: depth, block, attention kinds,
    Markov and confidence heads (bench.py gives its drafter presets these too)."""
    L, n = cfg.drafter_layers, cfg.sliding_layers
    return dict(num_hidden_layers=L, block_size=cfg.block_size,
                layer_types=["sliding_attention"] * n + ["full_attention"] * (L - n),
                sliding_window=cfg.sliding_window if n else None, markov_rank=cfg.markov_rank,
                confidence_head=cfg.confidence_head, domino_gru_dim=cfg.domino_gru_dim,
                domino_emb_dim=cfg.domino_emb_dim,
                **(dict(domino_shift_label=True, domino_prefix_len=1)
                   if cfg.domino_gru_dim and cfg.domino_layout == "shifted" else {}))


def domino_base_weight(cfg, step, total):
    """Domino's weight on the LM head's own CE at optimizer step `step` (0-based) of `total`:
    domino_base_start, falling linearly to 0 at domino_base_decay * total, then 0 (SpecForge
    `linear_lambda_base`). No Domino head: 0."""
    if not cfg.domino_gru_dim:
        return 0.0
    ramp = max(1, int(total * cfg.domino_base_decay))
    return max(0.0, min(1.0, cfg.domino_base_start * (1 - min(step / ramp, 1.0))))


def loss_options(cfg, device):
    """The objective's options from Config."""
    return LossOptions(weighting=cfg.loss_weighting, gamma=cfg.gamma, alpha=cfg.dpace_alpha,
                       chunk_blocks=cfg.loss_chunk,
                       backend="flex" if device.type == "cuda" else "sdpa",
                       kd=cfg.kd_loss, kd_weight=cfg.kd_weight,
                       confidence_weight=cfg.confidence_weight,
                       confidence_detached=cfg.confidence_detached)


@dataclass(frozen=True)
class Drafting:
    """A drafter rank's side of the step, built by build_drafting: what train_drafter reads and
    changes."""
    drafter: DFlashDrafter  # trained
    tables: Tables  # the target's embedding and LM head, frozen (fp8_head: an fp8.Float8Head)
    optim: Optimizer
    source: object  # .get(m) -> (batch, hidden states, target seconds): Colocated or Receiver
    opts: LossOptions  # the objective's options (loss_options)


def build_drafting(cfg, dcfg, d, source, tables=None, state=None):
    """The drafter of dcfg (or init_drafter's) on d.device in cfg.dtype with its variants (fp8
    linears, the FP8 LM head), the frozen (embedding, LM head) tables (default: read from
    cfg.target; bench.py passes random ones), and the optimizer (state: a checkpoint's, when
    resuming). Seeded: every drafter rank starts alike."""
    dtype = getattr(torch, cfg.dtype)
    torch.manual_seed(cfg.seed)
    drafter = load_drafter(cfg.init_drafter) if cfg.init_drafter else DFlashDrafter(dcfg)
    drafter = drafter.to(d.device, dtype)
    drafter.compile_layers = cfg.compile
    if cfg.fp8:  # before the optimizer and the compile; emulated on CPU (the same path, no speedup)
        to_float8(drafter, cfg.fp8, emulate=d.device.type != "cuda")
    embed, head = tables or frozen_tables(cfg.target, dtype, d.device)
    if cfg.fp8_head:
        head = Float8Head(head)
    optim = Optimizer(cfg, drafter, d)
    if state:
        optim.load(state)
    if d.device.type == "cuda":
        configure_compile()
        if d.leader:
            print("compiling the drafter layers and flex attention: the first steps (two lengths) "
                  "take longer", flush=True)
    return Drafting(drafter, Tables(embed, head), optim, source, loss_options(cfg, d.device))


def load_data(cfg, d, tokenizer, mask_id):
    """Rank 0 tokenizes into the on-disk cache once; every other rank then maps it. -> Batcher. The
    mask token must be one the data never holds: a drafter could not tell a masked slot from that
    token."""
    from data import Batcher, default_cache_dir, load_tokenized

    def load():
        cache = default_cache_dir() / "tokenized"
        return load_tokenized(cfg.data, tokenizer, cfg.max_length, cache,
                              skip_invalid=cfg.skip_invalid)
    data = load() if d.rank == 0 else None
    if d.world > 1:
        dist.barrier(group=d.transport)
    data = data if data is not None else load()
    hits = np.flatnonzero(np.asarray(data.ids) == mask_id)
    if hits.size:
        i = int(np.searchsorted(data.offsets, hits[0], side="right")) - 1
        text = tokenizer.decode(data.ids[max(data.offsets[i], hits[0] - 12):hits[0] + 4])
        token = tokenizer.convert_ids_to_tokens(mask_id)
        where = f"{cfg.data}:{int(data.lines[i])}"
        raise ValueError(f"mask_token: {token!r} (id {mask_id}) occurs {hits.size} times in the "
                         f"tokenized data, first at {where} (...{text!r}...); choose a token the "
                         f"data never uses")
    return Batcher(data, cfg.batch_size, seed=cfg.seed, pad_id=tokenizer.pad_token_id or 0,
                   pad_multiple=cfg.pad_multiple)


def shard_target(decoder, mesh):
    """How the frozen target is parallelized (what it is: target.py): FSDP2 on the node's target
    mesh, each decoder layer then the root, resharded after every forward as inference wants;
    mesh None (colocated, or target_shard=replicate): a whole copy on every target rank."""
    if mesh is not None:
        from torch.distributed.fsdp import fully_shard
        for module in [*decoder.layers, decoder]:
            fully_shard(module, mesh=mesh, reshard_after_forward=True)
    return decoder


def target_variants(cfg, decoder):
    """What the Config changes in a target built outside target.load_for_capture (bench.py's random
    ones), as load_for_capture does: with target_fp8 its linears in FP8. -> FP8 linears."""
    return target_to_float8(decoder) if cfg.target_fp8 else 0


if __name__ == "__main__":
    main(parse_config(sys.argv[1:]))
