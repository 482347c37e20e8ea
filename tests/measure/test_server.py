"""fitter.measure.server: a user's llama-server on loopback, on a port of its own, and what a trial is when the server
dies or its port is taken; with the llama-server the set-up built and the demo model."""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from fitter import ports, process
from fitter.flags import parse_launch_flags
from fitter.measure import server as server_module
from fitter.measure.runners import ServerRunner
from fitter.measure.server import measure_server, server_argv, start_server
from fitter.measure.types import BenchSpec
from tests.conftest import BUILT_TOOLS
from tests.ports import OCCUPANTS, first_pick_taken

SERVER = str(BUILT_TOOLS / "llama-server")
FLAGS = ["-c", "512", "-np", "1", "-t", "1", "-tb", "1"]
SHORT = BenchSpec(n_prompt=16, n_gen=16, repetitions=1, threads=1)
LONG = BenchSpec(n_prompt=16, n_gen=512, repetitions=2, threads=1)  # ~2 s of requests: room to kill the server


def test_the_server_listens_on_loopback_on_fitters_port_whatever_the_flags_say() -> None:
    argv = server_argv("/opt/llama/llama-server", "/m/a b.gguf", ["--host", "0.0.0.0", "--port", "8080", "-c", "512"],
                       41234)
    assert argv == ["/opt/llama/llama-server", "-m", "/m/a b.gguf", "--host", "0.0.0.0", "--port", "8080", "-c", "512",
                    "-lv", "4", "--host", "127.0.0.1", "--port", "41234", "--no-webui"]  # llama.cpp keeps the last


@pytest.fixture
def demo() -> str:
    from fitter.gguf.demo_models import demo_model_path

    return str(demo_model_path())


@pytest.fixture
def servers(monkeypatch: pytest.MonkeyPatch) -> list[subprocess.Popen[bytes]]:
    """Every llama-server fitter starts during the test, in order."""
    out: list[subprocess.Popen[bytes]] = []
    real = process.spawn

    def spawn(argv: Any, **kw: Any) -> subprocess.Popen[bytes]:
        proc = real(argv, **kw)
        if argv[0] == SERVER:
            out.append(proc)
        return proc

    monkeypatch.setattr(process, "spawn", spawn)
    return out


def _port(proc: subprocess.Popen[bytes]) -> int:
    """The port a started server was given (its last --port)."""
    args = [str(a) for a in proc.args]  # type: ignore[union-attr]
    return int(args[max(i for i, a in enumerate(args) if a == "--port") + 1])


@pytest.mark.tools("llama-server")
def test_a_started_server_listens_on_127_0_0_1_only(llama_tools: dict[str, Path], demo: str,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("http_proxy", "http://127.0.0.1:9")  # loopback requests must not go to a proxy
    monkeypatch.delenv("no_proxy", raising=False)
    with tempfile.NamedTemporaryFile(suffix=".log") as log:
        proc, port, problem = start_server(SERVER, demo, FLAGS, Path(log.name), time.perf_counter() + 120)
        try:
            assert problem is None
            cmdline = Path(f"/proc/{proc.pid}/cmdline").read_bytes().split(b"\0")[:-1]
            assert [a.decode() for a in cmdline] == server_argv(SERVER, demo, FLAGS, port)
            assert ports.listening_addresses(proc.pid) == {("127.0.0.1", port)}
        finally:
            process.stop(proc)


@pytest.mark.tools("llama-server")
@pytest.mark.parametrize("how", OCCUPANTS)
def test_a_port_taken_before_the_server_holds_it_is_given_up_for_another(
        llama_tools: dict[str, Path], demo: str, monkeypatch: pytest.MonkeyPatch,
        servers: list[subprocess.Popen[bytes]], how: str) -> None:
    # a server that sets SO_REUSEPORT too binds beside the other program's socket instead of failing
    flags = [*FLAGS, "--reuse-port"] if how == "shared" else FLAGS
    with first_pick_taken(monkeypatch, how) as picks:
        m = measure_server(SERVER, demo, flags, SHORT, timeout=120)
    assert (m.outcome, m.reason) == ("ok", "")
    assert len(picks) == 2 and picks[0] != picks[1]
    assert [_port(p) for p in servers] == picks  # the first server was stopped, the second measured


@pytest.mark.tools("llama-server")
def test_a_server_killed_mid_trial_is_a_crash_and_the_next_trial_gets_a_fresh_one(
        llama_tools: dict[str, Path], demo: str, servers: list[subprocess.Popen[bytes]],
        monkeypatch: pytest.MonkeyPatch) -> None:
    killed: list[int] = []
    first_request = threading.Event()
    post = server_module._post

    def posting(*args: Any, **kw: Any) -> Any:  # the trial's first request is on its way: the server is serving it
        first_request.set()
        return post(*args, **kw)

    monkeypatch.setattr(server_module, "_post", posting)

    def kill_once_serving() -> None:
        first_request.wait(60)
        os.kill(servers[0].pid, signal.SIGKILL)
        killed.append(servers[0].pid)

    config = parse_launch_flags(["-c", "512", "-np", "1"])
    with ServerRunner(SERVER) as runner:
        killer = threading.Thread(target=kill_once_serving)
        killer.start()
        first = runner.run(demo, config, LONG, 120).measurement
        killer.join()
        second = runner.run(demo, config, SHORT, 120).measurement
    assert killed == [servers[0].pid]
    assert (first.outcome, first.reason, first.returncode) == (
        "crash", "llama-server killed by signal SIGKILL during the trial", -signal.SIGKILL)
    assert first.pp is None and first.tg is None
    assert (second.outcome, len(servers)) == ("ok", 2)
    assert second.tg is not None and second.tg.n == 16


def test_streams_are_concurrent_requests_a_slot_each(demo: str) -> None:
    spec = BenchSpec(n_prompt=16, n_gen=16, n_depth=32, repetitions=2, threads=1, streams=2)
    m = measure_server(SERVER, demo, ["-c", "1024", "-np", "2", "-t", "1", "-tb", "1"], spec, 120)
    assert m.outcome == "ok", m.reason
    assert m.pp is not None and m.tg is not None and m.tg_stream is not None and m.ttft is not None
    assert (m.pp.n, m.tg.n, m.tg_stream.n, m.tg.depth) == (16, 16, 16, 32)
    assert len(m.tg.samples_ts) == len(m.tg_stream.samples_ts) == len(m.ttft.samples_ms) == 2
    assert all(x > 0 for x in m.ttft.samples_ms)


def test_fitters_worker_and_llama_bench_measure_one_stream() -> None:
    from fitter.measure.runners import LlamaBenchRunner, WorkerRunner
    from fitter.measure.types import WorkerError

    two = BenchSpec(streams=2)
    with pytest.raises(WorkerError, match=r"^fitter's worker measures one stream; 2 concurrent streams are served by "
                                          r"llama-server \(--llama-cpp DIR\) or a simulated machine"):
        WorkerRunner().run("m.gguf", parse_launch_flags([]), two, None)
    with pytest.raises(WorkerError, match=r"^llama-bench measures one stream"):
        LlamaBenchRunner("/bin/llama-bench").run("m.gguf", parse_launch_flags([]), two, None)


PROMPTS = ("Once upon a time, in a village by the sea, there lived", "The three laws of thermodynamics are")


@pytest.mark.tools("llama-server")
def test_decode_on_prompts_counts_what_a_draft_drafted_and_the_model_accepted(llama_tools: dict[str, Path]) -> None:
    # greedy decoding: a model drafting for itself is right but where a batch's arithmetic breaks a near-tie of its
    # random weights; another tiny model of weights of its own is nearly never right
    from tests.models import model_file

    target = str(model_file("qwen3-tiny"))
    spec = BenchSpec(n_prompt=16, n_gen=24, repetitions=2, threads=1, prompts=PROMPTS)
    flags = ["-c", "1024", "-np", "1", "-t", "1", "--spec-type", "draft-simple", "-fit", "off"]
    own = measure_server(SERVER, target, [*flags, "-md", target], spec, timeout=120, vocab_size=512)
    other = measure_server(SERVER, target, [*flags, "-md", str(model_file("llama-tiny"))], spec, timeout=120,
                           vocab_size=512)
    for m in (own, other):
        assert (m.outcome, m.reason) == ("ok", "")
        assert m.tg is not None and len(m.tg.samples_ts) == 2
        assert m.pp is not None and len(m.pp.samples_ts) == 2
        assert [b.buft for b in m.buffers if b.kind == "kv"] == ["CPU", "CPU"]  # the model's cache, then the draft's
    assert own.drafted is not None and own.drafted[0] > 0 and own.drafted[1] >= 0.9 * own.drafted[0]
    assert other.drafted is not None and other.drafted[0] > 0 and other.drafted[1] <= 0.1 * other.drafted[0]
    n, accepted = own.drafted
    assert own.to_json()["draft"] == {"drafted": n, "accepted": accepted, "acceptance": round(accepted / n, 4)}
