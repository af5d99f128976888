#!/usr/bin/env bash
# How far more chat training data moves a drafter on MT-Bench (issue 6; docs/training.md, "More chat data").
# The shipped treespark drafter is fine-tuned (dspark loss) on MT-Bench's 48 training prompts alone and
# with self-generated chat prompts (`treespark self-prompts`), then scored offline on MT-Bench's held-out
# prompts (`eval-drafter`: chain τ, treespark tree τ at budget 16, α per depth). Prints a table and
# writes $DATA/probe.json. Stages resume like train_drafters.sh's; ≈ 50 min on the 2-core CPU.
#   experiments/chat_data_probe.sh
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PY:-.venv/bin/python}
DATA=${DATA:-experiments/data/chat-probe}
NEW=${NEW:-128}          # new tokens per rollout, as train_drafters.sh
START=treespark_jax/drafters/smollm2-135m/treespark
# name:rollout dirs (comma-separated, under $DATA):steps
RUNS="mtbench_200:mtbench-train:200 self256_200:mtbench-train,self256:200 self256_600:mtbench-train,self256:600"
RUNS="$RUNS self1024_600:mtbench-train,self256,self768:600 self1024_1500:mtbench-train,self256,self768:1500"
T="$PY -m treespark_jax.cli"
mkdir -p "$DATA"

for split in train eval; do
  $T rollout --prompts mtbench --split $split --max-new-tokens "$NEW" --batch-size 16 --out "$DATA/rollouts-mtbench-$split"
done
# 1,024 prompts (seed 0), rolled out as the first 256 and the other 768, so both data sizes share them
[ -f "$DATA/self1024.jsonl" ] || $T self-prompts --limit 1024 --seed 0 --json-out "$DATA/self1024.jsonl"
[ -f "$DATA/self256.jsonl" ] || head -n 256 "$DATA/self1024.jsonl" > "$DATA/self256.jsonl"
[ -f "$DATA/self768.jsonl" ] || tail -n +257 "$DATA/self1024.jsonl" > "$DATA/self768.jsonl"
for part in self256 self768; do
  $T rollout --prompts "$DATA/$part.jsonl" --max-new-tokens "$NEW" --batch-size 16 --out "$DATA/rollouts-$part"
done

evaluate() {  # drafter, json
  [ -f "$2" ] || $T eval-drafter --drafter "$1" --rollouts "$DATA/rollouts-mtbench-eval" --method treespark \
    --budget 16 --json-out "$2"
}
evaluate "$START" "$DATA/eval-shipped.json"
for run in $RUNS; do
  IFS=: read -r name sets steps <<< "$run"
  dirs=$(for s in ${sets//,/ }; do echo "$DATA/rollouts-$s"; done)
  $T train --rollouts $dirs --loss dspark --init "$START" --steps "$steps" --batch-size 4 --seq-len 384 --anchors 16 \
    --save-every 100 --log-every 20 --quiet --out "$DATA/$name"
  evaluate "$DATA/$name/drafter" "$DATA/eval-$name.json"
done

$PY - "$DATA" shipped ${RUNS} <<'PY'
import json, sys
data, names = sys.argv[1], [r.split(":")[0] for r in sys.argv[2:]]
rows = []
for name in names:
    r = json.load(open(f"{data}/eval-{name}.json"))
    rows.append({"run": name, "chain_tau": r["chain_tau"], "tree_tau": r["tree_tau"], "alpha": r["alpha"]})
print(f"{'run':<15}{'chain τ':>9}{'tree τ':>9}  α per depth")
for r in rows:
    print(f"{r['run']:<15}{r['chain_tau']:>9.3f}{r['tree_tau']:>9.3f}  " + " ".join(f"{a:.2f}" for a in r["alpha"]))
json.dump(rows, open(f"{data}/probe.json", "w"), indent=2)
PY
