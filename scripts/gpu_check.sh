#!/usr/bin/env bash
# GPU checks for a lent CUDA machine: installs nothing from the network, runs the CUDA tests and a
# short throughput benchmark, prints a small table. Budget: under 8 minutes on one H200.
# Usage (repo root): bash scripts/gpu_check.sh   (writes logs to ${OUT:-/tmp}/gpu_check)
# Wheels the device image lacks (typer 0.29, which vendors click) travel in .whl/ (see the device
# tool's README) and are installed to /tmp/site here, without a network.
set -uo pipefail
if compgen -G ".whl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
cd "$(dirname "$0")/.."
out="${OUT:-/tmp}/gpu_check"; mkdir -p "$out"
export PYTHONPATH="$PWD/.gpu_site${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
# The package maps engine/, commands/, checks/ to llmctl.*; expose that layout without pip.
mkdir -p .gpu_site/llmctl
for f in llmctl/*; do ln -sfn "$PWD/$f" ".gpu_site/llmctl/$(basename "$f")"; done
ln -sfn "$PWD/engine" .gpu_site/llmctl/engine
ln -sfn "$PWD/commands" .gpu_site/llmctl/commands
ln -sfn "$PWD/checks" .gpu_site/llmctl/checks
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv | tee "$out/nvidia-smi.csv"
python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())"
python -m llmctl.cli doctor --json > "$out/doctor.json"; echo "doctor exit code $?"
python - "$out/doctor.json" <<'PY'
import json, sys
report = json.load(open(sys.argv[1]))
print("doctor:", report["summary"])
for r in report["results"]:
    if r["status"] != "pass":
        print(f"  {r['status']:5} {r['id']:24} {r.get('observed')}")
PY
timeout 240 python -m pytest -q -p no:cacheprovider tests/test_cuda.py 2>&1 | tee "$out/pytest.log" | tail -5
timeout 180 python -m llmctl.cli bench --gpu --json --quick > "$out/bench_gpu.json" 2>"$out/bench_gpu.err"
echo "llmctl bench --gpu exit code $?"; tail -5 "$out/bench_gpu.err"
python - "$out/bench_gpu.json" <<'PY'
import json, sys
try:
    doc = json.load(open(sys.argv[1]))
except (OSError, ValueError) as exc:
    sys.exit(f"bench --gpu: no JSON ({exc})")
fmt = lambda v: "-" if v is None else f"{v:,.4g}"
print(f"{'device':16} {'benchmark':44} {'median':>10} {'unit':9} {'peak':>9} {'% peak':>7}")
for r in doc["results"]:
    print(f"{r['device']:16} {r['label']:44} {fmt(r['median']):>10} {r['unit']:9} {fmt(r['peak']):>9} {fmt(r['pct_of_peak']):>7}")
for e in doc["errors"]:
    print("  error:", e)
gate = {"gemm_bf16": 75.0, "memory_copy": 85.0}  # issue 6: H200 expectations
for r in doc["results"]:
    if r["name"] in gate and r["pct_of_peak"] is not None:
        verdict = "ok" if r["pct_of_peak"] >= gate[r["name"]] else "BELOW"
        print(f"  {r['device']} {r['name']}: {r['pct_of_peak']}% of peak (want >= {gate[r['name']]}%) {verdict}")
PY
timeout 120 python -m pytest -q -p no:cacheprovider -m cuda tests/test_bench_hardware.py 2>&1 | tail -3
timeout 240 python benchmarks/offline_throughput.py --dtypes bfloat16 --device cuda --json "$out/offline.json" \
    2>"$out/bench.err" | tee "$out/offline.txt"
