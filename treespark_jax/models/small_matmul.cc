// Products of a few rows with a weight matrix, for XLA's CPU backend: an XLA FFI handler that
// models/small_matmul.py compiles, loads and calls. A decode step or a verify call multiplies 1 to
// a few dozen rows by every weight matrix of the target, so its cost is reading the weights once
// from memory; XLA's CPU matmuls read them at a fraction of the memory's speed for two or more rows
// (docs/cost_model.md). The weights come packed in column tiles, so every tile is one contiguous run
// of memory read front to back, and each weight is read once for up to kRowBlock rows.
//
// Operands: x [M, K] f32, w [J, K, 32] f32 (tile j holds columns 32j .. 32j + 31 of a [K, 32J]
// matrix, row by row: small_matmul.pack); attribute `threads` (the most threads a call may use).
// Result [M, 32J] f32 = x · W. Each output is summed over k in order, one fused multiply-add per k,
// whatever M and the threads: a row's result does not depend on the rows beside it.
//
// Runs of tiles are work items shared with helpers on XLA's intra-op pool (cpu_parallel.h).

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "cpu_parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

typedef float v16 __attribute__((vector_size(64)));  // 16 floats (two 8-float halves without AVX-512)

constexpr int64_t kTile = 32;          // columns per packed tile: two vectors
constexpr int64_t kRowBlock = 8;       // rows whose 16 accumulators are held while a tile is read
constexpr int64_t kMaxThreads = 8;
constexpr int64_t kParallelWork = 1 << 18;  // weights (K·N) of a call below which one thread runs it
constexpr int64_t kItemWeights = 1 << 16;   // weights per work item, about (whole tiles)
constexpr int64_t kRowChunk = 2048;          // rows multiplied together (a prefill's x read from the cache)

inline v16 Load(const float* p) {
  v16 x;
  std::memcpy(&x, p, sizeof(x));
  return x;
}

inline void Store(float* p, v16 x) { std::memcpy(p, &x, sizeof(x)); }

// y[r, 0:32] = x[r, :] · tile for R rows (row strides K and N).
template <int R>
void TileRows(const float* __restrict x, int64_t K, const float* __restrict tile, float* __restrict y, int64_t N) {
  v16 acc[R][2] = {};
  for (int64_t k = 0; k < K; ++k) {
    const v16 w0 = Load(tile + k * kTile), w1 = Load(tile + k * kTile + 16);
    for (int r = 0; r < R; ++r) {
      const float xr = x[r * K + k];
      acc[r][0] += xr * w0;
      acc[r][1] += xr * w1;
    }
  }
  for (int r = 0; r < R; ++r) {
    Store(y + r * N, acc[r][0]);
    Store(y + r * N + 16, acc[r][1]);
  }
}

using TileFn = void (*)(const float*, int64_t, const float*, float*, int64_t);
constexpr TileFn kTileFns[kRowBlock + 1] = {nullptr,     TileRows<1>, TileRows<2>, TileRows<3>, TileRows<4>,
                                            TileRows<5>, TileRows<6>, TileRows<7>, TileRows<8>};

ffi::Error PackedMatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                            ffi::ResultBuffer<ffi::F32> y, int64_t max_threads) {
  const auto xd = x.dimensions(), wd = w.dimensions(), yd = y->dimensions();
  if (xd.size() != 2 || wd.size() != 3 || yd.size() != 2 || wd[2] != kTile || wd[1] != xd[1] || yd[0] != xd[0] ||
      yd[1] != wd[0] * kTile) {
    return ffi::Error::InvalidArgument("small_matmul: x must be [M,K], w [J,K,32] and the result [M,32J]");
  }
  const int64_t M = xd[0], K = xd[1], J = wd[0], N = J * kTile;
  if (M == 0 || J == 0) return ffi::Error::Success();
  if (K == 0) {
    std::fill(y->typed_data(), y->typed_data() + M * N, 0.0f);
    return ffi::Error::Success();
  }
  const float* xs = x.typed_data();
  const float* ws = w.typed_data();
  float* ys = y->typed_data();
  const int64_t per_item = std::max<int64_t>(1, kItemWeights / (K * kTile));  // tiles per work item
  const int64_t items = (J + per_item - 1) / per_item;
  const int64_t threads =
      K * N < kParallelWork ? 1 : std::clamp<int64_t>(std::min(items, max_threads), 1, kMaxThreads);
  // Rows in chunks of kRowChunk, one after the other: each work item reads its chunk of x once per
  // tile, and a chunk stays in the cache where a whole prefill's x would be read from memory.
  for (int64_t r0 = 0; r0 < M; r0 += kRowChunk) {
    const int64_t r1 = std::min(M, r0 + kRowChunk);
    treespark::ShareItems(pool, items, threads, [=]() {
      return [=](int64_t item) {
        for (int64_t j = item * per_item; j < std::min(J, (item + 1) * per_item); ++j) {
          for (int64_t r = r0; r < r1; r += kRowBlock) {
            kTileFns[std::min(kRowBlock, r1 - r)](xs + r * K, K, ws + j * K * kTile, ys + r * N + j * kTile, N);
          }
        }
      };
    });
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(TreesparkPackedMatmul, PackedMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x
                                  .Arg<ffi::Buffer<ffi::F32>>()  // w, packed
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("threads"));
