"""llama.cpp's flags on fitter's command line and in a list (a launcher's, a tuning result's): parsed once into a
LaunchConfig (and the ProcessFlags it leaves to the process), with the argparse options derived from the one table
in fitter.flags.vocabulary and llama-server's spellings, defaults and error rules.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
from collections.abc import Sequence
from typing import Any

from fitter.errors import LaunchConfigError
from fitter.flags.config import LaunchConfig, ProcessFlags, TensorOverride, validate
from fitter.flags.consumers import CONSUMER_NAMES, DEFAULT_CONSUMER, apply_defaults
from fitter.flags.overrides import CPU_MOE_RULE, ncmoe_rules, split_ncmoe
from fitter.flags.vocabulary import BARE, BY_NAME, BY_SPACE_KEY, Flag, Kind, Level, launch_flags, process_flags

_DEFAULTS = {f.name: f.default for f in dataclasses.fields(LaunchConfig)}
_FIELDS = tuple(dict.fromkeys(f.field for f in launch_flags()))  # the LaunchConfig fields flags set
_RULE_FIELDS = tuple(dict.fromkeys(f.field for f in launch_flags() if f.kind in (Kind.RULE, Kind.RULE_SWITCH)))


class _AppendOverride(argparse.Action):
    """-ot, -cmoe and -ncmoe share one ordered rule list, as in common/arg.cpp (first match wins); the draft's
    -otd, -cmoed and -ncmoed another."""

    def __call__(self, parser: argparse.ArgumentParser, ns: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        rules: list[TensorOverride] = list(getattr(ns, self.dest, None) or [])
        kind = BY_NAME[self.option_strings[0]].kind
        if kind is Kind.RULE_SWITCH:
            rules.append(CPU_MOE_RULE)
        elif self.option_strings[0] in ("-ncmoe", "-ncmoed"):
            try:
                n = int(values)
            except (TypeError, ValueError):
                raise LaunchConfigError(f"{option_string} {values!r}: expected an integer") from None
            if n < 0:
                raise LaunchConfigError(f"{option_string} {values}: must be >= 0 (common/arg.cpp)")
            rules.extend(ncmoe_rules(n))  # llm_add_n_cpu_ffn_overrides: the *first* n layers
        else:
            rules.extend(_ot_rules(str(values), option_string))
        setattr(ns, self.dest, rules)


def _ot_rules(value: str, option_string: str | None) -> list[TensorOverride]:
    rules = []
    for item in value.split(","):
        pattern, sep, buft = item.partition("=")
        if not sep or not pattern or not buft:
            raise LaunchConfigError(f"{option_string} {value!r}: each rule must be PATTERN=BUFFER_TYPE")
        try:
            re.compile(pattern)
        except re.error as e:
            raise LaunchConfigError(f"{option_string} {value!r}: bad regular expression: {e}") from None
        rules.append(TensorOverride(pattern, buft))
    return rules


class _Merge(argparse.Action):
    """A flag whose repeated values combine as llama.cpp combines them, starting from the default (Flag.merge:
    --spec-type's types add up to the default `none`)."""

    def __call__(self, parser: argparse.ArgumentParser, ns: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        merge = BY_NAME[self.option_strings[0]].merge
        assert merge is not None
        setattr(ns, self.dest, merge(getattr(ns, self.dest, _DEFAULTS[self.dest]), values))


class _MergeConst(argparse.Action):
    """A bare flag that changes its field as llama.cpp combined it with the others (Flag.merge: an older llama.cpp's
    load switches)."""

    def __call__(self, parser: argparse.ArgumentParser, ns: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        merge = BY_NAME[self.option_strings[0]].merge
        assert merge is not None
        current = getattr(ns, self.dest, argparse.SUPPRESS)
        setattr(ns, self.dest, merge(_DEFAULTS[self.dest] if current is argparse.SUPPRESS else current, None))


def _add(target: Any, f: Flag, default: Any, help_text: str | None = None) -> None:
    text = help_text or f.help
    if f.kind is Kind.VALUE and f.merge is not None:
        target.add_argument(*f.names, dest=f.field, type=f.parse, default=default, metavar=f.metavar,
                            action=_Merge, help=text)
    elif f.kind is Kind.VALUE:
        target.add_argument(*f.names, dest=f.field, type=f.parse, default=default, metavar=f.metavar,
                            choices=f.choices, help=text)
    elif f.kind is Kind.SWITCH:
        target.add_argument(*f.names, dest=f.field, action="store_true", default=default, help=text)
    elif f.kind is Kind.NEGATION:
        target.add_argument(*f.names, dest=f.field, action="store_false", default=default, help=text)
    elif f.kind is Kind.CONST and f.merge is not None:
        target.add_argument(*f.names, dest=f.field, action=_MergeConst, nargs=0, default=default, help=text)
    elif f.kind is Kind.CONST:
        target.add_argument(*f.names, dest=f.field, action="store_const", const=f.const, default=default,
                            help=text)
    else:  # RULE, RULE_SWITCH: one ordered list (the target's, the draft's)
        target.add_argument(*f.names, dest=f.field, action=_AppendOverride, default=default,
                            nargs=0 if f.kind is Kind.RULE_SWITCH else None, metavar=f.metavar, help=text)


def add_launch_arguments(parser: argparse.ArgumentParser) -> None:
    """Every flag a LaunchConfig holds, as llama-server spells it; flags that set one field are exclusive. Plus
    fitter's own `--for PROGRAM`: whose defaults and memory rules the flags are read with. A launch field is in the
    parsed namespace only when a flag set it (argparse.SUPPRESS): which fields were given is the namespace's."""
    parser.add_argument("--for", dest="consumer", choices=CONSUMER_NAMES, default=DEFAULT_CONSUMER,
                        metavar="PROGRAM", help="the program that will run the config: " + " | ".join(CONSUMER_NAMES)
                        + " (default llama-server); its defaults and memory rules apply")
    g = parser.add_argument_group("llama.cpp flags (llama-server spellings and defaults)")
    groups: dict[str, Any] = {}
    for f in launch_flags():
        shared = [o for o in launch_flags() if o.field == f.field]
        if len(shared) > 1 and f.field not in _RULE_FIELDS and not any(o.merge for o in shared):
            if f.field not in groups:
                groups[f.field] = g.add_mutually_exclusive_group()
            target = groups[f.field]
        else:
            target = g
        _add(target, f, argparse.SUPPRESS)


def add_process_arguments(parser: argparse.ArgumentParser | Any, help_text: dict[str, str] | None = None,
                          names: Sequence[str] = ("-t", "-tb", "-C", "-Cr")) -> None:
    """The process-level flags (threads, affinity) a command reads itself; default None (its own default)."""
    for f in process_flags():
        if f.canonical in names:
            _add(parser, f, None, (help_text or {}).get(f.canonical))


def launch_config_from_args(ns: argparse.Namespace, check: bool = True) -> LaunchConfig:
    """The LaunchConfig of parsed arguments (add_launch_arguments), with the defaults of the program `--for` names
    where no flag set a field, and the fields flags set recorded as given."""
    # a flag that set its field to nothing (`-ts ,`, `--rpc ,`, `-md ""`) gave nothing a writer could repeat
    given = {name for name in _FIELDS if hasattr(ns, name) and getattr(ns, name) not in ((), "")}
    values: dict[str, Any] = {name: getattr(ns, name, _DEFAULTS[name]) for name in _FIELDS}
    for name in _RULE_FIELDS:
        values[name] = tuple(values[name] or ())
    values = apply_defaults(values, given, getattr(ns, "consumer", None) or DEFAULT_CONSUMER)
    config = LaunchConfig(**values, given=frozenset(given))
    if check:  # False: leave llama.cpp's own rules to llama.cpp (golden data records what it does)
        validate(config)
    return config


def process_flags_from_args(ns: argparse.Namespace) -> ProcessFlags:
    return ProcessFlags(**{f.field: getattr(ns, f.field, None) for f in process_flags()})


class _Parser(argparse.ArgumentParser):
    def __init__(self, flags: Sequence[str]) -> None:
        super().__init__(add_help=False, allow_abbrev=False)  # llama.cpp takes no abbreviation: -m is not -mg
        self._flags = flags

    def error(self, message: str) -> Any:  # argparse would print usage and exit
        raise LaunchConfigError(f"llama.cpp flags {' '.join(self._flags)!r}: {message}")


def parse_launch_flags(flags: Sequence[str], consumer: str = DEFAULT_CONSUMER, check: bool = True) -> LaunchConfig:
    """Parse a list of llama.cpp flags (as a launcher would pass them) into a LaunchConfig for the program
    `consumer` (fitter.flags.consumers); `check` also applies the rules llama.cpp enforces before loading."""
    parser = _Parser(flags)
    add_launch_arguments(parser)
    ns = parser.parse_args(_joined(flags))
    ns.consumer = consumer
    return launch_config_from_args(ns, check)


def _joined(flags: Sequence[str]) -> list[str]:
    """`-ot -x=CPU` as `-ot=-x=CPU`: llama.cpp takes the token after a flag as its value whatever it looks like,
    argparse would take a value starting with '-' for another flag (and pin's `-ot PATTERN` would not read back)."""
    out: list[str] = []
    i = 0
    while i < len(flags):
        f = BY_NAME.get(flags[i])
        if f is not None and f.takes_value and f.level in (Level.CONTEXT, Level.MODEL) and i + 1 < len(flags):
            out.append(f"{flags[i]}={flags[i + 1]}")
            i += 2
        else:
            out.append(flags[i])
            i += 1
    return out


def parse_flags(flags: Sequence[str], consumer: str = DEFAULT_CONSUMER) -> tuple[LaunchConfig, ProcessFlags]:
    """A full llama-server flag list (a trial's, a result's): its LaunchConfig and its process-level flags."""
    launch, _ = split_process_flags(flags, "the flags")
    return parse_launch_flags(launch, consumer), process_flags_of(flags)


def process_flags_of(flags: Sequence[str]) -> ProcessFlags:
    """The -t/-tb/-C/-Cr of a flag list; thread counts must be integers >= 1."""
    _, process = split_process_flags(flags, "the flags")
    counts: dict[str, int] = {}
    for name in ("-t", "-tb"):
        if name in process:
            try:
                counts[name] = int(process[name])
            except ValueError:
                counts[name] = 0
            if counts[name] < 1:
                raise LaunchConfigError(f"{name} {process[name]!r}: expected a thread count >= 1")
    return ProcessFlags(counts.get("-t"), counts.get("-tb"), process.get("-C"), process.get("-Cr"))


def split_process_flags(flags: Sequence[str], where: str) -> tuple[list[str], dict[str, str]]:
    """(llama.cpp flags for parse_launch_flags, {-t|-tb|-C|-Cr: value}) of a flag list."""
    launch: list[str] = []
    process: dict[str, str] = {}
    i = 0
    while i < len(flags):
        f = BY_NAME.get(flags[i])
        if f is None or f.level is not Level.PROCESS:
            launch.append(flags[i])
            i += 1
            continue
        if i + 1 >= len(flags):
            raise LaunchConfigError(f"{where}: {flags[i]} without a value")
        process[f.canonical] = flags[i + 1]
        i += 2
    return launch, process


def flag_groups(flags: Sequence[str]) -> list[tuple[str, list[str]]]:
    """A flag list as (name, tokens) groups: a flag with its value, or alone when it is bare (or written
    `--name=VALUE`); a flag fitter does not know takes the next token; anything else stands alone."""
    groups: list[tuple[str, list[str]]] = []
    i = 0
    while i < len(flags):
        token = flags[i]
        name = token.split("=", 1)[0] if token.startswith("--") else token
        bare = name in BARE or name != token or not token.startswith("-")
        n = 0 if bare else 1
        groups.append((name, list(flags[i : i + 1 + n])))
        i += 1 + n
    return groups


def flag_value(flags: Sequence[str], field: str) -> str | None:
    """The value given for a field's flags (the last one), e.g. flag_value(flags, "rpc") → "127.0.0.1:50052"."""
    value = None
    for name, tokens in flag_groups(flags):
        known = BY_NAME.get(name)
        if known is not None and known.field == field and known.takes_value:
            value = tokens[-1].split("=", 1)[-1] if len(tokens) == 1 else tokens[-1]
    return value


def without(flags: Sequence[str], field: str) -> list[str]:
    """`flags` less every flag (and its value) that sets `field`."""
    return [t for name, tokens in flag_groups(flags) if not (name in BY_NAME and BY_NAME[name].field == field)
            for t in tokens]


def searched_flags(flags: Sequence[str], fixed: Sequence[str]) -> list[str]:
    """A trial's flags less the ones its fixed flags have (each flag with its value): what its search chose."""
    kept = {tuple(tokens) for _, tokens in flag_groups(fixed)}
    return [t for _, tokens in flag_groups(flags) if tuple(tokens) not in kept for t in tokens]


def has_flag(flags: Sequence[str], field: str) -> bool:
    return any(name in BY_NAME and BY_NAME[name].field == field for name, _ in flag_groups(flags))


def with_params(config: LaunchConfig, params: dict[str, Any], check: bool = True) -> LaunchConfig:
    """`config` with search-space parameters applied (keys: llama.cpp's long flag names, as a search space has
    them; process-level keys such as threads are not a LaunchConfig's and are refused), each value read as
    llama.cpp reads that flag's, tensor-override rules appended after the config's own (as on a command line),
    each field recorded as given; `check`: llama.cpp's rules too (fitter.flags.config.validate)."""
    changes: dict[str, Any] = {}
    overrides = list(config.overrides)
    for key, value in params.items():
        f = BY_SPACE_KEY.get(key)
        if f is None or f.level is Level.PROCESS:
            raise LaunchConfigError(f"{key}={value!r}: not a llama.cpp launch parameter of a search space")
        if f.kind is Kind.RULE:  # -ncmoe N
            overrides.extend(ncmoe_rules(int(value)))
        else:
            changes[f.field] = f.parse(str(value)) if f.parse is not None else str(value)
    if len(overrides) != len(config.overrides):
        changes["overrides"] = tuple(overrides)
    out = config.with_given(**changes)
    if check:
        validate(out)
    return out


def fixed_space_keys(config: LaunchConfig) -> set[str]:
    """The search-space keys the flags given fix (they leave the search): each given field's key, and n-cpu-moe where
    the given rules place experts as `-cmoe` or `-ncmoe` do, `-ncmoe 0` too (an `-ot` of other tensors leaves it
    searched)."""
    keys = {f.space_key for f in launch_flags() if f.space_key and f.field in config.given and f.kind is Kind.VALUE}
    # a switch's key (kv-offload) is fixed by either spelling given (-kvo, -nkvo)
    keys |= {k for f in launch_flags() if f.field in config.given and f.kind in (Kind.SWITCH, Kind.NEGATION)
             for k in ((f.space_key,) if f.space_key else ()) + f.fixes}
    rules = config.overrides if "overrides" in config.given else ()
    if "overrides" in config.given and (not rules or CPU_MOE_RULE in rules
                                         or any(split_ncmoe(rules[i:])[0] for i in range(len(rules)))):
        keys.add("n-cpu-moe")
    return keys


def with_endpoint(flags: Sequence[str], old: str, new: str) -> list[str]:
    """`flags` with every mention of an RPC endpoint (the `--rpc` value, `-ot …=RPC0[old]`) moved to another: a
    recorded run's emulated GPU is gone, a fresh one listens elsewhere."""
    return [f.replace(old, new) for f in flags]


def with_endpoints(flags: Sequence[str], old: Sequence[str], new: Sequence[str]) -> list[str]:
    """`with_endpoint` for several emulated GPUs at once, the i-th old endpoint to the i-th new one (through names no
    endpoint has, so one moved to another's old port is not moved twice)."""
    out = list(flags)
    for i, endpoint in enumerate(old):  # a whole port only: 127.0.0.1:4084 is not the start of 127.0.0.1:40845
        pattern = re.compile(re.escape(endpoint) + r"(?!\d)")
        out = [pattern.sub(f"\0{i}\0", f) for f in out]
    for i, endpoint in enumerate(new):
        out = with_endpoint(out, f"\0{i}\0", endpoint)
    return out
