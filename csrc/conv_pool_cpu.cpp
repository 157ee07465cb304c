// CPU kernel of conv_relu_maxpool2 (kernels/conv_relu_pool.py) for thin inputs: maxpool2(relu(conv2d(x) + b)) of a
// stride-1 convolution whose reduction C_in·KH·KW is short (a first layer: LeNet's 1 channel x 3x3), where oneDNN's
// convolution runs at a small fraction of its speed on wider inputs and writes a full-size output that the pool then
// reads back. Here each pooled output pixel keeps four accumulators per block of output channels (one per position of
// the 2x2 window) in registers, and only the pooled activation is written, channels_last, once.
//
// Why the epilogue order is the same function: for a bias constant over a channel, max_q(v_q) + b = max_q(v_q + b)
// and relu is monotone, so maxpool(relu(conv(x) + b)) = relu(maxpool(conv(x)) + b), exactly on the float32
// accumulators (rounding fl(v + b) is monotone in v). NaN propagates through the maximum and the ReLU, as in the
// eager chain. Products and sums are float32 (bf16 operands are widened, which is exact, and the result is rounded
// to bf16 once), so results agree with the eager chain within the rounding of a reordered float32 sum.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cstring>
#include <type_traits>
#include <vector>

#include "philox_cpu.h"  // SPLITZ_CLONES and bfloat16_bits

namespace {

// Output channels per accumulator block: 4 window positions x 2 vectors of 16 float32 = 8 AVX-512 registers. The
// packed weight and bias are zero-padded to whole blocks, so every block runs the same straight-line code.
constexpr int64_t kBlock = 32;

// 16 float32 lanes as a GCC vector: one AVX-512 register in the x86-64-v4 clone, two AVX2 or four SSE ones in the
// others (the compiler lowers the type per target). The multiply-adds are written out on it because the loop
// vectoriser kept the accumulators in memory (about a tenth of the FMA rate); the epilogue stays a plain loop, which
// the vectoriser turns into masked compares and blends (GCC scalarises a select of a select on this type in a
// target clone).
typedef float Lanes __attribute__((vector_size(64)));
constexpr int64_t kLanes = 16;
static_assert(kBlock == 2 * kLanes, "a block is two vectors");

inline Lanes load(const float* p) {
  Lanes v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// The larger of a and m, NaN winning (std::max and fmax would drop it).
inline float max_nan(float a, float m) { return (a > m || a != a) ? a : m; }

template <typename In>
inline float widen(In value) {
  if constexpr (std::is_same_v<In, float>) {
    return value;
  } else {
    const uint32_t bits = static_cast<uint32_t>(value) << 16;  // bfloat16 bits: the upper half of a float32
    float out;
    std::memcpy(&out, &bits, sizeof out);
    return out;
  }
}

template <typename Out>
inline Out narrow(float value) {
  if constexpr (std::is_same_v<Out, float>) {
    return value;
  } else {
    return splitz::bfloat16_bits(value);
  }
}

// Channel j of a pooled pixel: the window's maximum, then the bias, then the ReLU (NaN stays NaN: NaN < 0 is false),
// rounded to the output type once.
template <typename Out>
inline Out pooled_relu(const float (&acc)[4][kBlock], const float* __restrict bias, int64_t j) {
  const float v = max_nan(acc[3][j], max_nan(acc[2][j], max_nan(acc[1][j], acc[0][j]))) + bias[j];
  return narrow<Out>(v < 0.0f ? 0.0f : v);
}

// One sample: `padded` is its image zero-padded, [C_in][HP][WP] float32; `weight` is [blocks][K][kBlock] with
// k = (c KH + ky) KW + kx; `out` is the sample's [Hp][Wp][C_out] (channels_last).
template <typename Out>
SPLITZ_CLONES void pool_sample(const float* __restrict padded, const int64_t* __restrict offset, int64_t taps,
                               int64_t wp_cols, const float* __restrict weight, const float* __restrict bias,
                               int64_t c_out, int64_t pooled_h, int64_t pooled_w, Out* __restrict out) {
  const int64_t blocks = (c_out + kBlock - 1) / kBlock;
  const Lanes zero = {};
  for (int64_t py = 0; py < pooled_h; ++py) {
    for (int64_t px = 0; px < pooled_w; ++px) {
      Out* __restrict pixel = out + (py * pooled_w + px) * c_out;
      const float* __restrict window = padded + 2 * py * wp_cols + 2 * px;
      for (int64_t cb = 0; cb < blocks; ++cb) {
        Lanes a0 = zero, b0 = zero, a1 = zero, b1 = zero, a2 = zero, b2 = zero, a3 = zero, b3 = zero;
        const float* __restrict w = weight + cb * taps * kBlock;
        for (int64_t k = 0; k < taps; ++k, w += kBlock) {
          const float* __restrict tap = window + offset[k];
          const Lanes lo = load(w), hi = load(w + kLanes);
          const float x0 = tap[0], x1 = tap[1], x2 = tap[wp_cols], x3 = tap[wp_cols + 1];
          a0 += x0 * lo;
          b0 += x0 * hi;
          a1 += x1 * lo;
          b1 += x1 * hi;
          a2 += x2 * lo;
          b2 += x2 * hi;
          a3 += x3 * lo;
          b3 += x3 * hi;
        }
        float acc[4][kBlock];  // the window's four positions, spilled once for the epilogue's vectorised loop
        std::memcpy(acc[0], &a0, sizeof a0);
        std::memcpy(acc[0] + kLanes, &b0, sizeof b0);
        std::memcpy(acc[1], &a1, sizeof a1);
        std::memcpy(acc[1] + kLanes, &b1, sizeof b1);
        std::memcpy(acc[2], &a2, sizeof a2);
        std::memcpy(acc[2] + kLanes, &b2, sizeof b2);
        std::memcpy(acc[3], &a3, sizeof a3);
        std::memcpy(acc[3] + kLanes, &b3, sizeof b3);
        const float* __restrict b = bias + cb * kBlock;
        Out* __restrict dst = pixel + cb * kBlock;
        const int64_t valid = std::min(kBlock, c_out - cb * kBlock);
        if (valid == kBlock) {  // a whole block: a fixed trip count, vectorised
          for (int64_t j = 0; j < kBlock; ++j) dst[j] = pooled_relu<Out>(acc, b, j);
        } else {
          for (int64_t j = 0; j < valid; ++j) dst[j] = pooled_relu<Out>(acc, b, j);
        }
      }
    }
  }
}

template <typename In, typename Out>
void run(const In* x, const int64_t* stride, int64_t batch, int64_t c_in, int64_t height, int64_t width,
         int64_t kh, int64_t kw, int64_t ph, int64_t pw, const float* weight, const float* bias, int64_t c_out,
         int64_t pooled_h, int64_t pooled_w, Out* out) {
  const int64_t hp_rows = height + 2 * ph, wp_cols = width + 2 * pw;  // a pooled window reads rows < H_out + KH - 1
  const int64_t plane = hp_rows * wp_cols, taps = c_in * kh * kw;
  std::vector<int64_t> offset(taps);  // tap k = (c KH + ky) KW + kx: its offset in the padded image
  for (int64_t c = 0, k = 0; c < c_in; ++c)
    for (int64_t ky = 0; ky < kh; ++ky)
      for (int64_t kx = 0; kx < kw; ++kx, ++k) offset[k] = c * plane + ky * wp_cols + kx;
  at::parallel_for(0, batch, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> padded(c_in * plane, 0.0f);  // the zero border stays zero: only the interior is rewritten
    for (int64_t b = begin; b < end; ++b) {
      const In* sample = x + b * stride[0];
      for (int64_t c = 0; c < c_in; ++c) {
        for (int64_t y = 0; y < height; ++y) {
          float* dst = padded.data() + c * plane + (y + ph) * wp_cols + pw;
          const In* src = sample + c * stride[1] + y * stride[2];
          for (int64_t xi = 0; xi < width; ++xi) dst[xi] = widen(src[xi * stride[3]]);
        }
      }
      pool_sample<Out>(padded.data(), offset.data(), taps, wp_cols, weight, bias, c_out, pooled_h, pooled_w,
                       out + b * pooled_h * pooled_w * c_out);
    }
  });
}

// out = maxpool2(relu(conv2d(x, W, b, padding))) for x [B, C_in, H, W] (float32 or bfloat16, any strides), the
// weight packed by the caller as [ceil(C_out / 32)][C_in KH KW][32] float32 (zero-padded), the bias as
// [ceil(C_out / 32) 32] float32; out is [B, C_out, H_p, W_p] channels_last in x's dtype.
void conv_relu_maxpool2(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& bias, int64_t kh,
                        int64_t kw, int64_t ph, int64_t pw, torch::Tensor& out) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 4, "conv_relu_maxpool2 (native) needs a 4-d CPU tensor");
  TORCH_CHECK(x.scalar_type() == out.scalar_type(), "conv_relu_maxpool2 (native): out must have x's dtype");
  TORCH_CHECK(weight.scalar_type() == torch::kFloat32 && weight.is_contiguous() && bias.scalar_type() == torch::kFloat32
                  && bias.is_contiguous(), "conv_relu_maxpool2 (native): the packed weight and bias must be float32");
  const int64_t batch = x.size(0), c_in = x.size(1), height = x.size(2), width = x.size(3), c_out = out.size(1);
  const int64_t blocks = (c_out + kBlock - 1) / kBlock;
  TORCH_CHECK(weight.numel() == blocks * c_in * kh * kw * kBlock && bias.numel() == blocks * kBlock,
              "conv_relu_maxpool2 (native): the packed weight or bias has the wrong size");
  const int64_t pooled_h = (height + 2 * ph - kh + 1) / 2, pooled_w = (width + 2 * pw - kw + 1) / 2;
  TORCH_CHECK(out.size(0) == batch && out.size(2) == pooled_h && out.size(3) == pooled_w &&
                  out.is_contiguous(torch::MemoryFormat::ChannelsLast),
              "conv_relu_maxpool2 (native): out must be [B, C_out, H_p, W_p] channels_last");
  const int64_t stride[4] = {x.stride(0), x.stride(1), x.stride(2), x.stride(3)};
  const float* w = weight.data_ptr<float>();
  const float* b = bias.data_ptr<float>();
  switch (x.scalar_type()) {
    case torch::kFloat32:
      run<float, float>(x.data_ptr<float>(), stride, batch, c_in, height, width, kh, kw, ph, pw, w, b, c_out,
                        pooled_h, pooled_w, out.data_ptr<float>());
      break;
    case torch::kBFloat16:
      run<uint16_t, uint16_t>(reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()), stride, batch, c_in,
                              height, width, kh, kw, ph, pw, w, b, c_out, pooled_h, pooled_w,
                              reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()));
      break;
    default:
      TORCH_CHECK(false, "conv_relu_maxpool2 (native) takes float32 or bfloat16, got ", x.scalar_type());
  }
}

}  // namespace

// The GIL is released while the kernel runs (it touches no Python object): the sampling engine runs its batches on
// several worker threads, which a held GIL would run one at a time.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("conv_relu_maxpool2", &conv_relu_maxpool2,
        "maxpool2(relu(conv2d(x) + b)) of a thin stride-1 convolution, pooled output channels_last, into out",
        py::call_guard<py::gil_scoped_release>());
}
