"""The C++ source of :mod:`zerotron.serve.kernels` (compiled there on first use; what each kernel
computes and why is documented there and beside each function below): the paged-attention decode and
the decoder layer's elementwise steps here, the linear layers in :mod:`zerotron.serve.kernel_linear_source`."""

from zerotron.serve import kernel_linear_source as _linear

SOURCE = (
    r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <cstdint>
#include <cstring>
#include <optional>
#include <type_traits>
#if defined(__x86_64__)
#include <immintrin.h>
#endif
#include <vector>

namespace {

// exp on [-87, 0] (Cephes' expf: range reduction by ln 2, degree-6 polynomial; ~1 ulp), plain
// arithmetic so that the compiler vectorizes the loops that call it.
inline float exp_neg(float x) {
  x = x < -87.0f ? -87.0f : x;
  float fx = __builtin_floorf(x * 1.44269504088896341f + 0.5f);
  x = x - fx * 0.693359375f + fx * 2.12194440e-4f;
  float z = x * x;
  float y = ((((1.9875691500e-4f * x + 1.3981999507e-3f) * x + 8.3334519073e-3f) * x
              + 4.1665795894e-2f) * x + 1.6666665459e-1f) * x + 5.0000001201e-1f;
  y = y * z + x + 1.0f;
  int32_t bits = (static_cast<int32_t>(fx) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return y * scale;
}

// Each of ``group`` rows of ``n`` scores replaced by exp(score - max); ``total`` gets the row sums.
inline void softmax(float* score, float* total, int64_t group, int64_t n) {
  for (int64_t g = 0; g < group; ++g) {
    float* s = score + g * n;
    float top = s[0];
    for (int64_t j = 1; j < n; ++j) top = s[j] > top ? s[j] : top;
    float sum = 0.0f;
    for (int64_t j = 0; j < n; ++j) {
      s[j] = exp_neg(s[j] - top);
      sum += s[j];
    }
    total[g] = sum;
  }
}

// The generic kernel: any dtype and head size. Per task (a row and a KV head): the scores of the
// row's query heads that share the KV head against its keys in position order, softmax (fp32),
// the weighted sum of its values.
template <typename T>
void decode_generic(const T* q, const T* kp, const T* vp, const int64_t* slots, const int64_t* lens,
                    T* out, int64_t rows, int64_t heads, int64_t kv_heads, int64_t dim, int64_t width,
                    float scale) {
  const int64_t group = heads / kv_heads;
  at::parallel_for(0, rows * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(group * dim), acc(group * dim), kf(dim), vf(dim), score, total(group);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t r = task / kv_heads, kh = task % kv_heads, n = lens[r];
      const int64_t* slot = slots + r * width;
      score.assign(group * n, 0.0f);
      for (int64_t g = 0; g < group; ++g) {
        const T* qrow = q + (r * heads + kh * group + g) * dim;
        for (int64_t d = 0; d < dim; ++d) qf[g * dim + d] = static_cast<float>(qrow[d]) * scale;
      }
      for (int64_t j = 0; j < n; ++j) {
        const T* k = kp + (slot[j] * kv_heads + kh) * dim;
        for (int64_t d = 0; d < dim; ++d) kf[d] = static_cast<float>(k[d]);
        for (int64_t g = 0; g < group; ++g) {
          float dot = 0.0f;
          for (int64_t d = 0; d < dim; ++d) dot += qf[g * dim + d] * kf[d];
          score[g * n + j] = dot;
        }
      }
      softmax(score.data(), total.data(), group, n);
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t j = 0; j < n; ++j) {
        const T* v = vp + (slot[j] * kv_heads + kh) * dim;
        for (int64_t d = 0; d < dim; ++d) vf[d] = static_cast<float>(v[d]);
        for (int64_t g = 0; g < group; ++g) {
          const float p = score[g * n + j];
          for (int64_t d = 0; d < dim; ++d) acc[g * dim + d] += p * vf[d];
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        T* o = out + (r * heads + kh * group + g) * dim;
        const float inv = 1.0f / total[g];
        for (int64_t d = 0; d < dim; ++d) o[d] = static_cast<T>(acc[g * dim + d] * inv);
      }
    }
  });
}

#if defined(__AVX512F__)
// The same computation on AVX-512 registers, for float and bfloat16 pools, heads of V * 16 and
// groups of G query heads per KV head known when compiling: a key's 16-lane products summed
// lane-wise, then across lanes; the values accumulated in 16-lane registers.
template <typename T>
inline __m512 load16(const T* p);
template <>
inline __m512 load16<float>(const float* p) { return _mm512_loadu_ps(p); }
template <>
inline __m512 load16<c10::BFloat16>(const c10::BFloat16* p) {
  __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

template <typename T>
inline void prefetch_slot(const T* p, int64_t elements) {
  const char* c = reinterpret_cast<const char*>(p);
  for (int64_t off = 0; off < elements * static_cast<int64_t>(sizeof(T)); off += 64) _mm_prefetch(c + off, _MM_HINT_T0);
}

// Calls visit(j, kh, x) for each of a row's first n slots and each KV head, x the slot's V vectors of
// that head: slot by slot, all KV heads of a slot at once (one contiguous run of the pool), the slot
// four ahead requested meanwhile.
template <typename T, int V, typename Visit>
inline void for_each_slot(const T* pool, const int64_t* slot, int64_t n, int64_t kv_heads, Visit visit) {
  constexpr int64_t dim = V * 16, PREFETCH = 4;
  const int64_t stride = kv_heads * dim;
  for (int64_t j = 0; j < n; ++j) {
    if (j + PREFETCH < n) prefetch_slot(pool + slot[j + PREFETCH] * stride, stride);
    const T* base = pool + slot[j] * stride;
    for (int64_t kh = 0; kh < kv_heads; ++kh) {
      __m512 x[V];
      for (int v = 0; v < V; ++v) x[v] = load16<T>(base + kh * dim + 16 * v);
      visit(j, kh, x);
    }
  }
}

// One task per row: its keys, then its values, through for_each_slot.
template <typename T, int V, int G>
void decode_avx512(const T* q, const T* kp, const T* vp, const int64_t* slots, const int64_t* lens,
                   T* out, int64_t rows, int64_t heads, int64_t kv_heads, int64_t width, float scale) {
  constexpr int64_t dim = V * 16;
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> score, total(heads);
    std::vector<__m512> qv(heads * V), acc(heads * V);
    alignas(64) float buffer[dim];
    for (int64_t r = begin; r < end; ++r) {
      const int64_t n = lens[r];
      const int64_t* slot = slots + r * width;
      score.resize(heads * n);
      for (int64_t h = 0; h < heads; ++h)
        for (int v = 0; v < V; ++v)
          qv[h * V + v] = _mm512_mul_ps(load16<T>(q + (r * heads + h) * dim + 16 * v), _mm512_set1_ps(scale));
      for_each_slot<T, V>(kp, slot, n, kv_heads, [&](int64_t j, int64_t kh, const __m512* k) {
        for (int g = 0; g < G; ++g) {
          const __m512* qh = qv.data() + (kh * G + g) * V;
          __m512 dot = _mm512_mul_ps(qh[0], k[0]);
          for (int v = 1; v < V; ++v) dot = _mm512_fmadd_ps(qh[v], k[v], dot);
          score[(kh * G + g) * n + j] = _mm512_reduce_add_ps(dot);
        }
      });
      softmax(score.data(), total.data(), heads, n);
      for (auto& a : acc) a = _mm512_setzero_ps();
      for_each_slot<T, V>(vp, slot, n, kv_heads, [&](int64_t j, int64_t kh, const __m512* val) {
        for (int g = 0; g < G; ++g) {
          const int64_t h = kh * G + g;
          const __m512 p = _mm512_set1_ps(score[h * n + j]);
          __m512* a = acc.data() + h * V;
          for (int v = 0; v < V; ++v) a[v] = _mm512_fmadd_ps(p, val[v], a[v]);
        }
      });
      for (int64_t h = 0; h < heads; ++h) {
        T* o = out + (r * heads + h) * dim;
        const __m512 inv = _mm512_set1_ps(1.0f / total[h]);
        for (int v = 0; v < V; ++v) _mm512_store_ps(buffer + 16 * v, _mm512_mul_ps(acc[h * V + v], inv));
        for (int64_t d = 0; d < dim; ++d) o[d] = static_cast<T>(buffer[d]);
      }
    }
  });
}

template <typename T, int V>
bool decode_fixed_group(const T* q, const T* kp, const T* vp, const int64_t* slots, const int64_t* lens,
                        T* out, int64_t rows, int64_t heads, int64_t kv_heads, int64_t width, float scale) {
  switch (heads / kv_heads) {
#define ZT_GROUP(G) \
    case G: decode_avx512<T, V, G>(q, kp, vp, slots, lens, out, rows, heads, kv_heads, width, scale); return true;
    ZT_GROUP(1) ZT_GROUP(2) ZT_GROUP(3) ZT_GROUP(4) ZT_GROUP(5) ZT_GROUP(6) ZT_GROUP(7) ZT_GROUP(8)
#undef ZT_GROUP
    default: return false;
  }
}
#endif

template <typename T>
void decode(const T* q, const T* kp, const T* vp, const int64_t* slots, const int64_t* lens, T* out,
            int64_t rows, int64_t heads, int64_t kv_heads, int64_t dim, int64_t width, float scale) {
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<T, float> || std::is_same_v<T, c10::BFloat16>) {
    if (dim == 64 && decode_fixed_group<T, 4>(q, kp, vp, slots, lens, out, rows, heads, kv_heads, width, scale)) return;
    if (dim == 128 && decode_fixed_group<T, 8>(q, kp, vp, slots, lens, out, rows, heads, kv_heads, width, scale)) return;
  }
#endif
  decode_generic<T>(q, kp, vp, slots, lens, out, rows, heads, kv_heads, dim, width, scale);
}

"""
    + _linear.KERNELS
    + r"""// ---- the decoder layer's elementwise steps -----------------------------------------------------------
// RMSNorm and the gated MLP's SiLU(gate) * up, one call per layer step instead of the six and three
// torch operators (each a dispatch and a pass over the rows) that a decode step of a few rows spends
// more time calling than computing. Each row is one task whose loop order depends on the row's length
// alone, so a row's bits never depend on its company; the roundings are the model's own (RMSNorm: the
// statistic in fp32, the normalised row rounded to the dtype, then times the weight, rounded again;
// SiLU rounded to the dtype before the product).
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
// g < 0 as g t / (1 + t), t = e^-|g|.
template <typename T>
void silu_mul_rows(const T* gu, T* y, int64_t rows, int64_t width, int64_t ld) {
  at::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* g = gu + r * ld;
      const T* u = g + width;
      T* yr = y + r * width;
      for (int64_t j = 0; j < width; ++j) {
        const float a = static_cast<float>(g[j]);
        const float t = exp_neg(a < 0.0f ? a : -a);
        const float silu = (a < 0.0f ? a * t : a) / (1.0f + t);
        yr[j] = static_cast<T>(static_cast<float>(static_cast<T>(silu)) * static_cast<float>(u[j]));
      }
    }
  });
}
}  // namespace

// The entry points below compute without Python's GIL, as torch's own operators do: a bound C++
// function keeps it by default, and the serving engine spends most of a step in these kernels, while
// the HTTP server's thread, which takes in requests and streams tokens, waits for the GIL.

// q (rows, heads, dim); k_pool, v_pool (slots, kv_heads, dim); slots (rows, width) int64, each row's
// key slots in position order; lens (rows,) int64, how many of them it attends -> (rows, heads, dim)
torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k_pool, torch::Tensor v_pool,
                           torch::Tensor slots, torch::Tensor lens, double scale) {
  TORCH_CHECK(q.is_contiguous() && k_pool.is_contiguous() && v_pool.is_contiguous(), "contiguous inputs");
  TORCH_CHECK(slots.is_contiguous() && lens.is_contiguous(), "contiguous slots and lengths");
  TORCH_CHECK(q.scalar_type() == k_pool.scalar_type() && q.scalar_type() == v_pool.scalar_type(), "one dtype");
  TORCH_CHECK(slots.scalar_type() == torch::kLong && lens.scalar_type() == torch::kLong, "int64 slots");
  const int64_t rows = q.size(0), heads = q.size(1), dim = q.size(2), kv_heads = k_pool.size(1);
  TORCH_CHECK(heads % kv_heads == 0 && k_pool.size(2) == dim && slots.size(0) == rows, "shapes");
  TORCH_CHECK(lens.size(0) == rows, "one length per row");
  const int64_t* len = lens.data_ptr<int64_t>();
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r) {
    TORCH_CHECK(len[r] >= 1 && len[r] <= slots.size(1), "a row's length outside 1..slot list width");
    for (int64_t j = 0; j < len[r]; ++j)
      TORCH_CHECK(slot[r * slots.size(1) + j] >= 0 && slot[r * slots.size(1) + j] < k_pool.size(0),
                  "slots outside the pool");
  }
  auto out = torch::empty_like(q);
  const float s = static_cast<float>(scale);
  pybind11::gil_scoped_release no_gil;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode", [&] {
    decode<scalar_t>(q.data_ptr<scalar_t>(), k_pool.data_ptr<scalar_t>(), v_pool.data_ptr<scalar_t>(),
                     slots.data_ptr<int64_t>(), lens.data_ptr<int64_t>(), out.data_ptr<scalar_t>(),
                     rows, heads, kv_heads, dim, slots.size(1), s);
  });
  return out;
}

"""
    + _linear.ENTRIES
    + r"""// x (rows, n) with unit column stride, weight (n,) of x's dtype -> (rows, n): RMSNorm of each row
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "rows with unit column stride");
  TORCH_CHECK(weight.dim() == 1 && weight.is_contiguous() && weight.size(0) == x.size(1), "a weight per column");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type(), "the weight in the rows' dtype");
  auto y = torch::empty({x.size(0), x.size(1)}, x.options());
  pybind11::gil_scoped_release no_gil;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    rms_norm_rows<scalar_t>(x.data_ptr<scalar_t>(), weight.data_ptr<scalar_t>(), y.data_ptr<scalar_t>(), x.size(0),
                            x.size(1), x.stride(0), static_cast<float>(eps));
  });
  return y;
}

// gu (rows, 2 width) with unit column stride, the gate's columns then the up's -> (rows, width):
// silu(gate) * up
torch::Tensor silu_mul(torch::Tensor gu, int64_t width) {
  TORCH_CHECK(gu.dim() == 2 && gu.stride(1) == 1 && gu.size(1) == 2 * width, "rows of gate and up columns");
  auto y = torch::empty({gu.size(0), width}, gu.options());
  pybind11::gil_scoped_release no_gil;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, gu.scalar_type(), "silu_mul", [&] {
    silu_mul_rows<scalar_t>(gu.data_ptr<scalar_t>(), y.data_ptr<scalar_t>(), gu.size(0), width, gu.stride(0));
  });
  return y;
}
"""
)
