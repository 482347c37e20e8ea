"""`fitter quality`: what each KV cache type (and each file of a model) costs in output quality, measured by the
build's own llama-perplexity on this machine's devices (fitter.measure.quality)."""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path
from typing import Any

from fitter.cli.common import add_llama_cpp, launch_args, log
from fitter.errors import FitterError
from fitter.flags import add_launch_arguments, add_process_arguments, pin
from fitter.flags.config import DRAFT_FIELDS
from fitter.flags.vocabulary import names_of

DEFAULT_N_CTX = 512  # llama-perplexity's own -c (tools/perplexity/perplexity.cpp: params.n_ctx = 512)
# llama.cpp flags passed to every run as given: where the model runs and how it is batched
PASSED = ("batch_size", "ubatch_size", "n_gpu_layers", "overrides", "kv_unified", "swa_full", "no_kv_offload",
          "no_op_offload", "no_repack", "load_mode", "fit", "tensor_split", "main_gpu", "split_mode", "rpc",
          "device_names")
# llama-server flags llama-perplexity rejects ("invalid argument": common/arg.cpp registers them for other tools) or
# overrides (-np: perplexity.cpp sets n_parallel = n_batch / n_ctx itself), by field, with why
REFUSED = {"parallel": "llama-perplexity runs -b / -c sequences at once itself (perplexity.cpp: n_parallel)",
           "cache_ram_mib": "llama-server's prompt cache is no part of llama-perplexity",
           "draft_model": "llama-perplexity loads no draft model", "mmproj": "llama-perplexity loads no projector",
           "mmproj_device": "llama-perplexity loads no projector"}


def _tool(ns: argparse.Namespace) -> Path:
    """The llama-perplexity of `--llama-cpp DIR`, else the pinned tools' (fitter.measure.llamacpp.tools)."""
    if ns.llama_cpp:
        from fitter.measure.llamacpp.builds import find_build

        return find_build(ns.llama_cpp).perplexity_tool()
    from fitter.measure.llamacpp.tools import tools_dir

    tool = tools_dir() / "llama-perplexity"
    if not tool.is_file():
        raise FitterError(f"llama-perplexity is not built in {tool.parent}: run `python -m fitter.measure.llamacpp."
                          "tools` (a few minutes once), or give a build with --llama-cpp DIR")
    return tool


def _refuse(given: frozenset[str]) -> None:
    for field in sorted(given):
        why = REFUSED.get(field) or ("llama-perplexity loads no draft model" if field in DRAFT_FIELDS else None)
        if why is not None:
            raise FitterError(f"{names_of(field)[0]}: {why}; drop it for fitter quality")


def cmd_quality(ns: argparse.Namespace) -> int:
    from fitter.gguf.demo_models import demo_model_path
    from fitter.measure.quality import SHIPPED_TEXT, kv_pairs, model_file, quality_table, render_quality

    config, process = launch_args(ns)
    _refuse(config.given)
    n_ctx = config.ctx_size if "ctx_size" in config.given else DEFAULT_N_CTX
    if n_ctx < 1:
        raise FitterError(f"-c {n_ctx}: llama-perplexity scores chunks of -c tokens; give -c 1 or more (default "
                          f"{DEFAULT_N_CTX})")
    if ns.chunks is not None and ns.chunks < 2:
        raise FitterError(f"--chunks {ns.chunks}: llama-perplexity needs at least 2 chunks of -c tokens")
    paths = ns.models or [str(demo_model_path())]
    missing = [p for p in paths if not Path(p).is_file()]
    if missing:
        raise FitterError(f"{missing[0]}: no such model file")
    text = Path(ns.quality_text) if ns.quality_text else SHIPPED_TEXT
    if not text.is_file():
        raise FitterError(f"--quality-text {text}: no such file")
    flash_attn = config.flash_attn if "flash_attn" in config.given else None
    typed = {"cache_type_k", "cache_type_v"} & config.given
    if typed and ns.kv_types:
        raise FitterError(f"--kv-types {ns.kv_types} and -ctk/-ctv: give the types one way")
    tool = _tool(ns)
    from fitter.measure.llamacpp.perplexity import kv_types_of

    if typed:
        pairs = [(config.cache_type_k, config.cache_type_v)]
    else:  # one file: every type the build takes; several: the files at f16 unless told
        pairs = kv_pairs(ns.kv_types or ("all" if len(paths) == 1 else "f16"), kv_types_of(str(tool)), flash_attn)
    flags = [*pin(replace(config, given=config.given & set(PASSED)), given=True), *process.flags()]
    table = quality_table(tool, [model_file(p) for p in paths], text, n_ctx, pairs, flash_attn, flags, flags,
                          ns.chunks, ns.reference, ns.timeout, log)
    print(json.dumps(table.to_json(), indent=1) if ns.json else render_quality(table))
    return 0


def register(sub: Any) -> None:
    q = sub.add_parser(
        "quality",
        help="measure what each KV cache type (or each file of a model) costs in output quality",
        description="The KL divergence of each K/V cache type's next-token distributions from a reference (the "
        "model at f16 K and V; among several files of one model, the one with the most bits per weight), and the "
        "perplexity, over a text, measured by the build's own llama-perplexity (--kl-divergence-base / "
        "--kl-divergence) on the devices the flags name (the CPU by default). The reference's logits are made once "
        "and kept in fitter's home (quality/).",
        epilog="One file: every KV cache type the build takes (K and V alike) unless --kv-types or -ctk/-ctv say "
        "otherwise. Several files (the same architecture and vocabulary): each at f16 K and V against the "
        "highest-precision one, unless --kv-types says more. llama-perplexity needs 2 x -c tokens of text.",
    )
    q.add_argument("models", nargs="*", metavar="MODEL", help="GGUF files of one model (default: the demo model)")
    q.add_argument("--quality-text", metavar="FILE", help="the text to score (default: the public-domain text "
                   "fitter ships, fitter/measure/llamacpp/texts/founding-texts.txt)")
    q.add_argument("--kv-types", metavar="all|LIST", help="K/V cache types to measure: all (every type the build "
                   "takes), or a list of TYPE (K and V) or K/V, e.g. f16,q8_0,q8_0/q4_0")
    q.add_argument("--chunks", type=int, metavar="N", help="score at most N chunks of -c tokens (llama-perplexity "
                   "--chunks; default: all the text holds)")
    q.add_argument("--reference", metavar="FILE", help="the file the others are measured against (default: the "
                   "one with the most bits per weight)")
    add_process_arguments(q)
    add_llama_cpp(q, "measure with that build's llama-perplexity")
    q.add_argument("--timeout", type=float, default=None, metavar="S", help="seconds before one run counts as hung")
    q.add_argument("--json", action="store_true")
    add_launch_arguments(q)
    q.set_defaults(func=cmd_quality)
