#!/usr/bin/env bash
# Drafter variants at equal steps (issue 22, deliverables 3 and 4): dspark drafters trained the same steps on
# the same rollouts with different `treespark train` flags, each evaluated offline on the held-out split
# (expected chain τ, greedy tree τ of pctree at BUDGET), and with COST=1 each drafter's round at the full BUDGET timed by
# `treespark profile` (draft ms; what a deeper drafter costs at inference).
#   experiments/drafter_probe.sh                                   (warm start: VARIANTS below)
#   VARIANTS="layers1:; layers2:--drafter-layers 2" experiments/drafter_probe.sh
# VARIANTS are separated by semicolons; a variant is NAME:FLAGS, FLAGS `train` flags as typed (empty for the
# defaults), e.g. "w:--init-layers 1,14 --loss-weights chain_ce=0.2,chain_l1=0.8".
# Without TRAIN/EVAL_ROLLOUTS it makes its own rollouts of SET (LIMIT training and EVAL held-out prompts).
# Outputs go to $DATA (gitignored); every stage resumes when re-run (rollouts skip finished prompts,
# training resumes from its last checkpoint, finished evaluations and profiles are kept).
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PY:-.venv/bin/python}
DATA=${DATA:-experiments/data/probe}
SET=${SET:-gsm8k}
LIMIT=${LIMIT:-64}             # training prompts
EVAL=${EVAL:-32}               # held-out prompts
NEW=${NEW:-128}                # new tokens per rollout
TRAIN_ROLLOUTS=${TRAIN_ROLLOUTS:-$DATA/$SET-train}  # space-separated rollout directories to train on
EVAL_ROLLOUTS=${EVAL_ROLLOUTS:-$DATA/$SET-eval}
STEPS=${STEPS:-200}            # optimizer steps per drafter
SEED=${SEED:-0}
VARIANTS=${VARIANTS:-"random:; layer1:--init-layers 1; layer14:--init-layers 14; layer27:--init-layers 27"}
BUDGET=${BUDGET:-16}
DRAFT_VOCAB=${DRAFT_VOCAB:-8192}
COST=${COST:-0}                # 1: time each drafter's round with `treespark profile` (context 256)
T="$PY -m treespark_jax.cli"

if [ "$TRAIN_ROLLOUTS" = "$DATA/$SET-train" ]; then
  $T rollout --prompts "$SET" --split train --limit "$LIMIT" --max-new-tokens "$NEW" --batch-size 16 \
    --out "$DATA/$SET-train"
fi
if [ "$EVAL_ROLLOUTS" = "$DATA/$SET-eval" ]; then
  $T rollout --prompts "$SET" --split eval --limit "$EVAL" --max-new-tokens "$NEW" --batch-size 16 \
    --out "$DATA/$SET-eval"
fi
names=()
IFS=';' read -ra variants <<< "$VARIANTS"
for variant in "${variants[@]}"; do
  variant=${variant#"${variant%%[![:space:]]*}"}  # without the spaces before it
  name=${variant%%:*}
  read -ra flags <<< "${variant#*:}"
  names+=("$name")
  out="$DATA/dspark-$name"
  # shellcheck disable=SC2086  # the rollout directories split on spaces
  $T train --rollouts $TRAIN_ROLLOUTS --loss dspark --draft-vocab "$DRAFT_VOCAB" "${flags[@]}" --steps "$STEPS" \
    --seed "$SEED" --batch-size 4 --seq-len 384 --anchors 16 --save-every 50 --log-every 10 --quiet --out "$out"
  # shellcheck disable=SC2086
  [ -f "$out/eval.json" ] || $T eval-drafter --drafter "$out/drafter" --rollouts $EVAL_ROLLOUTS --method pctree \
    --budget "$BUDGET" --json-out "$out/eval.json"
  if [ "$COST" = 1 ] && [ ! -f "$out/profile.json" ]; then
    $T profile --budget "$BUDGET" --contexts 256 --repeats 15 --drafter "$out/drafter" --json-out "$out/profile.json"
  fi
done
$PY - "$DATA" "${names[@]}" <<'PY'
import json, pathlib, sys
data, names = pathlib.Path(sys.argv[1]), sys.argv[2:]
print(f"{'variant':<10} {'chain tau':>9} {'tree tau':>9} {'draft ms':>9}  alpha per depth")
for name in names:
    r = json.loads((data / f"dspark-{name}" / "eval.json").read_text())
    profile = data / f"dspark-{name}" / "profile.json"
    draft = f"{json.loads(profile.read_text())['measured_draft_ms'][-1]:9.2f}" if profile.exists() else f"{'-':>9}"
    print(f"{name:<10} {r['chain_tau']:9.3f} {r['tree_tau']:9.3f} {draft}  " + " ".join(f"{a:.2f}" for a in r["alpha"]))
PY
