#!/usr/bin/env bash
# The one prepared run for a lent GPU machine: `make gpu-check` (the memory and time model against real steps,
# bench/gpu_check.py), then `lorafit measure` on the README's headline plans (Llama-2-7B and Llama-3.1-8B QLoRA)
# for the GPU it finds, and the measurements exported as calibration rows; everything is written under OUT
# (default bench/results), to be committed there and compared with the estimates.
#
# Prepare here first: `make gpu-wheels` (bitsandbytes and pydantic, which the GPU image lacks, into .whl/).
# There, with .whl carried:   OUT=$OUT bash bench/gpu_session.sh      (GPU_CHECK_MINUTES, default 6)
set -u
out=${OUT:-bench/results}
mkdir -p "$out"
python=${GPU_PYTHON:-python3}
export PYTHONUNBUFFERED=1 XDG_CACHE_HOME="$out/cache" PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
if [ -d .whl ]; then
    "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
"$python" bench/gpu_check.py --out "$out/gpu-check.json" --time-budget "${GPU_CHECK_MINUTES:-6}" 2>&1 | tee "$out/gpu-check.log"
for model in llama-2-7b llama-3.1-8b; do
    echo "== lorafit measure --model $model --method qlora"
    "$python" -m lorafit.cli measure --model "$model" --method qlora --steps 5 --json >"$out/measure-$model.json" \
        2>"$out/measure-$model.err"
    echo "exit $?"; cat "$out/measure-$model.err"
done
"$python" -m lorafit.cli measure --export "$out/measured-rows.csv"
