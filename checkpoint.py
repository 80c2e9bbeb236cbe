"""The run directory, everything a training run writes and reads back: out_dir/run_name/ holds
config.json (the resolved config), env.txt (versions, nvidia-smi), init/ (the untrained drafter:
eval's baseline), ckpt-<step>/ (the released-format drafter + train_state.pt), metrics.jsonl (one
JSON object per log step), curves.png, and done.json once the run is over. Checkpoints are written
aside and renamed, so a crash never leaves a torn one.

Test: python -m pytest -q tests/test_reliability.py"""

import datetime
import json
import math
import os
import pickle
import shutil
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch

from model import save_drafter


# -------------------------------------------------------------------------------- the run directory
def write_run_info(run_dir, cfg, d, dcfg):
    import transformers
    os.makedirs(run_dir, exist_ok=True)
    with open(os.path.join(run_dir, "config.json"), "w") as f:
        json.dump({"train": asdict(cfg), "drafter": dcfg.to_json_dict(), "world": d.world,
                   "targets": d.targets, "drafters": d.drafters}, f, indent=2)
    info = [f"python {sys.version.split()[0]}", f"torch {torch.__version__}",
            f"transformers {transformers.__version__}", f"cuda {torch.version.cuda}"]
    try:
        smi = subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=20)
        info.append(smi.stdout)
    except (OSError, subprocess.TimeoutExpired):
        info.append("nvidia-smi: not available")
    with open(os.path.join(run_dir, "env.txt"), "w") as f:
        f.write("\n".join(info))
    print(f"drafter: {dcfg.num_hidden_layers} layers {dcfg.layer_types}, target layers "
          f"{dcfg.target_layer_ids}, mask token {dcfg.mask_token_id}, block {dcfg.block_size}",
          flush=True)


def warn_config_changes(cfg, state):
    saved = (state or {}).get("config", {})
    changed = [f"{k} {v!r} -> {getattr(cfg, k)!r}" for k, v in saved.items()
               if k != "resume" and getattr(cfg, k, v) != v]
    # allowed (e.g. a longer max_steps), but the run is then no longer the uninterrupted one
    if changed:
        print(f"WARNING resume: config differs from the checkpoint's: {', '.join(changed)}",
              flush=True)


def open_run_dir(run_dir, drafter, resumed_at):
    """The leader's start: a fresh run saves init/ and starts metrics.jsonl anew; a resumed one
    drops the metrics lines past its checkpoint (those steps are redone). done.json goes: a run
    resumed past its end is not done."""
    metrics = os.path.join(run_dir, "metrics.jsonl")
    Path(run_dir, "done.json").unlink(missing_ok=True)
    if resumed_at is None:
        Path(metrics).unlink(missing_ok=True)
        save_drafter(drafter, os.path.join(run_dir, "init"))
    elif os.path.exists(metrics):
        with open(metrics) as f:
            rows = [x for x in f if x.strip() and json.loads(x)["step"] <= resumed_at]
        with open(metrics + ".tmp", "w") as f:
            f.writelines(rows)
        os.replace(metrics + ".tmp", metrics)


def write_done(run_dir, total, bad_steps, streak, last_good):
    """done.json: the run is over (eval.py --watch stops once it has evaluated every checkpoint)."""
    with open(os.path.join(run_dir, "done.json.tmp"), "w") as f:
        json.dump({"steps": total, "bad_steps": bad_steps, "final": last_good}, f)
    os.replace(os.path.join(run_dir, "done.json.tmp"), os.path.join(run_dir, "done.json"))
    print(f"done: {total} steps" + (f", {bad_steps} skipped as non-finite" if bad_steps else "") +
          (f" (the last {streak} in a row: no final checkpoint)" if streak else "") +
          f"; checkpoints in {run_dir}", flush=True)


# -------------------------------------------------------------------------------------- checkpoints
# ckpt-<step>/ = the released-format drafter + train_state.pt (masters, optimizer, step)
def list_ckpts(run_dir):
    """Complete checkpoints, oldest first: exactly ckpt-<7 digits>, never a .tmp (a write) or a .old
    (being removed)."""
    names = os.listdir(run_dir) if os.path.isdir(run_dir) else []
    return sorted(c for c in names if c.startswith("ckpt-") and c[5:].isdigit())


def _fsync(path):
    # a file or a directory: on disk, not just in the page cache, before the rename publishes it
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint(run_dir, step, drafter, optim, cfg, bad_steps=0):
    """Released-format drafter + train_state.pt (tensors and plain containers only), written into
    ckpt-<step>.tmp, flushed, renamed: a crash or a full disk at any point leaves every earlier
    checkpoint intact (a failed write removes its .tmp and raises). Only after the rename are the
    oldest pruned beyond keep_ckpts."""
    final = os.path.join(run_dir, f"ckpt-{step:07d}")
    tmp, old = final + ".tmp", final + ".old"
    # leftovers of a killed write (only this process, the leader, writes here)
    for c in os.listdir(run_dir):
        if c.startswith("ckpt-") and c.endswith((".tmp", ".old")):
            shutil.rmtree(os.path.join(run_dir, c), ignore_errors=True)
    try:
        save_drafter(drafter, tmp, dtype=torch.bfloat16)
        # (older checkpoints also hold "micro_batch", never read: the step gives the schedule)
        state = {"step": step, "masters": [mp.detach().cpu() for mp in optim.masters],
                 "optimizer": optim.opt.state_dict(), "config": asdict(cfg), "bad_steps": bad_steps}
        torch.save(state, os.path.join(tmp, "train_state.pt"))
        for f in os.listdir(tmp):
            _fsync(os.path.join(tmp, f))
        _fsync(tmp)
    except BaseException:
        # give back the space of a failed write (disk full), then fail loudly
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    # the same step again (resumed from an older checkpoint): swap aside, never delete first
    if os.path.exists(final):
        os.replace(final, old)
    os.replace(tmp, final)
    _fsync(run_dir)
    shutil.rmtree(old, ignore_errors=True)
    # renamed first: a crash mid-delete leaves no torn ckpt-*
    for c in list_ckpts(run_dir)[:-cfg.keep_ckpts]:
        os.replace(os.path.join(run_dir, c), os.path.join(run_dir, c + ".old"))
        shutil.rmtree(os.path.join(run_dir, c + ".old"), ignore_errors=True)
    return final


def resume_point(cfg, run_dir):
    """-> (checkpoint path, its train state), or (None, None) for a fresh run. --resume=auto takes
    the newest loadable checkpoint, saying which newer ones it passed over (a disk or a copy can
    damage one); an explicit one must load."""
    if cfg.resume != "auto":
        return (cfg.resume, load_train_state(cfg.resume)) if cfg.resume else (None, None)
    for name in reversed(list_ckpts(run_dir)):
        path = os.path.join(run_dir, name)
        try:
            return path, load_train_state(path)
        except ValueError as e:
            print(f"WARNING resume: passing over {path}: {e}", flush=True)
    return None, None


def load_train_state(ckpt):
    """train_state.pt through torch.load(weights_only=True), so a tampered or foreign file cannot
    run code, onto the CPU; the drafter's files must be whole too. Raises ValueError saying what is
    missing, torn, or refused."""
    from safetensors import safe_open
    missing = [f for f in ("config.json", "model.safetensors", "train_state.pt")
               if not os.path.isfile(os.path.join(ckpt, f))]
    if missing:
        raise ValueError(f"{ckpt} is incomplete: no {', '.join(missing)}")
    try:
        with safe_open(os.path.join(ckpt, "model.safetensors"), "pt"):
            pass
        json.load(open(os.path.join(ckpt, "config.json")))
    # a truncated safetensors file fails its header check; a cut config.json its parse
    except Exception as e:
        raise ValueError(f"{ckpt} is torn: {type(e).__name__}: {_first_line(e)}") from None
    path = os.path.join(ckpt, "train_state.pt")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:  # anything beyond tensors and plain containers
        raise ValueError(f"{path} is not a plain training state (refusing to unpickle it): "
                         f"{_first_line(e)}") from None
    except Exception as e:  # a truncated zip archive: RuntimeError from the stream reader, EOFError
        raise ValueError(f"{path} is torn (truncated or damaged): {type(e).__name__}: "
                         f"{_first_line(e)}") from None


def _first_line(e):
    return str(e).splitlines()[0] if str(e) else ""


def lock_run_dir(run_dir):
    """One run per run directory: an exclusive lock on run_dir/lock, held while this process lives
    (keep the returned file open). A second run into the same directory is refused, naming the
    holder."""
    import fcntl
    import socket
    os.makedirs(run_dir, exist_ok=True)
    f = open(os.path.join(run_dir, "lock"), "a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = f.read().strip() or "holder unknown"
        raise RuntimeError(f"{run_dir} is in use by another run ({holder}); wait for it to end, or "
                           f"pick another run_name") from None
    f.truncate(0)
    f.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
    f.flush()
    return f


# --------------------------------------------------------------------------------------------- logs
# one human line and one metrics.jsonl record per log step, curves.png at each checkpoint
def step_metrics(s, d, dt):
    """The statistics summed over a log interval of dt seconds (a dict of float64 tensors, reduced
    over the drafter ranks) -> the figures of its log record: loss, accuracy, tau estimate,
    throughput, each role's busy fraction and capacity, peak memory."""
    s = {k: (v.item() if v.numel() == 1 else v) for k, v in s.items()}
    correct, count = s["correct_K"], s["count_K"]
    # busy: summed per-GPU busy seconds over (GPUs x wall seconds)
    t_busy = s["target_s"] / (len(d.targets) * dt)
    d_busy = s["drafter_s"] / (len(d.drafters) * dt)
    # sequences per second one GPU of each role sustains
    cap_t = s["sequences"] / max(s["target_s"], 1e-9)
    cap_d = s["sequences"] / max(s["drafter_s"], 1e-9)
    balance = d.world * cap_d / (cap_t + cap_d)  # target GPUs that would exactly feed the rest
    mem = torch.cuda.max_memory_allocated() / 2 ** 30 if d.device.type == "cuda" else 0.0
    return dict(loss=s["loss_sum"] / max(s["weight_sum"], 1e-12),
                acc=(correct.sum() / count.sum().clamp(min=1)).item(),
                tau_est=s["tau_sum"] / max(s["blocks"], 1),
                tok_s=s["tokens"] / dt, seq_s=s["sequences"] / dt,
                target_busy=t_busy, drafter_busy=d_busy,
                target_seq_s_per_gpu=cap_t, drafter_seq_s_per_gpu=cap_d,
                balanced_target_gpus=balance, mem_gb=mem,
                acc_k=(correct / count.clamp(min=1)).tolist()[1:])


def log_line(run_dir, rec, total, world):
    """One log step: rec (step, step_metrics' figures, lr, grad_norm, recompiles, bad_steps, eta_s)
    as a human line and a metrics.jsonl record."""
    rec = dict(rec, time=time.time())
    eta = datetime.timedelta(seconds=round(rec["eta_s"]))
    line = (f"step={rec['step']}/{total} loss={rec['loss']:.4f} acc={rec['acc']:.3f} "
            f"tau_est={rec['tau_est']:.2f} lr={rec['lr']:.2e} gnorm={rec['grad_norm']:.2f} "
            f"tok/s={rec['tok_s']:.0f} target_busy={rec['target_busy']:.0%} "
            f"drafter_busy={rec['drafter_busy']:.0%} mem={rec['mem_gb']:.1f}GB eta={eta} | "
            f"capacity seq/s/GPU target={rec['target_seq_s_per_gpu']:.2f} "
            f"drafter={rec['drafter_seq_s_per_gpu']:.2f}")
    balance = rec["balanced_target_gpus"]
    if world > 1:
        line += f" -> balanced split {balance:.1f}:{world - balance:.1f}"
    if rec["recompiles"]:
        line += f" RECOMPILES={rec['recompiles']}"
    if rec["bad_steps"]:
        line += f" SKIPPED_STEPS={rec['bad_steps']}"
    print(line, flush=True)
    with open(os.path.join(run_dir, "metrics.jsonl"), "a") as f:
        f.write(json.dumps(rec) + "\n")


def log_skipped(run_dir, rec, total, max_bad):
    """A step dropped for a non-finite loss or grad norm, rec (step, skipped=True, loss, grad_norm,
    bad_streak, bad_steps): one human line and one JSONL record now, whatever log_every says.
    Non-finite values are written as strings ("nan", "inf"): the file stays valid JSON."""
    print(f"step={rec['step']}/{total} SKIPPED: non-finite loss={rec['loss']:.4g} "
          f"gnorm={rec['grad_norm']:.4g}; weights and optimizer state unchanged "
          f"({rec['bad_streak']} in a row, the run stops at {max_bad}; {rec['bad_steps']} "
          f"skipped so far)", flush=True)
    num = lambda x: x if not isinstance(x, float) or math.isfinite(x) else str(x)  # noqa: E731
    rec = {k: num(v) for k, v in dict(rec, time=time.time()).items()}
    with open(os.path.join(run_dir, "metrics.jsonl"), "a") as f:
        f.write(json.dumps(rec) + "\n")


def plot_curves(run_dir):
    # no pyplot: no global backend state, renders headless (Agg)
    from matplotlib.figure import Figure
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        rows = [r for r in map(json.loads, f) if not r.get("skipped")]
    fig = Figure(figsize=(13, 3.5))
    for ax, key in zip(fig.subplots(1, 3), ("loss", "acc", "tau_est")):
        ax.plot([r["step"] for r in rows], [r[key] for r in rows])
        ax.set(title=key, xlabel="step")
    fig.tight_layout()
    fig.savefig(os.path.join(run_dir, "curves.png"), dpi=100)
