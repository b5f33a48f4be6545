"""The attack suite: programs that try to get out of the sandbox, each one contained.

Each test is one attack run through the real server (bubblewrap) and asserts, from outside,
that it did no harm: nothing reached the host listener, no host file changed, no process
outlived its run, the server still answers. tests/conftest.py counts these tests
("sandbox attack suite: N attacks, N contained") from their ``sandbox_attack`` property.
"""

from __future__ import annotations

import errno
import os
import socket
import threading
import time
import uuid
from pathlib import Path

import pytest

import reinforge
from reinforge.sandbox.isolation import SECCOMP_ARCHES, processes_of_user, seccomp_filter

REPO = Path(reinforge.__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _count_attack(request, record_property):
    record_property("sandbox_attack", request.node.name)


def _no_processes_left(server) -> None:
    settings = server.settings
    for slot in range(settings.num_slots):
        left = processes_of_user(settings.uid_base + slot)
        states = [Path(f"/proc/{pid}/stat").read_text()[:80] for pid in left if Path(f"/proc/{pid}/stat").exists()]
        assert left == [], f"slot {slot} has processes after its run: {states}"


def _still_serving(client) -> None:
    started = time.monotonic()
    response = client.run_code("print('alive')", run_timeout=5)
    assert response.run_result.stdout == "alive\n" and time.monotonic() - started < 3


def test_connect_to_host_listener(client, tmp_path):
    """Host listeners on 127.0.0.1, on ::1, on a unix socket path and an abstract unix name: none is reached."""
    listeners = []
    for family, address in [(socket.AF_INET, ("127.0.0.1", 0)), (socket.AF_INET6, ("::1", 0)),
                            (socket.AF_UNIX, str(tmp_path / "host.sock")),
                            (socket.AF_UNIX, f"\0reinforge-attack-{uuid.uuid4().hex}")]:
        listener = socket.socket(family)
        try:
            listener.bind(address)
        except OSError:  # no IPv6 on this host
            listener.close()
            continue
        listener.listen()
        listener.setblocking(False)
        listeners.append(listener)
    (tmp_path / "host.sock").chmod(0o777)
    targets = [(listener.family, listener.getsockname()) for listener in listeners]
    targets += [(socket.AF_INET, ("1.1.1.1", 53)), (socket.AF_INET, ("8.8.8.8", 443)),
                (socket.AF_INET6, ("2606:4700:4700::1111", 53))]
    code = f"""
import socket
for family, address in {[(int(family), address[:2] if isinstance(address, tuple) else address)
                          for family, address in targets]!r}:
    try:
        connection = socket.socket(family)
        connection.settimeout(1)
        connection.connect(tuple(address) if isinstance(address, list) else address)
        print("CONNECTED", address)
    except OSError as error:
        print("BLOCKED", address, error)
"""
    response = client.run_code(code, run_timeout=10)
    for listener in listeners:
        with pytest.raises(BlockingIOError):
            listener.accept()  # nothing ever connected
        listener.close()
    assert response.run_result.stdout.count("BLOCKED") == len(targets), response
    assert "CONNECTED" not in response.run_result.stdout


def test_read_project_files_and_shadow(client):
    targets = [REPO / "pyproject.toml", REPO / "reinforge" / "cli.py", Path("/etc/shadow"), Path("/etc/passwd"),
               Path("/root"), Path.home() / ".bash_history", Path("/proc/1/root/etc/shadow")]
    assert (REPO / "pyproject.toml").exists()
    code = f"""
import os
for path in {[str(target) for target in targets]!r}:
    try:
        content = os.listdir(path) if os.path.isdir(path) else open(path, "rb").read(100)
        print("READ", path, content)
    except OSError as error:
        print("DENIED", path, type(error).__name__)
"""
    response = client.run_code(code)
    assert response.run_result.stdout.count("DENIED") == len(targets), response.run_result.stdout


def test_write_outside_tmp(client, tmp_path):
    host_targets = [tmp_path / "escaped.txt", REPO / f"escaped-{uuid.uuid4().hex}.txt"]
    sandbox_only = ["/escaped.txt", "/usr/escaped.txt", "/etc/escaped.txt", "/code/main.py", "/dev/escaped"]
    code = f"""
import os
for path in {sandbox_only!r}:
    try:
        open(path, "w").write("pwned")
        print("WROTE", path)
    except OSError as error:
        print("DENIED", path, type(error).__name__)
for path in {[str(target) for target in host_targets]!r}:
    try:  # the host's /tmp path exists only inside the private /tmp, if at all
        os.makedirs(os.path.dirname(path), exist_ok=True)
        open(path, "w").write("pwned")
        print("WROTE-PRIVATE", path)
    except OSError as error:
        print("DENIED", path, type(error).__name__)
"""
    response = client.run_code(code)
    assert response.run_result.stdout.count("DENIED") >= len(sandbox_only), response.run_result.stdout
    assert "WROTE " not in response.run_result.stdout
    for target in host_targets:
        assert not target.exists(), f"{target} was written from inside the sandbox"


def test_fork_bomb(sandbox_server, client):
    code = """
import os, time
children = 0
try:
    while True:
        if os.fork() == 0:
            time.sleep(60)
            os._exit(0)
        children += 1
except OSError:
    print("LIMIT", children, flush=True)
while True:
    try:
        os.fork()
    except OSError:
        pass
"""
    started = time.monotonic()
    response = client.run_code(code, run_timeout=2)
    assert response.run_result.status == "TimeLimitExceeded", response
    assert time.monotonic() - started < 6
    children = int(response.run_result.stdout.split()[1])
    assert children < sandbox_server.settings.max_processes
    _no_processes_left(sandbox_server)
    _still_serving(client)


def test_memory_bomb(client):
    code = """
chunks = []
try:
    while True:
        chunks.append(bytearray(64 << 20))
except MemoryError:
    print("HEAP-LIMIT", len(chunks) * 64, "MB", flush=True)
chunks.clear()
try:  # /tmp is a tmpfs, memory outside the address-space limit: its size and the file-size limit hold it
    with open("/tmp/big", "wb") as big:
        for _ in range(1024):
            big.write(b"x" * (1 << 20))
    print("TMPFS-UNBOUNDED")
except OSError as error:
    print("TMPFS-LIMIT", type(error).__name__)
"""
    response = client.run_code(code, memory_limit_mb=256, run_timeout=10)
    lines = response.run_result.stdout.split("\n")
    assert lines[0].startswith("HEAP-LIMIT") and int(lines[0].split()[1]) <= 256, response
    assert lines[1].startswith("TMPFS-LIMIT"), response


def test_memory_bomb_across_processes_and_memfds(sandbox_server, client):
    """memory_limit_MB holds the whole sandbox: not 4 children of 200 MB each, not 600 MB of memfd files."""
    if sandbox_server.cgroups is None:
        pytest.skip("the server cannot create cgroups here (not root, or no memory and pids controllers)")
    code = """
import os, time
if "{kind}" == "fork":  # each child touches 200 MB and holds it 2 s; those the kernel killed did not survive
    pids = []
    for _ in range(4):
        pid = os.fork()
        if pid == 0:
            block = bytearray(200 << 20)
            for index in range(0, len(block), 4096):
                block[index] = 1
            time.sleep(2)
            os._exit(0)
        pids.append(pid)
    print("SURVIVED", sum(os.waitpid(pid, 0)[1] == 0 for pid in pids), flush=True)
else:
    held = []
    for _ in range(10):
        fd = os.memfd_create("bomb")
        for _ in range(60):
            os.write(fd, b"x" * (1 << 20))
        held.append(fd)
        print("MEMFD-HOLDS 60", flush=True)
"""
    fork = client.run_code(code.replace("{kind}", "fork"), memory_limit_mb=256, run_timeout=10)
    assert fork.run_result.stdout in ("SURVIVED 0\n", "SURVIVED 1\n"), fork  # never two 200 MB at once
    memfd = client.run_code(code.replace("{kind}", "memfd"), memory_limit_mb=256, run_timeout=10)
    assert memfd.run_result.stdout.count("HOLDS") <= 4, memfd
    for response in (fork, memfd):
        assert "memory limit of 256 MB" in response.run_result.stderr, response
    _no_processes_left(sandbox_server)
    _still_serving(client)


def test_infinite_loop_with_detached_child(sandbox_server, client):
    code = """
import os, signal
signal.signal(signal.SIGTERM, signal.SIG_IGN)
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        while True:
            pass
    os._exit(0)
while True:
    pass
"""
    started = time.monotonic()
    response = client.run_code(code, run_timeout=1)
    elapsed = time.monotonic() - started
    assert response.status == "Failed" and response.run_result.status == "TimeLimitExceeded", response
    assert elapsed < 4, f"a 1 s timeout took {elapsed:.1f}s to answer"
    _no_processes_left(sandbox_server)


def test_hundred_megabytes_of_output(sandbox_server, client):
    code = "import sys\nfor _ in range(100):\n    sys.stdout.write('x' * (1 << 20))\n"
    started = time.monotonic()
    response = client.run_code(code, run_timeout=20)
    assert time.monotonic() - started < 5
    assert len(response.run_result.stdout) == sandbox_server.settings.max_output_bytes
    assert "was stopped" in response.run_result.stderr and response.status == "Failed"
    _no_processes_left(sandbox_server)


def test_signal_the_server(client):
    code = f"""
import os, signal
for target in ({os.getpid()}, -1, 1):
    try:
        os.kill(target, signal.SIGKILL)
        print("SENT", target)
    except OSError as error:
        print("DENIED", target, type(error).__name__)
print("visible processes:", [p for p in os.listdir("/proc") if p.isdigit()])
"""
    client.run_code(code)
    assert os.getpid() > 0  # this test process runs the server: we are still here
    _still_serving(client)


def test_read_another_sandboxes_files(client):
    token = uuid.uuid4().hex
    writer_code = f"open('/tmp/secret.txt', 'w').write('{token}')\nimport time\nprint('WRITTEN', flush=True)\ntime.sleep(3)\n"
    reader_code = f"""
import os
found = []
for root, folders, files in os.walk("/"):
    if root.startswith(("/proc", "/dev", "/usr")):
        folders[:] = []
        continue
    for name in files:
        try:
            if "{token[::-1]}"[::-1] in open(os.path.join(root, name), errors="ignore").read(4096):
                found.append(os.path.join(root, name))
        except OSError:
            pass
for pid in [entry for entry in os.listdir("/proc") if entry.isdigit()]:
    try:
        found += [pid + ":" + name for name in os.listdir(f"/proc/{{pid}}/root/tmp") if name == "secret.txt"]
    except OSError:
        pass
print("FOUND" if found else "NOTHING", found)
"""
    finished: dict[str, float] = {}

    def run_writer():
        client.run_code(writer_code, run_timeout=10)
        finished["writer"] = time.monotonic()

    writer = threading.Thread(target=run_writer)
    writer.start()
    time.sleep(1.0)
    reader = client.run_code(reader_code, run_timeout=10)
    finished["reader"] = time.monotonic()
    writer.join()
    assert finished["reader"] < finished["writer"], "the two sandboxes did not run at the same time"
    assert reader.run_result.stdout.startswith("NOTHING"), reader.run_result.stdout


def test_busy_children_do_not_starve_another_slot(sandbox_server, client):
    """50 busy processes, each a session (and so a scheduler autogroup) of its own, in one slot: a program in the other
    slot still gets its share of the CPUs, not a 51st of them."""
    if sandbox_server.cgroups is None:
        pytest.skip("the server cannot create cgroups here (not root, or no memory and pids controllers)")
    victim = """
import time
wall, cpu = time.monotonic(), time.process_time()
while time.monotonic() - wall < {window}:
    pass
print((time.process_time() - cpu) / (time.monotonic() - wall))
"""
    hog = """
import os
start, go = os.pipe()
for _ in range(50):  # all forked before any spins: a spinning child would slow the forks themselves
    if os.fork() == 0:
        os.setsid()
        os.close(go)
        os.read(start, 1)
        while True:
            pass
os.close(go)
while True:
    pass
"""
    alone = float(client.run_code(victim.format(window=0.3), run_timeout=5).run_result.stdout)
    # long enough for the victim's start as well, which a starved slot's python took about a second for
    hogging = threading.Thread(target=client.run_code, args=(hog,), kwargs={"run_timeout": 2.4})
    hogging.start()
    time.sleep(0.5)
    contended = float(client.run_code(victim.format(window=0.4), run_timeout=5).run_result.stdout)
    hogging.join()
    assert contended > 0.2 * alone, f"CPU share {contended:.2f} beside a hog, {alone:.2f} alone"
    _no_processes_left(sandbox_server)


def test_terminals_cannot_be_used_up(client):
    """Every devpts but the host's shares one pool of 3072 terminals: a program holding 64 x 1024 of them left none
    to other sandboxes until it ended. A program gets none, and cannot make /dev/pts hold anything."""
    code = """
import os
for attempt in (os.openpty, lambda: os.open("/dev/ptmx", os.O_RDWR | os.O_NOCTTY),
                lambda: os.open("/dev/pts/ptmx", os.O_RDWR | os.O_NOCTTY),
                lambda: os.open("/dev/pts/file", os.O_WRONLY | os.O_CREAT)):
    try:
        attempt()
        print("OPENED")
    except OSError as error:
        print("DENIED", type(error).__name__)
"""
    response = client.run_code(code)
    assert response.run_result.stdout.count("DENIED") == 4, response


def test_host_aio_contexts_cannot_be_used_up(client):
    """aio contexts come from one pool for the whole host (fs.aio-max-nr): a program holding all 65536 made the host's
    own io_setup fail until it ended. io_setup is refused inside the sandbox."""
    if seccomp_filter() is None:
        pytest.skip(f"no seccomp filter for {os.uname().machine}")
    code = f"""
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
context = ctypes.c_ulong(0)
print(libc.syscall({SECCOMP_ARCHES[os.uname().machine][1]}, 1024, ctypes.byref(context)), ctypes.get_errno())
"""
    response = client.run_code(code)
    assert response.run_result.stdout == f"-1 {errno.ENOSYS}\n", response
