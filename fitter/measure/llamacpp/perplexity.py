"""llama.cpp's own measure of output quality, run as its tool `llama-perplexity`: the KL divergence of a config's
next-token distributions from a reference's, and the perplexity, over a text (tools/perplexity, llama.cpp 0c1e570).

Two runs, as tools/perplexity/README.md documents them:
- the reference, `llama-perplexity -m MODEL -f TEXT -c N --kl-divergence-base BASE.kld` at llama.cpp's default f16 K
  and V: it tokenizes the text, scores it in chunks of N tokens (the second half of each) and saves the scored
  tokens' log-probabilities (perplexity.cpp `perplexity`: "_logits_", n_ctx, n_vocab, n_chunk, the chunks' tokens,
  then per chunk N - 1 - N/2 rows of nv = 2*((n_vocab+1)/2) + 4 uint16: a scale and a minimum as two floats and the
  quantized log-probabilities). Made once per model file, text, -c, --chunks, build and flags, kept in fitter's home
  (`quality/`), written under a temporary name and renamed once whole (`reference_logits`);
- a config, `llama-perplexity -m MODEL --kl-divergence-base BASE.kld --kl-divergence -ctk K -ctv V -c N` with the
  config's own flags: it reads the reference's tokens from the file (not the text) and prints its statistics
  (perplexity.cpp `kl_divergence`), parsed into a QualityMeasure (`measure_quality`).

llama.cpp's ± are standard errors: `mean_and_uncertainty` in kl_divergence gives sqrt((E[x²] - E[x]²) / (n - 1))
(0 with 10 tokens or fewer), "Same top p" gives the binomial sqrt(p(1 - p) / (n - 1)), and PPL's is propagated from
the mean log-probability's (ppl × its standard error). A 95 % interval is therefore mean ± 1.96 × ±
(QualityMeasure.kld_interval95). llama.cpp prints the KLD figures with 6 decimals (%10.6lf), PPL's with 6 and the
percentages with 3: what is parsed is what it printed.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
import shlex
import struct
import subprocess
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from functools import lru_cache
from pathlib import Path
from statistics import NormalDist
from typing import Any

from fitter import process
from fitter.errors import FitterError
from fitter.measure.llamacpp.fit_params import fit_env
from fitter.paths import fitter_home, safe_name, write_atomic

__all__ = [
    "MIN_SCORED_TOKENS",
    "REFERENCE_KV",
    "TOOL",
    "UNQUANTIZED",
    "Z95",
    "KldHeader",
    "QualityError",
    "QualityMeasure",
    "Reference",
    "check_kv",
    "check_scored",
    "check_text_length",
    "config_argv",
    "kv_types_of",
    "measure_quality",
    "parse_kv_types",
    "parse_quality",
    "read_kld_header",
    "reference_argv",
    "reference_logits",
    "scored_tokens",
    "tool_build",
]

TOOL = "llama-perplexity"
REFERENCE_KV = ("f16", "f16")  # llama.cpp's default K and V cache types (common/common.h cache_type_k/v)
MIN_SCORED_TOKENS = 100  # perplexity.cpp kl_divergence: `if (kld.count < 100) return;` prints no statistics below
Z95 = NormalDist().inv_cdf(0.975)  # 1.959964: a 95 % interval is mean ± Z95 standard errors
ATTEMPTS = 3  # runs of a config whose log lost its statistics (see `measure_quality`) before it counts as failed
LOG_TAIL_LINES = 15  # the tool's last lines quoted in a QualityError
# the tool's log without prefixes, timestamps or colours (common/arg.cpp), so each statistic is a line of its own
LOG_FLAGS = ("--no-log-prefix", "--no-log-timestamps", "--log-colors", "off")
UNQUANTIZED = ("f32", "f16", "bf16")  # the KV types ggml_is_quantized calls not quantized (ggml.c type_traits)
_MAGIC = b"_logits_"  # perplexity.cpp perplexity / kl_divergence: the logits file's first 8 bytes


class QualityError(FitterError):
    """llama-perplexity did not measure: it refused the input, crashed, or printed no statistics."""

    quotes_output = True  # the tool's own log lines


@dataclass(frozen=True)
class KldHeader:
    """The head of a reference logits file (perplexity.cpp perplexity: written before the log-probabilities)."""

    n_ctx: int
    n_vocab: int
    n_chunk: int

    @property
    def size(self) -> int:
        """The whole file's bytes: the head, the chunks' tokens (int32), and per chunk its scored rows of nv uint16."""
        nv = 2 * ((self.n_vocab + 1) // 2) + 4
        return len(_MAGIC) + 12 + 4 * self.n_ctx * self.n_chunk + 2 * self.n_chunk * scored_per_chunk(self.n_ctx) * nv


def scored_per_chunk(n_ctx: int) -> int:
    """Tokens scored in a chunk of n_ctx: the second half's, less the last (perplexity.cpp: first = n_ctx/2, and
    n_ctx - 1 - first of them)."""
    return n_ctx - 1 - n_ctx // 2


def scored_tokens(n_ctx: int, n_chunk: int) -> int:
    return n_chunk * scored_per_chunk(n_ctx)


def read_kld_header(path: Path) -> KldHeader:
    """The head of a logits file `--kl-divergence-base` wrote; QualityError when it is not one."""
    with path.open("rb") as f:
        head = f.read(len(_MAGIC) + 12)
    if len(head) < len(_MAGIC) + 12 or not head.startswith(_MAGIC):
        raise QualityError(f"{path}: not a llama-perplexity logits file (no {_MAGIC.decode()} head)")
    n_ctx, n_vocab, n_chunk = struct.unpack("<Iii", head[len(_MAGIC):])
    return KldHeader(n_ctx, n_vocab, n_chunk)


@dataclass(frozen=True)
class Reference:
    """A reference's logits file and what its run printed."""

    path: Path  # the .kld file (fitter's home, quality/)
    model: str
    text: str
    n_ctx: int
    n_vocab: int
    n_chunk: int
    tokens: int  # tokens scored: n_chunk × (n_ctx - 1 - n_ctx/2)
    ppl: float | None  # "Final estimate: PPL = %.4lf +/- %.5lf" (perplexity.cpp perplexity); None: its log lost it
    ppl_sem: float | None
    argv: tuple[str, ...]  # the run that made it (its temporary file name aside)
    seconds: float  # that run's wall time
    cached: bool  # True: this call found it made before (no run)


@dataclass(frozen=True)
class QualityMeasure:
    """One config's quality against a reference, as llama-perplexity printed it (kl_divergence's statistics)."""

    model: str
    reference_model: str
    cache_type_k: str
    cache_type_v: str
    flags: tuple[str, ...]  # the config's own flags (devices, threads, -fa, -b …) as the tool was given them
    n_ctx: int
    chunks: int
    tokens: int  # tokens scored: chunks × (n_ctx - 1 - n_ctx/2)
    kld_mean: float
    kld_sem: float  # llama.cpp's ±: a standard error
    kld_p99: float  # "99.0%   KLD"
    kld_median: float
    kld_max: float
    same_top_pct: float  # "Same top p": % of tokens whose most likely next token is the reference's
    same_top_sem_pct: float
    ppl: float  # Mean PPL(Q)
    ppl_sem: float
    ppl_base: float  # Mean PPL(base): the reference's, over the same tokens
    ppl_base_sem: float
    seconds: float  # the run's wall time (load included)

    @property
    def kld_interval95(self) -> tuple[float, float]:
        """mean ± 1.96 standard errors (llama.cpp's ± is one: see the module docstring)."""
        return self.kld_mean - Z95 * self.kld_sem, self.kld_mean + Z95 * self.kld_sem

    def to_json(self) -> dict[str, Any]:
        lo, hi = self.kld_interval95
        return {**asdict(self), "flags": list(self.flags), "kld_interval95": [lo, hi]}


# -- command lines (pure) -----------------------------------------------------------------------------------------


def reference_argv(tool: str | Path, model: str | Path, text: str | Path, n_ctx: int, base: str | Path,
                   flags: Sequence[str] = (), chunks: int | None = None) -> list[str]:
    """The reference's run: the text scored at f16 K and V (the default: no -ctk/-ctv), its logits saved to `base`
    (tools/perplexity/README.md)."""
    argv = [str(tool), "-m", str(model), "-f", str(text), "-c", str(n_ctx), "--kl-divergence-base", str(base)]
    return [*argv, *(["--chunks", str(chunks)] if chunks is not None else []), *flags, *LOG_FLAGS]


def config_argv(tool: str | Path, model: str | Path, base: str | Path, n_ctx: int, cache_type_k: str,
                cache_type_v: str, flash_attn: str | None = None, flags: Sequence[str] = ()) -> list[str]:
    """A config's run against the reference `base`: its K and V cache types, its flash attention (the tool's
    default, auto, when None) and its own flags (devices, threads, batch sizes); the tokens come from `base`."""
    fa = ["-fa", flash_attn] if flash_attn is not None else []
    return [str(tool), "-m", str(model), "--kl-divergence-base", str(base), "--kl-divergence", "-ctk", cache_type_k,
            "-ctv", cache_type_v, *fa, "-c", str(n_ctx), *flags, *LOG_FLAGS]


# -- parsing what the tool printed (pure) --------------------------------------------------------------------------

_NUM = r"([-+]?(?:\d+\.?\d*(?:[eE][-+]?\d+)?|nan|inf))"
# perplexity.cpp kl_divergence's LOG lines: (the line's label, the QualityMeasure fields, its pattern); the printf
# formats are "Mean PPL(Q)                   : %10.6lf ± %10.6lf", "Mean    KLD: %10.6lf ± %10.6lf",
# "Maximum KLD: %10.6f", "99.0%%   KLD: %10.6f", "Median  KLD: %10.6f" and "Same top p: %6.3lf ± %5.3lf %%"
_STATS = (
    ("Mean PPL(Q)", ("ppl", "ppl_sem"), rf"^Mean PPL\(Q\)\s+:\s+{_NUM} ± +{_NUM}$"),
    ("Mean PPL(base)", ("ppl_base", "ppl_base_sem"), rf"^Mean PPL\(base\)\s+:\s+{_NUM} ± +{_NUM}$"),
    ("Mean    KLD", ("kld_mean", "kld_sem"), rf"^Mean    KLD:\s+{_NUM} ± +{_NUM}$"),
    ("Maximum KLD", ("kld_max",), rf"^Maximum KLD:\s+{_NUM}$"),
    ("99.0%   KLD", ("kld_p99",), rf"^99\.0%   KLD:\s+{_NUM}$"),
    ("Median  KLD", ("kld_median",), rf"^Median  KLD:\s+{_NUM}$"),
    ("Same top p", ("same_top_pct", "same_top_sem_pct"), rf"^Same top p:\s+{_NUM} ± +{_NUM} %$"),
)
_CHUNKS = re.compile(r"^kl_divergence: computing over (\d+) chunks, n_ctx=(\d+), batch_size=(\d+), n_seq=(\d+)$",
                     re.M)
_FINAL = re.compile(rf"^Final estimate: PPL = {_NUM} \+/- {_NUM}$", re.M)
_TOO_SHORT = re.compile(r"you need at least (\d+) tokens to evaluate perplexity with a context of (\d+)")
_ONLY = re.compile(r"the data file you provided tokenizes to only (\d+) tokens")
_VOCAB = re.compile(r"inconsistent vocabulary \((\d+) vs (\d+)\)")  # kl_divergence: the file's, then the model's
# common/arg.cpp -ctk's help: "allowed values: f32, f16, …" then "(default: f16)", wrapped at the help's width
# kl_divergence's own refusals after it started (it returns, and the tool exits 0): not a lost log, no new attempt
_ERROR = re.compile(r"^kl_divergence ?: (?:failed|you must|.* does not look like|.* has been computed with)", re.M)
_KV_HELP = re.compile(r"^-ctk,\s+--cache-type-k TYPE.*?allowed values: (.*?)\(default", re.S | re.M)


def _tail(log: str) -> str:
    lines = [line for line in log.splitlines() if line.strip()]
    return "\n".join(lines[-LOG_TAIL_LINES:])


def parse_quality(log: str, model: str, reference_model: str, cache_type_k: str, cache_type_v: str,
                  flags: Sequence[str] = (), seconds: float = 0.0) -> QualityMeasure:
    """A QualityMeasure from a `--kl-divergence` run's log; QualityError, with the log's tail, when a statistic is
    missing (a failed run is never a zero)."""
    values: dict[str, float] = {}
    for label, fields, pattern in _STATS:
        m = re.search(pattern, log, re.M)
        if m is None:
            raise QualityError(f"llama-perplexity printed no '{label}' line for {model} (-ctk {cache_type_k} -ctv "
                               f"{cache_type_v}); its log ends:\n" + _tail(log))
        values.update(zip(fields, map(float, m.groups()), strict=True))
    chunks = _CHUNKS.search(log)
    if chunks is None:
        raise QualityError(f"llama-perplexity printed no 'kl_divergence: computing over' line for {model}; its log "
                           "ends:\n" + _tail(log))
    n_chunk, n_ctx = int(chunks.group(1)), int(chunks.group(2))
    return QualityMeasure(model=model, reference_model=reference_model, cache_type_k=cache_type_k,
                          cache_type_v=cache_type_v, flags=tuple(flags), n_ctx=n_ctx, chunks=n_chunk,
                          tokens=scored_tokens(n_ctx, n_chunk), seconds=round(seconds, 3), **values)


def parse_kv_types(help_text: str) -> tuple[str, ...]:
    """The KV cache types a build accepts, from its `--help` (common/arg.cpp `kv_cache_types`, listed in -ctk's
    help as "allowed values: f32, f16, …"); () when the help lists none."""
    m = _KV_HELP.search(help_text)
    return tuple(t.strip() for t in m.group(1).replace("\n", " ").split(",") if t.strip()) if m else ()


# -- running the tool ----------------------------------------------------------------------------------------------


@lru_cache(maxsize=8)
def kv_types_of(tool: str) -> tuple[str, ...]:
    """The KV cache types the build of `tool` accepts (its own --help); QualityError when it lists none."""
    rc, log = _run([tool, "--help"], timeout=60.0)
    types = parse_kv_types(log)
    if not types:
        raise QualityError(f"{tool} --help lists no KV cache types (exit status {rc}); its output ends:\n" + _tail(log))
    return types


def _run(argv: Sequence[str], timeout: float | None) -> tuple[int, str]:
    """Run the tool to its end: (exit status, stdout and stderr). Past `timeout` its group is killed (QualityError)."""
    proc = process.spawn(argv, env=fit_env(os.environ), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill_group(proc)
        out, _ = proc.communicate()
        raise QualityError(f"`{shlex.join(argv)}` ran past {timeout:g} s; its log ends:\n"
                           + _tail(out.decode(errors="replace"))) from None
    process.unregister(proc.pid)
    return proc.returncode, out.decode(errors="replace")


def _text_too_short(text: Path, n_ctx: int, log: str, model: str) -> QualityError | None:
    """llama.cpp's own refusal of a text shorter than two chunks (perplexity.cpp perplexity), in fitter's words."""
    need = _TOO_SHORT.search(log)
    if need is None:
        return None
    only = _ONLY.search(log)
    count = f"tokenizes to {only.group(1)} tokens" if only else "tokenizes to fewer tokens"
    return QualityError(f"{text}: {count} with {model}; -c {n_ctx} needs at least {need.group(1)} (llama-perplexity "
                        "scores chunks of -c tokens and needs two: tools/perplexity/perplexity.cpp); give a longer "
                        "text or a smaller -c")


def check_text_length(text: Path, n_ctx: int) -> None:
    """Refuse, before anything runs, a text too short for two chunks whatever the tokenizer: a token holds at least
    one byte, and llama.cpp adds at most a BOS and a space prefix. The exact count is the tool's (its refusal is
    translated when it comes)."""
    size = text.stat().st_size
    if size + 2 < 2 * n_ctx:
        raise QualityError(f"{text}: {size} bytes cannot make the {2 * n_ctx} tokens llama-perplexity needs at -c "
                           f"{n_ctx} (two chunks of -c tokens; a token holds at least one byte); give a longer text "
                           "or a smaller -c")


def _key(model: Path, text: Path, n_ctx: int, chunks: int | None, build: dict[str, Any], flags: Sequence[str],
         identity: str) -> str:
    st = model.stat()
    what = {"model": str(model.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns, "header": identity,
            "text": hashlib.sha256(text.read_bytes()).hexdigest(), "n_ctx": n_ctx, "chunks": chunks, "build": build,
            "flags": list(flags), "kv": list(REFERENCE_KV)}
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:16]


def tool_build(tool: str | Path) -> dict[str, Any]:
    """What keys a reference to the build that made it: the commit the tool reports (`--version`), the backends
    beside it and its folder (fitter.measure.llamacpp.builds)."""
    from fitter.measure.llamacpp.builds import library_backends, server_build

    path = Path(tool).resolve()
    return {"commit": server_build(str(path)).get("commit", "unknown"),
            "backends": sorted(library_backends(path.parent)), "folder": str(path.parent)}


def reference_logits(tool: str | Path, model: str | Path, text: str | Path, n_ctx: int, flags: Sequence[str] = (),
                     chunks: int | None = None, identity: str = "", timeout: float | None = None) -> Reference:
    """The reference logits of `model` over `text` at -c `n_ctx` (f16 K and V, -fa auto: no -ctk/-ctv/-fa in
    `flags`), made once and kept in fitter's home.

    The key: the model file (path, size, mtime, its header's `identity`), the text's bytes, -c, --chunks, the build
    (`tool_build`) and `flags` as given (threads included: leave out what should share one reference). A cached file
    counts only whole (its size is the one its head implies); a run writes a temporary file and renames it whole, so
    an interrupted run leaves none."""
    model_p, text_p = Path(model), Path(text)
    check_text_length(text_p, n_ctx)
    folder = fitter_home() / "quality"
    key = _key(model_p, text_p, n_ctx, chunks, tool_build(tool), flags, identity)
    stem = f"{safe_name(model_p.stem, limit=60)}-c{n_ctx}-{key}"
    path, meta = folder / f"{stem}.kld", folder / f"{stem}.json"
    cached = _cached(path, meta)
    if cached is not None:
        return cached
    folder.mkdir(parents=True, exist_ok=True)
    part = folder / f".{stem}.{secrets.token_hex(4)}.part"
    argv = reference_argv(tool, model, text, n_ctx, part, flags, chunks)
    try:
        for attempt in range(1, ATTEMPTS + 1):
            t0 = time.perf_counter()
            rc, log = _run(argv, timeout)
            seconds = time.perf_counter() - t0
            # a text too short whose count the log lost (see `measure_quality`): run it again for llama.cpp's count
            if attempt < ATTEMPTS and _TOO_SHORT.search(log) is None and _short_file(part, rc):
                continue
            break
        head = _reference_head(part, rc, log, argv, text_p, n_ctx, str(model))
        os.replace(part, path)
    finally:
        part.unlink(missing_ok=True)
    final = _FINAL.search(log)  # llama-perplexity's log can lose its last lines (see `measure_quality`): then no PPL
    ref = Reference(path=path, model=str(model), text=str(text), n_ctx=head.n_ctx, n_vocab=head.n_vocab,
                    n_chunk=head.n_chunk, tokens=scored_tokens(head.n_ctx, head.n_chunk),
                    ppl=float(final.group(1)) if final else None, ppl_sem=float(final.group(2)) if final else None,
                    argv=tuple(str(path) if a == str(part) else a for a in argv), seconds=round(seconds, 3),
                    cached=False)
    write_atomic(meta, json.dumps({**asdict(ref), "path": str(path), "argv": list(ref.argv), "size": head.size},
                                  indent=1) + "\n")
    return ref


def _short_file(part: Path, rc: int) -> bool:
    """The file `perplexity` leaves on a text too short: the magic and n_ctx only (perplexity.cpp)."""
    return rc == 0 and part.is_file() and part.stat().st_size == len(_MAGIC) + 4


def _reference_head(part: Path, rc: int, log: str, argv: Sequence[str], text: Path, n_ctx: int,
                    model: str) -> KldHeader:
    """The head of the logits file a reference run wrote, once it is whole; QualityError otherwise. A text too short
    is told by the tool's error or, where its log lost that line, by the file it left: `perplexity` writes the magic
    and n_ctx, then returns on the short text before n_vocab and n_chunk (perplexity.cpp)."""
    short = _text_too_short(text, n_ctx, log, model)
    if short is None and _short_file(part, rc):
        short = QualityError(f"{text}: it tokenizes to fewer than the {2 * n_ctx} tokens -c {n_ctx} needs with "
                             f"{model} (llama-perplexity scores chunks of -c tokens and needs two: "
                             "tools/perplexity/perplexity.cpp); give a longer text or a smaller -c")
    if short is not None:
        raise short
    if rc != 0 or not part.is_file():
        raise QualityError(f"the reference run `{shlex.join(argv)}` failed (exit status {rc}); its log ends:\n"
                           + _tail(log))
    head = read_kld_header(part)
    if part.stat().st_size != head.size:
        raise QualityError(f"the reference run `{shlex.join(argv)}` wrote {part.stat().st_size} bytes, not the "
                           f"{head.size} its head implies; its log ends:\n" + _tail(log))
    return head


def _cached(path: Path, meta: Path) -> Reference | None:
    """The reference made before, when its logits file is there whole and its record reads."""
    try:
        doc = json.loads(meta.read_text())
        if not path.is_file() or path.stat().st_size != doc["size"]:
            return None
        doc.pop("size")
        return Reference(**{**doc, "path": path, "argv": tuple(doc["argv"]), "cached": True})
    except (OSError, ValueError, KeyError, TypeError):
        return None


def check_kv(tool: str | Path, cache_type_k: str, cache_type_v: str, flash_attn: str | None) -> None:
    """Refuse, before anything runs, a KV cache type the build does not take (its own list: common/arg.cpp
    `kv_cache_types`, read from its --help) and a quantized V cache without flash attention (src/llama-context.cpp
    llama_init_from_model: "quantized V cache requires flash_attn to be enabled"; -fa auto turns it on)."""
    allowed = kv_types_of(str(tool))
    for flag, t in (("-ctk", cache_type_k), ("-ctv", cache_type_v)):
        if t not in allowed:
            raise QualityError(f"{flag} {t}: not a KV cache type of the build of {tool}; it takes {', '.join(allowed)}")
    if flash_attn == "off" and cache_type_v not in UNQUANTIZED:
        raise QualityError(f"-ctv {cache_type_v} with -fa off: a quantized V cache needs flash attention (llama.cpp "
                           "refuses it: src/llama-context.cpp llama_init_from_model); give -fa on or auto")


def measure_quality(tool: str | Path, model: str | Path, ref: Reference, cache_type_k: str, cache_type_v: str,
            flash_attn: str | None = None, flags: Sequence[str] = (), n_vocab: int | None = None,
            timeout: float | None = None) -> QualityMeasure:
    """`model`'s quality with a K and V cache of these types, flash attention `flash_attn` (None: the tool's
    default, auto) and its `flags` (devices, threads, batch sizes), against `ref`. The types, and `n_vocab` (the
    model's, from its header) against the reference's, are checked before anything starts."""
    check_kv(tool, cache_type_k, cache_type_v, flash_attn)
    if n_vocab is not None and n_vocab != ref.n_vocab:
        raise QualityError(f"{model}: its vocabulary has {n_vocab} tokens, the reference's ({ref.model}) "
                           f"{ref.n_vocab}: KL divergence compares the same tokens' probabilities; give files of one "
                           "model")
    check_scored(ref)
    argv = config_argv(tool, model, ref.path, ref.n_ctx, cache_type_k, cache_type_v, flash_attn, flags)
    measured_flags = [*(["-fa", flash_attn] if flash_attn is not None else []), *flags]
    attempt = 0
    while True:
        attempt += 1
        t0 = time.perf_counter()
        rc, log = _run(argv, timeout)
        seconds = time.perf_counter() - t0
        vocab = _VOCAB.search(log)
        if vocab is not None:  # kl_divergence logs it and goes on: a mismatch is refused here
            raise QualityError(f"{model}: its vocabulary has {vocab.group(2)} tokens, the reference's ({ref.model}) "
                               f"{vocab.group(1)} (llama-perplexity: inconsistent vocabulary); give files of one model")
        if rc != 0:
            raise QualityError(f"`{shlex.join(argv)}` failed (exit status {rc}); its log ends:\n" + _tail(log))
        try:
            return parse_quality(log, str(model), ref.model, cache_type_k, cache_type_v, measured_flags, seconds)
        except QualityError:
            # llama-perplexity returns from main without common_log_flush, and common/log.cpp's worker thread then
            # loses what it had not written yet ("logs may be lost if not flushed before the program exits"): on a
            # busy machine the statistics themselves. The run itself was whole: run it again.
            if attempt == ATTEMPTS or _ERROR.search(log):
                raise


def check_scored(ref: Reference) -> None:
    """Refuse a reference whose chunks score fewer tokens than llama-perplexity prints KL statistics for."""
    if ref.tokens < MIN_SCORED_TOKENS:
        raise QualityError(f"{ref.text} at -c {ref.n_ctx}: {ref.n_chunk} chunks score {ref.tokens} tokens; "
                           f"llama-perplexity prints its KL divergence from {MIN_SCORED_TOKENS} "
                           "(tools/perplexity/perplexity.cpp kl_divergence): give a longer text or a larger -c")
