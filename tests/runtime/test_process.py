"""Process liveness (`runtime.process.pid_alive`) against real processes, a zombie included."""

import json
import os
import resource
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest

from slipstream.runtime import process
from slipstream.runtime.process import pid_alive


def _state(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()[0]
    except OSError:
        return None


@pytest.mark.timeout(30)
@pytest.mark.skipif(not Path("/proc").is_dir(), reason="zombies are told apart through /proc")
def test_an_unreaped_child_is_dead_and_a_running_one_alive() -> None:
    running = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    exited = subprocess.Popen([sys.executable, "-c", "pass"])  # not waited on: it stays a zombie
    try:
        assert pid_alive(os.getpid()) and pid_alive(running.pid)
        deadline = time.monotonic() + 20
        while _state(exited.pid) != "Z":
            assert time.monotonic() < deadline, f"child {exited.pid} never became a zombie"
            time.sleep(0.01)
        os.kill(exited.pid, 0)  # a zombie still answers kill(0) …
        assert not pid_alive(exited.pid)  # … but is dead
    finally:
        running.kill()
        running.wait()
        exited.wait()  # reaped: the pid is gone altogether
    assert not pid_alive(exited.pid) and not pid_alive(running.pid)


def test_without_proc_kill_zero_decides(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(process, "_PROC", tmp_path / "no-proc")
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    assert pid_alive(os.getpid())
    assert not pid_alive(child.pid)


def test_pids_that_name_no_single_process_are_not_alive() -> None:
    assert not pid_alive(0)  # kill(0, 0) would address this process's own group
    assert not pid_alive(-1)


@pytest.mark.timeout(60)
def test_peak_rss_is_the_child_s_own_not_its_parent_s() -> None:
    """VmHWM of a fresh interpreter is small though its parent (this test, torch loaded) is large, grows
    with what the process touches, and the getrusage fallback reads the same unit."""
    code = (
        "import sys; from slipstream.runtime.process import peak_rss_mb; before = peak_rss_mb(); "
        "block = bytearray(256 << 20); print(before, peak_rss_mb())"
    )
    ballast = bytearray(512 << 20)  # touched (zero-filled): this parent's RSS is now >= 512 MiB
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    del ballast
    before, after = (float(x) for x in out.split())
    assert 0 < before < 256 and after - before > 200


def test_peak_rss_falls_back_to_getrusage_without_proc(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from_proc = process.peak_rss_mb()
    monkeypatch.setattr(process, "_PROC", tmp_path)  # no /proc/self/status there
    fallback = process.peak_rss_mb()
    assert from_proc > 0 and fallback >= from_proc * 0.9  # ru_maxrss: at least this process's own peak


@pytest.mark.timeout(60)
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt: Linux only")
def test_kept_freed_memory_is_reused_instead_of_faulted_in_again() -> None:
    """Steps shaped like a learner's (buffers of 24-40 MiB allocated and freed in turn): with glibc's
    defaults most of each step's pages fault in again; after keep_freed_memory most are reused."""
    code = (
        "import resource, sys, torch; from slipstream.runtime.process import keep_freed_memory\n"
        "kept = keep_freed_memory() if sys.argv[1] == 'keep' else None\n"
        "faults = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_minflt\n"
        "def step():\n"
        "    a = [torch.ones(n << 18) for n in (40, 24, 40, 24)]; del a\n"
        "step(); step(); before = faults()\n"
        "for _ in range(4): step()\n"
        "print(kept, faults() - before)\n"
    )
    pages = 4 * (128 << 20) // resource.getpagesize()  # what four steps touch
    results = {}
    for mode in ("keep", "default"):
        out = subprocess.run([sys.executable, "-c", code, mode], capture_output=True, text=True, check=True)
        kept, faults = out.stdout.split()
        results[mode] = (kept, int(faults))
    assert results["keep"][0] == "True"
    assert results["default"][1] > pages * 0.5  # the control: the defaults fault most pages in again
    assert results["keep"][1] < results["default"][1] * 0.5


@pytest.mark.timeout(60)
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim: Linux only")
def test_released_memory_leaves_the_process_and_the_heap_says_what_is_kept() -> None:
    """What a burst kept for reuse (`keep_freed_memory`) shows as the heap's free part, counts in the resident
    size, and goes back to the kernel on `release_freed_memory`, live tensors untouched."""
    code = (
        "import json, torch; from slipstream.runtime import process\n"
        "process.keep_freed_memory()\n"
        "live = torch.ones(8 << 18)\n"  # 8 MiB that must survive
        "burst = [torch.ones(32 << 18) for _ in range(8)]; del burst\n"  # 256 MiB, freed but kept
        "kept = process.memory_now()\n"
        "released = process.release_freed_memory()\n"
        "print(json.dumps([kept, released, process.memory_now(), float(live.sum())]))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    kept, released, after, live = json.loads(out.stdout)
    assert kept["heap_free_mb"] > 200 and kept["heap_used_mb"] >= 8
    assert released and kept["rss_mb"] - after["rss_mb"] > 200  # the kept pages left the process
    assert live == 8 << 18  # the live tensor's pages stayed


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="per-thread affinity: Linux only")
def test_pinning_moves_every_thread_not_only_the_caller() -> None:
    """`pin_threads` pins threads made earlier (an OpenMP pool) too; `sched_setaffinity(0)` moves the caller."""
    code = (
        "import json, os, threading, time\n"
        "from slipstream.runtime.process import pin_threads\n"
        "stop = threading.Event(); t = threading.Thread(target=stop.wait); t.start()\n"
        "one = {min(os.sched_getaffinity(0))}\n"
        "ok = pin_threads(one)\n"
        "got = [sorted(os.sched_getaffinity(int(tid))) for tid in os.listdir('/proc/self/task')]\n"
        "stop.set(); t.join(); print(json.dumps([ok, sorted(one), got]))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    ok, one, got = json.loads(out.stdout)
    assert ok and len(got) >= 2 and all(cpus == one for cpus in got)


_HOLD = """
import mmap, sys
size = int(sys.argv[1]) << 20
if sys.argv[2] == "shared":  # map one file both children map: its pages are shared between them
    f = open(sys.argv[3], "r+b"); buf = mmap.mmap(f.fileno(), size)
else:
    buf = bytearray(size)
for i in range(0, size, 4096):
    buf[i] = 1  # touch every page: resident
print("ready", flush=True)
sys.stdin.read()
"""


def _hold(mb: int, *how: str) -> subprocess.Popen[str]:
    child = subprocess.Popen(
        [sys.executable, "-c", _HOLD, str(mb), *how], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert child.stdout is not None and child.stdout.readline().strip() == "ready"
    return child


@pytest.mark.skipif(not Path("/proc/self/smaps_rollup").is_file(), reason="needs Linux >= 4.14")
def test_memory_sampler_reads_smaps_only_where_a_new_peak_is_possible() -> None:
    # smaps_rollup costs ~15 ms of CPU a resident GB: a reading where no process grew reads statm alone.
    sampler = process.MemorySampler(label=lambda pid: None if pid == os.getpid() else "child")
    children = [_hold(64, "private")]
    try:
        first = sampler.sample()
        assert first >= 64 and sampler.skipped == 0
        assert sampler.sample() <= sampler.peak_mb == first and sampler.skipped == 1  # nothing grew
        children.append(_hold(96, "private"))  # a new process: its whole RSS may be a new peak
        second = sampler.sample()
        assert sampler.skipped == 1 and second == sampler.peak_mb and second >= first + 96
        assert sampler.sample() <= second and sampler.skipped == 2
    finally:
        for child in children:
            child.kill()
            child.wait()
    assert sampler.sample() < sampler.peak_mb and sampler.skipped == 3  # freed: no read, the peak stays


@pytest.mark.skipif(not Path("/proc/self/smaps_rollup").is_file(), reason="needs Linux >= 4.14")
def test_memory_sampler_counts_the_tree_and_shared_pages_once(tmp_path: Path) -> None:
    shared = tmp_path / "shared.bin"
    shared.write_bytes(b"\0" * (64 << 20))
    sampler = process.MemorySampler(label=lambda pid: "root" if pid == os.getpid() else "child")
    baseline = sampler.sample()
    children = [_hold(96, "private"), _hold(64, "shared", str(shared)), _hold(64, "shared", str(shared))]
    try:
        assert set(sampler.tree()) >= {os.getpid(), *(c.pid for c in children)}
        held = sampler.sample() - baseline
        # 96 MiB private + 64 MiB shared by two (once in all) + three interpreters (~10 MiB each),
        # where summing RSS would count the shared 64 twice.
        assert 96 + 64 <= held < 96 + 2 * 64
        assert sampler.peak_mb >= baseline + held - 1 and sampler.at_peak_mb["child"] >= 96 + 64
        # A process labelled None (a benchmark's own beside the run it measures) is not counted.
        skipping = process.MemorySampler(label=lambda pid: None if pid == os.getpid() else "child")
        assert skipping.sample() == pytest.approx(held + baseline - sampler.at_peak_mb["root"], abs=8)
        assert "root" not in skipping.at_peak_mb
    finally:
        for child in children:
            child.kill()
            child.wait()
    assert sampler.sample() < sampler.peak_mb  # the peak stays the peak
    assert process.MemorySampler(root_pid=children[0].pid).sample() == 0.0  # gone: nothing to read


def test_peak_gpu_mb_is_none_without_cuda_and_sums_the_devices_with_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert process.peak_gpu_mb() is None  # torch is imported here, CUDA never initialised

    class Cuda:  # a stand-in for torch.cuda on a two-GPU host: only what peak_gpu_mb reads
        @staticmethod
        def is_initialized() -> bool:
            return True

        @staticmethod
        def device_count() -> int:
            return 2

        @staticmethod
        def max_memory_reserved(device: int) -> int:
            return (device + 1) << 20

    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(cuda=Cuda))
    assert process.peak_gpu_mb() == 3.0
