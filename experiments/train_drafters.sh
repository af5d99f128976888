#!/usr/bin/env bash
# Trained drafters for the smollm2-135m preset (DESIGN.md §1.4, issue 6), stage by stage:
#   1. rollouts of the target on the training prompts (HumanEval, GSM8K, MT-Bench train splits, and
#      with SELF > 0 that many chat prompts the target writes itself: `treespark self-prompts`; with
#      SELF_CODE > 0 that many code prompts it writes after the HumanEval wrapper, `--user-prefix`, and with
#      SELF_MATH > 0 that many word problems it writes after the GSM8K one; with SAMPLES > 0 that many sampled
#      answers to each training prompt of SAMPLE_SETS)
#   2. a dflash drafter and a dspark drafter on the same data for the same steps, each trained on its
#      draft vocabulary (the DRAFT_VOCAB most frequent tokens of the training rollouts), drawing math, code and
#      chat records a third each (MIX, which every training stage follows)
#   3. on-policy rollouts with the dspark drafter (every verified tree logged): greedy ones replayed from the
#      plain rollouts of stage 1 (REPLAY=1, `treespark replay`), or decoded speculatively (REPLAY=0)
#   4. a treespark drafter warm-started from the dspark one (and its draft vocabulary), trained on the
#      on-policy trees of the $ONPOLICY sets mixed (TREE_SHARE) with the plain rollouts of stage 1, whose
#      tree slots stay empty
#   5. offline evaluation of all three on the held-out (eval) split
#   (ablate: treespark loss-term ablation for experiments/RESULTS.md; iterate: the iterated on-policy loop with
#    its no-tree-terms controls, two seeds; finetune: a longer fine-tune of a trained drafter; none of the three is
#    in the default stages)
#   6. export: the three drafters in bfloat16 into treespark_jax/drafters/smollm2-135m/ (shipped with
#      the package)
# Every stage resumes where it stopped when the script is run again (rollouts skip finished
# prompts, training resumes from its last checkpoint), so it can be run in pieces:
#   experiments/train_drafters.sh [STAGE...]      e.g. `experiments/train_drafters.sh rollouts dspark`
# Settings come from the environment (defaults below); outputs go to $DATA (gitignored).
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PY:-.venv/bin/python}
DATA=${DATA:-experiments/data}
LIMIT=${LIMIT:-}               # training prompts per set (empty: all; GSM8K has 1,287, HumanEval 132, MT-Bench 48)
NEW=${NEW:-256}                # new tokens per rollout
RBATCH=${RBATCH:-32}           # prompts per rollout generation batch (and shard)
STEPS=${STEPS:-6000}           # optimizer steps per drafter
BATCH=${BATCH:-4}              # sequences per step
SEQ=${SEQ:-384}                # tokens per sequence (prompt + response, longer ones are cut)
ANCHORS=${ANCHORS:-16}         # gold-chain blocks per sequence
BUDGET=${BUDGET:-16}           # tree budget of the on-policy rollouts
SETS="gsm8k humaneval mtbench"
ONPOLICY=${ONPOLICY:-"gsm8k humaneval mtbench"}  # sets whose on-policy trees are logged (the others stay plain)
REPLAY=${REPLAY:-1}             # onpolicy stage: 1 replays greedy trees from the plain rollouts (`treespark replay`,
                               # minutes), 0 decodes speculatively with the target (hours on this CPU)
TREE_SHARE=${TREE_SHARE:-0.5}  # treespark stages: share of every batch's sequences drawn from on-policy records
SELF=${SELF:-4000}             # self-generated chat prompts (DESIGN.md §1.4)
SELF_CODE=${SELF_CODE:-1000}   # self-generated code prompts (HumanEval has 132 training prompts; code needs more)
# self-generated math word problems: GSM8K's 1,287 training prompts are fit far past its eval split (SAMPLES,
# below); the target's answers to questions it wrote itself are more contexts of its own math answers
SELF_MATH=${SELF_MATH:-0}
# SAMPLES sampled rollouts (temperature SAMPLE_TEMP, seeds 1..SAMPLES) of every training prompt of SAMPLE_SETS: more
# contexts of the target's own answers where a set's train split is small. GSM8K's 1,287 are fit far past its eval
# split (treespark 20×: replayed τ 3.38 on 32 train rollouts, 2.83 on the eval ones; dspark 2.66 / 2.45).
SAMPLES=${SAMPLES:-0}
SAMPLE_SETS=${SAMPLE_SETS:-"gsm8k"}
SAMPLE_TEMP=${SAMPLE_TEMP:-0.7}
DRAFT_VOCAB=${DRAFT_VOCAB:-8192}  # draft vocabulary the drafters train on and draft from (most frequent training tokens)
# the dspark drafter the on-policy, treespark and ablate stages start from; on a machine without this DATA
# (its rollouts regenerated, the dspark stage not rerun) the shipped one: treespark_jax/drafters/smollm2-135m/dspark
DSPARK=${DSPARK:-$DATA/dspark/drafter}
T="$PY -m treespark_jax.cli"
TRAIN_ARGS="--steps $STEPS --batch-size $BATCH --seq-len $SEQ --anchors $ANCHORS --save-every 100 --log-every 10"
CONTEXT_VOCAB=${CONTEXT_VOCAB:-64}  # context slots beside the draft vocabulary (--context-vocab; docs/training.md)
POINTER_RANK=${POINTER_RANK:-32}   # rank of the slots' pointer score (--pointer-rank; 0 = none)
# loss weights every dspark and treespark run adds (--loss-weights; the KL term is what trains the slots' pointer)
CHAIN_WEIGHTS=${CHAIN_WEIGHTS:-chain_kl=0.3}
weights() {  # --loss-weights of CHAIN_WEIGHTS and the given ones (nothing when both are empty)
  local all
  all=$(printf '%s\n' "$CHAIN_WEIGHTS" "$@" | { grep -v '^$' || true; } | paste -sd, -)
  if [ -n "$all" ]; then echo "--loss-weights $all"; fi
}
# the treespark stage and the ablations keep their --init drafter's draft vocabulary and context slots
VOCAB_ARGS="--draft-vocab $DRAFT_VOCAB --context-vocab $CONTEXT_VOCAB --pointer-rank $POINTER_RANK"

plain() { for s in $SETS; do echo "$DATA/rollouts-$s-$1"; done; }
self_rollouts() {
  if [ "$SELF" -gt 0 ]; then echo "$DATA/rollouts-self$SELF-train"; fi
  if [ "$SELF_CODE" -gt 0 ]; then echo "$DATA/rollouts-selfcode$SELF_CODE-train"; fi
  if [ "$SELF_MATH" -gt 0 ]; then echo "$DATA/rollouts-selfmath$SELF_MATH-train"; fi
}
sampled_dir() { echo "$DATA/rollouts-$1-train-t$SAMPLE_TEMP-s$2"; }  # set $1's sampled answers of seed $2
sampled() {
  for s in $SAMPLE_SETS; do for i in $(seq 1 "$SAMPLES"); do sampled_dir "$s" "$i"; done; done
}
train_plain() { plain train; self_rollouts; sampled; }  # the sets' train splits, the self-generated prompts, samples
# How a training run draws its records. `records`: every record alike (with --tree-share for the treespark stages:
# that share of every batch from the directories with logged trees), so a domain weighs what its records do (4,000
# chat prompts made GSM8K 21 % and code 10 % of the 20× run's tokens, docs/training.md). `domains`: the plain
# records' draws go a third each to math (GSM8K and its samples), code (HumanEval and the self-code prompts) and
# chat (MT-Bench and the self-generated prompts), records alike within a domain; the records with logged trees
# keep TREE_SHARE of the draws, records alike among them (both by --mix-weights).
MIX=${MIX:-domains}
domain_of() {  # the domain of plain rollout directory $1, by its name (one with trees: the manifest says so)
  case "$(basename "$1")" in
    rollouts-gsm8k-* | rollouts-selfmath*) echo math ;;
    rollouts-humaneval-* | rollouts-selfcode*) echo code ;;
    *) echo chat ;;
  esac
}
mix() {  # --rollouts $2... and how they are drawn (MIX); $1 = the share of directories with logged trees (0: none)
  local share=$1
  shift
  echo --rollouts "$@"
  if [ "$MIX" = records ]; then
    if [ "$share" != 0 ]; then echo --tree-share "$share"; fi
    return 0
  fi
  [ "$MIX" = domains ] || { echo "MIX=$MIX must be records or domains" >&2; return 1; }
  for d in "$@"; do echo "$(domain_of "$d") $d"; done | $PY -c '
import sys
from collections import Counter
from treespark_jax.rollouts.store import read_manifest

share = float(sys.argv[1])
rows = [line.split() for line in sys.stdin]
manifests = {d: read_manifest(d) for _, d in rows}
group = {d: "trees" if manifests[d]["trees"] else domain for domain, d in rows}
records, total = {d: m["records"] for d, m in manifests.items()}, Counter()
for d, g in group.items():
    total[g] += records[d]
domains = len(total) - ("trees" in total)
of = {g: share if g == "trees" else (1 - share) / domains for g in total}
print("--mix-weights " + ",".join(f"{of[group[d]] * records[d] / total[group[d]]:.6g}" for _, d in rows))' "$share"
}

stage_rollouts() {
  for s in $SETS; do
    $T rollout --prompts "$s" --split train ${LIMIT:+--limit "$LIMIT"} --max-new-tokens "$NEW" --batch-size "$RBATCH" \
      --out "$DATA/rollouts-$s-train"
    $T rollout --prompts "$s" --split eval --max-new-tokens "$NEW" --batch-size "$RBATCH" --out "$DATA/rollouts-$s-eval"
  done
  if [ "$SELF" -gt 0 ]; then
    # self-prompts resumes from its progress file, and the rollouts from their shards
    [ -f "$DATA/self-prompts-$SELF.jsonl" ] || $T self-prompts --limit "$SELF" --seed 0 --batch-size "$RBATCH" \
      --json-out "$DATA/self-prompts-$SELF.jsonl"
    $T rollout --prompts "$DATA/self-prompts-$SELF.jsonl" --max-new-tokens "$NEW" --batch-size "$RBATCH" \
      --out "$DATA/rollouts-self$SELF-train"
  fi
  stage_selfcode
  stage_selfmath
  stage_sampled
}
stage_sampled() {  # SAMPLES sampled answers to each training prompt of SAMPLE_SETS (none by default)
  for s in $SAMPLE_SETS; do
    for i in $(seq 1 "$SAMPLES"); do
      $T rollout --prompts "$s" --split train ${LIMIT:+--limit "$LIMIT"} --max-new-tokens "$NEW" --batch-size "$RBATCH" \
        --temperature "$SAMPLE_TEMP" --seed "$i" --out "$(sampled_dir "$s" "$i")"
    done
  done
}
# $3 prompts the target writes after prompt set $2's wrapper and the start $4 ($5...: more `self-prompts` flags),
# the check of them against the set's eval split, and their rollouts; $1 names the files (self-$1-$3.jsonl)
self_set() {
  local kind=$1 set=$2 n=$3 prefix
  [ "$n" -gt 0 ] || return 0
  # (printed with an "x" after it, then cut: $(...) would strip the wrapper's trailing newlines)
  prefix="$($PY -c 'import sys; from treespark_jax.prompts.sets import WRAPPERS
print(WRAPPERS[sys.argv[1]].partition("{")[0] + sys.argv[2], end="x")' "$set" "$4")"
  prefix=${prefix%x}
  shift 4
  [ -f "$DATA/self-$kind-$n.jsonl" ] || $T self-prompts --limit "$n" --seed 0 --batch-size "$RBATCH" \
    --max-new-tokens 128 --user-prefix "$prefix" "$@" --json-out "$DATA/self-$kind-$n.jsonl"
  # the prompts that share 8 consecutive words with one of the set's eval questions (a leak, if there are any)
  [ -f "$DATA/self-$kind-$n.overlap.json" ] || $PY experiments/eval_overlap.py "$DATA/self-$kind-$n.jsonl" "$set" \
    --json-out "$DATA/self-$kind-$n.overlap.json"
  $T rollout --prompts "$DATA/self-$kind-$n.jsonl" --max-new-tokens "$NEW" --batch-size "$RBATCH" \
    --out "$DATA/rollouts-self$kind$n-train"
}
stage_selfcode() { self_set code humaneval "$SELF_CODE" def; }  # the target continues the code block from "def"
stage_selfmath() {  # the target writes the question on from the first two words of a GSM8K training question
  local starts="$DATA/gsm8k-train-starts.txt"
  if [ ! -f "$starts" ]; then  # written whole under its name
    $PY -c 'from treespark_jax.prompts.load import load_prompts
print("\n".join(" ".join(r.meta["raw"].split()[:2]) for r in load_prompts("gsm8k", "train")))' > "$starts.tmp"
    mv "$starts.tmp" "$starts"
  fi
  self_set math gsm8k "$SELF_MATH" "" --starts "$starts" --temperature 0.7 --top-p 0.9
}
stage_dflash() { local data; data=$(mix 0 $(train_plain)); $T train $data --loss dflash $TRAIN_ARGS $VOCAB_ARGS --out "$DATA/dflash"; }
stage_dspark() {
  local data
  data=$(mix 0 $(train_plain))
  $T train $data --loss dspark $TRAIN_ARGS $VOCAB_ARGS $(weights) --out "$DATA/dspark"
}
onpolicy_dir() { if [ "$REPLAY" = 1 ]; then echo "$DATA/replay-$1-train"; else echo "$DATA/onpolicy-$1-train"; fi; }
stage_onpolicy() {
  for s in $ONPOLICY; do
    if [ "$REPLAY" = 1 ]; then  # every plain training rollout of the set, replayed (no target forward)
      $T replay --rollouts "$DATA/rollouts-$s-train" --drafter "$DSPARK" --method pctree --budget "$BUDGET" \
        --batch-size 8 --out "$(onpolicy_dir "$s")"
    else
      $T rollout --prompts "$s" --split train ${LIMIT:+--limit "$LIMIT"} --max-new-tokens "$NEW" --batch-size "$RBATCH" \
        --drafter "$DSPARK" --method pctree --budget "$BUDGET" --out "$(onpolicy_dir "$s")"
    fi
  done
}
treespark_sets() {  # the on-policy trees, and every plain rollout there is (a set's on-policy prompts may be fewer)
  for s in $SETS; do
    case " $ONPOLICY " in *" $s "*) onpolicy_dir "$s" ;; esac
    if [ -d "$DATA/rollouts-$s-train" ]; then echo "$DATA/rollouts-$s-train"; fi
  done
  self_rollouts
  sampled
}
stage_treespark() {
  local data
  data=$(mix "$TREE_SHARE" $(treespark_sets))
  $T train $data --loss treespark --trees 4 --init "$DSPARK" $TRAIN_ARGS $(weights) --out "$DATA/treespark"
}
stage_eval() {
  for d in dflash:ddtree dspark:pctree treespark:treespark; do
    $T eval-drafter --drafter "$DATA/${d%%:*}/drafter" --rollouts $(plain eval) --method "${d##*:}" \
      --budget "$BUDGET" --json-out "$DATA/eval-${d%%:*}.json"
  done
}

ABLATE_STEPS=${ABLATE_STEPS:-100}  # steps per loss-term ablation run
NO_TREE_TERMS=tree_tv=0,tree_ce=0,tree_coverage=0,tree_edge=0
# full: the default weights (the edge term only); node_terms: the node terms back on at the weights they had
# before 2026-12-04; unit_weights: DESIGN.md §1.4's own; no_tree_terms: the edge term off too
ABLATIONS="full: node_terms:tree_tv=0.09,tree_ce=0.01,tree_coverage=0.1 unit_weights:tree_tv=0.9,tree_ce=0.1,tree_coverage=1,tree_edge=1 no_tree_terms:$NO_TREE_TERMS"
stage_ablate() {  # treespark loss terms, each variant from the dspark drafter for ABLATE_STEPS, offline tree τ on GSM8K eval
  local data
  data=$(mix "$TREE_SHARE" $(treespark_sets))
  $T rollout --prompts gsm8k --split eval --max-new-tokens "$NEW" --batch-size "$RBATCH" --out "$DATA/rollouts-gsm8k-eval"
  mkdir -p "$DATA/ablate-start"  # the reference: the dspark drafter every variant starts from
  $T eval-drafter --drafter "$DSPARK" --rollouts "$DATA/rollouts-gsm8k-eval" --method treespark \
    --budget "$BUDGET" --json-out "$DATA/ablate-start/eval.json"
  mkdir -p "$DATA/ablate-shipped"  # for scale: the treespark stage's run (STEPS steps), exported as the shipped drafter
  $T eval-drafter --drafter "$DATA/treespark/drafter" --rollouts "$DATA/rollouts-gsm8k-eval" --method treespark \
    --budget "$BUDGET" --json-out "$DATA/ablate-shipped/eval.json"
  # the shipped run's control: the same STEPS steps from the same start with every tree term off
  $T train $data --loss treespark --trees 4 --init "$DSPARK" $TRAIN_ARGS \
    $(weights "$NO_TREE_TERMS") --out "$DATA/ablate-shipped_no_tree_terms"
  $T eval-drafter --drafter "$DATA/ablate-shipped_no_tree_terms/drafter" --rollouts "$DATA/rollouts-gsm8k-eval" \
    --method treespark --budget "$BUDGET" --json-out "$DATA/ablate-shipped_no_tree_terms/eval.json"
  for v in $ABLATIONS; do
    name=${v%%:*} w=${v#*:}
    $T train $data --loss treespark --trees 4 --init "$DSPARK" \
      --steps "$ABLATE_STEPS" --batch-size "$BATCH" --seq-len "$SEQ" --anchors "$ANCHORS" --save-every 50 --log-every 10 \
      $(weights "$w") --out "$DATA/ablate-$name"
    $T eval-drafter --drafter "$DATA/ablate-$name/drafter" --rollouts "$DATA/rollouts-gsm8k-eval" --method treespark \
      --budget "$BUDGET" --json-out "$DATA/ablate-$name/eval.json"
  done
}

# The iterated loop of DESIGN.md §1.4 ("learning to draft the trees you verify"), ROUNDS rounds. Round r:
#   1. on-policy trees of the round's start drafter (round 1: ITER_START, the treespark stage's drafter; then round r-1's
#      seed-0 treespark drafter), treespark method at BUDGET: at ITER_TEMP=0 (and REPLAY=1) replayed from every
#      plain train rollout of the ONPOLICY sets (whole budget every round); otherwise on-policy rollouts of
#      ITER_LIMIT GSM8K training prompts (a new window each round), every verified tree logged;
#   2. for each seed in ITER_SEEDS, ITER_STEPS steps of `treespark` training from the start drafter at peak
#      learning rate ITER_LR on those trees plus every plain training rollout (GSM8K's too), and the control:
#      the same steps, data, seed and start with every tree term off;
#   3. offline τ (eval-drafter on the three eval splits) and online τ at equal budget (bench, GSM8K eval
#      prompts, every round drafted and the whole budget verified) of each, and of round 1's start drafter
#      (a later round's start is scored already: round r-1's treespark-s0).
# ITER_TEMP sets the temperature of the on-policy rollouts and of the online τ. At 0 the trees are verified
# greedily, and a node's reach weight is 1 only on the target's argmax path, so node distillation sees the rows
# the gold chain has; at ITER_TEMP > 0 (verified by the treespark method's sampling rule) it also sees the rows
# of the branches the target's own draws reach (losses/tree.py, docs/training.md).
# Outputs: $DATA/iter-r<r> (ITER_TEMP=0; iter-t<T>-r<r> at temperature T) holding
# {onpolicy or replay-<set>,<variant>-s<seed>/{drafter,eval.json,bench.json}}, and round 1's start/{eval.json,bench.json}; a
# score already written is kept. The RESULTS.md table is rendered from them (experiments/results_iterate.py).
ROUNDS=${ROUNDS:-2}
ITER_LIMIT=${ITER_LIMIT:-128}   # GSM8K training prompts per round's on-policy rollouts (when not replayed)
ITER_STEPS=${ITER_STEPS:-600}   # steps per round and variant
ITER_SEEDS=${ITER_SEEDS:-"0 1"}
ITER_BENCH=${ITER_BENCH:-16}    # GSM8K eval prompts of the online τ
ITER_TEMP=${ITER_TEMP:-0}       # temperature of the on-policy rollouts and of the online τ
# A round fine-tunes a trained drafter: at the stages' 3e-4 and with GSM8K only from the round's window, round 1
# lowered its start's pooled offline tree τ (2.496 → 2.43–2.46 at temperature 1, docs/training.md).
ITER_LR=${ITER_LR:-1e-4}
# round 1's start drafter; on a machine without this DATA's treespark stage, the shipped one (bfloat16):
# ITER_START=treespark_jax/drafters/smollm2-135m/treespark
ITER_START=${ITER_START:-$DATA/treespark/drafter}
iter_score() {  # offline and online τ of drafter $1 into $2/{eval,bench}.json (each kept once written)
  [ -f "$2/eval.json" ] || $T eval-drafter --drafter "$1" --rollouts $(plain eval) --method treespark \
    --budget "$BUDGET" --json-out "$2/eval.json"
  [ -f "$2/bench.json" ] || $T bench --prompts gsm8k --split eval --limit "$ITER_BENCH" --methods ar,treespark \
    --budgets "$BUDGET" --drafter "treespark=$1" --no-skip-drafting --no-cost-aware-stop --repeats 1 \
    --temperature "$ITER_TEMP" --json-out "$2/bench.json"
}
replayed() {  # drafter $1's greedy treespark trees replayed from every plain train rollout of the ONPOLICY sets into
  local s      # $2/replay-<set> (each resumed); prints those folders; fails as a replay fails (errexit does not
  for s in $ONPOLICY; do  # reach into the command substitution that reads them)
    $T replay --rollouts "$DATA/rollouts-$s-train" --drafter "$1" --method treespark --budget "$BUDGET" \
      --batch-size 8 --out "$2/replay-$s" >&2 || return 1
    echo "$2/replay-$s"
  done
}
# `treespark` training from drafter $1 with seed $2 for $3 steps at peak learning rate $4 into $5, the loss weights
# $6 changed (as `weights` takes them), on the rollouts and mix of $7...; then its offline and online τ (iter_score)
fine_tune() {
  local start=$1 seed=$2 steps=$3 lr=$4 run=$5 terms=$6
  shift 6
  $T train "$@" --loss treespark --trees 4 --init "$start" --seed "$seed" --lr "$lr" --steps "$steps" \
    --batch-size "$BATCH" --seq-len "$SEQ" --anchors "$ANCHORS" --save-every 100 --log-every 10 $(weights $terms) \
    --out "$run"
  iter_score "$run/drafter" "$run"
}
stage_iterate() {
  local start="$ITER_START"
  for r in $(seq 1 "$ROUNDS"); do
    local dir="$DATA/iter-r$r"
    if [ "$ITER_TEMP" != 0 ]; then dir="$DATA/iter-t$ITER_TEMP-r$r"; fi
    mkdir -p "$dir"
    local trees=""
    if [ "$ITER_TEMP" = 0 ] && [ "$REPLAY" = 1 ]; then
      trees=$(replayed "$start" "$dir")
    else
      $PY - "$dir/prompts.jsonl" "$(( (r - 1) * ITER_LIMIT ))" "$ITER_LIMIT" <<'PY'
import json, sys
from pathlib import Path
from treespark_jax.prompts.load import load_prompts

out, offset, limit = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
if not out.exists():  # the round's window of GSM8K training prompts, as written (one user turn each)
    recs = load_prompts("gsm8k", "train")[offset: offset + limit]
    out.write_text("".join(json.dumps({"id": r.id, "prompt": r.turns[0]}) + "\n" for r in recs))
PY
      $T rollout --prompts "$dir/prompts.jsonl" --max-new-tokens "$NEW" --batch-size "$RBATCH" \
        --drafter "$start" --method treespark --budget "$BUDGET" --temperature "$ITER_TEMP" --out "$dir/onpolicy"
      trees="$dir/onpolicy"
    fi
    if [ "$r" = 1 ]; then mkdir -p "$dir/start" && iter_score "$start" "$dir/start"; fi  # later: round r-1's
    local data
    data=$(mix "$TREE_SHARE" $trees $(train_plain))
    for seed in $ITER_SEEDS; do
      for variant in treespark control; do
        local terms=""
        [ "$variant" = control ] && terms="$NO_TREE_TERMS"
        fine_tune "$start" "$seed" "$ITER_STEPS" "$ITER_LR" "$dir/$variant-s$seed" "$terms" $data
      done
    done
    start="$dir/treespark-s0/drafter"
  done
}

# A longer fine-tune than a round's, for a drafter to ship: FT_STEPS steps at FT_LR from FT_INIT on its replayed
# trees (as a round's at temperature 0) and every plain training rollout, SELF_MATH's and SAMPLES' among them, into
# $DATA/$FT_NAME/{replay-<set>,run}, scored as the rounds' runs are (not in the default stages; export does not
# read it). A round does not move its start (600 steps at 1e-4, docs/training.md); new math data at more steps may.
FT_INIT=${FT_INIT:-treespark_jax/drafters/smollm2-135m/treespark}
FT_STEPS=${FT_STEPS:-3000}
FT_LR=${FT_LR:-1e-4}
FT_NAME=${FT_NAME:-finetune}
FT_LAYERS=${FT_LAYERS:-}  # drafter layers (default FT_INIT's); layers past FT_INIT's start as the identity (warm_start)
stage_finetune() {
  local dir="$DATA/$FT_NAME" trees data
  mkdir -p "$dir"
  trees=$(replayed "$FT_INIT" "$dir")
  data=$(mix "$TREE_SHARE" $trees $(train_plain))
  fine_tune "$FT_INIT" 0 "$FT_STEPS" "$FT_LR" "$dir/run" "" $data ${FT_LAYERS:+--drafter-layers "$FT_LAYERS"}
}

# the run the export stage ships as the treespark drafter: the treespark stage's, or a finetune stage's
# (EXPORT_TREESPARK=$DATA/$FT_NAME/run/drafter)
EXPORT_TREESPARK=${EXPORT_TREESPARK:-$DATA/treespark/drafter}
stage_export() {  # bfloat16 copies, each with the draft vocabulary it was trained on; a stage not run keeps its shipped one
  $PY - "$DATA/dflash/drafter" "$DATA/dspark/drafter" "$EXPORT_TREESPARK" <<'PY'
import sys
from pathlib import Path
from treespark_jax.drafter.checkpoint import export_drafter

for name, run in zip(("dflash", "dspark", "treespark"), map(Path, sys.argv[1:])):
    if run.is_dir():
        print(export_drafter(run, f"treespark_jax/drafters/smollm2-135m/{name}", overwrite=True))
    else:
        print(f"{run} does not exist: the shipped {name} drafter stays")
PY
}

for stage in ${@:-rollouts dflash dspark onpolicy treespark eval export}; do
  echo "== $stage"
  "stage_$stage"
done
