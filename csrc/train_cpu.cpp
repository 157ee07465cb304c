// CPU kernels of the SPLITZ training step (kernels/conv_power.py, kernels/train_noise.py), a separate extension from
// noise_cpu.cpp (kernels/native.py builds one module per op family, so neither file's binding list depends on the
// other's). Multi-threaded over the batch with ATen's intra-op pool; every loop is an axpy along an image row or an
// elementwise pass, so GCC vectorises it (target_clones picks AVX-512 / AVX2 / baseline at load time).
//
// * masked_conv_gram: v -> f . W^T (m . W (f . v)) for a zero-padded Conv2d (any stride / padding / dilation,
//   groups = 1): one power step of the training estimate (splitz_fast/lipschitz.py) per image, output channel by
//   output channel, so the [C_out, H_out, W_out] activation never leaves the cache.
// * masked_conv_sumsq: per image ||m . W (f . v)||^2, and its gradient with respect to W (the gradient-carrying
//   factor of the estimate).
// * clip_mask_forward / clip_backward: the first layer's clipped ReLU and its varying mask over the ball in one pass
//   (kernels/clip_mask.py), and the clipped ReLU's gradient.
// * train_noise: [B q, *S] rows latent[k / q] + sigma z_k from the Philox stream of philox.h (sample k of the call at
//   sample offset `offset`), contiguous or channels_last.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <vector>

#include "philox_cpu.h"

namespace {

#define SPLITZ_INLINE inline __attribute__((always_inline))

struct ConvGeometry {
  int64_t c_in, h, w, c_out, kh, kw, h_out, w_out, sh, sw, ph, pw, dh, dw;
};

// How one image is laid out while a kernel works on it. The input sits zero-padded in `xp` (channel pitch `cpitch`,
// row pitch `wp`), so no tap needs a bounds check; an output plane sits in `y` with row pitch `ypitch`. With stride 1
// the output row pitch is the padded input's (`wp`), so tap (c, ky, kx) of every output is one flat run
// y[i] += w xp[base + i], i < h_out wp (the columns past w_out are scratch, zeroed before use); otherwise a run per
// output row.
struct Layout {
  int64_t hp, wp, cpitch, ypitch, plane;  // plane: length of y
  int64_t rows, cols, xrow, xcol;         // a tap's run: rows x cols, input steps per row / per column
};

Layout layout(const ConvGeometry& g) {
  Layout l{};
  l.hp = g.h + 2 * g.ph;
  l.wp = g.w + 2 * g.pw;
  l.cpitch = l.hp * l.wp + (g.kw - 1) * g.dw + 1;  // slack: a flat run may read past the last padded row
  const bool flat = g.sh == 1 && g.sw == 1;
  l.ypitch = flat ? l.wp : g.w_out;
  l.plane = g.h_out * l.ypitch;
  l.rows = flat ? 1 : g.h_out;
  l.cols = flat ? l.plane : g.w_out;
  l.xrow = g.sh * l.wp;
  l.xcol = g.sw;
  return l;
}

inline int64_t tap_offset(const ConvGeometry& g, const Layout& l, int64_t k) {
  const int64_t c = k / (g.kh * g.kw), ky = (k / g.kw) % g.kh, kx = k % g.kw;
  return c * l.cpitch + ky * g.dh * l.wp + kx * g.dw;
}

// y[run] += w x[run]
template <typename T>
SPLITZ_INLINE void tap_gather(const Layout& l, T* __restrict y, const T* __restrict x, T w) {
  for (int64_t r = 0; r < l.rows; ++r) {
    T* __restrict yr = y + r * l.ypitch;
    const T* __restrict xr = x + r * l.xrow;
    if (l.xcol == 1) {
      for (int64_t j = 0; j < l.cols; ++j) yr[j] += w * xr[j];
    } else {
      for (int64_t j = 0; j < l.cols; ++j) yr[j] += w * xr[j * l.xcol];
    }
  }
}

// x[run] += w y[run] (the transposed tap)
template <typename T>
SPLITZ_INLINE void tap_scatter(const Layout& l, T* __restrict x, const T* __restrict y, T w) {
  for (int64_t r = 0; r < l.rows; ++r) {
    const T* __restrict yr = y + r * l.ypitch;
    T* __restrict xr = x + r * l.xrow;
    if (l.xcol == 1) {
      for (int64_t j = 0; j < l.cols; ++j) xr[j] += w * yr[j];
    } else {
      for (int64_t j = 0; j < l.cols; ++j) xr[j * l.xcol] += w * yr[j];
    }
  }
}

// sum over the run of y x, in 16 lanes (vectorises without reassociating a scalar sum), lanes added in order.
template <typename T>
SPLITZ_INLINE T tap_dot(const Layout& l, const T* __restrict y, const T* __restrict x) {
  constexpr int kLanes = 16;
  T lane[kLanes] = {};
  T tail = 0;
  for (int64_t r = 0; r < l.rows; ++r) {
    const T* __restrict yr = y + r * l.ypitch;
    const T* __restrict xr = x + r * l.xrow;
    int64_t j = 0;
    if (l.xcol == 1) {
      for (; j + kLanes <= l.cols; j += kLanes)
        for (int i = 0; i < kLanes; ++i) lane[i] += yr[j + i] * xr[j + i];
    }
    for (; j < l.cols; ++j) tail += yr[j] * xr[j * l.xcol];
  }
  T total = 0;
  for (int i = 0; i < kLanes; ++i) total += lane[i];
  return total + tail;
}

// Between an image [C_in, H, W] and the interior of its padded copy, times f (when given): to_padded copies
// f . image into the interior, else f . interior into the image.
template <typename T>
SPLITZ_INLINE void copy_interior(const ConvGeometry& g, const Layout& l, T* image, const T* __restrict f, T* padded,
                                 bool to_padded) {
  for (int64_t c = 0; c < g.c_in; ++c)
    for (int64_t iy = 0; iy < g.h; ++iy) {
      T* row = image + (c * g.h + iy) * g.w;
      T* inner = padded + c * l.cpitch + (iy + g.ph) * l.wp + g.pw;
      const T* __restrict src = to_padded ? row : inner;
      T* __restrict dst = to_padded ? inner : row;
      const T* __restrict fr = f ? f + (c * g.h + iy) * g.w : nullptr;
      if (fr) {
        for (int64_t ix = 0; ix < g.w; ++ix) dst[ix] = src[ix] * fr[ix];
      } else {
        for (int64_t ix = 0; ix < g.w; ++ix) dst[ix] = src[ix];
      }
    }
}

// The padded copy of one image: xp = 0 outside, f . v inside.
template <typename T>
SPLITZ_INLINE void load_padded(const ConvGeometry& g, const Layout& l, const T* v, const T* f, T* xp) {
  std::fill(xp, xp + g.c_in * l.cpitch, T(0));
  copy_interior(g, l, const_cast<T*>(v), f, xp, true);  // reads v only
}

// y = m_o . (W_o * xp): the taps summed in (c, ky, kx) order; scratch columns zeroed.
template <typename T>
SPLITZ_INLINE void forward_plane(const ConvGeometry& g, const Layout& l, const T* __restrict xp,
                                 const T* __restrict weight_o, const uint8_t* __restrict mask_o, T* __restrict y) {
  const int64_t taps = g.c_in * g.kh * g.kw;
  std::fill(y, y + l.plane, T(0));
  for (int64_t k = 0; k < taps; ++k) tap_gather(l, y, xp + tap_offset(g, l, k), weight_o[k]);
  for (int64_t oy = 0; oy < g.h_out; ++oy) {
    T* __restrict yr = y + oy * l.ypitch;
    if (mask_o) {
      const uint8_t* __restrict mr = mask_o + oy * g.w_out;
      for (int64_t ox = 0; ox < g.w_out; ++ox) yr[ox] *= static_cast<T>(mr[ox]);  // a product: NaN stays NaN
    }
    for (int64_t ox = g.w_out; ox < l.ypitch; ++ox) yr[ox] = T(0);
  }
}

// out_b = f . W^T (m . W (f . v_b)) for one image.
template <typename T>
SPLITZ_CLONES void gram_image(const ConvGeometry& g, const Layout& l, const T* v, const T* weight,
                              const uint8_t* mask, const T* f, T* xp, T* xg, T* y, T* out) {
  const int64_t taps = g.c_in * g.kh * g.kw, plane_out = g.h_out * g.w_out;
  load_padded(g, l, v, f, xp);
  std::fill(xg, xg + g.c_in * l.cpitch, T(0));
  for (int64_t o = 0; o < g.c_out; ++o) {
    const T* weight_o = weight + o * taps;
    forward_plane(g, l, xp, weight_o, mask ? mask + o * plane_out : nullptr, y);
    for (int64_t k = 0; k < taps; ++k) tap_scatter(l, xg + tap_offset(g, l, k), y, weight_o[k]);
  }
  copy_interior(g, l, out, f, xg, false);
}

// ||m . W (f . v_b)||^2 for one image, summed plane by plane in 16 lanes.
template <typename T>
SPLITZ_CLONES T sumsq_image(const ConvGeometry& g, const Layout& l, const T* v, const T* weight, const uint8_t* mask,
                            const T* f, T* xp, T* y) {
  const int64_t taps = g.c_in * g.kh * g.kw, plane_out = g.h_out * g.w_out;
  load_padded(g, l, v, f, xp);
  Layout whole = l;  // a plane as one run against itself
  whole.rows = 1;
  whole.cols = l.plane;
  whole.xcol = 1;
  T total = 0;
  for (int64_t o = 0; o < g.c_out; ++o) {
    forward_plane(g, l, xp, weight + o * taps, mask ? mask + o * plane_out : nullptr, y);
    total += tap_dot(whole, y, y);
  }
  return total;
}

// For the weight gradient of one image: ys[o] = m_o . (W_o * xp) for every output channel (C_out planes) and
// xs[k] = tap k's run of xp (taps planes, in the planes' layout), so that the gradient is ys xs^T.
template <typename T>
SPLITZ_CLONES void planes_and_taps(const ConvGeometry& g, const Layout& l, const T* v, const T* weight,
                                   const uint8_t* mask, const T* f, T* xp, T* ys, T* xs) {
  const int64_t taps = g.c_in * g.kh * g.kw, plane_out = g.h_out * g.w_out;
  load_padded(g, l, v, f, xp);
  for (int64_t o = 0; o < g.c_out; ++o)
    forward_plane(g, l, xp, weight + o * taps, mask ? mask + o * plane_out : nullptr, ys + o * l.plane);
  for (int64_t k = 0; k < taps; ++k) {
    T* __restrict dst = xs + k * l.plane;
    std::fill(dst, dst + l.plane, T(0));
    tap_gather(l, dst, xp + tap_offset(g, l, k), T(1));  // 0 + 1 x: exact copy of the run
  }
}

ConvGeometry geometry(const torch::Tensor& v, const torch::Tensor& weight, std::vector<int64_t> stride,
                      std::vector<int64_t> padding, std::vector<int64_t> dilation) {
  TORCH_CHECK(v.dim() == 4 && weight.dim() == 4 && v.size(1) == weight.size(1),
              "masked conv (native CPU): v must be [B, C_in, H, W] and weight [C_out, C_in, kh, kw]");
  TORCH_CHECK(stride.size() == 2 && padding.size() == 2 && dilation.size() == 2 && stride[0] > 0 && stride[1] > 0 &&
                  dilation[0] > 0 && dilation[1] > 0 && padding[0] >= 0 && padding[1] >= 0,
              "masked conv (native CPU): stride, padding and dilation must be pairs (stride, dilation > 0)");
  ConvGeometry g{v.size(1), v.size(2), v.size(3), weight.size(0), weight.size(2), weight.size(3), 0, 0,
                 stride[0], stride[1], padding[0], padding[1], dilation[0], dilation[1]};
  g.h_out = (g.h + 2 * g.ph - g.dh * (g.kh - 1) - 1) / g.sh + 1;
  g.w_out = (g.w + 2 * g.pw - g.dw * (g.kw - 1) - 1) / g.sw + 1;
  TORCH_CHECK(g.h_out > 0 && g.w_out > 0, "masked conv (native CPU): the kernel does not fit the padded input");
  return g;
}

// Checks shared by the ops; sets the factor's batch stride (0: shared by the batch).
void check_operands(const ConvGeometry& g, const torch::Tensor& v, const torch::Tensor& weight,
                    const c10::optional<torch::Tensor>& mask, const c10::optional<torch::Tensor>& factor,
                    int64_t& factor_stride) {
  TORCH_CHECK(v.device().is_cpu() && weight.device().is_cpu(), "masked conv (native CPU): tensors must be on the CPU");
  TORCH_CHECK(v.is_contiguous() && weight.is_contiguous() && v.scalar_type() == weight.scalar_type() &&
                  (v.scalar_type() == torch::kFloat32 || v.scalar_type() == torch::kFloat64),
              "masked conv (native CPU): v and weight must be contiguous float32 or float64 tensors of one dtype");
  const int64_t batch = v.size(0);
  if (mask.has_value()) {
    const auto& m = *mask;
    TORCH_CHECK(m.scalar_type() == torch::kUInt8 && m.is_contiguous() && m.dim() == 4 && m.size(0) == batch &&
                    m.size(1) == g.c_out && m.size(2) == g.h_out && m.size(3) == g.w_out,
                "masked conv (native CPU): out_mask must be a contiguous uint8 [B, C_out, H_out, W_out] tensor");
  }
  factor_stride = 0;
  if (factor.has_value()) {
    const auto& f = *factor;
    TORCH_CHECK(f.scalar_type() == v.scalar_type() && f.is_contiguous() && f.dim() == 4 &&
                    (f.size(0) == 1 || f.size(0) == batch) && f.size(1) == g.c_in && f.size(2) == g.h && f.size(3) == g.w,
                "masked conv (native CPU): in_factor must be a contiguous [1 or B, C_in, H, W] tensor of v's dtype");
    factor_stride = f.size(0) == 1 ? 0 : g.c_in * g.h * g.w;
  }
}

// out = f . W^T (m . W (f . v)) per image of v: [B, C_in, H, W] -> [B, C_in, H, W].
torch::Tensor masked_conv_gram(const torch::Tensor& v, const torch::Tensor& weight,
                               const c10::optional<torch::Tensor>& mask, const c10::optional<torch::Tensor>& factor,
                               std::vector<int64_t> stride, std::vector<int64_t> padding, std::vector<int64_t> dilation) {
  const ConvGeometry g = geometry(v, weight, stride, padding, dilation);
  int64_t factor_stride = 0;
  check_operands(g, v, weight, mask, factor, factor_stride);
  auto out = torch::empty_like(v);
  const Layout l = layout(g);
  const int64_t batch = v.size(0), in_numel = g.c_in * g.h * g.w, mask_numel = g.c_out * g.h_out * g.w_out;
  const uint8_t* m = mask.has_value() ? mask->data_ptr<uint8_t>() : nullptr;
  AT_DISPATCH_FLOATING_TYPES(v.scalar_type(), "masked_conv_gram", [&] {
    const scalar_t* vp = v.data_ptr<scalar_t>();
    const scalar_t* wp = weight.data_ptr<scalar_t>();
    const scalar_t* fp = factor.has_value() ? factor->data_ptr<scalar_t>() : nullptr;
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, batch, 1, [&](int64_t begin, int64_t end) {
      std::vector<scalar_t> xp(g.c_in * l.cpitch), xg(g.c_in * l.cpitch), y(l.plane);
      for (int64_t b = begin; b < end; ++b)
        gram_image<scalar_t>(g, l, vp + b * in_numel, wp, m ? m + b * mask_numel : nullptr,
                             fp ? fp + b * factor_stride : nullptr, xp.data(), xg.data(), y.data(), op + b * in_numel);
    });
  });
  return out;
}

// Per image b: ||m . W (f . v_b)||^2; with `scale` ([B]), instead the gradient with respect to W of
// sum_b scale[b] ||m . W (f . v_b)||^2, accumulated per chunk of the batch and the chunks summed in order.
torch::Tensor sumsq_or_grad(const torch::Tensor& v, const torch::Tensor& weight, const c10::optional<torch::Tensor>& mask,
                            const c10::optional<torch::Tensor>& factor, const c10::optional<torch::Tensor>& scale,
                            std::vector<int64_t> stride, std::vector<int64_t> padding, std::vector<int64_t> dilation) {
  const ConvGeometry g = geometry(v, weight, stride, padding, dilation);
  int64_t factor_stride = 0;
  check_operands(g, v, weight, mask, factor, factor_stride);
  const int64_t batch = v.size(0), in_numel = g.c_in * g.h * g.w, mask_numel = g.c_out * g.h_out * g.w_out;
  const int64_t wsize = weight.numel();
  if (scale.has_value()) {
    TORCH_CHECK(scale->scalar_type() == v.scalar_type() && scale->is_contiguous() && scale->dim() == 1 &&
                    scale->size(0) == batch,
                "masked conv (native CPU): scale must be a contiguous [B] tensor of v's dtype");
  }
  const Layout l = layout(g);
  const uint8_t* m = mask.has_value() ? mask->data_ptr<uint8_t>() : nullptr;
  torch::Tensor result = scale.has_value() ? torch::zeros_like(weight) : torch::empty({batch}, v.options());
  AT_DISPATCH_FLOATING_TYPES(v.scalar_type(), "masked_conv_sumsq", [&] {
    const scalar_t* vp = v.data_ptr<scalar_t>();
    const scalar_t* wp = weight.data_ptr<scalar_t>();
    const scalar_t* fp = factor.has_value() ? factor->data_ptr<scalar_t>() : nullptr;
    const scalar_t* sp = scale.has_value() ? scale->data_ptr<scalar_t>() : nullptr;
    const int64_t n_threads = std::max<int64_t>(1, at::get_num_threads());
    const int64_t chunk = std::max<int64_t>(1, (batch + n_threads - 1) / n_threads);
    const int64_t n_chunks = (batch + chunk - 1) / chunk;
    std::vector<scalar_t> partial(sp ? n_chunks * wsize : 0, scalar_t(0));
    scalar_t* rp = result.data_ptr<scalar_t>();
    const int64_t taps = g.c_in * g.kh * g.kw;
    at::parallel_for(0, n_chunks, 1, [&](int64_t chunk_begin, int64_t chunk_end) {
      std::vector<scalar_t> xp(g.c_in * l.cpitch), y(sp ? g.c_out * l.plane : l.plane), xs(sp ? taps * l.plane : 0);
      for (int64_t ci = chunk_begin; ci < chunk_end; ++ci) {
        torch::Tensor acc;
        if (sp) acc = torch::from_blob(partial.data() + ci * wsize, {g.c_out, taps}, v.options());
        for (int64_t b = ci * chunk; b < std::min(batch, (ci + 1) * chunk); ++b) {
          const scalar_t* vb = vp + b * in_numel;
          const uint8_t* mb = m ? m + b * mask_numel : nullptr;
          const scalar_t* fb = fp ? fp + b * factor_stride : nullptr;
          if (!sp) {
            rp[b] = sumsq_image<scalar_t>(g, l, vb, wp, mb, fb, xp.data(), y.data());
            continue;
          }
          if (sp[b] == scalar_t(0)) continue;
          planes_and_taps<scalar_t>(g, l, vb, wp, mb, fb, xp.data(), y.data(), xs.data());
          // acc += 2 scale_b ys xs^T: one small GEMM per image (ATen runs it single-threaded inside parallel_for).
          acc.addmm_(torch::from_blob(y.data(), {g.c_out, l.plane}, v.options()),
                     torch::from_blob(xs.data(), {taps, l.plane}, v.options()).t(), 1.0, 2.0 * double(sp[b]));
        }
      }
    });
    if (sp)
      for (int64_t ci = 0; ci < n_chunks; ++ci)
        for (int64_t i = 0; i < wsize; ++i) rp[i] += partial[ci * wsize + i];
  });
  return result;
}

torch::Tensor masked_conv_sumsq(const torch::Tensor& v, const torch::Tensor& weight,
                                const c10::optional<torch::Tensor>& mask, const c10::optional<torch::Tensor>& factor,
                                std::vector<int64_t> stride, std::vector<int64_t> padding,
                                std::vector<int64_t> dilation) {
  return sumsq_or_grad(v, weight, mask, factor, c10::nullopt, stride, padding, dilation);
}

// d/dW of sum_b scale[b] ||m . W (f . v_b)||^2: [C_out, C_in, kh, kw].
torch::Tensor masked_conv_sumsq_grad_weight(const torch::Tensor& v, const torch::Tensor& weight,
                                            const c10::optional<torch::Tensor>& mask,
                                            const c10::optional<torch::Tensor>& factor, const torch::Tensor& scale,
                                            std::vector<int64_t> stride, std::vector<int64_t> padding,
                                            std::vector<int64_t> dilation) {
  return sumsq_or_grad(v, weight, mask, factor, scale, stride, padding, dilation);
}

// ------------------------------------------------------------------------------------------------- training noise

SPLITZ_CLONES void add_scaled(float* __restrict out, const float* __restrict latent, const float* __restrict z,
                              float sigma, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = latent[i] + sigma * z[i];
}

// out[s C + c] = latent[c S + s] + sigma z[c S + s]: one channels_last row from logical-order operands.
SPLITZ_CLONES void add_scaled_nhwc(float* __restrict out, const float* __restrict latent, const float* __restrict z,
                                   float sigma, int64_t channels, int64_t spatial) {
  for (int64_t s = 0; s < spatial; ++s)
    for (int64_t c = 0; c < channels; ++c) out[s * channels + c] = latent[c * spatial + s] + sigma * z[c * spatial + s];
}

// Rows k in [0, B q) of out: latent[k / q] + sigma z over the stream positions [(offset + k) D, (offset + k + 1) D).
// seed_bits: the 64-bit seed as a signed int64 (two's complement; Python passes seed - 2^64 for seeds >= 2^63, so that
// the argument converts as an int64 everywhere, the profiler's argument recording included).
void train_noise(const torch::Tensor& latent, torch::Tensor& out, int64_t q, double sigma, int64_t seed_bits,
                 int64_t offset_samples, bool channels_last) {
  TORCH_CHECK(offset_samples >= 0, "train_noise (native CPU): offset must be >= 0");
  const uint64_t seed = static_cast<uint64_t>(seed_bits), offset = static_cast<uint64_t>(offset_samples);
  TORCH_CHECK(latent.device().is_cpu() && out.device().is_cpu(), "train_noise (native CPU): tensors must be on the CPU");
  TORCH_CHECK(latent.scalar_type() == torch::kFloat32 && latent.is_contiguous() && latent.dim() >= 2 &&
                  out.scalar_type() == torch::kFloat32,
              "train_noise (native CPU): latent must be a contiguous float32 [B, ...] tensor, out float32");
  TORCH_CHECK(q >= 1, "train_noise (native CPU): q must be >= 1");
  const int64_t batch = latent.size(0), numel = batch ? latent.numel() / batch : 0;
  TORCH_CHECK(out.dim() == latent.dim() && out.size(0) == batch * q && out.numel() == batch * q * numel,
              "train_noise (native CPU): out must be [B q, *latent.shape[1:]]");
  int64_t channels = 1, spatial = numel;
  if (channels_last) {
    TORCH_CHECK(latent.dim() == 4 && out.is_contiguous(at::MemoryFormat::ChannelsLast),
                "train_noise (native CPU): channels_last needs a [B, C, H, W] latent and a channels_last out");
    channels = latent.size(1);
    spatial = latent.size(2) * latent.size(3);
  } else {
    TORCH_CHECK(out.is_contiguous(), "train_noise (native CPU): out must be contiguous");
  }
  const float* lat = latent.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  const uint32_t k0 = static_cast<uint32_t>(seed), k1 = static_cast<uint32_t>(seed >> 32);
  const float sig = static_cast<float>(sigma);
  const int64_t rows = batch * q;
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(1, numel));
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> row(numel + 2);
    for (int64_t k = begin; k < end; ++k) {
      const uint64_t first = (offset + static_cast<uint64_t>(k)) * static_cast<uint64_t>(numel);
      const uint64_t last = first + static_cast<uint64_t>(numel);
      const uint64_t first_pair = first >> 1;
      const int64_t pairs = static_cast<int64_t>(((last - 1) >> 1) - first_pair) + 1;
      splitz::stream_pairs(first_pair, pairs, k0, k1, row.data());
      const float* z = row.data() + (first & 1);
      const float* lat_row = lat + (k / q) * numel;
      if (channels_last) {
        add_scaled_nhwc(dst + k * numel, lat_row, z, sig, channels, spatial);
      } else {
        add_scaled(dst + k * numel, lat_row, z, sig, numel);
      }
    }
  });
}

// ------------------------------------------------------------------------------------------ clipped ReLU + mask

// Per element of z [B, N] (shared r, theta [N], gamma [B]): r_eff = gamma_b r, upper = z + r_eff, lower = z - r_eff,
// mask = (upper > 0) & (lower < theta) — the float32 operations of interval_clip_reference, in its order — and
// latent = min(relu(z), theta) as torch computes it (NaN propagates; relu(z) = z unless z < 0).
template <typename T>
SPLITZ_CLONES void clip_mask_row(const T* __restrict z, const T* __restrict r, const T* __restrict theta, T g, int64_t n,
                                 T* __restrict latent, uint8_t* __restrict mask) {
  for (int64_t j = 0; j < n; ++j) {
    const T zj = z[j], th = theta[j];
    const T r_eff = g * r[j];
    const T upper = zj + r_eff, lower = zj - r_eff;
    mask[j] = static_cast<uint8_t>((upper > T(0)) & (lower < th));
    const T a = zj < T(0) ? T(0) : zj;
    latent[j] = a > th ? th : a;
  }
}

// The gradient of min(relu(z), theta), torch's rules: relu passes where its output is > 0, minimum passes where
// relu(z) < theta, half at a tie; grad_theta_elem gets the other share (where relu(z) > theta, half at a tie).
template <typename T>
SPLITZ_CLONES void clip_grad_row(const T* __restrict z, const T* __restrict grad, const T* __restrict theta, int64_t n,
                                 T* __restrict grad_z, T* __restrict grad_theta) {
  for (int64_t j = 0; j < n; ++j) {
    const T zj = z[j], th = theta[j], gj = grad[j];
    const T a = zj < T(0) ? T(0) : zj;
    const T to_a = a < th ? gj : (a == th ? gj / T(2) : T(0));
    grad_z[j] = a > T(0) ? to_a : T(0);
    if (grad_theta) grad_theta[j] = a > th ? gj : (a == th ? gj / T(2) : T(0));
  }
}

void check_clip_operands(const torch::Tensor& z, const torch::Tensor& theta, const torch::Tensor* r,
                         const torch::Tensor* gamma) {
  TORCH_CHECK(z.device().is_cpu() && (z.scalar_type() == torch::kFloat32 || z.scalar_type() == torch::kFloat64) &&
                  z.is_contiguous() && z.dim() == 2,
              "clip_mask (native CPU): z must be a contiguous float32/float64 [B, N] CPU tensor");
  const int64_t n = z.size(1);
  TORCH_CHECK(theta.scalar_type() == z.scalar_type() && theta.is_contiguous() && theta.numel() == n,
              "clip_mask (native CPU): theta must be a contiguous [N] tensor of z's dtype");
  if (r) TORCH_CHECK(r->scalar_type() == z.scalar_type() && r->is_contiguous() && r->numel() == n,
                     "clip_mask (native CPU): r must be a contiguous [N] tensor of z's dtype");
  if (gamma) TORCH_CHECK(gamma->scalar_type() == z.scalar_type() && gamma->is_contiguous() &&
                             gamma->numel() == z.size(0),
                         "clip_mask (native CPU): gamma must be a contiguous [B] tensor of z's dtype");
}

std::vector<torch::Tensor> clip_mask_forward(const torch::Tensor& z, const torch::Tensor& r, const torch::Tensor& gamma,
                                             const torch::Tensor& theta) {
  check_clip_operands(z, theta, &r, &gamma);
  auto latent = torch::empty_like(z);
  auto mask = torch::empty(z.sizes(), z.options().dtype(torch::kUInt8));
  const int64_t batch = z.size(0), n = z.size(1);
  AT_DISPATCH_FLOATING_TYPES(z.scalar_type(), "clip_mask_forward", [&] {
    const scalar_t *zp = z.data_ptr<scalar_t>(), *rp = r.data_ptr<scalar_t>(), *tp = theta.data_ptr<scalar_t>();
    const scalar_t* gp = gamma.data_ptr<scalar_t>();
    scalar_t* lp = latent.data_ptr<scalar_t>();
    uint8_t* mp = mask.data_ptr<uint8_t>();
    at::parallel_for(0, batch, std::max<int64_t>(1, 32768 / std::max<int64_t>(1, n)), [&](int64_t begin, int64_t end) {
      for (int64_t b = begin; b < end; ++b) clip_mask_row<scalar_t>(zp + b * n, rp, tp, gp[b], n, lp + b * n, mp + b * n);
    });
  });
  return {latent, mask};
}

std::vector<torch::Tensor> clip_backward(const torch::Tensor& z, const torch::Tensor& grad, const torch::Tensor& theta,
                                         bool need_theta) {
  check_clip_operands(z, theta, nullptr, nullptr);
  TORCH_CHECK(grad.sizes() == z.sizes() && grad.scalar_type() == z.scalar_type() && grad.is_contiguous(),
              "clip_mask (native CPU): grad must be contiguous and shaped like z");
  auto grad_z = torch::empty_like(z);
  auto grad_theta = need_theta ? torch::empty_like(z) : torch::Tensor();
  const int64_t batch = z.size(0), n = z.size(1);
  AT_DISPATCH_FLOATING_TYPES(z.scalar_type(), "clip_backward", [&] {
    const scalar_t *zp = z.data_ptr<scalar_t>(), *gp = grad.data_ptr<scalar_t>(), *tp = theta.data_ptr<scalar_t>();
    scalar_t* gz = grad_z.data_ptr<scalar_t>();
    scalar_t* gt = need_theta ? grad_theta.data_ptr<scalar_t>() : nullptr;
    at::parallel_for(0, batch, std::max<int64_t>(1, 32768 / std::max<int64_t>(1, n)), [&](int64_t begin, int64_t end) {
      for (int64_t b = begin; b < end; ++b)
        clip_grad_row<scalar_t>(zp + b * n, gp + b * n, tp, n, gz + b * n, gt ? gt + b * n : nullptr);
    });
  });
  return {grad_z, grad_theta};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "splitz_fast native CPU kernels of the training step (csrc/train_cpu.cpp)";
  m.def("masked_conv_gram", &masked_conv_gram, "f . W^T (m . W (f . v)) per image (one power step)");
  m.def("masked_conv_sumsq", &masked_conv_sumsq, "||m . W (f . v_b)||^2 per image");
  m.def("masked_conv_sumsq_grad_weight", &masked_conv_sumsq_grad_weight,
        "d/dW of sum_b scale_b ||m . W (f . v_b)||^2");
  m.def("train_noise", &train_noise, "rows latent[k / q] + sigma z_k of the Philox stream, into out");
  m.def("clip_mask_forward", &clip_mask_forward, "min(relu(z), theta) and the varying mask of the ball, one pass");
  m.def("clip_backward", &clip_backward, "gradient of min(relu(z), theta) w.r.t. z (and theta per element)");
}
