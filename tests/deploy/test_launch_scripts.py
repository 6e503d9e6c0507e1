"""The launch recipes of deploy/: the SLURM batch script (deploy/slurm/train.sbatch) and the ssh launcher
(deploy/ssh/launch.sh), each driving a real 2-step run across two "hosts" (tests/netns.py: two network
namespaces joined by a veth pair), and each checked cheaply for the command lines it builds.

- sbatch: run with bash (#SBATCH lines are comments) under a fake `srun` first on PATH that starts the task
  once per node, node i inside namespace i, with the variables srun sets (SLURM_NODEID, SLURM_PROCID, ...).
- ssh: a real OpenSSH server in each namespace (its own host key, the test's key authorized), the launcher
  run from node 0's namespace, as from the head. Without /usr/sbin/sshd the test fails saying how to
  install it (CI: apt-get install -y openssh-server); it never skips.
- The cheap checks put a fake `ssh`/`srun` on PATH and a fake python that prints the argv it was given.

Needs root (namespaces, sshd); CI runs as root.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest

from tests import netns
from tests.cli.conftest import config

pytestmark = pytest.mark.timeout(600)


REPO = Path(__file__).resolve().parents[2]
SBATCH = REPO / "deploy" / "slurm" / "train.sbatch"
LAUNCH = REPO / "deploy" / "ssh" / "launch.sh"
PORT = 29500
SSHD = "/usr/sbin/sshd"

# srun's stand-in: the task once per node, node i in namespace i of FAKE_SLURM_NETNS (else on this host, as
# many as SLURM_NNODES), each with what srun sets in a task; exits non-zero if any task did.
FAKE_SRUN = r"""#!/usr/bin/env bash
set -u
printf '%s\n' "$@" > "$FAKE_SLURM_DIR/srun.args"
while [[ $# -gt 0 && $1 == -* ]]; do shift; done
if [[ -n ${FAKE_SLURM_NETNS:-} ]]; then read -ra netns <<<"$FAKE_SLURM_NETNS"; n=${#netns[@]}; else n=$SLURM_NNODES; fi
pids=()
for ((i = 0; i < n; i++)); do
    prefix=()
    if [[ -n ${FAKE_SLURM_NETNS:-} ]]; then prefix=(ip netns exec "${netns[i]}"); fi
    "${prefix[@]}" env SLURM_NODEID="$i" SLURM_PROCID="$i" SLURM_LOCALID=0 SLURM_NNODES="$n" \
        SLURM_JOB_NODELIST="$SLURM_JOB_NODELIST" SLURMD_NODENAME="node$i" "$@" > "$FAKE_SLURM_DIR/task-$i.out" 2>&1 &
    pids+=($!)
done
rc=0
for pid in "${pids[@]}"; do wait "$pid" || rc=$?; done
exit $rc
"""

# scontrol's stand-in for `scontrol show hostnames LIST` (a comma list, no ranges); FAKE_SCONTROL_FAIL: as
# where scontrol cannot answer, so the script leaves the node list to the CLI.
FAKE_SCONTROL = r"""#!/usr/bin/env bash
[[ -z ${FAKE_SCONTROL_FAIL:-} && $1 == show && $2 == hostnames ]] || exit 1
tr ',' '\n' <<<"$3"
"""

# ssh's stand-in: records its arguments in FAKE_SSH_DIR/<host>.args; FAKE_SSH_FAIL's host fails at once,
# FAKE_SSH_HANG's hosts run until killed; any other runs the remote command here as sshd would: through a
# shell, in a bare environment, its stdin a pipe that this "ssh" holds open until it exits or is killed.
FAKE_SSH = r"""#!/usr/bin/env bash
host=${*: -2:1}
printf '%s\n' "$@" > "$FAKE_SSH_DIR/$host.args"
if [[ $host == "${FAKE_SSH_FAIL:-}" ]]; then echo "no route to $host" >&2; exit 1; fi
if [[ " ${FAKE_SSH_HANG:-} " == *" $host "* ]]; then exec -a "sleep-for-$FAKE_SSH_DIR" sleep 300; fi
session=$FAKE_SSH_DIR/$host.stdin
rm -f "$session" && mkfifo "$session"
env -i HOME="$HOME" PATH=/usr/bin:/bin bash -c "${*: -1}" <"$session" &
remote=$!
exec 4>"$session"
wait "$remote"
"""

# A python that only says how it was called: one JSON line of its argv, directory and chosen variables.
FAKE_PYTHON = f"""#!{sys.executable}
import json, os, sys, time
keys = ("CI", "MASTER_PORT", "SLURM_NODEID", "SLURM_PROCID", "FROM_HERE", "UNSET_HERE")
print(json.dumps({{"argv": sys.argv[1:], "cwd": os.getcwd(), "env": {{k: os.environ.get(k) for k in keys}}}}))
if os.environ.get("FAKE_PYTHON_HOLD"):  # then as a run would: running until stopped
    sys.stdout.flush()
    open(os.path.join(os.environ["FAKE_PYTHON_HOLD"], str(os.getpid())), "w").close()
    time.sleep(300)
"""


def executable(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(0o755)
    return path


def fake_bin(tmp_path: Path, **scripts: str) -> Path:
    """A directory of stand-ins to put first on PATH."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, text in scripts.items():
        executable(bin_dir / name, text)
    return bin_dir


def clean_env(**extra: str) -> dict[str, str]:
    """This environment without the names the scripts and the CLI read, plus `extra`."""
    drop = ("MASTER_ADDR", "MASTER_PORT", "NNODES", "NODE_RANK", "SSH", "SSH_OPTS", "SLIPSTREAM_ARGS",
            "SLIPSTREAM_ENV", "SLIPSTREAM_DIR", "SLIPSTREAM_PYTHON", "CONFIG", "RUN_DIR")  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k not in drop and not k.startswith("SLURM_")}
    return {**env, **extra}


def events(run_dir: Path, name: str) -> list[dict]:
    path = run_dir / "logs" / f"{name}.jsonl"
    return [msgspec.json.decode(line) for line in path.read_bytes().splitlines()] if path.exists() else []


def assert_two_step_run(run_dir: Path, why: str) -> None:
    """The run finished its 2 steps, and node 1's agent started node 1's actors."""
    summary = run_dir / "summary.json"
    assert summary.exists(), f"no summary.json: {why}"
    assert len(json.loads(summary.read_text())["steps"]) == 2
    started = sorted(e["actor"] for e in events(run_dir, "agent-1") if e["event"] == "actor_started")
    assert started == ["drafter:0", "rollout:0"], why


@pytest.fixture
def two_nodes() -> Iterator[tuple[str, str, str, str]]:
    """Two namespaces joined by a veth pair: (netns 0, its address, netns 1, its address)."""
    with netns.two_nodes() as nodes:
        yield nodes


@pytest.fixture
def cfg_file(tiny_chat: Path, tmp_path: Path) -> Path:
    """The 2-step config of tests/cli/test_train_nodes.py: learner and verifier on node 0, a rollout (and
    the drafter, on its idle windows) on node 1."""
    cfg = config(
        tiny_chat,
        steps=2,
        rollout={"devices": 1, "verify_weights": True},
        nodes=[{"learners": 1, "verifiers": 1}, {"rollouts": 1}],
    )
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps(msgspec.to_builtins(cfg)))
    return path


def processes(marker: str) -> dict[int, list[str]]:
    """This machine's processes with `marker` in an argument: pid -> command line."""
    found = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            argv = (proc / "cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:  # gone meanwhile
            continue
        if any(marker in arg for arg in argv):
            found[int(proc.name)] = argv
    return found


def kill_leftovers(marker: str) -> None:
    """SIGKILL what a failed test left running: the processes it started name its own `marker` path."""
    for pid in processes(marker):
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)


def tail(path: Path, chars: int = 3000) -> str:
    return path.read_text(errors="replace")[-chars:] if path.exists() else f"({path} missing)"


# --- SLURM -----------------------------------------------------------------------------------------------


def test_sbatch_under_srun_trains_two_steps_across_two_nodes(
    two_nodes: tuple[str, str, str, str], cfg_file: Path, tmp_path: Path
) -> None:
    ns0, ip0, ns1, ip1 = two_nodes
    bin_dir = fake_bin(tmp_path, srun=FAKE_SRUN, scontrol=FAKE_SCONTROL)
    run_dir = tmp_path / "run"
    env = clean_env(
        PATH=f"{bin_dir}:{os.environ['PATH']}",
        CI="true",
        FAKE_SLURM_DIR=str(tmp_path),
        FAKE_SLURM_NETNS=f"{ns0} {ns1}",
        # What sbatch sets in the batch script's environment.
        SLURM_JOB_ID="4242",
        SLURM_NNODES="2",
        SLURM_JOB_NUM_NODES="2",
        SLURM_JOB_NODELIST=f"{ip0},{ip1}",
        SLURM_SUBMIT_DIR=str(REPO),
        MASTER_PORT=str(PORT),
        SLIPSTREAM_PYTHON=sys.executable,
        SLIPSTREAM_ARGS="--join-timeout 120",
    )
    try:
        done = subprocess.run(["bash", str(SBATCH), str(cfg_file), str(run_dir)], env=env, cwd=tmp_path,
                              capture_output=True, text=True, timeout=480)  # fmt: skip
    finally:
        kill_leftovers(str(tmp_path))
    why = f"{done.stderr[-2000:]}\nnode 0:\n{tail(tmp_path / 'task-0.out')}\nnode 1:\n{tail(tmp_path / 'task-1.out')}"
    assert done.returncode == 0, why
    assert_two_step_run(run_dir, why)
    # Each node's command line is in the job's log: the head (scontrol's first host) and its own rank.
    for rank in (0, 1):
        said = (tmp_path / f"task-{rank}.out").read_text()
        assert f"--head {ip0}:{PORT}" in said and f"--node-rank {rank}" in said, said[:2000]


def test_sbatch_builds_one_command_per_node_and_falls_back_to_the_clis_node_list(tmp_path: Path) -> None:
    bin_dir = fake_bin(tmp_path, srun=FAKE_SRUN, scontrol=FAKE_SCONTROL)
    fake_python = executable(tmp_path / "python", FAKE_PYTHON)
    env = clean_env(
        PATH=f"{bin_dir}:{os.environ['PATH']}",
        FAKE_SLURM_DIR=str(tmp_path),
        SLURM_JOB_ID="7",
        SLURM_NNODES="2",
        SLURM_JOB_NODELIST="gpu03,gpu04",
        SLURM_SUBMIT_DIR=str(tmp_path),
        MASTER_PORT="29511",
        SLIPSTREAM_PYTHON=str(fake_python),
        SLIPSTREAM_ARGS="--join-timeout 60",
    )

    def run(*args: str, **more: str) -> list[dict]:
        done = subprocess.run(["bash", str(SBATCH), *args], env={**env, **more}, cwd=tmp_path,
                              capture_output=True, text=True, timeout=60)  # fmt: skip
        assert done.returncode == 0, done.stderr
        return [json.loads((tmp_path / f"task-{i}.out").read_text().splitlines()[-1]) for i in (0, 1)]

    srun = ["--nodes=2", "--ntasks=2", "--ntasks-per-node=1", "--kill-on-bad-exit=1"]
    for rank, called in enumerate(run("cfg.yaml", "runs/r", "steps=5", "task_options.note=a 'b' c")):
        assert called["argv"] == [
            "-m", "slipstream.cli.main", "train", "cfg.yaml", "steps=5", "task_options.note=a 'b' c",
            "--nnodes", "2", "--run-dir", "runs/r", "--head", "gpu03:29511", "--join-timeout", "60",
            "--node-rank", str(rank),
        ]  # fmt: skip
        assert called["env"]["SLURM_NODEID"] == str(rank) and called["cwd"] == str(tmp_path)
    assert (tmp_path / "srun.args").read_text().splitlines()[: len(srun)] == srun
    # Where scontrol cannot expand the list: no --head, and the CLI reads SLURM_JOB_NODELIST and MASTER_PORT.
    for rank, called in enumerate(run(FAKE_SCONTROL_FAIL="1", CONFIG="c.yaml", RUN_DIR="/shared/run")):
        assert "--head" not in called["argv"]
        assert called["argv"][3:8] == ["c.yaml", "--nnodes", "2", "--run-dir", "/shared/run"]
        assert called["argv"][-2:] == ["--node-rank", str(rank)] and called["env"]["MASTER_PORT"] == "29511"
    # MASTER_ADDR names the head over the node list.
    assert all("10.9.8.7:29511" in c["argv"] for c in run("c.yaml", "r", MASTER_ADDR="10.9.8.7"))
    # No config: the usage, and nothing started.
    (tmp_path / "srun.args").unlink()
    done = subprocess.run(["bash", str(SBATCH)], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "usage: sbatch" in done.stderr
    assert not (tmp_path / "srun.args").exists()


# --- ssh -------------------------------------------------------------------------------------------------


def start_sshd(ns: str, ip: str, tmp_path: Path, authorized: Path) -> tuple[subprocess.Popen, Path]:
    """A real OpenSSH server on ip:22 inside namespace `ns`, with its own host key; the test's key logs in."""
    home = tmp_path / f"sshd-{ns}"
    home.mkdir()
    host_key = home / "host_ed25519"
    netns.sh("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(host_key))
    conf = home / "sshd_config"
    conf.write_text(
        f"Port 22\nListenAddress {ip}\nHostKey {host_key}\nPidFile {home / 'sshd.pid'}\n"
        f"AuthorizedKeysFile {authorized}\nPermitRootLogin yes\nPubkeyAuthentication yes\n"
        "PasswordAuthentication no\nKbdInteractiveAuthentication no\nUsePAM no\nStrictModes no\n"
        "LogLevel VERBOSE\n"
    )
    log = home / "sshd.log"
    proc = subprocess.Popen(["ip", "netns", "exec", ns, SSHD, "-D", "-e", "-f", str(conf)],
                            stdout=log.open("w"), stderr=subprocess.STDOUT)  # fmt: skip
    return proc, log


def wait_listening(procs: list[tuple[subprocess.Popen, Path]]) -> None:
    deadline = time.monotonic() + 30
    for proc, log in procs:
        while "Server listening" not in log.read_text():
            assert proc.poll() is None, f"sshd exited {proc.returncode}: {log.read_text()}"
            assert time.monotonic() < deadline, f"sshd not listening after 30s: {log.read_text()}"
            time.sleep(0.1)


def test_ssh_launcher_trains_two_steps_across_two_sshd_hosts(
    two_nodes: tuple[str, str, str, str], cfg_file: Path, tmp_path: Path
) -> None:
    if not os.access(SSHD, os.X_OK) or shutil.which("ssh") is None or shutil.which("ssh-keygen") is None:
        pytest.fail(
            f"this test needs OpenSSH's server ({SSHD}) and client (ssh, ssh-keygen): "
            "apt-get install -y --no-install-recommends openssh-server (CI must install it; no skip)"
        )
    ns0, ip0, ns1, ip1 = two_nodes
    Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)  # sshd's privilege separation directory
    key = tmp_path / "id_ed25519"
    netns.sh("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key))
    authorized = tmp_path / "authorized_keys"
    shutil.copy(key.with_suffix(".pub"), authorized)
    servers = [start_sshd(ns, ip, tmp_path, authorized) for ns, ip in ((ns0, ip0), (ns1, ip1))]
    try:
        wait_listening(servers)
        hostfile = tmp_path / "hosts"
        hostfile.write_text(f"# the head first\n{ip0}\n\n{ip1}  # node 1\n")
        run_dir = tmp_path / "run"
        env = clean_env(
            SSH_OPTS=f"-i {key} -p 22 -o IdentitiesOnly=yes -o BatchMode=yes -o StrictHostKeyChecking=no "
            "-o UserKnownHostsFile=/dev/null -o LogLevel=ERROR -o ConnectTimeout=20",
            MASTER_PORT=str(PORT),
            SLIPSTREAM_DIR=str(REPO),  # the ssh'd commands start in the user's home, with a bare PATH
            SLIPSTREAM_PYTHON=sys.executable,
            SLIPSTREAM_ENV="CI=true SLIPSTREAM_HOME HF_HOME",
            SLIPSTREAM_ARGS="--join-timeout 120",
        )
        # Launched from the head's namespace, as from node 0 (the namespaces' addresses are theirs alone).
        done = subprocess.run(["ip", "netns", "exec", ns0, "bash", str(LAUNCH), str(hostfile), str(cfg_file),
                               str(run_dir)], env=env, cwd=tmp_path, capture_output=True, text=True,
                              timeout=480)  # fmt: skip
        logs = [run_dir / "launch" / f"{ip0}-0.log", run_dir / "launch" / f"{ip1}-1.log"]
        why = f"{done.stderr[-2000:]}\nnode 0:\n{tail(logs[0])}\nnode 1:\n{tail(logs[1])}"
        assert done.returncode == 0, why
        assert "all 2 nodes finished" in done.stderr
        assert_two_step_run(run_dir, why)
        assert "step 2/2" in logs[0].read_text(), why  # the head's stdout came back through ssh
        # Node 1 ran in node 1's namespace: its rollout's data endpoint is on node 1's address.
        ready = next(e for e in events(run_dir, "rollout-0") if e["event"] == "ready")
        assert ready["data"].startswith(f"tcp://{ip1}:"), ready

        # Stopped mid-run (SIGTERM, as a scheduler or Ctrl-C would), the launcher kills its ssh clients; on
        # each host the watcher of the closed session stops `slipstream train`, and its actors die with it.
        run2 = tmp_path / "run2"
        launcher = subprocess.Popen(["ip", "netns", "exec", ns0, "bash", str(LAUNCH), str(hostfile),
                                     str(cfg_file), str(run2), "steps=500"], env=env, cwd=tmp_path,
                                    stderr=subprocess.PIPE, text=True)  # fmt: skip
        try:
            deadline = time.monotonic() + 120
            while not (run2 / "logs" / "rollout-0.jsonl").exists():
                assert launcher.poll() is None, launcher.communicate()[1]
                assert time.monotonic() < deadline, "node 1's rollout never started"
                time.sleep(0.2)
            ranks = {
                c[c.index("--node-rank") + 1] for c in processes(str(run2)).values() if "--node-rank" in c
            }
            assert ranks == {"0", "1"}  # both nodes' `slipstream train` (and their ssh clients) are running
            launcher.terminate()
            assert launcher.wait(timeout=60) == 143
            assert "SIGTERM, stopping every node" in launcher.communicate()[1]
        finally:
            if launcher.poll() is None:
                launcher.kill()
        deadline = time.monotonic() + 60
        while left := processes(str(run2)):
            assert time.monotonic() < deadline, f"still running 60 s after the launcher stopped: {left}"
            time.sleep(0.5)
    finally:
        for proc, _ in servers:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
        kill_leftovers(str(tmp_path))


def test_ssh_launcher_builds_each_nodes_command_and_gathers_its_output(tmp_path: Path) -> None:
    bin_dir = fake_bin(tmp_path, ssh=FAKE_SSH)
    fake_python = executable(tmp_path / "python", FAKE_PYTHON)
    hostfile = tmp_path / "hosts"
    hostfile.write_text("# head\n10.1.2.3 slots=8\n\n  root@10.1.2.4\n10.1.2.5 # last\n")
    env = clean_env(
        PATH=f"{bin_dir}:{os.environ['PATH']}",
        FAKE_SSH_DIR=str(tmp_path),
        SSH_OPTS="-p 2222 -o 'StrictHostKeyChecking accept-new'",
        MASTER_PORT="29511",
        SLIPSTREAM_DIR=str(tmp_path),
        SLIPSTREAM_PYTHON=str(fake_python),
        SLIPSTREAM_ENV="CI=yes FROM_HERE UNSET_HERE",
        FROM_HERE="x y",
    )
    env.pop("UNSET_HERE", None)
    override = 'task_options.note=it\'s "quoted" $HOME'
    done = subprocess.run(["bash", str(LAUNCH), str(hostfile), "cfg.yaml", "runs/r", "steps=5", override],
                          env=env, cwd=tmp_path, capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.returncode == 0, done.stderr
    run_dir = tmp_path / "runs" / "r"
    for rank, host in enumerate(["10.1.2.3", "10.1.2.4", "10.1.2.5"]):
        dest = "root@10.1.2.4" if rank == 1 else host
        args = (tmp_path / f"{dest}.args").read_text().splitlines()
        assert args[:4] == ["-p", "2222", "-o", "StrictHostKeyChecking accept-new"] and args[4] == dest
        # The remote command, through a shell as sshd runs it: every word arrives as it was given.
        called = json.loads((run_dir / "launch" / f"{host}-{rank}.log").read_text())
        assert called["argv"] == [
            "-m", "slipstream.cli.main", "train", "cfg.yaml", "steps=5", override, "--nnodes", "3",
            "--node-rank", str(rank), "--head", "10.1.2.3:29511", "--run-dir", str(run_dir),
        ]  # fmt: skip
        assert called["cwd"] == str(tmp_path)
        assert called["env"] | {"MASTER_PORT": None} == {
            "CI": "yes", "FROM_HERE": "x y", "UNSET_HERE": None, "MASTER_PORT": None, "SLURM_NODEID": None,
            "SLURM_PROCID": None,
        }  # fmt: skip
    # RUN_DIR left out (a third argument with `=` is an override): runs/train-<time>, under SLIPSTREAM_DIR.
    hostfile.write_text("10.1.2.3\n")
    done = subprocess.run(["bash", str(LAUNCH), str(hostfile), "cfg.yaml", "steps=5"], env=env,
                          cwd=tmp_path, capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.returncode == 0, done.stderr
    (made,) = (tmp_path / "runs").glob("train-*")
    called = json.loads((made / "launch" / "10.1.2.3-0.log").read_text())
    assert called["argv"][3:6] == ["cfg.yaml", "steps=5", "--nnodes"] and called["argv"][-1] == str(made)


def test_ssh_launcher_stopped_ends_each_hosts_command_through_its_ssh_session(tmp_path: Path) -> None:
    bin_dir = fake_bin(tmp_path, ssh=FAKE_SSH)
    hostfile = tmp_path / "hosts"
    hostfile.write_text("10.1.2.3\n10.1.2.4\n")
    held = tmp_path / "held"
    held.mkdir()
    env = clean_env(
        PATH=f"{bin_dir}:{os.environ['PATH']}",
        FAKE_SSH_DIR=str(tmp_path),
        SLIPSTREAM_PYTHON=str(executable(tmp_path / "python", FAKE_PYTHON)),
        SLIPSTREAM_ENV=f"FAKE_PYTHON_HOLD={held}",
    )
    run_dir = tmp_path / "run"
    launcher = subprocess.Popen(["bash", str(LAUNCH), str(hostfile), "cfg.yaml", str(run_dir)], env=env,
                                cwd=tmp_path, stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while len(list(held.iterdir())) < 2:
            assert launcher.poll() is None, launcher.communicate()[1]
            assert time.monotonic() < deadline, "the hosts' commands never started"
            time.sleep(0.1)
        pids = sorted(int(p.name) for p in held.iterdir())
        launcher.terminate()
        assert launcher.wait(timeout=60) == 143
        assert "SIGTERM, stopping every node" in launcher.communicate()[1]
    finally:
        if launcher.poll() is None:
            launcher.kill()
    # Killing an ssh client signals nothing on its host; the watcher of the session's stdin, which closed,
    # stops the command there (each would otherwise sleep for 300 s).
    deadline = time.monotonic() + 60
    try:
        while left := [p for p in pids if alive(p)]:
            assert time.monotonic() < deadline, (
                f"the hosts' commands {left} outlived their ssh sessions by 60 s"
            )
            time.sleep(0.2)
        assert not processes(str(run_dir))
    finally:
        kill_leftovers(str(tmp_path))


def alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie has ended)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False


def test_ssh_launcher_names_the_failed_node_and_stops_the_others(tmp_path: Path) -> None:
    bin_dir = fake_bin(tmp_path, ssh=FAKE_SSH)
    hostfile = tmp_path / "hosts"
    hostfile.write_text("10.1.2.3\n10.1.2.4\n10.1.2.5\n")
    env = clean_env(
        PATH=f"{bin_dir}:{os.environ['PATH']}",
        FAKE_SSH_DIR=str(tmp_path),
        FAKE_SSH_FAIL="10.1.2.4",
        FAKE_SSH_HANG="10.1.2.3 10.1.2.5",  # they would run for 300 s
    )
    # The launcher waits for every node: it ends in time only if it kills the hung ones.
    try:
        done = subprocess.run(["bash", str(LAUNCH), str(hostfile), "cfg.yaml", str(tmp_path / "run")],
                              env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120)  # fmt: skip
        assert not processes(f"sleep-for-{tmp_path}")
    finally:
        kill_leftovers(str(tmp_path))
    assert done.returncode == 1, done.stderr
    assert "FAILED: node 1 (10.1.2.4) exited 1" in done.stderr
    assert "no route to 10.1.2.4" in done.stderr  # the failed node's log, shown
    assert "node 0 (10.1.2.3) stopped" in done.stderr and "node 2 (10.1.2.5) stopped" in done.stderr
    assert (tmp_path / "run" / "launch" / "10.1.2.4-1.log").read_text() == "no route to 10.1.2.4\n"
    # The head must be an address the other hosts reach: a loopback name is refused before any ssh.
    hostfile.write_text("localhost\n10.1.2.4\n")
    done = subprocess.run(["bash", str(LAUNCH), str(hostfile), "cfg.yaml", str(tmp_path / "run2")], env=env,
                          cwd=tmp_path, capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.returncode == 2 and "loopback" in done.stderr, done.stderr
    assert not (tmp_path / "run2").exists()
