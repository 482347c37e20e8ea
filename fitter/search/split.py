"""The tune's placement on two or more GPUs: which layers each GPU holds and, per GPU, which of its layers send
their experts to the CPU.

On one GPU the placement is `-ncmoe N` (the experts of the first N layers on the CPU). On several it cannot be: those
first layers all sit on the first GPU, which empties while the others overflow (llama.cpp #15263, #15136). So on N
devices `n-cpu-moe` becomes these keys, each a llama.cpp flag per device, written as llama.cpp's own flags:

- ``tensor-split[i]`` (i < N-1): layers on device i, `-ts` as layer counts (as llama.cpp's `--fit` writes it); the
  last device takes the rest of the model's layers and its output layer (`-ngl all`);
- ``n-cpu-moe[i]``: how many of device i's layers keep their experts on the CPU (ik_llama.cpp's per-GPU `-ncmoe`),
  as one `-ot blk\\.(L1|L2|…)\\.ffn_…_exps=CPU` rule;
- ``expert-order``: which of a device's layers those are: its ``last`` (llama.cpp `--fit`'s order) or ``first``
  (`-ncmoe`'s);
- ``split-mode`` ``layer`` (the layers across the devices) or ``none`` with ``main-gpu`` (the whole model on that
  one GPU, src/llama.cpp `llama_model_load_from_file_impl`; under `-sm layer` llama.cpp reads no `-mg`), or
  ``tensor`` where the search space lists it (llama.cpp's tensor parallelism: every layer's weights split over all
  the devices, which the model sees as one "Meta" device, src/llama-model.cpp `llama_meta_device_get_split_state`):
  there ``n-cpu-moe[0]`` counts the model's expert layers whose experts go to the CPU, its first or last ones as
  ``expert-order`` says, as on one GPU. A dense model on several GPUs searches ``split-mode`` only when it can be
  ``tensor``: layer (llama.cpp's own split by free memory, `-ngl` searched) or tensor.

On one GPU ``expert-order`` is searched beside `n-cpu-moe N` when the space lists it: ``first`` is `-ncmoe N`;
``last`` keeps as many expert layers on the CPU as `-ncmoe N` would, the model's last ones, as one `-ot` rule
(`last_experts_rule`), the order llama.cpp's `--fit` uses (common/fit.cpp moves experts from the last layers
first); ik_llama.cpp #2262 measured it ~10 % faster prefill at equal VRAM.

The fewest bytes from RAM are found the way `fitter fit` finds them (fitter.memory.fit.fit_devices); the speed of each
GPU is measured: moving layers from a slow GPU to a fast one, or the model onto one GPU, are the neighbours.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from optuna.distributions import BaseDistribution, CategoricalDistribution, IntDistribution

from fitter.errors import LaunchConfigError
from fitter.flags import LaunchConfig, TensorOverride
from fitter.flags.overrides import FFN_EXPS_REGEX
from fitter.gguf.model_spec import ModelSpec
from fitter.memory.backends.devices import Device
from fitter.memory.fit.fit_devices import expert_layers, expert_ranges

ORDER = "expert-order"
MODE = "split-mode"
MAIN = "main-gpu"
EXPERT_ORDERS = ("last", "first")
SPLIT_MODES = ("layer", "none")
TENSOR = "tensor"  # -sm tensor, searched where the space lists it (fitter.search.space.for_target)
# the flags that fix the placement on several devices: the user's own split, rules, or expert counts
FIXING_FLAGS = ("tensor_split", "overrides", "split_mode", "main_gpu", "n_gpu_layers")


def split_key(i: int) -> str:
    return f"tensor-split[{i}]"


def experts_key(i: int) -> str:
    return f"n-cpu-moe[{i}]"


def is_split_key(key: str) -> bool:
    return key.startswith(("tensor-split[", "n-cpu-moe[")) or key in (ORDER, MODE, MAIN)


def last_experts_rule(spec: ModelSpec, n_cpu_moe: int) -> TensorOverride | None:
    """On one GPU, `-ncmoe n_cpu_moe`'s count of expert layers on the CPU taken from the model's last expert layers,
    as one rule. None where that is `-ncmoe`'s own placement (none of them, or all)."""
    layers = expert_layers(spec)
    n = sum(1 for il in layers if il < n_cpu_moe)
    if n == 0 or n == len(layers):
        return None
    return experts_rule(layers[len(layers) - n:])


def experts_rule(layers: list[int]) -> TensorOverride:
    """The experts of `layers` on the CPU: one rule for them all (std::regex alternation), not a rule per layer,
    so the line is one a person can read."""
    return TensorOverride(rf"blk\.({'|'.join(map(str, sorted(layers)))}){FFN_EXPS_REGEX}", "CPU")


def split_dims(distributions: Mapping[str, BaseDistribution], n_devices: int, n_layer: int) -> \
        dict[str, BaseDistribution]:
    """The space on `n_devices` devices: `n-cpu-moe` (one GPU's placement) replaced by the keys above, in its place;
    the space's own `split-mode` (layer, tensor) folded into theirs: tensor beside layer and none. Without
    `n-cpu-moe` the space's `split-mode` stays where it can be tensor, else goes (layer is llama.cpp's default)."""
    listed = distributions.get(MODE)
    modes = tuple(listed.choices) if isinstance(listed, CategoricalDistribution) else ("layer",)
    out: dict[str, BaseDistribution] = {}
    for key, d in distributions.items():
        if key == MODE:
            if "n-cpu-moe" not in distributions and TENSOR in modes and n_devices >= 2:
                out[key] = d
            continue
        if key != "n-cpu-moe" or n_devices < 2:
            out[key] = d
            continue
        for i in range(n_devices - 1):
            out[split_key(i)] = IntDistribution(0, n_layer + 1)
        for i in range(n_devices):
            out[experts_key(i)] = IntDistribution(0, n_layer)
        out[ORDER] = distributions.get(ORDER, CategoricalDistribution(EXPERT_ORDERS))  # the space's, if it has one
        out[MODE] = CategoricalDistribution((*(SPLIT_MODES if "layer" in modes else ()),
                                             *((TENSOR,) if TENSOR in modes else ())))
        out[MAIN] = IntDistribution(0, n_devices - 1)
    return out


@dataclass(frozen=True)
class Split:
    """A placement on several devices, as the params say it."""

    counts: tuple[int, ...] | None  # layers per device (-ts); None: llama.cpp's own split (by free memory)
    to_cpu: tuple[int, ...]  # per device: how many of its expert layers keep their experts on the CPU
    order: str = "last"
    main: int | None = None  # -sm none -mg main: every layer on that device
    tensor: bool = False  # -sm tensor: to_cpu is one count, of the model's expert layers (the Meta device's)

    def params(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.tensor:
            out[MODE], out[experts_key(0)] = TENSOR, self.to_cpu[0]
        elif self.main is not None:
            out[MODE], out[MAIN] = "none", self.main
            out[experts_key(self.main)] = self.to_cpu[self.main]
        else:
            out[MODE] = "layer"
            if self.counts is not None:
                out.update({split_key(i): c for i, c in enumerate(self.counts[:-1])})
            out.update({experts_key(i): n for i, n in enumerate(self.to_cpu)})
        out[ORDER] = self.order
        return out


def read_split(params: Mapping[str, Any], n_devices: int, n_layer: int) -> Split:
    """The split the params stand for (keys absent: llama.cpp's default split, no experts on the CPU)."""
    order = str(params.get(ORDER, "last"))
    if params.get(MODE) == TENSOR:
        return Split(None, (int(params.get(experts_key(0), 0)),), order, tensor=True)
    to_cpu = tuple(int(params.get(experts_key(i), 0)) for i in range(n_devices))
    if params.get(MODE, "layer") == "none":
        return Split(None, to_cpu, order, int(params.get(MAIN, 0)))
    if not any(split_key(i) in params for i in range(n_devices - 1)):
        return Split(None, to_cpu, order)
    given = [int(params.get(split_key(i), 0)) for i in range(n_devices - 1)]
    rest = n_layer + 1 - sum(given)
    if rest < 0:
        raise LaunchConfigError(
            f"{', '.join(f'{split_key(i)}={v}' for i, v in enumerate(given))}: {sum(given)} layers, more than the "
            f"model's {n_layer} layers and its output layer")
    return Split((*given, rest), to_cpu, order)


def apply_split(spec: ModelSpec, devices: tuple[Device, ...], config: LaunchConfig, split: Split) -> LaunchConfig:
    """`config` (every layer offloaded) placed as `split` says: -sm tensor, -sm none -mg, or -ts, and the experts'
    rules."""
    if split.tensor:
        config = config.with_given(split_mode=TENSOR)
    elif split.main is not None:
        config = config.with_given(split_mode="none", main_gpu=split.main)
    elif split.counts is not None:
        config = config.with_given(tensor_split=tuple(float(c) for c in split.counts))
    layers = experts_to_cpu(spec, devices, config, split)
    if layers:
        config = config.with_given(overrides=(*config.overrides, experts_rule(layers)))
    return config


def experts_to_cpu(spec: ModelSpec, devices: tuple[Device, ...], config: LaunchConfig, split: Split) -> list[int]:
    """The layers whose experts the split sends to the CPU: per device its first or last n expert layers (-sm
    tensor: of the model's, as on one GPU)."""
    if split.tensor:
        layers = expert_layers(spec)
        n = min(split.to_cpu[0], len(layers))
        return layers[:n] if split.order == "first" else layers[len(layers) - n:]
    out: list[int] = []
    for layers, n in zip(expert_ranges(spec, devices, config), split.to_cpu, strict=True):
        n = min(n, len(layers))
        out += layers[:n] if split.order == "first" else layers[len(layers) - n:]
    return out
