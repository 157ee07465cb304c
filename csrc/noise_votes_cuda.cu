// CUDA kernels of the sampling engine: the noise stream (contract: philox.h and kernels/noise.py) fused with the
// broadcast latent, the cast and the layout, and the vote count (row argmax + histogram). Built, with its binding
// noise_votes_cuda_bind.cpp, as a Python module of its own (splitz_fast/kernels/native.py: cuda_module), separate
// from the CPU extension and only where CUDA is available. No torch header here (see noise_votes_cuda.h).
//
// noisy_latents: one thread per Philox call (the pair z_2i, z_2i+1, both used), where the Triton kernel runs each
// call twice (one element per lane). A launch covers rows (samples) [0, rows) of the output, ceil(D / 2) threads each:
//  - logical order (contiguous out, or channels_last with H W odd): thread i of row k runs the i-th pair that overlaps
//    the row's stream range [t0, t0 + D), t0 = (offset + k) D, and writes the numbers of it that fall into the row
//    (a pair straddling two rows, D odd, is run by both rows, each keeping its half);
//  - channels_last with H W even (D even, so rows start on a pair): thread i = u C + c runs the pair of channel c at
//    spatial positions 2u, 2u + 1, stored at 2u C + c and (2u + 1) C + c: consecutive threads write consecutive
//    channels, so both stores are coalesced.
// Each value is latent + sigma z with both operations rounded to float32 (__fmul_rn / __fadd_rn: no FMA, whatever
// the flags), then cast to the output type (bfloat16 and float16 round to nearest even, as torch). ln, sin, cos and
// sqrt are CUDA's accurate versions (a few float32 ulps); never build this with --use_fast_math.
//
// count_votes: counts[argmax(row)] += 1 for every row, ties to the lowest index, a NaN counting as the maximum (the
// first NaN of a row wins) as torch.argmax. One thread per row for up to 32 classes, one warp per row above (shuffle
// reduction); the votes of a block go to a shared-memory histogram flushed with one atomic per non-empty bin (up to
// 8192 classes; beyond, one global atomic per row).
#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "noise_votes_cuda.h"
#include "philox.h"

namespace splitz_cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kWarp = 32;
constexpr int64_t kMaxThreadsPerLaunch = INT_MAX;  // thread indices stay 32-bit
constexpr int kSharedHistogramBins = 8192;         // 32 KiB of int32 bins per block
constexpr int kThreadPerRowClasses = 32;           // up to this many classes: one thread per row

// ------------------------------------------------------------------------------------------------- noise stream
enum Layout : int { kLogical = 0, kChannelsLastLogical = 1, kChannelsLastPairs = 2 };

template <typename Out>
__device__ __forceinline__ void store(Out* out, uint32_t index, float value) {
  if constexpr (std::is_same_v<Out, float>) {
    out[index] = value;
  } else if constexpr (std::is_same_v<Out, uint16_t>) {  // bfloat16 as its bit pattern
    out[index] = splitz::bfloat16_bits(value);
  } else {
    out[index] = __float2half_rn(value);
  }
}

__device__ __forceinline__ float noisy(float latent, float sigma, float z) {
  return __fadd_rn(latent, __fmul_rn(sigma, z));
}

// z_2p and z_2p+1 of the stream: one Philox call and one Box-Muller transform (philox.h).
__device__ __forceinline__ void stream_pair(uint64_t pair, uint32_t k0, uint32_t k1, float& z_even, float& z_odd) {
  uint32_t w0, w1, w2;
  splitz::philox_words(static_cast<uint32_t>(pair), static_cast<uint32_t>(pair >> 32), k0, k1, w0, w1, w2);
  float u1, u2;
  splitz::box_muller_uniforms(w0, w1, w2, u1, u2);
  const float r2 = __fmul_rn(-2.0f, logf(u1));
  const float r = sqrtf(r2 > 0.0f ? r2 : 0.0f);
  float s, c;
  sincosf(__fmul_rn(6.283185307179586f, u2), &s, &c);
  z_even = __fmul_rn(r, c);
  z_odd = __fmul_rn(r, s);
}

// Rows [0, rows) of one launch; `first` is the stream index of element 0 of row 0 (mod 2^64), `latent` the latent in
// the output's storage order, `channels` and `spatial` C and H W of a [C, H, W] latent (channels_last layouts).
template <typename Out, int kLayout>
__global__ void __launch_bounds__(kThreads) noisy_latents_kernel(
    const float* __restrict__ latent, Out* __restrict__ out, uint32_t rows, uint32_t numel, uint32_t pairs_per_row,
    uint32_t channels, uint32_t spatial, float sigma, uint32_t k0, uint32_t k1, uint64_t first) {
  const uint32_t g = blockIdx.x * kThreads + threadIdx.x;
  const uint32_t k = g / pairs_per_row;
  if (k >= rows) return;
  const uint32_t i = g - k * pairs_per_row;
  const uint64_t t0 = first + static_cast<uint64_t>(k) * numel;
  Out* row = out + static_cast<int64_t>(k) * numel;
  float z_even, z_odd;
  if constexpr (kLayout == kChannelsLastPairs) {
    const uint32_t u = i / channels, c = i - u * channels;
    stream_pair((t0 >> 1) + static_cast<uint64_t>(c) * (spatial / 2) + u, k0, k1, z_even, z_odd);
    const uint32_t q = 2 * u * channels + c;
    store(row, q, noisy(latent[q], sigma, z_even));
    store(row, q + channels, noisy(latent[q + channels], sigma, z_odd));
  } else {
    stream_pair((t0 >> 1) + i, k0, k1, z_even, z_odd);
    const int64_t j = 2 * static_cast<int64_t>(i) - static_cast<int64_t>(t0 & 1);  // the element of z_even
    const float z[2] = {z_even, z_odd};
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int64_t e = j + h;
      if (e < 0 || e >= static_cast<int64_t>(numel)) continue;
      uint32_t q = static_cast<uint32_t>(e);
      if constexpr (kLayout == kChannelsLastLogical) q = (q % spatial) * channels + q / spatial;
      store(row, q, noisy(latent[q], sigma, z[h]));
    }
  }
}

template <typename Out, int kLayout>
cudaError_t launch_noise(const float* latent, Out* out, int64_t num, int64_t numel, int64_t channels, int64_t spatial,
                         float sigma, uint64_t seed, uint64_t offset, cudaStream_t stream) {
  const int64_t pairs_per_row = (numel + 1) / 2;
  const int64_t rows_per_launch = std::max<int64_t>(1, kMaxThreadsPerLaunch / pairs_per_row);
  const uint32_t k0 = static_cast<uint32_t>(seed), k1 = static_cast<uint32_t>(seed >> 32);
  for (int64_t start = 0; start < num; start += rows_per_launch) {
    const int64_t rows = std::min(rows_per_launch, num - start);
    const int64_t threads = rows * pairs_per_row;
    const uint64_t first = (offset + static_cast<uint64_t>(start)) * static_cast<uint64_t>(numel);
    const unsigned blocks = static_cast<unsigned>((threads + kThreads - 1) / kThreads);
    noisy_latents_kernel<Out, kLayout><<<blocks, kThreads, 0, stream>>>(
        latent, out + start * numel, static_cast<uint32_t>(rows), static_cast<uint32_t>(numel),
        static_cast<uint32_t>(pairs_per_row), static_cast<uint32_t>(channels), static_cast<uint32_t>(spatial), sigma,
        k0, k1, first);
    const cudaError_t status = cudaGetLastError();
    if (status != cudaSuccess) return status;
  }
  return cudaSuccess;
}

template <typename Out>
cudaError_t noise_for_layout(int layout, const float* latent, void* out, int64_t num, int64_t numel, int64_t channels,
                             int64_t spatial, float sigma, uint64_t seed, uint64_t offset, cudaStream_t stream) {
  Out* typed = static_cast<Out*>(out);
  switch (layout) {
    case kChannelsLastPairs:
      return launch_noise<Out, kChannelsLastPairs>(latent, typed, num, numel, channels, spatial, sigma, seed, offset,
                                                   stream);
    case kChannelsLastLogical:
      return launch_noise<Out, kChannelsLastLogical>(latent, typed, num, numel, channels, spatial, sigma, seed, offset,
                                                     stream);
    default:
      return launch_noise<Out, kLogical>(latent, typed, num, numel, channels, spatial, sigma, seed, offset, stream);
  }
}

__global__ void philox_words_kernel(const int64_t* __restrict__ counters, int64_t n, uint32_t k0, uint32_t k1,
                                    int64_t* __restrict__ words) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (i >= n) return;
  const uint64_t t = static_cast<uint64_t>(counters[i]);
  uint32_t w0, w1, w2;
  splitz::philox_words(static_cast<uint32_t>(t), static_cast<uint32_t>(t >> 32), k0, k1, w0, w1, w2);
  words[3 * i] = w0;
  words[3 * i + 1] = w1;
  words[3 * i + 2] = w2;
}

// -------------------------------------------------------------------------------------------------- vote counts
template <typename T> __device__ __forceinline__ float widen(T x) { return static_cast<float>(x); }
template <> __device__ __forceinline__ float widen<__half>(__half x) { return __half2float(x); }
template <> __device__ __forceinline__ float widen<__nv_bfloat16>(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ double widen(double x) { return x; }

// Whether (value, index) beats the running best (best, best_index) in torch.argmax's order: a NaN beats every number,
// and the lower index wins among NaNs and among equal values.
template <typename Acc>
__device__ __forceinline__ bool beats(Acc value, int index, Acc best, int best_index) {
  const bool nan = value != value, best_nan = best != best;
  if (nan || best_nan) return nan && (!best_nan || index < best_index);
  return value > best || (value == best && index < best_index);
}

template <typename Acc>
__device__ __forceinline__ void warp_argmax(Acc& best, int& best_index) {
#pragma unroll
  for (int delta = kWarp / 2; delta > 0; delta /= 2) {
    const Acc other = __shfl_down_sync(0xFFFFFFFFu, best, delta);
    const int other_index = __shfl_down_sync(0xFFFFFFFFu, best_index, delta);
    if (beats(other, other_index, best, best_index)) {
      best = other;
      best_index = other_index;
    }
  }
}

template <typename Count>
__device__ __forceinline__ void add_count(Count* counts, int bin, int value) {
  if constexpr (sizeof(Count) == 8) {  // two's complement: unsigned 64-bit addition is int64 addition
    atomicAdd(reinterpret_cast<unsigned long long*>(counts + bin), static_cast<unsigned long long>(value));
  } else {
    atomicAdd(reinterpret_cast<int*>(counts + bin), value);
  }
}

// Rows go to blocks grid-stride; kWarpPerRow: one warp per row (lanes stride over the classes), else one thread per
// row. With kShared each block counts into a shared histogram of `classes` bins first.
template <typename Logit, typename Acc, typename Count, bool kWarpPerRow, bool kShared>
__global__ void __launch_bounds__(kThreads) count_votes_kernel(
    const Logit* __restrict__ logits, int64_t rows, int classes, int64_t stride_r, int64_t stride_c,
    Count* __restrict__ counts) {
  extern __shared__ int histogram[];
  if constexpr (kShared) {
    for (int b = threadIdx.x; b < classes; b += kThreads) histogram[b] = 0;
    __syncthreads();
  }
  constexpr int kRowsPerStep = kWarpPerRow ? kThreads / kWarp : kThreads;
  constexpr int kColumnStep = kWarpPerRow ? kWarp : 1;
  const int lane = kWarpPerRow ? static_cast<int>(threadIdx.x) % kWarp : 0;
  const int slot = kWarpPerRow ? static_cast<int>(threadIdx.x) / kWarp : static_cast<int>(threadIdx.x);
  for (int64_t base = static_cast<int64_t>(blockIdx.x) * kRowsPerStep; base < rows;
       base += static_cast<int64_t>(gridDim.x) * kRowsPerStep) {
    const int64_t row = base + slot;  // the same for the 32 lanes of a warp in warp-per-row mode
    if (row >= rows) continue;
    const Logit* x = logits + row * stride_r;
    Acc best = static_cast<Acc>(-INFINITY);
    int best_index = INT_MAX;
    for (int c = lane; c < classes; c += kColumnStep) {
      const Acc value = widen(x[c * stride_c]);
      if (beats(value, c, best, best_index)) {
        best = value;
        best_index = c;
      }
    }
    if constexpr (kWarpPerRow) warp_argmax(best, best_index);
    if (lane == 0) {
      if constexpr (kShared) {
        atomicAdd(histogram + best_index, 1);
      } else {
        add_count(counts, best_index, 1);
      }
    }
  }
  if constexpr (kShared) {
    __syncthreads();
    for (int b = threadIdx.x; b < classes; b += kThreads) {
      if (histogram[b] != 0) add_count(counts, b, histogram[b]);
    }
  }
}

template <typename Logit, typename Acc, typename Count>
cudaError_t launch_votes(const void* logits, int64_t rows, int classes, int64_t stride_r, int64_t stride_c,
                         void* counts, int sms, cudaStream_t stream) {
  const bool warp_per_row = classes > kThreadPerRowClasses;
  const bool shared = classes <= kSharedHistogramBins;
  const int64_t rows_per_step = warp_per_row ? kThreads / kWarp : kThreads;
  const int64_t blocks = std::min<int64_t>((rows + rows_per_step - 1) / rows_per_step, 4 * int64_t{std::max(sms, 1)});
  const size_t shared_bytes = shared ? sizeof(int) * static_cast<size_t>(classes) : 0;
  const Logit* x = static_cast<const Logit*>(logits);
  Count* c = static_cast<Count*>(counts);
  const dim3 grid(static_cast<unsigned>(blocks));
  if (warp_per_row && shared) {
    count_votes_kernel<Logit, Acc, Count, true, true><<<grid, kThreads, shared_bytes, stream>>>(
        x, rows, classes, stride_r, stride_c, c);
  } else if (warp_per_row) {
    count_votes_kernel<Logit, Acc, Count, true, false><<<grid, kThreads, 0, stream>>>(
        x, rows, classes, stride_r, stride_c, c);
  } else {
    count_votes_kernel<Logit, Acc, Count, false, true><<<grid, kThreads, shared_bytes, stream>>>(
        x, rows, classes, stride_r, stride_c, c);
  }
  return cudaGetLastError();
}

template <typename Logit, typename Acc>
cudaError_t votes_for_counts(const void* logits, int64_t rows, int classes, int64_t stride_r, int64_t stride_c,
                             void* counts, bool counts64, int sms, cudaStream_t stream) {
  return counts64 ? launch_votes<Logit, Acc, int64_t>(logits, rows, classes, stride_r, stride_c, counts, sms, stream)
                  : launch_votes<Logit, Acc, int32_t>(logits, rows, classes, stride_r, stride_c, counts, sms, stream);
}

}  // namespace

cudaError_t noisy_latents(const float* latent, void* out, int out_type, int64_t num, int64_t numel, int64_t channels,
                          int64_t spatial, bool channels_last, float sigma, uint64_t seed, uint64_t offset,
                          cudaStream_t stream) {
  if (num <= 0 || numel <= 0 || numel > INT_MAX) return num == 0 ? cudaSuccess : cudaErrorInvalidValue;
  const int layout = !channels_last ? kLogical : (spatial % 2 == 0 ? kChannelsLastPairs : kChannelsLastLogical);
  switch (out_type) {
    case kOutFloat32:
      return noise_for_layout<float>(layout, latent, out, num, numel, channels, spatial, sigma, seed, offset, stream);
    case kOutBFloat16:
      return noise_for_layout<uint16_t>(layout, latent, out, num, numel, channels, spatial, sigma, seed, offset,
                                        stream);
    case kOutFloat16:
      return noise_for_layout<__half>(layout, latent, out, num, numel, channels, spatial, sigma, seed, offset, stream);
    default:
      return cudaErrorInvalidValue;
  }
}

cudaError_t count_votes(const void* logits, int logits_type, int64_t rows, int classes, int64_t stride_r,
                        int64_t stride_c, void* counts, bool counts64, int sms, cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  if (rows < 0 || classes <= 0) return cudaErrorInvalidValue;
  switch (logits_type) {
    case kLogitsFloat32:
      return votes_for_counts<float, float>(logits, rows, classes, stride_r, stride_c, counts, counts64, sms, stream);
    case kLogitsFloat64:
      return votes_for_counts<double, double>(logits, rows, classes, stride_r, stride_c, counts, counts64, sms, stream);
    case kLogitsFloat16:
      return votes_for_counts<__half, float>(logits, rows, classes, stride_r, stride_c, counts, counts64, sms, stream);
    case kLogitsBFloat16:
      return votes_for_counts<__nv_bfloat16, float>(logits, rows, classes, stride_r, stride_c, counts, counts64, sms,
                                                    stream);
    default:
      return cudaErrorInvalidValue;
  }
}

cudaError_t philox_words(const int64_t* counters, int64_t n, uint64_t seed, int64_t* words, cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  philox_words_kernel<<<static_cast<unsigned>((n + kThreads - 1) / kThreads), kThreads, 0, stream>>>(
      counters, n, static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32), words);
  return cudaGetLastError();
}

}  // namespace splitz_cuda
