#!/usr/bin/env bash
# Per-kernel GPU durations of any command, from Nsight Compute's gpu__time_duration (one metric:
# one pass per kernel, no memory save and restore), as a table: kernel, launches, median, min, max,
# total µs. Every kernel of the command is listed (XLA's too), so a jitted MoE layer's time can be
# split into ours and the rest. Kernels run one at a time under ncu, so the sum is not the step's
# wall time; each duration is the kernel's own. Run on the GPU machine:
#   OUT=dir LABEL=name [NCU_SKIP=n] [NCU_COUNT=n] [NCU_KERNELS=regex] bash scripts/ncu_durations.sh python3 prog.py ...
# Writes $OUT/ncu-dur-$LABEL.csv (raw) and prints the table (also $OUT/ncu-dur-$LABEL.txt).
set -uo pipefail
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"; OUT=$(cd "$OUT" && pwd)
LABEL=${LABEL:-run}
FILTER=()
[ -n "${NCU_KERNELS:-}" ] && FILTER=(-k "regex:$NCU_KERNELS")
env XLA_PYTHON_CLIENT_PREALLOCATE=false timeout "${NCU_TIMEOUT:-200}" ncu --clock-control none --metrics gpu__time_duration.sum \
  "${FILTER[@]}" --launch-skip "${NCU_SKIP:-0}" --launch-count "${NCU_COUNT:-4000}" -f -o "$OUT/ncu-dur-$LABEL" "$@" \
  > "$OUT/ncu-dur-$LABEL.log" 2>&1
ncu --import "$OUT/ncu-dur-$LABEL.ncu-rep" --csv --page raw --metrics gpu__time_duration.sum > "$OUT/ncu-dur-$LABEL.csv" 2>&1
python3 - "$OUT/ncu-dur-$LABEL.csv" <<'EOF' | tee "$OUT/ncu-dur-$LABEL.txt"
import csv, statistics, sys, re
rows = list(csv.reader(open(sys.argv[1])))
if not rows or "Kernel Name" not in rows[0]:
    print("no kernels profiled:", rows[:2]); sys.exit(0)
h = rows[0]; ki = h.index("Kernel Name"); di = h.index("gpu__time_duration.sum")
unit = rows[1][di] if len(rows) > 1 else ""
scale = {"nsecond": 1e-3, "ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3, "ms": 1e3}.get(unit.strip(), 1.0)
per = {}
for r in rows[2:]:
    try:
        v = float(r[di].replace(",", "")) * scale
    except (ValueError, IndexError):
        continue
    name = re.sub(r"\(.*", "", r[ki]).split("::")[-1][:60]
    per.setdefault(name, []).append(v)
print(f"{'kernel':60} {'n':>5} {'median':>8} {'min':>8} {'max':>8} {'total':>10}  (µs)")
for name, vs in sorted(per.items(), key=lambda kv: -sum(kv[1])):
    print(f"{name:60} {len(vs):5d} {statistics.median(vs):8.2f} {min(vs):8.2f} {max(vs):8.2f} {sum(vs):10.1f}")
EOF
