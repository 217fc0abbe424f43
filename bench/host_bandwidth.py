"""What the host can move, for sizing the offloaded optimizer: memory bandwidth of a copy and an
add (float32, 1 GiB arrays) at 1 to 16 threads, copies between the GPU and pinned or pageable host
memory, and the time to pin host memory.

    python3 bench/host_bandwidth.py          # on a GPU machine (torch with CUDA)

docs/benchmarks.md ("Measured: the full AdamW step on one H100") quotes its output.
"""
import time

import torch

N = 1 << 28  # 1 GiB of float32


def best_of(fn, repeats=3):
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def main():
    a, b, c = torch.ones(N), torch.ones(N), torch.ones(N)
    for threads in (1, 4, 8, 16):
        torch.set_num_threads(threads)
        copy = best_of(lambda: a.copy_(b))
        add = best_of(lambda: torch.add(a, b, out=c))
        print(f"threads {threads}: copy {2 * 4 * N / copy / 1e9:.1f} GB/s, add {3 * 4 * N / add / 1e9:.1f} GB/s")
    if not torch.cuda.is_available():
        return
    gpu = torch.ones(N, device="cuda")
    pinned, pageable = torch.empty(N, pin_memory=True), torch.empty(N)

    def to_host(dst):
        dst.copy_(gpu, non_blocking=True)
        torch.cuda.synchronize()

    def to_gpu(src):
        gpu.copy_(src, non_blocking=True)
        torch.cuda.synchronize()

    for name, fn in [("D2H pinned", lambda: to_host(pinned)), ("D2H pageable", lambda: to_host(pageable)),
                     ("H2D pinned", lambda: to_gpu(pinned)), ("H2D pageable", lambda: to_gpu(pageable))]:
        print(f"{name}: {4 * N / best_of(fn) / 1e9:.1f} GB/s")
    start = time.perf_counter()
    torch.empty(1 << 33, dtype=torch.float32).pin_memory()
    print(f"pinning 32 GiB: {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
