"""Names that break naive quoting and naive folders: what a model file, its metadata or a result may be called."""

from __future__ import annotations

# model paths: blanks, quotes, shell syntax, line breaks, unicode, control characters, a leading dash
HOSTILE_PATHS = [
    "/models/my models/a b.gguf",
    "/models/it's \"quoted\".gguf",
    "/models/$HOME `echo INJECTED` $(echo INJECTED) ;echo INJECTED &.gguf",
    "/models/two\nlines.gguf",
    "/models/a\n#not a comment\\\n  \\ b.gguf",  # llama-swap drops lines starting with '#' and cuts a final '\'
    "/models/ünïcödé 🦙 模型.gguf",
    "-starts-with-a-dash.gguf",
    "/models/tab\there.gguf",
    "/models/ctrl \x01\x1b[31m\x7f \x85 \u2028 \ufeff.gguf",
    "/models/trailing blank.gguf ",
    "/models/#;.gguf",
    "\\\\server\\share\\a.gguf",
]
# model names (GGUF general.name, a file stem): the same, plus what a folder or an INI section cannot be
HOSTILE_NAMES = ["a b", "it's \"q\"", "llama 🦙 模型", "two\nlines", "*", "[x]:q4_k_m", "#;=", "${PORT}",
                 "\x85\u2028\x01", "-", "..", "a\\"]
