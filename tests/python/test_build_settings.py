"""Settings of the build that the test run depends on."""
from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest

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


def test_libtorch_units_compile_with_the_precompiled_headers():
    """Every LibTorch unit includes the precompiled LibTorch headers (cmake/DtaTorchPch.cmake), and
    GCC really uses them: it silently parses the headers again when any macro or code-generation
    flag differs from the header's build (-Winvalid-pch only warns), which would double CI's build
    time unnoticed. One unit of each kind is compiled again: a library of the executor, a library
    linking gRPC's threads, a test and a binary."""
    build = Path(os.environ.get("DTA_BUILD_DIR", REPO / "build"))
    if re.search(r"^DTA_NO_PCH:BOOL=(ON|TRUE|1)$", (build / "CMakeCache.txt").read_text(), re.M):
        pytest.skip(f"{build} is configured with -DDTA_NO_PCH=ON")
    commands = {Path(e["file"]).relative_to(REPO).as_posix(): e
                for e in json.loads((build / "compile_commands.json").read_text())}
    torch_units = [f for f, e in commands.items()
                   if f.startswith("executor/") and f.endswith(".cc") and "cmake_pch" not in f]
    assert len(torch_units) > 20, "no executor units in compile_commands.json: is build/ configured?"
    skipped = [f for f in torch_units
               if "cmake_pch.hxx" not in commands[f]["command"] and f != "executor/optim/host_adamw.cc"]
    assert not skipped, f"LibTorch units without the precompiled headers: {skipped}"

    for unit in ["executor/engine/dta.cc", "apps/trainer/checkpoints.cc",
                 "tests/executor/engine/equivalence_test.cc", "apps/train/train_main.cc"]:
        entry = commands[unit]
        argv = shlex.split(entry["command"])
        output = argv.index("-o")
        del argv[output:output + 2]
        argv += ["-fsyntax-only", "-H", "-Werror=invalid-pch"]
        run = subprocess.run(argv, cwd=entry["directory"], capture_output=True, text=True)
        assert run.returncode == 0, f"{unit}: {run.stderr[-3000:]}"
        # -H lists every header read; "! X.gch" is a precompiled header used in place of X.
        first = run.stderr.splitlines()[0] if run.stderr else ""
        assert first.startswith("! ") and first.endswith("cmake_pch.hxx.gch"), \
            f"{unit} parsed the LibTorch headers itself: {first!r}"
