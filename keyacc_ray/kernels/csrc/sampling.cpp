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
#include <cstdlib>
#include <cstring>
#include <string>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

// Everything a row runs is inlined (HOT) into one entry point per ISA (sample_row_avx512,
// _avx2, _portable; argmax_row likewise), so that all of it is compiled for that ISA; the entry
// points are chosen once per process by CPUID, or forced as the linear kernels are
// (KEYACC_CPU_ISA=portable | avx2). (A helper left out of line runs as the baseline's SSE2 code
// when an AVX-512 function calls it: with helpers cloned one by one, a template instantiation
// was not, and the top-k ranking ran 6x slower than in an AVX-512 build.)
#define HOT inline __attribute__((always_inline))
#if defined(__x86_64__)
#define SAMPLING_X86 1
#define AVX512_FN __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq")))
#define AVX2_FN __attribute__((target("avx2,fma")))
#else
#define SAMPLING_X86 0
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

HOT double kept_mass(const float* p, int64_t n, float t) {
  double s = 0.0;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) s += kept(p[i], t);
  return s;
}

HOT float mass_ge(const float* p, int64_t n, float t) {  // float lanes: vectorised
  float s = 0.0f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) s += kept(p[i], t);
  return s;
}

// The largest key K in [lo, hi] with enough(K), given enough(lo) (enough falls as K rises): a
// bisection over the values' keys, each step one branch-free vectorised pass over the values,
// cheaper on the small and flat rows sampling sees than a selection's data-dependent branches.
template <typename Enough>
HOT uint32_t bisect(uint32_t lo, uint32_t hi, Enough enough) {
  while (lo < hi) {
    const uint32_t mid = lo + (hi - lo) / 2 + 1;
    if (enough(mid)) lo = mid;
    else hi = mid - 1;
  }
  return lo;
}

HOT void max_into(float* acc, const float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) acc[i] = acc[i] >= y[i] ? acc[i] : y[i];
}

// The values of x at least t and their indices, in index order, into vals / idx (room for n):
// 16 values compared at a time into a bit mask (vector registers), then only the kept ones
// walked, by their bits.
HOT int64_t gather_ge(const float* x, int64_t n, float t, float* vals, int64_t* idx) {
  int64_t m = 0, i = 0;
  for (; i + 16 <= n; i += 16) {
    uint32_t mask = 0;
#pragma omp simd reduction(| : mask)
    for (int j = 0; j < 16; ++j) mask |= static_cast<uint32_t>(x[i + j] >= t) << j;  // (NaN never kept)
    while (mask) {
      const int j = __builtin_ctz(mask);
      vals[m] = x[i + j];
      idx[m++] = i + j;
      mask &= mask - 1;
    }
  }
  for (; i < n; ++i) {
    vals[m] = x[i];
    idx[m] = i;
    m += x[i] >= t;
  }
  return m;
}

struct RowScratch {
  std::vector<float> few, cand, gm;
  std::vector<int64_t> idx;
  std::vector<double> mass;
};

// The k-th largest of v[0..m) (1 <= k <= m <= L, no NaN): the least of the values fewer than k
// others exceed. Counted branch-free in vector registers (L lanes, the unused ones -inf: they
// exceed nothing and are never the answer), which on the few dozen values a sampling row leaves
// costs less than a selection's mispredicted branches.
template <int L>
HOT float kth_of_few(const float* v, int64_t m, int64_t k) {
  float w[L];
  int32_t c[L];
  for (int i = 0; i < L; ++i) {
    w[i] = i < m ? v[i] : -std::numeric_limits<float>::infinity();
    c[i] = 0;
  }
  for (int64_t j = 0; j < m; ++j) {
    const float y = v[j];
#pragma omp simd
    for (int i = 0; i < L; ++i) c[i] += static_cast<int32_t>(y > w[i]);
  }
  float kth = std::numeric_limits<float>::infinity();
#pragma omp simd reduction(min : kth)
  for (int i = 0; i < L; ++i) kth = std::min(kth, c[i] < k && i < m ? w[i] : std::numeric_limits<float>::infinity());
  return kth;
}

// Of p[0..m) (all >= 0), the mass of the values at least each one (double), into at (room for m):
// each row of the sum in the same order, m vectorised passes.
HOT void mass_at_least_each(const float* p, int64_t m, double* at) {
  for (int64_t i = 0; i < m; ++i) at[i] = 0.0;
  for (int64_t j = 0; j < m; ++j) {
    const float y = p[j];
#pragma omp simd
    for (int64_t i = 0; i < m; ++i) at[i] += static_cast<double>(kept(y, p[i]));
  }
}

constexpr int64_t FEW = 128;  // sets up to this size are ranked by counting, larger ones selected

// The k-th largest of v[0..m) (1 <= k <= m, no NaN).
HOT float kth_of(const float* v, int64_t m, int64_t k, RowScratch& rs) {
  if (m <= 32) return kth_of_few<32>(v, m, k);
  if (m <= 64) return kth_of_few<64>(v, m, k);
  if (m <= FEW) return kth_of_few<128>(v, m, k);
  rs.few.assign(v, v + m);
  std::nth_element(rs.few.begin(), rs.few.begin() + (k - 1), rs.few.end(), std::greater<float>());
  return rs.few[k - 1];
}

// The tokens of x (n values) at least its k-th largest (1 <= k <= n; ties kept; NaN never), with
// their indices, gathered in index order into rs.cand / rs.idx; returns how many. A lower bound
// first: the element-wise maxima of the contiguous runs of w values (w >= 2k; one vectorised pass
// over x) hold k distinct values of x, so their k-th largest is at most x's; on a sampling row
// only about k tokens are at least that bound, and only those are gathered and ranked.
HOT int64_t top_k_of(const float* x, int64_t n, int64_t k, RowScratch& rs) {
  const int64_t w = std::max<int64_t>(2 * k, 64);
  float floor = -std::numeric_limits<float>::infinity();
  if (n >= 2 * w) {
    rs.gm.assign(x, x + w);
    for (int64_t g = 1; g < n / w; ++g) max_into(rs.gm.data(), x + g * w, w);
    int64_t c = 0;  // (a NaN maximum left out)
    for (int64_t i = 0; i < w; ++i) {
      rs.gm[c] = rs.gm[i];
      c += rs.gm[i] == rs.gm[i];
    }
    if (c >= k) floor = kth_of(rs.gm.data(), c, k, rs);
  }
  rs.cand.resize(n);
  rs.idx.resize(n);
  const int64_t m = gather_ge(x, n, floor, rs.cand.data(), rs.idx.data());
  if (m < k) return gather_ge(x, n, -std::numeric_limits<float>::infinity(), rs.cand.data(), rs.idx.data());  // NaNs: every other token
  const float kth = kth_of(rs.cand.data(), m, k, rs);
  int64_t c = 0;
  for (int64_t i = 0; i < m; ++i) {  // those at least the k-th, still in index order
    rs.cand[c] = rs.cand[i];
    rs.idx[c] = rs.idx[i];
    c += rs.cand[i] >= kth;
  }
  return c;
}

// The probability at which the descending cumulative mass of p[0..m) (all > 0) first reaches
// `need`: the largest value with a mass of at least `need` at or above it (the tokens as likely as
// it are all kept); 0 when the whole mass falls short of it (rounding): every token kept.
// A sampling row is peaked: dividing a bound by 8 from the row's largest value, the mass at or
// above it (float lanes: cheap, and only a guide) soon reaches `need` with few values there. The
// first such bound above `floor`, or 0 (none within a few passes).
HOT float peak_bound(const float* p, int64_t m, float top, double need, float floor) {
  float t = top;
  for (int j = 0; j < 6; ++j) {
    t *= 0.125f;
    if (t <= floor) return 0.0f;
    if (static_cast<double>(mass_ge(p, m, t)) >= need) return t;
  }
  return 0.0f;
}

HOT float threshold_of_few(const float* p, int64_t m, double need, std::vector<double>& mass) {
  mass.resize(m);
  mass_at_least_each(p, m, mass.data());
  float best = 0.0f;
  for (int64_t i = 0; i < m; ++i) best = mass[i] >= need ? std::max(best, p[i]) : best;
  return best;
}

HOT float top_p_threshold(const float* p, int64_t m, double need, std::vector<double>& mass,
                          std::vector<float>& few) {
  if (m <= 64) return threshold_of_few(p, m, need, mass);  // a few candidates (top-k, or a peaked row)
  float pmin = std::numeric_limits<float>::infinity(), pmax = 0.0f;
  for (int64_t i = 0; i < m; ++i) {
    pmin = std::min(pmin, p[i]);
    pmax = std::max(pmax, p[i]);
  }
  if (static_cast<double>(mass_ge(p, m, pmin)) < need) return 0.0f;
  // The values at least a bound whose mass reaches `need` hold the threshold (the least of them
  // has all of that mass at or above it): where they are few, it is found among them alone.
  if (const float t = peak_bound(p, m, pmax, need, pmin); t > 0.0f) {
    few.clear();
    for (int64_t i = 0; i < m; ++i)
      if (p[i] >= t) few.push_back(p[i]);
    if (few.size() <= 64) {
      const float tau = threshold_of_few(few.data(), static_cast<int64_t>(few.size()), need, mass);
      if (tau > 0.0f) return tau;  // (else the float mass misled the bound: the whole search)
    }
  }
  return float_of(bisect(key_of(pmin), key_of(pmax),
                         [&](uint32_t key) { return static_cast<double>(mass_ge(p, m, float_of(key))) >= need; }));
}

// The first kept token (p > 0 and p >= tau) whose cumulative mass (token-id order, double)
// passes u x the kept mass; `ids` null: the index itself. Branch-free over the tokens.
// The first kept token of a row short enough to walk (see draw).
HOT int64_t draw_walk(const float* p, int64_t n, float t, double target) {
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
  return i;
}

HOT int64_t draw(const float* p, const int64_t* ids, int64_t n, float tau, double u) {
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
    const double v = (target - before) / std::max(mass[c], 1e-300);  // (the chunk's own u)
    const int64_t j = start + draw_walk(p + start, len, t, v * kept_mass(p + start, len, t));
    return ids ? ids[j] : j;
  }
  const int64_t i = draw_walk(p, n, t, u * kept_mass(p, n, t));
  return ids ? ids[i] : i;
}

HOT int64_t sample_row(const float* x, const float* e, int64_t V, float T, int64_t k, float top_p, float min_p,
                   double u, RowScratch& rs) {
  auto& cand = rs.cand;
  if (k > 0 && k < V) {
    // top-k on the logits themselves: every token at least the k-th largest kept (ties), in
    // token-id order; softmax over them of x / T (the largest of them is the row's largest)
    const int64_t n = top_k_of(x, V, k, rs);
    float m = -std::numeric_limits<float>::infinity();
    for (int64_t i = 0; i < n; ++i) {
      cand[i] = cand[i] / T;
      m = std::max(m, cand[i]);
    }
    double s = 0.0;
    for (int64_t i = 0; i < n; ++i) {
      cand[i] = std::exp(cand[i] - m);
      s += cand[i];
    }
    const float fs = static_cast<float>(s);
    float pmax = 0.0f;
    for (int64_t i = 0; i < n; ++i) {
      cand[i] /= fs;
      pmax = std::max(pmax, cand[i]);
    }
    if (min_p > 0.0f) {  // ruled out, then renormalised among the rest
      const float cut = min_p * pmax;
      double r = 0.0;
      for (int64_t i = 0; i < n; ++i) {
        if (cand[i] < cut) cand[i] = 0.0f;
        r += cand[i];
      }
      const float fr = static_cast<float>(r);
      for (int64_t i = 0; i < n; ++i) cand[i] /= fr;
    }
    float tau = 0.0f;
    if (top_p < 1.0f) {  // (the ones min-p ruled out hold no mass: left out of the selection)
      rs.gm.clear();
      for (int64_t i = 0; i < n; ++i)
        if (cand[i] >= std::numeric_limits<float>::min()) rs.gm.push_back(cand[i]);
      tau = top_p_threshold(rs.gm.data(), static_cast<int64_t>(rs.gm.size()), top_p, rs.mass, rs.few);
    }
    return draw(cand.data(), rs.idx.data(), n, tau, u);
  }
  // no top-k: the whole vocabulary (e's largest is exp(0) = 1, so min-p compares with min_p)
  if (top_p >= 1.0f) {
    if (min_p <= 0.0f) return draw(e, nullptr, V, 0.0f, u);
    cand.resize(V);
    for (int64_t i = 0; i < V; ++i) cand[i] = e[i] < min_p ? 0.0f : e[i];
    return draw(cand.data(), nullptr, V, 0.0f, u);
  }
  // top-p: the probabilities p = e / sum (e below min_p ruled out). Only tokens at least
  // (1 - top_p) / V likely can be kept (the ones below hold less than 1 - top_p together, so the
  // threshold is never under it): only those are gathered (a pass over e at a bound a little
  // under it, then each gathered p computed and compared exactly), selected from and drawn from.
  // First a bound t on e from its largest (1) whose mass reaches top_p (peak_bound): the tokens
  // at least t / fs likely (all of them, by the same margin) hold that mass, so the threshold is
  // one of theirs; those fewer are gathered, and the wide gather is left for the rows where that
  // finds nothing (a flat row, or rounding).
  const float fs = static_cast<float>(kept_mass(e, V, min_p));  // (e below min_p: 0)
  const float lo = std::max((1.0f - top_p) / static_cast<float>(V), std::numeric_limits<float>::min());
  const float t = peak_bound(e, V, 1.0f, static_cast<double>(top_p) * fs, std::max(lo * fs, min_p));
  const bool narrow = t > 0.0f;
  cand.resize(V);
  rs.idx.resize(V);
  for (int pass = narrow ? 0 : 1; pass < 2; ++pass) {
    const float cut = pass == 0 ? std::max(lo, t / fs) : lo;
    const int64_t g = gather_ge(e, V, std::max(min_p, (pass == 0 ? t : lo * fs) * 0.999f), cand.data(), rs.idx.data());
    int64_t n = 0;
    for (int64_t i = 0; i < g; ++i) {
      const float p = cand[i] / fs;
      cand[n] = p;
      rs.idx[n] = rs.idx[i];
      n += p >= cut;
    }
    if (n == 0) {
      if (pass == 0) continue;
      return draw(e, nullptr, V, 0.0f, u);  // (not reached on a finite row: its best is 1 / fs)
    }
    const float tau = top_p_threshold(cand.data(), n, top_p, rs.mass, rs.few);
    if (tau > 0.0f) return draw(cand.data(), rs.idx.data(), n, tau, u);
  }
  // the whole mass short of top_p (rounding): every token kept, as the plain draw over p
  auto& all = rs.few;
  all.resize(V);
  for (int64_t i = 0; i < V; ++i) all[i] = e[i] < min_p ? 0.0f : e[i] / fs;
  return draw(all.data(), nullptr, V, 0.0f, u);
}

#define SAMPLE_ROW_ARGS                                                                                     \
  const float *x, const float *e, int64_t V, float T, int64_t k, float top_p, float min_p, double u, \
      RowScratch &rs
using SampleRowFn = int64_t (*)(SAMPLE_ROW_ARGS);
#if SAMPLING_X86
AVX512_FN int64_t sample_row_avx512(SAMPLE_ROW_ARGS) { return sample_row(x, e, V, T, k, top_p, min_p, u, rs); }
AVX2_FN int64_t sample_row_avx2(SAMPLE_ROW_ARGS) { return sample_row(x, e, V, T, k, top_p, min_p, u, rs); }
#endif
int64_t sample_row_portable(SAMPLE_ROW_ARGS) { return sample_row(x, e, V, T, k, top_p, min_p, u, rs); }

}  // namespace

namespace {

// The largest value's key (an integer max: vectorised, 64 lanes so that four vectors' maxima
// are in flight at once, not one dependent chain; + 0: -0 and 0 one key).
HOT uint32_t max_key(const float* x, int64_t n) {
  uint32_t acc[64] = {0};
  int64_t i = 0;
  for (; i + 64 <= n; i += 64) {
#pragma omp simd
    for (int j = 0; j < 64; ++j) acc[j] = std::max(acc[j], key_of(x[i + j] + 0.0f));
  }
  uint32_t m = 0;
  for (int j = 0; j < 64; ++j) m = std::max(m, acc[j]);
  for (; i < n; ++i) m = std::max(m, key_of(x[i] + 0.0f));
  return m;
}

// The first index holding key m: 64 at a time (a vectorised test: an early exit inside the
// block, or a bool's |=, keeps the compiler scalar, about 1 ns a value), then within the block.
HOT int64_t first_with(const float* x, int64_t n, uint32_t m) {
  int64_t i = 0;
  for (; i + 64 <= n; i += 64) {
    uint32_t hit = 0;
#pragma omp simd reduction(| : hit)
    for (int j = 0; j < 64; ++j) hit |= static_cast<uint32_t>(key_of(x[i + j] + 0.0f) == m);
    if (hit) break;
  }
  for (; i < n; ++i)
    if (key_of(x[i] + 0.0f) == m) return i;
  return 0;
}

using ArgmaxRowFn = int64_t (*)(const float*, int64_t);
#if SAMPLING_X86
AVX512_FN int64_t argmax_row_avx512(const float* x, int64_t n) { return first_with(x, n, max_key(x, n)); }
AVX2_FN int64_t argmax_row_avx2(const float* x, int64_t n) { return first_with(x, n, max_key(x, n)); }
#endif
int64_t argmax_row_portable(const float* x, int64_t n) { return first_with(x, n, max_key(x, n)); }

struct RowPaths {
  SampleRowFn sample;
  ArgmaxRowFn argmax;
  const char* name;
};

// The best this CPU runs, unless KEYACC_CPU_ISA forces a lesser one (portable, avx2).
const RowPaths& row_paths() {
  static const RowPaths p = [] {
    const char* f = std::getenv("KEYACC_CPU_ISA");
    const std::string forced = f ? f : "";
#if SAMPLING_X86
    if (forced != "portable" && forced != "avx2" && __builtin_cpu_supports("avx512f") &&
        __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq"))
      return RowPaths{sample_row_avx512, argmax_row_avx512, "avx512"};
    if (forced != "portable" && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
      return RowPaths{sample_row_avx2, argmax_row_avx2, "avx2"};
#endif
    return RowPaths{sample_row_portable, argmax_row_portable, "portable"};
  }();
  return p;
}

}  // namespace

std::string sampling_isa() { return row_paths().name; }

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
  const ArgmaxRowFn row = row_paths().argmax;
  at::parallel_for(0, n, std::max<int64_t>(1, 262144 / std::max<int64_t>(V, 1)), [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) op[r] = row(xp + r * V, V);
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
  const SampleRowFn sample_row = row_paths().sample;
  at::parallel_for(0, n, grain, [&](int64_t b, int64_t end) {
    RowScratch rs;
    for (int64_t r = b; r < end; ++r)
      op[r] = sample_row(xp + r * V, ep ? ep + r * V : nullptr, V, Tp[r], kp[r], tpp[r], mpp[r], up[r], rs);
  });
  return out;
}

// The penalties' flat index operations (engine/penalties.py, whose torch form is index_select,
// where and index_copy_), in place on a contiguous float32 x; idx: int64 flat indices, each at
// most once. penalize_at: x[i] = x[i] < 0 ? x[i] * p : x[i] / p, the penalty rounded to float32
// as torch rounds a Python float for a float32 tensor (transformers' score * p and score / p).
static bool in_range(const int64_t* ip, int64_t n, int64_t size) {
  int64_t lo = 0, hi = 0;  // (a min / max the compiler vectorises, then one test)
  for (int64_t j = 0; j < n; ++j) {
    lo = std::min(lo, ip[j]);
    hi = std::max(hi, ip[j]);
  }
  return lo >= 0 && (n == 0 || hi < size);
}

// x contiguous float32, idx contiguous int64 flat indices into it (`name` in the errors).
static void check_flat(const torch::Tensor& x, const torch::Tensor& idx, const char* name) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && x.is_contiguous(), name, ": contiguous float32 x");
  TORCH_CHECK(idx.scalar_type() == torch::kInt64 && idx.is_contiguous(), name, ": contiguous int64 indices");
  TORCH_CHECK(in_range(idx.data_ptr<int64_t>(), idx.numel(), x.numel()), name, ": index out of range");
}

void penalize_at(torch::Tensor x, torch::Tensor idx, double penalty) {
  check_flat(x, idx, "penalize_at");
  float* xp = x.data_ptr<float>();
  const int64_t* ip = idx.data_ptr<int64_t>();
  const int64_t n = idx.numel();
  const float p = static_cast<float>(penalty);
  at::parallel_for(0, n, 1 << 14, [&](int64_t b, int64_t e) {
    for (int64_t j = b; j < e; ++j) {  // (both made, one kept: no branch on the sign to mispredict)
      const float v = xp[ip[j]], lo = v * p, hi = v / p;
      xp[ip[j]] = v < 0.f ? lo : hi;
    }
  });
}

// x[idx[j]] -= v[j] (float32), as x.index_copy_(0, idx, x.index_select(0, idx) - v).
void subtract_at(torch::Tensor x, torch::Tensor idx, torch::Tensor v) {
  check_flat(x, idx, "subtract_at");
  TORCH_CHECK(v.scalar_type() == torch::kFloat32 && v.is_contiguous() && v.numel() == idx.numel(),
              "subtract_at: a float32 value an index");
  float* xp = x.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  const int64_t* ip = idx.data_ptr<int64_t>();
  const int64_t n = idx.numel();
  for (int64_t j = 0; j < n; ++j) xp[ip[j]] -= vp[j];
}

// sample_rows with each row's uniform made here from its seed (premixed: splitmix64's finalizer
// applied once, as engine/sampling.py's _Plan keeps them) and its position, as
// sampling.uniforms() makes it: u = (mix(seed ^ position) >> 11) * 2^-53.
torch::Tensor sample_rows_seeded(torch::Tensor x, torch::Tensor temperature, torch::Tensor top_k, torch::Tensor top_p,
                                 torch::Tensor min_p, torch::Tensor seeds, torch::Tensor positions, torch::Tensor e) {
  auto sd = seeds.to(torch::kInt64).contiguous(), ps = positions.to(torch::kInt64).contiguous();
  TORCH_CHECK(sd.numel() == ps.numel(), "sample_rows_seeded: a seed and a position a row");
  auto u = torch::empty({sd.numel()}, torch::kFloat64);
  const int64_t *sp = sd.data_ptr<int64_t>(), *pp = ps.data_ptr<int64_t>();
  double* up = u.data_ptr<double>();
  for (int64_t r = 0; r < sd.numel(); ++r) {
    uint64_t z = (static_cast<uint64_t>(sp[r]) ^ static_cast<uint64_t>(pp[r])) + 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    up[r] = static_cast<double>(z >> 11) * 0x1.0p-53;
  }
  return sample_rows(x, temperature, top_k, top_p, min_p, u, e);
}
