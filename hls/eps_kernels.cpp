// l2l eager param-server (EPS) kernels in Vitis HLS C++: finite check, fused
// reduce + AdamW + device copy, fused reduce + Lion + device copy, LAMB's two passes
// (reduce + moments + the norms' partial sums; the step + device copy), and copy alone.
//
// The same kernels, kernel names and argument order as fpga/opencl/eps.cl
// (fpga/ARGS.md: buffers first, then n and k (and n_decay for the updates, and
// nseg for LAMB's), then the step scalars in the contract's table order:
// StepScalars for AdamW, LionScalars for Lion, LambScalars for LAMB), computing the
// same bits: docs/eps-numerics.md.
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
// (-Wno-unknown-pragmas), and eps::fifo stands in for hls::stream when
// hls_stream.h is not on the include path.
//
// Dtypes: gradients G and device copy C are each f32 (float), bf16 (bfloat16
// bits in uint16_t) or f16 (binary16 bits in uint16_t); one top function per
// combination: eps_check_<G>, eps_update_<G>_<C> (AdamW), eps_lion_<G>_<C> (Lion),
// eps_lamb_norms_<G> and eps_lamb_step_<C> (LAMB), eps_copy_<C>. eps_check and
// eps_copy serve every optimizer.
//
// Structure (docs/fpga.md, "Kernel structure"). Each top function walks the
// layer in blocks of BLOCK elements and runs one dataflow region per block (LAMB's
// per segment: a block, or the part of one inside a tensor). A
// region is a chain of processes joined by FIFOs, all running at once:
//
//   read   one process per m_axi port, a pipelined loop of burst reads
//          (the gradients: per tile of TILE elements, contribution 0's
//          TILE elements, then contribution 1's, ...);
//   compute  reduce: adds the K contributions into a TILE-element accumulator
//          in contribution order (acc = g_0; acc = acc + g_1; ...: the
//          contract's left fold per element) and passes each sum on while it
//          adds the last contribution; then the finite test (check), the
//          AdamW update and the device copy's narrowing (update), the Lion
//          update and the narrowing (lion), or the narrowing alone (copy);
//   write  one process per m_axi port written, a pipelined loop of burst
//          writes.
//
// Every element loop is pipelined at II=1: one element per clock per process.
// The gradient port reads K elements per element of the layer, so a region
// takes about K clocks per element (1 for K = 1) and the other processes wait
// on it. Each array is read once per element (the gradients once per
// contribution) and written once. Blocks keep the FIFOs of the C-simulation
// (which runs the processes one after the other) at BLOCK elements; in
// hardware each block costs one fill and drain of the region.

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#if defined(__SYNTHESIS__) || defined(__VITIS_HLS__)
#define EPS_HLS_STREAM 1
#elif defined(__has_include)
#if __has_include(<hls_stream.h>)
#define EPS_HLS_STREAM 1
#endif
#endif

#ifdef EPS_HLS_STREAM
#include <hls_stream.h>
#else
#include <utility>
#include <vector>
#endif

#if defined(__GNUC__) && !defined(__SYNTHESIS__)
#pragma GCC diagnostic ignored "-Wunused-label"  // loop labels name the loops in HLS reports
#endif

namespace eps {

constexpr unsigned TILE = 1024;  // elements per tile: one gradient burst run per contribution
constexpr unsigned BLOCK = 64 * TILE;  // elements per run of a dataflow region
constexpr unsigned TILES = BLOCK / TILE;  // tiles per block
constexpr unsigned FIFO_DEPTH = 64;  // elements each FIFO between two processes holds
// Loop trip counts for the HLS reports only (they do not change the hardware):
constexpr unsigned MAX_BLOCKS = 65536;  // n < 2**32 elements
constexpr unsigned AVG_BLOCKS = 16;     // a layer of 1 Mi elements
constexpr unsigned MAX_K = 8;           // contributions
constexpr unsigned AVG_K = 1;

// ---------------------------------------------------------------- FIFOs

#ifdef EPS_HLS_STREAM
template <class T>
using fifo = hls::stream<T>;
#else
// The C-simulation's stand-in for hls::stream: the same write()/read(), no
// bound. The processes of a region run one after the other here, so a FIFO
// fills with the whole block before its reader starts; its storage comes from
// a per-thread pool, so that each block reuses the last block's memory instead
// of growing a fresh buffer. Reading an empty FIFO, or leaving data behind,
// would hang or corrupt the hardware; here it stops the program.
template <class T>
class fifo {
public:
    fifo() {
        std::vector<std::vector<T>> &free = pool();
        if (!free.empty()) {
            buf_.swap(free.back());
            free.pop_back();
        }
    }
    fifo(const fifo &) = delete;
    fifo &operator=(const fifo &) = delete;
    ~fifo() {
        if (head_ != buf_.size()) fail("data left in a FIFO");
        buf_.clear();
        pool().push_back(std::move(buf_));
    }
    void write(const T &x) { buf_.push_back(x); }
    T read() {
        if (head_ == buf_.size()) fail("read from an empty FIFO");
        return buf_[head_++];
    }
    bool empty() const { return head_ == buf_.size(); }

private:
    static std::vector<std::vector<T>> &pool() {
        static thread_local std::vector<std::vector<T>> free;
        return free;
    }
    [[noreturn]] static void fail(const char *what) {
        std::fprintf(stderr, "eps_kernels.cpp: %s\n", what);
        std::abort();
    }
    std::vector<T> buf_;
    std::size_t head_ = 0;
};
#endif

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

inline bool is_nan(float x) { return (bits_of(x) & 0x7fffffffu) > 0x7f800000u; }

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
        // subnormal: man * 2**-24, normal in binary32; shift the leading one to bit 10.
        // A fixed 10 steps (man >= 1 needs at most 10), unrolled into a chain of
        // multiplexers inside the pipelined loops that call this.
        uint32_t ex = 113u;  // exponent field of 2**-14
    normalise:
        for (unsigned s = 0; s < 10; ++s) {
#pragma HLS UNROLL
#pragma HLS loop_tripcount min=10 max=10 avg=10
            if ((man & 0x400u) == 0) {
                man <<= 1;
                --ex;
            }
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

inline unsigned part(uint64_t n, uint64_t base, unsigned size) {
    return (n - base < size) ? static_cast<unsigned>(n - base) : size;
}

// ---------------------------------------------------------------- read processes

// The block's K contributions, tile by tile: contribution 0's tile, then 1's, ...
// Each inner loop is one sequential run of up to TILE elements, which the m_axi
// adapter issues as bursts of up to EPS_BURST beats.
template <class G>
void read_grads(const typename G::T *g, fifo<typename G::T> &out, unsigned n, unsigned k, uint64_t base,
                unsigned len) {
tiles:
    for (unsigned t = 0; t < len; t += TILE) {
#pragma HLS loop_tripcount min=1 max=TILES avg=TILES
        const unsigned tl = part(len, t, TILE);
    contributions:
        for (unsigned c = 0; c < k; ++c) {
#pragma HLS loop_tripcount min=1 max=MAX_K avg=AVG_K
            const typename G::T *src = g + static_cast<uint64_t>(c) * n + base + t;
        burst:
            for (unsigned i = 0; i < tl; ++i) {
#pragma HLS PIPELINE II=1
#pragma HLS loop_tripcount min=1 max=TILE avg=TILE
                out.write(src[i]);
            }
        }
    }
}

// One array's block, in order: one sequential run, issued as bursts.
template <class T>
void read_array(const T *src, fifo<T> &out, uint64_t base, unsigned len) {
elements:
    for (unsigned i = 0; i < len; ++i) {
#pragma HLS PIPELINE II=1
#pragma HLS loop_tripcount min=1 max=BLOCK avg=BLOCK
        out.write(src[base + i]);
    }
}

// ---------------------------------------------------------------- write process

template <class T>
void write_array(fifo<T> &in, T *dst, uint64_t base, unsigned len) {
elements:
    for (unsigned i = 0; i < len; ++i) {
#pragma HLS PIPELINE II=1
#pragma HLS loop_tripcount min=1 max=BLOCK avg=BLOCK
        dst[base + i] = in.read();
    }
}

// ---------------------------------------------------------------- compute processes

// The reduction: out gets ((g_0 + g_1) + ... + g_{k-1}) per element, in element
// order, written during the pass over the last contribution. acc[i] is read and
// written once per pass at distinct i, so the pass pipelines at II=1 (no
// dependence between its iterations); the passes are kept apart (no
// flattening), so a short tile's pass finishes its stores before the next pass
// loads them.
template <class G>
void reduce(fifo<typename G::T> &in, fifo<float> &out, unsigned k, unsigned len) {
    float acc[TILE];
tiles:
    for (unsigned t = 0; t < len; t += TILE) {
#pragma HLS loop_tripcount min=1 max=TILES avg=TILES
        const unsigned tl = part(len, t, TILE);
    contributions:
        for (unsigned c = 0; c < k; ++c) {
#pragma HLS loop_tripcount min=1 max=MAX_K avg=AVG_K
#pragma HLS LOOP_FLATTEN off
            const bool last = (c + 1 == k);
        add:
            for (unsigned i = 0; i < tl; ++i) {
#pragma HLS PIPELINE II=1
#pragma HLS loop_tripcount min=1 max=TILE avg=TILE
#pragma HLS DEPENDENCE variable=acc inter false
                const float x = G::wide(in.read());
                float s = x;  // contribution 0: acc = g_0
                if (c != 0) {
                    const float sum = acc[i] + x;  // acc = acc + g_c
                    s = sum;
                }
                if (last) {
                    out.write(s);
                } else {
                    acc[i] = s;
                }
            }
        }
    }
}

// The finite test: verdict gets 1 when every (sum * inv_scale) of the block is finite.
inline void all_finite(fifo<float> &sums, fifo<int> &verdict, unsigned len, float inv_scale) {
    int ok = 1;
scale:
    for (unsigned i = 0; i < len; ++i) {
#pragma HLS PIPELINE II=1
#pragma HLS loop_tripcount min=1 max=BLOCK avg=BLOCK
        const float gi = sums.read() * inv_scale;
        if (!is_finite(gi)) ok = 0;
    }
    verdict.write(ok);
}

// AdamW on one element per clock, in the contract's order of operations. The block's
// first `decayed` elements are weight-decayed, the rest keep p1 = p0 (the parameter
// groups): a multiplexer after the multiplier, no change to the pipeline.
template <class C>
void adamw(fifo<float> &sums, fifo<float> &p_in, fifo<float> &m_in, fifo<float> &v_in, fifo<float> &p_out,
           fifo<float> &m_out, fifo<float> &v_out, fifo<typename C::T> &copy_out, unsigned len,
           unsigned decayed, float decay, float b1, float omb1, float b2, float omb2, float inv_bc2_sqrt,
           float eps, float neg_step, float inv_scale) {
elements:
    for (unsigned i = 0; i < len; ++i) {
#pragma HLS PIPELINE II=1
#pragma HLS loop_tripcount min=1 max=BLOCK avg=BLOCK
        const float g = sums.read() * inv_scale;
        const float p0 = p_in.read();
        const float m0 = m_in.read();
        const float v0 = v_in.read();
        // the contract's order: every parenthesised product and each sum on its own
        const float pd = p0 * decay;              // p * decay
        const float p1 = (i < decayed) ? pd : p0; // p1: p * decay below n_decay, p past it
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
        p_out.write(p2);
        m_out.write(m1);
        v_out.write(v1);
        copy_out.write(C::narrow(p2));
    }
}

// Lion on one element per clock, in the contract's order of operations (docs/eps-numerics.md,
// "Lion update"). Same shape as adamw: the decay boundary is a multiplexer after the
// multiplier. The step is the sign of c = (b1*m) + (omb1*g), taken from the old m:
// sign(c) * neg_lr is exact (a sign flip), so one adder computes p1 + sign(c) * neg_lr and
// a multiplexer picks p1 itself where c is a zero of either sign (p1 keeps its own sign of
// zero: no `p1 + 0` that would turn -0 into +0). A NaN c never comes from finite state and a
// finite gradient; from NaN state it gives a NaN p', as the golden model's p1 + sign(c)*neg_lr
// does (c itself: the payload is unspecified).
template <class C>
void lion(fifo<float> &sums, fifo<float> &p_in, fifo<float> &m_in, fifo<float> &p_out, fifo<float> &m_out,
          fifo<typename C::T> &copy_out, unsigned len, unsigned decayed, float decay, float b1, float omb1,
          float b2, float omb2, float neg_lr, float inv_scale) {
elements:
    for (unsigned i = 0; i < len; ++i) {
#pragma HLS PIPELINE II=1
#pragma HLS loop_tripcount min=1 max=BLOCK avg=BLOCK
        const float g = sums.read() * inv_scale;
        const float p0 = p_in.read();
        const float m0 = m_in.read();
        // the contract's order: every parenthesised product and each sum on its own
        const float pd = p0 * decay;                       // p * decay
        const float p1 = (i < decayed) ? pd : p0;          // p1: p * decay below n_decay, p past it
        const float b1m = b1 * m0;                         // b1 * m
        const float omb1g = omb1 * g;                      // omb1 * g
        const float c = b1m + omb1g;                       // c = (b1*m) + (omb1*g)
        const float step = (c < 0.0f) ? -neg_lr : neg_lr;  // sign(c) * neg_lr, exactly (c not zero)
        const float moved = p1 + step;                     // p1 + sign(c)*neg_lr
        const float p2 = (c == 0.0f) ? p1 : is_nan(c) ? c : moved;  // p' (c = +-0: p1 itself)
        const float b2m = b2 * m0;                         // b2 * m
        const float omb2g = omb2 * g;                      // omb2 * g
        const float m1 = b2m + omb2g;                      // m' = (b2*m) + (omb2*g)
        p_out.write(p2);
        m_out.write(m1);
        copy_out.write(C::narrow(p2));
    }
}

template <class C>
void narrow_copy(fifo<float> &in, fifo<typename C::T> &out, unsigned len) {
elements:
    for (unsigned i = 0; i < len; ++i) {
#pragma HLS PIPELINE II=1
#pragma HLS loop_tripcount min=1 max=BLOCK avg=BLOCK
        out.write(C::narrow(in.read()));
    }
}

// The flag's write process: clears *finite when the block had a non-finite element.
inline void write_flag(fifo<int> &verdict, int *finite) {
    if (verdict.read() == 0) *finite = 0;
}

// ---------------------------------------------------------------- LAMB (two passes)
//
// docs/eps-numerics.md, "LAMB update". A LAMB update is two kernels, each one dataflow
// region per segment (the entry's tensors cut at every BLOCK boundary: at most BLOCK
// elements each; `seg` holds the bounds, segment s being [seg[s], seg[s+1])):
//
//   eps_lamb_norms_<g>  m', v' in place and, per segment, LANES binary32 partial sums of
//                       p*p and of u2*u2 (the norms of the trust ratio); p is read only.
//   eps_lamb_step_<c>   u2 again from p, m', v'; p' = p + step[s] * u2; the device copy.
//
// Between the two the host folds the sums into one step size per segment
// (numerics.lamb_steps, in binary64). A region per segment, not per block: each
// segment's sums start from +0 at its first element and leave the region with it, and a
// segment never spans two blocks, so the regions run no more often than the blocks do
// plus once per tensor start.

constexpr unsigned LANES = 16;  // partial sums per norm and segment (numerics.LANES)
constexpr unsigned SUMS = 2 * LANES;  // floats of one segment in `sums`: p*p's lanes, then u2*u2's
// Loop trip counts for the HLS reports only:
constexpr unsigned MAX_SEGMENTS = 2 * MAX_BLOCKS;  // the blocks and as many tensor starts
constexpr unsigned AVG_SEGMENTS = AVG_BLOCKS + 8;  // a layer of 1 Mi elements and 8 tensors

// LAMB's update term u2 from p and the new moments m', v', one rounded binary32 operation
// per statement in the contract's order; `decayed`: the element lies below n_decay. Both
// passes call this one function, so the second pass's u2 is the first's, bit for bit.
inline float lamb_u2(float p0, float m1, float v1, bool decayed, float inv_bc2_sqrt, float eps,
                     float inv_bc1, float wd) {
    const float sq = std::sqrt(v1);      // sqrt(v')
    const float sc = sq * inv_bc2_sqrt;  // sqrt(v') * inv_bc2_sqrt
    const float d = sc + eps;            // d = (...) + eps
    const float q = m1 / d;              // q = m' / d
    const float u = q * inv_bc1;         // u = q * inv_bc1
    const float wdp = wd * p0;           // wd * p
    const float ud = u + wdp;            // u + wd*p
    return decayed ? ud : u;             // u2: u + wd*p below n_decay, u past it
}

// LAMB's first pass on one element per clock: AdamW's moments, then the squares the
// norms add up. The segment's first `decayed` elements are weight-decayed (a multiplexer
// after the adder, as in adamw). p is read, not written.
inline void lamb_moments(fifo<float> &grad, fifo<float> &p_in, fifo<float> &m_in, fifo<float> &v_in,
                         fifo<float> &m_out, fifo<float> &v_out, fifo<float> &pp_out, fifo<float> &uu_out,
                         unsigned len, unsigned decayed, float b1, float omb1, float b2, float omb2,
                         float inv_bc2_sqrt, float eps, float inv_bc1, float wd, float inv_scale) {
elements:
    for (unsigned i = 0; i < len; ++i) {
#pragma HLS PIPELINE II=1
#pragma HLS loop_tripcount min=1 max=BLOCK avg=BLOCK
        const float g = grad.read() * inv_scale;
        const float p0 = p_in.read();
        const float m0 = m_in.read();
        const float v0 = v_in.read();
        const float b1m = b1 * m0;         // b1 * m
        const float omb1g = omb1 * g;      // omb1 * g
        const float m1 = b1m + omb1g;      // m' = (b1*m) + (omb1*g)
        const float gg = g * g;            // g * g
        const float omb2gg = omb2 * gg;    // omb2 * (g*g)
        const float b2v = b2 * v0;         // b2 * v
        const float v1 = b2v + omb2gg;     // v' = (b2*v) + (omb2*(g*g))
        const float pp = p0 * p0;          // p * p
        const float u2 = lamb_u2(p0, m1, v1, i < decayed, inv_bc2_sqrt, eps, inv_bc1, wd);
        const float uu = u2 * u2;          // u2 * u2
        m_out.write(m1);
        v_out.write(v1);
        pp_out.write(pp);
        uu_out.write(uu);
    }
}

// The segment's LANES partial sums of p*p and of u2*u2: lane j adds the segment's elements
// j, j + LANES, j + 2*LANES, ... in index order, from +0, one rounded addition each
// (acc_j = acc_j + x); then out gets p*p's lanes 0..15 and u2*u2's lanes 0..15.
//
// Why LANES accumulators: a binary32 adder takes several clocks at a few hundred MHz, so a
// single running sum would let the loop start one element every adder-latency clocks. With
// LANES interleaved sums an accumulator is read again LANES iterations after it is written,
// which the DEPENDENCE pragmas tell the scheduler (distance=LANES, a true dependence), so
// the loop can run at II=1 as long as the adder's latency is below LANES clocks. Not
// checked here (no Vitis): that the synthesised adder's latency at the target clock is
// below 16 and that the scheduler reaches II=1 with the completely partitioned accumulators
// (16 registers and a 16-way multiplexer per sum); a synthesis report must show it. The
// bits do not depend on it: each lane's additions stay in index order whatever the schedule.
inline void lane_sums(fifo<float> &pp_in, fifo<float> &uu_in, fifo<float> &out, unsigned len) {
    float acc_p[LANES];
    float acc_u[LANES];
#pragma HLS ARRAY_PARTITION variable=acc_p complete
#pragma HLS ARRAY_PARTITION variable=acc_u complete
clear:
    for (unsigned j = 0; j < LANES; ++j) {
#pragma HLS UNROLL
#pragma HLS loop_tripcount min=LANES max=LANES avg=LANES
        acc_p[j] = 0.0f;  // +0
        acc_u[j] = 0.0f;
    }
accumulate:
    for (unsigned i = 0; i < len; ++i) {
#pragma HLS PIPELINE II=1
#pragma HLS loop_tripcount min=1 max=BLOCK avg=BLOCK
#pragma HLS DEPENDENCE variable=acc_p inter RAW distance=16 true
#pragma HLS DEPENDENCE variable=acc_u inter RAW distance=16 true
        const unsigned j = i % LANES;  // i counts from the segment's first element
        const float x = pp_in.read();
        const float y = uu_in.read();
        const float sp = acc_p[j] + x;  // acc_j = acc_j + p*p
        const float su = acc_u[j] + y;  // acc_j = acc_j + u2*u2
        acc_p[j] = sp;
        acc_u[j] = su;
    }
emit:
    for (unsigned j = 0; j < SUMS; ++j) {
#pragma HLS PIPELINE II=1
#pragma HLS loop_tripcount min=SUMS max=SUMS avg=SUMS
        out.write(j < LANES ? acc_p[j] : acc_u[j - LANES]);
    }
}

// LAMB's second pass on one element per clock: u2 again (lamb_u2: pass 1's statements),
// ns = step * u2, p' = p + ns, and the device copy of p'. `step` is the segment's step
// size (-lr * trust, from the host).
template <class C>
void lamb_apply(fifo<float> &p_in, fifo<float> &m_in, fifo<float> &v_in, fifo<float> &p_out,
                fifo<typename C::T> &copy_out, unsigned len, unsigned decayed, float step, float inv_bc2_sqrt,
                float eps, float inv_bc1, float wd) {
elements:
    for (unsigned i = 0; i < len; ++i) {
#pragma HLS PIPELINE II=1
#pragma HLS loop_tripcount min=1 max=BLOCK avg=BLOCK
        const float p0 = p_in.read();
        const float m1 = m_in.read();
        const float v1 = v_in.read();
        const float u2 = lamb_u2(p0, m1, v1, i < decayed, inv_bc2_sqrt, eps, inv_bc1, wd);
        const float ns = step * u2;  // step * u2
        const float p2 = p0 + ns;    // p' = p + (...)
        p_out.write(p2);
        copy_out.write(C::narrow(p2));
    }
}

// One segment's sums: SUMS floats from `base` (a short run: one burst).
inline void write_sums(fifo<float> &in, float *dst, uint64_t base) {
elements:
    for (unsigned j = 0; j < SUMS; ++j) {
#pragma HLS PIPELINE II=1
#pragma HLS loop_tripcount min=SUMS max=SUMS avg=SUMS
        dst[base + j] = in.read();
    }
}

// ---------------------------------------------------------------- dataflow regions (one block each)

template <class G>
void check_block(const typename G::T *g, int *finite, unsigned n, unsigned k, float inv_scale, uint64_t base,
                 unsigned len) {
#pragma HLS DATAFLOW
    fifo<typename G::T> raw;
#pragma HLS STREAM variable=raw depth=FIFO_DEPTH
    fifo<float> sums;
#pragma HLS STREAM variable=sums depth=FIFO_DEPTH
    fifo<int> verdict;
#pragma HLS STREAM variable=verdict depth=2
    read_grads<G>(g, raw, n, k, base, len);
    reduce<G>(raw, sums, k, len);
    all_finite(sums, verdict, len, inv_scale);
    write_flag(verdict, finite);
}

template <class G, class C>
void update_block(const typename G::T *gr, float *p, float *m, float *v, typename C::T *copy, unsigned n,
                  unsigned k, unsigned decayed, float decay, float b1, float omb1, float b2, float omb2,
                  float inv_bc2_sqrt, float eps, float neg_step, float inv_scale, uint64_t base, unsigned len) {
#pragma HLS DATAFLOW
    fifo<typename G::T> raw;
#pragma HLS STREAM variable=raw depth=FIFO_DEPTH
    fifo<float> sums;
#pragma HLS STREAM variable=sums depth=FIFO_DEPTH
    fifo<float> p_in;
#pragma HLS STREAM variable=p_in depth=FIFO_DEPTH
    fifo<float> m_in;
#pragma HLS STREAM variable=m_in depth=FIFO_DEPTH
    fifo<float> v_in;
#pragma HLS STREAM variable=v_in depth=FIFO_DEPTH
    fifo<float> p_out;
#pragma HLS STREAM variable=p_out depth=FIFO_DEPTH
    fifo<float> m_out;
#pragma HLS STREAM variable=m_out depth=FIFO_DEPTH
    fifo<float> v_out;
#pragma HLS STREAM variable=v_out depth=FIFO_DEPTH
    fifo<typename C::T> copy_out;
#pragma HLS STREAM variable=copy_out depth=FIFO_DEPTH
    read_grads<G>(gr, raw, n, k, base, len);
    read_array<float>(p, p_in, base, len);
    read_array<float>(m, m_in, base, len);
    read_array<float>(v, v_in, base, len);
    reduce<G>(raw, sums, k, len);
    adamw<C>(sums, p_in, m_in, v_in, p_out, m_out, v_out, copy_out, len, decayed, decay, b1, omb1, b2, omb2,
             inv_bc2_sqrt, eps, neg_step, inv_scale);
    write_array<float>(p_out, p, base, len);
    write_array<float>(m_out, m, base, len);
    write_array<float>(v_out, v, base, len);
    write_array<typename C::T>(copy_out, copy, base, len);
}

// Lion's region: update_block without v (two state arrays in and out, not three).
template <class G, class C>
void lion_block(const typename G::T *gr, float *p, float *m, typename C::T *copy, unsigned n, unsigned k,
                unsigned decayed, float decay, float b1, float omb1, float b2, float omb2, float neg_lr,
                float inv_scale, uint64_t base, unsigned len) {
#pragma HLS DATAFLOW
    fifo<typename G::T> raw;
#pragma HLS STREAM variable=raw depth=FIFO_DEPTH
    fifo<float> sums;
#pragma HLS STREAM variable=sums depth=FIFO_DEPTH
    fifo<float> p_in;
#pragma HLS STREAM variable=p_in depth=FIFO_DEPTH
    fifo<float> m_in;
#pragma HLS STREAM variable=m_in depth=FIFO_DEPTH
    fifo<float> p_out;
#pragma HLS STREAM variable=p_out depth=FIFO_DEPTH
    fifo<float> m_out;
#pragma HLS STREAM variable=m_out depth=FIFO_DEPTH
    fifo<typename C::T> copy_out;
#pragma HLS STREAM variable=copy_out depth=FIFO_DEPTH
    read_grads<G>(gr, raw, n, k, base, len);
    read_array<float>(p, p_in, base, len);
    read_array<float>(m, m_in, base, len);
    reduce<G>(raw, sums, k, len);
    lion<C>(sums, p_in, m_in, p_out, m_out, copy_out, len, decayed, decay, b1, omb1, b2, omb2, neg_lr,
            inv_scale);
    write_array<float>(p_out, p, base, len);
    write_array<float>(m_out, m, base, len);
    write_array<typename C::T>(copy_out, copy, base, len);
}

// LAMB's first pass over one segment [base, base + len): the gradients reduced as for
// AdamW, m' and v' written back, the segment's sums written to sums[sbase, sbase + SUMS).
template <class G>
void lamb_norms_block(const typename G::T *gr, const float *p, float *m, float *v, float *sums, unsigned n,
                      unsigned k, unsigned decayed, float b1, float omb1, float b2, float omb2,
                      float inv_bc2_sqrt, float eps, float inv_bc1, float wd, float inv_scale, uint64_t base,
                      unsigned len, uint64_t sbase) {
#pragma HLS DATAFLOW
    fifo<typename G::T> raw;
#pragma HLS STREAM variable=raw depth=FIFO_DEPTH
    fifo<float> grad;
#pragma HLS STREAM variable=grad depth=FIFO_DEPTH
    fifo<float> p_in;
#pragma HLS STREAM variable=p_in depth=FIFO_DEPTH
    fifo<float> m_in;
#pragma HLS STREAM variable=m_in depth=FIFO_DEPTH
    fifo<float> v_in;
#pragma HLS STREAM variable=v_in depth=FIFO_DEPTH
    fifo<float> m_out;
#pragma HLS STREAM variable=m_out depth=FIFO_DEPTH
    fifo<float> v_out;
#pragma HLS STREAM variable=v_out depth=FIFO_DEPTH
    fifo<float> pp;
#pragma HLS STREAM variable=pp depth=FIFO_DEPTH
    fifo<float> uu;
#pragma HLS STREAM variable=uu depth=FIFO_DEPTH
    fifo<float> lanes;
#pragma HLS STREAM variable=lanes depth=SUMS
    read_grads<G>(gr, raw, n, k, base, len);
    read_array<float>(p, p_in, base, len);
    read_array<float>(m, m_in, base, len);
    read_array<float>(v, v_in, base, len);
    reduce<G>(raw, grad, k, len);
    lamb_moments(grad, p_in, m_in, v_in, m_out, v_out, pp, uu, len, decayed, b1, omb1, b2, omb2, inv_bc2_sqrt,
                 eps, inv_bc1, wd, inv_scale);
    lane_sums(pp, uu, lanes, len);
    write_array<float>(m_out, m, base, len);
    write_array<float>(v_out, v, base, len);
    write_sums(lanes, sums, sbase);
}

// LAMB's second pass over one segment: p' and its device copy from p, m', v' and the
// segment's step size.
template <class C>
void lamb_step_block(float *p, const float *m, const float *v, typename C::T *copy, unsigned decayed, float step,
                     float inv_bc2_sqrt, float eps, float inv_bc1, float wd, uint64_t base, unsigned len) {
#pragma HLS DATAFLOW
    fifo<float> p_in;
#pragma HLS STREAM variable=p_in depth=FIFO_DEPTH
    fifo<float> m_in;
#pragma HLS STREAM variable=m_in depth=FIFO_DEPTH
    fifo<float> v_in;
#pragma HLS STREAM variable=v_in depth=FIFO_DEPTH
    fifo<float> p_out;
#pragma HLS STREAM variable=p_out depth=FIFO_DEPTH
    fifo<typename C::T> copy_out;
#pragma HLS STREAM variable=copy_out depth=FIFO_DEPTH
    read_array<float>(p, p_in, base, len);
    read_array<float>(m, m_in, base, len);
    read_array<float>(v, v_in, base, len);
    lamb_apply<C>(p_in, m_in, v_in, p_out, copy_out, len, decayed, step, inv_bc2_sqrt, eps, inv_bc1, wd);
    write_array<float>(p_out, p, base, len);
    write_array<typename C::T>(copy_out, copy, base, len);
}

template <class C>
void copy_block(const float *p, typename C::T *copy, uint64_t base, unsigned len) {
#pragma HLS DATAFLOW
    fifo<float> p_in;
#pragma HLS STREAM variable=p_in depth=FIFO_DEPTH
    fifo<typename C::T> copy_out;
#pragma HLS STREAM variable=copy_out depth=FIFO_DEPTH
    read_array<float>(p, p_in, base, len);
    narrow_copy<C>(p_in, copy_out, len);
    write_array<typename C::T>(copy_out, copy, base, len);
}

// ---------------------------------------------------------------- kernels: one region per block

// Clears *finite (set to 1 by the host) when any reduced gradient element
// ((g_0 + g_1) + ... + g_{k-1}) * inv_scale is inf or NaN. Reads the gradients only.
template <class G>
void check(const typename G::T *g, int *finite, unsigned n, unsigned k, float inv_scale) {
blocks:
    for (uint64_t base = 0; base < n; base += BLOCK) {  // 64 bits: no wrap for n near 2**32
#pragma HLS loop_tripcount min=1 max=MAX_BLOCKS avg=AVG_BLOCKS
        check_block<G>(g, finite, n, k, inv_scale, base, part(n, base, BLOCK));
    }
}

// How many of the block [base, base + len) lie below the decay boundary
// (numerics.decayed_part); an n_decay above n acts as n.
inline unsigned decayed_part(uint64_t n_decay, uint64_t base, unsigned len) {
    return n_decay <= base ? 0u : part(n_decay, base, len);
}

// One pass: reduce the k contributions, AdamW in place on p, m, v, write the
// device copy of p'. Elements [0, n_decay) are weight-decayed, the rest are not.
// Does nothing when *finite is 0 (the layer is untouched).
template <class G, class C>
void update(const typename G::T *gr, float *p, float *m, float *v, typename C::T *copy,
            const int *finite, unsigned n, unsigned k, unsigned n_decay, float decay, float b1, float omb1, float b2,
            float omb2, float inv_bc2_sqrt, float eps, float neg_step, float inv_scale) {
    if (*finite == 0) return;
blocks:
    for (uint64_t base = 0; base < n; base += BLOCK) {  // 64 bits: no wrap for n near 2**32
#pragma HLS loop_tripcount min=1 max=MAX_BLOCKS avg=AVG_BLOCKS
        const unsigned len = part(n, base, BLOCK);
        update_block<G, C>(gr, p, m, v, copy, n, k, decayed_part(n_decay, base, len), decay, b1, omb1, b2,
                           omb2, inv_bc2_sqrt, eps, neg_step, inv_scale, base, len);
    }
}

// Lion's pass, as update's: reduce the k contributions, Lion in place on p, m, write the
// device copy of p'. Elements [0, n_decay) are weight-decayed, the rest are not; the
// boundary is cut per block as for AdamW. Does nothing when *finite is 0.
template <class G, class C>
void lion_update(const typename G::T *gr, float *p, float *m, typename C::T *copy, const int *finite,
                 unsigned n, unsigned k, unsigned n_decay, float decay, float b1, float omb1, float b2,
                 float omb2, float neg_lr, float inv_scale) {
    if (*finite == 0) return;
blocks:
    for (uint64_t base = 0; base < n; base += BLOCK) {  // 64 bits: no wrap for n near 2**32
#pragma HLS loop_tripcount min=1 max=MAX_BLOCKS avg=AVG_BLOCKS
        const unsigned len = part(n, base, BLOCK);
        lion_block<G, C>(gr, p, m, copy, n, k, decayed_part(n_decay, base, len), decay, b1, omb1, b2, omb2,
                         neg_lr, inv_scale, base, len);
    }
}

// Segment s of `seg` as [lo, hi), kept inside [0, n]: a malformed `seg` (the host checks it
// first) cannot make a region read or write past the layer.
inline unsigned segment_end(const unsigned *seg, unsigned s, unsigned n) {
    const unsigned hi = seg[s + 1];
    return hi < n ? hi : n;
}

inline unsigned segment_start(const unsigned *seg, unsigned s, unsigned hi) {
    const unsigned lo = seg[s];
    return lo < hi ? lo : hi;
}

// LAMB's first pass: per segment, reduce the k contributions, m' and v' in place, the
// segment's SUMS partial sums into sums[s*SUMS, (s+1)*SUMS). Elements [0, n_decay) are
// weight-decayed, the rest are not (cut per segment). Does nothing when *finite is 0.
template <class G>
void lamb_norms(const typename G::T *gr, const float *p, float *m, float *v, const unsigned *seg, float *sums,
                const int *finite, unsigned n, unsigned k, unsigned n_decay, unsigned nseg, float b1, float omb1,
                float b2, float omb2, float inv_bc2_sqrt, float eps, float inv_bc1, float wd, float inv_scale) {
    if (*finite == 0) return;
segments:
    for (unsigned s = 0; s < nseg; ++s) {
#pragma HLS loop_tripcount min=1 max=MAX_SEGMENTS avg=AVG_SEGMENTS
        const unsigned hi = segment_end(seg, s, n);
        const unsigned lo = segment_start(seg, s, hi);
        const unsigned len = hi - lo;
        lamb_norms_block<G>(gr, p, m, v, sums, n, k, decayed_part(n_decay, lo, len), b1, omb1, b2, omb2,
                            inv_bc2_sqrt, eps, inv_bc1, wd, inv_scale, lo, len, static_cast<uint64_t>(s) * SUMS);
    }
}

// LAMB's second pass: per segment, p' = p + steps[s] * u2 in place and the device copy of
// p'. m and v are read, not written. Does nothing when *finite is 0.
template <class C>
void lamb_step(float *p, const float *m, const float *v, typename C::T *copy, const unsigned *seg,
               const float *steps, const int *finite, unsigned n, unsigned n_decay, unsigned nseg,
               float inv_bc2_sqrt, float eps, float inv_bc1, float wd) {
    if (*finite == 0) return;
segments:
    for (unsigned s = 0; s < nseg; ++s) {
#pragma HLS loop_tripcount min=1 max=MAX_SEGMENTS avg=AVG_SEGMENTS
        const unsigned hi = segment_end(seg, s, n);
        const unsigned lo = segment_start(seg, s, hi);
        const unsigned len = hi - lo;
        lamb_step_block<C>(p, m, v, copy, decayed_part(n_decay, lo, len), steps[s], inv_bc2_sqrt, eps, inv_bc1,
                           wd, lo, len);
    }
}

template <class C>
void copy_only(const float *p, typename C::T *copy, unsigned n) {
blocks:
    for (uint64_t base = 0; base < n; base += BLOCK) {  // 64 bits: no wrap for n near 2**32
#pragma HLS loop_tripcount min=1 max=MAX_BLOCKS avg=AVG_BLOCKS
        copy_block<C>(p, copy, base, part(n, base, BLOCK));
    }
}

}  // namespace eps

// ---------------------------------------------------------------- top functions
// Thin instantiations. Each array argument has a bundle (AXI master) of its own,
// so each can sit in its own HBM/DDR bank; scalars and the control go through
// the one s_axilite slave (an ap_ctrl_hs register map, buffers as 64-bit addresses).
//
// Every m_axi port: bursts of up to EPS_BURST beats (64 beats of 512 bits is
// 4 KiB, the AXI limit, if Vitis widens the port; 256 B at 32 bits),
// EPS_OUTSTANDING bursts in flight each way, and a depth= (elements) that
// sizes the port's memory in C/RTL co-simulation: a test bench of up to
// 70000 elements (a whole block and part of another) and k <= 4. Synthesis
// ignores depth=. EPS_PRAGMA expands its argument first (EPS_DEPTH_<port>,
// EPS_BURST, EPS_KW_*) so that the pragma holds plain numbers and keywords.
//
// The keywords port= and bundle= are spelled EPS_KW_port= and EPS_KW_bundle=
// because the macros' parameters have those names, and a parameter is replaced
// wherever its name appears: written plainly, `port=port` became `g=g`, a
// pragma Vitis does not read as the port's interface.
// tests/test_hls_pragmas.py checks the pragmas as the preprocessor expands them.

#define EPS_BURST 64
#define EPS_OUTSTANDING 4
#define EPS_DEPTH_g 280000
#define EPS_DEPTH_gr 280000
#define EPS_DEPTH_p 70000
#define EPS_DEPTH_m 70000
#define EPS_DEPTH_v 70000
#define EPS_DEPTH_copy 70000
#define EPS_DEPTH_finite 1
#define EPS_DEPTH_seg 65
#define EPS_DEPTH_sums 2048
#define EPS_DEPTH_steps 64

#define EPS_KW_port port
#define EPS_KW_bundle bundle
#define EPS_PRAGMA_TEXT(x) _Pragma(#x)
#define EPS_PRAGMA(x) EPS_PRAGMA_TEXT(x)
#define EPS_MAXI(port, bundle) \
    EPS_PRAGMA(HLS INTERFACE m_axi EPS_KW_port=port offset=slave EPS_KW_bundle=bundle max_widen_bitwidth=512 \
               max_read_burst_length=EPS_BURST max_write_burst_length=EPS_BURST \
               num_read_outstanding=EPS_OUTSTANDING num_write_outstanding=EPS_OUTSTANDING \
               depth=EPS_DEPTH_##port)
#define EPS_LITE(port) EPS_PRAGMA(HLS INTERFACE s_axilite EPS_KW_port=port)

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
        unsigned n, unsigned k, unsigned n_decay, float decay, float b1, float omb1, float b2, \
        float omb2, float inv_bc2_sqrt, float eps, float neg_step, float inv_scale) {          \
        EPS_MAXI(gr, gmem0)                                                                    \
        EPS_MAXI(p, gmem1)                                                                     \
        EPS_MAXI(m, gmem2)                                                                     \
        EPS_MAXI(v, gmem3)                                                                     \
        EPS_MAXI(copy, gmem4)                                                                  \
        EPS_MAXI(finite, gmem5)                                                                \
        EPS_LITE(n)                                                                            \
        EPS_LITE(k)                                                                            \
        EPS_LITE(n_decay)                                                                      \
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
        eps::update<G, C>(gr, p, m, v, copy, finite, n, k, n_decay, decay, b1, omb1, b2, omb2, \
                          inv_bc2_sqrt, eps, neg_step, inv_scale);                             \
    }

// eps_lion_<g>_<c>: eps_update's shape with Lion's state (p, m) and LionScalars. The
// bundles are numbered by position as in every other top function; the banks come from
// the port names (u280.cfg, u50.cfg: each role in the same pseudo-channel as AdamW's).
#define EPS_LION(GN, G, CN, C)                                                                \
    extern "C" void eps_lion_##GN##_##CN(                                                      \
        const G::T *gr, float *p, float *m, C::T *copy, const int *finite,                     \
        unsigned n, unsigned k, unsigned n_decay, float decay, float b1, float omb1, float b2, \
        float omb2, float neg_lr, float inv_scale) {                                           \
        EPS_MAXI(gr, gmem0)                                                                    \
        EPS_MAXI(p, gmem1)                                                                     \
        EPS_MAXI(m, gmem2)                                                                     \
        EPS_MAXI(copy, gmem3)                                                                  \
        EPS_MAXI(finite, gmem4)                                                                \
        EPS_LITE(n)                                                                            \
        EPS_LITE(k)                                                                            \
        EPS_LITE(n_decay)                                                                      \
        EPS_LITE(decay)                                                                        \
        EPS_LITE(b1)                                                                           \
        EPS_LITE(omb1)                                                                         \
        EPS_LITE(b2)                                                                           \
        EPS_LITE(omb2)                                                                         \
        EPS_LITE(neg_lr)                                                                       \
        EPS_LITE(inv_scale)                                                                    \
        EPS_LITE(return)                                                                       \
        eps::lion_update<G, C>(gr, p, m, copy, finite, n, k, n_decay, decay, b1, omb1, b2, omb2, \
                               neg_lr, inv_scale);                                             \
    }

// eps_lamb_norms_<g> and eps_lamb_step_<c>: LAMB's two passes (docs/eps-numerics.md, "LAMB
// update"). The buffers, then n (k), n_decay, nseg, then the nine LambScalars in their
// order; the step kernel takes them all too (b1, omb1, b2, omb2 and inv_scale unused) so
// that both kernels have one scalar order. seg (uint32[nseg + 1]) is the segments' bounds,
// sums (float[nseg][2][16]) the first pass's partial sums, steps (float[nseg]) the host's
// step sizes. Bundles numbered by position as in every other top function; the banks come
// from the port names (u280.cfg, u50.cfg).
#define EPS_LAMB_NORMS(GN, G)                                                                 \
    extern "C" void eps_lamb_norms_##GN(                                                       \
        const G::T *gr, const float *p, float *m, float *v, const unsigned *seg, float *sums,  \
        const int *finite, unsigned n, unsigned k, unsigned n_decay, unsigned nseg, float b1,  \
        float omb1, float b2, float omb2, float inv_bc2_sqrt, float eps, float inv_bc1,        \
        float wd, float inv_scale) {                                                           \
        EPS_MAXI(gr, gmem0)                                                                    \
        EPS_MAXI(p, gmem1)                                                                     \
        EPS_MAXI(m, gmem2)                                                                     \
        EPS_MAXI(v, gmem3)                                                                     \
        EPS_MAXI(seg, gmem4)                                                                   \
        EPS_MAXI(sums, gmem5)                                                                  \
        EPS_MAXI(finite, gmem6)                                                                \
        EPS_LITE(n)                                                                            \
        EPS_LITE(k)                                                                            \
        EPS_LITE(n_decay)                                                                      \
        EPS_LITE(nseg)                                                                         \
        EPS_LITE(b1)                                                                           \
        EPS_LITE(omb1)                                                                         \
        EPS_LITE(b2)                                                                           \
        EPS_LITE(omb2)                                                                         \
        EPS_LITE(inv_bc2_sqrt)                                                                 \
        EPS_LITE(eps)                                                                          \
        EPS_LITE(inv_bc1)                                                                      \
        EPS_LITE(wd)                                                                           \
        EPS_LITE(inv_scale)                                                                    \
        EPS_LITE(return)                                                                       \
        eps::lamb_norms<G>(gr, p, m, v, seg, sums, finite, n, k, n_decay, nseg, b1, omb1, b2,  \
                           omb2, inv_bc2_sqrt, eps, inv_bc1, wd, inv_scale);                   \
    }

#define EPS_LAMB_STEP(CN, C)                                                                  \
    extern "C" void eps_lamb_step_##CN(                                                        \
        float *p, const float *m, const float *v, C::T *copy, const unsigned *seg,             \
        const float *steps, const int *finite, unsigned n, unsigned n_decay, unsigned nseg,    \
        float b1, float omb1, float b2, float omb2, float inv_bc2_sqrt, float eps,             \
        float inv_bc1, float wd, float inv_scale) {                                            \
        EPS_MAXI(p, gmem0)                                                                     \
        EPS_MAXI(m, gmem1)                                                                     \
        EPS_MAXI(v, gmem2)                                                                     \
        EPS_MAXI(copy, gmem3)                                                                  \
        EPS_MAXI(seg, gmem4)                                                                   \
        EPS_MAXI(steps, gmem5)                                                                 \
        EPS_MAXI(finite, gmem6)                                                                \
        EPS_LITE(n)                                                                            \
        EPS_LITE(n_decay)                                                                      \
        EPS_LITE(nseg)                                                                         \
        EPS_LITE(b1)                                                                           \
        EPS_LITE(omb1)                                                                         \
        EPS_LITE(b2)                                                                           \
        EPS_LITE(omb2)                                                                         \
        EPS_LITE(inv_bc2_sqrt)                                                                 \
        EPS_LITE(eps)                                                                          \
        EPS_LITE(inv_bc1)                                                                      \
        EPS_LITE(wd)                                                                           \
        EPS_LITE(inv_scale)                                                                    \
        EPS_LITE(return)                                                                       \
        eps::lamb_step<C>(p, m, v, copy, seg, steps, finite, n, n_decay, nseg, inv_bc2_sqrt,   \
                          eps, inv_bc1, wd);                                                   \
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

#define EPS_LION_ALL_COPIES(GN, G)      \
    EPS_LION(GN, G, f32, eps::F32)      \
    EPS_LION(GN, G, bf16, eps::BF16)    \
    EPS_LION(GN, G, f16, eps::F16)

EPS_LION_ALL_COPIES(f32, eps::F32)
EPS_LION_ALL_COPIES(bf16, eps::BF16)
EPS_LION_ALL_COPIES(f16, eps::F16)

EPS_LAMB_NORMS(f32, eps::F32)
EPS_LAMB_NORMS(bf16, eps::BF16)
EPS_LAMB_NORMS(f16, eps::F16)

EPS_LAMB_STEP(f32, eps::F32)
EPS_LAMB_STEP(bf16, eps::BF16)
EPS_LAMB_STEP(f16, eps::F16)

EPS_COPY(f32, eps::F32)
EPS_COPY(bf16, eps::BF16)
EPS_COPY(f16, eps::F16)
