// l2l_axi_rd -- AXI4 burst read engine: element ranges of memory in, an
// AXI-Stream of LANES-element beats out, realigned to lane 0.
//
// What: each command names a range of `cmd_len` (>= 1) elements of EW bits
// starting at byte address `cmd_addr` (a multiple of EW/8, otherwise free;
// with REALIGN = 0 a multiple of the beat, for a smaller engine).
// The engine reads the beat-aligned span covering the range with INCR bursts
// of at most BURST beats that never cross a BURST-beat boundary (so never a
// 4 KiB one: BURST * beat bytes <= 4096 is checked), and streams the range
// out as ceil(cmd_len / LANES) beats: element j of the range in lane j mod
// LANES, tkeep set on the lanes that hold range elements (all but the tail of
// the last beat), tlast on the last beat of each command. Commands are
// streamed in order, back to back.
//
// Why: the EPS kernel reads the K gradient contributions of a layer block by
// block (contribution c of block b starts at element c*n + b*BLOCK*LANES),
// and n need not be a multiple of LANES, so a segment may start in the middle
// of a beat. The realigner shifts it to lane 0 (one bubble per command that
// starts mid-beat; none for aligned commands). p, m, v are read as one
// command of n elements each.
//
// Throughput: reads are issued ahead of the stream, several bursts in flight,
// limited by credits: a burst is requested only when the read buffer (FIFO of
// FIFO_DEPTH beats) has room for all of it and every burst before it, so the
// R channel is never back-pressured by the engine and a memory with latency L
// cycles keeps the stream at one beat per clock when FIFO_DEPTH >= L + BURST.
// One AXI ID (0): data return in order. rresp is not looked at here (an
// error response delivers whatever data the slave gives): the kernel watches
// every response on its ports and reports errors (l2l_eps_kernel, status).
`default_nettype none

module l2l_axi_rd #(
    parameter LANES      = 1,    // elements per beat, a power of two, 1 .. 64
    parameter EW         = 32,   // element width in bits: 16 or 32
    parameter BURST      = 64,   // beats per burst at most, a power of two, 1 .. 256
    parameter FIFO_DEPTH = 256,  // read buffer in beats, a power of two >= BURST and >= 2
    parameter CMD_DEPTH  = 4,    // commands in flight, a power of two >= 2
    parameter LEN_W      = 32,   // bits of cmd_len, log2(BURST) + 1 .. 48
    parameter REALIGN    = 1     // 1: any element address; 0: beat-aligned addresses only (the
                                 //    low address bits are ignored, no realigning shifter is built)
) (
    input  wire                  clk,
    input  wire                  rst,          // synchronous, active high
    // command: a range of elements
    input  wire                  cmd_valid,
    output wire                  cmd_ready,
    // bits below the element (REALIGN = 0: below the beat) are not looked at
    /* verilator lint_off UNUSEDSIGNAL */
    input  wire [63:0]           cmd_addr,     // byte address of the first element
    /* verilator lint_on UNUSEDSIGNAL */
    input  wire [LEN_W-1:0]      cmd_len,      // elements, >= 1
    // the range, LANES elements a beat
    output wire [EW*LANES-1:0]   m_axis_tdata,
    output wire [LANES-1:0]      m_axis_tkeep,
    output wire                  m_axis_tlast,
    output wire                  m_axis_tvalid,
    input  wire                  m_axis_tready,
    output wire                  idle,         // no command pending, nothing in flight
    // AXI4 read channels
    output wire [0:0]            m_axi_arid,
    output reg  [63:0]           m_axi_araddr,
    output reg  [7:0]            m_axi_arlen,
    output wire [2:0]            m_axi_arsize,
    output wire [1:0]            m_axi_arburst,
    output reg                   m_axi_arvalid,
    input  wire                  m_axi_arready,
    // rid, rresp, rlast: part of the AXI4 port, not needed here: one ID, so data return in
    // order; the kernel watches rresp itself; the engine counts beats instead of rlast
    /* verilator lint_off UNUSEDSIGNAL */
    input  wire [0:0]            m_axi_rid,
    /* verilator lint_on UNUSEDSIGNAL */
    input  wire [EW*LANES-1:0]   m_axi_rdata,
    /* verilator lint_off UNUSEDSIGNAL */
    input  wire [1:0]            m_axi_rresp,
    input  wire                  m_axi_rlast,
    /* verilator lint_on UNUSEDSIGNAL */
    input  wire                  m_axi_rvalid,
    output wire                  m_axi_rready
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

    localparam DW   = EW * LANES;             // bits per beat
    localparam BB   = DW / 8;                 // bytes per beat
    localparam BBL  = clog2(BB);
    localparam EBL  = clog2(EW / 8);         // log2 bytes per element
    localparam LL   = clog2(LANES);          // log2 lanes (0 for one lane)
    localparam OW   = (LL > 0) ? LL : 1;      // width of a lane offset
    localparam BL   = clog2(BURST);
    localparam CW   = LEN_W + 1;              // beat counts: up to ceil((LANES-1 + 2^LEN_W - 1) / LANES)
    localparam RW   = clog2(FIFO_DEPTH) + 1; // reserved-beat counter, 0 .. FIFO_DEPTH
    localparam [BL:0] BURST_B = BURST[BL:0];     // BURST and its in-burst beat mask, BL + 1 bits
    localparam [BL:0] BMASK   = BURST_B - 1'b1;
    localparam [RW-1:0] FIFO_R = FIFO_DEPTH[RW-1:0];  // at the reserved counter's width

    initial begin
        if (LANES < 1 || LANES > 64 || (LANES & (LANES - 1)) != 0 || (EW != 16 && EW != 32) ||
            BURST < 1 || BURST > 256 || (BURST & (BURST - 1)) != 0 || BURST * BB > 4096 ||
            FIFO_DEPTH < 2 || FIFO_DEPTH < BURST || (FIFO_DEPTH & (FIFO_DEPTH - 1)) != 0 ||
            CMD_DEPTH < 2 || (CMD_DEPTH & (CMD_DEPTH - 1)) != 0 || LEN_W <= BL || LEN_W > 48 ||
            (REALIGN != 0 && REALIGN != 1)) begin
            $error("l2l_axi_rd: illegal parameters LANES=%0d EW=%0d BURST=%0d FIFO_DEPTH=%0d CMD_DEPTH=%0d LEN_W=%0d REALIGN=%0d",
                   LANES, EW, BURST, FIFO_DEPTH, CMD_DEPTH, LEN_W, REALIGN);
            $finish;
        end
    end

    // ------------------------------------------------------------ command -> bursts
    reg  [CW-1:0] ar_left;       // beats of the current command not yet requested
    reg  [63:0]   ar_next;       // beat-aligned byte address of the next request
    reg  [RW-1:0] reserved;      // beats requested and not yet taken from the buffer

    wire [OW-1:0] c_off   = (LL > 0 && REALIGN != 0) ? cmd_addr[EBL +: OW] : {OW{1'b0}};
    wire [CW-1:0] c_lanes = {{(CW - OW){1'b0}}, c_off} + {1'b0, cmd_len} + (LANES - 1);
    wire [CW-1:0] c_raw   = c_lanes >> LL;                                  // beats read
    wire [CW-1:0] c_out   = ({1'b0, cmd_len} + (LANES - 1)) >> LL;          // beats streamed
    wire [OW-1:0] c_rem   = (LL > 0) ? cmd_len[OW-1:0] : {OW{1'b0}};
    wire [LANES-1:0] c_keep = (c_rem == 0) ? {LANES{1'b1}}
                                           : ~({LANES{1'b1}} << c_rem);    // lanes of the last beat

    localparam QW = OW + CW + CW + LANES;     // the realigner's view of a command
    wire          q_s_ready;
    wire          q_m_valid;
    wire          q_m_ready;
    wire [QW-1:0] q_m_data;

    assign cmd_ready = (ar_left == 0) && q_s_ready;
    wire   cmd_take  = cmd_valid && cmd_ready;

    // the FIFOs' counts are not needed: the engine keeps its own credit count (reserved)
    /* verilator lint_off PINCONNECTEMPTY */
    l2l_fifo #(.WIDTH(QW), .AW(clog2(CMD_DEPTH))) u_cmdq (
        .clk(clk), .rst(rst),
        .s_valid(cmd_take), .s_ready(q_s_ready), .s_data({c_off, c_out, c_raw, c_keep}),
        .m_valid(q_m_valid), .m_ready(q_m_ready), .m_data(q_m_data), .count());
    /* verilator lint_on PINCONNECTEMPTY */

    wire [BL:0]   to_edge  = BURST_B - (ar_next[BBL +: BL + 1] & BMASK);  // beats to the burst boundary
    wire [CW-1:0] to_edge_c = {{(CW - BL - 1){1'b0}}, to_edge};
    wire [CW-1:0] blen     = (ar_left < to_edge_c) ? ar_left : to_edge_c;
    wire          credit   = ({{(CW + 1 - RW){1'b0}}, reserved} + {1'b0, blen}) <= {{(CW + 1 - RW){1'b0}}, FIFO_R};
    wire          ar_issue = (ar_left != 0) && (!m_axi_arvalid || m_axi_arready) && credit;

    wire pop;                    // a beat leaves the read buffer

    assign m_axi_arid    = 1'b0;
    assign m_axi_arsize  = BBL[2:0];
    assign m_axi_arburst = 2'b01;            // INCR

    always @(posedge clk) begin
        if (rst) begin
            ar_left       <= {CW{1'b0}};
            ar_next       <= 64'd0;
            m_axi_arvalid <= 1'b0;
            m_axi_araddr  <= 64'd0;
            m_axi_arlen   <= 8'd0;
            reserved      <= {RW{1'b0}};
        end else begin
            if (cmd_take) begin
                ar_left <= c_raw;
                ar_next <= {cmd_addr[63:BBL], {BBL{1'b0}}};
            end else if (ar_issue) begin
                ar_left <= ar_left - blen;
                ar_next <= ar_next + ({{(64 - CW){1'b0}}, blen} << BBL);
            end
            if (ar_issue) begin
                m_axi_arvalid <= 1'b1;
                m_axi_araddr  <= ar_next;
                m_axi_arlen   <= blen[7:0] - 8'd1;
            end else if (m_axi_arready) begin
                m_axi_arvalid <= 1'b0;
            end
            reserved <= reserved + (ar_issue ? blen[RW-1:0] : {RW{1'b0}}) - {{(RW - 1){1'b0}}, pop};
        end
    end

    // ------------------------------------------------------------ read buffer
    wire          raw_valid;
    wire [DW-1:0] raw_data;

    /* verilator lint_off PINCONNECTEMPTY */
    l2l_fifo #(.WIDTH(DW), .AW(clog2(FIFO_DEPTH))) u_buf (
        .clk(clk), .rst(rst),
        .s_valid(m_axi_rvalid), .s_ready(m_axi_rready), .s_data(m_axi_rdata),
        .m_valid(raw_valid), .m_ready(pop), .m_data(raw_data), .count());
    /* verilator lint_on PINCONNECTEMPTY */

    // ------------------------------------------------------------ realigner
    reg              ra_active;
    reg  [OW-1:0]    ra_off;      // lane of the command's first element in its first beat
    reg  [CW-1:0]    ra_outs;     // beats still to stream
    reg  [CW-1:0]    ra_raws;     // beats still to take from the buffer
    reg  [LANES-1:0] ra_keep;
    reg              ra_held;     // hold has the previous beat (off != 0 only)
    reg  [DW-1:0]    hold;
    reg              o_valid, o_last;
    reg  [DW-1:0]    o_data;
    reg  [LANES-1:0] o_keep;

    wire can_emit = !o_valid || m_axis_tready;
    wire aligned  = (ra_off == 0);
    // an unaligned command's first beat only fills hold
    wire prime    = ra_active && !aligned && !ra_held && raw_valid;
    wire need_raw = aligned || (ra_raws != 0);
    wire emit     = ra_active && can_emit && (aligned ? raw_valid : (ra_held && (!need_raw || raw_valid)));
    assign pop    = (emit && need_raw) || prime;
    wire finish   = emit && (ra_outs == 1);
    wire load     = q_m_valid && (!ra_active || finish);
    assign q_m_ready = load;

    wire [DW-1:0]   cur  = need_raw ? raw_data : {DW{1'b0}};
    // the pair of beats shifted down by the offset: only its low beat is the output
    /* verilator lint_off UNUSEDSIGNAL */
    wire [2*DW-1:0] cat  = {cur, hold} >> (ra_off * EW);
    /* verilator lint_on UNUSEDSIGNAL */
    wire [DW-1:0]   outd = (aligned || REALIGN == 0) ? raw_data : cat[DW-1:0];

    always @(posedge clk) begin
        if (rst) begin
            ra_active <= 1'b0;
            ra_held   <= 1'b0;
            ra_off    <= {OW{1'b0}};
            ra_outs   <= {CW{1'b0}};
            ra_raws   <= {CW{1'b0}};
            ra_keep   <= {LANES{1'b0}};
            o_valid   <= 1'b0;
        end else begin
            if (load) begin
                ra_active <= 1'b1;
                ra_held   <= 1'b0;
                {ra_off, ra_outs, ra_raws, ra_keep} <= q_m_data;
            end else begin
                if (finish)
                    ra_active <= 1'b0;
                if (emit) begin
                    ra_outs <= ra_outs - 1'b1;
                    if (need_raw)
                        ra_raws <= ra_raws - 1'b1;
                end
                if (prime) begin
                    ra_held <= 1'b1;
                    ra_raws <= ra_raws - 1'b1;
                end
            end
            if (emit)
                o_valid <= 1'b1;
            else if (m_axis_tready)
                o_valid <= 1'b0;
        end
    end

    always @(posedge clk) begin
        if (pop)
            hold <= raw_data;
        if (emit) begin
            o_data <= outd;
            o_last <= (ra_outs == 1);
            o_keep <= (ra_outs == 1) ? ra_keep : {LANES{1'b1}};
        end
    end

    assign m_axis_tdata  = o_data;
    assign m_axis_tkeep  = o_keep;
    assign m_axis_tlast  = o_last;
    assign m_axis_tvalid = o_valid;

    assign idle = (ar_left == 0) && !m_axi_arvalid && (reserved == 0) && !q_m_valid &&
                  !ra_active && !o_valid;

endmodule

`default_nettype wire
