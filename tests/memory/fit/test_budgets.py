"""fitter.memory.fit.budgets: free memory less the fit target, one validated rule for fit, tune and check."""

from __future__ import annotations

import pytest

from fitter.errors import FitterError
from fitter.memory.backends.devices import CUDA, RPC, Device
from fitter.memory.fit.budgets import device_budgets, parse_fit_targets
from fitter.units import MIB

GPUS = (Device("CUDA0", CUDA, 8192 * MIB, 7000 * MIB), Device("CUDA1", CUDA, 8192 * MIB, None))


def test_one_target_for_every_device_or_one_each() -> None:
    assert device_budgets(GPUS, (1024,)) == {"CUDA0": 5976 * MIB, "CUDA1": 7168 * MIB}  # free, else total
    assert device_budgets(GPUS, (1000, 0)) == {"CUDA0": 6000 * MIB, "CUDA1": 8192 * MIB}
    assert device_budgets((Device("RPC0[h:1]", RPC),), (16,)) == {"RPC0[h:1]": None}  # nothing known: not judged


@pytest.mark.parametrize(("targets", "devices", "message"), [
    ((1, 2, 3), GPUS, "--fit-target 1,2,3: 3 values for 2 GPUs (CUDA0, CUDA1); give one value for every GPU or "
                      "exactly one per GPU"),
    ((1, 2), GPUS[:1], "--fit-target 1,2: 2 values for 1 GPU (CUDA0); give one value for every GPU or exactly one "
                       "per GPU"),
    ((1, 2), (*GPUS, GPUS[0]), "--fit-target 1,2: 2 values for 3 GPUs (CUDA0, CUDA1, CUDA0); give one value for "
                               "every GPU or exactly one per GPU"),
])
def test_a_target_list_of_another_length_names_both_counts(targets: tuple[int, ...], devices: tuple[Device, ...],
                                                          message: str) -> None:
    with pytest.raises(FitterError) as e:
        device_budgets(devices, targets)
    assert str(e.value) == message


def test_targets_parse_as_non_negative_mib() -> None:
    assert parse_fit_targets("1024") == (1024,) and parse_fit_targets("16,0") == (16, 0)
    for text, why in (("x", "expected MiB[,MiB...] as integers"), ("-1", "expected non-negative MiB[,MiB...]"),
                      ("", "expected non-negative MiB[,MiB...]")):
        with pytest.raises(FitterError) as e:
            parse_fit_targets(text)
        assert str(e.value) == f"--fit-target {text!r}: {why}"
