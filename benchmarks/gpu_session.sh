#!/usr/bin/env bash
# One device call for a session: GPU tests, the rollout bench, the training-step bench.
#   OUT=... bash benchmarks/gpu_session.sh        (on the GPU machine; full logs and JSON under $OUT)
# Env: TRAIN_PARTS (default "grpo_kept grpo kl_kept ppo_kept", the v4 table), GRPO_STEPS / KL_PPO_STEPS (default 6: medians of steps 2-6),
# SKIP_TESTS, SKIP_ROLLOUT, PROFILE_NATIVE=1 (adds the sampler/graph profile with its layout sweep),
# and time limits TEST_LIMIT, ROLLOUT_LIMIT, TRAIN_LIMIT (seconds).
set -u
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"; export OUT PYTHONPATH=.
nvidia-smi --query-gpu=name,driver_version,memory.used --format=csv,noheader
python3 -c "import torch, transformers, triton, sys; print(torch.__version__, transformers.__version__, triton.__version__, sys.version.split()[0])"
# pure-Python dependencies the GPU image lacks travel as wheels in .whl/ (carry it)
for module in omegaconf rich pandas pyarrow matplotlib yaml; do
  python3 -c "import $module" 2>/dev/null || missing="${missing:-} $module"
done
echo "missing before install:${missing:-none}"
if [ -d .whl ] && [ -n "${missing:-}" ]; then
  for module in $missing; do
    case $module in
      omegaconf) wheels="omegaconf antlr4_python3_runtime" ;; rich) wheels="rich markdown_it_py mdurl pygments" ;;
      *) wheels=$module ;;
    esac
    for w in $wheels; do
      for f in .whl/${w}-*.whl; do [ -f "$f" ] && python3 -m zipfile -e "$f" /tmp/gpu_site; done
    done
  done
  export PYTHONPATH=.:/tmp/gpu_site
fi
python3 -c "import omegaconf; print('omegaconf', omegaconf.__version__)"
if [ -z "${SKIP_TESTS:-}" ]; then
  timeout "${TEST_LIMIT:-150}" python3 -m pytest -q -p no:cacheprovider -m gpu tests/engine tests/models tests/rollout/native >"$OUT/gpu_tests.log" 2>&1
  echo "gpu tests exit $?"; tail -n 3 "$OUT/gpu_tests.log"
fi
[ -n "${SKIP_ROLLOUT:-}" ] || timeout "${ROLLOUT_LIMIT:-200}" python3 -m reinforge.bench --out "$OUT/bench.json" >"$OUT/rollout.log" 2>&1
echo "rollout bench exit $?"; tail -n 14 "$OUT/rollout.log"
if [ -n "${PROFILE_NATIVE:-}" ]; then
  timeout 200 python3 benchmarks/profile_native.py "$OUT/profile_native.json" --sweep >"$OUT/profile_native.log" 2>&1
  echo "profile_native exit $?"; tail -n 8 "$OUT/profile_native.log"
fi
GRPO_STEPS=${GRPO_STEPS:-6} KL_PPO_STEPS=${KL_PPO_STEPS:-6} timeout "${TRAIN_LIMIT:-400}" \
  python3 benchmarks/train_step.py ${TRAIN_PARTS:-grpo_kept grpo kl_kept ppo_kept} >"$OUT/train.log" 2>&1
echo "train bench exit $?"; grep -v -e "it/s]" -e "s/it]" -e '^{"variant"' "$OUT/train.log" | tail -n 12
