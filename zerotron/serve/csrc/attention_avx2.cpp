
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
// The paged attention on AVX2 and FMA (8-lane registers), for float and bfloat16 pools and heads of
// any multiple of 8 up to 256: what a CPU without AVX-512 (AMD Zen 1-3, Intel before Skylake-X and
// its client cores) computes fp32 serving with. The rows go in the AVX-512 kernel's blocks
// (row_blocks, dealt to threads by deal), and per block and 16 keys at a time:
// - the keys of one KV head are transposed into a (dim, 16) panel, and the scores of up to 6 query
//   vectors (a row's heads that share the KV head, over the block's rows) against the panel are a
//   register-blocked product: each score one chain of fused multiply-adds over d in order, whatever
//   the other query vectors beside it;
// - each row's softmax runs over its own scores (8-lane partial sums added in one fixed order);
// - each query vector's weighted sum of the values runs in key order, in fp32 accumulators kept from
//   one run of keys to the next: for a prompt's rows 32 keys (16 from an 8-bit pool), each value
//   loaded once for up to 3 query heads that share it (weigh_group); for a decode 16, head by head.
//   A head's sums are the same chain either way.
// So a row's numbers are its own: the same alone, in any block, as a prompt row or as a decode. An
// 8-bit pool is read 16 positions at a time, all KV heads, dequantised into an fp32 chunk (stage_chunk:
// the values of kv_quant.dequantize, exactly as load8 widens them from a dense pool), then as above.

template <typename T>
inline __m256 load8(const T* p);
template <>
inline __m256 load8<float>(const float* p) { return _mm256_loadu_ps(p); }
template <>
inline __m256 load8<c10::BFloat16>(const c10::BFloat16* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}

// 8 codes (the low 8 bytes of x) as fp32, as kv_codes16 converts 16 on AVX-512: int8 directly; fp8
// through fp16's bits (F16C), e4m3's value 2^-8 the code's (kv_scale8 folds the 256 into the scale).
inline __m256 kv_codes8(__m128i x, int fmt) {
  if (fmt == 3) return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(x));
  const __m128i h = _mm_cvtepi8_epi16(x);
  return _mm256_cvtph_ps(fmt == 2 ? _mm_slli_epi16(h, 8)
                                  : _mm_and_si128(_mm_slli_epi16(h, 7), _mm_set1_epi16(static_cast<int16_t>(0xBFFF))));
}
inline __m256 kv_scale8(float scale, int fmt) { return _mm256_set1_ps(fmt == 1 ? scale * 256.0f : scale); }

// 8 fp32 values rounded to T as torch rounds (bf16: to nearest even on the bits), back in fp32.
template <typename T>
inline __m256 round8_to(__m256 x);
template <>
inline __m256 round8_to<float>(__m256 x) { return x; }
template <>
inline __m256 round8_to<c10::BFloat16>(__m256 x) {
  const __m256i bits = _mm256_castps_si256(x);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i up = _mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF)));
  return _mm256_castsi256_ps(_mm256_and_si256(up, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

// An 8-bit pool's vectors of positions j0 .. j0 + cn - 1, all KV heads, into ``staged`` as fp32 (position
// c, KV head kh at (c * kv_heads + kh) * dim): each value its code times its scale in fp32, rounded to
// T (kv_quant.dequantize's value), widened exactly — what load8<T> reads from a pool of those values.
// The next positions' codes are requested meanwhile.
template <typename T>
inline void stage_chunk(const KVSource& src, const int64_t* slot, int64_t j0, int64_t cn, int64_t n, int64_t kv_heads,
                        int64_t dim, float* staged) {
  for (int64_t j = j0 + kChunk; j < std::min<int64_t>(j0 + 2 * kChunk, n); ++j) {
    prefetch_slot(src.codes + slot[j] * kv_heads * dim, kv_heads * dim);
    prefetch_slot(src.scales + slot[j] * kv_heads, kv_heads);
  }
  for (int64_t c = 0; c < cn; ++c) {
    const int64_t vec = slot[j0 + c] * kv_heads;
    for (int64_t kh = 0; kh < kv_heads; ++kh) {
      const __m256 f = kv_scale8(src.scales[vec + kh], src.fmt);
      const uint8_t* x = src.codes + (vec + kh) * dim;
      float* o = staged + (c * kv_heads + kh) * dim;
      for (int64_t d = 0; d < dim; d += 8) {
        const __m128i raw = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(x + d));
        _mm256_storeu_ps(o + d, round8_to<T>(_mm256_mul_ps(kv_codes8(raw, src.fmt), f)));
      }
    }
  }
}

// Positions 0 .. 15 as slots: a staged chunk's own.
constexpr int64_t kStagedSlots[kChunk] = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};

// exp_neg on 8 lanes (exp_neg16's reduction and polynomial, kExpPoly).
inline __m256 exp_neg8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
  const __m256 fx = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(kLog2e), _mm256_set1_ps(0.5f)));
  x = _mm256_fmadd_ps(fx, _mm256_set1_ps(kLn2Lo), _mm256_fnmadd_ps(fx, _mm256_set1_ps(kLn2Hi), x));
  const __m256 z = _mm256_mul_ps(x, x);
  __m256 y = _mm256_set1_ps(kExpPoly[0]);
  for (int i = 1; i < 6; ++i) y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(kExpPoly[i]));
  y = _mm256_add_ps(_mm256_fmadd_ps(y, z, x), _mm256_set1_ps(1.0f));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(bits));
}

// The sum (or the largest) of 8 lanes: the halves combined, then the halves' halves, ...
inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps(s, s, 1)));
}
inline float hmax8(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(s, _mm_shuffle_ps(s, s, 1)));
}

// One row of n scores (readable up to n rounded up to 8) replaced by exp(score - max), the lanes
// past n by 0; returns the sum.
inline float softmax8(float* s, int64_t n) {
  const int64_t full = n / 8 * 8;
  const __m256 tail = _mm256_castsi256_ps(
      _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n - full)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)));
  const __m256 none = _mm256_set1_ps(-INFINITY);
  __m256 top = none;
  for (int64_t j = 0; j < full; j += 8) top = _mm256_max_ps(top, _mm256_loadu_ps(s + j));
  if (full < n) top = _mm256_max_ps(top, _mm256_blendv_ps(none, _mm256_loadu_ps(s + full), tail));
  const __m256 m = _mm256_set1_ps(hmax8(top));
  __m256 sum = _mm256_setzero_ps();
  for (int64_t j = 0; j < full; j += 8) {
    const __m256 e = exp_neg8(_mm256_sub_ps(_mm256_loadu_ps(s + j), m));
    _mm256_storeu_ps(s + j, e);
    sum = _mm256_add_ps(sum, e);
  }
  if (full < n) {
    const __m256 e = _mm256_blendv_ps(_mm256_setzero_ps(), exp_neg8(_mm256_sub_ps(_mm256_loadu_ps(s + full), m)), tail);
    _mm256_storeu_ps(s + full, e);
    sum = _mm256_add_ps(sum, e);
  }
  return hsum8(sum);
}

// 8 registers of 8 lanes transposed: r[i] lane j <- r[j] lane i.
inline void transpose8(__m256* r) {
  __m256 t[8], u[8];
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 2; ++i) {
    u[4 * i] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], _MM_SHUFFLE(1, 0, 1, 0));
    u[4 * i + 1] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], _MM_SHUFFLE(3, 2, 3, 2));
    u[4 * i + 2] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(1, 0, 1, 0));
    u[4 * i + 3] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x20);
    r[i + 4] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x31);
  }
}

// The slots of positions j0 .. j0 + 15 (up to n) requested: each slot's vectors of all KV heads.
template <typename T>
__attribute__((always_inline)) inline void prefetch_slots(const T* pool, const int64_t* slot, int64_t j0, int64_t n, int64_t elements) {
  for (int64_t j = j0; j < std::min<int64_t>(j0 + kChunk, n); ++j) prefetch_slot(pool + slot[j] * elements, elements);
}

// Keys j0 .. j0 + cn - 1 (cn <= 16) of KV head kh, fp32, into the panel kt (dim rows of 16: kt[d * 16
// + c] = key c's element d); the columns past cn are zeros.
template <typename T>
inline void key_panel(const T* pool, const int64_t* slot, int64_t j0, int64_t cn, int64_t kv_heads, int64_t kh,
                      int64_t dim, float* kt) {
  __m256 r[8];
  for (int64_t c0 = 0; c0 < 16; c0 += 8) {
    for (int64_t d0 = 0; d0 < dim; d0 += 8) {
      for (int i = 0; i < 8; ++i)
        r[i] = c0 + i < cn ? load8<T>(pool + (slot[j0 + c0 + i] * kv_heads + kh) * dim + d0) : _mm256_setzero_ps();
      transpose8(r);
      for (int i = 0; i < 8; ++i) _mm256_storeu_ps(kt + (d0 + i) * 16 + c0, r[i]);
    }
  }
}

// R query vectors q[r] (dim fp32, scaled) against a key panel: out[r][c] = sum over d, in order, of
// q[r][d] * kt[d * 16 + c] (one fused multiply-add per d from 0). The lines ahead[0 .. nahead) are
// requested one per d, between the products (any past dim after them), where AHEAD.
template <int R, bool AHEAD>
inline void panel_scores(const float* const* q, const float* kt, int64_t dim, float* const* out, const char* const* ahead,
                         int64_t nahead) {
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t d = 0; d < dim; ++d) {
    if constexpr (AHEAD)
      if (d < nahead) _mm_prefetch(ahead[d], _MM_HINT_T0);
    const __m256 k0 = _mm256_loadu_ps(kt + d * 16), k1 = _mm256_loadu_ps(kt + d * 16 + 8);
    for (int r = 0; r < R; ++r) {
      const __m256 qd = _mm256_broadcast_ss(q[r] + d);
      acc[r][0] = _mm256_fmadd_ps(qd, k0, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(qd, k1, acc[r][1]);
    }
  }
  if constexpr (AHEAD)
    for (int64_t d = dim; d < nahead; ++d) _mm_prefetch(ahead[d], _MM_HINT_T0);
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_ps(out[r], acc[r][0]);
    _mm256_storeu_ps(out[r] + 8, acc[r][1]);
  }
}

// panel_scores for m query vectors, 6 at a time; the first call requests the lines ahead (the others
// have no test of them). The first call of 6 is written apart on purpose: one loop over a helper that
// chose the instantiation at run time left the products out of line and ran prompts 1.4-1.5x slower.
inline void panel_scores_any(const float* const* q, const float* kt, int64_t dim, float* const* out, int64_t m,
                             const char* const* ahead, int64_t nahead) {
  if (m >= 6 && nahead > 0) {
    panel_scores<6, true>(q, kt, dim, out, ahead, nahead);
    m -= 6, q += 6, out += 6, nahead = 0;
  }
  for (; m >= 6; m -= 6, q += 6, out += 6) panel_scores<6, false>(q, kt, dim, out, ahead, 0);
  switch (m) {
#define ZT_PANEL(R) \
    case R: return nahead > 0 ? panel_scores<R, true>(q, kt, dim, out, ahead, nahead) : panel_scores<R, false>(q, kt, dim, out, ahead, 0);
    ZT_PANEL(5) ZT_PANEL(4) ZT_PANEL(3) ZT_PANEL(2) ZT_PANEL(1)
#undef ZT_PANEL
    default: break;
  }
}

// acc[0 .. 8 NV) += sum over c < m, in order, of p[c] * value c (its elements at v[c] .. + 8 NV).
template <typename T, int NV>
inline void weigh_values(float* acc, const float* p, const T* const* v, int64_t m) {
  __m256 sum[NV];
  for (int i = 0; i < NV; ++i) sum[i] = _mm256_loadu_ps(acc + 8 * i);
  for (int64_t c = 0; c < m; ++c) {
    const __m256 w = _mm256_broadcast_ss(p + c);
    for (int i = 0; i < NV; ++i) sum[i] = _mm256_fmadd_ps(w, load8<T>(v[c] + 8 * i), sum[i]);
  }
  for (int i = 0; i < NV; ++i) _mm256_storeu_ps(acc + 8 * i, sum[i]);
}

// Keys per step of the weighted sums over a dense pool (an 8-bit pool's are staged kChunk at a time).
constexpr int64_t kValueChunk = 32;

template <typename T>
inline void weigh_values_any(float* acc, const float* p, const T* const* v, int64_t m, int64_t dim) {
  const T* part[kValueChunk];
  for (int64_t d0 = 0; d0 < dim; d0 += 64) {
    for (int64_t c = 0; c < m; ++c) part[c] = v[c] + d0;
    switch (std::min<int64_t>(8, (dim - d0) / 8)) {
#define ZT_NV(NV) \
      case NV: weigh_values<T, NV>(acc + d0, p, part, m); break;
      ZT_NV(1) ZT_NV(2) ZT_NV(3) ZT_NV(4) ZT_NV(5) ZT_NV(6) ZT_NV(7) ZT_NV(8)
#undef ZT_NV
      default: break;
    }
  }
}

// weigh_values for G query heads that share their values (a KV head's heads in one row): acc + g * astep
// += sum over c < m, in order, of p[g * pstep + c] * value c (elements 8 NV from v[c]); each value
// loaded once for the G heads, each head's sums the chain weigh_values gives it alone.
template <typename T, int G, int NV>
inline void weigh_heads(float* acc, int64_t astep, const float* p, int64_t pstep, const T* const* v, int64_t m) {
  __m256 sum[G][NV];
  for (int g = 0; g < G; ++g)
    for (int i = 0; i < NV; ++i) sum[g][i] = _mm256_loadu_ps(acc + g * astep + 8 * i);
  for (int64_t c = 0; c < m; ++c) {
    __m256 w[G];
    for (int g = 0; g < G; ++g) w[g] = _mm256_broadcast_ss(p + g * pstep + c);
    for (int i = 0; i < NV; ++i) {
      const __m256 x = load8<T>(v[c] + 8 * i);
      for (int g = 0; g < G; ++g) sum[g][i] = _mm256_fmadd_ps(w[g], x, sum[g][i]);
    }
  }
  for (int g = 0; g < G; ++g)
    for (int i = 0; i < NV; ++i) _mm256_storeu_ps(acc + g * astep + 8 * i, sum[g][i]);
}

// weigh_values_any for a row's ``group`` heads of one KV head (accumulators ``dim`` apart,
// probabilities ``pstep`` apart), up to 3 heads and 32 elements at a time (12 accumulators, the
// values and the heads' weights in the 16 registers): the same sums.
template <typename T>
inline void weigh_group(float* acc, const float* p, int64_t pstep, const T* const* v, int64_t m, int64_t dim,
                        int64_t group) {
  const T* part[kValueChunk];
  for (int64_t g0 = 0; g0 < group; g0 += 3) {
    const int64_t gs = std::min<int64_t>(3, group - g0);
    if (gs == 1) {
      weigh_values_any<T>(acc + g0 * dim, p + g0 * pstep, v, m, dim);
      continue;
    }
    for (int64_t d0 = 0; d0 < dim; d0 += 32) {
      for (int64_t c = 0; c < m; ++c) part[c] = v[c] + d0;
      float* a = acc + g0 * dim + d0;
      const float* pg = p + g0 * pstep;
      switch (std::min<int64_t>(4, (dim - d0) / 8) + 4 * (gs - 2)) {
#define ZT_GNV(G, NV) \
        case NV + 4 * (G - 2): weigh_heads<T, G, NV>(a, dim, pg, pstep, part, m); break;
        ZT_GNV(2, 1) ZT_GNV(2, 2) ZT_GNV(2, 3) ZT_GNV(2, 4) ZT_GNV(3, 1) ZT_GNV(3, 2) ZT_GNV(3, 3) ZT_GNV(3, 4)
#undef ZT_GNV
        default: break;
      }
    }
  }
}

// How many runs of 16 keys ahead a dense pool's keys are requested, and the most lines of one KV head's
// 16 vectors (heads of up to 256 fp32).
constexpr int64_t kKeysAhead = 2;
constexpr int64_t kMaxLines = kChunk * 256 * sizeof(float) / 64;

// The scores of a block's rows r0 .. r0 + nr - 1 (on one slot list) against its n keys, 16 keys at a
// time and per KV head: score + offset[w] + h * stride[w] holds row w's head h (stride: its length
// rounded up to 16). The keys: a dense pool read in place, or an 8-bit pool staged 16 positions at a
// time (stage_chunk) into ``staged``. A dense pool's keys kKeysAhead runs on are requested while the
// panels' products run, the lines of KV head kh's 16 vectors (dim * sizeof(T) / 4 of them where a
// vector fills whole lines) one per d of KV head kh's panel: requested all at once at the start of a
// run, the requests stalled the core (decodes' attention over a pool in DRAM took 1.07-1.18x the time
// on a Zen 3; prompts' the same).
template <typename T, typename Pool>
void block_scores(const float* qf, const Pool& kp, const int64_t* slot, const int64_t* len, const int64_t* offset,
                  const int64_t* stride, int64_t nr, int64_t n, int64_t heads, int64_t kv_heads, int64_t dim,
                  float* score, float* kt, float* staged, std::vector<const float*>& qs, std::vector<float*>& outs) {
  const int64_t group = heads / kv_heads;
  const char* ahead[kMaxLines];
  for (int64_t j0 = 0; j0 < n; j0 += kChunk) {
    const int64_t cn = std::min<int64_t>(kChunk, n - j0);
    if constexpr (!std::is_pointer_v<Pool>) stage_chunk<T>(kp, slot, j0, cn, n, kv_heads, dim, staged);
    for (int64_t kh = 0; kh < kv_heads; ++kh) {
      if constexpr (std::is_pointer_v<Pool>)
        key_panel<T>(kp, slot, j0, cn, kv_heads, kh, dim, kt);
      else
        key_panel<float>(staged, kStagedSlots, 0, cn, kv_heads, kh, dim, kt);
      qs.clear();
      outs.clear();
      for (int64_t w = 0; w < nr; ++w) {
        if (j0 >= len[w]) continue;
        for (int64_t h = kh * group; h < (kh + 1) * group; ++h) {
          qs.push_back(qf + (w * heads + h) * dim);
          outs.push_back(score + offset[w] + h * stride[w] + j0);
        }
      }
      int64_t nahead = 0;
      if constexpr (std::is_pointer_v<Pool>)
        for (int64_t j = j0 + kKeysAhead * kChunk; j < std::min<int64_t>(j0 + (kKeysAhead + 1) * kChunk, n); ++j)
          for (int64_t b = 0; b < dim * static_cast<int64_t>(sizeof(T)); b += 64)
            ahead[nahead++] = reinterpret_cast<const char*>(kp + (slot[j] * kv_heads + kh) * dim) + b;
      panel_scores_any(qs.data(), kt, dim, outs.data(), static_cast<int64_t>(qs.size()), ahead, nahead);
    }
  }
}

// The pools: dense (const T*) or 8-bit (KVSource, staged 16 positions at a time: the bits of the dense
// pool of kv_quant.dequantize's values).
template <typename T, typename Pool>
void attend_avx2(const T* q, const Pool& kp, const Pool& vp, const int64_t* slots, const int64_t* seq, const int64_t* lens,
                 T* out, int64_t rows, int64_t heads, int64_t kv_heads, int64_t dim, int64_t width, float scale) {
  const int64_t group = heads / kv_heads;
  const std::vector<int64_t> start = row_blocks(seq, rows);
  const int64_t blocks = static_cast<int64_t>(start.size()) - 1;
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), blocks));
  const std::vector<std::vector<int64_t>> share = deal(start, lens, threads);
  at::parallel_for(0, threads, 1, [&](int64_t first, int64_t last) {
    std::vector<float> score, qf(kBlock * heads * dim), acc(kBlock * heads * dim), kt(dim * 16), total(kBlock * heads);
    std::vector<float> staged(std::is_pointer_v<Pool> ? 0 : kChunk * kv_heads * dim);
    std::vector<const float*> qs;
    std::vector<float*> outs;
    int64_t offset[kBlock + 1], stride[kBlock];
    const T* vrow[kValueChunk];
    const float* srow[kChunk];
    for (int64_t t = first; t < last; ++t) {
      for (int64_t b : share[t]) {
        const int64_t r0 = start[b], nr = start[b + 1] - r0;
        const int64_t* slot = slots + seq[r0] * width;
        const int64_t* len = lens + r0;
        int64_t n = 0;  // the block's longest row
        offset[0] = 0;
        for (int64_t w = 0; w < nr; ++w) {
          n = std::max(n, len[w]);
          stride[w] = (len[w] + 15) / 16 * 16;
          offset[w + 1] = offset[w] + heads * stride[w];
        }
        score.resize(offset[nr]);
        for (int64_t i = 0; i < nr * heads * dim; ++i) qf[i] = static_cast<float>(q[r0 * heads * dim + i]) * scale;
        block_scores<T>(qf.data(), kp, slot, len, offset, stride, nr, n, heads, kv_heads, dim, score.data(), kt.data(),
                        staged.data(), qs, outs);
        for (int64_t w = 0; w < nr; ++w)
          for (int64_t h = 0; h < heads; ++h)
            total[w * heads + h] = softmax8(score.data() + offset[w] + h * stride[w], len[w]);
        std::fill(acc.begin(), acc.begin() + nr * heads * dim, 0.0f);
        // a prompt's rows: 32 keys at a time, each value weighed for up to 3 heads at once (a 2,048-token
        // prompt's attention 9-11% faster on a Zen 3); a decode (a block of one row): 16 keys, head by
        // head (its stream of values from memory ran 4-12% slower grouped)
        const bool prompt = nr > 1;
        const int64_t step = std::is_pointer_v<Pool> && prompt ? kValueChunk : kChunk;
        const int64_t at_once = prompt ? group : 1;
        for (int64_t j0 = 0; j0 < n; j0 += step) {
          const int64_t cn = std::min<int64_t>(step, n - j0);
          if constexpr (std::is_pointer_v<Pool>) {
            for (int64_t j = j0 + step; j < std::min<int64_t>(j0 + 2 * step, n); j += kChunk)
              prefetch_slots(vp, slot, j, n, kv_heads * dim);
          } else
            stage_chunk<T>(vp, slot, j0, cn, n, kv_heads, dim, staged.data());
          for (int64_t kh = 0; kh < kv_heads; ++kh) {
            for (int64_t c = 0; c < cn; ++c) {
              if constexpr (std::is_pointer_v<Pool>)
                vrow[c] = vp + (slot[j0 + c] * kv_heads + kh) * dim;
              else
                srow[c] = staged.data() + (c * kv_heads + kh) * dim;
            }
            for (int64_t w = 0; w < nr; ++w) {
              if (j0 >= len[w]) continue;
              const int64_t m = std::min<int64_t>(cn, len[w] - j0);
              float* a = acc.data() + (w * heads + kh * group) * dim;
              const float* p = score.data() + offset[w] + kh * group * stride[w] + j0;
              for (int64_t g = 0; g < group; g += at_once) {
                if constexpr (std::is_pointer_v<Pool>)
                  weigh_group<T>(a + g * dim, p + g * stride[w], stride[w], vrow, m, dim, at_once);
                else
                  weigh_group<float>(a + g * dim, p + g * stride[w], stride[w], srow, m, dim, at_once);
              }
            }
          }
        }
        for (int64_t w = 0; w < nr; ++w)
          for (int64_t h = 0; h < heads; ++h) {
            const float inv = 1.0f / total[w * heads + h];
            const float* a = acc.data() + (w * heads + h) * dim;
            T* o = out + ((r0 + w) * heads + h) * dim;
            for (int64_t d = 0; d < dim; ++d) o[d] = static_cast<T>(a[d] * inv);
          }
      }
    }
  });
}
#endif

// The fp32 kernels' dispatch: heads of 64 or 128 (float, bf16) on AVX-512; heads of a multiple of 8 up
// to 256 (float, bf16) on AVX2; everything else in the generic loop. ``Pool``: a dense pool (const T*)
// or an 8-bit one (KVSource), read in place by each.
template <typename T, typename Pool>
void attend(const T* q, const Pool& kp, const Pool& vp, const int64_t* slots, const int64_t* seq, const int64_t* lens,
            T* out, int64_t rows, int64_t heads, int64_t kv_heads, int64_t dim, int64_t width, float scale) {
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<T, float> || std::is_same_v<T, c10::BFloat16>) {
    if (dim == 64 && attend_fixed_group<T, 4>(q, kp, vp, slots, seq, lens, out, rows, heads, kv_heads, width, scale))
      return;
    if (dim == 128 && attend_fixed_group<T, 8>(q, kp, vp, slots, seq, lens, out, rows, heads, kv_heads, width, scale))
      return;
  }
#elif defined(__AVX2__) && defined(__FMA__)
  if constexpr (std::is_same_v<T, float> || std::is_same_v<T, c10::BFloat16>) {
    if (dim % 8 == 0 && dim <= 256) {
      attend_avx2<T, Pool>(q, kp, vp, slots, seq, lens, out, rows, heads, kv_heads, dim, width, scale);
      return;
    }
  }
#endif
  attend_generic<T>(q, kp, vp, slots, seq, lens, out, rows, heads, kv_heads, dim, width, scale);
}
