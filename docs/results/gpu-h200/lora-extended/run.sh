#!/bin/bash
# H200: LoRA adapters, 8B shape bf16, 2 random rank-16 adapters on every linear layer.
# The tree measured (new/): in-process decode step rows 32,64, then HTTP closed loop c=32,64; main's step (rows 32) last.
R=$(cd "$(dirname "$0")" && pwd)
M=${LORA_MODEL:-/tmp/m8}
t0=$(date +%s)
say() { echo "[$(( $(date +%s) - t0 )) s] $*" | tee -a $OUT/progress.txt; }
[ -f $M/config.json ] || (cd $R/new && PYTHONPATH=$PWD:/tmp/site timeout ${T_BUILD:-90} python3 -c "from mlxq.models.tiny import build_tiny_model as b; b('llama', '$M', preset='llama3-8b', fast_init=True)")
say "model $M ready"
(cd $R/new && PYTHONPATH=$PWD:/tmp/site timeout ${T_STEP:-70} python3 scripts/profile_adapter_step.py --model $M --rows ${ROWS:-32,64} --steps ${STEPS:-10}) 2>&1 | grep -E '^\||Error|error' | tee $OUT/step-new.txt
say "step new done"
(cd $R/new && PYTHONPATH=$PWD:/tmp/site timeout ${T_HTTP:-120} python3 scripts/bench_adapters.py --model $M --concurrency ${CONC:-32,64} --rounds 1 --seconds ${SECONDS_HTTP:-5} --warmup-seconds 2 --max-tokens 48 --out $OUT/http.json) 2>&1 | grep -E '^\||Error|error' | tee $OUT/http.txt
say "http done"
(cd $R/main && PYTHONPATH=$PWD:/tmp/site timeout ${T_MAIN:-45} python3 scripts/profile_adapter_step.py --model $M --rows ${ROWS_MAIN:-32} --steps ${STEPS:-10}) 2>&1 | grep -E '^\||Error|error' | tee $OUT/step-main.txt
say "step main done"
