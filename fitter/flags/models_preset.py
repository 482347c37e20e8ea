"""llama-server's router presets (`--models-preset FILE`, common/preset.cpp): an INI file of one section per model,
`model = PATH` and llama-server options by their long names; section `*` holds the options of every model. Read here
as each model's path and flags, so a set of models loaded together is fitted as llama-server's router starts them
(tools/server/server-models.cpp: every preset rendered to its own llama-server argv).

The file's syntax is common/preset.cpp parse_ini_from_file's: `[name]` headers, `key = value` lines whose value runs
to the line's end less the blanks around it and stops at `;` or `#`, comment and blank lines. A key is any spelling
of a llama.cpp option without its dashes (`ctx-size`, `c`, `n-cpu-moe`) or fitter's preset key for it; a switch's
value is truthy (on, enabled, true, 1) or falsey (off, disabled, false, 0), and under a negated spelling (`no-mmap`)
it means the opposite (common/preset.cpp parse_bool_arg)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from fitter.errors import FitterError
from fitter.flags.vocabulary import FLAGS, Flag

GLOBAL = "*"  # common/preset.cpp load_from_ini: the section every model's options cascade from
_TRUTHY = ("on", "enabled", "true", "1")  # common/arg.cpp common_arg_utils::is_truthy
_FALSEY = ("off", "disabled", "false", "0")
_HEADER = re.compile(r"^[ \t]*\[[ \t]*([^\]]*?)[ \t]*\][ \t]*(?:[;#].*)?$")
_KV = re.compile(r"^[ \t]*([A-Za-z_][A-Za-z0-9_.-]*)[ \t]*=[ \t]*([^;#\r\n]*?)[ \t]*(?:[;#].*)?$")
_BLANK = re.compile(r"^[ \t]*(?:[;#].*)?$")


@dataclass(frozen=True)
class PresetModel:
    name: str  # the section: the name the router serves it as
    model: str  # its `model` key
    flags: tuple[str, ...]  # its options as llama-server flags, the global section's first


def _keys() -> dict[str, tuple[Flag, bool]]:
    """Each key a preset may use → (the flag, whether a truthy value means the flag: its own spellings, `no-mmap =
    true`; under the option's other name a falsey one does, `kv-offload = false` for -nkvo)."""
    out: dict[str, tuple[Flag, bool]] = {}
    for f in FLAGS:
        for name in f.names:
            out.setdefault(name.lstrip("-"), (f, True))
        if f.preset_key is not None:
            out.setdefault(f.preset_key, (f, f.preset_value != "false"))
    return out


def _flag_tokens(f: Flag, when_truthy: bool, value: str, where: str) -> list[str]:
    if f.takes_value:
        return [f.canonical, value]
    v = value.lower()
    if v not in _TRUTHY + _FALSEY:
        raise FitterError(f"{where}: {value!r} is not on/off (llama.cpp reads on, enabled, true, 1 or off, disabled, "
                          "false, 0)")
    return [f.canonical] if (v in _TRUTHY) == when_truthy else []


def read_models_preset(path: str | Path) -> list[PresetModel]:
    """The models of a router preset file, in the file's order, each with its flags; one-line errors name the file,
    the line and the rule."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as e:
        raise FitterError(f"--models-preset {p}: cannot read it ({e.strerror or e})") from None
    sections: dict[str, list[tuple[str, str, int]]] = {}
    current: str | None = None
    for n, line in enumerate(re.split(r"\r\n|\n|\r", text), 1):
        if (h := _HEADER.match(line)) is not None:
            current = h.group(1)
            sections.setdefault(current, [])
        elif (kv := _KV.match(line)) is not None:
            if current is None:
                raise FitterError(f"{p}:{n}: {kv.group(1)} = … before any [section]")
            sections[current].append((kv.group(1), kv.group(2), n))
        elif not _BLANK.match(line):
            raise FitterError(f"{p}:{n}: not a [section], a key = value or a comment: {line.strip()!r}")
    keys = _keys()

    def flags_of(name: str) -> tuple[str | None, list[str]]:
        model, flags = None, []
        for key, value, n in sections.get(name, []):
            where = f"{p}:{n}: [{name}] {key}"
            if key in ("model", "m"):
                model = value
            elif key in keys:
                tokens = _flag_tokens(*keys[key], value, where)
                if not tokens and value.lower() in _FALSEY and f"no-{key}" in keys:  # `mmap = off`: --no-mmap
                    tokens = _flag_tokens(*keys[f"no-{key}"], "true", where)
                flags += tokens
            elif key not in ("version", "alias", "tags"):
                raise FitterError(f"{where}: not an option fitter prices (its memory flags: "
                                  "fitter estimate --help); remove it from the set's file for the fit")
        return model, flags

    _, common = flags_of(GLOBAL)
    models = []
    for name in sections:
        if name == GLOBAL:
            continue
        model, flags = flags_of(name)
        if not model:
            raise FitterError(f"{p}: [{name}] has no model = PATH")
        if not Path(model).is_file():
            raise FitterError(f"{p}: [{name}] model = {model}: no such file")
        models.append(PresetModel(name, model, (*common, *flags)))
    if not models:
        raise FitterError(f"{p}: no model sections ([name] with model = PATH)")
    return models
