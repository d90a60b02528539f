"""PPO with a critic against GRPO, and per-turn against per-episode credit, at equal samples (issue 54).

Two studies, each `polopt-train` run in its own process, seeds 0, 1, 2:

- `default`: the default job (arithmetic, the tiny model, 1,500 rollouts of 8 prompts x 8 completions) with
  `objective=grpo` (the shipped default) and `objective=ppo` (a critic copied from the warm-started policy, GAE,
  the critic's shipped settings): the same prompts, completions per step and optimizer steps.
- `tool`: `experiment=tool_arithmetic` (multi-turn rollouts with an `add` tool) with `experience.turn_credit=episode`
  (the default: one advantage a completion) and `turn` (each turn's own return, measured against the same turn of
  its group).

    python benchmarks/ppo_study.py --out docs/ppo                 # both studies, 3 seeds (about an hour on 2 cores)
    python benchmarks/ppo_study.py --out /tmp/p --quick           # a minute: the pipeline, not a result

Writes `<out>/results.csv` (one row per run: study, setting, seed, held-out accuracy before and after RL, the best and
its rollout, the critic's explained variance over the last 50 rollouts, RL wall time) and `<out>/summary.md` (median
and range over the seeds, and each seed's difference).
"""

from __future__ import annotations

import statistics
from pathlib import Path

from tool_task import run_study, seed_differences, study_arguments, train_run

# study -> (its base overrides, {setting: its overrides}); the first setting is the baseline
STUDIES = {
    "default": ([], {"grpo": ["objective=grpo"], "ppo": ["objective=ppo"]}),
    "tool": (["experiment=tool_arithmetic"], {"episode": ["experience.turn_credit=episode"],
                                              "turn": ["experience.turn_credit=turn"]}),
}
COLUMNS = ["study", "setting", "seed", "accuracy_before", "accuracy_after", "accuracy_best", "best_rollout",
           "explained_variance_last", "rl_wall_s"]


def run(runs: Path, study: str, setting: str, seed: int, quick: bool, cache: Path, threads: int) -> dict:
    base, settings = STUDIES[study]
    # quick: the default job's warm start to a fixed few steps (its probe target would not be met)
    results, lines = train_run(runs / f"{study}-{setting}-s{seed}", [*base, *settings[setting],
                               *(["warm_start.target_accuracy=null"] if quick else [])], seed, quick, cache, threads)
    explained = [float(line["train/critic/explained_variance"]) for line in lines  # NaN: returns that did not vary
                 if line.get("train/critic/explained_variance") not in (None, "", "nan")][-50:]
    return {"study": study, "setting": setting, "seed": seed,
            "accuracy_before": round(results["val_accuracy_before"], 4),
            "accuracy_after": round(results["val_accuracy_after"], 4),
            "accuracy_best": round(results["val_accuracy_best"], 4) if results.get("val_accuracy_best") else None,
            "best_rollout": results.get("val_accuracy_best_rollout"),
            "explained_variance_last": round(statistics.mean(explained), 3) if explained else None,
            "rl_wall_s": results.get("rl_wall_s")}


def median_range(values: list[float], scale: float = 100.0, digits: int = 1) -> str:
    return (f"{scale * statistics.median(values):.{digits}f} "
            f"({scale * min(values):.{digits}f}-{scale * max(values):.{digits}f})")


def summarize(rows: list[dict], out: Path) -> str:
    lines = ["| study | setting | seeds | accuracy before RL | after RL | best | RL wall s | critic's explained variance "
             "(last 50 rollouts) |", "|---|---|---|---|---|---|---|---|"]
    for study, (_, settings) in STUDIES.items():
        for setting in settings:
            rs = [r for r in rows if r["study"] == study and r["setting"] == setting]
            if not rs:
                continue
            explained = [r["explained_variance_last"] for r in rs if r["explained_variance_last"] is not None]
            lines.append(f"| {study} | {setting} | {len(rs)} | {median_range([r['accuracy_before'] for r in rs])} | "
                         f"{median_range([r['accuracy_after'] for r in rs])} | "
                         f"{median_range([r['accuracy_best'] or r['accuracy_after'] for r in rs])} | "
                         f"{median_range([r['rl_wall_s'] for r in rs], 1.0, 0)} | "
                         f"{median_range(explained, 1.0, 2) if explained else '-'} |")
    lines.append("")
    for study, (_, settings) in STUDIES.items():
        baseline, *others = settings
        for other in others:
            lines += seed_differences([r for r in rows if r["study"] == study], other, baseline,
                                      f"{study}: {other} minus {baseline}")
    text = "\n".join(lines) + "\n"
    (out / "summary.md").write_text(text)
    return text


def main(argv: list[str] | None = None) -> None:
    parser = study_arguments(__doc__)
    parser.add_argument("--studies", nargs="+", choices=sorted(STUDIES), default=list(STUDIES))
    args = parser.parse_args(argv)
    # a seed's first setting makes the warm start; its other settings load it from the cache
    keys = [(study, setting, seed) for study in args.studies for seed in args.seeds for setting in STUDIES[study][1]]
    firsts = [k for k in keys if k[1] == next(iter(STUDIES[k[0]][1]))]
    rows = run_study(args, run, firsts, [k for k in keys if k not in firsts], COLUMNS)
    print(summarize(rows, args.out))


if __name__ == "__main__":
    main()
