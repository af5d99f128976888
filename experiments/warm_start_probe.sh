#!/usr/bin/env bash
# Warm start from the target (issue 22, deliverable 3): dspark drafters trained the same steps on the
# same rollouts, from random weights and from copies of target decoder layers (`train --init-layers L`),
# each evaluated offline on the held-out split (expected chain τ, greedy tree τ of pctree at BUDGET).
#   experiments/warm_start_probe.sh            (settings from the environment, defaults below)
# Outputs go to $DATA (gitignored); every stage resumes when re-run (rollouts skip finished prompts,
# training resumes from its last checkpoint, finished evaluations are kept).
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PY:-.venv/bin/python}
DATA=${DATA:-experiments/data/warmstart}
SET=${SET:-gsm8k}
LIMIT=${LIMIT:-64}             # training prompts
EVAL=${EVAL:-32}               # held-out prompts
NEW=${NEW:-128}                # new tokens per rollout
STEPS=${STEPS:-200}            # optimizer steps per drafter
LAYERS=${LAYERS:-"random 1 14 27"}  # "random", or the target layer copied into the drafter's one layer
BUDGET=${BUDGET:-16}
DRAFT_VOCAB=${DRAFT_VOCAB:-8192}
T="$PY -m treespark_jax.cli"

$T rollout --prompts "$SET" --split train --limit "$LIMIT" --max-new-tokens "$NEW" --batch-size 16 \
  --out "$DATA/$SET-train"
$T rollout --prompts "$SET" --split eval --limit "$EVAL" --max-new-tokens "$NEW" --batch-size 16 \
  --out "$DATA/$SET-eval"
for init in $LAYERS; do
  out="$DATA/dspark-$init"
  args=()
  [ "$init" = random ] || args=(--init-layers "$init")
  $T train --rollouts "$DATA/$SET-train" --loss dspark --draft-vocab "$DRAFT_VOCAB" "${args[@]}" --steps "$STEPS" \
    --batch-size 4 --seq-len 384 --anchors 16 --save-every 50 --log-every 10 --quiet --out "$out"
  [ -f "$out/eval.json" ] || $T eval-drafter --drafter "$out/drafter" --rollouts "$DATA/$SET-eval" --method pctree \
    --budget "$BUDGET" --json-out "$out/eval.json"
done
$PY - "$DATA" $LAYERS <<'PY'
import json, sys
data, inits = sys.argv[1], sys.argv[2:]
print(f"{'init':<8} {'chain tau':>9} {'tree tau':>9}  alpha per depth")
for init in inits:
    r = json.load(open(f"{data}/dspark-{init}/eval.json"))
    print(f"{init:<8} {r['chain_tau']:9.3f} {r['tree_tau']:9.3f}  " + " ".join(f"{a:.2f}" for a in r["alpha"]))
PY
