"""Settings of the build that the test run depends on."""
from __future__ import annotations

import os
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_gtest_discovery_waits_for_binaries_slow_to_start():
    """CTest lists each GoogleTest binary's cases (--gtest_list_tests) when it starts; with CMake's
    default 5 s, a LibTorch binary starting on a loaded 2-core machine failed the whole run before
    any test ran. Every suite's discovery must allow minutes."""
    build = Path(os.environ.get("DTA_BUILD_DIR", REPO / "build"))
    scripts = sorted(build.glob("tests/**/*_include.cmake"))
    assert len(scripts) > 20, f"no GoogleTest discovery scripts under {build}/tests: is it built?"
    for script in scripts:
        timeout = re.search(r"TEST_DISCOVERY_TIMEOUT \[==\[(\d+)\]==\]", script.read_text())
        assert timeout is not None, f"{script} sets no discovery timeout"
        assert int(timeout[1]) >= 120, f"{script}: discovery gives up after {timeout[1]} s"
