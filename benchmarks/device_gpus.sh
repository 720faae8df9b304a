#!/usr/bin/env bash
# Issue 27 on the lent 2x H100 host (device kind nvidia-h100-x2), after benchmarks/device_train.sh's wheelhouse.
# The device tool sends the lead's checkout; this branch's files travel under .dev27 (see docs/benchmarks.md):
#   call 1: carry .dev27/benchmarks/out/whl-a                      bash .dev27/benchmarks/device_gpus.sh stage
#   call 2: carry code + .dev27/benchmarks/out/whl-b               bash .dev27/benchmarks/device_gpus.sh checks
#   call 3: same carry                                             bash .dev27/benchmarks/device_gpus.sh bench [WHAT]
#   (a second lease: stage, then `fsdp` (install, fsdp runs, kill drills), then `bench lora1,lora2,full1,full2`)
# Session 3 (issue 27's rest), after `stage`:
#   call 2: carry .dev27 code dirs + .dev27/benchmarks/out/whl-b   bash .dev27/benchmarks/device_gpus.sh goals
#           (fsdp vs dp full and LoRA with each step's peak per rank; strong and weak scaling against one GPU)
#   call 3: same carry                                              bash .dev27/benchmarks/device_gpus.sh drills
#           (attach + stop on a running 2-rank launch; the old layout's NCCL `invalid usage`; kill, quarantine,
#           a fresh launch, quarantine clear)
# Session 4 (2026-11-27), after `stage`, same carry:
#   bash benchmarks/device_gpus.sh drills fsdpckpt     (fsdp's sharded checkpoints: kill, export, resume)
#   python3 benchmarks/bench_gpus.py dpstep --out $OUT --model /tmp/bench-gpus/model-M --steps 8 --batch 8 --seq 512
#   GOALS_S=360 ITERS=12 bash benchmarks/device_gpus.sh goals full1,full2w,lora1,lora2w
# Everything lands in $OUT (at most 8 files come back). NCCL_NVLS_ENABLE=0 throughout (the machine's rule).
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/.." && pwd)"
OUT="${OUT:-/tmp/out}"
mkdir -p "$OUT"
cd "$REPO"
export PYTHONPATH="$REPO"
case "${1:-}" in
  stage)
    bash benchmarks/device_train.sh stage-a
    nvidia-smi topo -m > "$OUT/topo.txt" 2>&1; cat "$OUT/topo.txt" ;;
  checks)
    bash benchmarks/device_train.sh install > "$OUT/install.log" 2>&1 || { tail -30 "$OUT/install.log"; exit 1; }
    { python3 -c 'import mlx.core as mx, mlx_lm; print("mlx", mx.__version__, "mlx-lm", mlx_lm.__version__)'
      nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader; } > "$OUT/versions.txt"
    timeout 120 python3 benchmarks/bench_gpus.py stream --out "$OUT" 2>&1 | tail -20
    printf 'defaults:\n  connection: local\nnodes:\n  - name: h100\n    workdir: /tmp/nt\n' > /tmp/nt.yaml
    timeout 200 python3 -m coordinator nettest -i /tmp/nt.yaml --json > "$OUT/nettest.json" 2> "$OUT/nettest.err"
    tail -c 1500 "$OUT/nettest.json"; tail -5 "$OUT/nettest.err"
    timeout 330 python3 benchmarks/bench_gpus.py launch --out "$OUT" --root /tmp/bench-gpus --what lora2,kill \
        --iters 20 2>&1 | tail -5
    timeout 200 python3 benchmarks/bench_gpus.py fsdp --out "$OUT" --model /tmp/bench-gpus/model-M --steps 3 \
        2>&1 | tail -40 ;;
  fsdp)
    bash benchmarks/device_train.sh install > "$OUT/install.log" 2>&1 || { tail -30 "$OUT/install.log"; exit 1; }
    timeout 200 python3 benchmarks/bench_gpus.py launch --out "$OUT" --root /tmp/bench-gpus --what fsdp2 \
        --iters 20 2>&1 | tail -3
    timeout 150 python3 benchmarks/bench_gpus.py fsdp --out "$OUT" --model /tmp/bench-gpus/model-M --steps 3 \
        2>&1 | tail -30
    mv "$OUT/launch.json" "$OUT/launch-fsdp.json"
    timeout 240 python3 benchmarks/bench_gpus.py launch --out "$OUT" --root /tmp/bench-gpus --what "${2:-kill,killfsdp}" \
        --iters 20 2>&1 | tail -3 ;;
  peaks)
    bash benchmarks/device_train.sh install > "$OUT/install.log" 2>&1 || { tail -30 "$OUT/install.log"; exit 1; }
    timeout 150 python3 benchmarks/bench_gpus.py launch --out "$OUT" --root /tmp/bench-gpus --what "" 2>&1 | tail -2
    timeout 200 python3 benchmarks/bench_gpus.py fsdp --out "$OUT" --model /tmp/bench-gpus/model-M --steps 4 \
        2>&1 | grep -v '^ ' | tail -5
    python3 -c 'import json,sys; [print(x.get("rank"), {k: (v["peak_bytes"], v["active_bytes"], [round(l, 5) for l in v["losses"]]) for k, v in x.items() if isinstance(v, dict)}) for x in json.load(open(sys.argv[1]))]' "$OUT/fsdp.json" ;;
  bench)
    timeout 560 python3 benchmarks/bench_gpus.py launch --out "$OUT" --root /tmp/bench-gpus \
        --what "${2:-lora1,full2}" --iters 20 2>&1 | tail -5
    python3 - "$OUT/launch.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
for k, v in r.items():
    if isinstance(v, dict):
        print(k, v.get("rc"), (v.get("summary") or {}).get("state"), [(x["rank"], x["total_tok_per_s_median"], x["peak_memory"]) for x in v.get("ranks", [])])
PY
    ;;
  goals)
    bash benchmarks/device_train.sh install > "$OUT/install.log" 2>&1 || { tail -30 "$OUT/install.log"; exit 1; }
    timeout "${GOALS_S:-560}" python3 benchmarks/bench_gpus.py launch --out "$OUT" --root /tmp/bench-gpus \
        --what "${2:-fsdp2,full2,lorafsdp2,lora2e,lora1,lora2w,full1,full2w}" --iters "${ITERS:-12}" 2>&1 | tail -4
    python3 - "$OUT/launch.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
for k, v in r.items():
    if isinstance(v, dict):
        print(k, v.get("rc"), v.get("process_s"), (v.get("summary") or {}).get("state"))
        for x in v.get("ranks", []):
            print("  ", x["node"], x["rank"], x["total_tok_per_s_median"], [round((p or 0) / 1e9, 2) for p in x.get("peaks", [])],
                  [round(l, 4) for l in x["losses"] if l is not None][:6], x["errors"][:1])
PY
    ;;
  drills)
    bash benchmarks/device_train.sh install > "$OUT/install.log" 2>&1 || { tail -30 "$OUT/install.log"; exit 1; }
    timeout "${DRILLS_S:-560}" python3 benchmarks/bench_gpus.py drills --out "$OUT" --root /tmp/bench-gpus \
        --what "${2:-invalid,attach,quarantine}" 2>&1 | tail -4
    python3 -c 'import json,sys; print(json.dumps(json.load(open(sys.argv[1])), indent=1)[:9000])' "$OUT/drills.json" ;;
  *) echo "usage: $0 stage|checks|fsdp|peaks|bench|goals|drills [WHAT]" >&2; exit 2 ;;
esac
