
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <c10/util/Half.h>
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <optional>
#include <type_traits>
#if defined(__x86_64__)
#include <immintrin.h>
#endif
#if defined(__linux__)
#include <sched.h>
#endif
#include <vector>

namespace {

// exp on [-87, 0] (Cephes' expf: range reduction by ln 2, degree-6 polynomial; ~1 ulp), plain
// arithmetic so that the compiler vectorizes the loops that call it.
inline float exp_neg(float x) {
  x = x < -87.0f ? -87.0f : x;
  float fx = __builtin_floorf(x * 1.44269504088896341f + 0.5f);
  x = x - fx * 0.693359375f + fx * 2.12194440e-4f;
  float z = x * x;
  float y = ((((1.9875691500e-4f * x + 1.3981999507e-3f) * x + 8.3334519073e-3f) * x
              + 4.1665795894e-2f) * x + 1.6666665459e-1f) * x + 5.0000001201e-1f;
  y = y * z + x + 1.0f;
  int32_t bits = (static_cast<int32_t>(fx) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return y * scale;
}

// Each of ``group`` rows of ``n`` scores replaced by exp(score - max); ``total`` gets the row sums.
inline void softmax(float* score, float* total, int64_t group, int64_t n) {
  for (int64_t g = 0; g < group; ++g) {
    float* s = score + g * n;
    float top = s[0];
    for (int64_t j = 1; j < n; ++j) top = s[j] > top ? s[j] : top;
    float sum = 0.0f;
    for (int64_t j = 0; j < n; ++j) {
      s[j] = exp_neg(s[j] - top);
      sum += s[j];
    }
    total[g] = sum;
  }
}

// An 8-bit pool's keys or values (kv_quant.py): codes (slots, kv_heads, dim) with a float32 scale per
// slot and KV head, each value its code (exact in fp32) times its scale in fp32, rounded to the model's
// dtype to nearest even as torch rounds (kv_quant.dequantize's values, with no dense dequantised
// copy). The bf16 matrix-product kernels (attention_dot.cpp, attention_tiles.cpp) read their bf16
// pools through it too (``bf16`` set); the fp32 kernels take a dense pool as a plain pointer.
struct KVSource {
  const uint16_t* bf16 = nullptr;  // the bf16 pool, or null for an 8-bit one
  const uint8_t* codes = nullptr;
  const float* scales = nullptr;
  int fmt = 0;  // 1 fp8 e4m3, 2 fp8 e5m2, 3 int8
};

// One 8-bit code's value, exact in fp32: fmt 1 fp8 e4m3, 2 fp8 e5m2, 3 int8.
inline float kv_code(uint8_t c, int fmt) {
  if (fmt == 3) return static_cast<float>(static_cast<int8_t>(c));
  if (fmt == 1) return static_cast<float>(c10::Float8_e4m3fn(c, c10::Float8_e4m3fn::from_bits()));
  return static_cast<float>(c10::Float8_e5m2(c, c10::Float8_e5m2::from_bits()));
}

// Vector ``vec`` (slot * kv_heads + KV head) of a pool in fp32: a dense pool's values widened; an
// 8-bit pool's values (KVSource) rounded to T, then widened.
template <typename T>
inline void widen(const T* pool, int64_t vec, int64_t dim, float* out) {
  const T* x = pool + vec * dim;
  for (int64_t d = 0; d < dim; ++d) out[d] = static_cast<float>(x[d]);
}
template <typename T>
inline void widen(const KVSource& src, int64_t vec, int64_t dim, float* out) {
  const uint8_t* c = src.codes + vec * dim;
  const float s = src.scales[vec];
  for (int64_t d = 0; d < dim; ++d) out[d] = static_cast<float>(static_cast<T>(kv_code(c[d], src.fmt) * s));
}

// The generic kernel: any dtype and head size. Per task (a row and a KV head): the scores of the
// row's query heads that share the KV head against its keys (the first lens[r] of its sequence's
// slot list, slots[seq[r]]) in position order, softmax (fp32), the weighted sum of its values. The
// pools (Pool): dense (const T*) or 8-bit (KVSource).
template <typename T, typename Pool>
void attend_generic(const T* q, const Pool& kp, const Pool& vp, const int64_t* slots, const int64_t* seq,
                    const int64_t* lens, T* out, int64_t rows, int64_t heads, int64_t kv_heads, int64_t dim,
                    int64_t width,
                    float scale) {
  const int64_t group = heads / kv_heads;
  at::parallel_for(0, rows * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(group * dim), acc(group * dim), kf(dim), vf(dim), score, total(group);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t r = task / kv_heads, kh = task % kv_heads, n = lens[r];
      const int64_t* slot = slots + seq[r] * width;
      score.assign(group * n, 0.0f);
      for (int64_t g = 0; g < group; ++g) {
        const T* qrow = q + (r * heads + kh * group + g) * dim;
        for (int64_t d = 0; d < dim; ++d) qf[g * dim + d] = static_cast<float>(qrow[d]) * scale;
      }
      for (int64_t j = 0; j < n; ++j) {
        widen<T>(kp, slot[j] * kv_heads + kh, dim, kf.data());
        for (int64_t g = 0; g < group; ++g) {
          float dot = 0.0f;
          for (int64_t d = 0; d < dim; ++d) dot += qf[g * dim + d] * kf[d];
          score[g * n + j] = dot;
        }
      }
      softmax(score.data(), total.data(), group, n);
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t j = 0; j < n; ++j) {
        widen<T>(vp, slot[j] * kv_heads + kh, dim, vf.data());
        for (int64_t g = 0; g < group; ++g) {
          const float p = score[g * n + j];
          for (int64_t d = 0; d < dim; ++d) acc[g * dim + d] += p * vf[d];
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        T* o = out + (r * heads + kh * group + g) * dim;
        const float inv = 1.0f / total[g];
        for (int64_t d = 0; d < dim; ++d) o[d] = static_cast<T>(acc[g * dim + d] * inv);
      }
    }
  });
}

// Rows in blocks: consecutive rows on one slot list (a prompt's, one row per position), at most
// kBlock of them, share each key and value while it is loaded (converted to fp32 once); a decode is
// a block of one row.
constexpr int64_t kBlock = 16;
constexpr int kChunk = 16;  // keys scored at once

// The blocks' first rows (and rows at the end): a new block where the slot list changes or one is full.
inline std::vector<int64_t> row_blocks(const int64_t* seq, int64_t rows) {
  std::vector<int64_t> start{0};
  for (int64_t r = 1; r < rows; ++r)
    if (seq[r] != seq[r - 1] || r - start.back() == kBlock) start.push_back(r);
  start.push_back(rows);
  return start;
}

// The blocks dealt to ``threads`` threads by their work (the keys of their rows), largest first, each
// to the thread with the least so far: a prompt's late rows, which see the most keys, are spread
// over the threads. Returns each thread's blocks.
inline std::vector<std::vector<int64_t>> deal(const std::vector<int64_t>& start, const int64_t* lens, int64_t threads) {
  const int64_t blocks = static_cast<int64_t>(start.size()) - 1;
  std::vector<int64_t> work(blocks, 0), order(blocks), load(threads, 0);
  for (int64_t b = 0; b < blocks; ++b) {
    for (int64_t r = start[b]; r < start[b + 1]; ++r) work[b] += lens[r];
    order[b] = b;
  }
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return work[a] > work[b]; });
  std::vector<std::vector<int64_t>> share(threads);
  for (int64_t b : order) {
    const int64_t t = std::min_element(load.begin(), load.end()) - load.begin();
    share[t].push_back(b);
    load[t] += work[b];
  }
  return share;
}

// A block's KV heads kh0 .. kh1 - 1 (and their query heads): the task of one thread.
struct Part {
  int64_t block, kh0, kh1;
};

// deal's dealing where there are fewer blocks than threads (a decode of one or a few sequences):
// each block's KV heads split into as many even parts as the threads allow, each part's work the
// block's times its share of the heads. A head's numbers are the same in any part.
inline std::vector<std::vector<Part>> deal_parts(const std::vector<int64_t>& start, const int64_t* lens, int64_t threads,
                                                 int64_t kv_heads) {
  const int64_t blocks = static_cast<int64_t>(start.size()) - 1;
  const int64_t parts = blocks >= threads ? 1 : std::min(kv_heads, (threads + blocks - 1) / blocks);
  std::vector<Part> items;
  std::vector<int64_t> work;
  for (int64_t b = 0; b < blocks; ++b) {
    int64_t keys = 0;
    for (int64_t r = start[b]; r < start[b + 1]; ++r) keys += lens[r];
    for (int64_t p = 0; p < parts; ++p) {
      items.push_back({b, p * kv_heads / parts, (p + 1) * kv_heads / parts});
      work.push_back(keys * (items.back().kh1 - items.back().kh0));
    }
  }
  std::vector<int64_t> order(items.size()), load(std::max<int64_t>(1, std::min<int64_t>(threads, items.size())), 0);
  for (size_t i = 0; i < order.size(); ++i) order[i] = static_cast<int64_t>(i);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return work[a] > work[b]; });
  std::vector<std::vector<Part>> share(load.size());
  for (int64_t i : order) {
    const int64_t t = std::min_element(load.begin(), load.end()) - load.begin();
    share[t].push_back(items[i]);
    load[t] += work[i];
  }
  return share;
}

#if defined(__x86_64__)
// ``elements`` values from p requested into L1, 64 bytes at a time.
// Always inlined (as every fetch helper here): GCC does not inline a plain function into the AVX-512,
// AVX512-BF16 and AMX kernels built for other targets, and drops a call to one that only prefetches.
template <typename T>
__attribute__((always_inline)) inline void prefetch_slot(const T* p, int64_t elements) {
  const char* c = reinterpret_cast<const char*>(p);
  for (int64_t off = 0; off < elements * static_cast<int64_t>(sizeof(T)); off += 64) _mm_prefetch(c + off, _MM_HINT_T0);
}

// The vector kernels' exp_neg (AVX-512 and AVX2): Cephes' range reduction by ln 2 (log2(e), ln 2 in
// two parts) and its degree-6 polynomial, highest power first, evaluated in fused multiply-adds.
constexpr float kLog2e = 1.44269504088896341f, kLn2Hi = 0.693359375f, kLn2Lo = 2.12194440e-4f;
constexpr float kExpPoly[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                               4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};

// The AVX-512 helpers the generic AVX-512 kernels and the AMX kernels (built for other targets) share:
// always inlined, of a target every caller's includes.
#define ZT_AVX512_HELPER __attribute__((target("avx512f"), always_inline)) inline

// 16 fp32 values rounded to bf16 as torch rounds (to nearest even on the bits, subnormals included),
// back in fp32.
ZT_AVX512_HELPER __m512 round_bf16(__m512 x) {
  const __m512i bits = _mm512_castps_si512(x);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i up = _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF)));
  return _mm512_castsi512_ps(_mm512_and_si512(up, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

// 16 bf16 values (their bits) widened to fp32; fp32 values that are bf16 values narrowed to their bits.
ZT_AVX512_HELPER __m512 widen_bf16(__m256i bits) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}
ZT_AVX512_HELPER __m256i narrow_bf16(__m512 v) {
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(v), 16));
}

// exp_neg on 16 lanes (the same reduction and polynomial, in fused multiply-adds).
ZT_AVX512_HELPER __m512 exp_neg16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 fx = _mm512_roundscale_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(kLog2e), _mm512_set1_ps(0.5f)),
                                         _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  x = _mm512_fmadd_ps(fx, _mm512_set1_ps(kLn2Lo), _mm512_fnmadd_ps(fx, _mm512_set1_ps(kLn2Hi), x));
  const __m512 z = _mm512_mul_ps(x, x);
  __m512 y = _mm512_set1_ps(kExpPoly[0]);
  for (int i = 1; i < 6; ++i) y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(kExpPoly[i]));
  y = _mm512_add_ps(_mm512_fmadd_ps(y, z, x), _mm512_set1_ps(1.0f));
  const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(fx), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(y, _mm512_castsi512_ps(bits));
}

// The gated MLP's SiLU(g) * u on 16 lanes of bf16 values g and u (in fp32), with the model's roundings:
// silu(g) = g / (1 + e^-g) through exp_neg16 of -|g| (g >= 0: g / (1 + t), g < 0: g t / (1 + t),
// t = e^-|g|), rounded to bf16, times u, rounded again.
ZT_AVX512_HELPER __m512 silu_mul16(__m512 g, __m512 u) {
  const __m512 t = exp_neg16(_mm512_min_ps(g, _mm512_sub_ps(_mm512_setzero_ps(), g)));
  const __m512 num = _mm512_mask_mul_ps(g, _mm512_cmp_ps_mask(g, _mm512_setzero_ps(), _CMP_LT_OQ), g, t);
  const __m512 silu = round_bf16(_mm512_div_ps(num, _mm512_add_ps(_mm512_set1_ps(1.0f), t)));
  return round_bf16(_mm512_mul_ps(silu, u));
}
#endif

#if defined(__AVX512F__)
// The same computation on AVX-512 registers, for float and bfloat16 pools, heads of V * 16 and
// groups of G query heads per KV head known when compiling: a key's 16-lane products summed
// lane-wise, then across lanes; the values accumulated in 16-lane registers.
template <typename T>
inline __m512 load16(const T* p);
template <>
inline __m512 load16<float>(const float* p) { return _mm512_loadu_ps(p); }
template <>
inline __m512 load16<c10::BFloat16>(const c10::BFloat16* p) {
  __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}


// 16 codes (a 128-bit lane) as fp32: int8 converted directly; fp8 through fp16's bits, sign-extended
// to 16 bits and shifted into place (e5m2 is fp16's top byte; e4m3's exponent and mantissa go 7 bits
// up, the sign's copy in bit 14 cleared), converted exactly: e4m3's value 2^-8 the code's (exponent
// bias 15 against 7), which kv_scale folds into the scale. Both always inlined: the AVX512-BF16 and
// tile kernels' functions, of other targets, otherwise call them per 16 codes.
__attribute__((always_inline)) inline __m512 kv_codes16(__m128i x, int fmt) {
  if (fmt == 3) return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(x));
  const __m256i h = _mm256_cvtepi8_epi16(x);
  return _mm512_cvtph_ps(fmt == 2 ? _mm256_slli_epi16(h, 8)
                                  : _mm256_and_si256(_mm256_slli_epi16(h, 7), _mm256_set1_epi16(static_cast<int16_t>(0xBFFF))));
}

// The factor kv_codes16's values are multiplied by: the scale (times 256 for e4m3, exact: a power of
// two, and the product code x scale is rounded once either way).
__attribute__((always_inline)) inline __m512 kv_scale(float scale, int fmt) {
  return _mm512_set1_ps(fmt == 1 ? scale * 256.0f : scale);
}

// 16 fp32 values rounded to T as torch rounds (bf16: to nearest even on the bits, subnormals
// included; the 8-bit pools' values are finite), back in fp32.
template <typename T>
inline __m512 round_to(__m512 x);
template <>
inline __m512 round_to<float>(__m512 x) { return x; }
template <>
inline __m512 round_to<c10::BFloat16>(__m512 x) { return round_bf16(x); }

// softmax's work on 16 lanes: each of ``group`` rows of ``n`` scores replaced by exp(score - max),
// ``total`` the row sums (16 running sums over the row's positions j % 16, then added up).
inline void softmax16(float* score, float* total, int64_t group, int64_t n) {
  const int64_t full = n / 16 * 16;
  const __mmask16 tail = static_cast<__mmask16>((1u << (n - full)) - 1u);
  for (int64_t g = 0; g < group; ++g) {
    float* s = score + g * n;
    __m512 top = _mm512_set1_ps(-INFINITY);
    for (int64_t j = 0; j < full; j += 16) top = _mm512_max_ps(top, _mm512_loadu_ps(s + j));
    if (tail) top = _mm512_mask_max_ps(top, tail, top, _mm512_maskz_loadu_ps(tail, s + full));
    const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(top));
    __m512 sum = _mm512_setzero_ps();
    for (int64_t j = 0; j < full; j += 16) {
      const __m512 e = exp_neg16(_mm512_sub_ps(_mm512_loadu_ps(s + j), m));
      _mm512_storeu_ps(s + j, e);
      sum = _mm512_add_ps(sum, e);
    }
    if (tail) {
      const __m512 e = exp_neg16(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, s + full), m));
      _mm512_mask_storeu_ps(s + full, tail, e);
      sum = _mm512_mask_add_ps(sum, tail, sum, e);
    }
    total[g] = _mm512_reduce_add_ps(sum);
  }
}

// The sums of the lanes of 16 vectors at once, each the bits _mm512_reduce_add_ps gives it (its
// halves added, then the halves' halves, ...: the same pairs in the same order), in about a third of
// the instructions: x[i] holds the vector whose sum goes to lane (i % 4) * 4 + i / 4.
inline __m512 reduce16(const __m512* x) {
  __m512 y[8], z[4], t[2];
  for (int i = 0; i < 8; ++i)
    y[i] = _mm512_add_ps(_mm512_shuffle_f32x4(x[2 * i], x[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)),
                         _mm512_shuffle_f32x4(x[2 * i], x[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)));
  for (int i = 0; i < 4; ++i)
    z[i] = _mm512_add_ps(_mm512_shuffle_f32x4(y[2 * i], y[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)),
                         _mm512_shuffle_f32x4(y[2 * i], y[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)));
  for (int i = 0; i < 2; ++i)
    t[i] = _mm512_add_ps(_mm512_shuffle_ps(z[2 * i], z[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)),
                         _mm512_shuffle_ps(z[2 * i], z[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)));
  return _mm512_add_ps(_mm512_shuffle_ps(t[0], t[1], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_ps(t[0], t[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

// Positions j0 .. j0 + 15 (fewer at the end, n) of a slot list: each slot's vectors of KV heads
// kh0 .. kh1 - 1 converted to fp32 into ``chunk`` (KV head kh, position c at (kh * kChunk + c) * dim),
// the next chunk's slots requested meanwhile. Returns how many positions it loaded.
template <typename T, int V>
inline int64_t load_chunk(const T* pool, const int64_t* slot, int64_t j0, int64_t n, int64_t kv_heads, int64_t kh0,
                          int64_t kh1, float* chunk) {
  constexpr int64_t dim = V * 16;
  const int64_t cn = std::min<int64_t>(kChunk, n - j0);
  for (int64_t c = 0; c < cn; ++c) {
    if (j0 + c + kChunk < n) prefetch_slot(pool + (slot[j0 + c + kChunk] * kv_heads + kh0) * dim, (kh1 - kh0) * dim);
    const T* x = pool + slot[j0 + c] * kv_heads * dim;
    for (int64_t kh = kh0; kh < kh1; ++kh)
      for (int v = 0; v < V; ++v) _mm512_storeu_ps(chunk + (kh * kChunk + c) * dim + 16 * v, load16<T>(x + kh * dim + 16 * v));
  }
  return cn;
}

// The same from an 8-bit pool: each value its code times its scale in fp32 (kv_codes16, kv_scale),
// rounded to T (round_to): kv_quant.dequantize's values, widened.
template <typename T, int V>
inline int64_t load_chunk(const KVSource& src, const int64_t* slot, int64_t j0, int64_t n, int64_t kv_heads, int64_t kh0,
                          int64_t kh1, float* chunk) {
  constexpr int64_t dim = V * 16;
  const int64_t cn = std::min<int64_t>(kChunk, n - j0);
  for (int64_t c = 0; c < cn; ++c) {
    if (j0 + c + kChunk < n) {
      prefetch_slot(src.codes + (slot[j0 + c + kChunk] * kv_heads + kh0) * dim, (kh1 - kh0) * dim);
      prefetch_slot(src.scales + slot[j0 + c + kChunk] * kv_heads + kh0, kh1 - kh0);
    }
    const int64_t vec = slot[j0 + c] * kv_heads;
    for (int64_t kh = kh0; kh < kh1; ++kh) {
      const __m512 f = kv_scale(src.scales[vec + kh], src.fmt);
      const uint8_t* x = src.codes + (vec + kh) * dim;
      for (int v = 0; v < V; ++v) {
        const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(x + 16 * v));
        _mm512_storeu_ps(chunk + (kh * kChunk + c) * dim + 16 * v, round_to<T>(_mm512_mul_ps(kv_codes16(raw, src.fmt), f)));
      }
    }
  }
  return cn;
}

// One task per block of rows (or per part of its KV heads where there are fewer blocks than threads:
// deal_parts): their keys, then their values, 16 at a time. A row's numbers are those of the same row
// alone: each head's scores, softmax and weighted sum in the same order whatever block or part it is
// in, and no two threads share a row's head. The pools: dense or 8-bit (load_chunk's).
template <typename T, int V, int G, typename Pool>
void attend_avx512(const T* q, const Pool& kp, const Pool& vp, const int64_t* slots, const int64_t* seq,
                   const int64_t* lens, T* out, int64_t rows, int64_t heads, int64_t kv_heads, int64_t width,
                   float scale) {
  constexpr int64_t dim = V * 16;
  const std::vector<int64_t> start = row_blocks(seq, rows);
  const int64_t blocks = static_cast<int64_t>(start.size()) - 1;
  const std::vector<std::vector<Part>> share = deal_parts(start, lens, at::get_num_threads(), kv_heads);
  const int64_t threads = static_cast<int64_t>(share.size());
  at::parallel_for(0, threads, 1, [&](int64_t first, int64_t last) {
    std::vector<float> score, total(kBlock * heads), chunk(kChunk * kv_heads * dim, 0.0f);
    std::vector<__m512> qv(kBlock * heads * V), acc(kBlock * heads * V);
    int64_t offset[kBlock + 1];
    alignas(64) float buffer[dim];
    for (int64_t t = first; t < last; ++t) {
      for (const Part& part : share[t]) {
        const int64_t b = part.block, kh0 = part.kh0, kh1 = part.kh1, h0 = kh0 * G, h1 = kh1 * G;
        const int64_t r0 = start[b], nr = start[b + 1] - r0;
        const int64_t* slot = slots + seq[r0] * width;
        const int64_t* len = lens + r0;
        int64_t n = 0;  // the block's longest row
        offset[0] = 0;
        for (int64_t w = 0; w < nr; ++w) {
          n = std::max(n, len[w]);
          offset[w + 1] = offset[w] + heads * len[w];
        }
        score.resize(offset[nr]);
        for (int64_t w = 0; w < nr; ++w)
          for (int64_t h = h0; h < h1; ++h)
            for (int v = 0; v < V; ++v)
              qv[(w * heads + h) * V + v] =
                  _mm512_mul_ps(load16<T>(q + ((r0 + w) * heads + h) * dim + 16 * v), _mm512_set1_ps(scale));
        // Scores 16 keys at a time: the keys converted to fp32 once (load_chunk), each query's 16 dot
        // products reduced together (reduce16: the bits of reducing each alone).
        for (int64_t j0 = 0; j0 < n; j0 += kChunk) {
          load_chunk<T, V>(kp, slot, j0, n, kv_heads, kh0, kh1, chunk.data());
          for (int64_t w = 0; w < nr; ++w) {
            if (j0 >= len[w]) continue;
            float* s = score.data() + offset[w];
            const __mmask16 valid = static_cast<__mmask16>((1u << std::min<int64_t>(kChunk, len[w] - j0)) - 1u);
            for (int64_t h = h0; h < h1; ++h) {
              const __m512* qh = qv.data() + (w * heads + h) * V;
              const float* kb = chunk.data() + (h / G) * kChunk * dim;
              __m512 dot[kChunk];
              for (int i = 0; i < kChunk; ++i) {
                const float* key = kb + ((i % 4) * 4 + i / 4) * dim;  // reduce16's lane order
                dot[i] = _mm512_mul_ps(qh[0], _mm512_loadu_ps(key));
                for (int v = 1; v < V; ++v) dot[i] = _mm512_fmadd_ps(qh[v], _mm512_loadu_ps(key + 16 * v), dot[i]);
              }
              _mm512_mask_storeu_ps(s + h * len[w] + j0, valid, reduce16(dot));
            }
          }
        }
        for (int64_t w = 0; w < nr; ++w)
          softmax16(score.data() + offset[w] + h0 * len[w], total.data() + w * heads + h0, h1 - h0, len[w]);
        // Values 16 keys at a time, converted to fp32 once (load_chunk); each query's sums stay in
        // registers over the chunk's keys, in key order.
        for (int64_t a = 0; a < nr * heads * V; ++a) acc[a] = _mm512_setzero_ps();
        for (int64_t j0 = 0; j0 < n; j0 += kChunk) {
          const int64_t cn = load_chunk<T, V>(vp, slot, j0, n, kv_heads, kh0, kh1, chunk.data());
          for (int64_t w = 0; w < nr; ++w) {
            if (j0 >= len[w]) continue;
            const int64_t m = std::min<int64_t>(cn, len[w] - j0);
            const float* s = score.data() + offset[w] + j0;
            for (int64_t h = h0; h < h1; ++h) {
              const float* vb = chunk.data() + (h / G) * kChunk * dim;
              const float* p = s + h * len[w];
              __m512* a = acc.data() + (w * heads + h) * V;
              __m512 sum[V];
              for (int v = 0; v < V; ++v) sum[v] = a[v];
              for (int64_t c = 0; c < m; ++c) {
                const __m512 weight = _mm512_set1_ps(p[c]);
                for (int v = 0; v < V; ++v) sum[v] = _mm512_fmadd_ps(weight, _mm512_loadu_ps(vb + c * dim + 16 * v), sum[v]);
              }
              for (int v = 0; v < V; ++v) a[v] = sum[v];
            }
          }
        }
        for (int64_t w = 0; w < nr; ++w) {
          for (int64_t h = h0; h < h1; ++h) {
            T* o = out + ((r0 + w) * heads + h) * dim;
            const __m512 inv = _mm512_set1_ps(1.0f / total[w * heads + h]);
            for (int v = 0; v < V; ++v)
              _mm512_store_ps(buffer + 16 * v, _mm512_mul_ps(acc[(w * heads + h) * V + v], inv));
            for (int64_t d = 0; d < dim; ++d) o[d] = static_cast<T>(buffer[d]);
          }
        }
      }
    }
  });
}

template <typename T, int V, typename Pool>
bool attend_fixed_group(const T* q, const Pool& kp, const Pool& vp, const int64_t* slots, const int64_t* seq,
                        const int64_t* lens, T* out, int64_t rows, int64_t heads, int64_t kv_heads, int64_t width,
                        float scale) {
  switch (heads / kv_heads) {
#define ZT_GROUP(G) \
    case G: attend_avx512<T, V, G, Pool>(q, kp, vp, slots, seq, lens, out, rows, heads, kv_heads, width, scale); return true;
    ZT_GROUP(1) ZT_GROUP(2) ZT_GROUP(3) ZT_GROUP(4) ZT_GROUP(5) ZT_GROUP(6) ZT_GROUP(7) ZT_GROUP(8)
#undef ZT_GROUP
    default: return false;
  }
}
#endif

