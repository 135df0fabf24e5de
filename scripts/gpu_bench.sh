#!/usr/bin/env bash
# The concurrency benchmark on a GPU (not part of the tests): the continuous-batching scheduler
# alone, in process (`warmup_tools.sim.bench.engine`), on CUDA in bfloat16 and float32, 1/4/8/16 streams;
# then the simulated engine's profile of this GPU and the demo LM (`profile-fit`'s fit_profile), written
# to OUT_DIR/profile-gpu-demo-lm.json (copy it into warmup_tools/lora_adapter/profiles/ to use it).
# It needs torch, transformers and peft, not tritonserver, so it runs on a machine that has only those
# (a GPU machine with a bare Python image); the assets' lm/ and adapters/ come from `make assets` here.
#
#   scripts/gpu_bench.sh [ASSETS_DIR] [OUT_DIR]        # defaults: .assets and $OUT (or /tmp/gpu-bench)
#
# On a remote GPU machine, copy the repository with .assets/lm and .assets/adapters (about 50 MiB) and run
# `bash scripts/gpu_bench.sh .assets OUT_DIR` (it takes a few minutes).
set -euo pipefail
cd "$(dirname "$0")/.."
assets=${1:-.assets}
out=${2:-${OUT:-/tmp/gpu-bench}}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
python3 - <<'PY' | tee "$out/device.txt"
import peft, torch, transformers
assert torch.cuda.is_available(), "torch sees no CUDA device"
print("torch", torch.__version__, "transformers", transformers.__version__, "peft", peft.__version__,
      "device", torch.cuda.get_device_name(0))
PY
for dtype in bfloat16 float32; do
  python3 -m warmup_tools.sim.bench.engine --assets-dir "$assets" --device cuda --dtype "$dtype" \
    --lm-threads 0 2>&1 | tee "$out/engine-$dtype.txt"
done
python3 - "$assets" "$out/profile-gpu-demo-lm.json" <<'PY'
import json, sys
from pathlib import Path
from warmup_tools.lora_adapter.profile_fit import fit_profile, summary
profile = fit_profile(Path(sys.argv[1]), name="gpu-demo-lm", device="cuda", dtype="bfloat16")
Path(sys.argv[2]).write_text(json.dumps(profile.to_json(), indent=2) + "\n", encoding="utf-8")
print(f"wrote {sys.argv[2]}: {summary(profile)}")
PY
