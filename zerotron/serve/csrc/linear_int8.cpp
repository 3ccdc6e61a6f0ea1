// ---- 8-bit weights with a scale (and a min) per group of inputs, on AVX2 ----------------------------
// y = x w^T for fp32 x (rows, K) and w (N, K) given as int8 values q (or 4-bit ones two a byte) and a
// scale s (and a min m) per output and group of `group` inputs: w = q * s - m (or + m), the file's own
// arithmetic (GGUF Q8_0, Q6_K, Q5_K, Q4_K, Q4_1, Q4_0, Q3_K, Q2_K; GPTQ, AWQ and compressed-tensors
// 8- and 4-bit, whose zeros are mins z * s). Each scale and min is a product of
// at most two factors read from tables of any layout and dtype (Factor), so the files' tables are read
// as they are, with no dequantised or repacked copy.
//
// Per task (a chunk of rows, a tile of 12 outputs) the weights of a 256-deep slice of inputs are
// dequantised once into an fp32 buffer (exact: the products of 8-bit values and f16-sized scales fit
// fp32's significand), which every block of up to 4 rows of the chunk then multiplies while it is in
// L1. An output element is 8 fused multiply-add chains over its inputs, lane l taking inputs l, l + 8,
// ... in order from zero, the 8 lanes added in a fixed tree at the end: a row's numbers never depend on
// the other rows, on the blocking, or on how the tiles are shared among threads.
#if defined(__x86_64__) && (defined(__clang__) || defined(__GNUC__))
#define ZT_Q8 1
#if defined(__clang__)
#define ZT_Q8_TARGET __attribute__((target("avx2,fma,f16c")))
#define ZT_Q8_ORDER _Pragma("clang fp reassociate(off)")
#else  // the chains must stay chains: no reassociation here whatever the file's flags
#define ZT_Q8_TARGET __attribute__((target("avx2,fma,f16c"), optimize("no-associative-math")))
#define ZT_Q8_ORDER
#endif
constexpr int64_t QOT = 12, QKS = 256, QMC = 64;  // outputs per tile, inputs per slice, rows per task

// One factor of the groups' scales or mins: entry (o, gi / per) of a table, at o * so + (gi / per) * sg.
struct Factor {
  const void* p = nullptr;
  int kind = 0;  // 0 absent (1.0), 1 f32, 2 f16, 3 int8, 4 uint8, 5 bf16
  int64_t so = 0, sg = 0, per = 1;
};

// A bf16 value's bits as the float whose upper half they are.
__attribute__((always_inline)) inline float bf16_float(uint16_t h) {
  const uint32_t bits = static_cast<uint32_t>(h) << 16;
  float v;
  std::memcpy(&v, &bits, 4);
  return v;
}

// Entry i of a factor's table as a float.
ZT_Q8_TARGET inline float factor_entry(const Factor& f, int64_t i) {
  switch (f.kind) {
    case 1: return static_cast<const float*>(f.p)[i];
    case 2: return _cvtsh_ss(static_cast<const uint16_t*>(f.p)[i]);
    case 3: return static_cast<float>(static_cast<const int8_t*>(f.p)[i]);
    case 4: return static_cast<float>(static_cast<const uint8_t*>(f.p)[i]);
    case 5: return bf16_float(static_cast<const uint16_t*>(f.p)[i]);
    default: return 1.0f;
  }
}

// Output o's factor for groups g0, g0 + 1, ... (count of them) multiplied into out; e0 = g0 / per and
// r0 = g0 % per are the slice's, the same for every output (no division per output).
ZT_Q8_TARGET __attribute__((always_inline)) inline void factor_times(const Factor& f, int64_t o, int64_t e0, int64_t r0, int64_t count, float* out) {
  if (f.kind == 0) return;
  if (f.per == 1) {  // an entry per group (most tables): one kind per loop, no counting
    const int64_t at = o * f.so + e0 * f.sg, sg = f.sg;
    switch (f.kind) {
      case 1:
        for (int64_t c = 0; c < count; ++c) out[c] *= static_cast<const float*>(f.p)[at + c * sg];
        return;
      case 2:
        for (int64_t c = 0; c < count; ++c) out[c] *= _cvtsh_ss(static_cast<const uint16_t*>(f.p)[at + c * sg]);
        return;
      case 5:  // bf16 (torch's int4 scales and zeros)
        for (int64_t c = 0; c < count; ++c) out[c] *= bf16_float(static_cast<const uint16_t*>(f.p)[at + c * sg]);
        return;
      default:
        for (int64_t c = 0; c < count; ++c) out[c] *= factor_entry(f, at + c * sg);
        return;
    }
  }
  int64_t i = o * f.so + e0 * f.sg, r = r0;
  for (int64_t c = 0; c < count; ++c) {
    out[c] *= factor_entry(f, i);
    if (++r == f.per) {
      r = 0;
      i += f.sg;
    }
  }
}

struct Q8Problem {
  const float* x;
  float* y;
  const int8_t* q;  // value (o, k) at q[o * qo + (k / group) * qg + k % group] (elements)
  int64_t qo, qg;
  // kind 0: int8 values; 1: two values a byte instead (input 2j in the low half, 2j + 1 in the high:
  // byte (k % group) / 2), each less offset (GGUF Q2_K's and Q3_K's values as zerotron keeps them), or
  // with offset -1 to -5 each an index into a table (Q8_TABLES: llama.cpp's IQ4_NL values, or the values
  // of the 1- to 3-bit IQ types' grids): lut[nibble];
  // 2: bf16 values (the weights themselves: no scales)
  int kind;
  int32_t offset;
  Factor s1, s2, m1, m2;  // scale s1 * s2; min m1 * m2 (none when m1 is absent)
  bool add_mins;          // w = q * s + m instead (GGUF Q4_1's)
  int64_t ldx, rows, n, k, group, tiles, chunk;
  const int64_t* slices = nullptr;  // q8_slice's e0 and r0 (8 numbers) of each QKS-input slice, made once a call
  bool wide = false;                // 1 to 8 rows' outputs two a register on AVX-512 (q8_direct_wide)
  int64_t ldy = 0;                  // output (m, o) at y[m * ldy + o]: n, or wider where several products share y
  int64_t ahead[5] = {0, 0, 0, 0, 0};  // bytes an output's values, s1, s2, m1, m2 take (q8_ahead_bytes)
  alignas(16) int8_t lut[16] = {};     // kind 1: a nibble's value (nibble - offset, or its table's entry)
};

// The weights' 4-bit indices' tables, offset -1 to -5 (zerotron.models.gguf_blocks.NIBBLE_TABLES):
// llama.cpp's IQ4_NL values (kvalues_iq4nl); the values of the IQ2 grids, of IQ3_XXS's and IQ3_S's,
// times either sign; IQ1's grid values plus or less their delta, in eighths (zeros: padding).
constexpr int Q8_TABLES = 5;
constexpr int8_t Q8_TABLE[Q8_TABLES][16] = {
    {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113},
    {-43, -25, -8, 8, 25, 43, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0},
    {-62, -52, -44, -36, -28, -20, -12, -4, 4, 12, 20, 28, 36, 44, 52, 62},
    {-15, -13, -11, -9, -7, -5, -3, -1, 1, 3, 5, 7, 9, 11, 13, 15},
    {-9, -7, -1, 1, 7, 9, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0},
};

// A problem's nibble table from its offset.
inline void q8_lut(Q8Problem& t) {
  for (int i = 0; i < 16; ++i) t.lut[i] = t.offset < 0 ? Q8_TABLE[-t.offset - 1][i] : static_cast<int8_t>(i - t.offset);
}

// 8 weights of output o, inputs k .. k + 7 of group gi (scale sv, min mv): q * s - m, or q * s
// without mins (q * s is exact: a small integer times a scale of at most 19 significant bits, so one
// rounding either way); bf16 weights widened. Both paths below take their weights from here.
template <int KIND>
ZT_Q8_TARGET inline __m256 q8_weights8(const Q8Problem& t, int64_t o, int64_t gi, int64_t k, __m256 sv, __m256 mv, bool mins) {
  const int64_t kk = k - gi * t.group;
  if constexpr (KIND == 2) {
    const __m128i h = _mm_loadu_si128(
        reinterpret_cast<const __m128i*>(reinterpret_cast<const uint16_t*>(t.q) + o * t.qo + gi * t.qg + kk));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  } else {
    const int8_t* qg = t.q + o * t.qo + gi * t.qg;
    __m256i v;
    if constexpr (KIND == 1) {
      int32_t four;
      std::memcpy(&four, qg + kk / 2, 4);
      const __m128i b = _mm_cvtsi32_si128(four), low = _mm_set1_epi8(15);
      const __m128i pairs = _mm_unpacklo_epi8(_mm_and_si128(b, low), _mm_and_si128(_mm_srli_epi16(b, 4), low));
      v = _mm256_cvtepi8_epi32(_mm_shuffle_epi8(_mm_load_si128(reinterpret_cast<const __m128i*>(t.lut)), pairs));
    } else {
      v = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(qg + kk)));
    }
    const __m256 f = _mm256_cvtepi32_ps(v);
    return mins ? _mm256_fmsub_ps(f, sv, mv) : _mm256_mul_ps(f, sv);
  }
}

// 16 weights of output o, inputs k .. k + 15 of group gi, from values two a byte (a group of a
// multiple of 16 inputs): split, interleave, each nibble's value (lut), 8 bytes at a time.
ZT_Q8_TARGET inline void q8_weights16(const Q8Problem& t, int64_t o, int64_t gi, int64_t k, __m256 sv, __m256 mv, bool mins, __m256* w) {
  const __m128i low = _mm_set1_epi8(15);
  const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(t.q + o * t.qo + gi * t.qg + (k - gi * t.group) / 2));
  const __m128i pairs = _mm_shuffle_epi8(_mm_load_si128(reinterpret_cast<const __m128i*>(t.lut)),
                                         _mm_unpacklo_epi8(_mm_and_si128(b, low), _mm_and_si128(_mm_srli_epi16(b, 4), low)));
  const __m256 f0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(pairs));
  const __m256 f1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(pairs, 8)));
  w[0] = mins ? _mm256_fmsub_ps(f0, sv, mv) : _mm256_mul_ps(f0, sv);
  w[1] = mins ? _mm256_fmsub_ps(f1, sv, mv) : _mm256_mul_ps(f1, sv);
}

// Output o's scales s and mins m (negated where add_mins) of the slice's groups g0 .. g0 + count - 1;
// e0[i], r0[i]: g0 / per and g0 % per of factor i (s1, s2, m1, m2), the same for every output.
ZT_Q8_TARGET __attribute__((always_inline)) inline void q8_factors(const Q8Problem& t, int64_t o, const int64_t* e0, const int64_t* r0, int64_t count, float* s, float* m) {
  // the mins' sign in their first factor (-1 times a product is its negation, exactly): negated after
  // the scalar products, a vector load of them would wait on their stores
  const float sign = t.add_mins ? -1.0f : 1.0f;
  for (int64_t c = 0; c < count; ++c) {
    s[c] = 1.0f;
    m[c] = sign;
  }
  factor_times(t.s1, o, e0[0], r0[0], count, s);
  factor_times(t.s2, o, e0[1], r0[1], count, s);
  if (t.m1.kind == 0) return;
  factor_times(t.m1, o, e0[2], r0[2], count, m);
  factor_times(t.m2, o, e0[3], r0[3], count, m);
}

// An output's values and its factors' entries fetched ahead of their use (nothing past the last
// output): a decode's row or two reads each output's few hundred bytes once, too few for the loads of
// one output to hide their latency. The fp32-activation kernels' direct paths (q8_direct,
// q8_direct_wide) fetch the output Q8_AHEAD on; the 8-bit-activation one has its own distance (VA_AHEAD).
constexpr int64_t Q8_AHEAD = 8;  // outputs ahead
__attribute__((always_inline)) inline int64_t factor_bytes(const Factor& f) { return f.kind == 1 ? 4 : (f.kind == 3 || f.kind == 4) ? 1 : 2; }  // an entry's
// The bytes of an output's values (0 where they are group-major, GPTQ's: not together, and no output
// is fetched ahead) and of each factor's entries, for q8_prefetch_factors; made once a call (divisions).
inline void q8_ahead_bytes(Q8Problem& t) {
  const int64_t size = t.kind == 2 ? 2 : 1, groups = (t.k + t.group - 1) / t.group;
  t.ahead[0] = t.qg > t.qo ? 0 : ((groups - 1) * t.qg + (t.kind == 1 ? t.group / 2 : t.group)) * size;
  const Factor* fs[4] = {&t.s1, &t.s2, &t.m1, &t.m2};
  for (int i = 0; i < 4; ++i)
    t.ahead[i + 1] = fs[i]->kind == 0 ? 0 : ((groups - 1) / fs[i]->per * fs[i]->sg + 1) * factor_bytes(*fs[i]);
}
// The fetches below are always inlined: the AVX-512 kernels that call them are built for another
// target, which GCC does not inline plain functions into, and a call it cannot inline to a function
// that only prefetches it counts as pure and drops (the one-row 8-bit-activation kernel ran without
// its fetch ahead that way).
__attribute__((always_inline)) inline void q8_prefetch_bytes(const void* at, int64_t bytes) {
  const char* p = static_cast<const char*>(at);
  for (int64_t b = 0; b < bytes; b += 64) _mm_prefetch(p + b, _MM_HINT_T0);
  _mm_prefetch(p + bytes - 1, _MM_HINT_T0);  // the last line, where the bytes do not start one
}
// Output o's factors' entries into L1 (its values are fetched a line at a time as they are reached).
__attribute__((always_inline)) inline void q8_prefetch_factors(const Q8Problem& t, int64_t o) {
  if (o >= t.n || t.ahead[0] == 0) return;  // past the last output, or values not together
  const Factor* fs[4] = {&t.s1, &t.s2, &t.m1, &t.m2};
  for (int i = 0; i < 4; ++i)
    if (t.ahead[i + 1]) q8_prefetch_bytes(static_cast<const char*>(fs[i]->p) + o * fs[i]->so * factor_bytes(*fs[i]), t.ahead[i + 1]);
}

// The one-/two-row paths' fetch of the values ahead, a line at a time: at input kk of group gi (kk a
// multiple of a line's inputs: q8_line_start), output o's line holding it into L1 (values together;
// an o past the last output fetches nothing that faults).
inline bool q8_line_start(int kind, int64_t kk) { return (kk & (kind == 1 ? 127 : kind == 2 ? 31 : 63)) == 0; }
__attribute__((always_inline)) inline void q8_prefetch_value(const Q8Problem& t, int64_t o, int64_t gi, int64_t kk) {
  const int64_t e = o * t.qo + gi * t.qg + (t.kind == 1 ? kk / 2 : kk);
  _mm_prefetch(reinterpret_cast<const char*>(t.q) + e * (t.kind == 2 ? 2 : 1), _MM_HINT_T0);
}

// e0 and r0 of q8_factors for a slice starting at group g0 (computed: q8_linear_many's table of them).
inline void q8_slice(const Q8Problem& t, int64_t g0, int64_t* e0, int64_t* r0) {
  const Factor* fs[4] = {&t.s1, &t.s2, &t.m1, &t.m2};
  for (int i = 0; i < 4; ++i) {
    e0[i] = g0 / fs[i]->per;
    r0[i] = g0 % fs[i]->per;
  }
}

// Outputs o0 .. o0 + outputs - 1 (those below n) of inputs [k0, k1) dequantised into buf (a row of ld
// fp32 per output, the missing outputs' rows zero): w = q * s - m, 8 values at a time (a group holds a
// multiple of 8).
template <int KIND>  // the problem's kind, known when compiling: no branch per 8 values
ZT_Q8_TARGET void q8_dequant(const Q8Problem& t, int64_t o0, int64_t k0, int64_t k1, float* buf,
                             int64_t outputs = QOT, int64_t ld = QKS) {
  const bool mins = t.m1.kind != 0;
  const int64_t g0 = k0 / t.group, count = (k1 - 1) / t.group - g0 + 1;  // the slice's groups
  const int64_t* e0 = t.slices + (k0 / QKS) * 8;
  const int64_t* r0 = e0 + 4;
  float s[QKS / 8], m[QKS / 8];  // per group of the slice (at most 32 groups: a group has 8+ inputs)
  for (int64_t j = 0; j < outputs; ++j) {
    float* row = buf + j * ld;
    const int64_t o = o0 + j;
    if (o >= t.n) {
      for (int64_t k = 0; k < k1 - k0; k += 8) _mm256_store_ps(row + k, _mm256_setzero_ps());
      continue;
    }
    q8_factors(t, o, e0, r0, count, s, m);
    for (int64_t c = 0; c < count; ++c) {
      const int64_t gi = g0 + c, start = std::max(k0, gi * t.group), end = std::min(k1, (gi + 1) * t.group);
      const __m256 sv = _mm256_set1_ps(s[c]), mv = _mm256_set1_ps(m[c]);
      if (KIND == 1 && t.group % 16 == 0) {
        for (int64_t k = start; k < end; k += 16) {
          __m256 w[2];
          q8_weights16(t, o, gi, k, sv, mv, mins, w);
          _mm256_store_ps(row + (k - k0), w[0]);
          _mm256_store_ps(row + (k - k0) + 8, w[1]);
        }
        continue;
      }
      for (int64_t k = start; k < end; k += 8) _mm256_store_ps(row + (k - k0), q8_weights8<KIND>(t, o, gi, k, sv, mv, mins));
    }
  }
}

// MR rows of x (ldx apart, from the slice's first input) times 3 outputs' dequantised rows (QKS apart)
// over len inputs, the 8-lane sums carried in c (QOT x 8 floats per row, the 3 outputs' from c).
template <int MR>
ZT_Q8_TARGET inline void q8_block(const float* x, int64_t ldx, const float* w, int64_t len, float* c, bool first) {
  ZT_Q8_ORDER
  __m256 acc[MR][3];
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < 3; ++j) acc[r][j] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(c + (r * QOT + j) * 8);
  for (int64_t k = 0; k < len; k += 8) {
    const __m256 w0 = _mm256_load_ps(w + k), w1 = _mm256_load_ps(w + QKS + k), w2 = _mm256_load_ps(w + 2 * QKS + k);
    for (int r = 0; r < MR; ++r) {
      const __m256 a = _mm256_loadu_ps(x + r * ldx + k);
      acc[r][0] = _mm256_fmadd_ps(a, w0, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(a, w1, acc[r][1]);
      acc[r][2] = _mm256_fmadd_ps(a, w2, acc[r][2]);
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < 3; ++j) _mm256_storeu_ps(c + (r * QOT + j) * 8, acc[r][j]);
}

ZT_Q8_TARGET void q8_rows(const float* x, int64_t ldx, const float* w, int64_t len, float* c, bool first, int64_t mr) {
  switch (mr) {
    case 4: q8_block<4>(x, ldx, w, len, c, first); break;
    case 3: q8_block<3>(x, ldx, w, len, c, first); break;
    case 2: q8_block<2>(x, ldx, w, len, c, first); break;
    default: q8_block<1>(x, ldx, w, len, c, first); break;
  }
}

// The 8 lanes of v added in a fixed tree: (0+4, 1+5, 2+6, 3+7), then pairs, then the last two.
ZT_Q8_TARGET inline float q8_sum(const float* v) {
  const __m128 a = _mm_add_ps(_mm_loadu_ps(v), _mm_loadu_ps(v + 4));
  const __m128 b = _mm_add_ps(a, _mm_movehl_ps(a, a));
  return _mm_cvtss_f32(_mm_add_ss(b, _mm_shuffle_ps(b, b, 1)));
}

// One or two rows (a decode) times a tile's outputs with the weights dequantised in registers, 4
// outputs at a time: the same weights, the same 8 chains per output in the same order and the same
// final tree as q8_tasks' buffered path, so a row's numbers are the same on either path.
template <int KIND, int MR>
ZT_Q8_TARGET void q8_direct(const Q8Problem& t, int64_t m0, int64_t o0, int64_t width) {
  ZT_Q8_ORDER
  const bool mins = t.m1.kind != 0;
  for (int64_t j0 = 0; j0 < width; j0 += 4) {
    const int jn = static_cast<int>(std::min<int64_t>(4, width - j0));
    // the factors of the outputs Q8_AHEAD on now, their values a line at a time as the same inputs of
    // these outputs are read (q8_direct_wide's way: a burst of every line at once stalls the loads)
    for (int j = 0; j < jn; ++j) q8_prefetch_factors(t, o0 + j0 + j + Q8_AHEAD);
    const bool ahead = t.ahead[0] != 0;
    __m256 acc[MR][4];
    for (int r = 0; r < MR; ++r)
      for (int j = 0; j < 4; ++j) acc[r][j] = _mm256_setzero_ps();
    float s[4][QKS / 8], m[4][QKS / 8];
    for (int64_t k0 = 0; k0 < t.k; k0 += QKS) {
      const int64_t k1 = std::min(t.k, k0 + QKS), g0 = k0 / t.group, count = (k1 - 1) / t.group - g0 + 1;
      const int64_t* e0 = t.slices + (k0 / QKS) * 8;
      const int64_t* r0 = e0 + 4;
      for (int j = 0; j < jn; ++j) q8_factors(t, o0 + j0 + j, e0, r0, count, s[j], m[j]);
      for (int64_t c = 0; c < count; ++c) {
        const int64_t gi = g0 + c, start = std::max(k0, gi * t.group), end = std::min(k1, (gi + 1) * t.group);
        __m256 sv[4], mv[4];
        for (int j = 0; j < jn; ++j) {
          sv[j] = _mm256_set1_ps(s[j][c]);
          mv[j] = _mm256_set1_ps(m[j][c]);
        }
        if (KIND == 1 && t.group % 16 == 0) {
          for (int64_t k = start; k < end; k += 16) {
            if (ahead && q8_line_start(KIND, k - gi * t.group))
              for (int j = 0; j < jn; ++j) q8_prefetch_value(t, o0 + j0 + j + Q8_AHEAD, gi, k - gi * t.group);
            __m256 a[MR][2];
            for (int r = 0; r < MR; ++r) {
              a[r][0] = _mm256_loadu_ps(t.x + (m0 + r) * t.ldx + k);
              a[r][1] = _mm256_loadu_ps(t.x + (m0 + r) * t.ldx + k + 8);
            }
            for (int j = 0; j < jn; ++j) {
              __m256 w[2];
              q8_weights16(t, o0 + j0 + j, gi, k, sv[j], mv[j], mins, w);
              for (int r = 0; r < MR; ++r) acc[r][j] = _mm256_fmadd_ps(a[r][1], w[1], _mm256_fmadd_ps(a[r][0], w[0], acc[r][j]));
            }
          }
          continue;
        }
        for (int64_t k = start; k < end; k += 8) {
          if (ahead && q8_line_start(KIND, k - gi * t.group))
            for (int j = 0; j < jn; ++j) q8_prefetch_value(t, o0 + j0 + j + Q8_AHEAD, gi, k - gi * t.group);
          __m256 a[MR];
          for (int r = 0; r < MR; ++r) a[r] = _mm256_loadu_ps(t.x + (m0 + r) * t.ldx + k);
          for (int j = 0; j < jn; ++j) {
            const __m256 w = q8_weights8<KIND>(t, o0 + j0 + j, gi, k, sv[j], mv[j], mins);
            for (int r = 0; r < MR; ++r) acc[r][j] = _mm256_fmadd_ps(a[r], w, acc[r][j]);
          }
        }
      }
    }
    alignas(32) float lanes[8];
    for (int r = 0; r < MR; ++r)
      for (int j = 0; j < jn; ++j) {
        _mm256_store_ps(lanes, acc[r][j]);
        t.y[(m0 + r) * t.ldy + o0 + j0 + j] = q8_sum(lanes);
      }
  }
}

template <int KIND>
ZT_Q8_TARGET void q8_direct_rows(const Q8Problem& t, int64_t m0, int64_t rows, int64_t o0, int64_t width) {
  if (rows == 2) q8_direct<KIND, 2>(t, m0, o0, width);
  else q8_direct<KIND, 1>(t, m0, o0, width);
}

void q8_direct_wide(const Q8Problem& t, int64_t m0, int64_t rows, int64_t o0, int64_t width);  // linear_wide.cpp

// Tasks [begin, end) of one thread: task = (chunk of rows, tile of outputs), chunk-major.
ZT_Q8_TARGET void q8_tasks(const Q8Problem& t, int64_t begin, int64_t end) {
  alignas(32) float buf[QOT * QKS];
  alignas(32) float c[QMC * QOT * 8];
  for (int64_t task = begin; task < end; ++task) {
    const int64_t tile = task % t.tiles, mc = task / t.tiles;
    const int64_t m0 = mc * t.chunk, m1 = std::min(t.rows, m0 + t.chunk);
    const int64_t o0 = tile * QOT, width = std::min(QOT, t.n - o0);
    // a decode's row or two (up to 8 on AVX-512: q8_direct_wide): no buffer, where an output's values
    // lie together (GGUF, bf16 and 4-bit rows; GPTQ's group-major values, 4 outputs' apart per group,
    // stay on the buffered path)
    if (m1 - m0 <= (t.wide && t.kind != 2 ? 8 : 2) && (t.kind == 2 || t.qo >= t.qg)) {
      if (t.wide && t.kind != 2) q8_direct_wide(t, m0, m1 - m0, o0, width);
      else if (t.kind == 2) q8_direct_rows<2>(t, m0, m1 - m0, o0, width);
      else if (t.kind == 1) q8_direct_rows<1>(t, m0, m1 - m0, o0, width);
      else q8_direct_rows<0>(t, m0, m1 - m0, o0, width);
      continue;
    }
    for (int64_t k0 = 0; k0 < t.k; k0 += QKS) {
      const int64_t k1 = std::min(t.k, k0 + QKS);
      if (t.kind == 2) q8_dequant<2>(t, o0, k0, k1, buf);
      else if (t.kind == 1) q8_dequant<1>(t, o0, k0, k1, buf);
      else q8_dequant<0>(t, o0, k0, k1, buf);
      for (int64_t m = m0; m < m1; m += 4)
        for (int64_t j = 0; j < width; j += 3)
          q8_rows(t.x + m * t.ldx + k0, t.ldx, buf + j * QKS, k1 - k0, c + ((m - m0) * QOT + j) * 8, k0 == 0,
                  std::min<int64_t>(4, m1 - m));
    }
    for (int64_t m = m0; m < m1; ++m)
      for (int64_t j = 0; j < width; ++j) t.y[m * t.ldy + o0 + j] = q8_sum(c + ((m - m0) * QOT + j) * 8);
  }
}

// Every QKS-input slice's q8_slice (e0 then r0), made once a call, not once per output (its divisions).
std::vector<int64_t> q8_slices(const Q8Problem& t) {
  std::vector<int64_t> slices;
  for (int64_t k0 = 0; k0 < t.k; k0 += QKS) {
    int64_t e0[4], r0[4];
    q8_slice(t, k0 / t.group, e0, r0);
    slices.insert(slices.end(), e0, e0 + 4);
    slices.insert(slices.end(), r0, r0 + 4);
  }
  return slices;
}

// Several products of the same rows (q, k and v; gate and up) in one parallel region: problem i's
// tasks (chunks of rows times tiles of outputs, its chunk and tiles set) numbered after those of the
// problems before it, the threads dealt the whole range; run(i, begin, end) runs problem i's tasks
// [begin, end). Each task is what a call for its problem alone runs (an output's arithmetic never
// depends on the others).
template <typename Run>
void q8_deal(const std::vector<Q8Problem>& ts, const Run& run) {
  std::vector<int64_t> first(ts.size() + 1, 0);
  for (size_t i = 0; i < ts.size(); ++i)
    first[i + 1] = first[i] + (ts[i].rows + ts[i].chunk - 1) / ts[i].chunk * ts[i].tiles;
  at::parallel_for(0, first.back(), 1, [&](int64_t begin, int64_t end) {
    for (size_t i = 0; i < ts.size(); ++i) {
      const int64_t lo = std::max(begin, first[i]), hi = std::min(end, first[i + 1]);
      if (lo < hi) run(i, lo - first[i], hi - first[i]);
    }
  });
}

void q8_linear_many(std::vector<Q8Problem>& ts) {
  std::vector<std::vector<int64_t>> slices(ts.size());
  for (size_t i = 0; i < ts.size(); ++i) {
    slices[i] = q8_slices(ts[i]);
    ts[i].slices = slices[i].data();
  }
  q8_deal(ts, [&](size_t i, int64_t lo, int64_t hi) { q8_tasks(ts[i], lo, hi); });
}
#endif
