"""The work a machine will serve, as a trial measures it: prompt and generation lengths, the depths of context
decode and prefill run at, and the streams served at once.

A workload comes from the command line (`-p`, `-n`, `-d 0,32768`, `--concurrency N`) or a TOML file
(`--workload FILE`, or the name of one shipped in workloads/); the default is today's single test: -p 512 -n 128 at
depth 0, one stream. How depths weigh: `weights` are the shares of the workload's tokens served at each depth, so
its speed is its tokens over the time they take, Σw / Σ(w_d / speed_d) (a weighted harmonic mean), for prefill and
decode alike. `min_ctx` (`--min-ctx N`) makes the context a trade instead of a given: tune searches `-c` from N up
(`context_choices`) with the context as a Pareto axis beside speed and VRAM. Nothing here measures;
fitter.measure.served runs a workload through any runner.
"""

from __future__ import annotations

import math
import re
import tomllib
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from fitter.errors import FitterError
from fitter.flags import LaunchConfig, resolve_context, validate
from fitter.paths import SOURCE_ROOT
from fitter.workload.prompts import Prompts, read_prompts

INT_MAX = 2**31 - 1  # llama-bench reads -p -n -d as C ints
_KEYS = {"description", "prompt", "gen", "depths", "weights", "concurrency", "min_ctx", "prompts", "images",
         "image_tokens"}
MAX_CONTEXT_CHOICES = 8  # multiples of --min-ctx up to this many, else doublings: a search a dozen trials can cover
_RANGE = re.compile(r"(\d+)(?:-(\d+)(?:([+*])(\d+))?)?")


class WorkloadError(FitterError):
    """A workload file or flag that does not describe a workload."""


@dataclass(frozen=True)
class Workload:
    n_prompt: int = 512
    n_gen: int = 128
    depths: tuple[int, ...] = (0,)
    weights: tuple[float, ...] = ()  # share of the tokens served at each depth (any scale); () = equal shares
    concurrency: int = 1  # streams served at once: that many concurrent requests, one llama-server slot each
    source: str = "flags"  # "flags", a file path, or "shipped:<name>"
    description: str = ""
    min_ctx: int = 0  # > 0: tune searches -c >= this (context as a trade, a Pareto axis); 0: -c as given
    prompts: Prompts | None = None  # the user's text decode runs on (fitter.workload.prompts); None: synthetic tokens
    # Images per request (a vision projector's, --mmproj): each takes `image_tokens` context cells, decoded by the
    # model as one prefill of embeddings (tools/mtmd mtmd_helper_eval_chunks); `with_images` folds them into the
    # prompt once the projector says how many (0: not yet resolved)
    images: int = 0
    image_tokens: int = 0

    def __post_init__(self) -> None:
        where = self.source
        if not self.weights:
            object.__setattr__(self, "weights", (1.0,) * len(self.depths))
        if min(self.n_prompt, self.n_gen) < 0 or max(self.n_prompt, self.n_gen) > INT_MAX:
            raise WorkloadError(f"{where}: prompt {self.n_prompt} and gen {self.n_gen} must be 0..{INT_MAX}")
        if not self.n_prompt and not self.n_gen:
            raise WorkloadError(f"{where}: prompt and gen are both 0: nothing to measure")
        if not self.depths or any(d < 0 or d > INT_MAX for d in self.depths) or len(set(self.depths)) != \
                len(self.depths):
            raise WorkloadError(f"{where}: depths {list(self.depths)} must be distinct counts 0..{INT_MAX}")
        if len(self.weights) != len(self.depths) or any(not math.isfinite(w) or w <= 0 for w in self.weights):
            raise WorkloadError(f"{where}: weights {list(self.weights)} must be one positive number per depth "
                                f"({len(self.depths)})")
        if not 1 <= self.concurrency <= 256:
            raise WorkloadError(f"{where}: concurrency {self.concurrency} must be 1..256 streams")
        if not 0 <= self.min_ctx <= INT_MAX:
            raise WorkloadError(f"{where}: min_ctx {self.min_ctx} must be a context of 1..{INT_MAX} cells (or 0: "
                                "-c as given)")
        if self.prompts is not None and not self.is_default_shape:
            raise WorkloadError(f"{where}: prompts {self.prompts.file} are decoded from their own text, in one "
                                "stream: drop the depth list and the concurrency")
        if not 0 <= self.images <= 64 or self.image_tokens < 0:
            raise WorkloadError(f"{where}: images {self.images} must be 0..64 per request")
        if self.prompts is not None and not self.n_gen:
            raise WorkloadError(f"{where}: prompts {self.prompts.file} with gen 0: nothing is decoded from them")

    @property
    def is_default_shape(self) -> bool:
        """One depth and one stream: what fitter measured before workloads (a single llama-bench test)."""
        return len(self.depths) == 1 and self.concurrency == 1

    def tokens_per_stream(self) -> int:
        """The cells one stream's deepest test needs: the depth, then its prompt or its generation (llama-bench's
        tests each start from the depth)."""
        return max(self.depths) + max(self.n_prompt, self.n_gen)

    def share(self, depth: int) -> float:
        """The normalised weight of `depth`."""
        return self.weights[self.depths.index(depth)] / sum(self.weights)

    def label(self) -> str:
        """Short, for tables and logs: `-p 512 -n 128 -d 0,32768 (weights 1,3) ×4 streams`."""
        text = f"-p {self.n_prompt} -n {self.n_gen} -d {','.join(map(str, self.depths))}"
        if len(set(self.weights)) > 1:
            text += f" (weights {','.join(f'{w:g}' for w in self.weights)})"
        if self.concurrency > 1:
            text += f" ×{self.concurrency} streams"
        if self.min_ctx:
            text += f", -c >= {self.min_ctx}"
        if self.prompts is not None:
            text += f", decode on {len(self.prompts.texts)} prompts of {self.prompts.file}"
        if self.images:
            text += f" (the prompt holds {self.images} image{'s' if self.images > 1 else ''} of {self.image_tokens} "
            text += "tokens)"
        return text

    def to_json(self) -> dict[str, Any]:
        out = {"prompt": self.n_prompt, "gen": self.n_gen, "depths": list(self.depths),
               "weights": list(self.weights), "concurrency": self.concurrency, "source": self.source,
               "description": self.description}
        if self.min_ctx:
            out["min_ctx"] = self.min_ctx
        if self.prompts is not None:
            out["prompts"] = self.prompts.to_json()
        if self.images:
            out.update(images=self.images, image_tokens=self.image_tokens)
        return out

    @staticmethod
    def from_json(data: Any, where: str) -> Workload:
        """A workload as pareto.json or a measurement records it."""
        if not isinstance(data, dict):
            raise WorkloadError(f"{where}: \"workload\" must be a table, got {type(data).__name__}")
        body = {k: v for k, v in data.items() if k != "source"}
        return parse_workload(body, str(data.get("source") or where))


def prompts_problem(w: Workload, backend: str) -> str | None:
    """Why `backend` cannot decode on the workload's prompts, or None: llama-server takes text; llama-bench, fitter's
    worker and a simulated machine take token counts."""
    if w.prompts is None or backend == "llama-server":
        return None
    return (f"--prompts {w.prompts.file}: {backend} measures synthetic tokens, not text; decode on your prompts runs "
            "through llama-server (--llama-cpp DIR)")


def measure_problem(w: Workload, config: LaunchConfig, backend: str) -> str | None:
    """What keeps `backend` from measuring `config` under `w` (prompts it cannot send, a draft it cannot load or a
    speculation without text), or None."""
    from fitter.flags.draft import measuring_problem

    return prompts_problem(w, backend) or measuring_problem(config, backend,
                                                             w.prompts.file if w.prompts is not None else None)


def with_images(w: Workload, tokens_per_image: int | None) -> Workload:
    """`w` with its images' tokens in each prompt (`tokens_per_image`: the projector's, fitter.gguf.projector;
    None: no --mmproj, refused). Resolved once: a recorded workload keeps its prompt as measured."""
    if not w.images or w.image_tokens:
        return w
    if tokens_per_image is None:
        raise WorkloadError(f"{w.source}: images {w.images} per request need a vision projector: give --mmproj FILE")
    from dataclasses import replace

    return replace(w, n_prompt=w.n_prompt + w.images * tokens_per_image, image_tokens=tokens_per_image)


def serving_config(w: Workload, config: LaunchConfig) -> LaunchConfig:
    """`config` able to serve `w`: `-np N` added for N streams where no -np was given (a slot per stream, each
    with its own KV stream, as an explicit -np makes them); fewer slots than streams is refused."""
    if w.concurrency == 1:
        return config
    if "parallel" not in config.given:
        return _checked(config.with_given(parallel=w.concurrency))
    if config.n_seq_max < w.concurrency:
        raise WorkloadError(f"{w.source}: concurrency {w.concurrency} needs a slot per stream, but -np "
                            f"{config.parallel} serves {config.n_seq_max}")
    return config


def searched_context(w: Workload, config: LaunchConfig) -> LaunchConfig:
    """`config` at the smallest context `w` accepts (`-c min_ctx`, the baseline's and the search's first), where
    the workload searches the context; a -c given beside it is refused (it would fix what is searched)."""
    if not w.min_ctx:
        return config
    if "ctx_size" in config.given:
        raise WorkloadError(f"{w.source}: min_ctx {w.min_ctx} searches the context, and -c {config.ctx_size} fixes "
                            "it: give one or the other")
    return _checked(config.with_given(ctx_size=w.min_ctx))


def _checked(config: LaunchConfig) -> LaunchConfig:
    validate(config)  # as llama.cpp checks the flags before it loads
    return config


def context_problem(w: Workload, config: LaunchConfig, n_ctx_train: int) -> str | None:
    """Why `config`'s context cannot hold the workload's deepest test in every stream at once, or None."""
    ctx = resolve_context(config, n_ctx_train)
    need = w.tokens_per_stream()
    if need > ctx.n_ctx_seq:
        return (f"{w.source}: depth {max(w.depths)} + max(prompt {w.n_prompt}, gen {w.n_gen}) = {need} cells, but a "
                f"slot of -c {config.ctx_size or n_ctx_train} holds {ctx.n_ctx_seq}; give a larger -c")
    if ctx.n_stream == 1 and w.concurrency * need > ctx.n_ctx:
        return (f"{w.source}: {w.concurrency} streams of {need} cells share the unified KV cache of {ctx.n_ctx} "
                "cells; give a larger -c")
    return None


def context_choices(min_ctx: int, n_ctx_train: int) -> tuple[int, ...]:
    """The contexts `--min-ctx N` searches: N, 2N, 3N, … up to the training context when that is at most
    MAX_CONTEXT_CHOICES of them (so the table reads as the cost of each extra N), else N, 2N, 4N, …; the training
    context last either way (llama.cpp serves no more without rope scaling)."""
    if min_ctx > n_ctx_train:
        raise WorkloadError(f"--min-ctx {min_ctx}: more than the model's training context ({n_ctx_train})")
    if n_ctx_train // min_ctx <= MAX_CONTEXT_CHOICES:
        out = list(range(min_ctx, n_ctx_train + 1, min_ctx))
    else:
        out = [min_ctx << k for k in range((n_ctx_train // min_ctx).bit_length())]
    return tuple(out) if out[-1] == n_ctx_train else (*out, n_ctx_train)


def combined_rate(rates: list[float], weights: list[float]) -> float:
    """A workload's speed over its depths: its tokens over their time, Σw / Σ(w / rate)."""
    return sum(weights) / sum(w / r for w, r in zip(weights, rates, strict=True))


def parse_depths(text: str, flag: str = "-d") -> tuple[int, ...]:
    """llama-bench's int list: `first[-last[(+|*)step]]`, comma separated (tools/llama-bench/llama-bench.cpp
    parse_int_range): `0,32768`, `0-32768+8192`, `512-8192*2`."""
    out: list[int] = []
    for part in text.split(","):
        m = _RANGE.fullmatch(part.strip())
        if m is None:
            raise WorkloadError(f"{flag} {text!r}: {part!r} is not N or first-last[+|*step] (llama-bench's syntax)")
        first = int(m.group(1))
        last = int(m.group(2)) if m.group(2) else first
        op, step = m.group(3) or "+", int(m.group(4) or 1)
        i = first
        while i <= last:
            out.append(i)
            nxt = i + step if op == "+" else i * step
            if nxt <= i:
                raise WorkloadError(f"{flag} {text!r}: the range {part!r} does not grow (llama-bench: invalid range)")
            i = nxt
    if len(set(out)) != len(out):
        raise WorkloadError(f"{flag} {text!r}: a depth is given twice")
    return tuple(out)


def parse_workload(data: dict[str, Any], where: str) -> Workload:
    """A workload table (a TOML file's top level, or pareto.json's record), checked key by key."""
    unknown = sorted(set(data) - _KEYS)
    if unknown:
        raise WorkloadError(f"{where}: unknown key {unknown[0]!r} (a workload has {', '.join(sorted(_KEYS))})")

    def count(key: str, default: int) -> int:
        value = data.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int):
            raise WorkloadError(f"{where}: {key} = {value!r} must be a whole number")
        return value

    depths = data.get("depths", [0])
    if isinstance(depths, str):
        depths = list(parse_depths(depths, f"{where}: depths"))
    if not isinstance(depths, list) or any(isinstance(d, bool) or not isinstance(d, int) for d in depths):
        raise WorkloadError(f"{where}: depths = {depths!r} must be a list of whole numbers or llama-bench's "
                            "'0,32768' syntax")
    weights = data.get("weights", [1.0] * len(depths))
    if not isinstance(weights, list) or any(isinstance(w, bool) or not isinstance(w, (int, float)) for w in weights):
        raise WorkloadError(f"{where}: weights = {weights!r} must be a list of numbers, one per depth")
    description = data.get("description", "")
    if not isinstance(description, str):
        raise WorkloadError(f"{where}: description = {description!r} must be a string")
    return Workload(n_prompt=count("prompt", 512), n_gen=count("gen", 128), depths=tuple(depths),
                    weights=tuple(float(w) for w in weights), concurrency=count("concurrency", 1), source=where,
                    description=description, min_ctx=count("min_ctx", 0), prompts=_prompts(data, where),
                    images=count("images", 0), image_tokens=count("image_tokens", 0))


def _prompts(data: dict[str, Any], where: str) -> Prompts | None:
    """A file's `prompts = "FILE"` (relative to the workload file), or a result's record of them."""
    value = data.get("prompts")
    if value is None:
        return None
    if isinstance(value, dict):
        return Prompts.from_json(value, where)
    if not isinstance(value, str) or not value:
        raise WorkloadError(f"{where}: prompts = {value!r} must be the path of a prompts file")
    path = Path(value)
    if not path.is_absolute() and Path(where).is_file():  # beside the workload file that names it
        path = Path(where).parent / path
    return read_prompts(str(path))


def shipped_workload_names() -> tuple[str, ...]:
    return tuple(sorted(p.stem for p in _shipped_folder().glob("*.toml")))


def load_workload(name_or_path: str) -> Workload:
    """`--workload FILE`, or the name of a shipped workload (workloads/NAME.toml)."""
    path = Path(name_or_path)
    shipped = _shipped_folder() / f"{name_or_path}.toml"
    if not path.exists() and "/" not in name_or_path and shipped.is_file():
        path, where = shipped, f"shipped:{name_or_path}"
    else:
        where = str(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise WorkloadError(f"--workload {name_or_path}: no such file, and no shipped workload of that name "
                            f"(shipped: {', '.join(shipped_workload_names())})") from None
    except (OSError, UnicodeDecodeError) as e:
        raise WorkloadError(f"{path}: cannot read the workload: {getattr(e, 'strerror', None) or e}") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise WorkloadError(f"{path}: not TOML: {e}") from None
    return parse_workload(data, where)


def _shipped_folder() -> Path:
    # a wheel holds the folder as fitter/workloads (pyproject force-include); an editable install imports fitter from
    # the repository, where it is the top-level workloads/ beside the package (as search_spaces/)
    packaged = Path(str(resources.files("fitter"))) / "workloads"
    return packaged if packaged.is_dir() else SOURCE_ROOT / "workloads"
