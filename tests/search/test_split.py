"""fitter.search.split: the tune's placement on two or more GPUs, as llama.cpp flags, and the search around it."""

from __future__ import annotations

from dataclasses import replace
from functools import cache

import pytest
from optuna.distributions import CategoricalDistribution, IntDistribution

from fitter.errors import LaunchConfigError
from fitter.flags import LaunchConfig
from fitter.gguf.model_spec import ModelSpec, Role, load_model_spec
from fitter.grid.points import sim_request
from fitter.memory.plan.estimator import CPU, estimate
from fitter.search import split
from fitter.search.plan import Screener, neighbours
from fitter.search.request import TuneRequest, candidate, combos
from fitter.search.screen import device_totals
from fitter.sim import load_machine
from tests.models import model_file

EXPS = r"\.ffn_(up|down|gate|gate_up)_(ch|)exps"


@cache
def spec() -> ModelSpec:
    return load_model_spec(str(model_file("gpt-oss-20b", sparse=True)))  # 24 layers, experts in every one


def request(machine: str = "gpu-3090-3060") -> TuneRequest:
    m = load_machine(machine)
    req = sim_request(m, spec(), spec().path)
    return replace(req, distributions=split.split_dims(req.distributions, len(req.devices), spec().n_layer))


def test_on_two_devices_n_cpu_moe_becomes_per_device_keys_in_its_place() -> None:
    dists = {"n-cpu-moe": IntDistribution(0, 24), "ubatch-size": CategoricalDistribution((512, 2048))}
    out = split.split_dims(dists, 2, 24)
    assert list(out) == ["tensor-split[0]", "n-cpu-moe[0]", "n-cpu-moe[1]", "expert-order", "split-mode",
                         "main-gpu", "ubatch-size"]
    assert out["tensor-split[0]"] == IntDistribution(0, 25)
    assert out["n-cpu-moe[1]"] == IntDistribution(0, 24)
    assert out["main-gpu"] == IntDistribution(0, 1)
    assert split.split_dims(dists, 1, 24) == dists


def test_the_last_device_takes_the_rest_of_the_layers_and_a_split_past_them_is_refused() -> None:
    s = split.read_split({"tensor-split[0]": 10, "tensor-split[1]": 5, "n-cpu-moe[2]": 3}, 3, 24)
    assert s == split.Split((10, 5, 10), (0, 0, 3), "last", None)
    assert split.read_split({"split-mode": "none", "main-gpu": 1}, 2, 24) == split.Split(None, (0, 0), "last", 1)
    with pytest.raises(LaunchConfigError, match=r"tensor-split\[0\]=20, tensor-split\[1\]=6: 26 layers, more than "
                                                r"the model's 24 layers and its output layer"):
        split.read_split({"tensor-split[0]": 20, "tensor-split[1]": 6}, 3, 24)


@pytest.mark.parametrize(("order", "layers"), [("last", "14|15|21|22|23"), ("first", "0|1|16|17|18")])
def test_each_device_sends_its_own_first_or_last_layers_experts_to_the_cpu(order: str, layers: str) -> None:
    req = request()
    cand = candidate(req, {"tensor-split[0]": 16, "n-cpu-moe[0]": 2, "n-cpu-moe[1]": 3, "expert-order": order,
                           "split-mode": "layer"})
    assert cand.error is None
    assert cand.flags[-8:] == ("-ot", rf"blk\.({layers}){EXPS}=CPU", "-ts", "16,9", "-t", "16", "-tb", "16")
    plan = Screener(req)(cand).plan
    assert plan is not None
    on_cpu = {p.tensor.layer for p in plan.placements if p.tensor.role is Role.EXPERT and p.buft == CPU}
    assert on_cpu == {int(x) for x in layers.split("|")}
    assert plan.layer_devices[:17] == ("CUDA0",) * 16 + ("CUDA1",)


def test_one_device_holds_everything_with_split_mode_none() -> None:
    req = request()
    cand = candidate(req, {"split-mode": "none", "main-gpu": 1, "n-cpu-moe[1]": 4, "expert-order": "last"})
    assert cand.flags == ("-fa", "on", "-ngl", "all", "-ot", rf"blk\.(20|21|22|23){EXPS}=CPU", "-sm", "none", "-mg",
                          "1", "-t", "16", "-tb", "16")
    plan = Screener(req)(cand).plan
    assert plan is not None
    totals = device_totals(plan)
    assert totals["CUDA0"] == 0 and totals["CUDA1"] > 0
    assert set(plan.layer_devices) == {"CUDA1"}


def test_the_first_placement_fills_every_gpu_and_reads_fewer_bytes_than_gpu0_first() -> None:
    m = load_machine("gpu-3090-3060")
    shape = load_model_spec(str(model_file("gpt-oss-120b", sparse=True)))
    base = sim_request(m, shape, shape.path)
    req = replace(base, distributions=split.split_dims(base.distributions, 2, shape.n_layer))
    screener = Screener(req)
    combo = {**combos(req)[0], "threads": 16}
    placed = screener.placement(combo)
    assert placed is not None and placed["split-mode"] == "layer"
    s = screener(candidate(req, placed))
    assert s.feasible and s.plan is not None
    totals = device_totals(s.plan)
    slack = {d: req.budgets.devices[d] - totals[d] for d in ("CUDA0", "CUDA1")}
    one_layer = max(sum(t.n_bytes for t in shape.tensors if t.role is Role.EXPERT and t.layer == il)
                    for il in range(shape.n_layer))
    assert all(0 <= v <= one_layer for v in slack.values()), slack
    # GPU0-first: -ncmoe's first layers with llama.cpp's default split, the fewest that fit
    gpu0_first = Screener(base).placement(combo)
    assert gpu0_first is not None
    g = Screener(base)(candidate(base, gpu0_first))
    assert g.plan is not None
    placed_bytes, gpu0_bytes = (sum(v for k, v in device_totals(p).items() if k != CPU) for p in (s.plan, g.plan))
    assert placed_bytes > gpu0_bytes + 8 * 2**30  # ~8 GiB more of the model on the GPUs


def test_with_a_build_that_projects_more_the_split_leaves_that_room_and_is_searched_again() -> None:
    shape = load_model_spec(str(model_file("gpt-oss-120b", sparse=True)))
    base = sim_request(load_machine("gpu-3090-3060"), shape, shape.path)
    req = replace(base, distributions=split.split_dims(base.distributions, 2, shape.n_layer))
    extra = 1024 * 2**20  # the build projects 1 GiB more compute on every GPU than fitter's estimate

    def projector(config: LaunchConfig) -> dict[str, dict[str, int]]:
        plan = estimate(shape, config, req.devices)
        totals = plan.totals()
        return {d.name: {"model": totals[d.name].model, "kv": totals[d.name].kv,
                         "compute": totals[d.name].compute + extra} for d in req.devices}

    guarded = replace(req, projector=projector)
    combo = {**combos(req)[0], "threads": 16}
    placed = Screener(guarded).placement(combo)
    assert placed is not None and Screener(guarded)(candidate(guarded, placed)).feasible
    plain = Screener(req).placement(combo)
    assert plain is not None
    assert placed["n-cpu-moe[0]"] + placed["n-cpu-moe[1]"] > plain["n-cpu-moe[0]"] + plain["n-cpu-moe[1]"]


def test_a_split_searched_once_serves_every_thread_count() -> None:
    req = request()
    screener = Screener(req)
    combo = combos(req)[0]
    a, b = (screener.placement({**combo, "threads": t}) for t in (8, 16))
    assert a is not None and b is not None and len(screener._spreads) == 1
    assert {k: v for k, v in a.items() if k != "threads"} == {k: v for k, v in b.items() if k != "threads"}


def test_the_placements_neighbours_move_layers_flip_the_order_and_try_each_gpu_alone() -> None:
    req = request()
    screener = Screener(req)
    placed = screener.placement({**combos(req)[0], "threads": 16})
    assert placed is not None
    moves = list(neighbours(req, screener, placed))
    shapes = {(p.get("split-mode"), p.get("main-gpu"), p.get("expert-order"), p.get("tensor-split[0]"))
              for p in moves}
    ts = placed["tensor-split[0]"]
    assert ("none", 0, "last", None) in shapes and ("none", 1, "last", None) in shapes
    assert ("layer", None, "first", ts) in shapes
    assert ("layer", None, "last", ts - 3) in shapes and ("layer", None, "last", ts + 3) in shapes
    for p in moves:
        assert screener(candidate(req, p)).feasible


# -- one GPU: which layers -ncmoe's count takes -----------------------------------------------------------------


def one_gpu() -> TuneRequest:
    return sim_request(load_machine("gpu-8gb"), spec(), spec().path)


def test_on_one_gpu_the_shipped_space_orders_the_experts_first_or_last() -> None:
    assert one_gpu().distributions["expert-order"] == CategoricalDistribution(("first", "last"))
    assert split.last_experts_rule(spec(), 5) == split.experts_rule([19, 20, 21, 22, 23])
    assert split.last_experts_rule(spec(), 0) is None  # -ncmoe 0 and -cmoe are the same either way
    assert split.last_experts_rule(spec(), 24) is None
    deepseek = load_model_spec(str(model_file("deepseek2-tiny")))  # layer 0 is dense: -ncmoe 2 moves layer 1's
    assert split.last_experts_rule(deepseek, 2) == split.experts_rule([2])


def test_last_keeps_as_many_expert_layers_on_the_cpu_as_ncmoe_the_last_ones_as_one_rule() -> None:
    req = one_gpu()
    screener = Screener(req)
    first = candidate(req, {"n-cpu-moe": 5, "expert-order": "first", "threads": 8})
    last = candidate(req, {"n-cpu-moe": 5, "expert-order": "last", "threads": 8})
    assert first.flags == ("-fa", "on", "-ngl", "all", "-ncmoe", "5", "-t", "8", "-tb", "8")
    assert last.flags == ("-fa", "on", "-ngl", "all", "-ot", rf"blk\.(19|20|21|22|23){EXPS}=CPU", "-t", "8", "-tb", "8")
    plans = {order: screener(c).plan for order, c in (("first", first), ("last", last))}
    on_cpu = {order: {p.tensor.layer for p in plan.placements if p.tensor.role is Role.EXPERT and p.buft == CPU}
              for order, plan in plans.items() if plan is not None}
    assert on_cpu == {"first": {0, 1, 2, 3, 4}, "last": {19, 20, 21, 22, 23}}
    weights = {order: sum(p.tensor.n_bytes for p in plan.placements if p.buft == "CUDA0")
               for order, plan in plans.items() if plan is not None}
    assert weights["first"] == weights["last"]  # every layer's experts the same size: the same VRAM for weights
    # as many on the CPU as there are, or none: -ncmoe's own placement, so one config (one key), not two
    assert candidate(req, {"n-cpu-moe": 24, "expert-order": "last"}).key == \
        candidate(req, {"n-cpu-moe": 24, "expert-order": "first"}).key


def test_the_rule_tune_writes_for_last_is_the_one_the_golden_matrix_measured() -> None:
    # tests/golden/rpc.json and cuda-emulated.json: <model>/ngl-all-ot-experts-last2, estimated exactly
    # (tests/memory/plan/test_golden.py)
    demo = load_model_spec(str(model_file("demo")))  # 8 layers, experts in each
    req = replace(one_gpu(), spec=demo, base=LaunchConfig(), distributions={"n-cpu-moe": IntDistribution(0, 8)})
    cand = candidate(req, {"n-cpu-moe": 2, "expert-order": "last"})
    assert cand.flags[cand.flags.index("-ot"):][:2] == ("-ot", r"blk\.(6|7)\.ffn_(up|down|gate|gate_up)_(ch|)exps=CPU")


def test_on_one_gpu_the_neighbours_flip_the_expert_order_at_the_same_count() -> None:
    req = one_gpu()
    screener = Screener(req)
    placed = screener.placement({**combos(req)[0], "threads": 8})
    assert placed is not None and placed["expert-order"] == "first"  # the structured start is -ncmoe's
    moves = list(neighbours(req, screener, placed))
    flipped = [p for p in moves if p.get("expert-order") == "last"]
    assert flipped == [{**placed, "expert-order": "last"}]
    # a move of another key keeps the order it is given
    last = {**placed, "expert-order": "last"}
    assert all(p.get("expert-order") in ("last", "first") for p in neighbours(req, screener, last))
    assert {p.get("expert-order") for p in neighbours(req, screener, last)
            if p.get("ubatch-size") != last.get("ubatch-size")} == {"last"}


# -- -sm tensor: the GPUs as one device -------------------------------------------------------------------------


def test_the_spaces_split_mode_puts_tensor_beside_layer_and_none() -> None:
    modes = CategoricalDistribution(("layer", "tensor"))
    moe = split.split_dims({"n-cpu-moe": IntDistribution(0, 24), "split-mode": modes}, 2, 24)
    assert list(moe) == ["tensor-split[0]", "n-cpu-moe[0]", "n-cpu-moe[1]", "expert-order", "split-mode", "main-gpu"]
    assert moe["split-mode"] == CategoricalDistribution(("layer", "none", "tensor"))
    # a dense model: the mode is searched only where it can be tensor (layer alone is llama.cpp's default)
    dense = {"n-gpu-layers": IntDistribution(0, 41), "split-mode": modes}
    assert split.split_dims(dense, 2, 40) == dense
    assert split.split_dims({**dense, "split-mode": CategoricalDistribution(("layer",))}, 2, 40) == \
        {"n-gpu-layers": IntDistribution(0, 41)}
    tensor = split.read_split({"split-mode": "tensor", "n-cpu-moe[0]": 3, "n-cpu-moe[1]": 9, "expert-order": "first",
                               "tensor-split[0]": 5}, 2, 24)
    assert tensor == split.Split(None, (3,), "first", tensor=True)
    assert tensor.params() == {"split-mode": "tensor", "n-cpu-moe[0]": 3, "expert-order": "first"}


def test_a_tensor_parallel_candidate_sends_the_models_last_expert_layers_to_the_cpu() -> None:
    req = request("gpu-2x3090")
    assert req.distributions["split-mode"] == CategoricalDistribution(("layer", "none", "tensor"))
    cand = candidate(req, {"split-mode": "tensor", "n-cpu-moe[0]": 3, "n-cpu-moe[1]": 7, "expert-order": "last",
                           "tensor-split[0]": 4, "main-gpu": 1})
    assert cand.flags == ("-fa", "on", "-ngl", "all", "-ot", rf"blk\.(21|22|23){EXPS}=CPU", "-sm", "tensor", "-t", "8",
                          "-tb", "8")
    plan = Screener(req)(cand).plan
    assert plan is not None
    on_cpu = {p.tensor.layer for p in plan.placements if p.tensor.role is Role.EXPERT and p.buft == CPU}
    assert on_cpu == {21, 22, 23} and set(plan.layer_devices) == {"Meta()"}
    totals = device_totals(plan)
    assert totals["CUDA0"] > 0 and totals["CUDA1"] > 0


def test_the_tensor_placement_is_the_fewest_expert_layers_on_the_cpu_that_fit() -> None:
    shape = load_model_spec(str(model_file("gpt-oss-120b", sparse=True)))  # ~60 GiB: more than two 3090s hold
    base = sim_request(load_machine("gpu-2x3090"), shape, shape.path)
    req = replace(base, distributions=split.split_dims(base.distributions, 2, shape.n_layer))
    screener = Screener(req)
    combo = {**combos(req)[0], "threads": 8}
    placed = screener.placement({**combo, "split-mode": "tensor"})
    assert placed is not None and placed["split-mode"] == "tensor" and placed["expert-order"] == "last"
    n = placed["n-cpu-moe[0]"]
    assert 0 < n < shape.n_layer and screener(candidate(req, placed)).feasible
    assert not screener(candidate(req, {**placed, "n-cpu-moe[0]": n - 1})).feasible
    # and a neighbour of the layer split's placement, which in turn has the layer split among its own
    layered = screener.placement(combo)
    assert layered is not None and layered["split-mode"] == "layer"
    assert placed in list(neighbours(req, screener, layered))
    back = list(neighbours(req, screener, placed))
    assert layered in back and {**placed, "expert-order": "first"} in back


def test_a_dense_model_searches_the_mode_and_its_own_layers_in_each() -> None:
    qwen = load_model_spec(str(model_file("qwen3-14b", sparse=True)))
    base = sim_request(load_machine("gpu-2x3090"), qwen, qwen.path)
    assert base.distributions["split-mode"] == CategoricalDistribution(("layer", "tensor"))
    req = replace(base, distributions=split.split_dims(base.distributions, 2, qwen.n_layer))
    screener = Screener(req)
    combo = {**combos(req)[0], "threads": 8}
    layered = screener.placement(combo)
    assert layered == {**combo, "n-gpu-layers": qwen.n_layer + 1}  # llama.cpp's own split: no -sm written
    tensor = {**combo, "split-mode": "tensor", "n-gpu-layers": qwen.n_layer + 1}
    assert tensor in list(neighbours(req, screener, layered))
    assert "-sm" in candidate(req, tensor).flags and "-sm" not in candidate(req, layered).flags
    # an architecture llama.cpp does not split, or one GPU: the key is not searched
    deepseek = load_model_spec(str(model_file("deepseek2-tiny", sparse=True)))
    assert "split-mode" not in sim_request(load_machine("gpu-2x3090"), deepseek, deepseek.path).distributions
    assert "split-mode" not in sim_request(load_machine("gpu-16gb"), qwen, qwen.path).distributions
