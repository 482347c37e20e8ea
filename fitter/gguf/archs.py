"""What each architecture's memory depends on, as llama.cpp 0c1e570 builds it: one row per architecture.

The rows follow each model's `load_arch_hparams` (src/models/<arch>.cpp) and `llama_model::create_memory`
(src/llama-model.cpp). An architecture not listed here is one fitter has no memory rules for: its spec says so and
names it (fitter.gguf.model_spec). tests/memory/plan/test_arch_goldens.py checks every row against the buffers llama.cpp
logged for the tiny model of that architecture that llama.cpp's own tests/test-llama-archs.cpp builds.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class Memory(StrEnum):
    KV = "kv"  # llama_kv_cache (or its iSWA pair) over every trunk layer
    HYBRID = "hybrid"  # llama_memory_hybrid: a KV cache for the attention layers, recurrent state for the others
    RECURRENT = "recurrent"  # llama_memory_recurrent over every layer
    NONE = "none"  # no memory at all (diffusion models, encoders: create_memory returns nullptr)


class SwaWhen(StrEnum):
    ALWAYS = "always"  # load_swa_pattern runs unconditionally
    KEY = "key"  # only when the file gives `attention.sliding_window` > 0
    UNLESS_ZERO = "unless-zero"  # unless the file gives `attention.sliding_window` = 0 (llama4's chunked attention)
    ARRAY = "array"  # the file's `attention.sliding_window_pattern` array alone (ml.get_arr)
    # when the file gives `attention.sliding_window` > 0, every attention layer of a hybrid slides and no pattern key
    # is read (lfm2: is_swa = !is_recr)
    ATTENTION = "attention"


@dataclass(frozen=True)
class Swa:
    """llama_model_base::load_swa_pattern(ml, pattern, dense_first): the file's `sliding_window_pattern` (an array,
    or a period) wins over the default period."""

    when: SwaWhen
    pattern: int = 0
    dense_first: bool = False
    n_swa: int = 0  # a window the architecture sets itself: the default when the file has none, or forced
    forced: bool = False  # the window is the architecture's whatever the file says (llama4 8192, smallthinker 4096)


class RecurrentBy(StrEnum):
    """How a hybrid model's load_arch_hparams sets llama_hparams::is_recr, and which layers create_memory's filters
    give a KV cache (src/llama-model.cpp `llama_model::create_memory`)."""

    # the file's `attention.recurrent_layers`, else every layer but each `interval`-th (`full_attention_interval`);
    # the others attend (qwen3next, qwen35, qwen35moe)
    INTERVAL = "interval"
    NO_KV_HEADS = "no-kv-heads"  # a layer with no KV heads is recurrent, the others attend (jamba, plamo2, …)
    # recurrent: no KV heads and no FFN; attends: KV heads and no FFN; an FFN layer has neither (nemotron_h)
    NO_KV_HEADS_NOR_FFN = "no-kv-heads-nor-ffn"
    EVERY = "every"  # every layer both attends and keeps recurrent state (falcon-h1: filters that are always true)


@dataclass(frozen=True)
class Recurrent:
    """Which layers of a hybrid model keep recurrent state and which a KV cache. A recurrent model
    (Memory.RECURRENT) keeps state in every layer and needs no row of this."""

    by: RecurrentBy
    interval: int = 0  # RecurrentBy.INTERVAL's default
    # the state of a lightning-attention layer: a head-size square per head (minimax-01: n_embd_head_la)
    linear_attention: bool = False


class Indexer(StrEnum):
    """Which layers keep a sparse-attention lightning indexer's key cache beside the attention cache: a second KV
    cache of one key head of `attention.indexer.key_length` per layer (no V), of the K cache's type and the attention
    cache's cells (src/llama-kv-cache-dsa.cpp; in a hybrid, src/llama-memory-hybrid-idx.cpp, after the recurrent
    state, three such widths with a k-pool: key, gate and pooled values)."""

    TRUNK = "trunk"  # every trunk layer (deepseek32)
    # the layers `attention.indexer.types` marks; without the key every layer of a GLM-5 or 5.1 (a training context
    # under 1048576), else GLM-5.2's default: layers 0 and 1, then every 4th from layer 2 (src/models/glm-dsa.cpp)
    TYPES = "types"
    TYPES_OR_ALL = "types-or-all"  # the attention layers `attention.indexer.types` marks, all without it (glm5-next)


@dataclass(frozen=True)
class Arch:
    memory: Memory = Memory.KV
    swa: Swa | None = None
    recurrent: Recurrent | None = None
    skips_nextn: bool = False  # NextN/MTP blocks are loaded with TENSOR_SKIP (ml.load_mtp is false for a server)
    flash_attn: bool = True  # False: llama_init_from_model forces flash attention off (Grok)
    indexer: Indexer | None = None


_S = Swa
_W = SwaWhen
# One row per architecture whose memory llama.cpp builds as fitter models it. Plain KV rows carry no fields.
ARCHS: dict[str, Arch] = {
    **{name: Arch() for name in (
        "arcee", "arctic", "baichuan", "bailingmoe", "bailingmoe2", "bloom", "chatglm", "codeshell", "cogvlm",
        "command-r", "dbrx", "deci", "deepseek", "dots1", "ernie4_5", "ernie4_5-moe", "exaone", "exaone4",
        "falcon", "gemma", "glm4", "gpt2", "gptneox", "granite", "granitemoe", "grovemoe", "hunyuan-dense",
        "hunyuan-moe", "hunyuan_vl", "hy_v3", "internlm2", "jais", "jais2", "llama", "maincoder", "minicpm",
        "minicpm3", "minimax-m2", "mistral3", "mistral4", "mpt", "nanbeige", "nemotron", "olmo", "olmoe",
        "openelm", "orion", "paddleocr", "pangu-embedded", "phi2", "phi3", "phimoe", "plamo", "pockettts", "qwen",
        "qwen2", "qwen2moe", "qwen2vl", "qwen3", "qwen3moe", "qwen3tts", "qwen3vl", "qwen3vlmoe", "refact",
        "seed_oss", "smollm3", "stablelm", "starcoder", "starcoder2", "talkie", "xverse", "hrm_text",
    )},
    "grok": Arch(flash_attn=False),  # "flash_attn is not compatible with Grok - forcing off"
    "deepseek2": Arch(skips_nextn=True),  # MLA comes from its keys, as llama_hparams::is_mla
    "deepseek32": Arch(skips_nextn=True, indexer=Indexer.TRUNK),
    "glm-dsa": Arch(skips_nextn=True, indexer=Indexer.TYPES),
    "glm4moe": Arch(skips_nextn=True),
    "gpt-oss": Arch(swa=_S(_W.ALWAYS, 2)),
    "gemma2": Arch(swa=_S(_W.ALWAYS, 2, n_swa=4096)),
    "gemma3": Arch(swa=_S(_W.KEY, 6)),
    "cohere2": Arch(swa=_S(_W.ALWAYS, 4)),
    "cohere2moe": Arch(swa=_S(_W.ALWAYS, 4, dense_first=True), skips_nextn=True),
    "exaone-moe": Arch(swa=_S(_W.ALWAYS, 4, n_swa=128)),
    "afmoe": Arch(swa=_S(_W.KEY, 4)),
    "laguna": Arch(swa=_S(_W.KEY, 4, dense_first=True)),
    # LLAMA_SWA_TYPE_CHUNKED: chunks of 8192 size the cache as a window does (only the mask differs)
    "llama4": Arch(swa=_S(_W.UNLESS_ZERO, 4, n_swa=8192, forced=True)),
    "mellum": Arch(swa=_S(_W.KEY, 4)),
    "muse-glimmer": Arch(swa=_S(_W.ALWAYS, 4)),
    "olmo2": Arch(swa=_S(_W.KEY, 4)),
    "plamo3": Arch(swa=_S(_W.KEY, 8)),
    "smallthinker": Arch(swa=_S(_W.KEY, 4, dense_first=True, n_swa=4096, forced=True)),
    **{name: Arch(swa=_S(_W.ARRAY)) for name in ("granite_swa", "maple", "spark2_5")},
    "mimo2": Arch(swa=_S(_W.ARRAY), skips_nextn=True),
    # gated DeltaNet + attention every 4th layer (src/models/qwen3next.cpp, qwen35.cpp, qwen35moe.cpp)
    **{name: Arch(Memory.HYBRID, recurrent=Recurrent(RecurrentBy.INTERVAL, interval=4), skips_nextn=True)
       for name in ("qwen3next", "qwen35", "qwen35moe")},
    "glm5-next": Arch(Memory.HYBRID, recurrent=Recurrent(RecurrentBy.NO_KV_HEADS), skips_nextn=True,
                      indexer=Indexer.TYPES_OR_ALL),
    # Mamba (jamba, plamo2) and Mamba-2 (granitehybrid, nemotron_h, falcon-h1) layers beside attention
    **{name: Arch(Memory.HYBRID, recurrent=Recurrent(RecurrentBy.NO_KV_HEADS))
       for name in ("jamba", "plamo2", "granitehybrid")},
    **{name: Arch(Memory.HYBRID, recurrent=Recurrent(RecurrentBy.NO_KV_HEADS_NOR_FFN))
       for name in ("nemotron_h", "nemotron_h_moe")},
    "falcon-h1": Arch(Memory.HYBRID, recurrent=Recurrent(RecurrentBy.EVERY)),
    # Kimi delta attention beside MLA (src/models/kimi-linear.cpp, kimi-k3.cpp, bailingmoe3.cpp; `kda.head_dim`)
    **{name: Arch(Memory.HYBRID, recurrent=Recurrent(RecurrentBy.NO_KV_HEADS), skips_nextn=True)
       for name in ("kimi-linear", "kimi-k3", "bailingmoe3")},
    # lightning attention beside softmax attention every 8th layer (src/models/minimax-01.cpp)
    "minimax-01": Arch(Memory.HYBRID, recurrent=Recurrent(RecurrentBy.INTERVAL, interval=8, linear_attention=True)),
    # gated short convolutions beside attention (src/models/lfm2.cpp: n_embd_r from `shortconv.l_cache`)
    **{name: Arch(Memory.HYBRID, swa=_S(_W.ATTENTION), recurrent=Recurrent(RecurrentBy.NO_KV_HEADS))
       for name in ("lfm2", "lfm2moe")},
    **{name: Arch(Memory.RECURRENT) for name in ("mamba", "mamba2")},
    **{name: Arch(Memory.NONE) for name in ("dream", "llada", "llada-moe", "rnd1")},
}
