// ---- 8- and 4-bit weights times 8-bit activations, on AVX512-VNNI -----------------------------------
// y = x w^T as llama.cpp and vLLM's GGUF kernels compute it: each row of x quantised to int8 per block
// of 32 inputs (d = max |x| / 127, xq = round-half-even(x / d); an all-zero block is zeros), then the
// integer products of xq and the weights' values summed exactly in int32 (VPDPBUSD), scaled by the
// weights' group scale s times the block's d, less the groups' mins times the sums of the quantised
// inputs. In real arithmetic that is x^ w^T, x^ = d * xq the quantised rows, w = q * s - m the weights
// of q8_linear (same operands: Q8Problem, kinds 0 and 1).
//
// VPDPBUSD multiplies unsigned bytes by signed ones: int8 values go in as q + 128 (the top bit
// flipped) and 4-bit ones as the nibbles themselves (0..15), the quantised rows as the signed side;
// each 32-bit lane's sum starts from -128 (or -offset) times the sum of its inputs' xq, so it ends as
// sum xq * q exactly. A lane holds 4 inputs (int8 values: 64 inputs a 64-byte chunk) or 8 (two a byte:
// 128 inputs a chunk, the low halves against the chunk's even inputs, the high against its odd ones).
// An output's float sum: lane-wise fused multiply-adds of the lanes' integer sums times their scales,
// chunk by chunk in k order, the 16 lanes added in a fixed tree, less the mins times the groups' sums
// (16 lanes of groups, a fixed tree): a row's numbers never depend on the other rows or the threads.
#if defined(ZT_Q8)
#define ZT_VNNI 1
#define ZT_VNNI_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")))
constexpr int64_t VA_SLICE = 256, VA_TILE = 16, VA_MC = 64;  // K padded to slices; outputs, rows a task
constexpr int64_t VA_DIRECT = 16;  // rows of a chunk up to which it reads the tables direct and fetches ahead
constexpr int64_t VA_AHEAD = 16;  // outputs ahead a decode fetches, a line a chunk into L2 (BENCHMARKS.md)
// outputs of a prompt's block (va_block): int8 values, 4-bit ones (their two halves take twice the registers)
constexpr int VA_BLOCK[2] = {4, 2};

struct VaChunks {  // per chunk of inputs, the same for every output and row
  std::vector<int64_t> group, at;  // the chunk's first group; its first byte in an output's values
  std::vector<int32_t> lane_group;  // each lane's group (where chunks and groups do not align)
  bool aligned = true, together = true, flat = false;  // flat: an output's values in k order, together
  int64_t groups = 0, chunks = 0, full = 0;  // all chunks; those whose 64 bytes are all within K
  __mmask64 tail = 0;                        // the bytes of the last chunk that are within K
};

struct VnniRows {  // the rows quantised, row r's entries at r * (kp, lanes, groups)
  std::vector<int8_t> xq;     // kp values a row (kind 1: each chunk's 64 even inputs, then its 64 odd)
  std::vector<int32_t> corr;  // a lane's starting sum: -128 (or -offset) times its inputs' xq
  std::vector<float> dl;      // a lane's block scale d
  std::vector<float> xs;      // a group's sum of d * xq (for the mins)
  int64_t kp = 0, lanes = 0, width = 4;
};

// Row r's quantised inputs in input order (plain) and its blocks' scales d into v: kind 1's chunks
// interleaved (each 128-input chunk's even inputs, then its odd ones), the lanes' starting sums and
// scales, the groups' sums for the mins. Shared by the AVX512-VNNI and AVX2 quantisers (va_quantize,
// va2_quantize), so both give v the same numbers; no reassociation (ZT_Q8_TARGET).
ZT_Q8_TARGET void va_rows_finish(const Q8Problem& t, VnniRows& v, int64_t r, const int8_t* plain, const float* d, bool mins) {
  ZT_Q8_ORDER
  int8_t* xq = v.xq.data() + r * v.kp;
  if (t.kind == 1)
    for (int64_t c = 0; c < v.kp; c += 128)
      for (int64_t j = 0; j < 64; ++j) {
        xq[c + j] = plain[c + 2 * j];
        xq[c + 64 + j] = plain[c + 2 * j + 1];
      }
  const int32_t lift = t.kind == 1 && t.offset >= 0 ? t.offset : 128;  // a table's values go in as value + 128
  for (int64_t l = 0; l < v.lanes; ++l) {
    int32_t sum = 0;
    for (int64_t i = 0; i < v.width; ++i) sum += plain[l * v.width + i];
    v.corr[r * v.lanes + l] = -lift * sum;
    v.dl[r * v.lanes + l] = d[l * v.width / 32];
  }
  if (!mins) return;
  const int64_t groups = t.k / t.group;
  for (int64_t g = 0; g < groups; ++g) {
    float s = 0.0f;
    for (int64_t k = g * t.group; k < (g + 1) * t.group; ++k) s += d[k / 32] * static_cast<float>(plain[k]);
    v.xs[r * groups + g] = s;
  }
}

// Row r of t.x quantised into v (blocks of 32 inputs), and its lanes' and groups' sums.
ZT_VNNI_TARGET void va_quantize(const Q8Problem& t, VnniRows& v, int64_t r, bool mins) {
  const float* x = t.x + r * t.ldx;
  int8_t* xq = v.xq.data() + r * v.kp;  // zeros (the caller's), the inputs past K staying so
  std::vector<int8_t> scratch(t.kind == 1 ? static_cast<size_t>(v.kp) : 0, 0);
  int8_t* plain = t.kind == 1 ? scratch.data() : xq;  // in input order; kind 1 then interleaves into xq
  std::vector<float> d(static_cast<size_t>(v.kp / 32), 0.0f);
  for (int64_t b = 0; b * 32 < t.k; ++b) {
    const int64_t left = std::min<int64_t>(32, t.k - b * 32);
    const __mmask16 m0 = static_cast<__mmask16>(left >= 16 ? 0xFFFF : (1u << left) - 1);
    const __mmask16 m1 = static_cast<__mmask16>(left >= 32 ? 0xFFFF : left > 16 ? (1u << (left - 16)) - 1 : 0);
    const __m512 a = _mm512_maskz_loadu_ps(m0, x + b * 32), c = _mm512_maskz_loadu_ps(m1, x + b * 32 + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(c)));
    const float db = amax / 127.0f;
    d[b] = db;
    if (db == 0.0f) continue;  // zeros already
    const __m512 dv = _mm512_set1_ps(db);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(plain + b * 32),
                     _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_div_ps(a, dv))));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(plain + b * 32 + 16),
                     _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_div_ps(c, dv))));
  }
  va_rows_finish(t, v, r, plain, d.data(), mins);
}

// The 64 bytes of output o's values from input kc (a chunk's start, in group g) where they do not lie
// together, into buf: gathered group by group; bytes past K are zeros.
inline void va_gather_bytes(const Q8Problem& t, int64_t o, int64_t kc, int64_t g, int8_t* buf) {
  const int64_t shift = t.kind == 1 ? 1 : 0, nb = std::min<int64_t>(64, (t.k - kc) >> shift);
  std::memset(buf, 0, 64);
  for (int64_t b = 0, k = kc; b < nb; ++g) {  // byte b holds input kc + (b << shift)
    const int64_t take = std::min(nb - b, ((g + 1) * t.group - k) >> shift);
    std::memcpy(buf + b, t.q + o * t.qo + g * t.qg + ((k - g * t.group) >> shift), static_cast<size_t>(take));
    b += take;
    k = (g + 1) * t.group;
  }
}
ZT_VNNI_TARGET inline __m512i va_gather(const Q8Problem& t, int64_t o, int64_t kc, int64_t g) {
  alignas(64) int8_t buf[64];
  va_gather_bytes(t, o, kc, g, buf);
  return _mm512_load_si512(buf);
}

// Up to 16 consecutive entries of a factor's table from p (left of them; the rest 0), as fp32.
ZT_VNNI_TARGET __attribute__((always_inline)) inline __m512 va_entries(int kind, const void* p, int64_t left) {
  const __mmask16 m = static_cast<__mmask16>(left >= 16 ? 0xFFFF : (1u << left) - 1);
  switch (kind) {
    case 1: return _mm512_maskz_loadu_ps(m, p);
    case 2: return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, p));
    case 3: return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(m, p)));
    case 4: return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(m, p)));
    default: return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
  }
}

// Output o's factor f for groups g .. g + left - 1 (left up to 16; the rest 0) where its table has an
// entry per `per` groups, per a power of two, unit stride (va_per_group): per 1 the entries as they
// lie, else the (r + left - 1) / per + 1 entries they take, each repeated per times from the lane of
// the group's place r = g % per (a permutation); as fp32, all ones where the factor is absent.
ZT_VNNI_TARGET __attribute__((always_inline)) inline __m512 va_row_entries(const Factor& f, int64_t o, int64_t g, int64_t left) {
  if (f.kind == 0) return _mm512_set1_ps(1.0f);
  const int64_t size = factor_bytes(f);
  const char* row = static_cast<const char*>(f.p) + o * f.so * size;
  if (f.per == 1) return va_entries(f.kind, row + g * size, left);
  const unsigned shift = static_cast<unsigned>(__builtin_ctzll(static_cast<uint64_t>(f.per)));
  const int64_t r = g & (f.per - 1);
  const __m512i idx = _mm512_srli_epi32(
      _mm512_add_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                       _mm512_set1_epi32(static_cast<int32_t>(r))),
      shift);
  return _mm512_permutexvar_ps(idx, va_entries(f.kind, row + (g >> shift) * size, ((r + left - 1) >> shift) + 1));
}

// Output o's scales (s1 · s2) and mins (m1 · m2, negated where they are added) of groups g .. g + left - 1,
// where every factor has an entry per group: the products q8_factors and va_factor make, so their bits.
ZT_VNNI_TARGET __attribute__((always_inline)) inline __m512 va_row_scales(const Q8Problem& t, int64_t o, int64_t g, int64_t left) {
  const __m512 e = va_row_entries(t.s1, o, g, left);
  return t.s2.kind != 0 ? _mm512_mul_ps(e, va_row_entries(t.s2, o, g, left)) : e;
}
ZT_VNNI_TARGET __attribute__((always_inline)) inline __m512 va_row_mins(const Q8Problem& t, int64_t o, int64_t g, int64_t left) {
  __m512 e = va_row_entries(t.m1, o, g, left);
  if (t.m2.kind != 0) e = _mm512_mul_ps(e, va_row_entries(t.m2, o, g, left));
  return t.add_mins ? _mm512_xor_ps(e, _mm512_set1_ps(-0.0f)) : e;  // exactly -m
}

// Whether a factor's entries can be read as va_row_entries reads them: an entry per group, or per a
// power of two of groups (a K type's super-block scale), at unit stride.
inline bool va_per_group(const Factor& f) { return f.kind == 0 || (f.sg == 1 && f.per > 0 && (f.per & (f.per - 1)) == 0); }

// An output's sum y from its lanes' sums acc (the end of va_output and va_decode4): the 16 lanes added
// in a fixed tree, less its mins mj (none: nullptr) times row r's groups' sums, 16 lanes of groups, a
// fixed tree.
ZT_VNNI_TARGET __attribute__((always_inline)) inline float va_finish(const VnniRows& v, int64_t r, const VaChunks& ch,
                                                                     __m512 acc, const float* mj) {
  float y = _mm512_reduce_add_ps(acc);
  if (mj == nullptr) return y;
  const float* xs = v.xs.data() + r * ch.groups;
  __m512 ms = _mm512_setzero_ps();
  for (int64_t g = 0; g < ch.groups; g += 16) {
    const int64_t left = std::min<int64_t>(16, ch.groups - g);
    const __mmask16 k = static_cast<__mmask16>(left >= 16 ? 0xFFFF : (1u << left) - 1);
    ms = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(k, mj + g), _mm512_maskz_loadu_ps(k, xs + g), ms);
  }
  return y - _mm512_reduce_add_ps(ms);
}

// Rows m0 .. m0 + MR - 1's sums of outputs o .. o + NO - 1 from their lanes (va_finish; output o + j's
// mins ls floats on from m), stored (the end of va_output and va_block).
template <int MR, int NO>
ZT_VNNI_TARGET __attribute__((always_inline)) inline void va_store(const Q8Problem& t, const VnniRows& v, int64_t m0, int64_t o,
                                                                   const VaChunks& ch, const __m512 (&acc)[MR][NO],
                                                                   const float* m, int64_t ls) {
#pragma GCC unroll 4
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
    for (int j = 0; j < NO; ++j)
      t.y[(m0 + r) * t.ldy + o + j] = va_finish(v, m0 + r, ch, acc[r][j], m == nullptr ? nullptr : m + j * ls);
}

// An output's 64 bytes w as VPDPBUSD's unsigned operands: KIND 1 its low nibbles in b and high ones
// in h (where ``table``, IQ4_NL's: each nibble's value + 128 from ulut), else its int8 values + 128 in
// b (h then b too). Always inlined: a constant ``table`` leaves no test behind.
template <int KIND>
ZT_VNNI_TARGET __attribute__((always_inline)) inline void va_operands(__m512i w, bool table, __m512i ulut, __m512i& b,
                                                                      __m512i& h) {
  const __m512i low = _mm512_set1_epi8(15), top = _mm512_set1_epi8(static_cast<char>(0x80));
  if constexpr (KIND == 1) {
    b = _mm512_and_si512(w, low);
    h = _mm512_and_si512(_mm512_srli_epi16(w, 4), low);
    if (table) {
      b = _mm512_shuffle_epi8(ulut, b);
      h = _mm512_shuffle_epi8(ulut, h);
    }
  } else {
    b = h = _mm512_xor_si512(w, top);
  }
}

// One (row, output) step of a chunk, the arithmetic every 8-bit kernel here shares (so their bits): the
// 16 lanes' integer sums from the row's corrections cr over b x x0 (KIND 1: then h x x1), to fp32,
// times the output's lane scales sl times the row's block scales d, added to acc.
template <int KIND>
ZT_VNNI_TARGET __attribute__((always_inline)) inline __m512 va_step(__m512 acc, __m512i cr, __m512i b, __m512i h, __m512i x0,
                                                                    __m512i x1, __m512 sl, __m512 d) {
  __m512i a = _mm512_dpbusd_epi32(cr, b, x0);
  if constexpr (KIND == 1) a = _mm512_dpbusd_epi32(a, h, x1);
  return _mm512_fmadd_ps(_mm512_cvtepi32_ps(a), _mm512_mul_ps(sl, d), acc);
}

// Rows m0 .. m0 + MR - 1 times outputs o .. o + NO - 1: s and m are output o's group scales and mins
// (all groups, 16 zeros after; output o + j's ls floats on). TOGETHER: a chunk's 64 bytes lie together
// (an output's values contiguous, or a group of whole chunks); ALIGNED: a chunk holds whole groups or a
// group whole chunks, so one permutation (idx) of the 16 scales from the chunk's first group gives the
// lanes' (else a gather). AHEAD: fetch outputs o + VA_AHEAD on (a few rows read each output once).
// Outputs of one row (a decode) share its loads; each (row, output) has its arithmetic at any MR, NO.
template <int KIND, int MR, bool TOGETHER, bool ALIGNED, bool AHEAD = false, int NO = 1>
ZT_VNNI_TARGET void va_output(const Q8Problem& t, const VnniRows& v, int64_t m0, int64_t o, const float* s, const float* m,
                              const VaChunks& ch, __m512i idx, int64_t ls = 0) {
  constexpr int64_t chunk = KIND == 1 ? 128 : 64;  // 16 lanes a chunk
  // AHEAD: the factors of each output VA_AHEAD on now, its values a line a chunk into L2 (past the
  // last output: this output's line again)
  const int8_t *base[NO], *ahead[NO] = {};
  for (int j = 0; j < NO; ++j) {
    base[j] = t.q + (o + j) * t.qo;
    if constexpr (AHEAD) ahead[j] = o + j + VA_AHEAD < t.n ? base[j] + VA_AHEAD * t.qo : base[j];
    if constexpr (AHEAD) q8_prefetch_factors(t, o + j + VA_AHEAD);
  }
  const int8_t* xq[MR];
  const int32_t* corr[MR];
  const float* dl[MR];
  __m512 acc[MR][NO];
  for (int r = 0; r < MR; ++r) {
    xq[r] = v.xq.data() + (m0 + r) * v.kp;
    corr[r] = v.corr.data() + (m0 + r) * v.lanes;
    dl[r] = v.dl.data() + (m0 + r) * v.lanes;
#pragma GCC unroll 4
    for (int j = 0; j < NO; ++j) acc[r][j] = _mm512_setzero_ps();
  }
  const __m512i top = _mm512_set1_epi8(static_cast<char>(0x80));
  // values two a byte indexing IQ4_NL's table (offset -1): each nibble's value + 128, as int8 values go in
  const bool table = KIND == 1 && t.offset < 0;
  const __m512i ulut = _mm512_xor_si512(_mm512_broadcast_i32x4(_mm_load_si128(reinterpret_cast<const __m128i*>(t.lut))), top);
  const int64_t* at = ch.at.data();
  const int64_t* group = ch.group.data();
  for (int64_t c = 0; c < ch.chunks; ++c) {
#pragma GCC unroll 4
    for (int j = 0; j < NO; ++j) {
      __m512i b;
      if constexpr (AHEAD) _mm_prefetch(reinterpret_cast<const char*>(ahead[j] + at[c]), _MM_HINT_T1);
      if constexpr (TOGETHER)
        b = c < ch.full ? _mm512_loadu_si512(base[j] + at[c]) : _mm512_maskz_loadu_epi8(ch.tail, base[j] + at[c]);
      else
        b = va_gather(t, o + j, c * chunk, group[c]);
      __m512 sl;
      if constexpr (ALIGNED) sl = _mm512_permutexvar_ps(idx, _mm512_loadu_ps(s + j * ls + group[c]));
      else sl = _mm512_i32gather_ps(_mm512_loadu_si512(ch.lane_group.data() + c * 16), s + j * ls, 4);
      __m512i lo, hi;
      va_operands<KIND>(b, table, ulut, lo, hi);
#pragma GCC unroll 4
      for (int r = 0; r < MR; ++r) {
        const int8_t* x = xq[r] + c * chunk;
        const __m512i x0 = _mm512_loadu_si512(x), x1 = KIND == 1 ? _mm512_loadu_si512(x + 64) : x0;
        acc[r][j] = va_step<KIND>(acc[r][j], _mm512_loadu_si512(corr[r] + c * 16), lo, hi, x0, x1, sl,
                                  _mm512_loadu_ps(dl[r] + c * 16));
      }
    }
  }
  va_store<MR, NO>(t, v, m0, o, ch, acc, m, ls);
}

// va_output for the problem's kind and the chunks' layout, MR rows (4 or 1).
template <int MR>
ZT_VNNI_TARGET void va_rows(const Q8Problem& t, const VnniRows& v, int64_t m0, int64_t o, const float* s, const float* m,
                            const VaChunks& ch, __m512i idx, bool ahead) {
  if (ahead) {  // ALIGNED, TOGETHER (va_tasks' condition)
    if (t.kind == 1) va_output<1, MR, true, true, true>(t, v, m0, o, s, m, ch, idx);
    else va_output<0, MR, true, true, true>(t, v, m0, o, s, m, ch, idx);
    return;
  }
  const int which = (t.kind == 1 ? 4 : 0) + (ch.together ? 2 : 0) + (ch.aligned ? 1 : 0);
  switch (which) {
    case 0: va_output<0, MR, false, false>(t, v, m0, o, s, m, ch, idx); break;
    case 1: va_output<0, MR, false, true>(t, v, m0, o, s, m, ch, idx); break;
    case 2: va_output<0, MR, true, false>(t, v, m0, o, s, m, ch, idx); break;
    case 3: va_output<0, MR, true, true>(t, v, m0, o, s, m, ch, idx); break;
    case 4: va_output<1, MR, false, false>(t, v, m0, o, s, m, ch, idx); break;
    case 5: va_output<1, MR, false, true>(t, v, m0, o, s, m, ch, idx); break;
    case 6: va_output<1, MR, true, false>(t, v, m0, o, s, m, ch, idx); break;
    default: va_output<1, MR, true, true>(t, v, m0, o, s, m, ch, idx); break;
  }
}

// One chunk c of va_block: each output's values (MASKED: the last chunk's bytes within K alone) and
// scales loaded once for the MR rows, each row's quantised inputs, corrections and block scales once for
// the NO outputs (rows' entries at xq[r], corr[r], dl[r] for chunk 0).
template <int KIND, int NO, bool AHEAD, int MR, bool TABLE, bool MASKED>
ZT_VNNI_TARGET __attribute__((always_inline)) inline void va_block_chunk(const VaChunks& ch, int64_t c, const int8_t* const (&base)[NO],
                                                                         const int8_t* const (&ahead)[NO], const float* s, int64_t ls,
                                                                         __m512i idx, __m512i ulut, const int8_t* const (&xq)[MR],
                                                                         const int32_t* const (&corr)[MR], const float* const (&dl)[MR],
                                                                         __m512 (&acc)[MR][NO]) {
  const int64_t at = ch.at[c], group = ch.group[c];
  __m512i b[NO], h[NO];  // va_operands
  __m512 sl[NO];
#pragma GCC unroll 4
  for (int j = 0; j < NO; ++j) {
    if constexpr (AHEAD) _mm_prefetch(reinterpret_cast<const char*>(ahead[j] + at), _MM_HINT_T1);
    const __m512i w = MASKED ? _mm512_maskz_loadu_epi8(ch.tail, base[j] + at) : _mm512_loadu_si512(base[j] + at);
    va_operands<KIND>(w, TABLE, ulut, b[j], h[j]);
    sl[j] = _mm512_permutexvar_ps(idx, _mm512_loadu_ps(s + j * ls + group));
  }
#pragma GCC unroll 4
  for (int r = 0; r < MR; ++r) {
    const __m512i cr = _mm512_loadu_si512(corr[r] + c * 16);
    const __m512 d = _mm512_loadu_ps(dl[r] + c * 16);
    const int8_t* x = xq[r] + c * (KIND == 1 ? 128 : 64);
    const __m512i x0 = _mm512_loadu_si512(x);
    const __m512i x1 = KIND == 1 ? _mm512_loadu_si512(x + 64) : x0;
#pragma GCC unroll 4
    for (int j = 0; j < NO; ++j) acc[r][j] = va_step<KIND>(acc[r][j], cr, b[j], h[j], x0, x1, sl[j], d);
  }
}

// Rows m0 .. m0 + MR - 1 times outputs o .. o + NO - 1 where a chunk's 64 bytes lie together and hold
// whole groups (a prompt's block of a task, or a few rows of a decode): va_block_chunk chunk by chunk,
// the whole chunks' loop free of the last chunk's mask and IQ4_NL's table a template argument (TABLE).
// Each (row, output) has va_output's arithmetic (the same chains in the same order), so its bits.
template <int KIND, int NO, bool AHEAD, int MR, bool TABLE = false>
ZT_VNNI_TARGET void va_block(const Q8Problem& t, const VnniRows& v, int64_t m0, int64_t o, const float* s, const float* m,
                             const VaChunks& ch, __m512i idx, int64_t ls) {
  const int8_t *base[NO], *ahead[NO] = {};
  for (int j = 0; j < NO; ++j) {
    base[j] = t.q + (o + j) * t.qo;
    // AHEAD (4 rows of a decode): va_output's fetches of the outputs VA_AHEAD on
    if constexpr (AHEAD) ahead[j] = o + j + VA_AHEAD < t.n ? base[j] + VA_AHEAD * t.qo : base[j];
    if constexpr (AHEAD) q8_prefetch_factors(t, o + j + VA_AHEAD);
  }
  const int8_t* xq[MR];
  const int32_t* corr[MR];
  const float* dl[MR];
  __m512 acc[MR][NO];
#pragma GCC unroll 4
  for (int r = 0; r < MR; ++r) {
    xq[r] = v.xq.data() + (m0 + r) * v.kp;
    corr[r] = v.corr.data() + (m0 + r) * v.lanes;
    dl[r] = v.dl.data() + (m0 + r) * v.lanes;
#pragma GCC unroll 4
    for (int j = 0; j < NO; ++j) acc[r][j] = _mm512_setzero_ps();
  }
  const __m512i top = _mm512_set1_epi8(static_cast<char>(0x80));
  // IQ4_NL's indices: each nibble's value + 128 (va_output)
  const __m512i ulut = _mm512_xor_si512(_mm512_broadcast_i32x4(_mm_load_si128(reinterpret_cast<const __m128i*>(t.lut))), top);
  const int64_t full = ch.full;
  for (int64_t c = 0; c < full; ++c)
    va_block_chunk<KIND, NO, AHEAD, MR, TABLE, false>(ch, c, base, ahead, s, ls, idx, ulut, xq, corr, dl, acc);
  if (full < ch.chunks)
    va_block_chunk<KIND, NO, AHEAD, MR, TABLE, true>(ch, full, base, ahead, s, ls, idx, ulut, xq, corr, dl, acc);
  va_store<MR, NO>(t, v, m0, o, ch, acc, m, ls);
}

// va_block for the problem's kind at MR rows (4 or 2), with a decode's fetches ahead (ahead: a chunk
// of a few rows); false, nothing done, where the chunks' layout takes no blocks or fewer than a
// block's outputs are left.
template <int MR>
ZT_VNNI_TARGET bool va_blocks(const Q8Problem& t, const VnniRows& v, int64_t m0, int64_t o, int64_t left, const float* s,
                              const float* m, const VaChunks& ch, __m512i idx, int64_t ls, bool ahead) {
  if (!ch.together || !ch.aligned || left < VA_BLOCK[t.kind == 1]) return false;
  const bool table = t.kind == 1 && t.offset < 0;  // IQ4_NL's indices
  if (table && ahead) va_block<1, VA_BLOCK[1], true, MR, true>(t, v, m0, o, s, m, ch, idx, ls);
  else if (table) va_block<1, VA_BLOCK[1], false, MR, true>(t, v, m0, o, s, m, ch, idx, ls);
  else if (t.kind == 1 && ahead) va_block<1, VA_BLOCK[1], true, MR>(t, v, m0, o, s, m, ch, idx, ls);
  else if (t.kind == 1) va_block<1, VA_BLOCK[1], false, MR>(t, v, m0, o, s, m, ch, idx, ls);
  else if (ahead) va_block<0, VA_BLOCK[0], true, MR>(t, v, m0, o, s, m, ch, idx, ls);
  else va_block<0, VA_BLOCK[0], false, MR>(t, v, m0, o, s, m, ch, idx, ls);
  return true;
}

// The byte offset, from an output's row, of each group's entry of a factor's table that va_row_entries
// does not read ((g / per) · sg entries): made once a call, none for the others.
inline std::vector<int32_t> va_offsets(const Factor& f, int64_t groups) {
  std::vector<int32_t> off;
  if (va_per_group(f)) return off;
  if (((groups - 1) / f.per) * f.sg * factor_bytes(f) > INT32_MAX - 4) return off;  // entry by entry instead
  off.resize(static_cast<size_t>(groups));
  for (int64_t g = 0; g < groups; ++g) off[g] = static_cast<int32_t>((g / f.per) * f.sg * factor_bytes(f));
  return off;
}

// Up to 16 entries of a factor's table at byte offsets off from row (left of them; the rest 0), as
// fp32: each gathered as the aligned 4 bytes that hold it (which lie in the entry's page: no read
// can fault), then its bytes taken out of them. The same values factor_entry gives.
ZT_VNNI_TARGET __attribute__((always_inline)) inline __m512 va_gathered(int kind, const char* row, const int32_t* off,
                                                                        int64_t left) {
  const __mmask16 m = static_cast<__mmask16>(left >= 16 ? 0xFFFF : (1u << left) - 1);
  const __m512i o = _mm512_maskz_loadu_epi32(m, off);
  if (kind == 1) return _mm512_mask_i32gather_ps(_mm512_setzero_ps(), m, o, row, 1);
  const __m512i at = _mm512_add_epi32(o, _mm512_set1_epi32(static_cast<int32_t>(reinterpret_cast<uintptr_t>(row) & 3)));
  const __m512i aligned = _mm512_sub_epi32(_mm512_andnot_si512(_mm512_set1_epi32(3), at),
                                           _mm512_set1_epi32(static_cast<int32_t>(reinterpret_cast<uintptr_t>(row) & 3)));
  const __m512i word = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), m, aligned, row, 1);
  const __m512i bits = _mm512_slli_epi32(_mm512_and_si512(at, _mm512_set1_epi32(3)), 3);  // the entry's bit offset
  const __m512i low = _mm512_srlv_epi32(word, bits);  // the entry in the low bits
  switch (kind) {
    case 2: return _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_and_si512(low, _mm512_set1_epi32(0xFFFF))));
    case 3: return _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(low, 24), 24));
    case 4: return _mm512_cvtepi32_ps(_mm512_and_si512(low, _mm512_set1_epi32(0xFF)));
    default: return _mm512_castsi512_ps(_mm512_slli_epi32(low, 16));
  }
}

// Output o's factor f for every group, into out (first) or multiplied into it: the same fp32
// products as q8_factors (1 · f1 · f2), 16 groups at a time: read as they lie where va_row_entries
// reads them (va_per_group), else through their offsets (va_offsets); entry by entry without them.
ZT_VNNI_TARGET void va_factor(const Factor& f, int64_t o, int64_t groups, float* out, bool first,
                              const int32_t* offsets = nullptr) {
  if (f.kind == 0) {
    if (first) std::fill(out, out + groups, 1.0f);
    return;
  }
  const bool lie = va_per_group(f);
  if (!lie && offsets == nullptr) {
    for (int64_t g = 0; g < groups; ++g) {
      const float e = factor_entry(f, o * f.so + (g / f.per) * f.sg);
      out[g] = first ? e : out[g] * e;
    }
    return;
  }
  const char* row = static_cast<const char*>(f.p) + o * f.so * factor_bytes(f);
  for (int64_t g0 = 0; g0 < groups; g0 += 16) {
    const int64_t left = std::min<int64_t>(16, groups - g0);
    __m512 v = lie ? va_row_entries(f, o, g0, left) : va_gathered(f.kind, row, offsets + g0, left);
    const __mmask16 m = static_cast<__mmask16>(left >= 16 ? 0xFFFF : (1u << left) - 1);
    if (!first) v = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, out + g0), v);
    _mm512_mask_storeu_ps(out + g0, m, v);
  }
}

// q8_factors (va_factor's) for output o and groups g0 .. g0 + count - 1 (a slice, or every group) where
// every factor has an entry per group, or per a power of two of them (va_per_group): 16 groups a step,
// the same products (f1 · f2, the mins negated where added), so their bits; m untouched without mins.
ZT_VNNI_TARGET __attribute__((always_inline)) inline void va_slice_factors(const Q8Problem& t, int64_t o, int64_t g0, int64_t count, float* s, float* m) {
  const bool mins = t.m1.kind != 0;
  for (int64_t c = 0; c < count; c += 16) {
    const int64_t left = std::min<int64_t>(16, count - c);
    const __mmask16 k = static_cast<__mmask16>(left >= 16 ? 0xFFFF : (1u << left) - 1);
    _mm512_mask_storeu_ps(s + c, k, va_row_scales(t, o, g0 + c, left));
    if (mins) _mm512_mask_storeu_ps(m + c, k, va_row_mins(t, o, g0 + c, left));
  }
}
#endif
