# Everything a user or CI needs: `make demo`, `make test`.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup demo test test-slow test-real testbed lint profiles bench models evaluate drift clean

$(STAMP): pyproject.toml Makefile
	@command -v $(PY) >/dev/null 2>&1 || { echo "need $(PY) (set PY=python3.x, x >= 11)"; exit 2; }
	test -d $(VENV) || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test,ray,serve]'
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(BIN)/lorapack demo

# Test tiers (docs/testbed.md): `test` is the README's fast suite (<= 4 min on 2 idle cores); `test-slow` the
# heavy tests (whole-file re-simulations, long sweeps); `test-real` the tests against a real vLLM (the testbed).
test: $(STAMP)
	$(BIN)/ruff check src tests bench scripts
	$(BIN)/python -m pytest -x -p no:cacheprovider -m "not slow and not real" $(PYTEST_ARGS)

test-slow: $(STAMP)
	$(BIN)/python -m pytest -x -p no:cacheprovider -m "slow and not real" --durations=8 $(PYTEST_ARGS)

# vLLM's CPU build in its own environment, cached per machine under ~/.cache/lorapack/testbed (docs/testbed.md)
testbed: $(STAMP)
	$(BIN)/python -m lorapack.testbed install

test-real: $(STAMP)
	@$(BIN)/python -m lorapack.testbed status >/dev/null || exit 2
	$(BIN)/python -m pytest -p no:cacheprovider -m real --durations=12 $(PYTEST_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check src tests bench scripts

profiles: $(STAMP)
	$(BIN)/python scripts/fit_profiles.py

# sweep -> train -> refine for both shipped profiles (docs/surrogates.md); MODELS_ARGS="--limit 3000" for a
# quick, smaller dataset. Sweeps resume from build/models-data.
models: $(STAMP)
	nice -n 10 $(BIN)/python scripts/make_models.py $(MODELS_ARGS)

# the evaluate study of issue 9 (144 scenarios; niced: the machine is shared), then its tables into the docs
evaluate: $(STAMP)
	mkdir -p results
	nice -n 10 $(BIN)/lorapack evaluate studies/evaluate/llama.yaml studies/evaluate/llama-throughput.yaml \
		studies/evaluate/qwen.yaml studies/evaluate/qwen-throughput.yaml \
		--out results/evaluate --jobs 2 --workers 1 $(EVALUATE_ARGS)
	$(BIN)/python scripts/evaluation_doc.py results/evaluate

# evaluation over time (issue 25): docs/replan.md "Evaluation over time" (<= 30 min on 2 cores)
drift: $(STAMP)
	nice -n 10 $(BIN)/lorapack evaluate studies/evaluate/drift.yaml --out results/drift --workers 2
	$(BIN)/python scripts/drift_doc.py results/drift

bench: $(STAMP)
	$(BIN)/python bench/twin_speed.py

clean:
	rm -rf $(VENV) build dist src/*.egg-info
