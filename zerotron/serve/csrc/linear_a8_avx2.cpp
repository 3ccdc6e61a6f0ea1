// ---- 8- and 4-bit weights times 8-bit activations, on AVX2 -------------------------------------------
// The AVX512-VNNI kernel's products (linear_vnni.cpp) on a CPU with AVX2, FMA and F16C but no
// AVX512-VNNI (AMD Zen 1-3, Intel client cores): the same rows quantised (va2_quantize gives the same
// xq, scales and sums as va_quantize), the same integer lane sums, the same fp32 arithmetic in the same
// order, so the same bits. A 512-bit lane's sum is held as two 256-bit halves (lanes 0-7, 8-15); each
// lane's exact integer sum of xq times the values comes from VPMADDUBSW and VPMADDWD, with no
// saturation: 4-bit values (0..15) times |xq| <= 127 pair to at most 3,810 (and the low and high halves'
// pairs to 7,620); an int8 value q and a table's entry go in as |q| against xq carrying q's sign
// (pairs of at most 2 * 128 * 127 = 32,512), so the sum is sum q * xq itself and the VNNI kernel's
// start from -128 times the inputs' sum (its values go in as q + 128) is left out. Each lane's fp32
// chain (a fused multiply-add of its integer sum times its scale times the block's scale, chunk by
// chunk) and the final tree (_mm512_reduce_add_ps's: the halves added lane-wise, then 128-bit halves,
// then pairs) are the VNNI kernel's. Built for a CPU with AVX-VNNI (its 256-bit VPDPBUSD), the lanes'
// sums take it in place of the two instructions (va2_sums).
#if defined(ZT_Q8)
std::atomic<bool> g_va_avx2{false};  // the AVX2 products on an AVX512-VNNI CPU too (tests, benchmarks)

// A block of 32 inputs' int32 values as int8 with saturation, in order (VPACKSSDW and VPACKSSWB
// interleave 128-bit lanes; the permutation puts them back): _mm512_cvtsepi32_epi8's values.
ZT_Q8_TARGET __attribute__((always_inline)) inline __m256i va2_pack(__m256i a, __m256i b, __m256i c, __m256i d) {
  const __m256i ab = _mm256_packs_epi32(a, b), cd = _mm256_packs_epi32(c, d);
  return _mm256_permutevar8x32_epi32(_mm256_packs_epi16(ab, cd), _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

// Row r of t.x quantised into v: va_quantize's numbers (the maximum is exact in any order; the
// division, rounding to nearest even and saturation are the same operations).
ZT_Q8_TARGET void va2_quantize(const Q8Problem& t, VnniRows& v, int64_t r, bool mins) {
  const float* x = t.x + r * t.ldx;
  std::vector<int8_t> scratch(t.kind == 1 ? static_cast<size_t>(v.kp) : 0, 0);
  int8_t* plain = t.kind == 1 ? scratch.data() : v.xq.data() + r * v.kp;
  std::vector<float> d(static_cast<size_t>(v.kp / 32), 0.0f);
  const __m256 abs = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  for (int64_t b = 0; b * 32 < t.k; ++b) {
    alignas(32) float block[32] = {};
    const float* from = x + b * 32;
    if (t.k - b * 32 < 32) {  // the last inputs, zeros after them
      std::memcpy(block, from, static_cast<size_t>(t.k - b * 32) * sizeof(float));
      from = block;
    }
    __m256 a[4], top = _mm256_setzero_ps();
    for (int i = 0; i < 4; ++i) {
      a[i] = _mm256_loadu_ps(from + 8 * i);
      top = _mm256_max_ps(top, _mm256_and_ps(a[i], abs));
    }
    alignas(32) float tops[8];
    _mm256_store_ps(tops, top);
    const float amax = *std::max_element(tops, tops + 8);
    const float db = amax / 127.0f;
    d[b] = db;
    if (db == 0.0f) continue;  // zeros already
    const __m256 dv = _mm256_set1_ps(db);
    __m256i q[4];
    for (int i = 0; i < 4; ++i) q[i] = _mm256_cvtps_epi32(_mm256_div_ps(a[i], dv));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(plain + b * 32), va2_pack(q[0], q[1], q[2], q[3]));
  }
  va_rows_finish(t, v, r, plain, d.data(), mins);
}

// A factor's table read 8 groups at a time (va2_entries), made once a call: its entries' bytes and
// an output's, and how they spread over groups (an entry a group, or one per 8 or more).
struct Va2Table {
  const char* p = nullptr;
  int64_t row = 0, size = 0, per = 1;
  bool spread = false;  // one entry per 8 or more groups (a power of two of them)
};
inline Va2Table va2_table(const Factor& f) {
  Va2Table v;
  v.p = static_cast<const char*>(f.p);
  v.size = f.kind == 0 ? 0 : factor_bytes(f);
  v.row = f.so * v.size;
  v.per = f.per;
  v.spread = f.per >= 8 && (f.per & (f.per - 1)) == 0;
  return v;
}
// Whether va2_entries reads a factor's table (else factor_entry, entry by entry).
inline bool va2_reads(const Factor& f) {
  return f.kind == 0 || (f.sg == 1 && (f.per == 1 || (f.per >= 8 && (f.per & (f.per - 1)) == 0)));
}

// 8 groups' entries of a table of kind KIND from group g of output o (g + 8 <= groups), as fp32:
// factor_entry's values, read as they lie (an entry a group) or one entry spread.
template <int KIND>
ZT_Q8_TARGET __attribute__((always_inline)) inline __m256 va2_entries(const Va2Table& f, int64_t o, int64_t g) {
  if constexpr (KIND == 0) return _mm256_set1_ps(1.0f);
  const char* p = f.p + o * f.row + (f.spread ? g / f.per : g) * f.size;
  if (f.spread) {
    if constexpr (KIND == 1) return _mm256_set1_ps(*reinterpret_cast<const float*>(p));
    else if constexpr (KIND == 2) return _mm256_set1_ps(_cvtsh_ss(*reinterpret_cast<const uint16_t*>(p)));
    else if constexpr (KIND == 3) return _mm256_set1_ps(static_cast<float>(*reinterpret_cast<const int8_t*>(p)));
    else if constexpr (KIND == 4) return _mm256_set1_ps(static_cast<float>(*reinterpret_cast<const uint8_t*>(p)));
    else return _mm256_set1_ps(bf16_float(*reinterpret_cast<const uint16_t*>(p)));
  }
  if constexpr (KIND == 1) return _mm256_loadu_ps(reinterpret_cast<const float*>(p));
  else if constexpr (KIND == 2) return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  else if constexpr (KIND == 3) return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  else if constexpr (KIND == 4) return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  else
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}

// Output o's scale and min (where it has mins) of group g into *s and *m, entry by entry
// (factor_entry): the same products as 8 groups at a time.
ZT_Q8_TARGET __attribute__((always_inline)) inline void va2_group_factors(const Q8Problem& t, int64_t o, int64_t g, float* s, float* m) {
  float e = factor_entry(t.s1, o * t.s1.so + (g / t.s1.per) * t.s1.sg);
  if (t.s2.kind != 0) e *= factor_entry(t.s2, o * t.s2.so + (g / t.s2.per) * t.s2.sg);
  *s = e;
  if (t.m1.kind == 0) return;
  float n = factor_entry(t.m1, o * t.m1.so + (g / t.m1.per) * t.m1.sg);
  if (t.m2.kind != 0) n *= factor_entry(t.m2, o * t.m2.so + (g / t.m2.per) * t.m2.sg);
  *m = t.add_mins ? -n : n;
}

// Outputs o .. o + count - 1's scales (s1 · s2) and mins (m1 · m2, negated where added; untouched
// without mins) of every group, output j's at s + j * stride and m + j * stride: va_factor's and
// va_outputs_factors' products, so their bits, the tables' kinds template arguments. The groups past
// the last whole 8 (and every group of a table va2_entries does not read) entry by entry.
template <int S1, int S2, int M1, int M2>
ZT_Q8_TARGET void va2_outputs_kinds(const Q8Problem& t, int64_t o, int64_t count, int64_t groups, float* s, float* m,
                                    int64_t stride) {
  const Va2Table f[4] = {va2_table(t.s1), va2_table(t.s2), va2_table(t.m1), va2_table(t.m2)};
  const __m256 sign = _mm256_castsi256_ps(_mm256_set1_epi32(t.add_mins ? INT32_MIN : 0));
  const bool reads = va2_reads(t.s1) && va2_reads(t.s2) && va2_reads(t.m1) && va2_reads(t.m2);
  const int64_t whole = reads ? groups / 8 * 8 : 0;
  for (int64_t j = 0; j < count; ++j) {
    float* sj = s + j * stride;
    float* mj = m + j * stride;
    for (int64_t g = 0; g < whole; g += 8) {
      __m256 e = va2_entries<S1>(f[0], o + j, g);
      if constexpr (S2 != 0) e = _mm256_mul_ps(e, va2_entries<S2>(f[1], o + j, g));
      _mm256_storeu_ps(sj + g, e);
      if constexpr (M1 != 0) {
        __m256 n = va2_entries<M1>(f[2], o + j, g);
        if constexpr (M2 != 0) n = _mm256_mul_ps(n, va2_entries<M2>(f[3], o + j, g));
        _mm256_storeu_ps(mj + g, _mm256_xor_ps(n, sign));
      }
    }
    for (int64_t g = whole; g < groups; ++g) va2_group_factors(t, o + j, g, sj + g, mj + g);
  }
}

// va2_outputs_kinds for the problem's tables: the kinds the loaders give (va_outputs_factors' list)
// as template arguments, any other through a kind read entry by entry.
ZT_Q8_TARGET void va2_factors(const Q8Problem& t, int64_t o, int64_t count, int64_t groups, float* s, float* m,
                              int64_t stride) {
  switch (t.s1.kind | t.s2.kind << 4 | t.m1.kind << 8 | t.m2.kind << 12) {
    case 0x0001: return va2_outputs_kinds<1, 0, 0, 0>(t, o, count, groups, s, m, stride);
    case 0x0002: return va2_outputs_kinds<2, 0, 0, 0>(t, o, count, groups, s, m, stride);
    case 0x0005: return va2_outputs_kinds<5, 0, 0, 0>(t, o, count, groups, s, m, stride);
    case 0x0101: return va2_outputs_kinds<1, 0, 1, 0>(t, o, count, groups, s, m, stride);
    case 0x0202: return va2_outputs_kinds<2, 0, 2, 0>(t, o, count, groups, s, m, stride);
    case 0x0505: return va2_outputs_kinds<5, 0, 5, 0>(t, o, count, groups, s, m, stride);
    case 0x0032: return va2_outputs_kinds<2, 3, 0, 0>(t, o, count, groups, s, m, stride);
    case 0x0031: return va2_outputs_kinds<1, 3, 0, 0>(t, o, count, groups, s, m, stride);
    case 0x0042: return va2_outputs_kinds<2, 4, 0, 0>(t, o, count, groups, s, m, stride);
    case 0x4242: return va2_outputs_kinds<2, 4, 2, 4>(t, o, count, groups, s, m, stride);
    default:  // other kinds: entry by entry
      for (int64_t j = 0; j < count; ++j)
        for (int64_t g = 0; g < groups; ++g) va2_group_factors(t, o + j, g, s + j * stride + g, m + j * stride + g);
  }
}

// 16 lanes (lo: 0-7, hi: 8-15) added as _mm512_reduce_add_ps adds them.
ZT_Q8_TARGET __attribute__((always_inline)) inline float va2_reduce(__m256 lo, __m256 hi) {
  const __m256 t3 = _mm256_add_ps(hi, lo);
  const __m128 t6 = _mm_add_ps(_mm256_extractf128_ps(t3, 1), _mm256_castps256_ps128(t3));
  const __m128 t8 = _mm_add_ps(t6, _mm_shuffle_ps(t6, t6, _MM_SHUFFLE(1, 0, 3, 2)));
  return _mm_cvtss_f32(_mm_add_ss(t8, _mm_shuffle_ps(t8, t8, _MM_SHUFFLE(1, 1, 1, 1))));
}

// va_finish: an output's sum from its lanes, less its mins mj (none: nullptr) times row r's groups' sums.
ZT_Q8_TARGET __attribute__((always_inline)) inline float va2_finish(const VnniRows& v, int64_t r, const VaChunks& ch,
                                                                   __m256 lo, __m256 hi, const float* mj) {
  const float y = va2_reduce(lo, hi);
  if (mj == nullptr) return y;
  const float* xs = v.xs.data() + r * ch.groups;
  __m256 m0 = _mm256_setzero_ps(), m1 = _mm256_setzero_ps();
  int64_t g = 0;
  for (; g + 16 <= ch.groups; g += 16) {
    m0 = _mm256_fmadd_ps(_mm256_loadu_ps(mj + g), _mm256_loadu_ps(xs + g), m0);
    m1 = _mm256_fmadd_ps(_mm256_loadu_ps(mj + g + 8), _mm256_loadu_ps(xs + g + 8), m1);
  }
  if (g < ch.groups) {  // the last groups, zeros after them (masked loads: no copy to stall on)
    const __m256i iota = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const int left = static_cast<int>(ch.groups - g);
    const __m256i k0 = _mm256_cmpgt_epi32(_mm256_set1_epi32(left), iota);
    const __m256i k1 = _mm256_cmpgt_epi32(_mm256_set1_epi32(left - 8), iota);
    m0 = _mm256_fmadd_ps(_mm256_maskload_ps(mj + g, k0), _mm256_maskload_ps(xs + g, k0), m0);
    m1 = _mm256_fmadd_ps(_mm256_maskload_ps(mj + g + 8, k1), _mm256_maskload_ps(xs + g + 8, k1), m1);
  }
  return y - va2_reduce(m0, m1);
}

// A chunk's lane scales (half h: lanes 8h .. 8h + 7) from the 16 group scales at sg, lane l taking
// entry idx[l] (va_output's permutation; wide: some idx >= 8).
ZT_Q8_TARGET __attribute__((always_inline)) inline __m256 va2_scales(const float* sg, __m256i idx, bool wide) {
  const __m256 low = _mm256_permutevar8x32_ps(_mm256_loadu_ps(sg), idx);
  if (!wide) return low;
  const __m256 high = _mm256_permutevar8x32_ps(_mm256_loadu_ps(sg + 8), idx);
  return _mm256_blendv_ps(low, high, _mm256_castsi256_ps(_mm256_cmpgt_epi32(idx, _mm256_set1_epi32(7))));
}

// One half's exact integer lane sums, by the values' mode: 0 int8 values q (lo), 1 nibbles less an
// offset (lo, hi: the low and high nibbles; from corr), 2 nibbles of offset 0 (corr is 0: left out),
// 3 a table's entries (lo, hi), against the quantised inputs x0 (and x1, the odd inputs). Where the
// build's CPU has AVX-VNNI (the VEX-encoded 256-bit VPDPBUSD of Intel client cores since Alder Lake, and
// of AVX-512 CPUs since Sapphire Rapids and Zen 5) a lane's four byte products are summed into its int32
// by one instruction, as in the VNNI kernel: int8 values and a table's entries go in as value + 128
// from corr (-128 times the lane's inputs' sum), so the sum is the same exact sum of values times
// inputs (no saturation in either), and the bits are the same.
#if defined(__AVXVNNI__)
constexpr bool kVa2Lifted = true;  // modes 0 and 3 start from corr
#else
constexpr bool kVa2Lifted = false;
#endif
template <int MODE>
ZT_Q8_TARGET __attribute__((always_inline)) inline __m256i va2_sums(__m256i lo, __m256i hi, __m256i x0, __m256i x1, __m256i corr) {
#if defined(__AVXVNNI__)
  const __m256i lift = _mm256_set1_epi8(static_cast<char>(0x80));  // q + 128 as an unsigned byte
  if constexpr (MODE == 0) return _mm256_dpbusd_avx_epi32(corr, _mm256_xor_si256(lo, lift), x0);
  if constexpr (MODE == 3) {
    lo = _mm256_xor_si256(lo, lift);
    hi = _mm256_xor_si256(hi, lift);
  }
  return _mm256_dpbusd_avx_epi32(_mm256_dpbusd_avx_epi32(corr, lo, x0), hi, x1);  // nibbles: from corr (0: none)
#else
  const __m256i ones = _mm256_set1_epi16(1);
  if constexpr (MODE == 1 || MODE == 2) {  // nibbles: the two halves' pairs fit int16 together
    const __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(lo, x0), _mm256_maddubs_epi16(hi, x1));
    return MODE == 1 ? _mm256_add_epi32(corr, _mm256_madd_epi16(p, ones)) : _mm256_madd_epi16(p, ones);
  } else {  // |w| against x with w's sign: the sum of w * x (corr, for values + 128, left out)
    __m256i a = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(lo), _mm256_sign_epi8(x0, lo)), ones);
    if constexpr (MODE == 3)
      a = _mm256_add_epi32(a, _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(hi), _mm256_sign_epi8(x1, hi)), ones));
    return a;
  }
#endif
}

// Chunk c of rows m0 .. m0 + MR - 1 times outputs o .. o + NO - 1 (their values at base), into acc.
// PART: the last chunk, whose bytes end within K (zeros after them): read by masked loads of whole
// words (a copy read back at once stalls on its stores) or, where K's bytes end within a word, copied;
// a template argument, so the whole chunks' loop has no test of it.
template <int MODE, int MR, int NO, bool AHEAD, bool PART>
ZT_Q8_TARGET __attribute__((always_inline)) inline void va2_chunk(const Q8Problem& t, const VnniRows& v, int64_t m0, int64_t c,
                                                                  const int8_t* const (&base)[NO], const int8_t* const (&ahead)[NO],
                                                                  const float* s, const VaChunks& ch, const __m256i (&idx)[2],
                                                                  const bool (&wide)[2], int64_t ls, __m256 (&acc)[MR][NO][2]) {
  constexpr int KIND = MODE == 0 ? 0 : 1;
  constexpr int64_t width = KIND == 1 ? 128 : 64;  // a chunk's inputs
  const __m256i low = _mm256_set1_epi8(15);
  const __m256i lut = _mm256_broadcastsi128_si256(_mm_load_si128(reinterpret_cast<const __m128i*>(t.lut)));
  const int64_t tail = (t.k >> (KIND == 1 ? 1 : 0)) % 64;
  const bool copy = PART && tail % 4 != 0;
  const int8_t* p[NO];
  alignas(32) int8_t last[NO][64];
  for (int j = 0; j < NO; ++j) {
    p[j] = base[j] + ch.at[c];
    if constexpr (AHEAD) _mm_prefetch(reinterpret_cast<const char*>(ahead[j] + ch.at[c]), _MM_HINT_T1);
    if (copy) {
      std::memset(last[j], 0, 64);
      std::memcpy(last[j], p[j], static_cast<size_t>(tail));
      p[j] = last[j];
    }
  }
#pragma GCC unroll 2
  for (int h = 0; h < 2; ++h) {  // lanes 8h .. 8h + 7: each output's values and scales, then the rows
    __m256i lo[NO], hi[NO];  // int8 values, or the low and high nibbles (a table's entries)
    __m256 sl[NO];
#pragma GCC unroll 2
    for (int j = 0; j < NO; ++j) {
      const __m256i* at = reinterpret_cast<const __m256i*>(p[j] + 32 * h);
      __m256i b;
      if constexpr (PART) {
        const __m256i keep = _mm256_cmpgt_epi32(_mm256_set1_epi32(copy ? 8 : static_cast<int>(tail / 4 - 8 * h)),
                                                _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
        b = _mm256_maskload_epi32(reinterpret_cast<const int*>(at), keep);
      } else {
        b = _mm256_loadu_si256(at);
      }
      lo[j] = hi[j] = b;
      if constexpr (KIND == 1) {
        lo[j] = _mm256_and_si256(b, low);
        hi[j] = _mm256_and_si256(_mm256_srli_epi16(b, 4), low);
        if constexpr (MODE == 3) {
          lo[j] = _mm256_shuffle_epi8(lut, lo[j]);
          hi[j] = _mm256_shuffle_epi8(lut, hi[j]);
        }
      }
      sl[j] = va2_scales(s + j * ls + ch.group[c], idx[h], wide[h]);
    }
#pragma GCC unroll 4
    for (int r = 0; r < MR; ++r) {
      const int64_t row = m0 + r, lane = row * v.lanes + c * 16 + 8 * h;
      const int8_t* xq = v.xq.data() + row * v.kp + c * width + 32 * h;
      const __m256i corr =
          MODE == 1 || (kVa2Lifted && MODE != 2) ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v.corr.data() + lane))
                                                 : _mm256_setzero_si256();
      const __m256 dl = _mm256_loadu_ps(v.dl.data() + lane);
      const __m256i x0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq));
      const __m256i x1 = KIND == 1 ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + 64)) : x0;
#pragma GCC unroll 2
      for (int j = 0; j < NO; ++j) {
        const __m256i a = va2_sums<MODE>(lo[j], hi[j], x0, x1, corr);
        acc[r][j][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a), _mm256_mul_ps(sl[j], dl), acc[r][j][h]);
      }
    }
  }
}

// Rows m0 .. m0 + MR - 1 times outputs o .. o + NO - 1 (va_block's product, by halves): s and m are
// output o's group scales and mins (output o + j's ls floats on), idx the lanes' permutation of a
// chunk's group scales (the chunk's bytes lie together and hold whole groups, or a group whole
// chunks). AHEAD: the outputs VA_AHEAD on fetched a line a chunk (a decode).
template <int MODE, int MR, int NO, bool AHEAD>
ZT_Q8_TARGET void va2_block(const Q8Problem& t, const VnniRows& v, int64_t m0, int64_t o, const float* s, const float* m,
                            const VaChunks& ch, const __m256i (&idx)[2], const bool (&wide)[2], int64_t ls) {
  const int8_t *base[NO], *ahead[NO] = {};
  for (int j = 0; j < NO; ++j) {
    base[j] = t.q + (o + j) * t.qo;
    if constexpr (AHEAD) ahead[j] = o + j + VA_AHEAD < t.n ? base[j] + VA_AHEAD * t.qo : base[j];
    if constexpr (AHEAD) q8_prefetch_factors(t, o + j + VA_AHEAD);
  }
  __m256 acc[MR][NO][2];
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NO; ++j) acc[r][j][0] = acc[r][j][1] = _mm256_setzero_ps();
  int64_t c = 0;
  for (; c < ch.full; ++c) va2_chunk<MODE, MR, NO, AHEAD, false>(t, v, m0, c, base, ahead, s, ch, idx, wide, ls, acc);
  for (; c < ch.chunks; ++c) va2_chunk<MODE, MR, NO, AHEAD, true>(t, v, m0, c, base, ahead, s, ch, idx, wide, ls, acc);
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NO; ++j)
      t.y[(m0 + r) * t.ldy + o + j] =
          va2_finish(v, m0 + r, ch, acc[r][j][0], acc[r][j][1], m == nullptr ? nullptr : m + j * ls);
}

// One row times output o where a chunk's bytes do not lie together or hold whole groups: the bytes
// gathered (va_gather_bytes), each lane's scale its group's (ch.lane_group), va_output's arithmetic.
template <int MODE>
ZT_Q8_TARGET void va2_any(const Q8Problem& t, const VnniRows& v, int64_t r, int64_t o, const float* s, const float* m,
                          const VaChunks& ch) {
  constexpr int KIND = MODE == 0 ? 0 : 1;
  constexpr int64_t width = KIND == 1 ? 128 : 64;
  const __m256i low = _mm256_set1_epi8(15);
  const __m256i lut = _mm256_broadcastsi128_si256(_mm_load_si128(reinterpret_cast<const __m128i*>(t.lut)));
  __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
  for (int64_t c = 0; c < ch.chunks; ++c) {
    alignas(32) int8_t bytes[64];
    va_gather_bytes(t, o, c * width, ch.group[c], bytes);
    const int8_t* xq = v.xq.data() + r * v.kp + c * width;
    for (int h = 0; h < 2; ++h) {
      alignas(32) float sc[8];
      for (int l = 0; l < 8; ++l) sc[l] = s[ch.lane_group[c * 16 + 8 * h + l]];
      const __m256i b = _mm256_load_si256(reinterpret_cast<const __m256i*>(bytes + 32 * h));
      __m256i lo = b, hi = b;
      if constexpr (KIND == 1) {
        lo = _mm256_and_si256(b, low);
        hi = _mm256_and_si256(_mm256_srli_epi16(b, 4), low);
        if constexpr (MODE == 3) {
          lo = _mm256_shuffle_epi8(lut, lo);
          hi = _mm256_shuffle_epi8(lut, hi);
        }
      }
      const int64_t lane = r * v.lanes + c * 16 + 8 * h;
      const __m256i corr = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v.corr.data() + lane));
      const __m256i x0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + 32 * h));
      const __m256i x1 = KIND == 1 ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + 64 + 32 * h)) : x0;
      const __m256i a = va2_sums<MODE>(lo, hi, x0, x1, corr);
      acc[h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a), _mm256_mul_ps(_mm256_load_ps(sc), _mm256_loadu_ps(v.dl.data() + lane)),
                               acc[h]);
    }
  }
  t.y[r * t.ldy + o] = va2_finish(v, r, ch, acc[0], acc[1], m);
}

// The values' mode of va2_sums: int8 (0), nibbles less an offset (1) or of none (2), a table's (3).
inline int va2_mode(const Q8Problem& t) { return t.kind == 0 ? 0 : t.offset < 0 ? 3 : t.offset == 0 ? 2 : 1; }

// va2_block for the problem's values: MR rows (2 or 1) times NO outputs (2 or 1).
template <int MR, int NO>
ZT_Q8_TARGET void va2_blocks(const Q8Problem& t, const VnniRows& v, int64_t m0, int64_t o, const float* s, const float* m,
                             const VaChunks& ch, const __m256i (&idx)[2], const bool (&wide)[2], int64_t ls, bool ahead) {
  switch (va2_mode(t) * 2 + (ahead ? 1 : 0)) {
    case 0: return va2_block<0, MR, NO, false>(t, v, m0, o, s, m, ch, idx, wide, ls);
    case 1: return va2_block<0, MR, NO, true>(t, v, m0, o, s, m, ch, idx, wide, ls);
    case 2: return va2_block<1, MR, NO, false>(t, v, m0, o, s, m, ch, idx, wide, ls);
    case 3: return va2_block<1, MR, NO, true>(t, v, m0, o, s, m, ch, idx, wide, ls);
    case 4: return va2_block<2, MR, NO, false>(t, v, m0, o, s, m, ch, idx, wide, ls);
    case 5: return va2_block<2, MR, NO, true>(t, v, m0, o, s, m, ch, idx, wide, ls);
    case 6: return va2_block<3, MR, NO, false>(t, v, m0, o, s, m, ch, idx, wide, ls);
    default: return va2_block<3, MR, NO, true>(t, v, m0, o, s, m, ch, idx, wide, ls);
  }
}

// va_tasks on AVX2: tasks [begin, end) of one thread, (chunk of rows, tile of outputs) chunk-major;
// first: the 16 lanes' first groups. A tile's outputs' factors made at once (one row: two outputs'
// just before their pass), then rows in blocks of 2 (a prompt) or 1 (a decode: the outputs VA_AHEAD
// on fetched) against two outputs a pass.
ZT_Q8_TARGET void va2_tasks(const Q8Problem& t, const VnniRows& v, const VaChunks& ch, const int32_t* first,
                            int64_t begin, int64_t end) {
  __m256i idx[2];
  bool wide[2];
  for (int h = 0; h < 2; ++h) {
    idx[h] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(first + 8 * h));
    wide[h] = *std::max_element(first + 8 * h, first + 8 * h + 8) >= 8;
  }
  const int64_t groups = t.k / t.group, stride = groups + 16;  // a tile's outputs' scales, 16 zeros after each
  const bool mins = t.m1.kind != 0, blocks = ch.together && ch.aligned;
  std::vector<float> s(static_cast<size_t>(VA_TILE * stride), 0.0f), m(static_cast<size_t>(VA_TILE * stride), 0.0f);
  for (int64_t task = begin; task < end; ++task) {
    const int64_t tile = task % t.tiles, mc = task / t.tiles;
    const int64_t r0 = mc * t.chunk, r1 = std::min(t.rows, r0 + t.chunk);
    const int64_t o0 = tile * VA_TILE, o1 = std::min(t.n, o0 + VA_TILE);
    const bool each = r1 - r0 == 1;  // one row: each pass's outputs' factors just before it
    if (!each) va2_factors(t, o0, o1 - o0, groups, s.data(), m.data(), stride);
    for (int64_t r = r0; r < r1;) {
      const int64_t mr = blocks && r1 - r >= 2 ? 2 : 1;
      for (int64_t o = o0; o < o1;) {
        const int64_t no = blocks && o1 - o >= 2 ? 2 : 1;
        const int64_t at = each ? 0 : (o - o0) * stride;
        if (each) va2_factors(t, o, no, groups, s.data(), m.data(), stride);
        const float* so = s.data() + at;
        const float* mp = mins ? m.data() + at : nullptr;
        if (!blocks) {  // one row, one output at a time
          const int mode = va2_mode(t);
          if (mode == 0) va2_any<0>(t, v, r, o, so, mp, ch);
          else if (mode == 3) va2_any<3>(t, v, r, o, so, mp, ch);
          else va2_any<1>(t, v, r, o, so, mp, ch);  // from corr (0 where the offset is)
          ++o;
          continue;
        }
        const bool ahead = r == r0 && r1 - r0 <= VA_DIRECT && ch.together;
        if (mr == 2 && no == 2) va2_blocks<2, 2>(t, v, r, o, so, mp, ch, idx, wide, stride, ahead);
        else if (mr == 2) va2_blocks<2, 1>(t, v, r, o, so, mp, ch, idx, wide, stride, ahead);
        else if (no == 2) va2_blocks<1, 2>(t, v, r, o, so, mp, ch, idx, wide, stride, ahead);
        else va2_blocks<1, 1>(t, v, r, o, so, mp, ch, idx, wide, stride, ahead);
        o += no;
      }
      r += mr;
    }
  }
}
#endif
