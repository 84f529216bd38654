#!/usr/bin/env bash
# Reproduce everything under docs/benchmarks/ on one machine (holds the vLLM lock throughout so
# no other vLLM run overlaps, and so the router-overhead and transfer numbers see a quiet machine).
#   bash docs/benchmarks/run_all.sh            # full run (about 110 min on the 2-core machine;
#                                              # the GPU profile's fit is separate: see README.md)
#   SMOKE=1 bash docs/benchmarks/run_all.sh    # tiny sweep into /tmp/bench-smoke (~5 min)
#   SPEED=1 bash docs/benchmarks/run_all.sh    # the router/connector speed numbers, one run, into
#                                              # docs/benchmarks/speed (~20 min on the 2-core machine)
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=docs/benchmarks
SWEEP=(--input-lens 512,2048,8192 --fractions 0.3,0.6,0.9,1.2 --repetitions 2 --output-len 64 --point-time-limit 120)
OVERHEAD=(--rates 100,250,500 --seconds-per-rate 6 --saturation-requests 3000 --saturation-rounds 3)
TRANSFER=(--iterations 50 --rounds 3)
ROUTING=()
PINNED=()
VLLM_SERVE=()   # vLLM's own client with vLLM's push vs pull recipe (the command's defaults)
if [[ "${SPEED:-0}" == 1 ]]; then
  # Overhead, the three transfer shapes, ours against aggregated at light and loaded points of every
  # input length (the TTFT breakdown), and the same at 8192 tokens with one core per instance.
  OUT=docs/benchmarks/speed
  SWEEP=(--stacks ours,aggregated --input-lens 512,2048,8192 --fractions 0.3,0.9 --repetitions 2
         --output-len 64 --point-time-limit 120)
  PINNED=(--stacks ours,aggregated --input-lens 8192 --fractions 0.3,0.9 --repetitions 2
          --output-len 64 --point-time-limit 120 --pin-processes)
fi
if [[ "${SMOKE:-0}" == 1 ]]; then
  OUT=/tmp/bench-smoke
  SWEEP=(--input-lens 512 --fractions 0.5,1 --light-fraction 0.5 --loaded-fraction 1 --capacity-requests 4
         --min-requests 3 --max-requests 3 --output-len 16)
  OVERHEAD=(--rates 100 --seconds-per-rate 2 --saturation-requests 100)
  TRANSFER=(--iterations 10 --rounds 1)
  ROUTING=(--parts uneven --uneven-requests 40)
  VLLM_SERVE=(--num-prompts 5 --rates 1)
fi
mkdir -p "$OUT"
exec flock /tmp/vllm-e2e.lock bash -c '
  set -euo pipefail
  OUT=$0
  .venv/bin/disagg-bench overhead '"${OVERHEAD[*]}"' \
      --result-file "$OUT/overhead.json" --markdown-file "$OUT/overhead.md"
  .venv/bin/disagg-bench transfer '"${TRANSFER[*]}"' --result-file "$OUT/transfer.json"
  .venv/bin/disagg-bench transfer '"${TRANSFER[*]}"' --block-bytes 65536 \
      --result-file "$OUT/transfer-64mib.json"
  .venv/bin/disagg-bench transfer '"${TRANSFER[*]}"' --regions 64 --block-bytes 256 \
      --result-file "$OUT/transfer-16k-descriptors.json"
  .venv/bin/disagg-bench transfer '"${TRANSFER[*]}"' --p-tp 2 --block-bytes 65536 \
      --result-file "$OUT/transfer-64mib-p-tp2.json"
  .venv/bin/disagg-bench scenarios '"${SWEEP[*]}"' --out-dir "$OUT" || true
  if [[ "$1" != 0 ]]; then
    .venv/bin/disagg-bench scenarios '"${PINNED[*]}"' --out-dir "$OUT/pinned"
  else
    .venv/bin/disagg-bench routing '"${ROUTING[*]}"' --out-dir "$OUT"
    .venv/bin/disagg-bench vllm-serve '"${VLLM_SERVE[*]}"' --out-dir "$OUT/vllm-bench" \
        --disagg-bench-dir "$OUT"
  fi
  if [[ "$2" == 0 && "$1" == 0 ]]; then  # the full run: the benchmarks with no smaller form
    .venv/bin/disagg-bench bind --out-dir "$OUT"
    .venv/bin/disagg-bench tenants --out-dir "$OUT"
    .venv/bin/disagg-bench fit-profile --pin-processes --out-dir "$OUT"
    .venv/bin/disagg-bench emulator-accuracy --fit-first --real-runs 2 --cpu-steps \
        --also-sleeping --stacks ours,aggregated \
        --input-lens 512,2048,8192 --fractions 0.3,0.9 --repetitions 1 --output-len 64 \
        --point-time-limit 120 \
        --pin-processes --seconds-per-point 30 --max-requests 40 --out-dir "$OUT"
    .venv/bin/disagg-bench fleet-scale --out-dir "$OUT"
    .venv/bin/disagg-bench churn --out-dir "$OUT"
  fi
' "$OUT" "${#PINNED[@]}" "${SMOKE:-0}"
