// l2l_eps_kernel -- the RTL EPS as a Vitis RTL kernel: one layer update
// (finite check, gradient reduction, AdamW or Lion, device copy) per ap_start.
//
// What: the host writes the arguments of eps_update_<g>_<c> (fpga/ARGS.md,
// "RTL kernel"; eps_lion_<g>_<c> when OPTIMIZER = 1, its "Lion" subsection)
// into the ap_ctrl_hs register map of l2l_axil_ctrl and sets ap_start. A run is
//   1. check pass: the K gradient contributions (all of `gr`, k*n elements
//      of GDTYPE back to back) stream through l2l_eps_reduce in its block
//      order -- for each block of BLOCK*LANES elements, contribution 0's
//      segment, then contribution 1's for the same elements, ..., K-1's -- with
//      the flag cleared first; the reduced g is dropped, the flag kept;
//   2. the flag word (1 finite, 0 not) is written to `finite`, on m_axi_p;
//   3. only if finite, the update pass: the gradients stream through the
//      reducer again (the same operations in the same order, so the same
//      bits), joined beat by beat with p, m, v read in element order, through
//      l2l_eps_adamw; p', m', v' and the device copy are written back in place
//      in bursts. Weight decay applies to elements [0, n_decay) only (the
//      parameter groups): a count of decayed elements still to come, LANES
//      less per joined beat, gives every lane of the beat its decay bit, so a
//      boundary inside a beat, at a burst or block edge, or on a partial last
//      beat is exact; n_decay above n acts as n;
// then ap_done (and the interrupt, if enabled). A layer that is not finite
// gets only its flag written: p, m, v and the copy stay as they were (the
// contract's skip). n = 0 writes flag 1 and nothing else; k = 0 or k > 255
// writes flag 0 and nothing else.
//
// The optimizer is a build-time parameter, so each bitstream carries one
// datapath: OPTIMIZER = 0 is AdamW (l2l_eps_adamw, state p, m, v), 1 is Lion
// (l2l_eps_lion, state p, m). A Lion kernel has the same register map -- v's
// address word at 0x28 stays and is ignored, and Lion's seven scalars
// (LionScalars order) take the words from 0x4C on: decay .. omb2 where AdamW
// has them, neg_lr at 0x60, inv_scale at 0x64 (0x68, 0x6C ignored) -- and the
// same ports, m_axi_v tied off (no request is ever made on it). 2 is LAMB
// (l2l_eps_lamb, state p, m, v): two launches an update, chosen by a pass
// register past the status word (with the segment bounds, sums, step sizes and
// segment count: fpga/ARGS.md "LAMB"). Pass 1 is the run above with LAMB's
// norm pass as the update (m', v' written, p only read, each segment's sums
// written through p's write engine, the segment ends read on copy's idle read
// channels); pass 2 has no check and no flag: p, m', v' and the step sizes
// (on gr's port) in, p' and the copy out. With OPTIMIZER = 0 the logic is the
// AdamW kernel's as it was.
//
// Memory errors: every read and write response on the five masters is
// watched. One that is SLVERR or DECERR sets the status register's
// dma_error bit (0x70, l2l_axil_ctrl) until the next run starts. An error
// on a gradient read during the check pass makes the flag 0 and skips the
// update, so the layer stays as it was; an error on the flag's own write also
// skips the update. An error during the update pass cannot be undone (p, m, v
// are being rewritten in place): the run completes and the host, which reads
// the status with the flag, must not trust the layer.
//
// Why this shape: the contract leaves a non-finite layer untouched, so the
// flag must be known before the first write to p, m, v (ARGS.md: "Why a check
// pass"); recomputing the reduction costs a second read of the gradients but
// no write and read of the reduced g. Each array has its own AXI4 master
// (m_axi_gr, m_axi_p, m_axi_m, m_axi_v, m_axi_copy) so each can sit in its own
// HBM pseudo-channel, as the HLS kernel's bundles do; `finite` travels on
// m_axi_p's write channel (idle until the update pass) so it needs no port of
// its own and must be placed in p's bank.
//
// Memory layout rules (ARGS.md): addresses are byte addresses; gr and the
// flag need only element (flag: 4-byte) alignment -- a contribution c*n
// elements in generally starts mid-beat and l2l_axi_rd realigns it; p, m, v
// and copy must be aligned to their port's beat (32*LANES/8 bytes; copy
// CW*LANES/8), as every Vitis buffer is (4 KiB). Bursts of at most BURST
// beats never cross a BURST-beat boundary, hence never 4 KiB.
//
// Throughput: with a memory that never stalls, one beat of LANES elements
// per clock through each pass per contribution: the check pass takes about
// k*n/LANES clocks, the update pass about k*n/LANES (the gradients dominate
// when k > 1; p, m, v and the writes run alongside), plus pipeline fill
// (reducer 16, AdamW 110 to 113 clocks with the current latency header) and
// burst latency. Read buffers of RD_FIFO beats per port keep RD_FIFO - BURST
// beats in flight: enough while the memory's read latency is below that many
// clocks.
`default_nettype none

module l2l_eps_kernel #(
    parameter LANES   = 16,   // elements per beat, a power of two, 1 .. 16
    parameter GDTYPE  = 0,    // gradient dtype: 0 fp32, 1 bf16, 2 fp16
    parameter CDTYPE  = 0,    // device copy dtype: 0 fp32, 1 bf16, 2 fp16
    parameter OPTIMIZER = 0,  // the update: 0 AdamW (eps_update_<g>_<c>), 1 Lion (eps_lion_<g>_<c>),
                              // 2 LAMB (eps_lamb_<g>_<c>: both passes, fpga/ARGS.md "LAMB")
    parameter BURST   = 64,   // beats per AXI burst at most (power of two, BURST * beat bytes <= 4096)
    parameter BLOCK   = 64,   // beats per reducer segment (the accumulator's size)
    parameter RD_FIFO = 256,  // read buffer per port in beats (power of two >= BURST)
    parameter WR_FIFO = 128,  // write buffer per port in beats (power of two >= BURST)
    parameter DSP_SHAPE = 0,  // how each multiplier cuts its 24x24 significand product: 0 18x18 pieces
                              // (ECP5 MULT18X18D; 5 DSP48s a multiplier on Xilinx), 1 27x18 pieces
                              // (Xilinx DSP48E2, or DSP48E1's 25x18: 2 DSPs a multiplier); same results
    parameter C_S_AXI_CONTROL_ADDR_WIDTH = 12,
    // port widths: fixed by the parameters above (kernel.xml states them)
    parameter C_M_AXI_GR_DATA_WIDTH   = ((GDTYPE == 0) ? 32 : 16) * LANES,
    parameter C_M_AXI_DATA_WIDTH      = 32 * LANES,
    parameter C_M_AXI_COPY_DATA_WIDTH = ((CDTYPE == 0) ? 32 : 16) * LANES
) (
    input  wire        ap_clk,
    input  wire        ap_rst_n,
    // the name Vitis requires of an RTL kernel's interrupt (a C++ word to Verilator)
    /* verilator lint_off SYMRSVDWORD */
    output wire        interrupt,
    /* verilator lint_on SYMRSVDWORD */

    // AXI4-Lite control slave
    input  wire [C_S_AXI_CONTROL_ADDR_WIDTH-1:0] s_axi_control_awaddr,
    input  wire        s_axi_control_awvalid,
    output wire        s_axi_control_awready,
    input  wire [31:0] s_axi_control_wdata,
    input  wire [3:0]  s_axi_control_wstrb,
    input  wire        s_axi_control_wvalid,
    output wire        s_axi_control_wready,
    output wire [1:0]  s_axi_control_bresp,
    output wire        s_axi_control_bvalid,
    input  wire        s_axi_control_bready,
    input  wire [C_S_AXI_CONTROL_ADDR_WIDTH-1:0] s_axi_control_araddr,
    input  wire        s_axi_control_arvalid,
    output wire        s_axi_control_arready,
    output wire [31:0] s_axi_control_rdata,
    output wire [1:0]  s_axi_control_rresp,
    output wire        s_axi_control_rvalid,
    input  wire        s_axi_control_rready,

    // m_axi_gr: the K gradient contributions (read only; write channels tied off)
    output wire [0:0]  m_axi_gr_awid,
    output wire [63:0] m_axi_gr_awaddr,
    output wire [7:0]  m_axi_gr_awlen,
    output wire [2:0]  m_axi_gr_awsize,
    output wire [1:0]  m_axi_gr_awburst,
    output wire        m_axi_gr_awvalid,
    // the write channels' inputs of a read-only master are part of the port, not used
    /* verilator lint_off UNUSEDSIGNAL */
    input  wire        m_axi_gr_awready,
    /* verilator lint_on UNUSEDSIGNAL */
    output wire [C_M_AXI_GR_DATA_WIDTH-1:0]   m_axi_gr_wdata,
    output wire [C_M_AXI_GR_DATA_WIDTH/8-1:0] m_axi_gr_wstrb,
    output wire        m_axi_gr_wlast,
    output wire        m_axi_gr_wvalid,
    // (as above: a read-only master's write-side inputs)
    /* verilator lint_off UNUSEDSIGNAL */
    input  wire        m_axi_gr_wready,
    input  wire [0:0]  m_axi_gr_bid,
    input  wire [1:0]  m_axi_gr_bresp,
    input  wire        m_axi_gr_bvalid,
    /* verilator lint_on UNUSEDSIGNAL */
    output wire        m_axi_gr_bready,
    output wire [0:0]  m_axi_gr_arid,
    output wire [63:0] m_axi_gr_araddr,
    output wire [7:0]  m_axi_gr_arlen,
    output wire [2:0]  m_axi_gr_arsize,
    output wire [1:0]  m_axi_gr_arburst,
    output wire        m_axi_gr_arvalid,
    input  wire        m_axi_gr_arready,
    input  wire [0:0]  m_axi_gr_rid,
    input  wire [C_M_AXI_GR_DATA_WIDTH-1:0]   m_axi_gr_rdata,
    input  wire [1:0]  m_axi_gr_rresp,
    input  wire        m_axi_gr_rlast,
    input  wire        m_axi_gr_rvalid,
    output wire        m_axi_gr_rready,

    // m_axi_p: master weights, read and written in place; also the flag write
    output wire [0:0]  m_axi_p_awid,
    output wire [63:0] m_axi_p_awaddr,
    output wire [7:0]  m_axi_p_awlen,
    output wire [2:0]  m_axi_p_awsize,
    output wire [1:0]  m_axi_p_awburst,
    output wire        m_axi_p_awvalid,
    input  wire        m_axi_p_awready,
    output wire [C_M_AXI_DATA_WIDTH-1:0]   m_axi_p_wdata,
    output wire [C_M_AXI_DATA_WIDTH/8-1:0] m_axi_p_wstrb,
    output wire        m_axi_p_wlast,
    output wire        m_axi_p_wvalid,
    input  wire        m_axi_p_wready,
    input  wire [0:0]  m_axi_p_bid,
    input  wire [1:0]  m_axi_p_bresp,
    input  wire        m_axi_p_bvalid,
    output wire        m_axi_p_bready,
    output wire [0:0]  m_axi_p_arid,
    output wire [63:0] m_axi_p_araddr,
    output wire [7:0]  m_axi_p_arlen,
    output wire [2:0]  m_axi_p_arsize,
    output wire [1:0]  m_axi_p_arburst,
    output wire        m_axi_p_arvalid,
    input  wire        m_axi_p_arready,
    input  wire [0:0]  m_axi_p_rid,
    input  wire [C_M_AXI_DATA_WIDTH-1:0]   m_axi_p_rdata,
    input  wire [1:0]  m_axi_p_rresp,
    input  wire        m_axi_p_rlast,
    input  wire        m_axi_p_rvalid,
    output wire        m_axi_p_rready,

    // m_axi_m: first moment, in place
    output wire [0:0]  m_axi_m_awid,
    output wire [63:0] m_axi_m_awaddr,
    output wire [7:0]  m_axi_m_awlen,
    output wire [2:0]  m_axi_m_awsize,
    output wire [1:0]  m_axi_m_awburst,
    output wire        m_axi_m_awvalid,
    input  wire        m_axi_m_awready,
    output wire [C_M_AXI_DATA_WIDTH-1:0]   m_axi_m_wdata,
    output wire [C_M_AXI_DATA_WIDTH/8-1:0] m_axi_m_wstrb,
    output wire        m_axi_m_wlast,
    output wire        m_axi_m_wvalid,
    input  wire        m_axi_m_wready,
    input  wire [0:0]  m_axi_m_bid,
    input  wire [1:0]  m_axi_m_bresp,
    input  wire        m_axi_m_bvalid,
    output wire        m_axi_m_bready,
    output wire [0:0]  m_axi_m_arid,
    output wire [63:0] m_axi_m_araddr,
    output wire [7:0]  m_axi_m_arlen,
    output wire [2:0]  m_axi_m_arsize,
    output wire [1:0]  m_axi_m_arburst,
    output wire        m_axi_m_arvalid,
    input  wire        m_axi_m_arready,
    input  wire [0:0]  m_axi_m_rid,
    input  wire [C_M_AXI_DATA_WIDTH-1:0]   m_axi_m_rdata,
    input  wire [1:0]  m_axi_m_rresp,
    input  wire        m_axi_m_rlast,
    input  wire        m_axi_m_rvalid,
    output wire        m_axi_m_rready,

    // m_axi_v: second moment, in place (AdamW); tied off in a Lion kernel (OPTIMIZER = 1),
    // whose inputs here then go unused (bit 1 of rresp and bresp aside: still watched for errors)
    output wire [0:0]  m_axi_v_awid,
    output wire [63:0] m_axi_v_awaddr,
    output wire [7:0]  m_axi_v_awlen,
    output wire [2:0]  m_axi_v_awsize,
    output wire [1:0]  m_axi_v_awburst,
    output wire        m_axi_v_awvalid,
    // (the inputs of a Lion kernel's tied-off master: part of the port, not used)
    /* verilator lint_off UNUSEDSIGNAL */
    input  wire        m_axi_v_awready,
    output wire [C_M_AXI_DATA_WIDTH-1:0]   m_axi_v_wdata,
    output wire [C_M_AXI_DATA_WIDTH/8-1:0] m_axi_v_wstrb,
    output wire        m_axi_v_wlast,
    output wire        m_axi_v_wvalid,
    input  wire        m_axi_v_wready,
    input  wire [0:0]  m_axi_v_bid,
    input  wire [1:0]  m_axi_v_bresp,
    input  wire        m_axi_v_bvalid,
    output wire        m_axi_v_bready,
    output wire [0:0]  m_axi_v_arid,
    output wire [63:0] m_axi_v_araddr,
    output wire [7:0]  m_axi_v_arlen,
    output wire [2:0]  m_axi_v_arsize,
    output wire [1:0]  m_axi_v_arburst,
    output wire        m_axi_v_arvalid,
    input  wire        m_axi_v_arready,
    input  wire [0:0]  m_axi_v_rid,
    input  wire [C_M_AXI_DATA_WIDTH-1:0]   m_axi_v_rdata,
    input  wire [1:0]  m_axi_v_rresp,
    input  wire        m_axi_v_rlast,
    input  wire        m_axi_v_rvalid,
    /* verilator lint_on UNUSEDSIGNAL */
    output wire        m_axi_v_rready,

    // m_axi_copy: the device copy of p' (write only; read channels tied off)
    output wire [0:0]  m_axi_copy_awid,
    output wire [63:0] m_axi_copy_awaddr,
    output wire [7:0]  m_axi_copy_awlen,
    output wire [2:0]  m_axi_copy_awsize,
    output wire [1:0]  m_axi_copy_awburst,
    output wire        m_axi_copy_awvalid,
    input  wire        m_axi_copy_awready,
    output wire [C_M_AXI_COPY_DATA_WIDTH-1:0]   m_axi_copy_wdata,
    output wire [C_M_AXI_COPY_DATA_WIDTH/8-1:0] m_axi_copy_wstrb,
    output wire        m_axi_copy_wlast,
    output wire        m_axi_copy_wvalid,
    input  wire        m_axi_copy_wready,
    input  wire [0:0]  m_axi_copy_bid,
    input  wire [1:0]  m_axi_copy_bresp,
    input  wire        m_axi_copy_bvalid,
    output wire        m_axi_copy_bready,
    output wire [0:0]  m_axi_copy_arid,
    output wire [63:0] m_axi_copy_araddr,
    output wire [7:0]  m_axi_copy_arlen,
    output wire [2:0]  m_axi_copy_arsize,
    output wire [1:0]  m_axi_copy_arburst,
    output wire        m_axi_copy_arvalid,
    // the read channels' inputs of a write-only master are part of the port, not used
    /* verilator lint_off UNUSEDSIGNAL */
    input  wire        m_axi_copy_arready,
    input  wire [0:0]  m_axi_copy_rid,
    input  wire [C_M_AXI_COPY_DATA_WIDTH-1:0]   m_axi_copy_rdata,
    input  wire [1:0]  m_axi_copy_rresp,
    input  wire        m_axi_copy_rlast,
    input  wire        m_axi_copy_rvalid,
    /* verilator lint_on UNUSEDSIGNAL */
    output wire        m_axi_copy_rready
);

    function integer clog2;     // ceil(log2(x)), a constant function (Verilog-2001)
        input integer x;
        integer r;
        begin
            r = 0;
            while ((1 << r) < x)
                r = r + 1;
            clog2 = r;
        end
    endfunction

    localparam GW   = (GDTYPE == 0) ? 32 : 16;    // gradient element bits
    localparam CW   = (CDTYPE == 0) ? 32 : 16;    // copy element bits
    localparam GEBL = (GDTYPE == 0) ? 2 : 1;      // log2 gradient element bytes
    localparam DW   = 32 * LANES;
    localparam BB   = DW / 8;                     // p/m/v beat bytes
    localparam BBL  = clog2(BB);
    localparam SEG  = BLOCK * LANES;              // elements per reducer segment
    localparam [31:0] SEG_B  = SEG << GEBL;       // gradient bytes per segment (< 2^23)
    localparam [31:0] FL_MSK = BB - 4;            // the flag word's byte offset bits in a beat
    localparam        LAMB   = (OPTIMIZER == 2);  // two passes, chosen by the pass register

    initial begin
        if (LANES < 1 || LANES > 16 || (LANES & (LANES - 1)) != 0 ||
            GDTYPE < 0 || GDTYPE > 2 || CDTYPE < 0 || CDTYPE > 2 || OPTIMIZER < 0 || OPTIMIZER > 2 ||
            DSP_SHAPE < 0 || DSP_SHAPE > 1 ||
            BURST < 1 || BURST > 256 || (BURST & (BURST - 1)) != 0 || BURST * BB > 4096 ||
            BLOCK < 1 || BLOCK > 65536 || (OPTIMIZER == 2 && C_S_AXI_CONTROL_ADDR_WIDTH < 8) ||
            RD_FIFO < BURST || RD_FIFO < 2 || (RD_FIFO & (RD_FIFO - 1)) != 0 ||
            WR_FIFO < BURST || WR_FIFO < 2 || (WR_FIFO & (WR_FIFO - 1)) != 0 ||
            C_M_AXI_GR_DATA_WIDTH != GW * LANES || C_M_AXI_DATA_WIDTH != DW ||
            C_M_AXI_COPY_DATA_WIDTH != CW * LANES) begin
            $error("l2l_eps_kernel: illegal parameters LANES=%0d GDTYPE=%0d CDTYPE=%0d OPTIMIZER=%0d DSP_SHAPE=%0d BURST=%0d BLOCK=%0d RD_FIFO=%0d WR_FIFO=%0d (or a port width that does not follow them)",
                   LANES, GDTYPE, CDTYPE, OPTIMIZER, DSP_SHAPE, BURST, BLOCK, RD_FIFO, WR_FIFO);
            $finish;
        end
    end

    // ------------------------------------------------------------ reset
    reg rst;
    always @(posedge ap_clk)
        rst <= !ap_rst_n;

    // ------------------------------------------------------------ memory errors
    // SLVERR (2'b10) and DECERR (2'b11) both have bit 1 set; OKAY and EXOKAY do not.
    wire resp_err = (m_axi_gr_rvalid   && m_axi_gr_rready   && m_axi_gr_rresp[1])   ||
                    (m_axi_p_rvalid    && m_axi_p_rready    && m_axi_p_rresp[1])    ||
                    (m_axi_m_rvalid    && m_axi_m_rready    && m_axi_m_rresp[1])    ||
                    (m_axi_v_rvalid    && m_axi_v_rready    && m_axi_v_rresp[1])    ||
                    (m_axi_p_bvalid    && m_axi_p_bready    && m_axi_p_bresp[1])    ||
                    (m_axi_m_bvalid    && m_axi_m_bready    && m_axi_m_bresp[1])    ||
                    (m_axi_v_bvalid    && m_axi_v_bready    && m_axi_v_bresp[1])    ||
                    (m_axi_copy_bvalid && m_axi_copy_bready && m_axi_copy_bresp[1]) ||
                    (LAMB && m_axi_copy_rvalid && m_axi_copy_rready && m_axi_copy_rresp[1]);  // LAMB's seg
    reg  dma_err;                  // sticky for a run: cleared when the next one starts
    wire dma_err_now = dma_err || resp_err;

    // ------------------------------------------------------------ control registers
    wire        ap_start;
    wire        ap_ready, ap_done, ap_idle;
    wire [63:0] a_gr, a_p, a_m, a_v, a_copy, a_finite;
    wire [31:0] a_n, a_k, a_n_decay, a_decay, a_b1, a_omb1, a_b2, a_omb2, a_inv_bc2_sqrt, a_eps, a_neg_step,
                a_inv_scale;
    // LAMB's words (0x74 on): the register file holds them only when OPTIMIZER = 2
    wire [31:0] a_pass, a_nseg;
    wire [63:0] a_seg, a_sums, a_steps;

    l2l_axil_ctrl #(.ADDR_W(C_S_AXI_CONTROL_ADDR_WIDTH), .LAMB(LAMB ? 1 : 0)) u_ctrl (
        .clk(ap_clk), .rst(rst),
        .s_axi_control_awaddr(s_axi_control_awaddr), .s_axi_control_awvalid(s_axi_control_awvalid),
        .s_axi_control_awready(s_axi_control_awready), .s_axi_control_wdata(s_axi_control_wdata),
        .s_axi_control_wstrb(s_axi_control_wstrb), .s_axi_control_wvalid(s_axi_control_wvalid),
        .s_axi_control_wready(s_axi_control_wready), .s_axi_control_bresp(s_axi_control_bresp),
        .s_axi_control_bvalid(s_axi_control_bvalid), .s_axi_control_bready(s_axi_control_bready),
        .s_axi_control_araddr(s_axi_control_araddr), .s_axi_control_arvalid(s_axi_control_arvalid),
        .s_axi_control_arready(s_axi_control_arready), .s_axi_control_rdata(s_axi_control_rdata),
        .s_axi_control_rresp(s_axi_control_rresp), .s_axi_control_rvalid(s_axi_control_rvalid),
        .s_axi_control_rready(s_axi_control_rready), .interrupt(interrupt),
        .ap_start(ap_start), .ap_ready(ap_ready), .ap_done(ap_done), .ap_idle(ap_idle),
        .dma_error(dma_err),
        .arg_gr(a_gr), .arg_p(a_p), .arg_m(a_m), .arg_v(a_v), .arg_copy(a_copy), .arg_finite(a_finite),
        .arg_n(a_n), .arg_k(a_k), .arg_n_decay(a_n_decay), .arg_decay(a_decay), .arg_b1(a_b1), .arg_omb1(a_omb1), .arg_b2(a_b2),
        .arg_omb2(a_omb2), .arg_inv_bc2_sqrt(a_inv_bc2_sqrt), .arg_eps(a_eps), .arg_neg_step(a_neg_step),
        .arg_inv_scale(a_inv_scale),
        .arg_pass(a_pass), .arg_seg(a_seg), .arg_sums(a_sums), .arg_steps(a_steps), .arg_nseg(a_nseg));

    // ------------------------------------------------------------ run state
    localparam [2:0] S_IDLE = 3'd0, S_CHECK = 3'd1, S_SAMPLE = 3'd2, S_FLAG = 3'd3,
                     S_UPDATE = 3'd4, S_DONE = 3'd5,
                     S_GO = 3'd6;      // LAMB's step pass, arguments latched: its commands next
    reg  [2:0]  state;

    // arguments, latched when the run starts (ap_ready: the host may write the next ones)
    reg  [63:0] r_gr, r_p, r_m, r_copy, r_finite;
    reg  [31:0] r_n;
    reg  [7:0]  r_k;
    reg  [31:0] r_n_decay;
    // the scalar words by their AdamW names; a Lion kernel reads decay .. omb2 as they are, its
    // neg_lr from the inv_bc2_sqrt word (0x60) and its inv_scale from the eps word (0x64, latched
    // into r_inv_scale)
    reg  [31:0] r_decay, r_b1, r_omb1, r_b2, r_omb2, r_inv_bc2_sqrt, r_inv_scale;
    // v's address and AdamW's eps and neg_step words: a Lion kernel (OPTIMIZER = 1) does not read them
    /* verilator lint_off UNUSEDSIGNAL */
    reg  [63:0] r_v;
    reg  [31:0] r_eps, r_neg_step;
    // LAMB's pass (1 when the pass register is 2, the step pass), buffers and segment count:
    // only the LAMB kernel (OPTIMIZER = 2) reads them
    reg         r_pass2;
    reg  [63:0] r_seg, r_sums, r_steps;
    reg  [31:0] r_nseg;
    /* verilator lint_on UNUSEDSIGNAL */
    wire        lamb1 = LAMB && !r_pass2;     // the LAMB kernel's norms pass
    wire        lamb2 = LAMB && r_pass2;      // its step pass: no gradients, no check, no flag

    assign ap_ready = (state == S_IDLE) && ap_start;
    assign ap_idle  = (state == S_IDLE);
    assign ap_done  = (state == S_DONE);

    wire k_ok = (a_k != 0) && (a_k <= 255) && (!LAMB || a_pass == 32'd1);   // LAMB: pass 1 here

    // ------------------------------------------------------------ gradient segments
    // for each block b, for each contribution c: elements [c*n + b*SEG, + min(SEG, n - b*SEG))
    reg         gen_active;
    reg  [7:0]  gen_c;
    reg  [31:0] gen_left;          // elements from the current block's start to n
    reg  [63:0] gen_blk;           // byte address of contribution 0's segment of the block
    reg  [63:0] gen_seg;           // byte address of the current segment
    wire [31:0] gen_len = (gen_left < SEG) ? gen_left : SEG;
    wire        gr_cmd_ready;
    wire        gen_take = gen_active && gr_cmd_ready;
    reg         rd_cmd_st;         // LAMB's step pass: the step sizes, on gr's port (idle then)
    wire [31:0] st_len = (GDTYPE == 0) ? r_nseg : (r_nseg << 1);   // in gradient elements
    reg         gen_start;         // pulse: a pass over the gradients begins (arguments latched)

    always @(posedge ap_clk) begin
        if (rst) begin
            gen_active <= 1'b0;
        end else if (gen_start) begin
            gen_active <= 1'b1;
            gen_c      <= 8'd0;
            gen_left   <= r_n;
            gen_blk    <= r_gr;
            gen_seg    <= r_gr;
        end else if (gen_take) begin
            if (gen_c == r_k - 8'd1) begin
                gen_c    <= 8'd0;
                gen_left <= gen_left - gen_len;
                gen_blk  <= gen_blk + {32'd0, SEG_B};
                gen_seg  <= gen_blk + {32'd0, SEG_B};
                if (gen_left <= SEG)
                    gen_active <= 1'b0;
            end else begin
                gen_c   <= gen_c + 8'd1;
                gen_seg <= gen_seg + ({32'd0, r_n} << GEBL);
            end
        end
    end

    // ------------------------------------------------------------ read engines
    wire [GW*LANES-1:0] gr_tdata;
    wire [LANES-1:0]    gr_tkeep;
    wire                gr_tlast, gr_tvalid, gr_tready;

    // Outputs left open on purpose (PINCONNECTEMPTY waived around the instances below): a
    // read engine's idle (a run ends on beat counts and the write engines' idle), the p, m, v
    // streams' tkeep and m, v's tlast (joined beat by beat, the reduced g's tkeep and p's
    // tlast stand for them), the reducer's and AdamW's tlast and latency (the sequencer and
    // the write engines count beats).
    /* verilator lint_off PINCONNECTEMPTY */
    l2l_axi_rd #(.LANES(LANES), .EW(GW), .BURST(BURST), .FIFO_DEPTH(RD_FIFO)) u_rd_gr (
        .clk(ap_clk), .rst(rst),
        .cmd_valid(gen_active || rd_cmd_st), .cmd_ready(gr_cmd_ready),
        .cmd_addr(gen_active ? gen_seg : r_steps), .cmd_len(gen_active ? gen_len : st_len),
        .m_axis_tdata(gr_tdata), .m_axis_tkeep(gr_tkeep), .m_axis_tlast(gr_tlast),
        .m_axis_tvalid(gr_tvalid), .m_axis_tready(gr_tready), .idle(),
        .m_axi_arid(m_axi_gr_arid), .m_axi_araddr(m_axi_gr_araddr), .m_axi_arlen(m_axi_gr_arlen),
        .m_axi_arsize(m_axi_gr_arsize), .m_axi_arburst(m_axi_gr_arburst), .m_axi_arvalid(m_axi_gr_arvalid),
        .m_axi_arready(m_axi_gr_arready), .m_axi_rid(m_axi_gr_rid), .m_axi_rdata(m_axi_gr_rdata),
        .m_axi_rresp(m_axi_gr_rresp), .m_axi_rlast(m_axi_gr_rlast), .m_axi_rvalid(m_axi_gr_rvalid),
        .m_axi_rready(m_axi_gr_rready));

    // p, m, v: one command of n elements each per update pass (v's engine is AdamW's, in the
    // optimizer's block below)
    reg                 rd_cmd_p, rd_cmd_m, rd_cmd_v;     // command pending
    wire                rd_rdy_p, rd_rdy_m, rd_rdy_v;
    wire [DW-1:0]       p_tdata, m_tdata;
    // p's tlast and the reduced g's tkeep: the AdamW and Lion datapaths' (LAMB counts, and takes p's keep)
    /* verilator lint_off UNUSEDSIGNAL */
    wire                p_tlast;
    /* verilator lint_on UNUSEDSIGNAL */
    // p's lanes in the beat: the LAMB datapath's keep (its step pass has no reduced g)
    /* verilator lint_off UNUSEDSIGNAL */
    wire [LANES-1:0]    p_tkeep;
    /* verilator lint_on UNUSEDSIGNAL */
    wire                p_tvalid, m_tvalid, v_tvalid;
    wire                join_fire;

    l2l_axi_rd #(.LANES(LANES), .EW(32), .BURST(BURST), .FIFO_DEPTH(RD_FIFO), .REALIGN(0)) u_rd_p (
        .clk(ap_clk), .rst(rst),
        .cmd_valid(rd_cmd_p), .cmd_ready(rd_rdy_p), .cmd_addr(r_p), .cmd_len(r_n),
        .m_axis_tdata(p_tdata), .m_axis_tkeep(p_tkeep), .m_axis_tlast(p_tlast),
        .m_axis_tvalid(p_tvalid), .m_axis_tready(join_fire), .idle(),
        .m_axi_arid(m_axi_p_arid), .m_axi_araddr(m_axi_p_araddr), .m_axi_arlen(m_axi_p_arlen),
        .m_axi_arsize(m_axi_p_arsize), .m_axi_arburst(m_axi_p_arburst), .m_axi_arvalid(m_axi_p_arvalid),
        .m_axi_arready(m_axi_p_arready), .m_axi_rid(m_axi_p_rid), .m_axi_rdata(m_axi_p_rdata),
        .m_axi_rresp(m_axi_p_rresp), .m_axi_rlast(m_axi_p_rlast), .m_axi_rvalid(m_axi_p_rvalid),
        .m_axi_rready(m_axi_p_rready));

    l2l_axi_rd #(.LANES(LANES), .EW(32), .BURST(BURST), .FIFO_DEPTH(RD_FIFO), .REALIGN(0)) u_rd_m (
        .clk(ap_clk), .rst(rst),
        .cmd_valid(rd_cmd_m), .cmd_ready(rd_rdy_m), .cmd_addr(r_m), .cmd_len(r_n),
        .m_axis_tdata(m_tdata), .m_axis_tkeep(), .m_axis_tlast(),
        .m_axis_tvalid(m_tvalid), .m_axis_tready(join_fire), .idle(),
        .m_axi_arid(m_axi_m_arid), .m_axi_araddr(m_axi_m_araddr), .m_axi_arlen(m_axi_m_arlen),
        .m_axi_arsize(m_axi_m_arsize), .m_axi_arburst(m_axi_m_arburst), .m_axi_arvalid(m_axi_m_arvalid),
        .m_axi_arready(m_axi_m_arready), .m_axi_rid(m_axi_m_rid), .m_axi_rdata(m_axi_m_rdata),
        .m_axi_rresp(m_axi_m_rresp), .m_axi_rlast(m_axi_m_rlast), .m_axi_rvalid(m_axi_m_rvalid),
        .m_axi_rready(m_axi_m_rready));
    /* verilator lint_on PINCONNECTEMPTY */

    // ------------------------------------------------------------ reducer
    wire [DW-1:0]    g_tdata;
    /* verilator lint_off UNUSEDSIGNAL */
    wire [LANES-1:0] g_tkeep;
    /* verilator lint_on UNUSEDSIGNAL */
    wire             g_tvalid, g_tready;
    wire             red_finite;
    reg              flag_clear;
    wire             red_in_ready, st_in_ready;   // the gradient stream's two consumers
    assign gr_tready = lamb2 ? st_in_ready : red_in_ready;

    // tlast and latency left open (see the read engines above)
    /* verilator lint_off PINCONNECTEMPTY */
    l2l_eps_reduce #(.LANES(LANES), .GDTYPE(GDTYPE), .BLOCK(BLOCK), .DSP_SHAPE(DSP_SHAPE)) u_reduce (
        .clk(ap_clk), .rst(rst), .inv_scale(r_inv_scale), .k(r_k),
        .s_axis_tdata(gr_tdata), .s_axis_tkeep(gr_tkeep), .s_axis_tlast(gr_tlast),
        .s_axis_tvalid(gr_tvalid && !lamb2), .s_axis_tready(red_in_ready),
        .m_axis_tdata(g_tdata), .m_axis_tkeep(g_tkeep), .m_axis_tlast(),
        .m_axis_tvalid(g_tvalid), .m_axis_tready(g_tready),
        .flag_clear(flag_clear), .finite(red_finite), .latency());
    /* verilator lint_on PINCONNECTEMPTY */

    // check pass: g is counted and dropped; update pass: g joins p, m, v
    reg  [31:0] chk_left;          // reduced beats still to come in the check pass
    wire        in_check = (state == S_CHECK);
    wire        chk_beat = in_check && g_tvalid;
    wire        ad_ready;
    wire        all_in   = (g_tvalid || lamb2) && p_tvalid && m_tvalid && v_tvalid;
    assign join_fire = (state == S_UPDATE) && all_in && ad_ready;
    assign g_tready  = in_check || join_fire;

    // ------------------------------------------------------------ decay boundary
    // dec_left: elements from the current joined beat on that are still to be decayed
    // (saturates at 0); dmask: lane i of that beat is decayed iff dec_left > i. Both are
    // flip-flops, so the lanes' decay-operand mux is fed from registers: the comparators
    // sit before dmask, off the multipliers' first stage.
    reg  [31:0]      dec_left;
    reg  [LANES-1:0] dmask;
    wire [31:0]      dec_next = (dec_left > LANES) ? dec_left - LANES : 32'd0;
    // one set of comparators: the next beat's count in the update pass, n_decay before it
    wire [31:0]      dec_from = (state == S_UPDATE) ? dec_next : r_n_decay;
    wire [LANES-1:0] dmask_from;
    genvar gi;
    generate
        for (gi = 0; gi < LANES; gi = gi + 1) begin : g_dmask
            assign dmask_from[gi] = (dec_from > gi);
        end
    endgenerate

    // ------------------------------------------------------------ AdamW or Lion: the joined beat
    wire [DW-1:0]       pn, mn;
    wire [CW*LANES-1:0] cn;
    wire [LANES-1:0]    ad_keep;
    wire                ad_valid;
    wire                wr_rdy_p, wr_rdy_m, wr_rdy_v, wr_rdy_c;    // stream side
    wire                all_out  = lamb1 ? (wr_rdy_m && wr_rdy_v) :
                                   lamb2 ? (wr_rdy_p && wr_rdy_c) : (wr_rdy_p && wr_rdy_m && wr_rdy_v && wr_rdy_c);
    wire                out_fire = ad_valid && all_out;
    // what each write engine takes: the datapath's beats, but for LAMB the pass's own (pass 1
    // writes m', v' and, on p's engine, the sums; pass 2 writes p' and the copy)
    wire [DW-1:0]       sums_tdata;
    wire                sums_tvalid;
    wire                wv_p = lamb1 ? sums_tvalid : out_fire;
    wire                wv_m = lamb2 ? 1'b0 : out_fire;
    wire                wv_c = lamb1 ? 1'b0 : out_fire;

    // operand isolation: during the check pass the reducer's output does not toggle the
    // datapath (dynamic power; it is not sampled there anyway)
    wire [DW-1:0] g_iso = (state == S_UPDATE) ? g_tdata : {DW{1'b0}};

    // ------------------------------------------------------------ the optimizer's datapath
    // and v's engines: AdamW's (OPTIMIZER = 0, the kernel as it was), Lion's (v tied off) or
    // LAMB's (with its segment ends on copy's read channels)
    reg  wr_cmd_p, wr_cmd_m, wr_cmd_v, wr_cmd_c;                   // command pending
    reg  rd_cmd_seg;                                               // LAMB: the segment ends
    wire seg_cmd_ready;
    // LAMB: a run begins (a pulse only the LAMB datapath takes)
    /* verilator lint_off UNUSEDSIGNAL */
    reg  lamb_start;
    /* verilator lint_on UNUSEDSIGNAL */
    wire wc_rdy_p, wc_rdy_m, wc_rdy_v, wc_rdy_c;
    wire wr_idle_p, wr_idle_m, wr_idle_v, wr_idle_c;

    generate
        if (OPTIMIZER == 0) begin : g_adamw
            wire [DW-1:0] v_tdata, vn;

            // idle, tkeep and tlast left open (see the read engines above)
            /* verilator lint_off PINCONNECTEMPTY */
            l2l_axi_rd #(.LANES(LANES), .EW(32), .BURST(BURST), .FIFO_DEPTH(RD_FIFO), .REALIGN(0)) u_rd_v (
                .clk(ap_clk), .rst(rst),
                .cmd_valid(rd_cmd_v), .cmd_ready(rd_rdy_v), .cmd_addr(r_v), .cmd_len(r_n),
                .m_axis_tdata(v_tdata), .m_axis_tkeep(), .m_axis_tlast(),
                .m_axis_tvalid(v_tvalid), .m_axis_tready(join_fire), .idle(),
                .m_axi_arid(m_axi_v_arid), .m_axi_araddr(m_axi_v_araddr), .m_axi_arlen(m_axi_v_arlen),
                .m_axi_arsize(m_axi_v_arsize), .m_axi_arburst(m_axi_v_arburst), .m_axi_arvalid(m_axi_v_arvalid),
                .m_axi_arready(m_axi_v_arready), .m_axi_rid(m_axi_v_rid), .m_axi_rdata(m_axi_v_rdata),
                .m_axi_rresp(m_axi_v_rresp), .m_axi_rlast(m_axi_v_rlast), .m_axi_rvalid(m_axi_v_rvalid),
                .m_axi_rready(m_axi_v_rready));
            /* verilator lint_on PINCONNECTEMPTY */

            // tlast and latency left open (see the read engines above)
            /* verilator lint_off PINCONNECTEMPTY */
            l2l_eps_adamw #(.LANES(LANES), .CDTYPE(CDTYPE), .DSP_SHAPE(DSP_SHAPE)) u_adamw (
                .clk(ap_clk), .rst(rst),
                .decay(r_decay), .b1(r_b1), .omb1(r_omb1), .b2(r_b2), .omb2(r_omb2),
                .inv_bc2_sqrt(r_inv_bc2_sqrt), .eps(r_eps), .neg_step(r_neg_step),
                .s_axis_g(g_iso), .s_axis_p(p_tdata), .s_axis_m(m_tdata), .s_axis_v(v_tdata),
                .s_axis_tkeep(g_tkeep), .s_axis_decay(dmask), .s_axis_tlast(p_tlast),
                .s_axis_tvalid((state == S_UPDATE) && all_in), .s_axis_tready(ad_ready),
                .m_axis_p(pn), .m_axis_m(mn), .m_axis_v(vn), .m_axis_c(cn),
                .m_axis_tkeep(ad_keep), .m_axis_tlast(),
                .m_axis_tvalid(ad_valid), .m_axis_tready(all_out), .latency());
            /* verilator lint_on PINCONNECTEMPTY */

            l2l_axi_wr #(.LANES(LANES), .EW(32), .BURST(BURST), .FIFO_DEPTH(WR_FIFO)) u_wr_v (
                .clk(ap_clk), .rst(rst),
                .cmd_valid(wr_cmd_v), .cmd_ready(wc_rdy_v), .cmd_addr(r_v), .cmd_len(r_n),
                .s_axis_tdata(vn), .s_axis_tkeep(ad_keep), .s_axis_tvalid(out_fire), .s_axis_tready(wr_rdy_v),
                .idle(wr_idle_v),
                .m_axi_awid(m_axi_v_awid), .m_axi_awaddr(m_axi_v_awaddr), .m_axi_awlen(m_axi_v_awlen),
                .m_axi_awsize(m_axi_v_awsize), .m_axi_awburst(m_axi_v_awburst), .m_axi_awvalid(m_axi_v_awvalid),
                .m_axi_awready(m_axi_v_awready), .m_axi_wdata(m_axi_v_wdata), .m_axi_wstrb(m_axi_v_wstrb),
                .m_axi_wlast(m_axi_v_wlast), .m_axi_wvalid(m_axi_v_wvalid), .m_axi_wready(m_axi_v_wready),
                .m_axi_bid(m_axi_v_bid), .m_axi_bresp(m_axi_v_bresp), .m_axi_bvalid(m_axi_v_bvalid),
                .m_axi_bready(m_axi_v_bready));
        end else if (OPTIMIZER == 1) begin : g_lion
            // Lion's scalars are the words from 0x4C in LionScalars order: decay, b1, omb1, b2,
            // omb2 in AdamW's words, neg_lr in AdamW's inv_bc2_sqrt word (0x60), inv_scale in its
            // eps word (0x64; r_inv_scale, the reducer's)
            // tlast and latency left open (see the read engines above)
            /* verilator lint_off PINCONNECTEMPTY */
            l2l_eps_lion #(.LANES(LANES), .CDTYPE(CDTYPE), .DSP_SHAPE(DSP_SHAPE)) u_lion (
                .clk(ap_clk), .rst(rst),
                .decay(r_decay), .b1(r_b1), .omb1(r_omb1), .b2(r_b2), .omb2(r_omb2),
                .neg_lr(r_inv_bc2_sqrt),
                .s_axis_g(g_iso), .s_axis_p(p_tdata), .s_axis_m(m_tdata),
                .s_axis_tkeep(g_tkeep), .s_axis_decay(dmask), .s_axis_tlast(p_tlast),
                .s_axis_tvalid((state == S_UPDATE) && all_in), .s_axis_tready(ad_ready),
                .m_axis_p(pn), .m_axis_m(mn), .m_axis_c(cn),
                .m_axis_tkeep(ad_keep), .m_axis_tlast(),
                .m_axis_tvalid(ad_valid), .m_axis_tready(all_out), .latency());
            /* verilator lint_on PINCONNECTEMPTY */

            // no v: its stream is always there and always taken, its commands taken at once, its
            // master never asks (a response would still be watched for errors above)
            assign v_tvalid  = 1'b1;
            assign rd_rdy_v  = 1'b1;
            assign wc_rdy_v  = 1'b1;
            assign wr_rdy_v  = 1'b1;
            assign wr_idle_v = 1'b1;
            assign m_axi_v_awid    = 1'b0;
            assign m_axi_v_awaddr  = 64'd0;
            assign m_axi_v_awlen   = 8'd0;
            assign m_axi_v_awsize  = 3'd0;
            assign m_axi_v_awburst = 2'b01;
            assign m_axi_v_awvalid = 1'b0;
            assign m_axi_v_wdata   = {C_M_AXI_DATA_WIDTH{1'b0}};
            assign m_axi_v_wstrb   = {(C_M_AXI_DATA_WIDTH / 8){1'b0}};
            assign m_axi_v_wlast   = 1'b0;
            assign m_axi_v_wvalid  = 1'b0;
            assign m_axi_v_bready  = 1'b1;
            assign m_axi_v_arid    = 1'b0;
            assign m_axi_v_araddr  = 64'd0;
            assign m_axi_v_arlen   = 8'd0;
            assign m_axi_v_arsize  = 3'd0;
            assign m_axi_v_arburst = 2'b01;
            assign m_axi_v_arvalid = 1'b0;
            assign m_axi_v_rready  = 1'b1;
        end else begin : g_lamb
            // LAMB's nine scalars are the words from 0x4C in LambScalars order: b1 .. wd in
            // AdamW's decay .. neg_step words, inv_scale in AdamW's (0x6C, r_inv_scale)
            wire [DW-1:0]       v_tdata, vn;
            wire [CW*LANES-1:0] seg_tdata;
            wire [LANES-1:0]    seg_tkeep;
            wire                seg_tvalid, seg_tready;
            wire [31:0]         seg_len = (CDTYPE == 0) ? r_nseg : (r_nseg << 1);   // in copy elements

            // idle, tkeep and tlast left open (see the read engines above)
            /* verilator lint_off PINCONNECTEMPTY */
            l2l_axi_rd #(.LANES(LANES), .EW(32), .BURST(BURST), .FIFO_DEPTH(RD_FIFO), .REALIGN(0)) u_rd_v (
                .clk(ap_clk), .rst(rst),
                .cmd_valid(rd_cmd_v), .cmd_ready(rd_rdy_v), .cmd_addr(r_v), .cmd_len(r_n),
                .m_axis_tdata(v_tdata), .m_axis_tkeep(), .m_axis_tlast(),
                .m_axis_tvalid(v_tvalid), .m_axis_tready(join_fire), .idle(),
                .m_axi_arid(m_axi_v_arid), .m_axi_araddr(m_axi_v_araddr), .m_axi_arlen(m_axi_v_arlen),
                .m_axi_arsize(m_axi_v_arsize), .m_axi_arburst(m_axi_v_arburst), .m_axi_arvalid(m_axi_v_arvalid),
                .m_axi_arready(m_axi_v_arready), .m_axi_rid(m_axi_v_rid), .m_axi_rdata(m_axi_v_rdata),
                .m_axi_rresp(m_axi_v_rresp), .m_axi_rlast(m_axi_v_rlast), .m_axi_rvalid(m_axi_v_rvalid),
                .m_axi_rready(m_axi_v_rready));

            // the segment ends seg[1 ..], on copy's read channels (idle but for them)
            l2l_axi_rd #(.LANES(LANES), .EW(CW), .BURST(BURST), .FIFO_DEPTH(RD_FIFO)) u_rd_seg (
                .clk(ap_clk), .rst(rst),
                .cmd_valid(rd_cmd_seg), .cmd_ready(seg_cmd_ready), .cmd_addr(r_seg + 64'd4), .cmd_len(seg_len),
                .m_axis_tdata(seg_tdata), .m_axis_tkeep(seg_tkeep), .m_axis_tlast(),
                .m_axis_tvalid(seg_tvalid), .m_axis_tready(seg_tready), .idle(),
                .m_axi_arid(m_axi_copy_arid), .m_axi_araddr(m_axi_copy_araddr), .m_axi_arlen(m_axi_copy_arlen),
                .m_axi_arsize(m_axi_copy_arsize), .m_axi_arburst(m_axi_copy_arburst),
                .m_axi_arvalid(m_axi_copy_arvalid), .m_axi_arready(m_axi_copy_arready), .m_axi_rid(m_axi_copy_rid),
                .m_axi_rdata(m_axi_copy_rdata), .m_axi_rresp(m_axi_copy_rresp), .m_axi_rlast(m_axi_copy_rlast),
                .m_axi_rvalid(m_axi_copy_rvalid), .m_axi_rready(m_axi_copy_rready));
            /* verilator lint_on PINCONNECTEMPTY */

            l2l_eps_lamb #(.LANES(LANES), .GDTYPE(GDTYPE), .CDTYPE(CDTYPE), .DSP_SHAPE(DSP_SHAPE)) u_lamb (
                .clk(ap_clk), .rst(rst), .start(lamb_start), .pass2(r_pass2), .n(r_n),
                .b1(r_decay), .omb1(r_b1), .b2(r_omb1), .omb2(r_b2), .inv_bc2_sqrt(r_omb2),
                .eps(r_inv_bc2_sqrt), .inv_bc1(r_eps), .wd(r_neg_step),
                .s_axis_g(g_iso), .s_axis_p(p_tdata), .s_axis_m(m_tdata), .s_axis_v(v_tdata),
                .s_axis_tkeep(p_tkeep), .s_axis_decay(dmask),
                .s_axis_tvalid((state == S_UPDATE) && all_in), .s_axis_tready(ad_ready),
                .s_seg_tdata(seg_tdata), .s_seg_tkeep(seg_tkeep), .s_seg_tvalid(seg_tvalid),
                .s_seg_tready(seg_tready),
                .s_step_tdata(gr_tdata), .s_step_tkeep(gr_tkeep), .s_step_tvalid(gr_tvalid && lamb2),
                .s_step_tready(st_in_ready),
                .m_axis_p(pn), .m_axis_m(mn), .m_axis_v(vn), .m_axis_c(cn), .m_axis_tkeep(ad_keep),
                .m_axis_tvalid(ad_valid), .m_axis_tready(all_out),
                .m_sums_tdata(sums_tdata), .m_sums_tvalid(sums_tvalid), .m_sums_tready(wr_rdy_p));

            l2l_axi_wr #(.LANES(LANES), .EW(32), .BURST(BURST), .FIFO_DEPTH(WR_FIFO)) u_wr_v (
                .clk(ap_clk), .rst(rst),
                .cmd_valid(wr_cmd_v), .cmd_ready(wc_rdy_v), .cmd_addr(r_v), .cmd_len(r_n),
                .s_axis_tdata(vn), .s_axis_tkeep(ad_keep), .s_axis_tvalid(wv_m), .s_axis_tready(wr_rdy_v),
                .idle(wr_idle_v),
                .m_axi_awid(m_axi_v_awid), .m_axi_awaddr(m_axi_v_awaddr), .m_axi_awlen(m_axi_v_awlen),
                .m_axi_awsize(m_axi_v_awsize), .m_axi_awburst(m_axi_v_awburst), .m_axi_awvalid(m_axi_v_awvalid),
                .m_axi_awready(m_axi_v_awready), .m_axi_wdata(m_axi_v_wdata), .m_axi_wstrb(m_axi_v_wstrb),
                .m_axi_wlast(m_axi_v_wlast), .m_axi_wvalid(m_axi_v_wvalid), .m_axi_wready(m_axi_v_wready),
                .m_axi_bid(m_axi_v_bid), .m_axi_bresp(m_axi_v_bresp), .m_axi_bvalid(m_axi_v_bvalid),
                .m_axi_bready(m_axi_v_bready));
        end
    endgenerate

    // not LAMB: no sums, no step sizes, no segment ends, copy's read channels tied off
    generate
        if (!LAMB) begin : g_no_lamb
            assign sums_tdata    = {DW{1'b0}};
            assign sums_tvalid   = 1'b0;
            assign st_in_ready   = 1'b0;
            assign seg_cmd_ready = 1'b1;
            assign m_axi_copy_arid    = 1'b0;
            assign m_axi_copy_araddr  = 64'd0;
            assign m_axi_copy_arlen   = 8'd0;
            assign m_axi_copy_arsize  = 3'd0;
            assign m_axi_copy_arburst = 2'b01;
            assign m_axi_copy_arvalid = 1'b0;
            assign m_axi_copy_rready  = 1'b1;
        end
    endgenerate

    // ------------------------------------------------------------ write engines
    // (v's is AdamW's, in the optimizer's block above)

    // the flag write shares m_axi_p's write channels with the p write engine (never at once)
    wire        flag_phase = (state == S_FLAG);
    reg         fl_awvalid, fl_wvalid, fl_done;
    reg  [31:0] fl_word;
    wire [0:0]  pe_awid;
    wire [63:0] pe_awaddr;
    wire [7:0]  pe_awlen;
    wire [2:0]  pe_awsize;
    wire [1:0]  pe_awburst;
    wire        pe_awvalid;
    wire [DW-1:0]   pe_wdata;
    wire [BB-1:0]   pe_wstrb;
    wire        pe_wlast, pe_wvalid, pe_bready;

    l2l_axi_wr #(.LANES(LANES), .EW(32), .BURST(BURST), .FIFO_DEPTH(WR_FIFO)) u_wr_p (
        .clk(ap_clk), .rst(rst),
        .cmd_valid(wr_cmd_p), .cmd_ready(wc_rdy_p),
        .cmd_addr(lamb1 ? r_sums : r_p), .cmd_len(lamb1 ? (r_nseg << 5) : r_n),   // 32 sums a segment
        .s_axis_tdata(lamb1 ? sums_tdata : pn), .s_axis_tkeep(lamb1 ? {LANES{1'b1}} : ad_keep),
        .s_axis_tvalid(wv_p), .s_axis_tready(wr_rdy_p),
        .idle(wr_idle_p),
        .m_axi_awid(pe_awid), .m_axi_awaddr(pe_awaddr), .m_axi_awlen(pe_awlen), .m_axi_awsize(pe_awsize),
        .m_axi_awburst(pe_awburst), .m_axi_awvalid(pe_awvalid), .m_axi_awready(m_axi_p_awready && !flag_phase),
        .m_axi_wdata(pe_wdata), .m_axi_wstrb(pe_wstrb), .m_axi_wlast(pe_wlast), .m_axi_wvalid(pe_wvalid),
        .m_axi_wready(m_axi_p_wready && !flag_phase), .m_axi_bid(m_axi_p_bid), .m_axi_bresp(m_axi_p_bresp),
        .m_axi_bvalid(m_axi_p_bvalid && !flag_phase), .m_axi_bready(pe_bready));

    // the flag word's byte lanes in p's beat (the flag address is 4-byte aligned)
    // shifted at 16 lanes' width: below LANES = 16 only the low BB bits are the beat's
    /* verilator lint_off UNUSEDSIGNAL */
    wire [63:0] fl_strb = 64'hF << (r_finite[5:0] & FL_MSK[5:0]);
    /* verilator lint_on UNUSEDSIGNAL */
    assign m_axi_p_awid    = pe_awid;
    assign m_axi_p_awaddr  = flag_phase ? {r_finite[63:BBL], {BBL{1'b0}}} : pe_awaddr;
    assign m_axi_p_awlen   = flag_phase ? 8'd0 : pe_awlen;
    assign m_axi_p_awsize  = pe_awsize;
    assign m_axi_p_awburst = pe_awburst;
    assign m_axi_p_awvalid = flag_phase ? fl_awvalid : pe_awvalid;
    assign m_axi_p_wdata   = flag_phase ? {LANES{fl_word}} : pe_wdata;
    assign m_axi_p_wstrb   = flag_phase ? fl_strb[BB-1:0] : pe_wstrb;
    assign m_axi_p_wlast   = flag_phase ? 1'b1 : pe_wlast;
    assign m_axi_p_wvalid  = flag_phase ? fl_wvalid : pe_wvalid;
    assign m_axi_p_bready  = flag_phase ? 1'b1 : pe_bready;

    l2l_axi_wr #(.LANES(LANES), .EW(32), .BURST(BURST), .FIFO_DEPTH(WR_FIFO)) u_wr_m (
        .clk(ap_clk), .rst(rst),
        .cmd_valid(wr_cmd_m), .cmd_ready(wc_rdy_m), .cmd_addr(r_m), .cmd_len(r_n),
        .s_axis_tdata(mn), .s_axis_tkeep(ad_keep), .s_axis_tvalid(wv_m), .s_axis_tready(wr_rdy_m),
        .idle(wr_idle_m),
        .m_axi_awid(m_axi_m_awid), .m_axi_awaddr(m_axi_m_awaddr), .m_axi_awlen(m_axi_m_awlen),
        .m_axi_awsize(m_axi_m_awsize), .m_axi_awburst(m_axi_m_awburst), .m_axi_awvalid(m_axi_m_awvalid),
        .m_axi_awready(m_axi_m_awready), .m_axi_wdata(m_axi_m_wdata), .m_axi_wstrb(m_axi_m_wstrb),
        .m_axi_wlast(m_axi_m_wlast), .m_axi_wvalid(m_axi_m_wvalid), .m_axi_wready(m_axi_m_wready),
        .m_axi_bid(m_axi_m_bid), .m_axi_bresp(m_axi_m_bresp), .m_axi_bvalid(m_axi_m_bvalid),
        .m_axi_bready(m_axi_m_bready));

    // the copy port has the copy's element width: its bursts carry BURST beats of CW*LANES bits
    l2l_axi_wr #(.LANES(LANES), .EW(CW), .BURST(BURST), .FIFO_DEPTH(WR_FIFO)) u_wr_c (
        .clk(ap_clk), .rst(rst),
        .cmd_valid(wr_cmd_c), .cmd_ready(wc_rdy_c), .cmd_addr(r_copy), .cmd_len(r_n),
        .s_axis_tdata(cn), .s_axis_tkeep(ad_keep), .s_axis_tvalid(wv_c), .s_axis_tready(wr_rdy_c),
        .idle(wr_idle_c),
        .m_axi_awid(m_axi_copy_awid), .m_axi_awaddr(m_axi_copy_awaddr), .m_axi_awlen(m_axi_copy_awlen),
        .m_axi_awsize(m_axi_copy_awsize), .m_axi_awburst(m_axi_copy_awburst),
        .m_axi_awvalid(m_axi_copy_awvalid), .m_axi_awready(m_axi_copy_awready),
        .m_axi_wdata(m_axi_copy_wdata), .m_axi_wstrb(m_axi_copy_wstrb), .m_axi_wlast(m_axi_copy_wlast),
        .m_axi_wvalid(m_axi_copy_wvalid), .m_axi_wready(m_axi_copy_wready), .m_axi_bid(m_axi_copy_bid),
        .m_axi_bresp(m_axi_copy_bresp), .m_axi_bvalid(m_axi_copy_bvalid), .m_axi_bready(m_axi_copy_bready));

    // unused channels, tied off
    assign m_axi_gr_awid    = 1'b0;
    assign m_axi_gr_awaddr  = 64'd0;
    assign m_axi_gr_awlen   = 8'd0;
    assign m_axi_gr_awsize  = 3'd0;
    assign m_axi_gr_awburst = 2'b01;
    assign m_axi_gr_awvalid = 1'b0;
    assign m_axi_gr_wdata   = {C_M_AXI_GR_DATA_WIDTH{1'b0}};
    assign m_axi_gr_wstrb   = {(C_M_AXI_GR_DATA_WIDTH / 8){1'b0}};
    assign m_axi_gr_wlast   = 1'b0;
    assign m_axi_gr_wvalid  = 1'b0;
    assign m_axi_gr_bready  = 1'b1;
    // (copy's read channels: tied off in the optimizer's block above, but for LAMB's segment ends)

    // ------------------------------------------------------------ sequencer
    wire writes_idle = !wr_cmd_p && !wr_cmd_m && !wr_cmd_v && !wr_cmd_c &&
                       wr_idle_p && wr_idle_m && wr_idle_v && wr_idle_c;
    reg  upd_started;

    always @(posedge ap_clk) begin
        if (rst) begin
            state      <= S_IDLE;
            flag_clear <= 1'b0;
            gen_start  <= 1'b0;
            fl_awvalid <= 1'b0;
            fl_wvalid  <= 1'b0;
            fl_done    <= 1'b0;
            fl_word    <= 32'd0;
            rd_cmd_p   <= 1'b0;
            rd_cmd_m   <= 1'b0;
            rd_cmd_v   <= 1'b0;
            wr_cmd_p   <= 1'b0;
            wr_cmd_m   <= 1'b0;
            wr_cmd_v   <= 1'b0;
            wr_cmd_c   <= 1'b0;
            rd_cmd_st  <= 1'b0;
            rd_cmd_seg <= 1'b0;
            lamb_start <= 1'b0;
            upd_started <= 1'b0;
            chk_left   <= 32'd0;
            dma_err    <= 1'b0;
            dec_left   <= 32'd0;
            dmask      <= {LANES{1'b0}};
        end else begin
            if (resp_err) dma_err <= 1'b1;
            flag_clear <= 1'b0;
            gen_start  <= 1'b0;
            if (rd_cmd_p && rd_rdy_p) rd_cmd_p <= 1'b0;
            if (rd_cmd_m && rd_rdy_m) rd_cmd_m <= 1'b0;
            if (rd_cmd_v && rd_rdy_v) rd_cmd_v <= 1'b0;
            if (wr_cmd_p && wc_rdy_p) wr_cmd_p <= 1'b0;
            if (wr_cmd_m && wc_rdy_m) wr_cmd_m <= 1'b0;
            if (wr_cmd_v && wc_rdy_v) wr_cmd_v <= 1'b0;
            if (wr_cmd_c && wc_rdy_c) wr_cmd_c <= 1'b0;
            if (rd_cmd_st && gr_cmd_ready && !gen_active) rd_cmd_st <= 1'b0;
            if (rd_cmd_seg && seg_cmd_ready) rd_cmd_seg <= 1'b0;
            lamb_start <= 1'b0;
            if (join_fire) begin                  // a beat went in: the next one's decay bits
                dec_left <= dec_next;
                dmask    <= dmask_from;
            end
            case (state)
                S_IDLE: if (ap_start) begin
                    dma_err <= 1'b0;              // a new run: the last one's errors are read by now
                    r_gr   <= a_gr;   r_p <= a_p;   r_m <= a_m;   r_v <= a_v;
                    r_copy <= a_copy; r_finite <= a_finite;
                    r_n    <= a_n;    r_k <= a_k[7:0];    r_n_decay <= a_n_decay;
                    r_decay <= a_decay; r_b1 <= a_b1; r_omb1 <= a_omb1; r_b2 <= a_b2; r_omb2 <= a_omb2;
                    r_inv_bc2_sqrt <= a_inv_bc2_sqrt; r_eps <= a_eps; r_neg_step <= a_neg_step;
                    r_inv_scale <= (OPTIMIZER == 1) ? a_eps : a_inv_scale;   // 0x64 (Lion) or 0x6C
                    r_pass2 <= (a_pass == 32'd2);
                    r_seg   <= a_seg;  r_sums <= a_sums;  r_steps <= a_steps;  r_nseg <= a_nseg;
                    lamb_start <= LAMB;
                    chk_left <= (a_n >> clog2(LANES)) + ((a_n & (LANES - 1)) != 0);
                    if (LAMB && a_pass == 32'd2) begin
                        // the step pass: no check, no flag (the host runs it after a finite pass 1)
                        state <= (a_n != 0) ? S_GO : S_DONE;
                    end else if (k_ok && a_n != 0) begin
                        flag_clear <= 1'b1;
                        gen_start  <= 1'b1;
                        state      <= S_CHECK;
                    end else begin
                        fl_word    <= {31'd0, (a_n == 0) && k_ok};
                        fl_awvalid <= 1'b1;
                        fl_wvalid  <= 1'b1;
                        fl_done    <= 1'b0;
                        state      <= S_FLAG;
                    end
                end
                S_CHECK: if (chk_beat) begin
                    chk_left <= chk_left - 32'd1;
                    if (chk_left == 32'd1)
                        state <= S_SAMPLE;        // the flag is final one edge after the last beat
                end
                S_SAMPLE: begin
                    fl_word    <= {31'd0, red_finite && !dma_err_now};   // a bad gradient read: skip
                    fl_awvalid <= 1'b1;
                    fl_wvalid  <= 1'b1;
                    fl_done    <= 1'b0;
                    state      <= S_FLAG;
                end
                S_FLAG: begin
                    if (m_axi_p_awready) fl_awvalid <= 1'b0;
                    if (m_axi_p_wready)  fl_wvalid  <= 1'b0;
                    if (m_axi_p_bvalid)  fl_done    <= 1'b1;
                    if (fl_done) begin
                        if (fl_word[0] && !dma_err_now) begin
                            rd_cmd_p <= 1'b1; rd_cmd_m <= 1'b1; rd_cmd_v <= 1'b1;
                            wr_cmd_p <= 1'b1; wr_cmd_m <= 1'b1; wr_cmd_v <= 1'b1; wr_cmd_c <= !LAMB;
                            rd_cmd_seg  <= LAMB;          // LAMB's norms pass: p's engine writes the sums
                            upd_started <= 1'b0;
                            gen_start   <= 1'b1;
                            dec_left    <= r_n_decay;     // the first beat's decay bits
                            dmask       <= dmask_from;
                            state <= S_UPDATE;
                        end else begin
                            state <= S_DONE;
                        end
                    end
                end
                S_GO: begin                       // LAMB's step pass: p, m', v' in; p', copy out
                    rd_cmd_p <= 1'b1; rd_cmd_m <= 1'b1; rd_cmd_v <= 1'b1;
                    wr_cmd_p <= 1'b1; wr_cmd_c <= 1'b1;
                    rd_cmd_seg  <= 1'b1;
                    rd_cmd_st   <= 1'b1;
                    upd_started <= 1'b0;
                    dec_left    <= r_n_decay;
                    dmask       <= dmask_from;
                    state       <= S_UPDATE;
                end
                S_UPDATE: begin
                    upd_started <= 1'b1;          // the write commands are seen pending first
                    if (upd_started && writes_idle && !gen_active)
                        state <= S_DONE;
                end
                default: state <= S_IDLE;      // S_DONE: ap_done for this one clock
            endcase
        end
    end

endmodule

`default_nettype wire
