// keyacc-ray CPU sampling: top-k, min-p, top-p and the seeded inverse-CDF draw for a batch of
// rows, one pass of selection per row instead of torch's CPU topk / sort (which cost 3-13 us a
// row on a 512-token vocabulary and far more on a real one).
//
// The rule is engine/sampling.py's (the torch path, which CUDA runs and the tests compare
// against): on exp((x - max) / T), a top-k row keeps the tokens whose logit is at least the
// k-th largest (ties kept) and renormalises over them; min-p rules out tokens less likely than
// min_p x the most likely one; top-p keeps the likeliest tokens until their mass reaches top_p,
// with every token exactly as likely as the one that reaches it; then the token whose cumulative
// mass, walked in token-id order, first passes u x the kept mass. Rows are independent (the same
// row draws the same token in any batch). Greedy rows: argmax_rows, a vectorised argmax.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

#if defined(__x86_64__)
#define SCLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define SCLONES
#endif

// Floats as unsigned keys in the same order (negative ones flipped), and back.
inline uint32_t key_of(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}
inline float float_of(uint32_t k) {
  const uint32_t u = (k & 0x80000000u) ? (k & 0x7fffffffu) : ~k;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// v where v >= t, else 0, without a branch (whether a token is kept is as good as random: a
// branch on it mispredicts half the time)
inline float kept(float v, float t) {
  uint32_t u;
  std::memcpy(&u, &v, 4);
  u &= 0u - static_cast<uint32_t>(v >= t);
  float r;
  std::memcpy(&r, &u, 4);
  return r;
}

SCLONES double kept_mass(const float* p, int64_t n, float t) {
  double s = 0.0;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) s += kept(p[i], t);
  return s;
}

SCLONES float mass_ge(const float* p, int64_t n, float t) {  // float lanes: vectorised
  float s = 0.0f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) s += kept(p[i], t);
  return s;
}

// The largest key K in [lo, hi] with enough(K), given enough(lo) (enough falls as K rises): a
// bisection over the values' keys, each step one branch-free vectorised pass over the values,
// cheaper on the small and flat rows sampling sees than a selection's data-dependent branches.
template <typename Enough>
uint32_t bisect(uint32_t lo, uint32_t hi, Enough enough) {
  while (lo < hi) {
    const uint32_t mid = lo + (hi - lo) / 2 + 1;
    if (enough(mid)) lo = mid;
    else hi = mid - 1;
  }
  return lo;
}

SCLONES void max_into(float* acc, const float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) acc[i] = acc[i] >= y[i] ? acc[i] : y[i];
}

// The k-th largest of x (1 <= k <= n): the largest value with at least k values >= it. The maxima
// of G interleaved groups (one vectorised pass) bound it from below when there are enough groups
// (the k largest maxima are k distinct values); only the values at least that bound (a few
// dozen on a sampling row) go to a selection.
float kth_largest(const float* x, int64_t n, int64_t k, std::vector<float>& gm, std::vector<float>& few) {
  constexpr int64_t G = 8;
  const int64_t ng = n / G;
  float floor = -std::numeric_limits<float>::infinity();
  if (ng >= 2 * k) {
    gm.assign(x, x + ng);
    for (int64_t g = 1; g < G; ++g) max_into(gm.data(), x + g * ng, ng);
    std::nth_element(gm.begin(), gm.begin() + (k - 1), gm.end(), std::greater<float>());
    floor = gm[k - 1];
  }
  few.resize(n);
  int64_t m = 0;
  for (int64_t i = 0; i < n; ++i) {  // branch-free compaction (NaN never kept)
    few[m] = x[i];
    m += x[i] >= floor;
  }
  if (m < k) return -std::numeric_limits<float>::infinity();  // NaNs
  std::nth_element(few.begin(), few.begin() + (k - 1), few.begin() + m, std::greater<float>());
  return few[k - 1];
}

// The probability of the token at which the descending cumulative mass of p (all >= 0) first
// reaches `need`: the largest value with a mass of at least `need` at or above it (the tokens as
// likely as it are all kept); 0 when the whole mass falls short of it (rounding): every token
// kept. Only values >= at_least are looked at (the caller knows the answer is not below it).
float top_p_threshold(const float* p, int64_t n, double need, float at_least, std::vector<float>& few) {
  const float lo = std::max(at_least, std::numeric_limits<float>::min());
  few.resize(n);
  float pmin = std::numeric_limits<float>::infinity(), pmax = 0.0f;
  int64_t m = 0;
  for (int64_t i = 0; i < n; ++i) {  // branch-free compaction
    const float v = p[i];
    few[m] = v;
    m += v >= lo;
    pmax = std::max(pmax, v);
  }
  few.resize(m);
  for (int64_t i = 0; i < m; ++i) pmin = std::min(pmin, few[i]);
  if (m <= 64) {  // a few candidates (top-k, or a peaked row): sorted outright
    std::sort(few.begin(), few.end(), std::greater<float>());
    double acc = 0.0;
    for (const float v : few) {
      acc += v;
      if (acc >= need) return v;
    }
    return 0.0f;
  }
  if (static_cast<double>(mass_ge(few.data(), m, pmin)) < need) return 0.0f;
  return float_of(bisect(key_of(pmin), key_of(pmax),
                         [&](uint32_t key) { return static_cast<double>(mass_ge(few.data(), m, float_of(key))) >= need; }));
}

// The first kept token (p > 0 and p >= tau) whose cumulative mass (token-id order, double)
// passes u x the kept mass; `ids` null: the index itself. Branch-free over the tokens.
int64_t draw(const float* p, const int64_t* ids, int64_t n, float tau, double u) {
  const float t = tau > 0.0f ? tau : std::numeric_limits<float>::denorm_min();
  constexpr int64_t CHUNK = 1024;  // a long row: chunk masses first (vectorised), then one chunk walked
  if (n > 8 * CHUNK) {
    const int64_t nc = (n + CHUNK - 1) / CHUNK;
    std::vector<double> mass(nc);
    double total = 0.0;
    for (int64_t c = 0; c < nc; ++c) total += mass[c] = kept_mass(p + c * CHUNK, std::min(CHUNK, n - c * CHUNK), t);
    const double target = u * total;
    double before = 0.0;
    int64_t c = 0;
    for (; c < nc - 1 && before + mass[c] <= target; ++c) before += mass[c];
    while (c > 0 && mass[c] == 0.0) before -= mass[--c];  // (rounding past the last chunk with mass)
    const int64_t start = c * CHUNK, len = std::min(CHUNK, n - start);
    const int64_t j = start + draw(p + start, nullptr, len, tau, (target - before) / std::max(mass[c], 1e-300));
    return ids ? ids[j] : j;
  }
  const double target = u * kept_mass(p, n, t);
  double cum = 0.0;
  int64_t i = 0;
  for (; i < n; ++i) {
    cum += kept(p[i], t);  // rises only at a kept token, so the first to pass is kept
    if (cum > target) break;
  }
  if (i == n) {  // rounding: the last kept token
    for (i = n - 1; i > 0 && !(p[i] >= t); --i) {
    }
  }
  return ids ? ids[i] : i;
}

struct RowScratch {
  std::vector<float> few, cand;
  std::vector<int64_t> idx;
};

int64_t sample_row(const float* x, const float* e, int64_t V, float T, int64_t k, float top_p, float min_p,
                   double u, RowScratch& rs) {
  auto& cand = rs.cand;
  if (k > 0 && k < V) {
    // top-k on the logits themselves: the k-th largest, every token at least that large kept;
    // softmax over them of x / T (the largest of them is the row's largest)
    const float kth = kth_largest(x, V, k, rs.few, rs.cand);
    auto& idx = rs.idx;
    idx.clear();
    cand.clear();
    float m = -std::numeric_limits<float>::infinity();
    for (int64_t i = 0; i < V; ++i)
      if (x[i] >= kth) {
        idx.push_back(i);
        cand.push_back(x[i] / T);
        m = std::max(m, cand.back());
      }
    double s = 0.0;
    for (auto& v : cand) {
      v = std::exp(v - m);
      s += v;
    }
    const int64_t n = static_cast<int64_t>(cand.size());
    const float fs = static_cast<float>(s);
    float pmax = 0.0f;
    for (auto& v : cand) {
      v /= fs;
      pmax = std::max(pmax, v);
    }
    if (min_p > 0.0f) {  // ruled out, then renormalised among the rest
      const float cut = min_p * pmax;
      double r = 0.0;
      for (auto& v : cand) {
        if (v < cut) v = 0.0f;
        r += v;
      }
      const float fr = static_cast<float>(r);
      for (auto& v : cand) v /= fr;
    }
    const float tau = top_p < 1.0f ? top_p_threshold(cand.data(), n, top_p, 0.0f, rs.few) : 0.0f;
    return draw(cand.data(), idx.data(), n, tau, u);
  }
  // no top-k: the whole vocabulary (e's largest is exp(0) = 1, so min-p compares with min_p)
  if (top_p >= 1.0f) {
    if (min_p <= 0.0f) return draw(e, nullptr, V, 0.0f, u);
    cand.resize(V);
    for (int64_t i = 0; i < V; ++i) cand[i] = e[i] < min_p ? 0.0f : e[i];
    return draw(cand.data(), nullptr, V, 0.0f, u);
  }
  cand.resize(V);
  for (int64_t i = 0; i < V; ++i) cand[i] = e[i] < min_p ? 0.0f : e[i];
  const float fs = static_cast<float>(kept_mass(cand.data(), V, 0.0f));  // (vectorised)
  for (auto& v : cand) v /= fs;
  // Only tokens at least (1 - top_p) / V likely can be kept: the ones below it hold less than
  // 1 - top_p together, so the threshold is never under it.
  const float floor_p = (1.0f - top_p) / static_cast<float>(V);
  const float tau = top_p_threshold(cand.data(), V, top_p, floor_p, rs.few);
  return draw(cand.data(), nullptr, V, tau, u);
}

}  // namespace

namespace {

SCLONES uint32_t max_key(const float* x, int64_t n) {  // the largest value's key (an integer max: vectorised)
  uint32_t m = 0;
#pragma omp simd reduction(max : m)
  for (int64_t i = 0; i < n; ++i) m = std::max(m, key_of(x[i] + 0.0f));  // (+ 0: -0 and 0 one key)
  return m;
}

// The first index holding key m: 16 at a time (a vectorised test), then within the block.
int64_t first_with(const float* x, int64_t n, uint32_t m) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    bool hit = false;
    for (int j = 0; j < 16; ++j) hit |= key_of(x[i + j] + 0.0f) == m;
    if (hit) break;
  }
  for (; i < n; ++i)
    if (key_of(x[i] + 0.0f) == m) return i;
  return 0;
}

}  // namespace

// The index of each row's largest logit, the first one where several are equal (torch.argmax's
// rule), for float32 or bfloat16 logits [n, V]: torch's CPU argmax over bf16 took 3.4 ms for
// 32 rows of 32,000 (about 1 ns an element; this is one vectorised pass).
torch::Tensor argmax_rows(torch::Tensor x) {
  TORCH_CHECK(x.dim() == 2, "argmax_rows: [rows, vocab]");
  if (x.scalar_type() != torch::kFloat32 && x.scalar_type() != torch::kBFloat16) return x.argmax(-1);
  x = x.to(torch::kFloat32).contiguous();  // bf16 widened by torch's vectorised copy (exact)
  const int64_t n = x.size(0), V = x.size(1);
  auto out = torch::empty({n}, torch::kInt64);
  const float* xp = x.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, n, std::max<int64_t>(1, 262144 / std::max<int64_t>(V, 1)), [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) op[r] = first_with(xp + r * V, V, max_key(xp + r * V, V));
  });
  return out;
}

// logits x [n, V] float32 (raw); per row the temperature (> 0), top-k (0: none), top-p, min-p and
// uniform u in [0, 1); e [n, V] float32 = exp(x / T - max(x / T)) per row, needed only by rows
// without top-k (else an empty tensor). Returns the sampled ids [n] int64.
torch::Tensor sample_rows(torch::Tensor x, torch::Tensor temperature, torch::Tensor top_k, torch::Tensor top_p,
                          torch::Tensor min_p, torch::Tensor u, torch::Tensor e) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32, "sample_rows: x float32 [rows, vocab]");
  x = x.contiguous();
  const int64_t n = x.size(0), V = x.size(1);
  const bool have_e = e.numel() > 0;
  TORCH_CHECK(!have_e || (e.sizes() == x.sizes() && e.scalar_type() == torch::kFloat32), "sample_rows: e like x");
  e = e.contiguous();
  auto T = temperature.to(torch::kFloat32).contiguous();
  auto k = top_k.to(torch::kInt64).contiguous();
  auto tp = top_p.to(torch::kFloat32).contiguous();
  auto mp = min_p.to(torch::kFloat32).contiguous();
  auto uu = u.to(torch::kFloat64).contiguous();
  TORCH_CHECK(T.numel() == n && k.numel() == n && tp.numel() == n && mp.numel() == n && uu.numel() == n,
              "sample_rows: one value a row");
  const int64_t* kp = k.data_ptr<int64_t>();
  for (int64_t r = 0; r < n; ++r)
    TORCH_CHECK(have_e || (kp[r] > 0 && kp[r] < V), "sample_rows: a row without top-k needs e");
  auto out = torch::empty({n}, torch::kInt64);
  const float *xp = x.data_ptr<float>(), *ep = have_e ? e.data_ptr<float>() : nullptr, *Tp = T.data_ptr<float>(),
              *tpp = tp.data_ptr<float>(), *mpp = mp.data_ptr<float>();
  const double* up = uu.data_ptr<double>();
  int64_t* op = out.data_ptr<int64_t>();
  // rows are cheap on a small vocabulary: threads only where each gets real work
  const int64_t grain = std::max<int64_t>(1, 65536 / std::max<int64_t>(V, 1));
  at::parallel_for(0, n, grain, [&](int64_t b, int64_t end) {
    RowScratch rs;
    for (int64_t r = b; r < end; ++r)
      op[r] = sample_row(xp + r * V, ep ? ep + r * V : nullptr, V, Tp[r], kp[r], tpp[r], mpp[r], up[r], rs);
  });
  return out;
}
