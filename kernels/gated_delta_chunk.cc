#include "kernels/gated_delta_chunk.h"

#include <c10/util/Exception.h>
#include <torch/csrc/autograd/custom_function.h>

#include <cmath>
#include <limits>
#include <vector>

#include "core/base/env_switch.h"
#include "kernels/gated_delta_chunk_internal.h"

namespace dta::kernels {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

struct Sizes {
  int64_t tokens = 0, key_heads = 0, heads = 0, dk = 0, dv = 0, chunk = 0, chunks = 0;
  int64_t group() const { return heads / key_heads; }
};

void CheckLike(const char* name, const at::Tensor& t, const at::Tensor& q,
               std::initializer_list<int64_t> shape, const char* expected) {
  TORCH_CHECK(t.defined() && t.sizes() == at::IntArrayRef(shape), "gated delta chunk: ", name,
              " must be ", expected, " = ", at::IntArrayRef(shape), ", got ",
              t.defined() ? t.sizes() : at::IntArrayRef{});
  TORCH_CHECK(t.scalar_type() == q.scalar_type(), "gated delta chunk: ", name, " is ",
              t.scalar_type(), ", q ", q.scalar_type(), " (one type for all)");
  TORCH_CHECK(t.device() == q.device(), "gated delta chunk: ", name, " is on ", t.device(),
              ", q on ", q.device());
}

Sizes CheckInputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                  const at::Tensor& g, const at::Tensor& beta, int64_t chunk_size) {
  TORCH_CHECK(q.defined() && q.dim() == 3 && q.size(0) >= 1,
              "gated delta chunk: q must be [T, Hk, Dk] with T >= 1, got ",
              q.defined() ? q.sizes() : at::IntArrayRef{});
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kDouble,
              "gated delta chunk: q must be float32 or float64, got ", q.scalar_type());
  TORCH_CHECK(v.defined() && v.dim() == 3, "gated delta chunk: v must be [T, H, Dv], got ",
              v.defined() ? v.sizes() : at::IntArrayRef{});
  TORCH_CHECK(chunk_size >= 1, "gated delta chunk: chunk_size must be >= 1, got ", chunk_size);
  Sizes s{.tokens = q.size(0),
          .key_heads = q.size(1),
          .heads = v.size(1),
          .dk = q.size(2),
          .dv = v.size(2),
          .chunk = chunk_size};
  s.chunks = (s.tokens + chunk_size - 1) / chunk_size;
  TORCH_CHECK(s.key_heads >= 1 && s.heads % s.key_heads == 0, "gated delta chunk: value heads (",
              s.heads, ") must be a multiple of key heads (", s.key_heads, ")");
  CheckLike("k", k, q, {s.tokens, s.key_heads, s.dk}, "[T, Hk, Dk]");
  CheckLike("v", v, q, {s.tokens, s.heads, s.dv}, "[T, H, Dv]");
  CheckLike("g", g, q, {s.tokens, s.heads}, "[T, H]");
  CheckLike("beta", beta, q, {s.tokens, s.heads}, "[T, H]");
  return s;
}

// [T, X, D] or [T, X] -> [X, N, C, D] (D = 1 for [T, X]), padded with zero tokens; key heads
// repeated to value heads (`group` each).
at::Tensor ChunkMajor(const at::Tensor& x, const Sizes& s, int64_t group = 1) {
  at::Tensor heads = (x.dim() == 2 ? x.unsqueeze(-1) : x).transpose(0, 1);
  if (group > 1) heads = heads.repeat_interleave(group, 0);
  const int64_t pad = s.chunks * s.chunk - s.tokens;
  if (pad > 0) heads = at::constant_pad_nd(heads, {0, 0, 0, pad});
  return heads.contiguous().view({heads.size(0), s.chunks, s.chunk, heads.size(2)});
}

// [H, N, C, D] -> [T, H, D]; key heads' gradients summed over their value heads.
at::Tensor TokenMajor(const at::Tensor& x, const Sizes& s, int64_t group = 1) {
  at::Tensor t = x.reshape({x.size(0), s.chunks * s.chunk, x.size(3)})
                     .narrow(1, 0, s.tokens)
                     .transpose(0, 1);  // [T, H, D]
  if (group > 1) t = t.reshape({s.tokens, s.key_heads, group, x.size(3)}).sum(2);
  return t.contiguous();
}

double QueryScale(const Sizes& s) { return 1.0 / std::sqrt(static_cast<double>(s.dk)); }

// pairwise[i][j] = exp(cum[i] - cum[j]) for j <= i, 0 above the diagonal. cum [H, N, C].
at::Tensor Pairwise(const at::Tensor& cum) {
  const int64_t c = cum.size(-1);
  const at::Tensor upper = at::ones({c, c}, cum.options().dtype(at::kBool)).triu(1);
  return (cum.unsqueeze(-1) - cum.unsqueeze(-2))
      .masked_fill(upper, -std::numeric_limits<double>::infinity())
      .exp();
}

// The batched ATen ops (what ChunkedGatedDeltaRule ran before the fused path); differentiable
// through autograd.
ChunkTerms TermsAten(const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
                     const at::Tensor& g_in, const at::Tensor& beta_in, const Sizes& s) {
  const at::Tensor q = ChunkMajor(q_in, s, s.group()) * QueryScale(s);
  const at::Tensor k = ChunkMajor(k_in, s, s.group());
  const at::Tensor v = ChunkMajor(v_in, s);
  const at::Tensor beta = ChunkMajor(beta_in, s);            // [H, N, C, 1]
  const at::Tensor decay = ChunkMajor(g_in, s).squeeze(-1);  // [H, N, C]
  const at::Tensor k_beta = k * beta;
  const at::Tensor v_beta = v * beta;
  const at::Tensor cum = decay.cumsum(-1);
  const at::Tensor pairwise = Pairwise(cum);
  // The WY/UT form: (I + strictly_lower(k_beta k^T * pairwise))^-1 condenses a chunk's delta
  // updates into matmuls.
  const at::Tensor system = at::matmul(k_beta, k.transpose(-1, -2)) * pairwise;
  ChunkTerms t;
  t.new_values = at::linalg_solve_triangular(system, v_beta, /*upper=*/false, /*left=*/true,
                                             /*unitriangular=*/true);
  t.k_cumdecay = at::linalg_solve_triangular(system, k_beta * cum.exp().unsqueeze(-1),
                                             /*upper=*/false, /*left=*/true,
                                             /*unitriangular=*/true);
  t.intra = at::matmul(q, k.transpose(-1, -2)) * pairwise;
  t.q_decayed = q * cum.exp().unsqueeze(-1);
  t.k_decayed = k * (cum.narrow(-1, s.chunk - 1, 1) - cum).exp().unsqueeze(-1);
  t.chunk_decay = cum.select(-1, s.chunk - 1).exp();
  return t;
}

ChunkTerms EmptyTerms(const Sizes& s, const at::TensorOptions& o) {
  return {.k_cumdecay = at::empty({s.heads, s.chunks, s.chunk, s.dk}, o),
          .new_values = at::empty({s.heads, s.chunks, s.chunk, s.dv}, o),
          .k_decayed = at::empty({s.heads, s.chunks, s.chunk, s.dk}, o),
          .q_decayed = at::empty({s.heads, s.chunks, s.chunk, s.dk}, o),
          .intra = at::empty({s.heads, s.chunks, s.chunk, s.chunk}, o),
          .chunk_decay = at::empty({s.heads, s.chunks}, o)};
}

// The fused forward on the CPU: the CUDA kernel's arithmetic, one chunk and head at a time, every
// sum in index order. Contiguous inputs.
template <typename T>
void ForwardLoops(const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
                  const at::Tensor& g_in, const at::Tensor& beta_in, const Sizes& s,
                  ChunkTerms& out) {
  const T* qp = q_in.data_ptr<T>();
  const T* kp = k_in.data_ptr<T>();
  const T* vp = v_in.data_ptr<T>();
  const T* gp = g_in.data_ptr<T>();
  const T* bp = beta_in.data_ptr<T>();
  const T scale = static_cast<T>(QueryScale(s));
  const int64_t c_len = s.chunk, dk = s.dk, dv = s.dv;
  std::vector<T> cum(c_len), beta(c_len), ks(c_len * dk), qs(c_len * dk), a(c_len * c_len);
  std::vector<T> x(c_len);
  for (int64_t h = 0; h < s.heads; ++h) {
    const int64_t kh = h / s.group();
    for (int64_t n = 0; n < s.chunks; ++n) {
      const int64_t chunk_index = h * s.chunks + n;
      T acc = T(0);
      for (int64_t i = 0; i < c_len; ++i) {
        const int64_t t = n * c_len + i;
        const bool real = t < s.tokens;
        acc += real ? gp[t * s.heads + h] : T(0);
        cum[i] = acc;
        beta[i] = real ? bp[t * s.heads + h] : T(0);
        for (int64_t d = 0; d < dk; ++d) {
          ks[i * dk + d] = real ? kp[(t * s.key_heads + kh) * dk + d] : T(0);
          qs[i * dk + d] = real ? qp[(t * s.key_heads + kh) * dk + d] * scale : T(0);
        }
      }
      const T last = cum[c_len - 1];
      T* intra = out.intra.data_ptr<T>() + chunk_index * c_len * c_len;
      for (int64_t i = 0; i < c_len; ++i) {
        for (int64_t j = 0; j < c_len; ++j) {
          T kk = T(0), qk = T(0);
          if (j <= i) {
            for (int64_t d = 0; d < dk; ++d) {
              kk += ks[i * dk + d] * beta[i] * ks[j * dk + d];
              qk += qs[i * dk + d] * ks[j * dk + d];
            }
          }
          const T p = j <= i ? std::exp(cum[i] - cum[j]) : T(0);
          a[i * c_len + j] = j < i ? kk * p : T(0);
          intra[i * c_len + j] = qk * p;
        }
      }
      // Forward substitution, one right-hand column at a time: U's Dv columns, then W's Dk.
      T* u = out.new_values.data_ptr<T>() + chunk_index * c_len * dv;
      T* w = out.k_cumdecay.data_ptr<T>() + chunk_index * c_len * dk;
      for (int64_t col = 0; col < dv + dk; ++col) {
        for (int64_t i = 0; i < c_len; ++i) {
          const int64_t t = n * c_len + i;
          T xi = col < dv ? (t < s.tokens ? vp[(t * s.heads + h) * dv + col] : T(0)) * beta[i]
                          : ks[i * dk + col - dv] * beta[i] * std::exp(cum[i]);
          for (int64_t j = 0; j < i; ++j) xi -= a[i * c_len + j] * x[j];
          x[i] = xi;
          if (col < dv) {
            u[i * dv + col] = xi;
          } else {
            w[i * dk + col - dv] = xi;
          }
        }
      }
      T* kd = out.k_decayed.data_ptr<T>() + chunk_index * c_len * dk;
      T* qd = out.q_decayed.data_ptr<T>() + chunk_index * c_len * dk;
      for (int64_t i = 0; i < c_len; ++i) {
        const T to_end = std::exp(last - cum[i]), from_start = std::exp(cum[i]);
        for (int64_t d = 0; d < dk; ++d) {
          kd[i * dk + d] = ks[i * dk + d] * to_end;
          qd[i * dk + d] = qs[i * dk + d] * from_start;
        }
      }
      out.chunk_decay.data_ptr<T>()[chunk_index] = std::exp(last);
    }
  }
}

bool FusedEnabled() { return EnvSwitchOn("DTA_GATED_DELTA_FUSED"); }

// Whether the forward kernel (`backward` false) or the backward kernel runs these inputs;
// DTA_GATED_DELTA_BACKWARD_KERNEL=0 (read at every backward) keeps BackwardAnalytic on the GPU
// (tests and benchmarks compare the two).
bool KernelFits(const at::Tensor& q, const Sizes& s, bool backward = false) {
#ifdef DTA_KERNELS_HAVE_CUDA
  if (!q.is_cuda() || s.chunk > internal::kGatedDeltaMaxChunk) return false;
  const int device = q.device().index();
  return backward
             ? EnvSwitchOn("DTA_GATED_DELTA_BACKWARD_KERNEL") &&
                   internal::GatedDeltaChunkBackwardFits(q.scalar_type(), s.chunk, s.dk, device)
             : internal::GatedDeltaChunkFits(q.scalar_type(), s.chunk, s.dk, device);
#else
  (void)q;
  (void)s;
  (void)backward;
  return false;
#endif
}

ChunkTerms FusedForward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                        const at::Tensor& g, const at::Tensor& beta, const Sizes& s) {
  ChunkTerms out = EmptyTerms(s, q.options());
  if (q.is_cuda()) {
#ifdef DTA_KERNELS_HAVE_CUDA
    TORCH_CHECK(KernelFits(q, s), "gated delta chunk: no kernel for C = ", s.chunk, ", Dk = ", s.dk,
                ", ", q.scalar_type());
    internal::GatedDeltaChunkForwardCuda(q, k, v, g, beta, out);
    return out;
#else
    TORCH_CHECK(false, "gated delta chunk: the fused path on a GPU needs a CUDA build");
#endif
  }
  TORCH_CHECK(q.is_cpu(), "gated delta chunk: the fused path runs on the CPU or CUDA, not ",
              q.device());
  if (q.scalar_type() == at::kDouble) {
    ForwardLoops<double>(q, k, v, g, beta, s, out);
  } else {
    ForwardLoops<float>(q, k, v, g, beta, s, out);
  }
  return out;
}

struct InputGrads {
  at::Tensor q, k, v, g, beta;
};

// The analytic gradient of the terms (header) with respect to q, k, v, g and beta, batched over
// every chunk, from the inputs and the outputs U and W (T = M^-1 enters only through triangular
// solves with M^T). With R_U = T^T dU, R_W = T^T dW:
//   dS = -strictly_lower(R_U U^T + R_W W^T), dv = beta R_U,
//   d(k beta) and d(beta) through S = (beta k k^T) * P and W's right-hand side beta exp(c) k,
//   dP = dS * beta k k^T + d_intra * q k^T, dc_i = sum_j dP_ij P_ij - sum_j dP_ji P_ji + ...,
//   dg = the reversed cumulative sum of dc within each chunk.
InputGrads BackwardAnalytic(const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
                            const at::Tensor& g_in, const at::Tensor& beta_in,
                            const at::Tensor& u_out, const at::Tensor& w_out, const Sizes& s,
                            const ChunkTerms& grad) {
  const double scale = QueryScale(s);
  const at::Tensor q = ChunkMajor(q_in, s, s.group()) * scale;  // [H, N, C, Dk]
  const at::Tensor k = ChunkMajor(k_in, s, s.group());
  const at::Tensor v = ChunkMajor(v_in, s);
  const at::Tensor beta = ChunkMajor(beta_in, s);  // [H, N, C, 1]
  const at::Tensor cum = ChunkMajor(g_in, s).squeeze(-1).cumsum(-1);
  const at::Tensor from_start = cum.exp().unsqueeze(-1);  // [.., C, 1]
  const at::Tensor to_end =
      (cum.narrow(-1, s.chunk - 1, 1) - cum).exp().unsqueeze(-1);  // [.., C, 1]
  const at::Tensor pairwise = Pairwise(cum);
  const at::Tensor kt = k.transpose(-1, -2);
  const at::Tensor kk = at::matmul(k, kt);
  const at::Tensor qk = at::matmul(q, kt);
  const at::Tensor system = kk * beta * pairwise;

  auto solve_transposed = [&](const at::Tensor& rhs) {
    return at::linalg_solve_triangular(system.transpose(-1, -2), rhs, /*upper=*/true,
                                       /*left=*/true, /*unitriangular=*/true);
  };
  const at::Tensor ru = solve_transposed(grad.new_values);
  const at::Tensor rw = solve_transposed(grad.k_cumdecay);
  const at::Tensor strict = at::ones({s.chunk, s.chunk}, cum.options().dtype(at::kBool)).tril(-1);
  const at::Tensor d_system =
      (at::matmul(ru, u_out.transpose(-1, -2)) + at::matmul(rw, w_out.transpose(-1, -2)))
          .neg()
          .masked_fill(strict.logical_not(), 0);
  const at::Tensor k_rw = (k * rw).sum(-1, /*keepdim=*/true);  // [.., C, 1]

  // dS_ij beta_i P_ij: the gradient of k k^T through S.
  const at::Tensor g1 = d_system * beta * pairwise;
  // d_intra P: the gradient of q k^T through intra (P is zero above the diagonal).
  const at::Tensor g2 = grad.intra * pairwise;
  const at::Tensor dq = (at::matmul(g2, k) + from_start * grad.q_decayed) * scale;
  const at::Tensor dk = at::matmul(g1, k) + at::matmul(g1.transpose(-1, -2), k) +
                        at::matmul(g2.transpose(-1, -2), q) + beta * from_start * rw +
                        to_end * grad.k_decayed;
  const at::Tensor dv = beta * ru;
  const at::Tensor dbeta = (v * ru).sum(-1, /*keepdim=*/true) + from_start * k_rw +
                           (d_system * kk * pairwise).sum(-1, /*keepdim=*/true);
  // The cumulative decay's gradient: through P, exp(c) (W and Qd), exp(c_last - c) (Kd) and d.
  const at::Tensor through_p = (d_system * beta * kk + grad.intra * qk) * pairwise;
  const at::Tensor kd_term = (k * to_end * grad.k_decayed).sum(-1);  // [H, N, C]
  at::Tensor dcum = through_p.sum(-1) - through_p.sum(-2) + (beta * from_start * k_rw).squeeze(-1) +
                    (from_start * (q * grad.q_decayed).sum(-1, /*keepdim=*/true)).squeeze(-1) -
                    kd_term;
  const at::Tensor d_last = kd_term.sum(-1) + grad.chunk_decay * cum.select(-1, s.chunk - 1).exp();
  dcum = dcum + at::constant_pad_nd(d_last.unsqueeze(-1), {s.chunk - 1, 0});
  const at::Tensor dg = dcum.flip(-1).cumsum(-1).flip(-1);
  return {.q = TokenMajor(dq, s, s.group()),
          .k = TokenMajor(dk, s, s.group()),
          .v = TokenMajor(dv, s),
          .g = TokenMajor(dg.unsqueeze(-1), s).squeeze(-1),
          .beta = TokenMajor(dbeta, s).squeeze(-1)};
}

// The output gradients with zeros for the undefined ones (outputs the loss does not use).
ChunkTerms ZerosWhereUndefined(const ChunkTerms& grad, const Sizes& s, const at::TensorOptions& o) {
  auto pick = [&](const at::Tensor& g, at::IntArrayRef shape) {
    return g.defined() ? g : at::zeros(shape, o);
  };
  const int64_t h = s.heads, n = s.chunks, c = s.chunk;
  return {.k_cumdecay = pick(grad.k_cumdecay, {h, n, c, s.dk}),
          .new_values = pick(grad.new_values, {h, n, c, s.dv}),
          .k_decayed = pick(grad.k_decayed, {h, n, c, s.dk}),
          .q_decayed = pick(grad.q_decayed, {h, n, c, s.dk}),
          .intra = pick(grad.intra, {h, n, c, c}),
          .chunk_decay = pick(grad.chunk_decay, {h, n})};
}

#ifdef DTA_KERNELS_HAVE_CUDA
// BackwardAnalytic's gradients from the backward kernel: one launch, then a key head's group of
// value heads summed (one reduction, in a fixed order).
InputGrads BackwardCuda(const internal::BackwardInputs& in, const Sizes& s,
                        const ChunkTerms& grad) {
  auto contiguous = [](const at::Tensor& t) { return t.defined() ? t.contiguous() : t; };
  const ChunkTerms g{.k_cumdecay = contiguous(grad.k_cumdecay),
                     .new_values = contiguous(grad.new_values),
                     .k_decayed = contiguous(grad.k_decayed),
                     .q_decayed = contiguous(grad.q_decayed),
                     .intra = contiguous(grad.intra),
                     .chunk_decay = contiguous(grad.chunk_decay)};
  const at::TensorOptions o = in.q.options();
  const int64_t cp = internal::PadToMmaTile(s.chunk), kp = internal::PadToMmaTile(s.dk);
  const internal::BackwardOutputs out{.q = at::empty({s.chunks * cp, s.heads, kp}, o),
                                      .k = at::empty({s.chunks * cp, s.heads, kp}, o),
                                      .v = at::empty({s.tokens, s.heads, s.dv}, o),
                                      .g = at::empty({s.tokens, s.heads}, o),
                                      .beta = at::empty({s.tokens, s.heads}, o)};
  internal::GatedDeltaChunkBackwardCuda(in, g, out);
  // The tokens' rows and Dk columns of a padded gradient; a key head's value heads summed.
  auto unpad = [&](const at::Tensor& x) {
    const at::Tensor t = x.view({s.chunks, cp, s.heads, kp})
                             .narrow(1, 0, s.chunk)
                             .reshape({s.chunks * s.chunk, s.heads, kp})
                             .narrow(0, 0, s.tokens)
                             .narrow(2, 0, s.dk);
    return s.group() == 1 ? t.contiguous()
                          : t.reshape({s.tokens, s.key_heads, s.group(), s.dk}).sum(2);
  };
  return {.q = unpad(out.q), .k = unpad(out.k), .v = out.v, .g = out.g, .beta = out.beta};
}
#endif

class FusedFunction : public torch::autograd::Function<FusedFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k,
                               const at::Tensor& v, const at::Tensor& g, const at::Tensor& beta,
                               int64_t chunk_size) {
    const Sizes s = CheckInputs(q, k, v, g, beta, chunk_size);
    ChunkTerms t = FusedForward(q, k, v, g, beta, s);
    // Inputs and two outputs only: backward recomputes S, P and the triangular blocks' inverses.
    ctx->save_for_backward({q, k, v, g, beta, t.new_values, t.k_cumdecay});
    ctx->saved_data["chunk_size"] = chunk_size;
    // Unused outputs' gradients stay undefined: the kernel reads them as zeros without a memset.
    ctx->set_materialize_grads(false);
    return {t.k_cumdecay, t.new_values, t.k_decayed, t.q_decayed, t.intra, t.chunk_decay};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list saved = ctx->get_saved_variables();
    const Sizes s = CheckInputs(saved[0], saved[1], saved[2], saved[3], saved[4],
                                ctx->saved_data["chunk_size"].toInt());
    const ChunkTerms grad{.k_cumdecay = grads[0],
                          .new_values = grads[1],
                          .k_decayed = grads[2],
                          .q_decayed = grads[3],
                          .intra = grads[4],
                          .chunk_decay = grads[5]};
    if (KernelFits(saved[0], s, /*backward=*/true)) {
#ifdef DTA_KERNELS_HAVE_CUDA
      const InputGrads d = BackwardCuda({.q = saved[0].contiguous(),
                                         .k = saved[1].contiguous(),
                                         .v = saved[2].contiguous(),
                                         .g = saved[3].contiguous(),
                                         .beta = saved[4].contiguous(),
                                         .new_values = saved[5].contiguous(),
                                         .k_cumdecay = saved[6].contiguous()},
                                        s, grad);
      return {d.q, d.k, d.v, d.g, d.beta, at::Tensor()};
#endif
    }
    const InputGrads d =
        BackwardAnalytic(saved[0], saved[1], saved[2], saved[3], saved[4], saved[5], saved[6], s,
                         ZerosWhereUndefined(grad, s, saved[0].options()));
    return {d.q, d.k, d.v, d.g, d.beta, at::Tensor()};
  }
};

}  // namespace

bool GatedDeltaChunkUsesKernel(const at::Tensor& q, int64_t value_dim, int64_t chunk_size) {
  if (!q.defined() || q.dim() != 3 || !FusedEnabled()) return false;
  Sizes s{.tokens = q.size(0),
          .key_heads = q.size(1),
          .heads = q.size(1),
          .dk = q.size(2),
          .dv = value_dim,
          .chunk = chunk_size};
  return KernelFits(q, s);
}

ChunkTerms GatedDeltaChunkTerms(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                const at::Tensor& g, const at::Tensor& beta, int64_t chunk_size,
                                GatedDeltaPath path) {
  const Sizes s = CheckInputs(q, k, v, g, beta, chunk_size);
  // A pass that keeps a graph fuses only where the backward kernel runs too: the analytic backward
  // as batched ATen ops is 1.5x slower than autograd's over the ATen forward (an H200, 16K tokens).
  bool needs_grad = false;
  for (const at::Tensor* t : {&q, &k, &v, &g, &beta}) needs_grad |= t->requires_grad();
  needs_grad &= at::GradMode::is_enabled();
  const bool fused = path == GatedDeltaPath::kFused ||
                     (path == GatedDeltaPath::kAuto && FusedEnabled() && KernelFits(q, s) &&
                      (!needs_grad || KernelFits(q, s, /*backward=*/true)));
  if (!fused) return TermsAten(q, k, v, g, beta, s);
  const variable_list out = FusedFunction::apply(q.contiguous(), k.contiguous(), v.contiguous(),
                                                 g.contiguous(), beta.contiguous(), chunk_size);
  return {.k_cumdecay = out[0],
          .new_values = out[1],
          .k_decayed = out[2],
          .q_decayed = out[3],
          .intra = out[4],
          .chunk_decay = out[5]};
}

}  // namespace dta::kernels
