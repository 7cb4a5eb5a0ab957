#!/usr/bin/env bash
# Start multi-worker training: one process per worker, each with its
# TF_CONFIG (the cluster's addresses, and which task this process is), as
# tf.distribute.MultiWorkerMirroredStrategy reads it.
#
# Three ways to run it:
#
#   1. Local cluster (default): N workers on 127.0.0.1, for trying things
#      out or for one machine with several GPUs per process. Each
#      worker's output lines start with "[worker I] ".
#        examples/launch_tf_config.sh -n 2 -- \
#            python examples/multi_worker.py --quick --backup-dir /tmp/run1
#
#   2. Slurm: under `srun` each task computes its own TF_CONFIG from
#      Slurm's variables and runs the command (one task per node):
#        srun --nodes=4 --ntasks-per-node=1 \
#            examples/launch_tf_config.sh -- \
#            python train.py --backup-dir /shared/run1
#      The mapping: the hosts are `scontrol show hostnames
#      $SLURM_JOB_NODELIST` (node[01-04] -> node01 ... node04), each at
#      port $PORT (default 23456); this task is worker $SLURM_PROCID. With
#      several tasks per node, the port is $PORT + $SLURM_LOCALID and the
#      worker list repeats each host $SLURM_NTASKS_PER_NODE times (Slurm's
#      default block distribution numbers a node's tasks consecutively).
#
#   3. Any other scheduler or plain ssh: give the hosts and this process's
#      index, on every host:
#        examples/launch_tf_config.sh --hosts host1,host2 --index 0 -- \
#            python train.py --backup-dir /shared/run1
#
# --dry-run prints each TF_CONFIG and command instead of running it
# (nothing is started; try the Slurm mapping on a laptop with
# SLURM_PROCID=1 SLURM_NTASKS=2 SLURM_JOB_NODELIST='node[01-02]').
#
# Every worker must run the same command; restart all of them after a
# failure (keras_mgpu.callbacks.BackupAndRestore resumes from the last
# backup). Environment: PORT (first port, default 23456), PYTHON (the
# interpreter that writes the JSON, default python3).
set -euo pipefail

usage() {
    # The comment block at the top of this file.
    awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"
    exit "${1:-0}"
}

workers=2
hosts=""
index=""
dry_run=0
port="${PORT:-23456}"
python="${PYTHON:-python3}"
while [[ $# -gt 0 ]]; do
    case "$1" in
        -n | --workers) workers="$2"; shift 2 ;;
        --hosts) hosts="$2"; shift 2 ;;
        --index) index="$2"; shift 2 ;;
        --dry-run) dry_run=1; shift ;;
        -h | --help) usage 0 ;;
        --) shift; break ;;
        *) echo "launch_tf_config.sh: unknown option '$1'" >&2; usage 2 ;;
    esac
done
if [[ $# -eq 0 ]]; then
    echo "launch_tf_config.sh: no command (give it after --)" >&2
    usage 2
fi

# Expands a Slurm node list ("node[01-03,07],gpu5") with scontrol where it
# exists, else with a small parser for that common form.
expand_nodelist() {
    if command -v scontrol > /dev/null 2>&1; then
        scontrol show hostnames "$1" | paste -sd, -
        return
    fi
    "$python" - "$1" << 'EOF'
import re, sys
hosts = []
for prefix, ranges, plain in re.findall(r"([^,\[]+)\[([^\]]+)\]|([^,\[\]]+)", sys.argv[1]):
    if plain:
        hosts.append(plain)
        continue
    for part in ranges.split(","):
        first, _, last = part.partition("-")
        for n in range(int(first), int(last or first) + 1):
            hosts.append(f"{prefix}{n:0{len(first)}d}")
print(",".join(hosts))
EOF
}

# Copies standard input to standard output, each line prefixed by $1 and
# written whole.
prefix_lines() {
    awk -v prefix="$1" '{ print prefix $0; fflush() }'
}

# TF_CONFIG for task $2 of the comma-separated "host:port" list $1.
tf_config() {
    "$python" -c '
import json, sys
print(json.dumps({"cluster": {"worker": sys.argv[1].split(",")},
                  "task": {"type": "worker", "index": int(sys.argv[2])}}))
' "$1" "$2"
}

run_one() {  # $1: TF_CONFIG, then the command
    local config="$1"
    shift
    echo "TF_CONFIG='$config' $*"
    if [[ $dry_run -eq 0 ]]; then
        TF_CONFIG="$config" exec "$@"
    fi
}

if [[ -n "${SLURM_PROCID:-}" && -z "$hosts" ]]; then
    # Slurm: one TF_CONFIG per task, computed inside the task.
    per_node="${SLURM_NTASKS_PER_NODE:-1}"
    per_node="${per_node%%(*}"  # "2(x4)" -> "2"
    addresses=()
    for host in $(expand_nodelist "$SLURM_JOB_NODELIST" | tr , ' '); do
        for ((local_id = 0; local_id < per_node; local_id++)); do
            addresses+=("$host:$((port + local_id))")
        done
    done
    list=$(IFS=,; echo "${addresses[*]}")
    run_one "$(tf_config "$list" "$SLURM_PROCID")" "$@"
elif [[ -n "$hosts" ]]; then
    # A host list: this process is worker --index.
    if [[ -z "$index" ]]; then
        echo "launch_tf_config.sh: --hosts needs --index (this host's" \
            "position in the list)" >&2
        exit 2
    fi
    addresses=()
    for host in ${hosts//,/ }; do
        addresses+=("$host:$port")
    done
    list=$(IFS=,; echo "${addresses[*]}")
    run_one "$(tf_config "$list" "$index")" "$@"
else
    # A local cluster on 127.0.0.1: start every worker here, wait for all.
    addresses=()
    for ((i = 0; i < workers; i++)); do
        addresses+=("127.0.0.1:$((port + i))")
    done
    list=$(IFS=,; echo "${addresses[*]}")
    pids=()
    # Never leave workers behind: on exit or Ctrl-C, stop those still
    # running.
    trap 'for p in "${pids[@]}"; do kill "$p" 2> /dev/null || true; done' \
        EXIT INT TERM
    for ((i = 0; i < workers; i++)); do
        config=$(tf_config "$list" "$i")
        if [[ $dry_run -eq 1 ]]; then
            run_one "$config" "$@"
        else
            echo "TF_CONFIG='$config' $*"
            # Each worker's lines through a filter of its own, prefixed:
            # workers write a line in several pieces when Python runs
            # unbuffered (PYTHONUNBUFFERED, common in CI), and pieces from
            # two workers sharing one stdout would mix within a line.
            TF_CONFIG="$config" "$@" > >(prefix_lines "[worker $i] ") &
            pids+=("$!")
        fi
    done
    status=0
    for p in "${pids[@]}"; do
        wait "$p" || status=$?
    done
    trap - EXIT INT TERM
    exit "$status"
fi
