"""Property tests: llama.cpp flag lists as fitter reads them (a command line's, a launcher's, a tuning result's).
Arbitrary argv lists of llama-server's spellings with plausible and hostile values, in every spelling argparse takes
(`-c 4096`, `-c=4096`, `-c4096`, `--ctx-size=4096`), stray tokens, unicode and huge numbers. Each parses to a
LaunchConfig and ProcessFlags, whose pinned flags read back to the same pinned flags and whose flags as given
(`pin(config, given=True)`) read back to the same config with the same fields given, or fails with one line of
LaunchConfigError naming a flag or token it was given; nothing else escapes, nothing runs away."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fitter.errors import LaunchConfigError
from fitter.flags import KV_CACHE_TYPES, parse_flags, parse_launch_flags, pin
from fitter.flags.config import LOAD_MODES
from fitter.flags.consumers import CONSUMER_NAMES
from fitter.flags.parse import flag_groups, flag_value, process_flags_of, without
from fitter.flags.vocabulary import BY_NAME, FLAGS, Kind
from tests.properties import assert_one_line_naming, bounded, examples

pytestmark = pytest.mark.properties  # all their examples: FITTER_ALL_EXAMPLES=1 (tests/properties.py)

NUMBERS = st.one_of(st.integers(-3, 5000).map(str), st.sampled_from(
    ["0", "-1", "-2", "512", "4096", "1e3", "0x10", " 12", "1_000", "+7", "٣", "nan", "inf", "", "auto", "all"]))
HUGE = st.sampled_from([str(2**31), str(2**63), "9" * 30, "9" * 5000, "0-99999999999", "f" * 5000, "1e999"])
WORDS = st.sampled_from([*KV_CACHE_TYPES, *LOAD_MODES, "on", "off", "auto", "enabled", "TRUE", "-1", "yes", "",
                         "127.0.0.1:50052", "127.0.0.1:50052,host:1", "x", "0-3", "3-1", "0x3", "3,1", "1/0",
                         "nan,inf", ",", "-"])
PATTERNS = st.sampled_from([r"exps=CPU", r"blk\.1\.=CUDA0,exps=CPU", "(=CPU", "a=", "=CPU", "a{1,2}=CPU", "x=b=CPU",
                            "[=CPU", "(a+)+$=CPU", ",", "a=CPU,,b=CPU", "--ctx-size=CPU"])
TEXT = st.text(max_size=10)
VALUES = st.one_of(NUMBERS, HUGE, WORDS, PATTERNS, TEXT)
NAMES = st.sampled_from(sorted(BY_NAME))
COUNT = st.integers(0, 2**20).map(str)
# What llama-server takes for each flag (by its first spelling), so that many lists parse and read back
PLAUSIBLE: dict[str, st.SearchStrategy[str]] = {
    "-c": COUNT, "-b": st.integers(1, 8192).map(str), "-ub": st.integers(1, 8192).map(str),
    "-ctk": st.sampled_from(list(KV_CACHE_TYPES)), "-ctv": st.sampled_from(list(KV_CACHE_TYPES)),
    "-fa": st.sampled_from(["on", "off", "auto", "enabled", "0", "-1"]),
    "-ngl": st.one_of(st.integers(-2, 600).map(str), st.sampled_from(["auto", "all"])),
    # a pattern may start with '-': llama.cpp takes the token after -ot whatever it is
    "-ncmoe": st.integers(0, 600).map(str), "-ot": PATTERNS | PATTERNS.map(lambda p: "-" + p),
    "-np": st.integers(-1, 64).map(str),
    "-lm": st.sampled_from(LOAD_MODES), "-fit": st.sampled_from(["on", "off"]),
    "-ts": st.sampled_from(["3,1", "1", "0.5/0.5", "1,0,2"]), "-mg": st.integers(0, 8).map(str),
    "--rpc": st.sampled_from(["127.0.0.1:50052", "127.0.0.1:50052,10.0.0.2:50052", "-h:1"]),
    "-t": st.integers(1, 64).map(str), "-tb": st.integers(1, 64).map(str),
    "-C": st.sampled_from(["0x3", "ff", "0x" + "f" * 128]), "-Cr": st.sampled_from(["0-3", "4-7", "0-511"]),
}


@st.composite
def group(draw: st.DrawFn) -> list[str]:
    """One flag as a user may write it: with its value apart or joined, alone, or a stray token."""
    name = draw(NAMES)
    canonical = BY_NAME[name].canonical
    value = draw(st.one_of(*[PLAUSIBLE[canonical]] * 3, VALUES) if canonical in PLAUSIBLE else VALUES)
    spelling = draw(st.sampled_from([0] * 12 + [1, 1, 2, 3, 4, 5]))  # mostly as written by hand or by fitter
    if spelling == 0:
        return [name, value]
    if spelling == 1:
        return [f"{name}={value}"]
    if spelling == 2:
        return [name + value]  # -c4096, or a longer name made up
    if spelling == 3:
        return [name]  # bare: right for switches, a missing value for the rest
    if spelling == 4:
        return [draw(st.sampled_from(["--", "-", "--bogus", "-x", "--ctx", "--n-gpu"])), value]
    return [draw(TEXT)]


ARGV = st.lists(group(), max_size=6).map(lambda groups: [t for g in groups for t in g])
SWITCHES = sorted(name for f in FLAGS for name in f.names if not f.takes_value)


@st.composite
def plausible_group(draw: st.DrawFn) -> list[str]:
    """A flag as llama-server takes it: a switch, or a value flag with a value it accepts."""
    name = draw(st.sampled_from(SWITCHES + sorted(n for n, f in BY_NAME.items() if f.canonical in PLAUSIBLE)))
    if name in SWITCHES:
        return [name]
    value = draw(PLAUSIBLE[BY_NAME[name].canonical])
    return [f"{name}={value}"] if name.startswith("--") and draw(st.booleans()) else [name, value]


PLAUSIBLE_ARGV = st.lists(plausible_group(), max_size=8).map(lambda groups: [t for g in groups for t in g])


def _names(argv: list[str]) -> list[str]:
    """What an error may name: a token as given or as repr writes it, or any spelling of a flag given."""
    out = ["llama.cpp flags"]
    for t in argv:
        out += [t, repr(t)[1:-1]]
        for name, f in BY_NAME.items():
            if t.startswith(name):  # -c 4096, -c=4096, -c4096: a message may name the flag by another spelling
                out += f.names
    return [n for n in out if n]


def reads_back(argv: list[str], consumer: str) -> bool:
    """Parse (and read -C/-Cr as the CPUs they name); then what fitter pins must read back as the same pinned flags.
    False when the list is refused, with one line naming a flag or token of it."""
    with bounded():
        try:
            launch, process = parse_flags(argv, consumer)
            process.cpus  # noqa: B018 (-C/-Cr read as llama.cpp's CPU set)
        except LaunchConfigError as e:
            assert_one_line_naming(e, *_names(argv))
            return False
        pinned = pin(launch, process=process)
        again, process_again = parse_flags(pinned, consumer)
        assert pin(again, process=process_again) == pinned  # what fitter writes, fitter reads back
        written = pin(launch, given=True)  # as given: the same config, the same fields given
        as_given = parse_launch_flags(written, consumer)
        assert (as_given, as_given.given) == (launch, launch.given), written
        assert pin(as_given, given=True) == written
    return True


@settings(max_examples=examples(600))
@given(ARGV, st.sampled_from(CONSUMER_NAMES))
def test_arbitrary_argv(argv: list[str], consumer: str) -> None:
    reads_back(argv, consumer)


@settings(max_examples=examples(400))
@given(PLAUSIBLE_ARGV, st.sampled_from(CONSUMER_NAMES))
def test_plausible_argv_reads_back_pinned(argv: list[str], consumer: str) -> None:
    reads_back(argv, consumer)


def _value_flags() -> list[str]:
    return sorted(name for f in FLAGS for name in f.names if f.kind in (Kind.VALUE, Kind.RULE))


def _with_value(name: str) -> st.SearchStrategy[tuple[str, str]]:
    """A flag with a huge number, a value it takes or any value, a third of the time each."""
    return st.tuples(st.just(name), st.one_of(HUGE, PLAUSIBLE.get(BY_NAME[name].canonical, VALUES), VALUES))


@settings(max_examples=examples(400))
@given(st.lists(st.sampled_from(_value_flags()).flatmap(_with_value), min_size=1, max_size=6), st.booleans())
def test_every_value_flag_with_any_value(pairs: list[tuple[str, str]], check: bool) -> None:
    """Each flag that takes a value, given any value: parsed, or refused naming the flag (and the list helpers that
    read a flag list without parsing it never fail)."""
    argv = [t for name, value in pairs for t in (name, value)]
    with bounded():
        flag_groups(argv)
        flag_value(argv, "ctx_size")
        without(argv, "overrides")
        try:
            process_flags_of(argv).cpus  # noqa: B018
            parse_launch_flags([t for name, value in pairs if BY_NAME[name].level.value in ("context", "model")
                                for t in (name, value)], check=check)
        except LaunchConfigError as e:
            assert_one_line_naming(e, *_names(argv))
