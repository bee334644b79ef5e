"""Issue 17 "Must show": 50 MB / 5 MB / 1 MB chat bodies (Content-Length and chunked) against
a default server: status and time of each answer, the API server's RSS growth, and /health
latency polled every 10 ms meanwhile. Run from the repository root:
``PYTHONPATH=$PWD python benchmarks/hard_edges_bodies.py``."""
import json, multiprocessing, socket, sys, threading, time
import httpx, psutil
sys.path.insert(0, "tests/e2e")
from e2e_utils import RemoteServer

srv = RemoteServer(["--kv-cache-memory", "256MiB"], api_key=None)
proc = psutil.Process(srv.proc.pid)

def poll(url, conn):
    """In its own process: this client's GIL (building and sending 50 MB) must not show up
    as /health latency. Polls between a "start" and a "stop" message, then sends the list."""
    with httpx.Client() as c:
        while conn.recv() == "start":
            got = []
            while not conn.poll():
                t = time.perf_counter(); r = c.get(url); got.append((time.perf_counter() - t, r.status_code))
                time.sleep(0.01)
            conn.recv()
            conn.send(got)

def body_of(nbytes):
    pad = nbytes - len(json.dumps({"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": ""}]}))
    return json.dumps({"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "hello " * (pad // 6) + "x" * (pad % 6)}]}).encode()

def send_raw(body, chunked=False):
    s = socket.create_connection(("127.0.0.1", srv.port)); s.settimeout(30)
    head = b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
    head += b"transfer-encoding: chunked\r\n\r\n" if chunked else b"content-length: %d\r\n\r\n" % len(body)
    t0 = time.perf_counter(); s.sendall(head)
    resp = b""; done = threading.Event()
    def reader():
        nonlocal resp
        try:
            while b"\r\n\r\n" not in resp or len(resp.split(b"\r\n\r\n", 1)[1]) < 20:
                d = s.recv(65536)
                if not d: break
                resp += d
        except OSError: pass
        done.set()
    th = threading.Thread(target=reader); th.start()
    try:
        for i in range(0, len(body), 1 << 16):
            if done.is_set(): break
            part = body[i:i + (1 << 16)]
            s.sendall(b"%x\r\n%s\r\n" % (len(part), part) if chunked else part)
        if chunked and not done.is_set(): s.sendall(b"0\r\n\r\n")
    except OSError: pass
    done.wait(30); t = time.perf_counter() - t0; s.close(); th.join(1)
    return resp.split(b"\r\n", 1)[0].decode(), t, resp.split(b"\r\n\r\n", 1)[-1][:160]

ours, theirs = multiprocessing.Pipe()
poller = multiprocessing.Process(target=poll, args=(srv.url_for("health"), theirs), daemon=True); poller.start()
httpx.get(srv.url_for("health")); time.sleep(1)
rss0 = proc.memory_info().rss
for size, chunked in ((50_000_000, False), (50_000_000, True), (5_000_000, False), (5_000_000, True), (1_000_000, False), (1_000_000, True)):
    payload = body_of(size)
    ours.send("start"); time.sleep(0.3)
    status, t, body = send_raw(payload, chunked)
    time.sleep(0.3)
    ours.send("stop"); lat = ours.recv()
    ls = sorted(l for l, _ in lat); worst = ls[-1]; med = ls[len(ls)//2]; p90 = ls[int(len(ls)*0.9)]
    print(f"{size/1e6:.0f} MB {'chunked' if chunked else 'content-length'}: {status!r} in {t:.3f} s; RSS growth "
          f"{(proc.memory_info().rss - rss0)/2**20:.1f} MiB; /health median {med*1000:.1f} p90 {p90*1000:.1f} max {worst*1000:.1f} ms over {len(lat)} polls; {body[:110]!r}")
ours.send("quit"); poller.join(5)
print("rss_peak_hwm", psutil.Process(srv.proc.pid).memory_full_info().rss / 2**20)
print(open(srv.log.name).read()[-1500:])
srv.stop()
