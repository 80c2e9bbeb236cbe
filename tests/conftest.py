"""Shared fixtures: a tiny random Qwen3 target with the SmolLM2 tokenizer, a small conversation file, and a
helper that runs train.py (one process, or under torchrun) the way a user would."""

import json
import os
import socket
import subprocess
import sys
import time
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


def run_trains(tiny_target, convs, *jobs, timeout=300):
    """Independent one-process runs of one test at the same time, each job (out, 1, *args) as run_train takes
    them -> their CompletedProcesses in job order. Start-up (imports, loading) is most of a tiny run, and one
    process keeps one core busy: side by side, they use both cores of a 2-core machine. (torchrun jobs gain
    nothing: their ranks already fill both cores, and two jobs at once took longer than one after the other.)"""
    with ThreadPoolExecutor(len(jobs)) as pool:
        runs = [pool.submit(run_train, tiny_target, convs, *job, timeout=timeout) for job in jobs]
        return [r.result()[0] for r in runs]
