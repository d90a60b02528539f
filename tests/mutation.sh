#!/usr/bin/env bash
# Mutation testing of the core (objectives, advantages) with mutmut 3 (the `dev` extra); docs/testing.md.
#   tests/mutation.sh [FILE ...]     default: the six files below; one worker (MUTMUT_JOBS to change it)
# Runs in a scratch copy (MUTATION_DIR, default a fresh temporary folder) so that mutmut's `mutants/` folder never
# lands in the tree; prints `mutmut results` (surviving mutants) and a score per file.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
py="${PYTHON:-$root/.venv-test/bin/python}"
[ -x "$py" ] || py=python
files=("$@")
[ ${#files[@]} -gt 0 ] || files=(polopt_lightning/objectives/base.py polopt_lightning/objectives/grpo.py
  polopt_lightning/objectives/gspo.py polopt_lightning/objectives/cispo.py polopt_lightning/objectives/sapo.py
  polopt_lightning/advantages.py)
work="${MUTATION_DIR:-$(mktemp -d /tmp/polopt-mutation.XXXXXX)}"
mkdir -p "$work"
cp -r "$root/polopt_lightning" "$root/conf" "$root/tests" "$root/pyproject.toml" "$work/"
find "$work" -name __pycache__ -prune -exec rm -rf {} +
# The fast unit tests that cover these files (seconds per mutant); the fits in test_estimators.py are deselected.
{
  echo "[mutmut]"
  echo "source_paths = polopt_lightning"
  echo "also_copy = conf"
  printf 'only_mutate =\n'; for f in "${files[@]}"; do printf '    %s\n' "$f"; done
  printf 'pytest_add_cli_args_test_selection =\n    tests/test_objectives.py\n    tests/test_objectives_edges.py\n    tests/test_advantages.py\n    tests/test_advantages_edges.py\n    tests/test_estimators.py\n'
  printf 'pytest_add_cli_args =\n    -p\n    no:cacheprovider\n    -k\n    not fit_with_each and not losses_by_name_train and not whitens_by_the_completions\n'
  echo "process_isolation = forkserver"
} > "$work/setup.cfg"
cd "$work"
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
"$py" -m mutmut run --max-children "${MUTMUT_JOBS:-1}" >"$work/run.log" 2>&1 || { tail -40 "$work/run.log"; exit 1; }
"$py" -m mutmut results --all true > "$work/results.txt" || true
"$py" - "$work/results.txt" <<'PY'
import collections, sys
per = collections.defaultdict(collections.Counter)
for line in open(sys.argv[1]):
    if "__mutmut_" in line:
        name, status = line.strip().rsplit(": ", 1)
        per[name.split("__mutmut_")[0].rsplit(".", 1)[0]][status] += 1
for module, c in sorted(per.items()):
    n, killed = sum(c.values()), c["killed"] + c["timeout"]
    print(f"{module}: {n} mutants, {killed} killed, score {100 * killed / n:.1f}%  {dict(c)}")
PY
grep -v -e ": killed" -e ": timeout" "$work/results.txt" || true  # `mutmut show NAME` in $work: the diff
echo "scratch copy: $work (delete it when done)"
