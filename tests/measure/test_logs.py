"""Parsing llama.cpp's buffer lines, on excerpts of real logs from llama-cpp-python 0.3.36 (llama.cpp 0c1e570)."""

from __future__ import annotations

from fitter.measure.logs import parse_buffer_lines, sum_by

# gpt-oss-120b (sparse header, 3 shards), CPU only, `-c 4096 -nr`, -np auto (4 slots, unified KV).
from fitter.measure.types import LoggedBuffer

GPT_OSS_120B = """\
load_tensors: offloading output layer to GPU
load_tensors: offloading 35 repeating layers to GPU
load_tensors: offloaded 37/37 layers to GPU
load_tensors:   CPU_Mapped model buffer size = 20337.54 MiB
load_tensors:   CPU_Mapped model buffer size = 20325.40 MiB
load_tensors:   CPU_Mapped model buffer size = 19775.53 MiB
....................................................................................................
llama_context: constructing llama_context
llama_context: n_seq_max             = 4
llama_context: n_ctx                 = 4096
llama_context: n_outputs_max         = 4
llama_context: n_ctx_seq (4096) < n_ctx_train (131072) -- the full capacity of the model will not be utilized
set_abort_callback: call
llama_context:        CPU  output buffer size =     3.07 MiB
llama_kv_cache_iswa: creating non-SWA KV cache, size = 4096 cells
llama_kv_cache: layer   0: filtered
llama_kv_cache: layer   1: dev = CPU
llama_kv_cache:        CPU KV buffer size =   144.00 MiB
llama_kv_cache: size =  144.00 MiB (  4096 cells,  18 layers,  4/1 seqs), K (f16):   72.00 MiB, V (f16):   72.00 MiB
llama_kv_cache: attn_rot_k = 0, n_embd_head_k_all = 64
llama_kv_cache_iswa: creating     SWA KV cache, size = 1024 cells
llama_kv_cache:        CPU KV buffer size =    36.00 MiB
llama_kv_cache: size =   36.00 MiB (  1024 cells,  18 layers,  4/1 seqs), K (f16):   18.00 MiB, V (f16):   18.00 MiB
sched_reserve: reserving ...
sched_reserve: worst-case: n_tokens = 512, n_seqs = 4, n_outputs = 4
sched_reserve:        CPU compute buffer size =    97.39 MiB
sched_reserve: graph: nodes = 2021, splits = 1, input objects = 4, input tensors = 9
~llama_context:        CPU compute buffer size is  97.3946 MiB, matches expectation of  97.3946 MiB
"""

# gpt-oss-tiny served half by an RPC device (`--rpc 127.0.0.1:50052 -ngl 99 -ncmoe 1 -c 4096`); the repack
# progress dots land in front of the next log line, as they do in llama.cpp's output.
GPT_OSS_TINY_RPC = """\
load_tensors:   CPU_Mapped model buffer size =     0.23 MiB
load_tensors:   CPU_REPACK model buffer size =     0.10 MiB
load_tensors: RPC0[127.0.0.1:50052] model buffer size =     0.28 MiB
..repack: repack tensor blk.0.ffn_gate_exps.weight with mxfp4_8x8
.repack: repack tensor blk.0.ffn_down_exps.weight with mxfp4_8x8
................
llama_context:        CPU  output buffer size =     0.01 MiB
llama_kv_cache_iswa: creating non-SWA KV cache, size = 4096 cells
llama_kv_cache: RPC0[127.0.0.1:50052] KV buffer size =     1.00 MiB
llama_kv_cache: size =    1.00 MiB (  4096 cells,   1 layers,  4/1 seqs), K (f16):    0.50 MiB, V (f16):    0.50 MiB
llama_kv_cache_iswa: creating     SWA KV cache, size = 1024 cells
llama_kv_cache: RPC0[127.0.0.1:50052] KV buffer size =     0.25 MiB
sched_reserve: RPC0[127.0.0.1:50052] compute buffer size =     5.26 MiB
sched_reserve:        CPU compute buffer size =     6.27 MiB
~llama_context: RPC0[127.0.0.1:50052] compute buffer size is   5.2559 MiB, matches expectation of   5.2559 MiB
~llama_context:        CPU compute buffer size is   6.2696 MiB, matches expectation of   6.2696 MiB
"""

# gpt-oss-tiny, `-c 4096 --no-mmap`: weights in a plain CPU buffer, MXFP4 experts repacked.
GPT_OSS_TINY_NO_MMAP = """\
load_tensors: loading model tensors, this can take a while... (load_mode = none)
load_tensors:          CPU model buffer size =     0.25 MiB
load_tensors:   CPU_REPACK model buffer size =     0.20 MiB
llama_context:        CPU  output buffer size =     0.01 MiB
llama_kv_cache:        CPU KV buffer size =     1.00 MiB
llama_kv_cache:        CPU KV buffer size =     0.25 MiB
sched_reserve:        CPU compute buffer size =     6.77 MiB
"""


def test_sharded_model_keeps_one_mapped_buffer_per_shard() -> None:
    assert parse_buffer_lines(GPT_OSS_120B) == [
        LoggedBuffer("CPU_Mapped", "model", 20337.54),
        LoggedBuffer("CPU_Mapped", "model", 20325.40),
        LoggedBuffer("CPU_Mapped", "model", 19775.53),
        LoggedBuffer("CPU", "output", 3.07),
        LoggedBuffer("CPU", "kv", 144.00),
        LoggedBuffer("CPU", "kv", 36.00),
        LoggedBuffer("CPU", "compute", 97.39),
    ]


def test_sum_by_adds_shards_and_both_iswa_caches() -> None:
    assert sum_by(parse_buffer_lines(GPT_OSS_120B)) == {
        ("CPU_Mapped", "model"): 60438.47,
        ("CPU", "output"): 3.07,
        ("CPU", "kv"): 180.0,
        ("CPU", "compute"): 97.39,
    }


def test_rpc_names_overflow_the_padding_and_debug_lines_are_ignored() -> None:
    buffers = parse_buffer_lines(GPT_OSS_TINY_RPC)
    rpc = "RPC0[127.0.0.1:50052]"
    assert buffers == [
        LoggedBuffer("CPU_Mapped", "model", 0.23),
        LoggedBuffer("CPU_REPACK", "model", 0.10),
        LoggedBuffer(rpc, "model", 0.28),
        LoggedBuffer("CPU", "output", 0.01),
        LoggedBuffer(rpc, "kv", 1.00),
        LoggedBuffer(rpc, "kv", 0.25),
        LoggedBuffer(rpc, "compute", 5.26),
        LoggedBuffer("CPU", "compute", 6.27),
    ]
    assert sum_by(buffers)[(rpc, "kv")] == 1.25


def test_plain_cpu_model_buffer_without_mmap() -> None:
    assert sum_by(parse_buffer_lines(GPT_OSS_TINY_NO_MMAP)) == {
        ("CPU", "model"): 0.25,
        ("CPU_REPACK", "model"): 0.20,
        ("CPU", "output"): 0.01,
        ("CPU", "kv"): 1.25,
        ("CPU", "compute"): 6.77,
    }


def test_prefixed_lines_and_pieces_joined_mid_line() -> None:
    # llama-server prefixes its log lines (timestamp, level); progress dots may precede a line.
    text = (
        "0.00.123.456 I load_tensors:        CUDA0 model buffer size =  1234.56 MiB\n"
        "...llama_context:  CUDA_Host  output buffer size =     0.77 MiB\n"
    )
    assert parse_buffer_lines(text) == [
        LoggedBuffer("CUDA0", "model", 1234.56),
        LoggedBuffer("CUDA_Host", "output", 0.77),
    ]


def test_lines_that_only_look_similar_are_not_buffers() -> None:
    text = (
        "llama_kv_cache_iswa: creating     SWA KV cache, size = 1024 cells\n"
        "llama_kv_cache: size =   36.00 MiB (  1024 cells,  18 layers,  4/1 seqs)\n"
        "llama_memory_recurrent:        CPU KV buffer size =     3.00 MiB\n"  # the recurrent memory writes RS
        "llama_context:        CPU compute buffer size =     1.00 MiB\n"  # wrong function for the kind
        "print_info: file size   = 0.45 MiB (6.05 BPW)\n"
    )
    assert parse_buffer_lines(text) == []
    assert parse_buffer_lines("") == []
    assert sum_by([]) == {}


def test_recurrent_state_counts_with_the_kv_cache_in_log_order() -> None:
    # a hybrid model (qwen3next): the attention layers' KV cache, then the recurrent layers' state
    text = ("llama_kv_cache:        CPU KV buffer size =     0.25 MiB\n"
            "llama_memory_recurrent:        CPU RS buffer size =     1.61 MiB\n")
    assert parse_buffer_lines(text) == [LoggedBuffer("CPU", "kv", 0.25), LoggedBuffer("CPU", "kv", 1.61)]
