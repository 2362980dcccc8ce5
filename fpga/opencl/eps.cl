// l2l eager param-server (EPS) kernels: finite check, fused reduce + AdamW (or
// Lion) + device copy, LAMB's two passes, and copy alone.
//
// Bit-exact with the NumPy golden model (host/l2l/eps/numerics.py) under the
// contract docs/eps-numerics.md: every operation one binary32 op, round
// to nearest even, no contraction into FMA, subnormals kept, correctly rounded
// divide and sqrt. Build with -cl-fp32-correctly-rounded-divide-sqrt and never
// with -cl-fast-relaxed-math or -cl-denorms-are-zero. Vector types are used
// for throughput only: OpenCL vector arithmetic is per-component IEEE.
//
// Argument order (fpga/ARGS.md; the same for the HLS and RTL kernels):
// buffers first, then n and k (and n_decay for the updates, nseg for LAMB's),
// then the step scalars in the contract's table order (Lion's, LAMB's: their own
// tables).
//
// Work split: vector j holds elements [VW j, VW j + VW) (VW below), and the
// n % VW tail is done element by element. A kernel cuts its n / VW vectors
// into equal regions (eps_check 4, 2 or 1 by the number of contributions, the
// others 1) and each region into get_global_size(0) contiguous chunks;
// work-item c walks chunk c of every region in lockstep, and the last
// work-item also takes the vectors left over past the regions and the tail.
// So one launch shape fits every device: on a CPU, a few hundred work-items,
// each a long sequential stream per array (short interleaved spans per
// work-item: the check measured 20% slower); on a GPU, a work-item per
// vector, adjacent items on adjacent vectors; on an FPGA, a single work-item
// that walks everything, the shape of a kernel run as a task. (LAMB's norm
// pass is the exception: its work-items own whole segments; see its section.)
//
// Dtypes: gradients G and device copy C are each f32 (float), bf16 (bfloat16
// bits in ushort) or f16 (binary16 bits in ushort); kernels are instantiated
// per combination and named eps_update_<G>_<C> (AdamW), eps_lion_<G>_<C> (Lion),
// eps_lamb_norms_<G> and eps_lamb_step_<C> (LAMB), eps_check_<G>, eps_copy_<C>.

#pragma OPENCL FP_CONTRACT OFF

// VW, the vector width: 8 (float8, AVX2-sized) or 16 (float16, one AVX-512
// register). The host builds with -DVW=16 for devices whose preferred float
// vector is 16 wide: on an AVX-512 CPU the update then runs about 5% faster
// when the host grants high memory bandwidth, where its divides and square
// roots, not memory, set the pace.
#ifndef VW
#define VW 8
#endif
#if VW == 8
#define floatV float8
#define uintV uint8
#define ushortV ushort8
#define floatH float4            /* VW ushorts seen as floats (the bf16 streaming store) */
#define vload_halfV vload_half8
#define vstore_halfV_rte vstore_half8_rte
#define convert_uintV convert_uint8
#define convert_ushortV convert_ushort8
#define intV int8
#define LANES ((int8)(0, 1, 2, 3, 4, 5, 6, 7))   /* each lane's index in its vector */
#define as_floatV as_float8
#define as_floatH as_float4
#define as_uintV as_uint8
#define NT_REG "x"               /* a ymm register for floatV (floatH always takes "x") */
#elif VW == 16
#define floatV float16
#define uintV uint16
#define ushortV ushort16
#define floatH float8
#define vload_halfV vload_half16
#define vstore_halfV_rte vstore_half16_rte
#define convert_uintV convert_uint16
#define convert_ushortV convert_ushort16
#define intV int16
#define LANES ((int16)(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15))
#define as_floatV as_float16
#define as_floatH as_float8
#define as_uintV as_uint16
#define NT_REG "v"               /* a zmm register (AVX-512) */
#else
#error "VW must be 8 or 16"
#endif
// float16 on an x86 target without AVX-512 (PoCL 3.0's generic CPU target, where its LLVM
// does not know the host's CPU model, still prefers float16) builds into no kernels and
// leaves that PoCL unable to exit cleanly: refuse it here, before any code is made, and
// the host builds float8 instead (opencl_backend.py).
#if VW == 16 && defined(__x86_64__) && !defined(__AVX512F__)
#error "VW=16 needs AVX-512 on an x86 target"
#endif

// Whole-vector loads and stores at element alignment: one unaligned vector
// instruction each (vmovups). PoCL 3.1's vload16/vstore16 split each access
// into two loads, or three stores, and the update measured 3-6% slower so.
typedef floatV __attribute__((aligned(4))) floatV_e;
typedef ushortV __attribute__((aligned(2))) ushortV_e;
#define LOADF(j, ptr) (*(__global const floatV_e *)((ptr) + VW * (size_t)(j)))
#define STOREF(x, j, ptr) (*(__global floatV_e *)((ptr) + VW * (size_t)(j)) = (x))
#define LOADU(j, ptr) (*(__global const ushortV_e *)((ptr) + VW * (size_t)(j)))
#define STOREU(x, j, ptr) (*(__global ushortV_e *)((ptr) + VW * (size_t)(j)) = (x))

// ---------------------------------------------------------------- work split

// First vector of chunk c of g chunks over len vectors (64-bit: c * len may pass 2^32).
inline size_t chunk_start(size_t len, size_t c, size_t g) { return (size_t)(((ulong)c * len) / g); }

// ---------------------------------------------------------------- widening (exact)

inline floatV wideV_f32(__global const float *g, size_t j) { return LOADF(j, g); }
inline float  wide1_f32(__global const float *g, size_t i) { return g[i]; }
inline floatV wideV_bf16(__global const ushort *g, size_t j) { return as_floatV(convert_uintV(LOADU(j, g)) << 16); }
inline float  wide1_bf16(__global const ushort *g, size_t i) { return as_float(((uint)g[i]) << 16); }
inline floatV wideV_f16(__global const ushort *g, size_t j) { return vload_halfV(j, (__global const half *)g); }
inline float  wide1_f16(__global const ushort *g, size_t i) { return vload_half(i, (__global const half *)g); }

// ---------------------------------------------------------------- device copy (round to nearest even)

inline void storeV_f32(__global float *c, size_t j, floatV x) { STOREF(x, j, c); }
inline void store1_f32(__global float *c, size_t i, float x) { c[i] = x; }
inline ushortV bf16_rneV(floatV x) {
    const uintV b = as_uintV(x);
    const uintV rounded = (b + (uintV)0x7fffu + ((b >> 16) & (uintV)1u)) >> 16;
    const uintV quiet_nan = (b >> 16) | (uintV)0x0040u;        // NaN stays NaN
    return convert_ushortV(select(rounded, quiet_nan, (b & (uintV)0x7fffffffu) > (uintV)0x7f800000u));
}
inline void storeV_bf16(__global ushort *c, size_t j, floatV x) { STOREU(bf16_rneV(x), j, c); }
inline void store1_bf16(__global ushort *c, size_t i, float x) {
    const uint b = as_uint(x);
    c[i] = (ushort)(((b & 0x7fffffffu) > 0x7f800000u) ? ((b >> 16) | 0x0040u)
                                                      : ((b + 0x7fffu + ((b >> 16) & 1u)) >> 16));
}
inline void storeV_f16(__global ushort *c, size_t j, floatV x) { vstore_halfV_rte(x, j, (__global half *)c); }
inline void store1_f16(__global ushort *c, size_t i, float x) { vstore_half_rte(x, i, (__global half *)c); }

// ---------------------------------------------------------------- streaming stores (x86 CPU devices)
// The device copy is a write-only stream. A plain store first reads each line
// of it into cache (write-allocate): 4 more bytes per element on the update's
// 36, and measured 20% of the update's time on PoCL. x86 non-temporal stores
// write whole lines without that read. The host defines L2L_NT_STORES only
// when the device is the x86 CPU it runs on (opencl_backend.py); the update
// uses them only when the copy buffer is aligned for them (a whole register:
// 4 VW bytes for an fp32 copy, 2 VW for a 16-bit one) and is not p itself (on
// a CPU device the fp32 masters serve as their own copy: a streaming store to
// the line just stored to made the update 7.6 times slower, a plain one costs
// nothing), and fences once per work-item (they are weakly ordered).
// Only the route of the bits to memory changes, never the bits. p, m and v,
// read just before they are written, gain nothing from it (streaming them too
// measured slower when the host grants more bandwidth, and alike otherwise).
// (__builtin_nontemporal_store crashes PoCL 3.1's compiler, hence inline
// assembly.)

// A streaming store takes a whole register: a ymm (AVX) for float8 (float16 is only built
// with AVX-512, above). A target compiled without AVX keeps plain stores.
#if defined(L2L_NT_STORES) && VW == 8 && !defined(__AVX__)
#undef L2L_NT_STORES
#endif

#ifdef L2L_NT_STORES
#define NT_ALIGN_f32 (4 * VW - 1)   /* a whole vector register: 32 or 64 bytes */
#define NT_ALIGN_bf16 (2 * VW - 1)
#define NT_ALIGN_f16 (2 * VW - 1)
inline void storeVnt_f32(__global float *c, size_t j, floatV x) {
    __asm__ volatile ("vmovntps %1, %0" : "=m"(*(__global floatV *)(c + VW * j)) : NT_REG(x));
}
inline void storeVnt_bf16(__global ushort *c, size_t j, floatV x) {
    __asm__ volatile ("vmovntps %1, %0" : "=m"(*(__global floatH *)(c + VW * j)) : "x"(as_floatH(bf16_rneV(x))));
}
inline void storeVnt_f16(__global ushort *c, size_t j, floatV x) { storeV_f16(c, j, x); }  // no integer RNE here
#define NT_FENCE() __asm__ volatile ("sfence" ::: "memory")
#endif

// ---------------------------------------------------------------- AdamW on one vector / element
// The contract's order: every parenthesised product and each sum rounded on its own.
// P1 is p1 as the decay boundary makes it: p0 * decay below n_decay, p0 itself past it.

#define ADAMW_BODY(T, P1)                                                              \
    const T p1 = (P1);                                                                 \
    const T m1 = (b1 * m0) + (omb1 * g);                                               \
    const T v1 = (b2 * v0) + (omb2 * (g * g));                                         \
    const T d = (sqrt(v1) * inv_bc2_sqrt) + eps;                                       \
    const T p2 = p1 + (neg_step * (m1 / d));

// ---------------------------------------------------------------- finite check
// Clears *finite (set to 1 by the host) when any reduced gradient element
// ((g_0 + g_1) + ... + g_{k-1}) * inv_scale is inf or NaN. Reads the gradients
// only: the update pass recomputes the sum instead of storing it.
//
// It is a pure read stream, so it must run at read bandwidth, and on two
// cores that takes care: each work-item walks its chunk of every region at
// once (four regions for one contribution, two for two or three, one for
// more: about four streams in all keep more lines in flight than one),
// CHECK_UNROLL vectors of each per iteration. The verdict is the largest
// magnitude seen, kept as integer bits in CHECK_UNROLL independent registers:
// an element is inf or NaN exactly when its magnitude bits reach the all-ones
// exponent, 0x7f800000 (the same verdict as isfinite). One integer max per
// vector and one store at most. Measured on this project's 2-core host, as a
// share of the memory roofline: one region, one vector per iteration, about
// 60%; four regions, eight vectors per iteration, about 80%, where torch.sum
// reads at 85-90%. Per-vector isfinite with a branch ran at half the read
// bandwidth; eight regions measured slower than four. Software prefetch 16 KiB
// ahead sped the check up alone but slowed it inside a step, where it runs
// while the previous update's dirty lines drain.

#define CHECK_UNROLL 8   /* vectors of each region a pass: CHECK_ONE written out 8 times below */
// Regions for k contributions: about four streams (regions x contributions) at once.
inline size_t check_regions(uint k) { return k >= 4 ? 1 : k >= 2 ? 2 : 4; }
#define MAGNITUDE_V(x) (as_uintV(x) & (uintV)0x7fffffffu)
#define REDUCEV(G, g, j, n, k, acc)                                                    \
    floatV acc = wideV_##G(g, j);                                                      \
    for (uint c_ = 1; c_ < k; ++c_) acc = acc + wideV_##G(g + (size_t)c_ * n, j);
#define REDUCE1(G, g, i, n, k, acc)                                                    \
    float acc = wide1_##G(g, i);                                                       \
    for (uint c_ = 1; c_ < k; ++c_) acc = acc + wide1_##G(g, (size_t)c_ * n + i);

// One vector of the check into accumulator top##u (a macro: PoCL keeps an
// array of accumulators in memory, not in registers).
#define CHECK_ONE(G, g, j, n, k, u)                                                    \
    { REDUCEV(G, g, j, n, k, acc##u) top##u = max(top##u, MAGNITUDE_V(acc##u * inv_scale)); }

#define EPS_CHECK(G, GT)                                                               \
__kernel void eps_check_##G(__global const GT *g, __global int *finite,                \
                            const uint n, const uint k, const float inv_scale) {       \
    const size_t nv = n / VW, items = get_global_size(0), me = get_global_id(0);       \
    const size_t regions = check_regions(k), region = nv / regions;                    \
    const size_t lo = chunk_start(region, me, items), hi = chunk_start(region, me + 1, items); \
    uintV top0 = (uintV)0, top1 = (uintV)0, top2 = (uintV)0, top3 = (uintV)0;          \
    uintV top4 = (uintV)0, top5 = (uintV)0, top6 = (uintV)0, top7 = (uintV)0;          \
    int bad_tail = 0;                                                                  \
    size_t t = lo;                                                                     \
    /* one contribution, the common case: the same pass without a contributions loop */ \
    if (k == 1) for (; t + CHECK_UNROLL <= hi; t += CHECK_UNROLL) {                    \
        for (size_t r = 0; r < regions; ++r) {                                         \
            const size_t j = r * region + t;                                           \
            CHECK_ONE(G, g, j, n, 1, 0) CHECK_ONE(G, g, j + 1, n, 1, 1)                \
            CHECK_ONE(G, g, j + 2, n, 1, 2) CHECK_ONE(G, g, j + 3, n, 1, 3)            \
            CHECK_ONE(G, g, j + 4, n, 1, 4) CHECK_ONE(G, g, j + 5, n, 1, 5)            \
            CHECK_ONE(G, g, j + 6, n, 1, 6) CHECK_ONE(G, g, j + 7, n, 1, 7)            \
        }                                                                              \
    }                                                                                  \
    for (; t + CHECK_UNROLL <= hi; t += CHECK_UNROLL) {                                \
        for (size_t r = 0; r < regions; ++r) {                                         \
            const size_t j = r * region + t;                                           \
            CHECK_ONE(G, g, j, n, k, 0) CHECK_ONE(G, g, j + 1, n, k, 1)                \
            CHECK_ONE(G, g, j + 2, n, k, 2) CHECK_ONE(G, g, j + 3, n, k, 3)            \
            CHECK_ONE(G, g, j + 4, n, k, 4) CHECK_ONE(G, g, j + 5, n, k, 5)            \
            CHECK_ONE(G, g, j + 6, n, k, 6) CHECK_ONE(G, g, j + 7, n, k, 7)            \
        }                                                                              \
    }                                                                                  \
    for (; t < hi; ++t) {                                                              \
        for (size_t r = 0; r < regions; ++r) CHECK_ONE(G, g, r * region + t, n, k, 0)  \
    }                                                                                  \
    if (me == items - 1) {  /* the vectors past the regions, and the n % VW tail */    \
        for (size_t j = regions * region; j < nv; ++j) CHECK_ONE(G, g, j, n, k, 0)     \
        for (size_t i = nv * VW; i < n; ++i) {                                         \
            REDUCE1(G, g, i, n, k, acc)                                                \
            bad_tail |= !isfinite(acc * inv_scale);                                    \
        }                                                                              \
    }                                                                                  \
    const uintV top = max(max(max(top0, top1), max(top2, top3)), max(max(top4, top5), max(top6, top7))); \
    if (any(top >= (uintV)0x7f800000u) || bad_tail) *finite = 0;                       \
}

EPS_CHECK(f32, float)
EPS_CHECK(bf16, ushort)
EPS_CHECK(f16, ushort)

// ---------------------------------------------------------------- update
// One pass: reduce the k contributions, AdamW in place on p, m, v, write the
// device copy of p'. Does nothing when *finite is 0 (the layer is untouched).
// Each work-item walks one contiguous chunk (one region): five streams per
// thread already keep enough lines in flight (more regions measured alike).
// Streaming stores are weakly ordered: one fence when the work-item is done
// makes them visible before the kernel completes.

#ifdef L2L_NT_STORES
#define STREAMING(C, copy, p) ((((size_t)(copy)) & NT_ALIGN_##C) == 0 && (size_t)(copy) != (size_t)(p))
#define STOREV_COPY(C, copy, j, x, nt) do { if (nt) storeVnt_##C(copy, j, x); else storeV_##C(copy, j, x); } while (0)
#define FENCE_IF(nt) do { if (nt) NT_FENCE(); } while (0)
#else
#define STREAMING(C, copy, p) 0
#define STOREV_COPY(C, copy, j, x, nt) storeV_##C(copy, j, x)
#define FENCE_IF(nt) do { } while (0)
#endif

// The walk every update kernel makes (AdamW's eps_update, Lion's eps_lion), around the
// optimizer's own step on one vector, VEC(G, C, j, P1), and on one tail element, ONE(G, C, i)
// (P1 says how p1 comes from p0: the decay boundary). Does nothing when *finite is 0.
//
// Parameter groups: elements [0, n_decay) are decayed, the rest keep p1 = p0 (no
// multiply, exact). A chunk is walked in up to three runs so that the common loops
// stay as they were: the whole vectors below the boundary, the one vector that
// straddles it (n_decay % VW lanes decayed, a per-lane select), the whole vectors
// past it. An n_decay above n acts as n (the host never passes one).
#define UPDATE_WALK(G, C, VEC, ONE)                                                    \
    if (*finite == 0) return;                                                          \
    const size_t nv = n / VW, items = get_global_size(0), me = get_global_id(0);       \
    const size_t lo = chunk_start(nv, me, items), hi = chunk_start(nv, me + 1, items); \
    const int nt = STREAMING(C, copy, p);                                              \
    const size_t jd = n_decay / VW;          /* the first vector not wholly decayed */ \
    const int straddle = (int)(n_decay % VW); /* its decayed lanes */                  \
    size_t j = lo;                                                                     \
    for (const size_t e = min(hi, jd); j < e; ++j) VEC(G, C, j, p0 * decay)            \
    if (j == jd && j < hi && straddle != 0) {                                          \
        VEC(G, C, j, select(p0, p0 * decay, LANES < (intV)straddle))                   \
        ++j;                                                                           \
    }                                                                                  \
    for (; j < hi; ++j) VEC(G, C, j, p0)                                               \
    FENCE_IF(nt);                                                                      \
    if (me == items - 1)  /* the n % VW tail */                                        \
        for (size_t i = nv * VW; i < n; ++i) ONE(G, C, i)

// AdamW on vector j, and on tail element i.
#define ADAMW_V(G, C, j, P1)                                                           \
    {                                                                                  \
        REDUCEV(G, gr, j, n, k, acc)                                                   \
        const floatV g = acc * inv_scale;                                              \
        const floatV p0 = LOADF(j, p), m0 = LOADF(j, m), v0 = LOADF(j, v);             \
        ADAMW_BODY(floatV, P1)                                                         \
        STOREF(p2, j, p); STOREF(m1, j, m); STOREF(v1, j, v);                          \
        STOREV_COPY(C, copy, j, p2, nt);                                               \
    }
#define ADAMW_1(G, C, i)                                                               \
    {                                                                                  \
        REDUCE1(G, gr, i, n, k, acc)                                                   \
        const float g = acc * inv_scale;                                               \
        const float p0 = p[i], m0 = m[i], v0 = v[i];                                   \
        ADAMW_BODY(float, i < n_decay ? p0 * decay : p0)                               \
        p[i] = p2; m[i] = m1; v[i] = v1;                                               \
        store1_##C(copy, i, p2);                                                       \
    }

#define EPS_UPDATE(G, GT, C, CT)                                                       \
__kernel void eps_update_##G##_##C(                                                    \
        __global const GT *gr, __global float *p, __global float *m,                   \
        __global float *v, __global CT *copy, __global const int *finite,              \
        const uint n, const uint k, const uint n_decay,                                \
        const float decay, const float b1, const float omb1, const float b2,           \
        const float omb2, const float inv_bc2_sqrt, const float eps,                   \
        const float neg_step, const float inv_scale) {                                 \
    UPDATE_WALK(G, C, ADAMW_V, ADAMW_1)                                                \
}

#define EPS_UPDATE_ALL_COPIES(G, GT)                                                   \
    EPS_UPDATE(G, GT, f32, float)                                                      \
    EPS_UPDATE(G, GT, bf16, ushort)                                                    \
    EPS_UPDATE(G, GT, f16, ushort)

EPS_UPDATE_ALL_COPIES(f32, float)
EPS_UPDATE_ALL_COPIES(bf16, ushort)
EPS_UPDATE_ALL_COPIES(f16, ushort)

// ---------------------------------------------------------------- Lion
// eps_lion_<G>_<C>: the same pass as eps_update with Lion's state (p, m) and scalars. The
// contract's order: c = (b1*m0) + (omb1*g) from the old m; p' = p1 + neg_lr where c > 0,
// p1 - neg_lr where c < 0, p1 itself where c is a zero of either sign (its own sign of zero
// kept); m' = (b2*m0) + (omb2*g). A NaN c (never from finite state and gradients) gives a
// NaN p', as the golden model's p1 + sign(c) * neg_lr does. Bytes per element: the
// contributions, p and m read, p, m and the copy written (8 fewer than AdamW's v).

#define LION_BODY(T, P1)                                                               \
    const T p1 = (P1);                                                                 \
    const T c = (b1 * m0) + (omb1 * g);                                                \
    const T m1 = (b2 * m0) + (omb2 * g);

// p' from p1 and c on a vector: three selects, no branch.
#define LION_STEP_V(p1, c)                                                             \
    select(select(select((p1), (p1) + neg_lr, (c) > (floatV)0.0f), (p1) - neg_lr, (c) < (floatV)0.0f), \
           (c), isnan(c))
#define LION_STEP_1(p1, c)                                                             \
    ((c) > 0.0f ? (p1) + neg_lr : (c) < 0.0f ? (p1) - neg_lr : isnan(c) ? (c) : (p1))

#define LION_V(G, C, j, P1)                                                            \
    {                                                                                  \
        REDUCEV(G, gr, j, n, k, acc)                                                   \
        const floatV g = acc * inv_scale;                                              \
        const floatV p0 = LOADF(j, p), m0 = LOADF(j, m);                               \
        LION_BODY(floatV, P1)                                                          \
        const floatV p2 = LION_STEP_V(p1, c);                                          \
        STOREF(p2, j, p); STOREF(m1, j, m);                                            \
        STOREV_COPY(C, copy, j, p2, nt);                                               \
    }
#define LION_1(G, C, i)                                                                \
    {                                                                                  \
        REDUCE1(G, gr, i, n, k, acc)                                                   \
        const float g = acc * inv_scale;                                               \
        const float p0 = p[i], m0 = m[i];                                              \
        LION_BODY(float, i < n_decay ? p0 * decay : p0)                                \
        const float p2 = LION_STEP_1(p1, c);                                           \
        p[i] = p2; m[i] = m1;                                                          \
        store1_##C(copy, i, p2);                                                       \
    }

#define EPS_LION(G, GT, C, CT)                                                         \
__kernel void eps_lion_##G##_##C(                                                      \
        __global const GT *gr, __global float *p, __global float *m,                   \
        __global CT *copy, __global const int *finite,                                 \
        const uint n, const uint k, const uint n_decay,                                \
        const float decay, const float b1, const float omb1, const float b2,           \
        const float omb2, const float neg_lr, const float inv_scale) {                 \
    UPDATE_WALK(G, C, LION_V, LION_1)                                                  \
}

#define EPS_LION_ALL_COPIES(G, GT)                                                     \
    EPS_LION(G, GT, f32, float)                                                        \
    EPS_LION(G, GT, bf16, ushort)                                                      \
    EPS_LION(G, GT, f16, ushort)

EPS_LION_ALL_COPIES(f32, float)
EPS_LION_ALL_COPIES(bf16, ushort)
EPS_LION_ALL_COPIES(f16, ushort)

// ---------------------------------------------------------------- LAMB (two kernels)
// docs/eps-numerics.md, "LAMB update". An update is eps_check_<G>, then
//
//   eps_lamb_norms_<G>  m', v' in place (p read only) and, per segment, SUM_LANES
//                       binary32 partial sums of p*p and of u2*u2 into
//                       sums[(s*2 + 0)*16 + j] and sums[(s*2 + 1)*16 + j];
//   the host's fold of the sums into one step size per segment (binary64);
//   eps_lamb_step_<C>   u2 again from p, m', v' (the same statements), p' = p + step*u2
//                       and the device copy.
//
// seg (uint[nseg + 1]) holds the segments' bounds: segment s is [seg[s], seg[s+1]), at
// most 65536 elements, never across a 65536 boundary. Both kernels do nothing when
// *finite is 0.
//
// Lanes: lane j of a segment adds its elements j, j + 16, j + 32, ... counted from the
// segment's own first element, in index order, from +0. The norm pass walks a segment in
// rows of 16 elements from its first: with VW 16 one floatV accumulator is the 16 lanes,
// with VW 8 two (lanes 0-7 and 8-15). A segment need not start on a vector boundary, so
// its rows are loaded at element alignment (LOADF_AT: one unaligned vector load); the
// last len % 16 elements are added lane by lane after the rows, in index order.
//
// Work split. Norm pass: a segment's sums cannot be split, so a work-item owns whole
// segments: those that start in its chunk of the elements (the chunks as the other
// kernels cut them, in elements); the last work-item also takes any starting past n.
// Any launch shape gives the same bits. Step pass: no reduction, so the elements are cut
// as eps_update cuts them (chunks of whole vectors, the n % VW tail to the last
// work-item); a work-item finds the segment holding its first element by a binary search
// of seg and walks on from there, in runs of one segment and one side of n_decay: each
// run's whole vectors take the segment's step as a scalar, its unaligned ends go element
// by element.
//
// Bytes per element: the norm pass reads the K contributions, p, m and v and writes m
// and v (K|G| + 12 in, 8 out); the step pass reads p, m, v and writes p and the copy
// (12 in, 4 + |C| out); with eps_check's K|G|: 2K|G| + 36 + |C|.

#define SUM_LANES 16  /* numerics.LANES */

// Loads and stores at an element offset (not a multiple of VW): one unaligned vector access.
#define LOADF_AT(ptr, i) (*(__global const floatV_e *)((ptr) + (size_t)(i)))
#define STOREF_AT(x, ptr, i) (*(__global floatV_e *)((ptr) + (size_t)(i)) = (x))
inline floatV wideE_f32(__global const float *g, size_t i) { return LOADF_AT(g, i); }
inline floatV wideE_bf16(__global const ushort *g, size_t i) {
    return as_floatV(convert_uintV(*(__global const ushortV_e *)(g + i)) << 16);
}
inline floatV wideE_f16(__global const ushort *g, size_t i) { return vload_halfV(0, (__global const half *)(g + i)); }
#define REDUCEE(G, g, i, n, k, acc)                                                    \
    floatV acc = wideE_##G(g, i);                                                      \
    for (uint c_ = 1; c_ < k; ++c_) acc = acc + wideE_##G(g + (size_t)c_ * n, i);

// Segment s of seg as [lo, hi), kept inside [0, n] (the HLS kernels' segment_end/start):
// a malformed seg (the host checks it first) cannot make a kernel reach past the layer.
inline uint lamb_segment_end(__global const uint *seg, uint s, uint n) { return min(seg[s + 1], n); }
inline uint lamb_segment_start(__global const uint *seg, uint s, uint hi) { return min(seg[s], hi); }
// The first segment s < nseg with seg[s] >= x, or nseg (seg[0..nseg) is non-decreasing).
inline uint lamb_first_from(__global const uint *seg, uint nseg, size_t x) {
    uint lo = 0, hi = nseg;
    while (lo < hi) {
        const uint mid = lo + (hi - lo) / 2;
        if ((size_t)seg[mid] < x) lo = mid + 1; else hi = mid;
    }
    return lo;
}

// u, LAMB's update term before the weight decay, from m1 and v1: one rounded binary32
// operation per statement, in the contract's order (both passes use these statements).
#define LAMB_U(T)                                                                      \
    const T sq = sqrt(v1);             /* sqrt(v') */                                  \
    const T dd = (sq * inv_bc2_sqrt) + eps; /* d = (sqrt(v') * inv_bc2_sqrt) + eps */  \
    const T u = (m1 / dd) * inv_bc1;   /* u = (m' / d) * inv_bc1 */
// u2 from u: decayed (u + wd*p), not (u), or the lanes of a vector below n_decay decayed.
#define U2_DECAYED (u + (wd * p0))
#define U2_PLAIN (u)
#define U2_LANES(dl) select(u, u + (wd * p0), LANES < (intV)(dl))

// The norm pass on VW elements from element i, the part `h` of a row (lanes h*VW on):
// their moments, and their squares added to accumulators accp##h, accu##h. U2 may use
// `part_`, the first lane of this part in its row.
#define LAMB_NORMS_V(G, i, h, U2)                                                      \
    {                                                                                  \
        const int part_ = (h) * VW;                                                    \
        REDUCEE(G, gr, i, n, k, acc)                                                   \
        const floatV g = acc * inv_scale;                                              \
        const floatV p0 = LOADF_AT(p, i), m0 = LOADF_AT(m, i), v0 = LOADF_AT(v, i);    \
        const floatV m1 = (b1 * m0) + (omb1 * g);                                      \
        const floatV v1 = (b2 * v0) + (omb2 * (g * g));                                \
        LAMB_U(floatV)                                                                 \
        const floatV u2 = U2;                                                          \
        accp##h = accp##h + (p0 * p0);                                                 \
        accu##h = accu##h + (u2 * u2);                                                 \
        STOREF_AT(m1, m, i); STOREF_AT(v1, v, i);                                      \
        (void)part_;                                                                   \
    }
#if VW == 16
#define LAMB_ROW(G, e, U2) LAMB_NORMS_V(G, e, 0, U2)
#else
#define LAMB_ROW(G, e, U2) { LAMB_NORMS_V(G, e, 0, U2) LAMB_NORMS_V(G, (e) + 8, 1, U2) }
#endif

#define EPS_LAMB_NORMS(G, GT)                                                          \
__kernel void eps_lamb_norms_##G(                                                      \
        __global const GT *gr, __global const float *p, __global float *m,             \
        __global float *v, __global const uint *seg, __global float *sums,             \
        __global const int *finite,                                                    \
        const uint n, const uint k, const uint n_decay, const uint nseg,               \
        const float b1, const float omb1, const float b2, const float omb2,            \
        const float inv_bc2_sqrt, const float eps, const float inv_bc1,                \
        const float wd, const float inv_scale) {                                       \
    if (*finite == 0) return;                                                          \
    const size_t items = get_global_size(0), me = get_global_id(0);                    \
    const uint first = lamb_first_from(seg, nseg, chunk_start(n, me, items));          \
    const uint last = me == items - 1 ? nseg : lamb_first_from(seg, nseg, chunk_start(n, me + 1, items)); \
    for (uint s = first; s < last; ++s) {                                              \
        const uint hi = lamb_segment_end(seg, s, n), lo = lamb_segment_start(seg, s, hi); \
        const uint len = hi - lo, full = len / SUM_LANES;      /* whole rows */        \
        const uint d = n_decay <= lo ? 0u : min(n_decay - lo, len); /* decayed elements */ \
        const uint rd = min(d / SUM_LANES, full);              /* wholly decayed rows */ \
        floatV accp0 = (floatV)0.0f, accu0 = (floatV)0.0f;     /* +0 */                \
        floatV accp1 = (floatV)0.0f, accu1 = (floatV)0.0f;     /* lanes 8-15 (VW 8) */ \
        uint r = 0;                                                                    \
        for (; r < rd; ++r) LAMB_ROW(G, lo + SUM_LANES * r, U2_DECAYED)                \
        if (r < full && d > SUM_LANES * r) {  /* the row across n_decay */             \
            const int straddle = (int)(d - SUM_LANES * r);                             \
            LAMB_ROW(G, lo + SUM_LANES * r, U2_LANES(straddle - part_))                \
            ++r;                                                                       \
        }                                                                              \
        for (; r < full; ++r) LAMB_ROW(G, lo + SUM_LANES * r, U2_PLAIN)                \
        float lp[SUM_LANES], lu[SUM_LANES];                                            \
        VSTORE_LANES(lp, accp0, accp1);                                                \
        VSTORE_LANES(lu, accu0, accu1);                                                \
        for (uint i = lo + SUM_LANES * full, j = 0; i < hi; ++i, ++j) {  /* the tail, lane by lane */ \
            REDUCE1(G, gr, i, n, k, acc)                                               \
            const float g = acc * inv_scale;                                           \
            const float p0 = p[i], m0 = m[i], v0 = v[i];                               \
            const float m1 = (b1 * m0) + (omb1 * g);                                   \
            const float v1 = (b2 * v0) + (omb2 * (g * g));                             \
            LAMB_U(float)                                                              \
            const float u2 = i < n_decay ? U2_DECAYED : U2_PLAIN;                      \
            lp[j] = lp[j] + (p0 * p0);                                                 \
            lu[j] = lu[j] + (u2 * u2);                                                 \
            m[i] = m1; v[i] = v1;                                                      \
        }                                                                              \
        __global float *out = sums + (size_t)s * (2 * SUM_LANES);                      \
        for (uint j = 0; j < SUM_LANES; ++j) { out[j] = lp[j]; out[SUM_LANES + j] = lu[j]; } \
    }                                                                                  \
}

#if VW == 16
#define VSTORE_LANES(arr, a0, a1) vstore16(a0, 0, arr)
#else
#define VSTORE_LANES(arr, a0, a1) do { vstore8(a0, 0, arr); vstore8(a1, 0, (arr) + 8); } while (0)
#endif

EPS_LAMB_NORMS(f32, float)
EPS_LAMB_NORMS(bf16, ushort)
EPS_LAMB_NORMS(f16, ushort)

// The step pass on the whole vector at element i (a multiple of VW), and on element i.
#define LAMB_STEP_V(C, i, U2)                                                          \
    {                                                                                  \
        const floatV p0 = LOADF_AT(p, i), m1 = LOADF_AT(m, i), v1 = LOADF_AT(v, i);    \
        LAMB_U(floatV)                                                                 \
        const floatV u2 = U2;                                                          \
        const floatV p2 = p0 + (step * u2);                                            \
        STOREF_AT(p2, p, i);                                                           \
        STOREV_COPY(C, copy, (i) / VW, p2, nt);                                        \
    }
#define LAMB_STEP_1(C, i)                                                              \
    {                                                                                  \
        const float p0 = p[i], m1 = m[i], v1 = v[i];                                   \
        LAMB_U(float)                                                                  \
        const float u2 = i < n_decay ? U2_DECAYED : U2_PLAIN;                          \
        const float p2 = p0 + (step * u2);                                             \
        p[i] = p2;                                                                     \
        store1_##C(copy, i, p2);                                                       \
    }
// Elements [a, b) of one segment, all on one side of n_decay (U2): the ends element by
// element, the whole vectors between them with the segment's step as a scalar.
#define LAMB_STEP_RUN(C, a, b, U2)                                                     \
    {                                                                                  \
        size_t i = (a);                                                                \
        for (; i < (b) && i % VW != 0; ++i) LAMB_STEP_1(C, i)                          \
        for (; i + VW <= (b); i += VW) LAMB_STEP_V(C, i, U2)                           \
        for (; i < (b); ++i) LAMB_STEP_1(C, i)                                         \
    }

#define EPS_LAMB_STEP(C, CT)                                                           \
__kernel void eps_lamb_step_##C(                                                       \
        __global float *p, __global const float *m, __global const float *v,           \
        __global CT *copy, __global const uint *seg, __global const float *steps,      \
        __global const int *finite,                                                    \
        const uint n, const uint n_decay, const uint nseg,                             \
        const float b1, const float omb1, const float b2, const float omb2,            \
        const float inv_bc2_sqrt, const float eps, const float inv_bc1,                \
        const float wd, const float inv_scale) {                                       \
    if (*finite == 0) return;                                                          \
    const size_t nv = n / VW, items = get_global_size(0), me = get_global_id(0);       \
    const size_t e0 = VW * chunk_start(nv, me, items);                                 \
    const size_t e1 = me == items - 1 ? (size_t)n : VW * chunk_start(nv, me + 1, items); \
    const int nt = STREAMING(C, copy, p);                                              \
    const uint from = lamb_first_from(seg, nseg, e0 + 1);  /* segments starting at or before e0 ... */ \
    size_t pos = e0;                                                                   \
    for (uint s = from == 0 ? 0 : from - 1; s < nseg && pos < e1; ++s) { /* ... the last of them on */ \
        const uint hi = lamb_segment_end(seg, s, n), lo = lamb_segment_start(seg, s, hi); \
        size_t a = max((size_t)lo, pos);                                               \
        const size_t b = min((size_t)hi, e1);                                          \
        if (a >= b) continue;                                                          \
        const float step = steps[s];                                                   \
        if (a < n_decay) {                                                             \
            const size_t c = min(b, (size_t)n_decay);                                  \
            LAMB_STEP_RUN(C, a, c, U2_DECAYED)                                         \
            a = c;                                                                     \
        }                                                                              \
        if (a < b) LAMB_STEP_RUN(C, a, b, U2_PLAIN)                                    \
        pos = b;                                                                       \
    }                                                                                  \
    FENCE_IF(nt);                                                                      \
}

EPS_LAMB_STEP(f32, float)
EPS_LAMB_STEP(bf16, ushort)
EPS_LAMB_STEP(f16, ushort)

// ---------------------------------------------------------------- copy only
// The device copy of the current master weights (after allocate or load).

#define EPS_COPY(C, CT)                                                                \
__kernel void eps_copy_##C(__global const float *p, __global CT *copy, const uint n) { \
    const size_t nv = n / VW, items = get_global_size(0), me = get_global_id(0);       \
    const size_t lo = chunk_start(nv, me, items), hi = chunk_start(nv, me + 1, items); \
    for (size_t j = lo; j < hi; ++j) storeV_##C(copy, j, LOADF(j, p));                 \
    if (me == items - 1)                                                               \
        for (size_t i = nv * VW; i < n; ++i) store1_##C(copy, i, p[i]);                \
}

EPS_COPY(f32, float)
EPS_COPY(bf16, ushort)
EPS_COPY(f16, ushort)
