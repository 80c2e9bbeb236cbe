"""Shared fixtures: a tiny random Qwen3 target with the SmolLM2 tokenizer, a small conversation file, and a
helper that runs train.py (one process, or under torchrun) the way a user would."""

import json
import os
import socket
import subprocess
import sys
import time
from collections import namedtuple
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

import data
import target

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def tiny_target(tmp_path_factory):
    """Random 6-layer Qwen3 (hidden 64, untied head) saved as an HF folder with the SmolLM2 tokenizer."""
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM
    smol = data.default_cache_dir() / "smollm2-135m-instruct"  # only its tokenizer is used
    if not (smol / "tokenizer.json").exists():
        smol = target.convert_gguf(target.smollm2_gguf(), smol)
    out = tmp_path_factory.mktemp("tiny_target")
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=2048,
                      tie_word_embeddings=False, rope_theta=10000.0)
    model = Qwen3ForCausalLM(cfg)
    with torch.no_grad():  # larger weights than the 0.02 default so layers differ visibly
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.2)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(smol).save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def convs(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "train.jsonl"
    words = "alpha beta gamma delta echo fox golf hotel india juliet kilo lima mike".split()
    with open(path, "w") as f:
        for i in range(24):
            reply = " ".join(words[(i + j) % len(words)] for j in range(8 + 3 * (i % 5)))
            f.write(json.dumps({"messages": [{"role": "user", "content": f"Say {i} words please"},
                                             {"role": "assistant", "content": reply}]}) + "\n")
    return path


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_train(tiny_target, convs, out, nproc, *args, env=None, timeout=300, torchrun_args=(), wait=True,
              fail=None):
    """train.py on the tiny target, as `python train.py` (nproc 1) or under torchrun. fail="RANK:STEP[:HOW]" runs
    it through tests/faults.py, which injects that fault (see there)."""
    base = [f"--target={tiny_target}", f"--data={convs}", f"--out_dir={out}", "--run_name=r", "--device=cpu",
            "--dtype=float32", "--mask_token=<empty_output>", "--drafter_layers=2", "--target_features=3",
            "--sliding_layers=1", "--sliding_window=16", "--block_size=4", "--num_anchors=8", "--max_length=64",
            "--pad_multiple=16", "--log_every=1", "--warmup_ratio=0", "--lr=1e-3", "--batch_size=1"]
    script = [str(ROOT / "train.py")] if fail is None else [str(ROOT / "tests" / "faults.py"), fail]
    if nproc == 1:
        cmd = [sys.executable, *script]
    else:
        rdzv = list(torchrun_args) or [f"--master_port={free_port()}"]
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", *rdzv,
               "--max_restarts=0", *script]
    e = dict(os.environ, OMP_NUM_THREADS="1", **(env or {}))
    if not wait:  # caller collects: p.communicate()
        return subprocess.Popen(cmd + base + list(args), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env=e, cwd=ROOT)
    t0 = time.time()
    p = subprocess.run(cmd + base + list(args), capture_output=True, text=True, timeout=timeout, env=e, cwd=ROOT)
    return p, time.time() - t0


def pytest_configure(config):
    config.addinivalue_line("markers", "runs(*names): the entries of its module's RUNS table that a test reads "
                                       "(through the `runs` fixture)")


def job(nproc, *args, **kwargs):
    """One entry of a module's RUNS table: run_train's arguments after `out` (nproc, the flags, fail=/env=/...)."""
    return nproc, args, kwargs


Run = namedtuple("Run", "p out secs")  # a finished run: its CompletedProcess, its out_dir, its wall seconds


class BackgroundRuns:
    """Training runs going on in the background, by name; runs[name] waits for that one -> Run."""

    def __init__(self, futures):
        self.futures = futures

    def __getitem__(self, name):
        if name not in self.futures:
            raise KeyError(f"{name!r}: add it to the test's @pytest.mark.runs(...)")
        return self.futures[name].result()


@pytest.fixture(scope="module", autouse=True)
def runs(request, tmp_path_factory):
    """The training runs of a module's RUNS table that its selected tests name (@pytest.mark.runs), started together
    when the module's first test starts, two at a time, in the background: a tiny run is mostly process start-up on
    one or two cores, so this keeps both cores of a 2-core machine busy while the module's other tests go on, instead
    of one run after another. A run's test reads it as runs[name] (waiting for it); a module without RUNS gets None."""
    table = getattr(request.module, "RUNS", None)
    wanted = {name for item in request.session.items if item.module is request.module
              for mark in item.iter_markers("runs") for name in mark.args}
    if not table or not wanted:
        yield None
        return
    assert wanted <= set(table), wanted - set(table)
    tiny, conversations = request.getfixturevalue("tiny_target"), request.getfixturevalue("convs")
    base = tmp_path_factory.mktemp("runs")

    def one(name, nproc, args, kwargs):
        p, secs = run_train(tiny, conversations, base / name, nproc, *args, **kwargs)
        return Run(p, base / name, secs)
    pool = ThreadPoolExecutor(2)
    futures = {name: pool.submit(one, name, *table[name]) for name in table if name in wanted}  # in table order
    yield BackgroundRuns(futures)
    pool.shutdown(wait=True, cancel_futures=True)


SPLIT_REFERENCE = ("--max_steps=3", "--grad_accum=4", "--target_ranks=2", "--drafter_ranks=1")


@pytest.fixture(scope="session")
def split_reference(tiny_target, convs, tmp_path_factory):
    """2 target + 1 drafter ranks, 4 micro-batches a step, 3 steps -> Run: the one-node run both the topology test
    (test_train) and the two-node test (test_multinode) compare against; one launch serves both."""
    out = tmp_path_factory.mktemp("split_reference")
    p, secs = run_train(tiny_target, convs, out, 3, *SPLIT_REFERENCE)
    return Run(p, out, secs)
