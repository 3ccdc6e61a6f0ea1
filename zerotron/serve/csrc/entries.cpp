// x (rows, n) with unit column stride, weight (n,) of x's dtype -> (rows, n): RMSNorm of each row
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
// The checks rope_store and rope_store_q8 make of the rows: y (rows, (heads + 2 kv_heads) dim) with
// unit column stride, cos and sin (rows, dim) contiguous in y's dtype, dim even.
void check_rope_rows(const torch::Tensor& y, const torch::Tensor& cos, const torch::Tensor& sin, int64_t heads,
                     int64_t kv_heads, int64_t dim) {
  TORCH_CHECK(y.dim() == 2 && y.stride(1) == 1, "rows of q, k and v columns with unit column stride");
  TORCH_CHECK(dim % 2 == 0 && y.size(1) == (heads + 2 * kv_heads) * dim, "q, k and v columns of the pools' heads");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.size(0) == y.size(0) && cos.size(1) == dim &&
                  sin.sizes() == cos.sizes() && cos.scalar_type() == y.scalar_type() &&
                  sin.scalar_type() == y.scalar_type(),
              "a cos and sin row per row in the rows' dtype");
}

// slots (rows,) int64, each inside a pool of pool_slots slots -> whether they are distinct (the rows
// then stored in parallel; rows sharing a slot, padding rows, in row order)
bool distinct_slots(const torch::Tensor& slots, int64_t rows, int64_t pool_slots) {
  TORCH_CHECK(slots.is_contiguous() && slots.scalar_type() == torch::kLong && slots.size(0) == rows, "a slot per row");
  const int64_t* slot = slots.data_ptr<int64_t>();
  std::vector<int64_t> seen(slot, slot + rows);
  for (int64_t v : seen) TORCH_CHECK(v >= 0 && v < pool_slots, "slots outside the pool");
  std::sort(seen.begin(), seen.end());
  return std::adjacent_find(seen.begin(), seen.end()) == seen.end();
}

// y (rows, (heads + 2 kv_heads) dim) with unit column stride, a layer's q, k and v products; cos, sin
// (rows, dim) contiguous in y's dtype; k_pool, v_pool (slots, kv_heads, dim); slots (rows,) int64 ->
// q (rows, heads, dim) rotated; k rotated and v written to the pools at the rows' slots
torch::Tensor rope_store(torch::Tensor y, torch::Tensor cos, torch::Tensor sin, torch::Tensor k_pool,
                         torch::Tensor v_pool, torch::Tensor slots, int64_t heads) {
  TORCH_CHECK(k_pool.is_contiguous() && v_pool.is_contiguous() && k_pool.sizes() == v_pool.sizes(), "pools");
  TORCH_CHECK(y.scalar_type() == k_pool.scalar_type() && v_pool.scalar_type() == y.scalar_type(), "one dtype");
  const int64_t rows = y.size(0), kv_heads = k_pool.size(1), dim = k_pool.size(2);
  check_rope_rows(y, cos, sin, heads, kv_heads, dim);
  const bool distinct = distinct_slots(slots, rows, k_pool.size(0));
  auto q = torch::empty({rows, heads, dim}, y.options());
  pybind11::gil_scoped_release no_gil;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, y.scalar_type(), "rope_store", [&] {
    rope_store_rows<scalar_t>(y.data_ptr<scalar_t>(), cos.data_ptr<scalar_t>(), sin.data_ptr<scalar_t>(),
                              k_pool.data_ptr<scalar_t>(), v_pool.data_ptr<scalar_t>(), slots.data_ptr<int64_t>(),
                              q.data_ptr<scalar_t>(), rows, y.stride(0), heads, kv_heads, dim, distinct);
  });
  return q;
}

// rope_store over an 8-bit pool (kv_quant.py): k_codes, v_codes (slots, kv_heads, dim) 8-bit;
// k_scales, v_scales (slots, kv_heads) float32; fmt 1 fp8 e4m3, 2 fp8 e5m2, 3 int8. The rotated k
// heads and the v heads are stored as kv_quant.QuantizedKV.store stores them (the same codes and
// scales) -> q (rows, heads, dim) rotated
torch::Tensor rope_store_q8(torch::Tensor y, torch::Tensor cos, torch::Tensor sin, torch::Tensor k_codes,
                            torch::Tensor k_scales, torch::Tensor v_codes, torch::Tensor v_scales, int64_t fmt,
                            torch::Tensor slots, int64_t heads) {
  TORCH_CHECK(fmt >= 1 && fmt <= 3, "fmt: 1 (fp8 e4m3), 2 (fp8 e5m2) or 3 (int8)");
  TORCH_CHECK(k_codes.is_contiguous() && v_codes.is_contiguous() && k_scales.is_contiguous() &&
                  v_scales.is_contiguous() && k_codes.dim() == 3 && k_codes.element_size() == 1 &&
                  v_codes.sizes() == k_codes.sizes() && v_codes.element_size() == 1,
              "contiguous 8-bit codes");
  const int64_t rows = y.size(0), kv_heads = k_codes.size(1), dim = k_codes.size(2);
  TORCH_CHECK(k_scales.scalar_type() == torch::kFloat && v_scales.scalar_type() == torch::kFloat &&
                  k_scales.dim() == 2 && k_scales.size(0) == k_codes.size(0) && k_scales.size(1) == kv_heads &&
                  v_scales.sizes() == k_scales.sizes(),
              "float32 scales, one per slot and KV head");
  TORCH_CHECK(dim <= 256, "heads at most 256 wide");
  check_rope_rows(y, cos, sin, heads, kv_heads, dim);
  const bool distinct = distinct_slots(slots, rows, k_codes.size(0));
  auto* kc = static_cast<uint8_t*>(k_codes.data_ptr());
  auto* vc = static_cast<uint8_t*>(v_codes.data_ptr());
  float* ks = k_scales.data_ptr<float>();
  float* vs = v_scales.data_ptr<float>();
  auto q = torch::empty({rows, heads, dim}, y.options());
  pybind11::gil_scoped_release no_gil;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, y.scalar_type(), "rope_store_q8", [&] {
    rope_store_q8_rows<scalar_t>(y.data_ptr<scalar_t>(), cos.data_ptr<scalar_t>(), sin.data_ptr<scalar_t>(), kc, ks, vc,
                                 vs, static_cast<int>(fmt), slots.data_ptr<int64_t>(), q.data_ptr<scalar_t>(), rows,
                                 y.stride(0), heads, kv_heads, dim, distinct);
  });
  return q;
}

// cpus: one list of CPU ids per OpenMP thread of this thread's team -> for each thread, whether it now
// runs on its list only. Thread t of the team (at::get_thread_num(), the calling thread being 0) binds
// itself, inside one parallel region of as many items as threads, as vLLM's CPU worker does; the team's
// threads are the ones later parallel regions of this thread reuse. Linux only (elsewhere: none bound).
std::vector<int64_t> bind_threads(std::vector<std::vector<int64_t>> cpus) {
  const int64_t n = static_cast<int64_t>(cpus.size());
  std::vector<int64_t> bound(n, 0);
  TORCH_CHECK(n == at::get_num_threads(), "a CPU list per OpenMP thread");
#ifdef __linux__
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    const int t = at::get_thread_num();
    if (t < 0 || t >= n || end - begin != 1) return;
    cpu_set_t set;
    CPU_ZERO(&set);
    for (int64_t c : cpus[t]) CPU_SET(static_cast<int>(c), &set);
    bound[t] = sched_setaffinity(0, sizeof(set), &set) == 0 ? 1 : 0;
  });
#endif
  return bound;
}

// A layer's fused q/k/v product y rotated, its k and v stored at the rows' slots and every row attended
// (rope_store, paged_attention; over an 8-bit pool, fmt 1-3 with k_pool, v_pool its codes,
// rope_store_q8, paged_attention_q8): the one-call layers' attention -> (rows, heads, dim).
torch::Tensor layer_attention(const torch::Tensor& y, const torch::Tensor& cos, const torch::Tensor& sin,
                              const torch::Tensor& k_pool, const torch::Tensor& v_pool, const torch::Tensor& k_scales,
                              const torch::Tensor& v_scales, int64_t fmt, const torch::Tensor& slots,
                              const torch::Tensor& key_slots, const torch::Tensor& lens, const torch::Tensor& seq,
                              int64_t heads, double scale, int64_t kernel) {
  if (fmt == 0) {
    auto q = rope_store(y, cos, sin, k_pool, v_pool, slots, heads);
    return paged_attention(q, k_pool, v_pool, key_slots, seq, lens, scale, kernel);
  }
  auto q = rope_store_q8(y, cos, sin, k_pool, k_scales, v_pool, v_scales, fmt, slots, heads);
  return paged_attention_q8(q, k_pool, k_scales, v_pool, v_scales, fmt, key_slots, seq, lens, scale, kernel);
}

// A decoder layer's step of fp32 or bf16 rows whose four products are prepared quantised linears
// (q8_prepare: q/k/v side by side, o, gate/up side by side, down; each with its bias, or an empty tensor
// for none), its attention on native kernel `kernel` (paged_attention's index) over a dense pool (fmt
// 0, the scales empty) or an 8-bit one (fmt 1-3: k_pool, v_pool its codes, k_scales, v_scales its
// scales; rope_store_q8, paged_attention_q8) (linears._LeanLayer's packed path, the same calls in the
// same order, so its bits): x (1, rows,
// hidden) -> x + o(attention(rope(q/k/v(norm1 x)))) = h, then h + down(silu(gate) * up) of norm2 h,
// SiLU and the product as torch computes F.silu(gate) * up. The rotated k and v of the rows are stored
// at their slots. One call instead of a dozen from Python.
torch::Tensor q8_layer(torch::Tensor x, torch::Tensor norm1, double eps1, torch::Tensor norm2, double eps2,
                       std::vector<int64_t> products, std::vector<torch::Tensor> biases, int64_t gate,
                       torch::Tensor cos, torch::Tensor sin,
                       torch::Tensor k_pool, torch::Tensor v_pool, torch::Tensor k_scales, torch::Tensor v_scales,
                       int64_t fmt, torch::Tensor slots, torch::Tensor key_slots, torch::Tensor lens,
                       torch::Tensor seq, int64_t heads, double scale, int64_t kernel) {
  TORCH_CHECK(x.dim() == 3 && x.size(0) == 1 &&
                  (x.scalar_type() == torch::kFloat || x.scalar_type() == torch::kBFloat16),
              "x: fp32 or bf16 (1, rows, hidden)");
  TORCH_CHECK(products.size() == 4 && biases.size() == 4, "the q/k/v, o, gate/up and down products, biases");
  // a product and its bias as the module adds it (int8_linears._prepared_forward: the fp32 product
  // cast to the rows' dtype, then + bias)
  auto product = [&](const torch::Tensor& rows, size_t i) {
    auto y = q8_run(rows, products[i]);
    if (y.scalar_type() != rows.scalar_type()) y = y.to(rows.scalar_type());
    return biases[i].numel() ? y + biases[i] : y;
  };
  auto h = x.reshape({x.size(1), x.size(2)});
  if (h.stride(1) != 1) h = h.contiguous();
  auto y = product(rms_norm(h, norm1, eps1), 0);
  const torch::Tensor rows = layer_attention(y, cos, sin, k_pool, v_pool, k_scales, v_scales, fmt, slots, key_slots,
                                             lens, seq, heads, scale, kernel);
  h = h + product(rows.view({rows.size(0), -1}), 1);
  auto gu = product(rms_norm(h, norm2, eps2), 2);
  TORCH_CHECK(gu.size(1) == 2 * gate, "gate and up of gate columns each");
  h = h + product(at::silu(gu.narrow(1, 0, gate)) * gu.narrow(1, gate, gate), 3);
  return h.view(x.sizes());
}

// A decoder layer's step whose four products run on a native linear kernel (linears: 0 bf16 on AMX tiles,
// tile_linear's packed weights; 1 bf16 on AVX512-BF16, dot_linear's; 2 fp32 on AVX-512 or AVX2, vec_linear's:
// q/k/v side by side, o, gate/up side by side, down; each bias fp32, or an empty tensor for none; widths
// the products' columns), its attention q8_layer's (a dense or an 8-bit pool): the calls
// linears._LeanLayer makes on its native path, in the same order on the same values, so its bits:
// RMSNorm, q/k/v, rope_store, paged_attention, o and the residual, RMSNorm, gate/up and SiLU(gate) * up
// (silu_mul; on tiles in the product's pass, tile_gated), down and the residual (added as torch adds
// two tensors; on tiles in the product's pass). One call instead of eight native calls from Python
// (nine and two torch adds on the other kernels) and their glue. 16 decodes of SmolLM2 on the AMX Xeon
// (the two ways alternating in one process): on tiles 24.2-25.0 against 25.3-27.9 ms a step at 64
// tokens, 72.3-74.4 against 74.5-76.3 at 2,000; on AVX512-BF16 41.7 against 44.7 at 64; in fp32 46.5
// against 49.5 at 64.
torch::Tensor native_layer(torch::Tensor x, torch::Tensor norm1, double eps1, torch::Tensor norm2, double eps2,
                           int64_t linears, std::vector<torch::Tensor> packed, std::vector<torch::Tensor> biases,
                           std::vector<int64_t> widths, int64_t gate, torch::Tensor cos, torch::Tensor sin,
                           torch::Tensor k_pool, torch::Tensor v_pool, torch::Tensor k_scales, torch::Tensor v_scales,
                           int64_t fmt, torch::Tensor slots, torch::Tensor key_slots, torch::Tensor lens,
                           torch::Tensor seq, int64_t heads, double scale, int64_t kernel) {
  TORCH_CHECK(linears >= 0 && linears <= 2, "linears: 0 (AMX tiles), 1 (AVX512-BF16) or 2 (fp32 on AVX-512 or AVX2)");
  TORCH_CHECK(x.dim() == 3 && x.size(0) == 1 &&
                  x.scalar_type() == (linears == 2 ? torch::kFloat : torch::kBFloat16),
              "x: (1, rows, hidden), bf16 on the tile and AVX512-BF16 linears, fp32 on the AVX-512 one");
  TORCH_CHECK(packed.size() == 4 && biases.size() == 4 && widths.size() == 4,
              "the q/k/v, o, gate/up and down products' packed weights, biases and widths");
  TORCH_CHECK(widths[2] == 2 * gate, "gate and up of gate columns each");
  const auto bias = [&](size_t i) {
    return biases[i].numel() ? std::optional<torch::Tensor>(biases[i]) : std::optional<torch::Tensor>();
  };
  // product i of rows, the residual (when given) added as the Python path adds it
  const auto product = [&](const torch::Tensor& rows, size_t i, const torch::Tensor* residual) {
    if (linears == 0)
      return tile_linear(rows, packed[i], bias(i), widths[i],
                         residual ? std::optional<torch::Tensor>(residual->contiguous()) : std::nullopt);
    auto y = linears == 1 ? dot_linear(rows, packed[i], bias(i), widths[i])
                          : vec_linear(rows, packed[i], bias(i), widths[i]);
    return residual ? *residual + y : y;
  };
  auto h = x.reshape({x.size(1), x.size(2)});
  if (h.stride(1) != 1) h = h.contiguous();
  auto y = product(rms_norm(h, norm1, eps1), 0, nullptr);
  const torch::Tensor rows = layer_attention(y, cos, sin, k_pool, v_pool, k_scales, v_scales, fmt, slots, key_slots,
                                             lens, seq, heads, scale, kernel);
  h = product(rows.view({rows.size(0), -1}), 1, &h);
  auto normed = rms_norm(h, norm2, eps2);
  auto g = linears == 0 ? tile_gated(normed, packed[2], bias(2), gate) : silu_mul(product(normed, 2, nullptr), gate);
  h = product(g, 3, &h);
  return h.view(x.sizes());
}
