#!/usr/bin/env bash
# GPU checks for a lent CUDA machine (an H200 here): `llmctl doctor --json`, the engine on cuda:0 as users start
# it (tests/test_cuda_engine.py under -W error::UserWarning: default start-up with every decode graph captured
# within --gpu-memory-utilization, no empty graph, graph-vs-eager logits, prefill with a cached prefix and with a
# sliding window against the CPU float32 reference with SDPA's math kernel off), `llmctl bench --gpu --json
# --quick`, the quantised linears on CUDA (tests/test_quant_cuda.py: int8/int4 on torch's CUDA kernels and fp8
# on the fp8 tensor cores against their dequantised references; then `bench throughput --quantization fp8`,
# whose report must name the quantisation and its weight/KV bytes), the other CUDA-marked tests, the offline
# throughput benchmark on cuda and a short `llmctl serve` + `llmctl bench serve` run, `bench --gpu --stress 60` (checked GEMMs, telemetry) and the NCCL
# all-reduce sweep (skipped, saying why, on one GPU). Each step has its own timeout and all share one 10.3-minute deadline; a step that
# fails or times out is reported and the others still run; a summary table comes last. Each step's verdict
# (scripts/gpu_check_steps.sh) needs more than an exit status where one can lie: doctor must exit 0 or 1 with
# its JSON report and no traceback, bench must write its JSON report. Installs nothing from the network.
#
#   bash scripts/gpu_check.sh --fetch-wheels   # HERE, once (needs PyPI): wheels the GPU image lacks -> .whl/
#   bash scripts/gpu_check.sh                  # on the GPU host (device tool: carry [".whl"])
#
# The GPU image has torch, transformers, pytest, httpx, rich, ... but not typer 0.29 (which vendors click
# and needs pydantic), pydantic, fastapi, starlette or uvicorn: those travel as wheels in .whl/ and are
# installed with --no-index into /tmp. llmctl itself is not installed: pyproject maps engine/, commands/
# and checks/ into the llmctl package, so .gpu_site/llmctl is a folder of symlinks with that layout, first
# on PYTHONPATH, and PYTHONSAFEPATH=1 (Python >= 3.11) keeps `python -m` from putting the repository root,
# whose own llmctl/ lacks those subpackages, in front of it.
#
# What only a GPU proves of the CUDA path (issue 13; the logic around it runs in CPU tests), by step and test:
#   engine   test_default_start_up_on_cuda0_captures_every_bucket_once_before_serving: the default start-up
#            (graphs on, pool from --gpu-memory-utilization) runs the profile forward on CUDA, captures every
#            bucket before serving with one log line, and no graph is empty (UserWarnings are errors).
#   engine   test_pool_and_graphs_stay_within_gpu_memory_utilization: CudaMemory's measurements (profile peak,
#            graph captures) keep weights + graphs + pool + a long batch's peak inside the budget.
#   engine   test_decode_graphs_replay_the_eager_logits: graphs captured on the engine's stream give eager's logits.
#   engine   test_prefill_with_cached_prefix_and_sliding_window_matches_cpu_reference_without_math_sdpa: masked GQA
#            prefill runs on a fused SDPA kernel (math disabled, so a fallback raises) and matches CPU float32.
#   engine   test_second_gpu_engine_matches_the_cpu_reference_and_leaves_cuda0_alone (two GPUs only): graphs
#            captured for cuda:1 replay real work; pytest: test_decode_step_graph_is_captured_on_every_gpu, the
#            bench's graph, every GPU.
#   tp_nccl  test_tp2_over_nccl_matches_tp1 (two GPUs only; issue 17): the sharded model's collectives over NCCL,
#            one GPU per rank, give TP=1's greedy tokens for 2 KV heads and for 1 (replicated on both ranks);
#            test_tp2_async_scheduling_over_nccl_gives_the_serial_engines_tokens (issue 40): rank 0's sampled ids
#            broadcast over NCCL as rank 1's next inputs give the serial TP=2 engine's tokens and log-probs.
#   ep_nccl  test_ep2_over_nccl_matches_one_gpu (two GPUs only; issue 43): a MoE model's experts dealt out over
#            two GPUs (the Triton grouped GEMM skipping the other rank's pairs, the partial sums all-reduced over
#            NCCL) give one GPU's greedy tokens; `-dp 2 --enable-expert-parallel` (replicas on cuda:0 and cuda:1,
#            tokens gathered and sums scattered over a stateless NCCL group) answers as one GPU.
#   dp_tp_nccl  test_two_replicas_of_two_gpus_each_answer_as_one_gpu (four GPUs only; issue 43): `-dp 2 -tp 2`,
#            the server's process rank 0 of both replicas (cuda:0, cuda:2), answers as one engine on cuda:0.
#
# Files (at most 8, for the device tool) go to ${OUT:-/tmp}/gpu_check: gpu_check.log (everything, the summary
# table last), engine.log, pytest.log, serve.log, doctor.json, bench_gpu.json, offline.json, bench_serve.json.
# Exit status: 0 when every step passed (doctor may report failed host checks) and every gated speed figure
# (bf16 GEMM >= 75 %, copy >= 85 % of the datasheet peak) holds, else 1. Throughput at real model size:
# scripts/gpu_perf_check.py.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
WHEELS=(typer pydantic pydantic-core annotated-types typing-inspection typing-extensions annotated-doc
        fastapi starlette uvicorn opentelemetry-api hypothesis sortedcontainers attrs)

if [[ "${1:-}" == "--fetch-wheels" ]]; then
    # The versions this checkout is tested with here, for the GPU image's CPython 3.12 on x86-64.
    mapfile -t pins < <("$PY" -c 'import sys; from importlib.metadata import version
for n in sys.argv[1:]: print(f"{n}=={version(n)}")' "${WHEELS[@]}") || exit 1
    rm -rf .whl && mkdir -p .whl
    exec "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d .whl "${pins[@]}"
fi

source scripts/gpu_check_steps.sh
deadline=$((SECONDS + 620))
out="${OUT:-/tmp}/gpu_check"
rm -rf "$out" && mkdir -p "$out"
log="$out/gpu_check.log"
steps=$(mktemp /tmp/gpu_check_steps.XXXXXX)
errdir=$(mktemp -d /tmp/gpu_check_stderr.XXXXXX)

main() {
extra=""
if compgen -G ".whl/*.whl" > /dev/null; then
    rm -rf /tmp/gpu_check_site
    if timeout 120 "$PY" -m pip install -q --no-index --no-deps --no-compile --target /tmp/gpu_check_site .whl/*.whl; then
        extra=/tmp/gpu_check_site
    else
        echo "gpu_check: installing .whl/*.whl failed; the CLI steps may fail to import"
    fi
else
    echo "gpu_check: no .whl/ (run 'bash scripts/gpu_check.sh --fetch-wheels' on a machine with PyPI and carry .whl)"
fi
rm -rf .gpu_site && mkdir -p .gpu_site/llmctl
for f in llmctl/*; do ln -s "$PWD/$f" ".gpu_site/llmctl/$(basename "$f")"; done
for d in engine commands checks; do ln -s "$PWD/$d" ".gpu_site/llmctl/$d"; done
export PYTHONPATH="$PWD/.gpu_site${extra:+:$extra}${PYTHONPATH:+:$PYTHONPATH}" PYTHONSAFEPATH=1 PYTHONUNBUFFERED=1
export NO_COLOR=1 GPU_CHECK_BENCH_JSON="$out/bench_gpu.json"

timeout 30 nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
timeout 60 "$PY" -c "import sys, torch; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, \
torch.cuda.get_device_name() if torch.cuda.is_available() else 'NO CUDA DEVICE')"
timeout 60 "$PY" -c "import llmctl.engine, llmctl.cli, typer; print('llmctl from', llmctl.__file__, '| typer', typer.__version__)"

step doctor 60 verdict_doctor "$out/doctor.json" "$PY" -m llmctl.cli doctor --json
step engine 100 verdict_pytest_ran "$out/engine.log" "$PY" -m pytest -q -rfEs -p no:cacheprovider -W error::UserWarning \
    tests/test_cuda_engine.py
tail -n 15 "$out/engine.log"
# TP=2 over NCCL, one GPU per rank, against TP=1 on cuda:0 (skips, saying so, with one GPU); its log stays out of
# $out (8 files at most) and is shown here.
step tp_nccl 120 verdict_pytest_or_skip "$errdir/tp_nccl.log" "$PY" -m pytest -q -rfEs -p no:cacheprovider \
    tests/test_cuda_tensor_parallel.py
tail -n 8 "$errdir/tp_nccl.log"
step ep_nccl 120 verdict_pytest_or_skip "$errdir/ep_nccl.log" "$PY" -m pytest -q -rfEs -p no:cacheprovider \
    tests/test_cuda_expert_parallel.py
tail -n 8 "$errdir/ep_nccl.log"
step dp_tp_nccl 120 verdict_pytest_or_skip "$errdir/dp_tp_nccl.log" "$PY" -m pytest -q -rfEs -p no:cacheprovider \
    tests/test_cuda_data_parallel.py
tail -n 8 "$errdir/dp_tp_nccl.log"
step bench_gpu 150 verdict_bench_json "$out/bench_gpu.json" "$PY" -m llmctl.cli bench --gpu --json --quick
# gpu-burn style: 60 s of checked fp32 GEMMs per GPU with NVML telemetry; wrong results or new XIDs/ECC exit 1.
step stress 100 verdict_bench_json "$errdir/stress.json" "$PY" -m llmctl.cli bench --gpu --stress 60 --json
# nccl-tests style all-reduce busbw sweep over every GPU (bench --gpu runs it too); needs two GPUs or more.
gpus=$(timeout 60 "$PY" -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
if (( gpus > 1 )); then
    step nccl_sweep 90 verdict_exit0 - "$PY" -c "import sys; from llmctl.bench.collectives import allreduce_sweep, bandwidths
rows = allreduce_sweep($gpus, [1 << 20, 1 << 24, 1 << 28, 1 << 30])
for r in rows: print(r.nbytes, 'bytes: busbw %.1f GB/s' % bandwidths(r.nbytes, sorted(r.seconds)[len(r.seconds) // 2], $gpus)[1], r.wrong_elements, 'wrong')
sys.exit(1 if any(r.wrong_elements for r in rows) else 0)"
else
    printf 'nccl_sweep\tok (skipped: %s GPU here; the all-reduce sweep needs two or more)\t0\n' "$gpus" >> "$steps"
    echo "== nccl_sweep: skipped ($gpus GPU; needs two or more)"
fi
# The quant step's files stay in $errdir (the device tool brings 8 back); their tails and figures reach the log.
step quant 120 verdict_pytest_ran "$errdir/quant.log" "$PY" -m pytest -q -rfEs -p no:cacheprovider tests/test_quant_cuda.py
tail -n 15 "$errdir/quant.log"
step quant_bench 60 verdict_offline_json "$errdir/quant_bench.json" "$PY" -m llmctl.cli bench throughput --device cuda \
    --dtype bfloat16 --quantization fp8 --num-prompts 32 --input-len 128 --output-len 64 --json
# The Triton kernels compiled on the GPU (the same tests run interpreted on CPUs): attention against its float32
# reference, the engine on --attention-backend triton against transformers, the fused layer ops and fp8 quantiser.
step triton 150 verdict_pytest_ran "$errdir/triton.log" "$PY" -m pytest -q -rfEs -p no:cacheprovider \
    tests/test_triton_attention.py tests/test_triton_layer_ops.py
tail -n 15 "$errdir/triton.log"
mapfile -t cuda_tests < <(grep -l "pytest.mark.cuda" tests/test_*.py | grep -v "test_cuda_engine.py\|test_cuda_tensor_parallel.py\|test_cuda_expert_parallel.py\|test_cuda_data_parallel.py\|test_quant_cuda.py\|test_triton_")
step pytest 210 verdict_pytest "$out/pytest.log" "$PY" -m pytest -q -rfEs -p no:cacheprovider -m cuda \
    --continue-on-collection-errors "${cuda_tests[@]}"
tail -n 15 "$out/pytest.log"
step offline 100 verdict_exit0 - "$PY" benchmarks/offline_throughput.py --dtypes bfloat16 --device cuda --json "$out/offline.json"

cat > /tmp/gpu_check_serve.py <<'PY'
"""llmctl serve on cuda, GET /health until 200, llmctl bench serve against it, then SIGTERM (a graceful drain)."""
import signal, socket, subprocess, sys, time

import httpx

out, py = sys.argv[1], sys.executable
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
url = f"http://127.0.0.1:{port}"
with open(f"{out}/serve.log", "w") as log:
    server = subprocess.Popen([py, "-m", "llmctl.cli", "serve", "--device", "cuda", "--port", str(port)],
                              stdout=log, stderr=subprocess.STDOUT)
try:
    start = time.monotonic()
    while True:
        if server.poll() is not None:
            sys.exit(f"llmctl serve exited with {server.returncode} before it was healthy (serve.log)")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if time.monotonic() - start > 90:
            sys.exit("llmctl serve was not healthy after 90 s (serve.log)")
        time.sleep(0.5)
    print(f"serve healthy after {time.monotonic() - start:.1f} s", flush=True)
    bench = subprocess.run([py, "-m", "llmctl.cli", "bench", "serve", "--base-url", url, "--num-prompts", "64",
                            "--request-rate", "16", "--random-input-len", "128", "--random-output-len", "64",
                            "--json"], stdout=subprocess.PIPE, timeout=120)
    with open(f"{out}/bench_serve.json", "wb") as f:
        f.write(bench.stdout)
    code = bench.returncode
finally:
    server.send_signal(signal.SIGTERM)
    try:
        server.wait(30)
    except subprocess.TimeoutExpired:
        server.kill()
        server.wait()
print(f"llmctl serve exited with {server.returncode} after SIGTERM", flush=True)
sys.exit(code or (server.returncode != 0))
PY
step serve 120 verdict_exit0 - "$PY" /tmp/gpu_check_serve.py "$out"

"$PY" - "$out" "$steps" "$errdir" <<'PY'
"""The summary: one row per step with its key figures, then the bench --gpu table and the H200 gates."""
import json, sys
from pathlib import Path

out, steps, scratch = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])


def load(name, folder=out):
    try:
        return json.loads((folder / name).read_text())
    except (OSError, ValueError):
        return None


def figures(name):
    if name == "doctor" and (doc := load("doctor.json")):
        s = doc["summary"]
        bad = [f"{r['id']}={r['status']}" for r in doc["results"] if r["status"] in ("fail", "warn")]
        return f"{s['pass']} pass, {s['warn']} warn, {s['fail']} fail, {s['skip']} skip " + " ".join(bad)
    if name == "bench_gpu" and (doc := load("bench_gpu.json")):
        keep = ("gemm_bf16", "gemm_fp8", "memory_copy", "h2d", "decode_step")
        rows = [f"{r['name']} {r['median']:,.4g} {r['unit']}" + (f" ({r['pct_of_peak']}%)" if r["pct_of_peak"] else "")
                for r in doc["results"] if r["device"] == "cuda:0" and r["name"] in keep]
        return "; ".join(rows) + (f"; {len(doc['errors'])} errors" if doc["errors"] else "")
    if name == "stress" and (doc := load("stress.json", scratch)):
        rows = [f"{r['device']} {r['median']:,.4g} TFLOP/s, {r['params']['compute_errors']} wrong, "
                f"max {(r['params']['telemetry']['temperature_c'] or {}).get('max', '?')} C"
                for r in doc["results"] if r["name"] == "stress_gemm"]
        return "; ".join(rows) + (f"; {len(doc['errors'])} errors" if doc["errors"] else "")
    if name == "quant_bench" and (doc := load("quant_bench.json", scratch)):
        return (f"fp8 weights {doc['weight_bytes'] / 2**20:,.1f} MiB, KV cache {doc['kv_cache_bytes'] / 2**20:,.0f} MiB, "
                f"{doc['output_tokens_per_second']['mean']:,.0f} output tok/s")
    log = (scratch if name in ("quant", "triton") else out) / f"{name}.log"
    if name in ("pytest", "engine", "quant", "triton") and log.exists():
        lines = [l for l in log.read_text().splitlines() if l.strip()]
        return lines[-1].strip("= ") if lines else ""
    if name == "offline" and (rows := load("offline.json")):
        return "; ".join(f"{r['system']} {r['dtype']} {r['workload']} {r['tokens_per_s']:,.0f} tok/s" for r in rows)
    if name == "serve" and (doc := load("bench_serve.json")):
        return (f"{doc['completed']} completed, {doc['failed']} failed, {doc['output_throughput']:,.0f} output tok/s, "
                f"median TTFT {doc['median_ttft_ms']:.1f} ms, median TPOT {doc['median_tpot_ms']:.2f} ms")
    return ""


rows = [line.split("\t") for line in steps.read_text().splitlines() if line]
print(f"\n{'step':10} {'status':28} {'s':>4}  figures")
for name, status, seconds in rows:
    print(f"{name:10} {status:28} {seconds:>4}  {figures(name)}")
doc = load("bench_gpu.json")
if doc:
    fmt = lambda v: "-" if v is None else f"{v:,.4g}"
    print(f"\n{'device':16} {'benchmark':44} {'median':>10} {'unit':9} {'peak':>9} {'% peak':>7}")
    for r in doc["results"]:
        print(f"{r['device']:16} {r['label']:44} {fmt(r['median']):>10} {r['unit']:9} {fmt(r['peak']):>9} "
              f"{fmt(r['pct_of_peak']):>7}")
    for e in doc["errors"]:
        print("  error:", e)
below = []
if doc:
    gate = {"gemm_bf16": 75.0, "memory_copy": 85.0}  # what an H100/H200 should reach (issue 6)
    for r in doc["results"]:
        if r["name"] in gate and r["pct_of_peak"] is not None:
            verdict = "ok" if r["pct_of_peak"] >= gate[r["name"]] else "BELOW"
            print(f"  {r['device']} {r['name']}: {r['pct_of_peak']}% of peak (want >= {gate[r['name']]}%) {verdict}")
            if verdict == "BELOW":
                below.append(f"{r['device']} {r['name']}")
if below:
    print("speed figures under their gates:", ", ".join(below))
sys.exit(0 if rows and all(status.startswith("ok") for _, status, _ in rows) and not below else 1)
PY
}

run_logged "$log" main
status=$?
rm -rf "$steps" "$errdir"
exit $status
