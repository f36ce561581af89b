#!/usr/bin/env bash
# The GPU check (issue 51), one command for a session with a lent GPU, run from the repository's root:
#   checks/gpu/run.sh        -> $OUT/gpu_check.json ($OUT: the device tool's folder; else checks/gpu/out)
# It needs Python, PyTorch, Triton and transformers, nothing installed: the tree is imported as it
# is, and every model is made there (benchmarks/gpu_check.py says what it runs). Under 8 minutes.
# Extra arguments go to benchmarks/gpu_check.py (--parts oracle,invariance to rerun a part).
set -euo pipefail
cd "$(dirname "$0")/../.."
out="${OUT:-checks/gpu/out}"
mkdir -p "$out"
python="${PYTHON:-python3}"
nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv || true
"$python" -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__,
'transformers', transformers.__version__, 'cuda', torch.cuda.is_available())"
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PAGEDLLM_CACHE_DIR="$out/.cache"
exec timeout 460 "$python" benchmarks/gpu_check.py --out "$out/gpu_check.json" "$@"
