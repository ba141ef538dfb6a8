# Two commands on a fresh clone: `make run` and `make test`.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: run test lint install bench-memory bench-allocator bench-litgpt bench-stacks-external bench-stacks bench-unsloth-speed bench-throughput bench-time-cpu bench-train bench-data bench-tokens bench-exact bench-image-text bench-moe bench-hybrid bench-time-trace bench-padded-reserve bench-export bench-savers bench-serve bench-startup screenshots serve gpu-check gpu-session gpu-wheels clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

# llama-cpp-python (the gguf extra) compiles from source; a portable build, without its examples and tests
LLAMA_CMAKE_ARGS ?= -DGGML_NATIVE=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TESTS=OFF

# multi (DeepSpeed, a pure-Python sdist: about 10 s to build) so that the tests read every generated DeepSpeed config with
# DeepSpeed's own config class
$(STAMP): pyproject.toml | $(BIN)/python
	CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" $(BIN)/pip install -q -e '.[train,test,gguf,multi]'
	touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	$(BIN)/lorafit plan
	$(BIN)/lorafit train --demo --output-dir runs/demo --overwrite
	$(BIN)/lorafit export runs/demo --to gguf --quant f16 --quant q4_k_m --ollama --output runs/demo-gguf --overwrite
	$(BIN)/lorafit chat runs/demo-gguf/demo-q4_k_m.gguf --prompt "Which animal lives on Duvik?"

test: $(STAMP)
	$(BIN)/ruff check src tests bench tools
	$(BIN)/ruff format --check src tests bench tools
	$(BIN)/mypy
	$(BIN)/python -m pytest -q

lint: $(STAMP)
	$(BIN)/ruff check src tests bench tools
	$(BIN)/ruff format --check src tests bench tools

BENCH_STAMP := $(VENV)/.installed-bench

$(BENCH_STAMP): pyproject.toml | $(STAMP)
	CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" $(BIN)/pip install -q -e '.[train,test,gguf,multi,bench]'
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

# LLaMA-Factory's and torchtune's own training steps, traced, against lorafit's --stack runtimes; each at its pinned
# version without its dependencies (the project's torch/transformers/peft/bitsandbytes/trl cover the step), plus the
# few pure-Python packages their imports need
LLAMAFACTORY_DIR := bench/out/llamafactory
TORCHTUNE_DIR := bench/out/torchtune
$(LLAMAFACTORY_DIR)/.installed: | $(BENCH_STAMP)
	$(BIN)/pip install -q --no-deps --target $(LLAMAFACTORY_DIR) llamafactory==0.9.5 omegaconf==2.4.0 \
		antlr4-python3-runtime==4.9.3
	touch $@
$(TORCHTUNE_DIR)/.installed: | $(BENCH_STAMP)
	$(BIN)/pip install -q --no-deps --target $(TORCHTUNE_DIR) torchtune==0.6.1 torchao==0.10.0 torchdata==0.11.0 \
		omegaconf==2.4.0 antlr4-python3-runtime==4.9.3 sentencepiece==0.2.3 tiktoken==0.14.0
	touch $@

bench-stacks-external: $(LLAMAFACTORY_DIR)/.installed $(TORCHTUNE_DIR)/.installed
	$(BIN)/python bench/stack_trace_external.py

# Each stack's own training step (TRL's SFTTrainer; transformers' Trainer after peft's kbit preparation), traced at
# Llama-2-7B and Llama-3.1-8B shapes on fake tensors and on small real models on the CPU, against lorafit's
# estimate under --stack; writes bench/results/stacks.json (docs/memory-model.md, "Other trainers' steps")
bench-stacks: $(STAMP)
	$(BIN)/python bench/stack_trace.py --json bench/results/stacks.json

# the time model's --stack unsloth against Unsloth's published speed-ups (its README's benchmark seconds)
bench-unsloth-speed: $(STAMP)
	$(BIN)/python bench/unsloth_speed.py

bench-throughput: $(STAMP)
	$(BIN)/python bench/throughput_accuracy.py

# the time model's step-time ratios (QLoRA/LoRA, micro-batch, sequence, checkpointing) against real steps on this
# CPU, with the CPU's measured rates as its card (lorafit.hostcard); writes bench/results/time-structure-cpu.json
bench-time-cpu: $(STAMP)
	$(BIN)/python bench/time_structure_cpu.py

bench-train: $(STAMP)
	$(BIN)/python bench/train_throughput.py

bench-data: $(STAMP)
	$(BIN)/python bench/data_stream.py

# The chat-template token estimate against real tokenizers: llama.cpp's vocab-only GGUFs and its copies of the
# checkpoints' chat templates, from the llama-cpp-python sdist on PyPI; writes src/lorafit/catalog/token_accuracy.toml
LLAMA_CPP_SDIST_VERSION := 0.3.36
LLAMA_CPP_SDIST := bench/out/llama-cpp-sdist
$(LLAMA_CPP_SDIST)/.extracted: | $(STAMP)
	rm -rf $(LLAMA_CPP_SDIST) && mkdir -p $(LLAMA_CPP_SDIST)
	$(BIN)/pip download -q --no-deps --no-binary :all: llama-cpp-python==$(LLAMA_CPP_SDIST_VERSION) -d $(LLAMA_CPP_SDIST)
	tar xzf $(LLAMA_CPP_SDIST)/llama_cpp_python-$(LLAMA_CPP_SDIST_VERSION).tar.gz -C $(LLAMA_CPP_SDIST) --strip-components=2 \
		--wildcards '*/vendor/llama.cpp/models/*' '*/vendor/llama.cpp/tests/test-chat-template.cpp'
	touch $@

bench-tokens: $(LLAMA_CPP_SDIST)/.extracted
	$(BIN)/python bench/token_estimate.py --llama-cpp $(LLAMA_CPP_SDIST)/llama.cpp --version $(LLAMA_CPP_SDIST_VERSION)

# the closed-form estimate (and time) of the MoE presets beside their --exact traces at the real shapes
bench-moe: $(STAMP)
	$(BIN)/python bench/moe_trace.py --time

# The linear-attention hybrids (Qwen3.5, Qwen3.5-MoE, Qwen3-Next): estimate beside the --exact trace at real shapes
# (bench/hybrid_trace.py)
bench-hybrid: $(STAMP)
	$(BIN)/python bench/hybrid_trace.py --time

bench-exact: $(STAMP)
	$(BIN)/python bench/exact_speed.py

# image-text models fine-tuned on text (Gemma 3, Mistral Small 3.x, Qwen2-VL, Qwen2.5-VL, Qwen3-VL): the estimate beside the --exact
# trace at the real shapes; writes bench/results/image-text-trace.json
bench-image-text: $(STAMP)
	$(BIN)/python bench/image_text_trace.py

# the time model's closed form (timing.micro_batch_time) beside its roofline run over the --exact trace's op list,
# per category, for Llama-3.1-8B on an RTX 4090 and an L4; writes bench/results/time-trace.json
bench-time-trace: $(STAMP)
	$(BIN)/python bench/time_trace.py

# the caching allocator simulated over full-depth traces of 72 steps, and memory.reserved_bytes' fit to it;
# writes bench/results/allocator-fit.json (docs/memory-model.md, section 5)
bench-allocator: $(STAMP)
	$(BIN)/python bench/allocator_fit.py --quick

# what micro-batches of changing length (a collator padding each batch to its longest row) strand in the simulated
# caching allocator, plain and with expandable segments, against two steps at the cap; writes
# bench/results/padded-reserve.json
bench-padded-reserve: $(STAMP)
	$(BIN)/python bench/padded_reserve.py

# lorafit's GGUF writer against llama.cpp's convert_hf_to_gguf.py (from the llama-cpp-python sdist, fetched once by
# pip into bench/out/llama-src) on a TinyLlama-1.1B-shaped model: identical tensors, time and peak RSS side by side;
# writes bench/results/export-gguf.json. Then the MoE and image-text families at a tiny shape (tensors and keys
# compared; bench/out/export-gguf-FAMILY-tiny.json). The bench extra brings sentencepiece, which that converter
# imports.
bench-export: $(STAMP) $(BENCH_STAMP)
	$(BIN)/python bench/export_gguf.py
	for family in qwen3-30b-a3b mixtral-8x7b gpt-oss-20b gemma-3-4b mistral-small-3.1-24b qwen2.5-vl-7b \
		qwen3-vl-8b; do \
		$(BIN)/python bench/export_gguf.py --tiny --repeat 1 --family $$family || exit 1; done

# Each memory saver's effect on 7-8B QLoRA at 2048 tokens, estimate and --exact side by side, against an 8 GB card;
# writes bench/results/savers.json
bench-savers: $(STAMP)
	$(BIN)/python bench/savers.py

# How fast `lorafit serve` answers /api/plan server-side, beside the planner called directly; writes
# bench/results/serve.json
bench-serve: $(STAMP)
	$(BIN)/python bench/serve.py

# How long `lorafit plan` takes in-process, imports included (target < 0.3 s), beside the bare `import lorafit`;
# fails if planning imported torch or transformers
bench-startup: $(STAMP)
	$(BIN)/python bench/startup.py

# The page as a browser shows it (the system's Chromium): the screenshots in docs/ that the README shows
screenshots: $(STAMP)
	LORAFIT_SCREENSHOTS=docs/screenshots LORAFIT_BROWSER_REQUIRED=1 $(BIN)/python -m pytest -q tests/test_web_browser.py

# The planner as a local web page on http://127.0.0.1:8765/
serve: $(STAMP)
	$(BIN)/lorafit serve --open

# Real training steps of 7-8B models on this machine's CUDA GPU against the estimate and the time model, and the
# plan's 24/16/8 GB verdicts under a memory cap; writes bench/results/gpu-check-<gpu>.json (bench/results/README.md).
# It measures with lorafit.measure.engine, the code of `lorafit measure` (one plan on any user's GPU).
#
# A GPU machine that cannot reach a package registry but has torch, transformers and peft: run there
#   make gpu-check GPU_PYTHON=python3
# after `make gpu-wheels` here, which puts the wheels that image lacks (bitsandbytes, pydantic; Python 3.12,
# x86-64) into .whl/; they are installed from there with no index.
GPU_PYTHON ?=
GPU_WHEELS := .whl
GPU_WHEEL_PYTHON ?= 3.12
gpu-wheels: $(STAMP)
	rm -rf $(GPU_WHEELS) && mkdir -p $(GPU_WHEELS)
	$(BIN)/pip download -q --no-deps -d $(GPU_WHEELS) --only-binary=:all: --python-version $(GPU_WHEEL_PYTHON) \
		--platform manylinux2014_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_28_x86_64 \
		"bitsandbytes==$$($(BIN)/python -c 'import bitsandbytes; print(bitsandbytes.__version__)')" \
		"pydantic==$$($(BIN)/python -c 'import pydantic; print(pydantic.VERSION)')" pydantic-core annotated-types \
		typing-inspection
	du -sh $(GPU_WHEELS)

# The one prepared script for a lent GPU machine: gpu-check, then `lorafit measure` on the headline plans, under OUT
gpu-session:
	bash bench/gpu_session.sh

ifeq ($(GPU_PYTHON),)
gpu-check: $(STAMP)
	$(BIN)/python bench/gpu_check.py
else
gpu-check:
	if [ -d $(GPU_WHEELS) ]; then $(GPU_PYTHON) -m pip install -q --no-index --no-deps $(GPU_WHEELS)/*.whl; fi
	$(GPU_PYTHON) bench/gpu_check.py
endif

clean:
	rm -rf $(VENV) runs bench/out
