#!/usr/bin/env bash
# The GPU checks of issue 21 in one command (docs/gpu.md says what each prints).
#
#   scripts/gpu-check.sh --prepare   # here, once, where pip reaches PyPI: hetflow's wheel and the wheels
#                                    # the GPU machine lacks (Python 3.12, x86-64) into .whl/ and the
#                                    # largest of them into .whl-big/ (both git-ignored): together they
#                                    # are over the 64 MiB one device call carries, so a first call
#                                    # carries .whl-big (command `true`) and the next, on the same warm
#                                    # machine, carries .whl and runs the checks (docs/gpu.md)
#   scripts/gpu-check.sh             # on the GPU machine, with .whl carried: a venv over the machine's
#                                    # PyTorch/CUDA, hetflow installed --no-deps from .whl, then the checks
#   scripts/gpu-check.sh --dry-run   # on a machine without a GPU: the same steps with this checkout's
#                                    # .venv, on CPU, so everything up to the CUDA calls is known to work;
#                                    # with IMAGE_PY=.venv/bin/python (and wheels prepared with
#                                    # DEVICE_PYTHON=3.11) it also rehearses the device's install
#
# The checks: the CUDA tests of the loader and the vendor tests (pytest), benchmarks/ml.py on the
# device (training and inference against plain PyTorch, copy rate against the pinned limit), and
# scripts/gpu_check_pipeline.py (photo-z train and predict on the GPU through hetflow), and
# scripts/gpu_check_warm.py (one-rank GPU stages forked warm by the fork server, torch on the GPU, each
# seeing exactly its slot's GPUs).  Everything printed goes to files under $OUT (the device tool's
# result folder; ./gpu-check-out by default): env.txt, tests.txt, bench-ml.txt, bench-ml.json,
# pipeline.txt, pipeline.json, warm.txt, warm.json, summary.txt.
# Exit status: 0 when every step passed.
set -uo pipefail
cd "$(dirname "$0")/.."
MODE=${1:-run}
WHEELS=${WHEELS:-.whl}  # relative: inside the checkout, so the device tool can carry it
DEVICE_PYTHON=${DEVICE_PYTHON:-3.12}  # the GPU machine's python3 (its image: /opt/torch/.venv, 3.12)
# What the GPU machine's image lacks of hetflow's dependencies (docs/gpu.md); one version of each.
DEPS=("mpi4py==4.1.2" "mpich==5.0.2" "sqlalchemy==2.1.9" "duckdb==2.0.1" "polars==2.1.0")
BIG_DEPS=("polars-runtime-32==2.1.0")  # 54 MB alone: carried by a call of its own
BIG=${WHEELS%/}-big

prepare() {
    local exclude py=${PYTHON:-.venv/bin/python}
    if [ "${WHEELS#/}" = "$WHEELS" ]; then  # in the checkout: keep it out of git
        exclude=$(git rev-parse --git-path info/exclude)
        grep -qxF "/$WHEELS/" "$exclude" 2>/dev/null || echo "/$WHEELS/" >>"$exclude"
    fi
    if [ "${WHEELS#/}" = "$WHEELS" ]; then
        grep -qxF "/$BIG/" "$exclude" 2>/dev/null || echo "/$BIG/" >>"$exclude"
    fi
    rm -rf "$WHEELS" "$BIG" && mkdir -p "$WHEELS" "$BIG"
    "$py" -m pip wheel --no-deps --no-build-isolation -q -w "$WHEELS" . || return 1
    local platforms=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
    "$py" -m pip download -q --no-deps --only-binary=:all: --python-version "$DEVICE_PYTHON" \
        --implementation cp "${platforms[@]}" -d "$WHEELS" "${DEPS[@]}" || return 1
    "$py" -m pip download -q --no-deps --only-binary=:all: --python-version "$DEVICE_PYTHON" \
        --implementation cp "${platforms[@]}" -d "$BIG" "${BIG_DEPS[@]}" || return 1
    ls -l "$WHEELS" "$BIG"
    du -sh "$WHEELS" "$BIG"
}

case "$MODE" in
    --prepare) prepare; exit $? ;;
    --dry-run) DEVICE=cpu ;;
    run) DEVICE=cuda ;;
    *) echo "usage: scripts/gpu-check.sh [--prepare | --dry-run]" >&2; exit 2 ;;
esac

OUT=${OUT:-$PWD/gpu-check-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XDG_RUNTIME_DIR=${XDG_RUNTIME_DIR:-/tmp/hetflow-gpu-check-xdg}
mkdir -p -m 0700 "$XDG_RUNTIME_DIR"
WORK=$(mktemp -d /tmp/hetflow-gpu-check.XXXXXX)
status=0
step() {  # step NAME LOGFILE COMMAND...: run it, keep its output, remember a failure
    local name=$1 log=$2; shift 2
    echo "== $name: $*" | tee -a "$OUT/summary.txt"
    local start=$SECONDS
    "$@" >"$log" 2>&1
    local rc=$?
    echo "   exit $rc after $((SECONDS - start)) s; last lines:" >>"$OUT/summary.txt"
    tail -n 15 "$log" | sed 's/^/   | /' >>"$OUT/summary.txt"
    [ "$rc" -eq 0 ] || status=1
    return "$rc"
}
: >"$OUT/summary.txt"

# On the GPU machine (and in a dry run given IMAGE_PY): hetflow and the carried wheels go into a
# fresh venv, never into the image.  The image's python3 is itself a venv, whose packages a nested
# `venv --system-site-packages` would not see: the new venv adds the image's site-packages after
# its own (a .pth), and the wheels are installed into the new venv, so that the mpich wheel's
# mpiexec and libmpi land where hetflow and mpi4py look (beside the venv's python, its lib/).
IMAGE_PY=${IMAGE_PY:-$([ "$DEVICE" = cuda ] && echo python3)}
if [ -n "$IMAGE_PY" ]; then
    if ! ls "$WHEELS"/hetflow-*.whl >/dev/null 2>&1; then
        echo "no $WHEELS/hetflow-*.whl: run scripts/gpu-check.sh --prepare first and carry $WHEELS" | tee "$OUT/summary.txt" >&2
        exit 2
    fi
    if ! ls "$BIG"/*.whl >/dev/null 2>&1; then
        echo "no $BIG/*.whl: carry $BIG in a call of its own just before this one, on the same warm machine" \
            | tee "$OUT/summary.txt" >&2
        exit 2
    fi
    install() {
        local site
        site=$("$IMAGE_PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])') || return 1
        "$IMAGE_PY" -m venv --without-pip "$WORK/venv" || return 1
        "$WORK/venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])' >"$WORK/purelib" || return 1
        echo "import site; site.addsitedir('$site')" >"$(cat "$WORK/purelib")/zz-image-site-packages.pth"
        # the venv's own python runs the image's pip: it installs into the venv; --ignore-installed so
        # that a package the image also has (mpi4py) is installed here and nothing there is uninstalled
        "$WORK/venv/bin/python" -m pip install --ignore-installed --no-index --no-deps --no-compile \
            --no-cache-dir "$WHEELS"/*.whl "$BIG"/*.whl || return 1
        ls "$WORK/venv/bin"
        "$WORK/venv/bin/python" -c 'import hetflow, mpi4py, sqlalchemy, torch, polars, duckdb
from mpi4py import MPI
print("hetflow from", hetflow.__file__, "| mpi4py from", mpi4py.__file__, "|", MPI.Get_library_version().splitlines()[0])'
    }
    step "venv over $IMAGE_PY with the carried wheels" "$OUT/env.txt" install || exit 1
    PY=$WORK/venv/bin/python
else
    PY=$PWD/.venv/bin/python
fi

{
    echo "--- machine"; uname -a; nproc; date -u
    command -v nvidia-smi >/dev/null && nvidia-smi
    "$PY" - <<'EOF'
import sys, torch, pyarrow, numpy, mpi4py, hetflow
from hetflow.tasks.gpu import detect_gpus
print("python", sys.version.split()[0], "| torch", torch.__version__, "| cuda", torch.version.cuda,
      "| available", torch.cuda.is_available(), "| pyarrow", pyarrow.__version__, "| numpy", numpy.__version__,
      "| mpi4py", mpi4py.__version__, "| hetflow", hetflow.__file__)
if torch.cuda.is_available():
    print("device", torch.cuda.get_device_name(0), torch.cuda.get_device_properties(0))
    print("nccl", torch.cuda.nccl.version())
print("hetflow detects", detect_gpus())
EOF
} >>"$OUT/env.txt" 2>&1

STEPS=${STEPS:-warm tests bench pipeline}  # a subset makes a shorter run
wants() { case " $STEPS " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }

wants tests && step "CUDA loader tests and GPU-vendor tests" "$OUT/tests.txt" \
    "$PY" -m pytest -q -p no:cacheprovider tests/ml/test_loader_cuda.py tests/test_gpu_vendor.py \
    tests/ml/test_loader_device.py -rs

# seconds: the fork server imports torch with no GPU visible and forks the GPU stages (docs/hpc.md)
wants warm && step "one-rank GPU stages started warm by the fork server ($DEVICE)" "$OUT/warm.txt" \
    "$PY" scripts/gpu_check_warm.py --device "$DEVICE" --workdir "$WORK/warm" --out "$OUT/warm.json"

if [ "$DEVICE" = cuda ]; then
    wants bench && step "benchmarks/ml.py on the GPU" "$OUT/bench-ml.txt" \
        "$PY" benchmarks/ml.py --device cuda --out "$OUT/bench-ml.json"
    wants pipeline && step "photo-z train and predict on the GPU through hetflow" "$OUT/pipeline.txt" \
        "$PY" scripts/gpu_check_pipeline.py --device cuda --workdir "$WORK/photoz" --out "$OUT/pipeline.json"
    # not in the default steps: STEPS=profile (where fit's and predict's host time goes, cProfile)
    wants profile && step "cProfile of hf.ml.fit and predict on the GPU" "$OUT/profile.txt" \
        "$PY" benchmarks/ml.py --device cuda --epochs 2 --profile "$OUT/profile"
else
    wants bench && step "benchmarks/ml.py (dry run: --quick on CPU)" "$OUT/bench-ml.txt" \
        "$PY" benchmarks/ml.py --device cpu --quick --out "$OUT/bench-ml.json"
    wants pipeline && step "photo-z pipeline (dry run: CPU, a declared GPU)" "$OUT/pipeline.txt" \
        "$PY" scripts/gpu_check_pipeline.py --device cpu --rows 20000 --epochs 4 --workdir "$WORK/photoz" \
        --out "$OUT/pipeline.json"
fi
echo "== done: $([ $status -eq 0 ] && echo 'every step passed' || echo 'a step FAILED') (device $DEVICE)" \
    | tee -a "$OUT/summary.txt"
rm -rf "$WORK"
exit $status
