# Attention from Scratch: the two commands a reader needs are `make book`
# and `make test`; everything else here serves them.

PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
NOTEBOOKS := $(sort $(wildcard book/*.ipynb))
# one notebook only: make outputs NB=book/01_general_attention.ipynb
NB ?= $(NOTEBOOKS)

# nbval's flags are in pyproject.toml ([tool.pytest.ini_options]).
# Test processes: pytest-xdist workers, one per core up to 4; each notebook
# and each test file runs whole in one worker (--dist loadscope), the
# longest first (tests/conftest.py orders them by tests/durations.json,
# which `make bench-suite BENCH_ARGS=--write-durations` refreshes; without
# that option the file is left as it is). JOBS=1 runs everything in one
# process.
JOBS ?= $(shell n=$$(nproc 2>/dev/null || echo 1); [ $$n -gt 4 ] && n=4; echo $$n)
XDIST := $(if $(filter 1,$(JOBS)),,-n $(JOBS) --dist loadscope --no-loadscope-reorder)
# Each worker's kernels get their share of the cores: N workers that each
# start one math thread per core would oversubscribe the machine, and
# OpenMP threads waiting for a core slow small operations: with two spinning
# threads chapter 8 took 63.6 s against 16.1 s on one thread, its cell of
# many small tensors 44.7 s against 9.1 s (one run each, no interval, on
# 2026-11-25 on a shared 2-core Xeon; tools/check/test_portable.py).
# (Speed only: make test-portable proves that no digit depends on the thread
# count.)
SHARE := OMP_NUM_THREADS=$(shell n=$$(( $$(nproc 2>/dev/null || echo 1) / $(JOBS) )); [ $$n -lt 1 ] && n=1; echo $$n)
SHARE += MKL_NUM_THREADS=$(lastword $(subst =, ,$(firstword $(SHARE))))
SHARE += OPENBLAS_NUM_THREADS=$(lastword $(subst =, ,$(firstword $(SHARE))))

# make book EXECUTE=1: execute the notebooks for the site (see `book`)
EXECUTE ?=

.PHONY: help venv book html test test-portable test-notebooks test-code lint \
        outputs bench bench-suite screenshots linkcheck clean distclean

help:
	@echo "make book           create .venv, install, build _build/html from the stored outputs"
	@echo "                    (make test proves them); make book EXECUTE=1 executes every notebook"
	@echo "make test           lint, the site (warnings as errors), nbval (strict) on every chapter as"
	@echo "                    downloaded, tests/ with the browser test (Chromium) and R's output; a"
	@echo "                    missing Chromium or R skips those tests (and fails them under CI=true)"
	@echo "make test-portable  nbval again under generic CPU code paths and with two threads"
	@echo "                    (PORTABLE=generic or PORTABLE=two-threads: one variant)"
	@echo "make lint           ruff (code and notebooks), codespell (prose), check-jsonschema (CI files)"
	@echo "make outputs        re-execute notebooks and store their outputs (NB=book/... for one)"
	@echo "make bench          every chapter's benchmarks, timed by tools/measure.py (medians with 95 %"
	@echo "                    intervals where a program has at least 6 rounds, as ch08's matmul ceiling"
	@echo "                    may stop at: none for ch07's times, ch10's training, ch11's uncached"
	@echo "                    1,024 tokens, each run once, nor ch13's profile (5 calls under"
	@echo "                    torch.profiler); the machine and its load in every row); PART=name runs one"
	@echo "                    chapter's part: ch07 (training times), ch08 (attention programs, ablation,"
	@echo "                    tiles, two threads), ch10 (training, generation), ch11 (prefill, decode,"
	@echo "                    bandwidth, static cache, decode levers, batching, speculative decoding),"
	@echo "                    ch12 (decoding speed of each variant), ch13 (tiled forward and backward"
	@echo "                    against SDPA, ablation, profile, training), ch16 (compiled FlexAttention,"
	@echo "                    a compiled tiled forward, a compiled decoding step), ch17 (ring attention:"
	@echo "                    time per rank and split, overlap, peak memory); RUN=k appends the rows to the"
	@echo "                    tables with run = k (an independent repeat) instead of replacing them"
	@echo "make train          every chapter's full training (train-gpt, train-gpt-draft, train-variants, long-context,"
	@echo "                    train-positions, train-sentiment, train-additive, train-seq2seq, train-circuits): weights and logs in book/data/"
	@echo "make train-variants chapter 12's attention variants trained like chapter 10's GPT, two at a time"
	@echo "                    (JOBS_TRAIN=N): weights in book/data/variants/, logs in book/data/"
	@echo "make train-circuits chapter 15's induction models (1 and 2 layers, 3 seeds) and MQAR across chapter 12's"
	@echo "                    variants, one thread: weights in book/data/circuits/, logs in book/data/"
	@echo "make train-additive chapter 9's two models trained in full: weights and log in book/data/"
	@echo "make train-seq2seq  issue 37's encoder-decoder Transformer, once per position option, on chapter 9's"
	@echo "                    strings; every model and chapter 9's GRU on lengths 6-20 (book/data/seq2seq_lengths.csv)"
	@echo "make bench-suite    time each stage of the suite itself (site, nbval per chapter,"
	@echo "                    tests per file, portable variants); not a test. BENCH_ARGS=--write-durations"
	@echo "                    stores the per-file times in tests/durations.json; BENCH_ARGS='--install DIR'"
	@echo "                    also times a fresh install into a new venv in DIR (a folder that must not exist)"
	@echo "make mutants        plant each bug of tools/check/mutants/*.toml in a scratch copy and check that tests/"
	@echo "                    catches it (minutes; ONLY=id-or-prefix for some, JOBS=N at a time)"
	@echo "make screenshots    a PNG of every page, light and dark, in _build/screenshots/"
	@echo "make pdf            the whole book as one PDF in _build/pdf/ (needs Debian's chromium)"
	@echo "make linkcheck      check the external links of the pages (needs a network)"
	@echo "make test-notebooks / test-code   the nbval part / the tests/ part alone"
	@echo "make clean          remove _build and caches (make distclean also removes .venv)"
	@echo "JOBS=N              test processes (default: one per core, at most 4)"

# The virtual environment, rebuilt when requirements.txt changes. A missing
# Python 3.11 or venv module stops here with one line that says what to install.
$(STAMP): requirements.txt
	@test -x $(BIN)/python || { \
	  $(PYTHON) -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))' 2>/dev/null \
	    || { echo "make: Python 3.11 is needed (found: $(PYTHON)); install it (Debian: apt-get install python3.11), or run make PYTHON=/path/to/python3.11" >&2; exit 1; }; \
	  $(PYTHON) -c 'import ensurepip, venv' 2>/dev/null \
	    || { echo "make: Python's venv module is missing; install it with: apt-get install python3-venv" >&2; exit 1; }; \
	  $(PYTHON) -m venv $(VENV); }
	$(BIN)/python -m pip install -r requirements.txt
	@touch $@

venv: $(STAMP)

# Build the site from the notebooks' stored outputs (seconds; `make test`
# proves them reproducible), Sphinx warnings as errors. EXECUTE=1 executes
# every notebook first (Jupyter Book's cache: unchanged ones are reused from
# _build/.jupyter_cache), so the pages show outputs computed on this machine.
book: $(STAMP)
	$(BIN)/python tools/build/build_site.py $(if $(filter-out 0,$(EXECUTE)),--execute)

html: book

# The whole suite:
# - lint (ruff, codespell, the CI files' schemas);
# - the site, built from the stored outputs with Sphinx warnings as errors
#   (tools/build/build_site.py); every chapter's download zip unpacked into an
#   empty folder of its own (tools/build/stage_downloads.py);
# - one pytest run, so that it ends on one summary line: nbval in strict mode
#   on every chapter AS DOWNLOADED (every stored text output reproduced
#   exactly by a fresh kernel that has nothing but the zip's files), and
#   tests/: the chapters' own code, the site's pages (built, and opened in
#   Chromium), the zips, R's output against the book's.
test: lint
	$(BIN)/python tools/build/build_site.py
	$(BIN)/python tools/build/stage_downloads.py
	BOOK_SITE_BUILT=1 $(SHARE) $(BIN)/python -m pytest $(XDIST) \
		_build/downloads/*/*.ipynb tests

# The stored outputs again, under other CPU code paths (tools/check/test_portable.py):
# no printed digit may depend on the processor or the thread count.
# PORTABLE=generic runs one variant (what .ci/run runs on every push; the
# weekly CI job runs two-threads).
PORTABLE ?= generic two-threads
test-portable: $(STAMP)
	$(BIN)/python tools/check/test_portable.py --jobs $(JOBS) $(addprefix --only ,$(PORTABLE))

test-notebooks: $(STAMP)
	$(SHARE) $(BIN)/python -m pytest $(XDIST) $(NOTEBOOKS)

test-code: $(STAMP)
	$(SHARE) $(BIN)/python -m pytest $(XDIST) tests

# Style and spelling: ruff reads the notebooks natively; codespell reads the
# prose only (markdown cells and Markdown files); check-jsonschema validates
# the GitHub workflow and Dependabot files against their published schemas.
lint: $(STAMP)
	$(BIN)/ruff check
	$(BIN)/ruff format --check
	$(BIN)/python tools/check/spellcheck.py
	$(BIN)/check-jsonschema --builtin-schema vendor.github-workflows .github/workflows/*.yml
	$(BIN)/check-jsonschema --builtin-schema vendor.dependabot .github/dependabot.yml

# Re-execute notebooks top to bottom in a fresh kernel and store the outputs
# (no timestamps: a second run gives no diff).
outputs: $(STAMP)
	$(BIN)/python tools/check/refresh_outputs.py $(NB)

# The benchmarks, one part per chapter (the machine is shared: run them on a
# quiet one; each row records the load before and after and a `busy` flag).
# `make bench` runs every part; `make bench PART=ch11` one chapter's (or
# PART="ch08 ch13" some); `make bench PART=ch13 RUN=2` an independent repeat:
# the rows are appended to the tables with a `run` column (BENCH_RUN) instead
# of replacing them (repeats are separate invocations at different times).
# Every script times with tools/measure.py (interleaved rounds, medians and
# paired ratios with their 95 % intervals, the machine record). An interval
# needs at least 6 rounds: ch10, ch11 and ch12 run 7, ch08 at least 7 calls
# per program (at least 6 for its matmul ceiling), ch13 9 or 15 pairs; ch07's
# training times, ch10's training and ch11's uncached 1,024-token decode run
# once (seven runs would add about 5.5 minutes, 6 minutes of CPU and 3.5
# minutes) and print no interval, nor does ch13's profile (5 calls of each
# pass under torch.profiler).
# - ch07: chapter 7's training times (printed only; tools/bench/bench_sentiment.py);
# - ch08: chapter 8's median time, GFLOP/s and peak extra memory of each
#   attention program for T = 256 ... 4096, its ablation and tile sweep, and
#   the same at 4096 on two threads (23.5 minutes on 2026-12-07, 2-core
#   AMD EPYC, quiet: see CONTRIBUTING.md; then
#   `make outputs NB=book/08_efficient_attention.ipynb`);
# - ch10: chapter 10's training and generation times (tools/bench/bench_gpt.py);
# - ch11: chapter 11's prefill, decode, bandwidth, per-operation,
#   matmul-ceiling and generation times (tools/bench/bench_token_cost.py), its
#   static cache, decode levers and batching (tools/bench/bench_static.py) and
#   speculative decoding (tools/bench/bench_speculative.py);
# - ch12: chapter 12's greedy decoding speed of each attention variant with
#   its own cache (tools/bench/bench_variants.py);
# - ch13: chapter 13's tiled forward and backward against SDPA, its ablation,
#   where the time goes (a profile) and 200 steps of training through each
#   (tools/bench/bench_flash.py);
# - ch16: chapter 16's compiled FlexAttention (each kernel's compile time in
#   an empty inductor cache, its generated C++, its speed against SDPA and
#   chapter 8's tiled forward, compiled and not, on one thread and two,
#   where dynamo breaks that forward's graph, a profile) and a compiled
#   decoding step against chapter 11's best eager one
#   (tools/bench/bench_flex.py; 11 min 7 s wall, 699 s user CPU, on
#   2026-12-07 at a load of 1.0 to 1.8, measured once).
# - ch17: chapter 17's ring attention across processes: each rank's CPU time
#   per split, the overlap of sending and computing, and peak memory per
#   rank for T = 4096 ... 65536 (tools/bench/bench_ring.py; 124 s wall on
#   2026-12-08, measured once).
PART ?=
RUN ?=
BENCH_PARTS := ch07 ch08 ch10 ch11 ch12 ch13 ch16 ch17
BENCH_PY := $(if $(RUN),BENCH_RUN=$(RUN) )$(BIN)/python tools/bench
BENCH_ch07 := $(BENCH_PY)/bench_sentiment.py
BENCH_ch08 := $(BENCH_PY)/bench_attention.py && $(BENCH_PY)/bench_attention.py \
	--threads 2 --sizes 4096 --parts main --no-memory --no-plot \
	--csv book/data/bench_attention_2threads.csv
BENCH_ch10 := $(BENCH_PY)/bench_gpt.py
BENCH_ch11 := $(BENCH_PY)/bench_token_cost.py && $(BENCH_PY)/bench_static.py \
	&& $(BENCH_PY)/bench_speculative.py
BENCH_ch12 := $(BENCH_PY)/bench_variants.py
BENCH_ch13 := $(BENCH_PY)/bench_flash.py
BENCH_ch16 := $(BENCH_PY)/bench_flex.py
BENCH_ch17 := $(BENCH_PY)/bench_ring.py
bench: $(STAMP)
	@test -z "$(filter-out $(BENCH_PARTS),$(PART))" || { \
	  echo "make: unknown PART '$(filter-out $(BENCH_PARTS),$(PART))'; the parts: $(BENCH_PARTS)" >&2; exit 2; }
	$(foreach part,$(or $(PART),$(BENCH_PARTS)),$(BENCH_$(part)) && ) true

# Chapter 10's GPT, trained in full (G = 4 and G = 1): weights and log in book/data/.
.PHONY: train-gpt
train-gpt: $(STAMP)
	$(BIN)/python tools/train/train_gpt.py

# Chapter 11's losses past the training length, with attention sinks and with
# an 8-bit cache, from chapter 10's stored weights (41 s of CPU, user and
# system, one thread, measured once with /usr/bin/time on 2026-11-26 on the
# 2-core AMD EPYC; not stored): book/data/long_context.csv. Part of
# `make train`: it changes only
# when train-gpt changes the weights, and it times nothing.
.PHONY: long-context
long-context: $(STAMP)
	$(BIN)/python tools/train/long_context.py

# Chapter 11's draft model for speculative decoding: chapter 10's GPT with
# one layer, trained the same way on one thread (book/data/gpt_draft.pt and
# its log, CPU and wall seconds).
.PHONY: train-gpt-draft
train-gpt-draft: $(STAMP)
	$(BIN)/python tools/train/train_gpt_draft.py

# Chapter 6's four forward-fill models, trained in full on one thread:
# weights and log in book/data/ (the chapter loads them).
.PHONY: train-positions
train-positions: $(STAMP)
	$(BIN)/python tools/train/train_positions.py

# Chapter 9's two models (with and without attention) trained in full, on one
# thread: weights, log and a model description in book/data/
# (tools/train/train_additive.py; then make outputs NB=book/09_additive_attention.ipynb).
.PHONY: train-additive
train-additive: $(STAMP)
	$(BIN)/python tools/train/train_additive.py

# Issue 37's encoder-decoder Transformer (book/seq2seq.py), once per position
# option, on chapter 9's strings and split, one thread (tools/train/train_seq2seq.py):
# weights in book/data/seq2seq/, the log, each model's accuracy by length 6-20
# beside chapter 9's GRU (its stored weights: run after train-additive) and a
# model description in book/data/.
.PHONY: train-seq2seq
train-seq2seq: $(STAMP)
	$(BIN)/python tools/train/train_seq2seq.py

# Chapter 7's trainings in full (1000 or 300 epochs, one thread): weights and
# log in book/data/ (then `make outputs NB=book/07_sentiment.ipynb`).
.PHONY: train-sentiment
train-sentiment: $(STAMP)
	$(BIN)/python tools/train/train_sentiment.py

# Chapter 12's attention variants (book/variants.py's VARIANTS), each trained
# like chapter 10's GPT in a process of its own on one thread, JOBS_TRAIN at
# a time (tools/train/train_variants.py): weights in book/data/variants/, the log
# and a summary with each model's CPU and wall seconds in book/data/.
# Measured once, on 2026-11-26 on the 2-core AMD EPYC, 2 jobs on 2 cores
# shared with other work: 945.0 s of CPU for the ten models (75-151 s each).
# Seeds 1 and 2 of GQA, the window, MLA and the hybrid (book/variants.py's
# PAIRED; issue 46), measured once on 2026-12-07, 2 jobs on 2 cores at a
# load of 6 to 14: 909.7 s of CPU for the eight (102-141 s each; the
# elapsed time of the run was measured once and not stored: the eight
# wall_s add up to 5,245 s, two at a time); 1,855 s of CPU for all 18
# (book/data/variants_train.csv).
JOBS_TRAIN ?= 2
.PHONY: train-variants
train-variants: $(STAMP)
	$(BIN)/python tools/train/train_variants.py --jobs $(JOBS_TRAIN)

# Chapter 15's trainings on one thread (tools/train/train_circuits.py): the one-
# and two-layer attention-only models on the induction task (three seeds each)
# and chapter 12's variants on MQAR; weights in book/data/circuits/, logs in
# book/data/ (each model's CPU and wall seconds).
.PHONY: train-circuits
train-circuits: $(STAMP)
	$(BIN)/python tools/train/train_circuits.py

# Every training target, one after the other (chapters 6, 7 and 9 train on one
# thread and log their CPU and wall seconds; issue 46's budget: 60 minutes of CPU in
# all, 3 per model; about 2,660 s by the logs: see CONTRIBUTING.md).
.PHONY: train
train: train-gpt train-gpt-draft train-variants long-context train-positions train-sentiment train-additive train-seq2seq train-circuits

# The suite's own benchmark: the time of each stage (tools/bench/bench_suite.py).
# BENCH_ARGS=--write-durations also stores the per-file times in
# tests/durations.json (the order in which `make test` starts them);
# BENCH_ARGS='--install DIR' also times a fresh install into a new venv in
# DIR, a folder that must not exist yet (--install alone stops with a usage
# error).
bench-suite: $(STAMP)
	$(BIN)/python tools/bench/bench_suite.py --jobs $(JOBS) $(BENCH_ARGS)

# External links of the pages built from the stored outputs (needs a network).
linkcheck: $(STAMP)
	$(BIN)/python tools/build/build_site.py --linkcheck

# Needs Debian's chromium (apt-get install chromium); no browser is downloaded.
screenshots: html
	$(BIN)/python tools/build/screenshots.py

# The whole book as one PDF, _build/pdf/attention-from-scratch.pdf: the
# single-page HTML build printed by Debian's chromium (tools/build/build_pdf.py).
.PHONY: pdf
pdf: $(STAMP)
	$(BIN)/python tools/build/build_pdf.py

clean:
	rm -rf _build .pytest_cache .ruff_cache .hypothesis tests/__pycache__ book/__pycache__ \
	       tools/__pycache__ tools/*/__pycache__ _ext/__pycache__ book/.ipynb_checkpoints

distclean: clean
	rm -rf $(VENV)

# Mutation run (issue 31): each bug listed in tools/check/mutants/*.toml (a file per
# chapter or module) planted in a
# scratch copy of the book, one at a time; the tests/ of its chapter (of every
# chapter using it, for a shared module) must catch it. Minutes, so not part
# of `make test`; but a bug whose `find` no longer occurs exactly once stops
# this run before it starts (exit status 2, naming it), and `make test`
# fails on it first (tests/test_mutants_tool.py checks every `find`).
# ONLY=id-or-prefix runs some; JOBS=N runs N at a time.
.PHONY: mutants
mutants: $(STAMP)
	$(BIN)/python tools/check/mutants.py --jobs $(JOBS) $(if $(ONLY),--only $(ONLY))
