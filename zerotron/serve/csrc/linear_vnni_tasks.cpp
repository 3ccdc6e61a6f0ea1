// ---- 8-bit-activation products, continued: a decode's factors and one-row kernel, the tasks ----------
// The factors' tables of a decode read with their kinds as template arguments (va_outputs_factors, the
// fp32-activation kernel's direct path uses them too), one row's four-outputs pass (va_decode4), and
// the products' tasks, planning and entry (va_tasks, va_plan, q8a8_linear_many).
#if defined(ZT_Q8)
// A factor's table as va_row_entries reads it, its kind a template argument and what the reads of its
// entries need made once a call: a decode's direct paths make every output's scales this way (with the
// kind and the entries' spacing found entry by entry, those reads took a third of a one-row Q4_K
// product's time on AVX512-VNNI).
struct VaTable {
  const char* p = nullptr;
  int64_t row = 0;     // an output's bytes on
  int64_t spare = 0;   // per - 1: a group's place in its entry's run of per
  int64_t size = 0;    // an entry's bytes (0: absent)
  int32_t shift = 0;   // log2 per
};
inline VaTable va_table(const Factor& f) {
  VaTable v;
  v.p = static_cast<const char*>(f.p);
  v.size = f.kind == 0 ? 0 : factor_bytes(f);
  v.row = f.so * v.size;
  v.shift = f.kind == 0 ? 0 : __builtin_ctzll(static_cast<uint64_t>(f.per));
  v.spare = (int64_t{1} << v.shift) - 1;
  return v;
}
// va_row_entries for a table of kind KIND (per 1 read through the identity permutation: no branch).
template <int KIND>
ZT_VNNI_TARGET __attribute__((always_inline)) inline __m512 va_table_entries(const VaTable& f, int64_t o, int64_t g, int64_t left) {
  if constexpr (KIND == 0) return _mm512_set1_ps(1.0f);
  constexpr int64_t size = KIND == 1 ? 4 : (KIND == 3 || KIND == 4) ? 1 : 2;
  const int64_t r = g & f.spare;
  const __m512i idx = _mm512_srl_epi32(
      _mm512_add_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                       _mm512_set1_epi32(static_cast<int32_t>(r))),
      _mm_cvtsi32_si128(f.shift));
  const char* at = f.p + o * f.row + (g >> f.shift) * size;
  return _mm512_permutexvar_ps(idx, va_entries(KIND, at, ((r + left - 1) >> f.shift) + 1));
}

// A table's 16 >> shift entries from p under mask k, as fp32, spread over 16 groups by idx (their
// places' entries: 16 whole groups from a multiple of 16, per dividing 16, read by one permutation).
template <int KIND, bool PERMUTE>
ZT_VNNI_TARGET __attribute__((always_inline)) inline __m512 va_spread(const char* p, __mmask16 k, __m512i idx) {
  if constexpr (KIND == 0) return _mm512_set1_ps(1.0f);
  __m512 e;
  if constexpr (KIND == 1) e = _mm512_maskz_loadu_ps(k, p);
  else if constexpr (KIND == 2) e = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(k, p));
  else if constexpr (KIND == 3) e = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(k, p)));
  else if constexpr (KIND == 4) e = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(k, p)));
  else e = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(k, p)), 16));
  return PERMUTE ? _mm512_permutexvar_ps(idx, e) : e;  // an entry per group: the identity
}

// va_slice_factors of every group for outputs o .. o + count - 1 (output j's scales at s + j * stride,
// its mins at m + j * stride), the factors' kinds template arguments: the same products, so their bits.
// Where every table has an entry per 1, 2, 4, 8 or 16 groups, each whole 16 groups' entries lie in the
// same places of the same permutation (made once), read under one mask (a factor of an entry per
// group, the second of a pair or a lone one, as it lies); the rest through va_table_entries.
template <int S1, int S2, int M1, int M2>
ZT_VNNI_TARGET void va_outputs_kinds(const Q8Problem& t, int64_t o, int64_t count, int64_t groups, float* s, float* m,
                                     int64_t stride) {
  const VaTable f[4] = {va_table(t.s1), va_table(t.s2), va_table(t.m1), va_table(t.m2)};
  // exactly -m where added: the sign bit as an integer (a float -0.0 and 0.0 may fold as one)
  const __m512 sign = _mm512_castsi512_ps(_mm512_set1_epi32(t.add_mins ? INT32_MIN : 0));
  const __m512i iota = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  __m512i idx[4];
  __mmask16 k[4];
  int64_t step[4];  // a whole 16 groups' bytes in a table
  bool spread = true;
  for (int i = 0; i < 4; ++i) {
    spread = spread && f[i].shift <= 4;
    idx[i] = _mm512_srl_epi32(iota, _mm_cvtsi32_si128(f[i].shift));
    k[i] = static_cast<__mmask16>((1u << (16 >> std::min(f[i].shift, 4))) - 1);
    step[i] = (16 >> std::min(f[i].shift, 4)) * f[i].size;
  }
  const int64_t whole = spread ? groups / 16 * 16 : 0;
  for (int64_t j = 0; j < count; ++j) {
    const char* at[4];
    for (int i = 0; i < 4; ++i) at[i] = f[i].p + (o + j) * f[i].row;
    for (int64_t g = 0; g < whole; g += 16) {
      __m512 e = va_spread<S1, S2 != 0>(at[0], k[0], idx[0]);
      if constexpr (S2 != 0) e = _mm512_mul_ps(e, va_spread<S2, false>(at[1], k[1], idx[1]));
      _mm512_storeu_ps(s + j * stride + g, e);
      if constexpr (M1 != 0) {
        __m512 n = va_spread<M1, M2 != 0>(at[2], k[2], idx[2]);
        if constexpr (M2 != 0) n = _mm512_mul_ps(n, va_spread<M2, false>(at[3], k[3], idx[3]));
        _mm512_storeu_ps(m + j * stride + g, _mm512_xor_ps(n, sign));
      }
      for (int i = 0; i < 4; ++i) at[i] += step[i];
    }
    for (int64_t g = whole; g < groups; g += 16) {
      const int64_t left = std::min<int64_t>(16, groups - g);
      const __mmask16 kl = static_cast<__mmask16>(left >= 16 ? 0xFFFF : (1u << left) - 1);
      __m512 e = va_table_entries<S1>(f[0], o + j, g, left);
      if constexpr (S2 != 0) e = _mm512_mul_ps(e, va_table_entries<S2>(f[1], o + j, g, left));
      _mm512_mask_storeu_ps(s + j * stride + g, kl, e);
      if constexpr (M1 != 0) {
        __m512 n = va_table_entries<M1>(f[2], o + j, g, left);
        if constexpr (M2 != 0) n = _mm512_mul_ps(n, va_table_entries<M2>(f[3], o + j, g, left));
        _mm512_mask_storeu_ps(m + j * stride + g, kl, _mm512_xor_ps(n, sign));
      }
    }
  }
}

inline bool per_one(const Factor& f) { return f.kind == 0 || f.per == 1; }

// Outputs o .. o + count - 1's scales and mins of every group, as va_slice_factors makes them, where
// every factor's table is read as va_row_entries reads it (va_per_group): the kinds the loaders give
// (a file's f16 scale with or without a min, a K type's f16 super-block scale times its int8 or
// uint8 sub-block scales and mins, a model's f32, f16 or bf16 scales and zeros) through
// va_outputs_kinds, any other output by output.
ZT_VNNI_TARGET void va_outputs_factors(const Q8Problem& t, int64_t o, int64_t count, int64_t groups, float* s, float* m,
                                       int64_t stride) {
  // a second factor's entries (a K type's sub-block scales) and a lone factor's lie a group each: the
  // identity permutation left out (va_spread); any other spacing output by output
  const bool plain = per_one(t.s2.kind != 0 ? t.s2 : t.s1) && per_one(t.m2.kind != 0 ? t.m2 : t.m1);
  const int code = plain ? t.s1.kind | t.s2.kind << 4 | t.m1.kind << 8 | t.m2.kind << 12 : -1;
  switch (code) {
    case 0x0001: return va_outputs_kinds<1, 0, 0, 0>(t, o, count, groups, s, m, stride);
    case 0x0002: return va_outputs_kinds<2, 0, 0, 0>(t, o, count, groups, s, m, stride);
    case 0x0005: return va_outputs_kinds<5, 0, 0, 0>(t, o, count, groups, s, m, stride);
    case 0x0101: return va_outputs_kinds<1, 0, 1, 0>(t, o, count, groups, s, m, stride);
    case 0x0202: return va_outputs_kinds<2, 0, 2, 0>(t, o, count, groups, s, m, stride);
    case 0x0505: return va_outputs_kinds<5, 0, 5, 0>(t, o, count, groups, s, m, stride);
    case 0x0032: return va_outputs_kinds<2, 3, 0, 0>(t, o, count, groups, s, m, stride);
    case 0x0042: return va_outputs_kinds<2, 4, 0, 0>(t, o, count, groups, s, m, stride);
    case 0x4242: return va_outputs_kinds<2, 4, 2, 4>(t, o, count, groups, s, m, stride);
    default:
      for (int64_t j = 0; j < count; ++j) va_slice_factors(t, o + j, 0, groups, s + j * stride, m + j * stride);
  }
}

// One chunk of va_decode4: the four outputs' 64 bytes b against the row's quantised inputs xc (lane
// sums from a0, block scales d), each output's 16 lanes' scales permuted (idx) from sg + j * ls.
template <int KIND, bool TABLE>
ZT_VNNI_TARGET __attribute__((always_inline)) inline void va_decode_chunk(const __m512i (&b)[4], __m512i a0, __m512 d,
                                                                          const int8_t* xc, const float* sg, int64_t ls,
                                                                          __m512i idx, __m512i ulut, __m512 (&acc)[4]) {
  const __m512i x0 = _mm512_loadu_si512(xc), x1 = KIND == 1 ? _mm512_loadu_si512(xc + 64) : x0;
#pragma GCC unroll 4
  for (int j = 0; j < 4; ++j) {
    __m512i lo, hi;
    va_operands<KIND>(b[j], TABLE, ulut, lo, hi);
    acc[j] = va_step<KIND>(acc[j], a0, lo, hi, x0, x1, _mm512_permutexvar_ps(idx, _mm512_loadu_ps(sg + j * ls)), d);
  }
}

// One row r against outputs o .. o + 3, where each output's values lie together in k order (chunk c's
// 64 bytes at 64c: va_plan's `flat`): va_output<KIND, 1, true, true, true, 4>'s arithmetic, so its bits,
// with the values' pointer stepped a chunk at a time, the last chunk's mask apart, IQ4_NL's table a
// template argument, and the outputs VA_AHEAD on fetched a line a chunk where all four lie in the
// product (va_output fetches each that does).
template <int KIND, bool TABLE>
ZT_VNNI_TARGET void va_decode4(const Q8Problem& t, const VnniRows& v, int64_t r, int64_t o, const float* s, const float* m,
                               const VaChunks& ch, __m512i idx, int64_t ls) {
  constexpr int64_t width = KIND == 1 ? 128 : 64;  // a chunk's inputs
  const int64_t qo = t.qo, qo3 = 3 * qo, ahead = o + 3 + VA_AHEAD < t.n ? VA_AHEAD * qo : 0;
  for (int j = 0; j < 4; ++j) q8_prefetch_factors(t, o + j + VA_AHEAD);
  const int8_t* p = t.q + o * qo;
  const int8_t* xq = v.xq.data() + r * v.kp;
  const int32_t* corr = v.corr.data() + r * v.lanes;
  const float* dl = v.dl.data() + r * v.lanes;
  const int64_t* group = ch.group.data();
  const __m512i top = _mm512_set1_epi8(static_cast<char>(0x80));
  const __m512i ulut = _mm512_xor_si512(_mm512_broadcast_i32x4(_mm_load_si128(reinterpret_cast<const __m128i*>(t.lut))), top);
  __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
  for (int64_t c = 0; c < ch.full; ++c, p += 64) {
    if (ahead != 0) {
      _mm_prefetch(reinterpret_cast<const char*>(p + ahead), _MM_HINT_T1);
      _mm_prefetch(reinterpret_cast<const char*>(p + ahead + qo), _MM_HINT_T1);
      _mm_prefetch(reinterpret_cast<const char*>(p + ahead + 2 * qo), _MM_HINT_T1);
      _mm_prefetch(reinterpret_cast<const char*>(p + ahead + qo3), _MM_HINT_T1);
    }
    const __m512i b[4] = {_mm512_loadu_si512(p), _mm512_loadu_si512(p + qo), _mm512_loadu_si512(p + 2 * qo),
                          _mm512_loadu_si512(p + qo3)};
    va_decode_chunk<KIND, TABLE>(b, _mm512_loadu_si512(corr + c * 16), _mm512_loadu_ps(dl + c * 16), xq + c * width,
                                 s + group[c], ls, idx, ulut, acc);
  }
  if (ch.full < ch.chunks) {
    const int64_t c = ch.full;
    const __m512i b[4] = {_mm512_maskz_loadu_epi8(ch.tail, p), _mm512_maskz_loadu_epi8(ch.tail, p + qo),
                          _mm512_maskz_loadu_epi8(ch.tail, p + 2 * qo), _mm512_maskz_loadu_epi8(ch.tail, p + qo3)};
    va_decode_chunk<KIND, TABLE>(b, _mm512_loadu_si512(corr + c * 16), _mm512_loadu_ps(dl + c * 16), xq + c * width,
                                 s + group[c], ls, idx, ulut, acc);
  }
#pragma GCC unroll 4
  for (int j = 0; j < 4; ++j) t.y[r * t.ldy + o + j] = va_finish(v, r, ch, acc[j], m == nullptr ? nullptr : m + j * ls);
}

// Tasks [begin, end) of one thread: task = (chunk of rows, tile of outputs), chunk-major; ``first``:
// the 16 lanes' first groups (loaded here: a 512-bit value may not cross into code built without
// AVX-512, as q8a8_linear_many is on an AVX2 build).
ZT_VNNI_TARGET void va_tasks(const Q8Problem& t, const VnniRows& v, const VaChunks& ch, const int32_t* first, int64_t begin,
                             int64_t end) {
  const __m512i idx = _mm512_load_si512(first);
  const int64_t groups = t.k / t.group, stride = groups + 16;  // a tile's outputs' scales, 16 zeros after each
  const bool mins = t.m1.kind != 0;
  // a chunk of up to VA_DIRECT rows (a decode of up to 16 sequences): the factors' tables read 16
  // groups a step where each has an entry per group or per a power of two of groups, and each output's
  // values and factors fetched ahead (va_output's AHEAD) by the chunk's first block of rows (16
  // sequences of the 1.7B shape's Q8_0 fetched nothing ahead and decoded slower than 4, BENCHMARKS.md)
  const bool direct = t.chunk <= VA_DIRECT && ch.aligned && ch.together && va_per_group(t.s1) && va_per_group(t.s2) &&
                      va_per_group(t.m1) && va_per_group(t.m2);
  std::vector<float> s(static_cast<size_t>(VA_TILE * stride), 0.0f), m(static_cast<size_t>(VA_TILE * stride), 0.0f);
  // the groups' offsets in the tables va_row_entries does not read (a bf16 model's scale_zero, say);
  // a direct chunk's tables are all read by it
  std::vector<int32_t> off[4];
  const Factor* fs[4] = {&t.s1, &t.s2, &t.m1, &t.m2};
  for (int i = 0; i < 4 && !direct; ++i) off[i] = va_offsets(*fs[i], groups);
  auto offsets = [&](int i) { return off[i].empty() ? nullptr : off[i].data(); };
  for (int64_t task = begin; task < end; ++task) {
    const int64_t tile = task % t.tiles, mc = task / t.tiles;
    const int64_t r0 = mc * t.chunk, r1 = std::min(t.rows, r0 + t.chunk);
    const int64_t o0 = tile * VA_TILE, o1 = std::min(t.n, o0 + VA_TILE);
    // one row: each pass's outputs' factors made just before it (the tile's at once were evicted by its
    // weights before their use); rows of a block: the tile's at once
    const bool each = direct && r1 - r0 == 1;
    if (direct && !each) va_outputs_factors(t, o0, o1 - o0, groups, s.data(), m.data(), stride);
    for (int64_t o = o0; o < o1; ++o) {  // the outputs' scales and mins, all groups
      float* so = s.data() + (o - o0) * stride;
      float* mo = m.data() + (o - o0) * stride;
      if (direct) continue;  // made above or below
      va_factor(t.s1, o, groups, so, true, offsets(0));
      va_factor(t.s2, o, groups, so, false, offsets(1));
      if (mins) {
        va_factor(t.m1, o, groups, mo, true, offsets(2));
        va_factor(t.m2, o, groups, mo, false, offsets(3));
        if (t.add_mins)
          for (int64_t g = 0; g < groups; ++g) mo[g] = -mo[g];
      }
    }
    // a block of rows against each of the tile's outputs: the block's quantised rows and the tile's
    // weights both stay in L1 across the other's loop
    for (int64_t r = r0; r < r1;) {
      const int64_t mr = r1 - r >= 4 ? 4 : r1 - r >= 2 && ch.together && ch.aligned ? 2 : 1;
      for (int64_t o = o0; o < o1;) {
        const int64_t at = each ? 0 : (o - o0) * stride;
        if (each) va_outputs_factors(t, o, std::min<int64_t>(4, o1 - o), groups, s.data(), m.data(), stride);
        const float* so = s.data() + at;
        const float* mp = mins ? m.data() + at : nullptr;
        if (mr == 1 && direct && o1 - o >= 4) {  // one row: four outputs a pass over its chunks
          if (ch.flat && t.kind == 1 && t.offset < 0) va_decode4<1, true>(t, v, r, o, so, mp, ch, idx, stride);
          else if (ch.flat && t.kind == 1) va_decode4<1, false>(t, v, r, o, so, mp, ch, idx, stride);
          else if (ch.flat) va_decode4<0, false>(t, v, r, o, so, mp, ch, idx, stride);
          else if (t.kind == 1) va_output<1, 1, true, true, true, 4>(t, v, r, o, so, mp, ch, idx, stride);
          else va_output<0, 1, true, true, true, 4>(t, v, r, o, so, mp, ch, idx, stride);
          o += 4;
          continue;
        }
        // rows in blocks of 4 (or 2) times a few outputs, where the layout takes them
        // the weights come from memory for the chunk's first block of rows, from cache for the others
        const bool ahead = direct && r == r0;
        if (mr == 4 ? va_blocks<4>(t, v, r, o, o1 - o, so, mp, ch, idx, stride, ahead)
                    : mr == 2 && va_blocks<2>(t, v, r, o, o1 - o, so, mp, ch, idx, stride, ahead)) {
          o += VA_BLOCK[t.kind == 1];
          continue;
        }
        if (mr == 4) va_rows<4>(t, v, r, o, so, mp, ch, idx, ahead);
        for (int64_t i = 0; i < mr && mr < 4; ++i) va_rows<1>(t, v, r + i, o, so, mp, ch, idx, ahead);
        ++o;
      }
      r += mr;
    }
  }
}

// The rows of t quantised into v (read by every product with t's kind of values, offset and group).
void va_quantize_rows(const Q8Problem& t, VnniRows& v, bool mins, bool avx2) {
  v.width = t.kind == 1 ? 8 : 4;
  v.kp = (t.k + VA_SLICE - 1) / VA_SLICE * VA_SLICE;
  v.lanes = v.kp / v.width;
  v.xq.assign(static_cast<size_t>(t.rows * v.kp), 0);
  v.corr.assign(static_cast<size_t>(t.rows * v.lanes), 0);
  v.dl.assign(static_cast<size_t>(t.rows * v.lanes), 0.0f);
  if (mins) v.xs.assign(static_cast<size_t>(t.rows * (t.k / t.group)), 0.0f);
  at::parallel_for(0, t.rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) avx2 ? va2_quantize(t, v, r, mins) : va_quantize(t, v, r, mins);
  });
}

// A problem's chunks of inputs (VaChunks) and its lanes' first groups; sets its tiles and row chunk.
struct VaPlan {
  VaChunks ch;
  alignas(64) int32_t first[16];
};

void va_plan(Q8Problem& t, int64_t width, VaPlan& p) {
  // a lane's group; where a chunk holds whole groups (or a group whole chunks) the same permutation
  // of the chunk's first 16 group scales serves every chunk
  VaChunks& ch = p.ch;
  const int64_t groups = t.k / t.group, chunk = 16 * width, lanes = (t.k + VA_SLICE - 1) / VA_SLICE * VA_SLICE / width;
  const int64_t shift = t.kind == 1 ? 1 : 0;
  for (int64_t kc = 0; kc < t.k; kc += chunk) {
    ch.group.push_back(kc / t.group);
    ch.at.push_back((kc / t.group) * t.qg + ((kc % t.group) >> shift));
  }
  ch.lane_group.resize(static_cast<size_t>(lanes));
  for (int64_t l = 0; l < lanes; ++l) ch.lane_group[l] = static_cast<int32_t>(std::min(groups - 1, l * width / t.group));
  ch.groups = groups;
  ch.chunks = static_cast<int64_t>(ch.group.size());
  ch.full = (t.k >> shift) / 64;
  ch.tail = ((t.k >> shift) % 64) ? (1ULL << ((t.k >> shift) % 64)) - 1 : ~0ULL;
  ch.aligned = chunk % t.group == 0 || t.group % chunk == 0;
  ch.together = t.qg == (t.group >> shift) || t.group % chunk == 0;
  ch.flat = t.qg == (t.group >> shift) && t.qo >= (t.k >> shift);  // chunk c's bytes at 64c
  for (int l = 0; l < 16; ++l) p.first[l] = static_cast<int32_t>(t.group >= chunk ? 0 : l * width / t.group);
  t.tiles = (t.n + VA_TILE - 1) / VA_TILE;
  t.chunk = std::min<int64_t>(VA_MC, t.rows);
}

// Several products of the same rows (q8_linear_many's) in one parallel region, the rows quantised
// once for all the products with the same kind of values, offset and group (what each would quantise);
// avx2: on the AVX2 code (linear_a8_avx2.cpp: a CPU without AVX512-VNNI, or asked for), the same bits.
void q8a8_linear_many(std::vector<Q8Problem>& ts, bool avx2) {
  const size_t count = ts.size();
  std::vector<size_t> rows_of(count);  // the problem whose quantised rows problem i reads
  std::vector<bool> mins(count, false);
  for (size_t i = 0; i < count; ++i) {
    rows_of[i] = i;
    for (size_t j = 0; j < i; ++j)
      if (ts[j].kind == ts[i].kind && ts[j].offset == ts[i].offset && ts[j].group == ts[i].group) {
        rows_of[i] = j;
        break;
      }
    mins[rows_of[i]] = mins[rows_of[i]] || ts[i].m1.kind != 0;
  }
  std::vector<VnniRows> v(count);
  for (size_t i = 0; i < count; ++i)
    if (rows_of[i] == i) va_quantize_rows(ts[i], v[i], mins[i], avx2);
  std::vector<VaPlan> plans(count);
  for (size_t i = 0; i < count; ++i) va_plan(ts[i], v[rows_of[i]].width, plans[i]);
  q8_deal(ts, [&](size_t i, int64_t lo, int64_t hi) {
    if (avx2) va2_tasks(ts[i], v[rows_of[i]], plans[i].ch, plans[i].first, lo, hi);
    else va_tasks(ts[i], v[rows_of[i]], plans[i].ch, plans[i].first, lo, hi);
  });
}
#endif
