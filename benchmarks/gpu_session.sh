#!/usr/bin/env bash
# One device call for a session: the rollout bench, then the training-step bench and CLI check.
#   bash benchmarks/gpu_session.sh        (on the GPU machine; full logs and JSON under $OUT)
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
[ -n "${SKIP_ROLLOUT:-}" ] || timeout "${ROLLOUT_LIMIT:-200}" python3 -m reinforge.bench --out "$OUT/bench.json" >"$OUT/rollout.log" 2>&1
echo "rollout bench exit $?"; tail -n 25 "$OUT/rollout.log"
timeout "${TRAIN_LIMIT:-360}" python3 benchmarks/train_step.py ${TRAIN_PARTS:-log_probs grpo check kl ppo} >"$OUT/train.log" 2>&1
echo "train bench exit $?"; grep -v -e "it/s]" -e "s/it]" "$OUT/train.log" | tail -n 40
