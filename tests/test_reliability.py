"""Fault campaign: every fault ends in a clean, loud exit or in the result of a run without it.

Killed ranks (kill -9 of a target and of a drafter rank at seeded random steps), a crash between a checkpoint's
temp write and its rename followed by an exact resume under the split topology, non-finite steps (skipped,
counted, stopped after max_bad_steps), a table of invalid configurations rejected before any model is loaded,
and the loading/writing safety rules. Real torchrun jobs on CPU (gloo) with the tiny random target of conftest.

    python -m pytest -q tests/test_reliability.py
"""

import copy
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import checkpoint
import train
from ranks import Dist
from conftest import ROOT, job, run_train

SPLIT = ("--target_ranks=2", "--drafter_ranks=1")
CRASH = ("--max_steps=8", "--batch_size=2", "--grad_accum=2", "--ckpt_every=2", "--keep_ckpts=2",
         "--warmup_ratio=0.5", *SPLIT)
PREEMPT = ("--max_steps=16", "--ckpt_every=1000")  # a target rank's request arrives up to ~7 steps later
ONE_TWO = ("--target_ranks=1", "--drafter_ranks=2")
# The training runs of this module that need no signal from the test while they run, started together in the
# background when the module starts (the `runs` fixture of conftest, two at a time), so that both cores stay busy;
# each test reads its own by name.
RUNS = {  # one-process runs first: the kill -9 tests, which come first, then share the cores with lighter jobs
    "nonfinite-once": job(1, "--max_steps=5", "--ckpt_every=1", "--keep_ckpts=5", fail="0:2:nan"),
    "torn-checkpoints": job(1, "--max_steps=3", "--ckpt_every=1"),  # then torn by its test, and resumed
    "nonfinite-weights": job(1, "--max_steps=4", "--ckpt_every=1", fail="0:1:inf"),
    "nonfinite-last-steps": job(1, "--max_steps=5", "--ckpt_every=1", fail="0:3+:nan"),
    "mask-token-in-data": job(1, "--max_steps=2", "--mask_token=<|im_end|>"),
    "crash-straight": job(3, *CRASH),  # the uninterrupted run the crashed and resumed one must equal
    "nonfinite-streak": job(3, "--max_steps=50", "--ckpt_every=2", "--max_bad_steps=3", *ONE_TWO,
                            fail="2:2+:nan"),
    "bad-config": job(3, *SPLIT, "--block_size=1", "--lr=0", "--run_name=../x"),
    "uninterrupted": job(3, *PREEMPT, *ONE_TWO),  # what a stopped and resumed run must equal
}


def _tiny_drafter_files(ck):
    """A small released-format drafter in `ck` (what a checkpoint directory holds besides train_state.pt)."""
    from model import DFlashDrafter, DrafterConfig, save_drafter
    save_drafter(DFlashDrafter(DrafterConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                             num_attention_heads=2, num_key_value_heads=1, head_dim=16, vocab_size=128,
                                             mask_token_id=3, target_layer_ids=[1], num_target_layers=4)), ck)


def records(out):
    return [json.loads(x) for x in open(Path(out) / "r" / "metrics.jsonl")]


def procs_with(marker):
    """pids of live processes whose command line mentions `marker` (a test's unique out_dir)."""
    pids = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit() and p.name != str(os.getpid()):
            try:
                cmd = (p / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                state = (p / "stat").read_text().rsplit(")", 1)[1].split()[0]
            except OSError:  # exited while we looked
                continue
            if marker in cmd and state != "Z":
                pids.append(int(p.name))
    return pids


def rank_pid(marker, rank):
    """The worker process of global rank `rank` in the job whose command line mentions `marker`."""
    for pid in procs_with(marker):
        try:
            env = (Path("/proc") / str(pid) / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in env and b"TORCHELASTIC_RUN_ID" in b" ".join(env):
            return pid
    return None


# -----------------------------------------------------------------------------
# kill -9


@pytest.mark.parametrize("role", ["target", "drafter", "launcher"])
def test_kill_9_names_rank_and_role_exits_fast_no_orphans(tiny_target, convs, tmp_path, role):
    """A real `kill -9` from outside, at a seeded random step, of a target rank (0 or 1) or the drafter (rank 2)
    of a 2 + 1 job: the job exits non-zero within 60 s of the kill, torchrun's summary names the rank and its role
    as the root cause, and no process of the job is left. kill -9 of torchrun itself takes its ranks with it."""
    rng = random.Random(f"kill-{role}")
    rank = rng.choice([0, 1]) if role == "target" else 2
    kill_at = rng.randint(2, 6)  # optimizer steps already logged when the kill lands
    out = tmp_path / f"kill-{role}"
    p = run_train(tiny_target, convs, out, 3, "--max_steps=100000", *SPLIT, wait=False)
    try:
        metrics = out / "r" / "metrics.jsonl"
        t_start = time.time()
        while not (metrics.exists() and len(metrics.read_text().splitlines()) >= kill_at):
            assert p.poll() is None, p.communicate()[1][-3000:]
            assert time.time() - t_start < 120, "the job never reached the kill step"
            time.sleep(0.05)
        pid = p.pid if role == "launcher" else rank_pid(str(out), rank)
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        t_kill = time.time()
        if role == "launcher":  # nobody is left to print a summary; the ranks must die with it (PR_SET_PDEATHSIG)
            p.wait(timeout=60)
            while procs_with(str(out)) and time.time() - t_kill < 10:
                time.sleep(0.1)
        else:
            _, err = p.communicate(timeout=120)
            assert time.time() - t_kill < 60
            root = err[err.index("Root Cause"):]
            assert f"rank      : {rank} " in root and "SIGKILL" in root, root
            assert f"rank {rank} ({role}) died without a Python error" in root, root
        assert p.returncode != 0
        assert procs_with(str(out)) == [], "orphan processes"
    finally:  # never leave a failed test's job running
        for q in procs_with(str(out)):
            os.kill(q, signal.SIGKILL)


# -----------------------------------------------------------------------------
# a crash inside a checkpoint write, then an exact resume under the split topology


@pytest.mark.runs("crash-straight")
def test_crash_in_checkpoint_write_keeps_newest_and_resume_is_exact_split(tiny_target, convs, tmp_path, runs):
    """2 target + 1 drafter ranks, fp32, batch 2 x grad_accum 2 (6 steps per epoch of 24 conversations), warmup
    over 4 of 8 steps. The drafter (the checkpoint writer) is SIGKILLed after ckpt-0000004.tmp is complete and
    before its rename: ckpt-0000002 stays intact and loadable, --resume=auto picks it, and the resumed run (inside
    the warmup, across the epoch boundary) has the losses, grad norms and final weights of an uninterrupted run,
    exactly: data cursor, anchor sampling, LR schedule and optimizer state are all restored."""
    p, straight_out, _ = runs["crash-straight"]
    assert p.returncode == 0, p.stderr[-3000:]
    straight = records(straight_out)

    out = tmp_path / "crash"
    p, _ = run_train(tiny_target, convs, out, 3, *CRASH, fail="2:4:ckpt")
    assert p.returncode != 0 and "SIGKILL" in p.stderr
    root = p.stderr[p.stderr.index("Root Cause"):]  # the killed rank, not the ranks torchrun stopped after it
    assert "rank      : 2 " in root and "rank 2 (drafter) died without a Python error" in root, root
    run = out / "r"
    assert checkpoint.list_ckpts(run) == ["ckpt-0000002"]
    assert (run / "ckpt-0000004.tmp" / "train_state.pt").exists()  # killed after the temp write, before the rename
    from model import load_drafter
    load_drafter(run / "ckpt-0000002")
    assert checkpoint.load_train_state(run / "ckpt-0000002")["step"] == 2
    assert [r["step"] for r in records(out)] == [1, 2, 3, 4]  # steps 3-4 ran, then their checkpoint was lost

    p, _ = run_train(tiny_target, convs, out, 3, *CRASH, "--resume=auto")
    assert p.returncode == 0, p.stderr[-3000:]
    assert "resuming at step 2" in p.stdout and "WARNING resume" not in p.stdout  # the same config
    resumed = records(out)
    assert [r["step"] for r in resumed] == list(range(1, 9))  # the lines of the lost steps were replaced
    for key in ("loss", "grad_norm", "acc", "tau_est", "lr"):
        assert [r[key] for r in resumed] == [r[key] for r in straight], key  # bit-identical in fp32
    a = checkpoint.load_train_state(straight_out / "r" / "ckpt-0000008")
    b = checkpoint.load_train_state(run / "ckpt-0000008")
    assert all(torch.equal(x, y) for x, y in zip(a["masters"], b["masters"]))
    assert (run / "ckpt-0000008" / "model.safetensors").read_bytes() == \
        (straight_out / "r" / "ckpt-0000008" / "model.safetensors").read_bytes()
    assert sorted(os.listdir(run)) == sorted(os.listdir(straight_out / "r"))  # no .tmp left behind


def test_checkpoint_write_failure_keeps_earlier_ones(tmp_path, monkeypatch):
    """A failed write (here: the disk is full while torch.save runs) raises, removes its .tmp and leaves the
    earlier checkpoints alone; rewriting an existing step swaps it out instead of deleting it first."""
    cfg = train.Config(keep_ckpts=2)
    d = Dist(0, 1, torch.device("cpu"), [0], [0], 1, None, None, None)
    from model import DFlashDrafter, DrafterConfig
    dcfg = DrafterConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=1, head_dim=16, vocab_size=128, mask_token_id=3,
                         target_layer_ids=[1], num_target_layers=4)
    drafter = DFlashDrafter(dcfg)
    optim = train.Optimizer(cfg, drafter, d)
    for step in (1, 2):
        checkpoint.save_checkpoint(tmp_path, step, drafter, optim, cfg)
    before = {c: (tmp_path / c / "model.safetensors").read_bytes() for c in checkpoint.list_ckpts(tmp_path)}

    def full_disk(*a, **k):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(torch, "save", full_disk)
    with pytest.raises(OSError, match="No space left"):
        checkpoint.save_checkpoint(tmp_path, 3, drafter, optim, cfg)
    monkeypatch.undo()
    assert sorted(os.listdir(tmp_path)) == ["ckpt-0000001", "ckpt-0000002"]  # no torn ckpt-3, no .tmp
    assert {c: (tmp_path / c / "model.safetensors").read_bytes() for c in checkpoint.list_ckpts(tmp_path)} == before
    with torch.no_grad():
        next(drafter.parameters()).add_(1.0)
    # the same step again: replaced, not lost
    checkpoint.save_checkpoint(tmp_path, 2, drafter, optim, cfg)
    assert sorted(os.listdir(tmp_path)) == ["ckpt-0000001", "ckpt-0000002"]
    assert (tmp_path / "ckpt-0000002" / "model.safetensors").read_bytes() != before["ckpt-0000002"]


# -----------------------------------------------------------------------------
# non-finite loss or grad norm


def _optimizer(dtype):
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8).to(dtype)
    d = Dist(0, 1, torch.device("cpu"), [0], [0], 1, None, None, None)
    return model, train.Optimizer(train.Config(), model, d)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nonfinite_step_changes_nothing(dtype):
    model, opt = _optimizer(dtype)
    model(torch.randn(4, 8, dtype=dtype)).sum().backward()
    assert opt.step(1e-2, 4.0)[1]  # a good step first, so Adam has state to (not) change
    snap = [p.detach().clone() for p in model.parameters()], [m.detach().clone() for m in opt.masters]
    state = {k: v.clone() for k, v in opt.opt.state[opt.masters[0]].items()}
    for poison in ("grad", "loss"):
        model(torch.randn(4, 8, dtype=dtype)).sum().backward()
        if poison == "grad":
            model.weight.grad[0, 0] = float("nan")
        gnorm, applied = opt.step(1e-2, 4.0, loss_finite=poison != "loss")
        assert not applied and (poison == "loss") == (gnorm == gnorm)  # nan != nan
        assert all(p.grad is None for p in model.parameters())  # the bad gradients are dropped
        assert all(torch.equal(a, b) for a, b in zip(model.parameters(), snap[0]))
        assert all(torch.equal(a, b) for a, b in zip(opt.masters, snap[1]))
        assert all(torch.equal(v, state[k]) for k, v in opt.opt.state[opt.masters[0]].items())
    model(torch.randn(4, 8, dtype=dtype)).sum().backward()
    assert opt.step(1e-2, 4.0)[1]  # the next good step applies normally
    assert not torch.equal(model.weight, snap[0][0])


@pytest.mark.runs("nonfinite-once")
def test_nonfinite_step_is_skipped_counted_and_logged(runs):
    """One NaN loss at step index 2 (the 3rd step): skipped, counted, logged at once; training continues and
    the optimizer applied 4 of 5 updates; no checkpoint holds a bad step."""
    p, out, _ = runs["nonfinite-once"]
    assert p.returncode == 0, p.stderr[-3000:]
    assert "step=3/5 SKIPPED: non-finite loss=nan" in p.stdout and "done: 5 steps, 1 skipped" in p.stdout
    rows = records(out)
    assert [(r["step"], bool(r.get("skipped"))) for r in rows] == [(1, 0), (2, 0), (3, 1), (4, 0), (5, 0)]
    assert rows[2]["loss"] == "nan" and rows[2]["bad_steps"] == 1 and [r["bad_steps"] for r in rows[3:]] == [1, 1]
    assert checkpoint.list_ckpts(out / "r") == ["ckpt-0000001", "ckpt-0000002", "ckpt-0000004", "ckpt-0000005"]
    state = checkpoint.load_train_state(out / "r" / "ckpt-0000005")
    assert state["bad_steps"] == 1
    assert all(int(s["step"]) == 4 for s in state["optimizer"]["state"].values())  # Adam saw 4 updates, not 5


@pytest.mark.runs("nonfinite-streak")
def test_consecutive_nonfinite_steps_stop_the_run_naming_last_good_checkpoint(runs):
    """1 target + 2 drafter ranks; NaN losses on rank 2 only, from step index 2 on: the leader (rank 1) sees them
    through the all-reduce, both drafters skip the same steps, and after max_bad_steps=3 the job stops with the
    path of the last good checkpoint."""
    p, out, secs = runs["nonfinite-streak"]
    assert p.returncode != 0
    good = str(out / "r" / "ckpt-0000002")
    assert "3 consecutive steps with a non-finite loss or grad norm (steps 3-5" in p.stderr
    assert f"Last good checkpoint: {good}" in p.stderr
    root = p.stderr[p.stderr.index("Root Cause"):]  # a drafter's error, not the target rank stopped after it
    assert "FAILED: FloatingPointError" in root and "(drafter)]" in root and "died without" not in root, root
    rows = records(out)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]  # nothing after the stop
    assert [r.get("bad_streak") for r in rows[2:]] == [1, 2, 3]
    assert checkpoint.list_ckpts(out / "r") == ["ckpt-0000002"]  # no checkpoint during the bad streak
    assert secs < 120


# -----------------------------------------------------------------------------
# config validation: every field error named, before any model loading

# one invalid field per row, on top of a valid 2 + 1 configuration (checked valid below)
INVALID = [
    ("world", dict(target_ranks=3), "target_ranks"),  # 3 + 1 != world size 3
    ("layer ids", dict(target_features=9), "target_features"),  # the target has 6 layers
    ("block", dict(block_size=1), "block_size"),
    ("mask id", dict(mask_token="49152"), "mask_token"),  # vocabulary 49152
    ("mask string", dict(mask_token="<not-a-token>"), "mask_token"),
    ("data", dict(data="/nonexistent/train.jsonl"), "data"),
    ("max_length", dict(max_length=3), "max_length"),  # < block_size 4
    ("anchors", dict(num_anchors=0), "num_anchors"),
    ("gamma", dict(gamma=0.0), "gamma"),
    ("loss weighting", dict(loss_weighting="pace"), "loss_weighting"),
    ("fp8 recipe", dict(fp8="e4m3"), "fp8"),
    ("dpace alpha 0", dict(dpace_alpha=0.0), "dpace_alpha"),
    ("dpace alpha nan", dict(dpace_alpha=float("nan")), "dpace_alpha"),
    ("markov rank negative", dict(markov_rank=-1), "markov_rank"),
    ("lr", dict(lr=-1e-3), "lr"),
    ("lr nan", dict(lr=float("nan")), "lr"),
    ("warmup", dict(warmup_ratio=1.0), "warmup_ratio"),
    ("beta2", dict(beta2=1.0), "beta2"),
    ("epochs", dict(epochs=0.0, max_steps=0), "epochs"),
    ("max_steps", dict(max_steps=-1), "max_steps"),
    ("clip", dict(grad_clip=0.0), "grad_clip"),
    ("keep", dict(keep_ckpts=0), "keep_ckpts"),
    ("bad steps", dict(max_bad_steps=0), "max_bad_steps"),
    ("escape", dict(run_name="../elsewhere"), "run_name"),
    ("absolute", dict(run_name="/tmp/elsewhere"), "run_name"),
    ("nested", dict(run_name="a/b"), "run_name"),
    ("init", dict(init_drafter="/nonexistent/drafter"), "init_drafter"),
    ("resume", dict(resume="/nonexistent/ckpt-0000100"), "resume"),
    ("window", dict(sliding_window=0), "sliding_window"),  # sliding_layers=1
    ("sliding", dict(sliding_layers=3), "sliding_layers"),  # drafter_layers=2
    ("dtype", dict(dtype="float16"), "dtype"),
    ("shard", dict(target_shard="zero3"), "target_shard"),
    ("device", dict(device="tpu"), "device"),
    ("prefetch", dict(prefetch=0), "prefetch"),
    # non-finite and absurd numbers: every range check also refuses nan and inf
    ("lr inf", dict(lr=float("inf")), "lr"),
    ("gamma nan", dict(gamma=float("nan")), "gamma"),
    ("gamma inf", dict(gamma=float("inf")), "gamma"),
    ("clip inf", dict(grad_clip=float("inf")), "grad_clip"),
    ("decay inf", dict(weight_decay=float("inf")), "weight_decay"),
    ("decay nan", dict(weight_decay=float("nan")), "weight_decay"),
    ("decay negative", dict(weight_decay=-0.1), "weight_decay"),
    ("warmup nan", dict(warmup_ratio=float("nan")), "warmup_ratio"),
    ("warmup negative", dict(warmup_ratio=-0.1), "warmup_ratio"),
    ("beta1 nan", dict(beta1=float("nan")), "beta1"),
    ("beta1 negative", dict(beta1=-0.5), "beta1"),
    ("epochs inf", dict(epochs=float("inf")), "epochs"),
    ("epochs nan", dict(epochs=float("nan")), "epochs"),
    ("epochs huge", dict(epochs=1e12), "epochs"),
    ("epochs inf with max_steps", dict(epochs=float("inf"), max_steps=5), "epochs"),
    ("max_steps huge", dict(max_steps=10 ** 12), "max_steps"),
    ("seed negative", dict(seed=-1), "seed"),
    ("seed past the RNGs", dict(seed=2 ** 32), "seed"),
    ("timeout zero", dict(transport_timeout=0), "transport_timeout"),
    ("timeout absurd", dict(transport_timeout=10 ** 12), "transport_timeout"),
    ("prefetch absurd", dict(prefetch=10 ** 6), "prefetch"),
    ("anchors past the length", dict(num_anchors=65), "num_anchors"),  # max_length 64
    ("anchors absurd", dict(num_anchors=10 ** 9), "num_anchors"),
    ("pad absurd", dict(pad_multiple=2 ** 40), "pad_multiple"),
    ("pad zero", dict(pad_multiple=0), "pad_multiple"),
    ("pad past the length", dict(pad_multiple=65), "pad_multiple"),  # max_length 64
    ("markov rank absurd", dict(markov_rank=4097), "markov_rank"),
    ("plan not a shape", dict(plan="abc"), "plan"),
    ("plan zero nodes", dict(plan="0x8"), "plan"),
    ("plan GiB nan", dict(plan="1x8:nan"), "plan"),
    ("length absurd", dict(max_length=2 ** 40, num_anchors=8), "max_length"),
    ("layers absurd", dict(drafter_layers=10 ** 6), "drafter_layers"),
    ("layers zero", dict(drafter_layers=0, sliding_layers=0), "drafter_layers"),
    ("block absurd", dict(block_size=10 ** 6), "block_size"),
    ("batch zero", dict(batch_size=0), "batch_size"),
    ("batch absurd", dict(batch_size=2 ** 40), "batch_size"),
    ("accum zero", dict(grad_accum=0), "grad_accum"),
    ("log zero", dict(log_every=0), "log_every"),
    ("ckpt zero", dict(ckpt_every=0), "ckpt_every"),
    ("chunk negative", dict(loss_chunk=-1), "loss_chunk"),
    ("features negative", dict(target_features=-1), "target_features"),
    # training windows only the context, inference the block's keys too: W < K would make them differ
    ("window below block", dict(sliding_window=3), "sliding_window"),  # block_size 4, sliding_layers 1
    ("window inf", dict(sliding_window=float("inf")), "sliding_window"),
    # a mask token given as a string is one exact token; only ASCII digits are an id
    ("mask non-ASCII digits", dict(mask_token="\u0663"), "mask_token"),  # Arabic-Indic three: not the id 3
    ("mask two tokens", dict(mask_token="hello world"), "mask_token"),
    ("mask token plus space", dict(mask_token="<empty_output> "), "mask_token"),
    ("run dir outside out_dir", dict(run_name="{link}"), "run_name"),
    ("out_dir a file", dict(out_dir="{file}"), "out_dir"),
    ("kd unknown", dict(kd_loss="tv"), "kd_loss"),
    ("kd weight past 1", dict(kd_weight=1.5), "kd_weight"),
    ("confidence weight negative", dict(confidence_weight=-1.0), "confidence_weight"),
    ("confidence head without a Markov head", dict(confidence_head=True),
     "confidence_head"),
    ("confidence detached without a head", dict(confidence_detached=True), "confidence_detached"),
    ("domino beside a Markov head", dict(domino_gru_dim=8, markov_rank=4), "domino_gru_dim"),
    ("domino base weight past 1", dict(domino_base_start=1.5), "domino_base_start"),
    ("unknown domino layout", dict(domino_layout="sideways"), "domino_layout"),
    ("more than any machine holds", dict(max_length=2 ** 20, num_anchors=2 ** 19), "num_anchors"),  # memory check
]


@pytest.fixture
def valid(tiny_target, convs, tmp_path):
    return dict(target=str(tiny_target), data=str(convs), out_dir=str(tmp_path / "out"), run_name="r", device="cpu",
                mask_token="<empty_output>", drafter_layers=2, target_features=3, sliding_layers=1,
                sliding_window=16, block_size=4, num_anchors=8, max_length=64, pad_multiple=16,
                target_ranks=2, drafter_ranks=1)


@pytest.fixture(scope="module")
def target_meta(tiny_target):
    from transformers import AutoConfig, AutoTokenizer
    return AutoConfig.from_pretrained(tiny_target), AutoTokenizer.from_pretrained(tiny_target)


@pytest.mark.parametrize("case,override,field", INVALID, ids=[c[0] for c in INVALID])
def test_invalid_config_names_the_field(valid, target_meta, case, override, field, tmp_path):
    train.validate(train.Config(**valid), 3, *target_meta)  # the base is valid: the override alone is at fault
    os.makedirs(valid["out_dir"], exist_ok=True)
    os.symlink(tmp_path, os.path.join(valid["out_dir"], "link"))  # a run directory that leads out of out_dir
    (tmp_path / "file").write_text("not a directory")
    override = {k: v.format(link="link", file=tmp_path / "file") if isinstance(v, str) else v
                for k, v in override.items()}
    with pytest.raises(ValueError) as e:
        train.validate(train.Config(**{**valid, **override}), 3, *target_meta)
    lines = str(e.value).splitlines()[1:]
    assert len(lines) == 1 and field in lines[0], lines


def test_markov_rank_past_the_vocabulary_is_refused(valid, target_meta):
    """A V x r, r x V head is low-rank only below r = V: a rank past the target's vocabulary is
    refused."""
    tc, tok = target_meta
    small = copy.deepcopy(tc)
    small.vocab_size = 1024  # the mask token <empty_output> (id 16) stays inside it
    train.validate(train.Config(**valid, markov_rank=1024), 3, small, tok)
    with pytest.raises(ValueError, match=r"markov_rank=1025 must be in \[0, min\(4096, the target "
                                         r"vocabulary 1024"):
        train.validate(train.Config(**valid, markov_rank=1025), 3, small, tok)


def test_fp8_head_needs_fp8_sized_head(valid, target_meta):
    """The FP8 matmuls take sizes in multiples of 16: a target vocabulary of 49,150 is refused before any work."""
    tc, tok = target_meta
    odd = copy.deepcopy(tc)
    odd.vocab_size = 49150
    train.validate(train.Config(**valid, fp8_head=True), 3, tc, tok)
    with pytest.raises(ValueError, match=r"fp8_head=True needs the target's vocab_size \(49150\)"):
        train.validate(train.Config(**valid, fp8_head=True), 3, odd, tok)



def test_target_fp8_needs_an_unsharded_target(valid, target_meta):
    """FSDP2 shards the target's bf16 weights; their FP8 copies would not be: refused before any work unless the
    target is replicated (or colocated with the drafter in one process)."""
    tc, tok = target_meta
    with pytest.raises(ValueError, match=r"target_fp8=True needs target_shard=replicate"):
        train.validate(train.Config(**valid, target_fp8=True), 3, tc, tok)
    train.validate(train.Config(**valid, target_fp8=True, target_shard="replicate"), 3, tc, tok)
    train.validate(train.Config(**valid, target_fp8=True), 1, tc, tok)  # colocated: one process, no FSDP

def test_fresh_run_over_old_checkpoints_is_refused(valid, target_meta):
    os.makedirs(os.path.join(valid["out_dir"], "r", "ckpt-0000100"))
    with pytest.raises(ValueError, match=r"resume: .* already holds checkpoints .*ckpt-0000100"):
        train.validate(train.Config(**valid), 3, *target_meta)
    train.validate(train.Config(**valid, resume="auto"), 3, *target_meta)


@pytest.mark.parametrize("argv,field", [(["--lrr=1"], "lrr"), (["--batch_size=two"], "batch_size"),
                                        (["--skip_invalid=maybe"], "skip_invalid"), (["--preset=huge"], "preset"),
                                        (["lr=1"], "lr=1")])
def test_bad_command_line_names_the_field(argv, field):
    with pytest.raises(SystemExit, match=field):
        train.parse_config(argv)


@pytest.mark.runs("bad-config")
def test_bad_config_stops_before_any_model_loading(convs, tmp_path, runs):
    """The real entry point under torchrun: every rank refuses at once, all errors listed, nothing loaded, no
    process group; a missing target is named as such."""
    p = runs["bad-config"].p
    assert p.returncode != 0
    for part in ("block_size=1", "lr=0.0", "run_name='../x'"):
        assert part in p.stderr, part
    assert "placement:" not in p.stdout and "target loaded" not in p.stdout and "target weights" not in p.stdout
    assert "invalid config" in p.stderr[p.stderr.index("Root Cause"):]  # torchrun's summary says why
    with pytest.raises(SystemExit, match="target: cannot read a model config and tokenizer from '/nonexistent/m"):
        train.main(train.Config(target="/nonexistent/model", data=str(convs), out_dir=str(tmp_path)))


# -----------------------------------------------------------------------------
# nothing runs code it should not, nothing is fetched, nothing written outside the run directory


class _Payload:
    def __reduce__(self):  # unpickling calls open(marker, "w"): would create the file
        return open, (os.environ["DFLASH_TEST_MARKER"], "w")


def test_train_state_holding_code_is_refused(tmp_path, monkeypatch):
    marker = tmp_path / "ran"
    monkeypatch.setenv("DFLASH_TEST_MARKER", str(marker))
    ck = tmp_path / "ckpt-0000001"
    _tiny_drafter_files(ck)  # a complete checkpoint but for what train_state.pt holds
    torch.save({"step": 1, "masters": [torch.zeros(2)], "x": _Payload()}, ck / "train_state.pt")
    with pytest.raises(ValueError, match="refusing to unpickle"):
        checkpoint.load_train_state(ck)
    assert not marker.exists()


def test_no_remote_code_no_unsafe_unpickling_in_the_repo():
    for f in list(ROOT.glob("*.py")):
        src = f.read_text()
        assert "trust_remote_code=True" not in src, f
        assert "weights_only=False" not in src, f
        assert "pickle.load" not in src, f


GUARD = '''
import socket
_ok = ("localhost", "127.0.0.1", "::1", socket.gethostname())
_getaddrinfo, _connect = socket.getaddrinfo, socket.socket.connect
def _no_dns(host, *a, **k):
    if host not in _ok and host is not None:
        raise OSError(f"network access attempted: {host}")
    return _getaddrinfo(host, *a, **k)
def _no_connect(self, addr):
    if isinstance(addr, tuple) and addr[0] not in _ok:
        raise OSError(f"network access attempted: {addr}")
    return _connect(self, addr)
socket.getaddrinfo, socket.socket.connect = _no_dns, _no_connect
'''


def test_training_needs_no_network_and_writes_only_its_run_directory(tiny_target, convs, tmp_path):
    guard = tmp_path / "guard"
    guard.mkdir()
    (guard / "sitecustomize.py").write_text(GUARD)
    env = {"PYTHONPATH": str(guard), "DFLASH_CACHE": str(tmp_path / "cache")}
    fetch = "import urllib.request; urllib.request.urlopen('http://example.com')"
    probe = subprocess.run([sys.executable, "-c", fetch], capture_output=True, text=True, env={**os.environ, **env})
    assert "network access attempted" in probe.stderr  # the guard is live in child processes
    out = tmp_path / "out"
    p, _ = run_train(tiny_target, convs, out, 1, "--max_steps=2", env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    assert os.listdir(out) == ["r"]  # everything the run writes is under out_dir/run_name
    assert sorted(os.listdir(tmp_path)) == ["cache", "guard", "out"]  # and the tokenized cache where it was told


# -----------------------------------------------------------------------------
# the run directory: one run at a time, resume only from sound checkpoints, no run ending 0 with broken weights


def test_second_run_into_a_running_run_directory_is_refused(tiny_target, convs, tmp_path):
    first = run_train(tiny_target, convs, tmp_path, 1, "--max_steps=100000", wait=False)
    try:
        metrics = tmp_path / "r" / "metrics.jsonl"
        t0 = time.time()
        while not metrics.exists():
            assert first.poll() is None and time.time() - t0 < 120, first.communicate()[1][-3000:]
            time.sleep(0.1)
        p, _ = run_train(tiny_target, convs, tmp_path, 1, "--max_steps=3", "--resume=auto")
        assert p.returncode != 0
        assert f"is in use by another run (pid {first.pid} on " in p.stderr, p.stderr[-2000:]
    finally:
        first.kill()
        first.communicate()
    p, _ = run_train(tiny_target, convs, tmp_path, 1, "--max_steps=3", "--resume=auto")  # the holder is gone
    assert p.returncode == 0, p.stderr[-3000:]


@pytest.mark.runs("torn-checkpoints")
def test_resume_auto_passes_over_torn_and_incomplete_checkpoints(tiny_target, convs, runs):
    p, out, _ = runs["torn-checkpoints"]
    assert p.returncode == 0, p.stderr[-3000:]
    run = out / "r"
    state = run / "ckpt-0000003" / "train_state.pt"
    state.write_bytes(state.read_bytes()[: state.stat().st_size // 2])  # torn
    (run / "ckpt-0000002" / "model.safetensors").unlink()  # incomplete
    with pytest.raises(ValueError, match="train_state.pt is torn"):
        checkpoint.load_train_state(run / "ckpt-0000003")
    with pytest.raises(ValueError, match="ckpt-0000002 is incomplete: no model.safetensors"):
        checkpoint.load_train_state(run / "ckpt-0000002")
    p, _ = run_train(tiny_target, convs, out, 1, "--max_steps=4", "--resume=auto")
    assert p.returncode == 0, p.stderr[-3000:]
    assert "passing over" in p.stdout and "ckpt-0000003/train_state.pt is torn" in p.stdout
    assert "ckpt-0000002 is incomplete" in p.stdout and "resuming at step 1" in p.stdout


@pytest.mark.runs("nonfinite-weights")
def test_update_leaving_nonfinite_weights_stops_the_run(runs):
    """An update that leaves a weight non-finite (injected at step index 1: an overflow) cannot be skipped back: the
    run stops there, non-zero, naming the last good checkpoint, and writes no checkpoint of the broken weights."""
    p, out, _ = runs["nonfinite-weights"]
    assert p.returncode != 0
    assert "step 2 left non-finite weights" in p.stderr, p.stderr[-2000:]
    assert f"Last good checkpoint: {out / 'r' / 'ckpt-0000001'}" in p.stderr
    assert checkpoint.list_ckpts(out / "r") == ["ckpt-0000001"]


@pytest.mark.runs("nonfinite-last-steps")
def test_run_whose_last_steps_were_skipped_exits_nonzero(runs):
    p, out, _ = runs["nonfinite-last-steps"]
    assert p.returncode != 0
    assert "the last 2 steps were skipped as non-finite" in p.stderr
    assert f"Last good checkpoint: {out / 'r' / 'ckpt-0000003'}" in p.stderr


def test_target_that_needs_custom_code_is_refused_without_running_it(tmp_path, convs):
    target = tmp_path / "custom"
    target.mkdir()
    (target / "config.json").write_text(json.dumps({"model_type": "custom", "auto_map": {
        "AutoConfig": "custom.CustomConfig", "AutoModelForCausalLM": "custom.CustomModel"}}))
    (target / "custom.py").write_text(f"open({str(tmp_path / 'ran')!r}, 'w').write('ran')\n")
    p = subprocess.run([sys.executable, str(ROOT / "train.py"), f"--target={target}", f"--data={convs}",
                        f"--out_dir={tmp_path}"], input="y\ny\n", capture_output=True, text=True, timeout=120)
    assert p.returncode != 0 and "needs custom code (trust_remote_code)" in p.stderr, p.stderr[-2000:]
    assert not (tmp_path / "ran").exists()


@pytest.mark.parametrize("var,value", [("NNODES", "abc"), ("DFLASH_NGPU", "1 --nnodes=2"), ("NNODES", "-1")])
def test_launch_sh_refuses_non_integer_knobs(var, value, tmp_path):
    env = dict(os.environ, DFLASH_PYTHON=sys.executable, DFLASH_OUT=str(tmp_path), **{var: value})
    p = subprocess.run(["bash", str(ROOT / "launch.sh")], env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and f"{var}={value} must be a non-negative integer" in p.stderr, p.stderr
    assert os.listdir(tmp_path) == []


def test_init_drafter_with_shape_fields_is_refused():
    with pytest.raises(SystemExit, match="--init_drafter takes the drafter's shape from its config.json: drop "
                                         "--block_size, --drafter_layers"):
        train.parse_config(["--init_drafter=/x", "--block_size=8", "--drafter_layers=3", "--lr=1e-3"])


@pytest.mark.runs("mask-token-in-data")
def test_mask_token_the_data_uses_is_refused(convs, runs):
    """<|im_end|> closes every turn of the chat template: as the mask token the drafter could not tell a masked slot
    from the end of a turn. Refused after tokenizing, before the target is loaded, naming the token and a record."""
    p = runs["mask-token-in-data"].p
    assert p.returncode != 0
    assert "mask_token: '<|im_end|>' (id 2) occurs" in p.stderr and f"first at {convs}:1 " in p.stderr, p.stderr
    assert "target loaded" not in p.stdout


def test_memory_estimate_refuses_what_cannot_fit_and_names_the_largest_num_anchors(valid, target_meta):
    """On a stated device size between the estimates for 4 and 8 anchors: 8 is refused, the message names the
    largest num_anchors that fits, which the estimate confirms (it fits, one more does not)."""
    import ranks
    cfg = train.Config(**valid)
    tc, tok = target_meta
    dcfg = train.drafter_cfg(cfg, tc, tok)
    need = {n: sum(ranks.memory_estimate(cfg, dcfg, tc, 2, n)["drafter"].values()) for n in (4, 8)}
    device = (need[4] + need[8]) / 2 / 0.95
    with pytest.raises(ValueError, match=r"num_anchors=8: a drafter rank needs ~") as e:
        train.validate(train.Config(**valid), 3, tc, tok, device_gib=device)
    fit = int(str(e.value).rsplit("the largest num_anchors that fits is ", 1)[1].split()[0])
    assert 4 <= fit < 8
    def drafter(n):
        return sum(ranks.memory_estimate(cfg, dcfg, tc, 2, n)["drafter"].values())
    assert drafter(fit) <= 0.95 * device < drafter(fit + 1)
    train.validate(train.Config(**{**valid, "num_anchors": fit}), 3, tc, tok, device_gib=device)


def test_memory_estimate_counts_the_final_states(valid, target_meta):
    """--kd_loss (or a confidence head): the target shard holds all 6 layers, not 4 (ids up to 3);
    the drafter holds the final states (one more D-wide slice per context position, one gathered
    per block row) and, per LM-head chunk, the target's logits, softmax and the KD terms
    (b + 12 bytes per logit, b = 2 in bf16); the states in flight grow by a quarter (3 ids -> 4
    slices). Exact differences, written out here."""
    import ranks
    tc, tok = target_meta
    plain, kd = train.Config(**valid), train.Config(**valid, kd_loss="kl")
    dcfg = train.drafter_cfg(plain, tc, tok)
    a, b = (ranks.memory_estimate(c, dcfg, tc, 2) for c in (plain, kd))
    layer = sum(ranks._target_params(tc, 6)[0][4:]) * 2 / 2 / ranks.GiB  # bf16, over 2 ranks
    assert b["target"]["shard"] - a["target"]["shard"] == pytest.approx(layer)
    assert b["target"]["states in flight"] == pytest.approx(a["target"]["states in flight"] * 4 / 3)
    S, N, K, V, D = 64, 8, 4, 49152, 64
    extra = (S * D + N * K * D) * 2 / ranks.GiB
    assert b["drafter"]["target states"] - a["drafter"]["target states"] == pytest.approx(extra)
    chunk = min(64 * K, N * K) * V * (2 + 12) / ranks.GiB
    assert b["drafter"]["LM-head chunk"] - a["drafter"]["LM-head chunk"] == pytest.approx(chunk)


def test_memory_estimate_counts_a_domino_head(valid, target_meta):
    """A Domino head (GRU G = 16, MLP E = 8): its parameters in the drafter's state, and per block
    row (D + 5G + 2E) activations, per LM-head chunk two more bf16 logits and the base CE's fp32
    softmax (2 * 2 + 4 bytes a logit). Exact differences, written out here."""
    import ranks
    tc, tok = target_meta
    plain = train.Config(**valid)
    dom = train.Config(**valid, domino_gru_dim=16, domino_emb_dim=8)
    a, b = (ranks.memory_estimate(c, train.drafter_cfg(c, tc, tok), tc, 2) for c in (plain, dom))
    R, D, V, G, E = 8 * 4, 64, 49152, 16, 8
    assert a["drafter"]["Domino head"] == 0
    want = (R * (D + 5 * G + 2 * E) * 2 + R * V * 8) / ranks.GiB
    assert b["drafter"]["Domino head"] == pytest.approx(want)
    params = 3 * G * (D + G) + E * (D + G) + E * V
    assert b["drafter"]["state"] - a["drafter"]["state"] == pytest.approx(params * (2 * 2 + 4 + 12) / ranks.GiB)


def test_plan_prints_each_roles_memory_and_the_largest_num_anchors_per_length(valid, target_meta, capsys):
    """--plan, from the target's config alone: the memory lines of the start-up check, and per max_length the
    largest num_anchors that fits a GPU of the stated size, which the start-up check confirms (it passes, one more
    is refused). The size lies between the estimates for 4 and 8 anchors at the configured max_length."""
    import ranks
    cfg = train.Config(**valid)
    tc, tok = target_meta
    dcfg = train.drafter_cfg(cfg, tc, tok)
    gib = sum(max(ranks.memory_need(cfg, dcfg, tc, 3, n).values()) for n in (4, 8)) / 2 / 0.95
    train.main(train.Config(**{**valid, "plan": f"1x3:{gib}"}))
    out = capsys.readouterr().out
    assert "  target rank: " in out and "  drafter rank: " in out and "LM-head chunk" in out
    row = next(x for x in out.splitlines() if x.startswith(f"  max_length={cfg.max_length}: "))
    fit = int(row.split(": ")[1].split()[0])
    assert 4 <= fit < 8
    def check(n):
        return ranks.memory_check(train.Config(**{**valid, "num_anchors": n}), dcfg, tc, 3, gib)[1]
    assert check(fit) == [] and check(fit + 1)
    with pytest.raises(SystemExit, match="--plan needs the target's config.json"):
        train.main(train.Config(**{**valid, "plan": "1x3", "target": str(valid["out_dir"])}))
    # a plan that is not a shape, or not this config's ranks per node: a config error, before the
    # target is read
    for bad, why in (("abc", r"must be NODESxGPUS\[:GiB\]"),
                     ("1x8", r"target_ranks \(2\) \+ drafter_ranks \(1\)")):
        with pytest.raises(SystemExit, match=rf"invalid config:\n  plan='{bad}'.*{why}"):
            train.main(train.Config(**{**valid, "plan": bad, "target": "/nonexistent/model"}))


# -----------------------------------------------------------------------------
# the shared cache: two processes at once, and a crashed writer's leftovers


def tiny_gguf(path, V=512, D=64, F=128):
    """A stand-in for SmolLM2's GGUF that converts in seconds (the real one takes ~1 minute here): its tokenizer
    cut to the first V tokens and the merges among them, one random fp32 Llama layer of width D."""
    import gguf
    import numpy as np
    import target
    f = gguf.GGUFReader(target.smollm2_gguf()).fields
    tokens = f["tokenizer.ggml.tokens"].contents()[:V]
    merges = [m for m in f["tokenizer.ggml.merges"].contents()
              if all(p in tokens for p in m.split(" ")) and m.replace(" ", "") in tokens]
    new = {"llama.block_count": 1, "llama.embedding_length": D, "llama.feed_forward_length": F,
           "llama.attention.head_count": 4, "llama.attention.head_count_kv": 2, "llama.rope.dimension_count": 16,
           "llama.vocab_size": V, "general.file_type": 0, "tokenizer.ggml.tokens": tokens,
           "tokenizer.ggml.merges": merges, "tokenizer.ggml.token_type": f["tokenizer.ggml.token_type"].contents()[:V]}
    w = gguf.GGUFWriter(str(path), "llama")
    for k, field in f.items():
        if not k.startswith("GGUF.") and k != "general.architecture":
            t = field.types[0]
            sub = {"sub_type": field.types[-1]} if t == gguf.GGUFValueType.ARRAY else {}
            w.add_key_value(k, new.get(k, field.contents()), t, **sub)
    shapes = {"token_embd.weight": (V, D), "output_norm.weight": (D,)}
    shapes.update({f"blk.0.{n}.weight": s for n, s in (
        ("attn_norm", (D,)), ("ffn_norm", (D,)), ("attn_q", (D, D)), ("attn_k", (D // 2, D)),
        ("attn_v", (D // 2, D)), ("attn_output", (D, D)), ("ffn_gate", (F, D)), ("ffn_up", (F, D)),
        ("ffn_down", (D, F)))})
    rng = np.random.default_rng(0)
    for name, s in shapes.items():
        w.add_tensor(name, rng.normal(0, 0.02, s).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


RACER = """
import sys, time
from pathlib import Path
import target
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM  # convert_gguf's
gguf, cache, me = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
(cache.parent / f"ready-{me}").touch()  # imports done: wait for the other, then both convert at once
while len(list(cache.parent.glob("ready-*"))) < 2:
    time.sleep(0.01)
print("result", target.convert_gguf(gguf, cache / "tiny"), flush=True)
"""


def test_two_processes_converting_into_an_empty_cache_both_get_one_conversion(tmp_path):
    """Two real processes convert the same GGUF into an empty cache (target.convert_gguf, the demo's and the test
    fixtures' path), released together by a file barrier once their imports are done; the cache also holds a
    crashed writer's half-written folder (tiny.tmp<pid>, that pid gone). Both succeed with the same complete
    folder, one converts while the other waits and takes its result, and nothing else is left in the cache."""
    gguf = tiny_gguf(tmp_path / "tiny.Q4_1.gguf")
    cache = tmp_path / "cache"
    cache.mkdir()
    dead = subprocess.Popen(["true"])
    dead.wait()  # a pid that no longer runs
    (leftover := cache / f"tiny.tmp{dead.pid}").mkdir()
    (leftover / "model.safetensors").write_bytes(b"torn")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    racers = [subprocess.Popen([sys.executable, "-c", RACER, str(gguf), str(cache), str(i)], env=env, cwd=ROOT,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]
    outs = [p.communicate(timeout=300) for p in racers]
    for p, (out, err) in zip(racers, outs):
        assert p.returncode == 0, err[-3000:]
        assert f"result {cache / 'tiny'}" in out
    said = "".join(out for out, _ in outs)
    assert said.count("converting ") == 1, said  # one conversion; the other process took its result
    assert f"removing {leftover}, left by a writer that died (pid {dead.pid})" in said, said
    assert sorted(os.listdir(cache)) == ["tiny"]  # the dead writer's folder is gone, no .tmp, no lock file
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(os.listdir(cache / "tiny"))
    import target
    assert target.load_tokenizer(cache / "tiny").eos_token == "<|im_end|>"


# -----------------------------------------------------------------------------
# preemption: SIGTERM to the job, or to one rank, stops every rank after the same step, with a checkpoint there

@pytest.fixture
def uninterrupted(runs):
    """The run a stopped and resumed one must equal: 1 target + 2 drafter ranks, 16 steps, fp32."""
    p, out, _ = runs["uninterrupted"]
    assert p.returncode == 0, p.stderr[-3000:]
    return out / "r" / "ckpt-0000016"


def _sigterm_at_step(tiny_target, convs, out, k, who, topology):
    """Start the PREEMPT job, SIGTERM `who` ("launcher" or a rank) once step k is logged -> (returncode, stdout,
    stderr, seconds from the signal to the launcher's exit)."""
    p = run_train(tiny_target, convs, out, 3, *PREEMPT, *topology, wait=False)
    try:
        metrics, t0 = out / "r" / "metrics.jsonl", time.time()
        while not (metrics.exists() and len(metrics.read_text().splitlines()) >= k):
            assert p.poll() is None, p.communicate()[1][-3000:]
            assert time.time() - t0 < 120, "the job never reached the step"
            time.sleep(0.02)
        pid = p.pid if who == "launcher" else rank_pid(str(out), who)
        os.kill(pid, signal.SIGTERM)
        t_signal = time.time()
        stdout, stderr = p.communicate(timeout=120)
        grace = time.time() - t_signal
        assert procs_with(str(out)) == [], "orphan processes"
        return p.returncode, stdout, stderr, grace
    finally:  # never leave a failed test's job running
        for q in procs_with(str(out)):
            os.kill(q, signal.SIGKILL)


def _stop_step(stdout, stderr, ranks=(0, 1, 2)):
    """The step every rank says it stopped after (all the same)."""
    import re
    said = {int(r): int(s) for r, s in re.findall(r"rank (\d) \(\w+\): stopped after step (\d+)", stdout)}
    assert sorted(said) == list(ranks), stdout[-3000:] + stderr[-3000:]
    assert len(set(said.values())) == 1, said
    return said[1]


def _same_state(a, b):
    """Two checkpoints hold the same drafter weights (bytes), fp32 masters and AdamW state, exactly."""
    assert (Path(a) / "model.safetensors").read_bytes() == (Path(b) / "model.safetensors").read_bytes()
    a, b = checkpoint.load_train_state(a), checkpoint.load_train_state(b)
    assert a["step"] == b["step"]
    assert all(torch.equal(x, y) for x, y in zip(a["masters"], b["masters"], strict=True))
    sa, sb = a["optimizer"]["state"], b["optimizer"]["state"]
    assert sorted(sa) == sorted(sb) and len(sa) == len(a["masters"])
    for i in sa:
        assert sorted(sa[i]) == sorted(sb[i]) and all(torch.equal(sa[i][k], sb[i][k]) for k in sa[i]), i
    assert a["optimizer"]["param_groups"] == b["optimizer"]["param_groups"]


@pytest.mark.runs("uninterrupted")
def test_sigterm_to_the_launcher_checkpoints_at_the_next_step_and_resume_is_exact(tiny_target, convs, tmp_path,
                                                                                 uninterrupted):
    """kill -TERM of torchrun once step 3 of 16 is logged: it forwards the signal to every rank; every rank stops
    after the same step S (the next boundary), the leader writes ckpt-S there, all exit 0 within the grace period
    (torchrun itself reports the signal it got), and --resume=auto then ends with the weights, fp32 masters and
    AdamW state of the uninterrupted run, exactly."""
    out = tmp_path / "stopped"
    code, stdout, stderr, grace = _sigterm_at_step(tiny_target, convs, out, 3, "launcher", ONE_TWO)
    S = _stop_step(stdout, stderr)
    print(f"\nSIGTERM to the launcher after step 3: every rank stopped after step {S}; the launcher exited "
          f"{grace:.1f} s after the signal")
    assert 3 < S < 16 and grace < 25, (S, grace)  # ranks.stop_grace(): torchrun's shutdown timeout, 30 s, less 5
    assert code != 0 and "SignalException" in stderr and "FAILED" not in stdout + stderr, stderr[-3000:]
    assert f"rank 1 (drafter): stopped after step {S} for SIGTERM " in stdout
    assert f"newest checkpoint {out / 'r' / f'ckpt-{S:07d}'}: continue with --resume=auto" in stdout
    run = out / "r"
    assert checkpoint.list_ckpts(run) == [f"ckpt-{S:07d}"] and not (run / "done.json").exists()
    assert checkpoint.load_train_state(run / f"ckpt-{S:07d}")["step"] == S
    assert [r["step"] for r in records(out)] == list(range(1, S + 1))

    p, _ = run_train(tiny_target, convs, out, 3, *PREEMPT, *ONE_TWO, "--resume=auto")
    assert p.returncode == 0, p.stderr[-3000:]
    assert f"resuming at step {S}" in p.stdout and "WARNING resume" not in p.stdout
    _same_state(run / "ckpt-0000016", uninterrupted)


@pytest.mark.parametrize("rank,role,topology", [(2, "drafter", ONE_TWO), (0, "target", SPLIT)])
def test_sigterm_to_one_rank_stops_every_rank_after_the_same_step(tiny_target, convs, tmp_path, rank, role, topology):
    """kill -TERM of one rank once step 3 is logged. Drafter rank 2 of 1 target + 2 drafters (not the leader: its
    request reaches rank 1 through the statistics' all-reduce, the target rank through the store), or target rank 0
    of 2 FSDP targets + 1 drafter (its request rides its next header to the drafter; rank 1 learns the stop from rank
    0 or the store, before the same forward). Every rank stops after the same step S, ckpt-S is written, the job
    exits 0 within the grace period."""
    out = tmp_path / "stopped"
    code, stdout, stderr, grace = _sigterm_at_step(tiny_target, convs, out, 3, rank, topology)
    S = _stop_step(stdout, stderr)
    print(f"\nSIGTERM to rank {rank} ({role}) after step 3: every rank stopped after step {S}; the job exited "
          f"{grace:.1f} s after the signal")
    assert code == 0 and 3 < S < 16 and grace < 25, (code, S, grace, stderr[-3000:])
    assert f"rank {rank} ({role}): stopped after step {S} for SIGTERM " in stdout
    if role == "target":
        assert "for a stop asked by rank 0 (target)" in stdout
    assert checkpoint.list_ckpts(out / "r") == [f"ckpt-{S:07d}"]
