# hetflow: `make demo` and `make test` work on a fresh machine with Python 3.10+ and a C compiler.
# Both create .venv when missing and install everything into it (idempotent).

PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.hetflow-installed
EXTRAS ?= ml,mpich,dask,radical,parsl,postgres,docs,dev
# the MPI test sizes: 1, 2 and an odd size
MPI_SIZES ?= 1 2 3
PYTEST_MPI = $(BIN)/python -m pytest -m mpi -q -p no:cacheprovider
# then the representative subset marked mpi5 at 5 ranks.  At 3 and 5 ranks there are more ranks than CI has
# cores: MPICH's progress loop sleeps (usleep(1)) after polls that find nothing, so a waiting rank gives its core
# to one that computes instead of spinning through its time slice.  Every size runs so: without it one spill
# join in the 3-rank pass on 2 cores took 112 s once (9.5 s at 1 rank), and that pass 392 s; the spill-join
# tests alone at 3 ranks take 7.2 s with it, 10.5 s without.
MPI_ENV = MPIR_CVAR_CH4_PROGRESS_THROTTLE=1 MPIR_CVAR_CH4_PROGRESS_THROTTLE_NO_PROGRESS_COUNT=64

.PHONY: install bytecode demo docs test test-serial test-mpi compiled test-compiled bench clean

install: $(STAMP) bytecode

$(STAMP): pyproject.toml constraints.txt
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip setuptools wheel
	$(BIN)/python -m pip install -q -c constraints.txt -e '.[$(EXTRAS)]'
	@touch $(STAMP)

# hetflow's own bytecode, beside its sources: an editable install writes none, and where PYTHONDONTWRITEBYTECODE=1
# is set (as on this project's machines) every hetflow process would compile what it imports at each start
# (docs/benchmarks.md, "Bytecode"); a file already compiled and unchanged is skipped
bytecode: $(STAMP)
	$(BIN)/python -m compileall -q pipeline tasks operators ml

demo: $(STAMP) bytecode
	$(BIN)/hetflow run examples/photoz/pipeline.py --no-progress
	$(BIN)/hetflow status --json

test: docs test-serial test-mpi test-compiled

# In parallel (pytest-xdist): -n auto is one worker per CPU and one more, capped; what must not run
# concurrently shares a group (tests/conftest.py): a file, tests/slurm/, the RP files.
test-serial: $(STAMP) bytecode
	$(BIN)/python -m pytest -m "not mpi" -n auto --dist loadfile --durations=15 tests

test-mpi: $(STAMP) bytecode
	@for n in $(MPI_SIZES); do \
	  echo "== mpiexec -n $$n pytest -m mpi"; \
	  $(MPI_ENV) $(BIN)/mpiexec -n $$n $(PYTEST_MPI) tests || { rc=$$?; [ $$rc -eq 5 ] || exit $$rc; }; \
	done
	@echo "== mpiexec -n 5 pytest -m 'mpi and mpi5' (oversubscribed)"
	$(MPI_ENV) $(BIN)/mpiexec -n 5 $(PYTEST_MPI) -m "mpi and mpi5" --durations=5 tests

# The docs site (mkdocs.yml, docs/): warnings are errors; the CLI reference is generated from the parser
# and the API reference from the docstrings at build time (scripts/docs_hooks.py, mkdocstrings).
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir build/site

# The scheduler compiled with mypyc (setup.py) into build/compiled, beside the editable
# pure-Python install; PYTHONPATH=build/compiled selects it.
compiled: $(STAMP)
	rm -rf build
	HETFLOW_COMPILE=1 $(BIN)/python -m pip install -q --no-build-isolation --no-deps --target build/compiled .

# the scheduler's tests again, against the compiled build
test-compiled: compiled
	PYTHONPATH=build/compiled $(BIN)/python -c "from hetflow.tasks.simulator import scheduler_build as b; assert b() == 'mypyc', b()"
	PYTHONPATH=build/compiled $(BIN)/python -m pytest -q -p no:cacheprovider \
	  tests/test_scheduler.py tests/test_scheduler_invariants.py tests/test_simulator.py

bench: $(STAMP)
	$(BIN)/python benchmarks/operators.py
	$(BIN)/python benchmarks/scheduler.py
	$(BIN)/python benchmarks/backends.py --tasks 20
	$(BIN)/python benchmarks/ml.py

clean:
	rm -rf .hetflow build dist *.egg-info
