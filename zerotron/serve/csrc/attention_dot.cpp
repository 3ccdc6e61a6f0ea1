// ---- bf16 paged attention on AVX512-BF16 ------------------------------------------------------------
// For x86 CPUs with AVX512-BF16 (VDPBF16PS) but no AMX, the tile kernel's matrix problem on vector
// registers: the rows in the blocks of the AVX-512 kernel (consecutive rows of one slot list, at most
// kBlock), per block and KV head the block's query rows of the heads that share the KV head (m = rows
// x group) times the keys, S = Q K^T, the keys packed 16 at a time as pairs of dims (as VDPBF16PS
// reads them); each row's softmax over its own keys (fp32, the probabilities rounded once to bf16);
// O = P V, the values packed 32 keys at a time as pairs of keys. An element of S is one query row
// times one key (a chain of VDPBF16PS steps over the head's dims in order), an element of O one row of
// P times one column of V (a chain over the keys in order from key 0): a row's numbers depend on its
// own query, keys and values alone, never on the block it is in, the other rows, or how a prompt is
// cut into chunks, and a decode is computed as a prompt row is. Where the fp32 kernel spends a
// 16-lane product and a reduction on each key of each row, here one instruction adds two dims of 16
// keys (scores) or two keys of 16 dims (sums) for a row: about 0.45x the time on a long prompt. A
// decode (three query rows per KV head) does not amortise packing its keys and values for the whole
// list (1.2-1.9x the fp32 kernel's time on Zen 4): from 64 keys it is streamed, a chunk of keys or
// values packed and used at once (dot_stream_block). The helpers (packing, softmax, the stream) are
// the tile kernel's too.
#if defined(ZT_DOT) && defined(__AVX512F__)
#define ZT_DOT_ATTENTION 1
// kv_codes16 and kv_scale: attention.cpp's.

// Vector ``vec`` (slot * kv_heads + KV head) of a pool, dims d0 .. d0 + 15 (16) or d0 .. d0 + 31 (32)
// as bf16: an 8-bit pool's codes times their scale in fp32, rounded to nearest even (VCVTNE2PS2BF16,
// torch's rounding but for a product below fp32's normal range, flushed to zero: such a value is
// zero to the bf16 products that read it, VDPBF16PS and TDPBF16PS, either way).
ZT_DOT_TARGET inline __m256i kv_load16(const KVSource& src, int64_t vec, int64_t dim, int64_t d0) {
  if (src.bf16 != nullptr) return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src.bf16 + vec * dim + d0));
  const __m128i x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src.codes + vec * dim + d0));
  return (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(kv_codes16(x, src.fmt), kv_scale(src.scales[vec], src.fmt)));
}
ZT_DOT_TARGET inline __m512i kv_load32(const KVSource& src, int64_t vec, int64_t dim, int64_t d0) {
  if (src.bf16 != nullptr) return _mm512_loadu_si512(src.bf16 + vec * dim + d0);
  const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src.codes + vec * dim + d0));
  const __m512 f = kv_scale(src.scales[vec], src.fmt);
  const __m512 lo = _mm512_mul_ps(kv_codes16(_mm256_castsi256_si128(x), src.fmt), f);
  const __m512 hi = _mm512_mul_ps(kv_codes16(_mm256_extracti128_si256(x, 1), src.fmt), f);
  return (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
}

// The next keys' vectors requested into L1 (the slots are scattered), an 8-bit pool's scales too.
ZT_DOT_TARGET __attribute__((always_inline)) inline void kv_prefetch(const KVSource& src, int64_t vec, int64_t dim) {
  if (src.bf16 != nullptr) {
    prefetch_slot(src.bf16 + vec * dim, dim);
  } else {
    prefetch_slot(src.codes + vec * dim, dim);
    _mm_prefetch(reinterpret_cast<const char*>(src.scales + vec), _MM_HINT_T0);
  }
}

// Keys j0 .. j0 + 15 of KV head kh as B tiles of S = Q K^T, one per 32 dims (pairs of dims down, the
// 16 keys across): out[h * 256 + k * 16 + c] = dims (32h + 2k, 32h + 2k + 1) of key j0 + c; zeros for
// keys at or past n. The next 16 keys' vectors are requested meanwhile (the slots are scattered).
ZT_DOT_TARGET inline void pack_keys(const KVSource& kp, const int64_t* slot, int64_t j0, int64_t n,
                                     int64_t kv_heads, int64_t kh, int64_t dim, uint32_t* out) {
  for (int64_t c = j0 + 16; c < std::min(j0 + 32, n); ++c) kv_prefetch(kp, slot[c] * kv_heads + kh, dim);
  for (int64_t h = 0; h < dim / 32; ++h) {
    __m512i r[16];
    for (int64_t c = 0; c < 16; ++c)
      r[c] = j0 + c < n ? kv_load32(kp, slot[j0 + c] * kv_heads + kh, dim, 32 * h) : _mm512_setzero_si512();
    transpose16(r);
    for (int k = 0; k < 16; ++k) _mm512_storeu_si512(out + h * 256 + k * 16, r[k]);
  }
}

// Values j0 .. j0 + 31 of KV head kh as B tiles of O = P V, one per 16 dims (pairs of keys down, the
// 16 dims across): out[t * 256 + k * 16 + d] = dim 16t + d of keys j0 + 2k (low half) and j0 + 2k + 1
// (high half); zeros for keys at or past n. The next 32 keys' vectors are requested meanwhile.
ZT_DOT_TARGET inline void pack_values(const KVSource& vp, const int64_t* slot, int64_t j0, int64_t n,
                                       int64_t kv_heads, int64_t kh, int64_t dim, uint32_t* out) {
  for (int64_t c = j0 + 32; c < std::min(j0 + 64, n); ++c) kv_prefetch(vp, slot[c] * kv_heads + kh, dim);
  for (int64_t k = 0; k < 16; ++k) {
    const int64_t a = j0 + 2 * k, b = a + 1;
    for (int64_t t = 0; t < dim / 16; ++t) {
      const __m512i lo = a < n ? _mm512_cvtepu16_epi32(kv_load16(vp, slot[a] * kv_heads + kh, dim, 16 * t)) : _mm512_setzero_si512();
      const __m512i hi = b < n ? _mm512_cvtepu16_epi32(kv_load16(vp, slot[b] * kv_heads + kh, dim, 16 * t)) : _mm512_setzero_si512();
      _mm512_storeu_si512(out + t * 256 + k * 16, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
    }
  }
}

// 2^t for t <= 0 on 16 lanes: t = n + f with n an integer and |f| <= 1/2, 2^f by its Taylor
// polynomial of degree 5 (relative error under 2e-6, far below the bf16 rounding that follows), times
// 2^n by scalef (0 far below). Not attention.cpp's exp_neg16: its fp32 probabilities are kept, these
// are rounded to bf16 at once, so one polynomial degree and the clamp less suffice.
ZT_DOT_TARGET inline __m512 exp2_neg16(__m512 t) {
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_fmadd_ps(_mm512_set1_ps(1.3333558e-3f), f, _mm512_set1_ps(9.6181291e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504109e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022651e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// One row's softmax: its first len scores -> probabilities exp(scale (s - max)) rounded to bf16 in p
// (zeros from len to width); the sum of the unrounded ones (16 running sums over j % 16, then added
// as _mm512_reduce_add_ps adds) returned.
ZT_DOT_TARGET inline float softmax_row(const float* s, int64_t len, float scale, uint16_t* p, int64_t width) {
  const int64_t full = len / 16 * 16;
  const __mmask16 tail = static_cast<__mmask16>((1u << (len - full)) - 1u);
  __m512 top = _mm512_set1_ps(-INFINITY);
  for (int64_t j = 0; j < full; j += 16) top = _mm512_max_ps(top, _mm512_loadu_ps(s + j));
  if (tail) top = _mm512_mask_max_ps(top, tail, top, _mm512_maskz_loadu_ps(tail, s + full));
  const float c = scale * 1.44269504088896341f;  // exp(scale x) = 2^(c x)
  const __m512 mul = _mm512_set1_ps(c), off = _mm512_set1_ps(-_mm512_reduce_max_ps(top) * c);
  __m512 sum = _mm512_setzero_ps();
  for (int64_t j = 0; j < full; j += 16) {
    const __m512 e = exp2_neg16(_mm512_fmadd_ps(_mm512_loadu_ps(s + j), mul, off));
    sum = _mm512_add_ps(sum, e);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + j), (__m256i)_mm512_cvtneps_pbh(e));
  }
  if (tail) {
    const __m512 e = _mm512_maskz_mov_ps(tail, exp2_neg16(_mm512_fmadd_ps(_mm512_maskz_loadu_ps(tail, s + full), mul, off)));
    sum = _mm512_add_ps(sum, e);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + full), (__m256i)_mm512_cvtneps_pbh(e));
  }
  for (int64_t j = full + (tail ? 16 : 0); j < width; j += 16) _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + j), _mm256_setzero_si256());
  return _mm512_reduce_add_ps(sum);
}

// What every block of one call shares: the queries, the pools, the output, the shapes.
struct AttentionProblem {
  const uint16_t* q;
  KVSource kp, vp;
  uint16_t* out;
  int64_t heads, kv_heads, dim;
  float scale;
};


// Two bf16 values at x in every lane: one broadcast from memory (through a general register, as
// _mm512_set1_epi32 of a loaded int is compiled, it costs two more instructions per step).
ZT_DOT_TARGET inline __m512bh pair_of(const uint16_t* x) {
  return (__m512bh)_mm512_broadcastss_ps(_mm_load_ss(reinterpret_cast<const float*>(x)));
}

// Sizes (uint32 elements) of one KV head's packed keys for n keys (pack_keys: 16 keys a group, n
// rounded up to 64) and its packed values (pack_values: 32 keys a group).
inline int64_t packed_keys_size(int64_t n, int64_t dim) { return (n + 63) / 64 * 4 * (dim / 32) * 256; }
inline int64_t packed_values_size(int64_t n, int64_t dim) { return (n + 31) / 32 * (dim / 16) * 256; }

constexpr int64_t kPackBytes = 1 << 20;  // the packed keys and values of a group of KV heads, at most

// How many KV heads the tile and dot kernels pack at once for n keys: as many as fit kPackBytes, at
// least one. The pool holds a slot's heads side by side; packing head by head would read one vector
// per slot at the slot's stride, a cache miss each.
inline int64_t heads_per_pack(int64_t n, int64_t dim, int64_t kv_heads) {
  const int64_t bytes = 4 * (packed_keys_size(n, dim) + packed_values_size(n, dim));
  return std::clamp<int64_t>(kPackBytes / bytes, 1, kv_heads);
}

// Keys ``from`` .. n (the last group of 16 again where ``from`` cuts one short; zeros past n up to a
// multiple of 64) and values (groups of 32) of KV heads kh0 .. kh0 + h - 1, head i's into keys(i)
// and values(i): 16 (32) keys of every head, then the next, so each slot's vectors of the group are
// read together.
template <typename Keys, typename Values>
ZT_DOT_TARGET void pack_heads(const AttentionProblem& pr, const int64_t* slot, int64_t from, int64_t n, int64_t kh0,
                              int64_t h, const Keys& keys, const Values& values) {
  const int64_t dim = pr.dim, kv_heads = pr.kv_heads, n64 = (n + 63) / 64 * 64, n32 = (n + 31) / 32 * 32;
  for (int64_t j0 = from / 16 * 16; j0 < n64; j0 += 16)
    for (int64_t i = 0; i < h; ++i)
      pack_keys(pr.kp, slot, j0, n, kv_heads, kh0 + i, dim, keys(i) + j0 / 16 * (dim / 32) * 256);
  for (int64_t j0 = from / 32 * 32; j0 < n32; j0 += 32)
    for (int64_t i = 0; i < h; ++i)
      pack_values(pr.vp, slot, j0, n, kv_heads, kh0 + i, dim, values(i) + j0 / 32 * (dim / 16) * 256);
}

// A thread's buffers for one block and KV head: the query rows, the packed keys, the scores, the
// probabilities, the packed values, each row's sum of probabilities.
struct DotAttention {
  std::vector<uint16_t> q, p;
  std::vector<uint32_t> keys, values;
  std::vector<float> s, total;
};

// The buffers of a group of KV heads and whose keys and values they hold: those of one slot list and
// heads kh0 .., kept from block to block: a prompt's blocks share its keys, and each packs only the
// keys past what the blocks before it packed.
struct DotGroup {
  std::vector<DotAttention> heads;
  const int64_t* slot = nullptr;
  int64_t kh0 = -1, packed = 0;  // how many keys hold in full
};

// S = Q K^T for R query rows (dim apart) against keys 0 .. width (a multiple of 32; packed by
// pack_keys, 16 keys a group), 32 keys at a time: s rows ls apart. Each score one chain of VDPBF16PS
// steps over the head's pairs of dims in order.
template <int R, int64_t D>
ZT_DOT_TARGET inline void dot_scores(const uint16_t* q, const uint32_t* keys, int64_t width, float* s, int64_t ls) {
  ZT_DOT_ORDER
  constexpr int64_t pairs = D / 2;
  for (int64_t j0 = 0; j0 < width; j0 += 32) {
    const uint32_t* k0 = keys + j0 * pairs;
    const uint32_t* k1 = k0 + 16 * pairs;
    __m512 acc[R][2];
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    for (int64_t d = 0; d < pairs; ++d) {
      const __m512bh a0 = (__m512bh)_mm512_loadu_si512(k0 + 16 * d), a1 = (__m512bh)_mm512_loadu_si512(k1 + 16 * d);
      for (int r = 0; r < R; ++r) {
        const __m512bh x = pair_of(q + r * D + 2 * d);
        acc[r][0] = _mm512_dpbf16_ps(acc[r][0], x, a0);
        acc[r][1] = _mm512_dpbf16_ps(acc[r][1], x, a1);
      }
    }
    for (int r = 0; r < R; ++r) {
      _mm512_storeu_ps(s + r * ls + j0, acc[r][0]);
      _mm512_storeu_ps(s + r * ls + j0 + 16, acc[r][1]);
    }
  }
}

// ``chunks`` chunks of 32 keys of O = P V added into acc: R rows of probabilities (lp apart, bf16,
// zeros past each row's keys, the chunks' first key at p) times the values (packed by pack_values, 32
// keys a chunk), dims 16 t0 .. 16 t0 + 63: each element one chain of VDPBF16PS steps over the pairs of
// keys in order.
template <int R>
ZT_DOT_TARGET inline void dot_chunks(__m512 (&acc)[R][4], const uint16_t* p, int64_t lp, const uint32_t* values,
                                     int64_t dim, int64_t t0, int64_t chunks) {
  ZT_DOT_ORDER
  const int64_t tiles = dim / 16;
  for (int64_t c = 0; c < chunks; ++c) {
    const uint32_t* vc = values + (c * tiles + t0) * 256;
    for (int64_t k = 0; k < 16; ++k) {
      __m512bh v[4];
      for (int i = 0; i < 4; ++i) v[i] = (__m512bh)_mm512_loadu_si512(vc + i * 256 + 16 * k);
      for (int r = 0; r < R; ++r) {
        const __m512bh x = pair_of(p + r * lp + 32 * c + 2 * k);
        for (int i = 0; i < 4; ++i) acc[r][i] = _mm512_dpbf16_ps(acc[r][i], x, v[i]);
      }
    }
  }
}

// O = P V for R rows of probabilities over keys 0 .. n32 (dot_chunks from key 0), divided by each
// row's total and rounded once to bf16 into o[r] + 16 t0.
template <int R>
ZT_DOT_TARGET inline void dot_values(const uint16_t* p, int64_t lp, const uint32_t* values, int64_t dim, int64_t t0,
                                     int64_t n32, uint16_t* const* o, const float* total) {
  __m512 acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < 4; ++i) acc[r][i] = _mm512_setzero_ps();
  dot_chunks<R>(acc, p, lp, values, dim, t0, n32 / 32);
  for (int r = 0; r < R; ++r) {
    const __m512 inv = _mm512_set1_ps(1.0f / total[r]);
    for (int i = 0; i < 4; ++i)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(o[r] + 16 * (t0 + i)),
                          (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(acc[r][i], inv)));
  }
}

// The same sums for ``chunks`` chunks of values, added to the fp32 sums in o (rows dim apart, dims
// 16 t0 ..) where ``more``, else from zero, and stored back to o unrounded: a stream's chunks go on
// with the chain where the chunk before left it (the same bits as dot_values' one pass).
template <int R>
ZT_DOT_TARGET inline void dot_sums(const uint16_t* p, int64_t lp, const uint32_t* values, int64_t dim, int64_t t0,
                                   int64_t chunks, float* o, bool more) {
  __m512 acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < 4; ++i) acc[r][i] = more ? _mm512_loadu_ps(o + r * dim + 16 * (t0 + i)) : _mm512_setzero_ps();
  dot_chunks<R>(acc, p, lp, values, dim, t0, chunks);
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < 4; ++i) _mm512_storeu_ps(o + r * dim + 16 * (t0 + i), acc[r][i]);
}

constexpr int kScoreRows = 8, kValueRows = 6;  // rows per register block: 16 and 24 accumulators

template <int64_t D>
ZT_DOT_TARGET void dot_scores_rows(const uint16_t* q, const uint32_t* keys, int64_t width, float* s, int64_t ls,
                                   int64_t rows) {
  switch (rows) {
#define ZT_ROWS(R) \
    case R: dot_scores<R, D>(q, keys, width, s, ls); break;
    ZT_ROWS(8) ZT_ROWS(7) ZT_ROWS(6) ZT_ROWS(5) ZT_ROWS(4) ZT_ROWS(3) ZT_ROWS(2)
#undef ZT_ROWS
    default: dot_scores<1, D>(q, keys, width, s, ls); break;
  }
}

// f(std::integral_constant<int, R>{}) for R = rows, 1 to kValueRows: the value kernels' rows as a
// template argument.
template <typename F>
inline void with_value_rows(int64_t rows, const F& f) {
  switch (rows) {
#define ZT_ROWS(R) \
    case R: f(std::integral_constant<int, R>{}); break;
    ZT_ROWS(6) ZT_ROWS(5) ZT_ROWS(4) ZT_ROWS(3) ZT_ROWS(2)
#undef ZT_ROWS
    default: f(std::integral_constant<int, 1>{}); break;
  }
}
static_assert(kValueRows == 6, "with_value_rows names the rows up to kValueRows");

ZT_DOT_TARGET void dot_values_rows(const uint16_t* p, int64_t lp, const uint32_t* values, int64_t dim, int64_t t0,
                                   int64_t n32, uint16_t* const* o, const float* total, int64_t rows) {
  with_value_rows(rows, [&](auto r) { dot_values<decltype(r)::value>(p, lp, values, dim, t0, n32, o, total); });
}

ZT_DOT_TARGET void dot_sums_rows(const uint16_t* p, int64_t lp, const uint32_t* values, int64_t dim, int64_t t0,
                                 int64_t chunks, float* o, bool more, int64_t rows) {
  with_value_rows(rows, [&](auto r) { dot_sums<decltype(r)::value>(p, lp, values, dim, t0, chunks, o, more); });
}

// One block of rows r0 .. r0 + nr - 1 (one slot list) and one KV head, its keys and values in ``b``
// (dot_pack), written to the output: the block's query rows of the heads that share the KV head
// (m = rows x group), their scores against the block's longest row's keys, each row's softmax over
// its own keys, the weighted sums.
ZT_DOT_TARGET void dot_block_head(DotAttention& b, const AttentionProblem& pr, const int64_t* len, int64_t r0, int64_t nr,
                                  int64_t kh) {
  const int64_t heads = pr.heads, kv_heads = pr.kv_heads, dim = pr.dim;
  const int64_t group = heads / kv_heads, m = nr * group;
  int64_t n = 0;
  for (int64_t w = 0; w < nr; ++w) n = std::max(n, len[w]);
  const int64_t n64 = (n + 63) / 64 * 64, n32 = (n + 31) / 32 * 32;
  const int64_t ls = n64 + 16, lp = n32 + 32;  // rows one cache line past a power of two apart
  const auto row = [&](int64_t i) { return ((r0 + i / group) * heads + kh * group + i % group) * dim; };
  b.q.resize(m * dim);
  for (int64_t i = 0; i < m; ++i) std::memcpy(b.q.data() + i * dim, pr.q + row(i), dim * 2);
  b.s.resize(m * ls);
  for (int64_t i0 = 0; i0 < m; i0 += kScoreRows)
    (dim == 64 ? dot_scores_rows<64> : dot_scores_rows<128>)(b.q.data() + i0 * dim, b.keys.data(), n64,
                                                           b.s.data() + i0 * ls, ls, std::min<int64_t>(kScoreRows, m - i0));
  b.p.resize(m * lp);
  b.total.resize(m);
  for (int64_t i = 0; i < m; ++i)
    b.total[i] = softmax_row(b.s.data() + i * ls, len[i / group], pr.scale, b.p.data() + i * lp, n32);
  for (int64_t i0 = 0; i0 < m; i0 += kValueRows) {
    const int64_t rows = std::min<int64_t>(kValueRows, m - i0);
    uint16_t* o[kValueRows];
    for (int64_t r = 0; r < rows; ++r) o[r] = pr.out + row(i0 + r);
    for (int64_t t0 = 0; t0 < dim / 16; t0 += 4)
      dot_values_rows(b.p.data() + i0 * lp, lp, b.values.data(), dim, t0, n32, o, b.total.data() + i0, rows);
  }
}

// The keys and values of a block of rows on ``slot`` (up to the block's longest row, n) for KV heads
// kh0 .. kh0 + h - 1 into the group's heads, going on from what the blocks before packed of the same
// slot list and heads.
ZT_DOT_TARGET void dot_pack(DotGroup& g, int64_t h, const AttentionProblem& pr, const int64_t* slot, int64_t n,
                            int64_t kh0) {
  if (g.slot != slot || g.kh0 != kh0) {
    g.slot = slot;
    g.kh0 = kh0;
    g.packed = 0;
  }
  for (int64_t i = 0; i < h; ++i) {
    std::vector<uint32_t>&keys = g.heads[i].keys, &values = g.heads[i].values;
    keys.resize(std::max<size_t>(keys.size(), packed_keys_size(n, pr.dim)));
    values.resize(std::max<size_t>(values.size(), packed_values_size(n, pr.dim)));
  }
  pack_heads(pr, slot, g.packed, n, kh0, h, [&](int64_t i) { return g.heads[i].keys.data(); },
             [&](int64_t i) { return g.heads[i].values.data(); });
  g.packed = std::max(g.packed, n);
}

// One thread's share of the blocks: the KV heads in groups (heads_per_pack for the share's longest
// row), each group over the blocks in turn (a slot list's blocks one after another share what they
// packed into ``g``, kept by the caller from call to call), head(g.heads[i], r0, nr, kh) per block and
// KV head. The dot and tile kernels' one walk.
template <typename Head>
ZT_DOT_TARGET inline void share_blocks(DotGroup& g, const AttentionProblem& pr, const std::vector<int64_t>& start,
                                       const std::vector<int64_t>& share, const int64_t* slots, const int64_t* seq,
                                       const int64_t* lens, int64_t width, const Head& head) {
  int64_t longest = 1;
  for (int64_t blk : share) longest = std::max(longest, *std::max_element(lens + start[blk], lens + start[blk + 1]));
  const int64_t hn = heads_per_pack(longest, pr.dim, pr.kv_heads);
  if (static_cast<int64_t>(g.heads.size()) < hn) g.heads.resize(hn);
  for (int64_t kh0 = 0; kh0 < pr.kv_heads; kh0 += hn) {
    const int64_t h = std::min(hn, pr.kv_heads - kh0);
    g.slot = nullptr;  // what it packed is stale in a new call: the pool has changed
    for (int64_t blk : share) {
      const int64_t r0 = start[blk], nr = start[blk + 1] - r0;
      const int64_t* slot = slots + seq[r0] * width;
      dot_pack(g, h, pr, slot, *std::max_element(lens + r0, lens + r0 + nr), kh0);
      for (int64_t i = 0; i < h; ++i) head(g.heads[i], r0, nr, kh0 + i);
    }
  }
}

// A block of at most 16 query rows whose slot list no other block of the call reads (a decode, a few
// rows of a prompt), on enough keys (the kernel's kStreamFrom): its keys and values are not packed for
// the whole list (a decode reuses none of it; packing 2,048 keys and values of every KV head took 80%
// of a tile decode's time, the packed copy going out to L2 and back) but a chunk at a time
// (kStreamKeys, kStreamValues): the chunk's slots copied whole, every KV head, as the pool lies
// (stage_slots), then each head's keys or values packed from the copy and used at once. Each element
// is the one the packed walk gives: the same products added in the same order (O's sums stored
// between chunks in fp32 and loaded again). The dot and tile kernels' stream (the tile kernel's chunks
// packed straight from the pool, without the copy, and a bf16 pool's keys not packed at all:
// kStreamFrom and key_scores in attention_tiles.cpp).
constexpr int64_t kStreamKeys = 64, kStreamValues = 128;

struct StreamBuffers {
  std::vector<uint16_t> q, p, stage;  // (KV head, m rows, dim), (KV head x m rows, lp), a chunk's slots
  std::vector<uint8_t> stage_codes;   // a chunk's slots of an 8-bit pool: codes, scales
  std::vector<float> stage_scales;
  std::vector<int64_t> iota;  // 0, 1, .. (the staged slots' numbers)
  std::vector<uint32_t> keys, values;  // one chunk's
  std::vector<float> s, o, total;  // (KV head x m, ls), (KV head x m, dim), (KV head x m)
};

// Where a chunk's keys or values are packed from: a pool, its slots, the chunk's first key and the
// list's length (pack_keys' and pack_values' arguments).
struct Staged {
  KVSource src;
  const int64_t* slot;
  int64_t from, n;
};

// Slots j0 .. j1 (below n) of a pool, every KV head, copied whole and in order into b's stage (slot
// j0 + c at c): read as the pool lies, not one head's vector at a slot's stride, each run of
// consecutive slots (a block's) in one copy (16 decodes of 2,048 keys over 30 layers' pools, out of
// cache as in the engine: 0.94-0.96x the time of a copy per slot, tile kernel); an 8-bit pool's codes
// and scales alike.
inline Staged stage_slots(StreamBuffers& b, const KVSource& src, const int64_t* slot, int64_t j0, int64_t j1, int64_t n,
                          int64_t kv_heads, int64_t dim) {
  const int64_t width = kv_heads * dim;
  const bool dense = src.bf16 != nullptr;
  if (dense) {
    b.stage.resize((j1 - j0) * width);
  } else {
    b.stage_codes.resize((j1 - j0) * width);
    b.stage_scales.resize((j1 - j0) * kv_heads);
  }
  if (static_cast<int64_t>(b.iota.size()) < 2 * (j1 - j0)) {  // pack_keys names the next 16 slots too
    b.iota.resize(2 * (j1 - j0));
    for (size_t i = 0; i < b.iota.size(); ++i) b.iota[i] = static_cast<int64_t>(i);
  }
  for (int64_t c = j0, end = std::min(j1, n); c < end;) {
    int64_t e = c + 1;
    while (e < end && slot[e] == slot[e - 1] + 1) ++e;
    if (dense) {
      std::memcpy(b.stage.data() + (c - j0) * width, src.bf16 + slot[c] * width, (e - c) * width * 2);
    } else {
      std::memcpy(b.stage_codes.data() + (c - j0) * width, src.codes + slot[c] * width, (e - c) * width);
      std::memcpy(b.stage_scales.data() + (c - j0) * kv_heads, src.scales + slot[c] * kv_heads, (e - c) * kv_heads * 4);
    }
    c = e;
  }
  KVSource staged;
  if (dense) {
    staged.bf16 = b.stage.data();
  } else {
    staged.codes = b.stage_codes.data();
    staged.scales = b.stage_scales.data();
    staged.fmt = src.fmt;
  }
  return Staged{staged, b.iota.data(), 0, n - j0};
}

// Slots a .. b (below n) of a pool, every KV head, requested into L2 (an 8-bit pool's codes and scales).
__attribute__((always_inline)) inline void prefetch_slots(const KVSource& src, const int64_t* slot, int64_t a, int64_t b,
                                                           int64_t n, int64_t kv, int64_t dim) {
  for (int64_t c = a, end = std::min(b, n); c < end; ++c) {
    if (src.bf16 != nullptr) {
      const char* from = reinterpret_cast<const char*>(src.bf16 + slot[c] * kv * dim);
      for (int64_t off = 0; off < kv * dim * 2; off += 64) _mm_prefetch(from + off, _MM_HINT_T1);
      continue;
    }
    const char* codes = reinterpret_cast<const char*>(src.codes + slot[c] * kv * dim);
    for (int64_t off = 0; off < kv * dim; off += 64) _mm_prefetch(codes + off, _MM_HINT_T1);
    const char* scales = reinterpret_cast<const char*>(src.scales + slot[c] * kv);
    for (int64_t off = 0; off < kv * 4; off += 64) _mm_prefetch(scales + off, _MM_HINT_T1);
  }
}

// One query row's output: its sums o (dim) over its total, rounded once to bf16 into out.
ZT_DOT_TARGET inline void store_row(uint16_t* out, const float* o, float total, int64_t dim) {
  const __m512 inv = _mm512_set1_ps(1.0f / total);
  for (int64_t d = 0; d < dim; d += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + d), (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(o + d), inv)));
}

// One streamed block of rows r0 .. r0 + nr - 1 (m = nr x group rows a KV head), every KV head: the
// query rows into b.q, scores(n, m, n64, ls) into b.s, each row's softmax into b.p, sums(n, m, n32,
// lp) into b.o, written to the output.
template <typename Scores, typename Sums>
ZT_DOT_TARGET void stream_rows(StreamBuffers& b, const AttentionProblem& pr, const int64_t* len, int64_t r0, int64_t nr,
                               const Scores& scores, const Sums& sums) {
  const int64_t heads = pr.heads, kv = pr.kv_heads, dim = pr.dim, group = heads / kv, m = nr * group;
  const int64_t n = *std::max_element(len, len + nr);
  const int64_t n64 = (n + 63) / 64 * 64, n32 = (n + 31) / 32 * 32;
  const int64_t ls = n64 + 16, lp = n32 + 32;  // rows one cache line past a power of two apart
  const auto row = [&](int64_t kh, int64_t i) { return ((r0 + i / group) * heads + kh * group + i % group) * dim; };
  b.q.resize(kv * m * dim);
  for (int64_t kh = 0; kh < kv; ++kh)
    for (int64_t i = 0; i < m; ++i) std::memcpy(b.q.data() + (kh * m + i) * dim, pr.q + row(kh, i), dim * 2);
  b.s.resize(kv * m * ls);
  scores(n, m, n64, ls);
  b.p.resize(kv * m * lp);
  b.total.resize(kv * m);
  for (int64_t i = 0; i < kv * m; ++i)
    b.total[i] = softmax_row(b.s.data() + i * ls, len[i % m / group], pr.scale, b.p.data() + i * lp, n32);
  b.o.resize(kv * m * dim);
  sums(n, m, n32, lp);
  for (int64_t kh = 0; kh < kv; ++kh)
    for (int64_t i = 0; i < m; ++i) store_row(pr.out + row(kh, i), b.o.data() + (kh * m + i) * dim, b.total[kh * m + i], dim);
}

// A thread's share of the blocks: each block of at most 16 query rows a KV head, alone on its slot
// list in the call, on ``from`` keys or more, streamed (stream(r0, nr, slot)); the others returned,
// to be packed.
template <typename Stream>
inline std::vector<int64_t> stream_alone(const std::vector<int64_t>& start, const std::vector<int64_t>& share,
                                         const int64_t* slots, const int64_t* seq, const int64_t* lens, int64_t width,
                                         int64_t group, int64_t from, const Stream& stream) {
  std::vector<int64_t> packed;
  const int64_t rows = start.back();
  for (int64_t blk : share) {
    const int64_t r0 = start[blk], r1 = start[blk + 1];
    const bool alone = (r0 == 0 || seq[r0 - 1] != seq[r0]) && (r1 == rows || seq[r1] != seq[r0]);
    if (alone && (r1 - r0) * group <= 16 && *std::max_element(lens + r0, lens + r1) >= from)
      stream(r0, r1 - r0, slots + seq[r0] * width);
    else
      packed.push_back(blk);
  }
  return packed;
}

// The dot kernel streams from 64 keys: 32 decodes on Zen 5 (30 layers' pools, out of cache), against
// packing the list, 0.70x the time at 64 and 128 keys, 0.65-0.67x at 256-512, 0.42-0.47x at 4,096;
// at 16 keys the same (within noise).
constexpr int64_t kDotStreamFrom = 64;

// A streamed block on VDPBF16PS: per chunk of kStreamKeys keys and KV head, the keys packed
// (pack_keys) and the head's m rows scored (dot_scores); per chunk of kStreamValues keys, the values
// packed (pack_values) and the sums gone on with (dot_sums). Meanwhile the next chunk's slots are
// requested into L2 a part before each packing (16 decodes of 2,048 keys over 30 layers' pools, out
// of cache, Zen 5: 0.84-0.86x the time of no request; the whole next chunk at once after the copy,
// 0.88x: the requests then wait on each other, and no work goes on meanwhile).
ZT_DOT_TARGET void dot_stream_block(StreamBuffers& b, const AttentionProblem& pr, const int64_t* len, const int64_t* slot,
                                    int64_t r0, int64_t nr) {
  const int64_t dim = pr.dim, kv = pr.kv_heads, halves = dim / 32, tiles = dim / 16;
  const auto score = dim == 64 ? dot_scores_rows<64> : dot_scores_rows<128>;
  stream_rows(b, pr, len, r0, nr,
              [&](int64_t n, int64_t m, int64_t n64, int64_t ls) {
                b.keys.resize(kStreamKeys / 16 * halves * 256);
                for (int64_t j0 = 0; j0 < n64; j0 += kStreamKeys) {
                  const Staged st = stage_slots(b, pr.kp, slot, j0, j0 + kStreamKeys, n, kv, dim);
                  const int64_t parts = kv * kStreamKeys / 16, next = j0 + kStreamKeys;
                  for (int64_t kh = 0; kh < kv; ++kh) {
                    for (int64_t i = 0; i < kStreamKeys / 16; ++i) {
                      const int64_t part = kh * kStreamKeys / 16 + i;
                      prefetch_slots(pr.kp, slot, next + kStreamKeys * part / parts, next + kStreamKeys * (part + 1) / parts, n,
                                     kv, dim);
                      pack_keys(st.src, st.slot, st.from + 16 * i, st.n, kv, kh, dim, b.keys.data() + i * halves * 256);
                    }
                    for (int64_t i0 = 0; i0 < m; i0 += kScoreRows)
                      score(b.q.data() + (kh * m + i0) * dim, b.keys.data(), kStreamKeys, b.s.data() + (kh * m + i0) * ls + j0,
                            ls, std::min<int64_t>(kScoreRows, m - i0));
                  }
                }
              },
              [&](int64_t n, int64_t m, int64_t n32, int64_t lp) {
                b.values.resize(kStreamValues / 32 * tiles * 256);
                for (int64_t j0 = 0; j0 < n32; j0 += kStreamValues) {
                  const int64_t chunks = std::min(kStreamValues, n32 - j0) / 32;
                  const Staged st = stage_slots(b, pr.vp, slot, j0, j0 + kStreamValues, n, kv, dim);
                  const int64_t parts = kv * kStreamValues / 32, next = j0 + kStreamValues;
                  for (int64_t kh = 0; kh < kv; ++kh) {
                    for (int64_t c = 0; c < kStreamValues / 32; ++c) {
                      const int64_t part = kh * kStreamValues / 32 + c;
                      prefetch_slots(pr.vp, slot, next + kStreamValues * part / parts, next + kStreamValues * (part + 1) / parts,
                                     n, kv, dim);
                      if (c < chunks)
                        pack_values(st.src, st.slot, st.from + 32 * c, st.n, kv, kh, dim, b.values.data() + c * tiles * 256);
                    }
                    for (int64_t i0 = 0; i0 < m; i0 += kValueRows)
                      for (int64_t t0 = 0; t0 < tiles; t0 += 4)
                        dot_sums_rows(b.p.data() + (kh * m + i0) * lp + j0, lp, b.values.data(), dim, t0, chunks,
                                      b.o.data() + (kh * m + i0) * dim, j0 > 0, std::min<int64_t>(kValueRows, m - i0));
                  }
                }
              });
}

// The dot kernel's share of the blocks (share_blocks).
ZT_DOT_TARGET void dot_share(const AttentionProblem& pr, const std::vector<int64_t>& start,
                             const std::vector<int64_t>& share, const int64_t* slots, const int64_t* seq,
                             const int64_t* lens, int64_t width) {
  thread_local StreamBuffers stream;
  const std::vector<int64_t> packed =
      stream_alone(start, share, slots, seq, lens, width, pr.heads / pr.kv_heads, kDotStreamFrom,
                   [&](int64_t r0, int64_t nr, const int64_t* slot) { dot_stream_block(stream, pr, lens + r0, slot, r0, nr); });
  if (packed.empty()) return;
  thread_local DotGroup g;  // kept from call to call (no fresh pages each call)
  share_blocks(g, pr, start, packed, slots, seq, lens, width, [&](DotAttention& b, int64_t r0, int64_t nr, int64_t kh) {
    dot_block_head(b, pr, lens + r0, r0, nr, kh);
  });
}

// The rows in attend_avx512's blocks, dealt to the threads by their work the same way; run(pr, start,
// blocks) computes one thread's blocks (the tile kernel's too).
template <typename Run>
void attend_blocks(const c10::BFloat16* q, const KVSource& kp, const KVSource& vp, const int64_t* seq,
                   const int64_t* lens, c10::BFloat16* out, int64_t rows, int64_t heads, int64_t kv_heads, int64_t dim,
                   float scale, const Run& run) {
  const std::vector<int64_t> start = row_blocks(seq, rows);
  const int64_t blocks = static_cast<int64_t>(start.size()) - 1;
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), blocks));
  const std::vector<std::vector<int64_t>> share = deal(start, lens, threads);
  const AttentionProblem pr{reinterpret_cast<const uint16_t*>(q), kp, vp, reinterpret_cast<uint16_t*>(out), heads, kv_heads,
                            dim, scale};
  at::parallel_for(0, threads, 1, [&](int64_t first, int64_t last) {
    for (int64_t t = first; t < last; ++t) run(pr, start, share[t]);
  });
}

void attend_dot(const c10::BFloat16* q, const KVSource& kp, const KVSource& vp, const int64_t* slots,
                const int64_t* seq, const int64_t* lens, c10::BFloat16* out, int64_t rows, int64_t heads,
                int64_t kv_heads, int64_t dim, int64_t width, float scale) {
  attend_blocks(q, kp, vp, seq, lens, out, rows, heads, kv_heads, dim, scale,
                [&](const AttentionProblem& pr, const std::vector<int64_t>& start, const std::vector<int64_t>& mine) {
                  dot_share(pr, start, mine, slots, seq, lens, width);
                });
}
#endif
