#include "kernels/chunk_state_recurrence.h"

#include <c10/util/Exception.h>
#include <torch/csrc/autograd/custom_function.h>

#include "core/base/env_switch.h"
#include "kernels/float32_bmm.h"

namespace dta::kernels {

#ifdef DTA_KERNELS_HAVE_CUDA
namespace internal {
// In kernels/chunk_state_recurrence.cu. Whether the kernel takes a chunk of `chunk` rows and key
// dim `dk` in `type` on CUDA device `device` (its shared memory fits).
bool ChunkScanFits(at::ScalarType type, int64_t chunk, int64_t dk, int device);
// One launch of the scan (the .cu's comment): forward with a = W, b = Kd, add_a = U, init = S0
// writes carried = h, rows = v_new, last = S_final; backward (reversed) with a = Kd, b = W,
// add_a = dv_new, add_b = dh, init = dS_final writes carried = g_i, rows = dvt, last = dS0.
// Contiguous tensors of one type on one device; add_a, add_b and init may be undefined (zeros).
// offsets: the segments' chunk offsets (S + 1 of them; {0, N} for one); init and last are
// [S, H, Dk, Dv].
void ChunkScanCuda(const at::Tensor& a, const at::Tensor& b, const at::Tensor& add_a,
                   const at::Tensor& add_b, const at::Tensor& decay, const at::Tensor& init,
                   const std::vector<int64_t>& offsets, bool backward, at::Tensor& carried,
                   at::Tensor& rows, at::Tensor& last);
}  // namespace internal
#endif

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

bool KernelEnabled() { return EnvSwitchOn("DTA_LINEAR_ATTENTION_KERNEL"); }

struct Sizes {
  int64_t heads = 0, chunks = 0, chunk = 0, dk = 0, dv = 0;
  std::vector<int64_t> offsets;  // the segments' chunk offsets, {0, N} for one
  bool segmented = false;        // states carry a leading [S] dimension

  int64_t segments() const { return static_cast<int64_t>(offsets.size()) - 1; }
  // An initial or final state's shape.
  std::vector<int64_t> StateShape() const {
    if (segmented) return {segments(), heads, dk, dv};
    return {heads, dk, dv};
  }
};

void CheckLike(const char* name, const at::Tensor& t, const at::Tensor& w, at::IntArrayRef shape,
               const char* expected) {
  TORCH_CHECK(t.defined(), "chunk state recurrence: ", name, " must be defined (", expected, ")");
  TORCH_CHECK(t.sizes() == shape, "chunk state recurrence: ", name, " must be ", expected, " = ",
              shape, ", got ", t.sizes());
  TORCH_CHECK(t.scalar_type() == w.scalar_type(), "chunk state recurrence: ", name, " is ",
              t.scalar_type(), ", k_cumdecay ", w.scalar_type(), " (one type for all)");
  TORCH_CHECK(t.device() == w.device(), "chunk state recurrence: ", name, " is on ", t.device(),
              ", k_cumdecay on ", w.device());
}

Sizes CheckInputs(const at::Tensor& w, const at::Tensor& u, const at::Tensor& kd,
                  const at::Tensor& d, const at::Tensor& s0, const ChunkStateOptions& options) {
  TORCH_CHECK(w.defined() && w.dim() == 4,
              "chunk state recurrence: k_cumdecay must be [H, N, C, Dk], got ",
              w.defined() ? w.sizes() : at::IntArrayRef{});
  TORCH_CHECK(w.scalar_type() == at::kFloat || w.scalar_type() == at::kDouble,
              "chunk state recurrence: k_cumdecay must be float32 or float64, got ",
              w.scalar_type());
  TORCH_CHECK(u.defined() && u.dim() == 4,
              "chunk state recurrence: new_values must be [H, N, C, Dv] = [", w.size(0), ", ",
              w.size(1), ", ", w.size(2), ", Dv], got ",
              u.defined() ? u.sizes() : at::IntArrayRef{});
  Sizes s{w.size(0), w.size(1), w.size(2), w.size(3), u.size(3)};
  CheckLike("new_values", u, w, {s.heads, s.chunks, s.chunk, s.dv}, "[H, N, C, Dv]");
  CheckLike("k_decayed", kd, w, {s.heads, s.chunks, s.chunk, s.dk}, "[H, N, C, Dk]");
  CheckLike("chunk_decay", d, w, {s.heads, s.chunks}, "[H, N]");
  s.segmented = !options.segment_chunks.empty();
  s.offsets = s.segmented ? options.segment_chunks : std::vector<int64_t>{0, s.chunks};
  TORCH_CHECK(s.offsets.size() >= 2 && s.offsets.front() == 0 && s.offsets.back() == s.chunks,
              "chunk state recurrence: segment_chunks must run from 0 to the ", s.chunks,
              " chunks, got ", at::IntArrayRef(s.offsets));
  for (size_t i = 1; i < s.offsets.size(); ++i) {
    TORCH_CHECK(s.offsets[i] >= s.offsets[i - 1],
                "chunk state recurrence: segment_chunks must not decrease, got ",
                at::IntArrayRef(s.offsets));
  }
  if (s0.defined()) {
    CheckLike("initial_state", s0, w, s.StateShape(),
              s.segmented ? "[S, H, Dk, Dv]" : "[H, Dk, Dv]");
  }
  return s;
}

bool UseKernel(const at::Tensor& w, const Sizes& s, const ChunkStateOptions& options) {
#ifdef DTA_KERNELS_HAVE_CUDA
  return options.use_kernel && w.is_cuda() && KernelEnabled() &&
         internal::ChunkScanFits(w.scalar_type(), s.chunk, s.dk, w.device().index());
#else
  (void)w;
  (void)s;
  (void)options;
  return false;
#endif
}

at::Tensor ContiguousOrUndefined(const at::Tensor& t) { return t.defined() ? t.contiguous() : t; }

// The loop of the header, one chunk at a time in ATen.
// segment's [H, Dk, Dv] part of a [H, Dk, Dv] or [S, H, Dk, Dv] state (undefined stays so).
at::Tensor SegmentState(const at::Tensor& state, const Sizes& s, int64_t segment) {
  if (!state.defined() || !s.segmented) return state;
  return state.select(0, segment);
}

// The loop of the header, one chunk at a time in ATen, each segment from its own state.
ChunkStates ForwardAten(const at::Tensor& w, const at::Tensor& u, const at::Tensor& kd,
                        const at::Tensor& d, const at::Tensor& s0, const Sizes& s) {
  at::Tensor states = at::empty({s.heads, s.chunks, s.dk, s.dv}, w.options());
  at::Tensor v_new = at::empty({s.heads, s.chunks, s.chunk, s.dv}, w.options());
  at::Tensor finals = s.segmented ? at::empty(s.StateShape(), w.options()) : at::Tensor();
  for (int64_t segment = 0; segment < s.segments(); ++segment) {
    const at::Tensor init = SegmentState(s0, s, segment);
    at::Tensor state =
        init.defined() ? init.clone() : at::zeros({s.heads, s.dk, s.dv}, w.options());
    for (int64_t i = s.offsets[segment]; i < s.offsets[segment + 1]; ++i) {
      states.select(1, i).copy_(state);
      const at::Tensor vn = u.select(1, i) - at::matmul(w.select(1, i), state);
      v_new.select(1, i).copy_(vn);
      state = state * d.select(1, i).view({-1, 1, 1}) +
              at::matmul(kd.select(1, i).transpose(-1, -2), vn);
    }
    if (!s.segmented) return {states, v_new, state};
    finals.select(0, segment).copy_(state);
  }
  return {states, v_new, finals};
}

struct ScanGrads {
  at::Tensor dvt;      // [H, N, C, Dv]: the gradient of v_new, through every path
  at::Tensor carried;  // [H, N, Dk, Dv]: g_i, the gradient of the state after chunk i
  at::Tensor initial;  // [H, Dk, Dv] or [S, H, Dk, Dv]
};

ScanGrads BackwardAten(const at::Tensor& dh, const at::Tensor& dvn, const at::Tensor& dfinal,
                       const at::Tensor& w, const at::Tensor& kd, const at::Tensor& d,
                       const Sizes& s) {
  at::Tensor dvt = at::empty({s.heads, s.chunks, s.chunk, s.dv}, w.options());
  at::Tensor carried = at::empty({s.heads, s.chunks, s.dk, s.dv}, w.options());
  at::Tensor initials = s.segmented ? at::empty(s.StateShape(), w.options()) : at::Tensor();
  for (int64_t segment = 0; segment < s.segments(); ++segment) {
    const at::Tensor last = SegmentState(dfinal, s, segment);
    at::Tensor g = last.defined() ? last : at::zeros({s.heads, s.dk, s.dv}, w.options());
    const int64_t first = s.offsets[segment];
    for (int64_t i = s.offsets[segment + 1] - 1; i >= first; --i) {
      at::Tensor dvt_i = at::matmul(kd.select(1, i), g);
      if (dvn.defined()) dvt_i = dvn.select(1, i) + dvt_i;
      dvt.select(1, i).copy_(dvt_i);
      carried.select(1, i).copy_(g);
      g = g * d.select(1, i).view({-1, 1, 1}) - at::matmul(w.select(1, i).transpose(-1, -2), dvt_i);
      if (dh.defined()) g = g + dh.select(1, i);
    }
    if (!s.segmented) {
      return {dvt, carried, last.defined() && s.chunks == 0 ? g.clone() : g};
    }
    initials.select(0, segment).copy_(g);
  }
  return {dvt, carried, initials};
}

// The gradients of the inputs from the scan's, batched over every chunk.
ChunkStateGrads FinishGrads(ScanGrads scan, const at::Tensor& states, const at::Tensor& v_new,
                            const Sizes& s) {
  const int64_t area = s.dk * s.dv;
  ChunkStateGrads grads;
  grads.k_cumdecay = Float32Bmm(scan.dvt, states.transpose(-1, -2)).neg_();
  grads.k_decayed = Float32Bmm(v_new, scan.carried.transpose(-1, -2));
  // sum(h_i * g_i) as a batch of dot products: no [H, N, Dk, Dv] temporary.
  grads.chunk_decay = at::matmul(states.reshape({s.heads, s.chunks, 1, area}),
                                 scan.carried.reshape({s.heads, s.chunks, area, 1}))
                          .view({s.heads, s.chunks});
  grads.new_values = std::move(scan.dvt);
  grads.initial_state = std::move(scan.initial);
  return grads;
}

void SaveOptions(AutogradContext* ctx, const ChunkStateOptions& options) {
  ctx->saved_data["use_kernel"] = options.use_kernel;
  ctx->saved_data["segment_chunks"] = options.segment_chunks;
}

ChunkStateOptions SavedOptions(AutogradContext* ctx) {
  return {.use_kernel = ctx->saved_data["use_kernel"].toBool(),
          .segment_chunks = ctx->saved_data["segment_chunks"].toIntVector()};
}

class ChunkStateFunction : public torch::autograd::Function<ChunkStateFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, const at::Tensor& w, const at::Tensor& u,
                               const at::Tensor& kd, const at::Tensor& d, const at::Tensor& s0,
                               const ChunkStateOptions& options) {
    ChunkStates out = ChunkStateForward(w, u, kd, d, s0, options);
    // The inputs as they are, not contiguous copies: the chunked rule's W comes column-major from
    // a triangular solve that keeps it for its own backward, so a copy kept here would add W's
    // size to the graph; backward copies it again, for a moment.
    ctx->save_for_backward({w, kd, d, out.states, out.new_values});
    SaveOptions(ctx, options);
    // Backward takes undefined gradients as zeros without materialising them.
    ctx->set_materialize_grads(false);
    return {out.states, out.new_values, out.final_state};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list saved = ctx->get_saved_variables();
    const ChunkStateOptions options = SavedOptions(ctx);
    ChunkStateGrads g = ChunkStateBackward(grads[0], grads[1], grads[2], saved[0], saved[1],
                                           saved[2], saved[3], saved[4], options);
    return {g.k_cumdecay, g.new_values, g.k_decayed, g.chunk_decay, g.initial_state, at::Tensor()};
  }
};

// out = Qd h + intra v_new with the recurrence; saves its inputs only (module comment in the
// header).
class ChunkOutputFunction : public torch::autograd::Function<ChunkOutputFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, const at::Tensor& w, const at::Tensor& u,
                               const at::Tensor& kd, const at::Tensor& d, const at::Tensor& s0,
                               const at::Tensor& qd, const at::Tensor& intra,
                               const ChunkStateOptions& options) {
    const ChunkStates scan = ChunkStateForward(w, u, kd, d, s0, options);
    at::Tensor out = Float32Bmm(qd, scan.states).add_(Float32Bmm(intra, scan.new_values));
    ctx->save_for_backward({w, u, kd, d, s0, qd, intra});
    SaveOptions(ctx, options);
    ctx->set_materialize_grads(false);
    return {out, scan.final_state};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list saved = ctx->get_saved_variables();
    const at::Tensor &w = saved[0], &u = saved[1], &kd = saved[2], &d = saved[3], &s0 = saved[4],
                     &qd = saved[5], &intra = saved[6];
    const ChunkStateOptions options = SavedOptions(ctx);
    const ChunkStates scan = ChunkStateForward(w, u, kd, d, s0, options);
    const at::Tensor& d_out = grads[0];
    at::Tensor d_qd, d_intra, d_states, d_new_values;
    if (d_out.defined()) {
      d_qd = Float32Bmm(d_out, scan.states.transpose(-1, -2));
      d_states = Float32Bmm(qd.transpose(-1, -2), d_out);
      d_intra = Float32Bmm(d_out, scan.new_values.transpose(-1, -2));
      d_new_values = Float32Bmm(intra.transpose(-1, -2), d_out);
    }
    ChunkStateGrads g = ChunkStateBackward(d_states, d_new_values, grads[1], w, kd, d, scan.states,
                                           scan.new_values, options);
    return {g.k_cumdecay,    g.new_values, g.k_decayed, g.chunk_decay,
            g.initial_state, d_qd,         d_intra,     at::Tensor()};
  }
};

}  // namespace

bool ChunkStateUsesKernel(const at::Tensor& k_cumdecay, int64_t value_dim,
                          const ChunkStateOptions& options) {
  if (!k_cumdecay.defined() || k_cumdecay.dim() != 4) return false;
  const Sizes s{k_cumdecay.size(0), k_cumdecay.size(1), k_cumdecay.size(2), k_cumdecay.size(3),
                value_dim};
  return UseKernel(k_cumdecay, s, options);
}

ChunkStates ChunkStateForward(const at::Tensor& k_cumdecay, const at::Tensor& new_values,
                              const at::Tensor& k_decayed, const at::Tensor& chunk_decay,
                              const at::Tensor& initial_state, const ChunkStateOptions& options) {
  const Sizes s =
      CheckInputs(k_cumdecay, new_values, k_decayed, chunk_decay, initial_state, options);
  const at::Tensor w = k_cumdecay.contiguous(), u = new_values.contiguous(),
                   kd = k_decayed.contiguous(), d = chunk_decay.contiguous(),
                   s0 = ContiguousOrUndefined(initial_state);
#ifdef DTA_KERNELS_HAVE_CUDA
  if (UseKernel(w, s, options)) {
    ChunkStates out{.states = at::empty({s.heads, s.chunks, s.dk, s.dv}, w.options()),
                    .new_values = at::empty({s.heads, s.chunks, s.chunk, s.dv}, w.options()),
                    .final_state = at::empty(s.StateShape(), w.options())};
    internal::ChunkScanCuda(w, kd, u, at::Tensor(), d, s0, s.offsets, /*backward=*/false,
                            out.states, out.new_values, out.final_state);
    return out;
  }
#endif
  return ForwardAten(w, u, kd, d, s0, s);
}

ChunkStateGrads ChunkStateBackward(const at::Tensor& grad_states, const at::Tensor& grad_new_values,
                                   const at::Tensor& grad_final_state, const at::Tensor& k_cumdecay,
                                   const at::Tensor& k_decayed, const at::Tensor& chunk_decay,
                                   const at::Tensor& states, const at::Tensor& new_values,
                                   const ChunkStateOptions& options) {
  const Sizes s =
      CheckInputs(k_cumdecay, new_values, k_decayed, chunk_decay, at::Tensor(), options);
  CheckLike("states", states, k_cumdecay, {s.heads, s.chunks, s.dk, s.dv}, "[H, N, Dk, Dv]");
  if (grad_states.defined()) {
    CheckLike("grad_states", grad_states, k_cumdecay, {s.heads, s.chunks, s.dk, s.dv},
              "[H, N, Dk, Dv]");
  }
  if (grad_new_values.defined()) {
    CheckLike("grad_new_values", grad_new_values, k_cumdecay, {s.heads, s.chunks, s.chunk, s.dv},
              "[H, N, C, Dv]");
  }
  if (grad_final_state.defined()) {
    CheckLike("grad_final_state", grad_final_state, k_cumdecay, s.StateShape(),
              s.segmented ? "[S, H, Dk, Dv]" : "[H, Dk, Dv]");
  }
  const at::Tensor w = k_cumdecay.contiguous(), kd = k_decayed.contiguous(),
                   d = chunk_decay.contiguous(), dh = ContiguousOrUndefined(grad_states),
                   dvn = ContiguousOrUndefined(grad_new_values),
                   dfinal = ContiguousOrUndefined(grad_final_state);
#ifdef DTA_KERNELS_HAVE_CUDA
  if (UseKernel(w, s, options)) {
    ScanGrads scan{.dvt = at::empty({s.heads, s.chunks, s.chunk, s.dv}, w.options()),
                   .carried = at::empty({s.heads, s.chunks, s.dk, s.dv}, w.options()),
                   .initial = at::empty(s.StateShape(), w.options())};
    internal::ChunkScanCuda(kd, w, dvn, dh, d, dfinal, s.offsets, /*backward=*/true, scan.carried,
                            scan.dvt, scan.initial);
    return FinishGrads(std::move(scan), states, new_values, s);
  }
#endif
  return FinishGrads(BackwardAten(dh, dvn, dfinal, w, kd, d, s), states, new_values, s);
}

ChunkStates ChunkStateRecurrence(const at::Tensor& k_cumdecay, const at::Tensor& new_values,
                                 const at::Tensor& k_decayed, const at::Tensor& chunk_decay,
                                 const at::Tensor& initial_state,
                                 const ChunkStateOptions& options) {
  const Sizes s =
      CheckInputs(k_cumdecay, new_values, k_decayed, chunk_decay, initial_state, options);
  const at::Tensor s0 =
      initial_state.defined() ? initial_state : at::zeros(s.StateShape(), k_cumdecay.options());
  variable_list out =
      ChunkStateFunction::apply(k_cumdecay, new_values, k_decayed, chunk_decay, s0, options);
  return {.states = out[0], .new_values = out[1], .final_state = out[2]};
}

ChunkOutput ChunkStateOutput(const at::Tensor& k_cumdecay, const at::Tensor& new_values,
                             const at::Tensor& k_decayed, const at::Tensor& chunk_decay,
                             const at::Tensor& initial_state, const at::Tensor& q_decayed,
                             const at::Tensor& intra, const ChunkStateOptions& options) {
  const Sizes s =
      CheckInputs(k_cumdecay, new_values, k_decayed, chunk_decay, initial_state, options);
  CheckLike("q_decayed", q_decayed, k_cumdecay, {s.heads, s.chunks, s.chunk, s.dk},
            "[H, N, C, Dk]");
  CheckLike("intra", intra, k_cumdecay, {s.heads, s.chunks, s.chunk, s.chunk}, "[H, N, C, C]");
  const at::Tensor s0 =
      initial_state.defined() ? initial_state : at::zeros(s.StateShape(), k_cumdecay.options());
  variable_list out = ChunkOutputFunction::apply(k_cumdecay, new_values, k_decayed, chunk_decay, s0,
                                                 q_decayed, intra, options);
  return {.out = out[0], .final_state = out[1]};
}

}  // namespace dta::kernels
