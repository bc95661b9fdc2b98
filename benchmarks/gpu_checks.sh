#!/usr/bin/env bash
# The measurements that wait for a GPU (benchmarks/README.md, "Waiting for a GPU"), most wanted first, fitted
# into one call of a lent machine: a check starts only while the time left allows its usual length, runs under
# a timeout of what is left, and writes its output to $OUT/<check>.log, so a check that fails or overruns costs
# only itself. A line per check at the end says how each ended.
#
#   bash benchmarks/gpu_checks.sh SECONDS [CHECK ...]      (default: every check, in the order below)
#   bash benchmarks/gpu_checks.sh --list                   (each check as NAME|SECONDS|COMMAND, running none)
#
# The lent machine has jax, torch and transformers but no gin-config; beforehand, here:
#   pip download --no-deps --dest .whl gin-config==0.5.0   (and carry .whl; it is installed under /tmp)
# DEVICE, SIZES and PYTHON (default gpu, large and python3) let the same checks run here at a tiny size, to try
# the script: DEVICE=cpu SIZES=tiny PYTHON=.venv/bin/python bash benchmarks/gpu_checks.sh 600 bert_triton
set -uo pipefail
cd "$(dirname "$0")/.."

if [[ $# -lt 1 || ! $1 =~ ^([0-9]+|--list)$ ]]; then
  echo "usage: bash benchmarks/gpu_checks.sh SECONDS [CHECK ...] | --list" >&2
  exit 2
fi
device=${DEVICE:-gpu}
sizes=${SIZES:-large}
python=${PYTHON:-python3}

train_step="$python benchmarks/train_step.py --device=$device --sizes=$sizes --repeats=5 --warmup=2"
# name | seconds it usually takes on an H200 (each large model compiles in 1-2.5 minutes) | command
checks=(
  "attention|90|$python benchmarks/attention.py --device=$device --tilings=64x64/4/3,128x64/8/2,128x64/8/3"
  "bert_triton|300|$train_step --families=bert --attention=auto,triton"
  "xlnet_start|300|$python benchmarks/step_loading.py --device=$device --sizes=$sizes --families=xlnet"
  "xlnet_triton|360|$train_step --families=xlnet --attention=auto,triton"
  "xlnet_masks|300|$train_step --families=xlnet --dropout_masks=bernoulli,hashed"
  "bert_masks|360|$train_step --families=bert --dropout_masks=bernoulli,packed,hashed"
  "gelu|300|$train_step --families=bert,bart --gelu_gradient=formula,autodiff"
)
if [[ $1 == --list ]]; then
  printf '%s\n' "${checks[@]}"
  exit 0
fi
deadline=$((SECONDS + $1))
shift
known=$(printf '%s\n' "${checks[@]}" | cut -d'|' -f1 | tr '\n' ' ')
for wanted in "$@"; do
  [[ " $known" == *" $wanted "* ]] || { echo "unknown check $wanted: expected some of $known" >&2; exit 2; }
done
out=${OUT:-/tmp/gpu_checks}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" > /dev/null; then
  $python -m pip install -q --no-index --no-deps --no-compile --target /tmp/gpu_checks_site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/gpu_checks_site${PYTHONPATH:+:$PYTHONPATH}
fi

summary=()
for check in "${checks[@]}"; do
  IFS='|' read -r name usual command <<< "$check"
  [[ $# -eq 0 || " $* " == *" $name "* ]] || continue
  left=$((deadline - SECONDS))
  if ((left < usual)); then
    summary+=("$name: skipped, ${left} s left of the ${usual} s it usually takes")
    continue
  fi
  echo "== $name ($command), ${left} s left" | tee "$out/$name.log"
  begun=$SECONDS
  timeout --kill-after=10 "$((left - 5))" $command 2>&1 | tee -a "$out/$name.log"
  status=${PIPESTATUS[0]}
  case $status in
    0) ended="done" ;;
    124 | 137) ended="stopped at the deadline" ;;
    *) ended="failed (exit $status)" ;;
  esac
  summary+=("$name: $ended in $((SECONDS - begun)) s, $out/$name.log")
done
printf '%s\n' "== checks" "${summary[@]}" | tee "$out/summary.log"
