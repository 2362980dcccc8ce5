// l2l eager param-server (EPS) kernels in Vitis HLS C++: finite check, fused
// reduce + AdamW + device copy, and copy alone.
//
// The same kernels, kernel names and argument order as fpga/opencl/eps.cl
// (fpga/ARGS.md: buffers first, then n and k, then the step scalars in the
// contract's table order), computing the same bits: docs/eps-numerics.md.
// Every operation is one binary32 operation rounded to nearest even, written as
// its own statement; build with -ffp-contract=off and never with -ffast-math.
// Not checked here (no Vitis in CI): that the synthesised floating-point cores
// keep subnormals and round to nearest even as the contract requires; a
// hardware build must be checked against the NumPy model like this C-sim is.
//
// As plain C++17 (no HLS headers) the file is also the C-simulation model:
// host/l2l/eps/hls_csim_backend.py compiles it with g++ into a shared library
// and runs the kernels on host arrays; tests/test_eps_hls.py checks them bit for
// bit against the NumPy golden model. g++ ignores the HLS pragmas
// (-Wno-unknown-pragmas).
//
// Dtypes: gradients G and device copy C are each f32 (float), bf16 (bfloat16
// bits in uint16_t) or f16 (binary16 bits in uint16_t); one top function per
// combination: eps_check_<G>, eps_update_<G>_<C>, eps_copy_<C>.
//
// Dataflow: elements are processed in tiles of TILE. Per tile the K
// contributions are read one after another, each as one burst of TILE
// elements, and added into a local accumulator array in contribution order
// (acc = g_0; acc = acc + g_1; ...: the contract's left fold per element); the
// adder's latency is hidden across the tile's elements, so every element loop
// runs at II=1 whatever K is. Then p, m, v are read, updated and written (and
// the copy written) in one more pass over the tile.

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>

#if defined(__GNUC__) && !defined(__SYNTHESIS__)
#pragma GCC diagnostic ignored "-Wunused-label"  // loop labels name the loops in HLS reports
#endif

namespace eps {

constexpr unsigned TILE = 1024;  // elements per tile: 4 KiB per burst of fp32

// ---------------------------------------------------------------- bit casts

inline uint32_t bits_of(float x) {
    uint32_t b;
    std::memcpy(&b, &x, sizeof b);
    return b;
}

inline float float_of(uint32_t b) {
    float x;
    std::memcpy(&x, &b, sizeof x);
    return x;
}

inline bool is_finite(float x) { return (bits_of(x) & 0x7f800000u) != 0x7f800000u; }

// ---------------------------------------------------------------- widening (exact)

struct F32 {
    typedef float T;
    static float wide(float g) { return g; }
    static float narrow(float x) { return x; }
};

struct BF16 {
    typedef uint16_t T;
    static float wide(uint16_t g) { return float_of(static_cast<uint32_t>(g) << 16); }
    // round to nearest even on the bit pattern; overflow carries into inf; NaN stays NaN
    // (quiet bit set, as eps.cl does, so a NaN with a payload in the low 16 bits only
    // does not become inf)
    static uint16_t narrow(float x) {
        const uint32_t b = bits_of(x);
        if ((b & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((b >> 16) | 0x0040u);
        return static_cast<uint16_t>((b + 0x7fffu + ((b >> 16) & 1u)) >> 16);
    }
};

struct F16 {
    typedef uint16_t T;
    static float wide(uint16_t h) {
        const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
        const uint32_t e = (h >> 10) & 0x1fu;
        uint32_t man = h & 0x3ffu;
        if (e == 0x1fu) return float_of(sign | 0x7f800000u | (man << 13));  // inf, NaN (payload kept)
        if (e != 0) return float_of(sign | ((e + 112u) << 23) | (man << 13));  // normal: rebias 15 -> 127
        if (man == 0) return float_of(sign);                                   // signed zero
        // subnormal: man * 2**-24, normal in binary32; shift the leading one to bit 10
        uint32_t ex = 113u;  // exponent field of 2**-14
        while ((man & 0x400u) == 0) {
            man <<= 1;
            --ex;
        }
        return float_of(sign | (ex << 23) | ((man & 0x3ffu) << 13));
    }
    // round to nearest even; subnormal results kept; overflow to signed inf; NaN stays NaN
    static uint16_t narrow(float x) {
        const uint32_t b = bits_of(x);
        const uint32_t sign = (b >> 16) & 0x8000u;
        const uint32_t a = b & 0x7fffffffu;
        if (a > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u | ((a >> 13) & 0x3ffu));
        if (a >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // >= 65520: inf
        if (a >= 0x38800000u) {                                               // >= 2**-14: normal
            const uint32_t r = a - 0x38000000u;                               // rebias 127 -> 15
            return static_cast<uint16_t>(sign | ((r + 0xfffu + ((r >> 13) & 1u)) >> 13));
        }
        // subnormal or zero: quanta of 2**-24; a = mant * 2**(e - 150) with e >= 1
        const uint32_t e = a >> 23;
        if (e < 102u) return static_cast<uint16_t>(sign);  // below 2**-25: rounds to zero
        const uint32_t mant = (a & 0x7fffffu) | 0x800000u;
        const uint32_t s = 126u - e;  // 14 .. 24 bits discarded
        uint32_t r = mant >> s;
        const uint32_t rem = mant & ((1u << s) - 1u);
        const uint32_t half = 1u << (s - 1u);
        if (rem > half || (rem == half && (r & 1u))) r = r + 1u;  // a carry gives 2**-14 exactly
        return static_cast<uint16_t>(sign | r);
    }
};

// ---------------------------------------------------------------- reduction of one tile
// acc[i] = ((g_0[i] + g_1[i]) + ... + g_{k-1}[i]) for the tile's elements.

template <class G>
void reduce_tile(const typename G::T *g, float acc[TILE], unsigned n, unsigned k, uint64_t base,
                 unsigned len) {
first:
    for (unsigned i = 0; i < len; ++i) {
#pragma HLS PIPELINE II=1
        acc[i] = G::wide(g[base + i]);
    }
contributions:
    for (unsigned c = 1; c < k; ++c) {
        const typename G::T *gc = g + static_cast<uint64_t>(c) * n + base;
    add:
        for (unsigned i = 0; i < len; ++i) {
#pragma HLS PIPELINE II=1
#pragma HLS DEPENDENCE variable=acc inter false
            const float x = G::wide(gc[i]);
            const float sum = acc[i] + x;
            acc[i] = sum;
        }
    }
}

// ---------------------------------------------------------------- finite check
// Clears *finite (set to 1 by the host) when any reduced gradient element
// ((g_0 + g_1) + ... + g_{k-1}) * inv_scale is inf or NaN. Reads the gradients only.

template <class G>
void check(const typename G::T *g, int *finite, unsigned n, unsigned k, float inv_scale) {
    int ok = 1;
    float acc[TILE];
tiles:
    for (uint64_t base = 0; base < n; base += TILE) {  // 64 bits: no wrap for n near 2**32
        const unsigned len = (n - base < TILE) ? static_cast<unsigned>(n - base) : TILE;
        reduce_tile<G>(g, acc, n, k, base, len);
    scale:
        for (unsigned i = 0; i < len; ++i) {
#pragma HLS PIPELINE II=1
            const float gi = acc[i] * inv_scale;
            if (!is_finite(gi)) ok = 0;
        }
    }
    if (ok == 0) *finite = 0;
}

// ---------------------------------------------------------------- update
// One pass: reduce the k contributions, AdamW in place on p, m, v, write the
// device copy of p'. Does nothing when *finite is 0 (the layer is untouched).

template <class G, class C>
void update(const typename G::T *gr, float *p, float *m, float *v, typename C::T *copy,
            const int *finite, unsigned n, unsigned k, float decay, float b1, float omb1, float b2,
            float omb2, float inv_bc2_sqrt, float eps, float neg_step, float inv_scale) {
    if (*finite == 0) return;
    float acc[TILE];
tiles:
    for (uint64_t base = 0; base < n; base += TILE) {  // 64 bits: no wrap for n near 2**32
        const unsigned len = (n - base < TILE) ? static_cast<unsigned>(n - base) : TILE;
        reduce_tile<G>(gr, acc, n, k, base, len);
    adamw:
        for (unsigned i = 0; i < len; ++i) {
#pragma HLS PIPELINE II=1
            const uint64_t j = base + i;
            const float g = acc[i] * inv_scale;
            const float p0 = p[j];
            const float m0 = m[j];
            const float v0 = v[j];
            // the contract's order: every parenthesised product and each sum on its own
            const float p1 = p0 * decay;              // p1 = p * decay
            const float b1m = b1 * m0;                // b1 * m
            const float omb1g = omb1 * g;             // omb1 * g
            const float m1 = b1m + omb1g;             // m' = (b1*m) + (omb1*g)
            const float gg = g * g;                   // g * g
            const float omb2gg = omb2 * gg;           // omb2 * (g*g)
            const float b2v = b2 * v0;                // b2 * v
            const float v1 = b2v + omb2gg;            // v' = (b2*v) + (omb2*(g*g))
            const float sq = std::sqrt(v1);           // sqrt(v')
            const float sc = sq * inv_bc2_sqrt;       // sqrt(v') * inv_bc2_sqrt
            const float d = sc + eps;                 // d = (...) + eps
            const float q = m1 / d;                   // m' / d
            const float ns = neg_step * q;            // neg_step * (m'/d)
            const float p2 = p1 + ns;                 // p' = p1 + (...)
            p[j] = p2;
            m[j] = m1;
            v[j] = v1;
            copy[j] = C::narrow(p2);
        }
    }
}

// ---------------------------------------------------------------- copy only

template <class C>
void copy_only(const float *p, typename C::T *copy, unsigned n) {
elements:
    for (unsigned i = 0; i < n; ++i) {
#pragma HLS PIPELINE II=1
        copy[i] = C::narrow(p[i]);
    }
}

}  // namespace eps

// ---------------------------------------------------------------- top functions
// Thin instantiations. Each array argument has a bundle (AXI master) of its own,
// so each can sit in its own HBM/DDR bank; scalars and the control go through
// the one s_axilite slave (an ap_ctrl_hs register map, buffers as 64-bit addresses).

#define EPS_PRAGMA(x) _Pragma(#x)
#define EPS_MAXI(port, bundle) \
    EPS_PRAGMA(HLS INTERFACE m_axi port=port offset=slave bundle=bundle max_widen_bitwidth=512)
#define EPS_LITE(port) EPS_PRAGMA(HLS INTERFACE s_axilite port=port)

#define EPS_CHECK(GN, G)                                                                      \
    extern "C" void eps_check_##GN(const G::T *g, int *finite, unsigned n, unsigned k,         \
                                   float inv_scale) {                                          \
        EPS_MAXI(g, gmem0)                                                                     \
        EPS_MAXI(finite, gmem1)                                                                \
        EPS_LITE(n)                                                                            \
        EPS_LITE(k)                                                                            \
        EPS_LITE(inv_scale)                                                                    \
        EPS_LITE(return)                                                                       \
        eps::check<G>(g, finite, n, k, inv_scale);                                             \
    }

#define EPS_UPDATE(GN, G, CN, C)                                                              \
    extern "C" void eps_update_##GN##_##CN(                                                    \
        const G::T *gr, float *p, float *m, float *v, C::T *copy, const int *finite,           \
        unsigned n, unsigned k, float decay, float b1, float omb1, float b2, float omb2,       \
        float inv_bc2_sqrt, float eps, float neg_step, float inv_scale) {                      \
        EPS_MAXI(gr, gmem0)                                                                    \
        EPS_MAXI(p, gmem1)                                                                     \
        EPS_MAXI(m, gmem2)                                                                     \
        EPS_MAXI(v, gmem3)                                                                     \
        EPS_MAXI(copy, gmem4)                                                                  \
        EPS_MAXI(finite, gmem5)                                                                \
        EPS_LITE(n)                                                                            \
        EPS_LITE(k)                                                                            \
        EPS_LITE(decay)                                                                        \
        EPS_LITE(b1)                                                                           \
        EPS_LITE(omb1)                                                                         \
        EPS_LITE(b2)                                                                           \
        EPS_LITE(omb2)                                                                         \
        EPS_LITE(inv_bc2_sqrt)                                                                 \
        EPS_LITE(eps)                                                                          \
        EPS_LITE(neg_step)                                                                     \
        EPS_LITE(inv_scale)                                                                    \
        EPS_LITE(return)                                                                       \
        eps::update<G, C>(gr, p, m, v, copy, finite, n, k, decay, b1, omb1, b2, omb2,          \
                          inv_bc2_sqrt, eps, neg_step, inv_scale);                             \
    }

#define EPS_COPY(CN, C)                                                                       \
    extern "C" void eps_copy_##CN(const float *p, C::T *copy, unsigned n) {                    \
        EPS_MAXI(p, gmem0)                                                                     \
        EPS_MAXI(copy, gmem1)                                                                  \
        EPS_LITE(n)                                                                            \
        EPS_LITE(return)                                                                       \
        eps::copy_only<C>(p, copy, n);                                                         \
    }

EPS_CHECK(f32, eps::F32)
EPS_CHECK(bf16, eps::BF16)
EPS_CHECK(f16, eps::F16)

#define EPS_UPDATE_ALL_COPIES(GN, G)      \
    EPS_UPDATE(GN, G, f32, eps::F32)      \
    EPS_UPDATE(GN, G, bf16, eps::BF16)    \
    EPS_UPDATE(GN, G, f16, eps::F16)

EPS_UPDATE_ALL_COPIES(f32, eps::F32)
EPS_UPDATE_ALL_COPIES(bf16, eps::BF16)
EPS_UPDATE_ALL_COPIES(f16, eps::F16)

EPS_COPY(f32, eps::F32)
EPS_COPY(bf16, eps::BF16)
EPS_COPY(f16, eps::F16)
