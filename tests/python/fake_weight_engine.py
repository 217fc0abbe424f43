"""A rollout engine's weight-update side, for test_weight_sync.py and bench/weight_sync_bench.py.

One process is one engine worker (tp * pp = 1). It serves SGLang's routes (``--kind=sglang``:
/init_weights_update_group, /pause_generation, /update_weights_from_distributed,
/continue_generation, /destroy_weights_update_group, /update_weights_from_disk) or AReaL's vLLM
server's (``--kind=areal-vllm``: /areal_init_weights_update_group, /areal_pause_generation,
/areal_set_update_weight_meta, /areal_update_weights_xccl, /areal_continue_generation,
/areal_update_weights), with those servers' JSON fields, and joins the trainer's group as they do:
AReaL's ``init_custom_process_group`` (torch's TCPStore rendezvous under a PrefixStore of the group
name) at rank ``rank_offset``, then one ``broadcast(src=0)`` per tensor of each update request.

With ``--device=cuda:N`` (bench/weight_sync_bench.py) the tensors are received on that GPU over
NCCL and kept there until the next pause, not saved.

It records, in ``<out>/events.json`` (rewritten after each request), every request in order, and
after each continue following updates, the tensors received since the pause in
``<out>/sync-<n>.safetensors`` (n from 1). It writes its URL to ``<out>/url`` once it listens.

Faults (``--fault``): ``die:N`` exits at once on the first update request of the N-th sync;
``hang:N`` never answers the update requests of the N-th sync and later ones (nor joins their
broadcasts).
"""
from __future__ import annotations

import argparse
import json
import os
import threading
import time
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file

try:  # imported before the engine listens: it takes seconds, longer than a test's rendezvous timeout
    from areal.engine.core.distributed import init_custom_process_group
except ImportError:  # the GPU machines have torch without AReaL: the calls SGLang and AReaL make
    def init_custom_process_group(backend, init_method, timeout, world_size, rank, group_name):
        from torch.distributed.distributed_c10d import (Backend, PrefixStore, _new_process_group_helper,
                                                        _world, rendezvous)
        store, rank, world_size = next(rendezvous(init_method, rank, world_size, timeout=timeout))
        store.set_timeout(timeout)
        group, _ = _new_process_group_helper(world_size, rank, [], Backend(backend), PrefixStore(group_name, store),
                                             group_name=group_name, timeout=timeout, group_desc=group_name)
        _world.pg_group_ranks[group] = {i: i for i in range(world_size)}
        return group

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


class Engine:
    def __init__(self, kind: str, out: Path, fault: str, timeout_s: float, device: str) -> None:
        self.kind, self.out, self.timeout, self.device = kind, out, timedelta(seconds=timeout_s), device
        self.fault_kind, _, at = fault.partition(":")
        self.fault_at = int(at) if at else 0
        self.events: list[dict] = []
        self.lock = threading.Lock()
        self.group = None
        self.group_name = ""
        self.meta: dict | None = None  # AReaL: the next update's specs
        self.received: dict[str, torch.Tensor] = {}
        self.syncs = 0  # pauses so far
        self.saved = 0

    def record(self, event: dict) -> None:
        with self.lock:
            self.events.append({"time": time.time(), **event})
            (self.out / "events.json.tmp").write_text(json.dumps(self.events))
            os.replace(self.out / "events.json.tmp", self.out / "events.json")

    def init_group(self, body: dict) -> dict:
        self.record({"route": "init", "body": body})
        rank = body["rank_offset"]
        self.group = init_custom_process_group(
            backend=body["backend"], init_method=f"tcp://{body['master_address']}:{body['master_port']}",
            world_size=body["world_size"], rank=rank, group_name=body["group_name"], timeout=self.timeout)
        self.group_name = body["group_name"]
        self.record({"route": "joined", "group_name": self.group_name, "rank": rank})
        return {"success": True, "message": "joined"}

    def receive(self, names: list[str], dtypes: list[str], shapes: list[list[int]], group_name: str) -> dict:
        if self.fault_kind == "die" and self.syncs == self.fault_at:
            os._exit(3)
        if self.fault_kind == "hang" and self.syncs >= self.fault_at:
            time.sleep(3600)
        if group_name != self.group_name or self.group is None:
            return {"success": False, "message": f"unknown group {group_name}"}
        tensors = [torch.empty(shape, dtype=DTYPES[dtype], device=self.device)
                   for dtype, shape in zip(dtypes, shapes)]
        works = [dist.broadcast(t, src=0, group=self.group, async_op=True) for t in tensors]
        for work in works:
            work.wait()
        if tensors and tensors[0].is_cuda:
            torch.cuda.synchronize()  # NCCL's wait only orders the stream: hold them before answering
        for name, tensor in zip(names, tensors):
            assert name not in self.received, f"{name} received twice in one sync"
            self.received[name] = tensor if self.device != "cpu" else tensor.clone()
        return {"success": True, "message": "updated"}

    def handle(self, route: str, body: dict) -> tuple[int, dict]:
        sglang = self.kind == "sglang"
        if route == ("/init_weights_update_group" if sglang else "/areal_init_weights_update_group"):
            return 200, self.init_group(body)
        if route == ("/pause_generation" if sglang else "/areal_pause_generation"):
            self.syncs += 1
            self.received = {}
            self.record({"route": "pause", "body": body})
            return 200, {"success": True}
        if route == ("/continue_generation" if sglang else "/areal_continue_generation"):
            if self.received and self.device == "cpu":
                self.saved += 1
                save_file(self.received, str(self.out / f"sync-{self.saved}.safetensors"))
                self.received = {}
            self.record({"route": "continue", "saved": self.saved})
            return 200, {"success": True}
        if sglang and route == "/update_weights_from_distributed":
            self.record({"route": "update", "body": body})
            answer = self.receive(body["names"], body["dtypes"], body["shapes"], body["group_name"])
            self.record({"route": "updated", "answer": answer})
            return 200, answer
        if not sglang and route == "/areal_set_update_weight_meta":
            self.meta = body
            self.record({"route": "meta", "body": body})
            return 200, {"success": True}
        if not sglang and route == "/areal_update_weights_xccl":
            meta, self.meta = self.meta, None
            self.record({"route": "update", "body": meta})
            if meta is None:
                return 400, {"success": False, "message": "no meta"}
            answer = self.receive(meta["names"], meta["dtypes"], meta["shapes"], meta["group_name"])
            self.record({"route": "updated", "answer": answer})
            return 200, answer
        if route == ("/update_weights_from_disk" if sglang else "/areal_update_weights"):
            self.record({"route": "reload", "body": body})
            return 200, {"success": True}
        if sglang and route == "/destroy_weights_update_group":
            self.record({"route": "destroy", "body": body})
            if body.get("group_name") == self.group_name and self.group is not None:
                group, self.group = self.group, None
                dist.destroy_process_group(group)
            return 200, {"success": True}
        return 404, {"detail": "Not Found"}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--kind", choices=["sglang", "areal-vllm"], required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--fault", default="")
    parser.add_argument("--timeout_s", type=float, default=30)
    parser.add_argument("--device", default="cpu",
                        help="where tensors are received (cuda:N joins with NCCL; only cpu saves them)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.device.startswith("cuda"):
        torch.cuda.set_device(torch.device(args.device))
    engine = Engine(args.kind, args.out, args.fault, args.timeout_s, args.device)

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 (http.server's name)
            length = int(self.headers.get("Content-Length", "0"))
            body = json.loads(self.rfile.read(length) or b"{}")
            try:
                status, answer = engine.handle(self.path, body)
            except Exception as e:  # noqa: BLE001 (answered, as the engines answer)
                engine.record({"route": "error", "path": self.path, "error": repr(e)})
                status, answer = 200, {"success": False, "message": repr(e)}
            payload = json.dumps(answer).encode()
            self.send_response(status)
            for header, value in (("Content-Type", "application/json"), ("Content-Length", str(len(payload)))):
                self.send_header(header, value)
            self.end_headers()
            self.wfile.write(payload)

        def log_message(self, *args) -> None:  # quiet: events.json is the record
            return

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    # Written then renamed: the test reads the file as soon as it exists, so it must never see it empty.
    (args.out / "url.tmp").write_text(f"http://127.0.0.1:{server.server_address[1]}")
    (args.out / "url.tmp").rename(args.out / "url")
    server.serve_forever()


if __name__ == "__main__":
    main()
