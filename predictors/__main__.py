"""`python -m hotneurons.predictors train ...` = pi-train-predictors; `... eval ...` = pi-eval."""

import sys

from hotneurons.predictors.cli import eval_main, train_main

if __name__ == "__main__":
    commands = {"train": train_main, "eval": eval_main}
    if len(sys.argv) < 2 or sys.argv[1] not in commands:
        sys.exit("usage: python -m hotneurons.predictors {train|eval} [OPTIONS]  (--help for each)")
    name = sys.argv.pop(1)
    commands[name](prog_name=f"python -m hotneurons.predictors {name}")
