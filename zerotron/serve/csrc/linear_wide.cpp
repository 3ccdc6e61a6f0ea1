// ---- the fp32-activation kernel's direct path on AVX-512, two outputs a register --------------------
// q8_direct's rows (a decode of one to eight sequences, the default path of a GGUF or int4 model):
// lanes 0-7 of a register carry the first output's 8 chains, lanes 8-15 the second's, each fed the same
// weights (q8_weights8's arithmetic: the values widened, times the scale less the min in one fused
// step) and the same inputs in the same order, and summed by the same tree, so every output has
// q8_direct's bits (and the buffered path's). Blocks of up to 6 outputs on one row, 4 on 2 to 4 rows (P
// pairs, a template argument with the rows, so the loops unroll and the pointers, scales and sums stay
// in registers: 8 outputs a block on one row spilled them, BENCHMARKS.md); each step's weights are
// made once for the block's rows; an odd last output is paired with itself and its copy dropped.
// Int8 values are read 32 inputs of both outputs a pass and split into the four 8-input steps with two
// unpacks (not four 8-byte loads and an interleave a step), 4-bit ones through q8_unpack32; where the
// factors' tables allow, the groups run in order without the QKS-input slices.
#if defined(ZT_Q8)
// q8_sum's tree over 8 lanes (0+4, 1+5, 2+6, 3+7, then pairs, then the last two).
ZT_VNNI_TARGET inline float va_sum8(__m256 v) {
  const __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 b = _mm_add_ps(a, _mm_movehl_ps(a, a));
  return _mm_cvtss_f32(_mm_add_ss(b, _mm_shuffle_ps(b, b, 1)));
}

// 32 inputs of two outputs' 4-bit values (16 bytes each from a and b: input 2i the low half of byte i,
// 2i + 1 the high) through the 16-byte table lut, as four 8-input steps: v[i] holds a's inputs
// 8i .. 8i + 7 then b's.
ZT_VNNI_TARGET __attribute__((always_inline)) inline void q8_unpack32(const int8_t* a, const int8_t* b, __m128i lut,
                                                                      __m128i* v) {
  const __m256i low = _mm256_set1_epi8(15), table = _mm256_broadcastsi128_si256(lut);
  const __m256i both = _mm256_inserti128_si256(
      _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a))),
      _mm_loadu_si128(reinterpret_cast<const __m128i*>(b)), 1);
  const __m256i lo = _mm256_and_si256(both, low), hi = _mm256_and_si256(_mm256_srli_epi16(both, 4), low);
  // each 128-bit lane (a's, b's): inputs 0-15 in `first`, 16-31 in `second`; then the quadwords ordered
  // a 0-7, b 0-7, a 8-15, b 8-15
  const __m256i first = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(table, _mm256_unpacklo_epi8(lo, hi)), 0xD8);
  const __m256i second = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(table, _mm256_unpackhi_epi8(lo, hi)), 0xD8);
  v[0] = _mm256_castsi256_si128(first);
  v[1] = _mm256_extracti128_si256(first, 1);
  v[2] = _mm256_castsi256_si128(second);
  v[3] = _mm256_extracti128_si256(second, 1);
}

// The same four steps from int8 values (32 bytes each from a and b): per 128-bit half, the low
// quadwords of a and b side by side (inputs 0-7, then 16-23) and the high ones (8-15, then 24-31).
ZT_VNNI_TARGET __attribute__((always_inline)) inline void wide_unpack32(const int8_t* a, const int8_t* b, __m128i* v) {
  const __m256i va = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a));
  const __m256i vb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b));
  const __m256i lo = _mm256_unpacklo_epi64(va, vb), hi = _mm256_unpackhi_epi64(va, vb);
  v[0] = _mm256_castsi256_si128(lo);
  v[1] = _mm256_castsi256_si128(hi);
  v[2] = _mm256_extracti128_si256(lo, 1);
  v[3] = _mm256_extracti128_si256(hi, 1);
}

// One 8-input step of two outputs: inputs kk .. kk + 7 of their groups' values a and b, a's then b's.
template <int KIND>
ZT_VNNI_TARGET __attribute__((always_inline)) inline __m128i wide_unpack8(const int8_t* a, const int8_t* b, int64_t kk,
                                                                          __m128i lut) {
  if constexpr (KIND == 1) {  // 4 bytes an output: input 2i the low half of byte i, 2i + 1 the high
    const __m128i low = _mm_set1_epi8(15);
    int32_t fa, fb;
    std::memcpy(&fa, a + kk / 2, 4);
    std::memcpy(&fb, b + kk / 2, 4);
    const __m128i ba = _mm_cvtsi32_si128(fa), bb = _mm_cvtsi32_si128(fb);
    const __m128i pa = _mm_unpacklo_epi8(_mm_and_si128(ba, low), _mm_and_si128(_mm_srli_epi16(ba, 4), low));
    const __m128i pb = _mm_unpacklo_epi8(_mm_and_si128(bb, low), _mm_and_si128(_mm_srli_epi16(bb, 4), low));
    return _mm_shuffle_epi8(lut, _mm_unpacklo_epi64(pa, pb));
  } else {
    return _mm_unpacklo_epi64(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(a + kk)),
                              _mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + kk)));
  }
}

// A step's 16 weights from its values: widened, times the scale, less the min (one fused step).
template <bool MINS>
ZT_VNNI_TARGET __attribute__((always_inline)) inline __m512 wide_weights(__m128i v, __m512 s, __m512 m) {
  const __m512 f = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(v));
  return MINS ? _mm512_fmsub_ps(f, s, m) : _mm512_mul_ps(f, s);
}

// Inputs 0 .. len - 1 of a group (x its inputs in row 0, ldx apart for the MR rows, q[j] lane half j's
// values there, sv and mv the pairs' scales and mins) into the sums (row r's of pair p at acc[r * P +
// p]): 32 inputs a pass, each pair's values unpacked for the four 8-input steps at once and each step's
// weights made once for the MR rows; the last inputs (fewer than 32) one step at a time.
template <int KIND, int P, bool MINS, int MR>
ZT_VNNI_TARGET __attribute__((always_inline)) inline void wide_group(const float* x, int64_t ldx,
                                                                     const int8_t* const* q, int64_t len,
                                                                     const __m512* sv, const __m512* mv, __m128i lut,
                                                                     __m512* acc) {
  int64_t k = 0;
  for (; k + 32 <= len; k += 32) {
    const int64_t at = KIND == 1 ? k / 2 : k;
    __m512 a[MR][4];
#pragma GCC unroll 4
    for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
      for (int i = 0; i < 4; ++i) a[r][i] = _mm512_broadcast_f32x8(_mm256_loadu_ps(x + r * ldx + k + 8 * i));
#pragma GCC unroll 4
    for (int p = 0; p < P; ++p) {
      __m128i v[4];
      if constexpr (KIND == 1) q8_unpack32(q[2 * p] + at, q[2 * p + 1] + at, lut, v);
      else wide_unpack32(q[2 * p] + at, q[2 * p + 1] + at, v);
#pragma GCC unroll 4
      for (int i = 0; i < 4; ++i) {
        const __m512 w = wide_weights<MINS>(v[i], sv[p], mv[p]);
#pragma GCC unroll 4
        for (int r = 0; r < MR; ++r) acc[r * P + p] = _mm512_fmadd_ps(a[r][i], w, acc[r * P + p]);
      }
    }
  }
  for (; k < len; k += 8) {
    __m512 a[MR];
#pragma GCC unroll 4
    for (int r = 0; r < MR; ++r) a[r] = _mm512_broadcast_f32x8(_mm256_loadu_ps(x + r * ldx + k));
#pragma GCC unroll 4
    for (int p = 0; p < P; ++p) {
      const __m512 w = wide_weights<MINS>(wide_unpack8<KIND>(q[2 * p], q[2 * p + 1], k, lut), sv[p], mv[p]);
#pragma GCC unroll 4
      for (int r = 0; r < MR; ++r) acc[r * P + p] = _mm512_fmadd_ps(a[r], w, acc[r * P + p]);
    }
  }
}

// Group gi's inputs [k0, k1) (within it) of outputs o .. o + jn - 1 of rows m0 .. m0 + MR - 1 (values
// q[j], lane half j's), the pairs' scales and mins read from s and m (lane half j's at s[j][c]); at its
// start, its lines of the values of the outputs Q8_AHEAD on fetched (a burst of every line at once
// stalls the loads behind it).
template <int KIND, int P, bool MINS, int MR>
ZT_VNNI_TARGET __attribute__((always_inline)) inline void wide_run(const Q8Problem& t, int64_t m0, int64_t o, int jn,
                                                                   int64_t gi, int64_t k0, int64_t k1,
                                                                   const float* const* s, const float* const* m,
                                                                   int64_t c, const int8_t* const* q, __m512* acc) {
  __m512 sv[P], mv[P];
#pragma GCC unroll 4
  for (int p = 0; p < P; ++p) {
    sv[p] = _mm512_insertf32x8(_mm512_set1_ps(s[2 * p][c]), _mm256_set1_ps(s[2 * p + 1][c]), 1);
    mv[p] = MINS ? _mm512_insertf32x8(_mm512_set1_ps(m[2 * p][c]), _mm256_set1_ps(m[2 * p + 1][c]), 1) : sv[p];
  }
  constexpr int64_t line = KIND == 1 ? 127 : 63;  // the inputs of a line of values
  if (t.ahead[0] != 0)
    for (int64_t kk = (k0 + line) & ~line; kk < k1; kk += line + 1)
      for (int j = 0; j < jn; ++j) q8_prefetch_value(t, o + j + Q8_AHEAD, gi, kk);
  const int8_t* qg[2 * P];
  for (int j = 0; j < 2 * P; ++j) qg[j] = q[j] + gi * t.qg + (KIND == 1 ? k0 / 2 : k0);
  const __m128i lut = _mm_load_si128(reinterpret_cast<const __m128i*>(t.lut));
  wide_group<KIND, P, MINS, MR>(t.x + m0 * t.ldx + gi * t.group + k0, t.ldx, qg, k1 - k0, sv, mv, lut, acc);
}

// Outputs o .. o + jn - 1 (2P - 1 or 2P of them) of rows m0 .. m0 + MR - 1. The factors of the outputs
// Q8_AHEAD on are fetched now, and at each group's start its lines of those outputs' values (a burst of
// every line at once stalls the loads behind it). Where the factors' tables allow (va_per_group), the
// block's scales and mins of every group are made at once (`every`: 16 groups a step) and the groups
// run in order; else slice by slice (QKS inputs), each slice's through q8_factors. Either way each
// output's inputs run in k order, the same for every row.
template <int KIND, int P, bool MINS, int MR>
ZT_VNNI_TARGET void wide_block(const Q8Problem& t, int64_t m0, int64_t o, int jn, bool per_group,
                               std::vector<float>& every) {
  for (int j = 0; j < jn; ++j) q8_prefetch_factors(t, o + j + Q8_AHEAD);
  const int64_t groups = t.k / t.group;
  const int8_t* q[2 * P];  // each lane half's output's values (an odd last output twice)
  for (int j = 0; j < 2 * P; ++j) q[j] = t.q + (o + std::min(j, jn - 1)) * t.qo;
  __m512 acc[MR * P];
#pragma GCC unroll 8
  for (int i = 0; i < MR * P; ++i) acc[i] = _mm512_setzero_ps();
  const float* sj[2 * P];
  const float* mj[2 * P];
  if (per_group) {
    every.resize(static_cast<size_t>(4 * P * groups));
    va_outputs_factors(t, o, jn, groups, every.data(), every.data() + 2 * P * groups, groups);
    for (int j = 0; j < 2 * P; ++j) {
      sj[j] = every.data() + std::min(j, jn - 1) * groups;
      mj[j] = every.data() + (2 * P + std::min(j, jn - 1)) * groups;
    }
    for (int64_t gi = 0; gi < groups; ++gi)
      wide_run<KIND, P, MINS, MR>(t, m0, o, jn, gi, 0, t.group, sj, mj, gi, q, acc);
  } else {
    float s[2 * P][QKS / 8], m[2 * P][QKS / 8];
    for (int j = 0; j < 2 * P; ++j) {
      sj[j] = s[std::min(j, jn - 1)];
      mj[j] = m[std::min(j, jn - 1)];
    }
    for (int64_t k0 = 0; k0 < t.k; k0 += QKS) {
      const int64_t k1 = std::min(t.k, k0 + QKS), g0 = k0 / t.group, count = (k1 - 1) / t.group - g0 + 1;
      for (int j = 0; j < jn; ++j)
        q8_factors(t, o + j, t.slices + (k0 / QKS) * 8, t.slices + (k0 / QKS) * 8 + 4, count, s[j], m[j]);
      for (int64_t c = 0; c < count; ++c) {
        const int64_t gi = g0 + c;
        wide_run<KIND, P, MINS, MR>(t, m0, o, jn, gi, std::max(k0, gi * t.group) - gi * t.group,
                                    std::min(k1, (gi + 1) * t.group) - gi * t.group, sj, mj, c, q, acc);
      }
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int p = 0; p < P; ++p) {
      float* y = t.y + (m0 + r) * t.ldy + o + 2 * p;
      y[0] = va_sum8(_mm512_castps512_ps256(acc[r * P + p]));
      if (2 * p + 1 < jn) y[1] = va_sum8(_mm512_extractf32x8_ps(acc[r * P + p], 1));
    }
}

// A block's pairs of outputs for MR rows (the registers of sums: with more rows, fewer pairs; 8 outputs
// a block on one row spilled them).
constexpr int wide_pairs(int mr) { return mr == 1 ? 3 : 2; }
using WideBlock = void (*)(const Q8Problem&, int64_t, int64_t, int, bool, std::vector<float>&);
// wide_block's instantiations for MR rows: [pairs - 1].
template <int KIND, bool MINS, int MR, int... Ps>
constexpr WideBlock wide_set[sizeof...(Ps)] = {wide_block<KIND, Ps, MINS, MR>...};
template <int KIND, bool MINS>
const WideBlock* wide_blocks(int64_t rows) {
  if (rows == 1) return wide_set<KIND, MINS, 1, 1, 2, 3>;  // (pairs 1 and 2: a last row of a block of 4)
  if (rows == 2) return wide_set<KIND, MINS, 2, 1, 2>;
  return rows == 3 ? wide_set<KIND, MINS, 3, 1, 2> : wide_set<KIND, MINS, 4, 1, 2>;
}

// Rows m0 .. m0 + rows - 1 (1 to 8) times outputs o0 .. o0 + width - 1: each block of outputs for the
// rows 4 at a time (its values read again from L1 for the next 4).
void q8_direct_wide(const Q8Problem& t, int64_t m0, int64_t rows, int64_t o0, int64_t width) {
  const bool mins = t.m1.kind != 0;
  const bool per_group = va_per_group(t.s1) && va_per_group(t.s2) && va_per_group(t.m1) && va_per_group(t.m2);
  const WideBlock* blocks[5];
  for (int64_t mr = 1; mr <= 4; ++mr)
    blocks[mr] = t.kind == 1 ? (mins ? wide_blocks<1, true>(mr) : wide_blocks<1, false>(mr))
                             : (mins ? wide_blocks<0, true>(mr) : wide_blocks<0, false>(mr));
  const int step = 2 * wide_pairs(static_cast<int>(std::min<int64_t>(4, rows)));
  thread_local std::vector<float> every;
  for (int64_t j0 = 0; j0 < width; j0 += step) {
    const int jn = static_cast<int>(std::min<int64_t>(step, width - j0));
    for (int64_t r = m0; r < m0 + rows; r += 4)
      blocks[std::min<int64_t>(4, m0 + rows - r)][(jn + 1) / 2 - 1](t, r, o0 + j0, jn, per_group, every);
  }
}
#endif
