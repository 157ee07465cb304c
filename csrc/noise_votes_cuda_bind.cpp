// Python binding of the CUDA kernels of noise_votes_cuda.cu (a module of its own, built by
// splitz_fast/kernels/native.py: cuda_module, only where CUDA is available): tensor checks, device guard, the current
// stream, then the raw-pointer launchers of noise_votes_cuda.h. The Python launchers (kernels/noise.py:
// noisy_latents_cuda, kernels/votes.py: count_votes_cuda) check the arguments first; these checks only keep a direct
// call memory-safe.
#include <torch/extension.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <climits>

#include "noise_votes_cuda.h"

namespace {

// Writes num noisy copies of `latent` into `out` ([num, *latent.shape], dense in its memory format; channels_last
// says NHWC storage for a [C, H, W] latent): element j of sample k is latent_j + sigma z_t, t = (offset + k) D + j.
void noisy_latents(const torch::Tensor& latent, torch::Tensor& out, double sigma, uint64_t seed, uint64_t offset,
                   bool channels_last) {
  TORCH_CHECK(latent.is_cuda() && out.is_cuda() && latent.device() == out.device(),
              "noisy_latents (CUDA): latent and out must be on the same CUDA device");
  TORCH_CHECK(latent.scalar_type() == torch::kFloat32 && latent.is_contiguous(),
              "noisy_latents (CUDA): latent must be a contiguous float32 tensor");
  const int64_t numel = latent.numel();
  TORCH_CHECK(numel > 0 && numel <= INT_MAX && out.dim() == latent.dim() + 1 && out.numel() == out.size(0) * numel,
              "noisy_latents (CUDA): out must have shape [num, *latent.shape] (fewer than 2^31 elements per sample)");
  const c10::cuda::CUDAGuard guard(latent.device());
  int64_t channels = 1, spatial = numel;
  torch::Tensor storage = latent;  // the latent in the output's storage order
  if (channels_last) {
    TORCH_CHECK(latent.dim() == 3 && out.is_contiguous(at::MemoryFormat::ChannelsLast),
                "noisy_latents (CUDA): channels_last needs a [C, H, W] latent and a channels_last out");
    channels = latent.size(0);
    spatial = latent.size(1) * latent.size(2);
    storage = latent.permute({1, 2, 0}).contiguous();
  } else {
    TORCH_CHECK(out.is_contiguous(), "noisy_latents (CUDA): out must be contiguous");
  }
  int out_type;
  switch (out.scalar_type()) {
    case torch::kFloat32: out_type = splitz_cuda::kOutFloat32; break;
    case torch::kBFloat16: out_type = splitz_cuda::kOutBFloat16; break;
    case torch::kFloat16: out_type = splitz_cuda::kOutFloat16; break;
    default: TORCH_CHECK(false, "noisy_latents (CUDA): out must be float32, bfloat16 or float16");
  }
  C10_CUDA_CHECK(splitz_cuda::noisy_latents(storage.data_ptr<float>(), out.data_ptr(), out_type, out.size(0), numel,
                                            channels, spatial, channels_last, static_cast<float>(sigma), seed, offset,
                                            c10::cuda::getCurrentCUDAStream()));
}

// counts += bincount(argmax(logits, 1), minlength=C) in place, asynchronously on the current stream; logits may have
// any strides.
void count_votes(const torch::Tensor& logits, torch::Tensor& counts) {
  TORCH_CHECK(logits.is_cuda() && counts.is_cuda() && logits.device() == counts.device(),
              "count_votes (CUDA): logits and counts must be on the same CUDA device");
  TORCH_CHECK(logits.dim() == 2 && counts.dim() == 1 && counts.numel() == logits.size(1) && counts.is_contiguous(),
              "count_votes (CUDA): logits must be [b, C] and counts a contiguous [C]");
  TORCH_CHECK(logits.size(1) > 0 && logits.size(1) <= INT_MAX, "count_votes (CUDA): need 1 <= C < 2^31 classes");
  TORCH_CHECK(counts.scalar_type() == torch::kInt64 || counts.scalar_type() == torch::kInt32,
              "count_votes (CUDA): counts must be int64 or int32");
  int logits_type;
  switch (logits.scalar_type()) {
    case torch::kFloat32: logits_type = splitz_cuda::kLogitsFloat32; break;
    case torch::kFloat64: logits_type = splitz_cuda::kLogitsFloat64; break;
    case torch::kFloat16: logits_type = splitz_cuda::kLogitsFloat16; break;
    case torch::kBFloat16: logits_type = splitz_cuda::kLogitsBFloat16; break;
    default: TORCH_CHECK(false, "count_votes (CUDA): logits must be float32, float64, float16 or bfloat16");
  }
  if (logits.size(0) == 0) return;
  const c10::cuda::CUDAGuard guard(logits.device());
  int sms = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, logits.get_device()));
  C10_CUDA_CHECK(splitz_cuda::count_votes(logits.data_ptr(), logits_type, logits.size(0),
                                          static_cast<int>(logits.size(1)), logits.stride(0), logits.stride(1),
                                          counts.data_ptr(), counts.scalar_type() == torch::kInt64, sms,
                                          c10::cuda::getCurrentCUDAStream()));
}

// The words (w0, w1, w2) of the Philox calls at int64 counters (read as uint64), as an int64 [n, 3] CUDA tensor: the
// device branch of philox.h (__umulhi), for tests against the reference, bit for bit.
torch::Tensor philox_words(const torch::Tensor& counters, uint64_t seed) {
  TORCH_CHECK(counters.is_cuda() && counters.scalar_type() == torch::kInt64 && counters.dim() == 1,
              "philox_words (CUDA): counters must be a 1-D int64 CUDA tensor");
  const c10::cuda::CUDAGuard guard(counters.device());
  auto source = counters.contiguous();
  auto words = torch::empty({source.numel(), 3}, source.options());
  C10_CUDA_CHECK(splitz_cuda::philox_words(source.data_ptr<int64_t>(), source.numel(), seed,
                                           words.data_ptr<int64_t>(), c10::cuda::getCurrentCUDAStream()));
  return words;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "splitz_fast CUDA kernels (csrc/noise_votes_cuda.cu): noise stream and vote counts";
  m.def("noisy_latents", &noisy_latents, "num noisy copies of a latent from the Philox stream, into out (CUDA)");
  m.def("count_votes", &count_votes, "counts += bincount(argmax(logits, 1)) in place (CUDA)");
  m.def("philox_words", &philox_words, "Philox4x32-10 words (w0, w1, w2) at int64 counters (CUDA)");
}
