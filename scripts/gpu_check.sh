#!/usr/bin/env bash
# The CUDA/NCCL path, checked on a machine with a GPU (never in CI, which has none): the same
# greedy job at DP=1 under torchrun, once on the CPU (gloo) and once on the GPU (NCCL), with
# small budgets so prompts are chunked and ride in mixed steps; their tokens are compared. Then
# the GPU job again with decode steps replayed from CUDA graphs (cuda_graphs on), whose tokens
# must equal the eager GPU run's, scripts/bench_mixed_step.py on the GPU (what a prompt chunk
# costs inside a decode step there), and scripts/bench_gpu_step.py (a DeepSeek-V2-Lite-shaped
# bf16 decode step with CUDA graphs off and on: its time, host share and roofline).
#
#   bash scripts/gpu_check.sh [OUT_DIR]        # python3 on PATH, or $PYTHON; exit 1 on mismatch
set -uo pipefail
out=${1:-${OUT:-/tmp/gpu_check}}
mkdir -p "$out"
py=${PYTHON:-python3}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
"$py" -c 'import torch; print("torch", torch.__version__, "cuda", torch.cuda.is_available(),
torch.cuda.get_device_name() if torch.cuda.is_available() else "")'
"$py" -m launcher.cli make-model --arch qwen3_moe --out "$out/model" > /dev/null || exit 1
"$py" - "$out/prompts.jsonl" <<'PY'
import json, random, sys
rng = random.Random(0)
with open(sys.argv[1], "w") as f:
    for _ in range(16):
        ids = [rng.randrange(3, 250) for _ in range(rng.randint(4, 120))]
        line = {"prompt_token_ids": ids, "max_tokens": 24, "ignore_eos": True, "temperature": 0}
        f.write(json.dumps(line) + "\n")
PY
job=(-m torch.distributed.run --standalone --nproc-per-node 1 -m launcher.cli run
     --config configs/torchrun.yaml --dp-size 1 --set "model=$out/model"
     --set max_num_batched_tokens=64 --set max_num_seqs=8 --prompts "$out/prompts.jsonl" --quiet)
echo "== CPU (gloo)"; CUDA_VISIBLE_DEVICES= "$py" "${job[@]}" --output "$out/cpu.jsonl"
echo "== GPU (NCCL)"; "$py" "${job[@]}" --output "$out/gpu.jsonl"
"$py" - "$out/cpu.jsonl" "$out/gpu.jsonl" <<'PY'
import json, sys
cpu, gpu = ([json.loads(line) for line in open(path)] for path in sys.argv[1:3])
same = sum(a["output_token_ids"] == b["output_token_ids"] for a, b in zip(cpu, gpu))
print(f"tokens equal on {same} of {len(cpu)} requests (GPU answered {len(gpu)})")
sys.exit(0 if same == len(cpu) == len(gpu) else 1)
PY
status=$?
if "$py" -c 'import torch, sys; sys.exit(not torch.cuda.is_available())'; then
    # Decode steps replayed from CUDA graphs (cuda_graphs on): the eager GPU run's tokens.
    echo "== GPU (NCCL), CUDA graphs on"
    "$py" "${job[@]}" --set cuda_graphs=on --output "$out/gpu_graphs.jsonl" 2>&1 \
        | tee "$out/gpu_graphs.log"
    [ "${PIPESTATUS[0]}" = 0 ] || status=1
    # A capture that fails falls back to the eager forward with a warning: that is a failure here.
    if grep -q "cuda_graphs on: graphs off" "$out/gpu_graphs.log"; then
        echo "graphs on: a capture failed, the steps ran eagerly (above)"; status=1
    fi
    "$py" - "$out/gpu.jsonl" "$out/gpu_graphs.jsonl" <<'PY' || status=1
import json, sys
eager, graphs = ([json.loads(line) for line in open(path)] for path in sys.argv[1:3])
same = sum(a["output_token_ids"] == b["output_token_ids"] for a, b in zip(eager, graphs))
print(f"graphs on: tokens equal to the eager GPU run on {same} of {len(eager)} requests")
sys.exit(0 if same == len(eager) == len(graphs) else 1)
PY
    "$py" scripts/bench_mixed_step.py --device cuda --out "$out/mixed_step_cuda.json"
    # A DeepSeek-V2-Lite-shaped bf16 decode step, graphs off and on: step time, host share,
    # roofline (random weights drawn on the device; ~32 GB of GPU memory).
    "$py" scripts/bench_gpu_step.py --out "$out/gpu_step.json" || status=1
fi
exit $status
