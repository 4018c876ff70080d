#!/usr/bin/env bash
# Loss scaling on whatever backend JAX finds (CPU, GPU or TPU), in one
# markdown file: the finiteness-check sweep, step_overhead's main rows, the
# fused step with one lax.cond against a per-leaf select, a GPT-2-shaped
# model's train step (ratios measured in one process), and the fused step
# against plain adam in two more processes, without and with
# XLA_FLAGS+=--xla_gpu_enable_command_buffer=+CONDITIONAL, with the copies
# in its compiled HLO.
#
# Usage: benchmarks/accelerator.sh [OUT.md] [--quick] [--no-sweep]
#   OUT.md      where to write (default benchmarks/ACCELERATOR_<backend>.md)
#   --quick     a smoke run on small trees and a one-block model (the suite
#               runs it; its figures mean nothing)
#   --no-sweep  leave the finiteness-check sweep out
# Environment: PYTHON, the interpreter (default: python).
#
# The sweep is `benchmarks/finite_sweep.py --quick`, run when that file
# exists. When its --help offers `--out`, it is given `--out DIR` (a fresh
# directory, so that nothing in benchmarks/ is overwritten) and its table is
# taken from a markdown file it writes there; otherwise, or when it writes
# none, from the lines starting with `|` that it prints.
set -euo pipefail

cd "$(dirname "$0")/.."
python=${PYTHON:-python}
out=""
quick=()
sweep=yes
for arg in "$@"; do
  case "$arg" in
    --quick) quick=(--quick) ;;
    --no-sweep) sweep=no ;;
    -h | --help)
      sed -n '2,21s/^# \{0,1\}//p' "$0"
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
if [[ "$sweep" == no ]]; then
  echo "== --no-sweep: no sweep"
  sweep_args=(--sweep-note "Not run (\`--no-sweep\`).")
elif [[ -f benchmarks/finite_sweep.py ]]; then
  echo "== sweep: $python benchmarks/finite_sweep.py --quick"
  sweep_cmd=("$python" benchmarks/finite_sweep.py --quick)
  sweep_help=$("$python" benchmarks/finite_sweep.py --help 2>/dev/null || true)
  mkdir "$tmp/sweep"
  if [[ "$sweep_help" == *--out* ]]; then
    sweep_cmd+=(--out "$tmp/sweep")
  fi
  if "${sweep_cmd[@]}" >"$tmp/sweep.txt"; then
    cat "$tmp/sweep.txt"
    written=("$tmp"/sweep/*.md)
    if [[ -s "${written[0]}" ]]; then
      sweep_args=(--sweep "${written[0]}")
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
  --command "benchmarks/accelerator.sh${*:+ $*}" \
  --seconds-before "$SECONDS"
