// Decode attention on the CPU: one pass over each row's keys for the scores, one over its values for
// the output, for a few folded queries per K/V head (a language decode step).
//
// Why: with one to a few queries per K/V head, the two batched matmuls of the torch path are tiny
// GEMMs (4 columns) whose cost is per matrix rather than per byte. On 2 x86 cores (AVX-512) the
// attention of a 30-request decode step of pi05_tiny (37 MB of K/V over 4 layers) took 3.3-5.1 ms
// through `bmm` and 2.1-2.3 ms here. Each row's K and V stream through once, scores and softmax
// stay in fp32, and rows are independent: a row's result does not depend on the other rows.
//
// Registered as torch.ops.oxygen_ros.decode_attention (see oxygen_ros/models/native.py, which builds
// this file on first use and falls back to the torch path when it cannot).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstdint>
#include <limits>
#include <vector>

#if !defined(__x86_64__)
#error "decode_attention.cpp needs x86-64 (AVX-512); other CPUs use the torch path"
#endif
#include <immintrin.h>

namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

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
  for (int64_t f = 0; f < floats; f += 16) _mm_prefetch(reinterpret_cast<const char*>(at + f), _MM_HINT_T0);
}

// ---- AVX-512 (D a multiple of 16) -------------------------------------------------------------

// dot(q, k) over `chunks` x 16 floats, as a vector of 16 partial sums.
__attribute__((target("avx512f")))
inline __m512 partial_dot(const float* q, const float* k, int64_t chunks) {
  __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(q), _mm512_loadu_ps(k));
  for (int64_t c = 1; c < chunks; ++c)
    acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + 16 * c), _mm512_loadu_ps(k + 16 * c), acc);
  return acc;
}

// The 16 horizontal sums of v[0..15] in one vector: lane 4j + m holds the sum of v[4m + j]. A
// tree of 15 adds and 30 in-register shuffles, instead of a separate reduction per vector.
__attribute__((target("avx512f")))
inline __m512 sum16(const __m512* v) {
  __m512 w[8], x[4], y[2];
  for (int i = 0; i < 8; ++i)   // 512 -> 256 bits: [v(2i) folded | v(2i+1) folded]
    w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                         _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
  for (int i = 0; i < 4; ++i)   // 256 -> 128 bits: 128-bit block b holds v(4i + b)
    x[i] = _mm512_add_ps(_mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], 0xDD));
  for (int i = 0; i < 2; ++i)   // 4 -> 2 partial sums per vector, within each block
    y[i] = _mm512_add_ps(_mm512_shuffle_ps(x[2 * i], x[2 * i + 1], 0x44),
                         _mm512_shuffle_ps(x[2 * i], x[2 * i + 1], 0xEE));
  return _mm512_add_ps(_mm512_shuffle_ps(y[0], y[1], 0x88), _mm512_shuffle_ps(y[0], y[1], 0xDD));
}

// Scores s[n * L + l] = q_n . k_l for keys l < end (masked keys and keys >= end get -inf). With a
// multiple of 4 queries, blocks of 4 keys x 4 queries are reduced together by sum16, which leaves
// each query's 4 scores in one 128-bit block, ready to store.
__attribute__((target("avx512f")))
void scores_avx512(const Problem& p, int64_t b, int64_t h, int64_t end, float* s) {
  const int64_t chunks = p.dim / 16, L = p.length;
  const float* q = p.q + (b * p.heads + h) * p.queries * p.dim;
  int64_t blocked = 0;
  if (p.queries % 4 == 0) {
    blocked = end - end % 4;
    for (int64_t l = 0; l < blocked; l += 4) {
      prefetch_row(k_row(p, b, h, l + kPrefetchKeys), 4 * p.k_l);
      for (int64_t n0 = 0; n0 < p.queries; n0 += 4) {
        __m512 v[16];
        for (int m = 0; m < 4; ++m)
          for (int j = 0; j < 4; ++j)
            v[4 * m + j] = partial_dot(q + (n0 + j) * p.dim, k_row(p, b, h, l + m), chunks);
        const __m512 sums = sum16(v);   // block j: query n0 + j, keys l .. l + 3
        _mm_storeu_ps(s + (n0 + 0) * L + l, _mm512_extractf32x4_ps(sums, 0));
        _mm_storeu_ps(s + (n0 + 1) * L + l, _mm512_extractf32x4_ps(sums, 1));
        _mm_storeu_ps(s + (n0 + 2) * L + l, _mm512_extractf32x4_ps(sums, 2));
        _mm_storeu_ps(s + (n0 + 3) * L + l, _mm512_extractf32x4_ps(sums, 3));
      }
    }
  }
  for (int64_t l = blocked; l < end; ++l) {
    const float* kl = k_row(p, b, h, l);
    for (int64_t n = 0; n < p.queries; ++n)
      s[n * L + l] = _mm512_reduce_add_ps(partial_dot(q + n * p.dim, kl, chunks));
  }
  const bool* m = p.mask + b * p.tokens * L;
  for (int64_t n = 0; n < p.queries; ++n) {
    const bool* mn = m + (n % p.tokens) * L;
    float* sn = s + n * L;
    for (int64_t l = 0; l < end; ++l) sn[l] = mn[l] ? sn[l] : kNegInf;
    for (int64_t l = end; l < L; ++l) sn[l] = kNegInf;
  }
}

// NQ queries, accumulators for S chunks of 16 dims each held in registers (NQ * S <= 16).
template <int NQ, int S>
__attribute__((target("avx512f")))
void output_avx512(const Problem& p, int64_t b, int64_t h, int64_t end, const float* probs, float* out) {
  for (int64_t d0 = 0; d0 < p.dim; d0 += 16 * S) {
    __m512 acc[NQ][S];
    for (int n = 0; n < NQ; ++n)
      for (int c = 0; c < S; ++c) acc[n][c] = _mm512_setzero_ps();
    for (int64_t l = 0; l < end; ++l) {
      const float* vl = v_row(p, b, h, l) + d0;
      prefetch_row(v_row(p, b, h, l + kPrefetchKeys) + d0, 16 * S);
      __m512 row[S];
      for (int c = 0; c < S; ++c) row[c] = _mm512_loadu_ps(vl + 16 * c);
      for (int n = 0; n < NQ; ++n) {
        const __m512 w = _mm512_set1_ps(probs[n * p.length + l]);
        for (int c = 0; c < S; ++c) acc[n][c] = _mm512_fmadd_ps(w, row[c], acc[n][c]);
      }
    }
    for (int n = 0; n < NQ; ++n)
      for (int c = 0; c < S; ++c) _mm512_storeu_ps(out + n * p.dim + d0 + 16 * c, acc[n][c]);
  }
}

using OutputFn = void (*)(const Problem&, int64_t, int64_t, int64_t, const float*, float*);

// The register-blocked output kernel for `queries` queries and `dim` dims, or null.
OutputFn pick_output_avx512(int64_t queries, int64_t dim) {
  const int64_t chunks = dim / 16;
  switch (queries) {
    case 1: return chunks % 16 == 0 ? output_avx512<1, 16> : chunks % 8 == 0 ? output_avx512<1, 8>
                 : chunks % 4 == 0 ? output_avx512<1, 4> : output_avx512<1, 1>;
    case 2: return chunks % 8 == 0 ? output_avx512<2, 8> : chunks % 4 == 0 ? output_avx512<2, 4>
                 : output_avx512<2, 1>;
    case 4: return chunks % 4 == 0 ? output_avx512<4, 4> : chunks % 2 == 0 ? output_avx512<4, 2>
                 : output_avx512<4, 1>;
    case 8: return chunks % 2 == 0 ? output_avx512<8, 2> : output_avx512<8, 1>;
    case 16: return output_avx512<16, 1>;
    default: return nullptr;
  }
}

bool has_avx512() {
  static const bool yes = __builtin_cpu_supports("avx512f");
  return yes;
}

// q [B, H, N, D] fp32 (scaled, queries folded group-major: n = group * T + token); k, v [B, L, H, D]
// fp32 with the last dimension contiguous; mask bool [B, T, L]; keys below shared_prefix are the
// same in every row (row 0's are read). Returns fp32 [B, H, N, D].
// Needs AVX-512, D a multiple of 16 and N in {1, 2, 4, 8, 16} (oxygen_ros.models.native.supports).
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const at::Tensor& mask, int64_t shared_prefix) {
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

  TORCH_CHECK(has_avx512(), "decode_attention: this CPU has no AVX-512");
  TORCH_CHECK(p.dim % 16 == 0, "decode_attention: head_dim must be a multiple of 16, got ", p.dim);
  const OutputFn output = pick_output_avx512(p.queries, p.dim);
  TORCH_CHECK(output != nullptr, "decode_attention: queries per K/V head must be 1, 2, 4, 8 or 16, got ",
              p.queries);
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
      scores_avx512(p, r / p.heads, r % p.heads, ends[r / p.heads], s_ptr + r * per_row);
  });
  probs = at::_softmax(probs, -1, false);
  const float* p_ptr = probs.data_ptr<float>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end_row) {
    for (int64_t r = begin; r < end_row; ++r)
      output(p, r / p.heads, r % p.heads, ends[r / p.heads], p_ptr + r * per_row,
             out_ptr + r * p.queries * p.dim);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(oxygen_ros, m) {
  m.def("decode_attention(Tensor q, Tensor k, Tensor v, Tensor mask, int shared_prefix=0) -> Tensor");
}

TORCH_LIBRARY_IMPL(oxygen_ros, CPU, m) {
  m.impl("decode_attention", &decode_attention);
}
