// ---- bf16 paged attention on AMX tiles -------------------------------------------------------------
// The rows in the blocks of the AVX-512 kernel (consecutive rows of one slot list, at most kBlock),
// per block and KV head a matrix problem: the block's query rows of the heads that share the KV head
// (M = rows x group) times the keys, S = Q K^T, in 16-key tiles; each row's softmax over its own
// keys (fp32, the probabilities rounded once to bf16); O = P V in 32-key tiles summed in key order
// from key 0. An element of S is one query row times one key (TDPBF16PS over the head's dims in
// order), an element of O one row of P times one column of V: a row's numbers depend on its own
// query, keys and values alone, never on the block it is in, the other rows, or how a prompt is cut
// into chunks, and a decode is computed as a prompt row is (positions past a row's keys enter O as
// zero probabilities times finite values, or zeros past the sequence's end). A block's keys and
// values are packed for a group of KV heads at once (pack_heads), each slot's vectors of the group read
// together: head by head, a decode of a model with many KV heads read one vector per slot at a stride
// of the slot's size and took 1.7-2.5x the time (16 sequences of 600 tokens, 32 KV heads of 64).
#if defined(ZT_TILES) && defined(ZT_DOT_ATTENTION)
#define ZT_TILE_ATTENTION 1
// A thread's buffers for one block and KV head: the query rows (M rounded up to 16, zeros past M),
// the block's key tiles, the scores, the probabilities, the block's value tiles, a tile row of O.
struct TileAttention {
  std::vector<uint16_t> q, p;
  std::vector<uint32_t> keys, values;
  std::vector<float> s, o, total;
};

// Four 16-key tiles of S: the rows of q (dim apart, as many as the loaded config's A tiles have) times
// keys k (four pack_keys groups of 16), TDPBF16PS over the head's dims in order (four independent
// tile sums in flight): into s (rows ls floats apart).
ZT_TILE_TARGET inline void score_tiles(const uint16_t* q, const uint32_t* k, int64_t dim, float* s, int64_t ls) {
  const int64_t halves = dim / 32;
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t h = 0; h < halves; ++h) {
    _tile_loadd(4, q + 32 * h, dim * 2);
    _tile_loadd(5, k + h * 256, 64);
    _tile_dpbf16ps(0, 4, 5);
    _tile_loadd(6, k + (halves + h) * 256, 64);
    _tile_dpbf16ps(1, 4, 6);
    _tile_loadd(7, k + (2 * halves + h) * 256, 64);
    _tile_dpbf16ps(2, 4, 7);
    _tile_loadd(5, k + (3 * halves + h) * 256, 64);
    _tile_dpbf16ps(3, 4, 5);
  }
  char* out = reinterpret_cast<char*>(s);
  _tile_stored(0, out, ls * 4);
  _tile_stored(1, out + 64, ls * 4);
  _tile_stored(2, out + 128, ls * 4);
  _tile_stored(3, out + 192, ls * 4);
}

// S for R (2 or 3) 16-row tiles of q (rows dim apart, 16 dim apart tile to tile) times all n64 keys k
// (pack_keys groups), 16 keys at a time: each key tile loaded once for the R row tiles (C tiles 0 ..
// R - 1, the row tiles in A tiles 4, 6, 7 from L1), not once per row tile as score_tiles does: the keys
// (256 KB for 2,048 keys of 64 dims) come from L2. Each element the same sum over the head's dims in
// order as score_tiles's.
template <int R>
ZT_TILE_TARGET inline void score_rows(const uint16_t* q, const uint32_t* k, int64_t dim, int64_t n64, float* s,
                                      int64_t ls) {
  const int64_t halves = dim / 32, rows = 16 * dim;
  char* out = reinterpret_cast<char*>(s);
  for (int64_t j = 0; j < n64 / 16; ++j) {
    const uint32_t* kj = k + j * halves * 256;
    _tile_zero(0);
    _tile_zero(1);
    if (R == 3) _tile_zero(2);
    for (int64_t h = 0; h < halves; ++h) {
      _tile_loadd(5, kj + h * 256, 64);
      _tile_loadd(4, q + 32 * h, dim * 2);
      _tile_dpbf16ps(0, 4, 5);
      _tile_loadd(6, q + rows + 32 * h, dim * 2);
      _tile_dpbf16ps(1, 6, 5);
      if (R == 3) {
        _tile_loadd(7, q + 2 * rows + 32 * h, dim * 2);
        _tile_dpbf16ps(2, 7, 5);
      }
    }
    _tile_stored(0, out + 64 * j, ls * 4);
    _tile_stored(1, out + 64 * j + 16 * ls * 4, ls * 4);
    if (R == 3) _tile_stored(2, out + 64 * j + 32 * ls * 4, ls * 4);
  }
}

// O's dims 16 t0 .. 16 t0 + 63 for the rows of p (lp apart) over ``chunks`` 32-key chunks of values
// (pack_values: dim / 16 tiles a chunk), in key order: added to the sums in o (rows dim floats apart)
// where ``more``, else from zero, and stored back to o.
ZT_TILE_TARGET inline void value_tiles(const uint16_t* p, int64_t lp, const uint32_t* values, int64_t t0, int64_t dim,
                                       int64_t chunks, float* o, bool more) {
  char* out = reinterpret_cast<char*>(o + 16 * t0);
  if (more) {
    _tile_loadd(0, out, dim * 4);
    _tile_loadd(1, out + 64, dim * 4);
    _tile_loadd(2, out + 128, dim * 4);
    _tile_loadd(3, out + 192, dim * 4);
  } else {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
  }
  for (int64_t c = 0; c < chunks; ++c) {
    _tile_loadd(4, p + 32 * c, lp * 2);
    const uint32_t* vc = values + (c * (dim / 16) + t0) * 256;
    _tile_loadd(5, vc, 64);
    _tile_dpbf16ps(0, 4, 5);
    _tile_loadd(6, vc + 256, 64);
    _tile_dpbf16ps(1, 4, 6);
    _tile_loadd(7, vc + 512, 64);
    _tile_dpbf16ps(2, 4, 7);
    _tile_loadd(5, vc + 768, 64);
    _tile_dpbf16ps(3, 4, 5);
  }
  _tile_stored(0, out, dim * 4);
  _tile_stored(1, out + 64, dim * 4);
  _tile_stored(2, out + 128, dim * 4);
  _tile_stored(3, out + 192, dim * 4);
}

// One block of rows r0 .. r0 + nr - 1 (one slot list) and one KV head, its keys and values packed
// (pack_heads), written to the output.
ZT_TILE_TARGET void tile_block_head(TileAttention& b, const AttentionProblem& pr, const int64_t* len, int64_t r0,
                                    int64_t nr, int64_t kh, const uint32_t* keys, const uint32_t* values) {
  const uint16_t* q = pr.q;
  uint16_t* out = pr.out;
  const int64_t heads = pr.heads, kv_heads = pr.kv_heads, dim = pr.dim;
  const float scale = pr.scale;
  const int64_t group = heads / kv_heads, m = nr * group, mp = (m + 15) / 16 * 16;
  int64_t n = 0;
  for (int64_t w = 0; w < nr; ++w) n = std::max(n, len[w]);
  const int64_t n64 = (n + 63) / 64 * 64, n32 = (n + 31) / 32 * 32;
  b.q.resize(mp * dim);
  std::fill(b.q.begin() + m * dim, b.q.begin() + mp * dim, 0);  // the padding rows (their O is not kept)
  for (int64_t i = 0; i < m; ++i)
    std::memcpy(b.q.data() + i * dim, q + ((r0 + i / group) * heads + kh * group + i % group) * dim, dim * 2);
  const int64_t ls = n64 + 16, lp = n32 + 32;  // rows one cache line past a power of two apart
  b.s.resize(mp * ls);
  for (int64_t m0 = 0; m0 < mp;) {  // S = Q K^T (keys from n on are zeros): 2 or 3 row tiles at a time
    const int64_t left = (mp - m0) / 16, r = left == 4 ? 2 : std::min<int64_t>(left, 3);
    if (r == 3)
      score_rows<3>(b.q.data() + m0 * dim, keys, dim, n64, b.s.data() + m0 * ls, ls);
    else if (r == 2)
      score_rows<2>(b.q.data() + m0 * dim, keys, dim, n64, b.s.data() + m0 * ls, ls);
    else  // a lone row tile: 64 keys at a time
      for (int64_t j0 = 0; j0 < n64; j0 += 64)
        score_tiles(b.q.data() + m0 * dim, keys + j0 / 16 * (dim / 32) * 256, dim, b.s.data() + m0 * ls + j0, ls);
    m0 += 16 * r;
  }
  b.p.resize(mp * lp);  // softmax_row writes each row to n32, the width value_tiles reads
  std::fill(b.p.begin() + m * lp, b.p.begin() + mp * lp, 0);
  b.total.resize(mp);
  for (int64_t i = 0; i < m; ++i)
    b.total[i] = softmax_row(b.s.data() + i * ls, len[i / group], scale, b.p.data() + i * lp, n32);
  b.o.resize(16 * dim);
  for (int64_t m0 = 0; m0 < mp; m0 += 16) {
    for (int64_t t0 = 0; t0 < dim / 16; t0 += 4)  // O = P V in key order
      value_tiles(b.p.data() + m0 * lp, lp, values, t0, dim, n32 / 32, b.o.data(), false);
    for (int64_t i = m0; i < std::min(m, m0 + 16); ++i)
      store_row(out + ((r0 + i / group) * heads + kh * group + i % group) * dim, b.o.data() + (i - m0) * dim, b.total[i],
                dim);
  }
}

// The tile kernel's stream (stream_rows): blocks of at most 16 query rows alone on their slot list
// on kStreamFrom keys or more. The tiles hold the block's m rows only (m-row A and C tiles): no
// padding rows. 32 decodes of 2,048 keys: 1.5-1.6x the fp32 kernel's time against 2.0-2.3x packed;
// below 1,024 keys packing the list was the faster (1.3-1.5x against 1.6-1.9x at 128 keys). Each
// chunk's keys and values are packed straight from the pool, not from a copy of the chunk's slots
// (stage_slots, the dot kernel's way): 16 decodes of 2,048 keys over 30 layers' pools on the AMX Xeon,
// 2.13-2.17 ms a layer against 2.44-2.52 (the copy stalled on memory with nothing else to do). A bf16
// pool's keys are not packed at all (key_scores): 1.90-1.93 ms against 2.13-2.17; requesting the next
// 64 keys' slots into L2 meanwhile, 2.00-2.09 (not kept).
constexpr int64_t kStreamFrom = 1024;

struct TileStream : StreamBuffers {
  int64_t config = 0;  // the rows the loaded tile config has
};

// S = Q K^T for every KV head's m rows, kStreamKeys keys at a time: s (kv_heads x m, ls).
ZT_TILE_TARGET void stream_scores(TileStream& b, const AttentionProblem& pr, const int64_t* slot, int64_t n, int64_t m,
                                  int64_t n64, int64_t ls) {
  const int64_t dim = pr.dim, kv = pr.kv_heads, halves = dim / 32;
  b.keys.resize(kStreamKeys / 16 * halves * 256);
  for (int64_t j0 = 0; j0 < n64; j0 += kStreamKeys) {
    for (int64_t kh = 0; kh < kv; ++kh) {
      for (int64_t i = 0; i < kStreamKeys / 16; ++i)
        pack_keys(pr.kp, slot, j0 + 16 * i, n, kv, kh, dim, b.keys.data() + i * halves * 256);
      score_tiles(b.q.data() + kh * m * dim, b.keys.data(), dim, b.s.data() + kh * m * ls + j0, ls);
    }
  }
}

// The tile config of key_scores: tiles 0-4 16 rows of m fp32 (C: 16 keys x m rows) or m pairs of
// bf16 (B: the rows' dims), 5-7 16 rows of 64 bytes (A: 16 keys' 32 dims).
ZT_TILE_TARGET inline void load_key_config(int64_t m) {
  TileConfig cfg;
  const uint16_t narrow = static_cast<uint16_t>(4 * m);
  cfg.colsb[0] = cfg.colsb[1] = cfg.colsb[2] = cfg.colsb[3] = cfg.colsb[4] = narrow;
  cfg.colsb[5] = cfg.colsb[6] = cfg.colsb[7] = 64;
  for (int i = 0; i < 8; ++i) cfg.rows[i] = 16;
  load_config(cfg);
}

// Whether keys j0 .. j0 + 15 lie in 16 consecutive slots (a block's) below n: read where they lie.
inline bool slot_run(const int64_t* slot, int64_t j0, int64_t n) {
  bool run = j0 + 16 <= n;
  for (int64_t c = 1; run && c < 16; ++c) run = slot[j0 + c] == slot[j0] + c;
  return run;
}

// Where 16 keys j0 .. j0 + 15 of KV head kh are read as an A tile: the pool itself where they are a
// slot_run, slot stride apart; else copied into stage (dim apart, zeros at or past n). Returns the
// first key's vector; stride set in bytes.
inline const uint16_t* key_rows(const KVSource& kp, const int64_t* slot, int64_t j0, int64_t n, int64_t kv,
                                int64_t kh, int64_t dim, bool run, uint16_t* stage, int64_t& stride) {
  if (run) {
    stride = kv * dim * 2;
    return kp.bf16 + (slot[j0] * kv + kh) * dim;
  }
  for (int64_t c = 0; c < 16; ++c) {
    if (j0 + c < n)
      std::memcpy(stage + c * dim, kp.bf16 + (slot[j0 + c] * kv + kh) * dim, dim * 2);
    else
      std::memset(stage + c * dim, 0, dim * 2);
  }
  stride = dim * 2;
  return stage;
}

// S = Q K^T of a bf16 pool for every KV head's m rows without packing the keys: S^T = K Q^T, 16 keys
// of the pool an A tile (their dims in pairs as they lie) and the rows' dims a B tile (qt: pairs of
// dims down, the m rows across), the 16 x m tiles transposed into s. Each element the product
// score_tiles forms (the same pairs of bf16 products, TDPBF16PS over the head's dims in order): the
// same bits as a row scored on packed keys. Packing the keys was half the streamed decode's time;
// transposing each 16 x m tile of S is a quarter of the shuffles the packing took.
ZT_TILE_TARGET void key_scores(TileStream& b, const AttentionProblem& pr, const int64_t* slot, int64_t n, int64_t m,
                               int64_t n64, int64_t ls) {
  const int64_t dim = pr.dim, kv = pr.kv_heads, halves = dim / 32;
  b.keys.resize(kv * halves * 256 + 4 * 16 * dim / 2 + 64 * 16);
  uint32_t* qt = b.keys.data();  // (KV head, half, pair of dims k, row i) at ((kh * halves + h) * 16 + k) * 16 + i
  uint16_t* stage = reinterpret_cast<uint16_t*>(qt + kv * halves * 256);  // 4 x 16 keys of dim
  float* t = reinterpret_cast<float*>(qt + kv * halves * 256 + 4 * 16 * dim / 2);  // 64 keys x 16
  const uint32_t* q32 = reinterpret_cast<const uint32_t*>(b.q.data());
  for (int64_t kh = 0; kh < kv; ++kh)
    for (int64_t h = 0; h < halves; ++h)
      for (int64_t k = 0; k < 16; ++k)
        for (int64_t i = 0; i < m; ++i) qt[((kh * halves + h) * 16 + k) * 16 + i] = q32[((kh * m + i) * dim + 32 * h) / 2 + k];
  load_key_config(m);
  for (int64_t j0 = 0; j0 < n64; j0 += 64) {
    bool run[4];  // the same for every KV head
    for (int g = 0; g < 4; ++g) run[g] = slot_run(slot, j0 + 16 * g, n);
    for (int64_t kh = 0; kh < kv; ++kh) {
      int64_t st[4];
      const char* a[4];
      for (int g = 0; g < 4; ++g)
        a[g] = reinterpret_cast<const char*>(
            key_rows(pr.kp, slot, j0 + 16 * g, n, kv, kh, dim, run[g], stage + g * 16 * dim, st[g]));
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      for (int64_t h = 0; h < halves; ++h) {
        _tile_loadd(4, qt + (kh * halves + h) * 256, 64);
        _tile_loadd(5, a[0] + 64 * h, st[0]);
        _tile_dpbf16ps(0, 5, 4);
        _tile_loadd(6, a[1] + 64 * h, st[1]);
        _tile_dpbf16ps(1, 6, 4);
        _tile_loadd(7, a[2] + 64 * h, st[2]);
        _tile_dpbf16ps(2, 7, 4);
        _tile_loadd(5, a[3] + 64 * h, st[3]);
        _tile_dpbf16ps(3, 5, 4);
      }
      _tile_stored(0, t, 64);
      _tile_stored(1, t + 256, 64);
      _tile_stored(2, t + 512, 64);
      _tile_stored(3, t + 768, 64);
      for (int g = 0; g < 4; ++g) {
        __m512i r[16];
        for (int c = 0; c < 16; ++c) r[c] = _mm512_loadu_si512(t + (16 * g + c) * 16);
        transpose16(r);
        for (int64_t i = 0; i < m; ++i) _mm512_storeu_si512(b.s.data() + (kh * m + i) * ls + j0 + 16 * g, r[i]);
      }
    }
  }
  load_tile_config(m);  // back to the m-row config stream_block keeps loaded (its b.config)
}

// Values j0 .. j0 + 31 of KV head kh of a bf16 pool as pack_values's B tiles, but with each tile's
// columns in another order: per 32 dims, VPUNPCKLWD and VPUNPCKHWD of the pair's two vectors, as they
// come, 128-bit lane by lane (tile 2z: dims 32z + 8L + 0..3 of lane L, tile 2z + 1: 32z + 8L + 4..7),
// four shuffles a pair of keys of 64 dims where pack_values widens and merges with eight. A column of
// O is one dim's sum over the keys whichever tile column holds it: unpair_row puts the dims back.
ZT_TILE_TARGET inline void pair_values(const uint16_t* pool, const int64_t* slot, int64_t j0, int64_t n, int64_t kv,
                                       int64_t kh, int64_t dim, uint32_t* out) {
  for (int64_t c = j0 + 32; c < std::min(j0 + 64, n); ++c) prefetch_slot(pool + (slot[c] * kv + kh) * dim, dim);
  for (int64_t k = 0; k < 16; ++k) {
    const int64_t a = j0 + 2 * k, b = a + 1;
    const uint16_t* va = a < n ? pool + (slot[a] * kv + kh) * dim : nullptr;
    const uint16_t* vb = b < n ? pool + (slot[b] * kv + kh) * dim : nullptr;
    for (int64_t z = 0; z < dim / 32; ++z) {
      const __m512i x = va != nullptr ? _mm512_loadu_si512(va + 32 * z) : _mm512_setzero_si512();
      const __m512i y = vb != nullptr ? _mm512_loadu_si512(vb + 32 * z) : _mm512_setzero_si512();
      _mm512_storeu_si512(out + 2 * z * 256 + k * 16, _mm512_unpacklo_epi16(x, y));
      _mm512_storeu_si512(out + (2 * z + 1) * 256 + k * 16, _mm512_unpackhi_epi16(x, y));
    }
  }
}

// One row of O summed on pair_values's tiles (column 16t + c holds dim 32(t / 2) + 8(c / 4) + 4(t % 2)
// + c % 4), its dims put back in order in place.
ZT_TILE_TARGET inline void unpair_row(float* o, int64_t dim) {
  alignas(64) static const int32_t lo[16] = {0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23};
  alignas(64) static const int32_t hi[16] = {8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31};
  const __m512i ilo = _mm512_load_si512(lo), ihi = _mm512_load_si512(hi);
  for (int64_t d = 0; d < dim; d += 32) {
    const __m512 x = _mm512_loadu_ps(o + d), y = _mm512_loadu_ps(o + d + 16);
    _mm512_storeu_ps(o + d, _mm512_permutex2var_ps(x, ilo, y));
    _mm512_storeu_ps(o + d + 16, _mm512_permutex2var_ps(x, ihi, y));
  }
}

// O = P V for every KV head's m rows over keys 0 .. n32, kStreamValues keys at a time, key order from
// key 0: b.o (kv_heads x m, dim), the sums stored between chunks. A bf16 pool's values are paired as
// they lie (pair_values), an 8-bit pool's packed (pack_values).
ZT_TILE_TARGET void stream_values(TileStream& b, const AttentionProblem& pr, const int64_t* slot, int64_t n, int64_t m,
                                  int64_t n32, int64_t lp) {
  const int64_t dim = pr.dim, kv = pr.kv_heads, tiles = dim / 16;
  const uint16_t* pool = pr.vp.bf16;
  b.values.resize(kStreamValues / 32 * tiles * 256);
  for (int64_t j0 = 0; j0 < n32; j0 += kStreamValues) {
    const int64_t chunks = std::min(kStreamValues, n32 - j0) / 32;
    for (int64_t kh = 0; kh < kv; ++kh) {
      for (int64_t c = 0; c < chunks; ++c) {
        if (pool != nullptr)
          pair_values(pool, slot, j0 + 32 * c, n, kv, kh, dim, b.values.data() + c * tiles * 256);
        else
          pack_values(pr.vp, slot, j0 + 32 * c, n, kv, kh, dim, b.values.data() + c * tiles * 256);
      }
      for (int64_t t0 = 0; t0 < tiles; t0 += 4)
        value_tiles(b.p.data() + kh * m * lp + j0, lp, b.values.data(), t0, dim, chunks, b.o.data() + kh * m * dim, j0 > 0);
    }
  }
  if (pool != nullptr)
    for (int64_t i = 0; i < kv * m; ++i) unpair_row(b.o.data() + i * dim, dim);
}

// One block of rows r0 .. r0 + nr - 1 (m = nr x group <= 16), every KV head, streamed (stream_rows)
// on tiles of the block's m rows.
ZT_TILE_TARGET void stream_block(TileStream& b, const AttentionProblem& pr, const int64_t* len, const int64_t* slot,
                                 int64_t r0, int64_t nr) {
  const int64_t m = nr * (pr.heads / pr.kv_heads);
  if (b.config != m) load_tile_config(m);  // A and C tiles of the block's m rows
  b.config = m;
  stream_rows(b, pr, len, r0, nr,
              [&](int64_t n, int64_t m, int64_t n64, int64_t ls) {
                if (pr.kp.bf16 != nullptr)
                  key_scores(b, pr, slot, n, m, n64, ls);
                else
                  stream_scores(b, pr, slot, n, m, n64, ls);
              },
              [&](int64_t n, int64_t m, int64_t n32, int64_t lp) { stream_values(b, pr, slot, n, m, n32, lp); });
}

// One thread's share of the blocks (a function of its own, not the lambda's body: gcc does not give a
// lambda its enclosing function's target, and tile intrinsics outside an AMX target do not compile).
// A block of at most 16 query rows alone on its slot list is streamed (stream_block); the others are
// walked and packed as the dot kernel's are (share_blocks, dot_pack): a prompt's blocks, dealt
// longest first, share what the first packed. Packing every block's keys and values afresh took a
// fifth of a 2,048-token prompt's attention (perf).
ZT_TILE_TARGET void attend_share(const AttentionProblem& pr, const std::vector<int64_t>& start,
                                 const std::vector<int64_t>& share, const int64_t* slots, const int64_t* seq,
                                 const int64_t* lens, int64_t width) {
  thread_local TileStream stream;
  stream.config = 0;
  const std::vector<int64_t> packed =
      stream_alone(start, share, slots, seq, lens, width, pr.heads / pr.kv_heads, kStreamFrom,
                   [&](int64_t r0, int64_t nr, const int64_t* slot) { stream_block(stream, pr, lens + r0, slot, r0, nr); });
  if (!packed.empty()) {
    load_tile_config();
    thread_local TileAttention b;  // kept from call to call (no fresh pages each call)
    thread_local DotGroup g;
    share_blocks(g, pr, start, packed, slots, seq, lens, width, [&](DotAttention& p, int64_t r0, int64_t nr, int64_t kh) {
      tile_block_head(b, pr, lens + r0, r0, nr, kh, p.keys.data(), p.values.data());
    });
  }
  _tile_release();
}

// The blocks of attend_avx512, dealt to the threads by their work the same way, on tiles.
void attend_tiles(const c10::BFloat16* q, const KVSource& kp, const KVSource& vp, const int64_t* slots,
                  const int64_t* seq, const int64_t* lens, c10::BFloat16* out, int64_t rows, int64_t heads,
                  int64_t kv_heads, int64_t dim, int64_t width, float scale) {
  attend_blocks(q, kp, vp, seq, lens, out, rows, heads, kv_heads, dim, scale,
                [&](const AttentionProblem& pr, const std::vector<int64_t>& start, const std::vector<int64_t>& mine) {
                  attend_share(pr, start, mine, slots, seq, lens, width);
                });
}
#endif
