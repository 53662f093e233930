#!/usr/bin/env bash
# One command for a machine with a GPU, inside a time budget, most valuable first: bench/gpt.py (jaxpar vs
# torch.compile) on gpt2 124M, batch 16 x 1024 tokens, bf16; bench/gpt_profile.py (where jaxpar's step goes: its
# GPU kernels by kind); every strategy in its 1-device configuration on GPT-2 (bf16, then fp16 with the loss
# scaler); the GPT model tests on the GPU; GPT-2's state dicts to and from transformers (examples/hf_gpt2.py, on the
# CPU beside the training runs); the CPU test suite if time is left; then one table. First run on an H100 on 2026-11-27 (docs/benchmarks.md).
#
#     bash bench/gpu.sh                 # from the repository root; results also in $OUT (default /tmp/jaxpar-gpu)
#     BUDGET=900 bash bench/gpu.sh      # seconds for all of it (default 480: the device tool's calls end at 600 s)
#     XLA_FLAGS="--xla_gpu_enable_triton_gemm=false --xla_gpu_enable_cublaslt=true" bash bench/gpu.sh
#                                       # jaxpar's fastest GPT step on an H100 (docs/benchmarks.md: the fifth lease); XLA reads
#                                       # the flags, torch does not
#
# The benchmark runs alone; the training runs go PARALLEL (default 3) at a time, each with that share of the GPU's
# memory (compiling, most of a short run, is CPU work), so their tokens/s are not a measurement: bench/gpt.py is.
# The steps run most valuable first, each under `timeout` for the time left; a step that the budget cannot fit
# is recorded as skipped, one that fails or times out as such, and the script goes on. The machine reaches no
# registry: its image has JAX (CUDA), flax, optax, orbax, torch and transformers, so the project is installed
# with --no-deps and without build isolation (which would fetch setuptools), and nothing here imports
# tensorflow-datasets (the text data is the standard library's sources). Its interpreter is `python3`.
# MODEL, SEQ, BATCH, STEPS, VARIANTS, PLATFORM (cuda) and PYTHON change the workload, for a dry run on a CPU;
# FLAG_SETS adds an XLA flag sweep (1c), SWEEP_SECS caps its time (default: all the budget left), SWEEP_VARIANT runs
# it on a variant of 1b (a number, as VARIANTS; default 1, jaxpar's defaults) and TOP lists more
# of the profile's kernels. To spend a short lease on what has not run yet: SKIP names steps to leave out
# (e.g. SKIP="bench_gpt tests_gpu tests_cpu"), and TRAIN the training runs of step 2 as strategy:precision
# (e.g. TRAIN="pipeline:bf16 zero:bf16 single:fp16"; default: every strategy but tp in bf16, then single, ddp and
# pipeline in fp16).
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/jaxpar-gpu}
PY=${PYTHON:-python3}
BUDGET=${BUDGET:-480}
STEPS=${STEPS:-20}
MODEL=${MODEL:-gpt2}
SEQ=${SEQ:-1024}
BATCH=${BATCH:-16}
PLATFORM=${PLATFORM:-cuda}
PARALLEL=${PARALLEL:-3}
mkdir -p "$OUT"
rm -f "$OUT"/*.rc "$OUT"/*.log "$OUT"/*.jsonl "$OUT"/*.secs
T0=$(date +%s)

# run NAME NEED CMD...: CMD under a timeout of the budget left, its output in $OUT/NAME.log and its exit status in
# $OUT/NAME.rc (124: timed out); "skipped" there when fewer than NEED seconds are left
run() {
    local name=$1 need=$2 left
    shift 2
    if [[ " ${SKIP:-} " == *" $name "* ]]; then
        echo "left out" >"$OUT/$name.rc"
        return
    fi
    left=$((BUDGET - ($(date +%s) - T0)))
    if ((left < need)); then
        echo skipped >"$OUT/$name.rc"
        return
    fi
    # SIGABRT at the limit: Python's faulthandler prints where each thread was (a hang and a slow step differ)
    local t0=$SECONDS
    PYTHONFAULTHANDLER=1 timeout --signal=ABRT --kill-after=10 "$left" "$@" >"$OUT/$name.log" 2>&1
    echo "$?" >"$OUT/$name.rc"
    echo $((SECONDS - t0)) >"$OUT/$name.secs"  # the table shows it: the next budget's plan
}

$PY -m pip install --no-deps --no-build-isolation -q -e . >"$OUT/install.log" 2>&1 ||
    echo "pip install failed: see $OUT/install.log"
$PY - <<'EOF' | tee "$OUT/devices.txt"
import jax; print(f"jax {jax.__version__}: {jax.devices()}")
EOF

# the training runs of step 2, checked before anything runs
STRATS=$($PY -c "import jaxpar; print(' '.join(jaxpar.STRATEGIES))")
one_device() {
    case $1 in
        pipeline) echo --num-stages 1 --micro-batches 4 ;;
        single) ;;
        *) echo --num-devices 1 ;;
    esac
}
RUNS=()  # "strategy precision"
if [ -n "${TRAIN:-}" ]; then
    for r in $TRAIN; do
        if [[ ! " $STRATS " == *" ${r%%:*} "* || ! "${r#*:}" =~ ^(fp32|bf16|fp16)$ ]]; then
            echo "TRAIN entry '$r': give strategy:precision, strategy one of $STRATS, precision fp32, bf16 or fp16" \
                "(e.g. TRAIN=\"pipeline:bf16 single:fp16\")" >&2
            exit 2
        fi
        RUNS+=("${r%%:*} ${r#*:}")
    done
else
    for s in $STRATS; do [ "$s" = tp ] || RUNS+=("$s bf16"); done  # tp needs 2 devices: one GPU has no tensor group
    for s in single ddp pipeline; do RUNS+=("$s fp16"); done
fi

# 1. jaxpar vs PyTorch (torch.compile, flash attention) on the same weights and batch: the headline numbers
run bench_gpt 120 $PY bench/gpt.py --model "$MODEL" --batch-size "$BATCH" --seq-len "$SEQ" --precision bf16 \
    --rounds 3 --steps 10

# 1b. where jaxpar's step spends its time on the GPU: jaxpar's step and a hand-written one, their kernels by kind,
#     from jax.profiler traces (the first run's trace is kept in $OUT); VARIANTS=1,2,3,4,5,6 for the first six (about
#     a minute more: per-sample off, 16-bit adds, XLA attention, qkv as three products), VARIANTS=1,6 for qkv as
#     three products alone (BATCH=64, llm.c's micro-batch, changes every step of this script: the fifth lease)
run gpt_profile 90 $PY bench/gpt_profile.py --model "$MODEL" --batch-size "$BATCH" --seq-len "$SEQ" \
    --variants "${VARIANTS:-1,5}" --top "${TOP:-12}" --save-trace "$OUT"

# 1c. only with FLAG_SETS (FLAG_SETS=default: gpt_profile.py's list; or sets like "--xla_a=1 --xla_b=2;--xla_c=3"):
#     jaxpar's default step under each set of XLA flags, each in its own process, against the baseline in the same
#     sweep, twice over where time allows; it prints its table by 15 s before the budget's end, and the steps
#     after it get the time it leaves (about a compile and a few seconds per set and pass: raise BUDGET)
if [ -n "${FLAG_SETS:-}" ]; then
    cap=$((BUDGET - ($(date +%s) - T0) - 15))
    [ -n "${SWEEP_SECS:-}" ] && ((SWEEP_SECS < cap)) && cap=$SWEEP_SECS
    run xla_flags 90 $PY bench/gpt_profile.py --model "$MODEL" --batch-size "$BATCH" --seq-len "$SEQ" \
        --xla-flag-sets="$FLAG_SETS" --rounds 2 --time-limit "$cap" ${SWEEP_VARIANT:+--sweep-variant "$SWEEP_VARIANT"}
fi

# 2. every strategy on one GPU: GPT-2 on the standard library's bytes, bf16; then fp16 with DeepSpeed's dynamic
#    loss scaling (2**16, window 1000, hysteresis 2): the step's own seed and skip
COMMON=(--model "$MODEL" --dataset text --seq-len "$SEQ" --batch-size "$BATCH" --optimizer adamw --lr 6e-4
        --gamma 1.0 --steps "$STEPS" --eval-split 'test[:32]' --eval-batch-size "$BATCH" --log-every 10 --quiet
        --report)
# 4, beside step 2's first runs (it runs on the CPU, and they are not measurements): GPT-2 to and from
#    transformers (the image has it), state-dict files and save_pretrained folders, by logits; last in the order,
#    the budget used to cut it
run hf_gpt2 30 env JAX_PLATFORMS=cpu $PY examples/hf_gpt2.py "$OUT/hf_gpt2" &
share=$($PY -c "print(round(0.9 / $PARALLEL, 2))")
for ((i = 0; i < ${#RUNS[@]}; i += PARALLEL)); do
    for r in "${RUNS[@]:i:PARALLEL}"; do
        read -r s p <<<"$r"
        name=train_$s$([ "$p" = bf16 ] || echo "_$p")  # train_single (bf16), train_single_fp16, ...
        # shellcheck disable=SC2046
        XLA_PYTHON_CLIENT_MEM_FRACTION=$share run "$name" 45 $PY train.py --strategy "$s" "${COMMON[@]}" \
            $(one_device "$s") --precision "$p" --metrics-out "$OUT/$name.jsonl" &
    done
    wait
done

# 3. the GPT model tests on the GPU itself (single-device ones; float32 matmuls at full precision, not TF32); on an
#    H100 they took 185 s (each compiles its own programs), hence after the training runs
run tests_gpu 200 env JAX_PLATFORMS="$PLATFORM" JAX_DEFAULT_MATMUL_PRECISION=highest $PY -m pytest -o addopts="-q" \
    -p no:cacheprovider tests/test_gpt.py -k "logits or state_dict or attention or layers or bf16 or size or init"

# 5. the CPU suite (conftest.py simulates 8 CPU devices; CI runs it too), if the budget has room for it
run tests_cpu 300 $PY -m pytest -o addopts="-q" -n 8 -p no:cacheprovider tests

wait  # nothing is left running: step 4 ended with step 2's first runs
# 6. one table
TRAINED=$(for r in "${RUNS[@]}"; do read -r s p <<<"$r"; echo "$s$([ "$p" = bf16 ] || echo "_$p")"; done) \
OUT="$OUT" PLATFORM="$PLATFORM" ELAPSED=$(($(date +%s) - T0)) BUDGET="$BUDGET" $PY - <<'EOF'
import os, re
out = os.environ["OUT"]
read = lambda f: open(os.path.join(out, f)).read() if os.path.exists(os.path.join(out, f)) else ""


def status(name: str, ok: bool = True) -> str:
    rc, secs = read(f"{name}.rc").strip(), read(f"{name}.secs").strip()
    return {"": "not run", "skipped": "skipped (time budget)", "left out": "left out (SKIP)",
            "124": f"TIMED OUT ({secs} s)"}.get(
        rc, ("ok" if rc == "0" and ok else "FAILED") + (f" ({secs} s)" if secs else ""))


rows = []
for name in ("tests_gpu", "tests_cpu"):
    log = read(f"{name}.log").strip().splitlines()
    where = os.environ["PLATFORM"] if name == "tests_gpu" else "cpu, 8 simulated devices"
    rows.append((f"pytest ({where})", status(name), log[-1] if log else "no output"))
for s in os.environ["TRAINED"].split():
    summary = [l for l in read(f"train_{s}.log").splitlines() if l.startswith("summary:")]
    if summary:
        kv = dict(re.findall(r"(\w+)=(\S+)", summary[-1]))
        tps = kv.get("tokens_per_s", "null")  # null: no step was timed (NaN in train.py, a run too short)
        detail = f"{'-' if tps == 'null' else f'{float(tps):,.0f}'} tokens/s, MFU {kv.get('mfu', '-')}, " \
                 f"train loss {kv.get('train_loss')}, held-out bits/byte {kv.get('eval_bits_per_byte')}" + \
                 (f", skipped steps {kv.get('skipped_steps', 0)}" if s.endswith("fp16") else "")
    else:
        tail = read(f"train_{s}.log").strip().splitlines()
        detail = tail[-1][:160] if tail else "no output"
    strategy, _, precision = s.partition("_")
    label = f"--strategy {strategy} --precision {precision or 'bf16'}"
    rows.append((f"train.py {label} (1 GPU)", status(f"train_{s}", bool(summary)), detail))
interop = [l for l in read("hf_gpt2.log").splitlines() if l.startswith("| ") and "|---" not in l][1:]
worst = max((float(l.rsplit("|", 2)[1]) for l in interop if "FAILED" not in l), default=float("nan"))
hf_tail = read("hf_gpt2.log").strip().splitlines()
rows.append(("examples/hf_gpt2.py (transformers)", status("hf_gpt2", bool(interop) and not any(
    "FAILED" in l for l in interop)), f"{len(interop)} checks, largest logit difference {worst:.1e}" if interop
    else (hf_tail[-1][:160] if hf_tail else "no output")))
bench = read("bench_gpt.log").splitlines()
table = [l for l in bench if l.startswith("|")]
rows.insert(0, ("bench/gpt.py, bf16", status("bench_gpt", bool(table)),
                "see below" if table else (bench[-1][:160] if bench else "no output")))
prof = read("gpt_profile.log").splitlines()
prof_start = next((i for i, l in enumerate(prof) if l.startswith("GPT ")), None)
rows.insert(1, ("bench/gpt_profile.py, bf16", status("gpt_profile", prof_start is not None),
                "see below" if prof_start is not None else (prof[-1][:160] if prof else "no output")))
sweep = read("xla_flags.log").splitlines()
sweep_start = next((i for i, l in enumerate(sweep) if l.startswith("XLA flag sets: ")), None)
if read("xla_flags.rc"):  # FLAG_SETS given
    rows.insert(2, ("bench/gpt_profile.py --xla-flag-sets", status("xla_flags", sweep_start is not None),
                    "see below" if sweep_start is not None else (sweep[-1][:160] if sweep else "no output")))
print("\njaxpar on " + read("devices.txt").strip() + f"; {os.environ['ELAPSED']} s of a {os.environ['BUDGET']} s budget")
print("\n| step | status | result |\n|---|---|---|")
for r in rows:
    print(f"| {r[0]} | {r[1]} | {r[2]} |")
if table:
    start = next(i for i, l in enumerate(bench) if l.startswith("GPT "))
    print("\n" + "\n".join(bench[start:]))
if prof_start is not None:
    print("\n" + "\n".join(prof[prof_start:]))
if sweep_start is not None:
    print("\n" + "\n".join(sweep[sweep_start:]))
print(f"\nlogs in {out}")
EOF
