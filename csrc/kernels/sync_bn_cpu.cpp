// Sync batch-norm kernels on the CPU (contracts in sync_bn.h).
//
// Layout: x is viewed as [outer][C][inner] with inner contiguous: a contiguous
// (N, C, *S) tensor is outer = N, inner = prod(S); channels_last and (N, C) are
// outer = N*prod(S), inner = 1 with channels adjacent. Work is split into
// chunks of whole outer rows, run in parallel; each chunk loops channels then
// inner, so the innermost loop is always unit-stride and vectorises.
// Reductions accumulate in float64 per chunk; chunk results are merged in
// chunk order, so results do not depend on the thread count.
#include "kernels/sync_bn_impl.h"

#include <ATen/Dispatch.h>
#include <ATen/MemoryOverlap.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <vector>

// sync_bn_cpu_avx2.cpp compiles this file again as namespace cpu_avx2.
#ifndef RR_CPU_KERNELS
#define RR_CPU_KERNELS cpu
#endif

namespace ringreduce {
namespace RR_CPU_KERNELS {
namespace {

using Layout = BnLayout;

constexpr int64_t kChunkElems = 1 << 15;

// Rows per chunk: a cache-sized chunk, but at least 32 elements of each
// channel, since every chunk keeps two doubles per channel (a row of 40,000
// channels made a chunk per row: 16 bytes of state per float32 input element,
// 4x the input; now at most 1/8 of it).
constexpr int64_t kMinChannelElems = 32;

int64_t rowsPerChunk(const Layout& l) {
  const int64_t rowElems = std::max<int64_t>(1, l.channels * l.inner);
  const int64_t inner = std::max<int64_t>(1, l.inner);
  return std::max<int64_t>({1, kChunkElems / rowElems,
                            (kMinChannelElems + inner - 1) / inner});
}

// Calls body(rowBegin, rowEnd, chunkIndex) for every chunk, in parallel.
template <typename F>
int64_t forChunks(const Layout& l, F body) {
  const int64_t rows = rowsPerChunk(l);
  const int64_t chunks = (l.outer + rows - 1) / rows;
  at::parallel_for(0, chunks, 1, [&](int64_t b, int64_t e) {
    for (int64_t k = b; k < e; ++k) body(k * rows, std::min(l.outer, (k + 1) * rows), k);
  });
  return chunks;
}

// Calls run(offset, len, c) for every unit-stride run of rows [r0, r1): with
// channels adjacent (inner == 1) one run per row, where the element at position
// i has channel i (c = -1); otherwise one run of `inner` elements per (row,
// channel), all of channel c. Kernels write both cases as plain loops over
// __restrict pointers, which the compiler vectorises.
template <typename F>
void forRuns(const Layout& l, int64_t r0, int64_t r1, F run) {
  for (int64_t r = r0; r < r1; ++r) {
    const int64_t base = r * l.outerStride;
    if (l.inner == 1) {
      run(base, l.channels, int64_t{-1});
    } else {
      for (int64_t c = 0; c < l.channels; ++c) run(base + c * l.channelStride, l.inner, c);
    }
  }
}

// Every run of the tensor, chunks in parallel.
template <typename F>
void forEachRun(const Layout& l, F run) {
  forChunks(l, [&](int64_t r0, int64_t r1, int64_t) { forRuns(l, r0, r1, run); });
}

// Sums over one run in float64 with 4 independent accumulators (a fixed order:
// the result does not depend on threads), so the adds pipeline.
constexpr int kLanes = 4;

template <typename T, typename F>
double sumRun(const T* __restrict p, int64_t len, F term) {
  double acc[kLanes] = {0, 0, 0, 0};
  int64_t i = 0;
  for (; i + kLanes <= len; i += kLanes) {
    for (int j = 0; j < kLanes; ++j) acc[j] += term(static_cast<double>(p[i + j]), i + j);
  }
  for (; i < len; ++i) acc[0] += term(static_cast<double>(p[i]), i);
  return (acc[0] + acc[1]) + (acc[2] + acc[3]);
}

void checkStat(const at::Tensor& t, int64_t c, const char* name) { bnCheckPerChannel(t, c, name); }

}  // namespace

at::Tensor bnStatsPack(const at::Tensor& input) {
  at::Tensor x;
  const Layout l = bnLayoutOf(input, &x);
  const int64_t C = l.channels;
  at::Tensor pack = at::zeros({3, C}, input.options().dtype(at::kDouble));
  if (l.outer == 0 || l.inner == 0 || C == 0) return pack;
  const int64_t rows = rowsPerChunk(l);
  const int64_t chunks = (l.outer + rows - 1) / rows;
  std::vector<double> mean(chunks * C, 0), m2(chunks * C, 0), count(chunks, 0);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "bn_stats_pack", [&] {
    const scalar_t* data = x.const_data_ptr<scalar_t>();
    forChunks(l, [&](int64_t r0, int64_t r1, int64_t k) {
      double* mu = &mean[k * C];
      double* sq = &m2[k * C];
      const double n = static_cast<double>((r1 - r0) * l.inner);
      count[k] = n;
      // Two passes over a cache-sized chunk: mean, then centred squares.
      forRuns(l, r0, r1, [&](int64_t off, int64_t len, int64_t c) {
        const scalar_t* __restrict in = data + off;
        if (c >= 0) {
          mu[c] += sumRun(in, len, [](double v, int64_t) { return v; });
          return;
        }
        double* __restrict acc = mu;
        for (int64_t i = 0; i < len; ++i) acc[i] += static_cast<double>(in[i]);
      });
      for (int64_t c = 0; c < C; ++c) mu[c] /= n;
      forRuns(l, r0, r1, [&](int64_t off, int64_t len, int64_t c) {
        const scalar_t* __restrict in = data + off;
        if (c >= 0) {
          const double m = mu[c];
          sq[c] += sumRun(in, len, [m](double v, int64_t) { return (v - m) * (v - m); });
          return;
        }
        double* __restrict acc = sq;
        const double* __restrict m = mu;
        for (int64_t i = 0; i < len; ++i) {
          const double d = static_cast<double>(in[i]) - m[i];
          acc[i] += d * d;
        }
      });
    });
  });
  // Chan et al.: merge (n_a, mean_a, M2_a) with (n_b, mean_b, M2_b), in chunk order.
  double* out = pack.data_ptr<double>();
  at::parallel_for(0, C, 64, [&](int64_t b, int64_t e) {
    for (int64_t c = b; c < e; ++c) {
      double n = 0, mu = 0, s = 0;
      for (int64_t k = 0; k < chunks; ++k) {
        double nb = count[k], delta = mean[k * C + c] - mu, total = n + nb;
        // An infinite mean stays infinite (inf - inf would make it NaN); the
        // squares are NaN either way, as nn's.
        mu = std::isfinite(delta) ? mu + delta * nb / total
                                  : (n * mu + nb * mean[k * C + c]) / total;
        s += m2[k * C + c] + delta * delta * n * nb / total;
        n = total;
      }
      out[c] = n;
      out[C + c] = n * mu;
      out[2 * C + c] = s + n * mu * mu;
    }
  });
  return pack;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> bnFinalize(const at::Tensor& pack, double eps,
                                                          c10::ScalarType statDtype) {
  TORCH_CHECK_VALUE(pack.dim() == 2 && pack.size(0) == 3 && pack.scalar_type() == at::kDouble,
                    "[ringreduce] bn_finalize: pack must be float64 [3, C], got ", pack.sizes(), " ",
                    pack.scalar_type());
  at::Tensor p = pack.contiguous();
  const int64_t C = p.size(1);
  auto opts = p.options().dtype(statDtype);
  at::Tensor mean = at::empty({C}, opts), invstd = at::empty({C}, opts), var = at::empty({C}, opts);
  AT_DISPATCH_FLOATING_TYPES(statDtype, "bn_finalize", [&] {
    const double* P = p.const_data_ptr<double>();
    scalar_t *m = mean.data_ptr<scalar_t>(), *r = invstd.data_ptr<scalar_t>(), *v = var.data_ptr<scalar_t>();
    // Branch-free (selects only) so it vectorises; an empty channel has
    // P1 = P2 = 0, so dividing by 1 instead of n gives mean 0 and var 0.
    for (int64_t c = 0; c < C; ++c) {
      const double n = P[c], div = n > 0 ? n : 1.0;
      const double mu = P[C + c] / div;
      const double biased = std::max((P[2 * C + c] - P[C + c] * mu) / div, 0.0);
      m[c] = static_cast<scalar_t>(mu);
      r[c] = static_cast<scalar_t>(1.0 / std::sqrt(biased + eps));
      v[c] = static_cast<scalar_t>(biased * (n > 1 ? n : 1.0) / (n > 1 ? n - 1 : 1.0));
    }
  });
  return {mean, invstd, var};
}

namespace {

// The per-channel vector as float64 (weight/bias default to 1/0), any stride.
// Read in place (no tensor is allocated: at SyncBN's sizes allocations cost
// more than the arithmetic) unless it is not a CPU floating-point tensor.
std::vector<double> perChannel(const std::optional<at::Tensor>& t, int64_t C, double fallback,
                               const char* name) {
  std::vector<double> out(C, fallback);
  if (!t.has_value() || !t->defined()) return out;
  checkStat(*t, C, name);
  const at::Tensor d = t->is_cpu() ? *t : t->to(at::kCPU);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, d.scalar_type(), "bn_per_channel", [&] {
    const scalar_t* p = d.const_data_ptr<scalar_t>();
    const int64_t stride = d.stride(0);
    for (int64_t c = 0; c < C; ++c) out[c] = static_cast<double>(p[c * stride]);
  });
  return out;
}

// stat = (1 - f) stat + f value, in place (the caller's tensor, any stride),
// element by element.
void blendInto(const at::Tensor& stat, const at::Tensor& value, double f, const char* name) {
  checkStat(stat, value.size(0), name);
  at::assert_no_internal_overlap(stat);  // as torch's in-place ops: an expanded stat
  const at::Tensor v = value.to(stat.scalar_type());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, stat.scalar_type(), "bn_running_stats", [&] {
    scalar_t* s = stat.data_ptr<scalar_t>();
    const scalar_t* p = v.const_data_ptr<scalar_t>();
    const int64_t ss = stat.stride(0), vs = v.stride(0);
    for (int64_t c = 0; c < stat.size(0); ++c) {
      scalar_t& out = s[c * ss];
      out = static_cast<scalar_t>((1 - f) * static_cast<double>(out) + f * static_cast<double>(p[c * vs]));
    }
  });
}

void updateRunningStats(const at::Tensor& mean, const at::Tensor& var, const at::Tensor& rm,
                        const std::optional<at::Tensor>& rv,
                        const std::optional<at::Tensor>& nbt, std::optional<double> momentum) {
  double f;
  if (momentum.has_value()) {
    f = *momentum;  // any value, as nn's (1 - m) * running + m * batch
  } else {
    TORCH_CHECK_VALUE(nbt.has_value() && nbt->defined(), "[ringreduce] bn_forward: momentum=None ",
                      "(cumulative average) needs num_batches_tracked");
    f = 1.0 / nbt->item<double>();  // a CPU scalar: no device sync involved
  }
  blendInto(rm, mean, f, "running_mean");
  if (rv.has_value() && rv->defined()) blendInto(*rv, var, f, "running_var");
}

}  // namespace

at::Tensor bnForward(const at::Tensor& input, const at::Tensor& mean, const at::Tensor& invstd,
                     const at::Tensor& varUnbiased, const std::optional<at::Tensor>& weight,
                     const std::optional<at::Tensor>& bias,
                     const std::optional<at::Tensor>& runningMean,
                     const std::optional<at::Tensor>& runningVar,
                     const std::optional<at::Tensor>& numBatchesTracked,
                     std::optional<double> momentum) {
  at::Tensor x;
  const Layout l = bnLayoutOf(input, &x);
  const int64_t C = l.channels;
  checkStat(mean, C, "mean");
  checkStat(invstd, C, "invstd");
  auto w = perChannel(weight, C, 1.0, "weight"), b = perChannel(bias, C, 0.0, "bias");
  auto mu = perChannel(mean, C, 0.0, "mean"), r = perChannel(invstd, C, 1.0, "invstd");
  std::vector<double> scale(C), shift(C);
  for (int64_t c = 0; c < C; ++c) {
    scale[c] = r[c] * w[c];
    shift[c] = b[c];
  }
  at::Tensor y = at::empty_like(x);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "bn_forward", [&] {
    using opmath = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;
    std::vector<opmath> m(mu.begin(), mu.end()), k(scale.begin(), scale.end()), s(shift.begin(), shift.end());
    const scalar_t* in = x.const_data_ptr<scalar_t>();
    scalar_t* out = y.data_ptr<scalar_t>();
    forEachRun(l, [&](int64_t off, int64_t len, int64_t c) {
      const scalar_t* __restrict src = in + off;
      scalar_t* __restrict dst = out + off;
      if (c >= 0) {
        const opmath mc = m[c], kc = k[c], sc = s[c];
        for (int64_t i = 0; i < len; ++i) {
          dst[i] = static_cast<scalar_t>((static_cast<opmath>(src[i]) - mc) * kc + sc);
        }
        return;
      }
      const opmath *__restrict mp = m.data(), *__restrict kp = k.data(), *__restrict sp = s.data();
      for (int64_t i = 0; i < len; ++i) {
        dst[i] = static_cast<scalar_t>((static_cast<opmath>(src[i]) - mp[i]) * kp[i] + sp[i]);
      }
    });
  });
  if (runningMean.has_value() && runningMean->defined()) {
    updateRunningStats(mean, varUnbiased, *runningMean, runningVar, numBatchesTracked, momentum);
  }
  return y;
}

at::Tensor bnBackwardReduce(const at::Tensor& dyIn, const at::Tensor& xIn, const at::Tensor& mean) {
  at::Tensor x;
  const Layout l = bnLayoutOf(xIn, &x);
  at::Tensor dy = bnGradLike(dyIn, x, "bn_backward_reduce");
  const int64_t C = l.channels;
  checkStat(mean, C, "mean");
  at::Tensor sums = at::zeros({2, C}, x.options().dtype(at::kDouble));
  if (l.outer == 0 || l.inner == 0 || C == 0) return sums;
  auto mu = perChannel(mean, C, 0.0, "mean");
  const int64_t rows = rowsPerChunk(l);
  const int64_t chunks = (l.outer + rows - 1) / rows;
  std::vector<double> a(chunks * C, 0), bsum(chunks * C, 0);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "bn_backward_reduce", [&] {
    const scalar_t* g = dy.const_data_ptr<scalar_t>();
    const scalar_t* in = x.const_data_ptr<scalar_t>();
    forChunks(l, [&](int64_t r0, int64_t r1, int64_t k) {
      forRuns(l, r0, r1, [&](int64_t off, int64_t len, int64_t c) {
        const scalar_t* __restrict gp = g + off;
        const scalar_t* __restrict xp = in + off;
        if (c >= 0) {
          const double m = mu[c];
          a[k * C + c] += sumRun(gp, len, [](double v, int64_t) { return v; });
          bsum[k * C + c] += sumRun(gp, len, [xp, m](double v, int64_t i) {
            return v * (static_cast<double>(xp[i]) - m);
          });
          return;
        }
        double *__restrict sa = &a[k * C], *__restrict sb = &bsum[k * C];
        const double* __restrict m = mu.data();
        for (int64_t i = 0; i < len; ++i) {
          const double v = static_cast<double>(gp[i]);
          sa[i] += v;
          sb[i] += v * (static_cast<double>(xp[i]) - m[i]);
        }
      });
    });
  });
  double* out = sums.data_ptr<double>();
  for (int64_t k = 0; k < chunks; ++k) {
    for (int64_t c = 0; c < C; ++c) {
      out[c] += a[k * C + c];
      out[C + c] += bsum[k * C + c];
    }
  }
  return sums;
}

at::Tensor bnBackwardElemt(const at::Tensor& dyIn, const at::Tensor& xIn, const at::Tensor& mean,
                           const at::Tensor& invstd, const std::optional<at::Tensor>& weight,
                           const at::Tensor& sumsIn, const at::Tensor& countIn) {
  at::Tensor x;
  const Layout l = bnLayoutOf(xIn, &x);
  at::Tensor dy = bnGradLike(dyIn, x, "bn_backward_elemt");
  const int64_t C = l.channels;
  at::Tensor sums = sumsIn.to(at::kDouble).contiguous();  // sizes checked by the router
  std::vector<double> N = countIn.numel() == C
                              ? perChannel(countIn.reshape({C}), C, 0.0, "count")
                              : std::vector<double>(C, countIn.item<double>());
  auto w = perChannel(weight, C, 1.0, "weight"), mu = perChannel(mean, C, 0.0, "mean");
  auto r = perChannel(invstd, C, 1.0, "invstd");
  const double* S = sums.const_data_ptr<double>();
  std::vector<double> k1(C), a(C), k2(C);
  for (int64_t c = 0; c < C; ++c) {
    const bool any = N[c] > 0;
    k1[c] = any ? w[c] * r[c] : 0.0;
    a[c] = any ? S[c] / N[c] : 0.0;
    k2[c] = any ? r[c] * r[c] * S[C + c] / N[c] : 0.0;
  }
  at::Tensor dx = at::empty_like(x);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "bn_backward_elemt", [&] {
    using opmath = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;
    std::vector<opmath> K1(k1.begin(), k1.end()), A(a.begin(), a.end()), K2(k2.begin(), k2.end()),
        M(mu.begin(), mu.end());
    const scalar_t* g = dy.const_data_ptr<scalar_t>();
    const scalar_t* in = x.const_data_ptr<scalar_t>();
    scalar_t* out = dx.data_ptr<scalar_t>();
    forEachRun(l, [&](int64_t off, int64_t len, int64_t c) {
      const scalar_t *__restrict gp = g + off, *__restrict xp = in + off;
      scalar_t* __restrict dst = out + off;
      if (c >= 0) {
        const opmath k1 = K1[c], ac = A[c], k2 = K2[c], mc = M[c];
        for (int64_t i = 0; i < len; ++i) {
          const opmath xm = static_cast<opmath>(xp[i]) - mc;
          dst[i] = static_cast<scalar_t>(k1 * (static_cast<opmath>(gp[i]) - ac - xm * k2));
        }
        return;
      }
      const opmath *__restrict k1 = K1.data(), *__restrict ac = A.data(), *__restrict k2 = K2.data(),
                   *__restrict mc = M.data();
      for (int64_t i = 0; i < len; ++i) {
        const opmath xm = static_cast<opmath>(xp[i]) - mc[i];
        dst[i] = static_cast<scalar_t>(k1[i] * (static_cast<opmath>(gp[i]) - ac[i] - xm * k2[i]));
      }
    });
  });
  return dx;
}

}  // namespace RR_CPU_KERNELS
}  // namespace ringreduce
