#!/usr/bin/env bash
# The measurements the open issues wait for, in three device calls of under 10 minutes each (in this order):
#   PART=scale OUT=... bash benchmarks/gpu_session.sh   # issue 14: 0.5B/1.5B/3B with the planner's defaults, TRL beside them
#   PART=big   OUT=... bash benchmarks/gpu_session.sh   # issue 14: 7B, 80/40 GiB caps, 7B LoRA at 40 GiB, 8k responses
#   PART=rest  OUT=... bash benchmarks/gpu_session.sh   # GPU tests; issue 17 agent rollout; issue 19 modes; issue 15 step check
# Pure-Python packages the GPU image lacks (omegaconf, rich; trl and datasets for TRL) travel as wheels in .whl/
# (carry it); they are installed under /tmp/site. Full logs and JSON land under $OUT (at most 8 files come back).
set -u
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    >/dev/null 2>&1 || echo "wheel install failed"
fi
export OUT PYTHONPATH=.:/tmp/site
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c "import torch, transformers, triton, sys; print(torch.__version__, transformers.__version__, triton.__version__, sys.version.split()[0])"
free -g | head -2
case "${PART:-scale}" in
  scale)
    python3 benchmarks/scale.py --deadline-s "${DEADLINE_S:-540}" \
      0.5b:0.5b:--steps,4 1.5b:1.5b:--steps,4 3b:3b:--steps,4 trl_0.5b:0.5b:trl,--steps,3,--checkpointing,off \
      trl_1.5b:1.5b:trl,--steps,3,--checkpointing,off trl_3b:3b:trl,--steps,3,--checkpointing,on
    ;;
  big)
    python3 benchmarks/scale.py --deadline-s "${DEADLINE_S:-540}" \
      7b:7b:--steps,3 7b_lora:7b:--lora,32,--gpu-memory-gib,40,--steps,3 1.5b_80:1.5b:--gpu-memory-gib,80,--steps,3 \
      3b_40:3b:--gpu-memory-gib,40,--steps,3 1.5b_8k:1.5b:--prompts,16,--response-tokens,8192,--steps,3
    ;;
  rest)
    timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests >"$OUT/gpu_tests.log" 2>&1
    echo "gpu tests exit $?"; tail -n 3 "$OUT/gpu_tests.log"
    timeout 120 python3 benchmarks/agent_rollout.py --out "$OUT/agent_rollout.json" >"$OUT/agent_rollout.log" 2>&1
    echo "agent rollout exit $?"; tail -n 12 "$OUT/agent_rollout.log"
    timeout 240 python3 benchmarks/offpolicy_modes.py --steps 1 --json "$OUT/offpolicy.json" >"$OUT/offpolicy.log" 2>&1
    echo "off-policy modes exit $?"; tail -n 8 "$OUT/offpolicy.log"
    GRPO_STEPS=5 timeout 150 python3 benchmarks/train_step.py grpo >"$OUT/train_step.log" 2>&1
    echo "train step exit $?"; grep -v -e "it/s]" -e "s/it]" -e '^{"variant"' "$OUT/train_step.log" | tail -n 6
    ;;
esac
