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
// NEON pairs on ARM). A work item is a chunk of at most 32 query rows of one kv head over a range of
// its slots, which it reads in blocks with the online softmax; items whose ranges split a row's slots
// are merged by the thread that finishes the last of them (flash-decoding). Scores of a few rows (a
// decode step) are dot products, three rows against 8 keys at a time summed across lanes (`Sums`);
// of 16 or more rows (a verify call) they are outer products with the rows in the lanes
// (`LaneScores`), and their softmax runs across those lanes with a polynomial exp (`Exp16`).
// Outputs: up to six rows held in registers while every value is read once. Each block's values
// are prefetched while its scores are computed, and the next block's keys while its values are
// read. Work items run on XLA's intra-op thread pool (`ffi::ThreadPool`), so a call starts no
// thread. Measured against XLA's attention in docs/cost_model.md.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "cpu_parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

typedef float v8 __attribute__((vector_size(32)));
typedef float v16 __attribute__((vector_size(64)));

constexpr float kMasked = -1e30f;  // exp(kMasked - any allowed score) is 0 in float32
constexpr int64_t kMaxWidth = 256;  // E at most
constexpr int64_t kLaneRows = 32;   // most query rows of a kv head per work item: each key read once for them
constexpr int64_t kKeyBlock = 256;  // slots per block of the online softmax: a block's scores stay in L1
constexpr int64_t kSplitKeys = 64;  // fewest slots of a work item when a row's slots are split between threads
constexpr int64_t kMinChunkRows = 8;  // fewest query rows of a work item when a kv head's rows are split
constexpr int64_t kMaxThreads = 8;
constexpr int64_t kItemsPerThread = 4;  // work items a thread enough to share a call evenly
constexpr int64_t kMaxSplits = kItemsPerThread * kMaxThreads;  // ranges of a row at most
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

// Query row r of kv head h's group (query r / G, head h·G + r % G): its offset in q or the result
// [T, H, E] of one batch row.
inline int64_t RowOffset(int64_t r, int64_t G, int64_t H, int64_t h, int64_t E) {
  return ((r / G) * H + h * G + r % G) * E;
}

// Uninitialised scratch memory (a std::vector would zero it on every call).
inline std::unique_ptr<float[]> Scratch(int64_t n) { return std::unique_ptr<float[]>(new float[n]); }

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

// Scores [n, kLaneRows] (key-major: lane i of a key's row is query row i) of the transposed queries
// qt [E, kLaneRows] (already scaled; rows past the item's are zero) against keys [n, E], 8 keys at a
// time on 16-float vectors: each key feature broadcast against the rows' vectors of that feature, no
// horizontal sums. The values [n, E] beside the keys are prefetched as the keys are read.
void LaneScores(const float* __restrict qt, const float* __restrict keys, float* __restrict scores, int64_t n,
                int64_t E, const float* values) {
  using V = v16;
  constexpr int64_t W = kLanes<V>, NV = kLaneRows / W;
  alignas(64) float tail[8 * kMaxWidth];
  for (int64_t s0 = 0; s0 < n; s0 += 8) {
    const float* __restrict block = keys + s0 * E;
    for (int64_t b = 0; b < std::min<int64_t>(8, n - s0) * E; b += 16) __builtin_prefetch(values + s0 * E + b);
    if (n - s0 < 8) {  // the last, partial block: zero keys after it (their scores are never read)
      std::fill(tail, tail + 8 * E, 0.0f);
      std::copy(block, block + (n - s0) * E, tail);
      block = tail;
    }
    V acc[8][NV] = {};
    for (int64_t e = 0; e < E; ++e) {
      V x[NV];
      for (int64_t v = 0; v < NV; ++v) x[v] = Load<V>(qt + e * kLaneRows + v * W);
      for (int64_t j = 0; j < 8; ++j) {
        for (int64_t v = 0; v < NV; ++v) acc[j][v] += block[j * E + e] * x[v];
      }
    }
    float* __restrict out = scores + s0 * kLaneRows;
    for (int64_t j = 0; j < 8; ++j) {
      for (int64_t v = 0; v < NV; ++v) std::memcpy(out + j * kLaneRows + v * W, &acc[j][v], sizeof(V));
    }
  }
}

// Adds to the outputs o [rows, E] (row-major) of `rows` ≤ kRows query rows, each first scaled by its
// alpha, the probabilities p(i, s) = probs[i·row_stride + s·key_stride] of row i at slot s times the
// values [n, E], every value read once for all rows; `ahead` (the next block's keys [n, E], or null)
// is prefetched as the values are read.
template <typename V, int64_t kC, int64_t kRows>
inline void WeightedValues(const float* __restrict probs, int64_t row_stride, int64_t key_stride,
                           const float* __restrict values, int64_t n, int64_t c_runtime, int64_t rows,
                           const float* __restrict alpha, float* __restrict o, const float* ahead) {
  constexpr int64_t W = kLanes<V>;
  const int64_t C = kC ? kC : c_runtime, E = W * C;
  V acc[kRows][kC ? kC : kMaxWidth / W] = {};
  for (int64_t i = 0; i < rows; ++i) {
    for (int64_t c = 0; c < C; ++c) acc[i][c] = alpha[i] * Load<V>(o + i * E + W * c);
  }
  for (int64_t s = 0; s < n; ++s) {
    const float* __restrict value = values + s * E;
    if (ahead) {
      for (int64_t b = 0; b < E; b += 16) __builtin_prefetch(ahead + s * E + b);
    }
    float p[kRows];
    for (int64_t i = 0; i < kRows; ++i) p[i] = i < rows ? probs[i * row_stride + s * key_stride] : 0.0f;
    for (int64_t c = 0; c < C; ++c) {
      const V x = Load<V>(value + W * c);
      for (int64_t i = 0; i < kRows; ++i) acc[i][c] += p[i] * x;
    }
  }
  for (int64_t i = 0; i < rows; ++i) std::memcpy(o + i * E, acc[i], E * sizeof(float));
}

// The online-softmax step of one row over a block's n scores: masked slots set to kMasked, then
// exp(score − new maximum) in place; updates the row's m and l and sets alpha = exp(m_old − m_new),
// the factor its outputs so far are rescaled by. While no allowed slot is seen m stays kMasked and
// exp(0) = 1 counts masked slots; the first allowed one makes alpha exp(kMasked − score) = 0, which
// drops them.
inline void SoftmaxStep(float* __restrict row, const bool* __restrict allowed, int64_t n, float& m, float& l,
                        float& alpha) {
  // separate loops: GCC leaves a fused select-and-maximum loop scalar
  for (int64_t s = 0; s < n; ++s) row[s] = allowed[s] ? row[s] : kMasked;
  float top = m;
  for (int64_t s = 0; s < n; ++s) top = std::max(top, row[s]);
  float total = 0.0f;
  for (int64_t s = 0; s < n; ++s) {
    row[s] = std::exp(row[s] - top);
    total += row[s];
  }
  alpha = std::exp(m - top);
  l = l * alpha + total;
  m = top;
}

// exp(x) of 16 floats x ≤ 0 (scores less their maximum): 2^k · e^r with k = round(x / ln 2) and r =
// x − k ln 2 (ln 2 in two parts), e^r by the degree-7 polynomial of Cephes' expf (S. Moshier; relative
// error about 1e-7 on |r| ≤ ln 2 / 2); 0 below −87, where float32's exp leaves the normal range.
inline v16 Exp16(v16 x) {
  typedef int32_t i16 __attribute__((vector_size(64)));
  const v16 clamped = x < -87.0f ? -87.0f : x;
  const i16 k = __builtin_convertvector(clamped * 1.44269504089f - 0.5f, i16);  // x ≤ 0: truncation rounds
  const v16 kf = __builtin_convertvector(k, v16);
  const v16 r = clamped - kf * 0.693359375f + kf * 2.12194440e-4f;
  v16 poly = 1.9875691500e-4f * r + 1.3981999507e-3f;
  poly = poly * r + 8.3334519073e-3f;
  poly = poly * r + 4.1665795894e-2f;
  poly = poly * r + 1.6666665459e-1f;
  poly = poly * r + 5.0000001201e-1f;
  const v16 e = poly * r * r + r + 1.0f;
  const i16 bits = (k + 127) << 23;  // 2^k as a float's exponent field
  v16 scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return x < -87.0f ? 0.0f : e * scale;
}

// The online-softmax step of kLaneRows rows at once over a block's key-major scores [n, kLaneRows]
// (`LaneScores`, masked slots already kMasked), on 16-float vectors across the rows' lanes; as
// `SoftmaxStep`.
inline void LaneSoftmaxStep(float* __restrict scores, int64_t n, float* __restrict m, float* __restrict l,
                            float* __restrict alpha) {
  constexpr int64_t NV = kLaneRows / 16;
  v16 top[NV], total[NV] = {};
  for (int64_t v = 0; v < NV; ++v) top[v] = Load<v16>(m + 16 * v);
  for (int64_t s = 0; s < n; ++s) {
    for (int64_t v = 0; v < NV; ++v) {
      const v16 x = Load<v16>(scores + s * kLaneRows + 16 * v);
      top[v] = x > top[v] ? x : top[v];
    }
  }
  for (int64_t s = 0; s < n; ++s) {
    for (int64_t v = 0; v < NV; ++v) {
      const v16 p = Exp16(Load<v16>(scores + s * kLaneRows + 16 * v) - top[v]);
      std::memcpy(scores + s * kLaneRows + 16 * v, &p, sizeof(p));
      total[v] += p;
    }
  }
  for (int64_t v = 0; v < NV; ++v) {
    const v16 factor = Exp16(Load<v16>(m + 16 * v) - top[v]), sum = Load<v16>(l + 16 * v) * factor + total[v];
    std::memcpy(alpha + 16 * v, &factor, sizeof(factor));
    std::memcpy(l + 16 * v, &sum, sizeof(sum));
    std::memcpy(m + 16 * v, &top[v], sizeof(top[v]));
  }
}

// One work item: rows first … first + R − 1 of one kv head's group in one batch row (row r = query
// r / G, head h·G + r % G) over slots [begin, end), on vectors V, in blocks of kKeyBlock slots with
// the online softmax (Milakov & Gimelshein 2018, as FlashAttention and flash-decoding use it): per
// row the running maximum m, the sum l of exp(score − m) and the outputs o = Σ exp(score − m)·value,
// rescaled by exp(m_old − m_new) when the maximum grows. Writes m [R], l [R] and o [R, E]; the
// caller merges the slot ranges of a row. Scores are row-major dot products (`Scores`) for a few
// rows, and key-major (`LaneScores`) for kLaneRows / 2 or more rows on 16-float vectors, where
// horizontal sums would cost as much as the products. kC = E / lanes when it is a common width (the
// feature loops unroll), 0 for any other. Scratch: queries [kLaneRows, E], scores [kLaneRows,
// kKeyBlock], and m, l and alpha [kLaneRows].
template <typename V, int64_t kC>
void RangeAttention(const float* __restrict q, const float* __restrict keys, const float* __restrict values,
                    const bool* __restrict mask, int64_t H, int64_t G, int64_t h, int64_t first, int64_t R, int64_t S,
                    int64_t Tm, int64_t begin, int64_t end, int64_t c_runtime, float* __restrict m_out,
                    float* __restrict l_out, float* __restrict o, float* __restrict queries,
                    float* __restrict scores, float* __restrict m, float* __restrict l, float* __restrict alpha) {
  constexpr int64_t W = kLanes<V>;
  // output rows held in registers while the values are read: 6 where 24 accumulators hold them
  constexpr int64_t kWideRows = kC && kC <= 4 ? 6 : 3;
  const int64_t C = kC ? kC : c_runtime, E = W * C;
  const bool lanes = W == 16 && 2 * R >= kLaneRows;
  const float scale = 1.0f / std::sqrt(static_cast<float>(E));
  const auto query_mask = [&](int64_t t) { return mask + (Tm == 1 ? 0 : t) * S; };  // query t's slots
  std::fill(queries, queries + kLaneRows * E, 0.0f);
  for (int64_t i = 0; i < R; ++i) {  // [R, E], or transposed [E, kLaneRows] for LaneScores
    const float* __restrict row = q + RowOffset(first + i, G, H, h, E);
    for (int64_t e = 0; e < E; ++e) queries[lanes ? e * kLaneRows + i : i * E + e] = row[e] * scale;
  }
  std::fill(m, m + kLaneRows, kMasked);
  std::fill(l, l + kLaneRows, 0.0f);
  std::fill(o, o + R * E, 0.0f);
  // slots per block: kKeyBlock for LaneScores, as many as the scores scratch holds for R rows for
  // Scores (a decode step's few rows read each range's keys, then its values, in one run each)
  const int64_t block = lanes ? kKeyBlock : kLaneRows * kKeyBlock / R / 8 * 8;
  for (int64_t s0 = begin; s0 < end; s0 += block) {
    const int64_t n = std::min(block, end - s0), np = (n + 7) / 8 * 8;
    // probabilities of row i at slot s: scores[i * row_stride + s * key_stride]
    const int64_t row_stride = lanes ? 1 : np, key_stride = lanes ? kLaneRows : 1;
    if (lanes) {
      LaneScores(queries, keys + s0 * E, scores, n, E, values + s0 * E);
      // kMasked where a row's query masks a slot: first the slots some query of the chunk masks (a
      // verify's tree, a batch row's padding), in a loop GCC vectorises, then those slots' rows
      unsigned char masked[kKeyBlock] = {};
      for (int64_t t = first / G; t <= (first + R - 1) / G; ++t) {
        const bool* __restrict row = query_mask(t) + s0;
        for (int64_t s = 0; s < n; ++s) masked[s] |= static_cast<unsigned char>(!row[s]);
      }
      for (int64_t s = 0; s < n; ++s) {
        for (int64_t r = 0; r < R && masked[s]; ++r) {
          if (!query_mask((first + r) / G)[s0 + s]) scores[s * kLaneRows + r] = kMasked;
        }
      }
      LaneSoftmaxStep(scores, n, m, l, alpha);
    } else {
      Scores<V, kC>(queries, keys + s0 * E, scores, R, n, np, C);
      for (int64_t r = 0; r < R; ++r) {
        SoftmaxStep(scores + r * np, query_mask((first + r) / G) + s0, n, m[r], l[r], alpha[r]);
      }
    }
    for (int64_t r0 = 0; r0 < R;) {
      const int64_t rows = std::min(R - r0, kWideRows);
      const auto weighted = rows > 3 ? WeightedValues<V, kC, kWideRows> : WeightedValues<V, kC, 3>;
      const float* ahead = r0 == 0 && s0 + block < end ? keys + (s0 + block) * E : nullptr;
      weighted(scores + r0 * row_stride, row_stride, key_stride, values + s0 * E, n, C, rows, alpha + r0,
               o + r0 * E, ahead);
      r0 += rows;
    }
  }
  std::copy(m, m + R, m_out);
  std::copy(l, l + R, l_out);
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
  // Work items: (batch row, kv head, a chunk of at most kLaneRows of its T·G query rows, a range of
  // its slots). Where the items would not share evenly between the threads (a multiple of them, or
  // kItemsPerThread a thread), a group (batch row, kv head, chunk) splits its slots into ranges of at least
  // kSplitKeys, or else its rows into smaller chunks of at least kMinChunkRows, one more at a time.
  const int64_t R = T * G, threads = B * KV * R * n < kParallelWork ? 1 : std::clamp<int64_t>(max_threads, 1, kMaxThreads);
  int64_t chunks = (R + kLaneRows - 1) / kLaneRows, splits = 1;
  for (;;) {
    const int64_t items = B * KV * chunks * splits;
    if (items % threads == 0 || items >= kItemsPerThread * threads) break;
    if ((splits + 1) * kSplitKeys <= n) {
      ++splits;
    } else if (R / (chunks + 1) >= kMinChunkRows) {
      ++chunks;
    } else {
      break;
    }
  }
  const int64_t rows = (R + chunks - 1) / chunks, groups = B * KV * chunks, items = groups * splits;
  const bool wide = kWide && E % 16 == 0;
  const auto run = wide ? (E == 64 ? RangeAttention<v16, 4> : E == 128 ? RangeAttention<v16, 8> : RangeAttention<v16, 0>)
                        : (E == 64 ? RangeAttention<v8, 8> : E == 128 ? RangeAttention<v8, 16> : RangeAttention<v8, 0>);
  const int64_t C = E / (wide ? 16 : 8);  // vectors per head row
  // Each item's m [rows], l [rows] and o [rows, E], for the merge.
  const auto part_m = Scratch(items * rows), part_l = Scratch(items * rows), part_o = Scratch(items * rows * E);
  const auto span = [&](int64_t b, int64_t split) {  // slots [begin, end) of a split of row b's slots, 8-aligned
    const int64_t step = (row_extent[b] + splits * 8 - 1) / (splits * 8) * 8;
    return std::pair<int64_t, int64_t>{std::min(split * step, row_extent[b]), std::min((split + 1) * step, row_extent[b])};
  };
  // The items of a group still running; the one that finishes a group merges its ranges: o = Σ o_i·exp(m_i
  // − M) / Σ l_i·exp(m_i − M) per row, M the largest m_i. A row with no allowed slot has every m_i =
  // kMasked (so M too): zeros, not a mean of values.
  struct Group {
    int64_t b, h, first, rows;  // batch row, kv head, first query row of the chunk, its rows
  };
  const auto group_of = [&](int64_t group) {
    const int64_t first = group % chunks * rows;
    return Group{group / (KV * chunks), group / chunks % KV, first, std::min(rows, R - first)};
  };
  const auto pending = std::make_unique<std::atomic<int64_t>[]>(groups);
  for (int64_t group = 0; group < groups; ++group) pending[group] = splits;
  const auto merge = [&](int64_t group) {
    const Group g = group_of(group);
    for (int64_t i = 0; i < g.rows; ++i) {
      const int64_t at = group * splits * rows + i;  // this row's entry of the group's first item
      float top = kMasked, total = 0.0f, weight[kMaxSplits];
      for (int64_t j = 0; j < splits; ++j) top = std::max(top, part_m[at + j * rows]);
      for (int64_t j = 0; j < splits; ++j) {
        weight[j] = std::exp(part_m[at + j * rows] - top);
        total += weight[j] * part_l[at + j * rows];
      }
      const float inv = top > kMasked ? 1.0f / total : 0.0f;
      float* __restrict dst = out->typed_data() + g.b * T * H * E + RowOffset(g.first + i, G, H, g.h, E);
      std::fill(dst, dst + E, 0.0f);
      for (int64_t j = 0; j < splits; ++j) {
        const float* __restrict o = part_o.get() + (at + j * rows) * E;
        for (int64_t e = 0; e < E; ++e) dst[e] += weight[j] * inv * o[e];
      }
    }
  };
  treespark::ShareItems(pool, items, std::min(threads, items), [&]() {
    return [&, queries = Scratch(kLaneRows * E), scores = Scratch(kLaneRows * kKeyBlock),
            running = Scratch(3 * kLaneRows)](int64_t item) mutable {
      const int64_t group = item / splits;
      const Group g = group_of(group);
      const int64_t head = ((layer * B + g.b) * KV + g.h) * S * E;
      const auto [begin, end] = span(g.b, item % splits);
      run(q.typed_data() + g.b * T * H * E, k.typed_data() + head, v.typed_data() + head,
          mask.typed_data() + g.b * Tm * S, H, G, g.h, g.first, g.rows, S, Tm, begin, end, C,
          part_m.get() + item * rows, part_l.get() + item * rows, part_o.get() + item * rows * E,
          queries.get(), scores.get(), running.get(), running.get() + kLaneRows,
          running.get() + 2 * kLaneRows);
      if (--pending[group] == 0) merge(group);
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
