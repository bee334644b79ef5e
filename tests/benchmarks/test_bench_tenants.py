"""``llmserve bench tenants``' summary table (fresh-user trial of issue 34: the run ended in
JSON only). The formatting on a small result dict; the benchmark itself is not run."""
from __future__ import annotations

import argparse
import json
import re

import pytest

from llmserve.benchmarks import tenants


def _result() -> dict:
    """A two-server result shaped as ``main``'s (TTFTs, tok/s, flood 429s, shares and ratios
    from the issue 34 closing run; the other counts made up)."""
    def phase(median, p99, n, tok_s, status, **extra):
        return {"status": status, "quiet_ttft_median_s": median, "quiet_ttft_p99_s": p99, "quiet_n": n,
                "output_tok_s": tok_s, "refusals_without_retry_after": {}, "timeouts": {}, "n_errors": 0, **extra}
    return {
        "load_avg_start": 2.5, "load_avg_end": 2.8, "cpus": 2,
        "fifo": {"capacity_req_s": 10.0,
                 "baseline": phase(0.077, 0.269, 160, 568.2, {"flooder": {200: 900}, "quiet": {200: 160}}),
                 "flood": phase(0.837, 1.017, 17, 550.2, {"flooder": {200: 2933, 429: 22436},
                                                          "quiet": {200: 17, 429: 143}}, timeouts={"quiet": 2}),
                 "weights": phase(None, None, 0, 600.0, {"light": {200: 50}, "heavy": {200: 50}},
                                  shares={"light": 0.698, "heavy": 0.302})},
        "fair": {"capacity_req_s": 10.0,
                 "baseline": phase(0.036, 0.062, 160, 606.0, {"flooder": {200: 950}, "quiet": {200: 160}}),
                 "flood": phase(0.039, 0.073, 160, 541.0, {"flooder": {200: 2711, 429: 24351},
                                                           "quiet": {200: 160}}, keys_reloads=28),
                 "weights": phase(None, None, 0, 610.0, {"light": {200: 30}, "heavy": {200: 90}},
                                  shares={"light": 0.2498, "heavy": 0.7502})},
        "fifo_quiet_p99_flood_over_baseline": 3.78, "fair_quiet_p99_flood_over_baseline": 1.17,
        "flood_output_tok_s_fair_over_fifo": 0.983,
    }


def _rows(text: str) -> dict[tuple[str, str], list[str]]:
    """(phase, server) -> the row's cells (split on runs of two or more spaces)."""
    lines = text.splitlines()
    header = re.split(r"\s{2,}", lines[0])
    assert header == [name for name, _ in tenants._SUMMARY_COLUMNS]
    assert set(lines[1]) == {"-"}
    cells = [re.split(r"\s{2,}", line.strip()) for line in lines[2:] if re.match(r"(baseline|flood|weights)\s{2,}", line)]
    assert all(len(c) == len(header) for c in cells), cells
    return {(c[0], c[1]): c[2:] for c in cells}


def test_summary_table_per_phase_and_server():
    text = tenants.format_summary(_result())
    rows = _rows(text)
    assert list(rows) == [(p, k) for p in ("baseline", "flood", "weights") for k in ("fifo", "fair")]
    #                               quiet n  p50      p99      flood/base  tok/s    429s     shares
    assert rows["baseline", "fifo"] == ["160", "0.077", "0.269", "-", "568.2", "0", "-"]
    assert rows["flood", "fifo"] == ["17", "0.837", "1.017", "3.78x", "550.2", str(22436 + 143), "-"]
    assert rows["flood", "fair"] == ["160", "0.039", "0.073", "1.17x", "541.0", "24351", "-"]
    assert rows["weights", "fair"] == ["-", "-", "-", "-", "610.0", "0", "0.250:0.750"]
    assert rows["weights", "fifo"][-1] == "0.698:0.302"
    assert "flood output tok/s, fair / FIFO: 0.983" in text
    assert "fifo flood: 2 timeouts" in text and "fair flood:" not in text  # only phases with problems
    assert "load average 2.5 at start, 2.8 at end" in text


def test_summary_of_a_json_round_trip_and_of_engine_steps():
    # Read back from --output-json the status codes are strings: the 429s still count.
    again = json.loads(json.dumps(_result()))
    assert _rows(tenants.format_summary(again))["flood", "fair"][5] == "24351"
    # --engine-steps: no HTTP (no status, "-" for 429s), the weight share as heavy_share; one server only.
    engine = {"fair": {"weights": {"output_tok_s": 700.0, "quiet_n": 0, "heavy_share": 0.74},
                       "flood": {"output_tok_s": 650.0, "quiet_n": 30, "quiet_ttft_median_s": 0.01,
                                 "quiet_ttft_p99_s": 0.02}}}
    rows = _rows(tenants.format_summary(engine))
    assert rows == {("weights", "fair"): ["-", "-", "-", "-", "700.0", "-", "0.260:0.740"],
                    ("flood", "fair"): ["30", "0.010", "0.020", "-", "650.0", "-", "-"]}


def test_main_prints_the_table_and_writes_the_json(monkeypatch, tmp_path, capsys):
    """As `bench serve`: the table on stdout, every figure in the --output-json file."""
    async def fake_servers(args, kinds):
        r = _result()
        return {k: r[k] for k in kinds}

    monkeypatch.setattr(tenants, "_run_servers", fake_servers)
    parser = argparse.ArgumentParser()
    tenants.add_cli_args(parser)
    out = tmp_path / "r.json"
    res = tenants.main(parser.parse_args(["--output-json", str(out)]))
    printed = capsys.readouterr().out
    assert printed.startswith("phase") and "{" not in printed  # the table, not the JSON
    assert f"Saved result to {out}" in printed
    saved = json.loads(out.read_text())
    assert saved["fair"]["flood"]["status"]["flooder"]["429"] == 24351
    assert saved == json.loads(json.dumps(res, default=str))
    assert res["fifo_quiet_p99_flood_over_baseline"] == pytest.approx(1.017 / 0.269)  # main's own ratios
    assert f"{1.017 / 0.269:.2f}x" in printed


def _parse(argv):
    from llmserve.entrypoints.cli import make_parser
    full = ["bench", "tenants", *argv]
    return make_parser(full).parse_args(full)


@pytest.mark.parametrize("server_args", ["--port 8650", "--dtype float32 --port=8650", "--host 0.0.0.0"])
def test_server_args_refuse_host_and_port(server_args, capsys):
    """The bench picks each server's port: a --port in --server-args made it poll /health
    on a port nobody listened on, forever."""
    with pytest.raises(SystemExit) as e:
        _parse(["--server-args", server_args])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--server-args" in err and "the bench chooses" in err
    assert _parse(["--server-args", "--dtype float32 --enforce-eager"]).server_args == "--dtype float32 --enforce-eager"


@pytest.mark.parametrize("phases", ["bogus", "baseline,bogus", "baseline,,flood", ""])
def test_phases_are_validated_at_parsing(phases, capsys):
    with pytest.raises(SystemExit) as e:
        _parse(["--phases", phases])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "unknown phase" in err and "baseline, flood, weights" in err


def test_phases_strip_spaces_and_default():
    assert _parse(["--phases", "baseline, flood"]).phases == "baseline,flood"
    assert _parse([]).phases == "baseline,flood,weights"


@pytest.mark.parametrize("duration", ["0", "-5", "nan"])
def test_duration_must_be_positive(duration, capsys):
    with pytest.raises(SystemExit) as e:
        _parse(["--duration", duration])
    assert e.value.code == 2
    assert "--duration" in capsys.readouterr().err
    assert _parse(["--duration", "0.5"]).duration == 0.5


def test_health_wait_times_out_and_stops_the_server():
    """A server that never answers /health: an error naming the log after the timeout (not a
    hang), and the process is terminated."""
    import subprocess
    import sys
    import socket
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        with pytest.raises(RuntimeError, match=r"within 1 s; log: the\.log"):
            tenants._wait_healthy(proc, f"http://127.0.0.1:{port}", "the.log", timeout_s=1.0)
        assert proc.poll() is not None
    finally:
        proc.kill()
        proc.wait()


def test_health_wait_fails_when_the_server_exits():
    import subprocess
    import sys
    proc = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    with pytest.raises(RuntimeError, match="exited with 3"):
        tenants._wait_healthy(proc, "http://127.0.0.1:9", "the.log", timeout_s=60.0)
