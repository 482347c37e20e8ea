"""Pooling by physics: where a searched parameter cannot change a speed, configs that differ only in it share their
samples instead of spending launch time measuring the same quantity again.

Each rule names the speed, the parameters that cannot change it at a fixed placement (the same -ngl/-ncmoe/-ot, KV
types, flash attention and context; those stay in the key), and llama.cpp's reason (0c1e570):

- decode (`tg`) ignores `-b`, `-ub` and `-tb`: a decoded token is a batch of one, so it is one ubatch of one token
  whatever -b/-ub allow (src/llama-batch.cpp `llama_batch_allocr::split_*` cut a batch into ubatches of at most
  n_ubatch tokens), and `llama_context::process_ubatch` computes it with `graph_compute(gf, ubatch.n_tokens > 1)`,
  which takes `cparams.n_threads` (-t) for a one-token ubatch and `n_threads_batch` (-tb) only for larger ones
  (src/llama-context.cpp `llama_context::graph_compute`). CUDA's op offload, the one batch-size-dependent path,
  starts at 32 tokens (ggml-cuda.cu `ggml_backend_cuda_device_offload_op`).
- prefill (`pp`) ignores `-t`: its ubatches have many tokens, so the same `graph_compute` takes `n_threads_batch`
  (-tb). The key keeps the effective -tb, so where -tb follows -t (not searched, not given), -t still counts.

A trial whose decode class already holds samples is launched with `-n 0` (prefill only): its decode is the class's
pooled samples. Prefill is always measured (it is what such a trial is for); its value pools its class's samples.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fitter.measure.types import samples_json
from fitter.search.request import Candidate


@dataclass(frozen=True)
class PoolRule:
    speed: str  # tg | pp
    ignores: tuple[str, ...]  # searched parameters (llama.cpp long names) that cannot change it
    why: str


RULES = (
    PoolRule("tg", ("batch-size", "ubatch-size", "threads-batch"),
             "a decoded token is one ubatch of one token, computed with -t threads (llama_context::graph_compute)"),
    PoolRule("pp", ("threads",), "prefill ubatches are computed with -tb threads (llama_context::graph_compute)"),
)
RULE = {r.speed: r for r in RULES}


def pool_key(cand: Candidate, speed: str) -> str:
    """The class of configs `speed` cannot tell apart: the params with the effective threads, less what the rule
    ignores."""
    effective: dict[str, Any] = {**cand.params, "threads": cand.spec.threads,
                                 "threads-batch": cand.spec.threads_batch or cand.spec.threads}
    for name in RULE[speed].ignores:
        effective.pop(name, None)
    return repr(sorted(effective.items(), key=lambda kv: kv[0]))


@dataclass
class SamplePool:
    """Samples (t/s) per (speed, class), with the trials they came from."""

    samples: dict[tuple[str, str], list[tuple[int, list[float]]]]

    @staticmethod
    def empty() -> SamplePool:
        return SamplePool({})

    def has(self, cand: Candidate, speed: str) -> bool:
        return bool(self.samples.get((speed, pool_key(cand, speed))))

    def add(self, cand: Candidate, speed: str, trial: int, own: list[float]) -> None:
        if own:
            self.samples.setdefault((speed, pool_key(cand, speed)), []).append((trial, list(own)))

    def pooled(self, cand: Candidate, speed: str, stats: dict[str, Any] | None, n: int, depth: int
               ) -> dict[str, Any] | None:
        """`stats` (a bench JSON test, or None when it was not measured) with its class's earlier samples added:
        avg_ts and stddev_ts over all of them, `pooled` naming the trials they came from and how many are its own."""
        earlier = self.samples.get((speed, pool_key(cand, speed)), [])
        own = [float(x) for x in (stats or {}).get("samples_ts", [])]
        if not earlier:
            return stats
        pooled = samples_json(stats or {"n": n, "depth": depth}, own + [x for _, xs in earlier for x in xs])
        return {**pooled, "pooled": {"trials": [t for t, _ in earlier], "own": len(own), "rule": RULE[speed].why}}
