# The two README commands. Each bootstraps the same venv.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# The CPU wheel that lies on disk here; on a machine that already has torch, nothing is replaced.
TORCH  ?= torch==2.13.0
DFLASH_REF ?= dflash==0.1.0

.PHONY: test lint demo venv clean

venv: $(STAMP)

$(STAMP): pyproject.toml trainer/requirements.txt Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q --disable-pip-version-check "$(TORCH)"
	$(PY) -m pip install -q --disable-pip-version-check -e '.[train,test]'
	# The DFlash reference implementation, for the export parity test. --no-deps: its model code
	# needs only torch and transformers (here already); its own pins would pull datasets & co.
	$(PY) -m pip install -q --disable-pip-version-check --no-deps "$(DFLASH_REF)"
	touch $(STAMP)

# ruff (pinned in the test extra, configured in pyproject.toml): pyflakes and pycodestyle, lines up
# to 120 columns. Only checks: nothing here rewrites or reformats the tree.
lint: $(STAMP)
	$(PY) -m ruff check .

# Lint first, then two pytest workers, one test file each at a time (module fixtures stay within one
# worker): the suite waits on sshd, subprocesses and torch start-ups more than it computes.
test: lint
	$(PY) -m pytest -q -p no:cacheprovider -n 2 --dist loadfile tests

demo: $(STAMP)
	PATH="$(abspath $(VENV))/bin:$$PATH" bash scripts/demo.sh

clean:
	rm -rf $(VENV) build *.egg-info
