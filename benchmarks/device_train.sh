#!/usr/bin/env bash
# bench_train.py on an NVIDIA GPU lent by the `device` tool: the wheelhouse (built here), its install there, the run.
#
#   bash benchmarks/device_train.sh wheelhouse        # HERE, in the checkout the device tool sends (see below)
#   bash benchmarks/device_train.sh stamp             # HERE, again just before the calls if HEAD moved since
#   bash benchmarks/device_train.sh stage-a           # THERE, device call 1 (carry benchmarks/out/whl-a)
#   bash benchmarks/device_train.sh run SIZES [ARGS]  # THERE, device call 2.. (carry benchmarks/out/whl-b)
#   bash benchmarks/device_train.sh phases [ARGS]     # THERE, instead of `run`: bench_train_phases.py's memory matrix
#   bash benchmarks/device_train.sh headroom [ARGS]   # THERE: the same per train.memory_headroom (none, 0.05, 0.1, 0.25)
#   bash benchmarks/device_train.sh collect [DIR]     # THERE, after a `run ... --keep DIR`: its runs' evidence, $OUT/keep.tgz
#
# What the device machine is and what that implies (/work/.library/device/README.md and KINDS.md, 2026-11):
# - x86_64, one H100 (nvidia-h100-x1) or H200; nothing can be fetched there: every missing Python package travels
#   as a wheel. Its `python3` is Python 3.12.3 (/opt/torch/.venv, with torch, numpy, transformers 5.17, tokenizers,
#   safetensors, sentencepiece, protobuf, jinja2, pyyaml, rich, click, psutil, prometheus-client, matplotlib and
#   the CUDA 13 `nvidia-*` wheels), so the wheels are cp312 manylinux x86_64, not cp311 as on this machine.
#   Missing there: mlx, mlx-cuda-13, mlx-lm, and of the coordinator's dependencies pydantic (+ pydantic-core,
#   annotated-types, typing-inspection, typing-extensions>=4.16), asyncssh (+ cryptography, cffi, pycparser) and
#   structlog. `pip download` takes the versions this repository's .venv runs (mlx 0.32.4, mlx-lm 0.32.2, ...).
# - What travels in one call: the working tree plus the `carry` paths, 64 MiB in all. mlx-cuda-13's wheel is
#   85.6 MiB (libmlx.so alone is 79 MB compressed; xz -6 only gets the wheel to 67 MiB), so it is split in two
#   byte ranges: whl-a (part 1) travels in a first call, which copies it out of the tree to /tmp/bench-wheels;
#   whl-b (part 2 and every other wheel) in the next, which joins, checks the SHA-256 and installs. Files outside
#   the tree survive between calls only while the machine stays warm: 30 s after a call returns. So make call 2
#   right after call 1; if the machine went back in between, `run` says so and call 1 must be made again.
# - Install INTO python3's own environment (no `--target`/PYTHONPATH): the coordinator starts the calibration bench
#   and the ranks with PYTHONPATH set to its shipped worker dir (coordinator/run/calibrate.py, launch.py), so mlx must
#   import without PYTHONPATH; and libmlx.so finds the CUDA libraries through its RPATH
#   ($ORIGIN/../../nvidia/{cu13,cublas,cudnn,nccl,...}/lib), i.e. in the same site-packages as the image's
#   nvidia-* wheels. A machine is bare at every start, so this changes nothing beyond the lease.
# - Limits: 10 minutes a command, 30 minutes of device time for a session (a one-chip machine counts part or all of its
#   held time), a machine goes back after 30 minutes held, 2,000 characters a command, files back from $OUT: at most
#   8, 16 MiB each. bench_train.py rewrites its --json after every run, so a command stopped at its limit still
#   returns what it measured; keep each call's work well inside 10 minutes (S in one call, M in one or two).
# - The machine stays warm 30 s after each call: make the calls back to back; a new machine costs a start (minutes)
#   and repeats call 1.
#
# The device tool sends the checkout its session was started in (the lead's /work/main), so `wheelhouse` runs
# there; benchmarks/out/ is ignored by git (.gitignore), so the wheels are never committed and travel only when
# named in `carry`.
#
# The calls, exactly (tool `run`; nvidia-h100-x1 or nvidia-h200, one chip; timeout_s 600):
#   1. carry ["benchmarks/out/whl-a"]  command: bash benchmarks/device_train.sh stage-a
#   2. carry ["benchmarks/out/whl-b"]  command: bash benchmarks/device_train.sh run S --iters 30 --rounds 2 --dtype bfloat16 --keep /tmp/bench-keep --skip-preflight
#   3. carry ["benchmarks/out/whl-b"]  command: bash benchmarks/device_train.sh run M --iters 20 --rounds 2 --dtype bfloat16 --keep /tmp/bench-keep --skip-preflight --methods lora
#   4. carry ["benchmarks/out/whl-b"]  command: bash benchmarks/device_train.sh run M --iters 20 --rounds 2 --dtype bfloat16 --keep /tmp/bench-keep --skip-preflight --methods full
# Issue 25 (memory parity, variable-length rows), after call 1, one call each:
#   carry ["benchmarks/out/whl-b"]  command: METHODS=lora bash benchmarks/device_train.sh headroom --iters 8
#   carry ["benchmarks/out/whl-b"]  command: METHODS=full bash benchmarks/device_train.sh headroom --iters 8
#   carry ["benchmarks/out/whl-b"]  command: bash benchmarks/device_train.sh run S --shapes long,variable --methods lora --iters 30 --rounds 2 --dtype bfloat16 --keep /tmp/bench-keep --skip-preflight
#   carry ["benchmarks/out/whl-b"]  command: bash benchmarks/device_train.sh run S --shapes long,variable --methods full --iters 30 --rounds 2 --dtype bfloat16 --keep /tmp/bench-keep --skip-preflight
#   (then M the same way with --iters 20, one method per call; `--memory-headroom none` gives ours unbounded)
# Issue 25 (the prediction on long and variable rows, at the playbook's calibration budget of 60 s, bench_train.py's
# default since session 9; process times from that session's H100 lease), after call 1, one call per line:
#   carry ["benchmarks/out/whl-b"]  command: bash benchmarks/device_train.sh run S --shapes long,variable --methods lora --iters 40 --rounds 1 --dtype bfloat16 --keep /tmp/bench-keep --skip-preflight
#   carry ["benchmarks/out/whl-b"]  command: bash benchmarks/device_train.sh run S --shapes long,variable --methods full --iters 40 --rounds 1 --dtype bfloat16 --keep /tmp/bench-keep --skip-preflight
#   carry ["benchmarks/out/whl-b"]  command: bash benchmarks/device_train.sh run M --shapes long,variable --methods lora --iters 40 --rounds 1 --dtype bfloat16 --keep /tmp/bench-keep --skip-preflight
#   carry ["benchmarks/out/whl-b"]  command: bash benchmarks/device_train.sh run M --shapes long,variable --methods full --iters 40 --rounds 1 --dtype bfloat16 --keep /tmp/bench-keep --skip-preflight
#   (M LoRA's call took 404 s with the model built in it; an S cell ~60 s of ours + ~25 s of mlx-lm; M variable full
#   98 s + 54 s. `--calibration-budget 10` fits S and M in two calls but measured a different calibration: 4 of 8
#   cells missed the +-15% goal there. `--shapes bimodal` is a length set calibration was not tuned on.)
# Issue 25 (S variable full: calibration's processes against the rank's; session 10), after call 1, one call:
#   carry ["benchmarks/out/whl-b"]  command: bash benchmarks/device_train.sh install && python3 benchmarks/bench_train.py --sizes S --shapes variable --methods full --iters 40 --dtype bfloat16 --keep /tmp/bk --build-only && PYTHONPATH=. python3 benchmarks/probe_rank_vs_bench.py --model /tmp/bk/model-S --data /tmp/bk/data-S-variable --method full --batch 8 --steps 40 --rounds 2 --calib-budget 60 --kinds calib,bench+rr,bench,rank
#   (about 200 s; docs/benchmarks-history.md, session 10, says what it found and what to try next)
# Issue 25 (S variable full, session 12: placement, GPU clocks, 300-step processes), after call 1, one call:
#   carry ["benchmarks/out/whl-b"]  command: see docs/benchmarks-history.md, session 12 (the probe's kinds may end in
#   `@gpu`/`@far`/`@CPUS`; an `nvidia-smi --query-gpu=... -lms 250` beside it logs the GPU's clocks). The H200 lent
#   then was one NUMA node (16 vCPUs): `@far` is refused there, `@gpu` is every CPU.
# What a replica digest costs on the GPU (every 50 steps; outside the steps' times; the step after one took 0.12-0.19 s
# against 0.027 s in session 12, when it was a SHA256 of every byte read on the host), after call 1, one call:
#   carry ["benchmarks/out/whl-b"]  command: bash benchmarks/device_train.sh install && PYTHONPATH=. python3 benchmarks/bench_digest.py --sizes S,M --methods lora,full --rounds 3 --steps 12 --json $OUT/digest.json
#   (sha256 = the old digest, sums-device = the new one on the GPU, each with the step after it against a step with
#   none; the bench stops if the host's and the device's sums differ. Then the rank's own `digest_s`:
#   PYTHONPATH=. python3 benchmarks/probe_rank_vs_bench.py --model /tmp/bk/model-S --data /tmp/bk/data-S-variable --method full --batch 8 --steps 300 --rounds 2 --kinds rank
#   after the `--build-only` of the line above)
# (whl-b is carried again so that a call landing on a fresh machine fails with a clear "make call 1 again" instead
# of a missing-file error; `run` installs only when mlx is not importable yet. --keep lets call 4 reuse call 3's
# M model, about a minute to build; checkpoints and adapters are deleted after every run whatever --keep says.)
# Each `run` writes $OUT/bench-<label>.md, .json and .log (label: the sizes and any --methods/--shapes), which come
# back. The per-run `process_s` of call 2 tells whether calls 3 and 4 fit their 10 minutes; if not, fewer --iters.
# bfloat16 weights, as real fine-tunes load them (the CPU runs here use float32); both tools get the same files.
# --skip-preflight: preflight still runs and its findings are in the .log, but a check that fails on this unfamiliar
# machine (a Firecracker VM) does not cost the call; it changes nothing in the training measured.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/.." && pwd)"
OUTDIR="$REPO/benchmarks/out"
STAGE=/tmp/bench-wheels
PART_BYTES=$((46 * 1024 * 1024))
CUDA_WHEEL=mlx_cuda_13-0.32.4-py3-none-manylinux_2_35_x86_64.whl
WHEELS=(mlx==0.32.4 mlx-cuda-13==0.32.4 mlx-lm==0.32.2
        pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
        typing_extensions==4.16.0 asyncssh==2.24.1 cryptography==50.0.2 cffi==2.1.1 pycparser==3.12
        structlog==26.1.0)
PLATFORMS=(--platform manylinux_2_35_x86_64 --platform manylinux_2_34_x86_64 --platform manylinux_2_28_x86_64
           --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)

die() { echo "device_train.sh: $*" >&2; exit 1; }

stamp() {
    # The device's copy of the tree has no .git: the commit measured travels in whl-b (bench_train's BENCH_COMMIT).
    mkdir -p "$OUTDIR/whl-b"
    local commit; commit="$(git -C "$REPO" rev-parse --short HEAD)"
    [ -z "$(git -C "$REPO" status --porcelain --untracked-files=no)" ] || commit="$commit+dirty"
    echo "$commit" > "$OUTDIR/whl-b/COMMIT"
    echo "commit stamp: $commit"
}

wheelhouse() {
    local all="$OUTDIR/wheels-cp312"
    rm -rf "$OUTDIR/whl-a" "$OUTDIR/whl-b"
    mkdir -p "$all" "$OUTDIR/whl-a" "$OUTDIR/whl-b"
    stamp
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        "${PLATFORMS[@]}" -d "$all" "${WHEELS[@]}"
    [ -f "$all/$CUDA_WHEEL" ] || die "expected $CUDA_WHEEL in $all"
    # The install test: the same wheels, as pip on python 3.12 / x86_64 would take them (into a scratch target).
    local scratch; scratch="$(mktemp -d)"
    python3 -m pip install -q --no-index --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp "${PLATFORMS[@]}" --target "$scratch" "$all"/*.whl
    [ -f "$scratch/mlx/lib/libmlx.so" ] || die "the install test has no mlx/lib/libmlx.so"
    rm -rf "$scratch"
    (cd "$all" && sha256sum "$CUDA_WHEEL" > "$OUTDIR/whl-b/SHA256SUMS")
    split -b "$PART_BYTES" -d -a 1 "$all/$CUDA_WHEEL" "$OUTDIR/whl-a/$CUDA_WHEEL.part"
    mv "$OUTDIR/whl-a/$CUDA_WHEEL.part1" "$OUTDIR/whl-b/"
    [ ! -e "$OUTDIR/whl-a/$CUDA_WHEEL.part2" ] || die "the CUDA wheel split into more than two parts"
    for w in "$all"/*.whl; do
        [ "$(basename "$w")" = "$CUDA_WHEEL" ] || cp "$w" "$OUTDIR/whl-b/"
    done
    # What travels: each call's carry plus the tree, under 64 MiB.
    local tree; tree=$(cd "$REPO" && git ls-files -z | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1)
    for d in whl-a whl-b; do
        local size; size=$(du -sb "$OUTDIR/$d" | cut -f1)
        printf '%s: %d MiB (+ %d MiB of tracked files)\n' "$d" $((size / 1048576)) $((tree / 1048576))
        [ $((size + tree)) -lt $((62 * 1048576)) ] || die "$d plus the tree is too large for one call"
    done
    ls -l "$OUTDIR/whl-a" "$OUTDIR/whl-b"
}

stage_a() {
    [ -f "benchmarks/out/whl-a/$CUDA_WHEEL.part0" ] || die "carry benchmarks/out/whl-a with this call"
    mkdir -p "$STAGE"
    cp "benchmarks/out/whl-a/$CUDA_WHEEL.part0" "$STAGE/"
    ls -l "$STAGE"
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
    python3 --version
}

install() {
    if python3 -c 'import mlx.core as mx, mlx_lm, pydantic, asyncssh, structlog; assert mx.cuda.is_available()' \
        2>/dev/null; then
        return 0
    fi
    [ -f "$STAGE/$CUDA_WHEEL.part0" ] || die "no $STAGE/$CUDA_WHEEL.part0: this is a fresh machine; make call 1 (stage-a) again, then this one at once"
    [ -f "benchmarks/out/whl-b/$CUDA_WHEEL.part1" ] || die "carry benchmarks/out/whl-b with this call"
    cat "$STAGE/$CUDA_WHEEL.part0" "benchmarks/out/whl-b/$CUDA_WHEEL.part1" > "$STAGE/$CUDA_WHEEL"
    (cd "$STAGE" && sha256sum -c "$REPO/benchmarks/out/whl-b/SHA256SUMS")
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
        "$STAGE/$CUDA_WHEEL" benchmarks/out/whl-b/*.whl
    # Every library libmlx.so needs must resolve (through its RPATH, the image's nvidia-* wheels) before an import.
    local lib; lib="$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["platlib"])')/mlx/lib/libmlx.so"
    if ldd "$lib" | grep 'not found' >&2; then
        die "libmlx.so cannot find the libraries above (is this python the one with the nvidia-* wheels?)"
    fi
    python3 - <<'EOF'
import mlx.core as mx, mlx_lm
print("mlx", mx.__version__, "mlx-lm", mlx_lm.__version__, "cuda", mx.cuda.is_available(), mx.default_device())
print(mx.device_info())
a = mx.random.normal((1024, 1024))
print("matmul ok", float((a @ a).sum()) == float((a @ a).sum()))
EOF
    python3 -c 'import mlx.core as mx; assert mx.cuda.is_available()' || die "mlx is installed but does not see the GPU"
}

run_bench() {
    [ $# -ge 1 ] || die "usage: run SIZES [bench_train.py args]"
    local sizes="$1"; shift
    install
    local label="${sizes//,/}"
    local args=("$@")
    for ((i = 0; i < ${#args[@]}; i++)); do
        case "${args[$i]}" in --methods|--shapes) label="$label-${args[$((i + 1))]//,/}" ;; esac
    done
    local out="${OUT:-$REPO/benchmarks/out}"
    mkdir -p "$out"
    export PYTHONUNBUFFERED=1
    [ ! -f benchmarks/out/whl-b/COMMIT ] || export BENCH_COMMIT="$(cat benchmarks/out/whl-b/COMMIT)"
    set -o pipefail
    python3 benchmarks/bench_train.py --sizes "$sizes" "$@" --json "$out/bench-$label.json" \
        2> >(tee "$out/bench-$label.log" >&2) | tee "$out/bench-$label.md"
}

run_phases() {
    # bench_train_phases.py (peak memory of each phase, ours vs mlx-lm's trainer) once per `--clear-cache`
    # setting, LoRA and full: whether clearing the allocator cache every step (mlx-lm's trainer does) is what
    # makes mlx-lm's GPU peak lower. Extra args go to every run (e.g. --iters 8).
    install
    local out="${OUT:-$REPO/benchmarks/out}"
    mkdir -p "$out"
    export PYTHONUNBUFFERED=1 PYTHONPATH="$REPO"
    set -o pipefail
    for method in lora full; do
        for clear in default never every-step; do
            echo "### $method, --clear-cache $clear"
            python3 benchmarks/bench_train_phases.py --size S --method "$method" --clear-cache "$clear" \
                --keep /tmp/phases-keep "$@" 2>&1 | tee -a "$out/phases.log" | tail -40
        done
    done
}

run_headroom() {
    # bench_train_phases.py per step, ours under each train.memory_headroom (none = unbounded, ours before issue 25)
    # and mlx-lm as shipped, LoRA and full (METHODS="lora" for one), S long rows: each step's peak and time with
    # and without the bound.
    install
    local out="${OUT:-$REPO/benchmarks/out}"
    mkdir -p "$out"
    export PYTHONUNBUFFERED=1 PYTHONPATH="$REPO"
    set -o pipefail
    for method in ${METHODS:-lora full}; do
        echo "### $method, mlx-lm"
        python3 benchmarks/bench_train_phases.py --size S --method "$method" --tools mlx_lm \
            --keep /tmp/phases-keep "$@" 2>&1 | tee -a "$out/headroom.log" | tail -20
        for headroom in none 0.05 0.1 0.25; do
            echo "### $method, ours, memory_headroom $headroom"
            python3 benchmarks/bench_train_phases.py --size S --method "$method" --tools ours \
                --memory-headroom "$headroom" --keep /tmp/phases-keep "$@" 2>&1 | tee -a "$out/headroom.log" | tail -20
        done
    done
}

collect() {
    # The evidence of the runs a `run ... --keep DIR` left (DIR, default /tmp/bench-keep): every run's events,
    # plan and summary, the calibration cache's bench results (each point's per-step `sample`) and the data, as
    # $OUT/keep.tgz; never the models, checkpoints or kernels. For holding a run's steps against calibration's.
    local keep="${1:-/tmp/bench-keep}" out="${OUT:-$REPO/benchmarks/out}"
    [ -d "$keep" ] || die "no $keep: run with --keep $keep first (on this machine, while it is warm)"
    mkdir -p "$out"
    (cd "$keep" && find . -path './model-*' -prune -o -type f \( -name '*.json' -o -name '*.jsonl' \
        -o -name '*.yaml' -o -name '*.log' \) -size -8M -print0 | tar czf "$out/keep.tgz" --null -T -)
    ls -l "$out/keep.tgz"
}

cd "$REPO"
case "${1:-}" in
    wheelhouse) wheelhouse ;;
    stamp) stamp ;;
    stage-a) stage_a ;;
    install) install ;;
    run) shift; run_bench "$@" ;;
    phases) shift; run_phases "$@" ;;
    headroom) shift; run_headroom "$@" ;;
    collect) shift; collect "$@" ;;
    *) die "usage: $0 wheelhouse | stamp | stage-a | install | run SIZES [bench_train.py args] | phases [ARGS] | headroom [ARGS] | collect [DIR]" ;;
esac
