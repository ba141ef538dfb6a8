# Two commands on a fresh clone: `make run` and `make test`.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: run test lint install bench-memory bench-litgpt bench-throughput bench-train bench-data bench-exact gpu-check clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e '.[train,test]'
	touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	$(BIN)/lorafit plan
	$(BIN)/lorafit train --demo --output-dir runs/demo --overwrite

test: $(STAMP)
	$(BIN)/ruff check src tests bench
	$(BIN)/ruff format --check src tests bench
	$(BIN)/python -m pytest -q

lint: $(STAMP)
	$(BIN)/ruff check src tests bench
	$(BIN)/ruff format --check src tests bench

BENCH_STAMP := $(VENV)/.installed-bench

$(BENCH_STAMP): pyproject.toml | $(STAMP)
	$(BIN)/pip install -q -e '.[train,test,bench]'
	touch $(BENCH_STAMP)

bench-memory: $(BENCH_STAMP)
	$(BIN)/python bench/memory_accuracy.py

# litgpt's own training step, traced, against lorafit's litgpt runtime (the LGC rows' stack); litgpt and
# Lightning at the versions of those runs, without their dependencies (the project's cover what the step imports)
LITGPT_DIR := bench/out/litgpt
$(LITGPT_DIR)/.installed: | $(BENCH_STAMP)
	$(BIN)/pip install -q --no-deps --target $(LITGPT_DIR) litgpt==0.4.13 lightning==2.4.0 \
		lightning-utilities==0.11.7 torchmetrics==1.4.1
	touch $@

bench-litgpt: $(LITGPT_DIR)/.installed
	$(BIN)/python bench/litgpt_trace.py --json bench/out/litgpt_trace.json

bench-throughput: $(STAMP)
	$(BIN)/python bench/throughput_accuracy.py

bench-train: $(STAMP)
	$(BIN)/python bench/train_throughput.py

bench-data: $(STAMP)
	$(BIN)/python bench/data_stream.py

bench-exact: $(STAMP)
	$(BIN)/python bench/exact_speed.py

# Real training steps of 7-8B models on this machine's CUDA GPU against the estimate and the time model, and the
# plan's 24/16/8 GB verdicts under a memory cap; writes bench/results/gpu-check-<gpu>.json (bench/results/README.md)
gpu-check: $(STAMP)
	$(BIN)/python bench/gpu_check.py

clean:
	rm -rf $(VENV) runs bench/out
