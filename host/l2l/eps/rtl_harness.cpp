// rtl_harness.cpp -- the card around the Verilated l2l_eps_kernel, for --eps rtl.
//
// What: a C ABI (loaded by host/l2l/eps/rtl_backend.py through ctypes) over one
// Verilator model of fpga/rtl/l2l_eps_kernel.v. The host drives it as a host
// driver drives the card: 32-bit AXI4-Lite writes and reads of the control
// registers (l2l_rtl_write / l2l_rtl_read), then clocks until the interrupt
// (l2l_rtl_wait). Behind the kernel's five AXI4 masters sits a memory model
// whose addresses ARE host virtual addresses: the backend's NumPy buffers,
// registered beforehand (l2l_rtl_regions), are read and written in place, with
// no copy. A burst that is not wholly inside one registered buffer (or that is
// not an INCR burst of full-width beats) is answered SLVERR and not performed,
// and the first such access is kept as a message (l2l_rtl_error): a wrong
// address is a Python exception, never a write to stray memory. A board's
// memory map is simulated by an offset (l2l_rtl_offset): the kernel then takes
// the board's bus addresses, and bus address a is host address a + offset.
//
// The memory never pauses: AR and AW are always ready; R serves one beat a
// clock in request order from the first accepted burst; W is ready while a
// write burst's address has been taken (the slave may wait for AW, AXI A3.3.1);
// B answers the next clock after a burst's last beat. So the clocks a launch
// takes are the kernel's own, which is what `l2l bench eps` reports.
//
// Why C++ and not Python per clock: a training step is hundreds of thousands
// of clocks; a Python call per clock would cost more than the model.
//
// The Verilated class is Vl2l_eps_kernel (verilator --cc, top l2l_eps_kernel); its
// `interrupt` port is __SYM__interrupt there (a C++ keyword in some dialects).
#include <cstdint>
#include <cstring>
#include <cstdio>
#include <deque>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#include "verilated.h"
#include "Vl2l_eps_kernel.h"

using L2L_VTOP = Vl2l_eps_kernel;

namespace {

// A Verilator port value <-> little-endian bytes: ports up to 64 bits are
// integers (CData .. QData), wider ones VlWide<N> (32-bit words, low first).
template <typename T>
typename std::enable_if<std::is_integral<T>::value>::type to_bytes(const T& v, uint8_t* out, size_t n) {
    uint64_t x = static_cast<uint64_t>(v);
    std::memcpy(out, &x, n);
}
template <std::size_t N>
void to_bytes(const VlWide<N>& v, uint8_t* out, size_t n) { std::memcpy(out, v.data(), n); }
template <typename T>
typename std::enable_if<std::is_integral<T>::value>::type from_bytes(T& v, const uint8_t* in, size_t n) {
    uint64_t x = 0;
    std::memcpy(&x, in, n);
    v = static_cast<T>(x);
}
template <std::size_t N>
void from_bytes(VlWide<N>& v, const uint8_t* in, size_t n) {
    std::memset(v.data(), 0, sizeof(EData) * N);
    std::memcpy(v.data(), in, n);
}
template <typename T>
constexpr size_t width_bytes(const T&) { return sizeof(T); }
template <std::size_t N>
constexpr size_t width_bytes(const VlWide<N>&) { return 4 * N; }

struct Burst {
    uint64_t base;  // address of beat 0's first byte lane (the address aligned down to the beat)
    uint32_t beats;
    uint32_t done;
    bool ok;
};

struct Region {
    uint64_t lo, hi;
};

// one AXI4 master's slave side: its bursts in flight and its beat width
struct Port {
    const char* name;
    size_t bytes = 0;           // beat width
    std::deque<Burst> rd, wr;   // accepted AR / AW bursts, oldest first
    std::deque<bool> b;         // B responses owed (ok)
    uint64_t rbeats = 0, wbeats = 0;
};

}  // namespace

struct L2lRtl {
    std::unique_ptr<VerilatedContext> ctx;
    std::unique_ptr<L2L_VTOP> top;
    std::vector<Region> regions;
    uint64_t offset = 0;        // host address = bus address + offset (mod 2^64)
    Port ports[5] = {{"gr"}, {"p"}, {"m"}, {"v"}, {"copy"}};
    std::string error;
    uint64_t cycle = 0;
    std::vector<uint8_t> beat;  // scratch: one beat

    bool inside(uint64_t lo, uint64_t hi) const {
        for (const Region& r : regions)
            if (lo >= r.lo && hi <= r.hi) return true;
        return false;
    }
    void fault(const Port& p, const char* what, uint64_t addr, uint32_t beats, unsigned size) {
        if (!error.empty()) return;  // the first is the cause; the rest follow from it
        char msg[256];
        std::snprintf(msg, sizeof msg,
                      "m_axi_%s %s burst at 0x%llx (%u beats of %zu bytes, size %u) outside the registered buffers",
                      p.name, what, static_cast<unsigned long long>(addr), beats, p.bytes, size);
        error = msg;
    }
    Burst accept(Port& p, const char* what, uint64_t addr, unsigned len, unsigned size, unsigned burst) {
        Burst bu{(addr + offset) & ~static_cast<uint64_t>(p.bytes - 1), len + 1u, 0, true};
        bool shape = (1u << size) == p.bytes && burst == 1;  // INCR of full-width beats
        if (!shape || !inside(bu.base, bu.base + static_cast<uint64_t>(bu.beats) * p.bytes)) {
            bu.ok = false;
            fault(p, what, addr, bu.beats, size);
        }
        return bu;
    }
};

namespace {

// Before the rising edge (inputs driven, model settled): the transfers that
// happen at this edge. After it: what this slave drives for the next clock.
template <typename RD, typename WD, typename WS>
struct Io {
    // master -> slave
    CData& arvalid; QData& araddr; CData& arlen; CData& arsize; CData& arburst;
    CData& rready;
    CData& awvalid; QData& awaddr; CData& awlen; CData& awsize; CData& awburst;
    CData& wvalid; WD& wdata; WS& wstrb; CData& wlast;
    CData& bready;
    // slave -> master
    CData& arready; CData& rvalid; RD& rdata; CData& rlast; CData& rresp; CData& rid;
    CData& awready; CData& wready; CData& bvalid; CData& bresp; CData& bid;
};

template <typename IO>
void edge(L2lRtl& h, Port& p, IO io) {
    if (io.arvalid && io.arready) p.rd.push_back(h.accept(p, "read", io.araddr, io.arlen, io.arsize, io.arburst));
    if (io.rvalid && io.rready) {
        Burst& bu = p.rd.front();
        ++p.rbeats;
        if (++bu.done == bu.beats) p.rd.pop_front();
    }
    if (io.awvalid && io.awready) p.wr.push_back(h.accept(p, "write", io.awaddr, io.awlen, io.awsize, io.awburst));
    if (io.wvalid && io.wready) {
        Burst& bu = p.wr.front();
        if (bu.ok) {
            uint8_t* dst = reinterpret_cast<uint8_t*>(bu.base + static_cast<uint64_t>(bu.done) * p.bytes);
            h.beat.resize(width_bytes(io.wdata));
            to_bytes(io.wdata, h.beat.data(), h.beat.size());
            uint64_t strb = static_cast<uint64_t>(io.wstrb);
            for (size_t i = 0; i < p.bytes; ++i)
                if (strb >> i & 1) dst[i] = h.beat[i];
        }
        ++p.wbeats;
        bool last = ++bu.done == bu.beats;
        if (last != static_cast<bool>(io.wlast) && h.error.empty())
            h.error = std::string("m_axi_") + p.name + ": wlast does not mark the burst's last beat";
        if (last) {
            p.b.push_back(bu.ok);
            p.wr.pop_front();
        }
    }
    if (io.bvalid && io.bready) p.b.pop_front();
}

template <typename IO>
void drive(L2lRtl& h, Port& p, IO io) {
    io.arready = 1;
    io.awready = 1;
    io.rid = 0;
    io.bid = 0;
    io.rvalid = !p.rd.empty();
    if (io.rvalid) {
        const Burst& bu = p.rd.front();
        h.beat.assign(width_bytes(io.rdata), 0);
        if (bu.ok)
            std::memcpy(h.beat.data(), reinterpret_cast<const void*>(bu.base + static_cast<uint64_t>(bu.done) * p.bytes),
                        p.bytes);
        from_bytes(io.rdata, h.beat.data(), h.beat.size());
        io.rlast = bu.done + 1 == bu.beats;
        io.rresp = bu.ok ? 0 : 2;  // OKAY or SLVERR
    } else {
        io.rlast = 0;
        io.rresp = 0;
    }
    io.wready = !p.wr.empty();
    io.bvalid = !p.b.empty();
    io.bresp = p.b.empty() || p.b.front() ? 0 : 2;
}

}  // namespace

#define L2L_IO(T, P)                                                                                            \
    Io<decltype(T->m_axi_##P##_rdata), decltype(T->m_axi_##P##_wdata), decltype(T->m_axi_##P##_wstrb)>{        \
        T->m_axi_##P##_arvalid, T->m_axi_##P##_araddr, T->m_axi_##P##_arlen, T->m_axi_##P##_arsize,           \
        T->m_axi_##P##_arburst, T->m_axi_##P##_rready,                                                          \
        T->m_axi_##P##_awvalid, T->m_axi_##P##_awaddr, T->m_axi_##P##_awlen, T->m_axi_##P##_awsize,           \
        T->m_axi_##P##_awburst, T->m_axi_##P##_wvalid, T->m_axi_##P##_wdata, T->m_axi_##P##_wstrb,            \
        T->m_axi_##P##_wlast, T->m_axi_##P##_bready,                                                            \
        T->m_axi_##P##_arready, T->m_axi_##P##_rvalid, T->m_axi_##P##_rdata, T->m_axi_##P##_rlast,            \
        T->m_axi_##P##_rresp, T->m_axi_##P##_rid,                                                               \
        T->m_axi_##P##_awready, T->m_axi_##P##_wready, T->m_axi_##P##_bvalid, T->m_axi_##P##_bresp,           \
        T->m_axi_##P##_bid}

#define L2L_PORTS(F, H)                                          \
    F(H, H.ports[0], L2L_IO(H.top, gr));                         \
    F(H, H.ports[1], L2L_IO(H.top, p));                          \
    F(H, H.ports[2], L2L_IO(H.top, m));                          \
    F(H, H.ports[3], L2L_IO(H.top, v));                          \
    F(H, H.ports[4], L2L_IO(H.top, copy))

namespace {

// One clock: the inputs set for it are settled, the edge's transfers taken,
// the rising edge evaluated, then this side's inputs for the next clock.
void tick(L2lRtl& h) {
    auto* t = h.top.get();
    t->ap_clk = 0;
    t->eval();
    L2L_PORTS(edge, h);
    t->ap_clk = 1;
    t->eval();
    L2L_PORTS(drive, h);
    ++h.cycle;
}

}  // namespace

extern "C" {

// A model, reset, with the memory side idle; LANES etc. are the build's parameters.
L2lRtl* l2l_rtl_new() {
    auto* h = new L2lRtl;
    h->ctx.reset(new VerilatedContext);
    h->top.reset(new L2L_VTOP(h->ctx.get()));
    auto* t = h->top.get();
    h->ports[0].bytes = width_bytes(t->m_axi_gr_rdata);
    h->ports[1].bytes = width_bytes(t->m_axi_p_rdata);
    h->ports[2].bytes = width_bytes(t->m_axi_m_rdata);
    h->ports[3].bytes = width_bytes(t->m_axi_v_rdata);
    h->ports[4].bytes = width_bytes(t->m_axi_copy_rdata);
    t->s_axi_control_awvalid = t->s_axi_control_wvalid = t->s_axi_control_arvalid = 0;
    t->s_axi_control_bready = t->s_axi_control_rready = 0;
    t->ap_rst_n = 0;
    L2L_PORTS(drive, (*h));
    for (int i = 0; i < 8; ++i) tick(*h);
    t->ap_rst_n = 1;
    tick(*h);
    return h;
}

void l2l_rtl_free(L2lRtl* h) {
    if (h) h->top->final();
    delete h;
}

// Beat widths in bytes of gr, p, m, v, copy (the build's LANES and dtypes).
void l2l_rtl_port_bytes(const L2lRtl* h, uint32_t* out) {
    for (int i = 0; i < 5; ++i) out[i] = static_cast<uint32_t>(h->ports[i].bytes);
}

// The buffers the kernel may touch in the next launches: [lo[i], lo[i] + size[i]).
void l2l_rtl_regions(L2lRtl* h, const uint64_t* lo, const uint64_t* size, uint32_t count) {
    h->regions.clear();
    for (uint32_t i = 0; i < count; ++i) h->regions.push_back({lo[i], lo[i] + size[i]});
}

// Bus address a is host address a + offset from now on (0: they are the same).
void l2l_rtl_offset(L2lRtl* h, uint64_t offset) { h->offset = offset; }

// One AXI4-Lite write of a 32-bit register (all four strobes); 0, or -1 when the slave
// does not answer within 64 clocks.
int l2l_rtl_write(L2lRtl* h, uint32_t addr, uint32_t data) {
    auto* t = h->top.get();
    t->s_axi_control_awaddr = addr;
    t->s_axi_control_wdata = data;
    t->s_axi_control_wstrb = 0xF;
    t->s_axi_control_awvalid = t->s_axi_control_wvalid = 1;
    t->s_axi_control_bready = 1;
    bool aw = false, w = false;
    for (int i = 0; i < 64; ++i) {
        t->ap_clk = 0;
        t->eval();
        bool aw_fire = t->s_axi_control_awvalid && t->s_axi_control_awready;
        bool w_fire = t->s_axi_control_wvalid && t->s_axi_control_wready;
        bool b_fire = t->s_axi_control_bvalid && t->s_axi_control_bready;
        tick(*h);
        aw |= aw_fire;
        w |= w_fire;
        if (aw) t->s_axi_control_awvalid = 0;
        if (w) t->s_axi_control_wvalid = 0;
        if (b_fire) {
            t->s_axi_control_bready = 0;
            return 0;
        }
    }
    t->s_axi_control_awvalid = t->s_axi_control_wvalid = t->s_axi_control_bready = 0;
    return -1;
}

// One AXI4-Lite read; 0, or -1 when the slave does not answer within 64 clocks.
int l2l_rtl_read(L2lRtl* h, uint32_t addr, uint32_t* data) {
    auto* t = h->top.get();
    t->s_axi_control_araddr = addr;
    t->s_axi_control_arvalid = 1;
    t->s_axi_control_rready = 1;
    for (int i = 0; i < 64; ++i) {
        t->ap_clk = 0;
        t->eval();
        bool ar_fire = t->s_axi_control_arvalid && t->s_axi_control_arready;
        bool r_fire = t->s_axi_control_rvalid && t->s_axi_control_rready;
        uint32_t rdata = t->s_axi_control_rdata;
        tick(*h);
        if (ar_fire) t->s_axi_control_arvalid = 0;
        if (r_fire) {
            t->s_axi_control_rready = 0;
            *data = rdata;
            return 0;
        }
    }
    t->s_axi_control_arvalid = t->s_axi_control_rready = 0;
    return -1;
}

// Clocks until the interrupt line is high, at most max_cycles; the clocks taken, or
// -1 on the limit. A memory fault does not stop the kernel (it gets SLVERR, as from
// a card); l2l_rtl_error says so afterwards.
int64_t l2l_rtl_wait(L2lRtl* h, uint64_t max_cycles) {
    auto* t = h->top.get();
    for (uint64_t i = 0; i < max_cycles; ++i) {
        t->ap_clk = 0;
        t->eval();
        if (t->__SYM__interrupt) return static_cast<int64_t>(i);
        tick(*h);
    }
    return -1;
}

// The first bad access since the last call ("" when none); clears it.
const char* l2l_rtl_error(L2lRtl* h) {
    static thread_local std::string last;
    last = h->error;
    h->error.clear();
    return last.c_str();
}

// Clocks since the model was made, and beats moved (reads, writes) on each port.
uint64_t l2l_rtl_cycles(const L2lRtl* h) { return h->cycle; }
void l2l_rtl_beats(const L2lRtl* h, uint64_t* reads, uint64_t* writes) {
    for (int i = 0; i < 5; ++i) {
        reads[i] = h->ports[i].rbeats;
        writes[i] = h->ports[i].wbeats;
    }
}

}  // extern "C"
