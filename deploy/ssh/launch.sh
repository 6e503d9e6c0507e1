#!/usr/bin/env bash
# `slipstream train` across hosts over ssh: one ssh per host of HOSTFILE, each running the same command
# (torchrun's convention) with its own --node-rank. The first host is node 0, the head: it runs the
# coordinator and writes the run's CURVE key to RUN_DIR/keys/run.key; every other node runs an agent that
# waits for that key, joins the head and starts the actors placed on it.
#
#   deploy/ssh/launch.sh HOSTFILE CONFIG [RUN_DIR] [key=value overrides...]
#   SLIPSTREAM_PYTHON=/shared/venv/bin/python SSH_OPTS="-i ~/.ssh/cluster -p 2222" \
#       deploy/ssh/launch.sh hosts.txt deploy/configs/gpu-7b.yaml /shared/runs/7b steps=500
#
# HOSTFILE: one ssh destination a line (`host` or `user@host`; words after the first, `#` comments and
# blank lines are ignored). RUN_DIR (default runs/train-<time>; a third argument with `=` in it is an
# override, not RUN_DIR) must be on a filesystem every host and this one see: each host's stdout and stderr
# are written here to RUN_DIR/launch/<host>-<rank>.log. Relative CONFIG and RUN_DIR are from SLIPSTREAM_DIR.
#
# Environment:
#   SSH, SSH_OPTS        the ssh command and its options, parsed as shell words (default `ssh`, none),
#                        e.g. SSH_OPTS="-i KEY -p PORT -o StrictHostKeyChecking=accept-new"
#   MASTER_PORT          the head's port; every port of the run derives from it (default 29500)
#   MASTER_ADDR          the head's address as the other hosts reach it (default: the first host, resolved
#                        here with getent; a loopback address is refused, since the others cannot reach it)
#   SLIPSTREAM_DIR       the directory every host runs in (default: this one, $PWD)
#   SLIPSTREAM_PYTHON    the python with slipstream installed on every host (default `python` on the remote
#                        login PATH, which is not this shell's: an absolute path is safer)
#   SLIPSTREAM_ENV       environment for every host, words `NAME` (this shell's value) or `NAME=VALUE`: an
#                        ssh'd command inherits nothing from here
#   SLIPSTREAM_ARGS      more `slipstream train` flags, word-split (e.g. "--join-timeout 600 --keys DIR")
#
# Stopping: when a node fails, or on Ctrl-C / SIGTERM, the ssh processes of the others are killed. Without
# a tty (ssh -tt needs an interactive stdin) killing ssh does not signal the remote command, so each host
# runs its command beside a watcher of the ssh session's stdin, which this script holds open: when the
# session closes, the watcher sends SIGTERM to `slipstream train` (its actors die with it, PR_SET_PDEATHSIG).
# Were a watcher lost, an agent still stops when its head goes silent (head_lost). Exits 0 when every node
# exited 0, else with the status of the first node that failed, naming it.
set -euo pipefail
((BASH_VERSINFO[0] * 100 + BASH_VERSINFO[1] >= 404)) || { echo "$0: needs bash >= 4.4" >&2; exit 2; }

usage() {
    echo "usage: $0 HOSTFILE CONFIG [RUN_DIR] [key=value overrides...]" >&2
    exit 2
}
die() {
    echo "launch: $*" >&2
    exit 2
}
(($# >= 2)) || usage
HOSTFILE=$1 CONFIG=$2
shift 2
RUN_DIR=""
if (($#)) && [[ $1 != *=* ]]; then
    RUN_DIR=$1
    shift
fi
overrides=("$@")

[[ -r $HOSTFILE ]] || die "HOSTFILE $HOSTFILE: not a readable file"
hosts=()
while IFS= read -r line || [[ -n $line ]]; do
    line=${line%%#*}
    read -ra words <<<"$line"
    if ((${#words[@]})); then
        hosts+=("${words[0]}")
    fi
done <"$HOSTFILE"
NNODES=${#hosts[@]}
((NNODES)) || die "HOSTFILE $HOSTFILE: no hosts in it"

ssh_cmd=() ssh_opts=()
eval "ssh_cmd=(${SSH:-ssh})"
eval "ssh_opts=(${SSH_OPTS:-})"
PORT=${MASTER_PORT:-29500}
PYTHON=${SLIPSTREAM_PYTHON:-python}
WORKDIR=${SLIPSTREAM_DIR:-$PWD}
RUN_DIR=${RUN_DIR:-runs/train-$(date +%Y%m%d-%H%M%S)}
[[ $RUN_DIR == /* ]] || RUN_DIR=$WORKDIR/$RUN_DIR
read -ra extra <<<"${SLIPSTREAM_ARGS:-}"
envs=()
read -ra env_words <<<"${SLIPSTREAM_ENV:-}"
for word in "${env_words[@]}"; do
    [[ $word =~ ^[A-Za-z_][A-Za-z0-9_]*(=.*)?$ ]] || die "SLIPSTREAM_ENV: $word is not NAME or NAME=VALUE"
    if [[ $word == *=* ]]; then
        envs+=("$word")
    elif [[ -n ${!word+set} ]]; then
        envs+=("$word=${!word}")
    fi
done

# The head's address: resolved here, where the hostfile's names mean what they mean to ssh. A name this
# host cannot resolve is passed on as it is, for each host to resolve (the CLI refuses a loopback there too).
HEAD_NAME=${hosts[0]##*@}
if [[ -n ${MASTER_ADDR:-} ]]; then
    HEAD=$MASTER_ADDR
elif ! HEAD=$(getent ahostsv4 "$HEAD_NAME" 2>/dev/null | awk 'NR == 1 { print $1 }') || [[ -z $HEAD ]]; then
    echo "launch: cannot resolve $HEAD_NAME here; each host resolves it (or set MASTER_ADDR)" >&2
    HEAD=$HEAD_NAME
fi
case $HEAD in
127.* | localhost | localhost.* | ::1)
    die "the head $HEAD_NAME is a loopback address ($HEAD): the other hosts cannot reach it; put an address" \
        "they reach in $HOSTFILE, or set MASTER_ADDR"
    ;;
esac

# One POSIX-shell word: the remote login shell parses the command line ssh sends it.
quote() { printf "'%s'" "${1//\'/\'\\\'\'}"; }
words() {
    local out="" w
    for w in "$@"; do
        out+="$(quote "$w") "
    done
    printf '%s' "${out% }"
}

remote_command() {  # rank -> the command line one host runs
    local train script
    train=$(words env "${envs[@]}" "$PYTHON" -m slipstream.cli.main train "$CONFIG" "${overrides[@]}" \
        --nnodes "$NNODES" --node-rank "$1" --head "$HEAD:$PORT" --run-dir "$RUN_DIR" "${extra[@]}")
    # fd 3: the session's stdin, read by the watcher only; EOF there means the ssh client is gone.
    script="cd $(quote "$WORKDIR") || exit 1; exec 3<&0; $train </dev/null 3<&- & pid=\$!;"
    script+=" { while read -r _; do :; done <&3; kill -TERM \"\$pid\"; } >/dev/null 2>&1 & watch=\$!;"
    script+=" exec 3<&-; wait \"\$pid\"; rc=\$?; kill \"\$watch\" 2>/dev/null; exit \"\$rc\""
    words sh -c "$script"
}

LOGS=$RUN_DIR/launch
mkdir -p "$LOGS"
tmp=$(mktemp -d)
mkfifo "$tmp/hold"
exec 3<>"$tmp/hold"  # every ssh's stdin: never written, never at EOF while this script lives

pids=()
stopping=""
running() {  # this script's ssh processes still running, as bash's job table has them (no pid reuse)
    printf ' %s ' "$(jobs -rp | tr '\n' ' ')"
}
stop_all() {
    local pid
    for pid in $(running); do
        kill -TERM "$pid" 2>/dev/null || true
    done
}
on_signal() {
    echo "launch: $1, stopping every node" >&2
    stopping=$1
    stop_all
}
trap 'on_signal SIGINT' INT
trap 'on_signal SIGTERM' TERM
trap 'stop_all; rm -rf "$tmp"' EXIT

echo "launch: $NNODES nodes, head $HEAD:$PORT (${hosts[0]}), run dir $RUN_DIR" >&2
for rank in "${!hosts[@]}"; do
    log=$LOGS/${hosts[rank]##*@}-$rank.log
    "${ssh_cmd[@]}" "${ssh_opts[@]}" "${hosts[rank]}" "$(remote_command "$rank")" <&3 >"$log" 2>&1 &
    pids[rank]=$!
    echo "launch: node $rank on ${hosts[rank]}, log $log" >&2
done

failed="" status=0
live=("${!pids[@]}")
while ((${#live[@]})); do
    still=()
    now=$(running)
    for rank in "${live[@]}"; do
        if [[ $now == *" ${pids[rank]} "* ]]; then
            still+=("$rank")
            continue
        fi
        rc=0
        wait "${pids[rank]}" || rc=$?
        host=${hosts[rank]} log=$LOGS/${hosts[rank]##*@}-$rank.log
        if ((rc == 0)); then
            echo "launch: node $rank ($host) finished" >&2
        elif [[ -n $failed || -n $stopping ]]; then
            echo "launch: node $rank ($host) stopped (exit $rc)" >&2
        else
            failed=$rank status=$rc
            why="exit $rc"
            ((rc != 255)) || why="ssh exit 255: could not connect, or the connection was lost"
            echo "launch: node $rank ($host) failed ($why); see $log:" >&2
            tail -n 20 "$log" | sed 's/^/    /' >&2 || true
            echo "launch: stopping the other nodes" >&2
            stop_all
        fi
    done
    live=("${still[@]}")
    if ((${#live[@]})); then
        sleep 1
    fi
done

if [[ -n $failed ]]; then
    echo "launch: FAILED: node $failed (${hosts[failed]}) exited $status; logs in $LOGS" >&2
    exit "$status"
fi
case $stopping in
SIGINT) exit 130 ;;
SIGTERM) exit 143 ;;
esac
echo "launch: all $NNODES nodes finished; run dir $RUN_DIR" >&2
