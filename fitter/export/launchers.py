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
from fitter.flags import LaunchConfig, parse_launch_flags, pin, split_process_flags
from fitter.flags.config import SPLIT_MODES
from fitter.flags.overrides import with_bufts
from fitter.flags.parse import flag_groups, process_flags_of
from fitter.flags.vocabulary import BY_NAME
from fitter.memory.backends.devices import emulated_gpu_names
from fitter.results.pareto import POLICIES, Entry, ParetoDoc
from fitter.results.quality_record import kv_note, kv_of_flags

FORMATS = ("server", "preset-ini", "llama-swap", "python", "json")
LLAMA_CPP_PYTHON = "0.3.36"  # the Llama.__init__ the python format is mapped against (pyproject's `llama` extra)
__all__ = ["FORMATS", "POLICIES", "Pick", "pick", "render"]


@dataclass(frozen=True)
class Pick:
    """The picked trial, parsed and pinned: what every format renders."""

    policy: str
    trial: int
    entry: Entry
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
    replanned: str | None = None  # what changed for the program the export is for (fitter.export.replan)
    binary: str = "llama-server"  # the llama-server the result was measured with (`--llama-cpp DIR`), else on PATH


def pick(result: ParetoDoc, policy: str, entry: Entry | None = None) -> Pick:
    """The picked entry (or `entry`, another of the result's, as the policy's launcher would run it) with its flags
    parsed and pinned; FitterError names the file, trial and flag at fault."""
    source = result.source
    entry = entry if entry is not None else result.entry(policy)
    where = f"{source}: the {policy} pick (trial {entry.trial})"
    model = result.model
    path = model.get("path")
    if not isinstance(path, str) or not path:
        raise FitterError(f"{source}: no model.path; the export needs the GGUF file to launch")
    name = model.get("name")
    if not isinstance(name, str) or not name:
        name = _stem(path)
    binary = result.llama_cpp.get("llama_server")
    binary = binary if isinstance(binary, str) and binary else "llama-server"
    for key, value in (("model.path", path), ("model.name", name), ("llama_cpp.llama_server", binary)):
        _check_text(f"{source}: {key}", value)
    if entry.flags is None:
        raise FitterError(f"{where}: \"flags\" must be a list of strings, got None")
    launch, _ = split_process_flags(entry.flags, where)
    try:
        config = parse_launch_flags(launch, result.consumer)
        process = process_flags_of(entry.flags)
    except LaunchConfigError as e:
        raise FitterError(f"{where}: {e}") from None
    if process.threads is None:
        raise FitterError(f"{where}: no -t (threads); an export pins -t and -tb as measured")
    process = replace(process, threads_batch=process.threads_batch or process.threads)  # llama.cpp: -tb is -t's

    emulated = result.emulated or (entry.measurement is not None and entry.measurement.emulated)
    warning = None
    if emulated and result.machine.get("emulated_gpu_kind") == "vulkan":
        # the emulated Vulkan GPUs are the Vulkan build's own devices, named as a Vulkan build names them
        warning = ("measured on fitter's emulated Vulkan GPU (llama.cpp's Vulkan backend on Mesa's lavapipe, capped, "
                   "CPU speed) on the tuning machine: check the placement fits your GPU with `fitter fit "
                   "--llama-cpp <your Vulkan build>`")
    elif emulated:
        # several emulated GPUs stand for CUDA0, CUDA1, … in their order: a rule naming one names that GPU
        named = emulated_gpu_names(config.rpc)
        dropped = f"; its --rpc {','.join(config.rpc)} is left out" if config.rpc else ""
        renamed = sorted({f"{r.buft} as {named[r.buft]}" for r in config.overrides if r.buft in named})
        dropped += f"; -ot names {', '.join(renamed)}" if renamed else ""
        several = len(config.rpc) > 1
        what = "GPUs (capped llama.cpp RPC devices" if several else "GPU (a capped llama.cpp RPC device"
        warning = (f"measured on fitter's emulated {what} on the tuning machine, CPU speed){dropped}: check the "
                   f"placement fits your GPU{'s' if several else ''} with `fitter fit`")
        config = replace(config, rpc=(), overrides=with_bufts(config.overrides, named))
    chosen = result.machine.get("model_devices")
    if not config.device_names and isinstance(chosen, list) and chosen and all(isinstance(n, str) for n in chosen):
        config = replace(config, device_names=tuple(chosen))  # the build's devices the trials used, named (-dev)
    if config.flash_attn == "auto":
        raise FitterError(f"{where}: -fa auto is resolved by llama-server per device at launch; an export pins "
                          "-fa on or off: tune with flash-attn on/off")
    if config.n_gpu_layers == -1:
        if result.machine.get("gpus") or emulated or config.rpc:
            raise FitterError(f"{where}: -ngl auto leaves the placement to llama.cpp's --fit; an export pins it: "
                              "tune with -ngl (or let `fitter fit` choose the placement)")
        config = replace(config, n_gpu_layers=0)  # no GPU on the tuning machine: nothing was offloaded

    assert process.threads is not None and process.threads_batch is not None
    flags = tuple(pin(config, process=process))
    for flag in flags:
        _check_text(f"{where}: flag", flag)
    return Pick(policy=policy, trial=int(entry.trial or 0), entry=entry, model_path=path, model_name=name,
                config=config, threads=process.threads, threads_batch=process.threads_batch,
                cpu_mask=process.cpu_mask, cpu_range=process.cpu_range, flags=flags,
                header=_header(result, entry, policy), warning=warning, binary=binary)


def _stem(path: str) -> str:
    return re.sub(r"\.gguf$", "", path.replace("\\", "/").rsplit("/", 1)[-1])


def _check_text(what: str, value: str) -> None:
    """Every format is UTF-8 text: a file name in another encoding (Python keeps its bytes as lone surrogates)
    cannot be written as the launcher would read it back."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise FitterError(f"{what} {value!r}: not valid UTF-8 (a name in another encoding); an export is UTF-8 text: "
                          "rename it") from None


def comment(text: str) -> str:
    """`text` fit for one comment line in any format: line breaks and other unprintable characters escaped, so a
    path in it can never start a line of its own (a command, a key, a section)."""
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text)


def _header(result: ParetoDoc, entry: Entry, policy: str) -> tuple[str, ...]:
    speeds = [f"{k} {value:.1f} t/s" for k in ("tg", "pp") if (value := entry.speed(k)) is not None]
    commit = result.llama_cpp.get("commit")
    lines = [f"fitter export --policy {policy}: trial {entry.trial} of {result.source}"]
    if speeds:
        lines.append("measured " + ", ".join(speeds) + (f" with llama.cpp {commit}" if commit else ""))
    elif commit:
        lines.append(f"measured with llama.cpp {commit}")
    if entry.flags and (note := kv_note(kv_of_flags(entry.flags), entry.quality, entry.kv_bytes)) is not None:
        lines.append(note)  # what its KV cache types cost in quality (fitter.results.quality_record)
    return tuple(lines)


def _comments(p: Pick, prefix: str) -> list[str]:
    return [f"{prefix} {comment(line)}" for line in (*p.header, *([p.warning] if p.warning else []))]


# -- the pinned flags as launchers read them ------------------------------------------------------------------


def preset_options(p: Pick) -> list[tuple[str, str]]:
    """(key, value) in flag order; llama-server rebuilds the argv from them (common_preset::to_args) ordered by the
    options' first spelling, which keeps -ncmoe's rules before -ot's as on the command line. Keys and the values of
    bare flags come from fitter.flags.vocabulary (common_preset::to_ini)."""
    return preset_pairs(p.model_path, p.flags)


def preset_pairs(model_path: str, flags: tuple[str, ...] | list[str]) -> list[tuple[str, str]]:
    """A model's path and pinned flags as preset (key, value) pairs (see preset_options)."""
    options = [("model", model_path)]
    for name, tokens in flag_groups(flags):
        f = BY_NAME[name]
        assert f.preset_key is not None, name
        options.append((f.preset_key, tokens[1] if len(tokens) > 1 else str(f.preset_value)))
    return options


# -- formats -----------------------------------------------------------------------------------------------------


def render(result: ParetoDoc, policy: str, fmt: str, note: str | None = None) -> str:
    """The picked configuration in one of FORMATS, ending with a newline; `note` (a re-plan for another program,
    fitter.export.replan) goes with it, as a comment or a "replanned" key."""
    renderers = {"server": render_server, "preset-ini": render_preset_ini, "llama-swap": render_llama_swap,
                 "python": render_python, "json": render_json}
    if fmt not in renderers:
        raise FitterError(f"--format {fmt!r}: unknown format; choose one of {', '.join(FORMATS)}")
    p = pick(result, policy)
    if note:
        p = replace(p, header=(*p.header, note), replanned=note)
    return renderers[fmt](p)


def launch_argv(p: Pick) -> list[str]:
    return [p.binary, "-m", p.model_path, *p.flags]


def render_server(p: Pick) -> str:
    # POSIX shell quoting: a newline in a value stays inside its quotes (the line then spans lines, still one command)
    notes = "".join(f"# {comment(line)}\n" for line in (p.warning, p.replanned) if line)
    return notes + shlex.join(launch_argv(p)) + "\n"


# common/preset.cpp parse_ini_from_file (0c1e570): a value runs to the line's end, less the blanks ([ \t]) around it,
# and stops at the first ';' or '#' (a comment); a line ends at \n, \r\n or \r. No quoting or escape exists.
_INI_UNSAFE = re.compile(r"[;#\r\n]|^[ \t]|[ \t]$")
# the same file's load_from_ini: section "*" holds the options of every preset, not a model's
_INI_GLOBAL = "*"


def render_preset_ini(p: Pick) -> str:
    return "\n".join([*_comments(p, ";"), *preset_section(p.model_name, preset_options(p))]) + "\n"


def preset_section(name: str, options: list[tuple[str, str]]) -> list[str]:
    """One model's section of a router preset: `[name]` then `key = value` lines; refused where llama-server's
    parser would cut a value."""
    section = re.sub(r"[\[\]:\s]+", "-", name).strip("-")  # a `:tag` would be re-cased
    lines = [f"[{section if section not in ('', _INI_GLOBAL) else 'model'}]"]
    for key, value in options:
        if _INI_UNSAFE.search(value):
            raise FitterError(f"preset-ini: {key} = {value!r}: llama-server's preset parser ends a value at ';', "
                              "'#' or a line break and drops the blanks around it; launch with --format server "
                              "instead")
        lines.append(f"{key} = {value}")
    return lines


def render_llama_swap(p: Pick) -> str:
    # llama-swap (github.com/mostlygeek/llama-swap, internal/config/commands.go SanitizeCommand, macros.go): `cmd`
    # loses its lines that start with '#' (after blanks) and the trailing '\' of its lines, `${NAME}` macros are
    # substituted, and it is split by github.com/billziss-gh/golib shlex.Posix (single quotes literal, blanks are
    # space, tab and newline). `proxy` defaults to http://localhost:${PORT} when cmd uses ${PORT}.
    argv = ["-m", p.model_path, *p.flags]
    for arg in argv:
        if "${" in arg:
            raise FitterError(f"llama-swap: {arg!r} contains '${{', which llama-swap reads as a macro")
    lines = [_swap_quote(p.binary), "--port ${PORT}",
             *(" ".join(_swap_quote(t) for t in tokens) for _, tokens in flag_groups(argv))]
    cmd = "\n".join(lines)
    out = [*_comments(p, "#"), "models:", f"  {yaml_quoted(p.model_name)}:"]
    if _YAML_BLOCK_UNSAFE.search(cmd):
        out.append(f"    cmd: {yaml_quoted(cmd)}")
    else:
        out += ["    cmd: |", *(f"      {line}" for line in cmd.split("\n"))]
    return "\n".join(out) + "\n"


def _swap_quote(token: str) -> str:
    """shlex.quote, with each newline inside a value quoted apart ('\n'), so every line of cmd starts and ends with a
    quote or a plain word: none starts with '#' or ends with '\', which llama-swap would drop or cut."""
    return "'\n'".join(shlex.quote(part) for part in token.split("\n"))


# what a YAML literal block cannot hold as it is (YAML 1.2 c-printable, less the line breaks and the BOM that
# libyaml, under both PyYAML and gopkg.in/yaml.v3, reads as such): such a cmd is written double-quoted, escaped
_YAML_BLOCK_UNSAFE = re.compile("[^\t\n\x20-\x7e\xa0-\ud7ff\ue000-\ufefe\uff00-\ufffd\U00010000-\U0010ffff]")


def yaml_quoted(text: str) -> str:
    """A YAML double-quoted scalar that reads back as exactly `text`: printable ASCII as is, the rest as escapes
    (YAML 1.2 section 5.7, read by PyYAML and gopkg.in/yaml.v3); astral characters as one \\U escape, not JSON's
    surrogate pairs, which yaml.v3 refuses."""
    out = []
    for c in text:
        if c in '"\\':
            out.append("\\" + c)
        elif c == "\n":
            out.append("\\n")
        elif " " <= c <= "~":
            out.append(c)
        elif ord(c) <= 0xFF:
            out.append(f"\\x{ord(c):02x}")
        elif ord(c) <= 0xFFFF:
            out.append(f"\\u{ord(c):04x}")
        else:
            out.append(f"\\U{ord(c):08x}")
    return '"' + "".join(out) + '"'


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
        "split_mode": SPLIT_MODES.index(c.split_mode),  # Llama(split_mode=…) takes enum llama_split_mode
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
    "among the ggml devices, as fitter/measure/capi.py build_model_params does."
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
    if c.device_names:
        out.append(f"-dev {','.join(c.device_names)}: llama_model_params.devices, a NULL-terminated array of the "
                   "ggml devices by name (ggml_backend_dev_by_name; no keyword)")
    if c.rpc:
        out.append(f"--rpc {','.join(c.rpc)}: register the RPC servers (ggml_backend_rpc_add_server) before loading")
    if p.cpu_mask or p.cpu_range:
        out.append("-C/-Cr: set the process's CPU affinity (os.sched_setaffinity) before loading")
    if c.draft_model:
        out.append(f"-md {c.draft_model}: llama-cpp-python loads no draft model (its draft_model is a prompt-lookup "
                   "object); the measured memory counted the draft's weights, KV cache and compute")
    if c.mmproj:
        out.append(f"--mmproj {c.mmproj}: a chat handler's clip_model_path in llama-cpp-python (llama_chat_format), "
                   "not a Llama keyword; the measured memory counted the projector's weights and compute")
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
    if p.replanned:
        doc["replanned"] = p.replanned
    return json.dumps(doc, indent=1) + "\n"


def render_json(p: Pick) -> str:
    """The Pareto entry, its flags pinned (identical when the tuner already pinned them)."""
    doc = {**p.entry.data, "flags": list(p.flags)}
    if p.warning:
        doc["warning"] = p.warning
    if p.replanned:
        doc["replanned"] = p.replanned
    return json.dumps(doc, indent=1) + "\n"

