// Rows per chunk: `rows` cut into as few chunks of at most `most` as it takes, of equal size rounded
// up to `unit`. The threads share tasks chunk-major, so unequal chunks (128 + 20 rows) would leave
// one thread most of the work.
inline int64_t even_chunk(int64_t rows, int64_t most, int64_t unit) {
  const int64_t chunks = (rows + most - 1) / most, per = (rows + chunks - 1) / chunks;
  return std::min(most, (per + unit - 1) / unit * unit);
}

// ---- bf16 linear layers on AMX tiles ---------------------------------------------------------------
// y = x w^T (+ bias) for bf16 x (rows, K) and w packed by pack_tiles: (N/16, K/32, 16, 16, 2), each
// 16-column, 32-deep block one B tile (pairs of k per row, as TDPBF16PS reads them). An output
// element is its row of x times its column of w summed over k in 32-deep tile products in k order,
// in fp32, rounded once to bf16 after the bias: a row's numbers never depend on the other rows or
// on how the columns are shared among threads.
#if defined(__x86_64__) && (defined(__clang__) || (defined(__GNUC__) && __GNUC__ >= 11))
#define ZT_TILES 1
#define ZT_TILE_TARGET __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512bf16")))
struct TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {0};
  uint16_t colsb[16] = {0};
  uint8_t rows[16] = {0};
};

// A config loaded for this thread. The config's bytes are handed to an empty asm that reads memory
// first: gcc 12.2.0 inlined a config built in a loop into its caller and dropped the stores of the rows
// and widths before LDTILECFG (a zero config, and the fault that loading it raises).
ZT_TILE_TARGET __attribute__((always_inline)) inline void load_config(const TileConfig& cfg) {
  __asm__ __volatile__("" : : "r"(&cfg) : "memory");
  _tile_loadconfig(&cfg);
}

// Every tile 64 bytes wide, for this thread: tiles 0-4 (the C and A tiles) of ``rows`` rows, 5-7 (B)
// of 16; the linear kernels' one shape is 16 rows of every tile.
ZT_TILE_TARGET inline void load_tile_config(int64_t rows = 16) {
  TileConfig cfg;
  for (int i = 0; i < 8; ++i) {
    cfg.rows[i] = i < 5 ? static_cast<uint8_t>(rows) : 16;
    cfg.colsb[i] = 64;
  }
  load_config(cfg);
}

// One block of MA x 16 rows (A tiles 4, 5: 16 rows each from a0, a1, lda0/lda1 bytes apart) times
// NB x 16 columns (B tiles 6, 7), summed into C tiles 0-3 over all k, stored to c (32 x 32 fp32).
// Each product follows the loads it needs, the next tile's load behind it (as the quantised tiles'
// loop is ordered): with the four loads first, SmolLM2's gate/up product at 2,048 rows ran at
// 1.45-1.67 TFLOP/s (2 threads), 1.70-2.13 this way; each C tile's sum over k the same, so its bits.
// `work(kb)` runs after each k step's products are issued: vector work of another block (its
// epilogue) that the core then does while the tile unit multiplies.
struct NoWork {
  inline void operator()(int64_t) const {}
};

template <int MA, int NB, typename Work = NoWork>
ZT_TILE_TARGET inline void tile_block(const uint16_t* a0, int64_t lda0, const uint16_t* a1, int64_t lda1,
                                      const uint16_t* b0, const uint16_t* b1, int64_t kblocks, float* c,
                                      const Work& work = Work()) {
  _tile_zero(0);
  if (NB == 2) _tile_zero(1);
  if (MA == 2) _tile_zero(2);
  if (MA == 2 && NB == 2) _tile_zero(3);
  for (int64_t kb = 0; kb < kblocks; ++kb) {
    _tile_loadd(4, a0 + kb * 32, lda0);
    _tile_loadd(6, b0 + kb * 512, 64);
    _tile_dpbf16ps(0, 4, 6);
    if (NB == 2) {
      _tile_loadd(7, b1 + kb * 512, 64);
      _tile_dpbf16ps(1, 4, 7);
    }
    if (MA == 2) {
      _tile_loadd(5, a1 + kb * 32, lda1);
      _tile_dpbf16ps(2, 5, 6);
      if (NB == 2) _tile_dpbf16ps(3, 5, 7);
    }
    work(kb);
  }
  char* cc = reinterpret_cast<char*>(c);
  _tile_stored(0, cc, 128);
  if (NB == 2) _tile_stored(1, cc + 64, 128);
  if (MA == 2) _tile_stored(2, cc + 16 * 128, 128);
  if (MA == 2 && NB == 2) _tile_stored(3, cc + 16 * 128 + 64, 128);
}

// A linear's operands: x rows of `ldx` elements (the first `full` rows, a multiple of 16, read in
// place), tail the rest (under 16) zero-padded to 16 rows of kblocks * 32; y (rows, n). Two
// epilogues fused: `res` (rows, n) added to the rounded product and the sum rounded (torch's
// `res + y` in bf16), or, `gate` > 0, a gated MLP's gate and up columns side by side (n = 2 gate,
// gate a multiple of 16): y (rows, gate) is SiLU(gate) * up of the rounded products (silu_mul16).
struct TileProblem {
  const uint16_t *x, *tail, *w;
  const float* bias;
  uint16_t* y;
  int64_t ldx, full, rows, n, nblocks, kblocks, chunk;
  const uint16_t* res = nullptr;
  int64_t gate = 0;
};

constexpr int64_t MCHUNK = 128;  // most rows of x a thread keeps in cache while it walks its columns

// 16 fp32 values as bf16 (TDPBF16PS's products are stored so: VCVTNEPS2BF16), back in fp32.
ZT_TILE_TARGET inline __m512 tile_round(__m512 v) {
  return widen_bf16((__m256i)_mm512_cvtneps_pbh(v));
}

// Rows r0 .. r1 - 1 of the sums c (rows of 32 fp32, output rows m0 on) of the 16-column blocks at
// columns col0 and col1 stored to y: each plus its bias, rounded to bf16 (plus t.res's value, rounded
// again), or for a gated product SiLU(the first) * the second.
ZT_TILE_TARGET inline void tile_store(const TileProblem& t, const float* c, int64_t m0, int64_t r0, int64_t r1,
                                      int64_t col0, int64_t col1, int64_t nbs) {
  if (t.gate) {
    const __m512 bg = t.bias ? _mm512_loadu_ps(t.bias + col0) : _mm512_setzero_ps();
    const __m512 bu = t.bias ? _mm512_loadu_ps(t.bias + col1) : _mm512_setzero_ps();
    for (int64_t r = r0; r < r1; ++r) {
      const __m512 g = tile_round(_mm512_add_ps(_mm512_loadu_ps(c + r * 32), bg));
      const __m512 u = tile_round(_mm512_add_ps(_mm512_loadu_ps(c + r * 32 + 16), bu));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(t.y + (m0 + r) * t.gate + col0), narrow_bf16(silu_mul16(g, u)));
    }
    return;
  }
  for (int64_t half = 0; half < nbs; ++half) {
    const int64_t col = half ? col1 : col0;
    if (col >= t.n) break;
    const __mmask16 keep = t.n - col >= 16 ? static_cast<__mmask16>(0xFFFF)
                                           : static_cast<__mmask16>((1u << (t.n - col)) - 1);
    const __m512 b = t.bias ? _mm512_maskz_loadu_ps(keep, t.bias + col) : _mm512_setzero_ps();
    for (int64_t r = r0; r < r1; ++r) {
      __m512 v = _mm512_loadu_ps(c + r * 32 + half * 16);
      if (t.bias) v = _mm512_add_ps(v, b);
      uint16_t* out = t.y + (m0 + r) * t.n + col;
      if (t.res) {
        v = _mm512_add_ps(tile_round(v), widen_bf16(_mm256_maskz_loadu_epi16(keep, t.res + (m0 + r) * t.n + col)));
        _mm256_mask_storeu_epi16(out, keep, narrow_bf16(round_bf16(v)));
      } else {
        _mm256_mask_storeu_epi16(out, keep, (__m256i)_mm512_cvtneps_pbh(v));
      }
    }
  }
}

// A block's epilogue (tile_store) spread over the next block's k steps, `per` rows a step: the
// stores' vector work beside the next products instead of between them.
struct TileEpilogue {
  const TileProblem* t = nullptr;
  const float* c = nullptr;
  int64_t m0 = 0, mr = 0, col0 = 0, col1 = 0, nbs = 0, per = 0;
  ZT_TILE_TARGET inline void operator()(int64_t kb) const {
    const int64_t r0 = kb * per;
    if (r0 < mr) tile_store(*t, c, m0, r0, std::min(mr, r0 + per), col0, col1, nbs);
  }
  ZT_TILE_TARGET inline void finish() const {
    if (t) tile_store(*t, c, m0, 0, mr, col0, col1, nbs);
  }
};

// Tasks [begin, end) of one thread: task = (chunk of rows, pair of 16-column blocks), chunk-major; a
// gated product's pairs are a gate block and its up block (gate / 16 blocks on). Each block's sums
// go to one of two buffers and are stored during the next block's products.
ZT_TILE_TARGET void tile_tasks(const TileProblem& t, int64_t begin, int64_t end) {
  load_tile_config();
  alignas(64) float c[2][32 * 32];
  const int64_t pairs = t.gate ? t.gate / 16 : (t.nblocks + 1) / 2, kblocks = t.kblocks, rows = t.rows;
  const int64_t full = t.full;
  TileEpilogue pending;  // the previous block's stores (none yet)
  int cur = 0;
  for (int64_t task = begin; task < end; ++task) {
    const int64_t p = task % pairs, mc = task / pairs;
    const int64_t nb = t.gate ? p : 2 * p, nb2 = t.gate ? t.gate / 16 + p : nb + 1;
    const int64_t nbs = std::min<int64_t>(2, t.nblocks - nb);
    const uint16_t* b0 = t.w + nb * kblocks * 512;
    const uint16_t* b1 = t.w + nb2 * kblocks * 512;
    for (int64_t m0 = mc * t.chunk; m0 < std::min(rows, (mc + 1) * t.chunk); m0 += 32) {
      const uint16_t* a0 = m0 < full ? t.x + m0 * t.ldx : t.tail;
      const uint16_t* a1 = m0 + 16 < full ? t.x + (m0 + 16) * t.ldx : t.tail;
      const int64_t lda0 = (m0 < full ? t.ldx : kblocks * 32) * 2;
      const int64_t lda1 = (m0 + 16 < full ? t.ldx : kblocks * 32) * 2;
      float* cc = c[cur];
      if (rows - m0 > 16 && nbs == 2) tile_block<2, 2>(a0, lda0, a1, lda1, b0, b1, kblocks, cc, pending);
      else if (rows - m0 > 16) tile_block<2, 1>(a0, lda0, a1, lda1, b0, b1, kblocks, cc, pending);
      else if (nbs == 2) tile_block<1, 2>(a0, lda0, a1, lda1, b0, b1, kblocks, cc, pending);
      else tile_block<1, 1>(a0, lda0, a1, lda1, b0, b1, kblocks, cc, pending);
      const int64_t mr = std::min<int64_t>(32, rows - m0);
      pending = TileEpilogue{&t, cc, m0, mr, nb * 16, nb2 * 16, nbs, (mr + kblocks - 1) / kblocks};
      cur ^= 1;
    }
  }
  pending.finish();
  _tile_release();
}

void tile_linear_run(const TileProblem& t) {
  const int64_t pairs = t.gate ? t.gate / 16 : (t.nblocks + 1) / 2, chunks = (t.rows + t.chunk - 1) / t.chunk;
  at::parallel_for(0, chunks * pairs, 1, [&](int64_t begin, int64_t end) { tile_tasks(t, begin, end); });
}
#endif
// ---- fp32 linear layers on AVX-512 -----------------------------------------------------------------
// y = x w^T (+ bias) for fp32 x (rows, K) and w packed by pack_vec: (N/48, K, 48), each 48-column
// panel k-major. An output element is one fused multiply-add chain over k in order from zero, the
// bias added after: a row's numbers never depend on the other rows, on the blocking, or on how the
// panels are shared among threads. Blocks of up to 8 rows x 48 columns keep 24 accumulators in
// registers; k is walked in 64-deep slices, every row block of a chunk through a slice while it is
// in L1, the next slice fetched into L1 and the fifth into L2 meanwhile (the panels of a thread's
// tasks follow each other in memory, so the fetches run on into its next panel), so that few rows
// cost about one read of the weights and many rows run at the FMA units' rate.
#if defined(__x86_64__) && (defined(__clang__) || defined(__GNUC__))
#define ZT_VEC 1
#if defined(__clang__)
#define ZT_VEC_TARGET __attribute__((target("avx512f")))
#define ZT_VEC_ORDER _Pragma("clang fp reassociate(off)")
#else  // the chains must stay chains: no reassociation here whatever the file's flags
#define ZT_VEC_TARGET __attribute__((target("avx512f"), optimize("no-associative-math")))
#define ZT_VEC_ORDER
#endif
constexpr int64_t VNR = 48, VMC = 128, VKC = 64;  // panel columns, rows per task, k per slice
constexpr int64_t VAHEAD = 4 * VKC * VNR;  // how far ahead (floats) the weights are fetched into L2

struct VecProblem {
  const float *x, *w, *bias;
  float* y;
  int64_t ldx, rows, n, k, panels, chunk;
};

// One k's row of the next slice's panel (at) into L1, and the row VAHEAD on into L2 (vec_block's and
// vec2_block's fetches; inlined into either target).
__attribute__((always_inline)) inline void vec_fetch_ahead(const float* at) {
  const char* p = reinterpret_cast<const char*>(at);
  const char* q = reinterpret_cast<const char*>(at + VAHEAD);
  for (int i = 0; i < 3; ++i) {
    _mm_prefetch(p + 64 * i, _MM_HINT_T0);
    _mm_prefetch(q + 64 * i, _MM_HINT_T1);
  }
}

// MR rows of x (ldx apart) times one panel over k in [k0, k1), the sums carried in c (48 per row);
// pf: where the next slice starts (prefetched into L1 while this one is multiplied, and the weights four
// slices further on into L2: from memory, one slice ahead is too late to keep the FMA units fed), or null
template <int MR>
ZT_VEC_TARGET inline void vec_block(const float* x, int64_t ldx, const float* w, int64_t k0, int64_t k1,
                                    float* c, bool first, const float* pf) {
  ZT_VEC_ORDER
  __m512 acc[MR][3];
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < 3; ++j) acc[r][j] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(c + r * VNR + j * 16);
  for (int64_t k = k0; k < k1; ++k) {
    const float* wk = w + k * VNR;
    const __m512 w0 = _mm512_load_ps(wk), w1 = _mm512_load_ps(wk + 16), w2 = _mm512_load_ps(wk + 32);
    if (pf) vec_fetch_ahead(pf + (k - k0) * VNR);
    for (int r = 0; r < MR; ++r) {
      const __m512 a = _mm512_set1_ps(x[r * ldx + k]);
      acc[r][0] = _mm512_fmadd_ps(a, w0, acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(a, w1, acc[r][1]);
      acc[r][2] = _mm512_fmadd_ps(a, w2, acc[r][2]);
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < 3; ++j) _mm512_storeu_ps(c + r * VNR + j * 16, acc[r][j]);
}

ZT_VEC_TARGET void vec_rows(const float* x, int64_t ldx, const float* w, int64_t k0, int64_t k1, float* c,
                            bool first, const float* pf, int64_t mr) {
  switch (mr) {
    case 8: vec_block<8>(x, ldx, w, k0, k1, c, first, pf); break;
    case 7: vec_block<7>(x, ldx, w, k0, k1, c, first, pf); break;
    case 6: vec_block<6>(x, ldx, w, k0, k1, c, first, pf); break;
    case 5: vec_block<5>(x, ldx, w, k0, k1, c, first, pf); break;
    case 4: vec_block<4>(x, ldx, w, k0, k1, c, first, pf); break;
    case 3: vec_block<3>(x, ldx, w, k0, k1, c, first, pf); break;
    case 2: vec_block<2>(x, ldx, w, k0, k1, c, first, pf); break;
    default: vec_block<1>(x, ldx, w, k0, k1, c, first, pf); break;
  }
}

// Tasks [begin, end) of one thread: task = (chunk of rows, panel), chunk-major; each slice of k through
// all the chunk's blocks of up to MR rows (Rows: vec_rows or vec2_rows), then Store puts a row's sums
// and the bias into y. Inlined into vec_tasks and vec2_tasks, each compiled for its own target.
template <int64_t MR, auto Rows, auto Store>
__attribute__((always_inline)) inline void vec_task_loop(const VecProblem& t, int64_t begin, int64_t end) {
  alignas(64) float c[VMC * VNR];
  for (int64_t task = begin; task < end; ++task) {
    const int64_t p = task % t.panels, mc = task / t.panels;
    const int64_t m0 = mc * t.chunk, m1 = std::min(t.rows, m0 + t.chunk);
    const float* w = t.w + p * t.k * VNR;
    for (int64_t k0 = 0; k0 < t.k; k0 += VKC) {
      const int64_t k1 = std::min(t.k, k0 + VKC);
      for (int64_t m = m0; m < m1; m += MR)
        Rows(t.x + m * t.ldx, t.ldx, w, k0, k1, c + (m - m0) * VNR, k0 == 0, m == m0 ? w + k1 * VNR : nullptr,
             std::min<int64_t>(MR, m1 - m));
    }
    const int64_t col = p * VNR, width = std::min(VNR, t.n - col);
    for (int64_t m = m0; m < m1; ++m)
      Store(c + (m - m0) * VNR, t.y + m * t.n + col, t.bias ? t.bias + col : nullptr, width);
  }
}

// One row's sums (48) plus the bias into y's `width` columns, 16 at a time under a mask.
ZT_VEC_TARGET inline void vec_store(const float* c, float* y, const float* bias, int64_t width) {
  for (int64_t j = 0; j < width; j += 16) {
    const int64_t cnt = std::min<int64_t>(16, width - j);
    const __mmask16 keep = cnt == 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << cnt) - 1);
    __m512 v = _mm512_loadu_ps(c + j);
    if (bias) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(keep, bias + j));
    _mm512_mask_storeu_ps(y + j, keep, v);
  }
}

ZT_VEC_TARGET void vec_tasks(const VecProblem& t, int64_t begin, int64_t end) {
  vec_task_loop<8, vec_rows, vec_store>(t, begin, end);
}

void vec_linear_run(const VecProblem& t) {
  const int64_t chunks = (t.rows + t.chunk - 1) / t.chunk;
  at::parallel_for(0, chunks * t.panels, 1, [&](int64_t begin, int64_t end) { vec_tasks(t, begin, end); });
}

// ---- the same fp32 linear layers on AVX2 (a CPU without AVX-512: AMD Zen 1-3, Intel client cores) ----
// pack_vec's panels and vec_tasks' slices and fetches, an output element the same one fused multiply-add
// chain over k in order from zero, the bias added after: a row's numbers are those of the AVX-512 code.
// 16 registers, not 32: one or two rows take a panel's 48 columns at once (6 or 12 sums), three or more
// a 16-column third of it at a time, 6 rows a block (12 sums, the two weight vectors, the row's value);
// the k loop unrolled four deep (not unrolled, 512 rows ran at 0.6-0.8x oneDNN's rate on a Zen 3).
#if defined(__clang__)
#define ZT_VEC2_TARGET __attribute__((target("avx2,fma")))
#else
#define ZT_VEC2_TARGET __attribute__((target("avx2,fma"), optimize("no-associative-math")))
#endif
constexpr int64_t V2MR = 6;  // rows a block of 16 columns

// One k of vec2_block: the NV weight vectors at wk times each of the MR rows' value at k, into acc.
template <int MR, int NV>
ZT_VEC2_TARGET __attribute__((always_inline)) inline void vec2_step(const float* x, int64_t ldx, const float* wk,
                                                                    int64_t k, __m256 (&acc)[MR][NV]) {
  __m256 wv[NV];
  for (int j = 0; j < NV; ++j) wv[j] = _mm256_load_ps(wk + j * 8);
  for (int r = 0; r < MR; ++r) {
    const __m256 a = _mm256_broadcast_ss(x + r * ldx + k);
    for (int j = 0; j < NV; ++j) acc[r][j] = _mm256_fmadd_ps(a, wv[j], acc[r][j]);
  }
}

// MR rows of x (ldx apart) times NV 8-column vectors of a panel from column `col` over k in [k0, k1),
// the sums carried in c (48 per row, from the same column); pf as vec_block's.
template <int MR, int NV>
ZT_VEC2_TARGET inline void vec2_block(const float* x, int64_t ldx, const float* w, int64_t col, int64_t k0,
                                      int64_t k1, float* c, bool first, const float* pf) {
  ZT_VEC_ORDER
  __m256 acc[MR][NV];
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NV; ++j) acc[r][j] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(c + r * VNR + col + j * 8);
  if (pf) {
    for (int64_t k = k0; k < k1; ++k) {
      vec_fetch_ahead(pf + (k - k0) * VNR);
      vec2_step<MR, NV>(x, ldx, w + k * VNR + col, k, acc);
    }
  } else {
#pragma GCC unroll 4
    for (int64_t k = k0; k < k1; ++k) vec2_step<MR, NV>(x, ldx, w + k * VNR + col, k, acc);
  }
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NV; ++j) _mm256_storeu_ps(c + r * VNR + col + j * 8, acc[r][j]);
}

// Rows m .. m + mr - 1 (mr up to V2MR) of a panel's slice: the whole panel for one or two rows, else
// its thirds.
ZT_VEC2_TARGET void vec2_rows(const float* x, int64_t ldx, const float* w, int64_t k0, int64_t k1, float* c,
                              bool first, const float* pf, int64_t mr) {
  if (mr == 1) return vec2_block<1, 6>(x, ldx, w, 0, k0, k1, c, first, pf);
  if (mr == 2) return vec2_block<2, 6>(x, ldx, w, 0, k0, k1, c, first, pf);
  for (int64_t col = 0; col < VNR; col += 16) {
    const float* p = col == 0 ? pf : nullptr;
    switch (mr) {
      case 6: vec2_block<6, 2>(x, ldx, w, col, k0, k1, c, first, p); break;
      case 5: vec2_block<5, 2>(x, ldx, w, col, k0, k1, c, first, p); break;
      case 4: vec2_block<4, 2>(x, ldx, w, col, k0, k1, c, first, p); break;
      default: vec2_block<3, 2>(x, ldx, w, col, k0, k1, c, first, p); break;
    }
  }
}

// One row's sums plus the bias into y (AVX2: no masked stores; the compiler vectorises it).
ZT_VEC2_TARGET inline void vec2_store(const float* c, float* y, const float* bias, int64_t width) {
  for (int64_t j = 0; j < width; ++j) y[j] = bias ? c[j] + bias[j] : c[j];
}

// vec_tasks on AVX2.
ZT_VEC2_TARGET void vec2_tasks(const VecProblem& t, int64_t begin, int64_t end) {
  vec_task_loop<V2MR, vec2_rows, vec2_store>(t, begin, end);
}

// Rows per task on AVX2: vec_linear's chunks in blocks of V2MR rows.
int64_t vec2_chunk(int64_t rows) { return even_chunk(rows, VMC / V2MR * V2MR, V2MR); }

void vec2_linear_run(const VecProblem& t) {
  const int64_t chunks = (t.rows + t.chunk - 1) / t.chunk;
  at::parallel_for(0, chunks * t.panels, 1, [&](int64_t begin, int64_t end) { vec2_tasks(t, begin, end); });
}
#endif

// ---- bf16 linear layers on AVX512-BF16 -------------------------------------------------------------
// y = x w^T (+ bias) for bf16 x (rows, K) and w packed by pack_dot: (N/48, K/2, 48, 2), each 48-column
// panel pair-major (for each pair of k, the 48 columns' two values side by side, as VDPBF16PS reads
// them). The fp32 kernel's blocking with bf16 operands: an output element is one chain of VDPBF16PS
// steps over the pairs of k in order from zero (each step adds its pair's two products to the fp32 sum),
// the bias added after, rounded once to bf16: a row's numbers never depend on the other rows, on the
// blocking, or on how the panels are shared among threads. A slice is 64 pairs (128 k), the same bytes
// as the fp32 kernel's; the weights are fetched ahead into L1 and L2 in the same way.
#if defined(__x86_64__) && (defined(__clang__) || (defined(__GNUC__) && __GNUC__ >= 10))
#define ZT_DOT 1
#if defined(__clang__)
#define ZT_DOT_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))
#define ZT_DOT_ORDER _Pragma("clang fp reassociate(off)")
#else
#define ZT_DOT_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16"), optimize("no-associative-math")))
#define ZT_DOT_ORDER
#endif
constexpr int64_t DNR = 48, DMC = 128, DKC = 64;  // panel columns, rows per task, pairs of k per slice
constexpr int64_t DAHEAD = 4 * DKC * DNR * 2;  // how far ahead (bf16 values) the weights are fetched into L2

struct DotProblem {
  const uint16_t* x;
  const uint16_t* w;
  const float* bias;
  uint16_t* y;
  int64_t ldx, rows, n, pairs, panels, chunk;
};

// MR rows of x (ldx apart) times one panel over the pairs [k0, k1), the sums carried in c (48 per row);
// pf: where the next slice starts (fetched into L1 meanwhile, four slices further on into L2), or null
template <int MR>
ZT_DOT_TARGET inline void dot_block(const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t k0, int64_t k1,
                                    float* c, bool first, const uint16_t* pf) {
  ZT_DOT_ORDER
  __m512 acc[MR][3];
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < 3; ++j) acc[r][j] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(c + r * DNR + j * 16);
  for (int64_t k = k0; k < k1; ++k) {
    const uint16_t* wk = w + k * DNR * 2;
    const __m512bh w0 = (__m512bh)_mm512_load_si512(wk), w1 = (__m512bh)_mm512_load_si512(wk + 32),
                   w2 = (__m512bh)_mm512_load_si512(wk + 64);
    if (pf) {
      const char* p = reinterpret_cast<const char*>(pf + (k - k0) * DNR * 2);
      _mm_prefetch(p, _MM_HINT_T0);
      _mm_prefetch(p + 64, _MM_HINT_T0);
      _mm_prefetch(p + 128, _MM_HINT_T0);
      const char* q = reinterpret_cast<const char*>(pf + (k - k0) * DNR * 2 + DAHEAD);
      _mm_prefetch(q, _MM_HINT_T1);
      _mm_prefetch(q + 64, _MM_HINT_T1);
      _mm_prefetch(q + 128, _MM_HINT_T1);
    }
    for (int r = 0; r < MR; ++r) {
      int32_t pair;
      std::memcpy(&pair, x + r * ldx + 2 * k, sizeof(pair));
      const __m512bh a = (__m512bh)_mm512_set1_epi32(pair);
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], a, w0);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], a, w1);
      acc[r][2] = _mm512_dpbf16_ps(acc[r][2], a, w2);
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < 3; ++j) _mm512_storeu_ps(c + r * DNR + j * 16, acc[r][j]);
}

ZT_DOT_TARGET void dot_rows(const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t k0, int64_t k1, float* c,
                            bool first, const uint16_t* pf, int64_t mr) {
  switch (mr) {
    case 8: dot_block<8>(x, ldx, w, k0, k1, c, first, pf); break;
    case 7: dot_block<7>(x, ldx, w, k0, k1, c, first, pf); break;
    case 6: dot_block<6>(x, ldx, w, k0, k1, c, first, pf); break;
    case 5: dot_block<5>(x, ldx, w, k0, k1, c, first, pf); break;
    case 4: dot_block<4>(x, ldx, w, k0, k1, c, first, pf); break;
    case 3: dot_block<3>(x, ldx, w, k0, k1, c, first, pf); break;
    case 2: dot_block<2>(x, ldx, w, k0, k1, c, first, pf); break;
    default: dot_block<1>(x, ldx, w, k0, k1, c, first, pf); break;
  }
}

// Rows m0 .. m1 - 1 of a panel's sums c (48 a row) to y's columns col .. col + width - 1 (rows ldy
// apart), the bias (fp32, or null) added, rounded once to bf16.
ZT_DOT_TARGET inline void dot_store(const float* c, int64_t m0, int64_t m1, int64_t col, int64_t width,
                                    const float* bias, uint16_t* y, int64_t ldy) {
  for (int64_t j = 0; j < width; j += 16) {
    const int64_t cnt = std::min<int64_t>(16, width - j);
    const __mmask16 keep = cnt == 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << cnt) - 1);
    const __m512 b = bias ? _mm512_maskz_loadu_ps(keep, bias + col + j) : _mm512_setzero_ps();
    for (int64_t m = m0; m < m1; ++m) {
      __m512 v = _mm512_loadu_ps(c + (m - m0) * DNR + j);
      if (bias) v = _mm512_add_ps(v, b);
      _mm256_mask_storeu_epi16(y + m * ldy + col + j, keep, (__m256i)_mm512_cvtneps_pbh(v));
    }
  }
}

// A 16 x 16 matrix of 32-bit elements, row i in r[i], transposed in place (r[i] becomes column i): the
// dot attention's key packing and the AVX512-BF16 kernel of quantised weights. Always inlined (its
// callers' targets differ).
ZT_DOT_TARGET __attribute__((always_inline)) inline void transpose16(__m512i* r) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int i = 0; i < 16; i += 8)
    for (int j = 0; j < 4; ++j) {
      t[i + j] = _mm512_shuffle_i32x4(r[i + j], r[i + j + 4], 0x88);
      t[i + j + 4] = _mm512_shuffle_i32x4(r[i + j], r[i + j + 4], 0xdd);
    }
  for (int j = 0; j < 8; ++j) {
    r[j] = _mm512_shuffle_i32x4(t[j], t[j + 8], 0x88);
    r[j + 8] = _mm512_shuffle_i32x4(t[j], t[j + 8], 0xdd);
  }
}

// Tasks [begin, end) of one thread: task = (chunk of rows, panel), chunk-major.
ZT_DOT_TARGET void dot_tasks(const DotProblem& t, int64_t begin, int64_t end) {
  alignas(64) float c[DMC * DNR];
  for (int64_t task = begin; task < end; ++task) {
    const int64_t p = task % t.panels, mc = task / t.panels;
    const int64_t m0 = mc * t.chunk, m1 = std::min(t.rows, m0 + t.chunk);
    const uint16_t* w = t.w + p * t.pairs * DNR * 2;
    for (int64_t k0 = 0; k0 < t.pairs; k0 += DKC) {
      const int64_t k1 = std::min(t.pairs, k0 + DKC);
      for (int64_t m = m0; m < m1; m += 8)
        dot_rows(t.x + m * t.ldx, t.ldx, w, k0, k1, c + (m - m0) * DNR, k0 == 0,
                 m == m0 ? w + k1 * DNR * 2 : nullptr, std::min<int64_t>(8, m1 - m));
    }
    dot_store(c, m0, m1, p * DNR, std::min(DNR, t.n - p * DNR), t.bias, t.y, t.n);
  }
}

void dot_linear_run(const DotProblem& t) {
  const int64_t chunks = (t.rows + t.chunk - 1) / t.chunk;
  at::parallel_for(0, chunks * t.panels, 1, [&](int64_t begin, int64_t end) { dot_tasks(t, begin, end); });
}
#endif

