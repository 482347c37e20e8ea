"""`fitter export`: one picked configuration of a tuning result, written for a launcher (CONTRACTS.md).

Formats: `server` (one shell-quoted llama-server line), `preset-ini` (a llama-server `--models-preset` section),
`llama-swap` (a `models:` entry of llama-swap's config.yaml), `python` (llama-cpp-python `Llama(**kwargs)` plus the
tensor overrides it cannot take as a keyword) and `json` (the Pareto entry).

Every format carries the same pinned flags: the trial's flags are parsed as llama-server reads them
(`parse_launch_flags`) and written out again with everything llama-server would otherwise decide itself
(`-c -b -ub -ctk -ctv -fa -np --kv-unified|--no-kv-unified -ngl -ncmoe/-ot -fit off -t -tb`), so the launcher runs
what was measured. Pure functions: a pareto.json dict in, text out.
"""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass, replace
from typing import Any

from fitter.errors import FitterError, LaunchConfigError
from fitter.export import placement_flags
from fitter.launch_config import LaunchConfig, parse_launch_flags, split_process_flags

FORMATS = ("server", "preset-ini", "llama-swap", "python", "json")
POLICIES = ("max-decode", "max-prefill", "balanced", "min-vram")
LLAMA_CPP_PYTHON = "0.3.36"  # the Llama.__init__ the python format is mapped against (pyproject's `llama` extra)

# Flags fitter's flag parser leaves to the process (tune adds -t/-tb, bench -C/-Cr): spelling → canonical flag.

# --models-preset keys: common_preset::to_ini (common/preset.cpp) writes each option under its last spelling in
# common/arg.cpp without the leading dashes; load_from_ini accepts any spelling without dashes (or the env name).
# A flag with a negative form (--kv-unified/--no-kv-unified, --kv-offload/--no-kv-offload, --op-offload/
# --no-op-offload, --repack/--no-repack) is one key whose value is true or false (common/arg.cpp is_truthy/is_falsey).
_PRESET_KEYS = {
    "-m": "model", "-c": "ctx-size", "-b": "batch-size", "-ub": "ubatch-size", "-ctk": "cache-type-k",
    "-ctv": "cache-type-v", "-fa": "flash-attn", "-np": "parallel", "--kv-unified": "kv-unified",
    "--no-kv-unified": "kv-unified", "-ngl": "n-gpu-layers", "-ncmoe": "n-cpu-moe", "-ot": "override-tensor",
    "--swa-full": "swa-full", "-nkvo": "kv-offload", "--no-op-offload": "op-offload", "-nr": "repack",
    "-lm": "load-mode", "-ts": "tensor-split", "-mg": "main-gpu", "--rpc": "rpc", "-fit": "fit",
    "-t": "threads", "-tb": "threads-batch", "-C": "cpu-mask", "-Cr": "cpu-range",
}
_BARE = ("--kv-unified", "--no-kv-unified", "--swa-full", "-nkvo", "--no-op-offload", "-nr")  # flags without a value
_NEGATIVE = ("--no-kv-unified", "-nkvo", "--no-op-offload", "-nr")  # bare flags written as `key = false`


@dataclass(frozen=True)
class Pick:
    """The picked trial, parsed and pinned: what every format renders."""

    policy: str
    trial: int
    entry: dict[str, Any]
    model_path: str
    model_name: str
    config: LaunchConfig  # an emulated GPU's --rpc already left out
    threads: int
    threads_batch: int
    cpu_mask: str | None
    cpu_range: str | None
    flags: tuple[str, ...]  # the pinned llama-server flags (no -m)
    header: tuple[str, ...]  # what the export is, as comment lines
    warning: str | None  # set when the result was measured on fitter's emulated GPU


# -- choosing the entry ------------------------------------------------------------------------------------------


def picked_entry(result: dict[str, Any], policy: str, source: str = "pareto.json") -> dict[str, Any]:
    """The Pareto entry `result["picks"][policy]` names."""
    if policy not in POLICIES:
        raise FitterError(f"--policy {policy!r}: unknown policy; choose one of {', '.join(POLICIES)}")
    picks = result.get("picks")
    if not isinstance(picks, dict) or not picks:
        raise FitterError(f"{source}: no \"picks\" (the tune found no confirmed configuration?); nothing to export")
    trial = picks.get(policy)
    if trial is None:
        raise FitterError(f"{source}: no {policy} pick (picks: {_listing(picks)}); choose another --policy")
    entries = result.get("pareto")
    if not isinstance(entries, list):
        raise FitterError(f"{source}: no \"pareto\" list; is this a pareto.json written by `fitter tune`?")
    for entry in entries:
        if isinstance(entry, dict) and entry.get("trial") == trial:
            return entry
    trials = ", ".join(str(e.get("trial")) for e in entries if isinstance(e, dict)) or "none"
    raise FitterError(f"{source}: the {policy} pick is trial {trial}, which is not in \"pareto\" (trials: {trials})")


def _listing(picks: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in sorted(picks.items())) or "none"


def pick(result: dict[str, Any], policy: str, source: str = "pareto.json") -> Pick:
    """The picked entry with its flags parsed and pinned; FitterError names the file, trial and flag at fault."""
    entry = picked_entry(result, policy, source)
    where = f"{source}: the {policy} pick (trial {entry['trial']})"
    model = result.get("model") or {}
    path = model.get("path")
    if not isinstance(path, str) or not path:
        raise FitterError(f"{source}: no model.path; the export needs the GGUF file to launch")
    name = model.get("name")
    if not isinstance(name, str) or not name:
        name = _stem(path)
    flags = entry.get("flags")
    if not isinstance(flags, list) or not all(isinstance(f, str) for f in flags):
        raise FitterError(f"{where}: \"flags\" must be a list of strings, got {flags!r}")
    launch, process = split_process_flags(flags, where)
    try:
        config = parse_launch_flags(launch)
    except LaunchConfigError as e:
        raise FitterError(f"{where}: {e}") from None
    if "-t" not in process:
        raise FitterError(f"{where}: no -t (threads); an export pins -t and -tb as measured")
    threads = _positive(process["-t"], "-t", where)
    threads_batch = _positive(process.get("-tb", process["-t"]), "-tb", where)  # llama.cpp: -tb defaults to -t

    emulated = bool(result.get("emulated") or (entry.get("measurement") or {}).get("emulated"))
    warning = None
    if emulated:
        for rule in config.overrides:
            if any(endpoint in rule.buft for endpoint in config.rpc):
                raise FitterError(f"{where}: -ot {rule.pattern}={rule.buft} names the emulated GPU, which an "
                                  "export leaves out; nothing to place it on")
        dropped = f"; its --rpc {','.join(config.rpc)} is left out" if config.rpc else ""
        warning = (f"measured on fitter's emulated GPU (a capped llama.cpp RPC device on the tuning machine, CPU "
                   f"speed){dropped}: check the placement fits your GPU with `fitter fit`")
        config = replace(config, rpc=())
    if config.flash_attn == "auto":
        raise FitterError(f"{where}: -fa auto is resolved by llama-server per device at launch; an export pins "
                          "-fa on or off: tune with flash-attn on/off")
    if config.n_gpu_layers == -1:
        if (result.get("machine") or {}).get("gpus") or emulated or config.rpc:
            raise FitterError(f"{where}: -ngl auto leaves the placement to llama.cpp's --fit; an export pins it: "
                              "tune with -ngl (or let `fitter fit` choose the placement)")
        config = replace(config, n_gpu_layers=0)  # no GPU on the tuning machine: nothing was offloaded

    pinned = pinned_flags(config, threads, threads_batch, process.get("-C"), process.get("-Cr"))
    return Pick(policy=policy, trial=int(entry["trial"]), entry=entry, model_path=path, model_name=name,
                config=config, threads=threads, threads_batch=threads_batch, cpu_mask=process.get("-C"),
                cpu_range=process.get("-Cr"), flags=tuple(pinned), header=_header(result, entry, policy, source),
                warning=warning)


def _stem(path: str) -> str:
    return re.sub(r"\.gguf$", "", path.replace("\\", "/").rsplit("/", 1)[-1])




def _positive(value: str, flag: str, where: str) -> int:
    try:
        n = int(value)
    except ValueError:
        n = 0
    if n < 1:
        raise FitterError(f"{where}: {flag} {value!r}: expected a thread count >= 1")
    return n


def _header(result: dict[str, Any], entry: dict[str, Any], policy: str, source: str) -> tuple[str, ...]:
    m = entry.get("measurement") or {}
    speeds = [f"{k} {m[k]['avg_ts']:.1f} t/s" for k in ("tg", "pp") if isinstance(m.get(k), dict)
              and isinstance(m[k].get("avg_ts"), int | float)]
    commit = (result.get("llama_cpp") or {}).get("commit")
    lines = [f"fitter export --policy {policy}: trial {entry['trial']} of {source}"]
    if speeds:
        lines.append("measured " + ", ".join(speeds) + (f" with llama.cpp {commit}" if commit else ""))
    elif commit:
        lines.append(f"measured with llama.cpp {commit}")
    return tuple(line.replace("\n", " ").replace("\r", " ") for line in lines)


# -- the pinned flags --------------------------------------------------------------------------------------------


def pinned_flags(config: LaunchConfig, threads: int, threads_batch: int, cpu_mask: str | None = None,
                 cpu_range: str | None = None) -> list[str]:
    """llama-server flags for `config` with every choice llama-server would make itself spelled out, in the order
    and spellings of fitter.export.server_flags (which needs the model's context; this needs only the flags)."""
    flags = ["-c", str(config.ctx_size), "-b", str(config.batch_size), "-ub", str(config.ubatch_size)]
    flags += ["-ctk", config.cache_type_k, "-ctv", config.cache_type_v, "-fa", config.flash_attn]
    flags += ["-np", str(config.n_seq_max), "--kv-unified" if config.unified else "--no-kv-unified"]
    flags += placement_flags(config)
    if config.rpc:
        flags += ["--rpc", ",".join(config.rpc)]
    flags += ["-fit", "off"]  # the placement is explicit: llama-server's --fit must not second-guess it
    flags += ["-t", str(threads), "-tb", str(threads_batch)]
    if cpu_mask:
        flags += ["-C", cpu_mask]
    if cpu_range:
        flags += ["-Cr", cpu_range]
    return flags


def _pairs(flags: list[str]) -> list[list[str]]:
    """Pinned flags grouped with their values: [["-c", "4096"], ["--kv-unified"], …]."""
    groups: list[list[str]] = []
    i = 0
    while i < len(flags):
        n = 1 if flags[i] in _BARE else 2
        groups.append(flags[i:i + n])
        i += n
    return groups


# -- formats -----------------------------------------------------------------------------------------------------


def render(result: dict[str, Any], policy: str, fmt: str, source: str = "pareto.json") -> str:
    """The picked configuration in one of FORMATS, ending with a newline."""
    renderers = {"server": render_server, "preset-ini": render_preset_ini, "llama-swap": render_llama_swap,
                 "python": render_python, "json": render_json}
    if fmt not in renderers:
        raise FitterError(f"--format {fmt!r}: unknown format; choose one of {', '.join(FORMATS)}")
    return renderers[fmt](pick(result, policy, source))


def server_argv(p: Pick) -> list[str]:
    return ["llama-server", "-m", p.model_path, *p.flags]


def render_server(p: Pick) -> str:
    warning = f"# {p.warning}\n" if p.warning else ""
    return warning + shlex.join(server_argv(p)) + "\n"


def preset_options(p: Pick) -> list[tuple[str, str]]:
    """(key, value) in flag order; llama-server rebuilds the argv from them (common_preset::to_args) ordered by the
    options' first spelling, which keeps -ncmoe's rules before -ot's as on the command line."""
    options = [("model", p.model_path)]
    for group in _pairs(list(p.flags)):
        key = _PRESET_KEYS[group[0]]
        value = group[1] if len(group) > 1 else ("false" if group[0] in _NEGATIVE else "true")
        options.append((key, value))
    return options


def render_preset_ini(p: Pick) -> str:
    # Grammar from common/preset.cpp parse_ini_from_file: `[name]` headers, `key = value` lines whose value ends at
    # the first `;` or `#` (a comment) and loses surrounding blanks; `;`/`#` comment lines.
    section = re.sub(r"[\[\]:\s]+", "-", p.model_name).strip("-") or "model"  # a `:tag` would be re-cased
    lines = [f"; {line}" for line in (*p.header, *([p.warning] if p.warning else []))]
    lines.append(f"[{section}]")
    for key, value in preset_options(p):
        if re.search(r"[;#\r\n]", value) or value != value.strip():
            raise FitterError(f"preset-ini: {key} = {value!r}: llama-server's preset parser ends a value at ';' or "
                              "'#' and trims blanks; launch with --format server instead")
        lines.append(f"{key} = {value}")
    return "\n".join(lines) + "\n"


def render_llama_swap(p: Pick) -> str:
    # llama-swap (github.com/mostlygeek/llama-swap, config.example.yaml, internal/config/commands.go): `cmd` is split
    # with POSIX shlex after `${PORT}`-style macros are substituted and lines starting with `#` are dropped; `proxy`
    # defaults to http://localhost:${PORT} when cmd uses ${PORT}.
    argv = ["-m", p.model_path, *p.flags]
    for arg in argv:
        if "${" in arg:
            raise FitterError(f"llama-swap: {arg!r} contains '${{', which llama-swap reads as a macro")
    lines = ["llama-server", "--port ${PORT}", *(shlex.join(g) for g in _pairs(argv))]
    out = [f"# {line}" for line in (*p.header, *([p.warning] if p.warning else []))]
    out += ["models:", f"  {json.dumps(p.model_name)}:", "    cmd: |", *(f"      {line}" for line in lines)]
    return "\n".join(out) + "\n"


def llama_kwargs(p: Pick) -> dict[str, Any]:
    """llama-cpp-python `Llama.__init__` keyword arguments equal to the pinned flags (llama_cpp/llama.py)."""
    from gguf.constants import GGMLQuantizationType  # the numbering of enum ggml_type (GGML_TYPE_Q8_0 = 8)

    c = p.config
    mmap, mlock = {"auto": (True, False), "mmap": (True, False), "none": (False, False), "mlock": (False, True),
                   "mmap+mlock": (True, True), "dio": (False, False)}[c.load_mode]
    kwargs: dict[str, Any] = {
        "model_path": p.model_path,
        "n_gpu_layers": -1 if c.n_gpu_layers < 0 else c.n_gpu_layers,  # Llama: -1 = every layer
        "main_gpu": c.main_gpu,
        "use_mmap": mmap,
        "use_mlock": mlock,
        "n_ctx": c.ctx_size,  # 0: the model's training context, as llama-server's -c 0
        "n_batch": c.batch_size,
        "n_ubatch": c.ubatch_size,
        "n_threads": p.threads,
        "n_threads_batch": p.threads_batch,
        "offload_kqv": not c.no_kv_offload,
        "flash_attn": c.flash_attn == "on",
        "op_offload": not c.no_op_offload,
        "swa_full": c.swa_full,  # the C API defaults to a full SWA cache, llama-server does not
        "type_k": int(GGMLQuantizationType[c.cache_type_k.upper()]),
        "type_v": int(GGMLQuantizationType[c.cache_type_v.upper()]),
    }
    if c.tensor_split:
        kwargs["tensor_split"] = list(c.tensor_split)
    return kwargs


def tensor_overrides(config: LaunchConfig) -> list[dict[str, str]]:
    """Every placement rule in llama.cpp's order (first match wins), -cmoe/-ncmoe expanded per layer."""
    return [{"pattern": r.pattern, "buft": r.buft} for r in config.overrides]


PYTHON_NOTE = (
    "Llama(**kwargs) alone cannot express -ncmoe/-ot: llama-cpp-python " + LLAMA_CPP_PYTHON + " has no tensor "
    "override parameter and silently ignores unknown keyword arguments such as n_cpu_moe. Pass tensor_overrides "
    "through llama_model_params.tensor_buft_overrides with ctypes: a NULL-terminated array of "
    "{const char * pattern; ggml_backend_buffer_type_t buft} (include/llama.h), each buffer type looked up by name "
    "among the ggml devices, as fitter/llama_cpp_loader.py build_model_params does."
)


def _not_in_kwargs(p: Pick) -> list[str]:
    c = p.config
    out = []
    if c.n_seq_max > 1:
        out.append(f"-np {c.n_seq_max} {'--kv-unified' if c.unified else '--no-kv-unified'}: Llama decodes one "
                   f"sequence (n_seq_max 1); its KV cache holds the same n_ctx cells in one stream")
    if c.no_repack:
        out.append("-nr: llama_model_params.use_extra_bufts = False (no keyword)")
    if c.load_mode == "dio":
        out.append("-lm dio: llama_model_params.load_mode = LLAMA_LOAD_MODE_DIO (no keyword)")
    if c.rpc:
        out.append(f"--rpc {','.join(c.rpc)}: register the RPC servers (ggml_backend_rpc_add_server) before loading")
    if p.cpu_mask or p.cpu_range:
        out.append("-C/-Cr: set the process's CPU affinity (os.sched_setaffinity) before loading")
    return out


def render_python(p: Pick) -> str:
    doc: dict[str, Any] = {
        "llama_cpp_python": LLAMA_CPP_PYTHON,
        "policy": p.policy,
        "trial": p.trial,
        "kwargs": llama_kwargs(p),
        "tensor_overrides": tensor_overrides(p.config),
        "note": PYTHON_NOTE,
    }
    extra = _not_in_kwargs(p)
    if extra:
        doc["not_in_kwargs"] = extra
    if p.warning:
        doc["warning"] = p.warning
    return json.dumps(doc, indent=1) + "\n"


def render_json(p: Pick) -> str:
    """The Pareto entry, its flags pinned (identical when the tuner already pinned them)."""
    doc = {**p.entry, "flags": list(p.flags)}
    if p.warning:
        doc["warning"] = p.warning
    return json.dumps(doc, indent=1) + "\n"

