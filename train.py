"""
Train a DFlash drafter against a frozen target, one process per GPU (torchrun).

Roles: target ranks hold the frozen target (FSDP2 over the target sub-mesh, or replicated), prefill each sequence
and capture the hidden states at `target_layer_ids`; drafter ranks train the drafter data-parallel with compiled
flex attention. Hidden states flow target -> drafter over point-to-point sends on a dedicated transport group.
With one process (one GPU, or CPU) both roles run in that process, with no transport.

    bash launch.sh                                   # picks the preset for this machine
    torchrun --nproc_per_node 8 train.py --target=/models/Qwen3.6-27B --data=train.jsonl
    python train.py --preset=demo --device=cpu       # colocated, 1 process
    python -m pytest -q tests/test_train.py

Edit the defaults in Config below; every field can be overridden with --field=value.
"""

import datetime
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
import traceback
from collections import deque
from dataclasses import asdict, dataclass, fields

import torch
import torch.distributed as dist

from attention import compile_count, configure_compile
from model import (DFlashDrafter, DrafterConfig, dflash_loss, drafter_config_from_target, load_drafter,
                   sample_anchors, save_drafter)


@dataclass(frozen=True)
class Config:
    # model
    target: str = "Qwen/Qwen3.6-27B"  # HF causal-LM folder (a hub id only where a hub is reachable)
    drafter_layers: int = 5  # decoder layers in the drafter
    target_features: int = 0  # target layers fused by fc (K); 0 = drafter_layers (released rule)
    block_size: int = 16  # tokens per drafted block (anchor + block_size-1 predictions)
    mask_token: str = ""  # mask token string or id; "" = tokenizer's mask token, else first free embedding row
    sliding_layers: int = 4  # the first n drafter layers use sliding-window attention, the rest full
    sliding_window: int = 2048  # tokens, for sliding layers
    init_drafter: str = ""  # start from this released-format drafter instead of a random init
    # data
    data: str = "train.jsonl"  # conversations, JSONL or JSON array (OpenAI messages or ShareGPT)
    max_length: int = 3072  # tokens per sequence, right-truncated
    batch_size: int = 1  # sequences per micro-batch (one drafter rank, one forward)
    grad_accum: int = 1  # micro-batches per drafter rank per optimizer step
    num_anchors: int = 512  # blocks per sequence (padded with invalid blocks: fixed shapes)
    gamma: float = 7.0  # loss decay over block offsets, exp(-(k-1)/gamma)
    loss_chunk: int = 64  # blocks per lm_head+CE chunk (0 = one sequence's blocks); the logits exist per chunk only
    skip_invalid: bool = False  # skip (and count) broken records instead of stopping at the first
    pad_multiple: int = 128  # sequence length bucket, tokens (fewer distinct shapes, no recompiles)
    # optim
    lr: float = 6e-4  # peak learning rate
    beta1: float = 0.9
    beta2: float = 0.999
    weight_decay: float = 0.0
    warmup_ratio: float = 0.04  # fraction of steps with linear warmup, then cosine to 0
    epochs: float = 6.0  # passes over the data
    max_steps: int = 0  # optimizer steps; 0 = derived from epochs (it is also the cosine horizon)
    grad_clip: float = 1.0  # global L2 norm
    max_bad_steps: int = 10  # consecutive steps with a non-finite loss or grad norm (skipped) before the run stops
    # distributed
    target_ranks: int = 5  # processes per node holding the target (FSDP2 mesh within the node)
    drafter_ranks: int = 3  # processes per node training the drafter (data parallel over all nodes)
    target_shard: str = "fsdp"  # fsdp | replicate (a full target copy per target rank)
    dtype: str = "bfloat16"  # bfloat16 (fp32 master weights and optimizer state) | float32
    device: str = "auto"  # auto | cuda | cpu
    compile: bool = True  # CUDA: compile each drafter layer (flex attention inside); False = eager layers, flex compiled
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
    preset: str = ""  # "demo": small target and data for CPU or 1-7 GPUs (see PRESETS)
    plan: str = ""  # "NODESxGPUS", e.g. "2x8": print the placement table for that machine and exit (no GPU)


PRESETS = {
    # SmolLM2-135M-Instruct + chitchat prompts answered by it (data.py prepare_demo)
    "demo": dict(target="{cache}/smollm2-135m-instruct", data="{cache}/chitchat_train.jsonl",
                 mask_token="<empty_output>", drafter_layers=2, target_features=5, sliding_layers=0,
                 max_length=384, batch_size=4, num_anchors=32, loss_chunk=0, lr=2e-3, warmup_ratio=0.05,
                 epochs=3.0, target_ranks=2, drafter_ranks=1, log_every=10, ckpt_every=100, pad_multiple=64),
    # the same demo on GPUs: a 5-layer drafter, responses of up to 256 tokens, every response position anchored
    "demo_gpu": dict(target="{cache}/smollm2-135m-instruct", data="{cache}/chitchat_train.jsonl",
                     mask_token="<empty_output>", drafter_layers=5, target_features=5, sliding_layers=0,
                     max_length=512, batch_size=16, num_anchors=256, loss_chunk=0, lr=6e-4, warmup_ratio=0.04,
                     epochs=4.3,  # 3,504 steps of 16 on the 13,050 kept of 13,185 answers: the reference recipe's
                     # ~6 minutes on one H200 (ANCHORS §6) at our speed, a third of the epochs on 4.4x the text
                     target_ranks=1, drafter_ranks=1, log_every=50, ckpt_every=1000, pad_multiple=64),
}


def parse_config(argv):
    """--field=value overrides, parsed against the field types; a preset applies first. Unknown key: error."""
    kv = {}
    for a in argv:
        if not a.startswith("--") or "=" not in a:
            raise SystemExit(f"arguments are --field=value, got {a!r}")
        k, v = a[2:].split("=", 1)
        kv[k.replace("-", "_")] = v
    types = {f.name: f.type for f in fields(Config)}
    unknown = sorted(set(kv) - set(types))
    if unknown:
        raise SystemExit(f"unknown config field(s) {unknown}; fields: {sorted(types)}")
    base = {}
    if kv.get("preset"):
        if kv["preset"] not in PRESETS:
            raise SystemExit(f"unknown preset {kv['preset']!r}; presets: {sorted(PRESETS)}")
        from data import default_cache_dir
        base = {k: v.format(cache=default_cache_dir()) if isinstance(v, str) else v
                for k, v in PRESETS[kv["preset"]].items()}
    for k, v in kv.items():
        t = types[k]
        if t in (bool, "bool"):
            if v.lower() not in ("1", "true", "yes", "0", "false", "no"):
                raise SystemExit(f"--{k}={v!r}: expected true/false")
            base[k] = v.lower() in ("1", "true", "yes")
            continue
        try:
            base[k] = int(v) if t in (int, "int") else float(v) if t in (float, "float") else v
        except ValueError:
            raise SystemExit(f"--{k}={v!r}: expected {t}") from None
    return Config(**base)

# -----------------------------------------------------------------------------
# topology and process groups


def assign_roles(world, cfg, local_world=None):
    """-> (target ranks, drafter ranks), global ranks. One process: both roles on rank 0 (colocated).
    Several nodes: every node gets the same split, its first target_ranks local ranks hold the target (torchrun
    numbers ranks node by node), so each node's targets feed only that node's drafters, over NVLink."""
    if world == 1:
        return [0], [0]
    local_world = local_world or world
    if world % local_world:
        raise ValueError(f"world size {world} is not a multiple of the processes per node ({local_world})")
    if cfg.target_ranks + cfg.drafter_ranks != local_world:
        raise ValueError(f"target_ranks ({cfg.target_ranks}) + drafter_ranks ({cfg.drafter_ranks}) must equal "
                         f"the world size ({world})" if local_world == world else
                         f"the processes per node ({local_world})")
    if cfg.target_ranks < 1 or cfg.drafter_ranks < 1:
        raise ValueError("need at least one target rank and one drafter rank")
    nodes = range(0, world, local_world)
    return ([n + i for n in nodes for i in range(cfg.target_ranks)],
            [n + i for n in nodes for i in range(cfg.target_ranks, local_world)])


def route(m, targets, drafters, nnodes, grad_accum):
    """Micro-batch m -> (target rank that prefills it, drafter rank that trains on it, its index k on that node).
    Drafters take m round-robin (m % Dr); node n's micro-batches, in increasing m, are numbered k = 0, 1, ... and
    dealt round-robin to node n's targets. One node: k == m and the target is targets[m % T]."""
    Dr, per_step = len(drafters), len(drafters) * grad_accum
    D, T = Dr // nnodes, len(targets) // nnodes  # per node
    j = m % Dr
    n, dl = divmod(j, D)
    k = ((m // per_step) * grad_accum + (m % per_step) // Dr) * D + dl
    return targets[n * T + k % T], drafters[j], k


def node_micro_batch(k, n, nnodes, n_drafters, grad_accum):
    """Inverse of route: the k-th micro-batch of node n -> its global index m."""
    D = n_drafters // nnodes
    step_acc, dl = divmod(k, D)
    s, a = divmod(step_acc, grad_accum)
    return s * n_drafters * grad_accum + a * n_drafters + n * D + dl


@dataclass(frozen=True)
class Dist:
    rank: int
    world: int
    device: torch.device
    targets: list  # global ranks with the target role
    drafters: list  # global ranks with the drafter role
    nnodes: int  # torchrun nodes (WORLD_SIZE / LOCAL_WORLD_SIZE)
    target_mesh: object  # DeviceMesh over targets (None when colocated or replicated)
    drafter_group: object  # process group over drafters (None when colocated)
    transport: object  # process group used only for target -> drafter sends

    @property
    def is_target(self):
        return self.rank in self.targets

    @property
    def is_drafter(self):
        return self.rank in self.drafters

    @property
    def role(self):
        return "target+drafter" if self.is_target and self.is_drafter else "target" if self.is_target else "drafter"

    @property
    def leader(self):  # the drafter rank that logs and writes checkpoints
        return self.rank == self.drafters[0]


def setup_dist(cfg):
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    use_cuda = cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())
    if use_cuda:
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)  # before any NCCL call, or P2P can hang (batch_isend_irecv docs)
        device = torch.device("cuda", local)
    else:
        device = torch.device("cpu")
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    targets, drafters = assign_roles(world, cfg, local_world)
    nnodes = world // local_world
    if world == 1:
        return Dist(rank, world, device, targets, drafters, 1, None, None, None)
    timeout = datetime.timedelta(seconds=cfg.transport_timeout)
    dist.init_process_group("nccl" if use_cuda else "gloo", timeout=timeout, device_id=device if use_cuda else None)
    # every rank builds every group, in this order (SPMD: a mismatch hangs silently)
    # The target is sharded within each node and replicated across nodes: it is frozen, so replicas never
    # synchronize, and its per-forward all-gathers stay on NVLink (README "Across nodes" has the arithmetic).
    from torch.distributed.device_mesh import DeviceMesh
    T = len(targets) // nnodes
    node_groups = [dist.new_group(targets[n * T:(n + 1) * T]) for n in range(nnodes)]
    target_mesh = None
    if cfg.target_shard == "fsdp" and rank in targets:
        target_mesh = DeviceMesh.from_group(node_groups[targets.index(rank) // T], device.type)
    drafter_group = dist.new_group(drafters)
    transport = dist.new_group(list(range(world)), timeout=timeout)
    dist.barrier(group=transport)  # creates the transport communicator on every rank now, not mid-run
    return Dist(rank, world, device, targets, drafters, nnodes, target_mesh, drafter_group, transport)


def teardown_dist(d):
    if d is not None and d.world > 1 and dist.is_initialized():
        dist.destroy_process_group()


def validate(cfg, world, target_config, tokenizer, local_world=None):
    """Every config error at once, before any process group or GPU memory. Each message starts with the field."""
    errs = []
    try:
        assign_roles(world, cfg, local_world)
    except ValueError as e:
        errs.append(str(e))
    tc = target_config.get_text_config()
    n_shape = len(errs)  # the fields the drafter config is derived from, checked first
    if cfg.drafter_layers < 1:
        errs.append(f"drafter_layers={cfg.drafter_layers} must be >= 1")
    n_feat = cfg.target_features or cfg.drafter_layers
    if not 1 <= n_feat <= tc.num_hidden_layers:
        errs.append(f"target_features={n_feat} must be in [1, {tc.num_hidden_layers}] (target depth)")
    if cfg.block_size < 2:
        errs.append(f"block_size={cfg.block_size} must be >= 2")
    if not 0 <= cfg.sliding_layers <= cfg.drafter_layers:
        errs.append(f"sliding_layers={cfg.sliding_layers} must be in [0, drafter_layers={cfg.drafter_layers}]")
    if cfg.sliding_layers > 0 and cfg.sliding_window < 1:
        errs.append(f"sliding_window={cfg.sliding_window} must be >= 1 when sliding_layers > 0")
    if cfg.mask_token.isdigit() and int(cfg.mask_token) >= tc.vocab_size:
        errs.append(f"mask_token={cfg.mask_token} must be < the target vocabulary ({tc.vocab_size})")
    shape_ok = len(errs) == n_shape  # else deriving the drafter config would only repeat these errors
    if not os.path.isfile(cfg.data):
        errs.append(f"data: no such file {cfg.data!r}")
    if cfg.max_length < cfg.block_size:
        errs.append(f"max_length={cfg.max_length} must be >= block_size={cfg.block_size}")
    for name in ("batch_size", "grad_accum", "num_anchors", "pad_multiple", "prefetch",
                 "transport_timeout", "log_every", "ckpt_every", "keep_ckpts", "max_bad_steps"):
        if getattr(cfg, name) < 1:
            errs.append(f"{name}={getattr(cfg, name)} must be >= 1")
    for name in ("lr", "gamma", "grad_clip"):
        if not getattr(cfg, name) > 0:  # also catches nan
            errs.append(f"{name}={getattr(cfg, name)} must be > 0")
    for name in ("warmup_ratio", "beta1", "beta2"):
        if not 0 <= getattr(cfg, name) < 1:
            errs.append(f"{name}={getattr(cfg, name)} must be in [0, 1)")
    for name in ("weight_decay", "loss_chunk", "max_steps"):
        if getattr(cfg, name) < 0:
            errs.append(f"{name}={getattr(cfg, name)} must be >= 0")
    if cfg.max_steps == 0 and not cfg.epochs > 0:
        errs.append(f"epochs={cfg.epochs} must be > 0 when max_steps=0")
    if cfg.dtype not in ("bfloat16", "float32"):
        errs.append(f"dtype={cfg.dtype!r} must be bfloat16 or float32")
    if cfg.target_shard not in ("fsdp", "replicate"):
        errs.append(f"target_shard={cfg.target_shard!r} must be fsdp or replicate")
    if cfg.device not in ("auto", "cuda", "cpu") or (cfg.device == "cuda" and not torch.cuda.is_available()):
        errs.append(f"device={cfg.device!r} must be auto, cpu or cuda (cuda only where CUDA is available)")
    # the run directory is the only place a run writes: run_name is one plain name inside out_dir, never a path
    if cfg.run_name in ("", ".", "..") or os.path.basename(cfg.run_name) != cfg.run_name:
        errs.append(f"run_name={cfg.run_name!r} must be a plain directory name inside out_dir (no '/', not '..')")
    elif not cfg.resume and list_ckpts(os.path.join(cfg.out_dir, cfg.run_name)):
        # a fresh run would interleave its checkpoints with the old run's (and prune the wrong ones)
        run_dir = os.path.join(cfg.out_dir, cfg.run_name)
        errs.append(f"resume: {run_dir} already holds checkpoints of an earlier run ({list_ckpts(run_dir)[-1]}); "
                    f"--resume=auto continues it, or pick another run_name (or delete the directory)")
    parent = os.path.abspath(cfg.out_dir)
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.access(parent, os.W_OK):
        errs.append(f"out_dir: {cfg.out_dir!r} is not writable ({parent})")
    if cfg.resume not in ("", "auto") and not os.path.isfile(os.path.join(cfg.resume, "train_state.pt")):
        errs.append(f"resume: {cfg.resume!r} holds no train_state.pt")
    if cfg.init_drafter and not all(os.path.isfile(os.path.join(cfg.init_drafter, f))
                                    for f in ("config.json", "model.safetensors")):
        errs.append(f"init_drafter: {cfg.init_drafter!r} holds no config.json + model.safetensors")
    elif shape_ok:
        try:
            dcfg = drafter_cfg(cfg, target_config, tokenizer)
        except (ValueError, KeyError, OSError) as e:
            errs.append(f"drafter config: {e}")
        else:
            if not 0 <= min(dcfg.target_layer_ids) <= max(dcfg.target_layer_ids) < tc.num_hidden_layers:
                errs.append(f"target_layer_ids {dcfg.target_layer_ids} must be layers of the target "
                            f"[0, {tc.num_hidden_layers})")
            if dcfg.hidden_size != tc.hidden_size or dcfg.vocab_size != tc.vocab_size:
                errs.append("drafter hidden_size/vocab_size differ from the target's")
    if errs:
        raise ValueError("invalid config:\n  " + "\n  ".join(errs))


def drafter_cfg(cfg, target_config, tokenizer):
    if cfg.init_drafter:
        with open(os.path.join(cfg.init_drafter, "config.json")) as f:
            return DrafterConfig.from_json_dict(json.load(f))
    mask = cfg.mask_token
    mask = int(mask) if mask.isdigit() else (mask or None)
    n = cfg.sliding_layers
    return drafter_config_from_target(
        target_config, tokenizer, num_layers=cfg.drafter_layers, num_target_features=cfg.target_features or None,
        block_size=cfg.block_size, mask_token=mask,
        layer_types=["sliding_attention"] * n + ["full_attention"] * (cfg.drafter_layers - n),
        sliding_window=cfg.sliding_window if n else None)

# -----------------------------------------------------------------------------
# target side: load (meta init, per-rank shard loading), shard, capture


class Weights:
    """Tensors of an HF checkpoint folder, read one at a time (never the whole model in host memory)."""

    def __init__(self, path):
        from safetensors import safe_open
        idx = os.path.join(path, "model.safetensors.index.json")
        if os.path.exists(idx):
            with open(idx) as f:
                files = sorted(set(json.load(f)["weight_map"].values()))
        else:
            files = ["model.safetensors"]
        self.where = {}
        for name in files:
            h = safe_open(os.path.join(path, name), "pt")
            self.where.update({k: h for k in h.keys()})

    def name(self, key):
        """A text-model key in the checkpoint's spelling (VLM checkpoints nest it under model.language_model)."""
        for cand in (key, key.replace("model.", "model.language_model.", 1), key.replace("model.", "", 1)):
            if cand in self.where:
                return cand
        raise KeyError(f"tensor {key!r} not found in the target checkpoint")

    def get(self, key):
        name = self.name(key)
        return self.where[name].get_tensor(name)


def load_target(cfg, dcfg, d, dtype):
    """The target's decoder up to the deepest captured layer (later layers and the LM head are never built nor run),
    created on the meta device, sharded with FSDP2 on the target mesh (per layer, then the root) or replicated,
    materialized on this rank's device, then filled tensor by tensor with this rank's shard only: peak host memory
    is one full tensor, not the model."""
    from transformers import AutoConfig, AutoModelForCausalLM
    tc = AutoConfig.from_pretrained(cfg.target).get_text_config()
    keep = max(dcfg.target_layer_ids) + 1
    tc.num_hidden_layers = keep
    if getattr(tc, "layer_types", None):
        tc.layer_types = tc.layer_types[:keep]
    with torch.device("meta"):
        base = AutoModelForCausalLM.from_config(tc, dtype=dtype).get_decoder()  # no lm_head
    base.requires_grad_(False).eval()
    if d.target_mesh is not None:
        from torch.distributed.fsdp import fully_shard
        for layer in base.layers:
            fully_shard(layer, mesh=d.target_mesh, reshard_after_forward=True)
        fully_shard(base, mesh=d.target_mesh, reshard_after_forward=True)  # inference: reshard the root too
    base.to_empty(device=d.device)
    w = Weights(cfg.target)
    t0 = time.time()
    params = dict(base.named_parameters())
    for i, (name, p) in enumerate(params.items()):
        full = w.get("model." + name).to(dtype)
        if hasattr(p, "to_local"):  # FSDP2 DTensor: this mesh rank's dim-0 chunk, as fully_shard splits it
            chunks = torch.chunk(full, d.target_mesh.size(), dim=0)
            r = d.target_mesh.get_local_rank()
            p.to_local().copy_(chunks[r] if r < len(chunks) else full[:0])
        else:
            p.data.copy_(full)
        if d.rank == d.targets[0] and (i + 1) % max(1, len(params) // 5) == 0:
            print(f"  target weights {i + 1}/{len(params)} ({time.time() - t0:.0f}s)", flush=True)
    for mname, mod in base.named_modules():
        for bname, buf in mod._buffers.items():
            if buf is not None and bname not in mod._non_persistent_buffers_set:
                buf.copy_(w.get("model." + (f"{mname}.{bname}" if mname else bname)))
    _reinit_nonpersistent_buffers(base)
    return base


def _reinit_nonpersistent_buffers(model):
    """to_empty leaves non-persistent buffers (rotary inv_freq) uninitialized: rebuild them from the module's own
    config, in fp32 on CPU, and copy. Any other such buffer is an error, never garbage."""
    for mname, mod in model.named_modules():
        names = [b for b in mod._non_persistent_buffers_set if mod._buffers.get(b) is not None]
        if not names:
            continue
        if not hasattr(mod, "config"):
            raise RuntimeError(f"cannot initialize non-persistent buffers {names} of {mname} ({type(mod).__name__})")
        fresh = type(mod)(config=mod.config)
        for b in names:
            mod._buffers[b].copy_(fresh._buffers[b])


class Capture:
    """Forward hooks on the decoder layers in target_layer_ids: id k = OUTPUT of decoder layer k, which is HF
    output_hidden_states[k+1] (spec §1.2); raw residual stream, no final norm. Concatenated in id order."""

    def __init__(self, base, layer_ids):
        self.base, self.ids, self.out = base, list(layer_ids), {}
        for i in set(self.ids):
            base.layers[i].register_forward_hook(self._hook(i))

    def _hook(self, i):
        def hook(mod, args, output):
            self.out[i] = output[0] if isinstance(output, tuple) else output
        return hook

    @torch.no_grad()
    def __call__(self, input_ids_BS):
        # right padding + causal attention: real tokens never see pads, so no attention mask is needed
        self.base(input_ids=input_ids_BS, use_cache=False)
        h = torch.cat([self.out[i] for i in self.ids], dim=-1)  # [B, S, K*D]
        self.out.clear()
        return h


def load_frozen_tables(path, dtype, device):
    """Only the embedding and LM head from the target checkpoint (a tied target reuses the embedding)."""
    w = Weights(path)
    embed = w.get("model.embed_tokens.weight")
    try:
        head = w.get("lm_head.weight")
    except KeyError:
        head = embed
    return embed.to(device, dtype), head.to(device, dtype)

# -----------------------------------------------------------------------------
# the schedule: static, so every rank knows whom it talks to and nobody needs a coordinator
#   micro-batch m (a global counter) belongs to optimizer step m // (drafters * grad_accum),
#   is read and prefilled by target rank targets[m % T] and trained on by drafter rank drafters[m % Dr].
#   Every rank walks its micro-batches in increasing m, so the lowest outstanding transfer can always proceed.


def batch_at(batcher, m):
    """Micro-batch m of the global stream: epoch m // steps_per_epoch, position m % steps_per_epoch."""
    batcher.epoch, batcher.step = divmod(m, batcher.steps_per_epoch)
    return next(batcher)


def make_header(batch, m, fwd_s, B):
    """Fixed-size int64 header, so the receiver can allocate: [m, B, S, forward microseconds, lengths x B]."""
    ids = batch["input_ids"]
    h = torch.zeros(4 + B, dtype=torch.long)
    h[:4] = torch.tensor([m, ids.shape[0], ids.shape[1], int(fwd_s * 1e6)])
    h[4:4 + ids.shape[0]] = batch["lengths"]
    return h


def run_target(cfg, d, batcher, capture, start_step, total_steps):
    """Target rank: prefill this node's micro-batches k = t, t + T, ... (T targets per node) from start_step to
    total_steps, send each to its drafter, at most `prefetch` in flight. The node's target ranks run the same number
    of forwards (FSDP all-gathers are collective): one with no micro-batch left in the last round runs a dummy."""
    nn, Dr, A = d.nnodes, len(d.drafters), cfg.grad_accum
    T = len(d.targets) // nn
    n, t = divmod(d.targets.index(d.rank), T)
    per_node_step = (Dr // nn) * A  # micro-batches per optimizer step on one node
    k0, k1 = start_step * per_node_step, total_steps * per_node_step
    inflight = deque()
    for r in range(math.ceil((k1 - k0) / T)):
        k = k0 + r * T + t
        if k >= k1:
            capture(torch.zeros(1, 8, dtype=torch.long, device=d.device))
            continue
        m = node_micro_batch(k, n, nn, Dr, A)
        src, dst, _ = route(m, d.targets, d.drafters, nn, A)
        assert src == d.rank, f"schedule bug: micro-batch {m} belongs to rank {src}, not {d.rank}"
        batch = batch_at(batcher, m)
        t0 = time.perf_counter()
        hidden = capture(batch["input_ids"].to(d.device))
        if d.device.type == "cuda":  # the compute stream only: a device-wide sync would also wait for the
            torch.cuda.current_stream().synchronize()  # previous sends, which wait for the drafter
        fwd = time.perf_counter() - t0
        tensors = [x.to(d.device) for x in (make_header(batch, m, fwd, cfg.batch_size), batch["input_ids"],
                                            batch["loss_mask"])] + [hidden]
        inflight.append((tensors, [dist.isend(x, dst, group=d.transport) for x in tensors]))
        while len(inflight) > cfg.prefetch:
            for w in inflight.popleft()[1]:
                w.wait()
    while inflight:
        for w in inflight.popleft()[1]:
            w.wait()


class Receiver:
    """Drafter rank: receives its micro-batches in schedule order. Messages between two ranks match in the order
    they were posted, so only the header of the NEXT micro-batch is posted ahead (while this one trains); the
    payload is posted once its header says how large it is."""

    def __init__(self, cfg, d, hidden_dim, dtype, schedule):
        self.cfg, self.d, self.C, self.dtype = cfg, d, hidden_dim, dtype
        self.todo, self.posted = deque(schedule), None

    def _post_next(self):
        if self.todo:
            m = self.todo.popleft()
            h = torch.zeros(4 + self.cfg.batch_size, dtype=torch.long, device=self.d.device)
            src = route(m, self.d.targets, self.d.drafters, self.d.nnodes, self.cfg.grad_accum)[0]
            self.posted = (m, src, h, dist.irecv(h, src, group=self.d.transport))

    def get(self, m):
        if self.posted is None:
            self._post_next()
        mm, src, h, work = self.posted
        self.posted = None
        work.wait()
        hm, B, S, fwd_us = h[:4].tolist()
        if not hm == mm == m:
            raise RuntimeError(f"rank {self.d.rank}: got micro-batch {hm} from rank {src}, expected {m}")
        ids = torch.empty(B, S, dtype=torch.long, device=self.d.device)
        lm = torch.empty(B, S, dtype=torch.long, device=self.d.device)
        hidden = torch.empty(B, S, self.C, dtype=self.dtype, device=self.d.device)
        for w in [dist.irecv(x, src, group=self.d.transport) for x in (ids, lm, hidden)]:
            w.wait()
        self._post_next()
        return {"input_ids": ids, "loss_mask": lm, "lengths": h[4:4 + B].cpu()}, hidden, fwd_us * 1e-6

# -----------------------------------------------------------------------------
# drafter side: schedule, optimizer


def lr_at(cfg, step, total):
    """Linear warmup from lr/W to lr over W = int(warmup_ratio * total) steps, then cosine to 0 (spec §4.2)."""
    W = int(cfg.warmup_ratio * total)
    if step < W:
        return cfg.lr * (step + 1) / W
    return 0.5 * cfg.lr * (1 + math.cos(math.pi * (step - W) / max(1, total - W)))


class Optimizer:
    """AdamW over fp32 master weights (the drafter itself may be bf16). Gradients go into one flat fp32 buffer,
    reduced once per step across drafter ranks and divided by the global token-weight sum (an exact token-weighted
    mean over ranks and micro-batches), then clipped by their global L2 norm."""

    def __init__(self, cfg, drafter, d):
        self.cfg, self.d = cfg, d
        self.params = list(drafter.parameters())
        fp32 = all(p.dtype == torch.float32 for p in self.params)
        self.masters = self.params if fp32 else [p.detach().float().requires_grad_() for p in self.params]
        self.flat = torch.zeros(sum(p.numel() for p in self.params), device=self.params[0].device)
        self.views, off = [], 0
        for p in self.params:
            self.views.append(self.flat[off:off + p.numel()].view_as(p))
            off += p.numel()
        self.opt = torch.optim.AdamW(self.masters, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2),
                                     weight_decay=cfg.weight_decay, fused=self.flat.is_cuda)

    def step(self, lr, weight_sum, loss_finite=True):
        """p.grad holds d(sum of weighted CE)/dp of this rank -> (global grad norm before clipping, applied).
        A non-finite loss or grad norm drops the step whole: no update, no optimizer-state change, gradients
        discarded. Every drafter rank sees the same all-reduced loss and buffer, so all take the same decision."""
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
        for mp in self.masters:  # fp32 runs: masters are the params, whose next backward must start from zero
            mp.grad = None
        if self.masters is not self.params:
            with torch.no_grad():
                torch._foreach_copy_(self.params, self.masters)
        return gnorm, True

    def load(self, state):
        with torch.no_grad():
            for mp, s in zip(self.masters, state["masters"]):
                mp.copy_(s)
            if self.masters is not self.params:
                torch._foreach_copy_(self.params, self.masters)
        self.opt.load_state_dict(state["optimizer"])

# -----------------------------------------------------------------------------
# checkpoints and logs


def list_ckpts(run_dir):
    """Complete checkpoints, oldest first: exactly ckpt-<7 digits>. A .tmp is a write in progress (or killed),
    a .old one being replaced or pruned; neither is ever resumed from."""
    if not os.path.isdir(run_dir):
        return []
    return sorted(c for c in os.listdir(run_dir) if c.startswith("ckpt-") and c[5:].isdigit())


def _fsync(path):  # a file or a directory: on disk, not just in the page cache, before the rename publishes it
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint(run_dir, step, drafter, optim, cfg, micro, bad_steps=0):
    """Released-format drafter + train_state.pt, written into ckpt-<step>.tmp, flushed, then renamed: a crash or a
    full disk at any point leaves every earlier complete checkpoint intact (a failed write removes its .tmp and
    raises). Only after the rename are the oldest pruned beyond keep_ckpts. train_state.pt holds only tensors,
    numbers, strings, lists and dicts, so resuming loads it with torch.load(weights_only=True)."""
    final = os.path.join(run_dir, f"ckpt-{step:07d}")
    tmp, old = final + ".tmp", final + ".old"
    for c in os.listdir(run_dir):  # leftovers of a killed write (only this process, the leader, writes here)
        if c.startswith("ckpt-") and c.endswith((".tmp", ".old")):
            shutil.rmtree(os.path.join(run_dir, c), ignore_errors=True)
    try:
        save_drafter(drafter, tmp, dtype=torch.bfloat16)
        torch.save({"step": step, "micro_batch": micro, "masters": [mp.detach().cpu() for mp in optim.masters],
                    "optimizer": optim.opt.state_dict(), "config": asdict(cfg), "bad_steps": bad_steps},
                   os.path.join(tmp, "train_state.pt"))
        for f in os.listdir(tmp):
            _fsync(os.path.join(tmp, f))
        _fsync(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # give back the space of a failed write (disk full), then fail loudly
        raise
    maybe_fail(step, "ckpt")  # test hook: SIGKILL between the complete temp write and the rename
    if os.path.exists(final):  # the same step again (resumed from an older checkpoint): swap aside, never delete first
        os.replace(final, old)
    os.replace(tmp, final)
    _fsync(run_dir)
    shutil.rmtree(old, ignore_errors=True)
    for c in list_ckpts(run_dir)[:-cfg.keep_ckpts]:  # renamed first: a crash mid-delete leaves no torn ckpt-*
        os.replace(os.path.join(run_dir, c), os.path.join(run_dir, c + ".old"))
        shutil.rmtree(os.path.join(run_dir, c + ".old"), ignore_errors=True)
    return final


def find_resume(cfg, run_dir):
    if cfg.resume == "auto":
        ckpts = list_ckpts(run_dir)
        return os.path.join(run_dir, ckpts[-1]) if ckpts else None
    return cfg.resume or None


def load_train_state(ckpt):
    """train_state.pt through torch.load(weights_only=True): tensors and plain containers only, so a tampered or
    foreign file cannot run code. Tensors land on the CPU (a CUDA run saved them on the leader's GPU)."""
    path = os.path.join(ckpt, "train_state.pt")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # pickle.UnpicklingError for anything beyond tensors and plain containers
        raise ValueError(f"resume: {path} is not a plain training state (refusing to unpickle it): "
                         f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from None


def plot_curves(run_dir):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        rows = [r for r in map(json.loads, f) if not r.get("skipped")]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.5))
    for ax, key in zip(axes, ("loss", "acc", "tau_est")):
        ax.plot([r["step"] for r in rows], [r[key] for r in rows])
        ax.set_title(key)
        ax.set_xlabel("step")
    fig.tight_layout()
    fig.savefig(os.path.join(run_dir, "curves.png"), dpi=100)
    plt.close(fig)


def write_run_info(run_dir, cfg, d, dcfg):
    import transformers
    os.makedirs(run_dir, exist_ok=True)
    with open(os.path.join(run_dir, "config.json"), "w") as f:
        json.dump({"train": asdict(cfg), "drafter": dcfg.to_json_dict(), "world": d.world,
                   "targets": d.targets, "drafters": d.drafters}, f, indent=2)
    info = [f"python {sys.version.split()[0]}", f"torch {torch.__version__}",
            f"transformers {transformers.__version__}", f"cuda {torch.version.cuda}"]
    try:
        info.append(subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=20).stdout)
    except (OSError, subprocess.TimeoutExpired):
        info.append("nvidia-smi: not available")
    with open(os.path.join(run_dir, "env.txt"), "w") as f:
        f.write("\n".join(info))


def log_line(cfg, d, run_dir, step, total, s, gnorm, lr, dt, K, recompiles, bad_steps=0):
    loss, wsum, tau, blocks, tokens, seqs, fwd, busy = s[:8].tolist()
    correct, count = s[8:8 + K], s[8 + K:]
    T, Dr = len(d.targets), len(d.drafters)
    colocated = d.world == 1
    t_busy = fwd / (T * dt)  # summed per-GPU busy seconds over (GPUs x wall seconds)
    d_busy = busy / (Dr * dt)
    cap_t, cap_d = seqs / max(fwd, 1e-9), seqs / max(busy, 1e-9)  # sequences/s one GPU of each role sustains
    balance = d.world * cap_d / (cap_t + cap_d)  # target GPUs that would exactly feed the rest
    mem = torch.cuda.max_memory_allocated() / 2 ** 30 if d.device.type == "cuda" else 0.0
    rec = dict(step=step, loss=loss / max(wsum, 1e-12), acc=(correct.sum() / count.sum().clamp(min=1)).item(),
               tau_est=tau / max(blocks, 1), lr=lr, grad_norm=gnorm, tok_s=tokens / dt, seq_s=seqs / dt,
               target_busy=t_busy, drafter_busy=d_busy, target_seq_s_per_gpu=cap_t, drafter_seq_s_per_gpu=cap_d,
               balanced_target_gpus=balance, mem_gb=mem, recompiles=recompiles, bad_steps=bad_steps,
               acc_k=(correct / count.clamp(min=1)).tolist()[1:], time=time.time())
    print(f"step={step}/{total} loss={rec['loss']:.4f} acc={rec['acc']:.3f} tau_est={rec['tau_est']:.2f} "
          f"lr={lr:.2e} gnorm={gnorm:.2f} tok/s={rec['tok_s']:.0f} target_busy={t_busy:.0%} "
          f"drafter_busy={d_busy:.0%} mem={mem:.1f}GB | capacity seq/s/GPU target={cap_t:.2f} "
          f"drafter={cap_d:.2f}" + ("" if colocated else f" -> balanced split {balance:.1f}:{d.world - balance:.1f}")
          + (f" RECOMPILES={recompiles}" if recompiles else "")
          + (f" SKIPPED_STEPS={bad_steps}" if bad_steps else ""), flush=True)
    with open(os.path.join(run_dir, "metrics.jsonl"), "a") as f:
        f.write(json.dumps(rec) + "\n")


def log_skipped(run_dir, step, total, loss, gnorm, streak, bad_steps, max_bad):
    """A step dropped for a non-finite loss or grad norm: one human line and one JSONL record (skipped=true) now,
    whatever log_every says. Non-finite values are written as strings ("nan", "inf"): the file stays valid JSON."""
    print(f"step={step}/{total} SKIPPED: non-finite loss={loss:.4g} gnorm={gnorm:.4g}; weights and optimizer "
          f"state unchanged ({streak} in a row, the run stops at {max_bad}; {bad_steps} skipped so far)", flush=True)
    num = lambda x: x if math.isfinite(x) else str(x)  # noqa: E731
    with open(os.path.join(run_dir, "metrics.jsonl"), "a") as f:
        f.write(json.dumps(dict(step=step, skipped=True, loss=num(loss), grad_norm=num(gnorm), bad_streak=streak,
                                bad_steps=bad_steps, time=time.time())) + "\n")


def placement_table(world, local_world, cfg):
    """The role of every rank and who sends hidden states to whom; pure (no GPU, no process group)."""
    targets, drafters = assign_roles(world, cfg, local_world)
    nnodes = world // local_world
    feeds = {r: set() for r in range(world)}
    for m in range(len(drafters) * cfg.grad_accum * max(1, len(targets)) * 2):  # covers every pairing
        src, dst, _ = route(m, targets, drafters, nnodes, cfg.grad_accum)
        feeds[src].add(dst)
        feeds[dst].add(src)
    lines = [f"placement: {nnodes} node(s) x {local_world} processes: {len(targets) // nnodes} target + "
             f"{len(drafters) // nnodes} drafter ranks per node; the target is FSDP-sharded within each node "
             f"({'replicated across nodes' if nnodes > 1 else 'one replica'}); the drafter is data-parallel over "
             f"all {len(drafters)} drafter ranks",
             "  rank  node  local  role            sends to / receives from"]
    for r in range(world):
        role = ("target+drafter" if r in targets and r in drafters else "target" if r in targets else "drafter")
        arrow = "" if world == 1 else ("-> " if r in targets else "<- ") + ",".join(map(str, sorted(feeds[r])))
        lines.append(f"  {r:4d}  {r // local_world:4d}  {r % local_world:5d}  {role:14s}  {arrow}")
    if nnodes > 1:
        lines.append("  across nodes: only the drafter gradient all-reduce (hidden states and target all-gathers "
                     "stay inside each node)")
    return "\n".join(lines)


# -----------------------------------------------------------------------------
# main


def main(cfg):
    from transformers import AutoConfig, AutoTokenizer
    if cfg.plan:  # dry run: the placement for NODESxGPUS, nothing loaded
        nodes, gpus = (int(x) for x in cfg.plan.lower().split("x"))
        print(placement_table(nodes * gpus, gpus, cfg))
        return
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank, local_world = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_WORLD_SIZE", world))
    try:  # a config error is a message naming the field and exit 1, before any process group or GPU memory
        try:
            target_config = AutoConfig.from_pretrained(cfg.target)
            tokenizer = AutoTokenizer.from_pretrained(cfg.target)
        except (OSError, ValueError) as e:
            raise ValueError(f"invalid config:\n  target: cannot read a model config and tokenizer from "
                             f"{cfg.target!r} ({type(e).__name__}: {str(e).splitlines()[0]})") from None
        validate(cfg, world, target_config, tokenizer, local_world)
    except ValueError as e:
        report_failure(f"[rank {rank}] {e}")
        raise SystemExit(f"[rank {rank}] {e}") from None
    targets, drafters = assign_roles(world, cfg, local_world)
    role = "target+drafter" if world == 1 else "target" if rank in targets else "drafter"
    # A rank killed by a signal (kill -9, the OOM killer, a segfault) prints nothing. Leave a note in torchrun's
    # error file now, so the launcher's failure summary still names this rank and its role; a Python failure
    # below replaces it with the real error. Its start-up timestamp makes a killed rank the "first observed
    # failure" ahead of peers that fail later because it vanished.
    report_failure(f"rank {rank} ({role}) died without a Python error: killed by a signal (kill -9, the OOM "
                   f"killer) or a crash in native code (note written by train.py at start-up)")
    die_with_launcher()
    d = None
    try:
        d = setup_dist(cfg)
        train(cfg, d, target_config, tokenizer)
    except BaseException as e:
        msg = f"[rank {rank} ({role})] FAILED: {type(e).__name__}: {e}"
        sys.stdout.flush()
        sys.stderr.write(f"\n{msg}\n{traceback.format_exc()}")
        sys.stderr.flush()
        report_failure(f"{msg}\n{traceback.format_exc()}")
        os._exit(1)  # never wait in NCCL/gloo destructors: torchrun sees the exit and stops every other rank
    teardown_dist(d)


def die_with_launcher():
    """Under torchrun (Linux): the kernel SIGKILLs this rank when its launcher dies. torchrun starts every worker
    in its own session, so a `kill -9` of torchrun (or a scheduler ending the job step that way) would otherwise
    leave the ranks running, holding their GPUs, with nobody to stop them."""
    if "TORCHELASTIC_RUN_ID" not in os.environ or not sys.platform.startswith("linux"):
        return
    import ctypes
    parent = os.getppid()
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
    if os.getppid() != parent:  # the launcher died before the request took effect
        os._exit(1)


def report_failure(msg):
    """Write torchrun's per-rank error file (TORCHELASTIC_ERROR_FILE, its documented format): when this rank
    fails, the launcher's summary prints `msg` under the rank and exit code. Without torchrun: nothing."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if path:
        with open(path, "w") as f:
            json.dump({"message": {"message": msg.splitlines()[0], "extraInfo": {
                "py_callstack": msg, "timestamp": str(int(time.time()))}}}, f)


def maybe_fail(step, point="step"):
    """Failure-path test hook, DFLASH_FAIL_AT=rank:step[:how], on that global rank at optimizer step `step`
    (0-based; "N+" = step N and every later one). It sits in the drafter loop, so `rank` is a drafter rank (or 0
    when colocated); tests kill target ranks from outside, with a real kill -9.
      (no how)  raise after that step's micro-batches (a Python error: message and traceback)
      kill      SIGKILL there (no message, no cleanup: what a crash or the OOM killer does)
      nan       that step's loss becomes NaN on this rank (the caller poisons it when this returns True)
      ckpt      SIGKILL inside the write of checkpoint ckpt-<step>, after its .tmp is complete, before the rename"""
    spec = os.environ.get("DFLASH_FAIL_AT", "").split(":")
    if len(spec) < 2 or int(spec[0]) != int(os.environ.get("RANK", "0")):
        return False
    how, at = (spec[2] if len(spec) > 2 else ""), spec[1]
    if point != {"nan": "loss", "ckpt": "ckpt"}.get(how, "step"):
        return False
    if not (step >= int(at[:-1]) if at.endswith("+") else step == int(at)):
        return False
    if how in ("kill", "ckpt"):
        os.kill(os.getpid(), signal.SIGKILL)
    if how == "nan":
        return True
    raise RuntimeError(f"injected failure (DFLASH_FAIL_AT={':'.join(spec)})")


def train(cfg, d, target_config, tokenizer):
    from data import Batcher, default_cache_dir, load_tokenized
    dtype = getattr(torch, cfg.dtype)
    dcfg = drafter_cfg(cfg, target_config, tokenizer)
    run_dir = os.path.join(cfg.out_dir, cfg.run_name)
    if d.rank == 0:
        print(placement_table(d.world, d.world // d.nnodes, cfg), flush=True)
        write_run_info(run_dir, cfg, d, dcfg)
        print(f"drafter: {dcfg.num_hidden_layers} layers {dcfg.layer_types}, target layers {dcfg.target_layer_ids}, "
              f"mask token {dcfg.mask_token_id}, block {dcfg.block_size}", flush=True)

    # data: rank 0 tokenizes into the on-disk cache once; everybody else then maps it
    cache = default_cache_dir() / "tokenized"
    load = lambda: load_tokenized(cfg.data, tokenizer, cfg.max_length, cache, skip_invalid=cfg.skip_invalid)  # noqa
    data = load() if d.rank == 0 else None
    if d.world > 1:
        dist.barrier(group=d.transport)
    data = data if data is not None else load()
    batcher = Batcher(data, cfg.batch_size, seed=cfg.seed, pad_id=tokenizer.pad_token_id or 0,
                      pad_multiple=cfg.pad_multiple)
    per_step = len(d.drafters) * cfg.grad_accum  # micro-batches per optimizer step
    steps_per_epoch = batcher.steps_per_epoch // per_step
    if steps_per_epoch < 1 and not cfg.max_steps:
        raise ValueError(f"{len(data)} sequences do not fill one optimizer step of {per_step * cfg.batch_size}")
    total = cfg.max_steps or max(1, int(cfg.epochs * steps_per_epoch))
    resume = find_resume(cfg, run_dir)
    state = load_train_state(resume) if resume else None
    start = state["step"] if state else 0
    if d.rank == 0:
        print(f"data: {len(data)} sequences, {steps_per_epoch} optimizer steps/epoch, {total} steps of "
              f"{per_step} micro-batches x {cfg.batch_size}" + (f"; resuming at step {start}" if state else ""),
              flush=True)
        changed = [f"{k} {v!r} -> {getattr(cfg, k)!r}" for k, v in (state or {}).get("config", {}).items()
                   if k != "resume" and getattr(cfg, k, v) != v]
        if changed:  # allowed (e.g. a longer max_steps), but the run is then no longer the uninterrupted one
            print(f"WARNING resume: config differs from the checkpoint's: {', '.join(changed)}", flush=True)

    capture = None
    if d.is_target:
        t0 = time.time()
        capture = Capture(load_target(cfg, dcfg, d, dtype), dcfg.target_layer_ids)
        if d.rank == d.targets[0]:
            import resource  # peak host memory of this process so far: loading reads one tensor at a time
            shard = "colocated" if d.world == 1 else cfg.target_shard
            print(f"target loaded ({shard}) in {time.time() - t0:.1f}s, peak host RSS of rank {d.rank} "
                  f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GiB", flush=True)
    if not d.is_drafter:
        run_target(cfg, d, batcher, capture, start, total)
        return

    # ---- drafter ranks (and the colocated process)
    torch.manual_seed(cfg.seed)  # identical init on every drafter rank
    drafter = load_drafter(cfg.init_drafter) if cfg.init_drafter else DFlashDrafter(dcfg)
    drafter = drafter.to(d.device, dtype)
    drafter.compile_layers = cfg.compile
    embed, head = load_frozen_tables(cfg.target, dtype, d.device)
    optim = Optimizer(cfg, drafter, d)
    if state:
        optim.load(state)
    backend = "flex" if d.device.type == "cuda" else "sdpa"
    if backend == "flex":
        configure_compile()
    Dr, di, K = len(d.drafters), d.drafters.index(d.rank), dcfg.block_size
    mine = deque(m for s in range(start, total) for m in range(s * per_step + di, (s + 1) * per_step, Dr))
    receiver = None if d.is_target else Receiver(cfg, d, len(dcfg.target_layer_ids) * dcfg.hidden_size, dtype, mine)
    metrics = os.path.join(run_dir, "metrics.jsonl")
    if d.leader and os.path.exists(os.path.join(run_dir, "done.json")):  # resumed past an earlier end: not done
        os.remove(os.path.join(run_dir, "done.json"))
    if d.leader and not state:
        if os.path.exists(metrics):
            os.remove(metrics)
        save_drafter(drafter, os.path.join(run_dir, "init"))  # the untrained drafter: the eval baseline
    if d.leader and state and os.path.exists(metrics):  # drop lines of steps past the checkpoint: they are redone
        with open(metrics) as f:
            rows = [x for x in f if x.strip() and json.loads(x)["step"] <= start]
        with open(metrics + ".tmp", "w") as f:
            f.writelines(rows)
        os.replace(metrics + ".tmp", metrics)
    acc, t_log, warm_graphs, gnorm_ok, lengths = None, time.perf_counter(), None, float("nan"), set()
    # non-finite steps: skipped in total (kept across resumes) and in a row; checkpoints are written only outside a
    # bad streak, so the newest checkpoint is the last good one and keep_ckpts never prunes it away
    bad_steps, streak, last_good = (state.get("bad_steps", 0) if state else 0), 0, resume
    for step in range(start, total):
        # [loss_sum, weight_sum, tau_sum, blocks, tokens, sequences, target s, drafter s, correct_K, count_K]
        stats = torch.zeros(8 + 2 * K, dtype=torch.float64)
        for _ in range(cfg.grad_accum):
            m = mine.popleft()
            if receiver is None:  # colocated: this process runs the target too
                batch = batch_at(batcher, m)
                t0 = time.perf_counter()
                hidden = capture(batch["input_ids"].to(d.device))
                if d.device.type == "cuda":
                    torch.cuda.synchronize()
                fwd = time.perf_counter() - t0
                batch = {k: v.to(d.device) for k, v in batch.items()}
            else:
                batch, hidden, fwd = receiver.get(m)
            t0 = time.perf_counter()
            # anchors depend only on (seed, m): the same sequences get the same blocks whatever the topology
            gen = torch.Generator(d.device).manual_seed(cfg.seed * 1_000_003 + m)
            anchors, keep = sample_anchors(batch["loss_mask"], cfg.num_anchors, gen)
            r = dflash_loss(drafter, embed, head, batch["input_ids"], batch["loss_mask"], hidden, anchors, keep,
                            gamma=cfg.gamma, backend=backend, chunk_blocks=cfg.loss_chunk)
            if maybe_fail(step, "loss"):  # test hook: a non-finite loss on this rank
                r["loss_sum"] = r["loss_sum"] * float("nan")
            r["loss_sum"].backward()  # the numerator; normalized once the global weight sum is known
            head_stats = torch.stack([r["loss_sum"].detach(), r["weight_sum"], r["tau_sum"], r["blocks"]])
            stats += torch.cat([head_stats.double().cpu(),
                                torch.tensor([float(batch["lengths"].sum()), len(batch["lengths"]), fwd, 0.0],
                                             dtype=torch.float64),
                                r["correct_K"].double().cpu(), r["count_K"].double().cpu()])
            stats[7] += time.perf_counter() - t0  # .cpu() above synchronized
            maybe_fail(step)
        if Dr > 1:
            stats = stats.to(d.device)
            dist.all_reduce(stats, group=d.drafter_group)
            stats = stats.cpu()
        t0 = time.perf_counter()
        lr = lr_at(cfg, step, total)
        gnorm, applied = optim.step(lr, stats[1].item(), loss_finite=math.isfinite(stats[0].item()))
        stats[7] += (time.perf_counter() - t0) * Dr  # optimizer time is drafter busy time on every drafter
        done = step + 1
        if applied:
            acc, streak, gnorm_ok = (stats if acc is None else acc + stats), 0, gnorm
        else:
            bad_steps, streak = bad_steps + 1, streak + 1
            if d.leader:
                log_skipped(run_dir, done, total, stats[0].item() / max(stats[1].item(), 1e-12), gnorm, streak,
                            bad_steps, cfg.max_bad_steps)
            if streak >= cfg.max_bad_steps:  # every drafter rank gets here at the same step (same reduced stats)
                raise FloatingPointError(
                    f"{streak} consecutive steps with a non-finite loss or grad norm (steps {done - streak + 1}-"
                    f"{done}, none applied; max_bad_steps={cfg.max_bad_steps}). Last good checkpoint: "
                    f"{last_good or 'none (no checkpoint written yet)'}; after a fix (lower lr, check the data) "
                    f"continue with --resume={last_good or 'auto'}")
        lengths.add(batch["input_ids"].shape[1])
        if warm_graphs is None and done - start >= 2 and len(lengths) >= 2:  # compile warm-up is over once two
            warm_graphs = compile_count()  # lengths were seen: compiled code is then dynamic in the length
        if d.leader and (done % cfg.log_every == 0 or done == total):
            if acc is not None:  # (an interval of skipped steps only has nothing to average: its lines say it)
                log_line(cfg, d, run_dir, done, total, acc, gnorm_ok, lr, time.perf_counter() - t_log, K,
                         compile_count() - (warm_graphs or compile_count()), bad_steps)
            acc, t_log = None, time.perf_counter()
        if streak == 0 and (done % cfg.ckpt_every == 0 or done == total):
            last_good = os.path.join(run_dir, f"ckpt-{done:07d}")
            if d.leader:
                save_checkpoint(run_dir, done, drafter, optim, cfg, done * per_step, bad_steps)
                plot_curves(run_dir)
                print(f"checkpoint {last_good}", flush=True)
    if d.leader:  # the run is over: eval.py --watch stops once it has evaluated every checkpoint
        with open(os.path.join(run_dir, "done.json.tmp"), "w") as f:
            json.dump({"steps": total, "bad_steps": bad_steps, "final": last_good}, f)
        os.replace(os.path.join(run_dir, "done.json.tmp"), os.path.join(run_dir, "done.json"))
        print(f"done: {total} steps" + (f", {bad_steps} skipped as non-finite" if bad_steps else "") +
              (f" (the last {streak} in a row: no final checkpoint)" if streak else "") +
              f"; checkpoints in {run_dir}", flush=True)


if __name__ == "__main__":
    main(parse_config(sys.argv[1:]))
