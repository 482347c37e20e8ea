"""How each launcher reads an export, ported from its source, so a test parses an export back the way it will be
read: llama.cpp's preset INI parser, llama-swap's command splitting, a POSIX shell."""

from __future__ import annotations

import re
import subprocess

# -- llama.cpp: common/preset.cpp parse_ini_from_file (0c1e570) ----------------------------------------------------
# newline ::= "\r\n" / "\n" / "\r"; ws ::= [ \t]*; comment ::= [;#] (!newline .)*
# header-line ::= "[" ws [^]]+ ws "]" eol; kv-line ::= ident ws "=" ws value eol; value ::= (!(ws ([;#] / newline /
# EOF)) .)*; comment-line ::= ws comment; blank-line ::= ws. A file with any other line is refused whole.
_INI_NEWLINE = re.compile(r"\r\n|\n|\r")
_INI_HEADER = re.compile(r"\[[ \t]*([^\]]+)\][ \t]*(?:[;#].*)?")
_INI_KV = re.compile(r"([a-zA-Z_][a-zA-Z0-9_.-]*)[ \t]*=[ \t]*((?:(?![ \t]*(?:[;#]|$)).)*)[ \t]*(?:[;#].*)?")
_INI_OTHER = re.compile(r"[ \t]*(?:[;#].*)?")


def llama_cpp_ini(text: str) -> dict[str, dict[str, str]]:
    """{section: {key: value}} as llama-server reads a --models-preset file (keys before any section: "default")."""
    parsed: dict[str, dict[str, str]] = {}
    section = "default"
    for line in _INI_NEWLINE.split(text):
        if m := _INI_HEADER.fullmatch(line):
            section = m.group(1)
            parsed[section] = {}
        elif m := _INI_KV.fullmatch(line):
            parsed.setdefault(section, {})[m.group(1)] = m.group(2)
        elif not _INI_OTHER.fullmatch(line):
            raise ValueError(f"llama.cpp's preset parser refuses the file at {line!r}")
    return parsed


# -- llama-swap: internal/config/commands.go SanitizeCommand (and StripComments, run on cmd first) -------------------
# Go's strings.TrimSpace: unicode.IsSpace
_GO_SPACE = "\t\n\v\f\r \x85\xa0\u1680\u2000\u2001\u2002\u2003\u2004\u2005\u2006\u2007\u2008\u2009\u200a\u2028\u2029" \
            "\u202f\u205f\u3000"


def llama_swap_argv(cmd: str) -> list[str]:
    """The argv llama-swap starts for a model's `cmd` (macros such as ${PORT} left unsubstituted)."""
    lines = []
    for line in cmd.split("\n"):
        trimmed = line.strip(_GO_SPACE)
        if trimmed.startswith("#"):
            continue
        lines.append(trimmed[:-1] + " " if trimmed.endswith("\\") else line)
    return golib_posix_split("\n".join(lines))


def golib_posix_split(line: str) -> list[str]:
    """github.com/billziss-gh/golib shlex.Posix.Split (v0.2.0, llama-swap's splitter): blanks are space, tab and
    newline; outside quotes a backslash takes the next character (with a newline, or at the end: nothing); inside
    double quotes only before $ ` " \\ or a newline; inside single quotes nothing is special."""
    space, word, no_escape, empty = " ", "A", object(), ""

    def escape(state: str, r: str, r0: str | None) -> object:
        if r != "\\" or state == "'":
            return no_escape
        if r0 is None or r0 == "\n":
            return empty
        if state == '"' and r0 not in '$`"\\':
            return no_escape
        return r0

    tokens: list[str] = []
    token: list[str] | None = None
    state = [space]
    i = 0
    while i < len(line):
        r, r0 = line[i], line[i + 1] if i + 1 < len(line) else None
        s = state[-1]
        e = escape(s, r, r0)
        step = 1 if e is no_escape or r0 is None else 2
        if e is empty:
            i += step
            continue
        if s == space:
            if e is not no_escape:
                state.append(word)
                token = [*(token or []), str(e)]
            elif r in "\"'":
                state += [word, r]
                token = []
            elif r not in " \t\n":
                state.append(word)
                token = [*(token or []), r]
        elif s == word:
            assert token is not None
            if e is not no_escape:
                token.append(str(e))
            elif r in "\"'":
                state.append(r)
            elif r in " \t\n":
                state.pop()
                tokens.append("".join(token))
                token = None
            else:
                token.append(r)
        else:  # inside quotes
            assert token is not None
            if e is not no_escape:
                token.append(str(e))
            elif r == s:
                state.pop()
            else:
                token.append(r)
        i += step
    if token is not None:
        tokens.append("".join(token))
    return tokens


# -- a POSIX shell ----------------------------------------------------------------------------------------------------


def sh_argv(line: str) -> list[str]:
    """The words `sh` makes of one exported command line (run as `set -- LINE`, so nothing is executed)."""
    script = f'set -- {line}\nfor a do printf "%s\\0" "$a"; done'
    out = subprocess.run(["sh", "-c", script], capture_output=True, check=True, timeout=30).stdout
    return [w.decode() for w in out.split(b"\0")[:-1]]
