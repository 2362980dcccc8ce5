// l2l_axi_wr -- AXI4 burst write engine: an AXI-Stream of LANES-element beats
// in, written to a contiguous, beat-aligned range of memory.
//
// What: a command names the beat-aligned byte address `cmd_addr` (its low
// log2(beat bytes) bits are ignored) and `cmd_len` (>= 1) elements; the engine
// takes the next ceil(cmd_len / LANES) beats of s_axis and writes them there
// with INCR bursts of at most BURST beats that never cross a BURST-beat
// boundary (so never 4 KiB: BURST * beat bytes <= 4096 is checked). Lanes with
// tkeep low are not written (wstrb low): the tail of a layer whose n is not a
// multiple of LANES leaves the memory beyond it untouched. tlast is ignored:
// the command's length delimits the stream. `idle` is high once every burst
// of every accepted command has its write response.
//
// Why: the EPS kernel writes p', m', v' and the device copy back in place,
// each from the AdamW datapath's output stream, each on its own AXI master.
// A burst address is issued only when all its data are already in the
// engine's FIFO, so W never waits on the stream once a burst is announced
// (an interconnect or HBM controller is never held by a half-fed burst) and
// bursts go out back to back while the stream keeps up. Several bursts may
// await their write responses (up to MAX_OUT); bresp is not looked at here:
// the kernel watches every response on its ports (l2l_eps_kernel, status).
`default_nettype none

module l2l_axi_wr #(
    parameter LANES      = 1,    // elements per beat, a power of two, 1 .. 64
    parameter EW         = 32,   // element width in bits: 16 or 32
    parameter BURST      = 64,   // beats per burst at most, a power of two, 1 .. 256
    parameter FIFO_DEPTH = 128,  // write buffer in beats, a power of two >= BURST and >= 2
    parameter MAX_OUT    = 32,   // bursts awaiting a write response at most, 1 .. 255
    parameter LEN_W      = 32    // bits of cmd_len, log2(BURST) + 1 .. 48
) (
    input  wire                  clk,
    input  wire                  rst,          // synchronous, active high
    input  wire                  cmd_valid,
    output wire                  cmd_ready,
    // the bits below the beat are not looked at
    /* verilator lint_off UNUSEDSIGNAL */
    input  wire [63:0]           cmd_addr,     // beat-aligned byte address
    /* verilator lint_on UNUSEDSIGNAL */
    input  wire [LEN_W-1:0]      cmd_len,      // elements, >= 1
    input  wire [EW*LANES-1:0]   s_axis_tdata,
    input  wire [LANES-1:0]      s_axis_tkeep,
    input  wire                  s_axis_tvalid,
    output wire                  s_axis_tready,
    output wire                  idle,
    // AXI4 write channels
    output wire [0:0]            m_axi_awid,
    output reg  [63:0]           m_axi_awaddr,
    output reg  [7:0]            m_axi_awlen,
    output wire [2:0]            m_axi_awsize,
    output wire [1:0]            m_axi_awburst,
    output reg                   m_axi_awvalid,
    input  wire                  m_axi_awready,
    output wire [EW*LANES-1:0]   m_axi_wdata,
    output wire [EW*LANES/8-1:0] m_axi_wstrb,
    output wire                  m_axi_wlast,
    output wire                  m_axi_wvalid,
    input  wire                  m_axi_wready,
    // bid, bresp: part of the AXI4 port, not needed here: one ID, and the kernel watches
    // bresp itself
    /* verilator lint_off UNUSEDSIGNAL */
    input  wire [0:0]            m_axi_bid,
    input  wire [1:0]            m_axi_bresp,
    /* verilator lint_on UNUSEDSIGNAL */
    input  wire                  m_axi_bvalid,
    output wire                  m_axi_bready
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

    localparam DW  = EW * LANES;
    localparam BB  = DW / 8;
    localparam EB  = EW / 8;
    localparam BBL = clog2(BB);
    localparam LL  = clog2(LANES);
    localparam BL  = clog2(BURST);
    localparam CW  = LEN_W + 1;
    localparam FW  = clog2(FIFO_DEPTH) + 1;   // FIFO count width: 0 .. FIFO_DEPTH + 1
    localparam [BL:0] BURST_B = BURST[BL:0];     // BURST and its in-burst beat mask, BL + 1 bits
    localparam [BL:0] BMASK   = BURST_B - 1'b1;

    initial begin
        if (LANES < 1 || LANES > 64 || (LANES & (LANES - 1)) != 0 || (EW != 16 && EW != 32) ||
            BURST < 1 || BURST > 256 || (BURST & (BURST - 1)) != 0 || BURST * BB > 4096 ||
            FIFO_DEPTH < 2 || FIFO_DEPTH < BURST || (FIFO_DEPTH & (FIFO_DEPTH - 1)) != 0 ||
            MAX_OUT < 1 || MAX_OUT > 255 || LEN_W <= BL || LEN_W > 48) begin
            $error("l2l_axi_wr: illegal parameters LANES=%0d EW=%0d BURST=%0d FIFO_DEPTH=%0d MAX_OUT=%0d LEN_W=%0d",
                   LANES, EW, BURST, FIFO_DEPTH, MAX_OUT, LEN_W);
            $finish;
        end
    end

    // ------------------------------------------------------------ data buffer (beat, strobes)
    wire [BB-1:0] strb;
    genvar i;
    generate
        for (i = 0; i < LANES; i = i + 1) begin : g_strb
            assign strb[i*EB +: EB] = {EB{s_axis_tkeep[i]}};
        end
    endgenerate

    wire          d_valid;
    wire          d_ready;
    wire [DW+BB-1:0] d_data;
    wire [FW-1:0] d_count;

    l2l_fifo #(.WIDTH(DW + BB), .AW(clog2(FIFO_DEPTH))) u_buf (
        .clk(clk), .rst(rst),
        .s_valid(s_axis_tvalid), .s_ready(s_axis_tready), .s_data({strb, s_axis_tdata}),
        .m_valid(d_valid), .m_ready(d_ready), .m_data(d_data), .count(d_count));

    // ------------------------------------------------------------ bursts
    reg  [CW-1:0] aw_left;       // beats of the current command not yet announced
    reg  [63:0]   aw_next;
    reg  [FW-1:0] committed;     // beats announced on AW, not yet sent on W
    reg  [7:0]    out_b;         // bursts announced, write response not yet back

    wire          lq_s_ready;    // burst lengths, AW side -> W side
    wire          lq_valid;
    wire          lq_ready;
    wire [8:0]    lq_data;

    wire [BL:0]   to_edge  = BURST_B - (aw_next[BBL +: BL + 1] & BMASK);  // beats to the burst boundary
    wire [CW-1:0] to_edge_c = {{(CW - BL - 1){1'b0}}, to_edge};
    wire [CW-1:0] blen     = (aw_left < to_edge_c) ? aw_left : to_edge_c;
    wire          have     = {{(CW + 1 - FW){1'b0}}, d_count} >= ({{(CW + 1 - FW){1'b0}}, committed} + {1'b0, blen});
    wire          aw_issue = (aw_left != 0) && (!m_axi_awvalid || m_axi_awready) && have &&
                             lq_s_ready && (out_b < MAX_OUT);

    assign cmd_ready = (aw_left == 0);
    wire   cmd_take  = cmd_valid && cmd_ready;
    wire   w_beat    = m_axi_wvalid && m_axi_wready;
    wire   b_take    = m_axi_bvalid && m_axi_bready;

    assign m_axi_awid    = 1'b0;
    assign m_axi_awsize  = BBL[2:0];
    assign m_axi_awburst = 2'b01;            // INCR
    assign m_axi_bready  = 1'b1;

    always @(posedge clk) begin
        if (rst) begin
            aw_left       <= {CW{1'b0}};
            aw_next       <= 64'd0;
            m_axi_awvalid <= 1'b0;
            m_axi_awaddr  <= 64'd0;
            m_axi_awlen   <= 8'd0;
            committed     <= {FW{1'b0}};
            out_b         <= 8'd0;
        end else begin
            if (cmd_take) begin
                aw_left <= ({1'b0, cmd_len} + (LANES - 1)) >> LL;
                aw_next <= {cmd_addr[63:BBL], {BBL{1'b0}}};
            end else if (aw_issue) begin
                aw_left <= aw_left - blen;
                aw_next <= aw_next + ({{(64 - CW){1'b0}}, blen} << BBL);
            end
            if (aw_issue) begin
                m_axi_awvalid <= 1'b1;
                m_axi_awaddr  <= aw_next;
                m_axi_awlen   <= blen[7:0] - 8'd1;
            end else if (m_axi_awready) begin
                m_axi_awvalid <= 1'b0;
            end
            committed <= committed + (aw_issue ? blen[FW-1:0] : {FW{1'b0}}) - {{(FW - 1){1'b0}}, w_beat};
            out_b     <= out_b + {7'd0, aw_issue} - {7'd0, b_take};
        end
    end

    // its count is not needed: lq_s_ready alone gates the next burst
    /* verilator lint_off PINCONNECTEMPTY */
    l2l_fifo #(.WIDTH(9), .AW(2)) u_lenq (
        .clk(clk), .rst(rst),
        .s_valid(aw_issue), .s_ready(lq_s_ready), .s_data(blen[8:0]),
        .m_valid(lq_valid), .m_ready(lq_ready), .m_data(lq_data), .count());
    /* verilator lint_on PINCONNECTEMPTY */

    // ------------------------------------------------------------ W
    reg       w_active;
    reg [8:0] w_left;            // beats of the current burst still to send

    wire w_end = w_beat && (w_left == 1);
    assign lq_ready = lq_valid && (!w_active || w_end);

    always @(posedge clk) begin
        if (rst) begin
            w_active <= 1'b0;
            w_left   <= 9'd0;
        end else if (lq_ready) begin
            w_active <= 1'b1;
            w_left   <= lq_data;
        end else if (w_end) begin
            w_active <= 1'b0;
        end else if (w_beat) begin
            w_left <= w_left - 9'd1;
        end
    end

    assign m_axi_wvalid = w_active && d_valid;
    assign m_axi_wdata  = d_data[DW-1:0];
    assign m_axi_wstrb  = d_data[DW +: BB];
    assign m_axi_wlast  = (w_left == 1);
    assign d_ready      = w_beat;

    assign idle = (aw_left == 0) && (out_b == 0);

endmodule

`default_nettype wire
