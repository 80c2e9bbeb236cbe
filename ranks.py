"""Everything that knows about ranks: roles and process groups (`assign_roles`, `setup_dist` -> a frozen
`Dist`), failure notes for torchrun's summary, the stop every rank agrees on after a SIGTERM (preemption:
`stop_agreed`, `watch_for_stop`), the placement table and the memory plan per GPU, and the static
schedule by which hidden states travel from target ranks to drafter ranks: micro-batch m (a global counter) belongs
to optimizer step m // (drafters * grad_accum), and `route` names the target rank that prefills it and the drafter
rank that trains on it. Every rank walks its micro-batches in increasing m, so the lowest outstanding transfer can
always proceed and nobody needs a coordinator. `run_target` is a target rank's whole life, `Receiver` the drafter's
end of the transfer, `Colocated` both in one process. The target itself is target.py; how it is sharded, train.py's
`shard_target`.

Test: python -m pytest -q tests/test_train.py tests/test_multinode.py; tests/test_reliability.py -k "kill or sigterm"
"""

import ctypes
import datetime
import json
import math
import os
import signal
import sys
import threading
import time
from collections import deque, namedtuple
from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist

from loss import domino_bytes, final_states


# ----------------------------------------------------------------------------- processes, roles and groups
TorchrunEnv = namedtuple("TorchrunEnv", "rank world local_rank local_world run_id error_file")


def torchrun_env():
    """What torchrun tells a worker, read in this one place (no torchrun: one process)."""
    e, world = os.environ, int(os.environ.get("WORLD_SIZE", "1"))
    return TorchrunEnv(int(e.get("RANK", "0")), world, int(e.get("LOCAL_RANK", "0")),
                       int(e.get("LOCAL_WORLD_SIZE", world)), e.get("TORCHELASTIC_RUN_ID"),
                       e.get("TORCHELASTIC_ERROR_FILE"))


def assign_roles(world, cfg, local_world=None):
    """-> (target ranks, drafter ranks), global ranks; one process: both roles on rank 0. Every node gets the same
    split, its first target_ranks local ranks the target, so its targets feed only its own drafters, over NVLink."""
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


def role_of(rank, targets, drafters):
    return "target+drafter" if rank in targets and rank in drafters else "target" if rank in targets else "drafter"


@dataclass(frozen=True)
class Dist:
    rank: int
    world: int
    device: torch.device
    targets: list  # global ranks with the target role
    drafters: list  # global ranks with the drafter role
    nnodes: int  # torchrun nodes (WORLD_SIZE / LOCAL_WORLD_SIZE)
    target_mesh: object  # DeviceMesh over this node's targets (None when colocated or replicated)
    drafter_group: object  # process group over drafters (None when colocated)
    transport: object  # process group used only for target -> drafter sends

    is_target = property(lambda self: self.rank in self.targets)
    is_drafter = property(lambda self: self.rank in self.drafters)
    leader = property(lambda self: self.rank == self.drafters[0])  # the drafter rank that logs and checkpoints


def setup_dist(cfg, env):
    use_cuda = on_gpu(cfg.device)
    if use_cuda:
        torch.cuda.set_device(env.local_rank)  # before any NCCL call, or P2P can hang (batch_isend_irecv docs)
    device = torch.device("cuda", env.local_rank) if use_cuda else torch.device("cpu")
    targets, drafters = assign_roles(env.world, cfg, env.local_world)
    nnodes = env.world // env.local_world
    if env.world == 1:
        return Dist(env.rank, 1, device, targets, drafters, 1, None, None, None)
    timeout = datetime.timedelta(seconds=cfg.transport_timeout)
    dist.init_process_group("nccl" if use_cuda else "gloo", timeout=timeout, device_id=device if use_cuda else None)
    # every rank builds every group, in this order (SPMD: a mismatch hangs silently). The target is sharded within each
    # node, replicated across nodes (frozen: replicas never sync), so its all-gathers stay on NVLink (README).
    from torch.distributed.device_mesh import DeviceMesh
    T = len(targets) // nnodes
    node_groups = [dist.new_group(targets[n * T:(n + 1) * T]) for n in range(nnodes)]
    target_mesh = (DeviceMesh.from_group(node_groups[targets.index(env.rank) // T], device.type)
                   if cfg.target_shard == "fsdp" and env.rank in targets else None)
    drafter_group = dist.new_group(drafters)
    transport = dist.new_group(list(range(env.world)), timeout=timeout)
    dist.barrier(group=transport)  # creates the transport communicator on every rank now, not mid-run
    return Dist(env.rank, env.world, device, targets, drafters, nnodes, target_mesh, drafter_group, transport)


def teardown_dist(d):
    _WATCHING.set()  # a target rank's stop watcher leaves the store before the store goes
    for t in threading.enumerate():
        if t.name == "watch_for_stop":
            t.join(timeout=2)
    if d is not None and d.world > 1 and dist.is_initialized():
        dist.destroy_process_group()


def reduce_stats(s, d):
    """Sum a dict of float64 tensors over the drafter ranks, in one all-reduce, with this rank's stop request beside
    them ("stop": how many drafter ranks know of one; stop_agreed takes it out)."""
    s = dict(s, stop=torch.tensor(float(stop_requested()), dtype=torch.float64))
    if len(d.drafters) == 1:
        return s
    flat = torch.cat([v.reshape(-1) for v in s.values()]).to(d.device)
    dist.all_reduce(flat, group=d.drafter_group)
    parts = flat.cpu().split([v.numel() for v in s.values()])
    return {k: p.view_as(v) for (k, v), p in zip(s.items(), parts)}


def launcher_start():
    """The start time of this process's parent (torchrun's agent) from /proc, alike on every rank of a node; or None."""
    try:
        ticks = int(open(f"/proc/{os.getppid()}/stat").read().rsplit(")", 1)[1].split()[19])  # field 22, starttime
        boot = next(int(line.split()[1]) for line in open("/proc/stat") if line.startswith("btime"))
    except (OSError, ValueError, IndexError, StopIteration):
        return None
    return int(boot + ticks / os.sysconf("SC_CLK_TCK"))


def report_failure(msg, when=None):
    """Write torchrun's per-rank error file (TORCHELASTIC_ERROR_FILE), if any: its summary prints `msg` under the rank
    and exit code, and names as the root cause the failure with the smallest timestamp `when` (default: now)."""
    path = torchrun_env().error_file
    if path:  # written aside, then renamed: the launcher never reads half a file (a SIGTERM may land mid-write)
        tmp = f"{path}.{time.monotonic_ns()}.tmp"
        with open(tmp, "w") as f:
            json.dump({"message": {"message": msg.splitlines()[0], "extraInfo": {
                "py_callstack": msg, "timestamp": str(int(time.time() if when is None else when))}}}, f)
        os.replace(tmp, path)


def watch_for_death(rank, role):
    """Under torchrun, make every end of this rank show in the launcher's summary with its rank and role: a note in the
    error file, stamped with the launcher's start time, names a rank killed by a signal (it prints nothing); a Python
    failure, or a SIGTERM that does not end in a clean stop (_on_sigterm), rewrites it, stamped later, so the
    first failure is the one named. And the kernel SIGKILLs this rank when its launcher dies (torchrun gives each
    worker its own session)."""
    if not sys.platform.startswith("linux"):
        return
    signal.signal(signal.SIGTERM, partial(_on_sigterm, rank, role))
    if torchrun_env().run_id is None:
        return
    report_failure(f"rank {rank} ({role}) died without a Python error: killed by a signal (kill -9, the OOM "
                   f"killer) or a crash in native code (note written by train.py at start-up)", launcher_start())
    parent = os.getppid()
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
    if os.getppid() != parent:  # the launcher died before the request took effect
        os._exit(1)


# ----------------------------------------------------------------------------- a stop at a step boundary (preemption)
# A scheduler ends a job with SIGTERM, then SIGKILL after a grace period. torchrun's launcher forwards a SIGTERM to
# every rank; a single rank may also get one. Either way the drafter ranks stop together after the step in progress:
# a request rides the statistics' all-reduce (reduce_stats), and a target rank's its next header to its drafters
# (run_target, Receiver). The leader publishes the step in the job's store, which a thread of every target rank
# watches, writes a checkpoint there, and every rank exits 0; --resume=auto continues from it as if never stopped.
# The launcher SIGKILLs ranks still alive TORCH_ELASTIC_SHUTDOWN_TIMEOUT (30) s after it forwarded the signal: a
# rank that has not stopped STOP_MARGIN s before then exits as on a failure, as does one whose peers are gone (a
# SIGTERM after a failure elsewhere: the job ends as it did before, naming the failed rank).
STOP_KEY = "dflash/stop_after"  # the job's store: the optimizer step the drafter ranks stopped after
STOP_MARGIN = 5  # seconds left to the launcher, for its summary
_stop = {}  # this process's request: {"signal_at": time.time()} and/or {"by": "rank R"}


def stop_grace():
    """Seconds from SIGTERM to this rank's exit, at most (a longer checkpoint write: raise the launcher's
    TORCH_ELASTIC_SHUTDOWN_TIMEOUT, which every rank reads too)."""
    return max(1, int(os.environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "30")) - STOP_MARGIN)


def _on_sigterm(rank, role, signum, frame):
    """Ask for a stop; if this rank is still alive stop_grace() s later, exit as on a failure. The note in the error
    file counts only if the rank then fails, and is stamped now: a failure elsewhere stays the root cause."""
    if "signal_at" in _stop:
        return
    _stop["signal_at"] = time.time()
    grace = stop_grace()
    report_failure(f"rank {rank} ({role}) got SIGTERM (a scheduler, or the launcher after a failure elsewhere) and "
                   f"failed before it could stop cleanly, or did not within {grace} s")

    def overdue():
        print(f"rank {rank} ({role}): no clean stop {grace} s after SIGTERM: exiting as on a failure",
              file=sys.stderr, flush=True)
        os._exit(128 + signal.SIGTERM)
    timer = threading.Timer(grace, overdue)
    timer.daemon = True  # a run that ends on its own meanwhile ends as usual
    timer.start()


def stop_requested():
    return bool(_stop)


def note_stop_request(by):
    """A stop asked by another rank (a target rank's header said so)."""
    _stop.setdefault("by", by)


def stop_agreed(s, d, done, total):
    """After optimizer step `done` of `total`: take the all-reduced request out of the statistics `s`. -> True when
    the drafter ranks stop here (every one sees the same sum); the leader then publishes it to the target ranks."""
    stop = s.pop("stop").item() > 0 and done < total
    if stop and d.world > 1:
        store = dist.distributed_c10d._get_default_store()
        if d.leader:
            store.set(STOP_KEY, str(done))
        else:  # no drafter exits before a target rank that loses it can read why
            store.wait([STOP_KEY])
    return stop


def stop_job(rank, role, done, ckpt=None, leader=False):
    """Say why this rank ends (the leader: from which checkpoint to go on), then exit 0 without waiting in gloo/NCCL
    (sends to the stopped ranks stay pending)."""
    why = (f"SIGTERM {time.time() - _stop['signal_at']:.1f} s ago (grace {stop_grace()} s)" if "signal_at" in _stop
           else f"a stop asked by {_stop['by']}" if "by" in _stop else "a stop asked by another rank")
    line = f"rank {rank} ({role}): stopped after step {done} for {why}"
    if leader:
        line += (f"; newest checkpoint {ckpt}: continue with --resume=auto" if ckpt else
                 "; no checkpoint (every step so far was non-finite)")
    print(line, flush=True)
    sys.stderr.flush()
    os._exit(0)


_WATCHING = threading.Event()  # set: the stop watcher's thread returns


def watch_for_stop(d):
    """Target ranks: a thread that ends this process, wherever its main thread waits (a send the stopped drafters
    will never receive, a collective), once the drafters published their stop. -> the store, or None alone."""
    if d.world == 1:
        return None
    store = dist.distributed_c10d._get_default_store()  # TCPStore: its client serializes calls, threads may share it

    def watch():
        try:
            while not store.check([STOP_KEY]):
                if _WATCHING.wait(0.05):  # the rank is ending on its own (teardown_dist)
                    return
        except Exception:  # the launcher and its store are gone: the job is over anyway
            return
        stop_job(d.rank, "target", int(store.get(STOP_KEY)))
    threading.Thread(target=watch, daemon=True, name="watch_for_stop").start()
    return store


def placement_table(world, local_world, cfg):
    """The role of every rank and who sends hidden states to whom; pure (no GPU, no process group)."""
    targets, drafters = assign_roles(world, cfg, local_world)
    nnodes, feeds = world // local_world, {r: set() for r in range(world)}
    for m in range(per_step(len(drafters), cfg.grad_accum) * max(1, len(targets)) * 2):  # covers every pairing
        src, dst, _ = route(m, targets, drafters, nnodes, cfg.grad_accum)
        feeds[src].add(dst)
        feeds[dst].add(src)
    lines = [f"placement: {nnodes} node(s) x {local_world} processes: {len(targets) // nnodes} target + "
             f"{len(drafters) // nnodes} drafter ranks per node; the target is FSDP-sharded within each node "
             f"({'replicated across nodes' if nnodes > 1 else 'one replica'}); the drafter is data-parallel over "
             f"all {len(drafters)} drafter ranks",
             "  rank  node  local  role            sends to / receives from"]
    lines += [f"  {r:4d}  {r // local_world:4d}  {r % local_world:5d}  {role_of(r, targets, drafters):14s}  "
              + ("" if world == 1 else ("-> " if r in targets else "<- ") + ",".join(map(str, sorted(feeds[r]))))
              for r in range(world)]
    if nnodes > 1:
        lines.append("  across nodes: only the drafter gradient all-reduce (hidden states and target all-gathers "
                     "stay inside each node)")
    return "\n".join(lines)


# ----------------------------------------- memory per GPU, from the configs alone (the start-up check and its printout)
GiB = 2 ** 30
USABLE = 0.95  # of a device: the CUDA context or the interpreter, and the allocator's fragmentation, take the rest


def memory_estimate(cfg, dcfg, target_config, targets_per_node, num_anchors=None):
    """GiB per GPU by role and part, for a micro-batch of batch_size sequences of max_length tokens,
    padded up to a multiple of pad_multiple as data.Batcher pads. Drafter: its state (bf16 weights
    and gradients, fp32 masters, Adam's moments, the flat fp32 gradient), the frozen embedding and
    head, the target's states, the activations saved for backward (per block row, per context
    position), one LM-head chunk (logits, fp32 softmax, gradient). Target: its shard, the gathered
    layers (current and next), one layer's forward activations, the states in flight. Within a few
    percent of measured peaks (BENCHMARKS.md)."""
    N, B = num_anchors or cfg.num_anchors, cfg.batch_size
    b = 4 if cfg.dtype == "float32" else 2  # bytes per element; auto is bf16 on GPUs
    S = -(-cfg.max_length // cfg.pad_multiple) * cfg.pad_multiple  # the longest batch, padded
    D, F, V, K, L = dcfg.hidden_size, dcfg.intermediate_size, dcfg.vocab_size, dcfg.block_size, dcfg.num_hidden_layers
    q, kv = dcfg.num_attention_heads * dcfg.head_dim, dcfg.num_key_value_heads * dcfg.head_dim
    nK, fin, P = len(dcfg.target_layer_ids), final_states(cfg, dcfg), dcfg.num_params()
    R, C = B * N * K, B * S  # block rows, context positions
    chunk = min((cfg.loss_chunk or N) * K, R)  # rows per LM-head chunk
    tc = target_config.get_text_config()
    # the target's final states: its whole depth runs; they travel beside the layers' (one more
    # D wide), and the drafter gathers one per row and holds the target's logits, softmax and
    # the KD terms per chunk (fp32)
    layers, embedding = _target_params(target_config, tc.num_hidden_layers if fin else
                                       max(dcfg.target_layer_ids) + 1)
    nS = nK + fin  # D-wide states per context position
    T = targets_per_node if cfg.target_shard == "fsdp" else 1
    parts = {"drafter": {"state": P * (2 * b + (4 if b == 2 else 0) + 12), "embedding + head": 2 * V * D * b,
                         "target states": C * nS * D * b + fin * R * D * b,
                         "activations": (L * (R * (4 * D + 3 * q + 3 * kv + 3 * F) + (C + R) * 3 * kv) + C * 2 * D) * b,
                         "LM-head chunk": chunk * V * (2 * b + 8 + fin * (b + 12)) + R * D * b,
                         "Domino head": domino_bytes(dcfg, R, chunk, b),
                         # CPU: SDPA with a dense [B, 1, Q, KV] mask materializes the scores of every layer type
                         "dense attention": 0 if on_gpu(cfg.device) else B * (dcfg.num_attention_heads * 2 * b + 2)
                         * N * K * (S + N * K) * len(set(dcfg.layer_types))},
             "target": {"shard": (sum(layers) + embedding) * b / T,
                        "gathered layers": 2 * max(layers) * b if T > 1 else 0,
                        "activations": C * (6 * tc.hidden_size + 3 * tc.intermediate_size) * b,
                        "states in flight": C * nS * D * b * (cfg.prefetch + 1)}}
    return {role: {k: v / GiB for k, v in p.items()} for role, p in parts.items()}


def _target_params(target_config, n, _seen={}):
    """Parameters of each of the target's first n layers and of its embedding (a meta-device model), per config."""
    key = (target_config.to_json_string(), n)
    if key not in _seen:
        from transformers import AutoModelForCausalLM
        with torch.device("meta"):
            dec = AutoModelForCausalLM.from_config(target_config.get_text_config()).get_decoder()
        _seen[key] = [sum(p.numel() for p in x.parameters()) for x in dec.layers[:n]], dec.embed_tokens.weight.numel()
    return _seen[key]


def on_gpu(device):  # a Config.device: auto | cuda | cpu
    return device == "cuda" or (device == "auto" and torch.cuda.is_available())


def memory_need(cfg, dcfg, target_config, world, num_anchors=None):
    """GiB per device of each role (one process holds both when world is 1)."""
    T = max(1, cfg.target_ranks) if world > 1 else 1
    total = {r: sum(p.values()) for r, p in memory_estimate(cfg, dcfg, target_config, T, num_anchors).items()}
    return {"target+drafter": sum(total.values())} if world == 1 else total


def largest_anchors(cfg, dcfg, target_config, world, usable):
    """The largest num_anchors (0: none) whose estimate (growing with it) stays within `usable` GiB on every role."""
    lo, hi = 0, cfg.max_length
    while lo < hi:
        mid = (lo + hi + 1) // 2
        fits = max(memory_need(cfg, dcfg, target_config, world, mid).values()) <= usable
        lo, hi = (mid, hi) if fits else (lo, mid - 1)
    return lo


def memory_check(cfg, dcfg, target_config, world, device_gib=None):
    """-> (lines to print, errors): an estimate past a device's memory (device_gib; default this rank's GPU, on CPU
    the host's share per process) is an error naming the largest num_anchors that fits."""
    T = max(1, cfg.target_ranks) if world > 1 else 1
    lines = [f"  {r} rank: {sum(p.values()):.1f} GiB = " + " + ".join(f"{v:.2f} {k}" for k, v in p.items() if v)
             for r, p in memory_estimate(cfg, dcfg, target_config, T).items()]
    if device_gib is None and on_gpu(cfg.device):
        device_gib = torch.cuda.get_device_properties(torchrun_env().local_rank).total_memory / GiB
    elif device_gib is None:  # CPU: the processes of this node share its memory
        device_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GiB / torchrun_env().local_world
    usable = USABLE * device_gib
    over = {r: x for r, x in memory_need(cfg, dcfg, target_config, world).items() if x > usable}
    lo = largest_anchors(cfg, dcfg, target_config, world, usable) if over else 0
    fit = f"the largest num_anchors that fits is {lo}" if lo else "no num_anchors fits this max_length, batch_size"
    return lines, [f"num_anchors={cfg.num_anchors}: a {r} rank needs ~{x:.1f} GiB at max_length={cfg.max_length}, "
                   f"batch_size={cfg.batch_size} (a device here has {device_gib:.1f} GiB, {usable:.1f} usable); {fit}"
                   for r, x in over.items()]


# ----------------------------------------------------------------------------- the static schedule
def per_step(n_drafters, grad_accum):
    """Micro-batches per optimizer step, over all drafter ranks."""
    return n_drafters * grad_accum


def route(m, targets, drafters, nnodes, grad_accum):
    """Micro-batch m -> (target rank that prefills it, drafter rank that trains on it, its index k on that node).
    Drafters take m round-robin (m % Dr); node n's micro-batches, in increasing m, are numbered k = 0, 1, ... and
    dealt round-robin to node n's targets. One node: k == m and the target is targets[m % T]."""
    Dr = len(drafters)
    D, T = Dr // nnodes, len(targets) // nnodes  # per node
    n, dl = divmod(m % Dr, D)
    s, a = divmod(m, per_step(Dr, grad_accum))  # its optimizer step, its place in that step
    k = (s * grad_accum + a // Dr) * D + dl
    return targets[n * T + k % T], drafters[m % Dr], k


def node_micro_batch(k, n, nnodes, n_drafters, grad_accum):
    """Inverse of route: the k-th micro-batch of node n -> its global index m."""
    D = n_drafters // nnodes
    step_acc, dl = divmod(k, D)
    s, a = divmod(step_acc, grad_accum)
    return s * per_step(n_drafters, grad_accum) + a * n_drafters + n * D + dl


def drafter_schedule(d, grad_accum, start, total):
    """The micro-batches drafter rank d.rank trains on from step `start` to `total`, in order (lazily)."""
    Dr, i, P = len(d.drafters), d.drafters.index(d.rank), per_step(len(d.drafters), grad_accum)
    return (m for s in range(start, total) for m in range(s * P + i, (s + 1) * P, Dr))


def batch_at(batcher, m):
    """Micro-batch m of the global stream: epoch m // steps_per_epoch, position m % steps_per_epoch."""
    batcher.epoch, batcher.step = divmod(m, batcher.steps_per_epoch)
    return next(batcher)


# ------------------------------------- the transfer: target rank -> drafter rank, point-to-point on the transport group
def run_target(cfg, d, batcher, capture, start_step, total_steps):
    """Target rank: prefill this node's micro-batches k = t, t + T, ... (T targets per node) from start_step to
    total_steps, send each to its drafter, at most `prefetch` in flight. The node's target ranks run the same number
    of forwards (FSDP all-gathers are collective): one with no micro-batch left in the last round runs a dummy.
    Once the drafters stop (watch_for_stop), this process ends; a peer that ended first is no failure."""
    store = watch_for_stop(d)
    try:
        _feed(cfg, d, batcher, capture, start_step, total_steps)
    except Exception:
        if store is not None and store.check([STOP_KEY]):
            stop_job(d.rank, "target", int(store.get(STOP_KEY)))
        raise


def _feed(cfg, d, batcher, capture, start_step, total_steps):
    nn, Dr, A, T = d.nnodes, len(d.drafters), cfg.grad_accum, len(d.targets) // d.nnodes
    n, t = divmod(d.targets.index(d.rank), T)
    per_node = per_step(Dr // nn, A)  # micro-batches per optimizer step on one node
    k0, k1 = start_step * per_node, total_steps * per_node
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
        ids, t0 = batch["input_ids"], time.perf_counter()
        hidden = capture(ids.to(d.device))
        if d.device.type == "cuda":  # the compute stream only: a device-wide sync would also wait for the
            torch.cuda.current_stream().synchronize()  # previous sends, which wait for the drafter
        # a fixed-size int64 header, so the receiver can allocate: [m, B, S, forward microseconds, a stop
        # requested here (0/1), lengths x B]
        header = torch.zeros(5 + cfg.batch_size, dtype=torch.long)
        header[:5] = torch.tensor([m, *ids.shape, int((time.perf_counter() - t0) * 1e6), stop_requested()])
        header[5:5 + ids.shape[0]] = batch["lengths"]
        tensors = [x.to(d.device) for x in (header, ids, batch["loss_mask"])] + [hidden]
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
        self.todo, self.posted = iter(schedule), None

    def _post_next(self):
        m = next(self.todo, None)
        if m is not None:
            h = torch.zeros(5 + self.cfg.batch_size, dtype=torch.long, device=self.d.device)
            src = route(m, self.d.targets, self.d.drafters, self.d.nnodes, self.cfg.grad_accum)[0]
            self.posted = (m, src, h, dist.irecv(h, src, group=self.d.transport))

    def get(self, m):
        """-> (batch on this device, hidden states [B, S, C], the target's forward seconds)."""
        if self.posted is None:
            self._post_next()
        (mm, src, h, work), self.posted = self.posted, None
        work.wait()
        hm, B, S, fwd_us, stop = h[:5].tolist()
        if not hm == mm == m:
            raise RuntimeError(f"rank {self.d.rank}: got micro-batch {hm} from rank {src}, expected {m}")
        if stop:
            note_stop_request(f"rank {src} (target)")
        ids, lm = (torch.empty(B, S, dtype=torch.long, device=self.d.device) for _ in "il")
        hidden = torch.empty(B, S, self.C, dtype=self.dtype, device=self.d.device)
        for w in [dist.irecv(x, src, group=self.d.transport) for x in (ids, lm, hidden)]:
            w.wait()
        self._post_next()
        return {"input_ids": ids, "loss_mask": lm, "lengths": h[5:5 + B].cpu()}, hidden, fwd_us * 1e-6


class Colocated:
    """One process holds both roles (one GPU, or CPU): micro-batch m is read and prefilled here."""

    def __init__(self, batcher, capture, device):
        self.batcher, self.capture, self.device = batcher, capture, device

    def get(self, m):
        batch, t0 = batch_at(self.batcher, m), time.perf_counter()
        hidden = self.capture(batch["input_ids"].to(self.device))
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        return {k: v.to(self.device) for k, v in batch.items()}, hidden, time.perf_counter() - t0
