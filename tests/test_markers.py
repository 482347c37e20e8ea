"""The test suite's own rules (tests/conftest.py): markers skip what this machine cannot run, and no test or
fixture touches the fitter home the session started with."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.conftest import SESSION_HOME, STARTING_HOME

CONFTEST = Path(__file__).parent / "conftest.py"


@pytest.fixture(scope="module")
def module_home() -> str:
    """What a module-scoped fixture sees: it runs before the per-test home of the autouse fixture exists."""
    return os.environ["FITTER_HOME"]


def test_module_fixtures_see_the_session_home_never_the_users(module_home: str) -> None:
    assert Path(module_home) == SESSION_HOME != STARTING_HOME
    assert os.environ["FITTER_HOME"] != module_home  # and each test a home of its own


def _run_marked(pytester: pytest.Pytester, marker: str, *plugins: str) -> pytest.RunResult:
    pytester.makeconftest(CONFTEST.read_text())
    pytester.makepyfile(test_marked=f"import pytest\n\n@pytest.mark.{marker}\ndef test_it():\n    assert True\n")
    return pytester.runpytest_subprocess(*(a for p in plugins for a in ("-p", p)), "-rs")


def test_a_llama_test_is_skipped_where_llama_cpp_python_is_missing(pytester: pytest.Pytester) -> None:
    # the `llama` marker skips, it is not a failure: an install without llama-cpp-python runs everything else
    pytester.makepyfile(hide_llama="import importlib.util\n_real = importlib.util.find_spec\n"
                        "importlib.util.find_spec = "
                        "lambda name, *a: None if name == 'llama_cpp' else _real(name, *a)\n")
    result = _run_marked(pytester, "llama", "hide_llama")
    result.assert_outcomes(skipped=1)
    result.stdout.fnmatch_lines(["*needs llama-cpp-python: llama-cpp-python is not installed*"])


def test_a_tools_test_skips_without_the_tools_and_fails_when_ci_requires_them(pytester: pytest.Pytester,
                                                                             tmp_path: Path) -> None:
    pytester.makeconftest(CONFTEST.read_text())
    pytester.makepyfile(test_marked="import pytest\n\n@pytest.mark.tools('llama-server')\n"
                        "def test_it(llama_tools):\n    assert llama_tools['llama-server'].is_file()\n")
    empty = {"FITTER_HOME": str(tmp_path / "no-tools")}
    with pytest.MonkeyPatch.context() as mp:
        for k, v in empty.items():
            mp.setenv(k, v)
        mp.delenv("FITTER_REQUIRE_TOOLS", raising=False)
        mp.delenv("FITTER_TEST_STARTING_HOME", raising=False)  # this session's: the inner one starts from `empty`
        skipped = pytester.runpytest_subprocess("-rs")
        mp.setenv("FITTER_REQUIRE_TOOLS", "1")
        required = pytester.runpytest_subprocess()
    skipped.assert_outcomes(skipped=1)
    skipped.stdout.fnmatch_lines(["*llama.cpp's llama-server not built in*"])
    required.assert_outcomes(errors=1)
    required.stdout.fnmatch_lines(["*the set-up must build them*"])
