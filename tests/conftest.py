"""Shared pytest fixtures and the rules of the markers.

- fitter's home: the session starts in a fresh folder (so module- and session-scoped fixtures never touch the user's
  ~/.cache/fitter), and every test in a fresh folder of its own (`_fitter_home`).
- The llama.cpp tools a set-up built (`python -m fitter.measure.llamacpp.tools`) are looked up once, in the home the
  session started with ($FITTER_HOME, else ~/.cache/fitter), before that home is replaced: the `llama_tools` fixture.
- Markers (pyproject.toml): `llama` skips where llama-cpp-python is not installed; `gpu` where NVML sees no NVIDIA
  GPU; `tools(NAME…)` where those tools are not built, unless FITTER_REQUIRE_TOOLS=1 (.ci/run sets it, so a
  missing build step fails there instead of skipping); `vulkan` where fitter's Vulkan build of llama.cpp
  (`.ci/setup --vulkan`) or Mesa's lavapipe is missing, under the same rule; `slow` marks the long matrices the
  default test command deselects (.ci/run runs them as its second command); `load` marks the tests a loaded
  machine once failed, which tests/test_under_load.py runs beside two busy processes.
- Property tests (hypothesis) run under the `fitter` profile: the same examples on every run (`derandomize`), no
  example database or cache left in the clone, a deadline per example; each test sets its own `max_examples`.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import Phase, settings
from hypothesis.configuration import set_hypothesis_home_dir

from fitter.machine.llama_cpp import llama_cpp_python_problem
from fitter.measure.llamacpp.tools import TOOLS, tools_dir
from fitter.paths import fitter_home
from tests.folders import process_folder

pytest_plugins = ["pytester"]  # tests/test_markers.py runs the markers on a pytest of its own

# The user's (or CI's) home, where the tools were built: resolved once, by the first process of the session (a
# pytest-xdist worker inherits the environment its controller set, so it reads the home the controller started with).
STARTING_HOME = Path(os.environ.setdefault("FITTER_TEST_STARTING_HOME", str(fitter_home())))
BUILT_TOOLS = STARTING_HOME / "tools" / tools_dir().name  # the recipe names the folder, the home holds it
BUILT_VULKAN = STARTING_HOME / "tools" / tools_dir("vulkan").name  # fitter's Vulkan build (.ci/setup --vulkan)
SESSION_HOME = process_folder("fitter-test-session-home-")
os.environ["FITTER_HOME"] = str(SESSION_HOME)  # before any test module is imported or any fixture runs

# CI's 2 cores run every property example in tens of milliseconds: a deadline of seconds only catches a runaway.
# No explain phase: it re-runs a failure a thousand times (a minute here) to comment the minimal example. Hypothesis's
# own caches (unicode tables, literals of the code under test) go to the session folder, not .hypothesis/ in the clone.
set_hypothesis_home_dir(os.environ.get("HYPOTHESIS_STORAGE_DIRECTORY") or SESSION_HOME / "hypothesis")
settings.register_profile("fitter", derandomize=True, database=None, deadline=3000, print_blob=False,
                          phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink])
settings.load_profile("fitter")


def _gpu_problem() -> str | None:
    from fitter.machine.nvidia import detect_nvidia

    gpus, nvidia = detect_nvidia()
    return None if gpus else f"needs an NVIDIA GPU: {nvidia.error or 'NVML sees none'}"


def marker_skips(item: pytest.Item, llama_problem: str | None, gpu_problem: str | None,
                 tools: Path, require_tools: bool) -> str | None:
    """Why `item` cannot run here (its markers against what this machine has), or None."""
    if item.get_closest_marker("llama") is not None and llama_problem is not None:
        return f"needs llama-cpp-python: {llama_problem}"
    if item.get_closest_marker("gpu") is not None and gpu_problem is not None:
        return gpu_problem
    marker = item.get_closest_marker("tools")
    if marker is not None:
        missing = [name for name in marker.args or TOOLS if not (tools / name).is_file()]
        if missing and not require_tools:
            return f"llama.cpp's {', '.join(missing)} not built in {tools} (python -m fitter.measure.llamacpp.tools)"
    if item.get_closest_marker("vulkan") is not None and not require_tools:
        return vulkan_problem()
    return None


def vulkan_problem() -> str | None:
    """Why the emulated Vulkan GPU's tests cannot run here (fitter's Vulkan build or lavapipe missing), or None."""
    from fitter.measure.emulator.emulated_vulkan import emulated_vulkan_problem

    if not (BUILT_VULKAN / "llama-server").is_file():
        return f"fitter's Vulkan build of llama.cpp is not in {BUILT_VULKAN} (bash .ci/setup --vulkan)"
    return emulated_vulkan_problem(BUILT_VULKAN / "llama-server")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    llama = llama_cpp_python_problem()
    gpu = _gpu_problem() if any(i.get_closest_marker("gpu") for i in items) else None
    require = os.environ.get("FITTER_REQUIRE_TOOLS") == "1"
    for item in items:
        why = marker_skips(item, llama, gpu, BUILT_TOOLS, require)
        if why is not None:
            item.add_marker(pytest.mark.skip(reason=why))


@pytest.fixture
def llama_tools(request: pytest.FixtureRequest) -> dict[str, Path]:
    """The built llama.cpp tools by name; a tool the test's `tools` marker names that is missing fails the test
    (it was not skipped: FITTER_REQUIRE_TOOLS=1)."""
    marker = request.node.get_closest_marker("tools")
    missing = [name for name in (marker.args if marker else ()) or TOOLS if not (BUILT_TOOLS / name).is_file()]
    if marker is not None and missing:
        pytest.fail(f"llama.cpp's {', '.join(missing)} not built in {BUILT_TOOLS}: the set-up must build them "
                    "(python -m fitter.measure.llamacpp.tools)")
    return {name: BUILT_TOOLS / name for name in TOOLS}


@pytest.fixture
def vulkan_build(request: pytest.FixtureRequest) -> Path:
    """fitter's Vulkan build's folder; a `vulkan` test fails where it is missing (it was not skipped:
    FITTER_REQUIRE_TOOLS=1)."""
    why = vulkan_problem()
    if why is not None:
        pytest.fail(f"the emulated Vulkan GPU cannot run: {why}; the set-up must provide it (bash .ci/setup --vulkan)")
    return BUILT_VULKAN


@pytest.fixture(autouse=True)
def _fitter_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Keep every test's cache (generated models, results) in a folder of its own."""
    home = tmp_path / "home"
    monkeypatch.setenv("FITTER_HOME", str(home))
    return home
