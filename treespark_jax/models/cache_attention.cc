// Grouped-query attention of a few query rows over the committed slots of one layer of a
// head-major KV cache, for XLA's CPU backend: an XLA FFI handler that models/cache_attention.py
// compiles, loads and calls. Keys and values are read in place, each batch row's only up to its
// last allowed slot below `extent`, once per kv head for all query rows of its group, so a decode
// step or a verify call costs what its rows have committed rather than the cache's capacity, with
// no copy of the slots it reads.
//
// Operands: q [B, T, H, E] f32 (RoPE applied), k and v [L, B, K, S, E] f32, mask [B, Tm, S] pred
// (Tm = T, or 1: one mask for every query), extent [] s32; attributes `layer` and `threads` (the
// most threads a call may use: the process's cores). Result [B, T, H, E] f32. E must be a multiple
// of 8 and at most 256 (the Python side checks). Slots at and after `extent` are not read; the
// mask must be False there. A query row with no allowed slot gets zeros. Scores and softmax in
// float32, the maximum subtracted before exp.
//
// The loops are written on float vectors (GCC/Clang vector extensions): 16 floats where the CPU has
// AVX-512 and the head width is a multiple of 16 (one 512-bit register), else 8 floats (AVX, or
// NEON pairs on ARM). Scores: three query rows against 8 keys at a time, each row's products as 8
// vectors folded to 8 floats and summed together (`Sums`), each key vector read once for the three
// rows. Outputs: up to six rows held in registers while every value is read once. Work items
// run on XLA's intra-op thread pool (`ffi::ThreadPool`), so a call starts no thread. Measured
// against XLA's attention in docs/cost_model.md.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

typedef float v8 __attribute__((vector_size(32)));
typedef float v16 __attribute__((vector_size(64)));

constexpr float kMasked = -1e30f;  // exp(kMasked - any allowed score) is 0 in float32
constexpr int64_t kMaxWidth = 256;  // E at most
constexpr int64_t kRowChunk = 9;    // query rows of a kv head per work item
constexpr int64_t kMaxThreads = 8;
constexpr int64_t kParallelWork = 4096;  // query rows × slots of a call below which one thread runs it
#ifdef __AVX512F__
constexpr bool kWide = true;  // 16-float vectors where E allows: twice the arithmetic per instruction
#else
constexpr bool kWide = false;  // 16-float vectors would be pairs of registers, and spill
#endif

template <typename V>
inline V Load(const float* p) {
  V x;
  std::memcpy(&x, p, sizeof(x));
  return x;
}

// Lanes of a vector type: 8 or 16.
template <typename V>
constexpr int64_t kLanes = sizeof(V) / sizeof(float);

// A vector's lanes summed pairwise down to 8 floats (the total is kept).
inline v8 Fold(v8 x) { return x; }
inline v8 Fold(v16 x) {
  return __builtin_shufflevector(x, x, 0, 1, 2, 3, 4, 5, 6, 7) +
         __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15);
}

// The sums of 8 vectors: lane j of the result is the sum of the lanes of x[j] (three rounds of
// pairwise shuffles and adds).
inline v8 Sums(const v8* x) {
  v8 b[4], c[2];
  for (int i = 0; i < 4; ++i) {
    b[i] = __builtin_shufflevector(x[2 * i], x[2 * i + 1], 0, 8, 2, 10, 4, 12, 6, 14) +
           __builtin_shufflevector(x[2 * i], x[2 * i + 1], 1, 9, 3, 11, 5, 13, 7, 15);
  }
  for (int i = 0; i < 2; ++i) {
    c[i] = __builtin_shufflevector(b[2 * i], b[2 * i + 1], 0, 1, 8, 9, 4, 5, 12, 13) +
           __builtin_shufflevector(b[2 * i], b[2 * i + 1], 2, 3, 10, 11, 6, 7, 14, 15);
  }
  return __builtin_shufflevector(c[0], c[1], 0, 1, 2, 3, 8, 9, 10, 11) +
         __builtin_shufflevector(c[0], c[1], 4, 5, 6, 7, 12, 13, 14, 15);
}

// The 8 sums (`Sums`) of 8 vectors of any width.
template <typename V>
inline v8 SumsOf(const V* x) {
  v8 folded[8];
  for (int j = 0; j < 8; ++j) folded[j] = Fold(x[j]);
  return Sums(folded);
}

// Scores [R, np] (row-major, np a multiple of 8) of the queries [R, E] (already scaled) against
// keys [n, E], 8 keys at a time: each row's products with them as 8 vectors, summed together.
// E = kC (or c_runtime) vectors of V.
template <typename V, int64_t kC>
void Scores(const float* __restrict queries, const float* __restrict keys, float* __restrict scores, int64_t R,
            int64_t n, int64_t np, int64_t c_runtime) {
  constexpr int64_t W = kLanes<V>;
  const int64_t C = kC ? kC : c_runtime, E = W * C;
  alignas(64) float tail[8 * (kC ? W * kC : kMaxWidth)];
  for (int64_t s0 = 0; s0 < n; s0 += 8) {
    const float* __restrict block = keys + s0 * E;
    if (n - s0 < 8) {  // the last, partial block: zero keys after it (their scores are never read)
      std::fill(tail, tail + 8 * E, 0.0f);
      std::copy(block, block + (n - s0) * E, tail);
      block = tail;
    }
    int64_t r = 0;
    // Three rows share each key read; the rest one at a time. Written out twice on purpose: one template
    // over the row count (a loop over an x[kRows] array) measured 7-13 % slower on 9-row calls here.
    for (; r + 3 <= R; r += 3) {
      const float* __restrict qr = queries + r * E;
      V acc[3][8] = {};
      for (int64_t c = 0; c < C; ++c) {
        const V x0 = Load<V>(qr + W * c), x1 = Load<V>(qr + E + W * c), x2 = Load<V>(qr + 2 * E + W * c);
        for (int64_t j = 0; j < 8; ++j) {
          const V key = Load<V>(block + j * E + W * c);
          acc[0][j] += x0 * key;
          acc[1][j] += x1 * key;
          acc[2][j] += x2 * key;
        }
      }
      for (int64_t i = 0; i < 3; ++i) {
        const v8 sums = SumsOf(acc[i]);
        std::memcpy(scores + (r + i) * np + s0, &sums, sizeof(v8));
      }
    }
    for (; r < R; ++r) {
      const float* __restrict qr = queries + r * E;
      V acc[8] = {};
      for (int64_t c = 0; c < C; ++c) {
        const V x = Load<V>(qr + W * c);
        for (int64_t j = 0; j < 8; ++j) acc[j] += x * Load<V>(block + j * E + W * c);
      }
      const v8 sums = SumsOf(acc);
      std::memcpy(scores + r * np + s0, &sums, sizeof(v8));
    }
  }
}

// The outputs of `rows` ≤ kRows query rows: each row's probabilities [n] (row stride np) times
// the values [n, E], every value read once for all rows; row i is written to `out_row(i)`.
template <typename V, int64_t kC, int64_t kRows, typename OutRow>
inline void WeightedValues(const float* __restrict probs, int64_t np, const float* __restrict values, int64_t n,
                           int64_t c_runtime, int64_t rows, OutRow out_row) {
  constexpr int64_t W = kLanes<V>;
  const int64_t C = kC ? kC : c_runtime;
  V o[kRows][kC ? kC : kMaxWidth / W] = {};
  for (int64_t s = 0; s < n; ++s) {
    const float* __restrict value = values + s * W * C;
    float p[kRows];
    for (int64_t i = 0; i < kRows; ++i) p[i] = i < rows ? probs[i * np + s] : 0.0f;
    for (int64_t c = 0; c < C; ++c) {
      const V x = Load<V>(value + W * c);
      for (int64_t i = 0; i < kRows; ++i) o[i][c] += p[i] * x;
    }
  }
  for (int64_t i = 0; i < rows; ++i) std::memcpy(out_row(i), o[i], W * C * sizeof(float));
}

// Rows first … first + R − 1 of one kv head's group in one batch row (row r = query r / G, head
// h·G + r % G) over the first n slots, on vectors V. kC = E / lanes when it is a common width (the
// feature loops unroll), 0 for any other. Scratch: queries [R, E] and scores [R, np].
template <typename V, int64_t kC>
void HeadAttention(const float* __restrict q, const float* __restrict keys, const float* __restrict values,
                   const bool* __restrict mask, float* __restrict out, int64_t H, int64_t G, int64_t h, int64_t first,
                   int64_t R, int64_t S, int64_t Tm, int64_t n, int64_t c_runtime, float* __restrict queries,
                   float* __restrict scores) {
  constexpr int64_t W = kLanes<V>;
  // output rows held in registers while the values are read: 6 where 24 accumulators hold them
  constexpr int64_t kWideRows = kC && kC <= 4 ? 6 : 3;
  const int64_t C = kC ? kC : c_runtime, E = W * C;
  const int64_t np = (n + 7) / 8 * 8;
  const float scale = 1.0f / std::sqrt(static_cast<float>(E));
  const auto at = [&](int64_t i) { return (((first + i) / G) * H + h * G + (first + i) % G) * E; };
  for (int64_t i = 0; i < R; ++i) {
    for (int64_t e = 0; e < E; ++e) queries[i * E + e] = q[at(i) + e] * scale;
  }
  Scores<V, kC>(queries, keys, scores, R, n, np, C);
  for (int64_t r = 0; r < R; ++r) {  // masked softmax over each row's n slots, in place
    float* __restrict row = scores + r * np;
    const bool* __restrict allowed = mask + (Tm == 1 ? 0 : (first + r) / G) * S;
    float top = kMasked;
    for (int64_t s = 0; s < n; ++s) {
      row[s] = allowed[s] ? row[s] : kMasked;
      top = std::max(top, row[s]);
    }
    float total = 0.0f;
    for (int64_t s = 0; s < n; ++s) {
      row[s] = std::exp(row[s] - top);
      total += row[s];
    }
    // a row with no allowed slot has every score kMasked and so its top too: zeros, not a mean of values
    const float inv = top > kMasked ? 1.0f / total : 0.0f;
    for (int64_t s = 0; s < n; ++s) row[s] *= inv;
  }
  for (int64_t r0 = 0; r0 < R;) {
    const int64_t rows = std::min(R - r0, kWideRows);
    const auto out_row = [&, r0](int64_t i) { return out + at(r0 + i); };
    const auto weighted = rows > 3 ? WeightedValues<V, kC, kWideRows, decltype(out_row)>
                                   : WeightedValues<V, kC, 3, decltype(out_row)>;
    weighted(scores + r0 * np, np, values, n, C, rows, out_row);
    r0 += rows;
  }
}

ffi::Error CacheAttentionImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                              ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::PRED> mask, ffi::Buffer<ffi::S32> extent,
                              ffi::ResultBuffer<ffi::F32> out, int64_t layer, int64_t max_threads) {
  const auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions(), md = mask.dimensions();
  if (qd.size() != 4 || kd.size() != 5 || vd.size() != 5 || md.size() != 3) {
    return ffi::Error::InvalidArgument("cache_attention: q must be [B,T,H,E], k and v [L,B,K,S,E], mask [B,Tm,S]");
  }
  const int64_t B = qd[0], T = qd[1], H = qd[2], E = qd[3];
  const int64_t L = kd[0], KV = kd[2], S = kd[3], Tm = md[1];
  bool same_kv = true;
  for (int i = 0; i < 5; ++i) same_kv = same_kv && kd[i] == vd[i];
  if (!same_kv || kd[1] != B || kd[4] != E || KV == 0 || H % KV != 0 || md[0] != B || md[2] != S ||
      (Tm != T && Tm != 1) || layer < 0 || layer >= L || E % 8 != 0 || E > kMaxWidth) {
    return ffi::Error::InvalidArgument("cache_attention: the shapes of q, k, v and mask or the layer do not agree");
  }
  const int64_t G = H / KV;
  const int64_t n = std::clamp<int64_t>(extent.typed_data()[0], 0, S);
  const int64_t np = std::max<int64_t>((n + 7) / 8 * 8, 8);
  // Work items: (batch row, kv head, a chunk of kRowChunk of its T·G query rows), shared with the
  // pool's threads when the call is large enough to pay for waking them.
  const int64_t chunks = (T * G + kRowChunk - 1) / kRowChunk, items = B * KV * chunks;
  const int64_t threads = B * KV * T * G * n < kParallelWork ? 1 : std::clamp<int64_t>(
      std::min(items, max_threads), 1, kMaxThreads);
  // Each batch row reads only up to its own last allowed slot (rows of a batch commit at different
  // lengths; the extent is the longest one's).
  std::vector<int64_t> row_extent(static_cast<size_t>(B), 0);
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t t = 0; t < Tm; ++t) {
      const bool* allowed = mask.typed_data() + (b * Tm + t) * S;
      int64_t last = n;
      while (last > row_extent[b] && !allowed[last - 1]) --last;
      row_extent[b] = std::max(row_extent[b], last);
    }
  }
  const bool wide = kWide && E % 16 == 0;
  const auto run = wide ? (E == 64 ? HeadAttention<v16, 4> : E == 128 ? HeadAttention<v16, 8> : HeadAttention<v16, 0>)
                        : (E == 64 ? HeadAttention<v8, 8> : E == 128 ? HeadAttention<v8, 16> : HeadAttention<v8, 0>);
  const int64_t C = E / (wide ? 16 : 8);  // vectors per head row
  treespark::ShareItems(pool, items, threads, [&]() {
    return [&, queries = std::vector<float>(static_cast<size_t>(kRowChunk * E)),
            scores = std::vector<float>(static_cast<size_t>(kRowChunk * np))](int64_t item) mutable {
      const int64_t b = item / (KV * chunks), h = item / chunks % KV, first = item % chunks * kRowChunk;
      const int64_t head = ((layer * B + b) * KV + h) * S * E;
      run(q.typed_data() + b * T * H * E, k.typed_data() + head, v.typed_data() + head,
          mask.typed_data() + b * Tm * S, out->typed_data() + b * T * H * E, H, G, h, first,
          std::min(kRowChunk, T * G - first), S, Tm, row_extent[b], C, queries.data(), scores.data());
    };
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(TreesparkCacheAttention, CacheAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // q
                                  .Arg<ffi::Buffer<ffi::F32>>()   // k
                                  .Arg<ffi::Buffer<ffi::F32>>()   // v
                                  .Arg<ffi::Buffer<ffi::PRED>>()  // mask
                                  .Arg<ffi::Buffer<ffi::S32>>()   // extent
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("layer")
                                  .Attr<int64_t>("threads"));
