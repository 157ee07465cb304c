// Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC 2011) and the Box-Muller step of
// splitz_fast's noise stream, shared by the C++ (noise_cpu.cpp) and CUDA (*.cu) kernels.
//
// The stream contract (the same as the Triton kernel kernels/noise.py; tl.randint4x, Triton >= 3.4): the
// noise of one seed is a sequence of N(0, 1) numbers z_t, t = 0, 1, 2, ...; element j of sample k of a call at sample
// offset `offset` is z_t with t = (offset + k) * D + j (D = elements per sample, j row-major). The pair (z_2i, z_2i+1)
// comes from one Philox call: counter i as the 128-bit Philox counter (lo32(i), hi32(i), 0, 0) under the key
// (lo32(seed), hi32(seed)); its first three output words w0, w1, w2 give
//     u1 = w0 2^-32 + (w1 + 1/2) 2^-64  in (0, 1]   (64 random bits, so |z| can reach 9.4),
//     u2 = w2 2^-32 - 1/2               in [-1/2, 1/2),
//     z_2i = r cos(2 pi u2),  z_2i+1 = r sin(2 pi u2),  r = sqrt(-2 ln u1)   (Box-Muller: two independent normals),
// all in float32 with the roundings written below (no FMA contraction: compile with -ffp-contract=off). The integer
// words are bit-identical on every backend; z differs between backends only by the rounding of ln, cos and sin.
#pragma once
#include <cstdint>
#include <cmath>
#include <cstring>

#if defined(__CUDACC__)
#define SPLITZ_HD __host__ __device__ __forceinline__
#define SPLITZ_UNROLL _Pragma("unroll")
#else
#define SPLITZ_HD inline __attribute__((always_inline))
#define SPLITZ_UNROLL _Pragma("GCC unroll 10")
#endif

namespace splitz {

constexpr uint32_t kPhiloxKeyA = 0x9E3779B9u;
constexpr uint32_t kPhiloxKeyB = 0xBB67AE85u;
constexpr uint32_t kPhiloxRoundA = 0xD2511F53u;
constexpr uint32_t kPhiloxRoundB = 0xCD9E8D57u;
constexpr int kPhiloxRounds = 10;

// The first three output words of Philox4x32-10 for counter (c0, c1, 0, 0) and key (k0, k1). On the host the words
// live in 64-bit lanes (always < 2^32): x86 multiplies 32 x 32 -> 64 bits in 64-bit vector lanes, so loops over this
// vectorise without shuffles (1.1-1.3x faster with AVX-512 than 32-bit lanes, measured).
SPLITZ_HD void philox_words(uint32_t c0, uint32_t c1, uint32_t k0, uint32_t k1, uint32_t& w0, uint32_t& w1,
                            uint32_t& w2) {
#if defined(__CUDA_ARCH__)
  uint32_t x0 = c0, x1 = c1, x2 = 0, x3 = 0;
  SPLITZ_UNROLL
  for (int round = 0; round < kPhiloxRounds; ++round) {
    const uint32_t hi_b = __umulhi(kPhiloxRoundB, x2), hi_a = __umulhi(kPhiloxRoundA, x0);
    const uint32_t lo_b = kPhiloxRoundB * x2, lo_a = kPhiloxRoundA * x0;
    x0 = hi_b ^ x1 ^ k0;
    x2 = hi_a ^ x3 ^ k1;
    x1 = lo_b;
    x3 = lo_a;
    k0 += kPhiloxKeyA;
    k1 += kPhiloxKeyB;
  }
#else
  constexpr uint64_t kLow = 0xFFFFFFFFull;
  uint64_t x0 = c0, x1 = c1, x2 = 0, x3 = 0, key0 = k0, key1 = k1;
  SPLITZ_UNROLL
  for (int round = 0; round < kPhiloxRounds; ++round) {
    const uint64_t pb = static_cast<uint64_t>(kPhiloxRoundB) * x2;
    const uint64_t pa = static_cast<uint64_t>(kPhiloxRoundA) * x0;
    x0 = (pb >> 32) ^ x1 ^ key0;
    x2 = (pa >> 32) ^ x3 ^ key1;
    x1 = pb & kLow;
    x3 = pa & kLow;
    key0 = (key0 + kPhiloxKeyA) & kLow;
    key1 = (key1 + kPhiloxKeyB) & kLow;
  }
#endif
  w0 = static_cast<uint32_t>(x0);
  w1 = static_cast<uint32_t>(x1);
  w2 = static_cast<uint32_t>(x2);
}

// float(w) correctly rounded, from two exact int32 conversions (x86 before AVX-512 has no vector uint32 -> float).
SPLITZ_HD float uint32_to_float(uint32_t w) {
  return static_cast<float>(static_cast<int32_t>(w >> 16)) * 65536.0f + static_cast<float>(static_cast<int32_t>(w & 0xFFFFu));
}

// u1 in (0, 1] from 64 bits and u2 in [-1/2, 1/2) from 32 bits, exactly as the Triton kernel forms them.
SPLITZ_HD void box_muller_uniforms(uint32_t w0, uint32_t w1, uint32_t w2, float& u1, float& u2) {
  const float a = uint32_to_float(w0) * 2.3283064365386963e-10f;
  const float b = (uint32_to_float(w1) + 0.5f) * 5.421010862427522e-20f;
  u1 = a + b;  // <= 1: a <= 1 and b < ulp(1) / 2, so the Triton kernel's min(u1, 1) is a no-op here
  u2 = uint32_to_float(w2) * 2.3283064365386963e-10f - 0.5f;
}

SPLITZ_HD float bits_to_float(uint32_t bits) {
  float value;
  std::memcpy(&value, &bits, sizeof(value));
  return value;
}

SPLITZ_HD uint32_t float_to_bits(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  return bits;
}

// ln(u) for a positive normal float u, branch-free so that loops over it vectorise: u = m 2^e with m in
// [sqrt(1/2), sqrt(2)) (the exponent is read after shifting the bit pattern by the bits of sqrt(1/2)), ln m = 2 atanh(s)
// with s = (m - 1) / (m + 1), |s| <= 0.1716, by its series to s^9 (truncation error below 2.1e-9 relative). Accurate to
// a few float32 ulps; used where libm's scalar logf would stop vectorisation.
SPLITZ_HD float log_positive(float u) {
  constexpr uint32_t kSqrtHalfBits = 0x3F3504F3u;  // sqrt(1/2) as float32
  const uint32_t shifted = float_to_bits(u) - kSqrtHalfBits;
  const int32_t exponent = static_cast<int32_t>(shifted) >> 23;  // floor(log2(u / sqrt(1/2)))
  const float m = bits_to_float((shifted & 0x007FFFFFu) + kSqrtHalfBits);  // [sqrt(1/2), sqrt(2))
  const float s = (m - 1.0f) / (m + 1.0f);
  const float s2 = s * s;
  const float series = 1.0f + s2 * (0.33333333f + s2 * (0.2f + s2 * (0.14285714f + s2 * 0.11111111f)));
  return static_cast<float>(exponent) * 0.69314718f + 2.0f * s * series;
}

// sin(x) for |x| <= pi/2 by its Taylor series to x^13 (truncation error below 7e-10), branch-free.
SPLITZ_HD float sin_half_pi(float x) {
  const float x2 = x * x;
  return x * (1.0f + x2 * (-1.66666667e-1f + x2 * (8.33333333e-3f + x2 * (-1.98412698e-4f + x2 * (2.75573192e-6f
         + x2 * (-2.50521084e-8f + x2 * 1.60590438e-10f))))));
}

// r = sqrt(-2 ln u1); max(., 0) guards an approximate ln that returned a tiny positive value just below 1.
SPLITZ_HD float box_muller_radius(float u1) {
  const float r2 = -2.0f * log_positive(u1);
  return sqrtf(r2 > 0.0f ? r2 : 0.0f);
}

// cos(2 pi u) and sin(2 pi u) for u in [-1/2, 1/2], branch-free, from sin on [-pi/2, pi/2] with v = |u|:
// cos(2 pi u) = sin(2 pi (1/4 - v)) and sin(2 pi u) = sign(u) sin(2 pi (1/4 - |v - 1/4|)).
SPLITZ_HD void cos_sin_two_pi(float u, float& c, float& s) {
  const uint32_t sign = float_to_bits(u) & 0x80000000u;
  const float v = bits_to_float(float_to_bits(u) ^ sign);
  const float d = v - 0.25f;
  const float w = 0.25f - bits_to_float(float_to_bits(d) & 0x7FFFFFFFu);
  c = sin_half_pi(6.28318531f * (0.25f - v));
  s = bits_to_float(float_to_bits(sin_half_pi(6.28318531f * w)) ^ sign);
}

// float32 -> bfloat16 bits, round to nearest even (torch's rule), NaN -> canonical 0x7FC0.
SPLITZ_HD uint16_t bfloat16_bits(float value) {
  const uint32_t bits = float_to_bits(value);
  const uint16_t rounded = static_cast<uint16_t>((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
  return value != value ? static_cast<uint16_t>(0x7FC0u) : rounded;
}

}  // namespace splitz
