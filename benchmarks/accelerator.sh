#!/usr/bin/env bash
# Loss scaling on whatever backend JAX finds (CPU, GPU or TPU), in one
# markdown file: the finiteness-check sweep, step_overhead's main rows, the
# fused step with one lax.cond against a per-leaf select, and a GPT-2-shaped
# model's train step. Ratios only, measured in one process.
#
# Usage: benchmarks/accelerator.sh [OUT.md] [--quick]
#   OUT.md   where to write (default benchmarks/ACCELERATOR_<backend>.md)
#   --quick  a smoke run on small trees and a one-block model (the suite runs
#            it; its figures mean nothing)
# Environment: PYTHON, the interpreter (default: python).
#
# The sweep is `benchmarks/finite_sweep.py --quick`, run when that file
# exists; its markdown table is taken from the file it writes with `--out`
# when its --help offers that option, else from what it prints.
set -euo pipefail

cd "$(dirname "$0")/.."
python=${PYTHON:-python}
out=""
quick=()
for arg in "$@"; do
  case "$arg" in
    --quick) quick=(--quick) ;;
    -h | --help)
      sed -n '2,16s/^# \{0,1\}//p' "$0"
      exit 0
      ;;
    -*)
      echo "accelerator.sh: unknown option '$arg' (see --help)" >&2
      exit 2
      ;;
    *)
      if [[ -n "$out" ]]; then
        echo "accelerator.sh: one output file, got '$out' and '$arg'" >&2
        exit 2
      fi
      out=$arg
      ;;
  esac
done

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
sweep_args=()
if [[ -f benchmarks/finite_sweep.py ]]; then
  echo "== sweep: $python benchmarks/finite_sweep.py --quick"
  sweep_cmd=("$python" benchmarks/finite_sweep.py --quick)
  sweep_help=$("$python" benchmarks/finite_sweep.py --help 2>/dev/null || true)
  if [[ "$sweep_help" == *--out* ]]; then
    sweep_cmd+=(--out "$tmp/sweep.md")
  fi
  if "${sweep_cmd[@]}" >"$tmp/sweep.txt"; then
    cat "$tmp/sweep.txt"
    if [[ -s "$tmp/sweep.md" ]]; then
      sweep_args=(--sweep "$tmp/sweep.md")
    else
      sweep_args=(--sweep "$tmp/sweep.txt")
    fi
  else
    status=$?
    cat "$tmp/sweep.txt"
    echo "== the sweep failed (exit $status); going on without it"
    sweep_args=(--sweep-note "\`benchmarks/finite_sweep.py --quick\` failed (exit $status).")
  fi
else
  echo "== benchmarks/finite_sweep.py not found: no sweep"
  sweep_args=(--sweep-note "Not run: \`benchmarks/finite_sweep.py\` is not in this checkout.")
fi

echo "== steps, cond or select, model step: $python benchmarks/accelerator.py"
"$python" benchmarks/accelerator.py \
  ${out:+--out "$out"} \
  "${quick[@]}" \
  "${sweep_args[@]}" \
  --command "benchmarks/accelerator.sh $*" \
  --seconds-before "$SECONDS"
