"""Measure the binary a user deploys: start their llama-server with the flags on 127.0.0.1, measure, stop it.

Prefill and decode speeds come from llama-server's own `/completion` timings (`prompt_per_second`,
`predicted_per_second`, tools/server/server-common.cpp), measuring what llama-bench measures: for a depth d the
context is first filled with d tokens (cached by the slot); a prefill repetition sends those d tokens plus p new ones,
so only the p new tokens are prefilled, at depth d; a decode repetition sends the d tokens alone (the slot re-evaluates
the last one) and decodes n tokens after them, at depth d, as llama-bench's tg test does. At d = 0 the decode prompt
is one token. The buffers come from the server's log, the build from `llama-server --version`.

The server listens on 127.0.0.1 only, on a port fitter picks: one lost to another process before the server held it
is given up for a fresh one (fitter.ports). A server that dies during a trial makes that trial a crash that
names its signal or exit status; each trial starts a server of its own.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from fitter import ports, process
from fitter.errors import FitterError
from fitter.machine.rss import peak_rss
from fitter.measure.llamacpp.builds import server_build
from fitter.measure.logs import classify_exit, parse_buffer_lines
from fitter.measure.types import BenchSpec, Latency, Measurement, SpeedStats

HOST = ports.HOST
_START_ATTEMPTS = 3  # a port found free can be taken before llama-server binds it: try another
# the bind failed: tools/server/server-http.cpp `server_http_context::start` (0c1e570; server.cpp's main before it)
_BIND_FAILED = "couldn't bind HTTP server socket"
# loopback needs no proxy: urllib would send these requests to $http_proxy unless $no_proxy names the host
_LOOPBACK = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def server_argv(binary: str, model: str, flags: list[str], port: int) -> list[str]:
    """The command line (pure): the user's flags, on loopback, with a port of fitter's choosing (last: llama.cpp keeps
    the last value of a repeated flag). Log verbosity 4 makes llama-server print llama.cpp's buffer lines (its
    default of 3 hides them)."""
    verbosity = [] if any(f in ("-lv", "--verbosity", "--log-verbosity") for f in flags) else ["-lv", "4"]
    return [binary, "-m", model, *flags, *verbosity, "--host", HOST, "--port", str(port), "--no-webui"]


def completion_request(tokens: list[int], n_predict: int, slot: int | None = None) -> dict[str, Any]:
    body = {"prompt": tokens, "n_predict": n_predict, "cache_prompt": True, "ignore_eos": True,
            "temperature": 0.0, "samplers": ["top_k"], "top_k": 1, "stream": False}
    if slot is not None:  # tools/server/server-context.cpp get_available_slot: a task's id_slot picks its slot
        body["id_slot"] = slot
    return body


def _post(port: int, path: str, body: dict[str, Any], timeout: float) -> dict[str, Any]:
    req = urllib.request.Request(f"http://{HOST}:{port}{path}", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with _LOOPBACK.open(req, timeout=timeout) as resp:
        out: dict[str, Any] = json.loads(resp.read())
        return out


def _healthy(port: int) -> bool:
    try:
        with _LOOPBACK.open(f"http://{HOST}:{port}/health", timeout=2) as resp:
            return bool(resp.status == 200)
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
        return False


def _wait_healthy(proc: subprocess.Popen[bytes], port: int, deadline: float) -> str:
    """"ok" once the server alone listens on `port` and answers /health; else "exited", "taken" (another process
    listens there) or "timeout" (past `deadline`, a perf_counter time)."""
    while True:
        if proc.poll() is not None:
            return "exited"
        state = ports.port_state(proc.pid, port)
        if state == "taken":
            return "taken"
        if state == "ours" and _healthy(port):
            return "ok"
        if time.perf_counter() > deadline:
            return "timeout"
        time.sleep(0.2)


def start_server(binary: str, model: str, flags: list[str], log_path: Path,
                 deadline: float) -> tuple[subprocess.Popen[bytes], int, str | None]:
    """Start llama-server on a free loopback port and wait until it is healthy: (process, port, None), or (process,
    port, "exited" | "timeout") when it exited or was not healthy by `deadline` (a perf_counter time). A port lost to
    another process (the bind failed, or another process listens there too) is given up for a fresh one, up to
    _START_ATTEMPTS times. The caller stops the process; its output is in `log_path`."""
    for _ in range(_START_ATTEMPTS):
        port = ports.pick_free_port("llama-server")
        with log_path.open("wb") as log:  # each attempt's output alone
            proc = process.spawn(server_argv(binary, model, flags, port), env=dict(os.environ), stdout=log,
                                 stderr=subprocess.STDOUT)
        try:
            state = _wait_healthy(proc, port, deadline)
        except BaseException:
            process.stop(proc)
            raise
        if state == "taken" or (state == "exited" and _BIND_FAILED in log_path.read_text(errors="replace")):
            process.stop(proc)
            continue
        return proc, port, None if state == "ok" else state
    raise FitterError(f"llama-server --port {port}: taken by another process before llama-server held it, "
                      f"{_START_ATTEMPTS} free ports on {HOST} in a row")


def _stats(n: int, depth: int, samples_ts: list[float]) -> SpeedStats:
    return SpeedStats.from_ns(n, depth, [round(n * 1e9 / ts) for ts in samples_ts])


def measure_server(
    binary: str, model: str, flags: list[str], spec: BenchSpec, timeout: float = 600.0, vocab_size: int = 256,
) -> Measurement:
    """Run the user's llama-server once and measure; the server is always stopped."""
    n_prompt, n_gen, n_depth, repetitions = spec.n_prompt, spec.n_gen, spec.n_depth, spec.repetitions
    t0 = time.perf_counter()
    fd, name = tempfile.mkstemp(prefix="fitter-llama-server-", suffix=".log")
    os.close(fd)
    log_path = Path(name)
    proc: subprocess.Popen[bytes] | None = None
    try:
        proc, port, problem = start_server(binary, model, flags, log_path, t0 + timeout)
        if problem == "exited":
            log = log_path.read_text(errors="replace")
            outcome, reason = classify_exit(proc.returncode, log)
            return _failed(outcome, reason, log, t0, spec, flags, proc.returncode)
        if problem == "timeout":
            return _failed("timeout", f"llama-server not healthy after {timeout:.0f} s",
                           log_path.read_text(errors="replace"), t0, spec, flags)
        load_s = time.perf_counter() - t0
        if spec.streams > 1:
            return _measure_streams(binary, proc, port, flags, spec, timeout, vocab_size, log_path, t0, load_s)
        if spec.prompts:
            return _measure_prompts(binary, proc, port, flags, spec, timeout, vocab_size, log_path, t0, load_s)
        # token ids from the byte range every generated vocabulary has; deterministic
        depth_tokens = [(7 * i) % (vocab_size - 10) + 10 for i in range(n_depth)]
        decode_prompt = depth_tokens or [10]
        try:
            if n_depth:
                _post(port, "/completion", completion_request(depth_tokens, 0), timeout)
            pp: list[float] = []
            tg: list[float] = []
            for r in range(-1, repetitions):  # r = -1: the warm-up, not recorded
                if n_prompt:
                    new = _prefill_tokens(n_prompt, vocab_size, r)  # the slot keeps the depth prefix only
                    out = _post(port, "/completion", completion_request(depth_tokens + new, 1), timeout)
                    if r >= 0:
                        pp.append(float(out["timings"]["prompt_per_second"]))
                if n_gen:
                    out = _post(port, "/completion", completion_request(decode_prompt, n_gen), timeout)
                    if r >= 0:
                        tg.append(float(out["timings"]["predicted_per_second"]))
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError) as e:
            rc, outcome, reason = _request_failed(proc, e, log_path, timeout)
            return _failed(outcome, reason, log_path.read_text(errors="replace"), t0, spec, flags, rc)
        return _measured(binary, proc, flags, spec, log_path, t0, load_s, pp, tg)
    finally:
        if proc is not None:
            process.stop(proc)
        log_path.unlink(missing_ok=True)


def _measure_prompts(binary: str, proc: subprocess.Popen[bytes], port: int, flags: list[str], spec: BenchSpec,
                     timeout: float, vocab_size: int, log_path: Path, t0: float, load_s: float) -> Measurement:
    """Prefill as a single test measures it (-p synthetic tokens); decode on the user's text: each repetition
    decodes -n tokens after every prompt, greedily (a speculation's acceptance then depends on the text alone), and
    its rate is their tokens over their time. The drafted and accepted tokens llama-server reports (`draft_n`,
    `draft_n_accepted`, tools/server/server-common.cpp) are summed over the recorded repetitions."""
    pp: list[float] = []
    tg: list[float] = []
    drafted = accepted = 0
    try:
        for r in range(-1, spec.repetitions):  # r = -1: the warm-up (the first prompt), not recorded
            if spec.n_prompt:
                out = _post(port, "/completion", completion_request(_prefill_tokens(spec.n_prompt, vocab_size, r), 1),
                            timeout)
                if r >= 0:
                    pp.append(float(out["timings"]["prompt_per_second"]))
            tokens, ms = 0, 0.0
            for i, text in enumerate(spec.prompts[:1] if r < 0 else spec.prompts):
                try:
                    out = _post(port, "/completion", {**completion_request([], spec.n_gen), "prompt": text}, timeout)
                except urllib.error.HTTPError as e:  # answered, and refused: a prompt the slot cannot hold
                    detail = e.read().decode(errors="replace").strip()[:300]
                    return _failed("crash", f"llama-server refused prompt {i + 1} (HTTP {e.code}: {detail}); the "
                                   "slot's context must hold each prompt and -n tokens after it",
                                   log_path.read_text(errors="replace"), t0, spec, flags)
                timings = out["timings"]
                tokens += int(timings["predicted_n"])
                ms += float(timings["predicted_ms"])
                if r >= 0:
                    drafted += int(timings.get("draft_n", 0))
                    accepted += int(timings.get("draft_n_accepted", 0))
            if r >= 0:
                tg.append(tokens * 1000.0 / max(ms, 1e-3))  # a decode faster than llama-server's ms clock: 1 µs
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError) as e:
        rc, outcome, reason = _request_failed(proc, e, log_path, timeout)
        return _failed(outcome, reason, log_path.read_text(errors="replace"), t0, spec, flags, rc)
    return _measured(binary, proc, flags, spec, log_path, t0, load_s, pp, tg,
                     drafted=(drafted, accepted) if drafted else None)


def _prefill_tokens(n: int, vocab_size: int, r: int) -> list[int]:
    """The -p synthetic tokens of repetition `r` (-1: the warm-up), ids from the byte range every generated
    vocabulary has: a different first token each time, so a slot that keeps a cached prefix prefills all n."""
    prompt = [(13 * i + 5) % (vocab_size - 10) + 10 for i in range(n)]
    return [(prompt[0] + r + 2) % (vocab_size - 10) + 10, *prompt[1:]] if prompt else []


def _measured(binary: str, proc: subprocess.Popen[bytes], flags: list[str], spec: BenchSpec, log_path: Path,
              t0: float, load_s: float, pp: list[float], tg: list[float],
              drafted: tuple[int, int] | None = None) -> Measurement:
    """A trial that ran: its speeds at the spec's depth, the buffers llama-server logged, its build and peak RSS."""
    log = log_path.read_text(errors="replace")
    return Measurement("ok", "", spec, tuple(flags), _stats(spec.n_prompt, spec.n_depth, pp) if pp else None,
                       _stats(spec.n_gen, spec.n_depth, tg) if tg else None, buffers=tuple(parse_buffer_lines(log)),
                       load_s=load_s, wall_s=time.perf_counter() - t0, llama_cpp=server_build(binary),
                       peak_rss=peak_rss(proc.pid), log=log[-3000:], drafted=drafted)


def _measure_streams(binary: str, proc: subprocess.Popen[bytes], port: int, flags: list[str], spec: BenchSpec,
                     timeout: float, vocab_size: int, log_path: Path, t0: float, load_s: float) -> Measurement:
    """`spec.streams` concurrent requests, one slot each (`id_slot`), as a server shared by that many users sees them:
    each slot's cache is first filled to the depth with its own tokens; a prefill repetition sends every slot's
    depth plus p new tokens at once (aggregate prefill: all the new tokens over the time until the last answer;
    time to first token: the mean request's time until its answer, one token); a decode repetition sends every
    slot's depth at once and decodes n tokens in each (aggregate decode: all streams' tokens over the longest
    stream's decode time, llama-server's own `predicted_ms`; per stream: the mean `predicted_per_second`)."""
    from concurrent.futures import ThreadPoolExecutor

    n, vocab = spec.streams, vocab_size - 10
    depth = [[(7 * i + 3 * s) % vocab + 10 for i in range(spec.n_depth)] for s in range(n)]
    prompt = [[(13 * i + 5 + s) % vocab + 10 for i in range(spec.n_prompt)] for s in range(n)]
    pp: list[float] = []
    tg: list[float] = []
    tg_stream: list[float] = []
    ttft: list[float] = []

    def at_once(bodies: list[dict[str, Any]]) -> list[tuple[float, dict[str, Any]]]:
        """Every body sent at once: each answer with its seconds since the first was sent."""
        start = time.perf_counter()

        def timed(body: dict[str, Any]) -> tuple[float, dict[str, Any]]:
            out = _post(port, "/completion", body, timeout)
            return time.perf_counter() - start, out

        return list(pool.map(timed, bodies))

    try:
        with ThreadPoolExecutor(max_workers=n, thread_name_prefix="fitter-stream") as pool:
            if spec.n_depth:
                list(pool.map(lambda s: _post(port, "/completion", completion_request(depth[s], 0, s), timeout),
                              range(n)))
            for r in range(-1, spec.repetitions):  # r = -1: the warm-up, not recorded
                if spec.n_prompt:
                    bodies = [completion_request(depth[s] + [(prompt[s][0] + r + 2) % vocab + 10, *prompt[s][1:]],
                                                 1, s) for s in range(n)]
                    answers = at_once(bodies)
                    if r >= 0:
                        pp.append(n * spec.n_prompt / max(t for t, _ in answers))
                        ttft.append(1000 * sum(t for t, _ in answers) / n)
                if spec.n_gen:
                    bodies = [completion_request(depth[s] or [10 + s], spec.n_gen, s) for s in range(n)]
                    timings = [out["timings"] for _, out in at_once(bodies)]
                    if r >= 0:
                        longest_s = max(float(t["predicted_ms"]) for t in timings) / 1000
                        tg.append(sum(int(t["predicted_n"]) for t in timings) / longest_s)
                        tg_stream.append(sum(float(t["predicted_per_second"]) for t in timings) / n)
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError) as e:
        rc, outcome, reason = _request_failed(proc, e, log_path, timeout)
        return _failed(outcome, reason, log_path.read_text(errors="replace"), t0, spec, flags, rc)
    log = log_path.read_text(errors="replace")
    return Measurement("ok", "", spec, tuple(flags), _stats(spec.n_prompt, spec.n_depth, pp) if pp else None,
                       _stats(spec.n_gen, spec.n_depth, tg) if tg else None,
                       tg_stream=_stats(spec.n_gen, spec.n_depth, tg_stream) if tg_stream else None,
                       ttft=Latency.from_ms(ttft) if ttft else None, buffers=tuple(parse_buffer_lines(log)),
                       load_s=load_s, wall_s=time.perf_counter() - t0, llama_cpp=server_build(binary),
                       peak_rss=peak_rss(proc.pid), log=log[-3000:])


def _request_failed(proc: subprocess.Popen[bytes], error: OSError, log_path: Path,
                    timeout: float) -> tuple[int | None, str, str]:
    """(exit status, outcome, reason) of a trial whose request failed: the server died (its signal or exit status;
    oom when it said it could not allocate), did not answer in time, or dropped the connection and lives on."""
    timed_out = isinstance(error, TimeoutError) or isinstance(getattr(error, "reason", None), TimeoutError)
    rc = proc.poll()
    if rc is None and not timed_out:
        with contextlib.suppress(subprocess.TimeoutExpired):
            rc = proc.wait(timeout=5)  # its sockets close, and the request fails, a moment before it can be reaped
    if rc is not None:
        outcome, reason = classify_exit(rc, log_path.read_text(errors="replace"))
        return rc, outcome, reason if outcome == "oom" else f"llama-server {reason} during the trial"
    if timed_out:
        return None, "timeout", f"llama-server did not answer within {timeout:g} s ({error})"
    return None, "crash", f"llama-server dropped the request and kept running ({error})"


def _failed(outcome: str, reason: str, log: str, t0: float, spec: BenchSpec, flags: list[str],
            returncode: int | None = None) -> Measurement:
    return Measurement(outcome, reason, spec, tuple(flags), buffers=tuple(parse_buffer_lines(log)),
                       wall_s=time.perf_counter() - t0, returncode=returncode, log=log[-3000:])
