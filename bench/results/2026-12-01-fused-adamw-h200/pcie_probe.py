# Host<->device bandwidth on the machine (run with the device's torch): one direction alone, both
# at once, and a pipeline shaped like ShardedAdamW::StreamedUpdate (rows of master, exp_avg and
# exp_avg_sq per bucket, an elementwise update between) with 2, 3 and 4 slots.
import time, torch
dev = torch.device("cuda")
GiB = 1 << 30
total = 8 * GiB  # bytes each way
host_in = torch.empty(total // 4, dtype=torch.float32).pin_memory()
host_out = torch.empty(total // 4, dtype=torch.float32).pin_memory()
host_in.fill_(1.0)
dbuf_in = torch.empty(2 * GiB // 4, dtype=torch.float32, device=dev)
dbuf_out = torch.empty(2 * GiB // 4, dtype=torch.float32, device=dev).fill_(2.0)
s_in, s_out = torch.cuda.Stream(), torch.cuda.Stream()

def run(chunk_bytes, up, down):
    n = chunk_bytes // 4
    dn = dbuf_in.numel()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for i in range(total // chunk_bytes):
        off = i * n
        if up:
            with torch.cuda.stream(s_in):
                dbuf_in[(off % dn):(off % dn) + n].copy_(host_in[off:off + n], non_blocking=True)
        if down:
            with torch.cuda.stream(s_out):
                host_out[off:off + n].copy_(dbuf_out[(off % dn):(off % dn) + n], non_blocking=True)
    torch.cuda.synchronize()
    return total / (time.perf_counter() - t) / 1e9

for chunk in [16 << 20, 64 << 20, 256 << 20]:
    for up, down in [(1, 0), (0, 1), (1, 1)]:
        r = [run(chunk, up, down) for _ in range(2)]
        print(f"chunk {chunk >> 20:4d} MiB up={up} down={down}: {max(r):6.1f} GB/s each way")

def pipeline(b, nslots, total_elems):
    slots = [torch.empty(3, b, device=dev) for _ in range(nslots)]
    grad = torch.randn(b, device=dev)
    hs = [torch.empty(total_elems, dtype=torch.float32).pin_memory() for _ in range(3)]
    for h in hs:
        h.fill_(0.5)
    loaded = [torch.cuda.Event() for _ in range(nslots)]
    updated = [torch.cuda.Event() for _ in range(nslots)]
    stored = [torch.cuda.Event() for _ in range(nslots)]
    compute = torch.cuda.current_stream()
    nb = total_elems // b
    def load(j):
        k = j % nslots
        with torch.cuda.stream(s_in):
            s_in.wait_event(stored[k])
            for r in range(3):
                slots[k][r].copy_(hs[r][j * b:(j + 1) * b], non_blocking=True)
            loaded[k].record(s_in)
    for _ in range(2):
        torch.cuda.synchronize()
        t = time.perf_counter()
        for j in range(min(nslots - 1, nb)):
            load(j)
        for j in range(nb):
            k = j % nslots
            if j + nslots - 1 < nb:
                load(j + nslots - 1)
            compute.wait_event(loaded[k])
            w, m, v = slots[k][0], slots[k][1], slots[k][2]
            m.mul_(0.9).add_(grad, alpha=0.1)
            v.mul_(0.999).addcmul_(grad, grad, value=0.001)
            w.addcdiv_(m, v.sqrt().add_(1e-8), value=-1e-3)
            w.to(torch.bfloat16)
            updated[k].record(compute)
            with torch.cuda.stream(s_out):
                s_out.wait_event(updated[k])
                for r in range(3):
                    hs[r][j * b:(j + 1) * b].copy_(slots[k][r], non_blocking=True)
                stored[k].record(s_out)
        torch.cuda.synchronize()
        dt = time.perf_counter() - t
    return nb * b * 12 / dt / 1e9, dt

elems = 768 << 20  # 9 GiB of state
for b in [4 << 20, 16 << 20, 64 << 20]:
    for nslots in [2, 3, 4]:
        gbs, dt = pipeline(b, nslots, elems)
        print(f"pipeline bucket {b >> 20:3d}M elements, {nslots} slots: {gbs:6.1f} GB/s each way")
