// l2l eager param-server (EPS) kernels: gradient reduction, AdamW, device copy.
//
// Bit-exact with the NumPy golden model (host/l2l/eps/numerics.py) under the
// contract shared/spec/eps-numerics.md: every operation one binary32 op, round
// to nearest even, no contraction into FMA, subnormals kept, correctly rounded
// divide and sqrt. Build with -cl-fp32-correctly-rounded-divide-sqrt and never
// with -cl-fast-relaxed-math or -cl-denorms-are-zero.
//
// Argument order (fpga/ARGS.md; the same for the HLS and RTL kernels):
// buffers first, then n (and k for the reduction), then the step scalars in
// the contract's table order.
//
// One work-item handles one element; the work-group vectoriser of the OpenCL
// compiler (PoCL) or the HLS pipeline of an FPGA compiler turns the loop body
// into SIMD lanes. Kernels are instantiated per gradient / copy dtype:
// _f32 (float), _bf16 (bfloat16 bits in ushort), _f16 (binary16 bits in ushort).

#pragma OPENCL FP_CONTRACT OFF

// ---------------------------------------------------------------- conversions

inline float widen_f32(__global const float *g, size_t i) { return g[i]; }
inline float widen_bf16(__global const ushort *g, size_t i) { return as_float(((uint)g[i]) << 16); }
inline float widen_f16(__global const ushort *g, size_t i) { return vload_half(i, (__global const half *)g); }

inline void store_f32(__global float *c, size_t i, float x) { c[i] = x; }
inline void store_bf16(__global ushort *c, size_t i, float x) {
    uint b = as_uint(x);
    if ((b & 0x7fffffffu) > 0x7f800000u) {            // NaN stays NaN (quiet)
        c[i] = (ushort)((b >> 16) | 0x0040u);
    } else {                                          // round to nearest, ties to even
        c[i] = (ushort)((b + 0x7fffu + ((b >> 16) & 1u)) >> 16);
    }
}
inline void store_f16(__global ushort *c, size_t i, float x) { vstore_half_rte(x, i, (__global half *)c); }

// ---------------------------------------------------------------- reduction
// g_out[i] = ((g[0][i] + g[1][i]) + ... + g[k-1][i]) * inv_scale; the k
// contributions lie one after another in `g` (k * n elements). `finite` is set
// to 1 by the host before the launch; any non-finite result clears it.

#define EPS_REDUCE(SUFFIX, GT)                                                        \
__kernel void eps_reduce_##SUFFIX(__global const GT *g, __global float *g_out,       \
                                  __global int *finite, const uint n, const uint k,   \
                                  const float inv_scale) {                           \
    const size_t i = get_global_id(0);                                                \
    if (i >= n) return;                                                               \
    float acc = widen_##SUFFIX(g, i);                                                 \
    for (uint c = 1; c < k; ++c) acc = acc + widen_##SUFFIX(g, (size_t)c * n + i);    \
    const float r = acc * inv_scale;                                                  \
    g_out[i] = r;                                                                     \
    if (!isfinite(r)) *finite = 0;                                                    \
}

EPS_REDUCE(f32, float)
EPS_REDUCE(bf16, ushort)
EPS_REDUCE(f16, ushort)

// ---------------------------------------------------------------- AdamW + copy
// In place on p, m, v from the reduced gradient g, then the device copy of p'.
// A layer whose finite flag is 0 is left untouched.

#define EPS_ADAMW(SUFFIX, CT)                                                         \
__kernel void eps_adamw_##SUFFIX(__global float *p, __global float *m,               \
                                 __global float *v, __global const float *g,          \
                                 __global CT *copy, __global const int *finite,       \
                                 const uint n,                                        \
                                 const float decay, const float b1, const float omb1, \
                                 const float b2, const float omb2,                    \
                                 const float inv_bc2_sqrt, const float eps,           \
                                 const float neg_step) {                              \
    const size_t i = get_global_id(0);                                                \
    if (i >= n || *finite == 0) return;                                               \
    const float gi = g[i];                                                            \
    const float p1 = p[i] * decay;                                                    \
    const float t1 = b1 * m[i];                                                       \
    const float t2 = omb1 * gi;                                                       \
    const float m1 = t1 + t2;                                                         \
    const float gg = gi * gi;                                                         \
    const float t3 = omb2 * gg;                                                       \
    const float t4 = b2 * v[i];                                                       \
    const float v1 = t4 + t3;                                                         \
    const float s = sqrt(v1);                                                         \
    const float s1 = s * inv_bc2_sqrt;                                                \
    const float d = s1 + eps;                                                         \
    const float q = m1 / d;                                                           \
    const float u = neg_step * q;                                                     \
    const float p2 = p1 + u;                                                          \
    p[i] = p2;                                                                        \
    m[i] = m1;                                                                        \
    v[i] = v1;                                                                        \
    store_##SUFFIX(copy, i, p2);                                                      \
}

EPS_ADAMW(f32, float)
EPS_ADAMW(bf16, ushort)
EPS_ADAMW(f16, ushort)

// ---------------------------------------------------------------- copy only
// The device copy of the current master weights (after allocate or load).

#define EPS_COPY(SUFFIX, CT)                                                          \
__kernel void eps_copy_##SUFFIX(__global const float *p, __global CT *copy,          \
                                const uint n) {                                       \
    const size_t i = get_global_id(0);                                                \
    if (i >= n) return;                                                               \
    store_##SUFFIX(copy, i, p[i]);                                                    \
}

EPS_COPY(f32, float)
EPS_COPY(bf16, ushort)
EPS_COPY(f16, ushort)
