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
#include <ATen/Parallel.h>

#include <cmath>
#include <vector>

namespace ringreduce {
namespace cpu {
namespace {

using Layout = BnLayout;

constexpr int64_t kChunkElems = 1 << 15;

int64_t rowsPerChunk(const Layout& l) {
  int64_t rowElems = std::max<int64_t>(1, l.channels * l.inner);
  return std::max<int64_t>(1, kChunkElems / rowElems);
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

// acc[c] += f(c, value) over rows [r0, r1) of one chunk, unit-stride innermost.
template <typename T, typename F>
void accumulateRows(const T* x, const Layout& l, int64_t r0, int64_t r1, double* acc, F f) {
  for (int64_t r = r0; r < r1; ++r) {
    const T* row = x + r * l.outerStride;
    if (l.inner == 1) {
      for (int64_t c = 0; c < l.channels; ++c) acc[c] += f(c, static_cast<double>(row[c]), r * l.outerStride + c);
    } else {
      for (int64_t c = 0; c < l.channels; ++c) {
        const T* p = row + c * l.channelStride;
        double s = 0;
        for (int64_t i = 0; i < l.inner; ++i) s += f(c, static_cast<double>(p[i]), r * l.outerStride + c * l.channelStride + i);
        acc[c] += s;
      }
    }
  }
}

// out[i] = f(c, i) over every element, in parallel, unit-stride innermost.
template <typename F>
void forEachElement(const Layout& l, F f) {
  forChunks(l, [&](int64_t r0, int64_t r1, int64_t) {
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t base = r * l.outerStride;
      if (l.inner == 1) {
        for (int64_t c = 0; c < l.channels; ++c) f(c, base + c);
      } else {
        for (int64_t c = 0; c < l.channels; ++c) {
          const int64_t start = base + c * l.channelStride;
          for (int64_t i = 0; i < l.inner; ++i) f(c, start + i);
        }
      }
    }
  });
}

void checkStat(const at::Tensor& t, int64_t c, const char* name) {
  TORCH_CHECK_VALUE(t.dim() == 1 && t.size(0) == c && t.is_contiguous(), "[ringreduce] sync batch norm: ",
                    name, " must be a contiguous [", c, "] tensor, got ", t.sizes());
}

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
      accumulateRows(data, l, r0, r1, mu, [](int64_t, double v, int64_t) { return v; });
      for (int64_t c = 0; c < C; ++c) mu[c] /= n;
      accumulateRows(data, l, r0, r1, sq, [mu](int64_t c, double v, int64_t) {
        double d = v - mu[c];
        return d * d;
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
        mu += delta * nb / total;
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
    for (int64_t c = 0; c < C; ++c) {
      const double n = P[c];
      const double mu = n > 0 ? P[C + c] / n : 0.0;
      const double biased = n > 0 ? std::max((P[2 * C + c] - P[C + c] * mu) / n, 0.0) : 0.0;
      m[c] = static_cast<scalar_t>(mu);
      r[c] = static_cast<scalar_t>(1.0 / std::sqrt(biased + eps));
      v[c] = static_cast<scalar_t>(n > 1 ? biased * n / (n - 1) : biased);
    }
  });
  return {mean, invstd, var};
}

namespace {

// The per-channel vector as float64 (weight/bias default to 1/0).
std::vector<double> perChannel(const std::optional<at::Tensor>& t, int64_t C, double fallback,
                               const char* name) {
  std::vector<double> out(C, fallback);
  if (!t.has_value() || !t->defined()) return out;
  checkStat(*t, C, name);
  at::Tensor d = t->to(at::kDouble);
  const double* p = d.const_data_ptr<double>();
  std::copy(p, p + C, out.begin());
  return out;
}

void updateRunningStats(const at::Tensor& mean, const at::Tensor& var, const at::Tensor& rm,
                        const std::optional<at::Tensor>& rv,
                        const std::optional<at::Tensor>& nbt, double momentum) {
  double f = momentum;
  if (momentum < 0) {
    TORCH_CHECK_VALUE(nbt.has_value() && nbt->defined(), "[ringreduce] bn_forward: momentum=None ",
                      "(cumulative average) needs num_batches_tracked");
    f = 1.0 / nbt->item<double>();  // a CPU scalar: no device sync involved
  }
  rm.mul_(1 - f).add_(mean.to(rm.scalar_type()), f);
  if (rv.has_value() && rv->defined()) rv->mul_(1 - f).add_(var.to(rv->scalar_type()), f);
}

}  // namespace

at::Tensor bnForward(const at::Tensor& input, const at::Tensor& mean, const at::Tensor& invstd,
                     const at::Tensor& varUnbiased, const std::optional<at::Tensor>& weight,
                     const std::optional<at::Tensor>& bias,
                     const std::optional<at::Tensor>& runningMean,
                     const std::optional<at::Tensor>& runningVar,
                     const std::optional<at::Tensor>& numBatchesTracked, double momentum) {
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
    forEachElement(l, [&](int64_t c, int64_t i) {
      out[i] = static_cast<scalar_t>((static_cast<opmath>(in[i]) - m[c]) * k[c] + s[c]);
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
      accumulateRows(g, l, r0, r1, &a[k * C], [](int64_t, double v, int64_t) { return v; });
      accumulateRows(g, l, r0, r1, &bsum[k * C], [&](int64_t c, double v, int64_t i) {
        return v * (static_cast<double>(in[i]) - mu[c]);
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
  at::Tensor sums = sumsIn.to(at::kDouble).contiguous();
  TORCH_CHECK_VALUE(sums.dim() == 2 && sums.size(0) == 2 && sums.size(1) == C,
                    "[ringreduce] bn_backward_elemt: sums must be [2, ", C, "], got ", sums.sizes());
  at::Tensor count = countIn.to(at::kDouble).expand({C}).contiguous();
  auto w = perChannel(weight, C, 1.0, "weight"), mu = perChannel(mean, C, 0.0, "mean");
  auto r = perChannel(invstd, C, 1.0, "invstd");
  const double* S = sums.const_data_ptr<double>();
  const double* N = count.const_data_ptr<double>();
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
    forEachElement(l, [&](int64_t c, int64_t i) {
      const opmath xm = static_cast<opmath>(in[i]) - M[c];
      out[i] = static_cast<scalar_t>(K1[c] * (static_cast<opmath>(g[i]) - A[c] - xm * K2[c]));
    });
  });
  return dx;
}

}  // namespace cpu
}  // namespace ringreduce
