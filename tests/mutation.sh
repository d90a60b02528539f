#!/usr/bin/env bash
# Mutation testing of the core with mutmut 3 (the `dev` extra); docs/testing.md.
#   tests/mutation.sh [GROUP ...]    groups: objectives advantages update step experience rewards multi_turn (default: all)
#   MUTMUT_JOBS (default 1): workers; MUTATION_DIR: the scratch folder; MUTATION_FLOOR: fail below this score (%);
#   MUTANTS: mutant name patterns (fnmatch, e.g. "polopt_lightning.objectives.base.*") instead of the group's
# Each group mutates its files (or the functions it names) and runs, for each mutant, only the fast tests of its
# selection that cover the mutated function. It works in a scratch copy (mutmut's `mutants/` never lands in the tree)
# and prints the score per file and the surviving mutants (`mutmut show NAME` in the group's folder: the diff).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
py="${PYTHON:-$root/.venv-test/bin/python}"
[ -x "$py" ] || py=python
groups=("$@")
[ ${#groups[@]} -gt 0 ] || groups=(objectives advantages update step experience rewards multi_turn)
work="${MUTATION_DIR:-$(mktemp -d /tmp/polopt-mutation.XXXXXX)}"
mkdir -p "$work"
status=0
for group in "${groups[@]}"; do
  names=()  # mutant name patterns (fnmatch); none: every mutant of the files
  deselect="not fit_with_each and not losses_by_name_train"
  case "$group" in
    objectives)
      files=(polopt_lightning/objectives/base.py polopt_lightning/objectives/grpo.py polopt_lightning/objectives/gspo.py
             polopt_lightning/objectives/cispo.py polopt_lightning/objectives/sapo.py)
      tests=(tests/test_objectives.py tests/test_objectives_edges.py tests/test_objectives_base.py tests/test_estimators.py
             tests/test_kl_entropy.py tests/test_core_edges.py)
      deselect="$deselect and not train_from_a_fit and not in_the_checkpoint and not kl_reward_penalty and not adapter_disabled"
      ;;
    advantages)
      files=(polopt_lightning/step/advantages.py)
      tests=(tests/test_advantages.py tests/test_advantages_edges.py tests/test_estimators.py)
      ;;
    update)  # the step's update: the sampler correction and the top-entropy mask on the advantages, mini- and
      # micro-batches, the schedule
      files=(polopt_lightning/step/update.py polopt_lightning/step/terms.py)
      tests=(tests/test_update.py tests/test_performance_equivalence.py tests/test_kl_entropy.py tests/test_core_edges.py)
      names=("polopt_lightning.step.terms.x_sampler_weights__*" "polopt_lightning.step.update.x_mini_batch_order__*"
             "polopt_lightning.step.update.x_micro_batches__*" "polopt_lightning.step.update.x_lr_factor__*"
             "polopt_lightning.step.terms.xǁSamplerCorrectionǁ*" "polopt_lightning.step.terms.xǁTopEntropyMaskǁadvantages__*")
      deselect="$deselect and not train_from_a_fit and not in_the_checkpoint and not adapter_disabled"
      ;;
    step)  # the update's loop (mini-batches, micro-batches and their weights, skipped steps, clipping, max_steps) and
      # the loss terms it runs (the entropy bonus, the top-entropy mask's tokens, the KL watch, the anchor)
      files=(polopt_lightning/step/update.py polopt_lightning/step/terms.py)
      tests=(tests/test_step_without_trainer.py)
      names=("polopt_lightning.step.update.xǁUpdaterǁrun__*" "polopt_lightning.step.update.xǁUpdaterǁstep__*"
             "polopt_lightning.step.update.xǁUpdaterǁaccumulate__*" "polopt_lightning.step.terms.x_build_terms__*"
             "polopt_lightning.step.terms.xǁEntropyBonusǁ*" "polopt_lightning.step.terms.xǁTopEntropyMaskǁbegin__*"
             "polopt_lightning.step.terms.xǁTopEntropyMaskǁend__*" "polopt_lightning.step.terms.xǁKLWatchǁloss__*"
             "polopt_lightning.step.terms.xǁAnchorTermǁbegin__*")
      deselect="$deselect and not train_from_a_fit and not in_the_checkpoint and not adapter_disabled and not memory"
      ;;
    experience)
      files=(polopt_lightning/step/experience.py)
      tests=(tests/test_experience.py tests/test_estimators.py tests/test_kl_entropy.py tests/test_core_edges.py)
      names=("polopt_lightning.step.experience.xǁExperienceMakerǁkl_penalty__*"
             "polopt_lightning.step.experience.xǁExperienceMakerǁbatch_moments__*" "polopt_lightning.step.experience.x_pad_cat__*"
             "polopt_lightning.step.experience.x_concat_groups__*")
      deselect="$deselect and not train_from_a_fit and not in_the_checkpoint and not adapter_disabled"
      ;;
    rewards)
      files=(polopt_lightning/rewards/composer.py)
      tests=(tests/test_rewards.py tests/test_core_edges.py)
      ;;
    multi_turn)  # the masks of multi-turn rollouts: whose tokens are whose, and the budget
      files=(polopt_lightning/rollout/multi_turn.py)
      tests=(tests/test_multi_turn.py tests/test_core_edges.py)
      names=("polopt_lightning.rollout.multi_turn.xǁEpisodeǁadd__*" "polopt_lightning.rollout.multi_turn.xǁMultiTurnEngineǁtake_turn__*"
             "polopt_lightning.rollout.multi_turn.xǁMultiTurnEngineǁanswer_turn__*" "polopt_lightning.rollout.multi_turn.x_left_pad__*"
             "polopt_lightning.rollout.multi_turn.x_assemble__*" "polopt_lightning.rollout.multi_turn.xǁChatTurnsǁobservation_ids__*")
      deselect="$deselect and not off_policy_passes and not hung_one_is_killed and not errors_and_hangs"
      ;;
    *) echo "unknown group $group (objectives advantages update step experience rewards multi_turn)" >&2; exit 2 ;;
  esac
  [ -z "${MUTANTS:-}" ] || read -r -a names <<< "$MUTANTS"
  dir="$work/$group"
  rm -rf "$dir" && mkdir -p "$dir"
  cp -r "$root/polopt_lightning" "$root/conf" "$root/tests" "$root/pyproject.toml" "$dir/"
  find "$dir" -name __pycache__ -prune -exec rm -rf {} +
  {
    echo "[mutmut]"
    echo "source_paths = polopt_lightning"
    echo "also_copy = conf"
    printf 'only_mutate =\n'; for f in "${files[@]}"; do printf '    %s\n' "$f"; done
    printf 'pytest_add_cli_args_test_selection =\n'; for t in "${tests[@]}"; do printf '    %s\n' "$t"; done
    printf 'pytest_add_cli_args =\n    -p\n    no:cacheprovider\n    -n\n    0\n    -k\n    %s\n' "$deselect"  # one process (-n 0): mutmut traces it
    echo "process_isolation = forkserver"
  } > "$dir/setup.cfg"
  echo "== $group: ${files[*]}"
  (
    cd "$dir"
    export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
    "$py" -m mutmut run --max-children "${MUTMUT_JOBS:-1}" "${names[@]}" >run.log 2>&1 || { tail -40 run.log; exit 1; }
    "$py" -m mutmut results --all true > results.txt || true
  ) || { status=1; continue; }
  "$py" - "$dir/results.txt" "${MUTATION_FLOOR:-0}" "${names[@]}" <<'PY' || status=1
import collections, fnmatch, sys
path, floor, patterns = sys.argv[1], float(sys.argv[2]), sys.argv[3:]
per, left = collections.defaultdict(collections.Counter), []
for line in open(path):  # the checked names' states, per module, and their survivors (or mutants no test covers)
    if "__mutmut_" in line:
        name, state = line.strip().rsplit(": ", 1)
        if patterns and not any(fnmatch.fnmatch(name, p) for p in patterns):
            continue
        per[name.split("__mutmut_")[0].split(".x")[0]][state] += 1
        if state not in ("killed", "timeout", "not checked"):
            left.append(f"    {name}: {state}")
low = False
for module, c in sorted(per.items()):
    n, killed = sum(c.values()), c["killed"] + c["timeout"]
    print(f"{module}: {n} mutants, {killed} killed, score {100 * killed / n:.1f}%  {dict(c)}")
    low |= 100 * killed / n < floor
print("\n".join(left))
sys.exit(1 if low or not per else 0)
PY
done
echo "scratch copies: $work (delete it when done)"
exit $status
