#!/usr/bin/env python3
"""Checks the include graph of dta's C++ sources against its layers (docs/architecture.md).

    core/        torch-free and gRPC-free: includes only core/ (and absl, simdjson, nlohmann, xxhash)
    kernels/     core/ and kernels/, LibTorch and CUDA
    executor/    core/, kernels/ and executor/, LibTorch: never dispatcher/ or proto/
    dispatcher/  core/, proto/ and dispatcher/, gRPC and Protobuf: never executor/, kernels/ or LibTorch
    apps/, bench/, bindings/   on top: anything but tests/

Inside core/, base/ is the bottom: core/base includes nothing else of ours. No source outside
tests/ includes tests/.

Usage: check_layers.py [ROOT]       prints every forbidden include as FILE:LINE: ..., exit 1 if any
       check_layers.py --self-test  plants a forbidden include of each kind in a scratch tree and
                                    checks that each is reported (and that a clean tree passes)
"""
import os
import re
import sys
import tempfile

SOURCE_SUFFIXES = (".h", ".hpp", ".cc", ".cpp", ".cu", ".cuh")
INCLUDE = re.compile(r'^\s*#\s*include\s*([<"])([^>"]+)[>"]')

# Project folders: an include whose first component is one of these names a layer.
LAYERS = ("core", "kernels", "executor", "dispatcher", "proto", "apps", "bench", "bindings", "tests")
TORCH = ("ATen/", "torch/", "c10/", "cuda", "cuda_runtime", "cub/", "cutlass/", "cute/", "nccl")
GRPC = ("grpc", "grpcpp/", "google/protobuf/", "proto/")

# layer -> (project layers it may include, third-party prefixes it must not include)
RULES = {
    "core": ({"core"}, TORCH + GRPC),
    "kernels": ({"core", "kernels"}, GRPC),
    "executor": ({"core", "kernels", "executor"}, GRPC),
    "dispatcher": ({"core", "proto", "dispatcher"}, TORCH),
    "apps": (set(LAYERS) - {"tests"}, ()),
    "bench": (set(LAYERS) - {"tests"}, ()),
    "bindings": (set(LAYERS) - {"tests"}, ()),
}


def violations(root):
    found = []
    for layer, (allowed, forbidden_prefixes) in RULES.items():
        top = os.path.join(root, layer)
        for directory, _, files in os.walk(top):
            for name in sorted(files):
                if not name.endswith(SOURCE_SUFFIXES):
                    continue
                path = os.path.join(directory, name)
                relative = os.path.relpath(path, root)
                with open(path, encoding="utf-8", errors="replace") as source:
                    for number, line in enumerate(source, 1):
                        match = INCLUDE.match(line)
                        if not match:
                            continue
                        included = match.group(2)
                        first = included.split("/", 1)[0]
                        where = f"{relative}:{number}: {layer}/ includes {included}"
                        if "/" in included and first in LAYERS:
                            if first not in allowed:
                                found.append(f"{where} ({first}/ is not below {layer}/)")
                            elif (layer == "core" and relative.startswith("core/base/")
                                  and not included.startswith("core/base/")):
                                found.append(f"{where} (core/base/ includes nothing else of ours)")
                        elif included.startswith(forbidden_prefixes):
                            found.append(f"{where} ({layer}/ must not depend on it)")
    return found


def self_test():
    planted = {
        "core/tree/a.h": '#include "executor/engine/executor.h"\n',
        "core/io/b.cc": "#include <ATen/ATen.h>\n",
        "core/io/c.cc": '#include "proto/dta/v1/dispatcher.pb.h"\n',
        "core/base/d.h": '#include "core/tree/prefix_tree.h"\n',
        "executor/model/e.cc": '#include "dispatcher/client/trainer_session.h"\n',
        "executor/engine/f.cc": "#include <grpcpp/grpcpp.h>\n",
        "dispatcher/core/g.cc": '#include "executor/engine/executor.h"\n',
        "dispatcher/wire/h.cc": "#include <torch/torch.h>\n",
        "kernels/i.cu": '#include "executor/model/decoder.h"\n',
        "apps/train/j.cc": '#include "tests/testing/process.h"\n',
    }
    clean = {
        "core/tree/ok.cc": '#include "core/base/ids.h"\n#include "absl/status/status.h"\n#include <vector>\n',
        "executor/engine/ok.cc": '#include "core/tree/schedule.h"\n#include "kernels/tree_attention.h"\n#include <ATen/ATen.h>\n',
        "dispatcher/core/ok.cc": '#include "proto/dta/v1/log.pb.h"\n#include <grpcpp/grpcpp.h>\n',
        "apps/trainer/ok.cc": '#include "dispatcher/client/trainer_session.h"\n#include "executor/engine/executor.h"\n',
    }
    with tempfile.TemporaryDirectory() as root:
        for files in (clean, planted):
            for relative, text in files.items():
                os.makedirs(os.path.dirname(os.path.join(root, relative)), exist_ok=True)
                with open(os.path.join(root, relative), "w") as out:
                    out.write(text)
            if files is clean:
                found = violations(root)
                if found:
                    print("self-test: a clean tree was reported:\n" + "\n".join(found))
                    return 1
        found = violations(root)
    missed = [f for f in planted if not any(v.startswith(f + ":") for v in found)]
    extra = [v for v in found if v.split(":", 1)[0] not in planted]
    if missed or extra or len(found) != len(planted):
        print(f"self-test failed: missed {missed}, extra {extra}, found {found}")
        return 1
    print(f"self-test: all {len(planted)} planted forbidden includes reported, the clean tree passed")
    return 0


def main(argv):
    if len(argv) > 1 and argv[1] == "--self-test":
        return self_test()
    root = argv[1] if len(argv) > 1 else os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
    found = violations(root)
    for line in found:
        print(line)
    if found:
        print(f"check_layers: {len(found)} forbidden include(s); see docs/architecture.md for the layers")
        return 1
    print("check_layers: the include graph respects the layers")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
