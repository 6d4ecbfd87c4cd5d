# Step runner and verdicts for scripts/gpu_check.sh, sourced by it and by tests/test_gpu_check_script.py (which
# runs them on the CPU with stub commands). Needs: $deadline (a $SECONDS value), $steps (the table file),
# $errdir (a folder for each step's stderr), $PY (a Python for the JSON checks).

# step NAME CAP VERDICT STDOUT_FILE COMMAND...: run COMMAND under min(CAP, time left) seconds with stdout to
# STDOUT_FILE ("-": the log) and stderr to $errdir/NAME.stderr (copied to the log afterwards); VERDICT (a
# function below) judges it from the exit status, STDOUT_FILE and the stderr file; one row (name, status,
# seconds) goes to $steps. The step's own exit status is 0 when it passed.
step() {
    local name=$1 cap=$2 verdict=$3 dest=$4 left rc status start=$SECONDS err
    shift 4
    left=$((deadline - SECONDS))
    (( cap > left )) && cap=$left
    if (( cap < 20 )); then
        printf '%s\tskipped (time budget spent)\t0\n' "$name" >> "$steps"; echo "== $name: skipped"; return 1
    fi
    err="$errdir/$name.stderr"
    echo "== $name (timeout ${cap}s): $*"
    if [[ $dest == - ]]; then timeout -k 10 "$cap" "$@" 2> "$err"; else timeout -k 10 "$cap" "$@" > "$dest" 2> "$err"; fi
    rc=$?
    cat "$err" >&2
    # 124: timeout stopped it; 137 also when the KILL 10 s later was needed, but a command killed otherwise
    # (the OOM killer) exits 137 too, before its time was up.
    if (( rc == 124 || (rc == 137 && SECONDS - start >= cap) )); then
        status="timed out after ${cap}s"
    else
        status=$("$verdict" "$rc" "$dest" "$err")
    fi
    printf '%s\t%s\t%d\n' "$name" "$status" $((SECONDS - start)) >> "$steps"
    echo "== $name: $status in $((SECONDS - start))s"
    [[ $status == ok* ]]
}

# A Python traceback on stderr is a crash whatever the exit status (an uncaught exception exits 1).
_traceback() {
    grep -q '^Traceback (most recent call last):' "$1"
}

# _json_report FILE KEY...: FILE holds one JSON object with every KEY.
_json_report() {
    "$PY" -c 'import json, sys
doc = json.load(open(sys.argv[1]))
sys.exit(0 if isinstance(doc, dict) and all(key in doc for key in sys.argv[2:]) else 1)' "$@" 2>/dev/null
}

# verdict_exit0 RC STDOUT STDERR: passed when the command exited 0.
verdict_exit0() {
    if (( $1 == 0 )); then echo "ok (exit 0)"; else echo "FAILED (exit $1)"; fi
}

# verdict_doctor: `llmctl doctor --json` exits 0 (all passed) or 1 (a check failed) with its JSON report on
# stdout; any other exit status, a traceback or a missing report is a crash of doctor itself.
verdict_doctor() {
    local rc=$1 out=$2 err=$3
    if (( rc != 0 && rc != 1 )); then echo "FAILED (exit $rc: doctor crashed or refused its flags)"
    elif _traceback "$err"; then echo "FAILED (exit $rc with a traceback: doctor crashed)"
    elif ! _json_report "$out" summary results; then echo "FAILED (exit $rc without a JSON report on stdout)"
    else echo "ok (exit $rc)"; fi
}

# verdict_bench_json: `llmctl bench ... --json` exits 0 with its JSON report (results, errors) on stdout.
verdict_bench_json() {
    local rc=$1 out=$2 err=$3
    if (( rc != 0 )); then echo "FAILED (exit $rc)"
    elif ! _json_report "$out" results errors; then echo "FAILED (exit 0 without a JSON report on stdout)"
    else echo "ok (exit 0)"; fi
}

# verdict_offline_json: `llmctl bench throughput/latency ... --json` exits 0 with its report, which names the
# quantisation and the weight and KV-cache bytes it ran with (a run that fell back silently would not).
verdict_offline_json() {
    local rc=$1 out=$2 err=$3
    if (( rc != 0 )); then echo "FAILED (exit $rc)"
    elif ! _json_report "$out" quantization weight_bytes kv_cache_bytes output_tokens_per_second; then
        echo "FAILED (exit 0 without a bench report naming quantization, weight and KV bytes)"
    else echo "ok (exit 0)"; fi
}

# verdict_pytest: pytest exits 0 when every selected test passed or skipped; 5 means nothing was collected.
verdict_pytest() {
    case $1 in
        0) echo "ok (exit 0)" ;;
        1) echo "FAILED (exit 1: tests failed)" ;;
        5) echo "FAILED (exit 5: no tests collected)" ;;
        *) echo "FAILED (exit $1: pytest error)" ;;
    esac
}

# verdict_pytest_ran: as verdict_pytest, and at least one test passed (on a host where CUDA does not work, the
# CUDA tests all skip and pytest exits 0).
verdict_pytest_ran() {
    local status
    status=$(verdict_pytest "$@")
    if [[ $status == ok* ]] && ! tail -n 1 "$2" | grep -q ' passed'; then status="FAILED (exit 0 but no test passed)"; fi
    echo "$status"
}

# verdict_pytest_or_skip: as verdict_pytest; when no test passed but none failed either, ok with the first skip's
# reason (pytest -rs), so a host without what the tests need (a second GPU for TP=2 over NCCL) says why.
verdict_pytest_or_skip() {
    local status reason
    status=$(verdict_pytest "$@")
    if [[ $status == ok* ]] && ! tail -n 1 "$2" | grep -q ' passed'; then
        reason=$(grep -m1 '^SKIPPED' "$2" | sed 's/^SKIPPED \[[0-9]*\] [^ ]*: //')
        status="ok (skipped: ${reason:-no reason given})"
    fi
    echo "$status"
}

# run_logged LOG COMMAND...: COMMAND's stdout and stderr to the terminal and appended to LOG; returns COMMAND's
# exit status once LOG has all of it (a pipeline waits for tee, where `exec > >(tee ...)` does not).
run_logged() {
    local log=$1
    shift
    "$@" 2>&1 | tee -a "$log"
    return "${PIPESTATUS[0]}"
}
