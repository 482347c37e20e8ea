"""llama.cpp's own `--fit`, run as its tool `llama-fit-params`: the placement llama.cpp would choose by itself.

`llama-fit-params` (tools/fit-params, llama.cpp 0c1e570) runs common/fit.cpp `common_fit_params` for a model and a
set of flags and prints the fitted CLI args (`-c N -ngl N [-ts A,B] [-ot "PATTERN=BUFT,…"]`) on the last line of
stdout; at `-lv 4` its projections are logged on stderr. `fitter tune` measures that placement as its baseline
trial ("what llama.cpp would do on its own"), and scripts/llama_fit_reference.py records it for the golden file.

The tool parses its args as its own example (LLAMA_EXAMPLE_FIT_PARAMS), not as llama-server, so the user's
llama-server flags are translated first (`fit_flags`):
- `-kvu`/`--kv-unified`/`-no-kvu`/`--no-kv-unified` are server (and bench, perplexity, …) only: the tool rejects
  them ("error: invalid argument"). Dropped: the tool never unifies the KV cache. With N slots it projects N
  streams of n_ctx/N cells: the same full-attention KV as one unified stream, and for SWA layers a slightly larger
  cache (N × (n_swa + n_ubatch) cells instead of N × n_swa + n_ubatch).
- `-np`: the tool has the common `-np` (default 1, no "auto"); llama-server's default `-np -1` (auto) becomes 4
  slots before its fit runs (tools/server/server.cpp), while the tool would pass -1 on as n_seq_max and fail. So an
  absent `-np`, or `-np -1`, becomes `-np 4`.
- `--no-mmap`, `--mmap`, `--mlock`, `--direct-io`: gone from this llama.cpp (neither llama-server nor the tool
  accepts them; fitter reads them as an older llama.cpp did, fitter.flags.vocabulary): translated to the one `-lm`
  they make together.
- `-cram`/`--cache-ram`: llama-server's prompt cache, which the tool rejects and which holds no device memory:
  dropped.
- `-fit on|off`: accepted but ignored (the tool always fits): dropped.
- `-mm`/`--mmproj`, `-mmdev`, `--(no-)mmproj-offload`: not registered for the tool (common/arg.cpp lists them for
  the server, CLI and mtmd examples only), and nothing in common/fit.cpp sizes a projector: dropped, so its
  placement ignores the projector's weights and compute buffers (llama-server's own --fit adds them to its margins
  first, tools/server/server-context.cpp load_model; fitter's baseline says so).
Every other flag fitter's launch config knows (`-c -b -ub -ctk -ctv -fa -ngl -cmoe -ncmoe -ot -np --swa-full -nkvo
--no-op-offload -nr -lm -ts -mg --rpc -fitt -fitc`) is common and passes through unchanged. Server-only flags
fitter does not model (`-ctxcp`, `-cb`, `--host`, …) are rejected by the tool: the fit fails with its
"invalid argument" message. The tool also keeps two differences no flag can remove: n_outputs_max stays 0 (logits
for a full ubatch in the compute graph, where llama-server reserves min(-b, slots)), and a placement the user fixed
(`-ngl`, `-ot`, `-ncmoe`, `-cmoe`, `-ts`) that does not fit makes it fail ("… already set by user, abort") where
llama-server would warn and load that placement anyway.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from fitter import process
from fitter.errors import FitterError
from fitter.flags.config import LaunchConfig
from fitter.flags.parse import flag_groups, parse_launch_flags
from fitter.flags.vocabulary import FLAGS, Kind, Level, flag, names_of
from fitter.measure.llamacpp.tools import tools_dir

__all__ = [
    "TOOL",
    "LlamaFit",
    "LlamaFitError",
    "baseline_config",
    "find_llama_fit_params",
    "fit_env",
    "fit_flags",
    "llama_fit_argv",
    "parse_llama_fit",
    "parse_projected_mib",
    "run_llama_fit",
]

TOOL = "llama-fit-params"
FIT_TIMEOUT_S = 300.0
LOG_TAIL_LINES = 12  # stderr lines quoted in a LlamaFitError

# llama-server spellings the tool rejects or reads differently (common/arg.cpp, llama.cpp 0c1e570): see the docstring.
_DROP = (frozenset(names_of("kv_unified")) | frozenset(names_of("fit")) | frozenset(names_of("cache_ram_mib"))
         | frozenset(names_of("mmproj")) | frozenset(names_of("mmproj_device")))
_LEGACY_LOAD = frozenset(name for name in names_of("load_mode") if flag(name).kind is Kind.CONST)
_PARALLEL = frozenset(names_of("parallel"))
SERVER_AUTO_SLOTS = 4  # tools/server/server.cpp: n_parallel < 0 → 4 slots (with a unified KV)

# The lines of the fit's own log (LOG_TRC at -lv 4) and the tool's verdict; `llama_params_fit*` in older builds.
FIT_LOG_RE = re.compile(
    r"^(?:common_params_fit_impl|common_fit_params|llama_params_fit_impl|llama_params_fit|"
    r"llama_fit_params|common_get_device_memory_data_impl): "
)
# The fit's projection for the placement it settled on (MiB, floored as logged), one line per device it filled.
USED_RE = re.compile(r"^\S+:\s+- (?P<dev>.+?): .* (?P<used>-?\d+) MiB used, +(?P<free>-?\d+) MiB free$")
# "No changes needed": the initial projection only (summed over devices).
TOTAL_RE = re.compile(r"projected to use (?P<used>\d+) MiB of device memory vs\. (?P<free>\d+) MiB of free device")
# With several devices, the initial projection per device, in device order (common/fit.cpp: nd > 1 only).
INITIAL_RE = re.compile(r"^\S+:\s+- (?P<dev>.+?): +\d+ total, +(?P<used>-?\d+) used, ")
# Why the fit failed, as common_fit_params / the arg parser log it.
_REASON_RES = (
    re.compile(r"failed to fit params to free device memory: (?P<why>.+)$"),
    re.compile(r"encountered an error while trying to fit params to free device memory: (?P<why>.+)$"),
    re.compile(r"^error: (?P<why>.+)$"),
)


@dataclass(frozen=True)
class LlamaFit:
    """What llama.cpp's fit chose: its printed args, and the projection it logged for them."""

    flags: tuple[str, ...]  # the args the fit printed, exactly as printed (shell-split): ("-c", "4096", "-ngl", …)
    tool: str  # the binary that ran
    projected_mib: tuple[int, ...] | None  # the fit's projected MiB per device (device order), when logged
    log: tuple[str, ...]  # the fit's own log lines (stderr, -lv 4)


class LlamaFitError(FitterError):
    """llama.cpp's fit did not answer: it found no placement, rejected a flag, crashed or timed out."""

    quotes_output = True  # llama-fit-params's own log lines

    def __init__(self, message: str, exit_status: int | None = None, log: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.exit_status = exit_status  # None: it did not exit (timeout) or could not start
        self.log = log  # the fit's own log lines, as in LlamaFit.log


def find_llama_fit_params(explicit: str | None = None) -> Path | None:
    """`explicit` (must be an executable file), else the one fitter.measure.llamacpp.tools built, else the one on
    PATH."""
    if explicit is not None:
        path = Path(explicit).expanduser()
        if not path.is_file() or not os.access(path, os.X_OK):
            raise LlamaFitError(f"{TOOL} {explicit!r}: not an executable file")
        return path
    built = tools_dir() / TOOL
    if built.is_file() and os.access(built, os.X_OK):
        return built
    found = shutil.which(TOOL)
    return Path(found) if found else None


def fit_flags(flags: Sequence[str]) -> list[str]:
    """The user's llama-server flags as llama-fit-params must be given them (see the module docstring)."""
    out: list[str] = []
    has_parallel = False
    for name, tokens in flag_groups(flags):
        if name in _DROP:
            continue
        if name in _LEGACY_LOAD:  # together as llama.cpp read them (--no-mmap --mlock: -lm mlock), at the first
            if not any(t == "-lm" for t in out):
                mode = parse_launch_flags([n for n, _ in flag_groups(flags) if n in _LEGACY_LOAD]).load_mode
                out += ["-lm", mode]
            continue
        if name in _PARALLEL:
            has_parallel = True
            value = tokens[-1].split("=", 1)[-1] if len(tokens) == 1 else tokens[-1]
            if value.strip() == "-1":
                tokens = [name, str(SERVER_AUTO_SLOTS)]
        out += tokens
    if not has_parallel:
        out += ["-np", str(SERVER_AUTO_SLOTS)]
    return out


def llama_fit_argv(
    tool: str | Path,
    model: str | Path,
    flags: Sequence[str],
    rpc: tuple[str, ...],
    fit_target_mib: tuple[int, ...],
    threads: int,
    fit_ctx_min: int | None = None,
) -> list[str]:
    """The llama-fit-params command line: model, devices, `-fitt` (one value is broadcast to every device, else one
    per device, common/arg.cpp), the translated user flags, `-fitc`, and logging that keeps the fit's projections
    (-lv 4) on stderr without prefixes, timestamps or colours."""
    if not fit_target_mib:
        raise LlamaFitError("fit_target_mib: at least one value (MiB to leave free per device) is needed, got ()")
    argv = [str(tool), "--model", str(model)]
    if rpc:
        argv += ["--rpc", ",".join(rpc)]
    argv += ["-fitt", ",".join(str(t) for t in fit_target_mib), *fit_flags(flags)]
    if fit_ctx_min is not None:
        argv += ["-fitc", str(fit_ctx_min)]
    return [*argv, "-t", str(threads), "-lv", "4", "--no-log-prefix", "--no-log-timestamps", "--log-colors", "off"]


def fit_env(base: Mapping[str, str]) -> dict[str, str]:
    """`base` without llama.cpp's LLAMA_ARG_* settings (the tool reads them as flags), and no gdb on an abort."""
    env = {k: v for k, v in base.items() if not k.startswith("LLAMA_ARG_")}
    env["GGML_NO_BACKTRACE"] = "1"
    return env


def parse_projected_mib(log: Sequence[str]) -> tuple[int, ...] | None:
    """The fit's projected MiB per device (in device order) for the placement it settled on, as logged (floored).

    The last "- DEV: … MiB used" line of each device wins. With several devices, their order is that of the
    initial projection table; with one, every line is about it. When no change was needed only the initial
    projection is logged. None when the log has no projection (e.g. no device, or the fit failed early).
    """
    names: list[str] = []
    for m in map(INITIAL_RE.match, log):
        if m and m.group("dev").strip() not in names:
            names.append(m.group("dev").strip())
    n_devices = max(1, len(names))
    per_dev: dict[int, int] = {}
    for line in log:
        m = USED_RE.match(line)
        if m:
            dev = m.group("dev").strip()
            per_dev[names.index(dev) if dev in names else 0] = int(m.group("used"))
    if len(per_dev) == n_devices:
        return tuple(per_dev[i] for i in sorted(per_dev))
    if not names:
        for line in log:
            t = TOTAL_RE.search(line)
            if t:
                return (int(t.group("used")),)
        return None
    initial = {names.index(m.group("dev").strip()): int(m.group("used")) for m in map(INITIAL_RE.match, log) if m}
    return tuple(initial[i] for i in sorted(initial))


def _reason(lines: list[str]) -> str:
    """Why the fit failed: the last reason common_fit_params or the arg parser gave, else the last line logged."""
    for line in reversed(lines):
        for rx in _REASON_RES:
            m = rx.search(line)
            if m:
                return m.group("why").strip()
    if not lines:
        return "it logged nothing"
    # tools/fit-params exit(1)s right after logging its verdict, and llama.cpp never flushes its (leaked, threaded)
    # logger at exit (common/log.cpp common_log_main), so the last lines, the reason among them, can be lost.
    return f"no reason logged (llama.cpp can lose its last log lines when it exits); its last line: {lines[-1].strip()}"


def parse_llama_fit(tool: str | Path, returncode: int, stdout: str, stderr: str) -> LlamaFit:
    """A finished llama-fit-params run as a LlamaFit; LlamaFitError when it failed or printed no args."""
    stderr_lines = [ln.rstrip() for ln in stderr.splitlines() if ln.strip()]
    log = tuple(ln for ln in stderr_lines if FIT_LOG_RE.match(ln))
    lines = [ln for ln in stdout.splitlines() if ln.strip()]
    if returncode != 0 or not lines:
        why = _reason(stderr_lines) if returncode != 0 else "it printed no arguments"
        if "already set by user" in why:
            why += " (the fit only chooses the placement flags left unset: -ngl, -ot/-ncmoe/-cmoe, -ts)"
        tail = "\n".join(stderr_lines[-LOG_TAIL_LINES:])
        raise LlamaFitError(
            f"llama.cpp's fit ({Path(tool).name}) failed with exit status {returncode}: {why}\n{tail}".rstrip(),
            returncode,
            log,
        )
    return LlamaFit(tuple(shlex.split(lines[-1])), str(tool), parse_projected_mib(log), log)


def run_llama_fit(
    tool: str | Path,
    model: str | Path,
    flags: Sequence[str],
    rpc: tuple[str, ...] = (),
    fit_target_mib: tuple[int, ...] = (1024,),
    threads: int = 1,
    timeout: float = FIT_TIMEOUT_S,
    fit_ctx_min: int | None = None,
) -> LlamaFit:
    """Run llama.cpp's fit for `model` with the user's llama-server `flags` on the devices it sees (plus `rpc`)."""
    argv = llama_fit_argv(tool, model, flags, rpc, fit_target_mib, threads, fit_ctx_min)
    try:
        rc, stdout, stderr = process.run(argv, timeout, env=fit_env(os.environ))
    except subprocess.TimeoutExpired:
        raise LlamaFitError(f"llama.cpp's fit ({shlex.join(argv)}) did not finish within {timeout:g} s") from None
    except OSError as e:
        raise LlamaFitError(f"llama.cpp's fit ({tool}) could not start: {e}") from None
    return parse_llama_fit(tool, rc, stdout, stderr)


# llama-server flags that fix what the fit decides, by the flag the fit prints for them, and the fit's own inputs
# (meaningless once the placement is fixed).
_FIXED = {"-c": names_of("ctx_size"), "-ngl": names_of("n_gpu_layers"), "-ts": names_of("tensor_split"),
          "-ot": names_of("overrides")}
_FIT_INPUTS = frozenset(names_of("fit") + tuple(n for f in FLAGS if f.level is Level.FIT for n in f.names))


def _printed(flags: Sequence[str]) -> list[str]:
    """The fit's printed args (`-c N -ngl N [-ts …] [-ot …]`, each with a value)."""
    if len(flags) % 2 or not all(f in _FIXED for f in flags[::2]):
        raise LlamaFitError(f"llama.cpp's fit printed {shlex.join(flags)!r}: expected pairs of -c, -ngl, -ts, -ot")
    return list(flags)


def baseline_config(fit: LlamaFit, base: LaunchConfig) -> LaunchConfig:
    """The baseline trial's config: the user's, with what the fit decided filled in.

    As llama.cpp's fit only sets what the user left unset, the user's own `-c N` (N > 0), `-ngl`, `-ts` and `-ot` /
    `-ncmoe` / `-cmoe` stay, and the fit's `-c` (which also replaces a `-c 0`: the context the fit resolved, or
    shrank to with `-fitc`), `-ngl`, `-ts` and `-ot` fill the gaps; `-fit off` pins the placement. `-b`, `-ub`,
    `-ctk`, `-ctv`, `-fa`, `-np` and threads are not added: they stay at llama-server's defaults unless the user gave
    them."""
    printed = _printed(fit.flags)
    fitted = parse_launch_flags(printed, base.consumer, check=False)
    kept = {name for name in base.given if name != "ctx_size" or base.ctx_size > 0}
    return base.with_given(**{name: getattr(fitted, name) for name in fitted.given - kept}, fit=False)
