#!/usr/bin/env bash
# One command for a machine with a GPU: the test suite, every strategy in its 1-device configuration on GPT-2,
# bench/gpt.py (jaxpar vs torch.compile) on gpt2 124M, batch 16 x 1024 tokens, bf16, and GPT-2's state dicts to
# and from transformers (examples/hf_gpt2.py); then one table.
#
#     bash bench/gpu.sh                 # from the repository root; results also in $OUT (default /tmp/jaxpar-gpu)
#
# The machine needs no registry: its image has JAX (CUDA), flax, optax, orbax, torch and transformers, so the
# project is installed with --no-deps, and nothing here imports tensorflow-datasets (the text data is the
# standard library's sources). Steps that fail are recorded as failed and the script goes on.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/jaxpar-gpu}
STEPS=${STEPS:-30}
mkdir -p "$OUT"
python -m pip install --no-deps -q -e . >"$OUT/install.log" 2>&1 || echo "pip install failed: see $OUT/install.log"
python - <<'EOF' | tee "$OUT/devices.txt"
import jax; print(f"jax {jax.__version__}: {jax.devices()}")
EOF

# 1. the test suite: as written (conftest.py simulates 8 CPU devices for the multi-device tests), then the GPT
#    model tests on the GPU itself (single-device ones; float32 matmuls at full precision, not TF32)
python -m pytest -o addopts="-q" -p no:cacheprovider tests >"$OUT/tests_cpu.log" 2>&1  # one process: xdist may be missing
echo "$?" >"$OUT/tests_cpu.rc"
JAX_PLATFORMS=cuda JAX_DEFAULT_MATMUL_PRECISION=highest python -m pytest -o addopts="-q" -p no:cacheprovider tests/test_gpt.py \
    -k "logits or state_dict or attention or layers or bf16 or size or init" >"$OUT/tests_gpu.log" 2>&1
echo "$?" >"$OUT/tests_gpu.rc"

# 2. every strategy on one GPU: GPT-2 124M on the standard library's bytes, batch 16 x 1024, bf16; then fp16
COMMON=(--model gpt2 --dataset text --seq-len 1024 --batch-size 16 --precision bf16 --optimizer adamw --lr 6e-4
        --gamma 1.0 --steps "$STEPS" --eval-split 'test[:64]' --eval-batch-size 16 --log-every 10 --quiet --report)
STRATS=$(python -c "import jaxpar; print(' '.join(jaxpar.STRATEGIES))")
for s in $STRATS; do
    case $s in
        pipeline) extra=(--num-stages 1 --micro-batches 4) ;;
        single) extra=() ;;
        *) extra=(--num-devices 1) ;;
    esac
    python train.py --strategy "$s" "${COMMON[@]}" "${extra[@]}" --metrics-out "$OUT/train_$s.jsonl" \
        >"$OUT/train_$s.log" 2>&1
    echo "$?" >"$OUT/train_$s.rc"
done
# fp16 with DeepSpeed's dynamic loss scaling (2**16, window 1000, hysteresis 2): the step's own seed and skip
for s in single ddp pipeline; do
    case $s in
        pipeline) extra=(--num-stages 1 --micro-batches 4) ;;
        single) extra=() ;;
        *) extra=(--num-devices 1) ;;
    esac
    python train.py --strategy "$s" "${COMMON[@]}" "${extra[@]}" --precision fp16 \
        --metrics-out "$OUT/train_${s}_fp16.jsonl" >"$OUT/train_${s}_fp16.log" 2>&1
    echo "$?" >"$OUT/train_${s}_fp16.rc"
done

# 3. jaxpar vs PyTorch (torch.compile, flash attention) on the same weights and batch
python bench/gpt.py --model gpt2 --batch-size 16 --seq-len 1024 --precision bf16 --rounds 5 --steps 10 \
    >"$OUT/bench_gpt.log" 2>&1
echo "$?" >"$OUT/bench_gpt.rc"

# 4. GPT-2 to and from transformers (the image has it): state-dict files and save_pretrained folders, by logits
JAX_PLATFORMS=cpu python examples/hf_gpt2.py "$OUT/hf_gpt2" >"$OUT/hf_gpt2.log" 2>&1
echo "$?" >"$OUT/hf_gpt2.rc"

# 5. one table
OUT="$OUT" STRATS="$STRATS" python - <<'EOF'
import json, os, re
out = os.environ["OUT"]
read = lambda f: open(os.path.join(out, f)).read() if os.path.exists(os.path.join(out, f)) else ""
rows = []
for name in ("tests_cpu", "tests_gpu"):
    log = read(f"{name}.log").strip().splitlines()
    rows.append((f"pytest ({name.split('_')[1]})", "ok" if read(f"{name}.rc").strip() == "0" else "FAILED",
                 log[-1] if log else "no output"))
for s in [*os.environ["STRATS"].split(), "single_fp16", "ddp_fp16", "pipeline_fp16"]:
    summary = [l for l in read(f"train_{s}.log").splitlines() if l.startswith("summary:")]
    ok = read(f"train_{s}.rc").strip() == "0" and summary
    if ok:
        kv = dict(re.findall(r"(\w+)=(\S+)", summary[-1]))
        mfu = [l for l in read(f"train_{s}.log").splitlines() if l.startswith("MFU")]
        detail = f"{float(kv.get('tokens_per_s', 'nan')):,.0f} tokens/s, MFU {kv.get('mfu', '-')}, " \
                 f"train loss {kv.get('train_loss')}, held-out bits/byte {kv.get('eval_bits_per_byte')}" + \
                 (f", skipped steps {kv.get('skipped_steps', 0)}" if s.endswith("fp16") else "")
    else:
        tail = read(f"train_{s}.log").strip().splitlines()
        detail = tail[-1][:160] if tail else "no output"
    label = f"--strategy {s.removesuffix('_fp16')} --precision fp16" if s.endswith("fp16") else f"--strategy {s}"
    rows.append((f"train.py {label} (1 GPU)", "ok" if ok else "FAILED", detail))
interop = [l for l in read("hf_gpt2.log").splitlines() if l.startswith("| ") and "|---" not in l][1:]
worst = max((float(l.rsplit("|", 2)[1]) for l in interop if "FAILED" not in l), default=float("nan"))
rows.append(("examples/hf_gpt2.py (transformers)", "ok" if read("hf_gpt2.rc").strip() == "0" and interop and not
             any("FAILED" in l for l in interop) else "FAILED", f"{len(interop)} checks, largest logit difference "
             f"{worst:.1e}" if interop else "no output"))
bench = read("bench_gpt.log").splitlines()
table = [l for l in bench if l.startswith("|")]
rows.append(("bench/gpt.py gpt2 16x1024 bf16", "ok" if read("bench_gpt.rc").strip() == "0" else "FAILED",
             "see below" if table else (bench[-1][:160] if bench else "no output")))
width = max(len(r[0]) for r in rows)
print("\njaxpar on " + read("devices.txt").strip())
print("\n| step | status | result |\n|---|---|---|")
for r in rows:
    print(f"| {r[0]} | {r[1]} | {r[2]} |")
if table:
    start = next(i for i, l in enumerate(bench) if l.startswith("GPT "))
    print("\n" + "\n".join(bench[start:]))
print(f"\nlogs in {out}")
EOF
