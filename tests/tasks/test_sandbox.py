"""The code sandbox and the code reward, with real processes: each misbehaving solution scores 0.0, the
host is unharmed (no connection reached it, it can still fork), nothing runs on and the temp dir is gone.
Needs root (the sandbox refuses without it); the limits are small so a test costs a few seconds."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from slipstream.runtime.fork_server import is_fork_server
from slipstream.tasks import sandbox as sandbox_module
from slipstream.tasks.code_tasks import CODE_TASK, PROBLEMS, HiddenTests, code_prompt, code_rows, extract_code
from slipstream.tasks.datasets import load_rows
from slipstream.tasks.sandbox import Limits, Sandbox, SandboxUnavailable

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux") or os.geteuid() != 0, reason="the code sandbox needs root on Linux"
)
ROOT = Path(__file__).resolve().parents[2]
LIMITS = Limits(wall_s=2.0, cpu_s=2, memory_mb=256, processes=8)
ADD = {"entry_point": "add", "tests": [{"args": [2, 3], "expected": 5}, {"args": [-1, 1], "expected": 0}]}


def sandbox_processes() -> list[int]:
    """Live processes of any sandbox uid."""
    found = []
    for entry in os.listdir("/proc"):
        try:
            status = Path("/proc", entry, "status").read_text()
        except (OSError, ValueError):
            continue
        uid = next(int(line.split()[1]) for line in status.splitlines() if line.startswith("Uid:"))
        if uid >= sandbox_module._UID_BASE and "\nState:\tZ" not in status:
            found.append(int(entry))
    return found


def sandbox_dirs() -> set[str]:
    return {p for p in os.listdir(tempfile.gettempdir()) if p.startswith("slipstream-sandbox-")}


@pytest.fixture(scope="module")
def reward() -> HiddenTests:
    return HiddenTests(LIMITS)


@pytest.fixture
def host_checked() -> Iterator[None]:
    """After the test: no sandbox process left, no new sandbox dir, no new child of ours, and fork works."""
    dirs, children = sandbox_dirs(), our_children()
    yield
    assert sandbox_processes() == []
    assert sandbox_dirs() <= dirs
    assert our_children() <= children, f"children left: {our_children() - children}"
    assert subprocess.run(["true"]).returncode == 0


def our_children() -> set[str]:
    """This process's children, but fork servers: those are the process's, kept for later launches."""
    pids = subprocess.run(["pgrep", "-P", str(os.getpid())], capture_output=True, text=True).stdout.split()
    return {pid for pid in pids if not is_fork_server(int(pid))}


def solution(body: str) -> str:
    return f"Here it is:\n```python\n{body}\n```\n"


SOLUTIONS = {
    "correct": "def add(a, b):\n    return a + b",
    "wrong": "def add(a, b):\n    return a - b",
    "looping": "def add(a, b):\n    while True:\n        pass",
    "fork_bomb": (
        "import os\ndef add(a, b):\n    while True:\n        try:\n            os.fork()\n"
        "        except OSError:\n            pass"
    ),
    "memory_hungry": "def add(a, b):\n    hoard = []\n    while True:\n        hoard.append(bytearray(10**7))",
    "exits_early": "import os\ndef add(a, b):\n    os._exit(0)",
    "always_equal": "class Same(int):\n    def __eq__(self, other):\n        return True\ndef add(a, b):\n    return Same(0)",
    "no_code": None,
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("name", "expected"), [("correct", 1.0), *((n, 0.0) for n in SOLUTIONS if n != "correct")]
)
def test_each_solution_is_scored_and_the_host_is_left_clean(
    reward: HiddenTests, host_checked: None, name: str, expected: float
) -> None:
    body = SOLUTIONS[name]
    completion = "I do not know." if body is None else solution(body)
    assert reward("Write add(a, b).", completion, answer=ADD) == expected


@pytest.mark.timeout(60)
def test_how_a_misbehaving_run_ends(host_checked: None) -> None:
    box = Sandbox(LIMITS, check=False)
    tests = ADD["tests"]
    looping = box.run(SOLUTIONS["looping"], "add", tests)
    assert looping.status == "timeout" and LIMITS.wall_s <= looping.elapsed_s < LIMITS.wall_s + 2
    bomb = box.run(SOLUTIONS["fork_bomb"], "add", tests)
    assert bomb.status == "timeout"
    hungry = box.run(SOLUTIONS["memory_hungry"], "add", tests)
    assert hungry.status == "failed" and "MemoryError" in hungry.detail
    early = box.run(SOLUTIONS["exits_early"], "add", tests)
    assert early.status == "crashed" and "no verdict" in early.detail
    printed = box.run("def add(a, b):\n    print('PASSED', a)\n    return 0", "add", tests)
    assert printed.status == "failed" and printed.passed == 1 and "PASSED 2" in printed.detail


TIGHT = Limits(wall_s=4.0, cpu_s=1, memory_mb=128, processes=5, file_mb=1, open_files=20)
PROBES = """
import errno, os, resource, socket, time

def limits():
    names = ("RLIMIT_CPU", "RLIMIT_AS", "RLIMIT_NPROC", "RLIMIT_FSIZE", "RLIMIT_NOFILE", "RLIMIT_CORE")
    read = [list(resource.getrlimit(getattr(resource, n))) for n in names]
    return read + [[name for _, name in socket.if_nameindex()], os.getuid() != 0, os.getgid() != 0]

def refused(e):
    return errno.errorcode.get(e.errno, str(e.errno))

def write(megabytes):
    try:
        with open("big", "wb") as f:
            for _ in range(megabytes):
                f.write(bytes(1 << 20))
    except OSError as e:
        return [os.path.getsize("big") >> 20, refused(e)]
    return [megabytes, None]

def allocate(megabytes):
    try:
        return len(bytearray(megabytes << 20)) >> 20
    except MemoryError:
        return "MemoryError"

def fork(cap):
    made = 0
    while made < cap:
        try:
            pid = os.fork()
        except OSError as e:
            return [made, refused(e)]
        if pid == 0:
            time.sleep(30)
            os._exit(0)
        made += 1
    return [made, None]

def open_files(cap):
    held = []
    while len(held) < cap:
        try:
            held.append(os.open("/dev/null", os.O_RDONLY))
        except OSError as e:
            return [held[-1] if held else None, refused(e)]
    return [held[-1], None]

def connect():
    try:
        socket.create_connection(("127.0.0.1", 9), timeout=1).close()
    except OSError as e:
        return refused(e)
    return None

def spin():
    while True:
        pass
"""


@pytest.mark.timeout(120)
def test_each_limit_holds_inside_the_sandbox(host_checked: None) -> None:
    """The limits read back from inside, then each one met: the expected values come from `TIGHT`, not from
    what the sandbox sets (a limit it dropped reads back as the host's and is never met)."""
    box = Sandbox(TIGHT, check=False)
    mb = 1 << 20

    def returns(entry: str, args: list[Any], expected: Any) -> None:
        result = box.run(PROBES, entry, [{"args": args, "expected": expected}])
        assert result.status == "passed", (entry, result.detail)

    returns("limits", [], [
        [TIGHT.cpu_s, TIGHT.cpu_s + 1], [TIGHT.memory_mb * mb] * 2, [TIGHT.processes] * 2,
        [TIGHT.file_mb * mb] * 2, [TIGHT.open_files] * 2, [0, 0], ["lo"], True, True,
    ])  # fmt: skip
    returns("write", [TIGHT.file_mb + 2], [TIGHT.file_mb, "EFBIG"])  # a file past the cap: EFBIG
    returns("allocate", [TIGHT.memory_mb // 4], TIGHT.memory_mb // 4)
    returns("allocate", [TIGHT.memory_mb], "MemoryError")
    returns("fork", [4 * TIGHT.processes], [TIGHT.processes - 1, "EAGAIN"])  # the code's process is one
    returns("open_files", [4 * TIGHT.open_files], [TIGHT.open_files - 1, "EMFILE"])
    returns("connect", [], "ENETUNREACH")  # its own network namespace: a loopback, down
    spun = box.run(PROBES, "spin", [{"args": [], "expected": None}])  # CPU time: SIGXCPU before the wall
    assert spun.status == "crashed" and "killed by SIGXCPU" in spun.detail, spun
    assert spun.elapsed_s < TIGHT.wall_s


@pytest.mark.timeout(60)
def test_the_code_cannot_reach_the_host_network(host_checked: None) -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        listener.setblocking(False)
        port = listener.getsockname()[1]
        code = f"import socket\ndef add(a, b):\n    socket.create_connection(('127.0.0.1', {port}), timeout=1)\n    return a + b"
        result = Sandbox(LIMITS, check=False).run(code, "add", ADD["tests"])
        assert result.status == "failed" and "OSError" in result.detail and "unreachable" in result.detail
        with pytest.raises(BlockingIOError):
            listener.accept()  # nothing ever connected


@pytest.mark.timeout(60)
def test_the_code_sees_no_secrets_and_writes_nothing_on_the_host(host_checked: None, tmp_path: Path) -> None:
    os.environ["SLIPSTREAM_TEST_SECRET"] = "hunter2"
    try:
        code = (
            "import os\ndef add(a, b):\n"
            "    open('/tmp/sandbox-was-here', 'w').write('x')\n"
            "    return [sorted(os.environ), os.listdir('/tmp'), os.path.exists('/root/.bashrc'), os.getuid()]"
        )
        result = Sandbox(LIMITS, check=False).run(code, "add", [{"args": [1, 2], "expected": 3}])
    finally:
        del os.environ["SLIPSTREAM_TEST_SECRET"]
    assert result.status == "failed" and "SLIPSTREAM_TEST_SECRET" not in result.detail
    assert '["LANG", "PATH", "PYTHONDONTWRITEBYTECODE"], ["sandbox-was-here"], false' in result.detail
    assert not Path("/tmp/sandbox-was-here").exists()  # it wrote in its own /tmp


@pytest.mark.timeout(60)
def test_a_host_that_cannot_isolate_is_refused_naming_what_is_missing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(SandboxUnavailable, match="needs root"):
        Sandbox(LIMITS)


@pytest.mark.timeout(60)
@pytest.mark.skipif(shutil.which("setpriv") is None, reason="needs util-linux's setpriv")
def test_without_cap_sys_admin_the_sandbox_refuses_to_start() -> None:
    probe = "from slipstream.tasks.code_tasks import HiddenTests\nHiddenTests()"
    done = subprocess.run(
        ["setpriv", "--bounding-set", "-sys_admin", sys.executable, "-c", probe],
        capture_output=True, text=True, timeout=50, cwd=ROOT,
    )  # fmt: skip
    assert done.returncode != 0
    assert (
        "SandboxUnavailable" in done.stderr
        and "unshare(PID namespace): Operation not permitted" in done.stderr
    )


def test_code_rows_prompts_and_extraction() -> None:
    rows = code_rows(25, seed=3)
    assert len(rows) == 25 and rows == code_rows(25, seed=3) and rows != code_rows(25, seed=4)
    assert {r.answer["entry_point"] for r in rows[: len(PROBLEMS)]} == {p.entry_point for p in PROBLEMS}
    assert "`add(a, b)`" in code_prompt(PROBLEMS[0]) and "add(2, 3) returns 5" in code_prompt(PROBLEMS[0])
    loaded, report = load_rows(CODE_TASK, seed=3, size=25)
    assert list(loaded) == rows and report is None
    two = (
        "```python\ndef helper(): pass\n```\n```python\ndef add(a, b): return a + b\n```\n```\nprint(1)\n```"
    )
    assert extract_code(two, "add") == "def add(a, b): return a + b\n"
    assert extract_code("def add(a, b): return 0", "add") == "def add(a, b): return 0"
    assert extract_code("no code", "add") is None


@pytest.mark.timeout(120)
def test_every_built_in_problem_is_solvable(reward: HiddenTests, host_checked: None) -> None:
    solutions = {
        "add": "return a + b" , "reverse": "return s[::-1]",
        "is_prime": "return n > 1 and all(n % d for d in range(2, int(n ** 0.5) + 1))",
        "fib": "a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a",
        "count_vowels": "return sum(c in 'aeiouAEIOU' for c in s)", "largest": "return max(xs)",
        "factorial": "import math\n    return math.factorial(n)", "evens": "return [x for x in xs if x % 2 == 0]",
        "digit_sum": "return sum(map(int, str(n)))",
        "fizzbuzz": "return 'FizzBuzz' if n % 15 == 0 else 'Fizz' if n % 3 == 0 else 'Buzz' if n % 5 == 0 else str(n)",
    }  # fmt: skip
    for problem in PROBLEMS:
        body = f"def {problem.signature}:\n    {solutions[problem.entry_point]}"
        assert reward(code_prompt(problem), solution(body), answer=problem.answer()) == 1.0, (
            problem.entry_point
        )


@pytest.mark.timeout(60)
def test_a_row_without_tests_cannot_be_judged(reward: HiddenTests) -> None:
    with pytest.raises(ValueError, match="needs answer"):
        reward("p", solution("def add(a, b): return 1"), answer="5")


# -- the code reward in a verifier ------------------------------------------------------------------


class QuickTests(HiddenTests):
    """HiddenTests with a sandbox wall-clock limit longer than the verifier's deadline below."""

    def __init__(self) -> None:
        super().__init__(Limits(wall_s=3.0, cpu_s=3, memory_mb=256, processes=8))


@pytest.mark.timeout(180)
def test_in_a_verifier_a_killed_worker_takes_its_sandbox_with_it(tmp_path: Path, host_checked: None) -> None:
    from slipstream.protocols.control import Shutdown
    from tests.actors.test_verifier import Pools, all_gone, descendants, spec

    pools = Pools(
        tmp_path / "run", [spec("tests.tasks.test_sandbox:QuickTests", 0, workers=1, timeout_s=1.5)]
    )
    try:
        actor_pid = pools.sup.pid("verifier:0")
        answer = json.dumps({"answer": ADD})
        got = pools.score(
            "verifier:0", [solution(SOLUTIONS["correct"]), solution(SOLUTIONS["wrong"])], row_json=answer
        )
        assert [r.reward for r in got] == [1.0, 0.0]
        # The verifier's deadline comes before the sandbox's: the worker is killed mid-run, and with it,
        # through the parent-death signals and the PID namespace, every process of the run.
        (got,) = pools.score("verifier:0", [solution(SOLUTIONS["fork_bomb"])], row_json=answer)
        assert got.reward is None and got.error == "timeout after 1.5 s"
        assert all_gone(set(sandbox_processes()), timeout=10)
        processes = descendants(actor_pid) | {actor_pid}
        pools.send("verifier:0", Shutdown(reason="test"))
        assert all_gone(processes, timeout=20)
    finally:
        pools.close()
