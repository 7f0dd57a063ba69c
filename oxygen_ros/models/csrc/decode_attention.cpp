// Decode attention on the CPU: one pass over each row's keys for the scores, one over its values for
// the output, for a few folded queries per K/V head (a language decode step).
//
// Why: with one to a few queries per K/V head, the two batched matmuls of the torch path are tiny
// GEMMs (4 columns) whose cost is per matrix rather than per byte. Here each row's K and V stream
// through once, scores and softmax stay in fp32, and rows are independent: a row's result does not
// depend on the other rows.
//
// One source for every CPU: the vector code is written with ATen's portable vector type
// at::vec::Vectorized<float> (W = Vec::size() floats: 16 with AVX-512, 8 with AVX2 and in the
// generic build, 4 with aarch64's NEON). oxygen_ros/models/native.py compiles this file for each
// build it uses (avx512, avx2, neon, default), with that instruction set's compiler flags and ATen's
// CPU_CAPABILITY defines (the same scheme ATen uses for its own kernels), only for instruction sets
// the running CPU can execute, and picks the best build at run time. Each build registers its own
// operator, torch.ops.oxygen_ros.decode_attention_<OXYGEN_ISA>, so several builds can be loaded in
// one process (tests, A/B benchmarks).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/ops/_softmax.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

#if !defined(OXYGEN_ISA) || !defined(CPU_CAPABILITY)
#error "compile with -DOXYGEN_ISA=<name> -DCPU_CAPABILITY=<ATen capability> (oxygen_ros/models/native.py)"
#endif
#define OXYGEN_STR2(x) #x
#define OXYGEN_STR(x) OXYGEN_STR2(x)
#define OXYGEN_ISA_NAME OXYGEN_STR(OXYGEN_ISA)

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int W = Vec::size();
static_assert(W == 4 || W == 8 || W == 16, "a vector of 4, 8 or 16 floats");
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// Whether this CPU can execute the instructions this build was compiled for. native.py checks the
// same before it loads a build; this check turns a forced misuse into an error instead of SIGILL.
bool cpu_can_run() {
#if defined(CPU_CAPABILITY_AVX512)
  static const bool yes = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
                          __builtin_cpu_supports("fma");
  return yes;
#elif defined(CPU_CAPABILITY_AVX2)
  static const bool yes = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return yes;
#else
  return true;   // the compiler's baseline for this architecture
#endif
}

// Shapes and strides of one call (elements, not bytes).
struct Problem {
  int64_t batch, heads, queries, tokens, dim, length;
  const float* q;                    // [B, H, N, D] contiguous
  const float* k;                    // [B, L, H, D], D contiguous
  const float* v;
  const bool* mask;                  // [B, T, L] contiguous; query n reads row n % T
  int64_t k_b, k_l, k_h, v_b, v_l, v_h;
  int64_t shared;                    // keys [0, shared) are the same in every row: read row 0's
};

// Key (value) row l of batch row b, head h: row 0's copy below the shared prefix, so that a prefix
// every row holds is read once from memory and then from cache.
inline const float* k_row(const Problem& p, int64_t b, int64_t h, int64_t l) {
  return p.k + (l < p.shared ? 0 : b) * p.k_b + h * p.k_h + l * p.k_l;
}
inline const float* v_row(const Problem& p, int64_t b, int64_t h, int64_t l) {
  return p.v + (l < p.shared ? 0 : b) * p.v_b + h * p.v_h + l * p.v_l;
}

// Keys [0, end) of row b that some query may see; keys at or past `end` are masked for all.
int64_t visible_end(const Problem& p, int64_t b) {
  const bool* m = p.mask + b * p.tokens * p.length;
  int64_t end = 0;
  for (int64_t t = 0; t < p.tokens; ++t) {
    const bool* row = m + t * p.length;
    for (int64_t l = p.length; l > end; --l) {
      if (row[l - 1]) { end = l; break; }
    }
  }
  return end;
}

// Keys ahead of the one being read whose K (V) row is prefetched (4 KB at head_dim 64). On the
// 2-core development machine distances of 0, 16, 32 and 64 keys measured alike within its noise
// (+-30 %); 16 keeps a few DRAM latencies of data in flight per core without running far past a
// short row.
constexpr int64_t kPrefetchKeys = 16;

// Prefetches `floats` floats from `at` (one hint per 64-byte line). Prefetching past the end of a
// buffer is harmless: a prefetch never faults.
inline void prefetch_row(const float* at, int64_t floats) {
  for (int64_t f = 0; f < floats; f += 16) __builtin_prefetch(at + f, 0, 3);
}

// dot(q, k) over D = chunks x W floats, as a vector of W partial sums.
inline Vec partial_dot(const float* q, const float* k, int64_t chunks) {
  Vec acc = Vec::loadu(q) * Vec::loadu(k);
  for (int64_t c = 1; c < chunks; ++c)
    acc = at::vec::fmadd(Vec::loadu(q + W * c), Vec::loadu(k + W * c), acc);
  return acc;
}

// The W horizontal sums of v[0 .. W) in one vector: lane i holds the sum of v[i]'s lanes. A tree of
// W - 1 adds of deinterleaved pairs (each level halves the lanes per input and keeps the inputs in
// order), instead of a separate reduction per vector. Overwrites v.
inline Vec lane_sums(Vec* v) {
  for (int width = W; width > 1; width /= 2) {
    for (int i = 0; i < width / 2; ++i) {
      const auto halves = at::vec::deinterleave2(v[2 * i], v[2 * i + 1]);
      v[i] = halves.first + halves.second;
    }
  }
  return v[0];
}

// Scores s[n * L + l] = q_n . k_l for keys l < end (masked keys and keys >= end get -inf). Blocks of
// W keys per query: their W partial dot products are reduced together by lane_sums, which leaves
// the block's scores in one vector, ready to store. A block's K rows stay in L1 for the next query.
void scores(const Problem& p, int64_t b, int64_t h, int64_t end, float* s) {
  const int64_t chunks = p.dim / W, L = p.length;
  const float* q = p.q + (b * p.heads + h) * p.queries * p.dim;
  for (int64_t l = 0; l < end; l += W) {
    const int count = static_cast<int>(std::min<int64_t>(W, end - l));
    for (int i = 0; i < W; ++i) prefetch_row(k_row(p, b, h, l + kPrefetchKeys + i), p.dim);
    for (int64_t n = 0; n < p.queries; ++n) {
      Vec parts[W];
      for (int i = 0; i < W; ++i)
        parts[i] = i < count ? partial_dot(q + n * p.dim, k_row(p, b, h, l + i), chunks) : Vec(0.f);
      const Vec sums = lane_sums(parts);
      if (count == W) sums.store(s + n * L + l);
      else sums.store(s + n * L + l, count);
    }
  }
  const bool* m = p.mask + b * p.tokens * L;
  for (int64_t n = 0; n < p.queries; ++n) {
    const bool* mn = m + (n % p.tokens) * L;
    float* sn = s + n * L;
    for (int64_t l = 0; l < end; ++l) sn[l] = mn[l] ? sn[l] : kNegInf;
    for (int64_t l = end; l < L; ++l) sn[l] = kNegInf;
  }
}

// Accumulator vectors the output kernel keeps in registers: half of the register file of AVX-512 (32
// registers) and of NEON (32 registers of 4 floats), and 8 of AVX2's 16, leaving room for the V row
// and the broadcast probabilities.
constexpr int kAccumulators = W == 16 ? 16 : 8;
// Keys per block in the output kernel when it takes several passes over a row's V (more queries or
// dims than kAccumulators cover): the passes over one block of keys read it from L1.
constexpr int64_t kBlockBytes = 16 * 1024;

// out[n, d0 .. d0 + S W) for NQ queries from n0 += sum over keys [l0, l1) of probs[n, l] V[l, ...],
// accumulated in registers in key order; `first` starts from zero, otherwise from `out` (the keys
// before l0), so the sum over keys is the same, in the same order, however the keys are blocked.
template <int NQ, int S>
void output_block(const Problem& p, int64_t b, int64_t h, int64_t n0, int64_t d0, int64_t l0, int64_t l1,
                  bool first, const float* probs, float* out) {
  Vec acc[NQ][S];
  for (int n = 0; n < NQ; ++n)
    for (int c = 0; c < S; ++c)
      acc[n][c] = first ? Vec(0.f) : Vec::loadu(out + (n0 + n) * p.dim + d0 + W * c);
  for (int64_t l = l0; l < l1; ++l) {
    const float* vl = v_row(p, b, h, l) + d0;
    prefetch_row(v_row(p, b, h, l + kPrefetchKeys) + d0, W * S);
    Vec row[S];
    for (int c = 0; c < S; ++c) row[c] = Vec::loadu(vl + W * c);
    for (int n = 0; n < NQ; ++n) {
      const Vec w(probs[(n0 + n) * p.length + l]);
      for (int c = 0; c < S; ++c) acc[n][c] = at::vec::fmadd(w, row[c], acc[n][c]);
    }
  }
  for (int n = 0; n < NQ; ++n)
    for (int c = 0; c < S; ++c) acc[n][c].store(out + (n0 + n) * p.dim + d0 + W * c);
}

using BlockFn = void (*)(const Problem&, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, bool,
                         const float*, float*);

// The output kernel's register blocking for `queries` queries of `dim` dims: NQ queries x S vectors
// of dims per pass, NQ * S <= kAccumulators, NQ a power of two dividing queries, S one dividing
// dim / W; S at least one 64-byte line when it fits. Null for other query counts.
struct Blocking { BlockFn fn; int nq, s; };

template <int NQ, int S>
constexpr Blocking blocking() { return {output_block<NQ, S>, NQ, S}; }

template <int NQ>
Blocking pick_s(int64_t chunks) {
  constexpr int kMaxS = kAccumulators / NQ > 0 ? kAccumulators / NQ : 1;
  if constexpr (kMaxS >= 16) { if (chunks % 16 == 0) return blocking<NQ, 16>(); }
  if constexpr (kMaxS >= 8) { if (chunks % 8 == 0) return blocking<NQ, 8>(); }
  if constexpr (kMaxS >= 4) { if (chunks % 4 == 0) return blocking<NQ, 4>(); }
  if constexpr (kMaxS >= 2) { if (chunks % 2 == 0) return blocking<NQ, 2>(); }
  return blocking<NQ, 1>();
}

Blocking pick_blocking(int64_t queries, int64_t dim) {
  const int64_t chunks = dim / W;
  // Queries per pass: as many as leave room for a line (16 floats) of dims each.
  constexpr int kLine = 16 / W;
  constexpr int kMaxQ = kAccumulators / kLine;
  const int64_t nq = std::min<int64_t>(queries, kMaxQ);
  switch (nq) {
    case 1: return pick_s<1>(chunks);
    case 2: return pick_s<2>(chunks);
    case 4: return pick_s<4>(chunks);
    case 8: if constexpr (kMaxQ >= 8) return pick_s<8>(chunks); break;
    case 16: if constexpr (kMaxQ >= 16) return pick_s<16>(chunks); break;
    default: break;
  }
  return {nullptr, 0, 0};
}

// out[n, :] = sum over keys l < end of probs[n, l] V[l, :] for one row (b, h).
void output(const Problem& p, const Blocking& blk, int64_t b, int64_t h, int64_t end, const float* probs,
            float* out) {
  const int64_t span = int64_t{blk.s} * W;
  const bool one_pass = blk.nq == p.queries && span == p.dim;
  const int64_t block = one_pass ? end : std::max<int64_t>(16, kBlockBytes / (p.dim * int64_t{sizeof(float)}));
  for (int64_t l0 = 0; l0 < end; l0 += block) {
    const int64_t l1 = std::min(end, l0 + block);
    for (int64_t d0 = 0; d0 < p.dim; d0 += span)
      for (int64_t n0 = 0; n0 < p.queries; n0 += blk.nq)
        blk.fn(p, b, h, n0, d0, l0, l1, l0 == 0, probs, out);
  }
}

// q [B, H, N, D] fp32 (scaled, queries folded group-major: n = group * T + token); k, v [B, L, H, D]
// fp32 with the last dimension contiguous; mask bool [B, T, L]; keys below shared_prefix are the
// same in every row (row 0's are read). Returns fp32 [B, H, N, D].
// Needs D a multiple of 16 and N in {1, 2, 4, 8, 16} (oxygen_ros.models.native.supports).
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const at::Tensor& mask, int64_t shared_prefix) {
  TORCH_CHECK(cpu_can_run(), "decode_attention: this CPU cannot run the ", OXYGEN_ISA_NAME, " build");
  TORCH_CHECK(q.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu() && mask.device().is_cpu(),
              "decode_attention: CPU tensors only");
  TORCH_CHECK(q.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat,
              "decode_attention: q, k, v must be float32");
  TORCH_CHECK(mask.scalar_type() == at::kBool, "decode_attention: mask must be bool");
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4 && mask.dim() == 3,
              "decode_attention: q, k, v must be 4-D and mask 3-D");
  TORCH_CHECK(k.sizes() == v.sizes(), "decode_attention: k and v shapes differ");
  const at::Tensor qc = q.contiguous(), mc = mask.contiguous();
  Problem p;
  p.batch = q.size(0); p.heads = q.size(1); p.queries = q.size(2); p.dim = q.size(3);
  p.length = k.size(1); p.tokens = mask.size(1);
  TORCH_CHECK(k.size(0) == p.batch && k.size(2) == p.heads && k.size(3) == p.dim,
              "decode_attention: k must be [B, L, H, D] matching q [B, H, N, D]");
  TORCH_CHECK(mask.size(0) == p.batch && mask.size(2) == p.length && p.tokens >= 1 &&
              p.queries % p.tokens == 0, "decode_attention: mask must be [B, T, L] with T dividing N");
  TORCH_CHECK(k.stride(3) == 1 && v.stride(3) == 1, "decode_attention: k, v need a contiguous last dim");
  p.q = qc.data_ptr<float>(); p.k = k.data_ptr<float>(); p.v = v.data_ptr<float>();
  p.mask = mc.data_ptr<bool>();
  p.k_b = k.stride(0); p.k_l = k.stride(1); p.k_h = k.stride(2);
  p.v_b = v.stride(0); p.v_l = v.stride(1); p.v_h = v.stride(2);
  TORCH_CHECK(shared_prefix >= 0 && shared_prefix <= p.length,
              "decode_attention: shared_prefix must be in [0, L], got ", shared_prefix);
  p.shared = shared_prefix;

  at::Tensor out = at::empty({p.batch, p.heads, p.queries, p.dim}, q.options());
  if (p.batch == 0 || p.heads == 0 || p.queries == 0 || p.dim == 0) return out;
  TORCH_CHECK(p.length > 0, "decode_attention: no keys");
  float* out_ptr = out.data_ptr<float>();

  TORCH_CHECK(p.dim % 16 == 0, "decode_attention: head_dim must be a multiple of 16, got ", p.dim);
  TORCH_CHECK(p.queries == 1 || p.queries == 2 || p.queries == 4 || p.queries == 8 || p.queries == 16,
              "decode_attention: queries per K/V head must be 1, 2, 4, 8 or 16, got ", p.queries);
  const Blocking blk = pick_blocking(p.queries, p.dim);
  // Scores of every row, then one softmax (ATen's vectorised kernel, fp32; keys masked for a query
  // get -inf and probability 0), then the outputs.
  const int64_t rows = p.batch * p.heads, per_row = p.queries * p.length;
  at::Tensor probs = at::empty({p.batch, p.heads, p.queries, p.length}, q.options());
  float* s_ptr = probs.data_ptr<float>();
  std::vector<int64_t> ends(p.batch);
  for (int64_t b = 0; b < p.batch; ++b) {
    ends[b] = visible_end(p, b);
    TORCH_CHECK(ends[b] > 0, "decode_attention: row ", b, " has a mask that hides every key");
  }
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end_row) {
    for (int64_t r = begin; r < end_row; ++r)
      scores(p, r / p.heads, r % p.heads, ends[r / p.heads], s_ptr + r * per_row);
  });
  probs = at::_softmax(probs, -1, false);
  const float* p_ptr = probs.data_ptr<float>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end_row) {
    for (int64_t r = begin; r < end_row; ++r)
      output(p, blk, r / p.heads, r % p.heads, ends[r / p.heads], p_ptr + r * per_row,
             out_ptr + r * p.queries * p.dim);
  });
  return out;
}

}  // namespace

// One operator per build: decode_attention_<OXYGEN_ISA> in the oxygen_ros namespace (a fragment, so
// that the builds for several instruction sets can be loaded side by side).
TORCH_LIBRARY_FRAGMENT(oxygen_ros, m) {
  m.def("decode_attention_" OXYGEN_ISA_NAME
        "(Tensor q, Tensor k, Tensor v, Tensor mask, int shared_prefix=0) -> Tensor");
}

TORCH_LIBRARY_IMPL(oxygen_ros, CPU, m) {
  m.impl("decode_attention_" OXYGEN_ISA_NAME, &decode_attention);
}
