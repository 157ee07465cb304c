// Launchers of the CUDA kernels of noise_votes_cuda.cu, called by the binding noise_votes_cuda_bind.cpp. The split
// keeps torch's headers out of nvcc's way: the .cu sees only the CUDA runtime and philox.h (it compiles in seconds,
// so CI compiles it on every run), the binding (plain C++) does the tensor checks and passes raw pointers and the
// current stream. Every launcher enqueues on `stream`, never synchronises, and returns the launch's error code.
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>

namespace splitz_cuda {

enum NoiseOut : int { kOutFloat32 = 0, kOutBFloat16 = 1, kOutFloat16 = 2 };
enum VoteLogits : int { kLogitsFloat32 = 0, kLogitsFloat64 = 1, kLogitsFloat16 = 2, kLogitsBFloat16 = 3 };

// out[k] = cast(latent + sigma z_k) for samples k < num of the stream (seed, offset) (contract: philox.h).
// `latent` is float32 in the output's storage order (NHWC for channels_last), `numel` = D < 2^31 elements per
// sample, `channels` and `spatial` are C and H W of a [C, H, W] latent (read only with channels_last), `out` has
// num * D elements of type `out_type`. The caller checks (offset + num) D <= 2^64.
cudaError_t noisy_latents(const float* latent, void* out, int out_type, int64_t num, int64_t numel, int64_t channels,
                          int64_t spatial, bool channels_last, float sigma, uint64_t seed, uint64_t offset,
                          cudaStream_t stream);

// counts[argmax(row)] += 1 for each of the `rows` rows of `logits` ([rows, classes] with element strides stride_r,
// stride_c), ties to the lowest index, NaN as the maximum (torch.argmax). counts: int64 (`counts64`) or int32,
// `classes` bins; `sms`: the device's multiprocessor count (sizes the grid).
cudaError_t count_votes(const void* logits, int logits_type, int64_t rows, int classes, int64_t stride_r,
                        int64_t stride_c, void* counts, bool counts64, int sms, cudaStream_t stream);

// words[3 i .. 3 i + 2] = (w0, w1, w2) of the Philox call at counters[i] (int64 read as uint64) under key `seed`.
cudaError_t philox_words(const int64_t* counters, int64_t n, uint64_t seed, int64_t* words, cudaStream_t stream);

}  // namespace splitz_cuda
