// ---- the decoder layer's elementwise steps -----------------------------------------------------------
// RMSNorm and the gated MLP's SiLU(gate) * up, one call per layer step instead of the six and three
// torch operators (each a dispatch and a pass over the rows) that a decode step of a few rows spends
// more time calling than computing. Each row is one task whose loop order depends on the row's length
// alone, so a row's bits never depend on its company; the roundings are the model's own (RMSNorm: the
// statistic in fp32, the normalised row rounded to the dtype, then times the weight, rounded again;
// SiLU rounded to the dtype before the product).
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
// The lanes `keep` names of 16 bf16 values widened to fp32 (the others 0); of fp32 bf16 values `v`, stored.
inline __m512 load_bf16(const c10::BFloat16* p, __mmask16 keep) {
  return widen_bf16(_mm256_maskz_loadu_epi16(keep, p));
}
inline void store_bf16(c10::BFloat16* p, __m512 v, __mmask16 keep) {
  _mm256_mask_storeu_epi16(p, keep, narrow_bf16(v));
}
#define ZT_BF16_ROWS 1
// 16 lanes of a row of n (the lanes from j on that the row has).
inline __mmask16 lanes_from(int64_t j, int64_t n) {
  return n - j >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (n - j)) - 1);
}
#endif

template <typename T>
void rms_norm_rows(const T* x, const T* w, T* y, int64_t rows, int64_t n, int64_t ldx, float eps) {
  at::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * ldx;
      T* yr = y + r * n;
      float ss = 0.0f;
      for (int64_t j = 0; j < n; ++j) {
        const float v = static_cast<float>(xr[j]);
        ss += v * v;
      }
      const float inv = 1.0f / __builtin_sqrtf(ss / static_cast<float>(n) + eps);
      for (int64_t j = 0; j < n; ++j) {
        const T normed = static_cast<T>(static_cast<float>(xr[j]) * inv);
        yr[j] = static_cast<T>(static_cast<float>(w[j]) * static_cast<float>(normed));
      }
    }
  });
}


// silu(g) = g / (1 + e^-g), through exp_neg of -|g| on both sides of zero: g >= 0 as g / (1 + t),
// g < 0 as g t / (1 + t), t = e^-|g|. bf16 rows on AVX-512: silu_mul16, the same arithmetic.
template <typename T>
void silu_mul_rows(const T* gu, T* y, int64_t rows, int64_t width, int64_t ld) {
  at::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* g = gu + r * ld;
      const T* u = g + width;
      T* yr = y + r * width;
#if defined(ZT_BF16_ROWS)
      if constexpr (std::is_same_v<T, c10::BFloat16>) {  // silu_mul16: the bf16 tile products' own gate
        for (int64_t j = 0; j < width; j += 16) {
          const __mmask16 keep = lanes_from(j, width);
          store_bf16(yr + j, silu_mul16(load_bf16(g + j, keep), load_bf16(u + j, keep)), keep);
        }
        continue;
      }
#endif
      for (int64_t j = 0; j < width; ++j) {
        const float a = static_cast<float>(g[j]);
        const float t = exp_neg(a < 0.0f ? a : -a);
        const float silu = (a < 0.0f ? a * t : a) / (1.0f + t);
        yr[j] = static_cast<T>(static_cast<float>(static_cast<T>(silu)) * static_cast<float>(u[j]));
      }
    }
  });
}

// Rotary position embedding of a layer's q and k heads and the store of k and v, one pass per row:
// x cos + rotate_half(x) sin with the model's roundings (each product rounded to the dtype, then the
// sum: torch's three operators, without contracting them into a fused multiply-add), the rotated q
// heads to ``q``, the rotated k heads and the v heads to the pools at the row's slot.
#pragma GCC push_options
#pragma GCC optimize("-ffp-contract=off")
template <typename T>
inline void rotate(const T* x, const T* c, const T* s, T* o, int64_t dim) {
  const int64_t half = dim / 2;
#if defined(ZT_BF16_ROWS)
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    if (half % 16 == 0) {  // 16 lanes at a time, the same roundings (bf16's, exact in fp32)
      const __mmask16 all = 0xFFFF;
      for (int64_t j = 0; j < dim; j += 16) {
        const __m512 other = load_bf16(x + (j < half ? j + half : j - half), all);
        const __m512 rot = j < half ? _mm512_sub_ps(_mm512_setzero_ps(), other) : other;
        const __m512 a = round_bf16(_mm512_mul_ps(load_bf16(x + j, all), load_bf16(c + j, all)));
        const __m512 b = round_bf16(_mm512_mul_ps(rot, load_bf16(s + j, all)));
        store_bf16(o + j, round_bf16(_mm512_add_ps(a, b)), all);
      }
      return;
    }
  }
#endif
  for (int64_t j = 0; j < dim; ++j) {
    const float rot = j < half ? -static_cast<float>(x[j + half]) : static_cast<float>(x[j - half]);
    const float a = static_cast<float>(static_cast<T>(static_cast<float>(x[j]) * static_cast<float>(c[j])));
    const float b = static_cast<float>(static_cast<T>(rot * static_cast<float>(s[j])));
    o[j] = static_cast<T>(a + b);
  }
}
#pragma GCC pop_options

// row(r) for every row: in parallel where the rows' slots are distinct, else in row order (rows sharing
// a slot, padding rows: the last one's store kept, as index_copy_ would keep it).
template <typename Row>
void store_rows(int64_t rows, bool parallel, const Row& row) {
  if (!parallel) {
    for (int64_t r = 0; r < rows; ++r) row(r);
    return;
  }
  at::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) row(r);
  });
}

template <typename T>
void rope_store_rows(const T* y, const T* cos, const T* sin, T* kp, T* vp, const int64_t* slots, T* q,
                     int64_t rows, int64_t ld, int64_t heads, int64_t kv_heads, int64_t dim, bool parallel) {
  store_rows(rows, parallel, [&](int64_t r) {
    const T* yr = y + r * ld;
    const T* c = cos + r * dim;
    const T* s = sin + r * dim;
    for (int64_t h = 0; h < heads; ++h) rotate<T>(yr + h * dim, c, s, q + (r * heads + h) * dim, dim);
    T* k = kp + slots[r] * kv_heads * dim;
    for (int64_t h = 0; h < kv_heads; ++h) rotate<T>(yr + (heads + h) * dim, c, s, k + h * dim, dim);
    std::memcpy(vp + slots[r] * kv_heads * dim, yr + (heads + kv_heads) * dim, kv_heads * dim * sizeof(T));
  });
}

// fp32 -> fp8 bits (FMT 1 e4m3fn, 2 e5m2) as c10's Float8_e4m3fn / Float8_e5m2 conversions give them
// (torch's own casts: round to nearest even, subnormals through a float add, overflow saturated or
// NaN as they make it), written without branches so that a loop over a vector's values vectorises.
template <int FMT>
inline uint8_t fp8_bits(float f) {
  constexpr uint32_t top = FMT == 1 ? UINT32_C(1087) << 20 : UINT32_C(143) << 23;  // the first value out
  constexpr uint32_t small = FMT == 1 ? UINT32_C(121) << 23 : UINT32_C(113) << 23;  // the smallest normal
  constexpr uint32_t denorm = FMT == 1 ? UINT32_C(141) << 23 : UINT32_C(134) << 23;
  constexpr int shift = FMT == 1 ? 20 : 21;
  constexpr uint32_t bias = FMT == 1 ? (static_cast<uint32_t>(7 - 127) << 23) + 0x7FFFF
                                     : (static_cast<uint32_t>(15 - 127) << 23) + 0xFFFFF;
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  const uint32_t sign = bits & UINT32_C(0x80000000);
  bits ^= sign;
  float mag, magic;
  std::memcpy(&mag, &bits, 4);
  std::memcpy(&magic, &denorm, 4);
  const float shifted = mag + magic;
  uint32_t sub;
  std::memcpy(&sub, &shifted, 4);
  sub -= denorm;
  uint32_t normal = (bits + bias + ((bits >> shift) & 1)) >> shift;
  if (FMT == 1) normal = normal == 0x7F ? 0x7E : normal;  // a carry into NaN's pattern: the largest
  const uint32_t nan = bits > UINT32_C(0x7F800000);
  const uint32_t over = FMT == 1 ? (nan ? 0x7F : 0x7E) : (nan ? 0x7F : 0x7C);
  const uint32_t r = bits >= top ? over : bits < small ? sub : normal;
  return static_cast<uint8_t>((r & 0xFF) | (sign >> 24));
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
// fp8_bits on 16 values at once: the same integer and float steps, lane by lane.
template <int FMT>
inline __m128i fp8_bits16(__m512 f) {
  constexpr uint32_t top = FMT == 1 ? UINT32_C(1087) << 20 : UINT32_C(143) << 23;
  constexpr uint32_t small = FMT == 1 ? UINT32_C(121) << 23 : UINT32_C(113) << 23;
  constexpr uint32_t denorm = FMT == 1 ? UINT32_C(141) << 23 : UINT32_C(134) << 23;
  constexpr int shift = FMT == 1 ? 20 : 21;
  constexpr uint32_t bias = FMT == 1 ? (static_cast<uint32_t>(7 - 127) << 23) + 0x7FFFF
                                     : (static_cast<uint32_t>(15 - 127) << 23) + 0xFFFFF;
  const __m512i all = _mm512_castps_si512(f);
  const __m512i sign = _mm512_and_si512(all, _mm512_set1_epi32(static_cast<int32_t>(0x80000000u)));
  const __m512i bits = _mm512_xor_si512(all, sign);
  const __m512i magic = _mm512_set1_epi32(static_cast<int32_t>(denorm));
  const __m512i sub = _mm512_sub_epi32(
      _mm512_castps_si512(_mm512_add_ps(_mm512_castsi512_ps(bits), _mm512_castsi512_ps(magic))), magic);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, shift), _mm512_set1_epi32(1));
  __m512i normal = _mm512_srli_epi32(
      _mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(static_cast<int32_t>(bias))), odd), shift);
  if (FMT == 1)
    normal = _mm512_mask_mov_epi32(normal, _mm512_cmpeq_epi32_mask(normal, _mm512_set1_epi32(0x7F)),
                                   _mm512_set1_epi32(0x7E));
  const __mmask16 nan = _mm512_cmpgt_epu32_mask(bits, _mm512_set1_epi32(0x7F800000));
  const __m512i over = _mm512_mask_mov_epi32(_mm512_set1_epi32(FMT == 1 ? 0x7E : 0x7C), nan, _mm512_set1_epi32(0x7F));
  __m512i r = _mm512_mask_mov_epi32(normal, _mm512_cmplt_epu32_mask(bits, _mm512_set1_epi32(static_cast<int32_t>(small))), sub);
  r = _mm512_mask_mov_epi32(r, _mm512_cmpge_epu32_mask(bits, _mm512_set1_epi32(static_cast<int32_t>(top))), over);
  r = _mm512_or_si512(_mm512_and_si512(r, _mm512_set1_epi32(0xFF)), _mm512_srli_epi32(sign, 24));
  return _mm512_cvtepi32_epi8(r);
}
#endif

// One key or value vector quantised as kv_quant.quantize quantises it (fmt 1 fp8 e4m3, 2 fp8 e5m2,
// 3 int8; dim at most 256): its scale the largest magnitude over the format's largest code (1 for an
// all-zero vector), each value over the scale in fp32, then int8 rounded to nearest even and
// clamped to 127, fp8 clamped to the format's largest value and rounded as torch's cast rounds.
template <typename T>
inline void quantize_vec(const T* x, int64_t dim, int fmt, uint8_t* codes, float* scale) {
  const float top = fmt == 1 ? 448.0f : fmt == 2 ? 57344.0f : 127.0f;
  float v[256];
  for (int64_t j = 0; j < dim; ++j) v[j] = static_cast<float>(x[j]);
#if defined(__AVX512F__) && defined(__AVX512BW__)
  if (dim % 16 == 0) {  // the same steps 16 values at a time
    __m512 m = _mm512_setzero_ps();
    for (int64_t j = 0; j < dim; j += 16) m = _mm512_max_ps(m, _mm512_abs_ps(_mm512_loadu_ps(v + j)));
    const float amax = _mm512_reduce_max_ps(m);
    const float s = amax > 0.0f ? amax / top : 1.0f;
    *scale = s;
    const __m512 sv = _mm512_set1_ps(s), hi = _mm512_set1_ps(top), lo = _mm512_set1_ps(-top);
    for (int64_t j = 0; j < dim; j += 16) {
      const __m512 y = _mm512_min_ps(_mm512_max_ps(_mm512_div_ps(_mm512_loadu_ps(v + j), sv), lo), hi);
      __m128i c;
      if (fmt == 3)
        c = _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(_mm512_roundscale_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)));
      else
        c = fmt == 1 ? fp8_bits16<1>(y) : fp8_bits16<2>(y);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(codes + j), c);
    }
    return;
  }
#endif
  float amax = 0.0f;
  for (int64_t j = 0; j < dim; ++j) amax = std::max(amax, std::fabs(v[j]));
  const float s = amax > 0.0f ? amax / top : 1.0f;
  *scale = s;
  for (int64_t j = 0; j < dim; ++j) {
    const float y = std::min(std::max(v[j] / s, -top), top);
    if (fmt == 3)
      codes[j] = static_cast<uint8_t>(static_cast<int8_t>(std::nearbyint(y)));
    else
      codes[j] = fmt == 1 ? fp8_bits<1>(y) : fp8_bits<2>(y);
  }
}

// rope_store_rows over an 8-bit pool: the rotated k heads and the v heads quantised (quantize_vec) to
// the pools' codes (slots, kv_heads, dim) and scales (slots, kv_heads) at the row's slot.
template <typename T>
void rope_store_q8_rows(const T* y, const T* cos, const T* sin, uint8_t* k_codes, float* k_scales, uint8_t* v_codes,
                        float* v_scales, int fmt, const int64_t* slots, T* q, int64_t rows, int64_t ld, int64_t heads,
                        int64_t kv_heads, int64_t dim, bool parallel) {
  store_rows(rows, parallel, [&](int64_t r) {
    const T* yr = y + r * ld;
    const T* c = cos + r * dim;
    const T* s = sin + r * dim;
    for (int64_t h = 0; h < heads; ++h) rotate<T>(yr + h * dim, c, s, q + (r * heads + h) * dim, dim);
    T k[256];
    for (int64_t h = 0; h < kv_heads; ++h) {
      const int64_t vec = slots[r] * kv_heads + h;
      rotate<T>(yr + (heads + h) * dim, c, s, k, dim);
      quantize_vec<T>(k, dim, fmt, k_codes + vec * dim, k_scales + vec);
      quantize_vec<T>(yr + (heads + kv_heads + h) * dim, dim, fmt, v_codes + vec * dim, v_scales + vec);
    }
  });
}
}  // namespace

// The entry points below compute without Python's GIL, as torch's own operators do: a bound C++
// function keeps it by default, and the serving engine spends most of a step in these kernels, while
// the HTTP server's thread, which takes in requests and streams tokens, waits for the GIL.

// The checks every attention call makes: contiguous int64 slot lists, sequences and lengths, each
// row's sequence among the lists and its length within 1 .. width, every slot a row reads inside a pool
// of ``pool_slots`` slots.
void check_attention_rows(const torch::Tensor& q, const torch::Tensor& slots, const torch::Tensor& seq,
                          const torch::Tensor& lens, int64_t pool_slots) {
  TORCH_CHECK(q.is_contiguous() && slots.is_contiguous() && seq.is_contiguous() && lens.is_contiguous(),
              "contiguous queries, slots and lengths");
  TORCH_CHECK(slots.scalar_type() == torch::kLong && seq.scalar_type() == torch::kLong &&
                  lens.scalar_type() == torch::kLong, "int64 slots, sequences and lengths");
  const int64_t rows = q.size(0), sequences = slots.size(0), width = slots.size(1);
  TORCH_CHECK(seq.size(0) == rows && lens.size(0) == rows, "one sequence and one length per row");
  const int64_t* len = lens.data_ptr<int64_t>();
  const int64_t* which = seq.data_ptr<int64_t>();
  const int64_t* slot = slots.data_ptr<int64_t>();
  std::vector<int64_t> longest(sequences, 0);  // the most keys any row reads of each slot list
  for (int64_t r = 0; r < rows; ++r) {
    TORCH_CHECK(which[r] >= 0 && which[r] < sequences, "a row's sequence outside the slot lists");
    TORCH_CHECK(len[r] >= 1 && len[r] <= width, "a row's length outside 1..slot list width");
    longest[which[r]] = std::max(longest[which[r]], len[r]);
  }
  // a slot outside the pool is one at or past it as an unsigned number: one compare a slot, in a loop
  // without a branch (vectorised) instead of a check per slot (the same slot lists each layer of a step)
  uint64_t outside = 0;
  for (int64_t s = 0; s < sequences; ++s) {
    const int64_t* list = slot + s * width;
    for (int64_t j = 0; j < longest[s]; ++j)
      outside |= static_cast<uint64_t>(static_cast<uint64_t>(list[j]) >= static_cast<uint64_t>(pool_slots));
  }
  TORCH_CHECK(outside == 0, "slots outside the pool");
}

// The bf16 matrix-product kernels: 1 on AMX tiles, 2 on AVX512-BF16 (null where not built).
using Products = void (*)(const c10::BFloat16*, const KVSource&, const KVSource&, const int64_t*, const int64_t*,
                          const int64_t*, c10::BFloat16*, int64_t, int64_t, int64_t, int64_t, int64_t, float);
Products products_kernel(int64_t kernel) {
#if defined(ZT_TILE_ATTENTION)
  if (kernel == 1) return attend_tiles;
#endif
#if defined(ZT_DOT_ATTENTION)
  if (kernel == 2) return attend_dot;
#endif
  return nullptr;
}

// q (rows, heads, dim); k_pool, v_pool (slots, kv_heads, dim); slots (sequences, width) int64, each
// sequence's key slots in position order; seq (rows,) int64, each row's sequence; lens (rows,) int64,
// how many of its sequence's keys a row attends -> (rows, heads, dim)
torch::Tensor paged_attention(torch::Tensor q, torch::Tensor k_pool, torch::Tensor v_pool, torch::Tensor slots,
                              torch::Tensor seq, torch::Tensor lens, double scale, int64_t kernel) {
  TORCH_CHECK(k_pool.is_contiguous() && v_pool.is_contiguous(), "contiguous pools");
  TORCH_CHECK(q.scalar_type() == k_pool.scalar_type() && q.scalar_type() == v_pool.scalar_type(), "one dtype");
  const int64_t rows = q.size(0), heads = q.size(1), dim = q.size(2), kv_heads = k_pool.size(1);
  TORCH_CHECK(heads % kv_heads == 0 && k_pool.size(2) == dim && v_pool.sizes() == k_pool.sizes(), "shapes");
  check_attention_rows(q, slots, seq, lens, k_pool.size(0));
  const int64_t *len = lens.data_ptr<int64_t>(), *which = seq.data_ptr<int64_t>(), *slot = slots.data_ptr<int64_t>();
  const int64_t width = slots.size(1);
  auto out = torch::empty_like(q);
  const float s = static_cast<float>(scale);
  pybind11::gil_scoped_release no_gil;
  const bool products = q.scalar_type() == torch::kBFloat16 && (dim == 64 || dim == 128);
  TORCH_CHECK(kernel == 0 || products, "the tile and AVX512-BF16 attention take bf16 heads of 64 or 128");
  if (Products run = products_kernel(kernel)) {
    KVSource k, v;
    k.bf16 = reinterpret_cast<const uint16_t*>(k_pool.data_ptr<c10::BFloat16>());
    v.bf16 = reinterpret_cast<const uint16_t*>(v_pool.data_ptr<c10::BFloat16>());
    run(q.data_ptr<c10::BFloat16>(), k, v, slot, which, len, out.data_ptr<c10::BFloat16>(), rows, heads, kv_heads, dim,
        width, s);
    return out;
  }
  TORCH_CHECK(kernel == 0, "this build has no such attention kernel");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_attention", [&] {
    attend<scalar_t>(q.data_ptr<scalar_t>(), k_pool.data_ptr<scalar_t>(), v_pool.data_ptr<scalar_t>(), slot, which,
                     len, out.data_ptr<scalar_t>(), rows, heads, kv_heads, dim, width, s);
  });
  return out;
}

// The same over an 8-bit pool, read in place: k_codes, v_codes (slots, kv_heads, dim) uint8 or int8;
// k_scales, v_scales (slots, kv_heads) float32; fmt 1 fp8 e4m3, 2 fp8 e5m2, 3 int8. Each key and value
// is the one kv_quant.dequantize gives it in q's dtype. kernel 0: the fp32 kernels (q of any floating
// dtype; AVX-512, AVX2 or the generic loop, as for a dense pool); 1 tiles, 2 AVX512-BF16 (bf16 rows
// with heads of 64 or 128).
torch::Tensor paged_attention_q8(torch::Tensor q, torch::Tensor k_codes, torch::Tensor k_scales, torch::Tensor v_codes,
                                 torch::Tensor v_scales, int64_t fmt, torch::Tensor slots, torch::Tensor seq,
                                 torch::Tensor lens, double scale, int64_t kernel) {
  TORCH_CHECK(k_codes.is_contiguous() && v_codes.is_contiguous() && k_scales.is_contiguous() && v_scales.is_contiguous(),
              "contiguous codes and scales");
  TORCH_CHECK(fmt >= 1 && fmt <= 3, "fmt: 1 (fp8 e4m3), 2 (fp8 e5m2) or 3 (int8)");
  TORCH_CHECK(k_codes.element_size() == 1 && v_codes.element_size() == 1 && k_codes.dim() == 3, "8-bit codes");
  TORCH_CHECK(k_scales.scalar_type() == torch::kFloat && v_scales.scalar_type() == torch::kFloat, "float32 scales");
  const int64_t rows = q.size(0), heads = q.size(1), dim = q.size(2), kv_heads = k_codes.size(1);
  TORCH_CHECK(heads % kv_heads == 0 && k_codes.size(2) == dim && v_codes.sizes() == k_codes.sizes() &&
                  k_scales.dim() == 2 && k_scales.size(0) == k_codes.size(0) && k_scales.size(1) == kv_heads &&
                  v_scales.sizes() == k_scales.sizes(), "shapes");
  check_attention_rows(q, slots, seq, lens, k_codes.size(0));
  auto out = torch::empty_like(q);
  KVSource k, v;
  k.codes = static_cast<const uint8_t*>(k_codes.data_ptr());
  v.codes = static_cast<const uint8_t*>(v_codes.data_ptr());
  k.scales = k_scales.data_ptr<float>();
  v.scales = v_scales.data_ptr<float>();
  k.fmt = v.fmt = static_cast<int>(fmt);
  const int64_t *len = lens.data_ptr<int64_t>(), *which = seq.data_ptr<int64_t>(), *slot = slots.data_ptr<int64_t>();
  const int64_t width = slots.size(1);
  const float s = static_cast<float>(scale);
  if (kernel == 0) {
    pybind11::gil_scoped_release no_gil;
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_attention_q8", [&] {
      attend<scalar_t>(q.data_ptr<scalar_t>(), k, v, slot, which, len, out.data_ptr<scalar_t>(), rows, heads, kv_heads,
                       dim, width, s);
    });
    return out;
  }
  TORCH_CHECK(q.scalar_type() == torch::kBFloat16 && (dim == 64 || dim == 128), "bf16 rows with heads of 64 or 128");
  Products run = products_kernel(kernel);
  TORCH_CHECK(run != nullptr, "this build has no such attention kernel for an 8-bit pool (1: tiles, 2: AVX512-BF16)");
  pybind11::gil_scoped_release no_gil;
  run(q.data_ptr<c10::BFloat16>(), k, v, slot, which, len, out.data_ptr<c10::BFloat16>(), rows, heads, kv_heads, dim,
      width, s);
  return out;
}
