"""Measure prefill and decode speed the way llama-bench does, in a persistent llama.cpp child process.

`LlamaWorker` keeps one child (`python -m fitter.measure.worker`) alive across trials. The parent sends one JSON
request per line on the child's stdin and reads one JSON reply per line from a private copy of its stdout;
everything llama.cpp and ggml log (and the child's stderr) goes to one log file, which the parent slices per trial.

What a trial measures mirrors tools/llama-bench/llama-bench.cpp (llama.cpp 0c1e570, as vendored in
llama-cpp-python 0.3.36), with one deliberate difference: the context is built at the *deployed* size from the
LaunchConfig (`-c`, `-np`, `--kv-unified`, `--swa-full`, `-fa`, `-ctk/-ctv`, `-b/-ub`, `-nkvo`, llama-server's
n_outputs_max), not llama-bench's `n_prompt + n_gen + n_depth` with one sequence, so the speed belongs to the
memory plan that would be deployed.

- Warm-up: one prefill of n_prompt tokens and one decoded token (llama-bench's warmup run).
- Per repetition, prefill (pp) and decode (tg) are separate tests as in llama-bench (`-p N` and `-n N` give two
  result rows there): the memory is cleared, `n_depth` tokens are prefilled untimed, then either n_prompt random
  tokens are decoded in `-b` chunks and synchronized (pp) or n_gen single tokens are decoded one by one, each
  synchronized, feeding a random token (tg, test_gen).
- samples_ts = tokens / seconds per repetition; avg and (sample, n-1) stddev of those, as llama-bench.

Model reuse follows llama-bench (`cmd_params_instance::equal_mparams`): the model stays loaded while only
context-level flags change (-c -b -ub -ctk -ctv -fa -t -tb -np -kvu --swa-full -nkvo --no-op-offload); `-ngl`,
`-ot`/`-cmoe`/`-ncmoe`, `-lm`, `-nr`, `-ts`, `-mg` or `--rpc` reload it. RPC devices cannot be unregistered from a
process, so a change of `--rpc` starts a fresh child.

Outcomes: `ok`, `oom` (an allocation refused: which buffer, which device, how many bytes, from the log), `crash`
(the child died: signal or exit status and the log tail) or `timeout` (the parent killed the child). After a crash
or timeout the next trial starts a fresh child. Failed outcomes carry no speeds.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import random
import select
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from types import TracebackType
from typing import IO, Any

from fitter import process
from fitter.flags import LaunchConfig, pin
from fitter.flags.vocabulary import MODEL_LEVEL
from fitter.machine.llama_cpp import lib_dir_of
from fitter.machine.rss import peak_rss, reset_peak_rss
from fitter.measure.capi import (
    Ggml,
    LogSink,
    build_context_params,
    build_model_params,
    build_mtmd_params,
    config_from_json,
    config_to_json,
)
from fitter.measure.logs import describe_oom, parse_buffer_lines, parse_oom, tail
from fitter.measure.types import BenchSpec, LoggedBuffer, Measurement, SpeedStats, WorkerError

__all__ = ["LlamaWorker", "measure"]

# ---------------------------------------------------------------------------------------------------------------
# Parent side


def default_timeout(model: str | Path, spec: BenchSpec) -> float:
    """A generous limit from the work asked for: load at 100 MB/s, decode reading the whole file per token at
    1 GB/s, prefill at half that per token, three times over, plus 30 s."""
    try:
        size = Path(model).stat().st_size
    except OSError:
        size = 0
    gen_s = max(0.005, size / 1e9)
    pp_s = gen_s / 2
    reps = spec.repetitions + (1 if spec.warmup else 0)
    work = reps * ((spec.n_prompt + 2 * spec.n_depth) * pp_s + spec.n_gen * gen_s)
    return 30.0 + size / 1e8 + 3.0 * work


class LlamaWorker:
    """A persistent measuring child. Use as a context manager; `run` never raises for llama.cpp's failures."""

    def __init__(self, log_path: str | Path | None = None, start_timeout: float = 120.0,
                 cpus: tuple[int, ...] | None = None) -> None:
        self._own_dir: tempfile.TemporaryDirectory[str] | None = None
        if log_path is None:
            self._own_dir = tempfile.TemporaryDirectory(prefix="fitter-worker-")
            log_path = Path(self._own_dir.name) / "worker.log"
        self.log_path = Path(log_path)
        self.start_timeout = start_timeout
        self.cpus = cpus  # CPU affinity of the child (llama.cpp's --cpu-mask / --cpu-range)
        self._proc: subprocess.Popen[bytes] | None = None
        self._buf = b""
        self._rpc: tuple[str, ...] | None = None  # the RPC servers the child registered (fixed for its life)
        self._model_key: tuple[Any, ...] | None = None
        self._model_buffers: tuple[LoggedBuffer, ...] = ()
        self._info: dict[str, str] = {}
        self.starts = 0  # children started so far

    # -- lifecycle --------------------------------------------------------------------------------------------

    def __enter__(self) -> LlamaWorker:
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    @property
    def build_info(self) -> dict[str, str]:
        """The llama.cpp build of the running child (start() reads it)."""
        return dict(self._info)

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None and self._proc.poll() is None else None

    def start(self) -> LlamaWorker:
        """Start the child if none is running, and read its build info."""
        if self.pid is not None:
            return self
        self._reap()
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:
            # pinned before the child has loaded llama.cpp, so every thread it starts inherits the affinity
            self._proc = process.spawn(process.python_module("fitter.measure.worker", str(self.log_path)),
                                       stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, cpus=self.cpus)
        self.starts += 1
        self._buf = b""
        self._rpc = None
        self._model_key = None
        self._model_buffers = ()
        offset = self._log_size()
        reply = self._exchange({"op": "info"}, time.monotonic() + self.start_timeout)
        if isinstance(reply, str) or not reply.get("ok"):
            log_text = self._log_since(offset)
            self._kill()
            raise WorkerError(f"the llama.cpp worker did not start: {tail(log_text) or 'no output'}")
        self._info = {
            "version": str(reply.get("version")),
            "system_info": str(reply.get("system_info")),
            "commit": str(reply.get("ggml_commit") or "unknown"),
            "source": f"ggml_commit() of the libggml-base loaded by llama-cpp-python {reply.get('version')}",
        }
        return self

    def close(self) -> None:
        proc = self._proc
        if proc is not None and proc.poll() is None:
            try:
                assert proc.stdin is not None
                proc.stdin.write(b'{"op": "quit"}\n')
                proc.stdin.flush()
                proc.wait(timeout=10)
                process.unregister(proc.pid)
            except (OSError, subprocess.TimeoutExpired):
                self._kill()
        self._reap()
        if self._own_dir is not None:
            self._own_dir.cleanup()
            self._own_dir = None

    def _kill(self) -> None:
        if self._proc is not None:
            process.kill_group(self._proc)

    def _reap(self) -> None:
        proc = self._proc
        if proc is None:
            return
        if proc.poll() is None:
            self._kill()
        for pipe in (proc.stdin, proc.stdout):
            if pipe is not None:
                with contextlib.suppress(OSError):
                    pipe.close()
        self._proc = None

    # -- protocol ---------------------------------------------------------------------------------------------

    def _exchange(self, request: dict[str, Any], deadline: float) -> dict[str, Any] | str:
        """Send one request and wait for its reply; "eof" when the child died, "deadline" when the deadline passed
        (then the child is still running: the caller kills it)."""
        proc = self._proc
        assert proc is not None and proc.stdin is not None and proc.stdout is not None
        try:
            proc.stdin.write(json.dumps(request).encode() + b"\n")
            proc.stdin.flush()
        except OSError:
            return "eof"
        fd = proc.stdout.fileno()
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                return "deadline"
            ready, _, _ = select.select([fd], [], [], min(left, 0.5))
            if not ready:
                continue
            chunk = os.read(fd, 65536)
            if not chunk:
                return "eof"
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        reply: dict[str, Any] = json.loads(line)
        return reply

    def _log_size(self) -> int:
        try:
            return self.log_path.stat().st_size
        except OSError:
            return 0

    def _log_since(self, offset: int) -> str:
        try:
            with self.log_path.open("rb") as f:
                f.seek(offset)
                return f.read().decode(errors="replace")
        except OSError:
            return ""

    # -- trials -----------------------------------------------------------------------------------------------

    def will_reload(self, model: str | Path, config: LaunchConfig) -> bool:
        """Whether `run(model, config)` loads the model anew (a placement change, or no model loaded)."""
        return self._model_key != (str(Path(model).resolve()), *(getattr(config, k) for k in MODEL_LEVEL))

    def unload(self) -> None:
        """Free the loaded model now (the next run would free it first thing): so a device's peak counter can be
        reset before the next trial allocates anything."""
        if self.pid is None or self._model_key is None:
            return
        reply = self._exchange({"op": "unload"}, time.monotonic() + self.start_timeout)
        if isinstance(reply, str):
            self._reap()
        self._model_key = None
        self._model_buffers = ()

    def run(self, model: str | Path, config: LaunchConfig, spec: BenchSpec | None = None,
            timeout: float | None = None) -> Measurement:
        """Measure `config` on `model`. `timeout` (seconds, load included) defaults to `default_timeout`."""
        spec = spec or BenchSpec()
        model = str(Path(model).resolve())
        if timeout is None:
            timeout = default_timeout(model, spec)
        t0 = time.monotonic()
        if self.pid is not None and self._rpc is not None and self._rpc != config.rpc:
            self.close_child()  # RPC devices stay registered for a process's life
        self.start()
        key = (model, *(getattr(config, k) for k in MODEL_LEVEL))
        offset = self._log_size()
        request = {"op": "run", "model": model, "config": config_to_json(config),
                   "spec": {k: getattr(spec, k) for k in BenchSpec.__dataclass_fields__}}
        reply = self._exchange(request, t0 + timeout)
        wall = time.monotonic() - t0
        log = self._log_since(offset)
        base = Measurement("ok", "", spec=spec, flags=tuple(pin(config, given=True)), wall_s=round(wall, 3),
                           llama_cpp=dict(self._info), log=log)
        if isinstance(reply, str):
            proc = self._proc
            assert proc is not None
            timed_out = reply == "deadline"
            if timed_out:
                self._kill()
            rc = proc.wait()
            self._reap()
            base = replace(base, wall_s=round(time.monotonic() - t0, 3), returncode=rc)
            if timed_out:
                why = f"killed after {timeout:g} s (the limit); log tail: {tail(log)}"
                return replace(base, outcome="timeout", reason=why)
            how = f"killed by signal {-rc} ({signal.Signals(-rc).name})" if rc < 0 else f"exited with status {rc}"
            oom = parse_oom(log)
            if oom is not None and "out of memory" in log.lower():
                return replace(base, outcome="oom", reason=f"worker {how}: {describe_oom(oom)}", oom=oom)
            return replace(base, outcome="crash", reason=f"llama.cpp worker {how}; log tail: {tail(log)}")

        self._rpc = config.rpc
        reused = bool(reply.get("reused"))
        buffers = parse_buffer_lines(log)
        if reply.get("loaded"):
            self._model_key = key
            self._model_buffers = tuple(b for b in buffers if b.kind == "model")
        elif reused:
            buffers = [*self._model_buffers, *(b for b in buffers if b.kind != "model")]
        load_s, context_s, rss = reply.get("load_s"), reply.get("context_s"), reply.get("peak_rss")
        base = replace(base, buffers=tuple(buffers), reused_model=reused,
                       load_s=None if load_s is None else float(load_s),
                       context_s=None if context_s is None else float(context_s),
                       peak_rss=None if rss is None else int(rss))
        if reply.get("ok"):
            pp = SpeedStats.from_ns(spec.n_prompt, spec.n_depth, reply["pp_ns"]) if spec.n_prompt else None
            tg = SpeedStats.from_ns(spec.n_gen, spec.n_depth, reply["tg_ns"]) if spec.n_gen else None
            return replace(base, pp=pp, tg=tg)
        if not reply.get("loaded") and not reused:
            self._model_key, self._model_buffers = None, ()
        error = str(reply.get("error"))
        oom = parse_oom(log)
        if oom is not None:
            return replace(base, outcome="oom", reason=f"{describe_oom(oom)} ({error})", oom=oom)
        raise WorkerError(f"llama.cpp rejected {' '.join(pin(config, given=True)) or 'the config'}: {error}")

    def close_child(self) -> None:
        """End the current child (a fresh one starts on the next trial)."""
        proc = self._proc
        if proc is not None and proc.poll() is None:
            self._kill()
        self._reap()


def measure(model: str | Path, config: LaunchConfig, spec: BenchSpec | None = None,
            timeout: float | None = None, cpus: tuple[int, ...] | None = None) -> Measurement:
    """One trial in a fresh worker."""
    with LlamaWorker(cpus=cpus) as worker:
        return worker.run(model, config, spec, timeout)


# ---------------------------------------------------------------------------------------------------------------
# Child side: everything below runs only in `python -m fitter.measure.worker LOG`.


class _ChildState:
    def __init__(self, log_path: Path) -> None:
        import llama_cpp

        self.llama = llama_cpp
        llama_cpp.llama_backend_init()
        self.sink = LogSink(log_path)
        llama_cpp.llama_log_set(self.sink.callback, ctypes.c_void_p(0))
        self.ggml = Ggml(lib_dir_of(Path(llama_cpp.__file__).parent))
        self.rpc: tuple[str, ...] | None = None
        self.model: Any = None
        self.model_key: tuple[Any, ...] | None = None
        self.keep_alive: list[Any] = []

    def info(self) -> dict[str, Any]:
        return {"ok": True, "version": getattr(self.llama, "__version__", None),
                "system_info": self.llama.llama_print_system_info().decode(errors="replace").strip(),
                "supports_rpc": bool(self.llama.llama_supports_rpc()), **self.ggml.build()}

    def free_model(self) -> None:
        if self.model:
            self.llama.llama_model_free(self.model)
        self.model, self.model_key, self.keep_alive = None, None, []

    def run(self, request: dict[str, Any]) -> dict[str, Any]:
        llama = self.llama
        config = config_from_json(request["config"])
        spec = BenchSpec(**request["spec"])
        out: dict[str, Any] = {"ok": False, "error": None, "loaded": False, "reused": False,
                               "load_s": None, "context_s": None, "peak_rss": None}
        reset_peak_rss()
        self.sink.errors.clear()
        ctx = mctx = None
        try:
            if self.rpc is None:
                self.rpc = config.rpc
                if config.rpc:
                    self.ggml.add_rpc_servers(config.rpc)
            elif self.rpc != config.rpc:
                out["error"] = "--rpc differs from this worker's registered servers"
                return out
            key = (request["model"], *(json.dumps(request["config"][k]) for k in MODEL_LEVEL))
            if self.model and self.model_key == key:
                out["reused"], out["load_s"] = True, 0.0
            else:
                self.free_model()
                t0 = time.perf_counter()
                keep: list[Any] = []
                mparams = build_model_params(config, self.ggml, keep)
                model = llama.llama_model_load_from_file(str(request["model"]).encode(), mparams)
                out["load_s"] = round(time.perf_counter() - t0, 4)
                if not model:
                    out["error"] = "llama_model_load_from_file failed: " + (self.sink.error_text() or "see the log")
                    return out
                self.model, self.model_key, self.keep_alive = model, key, keep
                out["loaded"] = True
            t0 = time.perf_counter()
            cparams = build_context_params(config, None, spec.threads, spec.threads_batch)
            ctx = llama.llama_init_from_model(self.model, cparams)
            out["context_s"] = round(time.perf_counter() - t0, 4)
            if not ctx:
                out["error"] = "llama_init_from_model failed: " + (self.sink.error_text() or "see the log")
                return out
            if config.mmproj:  # held while serving, as llama-server holds it: its memory is the trial's too
                from llama_cpp import mtmd_cpp

                mtmd_cpp.mtmd_log_set(self.sink.callback, ctypes.c_void_p(0))
                mctx = mtmd_cpp.mtmd_init_from_file(config.mmproj.encode(), self.model,
                                                    build_mtmd_params(config, self.ggml, spec.threads))
                if not mctx:
                    out["error"] = "mtmd_init_from_file failed: " + (self.sink.error_text() or "see the log")
                    return out
            n_ctx_seq = int(llama.llama_n_ctx_seq(ctx))
            need = spec.n_depth + max(spec.n_prompt, spec.n_gen)
            if need > n_ctx_seq:
                out["error"] = (f"the test needs {need} cells (depth {spec.n_depth} + max(-p, -n)) but a sequence of "
                                f"this context holds {n_ctx_seq}")
                return out
            out.update(_bench(llama, ctx, self.model, spec, self.sink))
            out["ok"] = out["error"] is None
            return out
        except Exception as e:  # a Python-side failure (bad buffer type name, …): report, don't crash
            out["error"] = f"{type(e).__name__}: {e}"
            return out
        finally:
            if mctx:
                from llama_cpp import mtmd_cpp

                mtmd_cpp.mtmd_free(mctx)
            if ctx:
                llama.llama_free(ctx)
            out["peak_rss"] = peak_rss()


def _bench(llama: Any, ctx: Any, model: Any, spec: BenchSpec, sink: LogSink) -> dict[str, Any]:
    """llama-bench's warm-up and repetitions (tools/llama-bench/llama-bench.cpp test_prompt / test_gen)."""
    vocab = llama.llama_model_get_vocab(model)
    n_vocab = int(llama.llama_vocab_n_tokens(vocab))
    add_bos = bool(llama.llama_vocab_get_add_bos(vocab))
    bos = int(llama.llama_vocab_bos(vocab))
    n_batch = int(llama.llama_n_batch(ctx))
    rng = random.Random(spec.seed)
    llama.llama_set_n_threads(ctx, spec.threads, spec.threads_batch or spec.threads)
    mem = llama.llama_get_memory(ctx)
    tokens = (llama.llama_token * max(n_batch, 1))()

    def decode(n: int) -> None:
        rc = int(llama.llama_decode(ctx, llama.llama_batch_get_one(tokens, n)))
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")

    def prompt(n_prompt: int) -> None:
        done = 0
        while done < n_prompt:
            n = min(n_prompt - done, n_batch)
            tokens[0] = bos if done == 0 and add_bos else rng.randrange(n_vocab)
            for i in range(1, n):
                tokens[i] = rng.randrange(n_vocab)
            decode(n)
            done += n
        llama.llama_synchronize(ctx)

    def gen(n_gen: int) -> None:
        tokens[0] = bos if add_bos else rng.randrange(n_vocab)
        for _ in range(n_gen):
            decode(1)
            llama.llama_synchronize(ctx)
            tokens[0] = rng.randrange(n_vocab)

    def timed(fn: Any, n: int) -> int:
        llama.llama_memory_clear(mem, True)
        if spec.n_depth:
            prompt(spec.n_depth)
        t = time.perf_counter_ns()
        fn(n)
        return time.perf_counter_ns() - t

    out: dict[str, Any] = {"error": None, "pp_ns": [], "tg_ns": []}
    try:
        if spec.warmup:
            llama.llama_memory_clear(mem, True)
            if spec.n_prompt:
                prompt(spec.n_prompt)
            if spec.n_gen:
                gen(1)
        for _ in range(spec.repetitions):
            if spec.n_prompt:
                out["pp_ns"].append(timed(prompt, spec.n_prompt))
            if spec.n_gen:
                out["tg_ns"].append(timed(gen, spec.n_gen))
    except RuntimeError as e:
        llama_err = sink.error_text()
        out["error"] = f"{e}: {llama_err}" if llama_err else str(e)
    return out


def _main(argv: list[str]) -> int:
    if len(argv) != 1:
        sys.stderr.write("usage: python -m fitter.measure.worker LOG\n")
        return 2
    # The protocol gets a private copy of stdout; fd 1 then points at stderr (the log), so nothing llama.cpp or
    # ggml prints can corrupt a reply.
    proto: IO[str] = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)
    state = _ChildState(Path(argv[0]))
    for line in sys.stdin:
        if not line.strip():
            continue
        request = json.loads(line)
        op = request.get("op")
        if op == "quit":
            break
        if op == "info":
            reply = state.info()
        elif op == "run":
            reply = state.run(request)
        elif op == "unload":
            state.free_model()
            reply = {"ok": True}
        else:
            reply = {"ok": False, "error": f"unknown op {op!r}"}
        proto.write(json.dumps(reply) + "\n")
        proto.flush()
    state.free_model()
    state.sink.close()
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
