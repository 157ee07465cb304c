// Host-side pieces of the noise stream (contract: philox.h) shared by the CPU kernels of noise_cpu.cpp and
// train_cpu.cpp: the ISA clones macro and the loop that draws whole Philox pairs in stream order.
#pragma once
#include <algorithm>
#include <cstdint>

#include "philox.h"

// target_clones: GCC compiles the function for x86-64-v4 (AVX-512), x86-64-v3 (AVX2) and baseline x86-64 and picks
// one when the library loads, so a build cached on one machine stays correct (and fast) on another.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define SPLITZ_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define SPLITZ_CLONES
#endif

namespace splitz {

constexpr int64_t kPairBlock = 128;  // Philox calls per inner block (their words are staged on the stack)

// z[2 p], z[2 p + 1] = the stream's numbers of the pairs first_pair + p, p < pairs (r cos, r sin of one Philox call).
// Two loops (Philox words, then Box-Muller) because GCC vectorises each but not the two fused.
static SPLITZ_CLONES void stream_pairs(uint64_t first_pair, int64_t pairs, uint32_t k0, uint32_t k1,
                                       float* __restrict z) {
  uint32_t w0[kPairBlock], w1[kPairBlock], w2[kPairBlock];
  for (int64_t start = 0; start < pairs; start += kPairBlock) {
    const int64_t count = std::min(kPairBlock, pairs - start);
    const uint64_t counter0 = first_pair + static_cast<uint64_t>(start);
    for (int64_t i = 0; i < count; ++i) {
      const uint64_t counter = counter0 + static_cast<uint64_t>(i);
      philox_words(static_cast<uint32_t>(counter), static_cast<uint32_t>(counter >> 32), k0, k1, w0[i], w1[i], w2[i]);
    }
    float* __restrict out = z + 2 * start;
    for (int64_t i = 0; i < count; ++i) {
      float u1, u2, c, s;
      box_muller_uniforms(w0[i], w1[i], w2[i], u1, u2);
      const float r = box_muller_radius(u1);
      cos_sin_two_pi(u2, c, s);
      out[2 * i] = r * c;
      out[2 * i + 1] = r * s;
    }
  }
}

}  // namespace splitz
