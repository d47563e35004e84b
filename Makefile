# hetflow: `make demo` and `make test` work on a fresh machine with Python 3.10+ and a C compiler.
# Both create .venv when missing and install everything into it (idempotent).

PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.hetflow-installed
EXTRAS ?= ml,mpich,dask,radical,parsl,postgres,dev
# the MPI test sizes: 1, 2 and an odd size
MPI_SIZES ?= 1 2 3
PYTEST_MPI = $(BIN)/python -m pytest -m mpi -q -p no:cacheprovider

.PHONY: install demo test test-serial test-mpi bench clean

install: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip setuptools wheel
	$(BIN)/python -m pip install -q -c constraints.txt -e '.[$(EXTRAS)]'
	@touch $(STAMP)

demo: $(STAMP)
	$(BIN)/hetflow run examples/photoz/pipeline.py --no-progress
	$(BIN)/hetflow status --json

test: test-serial test-mpi

test-serial: $(STAMP)
	$(BIN)/python -m pytest -m "not mpi" tests

test-mpi: $(STAMP)
	@for n in $(MPI_SIZES); do \
	  echo "== mpiexec -n $$n pytest -m mpi"; \
	  $(BIN)/mpiexec -n $$n $(PYTEST_MPI) tests || { rc=$$?; [ $$rc -eq 5 ] || exit $$rc; }; \
	done

bench: $(STAMP)
	$(BIN)/python benchmarks/operators.py
	$(BIN)/python benchmarks/scheduler.py
	$(BIN)/python benchmarks/backends.py --tasks 20

clean:
	rm -rf .hetflow build dist *.egg-info
