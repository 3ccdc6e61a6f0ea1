bool tiles_built() {
#if defined(ZT_TILES)
  return true;
#else
  return false;
#endif
}

// x (rows, K) bf16 with unit column stride; w from pack_tiles (N/16 blocks of 16 columns, K/32
// blocks of 32: K rounded up to 32 with zero weights); bias (n,) fp32 or empty; residual (rows, n)
// bf16 contiguous or empty -> (rows, n) bf16: the product (plus residual, as torch adds them); gate > 0:
// n = 2 gate columns, gate's then up's, gate a multiple of 16 -> (rows, gate) SiLU(gate) * up
torch::Tensor tile_product(torch::Tensor x, torch::Tensor w, std::optional<torch::Tensor> bias, int64_t n,
                           std::optional<torch::Tensor> residual, int64_t gate) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kBFloat16 && x.stride(1) == 1, "bf16 rows");
  TORCH_CHECK(w.dim() == 5 && w.scalar_type() == torch::kBFloat16 && w.is_contiguous(), "packed weight");
  TORCH_CHECK(w.size(2) == 16 && w.size(3) == 16 && w.size(4) == 2 && n <= w.size(0) * 16 && n > w.size(0) * 16 - 16, "packed shape");
  TORCH_CHECK(!bias || (bias->scalar_type() == torch::kFloat && bias->numel() == n && bias->is_contiguous()), "fp32 bias of n");
  TORCH_CHECK(gate == 0 || (gate % 16 == 0 && n == 2 * gate && !residual), "a gated product of 2 x gate columns, gate a multiple of 16");
  const int64_t rows = x.size(0), k = x.size(1), kblocks = w.size(1);
  TORCH_CHECK(!residual || (residual->scalar_type() == torch::kBFloat16 && residual->is_contiguous() &&
                            residual->dim() == 2 && residual->size(0) == rows && residual->size(1) == n),
              "a contiguous bf16 residual of the output's shape");
  TORCH_CHECK(k <= kblocks * 32 && k > kblocks * 32 - 32, "input features");
  if (rows > 1 && x.stride(0) < k) x = x.contiguous();
  auto y = torch::empty({rows, gate ? gate : n}, x.options());
  if (rows == 0) return y;
#if defined(ZT_TILES)
  // rows are read in place when K is a multiple of 32 (else from a zero-padded copy), the last
  // partial 16 from a zero-padded tile
  if (k != kblocks * 32) x = torch::constant_pad_nd(x, {0, kblocks * 32 - k});
  const int64_t full = rows / 16 * 16;
  auto tail = torch::zeros({full < rows ? 16 : 0, kblocks * 32}, x.options());
  if (full < rows) tail.narrow(0, 0, rows - full).copy_(x.narrow(0, full, rows - full));
  const float* b = bias ? bias->data_ptr<float>() : nullptr;
  TileProblem t{reinterpret_cast<const uint16_t*>(x.data_ptr()), reinterpret_cast<const uint16_t*>(tail.data_ptr()),
                reinterpret_cast<const uint16_t*>(w.data_ptr()), b, reinterpret_cast<uint16_t*>(y.data_ptr()),
                x.stride(0), full, rows, n, w.size(0), kblocks, even_chunk(rows, MCHUNK, 32),
                residual ? reinterpret_cast<const uint16_t*>(residual->data_ptr()) : nullptr, gate};
  pybind11::gil_scoped_release no_gil;
  tile_linear_run(t);
  return y;
#else
  TORCH_CHECK(false, "this build has no AMX tile kernels");
#endif
}

torch::Tensor tile_linear(torch::Tensor x, torch::Tensor w, std::optional<torch::Tensor> bias, int64_t n,
                          std::optional<torch::Tensor> residual) {
  return tile_product(x, w, bias, n, residual, 0);
}

torch::Tensor tile_gated(torch::Tensor x, torch::Tensor w, std::optional<torch::Tensor> bias, int64_t gate) {
  return tile_product(x, w, bias, 2 * gate, std::nullopt, gate);
}
// Whether this CPU runs vec_linear's AVX-512 code; its AVX2 code (with FMA).
bool vec512_cpu() {
#if defined(ZT_VEC)
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f");
#else
  return false;
#endif
}

bool vec2_cpu() {
#if defined(ZT_VEC)
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#else
  return false;
#endif
}

// Whether vec_linear runs on this CPU (on AVX-512 or on AVX2).
bool vec_cpu() { return vec512_cpu() || vec2_cpu(); }

// vec_linear on its AVX2 code even where the CPU has AVX-512 (the same bits: tests compare the two,
// benchmarks time an AVX2 CPU's linears this way); returns the previous setting.
std::atomic<bool> g_vec_avx2{false};
bool vec_avx2(bool on) { return g_vec_avx2.exchange(on); }

// Whether vec_linear multiplies on its AVX-512 code now (the CPU has it and vec_avx2 is off).
bool vec_on512() {
  static const bool has512 = vec512_cpu();
  return has512 && !g_vec_avx2.load();
}

// The code vec_linear multiplies on now: "AVX-512", "AVX2", or "" (neither here).
std::string vec_code() {
  if (vec_on512()) return "AVX-512";
  return vec2_cpu() ? "AVX2" : "";
}

bool vec_built() {
#if defined(ZT_VEC)
  return true;
#else
  return false;
#endif
}

// x (rows, K) fp32 with unit column stride; w from pack_vec (N/48 panels of K x 48, 64-byte aligned;
// N rounded up to 48 with zero weights); bias (n,) fp32 or empty -> (rows, n) fp32
torch::Tensor vec_linear(torch::Tensor x, torch::Tensor w, std::optional<torch::Tensor> bias, int64_t n) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.stride(1) == 1, "fp32 rows");
  TORCH_CHECK(w.dim() == 3 && w.scalar_type() == torch::kFloat && w.is_contiguous() && w.size(2) == 48, "packed weight");
  TORCH_CHECK(n <= w.size(0) * 48 && n > w.size(0) * 48 - 48 && w.size(1) == x.size(1), "packed shape");
  TORCH_CHECK(reinterpret_cast<uintptr_t>(w.data_ptr()) % 64 == 0, "a 64-byte aligned packed weight");
  TORCH_CHECK(!bias || (bias->scalar_type() == torch::kFloat && bias->numel() == n && bias->is_contiguous()), "fp32 bias of n");
  const int64_t rows = x.size(0);
  if (rows > 1 && x.stride(0) < x.size(1)) x = x.contiguous();
  auto y = torch::empty({rows, n}, x.options());
  if (rows == 0) return y;
#if defined(ZT_VEC)
  const bool avx512 = vec_on512();
  TORCH_CHECK(avx512 || vec2_cpu(), "this CPU has neither AVX-512F nor AVX2 with FMA");
  VecProblem t{x.data_ptr<float>(), w.data_ptr<float>(), bias ? bias->data_ptr<float>() : nullptr,
               y.data_ptr<float>(), x.stride(0), rows, n, x.size(1), w.size(0),
               avx512 ? even_chunk(rows, VMC, 8) : vec2_chunk(rows)};
  pybind11::gil_scoped_release no_gil;
  if (avx512) vec_linear_run(t);
  else vec2_linear_run(t);  // the same bits
  return y;
#else
  TORCH_CHECK(false, "this build has no fp32 linear kernel (x86-64 only)");
#endif
}

bool dot_built() {
#if defined(ZT_DOT)
  return true;
#else
  return false;
#endif
}

// Whether this CPU runs AVX512-BF16 instructions (VDPBF16PS).
bool dot_cpu() {
#if defined(ZT_DOT)
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bf16");
#else
  return false;
#endif
}

// x (rows, K) bf16 with unit column stride; w from pack_dot (N/48 panels of K/2 x 48 x 2, 64-byte
// aligned; K rounded up to even and N to 48 with zero weights); bias (n,) fp32 or empty -> (rows, n) bf16
torch::Tensor dot_linear(torch::Tensor x, torch::Tensor w, std::optional<torch::Tensor> bias, int64_t n) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kBFloat16 && x.stride(1) == 1, "bf16 rows");
  TORCH_CHECK(w.dim() == 4 && w.scalar_type() == torch::kBFloat16 && w.is_contiguous() && w.size(2) == 48 && w.size(3) == 2, "packed weight");
  TORCH_CHECK(n <= w.size(0) * 48 && n > w.size(0) * 48 - 48, "packed shape");
  TORCH_CHECK(reinterpret_cast<uintptr_t>(w.data_ptr()) % 64 == 0, "a 64-byte aligned packed weight");
  TORCH_CHECK(!bias || (bias->scalar_type() == torch::kFloat && bias->numel() == n && bias->is_contiguous()), "fp32 bias of n");
  const int64_t rows = x.size(0), k = x.size(1), pairs = w.size(1);
  TORCH_CHECK(k == 2 * pairs || k == 2 * pairs - 1, "input features");
  if (rows > 1 && x.stride(0) < k) x = x.contiguous();
  auto y = torch::empty({rows, n}, x.options());
  if (rows == 0) return y;
#if defined(ZT_DOT)
  if (k != 2 * pairs) x = torch::constant_pad_nd(x, {0, 1});  // the last pair's second value: zero
  DotProblem t{reinterpret_cast<const uint16_t*>(x.data_ptr()), reinterpret_cast<const uint16_t*>(w.data_ptr()),
               bias ? bias->data_ptr<float>() : nullptr, reinterpret_cast<uint16_t*>(y.data_ptr()),
               x.stride(0), rows, n, pairs, w.size(0), even_chunk(rows, DMC, 8)};
  pybind11::gil_scoped_release no_gil;
  dot_linear_run(t);
  return y;
#else
  TORCH_CHECK(false, "this build has no AVX512-BF16 linear kernel");
#endif
}


bool q8_built() {
#if defined(ZT_Q8)
  return true;
#else
  return false;
#endif
}

// Whether this CPU runs the 8-bit kernel's AVX2, FMA and F16C instructions.
bool q8_cpu() {
#if defined(ZT_Q8)
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
#else
  return false;
#endif
}

#if defined(ZT_Q8)
// A factor table (n, groups / per) of f32, f16, bf16, int8 or uint8, any strides; absent: 1.0 (or no min).
Factor q8_factor(const std::optional<torch::Tensor>& f, int64_t n, int64_t groups, const char* what) {
  Factor out;
  if (!f) return out;
  TORCH_CHECK(f->dim() == 2 && f->size(0) == n && f->size(1) > 0 && groups % f->size(1) == 0, what, ": a table (n, groups / per)");
  switch (f->scalar_type()) {
    case torch::kFloat: out.kind = 1; break;
    case torch::kHalf: out.kind = 2; break;
    case torch::kChar: out.kind = 3; break;
    case torch::kByte: out.kind = 4; break;
    case torch::kBFloat16: out.kind = 5; break;
    default: TORCH_CHECK(false, what, ": f32, f16, bf16, int8 or uint8");
  }
  out.p = f->data_ptr();
  out.so = f->stride(0);
  out.sg = f->stride(1);
  out.per = groups / f->size(1);
  return out;
}
#endif

// Whether this CPU runs the 8-bit-activation kernel's AVX512-VNNI (and BW, VL, DQ) instructions.
bool vnni_cpu() {
#if defined(ZT_VNNI)
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("f16c");
#else
  return false;
#endif
}

// Whether the 8-bit kernels run their AVX2 code alone: the 8-bit-activation products on
// linear_a8_avx2.cpp's, the fp32-activation ones prepared now without q8_direct_wide (a CPU without
// AVX512-VNNI, or asked for: q8_avx2).
bool va_on_avx2() {
#if defined(ZT_Q8)
  static const bool without = !vnni_cpu();
  return without || g_va_avx2.load();
#else
  return false;
#endif
}

// The 8-bit kernels on their AVX2 code alone (va_on_avx2) even where the CPU has AVX512-VNNI (on:
// true; a CPU without it runs them there anyway), as a CPU with AVX2 alone runs them: the
// 8-bit-activation products from the next call on (the same bits, so tests compare the two paths),
// the fp32-activation ones prepared from now on; benchmarks time an AVX2 CPU's linears this way.
// Returns the previous setting.
bool q8_avx2(bool on) {
#if defined(ZT_Q8)
  return g_va_avx2.exchange(on);
#else
  return on && false;
#endif
}

// x (rows, K) fp32 with unit column stride (bf16 in modes 2 and 3); q (n, groups, group) int8 with
// unit last stride (K = groups * group, group a multiple of 8), or uint8 (n, groups, group / 2): two
// values a byte, each less offset; the scales s1 (* s2) and mins m1 (* m2): tables (n, groups / per)
// -> (rows, n) in x's dtype: y = x (q * s - m)^T, or x (q * s + m)^T where add_mins. mode 0: x as it
// is (q8_linear_many; bf16 weights too, no scales); 1: x quantised to int8 per 32 inputs first
// (q8a8_linear_many, not bf16 weights); 2: bf16 x times the weights rounded to bf16 on AMX tiles
// (qtile_linear_run, K a multiple of 32); 3: the same on AVX512-BF16 (qdot_linear_run).
// q8_check_operands checks one product's operands for K inputs.
void q8_check_operands(int64_t k, const torch::Tensor& q, const std::optional<torch::Tensor>& s1,
                       const std::optional<torch::Tensor>& s2, const std::optional<torch::Tensor>& m1,
                       const std::optional<torch::Tensor>& m2, int64_t offset, int mode) {
  const bool nibbles = q.scalar_type() == torch::kByte, bf16 = mode == 0 && q.scalar_type() == torch::kBFloat16;
  TORCH_CHECK(q.dim() == 3 && (nibbles || bf16 || q.scalar_type() == torch::kChar) && q.stride(2) == 1,
              mode ? "int8 values (n, groups, group) or uint8 pairs (n, groups, group / 2)"
                   : "int8 values (n, groups, group), uint8 pairs (n, groups, group / 2) or bf16 weights (n, groups, group)");
  TORCH_CHECK(nibbles || offset == 0, "an offset for values two a byte only");
  TORCH_CHECK(offset >= -Q8_TABLES && offset < 16, "an offset of 0 to 15, or -1 to -5 (a table's)");
  TORCH_CHECK(bf16 ? !s1 && !s2 && !m1 && !m2 : s1.has_value(), "scales for 8- and 4-bit values only (and then s1)");
  const int64_t groups = q.size(1), group = q.size(2) * (nibbles ? 2 : 1);
  TORCH_CHECK(group % 8 == 0 && k == groups * group, "groups of a multiple of 8 inputs, K of them");
  TORCH_CHECK(mode < 2 || k % 32 == 0, "K a multiple of 32 for bf16 rows");
  TORCH_CHECK(!m2 || m1, "a min's second factor without its first");
}

void q8_check_rows(const torch::Tensor& x, int mode) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == (mode >= 2 ? torch::kBFloat16 : torch::kFloat) && x.stride(1) == 1,
              mode >= 2 ? "bf16 rows" : "fp32 rows");
}

#if defined(ZT_Q8)
// One checked product's problem for rows of K inputs, its outputs written at y (row stride ldy); the
// rows (x, ldx, rows, chunk) set by q8_set_rows.
Q8Problem q8_problem(int64_t k, const torch::Tensor& q, const std::optional<torch::Tensor>& s1,
                     const std::optional<torch::Tensor>& s2, const std::optional<torch::Tensor>& m1,
                     const std::optional<torch::Tensor>& m2, int64_t offset, bool add_mins, int mode) {
  const bool nibbles = q.scalar_type() == torch::kByte, bf16 = mode == 0 && q.scalar_type() == torch::kBFloat16;
  const int64_t n = q.size(0), groups = q.size(1), group = q.size(2) * (nibbles ? 2 : 1);
  Q8Problem t{nullptr, nullptr,
              static_cast<const int8_t*>(q.data_ptr()), q.stride(0), q.stride(1), bf16 ? 2 : nibbles ? 1 : 0,
              static_cast<int32_t>(offset), q8_factor(s1, n, groups, "s1"), q8_factor(s2, n, groups, "s2"),
              q8_factor(m1, n, groups, "m1"), q8_factor(m2, n, groups, "m2"), add_mins, 0, 0, n,
              k, group, (n + QOT - 1) / QOT, 0};
  t.wide = mode == 0 && !va_on_avx2();  // AVX-512 (with BW, VL, DQ): q8_direct_wide
  q8_ahead_bytes(t);
  q8_lut(t);
  return t;
}

void q8_set_rows(Q8Problem& t, const torch::Tensor& x, float* y, int64_t ldy) {
  t.x = x.scalar_type() == torch::kFloat ? x.data_ptr<float>() : nullptr;  // bf16 rows: read apart
  t.ldx = x.stride(0);
  t.rows = x.size(0);
  t.chunk = even_chunk(t.rows, QMC, 4);
  t.y = y;
  t.ldy = ldy;
}
#endif

torch::Tensor q8_entry(torch::Tensor x, torch::Tensor q, std::optional<torch::Tensor> s1, std::optional<torch::Tensor> s2,
                       std::optional<torch::Tensor> m1, std::optional<torch::Tensor> m2, int64_t offset, bool add_mins,
                       int mode) {
  const bool a8 = mode == 1, tiles = mode == 2;
  q8_check_rows(x, mode);
  q8_check_operands(x.size(1), q, s1, s2, m1, m2, offset, mode);
  const int64_t n = q.size(0), rows = x.size(0);
  if (rows > 1 && x.stride(0) < x.size(1)) x = x.contiguous();
  auto y = torch::empty({rows, n}, x.options());
  if (rows == 0 || n == 0) return y;
#if defined(ZT_Q8)
  TORCH_CHECK(!a8 || q8_cpu(), "this CPU has no AVX2, FMA and F16C");
  std::vector<Q8Problem> ts{q8_problem(x.size(1), q, s1, s2, m1, m2, offset, add_mins, mode)};
  q8_set_rows(ts[0], x, mode >= 2 ? nullptr : y.data_ptr<float>(), n);
  if (mode == 3) {
#if defined(ZT_QDOT)
    const int64_t chunk = even_chunk(rows, DMC, 8);
    QDotProblem qd{ts[0], reinterpret_cast<const uint16_t*>(x.data_ptr()), reinterpret_cast<uint16_t*>(y.data_ptr()),
                   x.stride(0), chunk, (rows + chunk - 1) / chunk};
    pybind11::gil_scoped_release no_gil;
    qdot_linear_run(qd);
    return y;
#else
    TORCH_CHECK(false, "this build has no AVX512-BF16 kernels for quantised weights");
#endif
  }
  if (tiles) {
#if defined(ZT_QTILES)
    // the rows packed as pack_tiles packs a weight: B tiles of 16 rows and 32 inputs
    const int64_t kblocks = x.size(1) / 32, blocks = (rows + 15) / 16, chunk = even_chunk(rows, MCHUNK, 32);
    auto xp = torch::constant_pad_nd(x, {0, 0, 0, blocks * 16 - rows})
                  .reshape({blocks, 16, kblocks, 16, 2})
                  .permute({0, 2, 3, 1, 4})
                  .contiguous();
    QTileProblem qt{ts[0], reinterpret_cast<const uint16_t*>(xp.data_ptr()), reinterpret_cast<uint16_t*>(y.data_ptr()),
                    kblocks, chunk, (rows + chunk - 1) / chunk};
    pybind11::gil_scoped_release no_gil;
    qtile_linear_run(qt);
    return y;
#else
    TORCH_CHECK(false, "this build has no AMX tile kernels");
#endif
  }
  pybind11::gil_scoped_release no_gil;
  if (a8) q8a8_linear_many(ts, va_on_avx2());
  else q8_linear_many(ts);
  return y;
#else
  TORCH_CHECK(false, "this build has no 8-bit linear kernel");
#endif
}

// Several products of rows of K inputs (q8_entry's operands each, modes 0 and 1, not bf16 weights),
// prepared once (q8_prepare: the tables are lists, one entry a product; the caller keeps the tensors
// alive until q8_release) and run side by side by q8_run into one (rows, sum of n) result in one
// parallel region; with a8 the rows quantised once for the products that share a kind of values,
// offset and group. Each output's arithmetic is the one a call for its product alone does: the same bits.
struct Q8Prepared {
  std::vector<Q8Problem> ts;
  int64_t k = 0, total = 0;
  bool a8 = false;
};

std::mutex& q8_prepared_lock() {
  static std::mutex lock;
  return lock;
}
std::vector<std::unique_ptr<Q8Prepared>>& q8_prepared() {
  static std::vector<std::unique_ptr<Q8Prepared>> all;
  return all;
}

int64_t q8_prepare(int64_t k, std::vector<torch::Tensor> q, std::vector<std::optional<torch::Tensor>> s1,
                   std::vector<std::optional<torch::Tensor>> s2, std::vector<std::optional<torch::Tensor>> m1,
                   std::vector<std::optional<torch::Tensor>> m2, std::vector<int64_t> offset,
                   std::vector<int64_t> add_mins, bool a8) {
  const size_t count = q.size();
  TORCH_CHECK(count > 0 && s1.size() == count && s2.size() == count && m1.size() == count && m2.size() == count &&
                  offset.size() == count && add_mins.size() == count,
              "one entry of each list a product");
#if defined(ZT_Q8)
  TORCH_CHECK(!a8 || q8_cpu(), "this CPU has no AVX2, FMA and F16C");
  auto prepared = std::make_unique<Q8Prepared>();
  prepared->k = k;
  prepared->a8 = a8;
  for (size_t i = 0; i < count; ++i) {
    q8_check_operands(k, q[i], s1[i], s2[i], m1[i], m2[i], offset[i], a8 ? 1 : 0);
    TORCH_CHECK(q[i].scalar_type() != torch::kBFloat16, "8- and 4-bit values");
    if (q[i].size(0) > 0)  // a product of no outputs adds no columns and no tasks
      prepared->ts.push_back(q8_problem(k, q[i], s1[i], s2[i], m1[i], m2[i], offset[i], add_mins[i] != 0, a8 ? 1 : 0));
    prepared->total += q[i].size(0);
  }
  std::lock_guard<std::mutex> hold(q8_prepared_lock());
  auto& all = q8_prepared();
  for (size_t h = 0; h < all.size(); ++h)
    if (!all[h]) {
      all[h] = std::move(prepared);
      return static_cast<int64_t>(h);
    }
  all.push_back(std::move(prepared));
  return static_cast<int64_t>(all.size() - 1);
#else
  TORCH_CHECK(false, "this build has no 8-bit linear kernel");
#endif
}

void q8_release(int64_t handle) {
  std::lock_guard<std::mutex> hold(q8_prepared_lock());
  auto& all = q8_prepared();
  if (handle >= 0 && handle < static_cast<int64_t>(all.size())) all[handle].reset();
}

// x (..., K) fp32 (or bf16, read widened) -> (..., sum of n) fp32: the prepared products of handle.
torch::Tensor q8_run(torch::Tensor x, int64_t handle) {
#if defined(ZT_Q8)
  std::vector<Q8Problem> ts;
  int64_t k = 0, total = 0;
  bool a8 = false;
  {
    std::lock_guard<std::mutex> hold(q8_prepared_lock());
    auto& all = q8_prepared();
    TORCH_CHECK(handle >= 0 && handle < static_cast<int64_t>(all.size()) && all[handle], "no such prepared products");
    ts = all[handle]->ts;
    k = all[handle]->k;
    total = all[handle]->total;
    a8 = all[handle]->a8;
  }
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == k, "rows of K inputs");
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = total;
  auto rows = x.reshape({-1, k});
  if (rows.scalar_type() != torch::kFloat) rows = rows.to(torch::kFloat);
  if (rows.stride(1) != 1 || (rows.size(0) > 1 && rows.stride(0) < k)) rows = rows.contiguous();
  auto y = torch::empty({rows.size(0), total}, rows.options());
  if (rows.size(0) > 0) {
    int64_t column = 0;
    for (auto& t : ts) {
      q8_set_rows(t, rows, y.data_ptr<float>() + column, total);
      column += t.n;
    }
    pybind11::gil_scoped_release no_gil;
    if (a8) q8a8_linear_many(ts, va_on_avx2());
    else q8_linear_many(ts);
  }
  return y.view(shape);
#else
  TORCH_CHECK(false, "this build has no 8-bit linear kernel");
#endif
}

torch::Tensor q8_linear(torch::Tensor x, torch::Tensor q, std::optional<torch::Tensor> s1,
                        std::optional<torch::Tensor> s2, std::optional<torch::Tensor> m1,
                        std::optional<torch::Tensor> m2, int64_t offset, bool add_mins) {
  return q8_entry(x, q, s1, s2, m1, m2, offset, add_mins, 0);
}

// q8_linear's operands (not bf16 weights) times the rows quantised to int8 per block of 32 inputs.
torch::Tensor q8a8_linear(torch::Tensor x, torch::Tensor q, std::optional<torch::Tensor> s1,
                          std::optional<torch::Tensor> s2, std::optional<torch::Tensor> m1,
                          std::optional<torch::Tensor> m2, int64_t offset, bool add_mins) {
  return q8_entry(x, q, s1, s2, m1, m2, offset, add_mins, 1);
}

// q8_linear's operands (not bf16 weights) times bf16 rows on AMX tiles, the weights rounded to bf16.
torch::Tensor q8t_linear(torch::Tensor x, torch::Tensor q, std::optional<torch::Tensor> s1,
                         std::optional<torch::Tensor> s2, std::optional<torch::Tensor> m1,
                         std::optional<torch::Tensor> m2, int64_t offset, bool add_mins) {
  return q8_entry(x, q, s1, s2, m1, m2, offset, add_mins, 2);
}

// q8_linear's operands (not bf16 weights) times bf16 rows on AVX512-BF16, the weights rounded to bf16.
torch::Tensor q8d_linear(torch::Tensor x, torch::Tensor q, std::optional<torch::Tensor> s1,
                         std::optional<torch::Tensor> s2, std::optional<torch::Tensor> m1,
                         std::optional<torch::Tensor> m2, int64_t offset, bool add_mins) {
  return q8_entry(x, q, s1, s2, m1, m2, offset, add_mins, 3);
}
