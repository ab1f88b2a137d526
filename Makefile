# Two commands a new user needs: `make run` (install, fetch the default pair, run the main job)
# and `make test` (the test suite; .ci/run calls it).
VENV ?= .venv
PY := $(VENV)/bin/python
# The local CPU wheel on our machines; elsewhere pick the build you want (e.g. a CUDA one).
TORCH ?= torch==2.13.0
# the llama.cpp runtime, pinned (forerun calls its C API), built from source with a patch;
# LLAMA_CMAKE_ARGS passes build options, e.g. -DGGML_CUDA=on for a GPU build
LLAMA_VERSION := 0.3.36
LLAMA_BUILD := build/llama-cpp-python
LLAMA_SRC := $(LLAMA_BUILD)/llama_cpp_python-$(LLAMA_VERSION)
LLAMA_CMAKE_ARGS ?=
# our changes to it, applied in this order: -amx (AMX tile fixes and kernel choice), -avx2
# (multi-row q4_K/q6_K kernels for verify passes and prompts), -hidden (every row's hidden
# state without its logits, for the heads), -q6k (q6_K weights repacked into 8-row interleaved
# blocks on x86, one kernel for 1-4 activation rows), -vnni (AVX512-VNNI dot products in the
# multi-row q4_K kernel, where the CPU has them), -weights-tiled (a pass of several row groups
# runs them all over one tile of the weights before the next; q4_K weights prefetched from 8 rows),
# -zmm (AVX-512: the multi-row q4_K kernel on two weight blocks at once, for 8+ rows),
# -q8k-avx512 (the activations' q8_K quantizer in AVX-512, the reference's bytes), -x86-q6k-pairs
# (without VNNI, the q6_K kernel sums two steps' products in 16 bits: three multiplies in four),
# -x86-stream-prefetch (without AVX-512 VNNI: the q4_K and q6_K kernels prefetch the weights
# they stream, and one-row q4_K passes take the multi-row kernel), -x86-q8k-avx2 (the q8_K
# quantizer in AVX2, the reference's bytes; a block with an infinity takes the reference),
# -x86-q6k-offset (the q6_K kernel takes its -32 offset off once a block, not once a group),
# -x86-avx2-rows (without VNNI: the q4_K and q6_K kernels hold one step's weights in registers
# over all the rows, broadcast activations by load, and q6_K takes up to 8 rows a call)
LLAMA_PATCH_NAMES := amx avx2 hidden q6k q8k-avx512 vnni weights-tiled zmm x86-q6k-pairs \
	x86-stream-prefetch x86-q8k-avx2 x86-q6k-offset x86-avx2-rows
LLAMA_PATCHES := $(foreach p,$(LLAMA_PATCH_NAMES),patches/llama-cpp-python-$(LLAMA_VERSION)-$(p).patch)
PROMPT ?= Refactor this function to use a dataclass:\n\ndef make_user(name, email, age):\n    return {\"name\": name, \"email\": email, \"age\": age}\n\ndef describe(user):\n    return f\"{user['name']} <{user['email']}> is {user['age']}\"

.PHONY: install run test lint clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml $(LLAMA_PATCHES)
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH)"
	$(PY) -m pip install --quiet -e ".[dev]"
	# the llama.cpp runtime: llama-cpp-python's source with our patches (patches/), compiled
	# here (~7 min on 2 cores); then the extra, already satisfied, is recorded
	rm -rf $(LLAMA_BUILD) && mkdir -p $(LLAMA_BUILD)
	$(PY) -m pip download --quiet --no-deps --no-binary :all: -d $(LLAMA_BUILD) \
		"llama-cpp-python==$(LLAMA_VERSION)"
	tar -xzf $(LLAMA_SRC).tar.gz -C $(LLAMA_BUILD)
	for p in $(LLAMA_PATCHES); do patch --quiet -d $(LLAMA_SRC) -p1 < $$p || exit 1; done
	CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" $(PY) -m pip install --quiet --no-cache-dir $(LLAMA_SRC)
	$(PY) -m pip install --quiet -e ".[llama]"
	touch $@

run: install
	$(VENV)/bin/forerun models pull
	printf '%b' "$(PROMPT)" | $(VENV)/bin/forerun generate --compare --method draft

test: install
	$(PY) -m pytest -q

lint: install
	$(VENV)/bin/ruff check forerun tests experiments

clean:
	rm -rf $(VENV) build .pytest_cache .ruff_cache
