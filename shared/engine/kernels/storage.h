/* Element access for the kernels' two storage types: float32, or bfloat16 (`bf16` set) computed in
 * float32. Rounding to bfloat16 is to nearest even, as torch's. */
#ifndef SPLITSERVE_STORAGE_H
#define SPLITSERVE_STORAGE_H

#include <stdint.h>
#include <string.h>

static inline __attribute__((always_inline)) float ld(const void *p, int64_t i, int bf16) {
    if (!bf16) return ((const float *)p)[i];
    uint32_t bits = (uint32_t)((const uint16_t *)p)[i] << 16;
    float f; memcpy(&f, &bits, 4); return f;
}

static inline __attribute__((always_inline)) uint32_t bf16_bits(float x) {
    uint32_t bits; memcpy(&bits, &x, 4);
    return (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16;
}

/* Round to the storage type and back (identity for float32). */
static inline __attribute__((always_inline)) float rnd(float x, int bf16) {
    if (!bf16) return x;
    uint32_t bits = bf16_bits(x) << 16;
    float f; memcpy(&f, &bits, 4); return f;
}

static inline __attribute__((always_inline)) void st(void *p, int64_t i, float x, int bf16) {
    if (!bf16) { ((float *)p)[i] = x; return; }
    ((uint16_t *)p)[i] = (uint16_t)bf16_bits(x);
}

#endif
