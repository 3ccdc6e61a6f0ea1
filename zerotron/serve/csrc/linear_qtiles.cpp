// ---- 8- and 4-bit weights dequantised to bf16 (the two kernels below) ---------------------------------
// Both multiply bf16 rows by the 8-bit kernel's weights (Q8Problem: any of its tables) dequantised as
// that kernel dequantises them (q8_dequant: fp32, q * s - m) and rounded once to bf16, the same bf16
// weights on either (kernel_definitions.dequantized_bf16 in PyTorch).
#if defined(ZT_DOT) && defined(ZT_Q8)
#define ZT_QBF16 1
#define ZT_QBF16_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma,f16c")))
// The 16 values of output o from input k (in group gi, scale sv, min mv) as bf16 at out: q8_dequant's
// q * s - m on 16 lanes instead of 8, rounded to nearest even.
template <int KIND>
ZT_QBF16_TARGET inline void qbf16_16(const Q8Problem& q, int64_t o, int64_t gi, int64_t k, __m512 sv, __m512 mv,
                                     bool mins, uint16_t* out) {
  const int8_t* qg = q.q + o * q.qo + gi * q.qg;
  __m128i v8;
  if constexpr (KIND == 1) {
    const __m128i low = _mm_set1_epi8(15);
    const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(qg + (k - gi * q.group) / 2));
    v8 = _mm_shuffle_epi8(_mm_load_si128(reinterpret_cast<const __m128i*>(q.lut)),
                          _mm_unpacklo_epi8(_mm_and_si128(b, low), _mm_and_si128(_mm_srli_epi16(b, 4), low)));
  } else {
    v8 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qg + (k - gi * q.group)));
  }
  const __m512 f = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(v8));
  const __m512 w = mins ? _mm512_fmsub_ps(f, sv, mv) : _mm512_mul_ps(f, sv);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), (__m256i)_mm512_cvtneps_pbh(w));
}

// Output o's weights of inputs [k0, k1) straight to bf16 at out, 16 at a time (groups of a multiple
// of 16 inputs), with no fp32 buffer between. s and m: the slice's groups' scales and mins (q8_factors).
template <int KIND>
ZT_QBF16_TARGET inline void qbf16_row(const Q8Problem& q, int64_t o, int64_t k0, int64_t k1, const float* s,
                                      const float* m, bool mins, uint16_t* out) {
  const int64_t g0 = k0 / q.group, count = (k1 - 1) / q.group - g0 + 1;
  for (int64_t c = 0; c < count; ++c) {
    const int64_t gi = g0 + c, start = std::max(k0, gi * q.group), end = std::min(k1, (gi + 1) * q.group);
    const __m512 sv = _mm512_set1_ps(s[c]), mv = _mm512_set1_ps(m[c]);
    for (int64_t k = start; k < end; k += 16) qbf16_16<KIND>(q, o, gi, k, sv, mv, mins, out + (k - k0));
  }
}

#endif

// ---- the same weights times bf16 rows on AVX512-BF16 (no AMX) ------------------------------------------
// y = x w^T on CPUs with AVX512-BF16 but without AMX tiles. Per task (48 outputs, a chunk of rows) the
// outputs' weights are dequantised to bf16 (16 outputs of 256 inputs at a time: 4-bit values looked up
// in their group's table, qdot_nibbles; others qbf16_row) and laid out as pack_dot lays out a weight
// (pairs of k, 48 outputs to a pair: 16 x 16 pairs transposed at a time, transpose16), and
// dot_linear's blocks (dot_rows) multiply that panel by every 8 rows of the chunk. An output
// element is its row of x times its panel column summed in fp32 over the pairs of k in order from
// zero (VDPBF16PS), rounded once to bf16: a row's numbers never depend on the other rows, on the
// chunks or on the threads. Tasks run output-major: a thread dequantises each panel once per call.
#if defined(ZT_QBF16)
#define ZT_QDOT 1
struct QDotProblem {
  Q8Problem q;        // the weights (q.x, q.y and q.ldx unused)
  const uint16_t* x;  // (rows, K) bf16, rows ldx apart
  uint16_t* y;        // (rows, n) bf16
  int64_t ldx, chunk, chunks;
};

// A group's 16 weights of 4-bit values (lut: the values of the 16 nibbles in fp32; scale s, min m) in
// bf16: q8_dequant's q * s - m for each value that a nibble can hold, rounded to nearest even; twice
// (entries 16-31 those of 0-15), so that an index's fifth bit does not matter.
ZT_QBF16_TARGET inline __m512i qbf16_table(__m512 lut, float s, float m, bool mins) {
  const __m512 sv = _mm512_set1_ps(s);
  const __m512 w = mins ? _mm512_fmsub_ps(lut, sv, _mm512_set1_ps(m)) : _mm512_mul_ps(lut, sv);
  return _mm512_broadcast_i64x4((__m256i)_mm512_cvtneps_pbh(w));
}

// 16 outputs' 4-bit weights of inputs [k0, k1) (a slice, groups of a multiple of 16) into the panel's
// columns 16 b .. 16 b + 15: per output and 32 inputs, its 16 bytes (16 pairs of nibbles) widened to
// a pair per 32-bit lane and looked up in its group's table of 16 bf16 weights (qbf16_table: the
// same bits as qbf16_16), then the 16 outputs' rows of 16 pairs transposed into 16 panel rows.
ZT_QBF16_TARGET void qdot_nibbles(const Q8Problem& q, int64_t ob, int64_t b, int64_t k0, int64_t k1, uint16_t* panel) {
  const bool mins = q.m1.kind != 0, split = q.group % 32 != 0;  // split: a group ends mid-way through 32 inputs
  const int64_t g0 = k0 / q.group, count = (k1 - 1) / q.group - g0 + 1;
  const int64_t* e0 = q.slices + (k0 / QKS) * 8;
  const __m512 lut = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_load_si128(reinterpret_cast<const __m128i*>(q.lut))));
  float s[16][QKS / 8], m[16][QKS / 8];
  __m512i tables[16];  // each output's table of its group gi (made where a group starts)
  const int64_t ow = std::min<int64_t>(16, q.n - ob);
  for (int64_t j = 0; j < ow; ++j) q8_factors(q, ob + j, e0, e0 + 4, count, s[j], m[j]);
  for (int64_t k = k0; k < k1; k += 32) {
    const int64_t gi = k / q.group, c = gi - g0, at = (k - gi * q.group) / 2;
    const bool across = split && at + 16 > q.group / 2, start = at == 0 || k == k0;
    __m512i r[16];
    for (int64_t j = 0; j < 16; ++j) {
      if (j >= ow) {
        r[j] = _mm512_setzero_si512();
        continue;
      }
      const int8_t* qo = q.q + (ob + j) * q.qo;
      __m128i bytes;
      if (!across) {
        bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qo + gi * q.qg + at));
      } else {  // the first 8 bytes in group gi, the last 8 in the next
        bytes = _mm_unpacklo_epi64(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(qo + gi * q.qg + at)),
                                   _mm_loadl_epi64(reinterpret_cast<const __m128i*>(qo + (gi + 1) * q.qg)));
      }
      // lane p: pair p's byte b, as the indices b (low half: bits 0-3, the first input's nibble) and
      // b << 12 (high half: bits 16-19, the second's); vpermw reads an index's five low bits
      const __m512i v = _mm512_cvtepu8_epi32(bytes);
      const __m512i idx = _mm512_or_si512(v, _mm512_slli_epi32(v, 12));
      if (start) tables[j] = qbf16_table(lut, s[j][c], m[j][c], mins);
      r[j] = _mm512_permutexvar_epi16(idx, tables[j]);
      if (across) {  // the upper pairs from the next group's table
        tables[j] = qbf16_table(lut, s[j][c + 1], m[j][c + 1], mins);
        const __mmask32 upper = ~((1u << (2 * (q.group / 2 - at))) - 1);
        r[j] = _mm512_mask_permutexvar_epi16(r[j], upper, idx, tables[j]);
      }
    }
    transpose16(r);
    for (int pp = 0; pp < 16; ++pp) _mm512_store_si512(panel + (k / 2 + pp) * DNR * 2 + 32 * b, r[pp]);
  }
}

// The panel of outputs o0 .. o0 + 47 (zero columns past n) as dot_rows reads it: pair P's 48 outputs'
// two values at panel + 96 P. rows: a 16 x 256 bf16 buffer, f: 16 x 256 fp32 (groups of 8 or 24).
template <int KIND>
ZT_QBF16_TARGET void qdot_panel(const Q8Problem& q, int64_t o0, uint16_t* panel, uint16_t* rows, float* f) {
  const bool mins = q.m1.kind != 0;
  // inputs a line of values holds (a line per group where an output's groups are not side by side)
  const int64_t per_line = KIND == 1 ? 128 : 64, line = q.qg * (KIND == 1 ? 2 : 1) == q.group ? per_line : std::min(per_line, q.group);
  float s[QKS / 8], m[QKS / 8];
  for (int64_t b = 0; b < DNR / 16; ++b) {
    const int64_t ob = o0 + 16 * b;
    for (int64_t k0 = 0; k0 < q.k; k0 += QKS) {
      const int64_t k1 = std::min(q.k, k0 + QKS);
      // the next slice's values (or the next 16 outputs' first) fetched meanwhile: 16 outputs' few
      // lines a slice are too short a stream for the hardware to fetch ahead
      const int64_t nk = k1 < q.k ? k1 : 0, no = k1 < q.k ? ob : ob + 16, nk1 = std::min(q.k, nk + QKS);
      for (int64_t j = 0; j < 16 && no + j < q.n; ++j)
        for (int64_t k = nk; k < nk1; k += line) q8_prefetch_value(q, no + j, k / q.group, k % q.group);
      if (KIND == 1 && q.group % 16 == 0) {
        qdot_nibbles(q, ob, b, k0, k1, panel);
        continue;
      }
      if (q.group % 16 == 0) {  // output by output
        const int64_t count = (k1 - 1) / q.group - k0 / q.group + 1;
        const int64_t* e0 = q.slices + (k0 / QKS) * 8;
        for (int64_t j = 0; j < 16; ++j) {
          if (ob + j >= q.n) {
            std::memset(rows + j * QKS, 0, (k1 - k0) * 2);
            continue;
          }
          q8_factors(q, ob + j, e0, e0 + 4, count, s, m);
          qbf16_row<KIND>(q, ob + j, k0, k1, s, m, mins, rows + j * QKS);
        }
      } else {
        q8_dequant<KIND>(q, ob, k0, k1, f, 16, QKS);  // groups of 8 or 24: 8 values at a time
        for (int64_t j = 0; j < 16; ++j)
          for (int64_t kk = 0; kk < k1 - k0; kk += 32) {
            const __m512 lo = _mm512_load_ps(f + j * QKS + kk), hi = _mm512_load_ps(f + j * QKS + kk + 16);
            _mm512_store_si512(rows + j * QKS + kk, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
          }
      }
      for (int64_t kk = 0; kk < k1 - k0; kk += 32) {
        __m512i r[16];
        for (int j = 0; j < 16; ++j) r[j] = _mm512_load_si512(rows + j * QKS + kk);
        transpose16(r);
        for (int pp = 0; pp < 16; ++pp) _mm512_store_si512(panel + ((k0 + kk) / 2 + pp) * DNR * 2 + 32 * b, r[pp]);
      }
    }
  }
}

// Tasks [begin, end) of one thread: task = (48 outputs, chunk of rows), output-major. dot_linear's
// target, so that its blocks are inlined here as in dot_tasks (called, they keep their sums on the stack).
ZT_DOT_TARGET void qdot_tasks(const QDotProblem& t, int64_t begin, int64_t end) {
  const Q8Problem& q = t.q;
  const int64_t pairs = q.k / 2, size = pairs * DNR * 2;
  thread_local std::vector<uint16_t> held;  // the panel, then the rows' buffer, from a 64-byte boundary
  if (static_cast<int64_t>(held.size()) < size + 16 * QKS + 32) held.resize(size + 16 * QKS + 32);
  uint16_t* panel = held.data() + (-(reinterpret_cast<uintptr_t>(held.data()) / 2) & 31);
  uint16_t* rows = panel + size;
  alignas(64) float f[16 * QKS];
  alignas(64) float c[DMC * DNR];
  int64_t have = -1;
  for (int64_t task = begin; task < end; ++task) {
    const int64_t p = task / t.chunks, mc = task % t.chunks, o0 = p * DNR;
    if (p != have) {
      if (q.kind == 1) qdot_panel<1>(q, o0, panel, rows, f);  // never kind 2: q8_entry refuses bf16 values
      else qdot_panel<0>(q, o0, panel, rows, f);
      have = p;
    }
    const int64_t m0 = mc * t.chunk, m1 = std::min(q.rows, m0 + t.chunk);
    for (int64_t k0 = 0; k0 < pairs; k0 += DKC) {
      const int64_t k1 = std::min(pairs, k0 + DKC);
      for (int64_t m = m0; m < m1; m += 8)
        dot_rows(t.x + m * t.ldx, t.ldx, panel, k0, k1, c + (m - m0) * DNR, k0 == 0,
                 m == m0 ? panel + k1 * DNR * 2 : nullptr, std::min<int64_t>(8, m1 - m));
    }
    dot_store(c, m0, m1, o0, std::min(DNR, q.n - o0), nullptr, t.y, q.n);
  }
}

void qdot_linear_run(QDotProblem t) {
  const std::vector<int64_t> slices = q8_slices(t.q);
  t.q.slices = slices.data();
  const int64_t tasks = (t.q.n + DNR - 1) / DNR * t.chunks;
  at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) { qdot_tasks(t, begin, end); });
}
#endif

// ---- 8- and 4-bit weights times bf16 rows on AMX tiles ----------------------------------------------
// y = x w^T for bf16 x (rows, K) and the weights above, on CPUs with AMX. Per task (a chunk of rows, 32
// outputs) the outputs' weights are dequantised to bf16 into a panel (32 x K), which tile products
// then multiply by every 16-row block of the chunk.
// The weights are the A tiles (16 outputs of 32 inputs each: the panel's rows as they are, no
// transpose) and the rows the B tiles (x packed as pack_tiles packs a weight). An output element is its
// row of x times its panel row summed in fp32 over k in 32-deep tile products in k order, rounded once
// to bf16: a row's numbers never depend on the other rows, on the chunks or on the threads. Tasks run
// output-major, so a thread dequantises each of its panels once per call whatever the row count: a
// prompt's hundreds of rows pay the dequantisation once, where a row-at-a-time kernel pays per row.
#if defined(ZT_TILES) && defined(ZT_QBF16)
#define ZT_QTILES 1
#define ZT_QTILE_TARGET __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma,f16c")))
struct QTileProblem {
  Q8Problem q;         // the weights (q.x, q.y and q.ldx unused)
  const uint16_t* xp;  // x packed: (row blocks of 16, kblocks, 16 pairs of k, 16 rows, 2)
  uint16_t* y;         // (rows, n) bf16
  int64_t kblocks, chunk, chunks;
};

constexpr int64_t QTO = 32;  // outputs per task: two A tiles

// The panel of outputs o0 .. o0 + 31 (zero rows past n), rows kp values apart: each
// weight q8_dequant's fp32 value rounded to bf16 (round to nearest even), 256 inputs at a time.
template <int KIND>
ZT_QTILE_TARGET void qtile_panel(const Q8Problem& q, int64_t o0, int64_t kp, uint16_t* panel) {
  if (q.group % 16 == 0) {  // output by output: each reads its values in one stream
    const bool mins = q.m1.kind != 0;
    float s[QKS / 8], m[QKS / 8];
    for (int64_t j = 0; j < QTO; ++j) {
      if (o0 + j >= q.n) {
        std::memset(panel + j * kp, 0, q.k * 2);
        continue;
      }
      for (int64_t k0 = 0; k0 < q.k; k0 += QKS) {
        const int64_t k1 = std::min(q.k, k0 + QKS), count = (k1 - 1) / q.group - k0 / q.group + 1;
        const int64_t* e0 = q.slices + (k0 / QKS) * 8;
        q8_factors(q, o0 + j, e0, e0 + 4, count, s, m);
        qbf16_row<KIND>(q, o0 + j, k0, k1, s, m, mins, panel + j * kp + k0);
      }
    }
    return;
  }
  alignas(64) float f[QTO * QKS];
  for (int64_t k0 = 0; k0 < q.k; k0 += QKS) {
    const int64_t k1 = std::min(q.k, k0 + QKS);
    q8_dequant<KIND>(q, o0, k0, k1, f, QTO, QKS);  // groups of 8 or 24: 8 values at a time
    for (int64_t j = 0; j < QTO; ++j)
      for (int64_t kk = 0; kk < k1 - k0; kk += 32) {
        const __m512 lo = _mm512_load_ps(f + j * QKS + kk), hi = _mm512_load_ps(f + j * QKS + kk + 16);
        _mm512_storeu_si512(panel + j * kp + k0 + kk, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
      }
  }
}

// A call of at most 32 rows (a decode step): outputs o0 .. o0 + 31 of the ma x 16 outputs and nb x 16
// rows, into c as tile_block stores it. Each 32-input step's weights are dequantised into a 2 KB
// buffer and multiplied at once, with no panel's trip through L2: the same bf16 weights and the same
// tile products in the same k order as the panel path, so the same bits. Groups of a multiple of 16.
template <int KIND>
ZT_QTILE_TARGET void qtile_small(const QTileProblem& t, int64_t o0, int ma, int nb, float* c) {
  const Q8Problem& q = t.q;
  const bool mins = q.m1.kind != 0;
  alignas(64) uint16_t a[QTO * 32];
  float s[QTO][QKS / 8], m[QTO][QKS / 8];
  int64_t group_of[QKS / 16];  // each 16 inputs' group in its slice, from the slice's first
  const uint16_t* b0 = t.xp;
  const uint16_t* b1 = t.xp + t.kblocks * 512;
  const int64_t ow = std::min(QTO, q.n - o0);
  std::memset(a, 0, sizeof(a));  // the outputs past n stay zero
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t k0 = 0; k0 < q.k; k0 += QKS) {
    const int64_t k1 = std::min(q.k, k0 + QKS), g0 = k0 / q.group, count = (k1 - 1) / q.group - g0 + 1;
    const int64_t* e0 = q.slices + (k0 / QKS) * 8;
    for (int64_t i = 0; i < (k1 - k0) / 16; ++i) group_of[i] = (k0 + 16 * i) / q.group - g0;
    for (int64_t j = 0; j < ow; ++j) q8_factors(q, o0 + j, e0, e0 + 4, count, s[j], m[j]);
    for (int64_t kb = k0 / 32; kb < k1 / 32; ++kb) {
      for (int64_t j = 0; j < ow; ++j)
        for (int64_t h = 0; h < 2; ++h) {
          const int64_t k = kb * 32 + 16 * h, gc = group_of[(k - k0) / 16];
          qbf16_16<KIND>(q, o0 + j, g0 + gc, k, _mm512_set1_ps(s[j][gc]), _mm512_set1_ps(m[j][gc]), mins,
                         a + j * 32 + 16 * h);
        }
      _tile_loadd(4, a, 64);
      _tile_loadd(6, b0 + kb * 512, 64);
      _tile_dpbf16ps(0, 4, 6);
      if (nb == 2) {
        _tile_loadd(7, b1 + kb * 512, 64);
        _tile_dpbf16ps(1, 4, 7);
      }
      if (ma == 2) {
        _tile_loadd(5, a + 16 * 32, 64);
        _tile_dpbf16ps(2, 5, 6);
        if (nb == 2) _tile_dpbf16ps(3, 5, 7);
      }
    }
  }
  char* cc = reinterpret_cast<char*>(c);
  _tile_stored(0, cc, 128);
  if (nb == 2) _tile_stored(1, cc + 64, 128);
  if (ma == 2) _tile_stored(2, cc + 16 * 128, 128);
  if (ma == 2 && nb == 2) _tile_stored(3, cc + 16 * 128 + 64, 128);
}

// Rows m0 + r0 .. m0 + r1 - 1 of outputs o0 .. o0 + ow - 1 from c[output][row] (as tile_block stores
// it), rounded to bf16: each row's outputs, 16 at a time, gathered down a column of c. (The bf16 tile
// target: its callers include tile_block's work, run inside tile_block.)
ZT_TILE_TARGET inline void qtile_store(const QTileProblem& t, const float* c, int64_t m0, int64_t r0, int64_t r1,
                                       int64_t o0, int64_t ow) {
  const __m512i column = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                            _mm512_set1_epi32(32));
  for (int64_t r = r0; r < r1; ++r)
    for (int64_t j = 0; j < ow; j += 16) {
      const __mmask16 keep = ow - j >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (ow - j)) - 1);
      const __m512 v = _mm512_mask_i32gather_ps(_mm512_setzero_ps(), keep, column, c + j * 32 + r, 4);
      _mm256_mask_storeu_epi16(t.y + (m0 + r) * t.q.n + o0 + j, keep, (__m256i)_mm512_cvtneps_pbh(v));
    }
}

// A block's stores (qtile_store) spread over the next block's k steps, `per` rows a step (as the bf16
// tile linear's TileEpilogue).
struct QTileEpilogue {
  const QTileProblem* t = nullptr;
  const float* c = nullptr;
  int64_t m0 = 0, mr = 0, o0 = 0, ow = 0, per = 0;
  ZT_TILE_TARGET inline void operator()(int64_t kb) const {
    const int64_t r0 = kb * per;
    if (r0 < mr) qtile_store(*t, c, m0, r0, std::min(mr, r0 + per), o0, ow);
  }
  ZT_TILE_TARGET inline void finish() const {
    if (t) qtile_store(*t, c, m0, 0, mr, o0, ow);
  }
};

// Tasks [begin, end) of one thread: task = (32 outputs, chunk of rows), output-major. Each block's
// sums go to one of two buffers and are stored during the next block's products.
ZT_QTILE_TARGET void qtile_tasks(const QTileProblem& t, int64_t begin, int64_t end) {
  load_tile_config();
  const Q8Problem& q = t.q;
  // panel rows 64 bytes longer than K: an A tile's 16 rows never all fall in one cache set (rows a
  // power of two bytes apart would, and the tile loads would miss in L1)
  const int64_t kp = t.kblocks * 32 + 32, rows = q.rows, n = q.n;
  thread_local std::vector<uint16_t> panel;
  if (static_cast<int64_t>(panel.size()) < QTO * kp) panel.resize(QTO * kp);
  alignas(64) float c[2][32 * 32];
  const bool small = rows <= 32 && q.group % 16 == 0;
  int64_t have = -1;
  QTileEpilogue pending;  // the previous block's stores (none yet; never in small calls)
  int cur = 0;
  for (int64_t task = begin; task < end; ++task) {
    const int64_t p = task / t.chunks, mc = task % t.chunks, o0 = p * QTO;
    if (small) {
      const int ma = n - o0 > 16 ? 2 : 1, nb = rows > 16 ? 2 : 1;
      if (q.kind == 1) qtile_small<1>(t, o0, ma, nb, c[0]);
      else qtile_small<0>(t, o0, ma, nb, c[0]);
      qtile_store(t, c[0], 0, 0, rows, o0, std::min(QTO, n - o0));
      continue;
    }
    if (p != have) {
      if (q.kind == 1) qtile_panel<1>(q, o0, kp, panel.data());  // never kind 2: q8_entry refuses bf16 values
      else qtile_panel<0>(q, o0, kp, panel.data());
      have = p;
    }
    const int64_t ow = std::min(QTO, n - o0);
    const uint16_t* a0 = panel.data();
    const uint16_t* a1 = a0 + 16 * kp;
    for (int64_t m0 = mc * t.chunk; m0 < std::min(rows, (mc + 1) * t.chunk); m0 += 32) {
      const uint16_t* b0 = t.xp + (m0 / 16) * t.kblocks * 512;
      const uint16_t* b1 = b0 + t.kblocks * 512;
      const int64_t mr = std::min<int64_t>(32, rows - m0);
      float* cc = c[cur];
      if (ow > 16 && mr > 16) tile_block<2, 2>(a0, kp * 2, a1, kp * 2, b0, b1, t.kblocks, cc, pending);
      else if (ow > 16) tile_block<2, 1>(a0, kp * 2, a1, kp * 2, b0, b1, t.kblocks, cc, pending);
      else if (mr > 16) tile_block<1, 2>(a0, kp * 2, a1, kp * 2, b0, b1, t.kblocks, cc, pending);
      else tile_block<1, 1>(a0, kp * 2, a1, kp * 2, b0, b1, t.kblocks, cc, pending);
      pending = QTileEpilogue{&t, cc, m0, mr, o0, ow, (mr + t.kblocks - 1) / t.kblocks};
      cur ^= 1;
    }
  }
  pending.finish();
  _tile_release();
}

void qtile_linear_run(QTileProblem t) {
  const std::vector<int64_t> slices = q8_slices(t.q);
  t.q.slices = slices.data();
  const int64_t tasks = (t.q.n + QTO - 1) / QTO * t.chunks;
  at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) { qtile_tasks(t, begin, end); });
}
#endif
