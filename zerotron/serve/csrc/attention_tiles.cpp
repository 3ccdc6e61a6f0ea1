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

// S = Q K^T for the block's query rows (mp of them, a multiple of 16) against keys 0 .. width (a
// multiple of 64; keys from n on are zeros) in 16-key tiles, four at a time (four independent tile
// sums in flight): s (mp, width).
ZT_TILE_TARGET inline void tile_scores(TileAttention& b, const uint32_t* keys, int64_t dim, int64_t mp, int64_t width,
                                       int64_t ls) {
  const int64_t halves = dim / 32;
  for (int64_t m0 = 0; m0 < mp; m0 += 16) {
    for (int64_t j0 = 0; j0 < width; j0 += 64) {
      const uint32_t* k = keys + j0 / 16 * halves * 256;
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      for (int64_t h = 0; h < halves; ++h) {
        _tile_loadd(4, b.q.data() + m0 * dim + 32 * h, dim * 2);
        _tile_loadd(5, k + h * 256, 64);
        _tile_dpbf16ps(0, 4, 5);
        _tile_loadd(6, k + (halves + h) * 256, 64);
        _tile_dpbf16ps(1, 4, 6);
        _tile_loadd(7, k + (2 * halves + h) * 256, 64);
        _tile_dpbf16ps(2, 4, 7);
        _tile_loadd(5, k + (3 * halves + h) * 256, 64);
        _tile_dpbf16ps(3, 4, 5);
      }
      char* s = reinterpret_cast<char*>(b.s.data() + m0 * ls + j0);
      _tile_stored(0, s, ls * 4);
      _tile_stored(1, s + 64, ls * 4);
      _tile_stored(2, s + 128, ls * 4);
      _tile_stored(3, s + 192, ls * 4);
    }
  }
}

// O = P V for query rows m0 .. m0 + 15, dims 16 t0 .. 16 t0 + 63, over keys 0 .. n32 in 32-key
// chunks (key order): into b.o (16, dim).
ZT_TILE_TARGET inline void tile_values(TileAttention& b, const uint32_t* values, int64_t m0, int64_t t0, int64_t dim,
                                       int64_t n32, int64_t lp) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  const uint32_t* v = values;
  for (int64_t c = 0; c < n32 / 32; ++c) {
    _tile_loadd(4, b.p.data() + m0 * lp + 32 * c, lp * 2);
    const uint32_t* vc = v + (c * (dim / 16) + t0) * 256;
    _tile_loadd(5, vc, 64);
    _tile_dpbf16ps(0, 4, 5);
    _tile_loadd(5, vc + 256, 64);
    _tile_dpbf16ps(1, 4, 5);
    _tile_loadd(5, vc + 512, 64);
    _tile_dpbf16ps(2, 4, 5);
    _tile_loadd(5, vc + 768, 64);
    _tile_dpbf16ps(3, 4, 5);
  }
  char* o = reinterpret_cast<char*>(b.o.data() + 16 * t0);
  _tile_stored(0, o, dim * 4);
  _tile_stored(1, o + 64, dim * 4);
  _tile_stored(2, o + 128, dim * 4);
  _tile_stored(3, o + 192, dim * 4);
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
  tile_scores(b, keys, dim, mp, n64, ls);
  b.p.resize(mp * lp);  // softmax_row writes each row to n32, the width tile_values reads
  std::fill(b.p.begin() + m * lp, b.p.begin() + mp * lp, 0);
  b.total.resize(mp);
  for (int64_t i = 0; i < m; ++i)
    b.total[i] = softmax_row(b.s.data() + i * ls, len[i / group], scale, b.p.data() + i * lp, n32);
  b.o.resize(16 * dim);
  for (int64_t m0 = 0; m0 < mp; m0 += 16) {
    for (int64_t t0 = 0; t0 < dim / 16; t0 += 4) tile_values(b, values, m0, t0, dim, n32, lp);
    for (int64_t i = m0; i < std::min(m, m0 + 16); ++i) {
      uint16_t* o = out + ((r0 + i / group) * heads + kh * group + i % group) * dim;
      const __m512 inv = _mm512_set1_ps(1.0f / b.total[i]);
      for (int64_t d = 0; d < dim; d += 16) {
        const __m512 x = _mm512_mul_ps(_mm512_loadu_ps(b.o.data() + (i - m0) * dim + d), inv);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + d), (__m256i)_mm512_cvtneps_pbh(x));
      }
    }
  }
}

// One thread's share of the blocks (a function of its own, not the lambda's body: gcc does not give a
// lambda its enclosing function's target, and tile intrinsics outside an AMX target do not compile).
// The blocks walked and packed as the dot kernel's are (share_blocks, dot_pack): a prompt's blocks,
// dealt longest first, share what the first packed. Packing every block's keys and values afresh took a fifth of a 2,048-token
// prompt's attention (perf).
ZT_TILE_TARGET void attend_share(const AttentionProblem& pr, const std::vector<int64_t>& start,
                                 const std::vector<int64_t>& share, const int64_t* slots, const int64_t* seq,
                                 const int64_t* lens, int64_t width) {
  TileConfig cfg;
  for (int i = 0; i < 8; ++i) {
    cfg.rows[i] = 16;
    cfg.colsb[i] = 64;
  }
  _tile_loadconfig(&cfg);
  thread_local TileAttention b;  // kept from call to call (no fresh pages each call)
  thread_local DotGroup g;
  share_blocks(g, pr, start, share, slots, seq, lens, width, [&](DotAttention& packed, int64_t r0, int64_t nr, int64_t kh) {
    tile_block_head(b, pr, lens + r0, r0, nr, kh, packed.keys.data(), packed.values.data());
  });
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
