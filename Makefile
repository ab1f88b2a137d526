# Two commands a new user needs: `make run` (install, fetch the default pair, run the main job)
# and `make test` (the test suite; .ci/run calls it).
VENV ?= .venv
PY := $(VENV)/bin/python
# The local CPU wheel on our machines; elsewhere pick the build you want (e.g. a CUDA one).
TORCH ?= torch==2.13.0
PROMPT ?= Refactor this function to use a dataclass:\n\ndef make_user(name, email, age):\n    return {\"name\": name, \"email\": email, \"age\": age}\n\ndef describe(user):\n    return f\"{user['name']} <{user['email']}> is {user['age']}\"

.PHONY: install run test lint clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH)"
	$(PY) -m pip install --quiet -e ".[dev]"
	# the llama.cpp runtime: llama-cpp-python compiles from source here (~8 min on 2 cores)
	$(PY) -m pip install --quiet -e ".[llama]"
	touch $@

run: install
	$(VENV)/bin/forerun models pull
	printf '%b' "$(PROMPT)" | $(VENV)/bin/forerun generate --compare --method draft

test: install
	$(PY) -m pytest -q

lint: install
	$(VENV)/bin/ruff check forerun tests scripts

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
