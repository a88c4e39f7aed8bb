# Everyday commands; the README's two quick-start commands need none of these.
PY ?= .venv/bin/python

.PHONY: venv test notebooks lint format bench verify properties mutations

venv:
	python3.11 -m venv .venv && .venv/bin/pip install torch==2.13.0 -e ".[dev]"

test:            ## unit tests and every notebook, outputs compared (what CI runs)
	$(PY) -m pytest --nbval

notebooks:       ## re-execute every notebook in place, top to bottom
	$(PY) -m jupyter nbconvert --to notebook --execute --inplace \
	  --ExecutePreprocessor.timeout=600 notebooks/*.ipynb

properties:      ## the property tests with many random examples (the default run takes a few)
	HYPOTHESIS_PROFILE=long $(PY) -m pytest tests/test_properties.py -q

mutations:       ## plant known bugs in a backend and show which checks catch them
	$(PY) scripts/mutation_check.py

lint:
	$(PY) -m ruff check fovi_ref tests notebooks scripts
	$(PY) -m ruff format --check fovi_ref tests scripts

format:
	$(PY) -m ruff format fovi_ref tests scripts notebooks

verify:
	$(PY) -m fovi_ref verify

bench:
	$(PY) -m fovi_ref bench
