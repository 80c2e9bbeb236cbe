"""
Fault injection from outside the trainer: patch one function of train.py for one rank and one optimizer step, then
run train.main exactly as `python train.py` would. Production code carries no test hooks.

    torchrun ... tests/faults.py RANK:STEP[:HOW] --field=value ...     (what conftest.run_train(fail=...) runs)

RANK is a global rank; STEP a 0-based optimizer step, "N+" meaning step N and every later one. The step hooks sit on
train.accumulate (the drafter's micro-batches of one step), so RANK is a drafter rank, or 0 when colocated; tests
kill target ranks from outside, with a real kill -9.
  (no HOW)  raise after that step's micro-batches (a Python error: message and traceback)
  kill      SIGKILL there (no message, no cleanup: what a crash or the OOM killer does)
  nan       that step's loss on this rank becomes NaN (every drafter rank then sees a non-finite reduced loss)
  inf       that step's update leaves a weight non-finite on this rank (what an overflowing update does)
  ckpt      SIGKILL inside the write of checkpoint ckpt-<STEP>, after its .tmp is complete, before the rename
"""

import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import checkpoint  # noqa: E402
import train  # noqa: E402


def at(spec, step):
    return step >= int(spec[:-1]) if spec.endswith("+") else step == int(spec)


def install(rank, step, how):
    if how == "ckpt":  # the last fsync of the .tmp directory is the moment it is complete and not yet renamed
        fsync = checkpoint._fsync

        def killing_fsync(path):
            fsync(path)
            if str(path).endswith(f"ckpt-{int(step):07d}.tmp"):
                os.kill(os.getpid(), signal.SIGKILL)
        checkpoint._fsync = killing_fsync
        return
    accumulate, optimizer_step, now = train.accumulate, train.Optimizer.step, []

    def faulty_accumulate(i, *args, **kwargs):
        stats, length = accumulate(i, *args, **kwargs)
        now[:] = [i]
        if how == "inf":
            return stats, length
        if at(step, i):
            if how == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            if how == "nan":
                stats["loss_sum"] = stats["loss_sum"] * float("nan")
            else:
                raise RuntimeError(f"injected failure (rank {rank}, step {i})")
        return stats, length
    train.accumulate = faulty_accumulate

    def overflowing_step(self, *args, **kwargs):
        out = optimizer_step(self, *args, **kwargs)
        if at(step, now[0]):
            with train.torch.no_grad():
                self.params[0].view(-1)[0] = float("inf")
        return out
    if how == "inf":
        train.Optimizer.step = overflowing_step


if __name__ == "__main__":
    rank, step, how = (sys.argv[1].split(":") + [""])[:3]
    if int(rank) == train.torchrun_env().rank:
        install(rank, step, how)
    train.main(train.parse_config(sys.argv[2:]))
