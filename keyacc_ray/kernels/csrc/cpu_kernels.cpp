// keyacc-ray CPU decode kernels: prepacked bf16 linear, decode attention over the engine's
// slot KV layout, RMSNorm and SiLU-multiply. One file, built at install time by
// torch.utils.cpp_extension (keyacc_ray/kernels/__init__.py).
//
// ISA dispatch is at run time: the AVX512-BF16 linear kernel is compiled with a function-level
// target attribute and only called when the CPU reports avx512bf16; every other kernel is plain
// C++ built as AVX-512F, AVX2 and baseline variants (CLONE_VARIANTS) so GCC vectorises each, and
// one is picked at run time (clone_level()). KEYACC_CPU_ISA=portable forces the portable code
// everywhere (tests use it to check the fallback on machines that do have AVX-512).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#if defined(__linux__)
#include <sys/mman.h>
#endif

#if defined(__x86_64__)
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#define KEYACC_X86 1
#else
#define KEYACC_X86 0
#endif
// The plain C++ kernels: each one's body (always inlined) built three times, as AVX-512F, AVX2 and
// baseline code, so GCC vectorises each; clone_level() picks one at run time (see CLONE_VARIANTS).
#define CLONE_BODY __attribute__((always_inline)) inline

namespace {

using bf16_t = uint16_t;

inline float bf2f(bf16_t v) {
  uint32_t u = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline bf16_t f2bf(float f) {  // round to nearest even, NaN kept quiet
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<bf16_t>((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<bf16_t>(u >> 16);
}

std::string forced_isa() {  // KEYACC_CPU_ISA: portable | avx2 | avx512 | amx (empty: the best this CPU runs)
  static const std::string v = [] {
    const char* s = std::getenv("KEYACC_CPU_ISA");
    return std::string(s ? s : "");
  }();
  return v;
}

bool force_portable() { return forced_isa() == "portable"; }

// Which build of the plain C++ kernels runs: 2 AVX-512F, 1 AVX2, 0 baseline; the best this CPU
// has, at most AVX2 where KEYACC_CPU_ISA is avx2 or portable (what a CPU without AVX-512 runs: the
// forced AVX2 path and the portable one are compared as an AVX2 machine would run them).
int clone_level() {
#if KEYACC_X86
  static const int v = [] {
    const std::string f = forced_isa();
    const int cpu = __builtin_cpu_supports("avx512f") ? 2 : __builtin_cpu_supports("avx2") ? 1 : 0;
    return std::min(cpu, (f == "avx2" || f == "portable") ? 1 : 2);
  }();
  return v;
#else
  return 0;
#endif
}

#if KEYACC_X86
#define CLONE_VARIANTS(name)                                                              \
  template <typename... A> __attribute__((target("avx512f"))) void name##_l2(A... a) { name##_body(a...); } \
  template <typename... A> __attribute__((target("avx2"))) void name##_l1(A... a) { name##_body(a...); }    \
  template <typename... A> void name##_l0(A... a) { name##_body(a...); }                                     \
  template <typename... A> inline void name(A... a) {                                                        \
    const int l = clone_level();                                                                             \
    if (l == 2) name##_l2(a...);                                                                             \
    else if (l == 1) name##_l1(a...);                                                                        \
    else name##_l0(a...);                                                                                    \
  }
#else
#define CLONE_VARIANTS(name) \
  template <typename... A> inline void name(A... a) { name##_body(a...); }
#endif

bool have_avx512bf16() {
#if KEYACC_X86
  static const bool v = __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512bw") &&
                        __builtin_cpu_supports("avx512vl");
  return v && !force_portable() && forced_isa() != "avx2";
#else
  return false;
#endif
}

// AVX2 + FMA: the linear kernel written for CPUs without AVX-512 (forced on one that has it by
// KEYACC_CPU_ISA=avx2, which also keeps every other kernel off AVX-512).
bool have_avx2() {
#if KEYACC_X86
  static const bool v = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return v && !force_portable();
#else
  return false;
#endif
}

// AMX (Sapphire Rapids and later): tile registers and a bf16 tile matrix multiply, for the
// products with many input rows (prefill, batched decode). Linux hands a process the tile state
// only on request (arch_prctl ARCH_REQ_XCOMP_PERM); refused, or forced off, the AVX-512 kernel runs.
bool have_amx() {
#if KEYACC_X86
  static const bool v = [] {
    const std::string f = forced_isa();
    if (!f.empty() && f != "amx") return false;
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
    const bool tile = d & (1u << 24), bf16 = d & (1u << 22);
    if (!tile || !bf16 || !have_avx512bf16()) return false;
    constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
  }();
  return v;
#else
  return false;
#endif
}

// ---------------------------------------------------------------------------------------------
// Linear layers from prepacked weights, bf16 or int8. Packed layout: [N/64 groups][K/2 pairs]
// [4 blocks][16 rows][2]: one load holds a k-pair for 16 output rows (the AVX512-BF16
// dot-product operand), and a group of 64 output rows is one sequential stream (256 bytes per
// k-pair for bf16), which is what the hardware prefetcher streams at full speed. Threads take
// contiguous runs of groups.
// Weight-only int8 uses per-output-row scales (max |w| / 127) and the same layout with int8
// elements: the kernel widens each int8 pair to bf16 (exact for |q| <= 127), runs the same bf16
// dot products and scales the row sums once at the end: half the bytes streamed at batch 1.
constexpr int NB = 16;
constexpr int GB = 4;  // blocks per group

// A zeroed tensor on 2 MB pages where Linux gives them (transparent huge pages in "always" or
// "madvise" mode; elsewhere plain pages, the same tensor). A decode step streams every weight once,
// and on 4 KB pages that is a TLB miss every 4 KB, each a page walk (two-level under a VM's nested
// paging) that the software prefetch ahead of the tile waits on. Measured on the 2-core Zen 3 VM
// (`bench_linear.py --stream --isa avx2`, off/on alternated seven times): a batch-1 step's products
// (755 MB) median 30.9 ms on 4 KB pages, 26.6 ms on 2 MB pages (28 GB/s: this VM's plain read).
// The pages must be asked for before they are first touched, so this allocates and zeroes itself.
// KEYACC_CPU_HUGE_PAGES=0 turns it off (plain torch allocations).
bool huge_pages_on() {
  static const bool v = [] {
    const char* e = std::getenv("KEYACC_CPU_HUGE_PAGES");
    return !(e && std::string(e) == "0");
  }();
  return v;
}

torch::Tensor zeros_huge(at::IntArrayRef sizes, torch::ScalarType dtype) {
  constexpr size_t HUGE = size_t{2} << 20;
  const size_t bytes = static_cast<size_t>(c10::multiply_integers(sizes)) * c10::elementSize(dtype);
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  // A mapping of its own (malloc may hand back heap pages already touched as 4 KB ones), cut to
  // start on a 2 MB boundary. Its pages are written at once, as torch.zeros does, so the memory is
  // the process's from here on (a KV pool sized from free RAM must not leave it to the next one).
  if (bytes >= HUGE && huge_pages_on()) {
    const size_t len = (bytes + HUGE - 1) / HUGE * HUGE;
    void* m = mmap(nullptr, len + HUGE, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (m != MAP_FAILED) {
      const uintptr_t base = reinterpret_cast<uintptr_t>(m);
      const uintptr_t start = (base + HUGE - 1) / HUGE * HUGE;
      if (start > base) munmap(m, start - base);
      if (base + HUGE > start) munmap(reinterpret_cast<void*>(start + len), base + HUGE - start);
      void* p = reinterpret_cast<void*>(start);
      madvise(p, len, MADV_HUGEPAGE);  // advice: refused (THP off), the pages are plain ones
      std::memset(p, 0, bytes);
      return torch::from_blob(p, sizes, [len](void* q) { munmap(q, len); }, torch::dtype(dtype));
    }
  }
#endif
  return torch::zeros(sizes, torch::dtype(dtype));
}

torch::Tensor zeros_huge_py(std::vector<int64_t> sizes, py::object dtype) {
  return zeros_huge(sizes, torch::python::detail::py_object_to_dtype(dtype));
}

template <typename W>
torch::Tensor pack_groups(const W* src, int64_t N, int64_t K, torch::ScalarType dtype) {
  const int64_t ng = (N + NB * GB - 1) / (NB * GB), kp = (K + 1) / 2;
  auto out = zeros_huge({ng, kp, GB, NB, 2}, dtype);
  W* dst = reinterpret_cast<W*>(out.data_ptr());
  at::parallel_for(0, ng, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g)
      for (int64_t j = 0; j < GB; ++j)
        for (int64_t i = 0; i < NB; ++i) {
          const int64_t n = (g * GB + j) * NB + i;
          if (n >= N) break;
          for (int64_t k = 0; k < K; ++k) dst[(((g * kp + k / 2) * GB + j) * NB + i) * 2 + (k & 1)] = src[n * K + k];
        }
  });
  return out;
}

torch::Tensor pack_bf16(torch::Tensor w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kBFloat16, "pack_bf16: want [N, K] bfloat16");
  w = w.contiguous();
  return pack_groups(reinterpret_cast<const bf16_t*>(w.data_ptr()), w.size(0), w.size(1), torch::kBFloat16);
}

std::vector<torch::Tensor> pack_int8(torch::Tensor w) {
  TORCH_CHECK(w.dim() == 2, "pack_int8: want [N, K]");
  auto wf = w.to(torch::kFloat32).contiguous();
  auto scales = (wf.abs().amax({1}) / 127.0).clamp_min(1e-12).contiguous();
  auto q = torch::round(wf / scales.unsqueeze(1)).clamp(-127, 127).to(torch::kInt8).contiguous();
  return {pack_groups(q.data_ptr<int8_t>(), wf.size(0), wf.size(1), torch::kInt8), scales};
}

inline float w_to_f(bf16_t v) { return bf2f(v); }
inline float w_to_f(int8_t v) { return static_cast<float>(v); }

#if KEYACC_X86
#define AVX512BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))

// Software prefetch of a weight stream PF_BYTES ahead of where a tile reads it. The hardware
// prefetcher alone left the batch-1 and few-row products at 16-19 GB/s of the 22-23 GB/s a
// plain two-thread sum reads on a 2-core Xeon VM; 4 KB ahead brought them to 20-23 GB/s, and
// 4-6 rows from ~13 to ~20 GB/s (scripts/bench_engine.py's roofline ratio; 2, 6 and 8 KB
// measured within noise of 4 KB). A prefetch past the end of the weights cannot fault. The AVX2
// kernels, which run natively on AMD Zen, ask for less (AVX2_PF_BYTES).
constexpr int PF_BYTES = 4096;
template <int DIST = PF_BYTES>
inline void prefetch_ahead(const void* p, int bytes) {
  for (int j = 0; j < bytes; j += 64) _mm_prefetch(static_cast<const char*>(p) + DIST + j, _MM_HINT_T0);
}

// A k-pair of 16 rows as the bf16 dot-product operand.
AVX512BF16 inline __m512i load_pair(const bf16_t* p) { return _mm512_loadu_si512(p); }
AVX512BF16 inline __m512i load_pair(const int8_t* p) {
  const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)));
  const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(p + 16))));
  return (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
}

// One group (GB blocks of 16 rows) x MT input rows per tile: GB*MT accumulators. Row sums are
// scaled (int8: by `sc`; bf16: by 1, exact) and the bias added before one rounding to bf16.
template <typename W, int MT>
AVX512BF16 inline void tile(const W* G, int64_t kp, int64_t n_base, const bf16_t* x, int64_t ldx, int64_t m0, int mt,
                            const float* sc, const float* bias, bf16_t* y, int64_t ldy, int64_t N) {
  __m512 acc[GB][MT];
  for (int j = 0; j < GB; ++j)
    for (int m = 0; m < MT; ++m) acc[j][m] = _mm512_setzero_ps();
  const int32_t* xr[MT];
  for (int m = 0; m < MT; ++m) xr[m] = reinterpret_cast<const int32_t*>(x + (m0 + (m < mt ? m : 0)) * ldx);
  for (int64_t p = 0; p < kp; ++p) {
    const W* wp = G + p * GB * NB * 2;
    prefetch_ahead(wp, GB * NB * 2 * sizeof(W));
    __m512i w[GB];
    for (int j = 0; j < GB; ++j) w[j] = load_pair(wp + j * NB * 2);
    for (int m = 0; m < MT; ++m) {
      const __m512i xb = _mm512_set1_epi32(xr[m][p]);
      for (int j = 0; j < GB; ++j) acc[j][m] = _mm512_dpbf16_ps(acc[j][m], (__m512bh)w[j], (__m512bh)xb);
    }
  }
  for (int j = 0; j < GB; ++j) {
    const int64_t n0 = n_base + j * NB;
    if (n0 >= N) break;
    const int64_t rem = N - n0;
    const __mmask16 mask = rem >= NB ? (__mmask16)0xffff : (__mmask16)((1u << rem) - 1);
    const __m512 sv = sc ? _mm512_maskz_loadu_ps(mask, sc + n0) : _mm512_set1_ps(1.f);
    const __m512 bv = bias ? _mm512_maskz_loadu_ps(mask, bias + n0) : _mm512_setzero_ps();
    for (int m = 0; m < mt; ++m) {
      __m256bh r = _mm512_cvtneps_pbh(_mm512_fmadd_ps(acc[j][m], sv, bv));
      _mm256_mask_storeu_epi16(y + (m0 + m) * ldy + n0, mask, (__m256i)r);
    }
  }
}

template <typename W>
AVX512BF16 void group_avx512(const W* G, int64_t kp, int64_t n_base, const bf16_t* x, int64_t ldx, int64_t M,
                             const float* sc, const float* bias, bf16_t* y, int64_t ldy, int64_t N) {
  constexpr int MT = 6;
  int64_t m0 = 0;
  for (; m0 + MT <= M; m0 += MT) tile<W, MT>(G, kp, n_base, x, ldx, m0, MT, sc, bias, y, ldy, N);
  const int r = static_cast<int>(M - m0);
  switch (r) {  // the tail: an exact tile so no accumulator is wasted at batch 1
    case 0: break;
    case 1: tile<W, 1>(G, kp, n_base, x, ldx, m0, 1, sc, bias, y, ldy, N); break;
    case 2: tile<W, 2>(G, kp, n_base, x, ldx, m0, 2, sc, bias, y, ldy, N); break;
    case 3: tile<W, 3>(G, kp, n_base, x, ldx, m0, 3, sc, bias, y, ldy, N); break;
    case 4: tile<W, 4>(G, kp, n_base, x, ldx, m0, 4, sc, bias, y, ldy, N); break;
    default: tile<W, 5>(G, kp, n_base, x, ldx, m0, 5, sc, bias, y, ldy, N); break;
  }
}
#endif

#if KEYACC_X86
// AMX over one group (4 blocks of 16 output rows): the packed layout is already the tile
// multiply's second operand (a k-pair of 16 rows per 64 bytes: VNNI order), so a B tile is 16
// k-pairs of one block, 256 bytes apart. Per 16 input rows: 4 accumulator tiles (C, 16 x 16
// float), an A tile of 16 rows x 32 k, and the 4 blocks' B tiles, for every 32 k. Needs K a
// multiple of 32 (the caller checks); a last partial set of rows goes through a zero-padded copy.
#define AMX_FN __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512bf16")))

struct alignas(64) TileConfig {
  uint8_t palette_id, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};
static_assert(sizeof(TileConfig) == 64, "the tile configuration is 64 bytes");

AMX_FN void amx_begin() {
  static const TileConfig cfg = [] {
    TileConfig c;
    std::memset(&c, 0, sizeof c);
    c.palette_id = 1;
    for (int t = 0; t < 7; ++t) {  // 0-3 C, 4 A, 5-6 B: 16 rows of 64 bytes each
      c.rows[t] = 16;
      c.colsb[t] = 64;
    }
    return c;
  }();
  _tile_loadconfig(&cfg);
}

AMX_FN void amx_end() { _tile_release(); }

// Weight-only int8 on the same tiles: a group's int8 weights widened to bf16 into `out` in the
// same packed layout (exact for |q| <= 127, as the AVX-512 int8 kernel widens them), so the tile
// loads read it as they read a bf16 group; the row sums are scaled at the end.
AMX_FN void widen_group(const int8_t* G, int64_t n, std::vector<bf16_t>& out) {
  out.resize(n);
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(G + i))));
    const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(G + i + 16))));
    _mm512_storeu_si512(out.data() + i, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
  }
  for (; i < n; ++i) out[i] = f2bf(static_cast<float>(G[i]));
}

// The tile loads wait on memory when a group's weights stream from DRAM (every product of a decode
// step: each layer's weights are read once a step): the hardware prefetchers start again at every
// 4 KB, and a tile load stalls until its 16 rows arrive. So the first 16-row pass asks for the
// weights two k-steps (8 KB) ahead (4-16 KB tried; 8 and 12 best). docs/benchmarks.md, "CPU decode
// attention": `bench_cpu_isa.py --isa amx` batch 32 +7-24%, batch 8 +12-15% on the 2-core Xeon VM.
constexpr int64_t AMX_PF_BYTES = 8192;

AMX_FN void group_amx(const bf16_t* G, int64_t kp, int64_t n_base, const bf16_t* x, int64_t ldx, int64_t M,
                      const float* sc, const float* bias, bf16_t* y, int64_t ldy, int64_t N) {
  alignas(64) float c[16 * GB * NB];  // [16 rows][64 outputs]
  constexpr int64_t BSTRIDE = GB * NB * 2 * sizeof(bf16_t);  // bytes from one k-pair of a block to the next
  constexpr int64_t STEP_BYTES = 16 * BSTRIDE;                // the weights of one k-step (16 k-pairs)
  for (int64_t m0 = 0; m0 < M; m0 += 16) {
    const int64_t rows = std::min<int64_t>(16, M - m0);
    const bf16_t* a = x + m0 * ldx;  // (x has rows up to a multiple of 16, zeros past M: see linear_packed)
    const int64_t lda = ldx;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t p = 0; p < kp; p += 16) {
      const bf16_t* b = G + p * GB * NB * 2;
      if (m0 == 0)  // the first pass streams the group's weights; the later ones find them in L2
        for (int64_t j = 0; j < STEP_BYTES; j += 64)
          _mm_prefetch(reinterpret_cast<const char*>(b) + AMX_PF_BYTES + j, _MM_HINT_T0);
      _tile_loadd(4, a + 2 * p, lda * sizeof(bf16_t));
      _tile_loadd(5, b, BSTRIDE);
      _tile_loadd(6, b + NB * 2, BSTRIDE);
      _tile_dpbf16ps(0, 4, 5);
      _tile_dpbf16ps(1, 4, 6);
      _tile_loadd(5, b + 2 * NB * 2, BSTRIDE);
      _tile_loadd(6, b + 3 * NB * 2, BSTRIDE);
      _tile_dpbf16ps(2, 4, 5);
      _tile_dpbf16ps(3, 4, 6);
    }
    constexpr int64_t LDC = GB * NB * sizeof(float);
    _tile_stored(0, c, LDC);
    _tile_stored(1, c + NB, LDC);
    _tile_stored(2, c + 2 * NB, LDC);
    _tile_stored(3, c + 3 * NB, LDC);
    for (int j = 0; j < GB; ++j) {
      const int64_t n0 = n_base + j * NB;
      if (n0 >= N) break;
      const int64_t rem = N - n0;
      const __mmask16 mask = rem >= NB ? (__mmask16)0xffff : (__mmask16)((1u << rem) - 1);
      const __m512 bv = bias ? _mm512_maskz_loadu_ps(mask, bias + n0) : _mm512_setzero_ps();
      const __m512 sv = sc ? _mm512_maskz_loadu_ps(mask, sc + n0) : _mm512_set1_ps(1.f);
      for (int64_t r = 0; r < rows; ++r) {  // (bf16: x 1 + bias, exact as the add it replaces)
        __m256bh v = _mm512_cvtneps_pbh(_mm512_fmadd_ps(_mm512_load_ps(c + r * GB * NB + j * NB), sv, bv));
        _mm256_mask_storeu_epi16(y + (m0 + r) * ldy + n0, mask, (__m256i)v);
      }
    }
  }
}
#endif

#if KEYACC_X86
// AVX2 + FMA (no AVX-512: Zen 2/3, Haswell..Comet Lake): the same packed layout, widened in
// registers. A half block (8 output rows) of one k-pair is 32 bytes of bf16 (16 of int8): each
// 32-bit lane holds a row's (k, k+1) pair, so the k weights are the lanes shifted left 16 bits
// and the k+1 weights the lanes with the low 16 bits cleared, exact float32 in two instructions.
// A tile: HB half blocks x MT input rows of float32 accumulators (at most 12 of the 16
// registers), each input pair broadcast from a float32 copy of the rows.
#define AVX2_FN __attribute__((target("avx2,fma")))

// On a 2-core AMD EPYC (Zen 3) VM a batch-1 step's products streamed their weights fastest with
// the software prefetch 768-1536 bytes ahead: 10% faster than 4 KB ahead or none (a standalone
// copy of the batch-1 tile, distances interleaved over 30 rounds; docs/benchmarks.md). The passes
// that read whole k-pair rows take it (one input row, and the chunked path's widening); a tile of
// fewer half blocks reads 64 bytes of each row and keeps PF_BYTES (1 KB ahead: 16% slower at 8 rows).
constexpr int AVX2_PF_BYTES = 1024;

AVX2_FN inline void load_half(const bf16_t* p, __m256& w0, __m256& w1) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  w0 = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
  w1 = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(static_cast<int>(0xffff0000u))));
}
AVX2_FN inline void load_half(const int8_t* p, __m256& w0, __m256& w1) {
  const __m256i v = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  w0 = _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(v, 16), 16));
  w1 = _mm256_cvtepi32_ps(_mm256_srai_epi32(v, 16));
}

template <typename W, int HB, int MT>
AVX2_FN inline void tile_avx2(const W* G, int64_t kp, int h0, int64_t n_base, const float* x, int64_t ldx,
                              int64_t m0, int mt, const float* sc, const float* bias, bf16_t* y, int64_t ldy,
                              int64_t N) {
  __m256 acc[HB][MT];
  for (int h = 0; h < HB; ++h)
    for (int m = 0; m < MT; ++m) acc[h][m] = _mm256_setzero_ps();
  const float* xr[MT];
  for (int m = 0; m < MT; ++m) xr[m] = x + (m0 + (m < mt ? m : 0)) * ldx;
  for (int64_t p = 0; p < kp; ++p) {
    const W* wp = G + p * GB * NB * 2 + h0 * 16;
    prefetch_ahead<MT == 1 ? AVX2_PF_BYTES : PF_BYTES>(wp, HB * 16 * sizeof(W));
    __m256 w0[HB], w1[HB];
    for (int h = 0; h < HB; ++h) load_half(wp + h * 16, w0[h], w1[h]);
    for (int m = 0; m < MT; ++m) {  // the input pair broadcast straight from memory (float32 rows)
      const __m256 a = _mm256_broadcast_ss(xr[m] + 2 * p), b = _mm256_broadcast_ss(xr[m] + 2 * p + 1);
      for (int h = 0; h < HB; ++h) acc[h][m] = _mm256_fmadd_ps(w1[h], b, _mm256_fmadd_ps(w0[h], a, acc[h][m]));
    }
  }
  for (int h = 0; h < HB; ++h) {
    const int64_t n0 = n_base + (h0 + h) * 8;
    if (n0 >= N) break;
    const int rem = static_cast<int>(std::min<int64_t>(8, N - n0));
    for (int m = 0; m < mt; ++m) {
      alignas(32) float r[8];
      _mm256_store_ps(r, acc[h][m]);
      bf16_t* out = y + (m0 + m) * ldy + n0;
      for (int i = 0; i < rem; ++i) out[i] = f2bf(r[i] * (sc ? sc[n0 + i] : 1.f) + (bias ? bias[n0 + i] : 0.f));
    }
  }
}

// Many rows: the group's weights widened to float32 once per chunk of KC k-pairs into a buffer that
// stays in L1, which every 6-row tile then reads as plain loads (widening them again for each tile
// took FMA-port slots); accumulators kept per row and column across chunks. Each output still sums
// its k-pairs in order, fma(w1, x1, fma(w0, x0, acc)): the same floats as the tiles above.
constexpr int64_t AVX2_KC = 32;  // k-pairs per chunk: 32 x 8 half blocks x 2 x 32 bytes = 16 KB
// rows from which the chunked path runs: fewer read each weight into registers about once anyway
// (measured the same at 6-12 rows; 17-60% faster at 32, the vocabulary's product most)
constexpr int64_t AVX2_CHUNKED_ROWS = 12;

template <int HB, int MT>
AVX2_FN inline void chunk_tile_avx2(const float* wb, int64_t pc, int h0, const float* x, int64_t ldx, int64_t p0,
                                    int64_t m0, int mt, float* accs) {
  constexpr int H = 2 * GB;
  __m256 acc[HB][MT];
  const float* xr[MT];
  for (int m = 0; m < MT; ++m) {
    const int64_t row = m0 + (m < mt ? m : 0);
    xr[m] = x + row * ldx + 2 * p0;
    for (int h = 0; h < HB; ++h) acc[h][m] = _mm256_loadu_ps(accs + row * (GB * NB) + (h0 + h) * 8);
  }
  for (int64_t p = 0; p < pc; ++p) {
    const float* wp = wb + (p * H + h0) * 16;
    __m256 w0[HB], w1[HB];
    for (int h = 0; h < HB; ++h) {
      w0[h] = _mm256_load_ps(wp + h * 16);
      w1[h] = _mm256_load_ps(wp + h * 16 + 8);
    }
    for (int m = 0; m < MT; ++m) {
      const __m256 a = _mm256_broadcast_ss(xr[m] + 2 * p), b = _mm256_broadcast_ss(xr[m] + 2 * p + 1);
      for (int h = 0; h < HB; ++h) acc[h][m] = _mm256_fmadd_ps(w1[h], b, _mm256_fmadd_ps(w0[h], a, acc[h][m]));
    }
  }
  for (int m = 0; m < mt; ++m)
    for (int h = 0; h < HB; ++h) _mm256_storeu_ps(accs + (m0 + m) * (GB * NB) + (h0 + h) * 8, acc[h][m]);
}

template <typename W>
AVX2_FN void group_avx2_chunked(const W* G, int64_t kp, int64_t n_base, const float* x, int64_t ldx, int64_t M,
                                const float* sc, const float* bias, bf16_t* y, int64_t ldy, int64_t N) {
  constexpr int H = 2 * GB;
  alignas(32) float wb[AVX2_KC * H * 16];
  std::vector<float> accs(static_cast<size_t>(M) * GB * NB, 0.f);
  for (int64_t p0 = 0; p0 < kp; p0 += AVX2_KC) {
    const int64_t pc = std::min<int64_t>(AVX2_KC, kp - p0);
    for (int64_t p = 0; p < pc; ++p) {
      const W* wp = G + (p0 + p) * GB * NB * 2;
      prefetch_ahead<AVX2_PF_BYTES>(wp, H * 16 * sizeof(W));
      for (int h = 0; h < H; ++h) {
        __m256 w0, w1;
        load_half(wp + h * 16, w0, w1);
        _mm256_store_ps(wb + (p * H + h) * 16, w0);
        _mm256_store_ps(wb + (p * H + h) * 16 + 8, w1);
      }
    }
    int64_t m0 = 0;
    for (; m0 + 6 <= M; m0 += 6)
      for (int h0 = 0; h0 < H; h0 += 2) chunk_tile_avx2<2, 6>(wb, pc, h0, x, ldx, p0, m0, 6, accs.data());
    const int r = static_cast<int>(M - m0);
    switch (r) {
      case 0: break;
      case 1: chunk_tile_avx2<8, 1>(wb, pc, 0, x, ldx, p0, m0, 1, accs.data()); break;
      case 2: for (int h0 = 0; h0 < H; h0 += 4) chunk_tile_avx2<4, 2>(wb, pc, h0, x, ldx, p0, m0, 2, accs.data()); break;
      case 3: for (int h0 = 0; h0 < H; h0 += 4) chunk_tile_avx2<4, 3>(wb, pc, h0, x, ldx, p0, m0, 3, accs.data()); break;
      case 4: for (int h0 = 0; h0 < H; h0 += 2) chunk_tile_avx2<2, 4>(wb, pc, h0, x, ldx, p0, m0, 4, accs.data()); break;
      default: for (int h0 = 0; h0 < H; h0 += 2) chunk_tile_avx2<2, 5>(wb, pc, h0, x, ldx, p0, m0, 5, accs.data()); break;
    }
  }
  for (int64_t m = 0; m < M; ++m)
    for (int i = 0; i < GB * NB && n_base + i < N; ++i) {
      const int64_t n = n_base + i;
      y[m * ldy + n] = f2bf(accs[m * GB * NB + i] * (sc ? sc[n] : 1.f) + (bias ? bias[n] : 0.f));
    }
}

// x: the input rows widened to float32 once per call (the caller's), so a broadcast is one load.
template <typename W>
AVX2_FN void group_avx2(const W* G, int64_t kp, int64_t n_base, const float* x, int64_t ldx, int64_t M,
                        const float* sc, const float* bias, bf16_t* y, int64_t ldy, int64_t N) {
  constexpr int H = 2 * GB;  // half blocks in a group
  if (M >= AVX2_CHUNKED_ROWS) return group_avx2_chunked<W>(G, kp, n_base, x, ldx, M, sc, bias, y, ldy, N);
  int64_t m0 = 0;
  for (; m0 + 6 <= M; m0 += 6)  // 2 half blocks x 6 rows: 12 accumulators, weights re-read from L1/L2
    for (int h0 = 0; h0 < H; h0 += 2) tile_avx2<W, 2, 6>(G, kp, h0, n_base, x, ldx, m0, 6, sc, bias, y, ldy, N);
  const int r = static_cast<int>(M - m0);
  switch (r) {  // the tail (batch 1: the whole group in one pass, every weight loaded once)
    case 0: break;
    case 1: tile_avx2<W, 8, 1>(G, kp, 0, n_base, x, ldx, m0, 1, sc, bias, y, ldy, N); break;
    case 2: for (int h0 = 0; h0 < H; h0 += 4) tile_avx2<W, 4, 2>(G, kp, h0, n_base, x, ldx, m0, 2, sc, bias, y, ldy, N); break;
    case 3: for (int h0 = 0; h0 < H; h0 += 4) tile_avx2<W, 4, 3>(G, kp, h0, n_base, x, ldx, m0, 3, sc, bias, y, ldy, N); break;
    case 4: for (int h0 = 0; h0 < H; h0 += 2) tile_avx2<W, 2, 4>(G, kp, h0, n_base, x, ldx, m0, 4, sc, bias, y, ldy, N); break;
    default: for (int h0 = 0; h0 < H; h0 += 2) tile_avx2<W, 2, 5>(G, kp, h0, n_base, x, ldx, m0, 5, sc, bias, y, ldy, N); break;
  }
}
#endif

// Input rows from which the bf16 products run on AMX tiles (fewer: the AVX-512 kernel, which
// streams the weights once for every row and is as fast when it is bandwidth-bound).
constexpr int64_t AMX_MIN_ROWS = 8;

template <typename W>
CLONE_BODY void group_portable_body(const W* G, int64_t kp, int64_t n_base, const bf16_t* x, int64_t ldx,
                                    int64_t M, const float* sc, const float* bias, bf16_t* y, int64_t ldy, int64_t N) {
  for (int64_t m = 0; m < M; ++m) {
    float acc[GB * NB] = {0};
    const bf16_t* xm = x + m * ldx;
    for (int64_t p = 0; p < kp; ++p) {
      const float x0 = bf2f(xm[2 * p]), x1 = bf2f(xm[2 * p + 1]);
      const W* w = G + p * GB * NB * 2;
      for (int i = 0; i < GB * NB; ++i) acc[i] += w_to_f(w[2 * i]) * x0 + w_to_f(w[2 * i + 1]) * x1;
    }
    for (int i = 0; i < GB * NB && n_base + i < N; ++i)
      y[m * ldy + n_base + i] = f2bf(acc[i] * (sc ? sc[n_base + i] : 1.f) + (bias ? bias[n_base + i] : 0.f));
  }
}
CLONE_VARIANTS(group_portable)

// y = x @ (sc * W)^T + b over a packed weight of element type W; x bf16 with any leading dims.
template <typename W>
torch::Tensor linear_packed(const char* name, torch::Tensor x, const torch::Tensor& packed, const float* sc, int64_t N,
                            const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(x.scalar_type() == torch::kBFloat16, name, ": bfloat16 input");
  TORCH_CHECK(packed.dim() == 5 && packed.size(2) == GB && packed.size(3) == NB, name, ": not a packed weight");
  const int64_t ng = packed.size(0), kp = packed.size(1);
  auto shape = x.sizes().vec();
  const int64_t K = shape.back();
  TORCH_CHECK(kp == (K + 1) / 2, name, ": input features ", K, " do not match the packed weight");
  auto x2 = x.reshape({-1, K});
  if (K % 2 || x2.stride(1) != 1 || x2.stride(0) != K) {  // pad to an even row so k-pairs are whole
    auto xp = torch::zeros({x2.size(0), 2 * kp}, x.options());
    xp.narrow(1, 0, K).copy_(x2);
    x2 = xp;
  }
  const int64_t M = x2.size(0), ldx = x2.size(1);
  shape.back() = N;
  auto y = torch::empty(shape, x.options());
  if (M == 0) return y;
  torch::Tensor bias_f;
  const float* bp = nullptr;
  if (bias.has_value() && bias->defined()) {
    bias_f = bias->to(torch::kFloat32).contiguous();
    bp = bias_f.data_ptr<float>();
  }
  const W* P = reinterpret_cast<const W*>(packed.data_ptr());
  const bf16_t* xp = reinterpret_cast<const bf16_t*>(x2.data_ptr());
  bf16_t* yp = reinterpret_cast<bf16_t*>(y.data_ptr());
  const bool fast = have_avx512bf16(), avx2 = !fast && have_avx2();
  const int64_t gstride = kp * GB * NB * 2;
#if KEYACC_X86
  if (M >= AMX_MIN_ROWS && kp % 16 == 0 && have_amx()) {
    // A tiles take 16 rows: the input zero-padded to a multiple of 16 rows once here (each group
    // padding its own copy cost more than the products at 8 rows: 48 KB written per group)
    torch::Tensor xpad;
    const bf16_t* xa = xp;
    if (M % 16) {
      xpad = torch::zeros({(M + 15) / 16 * 16, ldx}, x2.options());
      xpad.narrow(0, 0, M).copy_(x2);
      xa = reinterpret_cast<const bf16_t*>(xpad.data_ptr());
    }
    at::parallel_for(0, ng, 1, [&](int64_t g0, int64_t g1) {
      std::vector<bf16_t> wide;
      amx_begin();
      for (int64_t g = g0; g < g1; ++g) {
        const bf16_t* grp;
        if constexpr (std::is_same<W, bf16_t>::value) {
          grp = P + g * gstride;
        } else {
          widen_group(P + g * gstride, gstride, wide);
          grp = wide.data();
        }
        group_amx(grp, kp, g * GB * NB, xa, ldx, M, sc, bp, yp, N, N);
      }
      amx_end();
    });
    return y;
  }
#endif
  torch::Tensor xf;  // AVX2: the input rows in float32, once
  if (avx2) xf = x2.to(torch::kFloat32).contiguous();
  const float* xfp = avx2 ? xf.data_ptr<float>() : nullptr;
  auto group = [&](int64_t g) {  // one group of outputs, on the path this CPU runs
#if KEYACC_X86
    if (fast) return group_avx512<W>(P + g * gstride, kp, g * GB * NB, xp, ldx, M, sc, bp, yp, N, N);
    if (avx2) return group_avx2<W>(P + g * gstride, kp, g * GB * NB, xfp, ldx, M, sc, bp, yp, N, N);
#endif
    group_portable(P + g * gstride, kp, g * GB * NB, xp, ldx, M, sc, bp, yp, N, N);
  };
  // AVX2 products of 2 rows or more: groups handed out one at a time, so a thread the host slows
  // (this kind of VM's steal time) does fewer of them instead of holding the other at the join.
  // `bench_linear.py --stream --isa avx2` on the 2-core Zen 3 VM, seven alternations: rows 8 faster
  // in all seven (by 0.5-58 ms, mostly in noisy minutes), rows 32 in four; rows 1 mixed (+-5 ms),
  // so a batch-1 product (and every other path) keeps each thread's one contiguous share.
  if (avx2 && M > 1) {
    std::atomic<int64_t> next{0};
    at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
      for (int64_t g; (g = next.fetch_add(1, std::memory_order_relaxed)) < ng;) group(g);
    });
  } else {
    at::parallel_for(0, ng, 1, [&](int64_t g0, int64_t g1) {
      for (int64_t g = g0; g < g1; ++g) group(g);
    });
  }
  return y;
}

torch::Tensor linear_bf16(torch::Tensor x, torch::Tensor packed, int64_t N, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(packed.scalar_type() == torch::kBFloat16, "linear_bf16: bfloat16 weights");
  return linear_packed<bf16_t>("linear_bf16", x, packed, nullptr, N, bias);
}

torch::Tensor linear_int8(torch::Tensor x, torch::Tensor packed, torch::Tensor scales, int64_t N,
                          c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(packed.scalar_type() == torch::kInt8, "linear_int8: int8 weights");
  TORCH_CHECK(scales.scalar_type() == torch::kFloat32 && scales.numel() == N && scales.is_contiguous(), "linear_int8: scales");
  return linear_packed<int8_t>("linear_int8", x, packed, scales.data_ptr<float>(), N, bias);
}

// ---------------------------------------------------------------------------------------------
// Decode attention: one query token per sequence, K/V read in place from the engine's slot
// buffers [B, Hkv, L, D] (any strides on B, Hkv, L), grouped-query heads share each K/V row,
// softmax fused. Masked positions (additive mask below -1e30) are skipped.
template <typename T> inline float to_f(T v);
template <> inline float to_f<float>(float v) { return v; }
template <> inline float to_f<bf16_t>(bf16_t v) { return bf2f(v); }
template <typename T> inline T from_f(float v);
template <> inline float from_f<float>(float v) { return v; }
template <> inline bf16_t from_f<bf16_t>(float v) { return f2bf(v); }

// exp(x) to about 1 ulp in float32 for x in [-87, 88] (Cephes' range reduction and polynomial),
// written so the compiler vectorises loops that call it (libm's expf is a scalar call).
inline float vexp(float x) {
  x = x < -87.3f ? -87.3f : (x > 88.3f ? 88.3f : x);
  const float t = x * 1.44269504088896341f;
  const int n = static_cast<int>(t + (t >= 0.f ? 0.5f : -0.5f));
  const float fn = static_cast<float>(n);
  float r = x - fn * 0.693359375f;
  r = r - fn * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  uint32_t bits = static_cast<uint32_t>(n + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, 4);
  return p * scale;
}

// Dot product with 16 partial sums (the compiler vectorises it without reassociating floats).
inline float dot(const float* a, const float* b, int64_t n) {
  constexpr int V = 16;
  float part[V] = {0};
  int64_t i = 0;
  for (; i + V <= n; i += V)
    for (int l = 0; l < V; ++l) part[l] += a[i + l] * b[i + l];
  float s = 0.f;
  for (; i < n; ++i) s += a[i] * b[i];
  for (int l = 0; l < V; ++l) s += part[l];
  return s;
}

inline float sum_squares(const float* a, int64_t n) { return dot(a, a, n); }

// dot(row, row, D)'s end, for the vector versions: 16 partial sums p of rows [0, d), then the
// tail [d, D) and the partials in order, as dot() adds them.
inline float finish_squares(const float* p, const float* row, int64_t d, int64_t D) {
  float ss = 0.f;
  for (; d < D; ++d) ss += row[d] * row[d];
  for (int l = 0; l < 16; ++l) ss += p[l];
  return ss;
}

// Where key / value row j of one sequence and KV head lives: base + j * sl in a slot buffer, or
// in the paged pool at block table[j / bs] (block stride bstride), row j % bs of it.
template <typename T> struct Rows {
  const T* base;
  int64_t sl;
  const int32_t* table = nullptr;
  int64_t bs = 1, bstride = 0;
  inline const T* at(int64_t j) const {
    return table ? base + static_cast<int64_t>(table[j / bs]) * bstride + (j % bs) * sl : base + j * sl;
  }
  inline void prefetch(int64_t j, int64_t D) const {
    const char* p = reinterpret_cast<const char*>(at(j));
    for (int64_t o = 0; o < D * static_cast<int64_t>(sizeof(T)); o += 64) __builtin_prefetch(p + o, 0, 3);
  }
  // How many keys from j on lie one after another in memory (the rest of j's block), at most L - j.
  inline int64_t run(int64_t j, int64_t L) const {
    if (!table) return L - j;
    const int64_t n = bs - j % bs;
    return n < L - j ? n : L - j;
  }
};

// Decode attention streams each key and value row once from memory, and a paged pool's rows come
// in blocks of a few KB scattered over the pool: the hardware prefetchers start again at every
// block. So the K loop asks for the row KV_AHEAD keys on (K's, then V's once K's run out) and the
// V loop for the rows KV_AHEAD on from each run it starts (16-128 tried in a throwaway sweep, 32
// kept; before/after of the whole kernel: `scripts/bench_cpu_attention.py`, docs/benchmarks.md).
constexpr int64_t KV_AHEAD = 32;
template <typename T>
inline void prefetch_k_then_v(const Rows<T>& k, const Rows<T>& v, int64_t j, int64_t j0, int64_t L, int64_t D) {
  const int64_t a = j + KV_AHEAD;
  if (a < L) k.prefetch(a, D);
  else if (j0 + a - L < L) v.prefetch(j0 + a - L, D);
}

// Keys before j0 (a sliding window's start) are skipped like masked ones.
template <typename T>
CLONE_BODY void attn_one_body(const T* q, int64_t qsh, Rows<T> k, Rows<T> v, const T* mask, int64_t j0,
                              int64_t L, int64_t G, int64_t D, float scale, T* out, int64_t osh, float* buf) {
  float* qf = buf;            // [G, D]
  float* acc = qf + G * D;    // [G, D]
  float* row = acc + G * D;   // [D]
  float* s = row + D;         // [G, L]
  for (int64_t g = 0; g < G; ++g)
    for (int64_t d = 0; d < D; ++d) qf[g * D + d] = to_f<T>(q[g * qsh + d]) * scale;
  for (int64_t j = 0; j < L; ++j) {
    const float mj = mask ? to_f<T>(mask[j]) : 0.f;
    if (mj < -1e30f || j < j0) {
      for (int64_t g = 0; g < G; ++g) s[g * L + j] = -INFINITY;
      continue;
    }
    const T* kr = k.at(j);
    for (int64_t d = 0; d < D; ++d) row[d] = to_f<T>(kr[d]);
    for (int64_t g = 0; g < G; ++g) s[g * L + j] = dot(qf + g * D, row, D) + mj;
  }
  for (int64_t g = 0; g < G; ++g) {
    float* sg = s + g * L;
    float mx = -INFINITY;
    for (int64_t j = 0; j < L; ++j) mx = sg[j] > mx ? sg[j] : mx;
    float sum = 0.f;
    if (mx == -INFINITY) {  // a fully masked row: zeros, as SDPA's masked softmax would not NaN here
      for (int64_t j = 0; j < L; ++j) sg[j] = 0.f;
    } else {
      for (int64_t j = 0; j < L; ++j) {
        const float e = sg[j] == -INFINITY ? 0.f : vexp(sg[j] - mx);
        sg[j] = e;
        sum += e;
      }
      const float inv = 1.f / sum;
      for (int64_t j = 0; j < L; ++j) sg[j] *= inv;
    }
    for (int64_t d = 0; d < D; ++d) acc[g * D + d] = 0.f;
  }
  for (int64_t j = 0; j < L; ++j) {
    bool any = false;
    for (int64_t g = 0; g < G; ++g) any |= s[g * L + j] != 0.f;
    if (!any) continue;
    const T* vr = v.at(j);
    for (int64_t d = 0; d < D; ++d) row[d] = to_f<T>(vr[d]);
    for (int64_t g = 0; g < G; ++g) {
      const float p = s[g * L + j];
      float* ag = acc + g * D;
      for (int64_t d = 0; d < D; ++d) ag[d] += p * row[d];
    }
  }
  for (int64_t g = 0; g < G; ++g)
    for (int64_t d = 0; d < D; ++d) out[g * osh + d] = from_f<T>(acc[g * D + d]);
}
CLONE_VARIANTS(attn_one)


#if KEYACC_X86
// ---- AVX-512 versions of the attention and SiLU kernels (float32 math, bf16 or f32 storage) ----
#define AVX512 __attribute__((target("avx512f,avx512bw,avx512vl")))

AVX512 inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
AVX512 inline __m512 load16(const bf16_t* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}
AVX512 inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
AVX512 inline void store16(bf16_t* p, __m512 v) {  // round to nearest even (the data here has no NaN)
  __m512i u = _mm512_castps_si512(v);
  __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  u = _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb);
  _mm256_storeu_si256((__m256i*)p, _mm512_cvtepi32_epi16(_mm512_srli_epi32(u, 16)));
}

AVX512 inline __m512 vexp16(__m512 x) {  // vexp() lane-wise, same constants
  x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.3f)), _mm512_set1_ps(-87.3f));
  __m512 fn = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_sub_ps(x, _mm512_mul_ps(fn, _mm512_set1_ps(0.693359375f)));
  r = _mm512_sub_ps(r, _mm512_mul_ps(fn, _mm512_set1_ps(-2.12194440e-4f)));
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.f));
  __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(fn), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(e));
}

// One key's scores for one head (s0) or two (s1 too, when TWO), the two sharing the key's loaded
// row; each head's products are summed in the same order as one head alone would sum them.
template <typename T, bool TWO>
AVX512 inline void head_scores_avx512(const float* q0, const float* q1, const T* kr, int64_t D, float mj, float* s0,
                                      float* s1) {
  __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps(), b0 = _mm512_setzero_ps(), b1 = _mm512_setzero_ps();
  int64_t d = 0;
  for (; d + 32 <= D; d += 32) {
    const __m512 k0 = load16(kr + d), k1 = load16(kr + d + 16);
    a0 = _mm512_fmadd_ps(_mm512_loadu_ps(q0 + d), k0, a0);
    a1 = _mm512_fmadd_ps(_mm512_loadu_ps(q0 + d + 16), k1, a1);
    if (TWO) b0 = _mm512_fmadd_ps(_mm512_loadu_ps(q1 + d), k0, b0);
    if (TWO) b1 = _mm512_fmadd_ps(_mm512_loadu_ps(q1 + d + 16), k1, b1);
  }
  if (d < D) {
    const __m512 k0 = load16(kr + d);
    a0 = _mm512_fmadd_ps(_mm512_loadu_ps(q0 + d), k0, a0);
    if (TWO) b0 = _mm512_fmadd_ps(_mm512_loadu_ps(q1 + d), k0, b0);
  }
  *s0 = _mm512_reduce_add_ps(_mm512_add_ps(a0, a1)) + mj;
  if (TWO) *s1 = _mm512_reduce_add_ps(_mm512_add_ps(b0, b1)) + mj;
}

template <typename T>
AVX512 inline void key_scores_avx512(const float* qf, const T* kr, int64_t G, int64_t D, float mj, float* s,
                                     int64_t L) {
  int64_t g = 0;
  for (; g + 2 <= G; g += 2)
    head_scores_avx512<T, true>(qf + g * D, qf + (g + 1) * D, kr, D, mj, s + g * L, s + (g + 1) * L);
  if (g < G)  // a last head alone
    head_scores_avx512<T, false>(qf + g * D, qf + g * D, kr, D, mj, s + g * L, s + g * L);
}

// acc0 (and acc1 when TWO) [NV x 16] += sum over n value rows of p0[r] (p1[r]) x row, the tile
// held in registers over the rows; a row both weights skip is skipped (adding 0 x row is exact).
template <typename T, int NV, bool TWO>
AVX512 inline void value_tile_avx512(const T* vr, int64_t sl, int64_t n, const float* p0, const float* p1,
                                     float* acc0, float* acc1) {
  __m512 a[NV], b[NV];
  for (int c = 0; c < NV; ++c) {
    a[c] = _mm512_loadu_ps(acc0 + 16 * c);
    if (TWO) b[c] = _mm512_loadu_ps(acc1 + 16 * c);
  }
  for (int64_t r = 0; r < n; ++r, vr += sl) {
    const float x0 = p0[r], x1 = TWO ? p1[r] : 0.f;
    if (x0 == 0.f && x1 == 0.f) continue;
    const __m512 w0 = _mm512_set1_ps(x0), w1 = _mm512_set1_ps(x1);
    for (int c = 0; c < NV; ++c) {
      const __m512 vv = load16(vr + 16 * c);
      a[c] = _mm512_fmadd_ps(w0, vv, a[c]);
      if (TWO) b[c] = _mm512_fmadd_ps(w1, vv, b[c]);
    }
  }
  for (int c = 0; c < NV; ++c) {
    _mm512_storeu_ps(acc0 + 16 * c, a[c]);
    if (TWO) _mm512_storeu_ps(acc1 + 16 * c, b[c]);
  }
}

template <typename T, bool TWO>
AVX512 inline void value_tiles_avx512(const T* vr, int64_t sl, int64_t n, const float* p0, const float* p1,
                                      float* acc0, float* acc1, int64_t D) {
  int64_t d = 0;
  for (; d + 64 <= D; d += 64) value_tile_avx512<T, 4, TWO>(vr + d, sl, n, p0, p1, acc0 + d, acc1 + d);
  switch ((D - d) / 16) {
    case 3: value_tile_avx512<T, 3, TWO>(vr + d, sl, n, p0, p1, acc0 + d, acc1 + d); break;
    case 2: value_tile_avx512<T, 2, TWO>(vr + d, sl, n, p0, p1, acc0 + d, acc1 + d); break;
    case 1: value_tile_avx512<T, 1, TWO>(vr + d, sl, n, p0, p1, acc0 + d, acc1 + d); break;
    default: break;
  }
}

// Requires D % 16 == 0. Same contract as attn_one. Keys are walked a run at a time (the rest of a
// block: no division per key); a key's row is loaded once for two heads; the weighted sum of
// values keeps a tile of two heads x 64 dims in registers over a run. Every output is the same
// sum in the same order as a plain key-by-key loop.
template <typename T>
AVX512 void attn_one_avx512(const T* q, int64_t qsh, Rows<T> k, Rows<T> v, const T* mask, int64_t j0,
                            int64_t L, int64_t G, int64_t D, float scale, T* out, int64_t osh, float* buf,
                            int64_t nh = 1, int64_t qhs = 0, int64_t khs = 0, int64_t vhs = 0, int64_t ohs = 0) {
  // nh KV heads of one sequence at once: head hh's queries at q + hh * qhs, its keys and values at
  // k's / v's rows + hh * khs / vhs, its outputs at out + hh * ohs. A block's rows of all nh heads
  // lie one after another in the pool, read in order (one head at a time read a few KB a block).
  // Each head's sums are the same, in the same order, as with nh = 1.
  const int64_t R = nh * G;  // the task's query heads, head hh's g-th as row hh * G + g
  float* qf = buf;
  float* acc = qf + R * D;
  float* s = acc + R * D + D;  // [R, L]
  const __m512 vs = _mm512_set1_ps(scale);
  for (int64_t hh = 0; hh < nh; ++hh)
    for (int64_t g = 0; g < G; ++g)
      for (int64_t d = 0; d < D; d += 16)
        _mm512_storeu_ps(qf + (hh * G + g) * D + d, _mm512_mul_ps(load16(q + hh * qhs + g * qsh + d), vs));
  for (int64_t r = 0; r < R; ++r)
    for (int64_t j = 0; j < j0 && j < L; ++j) s[r * L + j] = -INFINITY;
  for (int64_t j = j0; j < L;) {
    const int64_t e = j + k.run(j, L);
    for (int64_t hh = 0; hh < nh; ++hh) {
      Rows<T> kh = k, vh = v;
      kh.base += hh * khs;
      vh.base += hh * vhs;
      const T* kr = kh.at(j);
      float* sh = s + hh * G * L;
      for (int64_t i = j; i < e; ++i, kr += k.sl) {
        prefetch_k_then_v(kh, vh, i, j0, L, D);
        const float mj = mask ? to_f<T>(mask[i]) : 0.f;
        if (mj < -1e30f) {
          for (int64_t g = 0; g < G; ++g) sh[g * L + i] = -INFINITY;
          continue;
        }
        key_scores_avx512(qf + hh * G * D, kr, G, D, mj, sh + i, L);
      }
    }
    j = e;
  }
  for (int64_t g = 0; g < R; ++g) {
    float* sg = s + g * L;
    __m512 mx = _mm512_set1_ps(-INFINITY);
    int64_t j = 0;
    for (; j + 16 <= L; j += 16) mx = _mm512_max_ps(mx, _mm512_loadu_ps(sg + j));
    float m = _mm512_reduce_max_ps(mx);
    for (; j < L; ++j) m = sg[j] > m ? sg[j] : m;
    if (m == -INFINITY) {
      for (j = 0; j < L; ++j) sg[j] = 0.f;
    } else {
      const __m512 vm = _mm512_set1_ps(m);
      __m512 vsum = _mm512_setzero_ps();
      for (j = 0; j + 16 <= L; j += 16) {
        __m512 x = _mm512_loadu_ps(sg + j);
        __mmask16 live = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-INFINITY), _CMP_NEQ_OQ);
        __m512 e = _mm512_maskz_mov_ps(live, vexp16(_mm512_sub_ps(x, vm)));
        _mm512_storeu_ps(sg + j, e);
        vsum = _mm512_add_ps(vsum, e);
      }
      float sum = _mm512_reduce_add_ps(vsum);
      for (; j < L; ++j) {
        const float e = sg[j] == -INFINITY ? 0.f : vexp(sg[j] - m);
        sg[j] = e;
        sum += e;
      }
      const __m512 inv = _mm512_set1_ps(1.f / sum);
      for (j = 0; j + 16 <= L; j += 16) _mm512_storeu_ps(sg + j, _mm512_mul_ps(_mm512_loadu_ps(sg + j), inv));
      for (; j < L; ++j) sg[j] *= 1.f / sum;
    }
    for (int64_t d = 0; d < D; d += 16) _mm512_storeu_ps(acc + g * D + d, _mm512_setzero_ps());
  }
  for (int64_t j = j0; j < L;) {
    const int64_t n = v.run(j, L);
    for (int64_t hh = 0; hh < nh; ++hh) {
      Rows<T> vh = v;
      vh.base += hh * vhs;
      const T* vr = vh.at(j);
      for (int64_t r = j + KV_AHEAD; r < j + KV_AHEAD + n && r < L; ++r) vh.prefetch(r, D);
      const float* sh = s + hh * G * L;
      float* ah = acc + hh * G * D;
      int64_t g = 0;
      for (; g + 2 <= G; g += 2)
        value_tiles_avx512<T, true>(vr, v.sl, n, sh + g * L + j, sh + (g + 1) * L + j, ah + g * D, ah + (g + 1) * D, D);
      if (g < G)  // a last head alone (the second weights and tile unused)
        value_tiles_avx512<T, false>(vr, v.sl, n, sh + g * L + j, sh + g * L + j, ah + g * D, ah + g * D, D);
    }
    j += n;
  }
  for (int64_t hh = 0; hh < nh; ++hh)
    for (int64_t g = 0; g < G; ++g)
      for (int64_t d = 0; d < D; d += 16) store16(out + hh * ohs + g * osh + d, _mm512_loadu_ps(acc + (hh * G + g) * D + d));
}

template <typename T>
AVX512 void silu_mul_avx512(const T* gu, T* y, int64_t M, int64_t I) {
  for (int64_t m = 0; m < M; ++m) {
    const T* g = gu + m * 2 * I;
    const T* u = g + I;
    T* yr = y + m * I;
    int64_t i = 0;
    for (; i + 16 <= I; i += 16) {
      __m512 a = load16(g + i);
      __m512 sg = _mm512_div_ps(a, _mm512_add_ps(_mm512_set1_ps(1.f), vexp16(_mm512_sub_ps(_mm512_setzero_ps(), a))));
      if (sizeof(T) == 2) {  // eager rounds silu's output to the dtype before the multiply
        alignas(64) T tmp[16];
        store16(tmp, sg);
        sg = load16(tmp);
      }
      store16(yr + i, _mm512_mul_ps(sg, load16(u + i)));
    }
    for (; i < I; ++i) {
      const float a = to_f<T>(g[i]);
      yr[i] = from_f<T>(to_f<T>(from_f<T>(a / (1.f + vexp(-a)))) * to_f<T>(u[i]));
    }
  }
}

// head_norm_rope_body for AVX-512, bitwise the same results (the same operations in the same
// order, f2bf's rounding and NaN rule lane-wise, the norm's 16 partial sums added as dot() adds
// them). The compiler's vectorisation of that body (256-bit, the rounding's integer steps per lane)
// took 8.3-8.7 ms of a batch-32 step of the bench model, this 3.8-4.3 (`bench_cpu_isa.py --kernel-times`).
AVX512 inline __mmask16 lanes_before(int64_t d, int64_t end) {
  return end - d >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << (end - d)) - 1u);
}
AVX512 inline __m512 load16m(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
AVX512 inline __m512 load16m(const bf16_t* p, __mmask16 m) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}
template <typename T> AVX512 inline __m512 round16(__m512 v) {  // to_f(from_f(v)) lane-wise
  if (std::is_same<T, float>::value) return v;
  const __m512i u = _mm512_castps_si512(v), hi = _mm512_set1_epi32(static_cast<int>(0xffff0000u));
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_and_si512(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb), hi);
  const __m512i nan = _mm512_or_si512(_mm512_and_si512(u, hi), _mm512_set1_epi32(0x00400000));
  return _mm512_castsi512_ps(_mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), nan));
}
AVX512 inline void store16m(float* p, __m512 v, __mmask16 m) { _mm512_mask_storeu_ps(p, m, v); }
AVX512 inline void store16m(bf16_t* p, __m512 v, __mmask16 m) {  // v already rounded (round16)
  _mm256_mask_storeu_epi16(p, m, _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(v), 16)));
}

AVX512 inline float sum_squares_avx512(const float* row, int64_t D) {  // dot(row, row, D), the same sum
  __m512 part = _mm512_setzero_ps();  // its 16 partial sums, then the tail, then the partials in order
  int64_t d = 0;
  for (; d + 16 <= D; d += 16) {
    const __m512 v = _mm512_loadu_ps(row + d);
    part = _mm512_add_ps(part, _mm512_mul_ps(v, v));
  }
  alignas(64) float p[16];
  _mm512_store_ps(p, part);
  return finish_squares(p, row, d, D);
}

// rms_rows_body (ADD: add_rms_rows_body, the residual added and stored first) on AVX-512,
// bitwise the same results.
template <typename T, bool ADD>
AVX512 void rms_rows_avx512(const T* x, T* res, const T* w, T* y, int64_t M, int64_t D, float eps, float* row) {
  for (int64_t i = 0; i < M; ++i) {
    const T* xr = x + i * D;
    T* rr = ADD ? res + i * D : nullptr;
    for (int64_t d = 0; d < D; d += 16) {
      const __mmask16 m = lanes_before(d, D);
      __m512 v = load16m(xr + d, m);
      if (ADD) {
        v = round16<T>(_mm512_add_ps(load16m(rr + d, m), v));
        store16m(rr + d, v, m);
      }
      _mm512_mask_storeu_ps(row + d, m, v);
    }
    const __m512 r = _mm512_set1_ps(1.f / std::sqrt(sum_squares_avx512(row, D) / static_cast<float>(D) + eps));
    T* yr = y + i * D;
    for (int64_t d = 0; d < D; d += 16) {
      const __mmask16 m = lanes_before(d, D);
      const __m512 v = round16<T>(_mm512_mul_ps(_mm512_maskz_loadu_ps(m, row + d), r));
      store16m(yr + d, round16<T>(_mm512_mul_ps(load16m(w + d, m), v)), m);
    }
  }
}

template <typename T>
AVX512 void head_norm_rope_avx512(const T* x, T* out, const T* nw, float eps, const T* cos, const T* sin, int64_t R,
                                  int64_t D, float* row) {
  for (int64_t d = 0; d < D; d += 16) {
    const __mmask16 m = lanes_before(d, D);
    _mm512_mask_storeu_ps(row + d, m, load16m(x + d, m));
  }
  if (nw) {
    const __m512 r = _mm512_set1_ps(1.f / std::sqrt(sum_squares_avx512(row, D) / static_cast<float>(D) + eps));
    for (int64_t d = 0; d < D; d += 16) {
      const __mmask16 m = lanes_before(d, D);
      const __m512 v = round16<T>(_mm512_mul_ps(_mm512_maskz_loadu_ps(m, row + d), r));
      _mm512_mask_storeu_ps(row + d, m, round16<T>(_mm512_mul_ps(load16m(nw + d, m), v)));
    }
  }
  const int64_t h = R / 2;
  const __m512i sign = _mm512_set1_epi32(static_cast<int>(0x80000000u));
  for (int64_t d = 0; d < h; d += 16) {  // first half: rotated by -x[d + h]
    const __mmask16 m = lanes_before(d, h);
    const __m512 a = round16<T>(_mm512_mul_ps(_mm512_maskz_loadu_ps(m, row + d), load16m(cos + d, m)));
    const __m512 neg = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(_mm512_maskz_loadu_ps(m, row + d + h)), sign));
    const __m512 b = round16<T>(_mm512_mul_ps(neg, load16m(sin + d, m)));
    store16m(out + d, round16<T>(_mm512_add_ps(a, b)), m);
  }
  for (int64_t d = h; d < R; d += 16) {  // second half: by x[d - h]
    const __mmask16 m = lanes_before(d, R);
    const __m512 a = round16<T>(_mm512_mul_ps(_mm512_maskz_loadu_ps(m, row + d), load16m(cos + d, m)));
    const __m512 b = round16<T>(_mm512_mul_ps(_mm512_maskz_loadu_ps(m, row + d - h), load16m(sin + d, m)));
    store16m(out + d, round16<T>(_mm512_add_ps(a, b)), m);
  }
  for (int64_t d = R; d < D; d += 16) {
    const __mmask16 m = lanes_before(d, D);
    store16m(out + d, round16<T>(_mm512_maskz_loadu_ps(m, row + d)), m);
  }
}
#endif


#if KEYACC_X86
// ---- AVX2 + FMA versions of the attention and SiLU kernels (CPUs without AVX-512) ----
AVX2_FN inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
AVX2_FN inline __m256 load8(const bf16_t* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}
AVX2_FN inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
AVX2_FN inline void store8(bf16_t* p, __m256 v) {  // round to nearest even (the data here has no NaN)
  __m256i u = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  u = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb), 16);
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(u, u), 0x08);  // lanes 0-3 | 4-7
  _mm_storeu_si128((__m128i*)p, _mm256_castsi256_si128(packed));
}
AVX2_FN inline float hsum8(__m256 v) {
  __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  a = _mm_add_ps(a, _mm_movehl_ps(a, a));
  return _mm_cvtss_f32(_mm_add_ss(a, _mm_movehdup_ps(a)));
}
AVX2_FN inline float hmax8(__m256 v) {
  __m128 a = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  a = _mm_max_ps(a, _mm_movehl_ps(a, a));
  return _mm_cvtss_f32(_mm_max_ss(a, _mm_movehdup_ps(a)));
}

AVX2_FN inline __m256 vexp8(__m256 x) {  // vexp() lane-wise, same constants
  x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(88.3f)), _mm256_set1_ps(-87.3f));
  __m256 fn = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                              _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_sub_ps(x, _mm256_mul_ps(fn, _mm256_set1_ps(0.693359375f)));
  r = _mm256_sub_ps(r, _mm256_mul_ps(fn, _mm256_set1_ps(-2.12194440e-4f)));
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_add_ps(_mm256_fmadd_ps(_mm256_mul_ps(p, r), r, r), _mm256_set1_ps(1.f));
  __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(fn), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

// head_scores_avx512's AVX2 twin: the same sums in the same order.
template <typename T, bool TWO>
AVX2_FN inline void head_scores_avx2(const float* q0, const float* q1, const T* kr, int64_t D, float mj, float* s0,
                                     float* s1) {
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), b0 = _mm256_setzero_ps(), b1 = _mm256_setzero_ps();
  int64_t d = 0;
  for (; d + 16 <= D; d += 16) {
    const __m256 k0 = load8(kr + d), k1 = load8(kr + d + 8);
    a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q0 + d), k0, a0);
    a1 = _mm256_fmadd_ps(_mm256_loadu_ps(q0 + d + 8), k1, a1);
    if (TWO) b0 = _mm256_fmadd_ps(_mm256_loadu_ps(q1 + d), k0, b0);
    if (TWO) b1 = _mm256_fmadd_ps(_mm256_loadu_ps(q1 + d + 8), k1, b1);
  }
  if (d < D) {
    const __m256 k0 = load8(kr + d);
    a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q0 + d), k0, a0);
    if (TWO) b0 = _mm256_fmadd_ps(_mm256_loadu_ps(q1 + d), k0, b0);
  }
  *s0 = hsum8(_mm256_add_ps(a0, a1)) + mj;
  if (TWO) *s1 = hsum8(_mm256_add_ps(b0, b1)) + mj;
}

template <typename T>
AVX2_FN inline void key_scores_avx2(const float* qf, const T* kr, int64_t G, int64_t D, float mj, float* s,
                                    int64_t L) {
  int64_t g = 0;
  for (; g + 2 <= G; g += 2)
    head_scores_avx2<T, true>(qf + g * D, qf + (g + 1) * D, kr, D, mj, s + g * L, s + (g + 1) * L);
  if (g < G)  // a last head alone
    head_scores_avx2<T, false>(qf + g * D, qf + g * D, kr, D, mj, s + g * L, s + g * L);
}

// value_tile_avx512's AVX2 twin: two heads x NV x 8 dims in registers over a run of rows.
template <typename T, int NV, bool TWO>
AVX2_FN inline void value_tile_avx2(const T* vr, int64_t sl, int64_t n, const float* p0, const float* p1,
                                    float* acc0, float* acc1) {
  __m256 a[NV], b[NV];
  for (int c = 0; c < NV; ++c) {
    a[c] = _mm256_loadu_ps(acc0 + 8 * c);
    if (TWO) b[c] = _mm256_loadu_ps(acc1 + 8 * c);
  }
  for (int64_t r = 0; r < n; ++r, vr += sl) {
    const float x0 = p0[r], x1 = TWO ? p1[r] : 0.f;
    if (x0 == 0.f && x1 == 0.f) continue;
    const __m256 w0 = _mm256_set1_ps(x0), w1 = _mm256_set1_ps(x1);
    for (int c = 0; c < NV; ++c) {
      const __m256 vv = load8(vr + 8 * c);
      a[c] = _mm256_fmadd_ps(w0, vv, a[c]);
      if (TWO) b[c] = _mm256_fmadd_ps(w1, vv, b[c]);
    }
  }
  for (int c = 0; c < NV; ++c) {
    _mm256_storeu_ps(acc0 + 8 * c, a[c]);
    if (TWO) _mm256_storeu_ps(acc1 + 8 * c, b[c]);
  }
}

template <typename T, bool TWO>
AVX2_FN inline void value_tiles_avx2(const T* vr, int64_t sl, int64_t n, const float* p0, const float* p1,
                                     float* acc0, float* acc1, int64_t D) {
  int64_t d = 0;
  for (; d + 32 <= D; d += 32) value_tile_avx2<T, 4, TWO>(vr + d, sl, n, p0, p1, acc0 + d, acc1 + d);
  switch ((D - d) / 8) {
    case 3: value_tile_avx2<T, 3, TWO>(vr + d, sl, n, p0, p1, acc0 + d, acc1 + d); break;
    case 2: value_tile_avx2<T, 2, TWO>(vr + d, sl, n, p0, p1, acc0 + d, acc1 + d); break;
    case 1: value_tile_avx2<T, 1, TWO>(vr + d, sl, n, p0, p1, acc0 + d, acc1 + d); break;
    default: break;
  }
}

// Requires D % 8 == 0. Same contract as attn_one; walked as attn_one_avx512.
template <typename T>
AVX2_FN void attn_one_avx2(const T* q, int64_t qsh, Rows<T> k, Rows<T> v, const T* mask, int64_t j0,
                           int64_t L, int64_t G, int64_t D, float scale, T* out, int64_t osh, float* buf,
                           int64_t nh = 1, int64_t qhs = 0, int64_t khs = 0, int64_t vhs = 0, int64_t ohs = 0) {
  // nh KV heads of one sequence at once: head hh's queries at q + hh * qhs, its keys and values at
  // k's / v's rows + hh * khs / vhs, its outputs at out + hh * ohs. A block's rows of all nh heads
  // lie one after another in the pool, read in order (one head at a time read a few KB a block).
  // Each head's sums are the same, in the same order, as with nh = 1.
  const int64_t R = nh * G;  // the task's query heads, head hh's g-th as row hh * G + g
  float* qf = buf;
  float* acc = qf + R * D;
  float* s = acc + R * D + D;  // [R, L]
  const __m256 vs = _mm256_set1_ps(scale);
  for (int64_t hh = 0; hh < nh; ++hh)
    for (int64_t g = 0; g < G; ++g)
      for (int64_t d = 0; d < D; d += 8)
        _mm256_storeu_ps(qf + (hh * G + g) * D + d, _mm256_mul_ps(load8(q + hh * qhs + g * qsh + d), vs));
  for (int64_t r = 0; r < R; ++r)
    for (int64_t j = 0; j < j0 && j < L; ++j) s[r * L + j] = -INFINITY;
  for (int64_t j = j0; j < L;) {
    const int64_t e = j + k.run(j, L);
    for (int64_t hh = 0; hh < nh; ++hh) {
      Rows<T> kh = k, vh = v;
      kh.base += hh * khs;
      vh.base += hh * vhs;
      const T* kr = kh.at(j);
      float* sh = s + hh * G * L;
      for (int64_t i = j; i < e; ++i, kr += k.sl) {
        prefetch_k_then_v(kh, vh, i, j0, L, D);
        const float mj = mask ? to_f<T>(mask[i]) : 0.f;
        if (mj < -1e30f) {
          for (int64_t g = 0; g < G; ++g) sh[g * L + i] = -INFINITY;
          continue;
        }
        key_scores_avx2(qf + hh * G * D, kr, G, D, mj, sh + i, L);
      }
    }
    j = e;
  }
  const __m256 ninf = _mm256_set1_ps(-INFINITY);
  for (int64_t g = 0; g < R; ++g) {
    float* sg = s + g * L;
    __m256 mx = ninf;
    int64_t j = 0;
    for (; j + 8 <= L; j += 8) mx = _mm256_max_ps(mx, _mm256_loadu_ps(sg + j));
    float m = hmax8(mx);
    for (; j < L; ++j) m = sg[j] > m ? sg[j] : m;
    if (m == -INFINITY) {
      for (j = 0; j < L; ++j) sg[j] = 0.f;
    } else {
      const __m256 vm = _mm256_set1_ps(m);
      __m256 vsum = _mm256_setzero_ps();
      for (j = 0; j + 8 <= L; j += 8) {
        const __m256 x = _mm256_loadu_ps(sg + j);
        const __m256 live = _mm256_cmp_ps(x, ninf, _CMP_NEQ_OQ);
        const __m256 e = _mm256_and_ps(live, vexp8(_mm256_sub_ps(x, vm)));
        _mm256_storeu_ps(sg + j, e);
        vsum = _mm256_add_ps(vsum, e);
      }
      float sum = hsum8(vsum);
      for (; j < L; ++j) {
        const float e = sg[j] == -INFINITY ? 0.f : vexp(sg[j] - m);
        sg[j] = e;
        sum += e;
      }
      const __m256 inv = _mm256_set1_ps(1.f / sum);
      for (j = 0; j + 8 <= L; j += 8) _mm256_storeu_ps(sg + j, _mm256_mul_ps(_mm256_loadu_ps(sg + j), inv));
      for (; j < L; ++j) sg[j] *= 1.f / sum;
    }
    for (int64_t d = 0; d < D; d += 8) _mm256_storeu_ps(acc + g * D + d, _mm256_setzero_ps());
  }
  for (int64_t j = j0; j < L;) {
    const int64_t n = v.run(j, L);
    for (int64_t hh = 0; hh < nh; ++hh) {
      Rows<T> vh = v;
      vh.base += hh * vhs;
      const T* vr = vh.at(j);
      for (int64_t r = j + KV_AHEAD; r < j + KV_AHEAD + n && r < L; ++r) vh.prefetch(r, D);
      const float* sh = s + hh * G * L;
      float* ah = acc + hh * G * D;
      int64_t g = 0;
      for (; g + 2 <= G; g += 2)
        value_tiles_avx2<T, true>(vr, v.sl, n, sh + g * L + j, sh + (g + 1) * L + j, ah + g * D, ah + (g + 1) * D, D);
      if (g < G)  // a last head alone (the second weights and tile unused)
        value_tiles_avx2<T, false>(vr, v.sl, n, sh + g * L + j, sh + g * L + j, ah + g * D, ah + g * D, D);
    }
    j += n;
  }
  for (int64_t hh = 0; hh < nh; ++hh)
    for (int64_t g = 0; g < G; ++g)
      for (int64_t d = 0; d < D; d += 8) store8(out + hh * ohs + g * osh + d, _mm256_loadu_ps(acc + (hh * G + g) * D + d));
}

template <typename T>
AVX2_FN void silu_mul_avx2(const T* gu, T* y, int64_t M, int64_t I) {
  for (int64_t m = 0; m < M; ++m) {
    const T* g = gu + m * 2 * I;
    const T* u = g + I;
    T* yr = y + m * I;
    int64_t i = 0;
    for (; i + 8 <= I; i += 8) {
      const __m256 a = load8(g + i);
      __m256 sg = _mm256_div_ps(a, _mm256_add_ps(_mm256_set1_ps(1.f), vexp8(_mm256_sub_ps(_mm256_setzero_ps(), a))));
      if (sizeof(T) == 2) {  // eager rounds silu's output to the dtype before the multiply
        alignas(32) T tmp[8];
        store8(tmp, sg);
        sg = load8(tmp);
      }
      store8(yr + i, _mm256_mul_ps(sg, load8(u + i)));
    }
    for (; i < I; ++i) {
      const float a = to_f<T>(g[i]);
      yr[i] = from_f<T>(to_f<T>(from_f<T>(a / (1.f + vexp(-a)))) * to_f<T>(u[i]));
    }
  }
}

// The norms and the rotary write for AVX2 (head_norm_rope_body, rms_rows_body and
// add_rms_rows_body as the AVX-512 versions above do them): the same operations in the same
// order, 8 lanes at a time, tails element by element as the bodies do them.
template <typename T> AVX2_FN inline __m256 round8(__m256 v) {  // to_f(from_f(v)) lane-wise
  if (std::is_same<T, float>::value) return v;
  const __m256i u = _mm256_castps_si256(v), hi = _mm256_set1_epi32(static_cast<int>(0xffff0000u));
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_and_si256(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb), hi);
  const __m256i nan = _mm256_or_si256(_mm256_and_si256(u, hi), _mm256_set1_epi32(0x00400000));
  return _mm256_castsi256_ps(_mm256_blendv_epi8(r, nan, _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q))));
}
AVX2_FN inline void store8r(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
AVX2_FN inline void store8r(bf16_t* p, __m256 v) {  // v already rounded (round8)
  const __m256i u = _mm256_srli_epi32(_mm256_castps_si256(v), 16);
  _mm_storeu_si128((__m128i*)p, _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packus_epi32(u, u), 0x08)));
}

AVX2_FN inline float sum_squares_avx2(const float* row, int64_t D) {  // dot(row, row, D), the same sum
  __m256 lo = _mm256_setzero_ps(), hi = _mm256_setzero_ps();  // partial sums 0-7 and 8-15
  int64_t d = 0;
  for (; d + 16 <= D; d += 16) {
    const __m256 a = _mm256_loadu_ps(row + d), b = _mm256_loadu_ps(row + d + 8);
    lo = _mm256_add_ps(lo, _mm256_mul_ps(a, a));
    hi = _mm256_add_ps(hi, _mm256_mul_ps(b, b));
  }
  alignas(32) float p[16];
  _mm256_store_ps(p, lo);
  _mm256_store_ps(p + 8, hi);
  return finish_squares(p, row, d, D);
}

template <typename T, bool ADD>
AVX2_FN void rms_rows_avx2(const T* x, T* res, const T* w, T* y, int64_t M, int64_t D, float eps, float* row) {
  for (int64_t i = 0; i < M; ++i) {
    const T* xr = x + i * D;
    T* rr = ADD ? res + i * D : nullptr;
    int64_t d = 0;
    for (; d + 8 <= D; d += 8) {
      __m256 v = load8(xr + d);
      if (ADD) {
        v = round8<T>(_mm256_add_ps(load8(rr + d), v));
        store8r(rr + d, v);
      }
      _mm256_storeu_ps(row + d, v);
    }
    for (; d < D; ++d) {
      if (ADD) rr[d] = from_f<T>(to_f<T>(rr[d]) + to_f<T>(xr[d]));
      row[d] = to_f<T>(ADD ? rr[d] : xr[d]);
    }
    const float r = 1.f / std::sqrt(sum_squares_avx2(row, D) / static_cast<float>(D) + eps);
    const __m256 vr = _mm256_set1_ps(r);
    T* yr = y + i * D;
    for (d = 0; d + 8 <= D; d += 8)
      store8r(yr + d, round8<T>(_mm256_mul_ps(load8(w + d), round8<T>(_mm256_mul_ps(_mm256_loadu_ps(row + d), vr)))));
    for (; d < D; ++d) yr[d] = from_f<T>(to_f<T>(w[d]) * to_f<T>(from_f<T>(row[d] * r)));
  }
}

template <typename T>
AVX2_FN void head_norm_rope_avx2(const T* x, T* out, const T* nw, float eps, const T* cos, const T* sin, int64_t R,
                                 int64_t D, float* row) {
  int64_t d = 0;
  for (; d + 8 <= D; d += 8) _mm256_storeu_ps(row + d, load8(x + d));
  for (; d < D; ++d) row[d] = to_f<T>(x[d]);
  if (nw) {
    const float r = 1.f / std::sqrt(sum_squares_avx2(row, D) / static_cast<float>(D) + eps);
    const __m256 vr = _mm256_set1_ps(r);
    for (d = 0; d + 8 <= D; d += 8)
      _mm256_storeu_ps(row + d, round8<T>(_mm256_mul_ps(load8(nw + d), round8<T>(_mm256_mul_ps(_mm256_loadu_ps(row + d), vr)))));
    for (; d < D; ++d) row[d] = to_f<T>(from_f<T>(to_f<T>(nw[d]) * to_f<T>(from_f<T>(row[d] * r))));
  }
  const int64_t h = R / 2;
  const __m256 sign = _mm256_castsi256_ps(_mm256_set1_epi32(static_cast<int>(0x80000000u)));
  for (d = 0; d + 8 <= h; d += 8) {  // first half: rotated by -x[d + h]
    const __m256 a = round8<T>(_mm256_mul_ps(_mm256_loadu_ps(row + d), load8(cos + d)));
    const __m256 b = round8<T>(_mm256_mul_ps(_mm256_xor_ps(_mm256_loadu_ps(row + d + h), sign), load8(sin + d)));
    store8r(out + d, round8<T>(_mm256_add_ps(a, b)));
  }
  for (; d < h; ++d) {
    const float a = to_f<T>(from_f<T>(row[d] * to_f<T>(cos[d])));
    const float b = to_f<T>(from_f<T>(-row[d + h] * to_f<T>(sin[d])));
    out[d] = from_f<T>(a + b);
  }
  for (d = h; d + 8 <= R; d += 8) {  // second half: by x[d - h]
    const __m256 a = round8<T>(_mm256_mul_ps(_mm256_loadu_ps(row + d), load8(cos + d)));
    const __m256 b = round8<T>(_mm256_mul_ps(_mm256_loadu_ps(row + d - h), load8(sin + d)));
    store8r(out + d, round8<T>(_mm256_add_ps(a, b)));
  }
  for (; d < R; ++d) {
    const float a = to_f<T>(from_f<T>(row[d] * to_f<T>(cos[d])));
    const float b = to_f<T>(from_f<T>(row[d - h] * to_f<T>(sin[d])));
    out[d] = from_f<T>(a + b);
  }
  for (d = R; d + 8 <= D; d += 8) store8r(out + d, round8<T>(_mm256_loadu_ps(row + d)));
  for (; d < D; ++d) out[d] = from_f<T>(row[d]);
}
#endif

bool have_avx512() {
#if KEYACC_X86
  static const bool v = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                        __builtin_cpu_supports("avx512vl");
  return v && !force_portable() && forced_isa() != "avx2";
#else
  return false;
#endif
}

template <typename T>
void attn_impl(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
               const c10::optional<torch::Tensor>& mask, double scale, torch::Tensor& out) {
  const int64_t B = q.size(0), H = q.size(1), D = q.size(3), Hkv = k.size(1), L = k.size(2);
  const int64_t G = H / Hkv;
  const T* qp = reinterpret_cast<const T*>(q.data_ptr());
  const T* kp = reinterpret_cast<const T*>(k.data_ptr());
  const T* vp = reinterpret_cast<const T*>(v.data_ptr());
  T* op = reinterpret_cast<T*>(out.data_ptr());
  const T* mp = nullptr;
  int64_t msb = 0, msl = 1;
  if (mask.has_value() && mask->defined()) {
    mp = reinterpret_cast<const T*>(mask->data_ptr());
    msb = mask->size(0) == 1 ? 0 : mask->stride(0);
    msl = mask->stride(3);
  }
  const bool wide = have_avx512() && D % 16 == 0, wide2 = !wide && have_avx2() && D % 8 == 0;
  at::parallel_for(0, B * Hkv, 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> buf(2 * G * D + D + G * L);
    std::vector<T> mrow(mp && msl != 1 ? L : 0);
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t b = i / Hkv, h = i % Hkv;
      const T* mrp = nullptr;
      if (mp) {
        mrp = mp + b * msb;
        if (msl != 1) {
          for (int64_t j = 0; j < L; ++j) mrow[j] = mrp[j * msl];
          mrp = mrow.data();
        }
      }
      const T* qh = qp + b * q.stride(0) + h * G * q.stride(1);
      const T* kh = kp + b * k.stride(0) + h * k.stride(1);
      const T* vh = vp + b * v.stride(0) + h * v.stride(1);
      T* oh = op + (b * H + h * G) * D;
#if KEYACC_X86
      if (wide) {
        attn_one_avx512<T>(qh, q.stride(1), Rows<T>{kh, k.stride(2)}, Rows<T>{vh, v.stride(2)}, mrp, 0, L, G, D,
                           static_cast<float>(scale), oh, D, buf.data());
        continue;
      }
      if (wide2) {
        attn_one_avx2<T>(qh, q.stride(1), Rows<T>{kh, k.stride(2)}, Rows<T>{vh, v.stride(2)}, mrp, 0, L, G, D,
                         static_cast<float>(scale), oh, D, buf.data());
        continue;
      }
#endif
      attn_one(qh, q.stride(1), Rows<T>{kh, k.stride(2)}, Rows<T>{vh, v.stride(2)}, mrp, 0, L, G, D,
                  static_cast<float>(scale), oh, D, buf.data());
    }
  });
}

template <typename T>
void paged_attn_impl(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, const int32_t* tables,
                     int64_t tstride, const int64_t* ctx, int64_t window, double scale, torch::Tensor& out) {
  const int64_t B = q.size(0), H = q.size(1), D = q.size(3), Hkv = k.size(1), bs = k.size(2);
  const int64_t G = H / Hkv;
  int64_t Lmax = 0;
  for (int64_t b = 0; b < B; ++b) Lmax = ctx[b] > Lmax ? ctx[b] : Lmax;
  const T* qp = reinterpret_cast<const T*>(q.data_ptr());
  const T* kp = reinterpret_cast<const T*>(k.data_ptr());
  const T* vp = reinterpret_cast<const T*>(v.data_ptr());
  T* op = reinterpret_cast<T*>(out.data_ptr());
  const bool wide = have_avx512() && D % 16 == 0, wide2 = !wide && have_avx2() && D % 8 == 0;
  // A task takes all of a sequence's KV heads (their rows of a block lie one after another in the
  // pool: read in order), split by heads only where the batch is too small to keep the threads busy.
  const int64_t nt = at::get_num_threads();
  const int64_t nc = std::min<int64_t>(Hkv, std::max<int64_t>(1, (4 * nt + B - 1) / B));
  const int64_t hc = (Hkv + nc - 1) / nc, chunks = (Hkv + hc - 1) / hc;
  at::parallel_for(0, B * chunks, 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> buf(2 * hc * G * D + D + hc * G * Lmax);
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t b = i / chunks, h = (i % chunks) * hc, nh = std::min(hc, Hkv - h), L = ctx[b];
      const int64_t j0 = window > 0 && L > window ? L - window : 0;
      const T* qh = qp + b * q.stride(0) + h * G * q.stride(1);
      Rows<T> kr{kp + h * k.stride(1), k.stride(2), tables + b * tstride, bs, k.stride(0)};
      Rows<T> vr{vp + h * v.stride(1), v.stride(2), tables + b * tstride, bs, v.stride(0)};
      T* oh = op + (b * H + h * G) * D;
#if KEYACC_X86
      if (wide) {
        attn_one_avx512<T>(qh, q.stride(1), kr, vr, nullptr, j0, L, G, D, static_cast<float>(scale), oh, D, buf.data(),
                           nh, G * q.stride(1), k.stride(1), v.stride(1), G * D);
        continue;
      }
      if (wide2) {
        attn_one_avx2<T>(qh, q.stride(1), kr, vr, nullptr, j0, L, G, D, static_cast<float>(scale), oh, D, buf.data(),
                         nh, G * q.stride(1), k.stride(1), v.stride(1), G * D);
        continue;
      }
#endif
      for (int64_t hh = 0; hh < nh; ++hh) {
        Rows<T> kh = kr, vh = vr;
        kh.base += hh * k.stride(1);
        vh.base += hh * v.stride(1);
        attn_one(qh + hh * G * q.stride(1), q.stride(1), kh, vh, static_cast<const T*>(nullptr), j0, L, G, D,
                 static_cast<float>(scale), oh + hh * G * D, D, buf.data());
      }
    }
  });
}

// q [B, H, 1, D]; k, v one layer's block pool [num_blocks, Hkv, block_size, D]; block_tables
// [B, max_blocks] int32 (row b's blocks in order); context_lens [B] int64 (keys 0..len-1, the
// query's own included); window > 0: only the last `window` keys (sliding-window layers).
// Returns [B, 1, H, D]: rows of mixed lengths, nothing padded, K/V never repeated per head.
torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor block_tables,
                                     torch::Tensor context_lens, int64_t window, double scale) {
  TORCH_CHECK(q.dim() == 4 && q.size(2) == 1, "paged_decode_attention: one query token per sequence");
  TORCH_CHECK(k.dim() == 4 && v.dim() == 4 && k.size(0) == v.size(0) && k.size(1) == v.size(1) &&
                  k.size(2) == v.size(2) && k.size(3) == q.size(3) && v.size(3) == q.size(3),
              "paged_decode_attention: pool shape");
  TORCH_CHECK(q.size(1) % k.size(1) == 0, "paged_decode_attention: heads not a multiple of KV heads");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && k.scalar_type() == v.scalar_type(), "paged_decode_attention: dtypes");
  TORCH_CHECK(k.stride(3) == 1 && v.stride(3) == 1, "paged_decode_attention: pool rows must be contiguous");
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt32 && block_tables.dim() == 2 &&
                  block_tables.size(0) == q.size(0) && block_tables.stride(1) == 1,
              "paged_decode_attention: block tables");
  TORCH_CHECK(context_lens.scalar_type() == torch::kInt64 && context_lens.numel() == q.size(0),
              "paged_decode_attention: context lengths");
  if (q.stride(3) != 1) q = q.contiguous();
  context_lens = context_lens.contiguous();
  const int64_t* ctx = context_lens.data_ptr<int64_t>();
  const int32_t* tp = block_tables.data_ptr<int32_t>();
  const int64_t bs = k.size(2), nb = k.size(0);
  for (int64_t b = 0; b < q.size(0); ++b) {
    TORCH_CHECK(ctx[b] >= 1 && ctx[b] <= block_tables.size(1) * bs, "paged_decode_attention: context length out of range");
    for (int64_t j = 0; j < (ctx[b] + bs - 1) / bs; ++j)
      TORCH_CHECK(tp[b * block_tables.stride(0) + j] >= 0 && tp[b * block_tables.stride(0) + j] < nb,
                  "paged_decode_attention: block id out of range");
  }
  auto out = torch::empty({q.size(0), 1, q.size(1), q.size(3)}, q.options());
  if (q.scalar_type() == torch::kFloat32)
    paged_attn_impl<float>(q, k, v, tp, block_tables.stride(0), ctx, window, scale, out);
  else if (q.scalar_type() == torch::kBFloat16)
    paged_attn_impl<bf16_t>(q, k, v, tp, block_tables.stride(0), ctx, window, scale, out);
  else TORCH_CHECK(false, "paged_decode_attention: float32 or bfloat16");
  return out;
}

// q [B, H, 1, D]; k, v [B, Hkv, L, D]; mask [B or 1, 1, 1, L] additive or none. Returns [B, 1, H, D].
torch::Tensor decode_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, c10::optional<torch::Tensor> mask,
                               double scale) {
  TORCH_CHECK(q.dim() == 4 && q.size(2) == 1, "decode_attention: one query token per sequence");
  TORCH_CHECK(k.dim() == 4 && v.sizes() == k.sizes() && k.size(0) == q.size(0) && k.size(3) == q.size(3),
              "decode_attention: K/V shape");
  TORCH_CHECK(q.size(1) % k.size(1) == 0, "decode_attention: heads not a multiple of KV heads");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && k.scalar_type() == v.scalar_type(), "decode_attention: dtypes");
  if (q.stride(3) != 1) q = q.contiguous();
  if (k.stride(3) != 1) k = k.contiguous();
  if (v.stride(3) != 1) v = v.contiguous();
  if (mask.has_value() && mask->defined()) {
    TORCH_CHECK(mask->dim() == 4 && mask->size(2) == 1 && mask->size(3) == k.size(2) &&
                    (mask->size(0) == 1 || mask->size(0) == q.size(0)) && mask->scalar_type() == q.scalar_type(),
                "decode_attention: mask shape or dtype");
  }
  auto out = torch::empty({q.size(0), 1, q.size(1), q.size(3)}, q.options());
  if (q.scalar_type() == torch::kFloat32) attn_impl<float>(q, k, v, mask, scale, out);
  else if (q.scalar_type() == torch::kBFloat16) attn_impl<bf16_t>(q, k, v, mask, scale, out);
  else TORCH_CHECK(false, "decode_attention: float32 or bfloat16");
  return out;
}

// ---------------------------------------------------------------------------------------------
// RMSNorm as transformers' Llama family computes it: x in float32, x * rsqrt(mean(x^2) + eps),
// rounded to the input dtype, times the weight (rounded again).
template <typename T>
CLONE_BODY void rms_rows_body(const T* x, const T* w, T* y, int64_t M, int64_t D, float eps, float* row) {
  for (int64_t m = 0; m < M; ++m) {
    const T* xr = x + m * D;
    for (int64_t d = 0; d < D; ++d) row[d] = to_f<T>(xr[d]);
    const float ss = sum_squares(row, D);
    const float r = 1.f / std::sqrt(ss / static_cast<float>(D) + eps);
    T* yr = y + m * D;
    for (int64_t d = 0; d < D; ++d) yr[d] = from_f<T>(to_f<T>(w[d]) * to_f<T>(from_f<T>(to_f<T>(xr[d]) * r)));
  }
}
CLONE_VARIANTS(rms_rows)

torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps) {
  TORCH_CHECK(x.scalar_type() == w.scalar_type(), "rms_norm: dtypes");
  x = x.contiguous();
  w = w.contiguous();
  const int64_t D = x.size(-1), M = x.numel() / std::max<int64_t>(D, 1);
  auto y = torch::empty_like(x);
  const bool wide = have_avx512(), wide2 = !wide && have_avx2();
  at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
    std::vector<float> row(D);
#if KEYACC_X86
    if (wide || wide2) {
      const float e = static_cast<float>(eps);
      if (x.scalar_type() == torch::kFloat32) {
        const float *xp = x.data_ptr<float>() + m0 * D, *wp = w.data_ptr<float>();
        float* yp = y.data_ptr<float>() + m0 * D;
        if (wide) return rms_rows_avx512<float, false>(xp, nullptr, wp, yp, m1 - m0, D, e, row.data());
        return rms_rows_avx2<float, false>(xp, nullptr, wp, yp, m1 - m0, D, e, row.data());
      }
      const bf16_t* xp = reinterpret_cast<const bf16_t*>(x.data_ptr()) + m0 * D;
      const bf16_t* wp = reinterpret_cast<const bf16_t*>(w.data_ptr());
      bf16_t* yp = reinterpret_cast<bf16_t*>(y.data_ptr()) + m0 * D;
      if (wide) return rms_rows_avx512<bf16_t, false>(xp, nullptr, wp, yp, m1 - m0, D, e, row.data());
      return rms_rows_avx2<bf16_t, false>(xp, nullptr, wp, yp, m1 - m0, D, e, row.data());
    }
#endif
    if (x.scalar_type() == torch::kFloat32)
      rms_rows(x.data_ptr<float>() + m0 * D, w.data_ptr<float>(), y.data_ptr<float>() + m0 * D, m1 - m0, D,
                      static_cast<float>(eps), row.data());
    else
      rms_rows(reinterpret_cast<const bf16_t*>(x.data_ptr()) + m0 * D,
                       reinterpret_cast<const bf16_t*>(w.data_ptr()), reinterpret_cast<bf16_t*>(y.data_ptr()) + m0 * D,
                       m1 - m0, D, static_cast<float>(eps), row.data());
  });
  return y;
}

// SiLU(gate) * up over a fused [.., 2I] gate|up row; each op rounded to the dtype as eager does.
template <typename T>
CLONE_BODY void silu_mul_rows_body(const T* gu, T* y, int64_t M, int64_t I) {
  for (int64_t m = 0; m < M; ++m) {
    const T* g = gu + m * 2 * I;
    const T* u = g + I;
    T* yr = y + m * I;
    for (int64_t i = 0; i < I; ++i) {
      const float a = to_f<T>(g[i]);
      const float s = to_f<T>(from_f<T>(a / (1.f + vexp(-a))));
      yr[i] = from_f<T>(s * to_f<T>(u[i]));
    }
  }
}
CLONE_VARIANTS(silu_mul_rows)

torch::Tensor silu_mul(torch::Tensor gu) {
  gu = gu.contiguous();
  const int64_t I = gu.size(-1) / 2, M = gu.numel() / std::max<int64_t>(gu.size(-1), 1);
  auto shape = gu.sizes().vec();
  shape.back() = I;
  auto y = torch::empty(shape, gu.options());
  const bool wide = have_avx512(), wide2 = !wide && have_avx2();
  at::parallel_for(0, M, 4, [&](int64_t m0, int64_t m1) {
#if KEYACC_X86
    if (wide2 && gu.scalar_type() == torch::kFloat32) {
      silu_mul_avx2<float>(gu.data_ptr<float>() + m0 * 2 * I, y.data_ptr<float>() + m0 * I, m1 - m0, I);
      return;
    }
    if (wide2 && gu.scalar_type() == torch::kBFloat16) {
      silu_mul_avx2<bf16_t>(reinterpret_cast<const bf16_t*>(gu.data_ptr()) + m0 * 2 * I,
                            reinterpret_cast<bf16_t*>(y.data_ptr()) + m0 * I, m1 - m0, I);
      return;
    }
    if (wide && gu.scalar_type() == torch::kFloat32) {
      silu_mul_avx512<float>(gu.data_ptr<float>() + m0 * 2 * I, y.data_ptr<float>() + m0 * I, m1 - m0, I);
      return;
    }
    if (wide && gu.scalar_type() == torch::kBFloat16) {
      silu_mul_avx512<bf16_t>(reinterpret_cast<const bf16_t*>(gu.data_ptr()) + m0 * 2 * I,
                              reinterpret_cast<bf16_t*>(y.data_ptr()) + m0 * I, m1 - m0, I);
      return;
    }
#endif
    if (gu.scalar_type() == torch::kFloat32)
      silu_mul_rows(gu.data_ptr<float>() + m0 * 2 * I, y.data_ptr<float>() + m0 * I, m1 - m0, I);
    else if (gu.scalar_type() == torch::kBFloat16)
      silu_mul_rows(reinterpret_cast<const bf16_t*>(gu.data_ptr()) + m0 * 2 * I,
                            reinterpret_cast<bf16_t*>(y.data_ptr()) + m0 * I, m1 - m0, I);
    else TORCH_CHECK(false, "silu_mul: float32 or bfloat16");
  });
  return y;
}

// ---------------------------------------------------------------------------------------------
// Pieces of a fused Llama-family decode layer (keyacc_ray/kernels/fused_step.py). Each op rounds
// to the storage dtype where transformers' eager code does, so bf16 results stay within a rounding
// step of the plain path.

// residual <- residual + x (rounded); returns RMSNorm(residual) * w.
template <typename T>
CLONE_BODY void add_rms_rows_body(const T* x, T* res, const T* w, T* y, int64_t M, int64_t D, float eps, float* row) {
  for (int64_t m = 0; m < M; ++m) {
    T* rr = res + m * D;
    const T* xr = x + m * D;
    for (int64_t d = 0; d < D; ++d) {
      const T r = from_f<T>(to_f<T>(rr[d]) + to_f<T>(xr[d]));
      rr[d] = r;
      row[d] = to_f<T>(r);
    }
    const float r = 1.f / std::sqrt(sum_squares(row, D) / static_cast<float>(D) + eps);
    T* yr = y + m * D;
    for (int64_t d = 0; d < D; ++d) yr[d] = from_f<T>(to_f<T>(w[d]) * to_f<T>(from_f<T>(row[d] * r)));
  }
}
CLONE_VARIANTS(add_rms_rows)

torch::Tensor add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor w, double eps) {
  TORCH_CHECK(x.scalar_type() == residual.scalar_type() && w.scalar_type() == x.scalar_type(), "add_rms_norm: dtypes");
  TORCH_CHECK(residual.is_contiguous() && x.numel() == residual.numel(), "add_rms_norm: residual");
  x = x.contiguous();
  w = w.contiguous();
  const int64_t D = x.size(-1), M = x.numel() / D;
  auto y = torch::empty_like(residual);
  const bool wide = have_avx512(), wide2 = !wide && have_avx2();
  at::parallel_for(0, M, 8, [&](int64_t m0, int64_t m1) {
    std::vector<float> row(D);
#if KEYACC_X86
    if (wide || wide2) {
      const float e = static_cast<float>(eps);
      if (x.scalar_type() == torch::kFloat32) {
        const float *xp = x.data_ptr<float>() + m0 * D, *wp = w.data_ptr<float>();
        float *rp = residual.data_ptr<float>() + m0 * D, *yp = y.data_ptr<float>() + m0 * D;
        if (wide) return rms_rows_avx512<float, true>(xp, rp, wp, yp, m1 - m0, D, e, row.data());
        return rms_rows_avx2<float, true>(xp, rp, wp, yp, m1 - m0, D, e, row.data());
      }
      if (x.scalar_type() == torch::kBFloat16) {
        const bf16_t* xp = reinterpret_cast<const bf16_t*>(x.data_ptr()) + m0 * D;
        const bf16_t* wp = reinterpret_cast<const bf16_t*>(w.data_ptr());
        bf16_t* rp = reinterpret_cast<bf16_t*>(residual.data_ptr()) + m0 * D;
        bf16_t* yp = reinterpret_cast<bf16_t*>(y.data_ptr()) + m0 * D;
        if (wide) return rms_rows_avx512<bf16_t, true>(xp, rp, wp, yp, m1 - m0, D, e, row.data());
        return rms_rows_avx2<bf16_t, true>(xp, rp, wp, yp, m1 - m0, D, e, row.data());
      }
    }
#endif
    if (x.scalar_type() == torch::kFloat32)
      add_rms_rows(x.data_ptr<float>() + m0 * D, residual.data_ptr<float>() + m0 * D, w.data_ptr<float>(),
                          y.data_ptr<float>() + m0 * D, m1 - m0, D, static_cast<float>(eps), row.data());
    else if (x.scalar_type() == torch::kBFloat16)
      add_rms_rows(reinterpret_cast<const bf16_t*>(x.data_ptr()) + m0 * D,
                           reinterpret_cast<bf16_t*>(residual.data_ptr()) + m0 * D,
                           reinterpret_cast<const bf16_t*>(w.data_ptr()), reinterpret_cast<bf16_t*>(y.data_ptr()) + m0 * D,
                           m1 - m0, D, static_cast<float>(eps), row.data());
    else TORCH_CHECK(false, "add_rms_norm: float32 or bfloat16");
  });
  return y;
}

// One head row: optional per-head RMSNorm, then rotary (rotate-half convention) on the first R dims.
// Compiled per ISA like the other elementwise kernels (an AVX2-only CPU gets AVX2 code, not
// baseline x86-64); the rotation's two halves are separate loops so each vectorises. The same
// arithmetic in the same order on every ISA (-ffp-contract=off, 16 partial sums): bitwise the
// same results whichever clone runs.
template <typename T>
CLONE_BODY void head_norm_rope_body(const T* x, T* out, const T* nw, float eps, const T* cos, const T* sin, int64_t R,
                                    int64_t D, float* row) {
  for (int64_t d = 0; d < D; ++d) row[d] = to_f<T>(x[d]);
  if (nw) {
    const float r = 1.f / std::sqrt(sum_squares(row, D) / static_cast<float>(D) + eps);
    for (int64_t d = 0; d < D; ++d) row[d] = to_f<T>(from_f<T>(to_f<T>(nw[d]) * to_f<T>(from_f<T>(row[d] * r))));
  }
  const int64_t h = R / 2;
  for (int64_t d = 0; d < h; ++d) {  // first half: rotated by -x[d + h]
    const float a = to_f<T>(from_f<T>(row[d] * to_f<T>(cos[d])));
    const float b = to_f<T>(from_f<T>(-row[d + h] * to_f<T>(sin[d])));
    out[d] = from_f<T>(a + b);
  }
  for (int64_t d = h; d < R; ++d) {  // second half: by x[d - h]
    const float a = to_f<T>(from_f<T>(row[d] * to_f<T>(cos[d])));
    const float b = to_f<T>(from_f<T>(row[d - h] * to_f<T>(sin[d])));
    out[d] = from_f<T>(a + b);
  }
  for (int64_t d = R; d < D; ++d) out[d] = from_f<T>(row[d]);
}
CLONE_VARIANTS(head_norm_rope)

template <typename T>
void rope_cache_impl(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, const T* qn, const T* kn,
                     float eps, const torch::Tensor& cos, const torch::Tensor& sin, torch::Tensor& kbuf,
                     torch::Tensor& vbuf, const int64_t* pos, const int64_t* rows, torch::Tensor& qo, int64_t H,
                     int64_t Hkv, int64_t D) {
  const int64_t B = q.size(0), R = cos.size(-1);
  const T* qp = reinterpret_cast<const T*>(q.data_ptr());
  const T* kp = reinterpret_cast<const T*>(k.data_ptr());
  const T* vp = reinterpret_cast<const T*>(v.data_ptr());
  const T* cp = reinterpret_cast<const T*>(cos.data_ptr());
  const T* sp = reinterpret_cast<const T*>(sin.data_ptr());
  T* kb = reinterpret_cast<T*>(kbuf.data_ptr());
  T* vb = reinterpret_cast<T*>(vbuf.data_ptr());
  T* op = reinterpret_cast<T*>(qo.data_ptr());
  const bool wide = have_avx512(), wide2 = !wide && have_avx2();
  // one head's norm and rotation, on AVX-512 or AVX2 where the CPU has it (bitwise the same either way)
  auto head = [&](const T* x, T* o, const T* nw, const T* c, const T* sn, float* row) {
#if KEYACC_X86
    if (wide) return head_norm_rope_avx512<T>(x, o, nw, eps, c, sn, R, D, row);
    if (wide2) return head_norm_rope_avx2<T>(x, o, nw, eps, c, sn, R, D, row);
#endif
    head_norm_rope(x, o, nw, eps, c, sn, R, D, row);
  };
  at::parallel_for(0, B * (H + Hkv), 4, [&](int64_t i0, int64_t i1) {
    std::vector<float> row(D);
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t b = i / (H + Hkv), h = i % (H + Hkv);
      const T* c = cp + b * cos.stride(0);
      const T* sn = sp + b * sin.stride(0);
      if (h < H) {
        head(qp + b * q.stride(0) + h * D, op + (b * H + h) * D, qn, c, sn, row.data());
      } else {
        const int64_t hk = h - H;
        const int64_t r = rows ? rows[b] : b;
        T* kd = kb + r * kbuf.stride(0) + hk * kbuf.stride(1) + pos[b] * kbuf.stride(2);
        T* vd = vb + r * vbuf.stride(0) + hk * vbuf.stride(1) + pos[b] * vbuf.stride(2);
        head(kp + b * k.stride(0) + hk * D, kd, kn, c, sn, row.data());
        std::memcpy(vd, vp + b * v.stride(0) + hk * D, D * sizeof(T));
      }
    }
  });
}

// q [B, H*D], k and v [B, Hkv*D] (rows contiguous); cos, sin [B, R]; kbuf, vbuf one layer's slot
// buffers [S, Hkv, max_len, D] (or its block pool [num_blocks, Hkv, block_size, D]); pos [B] int64;
// rows [B] int64 or none. Writes k (normed, rotated) and v at each row's position in slot (or
// block) rows[b] (b without rows); returns q normed and rotated as [B, H, 1, D].
torch::Tensor rope_kv_write(torch::Tensor q, torch::Tensor k, torch::Tensor v, c10::optional<torch::Tensor> q_norm,
                            c10::optional<torch::Tensor> k_norm, double eps, torch::Tensor cos, torch::Tensor sin,
                            torch::Tensor kbuf, torch::Tensor vbuf, torch::Tensor pos, c10::optional<torch::Tensor> rows) {
  const int64_t B = q.size(0), D = kbuf.size(3), Hkv = kbuf.size(1), H = q.size(1) / D;
  TORCH_CHECK(q.dim() == 2 && k.dim() == 2 && v.dim() == 2 && k.size(1) == Hkv * D && v.size(1) == Hkv * D &&
                  q.size(1) == H * D && k.size(0) == B && v.size(0) == B,
              "rope_kv_write: q/k/v shapes");
  TORCH_CHECK(q.stride(1) == 1 && k.stride(1) == 1 && v.stride(1) == 1, "rope_kv_write: rows must be contiguous");
  TORCH_CHECK(kbuf.dim() == 4 && kbuf.stride(3) == 1 && vbuf.stride(3) == 1 &&
                  (kbuf.size(0) >= B || (rows.has_value() && rows->defined())), "rope_kv_write: buffers");
  TORCH_CHECK(cos.dim() == 2 && cos.size(0) == B && cos.size(1) <= D && cos.size(1) % 2 == 0 && cos.stride(1) == 1 &&
                  sin.sizes() == cos.sizes() && sin.stride(1) == 1,
              "rope_kv_write: cos/sin");
  TORCH_CHECK(pos.scalar_type() == torch::kInt64 && pos.numel() == B, "rope_kv_write: positions");
  pos = pos.contiguous();
  const int64_t* pp = pos.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) TORCH_CHECK(pp[b] >= 0 && pp[b] < kbuf.size(2), "rope_kv_write: position out of range");
  torch::Tensor rt;
  const int64_t* rp = nullptr;
  if (rows.has_value() && rows->defined()) {
    TORCH_CHECK(rows->scalar_type() == torch::kInt64 && rows->numel() == B, "rope_kv_write: rows");
    rt = rows->contiguous();
    rp = rt.data_ptr<int64_t>();
    for (int64_t b = 0; b < B; ++b) TORCH_CHECK(rp[b] >= 0 && rp[b] < kbuf.size(0), "rope_kv_write: row out of range");
  }
  auto st = q.scalar_type();
  TORCH_CHECK(k.scalar_type() == st && v.scalar_type() == st && kbuf.scalar_type() == st && cos.scalar_type() == st,
              "rope_kv_write: dtypes");
  auto qo = torch::empty({B, H, 1, D}, q.options());
  auto nptr = [&](const c10::optional<torch::Tensor>& t) -> const void* {
    return t.has_value() && t->defined() ? t->data_ptr() : nullptr;
  };
  if (st == torch::kFloat32)
    rope_cache_impl<float>(q, k, v, (const float*)nptr(q_norm), (const float*)nptr(k_norm), static_cast<float>(eps), cos,
                           sin, kbuf, vbuf, pp, rp, qo, H, Hkv, D);
  else if (st == torch::kBFloat16)
    rope_cache_impl<bf16_t>(q, k, v, (const bf16_t*)nptr(q_norm), (const bf16_t*)nptr(k_norm), static_cast<float>(eps),
                            cos, sin, kbuf, vbuf, pp, rp, qo, H, Hkv, D);
  else TORCH_CHECK(false, "rope_kv_write: float32 or bfloat16");
  return qo;
}

std::string isa() {
  return have_amx() ? "amx" : have_avx512bf16() ? "avx512bf16" : have_avx2() ? "avx2" : "portable";
}

}  // namespace

// sampling.cpp
// A decode step's inputs from the engine's arrays, in one call (each numpy or torch operation it
// replaces cost 10-20 us right after a forward, its code cold): ids, positions, rows of the block
// array (int64 [n]) and the block array (int32 [seqs, max blocks]) -> token ids, positions, each
// new token's block and row in it, the block tables up to the furthest row's token (int32
// [n, widest]) and the context lengths (positions + 1).
std::vector<torch::Tensor> decode_inputs(torch::Tensor ids, torch::Tensor pos, torch::Tensor rows,
                                         torch::Tensor block_array, int64_t block_size) {
  TORCH_CHECK(ids.scalar_type() == torch::kInt64 && pos.scalar_type() == torch::kInt64 &&
                  rows.scalar_type() == torch::kInt64 && block_array.scalar_type() == torch::kInt32,
              "decode_inputs: int64 ids / pos / rows, an int32 block array");
  ids = ids.contiguous(), pos = pos.contiguous(), rows = rows.contiguous(), block_array = block_array.contiguous();
  const int64_t n = ids.numel(), S = block_array.size(0), M = block_array.size(1);
  TORCH_CHECK(pos.numel() == n && rows.numel() == n && n > 0 && block_size > 0, "decode_inputs: one of each a row");
  const int64_t *ip = ids.data_ptr<int64_t>(), *pp = pos.data_ptr<int64_t>(), *rp = rows.data_ptr<int64_t>();
  int64_t most = 0;
  for (int64_t r = 0; r < n; ++r) {
    TORCH_CHECK(pp[r] >= 0 && pp[r] / block_size < M && rp[r] >= 0 && rp[r] < S, "decode_inputs: out of range");
    most = std::max(most, pp[r]);
  }
  const int64_t W = most / block_size + 1;
  auto out = torch::empty({5, n}, torch::kInt64);
  auto tables = torch::empty({n, W}, torch::kInt32);
  int64_t* o = out.data_ptr<int64_t>();
  int32_t* t = tables.data_ptr<int32_t>();
  const int32_t* ba = block_array.data_ptr<int32_t>();
  for (int64_t r = 0; r < n; ++r) {
    const int64_t p = pp[r];
    const int32_t* row = ba + rp[r] * M;
    o[r] = ip[r];
    o[n + r] = p;
    o[2 * n + r] = row[p / block_size];
    o[3 * n + r] = p % block_size;
    o[4 * n + r] = p + 1;
    std::memcpy(t + r * W, row, W * sizeof(int32_t));
  }
  return {out[0], out[1], out[2], out[3], tables, out[4]};
}

// ---------------------------------------------------------------------------------------------
// A decode step's layers in one call: fused_step.py's loop over the layers, the same kernels in
// the same order with the same arguments (so the same bits), without going back to Python after
// each of a layer's nine kernel calls. That return cost Python time, and in a replica it cost a
// GIL reacquired ~200 times a step: with another thread holding the GIL 40% of the time (a busy
// event loop) a batch-1 step of the 24-layer bench model took 1.5x as long.
// Per layer, DL_T tensors in `w` (an empty tensor where the layer has none): q|k|v packed, its
// int8 scales, its bias (or q's alone, where q, k and v are separate products; a plain [N, K]
// weight where the product is not packed: float32 models, torch's own linear); q norm, k norm;
// o packed, scales, bias; the post-attention norm; gate|up packed, scales, bias; down packed,
// scales, bias; the next norm (the next layer's input norm, the model's final norm after the
// last); k's and v's packed, scales, bias where separate (else empty); DL_I ints: q, k, v, o,
// gate|up and down widths; DL_F doubles: the post-attention norm's eps, the next norm's eps, the q/k
// norms' eps, the attention scale. Per call, per layer: its K and V pools and its window.
// Returns the last layer's output through the final norm; `res` is updated in place.
constexpr size_t DL_T = 22, DL_I = 6, DL_F = 4;

torch::Tensor decode_layers(torch::Tensor x, torch::Tensor res, torch::Tensor cos, torch::Tensor sin,
                            std::vector<torch::Tensor> w, std::vector<int64_t> iv, std::vector<double> fv,
                            std::vector<torch::Tensor> kpools, std::vector<torch::Tensor> vpools,
                            std::vector<int64_t> windows, torch::Tensor tables, torch::Tensor ctx, torch::Tensor off,
                            torch::Tensor blk) {
  const size_t n = w.size() / DL_T;
  TORCH_CHECK(n > 0 && w.size() == n * DL_T && iv.size() == n * DL_I && fv.size() == n * DL_F && kpools.size() == n &&
                  vpools.size() == n && windows.size() == n,
              "decode_layers: per-layer arguments");
  auto opt = [](const torch::Tensor& t) { return t.numel() ? c10::optional<torch::Tensor>(t) : c10::nullopt; };
  auto lin = [&](const torch::Tensor& in, const torch::Tensor* t, int64_t N) {  // t: packed, scales, bias
    if (t[0].dim() == 2) return at::linear(in, t[0], opt(t[2]));  // a plain weight: torch's own product
    return t[1].numel() ? linear_int8(in, t[0], t[1], N, opt(t[2])) : linear_bf16(in, t[0], N, opt(t[2]));
  };
  const int64_t B = x.size(0);
  for (size_t j = 0; j < n; ++j) {
    const torch::Tensor* t = &w[j * DL_T];
    const int64_t* I = &iv[j * DL_I];
    const double* F = &fv[j * DL_F];
    const int64_t nq = I[0], nk = I[1], nv = I[2];
    torch::Tensor qx, kx, vx;
    if (t[16].numel()) {  // q, k and v separate
      qx = lin(x, t, nq), kx = lin(x, t + 16, nk), vx = lin(x, t + 19, nv);
    } else {
      auto y = lin(x, t, nq + nk + nv);
      qx = y.narrow(1, 0, nq), kx = y.narrow(1, nq, nk), vx = y.narrow(1, nq + nk, nv);
    }
    auto q = rope_kv_write(qx, kx, vx, opt(t[3]), opt(t[4]), F[2], cos, sin, kpools[j], vpools[j], off, blk);
    auto a = paged_decode_attention(q, kpools[j], vpools[j], tables, ctx, windows[j], F[3]);
    x = add_rms_norm(lin(a.view({B, -1}), t + 5, I[3]), res, t[8], F[0]);
    auto m = lin(silu_mul(lin(x, t + 9, I[4])), t + 12, I[5]);
    x = add_rms_norm(m, res, t[15], F[1]);
  }
  return x;
}

torch::Tensor sample_rows(torch::Tensor x, torch::Tensor temperature, torch::Tensor top_k, torch::Tensor top_p,
                          torch::Tensor min_p, torch::Tensor u, torch::Tensor e);
torch::Tensor argmax_rows(torch::Tensor x);
std::string sampling_isa();
torch::Tensor sample_rows_seeded(torch::Tensor x, torch::Tensor temperature, torch::Tensor top_k, torch::Tensor top_p,
                                 torch::Tensor min_p, torch::Tensor seeds, torch::Tensor positions, torch::Tensor e);
void penalize_at(torch::Tensor x, torch::Tensor idx, double penalty);
void subtract_at(torch::Tensor x, torch::Tensor idx, torch::Tensor v);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // The compute kernels run without the GIL, as torch's own ops do: a replica's event loop (its
  // streams, the hops it takes, its heartbeats) runs while a step's products and attention do,
  // instead of waiting out every call (a long prefill's product held it for its whole length).
  // They touch no Python object: arguments are converted before the call and results after.
  const auto nogil = py::call_guard<py::gil_scoped_release>();
  m.def("zeros_huge", &zeros_huge_py, "a zeroed CPU tensor on 2 MB pages where Linux gives them (else plain pages)",
        py::arg("sizes"), py::arg("dtype"));
  m.def("pack_bf16", &pack_bf16, nogil, "prepack [N, K] bf16 weights into 16-row k-pair blocks");
  m.def("linear_bf16", &linear_bf16, nogil, "y = x @ W^T (+ b) from prepacked bf16 weights");
  m.def("pack_int8", &pack_int8, nogil, "quantise [N, K] weights to int8 with per-row scales, prepacked");
  m.def("linear_int8", &linear_int8, nogil, "y = x @ (scale * Wq)^T (+ b) from prepacked int8 weights");
  m.def("decode_attention", &decode_attention, nogil, "one-token attention over slot KV buffers, GQA without repeat");
  m.def("rms_norm", &rms_norm, nogil, "Llama-family RMSNorm");
  m.def("silu_mul", &silu_mul, nogil, "SiLU(gate) * up over a fused gate|up tensor");
  m.def("add_rms_norm", &add_rms_norm, nogil, "residual += x; return RMSNorm(residual)");
  m.def("rope_kv_write", &rope_kv_write, nogil, "per-head norm + rotary for q and k, k/v written into the slot cache",
        py::arg("q"), py::arg("k"), py::arg("v"), py::arg("q_norm"), py::arg("k_norm"), py::arg("eps"), py::arg("cos"),
        py::arg("sin"), py::arg("kbuf"), py::arg("vbuf"), py::arg("pos"), py::arg("rows") = py::none());
  m.def("paged_decode_attention", &paged_decode_attention, nogil,
        "one-token attention over a paged KV block pool through block tables, GQA without repeat, mixed lengths");
  m.def("sample_rows", &sample_rows, nogil,
        "top-k / min-p / top-p and the seeded inverse-CDF draw per row (engine/sampling.py's rule)");
  m.def("argmax_rows", &argmax_rows, nogil, "each row's first largest logit (float32 / bfloat16), as torch.argmax");
  m.def("sample_rows_seeded", &sample_rows_seeded, nogil,
        "sample_rows with each row's uniform made from its premixed seed and position (sampling.uniforms' rule)");
  m.def("penalize_at", &penalize_at, nogil, "x[i] = x[i] < 0 ? x[i] * p : x[i] / p at flat indices (the repetition penalty)");
  m.def("subtract_at", &subtract_at, nogil, "x[idx[j]] -= v[j] at flat indices (presence and frequency penalties)");
  m.def("decode_layers", &decode_layers, nogil,
        "a decode step's layers in one call (fused_step.py's loop: the same kernels, the same order)");
  m.def("decode_inputs", &decode_inputs, nogil,
        "a decode step's ids, positions, blocks, rows in block, block tables (int32) and context lengths");
  m.def("sampling_isa", &sampling_isa, "the variant the sampling kernels run (avx512 | avx2 | portable)");
  m.def("isa", &isa, "the linear kernel variant this CPU runs (amx: AMX tiles for products of 8 rows or more)");
}
