"""Slow, idle and too many clients against a real server process with an open-file limit of 1,024: connections
that never send a byte or trickle their headers are closed at their timeouts, the cap makes room by closing the
longest-waiting one and never one whose request is being handled, and meanwhile the API keeps answering with a
small log."""
from __future__ import annotations

import json
import resource
import selectors
import socket
import statistics
import subprocess
import sys
import textwrap
import threading
import time
import urllib.request

import pytest

from tests.controlplane.conftest import TOKENS, bootstrap_doc
from tests.serverproc import ServerProcess

REQUEST_S, IDLE_S = 2.0, 4.0  # the server's --request-timeout and --idle-timeout in these tests
SLACK_S = 3.0  # what closing may take beyond a timeout: the guard's timer, the loop under load, a SYN retried once
IDLE_CONNECTIONS, TRICKLING_CONNECTIONS = 2_000, 500
TRICKLE_HEAD = b"POST /api/compute/reservations/list HTTP/1.1\r\nHost: berth\r\nX-Trickle: "


@pytest.fixture
def enough_files():
    """This process opens 2,500 sockets at once: raise its own soft open-file limit for the test."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = 4_096
    if hard != resource.RLIM_INFINITY and hard < need:
        pytest.skip(f"the open-file hard limit ({hard}) is below the {need} this test needs")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, need), hard))
    yield
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@pytest.fixture
def start_server(tmp_path):
    """start_server(*flags): a server with the short timeouts and an open-file limit of 1,024, stopped at the end
    whatever happens."""
    started: list[ServerProcess] = []

    def start(*flags: str) -> ServerProcess:
        (tmp_path / "b.json").write_text(json.dumps(bootstrap_doc()))
        server = ServerProcess(tmp_path / "cp.db", tmp_path / "b.json",
                               ["--synchronous", "NORMAL", "--request-timeout", str(REQUEST_S),
                                "--idle-timeout", str(IDLE_S), *flags], nofile=1024)
        started.append(server)
        return server.start()

    yield start
    for server in started:
        server.stop()


def address(server: ServerProcess) -> tuple[str, int]:
    host, port = server.url.removeprefix("http://").split(":")
    return host, int(port)


def closed_by_peer(sock: socket.socket, timeout: float) -> bool:
    """True when the server closes sock within timeout (whatever it sent first)."""
    sock.settimeout(timeout)
    try:
        while sock.recv(65536):
            pass
        return True
    except ConnectionError:
        return True
    except TimeoutError:
        return False


class Traffic(threading.Thread):
    """Healthz and creates, one after another, until stopped: (kind, status, seconds) per call."""

    def __init__(self, server: ServerProcess):
        super().__init__(daemon=True)
        self.server = server
        self.stop = threading.Event()
        self.calls: list[tuple[str, int, float]] = []

    def run(self) -> None:
        n = 0
        while not self.stop.is_set():
            t0 = time.monotonic()
            try:
                with urllib.request.urlopen(self.server.url + "/healthz", timeout=10) as resp:
                    status = resp.status
            except OSError as exc:
                status = -1
                print("healthz failed:", exc)
            self.calls.append(("healthz", status, time.monotonic() - t0))
            if n < 40:  # alice's quota holds 64 H100s
                t0 = time.monotonic()
                try:
                    status, _ = self.server.post("/api/compute/reservations/create", TOKENS["alice"], {
                        "poolId": "h100", "gpuModel": "H100_80GB", "gpuCount": 1, "durationHours": 1,
                        "idempotencyKey": f"slow-{n}"})
                except OSError as exc:
                    status = -1
                    print("create failed:", exc)
                self.calls.append(("create", status, time.monotonic() - t0))
                n += 1
            self.stop.wait(0.05)


def test_idle_and_trickling_connections_are_closed_while_the_api_answers(start_server, enough_files):
    server = start_server()
    traffic = Traffic(server)
    opened: dict[socket.socket, tuple[str, float]] = {}  # socket -> (idle|trickle, when its timeout began)
    closed: dict[socket.socket, float] = {}
    sel = selectors.DefaultSelector()
    t_start = time.monotonic()
    try:
        traffic.start()
        addr = address(server)
        total = IDLE_CONNECTIONS + TRICKLING_CONNECTIONS
        every = total // TRICKLING_CONNECTIONS  # interleaved: 1 in 5 trickles
        kinds = ["trickle" if i % every == every - 1 else "idle" for i in range(total)]
        trickling = []
        for i, kind in enumerate(kinds):
            s = socket.create_connection(addr, timeout=10)
            s.setblocking(False)
            if kind == "trickle":
                s.send(TRICKLE_HEAD)
                trickling.append(s)
            opened[s] = (kind, time.monotonic())
            sel.register(s, selectors.EVENT_READ)
            if i % 100 == 99:  # let the server's accept loop keep up (the listen backlog is 128)
                time.sleep(0.01)
        t_opened = time.monotonic()
        deadline = t_opened + IDLE_S + SLACK_S
        next_byte = time.monotonic() + 1
        while len(closed) < len(opened) and time.monotonic() < deadline:
            for key, _ in sel.select(timeout=0.1):
                s = key.fileobj
                try:
                    data = s.recv(65536)
                except (ConnectionError, BlockingIOError):
                    data = b""
                if not data:
                    closed[s] = time.monotonic()
                    sel.unregister(s)
            if time.monotonic() >= next_byte:  # one more header byte from each trickling connection still open
                next_byte += 1
                for s in trickling:
                    if s not in closed:
                        try:
                            s.send(b"a")
                        except OSError:
                            pass  # closed: the selector reports it
        t_closed = time.monotonic()
        traffic.stop.set()
        traffic.join(15)
    finally:
        traffic.stop.set()
        sel.close()
        for s in opened:
            s.close()
    open_left = [kind for s, (kind, _) in opened.items() if s not in closed]
    assert not open_left, f"{len(open_left)} slow connections still open {t_closed - t_opened:.1f} s after opening"
    late = [(kind, round(closed[s] - began, 2)) for s, (kind, began) in opened.items()
            if closed[s] - began > (IDLE_S if kind == "idle" else REQUEST_S) + SLACK_S]
    assert not late, f"closed later than the timeout plus {SLACK_S} s: {late[:10]}"

    healthz = [c for c in traffic.calls if c[0] == "healthz"]
    creates = [c for c in traffic.calls if c[0] == "create"]
    assert healthz and creates
    assert {status for _, status, _ in healthz} == {200}, healthz
    assert {status for _, status, _ in creates} == {202}, creates
    seconds = [s for _, _, s in traffic.calls]
    assert max(seconds) < 5 and statistics.median(seconds) < 0.5, sorted(seconds)[-10:]

    with urllib.request.urlopen(server.url + "/healthz", timeout=5) as resp:
        assert resp.status == 200
    assert server.stop() == 0
    log = "".join(server.lines)
    assert len(log.encode()) < 50_000, log[-5_000:]
    assert "Traceback" not in log and "out of system resource" not in log, log[-5_000:]
    print(f"{len(opened)} slow connections opened in {t_opened - t_start:.1f} s, all closed "
          f"{t_closed - t_opened:.1f} s later; {len(traffic.calls)} API calls, median "
          f"{statistics.median(seconds) * 1000:.0f} ms, max {max(seconds) * 1000:.0f} ms; log {len(log)} bytes")


def busy(addr) -> socket.socket:
    """A connection whose request is being handled: complete headers, a body announced and not sent yet."""
    s = socket.create_connection(addr, timeout=10)
    s.sendall(b"POST /api/compute/reservations/list HTTP/1.1\r\nHost: berth\r\nContent-Type: application/json\r\n"
              b"Authorization: Bearer " + TOKENS["alice"].encode() + b"\r\nContent-Length: 2\r\n\r\n")
    return s


def long_poll(addr, operation_id: str, seconds: float) -> socket.socket:
    """A connection in a long poll: operations/wait on an operation that stays running (no agent binds it)."""
    body = json.dumps({"operationId": operation_id, "timeoutMs": int(seconds * 1000)}).encode()
    s = socket.create_connection(addr, timeout=10)
    s.sendall(b"POST /api/compute/operations/wait HTTP/1.1\r\nHost: berth\r\nContent-Type: application/json\r\n"
              b"Authorization: Bearer " + TOKENS["alice"].encode() + b"\r\nContent-Length: "
              + str(len(body)).encode() + b"\r\n\r\n" + body)
    return s


def test_the_cap_closes_the_longest_waiting_connection_never_a_busy_one(start_server):
    server = start_server("--max-connections", "4")
    addr = address(server)
    status, doc = server.post("/api/compute/reservations/create", TOKENS["alice"], {
        "poolId": "h100", "gpuModel": "H100_80GB", "gpuCount": 1, "durationHours": 1, "idempotencyKey": "poll"})
    assert status == 202 and doc["reservation"]["operation"]["status"] == "running"
    socks = []
    try:
        idle_old = socket.create_connection(addr, timeout=10)
        socks.append(idle_old)
        time.sleep(0.2)
        idle_new = socket.create_connection(addr, timeout=10)
        socks.append(idle_new)
        time.sleep(0.2)
        reading = busy(addr)  # waits for its body
        polling = long_poll(addr, doc["reservation"]["operation"]["id"], IDLE_S + 2)  # outlasts the idle timeout
        socks += [reading, polling]
        time.sleep(0.2)
        # the cap is reached: a new connection makes room by closing the idle connection that waited longest
        with urllib.request.urlopen(server.url + "/healthz", timeout=5) as resp:
            assert resp.status == 200
        assert closed_by_peer(idle_old, 2)
        assert not closed_by_peer(idle_new, 0.2)
        # the busy connections' requests are still handled: each gets its answer
        reading.settimeout(REQUEST_S + SLACK_S)
        answer = reading.recv(65536)
        assert answer.startswith(b"HTTP/1.1 408"), answer  # the body never came
        t0 = time.monotonic()
        polling.settimeout(IDLE_S + 2 + SLACK_S)
        answer = polling.recv(65536)
        assert answer.startswith(b"HTTP/1.1 200") and b'"done": false' in answer.replace(b'":false', b'": false')
        assert time.monotonic() - t0 > 2  # it ran its whole wait, past the idle timeout
    finally:
        for s in socks:
            s.close()
    assert server.stop() == 0


def test_a_new_connection_is_refused_when_every_one_is_handling_a_request(start_server):
    server = start_server("--max-connections", "2")
    addr = address(server)
    socks = []
    try:
        socks += [busy(addr), busy(addr)]
        time.sleep(0.3)
        refused = socket.create_connection(addr, timeout=10)
        socks.append(refused)
        t0 = time.monotonic()
        assert closed_by_peer(refused, 1.0), "not refused at once"
        assert time.monotonic() - t0 < 1.0
        for s in socks[:2]:  # neither request was cut short
            s.settimeout(REQUEST_S + SLACK_S)
            assert s.recv(65536).startswith(b"HTTP/1.1 408")
    finally:
        for s in socks:
            s.close()
    assert server.stop() == 0
    log = "".join(server.lines)
    assert "refused a new connection" in log and "--max-connections" in log


def test_connections_without_a_request_in_progress_are_closed_at_their_timeouts(start_server):
    server = start_server()
    addr = address(server)
    with socket.create_connection(addr, timeout=10) as silent, socket.create_connection(addr, timeout=10) as slow, \
            socket.create_connection(addr, timeout=10) as kept:
        slow.sendall(b"GET /healthz HTTP/1.1\r\nHost: berth\r\n")  # headers never complete
        kept.sendall(b"GET /healthz HTTP/1.1\r\nHost: berth\r\n\r\n")  # answered, then kept alive and idle
        assert kept.recv(65536).startswith(b"HTTP/1.1 200")
        t0 = time.monotonic()
        assert closed_by_peer(slow, REQUEST_S + SLACK_S)
        assert REQUEST_S - 0.5 < time.monotonic() - t0
        assert closed_by_peer(silent, IDLE_S + SLACK_S) and closed_by_peer(kept, SLACK_S)
        assert IDLE_S - 0.5 < time.monotonic() - t0
    assert server.stop() == 0


def test_a_max_connections_above_the_open_file_limit_stops_the_start_saying_what_to_do(tmp_path):
    (tmp_path / "b.json").write_text(json.dumps(bootstrap_doc()))
    out = subprocess.run(
        [sys.executable, "-m", "berth", "controlplane", "serve", "--listen", "127.0.0.1:0",
         "--db", f"sqlite:///{tmp_path / 'cp.db'}", "--bootstrap", str(tmp_path / "b.json"),
         "--max-connections", "5000"],
        capture_output=True, text=True, timeout=30,
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (1024, 1024)),
    )
    assert out.returncode == 2, out.stderr
    assert "--max-connections 5000" in out.stderr and "LimitNOFILE" in out.stderr


ACCEPT_FLOOD = textwrap.dedent("""
    # A guarded site whose cap is above what the open-file limit allows, so that accept() fails with EMFILE.
    import asyncio, resource, sys
    from aiohttp import web
    from common import logs
    from controlplane.api import guard

    resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
    logs.configure("json", "info")

    async def main():
        loop = asyncio.get_running_loop()
        conns = guard.Guard(guard.Limits(idle_timeout_s=60), cap=10_000)
        loop.set_exception_handler(conns.exception_handler)
        runner = web.AppRunner(web.Application())
        await runner.setup()
        site = guard.GuardedSite(runner, "127.0.0.1", 0, conns)
        await site.start()
        print(site.address[1], flush=True)
        await asyncio.sleep(float(sys.argv[1]))
        await runner.cleanup()

    asyncio.run(main())
""")


def test_accept_failures_are_one_rate_limited_line_not_a_traceback_each(tmp_path, enough_files):
    proc = subprocess.Popen([sys.executable, "-c", ACCEPT_FLOOD, "4"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    socks = []
    try:
        port = int(proc.stdout.readline())
        for _ in range(150):  # more than the 64 descriptors the process may hold
            socks.append(socket.create_connection(("127.0.0.1", port), timeout=10))
        _, err = proc.communicate(timeout=30)
    finally:
        for s in socks:
            s.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    lines = [json.loads(line) for line in err.splitlines()]
    accept = [line for line in lines if line["event"].startswith("cannot accept connections")]
    assert len(accept) == 1 and "LimitNOFILE" in accept[0]["event"], err[-3000:]
    assert "Traceback" not in err and len(err) < 5_000, err[-3000:]
