"""The Gated DeltaNet rule as Flash Linear Attention (FLA) computes it: the baseline of
`dta-linear-attention-bench --what=rule` (the kernels a Qwen3-Next user would otherwise train
with; transformers calls them when `fla` is installed).

Same shapes and timing as the C++ bench: Qwen3-Next's 16 key / 32 value heads (GVA), Dk = Dv = 128,
64-token chunks, one chain of T tokens, wall-clock medians between device synchronisations, and
the same FLOP count (bench/linear_attention_bench.cc's RuleFlops, backward twice forward). Inputs
are q and k L2-normalised, v, log decays g and betas like the C++ bench's rule workload; FLA runs
them in bfloat16 (its usual path) and in float32. The error column is the output's, v's and q's
gradients' largest difference from the per-token recurrence in float64 on the first 256
tokens, relative to the largest entry.

The GPU machines have no package index: scripts/device_deps.sh fetches FLA's pinned wheels into
.deps/wheels; install them with
  pip install --no-index --no-deps --target /tmp/fla .deps/wheels/{fla_core,flash_linear_attention,einops}-*.whl
and run with PYTHONPATH=/tmp/fla python bench/gated_delta_baseline.py --tokens=4096,16384
"""

import argparse
import statistics
import time

import torch

KEY_HEADS, VALUE_HEADS, HEAD_DIM, CHUNK = 16, 32, 128, 64
PEAK_TFLOPS = {"bf16": 989, "tf32": 494, "fp32": 67}  # H200 dense


def rule_flops(t):
    """The chunked rule's forward FLOPs, as bench/linear_attention_bench.cc counts them."""
    c, dk, dv = CHUNK, HEAD_DIM, HEAD_DIM
    chunks = (t + CHUNK - 1) // CHUNK
    per_chunk = 4 * c * c * dk + c * c * (dv + dk) + 6 * c * dk * dv + 2 * c * c * dv
    return per_chunk * chunks * VALUE_HEADS


def median_ms(fn, runs, warmups):
    for _ in range(warmups):
        fn()
    times = []
    for _ in range(runs):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def inputs(t, dtype, seed=1):
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, device="cuda", generator=gen, dtype=torch.float32)

    q = torch.nn.functional.normalize(randn(1, t, KEY_HEADS, HEAD_DIM), dim=-1)
    k = torch.nn.functional.normalize(randn(1, t, KEY_HEADS, HEAD_DIM), dim=-1)
    v = randn(1, t, VALUE_HEADS, HEAD_DIM)
    g = -0.1 * torch.rand(1, t, VALUE_HEADS, device="cuda", generator=gen)
    beta = torch.sigmoid(randn(1, t, VALUE_HEADS))
    seed = randn(1, t, VALUE_HEADS, HEAD_DIM)
    cast = [x.to(dtype).requires_grad_(True) for x in (q, k, v)]
    return cast + [g.requires_grad_(True), beta.to(dtype).requires_grad_(True), seed]


def reference(q, k, v, g, beta, seed):
    """Output, v's and q's gradients of the per-token recurrence in float64 (GVA expanded)."""
    groups = VALUE_HEADS // KEY_HEADS
    x = [t.detach().double().requires_grad_(True) for t in (q, k, v, g, beta)]
    qe, ke = (t.repeat_interleave(groups, dim=2)[0] for t in x[:2])
    v64, g64, beta64 = x[2][0], x[3][0], x[4][0]
    state = torch.zeros(VALUE_HEADS, HEAD_DIM, HEAD_DIM, dtype=torch.float64, device=q.device)
    rows = []
    for i in range(q.shape[1]):
        state = state * g64[i].exp()[:, None, None]
        delta = (v64[i] - torch.einsum("hk,hkv->hv", ke[i], state)) * beta64[i][:, None]
        state = state + ke[i][:, :, None] * delta[:, None, :]
        rows.append(torch.einsum("hk,hkv->hv", qe[i] * HEAD_DIM**-0.5, state))
    out = torch.stack(rows)[None]
    grad_v, grad_q = torch.autograd.grad((out * seed.double()).sum(), [x[2], x[0]])
    return out.detach(), grad_v, grad_q


def relative(a, b):
    return ((a.double() - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", default="1024,4096,16384", help="comma-separated chain lengths")
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--warmups", type=int, default=3)
    args = parser.parse_args()
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    import fla.ops.common.chunk_o as chunk_o

    if chunk_o.IS_NVIDIA_HOPPER and chunk_o.TRITON_ABOVE_3_4_0 and not chunk_o.TRITON_ABOVE_3_7_1:
        # FLA refuses its gated dq/dk backward kernel under these Triton versions on Hopper (its
        # issue #640: wrong results), pointing to TileLang instead, which the GPU machines lack.
        # Timed anyway: the dq column says whether this run's gradients are the wrong ones.
        chunk_o.TRITON_ABOVE_3_7_1 = True
        print(f"note: Triton {__import__('triton').__version__} on Hopper: FLA's guard against "
              "its issue #640 lifted to time it; see the dq error column\n")

    def rule(q, k, v, g, beta):
        return chunk_gated_delta_rule(q, k, v, g, beta, scale=HEAD_DIM**-0.5)[0]

    print(
        f"FLA {__import__('fla').__version__} chunk_gated_delta_rule, {KEY_HEADS} key / "
        f"{VALUE_HEADS} value heads, Dk = Dv = {HEAD_DIM}, on {torch.cuda.get_device_name()}; "
        f"median of {args.runs} runs, wall-clock ms between synchronisations\n"
    )
    print("| inputs | T | fwd ms | fwd+bwd ms | over bound bf16 / fp32 | rel. error out / dv / dq (first 256 tokens) |")
    print("| --- | ---: | ---: | ---: | --- | --- |")
    for t in (int(x) for x in args.tokens.split(",")):
        flops = 3 * rule_flops(t)
        bound = {name: flops / (peak * 1e12) * 1e3 for name, peak in PEAK_TFLOPS.items()}
        for name, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
            q, k, v, g, beta, seed = inputs(t, dtype)

            def step():
                out = rule(q, k, v, g, beta)
                torch.autograd.grad((out.float() * seed).sum(), [q, k, v, g, beta])

            forward = median_ms(lambda: rule(q, k, v, g, beta), args.runs, args.warmups)
            both = median_ms(step, args.runs, args.warmups)
            head = [x[:, :256].detach().requires_grad_(True) for x in (q, k, v, g, beta)]
            out = rule(*head)
            grad_v, grad_q = torch.autograd.grad((out.float() * seed[:, :256]).sum(), [head[2], head[0]])
            ref_out, ref_grad, ref_grad_q = reference(*head, seed[:, :256])
            print(
                f"| {name} | {t} | {forward:.3f} | {both:.3f} | {both / bound['bf16']:.1f}x / "
                f"{both / bound['fp32']:.1f}x | {relative(out, ref_out):.1e} / "
                f"{relative(grad_v, ref_grad):.1e} / {relative(grad_q, ref_grad_q):.1e} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
