// CPU kernel of the noise stream (contract: philox.h): out[k] = cast(latent + sigma z_k) for num samples, in float32
// until the final cast, written in contiguous or channels_last storage order, multi-threaded over samples with
// ATen's intra-op pool (torch.set_num_threads). The inner loops are branch-free so that GCC vectorises Philox, ln and
// sin; SPLITZ_CLONES (philox_cpu.h) compiles them per ISA.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <type_traits>
#include <vector>

#include "philox_cpu.h"

namespace {

using splitz::kPairBlock;
using splitz::stream_pairs;

// Fewest channels for the channels_last pair path: it stores runs of C contiguous values, which vectorise poorly
// below this; fewer channels go through the permuted store (measured: C = 1 channels_last ran at 0.4x contiguous).
constexpr int64_t kMinPairChannels = 16;

// Both numbers of the Philox pairs first_pair + pair_offset[i] (i < count): z_even[i] = r cos, z_odd[i] = r sin.
SPLITZ_CLONES void table_pairs(uint64_t first_pair, const int32_t* __restrict pair_offset, int64_t count, uint32_t k0,
                               uint32_t k1, float* __restrict z_even, float* __restrict z_odd) {
  uint32_t w0[kPairBlock], w1[kPairBlock], w2[kPairBlock];
  for (int64_t start = 0; start < count; start += kPairBlock) {
    const int64_t block = std::min(kPairBlock, count - start);
    for (int64_t i = 0; i < block; ++i) {
      const uint64_t counter = first_pair + static_cast<uint64_t>(pair_offset[start + i]);
      splitz::philox_words(static_cast<uint32_t>(counter), static_cast<uint32_t>(counter >> 32), k0, k1, w0[i],
                           w1[i], w2[i]);
    }
    for (int64_t i = 0; i < block; ++i) {
      float u1, u2, c, s;
      splitz::box_muller_uniforms(w0[i], w1[i], w2[i], u1, u2);
      const float r = splitz::box_muller_radius(u1);
      splitz::cos_sin_two_pi(u2, c, s);
      z_even[start + i] = r * c;
      z_odd[start + i] = r * s;
    }
  }
}

// The final cast of a float32 value to the output type: bfloat16 travels as its bit pattern (round to nearest even).
template <typename Out>
inline Out to_storage(float value) {
  if constexpr (std::is_same_v<Out, float>) {
    return value;
  } else if constexpr (std::is_same_v<Out, uint16_t>) {
    return splitz::bfloat16_bits(value);
  } else {
    return static_cast<Out>(value);
  }
}

// out[q] = cast(latent[q] + sigma z[q]): the product and the sum are two float32 roundings (no FMA).
template <typename Out>
SPLITZ_CLONES void store_contiguous(const float* __restrict latent, const float* __restrict z, float sigma,
                                    int64_t count, Out* __restrict out) {
  for (int64_t q = 0; q < count; ++q) out[q] = to_storage<Out>(latent[q] + sigma * z[q]);
}

// out[q] = cast(latent[q] + sigma z[index[q]]): storage position q holds the logical element index[q].
template <typename Out>
SPLITZ_CLONES void store_permuted(const float* __restrict latent, const float* __restrict z,
                                  const int32_t* __restrict index, float sigma, int64_t count, Out* __restrict out) {
  for (int64_t q = 0; q < count; ++q) out[q] = to_storage<Out>(latent[q] + sigma * z[index[q]]);
}

// Sample rows [0, num) of the call: row k is z_t for t in [(offset + k) D, (offset + k + 1) D).
//  - contiguous: drawn into a per-thread buffer in logical order (whole Philox pairs, so an odd start skips one
//    number), then stored;
//  - channels_last with H W even (so D is even and rows start on a pair): the logical pair (c, s = 2u), (c, 2u + 1)
//    sits in storage rows 2u and 2u + 1 at channel c, so each pair is drawn once (counter table `pair_offset`, in the
//    order u, c) and both storage rows are written contiguously;
//  - channels_last with H W odd or fewer than kMinPairChannels channels: drawn in logical order, stored through the
//    permutation `index` (one channel: the layouts coincide and the contiguous path runs).
template <typename Out>
void fill(const float* latent_storage, const int32_t* index, const int32_t* pair_offset, int64_t channels,
          int64_t numel, int64_t num, float sigma, uint64_t seed, uint64_t offset, Out* out) {
  const uint32_t k0 = static_cast<uint32_t>(seed), k1 = static_cast<uint32_t>(seed >> 32);
  const int64_t grain = std::max<int64_t>(1, 32768 / numel);  // at least ~32k numbers per task
  at::parallel_for(0, num, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> row(numel + 2);
    for (int64_t k = begin; k < end; ++k) {
      const uint64_t first = (offset + static_cast<uint64_t>(k)) * static_cast<uint64_t>(numel);  // < 2^64 (checked)
      Out* out_row = out + k * numel;
      if (pair_offset != nullptr) {
        const int64_t pairs = numel / 2;
        float* z_even = row.data();
        float* z_odd = row.data() + pairs;
        table_pairs(first >> 1, pair_offset, pairs, k0, k1, z_even, z_odd);
        for (int64_t u = 0; u < pairs / channels; ++u) {
          const int64_t q = 2 * u * channels;
          store_contiguous(latent_storage + q, z_even + u * channels, sigma, channels, out_row + q);
          store_contiguous(latent_storage + q + channels, z_odd + u * channels, sigma, channels, out_row + q + channels);
        }
        continue;
      }
      const uint64_t last = first + static_cast<uint64_t>(numel);  // exclusive
      const uint64_t first_pair = first >> 1;
      const int64_t pairs = static_cast<int64_t>(((last - 1) >> 1) - first_pair) + 1;
      stream_pairs(first_pair, pairs, k0, k1, row.data());
      const float* z = row.data() + (first & 1);
      if (index == nullptr) {
        store_contiguous(latent_storage, z, sigma, numel, out_row);
      } else {
        store_permuted(latent_storage, z, index, sigma, numel, out_row);
      }
    }
  });
}

// Writes num noisy copies of `latent` (float32, contiguous, D elements) into `out` ([num, *latent.shape], dense in
// its memory format): element j of sample k is latent_j + sigma z_t, t = (offset + k) D + j. `channels_last` says
// that out's storage is NHWC for a [C, H, W] latent. The caller checks (offset + num) D <= 2^64.
void noisy_latents(const torch::Tensor& latent, torch::Tensor& out, double sigma, uint64_t seed, uint64_t offset,
                   bool channels_last) {
  TORCH_CHECK(latent.device().is_cpu() && out.device().is_cpu(), "noisy_latents (native CPU): tensors must be on the CPU");
  TORCH_CHECK(latent.scalar_type() == torch::kFloat32 && latent.is_contiguous(),
              "noisy_latents (native CPU): latent must be a contiguous float32 tensor");
  const int64_t numel = latent.numel();
  TORCH_CHECK(numel > 0 && numel < (int64_t{1} << 31) && out.dim() == latent.dim() + 1 &&
                  out.numel() == out.size(0) * numel,
              "noisy_latents (native CPU): out must have shape [num, *latent.shape] (fewer than 2^31 elements per sample)");
  const int64_t num = out.size(0);
  const float* lat = latent.data_ptr<float>();
  std::vector<int32_t> index;  // storage position -> logical element (channels_last, H W odd)
  std::vector<int32_t> pair_offset;  // pair (u, c) -> its Philox counter minus the row's first (channels_last, H W even)
  int64_t channels = 1;
  std::vector<float> latent_storage(lat, lat + numel);  // the latent in storage order
  if (channels_last) {
    TORCH_CHECK(latent.dim() == 3 && out.is_contiguous(at::MemoryFormat::ChannelsLast),
                "noisy_latents (native CPU): channels_last needs a [C, H, W] latent and a channels_last out");
    channels = latent.size(0);
    const int64_t spatial = latent.size(1) * latent.size(2);
    for (int64_t s = 0, q = 0; s < spatial; ++s)
      for (int64_t c = 0; c < channels; ++c, ++q) latent_storage[q] = lat[c * spatial + s];
    if (channels == 1) {
      // one channel: channels_last storage is the contiguous storage, so the contiguous path writes it
    } else if (spatial % 2 == 0 && channels >= kMinPairChannels) {
      pair_offset.resize(numel / 2);
      for (int64_t u = 0, p = 0; u < spatial / 2; ++u)
        for (int64_t c = 0; c < channels; ++c, ++p) pair_offset[p] = static_cast<int32_t>(c * (spatial / 2) + u);
    } else {
      index.resize(numel);
      for (int64_t s = 0, q = 0; s < spatial; ++s)
        for (int64_t c = 0; c < channels; ++c, ++q) index[q] = static_cast<int32_t>(c * spatial + s);
    }
  } else {
    TORCH_CHECK(out.is_contiguous(), "noisy_latents (native CPU): out must be contiguous");
  }
  const int32_t* permutation = index.empty() ? nullptr : index.data();
  const int32_t* pairs = pair_offset.empty() ? nullptr : pair_offset.data();
  const float sig = static_cast<float>(sigma);
  switch (out.scalar_type()) {
    case torch::kFloat32:
      fill(latent_storage.data(), permutation, pairs, channels, numel, num, sig, seed, offset, out.data_ptr<float>());
      break;
    case torch::kBFloat16:
      fill(latent_storage.data(), permutation, pairs, channels, numel, num, sig, seed, offset,
           reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()));
      break;
    case torch::kFloat16:
      fill(latent_storage.data(), permutation, pairs, channels, numel, num, sig, seed, offset, out.data_ptr<at::Half>());
      break;
    default:
      TORCH_CHECK(false, "noisy_latents (native CPU): out must be float32, bfloat16 or float16");
  }
}

// out[c] = cast(max of the four latent[q] + sigma z over one 2x2 window), per channel c: the values of row 2ho
// (q0: w = 2wo from z_even, q0 + C: w = 2wo + 1 from z_odd) and of row 2ho + 1 (q1 likewise). NaN propagates as in
// torch's max_pool2d (a NaN element wins its window).
template <typename Out>
SPLITZ_CLONES void store_pooled(const float* __restrict latent_row0, const float* __restrict latent_row1,
                                const float* __restrict even0, const float* __restrict odd0,
                                const float* __restrict even1, const float* __restrict odd1, float sigma,
                                int64_t channels, Out* __restrict out) {
  for (int64_t c = 0; c < channels; ++c) {
    const float a = latent_row0[c] + sigma * even0[c];
    const float b = latent_row0[channels + c] + sigma * odd0[c];
    const float d = latent_row1[c] + sigma * even1[c];
    const float e = latent_row1[channels + c] + sigma * odd1[c];
    float m = (b > a || b != b) && a == a ? b : a;
    m = (d > m || d != d) && m == m ? d : m;
    m = (e > m || e != e) && m == m ? e : m;
    out[c] = to_storage<Out>(m);
  }
}

// max_pool2d(latent + sigma z, 2) for num samples, channels_last [num, C, H/2, W/2] output (H, W even): the same
// numbers as noisy_latents followed by a 2x2 max pool of stride 2 (the max of float32 values commutes with the final
// rounding to bf16/fp16, which is monotone), in one pass that never writes the full-size batch.
template <typename Out>
void fill_pooled(const float* latent_storage, const int32_t* pair_offset, int64_t channels, int64_t height,
                 int64_t width, int64_t num, float sigma, uint64_t seed, uint64_t offset, Out* out) {
  const uint32_t k0 = static_cast<uint32_t>(seed), k1 = static_cast<uint32_t>(seed >> 32);
  const int64_t numel = channels * height * width, pooled = numel / 4, half_width = width / 2;
  const int64_t grain = std::max<int64_t>(1, 32768 / numel);
  at::parallel_for(0, num, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> row(numel);
    float* z_even = row.data();
    float* z_odd = row.data() + numel / 2;
    for (int64_t k = begin; k < end; ++k) {
      const uint64_t first = (offset + static_cast<uint64_t>(k)) * static_cast<uint64_t>(numel);  // even: W is even
      table_pairs(first >> 1, pair_offset, numel / 2, k0, k1, z_even, z_odd);
      Out* out_row = out + k * pooled;
      for (int64_t ho = 0; ho < height / 2; ++ho) {
        for (int64_t wo = 0; wo < half_width; ++wo) {
          const int64_t u0 = 2 * ho * half_width + wo, u1 = u0 + half_width;  // pair rows (h, w/2) of the window
          store_pooled(latent_storage + 2 * u0 * channels, latent_storage + 2 * u1 * channels,
                       z_even + u0 * channels, z_odd + u0 * channels, z_even + u1 * channels, z_odd + u1 * channels,
                       sigma, channels, out_row + (ho * half_width + wo) * channels);
        }
      }
    }
  });
}

void noisy_latents_maxpool2(const torch::Tensor& latent, torch::Tensor& out, double sigma, uint64_t seed,
                            uint64_t offset) {
  TORCH_CHECK(latent.device().is_cpu() && out.device().is_cpu(),
              "noisy_latents_maxpool2 (native CPU): tensors must be on the CPU");
  TORCH_CHECK(latent.scalar_type() == torch::kFloat32 && latent.is_contiguous() && latent.dim() == 3,
              "noisy_latents_maxpool2 (native CPU): latent must be a contiguous float32 [C, H, W] tensor");
  const int64_t channels = latent.size(0), height = latent.size(1), width = latent.size(2);
  TORCH_CHECK(height % 2 == 0 && width % 2 == 0 && latent.numel() < (int64_t{1} << 31),
              "noisy_latents_maxpool2 (native CPU): H and W must be even");
  TORCH_CHECK(out.dim() == 4 && out.size(1) == channels && out.size(2) == height / 2 && out.size(3) == width / 2 &&
                  out.is_contiguous(at::MemoryFormat::ChannelsLast),
              "noisy_latents_maxpool2 (native CPU): out must be a channels_last [num, C, H/2, W/2] tensor");
  const int64_t spatial = height * width, numel = latent.numel();
  const float* lat = latent.data_ptr<float>();
  std::vector<float> latent_storage(numel);
  for (int64_t s = 0, q = 0; s < spatial; ++s)
    for (int64_t c = 0; c < channels; ++c, ++q) latent_storage[q] = lat[c * spatial + s];
  std::vector<int32_t> pair_offset(numel / 2);
  for (int64_t u = 0, p = 0; u < spatial / 2; ++u)
    for (int64_t c = 0; c < channels; ++c, ++p) pair_offset[p] = static_cast<int32_t>(c * (spatial / 2) + u);
  const int64_t num = out.size(0);
  const float sig = static_cast<float>(sigma);
  switch (out.scalar_type()) {
    case torch::kFloat32:
      fill_pooled(latent_storage.data(), pair_offset.data(), channels, height, width, num, sig, seed, offset,
                  out.data_ptr<float>());
      break;
    case torch::kBFloat16:
      fill_pooled(latent_storage.data(), pair_offset.data(), channels, height, width, num, sig, seed, offset,
                  reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()));
      break;
    case torch::kFloat16:
      fill_pooled(latent_storage.data(), pair_offset.data(), channels, height, width, num, sig, seed, offset,
                  out.data_ptr<at::Half>());
      break;
    default:
      TORCH_CHECK(false, "noisy_latents_maxpool2 (native CPU): out must be float32, bfloat16 or float16");
  }
}

// The words (w0, w1, w2) of the Philox calls at int64 counters (read as uint64), as an int64 [n, 3] tensor: the integer
// half of the contract, for tests against the PyTorch reference and the Triton kernel.
torch::Tensor philox_words(const torch::Tensor& counters, uint64_t seed) {
  TORCH_CHECK(counters.device().is_cpu() && counters.scalar_type() == torch::kInt64 && counters.dim() == 1,
              "philox_words: counters must be a 1-D int64 CPU tensor");
  auto source = counters.contiguous();
  auto words = torch::empty({source.numel(), 3}, source.options());
  const int64_t* c = source.data_ptr<int64_t>();
  int64_t* w = words.data_ptr<int64_t>();
  for (int64_t i = 0; i < source.numel(); ++i) {
    const uint64_t t = static_cast<uint64_t>(c[i]);
    uint32_t w0, w1, w2;
    splitz::philox_words(static_cast<uint32_t>(t), static_cast<uint32_t>(t >> 32), static_cast<uint32_t>(seed),
                         static_cast<uint32_t>(seed >> 32), w0, w1, w2);
    w[3 * i] = w0;
    w[3 * i + 1] = w1;
    w[3 * i + 2] = w2;
  }
  return words;
}

}  // namespace

// The drawing ops release the GIL (they touch no Python object): the sampling engine draws each batch's noise on its
// own worker thread, and a held GIL ran those draws one at a time.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "splitz_fast native CPU kernels (csrc/)";
  m.def("noisy_latents", &noisy_latents, "num noisy copies of a latent from the Philox stream, into out",
        py::call_guard<py::gil_scoped_release>());
  m.def("noisy_latents_maxpool2", &noisy_latents_maxpool2,
        "max_pool2d(noisy latents, 2) in one pass, channels_last, into out", py::call_guard<py::gil_scoped_release>());
  m.def("philox_words", &philox_words, "Philox4x32-10 words (w0, w1, w2) at int64 counters");
}
